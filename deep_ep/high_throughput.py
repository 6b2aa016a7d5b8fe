"""HighThroughputMixin: ElasticBuffer's high-throughput (HT) dispatch and combine.

The mode follows from the buffer's topology (``ht_mode``): *direct* writes every token straight into
the receive slot of each rank that holds one of its experts (every rank load/store reachable);
*hybrid* (several real or virtual nodes and ``allow_hybrid_mode``) sends a token once per other
node, to the same-rail rank there, over the scale-out transport, and that rank forwards it inside
its node. Both produce the same dispatch outputs bit for bit; hybrid combine sums per node first
(docs/architecture.md). Every kernel receives the call shape as one ``_C.HtCall``, built once per
shape and cached.

Streams follow DeepEP: kernels run on the buffer's communication stream, which first waits for
``previous_event`` (or the caller's stream); outputs are allocated on the communication stream when
``allocate_on_comm_stream``; with ``async_with_compute_stream`` the returned ``EventOverlap`` holds
the event and every tensor the kernels touch, otherwise the caller's stream waits before return.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deep_ep import _C
from deep_ep._util import align_up, cuda_event, describe, pointer
from deep_ep.errors import BufferTooSmallError
from deep_ep.event import EventOverlap, event_or_none, stream_capturing
from deep_ep.failed_input import NULL_HIDDEN, add_note, take_part_without_input
from deep_ep.fp8 import pack_ue8m0_unchecked, unpack_ue8m0
from deep_ep.handle import EPHandle
from deep_ep.plan.estimates import theoretical_num_qps, theoretical_num_sms
from deep_ep.window import window_tensor

__all__ = ["HighThroughputMixin"]

FP8_GROUP_SIZE = 128
UE8M0_PER_WORD = 4  # packed UE8M0 scales: exponent bytes of four groups per int32 word
MAX_TOPK = 32
# Link rate the SM estimate saturates. Ranks on different GPUs: the measured H200 peer copy one
# way (395 GB/s, benchmarks/peer_copy.py, docs/performance.md). Ranks sharing a GPU: "NVLink" is
# the GPU's own memory, so use the device copy class (about half of the 4.3 TB/s read + write
# figure); the estimate is then capped by the per-rank SM share anyway.
NVLINK_GBS = 395.0
SHARED_GPU_GBS = 2000.0
# Effective HBM + NVLink write rate of one SM running our direct kernels, calibrated on 2 x H200
# (a num_sms sweep, docs/performance.md): one SM sustains ~40 GB/s alone but the rate per
# SM falls as SMs are added, and 90 % of the best measured bandwidth needed ~32 SMs where
# DeepEP's 50 GB/s/SM model gives 20. Calibrated so the estimate lands there.
DIRECT_SM_WRITE_GBS = 31.0
# The estimate's default read rate of one SM (get_theoretical_num_sms, sm_read_gbs).
SM_READ_GBS = 200.0


# Per-call-shape constants from the geometry core, memoised: every call would otherwise cross into
# _C and build a fresh dict (the host path of an uncached dispatch is on the critical path).
@functools.lru_cache(maxsize=256)
def _ht_layout(
    num_ranks: int, num_scaleup_ranks: int, num_max_tokens: int, hidden: int, num_topk: int, use_fp8: bool
) -> dict[str, int]:
    return _C.high_throughput_layout(num_ranks, num_scaleup_ranks, num_max_tokens, hidden, num_topk, use_fp8)


@functools.lru_cache(maxsize=64)
def counts_layout(num_ranks: int, num_local: int) -> dict[str, int]:
    return _C.ht_counts_layout(num_ranks, num_local)


_COUNTS_FIELDS = (
    "recv_per_source",
    "psum_per_source",
    "expert_offsets",
    "unaligned_per_expert",
    "expert_start",
    "psum_per_expert",
)


@functools.lru_cache(maxsize=64)
def counts_field_sizes(num_ranks: int, num_local: int) -> tuple[int, ...]:
    """Sizes of the counts fields in layout order (the layout packs them back to back)."""
    layout = counts_layout(num_ranks, num_local)
    bounds = [layout[name] for name in _COUNTS_FIELDS] + [layout["total"]]
    if bounds != sorted(bounds) or bounds[0] != 0:
        raise AssertionError(f"counts layout is not packed in field order: {layout}")
    return tuple(end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True))


def worst_case_rows(
    num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_experts: int, expert_alignment: int
) -> tuple[int, int]:
    """``(N, N')`` of a dispatch without CPU sync (docs/api.md): every rank's T_max tokens, and for
    expand each of them on up to min(K, L) local experts plus each expert's alignment padding."""
    num_local = num_experts // num_ranks
    num_rows = num_ranks * num_max_tokens_per_rank
    worst = num_rows * min(num_topk, num_local) + (expert_alignment - 1) * num_local
    return num_rows, align_up(worst, expert_alignment)


# Placeholder for a handle array allocated once the counts are known (no allocation of its own:
# every torch.empty costs host time on the uncached path).
_NOT_ALLOCATED = torch.empty(0)


def _to_col_major_scales(launch: _CommLaunch, scales: torch.Tensor, device: torch.device) -> torch.Tensor:
    """fp8 scales ``[N, P]`` as DeepEP V2 returns them for TMA: column-major, the token dimension
    padded to a multiple of 4 (a view ``[N, P]`` with strides ``(1, align(N, 4))``); copied on the
    comm stream after the epilogue wrote the row-major ones."""
    num_rows, num_groups = scales.shape
    columns = launch.empty((num_groups, align_up(max(num_rows, 1), 4)), scales.dtype, device)
    with torch.cuda.stream(launch.comm):
        columns[:, num_rows:].zero_()
        columns[:, :num_rows].copy_(scales.t())
    return columns.t()[:num_rows]


def _packed_like_input(launch: _CommLaunch, scales: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The received fp32 scales ``[N, G]`` packed back into int32 UE8M0 words ``[N, G/4]`` (the input's
    format), on the comm stream after the epilogue wrote them. Exact: the kernels copy the powers of
    two that unpacking the input gave, bit for bit."""
    packed = launch.empty((scales.shape[0], scales.shape[1] // UE8M0_PER_WORD), torch.int32, device)
    with torch.cuda.stream(launch.comm):
        packed.copy_(pack_ue8m0_unchecked(scales))
    return packed


def _kernel_ready(tensor: torch.Tensor) -> bool:
    """Contiguous and 16-byte aligned: what the kernels read as rows of 16-byte vectors."""
    return tensor.is_contiguous() and (tensor.numel() == 0 or tensor.data_ptr() % 16 == 0)


class _CommLaunch:
    """One operation's stream protocol: comm waits first, allocations on the chosen stream, and a
    finish() that records the event and either hands it to the caller or makes the caller wait.

    The joins between the caller's stream and comm go through ``Runtime.join_streams`` (an event
    the runtime owns) and streams travel as raw handles: a torch Event and Stream object per call
    cost more host time than the kernels' launches (the host path of every call)."""

    def __init__(
        self, runtime: Any, comm: torch.cuda.Stream, previous_event: Any, allocate_on_comm_stream: bool, device: int
    ) -> None:
        self.runtime = runtime
        self.comm = comm
        self.stream: int = comm.cuda_stream
        self.compute_stream: int = torch._C._cuda_getCurrentRawStream(device)
        if previous_event is not None:
            comm.wait_event(cuda_event(previous_event))
        else:
            runtime.join_streams(self.stream, self.compute_stream)
        # With previous_event the comm stream does not wait for the caller's stream, so memory the
        # caller's stream freed may still be in use there: allocate on comm (and hand the outputs to
        # the caller's stream through record_stream in finish) whatever allocate_on_comm_stream says.
        self.on_comm = allocate_on_comm_stream or previous_event is not None
        # The caller's stream as a torch object, only where record_stream needs one. An int device
        # index keeps torch off its slow device-resolution path.
        self.compute = torch.cuda.current_stream(device) if self.on_comm else None
        self.allocated: list[torch.Tensor] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.on_comm:
            with torch.cuda.stream(self.comm):
                tensor = torch.empty(shape, dtype=dtype, device=device)
        else:  # the caller's stream is current already: no stream switch on the host path
            tensor = torch.empty(shape, dtype=dtype, device=device)
        self.allocated.append(tensor)
        return tensor

    def join_caller(self) -> None:
        """The caller's stream waits for everything queued on comm so far."""
        self.runtime.join_streams(self.compute_stream, self.stream)

    def finish(self, async_with_compute_stream: bool, used: Sequence[torch.Tensor | None]) -> EventOverlap:
        if self.on_comm and not torch.cuda.is_current_stream_capturing():
            # Allocated on comm, handed to the caller's stream: the allocator must not reuse them on
            # comm while the caller still works with them.
            for tensor in self.allocated:
                tensor.record_stream(self.compute)
        if async_with_compute_stream:
            event = torch.cuda.Event()
            event.record(self.comm)
            keep = tuple(tensor for tensor in (*used, *self.allocated) if tensor is not None)
            return EventOverlap(event, extra_tensors=keep)
        self.join_caller()
        return EventOverlap(None)


class HighThroughputMixin:
    """HT dispatch / combine for ElasticBuffer (docs/api.md and the module docstring)."""

    # Set by ElasticBuffer before any method runs.
    _runtime: Any
    _window: dict[str, int]
    _comm_stream: torch.cuda.Stream
    _max_num_sms: int
    _max_ht_num_sms: int
    _ht_host_path: Any = None  # _C.HtHostPath (ElasticBuffer sets it), or None: EP_HT_HOST_PATH=0
    _serial: int
    _torch_device: torch.device
    num_ranks: int
    rank_idx: int
    num_max_tokens_per_rank: int
    num_topk: int
    device: int

    # ------------------------------------------------------------------ estimates

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0.0,
        nvlink_gbs: float = 0.0,
        sm_read_gbs: float = SM_READ_GBS,
        sm_write_gbs: float = 0.0,
    ) -> int:
        """Fewest SMs that keep the bottleneck link saturated for HT (deep_ep.plan.estimates) on this
        buffer's topology (direct: one load/store domain; hybrid: nodes of ``num_scaleup_ranks``),
        capped at this rank's SM share. DeepEP V2's arguments: ``num_scaleout_topk`` must be 0 (the
        model assumes balanced, not node-limited, routing, as V2's does); ``rdma_gbs`` 0: the
        scale-out link is not a bottleneck; ``nvlink_gbs`` 0: this machine's link (H200 NVLink, or
        HBM when ranks share a GPU); ``sm_write_gbs`` 0: the rate calibrated on our kernels."""
        if num_scaleout_topk != 0:
            raise ValueError(
                f"num_scaleout_topk must be 0 (the estimate assumes balanced routing, as DeepEP V2's), "
                f"got {num_scaleout_topk!r}"
            )
        for name, value in (
            ("rdma_gbs", rdma_gbs),
            ("nvlink_gbs", nvlink_gbs),
            ("sm_read_gbs", sm_read_gbs),
            ("sm_write_gbs", sm_write_gbs),
        ):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        return self._num_sms_estimate(num_experts, num_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs)

    def _num_sms_estimate(
        self,
        num_experts: int,
        num_topk: int,
        rdma_gbs: float = 0.0,
        nvlink_gbs: float = 0.0,
        sm_read_gbs: float = SM_READ_GBS,
        sm_write_gbs: float = 0.0,
    ) -> int:
        """get_theoretical_num_sms after its argument checks, cached per arguments: dispatch and
        combine with num_sms=0 call it with the default rates on every call (host time)."""
        cache = self.__dict__.setdefault("_num_sms_estimates", {})
        key = (num_experts, num_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs)
        if key not in cache:
            topology = getattr(self, "topology", None)
            shares_gpu = topology is not None and topology.ranks_per_gpu > 1
            num_scaleout = getattr(self, "num_scaleout_ranks", 1)
            num_sms = theoretical_num_sms(
                num_experts,
                num_topk,
                self.num_ranks,
                self.num_ranks // num_scaleout,
                num_scaleout,
                nvlink_gbs=nvlink_gbs or (SHARED_GPU_GBS if shares_gpu else NVLINK_GBS),
                rdma_gbs=rdma_gbs,
                sm_read_gbs=sm_read_gbs or SM_READ_GBS,
                sm_write_gbs=sm_write_gbs or DIRECT_SM_WRITE_GBS,
                prefer_overlap_with_compute=getattr(self, "prefer_overlap_with_compute", True),
                device_sms=self._max_ht_num_sms,
            )
            cache[key] = min(num_sms, self._max_ht_num_sms)
        if self._ht_host_path is not None and key[2:] == (0.0, 0.0, SM_READ_GBS, 0.0):
            # Only the Python path comes here: from now on the host path resolves num_sms=0 itself.
            self._ht_host_path.remember_num_sms(num_experts, num_topk, cache[key])
        return cache[key]

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """Queue pairs DeepEP would request for ``num_sms`` (informational: none are created here)."""
        return theoretical_num_qps(num_sms, hybrid=getattr(self, "num_scaleout_ranks", 1) > 1)

    # ------------------------------------------------------------------ dispatch

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int = 1,
        num_sms: int = 0,
        handle: EPHandle | None = None,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        previous_event: EventOverlap | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_qps: int = 0,
        previous_event_before_epilogue: EventOverlap | None = None,
        do_handle_copy: bool = True,
        do_zero_padding: bool = True,
        use_tma_aligned_col_major_sf: bool = False,
        zero_copy_recv: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, EPHandle, EventOverlap]:
        """Send each token once to every rank holding one of its experts.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, handle, event)``. ``recv_x`` is bf16
        ``[N, H]`` or ``(fp8 [N, H], fp32 scales [N, H/128])``; rows are ordered by (source rank,
        source token). ``recv_topk_idx`` int64 ``[N, K]`` holds local expert ids (-1 where the
        expert lives elsewhere); ``recv_topk_weights`` fp32 ``[N, K]`` carries all K weights.
        ``do_expand``: one row per (token, local expert), grouped by local expert, each group
        starting at a multiple of ``expert_alignment`` (padding rows zero); ``recv_topk_idx`` is
        None and ``recv_topk_weights`` is ``[N']``.

        ``handle=`` re-dispatches with cached routing (no counting, no CPU sync, CUDA-graph safe;
        ``topk_idx`` must be None, expand/alignment come from the handle). ``do_cpu_sync=False``
        (default True unless cached): outputs get worst-case sizes (``R * T_max`` rows; expand
        ``align(R * T_max * min(K, L) + (a - 1) * L, a)``), only the valid prefix (expand: the
        per-expert segments) is written, and the real counts stay on the device in the handle.

        DeepEP V2's extra arguments: ``cumulative_local_expert_recv_stats`` (int32 ``[L]``, uncached
        only) gets this call's unaligned per-local-expert counts added on the comm stream;
        ``previous_event_before_epilogue``: the copy epilogue also waits for it;
        ``use_tma_aligned_col_major_sf`` (fp8): scales returned column-major, token dimension padded
        to a multiple of 4 (strides ``(1, align(N, 4))``). ``do_handle_copy=False`` (uncached): the
        handle's ``topk_idx`` is the caller's tensor itself, as in V2 (the kernels still read the
        handle's own sanitised copy, so changing that tensor later changes no result); with True
        (default) it is that copy. ``num_qps`` (no RDMA queue pairs here) and ``do_zero_padding``
        (padding rows are always zeroed) are accepted and change nothing.

        ``zero_copy_recv`` (direct mode, non-expand; every rank must pass the same value): senders
        write each row and its fp8 scales straight into their final position in the receiver's
        window, so ``recv_x`` (and its scales) are views of the buffer and the copy epilogue writes
        the per-row metadata only. The views stay valid until the next HT dispatch or combine on
        this buffer is called (work the caller queued on its stream before that call is safe);
        clone them to keep them longer. A cached dispatch with ``zero_copy_recv=True`` needs a
        handle from a zero-copy dispatch.

        Every rank must call with the same hidden size, dtype, K, weights presence and T_max. An
        expert id outside [-1, E), or repeated in a token's row, is treated as -1 and raises
        ValueError at the next synchronisation point (this call's CPU sync, ``check_errors()``,
        ``barrier(with_cpu_sync=True)``); the buffer stays usable. Bad arguments raise at once, after
        this rank took part in the dispatch without data (its peers then see PeerInputError).
        """
        self._ensure_usable()
        self._check_fatal_errors("dispatch" if handle is None else "dispatch (cached)")
        previous_event = event_or_none(previous_event)
        previous_event_before_epilogue = event_or_none(previous_event_before_epilogue)
        if handle is None and (do_cpu_sync is None or bool(do_cpu_sync)) and stream_capturing():
            # Before any launch: nothing of this call runs during capture, so no peer waits for it.
            raise RuntimeError(
                "dispatch with do_cpu_sync=True (the default) cannot be captured in a CUDA graph: the host reads the "
                "received counts before it allocates the outputs. Capture a cached dispatch (handle=), or pass "
                "do_cpu_sync=False (outputs at their worst-case sizes)"
            )
        if (
            self._ht_host_path is not None
            and previous_event is None
            and not async_with_compute_stream
            and not allocate_on_comm_stream
            and cumulative_local_expert_recv_stats is None
            and num_qps == 0
            and previous_event_before_epilogue is None
            and not use_tma_aligned_col_major_sf
            and zero_copy_recv is False
            and type(num_sms) is int
        ):
            # The C++ host path for the everyday arguments (csrc/python/bind_ht_host_path.cpp): None
            # when an argument needs the checks and cases below, before anything was launched.
            result = self._dispatch_on_host_path(
                x,
                topk_idx,
                topk_weights,
                num_experts,
                num_max_tokens_per_rank,
                expert_alignment,
                num_sms,
                handle,
                do_cpu_sync,
                do_expand,
                do_handle_copy,
            )
            if result is not None:
                return result
        try:
            if not isinstance(zero_copy_recv, bool):
                raise TypeError(f"zero_copy_recv must be a bool, got {type(zero_copy_recv).__name__}")
            device = self._torch_device
            data, scales = self._check_dispatch_x(x, device)
            num_tokens, hidden = data.shape
            use_fp8 = scales is not None

            cached = handle is not None
            if cached:
                self._check_cached_dispatch(
                    handle,
                    topk_idx,
                    num_tokens,
                    num_experts,
                    num_max_tokens_per_rank,
                    expert_alignment,
                    do_expand,
                    do_cpu_sync,
                )
                num_experts = handle.num_experts
                num_max_tokens = handle.num_max_tokens_per_rank
                expert_alignment = handle.expert_alignment
                do_expand = handle.do_expand
                do_cpu_sync = False
                routing = handle.routing
            else:
                num_experts = self._check_num_experts(num_experts)
                self._check_topk_idx(topk_idx, num_tokens, device)
                num_max_tokens = self._check_num_max_tokens(num_max_tokens_per_rank, num_tokens)
                if not isinstance(expert_alignment, int) or expert_alignment < 1:
                    raise ValueError(f"expert_alignment must be an int >= 1, got {expert_alignment!r}")
                do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
                routing = topk_idx
            num_topk = routing.shape[1]
            if zero_copy_recv:
                self._check_zero_copy_recv(do_expand, handle)
            self._check_weights("topk_weights", topk_weights, (num_tokens, num_topk), device)
            layout = _ht_layout(self.num_ranks, self.num_scaleup_ranks, num_max_tokens, hidden, num_topk, use_fp8)
            self._check_fits(
                "dispatch",
                layout["dispatch_bytes"],
                T=num_tokens,
                H=hidden,
                K=num_topk,
                T_max=num_max_tokens,
                fp8=use_fp8,
            )
            num_sms = self._resolve_num_sms(num_sms, num_experts, num_topk)
            self._check_previous_event(previous_event)
            self._check_previous_event(previous_event_before_epilogue)
            self._check_num_qps(num_qps)
            if cumulative_local_expert_recv_stats is not None:
                if cached:
                    raise ValueError(
                        "cumulative_local_expert_recv_stats cannot be used with a cached handle= (no count)"
                    )
                self._check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, device)
                stats = cumulative_local_expert_recv_stats
                num_local = num_experts // self.num_ranks
                if stats.dtype != torch.int32 or tuple(stats.shape) != (num_local,):
                    raise ValueError(
                        f"cumulative_local_expert_recv_stats must be int32 [{num_local}] (local experts), "
                        f"got {describe(stats)}"
                    )
        except (ValueError, TypeError) as error:
            # This rank's input is bad, but its peers already run (or will run) this dispatch: take
            # part without data so none of them waits for this rank, then raise.
            self._dispatch_without_input(handle, num_experts, error, zero_copy_recv is True)
            raise

        num_ranks = self.num_ranks
        num_local = num_experts // num_ranks
        call = self._ht_call(num_max_tokens, hidden, num_topk, num_experts, use_fp8, zero_copy_recv=zero_copy_recv)
        launch = _CommLaunch(self._runtime, self._comm_stream, previous_event, allocate_on_comm_stream, self.device)
        input_scales = scales
        packed_scales = scales is not None and scales.dtype == torch.int32
        if packed_scales:
            # The kernels move fp32 scales: unpack the exponents, dispatch, pack the received ones.
            with torch.cuda.stream(launch.comm):  # after what comm waits for; used on comm only
                scales = unpack_ue8m0(scales)
        elif scales is not None and not _kernel_ready(scales):
            with torch.cuda.stream(launch.comm):
                scales = scales.clone(memory_format=torch.contiguous_format)
        if cached:
            new_handle = handle
        else:
            new_handle = self._notify(launch, call, routing, expert_alignment, do_expand, do_cpu_sync, num_sms, device)
            if not do_handle_copy:
                new_handle.keep_caller_topk_idx(topk_idx)
        send_base = pointer(new_handle.zero_copy_send_base) if zero_copy_recv else 0
        _C.ht_dispatch(
            self._runtime,
            call,
            num_tokens,
            pointer(data),
            pointer(scales),
            pointer(new_handle.routing),
            pointer(topk_weights),
            pointer(new_handle.dst_buffer_slot_idx),
            pointer(new_handle.expert_slot_idx),
            send_base,
            pointer(new_handle.hybrid_routing),
            cached,
            num_sms,
            launch.stream,
            False,
        )

        def allocate_meta() -> None:
            """The handle's per-row arrays, at the handle's num_recv_tokens."""
            if do_expand:
                new_handle.recv_expanded_row_idx = launch.empty(
                    (new_handle.num_recv_tokens, num_topk), torch.int32, device
                )
            new_handle.recv_src_info = launch.empty(
                (new_handle.num_recv_tokens, _C.HT_SRC_INFO_COLUMNS), torch.int32, device
            )

        def allocate_outputs(num_rows: int) -> tuple[Any, ...]:
            """(recv_x, recv_scales, recv_topk_idx, recv_topk_weights) of num_rows rows."""
            recv_topk_weights = None
            if topk_weights is not None:
                shape = (num_rows,) if do_expand else (num_rows, num_topk)
                recv_topk_weights = launch.empty(shape, torch.float32, device)
            if zero_copy_recv:  # rows and scales are in final position in the window
                rows_x, rows_scales = self._ht_zero_copy_views(call, data.dtype)
                rows_x, rows_scales = rows_x[:num_rows], None if rows_scales is None else rows_scales[:num_rows]
            else:
                rows_x = launch.empty((num_rows, hidden), data.dtype, device)
                rows_scales = (
                    launch.empty((num_rows, hidden // FP8_GROUP_SIZE), torch.float32, device) if use_fp8 else None
                )
            return (
                rows_x,
                rows_scales,
                None if do_expand else launch.empty((num_rows, num_topk), torch.int64, device),
                recv_topk_weights,
            )

        def epilogue(outputs: tuple[Any, ...]) -> None:
            rows_x, rows_scales, rows_topk_idx, rows_weights = outputs
            _C.ht_dispatch_epilogue(
                self._runtime,
                call,
                do_expand,
                expert_alignment,
                topk_weights is not None,
                pointer(new_handle.counts),
                rows_x.shape[0],
                new_handle.num_recv_tokens,
                pointer(rows_x),
                pointer(rows_scales),
                pointer(rows_topk_idx),
                pointer(rows_weights),
                # A cached dispatch has the same routing: the handle's source info and row map are already right.
                0 if cached else pointer(new_handle.recv_src_info),
                0 if cached else pointer(new_handle.recv_expanded_row_idx),
                self._max_num_sms,
                launch.stream,
            )

        if not cached:
            if do_cpu_sync:
                # The dispatch kernel is already moving data; only the output allocation waits. This
                # is a synchronisation point: what the kernels reported so far is raised here.
                self._read_dispatch_counts(launch.join_caller, new_handle, num_local)
            else:
                new_handle.num_recv_tokens, new_handle.num_expanded_tokens = worst_case_rows(
                    num_ranks, num_max_tokens, num_topk, num_experts, expert_alignment
                )
            allocate_meta()

        num_rows = new_handle.num_expanded_tokens if do_expand else new_handle.num_recv_tokens
        outputs = allocate_outputs(num_rows)
        if cumulative_local_expert_recv_stats is not None:
            with torch.cuda.stream(launch.comm):
                cumulative_local_expert_recv_stats.add_(new_handle.num_unaligned_recv_tokens_per_expert)
        if previous_event_before_epilogue is not None:
            launch.comm.wait_event(cuda_event(previous_event_before_epilogue))
        epilogue(outputs)
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights = outputs
        if packed_scales:
            recv_scales = _packed_like_input(launch, recv_scales, device)
        if use_fp8 and use_tma_aligned_col_major_sf:
            recv_scales = _to_col_major_scales(launch, recv_scales, device)
        used = ()
        if async_with_compute_stream:  # the event keeps them; a synchronous call needs no list
            used = (data, input_scales, scales, topk_idx, topk_weights, cumulative_local_expert_recv_stats)
            used += new_handle.tensors()
        event = launch.finish(async_with_compute_stream, used)
        out_x = (recv_x, recv_scales) if use_fp8 else recv_x
        return out_x, recv_topk_idx, recv_topk_weights, new_handle, event

    def _dispatch_on_host_path(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        num_experts: Any,
        num_max_tokens_per_rank: Any,
        expert_alignment: Any,
        num_sms: int,
        handle: Any,
        do_cpu_sync: Any,
        do_expand: Any,
        do_handle_copy: Any = True,
    ) -> tuple[Any, ...] | None:
        """dispatch through the C++ host path, or None: the Python path takes the call. Cached: one
        call. Uncached: the checks and launches up to the host's wait there, the handle built here
        (while the notify runs), then the wait for the counts, the outputs and the copy epilogue
        there; a failed wait comes back as an int and is raised here."""
        if handle is not None:
            if not (
                type(handle) is EPHandle
                and handle.owner_id == self._serial
                and topk_idx is None
                and not do_cpu_sync
                and num_experts is None
                and num_max_tokens_per_rank is None
                and expert_alignment == 1
                and do_expand is False
            ):
                return None
            compute = torch._C._cuda_getCurrentRawStream(self.device)
            outputs = self._ht_host_path.cached_dispatch(self._runtime, x, topk_weights, handle, num_sms, compute)
            if outputs is None:
                return None
            recv_x, recv_scales, recv_topk_idx, recv_topk_weights = outputs
            out_x = recv_x if recv_scales is None else (recv_x, recv_scales)
            return out_x, recv_topk_idx, recv_topk_weights, handle, EventOverlap(None)
        if num_experts is None:
            num_experts = getattr(self, "num_experts", 0)
        if num_max_tokens_per_rank is None:
            num_max_tokens_per_rank = self.num_max_tokens_per_rank
        if (
            type(num_experts) is not int
            or type(num_max_tokens_per_rank) is not int
            or type(expert_alignment) is not int
            or type(do_expand) is not bool
        ):
            return None
        do_cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
        max_topk = min(MAX_TOPK, self.num_topk) if getattr(self, "num_topk", 0) > 0 else MAX_TOPK
        compute = torch._C._cuda_getCurrentRawStream(self.device)
        host_path = self._ht_host_path
        begun = host_path.begin_dispatch(
            self._runtime,
            x,
            topk_idx,
            topk_weights,
            num_experts,
            num_max_tokens_per_rank,
            expert_alignment,
            do_expand,
            do_cpu_sync,
            num_sms,
            max_topk,
            compute,
        )
        if begun is None:
            return None
        call, num_sms, block = begun
        num_topk = topk_idx.shape[1]
        handle = self._handle_from_notify_block(call, block, expert_alignment, do_expand, do_cpu_sync, num_sms)
        if not do_handle_copy:
            handle.keep_caller_topk_idx(topk_idx)
        if not do_cpu_sync:
            handle.num_recv_tokens, handle.num_expanded_tokens = worst_case_rows(
                self.num_ranks, num_max_tokens_per_rank, num_topk, num_experts, expert_alignment
            )
        # With do_cpu_sync the host path waits for the counts and fills the handle's sizes itself.
        outputs = host_path.finish_dispatch(
            self._runtime, call, handle, do_expand, expert_alignment, topk_weights is not None, do_cpu_sync, compute
        )
        if type(outputs) is int:
            comm = self._comm_stream.cuda_stream
            self._raise_dispatch_count_failure(lambda: self._runtime.join_streams(compute, comm), outputs)
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights = outputs
        out_x = recv_x if recv_scales is None else (recv_x, recv_scales)
        return out_x, recv_topk_idx, recv_topk_weights, handle, EventOverlap(None)

    def _read_dispatch_counts(self, join_caller: Callable[[], None], handle: EPHandle, num_local: int) -> None:
        """The host wait for an uncached dispatch's counts (a synchronisation point: what the kernels
        reported so far is raised here); fills the handle's sizes."""
        try:
            self._wait_mapped_counter(_C.HT_MAPPED_READY)
            values = self._runtime.read_mapped_counters(0, _C.HT_MAPPED_ALIGNED_EXPERT_COUNTS + num_local)
            self._check_device_errors()
        except BaseException:
            # The kernels may still run and read the handle's arrays and the inputs: order whatever
            # the caller does next (freeing them included) after them.
            join_caller()
            raise
        handle.num_recv_tokens = values[_C.HT_MAPPED_NUM_RECV_TOKENS]
        handle.num_expanded_tokens = values[_C.HT_MAPPED_NUM_EXPANDED_TOKENS]
        handle.num_recv_tokens_per_expert_list = list(values[_C.HT_MAPPED_ALIGNED_EXPERT_COUNTS :])

    def _raise_dispatch_count_failure(self, join_caller: Callable[[], None], wait_value: int) -> None:
        """The host path's wait for the counts ended on a timeout or found an error the kernels
        recorded (``wait_value``: what the wait returned): raise it as _read_dispatch_counts does."""
        try:
            self._check_mapped_wait(wait_value)
            self._check_device_errors()
            raise RuntimeError(f"the host path reported a failed count wait ({wait_value}) with no error recorded")
        except BaseException:
            join_caller()
            raise

    def _notify(
        self,
        launch: _CommLaunch,
        call: Any,
        topk_idx: torch.Tensor,
        expert_alignment: int,
        do_expand: bool,
        do_cpu_sync: bool,
        num_sms: int,
        device: torch.device,
    ) -> EPHandle:
        """Launch the notify kernel and build the handle around its outputs (sizes filled in later)."""
        num_tokens = topk_idx.shape[0]
        # One allocation split into the handle's arrays (csrc/python/bind_ht_host_path.cpp,
        # NotifyBlock): each torch.empty costs host time on the uncached path, which the GPU waits for.
        block = _C.ht_notify_block(
            launch.empty((_C.ht_notify_block_ints(call, num_tokens),), torch.int32, device), call, num_tokens
        )
        routing, expert_slot, dst_slot, counts, *_, hybrid_routing, send_base, rank_prefix_matrix, scratch = block
        if do_cpu_sync:
            self._runtime.reset_mapped_counter(_C.HT_MAPPED_READY)
        _C.ht_notify(
            self._runtime,
            call,
            pointer(topk_idx),
            pointer(routing),
            num_tokens,
            expert_alignment,
            do_expand,
            pointer(expert_slot),
            pointer(dst_slot),
            pointer(scratch),
            pointer(counts),
            do_cpu_sync,
            pointer(send_base),
            pointer(rank_prefix_matrix),
            pointer(hybrid_routing),
            num_sms,
            launch.stream,
            False,
        )
        return self._handle_from_notify_block(call, block, expert_alignment, do_expand, do_cpu_sync, num_sms)

    def _handle_from_notify_block(
        self, call: Any, block: tuple, expert_alignment: int, do_expand: bool, do_cpu_sync: bool, num_sms: int
    ) -> EPHandle:
        """The handle around the notify block's arrays (_C.ht_notify_block); sizes filled in later."""
        (
            routing,
            expert_slot,
            dst_slot,
            counts,
            recv_per_source,
            psum_per_source,
            expert_offsets,
            unaligned,
            expert_start,
            psum_per_expert,
            hybrid_routing,
            send_base,
            rank_prefix_matrix,
            _,
        ) = block
        num_tokens, num_topk = routing.shape
        return EPHandle(
            do_expand=do_expand,
            num_experts=call.num_experts,
            expert_alignment=expert_alignment,
            num_max_tokens_per_rank=call.num_max_tokens_per_rank,
            num_sms=num_sms,
            topk_idx=routing,
            num_recv_tokens=0,
            num_expanded_tokens=0,
            num_recv_tokens_per_expert_list=[],
            psum_num_recv_tokens_per_source=psum_per_source,
            psum_num_recv_tokens_per_expert=psum_per_expert,
            num_unaligned_recv_tokens_per_expert=unaligned,
            recv_src_info=_NOT_ALLOCATED,  # allocated once the sizes are known
            dst_buffer_slot_idx=dst_slot,
            num_ranks=self.num_ranks,
            num_tokens=num_tokens,
            num_topk=num_topk,
            is_exact=do_cpu_sync,
            expert_slot_idx=expert_slot,
            num_recv_tokens_per_scaleup_rank=recv_per_source,
            expert_offsets_per_source=expert_offsets,
            expert_start=expert_start,
            recv_expanded_row_idx=None,
            counts=counts,
            owner_id=self._serial,
            hybrid_routing=hybrid_routing,
            num_nodes=call.num_nodes if call.hybrid else 1,
            scaleout_row_bytes=call.scaleout_row_bytes,
            home_node=self.scaleout_rank_idx if call.hybrid else 0,
            zero_copy_send_base=send_base,
            rank_prefix_matrix=rank_prefix_matrix,
        )

    # ------------------------------------------------------------------ combine

    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        *,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
        num_sms: int = 0,
        previous_event: EventOverlap | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        num_qps: int = 0,
        previous_event_before_epilogue: EventOverlap | None = None,
        zero_copy: bool = False,
        sum_topk_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Sum, for each token this rank dispatched, the rows it produced (plus ``bias``: a tensor or
        up to two), in fp32 in a fixed order, rounded to bf16 once: bitwise reproducible. The order
        is DeepEP V2's: the biases, then one term per destination rank in ascending order of the
        rank's last top-k lane of the token (expand rows pre-summed per rank in top-k lane order and
        rounded to bf16); see docs/api.md.

        ``x``: bf16 ``[N, H]`` (``[N', H]`` after an expand dispatch). ``topk_weights``: fp32
        ``[N, K]`` (expand ``[N']``); ``combined_topk_weights[t, k]`` is the weight of slot k sent by
        the rank owning expert k (0 for -1). Weighting is the caller's job (as in DeepEP).
        ``previous_event_before_epilogue``: the reduce kernel also waits for it; ``num_qps`` is
        accepted (no RDMA queue pairs here). In hybrid mode the sum runs per node first
        (docs/architecture.md).

        ``zero_copy=True`` (a buffer built with ``zero_copy_combine=True``, direct mode, a handle of a
        ``zero_copy_recv=True`` non-expand dispatch): ``x`` is ``get_combine_input_buffer(handle)``,
        already holding the expert outputs, and each home rank reads its tokens' rows from the
        peers' windows (one pass instead of three; bitwise the same result). Every rank must pass the
        same value.

        ``sum_topk_weights=True`` (DeepEP V1's rule, what ``deep_ep.Buffer.combine`` returns):
        ``combined_topk_weights[t, k]`` is instead the fp32 sum, from +0.0 over the ranks that
        received token t in ascending order, of slot k of the row each passed in ``topk_weights``
        (all K slots, whatever experts they name; hybrid mode: per node first, then over nodes, as
        V1's internode combine). Every rank must pass the same value.
        Returns ``(combined_x [T, H] bf16, combined_topk_weights [T, K] or None, event)``.
        """
        self._ensure_usable()
        self._check_fatal_errors("combine")
        previous_event = event_or_none(previous_event)
        previous_event_before_epilogue = event_or_none(previous_event_before_epilogue)
        if (
            self._ht_host_path is not None
            and type(handle) is EPHandle
            and handle.owner_id == self._serial
            and bias is None
            and zero_copy is False
            and previous_event is None
            and not async_with_compute_stream
            and not allocate_on_comm_stream
            and num_qps == 0
            and previous_event_before_epilogue is None
            and type(num_sms) is int
            and type(sum_topk_weights) is bool
        ):
            # The C++ host path, as in dispatch.
            outputs = self._ht_host_path.combine(
                self._runtime,
                x,
                topk_weights,
                handle,
                num_sms,
                sum_topk_weights,
                torch._C._cuda_getCurrentRawStream(self.device),
            )
            if outputs is not None:
                return outputs[0], outputs[1], EventOverlap(None)
        try:
            if not isinstance(zero_copy, bool):
                raise TypeError(f"zero_copy must be a bool, got {type(zero_copy).__name__}")
            if not isinstance(sum_topk_weights, bool):
                raise TypeError(f"sum_topk_weights must be a bool, got {type(sum_topk_weights).__name__}")
            if not isinstance(handle, EPHandle):
                raise TypeError(f"handle must be the EPHandle returned by dispatch, got {type(handle).__name__}")
            self._check_handle_owner(handle)
            device = self._torch_device
            num_rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
            what = "expanded rows (handle.num_expanded_tokens)" if handle.do_expand else "rows (handle.num_recv_tokens)"
            self._check_tensor("x", x, device)
            if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] != num_rows:
                raise ValueError(f"x must be bfloat16 [{num_rows}, H] (one row per received {what}), got {describe(x)}")
            hidden = x.shape[1]
            if hidden == 0 or hidden % 8 != 0:
                raise ValueError(f"x hidden size must be a positive multiple of 8 (16-byte rows), got H={hidden}")
            weights_shape = (num_rows,) if handle.do_expand else (num_rows, handle.num_topk)
            self._check_weights("topk_weights", topk_weights, weights_shape, device)
            biases = self._check_bias(bias, handle.num_tokens, hidden, device)
            num_max_tokens = handle.num_max_tokens_per_rank
            layout = _ht_layout(self.num_ranks, self.num_scaleup_ranks, num_max_tokens, hidden, handle.num_topk, False)
            self._check_fits(
                "combine",
                layout["combine_bytes"],
                T=handle.num_tokens,
                H=hidden,
                K=handle.num_topk,
                T_max=num_max_tokens,
            )
            num_sms = self._resolve_num_sms(num_sms or handle.num_sms, handle.num_experts, handle.num_topk)
            self._check_previous_event(previous_event)
            self._check_previous_event(previous_event_before_epilogue)
            self._check_num_qps(num_qps)
            if zero_copy:
                pull_call = self._zero_copy_combine_call(handle, hidden)
                if x.data_ptr() != self._ht_combine_input_views(pull_call)[0].data_ptr():
                    raise ValueError(
                        "combine(zero_copy=True) needs x = get_combine_input_buffer(handle) (the expert outputs "
                        "written into the buffer's combine input rows), got another tensor"
                    )
        except (ValueError, TypeError) as error:
            self._combine_without_input(x, handle, error, zero_copy is True)
            raise
        if zero_copy:
            return self._pull_combine(
                pull_call,
                handle,
                topk_weights,
                biases,
                num_sms,
                previous_event,
                async_with_compute_stream,
                allocate_on_comm_stream,
                previous_event_before_epilogue,
                sum_topk_weights,
            )

        launch = _CommLaunch(self._runtime, self._comm_stream, previous_event, allocate_on_comm_stream, self.device)
        combined_x = launch.empty((handle.num_tokens, hidden), torch.bfloat16, device)
        combined_weights = None
        if topk_weights is not None:
            combined_weights = launch.empty((handle.num_tokens, handle.num_topk), torch.float32, device)
        call = self._ht_call(num_max_tokens, hidden, handle.num_topk, handle.num_experts, False, combine_only=True)
        _C.ht_combine(
            self._runtime,
            call,
            handle.do_expand,
            pointer(x),
            pointer(topk_weights),
            sum_topk_weights,
            pointer(handle.counts),
            pointer(handle.recv_src_info),
            pointer(handle.recv_expanded_row_idx),
            handle.recv_src_info.shape[0],
            handle.num_tokens,
            pointer(handle.routing),
            pointer(handle.hybrid_routing),
            num_sms,
            launch.stream,
            False,
        )
        if previous_event_before_epilogue is not None:
            launch.comm.wait_event(cuda_event(previous_event_before_epilogue))
        _C.ht_combine_reduce(
            self._runtime,
            call,
            handle.num_tokens,
            pointer(handle.routing),
            pointer(biases[0]),
            pointer(biases[1]),
            pointer(combined_x),
            pointer(combined_weights),
            sum_topk_weights,
            self._max_num_sms,
            launch.stream,
        )
        event = launch.finish(async_with_compute_stream, (x, topk_weights, *biases, *handle.tensors()))
        return combined_x, combined_weights, event

    def get_combine_input_buffer(self, handle: EPHandle, hidden: int | None = None) -> torch.Tensor:
        """Zero-copy combine: the bf16 ``[N, H]`` rows of this buffer's window that take this rank's
        expert outputs (row i: the output for received row i of ``handle``), to be filled by the
        caller and passed to ``combine(x=..., handle, zero_copy=True)``. Needs a buffer built with
        ``zero_copy_combine=True`` (direct mode) and a handle of a ``zero_copy_recv=True``,
        non-expand dispatch. ``hidden``: default the buffer's. The rows are disjoint from the
        dispatch's receive rows (a zero-copy ``recv_x`` may be read while they are written); the
        caller must not write them while a zero-copy combine that reads them runs (write them on the
        stream the combine is called from)."""
        self._ensure_usable()
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be the EPHandle returned by dispatch, got {type(handle).__name__}")
        self._check_handle_owner(handle)
        call = self._zero_copy_combine_call(handle, getattr(self, "hidden", 0) if hidden is None else hidden)
        return self._ht_combine_input_views(call)[0][: handle.num_recv_tokens]

    def _zero_copy_combine_call(self, handle: EPHandle, hidden: Any) -> Any:
        """The call shape of a zero-copy combine with ``handle``, after its checks (ValueError /
        BufferTooSmallError naming the rule)."""
        scaleout = getattr(self, "num_scaleout_ranks", 1)
        if scaleout > 1:
            raise ValueError(f"zero-copy combine is direct mode only; this buffer spans {scaleout} nodes")
        if handle.do_expand:
            raise ValueError("zero-copy combine needs a non-expand handle (do_expand=False)")
        if handle.zero_copy_send_base is None:
            raise ValueError(
                "zero-copy combine needs a handle of a zero_copy_recv=True dispatch (its rows' positions at every "
                "rank come from it)"
            )
        if not isinstance(hidden, int) or hidden <= 0 or hidden % 8 != 0:
            raise ValueError(f"hidden must be a positive multiple of 8, got {hidden!r}")
        num_max_tokens = handle.num_max_tokens_per_rank
        call = self._ht_call(num_max_tokens, hidden, handle.num_topk, handle.num_experts, False, combine_only=True)
        available = self._window["ht_bytes"]
        if call.zero_copy_combine_bytes > available:
            raise BufferTooSmallError(
                f"HT zero-copy combine (H={hidden}, K={handle.num_topk}, T_max={num_max_tokens}) needs "
                f"{call.zero_copy_combine_bytes} bytes of the HT region, the buffer has {available}; build the "
                "buffer with zero_copy_combine=True (and these settings) or a larger num_bytes",
                needed_bytes=call.zero_copy_combine_bytes,
                available_bytes=available,
            )
        return call

    def _ht_window_rows(self, offset: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """A view of this rank's HT region at ``offset`` (built once per place; callers narrow). The
        views keep the runtime (the window's owner) alive, not the buffer: no reference cycle."""
        cache = self.__dict__.setdefault("_ht_window_row_cache", {})
        key = (offset, shape, dtype)
        view = cache.get(key)
        if view is None:
            base, start = self._runtime.local_base(), self._window["ht_offset"]
            view = cache[key] = window_tensor(self._runtime, base, start + offset, shape, dtype, self._torch_device)
        return view

    def _ht_zero_copy_views(self, call: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's final receive rows of a zero-copy call shape: ``[R * T_max, H]`` in ``dtype``
        and ``[R * T_max, H / 128]`` fp32 scales (None for bf16)."""
        rows = self.num_ranks * call.num_max_tokens_per_rank
        payload = self._ht_window_rows(call.zero_copy_payload_offset, (rows, call.hidden), dtype)
        if not call.use_fp8:
            return payload, None
        shape = (rows, call.hidden // FP8_GROUP_SIZE)
        return payload, self._ht_window_rows(call.zero_copy_scales_offset, shape, torch.float32)

    def _ht_combine_input_views(self, call: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's combine input rows ``[R * T_max, H]`` bf16 and weights ``[R * T_max, K]`` fp32."""
        rows = self.num_ranks * call.num_max_tokens_per_rank
        return (
            self._ht_window_rows(call.combine_input_offset, (rows, call.hidden), torch.bfloat16),
            self._ht_window_rows(call.combine_input_weights_offset, (rows, call.num_topk), torch.float32),
        )

    def _pull_combine(
        self,
        call: Any,
        handle: EPHandle,
        topk_weights: torch.Tensor | None,
        biases: tuple[torch.Tensor | None, torch.Tensor | None],
        num_sms: int,
        previous_event: EventOverlap | None,
        async_with_compute_stream: bool,
        allocate_on_comm_stream: bool,
        previous_event_before_epilogue: EventOverlap | None,
        sum_topk_weights: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """Zero-copy combine after the checks: the weights go next to the rows, then one kernel."""
        device = self._torch_device
        launch = _CommLaunch(self._runtime, self._comm_stream, previous_event, allocate_on_comm_stream, self.device)
        if previous_event_before_epilogue is not None:
            launch.comm.wait_event(cuda_event(previous_event_before_epilogue))
        combined_x = launch.empty((handle.num_tokens, call.hidden), torch.bfloat16, device)
        combined_weights = None
        if topk_weights is not None:
            combined_weights = launch.empty((handle.num_tokens, handle.num_topk), torch.float32, device)
            rows = self._ht_combine_input_views(call)[1][: handle.num_recv_tokens]
            with torch.cuda.stream(launch.comm):  # the peers read them after the kernel's entry barrier
                rows.copy_(topk_weights)
        _C.ht_combine_pull(
            self._runtime,
            call,
            handle.num_tokens,
            pointer(handle.routing),
            pointer(handle.dst_buffer_slot_idx),
            pointer(handle.zero_copy_send_base),
            pointer(biases[0]),
            pointer(biases[1]),
            pointer(combined_x),
            pointer(combined_weights),
            sum_topk_weights,
            num_sms,
            launch.stream,
            False,
        )
        event = launch.finish(async_with_compute_stream, (topk_weights, *biases, *handle.tensors()))
        return combined_x, combined_weights, event

    # ------------------------------------------------------------------ failed input

    def _dispatch_without_input(
        self, handle: Any, num_experts: Any, error: Exception, zero_copy_recv: bool = False
    ) -> None:
        """Take part in this dispatch with no token (deep_ep/failed_input.py). The protocol the peers
        run follows from ``handle``: cached (the dispatch kernel's entry barrier) or not (the notify
        count exchange, which needs the group's E: without a valid one this rank cannot take part;
        with ``zero_copy_recv`` in direct mode it adds the exchange of final-row offsets)."""
        cached = handle is not None
        # Hybrid, cached, with this buffer's handle: the dispatch runs on the handle's routing without
        # data, so the forwarders of other nodes learn that this rank's row streams carry nothing
        # instead of waiting for them (and its own forwarder keeps its signals in step).
        own_handle = isinstance(handle, EPHandle) and handle.owner_id == self._serial
        if not cached:
            try:
                num_experts = self._check_num_experts(num_experts)
            except ValueError:
                add_note(error, "this rank could not take part in the dispatch (no valid num_experts): peers time out")
                return
        num_ranks = self.num_ranks
        # The peers' T_max, as far as this rank can tell (a hybrid forwarder keeps their rows).

        def launch(stream: int, keep: Any) -> None:
            if cached and own_handle and handle.hybrid_routing is not None:
                call = self._ht_call(
                    handle.num_max_tokens_per_rank, NULL_HIDDEN, handle.num_topk, handle.num_experts, False
                )
                keep(*handle.tensors())
                routing = (
                    pointer(handle.routing),
                    pointer(handle.dst_buffer_slot_idx),
                    pointer(handle.expert_slot_idx),
                    pointer(handle.hybrid_routing),
                )
                _C.ht_dispatch(
                    self._runtime,
                    call,
                    handle.num_tokens,
                    0,
                    0,
                    routing[0],
                    0,
                    *routing[1:3],
                    0,
                    routing[3],
                    True,
                    1,
                    stream,
                    True,
                )
                return
            num_max_tokens = handle.num_max_tokens_per_rank if cached else max(1, self.num_max_tokens_per_rank)
            # Peers in hybrid mode refuse zero-copy receive (and take part without input too).
            zero_copy = zero_copy_recv and not cached and getattr(self, "num_scaleout_ranks", 1) == 1
            call = self._ht_call(
                num_max_tokens, NULL_HIDDEN, 1, num_ranks if cached else num_experts, False, zero_copy_recv=zero_copy
            )
            hybrid = torch.zeros((_C.ht_hybrid_routing_ints(call, 0),), dtype=torch.int32, device=self._torch_device)
            keep(hybrid)
            if not cached:
                counts_ints = counts_layout(num_ranks, num_experts // num_ranks)["total"]
                send_base_ints = num_ranks if zero_copy else 0
                scratch = torch.empty(
                    (counts_ints + send_base_ints + _C.ht_notify_scratch_ints(call, 0),),
                    dtype=torch.int32,
                    device=self._torch_device,
                )
                keep(scratch)
                _C.ht_notify(
                    self._runtime,
                    call,
                    0,
                    0,
                    0,
                    1,
                    False,
                    0,
                    0,
                    scratch.data_ptr() + 4 * (counts_ints + send_base_ints),
                    scratch.data_ptr(),
                    False,
                    scratch.data_ptr() + 4 * counts_ints if zero_copy else 0,
                    0,  # no rank prefix matrix (this rank's send counts still go to its window)
                    pointer(hybrid) if call.hybrid else 0,
                    1,
                    stream,
                    True,
                )
            no_data = (0, 0, 0, 0, 0, 0, 0, 0)  # num_tokens, x, scales, topk_idx, weights, dst/expert slot, send base
            hybrid_block = pointer(hybrid) if call.hybrid else 0
            _C.ht_dispatch(self._runtime, call, *no_data, hybrid_block, cached, 1, stream, True)

        take_part_without_input(self, error, launch)

    def _combine_without_input(self, x: Any, handle: Any, error: Exception, zero_copy: bool = False) -> None:
        """Take part in this combine without data (deep_ep/failed_input.py). With this buffer's own
        handle and a known hidden size, every row this rank owes goes out as zeros (its experts count
        as absent in the peers' results); otherwise no row is sent and the peers' slots for this rank
        hold stale data (their PeerInputError says the result must not be used). The push kernel
        passes the same barriers as the zero-copy (pull) one, so it serves both; with ``zero_copy``
        this rank's combine input rows are zeroed first, since its peers read them."""
        valid_handle = isinstance(handle, EPHandle) and handle.owner_id == self._serial
        hidden = self._combine_hidden_guess(x)
        zero_rows = valid_handle and hidden > 0
        pull_rows: tuple[torch.Tensor, ...] = ()
        if zero_copy and zero_rows:
            try:
                pull_call = self._zero_copy_combine_call(handle, hidden)
                pull_rows = tuple(view[: handle.num_recv_tokens] for view in self._ht_combine_input_views(pull_call))
            except ValueError:
                pull_rows = ()

        def launch(stream: int, keep: Any) -> None:
            if pull_rows:
                # Rows and weights: the peers read both (zero weights, as the push path sends for a failed input).
                with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                    for view in pull_rows:
                        view.zero_()
            if zero_rows:
                call = self._ht_call(
                    handle.num_max_tokens_per_rank,
                    hidden,
                    handle.num_topk,
                    handle.num_experts,
                    False,
                    combine_only=True,
                )
            else:
                call = self._ht_call(max(1, self.num_max_tokens_per_rank), NULL_HIDDEN, 1, self.num_ranks, False)
            hybrid = handle.hybrid_routing if zero_rows else None
            if call.hybrid and hybrid is None:
                hybrid = torch.zeros(
                    (_C.ht_hybrid_routing_ints(call, 0),), dtype=torch.int32, device=self._torch_device
                )
                keep(hybrid)
            if zero_rows:
                keep(*handle.tensors())
            _C.ht_combine(
                self._runtime,
                call,
                handle.do_expand if zero_rows else False,
                0,
                0,
                False,
                pointer(handle.counts) if zero_rows else 0,
                pointer(handle.recv_src_info) if zero_rows else 0,
                0,
                handle.recv_src_info.shape[0] if zero_rows else 0,
                handle.num_tokens if zero_rows else 0,
                pointer(handle.routing) if zero_rows else 0,
                pointer(hybrid),
                1,
                stream,
                True,
            )

        take_part_without_input(self, error, launch)
        if not zero_rows:
            add_note(error, "it sent no combine row: the peers' results hold stale data for its experts")

    def _combine_hidden_guess(self, x: Any) -> int:
        """The hidden size the peers combine with, as far as this rank can tell (0: unknown)."""
        if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] > 0 and x.shape[1] % 8 == 0:
            if getattr(self, "hidden", 0) in (0, x.shape[1]):
                return int(x.shape[1])
        return 0

    # ------------------------------------------------------------------ validation

    def _ht_call(
        self,
        num_max_tokens: int,
        hidden: int,
        num_topk: int,
        num_experts: int,
        use_fp8: bool,
        combine_only: bool = False,
        zero_copy_recv: bool = False,
    ) -> Any:
        """The call description of one shape on this buffer (topology, layout), built once and cached.
        ``combine_only``: for combine, which must fit only the combine footprint (an fp8 dispatch's
        region may be too small for bf16 dispatch rows). ``zero_copy_recv``: rows in final position."""
        key = (num_max_tokens, hidden, num_topk, num_experts, use_fp8, combine_only, zero_copy_recv)
        calls = self.__dict__.setdefault("_ht_calls", {})
        call = calls.get(key)
        if call is None:
            call = calls[key] = _C.ht_call(
                self._runtime, num_max_tokens, hidden, num_topk, num_experts, use_fp8, combine_only, zero_copy_recv
            )
        return call

    def _check_zero_copy_recv(self, do_expand: bool, handle: EPHandle | None) -> None:
        scaleout = getattr(self, "num_scaleout_ranks", 1)
        if scaleout > 1:
            raise ValueError(
                f"zero_copy_recv=True is direct mode only; this buffer spans {scaleout} nodes (hybrid mode, whose "
                "forwarders place the rows)"
            )
        if do_expand:
            raise ValueError(
                "zero_copy_recv=True returns non-expand rows only (do_expand=True places each row per expert in the "
                "copy epilogue)"
            )
        if handle is not None and handle.zero_copy_send_base is None:
            raise ValueError(
                "zero_copy_recv=True with a handle from a dispatch without zero_copy_recv (it has no final-row "
                "offsets): make the handle with a zero_copy_recv=True dispatch"
            )

    def _check_handle_owner(self, handle: EPHandle) -> None:
        if handle.owner_id != self._serial:
            raise ValueError(
                "handle comes from a dispatch of another buffer: its slots and counts describe that buffer's "
                "window; pass it to the buffer that dispatched"
            )

    def _check_tensor(self, name: str, tensor: Any, device: torch.device, any_strides: bool = False) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        # get_device() is an int (-1 on the CPU): cheaper than building tensor.device per check.
        if not tensor.is_cuda or tensor.get_device() != device.index:
            raise ValueError(f"{name} must be on this buffer's device {device}, got {tensor.device}")
        if any_strides:
            return
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {list(tensor.stride())} for {describe(tensor)}")
        if tensor.numel() > 0 and tensor.data_ptr() % 16 != 0:
            address = tensor.data_ptr()
            raise ValueError(
                f"{name} must start at a 16-byte aligned address (rows move as 16-byte vectors), got address "
                f"{address:#x} ({address % 16} bytes past a 16-byte boundary; .clone() gives an aligned copy)"
            )

    def _check_dispatch_x(self, x: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(x, torch.Tensor):
            self._check_tensor("x", x, device)
            if x.dtype != torch.bfloat16 or x.dim() != 2:
                raise ValueError(f"x must be bfloat16 [T, H] or an (fp8, scales) pair, got {describe(x)}")
            if x.shape[1] == 0 or x.shape[1] % 8 != 0:
                raise ValueError(f"x hidden size must be a positive multiple of 8 (16-byte rows), got H={x.shape[1]}")
            return x, None
        if not isinstance(x, (tuple, list)) or len(x) != 2:
            raise TypeError(f"x must be a bfloat16 tensor or an (fp8, scales) pair, got {type(x).__name__}")
        data, scales = x
        self._check_tensor("x[0]", data, device)
        # Scales may come with any strides (TMA-aligned quantisers hand them over column-major, as
        # DeepEP V2 accepts): dispatch copies them to a packed tensor on the comm stream.
        self._check_tensor("x[1]", scales, device, any_strides=True)
        if data.dtype != torch.float8_e4m3fn or data.dim() != 2:
            raise ValueError(f"x[0] must be float8_e4m3fn [T, H], got {describe(data)}")
        if data.shape[1] == 0 or data.shape[1] % FP8_GROUP_SIZE != 0:
            raise ValueError(
                f"x[0] hidden size must be a positive multiple of {FP8_GROUP_SIZE} for fp8 (one scale per "
                f"{FP8_GROUP_SIZE} channels), got H={data.shape[1]}"
            )
        expected = [data.shape[0], data.shape[1] // FP8_GROUP_SIZE]
        packed = scales.dtype == torch.int32
        if packed:
            expected = [data.shape[0], expected[1] // UE8M0_PER_WORD]  # packed UE8M0 exponents
        packable = data.shape[1] % (UE8M0_PER_WORD * FP8_GROUP_SIZE) == 0
        if (
            scales.dtype not in (torch.float32, torch.int32)
            or list(scales.shape) != expected
            or (packed and not packable)
        ):
            raise ValueError(
                f"x[1] (scales) must be float32 [T, H/128] or, with H % 512 == 0, int32 [T, H/512] (packed UE8M0 "
                f"exponents, four per word): expected {expected}, got {describe(scales)}"
            )
        return data, scales

    def _check_num_experts(self, num_experts: Any) -> int:
        if num_experts is None:
            num_experts = getattr(self, "num_experts", 0) or None
        if num_experts is None:
            raise ValueError("num_experts must be given (the buffer was not built with num_experts)")
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts > _C.MAX_EXPERTS:
            raise ValueError(f"num_experts must be an int in [1, {_C.MAX_EXPERTS}], got {num_experts!r}")
        if num_experts % self.num_ranks != 0:
            raise ValueError(
                f"num_experts ({num_experts}) must be a multiple of num_ranks ({self.num_ranks}): "
                "experts are split evenly over ranks"
            )
        return num_experts

    def _check_topk_idx(self, topk_idx: Any, num_tokens: int, device: torch.device) -> None:
        if topk_idx is None:
            raise ValueError("topk_idx must be given unless handle= is passed (cached dispatch), got None")
        self._check_tensor("topk_idx", topk_idx, device)
        if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
            raise ValueError(f"topk_idx must be int64 [{num_tokens}, K] (T from x), got {describe(topk_idx)}")
        num_topk = topk_idx.shape[1]
        sized_for = self.num_topk if getattr(self, "num_topk", 0) > 0 else MAX_TOPK
        if not 1 <= num_topk <= min(MAX_TOPK, sized_for):
            raise ValueError(
                f"topk_idx K must be in [1, {min(MAX_TOPK, sized_for)}] (at most {MAX_TOPK}, and at most the "
                f"num_topk={sized_for} the buffer was sized for), got K={num_topk}"
            )

    def _check_num_max_tokens(self, num_max_tokens_per_rank: Any, num_tokens: int) -> int:
        num_max_tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
        if not isinstance(num_max_tokens, int) or num_max_tokens < 1:
            raise ValueError(
                f"num_max_tokens_per_rank must be an int >= 1 (per call, or the buffer's), got {num_max_tokens!r}"
            )
        if num_tokens > num_max_tokens:
            raise ValueError(
                f"x has T={num_tokens} tokens, more than num_max_tokens_per_rank={num_max_tokens} "
                "(T must not exceed T_max)"
            )
        return num_max_tokens

    def _check_weights(self, name: str, weights: Any, shape: tuple[int, ...], device: torch.device) -> None:
        if weights is None:
            return
        self._check_tensor(name, weights, device)
        if weights.dtype != torch.float32 or tuple(weights.shape) != shape:
            raise ValueError(f"{name} must be float32 {list(shape)}, got {describe(weights)}")

    def _check_bias(
        self, bias: Any, num_tokens: int, hidden: int, device: torch.device
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if bias is None:
            return None, None
        terms = [bias] if isinstance(bias, torch.Tensor) else list(bias)
        if len(terms) > 2:
            raise ValueError(f"bias must be a tensor or a pair of tensors, got {len(terms)} entries")
        checked: list[torch.Tensor] = []
        for index, term in enumerate(terms):
            if term is None:
                continue
            name = "bias" if isinstance(bias, torch.Tensor) else f"bias[{index}]"
            self._check_tensor(name, term, device)
            if term.dtype != torch.bfloat16 or list(term.shape) != [num_tokens, hidden]:
                raise ValueError(f"{name} must be bfloat16 [{num_tokens}, {hidden}], got {describe(term)}")
            checked.append(term)
        checked += [None] * (2 - len(checked))
        return checked[0], checked[1]

    def _check_cached_dispatch(
        self,
        handle: Any,
        topk_idx: Any,
        num_tokens: int,
        num_experts: Any,
        num_max_tokens_per_rank: Any,
        expert_alignment: Any,
        do_expand: Any,
        do_cpu_sync: Any,
    ) -> None:
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle returned by dispatch, got {type(handle).__name__}")
        self._check_handle_owner(handle)
        if topk_idx is not None:
            raise ValueError(
                f"topk_idx must be None with handle= (cached dispatch reuses the handle's routing), got "
                f"{describe(topk_idx) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__}"
            )
        if do_cpu_sync:
            raise ValueError("do_cpu_sync=True cannot be used with handle= (a cached dispatch never syncs)")
        if num_tokens != handle.num_tokens:
            raise ValueError(f"x must have the handle's T={handle.num_tokens} tokens with handle=, got T={num_tokens}")
        for name, given, cached in (
            ("num_experts", num_experts, handle.num_experts),
            ("num_max_tokens_per_rank", num_max_tokens_per_rank, handle.num_max_tokens_per_rank),
        ):
            if given is not None and given != cached:
                raise ValueError(f"{name}={given} differs from the handle's {cached}")
        if expert_alignment != 1 and expert_alignment != handle.expert_alignment:
            raise ValueError(f"expert_alignment={expert_alignment} differs from the handle's {handle.expert_alignment}")
        if do_expand and not handle.do_expand:
            raise ValueError("do_expand=True with a handle from a non-expand dispatch")

    def _check_fits(self, operation: str, needed: int, **shape: Any) -> None:
        available = self._window["ht_bytes"]
        if needed > available:
            details = ", ".join(f"{key}={value}" for key, value in shape.items())
            raise BufferTooSmallError(
                f"HT {operation} ({details}) needs {needed} bytes of the HT region, the buffer has {available}; "
                "build the buffer with these settings (or a larger num_bytes)",
                needed_bytes=needed,
                available_bytes=available,
            )

    def _resolve_num_sms(self, num_sms: Any, num_experts: int, num_topk: int) -> int:
        if not isinstance(num_sms, int) or num_sms < 0:
            raise ValueError(f"num_sms must be an int >= 0 (0 = estimate), got {num_sms!r}")
        if num_sms == 0:
            return self._num_sms_estimate(num_experts, num_topk)  # the default rates need no checks
        if num_sms > self._max_ht_num_sms:
            raise ValueError(
                f"num_sms={num_sms} exceeds this rank's SM cap for HT kernels, {self._max_ht_num_sms} (all device "
                "SMs with one rank per GPU; with ranks sharing a GPU, half of each rank's share, so that the "
                "ranks' communication CTAs can be resident at once beside compute)"
            )
        return num_sms

    def _check_num_qps(self, num_qps: Any) -> None:
        """DeepEP V2's per-call queue-pair count: no RDMA queue pairs exist here, so any value within
        what the buffer "allocated" is accepted and changes nothing."""
        if not isinstance(num_qps, int) or num_qps < 0:
            raise ValueError(f"num_qps must be an int >= 0 (0 = estimate), got {num_qps!r}")
        allocated = getattr(self, "num_allocated_qps", 0)
        if allocated and num_qps > allocated:
            raise ValueError(f"num_qps={num_qps} exceeds num_allocated_qps={allocated}")

    @staticmethod
    def _check_previous_event(previous_event: Any) -> None:
        if previous_event is None:
            return
        if not isinstance(previous_event, (EventOverlap, torch.cuda.Event)):
            raise TypeError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
