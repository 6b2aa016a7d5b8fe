"""Import-time NCCL guard.

NCCL's device-API structs (ncclDevComm, window handles) change between versions, so the nccl.h the
extension was compiled with must be the version of the libnccl.so.2 the process loaded, or kernels
read NCCL's state at the wrong offsets. And two different libnccl files in one process (torch's pip
copy next to a system copy loaded by path) have separate global state: a communicator made by one
is garbage to the other. Whoever loads libnccl.so.2 first decides for every later dependency,
which is why deep_ep imports torch before its extension and then calls check_nccl().

This module imports nothing from deep_ep, so it can be tested without the extension.
"""

from __future__ import annotations

import filecmp
import os
import warnings

SUPPRESS_VARIABLE = "EP_SUPPRESS_NCCL_CHECK"
_MAPS_PATH = "/proc/self/maps"


def format_nccl_version(code: int) -> str:
    """NCCL_VERSION_CODE / ncclGetVersion() value as "major.minor.patch"."""
    if code >= 10000:  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
        major, rest = divmod(code, 10000)
    else:  # before 2.9: major * 1000 + minor * 100 + patch
        major, rest = divmod(code, 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


def mapped_nccl_files(maps_text: str) -> list[str]:
    """Real paths of the mapped files whose name starts with libnccl.so, in first-seen order."""
    paths: list[str] = []
    for line in maps_text.splitlines():
        # address perms offset dev inode pathname; the pathname may contain spaces.
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if not os.path.basename(path).startswith("libnccl.so"):
            continue
        real = os.path.realpath(path)
        if real not in paths:
            paths.append(real)
    return paths


def _same_content(left: str, right: str) -> bool:
    try:
        return filecmp.cmp(left, right, shallow=False)
    except OSError:  # deleted or unreadable: cannot prove it is the same library
        return False


def distinct_nccl_files(paths: list[str]) -> list[str]:
    """One representative per distinct library: byte-identical copies count once."""
    distinct: list[str] = []
    for path in paths:
        if not any(_same_content(path, kept) for kept in distinct):
            distinct.append(path)
    return distinct


def loaded_nccl_libraries() -> list[str]:
    """The distinct libnccl files this process maps; empty without /proc (not Linux)."""
    try:
        with open(_MAPS_PATH) as maps:
            return distinct_nccl_files(mapped_nccl_files(maps.read()))
    except OSError:
        return []


def check_nccl(compiled_version: int, loaded_version: int, linked_path: str, maps_text: str | None = None) -> None:
    """Raise ImportError if the loaded NCCL is not the compiled-against version; warn if the
    process maps more than one distinct libnccl. Skipped when EP_SUPPRESS_NCCL_CHECK=1."""
    if os.environ.get(SUPPRESS_VARIABLE, "").strip() == "1":
        return

    if compiled_version != loaded_version:
        compiled = format_nccl_version(compiled_version)
        loaded = format_nccl_version(loaded_version)
        raise ImportError(
            f"deep_ep was compiled against NCCL {compiled} but this process loaded NCCL {loaded} "
            f"(deep_ep was linked against {linked_path}). NCCL's device-API structures differ between "
            f"versions, so the kernels would misread them. Fix: install the matching NCCL "
            f"(pip install nvidia-nccl-cu13=={compiled}), or rebuild deep_ep against NCCL {loaded} "
            f"(pip install --no-build-isolation --no-deps -e ., with EP_NCCL_ROOT_DIR pointing at it "
            f"if it is not the pip package). Make sure torch is imported before deep_ep. "
            f"{SUPPRESS_VARIABLE}=1 skips this check."
        )

    distinct = loaded_nccl_libraries() if maps_text is None else distinct_nccl_files(mapped_nccl_files(maps_text))
    if len(distinct) > 1:
        warnings.warn(
            f"{len(distinct)} different NCCL libraries are loaded in this process: {', '.join(distinct)} "
            f"(deep_ep was linked against {linked_path}). Each copy has its own global state; a "
            f"communicator created by one is invalid in the other. Load a single libnccl.so.2: import "
            f"torch before anything that loads NCCL by path, and check LD_PRELOAD / LD_LIBRARY_PATH.",
            RuntimeWarning,
            stacklevel=2,
        )
