"""Zero-copy tensor views of a buffer's symmetric window.

The low-latency receive slots *are* the packed output tensors, so the result of a dispatch is a view
of the window rather than a copy. The view holds a reference to the window's owner (the buffer's
runtime, through the CUDA array interface object torch keeps alive), so implicit teardown never
frees the window under a live view; an explicit ``destroy()`` frees it regardless, and views must
not be used after it. The owner is the runtime, not the buffer: the buffer caches its views, and a
view holding the buffer would make a reference cycle that only Python's cyclic GC breaks.
"""

from __future__ import annotations

from typing import Any

import torch


class _WindowSpan:
    """A span of device memory exposed through ``__cuda_array_interface__`` as uint8."""

    def __init__(self, owner: Any, pointer: int, num_bytes: int) -> None:
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (num_bytes,),
            "typestr": "|u1",
            "data": (pointer, False),
            "version": 3,
            "strides": None,
            # Stream ordering is the caller's job (every use is ordered on the stream that wrote it).
            "stream": None,
        }


def window_tensor(
    owner: Any, base_pointer: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A tensor of ``shape``/``dtype`` over ``[base_pointer + offset, ...)``, keeping ``owner`` alive."""
    num_elements = 1
    for size in shape:
        num_elements *= size
    num_bytes = num_elements * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.as_tensor(_WindowSpan(owner, base_pointer + offset, num_bytes), device=device)
    return raw.view(dtype).view(shape)
