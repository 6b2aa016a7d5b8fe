"""Small helpers several deep_ep modules share, defined once here (tests/cpu/test_python_layering.py
holds every top-level helper to one definition). Private to the package: not part of the API."""

from __future__ import annotations

from typing import Any

import torch

from deep_ep.event import EventOverlap

__all__ = ["align_up", "cuda_event", "describe", "describe_with_device", "pointer"]


def describe(tensor: torch.Tensor) -> str:
    """``tensor``'s dtype and shape as error messages name them, e.g. ``bfloat16 [4, 7168]``."""
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def describe_with_device(value: Any) -> str:
    """A tensor's dtype, shape and device (``bfloat16 [4, 7168] on cuda:0``); any other object's
    type name."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    return f"{describe(value)} on {value.device}"


def align_up(value: int, alignment: int) -> int:
    """``value`` rounded up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


def pointer(tensor: torch.Tensor | None) -> int:
    """``tensor``'s data address, 0 for None (the kernels' "no tensor")."""
    return 0 if tensor is None else tensor.data_ptr()


def cuda_event(event: EventOverlap | torch.cuda.Event) -> torch.cuda.Event:
    """The CUDA event an ``EventOverlap`` holds, or ``event`` itself."""
    return event.event if isinstance(event, EventOverlap) else event
