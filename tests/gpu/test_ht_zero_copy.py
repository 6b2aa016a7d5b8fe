"""HT zero-copy receive (``dispatch(..., zero_copy_recv=True)``, direct mode, non-expand): senders write
each row and its fp8 scales in final position in the receiver's window, so ``recv_x`` is a view of
the buffer. Results must be bitwise those of the copy path in every mode (CPU sync, cached, no CPU
sync, async), the combine through a zero-copy handle must equal the combine through a copy handle,
and refused or failed calls must leave every rank's buffer usable and its workspace clean."""

from __future__ import annotations

import pytest
import torch
from ht_checks import (
    Case,
    assert_bitwise_equal,
    assert_outputs_equal,
    check_src_metadata,
    device,
    dispatch_case,
    expert_output,
    group_inputs,
    keep_compute_stream_busy,
    make_buffer,
    split,
)

import deep_ep
from deep_ep.testing import launch

FP8 = Case("fp8 H2048 K8 E64", 2048, 8, 64, 512, True, seed=41)
BF16_NO_WEIGHTS = Case("bf16 H2048 K6 E64 no weights", 2048, 6, 64, 384, False, with_weights=False, seed=42)


def _window_span(buffer) -> tuple[int, int]:
    base = buffer._runtime.local_base()
    return base, base + buffer._window["ht_offset"] + buffer._window["ht_bytes"]


def _assert_window_view(name: str, buffer, recv_x) -> None:
    """The rows (and scales) live in this rank's window: zero-copy really happened."""
    low, high = _window_span(buffer)
    for part, tensor in zip(("recv_x", "scales"), split(recv_x), strict=True):
        if tensor is None or tensor.numel() == 0:
            continue
        pointer = tensor.data_ptr()
        assert low <= pointer and pointer + tensor.numel() * tensor.element_size() <= high, (
            f"{name}: {part} at {pointer:#x} is not inside the window [{low:#x}, {high:#x})"
        )


def _combine_equal(name: str, buffer, rank: int, got: tuple, want: tuple) -> None:
    """Combine through the zero-copy handle equals combine through the copy handle. The expert
    output is computed from the zero-copy view before the first combine overwrites the window."""
    y = expert_output(want[0], rank, True)
    y_zero_copy = expert_output(got[0], rank, True)
    assert_bitwise_equal(f"{name}: expert output from the view", y_zero_copy, y)
    reference = buffer.combine(y, want[3], topk_weights=want[2])
    combined = buffer.combine(y_zero_copy, got[3], topk_weights=got[2])
    assert_bitwise_equal(f"{name}: combine", combined[0], reference[0])
    if reference[1] is not None:
        assert_bitwise_equal(f"{name}: combine weights", combined[1], reference[1])


def _zero_copy_equals_copy(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=512, hidden=2048)
    try:
        for case in (FP8, BF16_NO_WEIGHTS):
            inputs = group_inputs(case, num_ranks)
            want = dispatch_case(buffer, rank, case, inputs)
            rows = want[3].num_recv_tokens

            got = dispatch_case(buffer, rank, case, inputs, zero_copy_recv=True)
            name = f"{case.name} zero-copy"
            _assert_window_view(name, buffer, got[0])
            assert_outputs_equal(name, got, want)
            assert got[3].zero_copy_send_base is not None and want[3].zero_copy_send_base is None
            assert got[3].num_recv_tokens == rows
            check_src_metadata(case, rank, inputs, got[3])
            handle = got[3]
            _combine_equal(name, buffer, rank, got, want)

            cached = dispatch_case(buffer, rank, case, inputs, handle=handle, zero_copy_recv=True)
            _assert_window_view(f"{name} cached", buffer, cached[0])
            assert_outputs_equal(f"{name} cached", cached, want)
            assert cached[3] is handle
            # The zero-copy handle also serves a cached copy dispatch.
            assert_outputs_equal(
                f"{name} handle, cached copy", dispatch_case(buffer, rank, case, inputs, handle=handle), want
            )

            unsynced = dispatch_case(buffer, rank, case, inputs, do_cpu_sync=False, zero_copy_recv=True)
            assert split(unsynced[0])[0].shape[0] == num_ranks * case.num_max_tokens
            assert_outputs_equal(f"{name} no cpu sync", unsynced, want, rows)
            loose = unsynced[3]
            cached_loose = dispatch_case(buffer, rank, case, inputs, handle=loose, zero_copy_recv=True)
            assert_outputs_equal(f"{name} cached from a no-sync handle", cached_loose, want, rows)

            result = dispatch_case(buffer, rank, case, inputs, zero_copy_recv=True, async_with_compute_stream=True)
            keep_compute_stream_busy()
            result[4].current_stream_wait()
            assert_outputs_equal(f"{name} async", result, want)
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    finally:
        buffer.destroy()


def test_zero_copy_receive_equals_the_copy_path(num_ranks):
    launch(_zero_copy_equals_copy, num_ranks)


def _refused_and_failed(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=512, hidden=2048)
    outcomes = {}
    try:
        case = FP8
        inputs = group_inputs(case, num_ranks)
        want = dispatch_case(buffer, rank, case, inputs)

        def expect_refusal(label: str, match: str, call) -> None:
            with pytest.raises(ValueError, match=match):
                call()
            torch.cuda.synchronize()
            # Every rank refused and took part without data: each raised its own error, and none
            # reports the others' (deep_ep/failed_input.py).
            buffer.check_errors()
            assert_outputs_equal(f"copy dispatch after {label}", dispatch_case(buffer, rank, case, inputs), want)

        # The uncached refusal takes part in the zero-copy notify (its row-offset exchange) without data.
        expect_refusal(
            "expand",
            "non-expand rows only",
            lambda: buffer.dispatch(
                inputs.xs[rank],
                inputs.topk_idxs[rank],
                inputs.weights[rank],
                num_experts=case.experts(num_ranks),
                num_max_tokens_per_rank=case.num_max_tokens,
                do_expand=True,
                zero_copy_recv=True,
            ),
        )
        expect_refusal(
            "a copy handle",
            "without zero_copy_recv",
            lambda: dispatch_case(buffer, rank, case, inputs, handle=want[3], zero_copy_recv=True),
        )

        # One rank's input fails (T > T_max) while its peers run a zero-copy dispatch: the peers
        # raise PeerInputError from the CPU-synced count wait, nobody hangs, and the next zero-copy
        # dispatch is exact.
        bad_rank = num_ranks - 1
        x = inputs.xs[rank]
        if rank == bad_rank:
            data, scales = x
            x = (
                data.new_zeros((case.num_max_tokens + 1, case.hidden)),
                scales.new_zeros((case.num_max_tokens + 1, 16)),
            )
        try:
            buffer.dispatch(
                x,
                inputs.topk_idxs[rank],
                inputs.weights[rank],
                num_experts=case.experts(num_ranks),
                num_max_tokens_per_rank=case.num_max_tokens,
                zero_copy_recv=True,
            )
            outcomes["mixed"] = "ok"
        except deep_ep.PeerInputError:
            outcomes["mixed"] = "PeerInputError"
        except ValueError:
            outcomes["mixed"] = "ValueError"
        torch.cuda.synchronize()
        try:
            buffer.check_errors()
        except deep_ep.PeerInputError:
            pass
        got = dispatch_case(buffer, rank, case, inputs, zero_copy_recv=True)
        assert_outputs_equal("zero-copy dispatch after a failed input", got, want)
        buffer._check_device_errors()
        outcomes["dirty_workspace_bytes"] = buffer._debug_count_dirty_workspace_bytes()
    finally:
        buffer.destroy()
    return outcomes


def test_zero_copy_refusals_and_a_failed_input_leave_buffers_usable(num_ranks):
    if num_ranks < 2:
        pytest.skip("needs peers")
    results = launch(_refused_and_failed, num_ranks)
    bad_rank = num_ranks - 1
    for rank, result in enumerate(results):
        assert result["mixed"] == ("ValueError" if rank == bad_rank else "PeerInputError"), (rank, result)
        assert result["dirty_workspace_bytes"] == 0, (rank, result)


def _hybrid_refuses(rank, num_ranks, group):
    buffer = make_buffer(
        group, num_max_tokens_per_rank=512, hidden=2048, num_ranks_per_node=num_ranks // 2, allow_hybrid_mode=True
    )
    try:
        case = FP8
        inputs = group_inputs(case, num_ranks)
        with pytest.raises(ValueError, match="direct mode only"):
            dispatch_case(buffer, rank, case, inputs, zero_copy_recv=True)
        torch.cuda.synchronize()
        buffer.check_errors()  # every rank refused: none reports the others' failed input
        got = dispatch_case(buffer, rank, case, inputs)  # the hybrid copy path still works
        assert split(got[0])[0].device == device()
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    finally:
        buffer.destroy()


def test_zero_copy_receive_is_refused_in_hybrid_mode(num_ranks):
    if num_ranks < 4 or num_ranks % 2:
        pytest.skip(f"2 virtual nodes of at least 2 ranks need an even count >= 4; this run launches {num_ranks}")
    launch(_hybrid_refuses, num_ranks)
