"""Soak: 10,000 interleaved HT and LL operations on one buffer leak neither memory nor file descriptors.

Deselected by default (``-m soak`` selects it; pyproject.toml). Each cycle issues six operations:
an uncached HT dispatch, an LL dispatch (its hook, when it has one, held across the next step),
the HT combine, the LL combine, a cached HT re-dispatch of other tokens and its combine. Inputs
come from small pools built once (four HT and three LL input sets, so the pairings rotate), with
their reference results computed once; every ~500 operations (and every cycle of the warm-up, so
the checks' own first-use costs fall before the baseline) a cycle is checked bitwise against them.

After a warm-up of a few hundred operations the test records, per rank, the bytes torch's caching
allocator has handed out (``torch.cuda.memory_allocated``), the device's free memory
(``torch.cuda.mem_get_info``, which also sees allocations outside torch: the runtime's own, IPC
mappings, NCCL) and the open file descriptors, and at the end requires no growth beyond:

- ``ALLOCATED_SLACK_BYTES`` (16 blocks of 512 B, the allocator's rounding unit): both readings come
  after a synchronize + ``empty_cache`` with the same live tensors, so they should be equal; the
  slack only absorbs a few small tensors kept lazily. A leak of one smallest block per 500
  operations already exceeds it.
- ``FREE_MEMORY_SLACK_PER_RANK`` (2 MiB, the driver's page and the caching allocator's smallest
  segment) times the ranks sharing this GPU (all of them read the same device): one page per rank
  for what the driver may map on its own (e.g. a kernel module loaded on first use).
- no file descriptor at all.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ht_checks import assert_bitwise_equal, make_buffer
from ll_calls import ll_expert_output
from test_fuzz import (
    HtMode,
    LlBatch,
    LlMode,
    Routing,
    call_hook,
    check_ht_combine,
    check_ht_dispatch,
    check_ll_dispatch,
    ht_combine_call,
    ht_dispatch_call,
    ht_reference,
    ll_combine_batch,
    ll_dispatch_batch,
    make_ht_inputs,
    make_ll_batches,
)

from deep_ep.testing import launch

pytestmark = pytest.mark.soak

NUM_OPS = 10_000
WARMUP_OPS = 400
SPOT_CHECK_EVERY = 500
OPS_PER_CYCLE = 6
SEED = 9_000
GPU_TIMEOUT_SECS = 60

MAX_TOKENS = 128
HIDDEN = 1024
MAX_TOPK = 8
LL_MAX_TOKENS = 64
NUM_EXPERTS = 32  # HT and LL; divisible by 1, 2, 4, 8, 16 and 32 ranks

ALLOCATED_SLACK_BYTES = 16 * 512
FREE_MEMORY_SLACK_PER_RANK = 2 << 20

ROUTING = Routing(minus_one_ratio=0.1, all_minus_one_tokens=1, hot_expert=None, hot_ratio=0.5)
HOT_ROUTING = Routing(minus_one_ratio=0.3, all_minus_one_tokens=4, hot_expert=5, hot_ratio=0.7)


def _ht_mode(use_fp8, do_expand, alignment, num_biases, with_weights, do_cpu_sync, streams, routing) -> HtMode:
    return HtMode(
        hidden=HIDDEN,
        num_topk=MAX_TOPK if use_fp8 else 6,
        num_experts=NUM_EXPERTS,
        num_max_tokens=MAX_TOKENS,
        use_fp8=use_fp8,
        do_expand=do_expand,
        expert_alignment=alignment,
        num_biases=num_biases,
        with_weights=with_weights,
        scale_outputs=True,
        cached=True,
        do_cpu_sync=do_cpu_sync,
        streams=streams,
        bad_ids=False,
        routing=routing,
    )


HT_MODES = [
    _ht_mode(False, False, 1, 1, True, True, "caller stream", ROUTING),
    _ht_mode(True, True, 8, 0, True, False, "comm alloc + previous_event", HOT_ROUTING),
    _ht_mode(False, True, 1, 2, False, True, "async", ROUTING),
    _ht_mode(True, False, 32, 0, True, False, "async + comm alloc + previous_event", HOT_ROUTING),
]
# dispatch_mode / combine_mode are set per cycle (LL_DISPATCH_MODES, LL_COMBINE_MODES).
LL_MODES = [
    LlMode(MAX_TOPK, True, "direct", "direct", False, False, False, ROUTING),
    LlMode(4, False, "direct", "direct", True, False, False, HOT_ROUTING),
    LlMode(1, True, "direct", "direct", False, False, False, ROUTING),
]
LL_DISPATCH_MODES = ("hook", "direct", "async")  # 'hook': received only after the HT combine
LL_COMBINE_MODES = ("direct", "hook")
# Every pairing of pool entries and LL modes (period 12) runs, checked, before the baseline.
CHECKED_WARMUP_CYCLES = 12


@dataclass
class HtCase:
    """One HT pool entry: this rank's inputs (first and cached dispatch) and their references."""

    mode: HtMode
    x: Any
    topk_idx: torch.Tensor
    weights: torch.Tensor | None
    cached_x: Any
    cached_weights: torch.Tensor | None
    bias: Any
    expected: Any  # HtExpected of the first dispatch
    cached_expected: Any  # HtExpected of the cached re-dispatch


def _ht_case(mode: HtMode, rank: int, num_ranks: int, seed: int) -> HtCase:
    inputs = make_ht_inputs(mode, num_ranks, seed)
    return HtCase(
        mode=mode,
        x=inputs.xs[rank],
        topk_idx=inputs.topk_idxs[rank],
        weights=None if inputs.weights is None else inputs.weights[rank],
        cached_x=inputs.cached_xs[rank],
        cached_weights=None if inputs.cached_weights is None else inputs.cached_weights[rank],
        bias=None if inputs.biases is None else inputs.biases[rank],
        expected=ht_reference(mode, inputs, rank, inputs.xs, inputs.weights),
        cached_expected=ht_reference(mode, inputs, rank, inputs.cached_xs, inputs.cached_weights),
    )


def _ll_case(mode: LlMode, rank: int, num_ranks: int, seed: int) -> LlBatch:
    (batch,) = make_ll_batches(
        mode, rank, num_ranks, seed, num_max_tokens=LL_MAX_TOKENS, hidden=HIDDEN, num_experts=NUM_EXPERTS
    )
    return batch


def _cycle(buffer: Any, rank: int, num_ranks: int, cycle: int, ht_cases: list, ll_cases: list, check: bool) -> None:
    """Six operations; with ``check`` every result is compared with the pool's reference."""
    ht = ht_cases[cycle % len(ht_cases)]
    ll_index = cycle % len(ll_cases)
    ll, ll_use_fp8 = ll_cases[ll_index], LL_MODES[ll_index].use_fp8
    ll_dispatch_mode = LL_DISPATCH_MODES[cycle % len(LL_DISPATCH_MODES)]
    ll_combine_mode = LL_COMBINE_MODES[cycle % len(LL_COMBINE_MODES)]
    ll_with_out = LL_MODES[ll_index].with_out

    outputs = ht_dispatch_call(buffer, ht.mode, ht.x, ht.topk_idx, ht.weights)
    if check:
        check_ht_dispatch(ht.mode, ht.expected.dispatch, outputs, num_ranks)
    recv_x, recv_count, ll_handle, ll_hook = ll_dispatch_batch(buffer, ll, ll_use_fp8, ll_dispatch_mode)
    combined = ht_combine_call(buffer, ht.mode, outputs, rank, ht.bias)
    if check:
        check_ht_combine(ht.expected.combined, *combined)
    call_hook(ll_hook)
    if check:
        check_ll_dispatch(ll.dispatch, recv_x, recv_count, ll_handle)
    y = ll_expert_output(recv_x, ll_use_fp8)
    ll_combined, ll_combine_hook = ll_combine_batch(buffer, y, ll, ll_handle, ll_combine_mode, ll_with_out)
    call_hook(ll_combine_hook)
    if check:
        assert_bitwise_equal("LL combined_x", ll_combined, ll.combined)
    cached = ht_dispatch_call(buffer, ht.mode, ht.cached_x, None, ht.cached_weights, handle=outputs[3])
    if check:
        check_ht_dispatch(ht.mode, ht.cached_expected.dispatch, cached, num_ranks)
    combined = ht_combine_call(buffer, ht.mode, cached, rank, ht.bias)
    if check:
        check_ht_combine(ht.cached_expected.combined, *combined)


@dataclass(frozen=True)
class Usage:
    allocated_bytes: int
    free_bytes: int
    open_fds: int


def _usage(group: Any) -> Usage:
    """This process's footprint with no work in flight. Device free memory is read while every rank
    is idle (between two barriers): ranks sharing the GPU all see the same device."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # also frees blocks whose stream uses were pending
    allocated = torch.cuda.memory_allocated()
    open_fds = len(os.listdir("/proc/self/fd"))
    dist.barrier(group=group)
    free, _ = torch.cuda.mem_get_info()
    dist.barrier(group=group)
    return Usage(allocated, free, open_fds)


def _soak(rank: int, num_ranks: int, group: Any) -> dict[str, int]:
    buffer = make_buffer(
        group,
        num_max_tokens_per_rank=MAX_TOKENS,
        hidden=HIDDEN,
        num_topk=MAX_TOPK,
        num_max_dispatch_tokens_per_rank=LL_MAX_TOKENS,
        num_experts=NUM_EXPERTS,
        num_gpu_timeout_secs=GPU_TIMEOUT_SECS,
    )
    try:
        ht_cases = [_ht_case(mode, rank, num_ranks, SEED + index) for index, mode in enumerate(HT_MODES)]
        ll_cases = [_ll_case(mode, rank, num_ranks, SEED + 100 + index) for index, mode in enumerate(LL_MODES)]
        baseline = None
        ops = cycle = 0
        while ops < NUM_OPS:
            crosses = (ops + OPS_PER_CYCLE) // SPOT_CHECK_EVERY != ops // SPOT_CHECK_EVERY
            check = cycle < CHECKED_WARMUP_CYCLES or crosses
            try:
                _cycle(buffer, rank, num_ranks, cycle, ht_cases, ll_cases, check)
            except Exception as error:
                ht_mode = HT_MODES[cycle % len(HT_MODES)]
                ll_mode = dataclasses.replace(
                    LL_MODES[cycle % len(LL_MODES)],
                    dispatch_mode=LL_DISPATCH_MODES[cycle % len(LL_DISPATCH_MODES)],
                    combine_mode=LL_COMBINE_MODES[cycle % len(LL_COMBINE_MODES)],
                )
                raise AssertionError(
                    f"cycle {cycle} (operations {ops}..{ops + OPS_PER_CYCLE - 1}), rank {rank} of {num_ranks}, "
                    f"seed {SEED}, HT {ht_mode}, LL {ll_mode}: {type(error).__name__}: {error}"
                ) from error
            ops += OPS_PER_CYCLE
            cycle += 1
            if baseline is None and ops >= WARMUP_OPS:
                baseline = _usage(group)
        final = _usage(group)
        buffer.check_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
        num_gpus = torch.cuda.device_count()
        return {
            "ops": ops,
            "allocated_growth": final.allocated_bytes - baseline.allocated_bytes,
            "free_memory_drop": baseline.free_bytes - final.free_bytes,
            "fd_growth": final.open_fds - baseline.open_fds,
            "ranks_on_this_gpu": len(range(rank % num_gpus, num_ranks, num_gpus)),
        }
    finally:
        buffer.destroy()


def test_ten_thousand_mixed_operations_leak_no_memory_and_no_file_descriptors(num_ranks):
    if NUM_EXPERTS % num_ranks != 0:
        pytest.skip(f"the soak uses {NUM_EXPERTS} experts, which {num_ranks} ranks do not divide")
    results = launch(_soak, num_ranks, timeout_secs=1800.0)
    for rank, result in enumerate(results):
        assert result["ops"] >= NUM_OPS, (rank, result)
        assert result["allocated_growth"] <= ALLOCATED_SLACK_BYTES, (
            f"rank {rank}: torch.cuda.memory_allocated grew by {result['allocated_growth']} B "
            f"(slack {ALLOCATED_SLACK_BYTES} B): {result}"
        )
        free_slack = FREE_MEMORY_SLACK_PER_RANK * result["ranks_on_this_gpu"]
        assert result["free_memory_drop"] <= free_slack, (
            f"rank {rank}: device free memory fell by {result['free_memory_drop']} B (slack {free_slack} B): {result}"
        )
        assert result["fd_growth"] <= 0, f"rank {rank}: {result['fd_growth']} more open file descriptors: {result}"
