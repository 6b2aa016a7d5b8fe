#!/usr/bin/env bash
# Run DeepEP's own test scripts, unmodified, against the installed deep_ep package (this one), on
# one host whose ranks may share a GPU (start MPS first: scripts/mps.sh start).
#   usage: scripts/run_deepep_tests.sh DEEPEP_TESTS_DIR [LOG_DIR]
# DEEPEP_TESTS_DIR is the tests/ folder of a DeepEP checkout (holding legacy/ and elastic/). Logs go
# to LOG_DIR (default $OUT/deepep_tests, else ./out/deepep_tests), one per script; a summary line
# per script (exit code, seconds, log) is printed last and written to LOG_DIR/summary.txt. Exits
# non-zero when any script failed.
#
# Each script spawns its own ranks (torch.multiprocessing) and sets up its process group with
# deep_ep.utils.envs.init_dist, which reads MASTER_ADDR / MASTER_PORT / WORLD_SIZE (nodes) / RANK
# (node index): one node on 127.0.0.1 with a free port per script. test_internode.py needs 8 ranks
# per node and more than one node: it runs as two nodes on this host (two launches, RANK 0 and 1,
# 16 ranks), the buffers splitting the ranks into virtual nodes of 8 (EP_EMULATE_RANKS_PER_NODE).
# Its tuning loops time kernels with bench_kineto by the words "dispatch", "combine" and "notify",
# each of which must name at most one kernel of a profile.
#
# Knobs: PYTHON (default python3), EP_DEEPEP_RANKS (ranks per script, default 8; test_internode
#        always 2 x 8), EP_DEEPEP_TIMEOUT (seconds per script, default 900),
#        EP_DEEPEP_SCRIPTS (space-separated subset of: intranode low_latency ep ep_hybrid ep_perf
#        barrier internode; default all, in that order).
# Sizes are small (fewer tokens, hidden 2048) where a script takes them; test_ep runs every mode
# without the benchmark (ep, and ep_hybrid with two virtual nodes), then its first mode with the
# benchmark (ep_perf).
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
tests_dir=${1:?usage: run_deepep_tests.sh DEEPEP_TESTS_DIR [LOG_DIR]}
tests_dir=$(cd "$tests_dir" && pwd) || exit 2
log_dir=${2:-${OUT:-$repo/out}/deepep_tests}
mkdir -p "$log_dir"
log_dir=$(cd "$log_dir" && pwd)
for script in legacy/test_intranode.py legacy/test_low_latency.py elastic/test_ep.py; do
  [[ -f $tests_dir/$script ]] || { echo "run_deepep_tests: $tests_dir/$script not found" >&2; exit 2; }
done

PY=${PYTHON:-python3}
RANKS=${EP_DEEPEP_RANKS:-8}
TIMEOUT=${EP_DEEPEP_TIMEOUT:-900}
SCRIPTS=${EP_DEEPEP_SCRIPTS:-intranode low_latency ep ep_hybrid ep_perf barrier internode}
EXPERTS=$(( 8 * RANKS ))

source "$repo/scripts/mps_env.sh"  # the ranks find the MPS daemon through it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Ranks sharing a GPU load every kernel module up front (deep_ep/testing/rank_process.py says why).
export CUDA_MODULE_LOADING=EAGER
export MASTER_ADDR=127.0.0.1
unset EP_EMULATE_RANKS_PER_NODE

# The package the scripts will import, from outside both checkouts (a folder named deep_ep in the
# working directory would shadow it).
cd "$log_dir" || exit 2
if ! "$PY" -c "import deep_ep, deep_ep.utils.envs, deep_ep.utils.testing, deep_ep.utils.refs, deep_ep.utils.gate; print('deep_ep from', deep_ep.__file__)" > "$log_dir/import.log" 2>&1; then
  cat "$log_dir/import.log"
  echo "run_deepep_tests: deep_ep does not import with $PY" >&2
  exit 2
fi
cat "$log_dir/import.log"

free_port() {
  "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

summary=()
failed=0

# One script on one node: name, script path (relative to tests_dir), arguments...
run_one() {
  local name=$1 script=$2
  shift 2
  local log="$log_dir/$name.log" start rc
  start=$(date +%s)
  echo "== $name: $script $*" | tee "$log"
  MASTER_PORT=$(free_port) WORLD_SIZE=1 RANK=0 \
    timeout --kill-after=30 "$TIMEOUT" "$PY" "$tests_dir/$script" "$@" >> "$log" 2>&1
  rc=$?
  record "$name" "$rc" "$start" "$log"
}

# test_internode.py as two nodes of 8 ranks on this host: both launches share the rendezvous of
# node 0; the exit code is the first non-zero one.
run_internode() {
  local name=internode script=legacy/test_internode.py start rc=0 port node pids=() node_rc
  start=$(date +%s)
  port=$(free_port)
  echo "== $name: $script as 2 nodes x 8 ranks (WORLD_SIZE=2, EP_EMULATE_RANKS_PER_NODE=8)" | tee "$log_dir/$name.log"
  for node in 0 1; do
    MASTER_PORT=$port WORLD_SIZE=2 RANK=$node EP_EMULATE_RANKS_PER_NODE=8 \
      timeout --kill-after=30 "$TIMEOUT" "$PY" "$tests_dir/$script" --num-processes 8 \
      --num-tokens 1024 --hidden 2048 --num-topk 8 --num-experts 128 > "$log_dir/${name}_node$node.log" 2>&1 &
    pids+=($!)
  done
  for node in 0 1; do
    wait "${pids[$node]}"
    node_rc=$?
    if [[ $rc -eq 0 ]]; then rc=$node_rc; fi
  done
  for node in 0 1; do
    { echo "---- node $node ----"; cat "$log_dir/${name}_node$node.log"; } >> "$log_dir/$name.log"
  done
  record "$name" "$rc" "$start" "$log_dir/$name.log"
}

record() {
  local name=$1 rc=$2 start=$3 log=$4 note=""
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then note=" (timed out after ${TIMEOUT} s)"; fi
  if [[ $rc -ne 0 ]]; then
    failed=1
    echo "---- last lines of $log ----"
    tail -25 "$log"
  fi
  summary+=("$name: rc=$rc$note, $(( $(date +%s) - start )) s, log $log")
}

for name in $SCRIPTS; do
  case $name in
    intranode)
      run_one intranode legacy/test_intranode.py --num-processes "$RANKS" \
        --num-tokens 1024 --hidden 2048 --num-topk 8 --num-experts "$EXPERTS";;
    low_latency)
      run_one low_latency legacy/test_low_latency.py --num-processes "$RANKS" \
        --num-tokens 64 --hidden 2048 --num-topk 8 --num-experts "$EXPERTS";;
    ep)
      run_one ep elastic/test_ep.py --num-processes "$RANKS" \
        --num-tokens 512 --hidden 2048 --num-topk 6 --num-experts "$EXPERTS" --skip-perf-test;;
    ep_hybrid)
      if (( RANKS % 2 == 0 && RANKS >= 2 )); then
        EP_EMULATE_RANKS_PER_NODE=$(( RANKS / 2 )) run_one ep_hybrid elastic/test_ep.py --num-processes "$RANKS" \
          --num-tokens 512 --hidden 2048 --num-topk 6 --num-experts "$EXPERTS" --skip-perf-test
      fi;;
    ep_perf)
      run_one ep_perf elastic/test_ep.py --num-processes "$RANKS" \
        --num-tokens 512 --hidden 2048 --num-topk 6 --num-experts "$EXPERTS" --test-first-only;;
    barrier)
      if [[ -f $tests_dir/elastic/test_barrier.py ]]; then
        run_one barrier elastic/test_barrier.py --num-processes "$RANKS"
      fi;;
    internode)
      run_internode;;
    *)
      echo "run_deepep_tests: unknown script name $name" >&2
      failed=1;;
  esac
done

printf '%s\n' "${summary[@]}" > "$log_dir/summary.txt"
echo "== summary (DeepEP tests from $tests_dir)"
cat "$log_dir/summary.txt"
exit $failed
