// HT dispatch/combine launchers for Python: tensors cross as data_ptr() integers (0 = none),
// streams as cuda_stream integers. Shapes are validated in deep_ep/high_throughput.py; the checks
// here only guard the window. `input_failed`: this rank's input failed its host checks and it takes
// part without data; its peers record that (deep_ep.PeerInputError).
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/geometry.hpp"
#include "kernels/high_throughput.hpp"
#include "python/binding_utils.hpp"
#include "runtime/runtime.hpp"

namespace py = pybind11;

namespace deep_ep {
namespace {

enum class HtOperation { kDispatch, kCombine };

// The direct-mode footprint of this call shape must fit the buffer's HT region.
void check_fits(const Runtime& runtime, HtOperation operation, int64_t num_max_tokens_per_rank, int hidden,
                int num_topk, bool use_fp8) {
  const HighThroughputLayout layout =
      ht::direct_layout(runtime.device_view().num_ranks, num_max_tokens_per_rank, hidden, num_topk, use_fp8);
  const bool dispatch = operation == HtOperation::kDispatch;
  const int64_t needed = dispatch ? layout.dispatch_bytes : layout.combine_bytes;
  const int64_t available = runtime.window().ht_bytes;
  if (needed > available) {
    throw std::invalid_argument(std::string(dispatch ? "dispatch" : "combine") + " needs " + std::to_string(needed) +
                                " bytes of the HT region, the buffer has " + std::to_string(available));
  }
}

}  // namespace

void register_high_throughput(py::module_& m) {
  m.attr("HT_MAPPED_NUM_RECV_TOKENS") = ht::kMappedNumRecvTokens;
  m.attr("HT_MAPPED_NUM_EXPANDED_TOKENS") = ht::kMappedNumExpandedTokens;
  m.attr("HT_MAPPED_ALIGNED_EXPERT_COUNTS") = ht::kMappedAlignedExpertCounts;
  m.attr("HT_MAPPED_READY") = ht::kMappedReady;
  m.attr("HT_SRC_METADATA_COLUMNS") = ht::kSrcMetadataColumns;

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
      [](int64_t num_tokens, int num_experts, int num_ranks) {
        return ht::notify_scratch_ints(num_tokens, num_experts, num_ranks);
      },
      py::arg("num_tokens"), py::arg("num_experts"), py::arg("num_ranks"));

  m.def(
      "ht_notify",
      [](Runtime& runtime, std::uintptr_t topk_idx, std::uintptr_t topk_idx_copy, int num_tokens, int num_topk,
         int num_experts, int expert_alignment, bool do_expand, std::uintptr_t expert_slot, std::uintptr_t dst_slot,
         std::uintptr_t scratch, std::uintptr_t counts, bool cpu_sync, int num_sms, std::uintptr_t stream,
         bool input_failed) {
        ht::NotifyArgs args;
        args.view = runtime.device_view();
        args.topk_idx = pointer<const int64_t>(topk_idx);
        args.topk_idx_copy = pointer<int64_t>(topk_idx_copy);
        args.num_tokens = num_tokens;
        args.num_topk = num_topk;
        args.num_experts = num_experts;
        args.expert_alignment = expert_alignment;
        args.do_expand = do_expand;
        args.expert_slot = pointer<int32_t>(expert_slot);
        args.dst_slot = pointer<int32_t>(dst_slot);
        args.scratch = pointer<int32_t>(scratch);
        args.counts = pointer<int32_t>(counts);
        args.mapped_counters = cpu_sync ? runtime.mapped_counters_device() : nullptr;
        args.num_sms = num_sms;
        args.input_failed = input_failed;
        ht::launch_notify(args, as_stream(stream));
      },
      py::arg("runtime"), py::arg("topk_idx"), py::arg("topk_idx_copy"), py::arg("num_tokens"), py::arg("num_topk"),
      py::arg("num_experts"), py::arg("expert_alignment"), py::arg("do_expand"), py::arg("expert_slot"),
      py::arg("dst_slot"), py::arg("scratch"), py::arg("counts"), py::arg("cpu_sync"), py::arg("num_sms"),
      py::arg("stream"), py::arg("input_failed") = false);

  m.def(
      "ht_dispatch",
      [](Runtime& runtime, int64_t num_max_tokens_per_rank, int hidden, bool use_fp8, int num_topk, int num_experts,
         int num_tokens, std::uintptr_t x, std::uintptr_t x_scales, std::uintptr_t topk_idx,
         std::uintptr_t topk_weights, std::uintptr_t dst_slot, std::uintptr_t expert_slot, bool entry_barrier,
         int num_sms, std::uintptr_t stream, bool input_failed) {
        ht::DispatchArgs args;
        args.view = runtime.device_view();
        check_fits(runtime, HtOperation::kDispatch, num_max_tokens_per_rank, hidden, num_topk, use_fp8);
        args.ht_offset = runtime.window().ht_offset;
        args.num_max_tokens_per_rank = num_max_tokens_per_rank;
        args.hidden = hidden;
        args.use_fp8 = use_fp8;
        args.num_topk = num_topk;
        args.num_experts = num_experts;
        args.num_tokens = num_tokens;
        args.x = pointer<const void>(x);
        args.x_scales = pointer<const float>(x_scales);
        args.topk_idx = pointer<const int64_t>(topk_idx);
        args.topk_weights = pointer<const float>(topk_weights);
        args.dst_slot = pointer<const int32_t>(dst_slot);
        args.expert_slot = pointer<const int32_t>(expert_slot);
        args.entry_barrier = entry_barrier;
        args.num_sms = num_sms;
        args.input_failed = input_failed;
        ht::launch_dispatch(args, as_stream(stream));
      },
      py::arg("runtime"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"), py::arg("use_fp8"),
      py::arg("num_topk"), py::arg("num_experts"), py::arg("num_tokens"), py::arg("x"), py::arg("x_scales"),
      py::arg("topk_idx"), py::arg("topk_weights"), py::arg("dst_slot"), py::arg("expert_slot"),
      py::arg("entry_barrier"), py::arg("num_sms"), py::arg("stream"), py::arg("input_failed") = false);

  m.def(
      "ht_dispatch_epilogue",
      [](Runtime& runtime, int64_t num_max_tokens_per_rank, int hidden, bool use_fp8, int num_topk, int num_experts,
         bool do_expand, int expert_alignment, bool has_weights, std::uintptr_t counts, int64_t num_rows_allocated,
         int64_t num_meta_rows_allocated, std::uintptr_t recv_x, std::uintptr_t recv_x_scales,
         std::uintptr_t recv_topk_idx, std::uintptr_t recv_topk_weights, std::uintptr_t recv_src_metadata,
         std::uintptr_t recv_expanded_rows, int num_ctas, std::uintptr_t stream) {
        ht::EpilogueArgs args;
        args.view = runtime.device_view();
        check_fits(runtime, HtOperation::kDispatch, num_max_tokens_per_rank, hidden, num_topk, use_fp8);
        args.ht_offset = runtime.window().ht_offset;
        args.num_max_tokens_per_rank = num_max_tokens_per_rank;
        args.hidden = hidden;
        args.use_fp8 = use_fp8;
        args.num_topk = num_topk;
        args.num_experts = num_experts;
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
        args.recv_src_metadata = pointer<int32_t>(recv_src_metadata);
        args.recv_expanded_rows = pointer<int32_t>(recv_expanded_rows);
        args.num_ctas = num_ctas;
        ht::launch_dispatch_epilogue(args, as_stream(stream));
      },
      py::arg("runtime"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"), py::arg("use_fp8"),
      py::arg("num_topk"), py::arg("num_experts"), py::arg("do_expand"), py::arg("expert_alignment"),
      py::arg("has_weights"), py::arg("counts"), py::arg("num_rows_allocated"), py::arg("num_meta_rows_allocated"),
      py::arg("recv_x"), py::arg("recv_x_scales"), py::arg("recv_topk_idx"), py::arg("recv_topk_weights"),
      py::arg("recv_src_metadata"), py::arg("recv_expanded_rows"), py::arg("num_ctas"), py::arg("stream"));

  m.def(
      "ht_combine",
      [](Runtime& runtime, int64_t num_max_tokens_per_rank, int hidden, int num_topk, bool do_expand, std::uintptr_t x,
         std::uintptr_t topk_weights, std::uintptr_t counts, std::uintptr_t recv_src_metadata,
         std::uintptr_t recv_expanded_rows, int64_t num_meta_rows, int num_sms, std::uintptr_t stream,
         bool input_failed) {
        ht::CombineArgs args;
        args.view = runtime.device_view();
        check_fits(runtime, HtOperation::kCombine, num_max_tokens_per_rank, hidden, num_topk, false);
        args.ht_offset = runtime.window().ht_offset;
        args.num_max_tokens_per_rank = num_max_tokens_per_rank;
        args.hidden = hidden;
        args.num_topk = num_topk;
        args.do_expand = do_expand;
        args.x = pointer<const void>(x);
        args.topk_weights = pointer<const float>(topk_weights);
        args.counts = pointer<const int32_t>(counts);
        args.recv_src_metadata = pointer<const int32_t>(recv_src_metadata);
        args.recv_expanded_rows = pointer<const int32_t>(recv_expanded_rows);
        args.num_meta_rows = num_meta_rows;
        args.num_sms = num_sms;
        args.input_failed = input_failed;
        ht::launch_combine(args, as_stream(stream));
      },
      py::arg("runtime"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"), py::arg("num_topk"),
      py::arg("do_expand"), py::arg("x"), py::arg("topk_weights"), py::arg("counts"), py::arg("recv_src_metadata"),
      py::arg("recv_expanded_rows"), py::arg("num_meta_rows"), py::arg("num_sms"), py::arg("stream"),
      py::arg("input_failed") = false);

  m.def(
      "ht_combine_reduce",
      [](Runtime& runtime, int64_t num_max_tokens_per_rank, int hidden, int num_topk, int num_experts, int num_tokens,
         std::uintptr_t topk_idx, std::uintptr_t bias0, std::uintptr_t bias1, std::uintptr_t combined_x,
         std::uintptr_t combined_topk_weights, int num_ctas, std::uintptr_t stream) {
        ht::ReduceArgs args;
        args.view = runtime.device_view();
        check_fits(runtime, HtOperation::kCombine, num_max_tokens_per_rank, hidden, num_topk, false);
        args.ht_offset = runtime.window().ht_offset;
        args.num_max_tokens_per_rank = num_max_tokens_per_rank;
        args.hidden = hidden;
        args.num_topk = num_topk;
        args.num_experts = num_experts;
        args.num_tokens = num_tokens;
        args.topk_idx = pointer<const int64_t>(topk_idx);
        args.bias0 = pointer<const void>(bias0);
        args.bias1 = pointer<const void>(bias1);
        args.combined_x = pointer<void>(combined_x);
        args.combined_topk_weights = pointer<float>(combined_topk_weights);
        args.num_ctas = num_ctas;
        ht::launch_combine_reduce(args, as_stream(stream));
      },
      py::arg("runtime"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"), py::arg("num_topk"),
      py::arg("num_experts"), py::arg("num_tokens"), py::arg("topk_idx"), py::arg("bias0"), py::arg("bias1"),
      py::arg("combined_x"), py::arg("combined_topk_weights"), py::arg("num_ctas"), py::arg("stream"));
}

}  // namespace deep_ep
