// HT dispatch copy epilogue (receiver, local memory only): receive slots -> output tensors.
//
// Non-expand row i comes from source s = the first source whose inclusive psum exceeds i, slot
// j = i - psum[s-1]: rows are (source, token) ordered because slots are. Expand: the row of
// (token, local expert l) is expert_start[l] + expert_offsets[s][l] + expert_slot, i.e. expert
// groups in expert order, inside a group (source, token) order; padding rows up to the alignment
// are zeroed. Counts are always read from the device, so the same kernel serves exact (CPU sync)
// and worst-case (no sync, cached) allocations.
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/require.hpp"
#include "kernels/high_throughput.hpp"
#include "kernels/ht_common.cuh"
#include "kernels/preload.hpp"

namespace deep_ep::ht {
namespace {

constexpr int kEpilogueThreads = 512;
constexpr int kEpilogueWarps = kEpilogueThreads / 32;
constexpr int kCopyUnroll = 4;
constexpr int kRowsAhead = 4;

// Received row `row` came from `source`, where it is the `index`-th row that source sent here
// (`psum_per_source`: inclusive prefix of the rows per source, in source order).
struct RowOrigin {
  int source;
  int64_t index;
};

__device__ __forceinline__ RowOrigin origin_of_row(const int32_t* psum_per_source, int num_ranks, int64_t row) {
  int low = 0;
  int high = num_ranks - 1;
  while (low < high) {
    const int middle = (low + high) / 2;
    if (psum_per_source[middle] > row) {
      high = middle;
    } else {
      low = middle + 1;
    }
  }
  return {low, row - (low > 0 ? psum_per_source[low - 1] : 0)};
}

__device__ void zero_row(const EpilogueArgs& args, int64_t row, int64_t row_bytes, int num_scales) {
  const int lane = lane_id();
  int4* payload = reinterpret_cast<int4*>(static_cast<uint8_t*>(args.recv_x) + row * row_bytes);
  for (int64_t index = lane; index < row_bytes / kVectorBytes; index += 32) payload[index] = make_int4(0, 0, 0, 0);
  for (int index = lane; index < num_scales; index += 32) args.recv_x_scales[row * num_scales + index] = 0.0f;
  if (lane == 0 && args.recv_topk_weights != nullptr) args.recv_topk_weights[row] = 0.0f;
}

// Zero-copy receive (direct, non-expand): payload and scales are in final position already; only the
// per-row metadata is written, one thread per row. (A warp per row, as below, keeps only kRowsAhead
// rows' metadata loads in flight per warp, which measured bound by load latency at 8 ranks on one
// H200; here each lane's row loads are in flight at once.) Same values as the warp path: local expert
// ids, weights, and the source info with combine row = distinct destination ranks of the token
// below this rank (direct mode: every rank is in scope) and master lane = first local top-k entry.
static_assert(kSrcInfoSourceRank == 0 && kSrcInfoSourceToken == 1 && kSrcInfoCombineRow == 2 &&
                  kSrcInfoMasterLane == 3 && kSrcInfoColumns == 4,
              "zero_copy_metadata stores a row's source info as one int4 in this order");

__device__ void zero_copy_metadata(const EpilogueArgs& args, const int32_t* psum_per_source, int64_t num_rows) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const int num_topk = call.num_topk;
  const int num_local = call.num_local_experts();
  const int first_local_expert = view.rank * num_local;
  const TokenLayout& token = call.dispatch_token();
  const int64_t num_threads = int64_t{gridDim.x} * blockDim.x;
  for (int64_t row = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; row < num_rows; row += num_threads) {
    const auto [source, slot_index] = origin_of_row(psum_per_source, view.num_ranks, row);
    const uint8_t* slot = view.local<uint8_t>(call.dispatch_meta_slot(source, slot_index));
    const auto* experts = reinterpret_cast<const int32_t*>(slot + token.topk_idx_offset);
    const auto* weights = reinterpret_cast<const float*>(slot + token.weights_offset);
    const int32_t source_token = __ldg(reinterpret_cast<const int32_t*>(slot + token.src_offset));
    const bool writes_row = row < args.num_rows_allocated;
    int combine_row = 0;
    int master_lane = -1;
    for (int k = 0; k < num_topk; ++k) {
      const int expert = __ldg(experts + k);
      const int local =
          expert >= first_local_expert && expert < first_local_expert + num_local ? expert - first_local_expert : -1;
      if (local >= 0 && master_lane < 0) master_lane = k;
      const int expert_rank = expert >= 0 ? expert / num_local : -1;
      if (expert_rank >= 0 && expert_rank < view.rank) {
        // Counted at its first entry only (the slot's ids were just loaded: L1 hits).
        bool first = true;
        for (int j = 0; j < k; ++j) {
          const int earlier = __ldg(experts + j);
          first = first && !(earlier >= 0 && earlier / num_local == expert_rank);
        }
        combine_row += first ? 1 : 0;
      }
      if (writes_row) {
        args.recv_topk_idx[row * num_topk + k] = local;
        if (args.recv_topk_weights != nullptr) {
          args.recv_topk_weights[row * num_topk + k] = args.has_weights ? __ldg(weights + k) : 0.0f;
        }
      }
    }
    if (args.recv_src_info != nullptr && row < args.num_meta_rows_allocated) {
      *reinterpret_cast<int4*>(args.recv_src_info + row * kSrcInfoColumns) =
          make_int4(source, source_token, combine_row, master_lane);
    }
  }
}

__global__ void __launch_bounds__(kEpilogueThreads) dispatch_copy_epilogue_impl(const EpilogueArgs args) {
  __shared__ int32_t psum_shared[kMaxRanks];
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const int num_ranks = view.num_ranks;
  const int num_topk = call.num_topk;
  const int num_local = call.num_local_experts();
  const int first_local_expert = view.rank * num_local;
  const CountsLayout counts = counts_layout(num_ranks, num_local);
  for (int source = threadIdx.x; source < num_ranks; source += blockDim.x) {
    psum_shared[source] = args.counts[counts.psum_per_source + source];
  }
  __syncthreads();

  const int lane = lane_id();
  const TokenLayout& token = call.dispatch_token();
  const int64_t row_bytes = call.row_bytes();
  const int64_t num_vectors = row_bytes / kVectorBytes;
  const int num_scales = call.num_scales();
  // Combine rows are counted among the token's destination ranks of the combine receiver's scope:
  // direct, every rank (the home rank sums); hybrid, this node's ranks (the forwarder sums).
  const int scope_first = call.hybrid() ? call.node_of(view.rank) * call.ranks_per_node() : 0;
  const int64_t num_rows = psum_shared[num_ranks - 1];
  if (call.zero_copy_recv) {
    zero_copy_metadata(args, psum_shared, num_rows);
    return;
  }
  const int64_t first_warp = int64_t{blockIdx.x} * kEpilogueWarps + threadIdx.x / 32;
  const int64_t num_warps = int64_t{gridDim.x} * kEpilogueWarps;
  auto* recv_x = static_cast<uint8_t*>(args.recv_x);

  // One row's metadata as the warp holds it: lane k < K its entry k, lane 0 the source token.
  struct RowMeta {
    int source = 0;
    const uint8_t* slot = nullptr;
    int expert = -1;
    int32_t expert_slot = -1;
    float weight = 0.0f;
    int32_t source_token = 0;
  };
  const auto load_meta = [&](int64_t row) {
    RowMeta meta;
    if (row >= num_rows) return meta;
    const RowOrigin origin = origin_of_row(psum_shared, num_ranks, row);
    meta.source = origin.source;
    meta.slot = view.local<uint8_t>(call.dispatch_slot(origin.source, origin.index));
    if (lane < num_topk) {
      meta.expert = __ldg(reinterpret_cast<const int32_t*>(meta.slot + token.topk_idx_offset) + lane);
      meta.expert_slot = __ldg(reinterpret_cast<const int32_t*>(meta.slot + token.expert_slot_offset) + lane);
      if (args.has_weights)
        meta.weight = __ldg(reinterpret_cast<const float*>(meta.slot + token.weights_offset) + lane);
    }
    if (lane == 0) meta.source_token = __ldg(reinterpret_cast<const int32_t*>(meta.slot + token.src_offset));
    return meta;
  };

  // The metadata loads of the warp's next kRowsAhead rows are issued before this row is written, so
  // each warp keeps that many rows' loads in flight.
  RowMeta ahead[kRowsAhead];
#pragma unroll
  for (int i = 0; i < kRowsAhead; ++i) ahead[i] = load_meta(first_warp + i * num_warps);
  for (int64_t row = first_warp; row < num_rows; row += num_warps) {
    const RowMeta meta = ahead[0];
#pragma unroll
    for (int i = 0; i + 1 < kRowsAhead; ++i) ahead[i] = ahead[i + 1];
    ahead[kRowsAhead - 1] = load_meta(row + kRowsAhead * num_warps);
    const int source = meta.source;
    const uint8_t* slot = meta.slot;
    const int expert = meta.expert;
    const int32_t expert_slot = meta.expert_slot;
    const float weight = meta.weight;
    const int local =
        (expert >= first_local_expert && expert < first_local_expert + num_local) ? expert - first_local_expert : -1;
    const int expert_rank = expert >= 0 ? expert / num_local : -1;
    // Combine sends this row back to row j of the source's (hybrid: the forwarder's) combine area:
    // j = how many of the token's distinct destination ranks in scope are below this rank.
    const uint32_t first_lanes = __ballot_sync(kFullMask, is_first_lane_of_rank(expert_rank));
    const int combine_row = distinct_ranks_in_uniform(expert_rank, first_lanes, scope_first, view.rank);
    // DeepEP V2 names a received row by its master lane: the first top-k lane whose expert is here.
    // Every received row has one (the token came because of it); -1 would mean a corrupt slot.
    const int master_lane = __ffs(__ballot_sync(kFullMask, local >= 0)) - 1;
    const bool has_meta_row = row < args.num_meta_rows_allocated;

    if (!args.do_expand) {
      if (row < args.num_rows_allocated) {
        warp_copy_to_lanes<kCopyUnroll>(reinterpret_cast<const int4*>(slot), num_vectors, 1u,
                                        reinterpret_cast<int4*>(recv_x + row * row_bytes));
        if (num_scales > 0) {
          warp_copy_words_to_lanes(reinterpret_cast<const float*>(slot + token.scale_offset), num_scales, 1u,
                                   args.recv_x_scales + row * num_scales);
        }
        if (lane < num_topk) {
          args.recv_topk_idx[row * num_topk + lane] = local;
          if (args.recv_topk_weights != nullptr) args.recv_topk_weights[row * num_topk + lane] = weight;
        }
      }
    } else {
      int64_t position = -1;
      if (local >= 0) {
        position = int64_t{args.counts[counts.expert_start + local]} +
                   args.counts[counts.expert_offsets + source * num_local + local] + expert_slot;
      }
      const bool writes = position >= 0 && position < args.num_rows_allocated;
      const uint32_t dst_lanes = __ballot_sync(kFullMask, writes);
      warp_copy_to_lanes<kCopyUnroll>(reinterpret_cast<const int4*>(slot), num_vectors, dst_lanes,
                                      writes ? reinterpret_cast<int4*>(recv_x + position * row_bytes) : nullptr);
      if (num_scales > 0) {
        warp_copy_words_to_lanes(reinterpret_cast<const float*>(slot + token.scale_offset), num_scales, dst_lanes,
                                 writes ? args.recv_x_scales + position * num_scales : nullptr);
      }
      if (writes && args.recv_topk_weights != nullptr) args.recv_topk_weights[position] = weight;
      if (args.recv_expanded_rows != nullptr && has_meta_row && lane < num_topk) {
        args.recv_expanded_rows[row * num_topk + lane] = writes ? static_cast<int32_t>(position) : -1;
      }
    }
    if (args.recv_src_info != nullptr && has_meta_row && lane == 0) {
      int32_t* info = args.recv_src_info + row * kSrcInfoColumns;
      info[kSrcInfoSourceRank] = source;
      info[kSrcInfoSourceToken] = meta.source_token;
      info[kSrcInfoCombineRow] = combine_row;
      info[kSrcInfoMasterLane] = master_lane;
    }
  }

  if (!args.do_expand || args.expert_alignment <= 1) return;
  // Padding rows: at most alignment - 1 per expert; one warp per candidate row.
  const int64_t pads_per_expert = args.expert_alignment - 1;
  for (int64_t item = first_warp; item < num_local * pads_per_expert; item += num_warps) {
    const int local = static_cast<int>(item / pads_per_expert);
    const int64_t pad = item % pads_per_expert;
    const int64_t count = args.counts[counts.unaligned_per_expert + local];
    if (pad >= align_up(count, args.expert_alignment) - count) continue;
    const int64_t row = args.counts[counts.expert_start + local] + count + pad;
    if (row < args.num_rows_allocated) zero_row(args, row, row_bytes, num_scales);
  }
}

}  // namespace

void launch_dispatch_epilogue(const EpilogueArgs& args, cudaStream_t stream) {
  check_grid_size(args.view, "num_ctas", args.num_ctas);
  check_call(args.view, args.call);
  EP_REQUIRE(args.expert_alignment >= 1, "expert_alignment must be >= 1, got " + std::to_string(args.expert_alignment));
  EP_REQUIRE(!(args.call.zero_copy_recv && args.do_expand),
             "zero-copy receive has non-expand rows only (expanded rows are placed by the epilogue)");
  EP_REQUIRE(!args.call.zero_copy_recv || reinterpret_cast<uintptr_t>(args.recv_src_info) % 16 == 0,
             "zero-copy receive stores each recv_src_info row as one 16-byte vector: the array must be 16-byte "
             "aligned");
  dispatch_copy_epilogue_impl<<<args.num_ctas, kEpilogueThreads, 0, stream>>>(args);
  EP_CHECK_LAUNCH("ht dispatch_copy_epilogue_impl");
}

void preload_ht_dispatch_epilogue_kernels() {
  preload_kernel(dispatch_copy_epilogue_impl, "ht dispatch epilogue (dispatch_copy_epilogue_impl)");
}

}  // namespace deep_ep::ht
