// Routing helpers shared by the HT and LL kernels: deterministic, atomic-free slot assignment.
//
// A slot is the ordinal of a token among the tokens that match a predicate (go to rank d, select
// expert e), counted in token order. One warp walks the tokens 32 at a time; a ballot gives each
// matching lane the number of earlier matches. Receive order is therefore (source, token) by
// construction, with no sort and no atomic.
#pragma once

#include <cstdint>

#include "kernels/timeout.cuh"
#include "runtime/device_view.hpp"

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

// Reads topk_idx[token][k] (int64 from PyTorch). An id outside [-1, num_experts) is recorded for
// the host (reported as ValueError) and treated as -1, so the protocol still completes.
__device__ __forceinline__ int read_expert_id(const DeviceView& view, Operation operation, const int64_t* topk_idx,
                                              int num_topk, int token, int k, int num_experts) {
  const int64_t expert = topk_idx[static_cast<int64_t>(token) * num_topk + k];
  if (expert < -1 || expert >= num_experts) {
    record_invalid_expert(view, operation, expert, num_experts);
    return -1;
  }
  return static_cast<int>(expert);
}

}  // namespace deep_ep
