// HT combine. Direct: every received token row goes back to its home rank, into row
// [j][source token] of the home rank's combine area, j = index of this rank among the token's
// distinct destination ranks (ascending; kept in recv_src_info by the dispatch epilogue).
// Hybrid: the row goes over load/store to the token's forwarder on this node (the home rank's rail
// peer here), row [j][home node][token] with j counted among the token's ranks on this node; after
// a node barrier each forwarder sums its node's rows per token (fp32, one bf16 rounding) and puts
// the partial to the home rank (scale-out transport; lsa: stores the sum there directly), which
// waits for them before the reduce kernel adds biases and node partials.
//
// Every sum follows DeepEP V2's reference combine (deep_ep/utils/refs.py there): the terms go in
// ascending order of each term's last top-k lane (a rank's last lane at the forwarder, a node's at
// the home rank), not in row order; term_rows_in_v2_order (ht_common.cuh) maps one to the other.
// Expand mode sends one row per token: the fp32 sum of its expanded rows in top-k lane order (as
// V2 sums a rank's lanes), rounded to bf16 once.
// The K weights travel in the same slot; the home rank gathers weight k from the rank owning expert k
// (DeepEP V2), or sums slot k over every rank that received the token (V1; hybrid: per node at the
// forwarder, then over nodes).
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/require.hpp"
#include "kernels/barrier.cuh"
#include "kernels/high_throughput.hpp"
#include "kernels/ht_common.cuh"
#include "kernels/preload.hpp"
#include "kernels/scaleout.cuh"
#include "kernels/topology_barrier.cuh"

namespace deep_ep::ht {
namespace {

constexpr int kCombineThreads = 512;
constexpr int kCombineWarps = kCombineThreads / 32;
constexpr int kCopyUnroll = 4;
constexpr int kSumUnroll = 2;

// Expand mode: this rank's partial of one token into `dst`. Lane k holds the expanded row of top-k
// entry k (-1: its expert is elsewhere); the rows are summed in lane order, as V2 sums a rank's lanes.
__device__ void send_expanded_sum(const int4* x, int64_t num_vectors, int expanded_row, int4* dst) {
  const uint32_t row_lanes = __ballot_sync(kFullMask, expanded_row >= 0);
  // Lane j: the row of term j (0 past the terms: such rows are never loaded, the address stays in x).
  const int term_row = gather_in_lane_order(row_lanes, expanded_row, 0);
  sum_row_to_bf16<kSumUnroll>(
      dst, nullptr, nullptr, __popc(row_lanes), num_vectors,
      [&](int j) { return x + int64_t{__shfl_sync(kFullMask, term_row, j & 31)} * num_vectors; },
      [](const int4* p) { return ptx::ld_nc_v4(p); });
}

// Hybrid mode, forwarder phase: the node partial of one token (this node's rows of it, summed in fp32
// in ascending order of each rank's last top-k lane, as V2 sums a node's rank partials; rounded
// once) into `dst`, and the weights of this node's entries. Lane k holds the token's expert k (-1: none).
__device__ void sum_node_rows(const DeviceView& view, const HtCall& call, int source_node, int64_t token, int expert,
                              bool sum_topk_weights, uint8_t* dst) {
  const int lane = lane_id();
  const int node = call.node_of(view.rank);
  const int node_first = node * call.ranks_per_node();
  const int node_end = node_first + call.ranks_per_node();
  const TokenLayout& combine = call.combine_token();
  const int64_t num_vectors = int64_t{call.hidden} / kBf16PerVector;
  const int expert_rank = expert >= 0 ? call.rank_of_expert(expert) : -1;
  const int in_node_rank = (expert_rank >= node_first && expert_rank < node_end) ? expert_rank : -1;
  // Row j holds the rank with j of the token's ranks on this node below it.
  const TermRows terms = term_rows_in_v2_order(in_node_rank);
  const uint8_t* rows = view.local<uint8_t>(call.combine_row_slot(0, source_node, token));
  const int64_t row_stride =
      call.combine_row_slot(1, source_node, token) - call.combine_row_slot(0, source_node, token);
  // __ldcg: the rows were stored by this node's ranks during this kernel.
  sum_row_to_bf16<kSumUnroll>(
      reinterpret_cast<int4*>(dst), nullptr, nullptr, terms.num_terms, num_vectors,
      [&](int j) {
        return reinterpret_cast<const int4*>(rows + __shfl_sync(kFullMask, terms.row, j & 31) * row_stride);
      },
      [](const int4* p) { return __ldcg(p); });
  // Owner rule: weight k from the row of the rank owning expert k (entries of other nodes carry 0);
  // sum rule: the node's rows summed, ranks ascending (V1's first level).
  if (lane < call.num_topk) {
    reinterpret_cast<float*>(dst + combine.weights_offset)[lane] =
        combined_slot_weight(rows, row_stride, combine.weights_offset, terms, in_node_rank >= 0, sum_topk_weights,
                             [](const float* p) { return __ldcg(p); });
  }
}

// Hybrid mode, forwarder phase: every token this node holds experts of, per source node m: the rail
// peer's rows as forwarded by the dispatch (handle: forward_*), and this rank's own tokens (m = this
// node). Each partial goes to the token's home rank, row [index of this node among the token's
// nodes]; one signal per (CTA, batch, remote node) counts the rows it covers.
__device__ bool forward_partials(const CombineArgs& args, scaleout::DeferredQueue* queue, int* item_prefix,
                                 int* batch_rows) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const HybridRouting& hybrid = args.hybrid;
  const int lane = lane_id();
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int num_nodes = call.num_nodes();
  const int node = call.node_of(view.rank);
  const int num_topk = call.num_topk;
  const scaleout::WarpGroup group{1, static_cast<int>(blockDim.x), static_cast<int>(threadIdx.x)};
  scaleout::Transport transport(view, queue);
  transport.init(group);
  if (threadIdx.x == 0) {
    int running = 0;
    for (int m = 0; m < num_nodes; ++m) {
      item_prefix[m] = running;
      const int forwarded = hybrid.forward_prefix[m * (hybrid.num_channels + 1) + hybrid.num_channels];
      running += m == node ? args.num_tokens : max(0, min(forwarded, static_cast<int>(call.num_max_tokens())));
    }
    item_prefix[num_nodes] = running;
  }
  for (int m = group.thread; m < num_nodes; m += group.num_threads) batch_rows[m] = 0;
  group.sync();
  const int64_t num_items = item_prefix[num_nodes];
  const int64_t per_round = int64_t{gridDim.x} * kCombineWarps;
  for (int64_t round = 0; round * per_round < num_items; ++round) {
    const int64_t item = round * per_round + int64_t{blockIdx.x} * kCombineWarps + warp;
    if (item < num_items) {
      int m = 0;
      while (item >= item_prefix[m + 1]) ++m;
      const int64_t index = item - item_prefix[m];
      int64_t token = index;
      int expert = -1;
      bool involved = true;
      if (m == node) {
        if (lane < num_topk) expert = handle_expert(args.topk_idx, index * num_topk + lane, call.num_experts);
        involved = hybrid.node_slot[index * num_nodes + node] >= 0;
      } else {
        const int64_t kept = int64_t{m} * call.num_max_tokens() + index;
        token = hybrid.forward_token[kept];
        if (lane < num_topk) {
          const int32_t id = hybrid.forward_topk[kept * num_topk + lane];
          expert = (id >= 0 && id < call.num_experts) ? id : -1;
        }
      }
      if (involved) {
        // Index of this node among the token's nodes (ascending): the home rank's partial row.
        const int expert_node = expert >= 0 ? call.node_of(call.rank_of_expert(expert)) : -1;
        const uint32_t node_lanes = __ballot_sync(kFullMask, is_first_lane_of_rank(expert_node));
        const int node_index = distinct_ranks_in(expert_node, node_lanes, 0, node);
        if (m == node) {
          sum_node_rows(view, call, m, token, expert, args.sum_topk_weights,
                        view.local<uint8_t>(call.partial_slot(node_index, token)));
        } else if (view.scaleout.kind == ScaleoutKind::kLsa) {
          // lsa, whose puts are plain stores anyway: sum straight into the home rank's partial row
          // (no staging write and re-read). The batch's signal covers these stores as it covers a put.
          sum_node_rows(view, call, m, token, expert, args.sum_topk_weights,
                        view.peer<uint8_t>(call.rail_peer(view.rank, m), call.partial_slot(node_index, token)));
          if (lane == 0) atomicAdd(&batch_rows[m], 1);
        } else {
          sum_node_rows(view, call, m, token, expert, args.sum_topk_weights,
                        view.local<uint8_t>(call.partial_send_slot(m, token)));
          __syncwarp();
          transport.put(call.rail_peer(view.rank, m), call.partial_slot(node_index, token),
                        call.partial_send_slot(m, token), call.combine_token().bytes);
          if (lane == 0) atomicAdd(&batch_rows[m], 1);
        }
      }
    }
    group.sync();
    for (int m = 0; m < num_nodes; ++m) {
      const int rows = batch_rows[m];
      if (rows > 0) transport.signal(group, call.rail_peer(view.rank, m), kSignalPartials + node, rows);
    }
    group.sync();
    for (int m = group.thread; m < num_nodes; m += group.num_threads) batch_rows[m] = 0;
    group.sync();
  }
  transport.flush(group);
  return true;
}

// Hybrid mode, CTA 0 at the end: every remote node's partials of this rank's tokens have landed
// (the reduce kernel reads them next).
__device__ bool wait_partials(const CombineArgs& args) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const int node = call.node_of(view.rank);
  const scaleout::Transport transport(view, nullptr);
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  for (int m = threadIdx.x; m < call.num_nodes(); m += blockDim.x) {
    if (m == node) continue;
    const int id = kSignalPartials + m;
    const int32_t expected = args.hybrid.node_counts[m];
    if (scaleout::wait_signal(view, transport, Operation::kHtCombine, Phase::kPartialsArrive,
                              call.rail_peer(view.rank, m), id, expected)) {
      scaleout::advance_shadow(view, id, expected);
    } else {
      failed = 1;
    }
  }
  __syncthreads();
  return failed == 0;
}

__global__ void __launch_bounds__(kCombineThreads, 1) combine_impl(const CombineArgs args) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  __shared__ scaleout::DeferredQueue queue;
  __shared__ int item_prefix[kMaxNodes + 1];
  __shared__ int batch_rows[kMaxNodes];
  // The combine areas overlap the dispatch receive areas: wait until every rank has finished its
  // dispatch epilogue.
  if (blockIdx.x == 0 && !topology_barrier(view, Operation::kHtCombine, args.input_failed)) return;
  if (!grid_sync(view, Operation::kHtCombine, kGridSlotCombine)) return;

  const int lane = lane_id();
  const int num_ranks = view.num_ranks;
  const int num_topk = call.num_topk;
  const int node = call.node_of(view.rank);
  const TokenLayout& token = call.combine_token();
  const int64_t num_vectors = int64_t{call.hidden} / kBf16PerVector;
  const CountsLayout counts = counts_layout(num_ranks, 1);  // psum_per_source does not depend on L
  const int64_t num_rows = args.counts == nullptr ? 0 : args.counts[counts.psum_per_source + num_ranks - 1];
  const auto* x = static_cast<const int4*>(args.x);

  const int64_t first_warp = int64_t{blockIdx.x} * kCombineWarps + threadIdx.x / 32;
  for (int64_t row = first_warp; row < num_rows; row += int64_t{gridDim.x} * kCombineWarps) {
    const int32_t* info = args.recv_src_info + row * kSrcInfoColumns;
    const int source = __ldg(info + kSrcInfoSourceRank);
    const int64_t source_token = __ldg(info + kSrcInfoSourceToken);
    const int combine_row = __ldg(info + kSrcInfoCombineRow);
    // Direct: the home rank's row [j][token]. Hybrid: the forwarder of the source's tokens on this
    // node (its rail peer here), row [j][source node][token].
    const int receiver = call.hybrid() ? call.rail_peer(source, node) : source;
    uint8_t* dst = view.peer<uint8_t>(
        receiver, call.combine_row_slot(combine_row, call.hybrid() ? call.node_of(source) : 0, source_token));
    float weight = 0.0f;
    if (x == nullptr) {
      // This rank's input failed: its contribution to the token is zero, not stale window data.
      for (int64_t index = lane; index < num_vectors; index += 32) {
        reinterpret_cast<int4*>(dst)[index] = make_int4(0, 0, 0, 0);
      }
    } else if (!args.do_expand) {
      warp_copy_to_lanes<kCopyUnroll>(x + row * num_vectors, num_vectors, 1u, reinterpret_cast<int4*>(dst));
      if (lane < num_topk && args.topk_weights != nullptr) weight = __ldg(args.topk_weights + row * num_topk + lane);
    } else {
      const int expanded_row = lane < num_topk ? __ldg(args.recv_expanded_rows + row * num_topk + lane) : -1;
      send_expanded_sum(x, num_vectors, expanded_row, reinterpret_cast<int4*>(dst));
      if (expanded_row >= 0 && args.topk_weights != nullptr) weight = __ldg(args.topk_weights + expanded_row);
    }
    if (lane < num_topk && (args.topk_weights != nullptr || x == nullptr)) {
      reinterpret_cast<float*>(dst + token.weights_offset)[lane] = weight;
    }
  }

  if (!call.hybrid()) {
    // All rows everywhere, then the reduce epilogue may read its own area.
    if (!grid_sync(view, Operation::kHtCombine, kGridSlotCombine)) return;
    if (blockIdx.x == 0) rank_barrier(view, Operation::kHtCombine);
    return;
  }
  // Hybrid: this node's rows at every forwarder of the node, then the node partials.
  if (!grid_sync(view, Operation::kHtCombine, kGridSlotCombine)) return;
  if (blockIdx.x == 0 &&
      !group_barrier(view, Operation::kHtCombine, node * call.ranks_per_node(), call.ranks_per_node())) {
    return;
  }
  if (!grid_sync(view, Operation::kHtCombine, kGridSlotCombine)) return;
  forward_partials(args, &queue, item_prefix, batch_rows);
  if (!grid_sync(view, Operation::kHtCombine, kGridSlotCombine)) return;
  if (blockIdx.x == 0) wait_partials(args);
}

}  // namespace

void launch_combine(const CombineArgs& args, cudaStream_t stream) {
  check_ht_grid_size(args.view, "num_sms", args.num_sms);
  check_call(args.view, args.call);
  check_combine_shape(args.call.num_topk, args.call.hidden);
  check_hybrid_routing(args.call, args.hybrid, args.num_tokens);
  EP_REQUIRE(!args.call.hybrid() || args.num_tokens == 0 || args.topk_idx != nullptr,
             "hybrid combine needs the handle's routing copy");
  // With no received rows (every rank dispatched nothing here) the per-row arrays are empty, so
  // their pointers may be null; the kernel reads no row then.
  EP_REQUIRE(args.num_meta_rows >= 0, "num_meta_rows must be >= 0, got " + std::to_string(args.num_meta_rows));
  EP_REQUIRE(args.num_meta_rows == 0 || args.recv_src_info != nullptr, "combine needs the handle's recv_src_info");
  EP_REQUIRE(args.num_meta_rows == 0 || args.x == nullptr || !args.do_expand || args.recv_expanded_rows != nullptr,
             "expand combine needs the expanded row map");
  EP_REQUIRE(args.x != nullptr || args.input_failed || args.num_meta_rows == 0,
             "combine needs x (only a failed input sends zero rows)");
  combine_impl<<<args.num_sms, kCombineThreads, 0, stream>>>(args);
  EP_CHECK_LAUNCH("ht combine_impl");
}

void preload_ht_combine_kernels() { preload_kernel(combine_impl, "ht combine (combine_impl)"); }

}  // namespace deep_ep::ht
