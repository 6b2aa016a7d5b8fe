#!/usr/bin/env bash
# Nsight Compute profile of one kernel of a command, on the GPU machine, to see where a kernel's
# warps wait instead of guessing from phase stamps (the H200 machines read the hardware counters;
# `--clock-control none` leaves the GPU's clocks alone). Without MPS: run the command with one rank.
#
#   bash scripts/ncu_kernel.sh NAME KERNEL_REGEX COMMAND...
#   e.g. bash scripts/ncu_kernel.sh notify notify_kernel \
#          python3 benchmarks/bench_ht.py --num-ranks 1 --tokens 4096 --iters 3 --warmup 1
#
# Builds first (as gpu_check.sh does), profiles launches NCU_SKIP.. (default 4) of kernels whose
# name matches KERNEL_REGEX, NCU_COUNT of them (default 2), with the full section set and source
# counters, and writes to $OUT: NAME.ncu-rep, NAME_details.txt (every section of every profiled
# launch) and NAME_source.csv (per SASS instruction: executions and warp stall samples; the CUDA
# source page of the CLI export carried no metrics), and prints the hottest instructions and the
# code regions by samples (scripts/ncu_hotspots.py). Warp stalls are sampled every
# 2^(5 + NCU_SAMPLING) cycles (default 0: every 32 cycles; ncu's automatic interval left a 26 us
# kernel with ~300 samples, interval 0 ~9,800).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
[[ $# -ge 3 ]] || { echo "usage: ncu_kernel.sh NAME KERNEL_REGEX COMMAND..." >&2; exit 2; }
name=$1 kernel=$2
shift 2
export OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
[[ -n $NCU ]] || { echo "ncu_kernel: no ncu on this machine" >&2; exit 1; }
if ! MAX_JOBS=$(nproc) $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"
  echo "ncu_kernel: build failed ($OUT/build.log)" >&2
  exit 1
fi
"$NCU" --clock-control none --target-processes all -k "regex:$kernel" \
  --launch-skip "${NCU_SKIP:-4}" --launch-count "${NCU_COUNT:-2}" --set full --import-source yes \
  --warp-sampling-interval "${NCU_SAMPLING:-0}" \
  -f -o "$OUT/$name" "$@" > "$OUT/${name}_run.log" 2>&1
status=$?
tail -20 "$OUT/${name}_run.log"
[[ -f $OUT/$name.ncu-rep ]] || { echo "ncu_kernel: no report (rc=$status)" >&2; exit 1; }
"$NCU" -i "$OUT/$name.ncu-rep" --page details > "$OUT/${name}_details.txt" 2>&1
"$NCU" -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_source.csv" 2>&1
$PY scripts/ncu_hotspots.py "$OUT/${name}_source.csv" --top 25 || true
$PY scripts/ncu_hotspots.py "$OUT/${name}_source.csv" --regions || true
echo "ncu_kernel: $OUT/${name}_details.txt, $OUT/${name}_source.csv (rc=$status)"
exit "$status"
