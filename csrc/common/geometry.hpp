// Buffer geometry: the single description of every byte of the symmetric window.
//
// The size hints, the planner (through _C) and the kernels all read these structs, so what is
// allocated, what is reported and what the kernels address cannot disagree.
//
// Window layout, identical on every rank:
//   [workspace (kWorkspaceBytes)] [data region]
//   data region = [HT region (max of dispatch and combine footprints)] [LL region]
// HT and LL use disjoint sub-regions, so interleaving the two paths never needs a cleaning step.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EP_HOST_DEVICE __host__ __device__
#else
#define EP_HOST_DEVICE
#endif

namespace deep_ep {

constexpr int64_t kWindowAlignBytes = int64_t{2} << 20;  // 2 MiB: window, workspace and regions
constexpr int64_t kSlotAlignBytes = 32;                  // TMA bulk copies need 16 B; 32 keeps rows sector aligned
constexpr int kFp8GroupSize = 128;                       // channels per fp32 scale
constexpr int kMaxRanks = 1024;
constexpr int kMaxExperts = 2048;
constexpr int kMaxTopK = 32;
constexpr int kLowLatencyMessageHeaderBytes = 16;  // int32 source token, int32 top-k slot, 8 reserved bytes

EP_HOST_DEVICE constexpr int64_t min_of(int64_t a, int64_t b) { return a < b ? a : b; }
EP_HOST_DEVICE constexpr int64_t max_of(int64_t a, int64_t b) { return a > b ? a : b; }

EP_HOST_DEVICE constexpr int64_t align_up(int64_t value, int64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// One token slot of the HT receive areas. Offsets are from the start of the slot.
struct TokenLayout {
  int64_t payload_bytes = 0;       // hidden * element bytes, aligned
  int64_t scale_offset = 0;        // fp32 scales [hidden / 128] (fp8 payload only)
  int64_t topk_idx_offset = 0;     // int32 [num_topk] global expert ids (dispatch only)
  int64_t weights_offset = 0;      // fp32 [num_topk]
  int64_t expert_slot_offset = 0;  // int32 [num_topk] rank of the token among the sender's tokens of that expert
  int64_t src_offset = 0;          // int32 source token index (dispatch only)
  int64_t bytes = 0;               // whole slot, aligned
};

// Dispatch slot: payload (bf16 or fp8), fp8 scales, then K expert ids, K weights, K per-expert slots
// (the receiver places expanded rows with them, no scan needed) and the source token index.
EP_HOST_DEVICE constexpr TokenLayout dispatch_token_layout(int hidden, bool use_fp8, int num_topk) {
  TokenLayout layout;
  layout.payload_bytes = align_up(int64_t{hidden} * (use_fp8 ? 1 : 2), kSlotAlignBytes);
  layout.scale_offset = layout.payload_bytes;
  const int64_t scale_bytes = use_fp8 ? align_up(int64_t{hidden / kFp8GroupSize} * 4, kSlotAlignBytes) : 0;
  layout.topk_idx_offset = layout.scale_offset + scale_bytes;
  layout.weights_offset = layout.topk_idx_offset + int64_t{num_topk} * 4;
  layout.expert_slot_offset = layout.weights_offset + int64_t{num_topk} * 4;
  layout.src_offset = layout.expert_slot_offset + int64_t{num_topk} * 4;
  layout.bytes = layout.topk_idx_offset + align_up(int64_t{num_topk} * 12 + 4, kSlotAlignBytes);
  return layout;
}

// Combine slot: bf16 payload then K fp32 weights (gathered into combined_topk_weights).
EP_HOST_DEVICE constexpr TokenLayout combine_token_layout(int hidden, int num_topk) {
  TokenLayout layout;
  layout.payload_bytes = align_up(int64_t{hidden} * 2, kSlotAlignBytes);
  layout.scale_offset = layout.payload_bytes;
  layout.topk_idx_offset = layout.payload_bytes;
  layout.weights_offset = layout.payload_bytes;
  layout.expert_slot_offset = layout.payload_bytes;
  layout.src_offset = layout.payload_bytes;
  layout.bytes = layout.payload_bytes + align_up(int64_t{num_topk} * 4, kSlotAlignBytes);
  return layout;
}

// Logical topology of the EP group: scale-out domains ("nodes") of scale-up ranks.
struct Topology {
  int num_ranks = 1;
  int num_scaleup_ranks = 1;  // ranks per node
  EP_HOST_DEVICE constexpr int num_scaleout_ranks() const { return num_ranks / num_scaleup_ranks; }
  EP_HOST_DEVICE constexpr bool is_hybrid() const { return num_scaleout_ranks() > 1; }
};

// Scale-out row of hybrid dispatch: the dispatch slot followed by K int32 destination slots (the
// slot at the expert's rank on the first top-k entry of that rank, else -1), so the forwarder
// copies the slot prefix unchanged into the final receive slots.
EP_HOST_DEVICE constexpr int64_t scaleout_row_bytes(int hidden, bool use_fp8, int num_topk) {
  return dispatch_token_layout(hidden, use_fp8, num_topk).bytes + align_up(int64_t{num_topk} * 4, kSlotAlignBytes);
}

// HT receive areas for one call shape. Dispatch and combine start at the same offset of the HT
// region: every HT operation begins with a cross-rank barrier, so no peer still reads what the
// next operation overwrites.
struct HighThroughputLayout {
  TokenLayout dispatch_token;
  TokenLayout combine_token;
  int64_t num_max_tokens_per_rank = 0;
  // Final dispatch receive slots, both modes: rows [source rank][T_max], the row of a token being
  // its ordinal among the source's tokens for this rank.
  int64_t dispatch_recv_offset = 0;
  int64_t dispatch_recv_bytes = 0;
  // Direct combine: rows [j][T_max], j = index of the sender among the token's distinct
  // destination ranks (ascending), so j < min(R, K). Hybrid: the forwarder's rows
  // [j][source node][T_max], j = index of the sender among the token's destination ranks on its node.
  int64_t combine_recv_offset = 0;
  int64_t combine_recv_bytes = 0;
  // Hybrid dispatch: staging (one scale-out row per own token) and the rows arriving from every
  // source node's rail peer [source node][T_max] (slot = ordinal among that source's tokens for
  // this node).
  int64_t scaleout_row_bytes = 0;
  int64_t scaleout_send_offset = 0;
  int64_t scaleout_send_bytes = 0;
  int64_t scaleout_recv_offset = 0;
  int64_t scaleout_recv_bytes = 0;
  // Hybrid combine: the forwarder's node partials staged [source node][T_max] and put to the home
  // rank's rows [node index][T_max] (index of the node among the token's nodes, ascending).
  int64_t combine_send_offset = 0;
  int64_t combine_send_bytes = 0;
  int64_t combine_partial_offset = 0;
  int64_t combine_partial_bytes = 0;
  // Direct mode, zero-copy receive (opt-in per call): the same dispatch receive area split into
  // payload rows [R * T_max][row bytes] and fp32 scale rows [R * T_max][H / 128], both in final
  // (source rank, source token) order so the outputs are views of the window, then the slots'
  // metadata (expert ids, weights, per-expert slots, source token) [source rank][T_max]. Never
  // larger than the slot layout: each part is at most its aligned share of a slot.
  int64_t zero_copy_payload_offset = 0;
  int64_t zero_copy_scales_offset = 0;
  int64_t zero_copy_meta_offset = 0;
  int64_t zero_copy_meta_bytes = 0;  // one row's metadata: the slot from topk_idx_offset on
  // Direct mode, zero-copy combine (opt-in at construction): this rank's expert outputs, written by
  // the caller in received-row order [R * T_max][hidden] bf16, and their K fp32 weights, which the
  // home ranks read (pull) instead of receiving pushed rows. After the largest (bf16) dispatch
  // receive area of the shape, so the caller may write them while it still reads a zero-copy
  // recv_x; a push combine's rows stay below it too.
  int64_t combine_input_offset = 0;
  int64_t combine_input_weights_offset = 0;
  int64_t zero_copy_combine_bytes = 0;  // footprint of a zero-copy combine (0 in hybrid mode)
  int64_t dispatch_bytes = 0;           // whole dispatch footprint
  int64_t combine_bytes = 0;            // whole combine footprint
  int64_t region_bytes = 0;             // max of the two, 2 MiB aligned
};

EP_HOST_DEVICE constexpr HighThroughputLayout high_throughput_layout(const Topology& topology,
                                                                     int64_t num_max_tokens_per_rank, int hidden,
                                                                     int num_topk, bool use_fp8) {
  HighThroughputLayout layout;
  const int64_t tokens = num_max_tokens_per_rank;
  const int64_t num_ranks = topology.num_ranks;
  layout.num_max_tokens_per_rank = tokens;
  layout.dispatch_token = dispatch_token_layout(hidden, use_fp8, num_topk);
  layout.combine_token = combine_token_layout(hidden, num_topk);
  const int64_t d = layout.dispatch_token.bytes;
  const int64_t c = layout.combine_token.bytes;
  if (!topology.is_hybrid()) {
    layout.dispatch_recv_bytes = num_ranks * tokens * d;
    layout.combine_recv_bytes = min_of(num_ranks, num_topk) * tokens * c;
    const int64_t rows = num_ranks * tokens;
    const int64_t row_bytes = int64_t{hidden} * (use_fp8 ? 1 : 2);
    const int64_t scale_row_bytes = use_fp8 ? int64_t{hidden / kFp8GroupSize} * 4 : 0;
    layout.zero_copy_payload_offset = layout.dispatch_recv_offset;
    layout.zero_copy_scales_offset = layout.zero_copy_payload_offset + align_up(rows * row_bytes, kSlotAlignBytes);
    layout.zero_copy_meta_offset = layout.zero_copy_scales_offset + align_up(rows * scale_row_bytes, kSlotAlignBytes);
    layout.zero_copy_meta_bytes = d - layout.dispatch_token.topk_idx_offset;
    const int64_t bf16_dispatch_bytes = rows * dispatch_token_layout(hidden, false, num_topk).bytes;
    layout.combine_input_offset = align_up(max_of(bf16_dispatch_bytes, layout.combine_recv_bytes), kSlotAlignBytes);
    layout.combine_input_weights_offset =
        align_up(layout.combine_input_offset + rows * int64_t{hidden} * 2, kSlotAlignBytes);
    layout.zero_copy_combine_bytes = layout.combine_input_weights_offset + rows * int64_t{num_topk} * 4;
    layout.dispatch_bytes = layout.dispatch_recv_bytes;
    layout.combine_bytes = layout.combine_recv_bytes;
  } else {
    const int64_t scaleout = topology.num_scaleout_ranks();
    const int64_t scaleup = topology.num_scaleup_ranks;
    layout.scaleout_row_bytes = deep_ep::scaleout_row_bytes(hidden, use_fp8, num_topk);
    layout.scaleout_send_bytes = tokens * layout.scaleout_row_bytes;
    layout.scaleout_recv_offset = layout.scaleout_send_bytes;
    layout.scaleout_recv_bytes = scaleout * tokens * layout.scaleout_row_bytes;
    layout.dispatch_recv_offset = layout.scaleout_recv_offset + layout.scaleout_recv_bytes;
    layout.dispatch_recv_bytes = num_ranks * tokens * d;
    layout.dispatch_bytes = layout.dispatch_recv_offset + layout.dispatch_recv_bytes;
    layout.combine_recv_bytes = min_of(scaleup, num_topk) * scaleout * tokens * c;
    layout.combine_send_offset = layout.combine_recv_bytes;
    layout.combine_send_bytes = scaleout * tokens * c;
    layout.combine_partial_offset = layout.combine_send_offset + layout.combine_send_bytes;
    layout.combine_partial_bytes = min_of(scaleout, num_topk) * tokens * c;
    layout.combine_bytes = layout.combine_partial_offset + layout.combine_partial_bytes;
  }
  layout.region_bytes = align_up(max_of(layout.dispatch_bytes, layout.combine_bytes), kWindowAlignBytes);
  return layout;
}

// LL areas: fixed slots per (local expert, source rank); kLowLatencyAreas areas used in rotation
// (operation n uses area n % 3), so a send phase never waits for a peer to start the same
// operation: the area it writes was released by every peer at the end of their previous send
// (docs/low_latency.md, "Areas and release counts"). Each area holds
//   dispatch payload  [L][R][T_ll][hidden] (sized for bf16; an fp8 call uses the first half)
//   dispatch scales   [L][R][T_ll][hidden/128] fp32
//   dispatch headers  [L][R][T_ll] x 16 B (source token, top-k slot)
//   dispatch counts   [L][R] int32 arrival cells, count+1 ("0 = not arrived"), reset to 0 by the receive
//                     kernel; dispatch: tokens of source s for local expert l; combine: rows returned by
//                     local expert l of rank s
//   combine payload   [T_ll][K][hidden] bf16: the row of (token, top-k slot k) returned by its expert
//   combine flags     [R] int64 counts, never reset: [me] = operations received on this area,
//                     [d] = operations on this area whose data rank d has released (send phases wait
//                     for it, so a rank running ahead never overwrites data a slower peer still reads);
//                     then [2] int64 (area 0 only): area and epoch of this rank's last send phase.
//                     64-bit: an int32 count would wrap after 2^31 operations on an area (about a
//                     week of serving at 10,000 LL operations per second)
//   staging           the sender's own rows: payload [T_ll][2 * hidden] (token t's bf16 row, or its
//                     fp8 row in the first half), scales [T_ll][hidden/128] fp32, headers [E][T_ll] x
//                     16 B (expert e's header block; across nodes, a transport put reads from the
//                     sender's window), flags [T_ll] int32 (fp8: token t quantised into its staging
//                     row this operation; 0 between send kernels). Per area, so operations on
//                     different areas never share it.
constexpr int kLowLatencyAreas = 3;
constexpr int kLowLatencyStateWords = 2;  // int64 {area, epoch} of the last send phase, after the flags of area 0
struct LowLatencyLayout {
  int64_t num_max_tokens = 0;
  int num_local_experts = 0;
  int num_topk = 0;
  int64_t dispatch_payload_offset = 0;
  int64_t dispatch_scales_offset = 0;
  int64_t dispatch_headers_offset = 0;
  int64_t dispatch_counts_offset = 0;
  int64_t combine_payload_offset = 0;
  int64_t combine_flags_offset = 0;
  int64_t staging_payload_offset = 0;
  int64_t staging_scales_offset = 0;
  int64_t staging_headers_offset = 0;
  int64_t staging_flags_offset = 0;
  int64_t area_bytes = 0;    // one area, 2 MiB aligned
  int64_t region_bytes = 0;  // kLowLatencyAreas areas
  EP_HOST_DEVICE constexpr int64_t area_start(int area) const { return area * area_bytes; }
};

// Bytes of one LL dispatch message as it crosses the link (payload + scales + header).
EP_HOST_DEVICE constexpr int64_t low_latency_message_bytes(int hidden, bool use_fp8) {
  return use_fp8 ? int64_t{hidden} + int64_t{hidden / kFp8GroupSize} * 4 + kLowLatencyMessageHeaderBytes
                 : int64_t{hidden} * 2 + kLowLatencyMessageHeaderBytes;
}

EP_HOST_DEVICE constexpr LowLatencyLayout low_latency_layout(int64_t num_max_tokens, int hidden, int num_ranks,
                                                             int num_experts, int num_topk) {
  LowLatencyLayout layout;
  if (num_max_tokens == 0) return layout;
  layout.num_max_tokens = num_max_tokens;
  layout.num_local_experts = num_experts / num_ranks;
  layout.num_topk = num_topk;
  const int64_t rows = int64_t{layout.num_local_experts} * num_ranks * num_max_tokens;
  int64_t offset = 0;
  layout.dispatch_payload_offset = offset;
  offset = align_up(offset + rows * hidden * 2, kSlotAlignBytes);
  layout.dispatch_scales_offset = offset;
  offset = align_up(offset + rows * (hidden / kFp8GroupSize) * 4, kSlotAlignBytes);
  layout.dispatch_headers_offset = offset;
  offset = align_up(offset + rows * kLowLatencyMessageHeaderBytes, kSlotAlignBytes);
  layout.dispatch_counts_offset = offset;
  offset = align_up(offset + int64_t{num_experts} * 4, kSlotAlignBytes);
  layout.combine_payload_offset = offset;
  offset = align_up(offset + num_max_tokens * num_topk * hidden * 2, kSlotAlignBytes);
  layout.combine_flags_offset = offset;
  offset = align_up(offset + (int64_t{num_ranks} + kLowLatencyStateWords) * 8, kSlotAlignBytes);
  layout.staging_payload_offset = offset;
  offset = align_up(offset + num_max_tokens * hidden * 2, kSlotAlignBytes);
  layout.staging_scales_offset = offset;
  offset = align_up(offset + num_max_tokens * (hidden / kFp8GroupSize) * 4, kSlotAlignBytes);
  layout.staging_headers_offset = offset;
  offset = align_up(offset + int64_t{num_experts} * num_max_tokens * kLowLatencyMessageHeaderBytes, kSlotAlignBytes);
  layout.staging_flags_offset = offset;
  offset = align_up(offset + num_max_tokens * 4, kSlotAlignBytes);
  layout.area_bytes = align_up(offset, kWindowAlignBytes);
  layout.region_bytes = kLowLatencyAreas * layout.area_bytes;
  return layout;
}

// Scale-out signals (hybrid mode). Signal ids are per receiving rank; every signal is monotonic
// (never reset): a receiver waits for "its shadow + what it expects" and then advances its shadow.
constexpr int kMaxNodes = 128;
constexpr int kMaxChannels = 64;                // hybrid dispatch streams per (source node): token ranges of the sender
constexpr int kSignalBarrier = 0;               // + source node: rail barrier arrivals
constexpr int kSignalNotify = kMaxNodes;        // + source node: notify counts message landed
constexpr int kSignalPartials = 2 * kMaxNodes;  // + source node: combine partial rows landed (row count)
constexpr int kSignalRows = 3 * kMaxNodes;      // + source node * channels + channel: dispatch rows landed
// Added once per operation to a scale-out signal by a source whose input failed: to an LL arrival
// (n + 1, no rows), and to a hybrid row stream's signal (a cached dispatch: the stream's whole row
// count, no row written; the forwarder then forwards nothing of it). Above any count such a signal
// carries: T_ll + 1 (the LL send kernel's shared-memory check keeps T_ll far below it) and a
// stream's rows <= T_max (the hybrid dispatch launcher checks T_max < this).
constexpr int64_t kFailedInputSignalFlag = int64_t{1} << 24;
// LL across nodes: arrival of (area, local expert l, source s) at l * R + s; each operation adds
// n + 1 (+ kFailedInputSignalFlag when the source's input failed) once per (l, s).
constexpr int kSignalLlArrival = kSignalRows + kMaxNodes * kMaxChannels;
// LL across nodes: + area * kMaxRanks + source: operations on that area the source has released.
constexpr int kSignalLlRelease = kSignalLlArrival + kLowLatencyAreas * kMaxExperts;
constexpr int kMaxScaleoutSignals = kSignalLlRelease + kLowLatencyAreas * kMaxRanks;
// Hybrid notify message to one node: [S rank counts][S * L expert counts][channels + 1 row prefix];
// the messages to all nodes together hold R + E + N * (channels + 1) ints, each padded to 16 bytes.
constexpr int64_t kMaxNotifyMessageInts = kMaxRanks + kMaxExperts + int64_t{kMaxNodes} * (kMaxChannels + 4);
EP_HOST_DEVICE constexpr int64_t notify_message_ints(int num_scaleup_ranks, int num_local_experts, int num_channels) {
  return num_scaleup_ranks + int64_t{num_scaleup_ranks} * num_local_experts + num_channels + 1;
}

// Workspace at the start of the window: fixed positions, independent of the call shape.
//   barrier cells   int64 [kMaxRanks]: peer p writes its barrier epoch into cell p (monotonic, never reset)
//   rank counts     int32 [kMaxRanks]: HT notify, tokens from source p, count+1 (reset to 0 after use)
//   expert counts   int32 [kMaxExperts]: HT notify, [source p][local expert l] at p*L + l, count+1
//   grid counters   int32 [kNumGridCounters]: CTA arrival counters of one kernel (reset to 0 after use)
//   scratch         int32 [kNumScratchInts]: per-kernel local scratch (reset to 0 after use)
//   grid generation int32 [kNumGridCounters]: grid-sync generations (monotonic, never reset)
//   barrier epoch   int64: this rank's last barrier epoch (local only, monotonic)
//   scale-out signals uint64 [kMaxScaleoutSignals]: the lsa transport's signal cells (monotonic)
//   signal shadows  uint64 [kMaxScaleoutSignals]: what this rank has consumed of each signal (local)
//   notify messages int32, send and receive: hybrid notify's per-node counts (scale-out transport)
//   LL published    int64 [kLowLatencyAreas][kMaxRanks]: LL across nodes, release counts signalled
//   rank send counts int32 [kMaxRanks]: HT notify (direct), tokens this rank sends to each rank
struct WorkspaceLayout {
  static constexpr int kNumGridCounters = 64;
  static constexpr int kNumScratchInts = 4 * kMaxRanks;
  static constexpr int64_t barrier_cells_offset = 0;
  static constexpr int64_t rank_counts_offset = barrier_cells_offset + int64_t{kMaxRanks} * 8;
  static constexpr int64_t expert_counts_offset = rank_counts_offset + int64_t{kMaxRanks} * 4;
  // [source rank] int32: 1 when that rank took part in the current operation without data (its
  // input failed the host checks); the receiver reads and clears it after the entry handshake.
  static constexpr int64_t input_failed_offset = expert_counts_offset + int64_t{kMaxExperts} * 4;
  // [receiver rank] int32, zero-copy receive: "row + 1" of this rank's first row in that receiver's
  // final rows (0 = not arrived), sent back by the receiver in the notify kernel; read and cleared.
  static constexpr int64_t send_base_offset = input_failed_offset + int64_t{kMaxRanks} * 4;
  // int32 per notify column (expert, rank, node): every CTA of the HT notify adds its blocks'
  // counts before the grid sync; CTA 0 reads the totals after it and clears them.
  static constexpr int64_t notify_totals_offset = send_base_offset + int64_t{kMaxRanks} * 4;
  static constexpr int64_t grid_counters_offset =
      notify_totals_offset + int64_t{kMaxExperts + kMaxRanks + kMaxNodes} * 4;
  static constexpr int64_t scratch_offset = grid_counters_offset + int64_t{kNumGridCounters} * 4;
  static constexpr int64_t grid_generations_offset = scratch_offset + int64_t{kNumScratchInts} * 4;
  static constexpr int64_t barrier_epoch_offset = grid_generations_offset + int64_t{kNumGridCounters} * 4;
  // Everything in [zero_invariant_begin, zero_invariant_end) must be zero whenever no kernel runs.
  static constexpr int64_t zero_invariant_begin = rank_counts_offset;
  static constexpr int64_t zero_invariant_end = grid_generations_offset;
  static constexpr int64_t scaleout_signals_offset = align_up(barrier_epoch_offset + 8, kSlotAlignBytes);
  static constexpr int64_t scaleout_shadows_offset = scaleout_signals_offset + int64_t{kMaxScaleoutSignals} * 8;
  static constexpr int64_t notify_send_offset = scaleout_shadows_offset + int64_t{kMaxScaleoutSignals} * 8;
  static constexpr int64_t notify_recv_offset = notify_send_offset + kMaxNotifyMessageInts * 4;
  // LL across nodes: [area][peer] int64, the release count this rank last signalled to that peer
  // for that area (signals only add: the next release adds the difference). Persistent.
  static constexpr int64_t ll_published_offset = align_up(notify_recv_offset + kMaxNotifyMessageInts * 4, 8);
  // HT notify, direct mode: int32 [destination rank], the tokens this rank sends to each rank in the
  // current uncached dispatch. Written by this rank before it releases its count cells; its peers
  // read it through their peer pointer after acquiring those cells (V1's rank prefix matrix).
  // Overwritten by every notify, never cleared: outside the zero invariant.
  static constexpr int64_t rank_send_counts_offset = ll_published_offset + int64_t{kLowLatencyAreas} * kMaxRanks * 8;
  static constexpr int64_t used_bytes = rank_send_counts_offset + int64_t{kMaxRanks} * 4;
  static constexpr int64_t bytes = align_up(used_bytes, kWindowAlignBytes);
};

// The whole window of one buffer.
struct WindowLayout {
  int64_t workspace_bytes = WorkspaceLayout::bytes;
  int64_t ht_offset = 0;
  int64_t ht_bytes = 0;
  int64_t ll_offset = 0;
  int64_t ll_bytes = 0;
  int64_t total_bytes = 0;
};

EP_HOST_DEVICE constexpr WindowLayout window_layout(int64_t ht_bytes, int64_t ll_bytes) {
  WindowLayout layout;
  layout.ht_offset = layout.workspace_bytes;
  layout.ht_bytes = align_up(ht_bytes, kWindowAlignBytes);
  layout.ll_offset = layout.ht_offset + layout.ht_bytes;
  layout.ll_bytes = align_up(ll_bytes, kWindowAlignBytes);
  layout.total_bytes = layout.ll_offset + layout.ll_bytes;
  return layout;
}

}  // namespace deep_ep
