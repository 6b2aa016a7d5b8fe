// The one helper every device spin-wait goes through. A wait that passes its deadline records
// (operation, phase, rank, peer, expected, seen) in the host-mapped error record and returns
// false; the caller then leaves the kernel without trapping. A wait also gives up early when
// another thread has already recorded an error, so one failure does not cost N timeouts.
#pragma once

#include <cstdint>

#include "common/device_view.hpp"
#include "kernels/ptx.cuh"

namespace deep_ep {

// First writer wins; later failures (consequences of the first) are not recorded.
__device__ __forceinline__ void record_error(const DeviceView& view, ErrorStatus status, Operation operation,
                                             Phase phase, int32_t peer, int64_t expected, int64_t seen,
                                             int64_t peer_progress = -1) {
  ErrorRecord* record = view.error;
  if (atomicCAS(&record->status, 0, -1) == 0) {  // -1: being written
    record->operation = static_cast<int32_t>(operation);
    record->phase = static_cast<int32_t>(phase);
    record->rank = view.rank;
    record->peer = peer;
    record->call_serial = view.call_serial;
    record->expected = expected;
    record->seen = seen;
    record->peer_progress = peer_progress;
    __threadfence_system();
    ptx::st_release_sys(&record->status, static_cast<int32_t>(status));
  }
}

// An out-of-range or repeated expert id: recorded for the host, then treated as -1 by the caller
// so the protocol still completes.
__device__ __forceinline__ void record_invalid_expert(const DeviceView& view, Operation operation,
                                                      InvalidExpertKind kind, int64_t expert, int64_t num_experts,
                                                      int32_t token) {
  ErrorRecord* record = view.error;
  if (atomicCAS(&record->invalid_status, 0, -1) == 0) {
    record->invalid_operation = static_cast<int32_t>(operation);
    record->invalid_expert = expert;
    record->num_experts = num_experts;
    record->invalid_kind = static_cast<int32_t>(kind);
    record->invalid_token = token;
    __threadfence_system();
    ptx::st_release_sys(&record->invalid_status, 1);
  }
}

// A peer announced (through its barrier epoch or ready cell) that its input failed the host checks
// and it took part without data. Our own announcement is not recorded: our host raised already.
__device__ __forceinline__ void record_peer_failed(const DeviceView& view, Operation operation, int32_t peer) {
  if (peer == view.rank) return;
  ErrorRecord* record = view.error;
  if (atomicCAS(&record->peer_failed_status, 0, -1) == 0) {
    record->peer_failed_operation = static_cast<int32_t>(operation);
    record->peer_failed_rank = peer;
    __threadfence_system();
    ptx::st_release_sys(&record->peer_failed_status, 1);
  }
}

__device__ __forceinline__ bool error_recorded(const DeviceView& view) {
  return ptx::ld_relaxed_sys(&view.error->status) != 0;
}

// How a spin ended (spin_until).
enum class SpinEnd : int { kDone, kStopped, kError, kTimeout };

// The one spin loop of every device wait. `probe(seen)` loads the watched value (with acquire
// semantics) into `seen` and says whether the wait is over (kDone). Every 256 spins, `stop()` may
// end the wait (kStopped), then an error recorded by another thread ends it (kError), then the
// deadline (kTimeout): reading the host-mapped record crosses PCIe, so it and the clock are looked
// at only now and then.
template <typename Probe, typename Stop>
__device__ __forceinline__ SpinEnd spin_until(const DeviceView& view, Probe&& probe, Stop&& stop, uint64_t timeout_ns,
                                              int64_t& seen) {
  if (probe(seen)) return SpinEnd::kDone;
  const uint64_t start = ptx::global_timer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (probe(seen)) return SpinEnd::kDone;
    if ((spin & 255) == 0) {
      if (stop()) return SpinEnd::kStopped;
      if (error_recorded(view)) return SpinEnd::kError;
      if (ptx::global_timer_ns() - start > timeout_ns) return SpinEnd::kTimeout;
    }
  }
}

// Spins until `probe(seen)` returns true; returns false on timeout (recorded) or on an earlier
// error. `timeout_ns` defaults to the buffer's deadline; waits on this rank's own CTAs pass a
// longer one. `progress()` (called once, at the timeout) says how far the peer got by its own
// account, for the error record (ErrorRecord::peer_progress); the plain form records -1.
template <typename Probe, typename Progress>
__device__ __forceinline__ bool wait_until_reporting(const DeviceView& view, Operation operation, Phase phase,
                                                     int32_t peer, int64_t expected, Probe&& probe, Progress&& progress,
                                                     uint64_t timeout_ns = 0) {
  int64_t seen = 0;
  const SpinEnd end = spin_until(
      view, probe, [] { return false; }, timeout_ns == 0 ? view.timeout_ns : timeout_ns, seen);
  if (end == SpinEnd::kTimeout) {
    record_error(view, ErrorStatus::kTimeout, operation, phase, peer, expected, seen, progress());
  }
  return end == SpinEnd::kDone;
}

template <typename Probe>
__device__ __forceinline__ bool wait_until(const DeviceView& view, Operation operation, Phase phase, int32_t peer,
                                           int64_t expected, Probe&& probe, uint64_t timeout_ns = 0) {
  return wait_until_reporting(
      view, operation, phase, peer, expected, probe, [] { return int64_t{-1}; }, timeout_ns);
}

// Rank masking (LL only, opt-in): `mask` is this rank's int32 [R] mask in device memory, 1 for a
// peer it no longer waits for nor sends to; nullptr when masking is off. A masked peer's experts
// count as absent: its rows are not sent, its arrivals not awaited, its combine rows count as zero.
__device__ __forceinline__ bool peer_masked(const int32_t* mask, int peer) {
  return mask != nullptr && ptx::ld_relaxed_sys(mask + peer) != 0;
}

enum class WaitResult : int { kArrived = 0, kMasked = 1, kFailed = 2 };

// wait_until for a wait on `peer` under rank masking. Without a mask it is wait_until (kFailed on
// timeout or an earlier error). With one, a masked peer is not waited for (kMasked, also when
// another thread masks it during the wait), and a wait that passes its deadline masks the peer
// instead of recording an error: the operation completes without it.
template <typename Probe>
__device__ __forceinline__ WaitResult wait_or_mask(const DeviceView& view, int32_t* mask, Operation operation,
                                                   Phase phase, int32_t peer, int64_t expected, Probe&& probe) {
  if (mask == nullptr) {
    return wait_until(view, operation, phase, peer, expected, probe) ? WaitResult::kArrived : WaitResult::kFailed;
  }
  if (peer_masked(mask, peer)) return WaitResult::kMasked;
  int64_t seen = 0;
  switch (spin_until(
      view, probe, [&] { return peer_masked(mask, peer); }, view.timeout_ns, seen)) {
    case SpinEnd::kDone:
      return WaitResult::kArrived;
    case SpinEnd::kError:
      return WaitResult::kFailed;
    case SpinEnd::kTimeout:
      atomicExch(mask + peer, 1);
      return WaitResult::kMasked;
    case SpinEnd::kStopped:
      break;
  }
  return WaitResult::kMasked;
}

}  // namespace deep_ep
