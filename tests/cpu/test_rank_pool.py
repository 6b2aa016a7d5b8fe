"""deep_ep.testing.rank_pool (EP_TEST_POOL=1): launches reuse the rank processes, see the caller's
environment of the moment and nothing a previous launch changed, and a failure, a timeout, another
rank count or a launch whose ranks may exit starts fresh processes."""

from __future__ import annotations

import os

import pytest

from deep_ep.testing import RankError, launch, rank_pool


@pytest.fixture(autouse=True)
def _pooled(monkeypatch):
    monkeypatch.setenv(rank_pool.POOL_ENV, "1")
    yield
    rank_pool.close_pool()


def _pid_and_sum(rank, num_ranks, group):
    import torch
    import torch.distributed as dist

    value = torch.tensor([rank])
    dist.all_reduce(value, group=group)
    return os.getpid(), int(value.item())


def _connected(group) -> None:
    """Every connection of the group is up before a rank leaves the function: a rank that tears its
    group down while a peer is still connecting fails that peer's setup (gloo)."""
    import torch.distributed as dist

    dist.barrier(group=group)


def _read_and_set_env(rank, num_ranks, group):
    _connected(group)
    seen = (os.environ.get("EP_POOL_PROBE"), os.environ.get("EP_POOL_LEAK"))
    os.environ["EP_POOL_LEAK"] = "set by an earlier launch"
    return seen


def _fail_on_rank_zero(rank, num_ranks, group):
    _connected(group)
    if rank == 0:
        raise ValueError("planted failure")
    return rank


def _rank_one_hangs(rank, num_ranks, group):
    import time

    _connected(group)
    while rank == 1:
        time.sleep(0.1)
    return rank


def _pids(values):
    return [pid for pid, _ in values]


def test_launches_reuse_the_rank_processes_with_a_new_group_each():
    first = launch(_pid_and_sum, 2)
    second = launch(_pid_and_sum, 2)
    assert [total for _, total in first] == [1, 1] and [total for _, total in second] == [1, 1]
    assert _pids(first) == _pids(second) == rank_pool.pool_pids()
    assert os.getpid() not in _pids(first)


def test_each_launch_sees_the_callers_environment_and_not_a_previous_launchs_changes(monkeypatch):
    monkeypatch.setenv("EP_POOL_PROBE", "first")
    assert launch(_read_and_set_env, 2) == [("first", None)] * 2
    monkeypatch.setenv("EP_POOL_PROBE", "second")
    assert launch(_read_and_set_env, 2) == [("second", None)] * 2


def test_a_failure_ends_the_pool_and_the_next_launch_starts_fresh_processes():
    before = _pids(launch(_pid_and_sum, 2))
    with pytest.raises(RankError) as info:
        launch(_fail_on_rank_zero, 2)
    assert info.value.rank == 0 and "planted failure" in info.value.remote_traceback
    assert rank_pool.pool_pids() == []
    after = _pids(launch(_pid_and_sum, 2))
    assert set(after).isdisjoint(before)


def test_a_timeout_names_the_stuck_rank_with_its_stack_and_ends_the_pool():
    launch(_pid_and_sum, 2)  # the pool's processes started: the limit below covers the run only
    with pytest.raises(TimeoutError) as info:
        launch(_rank_one_hangs, 2, timeout_secs=5)
    assert "ranks [1] did not finish" in str(info.value)
    assert "_rank_one_hangs" in str(info.value)
    assert rank_pool.pool_pids() == []


def test_another_rank_count_replaces_the_pool():
    two = _pids(launch(_pid_and_sum, 2))
    one = _pids(launch(_pid_and_sum, 1))
    assert rank_pool.pool_pids() == one
    assert set(one).isdisjoint(two)


def test_a_launch_whose_ranks_may_exit_runs_in_fresh_processes():
    pooled = _pids(launch(_pid_and_sum, 2))
    fresh = _pids(launch(_pid_and_sum, 2, may_exit=(1,)))
    assert set(fresh).isdisjoint(pooled)
    assert rank_pool.pool_pids() == pooled  # the pool is left as it was


def test_a_changed_process_level_variable_starts_fresh_processes(monkeypatch):
    before = _pids(launch(_pid_and_sum, 2))
    monkeypatch.setenv("NCCL_DEBUG", "WARN" if os.environ.get("NCCL_DEBUG") != "WARN" else "INFO")
    after = _pids(launch(_pid_and_sum, 2))
    assert set(after).isdisjoint(before)


def test_without_the_variable_every_launch_starts_fresh_processes(monkeypatch):
    monkeypatch.delenv(rank_pool.POOL_ENV)
    first = _pids(launch(_pid_and_sum, 2))
    second = _pids(launch(_pid_and_sum, 2))
    assert set(first).isdisjoint(second)
    assert rank_pool.pool_pids() == []
