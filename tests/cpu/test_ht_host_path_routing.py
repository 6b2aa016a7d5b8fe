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

    def combine(self, runtime, x, topk_weights, handle, num_sms, stream):
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
        self._ht_speculative_epilogue = False
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
        {"previous_event": EventOverlap(None)},
        {"async_with_compute_stream": True},
        {"allocate_on_comm_stream": True},
        {"num_qps": 1},
        {"previous_event_before_epilogue": EventOverlap(None)},
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
        {"previous_event": EventOverlap(None)},
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
