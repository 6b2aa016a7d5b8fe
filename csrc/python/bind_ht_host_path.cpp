// The host path of the common HT calls in C++ (deep_ep._C.HtHostPath): a cached dispatch and a
// combine with their everyday arguments are checked, allocated (torch's caching allocator, on the
// caller's stream) and launched in one binding call. In Python the same call costs 50-60 µs of
// checks, torch.empty calls and launches, which the GPU waits for when the kernels are short.
//
// Every check here is a predicate that builds no message: when an argument is anything but the
// plain case (wrong dtype or shape, another device, non-contiguous, a num_sms the estimate has not
// resolved yet...), the call returns None before it launches anything and deep_ep/high_throughput.py
// runs its Python path, which raises the precise error (and takes part without data) or handles
// the less common case. So this path must accept nothing the Python path would refuse: its checks
// are the Python checks of the same arguments, and the handle fields it reads are EPHandle's.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "common/geometry.hpp"
#include "common/ht_call.hpp"
#include "kernels/high_throughput.hpp"
#include "python/ht_launchers.hpp"
#include "runtime/runtime.hpp"

namespace py = pybind11;

namespace deep_ep {
namespace {

constexpr int kFp8GroupSize = 128;  // channels per fp8 scale (deep_ep.fp8.FP8_GROUP_SIZE)

std::uintptr_t address(const at::Tensor& tensor) { return reinterpret_cast<std::uintptr_t>(tensor.data_ptr()); }
std::uintptr_t address(const std::optional<at::Tensor>& tensor) { return tensor ? address(*tensor) : 0; }

// The tensor inside a Python object, or nothing when it is not a torch.Tensor.
std::optional<at::Tensor> as_tensor(py::handle object) {
  if (!THPVariable_Check(object.ptr())) return std::nullopt;
  return THPVariable_Unpack(object.ptr());
}

py::object wrap(const std::optional<at::Tensor>& tensor) {
  if (!tensor) return py::none();
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(*tensor));
}

struct CallKey {
  int64_t num_max_tokens;
  int hidden;
  int num_topk;
  int num_experts;
  bool use_fp8;
  bool combine_only;
  bool operator==(const CallKey&) const = default;
};

class HtHostPath {
 public:
  HtHostPath(int device, std::uintptr_t comm_stream, int max_num_sms, int max_ht_num_sms)
      : device_(device), comm_stream_(comm_stream), max_num_sms_(max_num_sms), max_ht_num_sms_(max_ht_num_sms) {}

  // deep_ep's num_sms estimate for (E, K) with the default rates, as the Python path computed it
  // (num_sms=0 resolves through it; a shape not remembered yet goes to the Python path).
  void remember_num_sms(int num_experts, int num_topk, int num_sms) {
    for (auto& [key, value] : num_sms_estimates_) {
      if (key == std::pair{num_experts, num_topk}) {
        value = num_sms;
        return;
      }
    }
    num_sms_estimates_.push_back({{num_experts, num_topk}, num_sms});
  }

  int64_t num_calls() const { return num_calls_; }

  // dispatch(x, topk_weights=..., handle=handle, num_sms=num_sms) with every other argument at its
  // default (high_throughput.py decides that): (recv_x, recv_scales, recv_topk_idx,
  // recv_topk_weights), or None for the Python path.
  py::object cached_dispatch(Runtime& runtime, py::handle x, py::handle topk_weights, py::handle handle, int num_sms,
                             std::uintptr_t compute_stream) {
    std::optional<at::Tensor> data;
    std::optional<at::Tensor> scales;
    if (py::isinstance<py::tuple>(x) || py::isinstance<py::list>(x)) {
      const py::sequence pair = py::reinterpret_borrow<py::sequence>(x);
      if (py::len(pair) != 2) return py::none();
      data = as_tensor(pair[0]);
      scales = as_tensor(pair[1]);
      if (!data || !scales || !is_fp8_rows(*data) || !is_fp8_scales(*scales, *data)) return py::none();
    } else {
      data = as_tensor(x);
      if (!data || !kernel_ready(*data) || data->scalar_type() != at::kBFloat16 || !has_rows(*data, 8)) {
        return py::none();
      }
    }
    const int64_t num_tokens = data->size(0);
    const int hidden = static_cast<int>(data->size(1));
    const auto num_topk = handle.attr("num_topk").cast<int>();
    if (num_tokens != handle.attr("num_tokens").cast<int64_t>()) return py::none();
    const std::optional<at::Tensor> weights = optional_tensor(topk_weights);
    if (!topk_weights.is_none() && (!weights || !is_rows(*weights, at::kFloat, num_tokens, num_topk))) {
      return py::none();
    }
    const auto num_experts = handle.attr("num_experts").cast<int>();
    const std::optional<int> sms = resolve_num_sms(num_sms, num_experts, num_topk);
    if (!sms) return py::none();
    const auto num_max_tokens = handle.attr("num_max_tokens_per_rank").cast<int64_t>();
    const HtCall* call = find_call(runtime, {num_max_tokens, hidden, num_topk, num_experts, scales.has_value(), false});
    if (call == nullptr) return py::none();

    const auto do_expand = handle.attr("do_expand").cast<bool>();
    const auto expert_alignment = handle.attr("expert_alignment").cast<int>();
    const auto num_recv_tokens = handle.attr("num_recv_tokens").cast<int64_t>();
    const int64_t num_rows = do_expand ? handle.attr("num_expanded_tokens").cast<int64_t>() : num_recv_tokens;
    const at::Tensor routing = THPVariable_Unpack(handle.attr("topk_idx").ptr());
    const at::Tensor dst_slot = THPVariable_Unpack(handle.attr("dst_buffer_slot_idx").ptr());
    const at::Tensor expert_slot = THPVariable_Unpack(handle.attr("expert_slot_idx").ptr());
    const at::Tensor counts = THPVariable_Unpack(handle.attr("counts").ptr());
    const std::optional<at::Tensor> hybrid_routing = optional_tensor(handle.attr("hybrid_routing"));

    // Outputs on the caller's stream (current in torch), as the Python path allocates them: comm
    // waits for that stream first, and the caller's stream waits for comm at the end.
    const at::TensorOptions options = at::TensorOptions().device(at::kCUDA, device_);
    const at::Tensor recv_x = at::empty({num_rows, hidden}, options.dtype(data->scalar_type()));
    std::optional<at::Tensor> recv_scales;
    if (scales) recv_scales = at::empty({num_rows, hidden / kFp8GroupSize}, options.dtype(at::kFloat));
    std::optional<at::Tensor> recv_topk_idx;
    if (!do_expand) recv_topk_idx = at::empty({num_rows, num_topk}, options.dtype(at::kLong));
    std::optional<at::Tensor> recv_weights;
    if (weights) {
      recv_weights = do_expand ? at::empty({num_rows}, options.dtype(at::kFloat))
                               : at::empty({num_rows, num_topk}, options.dtype(at::kFloat));
    }

    ++num_calls_;
    runtime.join_streams(as_cuda_stream(comm_stream_), as_cuda_stream(compute_stream));
    launch_ht_dispatch(runtime, *call, static_cast<int>(num_tokens), address(*data), address(scales), address(routing),
                       address(weights), address(dst_slot), address(expert_slot), 0, address(hybrid_routing), true,
                       *sms, comm_stream_, false);
    // A cached dispatch has the handle's routing: its source info and row map are already right.
    launch_ht_dispatch_epilogue(runtime, *call, do_expand, expert_alignment, weights.has_value(), address(counts),
                                num_rows, num_recv_tokens, address(recv_x), address(recv_scales),
                                address(recv_topk_idx), address(recv_weights), 0, 0, max_num_sms_, comm_stream_);
    runtime.join_streams(as_cuda_stream(compute_stream), as_cuda_stream(comm_stream_));
    return py::make_tuple(wrap(recv_x), wrap(recv_scales), wrap(recv_topk_idx), wrap(recv_weights));
  }

  // combine(x, handle, topk_weights=..., num_sms=num_sms) with every other argument at its default:
  // (combined_x, combined_topk_weights), or None for the Python path.
  py::object combine(Runtime& runtime, py::handle x, py::handle topk_weights, py::handle handle, int num_sms,
                     std::uintptr_t compute_stream) {
    const std::optional<at::Tensor> rows = as_tensor(x);
    const auto do_expand = handle.attr("do_expand").cast<bool>();
    const int64_t num_rows = handle.attr(do_expand ? "num_expanded_tokens" : "num_recv_tokens").cast<int64_t>();
    if (!rows || !kernel_ready(*rows) || rows->scalar_type() != at::kBFloat16 || !has_rows(*rows, 8) ||
        rows->size(0) != num_rows) {
      return py::none();
    }
    const int hidden = static_cast<int>(rows->size(1));
    const auto num_topk = handle.attr("num_topk").cast<int>();
    const std::optional<at::Tensor> weights = optional_tensor(topk_weights);
    if (!topk_weights.is_none() && (!weights || !(do_expand ? is_vector(*weights, at::kFloat, num_rows)
                                                            : is_rows(*weights, at::kFloat, num_rows, num_topk)))) {
      return py::none();
    }
    const auto num_experts = handle.attr("num_experts").cast<int>();
    const std::optional<int> sms =
        resolve_num_sms(num_sms != 0 ? num_sms : handle.attr("num_sms").cast<int>(), num_experts, num_topk);
    if (!sms) return py::none();
    const auto num_max_tokens = handle.attr("num_max_tokens_per_rank").cast<int64_t>();
    const HtCall* call = find_call(runtime, {num_max_tokens, hidden, num_topk, num_experts, false, true});
    if (call == nullptr) return py::none();

    const auto num_tokens = handle.attr("num_tokens").cast<int>();
    const at::Tensor counts = THPVariable_Unpack(handle.attr("counts").ptr());
    const at::Tensor src_info = THPVariable_Unpack(handle.attr("recv_src_info").ptr());
    const std::optional<at::Tensor> expanded_rows = optional_tensor(handle.attr("recv_expanded_row_idx"));
    const at::Tensor routing = THPVariable_Unpack(handle.attr("topk_idx").ptr());
    const std::optional<at::Tensor> hybrid_routing = optional_tensor(handle.attr("hybrid_routing"));

    const at::TensorOptions options = at::TensorOptions().device(at::kCUDA, device_);
    const at::Tensor combined_x = at::empty({num_tokens, hidden}, options.dtype(at::kBFloat16));
    std::optional<at::Tensor> combined_weights;
    if (weights) combined_weights = at::empty({num_tokens, num_topk}, options.dtype(at::kFloat));

    ++num_calls_;
    runtime.join_streams(as_cuda_stream(comm_stream_), as_cuda_stream(compute_stream));
    launch_ht_combine(runtime, *call, do_expand, address(*rows), address(weights), address(counts), address(src_info),
                      address(expanded_rows), src_info.size(0), num_tokens, address(routing), address(hybrid_routing),
                      *sms, comm_stream_, false);
    launch_ht_combine_reduce(runtime, *call, num_tokens, address(routing), 0, 0, address(combined_x),
                             address(combined_weights), max_num_sms_, comm_stream_);
    runtime.join_streams(as_cuda_stream(compute_stream), as_cuda_stream(comm_stream_));
    return py::make_tuple(wrap(combined_x), wrap(combined_weights));
  }

 private:
  static cudaStream_t as_cuda_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

  // high_throughput.py's _check_tensor: this buffer's device, contiguous, 16-byte aligned.
  bool kernel_ready(const at::Tensor& tensor) const {
    return tensor.is_cuda() && tensor.get_device() == device_ && tensor.is_contiguous() &&
           (tensor.numel() == 0 || address(tensor) % 16 == 0);
  }
  // [T, H] with H a positive multiple of `multiple`.
  static bool has_rows(const at::Tensor& tensor, int64_t multiple) {
    return tensor.dim() == 2 && tensor.size(1) > 0 && tensor.size(1) % multiple == 0;
  }
  bool is_rows(const at::Tensor& tensor, at::ScalarType dtype, int64_t num_rows, int64_t num_columns) const {
    return kernel_ready(tensor) && tensor.scalar_type() == dtype && tensor.dim() == 2 && tensor.size(0) == num_rows &&
           tensor.size(1) == num_columns;
  }
  bool is_vector(const at::Tensor& tensor, at::ScalarType dtype, int64_t length) const {
    return kernel_ready(tensor) && tensor.scalar_type() == dtype && tensor.dim() == 1 && tensor.size(0) == length;
  }
  bool is_fp8_rows(const at::Tensor& data) const {
    return kernel_ready(data) && data.scalar_type() == at::kFloat8_e4m3fn && has_rows(data, kFp8GroupSize);
  }
  // fp32 [T, H/128], already as the kernels read it (packed UE8M0 or strided scales: Python path).
  bool is_fp8_scales(const at::Tensor& scales, const at::Tensor& data) const {
    return is_rows(scales, at::kFloat, data.size(0), data.size(1) / kFp8GroupSize);
  }
  static std::optional<at::Tensor> optional_tensor(py::handle object) {
    return object.is_none() ? std::nullopt : as_tensor(object);
  }

  // high_throughput.py's _resolve_num_sms without its errors: 0 = the remembered estimate.
  std::optional<int> resolve_num_sms(int num_sms, int num_experts, int num_topk) const {
    if (num_sms < 0 || num_sms > max_ht_num_sms_) return std::nullopt;
    if (num_sms > 0) return num_sms;
    for (const auto& [key, value] : num_sms_estimates_) {
      if (key == std::pair{num_experts, num_topk}) return value;
    }
    return std::nullopt;
  }

  // The call of one shape, built once; nullptr where the shape does not fit the HT region (the
  // Python path raises BufferTooSmallError with the sizes).
  const HtCall* find_call(const Runtime& runtime, const CallKey& key) {
    for (const auto& [known, call] : calls_) {
      if (known == key) return &call;
    }
    HtCall call;
    try {
      call = buffer_ht_call(runtime, key.num_max_tokens, key.hidden, key.num_topk, key.num_experts, key.use_fp8,
                            key.combine_only, false);
    } catch (const std::invalid_argument&) {
      return nullptr;
    }
    calls_.push_back({key, call});
    return &calls_.back().second;
  }

  int device_;
  std::uintptr_t comm_stream_;
  int max_num_sms_;
  int max_ht_num_sms_;
  int64_t num_calls_ = 0;
  std::vector<std::pair<std::pair<int, int>, int>> num_sms_estimates_;
  std::vector<std::pair<CallKey, HtCall>> calls_;
};

}  // namespace

void register_ht_host_path(py::module_& m) {
  py::class_<HtHostPath>(m, "HtHostPath")
      .def(py::init<int, std::uintptr_t, int, int>(), py::arg("device"), py::arg("comm_stream"), py::arg("max_num_sms"),
           py::arg("max_ht_num_sms"))
      .def("remember_num_sms", &HtHostPath::remember_num_sms)
      .def_property_readonly("num_calls", &HtHostPath::num_calls)
      // Positional arguments only: keyword matching costs host time on every call.
      .def("cached_dispatch", &HtHostPath::cached_dispatch)
      .def("combine", &HtHostPath::combine);
}

}  // namespace deep_ep
