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


def test_default_run_prints_no_mode_or_scaleout_columns(summary, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert all(row["mode"] == "direct" and row["num_ranks_per_node"] is None for row in summary["rows"])
    assert not any("scaleout_copies_per_token" in row for row in summary["rows"])
    bench_ht.write_outputs(summary, str(tmp_path))
    header = capsys.readouterr().out.splitlines()[0]
    assert header.split()[:3] == ["T", "operation", "time"] and "so/tok" not in header


# --num-ranks-per-node: the default buffer's results first (as bench_rank runs them), then those of
# a buffer with S=2 that ran in hybrid mode. Rank 0's handle reports scale-out copies, rank 1's not.
def _hybrid(result, copies, planned):
    result.update(mode="hybrid", num_ranks_per_node=2, scaleout_copies_per_token_planned=planned)
    result.update(scaleout_copies=copies, scaleout_bytes=None if copies is None else copies * 100)
    result["scaleout_copies_per_token"] = None if copies is None else copies / 4096
    return result


def _layout_per_rank(scale, copies, planned):
    results = [
        _result(4096, "dispatch_bf16", 0, 20, 400.0 * scale),
        _result(4096, "combine_bf16", 0, 20, 300.0 * scale),
        _hybrid(_result(4096, "dispatch_bf16", 0, 24, 500.0 * scale, recv=6000), copies, planned),
        _hybrid(_result(4096, "combine_bf16", 0, 24, 350.0 * scale, recv=6000), copies, planned),
    ]
    return {"rank": 0, "gpu": ["host", "gpu0"], "copy_gbs": 4000.0, "results": results}


@pytest.fixture
def layout_summary():
    config = {"tokens": [4096], "hidden": HIDDEN, "num_topk": 8, "num_experts": 256, "num_sms": [0]}
    config["num_ranks_per_node"] = [2]
    return bench_ht.summarize([_layout_per_rank(1.0, 2048, 0.5), _layout_per_rank(1.1, 3072, 0.75)], config)


def test_direct_and_hybrid_rows_sit_side_by_side(layout_summary):
    keys = [(row["operation"], row["mode"], row["num_ranks_per_node"]) for row in layout_summary["rows"]]
    assert keys == [
        ("dispatch_bf16", "direct", None),
        ("dispatch_bf16", "hybrid", 2),
        ("combine_bf16", "direct", None),
        ("combine_bf16", "hybrid", 2),
    ]
    hybrid = layout_summary["rows"][1]
    assert hybrid["time_us"] == pytest.approx(550.0) and hybrid["num_sms"] == 24
    assert hybrid["gbs_per_rank"][0] == pytest.approx(HIDDEN * 2 * 6000 / 500e-6 / 1e9)
    assert hybrid["scaleout_copies_per_token_per_rank"] == [0.5, 0.75]
    assert hybrid["scaleout_copies_per_token"] == pytest.approx(0.625)
    assert hybrid["scaleout_copies_per_token_planned"] == pytest.approx(0.625)
    assert hybrid["scaleout_bytes_per_rank"] == [204800, 307200]
    assert "scaleout_copies_per_token" not in layout_summary["rows"][0]


def test_hybrid_rows_print_mode_and_scaleout_copies_or_na(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    config = {"tokens": [4096], "hidden": HIDDEN, "num_topk": 8, "num_experts": 256, "num_sms": [0]}
    config["num_ranks_per_node"] = [2]
    # Rank 1's handle has no scale-out stat: the row's measured figure is n/a, the plan is not.
    summary = bench_ht.summarize([_layout_per_rank(1.0, 2048, 0.5), _layout_per_rank(1.0, None, 0.7)], config)
    assert summary["rows"][1]["scaleout_copies_per_token"] is None
    bench_ht.write_outputs(summary, str(tmp_path))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["T", "operation", "mode", "S", "time"] and "so/tok" in lines[0]
    direct, hybrid = lines[1].split(), lines[2].split()
    assert direct[1:4] == ["dispatch_bf16", "direct", "-"]
    assert hybrid[1:4] == ["dispatch_bf16", "hybrid", "2"]
    assert hybrid[9:11] == ["n/a", "0.60"] and direct[9:11] == ["-", "-"]
    saved = json.loads((tmp_path / "bench_ht.json").read_text())
    assert saved["rows"][1]["scaleout_copies_per_token_per_rank"] == [0.5, None]


def test_sweep_keeps_buffers_apart():
    config = {"tokens": [4096], "hidden": HIDDEN, "num_topk": 8, "num_experts": 256, "num_sms": [0, 8]}
    per_rank = _layout_per_rank(1.0, 2048, 0.5)
    per_rank["results"] += [
        _result(4096, "dispatch_bf16", 8, 8, 900.0),
        _hybrid(_result(4096, "dispatch_bf16", 8, 8, 450.0, recv=6000), 2048, 0.5),
    ]
    sweep = bench_ht.summarize([per_rank], config)["num_sms_sweep"]
    by_layout = {(item["operation"], item["num_ranks_per_node"]): item for item in sweep}
    assert set(by_layout) == {("dispatch_bf16", None), ("dispatch_bf16", 2)}
    assert by_layout[("dispatch_bf16", None)]["best_num_sms"] == 20
    assert by_layout[("dispatch_bf16", 2)]["best_num_sms"] == 8 and by_layout[("dispatch_bf16", 2)]["mode"] == "hybrid"


def test_num_ranks_per_node_option_parses_and_checks_against_the_group():
    assert bench_ht.parse_args([]).num_ranks_per_node == ""
    assert bench_ht.parse_ranks_per_node("") == []
    assert bench_ht.parse_ranks_per_node("2, 4,2") == [2, 4]
    with pytest.raises(ValueError, match=">= 1, got 0"):
        bench_ht.parse_ranks_per_node("0")
    with pytest.raises(ValueError, match="comma list"):
        bench_ht.parse_ranks_per_node("two")
    # The default buffer always runs first; S equal to the group size is that same run.
    assert bench_ht.buffer_layouts(8, []) == [None]
    assert bench_ht.buffer_layouts(8, [2, 8, 4]) == [None, 2, 4]
    with pytest.raises(ValueError, match="divide the group size 8, got \\[3\\]"):
        bench_ht.buffer_layouts(8, [2, 3])


def test_scaleout_stats_read_the_handle_or_report_none():
    from types import SimpleNamespace

    torch = pytest.importorskip("torch")
    handle = SimpleNamespace(stats={"scaleout_copies": torch.tensor(3000), "scaleout_bytes": torch.tensor([10, 20])})
    assert bench_ht.scaleout_stats(handle, 4000) == {
        "scaleout_copies": 3000,
        "scaleout_bytes": 30,
        "scaleout_copies_per_token": 0.75,
    }
    for missing in (SimpleNamespace(stats={"tokens_per_source_rank": torch.zeros(2)}), SimpleNamespace()):
        assert bench_ht.scaleout_stats(missing, 4000) == {
            "scaleout_copies": None,
            "scaleout_bytes": None,
            "scaleout_copies_per_token": None,
        }


def test_planned_scaleout_copies_count_other_nodes_per_token():
    torch = pytest.importorskip("torch")
    # R=4, E=8 (expert e on rank e // 2), S=2: rank 2 (node 1) sends token 0 to node 0 once (experts 0
    # and 3 are on ranks 0 and 1), token 1 stays on node 1, token 2 goes nowhere.
    topk_idx = torch.tensor([[0, 3], [4, 7], [-1, -1]])
    assert bench_ht.planned_scaleout_copies(topk_idx, 8, 4, 2, rank=2) == pytest.approx(1 / 3)
    assert bench_ht.planned_scaleout_copies(topk_idx[:0], 8, 4, 2, rank=2) is None


def test_zero_copy_operations_are_listed_only_when_asked_for():
    assert not set(bench_ht.ZERO_COPY_OPERATIONS) & set(bench_ht.operation_names({}))
    names = bench_ht.operation_names({"zero_copy": True})
    assert names[-len(bench_ht.ZERO_COPY_OPERATIONS) :] == bench_ht.ZERO_COPY_OPERATIONS
    # Zero-copy rows carry the same bytes as their copy counterparts (the rows delivered are the same).
    assert bench_ht.token_bytes("dispatch_fp8_cached_zero_copy", HIDDEN) == bench_ht.token_bytes("dispatch_fp8", HIDDEN)
    assert bench_ht.token_bytes("dispatch_bf16_zero_copy", HIDDEN) == bench_ht.token_bytes("dispatch_bf16", HIDDEN)
    assert bench_ht.parse_args(["--zero-copy"]).zero_copy
