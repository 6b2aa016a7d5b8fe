"""``deep_ep.utils.testing`` as DeepEP's test scripts import it: ``bench`` (CUDA-event timing) and
``bench_kineto`` (per-kernel device time from the torch profiler), with the output suppression and
L2 flush they use.

``bench_kineto`` finds a kernel by a substring of its name, as DeepEP's does. This library's
kernels are named so that DeepEP's scripts find them: low-latency ``ll_dispatch_kernel`` and
``ll_combine_kernel`` (the words "dispatch" and "combine" each match one of them), high-throughput
``dispatch_impl`` (``dispatch_impl_hybrid`` across nodes), ``dispatch_copy_epilogue_impl``,
``combine_impl`` (``combine_impl_pull``), ``combine_reduce_epilogue_impl`` and ``notify_kernel``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "bench",
    "bench_kineto",
    "empty_suppress",
    "flush_l2_cache",
    "kernel_durations_from_table",
    "kineto_table_lines",
    "suppress_stdout_stderr",
]

# Bytes written to evict the L2 cache (larger than any current GPU's L2).
L2_FLUSH_BYTES = 256_000_000


def flush_l2_cache(enabled: bool = True) -> None:
    """Evict the GPU's L2 cache by zeroing a 256 MB buffer (nothing when ``enabled`` is False or
    there is no GPU)."""
    if enabled and torch.cuda.is_available():
        torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int, device="cuda").zero_()


def bench(
    fn: Callable[[], Any],
    num_warmups: int = 50,
    num_tests: int = 50,
    post_fn: Callable[[], Any] | None = None,
    flush_l2: bool = True,
) -> tuple[float, float, float]:
    """``(average, minimum, maximum)`` seconds of ``fn()`` over ``num_tests`` timed calls after
    ``num_warmups`` untimed ones; the first timed call is left out of the statistics (so
    ``num_tests`` must be at least 2).

    Each call is timed by CUDA events around it on the current stream, after an L2 flush
    (``flush_l2``); ``post_fn()`` runs after each timed call, outside the timing. Without a GPU the
    calls are timed by the host clock instead (DeepEP's ``bench`` needs a GPU).
    """
    if num_tests < 2:
        raise ValueError(f"num_tests must be at least 2 (the first timed call is dropped), got {num_tests}")
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.synchronize()
    for _ in range(num_warmups):
        fn()
    if on_gpu:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(num_tests)
        ]
        for start, end in events:
            flush_l2_cache(flush_l2)
            start.record()
            fn()
            end.record()
            if post_fn is not None:
                post_fn()
        torch.cuda.synchronize()
        seconds = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        seconds = []
        for _ in range(num_tests):
            begin = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - begin)
            if post_fn is not None:
                post_fn()
    times = np.array(seconds[1:])
    return float(np.average(times)), float(np.min(times)), float(np.max(times))


class empty_suppress:  # noqa: N801 - DeepEP's name
    """A context manager that does nothing (``bench_kineto`` without output suppression)."""

    def __enter__(self) -> empty_suppress:
        return self

    def __exit__(self, *_: Any) -> None:
        pass


class suppress_stdout_stderr:  # noqa: N801 - DeepEP's name
    """Send this process's stdout and stderr to /dev/null inside the block: file descriptors 1 and 2
    (so output of native code, the profiler's, is silenced too) and ``sys.stdout`` / ``sys.stderr``."""

    def __enter__(self) -> suppress_stdout_stderr:
        sys.stdout.flush()
        sys.stderr.flush()
        self._devnull = open(os.devnull, "w")  # noqa: SIM115 - closed in __exit__
        self._saved_fds = [(fd, os.dup(fd)) for fd in (1, 2)]
        self._streams = (sys.stdout, sys.stderr)
        for fd, _ in self._saved_fds:
            os.dup2(self._devnull.fileno(), fd)
        sys.stdout = sys.stderr = self._devnull
        return self

    def __exit__(self, *_: Any) -> None:
        self._devnull.flush()
        sys.stdout, sys.stderr = self._streams
        for fd, saved in self._saved_fds:
            os.dup2(saved, fd)
            os.close(saved)
        self._devnull.close()


# Units of the profiler table's time columns, longest suffix first ("ms" and "us" end with "s").
_TIME_UNITS = (("ms", 1e3), ("us", 1e6), ("ns", 1e9), ("s", 1.0))


def _seconds(cell: str) -> float:
    for unit, per_second in _TIME_UNITS:
        if cell.endswith(unit):
            return float(cell[: -len(unit)]) / per_second
    raise ValueError(f"not a profiler time: {cell!r}")


def kineto_table_lines(profiler: Any) -> list[str]:
    """The lines of ``profiler``'s key_averages table as ``bench_kineto`` reads it (sorted by total
    CUDA time, names up to 100 characters): each kernel name must match at most one line."""
    return profiler.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")


def kernel_durations_from_table(table_lines: list[str], kernel_names: tuple[str, ...]) -> list[float]:
    """Average seconds per call of each name's row in a profiler ``key_averages().table()`` (rows
    whose text contains the name; its last two columns are the average device time and the call
    count), weighted by calls over the rows; 0 for a name in no row. Raises ``AssertionError`` when
    a name is in more than one row, as DeepEP's ``bench_kineto`` does."""
    for name in kernel_names:
        rows = [line for line in table_lines if name in line]
        assert len(rows) <= 1, f"Errors of the kernel {name} in the profiling table: {table_lines}"
    durations = []
    for name in kernel_names:
        total_seconds, total_calls = 0.0, 0
        for line in table_lines:
            if name not in line:
                continue
            cells = line.split()
            calls = int(cells[-1])
            total_seconds += _seconds(cells[-2]) * calls
            total_calls += calls
        durations.append(total_seconds / total_calls if total_calls > 0 else 0)
    return durations


def _durations_per_period(trace: dict, kernel_name: str, num_kernels_per_period: int) -> list[float]:
    """Average seconds of the i-th kernel of each period (``i < num_kernels_per_period``) among the
    trace's kernels whose name contains ``kernel_name``, in launch order."""
    events = [
        event
        for event in trace["traceEvents"]
        if event.get("cat", "kernel") == "kernel" and kernel_name in event.get("name", "")
    ]
    durations = [event["dur"] / 1e6 for event in sorted(events, key=lambda event: event["ts"])]
    assert durations and len(durations) % num_kernels_per_period == 0, (
        f"{len(durations)} kernels named {kernel_name} do not form periods of {num_kernels_per_period}"
    )
    num_periods = len(durations) // num_kernels_per_period
    return [sum(durations[i::num_kernels_per_period]) / num_periods for i in range(num_kernels_per_period)]


def bench_kineto(
    fn: Callable[[], Any],
    kernel_names: str | tuple[str, ...],
    num_tests: int = 30,
    suppress_kineto_output: bool = False,
    trace_path: str | None = None,
    flush_l2: bool = True,
    barrier_comm_profiling: bool = False,
    num_kernels_per_period: int = 1,
    barrier: Callable[[], Any] | None = None,
) -> float | list:
    """Average device seconds per launch of each kernel in ``kernel_names`` (a name, or a tuple of
    names: then a list in that order) over ``num_tests`` calls of ``fn``, from the torch profiler.

    ``fn`` runs once unprofiled, then ``2 * num_tests`` times under the profiler (one warm-up step
    of ``num_tests`` calls, one recorded step), each call after an L2 flush (``flush_l2``). With
    ``barrier_comm_profiling`` each call is preceded by a ~10 ms sleep kernel and a barrier
    (``barrier()``, default an all-reduce of one element over the default group) so that ranks
    start together (``EP_DISABLE_BARRIER_PROFILING=1`` turns that off). A kernel is every row of
    the profiler's table (``key_averages().table(sort_by='cuda_time_total',
    max_name_column_width=100)``) whose text contains the name: a name in more than one row raises
    ``AssertionError``, a name in none gives 0. ``suppress_kineto_output`` silences stdout and
    stderr while profiling; ``trace_path`` saves a Chrome trace there.

    ``num_kernels_per_period > 1``: ``fn`` launches that many kernels of each name (e.g. a send and
    a receive phase); each name's entry is then a list of the average seconds of the i-th kernel of
    every call. With ``EP_USE_NVIDIA_TOOLS=1`` (running under Nsight or compute-sanitizer, which
    conflict with the profiler) nothing is measured and every duration is 1.

    Differences from DeepEP: per-period kernels are found by a substring of the kernel's name, as
    in the table (DeepEP needs ``::name``, a kernel named ``name`` in a namespace), and the table's
    times may also be in seconds or nanoseconds.
    """
    if not isinstance(kernel_names, (str, tuple)):
        raise TypeError(f"kernel_names must be a str or a tuple of str, got {type(kernel_names).__name__}")
    names = (kernel_names,) if isinstance(kernel_names, str) else kernel_names
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"kernel_names must be a str or a tuple of str, got {kernel_names!r}")
    as_tuple = isinstance(kernel_names, tuple)
    if int(os.environ.get("EP_USE_NVIDIA_TOOLS", 0)):
        return (1,) * len(names) if as_tuple else 1

    fn()  # unprofiled: first-call tuning and its prints stay out of the profile
    torch.cuda.synchronize()

    barrier_comm_profiling = barrier_comm_profiling and int(os.environ.get("EP_DISABLE_BARRIER_PROFILING", 0)) == 0
    quiet = suppress_stdout_stderr if suppress_kineto_output else empty_suppress
    with quiet():
        schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CUDA], schedule=schedule, acc_events=True
        )
        one = torch.ones(1, dtype=torch.float, device="cuda")
        with profiler:
            for _ in range(2):
                for _ in range(num_tests):
                    flush_l2_cache(flush_l2)
                    if barrier_comm_profiling:
                        # A long kernel first, so that a late rank's launch overhead is hidden before
                        # the barrier lines the ranks up.
                        torch.cuda._sleep(20_000_000)
                        if barrier is None:
                            dist.all_reduce(one)
                        else:
                            barrier()
                    fn()
                torch.cuda.synchronize()
                profiler.step()

    durations: list[Any] = kernel_durations_from_table(kineto_table_lines(profiler), names)
    if trace_path is not None:
        profiler.export_chrome_trace(trace_path)
    if num_kernels_per_period > 1:
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / "trace.json"
            profiler.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        durations = [_durations_per_period(trace, name, num_kernels_per_period) for name in names]
    return durations if as_tuple else durations[0]
