#include "common/cuda_check.hpp"
#include "kernels/preload.hpp"
#include "kernels/runtime_kernels.hpp"
#include "kernels/topology_barrier.cuh"

namespace deep_ep {
namespace {

constexpr int kBarrierThreads = 128;

// The buffer's barrier (ElasticBuffer.barrier, destroy): across nodes through the scale-out
// transport, so it also serves ranks on other hosts.
__global__ void __launch_bounds__(kBarrierThreads, 1) rank_barrier_kernel(DeviceView view) {
  topology_barrier(view, Operation::kBarrier);
}

__global__ void query_lsa_pointers_kernel(ncclWindow_t window, int lsa_size, uint8_t** out) {
  for (int peer = threadIdx.x; peer < lsa_size; peer += blockDim.x) {
    out[peer] = static_cast<uint8_t*>(ncclGetLsaPointer(window, 0, peer));
  }
}

}  // namespace

void launch_rank_barrier(const DeviceView& view, cudaStream_t stream) {
  rank_barrier_kernel<<<1, kBarrierThreads, 0, stream>>>(view);
  EP_CHECK_LAUNCH("rank_barrier_kernel");
}

void launch_query_lsa_pointers(ncclWindow_t window, int lsa_size, uint8_t** out_device, cudaStream_t stream) {
  query_lsa_pointers_kernel<<<1, 128, 0, stream>>>(window, lsa_size, out_device);
  EP_CHECK_LAUNCH("query_lsa_pointers_kernel");
}

void preload_runtime_kernels() {
  preload_kernel(rank_barrier_kernel, "rank barrier");
  preload_kernel(query_lsa_pointers_kernel, "lsa pointer query");
}

void preload_kernels() {
  ht::preload_ht_notify_kernels();
  ht::preload_ht_dispatch_kernels();
  ht::preload_ht_dispatch_hybrid_kernels();
  ht::preload_ht_dispatch_epilogue_kernels();
  ht::preload_ht_combine_kernels();
  ht::preload_ht_combine_reduce_kernels();
  ht::preload_ht_combine_pull_kernels();
  preload_low_latency_dispatch_kernels();
  preload_low_latency_combine_kernels();
  preload_runtime_kernels();
}

}  // namespace deep_ep
