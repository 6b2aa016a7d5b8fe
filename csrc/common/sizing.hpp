// Size hints: validated requests turned into region sizes through geometry.hpp. The buffer, the
// static size hints and the planner all call these, so the numbers they report are the bytes the
// buffer allocates.
#pragma once

#include <cstdint>

#include "common/geometry.hpp"

namespace deep_ep {

struct HighThroughputRequest {
  int num_ranks = 1;
  int num_scaleup_ranks = 1;  // ranks per (possibly emulated) node; == num_ranks in direct mode
  int64_t num_max_tokens_per_rank = 0;
  int hidden = 0;
  int num_topk = 0;  // 0: size for kMaxTopK
  bool use_fp8 = false;
  bool zero_copy_combine = false;  // direct mode: room for the combine input rows (pull combine)
};

struct LowLatencyRequest {
  int num_ranks = 1;
  int64_t num_max_tokens_per_rank = 0;
  int hidden = 0;
  int num_experts = 0;
  int num_topk = 0;  // 0: size for min(kMaxTopK, num_experts)
};

// Top-k the regions are sized for when the caller does not say.
int resolve_high_throughput_topk(int num_topk);
int resolve_low_latency_topk(int num_topk, int num_experts);

// Throw std::invalid_argument naming the argument, the value and the rule.
HighThroughputLayout high_throughput_layout(const HighThroughputRequest& request);
LowLatencyLayout low_latency_layout(const LowLatencyRequest& request);
// Whole window for both parts (either may be empty: T_max == 0).
WindowLayout buffer_window(const HighThroughputRequest& ht, const LowLatencyRequest& ll);

}  // namespace deep_ep
