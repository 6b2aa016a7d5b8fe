"""The rank processes' side of a launch, shared by fresh launches (launcher.py) and the rank pool
(rank_pool.py): a rank's environment, threads, device and process group, running the rank function
and reporting its value or failure, and, in the caller, collecting every rank's report (with the
stacks of stuck ranks) and ending the processes.

Ranks are mapped to GPUs round-robin; when ranks outnumber GPUs they share them, the torch group is
then `gloo` (NCCL refuses two ranks on one GPU; the buffer's ipc backend needs the group only to
exchange handles), otherwise `nccl`. NVLink multicast stays off in every rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import queue
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


OTHER_FAILURES_GRACE_SECS = 15.0

# A launch that times out asks every unfinished rank for its Python stacks (faulthandler on
# SIGUSR1, written to a file per rank) before terminating it, so a hang names the line each rank
# is stuck on instead of only the ranks' numbers.
STACK_SIGNAL = signal.SIGUSR1
STACK_DUMP_WAIT_SECS = 2.0
STACK_DUMP_MAX_CHARS = 6000

# Under MPS a client that was killed (a failed test's ranks are terminated) is cleaned up by the
# server asynchronously; until then new clients fail CUDA initialisation ("MPS server is not ready",
# "busy or unavailable"), and that failure is sticky for the process. Such a launch is retried with
# fresh processes (launcher.launch): a rank that failed there never reached fn, so no work is repeated.
DEVICE_NOT_READY_MARKERS = ("MPS server is not ready", "busy or unavailable")


class DeviceNotReady(Exception):
    """A rank could not initialise CUDA for a transient reason (DEVICE_NOT_READY_MARKERS)."""


def _drain_failures(results: Any, max_reports: int, seconds: float) -> tuple[list[tuple[int, str]], set[int]]:
    """(rank, traceback) of the failures reported within ``seconds`` (at most ``max_reports``
    reports), and the ranks that reported success meanwhile."""
    failures: list[tuple[int, str]] = []
    finished: set[int] = set()
    deadline = time.monotonic() + seconds
    for _ in range(max(0, max_reports)):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, payload = results.get(timeout=remaining)
        except queue.Empty:
            break
        if status != "ok":
            failures.append((rank, payload[0]))
        else:
            finished.add(rank)
    return failures, finished


class RankError(RuntimeError):
    """A rank raised: carries its rank and the remote traceback."""

    def __init__(self, rank: int, remote_traceback: str) -> None:
        super().__init__(f"rank {rank} failed:\n{remote_traceback}")
        self.rank = rank
        self.remote_traceback = remote_traceback


def _stack_file(store_dir: str, rank: int) -> str:
    return os.path.join(store_dir, f"stacks_rank{rank}.txt")


@dataclass
class _RankSetup:
    backend: str
    device_id: Any
    needs_warm_up: bool  # ranks share a GPU and the libraries are not warmed up yet (warm_up.py)


# Ranks sharing a GPU each get this share of its memory (of 1 / ranks on that GPU) for torch's
# caching allocator; the rest is left to the windows (allocated by the library, outside the
# allocator), the CUDA contexts and MPS.
RANK_MEMORY_SHARE = 0.8


def cap_cached_memory(num_ranks: int, num_gpus: int, device: int) -> None:
    """Bound each rank's caching allocator to its share of the shared GPU. Without a bound, blocks
    one rank keeps cached after a large case are memory another rank cannot get: eight ranks of
    the low-latency suite on one 80 GB GPU then fail with OOM while each uses far less at once.
    Over its bound, the allocator frees its cached blocks and retries before it raises."""
    import torch

    ranks_on_this_gpu = -(-num_ranks // num_gpus)
    torch.cuda.set_per_process_memory_fraction(RANK_MEMORY_SHARE / ranks_on_this_gpu, device)


def setup_rank(rank: int, num_ranks: int, results: Any) -> _RankSetup | None:
    """Threads, device and process-group backend of a rank process; None (reported) when CUDA is
    not ready for a transient reason (DEVICE_NOT_READY_MARKERS)."""
    import torch

    # Every rank is a process with its own intra-op thread pool: without a share of the cores
    # each, N ranks run N x cores threads and CPU-side work (reference model, input generation)
    # slows down by an order of magnitude.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_ranks))
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device_id = None
    if num_gpus > 0:
        try:
            torch.cuda.set_device(rank % num_gpus)
            if num_ranks > num_gpus:
                cap_cached_memory(num_ranks, num_gpus, rank % num_gpus)
        except Exception as exc:
            if any(marker in str(exc) for marker in DEVICE_NOT_READY_MARKERS):
                results.put((rank, "device-not-ready", str(exc)))
                return None
            raise
        device_id = torch.device("cuda", rank % num_gpus)
    backend = "nccl" if 0 < num_ranks <= num_gpus else "gloo"
    return _RankSetup(backend, device_id, needs_warm_up=0 < num_gpus < num_ranks)


def run_rank(
    rank: int,
    num_ranks: int,
    init_method: str,
    setup: _RankSetup,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    """``fn`` in a torch process group of its own; its value (or its failure) goes to ``results``."""
    import torch.distributed as dist

    from deep_ep.testing.warm_up import warm_up_cuda_libraries

    kwargs: dict[str, Any] = {"device_id": setup.device_id} if setup.backend == "nccl" else {}
    dist.init_process_group(setup.backend, init_method=init_method, rank=rank, world_size=num_ranks, **kwargs)
    try:
        if setup.needs_warm_up:
            warm_up_cuda_libraries(setup.device_id)  # before any peer can spin on this rank (warm_up.py)
            setup.needs_warm_up = False
        value = fn(rank, num_ranks, dist.group.WORLD, *args)
    finally:
        dist.destroy_process_group()
    results.put((rank, "ok", pickle.dumps(value)))


def report_failure(rank: int, results: Any) -> None:
    """The exception being handled, pickled when it can be, with its traceback."""
    exc = sys.exc_info()[1]
    try:
        payload = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an unpicklable exception still reports its text
        payload = None
    results.put((rank, "error", (traceback.format_exc(), payload)))


def register_stack_dump(store_dir: str, rank: int) -> None:
    stack_file = open(_stack_file(store_dir, rank), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)


# Ranks that share a GPU run under MPS in one CUDA context. With lazy kernel loading (CUDA's
# default, and what `import torch` sets when the variable is unset) a rank's first launch of any
# kernel (torch's included) may wait for that context to synchronise, i.e. for a peer's kernel that
# spins until this rank's kernel runs: a deadlock until the peer's wait deadline (measured: the
# example MoE layer's backward at 4 ranks on one H200). The library loads its own kernels at buffer
# construction; the launcher makes such ranks load every module eagerly and calls cuBLAS once
# before the rank function (warm_up.py: cuBLAS loads a kernel's module when a call first needs it,
# which eager loading does not move). EP_LAUNCH_MODULE_LOADING (EAGER or LAZY) overrides the choice.
MODULE_LOADING_ENV = "CUDA_MODULE_LOADING"
MODULE_LOADING_OVERRIDE_ENV = "EP_LAUNCH_MODULE_LOADING"


def module_loading_for(num_ranks: int) -> dict[str, str]:
    """The environment the rank processes need on top of this one's."""
    override = os.environ.get(MODULE_LOADING_OVERRIDE_ENV)
    if override:
        return {MODULE_LOADING_ENV: override}
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {MODULE_LOADING_ENV: "EAGER"} if 0 < num_gpus < num_ranks else {}


@contextlib.contextmanager
def child_environment(overrides: dict[str, str]) -> Iterator[None]:
    """``overrides`` in os.environ while the rank processes start (spawned children copy it)."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _dump_stacks(processes: list[Any], ranks: list[int], store_dir: str) -> str:
    """The Python stacks of the live ``ranks`` (each rank's dump, cut to its last characters)."""
    alive = [rank for rank in ranks if processes[rank].is_alive() and processes[rank].pid is not None]
    for rank in alive:
        try:
            os.kill(processes[rank].pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    time.sleep(STACK_DUMP_WAIT_SECS if alive else 0.0)
    parts = []
    for rank in alive:
        try:
            with open(_stack_file(store_dir, rank)) as dump:
                text = dump.read().strip()
        except OSError:
            text = ""
        if len(text) > STACK_DUMP_MAX_CHARS:
            text = "..." + text[-STACK_DUMP_MAX_CHARS:]
        parts.append(f"\n--- rank {rank} stacks ---\n{text or '(no dump: the rank did not answer the signal)'}")
    return "".join(parts)


def collect(
    processes: list[Any],
    results: Any,
    timeout_secs: float,
    may_exit: tuple[int, ...],
    store_dir: str,
) -> list[Any]:
    """Every rank's result of one run, by rank. Raises RankError (the first failure, with the
    others that followed and the stacks of ranks that neither failed nor finished), RuntimeError
    (a rank died without reporting), TimeoutError (with the stuck ranks' stacks) or
    DeviceNotReady; the caller then ends the processes."""
    num_ranks = len(processes)
    collected: dict[int, Any] = {}
    failure: tuple[int, str, bytes | None] | None = None
    deadline = time.monotonic() + timeout_secs
    while len(collected) < num_ranks and failure is None:
        try:
            rank, status, payload = results.get(timeout=1.0)
        except queue.Empty:
            for r in may_exit:
                if r not in collected and processes[r].exitcode is not None:
                    collected[r] = None
            dead = [r for r, p in enumerate(processes) if r not in collected and p.exitcode not in (None, 0)]
            if dead:
                codes = {r: processes[r].exitcode for r in dead}
                raise RuntimeError(f"ranks {dead} died without reporting (exit codes {codes})") from None
            if time.monotonic() > deadline:
                missing = [r for r in range(num_ranks) if r not in collected]
                stacks = _dump_stacks(processes, missing, store_dir)
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_secs:g} s{stacks}") from None
            continue
        if status == "ok":
            collected[rank] = pickle.loads(payload)
        elif status == "device-not-ready":
            raise DeviceNotReady(f"rank {rank}: {payload}")
        else:
            failure = (rank, payload[0], payload[1])
    if failure is None:
        return [collected[rank] for rank in range(num_ranks)]
    # The first failure is often a consequence of another rank's: give the others a few seconds to
    # report theirs, and show them too.
    others, finished = _drain_failures(results, num_ranks - len(collected) - 1, OTHER_FAILURES_GRACE_SECS)
    rank, remote_traceback, pickled = failure
    listing = "".join(f"\n--- rank {other} also failed ---\n{text}" for other, text in others)
    # Ranks that neither failed nor finished are stuck (often what the failure waited for).
    reported = {*collected, *finished, rank, *(other for other, _ in others)}
    silent = [r for r in range(num_ranks) if r not in reported]
    listing += _dump_stacks(processes, silent, store_dir)
    original = None
    if pickled is not None:
        try:
            original = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - fall back to the traceback text
            original = None
    raise RankError(rank, remote_traceback + listing) from original


def new_store() -> tuple[str, str]:
    """A fresh directory and the file-store init method in it. A file store, not a TCP port: a port
    picked here and bound later by rank 0 can be taken in between (NCCL bootstraps open ephemeral
    ports), which failed launches with EADDRINUSE."""
    store_dir = tempfile.mkdtemp(prefix="deep_ep_launch_")
    return store_dir, "file://" + os.path.join(store_dir, "store")


def end_processes(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=30)
