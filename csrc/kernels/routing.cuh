// Routing helpers shared by the HT and LL kernels: deterministic, atomic-free slot assignment.
//
// A slot is the ordinal of a token among the tokens that match a predicate (go to rank d, select
// expert e), counted in token order. One warp walks the tokens 32 at a time; a ballot gives each
// matching lane the number of earlier matches. Receive order is therefore (source, token) by
// construction, with no sort and no atomic.
#pragma once

#include <cstdint>

#include "common/device_view.hpp"
#include "kernels/timeout.cuh"

namespace deep_ep {

// Called by all 32 lanes of a warp. `match(token)` -> bool; `emit(token, ordinal)` runs on the
// matching lane. Returns the number of matches (same value in every lane).
template <typename Match, typename Emit>
__device__ __forceinline__ int warp_enumerate_in_token_order(int num_tokens, Match&& match, Emit&& emit) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int num_matches = 0;
  for (int chunk = 0; chunk < num_tokens; chunk += 32) {
    const int token = chunk + lane;
    const bool hit = token < num_tokens && match(token);
    const uint32_t hits = __ballot_sync(0xffffffffu, hit);
    if (hit) emit(token, num_matches + __popc(hits & ((1u << lane) - 1u)));
    num_matches += __popc(hits);
  }
  return num_matches;
}

// The expert of entry k of a token's top-k row as every kernel uses it: the id, or -1 when it is
// -1, outside [-1, num_experts), or a repeat of an id at an earlier slot of the same row (the first
// occurrence counts; DeepEP's kernels would send the token twice and add the row twice).
__device__ __forceinline__ int routed_expert(const int64_t* topk_idx, int num_topk, int64_t token, int k,
                                             int num_experts, bool* is_duplicate = nullptr) {
  const int64_t* row = topk_idx + token * num_topk;
  const int64_t expert = row[k];
  if (expert < 0 || expert >= num_experts) return -1;
  for (int earlier = 0; earlier < k; ++earlier) {
    if (row[earlier] == expert) {
      if (is_duplicate != nullptr) *is_duplicate = true;
      return -1;
    }
  }
  return static_cast<int>(expert);
}

// routed_expert(), recording a bad entry for the host (reported as ValueError; the protocol still
// completes with the entry treated as -1). Kernels that read a row first call this one.
__device__ __forceinline__ int read_expert_id(const DeviceView& view, Operation operation, const int64_t* topk_idx,
                                              int num_topk, int token, int k, int num_experts) {
  const int64_t expert = topk_idx[static_cast<int64_t>(token) * num_topk + k];
  if (expert < -1 || expert >= num_experts) {
    record_invalid_expert(view, operation, InvalidExpertKind::kOutOfRange, expert, num_experts, token);
    return -1;
  }
  bool is_duplicate = false;
  const int routed = routed_expert(topk_idx, num_topk, token, k, num_experts, &is_duplicate);
  if (is_duplicate) record_invalid_expert(view, operation, InvalidExpertKind::kDuplicate, expert, num_experts, token);
  return routed;
}

}  // namespace deep_ep
