"""Where the extra work of a V1 ``Buffer`` call runs and its new tensors are allocated (V1's stream
rules over the core's communication stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from deep_ep.buffer import ElasticBuffer
from deep_ep.event import stream_capturing

__all__ = ["Streams"]


class Streams:
    """Where a call's extra work runs and its new tensors are allocated, with V1's rules: work on the
    communication stream when asked (async or previous_event), allocations on the comm stream when
    ``allocate_on_comm_stream`` (and then handed to the caller's stream with record_stream)."""

    def __init__(self, buffer: ElasticBuffer, *, work_on_comm: bool, allocate_on_comm: bool) -> None:
        self.compute = torch.cuda.current_stream(buffer.device)
        self.comm = buffer.get_comm_stream()
        self.work = self.comm if work_on_comm else self.compute
        self.alloc = self.comm if allocate_on_comm else self.compute
        self.allocated: list[torch.Tensor] = []

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        with torch.cuda.stream(self.alloc):
            tensor = torch.empty(tuple(shape), dtype=dtype, device=device)
        self.allocated.append(tensor)
        return tensor

    def working(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.work) if self.work is not self.compute else contextlib.nullcontext()

    def hand_over(self) -> None:
        if self.alloc is self.comm and not stream_capturing():
            for tensor in self.allocated:
                tensor.record_stream(self.compute)
