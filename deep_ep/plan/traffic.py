"""Cross-node copies per token under three deduplication strategies, and their transfer times.

A token on ``src_node`` must reach every node holding one of its experts. Sending it once per
expert (``per_expert``), once per destination rank (``per_rank``, what a direct dispatch does) or
once per destination node (``per_node``, the hybrid path: one copy per node, forwarded over
NVLink there) differ only in how many copies cross the scale-out network.
"""

from __future__ import annotations

import numpy as np
import torch

from deep_ep.plan.routing import as_tensor, check_placement, require

COPY_KINDS = ("per_expert", "per_rank", "per_node")


def _count_distinct(ids: torch.Tensor, keep: torch.Tensor, num_ids: int) -> torch.Tensor:
    """Distinct ids per row among entries where ``keep`` holds; ids in [0, num_ids)."""
    # Dropped entries land in an extra column that is not counted.
    seen = torch.zeros(ids.shape[0], num_ids + 1, dtype=torch.bool)
    seen.scatter_(1, torch.where(keep, ids, num_ids), True)
    return seen[:, :num_ids].sum(dim=1)


def cross_node_copies(
    topk_idx: torch.Tensor | np.ndarray,
    num_experts: int,
    num_ranks: int,
    num_ranks_per_node: int,
    src_node: int = 0,
) -> dict[str, float]:
    """Mean copies per token that leave ``src_node``, for routing ``topk_idx`` ([T, K], -1 = none).

    Returns ``per_expert`` (valid experts on other nodes), ``per_rank`` (distinct ranks on other
    nodes), ``per_node`` (distinct other nodes), ``nodes_per_token`` (distinct nodes holding the
    token's experts: the source node counts only when one of them is there) and ``ranks_per_token``
    (distinct ranks holding the experts), each averaged over all T rows (a row of -1 touches none).
    """
    check_placement(num_experts, num_ranks, num_ranks_per_node)
    num_nodes = num_ranks // num_ranks_per_node
    require(0 <= src_node < num_nodes, f"src_node must be in [0, num_nodes={num_nodes}), got {src_node}")
    idx = as_tensor(topk_idx, "topk_idx").cpu()
    require(
        idx.dim() == 2 and not idx.is_floating_point() and not idx.is_complex() and idx.dtype != torch.bool,
        f"topk_idx must be an integer [T, K] array, got {idx.dtype} {list(idx.shape)}",
    )
    require(idx.shape[0] >= 1, f"topk_idx must have at least one row, got {list(idx.shape)}")
    idx = idx.to(torch.int64)
    require(
        bool(((idx >= -1) & (idx < num_experts)).all()),
        f"topk_idx entries must be -1 or in [0, num_experts={num_experts}), "
        f"got range [{int(idx.min())}, {int(idx.max())}]",
    )

    valid = idx >= 0
    rank = idx.clamp(min=0) // (num_experts // num_ranks)
    node = rank // num_ranks_per_node
    remote = valid & (node != src_node)
    other_nodes = _count_distinct(node, remote, num_nodes)
    return {
        "per_expert": remote.sum(dim=1).double().mean().item(),
        "per_rank": _count_distinct(rank, remote, num_ranks).double().mean().item(),
        "per_node": other_nodes.double().mean().item(),
        "nodes_per_token": _count_distinct(node, valid, num_nodes).double().mean().item(),
        "ranks_per_token": _count_distinct(rank, valid, num_ranks).double().mean().item(),
    }


def transfer_times(
    copies: dict[str, float], *, message_bytes: int, num_tokens: int, link_gbs: float
) -> dict[str, float]:
    """Seconds one rank needs to push its cross-node copies through its own link.

    ``copies`` is a ``cross_node_copies`` (or ``uniform_cross_node_copies``) result; each of
    ``num_tokens`` tokens sends ``copies[kind]`` messages of ``message_bytes`` bytes over a link of
    ``link_gbs`` GB/s (1e9 bytes/s). Returns seconds for each of ``per_expert``, ``per_rank``, ``per_node``.
    """
    require(message_bytes > 0, f"message_bytes must be > 0, got {message_bytes}")
    require(num_tokens >= 0, f"num_tokens must be >= 0, got {num_tokens}")
    require(link_gbs > 0, f"link_gbs must be > 0, got {link_gbs}")
    missing = [kind for kind in COPY_KINDS if kind not in copies]
    require(not missing, f"copies must have keys {list(COPY_KINDS)}, missing {missing}")
    return {kind: copies[kind] * num_tokens * message_bytes / (link_gbs * 1e9) for kind in COPY_KINDS}
