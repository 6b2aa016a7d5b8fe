"""Reference of DeepEP V1's ``get_dispatch_layout``, written as plain loops (independent of the
tensor formulation in ``deep_ep.compat.layout.dispatch_layout`` it checks)."""

import torch

__all__ = ["dispatch_layout_by_loops"]


def dispatch_layout_by_loops(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, per_node: int):
    """``(tokens per rank, tokens per node, tokens per expert, is_token_in_rank bool [T, R])`` (lists,
    and a CPU tensor). A token counts once per rank and per node; ids outside ``[0, E)`` are ignored
    and a repeated id in a row counts once."""
    num_local = num_experts // num_ranks
    per_rank, per_expert = [0] * num_ranks, [0] * num_experts
    per_node_counts = [0] * (num_ranks // per_node)
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool)
    for token, row in enumerate(topk_idx.tolist()):
        experts = []
        for expert in row:
            if 0 <= expert < num_experts and expert not in experts:
                experts.append(expert)
        for expert in experts:
            per_expert[expert] += 1
        ranks = sorted({expert // num_local for expert in experts})
        for r in ranks:
            per_rank[r] += 1
            in_rank[token, r] = True
        for node in sorted({r // per_node for r in ranks}):
            per_node_counts[node] += 1
    return per_rank, per_node_counts, per_expert, in_rank
