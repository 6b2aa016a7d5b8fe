// Loading every kernel of the library into the process's CUDA context at buffer construction.
//
// With CUDA's lazy loading (the default since CUDA 12.2) a kernel is loaded at its first launch, and
// loading may need the context to synchronise. Ranks that share a GPU through MPS share one
// context, so a rank launching one of our kernels for the first time can wait for a peer's kernel
// that is itself spinning until this rank's kernel runs: a deadlock broken only by the peer's wait
// deadline (measured: a 4-rank MoE training step on one H200 stalled that way in its first
// combine). Every kernel is therefore loaded while the buffer is built, before any rank can launch
// a kernel that waits for its peers.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace deep_ep {

// Every kernel of the library, loaded now (cudaFuncGetAttributes loads a lazily loaded function).
// Throws std::runtime_error naming the kernel that could not be loaded.
void preload_kernels();

template <typename Kernel>
void preload_kernel(Kernel* kernel, const char* name) {
  cudaFuncAttributes attributes{};
  const cudaError_t status = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel));
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("loading kernel ") + name + " failed: " + cudaGetErrorString(status));
  }
}

// One per source file, each loading that file's kernels.
void preload_low_latency_combine_kernels();
void preload_low_latency_dispatch_kernels();
void preload_runtime_kernels();

namespace ht {
void preload_ht_combine_kernels();
void preload_ht_combine_reduce_kernels();
void preload_ht_combine_pull_kernels();
void preload_ht_dispatch_kernels();
void preload_ht_dispatch_epilogue_kernels();
void preload_ht_dispatch_hybrid_kernels();
void preload_ht_notify_kernels();
}  // namespace ht

}  // namespace deep_ep
