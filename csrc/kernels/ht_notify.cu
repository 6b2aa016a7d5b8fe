// HT notify (uncached dispatch): slots by prefix, then the count exchange.
//
// 1. Per block of 32 tokens (one warp), shared-memory bitmaps give every (token, expert) and every
//    (token, destination rank) its ordinal inside the block and the block's counts.
// 2. Per column (expert or rank), an exclusive scan over blocks turns counts into block bases; the
//    last row of the scratch holds this rank's totals.
// 3. Bases are added to the in-block ordinals: expert_slot / dst_slot are then ranks among this
//    rank's tokens in token order (no atomics, so the receive order is (source, token)).
// CTA 0 meanwhile exchanges counts through the workspace cells ("count + 1", 0 = not arrived; in
// direct mode with no entry barrier: the exchange is the gate, see exchange_counts), resets the
// cells it consumed, and writes the handle's counts and, for a CPU sync, the host-mapped counters
// with the ready cell last. The other CTAs add the bases (step 1 already wrote the handle's
// sanitised copy of topk_idx).
//
// Hybrid mode adds one column per node (a token counts once per node holding one of its experts:
// node_slot = its row in the scale-out stream to that node) and sends the counts for another
// node's ranks as one message to the same-rail rank there (scale-out transport). That rank, the
// forwarder, publishes them into its node-mates' count cells exactly as a direct sender would, and
// keeps the message's per-channel row prefix for the dispatch forwarder (handle: forward_prefix).
#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/require.hpp"
#include "kernels/barrier.cuh"
#include "kernels/high_throughput.hpp"
#include "kernels/ht_common.cuh"
#include "kernels/phase_clock.cuh"
#include "kernels/preload.hpp"
#include "kernels/routing.cuh"
#include "kernels/topology_barrier.cuh"

namespace deep_ep::ht {
namespace {

constexpr int kNotifyThreads = 256;
constexpr int kNotifyWarps = kNotifyThreads / 32;
static_assert(kNotifyTokensPerBlock == 32, "one token per lane");

// Row stride (ints) of a warp's staged expert ids: odd, so that lane t reading entry k of its own
// row (t * stride + k) hits 32 different banks.
__host__ __device__ constexpr int staged_id_stride(int num_topk) { return num_topk | 1; }

// Phase 1 needs one bitmap word per (warp, column) plus each warp's staged ids (32 tokens x
// stride); the exchange needs [R] + [E] + 2 x [L] ints.
size_t notify_smem_bytes(const HtCall& call) {
  const int64_t phase1 =
      int64_t{kNotifyWarps} * (notify_columns(call) + kNotifyTokensPerBlock * staged_id_stride(call.num_topk));
  const int64_t exchange = call.num_ranks() + call.num_experts + 2 * call.num_local_experts();
  return sizeof(int32_t) * static_cast<size_t>(std::max(phase1, exchange));
}

// A block's routing into the warp's staged ids (`ids`: 32 rows of `stride` ints, row = token of
// the block), sanitised as routed_expert() would: an id outside [-1, E) is recorded and becomes -1,
// a repeat of an earlier id in the same row is recorded and becomes -1. The rows are read with
// coalesced loads (the block's T x K entries are contiguous), several in flight per lane, instead
// of each lane walking its own row entry by entry (strided, one round trip after the other).
// Also writes the handle's sanitised copy of the routing. Called by all 32 lanes.
__device__ void stage_block_ids(const NotifyArgs& args, int block, int32_t* ids, int stride) {
  constexpr int kLoadsInFlight = 8;
  const int lane = lane_id();
  const int num_topk = args.call.num_topk;
  const int num_experts = args.call.num_experts;
  const int64_t first_entry = int64_t{block} * kNotifyTokensPerBlock * num_topk;
  const int num_entries = min(kNotifyTokensPerBlock, args.num_tokens - block * kNotifyTokensPerBlock) * num_topk;
  for (int first = 0; first < num_entries; first += 32 * kLoadsInFlight) {
    int64_t raw[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int i = first + u * 32 + lane;
      raw[u] = i < num_entries ? __ldg(args.topk_idx + first_entry + i) : -1;
    }
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u) {
      const int i = first + u * 32 + lane;
      if (i >= num_entries) continue;
      const int token = block * kNotifyTokensPerBlock + i / num_topk;
      if (raw[u] < -1 || raw[u] >= num_experts) {
        record_invalid_expert(args.view, Operation::kHtNotify, InvalidExpertKind::kOutOfRange, raw[u], num_experts,
                              token);
        raw[u] = -1;
      }
      ids[(i / num_topk) * stride + i % num_topk] = static_cast<int32_t>(raw[u]);
    }
  }
  __syncwarp();
  if (lane * num_topk < num_entries) {
    int32_t* row = ids + lane * stride;
    for (int k = 1; k < num_topk; ++k) {
      const int32_t expert = row[k];
      if (expert < 0) continue;
      for (int earlier = 0; earlier < k; ++earlier) {
        if (row[earlier] == expert) {
          record_invalid_expert(args.view, Operation::kHtNotify, InvalidExpertKind::kDuplicate, expert, num_experts,
                                block * kNotifyTokensPerBlock + lane);
          row[k] = -1;
          break;
        }
      }
    }
  }
  __syncwarp();
  // Every later kernel (dispatch, cached dispatch, combine) reads this copy: all agree that a bad
  // or repeated entry is -1, and the caller may reuse topk_idx.
  for (int i = lane; i < num_entries; i += 32) {
    args.topk_idx_copy[first_entry + i] = ids[(i / num_topk) * stride + i % num_topk];
  }
}

__device__ void count_blocks(const NotifyArgs& args, uint32_t* smem, int num_blocks, int num_columns) {
  const int lane = lane_id();
  const int warp = static_cast<int>(threadIdx.x / 32);
  const HtCall& call = args.call;
  const int num_experts = call.num_experts;
  const int num_local = call.num_local_experts();
  const int num_topk = call.num_topk;
  const int num_nodes = call.hybrid() ? call.num_nodes() : 0;
  const int stride = staged_id_stride(num_topk);
  uint32_t* expert_bits = smem + warp * num_columns;  // bit = lane (token) of the block
  uint32_t* rank_bits = expert_bits + num_experts;
  uint32_t* node_bits = rank_bits + call.num_ranks();
  int32_t* ids = reinterpret_cast<int32_t*>(smem + kNotifyWarps * num_columns) + warp * kNotifyTokensPerBlock * stride;
  int32_t* my_ids = ids + lane * stride;
  const uint32_t my_bit = 1u << lane;
  const uint32_t lower_lanes = my_bit - 1u;
  for (int block = blockIdx.x * kNotifyWarps + warp; block < num_blocks; block += gridDim.x * kNotifyWarps) {
    for (int column = lane; column < num_columns; column += 32) expert_bits[column] = 0;
    stage_block_ids(args, block, ids, stride);  // its __syncwarp also orders the zeroing
    const int token = block * kNotifyTokensPerBlock + lane;
    const bool has_token = token < args.num_tokens;
    uint32_t first_of_rank = 0;  // bit k: entry k is the token's first on its rank
    if (has_token) {
      for (int k = 0; k < num_topk; ++k) {
        const int expert = my_ids[k];
        if (expert < 0) continue;
        atomicOr(&expert_bits[expert], my_bit);
        // Only this lane sets its bit, so the old value says whether an earlier k hit this rank.
        if ((atomicOr(&rank_bits[expert / num_local], my_bit) & my_bit) == 0) first_of_rank |= 1u << k;
        if (num_nodes > 0) atomicOr(&node_bits[call.node_of(expert / num_local)], my_bit);
      }
    }
    __syncwarp();
    int32_t* block_row = args.scratch + int64_t{block} * num_columns;
    for (int column = lane; column < num_columns; column += 32) block_row[column] = __popc(expert_bits[column]);
    if (has_token) {
      for (int k = 0; k < num_topk; ++k) {
        const int64_t entry = int64_t{token} * num_topk + k;
        const int expert = my_ids[k];
        args.expert_slot[entry] = expert >= 0 ? __popc(expert_bits[expert] & lower_lanes) : -1;
        args.dst_slot[entry] =
            ((first_of_rank >> k) & 1u) != 0 ? __popc(rank_bits[expert / num_local] & lower_lanes) : -1;
      }
      for (int node = 0; node < num_nodes; ++node) {
        const uint32_t bits = node_bits[node];
        args.hybrid.node_slot[int64_t{token} * num_nodes + node] =
            (bits & my_bit) != 0 ? __popc(bits & lower_lanes) : -1;
      }
    }
    __syncwarp();
  }
}

// Exclusive scan over blocks, in place, one column per warp; totals go to row num_blocks. The loads
// of up to kScanRounds rounds of 32 blocks, for kScanColumns columns of the warp, are issued before
// the first is scanned: one load after the other was an L2 round trip each, in series (at 8 ranks
// of 8 SMs a warp has 4 to 5 columns).
constexpr int kScanRounds = 8;
constexpr int kScanColumns = 2;

__device__ void scan_columns(const NotifyArgs& args, int num_blocks, int num_columns) {
  const int lane = lane_id();
  const int warp = static_cast<int>(blockIdx.x * kNotifyWarps + threadIdx.x / 32);
  const int num_warps = static_cast<int>(gridDim.x) * kNotifyWarps;
  for (int first_column = warp; first_column < num_columns; first_column += num_warps * kScanColumns) {
    int running[kScanColumns] = {};
    for (int first = 0; first < num_blocks; first += 32 * kScanRounds) {
      int values[kScanColumns][kScanRounds];
#pragma unroll
      for (int c = 0; c < kScanColumns; ++c) {
        const int column = first_column + c * num_warps;
#pragma unroll
        for (int round = 0; round < kScanRounds; ++round) {
          const int block = first + round * 32 + lane;
          // Written by other CTAs before the grid sync: read through L2.
          values[c][round] = column < num_columns && block < num_blocks
                                 ? __ldcg(args.scratch + int64_t{block} * num_columns + column)
                                 : 0;
        }
      }
#pragma unroll
      for (int c = 0; c < kScanColumns; ++c) {
        const int column = first_column + c * num_warps;
        if (column >= num_columns) break;  // warp-uniform
#pragma unroll
        for (int round = 0; round < kScanRounds; ++round) {
          if (first + round * 32 >= num_blocks) break;  // warp-uniform
          const int block = first + round * 32 + lane;
          const int inclusive = warp_inclusive_sum(values[c][round]);
          if (block < num_blocks)
            args.scratch[int64_t{block} * num_columns + column] = running[c] + inclusive - values[c][round];
          running[c] += __shfl_sync(kFullMask, inclusive, 31);
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kScanColumns; ++c) {
      const int column = first_column + c * num_warps;
      if (lane == 0 && column < num_columns) args.scratch[int64_t{num_blocks} * num_columns + column] = running[c];
    }
  }
}

__device__ void add_block_bases(const NotifyArgs& args, int num_columns, int64_t first_thread, int64_t num_threads) {
  const HtCall& call = args.call;
  const int num_experts = call.num_experts;
  const int num_local = call.num_local_experts();
  const int num_topk = call.num_topk;
  const int64_t num_entries = int64_t{args.num_tokens} * num_topk;
  // kBaseEntries entries per thread at a time, every load of the batch issued before its first
  // store (entry by entry, each one's loads waited for the previous one's stores). 16 instead of 4
  // made no difference at 2 or 8 ranks on one H200.
  constexpr int kBaseEntries = 4;
  for (int64_t first = first_thread; first < num_entries; first += num_threads * kBaseEntries) {
    int expert[kBaseEntries];
    int32_t expert_slot[kBaseEntries];
    int32_t dst_slot[kBaseEntries];
#pragma unroll
    for (int b = 0; b < kBaseEntries; ++b) {
      const int64_t entry = first + b * num_threads;
      expert[b] = -1;
      if (entry >= num_entries) continue;
      // The routing as count_blocks sanitised it (it also wrote the handle's copy).
      expert[b] =
          routed_expert(args.topk_idx, num_topk, entry / num_topk, static_cast<int>(entry % num_topk), num_experts);
      expert_slot[b] = __ldcg(args.expert_slot + entry);
      dst_slot[b] = __ldcg(args.dst_slot + entry);
    }
#pragma unroll
    for (int b = 0; b < kBaseEntries; ++b) {
      const int64_t entry = first + b * num_threads;
      if (expert[b] < 0) continue;
      const int32_t* bases = args.scratch + entry / num_topk / kNotifyTokensPerBlock * num_columns;
      expert_slot[b] += __ldcg(bases + expert[b]);
      if (dst_slot[b] >= 0) dst_slot[b] += __ldcg(bases + num_experts + expert[b] / num_local);
    }
#pragma unroll
    for (int b = 0; b < kBaseEntries; ++b) {
      const int64_t entry = first + b * num_threads;
      if (expert[b] < 0) continue;
      args.expert_slot[entry] = expert_slot[b];
      if (dst_slot[b] >= 0) args.dst_slot[entry] = dst_slot[b];
    }
  }
  if (!call.hybrid()) return;
  const int num_nodes = call.num_nodes();
  const int64_t node_column = num_experts + call.num_ranks();
  for (int64_t item = first_thread; item < int64_t{args.num_tokens} * num_nodes; item += num_threads) {
    const int32_t slot = __ldcg(args.hybrid.node_slot + item);
    if (slot < 0) continue;
    const int64_t block = item / num_nodes / kNotifyTokensPerBlock;
    args.hybrid.node_slot[item] = slot + __ldcg(args.scratch + block * num_columns + node_column + item % num_nodes);
  }
}

// Hybrid mode, CTA 0 after the entry barrier: the counts for other nodes' ranks travel as one
// message per node to the same-rail rank there; the messages this rank receives as forwarder are
// published into its node-mates' cells. Message to node m: [S rank counts][S x L expert counts]
// [C + 1 row prefix of the scale-out stream to m, per channel]. Returns false on a timeout.
__device__ bool exchange_scaleout_counts(const NotifyArgs& args, const int32_t* totals, int num_columns,
                                         int num_blocks) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const int node = call.node_of(view.rank);
  const int num_nodes = call.num_nodes();
  const int scaleup = call.ranks_per_node();
  const int num_local = call.num_local_experts();
  const int num_channels = args.hybrid.num_channels;
  const int64_t message_ints = align_up(notify_message_ints(scaleup, num_local, num_channels), 4);
  const int64_t node_column = call.num_experts + call.num_ranks();
  const int64_t blocks_per_channel = channel_tokens(args.num_tokens, num_channels) / kNotifyTokensPerBlock;
  int32_t* outbox = view.local<int32_t>(WorkspaceLayout::notify_send_offset);
  const int32_t* inbox = view.local<int32_t>(WorkspaceLayout::notify_recv_offset);

  for (int m = 0; m < num_nodes; ++m) {
    if (threadIdx.x == 0) args.hybrid.node_counts[m] = __ldcg(totals + node_column + m);
    if (m == node) continue;
    int32_t* message = outbox + m * message_ints;
    for (int j = threadIdx.x; j < scaleup; j += blockDim.x)
      message[j] = __ldcg(totals + call.num_experts + m * scaleup + j);
    for (int index = threadIdx.x; index < scaleup * num_local; index += blockDim.x) {
      message[scaleup + index] = __ldcg(totals + int64_t{m} * scaleup * num_local + index);
    }
    for (int channel = threadIdx.x; channel <= num_channels; channel += blockDim.x) {
      const int64_t block = min(int64_t{channel} * blocks_per_channel, int64_t{num_blocks});
      message[scaleup + scaleup * num_local + channel] = __ldcg(args.scratch + block * num_columns + node_column + m);
    }
  }
  __syncthreads();

  __shared__ scaleout::DeferredQueue queue;
  const scaleout::WarpGroup group{1, static_cast<int>(blockDim.x), static_cast<int>(threadIdx.x)};
  scaleout::Transport transport(view, &queue);
  transport.init(group);
  group.sync();
  for (int m = 0; m < num_nodes; ++m) {
    if (m == node) continue;
    const int peer = call.rail_peer(view.rank, m);
    if (threadIdx.x < 32) {
      transport.put(peer, WorkspaceLayout::notify_recv_offset + 4 * node * message_ints,
                    WorkspaceLayout::notify_send_offset + 4 * m * message_ints, 4 * message_ints);
    }
    transport.signal(group, peer, kSignalNotify + node, 1);
  }
  transport.flush(group);

  // One thread per source node waits for its message; then the whole CTA republishes the arrived
  // messages into the node-mates' count cells as a direct sender would: every expert cell (spread
  // over the threads), one system fence, and after the __syncthreads the rank cells that announce
  // them (release). Serially in one thread per node this was L remote stores and a fence per rank.
  __shared__ int failed;
  __shared__ bool arrived[kMaxNodes];
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int m = threadIdx.x; m < num_nodes; m += blockDim.x) {
    arrived[m] = false;
    if (m == node) continue;
    const int source = call.rail_peer(view.rank, m);
    const int id = kSignalNotify + m;
    if (!scaleout::wait_signal(view, transport, Operation::kHtNotify, Phase::kScaleoutCountsArrive, source, id, 1)) {
      failed = 1;
      continue;
    }
    scaleout::advance_shadow(view, id, 1);
    arrived[m] = true;
  }
  __syncthreads();
  const int64_t expert_cells = int64_t{scaleup} * num_local;
  for (int64_t index = threadIdx.x; index < num_nodes * expert_cells; index += blockDim.x) {
    const int m = static_cast<int>(index / expert_cells);
    if (!arrived[m]) continue;
    const int j = static_cast<int>(index % expert_cells / num_local);
    const int local = static_cast<int>(index % num_local);
    const int source = call.rail_peer(view.rank, m);
    const int32_t* message = inbox + m * message_ints;
    const int64_t cell = WorkspaceLayout::expert_counts_offset + 4 * (int64_t{source} * num_local + local);
    ptx::st_relaxed_sys(view.peer<int32_t>(node * scaleup + j, cell), message[scaleup + j * num_local + local] + 1);
  }
  ptx::fence_acq_rel_sys();
  __syncthreads();
  for (int index = threadIdx.x; index < num_nodes * scaleup; index += blockDim.x) {
    const int m = index / scaleup;
    if (!arrived[m]) continue;
    const int j = index % scaleup;
    const int source = call.rail_peer(view.rank, m);
    const int32_t* message = inbox + m * message_ints;
    ptx::st_release_sys(
        view.peer<int32_t>(node * scaleup + j, WorkspaceLayout::rank_counts_offset + 4 * int64_t{source}),
        message[j] + 1);
  }
  for (int index = threadIdx.x; index < num_nodes * (num_channels + 1); index += blockDim.x) {
    const int m = index / (num_channels + 1);
    if (arrived[m]) {
      args.hybrid.forward_prefix[index] =
          inbox[m * message_ints + scaleup + scaleup * num_local + index % (num_channels + 1)];
    }
  }
  __syncthreads();
  return failed == 0;
}

// CTA 0: waits for this rank's "value + 1" cell from a peer (0 = not arrived), returns the value and
// clears the cell (workspace invariant). Acquire: what the peer stored before releasing the cell
// (its expert count cells) is visible after it. Returns false on a timeout (recorded).
__device__ bool take_count_cell(const DeviceView& view, Phase phase, int peer, int64_t offset, int32_t& value) {
  int32_t* cell = view.local<int32_t>(offset + 4 * int64_t{peer});
  const bool arrived = wait_until(view, Operation::kHtNotify, phase, peer, 1, [&](int64_t& seen) {
    value = ptx::ld_acquire_sys(cell);
    seen = value;
    return value != 0;
  });
  if (!arrived) return false;
  value -= 1;
  ptx::st_relaxed_sys(cell, 0);
  return true;
}

// CTA 0, zero-copy receive, once every source's count has arrived: each source learns where its
// rows start among this rank's final rows (the rows of all lower sources), so its dispatch kernel
// writes them in final position. Cells hold "row + 1" (0 = not arrived) and are cleared on read:
// a receiver writes the next value only after the source's counts of the next operation arrived,
// i.e. after the source finished this notify. Returns false on a timeout.
__device__ bool exchange_send_bases(const NotifyArgs& args, const int32_t* recv_per_source) {
  const DeviceView& view = args.view;
  const int num_ranks = view.num_ranks;
  for (int source = threadIdx.x; source < num_ranks; source += blockDim.x) {
    int32_t base = 0;
    for (int lower = 0; lower < source; ++lower) base += recv_per_source[lower];
    ptx::st_relaxed_sys(view.peer<int32_t>(source, WorkspaceLayout::send_base_offset + 4 * int64_t{view.rank}),
                        base + 1);
  }
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int dest = threadIdx.x; dest < num_ranks; dest += blockDim.x) {
    int32_t value = 0;
    if (take_count_cell(view, Phase::kSendBaseArrive, dest, WorkspaceLayout::send_base_offset, value)) {
      args.send_base[dest] = value;
    } else {
      failed = 1;
    }
  }
  __syncthreads();
  return failed == 0;
}

// CTA 0. Returns false on a timeout (recorded; the host sees it).
__device__ bool exchange_counts(const NotifyArgs& args, const int32_t* totals, int num_columns, int num_blocks,
                                int32_t* recv_per_source, int32_t* per_source_expert) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const int num_ranks = view.num_ranks;
  const int num_experts = call.num_experts;
  const int num_local = call.num_local_experts();
  // Direct: every rank is a destination here. Hybrid: the ranks of this node; the others get
  // theirs through the scale-out message.
  const int first_dest = call.hybrid() ? call.node_of(view.rank) * call.ranks_per_node() : 0;
  const int num_dests = call.hybrid() ? call.ranks_per_node() : num_ranks;
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  if (call.hybrid()) {
    // The scale-out count messages and the forwarders' republishing need every node past the
    // previous operation first.
    if (!topology_barrier(view, Operation::kHtNotify, args.input_failed)) return false;
  } else if (args.input_failed) {
    // Direct mode has no entry barrier (below): the announcement goes out before the rank cells
    // that release this rank's counts, and each receiver collects it after acquiring them.
    announce_input_failed(view);
  }
  // Direct mode needs no entry barrier: the count exchange is the gate. A peer's rank cell of this
  // operation arrives only once that peer has started this notify, i.e. finished everything it
  // queued before on its stream (its epilogue's and combine's reads of its window), so the dispatch
  // kernel, which runs after this exchange, writes into no window a peer still reads. The cells
  // themselves are free when written: a sender reaches its next notify only after the exit barrier
  // of this operation's dispatch kernel, which a receiver enters only after it consumed (and
  // cleared) this operation's cells.

  // Expert counts first; the rank count, released after them, announces that all of them landed.
  for (int index = threadIdx.x; index < num_dests * num_local; index += blockDim.x) {
    const int expert = first_dest * num_local + index;
    const int dest = expert / num_local;
    const int64_t cell =
        WorkspaceLayout::expert_counts_offset + 4 * (int64_t{view.rank} * num_local + expert % num_local);
    ptx::st_relaxed_sys(view.peer<int32_t>(dest, cell), __ldcg(totals + expert) + 1);
  }
  // No fence of our own: each release store below is cumulative over the CTA's expert-count
  // stores, which the __syncthreads orders before it.
  __syncthreads();
  for (int dest = first_dest + threadIdx.x; dest < first_dest + num_dests; dest += blockDim.x) {
    ptx::st_release_sys(view.peer<int32_t>(dest, WorkspaceLayout::rank_counts_offset + 4 * int64_t{view.rank}),
                        __ldcg(totals + num_experts + dest) + 1);
  }
  clock_phase(view, ClockedKernel::kHtNotify, 3);
  if (call.hybrid() && !exchange_scaleout_counts(args, totals, num_columns, num_blocks)) return false;

  for (int source = threadIdx.x; source < num_ranks; source += blockDim.x) {
    // The cell is cleared on read; the source writes it again only in its next notify, after this
    // operation's dispatch exit barrier.
    if (!take_count_cell(view, Phase::kCountsArrive, source, WorkspaceLayout::rank_counts_offset,
                         recv_per_source[source])) {
      failed = 1;
      continue;
    }
    if (!call.hybrid()) collect_input_failed(view, Operation::kHtNotify, source);
  }
  __syncthreads();
  clock_phase(view, ClockedKernel::kHtNotify, 4);
  if (failed != 0) return false;
  // Every source's expert cells were released before its rank cell, which some thread of this
  // CTA acquired before the __syncthreads above.
  for (int index = threadIdx.x; index < num_experts; index += blockDim.x) {
    int32_t* cell = view.local<int32_t>(WorkspaceLayout::expert_counts_offset + 4 * int64_t{index});
    per_source_expert[index] = ptx::ld_relaxed_sys(cell) - 1;
    ptx::st_relaxed_sys(cell, 0);
  }
  __syncthreads();
  return args.send_base == nullptr || exchange_send_bases(args, recv_per_source);
}

// CTA 0, after the exchange: the handle's counts and the host-mapped copy.
__device__ void write_counts(const NotifyArgs& args, const int32_t* recv_per_source, const int32_t* per_source_expert,
                             int32_t* unaligned, int32_t* aligned) {
  const int num_ranks = args.view.num_ranks;
  const int num_local = args.call.num_local_experts();
  const int alignment = args.expert_alignment;
  const CountsLayout layout = counts_layout(num_ranks, num_local);
  int32_t* counts = args.counts;
  int32_t* mapped = args.mapped_counters;
  const int lane = lane_id();
  const int warp = static_cast<int>(threadIdx.x / 32);

  for (int local = threadIdx.x; local < num_local; local += blockDim.x) {
    int running = 0;
    for (int source = 0; source < num_ranks; ++source) {
      counts[layout.expert_offsets + source * num_local + local] = running;
      running += per_source_expert[source * num_local + local];
    }
    counts[layout.unaligned_per_expert + local] = running;
    unaligned[local] = running;
    aligned[local] = static_cast<int32_t>(align_up(running, alignment));
  }
  __syncthreads();
  if (warp == 0) {
    int running = 0;
    for (int first = 0; first < num_ranks; first += 32) {
      const int source = first + lane;
      const int value = source < num_ranks ? recv_per_source[source] : 0;
      const int inclusive = running + warp_inclusive_sum(value);
      if (source < num_ranks) {
        counts[layout.recv_per_source + source] = value;
        counts[layout.psum_per_source + source] = inclusive;
      }
      running = __shfl_sync(kFullMask, inclusive, 31);
    }
    if (mapped != nullptr && lane == 0) mapped[kMappedNumRecvTokens] = running;
  } else if (warp == 1) {
    int running = 0;
    for (int first = 0; first < num_local; first += 32) {
      const int local = first + lane;
      const int value = local < num_local ? aligned[local] : 0;
      const int inclusive = running + warp_inclusive_sum(value);
      if (local < num_local) {
        const int start = inclusive - value;
        counts[layout.expert_start + local] = start;
        // DeepEP's meaning: expand rows of expert l are [start, psum[l]); non-expand, the aligned psum.
        counts[layout.psum_per_expert + local] = args.do_expand ? start + unaligned[local] : inclusive;
      }
      running = __shfl_sync(kFullMask, inclusive, 31);
    }
    if (mapped != nullptr && lane == 0) mapped[kMappedNumExpandedTokens] = running;
  }
  if (mapped == nullptr) return;
  for (int local = threadIdx.x; local < num_local; local += blockDim.x) {
    mapped[kMappedAlignedExpertCounts + local] = aligned[local];
  }
  __syncthreads();
  // The release is cumulative over the CTA's mapped stores (ordered before it by the barrier).
  if (threadIdx.x == 0) ptx::st_release_sys(mapped + kMappedReady, 1);
}

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(const NotifyArgs args) {
  extern __shared__ int32_t smem[];
  const int num_experts = args.call.num_experts;
  const int num_ranks = args.view.num_ranks;
  const int num_columns = notify_columns(args.call);
  const int num_blocks = (args.num_tokens + kNotifyTokensPerBlock - 1) / kNotifyTokensPerBlock;

  clock_phase(args.view, ClockedKernel::kHtNotify, 0);
  count_blocks(args, reinterpret_cast<uint32_t*>(smem), num_blocks, num_columns);
  if (!grid_sync(args.view, Operation::kHtNotify, kGridSlotNotify)) return;
  clock_phase(args.view, ClockedKernel::kHtNotify, 1);
  scan_columns(args, num_blocks, num_columns);
  if (!grid_sync(args.view, Operation::kHtNotify, kGridSlotNotify)) return;
  clock_phase(args.view, ClockedKernel::kHtNotify, 2);

  if (blockIdx.x == 0) {
    const int num_local = num_experts / num_ranks;
    int32_t* recv_per_source = smem;
    int32_t* per_source_expert = recv_per_source + num_ranks;
    int32_t* unaligned = per_source_expert + num_experts;
    int32_t* aligned = unaligned + num_local;
    const int32_t* totals = args.scratch + int64_t{num_blocks} * num_columns;
    if (exchange_counts(args, totals, num_columns, num_blocks, recv_per_source, per_source_expert)) {
      if (args.send_base != nullptr) clock_phase(args.view, ClockedKernel::kHtNotify, 5);
      write_counts(args, recv_per_source, per_source_expert, unaligned, aligned);
      clock_phase(args.view, ClockedKernel::kHtNotify, 6);
    }
    if (gridDim.x > 1) return;
  }
  // CTA 0 is busy with the exchange when there are others.
  const int64_t helpers = gridDim.x > 1 ? gridDim.x - 1 : 1;
  const int64_t helper = gridDim.x > 1 ? blockIdx.x - 1 : 0;
  add_block_bases(args, num_columns, helper * blockDim.x + threadIdx.x, helpers * blockDim.x);
  clock_phase(args.view, ClockedKernel::kHtNotify, 7);
}

}  // namespace

void launch_notify(const NotifyArgs& args, cudaStream_t stream) {
  check_ht_grid_size(args.view, "num_sms", args.num_sms);
  check_call(args.view, args.call);
  EP_REQUIRE(args.num_tokens == 0 || args.topk_idx_copy != nullptr, "the notify kernel needs topk_idx_copy");
  EP_REQUIRE(args.expert_alignment >= 1, "expert_alignment must be >= 1, got " + std::to_string(args.expert_alignment));
  EP_REQUIRE(args.call.num_local_experts() + kMappedAlignedExpertCounts <= kMappedReady,
             "too many local experts for the host-mapped counters");
  check_hybrid_routing(args.call, args.hybrid, args.num_tokens);
  EP_REQUIRE(args.call.zero_copy_recv == (args.send_base != nullptr),
             "a notify for zero-copy receive needs send_base (and only such a notify takes one)");
  const size_t smem = notify_smem_bytes(args.call);
  // Up to 48 KiB of dynamic shared memory needs no opt-in; the attribute call costs host time on
  // every launch, so it is made only for the large-E shapes that need it.
  if (static_cast<int64_t>(smem) > kDefaultDynamicSharedBytes) {
    EP_CUDA_CHECK(
        cudaFuncSetAttribute(notify_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  notify_kernel<<<args.num_sms, kNotifyThreads, smem, stream>>>(args);
  EP_CHECK_LAUNCH("ht notify_kernel");
}

void preload_ht_notify_kernels() { preload_kernel(notify_kernel, "ht notify"); }

}  // namespace deep_ep::ht
