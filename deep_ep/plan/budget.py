"""Memory budget mode: the largest token caps whose window fits a byte budget.

Serving stacks size the low-latency cap from the GPU memory left after the model and the KV cache,
and training stacks the high-throughput cap from what the model leaves; guessing costs either
memory or an assertion at run time. The window grows with each cap, so the largest cap that fits is
a doubling, then a bisection, over the same geometry the buffer allocates with (``buffer_bytes``).
Budgets are per rank: each rank allocates its own window (ranks sharing a GPU each need one).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from deep_ep.plan.routing import require
from deep_ep.plan.sizing import buffer_bytes

SEARCH_LIMIT = 1 << 24  # tokens per rank: past any window a GPU can hold
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def largest_fitting(fits: Callable[[int], bool], limit: int = SEARCH_LIMIT) -> int:
    """The largest ``n`` in ``[1, limit]`` with ``fits(n)``, for a ``fits`` that holds up to some
    ``n`` and fails beyond it; 0 when ``fits(1)`` fails."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)  # fits(low) holds; fits(high) fails or high is past the limit
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"8G"``, ``"512MiB"``, ``"1.5GiB"`` or a plain byte count -> bytes (binary units)."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    require(match is not None, f"a byte size must look like 8GiB, 512MiB or 1073741824, got {text!r}")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()])


def caps_within_budget(
    budget_bytes: int,
    *,
    num_ranks: int,
    num_ranks_per_node: int,
    num_experts: int,
    num_topk: int,
    hidden: int,
    use_fp8: bool,
    num_max_tokens_per_rank: int,
    num_max_dispatch_tokens_per_rank: int,
    zero_copy_combine: bool = False,
) -> dict[str, int | bool]:
    """What a window of ``budget_bytes`` per rank holds for this setup:

    ``configured_bytes`` / ``configured_fits`` (the window of the given caps), ``ht_with_ll`` (the
    largest HT cap next to the given LL cap), ``ll_with_ht`` (the largest LL cap next to the given
    HT cap), ``ht_only`` and ``ll_only`` (a buffer with one region); 0 where not one token fits."""
    require(budget_bytes > 0, f"the memory budget must be > 0 bytes, got {budget_bytes}")

    def window(ht_tokens: int, ll_tokens: int) -> int:
        sizes = buffer_bytes(
            num_ranks,
            num_ranks_per_node,
            num_experts,
            num_topk,
            hidden,
            ht_tokens,
            ll_tokens,
            use_fp8,
            zero_copy_combine,
        )
        return sizes["window"]["total_bytes"]

    configured = window(num_max_tokens_per_rank, num_max_dispatch_tokens_per_rank)
    return {
        "budget_bytes": budget_bytes,
        "configured_bytes": configured,
        "configured_fits": configured <= budget_bytes,
        "ht_with_ll": largest_fitting(lambda n: window(n, num_max_dispatch_tokens_per_rank) <= budget_bytes),
        "ll_with_ht": largest_fitting(lambda n: window(num_max_tokens_per_rank, n) <= budget_bytes),
        "ht_only": largest_fitting(lambda n: window(n, 0) <= budget_bytes),
        "ll_only": largest_fitting(lambda n: window(0, n) <= budget_bytes),
    }
