#!/bin/bash
# Copied from the shared tools (../shared does not travel to the GPU machine).
# Start or stop NVIDIA MPS on the GPU machine so that several processes (EP ranks) sharing one GPU
# run their kernels concurrently; without it the GPU time-slices between processes and every
# cross-rank wait costs milliseconds. It changes no GPU setting: it runs a user-space
# server that ends with `stop` (always run `stop` before the run ends).
#   usage: mps.sh start | stop | status
set -u
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mps_pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mps_log}
ctl=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
case "${1:-}" in
  start)
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if [[ ! -x $ctl ]]; then echo "mps.sh: nvidia-cuda-mps-control not found; ranks sharing a GPU will be slow" >&2; exit 1; fi
    "$ctl" -d && sleep 1 && echo "mps.sh: MPS started (pipe $CUDA_MPS_PIPE_DIRECTORY)";;
  stop)
    echo quit | "$ctl" 2>/dev/null; sleep 1; echo "mps.sh: MPS stopped";;
  status)
    if [[ -S $CUDA_MPS_PIPE_DIRECTORY/control ]] || pgrep -x nvidia-cuda-mps >/dev/null 2>&1; then echo running; else echo stopped; fi;;
  *) echo "usage: mps.sh start|stop|status" >&2; exit 2;;
esac
