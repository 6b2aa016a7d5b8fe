"""ElasticBuffer: the symmetric window shared by all EP ranks, and the entry point of every operation.

Construction is collective over the torch process group: every rank gathers every rank's facts
(host, GPU, settings), agrees on the topology and the backend, allocates the same window and
exchanges handles. HT dispatch/combine come from HighThroughputMixin, the decode path from
LowLatencyMixin; this file owns construction, sizing, errors and teardown.
"""

from __future__ import annotations

import itertools
import os
import socket
import warnings
from typing import Any

import torch
import torch.distributed as dist

from deep_ep import _C
from deep_ep.errors import CommTimeoutError
from deep_ep.event import EventOverlap
from deep_ep.handle import EPHandle
from deep_ep.high_throughput import HighThroughputMixin
from deep_ep.low_latency import LowLatencyMixin
from deep_ep.topology import (
    RankFacts,
    build_topology,
    choose_backend,
    emulated_ranks_per_node,
    gpu_is_shared,
    mps_is_running,
    requested_backend,
    sm_cap,
)

__all__ = ["ElasticBuffer", "EPHandle"]

_comm_streams: dict[int, torch.cuda.Stream] = {}
_warned_no_mps = False
# Handles record the serial of the buffer that made them (ids of dead objects are reused; serials are not).
_buffer_serials = itertools.count(1)


def _comm_stream(device: int) -> torch.cuda.Stream:
    """One high-priority communication stream per process and device, shared by all buffers."""
    if device not in _comm_streams:
        _comm_streams[device] = torch.cuda.Stream(device=device, priority=-1)
    return _comm_streams[device]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0", "false", "False")


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None


class ElasticBuffer(HighThroughputMixin, LowLatencyMixin):
    """Symmetric-memory buffer for expert-parallel dispatch and combine (docs/api.md).

    ``deterministic`` is accepted for DeepEP compatibility: results are always deterministic here
    (receive order is (source rank, source token) by construction, sums run in a fixed order), so
    ``deterministic=False`` changes nothing.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        *,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        num_max_dispatch_tokens_per_rank: int = 0,
        num_experts: int = 0,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        deterministic: bool = True,
        num_gpu_timeout_secs: float | None = None,
        num_cpu_timeout_secs: float | None = None,
        backend: str | None = None,
        num_ranks_per_node: int | None = None,
        explicitly_destroy: bool = False,
    ) -> None:
        self._runtime: Any = None
        self._serial = next(_buffer_serials)
        self._destroyed = False
        self._failure: CommTimeoutError | None = None
        if not torch.cuda.is_available():
            raise RuntimeError("ElasticBuffer needs a CUDA device; none is available")
        if not allow_multiple_reduction:
            raise ValueError(
                "allow_multiple_reduction=False is not supported: combine always sums a rank's rows for a token "
                "before sending them (one bf16 rounding per rank)"
            )
        for name, value in (
            ("num_max_tokens_per_rank", num_max_tokens_per_rank),
            ("hidden", hidden),
            ("num_topk", num_topk),
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            ("num_experts", num_experts),
        ):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if num_gpu_timeout_secs is None:
            num_gpu_timeout_secs = _env_seconds("EP_GPU_TIMEOUT_SECS", 100.0)
        if num_cpu_timeout_secs is None:
            num_cpu_timeout_secs = _env_seconds("EP_CPU_TIMEOUT_SECS", 300.0)
        if num_gpu_timeout_secs <= 0 or num_cpu_timeout_secs <= 0:
            raise ValueError(
                f"timeouts must be positive, got num_gpu_timeout_secs={num_gpu_timeout_secs}, "
                f"num_cpu_timeout_secs={num_cpu_timeout_secs}"
            )
        if num_bytes is not None and (num_bytes <= 0 or num_bytes % _C.WINDOW_ALIGN_BYTES != 0):
            raise ValueError(f"num_bytes must be a positive multiple of 2 MiB (2097152), got {num_bytes}")

        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.device = torch.cuda.current_device()
        self._torch_device = torch.device("cuda", self.device)  # built once: the call paths compare against it
        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.num_gpu_timeout_secs = float(num_gpu_timeout_secs)
        self.num_cpu_timeout_secs = float(num_cpu_timeout_secs)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = use_fp8_dispatch
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.num_experts = num_experts

        backend = requested_backend(backend)
        # Every rank must agree on every setting: the window has the same size and layout everywhere.
        settings = {
            "num_bytes": num_bytes,
            "num_max_tokens_per_rank": num_max_tokens_per_rank,
            "hidden": hidden,
            "num_topk": num_topk,
            "use_fp8_dispatch": use_fp8_dispatch,
            "num_max_dispatch_tokens_per_rank": num_max_dispatch_tokens_per_rank,
            "num_experts": num_experts,
            "allow_hybrid_mode": allow_hybrid_mode,
            "backend": backend,
            "num_ranks_per_node": emulated_ranks_per_node(num_ranks_per_node),
            "num_gpu_timeout_secs": self.num_gpu_timeout_secs,
        }
        properties = torch.cuda.get_device_properties(self.device)
        facts = RankFacts(
            host=socket.gethostname(), device_uuid=str(properties.uuid), sm_count=properties.multi_processor_count
        )
        gathered: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(gathered, (facts, settings), group=group)
        all_facts = [item[0] for item in gathered]
        for name, value in settings.items():
            values = [item[1][name] for item in gathered]
            if any(other != value for other in values):
                raise ValueError(f"every rank must pass the same {name}; got {values} (index = rank)")

        topology = build_topology(
            all_facts, self.rank_idx, num_ranks_per_node=num_ranks_per_node, allow_hybrid_mode=allow_hybrid_mode
        )
        self.topology = topology
        self.num_rdma_ranks = topology.num_rdma_ranks
        self.num_nvlink_ranks = topology.num_nvlink_ranks
        self.num_scaleout_ranks = topology.num_scaleout_ranks
        self.num_scaleup_ranks = topology.num_scaleup_ranks
        self.scaleout_rank_idx = topology.scaleout_rank_idx(self.rank_idx)
        self.scaleup_rank_idx = topology.scaleup_rank_idx(self.rank_idx)
        self.backend = choose_backend(backend, gpu_is_shared(all_facts))
        self._max_num_sms = sm_cap(properties.multi_processor_count, topology.ranks_per_gpu)
        if topology.ranks_per_gpu > 1:
            global _warned_no_mps
            if not mps_is_running() and not _warned_no_mps:
                _warned_no_mps = True
                warnings.warn(
                    f"{topology.ranks_per_gpu} ranks share GPU {self.device} but NVIDIA MPS does not seem to run: "
                    "their kernels will time-slice and every cross-rank wait will cost milliseconds "
                    "(start it with scripts/mps.sh start)",
                    stacklevel=2,
                )

        ht_region, ll_region = self._region_bytes(num_bytes)
        self._window = _C.window_layout(ht_region, ll_region)
        self.num_bytes = self._window["total_bytes"]
        self._comm_stream = _comm_stream(self.device)
        self._connect(ht_region, ll_region)
        if _env_flag("EP_BUFFER_DEBUG"):
            print(
                f"[deep_ep rank {self.rank_idx}] backend={self.backend} window={self.num_bytes} B "
                f"(HT {self._window['ht_bytes']} B, LL {self._window['ll_bytes']} B) "
                f"scaleout={self.num_scaleout_ranks} scaleup={self.num_scaleup_ranks} sm_cap={self._max_num_sms}",
                flush=True,
            )

    # ------------------------------------------------------------------ sizing

    def _region_bytes(self, num_bytes: int | None) -> tuple[int, int]:
        """(HT region, LL region) bytes; the LL part is always exact, HT gets the rest of num_bytes."""
        ll_region = 0
        self.num_ll_topk = 0
        if self.num_max_dispatch_tokens_per_rank > 0:
            ll = _C.low_latency_layout(
                self.num_ranks, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts, self.num_topk
            )
            ll_region = ll["region_bytes"]
            self.num_ll_topk = ll["num_topk"]
        if num_bytes is None:
            ht_region = 0
            if self.num_max_tokens_per_rank > 0:
                ht_region = _C.high_throughput_layout(
                    self.num_ranks,
                    self.num_scaleup_ranks,
                    self.num_max_tokens_per_rank,
                    self.hidden,
                    self.num_topk,
                    self.use_fp8_dispatch,
                )["region_bytes"]
            return ht_region, ll_region
        ht_region = num_bytes - _C.WORKSPACE_BYTES - ll_region
        if ht_region < 0:
            raise ValueError(
                f"num_bytes={num_bytes} cannot hold the workspace ({_C.WORKSPACE_BYTES} B) and the low-latency "
                f"region ({ll_region} B); need at least {_C.WORKSPACE_BYTES + ll_region}"
            )
        return ht_region, ll_region

    @staticmethod
    def get_buffer_size_hint(
        group: dist.ProcessGroup,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        num_ranks_per_node: int | None = None,
    ) -> int:
        """Exact window bytes an HT-only buffer with these settings allocates (all ranks on one host)."""
        if not allow_multiple_reduction:
            raise ValueError(
                "allow_multiple_reduction=False is not supported: combine always sums a rank's rows for a token "
                "before sending them (one bf16 rounding per rank)"
            )
        num_ranks = group.size()
        node_size = emulated_ranks_per_node(num_ranks_per_node) or num_ranks
        scaleup = node_size if allow_hybrid_mode and node_size < num_ranks else num_ranks
        region = _C.high_throughput_layout(
            num_ranks, scaleup, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch
        )
        return _C.window_layout(region["region_bytes"], 0)["total_bytes"]

    @staticmethod
    def get_low_latency_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int, num_topk: int = 0
    ) -> int:
        """Exact window bytes an LL-only buffer with these settings allocates."""
        region = _C.low_latency_layout(num_ranks, num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk)
        return _C.window_layout(0, region["region_bytes"])["total_bytes"]

    # -------------------------------------------------------------- bootstrap

    def _connect(self, ht_region: int, ll_region: int) -> None:
        backend = self.backend
        error: str | None = None
        try:
            self._runtime = _C.Runtime(
                self.rank_idx,
                self.num_ranks,
                self.num_scaleup_ranks,
                self.device,
                ht_region,
                ll_region,
                self.num_gpu_timeout_secs,
                self.num_cpu_timeout_secs,
                backend,
            )
            if backend == "ipc":
                handles: list[Any] = [None] * self.num_ranks
                dist.all_gather_object(handles, self._runtime.ipc_handle(), group=self.group)
                self._runtime.connect_ipc(handles)
            else:
                unique_id = [_C.Runtime.create_nccl_unique_id() if self.rank_idx == 0 else None]
                dist.broadcast_object_list(unique_id, src=dist.get_global_rank(self.group, 0), group=self.group)
                self._runtime.connect_nccl(unique_id[0])
        except Exception as exc:  # noqa: BLE001 - reported collectively below
            error = f"{type(exc).__name__}: {exc}"
        # Agree on the outcome so no rank proceeds into a kernel that waits for a rank that failed.
        outcomes: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(outcomes, error, group=self.group)
        failed = {rank: message for rank, message in enumerate(outcomes) if message is not None}
        if failed:
            if self._runtime is not None:
                self._runtime.destroy()
                self._runtime = None
            raise RuntimeError(f"ElasticBuffer construction failed ({backend} backend): {failed}")

    # ------------------------------------------------------------ error state

    def _ensure_usable(self) -> None:
        if self._destroyed:
            raise RuntimeError("this ElasticBuffer was destroyed")
        if self._failure is not None:
            raise CommTimeoutError(
                f"this buffer is unusable after an earlier failure: {self._failure}; destroy() it and build a new one",
                rank=self._failure.rank,
                peer=self._failure.peer,
                operation=self._failure.operation,
                phase=self._failure.phase,
                expected=self._failure.expected,
                seen=self._failure.seen,
            )

    def _check_device_errors(self) -> None:
        """Raise what the kernels recorded so far (no synchronisation)."""
        if not self._runtime.has_error():
            return
        record = self._runtime.error_record()
        if record["status"] > 0:
            waited_for = f"rank {record['peer']}" if record["peer"] >= 0 else "the other CTAs of its own kernel"
            self._failure = CommTimeoutError(
                f"rank {record['rank']}: {record['operation']} timed out after {self.num_gpu_timeout_secs:g} s "
                f"in phase '{record['phase']}' waiting for {waited_for} "
                f"(expected {record['expected']}, saw {record['seen']}); "
                "the buffer refuses further work until destroy()",
                rank=record["rank"],
                peer=record["peer"],
                operation=record["operation"],
                phase=record["phase"],
                expected=record["expected"],
                seen=record["seen"],
            )
            raise self._failure
        if record["invalid_status"] > 0:
            self._runtime.clear_invalid_input()
            raise ValueError(
                f"topk_idx contains expert id {record['invalid_expert']} outside [-1, {record['num_experts']}) "
                f"(detected on the device by {record['invalid_operation']}; that entry was treated as -1)"
            )

    def _wait_mapped_counter(self, index: int) -> int:
        value = self._runtime.wait_mapped_counter(index)
        if value == _C.MAPPED_WAIT_DEVICE_ERROR:
            self._check_device_errors()
        if value in (_C.MAPPED_WAIT_TIMEOUT, _C.MAPPED_WAIT_DEVICE_ERROR):
            self._failure = CommTimeoutError(
                f"rank {self.rank_idx}: host wait for the dispatch counts timed out after "
                f"{self.num_cpu_timeout_secs:g} s; the buffer refuses further work until destroy()",
                rank=self.rank_idx,
                operation="dispatch count exchange",
                phase="host wait",
            )
            raise self._failure
        return value

    def _debug_count_dirty_workspace_bytes(self) -> int:
        """Synchronises the current stream; non-zero bytes where the workspace invariant wants zeros."""
        return self._runtime.count_dirty_workspace_bytes(torch.cuda.current_stream().cuda_stream)

    # ----------------------------------------------------------------- public

    def barrier(self, with_cpu_sync: bool = False) -> None:
        """Cross-rank barrier on the current stream; with_cpu_sync waits for it and raises what it saw."""
        self._ensure_usable()
        self._check_device_errors()
        stream = torch.cuda.current_stream(self.device)
        self._runtime.launch_barrier(stream.cuda_stream)
        if with_cpu_sync:
            stream.synchronize()
            self._check_device_errors()

    def get_comm_stream(self) -> torch.cuda.Stream:
        return self._comm_stream

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap recorded on the current stream (pass as previous_event)."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    def local_window_base(self) -> int:
        """Device address of this rank's window (for zero-copy views)."""
        self._ensure_usable()
        return self._runtime.local_base()

    def destroy(self) -> None:
        """Collective teardown: every rank calls it; waits for all ranks to finish using the window first."""
        if self._destroyed:
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._runtime.destroy()
        self._runtime = None
        self._destroyed = True

    def __del__(self) -> None:
        if getattr(self, "_runtime", None) is not None and not getattr(self, "explicitly_destroy", True):
            # Implicit teardown frees this rank's resources without a collective.
            self._runtime.destroy()
            self._runtime = None
