"""The DeepEP-V1 façade ``deep_ep.compat``: everything that runs without a GPU (sizing rule,
refused options, layout, V1 output meanings, handle indexing, and the low-latency calls over a
recording stand-in for the cores: lazy LL window, sizing errors, argument routing, refusals)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import deep_ep.compat.buffer as compat_buffer
import deep_ep.compat.streams as compat_streams
from deep_ep import _C
from deep_ep.buffer import ElasticBuffer
from deep_ep.compat.buffer import Buffer, check_unbacked_options
from deep_ep.compat.capacity import bytes_for_tokens, low_latency_window_bytes, token_capacity, window_num_bytes
from deep_ep.compat.handles import DispatchHandle, LowLatencyDispatchHandle
from deep_ep.compat.layout import dispatch_layout
from deep_ep.compat.outputs import fit_rows, mask_rows_past, v1_dispatch_outputs, zero_foreign_weights
from deep_ep.compiled_archs import sass_architectures
from deep_ep.errors import BufferTooSmallError, PeerInputError
from deep_ep.event import EventOverlap
from deep_ep.handle import EPHandle
from deep_ep.low_latency import LowLatencyHandle
from deep_ep.testing.reference_layout import dispatch_layout_by_loops

MIB = 1 << 20

# --------------------------------------------------------------------------------------- sizing


def test_window_pools_both_budgets_rounded_up_to_2_mib_plus_the_workspace():
    workspace = _C.WORKSPACE_BYTES
    assert workspace == 2 * MIB
    assert window_num_bytes(0, 0) == workspace  # nothing but the workspace: every dispatch is too small
    assert window_num_bytes(1, 0) == 2 * MIB + workspace
    assert window_num_bytes(2 * MIB, 0) == 2 * MIB + workspace
    assert window_num_bytes(3 * MIB, MIB) == window_num_bytes(4 * MIB, 0) == 4 * MIB + workspace
    # DeepEP's tests and vLLM pass ~1 GB of NVL bytes: 477 x 2 MiB of HT region.
    assert window_num_bytes(int(1e9), 0) == 477 * 2 * MIB + workspace == 1_002_438_656
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="num_nvl_bytes must be a non-negative int"):
            window_num_bytes(bad, 0)
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        window_num_bytes(0, -2)


def test_capacity_worked_examples():
    region = window_num_bytes(int(1e9), 0) - _C.WORKSPACE_BYTES  # 1_000_341_504 bytes of HT region
    assert region == 1_000_341_504
    # 8 ranks, H=7168, K=8, bf16: one token slot is 14464 bytes at each of 8 ranks (dispatch is the
    # larger footprint) -> floor(1_000_341_504 / (8 * 14464)) = 8645 tokens per rank.
    assert token_capacity(8, 8, region, 7168, 8, False) == 8645
    assert bytes_for_tokens(8, 8, 8645, 7168, 8, False) == 8 * 8645 * 14464
    # fp8 dispatch slots are smaller, so the bf16 combine (14368 bytes a slot) bounds it.
    assert token_capacity(8, 8, region, 7168, 8, True) == region // (8 * 14368) == 8702
    # Two virtual nodes of four (hybrid): the scale-out staging lives in the same region.
    assert token_capacity(8, 4, region, 7168, 8, False) == 5801
    # A 2 MiB region holds 18 such tokens per rank; an empty one none.
    assert token_capacity(8, 8, 2 * MIB, 7168, 8, False) == 18
    assert token_capacity(8, 8, 0, 7168, 8, False) == 0


@pytest.mark.parametrize(
    "num_ranks, scaleup, hidden, num_topk, use_fp8",
    [(8, 8, 7168, 8, False), (8, 8, 7168, 8, True), (2, 2, 4096, 6, True), (8, 4, 7168, 8, False), (1, 1, 8, 1, False)],
)
@pytest.mark.parametrize("region", [2 * MIB, 64 * MIB, 1_000_341_504])
def test_capacity_is_the_largest_token_count_whose_footprint_fits(
    num_ranks, scaleup, hidden, num_topk, use_fp8, region
):
    capacity = token_capacity(num_ranks, scaleup, region, hidden, num_topk, use_fp8)
    assert capacity >= 1
    assert bytes_for_tokens(num_ranks, scaleup, capacity, hidden, num_topk, use_fp8) <= region
    assert bytes_for_tokens(num_ranks, scaleup, capacity + 1, hidden, num_topk, use_fp8) > region
    layout = _C.high_throughput_layout(num_ranks, scaleup, capacity, hidden, num_topk, use_fp8)
    assert max(layout["dispatch_bytes"], layout["combine_bytes"]) <= region


def test_capacity_matches_the_closed_form_in_direct_mode():
    # Direct mode: footprints are R * T_max * slot bytes, so the capacity is a division.
    for num_ranks, hidden, num_topk, use_fp8 in ((2, 2048, 8, False), (4, 4096, 6, True), (8, 7168, 1, False)):
        layout = _C.high_throughput_layout(num_ranks, num_ranks, 1, hidden, num_topk, use_fp8)
        slot = max(layout["dispatch_token_bytes"], layout["combine_token_bytes"])
        region = 300 * MIB
        assert token_capacity(num_ranks, num_ranks, region, hidden, num_topk, use_fp8) == region // (num_ranks * slot)


def _bare_buffer(num_ranks: int = 8, scaleup: int = 8, region: int = 2 * MIB, max_num_sms: int = 132) -> Buffer:
    """A Buffer with a stand-in core (sizes and SM cap only): no GPU, no group."""
    buffer = object.__new__(Buffer)
    buffer.group_size = num_ranks
    buffer.rank = 0
    buffer.num_nvl_bytes = region
    buffer.num_rdma_bytes = 0
    buffer._core = SimpleNamespace(
        num_scaleup_ranks=scaleup,
        num_scaleout_ranks=num_ranks // scaleup,
        _window={"ht_bytes": region, "ht_offset": _C.WORKSPACE_BYTES},
        _max_num_sms=max_num_sms,
        _max_ht_num_sms=max_num_sms,
    )
    return buffer


def test_too_small_names_the_bytes_needed():
    buffer = _bare_buffer(region=2 * MIB)
    assert buffer.token_capacity(7168, 8, False) == 18
    error = buffer._too_small(100, 7168, 8, False)
    assert isinstance(error, BufferTooSmallError) and isinstance(error, ValueError)
    needed = bytes_for_tokens(8, 8, 100, 7168, 8, False)
    assert error.needed_bytes == needed and error.available_bytes == 2 * MIB
    assert f"num_nvl_bytes + num_rdma_bytes >= {needed}" in str(error)
    assert "at most 18 tokens per rank" in str(error)


# ------------------------------------------------------------------------------ refused options


def test_comm_raises_not_implemented_naming_it():
    with pytest.raises(NotImplementedError, match="Buffer\\(comm=") as info:
        check_unbacked_options(comm=object())
    assert "comm=object" in str(info.value)
    # The constructor refuses before it touches the group or CUDA (group=None would fail there).
    with pytest.raises(NotImplementedError, match="comm"):
        Buffer(None, comm=object())


@pytest.mark.parametrize("option", ["allow_mnnvl", "use_fabric"])
def test_mnnvl_and_fabric_are_permissions_not_refusals(option):
    # SGLang passes allow_mnnvl=True on every machine: the constructor goes on to its size checks
    # (group=None is never reached: the bad size is refused first).
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        Buffer(None, -1, **{option: True})


def test_accepted_options_and_bad_sizes():
    check_unbacked_options()  # every default is backed
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        Buffer(None, -1)
    with pytest.raises(ValueError, match="num_qps_per_rank"):
        Buffer(None, 0, 0, False, -3)
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        Buffer(None, 0, -1, low_latency_mode=True)
    # low_latency_mode is accepted: construction goes past the option checks (and fails on group=None).
    with pytest.raises(AttributeError, match="rank"):
        Buffer(None, 0, 1 << 30, low_latency_mode=True)


def _shrink_buffer(enable_shrink: bool = True) -> Buffer:
    """A bare Buffer whose LL window is not built yet (masks are kept on the host until it is)."""
    buffer = _bare_buffer(num_ranks=4)
    buffer._core._ensure_usable = lambda: None
    buffer._core._check_fatal_errors = lambda: None
    buffer.low_latency_mode = True
    buffer.enable_shrink = enable_shrink
    return buffer


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("low_latency_update_mask_buffer", (1, True)),
        ("low_latency_query_mask_buffer", (torch.zeros(4, dtype=torch.int32),)),
        ("low_latency_clean_mask_buffer", ()),
    ],
)
def test_rank_mask_calls_need_enable_shrink(name, args):
    with pytest.raises(RuntimeError, match=f"Buffer.{name} needs rank masking.*enable_shrink=True"):
        getattr(_shrink_buffer(enable_shrink=False), name)(*args)


def test_enable_shrink_needs_low_latency_mode():
    with pytest.raises(ValueError, match="enable_shrink=True.*needs low_latency_mode=True"):
        Buffer(None, 0, 1 << 30, enable_shrink=True)


def test_masks_set_before_the_low_latency_window_exists_are_kept_until_it_is_built():
    buffer = _shrink_buffer()
    status = torch.full((4,), -1, dtype=torch.int32)
    buffer.low_latency_update_mask_buffer(2, True)
    buffer.low_latency_update_mask_buffer(3, True)
    buffer.low_latency_update_mask_buffer(3, False)
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0, 1, 0]
    with pytest.raises(ValueError, match="cannot mask itself"):
        buffer.low_latency_update_mask_buffer(0, True)
    with pytest.raises(ValueError, match="rank_to_mask must be a rank in"):
        buffer.low_latency_update_mask_buffer(4, True)
    with pytest.raises(ValueError, match="int32 tensor of 4 elements"):
        buffer.low_latency_query_mask_buffer(torch.zeros(3, dtype=torch.int32))
    buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0, 0, 0, 0]


def test_previous_event_is_checked_but_needs_no_allocate_on_comm_stream():
    Buffer._check_stream_options(None)
    Buffer._check_stream_options(EventOverlap(event="recorded"))  # any non-None event passes the type check
    with pytest.raises(TypeError, match="previous_event must be an EventOverlap"):
        Buffer._check_stream_options("event")


def test_num_sms_comes_from_config_or_the_class_and_is_capped(monkeypatch):
    monkeypatch.setattr(Buffer, "num_sms", 20)
    buffer = _bare_buffer(max_num_sms=16)
    assert buffer._resolve_num_sms(None) == 16  # V1's default 20, capped at this rank's share
    assert buffer._resolve_num_sms(SimpleNamespace(num_sms=8)) == 8
    Buffer.set_num_sms(12)
    assert Buffer.num_sms == 12 and buffer._resolve_num_sms(None) == 12
    with pytest.raises(ValueError, match="even"):
        Buffer.set_num_sms(13)
    with pytest.raises(TypeError, match="V1 Config with an int num_sms"):
        buffer._resolve_num_sms(object())


def test_layout_arguments_are_checked_for_shape():
    buffer = _bare_buffer(num_ranks=4, scaleup=4)
    buffer._check_layout_arguments(5, 8, torch.zeros(4, dtype=torch.int32), None, torch.zeros(5, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"num_tokens_per_rank must be a tensor of shape \[4\]"):
        buffer._check_layout_arguments(5, 8, torch.zeros(3, dtype=torch.int32), None, None)
    with pytest.raises(ValueError, match=r"is_token_in_rank must be a tensor of shape \[5, 4\]"):
        buffer._check_layout_arguments(5, 8, None, None, torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="is_token_in_rank must be bool"):
        buffer._check_layout_arguments(5, 8, None, None, torch.zeros(5, 4, dtype=torch.int32))
    hybrid = _bare_buffer(num_ranks=4, scaleup=2)
    with pytest.raises(ValueError, match=r"num_tokens_per_rdma_rank must be a tensor of shape \[2\]"):
        hybrid._check_layout_arguments(5, 8, None, torch.zeros(4, dtype=torch.int32), None)


def test_config_helpers_are_v1s_tables_at_buffer_num_sms(monkeypatch):
    from deep_ep.compat import config as v1_config

    monkeypatch.setattr(Buffer, "num_sms", 24)
    assert vars(Buffer.get_dispatch_config(8)) == vars(v1_config.get_dispatch_config(8, num_sms=24))
    assert vars(Buffer.get_combine_config(8)) == vars(v1_config.get_combine_config(8, num_sms=24))
    assert Buffer.get_dispatch_config(8).num_sms == 24
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == v1_config.get_low_latency_rdma_size_hint(
        128, 7168, 8, 256
    )


def test_sm90_build_info_comes_from_the_extension_fatbin():
    archs = sass_architectures(_C.__file__)
    assert archs, "the extension should carry SASS for at least one architecture"
    assert Buffer.is_sm90_compiled() == (90 in archs)
    assert sass_architectures("/nonexistent/_C.so") == frozenset()
    assert sass_architectures(__file__) == frozenset()  # not ELF


# ------------------------------------------------------------------------------------- layout


def test_dispatch_layout_worked_example():
    # 4 ranks, 8 experts (2 per rank). Token 1 repeats expert 3 and has a -1; token 2 has nothing;
    # token 3 carries an out-of-range id (ignored, as the core treats it as -1).
    topk_idx = torch.tensor([[0, 1, 6], [3, -1, 3], [-1, -1, -1], [7, 9, 2]])
    per_rank, per_rdma, per_expert, in_rank = dispatch_layout(topk_idx, 8, 4)
    assert per_rank.dtype == torch.int32 and per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
    assert per_rank.tolist() == [1, 2, 0, 2]  # token 0 counts once on rank 0 (experts 0 and 1)
    assert per_expert.tolist() == [1, 1, 1, 1, 0, 0, 1, 1]  # expert 3 once for token 1
    assert in_rank.tolist() == [
        [True, False, False, True],
        [False, True, False, False],
        [False, False, False, False],
        [False, True, False, True],
    ]
    assert per_rdma is None  # one node
    _, per_node, _, _ = dispatch_layout(topk_idx, 8, 4, num_ranks_per_node=2)
    assert per_node.tolist() == [3, 2]  # tokens 0 and 3 on both nodes, token 1 on node 0 only


@pytest.mark.parametrize("num_ranks, per_node", [(1, 1), (2, 2), (4, 2), (8, 4), (8, 1)])
def test_dispatch_layout_matches_loops_on_random_routing(num_ranks, per_node):
    generator = torch.Generator().manual_seed(num_ranks * 10 + per_node)
    num_experts = 4 * num_ranks
    topk_idx = torch.randint(-1, num_experts, (300, 6), generator=generator)
    per_rank, per_rdma, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, num_ranks, per_node)
    want_rank, want_node, want_expert, want_in_rank = dispatch_layout_by_loops(
        topk_idx, num_experts, num_ranks, per_node
    )
    assert per_rank.tolist() == want_rank
    assert per_expert.tolist() == want_expert
    assert torch.equal(in_rank, want_in_rank)
    if per_node == num_ranks:
        assert per_rdma is None
    else:
        assert per_rdma.tolist() == want_node
    # int32 routing gives the same layout; zero tokens give zero counts.
    assert torch.equal(dispatch_layout(topk_idx.int(), num_experts, num_ranks, per_node)[3], in_rank)
    empty = dispatch_layout(topk_idx[:0], num_experts, num_ranks, per_node)
    assert empty[0].tolist() == [0] * num_ranks and empty[3].shape == (0, num_ranks)


def test_dispatch_layout_refuses_bad_arguments():
    with pytest.raises(ValueError, match="multiple of the group size"):
        dispatch_layout(torch.zeros(2, 2, dtype=torch.int64), 6, 4)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        dispatch_layout(torch.zeros(2, dtype=torch.int64), 8, 4)
    with pytest.raises(ValueError, match="int64"):
        dispatch_layout(torch.zeros(2, 2), 8, 4)
    with pytest.raises(ValueError, match="num_ranks_per_node must divide"):
        dispatch_layout(torch.zeros(2, 2, dtype=torch.int64), 8, 4, num_ranks_per_node=3)


# ----------------------------------------------------------------------------- output helpers


def test_weights_of_foreign_slots_are_zeroed():
    idx = torch.tensor([[0, -1, 1], [-1, -1, 2]])
    weights = torch.tensor([[0.5, 0.25, 0.125], [1.0, 2.0, 3.0]])
    assert zero_foreign_weights(idx, weights) is weights
    assert weights.tolist() == [[0.5, 0.0, 0.125], [0.0, 0.0, 3.0]]


def test_rows_past_the_received_count_become_minus_one():
    idx = torch.arange(12).view(4, 3)
    mask_rows_past(idx, torch.tensor([2], dtype=torch.int32))
    assert idx.tolist() == [[0, 1, 2], [3, 4, 5], [-1, -1, -1], [-1, -1, -1]]


def test_fit_rows_narrows_or_pads():
    rows = torch.arange(6, dtype=torch.float32).view(3, 2)
    narrowed = fit_rows(rows, 2, 0.0)
    assert narrowed.data_ptr() == rows.data_ptr() and narrowed.shape == (2, 2)  # a view, no copy
    padded = fit_rows(rows, 5, -1.0)
    assert padded.tolist() == [[0, 1], [2, 3], [4, 5], [-1, -1], [-1, -1]]
    assert fit_rows(None, 4, 0.0) is None
    allocated = []

    def empty(shape, dtype, device):
        allocated.append(shape)
        return torch.empty(shape, dtype=dtype, device=device)

    fit_rows(rows, 4, 0.0, empty)
    assert allocated == [(4, 2)]


def _core_handle(num_rows: int, num_received: int, *, num_ranks: int = 2, num_nodes: int = 1) -> EPHandle:
    """A stand-in for what the core's dispatch returns (CPU tensors), ``num_received`` rows received."""
    counts = torch.zeros(64, dtype=torch.int32)
    psum = counts[0:num_ranks]
    psum.copy_(torch.linspace(num_received // num_ranks, num_received, num_ranks).round().int())
    psum[-1] = num_received
    src_info = torch.zeros(num_rows, 4, dtype=torch.int32)
    src_info[:, 0] = torch.arange(num_rows) % num_ranks
    src_info[:, 1] = torch.arange(num_rows) + 100
    topk_idx = torch.tensor([[0, 3], [1, -1], [-1, -1]])
    return EPHandle(
        do_expand=False,
        num_experts=4,
        expert_alignment=1,
        num_max_tokens_per_rank=8,
        num_sms=4,
        topk_idx=topk_idx,
        num_recv_tokens=num_rows,
        num_expanded_tokens=num_rows,
        num_recv_tokens_per_expert_list=[3, 1],
        psum_num_recv_tokens_per_source=psum,
        psum_num_recv_tokens_per_expert=counts[8:10],
        num_unaligned_recv_tokens_per_expert=counts[10:12],
        recv_src_info=src_info,
        dst_buffer_slot_idx=torch.zeros(3, 2, dtype=torch.int32),
        num_ranks=num_ranks,
        num_tokens=3,
        num_topk=2,
        is_exact=True,
        expert_slot_idx=torch.zeros(3, 2, dtype=torch.int32),
        num_recv_tokens_per_scaleup_rank=counts[12 : 12 + num_ranks],
        expert_offsets_per_source=counts[20 : 20 + 2 * num_ranks].view(num_ranks, 2),
        expert_start=counts[40:42],
        recv_expanded_row_idx=None,
        counts=counts,
        num_nodes=num_nodes,
    )


def _outputs(num_rows: int, hidden: int = 128, num_topk: int = 2):
    generator = torch.Generator().manual_seed(num_rows)
    data = torch.randn(num_rows, hidden, generator=generator).to(torch.float8_e4m3fn)
    scales = torch.rand(num_rows, hidden // 128, generator=generator)
    idx = torch.randint(-1, 2, (num_rows, num_topk), generator=generator)
    weights = torch.rand(num_rows, num_topk, generator=generator) + 0.5
    return (data, scales), idx, weights


def test_exact_dispatch_outputs_only_zero_the_foreign_weights():
    handle = _core_handle(num_rows=5, num_received=5)
    recv_x, idx, weights = _outputs(5)
    before = weights.clone()
    out_x, out_idx, out_weights, out_handle = v1_dispatch_outputs(recv_x, idx.clone(), weights, handle, 0)
    assert out_handle is handle and out_x is recv_x
    assert torch.equal(out_idx, idx)
    assert torch.equal(out_weights, torch.where(idx < 0, torch.zeros_like(before), before))


@pytest.mark.parametrize("num_worst", [4, 6, 9])
def test_worst_token_outputs_have_exactly_num_worst_rows(num_worst):
    # The core allocated 6 rows (R * T_max) and received 3 (the rest is garbage).
    handle = _core_handle(num_rows=6, num_received=3)
    (data, scales), idx, weights = _outputs(6)
    idx[:3] = torch.tensor([[0, -1], [1, 0], [-1, 1]])
    out_x, out_idx, out_weights, out_handle = v1_dispatch_outputs(
        (data, scales), idx.clone(), weights.clone(), handle, num_worst
    )
    out_data, out_scales = out_x
    assert out_data.shape == (num_worst, 128) and out_scales.shape == (num_worst, 1)
    assert out_idx.shape == (num_worst, 2) and out_weights.shape == (num_worst, 2)
    assert torch.equal(out_data[:3].view(torch.uint8), data[:3].view(torch.uint8))
    assert torch.equal(out_scales[:3], scales[:3])
    assert out_idx[:3].tolist() == [[0, -1], [1, 0], [-1, 1]]
    assert (out_idx[3:] == -1).all() and (out_weights[3:] == 0).all()  # V1's padding rows
    assert out_weights[0, 1] == 0 and out_weights[2, 0] == 0 and out_weights[1].tolist() == weights[1].tolist()
    # The handle now describes num_worst rows (combine's x, cached dispatch); the core's is untouched.
    assert out_handle is not handle and handle.num_recv_tokens == 6
    assert out_handle.num_recv_tokens == num_worst
    assert out_handle.recv_src_info.shape == (min(num_worst, 6), 4)
    assert out_handle.counts is handle.counts and out_handle.topk_idx is handle.topk_idx


# ------------------------------------------------------------------------------------- handle


def test_intranode_handle_indexes_like_v1_where_it_can():
    core = _core_handle(num_rows=5, num_received=5, num_ranks=2)
    in_rank = torch.tensor([[True, False], [False, True], [False, False]])
    handle = DispatchHandle(core, num_recv_tokens=5, num_worst_tokens=0, rank=1, is_token_in_rank=in_rank)
    assert len(handle) == 6 and not handle.internode
    assert handle[4] is in_rank and handle[-2] is in_rank
    assert handle[3].tolist() == [100, 101, 102, 103, 104] and handle[3].dtype == torch.int32
    assert handle[3].is_contiguous()
    assert torch.equal(handle.recv_rank_prefix_sum, core.psum_num_recv_tokens_per_source)
    assert handle.num_recv_tokens_device.tolist() == [5]
    with pytest.raises(IndexError, match="rank_prefix_matrix") as info:
        handle[0]
    message = str(info.value)
    assert "column 1" in message and "recv_rank_prefix_sum" in message and "gather_rank_prefix_matrix" in message
    for index, name in (
        (1, "channel_prefix_matrix"),
        (2, "recv_channel_prefix_matrix"),
        (5, "send_head"),
        (-1, "send_head"),
    ):
        with pytest.raises(IndexError, match=rf"'{name}'\) is not available"):
            handle[index]
    with pytest.raises(IndexError, match="out of range"):
        handle[6]
    with pytest.raises(TypeError, match="integers or slices"):
        handle["rank_prefix_matrix"]
    assert handle[3:5][1] is in_rank
    with pytest.raises(TypeError, match="cannot be iterated or unpacked"):
        list(handle)
    with pytest.raises(TypeError, match="cannot be iterated or unpacked"):
        _a, _b, _c, _d, _e, _f = handle


def test_intranode_handle_zero_is_the_cores_rank_prefix_matrix():
    core = _core_handle(num_rows=5, num_received=5, num_ranks=2)
    core.rank_prefix_matrix = torch.tensor([[1, 2], [4, 5]], dtype=torch.int32)  # the notify kernel's
    handle = DispatchHandle(core, num_recv_tokens=5, num_worst_tokens=0, rank=1)
    assert handle[0] is core.rank_prefix_matrix and handle.rank_prefix_matrix is core.rank_prefix_matrix
    # One gathered by a dispatch without topk_idx takes precedence (the same values on a real run).
    gathered = torch.tensor([[1, 2], [4, 5]], dtype=torch.int32)
    handle = DispatchHandle(core, num_recv_tokens=5, num_worst_tokens=0, rank=1, rank_prefix_matrix=gathered)
    assert handle[0] is gathered


def test_combine_asks_the_core_for_v1s_summed_weights():
    buffer = _recording_buffer()
    combined = []
    buffer._core.combine = lambda x, handle, **kwargs: combined.append((handle, kwargs)) or ("x", "w", None)
    core_handle = _core_handle(num_rows=3, num_received=3)
    handle = DispatchHandle(core_handle, num_recv_tokens=3, num_worst_tokens=0, rank=0)
    weights = torch.ones(3, 2)
    assert buffer.combine(torch.zeros(3, 128, dtype=torch.bfloat16), handle, topk_weights=weights)[:2] == ("x", "w")
    ((got_handle, kwargs),) = combined
    assert got_handle is core_handle and kwargs["topk_weights"] is weights and kwargs["sum_topk_weights"] is True


def test_is_token_in_rank_is_computed_from_the_routing_when_not_passed():
    core = _core_handle(num_rows=5, num_received=5, num_ranks=2)  # 4 experts, 2 per rank
    handle = DispatchHandle(core, num_recv_tokens=5, num_worst_tokens=0, rank=0)
    assert handle[4].tolist() == [[True, True], [True, False], [False, False]]


def test_internode_handle_gives_the_global_rank_prefix_sum():
    core = _core_handle(num_rows=4, num_received=4, num_ranks=4, num_nodes=2)
    handle = DispatchHandle(core, num_recv_tokens=4, num_worst_tokens=0, rank=2)
    assert len(handle) == 10 and handle.internode
    assert handle[0].shape == (3, 4)  # is_token_in_rank
    assert handle[6] is core.psum_num_recv_tokens_per_source and handle[-4] is handle[6]
    for index in (1, 2, 3, 4, 5, 7, 8, 9):
        with pytest.raises(IndexError, match="is not available"):
            handle[index]


def test_recv_src_idx_covers_padded_worst_rows():
    core = _core_handle(num_rows=3, num_received=2)
    handle = DispatchHandle(core, num_recv_tokens=5, num_worst_tokens=5, rank=0)
    assert handle[3].tolist() == [100, 101, 102, -1, -1]


# ---------------------------------------------------------------- refusals keep the ranks in step


class _RecordingCore(SimpleNamespace):
    """Records how the façade uses the core; its dispatch refuses T > T_max like the real one."""

    def __init__(self, region: int = 2 * MIB) -> None:
        super().__init__(
            num_scaleup_ranks=2,
            num_scaleout_ranks=1,
            _window={"ht_bytes": region, "ht_offset": _C.WORKSPACE_BYTES},
            _max_num_sms=32,
            _max_ht_num_sms=32,
            calls=[],
        )

    def _ensure_usable(self) -> None:
        pass

    def _check_fatal_errors(self, call: str | None = None) -> None:
        pass

    def _dispatch_without_input(self, handle, num_experts, error) -> None:
        self.calls.append(("dispatch without input", handle, num_experts, type(error).__name__))

    def _combine_without_input(self, x, handle, error) -> None:
        self.calls.append(("combine without input", handle, type(error).__name__))

    def dispatch(self, x, topk_idx=None, topk_weights=None, **kwargs):
        self.calls.append(("dispatch", kwargs.get("num_max_tokens_per_rank")))
        data = x[0] if isinstance(x, tuple) else x
        if data.shape[0] > kwargs["num_max_tokens_per_rank"]:
            raise ValueError("x has more than num_max_tokens_per_rank tokens")
        raise AssertionError("not reached in these tests")

    def destroy(self) -> None:
        self.calls.append(("destroy",))


def _recording_buffer(explicitly_destroy: bool = True) -> Buffer:
    buffer = _bare_buffer(num_ranks=2, scaleup=2)
    buffer._core = _RecordingCore()
    buffer.explicitly_destroy = explicitly_destroy
    return buffer


def _layout(num_tokens: int = 4, num_experts: int = 8):
    topk_idx = torch.tensor([[0, 5], [1, -1], [6, 7], [-1, -1]])[:num_tokens]
    per_rank, _, per_expert, in_rank = dispatch_layout(topk_idx, num_experts, 2)
    return topk_idx, {"num_tokens_per_rank": per_rank, "num_tokens_per_expert": per_expert, "is_token_in_rank": in_rank}


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"drop": "num_tokens_per_expert"}, ValueError, "num_tokens_per_expert must be given"),
        ({"num_worst_tokens": -1}, ValueError, "num_worst_tokens must be an int >= 0"),
        ({"config": object()}, TypeError, "V1 Config"),
        ({"is_token_in_rank": torch.zeros(3, 2, dtype=torch.bool)}, ValueError, "is_token_in_rank must be a tensor"),
    ],
)
def test_refused_dispatch_takes_part_without_data_then_raises(kwargs, error, words):
    buffer = _recording_buffer()
    topk_idx, layout = _layout()
    arguments = {"topk_idx": topk_idx, **layout, **kwargs}
    dropped = arguments.pop("drop", None)
    if dropped is not None:
        del arguments[dropped]
    with pytest.raises(error, match=words):
        buffer.dispatch(torch.zeros(4, 128, dtype=torch.bfloat16), **arguments)
    (call,) = buffer._core.calls
    assert call[0] == "dispatch without input" and call[1] is None and call[3] == error.__name__
    assert call[2] == (None if kwargs.get("drop") == "num_tokens_per_expert" else 8)  # E, from the layout


def test_a_cpu_synced_dispatch_refuses_cuda_graph_capture_before_the_core_runs(monkeypatch):
    monkeypatch.setattr(compat_buffer, "stream_capturing", lambda: True)
    buffer = _recording_buffer()
    topk_idx, layout = _layout()
    with pytest.raises(RuntimeError, match="without num_worst_tokens cannot be captured in a CUDA graph"):
        buffer.dispatch(torch.zeros(4, 128, dtype=torch.bfloat16), topk_idx=topk_idx, **layout)
    assert buffer._core.calls == []  # nothing launched, not even the take-part-without-data kernels
    # With num_worst_tokens (no CPU sync) the call goes on to the core.
    with pytest.raises(AssertionError, match="not reached"):
        buffer.dispatch(torch.zeros(4, 128, dtype=torch.bfloat16), topk_idx=topk_idx, num_worst_tokens=16, **layout)
    assert buffer._core.calls[0][0] == "dispatch"


def test_a_token_count_past_the_capacity_raises_buffer_too_small_after_the_core_took_part():
    buffer = _recording_buffer()
    capacity = buffer.token_capacity(4096, 2, False)
    topk_idx = torch.zeros(capacity + 1, 2, dtype=torch.int64)
    topk_idx[:, 1] = 4
    per_rank, _, per_expert, in_rank = dispatch_layout(topk_idx, 8, 2)
    with pytest.raises(BufferTooSmallError, match="num_nvl_bytes \\+ num_rdma_bytes >=") as info:
        buffer.dispatch(
            torch.zeros(capacity + 1, 4096, dtype=torch.bfloat16),
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
        )
    assert info.value.needed_bytes == bytes_for_tokens(2, 2, capacity + 1, 4096, 2, False)
    assert isinstance(info.value.__cause__, ValueError)  # the core's own refusal (it took part without data)
    assert buffer._core.calls == [("dispatch", capacity)]  # every rank passes the same T_max: the capacity


def test_an_fp8_dispatch_gets_the_bf16_t_max_so_its_handle_serves_bf16_cached_dispatches():
    buffer = _recording_buffer()
    # H=7168, K=8: the bf16 dispatch slot (14464 bytes) is the largest footprint, the fp8 one
    # smaller (the bf16 combine's 14368 bounds it): a region of 100 fp8 tokens holds 99 bf16 ones.
    buffer._core._window = {"ht_bytes": 2 * 14368 * 100, "ht_offset": _C.WORKSPACE_BYTES}
    bf16_capacity = buffer.token_capacity(7168, 8, False)
    assert buffer.token_capacity(7168, 8, True) > bf16_capacity  # the case that matters
    topk_idx = torch.arange(8, dtype=torch.int64).repeat(bf16_capacity + 1, 1)
    per_rank, _, per_expert, in_rank = dispatch_layout(topk_idx, 8, 2)
    x = (torch.zeros(bf16_capacity + 1, 7168, dtype=torch.float8_e4m3fn), torch.ones(bf16_capacity + 1, 56))
    with pytest.raises(BufferTooSmallError) as info:
        buffer.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
        )
    assert buffer._core.calls == [("dispatch", bf16_capacity)]
    assert f"at most {bf16_capacity} tokens" in str(info.value)


def test_refused_cached_dispatch_and_combine_take_part_with_the_core_handle():
    buffer = _recording_buffer()
    core_handle = _core_handle(num_rows=3, num_received=3)
    handle = DispatchHandle(core_handle, num_recv_tokens=3, num_worst_tokens=0, rank=0)
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="must be None with handle="):
        buffer.dispatch(x, handle=handle, topk_idx=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="DispatchHandle returned by dispatch"):
        buffer.dispatch(x, handle=core_handle)
    with pytest.raises(TypeError, match="DispatchHandle returned by dispatch"):
        buffer.combine(x, (1, 2, 3))
    calls = buffer._core.calls
    assert [call[0] for call in calls] == ["dispatch without input"] * 2 + ["combine without input"]
    assert calls[0][1] is core_handle and calls[1][1] is core_handle


def test_destroy_follows_the_explicitly_destroy_rule():
    implicit = _recording_buffer(explicitly_destroy=False)
    with pytest.raises(RuntimeError, match="explicitly_destroy=True"):
        implicit.destroy()
    buffer = _recording_buffer(explicitly_destroy=True)
    core = buffer._core
    buffer.destroy()
    buffer.destroy()  # once only
    assert core.calls == [("destroy",)]
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.get_comm_stream()


def test_gather_rank_prefix_matrix_over_a_one_rank_gloo_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        buffer = _bare_buffer(num_ranks=1, scaleup=1)
        buffer.group = dist.group.WORLD
        core = _core_handle(num_rows=2, num_received=2, num_ranks=1)  # routing: tokens 0 and 1 have an expert
        handle = DispatchHandle(core, num_recv_tokens=2, num_worst_tokens=0, rank=0)
        matrix = buffer.gather_rank_prefix_matrix(handle)
        assert matrix.dtype == torch.int32 and matrix.tolist() == [[2]]
        with pytest.raises(TypeError, match="DispatchHandle"):
            buffer.gather_rank_prefix_matrix(core)
    finally:
        dist.destroy_process_group()


def test_v1_size_hints_leave_room_for_the_tokens_they_size_for(monkeypatch):
    """A client sizing with deep_ep.compat.config's hints (V1's recipe) gets at least the token count the
    hints were computed for (their documented mapping: num_sms / 2 x the NVL receive chunk)."""
    config = pytest.importorskip("deep_ep.compat.config")
    monkeypatch.delenv(getattr(config, "TOKENS_ENV", "EP_V1_NUM_MAX_TOKENS_PER_RANK"), raising=False)
    monkeypatch.setattr(Buffer, "num_sms", 20)
    for num_ranks in (2, 4, 8, 16):
        configs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
        assert all(item.num_sms == 20 for item in configs)
        hidden = 7168
        nvl = max(item.get_nvl_buffer_size_hint(hidden * 2, num_ranks) for item in configs)
        rdma = max(item.get_rdma_buffer_size_hint(hidden * 2, num_ranks) for item in configs)
        region = window_num_bytes(nvl, rdma) - _C.WORKSPACE_BYTES
        sized_for = (configs[0].num_sms // 2) * configs[0].num_max_nvl_chunked_recv_tokens
        scaleup = min(num_ranks, 8)  # above 8 ranks V1 clients run 8-rank nodes
        for num_topk, use_fp8 in ((8, False), (8, True), (32, False)):
            assert token_capacity(num_ranks, scaleup, region, hidden, num_topk, use_fp8) >= sized_for
    Buffer.set_num_sms(24)
    assert Buffer.get_dispatch_config(8).num_sms == 24


# ------------------------------------------------------------------------------------ low latency

LL_T, LL_H, LL_E = 4, 256, 8  # num_max_dispatch_tokens_per_rank, hidden, num_experts of these tests


def _ll_core_handle(num_ranks: int = 2, num_tokens: int = 3, sizing=(LL_T, LL_H, LL_E)) -> LowLatencyHandle:
    """A core LowLatencyHandle as the compact dispatch returns it (CPU tensors)."""
    cap, hidden, num_experts = sizing
    num_local, num_slots = num_experts // num_ranks, num_ranks * cap
    return LowLatencyHandle(
        owner_id=1,
        area=0,
        op_index=0,
        num_tokens=num_tokens,
        num_topk=2,
        num_max_dispatch_tokens_per_rank=cap,
        hidden=hidden,
        num_experts=num_experts,
        use_fp8=True,
        recv_count=torch.zeros(num_local, dtype=torch.int32),
        count_per_source=torch.zeros(num_local, num_ranks, dtype=torch.int32),
        recv_src_token=torch.zeros(num_local, num_slots, dtype=torch.int32),
        recv_topk_slot=torch.zeros(num_local, num_slots, dtype=torch.int32),
        recv_layout="compact",
        recv_src_info=torch.arange(num_local * num_slots, dtype=torch.int32).view(num_local, num_slots),
        recv_layout_range=torch.arange(num_local * num_ranks, dtype=torch.int64).view(num_local, num_ranks),
        received=True,
    )


def test_low_latency_handle_is_v1s_five_entry_tuple_carrying_the_core_handle():
    core = _ll_core_handle()
    handle = LowLatencyDispatchHandle(core)
    assert isinstance(handle, tuple) and len(handle) == 5 and handle.core is core
    assert handle[0] is core.recv_src_info and handle[1] is core.recv_layout_range
    assert handle[2:] == (LL_T, LL_H, LL_E) and handle[-1] == LL_E
    src_info, layout_range, cap, hidden, num_experts = handle  # V1 clients unpack it
    assert src_info is core.recv_src_info and layout_range is core.recv_layout_range
    assert (cap, hidden, num_experts) == (LL_T, LL_H, LL_E)
    assert list(handle)[2:] == [LL_T, LL_H, LL_E]
    with pytest.raises(IndexError):
        handle[5]
    duplicate = copy.copy(handle)
    assert isinstance(duplicate, LowLatencyDispatchHandle) and duplicate.core is core and duplicate[0] is handle[0]
    assert "tensor(" not in repr(handle) and "hidden=256" in repr(handle)


class _RecordingLowLatencyCore(SimpleNamespace):
    """Stands for deep_ep.ElasticBuffer (both the HT core built by Buffer.__init__ and the LL-only
    core built by the first low_latency_dispatch); records how the façade uses it. Its LL calls
    refuse sizes other than its own like the real core: after "taking part without data"."""

    built: list = []
    get_low_latency_size_hint = staticmethod(ElasticBuffer.get_low_latency_size_hint)

    def __init__(self, group=None, num_bytes=None, **kwargs) -> None:
        super().__init__(
            group=group,
            num_bytes=num_bytes,
            kwargs=kwargs,
            calls=[],
            num_max_dispatch_tokens_per_rank=kwargs.get("num_max_dispatch_tokens_per_rank", 0),
            hidden=kwargs.get("hidden", 0),
            num_experts=kwargs.get("num_experts", 0),
            num_ranks=group.size() if group is not None else 2,
            num_scaleup_ranks=2,
            num_scaleout_ranks=1,
            _window={"ht_bytes": 2 * MIB, "ht_offset": _C.WORKSPACE_BYTES},
            _max_num_sms=32,
            _max_ht_num_sms=32,
            stale=False,
            destroy_error=None,
        )
        _RecordingLowLatencyCore.built.append(self)

    def _ll_masked_ranks(self) -> list[int]:
        return []

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        self.calls.append(("low_latency_update_mask_buffer", rank_to_mask, mask))

    def _ensure_usable(self) -> None:
        pass

    def _check_fatal_errors(self, call: str | None = None) -> None:
        pass

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, **kwargs):
        self.calls.append(("low_latency_dispatch", num_max_dispatch_tokens_per_rank, num_experts, kwargs))
        if (num_max_dispatch_tokens_per_rank, x.shape[1], num_experts) != (
            self.num_max_dispatch_tokens_per_rank,
            self.hidden,
            self.num_experts,
        ):
            self.calls.append(("dispatch without input",))
            raise ValueError("num_max_dispatch_tokens_per_rank must equal the buffer's")
        sizing = (self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts)
        handle = _ll_core_handle(self.num_ranks, x.shape[0], sizing)
        hook = (lambda: None) if kwargs["return_recv_hook"] else None
        event = EventOverlap("recorded", extra_tensors=(x,)) if kwargs["async_finish"] else None
        return torch.zeros(1), handle.recv_count, handle, event, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **kwargs):
        self.calls.append(("low_latency_combine", handle, kwargs))
        if not isinstance(handle, LowLatencyHandle):
            self.calls.append(("combine without input",))
            raise TypeError(f"handle must be the LowLatencyHandle of a low_latency_dispatch, got {type(handle)}")
        return torch.zeros(handle.num_tokens, self.hidden), None, None

    def get_next_low_latency_combine_buffer(self, handle):
        self.calls.append(("get_next_low_latency_combine_buffer", handle))
        return torch.zeros(1)

    def _ll_check_outstanding(self, operation) -> None:
        self.calls.append(("check outstanding", operation))

    def _ll_check_handle(self, handle) -> None:
        self.calls.append(("check handle", handle))
        if self.stale:
            raise RuntimeError("handle is stale")

    def _ll_combine_without_input(self, handle, error) -> None:
        self.calls.append(("combine without input", handle, type(error).__name__))

    def destroy(self) -> None:
        self.calls.append(("destroy",))
        if self.destroy_error is not None:
            raise self.destroy_error


class _Group:
    def __init__(self, rank: int = 0, size: int = 2) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.fixture
def fake_cores(monkeypatch):
    """deep_ep.compat.buffer.ElasticBuffer replaced by the recorder; the group exchange answers with this
    rank's item for every rank unless a test sets ``peers`` (the items of the others, by rank)."""
    _RecordingLowLatencyCore.built = []
    monkeypatch.setattr(compat_buffer, "ElasticBuffer", _RecordingLowLatencyCore)
    monkeypatch.setattr(compat_buffer, "stream_capturing", lambda: False)
    state = SimpleNamespace(exchanged=[], peers=None, built=_RecordingLowLatencyCore.built)

    def exchange(self, item):
        state.exchanged.append(item)
        if state.peers is None:
            return [item] * self.group_size
        return [item if other is None else other for other in state.peers]

    monkeypatch.setattr(Buffer, "_exchange_low_latency_setup", exchange)
    return state


def _ll_buffer(num_rdma_bytes: int | None = None, low_latency_mode: bool = True, num_nvl_bytes: int = 0) -> Buffer:
    if num_rdma_bytes is None:
        num_rdma_bytes = low_latency_window_bytes(LL_T, LL_H, 2, LL_E)
    return Buffer(_Group(), num_nvl_bytes, num_rdma_bytes, low_latency_mode=low_latency_mode, explicitly_destroy=True)


def _ll_inputs(num_tokens: int = 3, hidden: int = LL_H):
    return torch.zeros(num_tokens, hidden, dtype=torch.bfloat16), torch.zeros(num_tokens, 2, dtype=torch.int64)


def test_low_latency_mode_gives_num_rdma_bytes_to_the_ll_window(fake_cores):
    ht_only = _ll_buffer(num_rdma_bytes=6 * MIB, low_latency_mode=False, num_nvl_bytes=3 * MIB)
    assert ht_only._core.num_bytes == window_num_bytes(3 * MIB, 6 * MIB)  # pooled, as before
    buffer = _ll_buffer(num_rdma_bytes=6 * MIB, num_nvl_bytes=3 * MIB)
    assert buffer.low_latency_mode is True
    assert buffer._core.num_bytes == window_num_bytes(3 * MIB, 0)  # the HT window gets num_nvl_bytes only
    assert buffer._ll_core is None and buffer.low_latency_sizing is None  # built by the first LL dispatch
    assert fake_cores.exchanged == []


def test_ll_window_need_is_the_v1_size_hint():
    assert low_latency_window_bytes(128, 7168, 8, 288) == Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 288)
    assert low_latency_window_bytes(LL_T, LL_H, 2, LL_E) > _C.WORKSPACE_BYTES


def test_first_low_latency_dispatch_builds_the_ll_core_from_its_sizes(fake_cores):
    buffer = _ll_buffer()
    x, topk_idx = _ll_inputs()
    stats, wait = torch.zeros(LL_E // 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E, stats, wait)
    assert fake_cores.exchanged == [((LL_T, LL_H, LL_E), None)]
    ht_core, ll_core = fake_cores.built
    assert buffer._ll_core is ll_core and buffer.low_latency_sizing == (LL_T, LL_H, LL_E)
    assert ll_core.group is buffer.group and ll_core.num_bytes is None  # exactly the LL need
    assert ll_core.kwargs == {
        "num_max_dispatch_tokens_per_rank": LL_T,
        "hidden": LL_H,
        "num_experts": LL_E,
        "explicitly_destroy": True,
        "enable_rank_masking": False,
    }
    (call,) = ll_core.calls
    assert call[:3] == ("low_latency_dispatch", LL_T, LL_E)
    assert call[3] == {
        "cumulative_local_expert_recv_stats": stats,
        "dispatch_wait_recv_cost_stats": wait,
        "use_fp8": True,
        "round_scale": False,
        "use_ue8m0": False,
        "use_tma_aligned_col_major_sf": True,
        "recv_layout": "compact",
        "async_finish": False,
        "return_recv_hook": False,
    }
    assert isinstance(handle, LowLatencyDispatchHandle) and handle[0] is handle.core.recv_src_info
    assert recv_count is handle.core.recv_count
    assert isinstance(event, EventOverlap) and event.event is None and hook is None  # V1: EventOverlap(None)

    # Later calls reuse the core (no exchange) and pass the options through.
    _, _, _, event, hook = buffer.low_latency_dispatch(
        x, topk_idx, LL_T, LL_E, use_fp8=False, round_scale=True, use_ue8m0=True, return_recv_hook=True
    )
    assert len(fake_cores.exchanged) == 1 and len(fake_cores.built) == 2
    options = ll_core.calls[-1][3]
    assert options["use_fp8"] is False and options["round_scale"] is True and options["use_ue8m0"] is True
    assert options["return_recv_hook"] is True and callable(hook) and event.event is None
    _, _, _, event, _ = buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E, async_finish=True)
    assert event.event == "recorded"  # the core's own event (with its tensors) is returned as is


def test_too_small_num_rdma_bytes_raises_naming_the_bytes_on_every_rank(fake_cores):
    budget = low_latency_window_bytes(LL_T, LL_H, 2, LL_E)
    big = 4096
    needed = low_latency_window_bytes(big, LL_H, 2, LL_E)
    assert needed > budget
    buffer = _ll_buffer(num_rdma_bytes=budget)
    x, topk_idx = _ll_inputs()
    with pytest.raises(BufferTooSmallError, match=f"num_rdma_bytes >= {needed}") as info:
        buffer.low_latency_dispatch(x, topk_idx, big, LL_E)
    assert info.value.needed_bytes == needed and info.value.available_bytes == budget
    assert f"get_low_latency_rdma_size_hint({big}, {LL_H}, 2, {LL_E})" in str(info.value)
    # The peers learnt of it through the exchange (they raise too); nothing was built.
    assert fake_cores.exchanged == [(None, ("BufferTooSmallError", str(info.value)))]
    assert len(fake_cores.built) == 1 and buffer._ll_core is None
    # The sizes the budget was computed for build the window at the next call.
    buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    assert buffer.low_latency_sizing == (LL_T, LL_H, LL_E)


def test_a_peer_failure_at_the_first_call_raises_peer_input_error(fake_cores):
    buffer = _ll_buffer()
    fake_cores.peers = [(None, ("BufferTooSmallError", "needs num_rdma_bytes >= 123")), None]
    x, topk_idx = _ll_inputs()
    with pytest.raises(PeerInputError, match=r"rank\(s\) \[0\].*needs num_rdma_bytes >= 123") as info:
        buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    assert info.value.rank == 0 and info.value.operation == "low_latency_dispatch"
    assert buffer._ll_core is None and len(fake_cores.built) == 1


def test_ranks_disagreeing_on_the_first_sizes_all_raise(fake_cores):
    buffer = _ll_buffer(num_rdma_bytes=1 << 30)
    fake_cores.peers = [None, ((LL_T, LL_H, 2 * LL_E), None)]
    x, topk_idx = _ll_inputs()
    with pytest.raises(ValueError, match="every rank must pass the same"):
        buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    assert buffer._ll_core is None


@pytest.mark.parametrize(
    "x, cap, num_experts, error, words",
    [
        ("not a tensor", LL_T, LL_E, TypeError, "x must be a tensor"),
        (torch.zeros(2, 3, LL_H), LL_T, LL_E, ValueError, r"x must be bfloat16 \[T, H\]"),
        (torch.zeros(2, LL_H), 0, LL_E, ValueError, "num_max_dispatch_tokens_per_rank must be an int >= 1"),
        (torch.zeros(2, LL_H), LL_T, True, ValueError, "num_experts must be an int >= 1"),
        (torch.zeros(2, 200), LL_T, LL_E, ValueError, "multiple of 128"),
        (torch.zeros(2, LL_H), LL_T, 7, ValueError, "multiple of num_ranks"),
    ],
)
def test_first_call_arguments_that_cannot_size_a_window_are_refused_after_the_exchange(
    fake_cores, x, cap, num_experts, error, words
):
    buffer = _ll_buffer()
    with pytest.raises(error, match=words):
        buffer.low_latency_dispatch(x, torch.zeros(2, 2, dtype=torch.int64), cap, num_experts)
    ((sizing, report),) = fake_cores.exchanged
    assert sizing is None and report[0] == error.__name__
    assert buffer._ll_core is None


def test_first_call_inside_graph_capture_raises_before_anything(fake_cores, monkeypatch):
    buffer = _ll_buffer()
    monkeypatch.setattr(compat_buffer, "stream_capturing", lambda: True)
    x, topk_idx = _ll_inputs()
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    assert fake_cores.exchanged == [] and buffer._ll_core is None
    monkeypatch.setattr(compat_buffer, "stream_capturing", lambda: False)
    buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    monkeypatch.setattr(compat_buffer, "stream_capturing", lambda: True)
    buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)  # once built, LL calls may be captured


@pytest.mark.parametrize(
    "cap, hidden, num_experts", [(LL_T + 1, LL_H, LL_E), (LL_T, 2 * LL_H, LL_E), (LL_T, LL_H, 2 * LL_E)]
)
def test_later_call_with_other_sizes_raises_naming_both_after_the_core_took_part(fake_cores, cap, hidden, num_experts):
    buffer = _ll_buffer(num_rdma_bytes=1 << 30)
    x, topk_idx = _ll_inputs()
    buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    x_other, _ = _ll_inputs(hidden=hidden)
    with pytest.raises(ValueError) as info:
        buffer.low_latency_dispatch(x_other, topk_idx, cap, num_experts)
    message = str(info.value)
    assert f"num_max_dispatch_tokens_per_rank={cap}, hidden={hidden}, num_experts={num_experts}" in message
    assert f"num_max_dispatch_tokens_per_rank={LL_T}, hidden={LL_H}, num_experts={LL_E}" in message
    assert isinstance(info.value.__cause__, ValueError)  # the core's refusal
    ll_core = buffer._ll_core
    assert [call[0] for call in ll_core.calls] == ["low_latency_dispatch"] * 2 + ["dispatch without input"]
    assert len(fake_cores.exchanged) == 1


@pytest.mark.parametrize(
    "name, args",
    [
        ("low_latency_dispatch", (torch.zeros(1, LL_H), torch.zeros(1, 1, dtype=torch.int64), LL_T, LL_E)),
        ("low_latency_combine", (None, None, None, None)),
        ("get_next_low_latency_combine_buffer", (None,)),
        ("clean_low_latency_buffer", (LL_T, LL_H, LL_E)),
    ],
)
def test_low_latency_calls_need_low_latency_mode(fake_cores, name, args):
    buffer = _ll_buffer(low_latency_mode=False)
    with pytest.raises(RuntimeError, match="low_latency_mode=True"):
        getattr(buffer, name)(*args)
    assert fake_cores.exchanged == [] and len(fake_cores.built) == 1


def test_combine_and_next_buffer_need_a_dispatch_first(fake_cores):
    buffer = _ll_buffer()
    handle = LowLatencyDispatchHandle(_ll_core_handle())
    with pytest.raises(RuntimeError, match="no low_latency_dispatch ran"):
        buffer.low_latency_combine(torch.zeros(1), None, None, handle)
    with pytest.raises(RuntimeError, match="no low_latency_dispatch ran"):
        buffer.get_next_low_latency_combine_buffer(handle)


def test_combine_passes_the_core_handle_and_options_through(fake_cores):
    buffer = _ll_buffer()
    x, topk_idx = _ll_inputs()
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    y, weights, out, wait = torch.zeros(1), torch.zeros(3, 2), torch.zeros(3, LL_H), torch.zeros(2, dtype=torch.int64)
    combined, event, hook = buffer.low_latency_combine(
        y, topk_idx, weights, handle, zero_copy=True, out=out, combine_wait_recv_cost_stats=wait
    )
    name, core_handle, options = buffer._ll_core.calls[-1]
    assert name == "low_latency_combine" and core_handle is handle.core
    assert options == {
        "zero_copy": True,
        "async_finish": False,
        "return_recv_hook": False,
        "out": out,
        "combine_wait_recv_cost_stats": wait,
    }
    assert combined.shape == (3, LL_H) and isinstance(event, EventOverlap) and event.event is None and hook is None
    assert buffer.get_next_low_latency_combine_buffer(handle) is not None
    assert buffer._ll_core.calls[-1] == ("get_next_low_latency_combine_buffer", handle.core)
    with pytest.raises(TypeError, match="handle must be the handle Buffer.low_latency_dispatch returned"):
        buffer.get_next_low_latency_combine_buffer(tuple(handle))


def test_combine_with_a_foreign_handle_raises_type_error_after_the_core_took_part(fake_cores):
    buffer = _ll_buffer()
    x, topk_idx = _ll_inputs()
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    with pytest.raises(TypeError, match="got tuple") as info:
        buffer.low_latency_combine(torch.zeros(1), topk_idx, torch.zeros(3, 2), tuple(handle))
    assert isinstance(info.value.__cause__, TypeError)
    assert buffer._ll_core.calls[-1] == ("combine without input",)


@pytest.mark.parametrize("stale", [False, True])
def test_use_logfmt_is_refused_after_taking_part_without_data(fake_cores, stale):
    buffer = _ll_buffer()
    x, topk_idx = _ll_inputs()
    _, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    ll_core = buffer._ll_core
    ll_core.stale = stale
    with pytest.raises(NotImplementedError, match="use_logfmt=True"):
        buffer.low_latency_combine(torch.zeros(1), topk_idx, torch.zeros(3, 2), handle, use_logfmt=True)
    calls = ll_core.calls[1:]
    assert calls[:2] == [("check outstanding", "low_latency_combine"), ("check handle", handle.core)]
    # Zero rows for what the handle received when it is usable, none when it is not (as the core does).
    assert calls[2] == ("combine without input", None if stale else handle.core, "NotImplementedError")
    assert len(calls) == 3  # the combine itself never ran


def test_clean_low_latency_buffer_builds_the_window_once_then_only_checks_its_arguments(fake_cores):
    buffer = _ll_buffer()
    with pytest.raises(ValueError, match="hidden must be an int >= 1"):
        buffer.clean_low_latency_buffer(LL_T, 0, LL_E)
    assert buffer._ll_core is None and not fake_cores.exchanged  # refused before any communication
    assert buffer.clean_low_latency_buffer(LL_T, LL_H, LL_E) is None  # builds the window (collective)
    assert buffer._ll_core is not None and buffer.low_latency_sizing == (LL_T, LL_H, LL_E)
    assert len(fake_cores.exchanged) == 1
    x, topk_idx = _ll_inputs()
    buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)  # uses the window clean built
    calls = list(buffer._ll_core.calls)
    assert buffer.clean_low_latency_buffer(LL_T, LL_H, LL_E) is None
    with pytest.raises(ValueError, match=rf"num_experts=16\) differs .* num_experts={LL_E}"):
        buffer.clean_low_latency_buffer(LL_T, LL_H, 2 * LL_E)
    assert buffer._ll_core.calls == calls and len(fake_cores.exchanged) == 1  # no more communication


def test_rdma_buffer_view_needs_the_ll_window(fake_cores):
    buffer = _ll_buffer()
    with pytest.raises(RuntimeError, match="first low_latency_dispatch builds"):
        buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)


def test_destroy_destroys_both_cores_even_when_the_first_fails(fake_cores):
    buffer = _ll_buffer()
    x, topk_idx = _ll_inputs()
    buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    ht_core, ll_core = buffer._core, buffer._ll_core
    ll_core.destroy_error = RuntimeError("peer gone")
    with pytest.raises(RuntimeError, match="peer gone"):
        buffer.destroy()
    assert ll_core.calls[-1] == ("destroy",) and ht_core.calls == [("destroy",)]
    assert buffer._core is None and buffer._ll_core is None
    buffer.destroy()  # once only
    assert ht_core.calls == [("destroy",)]
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)


def test_the_first_call_exchanges_over_a_one_rank_gloo_group(tmp_path, monkeypatch):
    import torch.distributed as dist

    _RecordingLowLatencyCore.built = []
    monkeypatch.setattr(compat_buffer, "ElasticBuffer", _RecordingLowLatencyCore)
    monkeypatch.setattr(compat_buffer, "stream_capturing", lambda: False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        buffer = Buffer(dist.group.WORLD, 0, low_latency_window_bytes(LL_T, LL_H, 1, LL_E), low_latency_mode=True)
        x, topk_idx = _ll_inputs()
        buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
        assert buffer.low_latency_sizing == (LL_T, LL_H, LL_E)
    finally:
        dist.destroy_process_group()


def test_masks_set_before_the_first_low_latency_call_are_applied_to_the_window_it_builds(fake_cores):
    buffer = Buffer(
        _Group(),
        0,
        low_latency_window_bytes(LL_T, LL_H, 2, LL_E),
        low_latency_mode=True,
        explicitly_destroy=True,
        enable_shrink=True,
    )
    buffer.low_latency_update_mask_buffer(1, True)
    x, topk_idx = _ll_inputs()
    buffer.low_latency_dispatch(x, topk_idx, LL_T, LL_E)
    ll_core = buffer._ll_core
    assert ll_core.kwargs["enable_rank_masking"] is True
    assert ll_core.calls[0] == ("low_latency_update_mask_buffer", 1, True)
    assert ll_core.calls[1][0] == "low_latency_dispatch"
    buffer.low_latency_update_mask_buffer(1, False)  # now straight to the window's mask
    assert ll_core.calls[-1] == ("low_latency_update_mask_buffer", 1, False)


def test_tensors_allocated_on_the_comm_stream_are_handed_over_unless_capturing(monkeypatch):
    # Streams without a device: the two streams are stand-ins, the tensors record what they get.
    streams = object.__new__(compat_streams.Streams)
    streams.compute, streams.comm = object(), object()
    streams.alloc = streams.work = streams.comm
    handed = []
    streams.allocated = [SimpleNamespace(record_stream=handed.append)]
    monkeypatch.setattr(compat_streams, "stream_capturing", lambda: True)
    streams.hand_over()
    assert handed == []  # record_stream is not allowed inside capture
    monkeypatch.setattr(compat_streams, "stream_capturing", lambda: False)
    streams.hand_over()
    assert handed == [streams.compute]
