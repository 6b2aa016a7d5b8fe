"""Spawn one process per rank, run a function in each, and bring results (or the first failure) back.

Ranks are mapped to GPUs round-robin; when ranks outnumber GPUs they share them, the torch group is
then `gloo` (NCCL refuses two ranks on one GPU; the buffer's ipc backend needs the group only to
exchange handles), otherwise `nccl`. NVLink multicast stays off in every rank. What a rank process
does and how its results come back is rank_process.py, shared with the rank pool (rank_pool.py).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from deep_ep.testing.rank_process import (
    SAFE_ENV,
    DeviceNotReady,
    child_environment,
    collect,
    end_processes,
    module_loading_for,
    new_store,
    register_stack_dump,
    report_failure,
    run_rank,
    setup_rank,
)

# A launch whose ranks found CUDA not ready (rank_process.DEVICE_NOT_READY_MARKERS) is retried with
# fresh processes: a rank that failed there never reached fn, so no work is repeated.
DEVICE_NOT_READY_ATTEMPTS = 6
DEVICE_NOT_READY_DELAY_SECS = 5.0


def _worker(
    rank: int, num_ranks: int, init_method: str, fn: Callable[..., Any], args: tuple[Any, ...], results: Any
) -> None:
    os.environ.update(SAFE_ENV)
    register_stack_dump(os.path.dirname(init_method.removeprefix("file://")), rank)
    try:
        setup = setup_rank(rank, num_ranks, results)
        if setup is not None:
            run_rank(rank, num_ranks, init_method, setup, fn, args, results)
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller
        report_failure(rank, results)


def launch(
    fn: Callable[..., Any],
    num_ranks: int,
    *args: Any,
    timeout_secs: float = 900.0,
    may_exit: tuple[int, ...] = (),
) -> list[Any]:
    """Run ``fn(rank, num_ranks, group, *args)`` in ``num_ranks`` processes; return their results by rank.

    Fresh processes, or with EP_TEST_POOL=1 the rank processes of the previous launch of the same
    rank count (deep_ep/testing/rank_pool.py; launches with ``may_exit`` always start fresh ones).

    ``fn`` and ``args`` must be picklable (a module-level function). The first failing rank's exception is
    re-raised here as RankError (with the rank and its traceback) chained to the original exception.
    Ranks in ``may_exit`` may end their process without reporting (fault tests kill them with
    ``os._exit``): their result is None.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    from deep_ep.testing import rank_pool

    for attempt in range(1, DEVICE_NOT_READY_ATTEMPTS + 1):
        try:
            if rank_pool.pool_enabled() and not may_exit:
                return rank_pool.run_pooled(fn, num_ranks, args, timeout_secs, module_loading_for(num_ranks))
            return _launch_once(fn, num_ranks, args, timeout_secs, may_exit)
        except DeviceNotReady as error:
            if attempt == DEVICE_NOT_READY_ATTEMPTS:
                raise RuntimeError(
                    f"CUDA was not ready in {DEVICE_NOT_READY_ATTEMPTS} launches "
                    f"{DEVICE_NOT_READY_DELAY_SECS:g} s apart: {error}"
                ) from None
            time.sleep(DEVICE_NOT_READY_DELAY_SECS)
    raise AssertionError("unreachable")


def _launch_once(
    fn: Callable[..., Any], num_ranks: int, args: tuple[Any, ...], timeout_secs: float, may_exit: tuple[int, ...]
) -> list[Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    store_dir, init_method = new_store()
    processes = [
        context.Process(target=_worker, args=(rank, num_ranks, init_method, fn, args, results), daemon=True)
        for rank in range(num_ranks)
    ]
    with child_environment(module_loading_for(num_ranks)):
        for process in processes:
            process.start()
    try:
        return collect(processes, results, timeout_secs, may_exit, store_dir)
    except BaseException:
        end_processes(processes)  # ranks still running after a failure or a timeout
        raise
    finally:
        for process in processes:
            process.join(timeout=30)
        shutil.rmtree(store_dir, ignore_errors=True)
