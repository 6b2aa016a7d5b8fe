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
#include <c10/core/TensorImpl.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/error_record.hpp"
#include "common/geometry.hpp"
#include "common/ht_call.hpp"
#include "kernels/high_throughput.hpp"
#include "python/ht_launchers.hpp"
#include "python/uninitialized_tensor.hpp"
#include "runtime/runtime.hpp"

namespace py = pybind11;

namespace deep_ep {
namespace {

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

// The notify's one int32 allocation, split into the handle's arrays: [routing as 2 x int32 per
// entry] [expert_slot] [dst_slot] [counts fields, counts_layout order] [hybrid routing] [zero-copy
// send base] [rank prefix matrix, direct mode] [notify scratch]. One allocation: each costs host time on the uncached
// path, which the GPU waits for.
struct NotifyBlock {
  at::Tensor block;
  at::Tensor routing;      // int64 [T, K]
  at::Tensor expert_slot;  // [T, K]
  at::Tensor dst_slot;     // [T, K]
  at::Tensor counts;       // counts_layout(R, L).total
  at::Tensor recv_per_source, psum_per_source, expert_offsets, unaligned_per_expert, expert_start, psum_per_expert;
  std::optional<at::Tensor> hybrid_routing;      // hybrid mode
  std::optional<at::Tensor> send_base;           // zero-copy receive: [R]
  std::optional<at::Tensor> rank_prefix_matrix;  // direct mode: [R, R], V1's (ht_notify.cu)
  at::Tensor scratch;

  static int64_t rank_prefix_matrix_ints(const HtCall& call) {
    return call.hybrid() ? 0 : int64_t{call.num_ranks()} * call.num_ranks();
  }

  static int64_t num_ints(const HtCall& call, int64_t num_tokens) {
    return 4 * num_tokens * call.num_topk + ht::counts_layout(call.num_ranks(), call.num_local_experts()).total +
           ht::hybrid_routing_ints(call, num_tokens) + (call.zero_copy_recv ? call.num_ranks() : 0) +
           rank_prefix_matrix_ints(call) + ht::notify_scratch_ints(call, num_tokens);
  }

  NotifyBlock(at::Tensor allocation, const HtCall& call, int64_t num_tokens) : block(std::move(allocation)) {
    const int64_t entries = num_tokens * call.num_topk;
    const int num_ranks = call.num_ranks();
    const int num_local = call.num_local_experts();
    const ht::CountsLayout layout = ht::counts_layout(num_ranks, num_local);
    const int64_t counts_at = 4 * entries;
    routing = ints_view(0, {num_tokens, call.num_topk}, at::kLong);
    expert_slot = ints_view(2 * entries, {num_tokens, call.num_topk});
    dst_slot = ints_view(3 * entries, {num_tokens, call.num_topk});
    counts = ints_view(counts_at, {layout.total});
    recv_per_source = ints_view(counts_at + layout.recv_per_source, {num_ranks});
    psum_per_source = ints_view(counts_at + layout.psum_per_source, {num_ranks});
    expert_offsets = ints_view(counts_at + layout.expert_offsets, {num_ranks, num_local});
    unaligned_per_expert = ints_view(counts_at + layout.unaligned_per_expert, {num_local});
    expert_start = ints_view(counts_at + layout.expert_start, {num_local});
    psum_per_expert = ints_view(counts_at + layout.psum_per_expert, {num_local});
    int64_t offset = counts_at + layout.total;
    const int64_t hybrid_ints = ht::hybrid_routing_ints(call, num_tokens);
    if (call.hybrid()) hybrid_routing = ints_view(offset, {hybrid_ints});
    offset += hybrid_ints;
    if (call.zero_copy_recv) send_base = ints_view(offset, {num_ranks});
    offset += call.zero_copy_recv ? num_ranks : 0;
    if (!call.hybrid()) rank_prefix_matrix = ints_view(offset, {num_ranks, num_ranks});
    offset += rank_prefix_matrix_ints(call);
    scratch = ints_view(offset, {ht::notify_scratch_ints(call, num_tokens)});
  }

  // As deep_ep/high_throughput.py builds the handle from them (_handle_from_notify_block).
  py::tuple to_python() const {
    return py::make_tuple(wrap(routing), wrap(expert_slot), wrap(dst_slot), wrap(counts), wrap(recv_per_source),
                          wrap(psum_per_source), wrap(expert_offsets), wrap(unaligned_per_expert), wrap(expert_start),
                          wrap(psum_per_expert), wrap(hybrid_routing), wrap(send_base), wrap(rank_prefix_matrix),
                          wrap(scratch));
  }

 private:
  // A contiguous view of the block from int `first` on, made without the dispatcher: narrow and
  // view cost about 1 µs each on the host, and the uncached dispatch takes thirteen of them before
  // its handle exists. The view shares the block's storage like any view; the block never
  // requires grad, so no autograd view record is needed.
  at::Tensor ints_view(int64_t first, at::IntArrayRef sizes, at::ScalarType dtype = at::kInt) const {
    auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(block.storage()), block.key_set(),
                                                     c10::scalarTypeToTypeMeta(dtype));
    impl->set_sizes_contiguous(sizes);
    // Every view starts at a multiple of its element size: routing (int64) is at int 0.
    impl->set_storage_offset((block.storage_offset() + first) * int64_t{sizeof(int32_t)} / c10::elementSize(dtype));
    return at::Tensor::wrap_tensor_impl(std::move(impl));
  }
};

// Where the host path's time goes (bench_ht.py --host-profile): per operation, the time from one
// step's end to the next's, summed over calls. Off unless start_profile() turned it on (a call then
// pays one branch per step).
class HostPathProfile {
 public:
  enum Operation { kCachedDispatch, kCombine, kBeginDispatch, kFinishDispatch, kNumOperations };

  void start() {
    on_ = true;
    for (auto& steps : steps_) steps.clear();
    calls_.fill(0);
  }
  void begin(Operation operation) {
    if (!on_) return;
    operation_ = operation;
    ++calls_[operation];
    last_ = std::chrono::steady_clock::now();
  }
  void stamp(const char* step) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    const double ns = std::chrono::duration<double, std::nano>(now - last_).count();
    last_ = now;
    auto& steps = steps_[operation_];
    for (auto& [name, total] : steps) {
      if (name == step) {
        total += ns;
        return;
      }
    }
    steps.push_back({step, ns});
  }
  // {operation: {step: mean µs per call}} since start(); profiling stops.
  py::dict stop() {
    on_ = false;
    static constexpr std::array<const char*, kNumOperations> kNames = {"cached_dispatch", "combine", "begin_dispatch",
                                                                       "finish_dispatch"};
    py::dict result;
    for (int operation = 0; operation < kNumOperations; ++operation) {
      if (calls_[operation] == 0) continue;
      py::dict steps;
      for (const auto& [name, total] : steps_[operation]) steps[name.c_str()] = total / 1e3 / calls_[operation];
      result[kNames[operation]] = steps;
    }
    return result;
  }

 private:
  bool on_ = false;
  Operation operation_ = kCachedDispatch;
  std::chrono::steady_clock::time_point last_;
  std::array<int64_t, kNumOperations> calls_{};
  std::array<std::vector<std::pair<std::string, double>>, kNumOperations> steps_;
};

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
  void start_profile() { profile_.start(); }
  py::dict stop_profile() { return profile_.stop(); }

  // dispatch(x, topk_weights=..., handle=handle, num_sms=num_sms) with every other argument at its
  // default (high_throughput.py decides that): (recv_x, recv_scales, recv_topk_idx,
  // recv_topk_weights), or None for the Python path.
  py::object cached_dispatch(Runtime& runtime, py::handle x, py::handle topk_weights, py::handle handle, int num_sms,
                             std::uintptr_t compute_stream) {
    profile_.begin(HostPathProfile::kCachedDispatch);
    std::optional<at::Tensor> data;
    std::optional<at::Tensor> scales;
    if (!dispatch_input(x, data, scales)) return py::none();
    const int64_t num_tokens = data->size(0);
    const int hidden = static_cast<int>(data->size(1));
    const auto num_topk = handle.attr("num_topk").cast<int>();
    if (num_tokens != handle.attr("num_tokens").cast<int64_t>()) return py::none();
    std::optional<at::Tensor> weights;
    if (!weights_argument(topk_weights, num_tokens, num_topk, weights)) return py::none();
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
    const at::Tensor routing = tensor_field(handle, "routing");  // the sanitised copy (EPHandle.routing)
    const at::Tensor dst_slot = tensor_field(handle, "dst_buffer_slot_idx");
    const at::Tensor expert_slot = tensor_field(handle, "expert_slot_idx");
    const at::Tensor counts = tensor_field(handle, "counts");
    const std::optional<at::Tensor> hybrid_routing = optional_tensor_field(handle, "hybrid_routing");

    profile_.stamp("checks and handle fields");
    const auto outputs = allocate_dispatch_outputs(*call, num_rows, do_expand, weights.has_value());
    profile_.stamp("allocations");
    ++num_calls_;
    runtime.join_streams(as_cuda_stream(comm_stream_), as_cuda_stream(compute_stream));
    profile_.stamp("join");
    launch_ht_dispatch(runtime, *call, static_cast<int>(num_tokens), address(*data), address(scales), address(routing),
                       address(weights), address(dst_slot), address(expert_slot), 0, address(hybrid_routing), true,
                       *sms, comm_stream_, false);
    profile_.stamp("dispatch launch");
    // A cached dispatch has the handle's routing: its source info and row map are already right.
    launch_ht_dispatch_epilogue(runtime, *call, do_expand, expert_alignment, weights.has_value(), address(counts),
                                num_rows, num_recv_tokens, address(outputs.x), address(outputs.scales),
                                address(outputs.topk_idx), address(outputs.weights), 0, 0, max_num_sms_, comm_stream_);
    profile_.stamp("epilogue launch");
    runtime.join_streams(as_cuda_stream(compute_stream), as_cuda_stream(comm_stream_));
    profile_.stamp("join back");
    py::tuple result =
        py::make_tuple(wrap(outputs.x), wrap(outputs.scales), wrap(outputs.topk_idx), wrap(outputs.weights));
    profile_.stamp("outputs to Python");
    return result;
  }

  // combine(x, handle, topk_weights=..., num_sms=num_sms, sum_topk_weights=...) with every other
  // argument at its default: (combined_x, combined_topk_weights), or None for the Python path.
  py::object combine(Runtime& runtime, py::handle x, py::handle topk_weights, py::handle handle, int num_sms,
                     bool sum_topk_weights, std::uintptr_t compute_stream) {
    profile_.begin(HostPathProfile::kCombine);
    const std::optional<at::Tensor> rows = as_tensor(x);
    const auto do_expand = handle.attr("do_expand").cast<bool>();
    const int64_t num_rows = handle.attr(do_expand ? "num_expanded_tokens" : "num_recv_tokens").cast<int64_t>();
    if (!rows || !kernel_ready(*rows) || rows->scalar_type() != at::kBFloat16 || !has_rows(*rows, 8) ||
        rows->size(0) != num_rows) {
      return py::none();
    }
    const int hidden = static_cast<int>(rows->size(1));
    const auto num_topk = handle.attr("num_topk").cast<int>();
    std::optional<at::Tensor> weights;
    if (!weights_argument(topk_weights, num_rows, do_expand ? 0 : num_topk, weights)) return py::none();
    const auto num_experts = handle.attr("num_experts").cast<int>();
    const std::optional<int> sms =
        resolve_num_sms(num_sms != 0 ? num_sms : handle.attr("num_sms").cast<int>(), num_experts, num_topk);
    if (!sms) return py::none();
    const auto num_max_tokens = handle.attr("num_max_tokens_per_rank").cast<int64_t>();
    const HtCall* call = find_call(runtime, {num_max_tokens, hidden, num_topk, num_experts, false, true});
    if (call == nullptr) return py::none();

    const auto num_tokens = handle.attr("num_tokens").cast<int>();
    const at::Tensor counts = tensor_field(handle, "counts");
    const at::Tensor src_info = tensor_field(handle, "recv_src_info");
    const std::optional<at::Tensor> expanded_rows = optional_tensor_field(handle, "recv_expanded_row_idx");
    const at::Tensor routing = tensor_field(handle, "routing");  // the sanitised copy (EPHandle.routing)
    const std::optional<at::Tensor> hybrid_routing = optional_tensor_field(handle, "hybrid_routing");

    profile_.stamp("checks and handle fields");
    const at::Tensor combined_x = empty({num_tokens, hidden}, at::kBFloat16);
    std::optional<at::Tensor> combined_weights;
    if (weights) combined_weights = empty({num_tokens, num_topk}, at::kFloat);
    profile_.stamp("allocations");

    ++num_calls_;
    runtime.join_streams(as_cuda_stream(comm_stream_), as_cuda_stream(compute_stream));
    profile_.stamp("join");
    launch_ht_combine(runtime, *call, do_expand, address(*rows), address(weights), sum_topk_weights, address(counts),
                      address(src_info), address(expanded_rows), src_info.size(0), num_tokens, address(routing),
                      address(hybrid_routing), *sms, comm_stream_, false);
    profile_.stamp("combine launch");
    launch_ht_combine_reduce(runtime, *call, num_tokens, address(routing), 0, 0, address(combined_x),
                             address(combined_weights), sum_topk_weights, max_num_sms_, comm_stream_);
    profile_.stamp("reduce launch");
    runtime.join_streams(as_cuda_stream(compute_stream), as_cuda_stream(comm_stream_));
    profile_.stamp("join back");
    py::tuple result = py::make_tuple(wrap(combined_x), wrap(combined_weights));
    profile_.stamp("outputs to Python");
    return result;
  }

  // An uncached dispatch with everyday arguments, up to the host's wait for the counts: the checks,
  // the notify block, the notify and dispatch launches. Returns (call, num_sms, notify block
  // arrays as NotifyBlock::to_python) or None for the Python path. high_throughput.py then builds
  // the handle (while the notify runs) and calls finish_dispatch, which waits for the counts.
  py::object begin_dispatch(Runtime& runtime, py::handle x, py::handle topk_idx, py::handle topk_weights,
                            int num_experts, int64_t num_max_tokens, int expert_alignment, bool do_expand,
                            bool cpu_sync, int num_sms, int max_topk, std::uintptr_t compute_stream) {
    profile_.begin(HostPathProfile::kBeginDispatch);
    std::optional<at::Tensor> data;
    std::optional<at::Tensor> scales;
    if (!dispatch_input(x, data, scales)) return py::none();
    const int64_t num_tokens = data->size(0);
    const int hidden = static_cast<int>(data->size(1));
    const std::optional<at::Tensor> routing = as_tensor(topk_idx);
    if (!routing || !kernel_ready(*routing) || routing->scalar_type() != at::kLong || routing->dim() != 2 ||
        routing->size(0) != num_tokens || routing->size(1) < 1 || routing->size(1) > max_topk) {
      return py::none();
    }
    const int num_topk = static_cast<int>(routing->size(1));
    const int num_ranks = runtime.device_view().num_ranks;
    if (num_experts < 1 || num_experts > kMaxExperts || num_experts % num_ranks != 0 || num_max_tokens < 1 ||
        num_tokens > num_max_tokens || expert_alignment < 1) {
      return py::none();
    }
    std::optional<at::Tensor> weights;
    if (!weights_argument(topk_weights, num_tokens, num_topk, weights)) return py::none();
    const std::optional<int> sms = resolve_num_sms(num_sms, num_experts, num_topk);
    if (!sms) return py::none();
    const HtCall* call = find_call(runtime, {num_max_tokens, hidden, num_topk, num_experts, scales.has_value(), false});
    if (call == nullptr) return py::none();

    profile_.stamp("checks");
    const NotifyBlock notify(empty({NotifyBlock::num_ints(*call, num_tokens)}, at::kInt), *call, num_tokens);
    profile_.stamp("notify block");
    ++num_calls_;
    runtime.join_streams(as_cuda_stream(comm_stream_), as_cuda_stream(compute_stream));
    if (cpu_sync) runtime.reset_mapped_counter(ht::kMappedReady);
    profile_.stamp("join");
    launch_ht_notify(runtime, *call, address(*routing), address(notify.routing), static_cast<int>(num_tokens),
                     expert_alignment, do_expand, address(notify.expert_slot), address(notify.dst_slot),
                     address(notify.scratch), address(notify.counts), cpu_sync, 0, address(notify.rank_prefix_matrix),
                     address(notify.hybrid_routing), *sms, comm_stream_, false);
    profile_.stamp("notify launch");
    launch_ht_dispatch(runtime, *call, static_cast<int>(num_tokens), address(*data), address(scales),
                       address(notify.routing), address(weights), address(notify.dst_slot), address(notify.expert_slot),
                       0, address(notify.hybrid_routing), false, *sms, comm_stream_, false);
    profile_.stamp("dispatch launch");
    py::tuple result = py::make_tuple(py::cast(*call), *sms, notify.to_python());
    profile_.stamp("arrays to Python");
    return result;
  }

  // The rest of an uncached dispatch begun by begin_dispatch. With cpu_sync: the host's wait for the
  // counts (GIL released), then the handle's sizes set from them; without: the sizes high_throughput.py
  // put in the handle (worst case). Then the handle's per-row arrays (set in the handle) and the
  // outputs, the copy epilogue and the caller's stream joined. Returns (recv_x, recv_scales,
  // recv_topk_idx, recv_topk_weights), or the wait's value (an int) when the wait timed out or the
  // kernels recorded an error: high_throughput.py then raises it, after joining the streams.
  py::object finish_dispatch(Runtime& runtime, const HtCall& call, py::handle handle, bool do_expand,
                             int expert_alignment, bool has_weights, bool cpu_sync, std::uintptr_t compute_stream) {
    profile_.begin(HostPathProfile::kFinishDispatch);
    int64_t num_recv_tokens = 0;
    int64_t num_expanded_tokens = 0;
    if (cpu_sync) {
      int32_t ready = 0;
      {
        py::gil_scoped_release release;
        ready = runtime.wait_mapped_counter(ht::kMappedReady);
      }
      profile_.stamp("count wait");
      // Only a finished record, as high_throughput.py's _check_device_errors raises it: one still
      // being written is raised at the next synchronisation point, as on the Python path.
      if (ready < 0 || reported_error(runtime.error_record())) return py::int_(ready);
      const int num_local = call.num_local_experts();
      const std::vector<int32_t> values = runtime.read_mapped_counters(0, ht::kMappedAlignedExpertCounts + num_local);
      num_recv_tokens = values[ht::kMappedNumRecvTokens];
      num_expanded_tokens = values[ht::kMappedNumExpandedTokens];
      handle.attr("num_recv_tokens") = num_recv_tokens;
      handle.attr("num_expanded_tokens") = num_expanded_tokens;
      // One int per local expert (256 at one rank with E = 256), after the wait: filled through the
      // C API, without pybind11's per-item accessor objects.
      py::list per_expert(num_local);
      for (int l = 0; l < num_local; ++l) {
        PyObject* count = PyLong_FromLong(values[ht::kMappedAlignedExpertCounts + l]);
        if (count == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(per_expert.ptr(), l, count);  // steals the new reference into the empty slot
      }
      handle.attr("num_recv_tokens_per_expert_list") = per_expert;
    } else {
      num_recv_tokens = handle.attr("num_recv_tokens").cast<int64_t>();
      num_expanded_tokens = handle.attr("num_expanded_tokens").cast<int64_t>();
    }
    profile_.stamp("sizes");
    const int64_t num_rows = do_expand ? num_expanded_tokens : num_recv_tokens;
    const at::Tensor counts = tensor_field(handle, "counts");
    std::optional<at::Tensor> expanded_rows;
    if (do_expand) expanded_rows = empty({num_recv_tokens, int64_t{call.num_topk}}, at::kInt);
    const at::Tensor src_info = empty({num_recv_tokens, int64_t{ht::kSrcInfoColumns}}, at::kInt);
    const auto outputs = allocate_dispatch_outputs(call, num_rows, do_expand, has_weights);
    profile_.stamp("allocations");
    launch_ht_dispatch_epilogue(runtime, call, do_expand, expert_alignment, has_weights, address(counts), num_rows,
                                num_recv_tokens, address(outputs.x), address(outputs.scales), address(outputs.topk_idx),
                                address(outputs.weights), address(src_info), address(expanded_rows), max_num_sms_,
                                comm_stream_);
    profile_.stamp("epilogue launch");
    runtime.join_streams(as_cuda_stream(compute_stream), as_cuda_stream(comm_stream_));
    profile_.stamp("join back");
    handle.attr("recv_src_info") = wrap(src_info);
    handle.attr("recv_expanded_row_idx") = wrap(expanded_rows);
    py::tuple result =
        py::make_tuple(wrap(outputs.x), wrap(outputs.scales), wrap(outputs.topk_idx), wrap(outputs.weights));
    profile_.stamp("outputs to Python");
    return result;
  }

 private:
  static cudaStream_t as_cuda_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

  // Outputs and the notify block on the caller's stream (current in torch), as the Python path
  // allocates them: comm waits for that stream first, and the caller's stream waits for comm at the end.
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) const {
    return uninitialized_tensor(device_, sizes, dtype);
  }

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
  // topk_weights: None, or fp32 [num_rows, num_columns] (num_columns 0: [num_rows]) as the kernels
  // read it (high_throughput.py's _check_weights). False: the Python path takes the call.
  bool weights_argument(py::handle object, int64_t num_rows, int64_t num_columns,
                        std::optional<at::Tensor>& weights) const {
    if (object.is_none()) return true;
    weights = as_tensor(object);
    return weights && (num_columns == 0 ? is_vector(*weights, at::kFloat, num_rows)
                                        : is_rows(*weights, at::kFloat, num_rows, num_columns));
  }
  bool is_fp8_rows(const at::Tensor& data) const {
    return kernel_ready(data) && data.scalar_type() == at::kFloat8_e4m3fn && has_rows(data, kFp8GroupSize);
  }
  // fp32 [T, H/128], already as the kernels read it (packed UE8M0 or strided scales: Python path).
  bool is_fp8_scales(const at::Tensor& scales, const at::Tensor& data) const {
    return is_rows(scales, at::kFloat, data.size(0), data.size(1) / kFp8GroupSize);
  }
  // dispatch's x: bf16 [T, H] (H % 8 == 0) or (fp8 [T, H], fp32 scales [T, H/128]) (H % 128 == 0),
  // each as the kernels read it (high_throughput.py's _check_dispatch_x and _kernel_ready).
  bool dispatch_input(py::handle x, std::optional<at::Tensor>& data, std::optional<at::Tensor>& scales) const {
    if (py::isinstance<py::tuple>(x) || py::isinstance<py::list>(x)) {
      const auto pair = py::reinterpret_borrow<py::sequence>(x);
      if (py::len(pair) != 2) return false;
      data = as_tensor(pair[0]);
      scales = as_tensor(pair[1]);
      return data && scales && is_fp8_rows(*data) && is_fp8_scales(*scales, *data);
    }
    data = as_tensor(x);
    return data && kernel_ready(*data) && data->scalar_type() == at::kBFloat16 && has_rows(*data, 8);
  }

  // A dispatch's outputs, each in an allocation of its own like torch.empty's: outputs must not
  // share storage (torch.library custom ops, deep_ep.ops among them, refuse returns that alias
  // each other, and a caller may free recv_x long before the rest).
  struct DispatchOutputs {
    at::Tensor x;
    std::optional<at::Tensor> scales, topk_idx, weights;
  };
  DispatchOutputs allocate_dispatch_outputs(const HtCall& call, int64_t num_rows, bool do_expand,
                                            bool has_weights) const {
    DispatchOutputs outputs;
    outputs.x = empty({num_rows, call.hidden}, call.use_fp8 ? at::kFloat8_e4m3fn : at::kBFloat16);
    if (call.use_fp8) outputs.scales = empty({num_rows, call.hidden / kFp8GroupSize}, at::kFloat);
    if (!do_expand) outputs.topk_idx = empty({num_rows, call.num_topk}, at::kLong);
    if (has_weights) {
      outputs.weights = do_expand ? empty({num_rows}, at::kFloat) : empty({num_rows, call.num_topk}, at::kFloat);
    }
    return outputs;
  }

  // An EPHandle's device arrays (the handle came from this buffer's dispatch: high_throughput.py
  // checked its type and owner).
  static at::Tensor tensor_field(py::handle handle, const char* name) {
    return THPVariable_Unpack(handle.attr(name).ptr());
  }
  static std::optional<at::Tensor> optional_tensor_field(py::handle handle, const char* name) {
    const py::object field = handle.attr(name);
    return field.is_none() ? std::nullopt : as_tensor(field);
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
  HostPathProfile profile_;
  std::vector<std::pair<std::pair<int, int>, int>> num_sms_estimates_;
  std::vector<std::pair<CallKey, HtCall>> calls_;
};

}  // namespace

void register_ht_host_path(py::module_& m) {
  // The Python path's notify block (high_throughput.py's _notify allocates it, on the stream it chose).
  m.def(
      "ht_notify_block_ints",
      [](const HtCall& call, int64_t num_tokens) { return NotifyBlock::num_ints(call, num_tokens); }, py::arg("call"),
      py::arg("num_tokens"));
  m.def(
      "ht_notify_block",
      [](py::handle block, const HtCall& call, int64_t num_tokens) {
        const std::optional<at::Tensor> tensor = as_tensor(block);
        if (!tensor || tensor->scalar_type() != at::kInt || tensor->dim() != 1 ||
            tensor->size(0) != NotifyBlock::num_ints(call, num_tokens)) {
          throw py::type_error("ht_notify_block: block must be an int32 tensor of ht_notify_block_ints(call, T) ints");
        }
        return NotifyBlock(*tensor, call, num_tokens).to_python();
      },
      py::arg("block"), py::arg("call"), py::arg("num_tokens"));
  py::class_<HtHostPath>(m, "HtHostPath")
      .def(py::init<int, std::uintptr_t, int, int>(), py::arg("device"), py::arg("comm_stream"), py::arg("max_num_sms"),
           py::arg("max_ht_num_sms"))
      .def("remember_num_sms", &HtHostPath::remember_num_sms)
      .def_property_readonly("num_calls", &HtHostPath::num_calls)
      .def("start_profile", &HtHostPath::start_profile)
      .def("stop_profile", &HtHostPath::stop_profile)
      // Positional arguments only: keyword matching costs host time on every call.
      .def("cached_dispatch", &HtHostPath::cached_dispatch)
      .def("begin_dispatch", &HtHostPath::begin_dispatch)
      .def("finish_dispatch", &HtHostPath::finish_dispatch)
      .def("combine", &HtHostPath::combine);
}

}  // namespace deep_ep
