"""benchmarks/bench_ll.py's bookkeeping (no GPU): the slowest rank's median per mode and the
per-kernel times split by operation, on hand-made per-rank results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

bench_ll = pytest.importorskip("bench_ll")

HIDDEN = 7168


def _rank(rank: int, scale: float) -> dict:
    runs = [10.0 * scale, 30.0 * scale, 20.0 * scale]
    result = {
        "num_tokens": 128,
        "num_experts": 256,
        "num_selections": 1024,
        "num_received": 1000,
        "times_us": {op: {mode: list(runs) for mode in bench_ll.MODES} for op in bench_ll.OPERATIONS},
        "layer_pair_us": {kind: list(runs) for kind in bench_ll.LAYER_KINDS},
        "kernels_us": {name: 5.0 * scale for name in bench_ll.KERNELS},
    }
    return {
        "rank": rank,
        "gpu": ["host", "gpu0"],
        "device_name": "test",
        "copy_gbs": 4000.0 if rank == 0 else None,
        "barrier_us": [40.0, 40.0, 40.0],
        "sm_cap": 16,
        "results": [result],
    }


def test_rows_take_the_slowest_rank_and_split_kernels_by_operation():
    config = {"tokens": [128], "experts": [256], "hidden": HIDDEN, "num_topk": 8}
    summary = bench_ll.summarize([_rank(0, 1.0), _rank(1, 2.0)], config)
    rows = {row["operation"]: row for row in summary["rows"]}
    assert rows["dispatch"]["time_us"]["graph"] == pytest.approx(40.0)  # median of the slower rank's runs
    assert rows["dispatch"]["kernels_us_max_over_ranks"] == {
        "dispatch_fused": 10.0,
        "dispatch_send": 10.0,
        "dispatch_recv": 10.0,
    }
    assert set(rows["combine"]["kernels_us_max_over_ranks"]) == {
        "combine_fused",
        "combine_send",
        "combine_recv",
    }


def test_kernels_no_rank_profiled_are_left_out():
    config = {"tokens": [128], "experts": [256], "hidden": HIDDEN, "num_topk": 8}
    ranks = [_rank(0, 1.0), _rank(1, 2.0)]
    for result in ranks:
        for name in ("dispatch_fused", "combine_fused"):
            del result["results"][0]["kernels_us"][name]
    rows = {row["operation"]: row for row in bench_ll.summarize(ranks, config)["rows"]}
    assert set(rows["dispatch"]["kernels_us_max_over_ranks"]) == {"dispatch_send", "dispatch_recv"}


def _phases(start_ns: list[int], send_end: float) -> dict:
    return {
        "ll_dispatch_send": {"stamps_us": {"start": 1.0, "end": send_end}, "start_ns": start_ns},
        "ll_combine_recv": {"stamps_us": {"start": 0.5, "rows_reduced": 9.0}, "start_ns": start_ns},
    }


def test_phase_rows_take_the_largest_phase_over_ranks_and_the_start_skew_on_one_gpu():
    config = {"tokens": [128], "experts": [256], "hidden": HIDDEN, "num_topk": 8, "phases": True}
    ranks = [_rank(0, 1.0), _rank(1, 2.0)]
    ranks[0]["results"][0]["phases"] = {"graph": _phases([1_000, 5_000, 9_000], 30.0)}
    ranks[1]["results"][0]["phases"] = {"graph": _phases([3_000, 5_500, 9_000], 20.0)}
    rows = {row["operation"]: row for row in bench_ll.summarize(ranks, config)["rows"]}
    dispatch = rows["dispatch"]["phases"]["graph"]
    assert list(dispatch) == ["ll_dispatch_send"]  # the combine kernels go to the combine row
    assert dispatch["ll_dispatch_send"]["stamps_us_max_over_ranks"] == {"start": 1.0, "end": 30.0}
    assert dispatch["ll_dispatch_send"]["start_skew_us"] == pytest.approx(0.5)  # median of 2.0, 0.5, 0.0
    assert list(rows["combine"]["phases"]["graph"]) == ["ll_combine_recv"]


def test_phase_rows_leave_out_the_skew_across_gpus():
    from bench_common import phase_summary

    entries = [_phases([1_000], 5.0), _phases([9_000], 6.0)]
    summary = phase_summary(entries, same_clock=False)
    assert "start_skew_us" not in summary["ll_dispatch_send"]
    assert summary["ll_dispatch_send"]["stamps_us_max_over_ranks"]["end"] == 6.0


def test_the_benchmarks_request_the_phase_clock_through_the_variable_the_buffer_reads(monkeypatch):
    from bench_common import request_phase_clock

    from deep_ep import phase_clock

    monkeypatch.delenv(phase_clock.ENV, raising=False)
    request_phase_clock()
    assert phase_clock.requested() is True
