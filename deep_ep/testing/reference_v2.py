"""DeepEP V2's reference combine order as a small function of per-lane expert outputs.

DeepEP V2 checks its combine against ``deep_ep/utils/refs.py`` (``combine``, ``ordered_accumulate``):
per token, the top-k lanes are grouped by rank (then, in hybrid mode, by node); each group is summed
in fp32 in lane order, rounded to bf16 and left on the group's last lane (the other lanes become
zero); finally the biases and all K lanes are added in lane order in fp32 and rounded once. This
module writes that rule down directly on ``[T, K, H]`` lane outputs, independently of
``reference_ht.ht_combine`` (which follows our data flow: received rows, slots, node partials), so
tests can hold both the reference model and the kernels to V2's bits.
"""

from __future__ import annotations

import torch

from deep_ep.testing.reference_inputs import local_expert_ids, sanitize_topk_idx

__all__ = [
    "combine_inputs_from_lanes",
    "lanes_by_rank",
    "make_lane_outputs",
    "v2_combine",
    "v2_lane_partials",
    "v2_psum_num_recv_tokens_per_scaleup_rank",
]


def v2_combine(
    y: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    *,
    num_ranks_per_node: int | None = None,
    bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One source rank's combined bf16 ``[T, H]`` in V2's order.

    ``y``: bf16 ``[T, K, H]``, the expert output of each top-k lane (zero where ``topk_idx`` is -1);
    ``topk_idx``: ``[T, K]`` global expert ids. Lanes are reduced per rank (V2's ``reduce_in_local``)
    and, when ``num_ranks_per_node`` is below ``num_ranks`` (hybrid mode), then per node
    (``reduce_in_scaleup``). ``bias``: None, one bf16 ``[T, H]`` tensor, or a pair (summed in fp32
    first, as V2 does). A repeated expert id is taken as it stands (both lanes count), which is V2's
    reference behaviour, not the library's: give it routings without repeats.
    """
    num_local = num_experts // num_ranks
    y = v2_lane_partials(y, _floor_div(topk_idx, num_local))
    if num_ranks_per_node is not None and num_ranks_per_node < num_ranks:
        y = v2_lane_partials(y, _floor_div(topk_idx, num_local * num_ranks_per_node))
    if bias is None:
        acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    elif isinstance(bias, tuple):
        acc = bias[0].float() + bias[1].float()
    else:
        acc = bias.float()
    for lane in range(y.shape[1]):
        acc = acc + y[:, lane].float()
    return acc.to(y.dtype)


def v2_lane_partials(y: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """V2's grouped reduction: per token, the lanes with equal ``group`` id summed in fp32 from 0.0
    in lane order, rounded to ``y``'s dtype and stored on the group's last lane; other lanes zero.
    (V2 stable-sorts the lanes by group and sums each segment in order: the same sums.)"""
    out = torch.zeros_like(y)
    num_lanes = y.shape[1]
    for lane in range(num_lanes):
        member = group[:, : lane + 1] == group[:, lane : lane + 1]
        is_last = ~(group[:, lane + 1 :] == group[:, lane : lane + 1]).any(dim=1)
        partial = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
        for earlier in range(lane + 1):
            # Lanes of other groups add nothing: their terms are masked to +0.0 (the sum started at
            # +0.0, so that leaves every bit alone).
            partial = partial + torch.where(member[:, earlier : earlier + 1], y[:, earlier].float(), 0.0)
        out[:, lane] = torch.where(is_last.unsqueeze(1), partial.to(y.dtype), torch.zeros_like(y[:, lane]))
    return out


def lanes_by_rank(y: torch.Tensor, topk_idx: torch.Tensor, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, topk_idx)`` with each token's lanes stably sorted by rank (-1 lanes first). V2's order
    over them is the ascending-rank order (in hybrid mode, also ascending node), so a test can show
    that its data tells V2's order from that one."""
    rank = _floor_div(topk_idx, num_local)
    order = torch.sort(rank, dim=1, stable=True).indices
    return y.gather(1, order.unsqueeze(-1).expand_as(y)), topk_idx.gather(1, order)


def _floor_div(topk_idx: torch.Tensor, divisor: int) -> torch.Tensor:
    """V2's ``topk_idx // divisor``: -1 (no expert) stays -1, a group of zero lanes of its own."""
    return torch.div(topk_idx, divisor, rounding_mode="floor")


def make_lane_outputs(topk_idx: torch.Tensor, hidden: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 ``[T, K, H]`` expert outputs for the lanes of ``topk_idx`` (zero where it is -1) on which
    the sum order shows: ``±m * 2^e`` with ``m`` in {1, 1.25, 1.5, 1.75} and ``e`` in [-12, 24], so
    equal magnitudes often cancel exactly and a term 2^25 times smaller than another vanishes next to
    it in fp32 (``2^24 + 1 = 2^24``), unless the big ones cancel first."""
    shape = (*topk_idx.shape, hidden)
    mantissa = 1.0 + 0.25 * torch.randint(0, 4, shape, generator=generator).float()
    exponent = torch.randint(-12, 25, shape, generator=generator).float()
    sign = torch.randint(0, 2, shape, generator=generator).float() * 2 - 1
    values = (sign * mantissa * torch.pow(2.0, exponent)).to(torch.bfloat16)
    return values.masked_fill((topk_idx < 0).cpu().unsqueeze(-1), 0.0).to(topk_idx.device)


def combine_inputs_from_lanes(
    lanes: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    src_rank: torch.Tensor,
    src_token: torch.Tensor,
    dest: int,
    num_local: int,
    local_expert: torch.Tensor | None = None,
) -> torch.Tensor:
    """What rank ``dest`` passes to combine when lane ``k`` of source ``s``'s token ``t`` has the
    output ``lanes[s][t, k]`` (as V2's test builds its combine inputs). Rows as a dispatch gave them
    (``src_rank``, ``src_token`` per row, -1 for expand padding, which gets zeros). Non-expand: a
    token's row is its lanes on ``dest`` summed in fp32 from 0.0 in lane order, rounded to bf16 (the
    rank's partial, which V2's reference forms too). Expand (``local_expert`` per row given): the
    row of (token, local expert ``l``) is the output of the lane holding that expert."""
    hidden = lanes[0].shape[2]
    out = torch.zeros(src_rank.shape[0], hidden, dtype=lanes[0].dtype, device=lanes[0].device)
    for source, (source_lanes, topk_idx) in enumerate(zip(lanes, topk_idxs, strict=True)):
        rows = (src_rank == source).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        tokens = src_token[rows]
        local = local_expert_ids(topk_idx[tokens], dest, num_local)
        token_lanes = source_lanes[tokens]
        if local_expert is None:
            acc = torch.zeros(rows.numel(), hidden, dtype=torch.float32, device=out.device)
            for lane in range(local.shape[1]):
                acc = acc + torch.where((local[:, lane] >= 0).unsqueeze(1), token_lanes[:, lane].float(), 0.0)
            out[rows] = acc.to(out.dtype)
        else:
            lane = (local == local_expert[rows].unsqueeze(1)).to(torch.int64).argmax(dim=1)
            out[rows] = token_lanes[torch.arange(rows.numel(), device=out.device), lane]
    return out


def v2_psum_num_recv_tokens_per_scaleup_rank(
    topk_idxs: list[torch.Tensor], num_experts: int, rank: int, num_ranks_per_node: int | None = None
) -> list[int]:
    """DeepEP V2's ``EPHandle.psum_num_recv_tokens_per_scaleup_rank`` on ``rank``, from every rank's
    routing: one entry per scale-up peer ``u`` (``S = num_ranks_per_node`` of them; all ``R`` ranks
    when None), the inclusive prefix sum over ``u`` of the tokens of the source ranks ``n * S + u``
    (every node ``n``) that select at least one expert of ``rank`` (a token counts once). V2's
    hybrid notify sums those counts over the scale-out peers at forwarder ``u``; in direct mode
    (``S = R``) it is the prefix sum over source ranks."""
    num_ranks = len(topk_idxs)
    num_local = num_experts // num_ranks
    num_peers = num_ranks if num_ranks_per_node is None else num_ranks_per_node
    per_peer = [0] * num_peers
    for source, topk_idx in enumerate(topk_idxs):
        routing = sanitize_topk_idx(topk_idx.cpu(), num_experts)
        reaches = ((routing >= 0) & (torch.div(routing, num_local, rounding_mode="floor") == rank)).any(dim=1)
        per_peer[source % num_peers] += int(reaches.sum())
    return torch.tensor(per_peer, dtype=torch.int64).cumsum(0).tolist()
