"""DeepEP V1 low-latency client sequences through ``deep_ep.Buffer``, checked bitwise against the
reference model (``deep_ep.testing.reference_ll`` with ``recv_layout="compact"``).

The sequence follows DeepEP's own ``test_low_latency.py``: ``Buffer(group, 0, num_rdma_bytes =
Buffer.get_low_latency_rdma_size_hint(T, H, R, E), low_latency_mode=True)``; then for bf16 / fp8,
``round_scale``, ``use_ue8m0`` and with or without a receive hook (and ``async_finish``): dispatch,
check every valid row, the column-major scales, the V1 handle and the stats tensors, combine the
output of a deterministic expert, and combine again zero-copy through
``get_next_low_latency_combine_buffer``. Then the façade's own rules: the first call refuses CUDA-graph
capture (it builds the window), later calls with other sizes and ``use_logfmt`` raise (the ranks stay
in step), a captured dispatch + combine replays correctly, and a too-small ``num_rdma_bytes`` raises
``BufferTooSmallError`` on every rank (``PeerInputError`` on the ranks whose own sizes fit).

One launch per rank count runs every scenario and returns what each rank saw; the tests assert on
that. LL calls after the first run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from ll_calls import Expected, Inputs, NoHostSync, bits, ll_expert_output, reference_case
from rank_results import capture, guarded, launch_once

from deep_ep.compat.buffer import Buffer
from deep_ep.compat.handles import LowLatencyDispatchHandle
from deep_ep.errors import BufferTooSmallError, PeerInputError
from deep_ep.event import EventOverlap
from deep_ep.fp8 import pack_ue8m0
from deep_ep.testing.data import make_group_inputs
from deep_ep.testing.reference import ll_valid_row_mask

# DeepEP's defaults: T = 128 tokens per rank at most, H = 7168, top-8 of 288 experts.
T_LL, HIDDEN, NUM_EXPERTS, NUM_TOPK = 128, 7168, 288, 8
GPU_TIMEOUT_SECS = "60"  # a protocol bug fails the run in a minute instead of hanging it
GRAPH_INPUT_SETS = 3
STATS_BASE = 3  # cumulative_local_expert_recv_stats starts here: the kernel must add, not overwrite


@dataclass(frozen=True)
class LLCase:
    use_fp8: bool
    round_scale: bool
    use_ue8m0: bool
    mode: str  # "direct", "hook" (return_recv_hook) or "async" (async_finish)

    @property
    def label(self) -> str:
        kind = "bf16" if not self.use_fp8 else "fp8" + (" round" if self.round_scale else "")
        return f"{kind}{' ue8m0' if self.use_ue8m0 else ''} {self.mode}"


# DeepEP's sweep (hook x fp8 x round_scale x ue8m0), plus async_finish.
CASES = [
    LLCase(False, False, False, "direct"),
    LLCase(False, False, False, "hook"),
    LLCase(True, False, False, "direct"),
    LLCase(True, False, False, "hook"),
    LLCase(True, True, False, "direct"),
    LLCase(True, True, False, "hook"),
    LLCase(True, True, True, "direct"),
    LLCase(True, True, True, "hook"),
    LLCase(True, False, False, "async"),
    LLCase(False, False, False, "async"),
    LLCase(True, True, True, "async"),
]


# ------------------------------------------------------------------------------------ helpers


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _inputs_and_reference(
    rank: int,
    num_ranks: int,
    seed: int,
    *,
    use_fp8: bool,
    round_scale: bool = False,
    num_tokens: int = T_LL,
    uneven: bool = True,
) -> tuple[Inputs, Expected]:
    data = make_group_inputs(
        num_ranks, num_tokens, HIDDEN, NUM_EXPERTS, NUM_TOPK, seed=seed, uneven=uneven and num_tokens > 0
    )
    return reference_case(rank, data, NUM_EXPERTS, T_LL, use_fp8=use_fp8, round_scale=round_scale)


class Checks:
    """Collects mismatch descriptions instead of raising: every rank runs the whole sequence (an
    assertion on one rank would leave its peers waiting in the next collective call)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.failures: list[str] = []

    def true(self, condition: bool, what: str) -> None:
        if not condition:
            self.failures.append(f"{self.label}: {what}")

    def equal(self, name: str, actual: torch.Tensor, wanted: torch.Tensor) -> None:
        if actual.shape != wanted.shape or actual.dtype != wanted.dtype:
            self.failures.append(
                f"{self.label}: {name} is {actual.dtype} {list(actual.shape)}, expected {wanted.dtype} "
                f"{list(wanted.shape)}"
            )
            return
        differ = bits(actual) != bits(wanted)
        if bool(differ.any()):
            self.failures.append(f"{self.label}: {name} differs ({int(differ.sum())} elements)")


def _check_event(checks: Checks, event: Any, hook: Any, mode: str, what: str) -> None:
    """V1 returns an EventOverlap from every call (holding an event only with async_finish) and a
    hook only with return_recv_hook."""
    checks.true(isinstance(event, EventOverlap), f"{what} returned {type(event).__name__}, not an EventOverlap")
    if isinstance(event, EventOverlap):
        checks.true((event.event is not None) == (mode == "async"), f"{what}: event.event with mode {mode}")
    checks.true((hook is not None) == (mode == "hook"), f"{what}: hook with mode {mode}")


def _dispatch(
    buffer: Buffer,
    inputs: Inputs,
    case: LLCase,
    checks: Checks,
    *,
    stats: torch.Tensor | None = None,
    wait_stats: torch.Tensor | None = None,
    eager: bool = False,
) -> tuple[Any, torch.Tensor, Any]:
    """One V1 dispatch in ``case``'s mode, received (hook called / event waited on). ``eager``: the
    first LL call of a Buffer (it synchronises while building the window: no NoHostSync)."""
    with contextlib.nullcontext() if eager else NoHostSync():
        recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            inputs.x,
            inputs.topk_idx,
            T_LL,
            NUM_EXPERTS,
            cumulative_local_expert_recv_stats=stats,
            dispatch_wait_recv_cost_stats=wait_stats,
            use_fp8=case.use_fp8,
            round_scale=case.round_scale,
            use_ue8m0=case.use_ue8m0,
            async_finish=case.mode == "async",
            return_recv_hook=case.mode == "hook",
        )
        _check_event(checks, event, hook, case.mode, "dispatch")
        if case.mode == "async":
            event.current_stream_wait()
        if hook is not None:
            hook()
    return recv_x, recv_count, handle


def _combine(
    buffer: Buffer,
    y: torch.Tensor,
    inputs: Inputs,
    handle: Any,
    mode: str,
    checks: Checks,
    **options: Any,
) -> torch.Tensor:
    with NoHostSync():
        combined, event, hook = buffer.low_latency_combine(
            y,
            inputs.topk_idx,
            inputs.topk_weights,
            handle,
            async_finish=mode == "async",
            return_recv_hook=mode == "hook",
            **options,
        )
        _check_event(checks, event, hook, mode, "combine")
        if mode == "async":
            event.current_stream_wait()
        if hook is not None:
            hook()
    return combined


def _check_dispatch(
    checks: Checks, case: LLCase, recv_x: Any, recv_count: torch.Tensor, handle: Any, expected: Expected
):
    """Counts, the valid (compact) rows bit for bit, V1's scale layout and the V1 handle."""
    mine = expected.dispatch
    valid = ll_valid_row_mask(mine)  # rows [0, count) of each local expert
    num_local, num_slots = valid.shape
    groups = HIDDEN // 128
    checks.equal("recv_count", recv_count, mine["count"])

    checks.true(isinstance(handle, LowLatencyDispatchHandle), f"handle is {type(handle).__name__}")
    checks.true(isinstance(handle, tuple) and len(handle) == 5, "handle is V1's 5-entry tuple")
    src_info, layout_range, cap, hidden, num_experts = handle
    checks.true((cap, hidden, num_experts) == (T_LL, HIDDEN, NUM_EXPERTS), f"handle[2:] = {(cap, hidden, num_experts)}")
    checks.true(src_info.dtype == torch.int32 and tuple(src_info.shape) == (num_local, num_slots), "src_info shape")
    checks.equal("handle[0] src_info (valid rows)", src_info[valid].long(), mine["src_token"][valid])
    checks.equal("handle[1] layout_range", layout_range, mine["layout_range"])

    if not case.use_fp8:
        checks.true(isinstance(recv_x, torch.Tensor), "bf16 recv_x is one tensor")
        checks.equal("recv_x bf16 (valid rows)", recv_x[valid], mine["x"][valid])
        return
    data, scales = recv_x
    checks.true(tuple(data.shape) == (num_local, num_slots, HIDDEN), f"recv_x data shape {list(data.shape)}")
    checks.equal("recv_x fp8 (valid rows)", data[valid], mine["x"][valid])
    width = groups // 4 if case.use_ue8m0 else groups
    checks.true(tuple(scales.shape) == (num_local, num_slots, width), f"scales shape {list(scales.shape)}")
    # V1: column-major in the last two dims.
    checks.true(
        scales.stride() == (width * num_slots, 1, num_slots), f"scales strides {scales.stride()} (column-major)"
    )
    if case.use_ue8m0:
        checks.true(scales.dtype == torch.int32, f"ue8m0 scales dtype {scales.dtype}")
        checks.equal("recv_x ue8m0 scales (valid rows)", scales[valid], pack_ue8m0(mine["x_scales"][valid]))
    else:
        checks.equal("recv_x scales (valid rows)", scales[valid], mine["x_scales"][valid])


def _round_trip(
    buffer: Buffer,
    inputs: Inputs,
    expected: Expected,
    case: LLCase,
    checks: Checks,
    *,
    eager: bool = False,
    stats: dict | None = None,
) -> None:
    """Dispatch, check; combine (case's mode, out=), check; zero-copy combine, check."""
    stats = stats or {}
    num_local = NUM_EXPERTS // buffer.group_size
    cumulative = torch.full((num_local,), STATS_BASE, dtype=torch.int32, device=_device())
    wait_stats, combine_wait = stats.get("dispatch_wait"), stats.get("combine_wait")
    wait_before = None if wait_stats is None else wait_stats.clone()
    recv_x, recv_count, handle = _dispatch(
        buffer, inputs, case, checks, stats=cumulative, wait_stats=wait_stats, eager=eager
    )
    _check_dispatch(checks, case, recv_x, recv_count, handle, expected)
    checks.equal("cumulative_local_expert_recv_stats", cumulative, expected.dispatch["count"] + STATS_BASE)
    if wait_stats is not None:
        checks.true(bool((wait_stats >= wait_before).all()), "dispatch_wait_recv_cost_stats decreased")

    y = ll_expert_output(recv_x, case.use_fp8)
    out = torch.full((inputs.x.shape[0], HIDDEN), float("nan"), dtype=torch.bfloat16, device=inputs.x.device)
    combine_before = None if combine_wait is None else combine_wait.clone()
    combined = _combine(
        buffer, y, inputs, handle, case.mode, checks, out=out, combine_wait_recv_cost_stats=combine_wait
    )
    checks.true(combined.data_ptr() == out.data_ptr(), "combine(out=) returned another tensor")
    checks.equal("combined_x", combined, expected.combined)
    if combine_wait is not None:
        checks.true(bool((combine_wait >= combine_before).all()), "combine_wait_recv_cost_stats decreased")

    # V1's zero-copy pattern: fill the buffer of the next combine, then combine it in place.
    with NoHostSync():
        next_buffer = buffer.get_next_low_latency_combine_buffer(handle)
        next_buffer.copy_(y)
    combined = _combine(buffer, next_buffer, inputs, handle, "direct", checks, zero_copy=True)
    checks.equal("zero-copy combined_x", combined, expected.combined)


# ---------------------------------------------------------------------------------- scenarios


def _first_call_under_capture(buffer: Buffer, rank: int, num_ranks: int) -> dict:
    """The first LL call builds the window: refused inside CUDA-graph capture, before anything."""
    inputs, _ = _inputs_and_reference(rank, num_ranks, 11, use_fp8=True, num_tokens=8, uneven=False)

    def dispatch_in_capture() -> None:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            buffer.low_latency_dispatch(inputs.x, inputs.topk_idx, T_LL, NUM_EXPERTS)

    kind, message = capture(dispatch_in_capture)
    return {"kind": kind, "message": message, "sizing_after": buffer.low_latency_sizing}


def _cases(buffer: Buffer, rank: int, num_ranks: int, stats: dict) -> dict:
    results: dict[str, list[str]] = {}
    for index, case in enumerate(CASES):
        checks = Checks(case.label)
        inputs, expected = _inputs_and_reference(
            rank, num_ranks, 500 + index, use_fp8=case.use_fp8, round_scale=case.round_scale
        )
        # The very first LL call builds the window (a collective with host syncs).
        _round_trip(buffer, inputs, expected, case, checks, eager=index == 0, stats=stats)
        results[case.label] = checks.failures
        del inputs, expected
        torch.cuda.empty_cache()
    return results


def _windows(buffer: Buffer, num_ranks: int) -> list[str]:
    """After the first LL call: the LL window is exactly the hint, the RDMA view is its LL region."""
    checks = Checks("windows")
    ll_core = buffer._ll_core
    hint = Buffer.get_low_latency_rdma_size_hint(T_LL, HIDDEN, num_ranks, NUM_EXPERTS)
    checks.true(buffer.low_latency_sizing == (T_LL, HIDDEN, NUM_EXPERTS), f"sizing {buffer.low_latency_sizing}")
    checks.true(ll_core is not None and ll_core.num_bytes == hint, "the LL window holds exactly the hint")
    checks.true(buffer._core._window["ht_bytes"] == 0, "num_nvl_bytes=0: no HT region")
    view = buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
    checks.true(view.numel() == ll_core._window["ll_bytes"], "RDMA view covers the LL region")
    checks.true(view.data_ptr() == ll_core.local_window_base() + ll_core._window["ll_offset"], "RDMA view address")
    return checks.failures


def _refusals(buffer: Buffer, rank: int, num_ranks: int) -> dict:
    """Refused calls on every rank; each LL refusal takes part without data, so the ranks stay in
    step (a round trip afterwards matches the reference)."""
    inputs, _ = _inputs_and_reference(rank, num_ranks, 31, use_fp8=True, num_tokens=8, uneven=False)
    x, idx = inputs.x, inputs.topk_idx
    results: dict[str, Any] = {}
    results["other_cap"] = capture(lambda: buffer.low_latency_dispatch(x, idx, T_LL + 1, NUM_EXPERTS))
    other_hidden = torch.zeros(x.shape[0], HIDDEN - 1024, dtype=torch.bfloat16, device=x.device)
    results["other_hidden"] = capture(lambda: buffer.low_latency_dispatch(other_hidden, idx, T_LL, NUM_EXPERTS))
    results["other_experts"] = capture(lambda: buffer.low_latency_dispatch(x, idx, T_LL, 2 * NUM_EXPERTS))

    checks = Checks("logfmt")
    recv_x, _, handle = _dispatch(buffer, inputs, LLCase(True, False, False, "direct"), checks)
    y = ll_expert_output(recv_x, True)
    results["logfmt"] = capture(
        lambda: buffer.low_latency_combine(y, idx, inputs.topk_weights, handle, use_logfmt=True)
    )
    results["clean"] = capture(lambda: buffer.clean_low_latency_buffer(T_LL, HIDDEN, NUM_EXPERTS))
    results["clean_other"] = capture(lambda: buffer.clean_low_latency_buffer(T_LL, HIDDEN, 2 * NUM_EXPERTS))
    results["masks"] = [
        capture(lambda: buffer.low_latency_update_mask_buffer(0, True)),
        capture(lambda: buffer.low_latency_query_mask_buffer(torch.zeros(num_ranks, dtype=torch.int32))),
        capture(buffer.low_latency_clean_mask_buffer),
    ]
    # Still in step: a clean round trip after every refusal.
    case = LLCase(True, True, False, "hook")
    after_inputs, expected = _inputs_and_reference(rank, num_ranks, 32, use_fp8=True, round_scale=True)
    after = Checks("round trip after the refusals")
    _round_trip(buffer, after_inputs, expected, case, after)
    results["failures"] = checks.failures + after.failures
    return results


def _graph(buffer: Buffer, rank: int, num_ranks: int) -> list[str]:
    """A V1 dispatch + combine captured once (after the window exists), replayed with new inputs."""
    sets = [
        _inputs_and_reference(rank, num_ranks, 700 + i, use_fp8=True, uneven=False) for i in range(GRAPH_INPUT_SETS)
    ]
    static = Inputs(sets[0][0].x.clone(), sets[0][0].topk_idx.clone(), sets[0][0].topk_weights.clone())
    checks = Checks("graph")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(static.x, static.topk_idx, T_LL, NUM_EXPERTS)
        y = ll_expert_output(recv_x, True)
        combined, _, _ = buffer.low_latency_combine(y, static.topk_idx, static.topk_weights, handle)
    for replay in range(2 * GRAPH_INPUT_SETS):
        inputs, expected = sets[replay % GRAPH_INPUT_SETS]
        static.x.copy_(inputs.x)
        static.topk_idx.copy_(inputs.topk_idx)
        static.topk_weights.copy_(inputs.topk_weights)
        graph.replay()
        checks.label = f"graph replay {replay}"
        _check_dispatch(checks, LLCase(True, False, False, "direct"), recv_x, recv_count, handle, expected)
        checks.equal("combined_x", combined, expected.combined)
    del graph
    return checks.failures


def _too_small(group: Any, rank: int, num_ranks: int) -> dict:
    """num_rdma_bytes short of the hint: the first dispatch raises BufferTooSmallError on every rank
    (only the ranks whose own sizes do not fit when they differ; the others PeerInputError), builds
    nothing, and a later call with sizes that fit works."""
    needed = Buffer.get_low_latency_rdma_size_hint(T_LL, HIDDEN, num_ranks, NUM_EXPERTS)
    results: dict[str, Any] = {"needed": needed}
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16, device=_device())
    idx = torch.full((4, NUM_TOPK), -1, dtype=torch.int64, device=_device())

    def attempt(buffer: Buffer, cap: int) -> dict:
        try:
            buffer.low_latency_dispatch(x, idx, cap, NUM_EXPERTS)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return {
                "kind": type(exc).__name__,
                "message": str(exc),
                "needed_bytes": getattr(exc, "needed_bytes", None),
                "is_value_error": isinstance(exc, ValueError),
                "sizing": buffer.low_latency_sizing,
            }
        return {"kind": None, "sizing": buffer.low_latency_sizing}

    short = Buffer(group, 0, needed - 1, low_latency_mode=True, explicitly_destroy=True)
    try:
        results["short"] = attempt(short, T_LL)
    finally:
        short.destroy()

    exact = Buffer(group, 0, needed, low_latency_mode=True, explicitly_destroy=True)
    try:
        big = 4 * T_LL
        results["big_needed"] = Buffer.get_low_latency_rdma_size_hint(big, HIDDEN, num_ranks, NUM_EXPERTS)
        results["all_big"] = attempt(exact, big)
        if num_ranks > 1:
            results["rank0_big"] = attempt(exact, big if rank == 0 else T_LL)
        results["fits"] = attempt(exact, T_LL)
        inputs, expected = _inputs_and_reference(rank, num_ranks, 41, use_fp8=False, num_tokens=8, uneven=False)
        checks = Checks("after too small")
        _round_trip(exact, inputs, expected, LLCase(False, False, False, "direct"), checks)
        results["failures"] = checks.failures
    finally:
        exact.destroy()
    return results


def _rank_main(rank: int, num_ranks: int, group: Any) -> dict:
    os.environ["EP_GPU_TIMEOUT_SECS"] = GPU_TIMEOUT_SECS  # this rank's process only
    results: dict[str, Any] = {}
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(T_LL, HIDDEN, num_ranks, NUM_EXPERTS)
    buffer = Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, explicitly_destroy=True)
    device = _device()
    stats = {
        "dispatch_wait": torch.zeros(num_ranks, dtype=torch.int64, device=device),
        "combine_wait": torch.zeros(num_ranks, dtype=torch.int64, device=device),
    }
    try:
        results["before_first_call"] = {
            "sizing": buffer.low_latency_sizing,
            "rdma_view": capture(lambda: buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)),
            "combine_buffer": capture(lambda: buffer.get_next_low_latency_combine_buffer(None)),
        }
        guarded(results, "capture", lambda: _first_call_under_capture(buffer, rank, num_ranks))
        results["cases"] = _cases(buffer, rank, num_ranks, stats)
        results["stats"] = {name: tensor.tolist() for name, tensor in stats.items()}
        guarded(results, "windows", lambda: _windows(buffer, num_ranks))
        results["refusals"] = _refusals(buffer, rank, num_ranks)
        results["graph"] = _graph(buffer, rank, num_ranks)
        # Every refusal happened on every rank: no peer report is left over.
        results["errors_after"] = capture(buffer._ll_core.check_errors)
    finally:
        buffer.destroy()
    torch.cuda.empty_cache()
    results["too_small"] = _too_small(group, rank, num_ranks)
    return results


# ------------------------------------------------------------------------------------- tests


@pytest.fixture
def v1_ll_results(num_ranks: int) -> list[dict]:
    """Per-rank results of the whole sequence, run once per rank count."""
    return launch_once(_rank_main, num_ranks)


def _no_exception(rank: int, value: Any) -> None:
    assert not (isinstance(value, dict) and "exception" in value), f"rank {rank}: {value['exception']}"


def test_dispatch_and_combine_match_the_compact_reference_bitwise(v1_ll_results: list[dict]) -> None:
    """Every case: counts, valid rows, column-major (or UE8M0) scales, handle[0] / handle[1], the
    cumulative stats, both combines (with out=, and zero-copy), bit for bit."""
    failures = [
        f"rank {rank}: {item}" for rank, r in enumerate(v1_ll_results) for f in r["cases"].values() for item in f
    ]
    assert not failures, "\n".join(failures)


def test_wait_cost_stats_accumulate(v1_ll_results: list[dict]) -> None:
    for rank, result in enumerate(v1_ll_results):
        for name, values in result["stats"].items():
            assert all(value >= 0 for value in values), (rank, name, values)
            assert sum(values) > 0, f"rank {rank}: {name} never grew: {values}"


def test_the_first_call_builds_the_window_and_refuses_graph_capture(v1_ll_results: list[dict]) -> None:
    for rank, result in enumerate(v1_ll_results):
        before = result["before_first_call"]
        assert before["sizing"] is None
        assert before["rdma_view"][0] == "RuntimeError" and "first low_latency_dispatch" in before["rdma_view"][1]
        assert before["combine_buffer"][0] == "RuntimeError"
        refused = result["capture"]
        _no_exception(rank, refused)
        assert refused["kind"] == "RuntimeError" and "CUDA-graph capture" in refused["message"], (rank, refused)
        assert refused["sizing_after"] is None, "nothing was built inside the capture"
        _no_exception(rank, result["windows"])
        assert not result["windows"], f"rank {rank}: " + "\n".join(result["windows"])


def test_refused_calls_raise_on_every_rank_and_keep_the_ranks_in_step(v1_ll_results: list[dict]) -> None:
    for rank, result in enumerate(v1_ll_results):
        refusals = result["refusals"]
        built = f"num_max_dispatch_tokens_per_rank={T_LL}, hidden={HIDDEN}, num_experts={NUM_EXPERTS}"
        for name, words in (
            ("other_cap", f"num_max_dispatch_tokens_per_rank={T_LL + 1}"),
            ("other_hidden", f"hidden={HIDDEN - 1024}"),
            ("other_experts", f"num_experts={2 * NUM_EXPERTS}"),
        ):
            kind, message = refusals[name]
            assert kind == "ValueError" and words in message and built in message, (rank, name, kind, message)
        kind, message = refusals["logfmt"]
        assert kind == "NotImplementedError" and "use_logfmt" in message, (rank, kind, message)
        assert refusals["clean"] == (None, "")
        assert refusals["clean_other"][0] == "ValueError"
        for kind, message in refusals["masks"]:  # this Buffer has no enable_shrink (test_rank_masking.py has)
            assert kind == "RuntimeError" and "enable_shrink=True" in message, (rank, kind, message)
        assert not refusals["failures"], f"rank {rank}: " + "\n".join(refusals["failures"])
        assert result["errors_after"] == (None, ""), (rank, result["errors_after"])


def test_captured_dispatch_and_combine_replay_correctly(v1_ll_results: list[dict]) -> None:
    failures = [f"rank {rank}: {item}" for rank, r in enumerate(v1_ll_results) for item in r["graph"]]
    assert not failures, "\n".join(failures)


def test_too_small_num_rdma_bytes_raises_on_every_rank(v1_ll_results: list[dict]) -> None:
    for rank, result in enumerate(v1_ll_results):
        too_small = result["too_small"]
        needed, big_needed = too_small["needed"], too_small["big_needed"]
        short = too_small["short"]
        assert short["kind"] == BufferTooSmallError.__name__ and short["needed_bytes"] == needed, (rank, short)
        assert str(needed) in short["message"] and short["sizing"] is None
        all_big = too_small["all_big"]
        assert all_big["kind"] == BufferTooSmallError.__name__ and all_big["needed_bytes"] == big_needed, (
            rank,
            all_big,
        )
        if "rank0_big" in too_small:
            one = too_small["rank0_big"]
            expected = BufferTooSmallError if rank == 0 else PeerInputError
            assert one["kind"] == expected.__name__ and one["is_value_error"], (rank, one)
            assert one["sizing"] is None
        fits = too_small["fits"]
        assert fits["kind"] is None and fits["sizing"] == (T_LL, HIDDEN, NUM_EXPERTS), (rank, fits)
        assert not too_small["failures"], f"rank {rank}: " + "\n".join(too_small["failures"])
