// Device helpers shared by the HT kernels: warp scans, routing lanes, row copies, bf16 sums.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "common/geometry.hpp"
#include "common/require.hpp"
#include "kernels/ptx.cuh"

namespace deep_ep::ht {

constexpr uint32_t kFullMask = 0xffffffffu;
constexpr int kVectorBytes = 16;
constexpr int kBf16PerVector = kVectorBytes / 2;

// Host check shared by the combine and reduce launchers: rows move as 16-byte bf16 vectors.
inline void check_combine_shape(int num_topk, int hidden) {
  EP_REQUIRE(num_topk >= 1 && num_topk <= kMaxTopK,
             "num_topk must be in [1, " + std::to_string(kMaxTopK) + "], got " + std::to_string(num_topk));
  EP_REQUIRE(hidden % kBf16PerVector == 0,
             "hidden must be a multiple of 8 (16-byte bf16 vectors), got " + std::to_string(hidden));
}

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x % 32); }

__device__ __forceinline__ int warp_inclusive_sum(int value) {
  const int lane = lane_id();
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int other = __shfl_up_sync(kFullMask, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
}

// Entry `index` of a handle's routing copy. The notify kernel wrote that copy through
// routed_expert(), so bad and repeated ids are -1 there already; only the range check remains, so
// that a stray value can never address outside the window.
__device__ __forceinline__ int handle_expert(const int64_t* topk_idx_copy, int64_t index, int num_experts) {
  const int64_t expert = topk_idx_copy[index];
  return (expert >= 0 && expert < num_experts) ? static_cast<int>(expert) : -1;
}

// Lane k holds the rank of its top-k entry (-1: none). True on the lowest lane of each rank: the
// entry that owns the token's single copy to (or from) that rank.
__device__ __forceinline__ bool is_first_lane_of_rank(int rank) {
  const uint32_t same = __match_any_sync(kFullMask, rank);
  return rank >= 0 && __ffs(same) - 1 == lane_id();
}

// Lane k holds the rank of its entry and whether it is the first lane of that rank. Returns, on
// every lane, the number of distinct ranks of the token below `rank` (the index of `rank` in the
// token's ascending list of distinct destination ranks).
__device__ __forceinline__ int distinct_ranks_below(int rank, uint32_t first_lanes, int bound) {
  int below = 0;
  for (int other = 0; other < 32; ++other) {
    const int other_rank = __shfl_sync(kFullMask, rank, other);
    if (((first_lanes >> other) & 1u) != 0 && other_rank < bound) ++below;
  }
  return below;
}

// Copies `num_vectors` 16-byte vectors from `src` to the rows held by the lanes set in
// `dst_lanes` (lane k's row is `my_dst`): the source is read once whatever the number of
// destinations. Called by all 32 lanes. `src` must not be written by this launch (non-coherent load).
template <int kUnroll>
__device__ __forceinline__ void warp_copy_to_lanes(const int4* src, int64_t num_vectors, uint32_t dst_lanes,
                                                   int4* my_dst) {
  const int lane = lane_id();
  for (int64_t base = 0; base < num_vectors; base += 32 * kUnroll) {
    int4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t index = base + u * 32 + lane;
      if (index < num_vectors) values[u] = ptx::ld_nc_v4(src + index);
    }
    for (uint32_t lanes = dst_lanes; lanes != 0; lanes &= lanes - 1) {
      const int owner = __ffs(lanes) - 1;
      int4* dst = reinterpret_cast<int4*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), owner));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t index = base + u * 32 + lane;
        if (index < num_vectors) dst[index] = values[u];
      }
    }
  }
}

// Same for 4-byte elements (fp8 scales: a row of H/128 floats need not be 16-byte aligned).
__device__ __forceinline__ void warp_copy_words_to_lanes(const float* src, int num_words, uint32_t dst_lanes,
                                                         float* my_dst) {
  const int lane = lane_id();
  for (int base = 0; base < num_words; base += 32) {
    const int index = base + lane;
    const float value = index < num_words ? __ldg(src + index) : 0.0f;
    for (uint32_t lanes = dst_lanes; lanes != 0; lanes &= lanes - 1) {
      const int owner = __ffs(lanes) - 1;
      float* dst =
          reinterpret_cast<float*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_dst), owner));
      if (index < num_words) dst[index] = value;
    }
  }
}

// acc += 8 bf16 values, each addition a single fp32 rounding (no contraction, no reassociation).
__device__ __forceinline__ void accumulate_bf16x8(float (&acc)[kBf16PerVector], const int4& vector) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&vector);
#pragma unroll
  for (int p = 0; p < kBf16PerVector / 2; ++p) {
    const float2 values = __bfloat1622float2(pairs[p]);
    acc[2 * p] = __fadd_rn(acc[2 * p], values.x);
    acc[2 * p + 1] = __fadd_rn(acc[2 * p + 1], values.y);
  }
}

// Round to nearest even, once.
__device__ __forceinline__ int4 round_to_bf16x8(const float (&acc)[kBf16PerVector]) {
  int4 vector;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&vector);
#pragma unroll
  for (int p = 0; p < kBf16PerVector / 2; ++p) pairs[p] = __floats2bfloat162_rn(acc[2 * p], acc[2 * p + 1]);
  return vector;
}

}  // namespace deep_ep::ht
