// Error checks for CUDA and NCCL calls in host code: throw with the call, the file and the reason.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace deep_ep {

[[noreturn]] inline void throw_cuda_error(const char* call, cudaError_t status, const char* file, int line) {
  throw std::runtime_error(std::string(call) + " failed at " + file + ":" + std::to_string(line) + ": " +
                           cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
}

}  // namespace deep_ep

#define EP_CUDA_CHECK(call)                                                                            \
  do {                                                                                                 \
    const cudaError_t ep_status_ = (call);                                                             \
    if (ep_status_ != cudaSuccess) ::deep_ep::throw_cuda_error(#call, ep_status_, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: a bad configuration shows up here, not at the next sync.
#define EP_CHECK_LAUNCH(kernel_name)                                                                         \
  do {                                                                                                       \
    const cudaError_t ep_status_ = cudaGetLastError();                                                       \
    if (ep_status_ != cudaSuccess) ::deep_ep::throw_cuda_error(kernel_name, ep_status_, __FILE__, __LINE__); \
  } while (0)
