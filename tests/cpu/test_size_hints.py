"""The static size hints report exactly the window the constructor allocates, and agree with the planner."""

from __future__ import annotations

import pytest

from deep_ep import _C, ElasticBuffer
from deep_ep.plan import low_latency_slots


class _FakeGroup:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_low_latency_hint_is_workspace_plus_the_planned_region():
    hint = ElasticBuffer.get_low_latency_size_hint(128, 7168, 64, 256, num_topk=8)
    region = _C.low_latency_layout(64, 128, 7168, 256, 8)["region_bytes"]
    assert hint == _C.WORKSPACE_BYTES + region
    assert low_latency_slots(64, 256, 128, 7168, use_fp8=True, num_topk=8)["total_buffer_bytes"] == region
    assert hint % _C.WINDOW_ALIGN_BYTES == 0


def test_high_throughput_hint_matches_the_geometry_for_direct_and_emulated_nodes():
    direct = ElasticBuffer.get_buffer_size_hint(_FakeGroup(8), 4096, 7168, num_topk=8, use_fp8_dispatch=True)
    region = _C.high_throughput_layout(8, 8, 4096, 7168, 8, True)["region_bytes"]
    assert direct == _C.WORKSPACE_BYTES + region
    hybrid = ElasticBuffer.get_buffer_size_hint(_FakeGroup(8), 4096, 7168, num_topk=8, num_ranks_per_node=2)
    assert hybrid == _C.WORKSPACE_BYTES + _C.high_throughput_layout(8, 2, 4096, 7168, 8, False)["region_bytes"]
    flat = ElasticBuffer.get_buffer_size_hint(
        _FakeGroup(8), 4096, 7168, num_topk=8, num_ranks_per_node=2, allow_hybrid_mode=False
    )
    assert flat == _C.WORKSPACE_BYTES + _C.high_throughput_layout(8, 8, 4096, 7168, 8, False)["region_bytes"]


def test_hints_reject_bad_sizes_naming_the_argument():
    with pytest.raises(ValueError, match="hidden"):
        ElasticBuffer.get_buffer_size_hint(_FakeGroup(8), 4096, 7000, use_fp8_dispatch=True)
    with pytest.raises(ValueError, match="num_experts"):
        ElasticBuffer.get_low_latency_size_hint(128, 7168, 8, 260)


def test_hint_refuses_what_the_constructor_refuses():
    with pytest.raises(ValueError, match="allow_multiple_reduction=False is not supported"):
        ElasticBuffer.get_buffer_size_hint(_FakeGroup(8), 4096, 7168, allow_multiple_reduction=False)


def test_zero_copy_combine_hint_adds_room_for_the_combine_input_rows():
    plain = ElasticBuffer.get_buffer_size_hint(_FakeGroup(8), 4096, 7168, num_topk=8)
    zero_copy = ElasticBuffer.get_buffer_size_hint(_FakeGroup(8), 4096, 7168, num_topk=8, zero_copy_combine=True)
    layout = _C.high_throughput_layout(8, 8, 4096, 7168, 8, False, True)
    assert zero_copy == _C.WORKSPACE_BYTES + layout["region_bytes"]
    assert layout["region_bytes"] >= layout["zero_copy_combine_bytes"] > plain - _C.WORKSPACE_BYTES
    # Expert output rows [R * T_max, H] bf16 and K weights each, above the bf16 dispatch rows.
    rows = 8 * 4096
    assert layout["zero_copy_combine_bytes"] >= layout["dispatch_recv_bytes"] + rows * (7168 * 2 + 8 * 4)
    with pytest.raises(ValueError, match="direct mode only"):
        ElasticBuffer.get_buffer_size_hint(
            _FakeGroup(8), 4096, 7168, num_topk=8, num_ranks_per_node=4, zero_copy_combine=True
        )
