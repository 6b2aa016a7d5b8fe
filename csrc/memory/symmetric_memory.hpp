// Symmetric-memory backends: one window of the same size on every rank, and the base address of
// every load/store peer's window as this GPU sees it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memory/shareable_allocation.hpp"

namespace deep_ep {

enum class BackendKind { kIpc = 0, kNccl = 1 };

// Test hook: with EP_TEST_FAIL_WINDOW_ALLOC=1 in this process's environment, the window allocation
// throws as an out-of-memory would (how the tests make one rank's allocation fail).
void throw_if_window_allocation_fails_by_request(int64_t bytes);

class SymmetricMemory {
 public:
  virtual ~SymmetricMemory() = default;
  virtual uint8_t* local_base() const = 0;
  // Index = rank; valid after the backend's connect step.
  virtual const std::vector<uint8_t*>& peer_bases() const = 0;
  virtual int64_t bytes() const = 0;
  // Releases peer mappings and the allocation; the caller has quiesced every rank first.
  virtual void release() = 0;
};

// Process-to-process sharing on one host, for ranks sharing a GPU and for P2P-capable GPUs. By
// default the window is a ShareableAllocation (peers hold a reference: a dead rank's window stays
// mapped in its peers); where the driver cannot export one (or EP_IPC_MEMORY=legacy), cudaMalloc +
// cudaIpcGetMemHandle, whose memory goes away with its process. Every rank picks the same kind on
// one host; connect() refuses a mix.
class CudaIpcMemory final : public SymmetricMemory {
 public:
  CudaIpcMemory(int rank, int num_ranks, int64_t bytes);
  ~CudaIpcMemory() override;
  std::string handle() const;
  void connect(const std::vector<std::string>& handles);
  uint8_t* local_base() const override { return base_; }
  const std::vector<uint8_t*>& peer_bases() const override { return peer_bases_; }
  int64_t bytes() const override { return bytes_; }
  void release() override;
  bool shares_by_reference() const { return shared_ != nullptr; }

 private:
  int rank_;
  int num_ranks_;
  int64_t bytes_;
  int device_ = 0;
  uint8_t* base_ = nullptr;
  std::unique_ptr<ShareableAllocation> shared_;                 // this rank's window (reference-counted kind)
  std::vector<std::unique_ptr<ShareableAllocation>> imported_;  // peers' windows (same kind)
  std::vector<uint8_t*> peer_bases_;
};

// NCCL: the library's own communicator, ncclMemAlloc + ncclCommWindowRegister, an ncclDevComm
// (its creation proves symmetric support), peer pointers from ncclGetLsaPointer.
//
// With `gin` (the gin scale-out transport: the ranks may span hosts) the devComm also carries
// NCCL's GPU-initiated networking: kMaxScaleoutSignals GIN signals, the contexts NCCL gives, and a
// device copy of the devComm for kernels (gin_dev_comm()). Only then are GIN resources requested:
// asking for GIN signals on a communicator without GIN support breaks the communicator (2.28.9).
// The LSA (load/store) team may then be smaller than the world: peer_bases()[r] is nullptr for
// every rank r outside this rank's LSA team (another host), and kernels must reach those ranks
// only through the scale-out transport (kernels/scaleout.cuh), never through the peer table.
// Without `gin` every rank must be in the LSA team.
class NcclWindowMemory final : public SymmetricMemory {
 public:
  NcclWindowMemory(int rank, int num_ranks, int64_t bytes, bool gin = false);
  ~NcclWindowMemory() override;
  static std::string create_unique_id();
  // Bootstrap steps (see Runtime): communicator (collective), window memory (local), registration,
  // devComm and peer pointers (collective).
  void connect(const std::string& unique_id);
  void allocate();
  void register_window();
  uint8_t* local_base() const override { return peer_bases_.empty() ? nullptr : peer_bases_[rank_]; }
  const std::vector<uint8_t*>& peer_bases() const override { return peer_bases_; }
  int64_t bytes() const override { return bytes_; }
  void release() override;
  // gin only, after register_window() (nullptr otherwise): device address of the ncclDevComm
  // copy, and the window's ncclWindow_t (a device pointer), as DeviceView::scaleout wants them.
  const void* gin_dev_comm() const;
  void* gin_window() const;
  // Ranks of this rank's LSA team (valid after connect()).
  int lsa_size() const { return lsa_size_; }

 private:
  struct State;
  int rank_;
  int num_ranks_;
  int64_t bytes_;
  bool gin_;
  int lsa_size_ = 0;
  std::unique_ptr<State> state_;
  std::vector<uint8_t*> peer_bases_;
};

}  // namespace deep_ep
