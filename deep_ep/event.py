"""EventOverlap: lets a caller overlap communication with compute and wait when it needs the result."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


class EventOverlap:
    """A CUDA event recorded on the communication stream, plus tensors to keep alive until waited on.

    ``extra_tensors`` hold references (instead of ``record_stream``) so the caching allocator cannot
    reuse memory the communication stream still reads or writes. DeepEP V2's additions are here
    too: one hook to run right after the wait (``register_hook_after_wait``) and calling the object
    as a shorthand for ``current_stream_wait``.
    """

    def __init__(self, event: torch.cuda.Event | None = None, extra_tensors: tuple[Any, ...] | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors
        self._hook_after_wait: Callable[[], Any] | None = None

    def register_hook_after_wait(self, hook: Callable[[], Any]) -> None:
        """Run ``hook()`` once, right after the next ``current_stream_wait`` (work it launches is
        ordered after the event on the current stream). One hook per event (DeepEP V2's rule)."""
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if self._hook_after_wait is not None:
            raise RuntimeError("this EventOverlap already has a hook after wait; only one may be registered")
        self._hook_after_wait = hook

    def current_stream_wait(self, release_handle: bool = False) -> None:
        """Make the current stream wait for the event (no host synchronisation), then run the hook
        registered with ``register_hook_after_wait`` (once). The kept tensors are released after
        the wait whatever ``release_handle`` says (DeepEP V2's flag; accepted for its callers)."""
        if self.event is None:
            raise RuntimeError("EventOverlap has no event to wait on")
        torch.cuda.current_stream().wait_event(self.event)
        self.extra_tensors = None
        hook, self._hook_after_wait = self._hook_after_wait, None
        if hook is not None:
            hook()

    def __call__(self, release_handle: bool = False) -> None:
        """DeepEP V2's shorthand for ``current_stream_wait(release_handle)``."""
        self.current_stream_wait(release_handle)

    def __enter__(self) -> EventOverlap:
        return self

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if self.event is not None:
            self.current_stream_wait()


def event_or_none(previous_event: Any) -> Any:
    """``previous_event`` as the calls use it: an ``EventOverlap`` that holds no event (what a
    synchronous call returns, and what clients such as Megatron pass on) means no event, as in
    DeepEP. Anything else is returned unchanged for the call's own type check."""
    if isinstance(previous_event, EventOverlap) and previous_event.event is None:
        return None
    return previous_event


@functools.cache
def _cuda_present() -> bool:
    # torch.cuda.is_available() reads the environment and counts devices on every call (a few µs
    # on the uncached dispatch's path to its first launch); the answer does not change.
    return torch.cuda.is_available()


def stream_capturing() -> bool:
    """True inside CUDA-graph capture on the current stream (False without CUDA)."""
    return _cuda_present() and torch._C._cuda_isCurrentStreamCapturing()
