"""Seeded test inputs for a whole EP group.

Every rank process calls ``make_group_inputs`` with the same arguments and gets the same CPU
tensors for every rank, so it can run the reference model for the whole group locally and use
its own slice as the input to the real kernels.
"""

from dataclasses import dataclass

import torch

from deep_ep.fp8 import per_token_cast_to_fp8

__all__ = [
    "GroupData",
    "make_group_inputs",
    "make_routing",
    "make_tokens",
    "make_weights",
    "uneven_token_counts",
]


def make_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    *,
    generator: torch.Generator,
    minus_one_ratio: float = 0.1,
    all_minus_one_tokens: int = 1,
    hot_expert: int | None = None,
    hot_ratio: float = 0.5,
) -> torch.Tensor:
    """int64 [T, K]: distinct expert ids per row, about ``minus_one_ratio`` of the entries -1,
    ``min(all_minus_one_tokens, T)`` rows entirely -1, and (with ``hot_expert``) about
    ``hot_ratio`` of the tokens selecting ``hot_expert`` on top of those that pick it anyway.
    """
    if not 1 <= num_topk <= num_experts:
        raise ValueError(f"num_topk must be in [1, num_experts={num_experts}], got {num_topk}")
    for name, ratio in (("minus_one_ratio", minus_one_ratio), ("hot_ratio", hot_ratio)):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {ratio}")
    if hot_expert is not None and not 0 <= hot_expert < num_experts:
        raise ValueError(f"hot_expert must be in [0, {num_experts}), got {hot_expert}")

    scores = torch.rand(num_tokens, num_experts, generator=generator)
    if hot_expert is not None:
        is_hot = torch.rand(num_tokens, generator=generator) < hot_ratio
        # Uniform scores are < 1, so a score of 2 guarantees top-k keeps the hot expert.
        scores[is_hot, hot_expert] = 2.0
    topk_idx = scores.topk(num_topk, dim=1).indices
    # top-k returns the hot expert in slot 0; shuffle so every slot sees every expert.
    topk_idx = topk_idx.gather(1, torch.rand(num_tokens, num_topk, generator=generator).argsort(dim=1))
    dropped = torch.rand(num_tokens, num_topk, generator=generator) < minus_one_ratio
    if hot_expert is not None:
        dropped &= topk_idx != hot_expert
    topk_idx[dropped] = -1
    empty_tokens = torch.randperm(num_tokens, generator=generator)[: min(all_minus_one_tokens, num_tokens)]
    topk_idx[empty_tokens] = -1
    return topk_idx


def make_weights(topk_idx: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 weights in [0.1, 1) for every slot, -1 slots included (combine ignores them there)."""
    return torch.rand(topk_idx.shape, generator=generator) * 0.9 + 0.1


def make_tokens(
    num_tokens: int, hidden: int, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Normal random [T, H] without a single exact zero, so no row looks like untouched memory."""
    tokens = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    return torch.where(tokens == 0, torch.ones_like(tokens), tokens)


def uneven_token_counts(
    num_ranks: int, max_tokens: int, generator: torch.Generator, zero_rank: bool = True
) -> list[int]:
    """Random counts in [1, max_tokens]; one rank gets exactly ``max_tokens`` (the cap) and,
    with ``zero_rank`` and more than one rank, another gets 0."""
    if num_ranks < 1 or max_tokens < 1:
        raise ValueError(f"num_ranks and max_tokens must be >= 1, got {num_ranks} and {max_tokens}")
    counts = torch.randint(1, max_tokens + 1, (num_ranks,), generator=generator)
    chosen = torch.randperm(num_ranks, generator=generator)
    counts[chosen[0]] = max_tokens
    if zero_rank and num_ranks > 1:
        counts[chosen[1]] = 0
    return counts.tolist()


@dataclass(frozen=True)
class GroupData:
    """Inputs of every rank of the group (CPU tensors, indexed by rank)."""

    num_tokens: list[int]
    x: list[torch.Tensor]
    x_fp8: list[tuple[torch.Tensor, torch.Tensor]] | None
    topk_idx: list[torch.Tensor]
    topk_weights: list[torch.Tensor] | None

    @property
    def dispatch_xs(self) -> list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
        """What HT dispatch takes: the fp8 pairs when built with ``use_fp8``, else bf16."""
        return list(self.x_fp8) if self.x_fp8 is not None else list(self.x)


def make_group_inputs(
    num_ranks: int,
    num_max_tokens: int,
    hidden: int,
    num_experts: int,
    num_topk: int,
    *,
    seed: int,
    use_fp8: bool = False,
    with_weights: bool = True,
    uneven: bool = True,
    zero_rank: bool = True,
    minus_one_ratio: float = 0.1,
    all_minus_one_tokens: int = 1,
    hot_expert: int | None = None,
    hot_ratio: float = 0.5,
) -> GroupData:
    """Every rank's inputs, a pure function of the arguments (one generator seeded by ``seed``)."""
    generator = torch.Generator().manual_seed(seed)
    if uneven:
        num_tokens = uneven_token_counts(num_ranks, num_max_tokens, generator, zero_rank=zero_rank)
    else:
        num_tokens = [num_max_tokens] * num_ranks
    xs, topk_idxs, weights = [], [], []
    for count in num_tokens:
        xs.append(make_tokens(count, hidden, generator))
        topk_idxs.append(
            make_routing(
                count,
                num_experts,
                num_topk,
                generator=generator,
                minus_one_ratio=minus_one_ratio,
                all_minus_one_tokens=all_minus_one_tokens,
                hot_expert=hot_expert,
                hot_ratio=hot_ratio,
            )
        )
        weights.append(make_weights(topk_idxs[-1], generator))
    return GroupData(
        num_tokens=num_tokens,
        x=xs,
        x_fp8=[per_token_cast_to_fp8(x) for x in xs] if use_fp8 else None,
        topk_idx=topk_idxs,
        topk_weights=weights if with_weights else None,
    )
