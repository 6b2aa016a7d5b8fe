"""Step time of the example MoE layer (examples/moe_layer.py) with and without two-batch overlap.

    python benchmarks/bench_overlap.py --num-ranks 8 --out DIR
    torchrun --nproc-per-node 8 benchmarks/bench_overlap.py --out DIR

Paths and modes, each timed as one layer call on every rank:

* ``ht_forward`` (prefill, no autograd) and ``ht_forward_backward`` (training: forward, then
  backward of the output with a fixed gradient) over ``--tokens`` tokens per rank;
* ``ll_forward`` (decode, fp8 dispatch) over ``--ll-tokens`` tokens per rank;

in three modes: ``plain`` (``forward``: one batch), ``two_batch`` (``forward_two_batch(overlap=False)``:
the same two micro-batches issued one after the other on one stream) and ``two_batch_overlap``
(``forward_two_batch(overlap=True)``: HT on two streams, LL with receive hooks; see the example's
docstring). ``two_batch`` / ``two_batch_overlap`` is what overlapping gains; ``plain`` /
``two_batch_overlap`` also counts the cost of splitting the batch.

A run starts right after a device barrier (all ranks start together) and is timed with CUDA events
on the caller's stream (the HT dispatch's CPU sync and any host gap inside the call are included).
A run's time is the slowest rank's; the figure is the median over ``--iters`` runs after
``--warmup``. With ranks sharing a GPU, micro-batches of all ranks compete for the same SMs, so the
overlap gain measured there is not a multi-GPU figure. Writes DIR/bench_overlap.json and
DIR/bench_overlap.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_common import run_ranks, save_summary, timed_after_barrier

from deep_ep.testing.data import make_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from moe_layer import MoEConfig, MoELayer, make_buffer  # noqa: E402  (examples/ is not a package)

PATHS = ("ht_forward", "ht_forward_backward", "ll_forward")
MODES = ("plain", "two_batch", "two_batch_overlap")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-ranks", type=int, default=8, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--out", default="benchmarks/results", help="output directory")
    parser.add_argument("--tokens", type=int, default=4096, help="HT tokens per rank")
    parser.add_argument("--ll-tokens", type=int, default=128, help="LL (decode) tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--ffn-hidden", type=int, default=2048, help="expert FFN width F")
    parser.add_argument("--num-experts", type=int, default=256)
    parser.add_argument("--num-topk", type=int, default=8)
    parser.add_argument("--expert-alignment", type=int, default=128)
    parser.add_argument("--num-sms", type=int, default=0, help="HT communication SMs per rank (0: the estimate)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {PATHS}")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="timed runs per path and mode")
    return parser.parse_args(argv)


def _forward(layer: MoELayer, x: torch.Tensor, mode: str, decode: bool) -> torch.Tensor:
    if mode == "plain":
        return layer(x, decode=decode)
    return layer.forward_two_batch(x, decode=decode, overlap=mode == "two_batch_overlap")


def make_step(layer: MoELayer, path: str, mode: str, inputs: dict[str, torch.Tensor]) -> Callable[[], None]:
    if path == "ht_forward":

        def step() -> None:
            with torch.no_grad():
                _forward(layer, inputs["x"], mode, decode=False)

    elif path == "ht_forward_backward":
        leaf = inputs["x"].detach().clone().requires_grad_()

        def step() -> None:
            layer.zero_grad(set_to_none=True)
            leaf.grad = None
            _forward(layer, leaf, mode, decode=False).backward(inputs["grad"])

    else:

        def step() -> None:
            _forward(layer, inputs["x_ll"], mode, decode=True)

    return step


def bench_rank(rank: int, num_ranks: int, group: Any, config: dict[str, Any]) -> dict[str, Any]:
    cfg = MoEConfig(
        hidden=config["hidden"],
        ffn_hidden=config["ffn_hidden"],
        num_experts=config["num_experts"],
        num_topk=config["num_topk"],
        expert_alignment=config["expert_alignment"],
        num_sms=config["num_sms"],
        ll_use_fp8=True,
    )
    device = torch.device("cuda", torch.cuda.current_device())
    buffer = make_buffer(group, cfg, config["tokens"], config["ll_tokens"])
    try:
        layer = MoELayer(buffer, cfg, device)
        layer.warm_up(config["tokens"])  # every GEMM shape loaded before the ranks communicate
        generator = torch.Generator().manual_seed(1000 + rank)
        inputs = {
            "x": make_tokens(config["tokens"], cfg.hidden, generator).to(device),
            "grad": torch.randn(config["tokens"], cfg.hidden, generator=generator).to(torch.bfloat16).to(device),
            "x_ll": make_tokens(config["ll_tokens"], cfg.hidden, generator).to(device),
        }
        times = {
            path: {
                mode: timed_after_barrier(
                    buffer, make_step(layer, path, mode, inputs), config["warmup"], config["iters"]
                )
                for mode in MODES
            }
            for path in config["paths"]
        }
    finally:
        buffer.destroy()
    return {
        "rank": rank,
        "device_name": torch.cuda.get_device_name(device),
        "num_gpus": torch.cuda.device_count(),
        "times_us": times,
    }


def slowest_rank_median(per_rank_runs: list[list[float]]) -> float:
    """Median over runs of the slowest rank's time (runs are aligned by the barriers)."""
    return statistics.median(max(run) for run in zip(*per_rank_runs, strict=True))


def summarize(per_rank: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for path in config["paths"]:
        time_us = {mode: slowest_rank_median([item["times_us"][path][mode] for item in per_rank]) for mode in MODES}
        rows.append(
            {
                "path": path,
                "num_tokens": config["ll_tokens"] if path == "ll_forward" else config["tokens"],
                "time_us": time_us,
                "overlap_speedup_vs_two_batch": time_us["two_batch"] / time_us["two_batch_overlap"],
                "overlap_speedup_vs_plain": time_us["plain"] / time_us["two_batch_overlap"],
            }
        )
    return {
        "config": config,
        "num_ranks": len(per_rank),
        "num_gpus": per_rank[0]["num_gpus"],
        "device_name": per_rank[0]["device_name"],
        "rows": rows,
    }


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    figure, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for axis, row in zip(axes[0], rows, strict=True):
        values = [row["time_us"][mode] for mode in MODES]
        axis.bar(MODES, values, color=["tab:gray", "tab:blue", "tab:green"])
        for index, value in enumerate(values):
            axis.text(index, value, f"{value:.0f}", ha="center", va="bottom", fontsize=8)
        axis.set_title(f"{row['path']} (T={row['num_tokens']})")
        axis.set_ylabel("step time (us, median of the slowest rank)")
        axis.tick_params(axis="x", labelsize=8)
        axis.grid(True, axis="y", alpha=0.3)
    config = summary["config"]
    figure.suptitle(
        f"MoE layer two-batch overlap: {summary['num_ranks']} ranks on {summary['num_gpus']} GPU(s), "
        f"H={config['hidden']}, F={config['ffn_hidden']}, E={config['num_experts']}, K={config['num_topk']}"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_outputs(summary: dict[str, Any], out_dir: str) -> None:
    save_summary(summary, out_dir, "bench_overlap", plot)
    print(f"{summary['num_ranks']} ranks on {summary['num_gpus']} GPU(s) ({summary['device_name']})")
    print(f"{'path':<20} {'T':>5} {'plain':>9} {'two_batch':>10} {'overlap':>9} {'vs 2-batch':>10} {'vs plain':>9}")
    for row in summary["rows"]:
        t = row["time_us"]
        print(
            f"{row['path']:<20} {row['num_tokens']:>5} {t['plain']:>9.1f} {t['two_batch']:>10.1f} "
            f"{t['two_batch_overlap']:>9.1f} {row['overlap_speedup_vs_two_batch']:>9.2f}x "
            f"{row['overlap_speedup_vs_plain']:>8.2f}x"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    paths = [path for path in args.paths.split(",") if path.strip()]
    unknown = [path for path in paths if path not in PATHS]
    if unknown:
        raise SystemExit(f"--paths: unknown {unknown}; choose from {PATHS}")
    config = {
        "tokens": args.tokens,
        "ll_tokens": args.ll_tokens,
        "hidden": args.hidden,
        "ffn_hidden": args.ffn_hidden,
        "num_experts": args.num_experts,
        "num_topk": args.num_topk,
        "expert_alignment": args.expert_alignment,
        "num_sms": args.num_sms,
        "paths": paths,
        "warmup": args.warmup,
        "iters": args.iters,
    }
    per_rank = run_ranks(bench_rank, args.num_ranks, config)
    if per_rank is not None:
        write_outputs(summarize(per_rank, config), args.out)


if __name__ == "__main__":
    main()
