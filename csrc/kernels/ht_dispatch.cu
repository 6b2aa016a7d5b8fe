// HT dispatch, direct mode: every token row goes once to every rank that holds one of its experts, straight
// into that rank's receive slot [my rank][slot]; the slot comes from the notify prefix (or the
// cached handle), so no atomics and a deterministic (source, token) receive order.
//
// One warp per token: the row is read once and stored to each destination (the rank's own copy
// is a local store on the same path). The slot carries payload, fp8 scales, the K global expert
// ids, K weights, K per-expert slots and the source token index, so the receiver needs nothing else.
// Hybrid mode has its own kernel (ht_dispatch_hybrid.cu) behind the same launcher.
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/require.hpp"
#include "kernels/barrier.cuh"
#include "kernels/high_throughput.hpp"
#include "kernels/ht_common.cuh"
#include "kernels/phase_clock.cuh"
#include "kernels/preload.hpp"

namespace deep_ep::ht {
namespace {

constexpr int kDispatchThreads = 512;
constexpr int kDispatchWarps = kDispatchThreads / 32;
// 16 vectors per lane in flight: a whole fp8 row of H = 7168 (448 vectors) in one round of loads
// (109 registers). Within 2 % of 8 at 8 ranks on one H200 (HBM-bound there); not measured with one
// rank per GPU.
constexpr int kCopyUnroll = 16;

__global__ void __launch_bounds__(kDispatchThreads, 1) dispatch_impl(const DispatchArgs args) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  clock_phase(view, ClockedKernel::kHtDispatch, 0);
  if (args.entry_barrier) {
    // Cached dispatch: no notify kernel passed the entry barrier for us.
    if (blockIdx.x == 0 && !rank_barrier(view, Operation::kHtDispatch, args.input_failed)) return;
    if (!grid_sync(view, Operation::kHtDispatch, kGridSlotDispatch)) return;
    clock_phase(view, ClockedKernel::kHtDispatch, 1);
  }

  const int lane = lane_id();
  const int num_topk = call.num_topk;
  const auto* x = static_cast<const uint8_t*>(args.x);
  const int first_warp = static_cast<int>(blockIdx.x * kDispatchWarps + threadIdx.x / 32);
  for (int t = first_warp; t < args.num_tokens; t += gridDim.x * kDispatchWarps) {
    const int64_t entry = int64_t{t} * num_topk + lane;
    int expert = -1;
    int slot = -1;
    if (lane < num_topk) {
      expert = handle_expert(args.topk_idx, entry, call.num_experts);
      slot = args.dst_slot[entry];
    }
    const bool sends = slot >= 0 && expert >= 0;
    const uint32_t dst_lanes = __ballot_sync(kFullMask, sends);
    if (dst_lanes == 0) continue;
    const int32_t expert_slot = lane < num_topk ? args.expert_slot[entry] : -1;
    const float weight = (lane < num_topk && args.topk_weights != nullptr) ? args.topk_weights[entry] : 0.0f;
    const bool has_weights = args.topk_weights != nullptr;
    if (!call.zero_copy_recv) {
      uint8_t* my_slot =
          sends ? view.peer<uint8_t>(call.rank_of_expert(expert), call.dispatch_slot(view.rank, slot)) : nullptr;
      store_dispatch_slot<kCopyUnroll>(call, x, args.x_scales, has_weights, t, expert, expert_slot, weight, dst_lanes,
                                       my_slot);
    } else {
      // The row goes straight to its final position at the destination: this rank's first row
      // there (from notify) plus the token's ordinal among this rank's tokens for it.
      const int dest = sends ? call.rank_of_expert(expert) : 0;
      const int64_t row = sends ? int64_t{args.send_base[dest]} + slot : 0;
      uint8_t* my_payload = sends ? view.peer<uint8_t>(dest, call.zero_copy_payload(row)) : nullptr;
      float* my_scales = sends ? view.peer<float>(dest, call.zero_copy_scales(row)) : nullptr;
      uint8_t* my_meta = sends ? view.peer<uint8_t>(dest, call.dispatch_meta_slot(view.rank, slot)) : nullptr;
      store_dispatch_row<kCopyUnroll>(call, x, args.x_scales, has_weights, t, expert, expert_slot, weight, dst_lanes,
                                      my_payload, my_scales, my_meta);
    }
  }

  clock_phase(view, ClockedKernel::kHtDispatch, 2);
  // grid_sync fences every CTA's stores at system scope; CTA 0's barrier then releases them to all
  // peers and waits until every peer has released theirs to us: the epilogue may read.
  if (!grid_sync(view, Operation::kHtDispatch, kGridSlotDispatch)) return;
  clock_phase(view, ClockedKernel::kHtDispatch, 3);
  if (blockIdx.x == 0 && rank_barrier(view, Operation::kHtDispatch)) clock_phase(view, ClockedKernel::kHtDispatch, 4);
}

}  // namespace

void launch_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  check_ht_grid_size(args.view, "num_sms", args.num_sms);
  check_call(args.view, args.call);
  const HtCall& call = args.call;
  EP_REQUIRE(args.num_tokens <= call.num_max_tokens(), "num_tokens (" + std::to_string(args.num_tokens) +
                                                           ") exceeds num_max_tokens_per_rank (" +
                                                           std::to_string(call.num_max_tokens()) + ")");
  EP_REQUIRE(call.row_bytes() % kVectorBytes == 0,
             "hidden row bytes must be a multiple of 16, got hidden=" + std::to_string(call.hidden));
  EP_REQUIRE(!call.use_fp8 || call.hidden % kFp8GroupSize == 0,
             "hidden must be a multiple of 128 for fp8, got " + std::to_string(call.hidden));
  EP_REQUIRE(!call.zero_copy_recv || args.num_tokens == 0 || args.send_base != nullptr,
             "zero-copy receive needs the handle's send_base (from a notify with zero-copy receive)");
  if (call.hybrid()) {
    EP_REQUIRE(call.num_max_tokens() < kFailedInputSignalFlag,
               "hybrid dispatch needs num_max_tokens_per_rank < 2^24 (a row stream's count stays below the "
               "failed-input flag), got " +
                   std::to_string(call.num_max_tokens()));
    check_hybrid_routing(call, args.hybrid, args.num_tokens);
    launch_hybrid_dispatch(args, stream);
    return;
  }
  dispatch_impl<<<args.num_sms, kDispatchThreads, 0, stream>>>(args);
  EP_CHECK_LAUNCH("ht dispatch_impl");
}

void preload_ht_dispatch_kernels() { preload_kernel(dispatch_impl, "ht dispatch (dispatch_impl)"); }

}  // namespace deep_ep::ht
