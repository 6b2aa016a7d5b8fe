// High-throughput (HT) dispatch and combine in direct mode: every rank is load/store reachable.
//
// One dispatch is up to three kernels on the communication stream, one combine is two:
//   notify    (uncached dispatch only) slots by prefix, count exchange through the workspace
//   dispatch  each token row straight into every destination's receive slot
//   epilogue  receive slots -> output tensors (non-expand rows or expanded per-expert rows); with
//             zero-copy receive (direct, non-expand) the rows are already in final position in the
//             window and the epilogue writes the per-row metadata only
//   combine   each received row (expand: its rows pre-summed) back into its home rank's area
//   reduce    home rank: bias + contributions in fixed order, one bf16 rounding
//
// Receive areas (geometry.hpp, HighThroughputLayout, direct): dispatch rows [source][T_max], the
// row of a token being its slot = ordinal among the sender's tokens for that destination, so rows
// arrive in (source rank, source token) order without atomics. Combine rows [j][T_max], j = index
// of the sending rank among the token's distinct destination ranks (ascending). Both start at
// offset 0 of the HT region: every sequence starts with a cross-rank barrier.
//
// This header is host C++ (no device code): the bindings include it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/device_view.hpp"
#include "common/fast_divisor.hpp"
#include "common/geometry.hpp"
#include "common/ht_call.hpp"

namespace deep_ep::ht {

// Grid-sync counters (WorkspaceLayout::kNumGridCounters) used by the HT kernels. Kernels of one
// stream run one at a time, but distinct slots keep a failed kernel from confusing the next one.
constexpr int kGridSlotNotify = 8;
constexpr int kGridSlotDispatch = 9;
constexpr int kGridSlotCombine = 10;
constexpr int kGridSlotBarrier = 11;  // hybrid_barrier's own grid syncs

// Host-mapped counters written by the notify kernel when the caller asked for a CPU sync.
constexpr int kMappedNumRecvTokens = 0;               // non-expand rows N
constexpr int kMappedNumExpandedTokens = 1;           // expanded rows N' (sum of aligned per-expert counts)
constexpr int kMappedAlignedExpertCounts = 2;         // [L] aligned per-local-expert counts
constexpr int kMappedReady = kNumMappedCounters - 1;  // set to 1 last, with a system-scope release

// Source record of every received (non-expand) row (the handle's recv_src_info), one int32 each:
// source rank, source token, combine row j, and the master lane (first top-k lane whose expert is on
// the receiving rank). Combine reads the first three; the handle builds DeepEP V2's
// recv_src_metadata from columns 0, 1 and 3.
constexpr int kSrcInfoSourceRank = 0;
constexpr int kSrcInfoSourceToken = 1;
constexpr int kSrcInfoCombineRow = 2;
constexpr int kSrcInfoMasterLane = 3;
constexpr int kSrcInfoColumns = 4;

// Per-call routing counts of one rank (int32, one allocation owned by the handle). Offsets in ints.
struct CountsLayout {
  int recv_per_source = 0;       // [R] tokens received from each source rank
  int psum_per_source = 0;       // [R] inclusive prefix sum of the above (last = N)
  int expert_offsets = 0;        // [R][L] rows of local expert l from sources < s (exclusive over sources)
  int unaligned_per_expert = 0;  // [L] rows of local expert l (all sources)
  int expert_start = 0;          // [L] first expanded row of expert l: exclusive psum of aligned counts
  int psum_per_expert = 0;       // [L] DeepEP semantics: non-expand inclusive aligned psum; expand start + count
  int total = 0;
};

constexpr CountsLayout counts_layout(int num_ranks, int num_local_experts) {
  CountsLayout layout;
  int offset = 0;
  layout.recv_per_source = offset;
  offset += num_ranks;
  layout.psum_per_source = offset;
  offset += num_ranks;
  layout.expert_offsets = offset;
  offset += num_ranks * num_local_experts;
  layout.unaligned_per_expert = offset;
  offset += num_local_experts;
  layout.expert_start = offset;
  offset += num_local_experts;
  layout.psum_per_expert = offset;
  offset += num_local_experts;
  layout.total = offset;
  return layout;
}

// Notify scratch: per block of 32 tokens one row of [E experts | R ranks | N nodes] counts (turned
// in place into the block's prefix inside its CTA's range, or, for a range's first block, the
// range's aggregate: ht_notify.cu), plus one row of totals. Direct mode has no node columns.
constexpr int kNotifyTokensPerBlock = 32;
EP_HOST_DEVICE constexpr int notify_columns(const HtCall& call) {
  return call.num_experts + call.num_ranks() + (call.hybrid() ? call.num_nodes() : 0);
}
EP_HOST_DEVICE constexpr int64_t notify_blocks(int64_t num_tokens) {
  return (num_tokens + kNotifyTokensPerBlock - 1) / kNotifyTokensPerBlock;
}
EP_HOST_DEVICE constexpr int64_t notify_scratch_ints(const HtCall& call, int64_t num_tokens) {
  return (notify_blocks(num_tokens) + 1) * notify_columns(call);
}

// Hybrid mode: an own token's channel (the stream of scale-out rows its sender CTA signals) is its
// range of whole notify blocks: channel c holds tokens [c * tokens_per_channel, ...).
EP_HOST_DEVICE constexpr int64_t channel_tokens(int64_t num_tokens, int num_channels) {
  const int64_t blocks = notify_blocks(num_tokens);
  const int64_t per_channel = (blocks + num_channels - 1) / num_channels;
  return (per_channel > 0 ? per_channel : 1) * kNotifyTokensPerBlock;
}

// Hybrid mode's routing arrays of one dispatch (one int32 allocation owned by the handle).
struct HybridRouting {
  int num_channels = 0;
  int32_t* node_slot = nullptr;       // [T][N] ordinal of own token t among own tokens for node n, -1 if none
  int32_t* node_counts = nullptr;     // [N] own tokens for each node (the home node included)
  int32_t* forward_prefix = nullptr;  // [N][C + 1] rows from the rail peer of node m, exclusive prefix per channel
  int32_t* forward_token = nullptr;   // [N][T_max] source token of row r from the rail peer of node m
  int32_t* forward_topk = nullptr;    // [N][T_max][K] its global expert ids (-1: none)
  int64_t total_ints = 0;
};

EP_HOST_DEVICE inline HybridRouting hybrid_routing(int32_t* block, const HtCall& call, int64_t num_tokens) {
  HybridRouting routing;
  const int64_t nodes = call.num_nodes();
  const int num_channels = call.num_channels();
  routing.num_channels = num_channels;
  int64_t offset = 0;
  const auto take = [&](int64_t ints) {
    int32_t* pointer = block == nullptr ? nullptr : block + offset;
    offset += ints;
    return pointer;
  };
  routing.node_slot = take(num_tokens * nodes);
  routing.node_counts = take(nodes);
  routing.forward_prefix = take(nodes * (num_channels + 1));
  routing.forward_token = take(nodes * call.num_max_tokens());
  routing.forward_topk = take(nodes * call.num_max_tokens() * call.num_topk);
  routing.total_ints = offset;
  return routing;
}

// Ints of one dispatch's hybrid routing block (0 in direct mode, which has none).
inline int64_t hybrid_routing_ints(const HtCall& call, int64_t num_tokens) {
  return call.hybrid() ? hybrid_routing(nullptr, call, num_tokens).total_ints : 0;
}

struct NotifyArgs {
  DeviceView view;
  HtCall call;
  const int64_t* topk_idx = nullptr;  // [T, K]
  int64_t* topk_idx_copy = nullptr;   // out [T, K]: the handle's copy of the routing, bad/repeated ids -1
  int num_tokens = 0;
  int expert_alignment = 1;
  bool do_expand = false;
  int32_t* expert_slot = nullptr;      // out [T, K]: ordinal of t among this rank's tokens of that expert, -1 if none
  int32_t* dst_slot = nullptr;         // out [T, K]: slot at the expert's rank on the first k of that rank, else -1
  int32_t* scratch = nullptr;          // notify_scratch_ints(call, T)
  int32_t* counts = nullptr;           // out: counts_layout(R, L)
  int32_t* mapped_counters = nullptr;  // device pointer of the host-mapped counters; nullptr: no CPU sync
  int32_t* send_base = nullptr;        // zero-copy receive: out [R] this rank's first final row at each rank
  // Direct mode only: out [R, R] V1's rank prefix matrix, [s][d] = tokens ranks 0..s send to rank d;
  // nullptr: not wanted.
  int32_t* rank_prefix_matrix = nullptr;
  HybridRouting hybrid;  // hybrid mode: out node_slot, node_counts, forward_prefix
  int num_sms = 1;
  bool input_failed = false;  // this rank takes part with T = 0 and tells its peers its input failed
  // Divisions by K and by L, set by launch_notify (the kernel divides every routing entry).
  FastDivisor by_topk{1};
  FastDivisor by_local{1};
};

struct DispatchArgs {
  DeviceView view;
  HtCall call;
  int num_tokens = 0;
  const void* x = nullptr;               // [T, H] bf16 or fp8
  const float* x_scales = nullptr;       // [T, H/128] (fp8 only)
  const int64_t* topk_idx = nullptr;     // the handle's copy [T, K] (sanitised by notify)
  const float* topk_weights = nullptr;   // [T, K] or nullptr
  const int32_t* dst_slot = nullptr;     // from notify
  const int32_t* expert_slot = nullptr;  // from notify
  const int32_t* send_base = nullptr;    // zero-copy receive: [R] from notify (the handle's)
  HybridRouting hybrid;                  // hybrid mode: node_slot, forward_prefix in; forward_token/topk out
  bool entry_barrier = false;            // cached dispatch: no notify ran before, so barrier here
  int num_sms = 1;
  // This rank takes part without input: it sends no row (hybrid, cached: only its row streams' counts,
  // flagged, and its forwarder forwards nothing) and, with entry_barrier, tells its peers why.
  bool input_failed = false;
};

struct EpilogueArgs {
  DeviceView view;
  HtCall call;
  bool do_expand = false;
  int expert_alignment = 1;
  bool has_weights = false;             // senders wrote weights into the slots
  const int32_t* counts = nullptr;      // counts_layout(R, L)
  int64_t num_rows_allocated = 0;       // rows of recv_x (N or N' capacity); writes beyond are skipped
  int64_t num_meta_rows_allocated = 0;  // rows of recv_src_info / recv_expanded_rows
  void* recv_x = nullptr;
  float* recv_x_scales = nullptr;
  int64_t* recv_topk_idx = nullptr;       // non-expand [N, K] local ids
  float* recv_topk_weights = nullptr;     // non-expand [N, K]; expand [N']
  int32_t* recv_src_info = nullptr;       // [N, 4]; nullptr in cached mode (already in the handle)
  int32_t* recv_expanded_rows = nullptr;  // expand [N, K]; nullptr in cached mode
  int num_ctas = 1;
};

struct CombineArgs {
  DeviceView view;
  HtCall call;
  bool do_expand = false;
  const void* x = nullptr;                      // bf16 [N or N', H]; nullptr: send zero rows
  const float* topk_weights = nullptr;          // [N, K] or expand [N']; nullptr: no weights
  const int32_t* counts = nullptr;              // the handle's counts_layout(R, L); nullptr: no row
  const int32_t* recv_src_info = nullptr;       // [N, 4]
  const int32_t* recv_expanded_rows = nullptr;  // expand [N, K]
  int64_t num_meta_rows = 0;                    // N the host allocated the two arrays above for
  // Hybrid mode (the forwarder's node partials): own routing and the handle's hybrid arrays.
  int num_tokens = 0;
  const int64_t* topk_idx = nullptr;  // the handle's copy [T, K]
  HybridRouting hybrid;
  int num_sms = 1;
  bool input_failed = false;      // this rank's input failed: it sends zero rows (or none) and tells its peers
  bool sum_topk_weights = false;  // hybrid forwarder: node partial weights by V1's rule (see ReduceArgs)
};

struct ReduceArgs {
  DeviceView view;
  HtCall call;
  int num_tokens = 0;
  const int64_t* topk_idx = nullptr;  // the handle's copy [T, K]
  const void* bias0 = nullptr;        // bf16 [T, H] or nullptr
  const void* bias1 = nullptr;
  void* combined_x = nullptr;              // bf16 [T, H]
  float* combined_topk_weights = nullptr;  // [T, K] or nullptr
  // Weight k: false, the one sent by the rank (node) owning expert k (DeepEP V2); true, the fp32 sum
  // of slot k over every term, owners ascending, from +0.0 (DeepEP V1: all K slots of every rank
  // that received the token, whatever its experts there).
  bool sum_topk_weights = false;
  int num_ctas = 1;
};

// Zero-copy combine (direct mode, a handle from a zero_copy_recv dispatch): the home rank reads each
// token's rows from the combine input of its destination ranks (row send_base[d] + dst_slot there)
// and sums them with the biases in the push path's order, so the result is bitwise the same.
struct PullCombineArgs {
  DeviceView view;
  HtCall call;
  int num_tokens = 0;
  const int64_t* topk_idx = nullptr;   // the handle's copy [T, K]
  const int32_t* dst_slot = nullptr;   // the handle's [T, K]
  const int32_t* send_base = nullptr;  // the handle's [R]
  const void* bias0 = nullptr;         // bf16 [T, H] or nullptr
  const void* bias1 = nullptr;
  void* combined_x = nullptr;              // bf16 [T, H]
  float* combined_topk_weights = nullptr;  // [T, K] or nullptr: weights are not read
  bool sum_topk_weights = false;           // as in ReduceArgs
  int num_sms = 1;
  bool input_failed = false;  // this rank's input failed: it zeroed its combine input and tells its peers
};

void launch_notify(const NotifyArgs& args, cudaStream_t stream);
void launch_dispatch(const DispatchArgs& args, cudaStream_t stream);
void launch_hybrid_dispatch(const DispatchArgs& args, cudaStream_t stream);  // launch_dispatch checked args
void launch_dispatch_epilogue(const EpilogueArgs& args, cudaStream_t stream);
void launch_combine(const CombineArgs& args, cudaStream_t stream);
void launch_combine_reduce(const ReduceArgs& args, cudaStream_t stream);
void launch_pull_combine(const PullCombineArgs& args, cudaStream_t stream);

}  // namespace deep_ep::ht
