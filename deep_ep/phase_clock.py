"""Phase clock: where the time goes inside the communication kernels (profiling, opt-in).

With ``EP_PHASE_CLOCK=1`` in the environment when a buffer is built, the notify, HT dispatch and
LL kernels stamp the GPU's global nanosecond timer at the boundaries of their phases, per CTA,
into device memory (an L2 write each). Off (the default) a stamp is one skipped branch.

``read(buffer)`` returns, per kernel that ran since the last read, the kernel's first CTA entry
(``start_ns``, GPU clock) and for every phase the time the *last* CTA reached it, in µs after
``start_ns``. Read after synchronising; stamps are per call, so read (and reset) after each call
you want to see. One global timer serves the whole GPU: ranks sharing a GPU can compare
``start_ns`` directly (``across_ranks``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from deep_ep import _C

ENV = "EP_PHASE_CLOCK"

KernelPhases = dict[str, Any]  # {"start_ns": int, "<stamp>": µs after start or None}


def requested() -> bool:
    """Whether ``EP_PHASE_CLOCK=1``: buffers built now get a phase clock."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def summarise(stamps: Sequence[int]) -> dict[str, KernelPhases]:
    """Raw stamps ([kernel][CTA][stamp] ns, 0 = not reached) into per-kernel phase times."""
    kernels = list(_C.PHASE_CLOCK_KERNELS.items())
    ctas, per_cta = int(_C.PHASE_CLOCK_CTAS), int(_C.PHASE_CLOCK_STAMPS)
    if len(stamps) != len(kernels) * ctas * per_cta:
        raise ValueError(f"expected {len(kernels) * ctas * per_cta} stamps, got {len(stamps)}")
    result: dict[str, KernelPhases] = {}
    for index, (kernel, names) in enumerate(kernels):
        rows = [stamps[(index * ctas + cta) * per_cta : (index * ctas + cta + 1) * per_cta] for cta in range(ctas)]
        starts = [row[0] for row in rows if row[0] != 0]
        if not starts:
            continue
        start = min(starts)
        phases: KernelPhases = {"start_ns": start}
        for position, name in enumerate(names):
            reached = [row[position] for row in rows if row[position] != 0]
            phases[name] = (max(reached) - start) / 1e3 if reached else None
        result[kernel] = phases
    return result


def read(buffer: Any, reset: bool = True) -> dict[str, KernelPhases]:
    """The buffer's phase stamps since the last reset, summarised (see the module doc)."""
    runtime = getattr(buffer, "_runtime", None)
    if runtime is None:
        raise RuntimeError("the buffer has no runtime (destroyed?)")
    return summarise(runtime.read_phase_clock(reset))


def across_ranks(per_rank: Sequence[dict[str, KernelPhases]]) -> dict[str, KernelPhases]:
    """Ranks sharing one GPU (one clock): per kernel, ``start_skew_us`` (last rank's entry after the
    first's) and per phase the time the last rank reached it after the first rank's entry."""
    result: dict[str, KernelPhases] = {}
    for kernel in {name for phases in per_rank for name in phases}:
        ranks = [phases[kernel] for phases in per_rank if kernel in phases]
        first = min(rank["start_ns"] for rank in ranks)
        merged: KernelPhases = {"start_skew_us": (max(rank["start_ns"] for rank in ranks) - first) / 1e3}
        for name in _C.PHASE_CLOCK_KERNELS[kernel]:
            reached = [rank["start_ns"] - first + rank[name] * 1e3 for rank in ranks if rank.get(name) is not None]
            merged[name] = max(reached) / 1e3 if reached else None
        result[kernel] = merged
    return result
