"""Which HT calls go to the C++ host path (_C.HtHostPath) and which stay on the Python path: the
everyday arguments go there, every other argument stays here, and a None from the host path (its
checks refused something) hands the call to the Python path. A recording stand-in for the host
path; no GPU needed (the GPU suite, tests/gpu/test_ht_host_path.py, checks the results)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_handle import _handle

from deep_ep.event import EventOverlap
from deep_ep.high_throughput import HighThroughputMixin


class _RecordingHostPath:
    """Answers each call with `answer` (None: "not mine") and records what it was asked."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[str] = []

    def cached_dispatch(self, runtime, x, topk_weights, handle, num_sms, stream):
        self.calls.append("cached_dispatch")
        return self.answer

    def combine(self, runtime, x, topk_weights, handle, num_sms, sum_topk_weights, stream):
        self.calls.append("combine")
        return self.answer

    def begin_dispatch(self, runtime, x, topk_idx, topk_weights, *rest):
        self.calls.append("begin_dispatch")
        return self.answer


class _Buffer(HighThroughputMixin):
    """The attributes ElasticBuffer gives the HT mixin; no runtime, no GPU."""

    def __init__(self, host_path: _RecordingHostPath) -> None:
        self._serial = 1
        self.device = 0
        self._torch_device = torch.device("cuda", 0)
        self._runtime = object()
        self._ht_host_path = host_path
        self.num_ranks = 2
        self.num_max_tokens_per_rank = 16
        self.num_experts = 8
        self.num_topk = 2

    def _ensure_usable(self) -> None:
        pass

    def _check_fatal_errors(self, call: str | None = None) -> None:
        pass


@pytest.fixture(autouse=True)
def _no_cuda_stream(monkeypatch):
    # The host path is handed the caller's raw stream; there is none without a GPU.
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)


def _owned_handle() -> Any:
    handle = _handle(do_expand=False)
    handle.owner_id = 1
    return handle


def test_cached_dispatch_and_combine_with_everyday_arguments_take_the_host_path():
    recv = (torch.zeros(5, 8), None, torch.zeros(5, 2, dtype=torch.int64), torch.zeros(5, 2))
    host_path = _RecordingHostPath(recv)
    buffer = _Buffer(host_path)
    handle = _owned_handle()
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    recv_x, recv_topk_idx, recv_weights, got_handle, event = buffer.dispatch(x, topk_weights=None, handle=handle)
    assert host_path.calls == ["cached_dispatch"]
    assert recv_x is recv[0] and recv_topk_idx is recv[2] and recv_weights is recv[3] and got_handle is handle
    assert isinstance(event, EventOverlap) and event.event is None

    # fp8: the host path answers with scales, and dispatch returns the (data, scales) pair.
    scales = torch.zeros(5, 1)
    host_path.answer = (recv[0], scales, recv[2], recv[3])
    out_x = buffer.dispatch(x, handle=handle)[0]
    assert isinstance(out_x, tuple) and out_x[1] is scales

    host_path.answer = (torch.zeros(3, 8), None)
    combined, combined_weights, event = buffer.combine(torch.zeros(5, 8), handle)
    assert host_path.calls == ["cached_dispatch", "cached_dispatch", "combine"]
    assert combined is host_path.answer[0] and combined_weights is None and event.event is None


def test_an_uncached_dispatch_asks_the_host_path_first():
    host_path = _RecordingHostPath(None)
    buffer = _Buffer(host_path)
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    topk_idx = torch.zeros(3, 2, dtype=torch.int64)
    # The host path declines (None): the Python path takes the call and refuses the CPU tensor.
    with pytest.raises(Exception, match="must be on this buffer's device"):
        buffer.dispatch(x, topk_idx, do_cpu_sync=False)
    assert host_path.calls == ["begin_dispatch"]


@pytest.mark.parametrize(
    "options",
    [
        {"previous_event": EventOverlap("recorded")},
        {"async_with_compute_stream": True},
        {"allocate_on_comm_stream": True},
        {"num_qps": 1},
        {"previous_event_before_epilogue": EventOverlap("recorded")},
        {"use_tma_aligned_col_major_sf": True},
        {"zero_copy_recv": True},
        {"num_sms": 1.0},
        {"expert_alignment": 2},
        {"do_expand": True},
        {"num_experts": 8},
        {"num_max_tokens_per_rank": 16},
    ],
    ids=lambda options: next(iter(options)),
)
def test_other_dispatch_arguments_stay_on_the_python_path(options):
    host_path = _RecordingHostPath(None)
    buffer = _Buffer(host_path)
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    with pytest.raises(Exception):  # noqa: B017 - the Python path refuses the CPU tensor, or the fake's gaps
        buffer.dispatch(x, handle=_owned_handle(), **options)
    assert host_path.calls == []


@pytest.mark.parametrize(
    "options",
    [
        {"bias": torch.zeros(3, 8, dtype=torch.bfloat16)},
        {"zero_copy": True},
        {"previous_event": EventOverlap("recorded")},
        {"async_with_compute_stream": True},
        {"allocate_on_comm_stream": True},
        {"num_qps": 1},
        {"num_sms": 1.0},
    ],
    ids=lambda options: next(iter(options)),
)
def test_other_combine_arguments_stay_on_the_python_path(options):
    host_path = _RecordingHostPath(None)
    buffer = _Buffer(host_path)
    with pytest.raises(Exception):  # noqa: B017 - as above
        buffer.combine(torch.zeros(5, 8), _owned_handle(), **options)
    assert host_path.calls == []


def test_a_handle_of_another_buffer_stays_on_the_python_path():
    host_path = _RecordingHostPath(None)
    buffer = _Buffer(host_path)
    handle = _owned_handle()
    handle.owner_id = 2
    with pytest.raises(ValueError):  # the Python path checks x first (a CPU tensor here)
        buffer.dispatch(torch.zeros(3, 8, dtype=torch.bfloat16), handle=handle)
    with pytest.raises(ValueError, match="handle comes from a dispatch of another buffer"):
        buffer.combine(torch.zeros(5, 8), handle)
    assert host_path.calls == []


class _Call:
    """The HtCall fields the handle is built from."""

    num_experts = 8
    num_max_tokens_per_rank = 16
    hybrid = False
    scaleout_row_bytes = 0


def _notify_block(num_tokens: int, num_topk: int) -> tuple:
    """NotifyBlock.to_python's arrays (routing, slots, counts fields, hybrid, send base, rank prefix
    matrix, scratch)."""
    ints = torch.zeros(4, dtype=torch.int32)
    matrix = torch.zeros(2, 2, dtype=torch.int32)
    return (torch.zeros(num_tokens, num_topk, dtype=torch.int64), *([ints] * 9), None, None, matrix, ints)


class _UncachedHostPath(_RecordingHostPath):
    """begin_dispatch succeeds; finish_dispatch answers `finish` (outputs, or the count wait's int)
    and, for outputs, fills the handle's sizes as the C++ host path does after its wait."""

    def __init__(self, finish: Any) -> None:
        super().__init__(None)
        self.finish = finish
        self.finish_arguments: tuple = ()

    def begin_dispatch(self, runtime, x, topk_idx, topk_weights, *rest):
        self.calls.append("begin_dispatch")
        return _Call(), 4, _notify_block(*topk_idx.shape)

    def finish_dispatch(self, runtime, call, handle, do_expand, expert_alignment, has_weights, cpu_sync, stream):
        self.calls.append("finish_dispatch")
        self.finish_arguments = (do_expand, expert_alignment, has_weights, cpu_sync)
        if cpu_sync and type(self.finish) is not int:
            handle.num_recv_tokens = 5
        return self.finish


class _JoinRecordingRuntime:
    def __init__(self) -> None:
        self.joins = 0

    def join_streams(self, waiting, signalling):
        self.joins += 1


class _Stream:
    cuda_stream = 0


def _uncached_buffer(host_path: _UncachedHostPath) -> _Buffer:
    buffer = _Buffer(host_path)
    buffer._runtime = _JoinRecordingRuntime()
    buffer._comm_stream = _Stream()
    return buffer


def test_an_uncached_dispatch_on_the_host_path_returns_its_outputs_and_a_handle_with_the_sizes():
    outputs = (torch.zeros(5, 8), torch.zeros(5, 1), torch.zeros(5, 2, dtype=torch.int64), None)
    host_path = _UncachedHostPath(outputs)
    buffer = _uncached_buffer(host_path)
    recv_x, recv_topk_idx, recv_weights, handle, _ = buffer.dispatch(
        torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int64)
    )
    assert host_path.calls == ["begin_dispatch", "finish_dispatch"]
    assert host_path.finish_arguments == (False, 1, False, True)
    assert recv_x == (outputs[0], outputs[1]) and recv_topk_idx is outputs[2] and recv_weights is None
    assert handle.num_recv_tokens == 5 and handle.owner_id == buffer._serial and handle.num_sms == 4
    assert handle.rank_prefix_matrix.shape == (2, 2)  # the notify block's, filled by the notify kernel
    assert buffer._runtime.joins == 0


def test_an_unsynced_dispatch_on_the_host_path_gets_worst_case_sizes_before_finishing():
    host_path = _UncachedHostPath((torch.zeros(32, 8), None, None, None))
    buffer = _uncached_buffer(host_path)
    *_, handle, _ = buffer.dispatch(
        torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int64), do_cpu_sync=False
    )
    assert host_path.finish_arguments[3] is False
    # R * T_max rows (2 ranks, 16 tokens), set by high_throughput.py, not by the host path.
    assert handle.num_recv_tokens == 32


@pytest.mark.parametrize("wait_value", [-1, -2, 1])
def test_a_failed_count_wait_on_the_host_path_joins_the_streams_and_raises_what_the_buffer_reports(wait_value):
    host_path = _UncachedHostPath(wait_value)
    buffer = _uncached_buffer(host_path)
    seen = []

    def check_mapped_wait(value):
        seen.append(("wait", value))
        if value < 0:
            raise RuntimeError(f"wait ended on {value}")

    def check_device_errors():
        seen.append(("errors",))
        raise ValueError("a bad expert id")

    buffer._check_mapped_wait = check_mapped_wait
    buffer._check_device_errors = check_device_errors
    expected = RuntimeError if wait_value < 0 else ValueError
    with pytest.raises(expected):
        buffer.dispatch(torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int64))
    # The kernels may still read the handle's arrays and the inputs: the caller's stream waits for them.
    assert buffer._runtime.joins == 1
    assert seen[0] == ("wait", wait_value) and (wait_value < 0 or seen[1] == ("errors",))
