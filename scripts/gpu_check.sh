#!/usr/bin/env bash
# The one command for the GPU machine: build with all cores, start MPS, run the GPU tests for each
# rank count, run the benchmarks, stop MPS, and print a short summary last. Logs, JSON and plots go
# to $OUT or ./out.
#
# Knobs: EP_GPU_CHECK_RANKS (default 1,2,4,8; "none" runs no tests), EP_GPU_CHECK_TESTS (default tests/gpu),
#        EP_GPU_CHECK_BENCH (1 = run benchmarks, default 1), EP_GPU_CHECK_BENCH_RANKS (default 8),
#        EP_GPU_CHECK_BENCH_ARGS / EP_GPU_CHECK_LL_ARGS (extra arguments for bench_ht.py /
#        bench_ll.py, e.g. "--tokens 4096,8192 --baseline --num-sms 0,8,16,24,32,64"),
#        EP_GPU_CHECK_TIMEOUT (seconds per pytest run, default 900), PYTHON (default python3),
#        EP_GPU_CHECK_PLAN (instead of every test at every rank count: steps "RANKS:TESTS:SECONDS"
#        separated by spaces, TESTS comma-separated paths or test ids (file.py::test_name), SECONDS
#        optional, run in the order given, e.g.
#        "4:tests/gpu/test_low_latency.py,tests/gpu/test_faults.py:240 8:tests/gpu/test_moe_layer.py:150";
#        put a suite that may hang last), EP_GPU_CHECK_BUDGET (seconds since the start by which the
#        run ends: each step's limit is cut to the time left and a step with less than 30 s left is
#        skipped and reported, so that the summary and the logs still come back),
#        EP_GPU_CHECK_COMMANDS (further commands run last, under MPS, separated by ";;", each under the
#        per-run timeout and the budget, output in $OUT/command_N.log, e.g.
#        "python3 benchmarks/bench_ll.py --num-ranks 8 --num-ranks-per-node 4 --out $OUT/vn").
# EP_BACKEND (nccl / ipc) passes through to every buffer the tests and benchmarks build. The tests
# reuse their rank processes between launches (EP_TEST_POOL=1, docs/testing.md: a 2-rank step of five
# suites took 29 s instead of 74); EP_TEST_POOL=0 starts fresh ones for every launch. Each test's
# result is a line of its own (-v), so a step killed by its limit still shows which tests had passed.
# With two or more GPUs the peer-copy ceilings (benchmarks/peer_copy.py) are measured first.
# When $OUT holds more than 8 files (at any depth), everything but the JSON results is packed into
# $OUT/logs.tar.gz (scripts/pack_out.sh), for runners that return a bounded number of files.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export EP_RESULTS_DIR=$OUT
export EP_TEST_POOL=${EP_TEST_POOL:-1}
source scripts/mps_env.sh  # the ranks find the MPS daemon through it
PY=${PYTHON:-python3}
RANKS=${EP_GPU_CHECK_RANKS:-1,2,4,8}
TESTS=${EP_GPU_CHECK_TESTS:-tests/gpu}
BENCH=${EP_GPU_CHECK_BENCH:-1}
BENCH_RANKS=${EP_GPU_CHECK_BENCH_RANKS:-8}
BENCH_ARGS=${EP_GPU_CHECK_BENCH_ARGS:-}
LL_ARGS=${EP_GPU_CHECK_LL_ARGS:-}
PER_RUN_TIMEOUT=${EP_GPU_CHECK_TIMEOUT:-900}
summary=()

start=$(date +%s)
# Before the build writes anything: the fingerprint that matches this call's results to a commit.
summary+=("tree: $(bash scripts/tree_hash.sh) (scripts/tree_hash.sh)")
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
nvidia-smi topo -m >> "$OUT/nvidia-smi.txt" 2>&1
if ! MAX_JOBS=$(nproc) $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  echo "gpu_check: BUILD FAILED (log: $OUT/build.log)"
  exit 1
fi
build_s=$(( $(date +%s) - start ))
summary+=("build: ${build_s} s")
# The pre-flight check of this machine (versions, kernel architectures, peer access); its findings
# lead the summary.
$PY -m deep_ep.doctor > "$OUT/doctor.txt" 2>&1
summary+=("doctor: rc=$? $(grep -c '^\[error\]' "$OUT/doctor.txt") errors, $(grep -c '^\[warning\]' "$OUT/doctor.txt") warnings (doctor.txt)")

num_gpus=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [[ $num_gpus -ge 2 ]]; then
  nvidia-smi nvlink -s >> "$OUT/nvidia-smi.txt" 2>&1
  $PY benchmarks/peer_copy.py > "$OUT/peer_copy.json" 2>> "$OUT/nvidia-smi.txt"
  summary+=("peer copy: $(tr -d '\n ' < "$OUT/peer_copy.json")")
fi

bash scripts/mps.sh start || summary+=("mps: not started (ranks sharing a GPU will be slow)")
trap 'bash scripts/mps.sh stop >/dev/null 2>&1' EXIT

status=0
skipped=0
BUDGET=${EP_GPU_CHECK_BUDGET:-0}
source scripts/step_limit.sh
# " (cut to N s by the budget)" when step_limit shortened a step's own limit.
cut_note() { if [[ $1 -lt $2 ]]; then echo " (cut to $1 s by the budget)"; fi; }
# The limit of a step that starts now (its own limit cut by the budget) in $limit; 1 when the budget
# leaves too little, after recording the step (named $1) as skipped.
budget_skips() {
  limit=$(step_limit "$2")
  [[ $limit -gt 0 ]] && return 1
  summary+=("$1: skipped, the $BUDGET s budget is spent")
  skipped=$(( skipped + 1 ))
}
# One pytest run: rank count, test paths (space-separated), timeout, log name.
run_tests() {
  local n=$1 tests=$2 own_limit=$3 log=$4 t0 rc line limit
  budget_skips "tests ${n} ranks ($tests)" "$own_limit" && return
  t0=$(date +%s)
  # shellcheck disable=SC2086 # the test paths are meant to split
  EP_TEST_RANKS=$n timeout "$limit" $PY -m pytest $tests -v -rs -s -p no:cacheprovider --durations=0 --durations-min=1 \
    > "$OUT/$log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && status=1
  line=$(grep -E "(passed|failed|error|skipped)" "$OUT/$log" | tail -1)
  summary+=("tests ${n} ranks ($tests): rc=$rc $(( $(date +%s) - t0 )) s$(cut_note "$limit" "$own_limit") :: ${line}")
  if [[ $rc -ne 0 ]]; then
    grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/$log" | head -15
  fi
}
if [[ -n ${EP_GPU_CHECK_PLAN:-} ]]; then
  step=0
  for entry in $EP_GPU_CHECK_PLAN; do
    # RANKS before the first ':', SECONDS after the last one when numeric (test ids may hold '::').
    n=${entry%%:*}
    tests=${entry#*:}
    limit=$PER_RUN_TIMEOUT
    if [[ ${tests##*:} =~ ^[0-9]+$ ]]; then
      limit=${tests##*:}
      tests=${tests%:*}
    fi
    step=$(( step + 1 ))
    run_tests "$n" "${tests//,/ }" "$limit" "pytest_step${step}_${n}ranks.log"
  done
else
  [[ $RANKS == none ]] && RANKS=""
  for n in ${RANKS//,/ }; do
    run_tests "$n" "$TESTS" "$PER_RUN_TIMEOUT" "pytest_${n}ranks.log"
  done
fi

if [[ $BENCH == 1 ]]; then
  for bench in bench_ht bench_ll; do
    [[ -f benchmarks/$bench.py ]] || continue
    budget_skips "$bench" "$PER_RUN_TIMEOUT" && continue
    t0=$(date +%s)
    extra=$BENCH_ARGS
    [[ $bench == bench_ll ]] && extra=$LL_ARGS
    # shellcheck disable=SC2086 # the extra arguments are meant to split
    timeout "$limit" $PY benchmarks/$bench.py --num-ranks "$BENCH_RANKS" --out "$OUT" $extra \
      > "$OUT/${bench}.log" 2>&1
    rc=$?
    [[ $rc -ne 0 ]] && status=1
    summary+=("$bench (${BENCH_RANKS} ranks): rc=$rc $(( $(date +%s) - t0 )) s$(cut_note "$limit" "$PER_RUN_TIMEOUT")")
    tail -25 "$OUT/${bench}.log"
  done
fi

if [[ -n ${EP_GPU_CHECK_COMMANDS:-} ]]; then
  index=0
  commands=${EP_GPU_CHECK_COMMANDS//;;/$'\n'}
  while IFS= read -r command; do
    [[ -n ${command// /} ]] || continue
    index=$(( index + 1 ))
    budget_skips "command $index" "$PER_RUN_TIMEOUT" && continue
    t0=$(date +%s)
    timeout "$limit" bash -c "$command" > "$OUT/command_${index}.log" 2>&1
    rc=$?
    [[ $rc -ne 0 ]] && status=1
    summary+=("command $index ($command): rc=$rc $(( $(date +%s) - t0 )) s$(cut_note "$limit" "$PER_RUN_TIMEOUT") (command_${index}.log)")
    tail -12 "$OUT/command_${index}.log"
  done <<< "$commands"
fi

for file in "$OUT"/barrier_latency_*ranks.json; do
  [[ -f $file ]] || continue
  summary+=("$(basename "$file" .json): $($PY -c "import json,sys; print(round(json.load(open(sys.argv[1]))['us_per_barrier_max_over_ranks'], 2), 'us')" "$file")")
done

packed=$(bash scripts/pack_out.sh "$OUT" 8)
[[ -n $packed ]] && summary+=("$packed")

echo "===================== gpu_check summary ====================="
printf '%s\n' "${summary[@]}"
verdict=$([[ $status == 0 ]] && echo PASS || echo FAIL)
# Exit 3: what ran passed, but the budget left steps out.
[[ $status == 0 && $skipped -gt 0 ]] && verdict="INCOMPLETE ($skipped steps skipped)" && status=3
echo "total: $(( $(date +%s) - start )) s; status: $verdict"
exit $status
