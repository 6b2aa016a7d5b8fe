"""``deep_ep.utils.gate`` as DeepEP's test scripts import it: gate scores whose top-k sends rank 0
a chosen multiple of the tokens each other rank gets.

Experts ``[r * E / R, (r + 1) * E / R)`` live on rank ``r``; rank 0 is the hot rank. A token
"reaches" a rank when at least one of its top-k experts lives there. ``ratio`` is the number of
tokens reaching rank 0 divided by the number reaching another rank.
"""

from __future__ import annotations

import torch

__all__ = ["get_precise_unbalanced_scores", "get_random_unbalanced_scores", "get_unbalanced_scores"]

# Precise mode: unselected experts score in [0, LOW_CEILING), selected ones above it.
LOW_CEILING = 0.9
# Random mode: the hot rank's score ceiling is searched in [1, FACTOR_CEILING] by bisection.
FACTOR_CEILING = 100.0
FACTOR_SEARCH_STEPS = 20


def _device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _check_sizes(num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float) -> None:
    if num_tokens < 0 or num_ranks < 1 or num_experts < num_ranks or num_experts % num_ranks != 0:
        raise ValueError(
            f"need num_tokens >= 0 and num_experts a positive multiple of num_ranks, got "
            f"{num_tokens=}, {num_experts=}, {num_ranks=}"
        )
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk must be in [1, num_experts={num_experts}], got {num_topk}")
    if ratio < 1.0:
        raise ValueError(f"ratio must be no less than 1.0, got {ratio}")


def _ranks_reached(topk_idx: torch.Tensor, num_experts_per_rank: int, num_ranks: int) -> torch.Tensor:
    """bool ``[T, R]``: token ``t`` has a top-k expert on rank ``r``."""
    reached = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool, device=topk_idx.device)
    return reached.scatter_(1, topk_idx // num_experts_per_rank, True)


def hot_rank_ratio(scores: torch.Tensor, num_ranks: int, num_topk: int) -> float:
    """Tokens reaching rank 0 over the mean number reaching each other rank, for the top-k of
    ``scores`` (``[T, E]``); infinite when no token reaches another rank."""
    num_experts_per_rank = scores.shape[1] // num_ranks
    topk_idx = torch.topk(scores, num_topk, dim=-1, sorted=False).indices
    counts = _ranks_reached(topk_idx, num_experts_per_rank, num_ranks).sum(dim=0).float()
    others = counts[1:].mean().item()
    return counts[0].item() / others if others > 0 else float("inf")


def _scores_with_hot_rank(
    num_tokens: int, num_experts: int, num_ranks: int, factor: float, device: torch.device
) -> torch.Tensor:
    """Uniform scores in ``[0, 1)``, rank 0's experts in ``[0, factor)``."""
    scores = torch.rand(num_tokens, num_experts, dtype=torch.float32, device=device)
    scores[:, : num_experts // num_ranks] *= factor
    return scores


def get_random_unbalanced_scores(
    num_tokens: int,
    num_experts: int,
    num_ranks: int,
    num_topk: int,
    ratio: float,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """fp32 ``[T, E]`` scores drawn uniformly, rank 0's from ``[0, factor)`` and the others' from
    ``[0, 1)``, with ``factor`` found by a bisection over ``[1, 100]`` so that the top-k's hot-rank
    ratio approaches ``ratio`` (``factor = 1``, balanced, for ``ratio = 1`` or one rank). The ratio
    holds on average, not exactly."""
    _check_sizes(num_tokens, num_experts, num_ranks, num_topk, ratio)
    device = _device(device)
    factor = 1.0
    if ratio != 1.0 and num_ranks > 1 and num_tokens > 0:
        low, high = 1.0, FACTOR_CEILING
        for _ in range(FACTOR_SEARCH_STEPS):
            middle = (low + high) / 2
            probe = _scores_with_hot_rank(num_tokens, num_experts, num_ranks, middle, device)
            if hot_rank_ratio(probe, num_ranks, num_topk) > ratio:
                high = middle
            else:
                low = middle
        factor = low
    return _scores_with_hot_rank(num_tokens, num_experts, num_ranks, factor, device)


def _ranks_per_token(
    num_tokens: int, num_experts: int, num_ranks: int, num_topk: int, ratio: float, device
) -> torch.Tensor:
    """How many ranks each token reaches: as a balanced random gate would spread it, clamped to what
    the exact ratio allows (at most ``(R - 1) / ratio + 1`` on average, so that rank 0 can be reached
    ``ratio`` times as often as the others) and to what ``K`` experts need (at least
    ``ceil(K / (E / R))``)."""
    num_experts_per_rank = num_experts // num_ranks
    natural = torch.topk(torch.rand(num_tokens, num_experts, device=device), num_topk, dim=-1, sorted=False).indices
    spread = _ranks_reached(natural, num_experts_per_rank, num_ranks).sum(dim=1)
    lower = max(1, -(-num_topk // num_experts_per_rank))
    upper = min(num_topk, num_ranks, int((num_ranks - 1) / ratio) + 1)
    return spread.clamp(max=upper).clamp(min=lower)


def _hot_tokens(spread: torch.Tensor, num_ranks: int, ratio: float) -> torch.Tensor:
    """bool ``[T]``: the tokens that reach rank 0. Their number is ``ratio / (R - 1 + ratio)`` of
    all rank visits (so that each other rank gets ``1 / ratio`` of it), at least every token that
    reaches all ranks, at most every token."""
    num_tokens = spread.shape[0]
    if num_ranks == 1:
        return torch.ones(num_tokens, dtype=torch.bool, device=spread.device)
    visits = int(spread.sum().item())
    must = spread == num_ranks
    num_hot = round(ratio * visits / (num_ranks - 1 + ratio))
    num_hot = min(num_tokens, max(num_hot, int(must.sum().item())))
    priority = torch.rand(num_tokens, device=spread.device)
    priority[must] = 2.0
    hot = torch.zeros(num_tokens, dtype=torch.bool, device=spread.device)
    hot[torch.argsort(priority, descending=True)[:num_hot]] = True
    return hot


def _experts_per_rank(spread: torch.Tensor, hot: torch.Tensor, num_ranks: int, num_topk: int) -> torch.Tensor:
    """int64 ``[T, R]``: how many of each token's ``K`` experts live on each rank. A hot token
    reaches rank 0; the other ranks are dealt from a random cycle of ranks ``1 .. R-1`` in token
    order, so consecutive ranks of a token differ and every such rank is reached by the same number
    of tokens, give or take one. A token's ``K`` experts are spread as evenly as possible over its
    ranks, the larger shares starting at a random one."""
    num_tokens, device = spread.shape[0], spread.device
    width = int(spread.max().item()) if num_tokens > 0 else 1
    columns = torch.arange(width, device=device)
    num_normal = spread - hot.long()
    if num_ranks > 1:
        cycle = torch.randperm(num_ranks - 1, device=device) + 1
        starts = torch.cumsum(num_normal, dim=0) - num_normal
        normal = cycle[(starts.unsqueeze(1) + columns) % (num_ranks - 1)]
    else:
        normal = torch.zeros(num_tokens, width, dtype=torch.long, device=device)
    # Each token's ranks: rank 0 first if hot, then its normal ranks; -1 marks no rank.
    owner = torch.cat(
        [torch.where(hot, 0, -1).unsqueeze(1), normal.masked_fill(columns >= num_normal.unsqueeze(1), -1)], 1
    )
    present = owner >= 0
    position = torch.cumsum(present.long(), dim=1) - 1  # index among the token's ranks
    shift = (torch.rand(num_tokens, device=device) * spread).long().unsqueeze(1)
    base, extra = (num_topk // spread).unsqueeze(1), (num_topk % spread).unsqueeze(1)
    share = base + ((position + shift) % spread.unsqueeze(1) < extra).long()
    counts = torch.zeros(num_tokens, num_ranks + 1, dtype=torch.long, device=device)
    counts.scatter_add_(1, owner.masked_fill(~present, num_ranks), share.masked_fill(~present, 0))
    return counts[:, :num_ranks]


def get_precise_unbalanced_scores(
    num_tokens: int,
    num_experts: int,
    num_ranks: int,
    num_topk: int,
    ratio: float,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """fp32 ``[T, E]`` scores whose top-k reaches rank 0 with ``ratio`` times as many tokens as each
    other rank, exactly up to rounding, and every other rank with the same number of tokens give or
    take one. The selected experts score in ``(0.9, 1]``, all others in ``[0, 0.9)``.

    This is a constructed distribution, not a realistic gate: the number of ranks each token reaches
    follows a balanced random gate, capped at ``(R - 1) / ratio + 1`` (the most an exact ratio
    allows) and raised to ``ceil(K / (E / R))`` (the fewest ranks that hold ``K`` experts); where
    that floor exceeds the cap the ratio cannot be met and comes out lower.
    """
    _check_sizes(num_tokens, num_experts, num_ranks, num_topk, ratio)
    device = _device(device)
    num_experts_per_rank = num_experts // num_ranks
    if num_tokens == 0:
        return torch.empty(0, num_experts, dtype=torch.float32, device=device)
    spread = _ranks_per_token(num_tokens, num_experts, num_ranks, num_topk, ratio, device)
    hot = _hot_tokens(spread, num_ranks, ratio)
    counts = _experts_per_rank(spread, hot, num_ranks, num_topk)
    # Which local experts: each token and rank takes its first `count` in a random order.
    rank_in_order = torch.rand(num_tokens, num_ranks, num_experts_per_rank, device=device).argsort(-1).argsort(-1)
    chosen = rank_in_order < counts.unsqueeze(-1)
    low = torch.rand(num_tokens, num_ranks, num_experts_per_rank, device=device) * LOW_CEILING
    high = 1.0 - torch.rand(num_tokens, num_ranks, num_experts_per_rank, device=device) * (1.0 - LOW_CEILING - 1e-6)
    scores = torch.where(chosen, high, low).view(num_tokens, num_experts)
    # Tokens in random order: the cycle of ranks above follows token order.
    return scores[torch.randperm(num_tokens, device=device)].contiguous()


def get_unbalanced_scores(
    num_tokens: int,
    num_experts: int,
    num_ranks: int,
    num_topk: int,
    ratio: float,
    precise: bool,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """fp32 ``[num_tokens, num_experts]`` gate scores whose top-``num_topk`` reaches rank 0 with
    ``ratio`` (>= 1) times as many tokens as each other rank: exactly with ``precise``
    (``get_precise_unbalanced_scores``), on average otherwise (``get_random_unbalanced_scores``).

    Drawn from torch's global generator on ``device`` (default: CUDA when available, else the CPU;
    DeepEP always uses CUDA). Same contract as DeepEP's; the draws themselves differ.
    """
    if precise:
        return get_precise_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio, device=device)
    return get_random_unbalanced_scores(num_tokens, num_experts, num_ranks, num_topk, ratio, device=device)
