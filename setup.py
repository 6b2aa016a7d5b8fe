"""Build deep_ep: setuptools hands the extension deep_ep._C to CMake (CMakeLists.txt).

`pip install .`, `pip install -e .` and `pip install --no-build-isolation --no-deps .` all come
here. The CMake tree lives in build/cmake-<interpreter tag>/ (kept between builds, so a rebuild
only recompiles what changed); scripts/test.sh runs ctest in the same directory.

Environment: MAX_JOBS or CMAKE_BUILD_PARALLEL_LEVEL (parallel compile jobs, default: all cores),
CMAKE_ARGS (extra arguments for the CMake configure step, e.g. "-DEP_CUDA_ARCHS=90;100"),
EP_NCCL_ROOT_DIR (read by cmake/FindNcclByVersion.cmake).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def cmake_build_dir() -> Path:
    # One tree per interpreter (cpython-311, cpython-312...): a checkout built by two Pythons
    # keeps two caches instead of reconfiguring back and forth.
    return ROOT / "build" / f"cmake-{sys.implementation.cache_tag}"


def find_tool(name: str) -> str | None:
    """The pip-installed cmake/ninja of this interpreter first (PATH may not include the venv's
    bin/ when pip is called as .venv/bin/pip), then PATH."""
    try:
        if name == "cmake":
            import cmake

            candidate = Path(cmake.CMAKE_BIN_DIR) / "cmake"
        else:
            import ninja

            candidate = Path(ninja.BIN_DIR) / "ninja"
        if candidate.is_file():
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    return shutil.which(name)


def parallel_jobs() -> int:
    for variable in ("MAX_JOBS", "CMAKE_BUILD_PARALLEL_LEVEL"):
        value = os.environ.get(variable, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{variable} must be a positive integer, got {value!r}")
            return int(value)
    return os.cpu_count() or 1


def cached_generator(build_dir: Path) -> str | None:
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return None
    for line in cache.read_text(errors="replace").splitlines():
        if line.startswith("CMAKE_GENERATOR:"):
            return line.split("=", 1)[1]
    return None


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        cmake = find_tool("cmake")
        if cmake is None:
            raise RuntimeError("deep_ep needs CMake >= 3.26 to build: pip install cmake")
        ninja = find_tool("ninja")
        generator = "Ninja" if ninja else "Unix Makefiles"

        # setuptools copies the file from here into the source tree for editable installs.
        extension_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = cmake_build_dir()
        previous_generator = cached_generator(build_dir)
        if previous_generator is not None and previous_generator != generator:
            shutil.rmtree(build_dir)
        build_dir.mkdir(parents=True, exist_ok=True)

        configure = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-G",
            generator,
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DEP_EXTENSION_OUTPUT_DIR={extension_path.parent}",
        ]
        if ninja:
            configure.append(f"-DCMAKE_MAKE_PROGRAM={ninja}")
        extra_args = shlex.split(os.environ.get("CMAKE_ARGS", ""))
        if not any(arg.startswith("-DCMAKE_BUILD_TYPE=") for arg in extra_args):
            configure.append("-DCMAKE_BUILD_TYPE=Release")
        configure += extra_args
        build = [cmake, "--build", str(build_dir), "--parallel", str(parallel_jobs())]

        for command in (configure, build):
            print("deep_ep:", shlex.join(command), flush=True)
            subprocess.run(command, cwd=ROOT, check=True)

        if not extension_path.is_file():
            found = sorted(path.name for path in extension_path.parent.glob("_C*"))
            raise RuntimeError(f"CMake finished but {extension_path} is missing (found: {found or 'nothing'})")


setup(
    ext_modules=[CMakeExtension("deep_ep._C")],
    cmdclass={"build_ext": CMakeBuild},
)
