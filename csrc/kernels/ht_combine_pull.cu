// HT zero-copy combine, direct mode (pull): every rank wrote its expert outputs, in received-row
// order, into the combine input rows of its own window (and the combine call copied their weights
// next to them); after the entry barrier each home rank reads, for each own token, the rows of the
// token's destination ranks straight from their windows and sums
//   acc = 0 (fp32); acc += bias0; acc += bias1; acc += each rank's row in DeepEP V2's order
//   (ascending last top-k lane of the rank, term_rows_in_v2_order in ht_common.cuh);
//   out = bf16(acc), rounded once
// exactly as the push path's reduce does, so the result is bitwise the same, with one pass over the
// rows instead of three (send, land, reduce). The row of token t at rank d is d's received row
// send_base[d] + dst_slot[t, k] (k: the first top-k entry on d), known from the zero-copy dispatch.
// The exit barrier keeps every caller from overwriting its combine input while a peer still reads it.
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/require.hpp"
#include "kernels/barrier.cuh"
#include "kernels/high_throughput.hpp"
#include "kernels/ht_common.cuh"
#include "kernels/phase_clock.cuh"
#include "kernels/preload.hpp"
#include "kernels/topology_barrier.cuh"

namespace deep_ep::ht {
namespace {

constexpr int kPullThreads = 512;
constexpr int kPullWarps = kPullThreads / 32;
// Vectors per lane per row in flight (with kSumTermsInFlight rows: 8 x 16 B per lane): 2 measured faster
// than 3 at 8 ranks on one H200, 4 spills at 128 registers, and a cp.async shared-memory pipeline
// (registers no bound on what is in flight) gained nothing there, so the simpler register form stays.
constexpr int kSumUnroll = 2;
// Chunks of each term row kept on their way into L2 ahead of the loads (bulk prefetches; no
// registers): 2 x 1 KiB per row per warp, ~170 KiB per SM at 5.3 rows per token. 2 measured faster
// than none, 3 and 4 at 8 ranks on one H200, T = 4096 (further ahead, the prefetched lines are evicted
// before their loads); only loads from peers' windows gain from it (the reduce, which reads its own
// window, did not).
constexpr int kPullPrefetchChunks = 2;

// V1's combined weight of top-k slot `lane_id()` (returned on lanes < K): the slot of the token's row
// at every destination rank, ranks ascending, added in fp32 from +0.0 (as the push path's reduce
// does with PullCombineArgs::sum_topk_weights). Lane k holds its expert's rank and the token's row
// there; `holds_row`: one lane per rank (its first). Called by all 32 lanes.
__device__ float summed_slot_weight(const DeviceView& view, const HtCall& call, int rank, int64_t rank_row,
                                    bool holds_row, int num_ranks_of_token) {
  const int lane = lane_id();
  const uint32_t holders = __ballot_sync(kFullMask, holds_row);
  // Lane p gets the weights of the token's p-th lowest rank.
  const int position = distinct_ranks_in(rank, holders, 0, rank);
  const auto my_weights =
      holds_row ? reinterpret_cast<unsigned long long>(view.peer<float>(rank, call.combine_input_weights(rank_row)))
                : 0ull;
  unsigned long long ascending = 0;
  for (uint32_t lanes = holders; lanes != 0; lanes &= lanes - 1) {
    const int holder = __ffs(lanes) - 1;
    const int held_position = __shfl_sync(kFullMask, position, holder);
    const unsigned long long held = __shfl_sync(kFullMask, my_weights, holder);
    if (lane == held_position) ascending = held;
  }
  float weight = 0.0f;
  for (int p = 0; p < num_ranks_of_token; ++p) {
    const auto* weights = reinterpret_cast<const float*>(__shfl_sync(kFullMask, ascending, p));
    if (lane < call.num_topk) weight = __fadd_rn(weight, __ldcg(weights + lane));
  }
  return weight;
}

__global__ void __launch_bounds__(kPullThreads, 1) combine_impl_pull(const PullCombineArgs args) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  clock_phase(view, ClockedKernel::kHtCombinePull, 0);
  // Every rank's combine input was written on its stream before its combine launched: complete once
  // every rank has arrived.
  if (blockIdx.x == 0) {
    if (!topology_barrier(view, Operation::kHtCombine, args.input_failed)) return;
    clock_phase(view, ClockedKernel::kHtCombinePull, 1);
  }
  if (!grid_sync(view, Operation::kHtCombine, kGridSlotCombine)) return;
  clock_phase(view, ClockedKernel::kHtCombinePull, 2);

  const int lane = lane_id();
  const int num_topk = call.num_topk;
  const int num_local = call.num_local_experts();
  const int64_t num_vectors = int64_t{call.hidden} / kBf16PerVector;
  const auto* bias0 = static_cast<const int4*>(args.bias0);
  const auto* bias1 = static_cast<const int4*>(args.bias1);
  auto* out = static_cast<int4*>(args.combined_x);

  const int first_warp = static_cast<int>(blockIdx.x * kPullWarps + threadIdx.x / 32);
  for (int t = first_warp; t < args.num_tokens; t += gridDim.x * kPullWarps) {
    const int64_t entry = int64_t{t} * num_topk + lane;
    const int expert = lane < num_topk ? handle_expert(args.topk_idx, entry, call.num_experts) : -1;
    const int rank = expert >= 0 ? expert / num_local : -1;
    const uint32_t same_rank = __match_any_sync(kFullMask, rank);
    // The first lane of each destination rank holds the token's slot there: every lane of the rank
    // gets the token's row at that rank.
    const int first_lane = __ffs(same_rank) - 1;
    int64_t my_row = -1;
    if (rank >= 0 && lane == first_lane) my_row = int64_t{args.send_base[rank]} + args.dst_slot[entry];
    const int64_t rank_row = __shfl_sync(kFullMask, my_row, first_lane);
    // Term j is the rank whose last top-k lane is the j-th lowest of the token's ranks' last lanes
    // (DeepEP V2's order, as the push path's reduce sums): lane j gets its row.
    const bool last = rank >= 0 && 31 - __clz(same_rank) == lane;
    const uint32_t last_lanes = __ballot_sync(kFullMask, last);
    const int num_terms = __popc(last_lanes);
    const auto my_term = reinterpret_cast<unsigned long long>(
        last ? view.peer<uint8_t>(rank, call.combine_input_row(rank_row)) : nullptr);
    const auto* term_row = reinterpret_cast<const uint8_t*>(gather_in_lane_order(last_lanes, my_term, 0ull));

    // __ldcg: the rows are in peers' memory, written before this kernel by their own streams.
    const int64_t row = t * num_vectors;
    sum_row_to_bf16<kSumUnroll, kPullPrefetchChunks>(
        out + row, bias0 != nullptr ? bias0 + row : nullptr, bias1 != nullptr ? bias1 + row : nullptr, num_terms,
        num_vectors,
        [&](int j) {
          return reinterpret_cast<const int4*>(
              __shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(term_row), j & 31));
        },
        [](const int4* p) { return __ldcg(p); });

    if (args.combined_topk_weights != nullptr) {
      float weight = 0.0f;
      if (args.sum_topk_weights) {
        weight = summed_slot_weight(view, call, rank, rank_row, rank >= 0 && lane == first_lane, num_terms);
      } else if (expert >= 0 && lane < num_topk) {
        // Weight k comes from the row of the rank owning expert k.
        weight = __ldcg(view.peer<float>(rank, call.combine_input_weights(rank_row)) + lane);
      }
      if (lane < num_topk) args.combined_topk_weights[entry] = weight;
    }
  }

  clock_phase(view, ClockedKernel::kHtCombinePull, 3);
  // No rank may overwrite its combine input (its caller's next expert outputs) while a peer reads it.
  if (!grid_sync(view, Operation::kHtCombine, kGridSlotCombine)) return;
  clock_phase(view, ClockedKernel::kHtCombinePull, 4);
  if (blockIdx.x == 0 && rank_barrier(view, Operation::kHtCombine)) clock_phase(view, ClockedKernel::kHtCombinePull, 5);
}

}  // namespace

void launch_pull_combine(const PullCombineArgs& args, cudaStream_t stream) {
  check_ht_grid_size(args.view, "num_sms", args.num_sms);
  check_call(args.view, args.call);
  check_combine_shape(args.call.num_topk, args.call.hidden);
  EP_REQUIRE(!args.call.hybrid(), "zero-copy combine is direct mode only");
  EP_REQUIRE(args.num_tokens == 0 || (args.topk_idx != nullptr && args.dst_slot != nullptr &&
                                      args.send_base != nullptr && args.combined_x != nullptr),
             "zero-copy combine needs the handle's routing, destination slots and send_base (from a "
             "zero_copy_recv dispatch) and an output");
  combine_impl_pull<<<args.num_sms, kPullThreads, 0, stream>>>(args);
  EP_CHECK_LAUNCH("ht combine_impl_pull");
}

void preload_ht_combine_pull_kernels() {
  preload_kernel(combine_impl_pull, "ht zero-copy combine (combine_impl_pull)");
}

}  // namespace deep_ep::ht
