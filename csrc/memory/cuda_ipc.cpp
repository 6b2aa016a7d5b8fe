#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "memory/symmetric_memory.hpp"

namespace deep_ep {

void throw_if_window_allocation_fails_by_request(int64_t bytes) {
  const char* value = std::getenv("EP_TEST_FAIL_WINDOW_ALLOC");
  if (value != nullptr && std::string(value) == "1") {
    throw std::runtime_error("window allocation of " + std::to_string(bytes) +
                             " bytes failed: out of memory (injected by EP_TEST_FAIL_WINDOW_ALLOC=1)");
  }
}

namespace {

// Handle strings start with the kind, so that a mix of kinds is refused instead of misread.
constexpr char kSharedTag = 'S';
constexpr char kLegacyTag = 'L';

}  // namespace

CudaIpcMemory::CudaIpcMemory(int rank, int num_ranks, int64_t bytes)
    : rank_(rank), num_ranks_(num_ranks), bytes_(bytes) {
  throw_if_window_allocation_fails_by_request(bytes);
  EP_CUDA_CHECK(cudaGetDevice(&device_));
  if (ShareableAllocation::supported(device_)) {
    shared_ = std::make_unique<ShareableAllocation>();
    shared_->create(device_, bytes);
    base_ = shared_->base();
  } else {
    EP_CUDA_CHECK(cudaMalloc(&base_, static_cast<size_t>(bytes)));
  }
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
  if (shared_) return kSharedTag + shared_->handle();
  cudaIpcMemHandle_t handle;
  EP_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base_));
  return kLegacyTag + std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void CudaIpcMemory::connect(const std::vector<std::string>& handles) {
  if (static_cast<int>(handles.size()) != num_ranks_) {
    throw std::invalid_argument("connect_ipc needs one handle per rank (" + std::to_string(num_ranks_) + "), got " +
                                std::to_string(handles.size()));
  }
  const char my_tag = shared_ ? kSharedTag : kLegacyTag;
  peer_bases_.assign(num_ranks_, nullptr);
  imported_.clear();
  imported_.resize(num_ranks_);
  for (int peer = 0; peer < num_ranks_; ++peer) {
    if (peer == rank_) {
      peer_bases_[peer] = base_;
      continue;
    }
    const std::string& handle = handles[peer];
    if (handle.empty() || handle[0] != my_tag) {
      throw std::invalid_argument("IPC handle of rank " + std::to_string(peer) +
                                  " is of another kind than this rank's (" +
                                  (my_tag == kSharedTag ? "reference-counted" : "legacy CUDA IPC") +
                                  "): every rank of a host must share its window the same way (EP_IPC_MEMORY)");
    }
    if (shared_) {
      imported_[peer] = std::make_unique<ShareableAllocation>();
      imported_[peer]->import(device_, handle.substr(1), bytes_);
      peer_bases_[peer] = imported_[peer]->base();
      continue;
    }
    if (handle.size() != 1 + sizeof(cudaIpcMemHandle_t)) {
      throw std::invalid_argument("IPC handle of rank " + std::to_string(peer) + " has " +
                                  std::to_string(handle.size() - 1) + " bytes, expected " +
                                  std::to_string(sizeof(cudaIpcMemHandle_t)));
    }
    cudaIpcMemHandle_t ipc_handle;
    std::memcpy(&ipc_handle, handle.data() + 1, sizeof(ipc_handle));
    void* mapped = nullptr;
    const cudaError_t status = cudaIpcOpenMemHandle(&mapped, ipc_handle, cudaIpcMemLazyEnablePeerAccess);
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
  if (!shared_) {
    for (int peer = 0; peer < static_cast<int>(peer_bases_.size()); ++peer) {
      if (peer != rank_ && peer_bases_[peer] != nullptr) cudaIpcCloseMemHandle(peer_bases_[peer]);
    }
  }
  peer_bases_.clear();
  imported_.clear();  // each drops this process's reference to a peer's window
  if (shared_) {
    shared_.reset();
  } else if (base_ != nullptr) {
    cudaFree(base_);
  }
  base_ = nullptr;
}

}  // namespace deep_ep
