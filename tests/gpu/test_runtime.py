"""Runtime: construction/teardown, barriers, timeouts and construction-time validation on real GPUs."""

from __future__ import annotations

import json
import os
import time
import warnings

import pytest
import torch

import deep_ep
from deep_ep.testing import RankError, launch
from deep_ep.window import window_tensor

MiB = 1 << 20


def _make_buffer(group, **kwargs):
    settings = {"num_max_tokens_per_rank": 256, "hidden": 4096, "num_topk": 8, "explicitly_destroy": True}
    settings.update(kwargs)
    return deep_ep.ElasticBuffer(group, **settings)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _create_destroy_many(rank, num_ranks, group, backend, iterations):
    import torch.distributed as dist

    # Warm-up: the first buffer loads modules and creates the CUDA/NCCL context state that stays.
    _make_buffer(group, backend=backend).destroy()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    free_before, _ = torch.cuda.mem_get_info()
    fds_before = _open_fds()
    window_bytes = 0
    for _ in range(iterations):
        buffer = _make_buffer(group, backend=backend)
        window_bytes = buffer.num_bytes
        buffer.barrier(with_cpu_sync=True)
        buffer.destroy()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    free_after, _ = torch.cuda.mem_get_info()
    return {"free_drop": free_before - free_after, "window_bytes": window_bytes, "fd_growth": _open_fds() - fds_before}


def test_create_destroy_50_times_returns_memory(num_ranks):
    results = launch(_create_destroy_many, num_ranks, None if num_ranks <= torch.cuda.device_count() else "ipc", 50)
    for rank, result in enumerate(results):
        # A leak of one window per iteration would be 50 windows; allow less than one window of noise
        # (other ranks on the same GPU allocate and free at the same time).
        assert result["free_drop"] < result["window_bytes"], (rank, result)
        assert result["fd_growth"] <= 2, (rank, result)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_nccl_backend_single_rank_create_destroy_and_barriers():
    results = launch(_create_destroy_many, 1, "nccl", 20)
    assert results[0]["free_drop"] < results[0]["window_bytes"], results[0]
    launch(_barriers, 1, "nccl")


def _barriers(rank, num_ranks, group, backend=None):
    buffer = _make_buffer(group, backend=backend)
    try:
        assert buffer.backend in ("nccl", "ipc")
        stream = torch.cuda.current_stream()
        for _ in range(10):
            buffer.barrier()
        stream.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(1000):
            buffer.barrier()
        end.record()
        end.synchronize()
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0
        return {"us_per_barrier": start.elapsed_time(end) * 1000.0 / 1000, "backend": buffer.backend}
    finally:
        buffer.destroy()


def test_1000_barriers_back_to_back(num_ranks):
    results = launch(_barriers, num_ranks)
    latency = max(result["us_per_barrier"] for result in results)
    out_dir = os.environ.get("EP_RESULTS_DIR")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"barrier_latency_{num_ranks}ranks.json"), "w") as file:
            json.dump({"num_ranks": num_ranks, "us_per_barrier_max_over_ranks": latency, "ranks": results}, file)
    print(f"\n[barrier] {num_ranks} ranks: {latency:.2f} us per barrier (max over ranks)")


def _payload_before_barrier(rank, num_ranks, group):
    buffer = _make_buffer(group)
    try:
        ints_per_slot = 1024
        offset = buffer._window["ht_offset"]
        local = window_tensor(
            buffer, buffer.local_window_base(), offset, (num_ranks, ints_per_slot), torch.int32, "cuda"
        )
        stream = torch.cuda.current_stream().cuda_stream
        base = torch.arange(ints_per_slot, dtype=torch.int32, device="cuda")
        for iteration in range(20):
            # A peer's window is not a torch tensor here (NCCL-mapped peer memory is not one), so
            # the payload goes through the runtime's stream-ordered copy into the peer's window.
            payloads = [base * (iteration + 1) + rank * 100_000 + peer for peer in range(num_ranks)]
            for peer, payload in enumerate(payloads):
                buffer._runtime.copy_into_window(
                    peer, offset + rank * ints_per_slot * 4, payload.data_ptr(), ints_per_slot * 4, stream
                )
            buffer.barrier()
            expected = torch.stack([base * (iteration + 1) + source * 100_000 + rank for source in range(num_ranks)])
            assert torch.equal(local, expected), f"iteration {iteration}: payload written before the barrier missing"
            buffer.barrier()
        buffer.barrier(with_cpu_sync=True)
        with pytest.raises(ValueError, match="must lie in the window"):
            buffer._runtime.copy_into_window(rank, buffer._runtime.total_bytes() - 2, base.data_ptr(), 4, stream)
    finally:
        buffer.destroy()


def test_barrier_orders_payload_written_before_it(num_ranks):
    launch(_payload_before_barrier, num_ranks)


def _skip_one_barrier(rank, num_ranks, group):
    buffer = _make_buffer(group, num_gpu_timeout_secs=3)
    laggard = num_ranks - 1
    outcome = {}
    if rank != laggard:
        start = time.monotonic()
        try:
            buffer.barrier(with_cpu_sync=True)
            outcome["raised"] = False
        except deep_ep.CommTimeoutError as error:
            outcome.update(raised=True, peer=error.peer, phase=error.phase, message=str(error))
        outcome["elapsed"] = time.monotonic() - start
        try:
            buffer.barrier()
            outcome["refused_after"] = False
        except deep_ep.CommTimeoutError:
            outcome["refused_after"] = True
    else:
        # destroy() passes a closing barrier through the window: the laggard's would stand in for
        # the one it skipped, so it waits until its peers have timed out (their destroy() then skips
        # the barrier, and the laggard's times out and frees its window anyway).
        time.sleep(3 + 1.5)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        buffer.destroy()
    # A fresh buffer works again.
    buffer = _make_buffer(group, num_gpu_timeout_secs=3)
    for _ in range(10):
        buffer.barrier()
    buffer.barrier(with_cpu_sync=True)
    buffer.destroy()
    return outcome


def test_missing_rank_raises_comm_timeout_naming_it(num_ranks):
    if num_ranks < 2:
        pytest.skip("needs a peer to go missing")
    results = launch(_skip_one_barrier, num_ranks)
    for rank, outcome in enumerate(results[:-1]):
        assert outcome["raised"], (rank, outcome)
        assert outcome["peer"] == num_ranks - 1, (rank, outcome)
        assert outcome["phase"] == "barrier arrival", (rank, outcome)
        assert f"rank {num_ranks - 1}" in outcome["message"], outcome["message"]
        assert outcome["elapsed"] < 3 + 2, (rank, outcome)
        assert outcome["refused_after"], (rank, outcome)


def _construction_errors(rank, num_ranks, group):
    messages = {}

    def capture(name, **kwargs):
        try:
            _make_buffer(group, **kwargs).destroy()
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)

    capture("disagree", num_max_tokens_per_rank=256 + rank)
    capture("unaligned", num_bytes=3 * MiB)
    capture("bad_node_size", num_ranks_per_node=num_ranks + 1)
    if num_ranks > torch.cuda.device_count():
        capture("nccl_shared", backend="nccl")
    # The group still works after every refusal.
    buffer = _make_buffer(group)
    buffer.barrier(with_cpu_sync=True)
    buffer.destroy()
    return messages


def test_construction_rejects_bad_settings_on_every_rank(num_ranks):
    results = launch(_construction_errors, num_ranks)
    for messages in results:
        if num_ranks > 1:
            assert "num_max_tokens_per_rank" in messages["disagree"], messages
        else:
            assert messages["disagree"] is None
        assert "2 MiB" in messages["unaligned"], messages
        assert "num_ranks_per_node" in messages["bad_node_size"], messages
        if "nccl_shared" in messages:
            assert "ipc" in messages["nccl_shared"], messages


def _launch_failure(rank, num_ranks, group):
    if rank == num_ranks - 1:
        raise KeyError("planted failure")
    return rank


def test_launcher_reports_failing_rank(num_ranks):
    with pytest.raises(RankError) as info:
        launch(_launch_failure, num_ranks)
    assert info.value.rank == num_ranks - 1
    assert "planted failure" in str(info.value)
