"""``Buffer``: DeepEP V1's API as a thin layer over ``ElasticBuffer`` (one for the high-throughput
calls, a second for the low-latency ones).

Clients written for DeepEP V1 (``deep_ep.Buffer``) switch by changing an import. Every data movement
is the core's (``ElasticBuffer.dispatch`` / ``combine`` / ``low_latency_dispatch`` /
``low_latency_combine``); this module only translates arguments, sizes and return values:

* **Sizing.** V1 clients pass byte budgets (``num_nvl_bytes``, ``num_rdma_bytes``), not a token cap.
  The HT window's region is ``num_nvl_bytes + num_rdma_bytes`` rounded up to 2 MiB
  (:func:`window_num_bytes`); with ``low_latency_mode=True`` it is ``num_nvl_bytes`` alone and
  ``num_rdma_bytes`` is the budget of the low-latency window (deep_ep.compat.config's hints size them that
  way). Each HT call's token cap ``T_max`` is the *capacity* of that region for the call's shape:
  the largest ``T_max`` whose dispatch and combine footprints (the core's geometry,
  ``_C.high_throughput_layout``) fit (:func:`token_capacity`). It depends only on the group, the
  region and ``(H, K, fp8)``, so it is the same on every rank, and every rank may pass its own
  ``T <= T_max``. A larger ``T`` raises :class:`deep_ep.BufferTooSmallError` naming the bytes needed.
* **Low latency** (``low_latency_mode=True``). The core sizes its LL region from
  ``(num_max_dispatch_tokens_per_rank, hidden, num_experts)``, which V1 clients only pass to the
  first ``low_latency_dispatch``. That first call (collective, like every LL call) therefore builds
  a second ``ElasticBuffer`` over the same group holding only the LL region, sized exactly for the
  call's ``(T_ll, H, E)`` (``get_low_latency_rdma_size_hint``, top-k ``min(32, E)``); it raises
  ``BufferTooSmallError`` on every rank when that exceeds ``num_rdma_bytes``, and ``RuntimeError``
  inside CUDA-graph capture (building a window allocates and exchanges handles: make the first LL
  call eagerly, then capture). Later calls must pass the same ``(T_ll, H, E)`` (``ValueError``
  naming both). Results are V1's: rows of each local expert packed in ``[0, recv_count)``, fp8
  scales column-major, a 5-entry handle (:class:`LowLatencyDispatchHandle`), an ``EventOverlap``
  always. Differences: rows of an expert are ordered by (source rank, source token), V1's by
  arrival; ``clean_low_latency_buffer`` cleans nothing (the core's LL signals are epoch-tagged and
  never need cleaning) but builds the LL window when no LL call did yet; ``zero_copy`` changes
  nothing (combine always reads ``x`` in place); ``use_logfmt`` is not provided.
* **Results with V1's meanings.** ``recv_topk_idx`` holds local expert ids and -1 elsewhere; the
  weights of -1 slots are zeroed (the core forwards all K). With ``num_worst_tokens > 0`` there is no
  CPU sync: outputs have exactly ``num_worst_tokens`` rows, rows past the received count have
  ``recv_topk_idx = -1`` and weight 0.
* **Routing by rank.** A dispatch without ``topk_idx`` (DeepEP's own tests start with one) sends
  each token to the ranks ``is_token_in_rank`` marks (:func:`routing_from_ranks`: one expert id
  per marked rank) and counts experts from ``num_tokens_per_expert`` as V1 does (one all-gather over
  the group when it syncs with the CPU).
* **Handles.** :class:`DispatchHandle` wraps the core's ``EPHandle``; it is accepted back by
  ``dispatch(handle=)`` and ``combine`` and indexable like V1's tuple where we can give V1's value
  exactly (see its docstring). V1's ``rank_prefix_matrix`` (``handle[0]``) comes from the core's
  notify kernel on one node (each rank reads every peer's send counts during the count exchange,
  no extra collective); in hybrid mode it is an attribute after a CPU-synced dispatch without
  ``topk_idx``, and :meth:`Buffer.gather_rank_prefix_matrix` computes it with one explicit
  collective otherwise.
* **Streams.** As V1: kernels on the communication stream; ``async_finish`` returns an event
  (``async_with_compute_stream`` in the core), otherwise the caller's stream waits. With
  ``previous_event`` the comm stream waits for that event only, so new tensors are allocated on the
  comm stream (whatever ``allocate_on_comm_stream`` says) and handed to the caller's stream with
  ``record_stream``: memory the caller's stream freed is never reused while that stream may still
  use it (the core does the same).
* **Rank masking** as V1's ``enable_shrink`` mode (needs ``low_latency_mode=True``): the LL window
  is built with ``enable_rank_masking``; a low-latency wait that times out masks the peer instead
  of failing, and the ``low_latency_*_mask_buffer`` calls update, query and clean the mask (before
  the first LL call the mask is kept here and applied when the window is built).
* **Permissions and tuning** accepted as V1 clients pass them: ``allow_mnnvl`` and ``use_fabric``
  permit load/store sharing across a multi-node NVLink domain and fabric memory handles; the core
  shares windows wherever the ranks are load/store reachable (one host here) and runs hybrid mode
  between hosts, so on one host they change nothing. ``num_qps_per_rank`` and
  ``allow_nvlink_for_low_latency_mode`` (no RDMA queue pairs exist here; every LL peer is load/store
  reachable) and the chunk sizes of a V1 ``Config`` (V1's ring-buffer tuning; only ``config.num_sms``
  maps onto the core) are accepted without effect.
* **Not backed** (raise ``NotImplementedError`` naming the option, never ignored): ``comm`` and
  ``use_logfmt``.

Failure semantics are the core's (docs/api.md, "When something goes wrong"): when this layer refuses
a call's arguments it first takes part in the operation without data, like the core does, so the
peers never wait for this rank, then raises. The first ``low_latency_dispatch`` agrees with its
peers before building anything (one exchange over the group): when any rank's arguments fail, every
rank raises (the failing ones their own error, the others ``PeerInputError`` naming them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from deep_ep import _C
from deep_ep._util import cuda_event, describe_with_device
from deep_ep.buffer import ElasticBuffer
from deep_ep.compat import config as v1_config
from deep_ep.compat.capacity import (
    bytes_for_tokens,
    low_latency_window_bytes,
    non_negative_int,
    token_capacity,
    window_num_bytes,
)
from deep_ep.compat.handles import DispatchHandle, LowLatencyDispatchHandle
from deep_ep.compat.layout import check_layout_inputs, dispatch_layout, routing_from_ranks
from deep_ep.compat.outputs import v1_dispatch_outputs
from deep_ep.compat.streams import Streams
from deep_ep.compiled_archs import sass_architectures
from deep_ep.errors import BufferTooSmallError, PeerInputError
from deep_ep.event import EventOverlap, event_or_none, stream_capturing
from deep_ep.low_latency import LowLatencyHandle, check_rank_to_mask
from deep_ep.window import window_tensor

__all__ = ["Buffer", "check_unbacked_options"]


# V1's default SM count for HT kernels (Buffer.num_sms); set_num_sms changes it for every buffer.
def check_unbacked_options(*, comm: Any = None) -> None:
    """Raise NotImplementedError naming the first V1 constructor option the core does not back."""
    if comm is not None:
        raise NotImplementedError(
            f"Buffer(comm={type(comm).__name__}) is not implemented: pass a torch.distributed process group as "
            "`group` (an mpi4py communicator is not supported)"
        )


class Buffer:
    """DeepEP V1's ``deep_ep.Buffer`` over :class:`deep_ep.ElasticBuffer`: one for the high-throughput
    calls, built here, and with ``low_latency_mode=True`` a second one for the low-latency calls,
    built by the first ``low_latency_dispatch``.

    Construction is collective over ``group`` (a torch.distributed process group). The HT window is
    ``window_num_bytes(num_nvl_bytes, num_rdma_bytes)`` bytes, or ``window_num_bytes(num_nvl_bytes, 0)``
    with ``low_latency_mode=True``: then ``num_rdma_bytes`` is the budget of the LL window, which must
    hold ``Buffer.get_low_latency_rdma_size_hint(T_ll, H, R, E)`` for the ``(T_ll, H, E)`` of the
    first ``low_latency_dispatch`` (a V1 client sizes ``num_rdma_bytes`` with that hint). The LL
    window holds exactly that many bytes, not ``num_rdma_bytes``. The first ``low_latency_dispatch``
    is collective beyond the call itself (it agrees with its peers and builds the window): it must
    run on every rank, outside CUDA-graph capture (RuntimeError there); later LL calls may be
    captured.

    ``num_qps_per_rank``, ``allow_nvlink_for_low_latency_mode``, ``allow_mnnvl`` and ``use_fabric`` are
    accepted and recorded (no RDMA queue pairs here; LL peers are load/store reachable; the last two
    are permissions, see the module docstring). ``comm`` raises NotImplementedError before anything
    is allocated (:func:`check_unbacked_options`);
    ``enable_shrink`` (rank masking) needs ``low_latency_mode=True``.

    ``explicitly_destroy`` as V1: True means the caller releases the buffer with :meth:`destroy`
    (collective: a closing barrier through each window makes sure no peer still uses it, then it is
    freed); False means the windows are freed when the buffer is garbage-collected (without that
    barrier) and :meth:`destroy` refuses, as V1's does.
    """

    num_sms: int = v1_config.DEFAULT_NUM_SMS
    # Class defaults, so that a partly built Buffer (failed construction) still answers destroy() and
    # the low-latency calls with the right error.
    low_latency_mode: bool = False
    _ll_core: ElasticBuffer | None = None
    _ll_sizing: tuple[int, int, int] | None = None
    enable_shrink: bool = False
    _pending_masked_ranks: frozenset[int] | set[int] = frozenset()

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        use_fabric: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm: Any = None,
    ) -> None:
        self._core: ElasticBuffer | None = None
        check_unbacked_options(comm=comm)
        if enable_shrink and not low_latency_mode:
            raise ValueError(
                "Buffer(enable_shrink=True) masks failed ranks in low-latency operations: it needs "
                "low_latency_mode=True"
            )
        num_bytes = window_num_bytes(num_nvl_bytes, num_rdma_bytes)  # checks both budgets
        if low_latency_mode:
            num_bytes = window_num_bytes(num_nvl_bytes, 0)  # num_rdma_bytes is the LL window's budget
        non_negative_int("num_qps_per_rank", num_qps_per_rank)
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = use_fabric
        self.enable_shrink = enable_shrink
        self.explicitly_destroy = explicitly_destroy
        self._core = ElasticBuffer(group, num_bytes, explicitly_destroy=explicitly_destroy)

    # ------------------------------------------------------------------ V1 class-level API

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs the HT kernels use when no ``config`` is passed (V1: even); for every Buffer. Capped per
        call at this rank's SM cap for HT kernels (``deep_ep.topology.ht_sm_cap``)."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms < 2:
            raise ValueError(f"num_sms must be an int >= 2, got {new_num_sms!r}")
        if new_num_sms % 2 != 0:
            raise ValueError(f"num_sms must be even (V1's rule), got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True when deep_ep's extension holds sm_90 kernels (SASS in its fatbin, ``EP_CUDA_ARCHS``)."""
        return 90 in sass_architectures(_C.__file__)

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap recorded on the current stream (to pass as ``previous_event``)."""
        return ElasticBuffer.capture()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Any:
        """V1's recommended dispatch ``Config`` for ``Buffer.num_sms`` SMs (deep_ep.compat.config)."""
        return v1_config.get_dispatch_config(num_ranks, num_sms=Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Any:
        """V1's recommended combine ``Config`` for ``Buffer.num_sms`` SMs (deep_ep.compat.config)."""
        return v1_config.get_combine_config(num_ranks, num_sms=Buffer.num_sms)

    @staticmethod
    def get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int
    ) -> int:
        """Exact bytes of the LL window the first ``low_latency_dispatch`` with these sizes builds (workspace
        included, top-k ``min(32, E)``; deep_ep.compat.config): pass at least this as ``num_rdma_bytes``."""
        return v1_config.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts
        )

    # ------------------------------------------------------------------ plumbing

    def _usable_core(self) -> ElasticBuffer:
        core = self._core
        if core is None:
            raise RuntimeError("this Buffer was destroyed (or its construction failed)")
        core._ensure_usable()
        core._check_fatal_errors()
        return core

    def _num_scaleup_ranks(self) -> int:
        return self._core.num_scaleup_ranks

    def _ht_region_bytes(self) -> int:
        return int(self._core._window["ht_bytes"])

    def token_capacity(self, hidden: int, num_topk: int, use_fp8: bool) -> int:
        """Tokens per rank a call of this shape may pass (the per-call ``T_max``, same on every rank)."""
        return token_capacity(
            self.group_size, self._num_scaleup_ranks(), self._ht_region_bytes(), hidden, num_topk, use_fp8
        )

    def _resolve_num_sms(self, config: Any) -> int:
        """``config.num_sms`` (V1 ``Config``) or ``Buffer.num_sms``, capped at this rank's SM share."""
        if config is None:
            requested = type(self).num_sms
        else:
            requested = getattr(config, "num_sms", None)
            if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
                raise TypeError(
                    f"config must be a V1 Config with an int num_sms >= 1 (its chunk sizes tune V1's ring buffers and "
                    f"are not used here), got {type(config).__name__} with num_sms={requested!r}"
                )
        return min(requested, self._core._max_ht_num_sms)

    @staticmethod
    def _check_stream_options(previous_event: Any) -> None:
        if previous_event is None:
            return
        if not isinstance(previous_event, (EventOverlap, torch.cuda.Event)):
            raise TypeError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")

    def _row_major_scales(self, x: Any, previous_event: Any) -> Any:
        """x with fp8 scales made row-major contiguous (V1 accepts any strides; the core reads rows).
        The copy runs where the core's kernels will see it: on the caller's stream (the comm stream
        waits for it), or with previous_event on the comm stream after that event."""
        if not isinstance(x, (tuple, list)) or len(x) != 2:
            return x
        data, scales = x
        if not isinstance(scales, torch.Tensor) or scales.is_contiguous():
            return (data, scales)
        if previous_event is None:
            return (data, scales.contiguous())
        comm = self._core.get_comm_stream()
        comm.wait_event(cuda_event(previous_event))
        with torch.cuda.stream(comm):
            return (data, scales.contiguous())

    def _check_layout_arguments(
        self,
        num_tokens: int,
        num_experts: int,
        num_tokens_per_rank: Any,
        num_tokens_per_rdma_rank: Any,
        is_token_in_rank: Any,
    ) -> None:
        """Cheap checks (shapes, dtypes) of V1's layout arguments. Their values are not compared with
        topk_idx (that needs a sync): the core recomputes the layout from topk_idx."""
        num_ranks = self.group_size
        for name, value, shape in (
            ("num_tokens_per_rank", num_tokens_per_rank, (num_ranks,)),
            ("is_token_in_rank", is_token_in_rank, (num_tokens, num_ranks)),
        ):
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                raise ValueError(f"{name} must be a tensor of shape {list(shape)}, got {describe_with_device(value)}")
        if is_token_in_rank is not None and is_token_in_rank.dtype != torch.bool:
            raise ValueError(f"is_token_in_rank must be bool [T, R], got {describe_with_device(is_token_in_rank)}")
        nodes = self._core.num_scaleout_ranks
        if num_tokens_per_rdma_rank is not None and nodes > 1:
            if not isinstance(num_tokens_per_rdma_rank, torch.Tensor) or tuple(num_tokens_per_rdma_rank.shape) != (
                nodes,
            ):
                raise ValueError(
                    f"num_tokens_per_rdma_rank must be a tensor of shape [{nodes}] (nodes), got "
                    f"{describe_with_device(num_tokens_per_rdma_rank)}"
                )

    def _too_small(self, num_tokens: int, hidden: int, num_topk: int, use_fp8: bool) -> BufferTooSmallError:
        # Sized as dispatch sizes T_max: by the bf16 footprint, whatever x's type.
        capacity = self.token_capacity(hidden, num_topk, use_fp8=False)
        needed = bytes_for_tokens(
            self.group_size, self._num_scaleup_ranks(), max(num_tokens, 1), hidden, num_topk, use_fp8=False
        )
        available = self._ht_region_bytes()
        # With low_latency_mode, num_rdma_bytes belongs to the LL window.
        budget = "num_nvl_bytes" if self.low_latency_mode else "num_nvl_bytes + num_rdma_bytes"
        return BufferTooSmallError(
            f"dispatch of T={num_tokens} tokens (H={hidden}, K={num_topk}, {'fp8' if use_fp8 else 'bf16'}) on "
            f"{self.group_size} ranks needs {budget} >= {needed}; this Buffer's "
            f"{available} bytes (num_nvl_bytes={self.num_nvl_bytes}, num_rdma_bytes={self.num_rdma_bytes}) hold at "
            f"most {capacity} tokens per rank for this shape",
            needed_bytes=needed,
            available_bytes=available,
        )

    # ------------------------------------------------------------------ layout

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, EventOverlap]:
        """``(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [nodes] or None on one node,
        num_tokens_per_expert int32 [E], is_token_in_rank bool [T, R], event)`` from torch ops on the
        device (:func:`dispatch_layout`; no CPU sync). With ``previous_event``, ``async_finish`` or
        ``allocate_on_comm_stream`` the work runs on the communication stream, as V1's kernel does."""
        core = self._usable_core()
        previous_event = event_or_none(previous_event)
        self._check_stream_options(previous_event)
        if not isinstance(topk_idx, torch.Tensor) or topk_idx.device != core._torch_device:
            raise ValueError(
                f"topk_idx must be a tensor on this buffer's device {core._torch_device}, "
                f"got {describe_with_device(topk_idx)}"
            )
        nodes = core.num_scaleout_ranks
        per_node = core.num_scaleup_ranks if nodes > 1 else None
        check_layout_inputs(topk_idx, num_experts, self.group_size, per_node)
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            return (*dispatch_layout(topk_idx, num_experts, self.group_size, per_node), EventOverlap(None))
        streams = Streams(
            core, work_on_comm=True, allocate_on_comm=allocate_on_comm_stream or previous_event is not None
        )
        if previous_event is not None:
            streams.comm.wait_event(cuda_event(previous_event))
        else:
            streams.comm.wait_stream(streams.compute)
        device = topk_idx.device
        outputs = [
            streams.empty((self.group_size,), torch.int32, device),
            streams.empty((nodes,), torch.int32, device) if per_node is not None else None,
            streams.empty((num_experts,), torch.int32, device),
            streams.empty((topk_idx.shape[0], self.group_size), torch.bool, device),
        ]
        with streams.working():
            results = dispatch_layout(topk_idx, num_experts, self.group_size, per_node)
            for output, result in zip(outputs, results, strict=True):
                if output is not None:
                    output.copy_(result)
        streams.hand_over()
        event = torch.cuda.Event()
        event.record(streams.comm)
        if async_finish:
            keep = (topk_idx, *(output for output in outputs if output is not None))
            return (*outputs, EventOverlap(event, extra_tensors=keep))
        streams.compute.wait_event(event)
        return (*outputs, EventOverlap(None))

    # ------------------------------------------------------------------ dispatch

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Any = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[Any, torch.Tensor | None, torch.Tensor | None, list[int] | None, DispatchHandle | None, EventOverlap]:
        """V1's HT dispatch: ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list,
        handle, event)``.

        ``x``: bf16 ``[T, H]`` or ``(fp8 [T, H], fp32 scales [T, H/128])``, scales of any strides.
        ``num_tokens_per_expert`` (int [E]) gives ``E`` and is required, as in V1. With ``topk_idx``
        (int64 ``[T, K]``) the layout arguments are checked for shape only; the core recomputes the
        layout from ``topk_idx``. Without it (V1's routing by rank) each token goes to the ranks
        ``is_token_in_rank`` marks (R <= 32), ``recv_topk_idx`` / ``recv_topk_weights`` are None,
        combine sums the rows of every receiving rank, and ``num_recv_tokens_per_expert_list`` is the
        sum over ranks of their ``num_tokens_per_expert`` for this rank's experts, aligned, as V1's;
        with a CPU sync that takes one all-gather over the group (which also gives a hybrid-mode
        handle its ``rank_prefix_matrix``). On one node the handle's ``rank_prefix_matrix``
        (``handle[0]``) comes from the dispatch's count exchange either way.
        Rows arrive ordered by (source rank, source token). ``recv_topk_idx`` int64 ``[N, K]``: local
        expert ids, -1 elsewhere; ``recv_topk_weights`` fp32 ``[N, K]``, 0 where ``recv_topk_idx`` is
        -1. ``num_recv_tokens_per_expert_list``: per local expert, rounded up to ``expert_alignment``
        (empty with ``num_worst_tokens``). ``num_worst_tokens > 0``: no CPU sync (CUDA-graph safe), every
        output has ``num_worst_tokens`` rows (it must be at least the rows this rank receives, V1's
        contract), rows past the received ones have ``recv_topk_idx = -1`` and weight 0.

        Memory: without a CPU sync the core sizes its outputs for the worst case, ``R * T_max`` rows
        (``T_max`` the capacity), and the returned outputs are views of their first rows (copies
        padded with -1 / 0 rows when ``num_worst_tokens`` is larger).

        ``handle=`` (cached dispatch, no sync): the routing of that dispatch, ``topk_idx`` and
        ``topk_weights`` must be None, the layout arguments and ``num_worst_tokens`` are ignored
        (rows come from the handle); returns ``(recv_x, None, None, None, None, event)`` as V1.

        The call's token cap is :meth:`token_capacity` for ``(H, K, fp8)``; a larger ``T`` raises
        BufferTooSmallError (after taking part without data: its peers get PeerInputError).
        """
        core = self._usable_core()
        previous_event = event_or_none(previous_event)
        if handle is not None:
            return self._cached_dispatch(
                core, x, handle, topk_idx, topk_weights, config, previous_event, async_finish, allocate_on_comm_stream
            )
        if num_worst_tokens == 0 and stream_capturing():
            # Before any launch: nothing of this call runs during capture, so no peer waits for it.
            raise RuntimeError(
                "Buffer.dispatch without num_worst_tokens cannot be captured in a CUDA graph: the host reads the "
                "received counts before it allocates the outputs. Capture a cached dispatch (handle=), or pass "
                "num_worst_tokens > 0 (outputs padded to that many rows, no CPU sync)"
            )
        num_experts: Any = None
        try:
            if isinstance(num_tokens_per_expert, torch.Tensor) and num_tokens_per_expert.dim() == 1:
                num_experts = int(num_tokens_per_expert.shape[0])
            elif num_tokens_per_expert is not None:
                raise ValueError(
                    f"num_tokens_per_expert must be a 1-D tensor [E], got {describe_with_device(num_tokens_per_expert)}"
                )
            else:
                raise ValueError(
                    "num_tokens_per_expert must be given (V1's dispatch learns the number of experts from its "
                    "length; get_dispatch_layout returns it)"
                )
            by_ranks = topk_idx is None
            if by_ranks:
                topk_idx = self._routing_by_ranks(is_token_in_rank, num_experts, topk_weights)
            self._check_stream_options(previous_event)
            num_sms = self._resolve_num_sms(config)
            if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
                raise ValueError(f"num_worst_tokens must be an int >= 0, got {num_worst_tokens!r}")
            x = self._row_major_scales(x, previous_event)
            data = x[0] if isinstance(x, (tuple, list)) else x
            use_fp8 = isinstance(x, (tuple, list))
            if not isinstance(data, torch.Tensor) or data.dim() != 2:
                raise ValueError(
                    f"x must be bf16 [T, H] or an (fp8 [T, H], scales) pair, got {describe_with_device(data)}"
                )
            if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
                raise ValueError(f"topk_idx must be int64 [T, K], got {describe_with_device(topk_idx)}")
            num_tokens, hidden = data.shape
            num_topk = topk_idx.shape[1]
            self._check_layout_arguments(
                num_tokens, num_experts, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank
            )
            # T_max from the bf16 footprint whatever x's type: the handle may serve cached dispatches
            # of either type (DeepEP's tuning reuses an fp8 dispatch's handle for bf16 rows), and
            # the fp8 footprint is under 1% smaller.
            capacity = self.token_capacity(hidden, num_topk, use_fp8=False)
        except Exception as error:
            # Peers run this dispatch: take part without data (as the core does for its own checks).
            core._dispatch_without_input(None, num_experts, error)
            raise
        too_small = num_tokens > capacity or capacity < 1
        try:
            recv_x, recv_topk_idx, recv_topk_weights, core_handle, core_event = core.dispatch(
                x,
                topk_idx,
                topk_weights,
                num_experts=num_experts,
                num_max_tokens_per_rank=max(capacity, 1),
                expert_alignment=expert_alignment,
                num_sms=num_sms,
                do_cpu_sync=num_worst_tokens == 0,
                previous_event=previous_event,
                async_with_compute_stream=async_finish,
                allocate_on_comm_stream=allocate_on_comm_stream,
            )
        except ValueError as error:
            if too_small:  # the core refused T > T_max (or T_max = 1 not fitting) after taking part
                raise self._too_small(num_tokens, hidden, num_topk, use_fp8) from error
            raise

        rows = num_worst_tokens if num_worst_tokens > 0 else core_handle.num_recv_tokens
        rank_prefix_matrix = None
        per_expert = list(core_handle.num_recv_tokens_per_expert_list)
        if by_ranks:
            # V1 counts experts from num_tokens_per_expert, not from the routing: each rank's counts
            # for this rank's experts are summed (one all-gather, with its send counts: the handle's
            # rank prefix matrix). Without a CPU sync V1 returns no counts, and so do we.
            recv_topk_idx = recv_topk_weights = None
            if num_worst_tokens == 0:
                per_expert, rank_prefix_matrix = self._exchange_layout_counts(
                    topk_idx, num_tokens_per_expert, expert_alignment
                )
        streams = Streams(
            core, work_on_comm=async_finish, allocate_on_comm=allocate_on_comm_stream or previous_event is not None
        )
        with streams.working():
            out_x, recv_topk_idx, recv_topk_weights, core_handle = v1_dispatch_outputs(
                recv_x, recv_topk_idx, recv_topk_weights, core_handle, num_worst_tokens, streams.empty
            )
        event = self._finish(streams, async_finish, core_event)
        v1_handle = DispatchHandle(
            core_handle,
            num_recv_tokens=rows,
            num_worst_tokens=num_worst_tokens,
            rank=self.rank,
            is_token_in_rank=is_token_in_rank,
            rank_prefix_matrix=rank_prefix_matrix,
        )
        return out_x, recv_topk_idx, recv_topk_weights, per_expert, v1_handle, event

    def _routing_by_ranks(self, is_token_in_rank: Any, num_experts: int, topk_weights: Any) -> torch.Tensor:
        """The core's routing for a dispatch without ``topk_idx`` (:func:`routing_from_ranks`)."""
        num_ranks = self.group_size
        if topk_weights is not None:
            raise ValueError("topk_weights needs topk_idx (a dispatch without topk_idx carries no weights)")
        if (
            not isinstance(is_token_in_rank, torch.Tensor)
            or is_token_in_rank.dtype != torch.bool
            or is_token_in_rank.dim() != 2
            or is_token_in_rank.shape[1] != num_ranks
        ):
            raise ValueError(
                f"a dispatch without topk_idx routes by is_token_in_rank, which must be bool [T, {num_ranks}], "
                f"got {describe_with_device(is_token_in_rank)}"
            )
        if num_ranks > _C.MAX_TOPK:
            raise ValueError(
                f"a dispatch without topk_idx sends a token to up to R ranks as R routing entries, at most "
                f"{_C.MAX_TOPK}: this group has R={num_ranks}; pass topk_idx"
            )
        return routing_from_ranks(is_token_in_rank, num_experts)

    def _exchange_layout_counts(
        self, routing: torch.Tensor, num_tokens_per_expert: torch.Tensor, expert_alignment: int
    ) -> tuple[list[int], torch.Tensor]:
        """V1's per-local-expert receive counts (from every rank's ``num_tokens_per_expert``, aligned)
        and its ``rank_prefix_matrix`` int32 [R, R] (from every rank's send counts). Collective."""
        num_ranks = self.group_size
        num_local = num_tokens_per_expert.shape[0] // num_ranks
        sent = (routing >= 0).sum(dim=0, dtype=torch.int32)
        local = torch.cat([sent, num_tokens_per_expert.to(device=sent.device, dtype=torch.int32)])
        rows = self._all_gather_rows(local)
        experts = rows[:, num_ranks + self.rank * num_local : num_ranks + (self.rank + 1) * num_local].sum(dim=0)
        aligned = [-(-int(count) // expert_alignment) * expert_alignment for count in experts.tolist()]
        return aligned, rows[:, :num_ranks].cumsum(dim=0, dtype=torch.int32).to(sent.device)

    def _all_gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """``[R, n]``: every rank's 1-D ``local`` (one all-gather over the group; through the host for
        gloo). Returned on the host for gloo, else on ``local``'s device."""
        on_host = dist.get_backend(self.group) == "gloo"
        local = local.cpu() if on_host else local
        rows = [torch.empty_like(local) for _ in range(self.group_size)]
        dist.all_gather(rows, local, group=self.group)
        return torch.stack(rows)

    def _cached_dispatch(
        self,
        core: ElasticBuffer,
        x: Any,
        handle: Any,
        topk_idx: Any,
        topk_weights: Any,
        config: Any,
        previous_event: Any,
        async_finish: bool,
        allocate_on_comm_stream: bool,
    ) -> tuple[Any, None, None, None, None, EventOverlap]:
        core_handle = handle.core if isinstance(handle, DispatchHandle) else handle
        try:
            if not isinstance(handle, DispatchHandle):
                raise TypeError(f"handle must be the DispatchHandle returned by dispatch, got {type(handle).__name__}")
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(
                    "topk_idx and topk_weights must be None with handle= (V1's cached dispatch reuses the routing)"
                )
            self._check_stream_options(previous_event)
            num_sms = self._resolve_num_sms(config)
            x = self._row_major_scales(x, previous_event)
        except Exception as error:
            core._dispatch_without_input(core_handle, None, error)
            raise
        recv_x, _, _, _, event = core.dispatch(
            x,
            handle=core_handle,
            num_sms=num_sms,
            previous_event=previous_event,
            async_with_compute_stream=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
        )
        return recv_x, None, None, None, None, event

    @staticmethod
    def _finish(streams: Streams, async_finish: bool, core_event: EventOverlap) -> EventOverlap:
        """The event of a call whose extra work ran after the core's (on ``streams.work``)."""
        streams.hand_over()
        if not async_finish:
            return core_event  # the caller's stream already waited for the core; our work ran on it
        event = torch.cuda.Event()
        event.record(streams.comm)
        keep = tuple(core_event.extra_tensors or ()) + tuple(streams.allocated)
        return EventOverlap(event, extra_tensors=keep)

    # ------------------------------------------------------------------ combine

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
        config: Any = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        """V1's HT combine: ``(combined_x bf16 [T, H], combined_topk_weights fp32 [T, K] or None, event)``.

        ``x`` bf16 ``[handle.num_recv_tokens, H]`` (one row per dispatched row; padding rows of a
        ``num_worst_tokens`` dispatch are not read). Each token's rows are summed without weights,
        plus ``bias`` (a tensor or a pair). ``combined_topk_weights[t, k]`` follows V1: the fp32 sum,
        over the ranks that received token t (ascending, from +0.0; several nodes: per node first),
        of slot k of the ``topk_weights`` row each passes, all K slots whatever experts they name (a
        slot dispatch returned as 0 adds 0 unless the caller wrote into it).
        """
        core = self._usable_core()
        previous_event = event_or_none(previous_event)
        core_handle = handle.core if isinstance(handle, DispatchHandle) else handle
        try:
            if not isinstance(handle, DispatchHandle):
                raise TypeError(f"handle must be the DispatchHandle returned by dispatch, got {type(handle).__name__}")
            self._check_stream_options(previous_event)
            num_sms = self._resolve_num_sms(config)
        except Exception as error:
            core._combine_without_input(x, core_handle, error)
            raise
        return core.combine(
            x,
            core_handle,
            topk_weights=topk_weights,
            bias=bias,
            num_sms=num_sms,
            previous_event=previous_event,
            async_with_compute_stream=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
            sum_topk_weights=True,
        )

    # ------------------------------------------------------------------ extras

    def gather_rank_prefix_matrix(self, handle: DispatchHandle) -> torch.Tensor:
        """V1's ``rank_prefix_matrix`` of ``handle``'s dispatch: int32 ``[R, R]``, entry ``[i, j]`` the
        tokens ranks ``0..i`` sent to rank ``j``. The handle's own (``handle.rank_prefix_matrix``) when
        it has one (always on one node); otherwise **collective**: one all-gather of each rank's send
        counts over ``group`` (every rank must call it for the same dispatch, in the same order)."""
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be the DispatchHandle returned by dispatch, got {type(handle).__name__}")
        if handle.rank_prefix_matrix is not None:
            return handle.rank_prefix_matrix
        core = handle.core  # what the core really routed (sanitised), not the layout passed in
        sent = dispatch_layout(core.routing, core.num_experts, core.num_ranks)[0]
        return self._all_gather_rows(sent).to(sent.device).cumsum(dim=0, dtype=torch.int32)

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The communication stream the kernels run on (shared by the buffers of this process and device)."""
        return self._usable_core().get_comm_stream()

    def get_local_buffer_tensor(
        self,
        dtype: torch.dtype,
        size: torch.Size | Sequence[int] | None = None,
        offset: int = 0,
        use_rdma_buffer: bool = False,
    ) -> torch.Tensor:
        """A view of this rank's window: the "NVL buffer" is the first ``num_nvl_bytes`` of the HT
        region, the "RDMA buffer" the ``num_rdma_bytes`` after it (the two budgets are pooled into that
        region). With ``low_latency_mode`` the "RDMA buffer" is the LL region of the low-latency window
        instead (its exact size, at most ``num_rdma_bytes``; RuntimeError before the first
        ``low_latency_dispatch`` built it). ``offset`` in bytes; without ``size`` the view runs to the
        end of the chosen part, with ``size`` it is the first ``prod(size)`` elements viewed as
        ``size``. The bytes are receive slots: every dispatch and combine (of that kind) overwrites
        them."""
        core = self._usable_core()
        if use_rdma_buffer and self.low_latency_mode:
            core = self._usable_ll_core("get_local_buffer_tensor(use_rdma_buffer=True)")
            part_bytes, part_start = int(core._window["ll_bytes"]), int(core._window["ll_offset"])
        elif use_rdma_buffer:
            part_bytes, part_start = self.num_rdma_bytes, core._window["ht_offset"] + self.num_nvl_bytes
        else:
            part_bytes, part_start = self.num_nvl_bytes, core._window["ht_offset"]
        element = torch.empty((), dtype=dtype).element_size()
        non_negative_int("offset", offset)
        if offset > part_bytes:
            which = "num_rdma_bytes" if use_rdma_buffer else "num_nvl_bytes"
            raise ValueError(f"offset={offset} is past the end of the buffer ({which}={part_bytes})")
        num_elements = (part_bytes - offset) // element
        if size is not None:
            wanted = 1
            for extent in size:
                wanted *= int(extent)
            if wanted > num_elements:
                raise ValueError(
                    f"size {list(size)} needs {wanted} elements of {dtype}, the buffer holds {num_elements} from "
                    f"offset {offset}"
                )
            num_elements = wanted
        start = part_start + offset
        flat = window_tensor(core._runtime, core.local_window_base(), start, (num_elements,), dtype, core._torch_device)
        return flat.view(tuple(size)) if size is not None else flat

    def destroy(self) -> None:
        """Free the windows, the low-latency one (when built) then the high-throughput one (collective:
        every rank calls it). V1's rule: only for buffers built with ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise RuntimeError(
                "destroy() is for buffers built with explicitly_destroy=True (V1's rule); this one frees its "
                "window when it is garbage-collected"
            )
        core, self._core = self._core, None
        ll_core, self._ll_core = self._ll_core, None
        masked: list[int] = []
        try:
            if ll_core is not None:
                masked = ll_core._ll_masked_ranks()
                ll_core.destroy()
        finally:
            if core is not None:
                # Ranks the LL window masked may be gone: the HT window's closing barrier skips them too.
                core._ranks_masked_elsewhere = tuple(masked)
                core.destroy()

    # ------------------------------------------------------------------ low latency

    @property
    def low_latency_sizing(self) -> tuple[int, int, int] | None:
        """``(num_max_dispatch_tokens_per_rank, hidden, num_experts)`` the low-latency window was built
        for by the first ``low_latency_dispatch``; None before it."""
        return self._ll_sizing

    def _require_low_latency_mode(self, operation: str) -> None:
        if not self.low_latency_mode:
            raise RuntimeError(
                f"Buffer.{operation} needs a Buffer built with low_latency_mode=True (V1 asserts the same); this "
                "one has no low-latency window (its num_rdma_bytes went to the high-throughput window)"
            )

    def _usable_ll_core(self, operation: str) -> ElasticBuffer:
        """The low-latency ElasticBuffer, usable; RuntimeError when there is none (yet)."""
        self._usable_core()
        self._require_low_latency_mode(operation)
        core = self._ll_core
        if core is None:
            raise RuntimeError(
                f"Buffer.{operation} needs the low-latency window, which the first low_latency_dispatch builds; "
                "no low_latency_dispatch ran on this Buffer yet"
            )
        core._ensure_usable()
        core._check_fatal_errors()
        return core

    def _check_low_latency_sizing(self, x: Any, num_max_dispatch_tokens_per_rank: Any, num_experts: Any) -> tuple:
        """``(T_ll, H, E)`` of a first ``low_latency_dispatch`` (H from ``x``); raises TypeError /
        ValueError for arguments that cannot size a window, BufferTooSmallError when
        ``num_rdma_bytes`` cannot hold it."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor (bfloat16 [T, H]), got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"x must be bfloat16 [T, H], got {describe_with_device(x)}")
        return self._check_low_latency_window(num_max_dispatch_tokens_per_rank, int(x.shape[1]), num_experts)

    def _check_low_latency_window(self, num_max_dispatch_tokens_per_rank: Any, hidden: Any, num_experts: Any) -> tuple:
        """``(T_ll, H, E)`` if they can size a low-latency window within ``num_rdma_bytes``
        (ValueError / BufferTooSmallError otherwise)."""
        for name, value in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank),
            ("hidden", hidden),
            ("num_experts", num_experts),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if hidden % 128 != 0:
            raise ValueError(f"x hidden size must be a multiple of 128 (fp8 scale groups), got H={hidden}")
        sizing = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        needed = low_latency_window_bytes(num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts)
        if needed > self.num_rdma_bytes:
            raise BufferTooSmallError(
                f"low_latency_dispatch with num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank}, "
                f"hidden={hidden}, num_experts={num_experts} on {self.group_size} ranks needs num_rdma_bytes >= "
                f"{needed} (Buffer.get_low_latency_rdma_size_hint({num_max_dispatch_tokens_per_rank}, {hidden}, "
                f"{self.group_size}, {num_experts})); this Buffer has num_rdma_bytes={self.num_rdma_bytes}",
                needed_bytes=needed,
                available_bytes=self.num_rdma_bytes,
            )
        return sizing

    def _exchange_low_latency_setup(self, item: Any) -> list[Any]:
        """Every rank's ``item`` (one all-gather over the group; the first LL call only)."""
        gathered: list[Any] = [None] * self.group_size
        dist.all_gather_object(gathered, item, group=self.group)
        return gathered

    def _build_low_latency_core(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> Any:
        """The LL-only ElasticBuffer (collective): no HT region, the LL region sized for these settings."""
        return ElasticBuffer(
            self.group,
            None,
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
            hidden=hidden,
            num_experts=num_experts,
            explicitly_destroy=self.explicitly_destroy,
            enable_rank_masking=self.enable_shrink,
        )

    def _low_latency_core_for(self, operation: str, check_sizing: Callable[[], tuple]) -> ElasticBuffer:
        """The LL core, built when it does not exist yet from the sizes ``check_sizing()`` returns
        (or raises for) on this rank (collective then: one exchange of every rank's sizes or error,
        then the window; every rank raises alike)."""
        self._usable_core()
        self._require_low_latency_mode(operation)
        if self._ll_core is not None:
            return self._usable_ll_core(operation)
        if stream_capturing():
            raise RuntimeError(
                f"the first Buffer.{operation} builds the low-latency window (an exchange over the group and an "
                "allocation) and cannot run inside CUDA-graph capture: call clean_low_latency_buffer, or make one "
                "low_latency_dispatch (and its combine), eagerly before capturing"
            )
        sizing: tuple | None = None
        error: Exception | None = None
        try:
            sizing = check_sizing()
        except Exception as caught:  # noqa: BLE001 - whatever it is, the peers must hear of it (no hang)
            error = caught
        report = None if error is None else (type(error).__name__, str(error))
        gathered = self._exchange_low_latency_setup((sizing, report))
        failed = {rank: item[1] for rank, item in enumerate(gathered) if item[1] is not None}
        if error is not None:
            raise error  # every rank learnt of it; none built a window
        if failed:
            details = "; ".join(f"rank {rank}: {kind}: {message}" for rank, (kind, message) in sorted(failed.items()))
            raise PeerInputError(
                f"the first low_latency_dispatch failed on rank(s) {sorted(failed)}, so no rank built the "
                f"low-latency window or dispatched anything: {details}",
                rank=min(failed),
                operation="low_latency_dispatch",
            )
        sizings = [item[0] for item in gathered]
        if any(other != sizing for other in sizings):
            raise ValueError(
                "every rank must pass the same (num_max_dispatch_tokens_per_rank, hidden, num_experts) to the first "
                f"low_latency_dispatch (they size the low-latency window); got {sizings} (index = rank)"
            )
        core = self._build_low_latency_core(*sizing)
        self._ll_core, self._ll_sizing = core, sizing
        for rank in sorted(self._pending_masked_ranks):  # masked before the window existed
            core.low_latency_update_mask_buffer(rank, True)
        self._pending_masked_ranks = set()
        return core

    def _low_latency_mismatch(self, x: Any, num_max_dispatch_tokens_per_rank: Any, num_experts: Any) -> str | None:
        """The message for an LL call whose sizes differ from the window's, else None."""
        sizing = self._ll_sizing
        hidden = int(x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() >= 1 else None
        if sizing is None or (num_max_dispatch_tokens_per_rank, hidden, num_experts) == sizing:
            return None
        return (
            f"low_latency_dispatch(num_max_dispatch_tokens_per_rank={num_max_dispatch_tokens_per_rank!r}, "
            f"hidden={hidden}, num_experts={num_experts!r}) differs from this Buffer's low-latency window, built "
            f"by its first low_latency_dispatch for num_max_dispatch_tokens_per_rank={sizing[0]}, hidden={sizing[1]}, "
            f"num_experts={sizing[2]}: every low-latency call of a Buffer must pass those"
        )

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, torch.Tensor, LowLatencyDispatchHandle, EventOverlap, Any]:
        """V1's low-latency dispatch: ``(recv_x, recv_count, handle, event, hook)``.

        ``x`` bf16 ``[T, H]`` (``T <= num_max_dispatch_tokens_per_rank``), ``topk_idx`` int64 ``[T, K]``
        (-1 skips a slot). ``recv_x``: ``(fp8 [L, R*T_ll, H], scales)`` with ``use_fp8``, else bf16
        ``[L, R*T_ll, H]``, a fresh tensor; local expert ``l``'s rows are packed in
        ``[0, recv_count[l])`` (int32 ``[L]``), ordered by (source rank, source token) (V1: by arrival);
        later rows are undefined. Scales are column-major in the last two dims as V1's: fp32
        ``[L, R*T_ll, H/128]`` with strides ``(G*R*T_ll, 1, R*T_ll)``; ``round_scale``: powers of two;
        ``use_ue8m0`` (needs ``round_scale``, ``H % 512 == 0``): int32 ``[L, R*T_ll, H/512]`` of packed
        exponent bytes. ``handle``: :class:`LowLatencyDispatchHandle`. ``event``: an EventOverlap, with
        an event only with ``async_finish``; ``hook``: with ``return_recv_hook`` the receive phase runs
        when it is called, else None. ``cumulative_local_expert_recv_stats`` (int32 ``[L]``) gets
        ``recv_count`` added, ``dispatch_wait_recv_cost_stats`` (int64 ``[R]``) the clock cycles the
        receive phase waited for each source rank (both by the receive phase). No CPU sync.

        The first call builds the low-latency window for ``(num_max_dispatch_tokens_per_rank, H,
        num_experts)`` (see the class docstring: collective, not under graph capture,
        BufferTooSmallError when ``num_rdma_bytes`` is short); later calls must pass the same values
        (ValueError naming both, after taking part without data). Other bad arguments are the core's
        refusals (ValueError / TypeError after taking part without data).
        """
        built = self._ll_core is None
        core = self._low_latency_core_for(
            "low_latency_dispatch",
            lambda: self._check_low_latency_sizing(x, num_max_dispatch_tokens_per_rank, num_experts),
        )
        mismatch = None if built else self._low_latency_mismatch(x, num_max_dispatch_tokens_per_rank, num_experts)
        try:
            recv_x, recv_count, core_handle, event, hook = core.low_latency_dispatch(
                x,
                topk_idx,
                num_max_dispatch_tokens_per_rank,
                num_experts,
                cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats,
                use_fp8=use_fp8,
                round_scale=round_scale,
                use_ue8m0=use_ue8m0,
                use_tma_aligned_col_major_sf=True,  # V1's LL scales are column-major (no effect for bf16)
                recv_layout="compact",
                async_finish=async_finish,
                return_recv_hook=return_recv_hook,
            )
        except ValueError as error:
            if mismatch is not None:  # the core refused after taking part without data
                raise ValueError(mismatch) from error
            raise
        return recv_x, recv_count, LowLatencyDispatchHandle(core_handle), _v1_event(event), hook

    @staticmethod
    def _core_ll_handle(handle: Any) -> Any:
        return handle.core if isinstance(handle, LowLatencyDispatchHandle) else handle

    @staticmethod
    def _refuse_low_latency_combine(core: ElasticBuffer, core_handle: Any, error: Exception) -> None:
        """Take part in the combine without data (zero rows for what a usable handle received, none
        otherwise), as the core does for its own refusals; the caller then raises ``error``."""
        core._ll_check_outstanding("low_latency_combine")
        usable = isinstance(core_handle, LowLatencyHandle)
        if usable:
            try:
                core._ll_check_handle(core_handle)
            except (TypeError, ValueError, RuntimeError):
                usable = False
        core._ll_combine_without_input(core_handle if usable else None, error)

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyDispatchHandle,
        use_logfmt: bool = False,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap, Any]:
        """V1's low-latency combine: ``(combined_x bf16 [T, H], event, hook)`` with
        ``combined_x[t] = bf16(sum_k w[t, k] * y_k)`` (fp32, k ascending, -1 slots skipped).

        ``x`` bf16 ``[L, R*T_ll, H]`` laid out like the dispatch's ``recv_x`` (rows ``[0, recv_count)``
        of each expert are read); ``topk_idx`` / ``topk_weights`` those of the dispatch; ``handle`` the
        dispatch's. ``zero_copy`` is accepted and changes nothing: combine always reads ``x`` where it
        is, and with ``x = get_next_low_latency_combine_buffer(handle)`` no copy is made (V1: skips
        copying ``x`` into its send buffer, which must then hold the data). ``out``: bf16 ``[T, H]``
        to write into. ``combine_wait_recv_cost_stats`` int64 ``[R]`` gets the cycles waited per
        source rank. ``use_logfmt=True`` raises NotImplementedError (after taking part without data).
        ``event`` and ``hook`` as for dispatch.
        """
        core = self._usable_ll_core("low_latency_combine")
        core_handle = self._core_ll_handle(handle)
        if use_logfmt:
            refusal = NotImplementedError(
                "low_latency_combine(use_logfmt=True) is not implemented: V1's LogFMT (10-bit logarithmic "
                "per-64-channel combine payload) is not provided; pass use_logfmt=False (bf16 rows)"
            )
            self._refuse_low_latency_combine(core, core_handle, refusal)
            raise refusal
        try:
            combined, event, hook = core.low_latency_combine(
                x,
                topk_idx,
                topk_weights,
                core_handle,
                zero_copy=zero_copy,
                async_finish=async_finish,
                return_recv_hook=return_recv_hook,
                out=out,
                combine_wait_recv_cost_stats=combine_wait_recv_cost_stats,
            )
        except TypeError as error:
            if not isinstance(core_handle, LowLatencyHandle):  # the core took part without data
                raise TypeError(
                    f"handle must be the handle Buffer.low_latency_dispatch returned, got {type(handle).__name__}"
                ) from error
            raise
        return combined, _v1_event(event), hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyDispatchHandle) -> torch.Tensor:
        """A bf16 ``[L, R*T_ll, H]`` tensor owned by the LL buffer (two, handed out in turn) for the
        next ``low_latency_combine``: write the expert outputs into it and pass it as ``x`` (V1's
        zero-copy pattern). Rows as in the dispatch's ``recv_x``. Not a view of the window, unlike
        V1's; do not write it again before that combine has run (stream order)."""
        core = self._usable_ll_core("get_next_low_latency_combine_buffer")
        core_handle = self._core_ll_handle(handle)
        if not isinstance(core_handle, LowLatencyHandle):
            raise TypeError(
                f"handle must be the handle Buffer.low_latency_dispatch returned, got {type(handle).__name__}"
            )
        return core.get_next_low_latency_combine_buffer(core_handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Builds the low-latency window if no LL call did yet; cleans nothing (none is ever needed).

        V1 zeroes its LL signalling areas (between two barriers), needed after high-throughput kernels
        reused its RDMA buffer. Here the LL window is its own allocation that HT calls never touch,
        and its signal cells are tagged with the operation's epoch, so stale values are never
        mistaken for new ones. When the window does not exist yet this call builds it for these
        sizes, collectively like V1's clean (every rank calls it; errors as for the first
        low_latency_dispatch) — so a client that cleans before CUDA-graph capture can capture its
        first LL call. Once the window exists the arguments must be its sizes (ValueError naming
        both) and the call is local. RuntimeError without ``low_latency_mode`` (V1 asserts it)."""
        self._usable_core()
        self._require_low_latency_mode("clean_low_latency_buffer")
        sizing = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        for name, value in zip(("num_max_dispatch_tokens_per_rank", "hidden", "num_experts"), sizing, strict=True):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self._ll_core is None:
            self._low_latency_core_for("clean_low_latency_buffer", lambda: self._check_low_latency_window(*sizing))
            return
        built = self._ll_sizing
        if built is not None and sizing != built:
            raise ValueError(
                f"clean_low_latency_buffer(num_max_dispatch_tokens_per_rank={sizing[0]}, hidden={sizing[1]}, "
                f"num_experts={sizing[2]}) differs from this Buffer's low-latency window, built by its first "
                f"low_latency_dispatch for num_max_dispatch_tokens_per_rank={built[0]}, hidden={built[1]}, "
                f"num_experts={built[2]}"
            )

    # ------------------------------------------------------------------ rank masking (enable_shrink)

    def _mask_core(self, name: str) -> ElasticBuffer | None:
        """The LL core the mask calls act on; None before the first LL call built it (the mask is then
        kept here and applied when the window is built)."""
        self._usable_core()
        if not self.enable_shrink:
            raise RuntimeError(
                f"Buffer.{name} needs rank masking: build the Buffer with low_latency_mode=True and enable_shrink=True"
            )
        return self._ll_core if self._ll_core is None else self._usable_ll_core(name)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or restore a rank in this rank's low-latency rank mask: a masked rank
        is neither sent to nor waited for, its experts count as absent (combine contributions zero).
        A low-latency wait that times out masks its peer the same way (docs/api.md, "Rank masking")."""
        core = self._mask_core("low_latency_update_mask_buffer")
        if core is not None:
            core.low_latency_update_mask_buffer(rank_to_mask, mask)
            return
        check_rank_to_mask(rank_to_mask, self.group_size, self.rank)
        others = set(self._pending_masked_ranks) - {rank_to_mask}
        self._pending_masked_ranks = others | {rank_to_mask} if mask else others

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy the rank mask (1 = masked) into ``mask_status``, int32 with one entry per rank."""
        core = self._mask_core("low_latency_query_mask_buffer")
        if core is not None:
            core.low_latency_query_mask_buffer(mask_status)
            return
        if not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32:
            raise ValueError(f"mask_status must be an int32 tensor of {self.group_size} elements")
        if mask_status.numel() != self.group_size:
            raise ValueError(f"mask_status must be an int32 tensor of {self.group_size} elements")
        values = [1 if rank in self._pending_masked_ranks else 0 for rank in range(self.group_size)]
        mask_status.view(-1).copy_(torch.tensor(values, dtype=torch.int32))

    def low_latency_clean_mask_buffer(self) -> None:
        """Restore every rank (a restored rank that is still gone is masked again by the next wait on it)."""
        core = self._mask_core("low_latency_clean_mask_buffer")
        if core is not None:
            core.low_latency_clean_mask_buffer()
        self._pending_masked_ranks = set()


def _v1_event(event: Any) -> EventOverlap:
    """V1 returns an EventOverlap from every call: the core's (async), else one holding no event."""
    return event if isinstance(event, EventOverlap) else EventOverlap(None)
