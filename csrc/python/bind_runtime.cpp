// _C.Runtime: construction, bootstrap, error record, mapped counters, phase clock, barrier.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/error_record.hpp"
#include "common/phase_clock.hpp"
#include "runtime/runtime.hpp"

namespace py = pybind11;

namespace deep_ep {

void register_runtime(py::module_& m) {
  m.attr("MAPPED_WAIT_TIMEOUT") = Runtime::kMappedWaitTimeout;
  m.attr("MAPPED_WAIT_DEVICE_ERROR") = Runtime::kMappedWaitDeviceError;
  m.attr("NUM_MAPPED_COUNTERS") = kNumMappedCounters;
  // Phase clock: {kernel name: [stamp names]} in the layout's order, and the layout's extents.
  py::dict clocked;
  for (const ClockedKernelNames& names : kClockedKernelNames) {
    py::list stamps;
    for (const char* stamp : names.stamps) {
      if (stamp != nullptr) stamps.append(stamp);
    }
    clocked[names.kernel] = stamps;
  }
  m.attr("PHASE_CLOCK_KERNELS") = clocked;
  m.attr("PHASE_CLOCK_CTAS") = kPhaseClockCtas;
  m.attr("PHASE_CLOCK_STAMPS") = kPhaseClockStamps;

  py::class_<Runtime>(m, "Runtime")
      .def(py::init([](int rank, int num_ranks, int num_scaleup_ranks, int device, int64_t ht_region_bytes,
                       int64_t ll_region_bytes, double gpu_timeout_secs, double cpu_timeout_secs,
                       const std::string& backend, int max_num_sms, const std::string& scaleout, int max_ht_num_sms,
                       bool ll_scaleout, bool phase_clock) {
             if (backend != "ipc" && backend != "nccl") {
               throw std::invalid_argument("backend must be 'ipc' or 'nccl', got '" + backend + "'");
             }
             RuntimeConfig config;
             config.rank = rank;
             config.num_ranks = num_ranks;
             config.num_scaleup_ranks = num_scaleup_ranks;
             config.device = device;
             config.window = window_layout(ht_region_bytes, ll_region_bytes);
             config.gpu_timeout_secs = gpu_timeout_secs;
             config.cpu_timeout_secs = cpu_timeout_secs;
             config.backend = backend == "ipc" ? BackendKind::kIpc : BackendKind::kNccl;
             config.max_num_sms = max_num_sms;
             config.max_ht_num_sms = max_ht_num_sms;
             config.ll_scaleout = ll_scaleout;
             config.phase_clock = phase_clock;
             config.scaleout = parse_scaleout_kind(scaleout);
             return std::make_unique<Runtime>(config);
           }),
           py::arg("rank"), py::arg("num_ranks"), py::arg("num_scaleup_ranks"), py::arg("device"),
           py::arg("ht_region_bytes"), py::arg("ll_region_bytes"), py::arg("gpu_timeout_secs"),
           py::arg("cpu_timeout_secs"), py::arg("backend"), py::arg("max_num_sms"), py::arg("scaleout") = "lsa",
           py::arg("max_ht_num_sms") = 0, py::arg("ll_scaleout") = false, py::arg("phase_clock") = false)
      .def("ipc_handle", [](const Runtime& self) { return py::bytes(self.ipc_handle()); })
      .def("connect_ipc",
           [](Runtime& self, const std::vector<py::bytes>& handles) {
             std::vector<std::string> raw;
             raw.reserve(handles.size());
             for (const auto& handle : handles) raw.emplace_back(handle);
             self.connect_ipc(raw);
           })
      .def_static("create_nccl_unique_id", []() { return py::bytes(Runtime::create_nccl_unique_id()); })
      .def("connect_nccl", [](Runtime& self, const py::bytes& unique_id) { self.connect_nccl(std::string(unique_id)); })
      .def("allocate_nccl_window", &Runtime::allocate_nccl_window)
      .def("register_nccl_window", &Runtime::register_nccl_window)
      .def("connected", &Runtime::connected)
      .def("local_base", [](const Runtime& self) { return reinterpret_cast<std::uintptr_t>(self.local_base()); })
      .def("peer_base",
           [](const Runtime& self, int rank) { return reinterpret_cast<std::uintptr_t>(self.peer_base(rank)); })
      .def(
          "copy_into_window",
          [](const Runtime& self, int rank, int64_t offset, std::uintptr_t src, int64_t num_bytes,
             std::uintptr_t stream) {
            self.copy_into_window(rank, offset, reinterpret_cast<const void*>(src), num_bytes,
                                  reinterpret_cast<cudaStream_t>(stream));
          },
          py::arg("rank"), py::arg("offset"), py::arg("src"), py::arg("num_bytes"), py::arg("stream"))
      .def("total_bytes", [](const Runtime& self) { return self.window().total_bytes; })
      .def("error_record",
           [](const Runtime& self) {
             const ErrorRecord record = self.error_record();
             py::dict d;
             d["status"] = record.status;
             d["operation"] = std::string(operation_name(record.operation));
             d["phase"] = std::string(phase_name(record.phase));
             d["rank"] = record.rank;
             d["peer"] = record.peer;
             d["call_serial"] = record.call_serial;
             d["expected"] = record.expected;
             d["seen"] = record.seen;
             d["peer_progress"] = record.peer_progress;
             d["invalid_status"] = record.invalid_status;
             d["invalid_operation"] = std::string(operation_name(record.invalid_operation));
             d["invalid_expert"] = record.invalid_expert;
             d["num_experts"] = record.num_experts;
             d["invalid_kind"] = record.invalid_kind == static_cast<int32_t>(InvalidExpertKind::kDuplicate)
                                     ? std::string("duplicate")
                                     : std::string("out_of_range");
             d["invalid_token"] = record.invalid_token;
             d["peer_failed_status"] = record.peer_failed_status;
             d["peer_failed_operation"] = std::string(operation_name(record.peer_failed_operation));
             d["peer_failed_rank"] = record.peer_failed_rank;
             return d;
           })
      // Cheap check for the per-call fast path; error_record() builds the full report.
      .def("has_error", [](const Runtime& self) { return any_error(self.error_record()); })
      .def("has_fatal_error", [](const Runtime& self) { return self.error_record().status != 0; })
      .def("clear_invalid_input", &Runtime::clear_invalid_input)
      // Per-call host path: positional arguments only (keyword matching costs host time).
      .def("begin_call", &Runtime::begin_call)
      .def("join_streams",
           [](const Runtime& self, std::uintptr_t waiting, std::uintptr_t signalling) {
             self.join_streams(reinterpret_cast<cudaStream_t>(waiting), reinterpret_cast<cudaStream_t>(signalling));
           })
      .def("clear_peer_failed", &Runtime::clear_peer_failed)
      .def("reset_mapped_counter", &Runtime::reset_mapped_counter, py::arg("index"))
      .def("read_mapped_counters", &Runtime::read_mapped_counters, py::arg("begin"), py::arg("count"))
      .def("read_phase_clock", &Runtime::read_phase_clock, py::arg("reset"))
      .def("wait_mapped_counter", &Runtime::wait_mapped_counter, py::arg("index"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "launch_barrier",
          [](const Runtime& self, std::uintptr_t stream) {
            self.launch_barrier(reinterpret_cast<cudaStream_t>(stream));
          },
          py::arg("stream"))
      .def(
          "count_dirty_workspace_bytes",
          [](const Runtime& self, std::uintptr_t stream) {
            return self.count_dirty_workspace_bytes(reinterpret_cast<cudaStream_t>(stream));
          },
          py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("destroy", &Runtime::destroy);
}

}  // namespace deep_ep
