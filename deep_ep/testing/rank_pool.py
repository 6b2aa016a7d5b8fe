"""Rank processes kept between launches (opt-in: EP_TEST_POOL=1), so a test suite pays the rank
processes' start once per rank count instead of once per test.

A fresh launch (launcher.launch) starts one process per rank: Python, torch, CUDA, the MPS client
and, for ranks sharing a GPU, every CUDA module loaded eagerly. With the pool, a launch sends its
function to the same rank processes, each running it in a torch process group of its own (a new
file store per launch). A two-rank launch of a function that only synchronises took 1.65 s fresh
and 0.21 s pooled on a 2-core machine without a GPU; on one H200 a 2-rank step of
five GPU suites (30 tests) took 29 s pooled against 74 s fresh. scripts/gpu_check.sh pools by default.

What a launch sees is what a fresh process would: the caller's environment at the time of the launch
(plus the launcher's own settings), and nothing a previous launch left — a rank function's changes
to os.environ are undone, torch's deterministic mode and sync debug mode are reset, and torch's
cached GPU memory is released after each launch. Anything else a rank function changes in its
process (module globals) stays: a test that depends on a fresh process runs without the pool.
Launches whose ranks may exit (``may_exit``) always start fresh processes; so does a launch after
the caller changed a variable read at a process's start (CUDA_*, NCCL_*, NVSHMEM_*, TORCH_*) or
after a rank could not reset its CUDA state (a sticky error). Any failure or timeout ends the pool.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from deep_ep.testing import rank_process

POOL_ENV = "EP_TEST_POOL"


def pool_enabled() -> bool:
    return os.environ.get(POOL_ENV, "").strip() == "1"


# Variables read when a process starts its CUDA context, NCCL or torch (a change between launches
# needs new rank processes).
_PROCESS_LEVEL_PREFIXES = ("CUDA_", "NCCL_", "NVSHMEM_", "TORCH_")


def _process_level_environment() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(_PROCESS_LEVEL_PREFIXES)}


def _reset_torch_state() -> None:
    """What rank functions commonly switch on, back to torch's defaults, and the cached memory freed."""
    import torch

    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _pool_worker(rank: int, num_ranks: int, store_dir: str, tasks: Any, results: Any) -> None:
    """One rank of the pool: run each task (init method, caller's environment, fn, args) until None."""
    os.environ.update(rank_process.SAFE_ENV)
    rank_process.register_stack_dump(store_dir, rank)
    # The variables this process was started with that the caller's environment must not override
    # (the launcher's module-loading choice is fixed at the process's start).
    own = {name: os.environ[name] for name in (rank_process.MODULE_LOADING_ENV,) if name in os.environ}
    setup = None
    while True:
        task = tasks.get()
        if task is None:
            return
        init_method, environment, fn, args = task
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update({**environment, **rank_process.SAFE_ENV, **own})
        try:
            if setup is None:
                setup = rank_process.setup_rank(rank, num_ranks, results)
                if setup is None:
                    return  # CUDA not ready: reported, and this process is done
            rank_process.run_rank(rank, num_ranks, init_method, setup, fn, args, results)
        except BaseException:  # noqa: BLE001 - every failure goes back to the caller
            rank_process.report_failure(rank, results)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        try:
            _reset_torch_state()
        except Exception:  # noqa: BLE001 - e.g. a sticky CUDA error: the next launch starts fresh ranks
            return


class RankPool:
    """``num_ranks`` rank processes started with ``overrides`` in their environment."""

    def __init__(self, num_ranks: int, overrides: dict[str, str]) -> None:
        context = mp.get_context("spawn")
        self.num_ranks = num_ranks
        self.overrides = dict(overrides)
        self.process_environment = _process_level_environment()
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(num_ranks)]
        self.store_dir = tempfile.mkdtemp(prefix="deep_ep_pool_")  # the ranks' stack dumps
        self.processes = [
            context.Process(
                target=_pool_worker,
                args=(rank, num_ranks, self.store_dir, self.tasks[rank], self.results),
                daemon=True,
            )
            for rank in range(num_ranks)
        ]
        with rank_process.child_environment(self.overrides):
            for process in self.processes:
                process.start()

    def usable(self, num_ranks: int, overrides: dict[str, str]) -> bool:
        return (
            self.num_ranks == num_ranks
            and self.overrides == overrides
            and self.process_environment == _process_level_environment()
            and all(process.is_alive() for process in self.processes)
        )

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_secs: float) -> list[Any]:
        """Every rank's ``fn(rank, num_ranks, group, *args)`` (raises as rank_process.collect does)."""
        store_dir, init_method = rank_process.new_store()
        environment = dict(os.environ)
        try:
            for queue in self.tasks:
                queue.put((init_method, environment, fn, args))
            return rank_process.collect(self.processes, self.results, timeout_secs, (), self.store_dir)
        finally:
            shutil.rmtree(store_dir, ignore_errors=True)

    def close(self) -> None:
        """End the rank processes (asked first, then terminated) and remove their files."""
        for queue in self.tasks:
            try:
                queue.put(None)
            except (OSError, ValueError):
                pass
        for process in self.processes:
            process.join(timeout=5)
        rank_process.end_processes(self.processes)
        shutil.rmtree(self.store_dir, ignore_errors=True)

    @property
    def pids(self) -> list[int | None]:
        return [process.pid for process in self.processes]


_pool: RankPool | None = None


def run_pooled(
    fn: Callable[..., Any], num_ranks: int, args: tuple[Any, ...], timeout_secs: float, overrides: dict[str, str]
) -> list[Any]:
    """``fn`` on the pool of ``num_ranks`` ranks (started, or restarted for another rank count or
    environment override, as needed; one pool at a time). Any failure ends the pool."""
    global _pool
    if _pool is not None and not _pool.usable(num_ranks, overrides):
        close_pool()
    if _pool is None:
        _pool = RankPool(num_ranks, overrides)
    try:
        return _pool.run(fn, args, timeout_secs)
    except BaseException:
        close_pool()
        raise


def close_pool() -> None:
    """End the pool's processes, if there is a pool."""
    global _pool
    if _pool is not None:
        pool, _pool = _pool, None
        pool.close()


def pool_pids() -> list[int | None]:
    """The pool's process ids by rank ([] without a pool): tests check reuse and restarts with it."""
    return [] if _pool is None else _pool.pids


atexit.register(close_pool)
