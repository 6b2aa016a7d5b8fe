// HT combine reduce epilogue (home rank, local memory only): for each own token,
//   acc = 0 (fp32); acc += bias0; acc += bias1; acc += each term in DeepEP V2's order;
//   out = bf16(acc), rounded once.
// Direct: a term is the row of one of the token's destination ranks. Hybrid: the partial of one of
// the token's nodes (each already a bf16 sum of that node's rows, see ht_combine.cu). Row j came
// from the owner (rank or node) with j of the token's owners below it; V2's reference adds the
// owners in ascending order of their last top-k lane instead (term_rows_in_v2_order, ht_common.cuh),
// so the sum order, and hence every bit of the result, is fixed whatever the arrival order and equal
// to V2's. The home rank derives both from its own copy of topk_idx exactly as the senders did.
// Combined weights: slot k of the term owning expert k (V2), or of every term summed (V1, see
// ReduceArgs::sum_topk_weights; hybrid: node partials already summed that way by the forwarders).
#include <stdexcept>
#include <string>

#include "common/cuda_check.hpp"
#include "common/require.hpp"
#include "kernels/high_throughput.hpp"
#include "kernels/ht_common.cuh"
#include "kernels/preload.hpp"

namespace deep_ep::ht {
namespace {

constexpr int kReduceThreads = 512;
constexpr int kReduceWarps = kReduceThreads / 32;
constexpr int kSumUnroll = 2;

__global__ void __launch_bounds__(kReduceThreads) combine_reduce_epilogue_impl(const ReduceArgs args) {
  const DeviceView& view = args.view;
  const HtCall& call = args.call;
  const int lane = lane_id();
  const int num_topk = call.num_topk;
  const TokenLayout& token = call.combine_token();
  const int64_t num_vectors = int64_t{call.hidden} / kBf16PerVector;
  const auto* bias0 = static_cast<const int4*>(args.bias0);
  const auto* bias1 = static_cast<const int4*>(args.bias1);
  auto* out = static_cast<int4*>(args.combined_x);

  const int first_warp = static_cast<int>(blockIdx.x * kReduceWarps + threadIdx.x / 32);
  for (int t = first_warp; t < args.num_tokens; t += gridDim.x * kReduceWarps) {
    const int expert =
        lane < num_topk ? handle_expert(args.topk_idx, int64_t{t} * num_topk + lane, call.num_experts) : -1;
    // A term is a rank's row (direct) or a node's partial (hybrid).
    int term_owner = expert >= 0 ? call.rank_of_expert(expert) : -1;
    if (call.hybrid() && term_owner >= 0) term_owner = call.node_of(term_owner);
    const TermRows terms = term_rows_in_v2_order(term_owner);
    const uint8_t* token_rows =
        view.local<uint8_t>(call.hybrid() ? call.partial_slot(0, t) : call.combine_row_slot(0, 0, t));
    const int64_t area_stride = call.hybrid() ? call.partial_slot(1, t) - call.partial_slot(0, t)
                                              : call.combine_row_slot(1, 0, t) - call.combine_row_slot(0, 0, t);

    const int64_t row = t * num_vectors;
    sum_row_to_bf16<kSumUnroll>(
        out + row, bias0 != nullptr ? bias0 + row : nullptr, bias1 != nullptr ? bias1 + row : nullptr, terms.num_terms,
        num_vectors,
        [&](int j) {
          return reinterpret_cast<const int4*>(token_rows + __shfl_sync(kFullMask, terms.row, j & 31) * area_stride);
        },
        [](const int4* p) { return ptx::ld_nc_v4(p); });

    if (args.combined_topk_weights != nullptr && lane < num_topk) {
      // Owner rule: weight k from the term of the rank (node) owning expert k; sum rule: over all terms.
      args.combined_topk_weights[int64_t{t} * num_topk + lane] =
          combined_slot_weight(token_rows, area_stride, token.weights_offset, terms, expert >= 0, args.sum_topk_weights,
                               [](const float* p) { return __ldg(p); });
    }
  }
}

}  // namespace

void launch_combine_reduce(const ReduceArgs& args, cudaStream_t stream) {
  check_grid_size(args.view, "num_ctas", args.num_ctas);
  check_call(args.view, args.call);
  check_combine_shape(args.call.num_topk, args.call.hidden);
  combine_reduce_epilogue_impl<<<args.num_ctas, kReduceThreads, 0, stream>>>(args);
  EP_CHECK_LAUNCH("ht combine_reduce_epilogue_impl");
}

void preload_ht_combine_reduce_kernels() {
  preload_kernel(combine_reduce_epilogue_impl, "ht combine reduce (combine_reduce_epilogue_impl)");
}

}  // namespace deep_ep::ht
