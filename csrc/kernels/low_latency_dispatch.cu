// Low-latency dispatch: every (token, selected expert) message goes straight into the receiver's
// slot for (that expert, this rank); the receive slots *are* recv_x [L, R * T_ll, H], so the
// receive phase only waits for the counts.
//
// Send phase. Each CTA stages this rank's routing in shared memory once, then takes experts in
// rounds of up to one expert per warp. Per round: each warp lists, in token order, the tokens that
// selected its expert (slot = ordinal: deterministic, no atomics); all warps then copy the listed
// rows into the destination's slots with a 16-byte header {source token, top-k slot} (bf16 straight
// from x; fp8 from the token's staging row, which the first warp to need the token quantises: each
// token is quantised once per call, not once per selected expert); finally one thread per expert
// publishes count + 1 into the destination's arrival cell [l][me] with a system-scope release
// covering the whole round.
// Experts nobody selected still publish (count 0 -> 1), so the receiver waits for every cell.
//
// Across nodes (kScaleout): a destination on another node gets the row through the scale-out
// transport. The warp stages the token's message (bf16, or its fp8 row, quantised once) in its row
// of this area's staging block and the row's header in the expert's header block, then puts the
// payload (and the scales); after the round one warp per expert puts the header block and the CTA
// adds count + 1 to the destination's arrival signal, which covers every put of the CTA before it.
// Several warps may stage the same bf16 token at once (it selected several experts): they write
// the same bytes.
// With the lsa transport the rows and headers are stored straight into the peer instead (as within
// a node); only the arrival goes through the transport.
//
// One kernel function, ll_dispatch_kernel, runs the phases its LowLatencyPhases argument names:
// both in one launch (no receive hook), or the send phase and later, launched again by the hook,
// the receive phase. Both phases use the launch's dynamic shared memory (the send phase's routing
// and token lists, then the receive phase's prefix of the counts): a CTA receives only after its
// send phase is over, so one buffer of the larger size serves both.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/require.hpp"
#include "kernels/fp8.cuh"
#include "kernels/low_latency.hpp"
#include "kernels/phase_clock.cuh"
#include "kernels/preload.hpp"
#include "kernels/ptx.cuh"
#include "kernels/routing.cuh"
#include "kernels/timeout.cuh"

namespace deep_ep {
namespace {

constexpr int kWarps = kLowLatencyThreads / 32;
constexpr int kSlotBits = 5;  // top-k slot in the low bits of a list entry (K <= kMaxTopK = 32)
static_assert(kMaxTopK <= (1 << kSlotBits), "top-k slot must fit in a list entry");
constexpr int kBf16Unroll = 16;  // 16-byte vectors in flight per lane
constexpr int kFp8Unroll = 8;    // 128-channel group pairs in flight per warp

// The launch's dynamic shared memory, shared by the phases (see the file comment).
__device__ __forceinline__ uint8_t* dynamic_shared() {
  extern __shared__ __align__(16) uint8_t shared[];
  return shared;
}

__device__ __forceinline__ void send_bf16_row(const LowLatencyDispatchArgs& args, int dest, int64_t row, int token,
                                              int lane) {
  const int num_vectors = args.hidden / 8;
  const auto* src = reinterpret_cast<const int4*>(args.x) + int64_t{token} * num_vectors;
  int4* dst = args.view.peer<int4>(dest, args.area_offset + args.layout.dispatch_payload_offset) + row * num_vectors;
  low_latency::warp_copy_row<kBf16Unroll>(dst, src, num_vectors, lane);
}

// Token `token`'s bf16 row into its staging row (this rank's window), with plain stores: a put of
// the same warp (or, lsa-deferred, of the CTA after its barrier) reads it back.
__device__ __forceinline__ void stage_bf16_row(const LowLatencyDispatchArgs& args, int token, int lane) {
  const int num_vectors = args.hidden / 8;
  const auto* src = reinterpret_cast<const int4*>(args.x) + int64_t{token} * num_vectors;
  int4* dst =
      args.view.local<int4>(args.area_offset + args.layout.staging_payload_offset) + int64_t{token} * num_vectors;
  for (int index = lane; index < num_vectors; index += 32) dst[index] = ptx::ld_nc_v4(src + index);
}

// The payload area is sized for bf16; fp8 rows use its first half with row stride H bytes, so the
// receiver's view is a plain [L, R * T_ll, H] fp8 tensor. Each half-warp owns one 128-channel group
// (16 lanes x 8 channels); its amax is reduced with shuffles inside the half-warp.
__device__ __forceinline__ void write_fp8_row(const LowLatencyDispatchArgs& args, int token, uint8_t* dst,
                                              float* dst_scales, int lane) {
  const int num_groups = args.hidden / kFp8GroupSize;
  const auto* src = reinterpret_cast<const int4*>(args.x) + int64_t{token} * (args.hidden / 8);
  const int half = lane / 16;
  const int sub = lane % 16;
  for (int first = 0; first < num_groups; first += 2 * kFp8Unroll) {
    int4 packed[kFp8Unroll];
#pragma unroll
    for (int u = 0; u < kFp8Unroll; ++u) {
      const int group = first + 2 * u + half;
      packed[u] = group < num_groups ? ptx::ld_nc_v4(src + group * 16 + sub) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kFp8Unroll; ++u) {
      const int group = first + 2 * u + half;
      const fp8::Channels8 channels = fp8::widen_bf16x8(packed[u]);
      float amax = fp8::abs_max(channels);
#pragma unroll
      for (int offset = 8; offset >= 1; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      if (group < num_groups) {
        float inv_scale = 0.0f;
        float scale = 0.0f;
        if (args.round_scale) {
          const int exponent = fp8::pow2_scale_exponent(amax);
          inv_scale = fp8::exp2_exact(-exponent);
          scale = fp8::exp2_exact(exponent);
        } else {
          inv_scale = fp8::inverse_scale(amax);
          scale = fp8::scale(amax);
        }
        *reinterpret_cast<uint2*>(dst + group * kFp8GroupSize + sub * 8) = fp8::quantise8(channels, inv_scale);
        if (sub == 0) dst_scales[group] = scale;
      }
    }
  }
}

// Token `token` quantised into its staging row (fp8 in the first `hidden` bytes) and scales, once
// per call: the first warp to need the token claims its flag (0 -> 1), quantises and publishes 2
// (release; only warps of this launch read it, so GPU scope); a warp that finds it claimed waits
// for 2. The claimer is a running warp with nothing to wait for, so the wait always ends. The
// kernel's last CTA sets the flags back to 0. Warp-collective.
__device__ __forceinline__ void stage_fp8_once(const LowLatencyDispatchArgs& args, int token, int lane) {
  const int num_groups = args.hidden / kFp8GroupSize;
  const LowLatencyLayout& layout = args.layout;
  int32_t* flag = args.view.local<int32_t>(args.area_offset + layout.staging_flags_offset) + token;
  int state = 0;
  if (lane == 0) state = atomicCAS(flag, 0, 1);
  state = __shfl_sync(0xffffffffu, state, 0);
  if (state == 0) {
    auto* dst =
        args.view.local<uint8_t>(args.area_offset + layout.staging_payload_offset) + int64_t{token} * 2 * args.hidden;
    auto* dst_scales =
        args.view.local<float>(args.area_offset + layout.staging_scales_offset) + int64_t{token} * num_groups;
    write_fp8_row(args, token, dst, dst_scales, lane);
    __syncwarp();  // every lane's row bytes before lane 0's release
    if (lane == 0) ptx::st_release_gpu(flag, 2);
  } else if (lane == 0) {
    while (ptx::ld_acquire_gpu(flag) != 2) {
    }
  }
  __syncwarp();
}

// fp8 message of `token` into `dest`'s receive row `row`. `quantise_here`: quantised by this warp
// straight into the row (see send_rounds); otherwise copied from the token's staging row (payload
// and scales, quantised once per call) with 16-byte stores (the scales too when H is a multiple of 512).
__device__ __forceinline__ void send_fp8_row(const LowLatencyDispatchArgs& args, int dest, int64_t row, int token,
                                             bool quantise_here, int lane) {
  const int num_groups = args.hidden / kFp8GroupSize;
  const LowLatencyLayout& layout = args.layout;
  if (quantise_here) {
    uint8_t* payload = args.view.peer<uint8_t>(dest, args.area_offset + layout.dispatch_payload_offset);
    float* scales = args.view.peer<float>(dest, args.area_offset + layout.dispatch_scales_offset);
    write_fp8_row(args, token, payload + row * args.hidden, scales + row * num_groups, lane);
    return;
  }
  stage_fp8_once(args, token, lane);
  const auto* src =
      args.view.local<const int4>(args.area_offset + layout.staging_payload_offset) + int64_t{token} * args.hidden / 8;
  int4* dst = args.view.peer<int4>(dest, args.area_offset + layout.dispatch_payload_offset) + row * args.hidden / 16;
  low_latency::warp_copy_row<kFp8Unroll, true>(dst, src, args.hidden / 16, lane);
  const float* src_scales =
      args.view.local<const float>(args.area_offset + layout.staging_scales_offset) + int64_t{token} * num_groups;
  float* dst_scales = args.view.peer<float>(dest, args.area_offset + layout.dispatch_scales_offset) + row * num_groups;
  if (num_groups % 4 == 0) {
    // Rows of G fp32 scales are then 16-byte aligned too (the window's scale blocks are).
    for (int index = lane; index < num_groups / 4; index += 32) {
      ptx::st_na_v4(reinterpret_cast<int4*>(dst_scales) + index,
                    __ldcg(reinterpret_cast<const int4*>(src_scales) + index));
    }
  } else {
    for (int group = lane; group < num_groups; group += 32) dst_scales[group] = __ldcg(src_scales + group);
  }
}

// Across nodes: row `row` of expert `expert` (its i-th token, `entry`) to `dest` through the
// transport: stage the message and the header, put payload and scales. Warp-collective.
template <bool kUseFp8>
__device__ __forceinline__ void put_row(const LowLatencyDispatchArgs& args, scaleout::Transport& transport, int dest,
                                        int expert, int i, int64_t row, int32_t entry, int lane) {
  const LowLatencyLayout& layout = args.layout;
  const int token = entry >> kSlotBits;
  if constexpr (kUseFp8) {
    stage_fp8_once(args, token, lane);
  } else {
    stage_bf16_row(args, token, lane);
  }
  if (lane == 0) {
    int4* header = args.view.local<int4>(args.area_offset + layout.staging_headers_offset) +
                   int64_t{expert} * layout.num_max_tokens + i;
    *header = make_int4(token, entry & ((1 << kSlotBits) - 1), 0, 0);
  }
  const int64_t payload_bytes = kUseFp8 ? int64_t{args.hidden} : int64_t{args.hidden} * 2;
  transport.put(dest, args.area_offset + layout.dispatch_payload_offset + row * payload_bytes,
                args.area_offset + layout.staging_payload_offset + int64_t{token} * 2 * args.hidden, payload_bytes);
  if constexpr (kUseFp8) {
    const int64_t scale_bytes = int64_t{args.hidden / kFp8GroupSize} * 4;  // a multiple of 16 (launcher check)
    transport.put(dest, args.area_offset + layout.dispatch_scales_offset + row * scale_bytes,
                  args.area_offset + layout.staging_scales_offset + int64_t{token} * scale_bytes, scale_bytes);
  }
}

// One round of the dispatch send phase (after the area gate): the experts round.base + j *
// round.stride (j < experts_per_round); see the file comment.
template <bool kUseFp8, bool kScaleout>
__device__ __forceinline__ void send_round(const LowLatencyDispatchArgs& args, const int16_t* expert_ids,
                                           int32_t* lists, int* list_sizes, int experts_per_round,
                                           low_latency::SendRound round, scaleout::Transport& transport,
                                           const scaleout::WarpGroup& group) {
  const DeviceView& view = args.view;
  const LowLatencyLayout& layout = args.layout;
  const int num_tokens = args.num_tokens;
  const int num_topk = args.num_topk;
  const int num_ranks = view.num_ranks;
  const int num_local = layout.num_local_experts;
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);

  const auto expert_of = [&](int j) { return round.base + j * round.stride; };
  if (warp < experts_per_round) {
    const int expert = expert_of(warp);
    int count = 0;
    if (expert < args.num_experts) {
      int32_t* list = lists + warp * num_tokens;
      int slot = 0;
      count = warp_enumerate_in_token_order(
          num_tokens,
          [&](int token) {
            for (int k = 0; k < num_topk; ++k) {
              if (expert_ids[token * num_topk + k] == expert) {
                slot = k;
                return true;
              }
            }
            return false;
          },
          [&](int token, int ordinal) { list[ordinal] = (token << kSlotBits) | slot; });
    }
    if (lane == 0) list_sizes[warp] = count;
  }
  __syncthreads();
  clock_phase(view, ClockedKernel::kLlDispatchSend, 2);

  // Rows of the round go round-robin over all warps, so a hot expert does not serialise on one.
  int rows_before = 0;
  for (int j = 0; j < experts_per_round; ++j) {
    const int expert = expert_of(j);
    if (expert >= args.num_experts) break;
    const int count = list_sizes[j];
    const int dest = expert / num_local;
    // Receive slot of (local expert l, source me): rows [(l * R + me) * T_ll, + count).
    const int64_t first_row = (int64_t{expert % num_local} * num_ranks + view.rank) * layout.num_max_tokens;
    // A masked destination gets nothing (warps may disagree when it is masked meanwhile: harmless).
    const int first_i = peer_masked(args.rank_mask, dest) ? count : ((warp - rows_before) % kWarps + kWarps) % kWarps;
    // lsa puts are plain stores anyway: store straight into the peer as within a node (no staging
    // write and re-read); the arrival signal covers these stores as it covers a put.
    const bool remote = kScaleout && low_latency::via_transport(view, dest) && !low_latency::stores_directly(view);
    // When the call has at most one row per warp of the grid, each row's warp quantises the token
    // itself: the warps work in parallel anyway, and the shared staging row would put a store, a
    // fence, another warp's flag wait and a reload between x and the destination. Same bytes.
    const bool quantise_here = int64_t{num_tokens} * num_topk <= int64_t{gridDim.x} * kWarps;
    for (int i = first_i; i < count; i += kWarps) {
      const int32_t entry = lists[j * num_tokens + i];
      const int token = entry >> kSlotBits;
      const int64_t row = first_row + i;
      if (remote) {
        put_row<kUseFp8>(args, transport, dest, expert, i, row, entry, lane);
        continue;
      }
      if constexpr (kUseFp8) {
        send_fp8_row(args, dest, row, token, quantise_here, lane);
      } else {
        send_bf16_row(args, dest, row, token, lane);
      }
      if (lane == 0) {
        int4* header = view.peer<int4>(dest, args.area_offset + layout.dispatch_headers_offset) + row;
        ptx::st_na_v4(header, make_int4(token, entry & ((1 << kSlotBits) - 1), 0, 0));
      }
    }
    rows_before += count;
  }
  __syncthreads();
  clock_phase(view, ClockedKernel::kLlDispatchSend, 3);

  if constexpr (kScaleout) {
    // Header blocks (one warp per expert), then one arrival signal per expert: the CTA is the
    // group, so each signal covers the puts every warp of the CTA issued to that peer. Whether
    // an expert's rank gets a signal is decided once (a mask may change meanwhile, and every
    // thread must take part in the same signals).
    __shared__ int signal_expert[kWarps];
    if (static_cast<int>(threadIdx.x) < experts_per_round) {
      const int expert = expert_of(threadIdx.x);
      signal_expert[threadIdx.x] = expert < args.num_experts && low_latency::via_transport(view, expert / num_local) &&
                                   !peer_masked(args.rank_mask, expert / num_local);
    }
    __syncthreads();
    for (int j = warp; j < experts_per_round; j += kWarps) {
      if (signal_expert[j] == 0 || list_sizes[j] == 0 || low_latency::stores_directly(view)) continue;
      const int expert = expert_of(j);
      const int dest = expert / num_local;
      const int64_t first_row = (int64_t{expert % num_local} * num_ranks + view.rank) * layout.num_max_tokens;
      transport.put(dest, args.area_offset + layout.dispatch_headers_offset + first_row * kLowLatencyMessageHeaderBytes,
                    args.area_offset + layout.staging_headers_offset +
                        int64_t{expert} * layout.num_max_tokens * kLowLatencyMessageHeaderBytes,
                    int64_t{list_sizes[j]} * kLowLatencyMessageHeaderBytes);
    }
    transport.signal_each(group, experts_per_round, [&](int j) {
      if (signal_expert[j] == 0) return scaleout::SignalItem{};
      const int expert = expert_of(j);
      const uint64_t add = static_cast<uint64_t>(list_sizes[j]) + 1 +
                           (args.input_failed ? static_cast<uint64_t>(kFailedInputSignalFlag) : 0);
      return scaleout::SignalItem{expert / num_local,
                                  low_latency::arrival_signal(view, args.area, expert % num_local, view.rank), add};
    });
  }
  if (static_cast<int>(threadIdx.x) < experts_per_round) {
    const int expert = expert_of(threadIdx.x);
    if (expert < args.num_experts && !peer_masked(args.rank_mask, expert / num_local) &&
        !(kScaleout && low_latency::via_transport(view, expert / num_local))) {
      // The fence orders every row the CTA wrote this round (seen through the __syncthreads)
      // before the count, which a strong store after it releases (a release store would fence a
      // second time); the receiver's acquire of the count then covers them.
      ptx::fence_acq_rel_sys();
      ptx::st_relaxed_sys(
          low_latency::arrival_cell(view, expert / num_local, layout, args.area_offset, expert % num_local, view.rank),
          low_latency::arrival_value(list_sizes[threadIdx.x], args.input_failed));
    }
  }
  __syncthreads();  // lists and list_sizes are rewritten by the next round
  clock_phase(view, ClockedKernel::kLlDispatchSend, 4);
}

// The send phase (see the file comment); rounds of experts_per_round experts, claimed by running
// CTAs (low_latency::next_send_round says why).
template <bool kUseFp8, bool kScaleout>
__device__ __forceinline__ void send_phase(const LowLatencyDispatchArgs& args, int experts_per_round) {
  uint8_t* shared = dynamic_shared();
  __shared__ int list_sizes[kWarps];
  const DeviceView& view = args.view;
  const LowLatencyLayout& layout = args.layout;
  const int num_tokens = args.num_tokens;
  const int num_topk = args.num_topk;
  // [T * K] expert ids (validated: an out-of-range or repeated id is recorded and becomes -1), then one list
  // of (token << kSlotBits | slot) per expert of the round.
  auto* expert_ids = reinterpret_cast<int16_t*>(shared);
  auto* lists = reinterpret_cast<int32_t*>(shared + align_up(int64_t{num_tokens} * num_topk * 2, 16));

  const int64_t epoch = low_latency::send_epoch(view, layout, args.area_offset);
  int32_t* claims = low_latency::scratch_int(view, LowLatencyScratch::kSendClaim, args.area);
  const int num_rounds = low_latency::num_send_rounds(args.num_experts, experts_per_round);
  int round = low_latency::next_send_round(claims);
  // A CTA without a round (its grid's other CTAs took them all) neither gates nor stamps: only the
  // CTAs that send leave send stamps.
  const bool sends = round < num_rounds;
  if (sends) clock_phase(view, ClockedKernel::kLlDispatchSend, 0);
  for (int i = threadIdx.x; sends && i < num_tokens * num_topk; i += blockDim.x) {
    expert_ids[i] = static_cast<int16_t>(read_expert_id(view, Operation::kLlDispatch, args.topk_idx, num_topk,
                                                        i / num_topk, i % num_topk, args.num_experts));
  }
  // The whole CTA is the transport group (barrier 1; __syncthreads is barrier 0). The queue is
  // reset here and first used after begin_send's __syncthreads.
  const scaleout::WarpGroup group{1, kLowLatencyThreads, static_cast<int>(threadIdx.x)};
  scaleout::Transport transport(view, low_latency::transport_queue<kScaleout>());
  if constexpr (kScaleout) transport.init(group);
  // Also the __syncthreads that makes expert_ids visible to the whole CTA.
  const bool open = sends && low_latency::begin_send(view, layout, args.area, args.area_offset, epoch, round == 0,
                                                     Operation::kLlDispatch, args.rank_mask);
  if (open) clock_phase(view, ClockedKernel::kLlDispatchSend, 1);
  // After a timeout the CTA still takes its rounds (claimed ones are nobody else's) but sends nothing.
  for (; round < num_rounds; round = low_latency::next_send_round(claims)) {
    if (open) {
      send_round<kUseFp8, kScaleout>(args, expert_ids, lists, list_sizes, experts_per_round,
                                     low_latency::send_round(round, experts_per_round), transport, group);
    }
  }
  // Every source this CTA put may be rewritten by the next operation on this area.
  if constexpr (kScaleout) {
    if (open) transport.flush(group);
  }
  if (low_latency::end_send(view, layout, args.ll_offset, args.area, epoch, args.rank_mask) && kUseFp8) {
    // Every CTA is done with the staging rows: their flags back to 0 for the next send on this area.
    int32_t* flags = view.local<int32_t>(args.area_offset + layout.staging_flags_offset);
    for (int token = threadIdx.x; token < num_tokens; token += blockDim.x) flags[token] = 0;
  }
  if (sends) clock_phase(view, ClockedKernel::kLlDispatchSend, 5);
}

// Writes one received row's fp8 scales (G fp32 values in the window) in the output format.
__device__ __forceinline__ void store_scales(const LowLatencyDispatchArgs& args, const float* src, int64_t local,
                                             int64_t row, int lane) {
  const int num_groups = args.hidden / kFp8GroupSize;
  const int64_t num_rows = int64_t{args.view.num_ranks} * args.layout.num_max_tokens;
  switch (args.scales_format) {
    case LowLatencyScales::kFp32RowMajor:
    case LowLatencyScales::kFp32ColMajor: {
      const bool col = args.scales_format == LowLatencyScales::kFp32ColMajor;
      auto* out = static_cast<float*>(args.recv_scales) + local * num_rows * num_groups;
      for (int g = lane; g < num_groups; g += 32) out[col ? g * num_rows + row : row * num_groups + g] = src[g];
      break;
    }
    case LowLatencyScales::kUe8m0RowMajor:
    case LowLatencyScales::kUe8m0ColMajor: {
      // Power-of-two scales (round_scale): the UE8M0 byte is the fp32 exponent field.
      const bool col = args.scales_format == LowLatencyScales::kUe8m0ColMajor;
      const int num_words = num_groups / 4;
      auto* out = static_cast<int32_t*>(args.recv_scales) + local * num_rows * num_words;
      for (int w = lane; w < num_words; w += 32) {
        uint32_t word = 0;
#pragma unroll
        for (int b = 0; b < 4; ++b) word |= ((__float_as_uint(src[4 * w + b]) >> 23) & 0xffu) << (8 * b);
        out[col ? w * num_rows + row : row * num_words + w] = static_cast<int32_t>(word);
      }
      break;
    }
  }
}

// One CTA per local expert (strided). Thread s waits for the cell of source s, records the count
// and resets the cell (the source writes it again only after this rank's next operation on the
// area has started, which is after this kernel). Warp 0 then turns the counts into each source's
// first output row, and the warps copy the rows out of the window when recv_x is given (compact
// rows; the source of output row r is the last s whose first row is <= r). The rows were written
// while this kernel ran (by peers, and in a launch running both phases by this grid): loads
// through L2. Last, the grid's last CTA to finish bumps the area's epoch: in a launch running both
// phases every CTA reads the epoch when it starts, so no earlier CTA may bump it.
__device__ __forceinline__ void receive_phase(const LowLatencyDispatchArgs& args) {
  // Exclusive prefix of the counts over sources; [R] = total (receive_bytes). In dynamic shared
  // memory, where the send phase's routing was: the receive phase then costs the dispatch's largest
  // call no shared memory.
  auto* first_row = reinterpret_cast<int*>(dynamic_shared());
  const DeviceView& view = args.view;
  const LowLatencyLayout& layout = args.layout;
  const int num_ranks = view.num_ranks;
  const int64_t num_max_tokens = layout.num_max_tokens;
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const bool compact = args.recv_x != nullptr;
  const bool receives = static_cast<int>(blockIdx.x) < layout.num_local_experts;
  if (receives) clock_phase(view, ClockedKernel::kLlDispatchRecv, 0);
  const long long start = clock64();
  for (int local = blockIdx.x; local < layout.num_local_experts; local += gridDim.x) {
    for (int source = threadIdx.x; source < num_ranks; source += blockDim.x) {
      int64_t value = 0;  // count + 1 (+ kFailedInputSignalFlag when the source's input failed)
      bool arrived = false;
      if (low_latency::via_transport(view, source)) {
        // Across nodes: this thread is the only reader of the (area, l, s) signal; one operation
        // adds to it once, so what it grew by since the shadow is this operation's arrival.
        const int id = low_latency::arrival_signal(view, args.area, local, source);
        uint64_t* shadow = scaleout::shadow_cell(view, id);
        const uint64_t before = *shadow;
        arrived = low_latency::wait_arrival_signal(view, args.rank_mask, Operation::kLlDispatch, Phase::kCountsArrive,
                                                   source, id, before, &value) == WaitResult::kArrived;
        if (arrived) *shadow = before + static_cast<uint64_t>(value);
      } else {
        int32_t* cell = low_latency::arrival_cell(view, view.rank, layout, args.area_offset, local, source);
        // A masked source (or one masked by this wait) sent nothing: 0 rows.
        arrived = wait_or_mask(view, args.rank_mask, Operation::kLlDispatch, Phase::kCountsArrive, source, 1,
                               [&](int64_t& seen) {
                                 value = ptx::ld_acquire_sys(cell);
                                 seen = value;
                                 return value != 0;
                               }) == WaitResult::kArrived;
        ptx::st_relaxed_sys(cell, 0);
      }
      if (arrived && value >= kFailedInputSignalFlag) {
        record_peer_failed(view, Operation::kLlDispatch, source);
        value %= kFailedInputSignalFlag;
      }
      if (args.wait_cost_stats != nullptr) {
        atomicAdd(reinterpret_cast<unsigned long long*>(args.wait_cost_stats + source),
                  static_cast<unsigned long long>(clock64() - start));
      }
      // Clamped so that a corrupted count can never address past the source's slots.
      const int32_t count =
          arrived ? static_cast<int32_t>(min(max(value - 1, int64_t{0}), int64_t{num_max_tokens})) : 0;
      args.count_per_source[int64_t{local} * num_ranks + source] = count;
      first_row[source] = count;
    }
    __syncthreads();
    clock_phase(view, ClockedKernel::kLlDispatchRecv, 1);
    if (warp == 0) {
      int carry = 0;
      for (int base = 0; base < num_ranks; base += 32) {
        const int source = base + lane;
        const int count = source < num_ranks ? first_row[source] : 0;
        int inclusive = count;
#pragma unroll
        for (int offset = 1; offset < 32; offset *= 2) {
          const int other = __shfl_up_sync(0xffffffffu, inclusive, offset);
          if (lane >= offset) inclusive += other;
        }
        if (source < num_ranks) first_row[source] = carry + inclusive - count;
        carry += __shfl_sync(0xffffffffu, inclusive, 31);
      }
      if (lane == 0) {
        first_row[num_ranks] = carry;
        args.recv_count[local] = carry;
        if (args.cumulative_recv_stats != nullptr) args.cumulative_recv_stats[local] += carry;
      }
    }
    __syncthreads();
    const int total = first_row[num_ranks];
    if (args.recv_layout_range != nullptr) {
      for (int source = threadIdx.x; source < num_ranks; source += blockDim.x) {
        const int64_t begin = compact ? first_row[source] : source * num_max_tokens;
        const int64_t count = first_row[source + 1] - first_row[source];
        args.recv_layout_range[int64_t{local} * num_ranks + source] = (begin << 32) | count;
      }
    }
    if (compact || args.recv_src_info != nullptr) {
      const auto* headers = view.local<const int4>(args.area_offset + layout.dispatch_headers_offset);
      const int64_t row_bytes = args.use_fp8 ? args.hidden : int64_t{args.hidden} * 2;
      const int num_vectors = static_cast<int>(row_bytes / 16);
      const auto* payload = view.local<const int4>(args.area_offset + layout.dispatch_payload_offset);
      const auto* scales = view.local<const float>(args.area_offset + layout.dispatch_scales_offset);
      for (int row = warp; row < total; row += kLowLatencyThreads / 32) {
        int low = 0;
        int high = num_ranks - 1;
        while (low < high) {
          const int middle = (low + high + 1) / 2;
          if (first_row[middle] <= row) {
            low = middle;
          } else {
            high = middle - 1;
          }
        }
        const int64_t slot = (int64_t{local} * num_ranks + low) * num_max_tokens + (row - first_row[low]);
        const int64_t out_row = compact ? row : slot - int64_t{local} * num_ranks * num_max_tokens;
        const int64_t expert_rows = int64_t{num_ranks} * num_max_tokens;
        if (args.recv_src_info != nullptr && lane == 0) {
          args.recv_src_info[local * expert_rows + out_row] = headers[slot].x;
        }
        if (!compact) continue;
        auto* dst = static_cast<int4*>(args.recv_x) + (local * expert_rows + out_row) * num_vectors;
        low_latency::warp_copy_row<8, true>(dst, payload + slot * num_vectors, num_vectors, lane);
        if (args.use_fp8) store_scales(args, scales + slot * (args.hidden / kFp8GroupSize), local, out_row, lane);
      }
    }
    __syncthreads();  // first_row is rewritten for the next local expert
  }
  if (low_latency::last_to_finish(view, args.area)) {
    if (threadIdx.x == 0) low_latency::bump_epoch(view, args.layout, args.area_offset);
  }
  if (receives) clock_phase(view, ClockedKernel::kLlDispatchRecv, 2);
}

// The LL dispatch, every mode: the phases `phases` names (LowLatencyPhases). `experts_per_round`:
// the send phase's rounds (launch_dispatch sizes them to the dynamic shared memory). The receive
// phase has two call sites so that a launch of both phases is the send phase followed by the
// receive phase with no branch around the send phase: with one call site after a conditional send
// phase, ptxas spilled more (bf16 across nodes: 52 / 80 bytes instead of 8 / 8).
template <bool kUseFp8, bool kScaleout>
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_dispatch_kernel(const LowLatencyDispatchArgs args, int experts_per_round, LowLatencyPhases phases) {
  if (phases == LowLatencyPhases::kReceive) {
    receive_phase(args);
    return;
  }
  send_phase<kUseFp8, kScaleout>(args, experts_per_round);
  if (phases == LowLatencyPhases::kBoth) receive_phase(args);
}

void check_args(const LowLatencyDispatchArgs& args) {
  check_low_latency_call(args.layout, args.view.num_ranks, args.num_experts, args.num_tokens, args.num_topk);
  EP_REQUIRE(args.area >= 0 && args.area < kLowLatencyAreas,
             "area must be in [0, " + std::to_string(kLowLatencyAreas) + "), got " + std::to_string(args.area));
  EP_REQUIRE(args.hidden > 0 && args.hidden % kFp8GroupSize == 0,
             "hidden must be a positive multiple of 128, got " + std::to_string(args.hidden));
  const bool ue8m0 =
      args.scales_format == LowLatencyScales::kUe8m0RowMajor || args.scales_format == LowLatencyScales::kUe8m0ColMajor;
  if (args.recv_x != nullptr && args.use_fp8 && ue8m0) {
    EP_REQUIRE(args.round_scale, "UE8M0 scales need round_scale (power-of-two scales)");
    EP_REQUIRE(
        args.hidden % (4 * kFp8GroupSize) == 0,
        "UE8M0 scales pack 4 groups per int32: hidden must be a multiple of 512, got " + std::to_string(args.hidden));
  }
  EP_REQUIRE(args.recv_x == nullptr || !args.use_fp8 || args.recv_scales != nullptr,
             "an fp8 dispatch with compact rows needs recv_scales");
  if (args.view.ll_ranks_per_node > 0) {
    // A transport put moves whole 16-byte vectors: an fp8 row's H/128 fp32 scales must fill them.
    EP_REQUIRE(!args.use_fp8 || (args.hidden / kFp8GroupSize) % 4 == 0,
               "an fp8 low-latency dispatch across nodes needs hidden to be a multiple of 512 (its scales travel "
               "in 16-byte units), got " +
                   std::to_string(args.hidden));
  }
  check_grid_size(args.view, "num_sms", args.num_sms);
}

// A kernel's static shared memory and the dynamic shared memory it may take beside it (the
// device's opt-in limit per block minus the static part), looked up once.
struct SharedMemory {
  int static_bytes = 0;
  int dynamic_budget = 0;
};
template <auto kKernel>
SharedMemory shared_memory_of() {
  static const SharedMemory memory = [] {
    int device = 0;
    int optin = 0;
    EP_CUDA_CHECK(cudaGetDevice(&device));
    EP_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    cudaFuncAttributes attributes{};
    EP_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kKernel));
    const int static_bytes = static_cast<int>(attributes.sharedSizeBytes);
    return SharedMemory{static_bytes, optin - static_bytes};
  }();
  return memory;
}

// Dynamic shared memory of a send phase: the routing ([T * K] int16 expert ids), then one token
// list of T int32 per expert of a round. The largest call the buffer takes needs worst_send_bytes.
int64_t routing_bytes(int64_t tokens, int64_t topk) { return align_up(tokens * topk * 2, 16); }
int64_t worst_send_bytes(const LowLatencyLayout& layout) {
  return routing_bytes(layout.num_max_tokens, layout.num_topk) + layout.num_max_tokens * 4;
}
// Dynamic shared memory of a receive phase: the prefix of the counts over the sources, and the total.
int64_t receive_bytes(int num_ranks) { return int64_t{num_ranks + 1} * 4; }

// One launch of ll_dispatch_kernel. A send phase takes as many experts per round as the dynamic
// shared memory left after the routing holds lists for, up to one per warp, on a grid of up to one
// CTA per expert; a receive-only launch has up to one CTA per local expert. The grid and the
// shared memory differ per phase, the kernel function (and its instantiation) does not.
template <bool kUseFp8, bool kScaleout>
void launch_dispatch(const LowLatencyDispatchArgs& args, LowLatencyPhases phases, cudaStream_t stream) {
  constexpr auto kernel = ll_dispatch_kernel<kUseFp8, kScaleout>;
  const SharedMemory memory = shared_memory_of<kernel>();
  int grid = std::clamp(args.num_sms, 1, args.layout.num_local_experts);
  int experts_per_round = 0;
  int64_t shared_bytes = 0;
  if (runs_phase(phases, LowLatencyPhases::kSend)) {
    // That the buffer's largest call fits was checked when it was built (check_low_latency_dispatch_fits),
    // so at least one list fits beside the routing.
    const int64_t list_bytes = int64_t{args.num_tokens} * 4;
    const int64_t ids_bytes = routing_bytes(args.num_tokens, args.num_topk);
    experts_per_round =
        list_bytes == 0 ? kWarps
                        : static_cast<int>(std::min<int64_t>(kWarps, (memory.dynamic_budget - ids_bytes) / list_bytes));
    shared_bytes = ids_bytes + experts_per_round * list_bytes;
    grid = std::clamp(args.num_sms, 1, args.num_experts);
  }
  if (runs_phase(phases, LowLatencyPhases::kReceive)) {
    shared_bytes = std::max(shared_bytes, receive_bytes(args.view.num_ranks));
  }
  if (shared_bytes + memory.static_bytes > kDefaultDynamicSharedBytes) {
    EP_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared_bytes)));
  }
  kernel<<<grid, kLowLatencyThreads, shared_bytes, stream>>>(args, experts_per_round, phases);
  EP_CHECK_LAUNCH("low_latency_dispatch");
}

}  // namespace

void check_low_latency_call(const LowLatencyLayout& layout, int num_ranks, int num_experts, int num_tokens,
                            int num_topk) {
  EP_REQUIRE(layout.num_max_tokens > 0, "the buffer has no low-latency region (num_max_dispatch_tokens_per_rank=0)");
  // An arrival cell holds count + 1 below the failed-input flag (arrival_value).
  EP_REQUIRE(layout.num_max_tokens < kFailedInputSignalFlag - 1,
             "num_max_dispatch_tokens_per_rank must be below 2^24 - 1, got " + std::to_string(layout.num_max_tokens));
  EP_REQUIRE(num_experts == layout.num_local_experts * num_ranks,
             "num_experts must be " + std::to_string(layout.num_local_experts * num_ranks) + " (the buffer's), got " +
                 std::to_string(num_experts));
  EP_REQUIRE(num_tokens >= 0 && num_tokens <= layout.num_max_tokens,
             "num_tokens must be in [0, num_max_dispatch_tokens_per_rank=" + std::to_string(layout.num_max_tokens) +
                 "], got " + std::to_string(num_tokens));
  EP_REQUIRE(num_topk >= 1 && num_topk <= layout.num_topk && num_topk <= kMaxTopK,
             "num_topk must be in [1, " + std::to_string(layout.num_topk) + "] (the low-latency top-k), got " +
                 std::to_string(num_topk));
}

void check_low_latency_phases(LowLatencyPhases phases) {
  const int value = static_cast<int>(phases);
  EP_REQUIRE(value >= static_cast<int>(LowLatencyPhases::kSend) && value <= static_cast<int>(LowLatencyPhases::kBoth),
             "phases must be 1 (send), 2 (receive) or 3 (both), got " + std::to_string(value));
}

void check_low_latency_dispatch_fits(const LowLatencyLayout& layout, bool scaleout) {
  // The dispatch kernel of either message type (the call picks fp8 or bf16) for this buffer's reach.
  const int64_t budget = scaleout ? std::min(shared_memory_of<ll_dispatch_kernel<true, true>>().dynamic_budget,
                                             shared_memory_of<ll_dispatch_kernel<false, true>>().dynamic_budget)
                                  : std::min(shared_memory_of<ll_dispatch_kernel<true, false>>().dynamic_budget,
                                             shared_memory_of<ll_dispatch_kernel<false, false>>().dynamic_budget);
  // The receive phase's bytes (at most kMaxRanks + 1 ints) reuse the send phase's and always fit:
  // only the send phase's routing and token list grow with the buffer.
  const int64_t worst = worst_send_bytes(layout);
  // routing_bytes rounds T * K * 2 (even) up to 16 bytes: at most 14 bytes more.
  const int64_t largest = std::max<int64_t>(0, (budget - 14) / (2 * int64_t{layout.num_topk} + 4));
  const std::string top_k = "top-" + std::to_string(layout.num_topk);
  EP_REQUIRE(worst <= budget,
             "a low-latency dispatch of num_max_dispatch_tokens_per_rank=" + std::to_string(layout.num_max_tokens) +
                 " tokens x " + top_k + " does not fit in this GPU's shared memory (" + std::to_string(worst) + " > " +
                 std::to_string(budget) + " bytes of routing and token list): " +
                 "num_max_dispatch_tokens_per_rank must be at most " + std::to_string(largest) + " with " + top_k);
}

void launch_low_latency_dispatch(const LowLatencyDispatchArgs& args, LowLatencyPhases phases, cudaStream_t stream) {
  check_args(args);
  check_low_latency_phases(phases);
  if (args.view.ll_ranks_per_node > 0) {
    args.use_fp8 ? launch_dispatch<true, true>(args, phases, stream)
                 : launch_dispatch<false, true>(args, phases, stream);
  } else {
    args.use_fp8 ? launch_dispatch<true, false>(args, phases, stream)
                 : launch_dispatch<false, false>(args, phases, stream);
  }
}

void preload_low_latency_dispatch_kernels() {
  preload_kernel(ll_dispatch_kernel<true, false>, "ll dispatch (fp8)");
  preload_kernel(ll_dispatch_kernel<false, false>, "ll dispatch (bf16)");
  preload_kernel(ll_dispatch_kernel<true, true>, "ll dispatch across nodes (fp8)");
  preload_kernel(ll_dispatch_kernel<false, true>, "ll dispatch across nodes (bf16)");
}

}  // namespace deep_ep
