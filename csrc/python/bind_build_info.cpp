// Which NCCL the extension was compiled against and which one the process loaded. The device-API
// structs change between NCCL versions, so deep_ep/_nccl_check.py refuses to import when the two
// differ instead of letting kernels read a devComm at the wrong offsets.
#include <nccl.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

// CMake compiled in the version of the nccl.h it chose; a different nccl.h earlier on the include
// path (a system copy in /usr/include, nvcc's own include dir) would break this.
static_assert(NCCL_VERSION_CODE == EP_NCCL_EXPECTED_VERSION_CODE,
              "nccl.h seen by the compiler is not the one CMake chose (FindNcclByVersion.cmake)");

namespace py = pybind11;

namespace deep_ep {

void register_build_info(py::module_& m) {
  m.def(
      "nccl_compiled_version", [] { return static_cast<int>(NCCL_VERSION_CODE); },
      "NCCL_VERSION_CODE of the nccl.h the extension was compiled with (major*10000 + minor*100 + patch).");
  m.def(
      "nccl_loaded_version",
      [] {
        int version = 0;
        const ncclResult_t result = ncclGetVersion(&version);
        if (result != ncclSuccess) {
          throw std::runtime_error(std::string("ncclGetVersion failed: ") + ncclGetErrorString(result));
        }
        return version;
      },
      "ncclGetVersion() of the libnccl.so.2 loaded in this process.");
  m.def(
      "nccl_library_path", [] { return std::string(EP_NCCL_LIBRARY_PATH); },
      "Path of the libnccl.so.2 the extension was linked against.");
  m.def(
      "cuda_archs", [] { return std::string(EP_CUDA_ARCHS_CSV); },
      "The CUDA architectures the kernels were compiled for (SASS only), comma-separated, e.g. \"90\".");
}

}  // namespace deep_ep
