"""HT dispatch and combine against the reference model, bitwise, on random cases (outputs, the
handle's source arrays and DeepEP V2's recv_src_metadata built from them).

Inputs are uneven per rank with one rank at T = 0, one all -1 token per rank, about 10 % random -1
entries and (some cases) one hot expert taking half the traffic. All cases of a rank count run in
one launch on one buffer sized for the largest.
"""

from __future__ import annotations

import torch
from ht_checks import Case, check_src_metadata, device, dispatch_case, group_inputs, make_buffer, run_case

from deep_ep import per_token_cast_to_fp8
from deep_ep.testing import launch

CASES = [
    Case("bf16 H2048 K8 E64", 2048, 8, 64, 512, False, seed=1),
    Case(
        "fp8 H4096 K6 E256 expand a128 hot 1 bias",
        4096,
        6,
        256,
        1024,
        True,
        do_expand=True,
        expert_alignment=128,
        num_biases=1,
        hot_expert=3,
        seed=2,
    ),
    Case(
        "bf16 H7168 K1 E=R expand identity 2 biases",
        7168,
        1,
        -1,
        256,
        False,
        do_expand=True,
        num_biases=2,
        scale_outputs=False,
        seed=3,
    ),
    Case("fp8 H7168 K8 E256 T4096 hot 2 biases", 7168, 8, 256, 4096, True, num_biases=2, hot_expert=0, seed=4),
    Case(
        "bf16 H2048 K6 E64 expand a128 no weights",
        2048,
        6,
        64,
        2048,
        False,
        do_expand=True,
        expert_alignment=128,
        with_weights=False,
        seed=5,
    ),
    Case(
        "bf16 H4096 K8 E256 T300 identity 1 bias", 4096, 8, 256, 300, False, num_biases=1, scale_outputs=False, seed=6
    ),
    Case("fp8 H2048 K8 E=R a128", 2048, 8, -1, 700, True, expert_alignment=128, seed=7),
    Case("bf16 H4096 K6 E64 expand a1 hot", 4096, 6, 64, 1500, False, do_expand=True, hot_expert=63, seed=8),
    # More local experts than the notify's 256 threads at 1 and 2 ranks: its per-expert prefix runs
    # in chunks with a carry (expert_start of the later chunks).
    Case("bf16 H2048 K8 E1024 expand a4", 2048, 8, 1024, 384, False, do_expand=True, expert_alignment=4, seed=9),
]


def _nothing_received(buffer, num_ranks):
    """Every rank dispatches T = 0: empty outputs and handle arrays (null data pointers), and the
    combine of nothing, expand or not, must work (it once refused: "expand combine needs the
    expanded row map")."""
    num_experts = 8 * num_ranks
    hidden = 2048
    for do_expand in (False, True):
        for use_fp8 in (False, True):
            x = torch.empty(0, hidden, dtype=torch.bfloat16, device=device())
            dispatched = per_token_cast_to_fp8(x) if use_fp8 else x
            topk_idx = torch.empty(0, 4, dtype=torch.int64, device=device())
            weights = torch.empty(0, 4, dtype=torch.float32, device=device())
            recv_x, _, recv_weights, handle, _ = buffer.dispatch(
                dispatched, topk_idx, weights, num_experts=num_experts, do_expand=do_expand, expert_alignment=4
            )
            rows = recv_x[0] if use_fp8 else recv_x
            assert handle.num_recv_tokens == 0 and rows.shape == (0, hidden), (do_expand, use_fp8, rows.shape)
            assert handle.num_recv_tokens_per_expert_list == [0] * (num_experts // num_ranks)
            assert handle.recv_src_info.shape == (0, 4) and handle.recv_src_metadata.shape == (0, 4 + 2)
            y = torch.empty(rows.shape, dtype=torch.bfloat16, device=device())
            combined, combined_weights, _ = buffer.combine(y, handle, topk_weights=recv_weights)
            assert combined.shape == (0, hidden) and combined_weights.shape == (0, 4)


def _src_metadata_without_cpu_sync_then_cached(buffer, rank, num_ranks):
    """DeepEP V2's handle.recv_src_metadata (and recv_src_info) of a dispatch without CPU sync: worst-
    case rows, the received ones bitwise equal to the reference; a cached dispatch through that
    handle leaves them so (it does not rewrite them). Non-expand and expand."""
    for case in CASES[:2]:
        inputs = group_inputs(case, num_ranks)
        handle = dispatch_case(buffer, rank, case, inputs, do_cpu_sync=False)[3]
        num_topk = inputs.topk_idxs[rank].shape[1]
        assert handle.recv_src_metadata.shape == (num_ranks * case.num_max_tokens, num_topk + 2), case.name
        check_src_metadata(case, rank, inputs, handle)
        dispatch_case(buffer, rank, case, inputs, handle=handle)
        check_src_metadata(case, rank, inputs, handle)


def _run_cases(rank, num_ranks, group):
    buffer = make_buffer(group)
    try:
        _nothing_received(buffer, num_ranks)
        for case in CASES:
            run_case(buffer, rank, num_ranks, case)
        _src_metadata_without_cpu_sync_then_cached(buffer, rank, num_ranks)
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    finally:
        buffer.destroy()


def test_dispatch_and_combine_match_reference_bitwise(num_ranks):
    launch(_run_cases, num_ranks)
