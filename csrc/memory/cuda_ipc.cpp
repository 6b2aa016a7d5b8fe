#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "memory/symmetric_memory.hpp"
#include "runtime/cuda_check.hpp"

namespace deep_ep {

void throw_if_window_allocation_fails_by_request(int64_t bytes) {
  const char* value = std::getenv("EP_TEST_FAIL_WINDOW_ALLOC");
  if (value != nullptr && std::string(value) == "1") {
    throw std::runtime_error("window allocation of " + std::to_string(bytes) +
                             " bytes failed: out of memory (injected by EP_TEST_FAIL_WINDOW_ALLOC=1)");
  }
}

CudaIpcMemory::CudaIpcMemory(int rank, int num_ranks, int64_t bytes)
    : rank_(rank), num_ranks_(num_ranks), bytes_(bytes) {
  throw_if_window_allocation_fails_by_request(bytes);
  EP_CUDA_CHECK(cudaMalloc(&base_, static_cast<size_t>(bytes)));
  // A zeroed window is a valid one: every counter means "nothing arrived", every epoch is 0.
  EP_CUDA_CHECK(cudaMemset(base_, 0, static_cast<size_t>(bytes)));
  EP_CUDA_CHECK(cudaDeviceSynchronize());
}

CudaIpcMemory::~CudaIpcMemory() {
  try {
    release();
  } catch (...) {
    // Destructors must not throw; release() already freed what it could.
  }
}

std::string CudaIpcMemory::handle() const {
  cudaIpcMemHandle_t handle;
  EP_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base_));
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void CudaIpcMemory::connect(const std::vector<std::string>& handles) {
  if (static_cast<int>(handles.size()) != num_ranks_) {
    throw std::invalid_argument("connect_ipc needs one handle per rank (" + std::to_string(num_ranks_) + "), got " +
                                std::to_string(handles.size()));
  }
  peer_bases_.assign(num_ranks_, nullptr);
  for (int peer = 0; peer < num_ranks_; ++peer) {
    if (peer == rank_) {
      peer_bases_[peer] = base_;
      continue;
    }
    if (handles[peer].size() != sizeof(cudaIpcMemHandle_t)) {
      throw std::invalid_argument("IPC handle of rank " + std::to_string(peer) + " has " +
                                  std::to_string(handles[peer].size()) + " bytes, expected " +
                                  std::to_string(sizeof(cudaIpcMemHandle_t)));
    }
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, handles[peer].data(), sizeof(handle));
    void* mapped = nullptr;
    const cudaError_t status = cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
      throw std::runtime_error("cudaIpcOpenMemHandle for rank " + std::to_string(peer) +
                               " failed: " + cudaGetErrorString(status) +
                               " (the ipc backend needs every rank on this host and load/store reachable: the same "
                               "GPU or GPUs with P2P access)");
    }
    peer_bases_[peer] = static_cast<uint8_t*>(mapped);
  }
}

void CudaIpcMemory::release() {
  for (int peer = 0; peer < static_cast<int>(peer_bases_.size()); ++peer) {
    if (peer != rank_ && peer_bases_[peer] != nullptr) cudaIpcCloseMemHandle(peer_bases_[peer]);
  }
  peer_bases_.clear();
  if (base_ != nullptr) {
    cudaFree(base_);
    base_ = nullptr;
  }
}

}  // namespace deep_ep
