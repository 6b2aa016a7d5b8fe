// Geometry and size hints: the byte counts the buffer, the planner and the kernels share.
#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/geometry.hpp"
#include "common/ht_call.hpp"
#include "common/sizing.hpp"
#include "kernels/high_throughput.hpp"

namespace deep_ep {
namespace {

TEST(TokenLayout, Bf16DispatchSlotHoldsPayloadAndMetadataAligned) {
  const TokenLayout layout = dispatch_token_layout(7168, /*use_fp8=*/false, 8);
  EXPECT_EQ(layout.payload_bytes, 7168 * 2);
  EXPECT_EQ(layout.scale_offset, layout.payload_bytes);
  EXPECT_EQ(layout.topk_idx_offset, layout.payload_bytes);  // no scales for bf16
  EXPECT_EQ(layout.weights_offset, layout.topk_idx_offset + 8 * 4);
  EXPECT_EQ(layout.expert_slot_offset, layout.weights_offset + 8 * 4);
  EXPECT_EQ(layout.src_offset, layout.expert_slot_offset + 8 * 4);
  // 8 ids + 8 weights + 8 expert slots + source index = 100 B, aligned to 128.
  EXPECT_EQ(layout.bytes, 7168 * 2 + 128);
  EXPECT_EQ(layout.bytes % kSlotAlignBytes, 0);
}

TEST(TokenLayout, Fp8DispatchSlotCarriesOneScalePer128Channels) {
  const TokenLayout layout = dispatch_token_layout(7168, /*use_fp8=*/true, 8);
  EXPECT_EQ(layout.payload_bytes, 7168);
  EXPECT_EQ(layout.scale_offset, 7168);
  EXPECT_EQ(layout.topk_idx_offset, 7168 + 56 * 4);  // 224 B of scales is already 32-aligned
  EXPECT_EQ(layout.bytes, 7168 + 224 + 128);
}

TEST(TokenLayout, CombineSlotIsPayloadPlusWeights) {
  const TokenLayout layout = combine_token_layout(4096, 6);
  EXPECT_EQ(layout.payload_bytes, 8192);
  EXPECT_EQ(layout.weights_offset, 8192);
  EXPECT_EQ(layout.bytes, 8192 + 32);
}

TEST(HighThroughput, DirectRegionsAreRowsPerSourceAndPerDistinctRank) {
  const HighThroughputLayout layout = high_throughput_layout(Topology{8, 8}, 4096, 7168, 8, false);
  const int64_t d = dispatch_token_layout(7168, false, 8).bytes;
  const int64_t c = combine_token_layout(7168, 8).bytes;
  EXPECT_EQ(layout.dispatch_recv_bytes, 8 * 4096 * d);
  EXPECT_EQ(layout.combine_recv_bytes, 8 * 4096 * c);  // min(R, K) = 8
  EXPECT_EQ(layout.region_bytes, align_up(std::max(8 * 4096 * d, 8 * 4096 * c), kWindowAlignBytes));
  // Combine rows per token are bounded by top-k, not by the rank count.
  const HighThroughputLayout wide = high_throughput_layout(Topology{64, 64}, 128, 7168, 4, false);
  EXPECT_EQ(wide.combine_recv_bytes, 4 * 128 * combine_token_layout(7168, 4).bytes);
}

TEST(HighThroughput, HybridAddsScaleoutStagingAndForwardedRows) {
  const HighThroughputLayout layout = high_throughput_layout(Topology{16, 8}, 1024, 2048, 8, true);
  const int64_t d = dispatch_token_layout(2048, true, 8).bytes;
  const int64_t s = d + 32;  // the row plus K = 8 int32 destination slots, 32-byte aligned
  EXPECT_EQ(scaleout_row_bytes(2048, true, 8), s);
  EXPECT_EQ(layout.scaleout_send_bytes, 1024 * s);
  EXPECT_EQ(layout.scaleout_recv_bytes, 2 * 1024 * s);
  EXPECT_EQ(layout.dispatch_recv_bytes, 16 * 1024 * d);
  EXPECT_EQ(layout.dispatch_bytes, (1 + 2) * 1024 * s + 16 * 1024 * d);
  const int64_t c = combine_token_layout(2048, 8).bytes;
  EXPECT_EQ(layout.combine_bytes, (8 * 2 + 2 + 2) * 1024 * c);  // rows [min(S,K)][N], send [N], partials [min(N,K)]
  EXPECT_EQ(layout.region_bytes % kWindowAlignBytes, 0);
}

TEST(HighThroughput, NotifyBlocksScratchAndChannelsCoverEveryToken) {
  // Arguments of make_ht_call: topology, HT offset, T_max, H, K, E, fp8.
  const HtCall direct = make_ht_call(Topology{8, 8}, 4096, 4096, 512, 8, 256, false);
  const HtCall hybrid = make_ht_call(Topology{8, 4}, 4096, 4096, 512, 8, 256, false);
  EXPECT_EQ(ht::notify_columns(direct), 256 + 8);
  EXPECT_EQ(ht::notify_columns(hybrid), 256 + 8 + 2);  // one column per node
  for (const int64_t tokens : {int64_t{0}, int64_t{1}, int64_t{31}, int64_t{32}, int64_t{33}, int64_t{4096}}) {
    const int64_t blocks = ht::notify_blocks(tokens);
    EXPECT_GE(blocks * ht::kNotifyTokensPerBlock, tokens);
    EXPECT_LT((blocks - 1) * ht::kNotifyTokensPerBlock, std::max<int64_t>(tokens, 1));
    // One row per block and the totals row.
    EXPECT_EQ(ht::notify_scratch_ints(direct, tokens), (blocks + 1) * ht::notify_columns(direct));
    for (const int channels : {1, 3, 64}) {
      // Channels are whole blocks and together hold every token.
      const int64_t per_channel = ht::channel_tokens(tokens, channels);
      EXPECT_EQ(per_channel % ht::kNotifyTokensPerBlock, 0);
      EXPECT_GE(per_channel * channels, tokens);
    }
  }
}

TEST(HtCall, DirectAndHybridAddressesFollowTheLayout) {
  const HtCall direct = make_ht_call(Topology{8, 8}, 4096, 64, 512, 4, 16, false);
  const int64_t d = direct.dispatch_token().bytes;
  const int64_t c = direct.combine_token().bytes;
  EXPECT_FALSE(direct.hybrid());
  EXPECT_EQ(direct.num_channels(), 0);
  EXPECT_EQ(direct.dispatch_slot(3, 5), 4096 + (3 * 64 + 5) * d);
  EXPECT_EQ(direct.combine_row_slot(2, 0, 7), 4096 + (2 * 64 + 7) * c);

  const HtCall hybrid = make_ht_call(Topology{8, 4}, 4096, 64, 512, 4, 16, false);
  const HighThroughputLayout& layout = hybrid.layout;
  EXPECT_TRUE(hybrid.hybrid());
  EXPECT_EQ(hybrid.num_nodes(), 2);
  EXPECT_EQ(hybrid.rail_peer(1, 1), 5);
  EXPECT_EQ(hybrid.rail_peer(6, 0), 2);
  EXPECT_EQ(hybrid.num_channels(), 1);  // 64 tokens: one channel of 128
  EXPECT_EQ(hybrid.dispatch_slot(3, 5), 4096 + layout.dispatch_recv_offset + (3 * 64 + 5) * d);
  EXPECT_EQ(hybrid.scaleout_recv_slot(1, 9), 4096 + layout.scaleout_recv_offset + (64 + 9) * layout.scaleout_row_bytes);
  EXPECT_EQ(hybrid.combine_row_slot(2, 1, 7), 4096 + ((2 * 2 + 1) * 64 + 7) * c);
  EXPECT_EQ(hybrid.partial_slot(1, 3), 4096 + layout.combine_partial_offset + (64 + 3) * c);
  // Every hybrid area stays inside its footprint.
  EXPECT_LE(hybrid.scaleout_send_slot(63) + layout.scaleout_row_bytes - 4096, layout.scaleout_recv_offset);
  EXPECT_LE(hybrid.dispatch_slot(7, 63) + d - 4096, layout.dispatch_bytes);
  EXPECT_LE(hybrid.partial_slot(1, 63) + c - 4096, layout.combine_bytes);
  EXPECT_EQ(make_ht_call(Topology{8, 4}, 0, 100000, 512, 4, 16, false).num_channels(), kMaxChannels);
}

TEST(HtCall, ZeroCopyReceiveRowsFitTheSlotAreaAndKeepMetadataApart) {
  // fp8 and bf16, hidden sizes with and without slack in the slot alignment, odd T_max.
  for (const bool fp8 : {true, false}) {
    for (const int hidden : {128, 2048, 7168, 7184}) {
      if (fp8 && hidden % kFp8GroupSize != 0) continue;
      const HtCall call = make_ht_call(Topology{8, 8}, 4096, 37, hidden, 8, 64, fp8, true);
      const HighThroughputLayout& layout = call.layout;
      const TokenLayout& token = call.dispatch_token();
      const int64_t rows = 8 * 37;
      ASSERT_TRUE(call.zero_copy_recv);
      // Payload rows, then scale rows, then metadata: disjoint, and inside the slot area (no growth).
      EXPECT_EQ(call.zero_copy_payload(0), 4096 + layout.dispatch_recv_offset);
      EXPECT_EQ(call.zero_copy_payload(5) - call.zero_copy_payload(4), call.row_bytes());
      EXPECT_LE(call.zero_copy_payload(rows), call.zero_copy_scales(0));
      EXPECT_EQ(call.zero_copy_scales(1) - call.zero_copy_scales(0), call.num_scales() * 4);
      EXPECT_LE(call.zero_copy_scales(rows), 4096 + layout.zero_copy_meta_offset);
      EXPECT_EQ(call.dispatch_meta_slot(0, 0) + token.topk_idx_offset, 4096 + layout.zero_copy_meta_offset);
      EXPECT_EQ(call.dispatch_meta_slot(7, 36) + token.bytes - 4096,
                layout.zero_copy_meta_offset + rows * layout.zero_copy_meta_bytes);
      EXPECT_LE(layout.zero_copy_meta_offset + rows * layout.zero_copy_meta_bytes,
                layout.dispatch_recv_offset + layout.dispatch_recv_bytes);
      EXPECT_EQ(layout.dispatch_bytes, layout.dispatch_recv_bytes);
      // Metadata rows keep 16-byte alignment; the copy layout is unchanged.
      EXPECT_EQ((call.dispatch_meta_slot(3, 5) + token.topk_idx_offset) % 16, 0);
      const HtCall copy = make_ht_call(Topology{8, 8}, 4096, 37, hidden, 8, 64, fp8, false);
      EXPECT_EQ(copy.dispatch_meta_slot(3, 5), copy.dispatch_slot(3, 5));
    }
  }
  EXPECT_THROW(make_ht_call(Topology{8, 4}, 4096, 37, 2048, 8, 64, false, true), std::invalid_argument);
}

TEST(HtCall, ZeroCopyCombineInputLiesAboveEveryDispatchAndPushCombineArea) {
  for (const int ranks : {2, 8, 16}) {
    for (const int topk : {1, 4, 8}) {
      const HtCall call = make_ht_call(Topology{ranks, ranks}, 4096, 37, 2048, topk, 64, false);
      const HighThroughputLayout& layout = call.layout;
      const HighThroughputLayout fp8 = high_throughput_layout(Topology{ranks, ranks}, 37, 2048, topk, true);
      const int64_t rows = int64_t{ranks} * 37;
      // Above the bf16 and fp8 receive areas (a zero-copy recv_x may be read while outputs are
      // written) and above the push combine's rows.
      EXPECT_GE(layout.combine_input_offset, layout.dispatch_recv_offset + layout.dispatch_recv_bytes);
      EXPECT_GE(layout.combine_input_offset, fp8.dispatch_recv_offset + fp8.dispatch_recv_bytes);
      EXPECT_GE(layout.combine_input_offset, layout.combine_recv_offset + layout.combine_recv_bytes);
      EXPECT_EQ(call.combine_input_row(1) - call.combine_input_row(0), 2048 * 2);
      EXPECT_GE(layout.combine_input_weights_offset, layout.combine_input_offset + rows * 2048 * 2);
      EXPECT_EQ(call.combine_input_weights(1) - call.combine_input_weights(0), topk * 4);
      EXPECT_EQ(layout.zero_copy_combine_bytes, layout.combine_input_weights_offset + rows * topk * 4);
      EXPECT_EQ(layout.combine_input_offset % 16, 0);
      EXPECT_EQ(layout.combine_input_weights_offset % 16, 0);
    }
  }
  // Sized only on request, direct mode only.
  const HighThroughputRequest plain{8, 8, 128, 7168, 8, false};
  HighThroughputRequest zero_copy = plain;
  zero_copy.zero_copy_combine = true;
  const HighThroughputLayout with = high_throughput_layout(zero_copy);
  EXPECT_LT(high_throughput_layout(plain).region_bytes, with.zero_copy_combine_bytes);
  EXPECT_GE(with.region_bytes, with.zero_copy_combine_bytes);
  EXPECT_EQ(with.region_bytes % kWindowAlignBytes, 0);
  HighThroughputRequest hybrid = zero_copy;
  hybrid.num_scaleup_ranks = 4;
  EXPECT_THROW(high_throughput_layout(hybrid), std::invalid_argument);
}

TEST(LowLatency, PlannerExampleMessageAndReceiveSlots) {
  // 64 ranks, 256 experts, 128 tokens, hidden 7168, fp8: 7408 B messages, 4*64*128 slots.
  EXPECT_EQ(low_latency_message_bytes(7168, true), 7408);
  EXPECT_EQ(low_latency_message_bytes(7168, false), 7168 * 2 + 16);
  EXPECT_EQ(int64_t{4} * 64 * 128 * low_latency_message_bytes(7168, true), 242745344);
}

TEST(LowLatency, AreaHoldsEverySectionInOrderAndAligned) {
  const LowLatencyLayout layout = low_latency_layout(128, 7168, 8, 256, 8);
  const int64_t rows = 32 * 8 * 128;
  EXPECT_EQ(layout.num_local_experts, 32);
  EXPECT_EQ(layout.dispatch_payload_offset, 0);
  EXPECT_EQ(layout.dispatch_scales_offset, rows * 7168 * 2);
  EXPECT_EQ(layout.dispatch_headers_offset, layout.dispatch_scales_offset + rows * 56 * 4);
  EXPECT_EQ(layout.dispatch_counts_offset, layout.dispatch_headers_offset + rows * 16);
  EXPECT_EQ(layout.combine_payload_offset, layout.dispatch_counts_offset + 256 * 4);
  EXPECT_EQ(layout.combine_flags_offset, layout.combine_payload_offset + 128 * 8 * 7168 * 2);
  EXPECT_GE(layout.area_bytes, layout.combine_flags_offset + (8 + kLowLatencyStateWords) * 8);
  EXPECT_EQ(layout.area_bytes % kWindowAlignBytes, 0);
  EXPECT_EQ(layout.region_bytes, kLowLatencyAreas * layout.area_bytes);
  EXPECT_EQ(layout.area_start(2), 2 * layout.area_bytes);
  EXPECT_EQ(layout.area_start(1), layout.area_bytes);
}

// The staging block (payload [T][2H], scales [T][H/128], headers [E][T], flags [T]) ends each
// area, 16-byte aligned (transport puts move 16-byte vectors).
TEST(LowLatency, StagingBlockEndsTheAreaAligned) {
  const LowLatencyLayout layout = low_latency_layout(128, 7168, 8, 256, 8);
  EXPECT_GE(layout.staging_payload_offset, layout.combine_flags_offset + (8 + kLowLatencyStateWords) * 8);
  EXPECT_GE(layout.staging_scales_offset, layout.staging_payload_offset + int64_t{128} * 7168 * 2);
  EXPECT_GE(layout.staging_headers_offset, layout.staging_scales_offset + int64_t{128} * 56 * 4);
  EXPECT_GE(layout.staging_flags_offset,
            layout.staging_headers_offset + int64_t{256} * 128 * kLowLatencyMessageHeaderBytes);
  EXPECT_LE(layout.staging_flags_offset + int64_t{128} * 4, layout.area_bytes);
  for (const int64_t offset : {layout.staging_payload_offset, layout.staging_scales_offset,
                               layout.staging_headers_offset, layout.staging_flags_offset}) {
    EXPECT_EQ(offset % 16, 0);
  }
}

// The LL signal ids follow hybrid mode's, the whole range fits NCCL's proxy backend (16-bit ids),
// and the failed-input flag lies above any arrival count.
TEST(ScaleoutSignals, LowLatencyIdsFollowHybridAndFit) {
  EXPECT_EQ(kSignalLlArrival, kSignalRows + kMaxNodes * kMaxChannels);
  EXPECT_EQ(kSignalLlRelease, kSignalLlArrival + kLowLatencyAreas * kMaxExperts);
  EXPECT_EQ(kMaxScaleoutSignals, kSignalLlRelease + kLowLatencyAreas * kMaxRanks);
  EXPECT_LT(kMaxScaleoutSignals, 1 << 16);
  EXPECT_GT(kFailedInputSignalFlag, int64_t{1} << 16);
  EXPECT_LE(WorkspaceLayout::ll_published_offset + int64_t{kLowLatencyAreas} * kMaxRanks * 8, WorkspaceLayout::bytes);
  EXPECT_EQ(WorkspaceLayout::ll_published_offset % 8, 0);  // int64 counts, 64-bit atomics
}

TEST(LowLatency, EmptyWhenNotRequested) { EXPECT_EQ(low_latency_layout(0, 7168, 8, 256, 8).region_bytes, 0); }

TEST(Workspace, ZeroInvariantRangeCoversCountersNotEpochs) {
  EXPECT_GT(WorkspaceLayout::zero_invariant_begin, WorkspaceLayout::barrier_cells_offset);
  EXPECT_LE(WorkspaceLayout::zero_invariant_end, WorkspaceLayout::grid_generations_offset);
  // The zero-copy send-base cells are cleared on read: inside the zero invariant.
  EXPECT_GE(WorkspaceLayout::send_base_offset, WorkspaceLayout::zero_invariant_begin);
  EXPECT_LE(WorkspaceLayout::send_base_offset + int64_t{kMaxRanks} * 4, WorkspaceLayout::zero_invariant_end);
  // The notify's send-count row is overwritten, never cleared: outside it, and inside the workspace.
  EXPECT_GE(WorkspaceLayout::rank_send_counts_offset, WorkspaceLayout::zero_invariant_end);
  EXPECT_LE(WorkspaceLayout::rank_send_counts_offset + int64_t{kMaxRanks} * 4, WorkspaceLayout::used_bytes);
  EXPECT_LT(WorkspaceLayout::barrier_epoch_offset + 8, WorkspaceLayout::bytes + 1);
  EXPECT_EQ(WorkspaceLayout::bytes % kWindowAlignBytes, 0);
}

TEST(Window, RegionsFollowTheWorkspaceAligned) {
  const WindowLayout layout = window_layout(3 * kWindowAlignBytes + 5, kWindowAlignBytes);
  EXPECT_EQ(layout.ht_offset, WorkspaceLayout::bytes);
  EXPECT_EQ(layout.ht_bytes, 4 * kWindowAlignBytes);
  EXPECT_EQ(layout.ll_offset, layout.ht_offset + layout.ht_bytes);
  EXPECT_EQ(layout.total_bytes, WorkspaceLayout::bytes + 5 * kWindowAlignBytes);
}

TEST(Sizing, DefaultTopKSizesForTheMaximum) {
  EXPECT_EQ(resolve_high_throughput_topk(0), kMaxTopK);
  EXPECT_EQ(resolve_low_latency_topk(0, 16), 16);
  EXPECT_EQ(resolve_low_latency_topk(0, 256), kMaxTopK);
  EXPECT_EQ(resolve_low_latency_topk(6, 256), 6);
}

TEST(Sizing, RejectsBadRequestsNamingTheArgument) {
  const auto message = [](auto&& call) {
    try {
      call();
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] {
              high_throughput_layout(HighThroughputRequest{0, 1, 128, 7168, 8, false});
            }).find("num_ranks"),
            std::string::npos);
  EXPECT_NE(message([] {
              high_throughput_layout(HighThroughputRequest{8, 3, 128, 7168, 8, false});
            }).find("num_ranks_per_node"),
            std::string::npos);
  EXPECT_NE(message([] {
              high_throughput_layout(HighThroughputRequest{8, 8, 128, 7000, 8, true});
            }).find("hidden"),
            std::string::npos);
  EXPECT_NE(message([] {
              high_throughput_layout(HighThroughputRequest{8, 8, 128, 7168, 40, false});
            }).find("num_topk"),
            std::string::npos);
  EXPECT_NE(message([] {
              low_latency_layout(LowLatencyRequest{8, 128, 7168, 260, 8});
            }).find("num_experts"),
            std::string::npos);
  EXPECT_NE(message([] {
              low_latency_layout(LowLatencyRequest{8, 128, 7000, 256, 8});
            }).find("hidden"),
            std::string::npos);
}

TEST(Sizing, BufferWindowMatchesItsParts) {
  const HighThroughputRequest ht{8, 8, 4096, 7168, 8, true};
  const LowLatencyRequest ll{8, 128, 7168, 256, 8};
  const WindowLayout window = buffer_window(ht, ll);
  EXPECT_EQ(window.ht_bytes, high_throughput_layout(ht).region_bytes);
  EXPECT_EQ(window.ll_bytes, low_latency_layout(ll).region_bytes);
  EXPECT_EQ(window.total_bytes, WorkspaceLayout::bytes + window.ht_bytes + window.ll_bytes);
}

}  // namespace
}  // namespace deep_ep
