"""benchmarks/bench_ht.py's bookkeeping (no GPU): rows per (T, operation, SM count), the speed-up over
the baseline, and the num_sms sweep check against the estimate, on hand-made per-rank results."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

bench_ht = pytest.importorskip("bench_ht")

HIDDEN = 7168


def _result(num_tokens, operation, requested, sms, median_us, recv=8000):
    return {
        "num_tokens": num_tokens,
        "operation": operation,
        "median_us": median_us,
        "p10_us": median_us,
        "p90_us": median_us,
        "num_recv_tokens": recv,
        "requested_num_sms": requested,
        "num_sms": sms,
        "kernels_us": {"dispatch_kernel": median_us / 2},
    }


def _per_rank(rank_time_scale):
    results = [
        # The estimate picked 20 SMs; 8 and 32 were also swept.
        _result(4096, "dispatch_bf16", 0, 20, 400.0 * rank_time_scale),
        _result(4096, "combine_bf16", 0, 20, 300.0 * rank_time_scale),
        _result(4096, "dispatch_bf16", 8, 8, 800.0 * rank_time_scale),
        _result(4096, "combine_bf16", 8, 8, 600.0 * rank_time_scale),
        _result(4096, "dispatch_bf16", 32, 32, 380.0 * rank_time_scale),
        _result(4096, "combine_bf16", 32, 32, 330.0 * rank_time_scale),
        _result(4096, "baseline_dispatch_bf16", 0, 0, 1200.0 * rank_time_scale),
        _result(4096, "baseline_combine_bf16", 0, 0, 1500.0 * rank_time_scale),
    ]
    return {"rank": 0, "gpu": ["host", "gpu0"], "copy_gbs": 4000.0, "results": results}


@pytest.fixture
def summary():
    config = {"tokens": [4096], "hidden": HIDDEN, "num_topk": 8, "num_experts": 256, "num_sms": [0, 8, 32]}
    config["baseline"] = True
    per_rank = [_per_rank(1.0), _per_rank(1.1)]
    per_rank[1]["gpu"] = ["host", "gpu1"]
    return bench_ht.summarize(per_rank, config)


def test_rows_keep_each_sm_count_apart_and_take_the_slowest_rank(summary):
    rows = {(r["operation"], r["requested_num_sms"]): r for r in summary["rows"]}
    assert len(rows) == 8
    assert rows[("dispatch_bf16", 8)]["time_us"] == pytest.approx(880.0)
    assert rows[("dispatch_bf16", 0)]["num_sms"] == 20
    expected_gbs = HIDDEN * 2 * 8000 / 400e-6 / 1e9
    assert rows[("dispatch_bf16", 0)]["gbs_per_rank"][0] == pytest.approx(expected_gbs)


def test_speedup_is_baseline_time_over_ours_at_the_first_requested_sm_count(summary):
    rows = {(r["operation"], r["requested_num_sms"]): r for r in summary["rows"]}
    assert rows[("dispatch_bf16", 0)]["speedup_vs_baseline"] == pytest.approx(1320.0 / 440.0)
    assert rows[("combine_bf16", 0)]["speedup_vs_baseline"] == pytest.approx(1650.0 / 330.0)
    assert "speedup_vs_baseline" not in rows[("dispatch_bf16", 32)]
    assert "speedup_vs_baseline" not in rows[("baseline_dispatch_bf16", 0)]


def test_sweep_compares_the_estimate_with_the_best_sm_count(summary):
    sweep = {item["operation"]: item for item in summary["num_sms_sweep"]}
    assert set(sweep) == {"dispatch_bf16", "combine_bf16"}  # the baseline has no SM count to sweep
    dispatch = sweep["dispatch_bf16"]
    assert dispatch["best_num_sms"] == 32
    assert dispatch["estimate_num_sms"] == 20
    assert dispatch["estimate_fraction_of_best"] == pytest.approx(380.0 / 400.0)
    combine = sweep["combine_bf16"]
    assert combine["best_num_sms"] == 20
    assert combine["estimate_fraction_of_best"] == pytest.approx(1.0)
    assert set(combine["gbs_by_num_sms"]) == {"8", "20", "32"}


def test_outputs_are_written(summary, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bench_ht.write_outputs(summary, str(tmp_path))
    assert json.loads((tmp_path / "bench_ht.json").read_text())["num_sms_sweep"]
    assert (tmp_path / "bench_ht.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "x the baseline" in printed and "of best" in printed
