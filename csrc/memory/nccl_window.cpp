#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "kernels/runtime_kernels.hpp"
#include "memory/symmetric_memory.hpp"

namespace deep_ep {
namespace {

void nccl_check(ncclResult_t status, const char* call) {
  if (status != ncclSuccess) {
    throw std::runtime_error(std::string(call) + " failed: " + ncclGetErrorString(status) + " (" +
                             ncclGetLastError(nullptr) + ")");
  }
}

#define EP_NCCL_CHECK(call) nccl_check((call), #call)

}  // namespace

struct NcclWindowMemory::State {
  ncclComm_t comm = nullptr;
  void* buffer = nullptr;
  ncclWindow_t window = nullptr;
  ncclDevComm dev_comm{};
  bool dev_comm_created = false;
};

NcclWindowMemory::NcclWindowMemory(int rank, int num_ranks, int64_t bytes)
    : rank_(rank), num_ranks_(num_ranks), bytes_(bytes), state_(std::make_unique<State>()) {
  int loaded = 0;
  EP_NCCL_CHECK(ncclGetVersion(&loaded));
  // Device-API structs change between versions: kernels compiled against one header must run on
  // exactly that library (NCCL's device API has no cross-version compatibility).
  if (loaded != NCCL_VERSION_CODE) {
    throw std::runtime_error("the nccl backend was compiled against NCCL " + std::to_string(NCCL_VERSION_CODE) +
                             " but NCCL " + std::to_string(loaded) + " is loaded; rebuild or use backend='ipc'");
  }
}

NcclWindowMemory::~NcclWindowMemory() {
  try {
    release();
  } catch (...) {
    // Destructors must not throw.
  }
}

std::string NcclWindowMemory::create_unique_id() {
  ncclUniqueId id;
  EP_NCCL_CHECK(ncclGetUniqueId(&id));
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void NcclWindowMemory::connect(const std::string& unique_id) {
  if (unique_id.size() != sizeof(ncclUniqueId)) {
    throw std::invalid_argument("NCCL unique id must have " + std::to_string(sizeof(ncclUniqueId)) + " bytes, got " +
                                std::to_string(unique_id.size()));
  }
  ncclUniqueId id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  EP_NCCL_CHECK(ncclCommInitRank(&state_->comm, num_ranks_, id, rank_));

  // LSA only: requesting GIN resources on a communicator without GIN support breaks it (NCCL 2.28).
  const ncclTeam lsa = ncclTeamLsa(state_->comm);
  if (lsa.nRanks != num_ranks_) {
    throw std::runtime_error("the nccl backend needs every rank in one load/store (LSA) team, but the team has " +
                             std::to_string(lsa.nRanks) + " of " + std::to_string(num_ranks_) +
                             " ranks (scale-out through GIN is not implemented)");
  }
}

void NcclWindowMemory::allocate() {
  if (state_->comm == nullptr) throw std::logic_error("allocate() needs connect() first");
  throw_if_window_allocation_fails_by_request(bytes_);
  EP_NCCL_CHECK(ncclMemAlloc(&state_->buffer, static_cast<size_t>(bytes_)));
  EP_CUDA_CHECK(cudaMemset(state_->buffer, 0, static_cast<size_t>(bytes_)));
  EP_CUDA_CHECK(cudaDeviceSynchronize());
}

void NcclWindowMemory::register_window() {
  if (state_->buffer == nullptr) throw std::logic_error("register_window() needs allocate() first");
  EP_NCCL_CHECK(ncclCommWindowRegister(state_->comm, state_->buffer, static_cast<size_t>(bytes_), &state_->window,
                                       NCCL_WIN_DEFAULT));
  if (state_->window == nullptr) throw std::runtime_error("ncclCommWindowRegister returned no window");

  ncclDevCommRequirements requirements;
  std::memset(&requirements, 0, sizeof(requirements));  // 2.28.9 has no initializer macro
  requirements.lsaBarrierCount = 1;
  // Creating the device communicator is the real check that symmetric memory works here.
  EP_NCCL_CHECK(ncclDevCommCreate(state_->comm, &requirements, &state_->dev_comm));
  state_->dev_comm_created = true;

  uint8_t** pointers_device = nullptr;
  EP_CUDA_CHECK(cudaMalloc(&pointers_device, sizeof(uint8_t*) * num_ranks_));
  launch_query_lsa_pointers(state_->window, num_ranks_, pointers_device, nullptr);
  peer_bases_.assign(num_ranks_, nullptr);
  EP_CUDA_CHECK(cudaMemcpy(peer_bases_.data(), pointers_device, sizeof(uint8_t*) * num_ranks_, cudaMemcpyDeviceToHost));
  EP_CUDA_CHECK(cudaFree(pointers_device));
}

void NcclWindowMemory::release() {
  if (!state_) return;
  // Order from NCCL's 2.28.9 examples: devComm, window, memory, communicator.
  if (state_->dev_comm_created) ncclDevCommDestroy(state_->comm, &state_->dev_comm);
  state_->dev_comm_created = false;
  if (state_->window != nullptr) ncclCommWindowDeregister(state_->comm, state_->window);
  state_->window = nullptr;
  if (state_->buffer != nullptr) ncclMemFree(state_->buffer);
  state_->buffer = nullptr;
  if (state_->comm != nullptr) {
    ncclCommFinalize(state_->comm);
    ncclCommDestroy(state_->comm);
  }
  state_->comm = nullptr;
  peer_bases_.clear();
}

}  // namespace deep_ep
