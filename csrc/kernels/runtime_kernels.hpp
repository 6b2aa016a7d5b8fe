// Launchers of the runtime's own kernels (barrier, NCCL peer-pointer query).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <nccl_device.h>

#include <cstdint>

#include "common/device_view.hpp"

namespace deep_ep {

// One CTA: every rank releases its epoch to every peer and waits for theirs.
void launch_rank_barrier(const DeviceView& view, cudaStream_t stream);

// Writes ncclGetLsaPointer(window, 0, i) for i < lsa_size into out_device[i].
void launch_query_lsa_pointers(ncclWindow_t window, int lsa_size, uint8_t** out_device, cudaStream_t stream);

}  // namespace deep_ep
