# shellcheck shell=bash
# Sourced by gpu_check.sh: the time limit of a step that starts now under EP_GPU_CHECK_BUDGET.
#   step_limit LIMIT   (reads BUDGET, seconds, 0 = none, and start, the run's start in epoch seconds)
# prints LIMIT cut to what the budget leaves, or 0 when less than MIN_STEP_SECS are left (the
# caller skips the step). A step that started just inside the budget with its own, longer limit
# used to run past it, and the device call with it past the tool's 600 s: the call was killed and
# its summary lost.
MIN_STEP_SECS=${MIN_STEP_SECS:-30}
step_limit() {
  local limit=$1 left started
  if [[ ${BUDGET:-0} -le 0 ]]; then
    echo "$limit"
    return
  fi
  started=${start:?step_limit needs start, the start of the run in epoch seconds}
  left=$(( BUDGET - ($(date +%s) - started) ))
  if [[ $left -lt $MIN_STEP_SECS ]]; then
    echo 0
  elif [[ $left -lt $limit ]]; then
    echo "$left"
  else
    echo "$limit"
  fi
}
