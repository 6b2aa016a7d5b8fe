"""DeepEP V1 client sequences through ``deep_ep.compat.buffer.Buffer``, checked bitwise against the
reference model.

Each case replays what a V1 client does in an MoE layer: ``get_dispatch_layout`` (checked against
loops on the CPU) -> ``dispatch`` with the layout (bf16, or fp8 with column-major scales as DeepEP's
tests build them; ``expert_alignment``; with and without ``num_worst_tokens``) -> expert work ->
``combine`` with biases -> cached ``dispatch(handle=)``; synchronously, with ``async_finish``, and
as an ``async_finish`` + ``previous_event`` chain. V1's meanings are mapped onto the reference
outputs: ``recv_topk_weights`` is 0 where ``recv_topk_idx`` is -1, worst-token rows past the
received ones have ``recv_topk_idx = -1``, ``handle[3]`` is the source token of each row,
``recv_rank_prefix_sum`` / ``gather_rank_prefix_matrix`` V1's rank prefix matrix. Then the loud
failures: refused arguments, a token count past the byte budget (on every rank, and on one rank
while its peers see PeerInputError), and hybrid mode (V1's internode handle layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from ht_checks import (
    assert_bitwise_equal,
    device,
    emulated_ranks_per_node,
    expert_output,
    keep_compute_stream_busy,
    split,
)

from deep_ep.compat.buffer import Buffer
from deep_ep.compat.capacity import bytes_for_tokens
from deep_ep.compat.handles import DispatchHandle
from deep_ep.errors import BufferTooSmallError, PeerInputError
from deep_ep.testing import launch
from deep_ep.testing.data import make_group_inputs, make_tokens
from deep_ep.testing.reference import ht_combine, ht_dispatch
from deep_ep.testing.reference_layout import dispatch_layout_by_loops


@dataclass(frozen=True)
class V1Case:
    name: str
    hidden: int
    num_topk: int
    num_experts: int  # -1: one expert per rank
    num_tokens: int  # the largest rank's T (uneven per rank, one rank at 0)
    use_fp8: bool
    expert_alignment: int = 1
    worst: bool = False  # num_worst_tokens = every token of the group (V1's tests: T * R)
    num_biases: int = 0
    with_weights: bool = True
    # "sync", "async" (async_finish), "chain" (async_finish + previous_event, outputs allocated on the
    # comm stream as V1 clients ask) or "chain-default" (the same with allocate_on_comm_stream=False)
    mode: str = "sync"
    use_config: bool = False
    seed: int = 0

    def experts(self, num_ranks: int) -> int:
        return num_ranks if self.num_experts < 0 else self.num_experts

    def topk(self, num_ranks: int) -> int:
        return min(self.num_topk, self.experts(num_ranks))


CASES = [
    V1Case("bf16 H4096 K8 E64 bias", 4096, 8, 64, 512, False, num_biases=1, seed=101),
    V1Case(
        "fp8 col-major H2048 K6 E256 a128 async", 2048, 6, 256, 300, True, expert_alignment=128, mode="async", seed=102
    ),
    V1Case(
        "bf16 H2048 K8 E64 worst chain 2 biases",
        2048,
        8,
        64,
        256,
        False,
        worst=True,
        num_biases=2,
        mode="chain",
        seed=103,
    ),
    V1Case(
        "fp8 col-major H4096 K8 E64 worst a16 async no weights",
        4096,
        8,
        64,
        200,
        True,
        expert_alignment=16,
        worst=True,
        with_weights=False,
        mode="async",
        seed=104,
    ),
    V1Case("bf16 H7168 K1 E=R config", 7168, 1, -1, 128, False, use_config=True, seed=105),
    V1Case("fp8 col-major H2048 K8 E64 chain bias", 2048, 8, 64, 384, True, num_biases=1, mode="chain", seed=106),
    V1Case("bf16 H1024 K4 E32 chain-default", 1024, 4, 32, 200, False, mode="chain-default", seed=107),
]

HYBRID_CASES = [
    V1Case("hybrid bf16 H2048 K8 E64 bias", 2048, 8, 64, 256, False, num_biases=1, seed=111),
    V1Case("hybrid fp8 col-major H2048 K6 E64 worst async", 2048, 6, 64, 200, True, worst=True, mode="async", seed=112),
]


def _num_nvl_bytes(cases: list[V1Case], num_ranks: int, num_scaleup_ranks: int) -> int:
    """What a V1 client would size from hints: here the exact footprint of the largest case."""
    return max(
        bytes_for_tokens(num_ranks, num_scaleup_ranks, case.num_tokens, case.hidden, case.topk(num_ranks), case.use_fp8)
        for case in cases
    )


def _column_major(scales: torch.Tensor) -> torch.Tensor:
    """DeepEP's tests pass fp8 scales column-major: same values, strides (1, T)."""
    return scales.t().contiguous().t()


def _config(num_ranks: int, kind: str):
    """A V1 Config when deep_ep.compat.config provides one for this group size, else a stand-in with num_sms."""
    try:
        return getattr(Buffer, f"get_{kind}_config")(num_ranks)
    except (NotImplementedError, KeyError, AssertionError, ValueError):
        return SimpleNamespace(num_sms=24)


def _stream_kwargs(buffer: Buffer, mode: str, previous=None) -> dict:
    if mode == "sync":
        return {}
    if mode == "async":
        return {"async_finish": True}
    return {
        "previous_event": previous if previous is not None else buffer.capture(),
        "async_finish": True,
        "allocate_on_comm_stream": mode == "chain",
    }


def _wait(event, mode: str, what: str) -> None:
    if mode == "sync":
        assert event.event is None, f"{what}: a synchronous call returns EventOverlap(None)"
        return
    assert event.event is not None, f"{what}: async_finish returns an event"
    event.current_stream_wait()


def _run_case(buffer: Buffer, rank: int, num_ranks: int, case: V1Case, per_node: int | None = None) -> None:
    try:
        _check_case(buffer, rank, num_ranks, case, per_node)
    except AssertionError as error:
        raise AssertionError(f"case '{case.name}' (rank {rank} of {num_ranks}): {error}") from error


def _check_case(buffer: Buffer, rank: int, num_ranks: int, case: V1Case, per_node: int | None) -> None:
    num_experts, num_topk = case.experts(num_ranks), case.topk(num_ranks)
    data = make_group_inputs(
        num_ranks,
        case.num_tokens,
        case.hidden,
        num_experts,
        num_topk,
        seed=case.seed,
        use_fp8=case.use_fp8,
        with_weights=case.with_weights,
    )
    dev = device()
    xs = [(x[0].to(dev), x[1].to(dev)) if isinstance(x, tuple) else x.to(dev) for x in data.dispatch_xs]
    topk_idxs = [t.to(dev) for t in data.topk_idx]
    weights = None if data.topk_weights is None else [w.to(dev) for w in data.topk_weights]
    topk_idx = topk_idxs[rank]
    my_weights = None if weights is None else weights[rank]
    x_v1 = (xs[rank][0], _column_major(xs[rank][1])) if case.use_fp8 else xs[rank]
    if case.use_fp8 and x_v1[1].shape[0] > 1:  # with 0 or 1 rows column-major is also contiguous
        assert not x_v1[1].is_contiguous() and x_v1[1].stride() == (1, x_v1[1].shape[0])

    reference = ht_dispatch(xs, topk_idxs, weights, num_experts, expert_alignment=case.expert_alignment)
    expected = reference[rank]
    num_received = expected["x"].shape[0]
    num_worst = sum(data.num_tokens) if case.worst else 0
    rows = num_worst if case.worst else num_received

    # Layout, against loops on the CPU and against what every destination receives from this rank.
    ranks_per_node = per_node or num_ranks
    before = buffer.capture() if case.mode.startswith("chain") else None
    per_rank, per_rdma, per_expert, in_rank, layout_event = buffer.get_dispatch_layout(
        topk_idx, num_experts, **_stream_kwargs(buffer, case.mode, before)
    )
    if case.mode == "async":
        _wait(layout_event, case.mode, "get_dispatch_layout")
    want_rank, want_node, want_expert, want_in_rank = dispatch_layout_by_loops(
        data.topk_idx[rank], num_experts, num_ranks, ranks_per_node
    )

    # Dispatch with the layout, as V1 clients pass it.
    config = _config(num_ranks, "dispatch") if case.use_config else None
    dispatch_streams = _stream_kwargs(buffer, case.mode, layout_event if case.mode.startswith("chain") else None)
    outputs = buffer.dispatch(
        x_v1,
        num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        topk_idx=topk_idx,
        topk_weights=my_weights,
        expert_alignment=case.expert_alignment,
        num_worst_tokens=num_worst,
        config=config,
        **dispatch_streams,
    )
    if case.mode.startswith("chain"):
        keep_compute_stream_busy()
    recv_x, recv_topk_idx, recv_topk_weights, per_expert_list, handle, event = outputs
    _wait(event, case.mode, "dispatch")

    assert per_rank.tolist() == want_rank, f"num_tokens_per_rank {per_rank.tolist()} != {want_rank}"
    assert per_rank.tolist() == [r["num_recv_tokens_per_rank"][rank] for r in reference], "per rank vs reference"
    assert per_expert.tolist() == want_expert, "num_tokens_per_expert"
    assert torch.equal(in_rank.cpu(), want_in_rank), "is_token_in_rank"
    if per_node is None:
        assert per_rdma is None, "one node: num_tokens_per_rdma_rank is None"
    else:
        assert per_rdma.tolist() == want_node, f"num_tokens_per_rdma_rank {per_rdma.tolist()} != {want_node}"

    data_out, scales_out = split(recv_x)
    assert data_out.shape[0] == rows, f"recv_x has {data_out.shape[0]} rows, expected {rows}"
    assert_bitwise_equal("recv_x", data_out[:num_received], expected["x"])
    if case.use_fp8:
        assert scales_out.shape == (rows, case.hidden // 128) and scales_out.is_contiguous(), "row-major scales"
        assert_bitwise_equal("recv_x scales", scales_out[:num_received], expected["x_scales"])
    assert recv_topk_idx.shape == (rows, num_topk)
    assert_bitwise_equal("recv_topk_idx", recv_topk_idx[:num_received], expected["topk_idx"])
    assert bool((recv_topk_idx[num_received:] == -1).all()), "worst-token padding rows: recv_topk_idx -1"
    v1_weights = None
    if case.with_weights:
        v1_weights = expected["topk_weights"].masked_fill(expected["topk_idx"] < 0, 0.0)
        assert_bitwise_equal("recv_topk_weights (0 where -1)", recv_topk_weights[:num_received], v1_weights)
        assert bool((recv_topk_weights[num_received:] == 0).all()), "worst-token padding rows: weight 0"
    else:
        assert recv_topk_weights is None
    want_list = [] if case.worst else expected["num_recv_tokens_per_expert_aligned"]
    assert per_expert_list == want_list, f"num_recv_tokens_per_expert_list {per_expert_list} != {want_list}"

    # The handle: V1's entries where we have them exactly, a named IndexError elsewhere.
    assert isinstance(handle, DispatchHandle) and handle.num_recv_tokens == rows
    assert handle.internode == (per_node is not None)
    prefix = torch.tensor(expected["num_recv_tokens_per_rank"]).cumsum(0).tolist()
    assert handle.recv_rank_prefix_sum.tolist() == prefix, "recv_rank_prefix_sum"
    assert handle.num_recv_tokens_device.tolist() == [num_received]
    if per_node is None:
        assert len(handle) == 6
        assert handle[4] is in_rank, "handle[4] is the is_token_in_rank passed in"
        assert handle[3][:num_received].tolist() == expected["src_token"].tolist(), "handle[3] recv_src_idx"
        assert handle[0] is handle.rank_prefix_matrix, "handle[0]: the notify kernel's rank prefix matrix"
    else:
        assert len(handle) == 10
        assert handle[0] is in_rank and handle[6].tolist() == prefix, "internode handle[0] / handle[-4]"
    # V1's rank_prefix_matrix, exactly: [i, j] = tokens ranks 0..i sent to rank j (one collective).
    matrix = buffer.gather_rank_prefix_matrix(handle)
    sent = torch.tensor([r["num_recv_tokens_per_rank"] for r in reference]).t()  # [source, dest]
    assert matrix.tolist() == sent.cumsum(0).tolist(), "rank_prefix_matrix"
    assert matrix[:, rank].tolist() == prefix
    # DeepEP's own check: the rows of source i are the block [matrix[i - 1][rank], matrix[i][rank]).
    source_rank = handle.core.recv_src_info[:num_received, 0].cpu()
    start = 0
    for source in range(num_ranks):
        end = int(matrix[source, rank])
        assert bool((source_rank[start:end] == source).all()), f"rows [{start}, {end}) come from rank {source}"
        start = end

    # Expert work, then combine with biases; the reference combines what the reference received.
    ys = [
        expert_output((r["x"], r["x_scales"]) if r["x_scales"] is not None else r["x"], d, True)
        for d, r in enumerate(reference)
    ]
    weights_list = None
    if case.with_weights:
        weights_list = [r["topk_weights"].masked_fill(r["topk_idx"] < 0, 0.0) for r in reference]
    biases = _biases(case, data.num_tokens)
    order = {} if per_node is None else {"num_ranks_per_node": per_node}
    want = ht_combine(reference, ys, topk_idxs, num_experts, weights_list=weights_list, biases=biases, **order)[rank]
    y = expert_output(recv_x, rank, True)
    assert y.shape[0] == rows
    combine_config = _config(num_ranks, "combine") if case.use_config else None
    combined, combined_weights, event = buffer.combine(
        y,
        handle,
        topk_weights=recv_topk_weights,
        bias=None if biases is None else biases[rank],
        config=combine_config,
        **_stream_kwargs(buffer, case.mode),
    )
    _wait(event, case.mode, "combine")
    assert_bitwise_equal("combined_x", combined, want["x"])
    assert_bitwise_equal("combined_topk_weights", combined_weights, want["topk_weights"])

    # Cached dispatch with the handle: same rows, V1's None placeholders.
    cached = buffer.dispatch(x_v1, handle=handle, config=config, **_stream_kwargs(buffer, case.mode))
    cached_x, cached_idx, cached_weights, cached_list, cached_handle, event = cached
    _wait(event, case.mode, "cached dispatch")
    assert (cached_idx, cached_weights, cached_list, cached_handle) == (None, None, None, None)
    cached_data, cached_scales = split(cached_x)
    assert cached_data.shape[0] == rows, f"cached recv_x has {cached_data.shape[0]} rows, expected {rows}"
    assert_bitwise_equal("cached recv_x", cached_data[:num_received], expected["x"])
    if case.use_fp8:
        assert_bitwise_equal("cached recv_x scales", cached_scales[:num_received], expected["x_scales"])


def _biases(case: V1Case, num_tokens: list[int]):
    if case.num_biases == 0:
        return None
    generator = torch.Generator().manual_seed(20_000 + case.seed)
    biases = []
    for count in num_tokens:
        terms = [make_tokens(count, case.hidden, generator).to(device()) for _ in range(case.num_biases)]
        biases.append(terms[0] if case.num_biases == 1 else tuple(terms))
    return biases


# ---------------------------------------------------------------------------------- the suites


def _check_attributes(buffer: Buffer, group, rank: int, num_ranks: int, num_nvl_bytes: int) -> None:
    assert buffer.group is group and buffer.rank == rank and buffer.group_size == num_ranks
    assert buffer.num_nvl_bytes == num_nvl_bytes and buffer.num_rdma_bytes == 0
    assert buffer.low_latency_mode is False and buffer.explicitly_destroy is True
    assert Buffer.is_sm90_compiled() is True
    assert isinstance(buffer.get_comm_stream(), torch.cuda.Stream)
    assert buffer.capture().event is not None
    core = buffer._core
    view = buffer.get_local_buffer_tensor(torch.int32, (4, 4), offset=64)
    assert view.shape == (4, 4) and view.dtype == torch.int32
    assert view.data_ptr() == core.local_window_base() + core._window["ht_offset"] + 64
    assert buffer.get_local_buffer_tensor(torch.uint8).numel() == num_nvl_bytes
    assert buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).numel() == 0
    # Built without low_latency_mode: the LL calls refuse, as V1 asserts (nothing is communicated).
    x = torch.zeros(1, 128, dtype=torch.bfloat16, device=device())
    idx = torch.zeros(1, 1, dtype=torch.int64, device=device())
    with pytest.raises(RuntimeError, match="low_latency_mode=True"):
        buffer.low_latency_dispatch(x, idx, 1, num_ranks)
    with pytest.raises(RuntimeError, match="low_latency_mode=True"):
        buffer.clean_low_latency_buffer(1, 128, num_ranks)
    assert buffer.low_latency_sizing is None


def _refusals(buffer: Buffer, rank: int, num_ranks: int) -> None:
    """Refused calls on every rank: each rank takes part without data, so the buffer stays in step."""
    num_experts = 8 * num_ranks
    # Distinct experts per row (a repeated id is reported as a bad routing entry at the CPU sync).
    topk_idx = torch.rand(16, num_experts, device=device()).topk(4, dim=1).indices
    x = torch.randn(16, 1024, device=device()).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    layout = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}
    with pytest.raises(ValueError, match="topk_weights needs topk_idx"):
        buffer.dispatch(x, topk_weights=torch.ones(16, 4, device=device()), **layout)
    with pytest.raises(ValueError, match="num_tokens_per_expert must be given"):
        buffer.dispatch(x, topk_idx=topk_idx)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, **layout)
    with pytest.raises(ValueError, match="topk_idx and topk_weights must be None with handle="):
        buffer.dispatch(x, handle=handle, topk_idx=topk_idx)
    buffer._core.check_errors()  # every rank refused the same calls: nothing is left to report


def _byte_budget(group, rank: int, num_ranks: int) -> None:
    """A buffer sized for 64 tokens of H=2048, K=8: past the capacity BufferTooSmallError names the
    bytes; a worst-token count past R * capacity pads."""
    hidden, num_topk, num_experts = 2048, 8, 8 * num_ranks
    num_nvl_bytes = bytes_for_tokens(num_ranks, num_ranks, 64, hidden, num_topk, False)
    buffer = Buffer(group, num_nvl_bytes, 0, explicitly_destroy=True)
    try:
        capacity = buffer.token_capacity(hidden, num_topk, False)
        assert capacity >= 64
        generator = torch.Generator().manual_seed(300 + rank)

        def inputs(num_tokens: int):
            x = torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16).to(device())
            topk = torch.rand(num_tokens, num_experts, generator=generator).topk(num_topk, dim=1).indices.to(device())
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk, num_experts)
            layout = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}
            return x, topk, layout

        # Every rank past the capacity.
        x, topk, layout = inputs(capacity + 1)
        with pytest.raises(BufferTooSmallError) as info:
            buffer.dispatch(x, topk_idx=topk, **layout)
        needed = bytes_for_tokens(num_ranks, num_ranks, capacity + 1, hidden, num_topk, False)
        assert info.value.needed_bytes == needed and str(needed) in str(info.value)
        buffer._core.check_errors()

        # One rank past the capacity: it raises BufferTooSmallError, its peers PeerInputError.
        if num_ranks > 1:
            x, topk, layout = inputs(capacity + 1 if rank == 0 else 8)
            expected = BufferTooSmallError if rank == 0 else PeerInputError
            with pytest.raises(expected):
                buffer.dispatch(x, topk_idx=topk, **layout)
            buffer._core.check_errors()

        # num_worst_tokens beyond the core's R * capacity rows: padded outputs, combine and cached
        # dispatch over the same number of rows.
        num_worst = num_ranks * capacity + 7
        x, topk, layout = inputs(capacity)
        recv_x, recv_idx, _, per_expert_list, handle, _ = buffer.dispatch(
            x, topk_idx=topk, num_worst_tokens=num_worst, **layout
        )
        received = int(handle.num_recv_tokens_device.item())
        assert recv_x.shape == (num_worst, hidden) and per_expert_list == []
        assert bool((recv_idx[received:] == -1).all())
        combined, _, _ = buffer.combine(recv_x.clone(), handle)
        assert combined.shape == x.shape
        cached_x = buffer.dispatch(x, handle=handle)[0]
        assert cached_x.shape == (num_worst, hidden)
        assert torch.equal(cached_x[:received].view(torch.int16), recv_x[:received].view(torch.int16))
        buffer._core.check_errors()
    finally:
        buffer.destroy()


def _v1_sequences(rank: int, num_ranks: int, group) -> None:
    num_nvl_bytes = _num_nvl_bytes(CASES, num_ranks, num_ranks)
    buffer = Buffer(group, num_nvl_bytes, 0, False, explicitly_destroy=True)  # positional, as Megatron does
    try:
        _check_attributes(buffer, group, rank, num_ranks, num_nvl_bytes)
        for case in CASES:
            _run_case(buffer, rank, num_ranks, case)
        _refusals(buffer, rank, num_ranks)
        # Still in step after the refusals.
        _run_case(buffer, rank, num_ranks, CASES[0])
        buffer._core.check_errors()
        assert buffer._core._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    finally:
        buffer.destroy()
    _byte_budget(group, rank, num_ranks)


def test_v1_client_sequences_match_reference(num_ranks):
    launch(_v1_sequences, num_ranks)


def _v1_hybrid(rank: int, num_ranks: int, group, per_node: int) -> None:
    with emulated_ranks_per_node(per_node):
        buffer = Buffer(group, _num_nvl_bytes(HYBRID_CASES, num_ranks, per_node), explicitly_destroy=True)
    try:
        assert buffer._core.ht_mode == "hybrid", f"expected hybrid mode over {num_ranks // per_node} virtual nodes"
        for case in HYBRID_CASES:
            _run_case(buffer, rank, num_ranks, case, per_node=per_node)
        buffer._core.check_errors()
    finally:
        buffer.destroy()


def test_v1_client_sequences_in_hybrid_mode(num_ranks):
    if num_ranks < 4:
        pytest.skip("hybrid mode over virtual nodes needs at least 4 ranks (2 nodes of 2)")
    launch(_v1_hybrid, num_ranks, num_ranks // 2)
