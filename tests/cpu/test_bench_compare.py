"""benchmarks/bench_compare.py: rows matched by key across two summaries, ratios, kernels before → after,
rows of one side only, HT's host µs, a refusal to compare two different benchmarks, and the
phase-stamp table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

bench_compare = pytest.importorskip("bench_compare")


def _ht_row(operation: str, time_us: float, notify: float, notify_min: float) -> dict:
    return {
        "num_tokens": 4096,
        "operation": operation,
        "requested_num_sms": 0,
        "num_ranks_per_node": None,
        "time_us": time_us,
        "floor_fraction": 0.25,
        "host_us_max_over_ranks": time_us / 10,
        "kernels_us_max_over_ranks": {"notify_kernel": notify, "dispatch_kernel": 500.0},
        "kernels_us_min_over_ranks": {"notify_kernel": notify_min, "dispatch_kernel": 500.0},
    }


def _ll_row(operation: str, graph_us: float) -> dict:
    return {
        "num_experts": 256,
        "num_tokens": 128,
        "operation": operation,
        "time_us": {"eager": 1.0, "graph": graph_us},
        "floor_fraction_graph": 0.4,
        "kernels_us_max_over_ranks": {f"{operation}_send_kernel": 60.0},
    }


def test_ht_rows_are_matched_by_key_with_the_ratio_and_the_kernels_min_over_ranks():
    before = {"rows": [_ht_row("dispatch_fp8", 1000.0, 74.0, 71.3), _ht_row("combine_bf16", 900.0, 0, 0)]}
    after = {"rows": [_ht_row("combine_bf16", 900.0, 0, 0), _ht_row("dispatch_fp8", 950.0, 77.2, 66.4)]}
    lines = bench_compare.compare(before, after).splitlines()
    dispatch = next(line for line in lines if "dispatch_fp8" in line)
    assert "| T=4096 dispatch_fp8 | 1,000.0 | 950.0 | 0.950 | 0.25 | 0.25 | 100.0 → 95.0 |" in dispatch
    assert "notify 74.0 [71.3] → 77.2 [66.4]" in dispatch
    assert "dispatch 500.0 → 500.0" in dispatch  # max = min: no bracket


def test_a_row_of_one_side_only_shows_a_dash_on_the_other():
    before = {"rows": [_ll_row("dispatch", 150.0)]}
    after = {"rows": [_ll_row("dispatch", 140.0), _ll_row("combine", 170.0)]}
    table = bench_compare.compare(before, after)
    assert "| E=256 T=128 dispatch | 150.0 | 140.0 | 0.933 |" in table
    assert "| E=256 T=128 combine | - | 170.0 | - | - | 0.40 |" in table


def test_two_different_benchmarks_are_refused_from_the_command_line(tmp_path):
    ht = tmp_path / "ht.json"
    ll = tmp_path / "ll.json"
    ht.write_text(json.dumps({"rows": [_ht_row("dispatch_fp8", 1.0, 1.0, 1.0)]}))
    ll.write_text(json.dumps({"rows": [_ll_row("dispatch", 1.0)]}))
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_compare.py"), str(ht), str(ll)], capture_output=True, text=True
    )
    assert done.returncode != 0
    assert "different benchmarks (ht and ll)" in done.stderr


def _clocked(**stamps: float) -> dict:
    return {"stamps_us_max_over_ranks": {"start": 0.1, **stamps}, "start_skew_us": 2.0}


def test_phase_stamps_are_compared_per_kernel_and_ll_context():
    before_ll = _ll_row("dispatch", 150.0)
    after_ll = _ll_row("dispatch", 140.0)
    before_ll["phases"] = {"chain": {"ll_dispatch_send": _clocked(gate_open=4.3, end=24.5)}}
    after_ll["phases"] = {"chain": {"ll_dispatch_send": _clocked(gate_open=4.1, end=20.9)}}
    table = bench_compare.compare_phases({"rows": [before_ll]}, {"rows": [after_ll]})
    expected = "| E=256 T=128 dispatch | chain ll_dispatch_send | gate_open 4.3 → 4.1; end 24.5 → 20.9 | 2.0 → 2.0 |"
    assert expected in table
    assert "start 0.1" not in table  # the entry stamp is the reference, not a phase

    before_ht = _ht_row("dispatch_fp8", 1000.0, 74.0, 71.3)
    before_ht["phases"] = {"ht_notify": _clocked(blocks_counted=11.4)}
    table = bench_compare.compare_phases({"rows": [before_ht]}, {"rows": [_ht_row("dispatch_fp8", 950.0, 1, 1)]})
    assert "| T=4096 dispatch_fp8 | ht_notify | blocks_counted 11.4 → - | 2.0 → - |" in table


def test_no_phase_table_without_the_phase_clock():
    plain = {"rows": [_ll_row("dispatch", 1.0)]}
    assert bench_compare.compare_phases(plain, plain) == ""
