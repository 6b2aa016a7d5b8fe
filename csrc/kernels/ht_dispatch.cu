// HT dispatch: every token row goes once to every rank that holds one of its experts, straight
// into that rank's receive slot [my rank][slot]; the slot comes from the notify prefix (or the
// cached handle), so no atomics and a deterministic (source, token) receive order.
//
// One warp per token: the row is read once and stored to each destination (the rank's own copy
// is a local store on the same path). The slot carries payload, fp8 scales, the K global expert
// ids, K weights, K per-expert slots and the source token index, so the receiver needs nothing else.
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/require.hpp"
#include "kernels/barrier.cuh"
#include "kernels/high_throughput.hpp"
#include "kernels/ht_common.cuh"

namespace deep_ep::ht {
namespace {

constexpr int kDispatchThreads = 512;
constexpr int kDispatchWarps = kDispatchThreads / 32;
constexpr int kCopyUnroll = 8;

__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch_kernel(const DispatchArgs args) {
  const DeviceView& view = args.view;
  if (args.entry_barrier) {
    // Cached dispatch: no notify kernel passed the entry barrier for us.
    if (blockIdx.x == 0 && !rank_barrier(view, Operation::kHtDispatch, args.input_failed)) return;
    if (!grid_sync(view, Operation::kHtDispatch, kGridSlotDispatch)) return;
  }

  const int lane = lane_id();
  const int num_topk = args.num_topk;
  const int num_experts = args.num_experts;
  const int num_local = num_experts / view.num_ranks;
  const TokenLayout token = dispatch_token_layout(args.hidden, args.use_fp8, num_topk);
  const int64_t row_bytes = int64_t{args.hidden} * (args.use_fp8 ? 1 : 2);
  const int64_t num_vectors = row_bytes / kVectorBytes;
  const int num_scales = args.use_fp8 ? args.hidden / kFp8GroupSize : 0;
  const int64_t my_rows = int64_t{view.rank} * args.num_max_tokens_per_rank;
  const auto* x = static_cast<const uint8_t*>(args.x);

  const int first_warp = static_cast<int>(blockIdx.x * kDispatchWarps + threadIdx.x / 32);
  for (int t = first_warp; t < args.num_tokens; t += gridDim.x * kDispatchWarps) {
    const int64_t entry = int64_t{t} * num_topk + lane;
    int expert = -1;
    int slot = -1;
    if (lane < num_topk) {
      expert = handle_expert(args.topk_idx, entry, num_experts);
      slot = args.dst_slot[entry];
    }
    const bool sends = slot >= 0 && expert >= 0;
    const uint32_t dst_lanes = __ballot_sync(kFullMask, sends);
    if (dst_lanes == 0) continue;
    uint8_t* my_slot = nullptr;
    if (sends) my_slot = view.peer<uint8_t>(expert / num_local, args.ht_offset + (my_rows + slot) * token.bytes);

    warp_copy_to_lanes<kCopyUnroll>(reinterpret_cast<const int4*>(x + t * row_bytes), num_vectors, dst_lanes,
                                    reinterpret_cast<int4*>(my_slot));
    if (num_scales > 0) {
      warp_copy_words_to_lanes(args.x_scales + int64_t{t} * num_scales, num_scales, dst_lanes,
                               my_slot == nullptr ? nullptr : reinterpret_cast<float*>(my_slot + token.scale_offset));
    }
    // Lane k carries entry k to every destination; the expert ids are sanitized, so a receiver
    // never sees an id outside [-1, E).
    const int32_t expert_slot = lane < num_topk ? args.expert_slot[entry] : -1;
    const float weight = (lane < num_topk && args.topk_weights != nullptr) ? args.topk_weights[entry] : 0.0f;
    for (uint32_t lanes = dst_lanes; lanes != 0; lanes &= lanes - 1) {
      const int owner = __ffs(lanes) - 1;
      auto* dst =
          reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_slot), owner));
      if (lane < num_topk) {
        reinterpret_cast<int32_t*>(dst + token.topk_idx_offset)[lane] = expert;
        reinterpret_cast<int32_t*>(dst + token.expert_slot_offset)[lane] = expert_slot;
        if (args.topk_weights != nullptr) reinterpret_cast<float*>(dst + token.weights_offset)[lane] = weight;
      }
      if (lane == 0) *reinterpret_cast<int32_t*>(dst + token.src_offset) = t;
    }
  }

  // grid_sync fences every CTA's stores at system scope; CTA 0's barrier then releases them to all
  // peers and waits until every peer has released theirs to us: the epilogue may read.
  if (!grid_sync(view, Operation::kHtDispatch, kGridSlotDispatch)) return;
  if (blockIdx.x == 0) rank_barrier(view, Operation::kHtDispatch);
}

}  // namespace

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  const int num_ranks = args.view.num_ranks;
  check_grid_size(args.view, "num_sms", args.num_sms);
  EP_REQUIRE(args.num_topk >= 1 && args.num_topk <= kMaxTopK,
             "num_topk must be in [1, " + std::to_string(kMaxTopK) + "], got " + std::to_string(args.num_topk));
  EP_REQUIRE(args.num_experts >= 1 && args.num_experts % num_ranks == 0,
             "num_experts must be a positive multiple of num_ranks, got " + std::to_string(args.num_experts));
  EP_REQUIRE(args.num_tokens <= args.num_max_tokens_per_rank, "num_tokens (" + std::to_string(args.num_tokens) +
                                                                  ") exceeds num_max_tokens_per_rank (" +
                                                                  std::to_string(args.num_max_tokens_per_rank) + ")");
  EP_REQUIRE((int64_t{args.hidden} * (args.use_fp8 ? 1 : 2)) % kVectorBytes == 0,
             "hidden row bytes must be a multiple of 16, got hidden=" + std::to_string(args.hidden));
  EP_REQUIRE(!args.use_fp8 || args.hidden % kFp8GroupSize == 0,
             "hidden must be a multiple of 128 for fp8, got " + std::to_string(args.hidden));
  dispatch_kernel<<<args.num_sms, kDispatchThreads, 0, stream>>>(args);
  EP_CHECK_LAUNCH("ht dispatch_kernel");
}

}  // namespace deep_ep::ht
