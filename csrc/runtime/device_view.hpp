// What every communication kernel receives by value: who we are, where every load/store peer's
// window starts, where to report errors and how long a wait may last.
#pragma once

#include <cstdint>

#include "runtime/error_record.hpp"
#include "runtime/geometry.hpp"

namespace deep_ep {

struct DeviceView {
  int32_t rank = 0;
  int32_t num_ranks = 1;
  int32_t num_scaleup_ranks = 1;
  int32_t reserved = 0;
  uint8_t* const* peer_bases = nullptr;  // device array [num_ranks]: window base of rank p as this GPU sees it
  ErrorRecord* error = nullptr;          // host-mapped, device pointer
  uint64_t timeout_ns = 0;               // deadline of every device spin-wait

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

}  // namespace deep_ep
