"""The core's dispatch outputs given V1's meanings and shapes: weights of slots naming other ranks'
experts zeroed, and with ``num_worst_tokens`` every output fitted to exactly that many rows (padding
rows marked -1 / weight 0). Device ops on the current stream, no sync.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from deep_ep.handle import EPHandle

__all__ = ["fit_rows", "mask_rows_past", "v1_dispatch_outputs", "zero_foreign_weights"]


def zero_foreign_weights(recv_topk_idx: torch.Tensor, recv_topk_weights: torch.Tensor) -> torch.Tensor:
    """V1's received weights: 0 where ``recv_topk_idx`` is -1 (the expert lives on another rank, or the
    slot is empty). In place; returns ``recv_topk_weights``."""
    return recv_topk_weights.masked_fill_(recv_topk_idx < 0, 0.0)


def mask_rows_past(recv_topk_idx: torch.Tensor, num_valid: torch.Tensor) -> torch.Tensor:
    """Set rows ``>= num_valid`` (a one-element tensor on the same device, read there: no sync) to -1,
    in place: the padding rows of a ``num_worst_tokens`` dispatch. Returns ``recv_topk_idx``."""
    rows = torch.arange(recv_topk_idx.shape[0], device=recv_topk_idx.device)
    return recv_topk_idx.masked_fill_((rows >= num_valid.to(rows.dtype)).unsqueeze(1), -1)


def fit_rows(tensor: torch.Tensor | None, num_rows: int, fill: float, empty: Any = None) -> torch.Tensor | None:
    """``tensor`` with exactly ``num_rows`` rows: a view of its first rows, or (when it has fewer) a new
    tensor holding it followed by rows of ``fill``. ``empty(shape, dtype, device)`` allocates that new
    tensor (default ``torch.empty``)."""
    if tensor is None:
        return None
    if num_rows <= tensor.shape[0]:
        return tensor.narrow(0, 0, num_rows)
    allocate = empty or (lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device))
    padded = allocate((num_rows, *tensor.shape[1:]), tensor.dtype, tensor.device)
    padded[: tensor.shape[0]].copy_(tensor)
    padded[tensor.shape[0] :].fill_(fill)
    return padded


def v1_dispatch_outputs(
    recv_x: Any,
    recv_topk_idx: torch.Tensor | None,
    recv_topk_weights: torch.Tensor | None,
    core_handle: EPHandle,
    num_worst_tokens: int,
    empty: Any = None,
) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle]:
    """The core's uncached dispatch outputs with V1's meanings (device ops on the current stream, no sync).

    Weights of -1 slots are zeroed in place. ``num_worst_tokens > 0`` (the core ran without CPU sync
    and sized its outputs ``R * T_max`` rows, writing the received prefix only): every output gets
    exactly ``num_worst_tokens`` rows (a view, or a padded copy through ``empty``), rows past the
    received count get ``recv_topk_idx = -1`` (hence weight 0), and the returned EPHandle is a copy of
    ``core_handle`` describing ``num_worst_tokens`` rows (combine then takes x of that many rows, a
    cached dispatch allocates that many; only the received prefix is read or written)."""
    if num_worst_tokens > 0:
        core_rows = core_handle.num_recv_tokens
        rows = num_worst_tokens
        if isinstance(recv_x, (tuple, list)):
            recv_x = (fit_rows(recv_x[0], rows, 0, empty), fit_rows(recv_x[1], rows, 0, empty))
        else:
            recv_x = fit_rows(recv_x, rows, 0, empty)
        recv_topk_idx = fit_rows(recv_topk_idx, rows, -1, empty)
        recv_topk_weights = fit_rows(recv_topk_weights, rows, 0.0, empty)
        if recv_topk_idx is not None:
            mask_rows_past(recv_topk_idx, core_handle.psum_num_recv_tokens_per_source[-1:])
        core_handle = dataclasses.replace(
            core_handle,
            num_recv_tokens=rows,
            recv_src_info=core_handle.recv_src_info.narrow(0, 0, min(rows, core_rows)),
        )
    if recv_topk_weights is not None and recv_topk_idx is not None:
        zero_foreign_weights(recv_topk_idx, recv_topk_weights)
    return recv_x, recv_topk_idx, recv_topk_weights, core_handle
