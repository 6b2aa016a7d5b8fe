"""scripts/ncu_hotspots.py: the hottest instructions summed over profiled launches, and code regions
(runs of equal execution count) with their samples, from a source page in Nsight Compute's CSV form."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ncu_hotspots.py"
HEADER = [
    "Address",
    "Source",
    "Warp Stall Sampling (All Samples)",
    "Warp Stall Sampling (Not-issued Samples)",
    "Instructions Executed",
    "stall_barrier",
    "stall_long_sb",
    "stall_barrier (Not Issued)",
]
# (source, executions, samples, barrier, long_sb): all warps, then CTA 0's eight warps only.
LAUNCH = [
    ("LDG.E R1, desc[UR4][R2.64]", 128, 10, 0, 10),
    ("IADD3 R1, R1, 0x1, RZ", 128, 5, 0, 5),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 8, 2, 2, 0),
    ("STG.E desc[UR4][R2.64], R1", 8, 40, 30, 10),
    ("EXIT", 8, 1, 0, 0),
]


def _write_report(path: Path, launches: int) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        for _ in range(launches):
            writer.writerow(["Kernel Name", "notify_kernel(NotifyArgs)"])
            writer.writerow(HEADER)
            for index, (source, executed, samples, barrier, long_sb) in enumerate(LAUNCH):
                writer.writerow([hex(index * 16), f"      {source}", samples, samples, executed, barrier, long_sb, 0])


def _run(*args: str) -> str:
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=True)
    return result.stdout


def test_hottest_instructions_sum_every_launch(tmp_path):
    report = tmp_path / "notify_source.csv"
    _write_report(report, launches=2)
    lines = _run(str(report), "--top", "2").splitlines()
    assert lines[0].startswith("116 samples over 2 launch(es)")
    assert "barrier 55.2%, long_sb 43.1%" in lines[0]  # (2 + 30) x 2 and (10 + 5 + 10) x 2 of 116
    assert "80 #3" in lines[1] and "STG.E" in lines[1] and "barrier=60 long_sb=20" in lines[1]
    assert "20 #0" in lines[2] and "LDG.E" in lines[2]


def test_regions_group_instructions_that_the_same_warps_run(tmp_path):
    report = tmp_path / "notify_source.csv"
    _write_report(report, launches=2)
    lines = _run(str(report), "--regions").splitlines()
    assert lines[0].startswith("58 samples (first launch)")
    assert "#     0-1      exec=   128 samples=    15" in lines[1] and "LDG.E" in lines[1]
    assert "#     2-4      exec=     8 samples=    43" in lines[2]
    assert "BAR.SYNC.DEFER_BLOCKING STG.E EXIT" in lines[2]
    assert len(lines) == 3


def test_a_file_without_instruction_rows_is_an_error(tmp_path):
    report = tmp_path / "empty.csv"
    report.write_text('"File Name","notify.cu"\n"Line No","Source"\n')
    result = subprocess.run([sys.executable, str(SCRIPT), str(report)], capture_output=True, text=True)
    assert result.returncode == 1
    assert "no instruction rows" in result.stderr
