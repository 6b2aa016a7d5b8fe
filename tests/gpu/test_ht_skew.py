"""HT operations back to back while one rank lags: nothing a slow rank still reads is overwritten.

The uncached dispatch has no entry barrier in direct mode: its count exchange is the gate (a fast
rank's dispatch kernel writes into a peer's window only after that peer's counts of the same
operation arrived, i.e. after the peer finished everything it queued before). Here the last rank
holds back, through ``previous_event_before_epilogue``, its dispatch copy epilogue (which reads its
receive slots) and its combine reduce (which reads the pushed rows), and in zero-copy mode it reads
its ``recv_x`` view late, behind ~10 ms of work on its own stream, while the other ranks go on to
the next dispatch at once. Every result must be bitwise the one of the same sequence run with a
barrier between operations, and the workspace must be back to zero."""

from __future__ import annotations

import pytest
import torch
from ht_checks import Case, assert_bitwise_equal, dispatch_case, expert_output, group_inputs, make_buffer, split

from deep_ep.testing import launch

SKEW_CYCLES = 20_000_000  # about 10 ms of GPU time: far longer than these operations
CASES = (
    Case("fp8 H2048 K8 E64", 2048, 8, 64, 512, True, seed=61),
    Case("bf16 H2048 K6 E64", 2048, 6, 64, 384, False, seed=62),
)
ROUNDS = 4  # operations per mode, the cases alternating (each reuses what the one before wrote)


def _late_event() -> torch.cuda.Event:
    """An event that completes ~10 ms after the work queued so far on the current stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SKEW_CYCLES)
    event = torch.cuda.Event()
    event.record(side)
    return event


def _sequence(buffer, rank: int, inputs: list, zero_copy: bool, slow: bool, in_step: bool) -> list:
    """Dispatch + combine ROUNDS times; per round the received rows, scales, weights and the
    combined rows (clones where they are window views). ``in_step``: a barrier after each
    operation (the reference); ``slow``: this rank lags as described in the module docstring."""
    results = []

    def step() -> None:
        if in_step:
            buffer.barrier(with_cpu_sync=True)

    for index in range(ROUNDS):
        case = CASES[index % len(CASES)]
        lag = {"previous_event_before_epilogue": _late_event()} if slow and not zero_copy else {}
        recv_x, _, recv_weights, handle, _ = dispatch_case(
            buffer, rank, case, inputs[index % len(CASES)], zero_copy_recv=zero_copy, **lag
        )
        if slow and zero_copy:
            torch.cuda._sleep(SKEW_CYCLES)  # the caller's stream reads the view late
        data, scales = split(recv_x)
        kept = [data.clone(), None if scales is None else scales.clone(), recv_weights.clone()]
        step()
        y = expert_output(recv_x, rank, True)
        lag = {"previous_event_before_epilogue": _late_event()} if slow else {}
        combined, _, _ = buffer.combine(y, handle, topk_weights=recv_weights, **lag)
        results.append((case.name, *kept, combined))
        step()
    return results


def _lagging_rank(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=512, hidden=2048)
    try:
        inputs = [group_inputs(case, num_ranks) for case in CASES]
        slow = rank == num_ranks - 1
        for zero_copy in (False, True):
            want = _sequence(buffer, rank, inputs, zero_copy, slow=False, in_step=True)
            got = _sequence(buffer, rank, inputs, zero_copy, slow=slow, in_step=False)
            torch.cuda.synchronize()
            for index, (expected, actual) in enumerate(zip(want, got, strict=True)):
                name = f"{'zero-copy' if zero_copy else 'copy'} round {index} ({expected[0]}), rank {rank}"
                parts = ("recv_x", "scales", "weights", "combined")
                for part, got_part, want_part in zip(parts, actual[1:], expected[1:], strict=True):
                    if want_part is None:
                        assert got_part is None, f"{name}: {part} should be None"
                    else:
                        assert_bitwise_equal(f"{name}: {part}", got_part, want_part)
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    finally:
        buffer.destroy()


def test_a_lagging_rank_never_has_its_window_overwritten(num_ranks):
    if num_ranks < 2:
        pytest.skip("needs peers")
    launch(_lagging_rank, num_ranks)
