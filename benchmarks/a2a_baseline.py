"""The baseline the benchmarks compare against: dispatch and combine built from
``torch.distributed.all_to_all_single``, the way users do it without this library.

Dispatch: exchange per-rank row counts (one small all-to-all), copy them to the host (the one host
sync), gather the rows each destination needs into one send buffer, then one all-to-all of the
rows. Each token goes once to every rank that holds at least one of its experts (expert ``e`` lives
on rank ``e // (E / R)``; -1 entries are ignored). Received rows are ordered by (source rank,
source token), the non-expand order of ``deep_ep.testing.reference.ht_dispatch``.

Combine: the reverse all-to-all brings every row back to its source, which sums a token's rows in
fp32 from 0.0 and rounds to bf16 once (tokens sent nowhere are 0). The rows are added in ascending
order of each destination rank's last top-k lane (the highest slot ``k`` whose expert that rank
holds), DeepEP V2's order and that of ``deep_ep.testing.reference.ht_combine`` (non-expand, no
bias). As in the library, an expert id outside ``[0, E)`` or already selected at an earlier slot of
the same row selects nothing.

Pure torch + torch.distributed: gloo on CPU, nccl on GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["A2AHandle", "a2a_dispatch", "a2a_combine"]


@dataclass(frozen=True)
class A2AHandle:
    """What combine needs from dispatch.

    ``send_tokens[i]`` is the source token of send row ``i``; send rows are grouped by destination
    rank ascending (``send_splits[d]`` rows for rank ``d``), tokens ascending inside a group.
    ``recv_splits[s]`` is the number of rows received from rank ``s``. Combine adds the send rows
    in rounds, one per top-k lane ascending: ``round_rows`` lists the send rows round by round
    (``round_splits[k]`` rows in round ``k``), a row's round being the last top-k lane of its token
    that selects an expert of the row's destination rank.
    """

    num_tokens: int
    hidden: int
    send_tokens: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    round_rows: torch.Tensor
    round_splits: list[int]

    @property
    def num_recv_tokens(self) -> int:
        return sum(self.recv_splits)


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def a2a_dispatch(
    x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, A2AHandle]:
    """Rows received by this rank ``[N, H]`` (ordered by source rank, then source token) and the handle."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [T, H], got {_describe(x)}")
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"topk_idx must be int64 [{x.shape[0]}, K], got {_describe(topk_idx)}")
    num_ranks = dist.get_world_size(group)
    if num_experts < 1 or num_experts % num_ranks != 0:
        raise ValueError(f"num_experts must be a positive multiple of the group size {num_ranks}, got {num_experts}")
    num_local_experts = num_experts // num_ranks
    num_tokens, hidden = x.shape

    num_topk = topk_idx.shape[1]
    # A slot selects nothing if its id is out of range or repeats an earlier slot's id.
    selects = (topk_idx >= 0) & (topk_idx < num_experts)
    for lane in range(1, num_topk):
        selects[:, lane] &= ~(topk_idx[:, :lane] == topk_idx[:, lane : lane + 1]).any(dim=1)
    # Slots that select nothing map to a spare column R that is dropped, so each token marks each
    # rank at most once; last_lane[t, d] is the highest slot of token t on rank d (-1: none).
    dest_rank = torch.where(selects, topk_idx // num_local_experts, num_ranks)
    lanes = torch.arange(num_topk, device=x.device).expand(num_tokens, num_topk)
    last_lane = torch.full((num_tokens, num_ranks + 1), -1, dtype=torch.int64, device=x.device)
    last_lane.scatter_reduce_(1, dest_rank, lanes, reduce="amax")
    last_lane = last_lane[:, :num_ranks]
    goes_to = last_lane >= 0
    # nonzero walks the [R, T] mask row-major: destination ascending, then token ascending; boolean
    # indexing walks it in the same order.
    send_tokens = goes_to.t().nonzero()[:, 1]
    send_lanes = last_lane.t()[goes_to.t()]
    round_rows = torch.sort(send_lanes, stable=True).indices
    round_counts = torch.bincount(send_lanes, minlength=num_topk)
    send_counts = goes_to.sum(dim=0)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    counts = torch.cat([send_counts, recv_counts, round_counts]).tolist()
    send_splits, recv_splits = counts[:num_ranks], counts[num_ranks : 2 * num_ranks]
    round_splits = counts[2 * num_ranks :]

    send_rows = x.index_select(0, send_tokens)
    recv_x = x.new_empty(sum(recv_splits), hidden)
    dist.all_to_all_single(
        recv_x, send_rows, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group
    )
    handle = A2AHandle(num_tokens, hidden, send_tokens, send_splits, recv_splits, round_rows, round_splits)
    return recv_x, handle


def a2a_combine(y: torch.Tensor, handle: A2AHandle, group: dist.ProcessGroup | None) -> torch.Tensor:
    """bf16 ``[T, H]``: per source token, the fp32 sum of its returned rows in ascending order of
    each destination rank's last top-k lane of the token."""
    expected = [handle.num_recv_tokens, handle.hidden]
    if y.dtype != torch.bfloat16 or list(y.shape) != expected:
        raise ValueError(f"y must be bfloat16 {expected} (one row per received row), got {_describe(y)}")
    returned = y.new_empty(len(handle.send_tokens), handle.hidden)
    dist.all_to_all_single(
        returned,
        y.contiguous(),
        output_split_sizes=handle.send_splits,
        input_split_sizes=handle.recv_splits,
        group=group,
    )
    combined = torch.zeros(handle.num_tokens, handle.hidden, dtype=torch.float32, device=y.device)
    # One index_add_ per round (top-k lane), in ascending order: a lane belongs to one rank, so
    # inside one round every token appears at most once, even the atomic GPU index_add_ does exactly
    # one fp32 add per element, and the sum order is the lane order (a single index_add_ over all
    # rows would leave the order to the atomics).
    tokens = handle.send_tokens.index_select(0, handle.round_rows)
    rows = returned.index_select(0, handle.round_rows)
    start = 0
    for count in handle.round_splits:
        part = slice(start, start + count)
        combined.index_add_(0, tokens[part], rows[part].float())
        start += count
    return combined.to(torch.bfloat16)
