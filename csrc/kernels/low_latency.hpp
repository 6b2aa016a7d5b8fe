// Low-latency (decode) dispatch and combine: argument structs, launchers and the handshake both
// kernel families share.
//
// Each LL operation (dispatch or combine) is a send phase and a receive phase, two kernels, so the
// receive can be deferred to a hook. An operation uses one parity area of the LL region (its
// receive side), given as `area_offset` = ll_offset + parity * parity_bytes in every window.
//
// Protocol (docs/low_latency.md has the full argument):
//   * counts cells [L][R] of the area are arrival cells: (local expert l, source s) publishes
//     n + 1 there with a system-scope release after its rows ("0 = not arrived"). Dispatch: the n
//     tokens of s that selected expert l of the receiver. Combine: the n rows the receiver's
//     tokens get back from local expert l of s. The receive kernel resets every cell to 0.
//   * flags cells [R] of the area are ready epochs, never reset: ready[me] in my own window counts
//     the operations whose receive phase ran on this parity (bumped by the receive kernel);
//     ready[d] in my window is the epoch at which rank d last freed its area of this parity. A send
//     phase of epoch e = ready[me] + 1 first tells every peer "my area is free for epoch e", then
//     waits until every peer said the same before writing into that peer's area. A peer's area is
//     free once its next operation on the parity has started: everything it received before
//     (including zero-copy recv_x views) has been consumed by then.
//   * a rank whose input failed its host checks sends with no data and `input_failed`: it sets its
//     input-failed cell in every peer before the ready release; the peers record it (not fatal).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_view.hpp"
#include "common/error_record.hpp"
#include "common/geometry.hpp"

#if defined(__CUDACC__)
#include "kernels/barrier.cuh"
#include "kernels/ptx.cuh"
#include "kernels/timeout.cuh"
#endif

namespace deep_ep {

// Workspace scratch ints used by the LL combine receive kernel: [parity] CTA arrival counter (back
// to 0 when the kernel ends). The last two scratch ints, away from other kernels' scratch; one per
// parity so that two outstanding combines received on different streams never share a counter.
constexpr int kLowLatencyScratchIndex = WorkspaceLayout::kNumScratchInts - 2;

// Layout of the fp8 scales the dispatch receive phase writes into its output (compact rows).
enum class LowLatencyScales : int {
  kFp32RowMajor = 0,   // fp32 [L][R * T_ll][G]
  kFp32ColMajor = 1,   // fp32 [L][G][R * T_ll] (DeepEP V1's TMA-friendly layout)
  kUe8m0RowMajor = 2,  // int32 [L][R * T_ll][G / 4]: exponent bytes of 4 groups, the first lowest
  kUe8m0ColMajor = 3,  // int32 [L][G / 4][R * T_ll]
};

constexpr int kLowLatencySendThreads = 512;
constexpr int kLowLatencyRecvThreads = 512;

struct LowLatencyDispatchArgs {
  DeviceView view;
  LowLatencyLayout layout;
  int64_t area_offset = 0;  // window offset of this operation's parity area
  int num_experts = 0;
  int hidden = 0;
  int num_tokens = 0;  // T <= layout.num_max_tokens
  int num_topk = 0;    // K <= layout.num_topk
  bool use_fp8 = true;
  const void* x = nullptr;              // bf16 [T, hidden], contiguous
  const int64_t* topk_idx = nullptr;    // [T, K], contiguous
  int32_t* recv_count = nullptr;        // out: [L] tokens received per local expert
  int32_t* count_per_source = nullptr;  // out: [L, R] tokens received per (local expert, source)
  int num_sms = 1;                      // CTAs per kernel (<= the rank's SM cap)
  bool input_failed = false;            // this rank sends nothing and tells its peers why
  bool round_scale = false;             // fp8: power-of-two scales (kernels/fp8.cuh)
  // Receive phase outputs besides the counts. recv_x == nullptr: rows stay in the window in
  // per-source blocks (zero-copy); otherwise expert l's rows are copied to recv_x[l] packed in
  // [0, recv_count[l]) ordered by (source, source token), with their scales in `scales_format`.
  void* recv_x = nullptr;                         // [L, R * T_ll, H] fp8 or bf16
  void* recv_scales = nullptr;                    // fp8 only
  LowLatencyScales scales_format = LowLatencyScales::kFp32RowMajor;
  int32_t* recv_src_info = nullptr;               // [L, R * T_ll] source token of each row (output layout)
  int64_t* recv_layout_range = nullptr;           // [L, R] (first row << 32) | count, output layout
  int32_t* cumulative_recv_stats = nullptr;       // [L] += recv_count
  int64_t* wait_cost_stats = nullptr;             // [R] += clock64 cycles waited for each source
};

struct LowLatencyCombineArgs {
  DeviceView view;
  LowLatencyLayout layout;
  int64_t dispatch_area_offset = 0;  // parity area of the dispatch this combine answers (headers)
  int64_t area_offset = 0;           // this operation's parity area (combine payload, arrival cells)
  int parity = 0;                    // of area_offset: picks the receive kernel's scratch counter
  int num_experts = 0;
  int hidden = 0;
  int num_tokens = 0;                         // T of the dispatch
  int num_topk = 0;                           // K of the dispatch
  const void* x = nullptr;                    // bf16 [L, R * T_ll, hidden], contiguous: expert outputs
  const int32_t* count_per_source = nullptr;  // [L, R] from the dispatch receive
  const int64_t* topk_idx = nullptr;          // [T, K]
  const float* topk_weights = nullptr;        // [T, K]
  void* out = nullptr;                        // bf16 [T, hidden], contiguous
  int num_sms = 1;
  bool input_failed = false;  // this rank sends no row (count_per_source may be null) and tells its peers
  // The dispatch's layout range [L, R] when its rows were compacted (x rows of (l, s) start at
  // l * R * T_ll + range >> 32); nullptr: per-source blocks (rows of (l, s) at (l * R + s) * T_ll).
  const int64_t* layout_range = nullptr;
  int64_t* wait_cost_stats = nullptr;  // [R] += clock64 cycles the receive phase waited per source
};

// Throw std::invalid_argument for shapes the kernels cannot take, std::runtime_error for a failed
// launch. Send and receive of one operation must run in this order on streams ordered the same way.
void launch_low_latency_dispatch_send(const LowLatencyDispatchArgs& args, cudaStream_t stream);
void launch_low_latency_dispatch_recv(const LowLatencyDispatchArgs& args, cudaStream_t stream);
void launch_low_latency_combine_send(const LowLatencyCombineArgs& args, cudaStream_t stream);
void launch_low_latency_combine_recv(const LowLatencyCombineArgs& args, cudaStream_t stream);

// Host checks both LL operations share: the call must match what the buffer's LL region was
// sized for. Throws std::invalid_argument naming the argument, the value and the rule.
void check_low_latency_call(const LowLatencyLayout& layout, int num_ranks, int num_experts, int num_tokens,
                            int num_topk);

#if defined(__CUDACC__)
namespace low_latency {

__device__ __forceinline__ int32_t* arrival_cell(const DeviceView& view, int rank, const LowLatencyLayout& layout,
                                                 int64_t area_offset, int local_expert, int source) {
  const int64_t cell = int64_t{local_expert} * view.num_ranks + source;
  return view.peer<int32_t>(rank, area_offset + layout.dispatch_counts_offset + cell * 4);
}

__device__ __forceinline__ int32_t* ready_cell(const DeviceView& view, int rank, const LowLatencyLayout& layout,
                                               int64_t area_offset, int about_rank) {
  return view.peer<int32_t>(rank, area_offset + layout.combine_flags_offset + int64_t{about_rank} * 4);
}

// Epoch of the operation being sent: one more than the operations whose receive phase already ran
// on this parity. Only receive kernels write ready[me] in my window, and they are stream-ordered
// around send kernels, so every CTA of a send kernel reads the same value.
__device__ __forceinline__ int32_t send_epoch(const DeviceView& view, const LowLatencyLayout& layout,
                                              int64_t area_offset) {
  return ptx::ld_relaxed_sys(ready_cell(view, view.rank, layout, area_offset, view.rank)) + 1;
}

// Called by every thread of every CTA of a send kernel, before the CTA writes into any peer's area.
// CTA 0 announces that this rank's area is free for `epoch`; each CTA then waits until every peer
// announced the same. Returns false on timeout (the CTA must leave without writing).
__device__ __forceinline__ bool exchange_ready(const DeviceView& view, const LowLatencyLayout& layout,
                                               int64_t area_offset, int32_t epoch, Operation operation,
                                               bool input_failed) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  if (blockIdx.x == 0) {
    if (input_failed) {
      announce_input_failed(view);
      __syncthreads();  // the announcements precede every thread's release below
    }
    for (int peer = threadIdx.x; peer < view.num_ranks; peer += blockDim.x) {
      // Release: everything this rank did before this kernel (its use of the area) happens-before
      // the peer's writes into it.
      if (peer != view.rank) ptx::st_release_sys(ready_cell(view, peer, layout, area_offset, view.rank), epoch);
    }
  }
  __syncthreads();
  for (int peer = threadIdx.x; peer < view.num_ranks; peer += blockDim.x) {
    if (peer == view.rank) continue;  // my own area is free by stream order
    const int32_t* cell = ready_cell(view, view.rank, layout, area_offset, peer);
    const bool ok = wait_until(view, operation, Phase::kBarrierArrive, peer, epoch, [&](int64_t& seen) {
      seen = ptx::ld_acquire_sys(cell);
      return seen >= epoch;
    });
    if (!ok) {
      atomicExch(&failed, 1);
    } else if (blockIdx.x == 0) {
      collect_input_failed(view, operation, peer);
    }
  }
  __syncthreads();
  return failed == 0;
}

// The receive kernel's last act on the parity: one more operation has been received here.
__device__ __forceinline__ void bump_epoch(const DeviceView& view, const LowLatencyLayout& layout,
                                           int64_t area_offset) {
  int32_t* cell = ready_cell(view, view.rank, layout, area_offset, view.rank);
  ptx::st_relaxed_sys(cell, ptx::ld_relaxed_sys(cell) + 1);
}

// Copies one row of `num_vectors` 16-byte vectors with one warp, `kUnroll` vectors per lane in
// flight: all loads of a batch are issued before its stores.
template <int kUnroll>
__device__ __forceinline__ void warp_copy_row(int4* dst, const int4* src, int num_vectors, int lane) {
  for (int base = lane; base < num_vectors; base += 32 * kUnroll) {
    int4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 32 < num_vectors) values[u] = ptx::ld_nc_v4(src + base + u * 32);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 32 < num_vectors) ptx::st_na_v4(dst + base + u * 32, values[u]);
    }
  }
}

}  // namespace low_latency
#endif

}  // namespace deep_ep
