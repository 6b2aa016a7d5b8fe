#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/geometry.hpp"
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
  ncclDevComm* dev_comm_device = nullptr;  // gin: copy of dev_comm in device memory, for kernels
};

NcclWindowMemory::NcclWindowMemory(int rank, int num_ranks, int64_t bytes, bool gin)
    : rank_(rank), num_ranks_(num_ranks), bytes_(bytes), gin_(gin), state_(std::make_unique<State>()) {
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

  // Without gin every peer must be load/store reachable. With gin the LSA team is this rank's host
  // (or less); ranks outside it are reached only through GIN (peer_bases_ stays nullptr for them).
  const ncclTeam lsa = ncclTeamLsa(state_->comm);
  lsa_size_ = lsa.nRanks;
  if (lsa.nRanks != num_ranks_ && !gin_) {
    throw std::runtime_error(
        "without the 'gin' scale-out transport the nccl backend needs every rank in one "
        "load/store (LSA) team, but the team has " +
        std::to_string(lsa.nRanks) + " of " + std::to_string(num_ranks_) +
        " ranks (ranks on several hosts need hybrid mode over 'gin')");
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
  if (gin_) {
    // What the gin transport (kernels/scaleout_gin.cuh) uses: signals 0..kMaxScaleoutSignals-1 and
    // the contexts (the count is only a hint in 2.28.9; the devComm says what NCCL gave). Puts,
    // signals without data and flushes need no counters and no GIN barriers.
    requirements.ginForceEnable = true;
    requirements.ginContextCount = 4;
    requirements.ginSignalCount = kMaxScaleoutSignals;
  }
  // Creating the device communicator is the real check that symmetric memory (and GIN) work here.
  const ncclResult_t created = ncclDevCommCreate(state_->comm, &requirements, &state_->dev_comm);
  if (created != ncclSuccess) {
    const std::string reason = std::string(ncclGetErrorString(created)) + " (" + ncclGetLastError(state_->comm) + ")";
    if (!gin_) throw std::runtime_error("ncclDevCommCreate failed: " + reason);
    throw std::runtime_error(
        "the 'gin' scale-out transport needs NCCL GPU-initiated networking (GIN), but ncclDevCommCreate with " +
        std::to_string(kMaxScaleoutSignals) + " GIN signals failed: " + reason +
        ". GIN needs an RDMA-capable NIC (InfiniBand or RoCE, NCCL's IB transport, GPUDirect RDMA through "
        "nvidia-peermem or DMA-BUF) on every host, GIN not disabled (NCCL_GIN_ENABLE), and an NCCL build with GIN "
        "support (built against NCCL " +
        std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." + std::to_string(NCCL_PATCH) +
        "); the socket transport has none");
  }
  state_->dev_comm_created = true;

  if (gin_) {
    const ncclDevComm& comm = state_->dev_comm;
    if (comm.ginContextCount < 1) {
      throw std::runtime_error(
          "the 'gin' scale-out transport needs NCCL GPU-initiated networking (GIN), but the device communicator "
          "has no GIN context (GIN disabled or unsupported by this NCCL build, or NCCL_GIN_NCONTEXTS=0)");
    }
    if (comm.ginSignalCount < kMaxScaleoutSignals) {
      throw std::runtime_error("the device communicator has " + std::to_string(comm.ginSignalCount) +
                               " GIN signals, the gin transport needs " + std::to_string(kMaxScaleoutSignals));
    }
    // The proxy backend carries a signal id in 16 bits of its descriptor.
    for (int context = 0; context < comm.ginContextCount; ++context) {
      if (comm.ginTypes[context] == NCCL_NET_DEVICE_GIN_PROXY &&
          int64_t{comm.ginSignalBase} + kMaxScaleoutSignals > (int64_t{1} << 16)) {
        throw std::runtime_error("GIN signals " + std::to_string(comm.ginSignalBase) + ".." +
                                 std::to_string(int64_t{comm.ginSignalBase} + kMaxScaleoutSignals - 1) +
                                 " exceed the 16-bit signal ids of NCCL's GIN proxy backend");
      }
    }
    EP_CUDA_CHECK(cudaMalloc(&state_->dev_comm_device, sizeof(ncclDevComm)));
    EP_CUDA_CHECK(cudaMemcpy(state_->dev_comm_device, &state_->dev_comm, sizeof(ncclDevComm), cudaMemcpyHostToDevice));
  }

  // Peer pointers of the LSA team, indexed by world rank; ranks of other hosts stay nullptr.
  const ncclTeam lsa = ncclTeamLsa(state_->comm);
  std::vector<uint8_t*> lsa_bases(lsa.nRanks, nullptr);
  uint8_t** pointers_device = nullptr;
  EP_CUDA_CHECK(cudaMalloc(&pointers_device, sizeof(uint8_t*) * lsa.nRanks));
  launch_query_lsa_pointers(state_->window, lsa.nRanks, pointers_device, nullptr);
  const cudaError_t copied =
      cudaMemcpy(lsa_bases.data(), pointers_device, sizeof(uint8_t*) * lsa.nRanks, cudaMemcpyDeviceToHost);
  cudaFree(pointers_device);
  EP_CUDA_CHECK(copied);
  peer_bases_.assign(num_ranks_, nullptr);
  for (int lsa_rank = 0; lsa_rank < lsa.nRanks; ++lsa_rank) {
    const int world_rank = ncclTeamRankToWorld(state_->comm, lsa, lsa_rank);
    if (world_rank < 0 || world_rank >= num_ranks_) {
      throw std::runtime_error("LSA rank " + std::to_string(lsa_rank) + " maps to world rank " +
                               std::to_string(world_rank) + " outside [0, " + std::to_string(num_ranks_) + ")");
    }
    peer_bases_[world_rank] = lsa_bases[lsa_rank];
  }
  if (peer_bases_[rank_] == nullptr) throw std::runtime_error("NCCL gave no LSA pointer for this rank's own window");
}

const void* NcclWindowMemory::gin_dev_comm() const { return state_ ? state_->dev_comm_device : nullptr; }

void* NcclWindowMemory::gin_window() const { return state_ && gin_ ? state_->window : nullptr; }

void NcclWindowMemory::release() {
  if (!state_) return;
  // Order from NCCL's 2.28.9 examples: devComm, window, memory, communicator. The device copy of
  // the devComm is ours; kernels using it have finished (the caller quiesced every rank).
  if (state_->dev_comm_device != nullptr) cudaFree(state_->dev_comm_device);
  state_->dev_comm_device = nullptr;
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
