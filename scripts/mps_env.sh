# Sourced (not run) by every script that starts the MPS daemon or ranks: the daemon (scripts/mps.sh)
# and its clients (the ranks) meet in this pipe directory and must agree on it. A rank without it
# looks in the CUDA default directory, runs without MPS, and every cross-rank wait costs
# milliseconds.
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mps_pipe}
export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mps_log}
