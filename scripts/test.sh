#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run): bootstrap, the style gate (ruff check, ruff format
# --check, clang-format on the C++/CUDA sources), C++ unit tests (ctest), then pytest (tests/cpu,
# and tests/gpu, which skips itself without a GPU). Exits non-zero on any failure, including a
# finding of the style gate and a suite that collected no test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash scripts/bootstrap.sh

python=.venv/bin/python
build_dir="build/cmake-$("$python" -c 'import sys; print(sys.implementation.cache_tag)')"
failed=()

# Style gate: every finding fails the run.
python_sources=(deep_ep tests benchmarks examples scripts)
if ! .venv/bin/ruff check "${python_sources[@]}"; then
  failed+=("ruff check")
fi
if ! .venv/bin/ruff format --check "${python_sources[@]}"; then
  failed+=("ruff format")
fi
mapfile -t cpp_sources < <(find csrc tests/cpp -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' \) | sort)
if [ ${#cpp_sources[@]} -eq 0 ] || ! .venv/bin/clang-format --dry-run -Werror "${cpp_sources[@]}"; then
  failed+=(clang-format)
fi

shopt -s nullglob
cpp_tests=(tests/cpp/*.cpp)
shopt -u nullglob
# GoogleTest counts as installed when CMake found it or its header is on the system: a build that
# skipped the tests while GoogleTest is there is a failure, not a skip.
gtest_dir=$(sed -n 's/^GTest_DIR:PATH=//p' "$build_dir/CMakeCache.txt" 2>/dev/null || true)
gtest_found=false
if [[ -n "$gtest_dir" && "$gtest_dir" != *NOTFOUND ]] || [ -f /usr/include/gtest/gtest.h ]; then
  gtest_found=true
fi

if [ ${#cpp_tests[@]} -eq 0 ]; then
  echo "test: no tests/cpp/*.cpp, C++ unit tests skipped" >&2
elif [ "$gtest_found" != true ]; then
  echo "test: GoogleTest not installed, C++ unit tests skipped" >&2
elif [ ! -x "$build_dir/ep_cpp_tests" ]; then
  echo "test: GoogleTest is installed but $build_dir/ep_cpp_tests was not built" >&2
  failed+=("ctest (ep_cpp_tests missing)")
else
  # The ctest of the CMake that configured the tree: test files are version specific.
  ctest=$(sed -n 's/^CMAKE_CTEST_COMMAND:INTERNAL=//p' "$build_dir/CMakeCache.txt")
  if ! "${ctest:-ctest}" --test-dir "$build_dir" --output-on-failure --no-tests=error \
       --parallel "$(nproc)"; then
    failed+=(ctest)
  fi
fi

# pytest exits 5 when it collected nothing: non-zero, so it counts as a failure here too.
if ! "$python" -m pytest tests/cpu tests/gpu -q -rs; then
  failed+=(pytest)
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo "test: FAILED: ${failed[*]}" >&2
  exit 1
fi
