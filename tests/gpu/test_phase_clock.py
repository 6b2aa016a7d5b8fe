"""Phase clock (EP_PHASE_CLOCK=1): the kernels stamp every phase of a call, in order, with results
unchanged; without it the buffer has no clock to read.

Each rank collects its findings and the test fails on the first rank's list, so that no rank stops
early while its peers wait in a collective call."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator

import pytest
import torch
from ht_checks import Case, dispatch_case, expert_output, group_inputs
from ll_calls import bits, ll_expert_output, reference_case

import deep_ep
from deep_ep import phase_clock
from deep_ep.testing import launch
from deep_ep.testing.data import make_group_inputs

HIDDEN = 2048
CASE = Case("fp8 H2048 K8 E64", HIDDEN, 8, 64, 256, True, seed=71)
LL_TOKENS = 64
LL_EXPERTS = 64
LL_TOPK = 8

# Stamps every call of the kind reaches, in the order it reaches them (the last CTA's time). Only
# stamps of the same CTAs are compared: those of every CTA, and those of CTA 0 alone (the count
# exchange, the exit barrier), whose CTA may be past them before another CTA stamps its last
# all-CTA phase.
NOTIFY_ORDER = ("start", "blocks_counted", "bases_summed")
# Stamped by the CTAs that own 32-token blocks (none on a rank without tokens).
NOTIFY_COUNT_ORDER = ("start", "ids_loaded", "ids_staged", "block_counted", "own_blocks_scanned")
NOTIFY_CTA0_ORDER = ("counts_sent", "counts_arrived", "expert_counts_taken", "counts_written")
DISPATCH_ORDER = ("start", "rows_sent", "grid_synced")
CACHED_DISPATCH_ORDER = ("start", "entry_barrier", "rows_sent", "grid_synced")
PULL_ORDER = ("start", "grid_synced", "rows_summed", "exit_grid_synced")
# CTA 0 passes the entry barrier before any CTA leaves the grid sync; its exit barrier is only
# checked as reached (another CTA may stamp its exit grid sync after CTA 0's barrier).
PULL_CTA0_ORDER = ("entry_barrier", "grid_synced")
LL_ORDERS = {
    "ll_dispatch_send": ("start", "gate_open", "lists_built", "rows_sent", "arrivals_published", "end"),
    "ll_dispatch_recv": ("start", "counts_arrived", "rows_copied"),
    "ll_combine_send": ("start", "gate_open", "rows_sent", "arrivals_published", "end"),
    "ll_combine_recv": ("start", "rows_arrived", "rows_reduced"),
}


def _check_order(problems: list[str], what: str, phases: dict, order: tuple[str, ...]) -> None:
    times = [phases.get(name) for name in order]
    missing = [name for name, value in zip(order, times, strict=True) if value is None]
    if missing:
        problems.append(f"{what}: no stamp for {missing} ({phases})")
        return
    if any(later < earlier for earlier, later in itertools.pairwise(times)):
        problems.append(f"{what}: stamps out of order {dict(zip(order, times, strict=True))}")


@contextlib.contextmanager
def _clocked_buffer(group, **options) -> Iterator[deep_ep.ElasticBuffer]:
    """A buffer built with the phase clock; destroyed, and the variable dropped, on leaving."""
    os.environ[phase_clock.ENV] = "1"
    try:
        buffer = deep_ep.ElasticBuffer(
            group,
            num_max_tokens_per_rank=CASE.num_max_tokens,
            hidden=HIDDEN,
            num_topk=LL_TOPK,
            explicitly_destroy=True,
            **options,
        )
        try:
            yield buffer
        finally:
            buffer.destroy()
    finally:
        os.environ.pop(phase_clock.ENV, None)


def _run_clocked(problems: list[str], what: str, buffer, call, *kernels: str) -> tuple:
    """(call's result, its stamps) once the GPU is done; stamps None (and a problem noted) unless
    exactly ``kernels`` stamped."""
    result = call()
    torch.cuda.synchronize()
    stamps = phase_clock.read(buffer)
    if set(stamps) != set(kernels):
        problems.append(f"{what} stamped {sorted(stamps)}")
        return result, None
    return result, stamps


def _stamps_every_phase(rank: int, num_ranks: int, group) -> list[str]:
    problems: list[str] = []
    with _clocked_buffer(group, num_max_dispatch_tokens_per_rank=LL_TOKENS, num_experts=LL_EXPERTS) as buffer:
        phase_clock.read(buffer)  # whatever construction left
        inputs = group_inputs(CASE, num_ranks)
        (recv_x, _, recv_weights, handle, _), uncached = _run_clocked(
            problems,
            "uncached dispatch",
            buffer,
            lambda: dispatch_case(buffer, rank, CASE, inputs),
            "ht_notify",
            "ht_dispatch",
        )
        if uncached is not None:
            _check_order(problems, "notify", uncached["ht_notify"], NOTIFY_ORDER)
            if inputs.num_tokens[rank] > 0:
                _check_order(problems, "notify count phase", uncached["ht_notify"], NOTIFY_COUNT_ORDER)
            _check_order(problems, "notify count exchange", uncached["ht_notify"], NOTIFY_CTA0_ORDER)
            _check_order(problems, "uncached dispatch", uncached["ht_dispatch"], DISPATCH_ORDER)
            if uncached["ht_dispatch"]["exit_barrier"] is None:
                problems.append("the dispatch kernel stamped no exit barrier")
            if uncached["ht_dispatch"]["entry_barrier"] is not None:
                problems.append("an uncached dispatch passed the cached dispatch's entry barrier")
            if uncached["ht_notify"]["send_bases_arrived"] is not None:
                problems.append("a notify without zero-copy receive stamped send_bases_arrived")
            notify, dispatch = uncached["ht_notify"], uncached["ht_dispatch"]
            if dispatch["start_ns"] < notify["start_ns"] + notify["counts_written"] * 1e3:
                problems.append("the dispatch kernel's stamps start before the notify kernel's end (stream order)")

        _, cached = _run_clocked(
            problems,
            "cached dispatch",
            buffer,
            lambda: dispatch_case(buffer, rank, CASE, inputs, handle=handle),
            "ht_dispatch",
        )
        if cached is not None:
            _check_order(problems, "cached dispatch", cached["ht_dispatch"], CACHED_DISPATCH_ORDER)
        buffer.combine(expert_output(recv_x, rank, True), handle, topk_weights=recv_weights)
        torch.cuda.synchronize()
        phase_clock.read(buffer)  # the push combine kernels are not clocked

        data = make_group_inputs(num_ranks, LL_TOKENS, HIDDEN, LL_EXPERTS, LL_TOPK, seed=73)
        ll_inputs, expected = reference_case(rank, data, LL_EXPERTS, LL_TOKENS, use_fp8=True)
        ll_recv_x, _, ll_handle, _, _ = buffer.low_latency_dispatch(
            ll_inputs.x, ll_inputs.topk_idx, LL_TOKENS, LL_EXPERTS, use_fp8=True
        )
        combined, _, _ = buffer.low_latency_combine(
            ll_expert_output(ll_recv_x, True), ll_inputs.topk_idx, ll_inputs.topk_weights, ll_handle
        )
        torch.cuda.synchronize()
        ll = phase_clock.read(buffer)
        for kernel, order in LL_ORDERS.items():
            if kernel not in ll:
                problems.append(f"LL dispatch + combine left no {kernel} stamps")
            else:
                _check_order(problems, kernel, ll[kernel], order)
        if bool((bits(combined) != bits(expected.combined)).any()):
            problems.append("LL combine with the phase clock differs from the reference")
        buffer._check_device_errors()
    return problems


def _pull_combine_stamps(rank: int, num_ranks: int, group) -> list[str]:
    problems: list[str] = []
    with _clocked_buffer(group, zero_copy_combine=True) as buffer:
        inputs = group_inputs(CASE, num_ranks)
        recv_x, _, recv_weights, handle, _ = dispatch_case(buffer, rank, CASE, inputs, zero_copy_recv=True)
        y = expert_output(recv_x, rank, True)
        want = buffer.combine(y, handle, topk_weights=recv_weights)
        rows = buffer.get_combine_input_buffer(handle, hidden=HIDDEN)
        rows.copy_(y)
        torch.cuda.synchronize()
        phase_clock.read(buffer)  # the dispatch and the push combine
        got, stamps = _run_clocked(
            problems,
            "zero-copy combine",
            buffer,
            lambda: buffer.combine(rows, handle, topk_weights=recv_weights, zero_copy=True),
            "ht_combine_pull",
        )
        if stamps is not None:
            _check_order(problems, "zero-copy combine", stamps["ht_combine_pull"], PULL_ORDER)
            _check_order(problems, "zero-copy combine, CTA 0", stamps["ht_combine_pull"], PULL_CTA0_ORDER)
            if stamps["ht_combine_pull"]["exit_barrier"] is None:
                problems.append("the zero-copy combine stamped no exit barrier")
        if bool((got[0].view(torch.int16) != want[0].view(torch.int16)).any()):
            problems.append("the zero-copy combine with the phase clock differs from the push combine")
        buffer._check_device_errors()
    return problems


def _no_clock_by_default(rank: int, num_ranks: int, group) -> list[str]:
    os.environ.pop(phase_clock.ENV, None)
    buffer = deep_ep.ElasticBuffer(
        group, num_max_tokens_per_rank=64, hidden=HIDDEN, num_topk=LL_TOPK, explicitly_destroy=True
    )
    try:
        phase_clock.read(buffer)
    except RuntimeError as error:
        return [] if "no phase clock" in str(error) and "EP_PHASE_CLOCK=1" in str(error) else [str(error)]
    finally:
        buffer.destroy()
    return ["a buffer built without EP_PHASE_CLOCK=1 returned phase stamps"]


def test_every_clocked_kernel_stamps_its_phases_in_order_and_results_stay_exact(num_ranks):
    problems = launch(_stamps_every_phase, num_ranks)
    assert all(found == [] for found in problems), problems


def test_the_zero_copy_combine_stamps_its_phases_in_order_and_stays_exact(num_ranks):
    problems = launch(_pull_combine_stamps, num_ranks)
    assert all(found == [] for found in problems), problems


def test_a_buffer_has_no_phase_clock_unless_asked(num_ranks):
    if num_ranks > 2:
        pytest.skip("one check of the default is enough (1 and 2 ranks)")
    problems = launch(_no_clock_by_default, num_ranks)
    assert all(found == [] for found in problems), problems
