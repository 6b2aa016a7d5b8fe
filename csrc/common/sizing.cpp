#include "common/sizing.hpp"

#include <string>

#include "common/require.hpp"

namespace deep_ep {
namespace {

void check_ranks(int num_ranks) {
  EP_REQUIRE(num_ranks >= 1 && num_ranks <= kMaxRanks,
             "num_ranks must be in [1, " + std::to_string(kMaxRanks) + "], got " + std::to_string(num_ranks));
}

// `whole_groups_reason` is empty when any multiple of 8 will do, else why hidden needs whole
// 128-channel groups (one fp32 scale per group).
void check_hidden(int hidden, const std::string& whole_groups_reason) {
  EP_REQUIRE(hidden > 0, "hidden must be positive, got " + std::to_string(hidden));
  // Rows move in 16-byte vectors: bf16 needs hidden % 8 == 0.
  EP_REQUIRE(hidden % 8 == 0, "hidden must be a multiple of 8 (16-byte rows), got " + std::to_string(hidden));
  if (!whole_groups_reason.empty()) {
    EP_REQUIRE(hidden % kFp8GroupSize == 0,
               "hidden must be a multiple of 128 " + whole_groups_reason + ", got " + std::to_string(hidden));
  }
}

void check_topk(int num_topk) {
  EP_REQUIRE(num_topk >= 0 && num_topk <= kMaxTopK, "num_topk must be in [0, " + std::to_string(kMaxTopK) +
                                                        "] (0 = size for the maximum), got " +
                                                        std::to_string(num_topk));
}

}  // namespace

int resolve_high_throughput_topk(int num_topk) { return num_topk == 0 ? kMaxTopK : num_topk; }

int resolve_low_latency_topk(int num_topk, int num_experts) {
  return num_topk == 0 ? std::min(kMaxTopK, num_experts) : num_topk;
}

HighThroughputLayout high_throughput_layout(const HighThroughputRequest& request) {
  check_ranks(request.num_ranks);
  EP_REQUIRE(request.num_max_tokens_per_rank >= 0,
             "num_max_tokens_per_rank must be >= 0, got " + std::to_string(request.num_max_tokens_per_rank));
  EP_REQUIRE(request.num_scaleup_ranks >= 1 && request.num_ranks % request.num_scaleup_ranks == 0,
             "num_ranks_per_node must divide num_ranks (" + std::to_string(request.num_ranks) + "), got " +
                 std::to_string(request.num_scaleup_ranks));
  check_topk(request.num_topk);
  if (request.num_max_tokens_per_rank == 0) return HighThroughputLayout{};
  check_hidden(request.hidden, request.use_fp8 ? "for fp8 (one scale per 128 channels)" : "");
  const Topology topology{request.num_ranks, request.num_scaleup_ranks};
  EP_REQUIRE(!request.zero_copy_combine || !topology.is_hybrid(),
             "zero_copy_combine is direct mode only (the buffer spans " +
                 std::to_string(topology.num_scaleout_ranks()) + " nodes)");
  HighThroughputLayout layout =
      deep_ep::high_throughput_layout(topology, request.num_max_tokens_per_rank, request.hidden,
                                      resolve_high_throughput_topk(request.num_topk), request.use_fp8);
  if (request.zero_copy_combine) {
    layout.region_bytes = max_of(layout.region_bytes, align_up(layout.zero_copy_combine_bytes, kWindowAlignBytes));
  }
  return layout;
}

LowLatencyLayout low_latency_layout(const LowLatencyRequest& request) {
  check_ranks(request.num_ranks);
  EP_REQUIRE(request.num_max_tokens_per_rank >= 0,
             "num_max_dispatch_tokens_per_rank must be >= 0, got " + std::to_string(request.num_max_tokens_per_rank));
  check_topk(request.num_topk);
  if (request.num_max_tokens_per_rank == 0) return LowLatencyLayout{};
  // The LL region always reserves fp8 scales, whichever format a call uses.
  check_hidden(request.hidden, "for the low-latency region (it reserves one fp8 scale per 128 channels)");
  EP_REQUIRE(
      request.num_experts > 0 && request.num_experts <= kMaxExperts,
      "num_experts must be in [1, " + std::to_string(kMaxExperts) + "], got " + std::to_string(request.num_experts));
  EP_REQUIRE(request.num_experts % request.num_ranks == 0, "num_experts (" + std::to_string(request.num_experts) +
                                                               ") must be a multiple of num_ranks (" +
                                                               std::to_string(request.num_ranks) + ")");
  return deep_ep::low_latency_layout(request.num_max_tokens_per_rank, request.hidden, request.num_ranks,
                                     request.num_experts,
                                     resolve_low_latency_topk(request.num_topk, request.num_experts));
}

WindowLayout buffer_window(const HighThroughputRequest& ht, const LowLatencyRequest& ll) {
  return window_layout(high_throughput_layout(ht).region_bytes, low_latency_layout(ll).region_bytes);
}

}  // namespace deep_ep
