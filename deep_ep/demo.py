"""``python -m deep_ep.demo``: the planner report for a DeepSeek-V3-like setup, then (with a GPU)
one HT dispatch -> identity expert -> combine round trip and one LL dispatch -> combine, checked
rank by rank against the reference model.

The identity expert dequantises what it received (fp8 dispatch) to bf16 and returns it, so every
number the kernels produce is predicted exactly by ``deep_ep.testing.reference``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from typing import TypeVar

import torch

import deep_ep
from deep_ep.fp8 import per_token_cast_back
from deep_ep.plan import PlanConfig, build_plan, format_plan
from deep_ep.testing import launch
from deep_ep.testing.data import make_group_inputs
from deep_ep.testing.reference import ht_combine, ht_dispatch, ll_combine, ll_dispatch, ll_valid_row_mask

HIDDEN = 7168
NUM_TOPK = 8
BASE_NUM_EXPERTS = 256
HT_TOKENS_PER_RANK = 512
LL_TOKENS_PER_RANK = 64

Result = TypeVar("Result")


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    if torch.cuda.device_count() == 0:
        return "no CUDA device is visible"
    return None


def _timed(fn: Callable[[], Result]) -> tuple[Result, float]:
    """``(fn(), wall milliseconds)`` with the device idle before and after."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, (time.perf_counter() - start) * 1e3


def _same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bitwise equality (fp8 compared through its bytes)."""
    if actual.dtype == torch.float8_e4m3fn:
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    return actual.shape == expected.shape and torch.equal(actual.cpu(), expected.cpu())


def _ht_round_trip(
    buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int, num_experts: int, seed: int
) -> tuple[dict, dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    data = make_group_inputs(num_ranks, HT_TOKENS_PER_RANK, HIDDEN, num_experts, NUM_TOPK, seed=seed, use_fp8=True)
    xs = [(fp8.to(device), scales.to(device)) for fp8, scales in data.dispatch_xs]
    topk_idxs = [idx.to(device) for idx in data.topk_idx]
    weights = [w.to(device) for w in data.topk_weights]

    expected = ht_dispatch(xs, topk_idxs, weights, num_experts)
    ys = [per_token_cast_back(result["x"], result["x_scales"]) for result in expected]
    expected_combined = ht_combine(expected, ys, topk_idxs, num_experts)[rank]["x"]

    (recv_x, _, recv_weights, handle, _), dispatch_ms = _timed(
        lambda: buffer.dispatch(xs[rank], topk_idxs[rank], weights[rank], num_experts=num_experts)
    )
    recv_fp8, recv_scales = recv_x
    dispatch_ok = (
        _same(recv_fp8, expected[rank]["x"])
        and _same(recv_scales, expected[rank]["x_scales"])
        and _same(recv_weights, expected[rank]["topk_weights"])
    )
    y = per_token_cast_back(recv_fp8, recv_scales)
    (combined_x, _, _), combine_ms = _timed(lambda: buffer.combine(y, handle))
    passed = {"ht_dispatch": dispatch_ok, "ht_combine": _same(combined_x, expected_combined)}
    return passed, {"ht_dispatch": dispatch_ms, "ht_combine": combine_ms}


def _ll_round_trip(
    buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int, num_experts: int, seed: int
) -> tuple[dict, dict]:
    device = torch.device("cuda", torch.cuda.current_device())
    data = make_group_inputs(num_ranks, LL_TOKENS_PER_RANK, HIDDEN, num_experts, NUM_TOPK, seed=seed)
    xs = [x.to(device) for x in data.x]
    topk_idxs = [idx.to(device) for idx in data.topk_idx]
    weights = [w.to(device) for w in data.topk_weights]

    expected = ll_dispatch(xs, topk_idxs, num_experts, LL_TOKENS_PER_RANK, use_fp8=True)
    ys = [per_token_cast_back(result["x"], result["x_scales"]) for result in expected]
    expected_combined = ll_combine(expected, ys, topk_idxs, weights, num_experts, LL_TOKENS_PER_RANK)[rank]

    (recv_x, recv_count, handle, _, _), dispatch_ms = _timed(
        lambda: buffer.low_latency_dispatch(xs[rank], topk_idxs[rank], LL_TOKENS_PER_RANK, num_experts, use_fp8=True)
    )
    recv_fp8, recv_scales = recv_x
    # Rows past each (expert, source) count are undefined: compare only the rows dispatch defines.
    valid = ll_valid_row_mask(expected[rank])
    dispatch_ok = (
        _same(recv_count, expected[rank]["count"])
        and _same(recv_fp8[valid], expected[rank]["x"][valid])
        and _same(recv_scales[valid], expected[rank]["x_scales"][valid])
    )
    y = per_token_cast_back(recv_fp8, recv_scales)
    (combined_x, _, _), combine_ms = _timed(
        lambda: buffer.low_latency_combine(y, topk_idxs[rank], weights[rank], handle)
    )
    passed = {"ll_dispatch": dispatch_ok, "ll_combine": _same(combined_x, expected_combined)}
    return passed, {"ll_dispatch": dispatch_ms, "ll_combine": combine_ms}


def round_trip(
    rank: int,
    num_ranks: int,
    group: torch.distributed.ProcessGroup,
    num_experts: int,
    seed: int,
    *,
    low_latency: bool = True,
    num_gpu_timeout_secs: float | None = None,
) -> dict:
    """This rank's part of the checked round trips on ``group`` (every rank calls it): ``{"rank",
    "passed": {operation: bool}, "elapsed_ms": {operation: float}}``. ``low_latency=False`` builds an
    HT-only buffer and skips LL (ranks on several hosts)."""
    buffer = deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=HT_TOKENS_PER_RANK,
        hidden=HIDDEN,
        num_topk=NUM_TOPK,
        use_fp8_dispatch=True,
        num_max_dispatch_tokens_per_rank=LL_TOKENS_PER_RANK if low_latency else 0,
        num_experts=num_experts,
        explicitly_destroy=True,
        num_gpu_timeout_secs=num_gpu_timeout_secs,
    )
    try:
        passed, elapsed = _ht_round_trip(buffer, rank, num_ranks, num_experts, seed)
        if low_latency:
            ll_passed, ll_ms = _ll_round_trip(buffer, rank, num_ranks, num_experts, seed + 1)
            passed, elapsed = {**passed, **ll_passed}, {**elapsed, **ll_ms}
    finally:
        buffer.destroy()
    return {"rank": rank, "passed": passed, "elapsed_ms": elapsed}


def demo_num_experts(num_ranks: int) -> int:
    """The demo's expert count: DeepSeek-V3's 256, rounded up to a multiple of the ranks."""
    return num_ranks * math.ceil(BASE_NUM_EXPERTS / num_ranks)


def _run_on_gpus(num_ranks: int, seed: int) -> bool:
    num_experts = demo_num_experts(num_ranks)
    print(
        f"\nGPU round trip on {num_ranks} ranks ({torch.cuda.device_count()} GPU(s)): hidden {HIDDEN}, "
        f"{num_experts} experts, top-{NUM_TOPK}, fp8 dispatch, HT {HT_TOKENS_PER_RANK} / LL {LL_TOKENS_PER_RANK} "
        "tokens per rank at most; wall time of one call each"
    )
    results = launch(round_trip, num_ranks, num_experts, seed)
    operations = ("ht_dispatch", "ht_combine", "ll_dispatch", "ll_combine")
    print("  rank  " + "  ".join(f"{name:>20}" for name in operations))
    for result in results:
        cells = [
            f"{'pass' if result['passed'][name] else 'FAIL'} {result['elapsed_ms'][name]:9.3f} ms"
            for name in operations
        ]
        print(f"  {result['rank']:>4}  " + "  ".join(f"{cell:>20}" for cell in cells))
    all_passed = all(all(result["passed"].values()) for result in results)
    print("all ranks match the reference" if all_passed else "MISMATCH against the reference")
    return all_passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deep_ep.demo",
        description="Planner report, then an HT and an LL round trip on the GPUs checked against the reference.",
    )
    parser.add_argument("--num-ranks", type=int, default=None, help="default: min(8, max(2, number of GPUs))")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.num_ranks is not None and args.num_ranks < 1:
        parser.error(f"--num-ranks must be >= 1, got {args.num_ranks}")

    print(format_plan(build_plan(PlanConfig())))
    skip_reason = _gpu_skip_reason()
    if skip_reason is not None:
        print(f"\nGPU part skipped: {skip_reason}.")
        return 0
    num_ranks = args.num_ranks or min(8, max(2, torch.cuda.device_count()))
    return 0 if _run_on_gpus(num_ranks, args.seed) else 1


if __name__ == "__main__":
    sys.exit(main())
