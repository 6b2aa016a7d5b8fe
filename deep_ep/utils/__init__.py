"""``deep_ep.utils`` as DeepEP V1's clients import it (Megatron-LM:
``from deep_ep.utils import EventHandle, EventOverlap``), plus ``deep_ep.utils.math``.

``EventOverlap`` is ``deep_ep.event.EventOverlap``. ``EventHandle`` is V1's event type: a CUDA
event recorded on the current stream when it is created. It is a ``torch.cuda.Event``, so it can
be passed wherever this package takes one, e.g. ``previous_event=EventOverlap(EventHandle())``.
"""

from __future__ import annotations

import torch

from deep_ep.event import EventOverlap
from deep_ep.utils import math

__all__ = ["EventHandle", "EventOverlap", "math"]


class EventHandle(torch.cuda.Event):
    """A CUDA event recorded at construction on ``stream`` (default: the current stream).

    ``current_stream_wait()`` makes the then-current stream wait for it (no host synchronisation).
    Needs a CUDA device, like every CUDA event that is recorded.
    """

    def __new__(cls, stream: torch.cuda.Stream | None = None) -> EventHandle:
        return super().__new__(cls)

    def __init__(self, stream: torch.cuda.Stream | None = None) -> None:
        super().__init__()
        self.record(torch.cuda.current_stream() if stream is None else stream)

    def current_stream_wait(self) -> None:
        """Make the current stream wait for this event."""
        torch.cuda.current_stream().wait_event(self)
