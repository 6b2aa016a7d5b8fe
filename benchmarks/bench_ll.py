"""Low-latency dispatch/combine benchmark (decode shapes).

    python benchmarks/bench_ll.py --num-ranks 8 --out DIR [--tokens 1,32,128,256] [--experts 256,288]
    torchrun --nproc-per-node 8 benchmarks/bench_ll.py --out DIR

One buffer per expert count E, sized for T_ll = max(tokens); per token count T: fp8 dispatch and
bf16 combine, each timed
  * eager: send + receive in one call;
  * graph: the same call captured once in a CUDA graph and replayed;
  * hook: the send phase and the receive phase separately (return_recv_hook=True), with a device
    barrier between them so the receive phase measures receiving, not waiting for late peers;
  * layers: a decode step's chain, LAYERS dispatch + combine pairs back to back with no barrier
    between them, per pair: "rotating" captures the LAYERS pairs in one graph (LL areas in
    rotation: a send finds its area already released), "reusing" replays a graph of one pair
    LAYERS times (areas a, b, a, b: each send waits for its peers to start the same operation,
    the cost the rotation removes).
Every timed region starts right after a device barrier (all ranks start together); a run's time
is the slowest rank's, and the figure is the median over runs.

Bytes (DeepEP's convention, per rank): dispatch = valid selections x (H + H/128 * 4 + 16),
combine = valid selections x 2H. HBM floor, per GPU: dispatch reads each source token once
(2H bytes) and writes each (token, expert) message once; combine reads each expert row once (2H)
and writes each final token once (2H); summed over the ranks sharing the GPU, divided by the device
copy bandwidth (read + write) measured in the same run, plus one barrier. floor_fraction =
floor / measured time. Kernel times: device time of each launch of the operations' kernels
(one kernel function per operation, deep_ep.low_latency.KERNEL_NAMES): the one launch of an eager
dispatch and combine (``fused``: both phases) and the send and receive launches of a hooked pair
(torch.profiler, median of a few runs, slowest rank). Writes DIR/bench_ll.json and
DIR/bench_ll.png.

With --phases the buffers are built with the phase clock (EP_PHASE_CLOCK=1, deep_ep.phase_clock):
per row, for a graph-replayed dispatch + combine pair and for the last pair of the rotating chain,
each LL kernel's phase times after its first CTA entry (median of 9 runs, largest over ranks) and,
for ranks sharing a GPU, how long after the first rank's kernel the last rank's started.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from bench_common import (
    copy_bandwidth_gbs,
    phase_summary,
    phase_times_us,
    print_phases,
    profiled_kernel_events,
    request_phase_clock,
    run_ranks,
    save_summary,
    timed_after_barrier,
)

import deep_ep
from deep_ep import _C
from deep_ep.low_latency import KERNEL_NAMES
from deep_ep.testing.data import make_routing, make_tokens, make_weights

HIDDEN = 7168
TOPK = 8
OPERATIONS = ("dispatch", "combine")
LAYERS = 3  # pairs per decode-step chain: 6 operations, a multiple of the 3 LL areas
LAYER_KINDS = ("rotating", "reusing")
MODES = ("eager", "graph", "send", "recv")
# The LL kernel launches of a timed eager + hooked pair, in launch order: one launch per operation
# without a hook (both phases), the send and receive launches of the same kernel with one. Each
# launch is told apart by its place in the order (every launch of an operation has the same name).
KERNELS = ("dispatch_fused", "combine_fused", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-ranks", type=int, default=8, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--out", default="benchmarks/results", help="output directory")
    parser.add_argument("--tokens", default="1,32,128,256", help="comma list of tokens per rank")
    parser.add_argument("--experts", default="256,288", help="comma list of expert counts")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--num-topk", type=int, default=TOPK)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50, help="timed runs per operation and mode")
    parser.add_argument(
        "--recv-layout",
        default="compact",
        choices=("compact", "per_source"),
        help="dispatch receive rows: compact (copied out of the window, the default) or per_source (zero-copy view)",
    )
    parser.add_argument(
        "--num-ranks-per-node",
        type=int,
        default=0,
        help="S > 0: the ranks as virtual nodes of S ranks whose LL traffic between nodes goes over the scale-out "
        "transport (EP_LL_SCALEOUT=1; EP_SCALEOUT_TRANSPORT picks lsa or lsa-deferred); 0: one node (load/store)",
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each LL kernel's phases with the phase clock (EP_PHASE_CLOCK=1, deep_ep.phase_clock): "
        "a graph-replayed pair and the last pair of the rotating chain",
    )
    return parser.parse_args(argv)


# --------------------------------------------------------------------------- measurements


def timed_phases(buffer: Any, phases: list[Callable[[], None]], warmup: int, iters: int) -> list[list[float]]:
    """Per phase, per run, its time in us; each phase starts right after a device barrier."""
    for _ in range(warmup):
        for phase in phases:
            phase()
    events = []
    for _ in range(iters):
        run = []
        for phase in phases:
            buffer.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            phase()
            end.record()
            run.append((start, end))
        events.append(run)
    torch.cuda.synchronize()
    buffer._check_device_errors()
    return [[run[i][0].elapsed_time(run[i][1]) * 1e3 for run in events] for i in range(len(phases))]


def _kernel_named(name: str) -> str:
    """The LL kernel (KERNEL_NAMES) of the operation whose word ``name`` contains."""
    word = "dispatch" if "dispatch" in name else "combine"
    return next(kernel for kernel in KERNEL_NAMES if word in kernel)


def launch_times_us(buffer: Any, operation: Callable[[], None], launches: tuple[str, ...], runs: int = 9) -> dict:
    """Median device time of each LL kernel launch of ``operation``, which launches the LL kernels
    in the order ``launches`` names (each label starting with its operation's word), over a few
    profiled runs (profiled_kernel_events; empty if profiling fails or the launches differ from
    ``launches``)."""
    try:
        events = [
            event
            for event in profiled_kernel_events(buffer, operation, runs)
            if any(kernel in event.name for kernel in KERNEL_NAMES)
        ]
        labels = [launches[index % len(launches)] for index in range(len(events))]
        kernels = [_kernel_named(event.name) for event in events]
        if len(events) != runs * len(launches) or kernels != [_kernel_named(label) for label in labels]:
            raise RuntimeError(
                f"{len(events)} LL kernel launches ({kernels[: len(launches)]} ...), expected {runs} x {launches}"
            )
        durations: dict[str, list[float]] = {}
        for label, event in zip(labels, events, strict=True):
            durations.setdefault(label, []).append(event.time_range.elapsed_us())
        return {label: statistics.median(values) for label, values in durations.items()}
    except Exception as error:  # noqa: BLE001 - profiling is optional
        print(f"[bench] kernel profiling failed: {error}", file=sys.stderr)
        return {}


def _replay(graph_replay: Callable[[], None], times: int) -> None:
    for _ in range(times):
        graph_replay()


def barrier_us(buffer: Any, iters: int) -> list[float]:
    """One device barrier, timed after a first barrier has lined the ranks up."""
    return timed_phases(buffer, [buffer.barrier], 5, iters)[0]


class RoundTrip:
    """One rank's inputs at one T and the calls that time them (handles carried between phases)."""

    def __init__(self, buffer: Any, num_tokens: int, config: dict[str, Any], rank: int) -> None:
        self.buffer = buffer
        self.cap = config["cap"]
        self.recv_layout = config.get("recv_layout", "compact")
        hidden, num_topk, num_experts = config["hidden"], config["num_topk"], buffer.num_experts
        generator = torch.Generator().manual_seed(7919 * rank + 31 * num_tokens + num_experts)
        topk_idx = make_routing(
            num_tokens, num_experts, num_topk, generator=generator, minus_one_ratio=0.0, all_minus_one_tokens=0
        )
        self.x = make_tokens(num_tokens, hidden, generator).cuda()
        self.topk_idx = topk_idx.cuda()
        self.topk_weights = make_weights(topk_idx, generator).cuda()
        self.num_selections = int((topk_idx >= 0).sum())
        num_local = num_experts // buffer.num_ranks
        # Expert outputs: any bf16 values do; only the rows the dispatch filled are read.
        self.expert_out = torch.randn(num_local, buffer.num_ranks * self.cap, hidden, device="cuda").to(torch.bfloat16)
        self.out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device="cuda")
        self.handle: Any = None
        self.hook: Any = None
        self.dispatch()  # a handle for the first combine

    def dispatch(self, hook: bool = False) -> None:
        _, recv_count, self.handle, _, self.hook = self.buffer.low_latency_dispatch(
            self.x,
            self.topk_idx,
            self.cap,
            self.buffer.num_experts,
            use_fp8=True,
            return_recv_hook=hook,
            recv_layout=self.recv_layout,
        )
        self.recv_count = recv_count

    def combine(self, hook: bool = False) -> None:
        _, _, self.hook = self.buffer.low_latency_combine(
            self.expert_out, self.topk_idx, self.topk_weights, self.handle, return_recv_hook=hook, out=self.out
        )

    def receive(self) -> None:
        self.hook()

    def capture_layers(self, num_pairs: int) -> Callable[[], None]:
        """One graph of ``num_pairs`` dispatch + combine pairs back to back (a decode step's chain)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(num_pairs):
                self.dispatch()
                self.combine()
        self._layer_graphs = [*getattr(self, "_layer_graphs", []), graph]
        return graph.replay

    def capture(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """Graphs of one dispatch and of the combine answering it (parities stay in step: D, C)."""
        dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(dispatch_graph):
            self.dispatch()
        with torch.cuda.graph(combine_graph):
            self.combine()
        self._graphs = (dispatch_graph, combine_graph)
        return dispatch_graph.replay, combine_graph.replay


def bench_tokens(buffer: Any, num_tokens: int, config: dict[str, Any], rank: int) -> dict[str, Any]:
    trip = RoundTrip(buffer, num_tokens, config, rank)
    warmup, iters = config["warmup"], config["iters"]
    times: dict[str, dict[str, list[float]]] = {operation: {} for operation in OPERATIONS}
    eager = timed_phases(buffer, [trip.dispatch, trip.combine], warmup, iters)
    hooked = timed_phases(
        buffer,
        [lambda: trip.dispatch(hook=True), trip.receive, lambda: trip.combine(hook=True), trip.receive],
        warmup,
        iters,
    )
    trip.dispatch()
    dispatch_replay, combine_replay = trip.capture()
    graph = timed_phases(buffer, [dispatch_replay, combine_replay], warmup, iters)
    phases = {}
    if config.get("phases"):
        phases["graph"] = phase_times_us(buffer, lambda: (dispatch_replay(), combine_replay()))
    trip.dispatch()
    rotating = trip.capture_layers(LAYERS)
    if config.get("phases"):
        phases["chain"] = phase_times_us(buffer, rotating)  # the stamps of the chain's last pair
    trip.dispatch()
    reusing = trip.capture_layers(1)
    layers = {
        "rotating": [t / LAYERS for t in timed_after_barrier(buffer, rotating, warmup, iters)],
        "reusing": [t / LAYERS for t in timed_after_barrier(buffer, lambda: _replay(reusing, LAYERS), warmup, iters)],
    }
    # Device time of each launch of an eager dispatch + combine pair (one per operation) and of a
    # hooked pair (send and receive launches), each pair after a barrier.
    kernels = launch_times_us(
        buffer,
        lambda: (
            trip.dispatch(),
            trip.combine(),
            trip.dispatch(hook=True),
            trip.receive(),
            trip.combine(hook=True),
            trip.receive(),
        ),
        KERNELS,
    )
    for index, operation in enumerate(OPERATIONS):
        times[operation]["eager"] = eager[index]
        times[operation]["graph"] = graph[index]
        times[operation]["send"] = hooked[2 * index]
        times[operation]["recv"] = hooked[2 * index + 1]
    received = int(trip.recv_count.sum())
    return {
        "num_tokens": num_tokens,
        "num_experts": buffer.num_experts,
        "num_selections": trip.num_selections,
        "num_received": received,
        "times_us": times,
        "layer_pair_us": layers,
        "kernels_us": kernels,
        "phases": phases,
    }


def bench_rank(rank: int, num_ranks: int, group: Any, config: dict[str, Any]) -> dict[str, Any]:
    gpu = torch.cuda.current_device()
    gpu_of_rank: list[Any] = [None] * num_ranks
    dist.all_gather_object(
        gpu_of_rank, (os.uname().nodename, str(torch.cuda.get_device_properties(gpu).uuid)), group=group
    )
    # The first rank of each GPU measures the copy bandwidth while the others wait.
    first_on_gpu = gpu_of_rank.index(gpu_of_rank[rank]) == rank
    bandwidth = copy_bandwidth_gbs() if first_on_gpu else None
    dist.barrier(group=group)
    results, barriers, sm_cap = [], [], 0
    if config.get("phases"):
        request_phase_clock()  # before the buffers are built
    nodes = {}
    if config.get("num_ranks_per_node"):
        os.environ["EP_LL_SCALEOUT"] = "1"  # every rank sets it before its buffers read it
        nodes = {"num_ranks_per_node": config["num_ranks_per_node"]}
    for num_experts in config["experts"]:
        buffer = deep_ep.ElasticBuffer(
            group,
            hidden=config["hidden"],
            num_topk=config["num_topk"],
            num_max_dispatch_tokens_per_rank=config["cap"],
            num_experts=num_experts,
            explicitly_destroy=True,
            **nodes,
        )
        try:
            sm_cap = buffer._max_num_sms
            barriers += barrier_us(buffer, config["iters"])
            for num_tokens in config["tokens"]:
                results.append(bench_tokens(buffer, num_tokens, config, rank))
        finally:
            buffer.destroy()
        torch.cuda.empty_cache()
    return {
        "rank": rank,
        "gpu": gpu_of_rank[rank],
        "device_name": torch.cuda.get_device_name(gpu),
        "copy_gbs": bandwidth,
        "barrier_us": barriers,
        "sm_cap": sm_cap,
        "results": results,
    }


# --------------------------------------------------------------------------- figures


def slowest_rank_median(per_rank_runs: list[list[float]]) -> float:
    """Median over runs of the slowest rank's time (runs are aligned by the barriers)."""
    return statistics.median(max(run) for run in zip(*per_rank_runs, strict=True))


def summarize(per_rank: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    hidden = config["hidden"]
    message_bytes = _C.low_latency_message_bytes(hidden, True)
    gpus = sorted({tuple(item["gpu"]) for item in per_rank})
    bandwidth = {gpu: next(item["copy_gbs"] for item in per_rank if tuple(item["gpu"]) == gpu) for gpu in gpus}
    barrier = slowest_rank_median([item["barrier_us"] for item in per_rank])
    rows = []
    for num_experts in config["experts"]:
        for num_tokens in config["tokens"]:
            entries = [
                next(r for r in item["results"] if r["num_tokens"] == num_tokens and r["num_experts"] == num_experts)
                for item in per_rank
            ]
            for operation in OPERATIONS:
                per_selection = message_bytes if operation == "dispatch" else 2 * hidden
                floor_us = 0.0
                for gpu in gpus:
                    ranks = [i for i, item in enumerate(per_rank) if tuple(item["gpu"]) == gpu]
                    if operation == "dispatch":
                        moved = sum(
                            2 * hidden * num_tokens + message_bytes * entries[i]["num_selections"] for i in ranks
                        )
                    else:
                        moved = sum(2 * hidden * (entries[i]["num_received"] + num_tokens) for i in ranks)
                    floor_us = max(floor_us, moved / (bandwidth[gpu] * 1e9) * 1e6)
                floor_us += barrier
                times = {mode: slowest_rank_median([e["times_us"][operation][mode] for e in entries]) for mode in MODES}
                pair = {kind: slowest_rank_median([e["layer_pair_us"][kind] for e in entries]) for kind in LAYER_KINDS}
                kernels = {
                    name: max(e["kernels_us"].get(name, 0.0) for e in entries)
                    for name in KERNELS
                    if name.startswith(operation) and any(name in e["kernels_us"] for e in entries)
                }
                bytes_per_rank = [per_selection * entry["num_selections"] for entry in entries]
                mean_bytes = sum(bytes_per_rank) / len(bytes_per_rank)
                rows.append(
                    {
                        "num_experts": num_experts,
                        "num_tokens": num_tokens,
                        "operation": operation,
                        "time_us": times,
                        "bytes_per_rank": bytes_per_rank,
                        "gbs_per_rank_eager": mean_bytes / (times["eager"] * 1e-6) / 1e9,
                        "gbs_per_rank_graph": mean_bytes / (times["graph"] * 1e-6) / 1e9,
                        "floor_us": floor_us,
                        "floor_fraction_eager": floor_us / times["eager"],
                        "floor_fraction_graph": floor_us / times["graph"],
                        "layer_pair_us": pair,  # dispatch + combine, back to back (same on both rows)
                        "kernels_us_max_over_ranks": kernels,
                    }
                )
                if config.get("phases"):
                    rows[-1]["phases"] = {
                        mode: {
                            kernel: item
                            for kernel, item in phase_summary(
                                [e["phases"][mode] for e in entries], len(gpus) == 1
                            ).items()
                            if kernel.startswith(f"ll_{operation}")
                        }
                        for mode in entries[0]["phases"]
                    }
    return {
        "config": config,
        "num_ranks": len(per_rank),
        "num_gpus": len(gpus),
        "device_name": per_rank[0]["device_name"],
        "sm_cap_per_rank": per_rank[0]["sm_cap"],
        "copy_gbs_per_gpu": list(bandwidth.values()),
        "barrier_us": barrier,
        "message_bytes_fp8": message_bytes,
        "rows": rows,
    }


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    experts = summary["config"]["experts"]
    figure, axes = plt.subplots(2, len(experts), figsize=(6 * len(experts), 8), squeeze=False)
    for column, num_experts in enumerate(experts):
        for row_index, operation in enumerate(OPERATIONS):
            axis = axes[row_index][column]
            rows = [r for r in summary["rows"] if r["num_experts"] == num_experts and r["operation"] == operation]
            tokens = [r["num_tokens"] for r in rows]
            for mode in MODES:
                label = {"send": "hook: send phase", "recv": "hook: receive phase"}.get(mode, mode)
                axis.plot(tokens, [r["time_us"][mode] for r in rows], marker="o", label=label)
            axis.plot(tokens, [r["floor_us"] for r in rows], linestyle="--", color="black", label="HBM floor + barrier")
            axis.set_xscale("log", base=2)
            axis.set_xlabel("tokens per rank (T)")
            axis.set_ylabel("time (us, median of the slowest rank)")
            axis.set_title(f"{operation}, E={num_experts}")
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=8)
    config = summary["config"]
    figure.suptitle(
        f"deep_ep LL: {summary['num_ranks']} ranks on {summary['num_gpus']} GPU(s), H={config['hidden']}, "
        f"K={config['num_topk']}, T_ll={config['cap']}, fp8 dispatch, bf16 combine"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_outputs(summary: dict[str, Any], out_dir: str) -> None:
    save_summary(summary, out_dir, "bench_ll", plot)
    print(
        f"copy bandwidth {summary['copy_gbs_per_gpu']} GB/s, barrier {summary['barrier_us']:.1f} us, "
        f"SM cap per rank {summary['sm_cap_per_rank']}"
        + (
            f", virtual nodes of {summary['config']['num_ranks_per_node']} ranks (LL between nodes over the transport)"
            if summary["config"].get("num_ranks_per_node")
            else ""
        )
    )
    print(
        f"{'E':>4} {'T':>4} {'op':<9} {'eager':>7} {'graph':>7} {'send':>7} {'recv':>7} {'GB/s':>7} {'floor':>6}"
        f"  pair in a chain: {'rotating':>8} {'reusing':>8}  kernels (us, slowest rank)"
    )
    for row in summary["rows"]:
        t, pair = row["time_us"], row["layer_pair_us"]
        chain = f"  {'':16}{pair['rotating']:>8.1f} {pair['reusing']:>8.1f}"
        if row["operation"] != "dispatch":
            chain = " " * len(chain)
        kernels = " ".join(
            f"{name.removeprefix(row['operation'] + '_').removesuffix('_kernel')}={value:.1f}"
            for name, value in row["kernels_us_max_over_ranks"].items()
        )
        print(
            f"{row['num_experts']:>4} {row['num_tokens']:>4} {row['operation']:<9} {t['eager']:>7.1f} "
            f"{t['graph']:>7.1f} {t['send']:>7.1f} {t['recv']:>7.1f} {row['gbs_per_rank_graph']:>7.1f} "
            f"{row['floor_fraction_graph']:>6.2f}{chain}  {kernels}"
        )
    for row in summary["rows"]:
        for mode, phases in row.get("phases", {}).items():
            print_phases(f"E={row['num_experts']} T={row['num_tokens']} {row['operation']} {mode}", phases)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tokens = [int(value) for value in args.tokens.split(",") if value.strip()]
    config = {
        "tokens": tokens,
        "experts": [int(value) for value in args.experts.split(",") if value.strip()],
        "cap": max(tokens),
        "hidden": args.hidden,
        "num_topk": args.num_topk,
        "warmup": args.warmup,
        "iters": args.iters,
        "recv_layout": args.recv_layout,
        "num_ranks_per_node": args.num_ranks_per_node,
        "phases": args.phases,
    }
    per_rank = run_ranks(bench_rank, args.num_ranks, config)
    if per_rank is not None:
        write_outputs(summarize(per_rank, config), args.out)


if __name__ == "__main__":
    main()
