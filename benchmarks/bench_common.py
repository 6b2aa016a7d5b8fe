"""What the benchmark scripts share: the copy ceiling they normalise by, how ranks are started and
how a step is timed after the ranks are lined up."""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def timed_after_barrier(buffer: Any, step: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """Per run, microseconds from a device barrier's end to the end of ``step`` on this rank; then
    whatever the kernels reported is raised (``buffer.check_errors()``)."""
    for _ in range(warmup):
        step()
    events = []
    for _ in range(iters):
        buffer.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    buffer.check_errors()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def copy_bandwidth_gbs(num_bytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy, counting bytes read + written (the floor's convention)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * num_bytes * iters / (start.elapsed_time(end) * 1e-3) / 1e9


def run_ranks(
    bench_rank: Callable[..., dict[str, Any]], num_ranks: int, config: dict[str, Any]
) -> list[dict[str, Any]] | None:
    """Every rank's result: under torchrun (this process is one rank) gathered on rank 0 (None on the
    others); otherwise ``num_ranks`` processes started by deep_ep.testing.launch."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        num_gpus = torch.cuda.device_count()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % num_gpus)
        dist.init_process_group("nccl" if world <= num_gpus else "gloo")
        result = bench_rank(rank, world, dist.group.WORLD, config)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        dist.destroy_process_group()
        return gathered if rank == 0 else None
    from deep_ep.testing import launch

    return launch(bench_rank, num_ranks, config, timeout_secs=1800)


def save_summary(summary: dict[str, Any], out_dir: str, stem: str, plot: Callable[[dict[str, Any], str], None]) -> None:
    """Write ``out_dir/<stem>.json`` and the plot ``out_dir/<stem>.png`` (drawn by ``plot(summary, path)``)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as file:
        json.dump(summary, file, indent=1)
    plot(summary, os.path.join(out_dir, f"{stem}.png"))


def profiled_kernel_events(buffer: Any, operation: Callable[[], None], runs: int) -> list[Any]:
    """The CUDA events of ``runs`` profiled runs of ``operation``, in launch order.

    A CPU-synced barrier first lines the ranks up: the profiler starts at different moments in
    different processes, and without it the first run's entry barrier (e.g. in an HT notify, or a
    cached dispatch) would absorb that skew. Each run starts after a device barrier, as a timed
    run does."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    buffer.barrier(with_cpu_sync=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            buffer.barrier()
            operation()
        torch.cuda.synchronize()
    events = [event for event in prof.events() if event.device_type == DeviceType.CUDA]
    return sorted(events, key=lambda event: event.time_range.start)


def kernel_times_us(
    buffer: Any, operation: Callable[[], None], kernels: tuple[str, ...], runs: int = 9
) -> dict[str, float]:
    """Median device time of each kernel whose name contains one of ``kernels``, over a few profiled
    runs of ``operation`` (profiled_kernel_events; empty if profiling fails). The median drops
    what is left of the ranks' skew."""
    try:
        durations: dict[str, list[float]] = {}
        for event in profiled_kernel_events(buffer, operation, runs):
            for kernel in kernels:
                if kernel in event.name:
                    durations.setdefault(kernel, []).append(event.time_range.elapsed_us())
        return {kernel: statistics.median(values) for kernel, values in durations.items()}
    except Exception as error:  # noqa: BLE001 - profiling is optional
        print(f"[bench] kernel profiling failed: {error}", file=sys.stderr)
        return {}


def request_phase_clock() -> None:
    """Buffers this process builds from now on get the phase clock (deep_ep.phase_clock). Set as
    the variable, not through deep_ep.phase_clock.ENV, so that the benchmarks still import on an
    ab_compare before side that predates the module."""
    os.environ["EP_PHASE_CLOCK"] = "1"


def phase_times_us(buffer: Any, operation: Callable[[], None], runs: int = 9) -> dict[str, dict[str, Any]]:
    """Where each clocked kernel of ``operation`` spends its time (the buffer needs EP_PHASE_CLOCK=1;
    deep_ep.phase_clock): per kernel, the median over ``runs`` of each phase's time after the
    kernel's first CTA entry (µs; the last CTA to reach it), and each run's entry on the GPU clock
    (``start_ns``) so that ranks sharing a GPU can be compared (``phase_start_skew_us``: the hosts'
    launch skew, including how long each took to read and summarise the previous run's stamps).

    Each run starts after a device barrier, as a timed run does. (A host-synchronised barrier per
    run made it worse: the hosts then left the synchronisation milliseconds apart under MPS.)"""
    from deep_ep import phase_clock

    buffer.barrier(with_cpu_sync=True)
    phase_clock.read(buffer)
    samples: list[dict[str, Any]] = []
    for _ in range(runs):
        buffer.barrier()
        operation()
        torch.cuda.synchronize()
        samples.append(phase_clock.read(buffer))
    result: dict[str, dict[str, Any]] = {}
    for kernel in {name for sample in samples for name in sample}:
        seen = [sample[kernel] for sample in samples if kernel in sample]
        stamps: dict[str, float] = {}
        for name in seen[0]:
            values = [phases[name] for phases in seen if phases.get(name) is not None]
            if name != "start_ns" and values:
                stamps[name] = statistics.median(values)
        result[kernel] = {"stamps_us": stamps, "start_ns": [phases["start_ns"] for phases in seen]}
    return result


def phase_summary(entries: list[dict[str, Any]], same_clock: bool) -> dict[str, Any]:
    """Per kernel, over ranks: each phase's largest median, and (ranks on one GPU, one clock) the
    median over runs of how far after the first rank's entry the last rank's kernel started."""
    summary: dict[str, Any] = {}
    for kernel in sorted({name for entry in entries for name in entry}):
        ranks = [entry[kernel] for entry in entries if kernel in entry]
        stamps: dict[str, float] = {}
        for rank in ranks:
            for name, value in rank["stamps_us"].items():
                stamps[name] = max(stamps.get(name, value), value)
        item: dict[str, Any] = {"stamps_us_max_over_ranks": stamps}
        runs = min(len(rank["start_ns"]) for rank in ranks)
        if same_clock and len(ranks) > 1 and runs > 0:
            skews = [
                (max(rank["start_ns"][i] for rank in ranks) - min(rank["start_ns"][i] for rank in ranks)) / 1e3
                for i in range(runs)
            ]
            item["start_skew_us"] = statistics.median(skews)
        summary[kernel] = item
    return summary


def print_phases(label: str, phases: dict[str, Any]) -> None:
    """One line per kernel: its ranks' start skew and each phase's time after the kernel's entry."""
    for kernel, item in phases.items():
        skew = f" skew={item['start_skew_us']:.1f}" if "start_skew_us" in item else ""
        stamps = " ".join(f"{name}={value:.1f}" for name, value in item["stamps_us_max_over_ranks"].items())
        print(f"  {label} {kernel}:{skew} {stamps}")
