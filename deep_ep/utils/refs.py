"""``deep_ep.utils.refs`` as DeepEP V2's test script imports it: a reference dispatch across the
ranks of a process group, the synthetic expert outputs it combines, and the reference combine in
V2's summation order.

``combine`` is V2's order as ``deep_ep.testing.reference_v2`` writes it down (lanes summed per rank,
then per node, then in lane order with the biases), which this library's HT combine reproduces bit
for bit. ``dispatch`` exchanges the tokens over ``torch.distributed`` (``all_to_all_single``); on a
gloo group the rows travel through host memory as bytes, so CUDA, bf16 and fp8 tensors all work.

Notation: R ranks, E experts, L = E / R local experts; expert ``e`` lives on rank ``e // L``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from deep_ep.testing.reference_inputs import local_expert_ids
from deep_ep.testing.reference_v2 import v2_lane_partials
from deep_ep.utils.envs import get_global_seed
from deep_ep.utils.math import ceil_div

__all__ = ["combine", "dispatch", "generate_pre_combine_data", "ordered_accumulate"]

# generate_pre_combine_data's multiplier: a large prime scatters consecutive seeds.
SEED_PRIME = 131071


def _uses_device_collectives(group: dist.ProcessGroup | None, tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and "nccl" in str(dist.get_backend(group))


def _exchange_rows(
    rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``all_to_all_single`` of ``rows`` (``[N, ...]``, the first ``send_counts[0]`` rows to rank 0,
    and so on): the rows every rank sent here, by source rank. Rows travel as bytes (any dtype);
    through host memory unless the group is NCCL and the rows are on a GPU."""
    rows = rows.contiguous()
    shape, dtype, device = rows.shape[1:], rows.dtype, rows.device
    as_bytes = rows.reshape(rows.shape[0], -1).view(torch.uint8) if rows.numel() else None
    row_bytes = math.prod(shape) * rows.element_size()
    if as_bytes is None:
        as_bytes = torch.empty(rows.shape[0], row_bytes, dtype=torch.uint8, device=device)
    if not _uses_device_collectives(group, rows):
        as_bytes = as_bytes.cpu()
    received = torch.empty(sum(recv_counts), row_bytes, dtype=torch.uint8, device=as_bytes.device)
    dist.all_to_all_single(received, as_bytes, recv_counts, send_counts, group=group)
    received = received.to(device)
    if row_bytes == 0:
        return torch.empty(sum(recv_counts), *shape, dtype=dtype, device=device)
    return received.view(dtype).reshape(sum(recv_counts), *shape)


def dispatch(
    x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    num_max_tokens_per_rank: int,
    num_experts: int,
    *,
    group: dist.ProcessGroup | None = None,
):
    """Reference dispatch over ``group`` (default: the default group); collective.

    ``x``: ``[T, H]`` tokens, or ``(fp8 [T, H], scales [T, ceil(H / 128)])``; ``topk_idx``: ``[T, K]``
    global expert ids (-1 = none); ``topk_weights``: ``[T, K]`` or None. A token goes once to every
    rank holding one of its experts. Returns, on each rank,
    ``(recv_x, recv_topk_idx, recv_topk_weights, recv_src_token_idx, num_recv_tokens_per_rank)``:
    the received rows ordered by source rank, then source token (not expanded); ``recv_x`` in the
    form of ``x``; ``recv_topk_idx`` the local expert ids (-1 for experts on other ranks);
    ``recv_topk_weights`` the source's whole weight row (None without weights);
    ``recv_src_token_idx`` int32 ``src_rank * num_max_tokens_per_rank + src_token``; and
    ``num_recv_tokens_per_rank``, int32 ``[R]`` on torch's default device, the rows from each rank.

    ``num_max_tokens_per_rank`` must be the buffer's (it spaces the global token ids) and at least
    ``T``. DeepEP's, plus ``group`` and ``topk_weights=None``.
    """
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of the {num_ranks} ranks")
    num_local = num_experts // num_ranks
    data, scales = x if isinstance(x, tuple) else (x, None)
    num_tokens, hidden = data.shape
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx must be [{num_tokens}, K], got {list(topk_idx.shape)}")
    if scales is not None and list(scales.shape) != [num_tokens, ceil_div(hidden, 128)]:
        raise ValueError(f"scales must be [{num_tokens}, {ceil_div(hidden, 128)}], got {list(scales.shape)}")
    if topk_weights is not None and topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights must be {list(topk_idx.shape)}, got {list(topk_weights.shape)}")
    if num_tokens > num_max_tokens_per_rank:
        raise ValueError(f"{num_tokens} tokens exceed num_max_tokens_per_rank={num_max_tokens_per_rank}")

    # Per destination: the tokens with an expert there, in token order, and their local ids there.
    tokens, local_ids = [], []
    for dest in range(num_ranks):
        local = local_expert_ids(topk_idx, dest, num_local)
        selected = (local >= 0).any(dim=1).nonzero().squeeze(1)
        tokens.append(selected)
        local_ids.append(local[selected])
    order = torch.cat(tokens)
    send_counts = [int(selected.numel()) for selected in tokens]
    counts = torch.tensor(send_counts, dtype=torch.int32, device=data.device).view(num_ranks, 1)
    recv_counts = _exchange_rows(counts, [1] * num_ranks, [1] * num_ranks, group).view(-1).tolist()

    def exchange(rows: torch.Tensor) -> torch.Tensor:
        return _exchange_rows(rows, send_counts, recv_counts, group)

    recv_data = exchange(data[order])
    recv_x = recv_data if scales is None else (recv_data, exchange(scales[order]))
    recv_topk_idx = exchange(torch.cat(local_ids).to(topk_idx.dtype))
    recv_topk_weights = None if topk_weights is None else exchange(topk_weights[order])
    src_token_idx = (order + rank * num_max_tokens_per_rank).to(torch.int32)
    recv_src_token_idx = exchange(src_token_idx)
    num_recv_tokens_per_rank = torch.tensor(recv_counts, dtype=torch.int)
    return recv_x, recv_topk_idx, recv_topk_weights, recv_src_token_idx, num_recv_tokens_per_rank


def generate_pre_combine_data(
    src_token_global_idx: torch.Tensor,
    num_max_tokens_per_rank: int,
    num_topk: int,
    hidden: int,
    *,
    num_ranks: int | None = None,
) -> torch.Tensor:
    """bf16 ``[N, num_topk, hidden]`` synthetic expert outputs of the tokens with global ids
    ``src_token_global_idx`` (``src_rank * num_max_tokens_per_rank + src_token``), the same on every
    rank for the same token: lane ``j``, channel ``k`` of token id ``g`` is
    ``sin(((s * 131071) % M + 1) / M * (k + 1) + sin(seed))`` with ``s = g * num_topk + j``,
    ``M = num_ranks * num_max_tokens_per_rank * num_topk`` and ``seed = get_global_seed()``, computed
    in fp32. ``num_ranks`` defaults to the default group's size (DeepEP always reads it there)."""
    if num_ranks is None:
        num_ranks = dist.get_world_size()
    device = src_token_global_idx.device
    lanes = torch.arange(num_topk, device=device)
    seeds = src_token_global_idx.long().unsqueeze(1) * num_topk + lanes  # [N, K]
    max_seed = num_ranks * num_max_tokens_per_rank * num_topk
    frequency = ((seeds * SEED_PRIME % max_seed).float() + 1) / max_seed
    channels = torch.arange(1, hidden + 1, device=device, dtype=torch.float32)
    phases = frequency.unsqueeze(-1) * channels + math.sin(float(get_global_seed()))
    return torch.sin(phases).to(torch.bfloat16)


def ordered_accumulate(data: torch.Tensor, initial_value: torch.Tensor | None = None) -> torch.Tensor:
    """``initial_value + data[:, 0] + data[:, 1] + ...`` over the lanes of ``data`` (``[N, K, H]``),
    added in lane order in ``initial_value``'s dtype (fp32 zeros when None) with every lane widened
    to fp32 first, returned in ``data``'s dtype."""
    if initial_value is None:
        total = torch.zeros(data.shape[0], data.shape[2], dtype=torch.float32, device=data.device)
    else:
        total = initial_value.clone()
    for lane in range(data.shape[1]):
        total += data[:, lane].float()
    return total.to(data.dtype)


def combine(
    y: torch.Tensor,
    topk_idx: torch.Tensor,
    num_scaleout_ranks: int,
    num_scaleup_ranks: int,
    num_experts: int,
    bias: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None,
    reduce_in_local: bool,
    reduce_in_scaleup: bool,
) -> torch.Tensor:
    """Reference combine of one source rank's tokens in V2's order: ``[T, H]`` in ``y``'s dtype.

    ``y``: ``[T, K, H]``, lane ``k`` the output of expert ``topk_idx[t, k]`` (set lanes with
    ``topk_idx = -1`` to zero); ``R = num_scaleout_ranks * num_scaleup_ranks``. With
    ``reduce_in_local`` the lanes of each rank are first summed (fp32 from 0, in lane order, rounded
    to ``y``'s dtype, left on the rank's last lane, other lanes zero); with ``reduce_in_scaleup``
    those partials are then summed the same way per scale-up domain (``num_scaleup_ranks``
    consecutive ranks; this step is not a no-op even with one domain, since it rounds before the
    bias is added). Last, ``ordered_accumulate`` adds the lanes onto the bias (a pair is summed in
    fp32 first; none: zero). ``(True, True)`` is V2's hybrid combine, ``(True, False)`` its direct
    combine, ``(False, False)`` a combine without intermediate reductions; ``reduce_in_scaleup``
    needs ``reduce_in_local``.
    """
    if reduce_in_scaleup and not reduce_in_local:
        raise ValueError("reduce_in_scaleup needs reduce_in_local")
    num_ranks = num_scaleout_ranks * num_scaleup_ranks
    num_local = num_experts // num_ranks
    if reduce_in_local:
        y = v2_lane_partials(y, torch.div(topk_idx, num_local, rounding_mode="floor"))
    if reduce_in_scaleup:
        y = v2_lane_partials(y, torch.div(topk_idx, num_local * num_scaleup_ranks, rounding_mode="floor"))
    if isinstance(bias, tuple):
        initial = bias[0].float() + bias[1].float()
    else:
        initial = None if bias is None else bias.float()
    return ordered_accumulate(y, initial)
