"""HT zero-copy receive (``dispatch(..., zero_copy_recv=True)``, direct mode, non-expand): senders write
each row and its fp8 scales in final position in the receiver's window, so ``recv_x`` is a view of
the buffer. Results must be bitwise those of the copy path in every mode (CPU sync, cached, no CPU
sync, async), the combine through a zero-copy handle must equal the combine through a copy handle,
and refused or failed calls must leave every rank's buffer usable and its workspace clean.

Zero-copy combine (``combine(get_combine_input_buffer(handle), handle, zero_copy=True)``, a buffer
built with ``zero_copy_combine=True``): each home rank reads its tokens' rows from the peers' windows;
the result must be bitwise the push combine's, with biases and weights, repeatedly, and a rank whose
combine input fails must count as absent in its peers' results."""

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
    group_biases,
    group_inputs,
    keep_compute_stream_busy,
    make_buffer,
    split,
)

import deep_ep
from deep_ep import _C
from deep_ep.testing import launch

FP8 = Case("fp8 H2048 K8 E64", 2048, 8, 64, 512, True, num_biases=2, seed=41)
BF16_NO_WEIGHTS = Case(
    "bf16 H2048 K6 E64 no weights", 2048, 6, 64, 384, False, with_weights=False, num_biases=1, seed=42
)


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

            # The zero-copy combine needs room the buffer was not built with, unless this shape's
            # footprint happens to fit (one rank, the smaller bf16 case: T_max 384, K 6): then the
            # rows are a view inside the HT region.
            needed = _C.high_throughput_layout(
                num_ranks, num_ranks, case.num_max_tokens, case.hidden, case.topk(num_ranks), False, False
            )["zero_copy_combine_bytes"]
            if needed > buffer._window["ht_bytes"]:
                with pytest.raises(deep_ep.BufferTooSmallError, match="zero_copy_combine=True"):
                    buffer.get_combine_input_buffer(handle)
            else:
                rows_view = buffer.get_combine_input_buffer(handle)
                assert tuple(rows_view.shape) == (rows, case.hidden), (name, tuple(rows_view.shape))
                low, high = _window_span(buffer)
                end = rows_view.data_ptr() + rows_view.numel() * rows_view.element_size()
                assert low <= rows_view.data_ptr() and end <= high, (name, "combine input rows outside the window")
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


def _combine_pairs(buffer, case, handle, y, weights, bias, scale):
    """(push result, pull result) of one combine of ``scale`` x the expert output ``y``."""
    if scale != 1:
        y = (y.float() * scale).bfloat16()
    want = buffer.combine(y, handle, topk_weights=weights, bias=bias)
    rows = buffer.get_combine_input_buffer(handle, hidden=case.hidden)
    assert rows.shape == y.shape and rows.dtype == torch.bfloat16, (rows.shape, y.shape)
    rows.copy_(y)
    got = buffer.combine(rows, handle, topk_weights=weights, bias=bias, zero_copy=True)
    return want, got


def _assert_combined_equal(name: str, got: tuple, want: tuple) -> None:
    assert_bitwise_equal(f"{name}: combined_x", got[0], want[0])
    if want[1] is None:
        assert got[1] is None, f"{name}: combined weights should be None"
    else:
        assert_bitwise_equal(f"{name}: combined weights", got[1], want[1])


def _zero_copy_combine(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=512, hidden=2048, zero_copy_combine=True)
    outcomes = {}
    try:
        for case in (FP8, BF16_NO_WEIGHTS):
            inputs = group_inputs(case, num_ranks)
            biases = group_biases(case, inputs.num_tokens)
            bias = None if biases is None else biases[rank]
            recv = dispatch_case(buffer, rank, case, inputs, zero_copy_recv=True)
            handle = recv[3]
            # Before any combine: a push combine overwrites the zero-copy recv_x (its lifetime rule).
            y = expert_output(recv[0], rank, True)
            # Several combines in a row with new outputs: the exit barrier keeps a fast rank from
            # overwriting rows a slower peer still reads.
            for scale in (1, 3, 0.5):
                want, got = _combine_pairs(buffer, case, handle, y, recv[2], bias, scale)
                _assert_combined_equal(f"{case.name} pull x{scale}", got, want)
            with pytest.raises(ValueError, match="get_combine_input_buffer"):
                other = torch.zeros((handle.num_recv_tokens, case.hidden), dtype=torch.bfloat16, device=device())
                buffer.combine(other, handle, zero_copy=True)
            torch.cuda.synchronize()
            buffer.check_errors()  # every rank refused: none reports the others

            # A handle without CPU sync: worst-case rows, the valid prefix holds the outputs.
            loose_recv = dispatch_case(buffer, rank, case, inputs, do_cpu_sync=False, zero_copy_recv=True)
            loose = loose_recv[3]
            rows = buffer.get_combine_input_buffer(loose, hidden=case.hidden)
            assert rows.shape[0] == num_ranks * case.num_max_tokens
            rows.zero_()
            rows[: y.shape[0]].copy_(y)
            weights = None
            if recv[2] is not None:
                weights = torch.zeros((rows.shape[0], recv[2].shape[1]), dtype=torch.float32, device=device())
                weights[: recv[2].shape[0]] = recv[2]
            got = buffer.combine(
                rows, loose, topk_weights=weights, bias=bias, zero_copy=True, async_with_compute_stream=True
            )
            keep_compute_stream_busy()
            got[2].current_stream_wait()
            want = buffer.combine(y, handle, topk_weights=recv[2], bias=bias)
            _assert_combined_equal(f"{case.name} pull, no-sync handle, async", got, want)

        # A copy handle cannot serve a zero-copy combine.
        copy = dispatch_case(buffer, rank, FP8, group_inputs(FP8, num_ranks))
        with pytest.raises(ValueError, match="zero_copy_recv=True dispatch"):
            buffer.get_combine_input_buffer(copy[3])

        # One rank's combine input fails (x is not its combine input rows): it zeroes its rows, so every
        # peer's result is the push combine in which that rank sent zero rows.
        case = FP8
        inputs = group_inputs(case, num_ranks)
        bad_rank = num_ranks - 1
        recv = dispatch_case(buffer, rank, case, inputs, zero_copy_recv=True)
        handle = recv[3]
        y = expert_output(recv[0], rank, True)
        absent = buffer.combine(torch.zeros_like(y) if rank == bad_rank else y, handle, topk_weights=recv[2])
        rows = buffer.get_combine_input_buffer(handle, hidden=case.hidden)
        rows.copy_(y)
        try:
            result = buffer.combine(
                y.clone() if rank == bad_rank else rows, handle, topk_weights=recv[2], zero_copy=True
            )
            outcomes["failed_input"] = "ok"
            torch.cuda.synchronize()
            try:
                buffer.check_errors()
            except deep_ep.PeerInputError:
                outcomes["failed_input"] = "PeerInputError"
            outcomes["absent_exact"] = bool(torch.equal(result[0], absent[0]))
        except ValueError:
            outcomes["failed_input"] = "ValueError"
        torch.cuda.synchronize()
        want, got = _combine_pairs(buffer, case, handle, y, recv[2], None, 1)
        _assert_combined_equal("pull after a failed input", got, want)
        buffer._check_device_errors()
        outcomes["dirty_workspace_bytes"] = buffer._debug_count_dirty_workspace_bytes()
    finally:
        buffer.destroy()
    return outcomes


def test_zero_copy_combine_equals_the_push_combine(num_ranks):
    results = launch(_zero_copy_combine, num_ranks)
    bad_rank = num_ranks - 1
    for rank, result in enumerate(results):
        assert result["dirty_workspace_bytes"] == 0, (rank, result)
        if num_ranks == 1:
            assert result["failed_input"] == "ValueError", result
        elif rank == bad_rank:
            assert result["failed_input"] == "ValueError", (rank, result)
        else:
            assert result["failed_input"] == "PeerInputError" and result["absent_exact"], (rank, result)
