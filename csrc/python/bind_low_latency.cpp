// LL dispatch/combine launchers for Python: tensors cross as data_ptr() integers, streams as
// cuda_stream integers. Shapes are validated in deep_ep/low_latency.py; here the LL layout is
// rebuilt from the buffer's settings through sizing.hpp (never from offsets passed in), checked
// against the window that was really allocated, and turned into the area of the call.
// `input_failed`: this rank's input failed its host checks; it takes part without data (T = 0 for a
// dispatch; zero rows, or none without a handle, for a combine) and its peers record why.
// `rank_mask`: the buffer's int32 [R] rank mask (0: masking off).
// `phases`: which phases of the operation the launch runs (LL_PHASE_*: both without a receive hook,
// send and later receive with one); every value launches the same kernel function.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/geometry.hpp"
#include "common/sizing.hpp"
#include "kernels/low_latency.hpp"
#include "python/binding_utils.hpp"
#include "runtime/runtime.hpp"

namespace py = pybind11;

namespace deep_ep {
namespace {

// The buffer's LL sizing settings: what the region was allocated for.
struct LowLatencySettings {
  int64_t num_max_tokens = 0;
  int hidden = 0;
  int num_experts = 0;
  int num_topk = 0;  // the resolved LL top-k (ElasticBuffer.num_ll_topk)
};

LowLatencyLayout layout_of(const Runtime& runtime, const LowLatencySettings& settings) {
  const LowLatencyLayout layout = low_latency_layout(LowLatencyRequest{
      runtime.config().num_ranks, settings.num_max_tokens, settings.hidden, settings.num_experts, settings.num_topk});
  if (layout.region_bytes == 0 || layout.region_bytes > runtime.window().ll_bytes) {
    throw std::invalid_argument("the low-latency layout for these settings needs " +
                                std::to_string(layout.region_bytes) + " bytes, the buffer's LL region has " +
                                std::to_string(runtime.window().ll_bytes));
  }
  return layout;
}

int64_t area_offset(const Runtime& runtime, const LowLatencyLayout& layout, int area) {
  if (area < 0 || area >= kLowLatencyAreas) {
    throw std::invalid_argument("area must be in [0, " + std::to_string(kLowLatencyAreas) + "), got " +
                                std::to_string(area));
  }
  return runtime.window().ll_offset + layout.area_start(area);
}

LowLatencyDispatchArgs dispatch_args(const Runtime& runtime, const LowLatencySettings& settings, int area,
                                     std::uintptr_t x, std::uintptr_t topk_idx, int num_tokens, int num_topk,
                                     bool use_fp8, std::uintptr_t recv_count, std::uintptr_t count_per_source,
                                     int num_sms) {
  LowLatencyDispatchArgs args;
  args.view = runtime.device_view();
  args.layout = layout_of(runtime, settings);
  args.ll_offset = runtime.window().ll_offset;
  args.area_offset = area_offset(runtime, args.layout, area);
  args.area = area;
  args.num_experts = settings.num_experts;
  args.hidden = settings.hidden;
  args.num_tokens = num_tokens;
  args.num_topk = num_topk;
  args.use_fp8 = use_fp8;
  args.x = pointer<const void>(x);
  args.topk_idx = pointer<const int64_t>(topk_idx);
  args.recv_count = pointer<int32_t>(recv_count);
  args.count_per_source = pointer<int32_t>(count_per_source);
  args.num_sms = num_sms;
  return args;
}

LowLatencyCombineArgs combine_args(const Runtime& runtime, const LowLatencySettings& settings, int dispatch_area,
                                   int area, std::uintptr_t x, std::uintptr_t count_per_source, std::uintptr_t topk_idx,
                                   std::uintptr_t topk_weights, std::uintptr_t out, int num_tokens, int num_topk,
                                   int num_sms) {
  LowLatencyCombineArgs args;
  args.view = runtime.device_view();
  args.layout = layout_of(runtime, settings);
  args.ll_offset = runtime.window().ll_offset;
  args.dispatch_area_offset = area_offset(runtime, args.layout, dispatch_area);
  args.area_offset = area_offset(runtime, args.layout, area);
  args.area = area;
  args.num_experts = settings.num_experts;
  args.hidden = settings.hidden;
  args.num_tokens = num_tokens;
  args.num_topk = num_topk;
  args.x = pointer<const void>(x);
  args.count_per_source = pointer<const int32_t>(count_per_source);
  args.topk_idx = pointer<const int64_t>(topk_idx);
  args.topk_weights = pointer<const float>(topk_weights);
  args.out = pointer<void>(out);
  args.num_sms = num_sms;
  return args;
}

}  // namespace

void register_low_latency(py::module_& m) {
  m.attr("LL_AREAS") = kLowLatencyAreas;
  m.attr("LL_SCALES_FP32_ROW_MAJOR") = static_cast<int>(LowLatencyScales::kFp32RowMajor);
  m.attr("LL_SCALES_FP32_COL_MAJOR") = static_cast<int>(LowLatencyScales::kFp32ColMajor);
  m.attr("LL_SCALES_UE8M0_ROW_MAJOR") = static_cast<int>(LowLatencyScales::kUe8m0RowMajor);
  m.attr("LL_SCALES_UE8M0_COL_MAJOR") = static_cast<int>(LowLatencyScales::kUe8m0ColMajor);
  m.attr("LL_PHASE_SEND") = static_cast<int>(LowLatencyPhases::kSend);
  m.attr("LL_PHASE_RECEIVE") = static_cast<int>(LowLatencyPhases::kReceive);
  m.attr("LL_PHASE_BOTH") = static_cast<int>(LowLatencyPhases::kBoth);

  m.def(
      "check_low_latency_dispatch_fits",
      [](int num_ranks, int64_t num_max_tokens_per_rank, int hidden, int num_experts, int num_topk, bool scaleout) {
        check_low_latency_dispatch_fits(
            low_latency_layout(LowLatencyRequest{num_ranks, num_max_tokens_per_rank, hidden, num_experts, num_topk}),
            scaleout);
      },
      py::arg("num_ranks"), py::arg("num_max_tokens_per_rank"), py::arg("hidden"), py::arg("num_experts"),
      py::arg("num_topk"), py::arg("scaleout"));

  // The send phase reads x and topk_idx; the receive phase writes recv_count, count_per_source and
  // the row outputs. recv_x = 0: per-source rows stay in the window; scales_format: LowLatencyScales.
  m.def(
      "low_latency_dispatch",
      [](Runtime& runtime, int64_t num_max_tokens, int hidden, int num_experts, int ll_topk, int area, std::uintptr_t x,
         std::uintptr_t topk_idx, int num_tokens, int num_topk, bool use_fp8, std::uintptr_t recv_count,
         std::uintptr_t count_per_source, int num_sms, std::uintptr_t stream, int phases, bool input_failed,
         bool round_scale, std::uintptr_t recv_x, std::uintptr_t recv_scales, int scales_format,
         std::uintptr_t recv_src_info, std::uintptr_t recv_layout_range, std::uintptr_t cumulative_recv_stats,
         std::uintptr_t wait_cost_stats, std::uintptr_t rank_mask) {
        const LowLatencySettings settings{num_max_tokens, hidden, num_experts, ll_topk};
        LowLatencyDispatchArgs args = dispatch_args(runtime, settings, area, x, topk_idx, num_tokens, num_topk, use_fp8,
                                                    recv_count, count_per_source, num_sms);
        args.input_failed = input_failed;
        args.round_scale = round_scale;
        if (scales_format < 0 || scales_format > static_cast<int>(LowLatencyScales::kUe8m0ColMajor)) {
          throw std::invalid_argument("scales_format must be in [0, 3], got " + std::to_string(scales_format));
        }
        args.recv_x = pointer<void>(recv_x);
        args.recv_scales = pointer<void>(recv_scales);
        args.scales_format = static_cast<LowLatencyScales>(scales_format);
        args.recv_src_info = pointer<int32_t>(recv_src_info);
        args.recv_layout_range = pointer<int64_t>(recv_layout_range);
        args.cumulative_recv_stats = pointer<int32_t>(cumulative_recv_stats);
        args.wait_cost_stats = pointer<int64_t>(wait_cost_stats);
        args.rank_mask = pointer<int32_t>(rank_mask);
        launch_low_latency_dispatch(args, static_cast<LowLatencyPhases>(phases), as_stream(stream));
      },
      py::arg("runtime"), py::arg("num_max_tokens"), py::arg("hidden"), py::arg("num_experts"), py::arg("ll_topk"),
      py::arg("area"), py::arg("x"), py::arg("topk_idx"), py::arg("num_tokens"), py::arg("num_topk"),
      py::arg("use_fp8"), py::arg("recv_count"), py::arg("count_per_source"), py::arg("num_sms"), py::arg("stream"),
      py::arg("phases"), py::arg("input_failed") = false, py::arg("round_scale") = false, py::arg("recv_x") = 0,
      py::arg("recv_scales") = 0, py::arg("scales_format") = 0, py::arg("recv_src_info") = 0,
      py::arg("recv_layout_range") = 0, py::arg("cumulative_recv_stats") = 0, py::arg("wait_cost_stats") = 0,
      py::arg("rank_mask") = 0);
  // The send phase reads x and count_per_source; the receive phase writes out from topk_idx/weights.
  m.def(
      "low_latency_combine",
      [](Runtime& runtime, int64_t num_max_tokens, int hidden, int num_experts, int ll_topk, int dispatch_area,
         int area, std::uintptr_t x, std::uintptr_t count_per_source, std::uintptr_t topk_idx,
         std::uintptr_t topk_weights, std::uintptr_t out, int num_tokens, int num_topk, int num_sms,
         std::uintptr_t stream, int phases, bool input_failed, std::uintptr_t layout_range,
         std::uintptr_t wait_cost_stats, std::uintptr_t rank_mask) {
        const LowLatencySettings settings{num_max_tokens, hidden, num_experts, ll_topk};
        LowLatencyCombineArgs args = combine_args(runtime, settings, dispatch_area, area, x, count_per_source, topk_idx,
                                                  topk_weights, out, num_tokens, num_topk, num_sms);
        args.input_failed = input_failed;
        args.layout_range = pointer<const int64_t>(layout_range);
        args.wait_cost_stats = pointer<int64_t>(wait_cost_stats);
        args.rank_mask = pointer<int32_t>(rank_mask);
        launch_low_latency_combine(args, static_cast<LowLatencyPhases>(phases), as_stream(stream));
      },
      py::arg("runtime"), py::arg("num_max_tokens"), py::arg("hidden"), py::arg("num_experts"), py::arg("ll_topk"),
      py::arg("dispatch_area"), py::arg("area"), py::arg("x"), py::arg("count_per_source"), py::arg("topk_idx"),
      py::arg("topk_weights"), py::arg("out"), py::arg("num_tokens"), py::arg("num_topk"), py::arg("num_sms"),
      py::arg("stream"), py::arg("phases"), py::arg("input_failed") = false, py::arg("layout_range") = 0,
      py::arg("wait_cost_stats") = 0, py::arg("rank_mask") = 0);
}

}  // namespace deep_ep
