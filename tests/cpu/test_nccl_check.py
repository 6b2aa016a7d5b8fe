"""deep_ep/_nccl_check.py: version comparison and the duplicate-libnccl scan, on fabricated
/proc/self/maps text and temporary files (no GPU, no NCCL needed)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

# Loaded by path: the module has no dependencies, so its tests need neither torch nor the built
# extension that importing the deep_ep package pulls in.
_MODULE_PATH = Path(__file__).resolve().parents[2] / "deep_ep" / "_nccl_check.py"
_spec = importlib.util.spec_from_file_location("deep_ep_nccl_check_under_test", _MODULE_PATH)
nccl_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nccl_check)

LINKED = "/opt/venv/site-packages/nvidia/nccl/lib/libnccl.so.2"


def maps_line(path: str, address: int = 0x7F0000000000) -> str:
    return f"{address:x}-{address + 0x1000:x} r-xp 00000000 fd:01 1234567    {path}"


def make_library(directory: Path, name: str, content: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_bytes(content)
    return path


@pytest.fixture(autouse=True)
def no_suppression(monkeypatch):
    monkeypatch.delenv(nccl_check.SUPPRESS_VARIABLE, raising=False)


def check_without_warnings(*args, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nccl_check.check_nccl(*args, **kwargs)


@pytest.mark.parametrize(
    ("code", "text"),
    [(22809, "2.28.9"), (22803, "2.28.3"), (21903, "2.19.3"), (20900, "2.9.0"), (23001, "2.30.1"), (2804, "2.8.4")],
)
def test_format_nccl_version_decodes_both_encodings(code, text):
    assert nccl_check.format_nccl_version(code) == text


def test_version_mismatch_raises_import_error_naming_both_versions():
    with pytest.raises(ImportError) as error:
        nccl_check.check_nccl(22809, 22803, LINKED, maps_text="")
    message = str(error.value)
    assert "2.28.9" in message and "2.28.3" in message
    assert "nvidia-nccl-cu13==2.28.9" in message
    assert "rebuild" in message
    assert LINKED in message


def test_matching_versions_and_one_library_pass_silently(tmp_path):
    library = make_library(tmp_path / "pip", "libnccl.so.2", b"nccl 2.28.9")
    maps = "\n".join(
        [maps_line(str(library)), maps_line(str(library), 0x7F0000100000), maps_line("/usr/lib/libc.so.6")]
    )
    check_without_warnings(22809, 22809, str(library), maps_text=maps)


def test_two_different_libraries_warn_naming_both(tmp_path):
    pip_copy = make_library(tmp_path / "pip", "libnccl.so.2", b"nccl 2.28.9")
    system_copy = make_library(tmp_path / "usr lib", "libnccl.so.2.28.3", b"nccl 2.28.3")
    maps = "\n".join([maps_line(str(pip_copy)), maps_line(str(system_copy), 0x7F0000200000)])
    with pytest.warns(RuntimeWarning) as record:
        nccl_check.check_nccl(22809, 22809, str(pip_copy), maps_text=maps)
    message = str(record[0].message)
    assert str(pip_copy) in message
    assert str(system_copy) in message  # a path with a space survives the maps parsing


def test_symlink_to_the_same_file_counts_once(tmp_path):
    real = make_library(tmp_path / "lib", "libnccl.so.2.28.9", b"nccl 2.28.9")
    link = tmp_path / "lib" / "libnccl.so.2"
    link.symlink_to(real.name)
    maps = "\n".join([maps_line(str(real)), maps_line(str(link), 0x7F0000300000)])
    check_without_warnings(22809, 22809, str(link), maps_text=maps)


def test_identical_copies_in_two_places_count_once(tmp_path):
    first = make_library(tmp_path / "a", "libnccl.so.2", b"same bytes")
    second = make_library(tmp_path / "b", "libnccl.so.2", b"same bytes")
    maps = "\n".join([maps_line(str(first)), maps_line(str(second), 0x7F0000400000)])
    check_without_warnings(22809, 22809, str(first), maps_text=maps)


def test_deleted_copy_counts_as_different(tmp_path):
    present = make_library(tmp_path / "a", "libnccl.so.2", b"nccl")
    gone = tmp_path / "b" / "libnccl.so.2"
    maps = "\n".join([maps_line(str(present)), maps_line(f"{gone} (deleted)", 0x7F0000500000)])
    with pytest.warns(RuntimeWarning, match="2 different NCCL libraries"):
        nccl_check.check_nccl(22809, 22809, str(present), maps_text=maps)


def test_other_nccl_named_files_and_anonymous_maps_are_ignored(tmp_path):
    library = make_library(tmp_path / "pip", "libnccl.so.2", b"nccl")
    plugin = make_library(tmp_path / "plugins", "libnccl-net.so", b"plugin")
    maps = "\n".join(
        [
            maps_line(str(library)),
            maps_line(str(plugin), 0x7F0000600000),
            "7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]",
            "7f0000700000-7f0000800000 rw-p 00000000 00:00 0",
        ]
    )
    check_without_warnings(22809, 22809, str(library), maps_text=maps)


def test_suppression_skips_version_and_duplicate_checks(tmp_path, monkeypatch):
    first = make_library(tmp_path / "a", "libnccl.so.2", b"one")
    second = make_library(tmp_path / "b", "libnccl.so.2", b"two")
    maps = "\n".join([maps_line(str(first)), maps_line(str(second), 0x7F0000900000)])
    monkeypatch.setenv(nccl_check.SUPPRESS_VARIABLE, "1")
    check_without_warnings(22809, 22803, str(first), maps_text=maps)


def test_suppression_needs_the_value_one(monkeypatch):
    monkeypatch.setenv(nccl_check.SUPPRESS_VARIABLE, "0")
    with pytest.raises(ImportError):
        nccl_check.check_nccl(22809, 22803, LINKED, maps_text="")


def test_reads_the_process_maps_when_no_text_is_given(tmp_path, monkeypatch):
    first = make_library(tmp_path / "a", "libnccl.so.2", b"one")
    second = make_library(tmp_path / "b", "libnccl.so.2", b"two")
    maps_file = tmp_path / "maps"
    maps_file.write_text("\n".join([maps_line(str(first)), maps_line(str(second), 0x7F0000A00000)]) + "\n")
    monkeypatch.setattr(nccl_check, "_MAPS_PATH", str(maps_file))
    with pytest.warns(RuntimeWarning, match="2 different NCCL libraries"):
        nccl_check.check_nccl(22809, 22809, str(first))
