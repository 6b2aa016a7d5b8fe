// The cross-rank barrier of hybrid mode, where ranks of other nodes are reached only through the
// scale-out transport: node barrier (load/store), rail barrier (one signal to the same-rail rank
// of every other node), node barrier again. After the third step every rank of the group has
// entered the first, so no rank still uses what the operation after the barrier overwrites.
// Bytes that cross nodes are covered by their own signals, so the barrier carries no data.
#pragma once

#include "common/device_view.hpp"
#include "kernels/barrier.cuh"
#include "kernels/scaleout.cuh"

namespace deep_ep {

// The barrier of the buffer's topology (DeviceView: nodes of num_scaleup_ranks ranks): rank_barrier
// with one node, the three steps above with several. Called by every thread of one CTA (the CTA's
// threads form the transport group: named barrier 1).
__device__ __forceinline__ bool topology_barrier(const DeviceView& view, Operation operation,
                                                 bool input_failed = false) {
  const int scaleup = view.num_scaleup_ranks;
  const int num_nodes = view.num_ranks / scaleup;
  if (num_nodes <= 1) return rank_barrier(view, operation, input_failed);
  const int node = view.rank / scaleup;
  const int first = node * scaleup;
  const auto rail_peer = [&](int other) { return other * scaleup + view.rank % scaleup; };
  // The announcement of a failed input reaches every load/store peer here; peers of other nodes
  // collect it after the last step (causally after this rank's release in the first).
  if (!group_barrier(view, operation, first, scaleup, input_failed)) return false;

  __shared__ int failed_shared;
  if (threadIdx.x == 0) failed_shared = 0;
  const scaleout::WarpGroup group{1, static_cast<int>(blockDim.x), static_cast<int>(threadIdx.x)};
  scaleout::Transport transport(view, nullptr);
  for (int other = 0; other < num_nodes; ++other) {
    if (other != node) transport.signal(group, rail_peer(other), kSignalBarrier + node, 1);
  }
  for (int other = threadIdx.x; other < num_nodes; other += blockDim.x) {
    if (other == node) continue;
    const int id = kSignalBarrier + other;
    if (scaleout::wait_signal(view, transport, operation, Phase::kScaleoutBarrier, rail_peer(other), id, 1)) {
      scaleout::advance_shadow(view, id, 1);
    } else {
      atomicExch(&failed_shared, 1);
    }
  }
  __syncthreads();
  if (failed_shared != 0) return false;
  if (!group_barrier(view, operation, first, scaleup)) return false;
  for (int peer = threadIdx.x; peer < view.num_ranks; peer += blockDim.x) {
    if (peer / scaleup != node && view.peer_bases[peer] != nullptr) collect_input_failed(view, operation, peer);
  }
  __syncthreads();
  return true;
}

}  // namespace deep_ep
