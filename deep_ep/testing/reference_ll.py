"""Reference model of low-latency dispatch and combine for a whole EP group.

Receive layout on rank ``d``: ``[L, R * T_ll, H]``, local expert ``l`` holding the tokens that
selected expert ``d * L + l``; ``n_s`` of them come from source rank ``s``.

* ``recv_layout="compact"`` (the default, DeepEP V1's layout): expert ``l``'s rows are packed in
  ``[0, count[l])``, ordered by (source rank ascending, source token ascending); source ``s``'s
  block starts at ``begin_s = n_0 + ... + n_{s-1}``.
* ``recv_layout="per_source"``: rows ``[s * T_ll, s * T_ll + n_s)`` hold source ``s``'s tokens in
  ascending token order (``begin_s = s * T_ll``).

The kernels leave the other rows undefined, so tests compare only the rows ``ll_valid_row_mask``
marks. Every row carries its origin (``src_rank``, ``src_token``, ``topk_slot``), which is how
``ll_combine`` finds the rows of either layout. Routing is taken through ``sanitize_topk_idx`` as in
the library: an id outside ``[-1, E)`` is -1, and an expert repeated within a row is sent (and
combined) once, in the slot of its first occurrence.
"""

from collections.abc import Sequence

import torch

from deep_ep._util import describe
from deep_ep.fp8 import FP8_GROUP_SIZE, per_token_cast_to_fp8
from deep_ep.testing.reference_inputs import (
    as_bytes_if_fp8,
    check_topk_idx,
    num_local_experts,
    sanitize_topk_idx,
)

__all__ = ["LL_RECV_LAYOUTS", "ll_dispatch", "ll_combine", "ll_valid_row_mask"]

LL_RECV_LAYOUTS = ("compact", "per_source")


def _check_token_count(name: str, num_tokens: int, num_max_tokens: int) -> None:
    if num_tokens > num_max_tokens:
        raise ValueError(f"{name} has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={num_max_tokens}")


def ll_dispatch(
    xs: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    num_experts: int,
    num_max_tokens: int,
    *,
    use_fp8: bool = True,
    round_scale: bool = False,
    recv_layout: str = "compact",
    dests: Sequence[int] | None = None,
) -> list[dict]:
    """What every rank receives, one dict per rank (per rank of ``dests`` when given, in its order:
    a caller holding one destination's payload at a time keeps its memory to one rank's):

    * ``x`` [L, R*T_ll, H] (fp8 or bf16) and ``x_scales`` fp32 [L, R*T_ll, H/128] (fp8 only, else
      None; powers of two with ``round_scale``), rows in ``recv_layout`` order; invalid rows are zero;
    * ``count`` int32 [L] and ``count_per_source`` int32 [L, R];
    * ``src_rank``, ``src_token`` and ``topk_slot`` int64 [L, R*T_ll]: where each row came from
      (-1 on invalid rows), in ``recv_layout`` order;
    * ``layout_range`` int64 [L, R]: ``(begin << 32) | count`` of each (local expert, source) block.
    """
    num_ranks = len(xs)
    num_local = num_local_experts(num_experts, num_ranks)
    if len(topk_idxs) != num_ranks:
        raise ValueError(f"topk_idxs must have one entry per rank ({num_ranks}), got {len(topk_idxs)}")
    if recv_layout not in LL_RECV_LAYOUTS:
        raise ValueError(f"recv_layout must be one of {LL_RECV_LAYOUTS}, got {recv_layout!r}")
    if round_scale and not use_fp8:
        raise ValueError("round_scale=True (power-of-two fp8 scales) needs use_fp8=True")
    hidden = xs[0].shape[-1]
    payloads, routing = [], []
    for rank, (x, topk_idx) in enumerate(zip(xs, topk_idxs, strict=True)):
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != hidden:
            raise ValueError(f"xs[{rank}] must be bfloat16 [T, {hidden}], got {describe(x)}")
        _check_token_count(f"xs[{rank}]", x.shape[0], num_max_tokens)
        check_topk_idx(f"topk_idxs[{rank}]", topk_idx, x.shape[0])
        routing.append(sanitize_topk_idx(topk_idx, num_experts))
        payload, payload_scales = per_token_cast_to_fp8(x, round_scale=round_scale) if use_fp8 else (x, None)
        payloads.append((as_bytes_if_fp8(payload), payload_scales))

    device, payload_dtype = xs[0].device, torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    num_slots = num_ranks * num_max_tokens
    results = []
    for dest in range(num_ranks) if dests is None else dests:
        x = torch.zeros(num_local, num_slots, hidden, dtype=payloads[0][0].dtype, device=device)
        scales = torch.zeros(num_local, num_slots, hidden // FP8_GROUP_SIZE, device=device) if use_fp8 else None
        src_rank = torch.full((num_local, num_slots), -1, dtype=torch.int64, device=device)
        src_token = torch.full_like(src_rank, -1)
        topk_slot = torch.full_like(src_rank, -1)
        count_per_source = torch.zeros(num_local, num_ranks, dtype=torch.int32, device=device)
        begin = torch.zeros(num_local, num_ranks, dtype=torch.int64, device=device)
        for local in range(num_local):
            next_compact_row = 0
            for source, (data, source_scales) in enumerate(payloads):
                tokens, slots = (routing[source] == dest * num_local + local).nonzero(as_tuple=True)
                first = next_compact_row if recv_layout == "compact" else source * num_max_tokens
                rows = slice(first, first + tokens.numel())
                x[local, rows] = data[tokens]
                if scales is not None:
                    scales[local, rows] = source_scales[tokens]
                src_rank[local, rows] = source
                src_token[local, rows] = tokens
                topk_slot[local, rows] = slots
                count_per_source[local, source] = tokens.numel()
                begin[local, source] = first
                next_compact_row += tokens.numel()
        results.append(
            {
                "x": x.view(payload_dtype),
                "x_scales": scales,
                "count": count_per_source.sum(dim=1, dtype=torch.int32),
                "count_per_source": count_per_source,
                "src_rank": src_rank,
                "src_token": src_token,
                "topk_slot": topk_slot,
                "layout_range": (begin << 32) | count_per_source.to(torch.int64),
            }
        )
    return results


def ll_valid_row_mask(result: dict) -> torch.Tensor:
    """bool [L, R*T_ll]: the receive rows dispatch defines (the rest are undefined on the GPU)."""
    return result["src_token"] >= 0


def ll_combine(
    ll_dispatch_results: list[dict],
    ys: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    topk_weights_list: list[torch.Tensor],
    num_experts: int,
    num_max_tokens: int,
    sources: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """bf16 [T_s, H] per source rank (per rank of ``sources`` when given, in its order):
    ``bf16(sum_k w[t, k] * float(y_k))``.

    ``y_k`` is the row of ``ys[d][l]`` where ``ll_dispatch`` put token ``t`` for expert
    ``topk_idx[t, k]``, found through the result's ``src_rank`` and ``src_token``: ``ys`` is laid out
    like the results' ``x``, in whichever ``recv_layout`` they were made with. In fp32, starting at
    0.0 and for ``k`` ascending, skipping ``-1`` (and the slots ``sanitize_topk_idx`` turns into -1:
    a repeated expert counts once, at its first slot): ``acc = acc + (w * y)`` with the product
    rounded to fp32 before the add. Kernels must do the same (``__fadd_rn(acc, __fmul_rn(w, y))``):
    a fused multiply-add rounds once and differs.
    """
    num_ranks = len(topk_idxs)
    num_local = num_local_experts(num_experts, num_ranks)
    for name, value in (
        ("ll_dispatch_results", ll_dispatch_results),
        ("ys", ys),
        ("topk_weights_list", topk_weights_list),
    ):
        if len(value) != num_ranks:
            raise ValueError(f"{name} must have one entry per rank ({num_ranks}), got {len(value)}")
    hidden = ys[0].shape[-1]
    expected_shape = [num_local, num_ranks * num_max_tokens, hidden]
    for dest, y in enumerate(ys):
        if y.dtype != torch.bfloat16 or list(y.shape) != expected_shape:
            raise ValueError(f"ys[{dest}] must be bfloat16 {expected_shape}, got {describe(y)}")

    outputs = []
    for source in range(num_ranks) if sources is None else sources:
        weights, num_tokens = topk_weights_list[source], topk_idxs[source].shape[0]
        _check_token_count(f"topk_idxs[{source}]", num_tokens, num_max_tokens)
        check_topk_idx(f"topk_idxs[{source}]", topk_idxs[source], num_tokens)
        topk_idx = sanitize_topk_idx(topk_idxs[source], num_experts)
        if weights.dtype != torch.float32 or weights.shape != topk_idx.shape:
            raise ValueError(
                f"topk_weights_list[{source}] must be float32 {list(topk_idx.shape)}, got {describe(weights)}"
            )
        row_of = [_row_lookup(result, dest, source, num_tokens) for dest, result in enumerate(ll_dispatch_results)]
        acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=ys[0].device)
        for slot in range(topk_idx.shape[1]):
            experts = topk_idx[:, slot]
            for dest in range(num_ranks):
                tokens = ((experts >= 0) & (experts // num_local == dest)).nonzero().squeeze(1)
                local_ids = experts[tokens] % num_local
                rows = row_of[dest][tokens, local_ids]
                if (rows < 0).any():
                    raise ValueError(
                        f"ll_dispatch_results[{dest}] lacks a token of rank {source} that topk_idxs routes there"
                    )
                product = weights[tokens, slot].unsqueeze(1) * ys[dest][local_ids, rows].float()
                acc[tokens] = acc[tokens] + product
        outputs.append(acc.to(torch.bfloat16))
    return outputs


def _row_lookup(result: dict, dest: int, source: int, num_tokens: int) -> torch.Tensor:
    """[T, L]: receive row of each (token of ``source``, local expert), -1 where it was not sent."""
    src_rank, src_token = result["src_rank"], result["src_token"]
    local_ids, rows = (src_rank == source).nonzero(as_tuple=True)
    tokens = src_token[local_ids, rows]
    if tokens.numel() > 0 and int(tokens.max()) >= num_tokens:
        raise ValueError(
            f"ll_dispatch_results[{dest}] holds token {int(tokens.max())} of rank {source}, "
            f"which has only {num_tokens} tokens in topk_idxs[{source}]"
        )
    lookup = torch.full((num_tokens, src_token.shape[0]), -1, dtype=torch.int64, device=src_token.device)
    lookup[tokens, local_ids] = rows
    return lookup
