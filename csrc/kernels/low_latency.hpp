// Low-latency (decode) dispatch and combine: argument structs, launchers and the area protocol
// both kernels share.
//
// Each LL operation (dispatch or combine) is a send phase and a receive phase, run by one kernel
// function per operation (ll_dispatch_kernel, ll_combine_kernel) whose runtime argument
// LowLatencyPhases says which: both in one launch without a hook, the send phase now and the
// receive phase when a hook is called (the same function launched twice). Profilers key kernels by
// name, so every mode shows one kernel per operation. Send rounds are claimed by running CTAs (see
// next_send_round). Operation n uses area n % kLowLatencyAreas of the LL region (its receive side),
// given as `area_offset` = ll_offset + area * area_bytes in every window.
//
// Protocol (docs/low_latency.md has the full argument):
//   * counts cells [L][R] of the area are arrival cells: (local expert l, source s) publishes
//     n + 1 there with a system-scope release after its rows ("0 = not arrived"). Dispatch: the n
//     tokens of s that selected expert l of the receiver. Combine: the n rows the receiver's
//     tokens get back from local expert l of s. The receive phase resets every cell to 0.
//   * flags cells [R] of each area are counts, never reset: ready[me] in my own window counts the
//     operations whose receive phase ran on this area (bumped at the end of it); ready[d] in
//     my window counts the operations on this area whose data rank d has released. A send phase
//     of epoch e = ready[me] + 1 on an area waits until every peer released e - 1 operations there
//     — a poll of its own window — before writing into that peer's area.
//   * A rank releases an operation's data once it is done with it: when it starts the second
//     operation after it, or the next one on the same area (the lifetime of zero-copy views and
//     of the headers a combine reads). The send phase publishes releases twice: at its start for
//     its own area (everything before this operation there), and, from its last CTA once every
//     CTA is done with the window, at its end for the other areas (everything but the previous
//     operation). With the areas in rotation, the area an operation writes was released by every
//     peer at the end of their previous send: no send waits for a peer to start the same
//     operation. The rank's {area, epoch} of its last send (kLowLatencyStateWords in area 0) tell
//     the end-of-send publication which area holds the previous operation.
//   * a rank whose input failed its host checks sends with no data and `input_failed`: its arrival
//     cells (and signals) carry kFailedInputSignalFlag on top of count + 1, and the receiver records
//     it (not fatal) when it reads one. Carried by this operation's cells, the report belongs to this
//     operation: a separate "input failed" cell, set at the start of the send, could be set by a
//     fast rank's next operation while a slow peer still received this one, which then reported it
//     (a PeerInputError for an operation whose inputs were fine).
//   * across nodes (DeviceView::ll_ranks_per_node > 0): a peer of another node is reached through
//     the scale-out transport instead of stores. Rows are staged in the sender's window and put
//     (with `lsa`, whose puts are stores anyway, stored straight into the peer instead); the
//     arrival of (l, s) is signal kSignalLlArrival (area, l, s), which grows by n + 1 per
//     operation (+ kFailedInputSignalFlag for a failed input) and is never reset (the receiver
//     keeps a shadow); releases are signals kSignalLlRelease (area, s) holding the released count
//     itself. One signal covers the puts its CTA issued before it (the whole CTA is the group).
//   * rank masking (opt-in, `rank_mask`): a masked peer is skipped by every send (no rows, no
//     arrival cell, no release) and every wait (its arrivals count as 0 rows); a wait on a peer that
//     passes the deadline masks it instead of failing. Survivors stay in step with each other: each
//     still runs every phase of every operation, only the masked peers are left out.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_view.hpp"
#include "common/error_record.hpp"
#include "common/geometry.hpp"

#if defined(__CUDACC__)
#include "kernels/barrier.cuh"
#include "kernels/ptx.cuh"
#include "kernels/scaleout.cuh"
#include "kernels/timeout.cuh"
#endif

namespace deep_ep {

// Workspace scratch ints of the LL kernels, back to 0 when a kernel ends, the last ones away from
// other kernels' scratch; one per (kind, area) so that operations on different streams never share
// one. Kinds: the CTA finish counter of a receive phase (its last CTA resets the arrival cells or
// bumps the area's epoch), the CTA finish counter of a send phase (its last CTA publishes the
// releases) and the send round counter of a send phase (running CTAs claim rounds).
struct LowLatencyScratch {
  enum Kind : int { kReceiveFinish = 0, kSendFinish = 1, kSendClaim = 2, kNumKinds = 3 };
  static constexpr int kFirstIndex = WorkspaceLayout::kNumScratchInts - kNumKinds * kLowLatencyAreas;
  static constexpr int index(Kind kind, int area) { return kFirstIndex + kind * kLowLatencyAreas + area; }
};

// Layout of the fp8 scales the dispatch receive phase writes into its output (compact rows).
enum class LowLatencyScales : int {
  kFp32RowMajor = 0,   // fp32 [L][R * T_ll][G]
  kFp32ColMajor = 1,   // fp32 [L][G][R * T_ll] (DeepEP V1's TMA-friendly layout)
  kUe8m0RowMajor = 2,  // int32 [L][R * T_ll][G / 4]: exponent bytes of 4 groups, the first lowest
  kUe8m0ColMajor = 3,  // int32 [L][G / 4][R * T_ll]
};

// Threads per CTA of both LL kernels, in every phase.
constexpr int kLowLatencyThreads = 512;

// The phases of one LL operation a launch runs: a bit set passed to the kernel at run time, so that
// every mode launches the same kernel function (and template instantiation): kBoth without a receive
// hook, kSend then kReceive with one.
enum class LowLatencyPhases : int { kSend = 1, kReceive = 2, kBoth = 3 };

__host__ __device__ constexpr bool runs_phase(LowLatencyPhases phases, LowLatencyPhases phase) {
  return (static_cast<int>(phases) & static_cast<int>(phase)) != 0;
}

struct LowLatencyDispatchArgs {
  DeviceView view;
  LowLatencyLayout layout;
  int64_t ll_offset = 0;    // window offset of the LL region (area 0)
  int64_t area_offset = 0;  // window offset of this operation's area
  int area = 0;             // of area_offset: picks the kernels' scratch counters
  int num_experts = 0;
  int hidden = 0;
  int num_tokens = 0;  // T <= layout.num_max_tokens
  int num_topk = 0;    // K <= layout.num_topk
  bool use_fp8 = true;
  const void* x = nullptr;              // bf16 [T, hidden], contiguous
  const int64_t* topk_idx = nullptr;    // [T, K], contiguous
  int32_t* recv_count = nullptr;        // out: [L] tokens received per local expert
  int32_t* count_per_source = nullptr;  // out: [L, R] tokens received per (local expert, source)
  int num_sms = 1;                      // CTAs per kernel (<= the rank's SM cap)
  bool input_failed = false;            // this rank sends nothing and tells its peers why
  bool round_scale = false;             // fp8: power-of-two scales (kernels/fp8.cuh)
  // Receive phase outputs besides the counts. recv_x == nullptr: rows stay in the window in
  // per-source blocks (zero-copy); otherwise expert l's rows are copied to recv_x[l] packed in
  // [0, recv_count[l]) ordered by (source, source token), with their scales in `scales_format`.
  void* recv_x = nullptr;       // [L, R * T_ll, H] fp8 or bf16
  void* recv_scales = nullptr;  // fp8 only
  LowLatencyScales scales_format = LowLatencyScales::kFp32RowMajor;
  int32_t* recv_src_info = nullptr;          // [L, R * T_ll] source token of each row (output layout)
  int64_t* recv_layout_range = nullptr;      // [L, R] (first row << 32) | count, output layout
  int32_t* cumulative_recv_stats = nullptr;  // [L] += recv_count
  int64_t* wait_cost_stats = nullptr;        // [R] += clock64 cycles waited for each source
  int32_t* rank_mask = nullptr;              // [R] rank masking (kernels/timeout.cuh); nullptr: off
};

struct LowLatencyCombineArgs {
  DeviceView view;
  LowLatencyLayout layout;
  int64_t ll_offset = 0;             // window offset of the LL region (area 0)
  int64_t dispatch_area_offset = 0;  // area of the dispatch this combine answers (headers)
  int64_t area_offset = 0;           // this operation's area (combine payload, arrival cells)
  int area = 0;                      // of area_offset: picks the kernels' scratch counters
  int num_experts = 0;
  int hidden = 0;
  int num_tokens = 0;                         // T of the dispatch
  int num_topk = 0;                           // K of the dispatch
  const void* x = nullptr;                    // bf16 [L, R * T_ll, hidden], contiguous: expert outputs
  const int32_t* count_per_source = nullptr;  // [L, R] from the dispatch receive
  const int64_t* topk_idx = nullptr;          // [T, K]
  const float* topk_weights = nullptr;        // [T, K]
  void* out = nullptr;                        // bf16 [T, hidden], contiguous
  int num_sms = 1;
  bool input_failed = false;  // this rank sends no row (count_per_source may be null) and tells its peers
  // The dispatch's layout range [L, R] when its rows were compacted (x rows of (l, s) start at
  // l * R * T_ll + range >> 32); nullptr: per-source blocks (rows of (l, s) at (l * R + s) * T_ll).
  const int64_t* layout_range = nullptr;
  int64_t* wait_cost_stats = nullptr;  // [R] += clock64 cycles the receive phase waited per source
  int32_t* rank_mask = nullptr;        // [R] rank masking (kernels/timeout.cuh); nullptr: off
};

// Launch `phases` of one operation with the same arguments for every phase. Throw
// std::invalid_argument for shapes the kernels cannot take or a `phases` outside LowLatencyPhases,
// std::runtime_error for a failed launch. With split phases, kSend and kReceive of one operation
// must run in this order on streams ordered the same way.
void launch_low_latency_dispatch(const LowLatencyDispatchArgs& args, LowLatencyPhases phases, cudaStream_t stream);
void launch_low_latency_combine(const LowLatencyCombineArgs& args, LowLatencyPhases phases, cudaStream_t stream);

// Throws std::invalid_argument when the largest dispatch of a buffer of `layout` (its routing and
// token list are staged in shared memory) does not fit this device's dispatch kernel (`scaleout`:
// the instantiation that reaches other nodes through the transport). On the current device; checked
// when a buffer is built, so that no call can fail on it later.
void check_low_latency_dispatch_fits(const LowLatencyLayout& layout, bool scaleout);

// Host checks both LL operations share: the call must match what the buffer's LL region was
// sized for. Throws std::invalid_argument naming the argument, the value and the rule.
void check_low_latency_call(const LowLatencyLayout& layout, int num_ranks, int num_experts, int num_tokens,
                            int num_topk);
// Throws std::invalid_argument unless `phases` is one of LowLatencyPhases (it may come from Python).
void check_low_latency_phases(LowLatencyPhases phases);

#if defined(__CUDACC__)
namespace low_latency {

// This rank's LL scratch int of `kind` for `area` (LowLatencyScratch).
__device__ __forceinline__ int32_t* scratch_int(const DeviceView& view, LowLatencyScratch::Kind kind, int area) {
  return view.local<int32_t>(WorkspaceLayout::scratch_offset + int64_t{LowLatencyScratch::index(kind, area)} * 4);
}

// Send rounds. A send phase splits its work into `num_rounds` rounds; round q is what CTA q % G
// of a G-CTA grid would do in its round q / G if each CTA took its rounds in turn. A launch that
// runs both phases has CTAs whose receive phase waits for rows that any round may send, and the
// CTAs of a grid are not all resident at once (other kernels, other ranks' kernels under MPS share
// the SMs); so running CTAs claim rounds from the area's kSendClaim counter, and a CTA receives only
// once every round is claimed: each round belongs to a running CTA that finishes it without
// waiting on this grid. A send-only launch claims the same way (one code path for every mode).
// CTA-collective; the first claim is made before the area gate.
__device__ __forceinline__ int next_send_round(int32_t* claim_counter) {
  __shared__ int claimed;
  __syncthreads();  // every thread has read the previous claim
  if (threadIdx.x == 0) claimed = atomicAdd(claim_counter, 1);
  __syncthreads();
  return claimed;
}

// Round q of a round-split loop whose CTA c took items base + j * G + c (j < per_round), bases
// stepping by G * per_round: its first item and item stride.
struct SendRound {
  int base;  // the item of j = 0
  int stride;
};
__device__ __forceinline__ SendRound send_round(int round, int per_round) {
  const int grid = static_cast<int>(gridDim.x);
  return SendRound{(round / grid) * grid * per_round + round % grid, grid};
}
__device__ __forceinline__ int num_send_rounds(int num_items, int per_round) {
  const int grid = static_cast<int>(gridDim.x);
  return (num_items + grid * per_round - 1) / (grid * per_round) * grid;
}

__device__ __forceinline__ int32_t* arrival_cell(const DeviceView& view, int rank, const LowLatencyLayout& layout,
                                                 int64_t area_offset, int local_expert, int source) {
  const int64_t cell = int64_t{local_expert} * view.num_ranks + source;
  return view.peer<int32_t>(rank, area_offset + layout.dispatch_counts_offset + cell * 4);
}

// flags cell `about_rank` of an area in `rank`'s window (see the protocol above). int64: the counts
// grow by one per operation on the area and are never reset, so 32 bits would wrap in days.
__device__ __forceinline__ int64_t* flags_cell(const DeviceView& view, int rank, const LowLatencyLayout& layout,
                                               int64_t area_offset, int about_rank) {
  return view.peer<int64_t>(rank, area_offset + layout.combine_flags_offset + int64_t{about_rank} * 8);
}

// LL across nodes: `peer` sits on another node and is reached through the scale-out transport.
__device__ __forceinline__ bool via_transport(const DeviceView& view, int peer) {
  return view.ll_ranks_per_node > 0 && peer / view.ll_ranks_per_node != view.rank / view.ll_ranks_per_node;
}

// LL across nodes over `lsa` (virtual nodes of one host): a put is a plain store anyway, so the
// send phases store rows and headers straight into the peer, as within a node, and only the
// arrival signals go through the transport (a signal covers its CTA's stores as it covers puts).
__device__ __forceinline__ bool stores_directly(const DeviceView& view) {
  return view.scaleout.kind == ScaleoutKind::kLsa;
}

// Signal ids at the receiving rank (geometry.hpp).
__device__ __forceinline__ int arrival_signal(const DeviceView& view, int area, int local_expert, int source) {
  return kSignalLlArrival + area * kMaxExperts + local_expert * view.num_ranks + source;
}
__device__ __forceinline__ int release_signal(int area, int source) {
  return kSignalLlRelease + area * kMaxRanks + source;
}

// Tells transport peer `peer` that this rank released `released` operations of `area`. Signals
// only add, so this adds what was not published yet; atomicMax on the last published count keeps
// that exact when send phases of other areas (other streams) publish at the same time. The counts
// of an area only grow (docs/low_latency.md), so nothing is ever taken back.
__device__ __forceinline__ void publish_release_signal(const DeviceView& view, int area, int peer, int64_t released) {
  auto* last = view.local<long long>(WorkspaceLayout::ll_published_offset + (int64_t{area} * kMaxRanks + peer) * 8);
  const int64_t before = atomicMax(last, static_cast<long long>(released));
  if (released > before) {
    scaleout::signal_only(view, peer, release_signal(area, view.rank), static_cast<uint64_t>(released - before));
  }
}

// Release of `released` operations of area `area` (window offset `area_offset`) to `peer`.
// kFenced: the caller has already run a system-scope acq_rel fence after the accesses being
// released, so a strong relaxed store is enough (a release store would fence again).
template <bool kFenced = false>
__device__ __forceinline__ void publish_release(const DeviceView& view, const LowLatencyLayout& layout, int area,
                                                int64_t area_offset, int peer, int64_t released) {
  if (via_transport(view, peer)) {
    publish_release_signal(view, area, peer, released);
  } else if constexpr (kFenced) {
    ptx::st_relaxed_sys(flags_cell(view, peer, layout, area_offset, view.rank), released);
  } else {
    ptx::st_release_sys(flags_cell(view, peer, layout, area_offset, view.rank), released);
  }
}

// How many operations of area `area` (at `area_offset`) `peer` has released to this rank (acquire).
__device__ __forceinline__ int64_t released_by(const DeviceView& view, const LowLatencyLayout& layout, int area,
                                               int64_t area_offset, int peer) {
  if (via_transport(view, peer))
    return static_cast<int64_t>(scaleout::read_own_signal(view, release_signal(area, peer)));
  return ptx::ld_acquire_sys(flags_cell(view, view.rank, layout, area_offset, peer));
}

// LL across nodes: waits (or masks, as wait_or_mask) until arrival signal `id` of `source` grew
// past `before` (its shadow, read by the caller). `*delta` gets how much it grew: this operation's
// n + 1, plus kFailedInputSignalFlag when the source's input failed (one addition per operation).
__device__ __forceinline__ WaitResult wait_arrival_signal(const DeviceView& view, int32_t* rank_mask,
                                                          Operation operation, Phase phase, int source, int id,
                                                          uint64_t before, int64_t* delta) {
  return wait_or_mask(view, rank_mask, operation, phase, source, 1, [&](int64_t& seen) {
    const uint64_t signal = scaleout::read_own_signal(view, id);
    seen = signal > before ? static_cast<int64_t>(signal - before) : 0;
    *delta = seen;
    return seen != 0;
  });
}

// The lsa-deferred queue of a send CTA that uses the transport (its group is the whole CTA);
// nullptr, and no shared memory, otherwise.
template <bool kEnabled>
__device__ __forceinline__ scaleout::DeferredQueue* transport_queue() {
  if constexpr (kEnabled) {
    __shared__ scaleout::DeferredQueue queue;
    return &queue;
  } else {
    return nullptr;
  }
}

// Epoch of the operation being sent: one more than the operations whose receive phase already ran
// on this area. Only receive phases write ready[me] in my window, from the last CTA of their launch
// to finish (every CTA of a launch running both phases read it at its start; a receive-only launch
// is stream-ordered after its send launch), so every CTA of a send phase reads the same value.
__device__ __forceinline__ int64_t send_epoch(const DeviceView& view, const LowLatencyLayout& layout,
                                              int64_t area_offset) {
  return ptx::ld_relaxed_sys(flags_cell(view, view.rank, layout, area_offset, view.rank)) + 1;
}

// The value of an arrival cell: count + 1 (0 = not arrived), plus kFailedInputSignalFlag when this
// rank's input failed (the launchers keep counts below the flag).
__device__ __forceinline__ int32_t arrival_value(int32_t count, bool input_failed) {
  return count + 1 + (input_failed ? static_cast<int32_t>(kFailedInputSignalFlag) : 0);
}

// Start of a send phase; every thread of every CTA that sends, before the CTA writes into any
// peer's area. The CTA holding round 0 (`publishes`) releases the earlier operations on this area
// (epoch - 1) to every peer; each CTA then waits until every peer released epoch - 1 operations
// here — normally already true, from the peer's previous send. Round 0's holder publishes because
// it is sure to run before this rank's receive phase waits on the peers (whose sends wait for this
// release). Returns false on timeout (the CTA must not write then).
__device__ __forceinline__ bool begin_send(const DeviceView& view, const LowLatencyLayout& layout, int area,
                                           int64_t area_offset, int64_t epoch, bool publishes, Operation operation,
                                           int32_t* rank_mask) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  if (publishes) {
    for (int peer = threadIdx.x; peer < view.num_ranks; peer += blockDim.x) {
      // Release: everything this rank did before this kernel (its use of the area) happens-before
      // the peer's writes into it.
      if (peer != view.rank && !peer_masked(rank_mask, peer)) {
        publish_release(view, layout, area, area_offset, peer, epoch - 1);
      }
    }
  }
  __syncthreads();
  for (int peer = threadIdx.x; peer < view.num_ranks; peer += blockDim.x) {
    if (peer == view.rank) continue;  // my own area is free by stream order
    const WaitResult result =
        wait_or_mask(view, rank_mask, operation, Phase::kBarrierArrive, peer, epoch - 1, [&](int64_t& seen) {
          seen = released_by(view, layout, area, area_offset, peer);
          return seen >= epoch - 1;
        });
    if (result == WaitResult::kFailed) atomicExch(&failed, 1);
  }
  __syncthreads();
  return failed == 0;
}

// End of a send phase; every thread of every CTA, after the CTA's last access to any window (a
// combine reads its dispatch's headers in this rank's window). The last CTA to finish publishes to
// every peer how many operations of each area this rank has released: on this operation's area
// every earlier one (epoch - 1); on the area of the previous operation all but that one; on any
// other area every received one (all are at least two operations old). Then it records this
// operation as the previous one. Every CTA of the grid calls it after its last (empty) claim of a
// send round, so the last one also sets the area's claim counter back to 0. Returns true in every
// thread of the last CTA (every other CTA is then done with the send phase's window accesses),
// false elsewhere.
__device__ __forceinline__ bool end_send(const DeviceView& view, const LowLatencyLayout& layout, int64_t ll_offset,
                                         int area, int64_t epoch, const int32_t* rank_mask) {
  int32_t* counter = scratch_int(view, LowLatencyScratch::kSendFinish, area);
  __shared__ int is_last;
  __shared__ int64_t previous[kLowLatencyStateWords];
  __shared__ int64_t received[kLowLatencyAreas];
  static_assert(kLowLatencyThreads >= 64 + kLowLatencyAreas && kLowLatencyStateWords <= 32, "end_send's loaders");
  int64_t* state = view.local<int64_t>(ll_offset + layout.combine_flags_offset + int64_t{view.num_ranks} * 8);
  __syncthreads();
  const int thread = static_cast<int>(threadIdx.x);
  if (thread == 0) {
    // acq_rel: every CTA's window accesses happen-before the last CTA's release stores below.
    is_last = ptx::atomic_add_acq_rel_gpu(counter, 1) == static_cast<int32_t>(gridDim.x) - 1;
    if (is_last) {  // workspace invariant: scratch is zero between kernels
      *counter = 0;
      *scratch_int(view, LowLatencyScratch::kSendClaim, area) = 0;
    }
  } else if (thread >= 32 && thread < 32 + kLowLatencyStateWords) {
    // What the last CTA needs, loaded by other warps while thread 0 counts (every CTA: it is not
    // known yet which is last): this rank's last send, and how many operations each area received.
    // Earlier kernels of this stream wrote them, so reading before the count sees the same values.
    previous[thread - 32] = state[thread - 32];
  } else if (thread >= 64 && thread < 64 + kLowLatencyAreas) {
    received[thread - 64] =
        ptx::ld_relaxed_sys(flags_cell(view, view.rank, layout, ll_offset + layout.area_start(thread - 64), view.rank));
  }
  __syncthreads();
  if (!is_last) return false;
  const int previous_area = static_cast<int>(previous[0]);
  const int64_t previous_epoch = previous[1];  // 0: no previous operation
  if (thread < view.num_ranks) {
    int64_t released[kLowLatencyAreas];
#pragma unroll
    for (int other = 0; other < kLowLatencyAreas; ++other) {
      if (other == area) {
        released[other] = epoch - 1;
      } else if (other == previous_area && previous_epoch > 0) {
        released[other] = previous_epoch - 1;
      } else {
        released[other] = received[other];
      }
    }
    // One system-scope fence per thread, then strong stores: each store after the fence releases
    // what the fence covers (every CTA's window accesses, ordered before it by the counter's
    // acq_rel and the __syncthreads). A release store per area would fence once per area, in series.
    ptx::fence_acq_rel_sys();
    for (int peer = threadIdx.x; peer < view.num_ranks; peer += blockDim.x) {
      if (peer == view.rank || peer_masked(rank_mask, peer)) continue;
#pragma unroll
      for (int other = 0; other < kLowLatencyAreas; ++other) {
        publish_release<true>(view, layout, other, ll_offset + layout.area_start(other), peer, released[other]);
      }
    }
  }
  __syncthreads();  // every thread read `previous` before it is overwritten
  if (threadIdx.x == 0) {
    state[0] = area;
    state[1] = epoch;
  }
  return true;
}

// The receive phase's last act on the area: one more operation has been received here.
__device__ __forceinline__ void bump_epoch(const DeviceView& view, const LowLatencyLayout& layout,
                                           int64_t area_offset) {
  int64_t* cell = flags_cell(view, view.rank, layout, area_offset, view.rank);
  ptx::st_relaxed_sys(cell, ptx::ld_relaxed_sys(cell) + 1);
}

// Counts this CTA as finished with a receive phase (the area's kReceiveFinish counter, set back to
// 0 by the last CTA); true in every thread of the grid's last CTA to get here. acq_rel: whatever the
// other CTAs did before they counted (their waits, their reads of the epoch) happens-before what
// the last one does next. CTA-collective.
__device__ __forceinline__ bool last_to_finish(const DeviceView& view, int area) {
  __shared__ int is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counter = scratch_int(view, LowLatencyScratch::kReceiveFinish, area);
    is_last = ptx::atomic_add_acq_rel_gpu(counter, 1) == static_cast<int32_t>(gridDim.x) - 1;
    if (is_last) *counter = 0;  // workspace invariant: scratch is zero between kernels
  }
  __syncthreads();
  return is_last != 0;
}

// Copies one row of `num_vectors` 16-byte vectors with one warp, `kUnroll` vectors per lane in
// flight: all loads of a batch are issued before its stores. `kWrittenByThisLaunch`: the source
// was written by another warp of this launch (loads through L2, not the non-coherent path).
template <int kUnroll, bool kWrittenByThisLaunch = false>
__device__ __forceinline__ void warp_copy_row(int4* dst, const int4* src, int num_vectors, int lane) {
  for (int base = lane; base < num_vectors; base += 32 * kUnroll) {
    int4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 32 < num_vectors) {
        values[u] = kWrittenByThisLaunch ? __ldcg(src + base + u * 32) : ptx::ld_nc_v4(src + base + u * 32);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 32 < num_vectors) ptx::st_na_v4(dst + base + u * 32, values[u]);
    }
  }
}

}  // namespace low_latency
#endif

}  // namespace deep_ep
