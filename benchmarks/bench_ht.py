"""High-throughput dispatch/combine benchmark (definitions of every figure: docs/performance.md).

    python benchmarks/bench_ht.py --num-ranks 8 --out DIR [--tokens 256,1024,4096,8192]
    torchrun --nproc-per-node 8 benchmarks/bench_ht.py --out DIR

Per token count T and operation: median time over >= 50 CUDA-event-timed runs after warm-up (each
run starts right after a device barrier, so all ranks start together), DeepEP-style bytes and GB/s
per rank, SMs used, per-kernel times (torch.profiler), and the fraction of the HBM floor: bytes
that must move summed over the ranks of a GPU, divided by the device copy bandwidth measured in the
same run. Writes DIR/bench_ht.json and DIR/bench_ht.png.

With --baseline, the same ranks also time dispatch and combine built from all_to_all_single
(benchmarks/a2a_baseline.py) on the same bf16 inputs: rows baseline_dispatch_bf16 and
baseline_combine_bf16 (num_sms 0: NCCL picks its own channels), and speedup_vs_baseline (baseline
time / our time) on the dispatch_bf16 and combine_bf16 rows.

With --num-ranks-per-node S[,S...], the same operations also run on a buffer built with
num_ranks_per_node=S and allow_hybrid_mode=True (hybrid HT mode when S < the group size; a value
equal to the group size is the direct run), after the default buffer's run: every row carries
``mode`` (the buffer's ``ht_mode``, 'direct' or 'hybrid') and ``num_ranks_per_node`` (None for the
default buffer). Hybrid rows also carry the scale-out copies per token: measured
(``handle.stats['scaleout_copies']`` of the dispatch / the rank's tokens; None, printed 'n/a', when
the handle has no such stat) and planned (``deep_ep.plan.cross_node_copies(...)['per_node']`` of the
same routing).

With --phases the buffers are built with the phase clock (EP_PHASE_CLOCK=1, deep_ep.phase_clock)
and every row also carries ``phases``: per clocked kernel (notify, dispatch), each phase's time
after the kernel's first CTA entry (median of 9 runs, largest over ranks) and, for ranks sharing a
GPU, ``start_skew_us`` (how long after the first rank's kernel the last rank's started).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from a2a_baseline import a2a_combine, a2a_dispatch
from bench_common import (
    copy_bandwidth_gbs,
    kernel_times_us,
    phase_summary,
    phase_times_us,
    print_phases,
    request_phase_clock,
    run_ranks,
    save_summary,
)

import deep_ep
from deep_ep.plan import cross_node_copies

HIDDEN = 7168
TOPK = 8
EXPERTS = 256
FP8_GROUP = 128
# Substrings of the kernels' names (DeepEP V2's, for the timed kernels): "dispatch_impl" covers the
# direct and the hybrid kernel, "combine_impl" the push and the zero-copy (pull) combine.
KERNELS = (
    "notify_kernel",
    "dispatch_impl",
    "dispatch_copy_epilogue_impl",
    "combine_impl",
    "combine_reduce_epilogue_impl",
)
OPERATIONS = ("dispatch_fp8", "dispatch_bf16", "dispatch_fp8_cached", "dispatch_bf16_cached", "combine_bf16")
BASELINE_OPERATIONS = ("baseline_dispatch_bf16", "baseline_combine_bf16")
# The three calls whose host time issue targets name: uncached dispatch, cached dispatch, combine.
HOST_PROFILED_OPERATIONS = ("dispatch_fp8", "dispatch_fp8_cached", "combine_bf16")
# --zero-copy: the dispatches again with zero_copy_recv=True (rows written in final position, outputs
# are views of the window, the epilogue writes metadata only) and the zero-copy combine (the expert
# outputs already in the buffer's combine input rows, the home ranks read them); direct mode only.
ZERO_COPY_OPERATIONS = (
    "dispatch_fp8_zero_copy",
    "dispatch_bf16_zero_copy",
    "dispatch_fp8_cached_zero_copy",
    "dispatch_bf16_cached_zero_copy",
    "combine_bf16_zero_copy",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-ranks", type=int, default=8, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--out", default="benchmarks/results", help="output directory")
    parser.add_argument("--tokens", default="256,1024,4096,8192", help="comma list of tokens per rank")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--num-topk", type=int, default=TOPK)
    parser.add_argument("--num-experts", type=int, default=EXPERTS)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50, help="timed runs per operation (>= 50 for the table)")
    parser.add_argument(
        "--num-sms", default="0", help="comma list of SM counts to run each operation with (0: the analytic estimate)"
    )
    parser.add_argument("--baseline", action="store_true", help="also time the all_to_all_single baseline")
    parser.add_argument(
        "--num-ranks-per-node",
        default="",
        help="comma list of ranks per node S: also run each operation on a buffer with num_ranks_per_node=S "
        "(hybrid HT mode when S < the group size); default: the default buffer only",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help=f"print a cProfile of 200 calls of each of {', '.join(HOST_PROFILED_OPERATIONS)}, the host "
        "cost of their pieces (allocations, stream joins, a launch) without the profiler, and per operation "
        "the C++ host path's step times and whole-call time (rank 0)",
    )
    parser.add_argument(
        "--idle-start",
        action="store_true",
        help="start every timed call on an idle GPU (the host waits for the barrier before it): host us is "
        "then the call's own latency, not the previous call's tail plus this one",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each kernel's phases with the phase clock (EP_PHASE_CLOCK=1, deep_ep.phase_clock)",
    )
    parser.add_argument(
        "--zero-copy",
        action="store_true",
        help="also time every dispatch with zero_copy_recv=True (direct mode buffers only)",
    )
    return parser.parse_args(argv)


def operation_names(config: dict[str, Any]) -> tuple[str, ...]:
    names = OPERATIONS + (ZERO_COPY_OPERATIONS if config.get("zero_copy") else ())
    return names + BASELINE_OPERATIONS if config.get("baseline") else names


def parse_ranks_per_node(text: str) -> list[int]:
    """``--num-ranks-per-node``: comma list of positive ints, duplicates dropped (empty: none)."""
    values = []
    for item in text.split(","):
        if not item.strip():
            continue
        try:
            value = int(item)
        except ValueError:
            raise ValueError(f"--num-ranks-per-node must be a comma list of positive ints, got {text!r}") from None
        if value < 1:
            raise ValueError(f"--num-ranks-per-node values must be >= 1, got {value}")
        values.append(value)
    return list(dict.fromkeys(values))


def buffer_layouts(num_ranks: int, ranks_per_node: list[int]) -> list[int | None]:
    """Buffers to run, in order: the default one (None), then one per requested S. S equal to the
    group size is the default run again and is skipped; S must divide the group size."""
    bad = [value for value in ranks_per_node if value < 1 or num_ranks % value != 0]
    if bad:
        raise ValueError(f"--num-ranks-per-node values must divide the group size {num_ranks}, got {bad}")
    return [None] + [value for value in dict.fromkeys(ranks_per_node) if value != num_ranks]


def scaleout_stats(handle, num_tokens: int) -> dict[str, Any]:
    """Scale-out copies this rank's dispatch put on the network, from ``handle.stats`` (None where the
    handle does not report them): ``scaleout_copies``, ``scaleout_bytes`` and copies per token."""
    stats = getattr(handle, "stats", None)
    stats = stats if isinstance(stats, dict) else {}

    def total(key: str) -> int | None:
        value = stats.get(key)
        if value is None:
            return None
        return int(value.sum().item()) if isinstance(value, torch.Tensor) else int(value)

    copies, num_bytes = total("scaleout_copies"), total("scaleout_bytes")
    per_token = copies / num_tokens if copies is not None and num_tokens > 0 else None
    return {"scaleout_copies": copies, "scaleout_bytes": num_bytes, "scaleout_copies_per_token": per_token}


def planned_scaleout_copies(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, num_ranks_per_node: int, rank: int
) -> float | None:
    """Copies per token that leave this rank's node when each token crosses once per other node
    holding one of its experts (the planner's ``per_node``); None without tokens."""
    if topk_idx.shape[0] == 0:
        return None
    copies = cross_node_copies(
        topk_idx, num_experts, num_ranks, num_ranks_per_node, src_node=rank // num_ranks_per_node
    )
    return copies["per_node"]


# --------------------------------------------------------------------------- measurements


def timed_runs(buffer, operation, warmup: int, iters: int, idle_start: bool = False) -> tuple[list[float], list[float]]:
    """Per-run device times (us; each run starts right after a device barrier on the caller's
    stream) and host times of the call (us; includes the host wait for counts where there is one).
    Without ``idle_start`` the host does not wait for the barrier: the GPU may still run the previous
    call when this one starts, and an uncached dispatch's host time includes that tail (its count
    wait queues behind it). ``idle_start``: the host waits for the barrier, so every call starts on
    an idle GPU; the host time is then the call's own latency, and the device time includes the
    host's work before the first launch."""
    for _ in range(warmup):
        operation()
    events = []
    host_us = []
    for _ in range(iters):
        buffer.barrier(with_cpu_sync=idle_start)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        begin = time.perf_counter()
        operation()
        host_us.append((time.perf_counter() - begin) * 1e6)
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events], host_us


def host_profile(operation, calls: int = 200, top: int = 30) -> str:
    """cProfile of ``calls`` back-to-back calls (host side only): where the Python time goes."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        operation()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def host_path_steps(buffer, operation, calls: int = 200, idle_start: bool = False) -> tuple[dict, float]:
    """The C++ host path's own step times (HtHostPath.start_profile / stop_profile) over ``calls``
    calls of one operation, back to back or (``idle_start``) each after a barrier the host waited
    for: ({entry point: {step: µs per call}}, µs per whole call as the caller sees it; the difference
    is the Python around the entry points). ({}, 0.0) when the buffer has no host path
    (EP_HT_HOST_PATH=0)."""
    host_path = getattr(buffer, "_ht_host_path", None)
    if host_path is None:
        return {}, 0.0
    host_path.start_profile()
    total = 0.0
    for _ in range(calls):
        if idle_start:
            buffer.barrier(with_cpu_sync=True)
        begin = time.perf_counter()
        operation()
        total += time.perf_counter() - begin
    torch.cuda.synchronize()
    return host_path.stop_profile(), total / calls * 1e6


def host_primitive_costs(buffer, rows: int, hidden: int, num_topk: int, calls: int = 2000) -> dict[str, float]:
    """Host µs per call (no profiler; median of 10 batches) of the pieces a cached dispatch and a
    combine are made of: the output allocations, the stream joins (the runtime's event, and the
    torch Event + wait it replaced), the per-call runtime check, and one kernel launch (the
    runtime's barrier kernel: every rank makes the same calls)."""
    device = torch.cuda.current_device()
    runtime = buffer._runtime
    comm_stream = buffer.get_comm_stream()
    compute_stream = torch.cuda.current_stream(device)
    comm, compute = comm_stream.cuda_stream, compute_stream.cuda_stream

    def torch_event_join() -> None:
        event = torch.cuda.Event()
        event.record(compute_stream)
        comm_stream.wait_event(event)

    pieces = {
        "torch.empty recv_x bf16": lambda: torch.empty((rows, hidden), dtype=torch.bfloat16, device=device),
        "torch.empty recv_x fp8": lambda: torch.empty((rows, hidden), dtype=torch.float8_e4m3fn, device=device),
        "torch.empty scales": lambda: torch.empty((rows, hidden // FP8_GROUP), dtype=torch.float32, device=device),
        "torch.empty topk_idx": lambda: torch.empty((rows, num_topk), dtype=torch.int64, device=device),
        "Runtime.join_streams": lambda: runtime.join_streams(comm, compute),
        "torch Event + record + wait_event": torch_event_join,
        "Runtime.begin_call": lambda: runtime.begin_call(0),
        "kernel launch (Runtime.launch_barrier)": lambda: runtime.launch_barrier(compute),
    }
    costs = {}
    for name, piece in pieces.items():
        batches = []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls // 10):
                piece()
            batches.append((time.perf_counter() - start) * 1e6 / (calls // 10))
        costs[name] = statistics.median(batches)
    torch.cuda.synchronize()
    return costs


def make_inputs(num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=generator)
    topk_idx = scores.topk(num_topk, dim=1).indices
    weights = torch.rand(num_tokens, num_topk, device="cuda", generator=generator)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=generator).to(torch.bfloat16)
    return x, topk_idx, weights


def bench_tokens(
    buffer, rank: int, num_tokens: int, config: dict[str, Any], num_ranks_per_node: int | None = None
) -> list[dict[str, Any]]:
    """Every operation at one token count, once per requested SM count (0: the estimate).

    ``num_ranks_per_node``: what the buffer was built with (None: the default buffer, the only one
    that runs the baseline and the host profile)."""
    hidden, num_topk, num_experts = config["hidden"], config["num_topk"], config["num_experts"]
    x, topk_idx, weights = make_inputs(num_tokens, hidden, num_experts, num_topk, seed=1000 * rank + num_tokens)
    x_fp8 = deep_ep.per_token_cast_to_fp8(x)
    mode = getattr(buffer, "ht_mode", "direct")
    default_layout = num_ranks_per_node is None
    planned = None
    if mode == "hybrid" and num_ranks_per_node is not None:
        planned = planned_scaleout_copies(topk_idx, num_experts, buffer.num_ranks, num_ranks_per_node, rank)
    results = []

    def measure(
        name: str, operation, requested_sms: int, num_sms: int, num_recv_tokens: int, extra: dict | None = None
    ) -> None:
        times, host_us = timed_runs(
            buffer, operation, config["warmup"], config["iters"], idle_start=config.get("idle_start", False)
        )
        times.sort()
        results.append(
            {
                "num_tokens": num_tokens,
                "operation": name,
                "median_us": statistics.median(times),
                "p10_us": times[len(times) // 10],
                "p90_us": times[(len(times) * 9) // 10],
                "host_us": statistics.median(host_us),
                "num_recv_tokens": num_recv_tokens,
                "requested_num_sms": requested_sms,
                "num_sms": num_sms,
                "kernels_us": kernel_times_us(buffer, operation, KERNELS),
                "phases": phase_times_us(buffer, operation) if config.get("phases") else {},
                "mode": mode,
                "num_ranks_per_node": num_ranks_per_node,
                **(extra or {}),
            }
        )

    def operations_at(requested: int):
        common = {"num_experts": num_experts, "num_sms": requested}
        recv_x, _, recv_weights, handle, _ = buffer.dispatch(x_fp8, topk_idx, weights, **common)
        y = deep_ep.per_token_cast_back(*recv_x)
        sms = handle.num_sms
        operations = {
            "dispatch_fp8": lambda: buffer.dispatch(x_fp8, topk_idx, weights, **common),
            "dispatch_bf16": lambda: buffer.dispatch(x, topk_idx, weights, **common),
            # The handle carries routing only, so one handle serves cached dispatch of either dtype.
            "dispatch_fp8_cached": lambda: buffer.dispatch(x_fp8, topk_weights=weights, handle=handle, num_sms=sms),
            "dispatch_bf16_cached": lambda: buffer.dispatch(x, topk_weights=weights, handle=handle, num_sms=sms),
            "combine_bf16": lambda: buffer.combine(y, handle, topk_weights=recv_weights),
        }
        if config.get("zero_copy") and mode == "direct":
            zero_copy = {**common, "zero_copy_recv": True}
            zc_handle = buffer.dispatch(x_fp8, topk_idx, weights, **zero_copy)[3]
            cached = {"topk_weights": weights, "handle": zc_handle, "num_sms": sms, "zero_copy_recv": True}
            operations["dispatch_fp8_zero_copy"] = lambda: buffer.dispatch(x_fp8, topk_idx, weights, **zero_copy)
            operations["dispatch_bf16_zero_copy"] = lambda: buffer.dispatch(x, topk_idx, weights, **zero_copy)
            operations["dispatch_fp8_cached_zero_copy"] = lambda: buffer.dispatch(x_fp8, **cached)
            operations["dispatch_bf16_cached_zero_copy"] = lambda: buffer.dispatch(x, **cached)
            # The expert outputs are written once (an expert GEMM would write them there itself).
            rows = buffer.get_combine_input_buffer(zc_handle, hidden=hidden)
            rows.copy_(y)
            operations["combine_bf16_zero_copy"] = lambda: buffer.combine(
                rows, zc_handle, topk_weights=recv_weights, zero_copy=True
            )
        return operations, handle

    for requested in config["num_sms"]:
        operations, handle = operations_at(requested)
        extra = None
        if mode == "hybrid":
            extra = {**scaleout_stats(handle, num_tokens), "scaleout_copies_per_token_planned": planned}
        for name, operation in operations.items():
            measure(name, operation, requested, handle.num_sms, handle.num_recv_tokens, extra)
        if config.get("host_profile") and default_layout and requested == config["num_sms"][0]:
            # Every rank makes the calls (the count exchange needs them all); rank 0 prints.
            for name in HOST_PROFILED_OPERATIONS:
                profile_text = host_profile(operations[name])
                if rank == 0:
                    print(f"[bench_ht] host profile, {name}, T={num_tokens}:\n{profile_text}")
            costs = host_primitive_costs(buffer, handle.num_recv_tokens, hidden, topk_idx.shape[1])
            if rank == 0:
                lines = "\n".join(f"  {cost:8.2f}  {name}" for name, cost in costs.items())
                print(f"[bench_ht] host µs per call of the pieces, T={num_tokens}:\n{lines}")
            for name, operation in operations.items():
                steps, whole_call = host_path_steps(buffer, operation, idle_start=config.get("idle_start", False))
                if rank == 0 and steps:
                    lines = "\n".join(
                        f"  {call}: " + ", ".join(f"{step} {us:.2f}" for step, us in by_step.items())
                        for call, by_step in steps.items()
                    )
                    print(
                        f"[bench_ht] C++ host path, {name}, T={num_tokens}: whole call {whole_call:.2f} µs; "
                        f"µs per call of each step:\n{lines}"
                    )

    if config.get("baseline") and default_layout:
        group = buffer.group
        baseline_x, baseline_handle = a2a_dispatch(x, topk_idx, num_experts, group)
        if baseline_handle.num_recv_tokens != handle.num_recv_tokens:
            raise RuntimeError(
                f"baseline received {baseline_handle.num_recv_tokens} tokens, dispatch {handle.num_recv_tokens}"
            )
        baseline = {
            "baseline_dispatch_bf16": lambda: a2a_dispatch(x, topk_idx, num_experts, group),
            "baseline_combine_bf16": lambda: a2a_combine(baseline_x, baseline_handle, group),
        }
        for name, operation in baseline.items():
            # num_sms 0: NCCL picks its own channels.
            measure(name, operation, 0, 0, handle.num_recv_tokens)
    return results


def bench_rank(rank: int, num_ranks: int, group, config: dict[str, Any]) -> dict[str, Any]:
    hidden, num_topk = config["hidden"], config["num_topk"]
    tokens = config["tokens"]
    gpu = torch.cuda.current_device()
    # The first rank of each GPU measures the copy bandwidth while the others wait.
    gpu_of_rank: list[Any] = [None] * num_ranks
    dist.all_gather_object(
        gpu_of_rank, (os.uname().nodename, str(torch.cuda.get_device_properties(gpu).uuid)), group=group
    )
    first_on_gpu = gpu_of_rank.index(gpu_of_rank[rank]) == rank
    bandwidth = copy_bandwidth_gbs() if first_on_gpu else None
    dist.barrier(group=group)

    if config.get("phases"):
        request_phase_clock()  # before the buffers are built
    results = []
    for num_ranks_per_node in buffer_layouts(num_ranks, config.get("num_ranks_per_node", [])):
        layout = {} if num_ranks_per_node is None else {"num_ranks_per_node": num_ranks_per_node}
        if num_ranks_per_node is not None:
            layout["allow_hybrid_mode"] = True
        if config.get("zero_copy") and num_ranks_per_node in (None, num_ranks):
            layout["zero_copy_combine"] = True  # room for the combine input rows
        buffer = deep_ep.ElasticBuffer(
            group,
            num_max_tokens_per_rank=max(tokens),
            hidden=hidden,
            num_topk=num_topk,
            explicitly_destroy=True,
            **layout,
        )
        try:
            for num_tokens in tokens:
                results += bench_tokens(buffer, rank, num_tokens, config, num_ranks_per_node)
                buffer._check_device_errors()
        finally:
            buffer.destroy()
    return {"rank": rank, "gpu": gpu_of_rank[rank], "copy_gbs": bandwidth, "results": results}


# --------------------------------------------------------------------------- figures


def token_bytes(operation: str, hidden: int) -> int:
    """Bytes of one token as DeepEP counts them: payload (+ fp8 scales)."""
    if operation.startswith("dispatch_fp8"):
        return hidden + hidden // FP8_GROUP * 4
    return hidden * 2


def result_key(result: dict[str, Any]) -> tuple[int, str, int, int | None]:
    """(T, operation, requested SMs, num_ranks_per_node of the buffer: None for the default one)."""
    return (result["num_tokens"], result["operation"], result["requested_num_sms"], result.get("num_ranks_per_node"))


def ordered_keys(results: list[dict[str, Any]]) -> list[tuple[int, str, int, int | None]]:
    """Row order: (T, operation, requested SMs) as first measured, and within one of them the
    buffers in the order they ran, so direct and hybrid rows of an operation sit side by side."""
    keys = [result_key(r) for r in results]
    groups = {key[:3]: index for index, key in reversed(list(enumerate(keys)))}
    layouts = {key[3]: index for index, key in reversed(list(enumerate(keys)))}
    return sorted(dict.fromkeys(keys), key=lambda key: (groups[key[:3]], layouts[key[3]]))


def _mean_or_none(values: list[float | None]) -> float | None:
    return None if not values or any(value is None for value in values) else sum(values) / len(values)


def summarize(per_rank: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    hidden = config["hidden"]
    gpus = sorted({tuple(item["gpu"]) for item in per_rank})
    bandwidth = {gpu: next(item["copy_gbs"] for item in per_rank if tuple(item["gpu"]) == gpu) for gpu in gpus}
    rows = []
    by_key = [{result_key(r): r for r in item["results"]} for item in per_rank]
    for key in ordered_keys(per_rank[0]["results"]):
        num_tokens, operation, requested, num_ranks_per_node = key
        entries = [results[key] for results in by_key]
        per_token = token_bytes(operation, hidden)
        time_us = max(entry["median_us"] for entry in entries)
        gbs = [per_token * entry["num_recv_tokens"] / (entry["median_us"] * 1e-6) / 1e9 for entry in entries]
        # HBM floor per GPU: dispatch reads each source token once and writes each (token,
        # destination) copy once; combine reads each received row once and writes each token once.
        floor_us = 0.0
        for gpu in gpus:
            ranks = [i for i, item in enumerate(per_rank) if tuple(item["gpu"]) == gpu]
            moved = sum((num_tokens + entries[i]["num_recv_tokens"]) * per_token for i in ranks)
            floor_us = max(floor_us, moved / (bandwidth[gpu] * 1e9) * 1e6)
        # Max over ranks: what bounds the operation. Min over ranks: a kernel that waits for its
        # peers (notify's count exchange, a barrier) runs shortest on the last rank to arrive, so
        # the min is close to its own cost without the ranks' launch skew.
        kernels: dict[str, float] = {}
        kernels_min: dict[str, float] = {}
        for entry in entries:
            for kernel, value in entry["kernels_us"].items():
                kernels[kernel] = max(kernels.get(kernel, 0.0), value)
                kernels_min[kernel] = min(kernels_min.get(kernel, value), value)
        rows.append(
            {
                "num_tokens": num_tokens,
                "operation": operation,
                "time_us": time_us,
                "time_us_per_rank": [entry["median_us"] for entry in entries],
                "host_us_max_over_ranks": max(entry.get("host_us", 0.0) for entry in entries),
                "bytes_per_token": per_token,
                "bytes_per_rank": [per_token * entry["num_recv_tokens"] for entry in entries],
                "gbs_per_rank": gbs,
                "gbs_per_rank_mean": sum(gbs) / len(gbs),
                "floor_us": floor_us,
                "floor_fraction": floor_us / time_us,
                "requested_num_sms": requested,
                "num_sms": entries[0]["num_sms"],
                "kernels_us_max_over_ranks": kernels,
                "kernels_us_min_over_ranks": kernels_min,
                "mode": entries[0].get("mode", "direct"),
                "num_ranks_per_node": num_ranks_per_node,
            }
        )
        if config.get("phases"):
            rows[-1]["phases"] = phase_summary([entry["phases"] for entry in entries], len(gpus) == 1)
        if rows[-1]["mode"] == "hybrid":
            rows[-1].update(scaleout_summary(entries))
    if config.get("baseline"):
        add_speedups(rows, config["num_sms"][0])
    return {
        "config": config,
        "num_ranks": len(per_rank),
        "num_gpus": len(gpus),
        "copy_gbs_per_gpu": list(bandwidth.values()),
        "rows": rows,
        "num_sms_sweep": sweep_summary(rows),
    }


def scaleout_summary(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Scale-out copies per token of a hybrid row: per rank and the mean over ranks (None, printed
    'n/a', where a rank's handle did not report them), measured and planned."""
    measured = [entry.get("scaleout_copies_per_token") for entry in entries]
    planned = [entry.get("scaleout_copies_per_token_planned") for entry in entries]
    return {
        "scaleout_copies_per_rank": [entry.get("scaleout_copies") for entry in entries],
        "scaleout_bytes_per_rank": [entry.get("scaleout_bytes") for entry in entries],
        "scaleout_copies_per_token_per_rank": measured,
        "scaleout_copies_per_token": _mean_or_none(measured),
        "scaleout_copies_per_token_planned_per_rank": planned,
        "scaleout_copies_per_token_planned": _mean_or_none(planned),
    }


def add_speedups(rows: list[dict[str, Any]], requested_sms: int) -> None:
    """speedup_vs_baseline = baseline time / our time, on each of our rows (at the first requested SM
    count) that has a baseline row at its T."""
    time_us = {(row["num_tokens"], row["operation"]): row["time_us"] for row in rows if row["num_sms"] == 0}
    for row in rows:
        if row["requested_num_sms"] != requested_sms or row["operation"].startswith("baseline_"):
            continue
        baseline_us = time_us.get((row["num_tokens"], "baseline_" + row["operation"]))
        if baseline_us is not None:
            row["speedup_vs_baseline"] = baseline_us / row["time_us"]


def sweep_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (T, operation, buffer) run at several SM counts including the estimate (requested 0): the
    best measured GB/s, the SM count that gave it, and the estimate's GB/s as a fraction of the best."""
    summary = []

    def group(row: dict[str, Any]) -> tuple[int, str, int | None]:
        return row["num_tokens"], row["operation"], row.get("num_ranks_per_node")

    for key in dict.fromkeys(group(row) for row in rows):
        num_tokens, operation, num_ranks_per_node = key
        runs = [r for r in rows if group(r) == key]
        estimate = next((r for r in runs if r["requested_num_sms"] == 0), None)
        if estimate is None or len(runs) < 2:
            continue
        best = max(runs, key=lambda r: r["gbs_per_rank_mean"])
        summary.append(
            {
                "num_tokens": num_tokens,
                "operation": operation,
                "mode": estimate.get("mode", "direct"),
                "num_ranks_per_node": num_ranks_per_node,
                "gbs_by_num_sms": {str(r["num_sms"]): r["gbs_per_rank_mean"] for r in runs},
                "best_num_sms": best["num_sms"],
                "best_gbs": best["gbs_per_rank_mean"],
                "estimate_num_sms": estimate["num_sms"],
                "estimate_gbs": estimate["gbs_per_rank_mean"],
                "estimate_fraction_of_best": estimate["gbs_per_rank_mean"] / best["gbs_per_rank_mean"],
            }
        )
    return summary


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = summary["num_sms_sweep"]
    panels = 3 if sweep else 2
    figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    left, right = axes[0], axes[1]
    primary = summary["config"]["num_sms"][0]
    layouts = list(dict.fromkeys(row.get("num_ranks_per_node") for row in summary["rows"]))
    for layout in layouts:
        for operation in operation_names(summary["config"]):
            rows = [
                row
                for row in summary["rows"]
                if row["operation"] == operation
                and row.get("num_ranks_per_node") == layout
                and (row["operation"].startswith("baseline_") or row["requested_num_sms"] == primary)
            ]
            if not rows:
                continue
            label = operation + layout_label(rows[0])
            tokens = [row["num_tokens"] for row in rows]
            left.plot(tokens, [row["gbs_per_rank_mean"] for row in rows], marker="o", label=label)
            right.plot(tokens, [row["floor_fraction"] for row in rows], marker="o", label=label)
    for axis, label in ((left, "GB/s per rank (DeepEP-style)"), (right, "fraction of the HBM floor")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tokens per rank (T)")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    if sweep:
        axis = axes[2]
        largest = max(item["num_tokens"] for item in sweep)
        for item in sweep:
            if item["num_tokens"] != largest:
                continue
            points = sorted((int(sms), gbs) for sms, gbs in item["gbs_by_num_sms"].items())
            label = item["operation"] + layout_label(item)
            line = axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            axis.plot(
                [item["estimate_num_sms"]], [item["estimate_gbs"]], marker="*", markersize=14, color=line[0].get_color()
            )
        axis.set_xlabel(f"num_sms (T = {largest}; star: get_theoretical_num_sms)")
        axis.set_ylabel("GB/s per rank (DeepEP-style)")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(
        f"deep_ep HT: {summary['num_ranks']} ranks on {summary['num_gpus']} GPU(s), H={summary['config']['hidden']}, "
        f"K={summary['config']['num_topk']}, E={summary['config']['num_experts']}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def layout_label(row: dict[str, Any]) -> str:
    """'' for the default buffer's rows, else ' [<mode> S=<num_ranks_per_node>]'."""
    if row.get("num_ranks_per_node") is None:
        return ""
    return f" [{row.get('mode', 'direct')} S={row['num_ranks_per_node']}]"


def format_copies(row: dict[str, Any], key: str) -> str:
    """A scale-out copies-per-token figure for the table: '-' off hybrid rows, 'n/a' if not reported."""
    if row.get("mode") != "hybrid":
        return "-"
    value = row.get(key)
    return "n/a" if value is None else f"{value:.2f}"


def write_outputs(summary: dict[str, Any], out_dir: str) -> None:
    save_summary(summary, out_dir, "bench_ht", plot)
    # 20 columns fit our operation names (the committed tables); the baseline's are longer.
    width = max([20] + [len(row["operation"]) + 1 for row in summary["rows"]])
    # Mode, S and the scale-out columns only when --num-ranks-per-node asked for more buffers.
    layouts = bool(summary["config"].get("num_ranks_per_node")) or any(
        row.get("num_ranks_per_node") is not None for row in summary["rows"]
    )
    mode_header = f"{'mode':<6} {'S':>3} " if layouts else ""
    copies_header = f" {'so/tok':>7} {'plan':>6}" if layouts else ""
    print(
        f"{'T':>6} {'operation':<{width}} {mode_header}{'time us':>9} {'GB/s/rank':>10} {'floor':>6} {'SMs':>4} "
        f"{'host us':>8}{copies_header}  kernels (us)"
    )
    for row in summary["rows"]:
        kernels = " ".join(
            f"{name.removesuffix('_kernel')}={value:.0f}" for name, value in row["kernels_us_max_over_ranks"].items()
        )
        mode, copies = "", ""
        if layouts:
            node_size = row.get("num_ranks_per_node")
            mode = f"{row.get('mode', 'direct'):<6} {'-' if node_size is None else node_size:>3} "
            measured = format_copies(row, "scaleout_copies_per_token")
            copies = f" {measured:>7} {format_copies(row, 'scaleout_copies_per_token_planned'):>6}"
        print(
            f"{row['num_tokens']:>6} {row['operation']:<{width}} {mode}{row['time_us']:>9.1f} "
            f"{row['gbs_per_rank_mean']:>10.1f} {row['floor_fraction']:>6.2f} {row['num_sms']:>4} "
            f"{row.get('host_us_max_over_ranks', 0.0):>8.0f}{copies}  {kernels}"
        )
    for row in summary["rows"]:
        if row.get("phases"):
            print_phases(f"T={row['num_tokens']} {row['operation']}{layout_label(row)}", row["phases"])
    for row in summary["rows"]:
        if "speedup_vs_baseline" in row:
            print(
                f"{row['num_tokens']:>6} {row['operation']:<{width}} {row['speedup_vs_baseline']:.2f}x the baseline"
                f"{layout_label(row)}"
            )
    for item in summary["num_sms_sweep"]:
        print(
            f"{item['num_tokens']:>6} {item['operation']:<{width}}{layout_label(item)} "
            f"best {item['best_gbs']:.1f} GB/s at "
            f"{item['best_num_sms']} SMs; estimate {item['estimate_num_sms']} SMs gives {item['estimate_gbs']:.1f} "
            f"({item['estimate_fraction_of_best']:.2f} of best)"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = {
        "tokens": [int(value) for value in args.tokens.split(",") if value.strip()],
        "hidden": args.hidden,
        "num_topk": args.num_topk,
        "num_experts": args.num_experts,
        "warmup": args.warmup,
        "iters": args.iters,
        "num_sms": [int(value) for value in args.num_sms.split(",") if value.strip()],
    }
    if args.baseline:
        config["baseline"] = True
    if args.host_profile:
        config["host_profile"] = True
    if args.idle_start:
        config["idle_start"] = True
    if args.zero_copy:
        config["zero_copy"] = True
    if args.phases:
        config["phases"] = True
    try:
        ranks_per_node = parse_ranks_per_node(args.num_ranks_per_node)
        if ranks_per_node:
            # Fail before starting any rank (the group size is WORLD_SIZE under torchrun).
            buffer_layouts(int(os.environ.get("WORLD_SIZE", args.num_ranks)), ranks_per_node)
    except ValueError as error:
        raise SystemExit(f"bench_ht: {error}") from None
    if ranks_per_node:
        config["num_ranks_per_node"] = ranks_per_node
    per_rank = run_ranks(bench_rank, args.num_ranks, config)
    if per_rank is not None:
        write_outputs(summarize(per_rank, config), args.out)


if __name__ == "__main__":
    main()
