"""EPHandle: the stats view, DeepEP V2's recv_src_metadata and the tensors it keeps alive (no GPU needed)."""

import dataclasses

import pytest
import torch

from deep_ep.handle import EPHandle
from deep_ep.high_throughput import HighThroughputMixin, counts_field_sizes, counts_layout


def _handle(do_expand: bool) -> EPHandle:
    counts = torch.arange(20, dtype=torch.int32)
    return EPHandle(
        do_expand=do_expand,
        num_experts=8,
        expert_alignment=1,
        num_max_tokens_per_rank=16,
        num_sms=4,
        topk_idx=torch.zeros(3, 2, dtype=torch.int64),
        num_recv_tokens=5,
        num_expanded_tokens=6,
        num_recv_tokens_per_expert_list=[2, 4, 0, 0],
        psum_num_recv_tokens_per_source=counts[2:4],
        psum_num_recv_tokens_per_expert=counts[16:20],
        num_unaligned_recv_tokens_per_expert=counts[8:12],
        recv_src_info=torch.zeros(5, 4, dtype=torch.int32),
        dst_buffer_slot_idx=torch.zeros(3, 2, dtype=torch.int32),
        num_ranks=2,
        num_tokens=3,
        num_topk=2,
        is_exact=True,
        expert_slot_idx=torch.zeros(3, 2, dtype=torch.int32),
        num_recv_tokens_per_scaleup_rank=counts[0:2],
        expert_offsets_per_source=counts[4:8].view(2, 2),
        expert_start=counts[12:16],
        recv_expanded_row_idx=torch.zeros(5, 2, dtype=torch.int32) if do_expand else None,
        counts=counts,
    )


def test_stats_are_the_per_source_and_per_expert_count_views():
    handle = _handle(do_expand=False)
    assert handle.stats["tokens_per_source_rank"].tolist() == [0, 1]
    assert handle.stats["tokens_per_local_expert"].tolist() == [8, 9, 10, 11]
    assert handle.num_local_experts == 4


def test_tensors_lists_every_owned_device_tensor_once():
    plain, expanded = _handle(do_expand=False), _handle(do_expand=True)
    assert len(plain.tensors()) == 5
    assert len(expanded.tensors()) == 6
    assert any(tensor is expanded.recv_expanded_row_idx for tensor in expanded.tensors())


# One destination rank of a hand-worked dispatch: R = 2 ranks, E = 4 experts (rank 1 holds 2 and 3),
# K = 3, T_max = 4, expert_alignment 4. Rank 1 receives, in (source rank, source token) order:
#   source 0 token 0, experts [1, 2, 0]: ranks {0, 1}, j = 1, master lane 1 (expert 2)
#   source 0 token 1, experts [3, -1, 2]: ranks {1}, j = 0, master lane 0 (lane 2 is local too)
#   source 0 token 2, experts [-1, 0, 3]: ranks {0, 1}, j = 1, master lane 2
#   source 1 token 0, experts [2, 3, 1]: ranks {0, 1}, j = 1, master lane 0 (lane 1 is local too)
# Expand rows: expert 2 (local 0) gets rows 0, 1, 2 for received rows 0, 1, 3; expert 3 (local 1)
# starts at align(3, 4) = 4 with received rows 1, 2, 3.
HAND_SRC_INFO = [[0, 0, 1, 1], [0, 1, 0, 0], [0, 2, 1, 2], [1, 0, 1, 0]]
HAND_EXPANDED_ROWS = [[-1, 0, -1], [4, -1, 1], [-1, -1, 5], [2, 6, -1]]
# Columns: s * T_max + t, s * K + master lane, then the expanded row of each lane (-1 without expand).
HAND_V2_NON_EXPAND = [[0, 1, -1, -1, -1], [1, 0, -1, -1, -1], [2, 2, -1, -1, -1], [4, 3, -1, -1, -1]]
HAND_V2_EXPAND = [[0, 1, -1, 0, -1], [1, 0, 4, -1, 1], [2, 2, -1, -1, 5], [4, 3, 2, 6, -1]]


def _hand_worked_handle(do_expand: bool) -> EPHandle:
    return dataclasses.replace(
        _handle(do_expand),
        num_experts=4,
        num_max_tokens_per_rank=4,
        num_recv_tokens=4,
        num_topk=3,
        recv_src_info=torch.tensor(HAND_SRC_INFO, dtype=torch.int32),
        recv_expanded_row_idx=torch.tensor(HAND_EXPANDED_ROWS, dtype=torch.int32) if do_expand else None,
    )


@pytest.mark.parametrize(("do_expand", "expected"), [(False, HAND_V2_NON_EXPAND), (True, HAND_V2_EXPAND)])
def test_recv_src_metadata_has_deepep_v2_layout(do_expand, expected):
    metadata = _hand_worked_handle(do_expand).recv_src_metadata
    assert metadata.dtype == torch.int32 and metadata.shape == (4, 3 + 2)
    assert metadata.tolist() == expected


def test_recv_src_metadata_is_built_once_and_rebuilt_for_new_source_info():
    handle = _hand_worked_handle(do_expand=False)
    first = handle.recv_src_metadata
    assert handle.recv_src_metadata is first
    assert all(tensor is not first for tensor in handle.tensors())  # a view for the caller, not kernel input
    # A copy (as V1's num_worst_tokens handle is) and a replaced recv_src_info get their own.
    narrowed = dataclasses.replace(handle, recv_src_info=handle.recv_src_info.narrow(0, 0, 2))
    assert narrowed.recv_src_metadata.tolist() == HAND_V2_NON_EXPAND[:2]
    handle.recv_src_info = torch.tensor([[1, 3, 0, 2]], dtype=torch.int32)
    assert handle.recv_src_metadata.tolist() == [[7, 5, -1, -1, -1]]


@pytest.mark.parametrize("do_expand", [False, True])
def test_assigning_recv_src_metadata_rows_rebuilds_what_combine_reads(do_expand):
    # DeepEP V2's no-CPU-sync flow: handle.recv_src_metadata = handle.recv_src_metadata[:n].
    handle = _hand_worked_handle(do_expand)
    expected = HAND_V2_EXPAND if do_expand else HAND_V2_NON_EXPAND
    first_rows = handle.recv_src_metadata[:3].clone()
    handle.recv_src_info = torch.zeros_like(handle.recv_src_info)  # forget the record: rebuilt from the rows
    if do_expand:
        handle.recv_expanded_row_idx = torch.full_like(handle.recv_expanded_row_idx, -9)
    handle.recv_src_metadata = first_rows
    assert handle.recv_src_metadata is first_rows
    assert handle.recv_src_metadata.tolist() == expected[:3]
    # Source rank, source token and master lane come back; combine's slot j (column 2) is kept.
    rebuilt = handle.recv_src_info.tolist()
    assert [row[:2] + row[3:] for row in rebuilt[:3]] == [row[:2] + row[3:] for row in HAND_SRC_INFO[:3]]
    assert rebuilt[3] == [0, 0, 0, 0] and [row[2] for row in rebuilt] == [0, 0, 0, 0]
    if do_expand:
        assert handle.recv_expanded_row_idx.tolist()[:3] == HAND_EXPANDED_ROWS[:3]
        assert handle.recv_expanded_row_idx.tolist()[3] == [-9, -9, -9]


def test_assigned_recv_src_metadata_must_fit_the_record():
    handle = _hand_worked_handle(do_expand=False)
    with pytest.raises(ValueError, match=r"int32 \[n, 5\] with n <= 4.*got int32 \[5, 5\]"):
        handle.recv_src_metadata = torch.zeros(5, 5, dtype=torch.int32)
    with pytest.raises(ValueError, match="got int64"):
        handle.recv_src_metadata = torch.zeros(4, 5, dtype=torch.int64)
    with pytest.raises(TypeError):
        dataclasses.replace(handle, recv_src_metadata=torch.zeros(4, 5, dtype=torch.int32))


class _FakeHighThroughputBuffer(HighThroughputMixin):
    """What ElasticBuffer gives the HT mixin before combine's first check; no runtime, no GPU."""

    def __init__(self, serial: int) -> None:
        self._serial = serial
        self.device = 0
        self._torch_device = torch.device("cuda", 0)

    def _ensure_usable(self) -> None:
        pass

    def _check_fatal_errors(self, call: str | None = None) -> None:
        pass


def test_combine_refuses_a_handle_of_another_buffer_before_touching_tensors():
    mine, other = _FakeHighThroughputBuffer(serial=1), _FakeHighThroughputBuffer(serial=2)
    handle = _handle(do_expand=False)
    handle.owner_id = other._serial
    x = torch.zeros(5, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="handle comes from a dispatch of another buffer"):
        mine.combine(x, handle)
    with pytest.raises(TypeError, match="handle must be the EPHandle"):
        mine.combine(x, object())
    # The owner gets past the check and on to the tensor checks (a CPU tensor is refused there).
    with pytest.raises(ValueError, match="must be on this buffer's device"):
        other.combine(x, handle)


@pytest.mark.parametrize(("num_ranks", "num_local"), [(1, 1), (2, 128), (8, 32), (64, 4)])
def test_handle_counts_fields_are_packed_back_to_back(num_ranks, num_local):
    # dispatch splits one allocation into these views, in this order.
    sizes = counts_field_sizes(num_ranks, num_local)
    ranks, local = num_ranks, num_local
    assert sizes == (ranks, ranks, ranks * local, local, local, local)
    assert sum(sizes) == counts_layout(num_ranks, num_local)["total"]


# --------------------------------------------------------------------------- fp8 input scales


class _HostTensorBuffer(_FakeHighThroughputBuffer):
    """Takes CPU tensors where the buffer takes device tensors (the checks below are about dtypes,
    shapes and strides only)."""

    def _check_tensor(self, name, tensor, device, any_strides=False):
        if not any_strides and not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def _fp8(num_tokens: int, hidden: int) -> torch.Tensor:
    return torch.zeros(num_tokens, hidden, dtype=torch.float8_e4m3fn)


def test_dispatch_takes_fp8_scales_of_any_strides_and_packed_ue8m0_words():
    buffer = _HostTensorBuffer(serial=1)
    device = buffer._torch_device
    data = _fp8(6, 1024)
    column_major = torch.ones(8, 6).t()  # fp32 [T, H/128] with strides (1, T)
    assert buffer._check_dispatch_x((data, column_major), device)[1] is column_major
    packed = torch.zeros(6, 2, dtype=torch.int32)  # [T, H/512]: four UE8M0 bytes per word
    assert buffer._check_dispatch_x((data, packed), device)[1] is packed


@pytest.mark.parametrize(
    ("hidden", "scales"),
    [
        (1024, torch.zeros(6, 8, dtype=torch.int32)),  # int32 must be packed: [T, H/512]
        (384, torch.zeros(6, 3, dtype=torch.int32)),  # H % 512 != 0 cannot be packed four groups a word
        (1024, torch.zeros(6, 8, dtype=torch.float16)),
        (1024, torch.zeros(6, 2)),  # fp32 must be [T, H/128]
    ],
    ids=["int32-unpacked-shape", "int32-H-384", "fp16", "fp32-packed-shape"],
)
def test_dispatch_refuses_other_scale_formats_naming_both_accepted_ones(hidden, scales):
    buffer = _HostTensorBuffer(serial=1)
    with pytest.raises(ValueError, match=r"float32 \[T, H/128\] or, with H % 512 == 0, int32 \[T, H/512\]"):
        buffer._check_dispatch_x((_fp8(6, hidden), scales), buffer._torch_device)


def test_a_cpu_synced_dispatch_refuses_cuda_graph_capture_before_launching(monkeypatch):
    import deep_ep.high_throughput

    monkeypatch.setattr(deep_ep.high_throughput, "stream_capturing", lambda: True)
    buffer = _FakeHighThroughputBuffer(serial=1)  # no runtime: a launch would fail with AttributeError
    x = torch.zeros(4, 128, dtype=torch.bfloat16)
    topk_idx = torch.zeros(4, 2, dtype=torch.int64)
    for do_cpu_sync in (None, True):
        with pytest.raises(RuntimeError, match=r"do_cpu_sync=True \(the default\) cannot be captured in a CUDA graph"):
            buffer.dispatch(x, topk_idx, num_experts=8, do_cpu_sync=do_cpu_sync)
    # Without the CPU sync the call gets past the capture check (the fake then fails elsewhere).
    with pytest.raises(Exception) as later:  # noqa: PT011 - any failure past the check will do
        buffer.dispatch(x, topk_idx, num_experts=8, do_cpu_sync=False)
    assert "CUDA graph" not in str(later.value)
