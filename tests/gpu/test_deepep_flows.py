"""DeepEP's own test flows and its clients' first calls, through ``deep_ep.Buffer`` and
``deep_ep.ElasticBuffer``, as those programs make them (our own code; DeepEP's scripts are the
spec): SGLang's construction with ``allow_mnnvl=True``, Megatron's synchronous layout whose
``EventOverlap(None)`` is passed on as ``previous_event``, and DeepEP's intranode / internode test
flow that starts with a dispatch routed by ``is_token_in_rank`` alone (no ``topk_idx``), reads
``handle[0]`` (the rank prefix matrix) and the per-expert counts V1 derives from
``num_tokens_per_expert``, and combines the received rows back.

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
from deep_ep.event import EventOverlap
from deep_ep.testing import launch
from deep_ep.v1_buffer import Buffer, bytes_for_tokens

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


def _num_nvl_bytes(num_ranks: int, per_node: int) -> int:
    return bytes_for_tokens(num_ranks, per_node, 256, HIDDEN, num_ranks, False)


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
        buffer._core.check_errors()
    finally:
        buffer.destroy()


def test_deepep_internode_flow_on_virtual_nodes(num_ranks):
    if num_ranks < 4:
        pytest.skip("hybrid mode over virtual nodes needs at least 4 ranks (2 nodes of 2)")
    launch(_internode_flow, num_ranks, num_ranks // 2)
