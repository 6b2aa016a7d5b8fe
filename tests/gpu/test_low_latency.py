"""Low-latency dispatch and combine on the GPU, compared with deep_ep.testing.reference.

One launch per rank count runs every scenario (spawning ranks costs seconds) and returns what each
rank saw; the tests below assert on those results. Every eager LL call runs under
torch.cuda.set_sync_debug_mode("error"), so a host synchronisation anywhere in the path fails.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from ll_calls import (
    Expected,
    Inputs,
    NoHostSync,
    bits,
    launch_failures,
    ll_combine_call,
    ll_dispatch_call,
    ll_expert_output,
    profile_launches,
    reference_case,
)
from rank_results import capture, guarded, launch_once

import deep_ep
from deep_ep import _C
from deep_ep.fp8 import pack_ue8m0
from deep_ep.low_latency import KERNEL_NAMES
from deep_ep.testing.data import make_group_inputs
from deep_ep.testing.reference import ll_valid_row_mask
from deep_ep.window import window_tensor

GPU_TIMEOUT_SECS = 60  # a protocol bug fails the run in a minute instead of hanging it
GRAPH_REPLAYS = 200
GRAPH_INPUT_SETS = 5


@dataclass(frozen=True)
class BufferSpec:
    name: str
    num_max_tokens: int  # T_ll
    hidden: int
    num_experts: int | None  # None: one expert per rank (E = R)
    num_topk: int
    with_high_throughput: bool = False

    def experts(self, num_ranks: int) -> int:
        return num_ranks if self.num_experts is None else self.num_experts

    def topk(self, num_ranks: int) -> int:
        return min(self.num_topk, self.experts(num_ranks))


@dataclass(frozen=True)
class Case:
    num_tokens: int  # the cap of this case: ranks get uneven counts in [0, num_tokens]
    use_fp8: bool
    mode: str  # "direct", "hook" or "async"
    num_topk: int | None = None  # None: the buffer's
    hot_expert: bool = False  # every token selects expert 1 (or 0 when E == 1)
    recv_layout: str = "compact"
    round_scale: bool = False
    use_ue8m0: bool = False
    col_major: bool = False  # use_tma_aligned_col_major_sf
    zero_copy: bool = False  # combine input written into get_next_low_latency_combine_buffer

    def options(self) -> dict[str, Any]:
        """The low_latency_dispatch keywords of this case beyond fp8 and mode."""
        return {
            "recv_layout": self.recv_layout,
            "round_scale": self.round_scale,
            "use_ue8m0": self.use_ue8m0,
            "use_tma_aligned_col_major_sf": self.col_major,
        }

    def describe(self) -> str:
        flags = [name for name in ("round_scale", "use_ue8m0", "col_major", "zero_copy") if getattr(self, name)]
        return " ".join([self.recv_layout, *flags])


# T in {0, 1, 17, T_ll}, T_ll in {128, 256}, H in {2048, 4096, 7168}, K in {1, 8}, E in {R, 64, 288};
# compact (default) and per-source rows; fp32 row / column-major, power-of-two and UE8M0 scales.
SPECS: list[tuple[BufferSpec, list[Case]]] = [
    (
        BufferSpec("E288_H7168", 128, 7168, 288, 8),
        [
            Case(0, True, "direct"),
            Case(1, True, "hook"),
            Case(17, True, "direct"),
            Case(128, True, "hook"),
            Case(128, False, "direct"),
            Case(17, False, "async"),
            Case(128, True, "direct", hot_expert=True),
            Case(17, True, "direct", num_topk=1),
            Case(128, True, "hook", round_scale=True, use_ue8m0=True, col_major=True),
            Case(17, True, "direct", round_scale=True),
            Case(128, True, "async", col_major=True, zero_copy=True),
            Case(128, True, "direct", recv_layout="per_source"),
            Case(17, False, "hook", recv_layout="per_source", zero_copy=True),
        ],
    ),
    (
        BufferSpec("E64_H2048", 256, 2048, 64, 8),
        [
            Case(0, False, "hook"),
            Case(1, False, "direct"),
            Case(17, True, "async"),
            Case(256, True, "direct"),
            Case(256, False, "hook"),
            Case(256, False, "direct", hot_expert=True),
            Case(17, False, "hook", num_topk=1),
            Case(256, True, "direct", round_scale=True, use_ue8m0=True),
            Case(256, True, "hook", recv_layout="per_source", round_scale=True),
        ],
    ),
    (
        BufferSpec("ER_H4096", 128, 4096, None, 8, with_high_throughput=True),
        [
            Case(1, True, "direct"),
            Case(17, False, "hook"),
            Case(128, True, "hook"),
            Case(128, False, "direct", num_topk=1),
        ],
    ),
]


# ------------------------------------------------------------------------------------ helpers


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _make_buffer(group: Any, spec: BufferSpec, num_ranks: int, **overrides: Any) -> deep_ep.ElasticBuffer:
    """``overrides``: further ElasticBuffer keywords (test_ll_scaleout.py: num_ranks_per_node)."""
    return deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=spec.num_max_tokens if spec.with_high_throughput else 0,
        hidden=spec.hidden,
        num_topk=spec.topk(num_ranks),
        num_max_dispatch_tokens_per_rank=spec.num_max_tokens,
        num_experts=spec.experts(num_ranks),
        num_gpu_timeout_secs=GPU_TIMEOUT_SECS,
        explicitly_destroy=True,
        **overrides,
    )


def _inputs_and_reference(
    rank: int,
    num_ranks: int,
    spec: BufferSpec,
    num_tokens: int,
    num_topk: int,
    use_fp8: bool,
    seed: int,
    hot_expert: bool = False,
    uneven: bool = True,
    recv_layout: str = "compact",
    round_scale: bool = False,
) -> tuple[Inputs, Expected]:
    num_experts = spec.experts(num_ranks)
    kwargs: dict[str, Any] = {}
    if hot_expert:
        kwargs = {"hot_expert": min(1, num_experts - 1), "hot_ratio": 1.0, "all_minus_one_tokens": 0}
    data = make_group_inputs(
        num_ranks,
        num_tokens,
        spec.hidden,
        num_experts,
        num_topk,
        seed=seed,
        uneven=uneven and num_tokens > 0,
        **kwargs,
    )
    return reference_case(
        rank,
        data,
        num_experts,
        spec.num_max_tokens,
        use_fp8=use_fp8,
        round_scale=round_scale,
        recv_layout=recv_layout,
    )


@dataclass
class Observed:
    """Snapshot of one dispatch + combine (per-source recv_x is a window view: copied before the
    next op)."""

    recv_x: Any
    recv_count: torch.Tensor
    count_per_source: torch.Tensor
    src_info: torch.Tensor
    layout_range: torch.Tensor
    src_token: torch.Tensor  # window headers, per-source blocks
    topk_slot: torch.Tensor
    recv_layout: str
    combined: torch.Tensor | None = None


def _snapshot(recv_x: Any, recv_count: torch.Tensor, handle: Any) -> Observed:
    copied = tuple(t.clone() for t in recv_x) if isinstance(recv_x, tuple) else recv_x.clone()
    return Observed(
        copied,
        recv_count.clone(),
        handle.count_per_source.clone(),
        handle.recv_src_info.clone(),
        handle.recv_layout_range.clone(),
        handle.recv_src_token.clone(),
        handle.recv_topk_slot.clone(),
        handle.recv_layout,
    )


def _dispatch(
    buffer: Any, spec: BufferSpec, inputs: Inputs, use_fp8: bool, mode: str, **options: Any
) -> tuple[Any, Any, Any]:
    recv_x, recv_count, handle, hook = ll_dispatch_call(buffer, inputs.x, inputs.topk_idx, use_fp8, mode, **options)
    if hook is not None:
        with NoHostSync():
            hook()
    return recv_x, recv_count, handle


def _combine(
    buffer: Any, y: torch.Tensor, inputs: Inputs, handle: Any, mode: str, out: Any = None, **options: Any
) -> torch.Tensor:
    combined, hook = ll_combine_call(buffer, y, inputs.topk_idx, inputs.topk_weights, handle, mode, out, **options)
    if hook is not None:
        with NoHostSync():
            hook()
    return combined


def _round_trip(
    buffer: Any, spec: BufferSpec, inputs: Inputs, use_fp8: bool, mode: str, case: Case | None = None
) -> Observed:
    options = case.options() if case is not None else {}
    recv_x, recv_count, handle = _dispatch(buffer, spec, inputs, use_fp8, mode, **options)
    observed = _snapshot(recv_x, recv_count, handle)
    out = torch.full((inputs.x.shape[0], spec.hidden), float("nan"), dtype=torch.bfloat16, device=inputs.x.device)
    y = ll_expert_output(recv_x, use_fp8)
    combine_options: dict[str, Any] = {}
    if case is not None and case.zero_copy:
        # DeepEP's zero-copy combine: expert outputs written into the buffer's own tensor.
        staging = buffer.get_next_low_latency_combine_buffer(handle)
        staging.copy_(y)
        y, combine_options = staging, {"zero_copy": True}
    observed.combined = _combine(buffer, y, inputs, handle, mode, out=out, **combine_options)
    if observed.combined.data_ptr() != out.data_ptr():
        raise AssertionError("low_latency_combine(out=...) did not return the given tensor")
    return observed


def _compare(label: str, observed: Observed, expected: Expected, use_fp8: bool) -> list[str]:
    """Mismatch descriptions (empty when everything is bitwise equal on the valid rows)."""
    mine = expected.dispatch
    valid = ll_valid_row_mask(mine)
    failures = []

    def check(name: str, actual: torch.Tensor, wanted: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        # Compared as raw bits (fp8 has no comparison kernels), on the valid rows when given.
        actual, wanted = bits(actual), bits(wanted)
        if rows is not None:
            actual, wanted = actual[rows], wanted[rows]
        if actual.shape != wanted.shape or not torch.equal(actual, wanted):
            diff = "shape" if actual.shape != wanted.shape else int((actual != wanted).sum())
            failures.append(f"{label}: {name} differs ({diff} elements)")

    check("recv_count", observed.recv_count, mine["count"])
    check("count_per_source", observed.count_per_source, mine["count_per_source"])
    check("recv_src_info", observed.src_info.long(), mine["src_token"], valid)
    check("recv_layout_range", observed.layout_range, mine["layout_range"])
    if observed.recv_layout == "per_source":  # the window headers are per-source blocks
        check("src_token", observed.src_token.long(), mine["src_token"], valid)
        check("topk_slot", observed.topk_slot.long(), mine["topk_slot"], valid)
    if use_fp8:
        fp8, scales = observed.recv_x
        check("recv_x fp8", fp8, mine["x"], valid)
        if scales.dtype == torch.int32:  # UE8M0 words of the reference's power-of-two scales
            actual, wanted = scales[valid], pack_ue8m0(mine["x_scales"][valid])
            if not torch.equal(actual, wanted):
                failures.append(f"{label}: recv_x UE8M0 scales differ ({int((actual != wanted).sum())} words)")
        else:
            check("recv_x scales", scales, mine["x_scales"], valid)
    else:
        check("recv_x bf16", observed.recv_x, mine["x"], valid)
    if observed.combined is not None:
        check("combined_x", observed.combined, expected.combined)
    return failures


# ---------------------------------------------------------------------------------- scenarios


def _reference_cases(buffer: Any, rank: int, num_ranks: int, spec: BufferSpec, cases: list[Case]) -> dict:
    results: dict[str, list[str]] = {}
    for index, case in enumerate(cases):
        num_topk = case.num_topk or spec.topk(num_ranks)
        label = (
            f"{spec.name} T<={case.num_tokens} K={num_topk} {'fp8' if case.use_fp8 else 'bf16'} {case.mode}"
            f"{' hot' if case.hot_expert else ''} {case.describe()}"
        )
        seed = 1000 * (SPECS.index((spec, cases)) + 1) + index
        inputs, expected = _inputs_and_reference(
            rank,
            num_ranks,
            spec,
            case.num_tokens,
            num_topk,
            case.use_fp8,
            seed,
            case.hot_expert,
            recv_layout=case.recv_layout,
            round_scale=case.round_scale,
        )
        observed = _round_trip(buffer, spec, inputs, case.use_fp8, case.mode, case)
        failures = _compare(label, observed, expected, case.use_fp8)
        if case.mode != "direct":
            # The same inputs once more without hook/event: the modes must agree bit for bit.
            direct = _round_trip(buffer, spec, inputs, case.use_fp8, "direct", case)
            failures += _compare(f"{label} (direct rerun)", direct, expected, case.use_fp8)
        results[label] = failures
        del inputs, expected, observed
        torch.cuda.empty_cache()
    return results


def _outstanding(buffer: Any, rank: int, num_ranks: int, spec: BufferSpec) -> dict:
    """Two hooks pending work; a third operation raises; a hook called twice raises."""
    num_topk = spec.topk(num_ranks)
    cases = [
        _inputs_and_reference(rank, num_ranks, spec, spec.num_max_tokens, num_topk, use_fp8, seed)
        for use_fp8, seed in ((True, 71), (False, 72), (True, 73))
    ]
    pending = []
    with NoHostSync():
        for (inputs, _), use_fp8 in zip(cases[:2], (True, False), strict=True):
            recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
                inputs.x,
                inputs.topk_idx,
                spec.num_max_tokens,
                buffer.num_experts,
                use_fp8=use_fp8,
                return_recv_hook=True,
            )
            pending.append((recv_x, recv_count, handle, hook))
    third = capture(
        lambda: buffer.low_latency_dispatch(
            cases[2][0].x, cases[2][0].topk_idx, spec.num_max_tokens, buffer.num_experts, return_recv_hook=True
        )
    )
    with NoHostSync():
        for *_, hook in pending:
            hook()
    twice = capture(pending[0][3])
    failures = []
    observed = [_snapshot(recv_x, recv_count, handle) for recv_x, recv_count, handle, _ in pending]
    combine_hooks = []
    with NoHostSync():
        for (recv_x, _, handle, _), (inputs, _), use_fp8 in zip(pending, cases[:2], (True, False), strict=True):
            y = ll_expert_output(recv_x, use_fp8)
            combined, _, hook = buffer.low_latency_combine(
                y, inputs.topk_idx, inputs.topk_weights, handle, return_recv_hook=True
            )
            combine_hooks.append((combined, hook))
        for _, hook in combine_hooks:
            hook()
    for index, ((_, expected), use_fp8) in enumerate(zip(cases[:2], (True, False), strict=True)):
        observed[index].combined = combine_hooks[index][0]
        failures += _compare(f"outstanding op {index}", observed[index], expected, use_fp8)
    return {"third": third, "twice": twice, "failures": failures}


def _bad_inputs(buffer: Any, spec: BufferSpec) -> dict:
    """Every bad call raises (after taking part without data: no rank is left waiting)."""
    device = _device()
    cap, hidden, num_experts = spec.num_max_tokens, spec.hidden, buffer.num_experts
    num_topk = buffer.num_ll_topk
    x = torch.randn(4, hidden, device=device).to(torch.bfloat16)
    idx = torch.zeros(4, num_topk, dtype=torch.int64, device=device)
    dispatch = buffer.low_latency_dispatch
    calls = {
        "too_many_tokens": lambda: dispatch(
            torch.zeros(cap + 1, hidden, dtype=torch.bfloat16, device=device),
            torch.zeros(cap + 1, num_topk, dtype=torch.int64, device=device),
            cap,
            num_experts,
        ),
        "hidden_not_multiple_of_128": lambda: dispatch(x[:, :100], idx, cap, num_experts),
        "x_hidden_not_buffer_hidden": lambda: dispatch(
            torch.zeros(4, hidden + 128, dtype=torch.bfloat16, device=device), idx, cap, num_experts
        ),
        "x_dtype": lambda: dispatch(x.float(), idx, cap, num_experts),
        "topk_idx_dtype": lambda: dispatch(x, idx.int(), cap, num_experts),
        "topk_idx_shape": lambda: dispatch(x, idx[:3], cap, num_experts),
        "topk_too_wide": lambda: dispatch(
            x, torch.zeros(4, num_topk + 1, dtype=torch.int64, device=device), cap, num_experts
        ),
        "num_experts_mismatch": lambda: dispatch(x, idx, cap, num_experts + buffer.num_ranks),
        "cap_mismatch": lambda: dispatch(x, idx, cap + 1, num_experts),
        "round_scale_bf16": lambda: dispatch(x, idx, cap, num_experts, use_fp8=False, round_scale=True),
        "use_ue8m0_without_round_scale": lambda: dispatch(x, idx, cap, num_experts, use_ue8m0=True),
        "col_major_per_source": lambda: dispatch(
            x, idx, cap, num_experts, recv_layout="per_source", use_tma_aligned_col_major_sf=True
        ),
        "stats_dtype": lambda: dispatch(
            x, idx, cap, num_experts, cumulative_local_expert_recv_stats=torch.zeros(1, device=device)
        ),
        "async_and_hook": lambda: dispatch(x, idx, cap, num_experts, async_finish=True, return_recv_hook=True),
    }
    return {name: capture(call) for name, call in calls.items()}


def _bad_combine_inputs(buffer: Any, rank: int, num_ranks: int, spec: BufferSpec) -> dict:
    inputs, _ = _inputs_and_reference(rank, num_ranks, spec, 8, spec.topk(num_ranks), True, 91, uneven=False)
    combine = buffer.low_latency_combine
    calls = {
        "wait_stats_dtype": lambda y, handle: combine(
            y,
            inputs.topk_idx,
            inputs.topk_weights,
            handle,
            combine_wait_recv_cost_stats=torch.zeros(buffer.num_ranks, dtype=torch.int32, device=y.device),
        ),
        "x_shape": lambda y, handle: combine(y[:, :-1], inputs.topk_idx, inputs.topk_weights, handle),
        "weights_dtype": lambda y, handle: combine(y, inputs.topk_idx, inputs.topk_weights.double(), handle),
        "out_shape": lambda y, handle: combine(
            y, inputs.topk_idx, inputs.topk_weights, handle, out=torch.empty(1, spec.hidden, device=y.device)
        ),
        "not_a_handle": lambda y, handle: combine(y, inputs.topk_idx, inputs.topk_weights, object()),
    }
    results = {}
    for name, call in calls.items():
        # A refused combine still takes part (without data): an LL operation on every rank. A fresh
        # dispatch each time keeps the handle within its two-operation lifetime.
        recv_x, _, handle = _dispatch(buffer, spec, inputs, True, "direct")
        y = ll_expert_output(recv_x, True)
        results[name] = capture(lambda call=call, y=y, handle=handle: call(y, handle))
    # Two refusals after a dispatch are two LL operations: its handle is stale then.
    recv_x, _, handle = _dispatch(buffer, spec, inputs, True, "direct")
    y = ll_expert_output(recv_x, True)
    for _ in range(2):
        capture(lambda: calls["x_shape"](y, handle))
    results["stale_after_refusals"] = capture(lambda: combine(y, inputs.topk_idx, inputs.topk_weights, handle))
    inputs, expected = _inputs_and_reference(rank, num_ranks, spec, 8, spec.topk(num_ranks), True, 95, uneven=False)
    results["failures_after"] = _compare(
        "after refused combines", _round_trip(buffer, spec, inputs, True, "direct"), expected, True
    )
    return results


def _stats(buffer: Any, rank: int, num_ranks: int, spec: BufferSpec) -> list[str]:
    """DeepEP's statistics tensors: received tokens per local expert accumulate across calls (hook
    mode included); the wait-cost tensors only ever grow, and some wait is always measured."""
    num_topk = spec.topk(num_ranks)
    device = _device()
    num_local = buffer.num_experts // num_ranks
    received = torch.full((num_local,), 5, dtype=torch.int32, device=device)
    dispatch_wait = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    combine_wait = torch.zeros(num_ranks, dtype=torch.int64, device=device)
    expected_received = received.clone()
    failures = []
    for index, mode in enumerate(("direct", "hook")):
        inputs, expected = _inputs_and_reference(rank, num_ranks, spec, 17, num_topk, True, 96 + index)
        before = dispatch_wait.clone()
        recv_x, recv_count, handle = _dispatch(
            buffer,
            spec,
            inputs,
            True,
            mode,
            cumulative_local_expert_recv_stats=received,
            dispatch_wait_recv_cost_stats=dispatch_wait,
        )
        expected_received += expected.dispatch["count"]
        combine_before = combine_wait.clone()
        combined = _combine(
            buffer,
            ll_expert_output(recv_x, True),
            inputs,
            handle,
            mode,
            combine_wait_recv_cost_stats=combine_wait,
        )
        if not torch.equal(received, expected_received):
            failures.append(f"{mode}: cumulative recv stats {received.tolist()} != {expected_received.tolist()}")
        for name, now, then in (("dispatch", dispatch_wait, before), ("combine", combine_wait, combine_before)):
            if bool((now < then).any()) or int((now - then).sum()) <= 0:
                failures.append(f"{mode}: {name} wait cost did not grow: {then.tolist()} -> {now.tolist()}")
        if not torch.equal(bits(combined), bits(expected.combined)):
            failures.append(f"{mode}: combine with stats differs from the reference")
    return failures


SKEW_CYCLES = 20_000_000  # about 10 ms of GPU time: far longer than an LL operation


def _skew(buffer: Any, rank: int, num_ranks: int, spec: BufferSpec) -> list[str]:
    """A slow rank (the last) delays its stream before every LL phase while the others run ahead as
    far as the protocol lets them. Per-source (zero-copy) results are read as late as their lifetime
    allows — after the next operation was issued — and two hooks stay pending on the slow rank while
    the fast ranks go on to a third operation: nothing a slow rank still may read is overwritten."""
    slow = rank == num_ranks - 1
    num_topk = spec.topk(num_ranks)

    def delay() -> None:
        if slow:
            torch.cuda._sleep(SKEW_CYCLES)

    options = {"recv_layout": "per_source"}
    sets = [
        _inputs_and_reference(rank, num_ranks, spec, 17, num_topk, use_fp8, 400 + i, recv_layout="per_source")
        for i, use_fp8 in enumerate((True, False, True, False))
    ]
    failures: list[str] = []
    # Dispatch, combine, dispatch, ...: dispatch i's views are read after combine i was issued.
    for i, ((inputs, expected), use_fp8) in enumerate(zip(sets[:2], (True, False), strict=True)):
        delay()
        recv_x, recv_count, handle = _dispatch(buffer, spec, inputs, use_fp8, "direct", **options)
        y = ll_expert_output(recv_x, use_fp8).clone()
        delay()
        combined = _combine(buffer, y, inputs, handle, "direct")
        delay()
        observed = _snapshot(recv_x, recv_count, handle)  # still valid: only one LL call since
        observed.combined = combined
        failures += _compare(f"skewed round trip {i}", observed, expected, use_fp8)
    # Two dispatches pending on every rank; the slow rank receives them late.
    pending = []
    for (inputs, _), use_fp8 in zip(sets[2:], (True, False), strict=True):
        delay()
        with NoHostSync():
            recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
                inputs.x,
                inputs.topk_idx,
                spec.num_max_tokens,
                buffer.num_experts,
                use_fp8=use_fp8,
                return_recv_hook=True,
                **options,
            )
        pending.append((recv_x, recv_count, handle, hook, use_fp8))
    delay()
    for *_, hook, _ in pending:
        hook()
    for index, ((recv_x, recv_count, handle, _, use_fp8), (_, expected)) in enumerate(
        zip(pending, sets[2:], strict=True)
    ):
        observed = _snapshot(recv_x, recv_count, handle)
        failures += _compare(f"skewed pending dispatch {index}", observed, expected, use_fp8)
    # The operation after them (it reuses the area of the first skewed round trip) is correct too.
    inputs, expected = _inputs_and_reference(rank, num_ranks, spec, 17, num_topk, True, 410)
    delay()
    failures += _compare("after skew", _round_trip(buffer, spec, inputs, True, "direct"), expected, True)
    return failures


def _invalid_expert(buffer: Any, rank: int, num_ranks: int, spec: BufferSpec) -> dict:
    """An id >= E is treated as -1 and reported as ValueError at the next host check."""
    inputs, _ = _inputs_and_reference(rank, num_ranks, spec, 8, spec.topk(num_ranks), True, 92, uneven=False)
    bad = inputs.topk_idx.clone()
    bad[0, 0] = buffer.num_experts + 5
    inputs_bad = Inputs(inputs.x, bad, inputs.topk_weights)
    recv_x, _, handle = _dispatch(buffer, spec, inputs_bad, True, "direct")
    torch.cuda.synchronize()
    after_dispatch = capture(buffer._check_device_errors)
    _combine(buffer, ll_expert_output(recv_x, True), inputs_bad, handle, "direct")
    torch.cuda.synchronize()
    capture(buffer._check_device_errors)  # the combine saw the same id: clear it
    # The buffer stays usable: a clean round trip still matches the reference.
    clean_inputs, expected = _inputs_and_reference(rank, num_ranks, spec, 17, spec.topk(num_ranks), True, 93)
    failures = _compare("after invalid id", _round_trip(buffer, spec, clean_inputs, True, "direct"), expected, True)
    return {"after_dispatch": after_dispatch, "failures": failures}


def _interleave_with_high_throughput(buffer: Any, rank: int, num_ranks: int, spec: BufferSpec) -> list[str]:
    """LL dispatch (hook pending), a full HT dispatch + combine, then the LL receive and combine."""
    inputs, expected = _inputs_and_reference(rank, num_ranks, spec, spec.num_max_tokens, spec.topk(num_ranks), True, 94)
    with NoHostSync():
        recv_x, recv_count, handle, _, hook = buffer.low_latency_dispatch(
            inputs.x, inputs.topk_idx, spec.num_max_tokens, buffer.num_experts, return_recv_hook=True
        )
    ht_x, _, _, ht_handle, _ = buffer.dispatch(
        inputs.x, inputs.topk_idx, inputs.topk_weights, num_experts=buffer.num_experts
    )
    buffer.combine(ht_x, ht_handle)
    with NoHostSync():
        hook()
    observed = _snapshot(recv_x, recv_count, handle)
    observed.combined = _combine(buffer, ll_expert_output(recv_x, True), inputs, handle, "direct")
    failures = _compare("interleaved with HT", observed, expected, True)
    # And an LL round trip right after HT traffic.
    inputs, expected = _inputs_and_reference(rank, num_ranks, spec, 17, spec.topk(num_ranks), False, 95)
    buffer.dispatch(inputs.x, inputs.topk_idx, inputs.topk_weights, num_experts=buffer.num_experts)
    failures += _compare("after HT", _round_trip(buffer, spec, inputs, False, "direct"), expected, False)
    return failures


def _cuda_graph(buffer: Any, rank: int, num_ranks: int, spec: BufferSpec, with_hook: bool) -> list[str]:
    """Capture dispatch + combine once, replay with fresh inputs copied in, check every replay."""
    num_topk = spec.topk(num_ranks)
    sets = [
        _inputs_and_reference(rank, num_ranks, spec, spec.num_max_tokens, num_topk, True, 200 + i, uneven=False)
        for i in range(GRAPH_INPUT_SETS)
    ]
    static = Inputs(sets[0][0].x.clone(), sets[0][0].topk_idx.clone(), sets[0][0].topk_weights.clone())
    failures = _compare("graph warm-up", _round_trip(buffer, spec, static, True, "direct"), sets[0][1], True)

    mode = "hook" if with_hook else "direct"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, recv_count, handle = _dispatch(buffer, spec, static, True, mode)
        combined = _combine(buffer, ll_expert_output(recv_x, True), static, handle, mode)
    mismatches = torch.zeros(GRAPH_INPUT_SETS, dtype=torch.int64, device=static.x.device)
    for replay in range(GRAPH_REPLAYS):
        index = replay % GRAPH_INPUT_SETS
        inputs, expected = sets[index]
        static.x.copy_(inputs.x)
        static.topk_idx.copy_(inputs.topk_idx)
        static.topk_weights.copy_(inputs.topk_weights)
        graph.replay()
        mine = expected.dispatch
        valid = ll_valid_row_mask(mine).unsqueeze(-1)
        wrong = (recv_count != mine["count"]).sum()
        wrong += ((bits(recv_x[0]) != bits(mine["x"])) & valid).sum()
        wrong += ((bits(recv_x[1]) != bits(mine["x_scales"])) & valid).sum()
        wrong += (bits(combined) != bits(expected.combined)).sum()
        mismatches[index] += wrong
    counts = mismatches.tolist()
    failures += [f"graph replays of input set {i}: {n} wrong elements" for i, n in enumerate(counts) if n]
    del graph
    return failures


# Release counts seeded just below 2^31 and 2^32: the round trips below take every area's counts
# past int32's and uint32's range (4 operations per area). Counts grow by one per operation on an
# area and are never reset, so in serving they get there after days (docs/low_latency.md).
NEAR_OVERFLOW_SEEDS = (2**31 - 2, 2**32 - 2)
NEAR_OVERFLOW_ROUND_TRIPS = 6  # 12 operations, 4 on each of the 3 areas


def _release_counts(buffer: Any) -> list[torch.Tensor]:
    """This rank's LL release counts: per area, an int64 window view of one count per rank ([me]
    counts the operations received on the area)."""
    layout = buffer._ll_layout()
    runtime = buffer._runtime
    return [
        window_tensor(
            runtime,
            runtime.local_base(),
            buffer._window["ll_offset"] + area * layout["area_bytes"] + layout["combine_flags_offset"],
            (buffer.num_ranks,),
            torch.int64,
            _device(),
        )
        for area in range(_C.LL_AREAS)
    ]


def _counts_near_overflow(group: Any, rank: int, num_ranks: int, **overrides: Any) -> list[str]:
    """A buffer whose release counts start at ``seed`` on every area of every rank, as if ``seed``
    operations had run on each (set before any LL operation, on every rank before any rank's first):
    every round trip still matches the reference bit for bit, and every area's receive count ends at
    seed + 4."""
    spec = SPECS[1][0]  # E64_H2048
    failures = []
    for seed in NEAR_OVERFLOW_SEEDS:
        buffer = _make_buffer(group, spec, num_ranks, **overrides)
        try:
            torch.cuda.synchronize()
            for view in _release_counts(buffer):
                view.fill_(seed)
            buffer.barrier(with_cpu_sync=True)  # every rank seeded before any rank's first LL kernel
            for index in range(NEAR_OVERFLOW_ROUND_TRIPS):
                use_fp8, mode = index % 2 == 0, ("direct", "hook", "async")[index % 3]
                inputs, expected = _inputs_and_reference(
                    rank, num_ranks, spec, spec.num_max_tokens, spec.topk(num_ranks), use_fp8, 900 + index
                )
                observed = _round_trip(buffer, spec, inputs, use_fp8, mode)
                failures += _compare(f"counts from {seed}: round trip {index} {mode}", observed, expected, use_fp8)
            torch.cuda.synchronize()
            received = [int(view[rank]) for view in _release_counts(buffer)]
            if received != [seed + 4] * _C.LL_AREAS:
                failures.append(f"counts from {seed}: operations received per area {received}, expected {seed + 4}")
            dirty = buffer._debug_count_dirty_workspace_bytes()
            if dirty != 0:
                failures.append(f"counts from {seed}: {dirty} dirty workspace bytes")
        finally:
            buffer.destroy()
        torch.cuda.empty_cache()
    return failures


# 11,700 tokens x top-8 need 234,000 bytes of routing and token list: more than the dispatch
# kernel's shared memory on an H200 (about 232,200 bytes).
TOO_LARGE_FOR_SHARED_MEMORY = BufferSpec("T11700_H128", 11_700, 128, 64, 8)


def _launches_per_operation(mode: str) -> int:
    """Launches of each operation's kernel function: the send and the hook's receive phase with a
    hook, one launch of both phases otherwise."""
    return 2 if mode == "hook" else 1


def _largest_dispatch(group: Any, rank: int, num_ranks: int) -> dict:
    """A buffer whose largest dispatch cannot fit is refused when built, naming the largest
    num_max_dispatch_tokens_per_rank that fits; a buffer of that size dispatches and combines a
    full call bit for bit, with the same kernel launches as any other buffer (no hook: one per
    operation, its receive phase in the shared memory of the largest send phase; hook: two)."""
    spec = TOO_LARGE_FOR_SHARED_MEMORY
    kind, message = capture(lambda: _make_buffer(group, spec, num_ranks).destroy())
    result: dict[str, Any] = {"refused": (kind, message), "failures": []}
    match = re.search(r"must be at most (\d+) with top-", message)
    if match is None:
        return result
    largest = BufferSpec(f"T{match.group(1)}_H128", int(match.group(1)), 128, 64, 8)
    result["largest"] = largest.num_max_tokens
    buffer = _make_buffer(group, largest, num_ranks)
    try:
        inputs, expected = _inputs_and_reference(
            rank, num_ranks, largest, largest.num_max_tokens, largest.topk(num_ranks), True, 310, uneven=False
        )
        for mode in ("direct", "hook"):
            label = f"{largest.name} full call {mode}"
            launches, observed = profile_launches(functools.partial(_round_trip, buffer, largest, inputs, True, mode))
            result["failures"] += launch_failures(label, launches, _launches_per_operation(mode))
            result["failures"] += _compare(label, observed, expected, True)
        dirty = buffer._debug_count_dirty_workspace_bytes()
        if dirty != 0:
            result["failures"].append(f"{largest.name}: {dirty} dirty workspace bytes")
    finally:
        buffer.destroy()
    torch.cuda.empty_cache()
    return result


def _launches(buffer: Any, rank: int, num_ranks: int, spec: BufferSpec) -> list[str]:
    """Every mode launches one kernel function per operation (KERNEL_NAMES): once without a hook
    (direct, async), twice with one (send phase, then the hook's receive phase), the same
    instantiation in every mode of a message type; each operation's kernel is the only row of the
    profiler's table with its word ("dispatch", "combine"), as DeepEP's bench_kineto requires.
    Every round trip matches the reference."""
    failures = []
    num_topk = spec.topk(num_ranks)
    for use_fp8 in (True, False):
        names: set[str] = set()
        for mode in ("direct", "async", "hook"):
            label = f"{spec.name} {'fp8' if use_fp8 else 'bf16'} {mode}"
            inputs, expected = _inputs_and_reference(rank, num_ranks, spec, 17, num_topk, use_fp8, 300)
            run = functools.partial(_round_trip, buffer, spec, inputs, use_fp8, mode)
            launches, observed = profile_launches(run)
            failures += launch_failures(label, launches, _launches_per_operation(mode))
            failures += _compare(f"{label} (launch count)", observed, expected, use_fp8)
            names.update(launches.names)
        if len(names) != len(KERNEL_NAMES):
            failures.append(
                f"{spec.name} {'fp8' if use_fp8 else 'bf16'}: the modes launched {sorted(names)}, "
                "expected one kernel instantiation per operation for all of them"
            )
    return failures


def _rank_main(rank: int, num_ranks: int, group: Any) -> dict:
    results: dict[str, Any] = {}
    for spec, cases in SPECS:
        buffer = _make_buffer(group, spec, num_ranks)
        try:
            results.setdefault("reference", {}).update(_reference_cases(buffer, rank, num_ranks, spec, cases))
            # Synchronises: every LL kernel so far must have left the workspace scratch at zero.
            results.setdefault("dirty_workspace_bytes", {})[spec.name] = buffer._debug_count_dirty_workspace_bytes()
            if spec.name == "E64_H2048":
                results["graph"] = _cuda_graph(buffer, rank, num_ranks, spec, with_hook=False)
                results["graph_hook"] = _cuda_graph(buffer, rank, num_ranks, spec, with_hook=True)
            if spec.with_high_throughput:
                results["outstanding"] = _outstanding(buffer, rank, num_ranks, spec)
                guarded(results, "bad_inputs", lambda b=buffer, s=spec: _bad_inputs(b, s))
                results["bad_combine"] = _bad_combine_inputs(buffer, rank, num_ranks, spec)
                results["invalid_expert"] = _invalid_expert(buffer, rank, num_ranks, spec)
                results["stats"] = _stats(buffer, rank, num_ranks, spec)
                results["skew"] = _skew(buffer, rank, num_ranks, spec)
                results["interleave"] = _interleave_with_high_throughput(buffer, rank, num_ranks, spec)
                results["launches"] = _launches(buffer, rank, num_ranks, spec)
        finally:
            buffer.destroy()
        torch.cuda.empty_cache()
    results["near_overflow"] = _counts_near_overflow(group, rank, num_ranks)
    results["largest_dispatch"] = _largest_dispatch(group, rank, num_ranks)
    return results


# ------------------------------------------------------------------------------------- tests


@pytest.fixture
def ll_results(num_ranks: int) -> list[dict]:
    """Per-rank results of the whole scenario list, run once per rank count."""
    return launch_once(_rank_main, num_ranks)


def _all_failures(ll_results: list[dict], key: str) -> list[str]:
    failures = []
    for rank, result in enumerate(ll_results):
        value = result[key]
        if isinstance(value, dict) and "exception" in value:
            failures.append(f"rank {rank}: {value['exception']}")
            continue
        items = value.values() if isinstance(value, dict) else [value]
        for item in items:
            failures += [f"rank {rank}: {failure}" for failure in item]
    return failures


def test_dispatch_and_combine_match_reference_bitwise(ll_results: list[dict]) -> None:
    """Every case: counts, received rows, scales, headers and the combine output, bit for bit; the
    hook / async cases also rerun directly and must agree."""
    failures = _all_failures(ll_results, "reference")
    assert not failures, "\n".join(failures)


def test_workspace_scratch_is_zero_after_low_latency_operations(ll_results: list[dict]) -> None:
    for rank, result in enumerate(ll_results):
        dirty = result["dirty_workspace_bytes"]
        assert all(count == 0 for count in dirty.values()), (rank, dirty)


def test_each_operation_is_one_kernel_function_in_every_mode(ll_results: list[dict]) -> None:
    """Direct and async: one launch per dispatch and per combine; hook mode: two launches of the same
    kernel function (send, then receive). In every mode the profiler's table has exactly one row
    containing "dispatch" and one containing "combine" (DeepEP's bench_kineto). Results match the
    reference."""
    failures = _all_failures(ll_results, "launches")
    assert not failures, "\n".join(failures)


def test_cuda_graph_replays_match_reference(ll_results: list[dict]) -> None:
    failures = _all_failures(ll_results, "graph")
    assert not failures, "\n".join(failures)


def test_cuda_graph_with_hooks_replays_match_reference(ll_results: list[dict]) -> None:
    failures = _all_failures(ll_results, "graph_hook")
    assert not failures, "\n".join(failures)


def test_two_outstanding_hooks_work_and_a_third_operation_raises(ll_results: list[dict]) -> None:
    for rank, result in enumerate(ll_results):
        outstanding = result["outstanding"]
        assert not outstanding["failures"], f"rank {rank}: " + "\n".join(outstanding["failures"])
        kind, message = outstanding["third"]
        assert kind == "RuntimeError" and "at most two low-latency operations" in message, (rank, kind, message)


def test_calling_a_hook_twice_raises(ll_results: list[dict]) -> None:
    for rank, result in enumerate(ll_results):
        kind, message = result["outstanding"]["twice"]
        assert kind == "RuntimeError" and "already called" in message, (rank, kind, message)


def test_bad_dispatch_inputs_raise_value_error_naming_the_rule(ll_results: list[dict]) -> None:
    expected_words = {
        "too_many_tokens": "num_max_dispatch_tokens_per_rank",
        "hidden_not_multiple_of_128": "multiple of 128",
        "x_hidden_not_buffer_hidden": "hidden",
        "x_dtype": "bfloat16",
        "topk_idx_dtype": "int64",
        "topk_idx_shape": "topk_idx",
        "topk_too_wide": "top-k",
        "num_experts_mismatch": "num_experts",
        "cap_mismatch": "num_max_dispatch_tokens_per_rank",
        "round_scale_bf16": "needs use_fp8=True",
        "use_ue8m0_without_round_scale": "needs round_scale=True",
        "col_major_per_source": "needs recv_layout='compact'",
        "stats_dtype": "cumulative_local_expert_recv_stats must be a contiguous int32",
        "async_and_hook": "cannot be combined",
    }
    for rank, result in enumerate(ll_results):
        bad = result["bad_inputs"]
        assert "exception" not in bad, f"rank {rank}: {bad.get('exception')}"
        for name, word in expected_words.items():
            kind, message = bad[name]
            assert kind == "ValueError" and word in message, (rank, name, kind, message)


def test_bad_combine_inputs_raise_value_error(ll_results: list[dict]) -> None:
    for rank, result in enumerate(ll_results):
        bad = dict(result["bad_combine"])
        stale_kind, stale_message = bad.pop("stale_after_refusals")
        failures_after = bad.pop("failures_after")
        for name, (kind, message) in bad.items():
            # A wrong kind of object is a TypeError; wrong values of the right kind are ValueErrors.
            assert kind == ("TypeError" if name == "not_a_handle" else "ValueError"), (rank, name, kind, message)
        assert "combine_wait_recv_cost_stats must be a contiguous int64" in bad["wait_stats_dtype"][1]
        # Every refusal was an LL operation on every rank (taken part in without data).
        assert stale_kind == "RuntimeError" and "stale" in stale_message, (rank, stale_kind, stale_message)
        assert not failures_after, f"rank {rank}: " + "\n".join(failures_after)


def test_invalid_expert_id_is_reported_and_the_buffer_stays_usable(ll_results: list[dict]) -> None:
    for rank, result in enumerate(ll_results):
        kind, message = result["invalid_expert"]["after_dispatch"]
        assert kind == "ValueError" and "outside" in message, (rank, kind, message)
        assert not result["invalid_expert"]["failures"], result["invalid_expert"]["failures"]


def test_a_slow_rank_never_has_unread_data_overwritten(ll_results: list[dict]) -> None:
    failures = _all_failures(ll_results, "skew")
    assert not failures, "\n".join(failures)


def test_recv_and_wait_cost_stats_accumulate(ll_results: list[dict]) -> None:
    failures = _all_failures(ll_results, "stats")
    assert not failures, "\n".join(failures)


def test_a_dispatch_too_large_for_shared_memory_is_refused_when_the_buffer_is_built(
    ll_results: list[dict],
) -> None:
    """Refused at construction with the largest size that fits; that size runs a full call exactly,
    with and without a hook, one kernel function per operation."""
    spec = TOO_LARGE_FOR_SHARED_MEMORY
    for rank, result in enumerate(ll_results):
        kind, message = result["largest_dispatch"]["refused"]
        assert kind == "ValueError" and "does not fit in this GPU's shared memory" in message, (rank, kind, message)
        assert spec.num_max_tokens - 1_000 < result["largest_dispatch"]["largest"] < spec.num_max_tokens, message
        assert not result["largest_dispatch"]["failures"], "\n".join(result["largest_dispatch"]["failures"])


def test_release_counts_past_int32_and_uint32_keep_results_exact(ll_results: list[dict]) -> None:
    """The never-reset release counts run past 2^31 and 2^32 on every area: results stay bitwise
    equal to the reference and the counts keep counting (64-bit)."""
    failures = _all_failures(ll_results, "near_overflow")
    assert not failures, "\n".join(failures)


def test_interleaving_with_high_throughput_keeps_low_latency_results(ll_results: list[dict]) -> None:
    failures = _all_failures(ll_results, "interleave")
    assert not failures, "\n".join(failures)
