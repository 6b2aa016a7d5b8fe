// Every launcher refuses a grid larger than the rank's SM cap (RuntimeConfig::max_num_sms) before
// touching the GPU: a grid that cannot stay resident deadlocks in its grid syncs. Runs without one.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "common/device_view.hpp"
#include "kernels/high_throughput.hpp"

namespace deep_ep {
namespace {

DeviceView view_with_cap(int max_num_sms) {
  DeviceView view;
  view.rank = 0;
  view.num_ranks = 2;
  view.num_scaleup_ranks = 2;
  view.max_num_sms = max_num_sms;
  return view;
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

TEST(GridSizeCheck, HighThroughputLaunchersRefuseAGridAboveTheCap) {
  ht::NotifyArgs notify;
  notify.view = view_with_cap(4);
  notify.num_experts = 8;
  notify.num_topk = 2;
  notify.num_sms = 5;
  EXPECT_NE(refusal([&] { ht::launch_notify(notify, nullptr); }).find("got 5"), std::string::npos);

  ht::DispatchArgs dispatch;
  dispatch.view = view_with_cap(4);
  dispatch.num_experts = 8;
  dispatch.num_topk = 2;
  dispatch.hidden = 8;
  dispatch.num_max_tokens_per_rank = 1;
  dispatch.num_sms = 8;
  EXPECT_NE(refusal([&] { ht::launch_dispatch(dispatch, nullptr); }).find("got 8"), std::string::npos);

  ht::CombineArgs combine;
  combine.view = view_with_cap(4);
  combine.num_topk = 2;
  combine.hidden = 8;
  combine.num_sms = 6;
  EXPECT_NE(refusal([&] { ht::launch_combine(combine, nullptr); }).find("got 6"), std::string::npos);

  ht::EpilogueArgs epilogue;
  epilogue.view = view_with_cap(4);
  epilogue.num_ctas = 9;
  EXPECT_NE(refusal([&] { ht::launch_dispatch_epilogue(epilogue, nullptr); }).find("num_ctas"), std::string::npos);

  ht::ReduceArgs reduce;
  reduce.view = view_with_cap(4);
  reduce.num_topk = 2;
  reduce.hidden = 8;
  reduce.num_ctas = 7;
  EXPECT_NE(refusal([&] { ht::launch_combine_reduce(reduce, nullptr); }).find("got 7"), std::string::npos);
}

}  // namespace
}  // namespace deep_ep
