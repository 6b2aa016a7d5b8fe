"""EventOverlap without a GPU: the current stream is replaced by a recorder of the waits."""

from __future__ import annotations

import pytest
import torch

from deep_ep.event import EventOverlap, event_or_none


class RecordingStream:
    def __init__(self, log: list) -> None:
        self.log = log

    def wait_event(self, event: object) -> None:
        self.log.append(("wait", event))


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list:
    waits: list = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: RecordingStream(waits))
    return waits


def test_wait_then_the_hook_runs_once_and_the_kept_tensors_are_released(log: list) -> None:
    kept = torch.zeros(2)
    event = EventOverlap("event", extra_tensors=(kept,))
    event.register_hook_after_wait(lambda: log.append("hook"))
    event.current_stream_wait(release_handle=True)
    assert log == [("wait", "event"), "hook"] and event.extra_tensors is None
    event()  # the shorthand waits again; the hook ran once already
    assert log == [("wait", "event"), "hook", ("wait", "event")]


def test_one_hook_per_event_and_it_must_be_callable(log: list) -> None:
    event = EventOverlap("event")
    with pytest.raises(TypeError, match="hook must be callable"):
        event.register_hook_after_wait(42)  # type: ignore[arg-type]
    event.register_hook_after_wait(lambda: None)
    with pytest.raises(RuntimeError, match="only one may be registered"):
        event.register_hook_after_wait(lambda: None)


def test_no_event_raises_and_the_context_manager_waits_only_with_one(log: list) -> None:
    with pytest.raises(RuntimeError, match="no event to wait on"):
        EventOverlap(None)()
    with EventOverlap(None):
        pass
    with EventOverlap("event"):
        pass
    assert log == [("wait", "event")]


def test_an_event_overlap_holding_no_event_means_no_previous_event() -> None:
    # What a synchronous get_dispatch_layout returns; Megatron passes it on as previous_event.
    assert event_or_none(EventOverlap(None)) is None
    assert event_or_none(None) is None
    recorded = EventOverlap("event")
    assert event_or_none(recorded) is recorded
    assert event_or_none("not an event") == "not an event"  # left to the call's own type check
