"""Expert placement and gating used by the planner.

Placement follows the library: experts are contiguous per rank (expert ``e`` lives on rank
``e // (E / R)``) and ranks are contiguous per node (rank ``r`` is on node ``r // ranks_per_node``),
so the experts of one node are contiguous too.
"""

from __future__ import annotations

import numpy as np
import torch


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition holds (messages name the argument and the rule)."""
    if not condition:
        raise ValueError(message)


def check_placement(num_experts: int, num_ranks: int, num_ranks_per_node: int) -> None:
    require(num_ranks >= 1, f"num_ranks must be >= 1, got {num_ranks}")
    require(
        num_ranks_per_node >= 1 and num_ranks % num_ranks_per_node == 0,
        f"num_ranks_per_node must divide num_ranks ({num_ranks}), got {num_ranks_per_node}",
    )
    require(num_experts >= 1, f"num_experts must be >= 1, got {num_experts}")
    require(
        num_experts % num_ranks == 0,
        f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks})",
    )


def as_tensor(array: torch.Tensor | np.ndarray, name: str) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(array).__name__}")


def node_limited_topk(
    scores: torch.Tensor | np.ndarray, num_nodes: int, num_topk: int, max_nodes: int
) -> torch.Tensor | np.ndarray:
    """DeepSeek-V3 group-limited gate with one group per node.

    Each node is scored by the sum of its best ``num_topk // max_nodes`` expert scores (at least
    one), the ``max_nodes`` best nodes are kept, and the top-k is taken among their experts only.
    ``scores`` is ``[T, E]`` (torch or numpy). Returns int64 ``[T, num_topk]`` expert ids ordered by
    descending score, of the same kind (torch / numpy) as ``scores``.
    """
    scores_tensor = as_tensor(scores, "scores")
    require(
        scores_tensor.dim() == 2 and scores_tensor.is_floating_point(),
        f"scores must be a floating [T, E] array, got {scores_tensor.dtype} {list(scores_tensor.shape)}",
    )
    num_tokens, num_experts = scores_tensor.shape
    require(num_nodes >= 1, f"num_nodes must be >= 1, got {num_nodes}")
    require(
        num_experts % num_nodes == 0,
        f"num_experts ({num_experts}, scores.shape[1]) must be a multiple of num_nodes ({num_nodes})",
    )
    require(1 <= max_nodes <= num_nodes, f"max_nodes must be in [1, num_nodes={num_nodes}], got {max_nodes}")
    experts_per_node = num_experts // num_nodes
    require(
        1 <= num_topk <= max_nodes * experts_per_node,
        f"num_topk must be in [1, max_nodes * experts per node = {max_nodes * experts_per_node}], got {num_topk}",
    )

    per_node = scores_tensor.reshape(num_tokens, num_nodes, experts_per_node)
    best_per_node = max(1, num_topk // max_nodes)
    node_scores = per_node.topk(best_per_node, dim=-1).values.sum(dim=-1)
    kept_nodes = node_scores.topk(max_nodes, dim=-1).indices
    node_mask = torch.zeros(num_tokens, num_nodes, dtype=torch.bool, device=scores_tensor.device)
    node_mask.scatter_(1, kept_nodes, True)
    masked = per_node.masked_fill(~node_mask.unsqueeze(-1), float("-inf")).reshape(num_tokens, num_experts)
    topk_idx = masked.topk(num_topk, dim=-1, sorted=True).indices.to(torch.int64)
    return topk_idx.numpy() if isinstance(scores, np.ndarray) else topk_idx


def random_scores(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    """i.i.d. uniform gate scores: a plain top-k of them is uniform routing (every K-subset equally likely)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(num_tokens, num_experts, generator=generator)
