// Cross-rank barrier and intra-kernel grid synchronisation.
//
// rank_barrier: epoch based. Each rank keeps its last epoch in its workspace; to pass epoch e it
// release-stores e into its cell of every peer's barrier cells and waits until every peer's cell in
// its own window reaches e. Epochs only grow, so no cell is ever reset and back-to-back barriers
// need no cleaning step.
//
// A rank whose input failed its host checks still takes part (with no data) and announces it:
// announce_input_failed() sets its cell in every peer's input_failed cells before the release that
// lets the peer pass; collect_input_failed() (after the wait) records and clears it. A flag cell,
// not a bit on the epoch: a fast peer may overwrite its epoch cell with the next barrier's before
// this rank reads it.
//
// grid_sync: generation based. CTAs count arrivals in a workspace counter; the last to arrive
// resets the counter to 0 (workspace invariant) and bumps the generation the others wait on.
// Needs every CTA of the grid to be resident at once: launches keep num_sms within the SMs this
// rank may use (Runtime caps it when ranks share a GPU). Its deadline is twice the buffer's: the
// CTAs it waits for are usually in a cross-rank wait (CTA 0 in rank_barrier), whose own deadline
// must expire first so the error names the missing peer, not "grid synchronisation".
#pragma once

#include <cstdint>

#include "common/device_view.hpp"
#include "common/geometry.hpp"
#include "kernels/ptx.cuh"
#include "kernels/timeout.cuh"

namespace deep_ep {

// Called by threads of one CTA before the release that publishes this rank's arrival. Peers this
// rank cannot reach by load/store (other hosts, gin) are skipped. (LL does not use these cells: its
// arrival cells and signals carry the flag themselves, low_latency.hpp.)
__device__ __forceinline__ void announce_input_failed(const DeviceView& view) {
  for (int peer = threadIdx.x; peer < view.num_ranks; peer += blockDim.x) {
    if (peer != view.rank && view.peer_bases[peer] != nullptr) {
      ptx::st_relaxed_sys(view.peer<int32_t>(peer, WorkspaceLayout::input_failed_offset + int64_t{view.rank} * 4), 1);
    }
  }
}

// After this thread acquired `peer`'s arrival: record and clear the peer's announcement, if any.
// The cell returns to zero (workspace invariant). A peer that fails again before the clear merges
// into the same report.
__device__ __forceinline__ void collect_input_failed(const DeviceView& view, Operation operation, int peer) {
  int32_t* cell = view.local<int32_t>(WorkspaceLayout::input_failed_offset + int64_t{peer} * 4);
  if (ptx::ld_relaxed_sys(cell) != 0) {
    ptx::st_relaxed_sys(cell, 0);
    record_peer_failed(view, operation, peer);
  }
}

// Called by every thread of one CTA. Everything this rank wrote before the call (ordered before it
// by __syncthreads / grid_sync) is visible to every peer after it. Returns false on timeout.
// The peers are ranks [first, first + count), this rank among them; every rank of the group runs
// the same sequence of barriers (of any peer set), so one epoch counter serves them all.
__device__ __forceinline__ bool group_barrier(const DeviceView& view, Operation operation, int first, int count,
                                              bool input_failed = false) {
  __shared__ int64_t epoch_shared;
  __shared__ int failed_shared;
  int64_t* epoch_cell = view.local<int64_t>(WorkspaceLayout::barrier_epoch_offset);
  if (threadIdx.x == 0) {
    epoch_shared = *epoch_cell + 1;
    failed_shared = 0;
  }
  if (input_failed) announce_input_failed(view);
  __syncthreads();
  const int64_t epoch = epoch_shared;
  for (int peer = first + threadIdx.x; peer < first + count; peer += blockDim.x) {
    // Release at system scope: cumulative over this CTA's writes ordered by the __syncthreads above.
    ptx::st_release_sys(view.peer<int64_t>(peer, WorkspaceLayout::barrier_cells_offset + int64_t{view.rank} * 8),
                        epoch);
  }
  for (int peer = first + threadIdx.x; peer < first + count; peer += blockDim.x) {
    const int64_t* cell = view.local<int64_t>(WorkspaceLayout::barrier_cells_offset + int64_t{peer} * 8);
    const bool arrived = wait_until_reporting(
        view, operation, Phase::kBarrierArrive, peer, epoch,
        [&](int64_t& seen) {
          seen = ptx::ld_acquire_sys(cell);
          return seen >= epoch;
        },
        // The peer's own count of completed barriers (its epoch cell), when load/store reachable.
        [&] {
          if (view.peer_bases[peer] == nullptr) return int64_t{-1};
          return ptx::ld_acquire_sys(view.peer<int64_t>(peer, WorkspaceLayout::barrier_epoch_offset));
        });
    if (!arrived) {
      atomicExch(&failed_shared, 1);
    } else {
      collect_input_failed(view, operation, peer);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *epoch_cell = epoch;
  const bool ok = failed_shared == 0;
  __syncthreads();
  return ok;
}

__device__ __forceinline__ bool rank_barrier(const DeviceView& view, Operation operation, bool input_failed = false) {
  return group_barrier(view, operation, 0, view.num_ranks, input_failed);
}

// Called by every thread of every CTA of the grid, `slot` < WorkspaceLayout::kNumGridCounters and
// used by one kernel at a time. Returns false on timeout or an earlier error.
// kOrderPeerWrites: every thread first fences at system scope, so that writes this CTA made to
// peer windows are ordered before whatever another CTA publishes to peers after the sync. Without
// it (a phase that wrote only this GPU's memory) thread 0's acq_rel arrival releases, after the
// __syncthreads, what the whole CTA wrote (release is cumulative), as cooperative groups' grid sync
// does; a system fence in every thread waits for each thread's stores to be acknowledged, in series.
template <bool kOrderPeerWrites = true>
__device__ __forceinline__ bool grid_sync(const DeviceView& view, Operation operation, int slot) {
  __shared__ int ok_shared;
  if constexpr (kOrderPeerWrites) __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* arrivals = view.local<int32_t>(WorkspaceLayout::grid_counters_offset + int64_t{slot} * 4);
    int32_t* generation = view.local<int32_t>(WorkspaceLayout::grid_generations_offset + int64_t{slot} * 4);
    const int32_t current = ptx::ld_acquire_gpu(generation);
    bool ok = true;
    if (ptx::atomic_add_acq_rel_gpu(arrivals, 1) == static_cast<int32_t>(gridDim.x) - 1) {
      *arrivals = 0;
      __threadfence();
      atomicAdd(generation, 1);
    } else {
      ok = wait_until(
          view, operation, Phase::kGridSync, -1, current + 1,
          [&](int64_t& seen) {
            seen = ptx::ld_acquire_gpu(generation);
            return seen != current;
          },
          2 * view.timeout_ns);
    }
    ok_shared = ok ? 1 : 0;
  }
  __syncthreads();
  return ok_shared != 0;
}

}  // namespace deep_ep
