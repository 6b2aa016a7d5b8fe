"""Buffer bytes, read from the C++ geometry through ``_C`` (never recomputed here).

The geometry structs in csrc/runtime/geometry.hpp are what ElasticBuffer allocates and what the
kernels address, so asking them is the only way the planner's numbers stay equal to the buffer's.
"""

from __future__ import annotations

from deep_ep import _C


def high_throughput_bytes(
    num_ranks: int,
    num_ranks_per_node: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    num_topk: int,
    use_fp8: bool,
    zero_copy_combine: bool = False,
) -> dict[str, int]:
    """HT region of the window: ``_C.high_throughput_layout`` (token slot bytes, dispatch / combine
    footprints, ``zero_copy_combine_bytes``, ``region_bytes``). ``num_ranks_per_node == num_ranks``
    is direct mode (one node); ``zero_copy_combine`` sizes the region for it (direct mode only)."""
    return dict(
        _C.high_throughput_layout(
            num_ranks, num_ranks_per_node, num_max_tokens_per_rank, hidden, num_topk, use_fp8, zero_copy_combine
        )
    )


def low_latency_slots(
    num_ranks: int,
    num_experts: int,
    num_max_tokens_per_rank: int,
    hidden: int,
    use_fp8: bool = True,
    *,
    num_topk: int = 8,
) -> dict[str, int | float]:
    """How much of the LL receive slots a batch really fills.

    Every (local expert, source rank) pair owns ``num_max_tokens_per_rank`` message slots, because
    nobody knows the counts in advance. Under uniform routing the ``R * T`` tokens of the group send
    ``K`` messages each over ``E`` experts, so a rank (``L = E / R`` experts) receives
    ``R * T * K * L / E = T * K`` messages in expectation, out of ``L * R * T`` slots.

    Returns ``message_bytes``, ``recv_slot_bytes``, ``expected_used_bytes``, ``used_fraction`` and
    ``total_buffer_bytes`` (the whole LL region: three areas in rotation, combine areas included).
    """
    layout = _C.low_latency_layout(num_ranks, num_max_tokens_per_rank, hidden, num_experts, num_topk)
    message_bytes = _C.low_latency_message_bytes(hidden, use_fp8)
    num_local_experts = layout["num_local_experts"]
    recv_slots = num_local_experts * num_ranks * num_max_tokens_per_rank
    # Exact in integers: num_ranks * num_local_experts == num_experts.
    expected_messages = (
        num_ranks * num_max_tokens_per_rank * layout["num_topk"] * num_local_experts // num_experts if recv_slots else 0
    )
    return {
        "message_bytes": message_bytes,
        "recv_slot_bytes": recv_slots * message_bytes,
        "expected_used_bytes": expected_messages * message_bytes,
        "used_fraction": expected_messages / recv_slots if recv_slots else 0.0,
        "total_buffer_bytes": layout["region_bytes"],
    }


def window_bytes(ht_region_bytes: int, ll_region_bytes: int) -> dict[str, int]:
    """The whole symmetric window (workspace + HT region + LL region): ``_C.window_layout``."""
    return dict(_C.window_layout(ht_region_bytes, ll_region_bytes))


def buffer_bytes(
    num_ranks: int,
    num_ranks_per_node: int,
    num_experts: int,
    num_topk: int,
    hidden: int,
    num_max_tokens_per_rank: int,
    num_max_dispatch_tokens_per_rank: int,
    use_fp8: bool,
    zero_copy_combine: bool = False,
) -> dict[str, dict]:
    """Everything an ElasticBuffer built with these settings allocates: ``high_throughput``,
    ``low_latency`` (``low_latency_slots``) and ``window`` (``total_bytes`` = the allocation)."""
    high_throughput = high_throughput_bytes(
        num_ranks, num_ranks_per_node, num_max_tokens_per_rank, hidden, num_topk, use_fp8, zero_copy_combine
    )
    low_latency = low_latency_slots(
        num_ranks, num_experts, num_max_dispatch_tokens_per_rank, hidden, use_fp8, num_topk=num_topk
    )
    window = window_bytes(high_throughput["region_bytes"], low_latency["total_buffer_bytes"])
    return {"high_throughput": high_throughput, "low_latency": low_latency, "window": window}
