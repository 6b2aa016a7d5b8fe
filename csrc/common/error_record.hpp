// The error record kernels write into host-mapped memory when a wait times out or an input is
// invalid. The host reads it at its next check and raises CommTimeoutError / ValueError; the kernel
// itself never traps, so the CUDA context stays usable.
//
// Three independent parts: a timeout is fatal (peers are out of step; the buffer refuses further
// work until destroy()); an invalid routing entry is not (the kernel treated the bad expert id as
// -1, finished the protocol, and the buffer stays usable once the host has reported it); nor is a
// peer's failed input (the peer took part in the operation without data and told us so through
// its barrier or ready cell; our result of that operation lacks its contribution).
#pragma once

#include <cstdint>

namespace deep_ep {

enum class ErrorStatus : int32_t { kOk = 0, kTimeout = 1 };

// Operations and phases name the call site of a wait. Keep the names in error_names() in sync.
enum class Operation : int32_t {
  kNone = 0,
  kBarrier = 1,
  kHtNotify = 2,
  kHtDispatch = 3,
  kHtCombine = 4,
  kLlDispatch = 5,
  kLlCombine = 6,
};

enum class Phase : int32_t {
  kNone = 0,
  kBarrierArrive = 1,  // waiting for a peer's barrier epoch
  kCountsArrive = 2,   // waiting for a peer's token counts
  kDataArrive = 3,     // waiting for a peer's "data written" flag
  kGridSync = 4,       // waiting for the other CTAs of this rank's kernel
  // Hybrid mode, over the scale-out transport (peer = the global rank of the rail peer):
  kScaleoutCountsArrive = 5,  // notify: a rail peer's per-node counts
  kScaleoutRowsArrive = 6,    // dispatch forwarder: a rail peer's token rows
  kPartialsArrive = 7,        // combine: a node's partial sums at the home rank
  kScaleoutBarrier = 8,       // a rail peer's barrier signal
  kSendBaseArrive = 9,        // notify, zero-copy receive: a receiver's first-row offset for this rank
};

// What was wrong with a routing entry.
enum class InvalidExpertKind : int32_t {
  kOutOfRange = 0,  // id outside [-1, num_experts)
  kDuplicate = 1,   // id already selected at an earlier top-k slot of the same token
};

// Each part is written once (the first writer wins through its status word), read by the host.
struct ErrorRecord {
  // Timeout (fatal).
  int32_t status;       // ErrorStatus; -1 while being written
  int32_t operation;    // Operation
  int32_t phase;        // Phase
  int32_t rank;         // the rank that observed the failure
  int32_t peer;         // the rank it waited for (-1: a CTA of this rank's own grid)
  int32_t call_serial;  // DeviceView::call_serial of the waiting kernel: the host call it belongs to (0: unknown)
  int64_t expected;     // value waited for
  int64_t seen;         // last value seen
  // Invalid routing entry (not fatal): an expert id outside [-1, num_experts), or a repeat.
  int32_t invalid_status;     // 1 once recorded; -1 while being written; the host clears it
  int32_t invalid_operation;  // Operation
  int64_t invalid_expert;     // the offending id
  int64_t num_experts;        // the bound it broke
  int32_t invalid_kind;       // InvalidExpertKind
  int32_t invalid_token;      // token index (row of topk_idx) of the entry
  // A peer's input failed its host checks (not fatal): it took part without data.
  int32_t peer_failed_status;     // 1 once recorded; -1 while being written; the host clears it
  int32_t peer_failed_operation;  // Operation
  int32_t peer_failed_rank;       // the first such peer seen
  int32_t reserved2;
  // Timeout of a barrier arrival: how many barriers the awaited peer has completed by its own
  // count (its epoch cell, read through load/store at the timeout); -1 when not known. A count at
  // or past the expected epoch means the peer passed the barrier but its arrival never became
  // visible here; a smaller one that it never got there.
  int64_t peer_progress;
};

// Anything recorded (a timeout, an invalid routing entry, a peer's failed input), or being written.
inline bool any_error(const ErrorRecord& record) {
  return record.status != 0 || record.invalid_status != 0 || record.peer_failed_status != 0;
}

// An error the kernels finished recording. A record still being written (-1) is not one yet: a
// caller that must not wait for it goes on and finds it at its next check.
inline bool reported_error(const ErrorRecord& record) {
  return record.status > 0 || record.invalid_status > 0 || record.peer_failed_status > 0;
}

const char* operation_name(int32_t operation);
const char* phase_name(int32_t phase);

}  // namespace deep_ep
