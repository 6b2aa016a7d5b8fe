// HT dispatch, hybrid mode: a token crosses to another node once, to the rank with this rank's
// local index there (the rail peer), which forwards it to the ranks of its node holding the
// token's experts. Destinations on this rank's own node are stored directly, as in direct mode.
// The final receive slots, their contents and their order are exactly direct mode's, so the
// epilogue is shared and the outputs are bitwise equal.
//
// Each CTA runs two roles at once (every CTA of the grid is resident, so they cannot starve):
//   sender warps     channel c = a contiguous range of whole notify blocks of own tokens. Per batch
//                    (one token per sender warp): home-node copies; for remote nodes, stage the
//                    scale-out row once (dispatch slot + K destination slots) and put it to the
//                    rail peer's row [my node][node_slot] (lsa: store it there directly, no
//                    staging); then one signal per node (rows added).
//                    Rows of a channel are put in ordinal order and each signal covers the puts
//                    before it, so "signal >= r + 1" means rows [0, r] of the stream landed.
//   forwarder warps  stream (source node m, channel c): wait for row r's signal, then copy the
//                    row's slot prefix into the final slot [source rank][slot] of each rank of this
//                    node that holds one of its experts; keep the row's source token and experts
//                    for combine (handle: forward_token / forward_topk).
// The end is a node barrier: the epilogue reads only slots written by its own node.
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

constexpr int kThreads = 512;
constexpr int kSenderWarps = 8;
constexpr int kForwarderWarps = kThreads / 32 - kSenderWarps;
constexpr int kSenderBarrier = 2;  // named barrier of the sender warps (1: whole-CTA transport group)
constexpr int kCopyUnroll = 4;
// The forwarder copies one row at a time per warp: more 16-byte vectors in flight per lane.
constexpr int kForwardUnroll = 8;

__device__ __forceinline__ int rows_signal(int source_node, int channel) {
  return kSignalRows + source_node * kMaxChannels + channel;
}

// lsa transport: token t's scale-out row goes straight into each remote node's rail peer (its
// receive row [my node][ordinal]): the same bytes a put of the staged row delivers, without writing
// and re-reading a staging row. Lane m (of each group of 32 nodes) owns node m's row. The batch's
// signal covers these stores as it covers lsa puts, which are plain stores through the peer table
// too: the group barrier, then the signalling thread's system-scope fence and release add.
__device__ __forceinline__ void store_scaleout_rows(const DispatchArgs& args, int t, int expert, int32_t slot,
                                                    int32_t expert_slot, float weight, int* batch_rows) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const int lane = lane_id();
  const int num_nodes = call.num_nodes();
  const int node = call.node_of(view.rank);
  const auto* x = static_cast<const uint8_t*>(args.x);
  for (int base = 0; base < num_nodes; base += 32) {
    const int m = base + lane;
    const int32_t ordinal = (m < num_nodes && m != node) ? args.hybrid.node_slot[int64_t{t} * num_nodes + m] : -1;
    uint8_t* row = ordinal >= 0
                       ? view.peer<uint8_t>(call.rail_peer(view.rank, m), call.scaleout_recv_slot(node, ordinal))
                       : nullptr;
    const uint32_t dst_lanes = __ballot_sync(kFullMask, ordinal >= 0);
    if (dst_lanes == 0) continue;
    store_dispatch_slot<kCopyUnroll>(call, x, args.x_scales, args.topk_weights != nullptr, t, expert, expert_slot,
                                     weight, dst_lanes, row);
    for (uint32_t lanes = dst_lanes; lanes != 0; lanes &= lanes - 1) {
      const int owner = __ffs(lanes) - 1;
      auto* dst = reinterpret_cast<uint8_t*>(__shfl_sync(kFullMask, reinterpret_cast<unsigned long long>(row), owner));
      if (lane < call.num_topk) {
        reinterpret_cast<int32_t*>(dst + call.scaleout_dst_slot_offset())[lane] = expert >= 0 ? slot : -1;
      }
    }
    if (ordinal >= 0) atomicAdd(&batch_rows[m], 1);
  }
}

// A cached dispatch whose input failed (this rank takes part without data, with its handle): no row
// is written, but every row stream to another node gets one signal of its whole row count plus
// kFailedInputSignalFlag, so the forwarder there neither waits for rows that never come nor forwards
// stale ones (its node-mates' slots for this rank keep stale data, as in direct mode, and the
// PeerInputError every peer gets says the result must not be used).
__device__ void send_failed(const DispatchArgs& args, scaleout::Transport& transport, const scaleout::WarpGroup& group,
                            int* batch_rows) {
  const HtCall& call = args.call;
  const int num_nodes = call.num_nodes();
  const int node = call.node_of(args.view.rank);
  const int64_t per_channel = channel_tokens(args.num_tokens, args.hybrid.num_channels);
  for (int channel = blockIdx.x; channel < args.hybrid.num_channels; channel += gridDim.x) {
    const int64_t begin = channel * per_channel;
    const int64_t end = min(begin + per_channel, int64_t{args.num_tokens});
    for (int64_t t = begin + group.thread; t < end; t += group.num_threads) {
      for (int m = 0; m < num_nodes; ++m) {
        if (m != node && args.hybrid.node_slot[t * num_nodes + m] >= 0) atomicAdd(&batch_rows[m], 1);
      }
    }
    transport.signal_each(group, num_nodes, [&](int m) {
      if (m == node || batch_rows[m] == 0) return scaleout::SignalItem{};
      return scaleout::SignalItem{call.rail_peer(args.view.rank, m), rows_signal(node, channel),
                                  static_cast<uint64_t>(batch_rows[m]) + kFailedInputSignalFlag};
    });
    for (int m = group.thread; m < num_nodes; m += group.num_threads) batch_rows[m] = 0;
    group.sync();
  }
}

__device__ void send(const DispatchArgs& args, scaleout::DeferredQueue* queue, int* batch_rows) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const HybridRouting& hybrid = args.hybrid;
  const int lane = lane_id();
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int num_topk = call.num_topk;
  const int num_nodes = call.num_nodes();
  const int node = call.node_of(view.rank);
  const auto* x = static_cast<const uint8_t*>(args.x);
  const bool has_weights = args.topk_weights != nullptr;
  const scaleout::WarpGroup group{kSenderBarrier, kSenderWarps * 32, static_cast<int>(threadIdx.x)};
  scaleout::Transport transport(view, queue);
  transport.init(group);
  for (int m = group.thread; m < num_nodes; m += group.num_threads) batch_rows[m] = 0;
  group.sync();
  if (args.input_failed) {
    if (args.num_tokens > 0) send_failed(args, transport, group, batch_rows);
    return;
  }

  const int64_t per_channel = channel_tokens(args.num_tokens, hybrid.num_channels);
  for (int channel = blockIdx.x; channel < hybrid.num_channels; channel += gridDim.x) {
    const int64_t begin = channel * per_channel;
    const int64_t end = min(begin + per_channel, int64_t{args.num_tokens});
    for (int64_t batch = begin; batch < end; batch += kSenderWarps) {
      const int t = static_cast<int>(batch + warp);
      if (t < end) {
        const int64_t entry = int64_t{t} * num_topk + lane;
        int expert = -1;
        int32_t slot = -1;
        int32_t expert_slot = -1;
        float weight = 0.0f;
        if (lane < num_topk) {
          expert = handle_expert(args.topk_idx, entry, call.num_experts);
          slot = args.dst_slot[entry];
          expert_slot = args.expert_slot[entry];
          if (has_weights) weight = args.topk_weights[entry];
        }
        const int expert_rank = expert >= 0 ? call.rank_of_expert(expert) : -1;
        const bool home = slot >= 0 && expert >= 0 && call.node_of(expert_rank) == node;
        const uint32_t home_lanes = __ballot_sync(kFullMask, home);
        if (home_lanes != 0) {
          uint8_t* my_slot = home ? view.peer<uint8_t>(expert_rank, call.dispatch_slot(view.rank, slot)) : nullptr;
          store_dispatch_slot<kCopyUnroll>(call, x, args.x_scales, has_weights, t, expert, expert_slot, weight,
                                           home_lanes, my_slot);
        }
        const bool remote = expert >= 0 && call.node_of(expert_rank) != node;
        const bool any_remote = __ballot_sync(kFullMask, remote) != 0;
        if (any_remote && view.scaleout.kind == ScaleoutKind::kLsa) {
          store_scaleout_rows(args, t, expert, slot, expert_slot, weight, batch_rows);
        } else if (any_remote) {
          // Stage the scale-out row once (a put's source must be in the window): the dispatch
          // slot, then the K destination slots.
          uint8_t* staging = view.local<uint8_t>(call.scaleout_send_slot(t));
          store_dispatch_slot<kCopyUnroll>(call, x, args.x_scales, has_weights, t, expert, expert_slot, weight, 1u,
                                           lane == 0 ? staging : nullptr);
          if (lane < num_topk) {
            reinterpret_cast<int32_t*>(staging + call.scaleout_dst_slot_offset())[lane] = expert >= 0 ? slot : -1;
          }
          __syncwarp();
          for (int m = 0; m < num_nodes; ++m) {
            const int32_t ordinal = m == node ? -1 : hybrid.node_slot[int64_t{t} * num_nodes + m];
            if (ordinal < 0) continue;
            transport.put(call.rail_peer(view.rank, m), call.scaleout_recv_slot(node, ordinal),
                          call.scaleout_send_slot(t), call.layout.scaleout_row_bytes);
            if (lane == 0) atomicAdd(&batch_rows[m], 1);
          }
        }
      }
      // One signal per node with rows in this batch; it covers every put of the batch to that peer.
      group.sync();
      for (int m = 0; m < num_nodes; ++m) {
        const int rows = batch_rows[m];
        if (rows > 0) transport.signal(group, call.rail_peer(view.rank, m), rows_signal(node, channel), rows);
      }
      group.sync();
      for (int m = group.thread; m < num_nodes; m += group.num_threads) batch_rows[m] = 0;
      group.sync();
    }
  }
  // Staging rows are rewritten by the next operation, after its entry barrier.
  transport.flush(group);
}

__device__ void forward(const DispatchArgs& args) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const HybridRouting& hybrid = args.hybrid;
  const int lane = lane_id();
  const int forwarder = static_cast<int>(threadIdx.x / 32) - kSenderWarps;
  const int num_topk = call.num_topk;
  const int num_channels = hybrid.num_channels;
  const int node = call.node_of(view.rank);
  const TokenLayout& token = call.dispatch_token();
  const scaleout::Transport transport(view, nullptr);

  for (int stream = blockIdx.x; stream < call.num_nodes() * num_channels; stream += gridDim.x) {
    const int m = stream / num_channels;
    const int channel = stream % num_channels;
    if (m == node) continue;
    const int source = call.rail_peer(view.rank, m);
    const int32_t* prefix = hybrid.forward_prefix + m * (num_channels + 1);
    // Clamped to [0, T_max]: a rank taking part without input may hold a smaller T_max than its
    // peers, and a prefix is never trusted to address past the arrays.
    const int64_t first_row = max_of(0, min_of(prefix[channel], call.num_max_tokens()));
    const int64_t end_row = max_of(first_row, min_of(prefix[channel + 1], call.num_max_tokens()));
    const int32_t rows = static_cast<int32_t>(end_row - first_row);
    // Lane 0: the stream's shadow (stable during the kernel: advanced after the last grid sync) and
    // how many of its rows are known to have landed. Rows land in order (each signal covers the
    // puts before it), so one wait that sees the signal far ahead covers the rows up to there.
    const int signal = rows_signal(m, channel);
    const uint64_t shadow = lane == 0 ? *scaleout::shadow_cell(view, signal) : 0;
    uint64_t landed = 0;
    for (int32_t r = forwarder; r < rows; r += kForwarderWarps) {
      bool arrived = true;
      if (lane == 0 && landed < static_cast<uint64_t>(r) + 1) {
        arrived = scaleout::wait_signal_landed(view, transport, Operation::kHtDispatch, Phase::kScaleoutRowsArrive,
                                               source, signal, shadow, r + 1, &landed);
      }
      if (__shfl_sync(kFullMask, arrived ? 1 : 0, 0) == 0) return;
      const int64_t ordinal = first_row + r;
      // This rank's own input failed: it does not know the peers' row layout (hidden size, fp8), so
      // it forwards nothing (its node-mates' slots for this source keep stale data; every peer's
      // PeerInputError says the result must not be used), but it waits for the rows, so its
      // shadows stay in step with the signals.
      if (args.input_failed) continue;
      // The source's input failed (send_failed): no row came and none is forwarded. The row's
      // forward_token / forward_topk keep what the handle's first (uncached) dispatch wrote: the
      // same routing, so a combine with this handle still addresses the right rows.
      if (__shfl_sync(kFullMask, landed >= static_cast<uint64_t>(kFailedInputSignalFlag) ? 1 : 0, 0) != 0) continue;
      const uint8_t* row = view.local<uint8_t>(call.scaleout_recv_slot(m, ordinal));
      int expert = -1;
      int32_t slot = -1;
      if (lane < num_topk) {
        const int32_t id = __ldcg(reinterpret_cast<const int32_t*>(row + token.topk_idx_offset) + lane);
        expert = (id >= 0 && id < call.num_experts) ? id : -1;
        slot = __ldcg(reinterpret_cast<const int32_t*>(row + call.scaleout_dst_slot_offset()) + lane);
      }
      const int expert_rank = expert >= 0 ? call.rank_of_expert(expert) : -1;
      // The slot is bounded too: a row is never trusted to address past the source's slots.
      const bool mine = slot >= 0 && slot < call.num_max_tokens() && expert >= 0 && call.node_of(expert_rank) == node;
      const uint32_t dst_lanes = __ballot_sync(kFullMask, mine);
      uint8_t* my_dst = mine ? view.peer<uint8_t>(expert_rank, call.dispatch_slot(source, slot)) : nullptr;
      warp_copy_to_lanes<kForwardUnroll, true>(reinterpret_cast<const int4*>(row), token.bytes / kVectorBytes,
                                               dst_lanes, reinterpret_cast<int4*>(my_dst));
      const int64_t kept = int64_t{m} * call.num_max_tokens() + ordinal;
      if (lane < num_topk) hybrid.forward_topk[kept * num_topk + lane] = expert;
      if (lane == 0) hybrid.forward_token[kept] = __ldcg(reinterpret_cast<const int32_t*>(row + token.src_offset));
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_impl_hybrid(const DispatchArgs args) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  __shared__ scaleout::DeferredQueue queue;
  __shared__ int batch_rows[kMaxNodes];
  // After a timeout (the notify kernel before this one included) the handle's forward prefix was
  // never written: leave at once (the buffer refuses further work until destroy()).
  if (error_recorded(view)) return;
  if (args.entry_barrier) {
    // Cached dispatch: no notify kernel passed the entry barrier for us.
    if (blockIdx.x == 0 && !topology_barrier(view, Operation::kHtDispatch, args.input_failed)) return;
    if (!grid_sync(view, Operation::kHtDispatch, kGridSlotDispatch)) return;
  }
  if (threadIdx.x / 32 < kSenderWarps) {
    send(args, &queue, batch_rows);
  } else {
    forward(args);
  }
  if (!grid_sync(view, Operation::kHtDispatch, kGridSlotDispatch)) return;
  // Every row stream this CTA forwarded is consumed: the next operation expects from here.
  const int num_channels = args.hybrid.num_channels;
  const int node = call.node_of(view.rank);
  for (int stream = blockIdx.x; stream < call.num_nodes() * num_channels; stream += gridDim.x) {
    const int m = stream / num_channels;
    const int channel = stream % num_channels;
    if (m == node || threadIdx.x != 0) continue;
    const int32_t* prefix = args.hybrid.forward_prefix + m * (num_channels + 1);
    const int rows = prefix[channel + 1] - prefix[channel];
    if (rows <= 0) continue;
    // Every row of the stream landed (the forwarders waited for its last one), so the signal holds
    // this operation's whole addition: the rows, plus kFailedInputSignalFlag when the source's input failed.
    const int signal = rows_signal(m, channel);
    const uint64_t added = scaleout::read_own_signal(view, signal) - *scaleout::shadow_cell(view, signal);
    scaleout::advance_shadow(
        view, signal, rows + (added >= static_cast<uint64_t>(kFailedInputSignalFlag) ? kFailedInputSignalFlag : 0));
  }
  // The final slots of this node's ranks are written by this node's ranks only.
  if (blockIdx.x == 0) {
    group_barrier(view, Operation::kHtDispatch, node * call.ranks_per_node(), call.ranks_per_node());
  }
}

}  // namespace

void launch_hybrid_dispatch(const DispatchArgs& args, cudaStream_t stream) {
  dispatch_impl_hybrid<<<args.num_sms, kThreads, 0, stream>>>(args);
  EP_CHECK_LAUNCH("ht dispatch_impl_hybrid");
}

void preload_ht_dispatch_hybrid_kernels() {
  preload_kernel(dispatch_impl_hybrid, "ht hybrid dispatch (dispatch_impl_hybrid)");
}

}  // namespace deep_ep::ht
