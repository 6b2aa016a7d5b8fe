"""scripts/tree_hash.sh: the fingerprint gpu_check.sh prints, to match device calls to one tree. It
follows every source file's content and path and ignores build outputs and caches."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "tree_hash.sh"


def _tree(root: Path) -> Path:
    (root / "csrc").mkdir(parents=True)
    (root / "csrc" / "kernel.cu").write_text("__global__ void k() {}\n")
    (root / "deep_ep").mkdir()
    (root / "deep_ep" / "__init__.py").write_text("VERSION = 1\n")
    (root / "tests").mkdir()
    (root / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    (root / "CMakeLists.txt").write_text("project(x)\n")
    return root


def _hash(root: Path) -> str:
    result = subprocess.run(["bash", str(SCRIPT), str(root)], capture_output=True, text=True, check=True)
    digest = result.stdout.strip()
    assert len(digest) == 16 and int(digest, 16) >= 0, digest
    return digest


def test_the_same_files_give_the_same_fingerprint(tmp_path):
    assert _hash(_tree(tmp_path / "one")) == _hash(_tree(tmp_path / "two"))


def test_a_changed_file_changes_it(tmp_path):
    root = _tree(tmp_path / "tree")
    before = _hash(root)
    (root / "csrc" / "kernel.cu").write_text("__global__ void k() { return; }\n")
    assert _hash(root) != before


def test_a_renamed_or_added_file_changes_it(tmp_path):
    root = _tree(tmp_path / "tree")
    before = _hash(root)
    shutil.move(root / "tests" / "test_a.py", root / "tests" / "test_b.py")
    renamed = _hash(root)
    assert renamed != before
    (root / "deep_ep" / "new.py").write_text("")
    assert _hash(root) not in (before, renamed)


def test_build_outputs_and_caches_do_not_count(tmp_path):
    root = _tree(tmp_path / "tree")
    before = _hash(root)
    (root / "deep_ep" / "_C.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (root / "deep_ep" / "__pycache__").mkdir()
    (root / "deep_ep" / "__pycache__" / "__init__.cpython-312.pyc").write_bytes(b"\x00")
    (root / "build").mkdir()
    (root / "build" / "object.o").write_bytes(b"\x00")
    assert _hash(root) == before
