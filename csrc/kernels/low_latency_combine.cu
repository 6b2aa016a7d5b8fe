// Low-latency combine: every expert output row goes back to the rank of its token, into that rank's
// combine payload slot [token][top-k slot]; the receiver then sums the K slots of each token with
// its weights in fp32, k ascending, one bf16 rounding.
//
// Send phase. Work unit = (local expert l, source rank s), CTA-strided in rounds: the n(l, s) rows
// the dispatch put at [l][s * T_ll, + n) carry headers {token, top-k slot} (read from this rank's
// dispatch area), so each row is copied straight to rank s at [token][slot]. When the whole CTA is
// done with a round, one thread per unit publishes n + 1 into rank s's arrival cell [l][me]
// (system-scope release): the receiver has every row once all L * R cells are set.
//
// Across nodes (kScaleout): a row for a rank of another node is staged in this combine's own area,
// in its dispatch payload row (l, s, i) (bf16 stride: the area is sized for bf16), and put to
// [token][slot]; after the round the CTA adds n + 1 to that rank's arrival signal (l, me), which
// covers the CTA's puts. A combine writes only the combine payload of its area, and the dispatch
// rows there belong to the operation three before, whose lifetime ended when the operation before
// this one was sent: the staging touches no data a caller may still read (the zero-copy recv_x of
// the dispatch this combine answers lives in another area). The receive side waits on the signals
// (never reset: the last CTA advances the shadows).
// With the lsa transport a row for another node is stored straight into it instead (no staging).
//
// One kernel function, ll_combine_kernel, runs the phases its LowLatencyPhases argument names:
// both in one launch (no receive hook), or the send phase and later, launched again by the hook,
// the receive phase.
#include <cuda_bf16.h>
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
constexpr int kUnitsPerRound = 32;  // (local expert, source) units a send CTA handles together
constexpr int kCopyUnroll = 16;     // 16-byte vectors in flight per lane (send)
constexpr int kReduceUnroll = 2;    // vectors per lane reduced together (receive)
constexpr int kSlotsInFlight = 4;   // top-k slots loaded before they are summed (receive)

// Across nodes: row i of unit (l, s) to rank s through the transport (see the file comment).
// Warp-collective.
__device__ __forceinline__ void put_row(const LowLatencyCombineArgs& args, scaleout::Transport& transport, int source,
                                        int64_t dispatch_row, const int4* x_row, int token, int slot, int lane) {
  const LowLatencyLayout& layout = args.layout;
  const int num_vectors = args.hidden / 8;
  const int64_t row_bytes = int64_t{args.hidden} * 2;
  const int64_t staging = args.area_offset + layout.dispatch_payload_offset + dispatch_row * row_bytes;
  int4* stage = args.view.local<int4>(staging);
  if (x_row == nullptr) {
    // This rank's input failed: its expert outputs count as zero.
    for (int index = lane; index < num_vectors; index += 32) stage[index] = make_int4(0, 0, 0, 0);
  } else {
    for (int index = lane; index < num_vectors; index += 32) stage[index] = ptx::ld_nc_v4(x_row + index);
  }
  transport.put(
      source, args.area_offset + layout.combine_payload_offset + (int64_t{token} * layout.num_topk + slot) * row_bytes,
      staging, row_bytes);
}

// The send phase (see the file comment): rounds of kUnitsPerRound units, claimed by running CTAs
// (low_latency::next_send_round says why).
template <bool kScaleout>
__device__ __forceinline__ void send_phase(const LowLatencyCombineArgs& args) {
  __shared__ int unit_counts[kUnitsPerRound];
  __shared__ int64_t unit_first_x_row[kUnitsPerRound];
  __shared__ int unit_via_transport[kUnitsPerRound];
  const DeviceView& view = args.view;
  const LowLatencyLayout& layout = args.layout;
  const int num_ranks = view.num_ranks;
  const int num_vectors = args.hidden / 8;
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int num_units = layout.num_local_experts * num_ranks;

  const int64_t epoch = low_latency::send_epoch(view, layout, args.area_offset);
  int32_t* claims = low_latency::scratch_int(view, LowLatencyScratch::kSendClaim, args.area);
  const int num_rounds = low_latency::num_send_rounds(num_units, kUnitsPerRound);
  int round = low_latency::next_send_round(claims);
  // A CTA without a round (its grid's other CTAs took them all) neither gates nor stamps: only the
  // CTAs that send leave send stamps.
  const bool sends = round < num_rounds;
  if (sends) clock_phase(view, ClockedKernel::kLlCombineSend, 0);
  // The whole CTA is the transport group (barrier 1); the queue is first used after begin_send.
  const scaleout::WarpGroup group{1, kLowLatencyThreads, static_cast<int>(threadIdx.x)};
  scaleout::Transport transport(view, low_latency::transport_queue<kScaleout>());
  if constexpr (kScaleout) transport.init(group);
  const bool open = sends && low_latency::begin_send(view, layout, args.area, args.area_offset, epoch, round == 0,
                                                     Operation::kLlCombine, args.rank_mask);
  if (open) clock_phase(view, ClockedKernel::kLlCombineSend, 1);
  const auto* headers = view.local<const int4>(args.dispatch_area_offset + layout.dispatch_headers_offset);
  const auto* rows = static_cast<const int4*>(args.x);
  // Round q takes units base + j * stride (j < kUnitsPerRound), unit = l * R + s: source-fastest,
  // so neighbouring CTAs write to different ranks. A unit has few rows (about T * K / E), so the
  // rows of a whole round are spread over the warps together. After a timeout the CTA still takes
  // its rounds (claimed ones are nobody else's) but sends nothing.
  for (; round < num_rounds; round = low_latency::next_send_round(claims)) {
    if (!open) continue;
    const low_latency::SendRound units = low_latency::send_round(round, kUnitsPerRound);
    const auto unit_of = [&](int j) { return units.base + j * units.stride; };
    if (threadIdx.x < kUnitsPerRound) {
      const int unit = unit_of(threadIdx.x);
      // Clamped so that a corrupted count can never address past the slots. Without the handle's
      // counts (a failed input with no usable handle) this rank sends no row.
      // A masked source rank gets no row (and no arrival cell, below).
      unit_counts[threadIdx.x] =
          unit < num_units && args.count_per_source != nullptr && !peer_masked(args.rank_mask, unit % num_ranks)
              ? std::clamp(args.count_per_source[unit], 0, static_cast<int>(layout.num_max_tokens))
              : 0;
      // Where the unit's rows sit in x: per-source blocks, or compacted by the dispatch's receive
      // (first row from its layout range, clamped inside the expert's rows like the count).
      int64_t first_x_row = int64_t{unit} * layout.num_max_tokens;
      if (unit < num_units && args.layout_range != nullptr) {
        const int64_t expert_rows = int64_t{num_ranks} * layout.num_max_tokens;
        const int64_t begin =
            std::clamp<int64_t>(args.layout_range[unit] >> 32, 0, expert_rows - unit_counts[threadIdx.x]);
        first_x_row = int64_t{unit / num_ranks} * expert_rows + begin;
      }
      unit_first_x_row[threadIdx.x] = first_x_row;
      // Decided once per round: a mask may change meanwhile, and every thread must take part in
      // the same signals.
      unit_via_transport[threadIdx.x] = kScaleout && unit < num_units &&
                                        low_latency::via_transport(view, unit % num_ranks) &&
                                        !peer_masked(args.rank_mask, unit % num_ranks);
    }
    __syncthreads();

    int rows_before = 0;
    for (int j = 0; j < kUnitsPerRound; ++j) {
      const int unit = unit_of(j);
      if (unit >= num_units) break;
      const int count = unit_counts[j];
      const int64_t first_row = int64_t{unit} * layout.num_max_tokens;  // headers: rows [l][s][0, count)
      const int64_t first_x_row = unit_first_x_row[j];
      int4* payload = view.peer<int4>(unit % num_ranks, args.area_offset + layout.combine_payload_offset);
      for (int i = ((warp - rows_before) % kWarps + kWarps) % kWarps; i < count; i += kWarps) {
        const int64_t row = first_row + i;
        const int4 header = headers[row];  // written by the dispatch's senders: a coherent load
        const int token = header.x;
        const int slot = header.y;
        if (token < 0 || token >= layout.num_max_tokens || slot < 0 || slot >= layout.num_topk) continue;
        // lsa: a plain store into the peer, as within a node (the arrival signal covers it).
        if (kScaleout && unit_via_transport[j] != 0 && !low_latency::stores_directly(view)) {
          put_row(args, transport, unit % num_ranks, row,
                  rows == nullptr ? nullptr : rows + (first_x_row + i) * num_vectors, token, slot, lane);
          continue;
        }
        int4* dst = payload + (int64_t{token} * layout.num_topk + slot) * num_vectors;
        if (rows == nullptr) {
          // This rank's input failed: its expert outputs count as zero, not as stale slot data.
          for (int index = lane; index < num_vectors; index += 32) ptx::st_na_v4(dst + index, make_int4(0, 0, 0, 0));
        } else {
          low_latency::warp_copy_row<kCopyUnroll>(dst, rows + (first_x_row + i) * num_vectors, num_vectors, lane);
        }
      }
      rows_before += count;
    }
    __syncthreads();
    clock_phase(view, ClockedKernel::kLlCombineSend, 2);

    if constexpr (kScaleout) {
      // One arrival signal per unit of another node; it covers every put of the CTA to that rank.
      transport.signal_each(group, kUnitsPerRound, [&](int j) {
        if (unit_via_transport[j] == 0) return scaleout::SignalItem{};
        const int unit = unit_of(j);
        const uint64_t add = static_cast<uint64_t>(unit_counts[j]) + 1 +
                             (args.input_failed ? static_cast<uint64_t>(kFailedInputSignalFlag) : 0);
        return scaleout::SignalItem{unit % num_ranks,
                                    low_latency::arrival_signal(view, args.area, unit / num_ranks, view.rank), add};
      });
    }
    if (threadIdx.x < kUnitsPerRound) {
      const int unit = unit_of(threadIdx.x);
      if (unit < num_units && !peer_masked(args.rank_mask, unit % num_ranks) &&
          !(kScaleout && low_latency::via_transport(view, unit % num_ranks))) {
        // Orders the rows of every warp of the CTA (seen through the __syncthreads) before the
        // cell, which a strong store after the fence releases (no second fence).
        ptx::fence_acq_rel_sys();
        ptx::st_relaxed_sys(
            low_latency::arrival_cell(view, unit % num_ranks, layout, args.area_offset, unit / num_ranks, view.rank),
            low_latency::arrival_value(unit_counts[threadIdx.x], args.input_failed));
      }
    }
    __syncthreads();  // unit_counts is rewritten by the next round
    clock_phase(view, ClockedKernel::kLlCombineSend, 3);
  }
  // Every source this CTA put may be rewritten by the next operation.
  if constexpr (kScaleout) {
    if (open) transport.flush(group);
  }
  low_latency::end_send(view, layout, args.ll_offset, args.area, epoch, args.rank_mask);
  if (sends) clock_phase(view, ClockedKernel::kLlCombineSend, 4);
}

__device__ __forceinline__ int4 round_to_bf16x8(const float (&acc)[8]) {
  int4 packed;
  auto* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
  return packed;
}

// CTAs that sum rows of a T-token combine: a work item is (token, chunk of 32 * kReduceUnroll
// vectors), one per warp, so that a handful of tokens still keeps several CTAs busy.
__host__ __device__ __forceinline__ int reduce_chunks_per_token(int hidden) {
  return (hidden / 8 + 32 * kReduceUnroll - 1) / (32 * kReduceUnroll);
}
__host__ __device__ __forceinline__ int reduce_ctas(int num_tokens, int hidden) {
  const int64_t num_items = int64_t{num_tokens} * reduce_chunks_per_token(hidden);
  return static_cast<int>(num_items > kWarps ? (num_items + kWarps - 1) / kWarps : 1);
}

// The receive phase. Every CTA that sums rows (the first reduce_ctas of the grid: all of a
// receive-only launch's, which has no more) waits for all L * R arrival cells (a token may have
// rows from any of them). The grid's last CTA to finish waiting (or, a CTA that sums nothing, to
// finish its send phase) resets the cells and bumps the area's epoch: by then every CTA has seen
// every cell and read the epoch. Then the warps reduce the K slots of each token.
__device__ __forceinline__ void receive_phase(const LowLatencyCombineArgs& args) {
  __shared__ int failed;
  const DeviceView& view = args.view;
  const LowLatencyLayout& layout = args.layout;
  const int num_ranks = view.num_ranks;
  const int num_cells = layout.num_local_experts * num_ranks;
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const bool receives = static_cast<int>(blockIdx.x) < reduce_ctas(args.num_tokens, args.hidden);

  if (receives) {
    clock_phase(view, ClockedKernel::kLlCombineRecv, 0);
    if (threadIdx.x == 0) failed = 0;
    __syncthreads();
    const long long start = clock64();
    for (int cell_index = threadIdx.x; cell_index < num_cells; cell_index += blockDim.x) {
      const int source = cell_index % num_ranks;
      WaitResult result;
      if (low_latency::via_transport(view, source)) {
        // Across nodes: the (area, l, s) signal grew past its shadow (advanced by the last CTA below).
        const int id = low_latency::arrival_signal(view, args.area, cell_index / num_ranks, source);
        int64_t delta = 0;
        result = low_latency::wait_arrival_signal(view, args.rank_mask, Operation::kLlCombine, Phase::kDataArrive,
                                                  source, id, *scaleout::shadow_cell(view, id), &delta);
        if (result == WaitResult::kArrived && blockIdx.x == 0 && delta >= kFailedInputSignalFlag) {
          record_peer_failed(view, Operation::kLlCombine, source);
        }
      } else {
        const int32_t* cell =
            low_latency::arrival_cell(view, view.rank, layout, args.area_offset, cell_index / num_ranks, source);
        int32_t value = 0;
        result = wait_or_mask(view, args.rank_mask, Operation::kLlCombine, Phase::kDataArrive, source, 1,
                              [&](int64_t& seen) {
                                value = ptx::ld_acquire_sys(cell);
                                seen = value;
                                return value != 0;
                              });
        if (result == WaitResult::kArrived && blockIdx.x == 0 && value >= kFailedInputSignalFlag) {
          record_peer_failed(view, Operation::kLlCombine, source);
        }
      }
      if (result == WaitResult::kFailed) atomicExch(&failed, 1);
      // Every CTA waits for every cell: CTA 0 alone accounts the wait (DeepEP's per-source sum).
      if (args.wait_cost_stats != nullptr && blockIdx.x == 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(args.wait_cost_stats + source),
                  static_cast<unsigned long long>(clock64() - start));
      }
    }
    __syncthreads();
    clock_phase(view, ClockedKernel::kLlCombineRecv, 1);
    if (failed != 0) return;  // the error is recorded; the host raises CommTimeoutError
  }

  if (low_latency::last_to_finish(view, args.area)) {
    // Every CTA that waits has seen every cell; the senders write them again only after this
    // rank's next operation on the area has started (after this kernel).
    for (int cell_index = threadIdx.x; cell_index < num_cells; cell_index += blockDim.x) {
      const int source = cell_index % num_ranks;
      if (low_latency::via_transport(view, source)) {
        // The signal holds exactly this operation's addition (the source's next one needs this
        // rank's release of the area, after this kernel); a masked source's is not consumed.
        if (!peer_masked(args.rank_mask, source)) {
          const int id = low_latency::arrival_signal(view, args.area, cell_index / num_ranks, source);
          *scaleout::shadow_cell(view, id) = scaleout::read_own_signal(view, id);
        }
        continue;
      }
      ptx::st_relaxed_sys(
          low_latency::arrival_cell(view, view.rank, layout, args.area_offset, cell_index / num_ranks, source), 0);
    }
    if (threadIdx.x == 0) low_latency::bump_epoch(view, layout, args.area_offset);
  }
  if (!receives) return;

  const int num_vectors = args.hidden / 8;
  const int chunk_vectors = 32 * kReduceUnroll;
  const int chunks_per_token = reduce_chunks_per_token(args.hidden);
  const int64_t num_items = int64_t{args.num_tokens} * chunks_per_token;
  const auto* payload = view.local<const int4>(args.area_offset + layout.combine_payload_offset);
  auto* out = static_cast<int4*>(args.out);
  for (int64_t item = int64_t{blockIdx.x} * kWarps + warp; item < num_items; item += int64_t{gridDim.x} * kWarps) {
    const int token = static_cast<int>(item / chunks_per_token);
    const int first = static_cast<int>(item % chunks_per_token) * chunk_vectors + lane;
    int expert = -1;
    float weight = 0.0f;
    if (lane < args.num_topk) {
      expert = read_expert_id(view, Operation::kLlCombine, args.topk_idx, args.num_topk, token, lane, args.num_experts);
      weight = args.topk_weights[int64_t{token} * args.num_topk + lane];
      // A masked rank's experts are absent: their slots hold no row of this operation. Read after
      // every wait of this CTA, so a rank masked by one of them is left out of every token.
      if (expert >= 0 && peer_masked(args.rank_mask, expert / layout.num_local_experts)) expert = -1;
    }
    const uint32_t selected = __ballot_sync(0xffffffffu, expert >= 0);
    const int4* slots = payload + int64_t{token} * layout.num_topk * num_vectors + first;
    float acc[kReduceUnroll][8] = {};
    for (int first_slot = 0; first_slot < args.num_topk; first_slot += kSlotsInFlight) {
      // All loads of kSlotsInFlight slots are issued before any is used.
      int4 packed[kSlotsInFlight][kReduceUnroll];
#pragma unroll
      for (int j = 0; j < kSlotsInFlight; ++j) {
        const int k = first_slot + j;
        if (k >= args.num_topk || ((selected >> k) & 1u) == 0) continue;
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u) {
          if (first + u * 32 < num_vectors) packed[j][u] = __ldcg(slots + int64_t{k} * num_vectors + u * 32);
        }
      }
      // k ascending, product rounded to fp32 then added: the reference's arithmetic (no FMA).
#pragma unroll
      for (int j = 0; j < kSlotsInFlight; ++j) {
        const int k = first_slot + j;
        if (k >= args.num_topk || ((selected >> k) & 1u) == 0) continue;
        const float w = __shfl_sync(0xffffffffu, weight, k);
#pragma unroll
        for (int u = 0; u < kReduceUnroll; ++u) {
          if (first + u * 32 >= num_vectors) continue;
          const fp8::Channels8 y = fp8::widen_bf16x8(packed[j][u]);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[u][i] = __fadd_rn(acc[u][i], __fmul_rn(w, y.value[i]));
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      if (first + u * 32 < num_vectors) out[int64_t{token} * num_vectors + first + u * 32] = round_to_bf16x8(acc[u]);
    }
  }
  clock_phase(view, ClockedKernel::kLlCombineRecv, 2);
}

// The LL combine, every mode: the phases `phases` names (LowLatencyPhases).
template <bool kScaleout>
__global__ void __launch_bounds__(kLowLatencyThreads, 1)
    ll_combine_kernel(const LowLatencyCombineArgs args, LowLatencyPhases phases) {
  if (runs_phase(phases, LowLatencyPhases::kSend)) send_phase<kScaleout>(args);
  if (runs_phase(phases, LowLatencyPhases::kReceive)) receive_phase(args);
}

void check_args(const LowLatencyCombineArgs& args) {
  check_low_latency_call(args.layout, args.view.num_ranks, args.num_experts, args.num_tokens, args.num_topk);
  EP_REQUIRE(args.hidden > 0 && args.hidden % 8 == 0,
             "hidden must be a positive multiple of 8, got " + std::to_string(args.hidden));
  EP_REQUIRE(args.area >= 0 && args.area < kLowLatencyAreas,
             "area must be in [0, " + std::to_string(kLowLatencyAreas) + "), got " + std::to_string(args.area));
  check_grid_size(args.view, "num_sms", args.num_sms);
}

// One launch of ll_combine_kernel: a send phase takes up to one CTA per (local expert, source)
// unit, a receive phase up to one per reduce_ctas, a launch of both the larger of the two. The
// grid differs per phase, the kernel function (and its instantiation) does not.
template <bool kScaleout>
void launch_combine(const LowLatencyCombineArgs& args, LowLatencyPhases phases, cudaStream_t stream) {
  const int send_ctas =
      runs_phase(phases, LowLatencyPhases::kSend) ? args.layout.num_local_experts * args.view.num_ranks : 0;
  const int receive_ctas =
      runs_phase(phases, LowLatencyPhases::kReceive) ? reduce_ctas(args.num_tokens, args.hidden) : 0;
  const int grid = std::clamp(args.num_sms, 1, std::max(send_ctas, receive_ctas));
  ll_combine_kernel<kScaleout><<<grid, kLowLatencyThreads, 0, stream>>>(args, phases);
  EP_CHECK_LAUNCH("low_latency_combine");
}

}  // namespace

void launch_low_latency_combine(const LowLatencyCombineArgs& args, LowLatencyPhases phases, cudaStream_t stream) {
  check_args(args);
  check_low_latency_phases(phases);
  if (args.view.ll_ranks_per_node > 0) {
    launch_combine<true>(args, phases, stream);
  } else {
    launch_combine<false>(args, phases, stream);
  }
}

void preload_low_latency_combine_kernels() {
  preload_kernel(ll_combine_kernel<false>, "ll combine");
  preload_kernel(ll_combine_kernel<true>, "ll combine across nodes");
}

}  // namespace deep_ep
