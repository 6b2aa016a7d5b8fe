"""Seeded fuzz: a few hundred random HT and LL round trips against the reference model, bitwise.

Every iteration draws its mode from ``random.Random(seed)`` (the same on every rank, so the ranks
issue the same operations) and every source rank's inputs from
``torch.Generator().manual_seed(seed * 1000 + source)``, so each rank rebuilds the whole group's
inputs, runs the reference for the group on its GPU and compares its own part. ``seed`` is
``SEED + iteration``; a failure names the iteration, the seed and the full mode.

HT modes: bf16 / fp8, expand on / off with a random ``expert_alignment``, 0 / 1 / 2 biases, weights
or not, a cached re-dispatch of new tokens, ``do_cpu_sync=False``, and every stream variant
(``async_with_compute_stream``, ``allocate_on_comm_stream`` with and without ``previous_event``).
LL modes: fp8 / bf16, direct / ``return_recv_hook`` / ``async_finish`` for dispatch and combine
independently, ``out=``, and two micro-batches with both hooks outstanding. Routing: random T per
rank (0 and the cap included), random -1 density, all -1 tokens, one hot expert, and (some
iterations) repeated or out-of-range expert ids, which the library reports as ValueError at the next
synchronisation point and otherwise treats as -1 (``sanitize_topk_idx``).

One buffer per launch serves every iteration: HT sized for the largest case, LL for its one shape.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from ht_checks import assert_bitwise_equal, device, expert_output, make_buffer, split
from ll_calls import NoHostSync, ll_combine_call, ll_dispatch_call, ll_expert_output

from deep_ep import per_token_cast_to_fp8
from deep_ep.testing import launch
from deep_ep.testing.data import make_routing, make_tokens, make_weights
from deep_ep.testing.reference import (
    ht_combine,
    ht_dispatch,
    ll_combine,
    ll_dispatch,
    ll_valid_row_mask,
    sanitize_topk_idx,
)

SEED = 7_000
NUM_ITERATIONS = 300
HT_SHARE = 0.6  # of the iterations; the rest are LL
BAD_IDS_SHARE = 0.125  # iterations whose routing has repeated or out-of-range ids on some ranks

# The buffer: HT sized for T_max 256, H 2048, K 8 (bf16, the larger payload); LL for its one shape.
MAX_TOKENS = 256
HIDDEN = 2048
MAX_TOPK = 8
LL_MAX_TOKENS = 128
LL_EXPERTS = 64
GPU_TIMEOUT_SECS = 60  # a protocol bug fails the run in a minute instead of hanging it

HT_HIDDEN_SIZES = (1024, 1536, 2048)
HT_MAX_TOKENS = (MAX_TOKENS, 128, 33, 1)
ALIGNMENTS = (1, 2, 8, 32, 128)
MINUS_ONE_RATIOS = (0.0, 0.05, 0.2, 0.5, 0.9)

# name -> (flags for dispatch and combine, whether to pass previous_event=buffer.capture()).
STREAM_VARIANTS: dict[str, tuple[dict[str, bool], bool]] = {
    "caller stream": ({}, False),
    "async": ({"async_with_compute_stream": True}, False),
    "comm alloc": ({"allocate_on_comm_stream": True}, False),
    "comm alloc + previous_event": ({"allocate_on_comm_stream": True}, True),
    "async + comm alloc + previous_event": (
        {"allocate_on_comm_stream": True, "async_with_compute_stream": True},
        True,
    ),
}
LL_CALL_MODES = ("direct", "hook", "async")


def ht_expert_counts(num_ranks: int) -> list[int]:
    """HT expert counts the fuzz draws from: multiples of R in [32, 64]."""
    return [count for count in range(32, 65) if count % num_ranks == 0]


# ------------------------------------------------------------------------------------- modes


@dataclass(frozen=True)
class Routing:
    minus_one_ratio: float
    all_minus_one_tokens: int
    hot_expert: int | None
    hot_ratio: float


@dataclass(frozen=True)
class HtMode:
    hidden: int
    num_topk: int
    num_experts: int
    num_max_tokens: int
    use_fp8: bool
    do_expand: bool
    expert_alignment: int
    num_biases: int
    with_weights: bool
    scale_outputs: bool
    cached: bool
    do_cpu_sync: bool
    streams: str
    bad_ids: bool
    routing: Routing


@dataclass(frozen=True)
class LlMode:
    num_topk: int
    use_fp8: bool
    dispatch_mode: str
    combine_mode: str
    with_out: bool
    two_batches: bool  # two dispatches with hooks outstanding, then both combines
    bad_ids: bool
    routing: Routing


def draw_routing(rng: random.Random, num_experts: int) -> Routing:
    return Routing(
        minus_one_ratio=rng.choice(MINUS_ONE_RATIOS),
        all_minus_one_tokens=rng.choice((0, 1, 8)),
        hot_expert=rng.randrange(num_experts) if rng.random() < 0.3 else None,
        hot_ratio=rng.choice((0.3, 0.7, 1.0)),
    )


def draw_ht_mode(rng: random.Random, num_ranks: int) -> HtMode:
    num_experts = rng.choice(ht_expert_counts(num_ranks))
    bad_ids = rng.random() < BAD_IDS_SHARE
    do_expand = rng.random() < 0.5
    return HtMode(
        hidden=rng.choice(HT_HIDDEN_SIZES),
        num_topk=rng.randint(1, MAX_TOPK),
        num_experts=num_experts,
        num_max_tokens=rng.choice(HT_MAX_TOKENS),
        use_fp8=rng.random() < 0.5,
        do_expand=do_expand,
        expert_alignment=rng.choice(ALIGNMENTS),
        num_biases=rng.choice((0, 1, 2)),
        with_weights=rng.random() < 0.7,
        scale_outputs=rng.random() < 0.7,
        # A dispatch whose routing has bad ids reports them at its CPU sync, and then returns no
        # handle: such iterations dispatch once, without a CPU sync, and read the report later.
        cached=not bad_ids and rng.random() < 0.4,
        do_cpu_sync=not bad_ids and rng.random() < 0.6,
        streams=rng.choice(list(STREAM_VARIANTS)),
        bad_ids=bad_ids,
        routing=draw_routing(rng, num_experts),
    )


def draw_ll_mode(rng: random.Random, num_ll_topk: int) -> LlMode:
    two_batches = rng.random() < 0.2
    return LlMode(
        num_topk=rng.randint(1, num_ll_topk),
        use_fp8=rng.random() < 0.5,
        dispatch_mode="hook" if two_batches else rng.choice(LL_CALL_MODES),
        combine_mode="hook" if two_batches else rng.choice(LL_CALL_MODES),
        with_out=rng.random() < 0.5,
        two_batches=two_batches,
        bad_ids=rng.random() < BAD_IDS_SHARE,
        routing=draw_routing(rng, LL_EXPERTS),
    )


# ------------------------------------------------------------------------------------ inputs


def source_generator(seed: int, source: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1000 + source)


def draw_num_tokens(generator: torch.Generator, cap: int) -> int:
    """0 about 12 % of the time, the cap about 13 %, else uniform in [1, cap]."""
    draw = float(torch.rand((), generator=generator))
    if draw < 0.12:
        return 0
    if draw < 0.25:
        return cap
    return int(torch.randint(1, cap + 1, (), generator=generator))


def draw_topk_idx(
    num_tokens: int, num_experts: int, num_topk: int, routing: Routing, bad_ids: bool, generator: torch.Generator
) -> torch.Tensor:
    topk_idx = make_routing(
        num_tokens,
        num_experts,
        num_topk,
        generator=generator,
        minus_one_ratio=routing.minus_one_ratio,
        all_minus_one_tokens=routing.all_minus_one_tokens,
        hot_expert=routing.hot_expert,
        hot_ratio=routing.hot_ratio,
    )
    # With bad ids on, about half the ranks spoil an eighth of their rows (one entry each).
    if not bad_ids or num_tokens == 0 or float(torch.rand((), generator=generator)) < 0.5:
        return topk_idx
    spoiled = torch.randperm(num_tokens, generator=generator)[: max(1, num_tokens // 8)]
    for token in spoiled.tolist():
        slot = int(torch.randint(num_topk, (), generator=generator))
        earlier = (topk_idx[token, :slot] >= 0).nonzero().squeeze(1)
        if earlier.numel() > 0 and float(torch.rand((), generator=generator)) < 0.6:
            topk_idx[token, slot] = topk_idx[token, int(earlier[0])]  # a repeat of an earlier slot
        else:
            outside = (num_experts, num_experts + 7, -2, -1000)
            topk_idx[token, slot] = outside[int(torch.randint(len(outside), (), generator=generator))]
    return topk_idx


def has_bad_ids(topk_idx: torch.Tensor, num_experts: int) -> bool:
    return not torch.equal(sanitize_topk_idx(topk_idx, num_experts), topk_idx)


@dataclass
class HtInputs:
    """Every rank's HT inputs on this rank's GPU (indexed by source rank)."""

    xs: list[Any]  # bf16 [T, H] or (fp8, scales)
    cached_xs: list[Any] | None  # new tokens for the cached re-dispatch
    topk_idxs: list[torch.Tensor]
    weights: list[torch.Tensor] | None
    cached_weights: list[torch.Tensor] | None
    biases: list[Any] | None  # per source: None, a tensor or a pair


def _as_dispatch_input(x: torch.Tensor, use_fp8: bool) -> Any:
    return per_token_cast_to_fp8(x) if use_fp8 else x


def make_ht_inputs(mode: HtMode, num_ranks: int, seed: int) -> HtInputs:
    dev = device()
    xs, cached_xs, topk_idxs, weights, cached_weights, biases = [], [], [], [], [], []
    for source in range(num_ranks):
        generator = source_generator(seed, source)
        num_tokens = draw_num_tokens(generator, mode.num_max_tokens)
        topk_idx = draw_topk_idx(num_tokens, mode.num_experts, mode.num_topk, mode.routing, mode.bad_ids, generator)
        topk_idxs.append(topk_idx.to(dev))
        weights.append(make_weights(topk_idx, generator).to(dev))
        xs.append(_as_dispatch_input(make_tokens(num_tokens, mode.hidden, generator).to(dev), mode.use_fp8))
        cached_xs.append(_as_dispatch_input(make_tokens(num_tokens, mode.hidden, generator).to(dev), mode.use_fp8))
        cached_weights.append(make_weights(topk_idx, generator).to(dev))
        terms = [make_tokens(num_tokens, mode.hidden, generator).to(dev) for _ in range(mode.num_biases)]
        biases.append(None if not terms else terms[0] if len(terms) == 1 else tuple(terms))
    return HtInputs(
        xs=xs,
        cached_xs=cached_xs if mode.cached else None,
        topk_idxs=topk_idxs,
        weights=weights if mode.with_weights else None,
        cached_weights=cached_weights if mode.with_weights else None,
        biases=biases if mode.num_biases else None,
    )


@dataclass
class HtExpected:
    dispatch: dict  # this rank's part of ht_dispatch
    combined: dict  # this rank's part of ht_combine ("x", "topk_weights")


def ht_reference(
    mode: HtMode, inputs: HtInputs, rank: int, xs: list[Any], weights: list[torch.Tensor] | None
) -> HtExpected:
    """The reference for the whole group; the experts are ``expert_output`` of every received row."""
    results = ht_dispatch(
        xs,
        inputs.topk_idxs,
        weights,
        mode.num_experts,
        expert_alignment=mode.expert_alignment,
        do_expand=mode.do_expand,
    )
    ys = [
        expert_output((r["x"], r["x_scales"]) if r["x_scales"] is not None else r["x"], dest, mode.scale_outputs)
        for dest, r in enumerate(results)
    ]
    combined = ht_combine(
        results,
        ys,
        inputs.topk_idxs,
        mode.num_experts,
        weights_list=None if weights is None else [r["topk_weights"] for r in results],
        biases=inputs.biases,
        do_expand=mode.do_expand,
    )[rank]
    return HtExpected(results[rank], combined)


# ------------------------------------------------------------------------------- HT calls


def keep_compute_stream_busy() -> None:
    """Work on the caller's stream while the communication stream runs."""
    busy = torch.randn(1024, 1024, device=device())
    for _ in range(3):
        busy = busy @ busy / 1024


def _stream_kwargs(buffer: Any, streams: str) -> dict[str, Any]:
    flags, wait_for_previous = STREAM_VARIANTS[streams]
    return {**flags, "previous_event": buffer.capture()} if wait_for_previous else dict(flags)


def _finish(streams: str, event: Any) -> None:
    if STREAM_VARIANTS[streams][0].get("async_with_compute_stream"):
        keep_compute_stream_busy()
        event.current_stream_wait()


def ht_dispatch_call(
    buffer: Any,
    mode: HtMode,
    x: Any,
    topk_idx: torch.Tensor,
    weights: torch.Tensor | None,
    handle: Any = None,
) -> tuple:
    """One HT dispatch in ``mode`` (cached when ``handle`` is given); outputs ready on the caller's stream."""
    kwargs = _stream_kwargs(buffer, mode.streams)
    if handle is not None:
        outputs = buffer.dispatch(x, topk_weights=weights, handle=handle, **kwargs)
    else:
        outputs = buffer.dispatch(
            x,
            topk_idx,
            weights,
            num_experts=mode.num_experts,
            num_max_tokens_per_rank=mode.num_max_tokens,
            expert_alignment=mode.expert_alignment,
            do_expand=mode.do_expand,
            do_cpu_sync=mode.do_cpu_sync,
            **kwargs,
        )
    _finish(mode.streams, outputs[4])
    return outputs


def ht_combine_call(buffer: Any, mode: HtMode, outputs: tuple, rank: int, bias: Any) -> tuple:
    """Combine the expert outputs of a dispatch's rows; returns ``(combined_x, combined_topk_weights)``."""
    recv_x, _, recv_topk_weights, handle, _ = outputs
    y = expert_output(recv_x, rank, mode.scale_outputs)
    kwargs = _stream_kwargs(buffer, mode.streams)
    combined, combined_weights, event = buffer.combine(y, handle, topk_weights=recv_topk_weights, bias=bias, **kwargs)
    _finish(mode.streams, event)
    return combined, combined_weights


def _prefix(tensor: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    return None if tensor is None else tensor[:rows]


def check_ht_dispatch(mode: HtMode, expected: dict, outputs: tuple, num_ranks: int) -> None:
    """Outputs and handle of one dispatch against the reference. Without a CPU sync the outputs
    have worst-case sizes and only the prefix the reference describes is compared."""
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = outputs
    data, scales = split(recv_x)
    rows = expected["x"].shape[0]  # received tokens, or expanded rows with padding
    received = sum(expected["num_recv_tokens_per_rank"])
    per_expert = expected["num_recv_tokens_per_expert"]
    aligned = expected["num_recv_tokens_per_expert_aligned"]
    allocated = handle.num_expanded_tokens if mode.do_expand else handle.num_recv_tokens
    assert data.shape[0] == allocated, f"recv_x has {data.shape[0]} rows, the handle says {allocated}"
    if handle.is_exact:
        assert allocated == rows, f"recv_x has {allocated} rows after a CPU sync, expected {rows}"
        assert handle.num_recv_tokens == received, f"num_recv_tokens {handle.num_recv_tokens}, expected {received}"
        assert handle.num_recv_tokens_per_expert_list == aligned, (
            f"num_recv_tokens_per_expert_list {handle.num_recv_tokens_per_expert_list}, expected {aligned}"
        )
    else:
        assert allocated >= rows, f"worst-case recv_x has {allocated} rows, fewer than the {rows} received"
        worst = num_ranks * mode.num_max_tokens
        assert handle.num_recv_tokens == worst, f"num_recv_tokens {handle.num_recv_tokens}, expected R*T_max={worst}"
        assert handle.num_recv_tokens_per_expert_list == [], "no-sync handle has a per-expert list"
    assert_bitwise_equal("recv_x", data[:rows], expected["x"])
    assert_bitwise_equal("recv_x scales", _prefix(scales, rows), expected["x_scales"])
    assert_bitwise_equal("recv_topk_weights", _prefix(recv_topk_weights, rows), expected["topk_weights"])

    stats = handle.stats
    assert stats["tokens_per_source_rank"].tolist() == expected["num_recv_tokens_per_rank"], "tokens per source rank"
    assert stats["tokens_per_local_expert"].tolist() == per_expert, "tokens per local expert"
    assert handle.num_unaligned_recv_tokens_per_expert.tolist() == per_expert, "unaligned counts per expert"
    psum_rank = torch.tensor(expected["num_recv_tokens_per_rank"]).cumsum(0).tolist()
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == psum_rank, "psum per source rank"
    psum_aligned = torch.tensor(aligned, dtype=torch.int64).cumsum(0)
    if mode.do_expand:  # first row of expert l plus its count
        psum_expert = (psum_aligned - torch.tensor(aligned) + torch.tensor(per_expert)).tolist()
    else:  # inclusive prefix sum of the aligned counts
        psum_expert = psum_aligned.tolist()
    assert handle.psum_num_recv_tokens_per_expert.tolist() == psum_expert, (
        f"psum_num_recv_tokens_per_expert {handle.psum_num_recv_tokens_per_expert.tolist()}, expected {psum_expert}"
    )
    if mode.do_expand:
        assert recv_topk_idx is None, "expand mode returns no recv_topk_idx"
        return
    assert_bitwise_equal("recv_topk_idx", recv_topk_idx[:rows], expected["topk_idx"])
    info = handle.recv_src_info
    assert_bitwise_equal("recv_src_info source rank", info[:rows, 0].long(), expected["src_rank"])
    assert_bitwise_equal("recv_src_info source token", info[:rows, 1].long(), expected["src_token"])


def check_ht_combine(expected: dict, combined: torch.Tensor, combined_weights: torch.Tensor | None) -> None:
    assert_bitwise_equal("combined_x", combined, expected["x"])
    assert_bitwise_equal("combined_topk_weights", combined_weights, expected["topk_weights"])


def read_routing_report(buffer: Any) -> str | None:
    """Synchronise (``check_errors``) and take what the kernels reported: the ValueError message (a
    bad routing entry of this rank), or None. Anything else propagates."""
    try:
        buffer.check_errors()
    except ValueError as error:
        if type(error) is not ValueError:  # e.g. a peer's failed input: not what this test causes
            raise
        return str(error)
    return None


def expect_routing_report(buffer: Any, expected: bool, what: str) -> None:
    report = read_routing_report(buffer)
    if expected:
        assert report is not None, f"{what}: this rank's bad expert ids were not reported"
        assert "topk_idx" in report, f"{what}: unexpected report {report!r}"
    else:
        assert report is None, f"{what}: reported {report!r} although this rank's routing is valid"


def run_ht_iteration(buffer: Any, rank: int, num_ranks: int, mode: HtMode, seed: int) -> None:
    inputs = make_ht_inputs(mode, num_ranks, seed)
    bad = mode.bad_ids and has_bad_ids(inputs.topk_idxs[rank].cpu(), mode.num_experts)
    weights = None if inputs.weights is None else inputs.weights[rank]
    bias = None if inputs.biases is None else inputs.biases[rank]

    outputs = ht_dispatch_call(buffer, mode, inputs.xs[rank], inputs.topk_idxs[rank], weights)
    if mode.bad_ids:
        expect_routing_report(buffer, bad, "dispatch")
    expected = ht_reference(mode, inputs, rank, inputs.xs, inputs.weights)
    check_ht_dispatch(mode, expected.dispatch, outputs, num_ranks)

    if mode.cached:
        # Same routing (the handle's), new tokens and weights.
        cached_weights = None if inputs.cached_weights is None else inputs.cached_weights[rank]
        outputs = ht_dispatch_call(buffer, mode, inputs.cached_xs[rank], None, cached_weights, handle=outputs[3])
        expected = ht_reference(mode, inputs, rank, inputs.cached_xs, inputs.cached_weights)
        check_ht_dispatch(mode, expected.dispatch, outputs, num_ranks)

    combined, combined_weights = ht_combine_call(buffer, mode, outputs, rank, bias)
    if mode.bad_ids:
        read_routing_report(buffer)  # combine may see the bad ids again; the dispatch's report was checked
    check_ht_combine(expected.combined, combined, combined_weights)


# ------------------------------------------------------------------------------- LL calls


@dataclass
class LlBatch:
    """One LL micro-batch: this rank's inputs and its part of the reference."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    has_bad_ids: bool
    dispatch: dict
    combined: torch.Tensor


def make_ll_batches(
    mode: LlMode, rank: int, num_ranks: int, seed: int, *, num_max_tokens: int, hidden: int, num_experts: int
) -> list[LlBatch]:
    """Every source draws its batches from its own generator, in batch order; the shape is the
    buffer's (T_ll, H, E)."""
    dev = device()
    generators = [source_generator(seed, source) for source in range(num_ranks)]
    batches = []
    for _ in range(2 if mode.two_batches else 1):
        xs, idxs, weights = [], [], []
        for generator in generators:
            num_tokens = draw_num_tokens(generator, num_max_tokens)
            topk_idx = draw_topk_idx(num_tokens, num_experts, mode.num_topk, mode.routing, mode.bad_ids, generator)
            idxs.append(topk_idx.to(dev))
            weights.append(make_weights(topk_idx, generator).to(dev))
            xs.append(make_tokens(num_tokens, hidden, generator).to(dev))
        results = ll_dispatch(xs, idxs, num_experts, num_max_tokens, use_fp8=mode.use_fp8)
        ys = []
        for dest, result in enumerate(results):
            ys.append(
                ll_expert_output((result["x"], result["x_scales"]) if mode.use_fp8 else result["x"], mode.use_fp8)
            )
            if dest != rank:  # ll_combine only needs src_token of the other ranks: free the payloads
                result["x"] = result["x_scales"] = None
        combined = ll_combine(results, ys, idxs, weights, num_experts, num_max_tokens)[rank]
        bad = mode.bad_ids and has_bad_ids(idxs[rank].cpu(), num_experts)
        batches.append(LlBatch(xs[rank], idxs[rank], weights[rank], bad, results[rank], combined))
    return batches


def ll_dispatch_batch(buffer: Any, batch: LlBatch, use_fp8: bool, mode: str) -> tuple:
    """``ll_dispatch_call`` on one micro-batch."""
    return ll_dispatch_call(buffer, batch.x, batch.topk_idx, use_fp8, mode)


def ll_combine_batch(buffer: Any, y: torch.Tensor, batch: LlBatch, handle: Any, mode: str, with_out: bool) -> tuple:
    """``ll_combine_call`` on one micro-batch; with ``with_out`` the result lands in a given tensor."""
    out = None
    if with_out:
        out = torch.full((batch.x.shape[0], buffer.hidden), float("nan"), dtype=torch.bfloat16, device=batch.x.device)
    combined, hook = ll_combine_call(buffer, y, batch.topk_idx, batch.topk_weights, handle, mode, out)
    if out is not None:
        assert combined.data_ptr() == out.data_ptr(), "low_latency_combine(out=...) did not return the given tensor"
    return combined, hook


def call_hook(hook: Any) -> None:
    if hook is not None:
        with NoHostSync():
            hook()


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """Raw bytes for fp8 (boolean indexing and comparisons do not cover float8 everywhere)."""
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def check_ll_dispatch(expected: dict, recv_x: Any, recv_count: torch.Tensor, handle: Any) -> None:
    """Counts, headers and payload of the rows the reference defines (the others are undefined)."""
    valid = ll_valid_row_mask(expected)
    assert_bitwise_equal("recv_count", recv_count, expected["count"])
    assert_bitwise_equal("count_per_source", handle.count_per_source, expected["count_per_source"])
    assert_bitwise_equal("recv_src_info", handle.recv_src_info.long()[valid], expected["src_token"][valid])
    assert_bitwise_equal("recv_layout_range", handle.recv_layout_range, expected["layout_range"])
    if handle.recv_layout == "per_source":  # the window headers are laid out like per-source rows
        assert_bitwise_equal("recv_src_token", handle.recv_src_token.long()[valid], expected["src_token"][valid])
        assert_bitwise_equal("recv_topk_slot", handle.recv_topk_slot.long()[valid], expected["topk_slot"][valid])
    data, scales = split(recv_x)
    assert_bitwise_equal("recv_x", _bits(data)[valid], _bits(expected["x"])[valid])
    if expected["x_scales"] is None:
        assert scales is None, "bf16 dispatch returned scales"
    else:
        assert_bitwise_equal("recv_x scales", scales[valid], expected["x_scales"][valid])


def run_ll_iteration(buffer: Any, rank: int, num_ranks: int, mode: LlMode, seed: int) -> None:
    batches = make_ll_batches(
        mode,
        rank,
        num_ranks,
        seed,
        num_max_tokens=buffer.num_max_dispatch_tokens_per_rank,
        hidden=buffer.hidden,
        num_experts=buffer.num_experts,
    )
    # Every dispatch is sent before any hook runs (two batches: both hooks outstanding).
    sent = [ll_dispatch_batch(buffer, batch, mode.use_fp8, mode.dispatch_mode) for batch in batches]
    for *_, hook in sent:
        call_hook(hook)
    if mode.bad_ids:
        expect_routing_report(buffer, any(batch.has_bad_ids for batch in batches), "low_latency_dispatch")
    ys = []
    for index, (batch, (recv_x, recv_count, handle, _)) in enumerate(zip(batches, sent, strict=True)):
        try:
            check_ll_dispatch(batch.dispatch, recv_x, recv_count, handle)
        except AssertionError as error:
            raise AssertionError(f"batch {index}: {error}") from error
        ys.append(ll_expert_output(recv_x, mode.use_fp8))
    combines = [
        ll_combine_batch(buffer, y, batch, handle, mode.combine_mode, mode.with_out)
        for y, batch, (_, _, handle, _) in zip(ys, batches, sent, strict=True)
    ]
    for _, hook in combines:
        call_hook(hook)
    if mode.bad_ids:
        read_routing_report(buffer)  # combine may see the bad ids again; the dispatch's report was checked
    for index, (batch, (combined, _)) in enumerate(zip(batches, combines, strict=True)):
        assert_bitwise_equal(f"batch {index} combined_x", combined, batch.combined)


# ----------------------------------------------------------------------------------- driver


def make_fuzz_buffer(group: Any) -> Any:
    return make_buffer(
        group,
        num_max_tokens_per_rank=MAX_TOKENS,
        hidden=HIDDEN,
        num_topk=MAX_TOPK,
        num_max_dispatch_tokens_per_rank=LL_MAX_TOKENS,
        num_experts=LL_EXPERTS,
        num_gpu_timeout_secs=GPU_TIMEOUT_SECS,
    )


def run_iteration(buffer: Any, rank: int, num_ranks: int, iteration: int) -> str:
    """Run one seeded iteration; returns its kind. Any failure names the iteration, seed and mode."""
    seed = SEED + iteration
    rng = random.Random(seed)
    mode: HtMode | LlMode
    if rng.random() < HT_SHARE:
        mode = draw_ht_mode(rng, num_ranks)
    else:
        mode = draw_ll_mode(rng, min(MAX_TOPK, buffer.num_ll_topk))
    try:
        if isinstance(mode, HtMode):
            run_ht_iteration(buffer, rank, num_ranks, mode, seed)
        else:
            run_ll_iteration(buffer, rank, num_ranks, mode, seed)
    except Exception as error:
        raise AssertionError(
            f"iteration {iteration}, seed {seed} (source s draws from torch.Generator().manual_seed({seed} * 1000 "
            f"+ s)), rank {rank} of {num_ranks}, mode {mode}: {type(error).__name__}: {error}"
        ) from error
    return type(mode).__name__


def _fuzz(rank: int, num_ranks: int, group: Any) -> dict[str, int]:
    buffer = make_fuzz_buffer(group)
    try:
        kinds: dict[str, int] = {}
        for iteration in range(NUM_ITERATIONS):
            kind = run_iteration(buffer, rank, num_ranks, iteration)
            kinds[kind] = kinds.get(kind, 0) + 1
        buffer.check_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
        return kinds
    finally:
        buffer.destroy()


def test_random_round_trips_in_every_mode_match_reference_bitwise(num_ranks):
    if LL_EXPERTS % num_ranks != 0 or not ht_expert_counts(num_ranks):
        pytest.skip(f"the fuzz shapes need R to divide {LL_EXPERTS} experts, got R={num_ranks}")
    kinds = launch(_fuzz, num_ranks)
    assert all(sum(counts.values()) == NUM_ITERATIONS for counts in kinds), kinds
    assert all(counts.get("HtMode", 0) > 0 and counts.get("LlMode", 0) > 0 for counts in kinds), kinds
