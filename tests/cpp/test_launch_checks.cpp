// Every launcher refuses a grid larger than the rank's SM cap (RuntimeConfig::max_num_sms) before
// touching the GPU: a grid that cannot stay resident deadlocks in its grid syncs. Runs without one.
#include <gtest/gtest.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/device_view.hpp"
#include "common/sizing.hpp"
#include "kernels/high_throughput.hpp"
#include "kernels/low_latency.hpp"

namespace deep_ep {
namespace {

DeviceView view_with_cap(int max_num_sms, int max_ht_num_sms = 0) {
  DeviceView view;
  view.rank = 0;
  view.num_ranks = 2;
  view.num_scaleup_ranks = 2;
  view.max_num_sms = max_num_sms;
  view.max_ht_num_sms = max_ht_num_sms > 0 ? max_ht_num_sms : max_num_sms;
  return view;
}

// A 2-rank direct call shape: T_max 1, hidden 8, top-2 of 8 experts, bf16.
HtCall small_call(int num_scaleup_ranks = 2) {
  return make_ht_call(Topology{2, num_scaleup_ranks}, 0, 1, 8, 2, 8, false);
}

template <typename Launch>
std::string refusal(Launch&& launch) {
  try {
    launch();
  } catch (const std::invalid_argument& error) {
    return error.what();
  }
  return "";
}

TEST(GridSizeCheck, NamesTheCapAndTheValue) {
  EXPECT_NO_THROW(check_grid_size(view_with_cap(16), "num_sms", 16));
  EXPECT_NO_THROW(check_grid_size(view_with_cap(16), "num_sms", 1));
  const std::string message = refusal([] { check_grid_size(view_with_cap(16), "num_sms", 17); });
  EXPECT_NE(message.find("num_sms must be in [1, 16]"), std::string::npos) << message;
  EXPECT_NE(message.find("got 17"), std::string::npos) << message;
  EXPECT_FALSE(refusal([] { check_grid_size(view_with_cap(16), "num_ctas", 0); }).empty());
}

// What `launch` refuses (empty: nothing) for a small direct call on `view` with a grid of
// `num_ctas` in the argument field `grid` (num_sms or num_ctas).
template <typename Args>
std::string grid_refusal(void (*launch)(const Args&, cudaStream_t), int Args::*grid, int num_ctas,
                         const DeviceView& view) {
  Args args;
  args.view = view;
  args.call = small_call();
  args.*grid = num_ctas;
  return refusal([&] { launch(args, nullptr); });
}

TEST(GridSizeCheck, HighThroughputLaunchersRefuseAGridAboveTheCap) {
  const DeviceView view = view_with_cap(4);
  EXPECT_NE(grid_refusal(ht::launch_notify, &ht::NotifyArgs::num_sms, 5, view).find("got 5"), std::string::npos);
  EXPECT_NE(grid_refusal(ht::launch_dispatch, &ht::DispatchArgs::num_sms, 8, view).find("got 8"), std::string::npos);
  EXPECT_NE(grid_refusal(ht::launch_combine, &ht::CombineArgs::num_sms, 6, view).find("got 6"), std::string::npos);
  EXPECT_NE(grid_refusal(ht::launch_dispatch_epilogue, &ht::EpilogueArgs::num_ctas, 9, view).find("num_ctas"),
            std::string::npos);
  EXPECT_NE(grid_refusal(ht::launch_combine_reduce, &ht::ReduceArgs::num_ctas, 7, view).find("got 7"),
            std::string::npos);
}

// The notify indexes and divides routing entries as 31-bit ints (FastDivisor): T * K must stay below
// 2^31, and the launcher says so before touching the GPU.
TEST(NotifyCheck, RefusesMoreRoutingEntriesThanThirtyOneBitsIndex) {
  int64_t routing_copy = 0;  // never written: the launch is refused first
  ht::NotifyArgs notify;
  notify.view = view_with_cap(4);
  notify.call = small_call();  // K = 2
  notify.num_sms = 1;
  notify.topk_idx_copy = &routing_copy;
  notify.num_tokens = 1 << 30;
  const std::string message = refusal([&] { ht::launch_notify(notify, nullptr); });
  EXPECT_NE(message.find("num_tokens * num_topk must be below 2^31"), std::string::npos) << message;
  EXPECT_NE(message.find("1073741824 * 2"), std::string::npos) << message;
}

// Ranks sharing a GPU: the grid-synchronising HT kernels (notify, dispatch, combine) are held to the
// HT cap, the copy epilogue and the reduce (no spin, no grid sync) to the rank's full share.
TEST(GridSizeCheck, HighThroughputSendKernelsUseTheHtCap) {
  const std::string ht = refusal([] { check_ht_grid_size(view_with_cap(16, 8), "num_sms", 9); });
  EXPECT_NE(ht.find("num_sms must be in [1, 8]"), std::string::npos) << ht;
  EXPECT_NE(ht.find("SM cap for HT kernels"), std::string::npos) << ht;
  EXPECT_NO_THROW(check_ht_grid_size(view_with_cap(16, 8), "num_sms", 8));

  const DeviceView shared = view_with_cap(16, 8);
  const std::string cap = "SM cap for HT kernels";
  EXPECT_NE(grid_refusal(ht::launch_notify, &ht::NotifyArgs::num_sms, 9, shared).find(cap), std::string::npos);
  EXPECT_NE(grid_refusal(ht::launch_dispatch, &ht::DispatchArgs::num_sms, 9, shared).find(cap), std::string::npos);
  EXPECT_NE(grid_refusal(ht::launch_combine, &ht::CombineArgs::num_sms, 9, shared).find(cap), std::string::npos);

  // 12 CTAs: above the HT cap, within the full share. The epilogue launcher's grid check passes:
  // it refuses the call on a later check (an alignment of 0), not on the grid size.
  ht::EpilogueArgs epilogue;
  epilogue.view = view_with_cap(16, 8);
  epilogue.call = small_call();
  epilogue.num_ctas = 12;
  epilogue.expert_alignment = 0;
  const std::string later = refusal([&] { ht::launch_dispatch_epilogue(epilogue, nullptr); });
  EXPECT_NE(later.find("expert_alignment"), std::string::npos) << later;
}

// Zero-copy receive: the epilogue stores each recv_src_info row as one 16-byte vector, so the
// launcher refuses an array that is not 16-byte aligned (before touching the GPU).
TEST(EpilogueCheck, ZeroCopyNeedsSixteenByteAlignedSourceInfo) {
  ht::EpilogueArgs epilogue;
  epilogue.view = view_with_cap(4);
  epilogue.call = make_ht_call(Topology{2, 2}, 0, 1, 8, 2, 8, false, /*zero_copy_recv=*/true);
  epilogue.num_ctas = 1;
  epilogue.recv_src_info = reinterpret_cast<int32_t*>(uintptr_t{4096 + 4});
  const std::string message = refusal([&] { ht::launch_dispatch_epilogue(epilogue, nullptr); });
  EXPECT_NE(message.find("16-byte aligned"), std::string::npos) << message;
}

// LL across nodes: an fp8 row's H/128 fp32 scales travel in 16-byte puts, so H must be a multiple
// of 512 there; the same call by load/store is fine.
TEST(LowLatencyCheck, Fp8AcrossNodesNeedsScalesInWholeVectors) {
  LowLatencyDispatchArgs args;
  args.view = view_with_cap(4);
  args.layout = low_latency_layout(LowLatencyRequest{2, 4, 640, 4, 2});
  args.num_experts = 4;
  args.hidden = 640;
  args.num_tokens = 1;
  args.num_topk = 2;
  args.use_fp8 = true;
  args.num_sms = 5;  // above the cap: a call that passes the scales check fails on the grid size
  const std::string by_stores = refusal([&] { launch_low_latency_dispatch(args, LowLatencyPhases::kSend, nullptr); });
  EXPECT_NE(by_stores.find("num_sms"), std::string::npos) << by_stores;
  args.view.ll_ranks_per_node = 1;  // rank 1 is on another node
  const std::string across = refusal([&] { launch_low_latency_dispatch(args, LowLatencyPhases::kSend, nullptr); });
  EXPECT_NE(across.find("multiple of 512"), std::string::npos) << across;
  args.use_fp8 = false;  // bf16 rows need no scales
  const std::string bf16 = refusal([&] { launch_low_latency_dispatch(args, LowLatencyPhases::kSend, nullptr); });
  EXPECT_NE(bf16.find("num_sms"), std::string::npos) << bf16;
}

// A launch runs the phases named by a LowLatencyPhases value, which Python passes as an int: each
// launcher refuses a value outside the set before touching the GPU.
TEST(LowLatencyCheck, LaunchersRefusePhasesOutsideTheSet) {
  for (const LowLatencyPhases phases : {LowLatencyPhases::kSend, LowLatencyPhases::kReceive, LowLatencyPhases::kBoth}) {
    EXPECT_NO_THROW(check_low_latency_phases(phases));
  }
  LowLatencyDispatchArgs dispatch;
  dispatch.view = view_with_cap(4);
  dispatch.layout = low_latency_layout(LowLatencyRequest{2, 4, 640, 4, 2});
  dispatch.num_experts = 4;
  dispatch.hidden = 640;
  dispatch.num_tokens = 1;
  dispatch.num_topk = 2;
  dispatch.num_sms = 1;
  LowLatencyCombineArgs combine;
  combine.view = dispatch.view;
  combine.layout = dispatch.layout;
  combine.num_experts = 4;
  combine.hidden = 640;
  combine.num_tokens = 1;
  combine.num_topk = 2;
  combine.num_sms = 1;
  for (const int value : {0, 4, -1}) {
    const auto phases = static_cast<LowLatencyPhases>(value);
    const std::string by_dispatch = refusal([&] { launch_low_latency_dispatch(dispatch, phases, nullptr); });
    EXPECT_NE(by_dispatch.find("phases must be 1 (send), 2 (receive) or 3 (both), got " + std::to_string(value)),
              std::string::npos)
        << by_dispatch;
    const std::string by_combine = refusal([&] { launch_low_latency_combine(combine, phases, nullptr); });
    EXPECT_NE(by_combine.find("phases must be"), std::string::npos) << by_combine;
  }
}

// The mode follows from the buffer's topology: a call described for another topology (a hybrid
// shape on a direct buffer, here) is refused before any launch.
TEST(CallCheck, LaunchersRefuseACallOfAnotherTopology) {
  ht::DispatchArgs dispatch;
  dispatch.view = view_with_cap(4);
  dispatch.call = small_call(1);
  dispatch.num_sms = 1;
  const std::string message = refusal([&] { ht::launch_dispatch(dispatch, nullptr); });
  EXPECT_NE(message.find("another topology"), std::string::npos) << message;
}

// Hybrid launches need the handle's hybrid arrays.
TEST(CallCheck, HybridLaunchNeedsTheHybridArrays) {
  DeviceView view = view_with_cap(4);
  view.num_scaleup_ranks = 1;
  ht::CombineArgs combine;
  combine.view = view;
  combine.call = small_call(1);
  combine.num_sms = 1;
  const std::string message = refusal([&] { ht::launch_combine(combine, nullptr); });
  EXPECT_NE(message.find("num_channels"), std::string::npos) << message;
}

// A hybrid row stream's count must stay below the failed-input flag a cached dispatch adds to it.
TEST(CallCheck, HybridDispatchKeepsRowCountsBelowTheFailedFlag) {
  DeviceView view = view_with_cap(4);
  view.num_scaleup_ranks = 1;
  ht::DispatchArgs dispatch;
  dispatch.view = view;
  dispatch.call = make_ht_call(Topology{2, 1}, 0, kFailedInputSignalFlag, 8, 2, 8, false);
  dispatch.num_sms = 1;
  const std::string message = refusal([&] { ht::launch_dispatch(dispatch, nullptr); });
  EXPECT_NE(message.find("below the failed-input flag"), std::string::npos) << message;
  EXPECT_NE(message.find(std::to_string(kFailedInputSignalFlag)), std::string::npos) << message;
}

}  // namespace
}  // namespace deep_ep
