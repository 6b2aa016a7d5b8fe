// The extension module. Each bind_*.cpp registers one area; no logic lives here.
#include <pybind11/pybind11.h>

namespace deep_ep {
void register_build_info(pybind11::module_& m);
void register_geometry(pybind11::module_& m);
void register_runtime(pybind11::module_& m);
void register_high_throughput(pybind11::module_& m);
void register_ht_host_path(pybind11::module_& m);
void register_low_latency(pybind11::module_& m);
}  // namespace deep_ep

PYBIND11_MODULE(_C, m) {
  m.doc() = "deep_ep native extension: runtime, geometry and communication kernels";
  deep_ep::register_build_info(m);
  deep_ep::register_geometry(m);
  deep_ep::register_runtime(m);
  deep_ep::register_high_throughput(m);
  deep_ep::register_ht_host_path(m);
  deep_ep::register_low_latency(m);
}
