// HT notify (uncached dispatch): slots by prefix, then the count exchange.
//
// CTA c owns a contiguous range of 32-token blocks (BlockRange), so the prefix over tokens needs
// one grid sync, not one per step:
// 1. Per block (one warp), shared-memory bitmaps give every (token, expert) and every (token,
//    destination rank) its ordinal inside the block and the block's counts (a scratch row).
// 2. Per column (expert or rank), each CTA scans its own blocks' rows: a row becomes the block's
//    exclusive prefix inside the CTA, except the CTA's first row (whose prefix is 0), which takes
//    the CTA's aggregate instead. One grid sync, with no system fence (only local memory so far).
// 3. Each CTA sums its predecessors' aggregates per column (its base) and adds base + row to the
//    in-block ordinals of its own blocks: expert_slot / dst_slot are then ranks among this rank's
//    tokens in token order (ordinals without atomics, so the receive order is (source, token)).
// CTA 0 (base 0) takes the totals instead (every CTA added its aggregate into workspace cells before
// the grid sync; CTA 0 reads and clears them), exchanges counts through the
// workspace cells ("count + 1", 0 = not arrived; in direct mode with no entry barrier: the
// exchange is the gate, see exchange_counts), resets the cells it consumed, and writes the handle's
// counts and, for a CPU sync, the host-mapped counters with the ready cell last; in direct mode it
// then builds V1's rank prefix matrix from the send-count rows every source left in its own window
// before releasing its cells (write_rank_prefix_matrix). The other CTAs
// share CTA 0's step 3 (a lone CTA 0 does it while the peers' counts travel). Step 1 also writes
// the handle's sanitised copy of topk_idx.
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
#include "common/fast_divisor.hpp"
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

// The notify's grid: a CTA per kNotifyWarps blocks (one block per warp), at most num_sms, at least
// two where num_sms allows. Fewer CTAs than SMs at small T: fewer aggregates to sum after the sync.
// At least two: a lone CTA 0 adds its own tokens' bases between its count sends and its wait, on
// the path to the counts (measured slower at 2 ranks, T = 256).
int notify_grid_size(int num_sms, int64_t num_tokens) {
  const int64_t ctas = std::max<int64_t>((notify_blocks(num_tokens) + kNotifyWarps - 1) / kNotifyWarps, 2);
  return static_cast<int>(std::clamp<int64_t>(ctas, 1, num_sms));
}

// CTA c owns blocks [first(c), end(c)); CTAs from num_active() on own none.
struct BlockRange {
  int num_blocks;
  int per_cta;  // >= 1
  __device__ int first(int cta) const { return min(cta * per_cta, num_blocks); }
  __device__ int end(int cta) const { return min((cta + 1) * per_cta, num_blocks); }
  __device__ int owner(int block) const { return block / per_cta; }
  __device__ int num_active() const { return (num_blocks + per_cta - 1) / per_cta; }
};

__device__ BlockRange block_range(const NotifyArgs& args) {
  const int num_blocks = static_cast<int>(notify_blocks(args.num_tokens));
  const int grid = static_cast<int>(gridDim.x);
  return {num_blocks, max(1, (num_blocks + grid - 1) / grid)};
}

// The scratch: one row of num_columns ints per block, then the totals row. A block's row holds its
// counts, then (step 2) its exclusive prefix inside its CTA; a CTA's first row holds the CTA's
// aggregate instead.
__device__ __forceinline__ int32_t* scratch_row(const NotifyArgs& args, int64_t block, int num_columns) {
  return args.scratch + block * num_columns;
}
__device__ __forceinline__ int32_t* aggregate_row(const NotifyArgs& args, const BlockRange& range, int cta,
                                                  int num_columns) {
  return scratch_row(args, range.first(cta), num_columns);
}
__device__ __forceinline__ int32_t* totals_row(const NotifyArgs& args, const BlockRange& range, int num_columns) {
  return scratch_row(args, range.num_blocks, num_columns);
}
// The workspace's totals cells (zero between notifies): every CTA adds its aggregate before the grid
// sync, so CTA 0 reads the totals in one round of loads instead of summing every CTA's aggregate.
__device__ __forceinline__ int32_t* totals_cells(const NotifyArgs& args) {
  return args.view.local<int32_t>(WorkspaceLayout::notify_totals_offset);
}

// Phase 1 needs one bitmap word per (warp, column) plus each warp's staged ids (32 tokens x
// stride); the exchange needs [R] + [E] ints and the totals row.
size_t notify_smem_bytes(const HtCall& call) {
  const int64_t phase1 =
      int64_t{kNotifyWarps} * (notify_columns(call) + kNotifyTokensPerBlock * staged_id_stride(call.num_topk));
  const int64_t exchange = call.num_ranks() + call.num_experts + notify_columns(call);
  return sizeof(int32_t) * static_cast<size_t>(std::max(phase1, exchange));
}

// A block's routing entries: [first, first + count) of the [T, K] arrays (32 tokens, fewer in the last block).
struct BlockEntries {
  int64_t first;
  int count;
};
__device__ __forceinline__ BlockEntries block_entries(const NotifyArgs& args, int block) {
  const int num_topk = args.call.num_topk;
  return {int64_t{block} * kNotifyTokensPerBlock * num_topk,
          min(kNotifyTokensPerBlock, args.num_tokens - block * kNotifyTokensPerBlock) * num_topk};
}

// Entry i of a block's staged rows (32 rows of `stride` ints, one row of num_topk entries per token).
__device__ __forceinline__ int staged_entry(const NotifyArgs& args, int i, int stride) {
  const int row = args.by_topk.quotient(i);
  return row * stride + i - row * args.call.num_topk;
}

// A block's routing into the warp's staged ids (`ids`: 32 rows of `stride` ints, row = token of
// the block); an id outside [-1, E) is recorded and becomes -1 (count_blocks then turns a repeat of
// an earlier id in the same row into -1, as routed_expert() does). The rows are read with
// coalesced loads (the block's T x K entries are contiguous), several in flight per lane, instead
// of each lane walking its own row entry by entry (strided, one round trip after the other).
// Called by all 32 lanes.
__device__ void stage_block_ids(const NotifyArgs& args, int block, int32_t* ids, int stride, bool stamp) {
  constexpr int kLoadsInFlight = 8;
  const int lane = lane_id();
  const int num_experts = args.call.num_experts;
  const auto [first_entry, num_entries] = block_entries(args, block);
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
      if (raw[u] < -1 || raw[u] >= num_experts) {
        record_invalid_expert(args.view, Operation::kHtNotify, InvalidExpertKind::kOutOfRange, raw[u], num_experts,
                              block * kNotifyTokensPerBlock + args.by_topk.quotient(i));
        raw[u] = -1;
      }
      ids[staged_entry(args, i, stride)] = static_cast<int32_t>(raw[u]);
    }
  }
  if (stamp) clock_phase(args.view, ClockedKernel::kHtNotify, 10);
  __syncwarp();
}

// The handle's sanitised copy of a block's routing, from the staged ids once count_blocks removed
// the repeats. Every later kernel (dispatch, cached dispatch, combine) reads this copy: all agree
// that a bad or repeated entry is -1, and the caller may reuse topk_idx. Called by all 32 lanes,
// after a __syncwarp.
__device__ void store_routing_copy(const NotifyArgs& args, int block, const int32_t* ids, int stride) {
  const auto [first_entry, num_entries] = block_entries(args, block);
  for (int i = lane_id(); i < num_entries; i += 32) {
    args.topk_idx_copy[first_entry + i] = ids[staged_entry(args, i, stride)];
  }
}

// A token's in-block ordinals of one entry, in the entry's staged slot once its id is no longer
// needed: the expert ordinal in the low 16 bits, the destination-rank ordinal in the high 16 (each
// in [-1, 31]; -1: no expert, or not the token's first entry on that rank).
__device__ __forceinline__ int32_t pack_ordinals(int expert_ordinal, int rank_ordinal) {
  return static_cast<int32_t>((static_cast<uint32_t>(rank_ordinal) << 16) |
                              (static_cast<uint32_t>(expert_ordinal) & 0xffffu));
}

// Every entry's packed ordinals of a block into expert_slot / dst_slot, in entry order: coalesced
// stores (a lane storing its own token's K entries touched a 32-byte sector per lane and store).
// Called by all 32 lanes, after a __syncwarp.
__device__ void store_block_ordinals(const NotifyArgs& args, int block, const int32_t* ids, int stride) {
  const auto [first_entry, num_entries] = block_entries(args, block);
  for (int i = lane_id(); i < num_entries; i += 32) {
    const int32_t packed = ids[staged_entry(args, i, stride)];
    args.expert_slot[first_entry + i] = static_cast<int16_t>(packed & 0xffff);
    args.dst_slot[first_entry + i] = packed >> 16;
  }
}

__device__ void count_blocks(const NotifyArgs& args, uint32_t* smem, const BlockRange& range, int num_columns) {
  const int lane = lane_id();
  const int warp = static_cast<int>(threadIdx.x / 32);
  const HtCall& call = args.call;
  const int num_experts = call.num_experts;
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
  const int cta = static_cast<int>(blockIdx.x);
  for (int block = range.first(cta) + warp; block < range.end(cta); block += kNotifyWarps) {
    for (int column = lane; column < num_columns; column += 32) expert_bits[column] = 0;
    const bool first_block = block == range.first(cta);
    stage_block_ids(args, block, ids, stride, first_block);  // its __syncwarp also orders the zeroing
    if (first_block) clock_phase(args.view, ClockedKernel::kHtNotify, 8);
    const int token = block * kNotifyTokensPerBlock + lane;
    const bool has_token = token < args.num_tokens;
    uint32_t first_of_rank = 0;  // bit k: entry k is the token's first on its rank
    if (has_token) {
      for (int k = 0; k < num_topk; ++k) {
        const int expert = my_ids[k];
        if (expert < 0) continue;
        // Only this lane sets its bit, so the old value says whether an earlier k of this token hit
        // the same expert (a repeat: recorded, and the entry becomes -1) or the same rank.
        if ((atomicOr(&expert_bits[expert], my_bit) & my_bit) != 0) {
          record_invalid_expert(args.view, Operation::kHtNotify, InvalidExpertKind::kDuplicate, expert, num_experts,
                                token);
          my_ids[k] = -1;
          continue;
        }
        const int rank = args.by_local.quotient(expert);
        if ((atomicOr(&rank_bits[rank], my_bit) & my_bit) == 0) first_of_rank |= 1u << k;
        if (num_nodes > 0) atomicOr(&node_bits[call.node_of(rank)], my_bit);
      }
    }
    __syncwarp();
    if (first_block) clock_phase(args.view, ClockedKernel::kHtNotify, 11);
    store_routing_copy(args, block, ids, stride);
    int32_t* block_row = scratch_row(args, block, num_columns);
    for (int column = lane; column < num_columns; column += 32) block_row[column] = __popc(expert_bits[column]);
    __syncwarp();  // every lane read the staged ids: each lane may now overwrite its own row
    if (has_token) {
      for (int k = 0; k < num_topk; ++k) {
        const int expert = my_ids[k];
        const int expert_ordinal = expert >= 0 ? __popc(expert_bits[expert] & lower_lanes) : -1;
        const int rank_ordinal =
            ((first_of_rank >> k) & 1u) != 0 ? __popc(rank_bits[args.by_local.quotient(expert)] & lower_lanes) : -1;
        my_ids[k] = pack_ordinals(expert_ordinal, rank_ordinal);
      }
      for (int node = 0; node < num_nodes; ++node) {
        const uint32_t bits = node_bits[node];
        args.hybrid.node_slot[int64_t{token} * num_nodes + node] =
            (bits & my_bit) != 0 ? __popc(bits & lower_lanes) : -1;
      }
    }
    __syncwarp();
    store_block_ordinals(args, block, ids, stride);
    __syncwarp();  // the next block's staging overwrites the rows
  }
}

// Step 2, per CTA over its own blocks: row -> exclusive prefix inside the CTA; the first row (prefix
// 0) -> the CTA's aggregate. One thread per column; kScanLoads rows' loads in flight at a time.
constexpr int kScanLoads = 8;

__device__ void scan_own_blocks(const NotifyArgs& args, const BlockRange& range, int num_columns) {
  const int cta = static_cast<int>(blockIdx.x);
  const int first = range.first(cta);
  const int end = range.end(cta);
  if (first == end) return;
  for (int column = threadIdx.x; column < num_columns; column += blockDim.x) {
    int32_t running = 0;
    for (int chunk = first; chunk < end; chunk += kScanLoads) {
      int32_t values[kScanLoads];
#pragma unroll
      for (int u = 0; u < kScanLoads; ++u) {
        // Rows of other warps of this CTA (before the __syncthreads): read through L2.
        values[u] = chunk + u < end ? __ldcg(scratch_row(args, chunk + u, num_columns) + column) : 0;
      }
#pragma unroll
      for (int u = 0; u < kScanLoads; ++u) {
        const int block = chunk + u;
        if (block >= end) break;
        if (block != first) scratch_row(args, block, num_columns)[column] = running;
        running += values[u];
      }
    }
    scratch_row(args, first, num_columns)[column] = running;
    // The grid sync's release (thread 0's acq_rel arrival, after the __syncthreads) orders these adds
    // before CTA 0 reads the totals.
    if (running != 0) atomicAdd(totals_cells(args) + column, running);
  }
}

// Step 3: out[column] = the sum of the aggregates of CTAs [0, num_ctas) (a CTA's base; CTA 0 takes
// the totals from the workspace cells instead, take_totals). One thread per column; every load of a
// thread (up to kAggregateLoads aggregates of each of its columns) is issued before the first sum,
// so a thread pays one L2 round trip, not one per chunk and column.
constexpr int kAggregateLoads = 16;
constexpr int kAggregateColumns = 2;  // per thread at once: E + R columns exceed 256 threads

__device__ void sum_aggregates(const NotifyArgs& args, const BlockRange& range, int num_columns, int num_ctas,
                               int32_t* out) {
  const int stride = static_cast<int>(blockDim.x);
  for (int first = threadIdx.x; first < num_columns; first += kAggregateColumns * stride) {
    int32_t sum[kAggregateColumns] = {};
    for (int chunk = 0; chunk < num_ctas; chunk += kAggregateLoads) {
      int32_t values[kAggregateColumns][kAggregateLoads];
#pragma unroll
      for (int c = 0; c < kAggregateColumns; ++c) {
        const int column = first + c * stride;
#pragma unroll
        for (int u = 0; u < kAggregateLoads; ++u) {
          // Written by other CTAs before the grid sync: read through L2.
          const bool valid = column < num_columns && chunk + u < num_ctas;
          values[c][u] = valid ? __ldcg(aggregate_row(args, range, chunk + u, num_columns) + column) : 0;
        }
      }
#pragma unroll
      for (int c = 0; c < kAggregateColumns; ++c) {
#pragma unroll
        for (int u = 0; u < kAggregateLoads; ++u) sum[c] += values[c][u];
      }
    }
#pragma unroll
    for (int c = 0; c < kAggregateColumns; ++c) {
      const int column = first + c * stride;
      if (column >= num_columns) continue;
      out[column] = sum[c];
    }
  }
}

// CTA 0 after the grid sync: the totals from the workspace cells (into shared memory, and in hybrid
// mode the scratch's totals row), which are cleared for the next notify (workspace invariant; the
// next notify's adds come after this kernel ended). Both of a thread's columns are loaded at once.
__device__ void take_totals(const NotifyArgs& args, int num_columns, int32_t* totals, int32_t* scratch_totals) {
  int32_t* cells = totals_cells(args);
  const int stride = static_cast<int>(blockDim.x);
  for (int first = threadIdx.x; first < num_columns; first += kAggregateColumns * stride) {
    int32_t values[kAggregateColumns];
#pragma unroll
    for (int c = 0; c < kAggregateColumns; ++c) {
      const int column = first + c * stride;
      values[c] = column < num_columns ? __ldcg(cells + column) : 0;
    }
#pragma unroll
    for (int c = 0; c < kAggregateColumns; ++c) {
      const int column = first + c * stride;
      if (column >= num_columns) continue;
      cells[column] = 0;
      totals[column] = values[c];
      if (scratch_totals != nullptr) scratch_totals[column] = values[c];
    }
  }
}

// The exclusive prefix of `column` over all blocks before `block` (block == num_blocks: the total);
// CTA 0 after it wrote the totals row.
__device__ int32_t block_prefix(const NotifyArgs& args, const BlockRange& range, int num_columns, int block,
                                int64_t column) {
  if (block >= range.num_blocks) return __ldcg(totals_row(args, range, num_columns) + column);
  const int owner = range.owner(block);
  int32_t prefix = block == range.first(owner) ? 0 : __ldcg(scratch_row(args, block, num_columns) + column);
  for (int cta = 0; cta < owner; ++cta) prefix += __ldcg(aggregate_row(args, range, cta, num_columns) + column);
  return prefix;
}

// Step 3 for the tokens of CTA `cta`: ordinal + base (that CTA's, in this CTA's shared memory;
// nullptr for CTA 0, whose base is 0) + the block's prefix inside that CTA (0 for its first block).
// Thread `thread` of `num_threads` takes every num_threads-th entry.
__device__ void add_block_bases(const NotifyArgs& args, const BlockRange& range, int num_columns, int cta,
                                const int32_t* base, int64_t thread, int64_t num_threads) {
  const HtCall& call = args.call;
  const int num_experts = call.num_experts;
  const int num_topk = call.num_topk;
  const int first_block = range.first(cta);
  const int64_t first_token = int64_t{first_block} * kNotifyTokensPerBlock;
  const int64_t end_token = min(int64_t{range.end(cta)} * kNotifyTokensPerBlock, int64_t{args.num_tokens});
  const int64_t end_entry = end_token * num_topk;  // < 2^31 (launch_notify)
  const int64_t stride = num_threads;
  // The row of a block's prefix inside the CTA (nullptr for the CTA's first block, prefix 0).
  const auto prefix_row = [&](int64_t token) -> const int32_t* {
    const int64_t block = token / kNotifyTokensPerBlock;
    return block == first_block ? nullptr : scratch_row(args, block, num_columns);
  };
  const auto offset = [&](const int32_t* row, int64_t column) {
    return (row != nullptr ? __ldcg(row + column) : 0) + (base != nullptr ? base[column] : 0);
  };
  // kBaseEntries entries per thread at a time, every load of the batch issued before its first
  // store (entry by entry, each one's loads waited for the previous one's stores).
  constexpr int kBaseEntries = 4;
  for (int64_t first = first_token * num_topk + thread; first < end_entry; first += stride * kBaseEntries) {
    int expert[kBaseEntries];
    int32_t expert_slot[kBaseEntries];
    int32_t dst_slot[kBaseEntries];
#pragma unroll
    for (int b = 0; b < kBaseEntries; ++b) {
      const int64_t entry = first + b * stride;
      expert[b] = -1;
      if (entry >= end_entry) continue;
      // The routing as count_blocks sanitised it (CTA `cta` wrote it, before the grid sync).
      expert[b] = static_cast<int>(__ldcg(args.topk_idx_copy + entry));
      expert_slot[b] = __ldcg(args.expert_slot + entry);
      dst_slot[b] = __ldcg(args.dst_slot + entry);
    }
#pragma unroll
    for (int b = 0; b < kBaseEntries; ++b) {
      const int64_t entry = first + b * stride;
      if (expert[b] < 0) continue;
      const int32_t* row = prefix_row(args.by_topk.quotient(static_cast<int>(entry)));
      expert_slot[b] += offset(row, expert[b]);
      if (dst_slot[b] >= 0) dst_slot[b] += offset(row, num_experts + args.by_local.quotient(expert[b]));
    }
#pragma unroll
    for (int b = 0; b < kBaseEntries; ++b) {
      const int64_t entry = first + b * stride;
      if (expert[b] < 0) continue;
      args.expert_slot[entry] = expert_slot[b];
      if (dst_slot[b] >= 0) args.dst_slot[entry] = dst_slot[b];
    }
  }
  if (!call.hybrid()) return;
  const int num_nodes = call.num_nodes();
  const int64_t node_column = num_experts + call.num_ranks();
  for (int64_t item = first_token * num_nodes + thread; item < end_token * num_nodes; item += stride) {
    const int32_t slot = __ldcg(args.hybrid.node_slot + item);
    if (slot < 0) continue;
    args.hybrid.node_slot[item] = slot + offset(prefix_row(item / num_nodes), node_column + item % num_nodes);
  }
}

// Hybrid mode, CTA 0 after the entry barrier: the counts for other nodes' ranks travel as one
// message per node to the same-rail rank there; the messages this rank receives as forwarder are
// published into its node-mates' cells. Message to node m: [S rank counts][S x L expert counts]
// [C + 1 row prefix of the scale-out stream to m, per channel]. Returns false on a timeout.
__device__ bool exchange_scaleout_counts(const NotifyArgs& args, const int32_t* totals, int num_columns,
                                         const BlockRange& range) {
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
      const int block = static_cast<int>(min(int64_t{channel} * blocks_per_channel, int64_t{range.num_blocks}));
      message[scaleup + scaleup * num_local + channel] = block_prefix(args, range, num_columns, block, node_column + m);
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

// Direct mode, CTA 0, before the release of the rank cells: this rank's per-destination token
// counts (`per_rank`: [R]) into its own window, where every receiver reads them once it acquired
// this rank's cell (write_rank_prefix_matrix). Not cleared: the next notify overwrites the row, and a
// receiver reads it before it enters this operation's dispatch exit barrier, which this rank must
// pass before its next notify.
__device__ void store_rank_send_counts(const DeviceView& view, const int32_t* per_rank) {
  for (int dest = threadIdx.x; dest < view.num_ranks; dest += blockDim.x) {
    ptx::st_relaxed_sys(view.local<int32_t>(WorkspaceLayout::rank_send_counts_offset + 4 * int64_t{dest}),
                        per_rank[dest]);
  }
}

// CTA 0. `totals`: the totals in this CTA's shared memory; `scratch_totals`: the scratch's totals
// row (hybrid only: the scale-out messages read it). `while_waiting` runs once this rank's counts
// are sent, before it waits for its peers'. Returns false on a timeout (recorded; the host sees it).
template <typename WhileWaiting>
__device__ bool exchange_counts(const NotifyArgs& args, const int32_t* totals, const int32_t* scratch_totals,
                                int num_columns, const BlockRange& range, int32_t* recv_per_source,
                                int32_t* per_source_expert, WhileWaiting&& while_waiting) {
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
    ptx::st_relaxed_sys(view.peer<int32_t>(dest, cell), totals[expert] + 1);
  }
  if (!call.hybrid()) store_rank_send_counts(view, totals + num_experts);
  // No fence of our own: each release store below is cumulative over the CTA's expert-count
  // stores (and the send-count row), which the __syncthreads orders before it.
  __syncthreads();
  for (int dest = first_dest + threadIdx.x; dest < first_dest + num_dests; dest += blockDim.x) {
    ptx::st_release_sys(view.peer<int32_t>(dest, WorkspaceLayout::rank_counts_offset + 4 * int64_t{view.rank}),
                        totals[num_experts + dest] + 1);
  }
  clock_phase(view, ClockedKernel::kHtNotify, 3);
  while_waiting();
  if (call.hybrid() && !exchange_scaleout_counts(args, scratch_totals, num_columns, range)) return false;

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
  clock_phase(view, ClockedKernel::kHtNotify, 12);
  return args.send_base == nullptr || exchange_send_bases(args, recv_per_source);
}

// One value per thread of the CTA (all threads call): its inclusive prefix sum over the CTA, and the
// CTA's total. `warp_sums`: kNotifyWarps ints of shared memory, free again on return.
__device__ int cta_inclusive_sum(int value, int32_t* warp_sums, int& total) {
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int inclusive = warp_inclusive_sum(value);
  if (lane_id() == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  int below = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kNotifyWarps; ++w) {
    const int sum = warp_sums[w];
    below += w < warp ? sum : 0;
    total += sum;
  }
  __syncthreads();
  return below + inclusive;
}

// CTA 0, after the exchange: the handle's counts and the host-mapped copy. The per-expert prefix is
// CTA-wide (a thread per local expert; one warp walking the experts 32 at a time measured slower,
// and this is on the path to the host's wait).
__device__ void write_counts(const NotifyArgs& args, const int32_t* recv_per_source, const int32_t* per_source_expert) {
  __shared__ int32_t warp_sums[kNotifyWarps];
  const int num_ranks = args.view.num_ranks;
  const int num_local = args.call.num_local_experts();
  const int alignment = args.expert_alignment;
  const CountsLayout layout = counts_layout(num_ranks, num_local);
  int32_t* counts = args.counts;
  int32_t* mapped = args.mapped_counters;
  const int lane = lane_id();

  int carry = 0;  // aligned rows of the experts of earlier chunks
  for (int first = 0; first < num_local; first += blockDim.x) {
    const int local = first + static_cast<int>(threadIdx.x);
    int unaligned = 0;
    if (local < num_local) {
      for (int source = 0; source < num_ranks; ++source) {
        counts[layout.expert_offsets + source * num_local + local] = unaligned;
        unaligned += per_source_expert[source * num_local + local];
      }
      counts[layout.unaligned_per_expert + local] = unaligned;
    }
    const int aligned = local < num_local ? static_cast<int32_t>(align_up(unaligned, alignment)) : 0;
    int chunk_total = 0;
    const int inclusive = carry + cta_inclusive_sum(aligned, warp_sums, chunk_total);
    if (local < num_local) {
      const int start = inclusive - aligned;
      counts[layout.expert_start + local] = start;
      // DeepEP's meaning: expand rows of expert l are [start, psum[l]); non-expand, the aligned psum.
      counts[layout.psum_per_expert + local] = args.do_expand ? start + unaligned : inclusive;
      if (mapped != nullptr) mapped[kMappedAlignedExpertCounts + local] = aligned;
    }
    carry += chunk_total;
  }
  if (mapped != nullptr && threadIdx.x == 0) mapped[kMappedNumExpandedTokens] = carry;
  if (threadIdx.x < 32) {
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
  }
  if (mapped == nullptr) return;
  __syncthreads();
  clock_phase(args.view, ClockedKernel::kHtNotify, 13);
  // The release is cumulative over the CTA's mapped stores (ordered before it by the barrier).
  if (threadIdx.x == 0) ptx::st_release_sys(mapped + kMappedReady, 1);
}

// Sources whose send counts one thread has in flight while it builds a column of the matrix.
constexpr int kMatrixLoadsInFlight = 16;

// Direct mode, CTA 0, after a successful count exchange (off the host's path: the mapped counters
// are released already): V1's rank prefix matrix, [s][d] = tokens ranks 0..s send to rank d, from
// every source's send-count row in its window. Each source stored its row before releasing the rank
// cell some thread of this CTA acquired before exchange_counts' __syncthreads, so relaxed loads see
// it. A thread per destination column: a warp's loads of one source's row coalesce.
__device__ void write_rank_prefix_matrix(const NotifyArgs& args) {
  const DeviceView& view = args.view;
  const int num_ranks = view.num_ranks;
  for (int dest = threadIdx.x; dest < num_ranks; dest += blockDim.x) {
    const int64_t cell = WorkspaceLayout::rank_send_counts_offset + 4 * int64_t{dest};
    int32_t running = 0;
    for (int first = 0; first < num_ranks; first += kMatrixLoadsInFlight) {
      int32_t sent[kMatrixLoadsInFlight];
#pragma unroll
      for (int u = 0; u < kMatrixLoadsInFlight; ++u) {
        sent[u] = first + u < num_ranks ? ptx::ld_relaxed_sys(view.peer<int32_t>(first + u, cell)) : 0;
      }
#pragma unroll
      for (int u = 0; u < kMatrixLoadsInFlight; ++u) {
        if (first + u >= num_ranks) break;
        running += sent[u];
        args.rank_prefix_matrix[int64_t{first + u} * num_ranks + dest] = running;
      }
    }
  }
}

__global__ void __launch_bounds__(kNotifyThreads, 1) notify_kernel(const NotifyArgs args) {
  extern __shared__ int32_t smem[];
  const int num_experts = args.call.num_experts;
  const int num_ranks = args.view.num_ranks;
  const int num_columns = notify_columns(args.call);
  const BlockRange range = block_range(args);
  const int cta = static_cast<int>(blockIdx.x);
  // CTA 0's tokens get their bases from the other active CTAs (base 0: only the prefix rows, which
  // the grid sync published), so CTA 0 goes straight from the totals to the count exchange; alone,
  // it adds them itself while the peers' counts travel.
  const int helpers = range.num_active() - 1;

  clock_phase(args.view, ClockedKernel::kHtNotify, 0);
  count_blocks(args, reinterpret_cast<uint32_t*>(smem), range, num_columns);
  __syncthreads();  // the CTA's rows are complete
  scan_own_blocks(args, range, num_columns);
  clock_phase(args.view, ClockedKernel::kHtNotify, 9);
  if (!grid_sync<false>(args.view, Operation::kHtNotify, kGridSlotNotify)) return;
  clock_phase(args.view, ClockedKernel::kHtNotify, 1);

  if (cta == 0) {
    int32_t* recv_per_source = smem;
    int32_t* per_source_expert = recv_per_source + num_ranks;
    int32_t* totals = per_source_expert + num_experts;
    // The scratch's totals row only for hybrid mode (scale-out messages, channel prefixes).
    int32_t* scratch_totals = args.call.hybrid() ? totals_row(args, range, num_columns) : nullptr;
    take_totals(args, num_columns, totals, scratch_totals);
    __syncthreads();
    clock_phase(args.view, ClockedKernel::kHtNotify, 2);
    const auto add_own_bases = [&] {
      if (helpers > 0) return;
      add_block_bases(args, range, num_columns, 0, nullptr, threadIdx.x, blockDim.x);
      clock_phase(args.view, ClockedKernel::kHtNotify, 7);
    };
    if (exchange_counts(args, totals, scratch_totals, num_columns, range, recv_per_source, per_source_expert,
                        add_own_bases)) {
      if (args.send_base != nullptr) clock_phase(args.view, ClockedKernel::kHtNotify, 5);
      write_counts(args, recv_per_source, per_source_expert);
      clock_phase(args.view, ClockedKernel::kHtNotify, 6);
      if (args.rank_prefix_matrix != nullptr) write_rank_prefix_matrix(args);
    }
    return;
  }
  if (cta > helpers) return;
  int32_t* base = smem;  // the count phase is done with shared memory (grid_sync's __syncthreads)
  sum_aggregates(args, range, num_columns, cta, base);
  __syncthreads();
  clock_phase(args.view, ClockedKernel::kHtNotify, 2);
  add_block_bases(args, range, num_columns, cta, base, threadIdx.x, blockDim.x);
  add_block_bases(args, range, num_columns, 0, nullptr, int64_t{cta - 1} * blockDim.x + threadIdx.x,
                  int64_t{helpers} * blockDim.x);
  clock_phase(args.view, ClockedKernel::kHtNotify, 7);
}

}  // namespace

void launch_notify(const NotifyArgs& args, cudaStream_t stream) {
  check_ht_grid_size(args.view, "num_sms", args.num_sms);
  check_call(args.view, args.call);
  EP_REQUIRE(args.num_tokens == 0 || args.topk_idx_copy != nullptr, "the notify kernel needs topk_idx_copy");
  // Routing entries are indexed and divided as 31-bit ints in the kernel (FastDivisor).
  EP_REQUIRE(int64_t{args.num_tokens} * args.call.num_topk < (int64_t{1} << 31),
             "num_tokens * num_topk must be below 2^31, got " + std::to_string(args.num_tokens) + " * " +
                 std::to_string(args.call.num_topk));
  EP_REQUIRE(args.expert_alignment >= 1, "expert_alignment must be >= 1, got " + std::to_string(args.expert_alignment));
  EP_REQUIRE(args.call.num_local_experts() + kMappedAlignedExpertCounts <= kMappedReady,
             "too many local experts for the host-mapped counters");
  check_hybrid_routing(args.call, args.hybrid, args.num_tokens);
  EP_REQUIRE(args.call.zero_copy_recv == (args.send_base != nullptr),
             "a notify for zero-copy receive needs send_base (and only such a notify takes one)");
  EP_REQUIRE(!args.call.hybrid() || args.rank_prefix_matrix == nullptr,
             "the rank prefix matrix is direct mode only (hybrid peers' windows are not load/store reachable)");
  const size_t smem = notify_smem_bytes(args.call);
  // Up to 48 KiB of dynamic shared memory needs no opt-in; the attribute call costs host time on
  // every launch, so it is made only for the large-E shapes that need it.
  if (static_cast<int64_t>(smem) > kDefaultDynamicSharedBytes) {
    EP_CUDA_CHECK(
        cudaFuncSetAttribute(notify_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  NotifyArgs kernel_args = args;
  kernel_args.by_topk = FastDivisor(static_cast<uint32_t>(args.call.num_topk));
  kernel_args.by_local = FastDivisor(static_cast<uint32_t>(args.call.num_local_experts()));
  notify_kernel<<<notify_grid_size(args.num_sms, args.num_tokens), kNotifyThreads, smem, stream>>>(kernel_args);
  EP_CHECK_LAUNCH("ht notify_kernel");
}

void preload_ht_notify_kernels() { preload_kernel(notify_kernel, "ht notify"); }

}  // namespace deep_ep::ht
