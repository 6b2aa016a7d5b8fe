"""Sizes behind a V1 ``Buffer``: the window bytes its byte budgets stand for, the LL window its first
``low_latency_dispatch`` builds, and the per-call token capacity (``T_max``) of its HT region (the
sizing rule in deep_ep.compat.buffer's docstring). Pure arithmetic over the core's geometry
(``deep_ep._C``), no GPU.
"""

from __future__ import annotations

import functools
from typing import Any

from deep_ep import _C
from deep_ep.buffer import ElasticBuffer
from deep_ep.plan.budget import largest_fitting

__all__ = [
    "bytes_for_tokens",
    "low_latency_window_bytes",
    "non_negative_int",
    "token_capacity",
    "window_num_bytes",
]

# Upper bound of the capacity search (far beyond any window: 2^40 tokens per rank).
_MAX_CAPACITY = 1 << 40


def non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def window_num_bytes(num_nvl_bytes: int, num_rdma_bytes: int) -> int:
    """``num_bytes`` of the ElasticBuffer behind ``Buffer(group, num_nvl_bytes, num_rdma_bytes)``: the
    window whose HT region is ``num_nvl_bytes + num_rdma_bytes`` rounded up to 2 MiB, plus the 2 MiB
    workspace (no low-latency region). The two budgets are pooled: the core has one HT region in
    both topologies (hybrid mode keeps its scale-out staging inside it). With ``low_latency_mode``
    the Buffer passes ``num_rdma_bytes=0`` here: that budget holds the LL window
    (:func:`low_latency_window_bytes`)."""
    total = non_negative_int("num_nvl_bytes", num_nvl_bytes) + non_negative_int("num_rdma_bytes", num_rdma_bytes)
    return int(_C.window_layout(total, 0)["total_bytes"])


def low_latency_window_bytes(
    num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
) -> int:
    """Bytes of the LL-only ElasticBuffer a V1 ``Buffer(low_latency_mode=True)`` builds at its first
    ``low_latency_dispatch`` (workspace included, top-k ``min(32, E)``): what ``num_rdma_bytes``
    must hold. Equal to ``Buffer.get_low_latency_rdma_size_hint``. Invalid sizes raise ValueError."""
    return int(
        ElasticBuffer.get_low_latency_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    )


def bytes_for_tokens(
    num_ranks: int, num_scaleup_ranks: int, num_tokens: int, hidden: int, num_topk: int, use_fp8: bool
) -> int:
    """HT region bytes a call with ``T_max = num_tokens`` needs: the larger of the dispatch and the
    combine footprint (combine is always bf16). ``num_nvl_bytes + num_rdma_bytes`` at least this
    lets every rank pass up to ``num_tokens`` tokens for this shape."""
    layout = _C.high_throughput_layout(num_ranks, num_scaleup_ranks, num_tokens, hidden, num_topk, use_fp8)
    return int(max(layout["dispatch_bytes"], layout["combine_bytes"]))


@functools.lru_cache(maxsize=256)
def token_capacity(
    num_ranks: int, num_scaleup_ranks: int, ht_region_bytes: int, hidden: int, num_topk: int, use_fp8: bool
) -> int:
    """The largest ``T_max`` whose footprint (:func:`bytes_for_tokens`) fits ``ht_region_bytes``; 0 if
    not even one token per rank fits. The footprint grows with ``T_max``, so this is a doubling then a
    bisection over the core's geometry (memoised per shape)."""

    def fits(num_tokens: int) -> bool:
        needed = bytes_for_tokens(num_ranks, num_scaleup_ranks, num_tokens, hidden, num_topk, use_fp8)
        return needed <= ht_region_bytes

    return largest_fitting(fits, _MAX_CAPACITY)
