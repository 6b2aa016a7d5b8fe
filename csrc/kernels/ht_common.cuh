// Device helpers shared by the HT kernels: warp scans, routing lanes, row copies, bf16 sums.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "common/device_view.hpp"
#include "common/geometry.hpp"
#include "common/ht_call.hpp"
#include "common/require.hpp"
#include "kernels/high_throughput.hpp"
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

// Host check every HT launcher makes on its call description: the shape the kernels rely on, and a
// topology that is the buffer's (the mode follows from it).
inline void check_call(const DeviceView& view, const HtCall& call) {
  EP_REQUIRE(call.topology.num_ranks == view.num_ranks && call.topology.num_scaleup_ranks == view.num_scaleup_ranks,
             "the HT call description was built for another topology (" + std::to_string(call.topology.num_ranks) +
                 " ranks, " + std::to_string(call.topology.num_scaleup_ranks) + " per node) than this buffer's (" +
                 std::to_string(view.num_ranks) + ", " + std::to_string(view.num_scaleup_ranks) + ")");
  EP_REQUIRE(call.num_topk >= 1 && call.num_topk <= kMaxTopK,
             "num_topk must be in [1, " + std::to_string(kMaxTopK) + "], got " + std::to_string(call.num_topk));
  EP_REQUIRE(call.num_experts >= 1 && call.num_experts <= kMaxExperts && call.num_experts % view.num_ranks == 0,
             "num_experts must be a multiple of num_ranks (" + std::to_string(view.num_ranks) + ") in [1, " +
                 std::to_string(kMaxExperts) + "], got " + std::to_string(call.num_experts));
  EP_REQUIRE(
      !call.hybrid() || call.num_nodes() <= kMaxNodes,
      "hybrid mode supports up to " + std::to_string(kMaxNodes) + " nodes, got " + std::to_string(call.num_nodes()));
}

// Hybrid mode needs the handle's hybrid arrays and a channel count the signal ids can hold.
inline void check_hybrid_routing(const HtCall& call, const HybridRouting& routing, int64_t num_tokens) {
  if (!call.hybrid()) return;
  EP_REQUIRE(routing.num_channels >= 1 && routing.num_channels <= kMaxChannels,
             "hybrid mode needs num_channels in [1, " + std::to_string(kMaxChannels) + "], got " +
                 std::to_string(routing.num_channels));
  EP_REQUIRE(routing.node_counts != nullptr && routing.forward_prefix != nullptr && routing.forward_token != nullptr &&
                 routing.forward_topk != nullptr && (num_tokens == 0 || routing.node_slot != nullptr),
             "hybrid mode needs the handle's hybrid routing arrays");
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

// The same for the highest lane of each rank (or node): where DeepEP V2's reference combine leaves
// a rank's partial sum before it adds the K lanes in order, so these lanes fix the combine order.
__device__ __forceinline__ bool is_last_lane_of_rank(int rank) {
  const uint32_t same = __match_any_sync(kFullMask, rank);
  return rank >= 0 && 31 - __clz(same) == lane_id();
}

// Lane p gets `value` of the p-th lane set in `holders` (lanes ascending), `fallback` on lanes
// p >= popc(holders). `holders` must be the same on every lane (a ballot); at most popc(holders)
// shuffles.
template <typename T>
__device__ __forceinline__ T gather_in_lane_order(uint32_t holders, T value, T fallback) {
  const int lane = lane_id();
  T gathered = fallback;
  int position = 0;
  for (uint32_t lanes = holders; lanes != 0; lanes &= lanes - 1, ++position) {
    const T held = __shfl_sync(kFullMask, value, __ffs(lanes) - 1);
    if (lane == position) gathered = held;
  }
  return gathered;
}

// Copies `num_vectors` 16-byte vectors from `src` to the rows held by the lanes set in
// `dst_lanes` (lane k's row is `my_dst`): the source is read once whatever the number of
// destinations. Called by all 32 lanes. Unless `kWrittenByThisLaunch`, `src` must not be written by
// this launch (non-coherent load); otherwise it is read through L2.
template <int kUnroll, bool kWrittenByThisLaunch = false>
__device__ __forceinline__ void warp_copy_to_lanes(const int4* src, int64_t num_vectors, uint32_t dst_lanes,
                                                   int4* my_dst) {
  const int lane = lane_id();
  for (int64_t base = 0; base < num_vectors; base += 32 * kUnroll) {
    int4 values[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t index = base + u * 32 + lane;
      if (index < num_vectors) values[u] = kWrittenByThisLaunch ? __ldcg(src + index) : ptx::ld_nc_v4(src + index);
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

// The whole dispatch row of token `t` to every lane's destination in `dst_lanes`: payload to
// `my_payload`, fp8 scales to `my_scales`, and the K expert ids, K weights, K per-expert slots and
// the source token into the metadata fields of the slot based at `my_meta` (lane k's pointers are
// its destination's). Lane k holds entry k: `expert` (sanitised, so a receiver never sees an id
// outside [-1, E)), `expert_slot`, `weight`. Called by all 32 lanes.
template <int kUnroll>
__device__ __forceinline__ void store_dispatch_row(const HtCall& call, const uint8_t* x, const float* x_scales,
                                                   bool has_weights, int t, int expert, int32_t expert_slot,
                                                   float weight, uint32_t dst_lanes, uint8_t* my_payload,
                                                   float* my_scales, uint8_t* my_meta) {
  const TokenLayout& token = call.dispatch_token();
  const int64_t row_bytes = call.row_bytes();
  const int num_scales = call.num_scales();
  const int lane = lane_id();
  warp_copy_to_lanes<kUnroll>(reinterpret_cast<const int4*>(x + t * row_bytes), row_bytes / kVectorBytes, dst_lanes,
                              reinterpret_cast<int4*>(my_payload));
  if (num_scales > 0) warp_copy_words_to_lanes(x_scales + int64_t{t} * num_scales, num_scales, dst_lanes, my_scales);
  for (uint32_t lanes = dst_lanes; lanes != 0; lanes &= lanes - 1) {
    const int owner = __ffs(lanes) - 1;
    auto* dst =
        reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(my_meta), owner));
    if (lane < call.num_topk) {
      reinterpret_cast<int32_t*>(dst + token.topk_idx_offset)[lane] = expert;
      reinterpret_cast<int32_t*>(dst + token.expert_slot_offset)[lane] = expert_slot;
      if (has_weights) reinterpret_cast<float*>(dst + token.weights_offset)[lane] = weight;
    }
    if (lane == 0) *reinterpret_cast<int32_t*>(dst + token.src_offset) = t;
  }
}

// The same into whole dispatch slots (payload, scales and metadata at their slot offsets).
template <int kUnroll>
__device__ __forceinline__ void store_dispatch_slot(const HtCall& call, const uint8_t* x, const float* x_scales,
                                                    bool has_weights, int t, int expert, int32_t expert_slot,
                                                    float weight, uint32_t dst_lanes, uint8_t* my_slot) {
  float* my_scales =
      my_slot == nullptr ? nullptr : reinterpret_cast<float*>(my_slot + call.dispatch_token().scale_offset);
  store_dispatch_row<kUnroll>(call, x, x_scales, has_weights, t, expert, expert_slot, weight, dst_lanes, my_slot,
                              my_scales, my_slot);
}

// Lane k holds the rank of its entry; `first_lanes` marks one lane of each of the token's distinct
// ranks (its first or its last lane) and is the same on every lane (a ballot): the number of the
// token's distinct ranks in [low, high). `low` and `high` may differ between lanes (each lane gets
// its own count). One shuffle per distinct rank.
__device__ __forceinline__ int distinct_ranks_in(int rank, uint32_t first_lanes, int low, int high) {
  int count = 0;
  for (uint32_t lanes = first_lanes; lanes != 0; lanes &= lanes - 1) {
    const int other_rank = __shfl_sync(kFullMask, rank, __ffs(lanes) - 1);
    if (other_rank >= low && other_rank < high) ++count;
  }
  return count;
}

// The same when `low` and `high` are the same on every lane: one ballot.
__device__ __forceinline__ int distinct_ranks_in_uniform(int rank, uint32_t first_lanes, int low, int high) {
  const bool counted = ((first_lanes >> lane_id()) & 1u) != 0 && rank >= low && rank < high;
  return __popc(__ballot_sync(kFullMask, counted));
}

// The terms of a token's combine sum in DeepEP V2's order. Lane k holds `owner`, the rank (or node)
// whose term covers its top-k entry (-1: none). The terms sit in rows by owner, ascending (row j:
// the owner with j of the token's owners below it, where the senders put it), but V2's reference
// combine leaves each owner's partial on the owner's last lane and then adds the K lanes in lane
// order: the terms go in ascending order of their owners' last lanes. For [r1, r0, r1] (lanes 0-2)
// the rows are r0 -> 0, r1 -> 1, and the order is r0 (last lane 1), then r1 (last lane 2).
struct TermRows {
  int num_terms;  // distinct owners of the token
  int own_row;    // the row of this lane's owner (meaningless where owner < 0)
  int row;        // lane p: the row of the p-th term in V2's order; 0 for p >= num_terms
};

__device__ __forceinline__ TermRows term_rows_in_v2_order(int owner) {
  const uint32_t last_lanes = __ballot_sync(kFullMask, is_last_lane_of_rank(owner));
  TermRows rows;
  rows.num_terms = __popc(last_lanes);
  rows.own_row = distinct_ranks_in(owner, last_lanes, 0, owner);
  // The i-th last lane in lane order is the i-th term: gather the rows of those lanes.
  rows.row = gather_in_lane_order(last_lanes, rows.own_row, 0);
  return rows;
}

// Combined weight of top-k slot `lane_id()` (< K) of a token whose terms sit in rows `stride` bytes
// apart from `rows` (row j: the owner with j of the token's owners below it), each with its K
// weights at `weights_offset`. Owner rule (DeepEP V2): the slot as the row of the lane's own owner
// sent it, 0 where the lane has none. Sum rule (`sum`, DeepEP V1): the slot of every row, owners
// ascending, added in fp32 from +0.0 as V1's combine does. `load`: as in accumulate_rows.
template <typename Load>
__device__ __forceinline__ float combined_slot_weight(const uint8_t* rows, int64_t stride, int64_t weights_offset,
                                                      const TermRows& terms, bool has_owner, bool sum,
                                                      const Load& load) {
  const auto slot_of = [&](int row) {
    return reinterpret_cast<const float*>(rows + row * stride + weights_offset) + lane_id();
  };
  if (!sum) return has_owner ? load(slot_of(terms.own_row)) : 0.0f;
  float weight = 0.0f;
  for (int row = 0; row < terms.num_terms; ++row) weight = __fadd_rn(weight, load(slot_of(row)));
  return weight;
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

// acc[u] += terms [0, num_terms) at vector `base + u * 32 + lane` (term j's row: row_of(j), called
// by every lane for every j, so it may shuffle), term 0 first: the fixed order is what makes the
// sum bitwise reproducible, and the callers number the terms in DeepEP V2's order. The loads of up
// to kSumTermsInFlight terms are issued before any is added, so a warp keeps that many rows' loads
// in flight instead of one (the sums are bound by load latency, not bandwidth). `load` is the load the caller's
// coherence needs (__ldcg for rows peers wrote in this kernel or a peer's window, ld.nc for rows of an earlier kernel).
constexpr int kSumTermsInFlight = 4;

template <int kUnroll, typename RowOf, typename Load>
__device__ __forceinline__ void accumulate_rows(float (&acc)[kUnroll][kBf16PerVector], const RowOf& row_of,
                                                int num_terms, int64_t base, int64_t num_vectors, const Load& load) {
  const int lane = lane_id();
  for (int first = 0; first < num_terms; first += kSumTermsInFlight) {
    int4 vectors[kSumTermsInFlight][kUnroll];
#pragma unroll
    for (int t = 0; t < kSumTermsInFlight; ++t) {
      const int4* row = row_of(first + t);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t index = base + u * 32 + lane;
        if (first + t < num_terms && index < num_vectors) vectors[t][u] = load(row + index);
      }
    }
#pragma unroll
    for (int t = 0; t < kSumTermsInFlight; ++t) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t index = base + u * 32 + lane;
        if (first + t < num_terms && index < num_vectors) accumulate_bf16x8(acc[u], vectors[t][u]);
      }
    }
  }
}

// One warp, one token: out = bf16(bias0 + bias1 + term 0 + ... + term num_terms-1), summed in fp32 in
// that order and rounded once, kUnroll vectors per lane at a time (every combine sum: the reduce,
// the zero-copy pull, the hybrid forwarder's node partial, the expand sender's rank partial). A null
// bias is skipped; the biases and `out` point at the token's row; terms as in accumulate_rows.
// DeepEP V2's reference starts from bias0 + bias1 instead of +0.0 and also adds its zero lanes: no
// bit differs, since a +0.0 start or addend can only change the sign of a zero sum, and neither
// form ends in -0.0 (ours starts at +0.0; each of V2's K >= 1 lanes is a sum started at +0.0, or
// +0.0, so its first lane already clears a -0.0 bias sum).
//
// kPrefetchChunks > 0: lane j < num_terms keeps term j's next kPrefetchChunks chunks (32 * kUnroll
// vectors each) on their way into L2 by bulk prefetches, so that a warp's loads find them there:
// more bytes in flight than its registers hold. The terms must be complete before the call (the
// rows of an earlier kernel or of peers past a barrier).
template <int kUnroll, int kPrefetchChunks = 0, typename RowOf, typename Load>
__device__ __forceinline__ void sum_row_to_bf16(int4* out, const int4* bias0, const int4* bias1, int num_terms,
                                                int64_t num_vectors, const RowOf& row_of, const Load& load) {
  const int lane = lane_id();
  constexpr int64_t kChunk = 32 * kUnroll;
  const int4* my_term = nullptr;
  if constexpr (kPrefetchChunks > 0) my_term = row_of(lane);  // every lane calls: row_of may shuffle
  const auto prefetch = [&](int64_t chunk_base) {
    if (lane < num_terms && chunk_base < num_vectors) {
      const int64_t count = num_vectors - chunk_base < kChunk ? num_vectors - chunk_base : kChunk;
      ptx::prefetch_l2_bulk(my_term + chunk_base, static_cast<uint32_t>(count * kVectorBytes));
    }
  };
  if constexpr (kPrefetchChunks > 0) {
#pragma unroll
    for (int c = 1; c < kPrefetchChunks; ++c) prefetch(c * kChunk);
  }
  for (int64_t base = 0; base < num_vectors; base += kChunk) {
    if constexpr (kPrefetchChunks > 0) prefetch(base + kPrefetchChunks * kChunk);
    float acc[kUnroll][kBf16PerVector];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t index = base + u * 32 + lane;
#pragma unroll
      for (int e = 0; e < kBf16PerVector; ++e) acc[u][e] = 0.0f;
      if (index >= num_vectors) continue;
      if (bias0 != nullptr) accumulate_bf16x8(acc[u], ptx::ld_nc_v4(bias0 + index));
      if (bias1 != nullptr) accumulate_bf16x8(acc[u], ptx::ld_nc_v4(bias1 + index));
    }
    accumulate_rows(acc, row_of, num_terms, base, num_vectors, load);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t index = base + u * 32 + lane;
      if (index < num_vectors) out[index] = round_to_bf16x8(acc[u]);
    }
  }
}

}  // namespace deep_ep::ht
