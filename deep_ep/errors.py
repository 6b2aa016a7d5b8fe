"""Exceptions raised by deep_ep."""

from __future__ import annotations

from collections.abc import Iterable


class CommTimeoutError(RuntimeError):
    """A peer never arrived at a device (or host) wait before the deadline.

    The buffer that raised it refuses further work until ``destroy()``: its peers are out of step.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int = -1,
        peer: int = -1,
        operation: str = "",
        phase: str = "",
        expected: int = 0,
        seen: int = 0,
        peer_progress: int = -1,
        call_serial: int = 0,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.operation = operation
        self.phase = phase
        self.expected = expected
        self.seen = seen
        # Barrier timeouts: the barriers the peer completed by its own count (-1: not known).
        self.peer_progress = peer_progress
        # The serial of the buffer call whose kernel timed out (0: not known); the message names it.
        self.call_serial = call_serial


class BufferTooSmallError(ValueError):
    """An operation needs more bytes of the symmetric window than the buffer holds."""

    def __init__(self, message: str, *, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


class PeerInputError(ValueError):
    """Another rank's input to an operation failed its checks: that rank raised the details, took
    part in the operation without data (so no rank waited for it) and announced it. This rank's result
    of that operation lacks the rank's contribution and must not be used; the buffer stays usable.
    Raised at the next synchronisation point (a CPU-synced dispatch, ``barrier(with_cpu_sync=True)``,
    ``check_errors()``)."""

    def __init__(self, message: str, *, rank: int = -1, operation: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.operation = operation


def timeout_message(record: dict, timeout_secs: float, call_names: dict[int, str] | None = None) -> str:
    """The CommTimeoutError text for a device error record (``Runtime.error_record()``).
    ``call_names``: the buffer's call log (serial -> name), to name the call the waiting kernel
    belongs to (``record["call_serial"]``, 0 when unknown)."""
    waited_for = f"rank {record['peer']}" if record["peer"] >= 0 else "the other CTAs of its own kernel"
    serial = record.get("call_serial", 0)
    call = ""
    if serial > 0:
        name = (call_names or {}).get(serial)
        call = f" (call #{serial}{', ' + name if name else ''})"
    message = (
        f"rank {record['rank']}: {record['operation']}{call} timed out after {timeout_secs:g} s in phase "
        f"'{record['phase']}' waiting for {waited_for} (expected {record['expected']}, saw {record['seen']})"
    )
    progress = record.get("peer_progress", -1)
    if record["peer"] >= 0 and progress >= 0:
        if progress >= record["expected"]:
            message += (
                f"; rank {record['peer']} had completed {progress} barriers by its own count, so it passed this one "
                "but its arrival never became visible here"
            )
        else:
            message += f"; rank {record['peer']} had completed {progress} barriers by its own count"
    return message + "; the buffer refuses further work until destroy()"


def recent_calls_message(calls: Iterable[tuple[int, str, float]], now: float) -> str:
    """`` Calls this rank issued last (...)``: the buffer's call log (serial, name, monotonic time of
    the call) as a sentence for a timeout report, or "" when empty. Ranks issue the same calls in the
    same order, so comparing the serials in the reports of several ranks shows which call each rank
    had reached (the device wait that timed out belongs to one of them, or to an earlier one still
    running on the GPU)."""
    items = [f"#{serial} {name} ({now - issued:.1f} s ago)" for serial, name, issued in calls]
    return f". Calls this rank issued last: {', '.join(items)}" if items else ""
