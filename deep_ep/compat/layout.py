"""V1's dispatch layout (``Buffer.get_dispatch_layout``'s counts and ``is_token_in_rank``) computed
from ``topk_idx`` with torch ops (no sync), and the routing a V1 dispatch without ``topk_idx``
sends by (one expert id per rank ``is_token_in_rank`` marks).
"""

from __future__ import annotations

from typing import Any

import torch

from deep_ep._util import describe_with_device

__all__ = ["check_layout_inputs", "dispatch_layout", "routing_from_ranks"]


def dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_ranks_per_node: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """V1's ``get_dispatch_layout`` results, with torch ops on ``topk_idx``'s device (no sync).

    Returns ``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [R / num_ranks_per_node]
    or None, num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R])``. A token counts once per
    rank (and once per node) however many of its experts live there. Entries outside ``[0, E)`` (-1
    included) are ignored, and an expert repeated within a row counts once, as the core routes it
    (repeats and out-of-range ids are treated as -1 there). ``num_ranks_per_node`` None or ``R``:
    one node, ``num_tokens_per_rdma_rank`` is None.
    """
    per_node = check_layout_inputs(topk_idx, num_experts, num_ranks, num_ranks_per_node)
    num_tokens, num_topk = topk_idx.shape
    device = topk_idx.device
    num_local = num_experts // num_ranks
    idx = topk_idx.long()
    valid = (idx >= 0) & (idx < num_experts)
    if num_topk > 1:
        # An id equal to one in an earlier slot of its row is a repeat (the core counts the first only).
        earlier = torch.ones(num_topk, num_topk, dtype=torch.bool, device=device).tril(-1)
        repeated = ((idx.unsqueeze(2) == idx.unsqueeze(1)) & earlier).any(dim=2)
        valid &= ~repeated
    rank_of = torch.where(valid, idx // num_local, torch.full_like(idx, num_ranks))
    ranks = torch.arange(num_ranks, device=device)
    is_token_in_rank = (rank_of.unsqueeze(2) == ranks).any(dim=1)
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    expert = torch.where(valid, idx, torch.full_like(idx, num_experts)).flatten()
    per_expert = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    per_expert.scatter_add_(0, expert, torch.ones_like(expert))
    num_tokens_per_expert = per_expert[:num_experts].to(torch.int32)
    num_tokens_per_rdma_rank = None
    if per_node < num_ranks:
        in_node = is_token_in_rank.view(num_tokens, num_ranks // per_node, per_node).any(dim=2)
        num_tokens_per_rdma_rank = in_node.sum(dim=0, dtype=torch.int32)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank


def check_layout_inputs(topk_idx: Any, num_experts: Any, num_ranks: int, num_ranks_per_node: int | None) -> int:
    """Validate :func:`dispatch_layout`'s arguments; returns the ranks per node."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be a [T, K] tensor, got {describe_with_device(topk_idx)}")
    if topk_idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"topk_idx must be int64 (or int32), got {describe_with_device(topk_idx)}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size ({num_ranks})")
    per_node = num_ranks if num_ranks_per_node is None else num_ranks_per_node
    if per_node < 1 or num_ranks % per_node != 0:
        raise ValueError(f"num_ranks_per_node must divide the group size {num_ranks}, got {num_ranks_per_node}")
    return per_node


def routing_from_ranks(is_token_in_rank: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[T, R]`` expert ids that send each token exactly to the ranks ``is_token_in_rank``
    marks: lane ``r`` holds rank ``r``'s first expert, or -1. What a V1 dispatch without ``topk_idx``
    routes by (the core routes by expert ids; one id per marked rank reaches that rank once)."""
    num_ranks = is_token_in_rank.shape[1]
    first_experts = torch.arange(num_ranks, dtype=torch.int64, device=is_token_in_rank.device) * (
        num_experts // num_ranks
    )
    return torch.where(is_token_in_rank, first_experts, torch.full_like(first_experts, -1))
