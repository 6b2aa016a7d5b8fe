// HT combine reduce epilogue (home rank, local memory only): for each own token,
//   acc = 0 (fp32); acc += bias0; acc += bias1; acc += term j for j = 0 .. terms - 1;
//   out = bf16(acc), rounded once.
// Direct: term j is the row of the token's j-th destination rank. Hybrid: the partial of the
// token's j-th node (each already a bf16 sum of that node's rows, see ht_combine.cu).
// Row j came from the token's j-th destination rank in ascending order, so the sum order, and
// hence every bit of the result, is fixed whatever the arrival order. The home rank derives j from
// its own copy of topk_idx exactly as the senders did.
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

__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(const ReduceArgs args) {
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
    // A term is a rank's row (direct) or a node's partial (hybrid), in ascending order.
    int term_owner = expert >= 0 ? call.rank_of_expert(expert) : -1;
    if (call.hybrid() && term_owner >= 0) term_owner = call.node_of(term_owner);
    const uint32_t first_lanes = __ballot_sync(kFullMask, is_first_lane_of_rank(term_owner));
    const int num_terms = __popc(first_lanes);
    const uint8_t* token_rows =
        view.local<uint8_t>(call.hybrid() ? call.partial_slot(0, t) : call.combine_row_slot(0, 0, t));
    const int64_t area_stride = call.hybrid() ? call.partial_slot(1, t) - call.partial_slot(0, t)
                                              : call.combine_row_slot(1, 0, t) - call.combine_row_slot(0, 0, t);

    const int64_t row = t * num_vectors;
    sum_row_to_bf16<kSumUnroll>(
        out + row, bias0 != nullptr ? bias0 + row : nullptr, bias1 != nullptr ? bias1 + row : nullptr, num_terms,
        num_vectors, [&](int j) { return reinterpret_cast<const int4*>(token_rows + j * area_stride); },
        [](const int4* p) { return ptx::ld_nc_v4(p); });

    if (args.combined_topk_weights != nullptr) {
      // Weight k comes from the term of the rank (node) owning expert k.
      const int term = distinct_ranks_in(term_owner, first_lanes, 0, term_owner);
      if (lane < num_topk) {
        float weight = 0.0f;
        if (expert >= 0) {
          weight = __ldg(reinterpret_cast<const float*>(token_rows + term * area_stride + token.weights_offset) + lane);
        }
        args.combined_topk_weights[int64_t{t} * num_topk + lane] = weight;
      }
    }
  }
}

}  // namespace

void launch_combine_reduce(const ReduceArgs& args, cudaStream_t stream) {
  check_grid_size(args.view, "num_ctas", args.num_ctas);
  check_call(args.view, args.call);
  check_combine_shape(args.call.num_topk, args.call.hidden);
  reduce_kernel<<<args.num_ctas, kReduceThreads, 0, stream>>>(args);
  EP_CHECK_LAUNCH("ht combine reduce_kernel");
}

void preload_ht_combine_reduce_kernels() { preload_kernel(reduce_kernel, "ht combine reduce"); }

}  // namespace deep_ep::ht
