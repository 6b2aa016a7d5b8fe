// Geometry and size hints for Python: the planner and ElasticBuffer read these numbers instead of
// recomputing them.
#include <pybind11/pybind11.h>

#include "common/geometry.hpp"
#include "common/sizing.hpp"

namespace py = pybind11;

namespace deep_ep {

void register_geometry(py::module_& m) {
  m.attr("WINDOW_ALIGN_BYTES") = kWindowAlignBytes;
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("MAX_TOPK") = kMaxTopK;
  m.attr("WORKSPACE_BYTES") = WorkspaceLayout::bytes;
  m.attr("FP8_GROUP_SIZE") = kFp8GroupSize;

  m.def(
      "high_throughput_layout",
      [](int num_ranks, int num_scaleup_ranks, int64_t num_max_tokens_per_rank, int hidden, int num_topk, bool use_fp8,
         bool zero_copy_combine) {
        const HighThroughputLayout layout = high_throughput_layout(HighThroughputRequest{
            num_ranks, num_scaleup_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8, zero_copy_combine});
        py::dict d;
        d["num_topk"] = resolve_high_throughput_topk(num_topk);
        d["dispatch_token_bytes"] = layout.dispatch_token.bytes;
        d["combine_token_bytes"] = layout.combine_token.bytes;
        d["dispatch_bytes"] = layout.dispatch_bytes;
        d["combine_bytes"] = layout.combine_bytes;
        d["region_bytes"] = layout.region_bytes;
        d["dispatch_recv_offset"] = layout.dispatch_recv_offset;
        d["dispatch_recv_bytes"] = layout.dispatch_recv_bytes;
        d["combine_recv_offset"] = layout.combine_recv_offset;
        d["combine_recv_bytes"] = layout.combine_recv_bytes;
        d["scaleout_send_bytes"] = layout.scaleout_send_bytes;
        d["scaleout_recv_bytes"] = layout.scaleout_recv_bytes;
        d["zero_copy_combine_bytes"] = layout.zero_copy_combine_bytes;
        return d;
      },
      py::arg("num_ranks"), py::arg("num_scaleup_ranks"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"),
      py::arg("num_topk"), py::arg("use_fp8"), py::arg("zero_copy_combine") = false);

  m.def(
      "low_latency_layout",
      [](int num_ranks, int64_t num_max_tokens_per_rank, int hidden, int num_experts, int num_topk) {
        const LowLatencyLayout layout =
            low_latency_layout(LowLatencyRequest{num_ranks, num_max_tokens_per_rank, hidden, num_experts, num_topk});
        py::dict d;
        d["num_topk"] = layout.num_topk;
        d["num_local_experts"] = layout.num_local_experts;
        d["num_max_tokens"] = layout.num_max_tokens;
        d["area_bytes"] = layout.area_bytes;
        d["region_bytes"] = layout.region_bytes;
        d["dispatch_payload_offset"] = layout.dispatch_payload_offset;
        d["dispatch_scales_offset"] = layout.dispatch_scales_offset;
        d["dispatch_headers_offset"] = layout.dispatch_headers_offset;
        d["dispatch_counts_offset"] = layout.dispatch_counts_offset;
        d["combine_payload_offset"] = layout.combine_payload_offset;
        d["combine_flags_offset"] = layout.combine_flags_offset;
        return d;
      },
      py::arg("num_ranks"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"),
      py::arg("num_topk"));

  m.def(
      "low_latency_message_bytes", [](int hidden, bool use_fp8) { return low_latency_message_bytes(hidden, use_fp8); },
      py::arg("hidden"), py::arg("use_fp8"));

  m.def(
      "window_layout",
      [](int64_t ht_region_bytes, int64_t ll_region_bytes) {
        const WindowLayout layout = window_layout(ht_region_bytes, ll_region_bytes);
        py::dict d;
        d["workspace_bytes"] = layout.workspace_bytes;
        d["ht_offset"] = layout.ht_offset;
        d["ht_bytes"] = layout.ht_bytes;
        d["ll_offset"] = layout.ll_offset;
        d["ll_bytes"] = layout.ll_bytes;
        d["total_bytes"] = layout.total_bytes;
        return d;
      },
      py::arg("ht_region_bytes"), py::arg("ll_region_bytes"));
}

}  // namespace deep_ep
