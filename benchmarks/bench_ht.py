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
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from a2a_baseline import a2a_combine, a2a_dispatch
from bench_common import copy_bandwidth_gbs, run_ranks, save_summary

import deep_ep

HIDDEN = 7168
TOPK = 8
EXPERTS = 256
FP8_GROUP = 128
KERNELS = ("notify_kernel", "dispatch_kernel", "epilogue_kernel", "combine_kernel", "reduce_kernel")
OPERATIONS = ("dispatch_fp8", "dispatch_bf16", "dispatch_fp8_cached", "dispatch_bf16_cached", "combine_bf16")
BASELINE_OPERATIONS = ("baseline_dispatch_bf16", "baseline_combine_bf16")


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
        "--host-profile", action="store_true", help="print a cProfile of 200 uncached fp8 dispatch calls (rank 0)"
    )
    return parser.parse_args(argv)


def operation_names(config: dict[str, Any]) -> tuple[str, ...]:
    return OPERATIONS + BASELINE_OPERATIONS if config.get("baseline") else OPERATIONS


# --------------------------------------------------------------------------- measurements


def timed_runs(buffer, operation, warmup: int, iters: int) -> tuple[list[float], list[float]]:
    """Per-run device times (us; each run starts right after a device barrier on the caller's
    stream) and host times of the call (us; includes the host wait for counts where there is one)."""
    for _ in range(warmup):
        operation()
    events = []
    host_us = []
    for _ in range(iters):
        buffer.barrier()
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


def kernel_times_us(buffer, operation, runs: int = 9) -> dict[str, float]:
    """Median device time of each HT kernel over a few profiled runs (empty if profiling fails).

    A CPU-synced barrier first lines the ranks up: the profiler starts at different moments in
    different processes, and without it the first run's entry barrier (in notify, or in a cached
    dispatch) would absorb that skew. The median drops what is left of such outliers.
    """
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        buffer.barrier(with_cpu_sync=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                buffer.barrier()
                operation()
            torch.cuda.synchronize()
        durations: dict[str, list[float]] = {}
        for event in prof.events():
            if event.device_type != DeviceType.CUDA:
                continue
            for kernel in KERNELS:
                if kernel in event.name:
                    durations.setdefault(kernel, []).append(event.time_range.elapsed_us())
        return {kernel: statistics.median(values) for kernel, values in durations.items()}
    except Exception as error:  # noqa: BLE001 - profiling is optional
        print(f"[bench_ht] kernel profiling failed: {error}", file=sys.stderr)
        return {}


def make_inputs(num_tokens: int, hidden: int, num_experts: int, num_topk: int, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, device="cuda", generator=generator)
    topk_idx = scores.topk(num_topk, dim=1).indices
    weights = torch.rand(num_tokens, num_topk, device="cuda", generator=generator)
    x = torch.randn(num_tokens, hidden, device="cuda", generator=generator).to(torch.bfloat16)
    return x, topk_idx, weights


def bench_tokens(buffer, rank: int, num_tokens: int, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every operation at one token count, once per requested SM count (0: the estimate)."""
    hidden, num_topk, num_experts = config["hidden"], config["num_topk"], config["num_experts"]
    x, topk_idx, weights = make_inputs(num_tokens, hidden, num_experts, num_topk, seed=1000 * rank + num_tokens)
    x_fp8 = deep_ep.per_token_cast_to_fp8(x)
    results = []

    def measure(name: str, operation, requested_sms: int, num_sms: int, num_recv_tokens: int) -> None:
        times, host_us = timed_runs(buffer, operation, config["warmup"], config["iters"])
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
                "kernels_us": kernel_times_us(buffer, operation),
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
        return operations, handle

    for requested in config["num_sms"]:
        operations, handle = operations_at(requested)
        for name, operation in operations.items():
            measure(name, operation, requested, handle.num_sms, handle.num_recv_tokens)
        if config.get("host_profile") and requested == config["num_sms"][0]:
            # Every rank makes the calls (the count exchange needs them all); rank 0 prints.
            profile_text = host_profile(operations["dispatch_fp8"])
            if rank == 0:
                print(f"[bench_ht] host profile, dispatch_fp8, T={num_tokens}:\n{profile_text}")

    if config.get("baseline"):
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

    buffer = deep_ep.ElasticBuffer(
        group, num_max_tokens_per_rank=max(tokens), hidden=hidden, num_topk=num_topk, explicitly_destroy=True
    )
    results = []
    try:
        for num_tokens in tokens:
            results += bench_tokens(buffer, rank, num_tokens, config)
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


def summarize(per_rank: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    hidden = config["hidden"]
    gpus = sorted({tuple(item["gpu"]) for item in per_rank})
    bandwidth = {gpu: next(item["copy_gbs"] for item in per_rank if tuple(item["gpu"]) == gpu) for gpu in gpus}
    rows = []
    keys = [(r["num_tokens"], r["operation"], r["requested_num_sms"]) for r in per_rank[0]["results"]]
    for num_tokens, operation, requested in keys:
        entries = [
            next(
                r
                for r in item["results"]
                if (r["num_tokens"], r["operation"], r["requested_num_sms"]) == (num_tokens, operation, requested)
            )
            for item in per_rank
        ]
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
        kernels: dict[str, float] = {}
        for entry in entries:
            for kernel, value in entry["kernels_us"].items():
                kernels[kernel] = max(kernels.get(kernel, 0.0), value)
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
            }
        )
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
    """Per (T, operation) run at several SM counts including the estimate (requested 0): the best
    measured GB/s, the SM count that gave it, and the estimate's GB/s as a fraction of the best."""
    summary = []
    for num_tokens, operation in dict.fromkeys((row["num_tokens"], row["operation"]) for row in rows):
        runs = [r for r in rows if r["num_tokens"] == num_tokens and r["operation"] == operation]
        estimate = next((r for r in runs if r["requested_num_sms"] == 0), None)
        if estimate is None or len(runs) < 2:
            continue
        best = max(runs, key=lambda r: r["gbs_per_rank_mean"])
        summary.append(
            {
                "num_tokens": num_tokens,
                "operation": operation,
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
    for operation in operation_names(summary["config"]):
        rows = [
            row
            for row in summary["rows"]
            if row["operation"] == operation
            and (row["operation"].startswith("baseline_") or row["requested_num_sms"] == primary)
        ]
        tokens = [row["num_tokens"] for row in rows]
        left.plot(tokens, [row["gbs_per_rank_mean"] for row in rows], marker="o", label=operation)
        right.plot(tokens, [row["floor_fraction"] for row in rows], marker="o", label=operation)
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
            line = axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=item["operation"])
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


def write_outputs(summary: dict[str, Any], out_dir: str) -> None:
    save_summary(summary, out_dir, "bench_ht", plot)
    # 20 columns fit our operation names (the committed tables); the baseline's are longer.
    width = max([20] + [len(row["operation"]) + 1 for row in summary["rows"]])
    print(
        f"{'T':>6} {'operation':<{width}} {'time us':>9} {'GB/s/rank':>10} {'floor':>6} {'SMs':>4} {'host us':>8}"
        "  kernels (us)"
    )
    for row in summary["rows"]:
        kernels = " ".join(
            f"{name.removesuffix('_kernel')}={value:.0f}" for name, value in row["kernels_us_max_over_ranks"].items()
        )
        print(
            f"{row['num_tokens']:>6} {row['operation']:<{width}} {row['time_us']:>9.1f} "
            f"{row['gbs_per_rank_mean']:>10.1f} {row['floor_fraction']:>6.2f} {row['num_sms']:>4} "
            f"{row.get('host_us_max_over_ranks', 0.0):>8.0f}  {kernels}"
        )
    for row in summary["rows"]:
        if "speedup_vs_baseline" in row:
            print(f"{row['num_tokens']:>6} {row['operation']:<{width}} {row['speedup_vs_baseline']:.2f}x the baseline")
    for item in summary["num_sms_sweep"]:
        print(
            f"{item['num_tokens']:>6} {item['operation']:<{width}} best {item['best_gbs']:.1f} GB/s at "
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
    per_rank = run_ranks(bench_rank, args.num_ranks, config)
    if per_rank is not None:
        write_outputs(summarize(per_rank, config), args.out)


if __name__ == "__main__":
    main()
