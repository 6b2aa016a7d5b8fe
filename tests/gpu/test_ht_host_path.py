"""The C++ host path of HT dispatch (uncached and cached) and combine
(csrc/python/bind_ht_host_path.cpp): taken for the everyday arguments, bitwise the same results and
handle as the Python path, and left to the Python path (nothing launched twice) for an argument it
does not take; its outputs are torch's caching allocator's memory, as torch.empty's are, and go
through at::empty where that does more than allocate."""

from __future__ import annotations

import gc

import torch
from ht_checks import (
    Case,
    assert_bitwise_equal,
    assert_outputs_equal,
    dispatch_case,
    expert_output,
    group_inputs,
    make_buffer,
)
from torch.utils._python_dispatch import TorchDispatchMode

from deep_ep.testing import launch

CASES = (
    Case("fp8 H2048 K8 E64", 2048, 8, 64, 512, True, seed=41),
    Case("bf16 H2048 K6 E64 expand a64", 2048, 6, 64, 384, False, do_expand=True, expert_alignment=64, seed=42),
)


def assert_same_handle(name: str, got, want) -> None:
    """The two handles describe the same routing: sizes, counts and every per-row array."""
    for field in ("num_recv_tokens", "num_expanded_tokens", "num_recv_tokens_per_expert_list", "is_exact", "num_sms"):
        assert getattr(got, field) == getattr(want, field), f"{name}: handle.{field}"
    for field in ("topk_idx", "counts", "dst_buffer_slot_idx", "expert_slot_idx"):
        assert_bitwise_equal(f"{name}: handle.{field}", getattr(got, field), getattr(want, field))
    rows = want.num_recv_tokens if want.is_exact else int(want.psum_num_recv_tokens_per_scaleup_rank[-1])
    assert_bitwise_equal(f"{name}: handle.recv_src_info", got.recv_src_info[:rows], want.recv_src_info[:rows])
    if want.recv_expanded_row_idx is not None:
        assert_bitwise_equal(
            f"{name}: handle.recv_expanded_row_idx",
            got.recv_expanded_row_idx[:rows],
            want.recv_expanded_row_idx[:rows],
        )


def _host_path_equals_python_path(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=512, hidden=2048)
    host_path = buffer._ht_host_path
    assert host_path is not None, "the C++ host path is on by default"
    try:
        for case in CASES:
            inputs = group_inputs(case, num_ranks)
            buffer._ht_host_path = None  # what EP_HT_HOST_PATH=0 does
            try:
                synced = dispatch_case(buffer, rank, case, inputs)  # the Python path
                unsynced = dispatch_case(buffer, rank, case, inputs, do_cpu_sync=False)
            finally:
                buffer._ht_host_path = host_path
            handle = synced[3]
            y = expert_output(synced[0], rank, True)
            # num_sms=0: the host path takes the estimate once the Python code computed it with the
            # host path on (above it was off); any call of the estimate with the default rates does.
            buffer.get_theoretical_num_sms(case.experts(num_ranks), case.topk(num_ranks))

            calls = host_path.num_calls
            fast_synced = dispatch_case(buffer, rank, case, inputs)
            fast_unsynced = dispatch_case(buffer, rank, case, inputs, do_cpu_sync=False)
            assert host_path.num_calls == calls + 2, f"{case.name}: the uncached dispatch did not take the host path"
            assert_outputs_equal(f"{case.name}: uncached, host path against the Python path", fast_synced, synced)
            valid_rows = handle.num_expanded_tokens if case.do_expand else handle.num_recv_tokens
            assert_outputs_equal(
                f"{case.name}: no CPU sync, host path against the Python path", fast_unsynced, unsynced, valid_rows
            )
            assert_same_handle(f"{case.name}: uncached", fast_synced[3], handle)
            assert_same_handle(f"{case.name}: no CPU sync", fast_unsynced[3], unsynced[3])
            # The host path's handle serves combine and cached dispatch like the Python path's.
            handle = fast_synced[3]

            calls = host_path.num_calls
            fast = dispatch_case(buffer, rank, case, inputs, handle=handle)
            assert host_path.num_calls == calls + 1, f"{case.name}: the cached dispatch did not take the host path"
            fast_combined = buffer.combine(y, handle, topk_weights=synced[2])
            assert host_path.num_calls == calls + 2, f"{case.name}: the combine did not take the host path"

            buffer._ht_host_path = None  # what EP_HT_HOST_PATH=0 does
            try:
                slow = dispatch_case(buffer, rank, case, inputs, handle=handle)
                slow_combined = buffer.combine(y, handle, topk_weights=synced[2])
            finally:
                buffer._ht_host_path = host_path
            assert_outputs_equal(f"{case.name}: host path against the Python path", fast, slow)
            assert_outputs_equal(f"{case.name}: host path against the uncached dispatch", fast, synced)
            assert fast[3] is handle and fast[4].event is None
            assert_bitwise_equal(f"{case.name}: combine", fast_combined[0], slow_combined[0])
            assert_bitwise_equal(f"{case.name}: combine weights", fast_combined[1], slow_combined[1])

            if case.use_fp8:
                # Column-major scales (a TMA-aligned quantiser's): the host path declines before it
                # launches anything and the Python path copies them; the result is the same.
                data, scales = inputs.xs[rank]
                column_major = scales.t().contiguous().t()
                calls = host_path.num_calls
                weights = None if inputs.weights is None else inputs.weights[rank]
                declined = buffer.dispatch((data, column_major), topk_weights=weights, handle=handle)
                # (With fewer than two tokens the transposed copy is contiguous again: host path.)
                expected_calls = calls + (1 if column_major.is_contiguous() else 0)
                assert host_path.num_calls == expected_calls, f"{case.name}: strided scales must take the Python path"
                assert_outputs_equal(f"{case.name}: strided scales", declined, slow)
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    finally:
        buffer.destroy()


def test_host_path_equals_python_path(num_ranks):
    launch(_host_path_equals_python_path, num_ranks)


class _RecordedOps(TorchDispatchMode):
    """A Python dispatch mode that records the name of every op it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _live_blocks() -> dict[int, dict]:
    """The caching allocator's allocated blocks by address (with their recorded stacks, if any)."""
    return {
        block["address"]: block
        for segment in torch.cuda.memory_snapshot()
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }


def _describe_blocks(blocks: dict[int, dict], known: dict[int, dict]) -> list[str]:
    """The blocks not in ``known``: size and the innermost recorded frames."""
    described = []
    for address, block in blocks.items():
        if address in known:
            continue
        frames = [f"{frame['filename']}:{frame['line']} {frame['name']}" for frame in block.get("frames", [])[:6]]
        described.append(f"{block['size']} B (requested {block.get('requested_size')}) at {frames}")
    return described


def _host_path_outputs_are_torch_allocations(rank, num_ranks, group):
    case = Case("bf16 H2048 K6 E64", 2048, 6, 64, 384, False, seed=43)
    buffer = make_buffer(group, num_max_tokens_per_rank=512, hidden=2048)
    host_path = buffer._ht_host_path
    try:
        inputs = group_inputs(case, num_ranks)
        buffer.get_theoretical_num_sms(case.experts(num_ranks), case.topk(num_ranks))
        warm = dispatch_case(buffer, rank, case, inputs)  # the allocator's pool warmed up
        buffer.combine(expert_output(warm[0], rank, True), warm[3], topk_weights=warm[2])
        del warm
        torch.cuda.synchronize()
        # Every allocation from here on is recorded with its Python stack, so a block that outlives
        # its outputs can be named.
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python")
        blocks_before = _live_blocks()
        before = torch.cuda.memory_allocated()

        # The outputs and the handle's arrays are the caching allocator's blocks, counted while they
        # live and returned when the last reference goes (the host path builds them without at::empty).
        calls = host_path.num_calls
        recv_x, recv_topk_idx, recv_topk_weights, handle, _ = dispatch_case(buffer, rank, case, inputs)
        combined_x, combined_weights, _ = buffer.combine(
            expert_output(recv_x, rank, True), handle, topk_weights=recv_topk_weights
        )
        assert host_path.num_calls == calls + 2, "dispatch and combine must take the host path"
        torch.cuda.synchronize()
        outputs = (recv_x, recv_topk_idx, recv_topk_weights, handle.recv_src_info, combined_x, combined_weights)
        # Each output has storage of its own, as torch.empty's: torch.library custom ops (deep_ep.ops)
        # refuse returns that share storage. (Empty outputs, e.g. the combine of a rank without
        # tokens, have no memory to share.)
        # (Only addresses and sizes are kept: a storage object would keep its memory allocated.)
        storages = [(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()) for tensor in outputs]
        storages = [storage for storage in storages if storage[1] > 0]
        assert len(dict(storages)) == len(storages), "host-path outputs share storage"
        held = sum(nbytes for _, nbytes in storages)
        assert torch.cuda.memory_allocated() >= before + held, "host-path outputs not counted by torch's allocator"
        assert all(tensor.device == recv_x.device and tensor.is_contiguous() for tensor in outputs)
        valid_rows = handle.num_recv_tokens
        del recv_x, recv_topk_idx, recv_topk_weights, handle, combined_x, combined_weights, outputs
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - before
        if left != 0:
            gc.collect()
            after_gc = torch.cuda.memory_allocated() - before
            new_blocks = _describe_blocks(_live_blocks(), blocks_before)
            raise AssertionError(
                f"host-path outputs not returned to torch's allocator: {left} bytes still allocated once they "
                f"were dropped ({after_gc} after gc.collect()); the outputs held {held} bytes; blocks allocated "
                f"since the first measure: {new_blocks}"
            )

        # torch's deterministic mode fills new memory (NaN for floats): the host path allocates
        # as torch.empty does there, so the rows a no-CPU-sync dispatch leaves unwritten are NaN.
        fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        try:
            calls = host_path.num_calls
            unsynced = dispatch_case(buffer, rank, case, inputs, do_cpu_sync=False)
            assert host_path.num_calls == calls + 1, "the no-CPU-sync dispatch must take the host path"
        finally:
            torch.use_deterministic_algorithms(False)
            torch.utils.deterministic.fill_uninitialized_memory = fill
        recv_x = unsynced[0]
        assert valid_rows < recv_x.shape[0], f"the case must leave rows unwritten ({valid_rows} of {recv_x.shape[0]})"
        assert bool(recv_x[valid_rows:].isnan().all()), "rows past the received ones must be torch's NaN fill"

        # Under a Python dispatch mode (memory trackers, debug modes) the host path allocates through
        # at::empty, so the mode sees every allocation, as it would torch.empty's: the notify block,
        # the source info and the three outputs of this bf16 dispatch with weights.
        with _RecordedOps() as recorded:
            calls = host_path.num_calls
            dispatch_case(buffer, rank, case, inputs)
            assert host_path.num_calls == calls + 1, "the dispatch under a dispatch mode must take the host path"
        empties = [op for op in recorded.ops if op.startswith("aten.empty")]
        assert len(empties) >= 5, f"a dispatch mode must see the host path's allocations, saw {recorded.ops}"
        buffer._check_device_errors()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        buffer.destroy()


def test_host_path_outputs_are_torch_allocations(num_ranks):
    launch(_host_path_outputs_are_torch_allocations, num_ranks)
