"""HT hybrid mode: virtual nodes of S consecutive ranks on one host (``num_ranks_per_node=S``,
``allow_hybrid_mode=True``), a token crossing between nodes once per target node and forwarded
inside the node.

- dispatch is bitwise identical to direct mode, so the direct reference checks it unchanged;
  combine follows the hierarchical order (``ht_combine(..., num_ranks_per_node=S)``), bitwise;
- ``handle.stats["scaleout_copies"]`` is exactly the per-node cross-node copy count of the planner
  (``deep_ep.plan.cross_node_copies``) for the same routing;
- cached dispatch, no CPU sync, events / previous_event and CUDA graphs work as in direct mode;
- a late rank changes nothing; a missing rank makes every other rank raise CommTimeoutError
  naming a peer within the GPU timeout + 2 s, and a new hybrid buffer then works;
- ``allow_hybrid_mode=False`` with the same S stays direct (same dispatch bits, direct combine order).

Topologies (a pytest parameter): 2x4, 4x2 and 8x1 virtual nodes at 8 ranks, 2x2 at 4 ranks; the
others skip at a rank count (EP_TEST_RANKS) that does not fit. Each topology runs in one launch,
which builds one buffer per scale-out transport ("lsa", then "lsa-deferred"), forcing it through
EP_SCALEOUT_TRANSPORT set in every rank process just before the buffer is built (the buffer reads it
at construction); failures name the topology, the transport, the case, the rank and the first
differing index. One launch per topology rather than per (topology, transport) keeps the file near
a minute and a half at 8 ranks on one H200: starting 8 rank processes costs several seconds.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from ht_checks import (
    Case,
    GroupOnDevice,
    assert_bitwise_equal,
    assert_outputs_equal,
    check_dispatch,
    check_src_metadata,
    device,
    dispatch_case,
    expert_output,
    group_inputs,
    keep_compute_stream_busy,
    make_buffer,
    run_case,
    split,
)

import deep_ep
from deep_ep.plan import cross_node_copies, node_limited_topk
from deep_ep.testing import launch
from deep_ep.testing.data import make_routing, make_tokens, make_weights
from deep_ep.testing.reference import ht_combine, ht_dispatch

TRANSPORT_ENV = "EP_SCALEOUT_TRANSPORT"
TRANSPORTS = ("lsa", "lsa-deferred")

# (ranks, ranks per node): the launched rank count (EP_TEST_RANKS) must match.
TOPOLOGIES = [
    pytest.param(8, 4, id="2x4"),
    pytest.param(8, 2, id="4x2"),
    pytest.param(8, 1, id="8x1"),
    pytest.param(4, 2, id="2x2"),
]

# The buffer of the reference cases is sized for the largest of them.
MAX_TOKENS = 256
MAX_HIDDEN = 7168
MAX_TOPK = 8
DELAY_SECS = 0.5  # a late rank: far below the GPU timeout, far above a kernel's run time


def _require(num_ranks: int, topology_ranks: int, ranks_per_node: int) -> None:
    if num_ranks != topology_ranks:
        pytest.skip(
            f"{topology_ranks // ranks_per_node}x{ranks_per_node} virtual nodes need {topology_ranks} ranks; "
            f"this run launches {num_ranks} (EP_TEST_RANKS)"
        )


# ------------------------------------------------------------------------------------ buffers


def _label(num_ranks: int, ranks_per_node: int, transport: str | None) -> str:
    return f"{num_ranks // ranks_per_node}x{ranks_per_node} nodes, transport {transport or 'default'}"


def _hybrid_buffer(group, ranks_per_node: int, transport: str | None, **kwargs):
    """A hybrid buffer over virtual nodes of ``ranks_per_node`` ranks. ``transport`` is forced through
    EP_SCALEOUT_TRANSPORT (read at construction, restored after); None leaves the variable unset,
    so the buffer picks its default. Checks the mode and the transport the buffer reports."""
    previous = os.environ.pop(TRANSPORT_ENV, None)
    if transport is not None:
        os.environ[TRANSPORT_ENV] = transport
    try:
        buffer = make_buffer(group, num_ranks_per_node=ranks_per_node, allow_hybrid_mode=True, **kwargs)
    finally:
        os.environ.pop(TRANSPORT_ENV, None)
        if previous is not None:
            os.environ[TRANSPORT_ENV] = previous
    try:
        _check_hybrid(buffer, ranks_per_node, transport)
    except BaseException:
        buffer.destroy()
        raise
    return buffer


def _check_hybrid(buffer, ranks_per_node: int, transport: str | None) -> None:
    where = f"rank {buffer.rank_idx}, {_label(buffer.num_ranks, ranks_per_node, transport)}"
    mode = getattr(buffer, "ht_mode", "<missing>")
    assert mode == "hybrid", f"{where}: ht_mode {mode!r}, expected 'hybrid' (allow_hybrid_mode=True)"
    chosen = getattr(buffer, "scaleout_transport", "<missing>")
    if transport is None:
        assert chosen in TRANSPORTS, f"{where}: scaleout_transport {chosen!r}, expected one of {TRANSPORTS}"
    else:
        assert chosen == transport, f"{where}: scaleout_transport {chosen!r}, expected {transport!r} ({TRANSPORT_ENV})"


class _Late:
    """The buffer, but this rank sleeps before its dispatch and/or combine calls: its peers are already
    waiting for it in their kernels (within the timeout) and must deliver the same bits."""

    def __init__(self, buffer, dispatch_delay: float, combine_delay: float) -> None:
        self.buffer = buffer
        self.dispatch_delay = dispatch_delay
        self.combine_delay = combine_delay

    def dispatch(self, *args, **kwargs):
        time.sleep(self.dispatch_delay)
        return self.buffer.dispatch(*args, **kwargs)

    def combine(self, *args, **kwargs):
        time.sleep(self.combine_delay)
        return self.buffer.combine(*args, **kwargs)


# ----------------------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class HybridCase(Case):
    # Node-limited routing (DeepSeek-V3 gate, deep_ep.plan.node_limited_topk): every token's experts
    # lie on at most max(1, nodes // 2) nodes, instead of uniform random experts.
    node_limited: bool = False


CASES = [
    HybridCase("bf16 H2048 K8 E64", 2048, 8, 64, 256, False, seed=101),
    HybridCase(
        "fp8 H1024 K6 E64 expand a128 hot 1 bias",
        1024,
        6,
        64,
        256,
        True,
        do_expand=True,
        expert_alignment=128,
        num_biases=1,
        hot_expert=3,
        seed=102,
    ),
    HybridCase(
        "bf16 H512 K1 E=R expand identity 2 biases",
        512,
        1,
        -1,
        200,
        False,
        do_expand=True,
        num_biases=2,
        scale_outputs=False,
        seed=103,
    ),
    HybridCase(
        "fp8 H2048 K8 E=R a32 no weights", 2048, 8, -1, 160, True, expert_alignment=32, with_weights=False, seed=104
    ),
    HybridCase(
        "bf16 H1024 K4 E32 expand a16 hot last expert 2 biases",
        1024,
        4,
        32,
        256,
        False,
        do_expand=True,
        expert_alignment=16,
        num_biases=2,
        hot_expert=31,
        seed=105,
    ),
    HybridCase(
        "bf16 H2048 K8 E64 node-limited 1 bias", 2048, 8, 64, 256, False, num_biases=1, node_limited=True, seed=106
    ),
    HybridCase(
        "fp8 H1024 K6 E64 expand a64 node-limited identity",
        1024,
        6,
        64,
        192,
        True,
        do_expand=True,
        expert_alignment=64,
        scale_outputs=False,
        node_limited=True,
        seed=107,
    ),
    HybridCase(
        "DeepSeek-like fp8 H7168 K8 E256 T128 node-limited 1 bias",
        7168,
        8,
        256,
        128,
        True,
        num_biases=1,
        node_limited=True,
        seed=108,
    ),
]
LATE_CASE = HybridCase(
    "late ranks bf16 H2048 K8 E64 expand a8 1 bias",
    2048,
    8,
    64,
    128,
    False,
    do_expand=True,
    expert_alignment=8,
    num_biases=1,
    seed=109,
)


def _case_inputs(case: HybridCase, num_ranks: int, ranks_per_node: int) -> GroupOnDevice:
    """The case's seeded group inputs; node-limited cases replace the routing (same T, x, weights),
    keeping about 10 % of -1 entries and one all -1 token per rank."""
    inputs = group_inputs(case, num_ranks)
    if not case.node_limited:
        return inputs
    num_nodes = num_ranks // ranks_per_node
    max_nodes = max(1, num_nodes // 2)
    num_experts, num_topk = case.experts(num_ranks), case.topk(num_ranks)
    generator = torch.Generator().manual_seed(30_000 + case.seed)
    topk_idxs = []
    for count in inputs.num_tokens:
        if count == 0:
            topk_idxs.append(torch.empty(0, num_topk, dtype=torch.int64, device=device()))
            continue
        scores = torch.rand(count, num_experts, generator=generator)
        topk_idx = node_limited_topk(scores, num_nodes, num_topk, max_nodes)
        # The gate returns ids by descending score; shuffle so every slot sees every node.
        topk_idx = topk_idx.gather(1, torch.rand(count, num_topk, generator=generator).argsort(dim=1))
        topk_idx[torch.rand(count, num_topk, generator=generator) < 0.1] = -1
        topk_idx[int(torch.randint(count, (1,), generator=generator))] = -1
        topk_idxs.append(topk_idx.to(device()))
    return dataclasses.replace(inputs, topk_idxs=topk_idxs)


def _as_int(name: str, value) -> int:
    tensor = torch.as_tensor(value)
    assert not tensor.is_floating_point() and not tensor.is_complex(), f"{name} must be an integer, got {tensor.dtype}"
    return int(tensor.sum().item())


def _expected_scaleout_copies(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int, rank: int):
    """Σ over this rank's tokens of the other nodes holding one of its experts: the planner's mean
    ``per_node`` times T, which is a sum of integers over T (exact after rounding)."""
    num_tokens = topk_idx.shape[0]
    if num_tokens == 0:  # the planner needs a row
        return 0
    per_node = cross_node_copies(
        topk_idx.cpu(), num_experts, num_ranks, ranks_per_node, src_node=rank // ranks_per_node
    )
    total = per_node["per_node"] * num_tokens
    assert abs(total - round(total)) < 1e-6, f"cross_node_copies per_node x T = {total!r} is not an integer"
    return int(round(total))


def _scaleout_stats_check(case: HybridCase, rank: int, num_ranks: int, ranks_per_node: int):
    """check_handle for run_case: scaleout_copies exact against the planner, scaleout_bytes at least
    the token payload of those copies (whatever else it counts); either key missing fails."""

    def check(inputs: GroupOnDevice, handle) -> None:
        stats = handle.stats
        assert "scaleout_copies" in stats, f"handle.stats has no 'scaleout_copies' (keys {sorted(stats)})"
        assert "scaleout_bytes" in stats, f"handle.stats has no 'scaleout_bytes' (keys {sorted(stats)})"
        copies = _as_int("scaleout_copies", stats["scaleout_copies"])
        num_experts = case.experts(num_ranks)
        expected = _expected_scaleout_copies(inputs.topk_idxs[rank], num_experts, num_ranks, ranks_per_node, rank)
        assert copies == expected, (
            f"scaleout_copies {copies}, expected {expected} (cross_node_copies per_node x T, "
            f"T={inputs.num_tokens[rank]}, node {rank // ranks_per_node})"
        )
        num_bytes = _as_int("scaleout_bytes", stats["scaleout_bytes"])
        # Each copy carries at least the token: H bf16, or H fp8 bytes plus H / 128 fp32 scales.
        payload = case.hidden + case.hidden // 128 * 4 if case.use_fp8 else case.hidden * 2
        assert num_bytes >= copies * payload, (
            f"scaleout_bytes {num_bytes} < {copies} copies x {payload} B of token payload"
        )

    return check


def _run_hybrid_case(buffer, rank, num_ranks, ranks_per_node, transport, case, calls=None):
    """run_case in hybrid order plus the scale-out stats; failures name the topology and transport."""
    try:
        run_case(
            buffer if calls is None else calls,
            rank,
            num_ranks,
            case,
            inputs=_case_inputs(case, num_ranks, ranks_per_node),
            num_ranks_per_node=ranks_per_node,
            check_handle=_scaleout_stats_check(case, rank, num_ranks, ranks_per_node),
        )
    except AssertionError as error:
        raise AssertionError(f"{_label(num_ranks, ranks_per_node, transport)}: {error}") from error


# ------------------------------------------------------------------------ hybrid versus direct

VERSUS_CASES = [
    HybridCase("versus fp8 H2048 K8 E64 hot", 2048, 8, 64, 128, True, hot_expert=5, seed=111),
    HybridCase(
        "versus bf16 H1024 K6 E64 expand a32 2 biases",
        1024,
        6,
        64,
        128,
        False,
        do_expand=True,
        expert_alignment=32,
        num_biases=2,
        seed=112,
    ),
]


def _assert_same_dispatch(name: str, got: tuple, want: tuple) -> None:
    """Hybrid and direct dispatch results (outputs and handle counts) bitwise equal."""
    for part, actual, expected in (
        ("recv_x", split(got[0])[0], split(want[0])[0]),
        ("recv_x scales", split(got[0])[1], split(want[0])[1]),
        ("recv_topk_idx", got[1], want[1]),
        ("recv_topk_weights", got[2], want[2]),
        (
            "psum per source rank",
            got[3].psum_num_recv_tokens_per_source,
            want[3].psum_num_recv_tokens_per_source,
        ),
        ("psum per expert", got[3].psum_num_recv_tokens_per_expert, want[3].psum_num_recv_tokens_per_expert),
        ("tokens per local expert", got[3].stats["tokens_per_local_expert"], want[3].stats["tokens_per_local_expert"]),
    ):
        assert_bitwise_equal(f"{name}: {part}", actual, expected)
    assert got[3].num_recv_tokens_per_expert_list == want[3].num_recv_tokens_per_expert_list, (
        f"{name}: aligned counts {got[3].num_recv_tokens_per_expert_list}, "
        f"direct {want[3].num_recv_tokens_per_expert_list}"
    )


def _hybrid_versus_direct(rank, num_ranks, group, ranks_per_node):
    """allow_hybrid_mode=False with the same S: a direct buffer; the hybrid buffer (default transport)
    dispatches the same bits; each combines in its own order."""
    sizes = {"num_max_tokens_per_rank": 128, "hidden": 2048, "num_topk": 8}
    label = f"rank {rank}, {_label(num_ranks, ranks_per_node, None)}"
    direct = make_buffer(group, num_ranks_per_node=ranks_per_node, allow_hybrid_mode=False, **sizes)
    hybrid = None
    try:
        mode = getattr(direct, "ht_mode", "<missing>")
        assert mode == "direct", f"{label}: allow_hybrid_mode=False gave ht_mode {mode!r}, expected 'direct'"
        hybrid = _hybrid_buffer(group, ranks_per_node, None, **sizes)
        for case in VERSUS_CASES:
            inputs = group_inputs(case, num_ranks)
            results = [dispatch_case(buffer, rank, case, inputs) for buffer in (direct, hybrid)]
            _assert_same_dispatch(f"{label}, case '{case.name}', hybrid vs direct dispatch", results[1], results[0])
            # Each buffer against the reference: direct order for the direct buffer, hybrid for the other.
            run_case(direct, rank, num_ranks, case)
            run_case(hybrid, rank, num_ranks, case, num_ranks_per_node=ranks_per_node)
        for buffer in (direct, hybrid):
            buffer._check_device_errors()
            assert buffer._debug_count_dirty_workspace_bytes() == 0, f"{label}: workspace not back to zero"
    except AssertionError as error:
        raise AssertionError(f"{_label(num_ranks, ranks_per_node, None)}: {error}") from error
    finally:
        if hybrid is not None:
            hybrid.destroy()
        direct.destroy()


# ------------------------------------------------------------------------------------- modes

NON_EXPAND = HybridCase("modes fp8 H2048 K8 E64", 2048, 8, 64, 256, True, seed=121)
EXPAND = HybridCase(
    "modes bf16 H2048 K6 E64 expand a64", 2048, 6, 64, 192, False, do_expand=True, expert_alignment=64, seed=122
)
GRAPH_CASE = HybridCase("graph bf16 H2048 K8 E64", 2048, 8, 64, 128, False, seed=131)
NUM_REPLAYS = 10


def _reference_combine(case, rank, num_ranks, ranks_per_node, inputs, scale):
    """(reference dispatch of the group, expected combine of this rank in hybrid order)."""
    num_experts = case.experts(num_ranks)
    reference = ht_dispatch(
        inputs.xs,
        inputs.topk_idxs,
        inputs.weights,
        num_experts,
        expert_alignment=case.expert_alignment,
        do_expand=case.do_expand,
    )
    ys = [
        expert_output((r["x"], r["x_scales"]) if r["x_scales"] is not None else r["x"], dest, scale)
        for dest, r in enumerate(reference)
    ]
    expected = ht_combine(
        reference,
        ys,
        inputs.topk_idxs,
        num_experts,
        weights_list=None if inputs.weights is None else [r["topk_weights"] for r in reference],
        do_expand=case.do_expand,
        num_ranks_per_node=ranks_per_node,
    )[rank]
    return reference, expected


def _cached_no_sync_and_events(buffer, rank, num_ranks, ranks_per_node):
    for case in (NON_EXPAND, EXPAND):
        inputs = group_inputs(case, num_ranks)
        reference, expected = _reference_combine(case, rank, num_ranks, ranks_per_node, inputs, True)
        synced = dispatch_case(buffer, rank, case, inputs)
        check_dispatch(case, rank, reference[rank], synced, inputs, ranks_per_node)
        handle = synced[3]
        rows = handle.num_expanded_tokens if case.do_expand else handle.num_recv_tokens
        y = expert_output(synced[0], rank, True)
        want = buffer.combine(y, handle, topk_weights=synced[2])
        assert_bitwise_equal(f"{case.name} combine vs reference", want[0], expected["x"])
        assert_bitwise_equal(f"{case.name} combined weights vs reference", want[1], expected["topk_weights"])

        cached = dispatch_case(buffer, rank, case, inputs, handle=handle)
        assert_outputs_equal(f"{case.name} cached", cached, synced)
        assert cached[3] is handle, f"{case.name}: a cached dispatch returns the handle it was given"
        check_src_metadata(case, rank, inputs, handle, ranks_per_node)  # cached dispatch leaves it right

        unsynced = dispatch_case(buffer, rank, case, inputs, do_cpu_sync=False)
        loose = unsynced[3]
        assert loose.num_recv_tokens == num_ranks * case.num_max_tokens, (
            f"{case.name}: no-sync num_recv_tokens {loose.num_recv_tokens}, expected the worst case "
            f"{num_ranks * case.num_max_tokens}"
        )
        assert loose.num_recv_tokens_per_expert_list == [], f"{case.name}: no-sync aligned counts must be empty"
        assert int(loose.psum_num_recv_tokens_per_scaleup_rank[-1]) == handle.num_recv_tokens, (
            f"{case.name}: no-sync psum ends at {int(loose.psum_num_recv_tokens_per_scaleup_rank[-1])}, "
            f"expected {handle.num_recv_tokens}"
        )
        for field in (
            "psum_num_recv_tokens_per_scaleup_rank",
            "psum_num_recv_tokens_per_expert",
            "num_unaligned_recv_tokens_per_expert",
        ):
            assert_bitwise_equal(f"{case.name} no-sync {field}", getattr(loose, field), getattr(handle, field))
        assert_outputs_equal(f"{case.name} no cpu sync", unsynced, synced, rows)
        check_src_metadata(case, rank, inputs, loose, ranks_per_node)
        cached_loose = dispatch_case(buffer, rank, case, inputs, handle=loose)
        assert_outputs_equal(f"{case.name} cached from no-sync handle", cached_loose, synced, rows)

        # Combine through the no-sync handle: the worst-case input carries the same valid rows.
        y_loose = torch.zeros(
            loose.num_expanded_tokens if case.do_expand else loose.num_recv_tokens,
            y.shape[1],
            dtype=y.dtype,
            device=y.device,
        )
        y_loose[:rows] = y
        weights_loose = None
        if synced[2] is not None:
            weights_loose = torch.zeros((y_loose.shape[0], *synced[2].shape[1:]), dtype=torch.float32, device=y.device)
            weights_loose[:rows] = synced[2]
        got = buffer.combine(y_loose, loose, topk_weights=weights_loose)
        assert_bitwise_equal(f"{case.name} combine no-sync handle", got[0], want[0])
        assert_bitwise_equal(f"{case.name} combine no-sync weights", got[1], want[1])

        # Streams and events: every combination returns the same bits.
        for flags, wait_for_previous in (
            ({"async_with_compute_stream": True}, False),
            ({"allocate_on_comm_stream": True}, True),
            ({"allocate_on_comm_stream": True, "async_with_compute_stream": True}, True),
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


def _cuda_graph(buffer, rank, num_ranks, ranks_per_node):
    """Capture cached dispatch + identity experts + combine, replay with new token data (same
    routing and weights), compare every replay with the reference in hybrid order."""
    case = GRAPH_CASE
    inputs = group_inputs(case, num_ranks)
    handle = dispatch_case(buffer, rank, case, inputs)[3]
    x_static = inputs.xs[rank].clone()
    weights_static = inputs.weights[rank].clone()
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
    for replay in range(NUM_REPLAYS):
        generator = torch.Generator().manual_seed(1_000 + replay)
        xs = [make_tokens(count, case.hidden, generator).to(device()) for count in inputs.num_tokens]
        x_static.copy_(xs[rank])
        graph.replay()
        replay_inputs = dataclasses.replace(inputs, xs=xs)
        reference, expected = _reference_combine(case, rank, num_ranks, ranks_per_node, replay_inputs, False)
        assert_bitwise_equal(f"graph replay {replay} recv_x", recv_x, reference[rank]["x"])
        assert_bitwise_equal(f"graph replay {replay} combined_x", combined, expected["x"])
        assert_bitwise_equal(f"graph replay {replay} combined weights", combined_weights, expected["topk_weights"])
    torch.cuda.synchronize()
    del graph


def _reference_cases(rank, num_ranks, group, ranks_per_node, transport):
    """The reference cases and a late rank on one hybrid buffer of ``transport``."""
    buffer = _hybrid_buffer(
        group, ranks_per_node, transport, num_max_tokens_per_rank=MAX_TOKENS, hidden=MAX_HIDDEN, num_topk=MAX_TOPK
    )
    try:
        for case in CASES:
            _run_hybrid_case(buffer, rank, num_ranks, ranks_per_node, transport, case)
        # A late rank on the last node before its dispatch and one on node 0 before its combine.
        late = _Late(buffer, DELAY_SECS if rank == num_ranks - 1 else 0.0, DELAY_SECS if rank == 0 else 0.0)
        _run_hybrid_case(buffer, rank, num_ranks, ranks_per_node, transport, LATE_CASE, calls=late)
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, f"rank {rank}: workspace not back to zero"
    finally:
        buffer.destroy()


def _modes(rank, num_ranks, group, ranks_per_node, transport):
    """Cached, no CPU sync, events and a CUDA graph on one hybrid buffer of ``transport``."""
    buffer = _hybrid_buffer(group, ranks_per_node, transport, num_max_tokens_per_rank=256, hidden=2048)
    try:
        _cached_no_sync_and_events(buffer, rank, num_ranks, ranks_per_node)
        _cuda_graph(buffer, rank, num_ranks, ranks_per_node)
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    except AssertionError as error:
        where = f"rank {rank} of {num_ranks}, {_label(num_ranks, ranks_per_node, transport)}"
        raise AssertionError(f"{where}: {error}") from error
    finally:
        buffer.destroy()


def _suite(rank, num_ranks, group, ranks_per_node):
    _hybrid_versus_direct(rank, num_ranks, group, ranks_per_node)
    for transport in TRANSPORTS:
        _reference_cases(rank, num_ranks, group, ranks_per_node, transport)
        _modes(rank, num_ranks, group, ranks_per_node, transport)


@pytest.mark.parametrize("topology_ranks, ranks_per_node", TOPOLOGIES)
def test_hybrid_matches_reference_in_every_mode_for_each_transport(num_ranks, topology_ranks, ranks_per_node):
    """Per transport: the reference cases (dispatch as direct, combine in hybrid order, scale-out
    copies), a late rank, cached / no-sync / event variants and a CUDA graph; and the direct buffer
    that allow_hybrid_mode=False gives for the same S."""
    _require(num_ranks, topology_ranks, ranks_per_node)
    launch(_suite, num_ranks, ranks_per_node)


# ------------------------------------------------------------------------------- missing peer

TIMEOUT = 3.0
SLACK = 2.0  # what a failure may take beyond the GPU timeout
TIMEOUT_TOKENS = 64
TIMEOUT_HIDDEN = 512
TIMEOUT_TOPK = 4


def _timeout_buffer(group, ranks_per_node, transport):
    return _hybrid_buffer(
        group,
        ranks_per_node,
        transport,
        num_max_tokens_per_rank=TIMEOUT_TOKENS,
        hidden=TIMEOUT_HIDDEN,
        num_topk=TIMEOUT_TOPK,
        num_gpu_timeout_secs=TIMEOUT,
        num_cpu_timeout_secs=TIMEOUT + 10,
    )


def _small_inputs(rank, num_experts, seed):
    generator = torch.Generator().manual_seed(1000 * seed + 77 + rank)
    topk_idx = make_routing(TIMEOUT_TOKENS, num_experts, TIMEOUT_TOPK, generator=generator).to(device())
    weights = make_weights(topk_idx, generator).to(device())
    x = make_tokens(TIMEOUT_TOKENS, TIMEOUT_HIDDEN, generator).to(device())
    return x, topk_idx, weights


def _outcome(call):
    """(exception type name or None, message, seconds, peer, phase)."""
    start = time.monotonic()
    try:
        call()
        torch.cuda.synchronize()
        return None, "", time.monotonic() - start, None, None
    except Exception as error:  # noqa: BLE001 - the test asserts on the type
        peer, phase = getattr(error, "peer", None), getattr(error, "phase", None)
        return type(error).__name__, str(error), time.monotonic() - start, peer, phase


def _skip_one_operation(rank, num_ranks, group, ranks_per_node, transport, operation, seed):
    """Every rank dispatches once; then the missing rank skips ``operation`` (an uncached, CPU-synced
    dispatch, or the combine of that dispatch) while its peers call it. Returns the peers' outcome
    of the call and of destroy() (None on the missing rank)."""
    num_experts = 8 * num_ranks
    buffer = _timeout_buffer(group, ranks_per_node, transport)
    x, topk_idx, weights = _small_inputs(rank, num_experts, seed)
    recv_x, _, recv_weights, handle, _ = buffer.dispatch(x, topk_idx, weights, num_experts=num_experts)
    torch.cuda.synchronize()
    dist.barrier(group=group)
    if rank == num_ranks - 1:
        time.sleep(TIMEOUT + 1)  # its peers time out meanwhile
        del buffer, recv_x, recv_weights, handle  # no closing barrier: its peers' buffers failed
        gc.collect()
        return None

    def call():
        if operation == "dispatch":
            buffer.dispatch(x, topk_idx, weights, num_experts=num_experts)
        else:
            buffer.combine(recv_x, handle, topk_weights=recv_weights)
        buffer.check_errors()

    result = _outcome(call)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        destroyed = _outcome(buffer.destroy)
    return result, destroyed


def _after_the_timeouts(rank, num_ranks, group, ranks_per_node, transport):
    """A new hybrid buffer among all ranks works, bitwise."""
    buffer = _timeout_buffer(group, ranks_per_node, transport)
    try:
        case = HybridCase(
            "after the timeouts bf16 H512 K4",
            TIMEOUT_HIDDEN,
            TIMEOUT_TOPK,
            8 * num_ranks,
            TIMEOUT_TOKENS,
            False,
            seed=141,
        )
        _run_hybrid_case(buffer, rank, num_ranks, ranks_per_node, transport, case)
    finally:
        buffer.destroy()


def _missing_peer(rank, num_ranks, group, ranks_per_node):
    results = {}
    done = []  # steps completed, named in a failure: a broken context shows only at a later call
    for transport in TRANSPORTS:
        steps = [(f"{operation} skip", operation, seed) for seed, operation in enumerate(("dispatch", "combine"))]
        for name, operation, seed in [*steps, ("new buffer after the timeouts", None, None)]:
            step = f"{_label(num_ranks, ranks_per_node, transport)}: {name}"
            try:
                if operation is None:
                    _after_the_timeouts(rank, num_ranks, group, ranks_per_node, transport)
                else:
                    results[transport, operation] = _skip_one_operation(
                        rank, num_ranks, group, ranks_per_node, transport, operation, seed
                    )
            except Exception as error:
                raise RuntimeError(f"rank {rank}: {step} failed (steps done: {done}): {error}") from error
            done.append(step)
    return results


def test_a_missing_rank_is_named_by_every_peer_within_the_timeout_for_each_transport(num_ranks):
    if num_ranks < 4 or num_ranks % 2:
        pytest.skip(f"needs 2 virtual nodes of at least 2 ranks (an even count >= 4); this run launches {num_ranks}")
    ranks_per_node = num_ranks // 2  # 2 nodes: the missing rank is on node 1, half of its peers on node 0
    results = launch(_missing_peer, num_ranks, ranks_per_node)
    missing = num_ranks - 1
    for transport in TRANSPORTS:
        label = _label(num_ranks, ranks_per_node, transport)
        for operation in ("dispatch", "combine"):
            named = []
            for rank, result in enumerate(results[:missing]):
                (kind, message, seconds, peer, phase), destroyed = result[transport, operation]
                where = f"{label}, rank {rank} (rank {missing} skipped the {operation})"
                assert kind == deep_ep.CommTimeoutError.__name__, f"{where}: got {kind}: {message!r}"
                assert seconds < TIMEOUT + SLACK, (
                    f"{where}: raised after {seconds:.2f} s (timeout {TIMEOUT} s + {SLACK} s)"
                )
                assert peer is not None and 0 <= peer < num_ranks and peer != rank, f"{where}: peer {peer}: {message!r}"
                assert f"rank {peer}" in message, f"{where}: the message does not name peer {peer}: {message!r}"
                assert phase != "grid synchronisation", f"{where}: phase {phase!r}: {message!r}"
                named.append(peer)
                kind, message, seconds, _, _ = destroyed
                assert kind is None and seconds < SLACK, (
                    f"{where}: destroy gave {kind} {message!r} after {seconds:.2f} s"
                )
            assert missing in named, f"{label}: no peer named the missing rank {missing} in the {operation}: {named}"
