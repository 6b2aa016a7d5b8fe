"""Taking part in an operation without data, when this rank's input failed its host checks.

Every dispatch and combine is a protocol all ranks run together: a rank that raised before launching
would leave its peers waiting for it until the GPU timeout, after which their buffers are unusable.
So a rank whose arguments fail a check still launches the operation's kernels with no data and the
"input failed" announcement, then raises. Its peers complete the operation and report
``PeerInputError`` at their next synchronisation point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# The smallest row a launcher accepts (16 bytes of bf16): for calls that move no row.
NULL_HIDDEN = 8


def add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(note)


def take_part_without_input(
    buffer: Any, error: BaseException, launch: Callable[[int, Callable[..., None]], None]
) -> None:
    """Run ``launch(comm_stream_handle, keep)`` on the buffer's communication stream after this rank's
    earlier work, wait for it, and leave the caller's stream ordered after it (``keep(*tensors)`` keeps
    scratch tensors alive until then). Never raises: if this rank cannot take part, a note on
    ``error`` says so (its peers will then time out).

    The wait makes the announcement complete before ``error`` reaches the caller, and lets this rank
    drop its peers' announcements of the same operation: when every rank passed the same bad argument,
    each raises its own error now and none reports the others' later."""
    kept: list[torch.Tensor] = []
    try:
        runtime = buffer._runtime
        had_peer_report = runtime.error_record()["peer_failed_status"] != 0
        comm = buffer._comm_stream
        compute = torch.cuda.current_stream(buffer.device)
    except Exception as failure:  # noqa: BLE001 - the caller raises `error` in any case
        add_note(error, f"this rank could not take part in the operation without data ({failure})")
        return
    try:
        comm.wait_stream(compute)
        launch(comm.cuda_stream, lambda *tensors: kept.extend(tensors))
        comm.synchronize()
    except Exception as failure:  # noqa: BLE001
        add_note(error, f"this rank could not take part in the operation without data ({failure}): peers time out")
        return
    finally:
        compute.wait_stream(comm)
        kept.clear()
    if not had_peer_report:
        runtime.clear_peer_failed()
    add_note(error, "this rank took part in the operation without data; its peers report PeerInputError")
