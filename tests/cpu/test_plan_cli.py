"""python -m deep_ep.plan and python -m deep_ep.demo, run as a user would (subprocess)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deep_ep.plan import PlanConfig, build_plan

REPO_ROOT = Path(__file__).resolve().parents[2]


def _run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_cli_default_prints_the_deepseek_like_table():
    result = _run("deep_ep.plan")
    assert result.returncode == 0, result.stderr
    plan = build_plan(PlanConfig())
    out = result.stdout
    assert "64 ranks (8 node(s) x 8), 256 experts, top-8, hidden 7168, fp8 dispatch" in out
    assert "LL message                             7,408 B" in out
    assert "242,745,344 B" in out
    assert "3.12 % of the slots" in out
    assert f"{plan['window']['total_bytes']:,} B" in out
    assert f"{plan['high_throughput']['region_bytes']:,} B" in out
    for label in ("ranks touched", "nodes touched", "per expert", "per rank", "per node", "Analytic SMs"):
        assert label in out


def test_cli_json_is_one_object_equal_to_build_plan():
    args = ["--num-ranks", "16", "--num-ranks-per-node", "4", "--num-experts", "64", "--hidden", "4096"]
    result = _run("deep_ep.plan", *args, "--no-fp8", "--max-nodes", "2", "--link-gbs", "25", "--json")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    expected = build_plan(
        PlanConfig(
            num_ranks=16, num_ranks_per_node=4, num_experts=64, hidden=4096, use_fp8=False, max_nodes=2, link_gbs=25.0
        )
    )
    assert printed == json.loads(json.dumps(expected))
    assert printed["low_latency"]["message_bytes"] == 2 * 4096 + 16
    assert printed["config"]["max_nodes"] == 2 and printed["config"]["use_fp8"] is False


@pytest.mark.parametrize(
    "args,argument",
    [
        (["--num-ranks", "0"], "num_ranks"),
        (["--num-experts", "100"], "num_experts"),
        (["--hidden", "7000"], "hidden"),
        (["--num-ranks-per-node", "3"], "num_ranks_per_node"),
        (["--max-nodes", "9"], "max_nodes"),
        (["--num-ranks", "many"], "--num-ranks"),
    ],
)
def test_cli_bad_input_is_one_line_on_stderr_and_exit_2(args, argument):
    result = _run("deep_ep.plan", *args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert argument in lines[0]
    assert "Traceback" not in result.stderr


def test_cli_error_is_the_function_error():
    result = _run("deep_ep.plan", "--num-experts", "100")
    with pytest.raises(ValueError) as error:
        build_plan(PlanConfig(num_experts=100))
    assert result.stderr.strip().endswith(str(error.value))


def test_demo_without_gpu_prints_the_report_and_skips():
    result = _run("deep_ep.demo", env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr
    assert "64 ranks (8 node(s) x 8), 256 experts" in result.stdout
    assert "242,745,344 B" in result.stdout
    assert "GPU part skipped: torch.cuda.is_available() is False" in result.stdout
