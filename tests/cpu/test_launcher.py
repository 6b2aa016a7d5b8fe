"""The rank launcher works without a GPU (gloo) and reports a failing rank with its traceback."""

from __future__ import annotations

import pytest

from deep_ep.testing import RankError, launch


def _sum_ranks(rank, num_ranks, group, offset):
    import torch
    import torch.distributed as dist

    value = torch.tensor([rank + offset])
    dist.all_reduce(value, group=group)
    return int(value.item())


def _fail_on_last(rank, num_ranks, group):
    if rank == num_ranks - 1:
        raise ValueError(f"rank {rank} planted failure")
    return rank


def test_launch_returns_every_rank_result_in_order():
    assert launch(_sum_ranks, 3, 10) == [33, 33, 33]


def test_launch_works_for_one_rank():
    assert launch(_sum_ranks, 1, 5) == [5]


def test_launch_reraises_failing_rank_with_traceback():
    with pytest.raises(RankError) as info:
        launch(_fail_on_last, 2)
    assert info.value.rank == 1
    assert "planted failure" in info.value.remote_traceback
    assert "_fail_on_last" in info.value.remote_traceback
    assert isinstance(info.value.__cause__, ValueError)


def test_launch_rejects_zero_ranks():
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        launch(_sum_ranks, 0, 1)


def _thread_count(rank, num_ranks, group):
    import torch

    return torch.get_num_threads()


def test_launch_gives_each_rank_a_share_of_the_cores():
    import os

    expected = max(1, (os.cpu_count() or 1) // 2)
    assert launch(_thread_count, 2) == [expected, expected]


def _last_rank_exits(rank, num_ranks, group):
    import os

    import torch.distributed as dist

    # Every connection of the group is up before a rank leaves: a rank that exits while a peer is
    # still connecting to it fails that peer's process-group setup (seen on a loaded CI machine).
    dist.barrier(group=group)
    if rank == num_ranks - 1:
        os._exit(0)
    return rank


def test_launch_accepts_a_rank_allowed_to_exit_and_reports_it_as_none():
    assert launch(_last_rank_exits, 3, may_exit=(2,)) == [0, 1, None]


def test_launch_reports_a_rank_that_exits_without_permission():
    with pytest.raises((RuntimeError, TimeoutError)):
        launch(_last_rank_exits, 2, timeout_secs=5)


def _rank_one_sleeps_in_a_named_function(rank, num_ranks, group):
    import time

    if rank == 1:
        while True:
            time.sleep(0.1)
    return rank


def test_launch_timeout_reports_the_stuck_ranks_python_stack():
    with pytest.raises(TimeoutError) as info:
        # The limit covers the processes' start (spawn, torch import, process group): seconds on a
        # busy 2-core machine, so rank 0 gets room to finish while rank 1 never does.
        launch(_rank_one_sleeps_in_a_named_function, 2, timeout_secs=15)
    message = str(info.value)
    assert "ranks [1] did not finish" in message
    assert "--- rank 1 stacks ---" in message
    assert "_rank_one_sleeps_in_a_named_function" in message


def _rank_zero_fails_while_rank_one_hangs(rank, num_ranks, group):
    import time

    if rank == 0:
        raise RuntimeError("rank 0 planted failure")
    while True:
        time.sleep(0.1)


def test_a_failure_reports_the_stacks_of_ranks_that_neither_failed_nor_finished(monkeypatch):
    from deep_ep.testing import rank_process

    monkeypatch.setattr(rank_process, "OTHER_FAILURES_GRACE_SECS", 2.0)
    with pytest.raises(RankError) as info:
        launch(_rank_zero_fails_while_rank_one_hangs, 2, timeout_secs=60)
    assert info.value.rank == 0
    assert "--- rank 1 stacks ---" in info.value.remote_traceback
    assert "_rank_zero_fails_while_rank_one_hangs" in info.value.remote_traceback.split("--- rank 1 stacks ---")[1]


def test_ranks_sharing_a_gpu_load_modules_eagerly_unless_the_caller_chose(monkeypatch):
    import os

    from deep_ep.testing import rank_process

    monkeypatch.delenv("EP_LAUNCH_MODULE_LOADING", raising=False)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")  # what `import torch` sets when it is unset
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    assert rank_process.module_loading_for(2) == {"CUDA_MODULE_LOADING": "EAGER"}
    assert rank_process.module_loading_for(1) == {}
    monkeypatch.setenv("EP_LAUNCH_MODULE_LOADING", "LAZY")
    assert rank_process.module_loading_for(2) == {"CUDA_MODULE_LOADING": "LAZY"}
    monkeypatch.delenv("CUDA_MODULE_LOADING")
    with rank_process.child_environment({"CUDA_MODULE_LOADING": "EAGER"}):
        assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    assert "CUDA_MODULE_LOADING" not in os.environ
