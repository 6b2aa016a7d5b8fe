"""scripts/step_limit.sh (gpu_check.sh's EP_GPU_CHECK_BUDGET): a step's limit is cut to what the
budget leaves, a step with too little left is skipped, and without a budget the limit stands."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "step_limit.sh"


def _step_limit(limit: int, budget: int, elapsed: int) -> int:
    start = int(time.time()) - elapsed
    command = f'BUDGET={budget}; start={start}; source "{SCRIPT}"; step_limit {limit}'
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True)
    return int(result.stdout)


def test_without_a_budget_the_step_keeps_its_limit():
    assert _step_limit(900, budget=0, elapsed=10_000) == 900


def test_a_step_that_fits_keeps_its_limit():
    assert _step_limit(120, budget=540, elapsed=100) == 120


def test_a_step_that_would_run_past_the_budget_is_cut_to_the_time_left():
    # The case that ran a device call past its 600 s: a 130 s step started 480 s into a 535 s budget.
    limit = _step_limit(130, budget=535, elapsed=480)
    assert 53 <= limit <= 55


def test_a_step_with_less_than_30_s_left_is_skipped():
    assert _step_limit(130, budget=535, elapsed=510) == 0
    assert _step_limit(130, budget=535, elapsed=600) == 0
