"""scripts/pack_out.sh: what comes back from a device run stays within the tool's file limit, JSON
results outside the archive where they fit."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "pack_out.sh"


def _make(root: Path, names: list[str]) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(name)


def _pack(root: Path, limit: int = 8) -> str:
    result = subprocess.run(["bash", str(SCRIPT), str(root), str(limit)], capture_output=True, text=True, check=True)
    return result.stdout


def _files(root: Path) -> list[str]:
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())


def test_a_folder_within_the_limit_is_left_alone(tmp_path):
    names = ["build.log", "doctor.txt", "ht/bench_ht.json", "ht/bench_ht.png"]
    _make(tmp_path, names)
    assert _pack(tmp_path) == ""
    assert _files(tmp_path) == sorted(names)


def test_everything_but_the_json_results_is_packed_when_there_are_too_many(tmp_path):
    logs = [f"command_{i}.log" for i in range(6)] + ["doctor.txt", "a/bench_ht.png", "b/bench_ll.png"]
    results = ["a/bench_ht.json", "b/bench_ll.json"]
    _make(tmp_path, logs + results)
    assert "9 of 11 files packed" in _pack(tmp_path)
    assert _files(tmp_path) == sorted([*results, "logs.tar.gz"])
    with tarfile.open(tmp_path / "logs.tar.gz") as archive:
        assert sorted(name.removeprefix("./") for name in archive.getnames()) == sorted(logs)


def test_the_json_results_go_in_too_when_they_alone_are_too_many(tmp_path):
    results = [f"run{i}/bench_ht.json" for i in range(8)]
    _make(tmp_path, [*results, "build.log"])
    _pack(tmp_path)
    assert _files(tmp_path) == ["logs.tar.gz"]  # the emptied folders are gone too
    with tarfile.open(tmp_path / "logs.tar.gz") as archive:
        assert len(archive.getnames()) == 9
