#!/usr/bin/env bash
# Before/after measurements on one machine (machine-to-machine spread of the H200s we are lent is
# about 10 %, larger than many changes we measure). Two steps:
#
#   bash scripts/ab_compare.sh snapshot REF
#       here, in a git checkout: copies the source files that differ between REF and the working
#       tree, as they are at REF, into ab_before/ (untracked, so it travels with the tree to the GPU
#       machine), with the list of files the working tree adds (absent at REF).
#   bash scripts/ab_compare.sh run COMMAND...
#       on the GPU machine (no git needed): builds the REF side (the working tree with ab_before/
#       swapped in and the added files moved aside), runs COMMAND with $AB_SIDE=before, restores the
#       working tree, builds it, runs COMMAND with $AB_SIDE=after. COMMAND typically writes under
#       "$OUT/{side}" ({side} in an argument becomes before / after; use it, not $AB_SIDE, inside
#       EP_GPU_CHECK_COMMANDS, whose bash -c would expand $AB_SIDE too early). MPS is started
#       around each side (scripts/mps.sh; a server already running at the start is stopped first
#       and started again at the end). Exit status: 1 if a build fails, else COMMAND's status
#       on the after side.
#   bash scripts/ab_compare.sh clean
#       removes ab_before/ (never commit it).
#
# Only csrc/, deep_ep/, tests/cpp/, CMakeLists.txt and pyproject.toml are snapshotted: benchmarks and
# tests run from the working tree on both sides, so both sides measure with the same script.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
SNAPSHOT=ab_before
SOURCES=(csrc deep_ep tests/cpp CMakeLists.txt pyproject.toml)
# The ranks find the MPS daemon started around each side through it. Without it (this script run
# on its own, not from gpu_check.sh) the ranks ran without MPS: the waits cost milliseconds.
source scripts/mps_env.sh

build() {
  MAX_JOBS=$(nproc) ${PYTHON:-python3} -m pip install --no-build-isolation --no-deps -e . > "$1" 2>&1 || {
    tail -40 "$1"
    echo "ab_compare: build failed ($1)"
    return 1
  }
}

# COMMAND with every "{side}" in its arguments replaced by the side, and $AB_SIDE set. The
# placeholder survives where $AB_SIDE would not: gpu_check.sh runs its EP_GPU_CHECK_COMMANDS through
# `bash -c`, which expands "$AB_SIDE" (still unset) before this script starts.
run_side() {
  local side=$1 argument
  shift
  local command=()
  for argument in "$@"; do command+=("${argument//\{side\}/$side}"); done
  AB_SIDE=$side "${command[@]}"
}

case "${1:-}" in
  snapshot)
    ref=${2:?usage: ab_compare.sh snapshot REF}
    git rev-parse --verify --quiet "$ref^{commit}" > /dev/null || { echo "ab_compare: unknown ref $ref" >&2; exit 2; }
    rm -rf "$SNAPSHOT"
    mkdir -p "$SNAPSHOT/files"
    : > "$SNAPSHOT/added"
    git diff --name-only "$ref" -- "${SOURCES[@]}" > "$SNAPSHOT/changed"
    git ls-files --others --exclude-standard -- "${SOURCES[@]}" >> "$SNAPSHOT/changed"
    while read -r path; do
      [[ -n $path ]] || continue
      if git cat-file -e "$ref:$path" 2> /dev/null; then
        mkdir -p "$SNAPSHOT/files/$(dirname "$path")"
        git show "$ref:$path" > "$SNAPSHOT/files/$path"
      else
        echo "$path" >> "$SNAPSHOT/added"
      fi
    done < "$SNAPSHOT/changed"
    git rev-parse "$ref" > "$SNAPSHOT/ref"
    echo "ab_compare: $(wc -l < "$SNAPSHOT/changed") files differ from $ref ($(wc -l < "$SNAPSHOT/added") added since)"
    ;;
  run)
    shift
    [[ $# -gt 0 ]] || { echo "usage: ab_compare.sh run COMMAND..." >&2; exit 2; }
    [[ -f $SNAPSHOT/ref ]] || { echo "ab_compare: no $SNAPSHOT/ (run 'snapshot REF' first)" >&2; exit 2; }
    OUT=${OUT:-$PWD/out}
    mkdir -p "$OUT"
    aside=$(mktemp -d)
    # The REF side: every changed file as it was at REF, every added file moved aside.
    while read -r path; do
      [[ -n $path && -e $path ]] || continue
      mkdir -p "$aside/$(dirname "$path")"
      mv "$path" "$aside/$path"
    done < "$SNAPSHOT/changed"
    (cd "$SNAPSHOT/files" && find . -type f -print0) | while IFS= read -r -d '' path; do
      mkdir -p "$(dirname "$path")"
      cp "$SNAPSHOT/files/$path" "$path"
    done
    # gpu_check.sh runs its commands under one MPS server: leave it as we found it (build failures
    # included), or the commands after this one run without MPS and every cross-rank wait costs
    # milliseconds.
    if [[ $(bash scripts/mps.sh status) == running ]]; then
      bash scripts/mps.sh stop
      trap 'bash scripts/mps.sh start' EXIT
    fi
    status=0
    if build "$OUT/build_before.log"; then
      bash scripts/mps.sh start
      run_side before "$@"
      before_rc=$?  # before the echo: a command substitution in it would reset $?
      echo "ab_compare: before ($(cat "$SNAPSHOT/ref")): rc=$before_rc"
      bash scripts/mps.sh stop
    else
      status=1
    fi
    # Back to the working tree.
    (cd "$SNAPSHOT/files" && find . -type f -print0) | while IFS= read -r -d '' path; do rm -f "$path"; done
    (cd "$aside" && find . -type f -print0) | while IFS= read -r -d '' path; do
      mkdir -p "$(dirname "$path")"
      mv "$aside/$path" "$path"
      # Newer than what the REF side built from its copy, or the build would keep the REF objects.
      touch "$path"
    done
    rm -rf "$aside"
    [[ $status == 0 ]] || exit 1
    build "$OUT/build_after.log" || exit 1
    bash scripts/mps.sh start
    run_side after "$@"
    status=$?
    echo "ab_compare: after (working tree): rc=$status"
    bash scripts/mps.sh stop
    exit $status
    ;;
  clean)
    rm -rf "$SNAPSHOT"
    ;;
  *)
    echo "usage: ab_compare.sh snapshot REF | run COMMAND... | clean" >&2
    exit 2
    ;;
esac
