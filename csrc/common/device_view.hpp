// What every communication kernel receives by value: who we are, where every load/store peer's
// window starts, where to report errors and how long a wait may last.
#pragma once

#include <cstdint>
#include <string>

#include "common/error_record.hpp"
#include "common/geometry.hpp"
#include "common/require.hpp"

namespace deep_ep {

// Host-mapped int32 cells the kernels write for the host (received counts for the CPU sync).
constexpr int kNumMappedCounters = kMaxRanks + kMaxExperts + 64;

// How this rank reaches ranks of other nodes in hybrid mode (kernels/scaleout.cuh).
enum class ScaleoutKind : int32_t {
  kLsa = 0,          // stores through the peer table, release-add on the peer's signal cell
  kLsaDeferred = 1,  // tests: a put's bytes land only at a covering signal or flush (RDMA-like ordering)
  kGin = 2,          // NCCL GPU-initiated networking (ranks on other hosts)
};

struct ScaleoutView {
  ScaleoutKind kind = ScaleoutKind::kLsa;
  const void* gin_dev_comm = nullptr;  // gin: device copy of the ncclDevComm
  void* gin_window = nullptr;          // gin: the window's ncclWindow_t
};

struct DeviceView {
  int32_t rank = 0;
  int32_t num_ranks = 1;
  int32_t num_scaleup_ranks = 1;
  int32_t max_num_sms = 1;     // the rank's CTA cap (RuntimeConfig::max_num_sms); launchers check it
  int32_t max_ht_num_sms = 1;  // the HT dispatch / combine CTA cap (RuntimeConfig::max_ht_num_sms)
  // LL: peers outside this rank's group of this many ranks (another node) are reached through the
  // scale-out transport; 0: every peer by load/store.
  int32_t ll_ranks_per_node = 0;
  int32_t call_serial = 0;               // the host's serial of the call launching with this view (error reports)
  uint8_t* const* peer_bases = nullptr;  // device array [num_ranks]: window base of rank p as this GPU sees it
  ErrorRecord* error = nullptr;          // host-mapped, device pointer
  uint64_t timeout_ns = 0;               // deadline of every device spin-wait
  ScaleoutView scaleout;                 // hybrid mode's transport to other nodes
  uint64_t* phase_clock = nullptr;       // device phase stamps (common/phase_clock.hpp); null: off

#if defined(__CUDACC__)
  // Byte `offset` of this rank's window.
  template <typename T>
  __device__ __forceinline__ T* local(int64_t offset) const {
    return reinterpret_cast<T*>(peer_bases[rank] + offset);
  }
  // Byte `offset` of rank `peer`'s window: the only way kernels form a peer address.
  template <typename T>
  __device__ __forceinline__ T* peer(int32_t peer_rank, int64_t offset) const {
    return reinterpret_cast<T*>(peer_bases[peer_rank] + offset);
  }
#endif
};

// Dynamic shared memory a launch gets without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
constexpr int64_t kDefaultDynamicSharedBytes = 48 * 1024;

// The check every launcher makes on its grid size: at least one CTA, and no more than the rank's cap
// (a grid larger than what stays resident would deadlock in its grid syncs and cross-rank spins).
inline void check_grid_size(const DeviceView& view, const char* name, int num_ctas) {
  EP_REQUIRE(num_ctas >= 1 && num_ctas <= view.max_num_sms,
             std::string(name) + " must be in [1, " + std::to_string(view.max_num_sms) +
                 "] (this rank's SM cap: device SMs divided by the ranks sharing the GPU), got " +
                 std::to_string(num_ctas));
}

// The check of the HT kernels that synchronise their grid with the peers' kernels spinning
// (notify, dispatch, combine): the rank's HT cap, which leaves room for compute on a shared GPU.
inline void check_ht_grid_size(const DeviceView& view, const char* name, int num_ctas) {
  EP_REQUIRE(num_ctas >= 1 && num_ctas <= view.max_ht_num_sms,
             std::string(name) + " must be in [1, " + std::to_string(view.max_ht_num_sms) +
                 "] (this rank's SM cap for HT kernels: every SM with one rank per GPU, half of the rank's share "
                 "when ranks share a GPU), got " +
                 std::to_string(num_ctas));
}

}  // namespace deep_ep
