// HT combine (direct): every received token row goes back to its home rank, into row
// [j][source token] of the home rank's combine area, j = index of this rank among the token's
// distinct destination ranks (ascending; kept in recv_src_metadata by the dispatch epilogue).
//
// Expand mode sends one row per token: the fp32 sum of its expanded rows in ascending row order
// (= ascending local expert: expert groups are laid out in expert order), rounded to bf16 once.
// The K weights travel in the same slot; the home rank gathers weight k from the rank owning expert k.
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/require.hpp"
#include "kernels/barrier.cuh"
#include "kernels/high_throughput.hpp"
#include "kernels/ht_common.cuh"

namespace deep_ep::ht {
namespace {

constexpr int kCombineThreads = 512;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCopyUnroll = 4;
constexpr int kSumUnroll = 2;

// Lane k holds expanded row `row` (-1: none). Returns on lane r the r-th smallest valid row (-1
// past the count), so the sum visits the rows in a fixed order whatever the top-k order.
__device__ __forceinline__ int sort_rows_to_lanes(int row, int* num_rows) {
  const int lane = lane_id();
  const bool valid = row >= 0;
  const uint32_t valid_lanes = __ballot_sync(kFullMask, valid);
  int rank = 0;
  for (int other = 0; other < 32; ++other) {
    const int other_row = __shfl_sync(kFullMask, row, other);
    if (((valid_lanes >> other) & 1u) != 0 && (other_row < row || (other_row == row && other < lane))) ++rank;
  }
  *num_rows = __popc(valid_lanes);
  int ordered = -1;
  for (int position = 0; position < *num_rows; ++position) {
    const uint32_t holder = __ballot_sync(kFullMask, valid && rank == position);
    const int value = __shfl_sync(kFullMask, row, __ffs(holder) - 1);
    if (lane == position) ordered = value;
  }
  return ordered;
}

__device__ void send_expanded_sum(const int4* x, int64_t num_vectors, int ordered_row, int num_rows, int4* dst) {
  const int lane = lane_id();
  for (int64_t base = 0; base < num_vectors; base += 32 * kSumUnroll) {
    float acc[kSumUnroll][kBf16PerVector];
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
#pragma unroll
      for (int e = 0; e < kBf16PerVector; ++e) acc[u][e] = 0.0f;
    }
    for (int term = 0; term < num_rows; ++term) {
      const int64_t row = __shfl_sync(kFullMask, ordered_row, term);
#pragma unroll
      for (int u = 0; u < kSumUnroll; ++u) {
        const int64_t index = base + u * 32 + lane;
        if (index < num_vectors) accumulate_bf16x8(acc[u], ptx::ld_nc_v4(x + row * num_vectors + index));
      }
    }
#pragma unroll
    for (int u = 0; u < kSumUnroll; ++u) {
      const int64_t index = base + u * 32 + lane;
      if (index < num_vectors) dst[index] = round_to_bf16x8(acc[u]);
    }
  }
}

__global__ void __launch_bounds__(kCombineThreads, 1) combine_kernel(const CombineArgs args) {
  const DeviceView& view = args.view;
  // The home ranks' combine areas overlap their dispatch receive areas: wait until every rank has
  // finished its dispatch epilogue.
  if (blockIdx.x == 0 && !rank_barrier(view, Operation::kHtCombine, args.input_failed)) return;
  if (!grid_sync(view, Operation::kHtCombine, kGridSlotCombine)) return;

  const int lane = lane_id();
  const int num_ranks = view.num_ranks;
  const int num_topk = args.num_topk;
  const TokenLayout token = combine_token_layout(args.hidden, num_topk);
  const int64_t num_vectors = int64_t{args.hidden} / kBf16PerVector;
  const CountsLayout counts = counts_layout(num_ranks, 1);  // psum_per_source does not depend on L
  const int64_t num_rows = args.counts == nullptr ? 0 : args.counts[counts.psum_per_source + num_ranks - 1];
  const auto* x = static_cast<const int4*>(args.x);

  const int64_t first_warp = int64_t{blockIdx.x} * kCombineWarps + threadIdx.x / 32;
  for (int64_t row = first_warp; row < num_rows; row += int64_t{gridDim.x} * kCombineWarps) {
    const int32_t* meta = args.recv_src_metadata + row * kSrcMetadataColumns;
    const int source = __ldg(meta);
    const int64_t source_token = __ldg(meta + 1);
    const int64_t combine_row = __ldg(meta + 2);
    uint8_t* dst = view.peer<uint8_t>(
        source, args.ht_offset + (combine_row * args.num_max_tokens_per_rank + source_token) * token.bytes);
    float weight = 0.0f;
    if (x == nullptr) {
      // This rank's input failed: its contribution to the token is zero, not stale window data.
      for (int64_t index = lane; index < num_vectors; index += 32) {
        reinterpret_cast<int4*>(dst)[index] = make_int4(0, 0, 0, 0);
      }
    } else if (!args.do_expand) {
      warp_copy_to_lanes<kCopyUnroll>(x + row * num_vectors, num_vectors, 1u, reinterpret_cast<int4*>(dst));
      if (lane < num_topk && args.topk_weights != nullptr) weight = __ldg(args.topk_weights + row * num_topk + lane);
    } else {
      const int expanded_row = lane < num_topk ? __ldg(args.recv_expanded_rows + row * num_topk + lane) : -1;
      int num_terms = 0;
      const int ordered_row = sort_rows_to_lanes(expanded_row, &num_terms);
      send_expanded_sum(x, num_vectors, ordered_row, num_terms, reinterpret_cast<int4*>(dst));
      if (expanded_row >= 0 && args.topk_weights != nullptr) weight = __ldg(args.topk_weights + expanded_row);
    }
    if (lane < num_topk && (args.topk_weights != nullptr || x == nullptr)) {
      reinterpret_cast<float*>(dst + token.weights_offset)[lane] = weight;
    }
  }

  // All rows everywhere, then the reduce epilogue may read its own area.
  if (!grid_sync(view, Operation::kHtCombine, kGridSlotCombine)) return;
  if (blockIdx.x == 0) rank_barrier(view, Operation::kHtCombine);
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  check_grid_size(args.view, "num_sms", args.num_sms);
  check_combine_shape(args.num_topk, args.hidden);
  // With no received rows (every rank dispatched nothing here) the per-row arrays are empty, so
  // their pointers may be null; the kernel reads no row then.
  EP_REQUIRE(args.num_meta_rows >= 0, "num_meta_rows must be >= 0, got " + std::to_string(args.num_meta_rows));
  EP_REQUIRE(args.num_meta_rows == 0 || args.recv_src_metadata != nullptr,
             "combine needs the handle's source metadata");
  EP_REQUIRE(args.num_meta_rows == 0 || args.x == nullptr || !args.do_expand || args.recv_expanded_rows != nullptr,
             "expand combine needs the expanded row map");
  EP_REQUIRE(args.x != nullptr || args.input_failed || args.num_meta_rows == 0,
             "combine needs x (only a failed input sends zero rows)");
  combine_kernel<<<args.num_sms, kCombineThreads, 0, stream>>>(args);
  EP_CHECK_LAUNCH("ht combine_kernel");
}

}  // namespace deep_ep::ht
