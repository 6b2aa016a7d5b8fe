#!/usr/bin/env bash
# Prepare a working tree: .venv (created with python3 if missing), the development requirements,
# and an editable build of deep_ep (CMake tree in build/cmake-<interpreter>/, extension copied to
# deep_ep/_C*.so). Safe to run again: pip skips what is installed, CMake rebuilds what changed.
#
# MAX_JOBS (or CMAKE_BUILD_PARALLEL_LEVEL) caps parallel compile jobs; CMAKE_ARGS adds configure
# arguments (e.g. CMAKE_ARGS="-DEP_CUDA_ARCHS=90;100").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Several checkouts (agents, CI) may build on one machine at once; serialise venv changes and
# builds so two nvcc waves do not fight over 2 cores and 24 GiB.
lock=/tmp/deep_ep_build.lock
exec 9>>"$lock"
if ! flock --nonblock 9; then
  echo "bootstrap: another deep_ep build holds $lock; waiting" >&2
  flock 9
fi

if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $(command -v python3)" >&2
  python3 -m venv .venv
fi
python=.venv/bin/python

"$python" -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt

# -v: show CMake's output (which NCCL it chose, the compile steps), not only on failure.
start=$(date +%s)
"$python" -m pip install --disable-pip-version-check --no-build-isolation --no-deps -v -e .
echo "bootstrap: deep_ep built in $(( $(date +%s) - start )) s" >&2
