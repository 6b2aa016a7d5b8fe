#!/usr/bin/env bash
# The code tree's fingerprint (16 hex digits): every file that makes up the build, the package, the
# tests and the scripts, with its path, build outputs and caches left out. gpu_check.sh prints it
# first, so that results from several device calls can be shown to come from one tree (the copy
# on the device machine has no .git); run it here to match a call to a commit.
#   bash scripts/tree_hash.sh [ROOT]   (default: this repository)
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$root"
paths=()
for path in CMakeLists.txt pyproject.toml setup.py cmake csrc deep_ep tests scripts benchmarks examples; do
  [[ -e $path ]] && paths+=("$path")
done
find "${paths[@]}" -type f -not -path '*/__pycache__/*' -not -name '*.so' -not -name '*.pyc' -not -name '*.tmp' -print0 |
  LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
