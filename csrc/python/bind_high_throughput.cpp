// HT dispatch/combine launchers for Python: tensors cross as data_ptr() integers (0 = none),
// streams as cuda_stream integers, the call shape as an HtCall built once per shape (ht_call).
// Shapes are validated in deep_ep/high_throughput.py; the checks here only guard the window. `input_failed`: this
// rank's input failed its host checks and it takes part without data; its peers record that (deep_ep.PeerInputError).
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/geometry.hpp"
#include "common/ht_call.hpp"
#include "kernels/high_throughput.hpp"
#include "python/binding_utils.hpp"
#include "python/ht_launchers.hpp"
#include "runtime/runtime.hpp"

namespace py = pybind11;

namespace deep_ep {
namespace {

ht::HybridRouting hybrid_routing(const HtCall& call, std::uintptr_t block, int64_t num_tokens) {
  if (!call.hybrid()) return ht::HybridRouting{};
  return ht::hybrid_routing(pointer<int32_t>(block), call, num_tokens);
}

}  // namespace

// The call description of one shape on this buffer: topology from the runtime (so the mode follows
// from the buffer), layout resolved once; Python caches it per shape. A combine-only call (combine
// and its reduce touch the combine areas only) needs only the combine footprint, which does not
// depend on the dispatch dtype: an fp8 dispatch sized to the region must not have its combine
// refused for the bf16 dispatch rows it never uses.
HtCall buffer_ht_call(const Runtime& runtime, int64_t num_max_tokens_per_rank, int hidden, int num_topk,
                      int num_experts, bool use_fp8, bool combine_only, bool zero_copy_recv) {
  const DeviceView& view = runtime.device_view();
  const Topology topology{view.num_ranks, view.num_scaleup_ranks};
  HtCall call = make_ht_call(topology, runtime.window().ht_offset, num_max_tokens_per_rank, hidden, num_topk,
                             num_experts, use_fp8, zero_copy_recv);
  const int64_t needed =
      combine_only ? call.layout.combine_bytes : std::max(call.layout.dispatch_bytes, call.layout.combine_bytes);
  const int64_t available = runtime.window().ht_bytes;
  if (needed > available) {
    throw std::invalid_argument("HT call (T_max=" + std::to_string(num_max_tokens_per_rank) +
                                ", H=" + std::to_string(hidden) + ", K=" + std::to_string(num_topk) + ") needs " +
                                std::to_string(needed) + " bytes of the HT region, the buffer has " +
                                std::to_string(available));
  }
  return call;
}

// The launchers (ht_launchers.hpp) take positional arguments: keyword matching costs host time on
// every call.
void launch_ht_notify(Runtime& runtime, const HtCall& call, std::uintptr_t topk_idx, std::uintptr_t topk_idx_copy,
                      int num_tokens, int expert_alignment, bool do_expand, std::uintptr_t expert_slot,
                      std::uintptr_t dst_slot, std::uintptr_t scratch, std::uintptr_t counts, bool cpu_sync,
                      std::uintptr_t send_base, std::uintptr_t rank_prefix_matrix, std::uintptr_t hybrid_block,
                      int num_sms, std::uintptr_t stream, bool input_failed) {
  ht::NotifyArgs args;
  args.view = runtime.device_view();
  args.call = call;
  args.topk_idx = pointer<const int64_t>(topk_idx);
  args.topk_idx_copy = pointer<int64_t>(topk_idx_copy);
  args.num_tokens = num_tokens;
  args.expert_alignment = expert_alignment;
  args.do_expand = do_expand;
  args.expert_slot = pointer<int32_t>(expert_slot);
  args.dst_slot = pointer<int32_t>(dst_slot);
  args.scratch = pointer<int32_t>(scratch);
  args.counts = pointer<int32_t>(counts);
  args.mapped_counters = cpu_sync ? runtime.mapped_counters_device() : nullptr;
  args.send_base = pointer<int32_t>(send_base);
  args.rank_prefix_matrix = pointer<int32_t>(rank_prefix_matrix);
  args.hybrid = hybrid_routing(call, hybrid_block, num_tokens);
  args.num_sms = num_sms;
  args.input_failed = input_failed;
  ht::launch_notify(args, as_stream(stream));
}

void launch_ht_dispatch(Runtime& runtime, const HtCall& call, int num_tokens, std::uintptr_t x, std::uintptr_t x_scales,
                        std::uintptr_t topk_idx, std::uintptr_t topk_weights, std::uintptr_t dst_slot,
                        std::uintptr_t expert_slot, std::uintptr_t send_base, std::uintptr_t hybrid_block,
                        bool entry_barrier, int num_sms, std::uintptr_t stream, bool input_failed) {
  ht::DispatchArgs args;
  args.view = runtime.device_view();
  args.call = call;
  args.num_tokens = num_tokens;
  args.x = pointer<const void>(x);
  args.x_scales = pointer<const float>(x_scales);
  args.topk_idx = pointer<const int64_t>(topk_idx);
  args.topk_weights = pointer<const float>(topk_weights);
  args.dst_slot = pointer<const int32_t>(dst_slot);
  args.expert_slot = pointer<const int32_t>(expert_slot);
  args.send_base = pointer<const int32_t>(send_base);
  args.hybrid = hybrid_routing(call, hybrid_block, num_tokens);
  args.entry_barrier = entry_barrier;
  args.num_sms = num_sms;
  args.input_failed = input_failed;
  ht::launch_dispatch(args, as_stream(stream));
}

void launch_ht_dispatch_epilogue(Runtime& runtime, const HtCall& call, bool do_expand, int expert_alignment,
                                 bool has_weights, std::uintptr_t counts, int64_t num_rows_allocated,
                                 int64_t num_meta_rows_allocated, std::uintptr_t recv_x, std::uintptr_t recv_x_scales,
                                 std::uintptr_t recv_topk_idx, std::uintptr_t recv_topk_weights,
                                 std::uintptr_t recv_src_info, std::uintptr_t recv_expanded_rows, int num_ctas,
                                 std::uintptr_t stream) {
  ht::EpilogueArgs args;
  args.view = runtime.device_view();
  args.call = call;
  args.do_expand = do_expand;
  args.expert_alignment = expert_alignment;
  args.has_weights = has_weights;
  args.counts = pointer<const int32_t>(counts);
  args.num_rows_allocated = num_rows_allocated;
  args.num_meta_rows_allocated = num_meta_rows_allocated;
  args.recv_x = pointer<void>(recv_x);
  args.recv_x_scales = pointer<float>(recv_x_scales);
  args.recv_topk_idx = pointer<int64_t>(recv_topk_idx);
  args.recv_topk_weights = pointer<float>(recv_topk_weights);
  args.recv_src_info = pointer<int32_t>(recv_src_info);
  args.recv_expanded_rows = pointer<int32_t>(recv_expanded_rows);
  args.num_ctas = num_ctas;
  ht::launch_dispatch_epilogue(args, as_stream(stream));
}

void launch_ht_combine(Runtime& runtime, const HtCall& call, bool do_expand, std::uintptr_t x,
                       std::uintptr_t topk_weights, bool sum_topk_weights, std::uintptr_t counts,
                       std::uintptr_t recv_src_info, std::uintptr_t recv_expanded_rows, int64_t num_meta_rows,
                       int num_tokens, std::uintptr_t topk_idx, std::uintptr_t hybrid_block, int num_sms,
                       std::uintptr_t stream, bool input_failed) {
  ht::CombineArgs args;
  args.view = runtime.device_view();
  args.call = call;
  args.do_expand = do_expand;
  args.x = pointer<const void>(x);
  args.topk_weights = pointer<const float>(topk_weights);
  args.sum_topk_weights = sum_topk_weights;
  args.counts = pointer<const int32_t>(counts);
  args.recv_src_info = pointer<const int32_t>(recv_src_info);
  args.recv_expanded_rows = pointer<const int32_t>(recv_expanded_rows);
  args.num_meta_rows = num_meta_rows;
  args.num_tokens = num_tokens;
  args.topk_idx = pointer<const int64_t>(topk_idx);
  args.hybrid = hybrid_routing(call, hybrid_block, num_tokens);
  args.num_sms = num_sms;
  args.input_failed = input_failed;
  ht::launch_combine(args, as_stream(stream));
}

void launch_ht_combine_reduce(Runtime& runtime, const HtCall& call, int num_tokens, std::uintptr_t topk_idx,
                              std::uintptr_t bias0, std::uintptr_t bias1, std::uintptr_t combined_x,
                              std::uintptr_t combined_topk_weights, bool sum_topk_weights, int num_ctas,
                              std::uintptr_t stream) {
  ht::ReduceArgs args;
  args.view = runtime.device_view();
  args.call = call;
  args.num_tokens = num_tokens;
  args.topk_idx = pointer<const int64_t>(topk_idx);
  args.bias0 = pointer<const void>(bias0);
  args.bias1 = pointer<const void>(bias1);
  args.combined_x = pointer<void>(combined_x);
  args.combined_topk_weights = pointer<float>(combined_topk_weights);
  args.sum_topk_weights = sum_topk_weights;
  args.num_ctas = num_ctas;
  ht::launch_combine_reduce(args, as_stream(stream));
}

void launch_ht_combine_pull(Runtime& runtime, const HtCall& call, int num_tokens, std::uintptr_t topk_idx,
                            std::uintptr_t dst_slot, std::uintptr_t send_base, std::uintptr_t bias0,
                            std::uintptr_t bias1, std::uintptr_t combined_x, std::uintptr_t combined_topk_weights,
                            bool sum_topk_weights, int num_sms, std::uintptr_t stream, bool input_failed) {
  ht::PullCombineArgs args;
  args.view = runtime.device_view();
  args.call = call;
  args.num_tokens = num_tokens;
  args.topk_idx = pointer<const int64_t>(topk_idx);
  args.dst_slot = pointer<const int32_t>(dst_slot);
  args.send_base = pointer<const int32_t>(send_base);
  args.bias0 = pointer<const void>(bias0);
  args.bias1 = pointer<const void>(bias1);
  args.combined_x = pointer<void>(combined_x);
  args.combined_topk_weights = pointer<float>(combined_topk_weights);
  args.sum_topk_weights = sum_topk_weights;
  args.num_sms = num_sms;
  args.input_failed = input_failed;
  ht::launch_pull_combine(args, as_stream(stream));
}

void register_high_throughput(py::module_& m) {
  m.attr("HT_MAPPED_NUM_RECV_TOKENS") = ht::kMappedNumRecvTokens;
  m.attr("HT_MAPPED_NUM_EXPANDED_TOKENS") = ht::kMappedNumExpandedTokens;
  m.attr("HT_MAPPED_ALIGNED_EXPERT_COUNTS") = ht::kMappedAlignedExpertCounts;
  m.attr("HT_MAPPED_READY") = ht::kMappedReady;
  m.attr("HT_SRC_INFO_COLUMNS") = ht::kSrcInfoColumns;
  m.attr("HT_MAX_CHANNELS") = kMaxChannels;

  py::class_<HtCall>(m, "HtCall")
      .def_property_readonly("hybrid", &HtCall::hybrid)
      .def_property_readonly("num_nodes", &HtCall::num_nodes)
      .def_property_readonly("ranks_per_node", &HtCall::ranks_per_node)
      .def_property_readonly("num_max_tokens_per_rank", &HtCall::num_max_tokens)
      .def_property_readonly("num_channels", &HtCall::num_channels)
      .def_property_readonly("hidden", [](const HtCall& call) { return call.hidden; })
      .def_property_readonly("num_topk", [](const HtCall& call) { return call.num_topk; })
      .def_property_readonly("num_experts", [](const HtCall& call) { return call.num_experts; })
      .def_property_readonly("use_fp8", [](const HtCall& call) { return call.use_fp8; })
      .def_property_readonly("zero_copy_recv", [](const HtCall& call) { return call.zero_copy_recv; })
      .def_property_readonly("zero_copy_payload_offset",
                             [](const HtCall& call) { return call.zero_copy_payload(0) - call.ht_offset; })
      .def_property_readonly("zero_copy_scales_offset",
                             [](const HtCall& call) { return call.zero_copy_scales(0) - call.ht_offset; })
      .def_property_readonly("combine_input_offset",
                             [](const HtCall& call) { return call.combine_input_row(0) - call.ht_offset; })
      .def_property_readonly("combine_input_weights_offset",
                             [](const HtCall& call) { return call.combine_input_weights(0) - call.ht_offset; })
      .def_property_readonly("zero_copy_combine_bytes",
                             [](const HtCall& call) { return call.layout.zero_copy_combine_bytes; })
      .def_property_readonly("scaleout_row_bytes", [](const HtCall& call) { return call.layout.scaleout_row_bytes; })
      .def_property_readonly("dispatch_bytes", [](const HtCall& call) { return call.layout.dispatch_bytes; })
      .def_property_readonly("combine_bytes", [](const HtCall& call) { return call.layout.combine_bytes; });

  m.def("ht_call", &buffer_ht_call, py::arg("runtime"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"),
        py::arg("num_topk"), py::arg("num_experts"), py::arg("use_fp8"), py::arg("combine_only"),
        py::arg("zero_copy_recv"));

  m.def(
      "ht_counts_layout",
      [](int num_ranks, int num_local_experts) {
        const ht::CountsLayout layout = ht::counts_layout(num_ranks, num_local_experts);
        py::dict d;
        d["recv_per_source"] = layout.recv_per_source;
        d["psum_per_source"] = layout.psum_per_source;
        d["expert_offsets"] = layout.expert_offsets;
        d["unaligned_per_expert"] = layout.unaligned_per_expert;
        d["expert_start"] = layout.expert_start;
        d["psum_per_expert"] = layout.psum_per_expert;
        d["total"] = layout.total;
        return d;
      },
      py::arg("num_ranks"), py::arg("num_local_experts"));

  m.def(
      "ht_notify_scratch_ints",
      [](const HtCall& call, int64_t num_tokens) { return ht::notify_scratch_ints(call, num_tokens); }, py::arg("call"),
      py::arg("num_tokens"));

  m.def(
      "ht_hybrid_routing_ints",
      [](const HtCall& call, int64_t num_tokens) { return ht::hybrid_routing_ints(call, num_tokens); }, py::arg("call"),
      py::arg("num_tokens"));

  m.def("ht_notify", &launch_ht_notify);

  m.def("ht_dispatch", &launch_ht_dispatch);

  m.def("ht_dispatch_epilogue", &launch_ht_dispatch_epilogue);

  m.def("ht_combine", &launch_ht_combine);

  m.def("ht_combine_reduce", &launch_ht_combine_reduce);

  m.def("ht_combine_pull", &launch_ht_combine_pull);
}

}  // namespace deep_ep
