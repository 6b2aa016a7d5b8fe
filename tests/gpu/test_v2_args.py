"""DeepEP V2's extra ElasticBuffer arguments, with V2's meaning: column-major fp8 scales for TMA,
cumulative per-expert receive stats, an event the epilogue waits for, accepted queue-pair and
service-level knobs, and the domain-size queries."""

from __future__ import annotations

import pytest
import torch
from ht_checks import Case, assert_bitwise_equal, device, dispatch_case, group_inputs, make_buffer, split

from deep_ep.testing import launch

FP8 = Case("v2 args fp8 H2048 K8 E64", 2048, 8, 64, 200, True, seed=51)


def _v2_arguments(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=256, hidden=2048, sl_idx=5, num_allocated_qps=17)
    try:
        assert buffer.sl_idx == 5 and buffer.num_allocated_qps == 17
        assert buffer.get_logical_domain_size() == (buffer.num_scaleout_ranks, buffer.num_scaleup_ranks)
        assert buffer.get_physical_domain_size() == (buffer.num_rdma_ranks, buffer.num_nvlink_ranks)
        case = FP8
        inputs = group_inputs(case, num_ranks)
        num_local = case.experts(num_ranks) // num_ranks
        plain = dispatch_case(buffer, rank, case, inputs)

        # Column-major scales: same values, strides (1, align(N, 4)).
        stats = torch.full((num_local,), 7, dtype=torch.int32, device=device())
        before = buffer.capture()
        tma = dispatch_case(
            buffer,
            rank,
            case,
            inputs,
            use_tma_aligned_col_major_sf=True,
            cumulative_local_expert_recv_stats=stats,
            previous_event_before_epilogue=before,
            num_qps=17,
            do_handle_copy=False,
            do_zero_padding=True,
        )
        data, scales = split(tma[0])
        plain_data, plain_scales = split(plain[0])
        num_rows = plain_scales.shape[0]
        assert scales.shape == plain_scales.shape, f"rank {rank}: scales {tuple(scales.shape)}"
        assert scales.stride() == (1, (num_rows + 3) // 4 * 4), f"rank {rank}: strides {scales.stride()}"
        assert_bitwise_equal("col-major scales", scales.contiguous(), plain_scales)
        assert_bitwise_equal("recv_x with col-major scales", data, plain_data)
        # The stats gained exactly this call's unaligned per-expert counts.
        counts = plain[3].num_unaligned_recv_tokens_per_expert
        assert torch.equal(stats, counts + 7), f"rank {rank}: stats {stats.tolist()} vs counts {counts.tolist()}"

        with pytest.raises(ValueError, match="exceeds num_allocated_qps=17"):
            dispatch_case(buffer, rank, case, inputs, num_qps=18)
        with pytest.raises(ValueError, match="cannot be used with a cached handle"):
            dispatch_case(buffer, rank, case, inputs, handle=plain[3], cumulative_local_expert_recv_stats=stats)
        buffer.check_errors()  # every rank refused the same calls: no peer report is left behind
    finally:
        buffer.destroy()


def test_v2_arguments_keep_v2_meaning(num_ranks):
    launch(_v2_arguments, num_ranks)
