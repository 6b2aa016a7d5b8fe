"""EventOverlap: lets a caller overlap communication with compute and wait when it needs the result."""

from __future__ import annotations

from typing import Any

import torch


class EventOverlap:
    """A CUDA event recorded on the communication stream, plus tensors to keep alive until waited on.

    ``extra_tensors`` hold references (instead of ``record_stream``) so the caching allocator cannot
    reuse memory the communication stream still reads or writes.
    """

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: tuple[Any, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the event (no host synchronisation)."""
        if self.event is None:
            raise RuntimeError("EventOverlap has no event to wait on")
        torch.cuda.current_stream().wait_event(self.event)
        self.extra_tensors = None

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()
