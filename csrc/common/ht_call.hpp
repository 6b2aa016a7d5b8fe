// The description of one HT call shape that every HT kernel receives: the topology (direct or
// hybrid follows from it), the shape, and the resolved receive layout, with one accessor per
// address a kernel forms. Built once per shape on the host (bindings: ht_call) and embedded by
// value in every HT kernel's arguments, so no kernel repeats slot arithmetic of its own.
#pragma once

#include <cstdint>
#include <string>

#include "common/geometry.hpp"
#include "common/require.hpp"

namespace deep_ep {

// About four signals' worth of 32-token blocks per channel at T_max (T_max = 4096: 32 channels).
constexpr int64_t kTokensPerChannelHint = 128;

struct HtCall {
  Topology topology;
  int64_t ht_offset = 0;  // window offset of the HT region
  int hidden = 0;
  int num_topk = 0;
  int num_experts = 0;
  bool use_fp8 = false;  // the dispatch payload; combine is always bf16
  // Direct mode: senders write payload and scales into the receiver's final rows (the layout's
  // zero_copy_* parts), so the dispatch outputs are views of the window and the epilogue copies
  // metadata only. Every rank of a call must agree (like the dtype).
  bool zero_copy_recv = false;
  HighThroughputLayout layout;

  // --- topology ---
  EP_HOST_DEVICE constexpr bool hybrid() const { return topology.is_hybrid(); }
  EP_HOST_DEVICE constexpr int num_ranks() const { return topology.num_ranks; }
  EP_HOST_DEVICE constexpr int num_nodes() const { return topology.num_scaleout_ranks(); }
  EP_HOST_DEVICE constexpr int ranks_per_node() const { return topology.num_scaleup_ranks; }
  EP_HOST_DEVICE constexpr int node_of(int rank) const { return rank / topology.num_scaleup_ranks; }
  EP_HOST_DEVICE constexpr int local_index(int rank) const { return rank % topology.num_scaleup_ranks; }
  // The rank of `node` on the same rail (same local index) as `rank`: its scale-out peer there.
  EP_HOST_DEVICE constexpr int rail_peer(int rank, int node) const {
    return node * topology.num_scaleup_ranks + rank % topology.num_scaleup_ranks;
  }

  // Hybrid dispatch: scale-out row streams per sender (ranges of whole 32-token blocks). A function
  // of the shape only, so every rank (and a rank taking part without input) agrees on it.
  EP_HOST_DEVICE constexpr int num_channels() const {
    if (!hybrid()) return 0;
    const int64_t channels = (num_max_tokens() + kTokensPerChannelHint - 1) / kTokensPerChannelHint;
    return static_cast<int>(min_of(max_of(channels, 1), kMaxChannels));
  }

  // --- shape ---
  EP_HOST_DEVICE constexpr int64_t num_max_tokens() const { return layout.num_max_tokens_per_rank; }
  EP_HOST_DEVICE constexpr int num_local_experts() const { return num_experts / topology.num_ranks; }
  EP_HOST_DEVICE constexpr int rank_of_expert(int expert) const { return expert / num_local_experts(); }
  EP_HOST_DEVICE constexpr int64_t row_bytes() const { return int64_t{hidden} * (use_fp8 ? 1 : 2); }
  EP_HOST_DEVICE constexpr int num_scales() const { return use_fp8 ? hidden / kFp8GroupSize : 0; }
  EP_HOST_DEVICE constexpr const TokenLayout& dispatch_token() const { return layout.dispatch_token; }
  EP_HOST_DEVICE constexpr const TokenLayout& combine_token() const { return layout.combine_token; }

  // --- window offsets (add to a window base through DeviceView::local / peer) ---
  // Final dispatch slot `slot` of `source` (both modes).
  EP_HOST_DEVICE constexpr int64_t dispatch_slot(int source, int64_t slot) const {
    return ht_offset + layout.dispatch_recv_offset +
           (int64_t{source} * num_max_tokens() + slot) * dispatch_token().bytes;
  }
  // The metadata of the slot above, as a slot base: its topk_idx_offset.. fields are the row's. With
  // zero-copy receive the metadata lives in its own rows and the base's payload/scale fields are not
  // the row's (they are in final position: zero_copy_payload / zero_copy_scales).
  EP_HOST_DEVICE constexpr int64_t dispatch_meta_slot(int source, int64_t slot) const {
    if (!zero_copy_recv) return dispatch_slot(source, slot);
    return ht_offset + layout.zero_copy_meta_offset +
           (int64_t{source} * num_max_tokens() + slot) * layout.zero_copy_meta_bytes - dispatch_token().topk_idx_offset;
  }
  // Zero-copy receive: final row `row` (source rank, source token order) of the payload and scales.
  EP_HOST_DEVICE constexpr int64_t zero_copy_payload(int64_t row) const {
    return ht_offset + layout.zero_copy_payload_offset + row * row_bytes();
  }
  EP_HOST_DEVICE constexpr int64_t zero_copy_scales(int64_t row) const {
    return ht_offset + layout.zero_copy_scales_offset + row * num_scales() * 4;
  }
  // Zero-copy combine: this rank's expert output row `row` (received-row order) and its K weights.
  EP_HOST_DEVICE constexpr int64_t combine_input_row(int64_t row) const {
    return ht_offset + layout.combine_input_offset + row * int64_t{hidden} * 2;
  }
  EP_HOST_DEVICE constexpr int64_t combine_input_weights(int64_t row) const {
    return ht_offset + layout.combine_input_weights_offset + row * num_topk * 4;
  }
  // Combine row `row` of `token` of a source on `source_node`. Direct: rows [j][T_max] at the home
  // rank (source_node 0). Hybrid: rows [j][source node][T_max] at the forwarder.
  EP_HOST_DEVICE constexpr int64_t combine_row_slot(int row, int source_node, int64_t token) const {
    const int64_t nodes = hybrid() ? num_nodes() : 1;
    return ht_offset + layout.combine_recv_offset +
           ((int64_t{row} * nodes + source_node) * num_max_tokens() + token) * combine_token().bytes;
  }
  // Hybrid dispatch: staging row of an own token, and the row of `ordinal` from `source_node`.
  EP_HOST_DEVICE constexpr int64_t scaleout_send_slot(int64_t token) const {
    return ht_offset + layout.scaleout_send_offset + token * layout.scaleout_row_bytes;
  }
  EP_HOST_DEVICE constexpr int64_t scaleout_recv_slot(int source_node, int64_t ordinal) const {
    return ht_offset + layout.scaleout_recv_offset +
           (int64_t{source_node} * num_max_tokens() + ordinal) * layout.scaleout_row_bytes;
  }
  // Byte offset of the K destination slots inside a scale-out row.
  EP_HOST_DEVICE constexpr int64_t scaleout_dst_slot_offset() const { return dispatch_token().bytes; }
  // Hybrid combine: the forwarder's partial of `token` of `source_node`, staged, and the home
  // rank's partial row of the token's `node_index`-th node.
  EP_HOST_DEVICE constexpr int64_t partial_send_slot(int source_node, int64_t token) const {
    return ht_offset + layout.combine_send_offset +
           (int64_t{source_node} * num_max_tokens() + token) * combine_token().bytes;
  }
  EP_HOST_DEVICE constexpr int64_t partial_slot(int node_index, int64_t token) const {
    return ht_offset + layout.combine_partial_offset +
           (int64_t{node_index} * num_max_tokens() + token) * combine_token().bytes;
  }
};

inline HtCall make_ht_call(const Topology& topology, int64_t ht_offset, int64_t num_max_tokens_per_rank, int hidden,
                           int num_topk, int num_experts, bool use_fp8, bool zero_copy_recv = false) {
  HtCall call;
  call.topology = topology;
  call.ht_offset = ht_offset;
  call.hidden = hidden;
  call.num_topk = num_topk;
  call.num_experts = num_experts;
  call.use_fp8 = use_fp8;
  // The hybrid forwarders place rows in whole slots: zero-copy receive has no hybrid layout.
  EP_REQUIRE(!zero_copy_recv || !topology.is_hybrid(), "zero-copy receive is direct mode only (this buffer spans " +
                                                           std::to_string(topology.num_scaleout_ranks()) + " nodes)");
  call.zero_copy_recv = zero_copy_recv;
  call.layout = high_throughput_layout(topology, num_max_tokens_per_rank, hidden, num_topk, use_fp8);
  return call;
}

}  // namespace deep_ep
