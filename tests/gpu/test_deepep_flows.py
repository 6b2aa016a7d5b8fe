"""DeepEP's own test flows and its clients' first calls, through ``deep_ep.Buffer`` and
``deep_ep.ElasticBuffer``, as those programs make them (our own code; DeepEP's scripts are the
spec): SGLang's construction with ``allow_mnnvl=True``, Megatron's synchronous layout whose
``EventOverlap(None)`` is passed on as ``previous_event``, and DeepEP's intranode / internode test
flow that starts with a dispatch routed by ``is_token_in_rank`` alone (no ``topk_idx``), reads
``handle[0]`` (the rank prefix matrix) and the per-expert counts V1 derives from
``num_tokens_per_expert``, and combines the received rows back; then the same with ``topk_idx``
and weights: ``handle[0]`` from the dispatch itself, and V1's ``combined_topk_weights`` (each
receiving rank's whole weight row summed, after the test wrote into its ``-1`` slots as DeepEP's
does).

Rows are built so that every check is exact: row ``t`` of rank ``r`` holds ``r + 1`` in column 0,
``t`` in column 1 and ``1`` elsewhere, so a received row names its source, and the sum of the rows
of every receiving rank is the row times the number of ranks that received it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ht_checks import device, emulated_ranks_per_node

import deep_ep
from deep_ep.compat.buffer import Buffer
from deep_ep.compat.capacity import bytes_for_tokens
from deep_ep.event import EventOverlap
from deep_ep.testing import launch

HIDDEN = 256
TOPK = 4


def _num_tokens(rank: int) -> int:
    return 0 if rank == 1 else 96 + 17 * rank  # uneven, one rank without tokens


def _rows(rank: int, num_tokens: int) -> torch.Tensor:
    x = torch.ones(num_tokens, HIDDEN, dtype=torch.bfloat16, device=device())
    x[:, 0] = rank + 1
    x[:, 1] = torch.arange(num_tokens, device=device()).to(torch.bfloat16)  # < 256: exact in bf16
    return x


def _routing(rank: int, num_tokens: int, num_experts: int) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(4_000 + rank)
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk = scores.topk(TOPK, dim=1).indices
    topk[::7, -1] = -1  # some -1 entries
    return topk.to(device())


def _calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's calc_diff (1 - cosine similarity of x + 1 and y + 1, in fp64)."""
    x, y = x.double() + 1, y.double() + 1
    denominator = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denominator)


def _gather(group, tensor: torch.Tensor) -> list[torch.Tensor]:
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, tensor.cpu(), group=group)
    return parts


def _check_routing_by_ranks(buffer: Buffer, group, rank: int, num_ranks: int, num_experts: int, flow: str) -> None:
    num_tokens = _num_tokens(rank)
    x = _rows(rank, num_tokens)
    topk_idx = _routing(rank, num_tokens, num_experts)
    per_rank, _, per_expert, in_rank, layout_event = buffer.get_dispatch_layout(topk_idx, num_experts)
    assert layout_event.event is None  # synchronous: what Megatron passes on
    previous_event = layout_event if flow == "megatron" else (buffer.capture() if flow == "previous" else None)
    async_finish = flow == "async"
    recv_x, recv_idx, recv_weights, per_expert_list, handle, event = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        previous_event=previous_event,
        async_finish=async_finish,
    )
    if async_finish:
        event.current_stream_wait()
    assert recv_idx is None and recv_weights is None

    # Expected: every rank's rows marked for this rank, by (source rank, source token).
    all_in_rank = _gather(group, in_rank.to(torch.int32))
    all_per_expert = _gather(group, per_expert.view(1, -1))
    expected_rows = [torch.nonzero(all_in_rank[source][:, rank], as_tuple=True)[0] for source in range(num_ranks)]
    received = recv_x.float().cpu()
    assert received.shape == (sum(len(rows) for rows in expected_rows), HIDDEN)
    start = 0
    for source, rows in enumerate(expected_rows):
        block = received[start : start + len(rows)]
        assert torch.equal(block[:, 0], torch.full((len(rows),), float(source + 1))), f"rows from {source}"
        assert torch.equal(block[:, 1], rows.float()), f"token order of source {source}"
        start += len(rows)

    # V1's rank prefix matrix, [i][j] = tokens ranks 0..i sent to rank j: handle[0] of the intranode
    # tuple; the internode tuple's handle[-4] (recv_gbl_rank_prefix_sum) is its column for this rank.
    sent = torch.stack([part.sum(dim=0) for part in all_in_rank])
    matrix = handle.rank_prefix_matrix if handle.internode else handle[0]
    assert matrix.dtype == torch.int32 and matrix.shape == (num_ranks, num_ranks)
    assert torch.equal(matrix.cpu(), sent.cumsum(dim=0).to(torch.int32))
    assert torch.equal(buffer.gather_rank_prefix_matrix(handle).cpu(), matrix.cpu())
    column = handle[-4] if handle.internode else handle.recv_rank_prefix_sum
    assert torch.equal(column.cpu(), matrix[:, rank].cpu())

    # V1's per-expert counts: every rank's num_tokens_per_expert for this rank's experts.
    num_local = num_experts // num_ranks
    totals = torch.stack([part[0] for part in all_per_expert]).sum(dim=0)
    assert per_expert_list == totals[rank * num_local : (rank + 1) * num_local].tolist()

    # Combine sums the rows of every receiving rank: row t comes back times its rank count.
    combined, combined_weights, _ = buffer.combine(recv_x, handle, previous_event=EventOverlap(None))
    assert combined_weights is None
    expected = (x.float() * in_rank.sum(dim=1, keepdim=True).float()).to(torch.bfloat16)
    assert torch.equal(combined, expected)

    # A cached dispatch with that handle moves the same rows.
    cached = buffer.dispatch(x, handle=handle, previous_event=EventOverlap(None))[0]
    assert torch.equal(cached, recv_x)

    # num_worst_tokens without top-k: padded rows, no counts (V1's contract).
    worst_x, worst_idx, _, worst_list, _, _ = buffer.dispatch(
        x,
        num_tokens_per_rank=per_rank,
        is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        num_worst_tokens=num_ranks * 256,
    )
    assert worst_list == [] and worst_idx is None and worst_x.shape[0] == num_ranks * 256
    assert torch.equal(worst_x[: recv_x.shape[0]], recv_x)


def _rank_prefix_matrix(all_in_rank: list[torch.Tensor]) -> torch.Tensor:
    """V1's rank_prefix_matrix from every rank's is_token_in_rank: [i][j] = tokens ranks 0..i send to j."""
    sent = torch.stack([part.to(torch.int32).sum(dim=0) for part in all_in_rank])
    return sent.cumsum(dim=0).to(torch.int32)


def _v1_combined_weights(
    rank: int, num_tokens: int, all_weights: list[torch.Tensor], all_sources: list[torch.Tensor], per_node: int
) -> torch.Tensor:
    """V1's combined_topk_weights of this rank's tokens: for each token, slot by slot, the fp32 sum
    of the weight rows of every rank that received it (ranks ascending from +0.0; several nodes: per
    node first, then the node sums ascending, as V1's internode combine). ``all_sources[d]``: the
    (source rank, source token) of each row rank d received."""
    num_ranks = len(all_weights)
    total = torch.zeros(num_tokens, all_weights[0].shape[1], dtype=torch.float32)
    for node_first in range(0, num_ranks, per_node):
        node_sum = torch.zeros_like(total)
        for dest in range(node_first, node_first + per_node):
            mine = all_sources[dest][:, 0] == rank
            node_sum[all_sources[dest][mine, 1].long()] += all_weights[dest][mine]  # a token once per rank
        total += node_sum
    return total


def _check_routing_by_topk(
    buffer: Buffer, group, rank: int, num_ranks: int, num_experts: int, async_finish: bool, per_node: int
) -> None:
    """DeepEP's test_intranode flow with top-k: handle[0] read after the dispatch, the rows of
    source i in [M[i - 1][rank], M[i][rank]), and the combined weights of V1's rule."""
    num_tokens = _num_tokens(rank)
    x = _rows(rank, num_tokens)
    topk_idx = _routing(rank, num_tokens, num_experts)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    all_in_rank = _gather(group, in_rank)
    want_matrix = _rank_prefix_matrix(all_in_rank)
    receivers = in_rank.sum(dim=1, keepdim=True).float()  # ranks holding each token
    generator = torch.Generator(device="cpu").manual_seed(5_000 + rank)
    rand_weights = torch.randn(num_tokens, TOPK, generator=generator).to(device())
    rank_weights = torch.full((num_tokens, TOPK), float(rank + 1), device=device())
    for pure_rand, topk_weights in ((True, rand_weights), (False, rank_weights)):
        recv_x, recv_idx, recv_weights, _, handle, event = buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            async_finish=async_finish,
        )
        if async_finish:
            event.current_stream_wait()

        # handle[0] (intranode) is V1's matrix, the same on every rank; DeepEP's check_data.
        matrix = handle.rank_prefix_matrix if handle.internode else handle[0]
        if handle.internode:
            assert matrix is None or torch.equal(matrix.cpu(), want_matrix)
        else:
            assert matrix.dtype == torch.int32 and matrix.shape == (num_ranks, num_ranks)
            assert torch.equal(matrix.cpu(), want_matrix), f"rank_prefix_matrix {matrix.tolist()}"
            start = 0
            for source in range(num_ranks):
                end = int(matrix[source][rank])
                block = recv_x[start:end, 0].float()
                assert torch.equal(block, torch.full_like(block, float(source + 1))), f"rows from rank {source}"
                start = end
            assert start == recv_x.shape[0]
        column = handle[-4] if handle.internode else handle.recv_rank_prefix_sum
        assert torch.equal(column.cpu(), want_matrix[:, rank])

        # DeepEP writes each row's max into its -1 slots (not for random weights), then combines.
        if not pure_rand:
            empty = recv_idx.eq(-1)
            recv_weights[empty] = recv_weights.amax(dim=1, keepdim=True).expand_as(recv_weights)[empty]
        combined_x, combined_weights, event = buffer.combine(
            recv_x, handle, topk_weights=recv_weights, async_finish=async_finish
        )
        if async_finish:
            event.current_stream_wait()
        assert torch.equal(combined_x, (x.float() * receivers).to(torch.bfloat16))

        # Exactly V1's rule: the sum over the receiving ranks of the rows they passed.
        all_weights = _gather(group, recv_weights)
        all_sources = _gather(group, handle.core.recv_src_info[: recv_x.shape[0], :2])
        want = _v1_combined_weights(rank, num_tokens, all_weights, all_sources, per_node)
        assert torch.equal(combined_weights.cpu(), want), "combined_topk_weights (V1: sum over receiving ranks)"
        # DeepEP's own check (its routing has no -1 entries: compare the slots with an expert).
        routed = (topk_idx >= 0) & (receivers > 0)
        if not routed.any():
            continue  # a rank without tokens: DeepEP's calc_diff of nothing is NaN
        if pure_rand:
            got, ref = combined_weights[routed], topk_weights[routed]
        else:
            got, ref = (combined_weights / receivers)[routed], topk_weights[routed]
        assert _calc_diff(got, ref) < 1e-9


def _num_nvl_bytes(num_ranks: int, per_node: int) -> int:
    return bytes_for_tokens(num_ranks, per_node, 256, HIDDEN, max(num_ranks, TOPK), False)


def _client_flows(rank: int, num_ranks: int, group) -> None:
    num_experts = 8 * num_ranks
    # SGLang: every machine passes allow_mnnvl=True (and a queue-pair count).
    buffer = Buffer(
        group,
        _num_nvl_bytes(num_ranks, num_ranks),
        0,
        low_latency_mode=False,
        num_qps_per_rank=1,
        allow_mnnvl=True,
        use_fabric=True,
        explicitly_destroy=True,
    )
    try:
        for flow in ("plain", "megatron", "previous", "async"):
            _check_routing_by_ranks(buffer, group, rank, num_ranks, num_experts, flow)
        for async_finish in (False, True):
            _check_routing_by_topk(buffer, group, rank, num_ranks, num_experts, async_finish, num_ranks)
        buffer._core.check_errors()
        assert buffer._core._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    finally:
        buffer.destroy()

    # ElasticBuffer takes EventOverlap(None) as "no event" too.
    elastic = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=256, hidden=HIDDEN, num_topk=TOPK)
    try:
        num_tokens = _num_tokens(rank)
        x = _rows(rank, num_tokens)
        topk_idx = _routing(rank, num_tokens, num_experts)
        recv_x, _, _, handle, _ = elastic.dispatch(
            x, topk_idx, num_experts=num_experts, previous_event=EventOverlap(None)
        )
        plain_x = elastic.dispatch(x, topk_idx, num_experts=num_experts)[0]
        assert torch.equal(recv_x, plain_x)
        combined = elastic.combine(recv_x, handle, previous_event=EventOverlap(None))[0]
        assert torch.equal(combined, elastic.combine(recv_x, handle)[0])
        elastic.check_errors()
    finally:
        elastic.destroy()


def test_deepep_intranode_flow_and_client_first_calls(num_ranks):
    launch(_client_flows, num_ranks)


def _internode_flow(rank: int, num_ranks: int, group, per_node: int) -> None:
    with emulated_ranks_per_node(per_node):
        buffer = Buffer(group, _num_nvl_bytes(num_ranks, per_node), 0, allow_mnnvl=True, explicitly_destroy=True)
    try:
        assert buffer._core.ht_mode == "hybrid"
        for flow in ("plain", "async"):
            _check_routing_by_ranks(buffer, group, rank, num_ranks, 8 * num_ranks, flow)
        for async_finish in (False, True):
            _check_routing_by_topk(buffer, group, rank, num_ranks, 8 * num_ranks, async_finish, per_node)
        buffer._core.check_errors()
    finally:
        buffer.destroy()


def test_deepep_internode_flow_on_virtual_nodes(num_ranks):
    if num_ranks < 4:
        pytest.skip("hybrid mode over virtual nodes needs at least 4 ranks (2 nodes of 2)")
    launch(_internode_flow, num_ranks, num_ranks // 2)
