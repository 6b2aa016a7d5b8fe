// The HT call description and launchers as Python sees them (deep_ep._C.ht_*): tensors as data_ptr() integers (0 =
// none), streams as cuda_stream integers. bind_high_throughput.cpp binds them; the C++ host path
// (bind_ht_host_path.cpp) calls them with the addresses of the tensors it checked and allocated.
#pragma once

#include <cstdint>

#include "common/ht_call.hpp"
#include "runtime/runtime.hpp"

namespace deep_ep {

// The call description of one shape on this buffer (deep_ep._C.ht_call); raises std::invalid_argument
// when the shape does not fit the buffer's HT region.
HtCall buffer_ht_call(const Runtime& runtime, int64_t num_max_tokens_per_rank, int hidden, int num_topk,
                      int num_experts, bool use_fp8, bool combine_only, bool zero_copy_recv);
void launch_ht_notify(Runtime& runtime, const HtCall& call, std::uintptr_t topk_idx, std::uintptr_t topk_idx_copy,
                      int num_tokens, int expert_alignment, bool do_expand, std::uintptr_t expert_slot,
                      std::uintptr_t dst_slot, std::uintptr_t scratch, std::uintptr_t counts, bool cpu_sync,
                      std::uintptr_t send_base, std::uintptr_t rank_prefix_matrix, std::uintptr_t hybrid_block,
                      int num_sms, std::uintptr_t stream, bool input_failed);
void launch_ht_dispatch(Runtime& runtime, const HtCall& call, int num_tokens, std::uintptr_t x, std::uintptr_t x_scales,
                        std::uintptr_t topk_idx, std::uintptr_t topk_weights, std::uintptr_t dst_slot,
                        std::uintptr_t expert_slot, std::uintptr_t send_base, std::uintptr_t hybrid_block,
                        bool entry_barrier, int num_sms, std::uintptr_t stream, bool input_failed);
void launch_ht_dispatch_epilogue(Runtime& runtime, const HtCall& call, bool do_expand, int expert_alignment,
                                 bool has_weights, std::uintptr_t counts, int64_t num_rows_allocated,
                                 int64_t num_meta_rows_allocated, std::uintptr_t recv_x, std::uintptr_t recv_x_scales,
                                 std::uintptr_t recv_topk_idx, std::uintptr_t recv_topk_weights,
                                 std::uintptr_t recv_src_info, std::uintptr_t recv_expanded_rows, int num_ctas,
                                 std::uintptr_t stream);
void launch_ht_combine(Runtime& runtime, const HtCall& call, bool do_expand, std::uintptr_t x,
                       std::uintptr_t topk_weights, bool sum_topk_weights, std::uintptr_t counts,
                       std::uintptr_t recv_src_info, std::uintptr_t recv_expanded_rows, int64_t num_meta_rows,
                       int num_tokens, std::uintptr_t topk_idx, std::uintptr_t hybrid_block, int num_sms,
                       std::uintptr_t stream, bool input_failed);
void launch_ht_combine_reduce(Runtime& runtime, const HtCall& call, int num_tokens, std::uintptr_t topk_idx,
                              std::uintptr_t bias0, std::uintptr_t bias1, std::uintptr_t combined_x,
                              std::uintptr_t combined_topk_weights, bool sum_topk_weights, int num_ctas,
                              std::uintptr_t stream);
void launch_ht_combine_pull(Runtime& runtime, const HtCall& call, int num_tokens, std::uintptr_t topk_idx,
                            std::uintptr_t dst_slot, std::uintptr_t send_base, std::uintptr_t bias0,
                            std::uintptr_t bias1, std::uintptr_t combined_x, std::uintptr_t combined_topk_weights,
                            bool sum_topk_weights, int num_sms, std::uintptr_t stream, bool input_failed);

}  // namespace deep_ep
