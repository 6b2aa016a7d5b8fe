"""EPHandle fields whose meaning follows DeepEP V2 (no GPU needed): the per-scale-up-peer prefix sum
``psum_num_recv_tokens_per_scaleup_rank``, derived from the per-source counts the kernels write, and
``topk_idx`` after ``dispatch(do_handle_copy=False)``: the caller's tensor, while the kernels keep
reading the handle's sanitised copy (``routing``). The GPU suite (tests/gpu/test_v2_compat.py,
tests/gpu/ht_checks.py) checks both on real dispatches."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_handle import _handle as _small_handle
from test_ht_host_path_routing import _owned_handle, _RecordingHostPath, _uncached_buffer, _UncachedHostPath

from deep_ep.handle import EPHandle, psum_per_scaleup_peer
from deep_ep.testing.data import make_group_inputs
from deep_ep.testing.reference import ht_dispatch
from deep_ep.testing.reference_v2 import v2_psum_num_recv_tokens_per_scaleup_rank


def _handle(num_ranks: int, num_nodes: int, per_source: list[int]) -> EPHandle:
    """A handle whose count views hold ``per_source`` tokens from each source rank."""
    counts = torch.zeros(4 * num_ranks, dtype=torch.int32)
    counts[:num_ranks] = torch.tensor(per_source, dtype=torch.int32)
    counts[num_ranks : 2 * num_ranks] = counts[:num_ranks].cumsum(0)
    return EPHandle(
        do_expand=False,
        num_experts=2 * num_ranks,
        expert_alignment=1,
        num_max_tokens_per_rank=16,
        num_sms=4,
        topk_idx=torch.zeros(3, 2, dtype=torch.int64),
        num_recv_tokens=sum(per_source),
        num_expanded_tokens=sum(per_source),
        num_recv_tokens_per_expert_list=[],
        psum_num_recv_tokens_per_source=counts[num_ranks : 2 * num_ranks],
        psum_num_recv_tokens_per_expert=counts[2 * num_ranks : 2 * num_ranks + 2],
        num_unaligned_recv_tokens_per_expert=counts[3 * num_ranks : 3 * num_ranks + 2],
        recv_src_info=torch.zeros(sum(per_source), 4, dtype=torch.int32),
        dst_buffer_slot_idx=torch.zeros(3, 2, dtype=torch.int32),
        num_ranks=num_ranks,
        num_tokens=3,
        num_topk=2,
        is_exact=True,
        expert_slot_idx=torch.zeros(3, 2, dtype=torch.int32),
        num_recv_tokens_per_scaleup_rank=counts[:num_ranks],
        expert_offsets_per_source=torch.zeros(num_ranks, 2, dtype=torch.int32),
        expert_start=torch.zeros(2, dtype=torch.int32),
        recv_expanded_row_idx=None,
        counts=counts,
        num_nodes=num_nodes,
    )


def test_direct_mode_psum_is_the_per_source_prefix_sum_itself():
    handle = _handle(4, 1, [3, 1, 4, 2])
    assert handle.psum_num_recv_tokens_per_scaleup_rank is handle.psum_num_recv_tokens_per_source
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == [3, 4, 8, 10]


def test_hybrid_psum_has_one_entry_per_scaleup_peer_summed_over_nodes():
    # R = 4 on 2 nodes (S = 2): peer 0 forwards sources 0 and 2 (3 + 4), peer 1 sources 1 and 3 (1 + 2).
    handle = _handle(4, 2, [3, 1, 4, 2])
    psum = handle.psum_num_recv_tokens_per_scaleup_rank
    assert psum.dtype == torch.int32 and psum.tolist() == [7, 10]
    assert handle.psum_num_recv_tokens_per_source.tolist() == [3, 4, 8, 10]  # unchanged: rows by source
    # R = 6 on 3 nodes (S = 2) and on 2 nodes (S = 3).
    assert _handle(6, 3, [1, 2, 3, 4, 5, 6]).psum_num_recv_tokens_per_scaleup_rank.tolist() == [9, 21]
    assert _handle(6, 2, [1, 2, 3, 4, 5, 6]).psum_num_recv_tokens_per_scaleup_rank.tolist() == [5, 12, 21]


def test_hybrid_psum_follows_the_counts_and_survives_replace():
    handle = _handle(4, 2, [3, 1, 4, 2])
    handle.num_recv_tokens_per_scaleup_rank.copy_(torch.tensor([0, 5, 1, 1], dtype=torch.int32))
    assert handle.psum_num_recv_tokens_per_scaleup_rank.tolist() == [1, 7]  # e.g. a graph replay's counts
    narrowed = dataclasses.replace(handle, num_recv_tokens=2)
    assert narrowed.psum_num_recv_tokens_per_scaleup_rank.tolist() == [1, 7]


@pytest.mark.parametrize(("num_ranks", "num_ranks_per_node"), [(2, 1), (4, 2), (6, 3), (6, 2), (8, 4), (8, 8)])
def test_derivation_matches_v2_counted_from_every_ranks_routing(num_ranks, num_ranks_per_node):
    """The handle's value, derived from the per-source counts the reference dispatch reports, equals
    V2's per-peer count taken straight from every rank's routing."""
    num_experts = 3 * num_ranks
    for seed in (1, 2, 3):
        data = make_group_inputs(num_ranks, 24, 16, num_experts, 4, seed=seed, with_weights=False)
        reference = ht_dispatch(data.dispatch_xs, data.topk_idx, None, num_experts)
        num_nodes = num_ranks // num_ranks_per_node
        for rank in range(num_ranks):
            per_source = reference[rank]["num_recv_tokens_per_rank"]
            want = v2_psum_num_recv_tokens_per_scaleup_rank(
                data.topk_idx, num_experts, rank, None if num_nodes == 1 else num_ranks_per_node
            )
            got = _handle(num_ranks, num_nodes, per_source).psum_num_recv_tokens_per_scaleup_rank
            assert got.tolist() == want, f"R={num_ranks} S={num_ranks_per_node} seed {seed} rank {rank}"
            assert want[-1] == sum(per_source)
            assert psum_per_scaleup_peer(torch.tensor(per_source, dtype=torch.int32), num_nodes).tolist() == want


# ------------------------------------------------------------------ do_handle_copy=False


@pytest.fixture
def _no_cuda_stream(monkeypatch):
    # The host path is handed the caller's raw stream; there is none without a GPU.
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)


def test_keep_caller_topk_idx_moves_the_sanitised_copy_aside():
    handle = _small_handle(do_expand=False)
    copy = handle.topk_idx
    assert handle.routing is copy and handle.sanitized_topk_idx is None
    caller = torch.tensor([[1, 9], [2, 2], [-1, 0]])  # 9 out of range, 2 repeated: -1 in the copy
    handle.keep_caller_topk_idx(caller)
    assert handle.topk_idx is caller and handle.routing is copy and handle.sanitized_topk_idx is copy
    # The handle owns (and an event keeps alive) its copy, not the caller's tensor.
    assert any(tensor is copy for tensor in handle.tensors())
    assert not any(tensor is caller for tensor in handle.tensors())
    assert len(handle.tensors()) == 5
    # Twice (e.g. a second caller tensor): the copy stays the one the kernels read.
    other = caller.clone()
    handle.keep_caller_topk_idx(other)
    assert handle.topk_idx is other and handle.routing is copy
    # dataclasses.replace keeps both.
    narrowed = dataclasses.replace(handle, num_recv_tokens=2)
    assert narrowed.topk_idx is other and narrowed.routing is copy


@pytest.mark.parametrize("do_handle_copy", [True, False])
def test_uncached_host_path_dispatch_keeps_the_callers_topk_idx_without_handle_copy(_no_cuda_stream, do_handle_copy):
    host_path = _UncachedHostPath((torch.zeros(5, 8), None, torch.zeros(5, 2, dtype=torch.int64), None))
    buffer = _uncached_buffer(host_path)
    topk_idx = torch.tensor([[0, 5], [3, -1], [7, 7]])
    *_, handle, _ = buffer.dispatch(torch.zeros(3, 8, dtype=torch.bfloat16), topk_idx, do_handle_copy=do_handle_copy)
    assert host_path.calls == ["begin_dispatch", "finish_dispatch"]
    block_routing = handle.routing
    assert block_routing is not topk_idx  # the notify block's copy, what the kernels read
    if do_handle_copy:
        assert handle.topk_idx is block_routing and handle.sanitized_topk_idx is None
    else:
        assert handle.topk_idx is topk_idx and handle.topk_idx.data_ptr() == topk_idx.data_ptr()
        assert handle.sanitized_topk_idx is block_routing


def test_cached_dispatch_and_combine_return_and_use_the_same_handle(_no_cuda_stream):
    host_path = _RecordingHostPath((torch.zeros(5, 8), None, torch.zeros(5, 2, dtype=torch.int64), None))
    buffer = _uncached_buffer(host_path)
    handle = _owned_handle()
    caller = torch.zeros(3, 2, dtype=torch.int64)
    handle.keep_caller_topk_idx(caller)
    # do_handle_copy is an uncached dispatch's choice: a cached one returns the handle as it is.
    got = buffer.dispatch(torch.zeros(3, 8, dtype=torch.bfloat16), handle=handle, do_handle_copy=True)[3]
    assert got is handle and got.topk_idx is caller
    assert host_path.calls == ["cached_dispatch"]
