"""The HT stream protocol (``_CommLaunch``) joins the right streams in the right direction: the comm
stream waits for the caller's stream (or only for ``previous_event``) before any kernel, and a
synchronous call makes the caller's stream wait for comm at the end, through the runtime's event;
an asynchronous call hands a recorded event to the caller instead. A swapped join would be a race
on the GPU, not a deterministic failure, so the order is pinned here."""

from __future__ import annotations

import pytest
import torch

from deep_ep.event import EventOverlap
from deep_ep.high_throughput import _CommLaunch

COMM = 0x1111
CALLER = 0x2222


class _Runtime:
    def __init__(self) -> None:
        self.joins: list[tuple[int, int]] = []

    def join_streams(self, waiting: int, signalling: int) -> None:
        self.joins.append((waiting, signalling))


class _Stream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


class _Event:
    def __init__(self) -> None:
        self.recorded_on: object = None

    def record(self, stream: object) -> None:
        self.recorded_on = stream


@pytest.fixture
def streams(monkeypatch):
    caller = _Stream(CALLER)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: CALLER)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: caller)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    return _Stream(COMM), caller


def test_a_synchronous_call_joins_comm_after_the_caller_and_the_caller_after_comm(streams):
    comm, _ = streams
    runtime = _Runtime()
    launch = _CommLaunch(runtime, comm, None, False, 0)
    assert launch.stream == COMM
    assert runtime.joins == [(COMM, CALLER)], "comm must wait for the caller's stream before any kernel"
    event = launch.finish(False, ())
    assert runtime.joins == [(COMM, CALLER), (CALLER, COMM)], "the caller's stream must wait for comm at the end"
    assert event.event is None
    assert not launch.on_comm and launch.compute is None


def test_previous_event_replaces_the_first_join_and_outputs_go_on_comm(streams):
    comm, caller = streams
    runtime = _Runtime()
    previous = _Event()
    launch = _CommLaunch(runtime, comm, EventOverlap(previous), False, 0)
    assert comm.waited == [previous] and runtime.joins == [], "comm waits for previous_event only"
    assert launch.on_comm and launch.compute is caller
    launch.finish(False, ())
    assert runtime.joins == [(CALLER, COMM)]


def test_an_asynchronous_call_returns_an_event_recorded_on_comm_and_does_not_join_back(streams):
    comm, _ = streams
    runtime = _Runtime()
    launch = _CommLaunch(runtime, comm, None, False, 0)
    kept = torch.zeros(1)
    event = launch.finish(True, (kept, None))
    assert isinstance(event.event, _Event) and event.event.recorded_on is comm
    assert runtime.joins == [(COMM, CALLER)], "no join back: the caller waits on the event when it wants"
    assert event.extra_tensors == (kept,)
