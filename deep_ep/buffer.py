"""ElasticBuffer: the symmetric window shared by all EP ranks, and the entry point of every operation.

Construction is collective over the torch process group: every rank gathers every rank's facts
(host, GPU, settings), agrees on the topology and the backend, allocates the same window and
exchanges handles. HT dispatch/combine come from HighThroughputMixin, the decode path from
LowLatencyMixin; this file owns construction, sizing, errors and teardown.
"""

from __future__ import annotations

import collections
import itertools
import os
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist

from deep_ep import _C, phase_clock
from deep_ep.domains import local_rank_facts
from deep_ep.errors import CommTimeoutError, PeerInputError, recent_calls_message, timeout_message
from deep_ep.event import EventOverlap
from deep_ep.handle import EPHandle
from deep_ep.high_throughput import HighThroughputMixin
from deep_ep.low_latency import LowLatencyMixin
from deep_ep.topology import (
    build_topology,
    choose_backend,
    choose_scaleout_transport,
    emulated_ranks_per_node,
    gpu_is_shared,
    ht_sm_cap,
    ll_uses_scaleout,
    mps_is_running,
    requested_backend,
    requested_ll_scaleout,
    requested_scaleout_transport,
    sm_cap,
)

__all__ = ["ElasticBuffer", "EPHandle"]

_comm_streams: dict[int, torch.cuda.Stream] = {}
CALL_LOG_LENGTH = 8  # calls a timeout report lists
_warned_no_mps = False
_warned_lazy_loading = False
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


def _invalid_entry_message(record: dict[str, Any]) -> str:
    expert, token, operation = record["invalid_expert"], record["invalid_token"], record["invalid_operation"]
    if record["invalid_kind"] == "duplicate":
        return (
            f"topk_idx row {token} selects expert {expert} more than once (detected on the device by {operation}); "
            "only its first slot counted, the repeats were treated as -1"
        )
    return (
        f"topk_idx contains expert id {expert} outside [-1, {record['num_experts']}) at row {token} (detected on "
        f"the device by {operation}; that entry was treated as -1)"
    )


def _outcome(action: Any) -> tuple[Any, tuple[str, str] | None]:
    """(result, None) or (None, (exception type name, message)) of ``action()``."""
    try:
        return action(), None
    except Exception as error:  # noqa: BLE001 - reported to every rank by the caller
        return None, (type(error).__name__, str(error))


def _raise_if_any_rank_failed(step: str, errors: list[tuple[str, str] | None]) -> None:
    """Raise on every rank alike when any rank's entry is an error: ValueError / TypeError when
    every failing rank raised that type (a bad argument), else RuntimeError."""
    failed = {rank: error for rank, error in enumerate(errors) if error is not None}
    if not failed:
        return
    kinds = {kind for kind, _ in failed.values()}
    error_type: type[Exception] = RuntimeError
    if kinds == {"ValueError"} or kinds == {"BufferTooSmallError"}:
        error_type = ValueError
    elif kinds == {"TypeError"}:
        error_type = TypeError
    details = "; ".join(f"rank {rank}: {kind}: {message}" for rank, (kind, message) in sorted(failed.items()))
    raise error_type(f"ElasticBuffer construction failed at {step} on rank(s) {sorted(failed)}: {details}")


class ElasticBuffer(HighThroughputMixin, LowLatencyMixin):
    """Symmetric-memory buffer for expert-parallel dispatch and combine (docs/api.md).

    ``deterministic`` is accepted for DeepEP compatibility: results are always deterministic here
    (receive order is (source rank, source token) by construction, sums run in a fixed order), so
    ``deterministic=False`` changes nothing.
    """

    # Ranks another buffer of this rank (the V1 Buffer's LL window) has masked: destroy() skips its
    # closing barrier for them too.
    _ranks_masked_elsewhere: tuple[int, ...] = ()

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
        num_cpu_bytes: int = 0,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        enable_rank_masking: bool = False,
        zero_copy_combine: bool = False,
    ) -> None:
        self._runtime: Any = None
        self._serial = next(_buffer_serials)
        self._destroyed = False
        self._failure: CommTimeoutError | None = None
        # The last calls (serial, name, monotonic time), for timeout reports: a hang report of every
        # rank then says which call each one had reached.
        self._calls: collections.deque[tuple[int, str, float]] = collections.deque(maxlen=CALL_LOG_LENGTH)
        self._num_calls = 0
        if not torch.cuda.is_available():
            raise RuntimeError("ElasticBuffer needs a CUDA device; none is available")
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.device = torch.cuda.current_device()
        self._torch_device = torch.device("cuda", self.device)  # built once: the call paths compare against it

        # Construction is collective: a rank that raised alone would leave the others blocked in the
        # next exchange. Every check that can differ between ranks therefore runs before an exchange
        # every rank joins, and every rank raises the same error, naming the failing rank(s).
        settings: dict[str, Any] = {}
        local_error: tuple[str, str] | None = None
        try:
            settings = self._check_settings(
                num_bytes=num_bytes,
                num_max_tokens_per_rank=num_max_tokens_per_rank,
                hidden=hidden,
                num_topk=num_topk,
                use_fp8_dispatch=use_fp8_dispatch,
                num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                num_experts=num_experts,
                allow_hybrid_mode=allow_hybrid_mode,
                allow_multiple_reduction=allow_multiple_reduction,
                num_gpu_timeout_secs=num_gpu_timeout_secs,
                num_cpu_timeout_secs=num_cpu_timeout_secs,
                backend=backend,
                num_ranks_per_node=num_ranks_per_node,
                num_cpu_bytes=num_cpu_bytes,
                sl_idx=sl_idx,
                num_allocated_qps=num_allocated_qps,
                enable_rank_masking=enable_rank_masking,
                zero_copy_combine=zero_copy_combine,
            )
        except (ValueError, TypeError) as error:
            local_error = (type(error).__name__, str(error))
        facts = local_rank_facts()
        gathered: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(gathered, (facts, settings, local_error), group=group)
        _raise_if_any_rank_failed("settings check", [item[2] for item in gathered])
        for name, value in settings.items():
            if name == "num_cpu_timeout_secs":  # a host-side wait of this rank alone
                continue
            values = [item[1][name] for item in gathered]
            if any(other != value for other in values):
                raise ValueError(f"every rank must pass the same {name}; got {values} (index = rank)")
        all_facts = [item[0] for item in gathered]
        if settings["num_cpu_bytes"]:
            raise NotImplementedError(
                f"num_cpu_bytes={num_cpu_bytes}: the host-memory segment (DeepEP V2's Engram storage) is "
                "not implemented"
            )
        # DeepEP V2's RDMA knobs: sl_idx (InfiniBand service level) needs a GIN traffic class, which
        # NCCL 2.28 does not have, and queue pairs do not exist here (GIN manages its connections).
        # Both are recorded; num_allocated_qps bounds the per-call num_qps as in V2.
        self.sl_idx = sl_idx
        self.num_allocated_qps = num_allocated_qps

        self.allow_hybrid_mode = allow_hybrid_mode
        self.allow_multiple_reduction = allow_multiple_reduction
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        self.deterministic = deterministic
        self.explicitly_destroy = explicitly_destroy
        self.num_gpu_timeout_secs = settings["num_gpu_timeout_secs"]
        self.num_cpu_timeout_secs = settings["num_cpu_timeout_secs"]
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.hidden = hidden
        self.num_topk = num_topk
        self.use_fp8_dispatch = use_fp8_dispatch
        self.zero_copy_combine = zero_copy_combine
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.num_experts = num_experts
        backend = settings["backend"]

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
        # LL reaches other nodes through the scale-out transport: across hosts always, between the
        # virtual nodes of one host on request (EP_LL_SCALEOUT=1); otherwise by load/store.
        self.ll_scaleout = ll_uses_scaleout(
            num_max_dispatch_tokens_per_rank > 0,
            topology.num_scaleout_ranks,
            topology.spans_hosts,
            settings["ll_scaleout"],
        )
        # HT mode follows from the topology: hybrid when allowed and there is more than one node.
        self.ht_mode = "hybrid" if topology.num_scaleout_ranks > 1 else "direct"
        self.scaleout_transport = (
            choose_scaleout_transport(topology.spans_hosts, settings["scaleout_transport"], backend=self.backend)
            if self.ht_mode == "hybrid"
            else None
        )
        self._max_num_sms = sm_cap(facts.sm_count, topology.ranks_per_gpu)
        self._max_ht_num_sms = ht_sm_cap(facts.sm_count, topology.ranks_per_gpu)
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
            global _warned_lazy_loading
            if os.environ.get("CUDA_MODULE_LOADING", "LAZY").upper() != "EAGER" and not _warned_lazy_loading:
                _warned_lazy_loading = True
                warnings.warn(
                    f"{topology.ranks_per_gpu} ranks share GPU {self.device} with lazy CUDA module loading "
                    f"(CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', 'unset')}): under MPS a rank's "
                    "first launch of a kernel (torch's too) can wait for a peer kernel that spins until this rank "
                    "arrives, until the wait deadline. deep_ep loads its own kernels here; set "
                    "CUDA_MODULE_LOADING=EAGER in the ranks' environment before CUDA starts (deep_ep.testing.launch "
                    "does) to load the rest up front",
                    stacklevel=2,
                )

        ht_region, ll_region = self._region_bytes(num_bytes)
        self._window = _C.window_layout(ht_region, ll_region)
        self.num_bytes = self._window["total_bytes"]
        self._comm_stream = _comm_stream(self.device)
        # The C++ host path of HT dispatch (uncached and cached) and combine with everyday arguments
        # (one binding call, two for an uncached dispatch, instead of ~50 µs of Python checks,
        # allocations and launches); EP_HT_HOST_PATH=0 keeps every call on the Python path (A/B
        # measurements, debugging).
        self._ht_host_path = (
            _C.HtHostPath(self.device, self._comm_stream.cuda_stream, self._max_num_sms, self._max_ht_num_sms)
            if os.environ.get("EP_HT_HOST_PATH", "1") != "0"
            else None
        )
        self._phase_clock = settings["phase_clock"]  # EP_PHASE_CLOCK=1: kernels stamp their phases
        self._connect(ht_region, ll_region)
        self.enable_rank_masking = settings["enable_rank_masking"]
        if self.enable_rank_masking:
            self._ll_rank_mask = torch.zeros(self.num_ranks, dtype=torch.int32, device=self._torch_device)
        if _env_flag("EP_BUFFER_DEBUG"):
            print(
                f"[deep_ep rank {self.rank_idx}] backend={self.backend} window={self.num_bytes} B "
                f"(HT {self._window['ht_bytes']} B, LL {self._window['ll_bytes']} B) "
                f"scaleout={self.num_scaleout_ranks} scaleup={self.num_scaleup_ranks} "
                f"sm_cap={self._max_num_sms} ht_sm_cap={self._max_ht_num_sms}",
                flush=True,
            )

    @staticmethod
    def _check_settings(
        *,
        num_bytes: int | None,
        num_max_tokens_per_rank: int,
        hidden: int,
        num_topk: int,
        use_fp8_dispatch: bool,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        allow_hybrid_mode: bool,
        allow_multiple_reduction: bool,
        num_gpu_timeout_secs: float | None,
        num_cpu_timeout_secs: float | None,
        backend: str | None,
        num_ranks_per_node: int | None,
        num_cpu_bytes: int = 0,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        enable_rank_masking: bool = False,
        zero_copy_combine: bool = False,
    ) -> dict[str, Any]:
        """This rank's settings, resolved from arguments and environment; raises on a bad one. Every
        rank must end up with the same values (the window has one size and layout everywhere)."""
        if not allow_multiple_reduction:
            raise ValueError(
                "allow_multiple_reduction=False is not supported: combine always sums a rank's rows for a token "
                "before sending them (one bf16 rounding per rank)"
            )
        if not isinstance(sl_idx, int) or not 0 <= sl_idx <= 15:
            raise ValueError(f"sl_idx must be an InfiniBand service level in [0, 15], got {sl_idx!r}")
        for name, value in (
            ("num_cpu_bytes", num_cpu_bytes),
            ("num_allocated_qps", num_allocated_qps),
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
        if enable_rank_masking and num_max_dispatch_tokens_per_rank <= 0:
            raise ValueError(
                "enable_rank_masking=True masks ranks in low-latency operations only: it needs a low-latency region "
                f"(num_max_dispatch_tokens_per_rank > 0), got num_max_dispatch_tokens_per_rank="
                f"{num_max_dispatch_tokens_per_rank}"
            )
        if not isinstance(zero_copy_combine, bool):
            raise TypeError(f"zero_copy_combine must be a bool, got {type(zero_copy_combine).__name__}")
        if num_bytes is not None and (num_bytes <= 0 or num_bytes % _C.WINDOW_ALIGN_BYTES != 0):
            raise ValueError(f"num_bytes must be a positive multiple of 2 MiB (2097152), got {num_bytes}")
        return {
            "num_bytes": num_bytes,
            "num_max_tokens_per_rank": num_max_tokens_per_rank,
            "hidden": hidden,
            "num_topk": num_topk,
            "use_fp8_dispatch": use_fp8_dispatch,
            "zero_copy_combine": zero_copy_combine,
            "num_max_dispatch_tokens_per_rank": num_max_dispatch_tokens_per_rank,
            "num_experts": num_experts,
            "allow_hybrid_mode": allow_hybrid_mode,
            "backend": requested_backend(backend),
            "num_ranks_per_node": emulated_ranks_per_node(num_ranks_per_node),
            "scaleout_transport": requested_scaleout_transport(),
            "ll_scaleout": requested_ll_scaleout(),
            "phase_clock": phase_clock.requested(),
            "num_cpu_bytes": num_cpu_bytes,
            "num_allocated_qps": num_allocated_qps,
            "enable_rank_masking": bool(enable_rank_masking),
            "num_gpu_timeout_secs": float(num_gpu_timeout_secs),
            "num_cpu_timeout_secs": float(num_cpu_timeout_secs),
        }

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
            # A dispatch stages its routing in shared memory: a size no call could run is refused here.
            _C.check_low_latency_dispatch_fits(
                self.num_ranks,
                self.num_max_dispatch_tokens_per_rank,
                self.hidden,
                self.num_experts,
                self.num_topk,
                self.ll_scaleout,
            )
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
                    self.zero_copy_combine,
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
        zero_copy_combine: bool = False,
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
            num_ranks, scaleup, num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch, zero_copy_combine
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
        """Window allocation and peer mapping, in steps every rank joins: after each step the ranks
        agree on its outcome before any of them enters the next collective one."""
        backend = self.backend

        def create() -> Any:
            return _C.Runtime(
                self.rank_idx,
                self.num_ranks,
                self.num_scaleup_ranks,
                self.device,
                ht_region,
                ll_region,
                self.num_gpu_timeout_secs,
                self.num_cpu_timeout_secs,
                backend,
                self._max_num_sms,
                self.scaleout_transport or "lsa",
                self._max_ht_num_sms,
                self.ll_scaleout,
                self._phase_clock,
            )

        try:
            self._runtime = self._agree("window allocation" if backend == "ipc" else "runtime setup", create)
            if backend == "ipc":
                handle = self._agree("IPC handle export", self._runtime.ipc_handle)
                handles: list[Any] = [None] * self.num_ranks
                dist.all_gather_object(handles, handle, group=self.group)
                self._agree("peer mapping", lambda: self._runtime.connect_ipc(handles))
            else:
                created: list[Any] = [None]
                if self.rank_idx == 0:
                    created = [_outcome(_C.Runtime.create_nccl_unique_id)]
                dist.broadcast_object_list(created, src=dist.get_global_rank(self.group, 0), group=self.group)
                unique_id, error = created[0]
                _raise_if_any_rank_failed("NCCL unique id", [error] + [None] * (self.num_ranks - 1))
                self._agree("NCCL communicator", lambda: self._runtime.connect_nccl(unique_id))
                self._agree("window allocation", self._runtime.allocate_nccl_window)
                self._agree("window registration", self._runtime.register_nccl_window)
        except BaseException:
            # Nothing of a failed construction stays allocated.
            if self._runtime is not None:
                self._runtime.destroy()
                self._runtime = None
            raise

    def _agree(self, step: str, action: Any) -> Any:
        """Run ``action`` on this rank, then learn every rank's outcome; all raise alike if any failed."""
        result, error = _outcome(action)
        outcomes: list[Any] = [None] * self.num_ranks
        dist.all_gather_object(outcomes, error, group=self.group)
        _raise_if_any_rank_failed(f"{step} ({self.backend} backend)", outcomes)
        return result

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

    def _check_fatal_errors(self, call: str | None = None) -> None:
        """Raise a timeout the kernels recorded (no synchronisation). Every call starts with this
        check and nothing else: a report that is not fatal (a bad routing entry, a peer's failed
        input) is raised only at a synchronisation point, because raising it here would make this
        rank skip an operation its peers run, and their kernels would wait for it until the timeout.
        ``call`` names the call for the call log (timeout reports list the last ones)."""
        if call is not None:
            self._num_calls += 1
            self._calls.append((self._num_calls, call, time.monotonic()))
            # The kernels of this call carry its serial; one binding call sets it and reads the record.
            fatal = self._runtime.begin_call(self._num_calls)
        else:
            fatal = self._runtime.has_fatal_error()
        if fatal:
            self._raise_timeout(self._runtime.error_record())

    def _raise_timeout(self, record: dict[str, Any]) -> None:
        names = {serial: name for serial, name, _ in self._calls}
        self._failure = CommTimeoutError(
            timeout_message(record, self.num_gpu_timeout_secs, names)
            + recent_calls_message(self._calls, time.monotonic()),
            rank=record["rank"],
            peer=record["peer"],
            operation=record["operation"],
            phase=record["phase"],
            expected=record["expected"],
            seen=record["seen"],
            peer_progress=record.get("peer_progress", -1),
            call_serial=record.get("call_serial", 0),
        )
        raise self._failure

    def _check_device_errors(self) -> None:
        """Raise everything the kernels recorded so far (no synchronisation): a timeout as
        CommTimeoutError; otherwise a peer's failed input as PeerInputError and this rank's bad
        routing entries as ValueError (both cleared once raised; the buffer stays usable)."""
        if not self._runtime.has_error():
            return
        record = self._runtime.error_record()
        if record["status"] > 0:
            self._raise_timeout(record)
        messages = []
        if record["invalid_status"] > 0:
            self._runtime.clear_invalid_input()
            messages.append(_invalid_entry_message(record))
        if record["peer_failed_status"] > 0:
            self._runtime.clear_peer_failed()
            peer = record["peer_failed_rank"]
            operation = record["peer_failed_operation"]
            what = "lacks its rows (sent as zeros, or not at all)" if "combine" in operation else "lacks its tokens"
            messages.insert(
                0,
                f"rank {peer}'s input to {operation} failed its checks (rank {peer} raised the details): it took "
                f"part without data, so this rank's result of that operation {what} and must not be used; the "
                "buffer stays usable",
            )
            raise PeerInputError("; ".join(messages), rank=peer, operation=operation)
        if messages:
            raise ValueError("; ".join(messages))

    def check_errors(self) -> None:
        """Wait for this rank's queued work (current and communication streams), then raise what it
        reported: CommTimeoutError, PeerInputError (a peer's input failed, so this rank's result of
        that operation is incomplete) or ValueError (a bad expert id in this rank's topk_idx). The
        synchronisation point for paths that never sync with the host (LL, cached HT, combine)."""
        self._ensure_usable()
        torch.cuda.current_stream(self.device).synchronize()
        self._comm_stream.synchronize()
        self._check_device_errors()

    def _wait_mapped_counter(self, index: int) -> int:
        value = self._runtime.wait_mapped_counter(index)
        self._check_mapped_wait(value)
        return value

    def _check_mapped_wait(self, value: int) -> None:
        """Raise what a host wait on a mapped counter ended on, when it was a timeout or a device error."""
        if value == _C.MAPPED_WAIT_DEVICE_ERROR:
            self._check_device_errors()
        if value in (_C.MAPPED_WAIT_TIMEOUT, _C.MAPPED_WAIT_DEVICE_ERROR):
            what = (
                f"timed out after {self.num_cpu_timeout_secs:g} s"
                if value == _C.MAPPED_WAIT_TIMEOUT
                else "ended on a device error whose record could not be read"
            )
            self._failure = CommTimeoutError(
                f"rank {self.rank_idx}: host wait for the dispatch counts {what}; the buffer refuses further work "
                "until destroy()" + recent_calls_message(self._calls, time.monotonic()),
                rank=self.rank_idx,
                operation="dispatch count exchange",
                phase="host wait",
            )
            raise self._failure

    def _debug_count_dirty_workspace_bytes(self) -> int:
        """Synchronises the current stream; non-zero bytes where the workspace invariant wants zeros."""
        return self._runtime.count_dirty_workspace_bytes(torch.cuda.current_stream().cuda_stream)

    # ----------------------------------------------------------------- public

    def barrier(self, with_cpu_sync: bool = False, *, use_comm_stream: bool = False, sequential: bool = True) -> None:
        """Cross-rank barrier on the current stream (``use_comm_stream``: on the communication
        stream); with_cpu_sync waits for it and raises what the kernels reported until then (a
        synchronisation point, like check_errors()). ``sequential`` (DeepEP V2: a one-SM barrier
        rather than its two-SM hybrid variant) is accepted; there is one barrier kernel here."""
        self._ensure_usable()
        self._check_fatal_errors("barrier")
        stream = self._comm_stream if use_comm_stream else torch.cuda.current_stream(self.device)
        self._runtime.launch_barrier(stream.cuda_stream)
        if with_cpu_sync:
            stream.synchronize()
            self._check_device_errors()

    def get_comm_stream(self) -> torch.cuda.Stream:
        return self._comm_stream

    def get_physical_domain_size(self) -> tuple[int, int]:
        """(nodes, ranks per node) as the hardware groups them (virtual nodes count as nodes)."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> tuple[int, int]:
        """(scale-out ranks, scale-up ranks) the HT kernels use: (nodes, ranks per node) in hybrid
        mode, (1, R) in direct mode."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

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
        """Collective teardown: every rank calls it. A closing barrier through the window (not the
        torch group: no torch collective can end up paired with another one) makes every rank wait
        until its peers have finished using its window. After a timeout a peer may be gone, so the
        barrier is skipped; if the barrier itself times out, the window is freed all the same. Both
        say so in a warning."""
        if self._destroyed:
            return
        self._destroyed = True
        # Without destroy(), dropping the buffer frees the window as soon as the last reference to
        # the runtime goes (the buffer's, or a zero-copy view's: views hold the runtime, not the
        # buffer, so no reference cycle leaves it to Python's cyclic GC). No barrier then.
        runtime, self._runtime = self._runtime, None
        if runtime is None:
            return
        try:
            torch.cuda.synchronize(self.device)
            if self._failure is not None:
                warnings.warn(
                    f"destroy(): skipped the closing barrier after {self._failure.operation} timed out waiting for "
                    f"rank {self._failure.peer} (that rank may be gone); this rank's window is freed",
                    stacklevel=2,
                )
                return
            masked = sorted(set(self._ll_masked_ranks()) | set(self._ranks_masked_elsewhere))
            if masked:
                warnings.warn(
                    f"destroy(): skipped the closing barrier: this rank has masked rank(s) {masked} (they may be "
                    "gone); this rank's window is freed",
                    stacklevel=2,
                )
                return
            stream = torch.cuda.current_stream(self.device)
            runtime.launch_barrier(stream.cuda_stream)
            stream.synchronize()
            record = runtime.error_record()
            if record["status"] > 0:
                warnings.warn(
                    f"destroy(): the closing barrier timed out after {self.num_gpu_timeout_secs:g} s waiting for "
                    f"rank {record['peer']}; this rank's window is freed anyway (a peer still using it would fault)",
                    stacklevel=2,
                )
        finally:
            runtime.destroy()
