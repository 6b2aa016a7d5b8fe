"""HT dispatch/combine modes: cached handle, no CPU sync, events and streams, CUDA graphs, and a
long run with changing routing."""

from __future__ import annotations

import torch
from ht_checks import (
    Case,
    assert_bitwise_equal,
    assert_outputs_equal,
    device,
    dispatch_case,
    expert_output,
    group_inputs,
    keep_compute_stream_busy,
    make_buffer,
)

from deep_ep import per_token_cast_back, per_token_cast_to_fp8
from deep_ep.testing import launch
from deep_ep.testing.data import make_routing, make_tokens, make_weights
from deep_ep.testing.reference import ht_combine, ht_dispatch

NON_EXPAND = Case("fp8 H2048 K8 E64", 2048, 8, 64, 512, True, num_biases=1, seed=21)
EXPAND = Case("bf16 H2048 K6 E64 expand a64", 2048, 6, 64, 384, False, do_expand=True, expert_alignment=64, seed=22)


def _cached_no_sync_and_events(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=512, hidden=2048)
    try:
        for case in (NON_EXPAND, EXPAND):
            inputs = group_inputs(case, num_ranks)
            synced = dispatch_case(buffer, rank, case, inputs)
            handle = synced[3]
            rows = handle.num_expanded_tokens if case.do_expand else handle.num_recv_tokens

            cached = dispatch_case(buffer, rank, case, inputs, handle=handle)
            assert_outputs_equal(f"{case.name} cached", cached, synced)
            assert cached[3] is handle

            unsynced = dispatch_case(buffer, rank, case, inputs, do_cpu_sync=False)
            loose = unsynced[3]
            assert (
                loose.num_recv_tokens == num_ranks * case.num_max_tokens and loose.num_recv_tokens_per_expert_list == []
            )
            assert int(loose.psum_num_recv_tokens_per_scaleup_rank[-1]) == handle.num_recv_tokens
            for field in (
                "psum_num_recv_tokens_per_scaleup_rank",
                "psum_num_recv_tokens_per_expert",
                "num_unaligned_recv_tokens_per_expert",
            ):
                assert_bitwise_equal(f"{case.name} {field}", getattr(loose, field), getattr(handle, field))
            assert_outputs_equal(f"{case.name} no cpu sync", unsynced, synced, rows)
            cached_loose = dispatch_case(buffer, rank, case, inputs, handle=loose)
            assert_outputs_equal(f"{case.name} cached from no-sync handle", cached_loose, synced, rows)

            # Combine through either handle: the worst-case input carries the same valid rows.
            y = expert_output(synced[0], rank, True)
            y_loose = torch.zeros(
                loose.num_expanded_tokens if case.do_expand else loose.num_recv_tokens,
                y.shape[1],
                dtype=y.dtype,
                device=y.device,
            )
            y_loose[:rows] = y
            weights_loose = None
            if synced[2] is not None:
                weights_loose = torch.zeros(
                    (y_loose.shape[0], *synced[2].shape[1:]), dtype=torch.float32, device=y.device
                )
                weights_loose[:rows] = synced[2]
            want = buffer.combine(y, handle, topk_weights=synced[2])
            got = buffer.combine(y_loose, loose, topk_weights=weights_loose)
            assert_bitwise_equal(f"{case.name} combine no-sync handle", got[0], want[0])
            assert_bitwise_equal(f"{case.name} combine no-sync weights", got[1], want[1])

            # Streams and events: every combination returns the same bits.
            for flags, wait_for_previous in (
                ({"async_with_compute_stream": True}, False),
                ({"allocate_on_comm_stream": True}, True),
                ({"allocate_on_comm_stream": True, "async_with_compute_stream": True}, True),
                ({"allocate_on_comm_stream": True}, False),
                # previous_event without allocate_on_comm_stream (DeepEP's default): allocated on comm.
                ({}, True),
                ({"async_with_compute_stream": True}, True),
            ):
                label = f"{case.name} {sorted(flags)} previous_event={wait_for_previous}"
                previous = {"previous_event": buffer.capture()} if wait_for_previous else {}
                result = dispatch_case(buffer, rank, case, inputs, **flags, **previous)
                if flags.get("async_with_compute_stream"):
                    keep_compute_stream_busy()
                    result[4].current_stream_wait()
                assert_outputs_equal(label, result, synced)
                previous = {"previous_event": buffer.capture()} if wait_for_previous else {}
                combined = buffer.combine(y, result[3], topk_weights=result[2], **flags, **previous)
                if flags.get("async_with_compute_stream"):
                    keep_compute_stream_busy()
                    combined[2].current_stream_wait()
                assert_bitwise_equal(f"{label} combine", combined[0], want[0])
                assert_bitwise_equal(f"{label} combine weights", combined[1], want[1])
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    finally:
        buffer.destroy()


def test_cached_no_cpu_sync_and_event_variants_equal_synced_dispatch(num_ranks):
    launch(_cached_no_sync_and_events, num_ranks)


GRAPH_CASE = Case("graph bf16 H2048 K8 E64", 2048, 8, 64, 128, False, seed=31)
NUM_REPLAYS = 100


def _replay_inputs(replay, num_ranks, routing_group):
    """New token data (same routing) for one replay, identical on every rank."""
    generator = torch.Generator().manual_seed(1_000 + replay)
    return [make_tokens(count, GRAPH_CASE.hidden, generator).to(device()) for count in routing_group.num_tokens]


def _cuda_graph(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=128, hidden=2048)
    try:
        case = GRAPH_CASE
        num_experts = case.experts(num_ranks)
        inputs = group_inputs(case, num_ranks)
        first = dispatch_case(buffer, rank, case, inputs)
        handle = first[3]
        x_static = inputs.xs[rank].clone()
        weights_static = inputs.weights[rank].clone()
        # Warm up the cached path outside the capture, then capture dispatch + identity experts + combine.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            recv = buffer.dispatch(x_static, topk_weights=weights_static, handle=handle)
            buffer.combine(recv[0], handle, topk_weights=recv[2])
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv_x, _, recv_weights, _, _ = buffer.dispatch(x_static, topk_weights=weights_static, handle=handle)
            combined, combined_weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_weights)
        # Routing and weights stay fixed across replays, so the reference's row order and combined
        # weights are computed once; per replay the expected rows are a gather of the new tokens and
        # the identity-expert combine has a closed form (checked against ht_combine in the first replay).
        reference = ht_dispatch(inputs.xs, inputs.topk_idxs, inputs.weights, num_experts)
        src_rank = reference[rank]["src_rank"].to(device())
        src_token = reference[rank]["src_token"].to(device())
        expected_weights = ht_combine(
            reference,
            [r["x"] for r in reference],
            inputs.topk_idxs,
            num_experts,
            weights_list=[r["topk_weights"] for r in reference],
        )[rank]["topk_weights"]
        for replay in range(NUM_REPLAYS):
            xs = _replay_inputs(replay, num_ranks, inputs)
            x_static.copy_(xs[rank])
            graph.replay()
            expected_rows = torch.cat([xs[source][src_token[src_rank == source]] for source in range(num_ranks)])
            expected_x = _round_trip_expected(xs[rank], inputs.topk_idxs[rank], num_ranks, num_experts, False)
            if replay == 0:
                dispatched = ht_dispatch(xs, inputs.topk_idxs, inputs.weights, num_experts)
                full = ht_combine(dispatched, [r["x"] for r in dispatched], inputs.topk_idxs, num_experts)[rank]["x"]
                assert_bitwise_equal("closed form vs reference", expected_x, full)
            assert_bitwise_equal(f"replay {replay} recv_x", recv_x, expected_rows)
            assert_bitwise_equal(f"replay {replay} combined_x", combined, expected_x)
            assert_bitwise_equal(f"replay {replay} combined weights", combined_weights, expected_weights)
        torch.cuda.synchronize()
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
        del graph
        # A CPU-synced dispatch cannot be captured: it raises before launching anything (so no peer
        # waits for it) and the buffer stays usable.
        refused = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(refused):
                dispatch_case(buffer, rank, case, inputs)
        except RuntimeError as error:
            assert "cannot be captured in a CUDA graph" in str(error), error
        else:
            raise AssertionError("a CPU-synced dispatch was captured")
        del refused
        assert_outputs_equal("eager dispatch after a refused capture", dispatch_case(buffer, rank, case, inputs), first)
    finally:
        buffer.destroy()


def test_cuda_graph_of_cached_dispatch_and_combine_replays_with_new_data(num_ranks):
    launch(_cuda_graph, num_ranks)


STRESS_ITERATIONS = 500
STRESS_TOKENS = 256
STRESS_HIDDEN = 2048
STRESS_EXPERTS = 64
STRESS_TOPK = 8


def _round_trip_expected(x_bf16, topk_idx, num_ranks, num_experts, do_expand):
    """Combine of identity experts, computed from this rank's inputs alone: each destination rank
    contributes bf16(m * x) (m = the token's experts there in expand mode, else 1), summed in fp32
    and rounded once. m * x is exact in fp32 for m <= 32, and so is every partial sum of these
    multiples of x's last bit (at most 14 significant bits), so the order of the ranks (DeepEP V2's
    in the kernels, ascending here) changes no bit."""
    num_local = num_experts // num_ranks
    ranks = torch.where(topk_idx >= 0, topk_idx // num_local, torch.full_like(topk_idx, -1))
    acc = torch.zeros(x_bf16.shape, dtype=torch.float32, device=x_bf16.device)
    for dest in range(num_ranks):
        hits = (ranks == dest).sum(dim=1, keepdim=True)
        multiplier = hits if do_expand else (hits > 0).to(hits.dtype)
        acc = acc + (x_bf16.float() * multiplier.float()).to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def _stress(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=STRESS_TOKENS, hidden=STRESS_HIDDEN, num_topk=STRESS_TOPK)
    try:
        generator = torch.Generator().manual_seed(5_000 + rank)
        baseline = None
        for iteration in range(STRESS_ITERATIONS):
            if iteration == 10:
                torch.cuda.synchronize()
                baseline = torch.cuda.memory_allocated()
            num_tokens = int(torch.randint(0, STRESS_TOKENS + 1, (1,), generator=generator))
            topk_idx = make_routing(num_tokens, STRESS_EXPERTS, STRESS_TOPK, generator=generator).to(device())
            weights = make_weights(topk_idx, generator).to(device())
            x = make_tokens(num_tokens, STRESS_HIDDEN, generator).to(device())
            use_fp8 = iteration % 2 == 1
            do_expand = iteration % 3 == 2
            if use_fp8:
                dispatched = per_token_cast_to_fp8(x)
                x = per_token_cast_back(*dispatched)
            else:
                dispatched = x
            recv_x, _, recv_weights, handle, _ = buffer.dispatch(
                dispatched,
                topk_idx,
                weights,
                num_experts=STRESS_EXPERTS,
                do_expand=do_expand,
                expert_alignment=16 if do_expand else 1,
            )
            combined, combined_weights, _ = buffer.combine(
                expert_output(recv_x, rank, False), handle, topk_weights=recv_weights
            )
            expected = _round_trip_expected(x, topk_idx, num_ranks, STRESS_EXPERTS, do_expand)
            assert_bitwise_equal(f"iteration {iteration} combined_x", combined, expected)
            want_weights = torch.where(topk_idx >= 0, weights, torch.zeros_like(weights))
            assert_bitwise_equal(f"iteration {iteration} combined weights", combined_weights, want_weights)
        del recv_x, recv_weights, handle, combined, combined_weights
        torch.cuda.synchronize()
        growth = torch.cuda.memory_allocated() - baseline
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
        return growth
    finally:
        buffer.destroy()


def test_500_dispatch_combine_iterations_with_changing_routing_keep_memory_flat(num_ranks):
    growth = launch(_stress, num_ranks)
    # Live tensors of one iteration may differ in size from those at the baseline; nothing accumulates.
    limit = 4 * STRESS_TOKENS * num_ranks * (STRESS_HIDDEN * 2 + 64) + (1 << 20)
    assert all(value < limit for value in growth), growth
