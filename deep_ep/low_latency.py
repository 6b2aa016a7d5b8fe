"""LowLatencyMixin: ElasticBuffer's low-latency (decode) dispatch and combine (DeepEP V1 API).

Every LL operation is a send phase and a receive phase, run by one kernel function per operation
(``KERNEL_NAMES``) whose launch argument names the phases. Without a hook one launch runs both on
the caller's stream (``async_finish``: on the communication stream, with an event returned); with
``return_recv_hook=True`` a launch runs the send phase and the returned hook launches the same
kernel again for the receive phase, so no SM waits while the data is in flight. No call
synchronises with the host, so the whole path can be captured in a CUDA graph.

The LL region has three areas used in rotation (operation n uses area n % 3), so a send phase
finds the area it writes already released by every peer (docs/low_latency.md). By default
(``recv_layout="compact"``) the receive phase copies each local expert's rows out of the window
into a fresh ``recv_x``, packed in ``[0, recv_count[l])`` and ordered by (source rank, source
token): the layout masked grouped GEMMs read. With
``recv_layout="per_source"`` ``recv_x`` is instead a zero-copy view of this rank's receive slots
(source ``s`` at rows ``[s*T_ll, s*T_ll + n)``), valid until the next-but-one LL call starts.
At most two operations may be outstanding (receive phase not yet launched); a third raises.
See docs/low_latency.md for the layout and the protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deep_ep import _C
from deep_ep._util import describe_with_device, pointer
from deep_ep.event import EventOverlap
from deep_ep.failed_input import take_part_without_input
from deep_ep.window import window_tensor

__all__ = ["LowLatencyHandle", "LowLatencyMixin"]

FP8_GROUP_SIZE = 128
UE8M0_GROUP_WORDS = 4  # UE8M0 scales: one int32 packs the exponent bytes of 4 groups
RECV_LAYOUTS = ("compact", "per_source")
MAX_OUTSTANDING = 2
# A dispatch's data (headers included) is released once the second LL operation after it has sent,
# so the combine answering it must be at most that one.
MAX_COMBINE_DISTANCE = 2
# The kernel of each LL operation (dispatch, combine), as profilers name it (a substring of the
# demangled name): every mode launches the same function, once without a receive hook and twice with
# one (send phase, then the hook's receive phase). DeepEP's benchmarks find LL kernels by the words
# "dispatch" and "combine", each of which must name exactly one kernel of a profile, so no other
# kernel launched by an LL operation carries either word.
KERNEL_NAMES = ("ll_dispatch_kernel", "ll_combine_kernel")
# Receive phases launched into CUDA need 16-byte aligned rows.
_ROW_ALIGNMENT = 16


def _require_tensor(name: str, value: Any, expected: str) -> None:
    """A wrong kind of object is a TypeError (docs/api.md); a tensor of the wrong dtype or shape is a ValueError."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a tensor ({expected}), got {type(value).__name__}")


def check_rank_to_mask(rank_to_mask: Any, num_ranks: int, own_rank: int) -> None:
    """The rank a mask update names: a rank of the group other than the caller's."""
    if not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < num_ranks:
        raise ValueError(f"rank_to_mask must be a rank in [0, {num_ranks}), got {rank_to_mask!r}")
    if rank_to_mask == own_rank:
        raise ValueError(f"rank {rank_to_mask} cannot mask itself (its own experts are always present)")


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` contiguous and 16-byte aligned (a copy on the current stream when it is not)."""
    if not tensor.is_contiguous():
        return tensor.contiguous()
    if tensor.data_ptr() % _ROW_ALIGNMENT != 0:
        return tensor.clone()
    return tensor


@dataclass(eq=False)
class LowLatencyHandle:
    """What ``low_latency_combine`` needs from the ``low_latency_dispatch`` it answers.

    ``count_per_source`` int32 [L, R]: tokens received per (local expert, source rank), written by
    the dispatch's receive phase. ``recv_layout``: ``"compact"`` or ``"per_source"`` (where the
    rows of ``recv_x`` are, and where combine reads its ``x`` rows). ``recv_src_info`` int32
    [L, R * T_ll]: source token index of each row of ``recv_x`` (DeepEP's ``src_info``);
    ``recv_layout_range`` int64 [L, R]: ``(first row << 32) | count`` of each source's rows in
    ``recv_x`` (DeepEP's ``layout_range``). ``recv_src_token`` / ``recv_topk_slot`` int32
    [L, R * T_ll]: zero-copy views of the message headers in the window, per-source blocks whatever
    the layout (rows past the counts are undefined), valid until the next-but-one LL operation.
    """

    owner_id: int
    area: int
    op_index: int
    num_tokens: int
    num_topk: int
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    use_fp8: bool
    recv_count: torch.Tensor
    count_per_source: torch.Tensor
    recv_src_token: torch.Tensor
    recv_topk_slot: torch.Tensor
    recv_layout: str = "per_source"
    recv_src_info: torch.Tensor | None = None
    recv_layout_range: torch.Tensor | None = None
    received: bool = False


class _Hook:
    """Launches a pending receive phase once; a second call raises.

    ``keep_alive``: tensors the receive phase reads or writes (input copies made for alignment among
    them). The hook holds them until it runs; then they are tied to the stream the receive runs on,
    so the allocator cannot reuse them while it still runs there (the hook may be called on another
    stream than the one they were allocated on)."""

    def __init__(
        self, buffer: Any, operation: str, receive: Callable[[], None], keep_alive: tuple[torch.Tensor, ...]
    ) -> None:
        self._buffer = buffer
        self._operation = operation
        self._receive: Callable[[], None] | None = receive
        self._keep_alive = keep_alive

    def __call__(self) -> None:
        if self._receive is None:
            raise RuntimeError(f"this {self._operation} hook was already called; each hook receives exactly once")
        self._buffer._ensure_usable()
        self._buffer._check_fatal_errors(f"{self._operation} receive hook")
        receive, self._receive = self._receive, None
        self._buffer._ll_num_pending = self._buffer._ll_num_pending - 1
        receive()
        if not torch.cuda.is_current_stream_capturing():
            stream = torch.cuda.current_stream()
            for tensor in self._keep_alive:
                tensor.record_stream(stream)
        self._keep_alive = ()


class LowLatencyMixin:
    """``low_latency_dispatch`` / ``low_latency_combine`` on ElasticBuffer's LL region."""

    # Set by ElasticBuffer before any method runs.
    _runtime: Any
    _window: dict
    _comm_stream: torch.cuda.Stream
    _serial: int
    _torch_device: torch.device
    _max_num_sms: int
    num_ranks: int
    rank_idx: int
    hidden: int
    device: int
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    num_ll_topk: int

    # LL state, created on first use: next area, operations started, receive phases pending.
    _ll_next_area: int = 0
    _ll_num_ops: int = 0
    _ll_num_pending: int = 0
    # int32 [R] on the device with enable_rank_masking=True (1 = masked), else None.
    _ll_rank_mask: torch.Tensor | None = None

    # ------------------------------------------------------------------ public

    def low_latency_dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        num_max_dispatch_tokens_per_rank: int,
        num_experts: int,
        *,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        dispatch_wait_recv_cost_stats: torch.Tensor | None = None,
        use_fp8: bool = True,
        round_scale: bool = False,
        use_ue8m0: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
        recv_layout: str = "compact",
        async_finish: bool = False,
        return_recv_hook: bool = False,
    ) -> tuple[Any, torch.Tensor, LowLatencyHandle, EventOverlap | None, Callable[[], None] | None]:
        """Send every (token, selected expert) to the expert's rank; returns
        ``(recv_x, recv_count, handle, event, hook)``.

        ``recv_x`` is ``(fp8 [L, R*T_ll, H], scales)`` with ``use_fp8``, else bf16 ``[L, R*T_ll, H]``.
        ``recv_layout="compact"`` (default): a fresh tensor; local expert ``l``'s rows are packed in
        ``[0, recv_count[l])``, ordered by (source rank, source token). ``"per_source"``: a zero-copy
        view of the window; rows ``[s*T_ll, s*T_ll + n)`` hold the ``n`` tokens of rank ``s`` in
        token order. Rows past the counts are undefined in both.

        fp8 scales: fp32 ``[L, R*T_ll, H/128]``, row-major; ``use_tma_aligned_col_major_sf``: the
        same values column-major in the last two dims (strides ``(G*R*T_ll, 1, R*T_ll)``, DeepEP
        V1's LL layout; no effect without fp8). ``round_scale``: power-of-two scales
        (deep_ep/fp8.py). ``use_ue8m0`` (needs ``round_scale`` and ``H % 512 == 0``): int32
        ``[L, R*T_ll, H/512]``, each word the UE8M0 exponent bytes of 4 groups (first group in the
        lowest byte), row- or column-major as above. Column-major and UE8M0 need compact rows.

        ``cumulative_local_expert_recv_stats`` int32 [L] gets ``recv_count`` added;
        ``dispatch_wait_recv_cost_stats`` int64 [R] gets the clock cycles the receive phase waited for
        each source rank added (both by the receive phase, on its stream).
        ``recv_count`` int32 [L]. ``event`` is an EventOverlap with ``async_finish``, ``hook`` a
        callable launching the receive phase with ``return_recv_hook``; otherwise None.
        """
        self._ensure_usable()
        self._check_fatal_errors("low_latency_dispatch")
        self._ll_check_outstanding("low_latency_dispatch")
        try:
            self._ll_check_settings(num_max_dispatch_tokens_per_rank, num_experts)
            self._ll_check_dispatch_options(use_fp8, round_scale, use_ue8m0, use_tma_aligned_col_major_sf, recv_layout)
            self._ll_check_modes(async_finish, return_recv_hook)
            device = self._ll_device()
            num_tokens, num_topk = self._ll_check_dispatch_inputs(x, topk_idx, device)
            num_local = self._ll_layout()["num_local_experts"]
            self._ll_check_stats(
                "cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, torch.int32, num_local, device
            )
            self._ll_check_stats(
                "dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, torch.int64, self.num_ranks, device
            )
        except (ValueError, TypeError) as error:
            # This rank's input is bad, but its peers run this dispatch: take part without data.
            self._ll_dispatch_without_input(error)
            raise

        x, topk_idx = _aligned(x), topk_idx.contiguous()
        recv_count = torch.empty(num_local, dtype=torch.int32, device=device)
        count_per_source = torch.empty(num_local, self.num_ranks, dtype=torch.int32, device=device)
        num_slots = self.num_ranks * self.num_max_dispatch_tokens_per_rank
        recv_src_info = torch.empty(num_local, num_slots, dtype=torch.int32, device=device)
        recv_layout_range = torch.empty(num_local, self.num_ranks, dtype=torch.int64, device=device)
        area, op_index = self._ll_begin()
        views = self._ll_views(area)
        scales_format = _C.LL_SCALES_FP32_ROW_MAJOR
        out_data = out_scales = None
        if recv_layout == "compact":
            out_data, out_scales, recv_scales, scales_format = self._ll_compact_outputs(
                use_fp8, use_ue8m0, use_tma_aligned_col_major_sf, device
            )
            recv_x = (out_data, recv_scales) if use_fp8 else out_data
        else:
            recv_x = (views["x_fp8"], views["x_scales"]) if use_fp8 else views["x_bf16"]
        handle = LowLatencyHandle(
            owner_id=self._serial,
            area=area,
            op_index=op_index,
            num_tokens=num_tokens,
            num_topk=num_topk,
            num_max_dispatch_tokens_per_rank=self.num_max_dispatch_tokens_per_rank,
            hidden=self.hidden,
            num_experts=self.num_experts,
            use_fp8=use_fp8,
            recv_count=recv_count,
            count_per_source=count_per_source,
            recv_src_token=views["src_token"],
            recv_topk_slot=views["topk_slot"],
            recv_layout=recv_layout,
            recv_src_info=recv_src_info,
            recv_layout_range=recv_layout_range,
        )
        outputs = (out_data, out_scales, recv_src_info, recv_layout_range)
        stats = (cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats)

        def launch(phases: int, stream: torch.cuda.Stream) -> None:
            _C.low_latency_dispatch(
                *self._ll_sizing(),
                area,
                x.data_ptr(),
                topk_idx.data_ptr(),
                num_tokens,
                num_topk,
                use_fp8,
                recv_count.data_ptr(),
                count_per_source.data_ptr(),
                self._max_num_sms,
                stream.cuda_stream,
                phases,
                False,
                round_scale,
                pointer(out_data),
                pointer(out_scales),
                scales_format,
                recv_src_info.data_ptr(),
                recv_layout_range.data_ptr(),
                pointer(cumulative_local_expert_recv_stats),
                pointer(dispatch_wait_recv_cost_stats),
                pointer(self._ll_rank_mask),
            )

        def received() -> None:
            handle.received = True

        event, hook = self._ll_run(
            "low_latency_dispatch",
            launch,
            received,
            async_finish,
            return_recv_hook,
            keep_alive=tuple(t for t in (x, topk_idx, recv_count, count_per_source, *outputs, *stats) if t is not None),
        )
        return recv_x, recv_count, handle, event, hook

    def low_latency_combine(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        handle: LowLatencyHandle,
        *,
        zero_copy: bool = False,
        async_finish: bool = False,
        return_recv_hook: bool = False,
        out: torch.Tensor | None = None,
        combine_wait_recv_cost_stats: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, EventOverlap | None, Callable[[], None] | None]:
        """Return each expert output row to its token's rank and sum ``Σ_k w[t, k] · y_k`` in fp32
        (k ascending, ``-1`` skipped, one bf16 rounding); returns ``(combined_x [T, H], event, hook)``.

        ``x`` bf16 ``[L, R*T_ll, H]`` laid out like the dispatch's ``recv_x`` (its handle's
        ``recv_layout``); ``topk_idx`` / ``topk_weights`` are the ones given to the dispatch (int64 /
        fp32 ``[T, K]``). ``out``: a bf16 ``[T, H]`` tensor to write into instead of allocating.
        ``zero_copy`` is accepted for DeepEP's callers: the send phase always reads ``x`` in place
        (there is no staging copy to skip), e.g. the tensor of ``get_next_low_latency_combine_buffer``.
        ``combine_wait_recv_cost_stats`` int64 [R] gets the clock cycles the receive phase waited for
        each source rank added.
        """
        self._ensure_usable()
        self._check_fatal_errors("low_latency_combine")
        self._ll_check_outstanding("low_latency_combine")
        handle_usable = False
        try:
            self._ll_check_handle(handle)
            handle_usable = True
            if not isinstance(zero_copy, bool):
                raise TypeError(f"zero_copy must be a bool, got {type(zero_copy).__name__}")
            self._ll_check_modes(async_finish, return_recv_hook)
            device = self._ll_device()
            self._ll_check_combine_inputs(x, topk_idx, topk_weights, handle, out, device)
            self._ll_check_stats(
                "combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, torch.int64, self.num_ranks, device
            )
        except (ValueError, TypeError, RuntimeError) as error:
            # Take part without data: zero rows when the handle is usable (this rank's experts count
            # as absent in the peers' results), else none.
            self._ll_combine_without_input(handle if handle_usable else None, error)
            raise

        x, topk_idx, topk_weights = _aligned(x), topk_idx.contiguous(), topk_weights.contiguous()
        if out is None:
            out = torch.empty(handle.num_tokens, self.hidden, dtype=torch.bfloat16, device=device)
        area, _ = self._ll_begin()
        count_per_source = handle.count_per_source
        layout_range = handle.recv_layout_range if handle.recv_layout == "compact" else None

        def launch(phases: int, stream: torch.cuda.Stream) -> None:
            _C.low_latency_combine(
                *self._ll_sizing(),
                handle.area,
                area,
                x.data_ptr(),
                count_per_source.data_ptr(),
                topk_idx.data_ptr(),
                topk_weights.data_ptr(),
                out.data_ptr(),
                handle.num_tokens,
                handle.num_topk,
                self._max_num_sms,
                stream.cuda_stream,
                phases,
                False,
                pointer(layout_range),
                pointer(combine_wait_recv_cost_stats),
                pointer(self._ll_rank_mask),
            )

        event, hook = self._ll_run(
            "low_latency_combine",
            launch,
            lambda: None,
            async_finish,
            return_recv_hook,
            keep_alive=tuple(
                t
                for t in (x, topk_idx, topk_weights, count_per_source, out, layout_range, combine_wait_recv_cost_stats)
                if t is not None
            ),
        )
        return out, event, hook

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """A bf16 ``[L, R*T_ll, H]`` tensor owned by the buffer to write expert outputs into and
        pass as ``low_latency_combine``'s ``x`` (DeepEP's zero-copy combine). Two such tensors are
        allocated at first use and handed out in turn, so the previous combine's may still be read
        while this one is filled. Rows follow ``handle.recv_layout``. A combine's send phase reads
        it: do not write it again before that send phase has run (stream order)."""
        self._ensure_usable()
        self._ll_check_handle(handle)
        index = self.__dict__.get("_ll_combine_buffer_index", 0)
        self.__dict__["_ll_combine_buffer_index"] = index ^ 1
        buffers = self.__dict__.setdefault("_ll_combine_buffers", {})
        if index not in buffers:
            num_local = self._ll_layout()["num_local_experts"]
            buffers[index] = torch.empty(
                num_local,
                self.num_ranks * self.num_max_dispatch_tokens_per_rank,
                self.hidden,
                dtype=torch.bfloat16,
                device=self._ll_device(),
            )
        return buffers[index]

    # ------------------------------------------------------------ rank masking

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or restore rank ``rank_to_mask`` in this rank's LL rank mask.

        Stream-ordered on the current stream (CUDA-graph capturable). A masked rank is neither sent to
        nor waited for by this rank's LL operations; its experts count as absent (combine
        contributions zero). A rank must not mask itself. A rank masked by its peers must make no
        further LL call on this buffer (it would wait for peers that no longer send to it)."""
        mask_tensor = self._ll_require_masking("low_latency_update_mask_buffer")
        check_rank_to_mask(rank_to_mask, self.num_ranks, self.rank_idx)
        mask_tensor[rank_to_mask].fill_(1 if mask else 0)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Copy this rank's LL rank mask (1 = masked, by a timeout or by the caller) into
        ``mask_status``, an int32 tensor of ``num_ranks`` elements on this buffer's device
        (stream-ordered on the current stream)."""
        mask_tensor = self._ll_require_masking("low_latency_query_mask_buffer")
        _require_tensor("mask_status", mask_status, f"an int32 [{self.num_ranks}] tensor on {self._torch_device}")
        if (
            mask_status.dtype != torch.int32
            or mask_status.numel() != self.num_ranks
            or mask_status.device != self._torch_device
        ):
            raise ValueError(
                f"mask_status must be an int32 tensor of {self.num_ranks} elements on {self._torch_device}, "
                f"got {describe_with_device(mask_status)}"
            )
        mask_status.view(-1).copy_(mask_tensor)

    def low_latency_clean_mask_buffer(self) -> None:
        """Restore every rank (stream-ordered). A restored rank that is still gone is masked again by
        the next LL wait on it, after the timeout."""
        self._ll_require_masking("low_latency_clean_mask_buffer").zero_()

    def _ll_require_masking(self, call: str) -> torch.Tensor:
        self._ensure_usable()
        if self._ll_rank_mask is None:
            raise RuntimeError(
                f"{call}() needs rank masking: build the buffer with enable_rank_masking=True and a low-latency "
                "region (num_max_dispatch_tokens_per_rank > 0)"
            )
        return self._ll_rank_mask

    def _ll_masked_ranks(self) -> list[int]:
        """The ranks this rank has masked (synchronises with the device); [] without masking."""
        if self._ll_rank_mask is None:
            return []
        return [int(rank) for rank in self._ll_rank_mask.nonzero().flatten().tolist()]

    # ------------------------------------------------------------- failed input

    def _ll_dispatch_without_input(self, error: Exception) -> None:
        """Send no token (and the failure announcement), then receive: the peers' dispatch completes
        and this rank's LL state (area, epochs) stays in step with theirs."""
        if self.num_max_dispatch_tokens_per_rank <= 0:
            return  # no LL region: every rank raises the same error without launching

        def launch(stream: int, keep: Any) -> None:
            num_local = self._ll_layout()["num_local_experts"]
            counts = torch.empty(num_local * (self.num_ranks + 1), dtype=torch.int32, device=self._torch_device)
            keep(counts)
            area, _ = self._ll_begin()
            for phases in (_C.LL_PHASE_SEND, _C.LL_PHASE_RECEIVE):
                _C.low_latency_dispatch(
                    *self._ll_sizing(),
                    area=area,
                    x=0,
                    topk_idx=0,
                    num_tokens=0,
                    num_topk=1,
                    use_fp8=True,
                    recv_count=counts.data_ptr(),
                    count_per_source=counts.data_ptr() + 4 * num_local,
                    num_sms=self._max_num_sms,
                    stream=stream,
                    phases=phases,
                    input_failed=True,
                    rank_mask=pointer(self._ll_rank_mask),
                )

        take_part_without_input(self, error, launch)

    def _ll_combine_without_input(self, handle: LowLatencyHandle | None, error: Exception) -> None:
        """Send zero rows for what ``handle`` received (no row without a usable handle) with the
        failure announcement, then receive into nothing: the peers' combine completes."""
        if self.num_max_dispatch_tokens_per_rank <= 0:
            return

        def launch(stream: int, keep: Any) -> None:
            counts = 0
            if handle is not None:
                keep(handle.count_per_source)
                counts = handle.count_per_source.data_ptr()
            area, _ = self._ll_begin()
            for phases in (_C.LL_PHASE_SEND, _C.LL_PHASE_RECEIVE):
                _C.low_latency_combine(
                    *self._ll_sizing(),
                    dispatch_area=handle.area if handle is not None else 0,
                    area=area,
                    x=0,
                    count_per_source=counts,
                    topk_idx=0,
                    topk_weights=0,
                    out=0,
                    num_tokens=0,
                    num_topk=1,
                    num_sms=self._max_num_sms,
                    stream=stream,
                    phases=phases,
                    input_failed=True,
                    rank_mask=pointer(self._ll_rank_mask),
                )

        take_part_without_input(self, error, launch)

    # ---------------------------------------------------------------- launching

    def _ll_begin(self) -> tuple[int, int]:
        """(area, operation index) of the operation being started; moves to the next area."""
        area, op_index = self._ll_next_area, self._ll_num_ops
        self._ll_next_area = (area + 1) % _C.LL_AREAS
        self._ll_num_ops = op_index + 1
        return area, op_index

    def _ll_run(
        self,
        operation: str,
        launch: Callable[[int, torch.cuda.Stream], None],
        received: Callable[[], None],
        async_finish: bool,
        return_recv_hook: bool,
        keep_alive: tuple[torch.Tensor, ...],
    ) -> tuple[EventOverlap | None, Callable[[], None] | None]:
        """Launches one LL operation through ``launch(phases, stream)`` (one kernel function for
        every phase set): with a hook, the send phase now and the receive phase when the hook is
        called; otherwise both phases in one launch (on the comm stream with ``async_finish``).
        ``received()`` runs once the receive phase is launched."""
        compute = torch.cuda.current_stream(self.device)
        if return_recv_hook:
            launch(_C.LL_PHASE_SEND, compute)
            self._ll_num_pending = self._ll_num_pending + 1

            def receive() -> None:
                launch(_C.LL_PHASE_RECEIVE, torch.cuda.current_stream())
                received()

            return None, _Hook(self, operation, receive, keep_alive)
        if not async_finish:
            launch(_C.LL_PHASE_BOTH, compute)
            received()
            return None, None
        comm = self._comm_stream
        comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            launch(_C.LL_PHASE_BOTH, comm)
        received()
        event = torch.cuda.Event()
        event.record(comm)
        return EventOverlap(event, extra_tensors=keep_alive), None

    def _ll_sizing(self) -> tuple[Any, int, int, int, int]:
        """The leading arguments of every LL launcher: the runtime and the LL region's sizing."""
        return (
            self._runtime,
            self.num_max_dispatch_tokens_per_rank,
            self.hidden,
            self.num_experts,
            self.num_ll_topk,
        )

    def _ll_layout(self) -> dict:
        layout = self.__dict__.get("_ll_layout_cache")
        if layout is None:
            layout = _C.low_latency_layout(
                self.num_ranks, self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts, self.num_ll_topk
            )
            self.__dict__["_ll_layout_cache"] = layout
        return layout

    def _ll_views(self, area: int) -> dict[str, torch.Tensor]:
        """Zero-copy views of this rank's receive slots at ``area`` (built once per buffer; every
        area at the first call, so a later CUDA-graph capture creates none)."""
        cache = self.__dict__.setdefault("_ll_view_cache", {})
        if not cache:
            layout = self._ll_layout()
            base = self._runtime.local_base()
            device = self._ll_device()
            # The views keep the runtime (the window's owner) alive, not the buffer: no reference cycle.
            owner = self._runtime
            num_local, num_slots = layout["num_local_experts"], self.num_ranks * self.num_max_dispatch_tokens_per_rank
            hidden, groups = self.hidden, self.hidden // FP8_GROUP_SIZE
            for index in range(_C.LL_AREAS):
                start = self._window["ll_offset"] + index * layout["area_bytes"]
                payload = start + layout["dispatch_payload_offset"]
                headers = window_tensor(
                    owner,
                    base,
                    start + layout["dispatch_headers_offset"],
                    (num_local, num_slots, 4),
                    torch.int32,
                    device,
                )
                cache[index] = {
                    "x_bf16": window_tensor(
                        owner, base, payload, (num_local, num_slots, hidden), torch.bfloat16, device
                    ),
                    # The payload area is sized for bf16; fp8 rows use its first half, row stride H.
                    "x_fp8": window_tensor(
                        owner, base, payload, (num_local, num_slots, hidden), torch.float8_e4m3fn, device
                    ),
                    "x_scales": window_tensor(
                        owner,
                        base,
                        start + layout["dispatch_scales_offset"],
                        (num_local, num_slots, groups),
                        torch.float32,
                        device,
                    ),
                    "src_token": headers[..., 0],
                    "topk_slot": headers[..., 1],
                }
        # Fresh tensor objects each call (same memory), so callers cannot alter each other's metadata.
        return {name: view[...] for name, view in cache[area].items()}

    def _ll_device(self) -> torch.device:
        return self._torch_device

    def _ll_compact_outputs(
        self, use_fp8: bool, use_ue8m0: bool, col_major: bool, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, int]:
        """``(recv_x data, scales storage, scales as returned, scales format)`` for compact rows."""
        num_local = self._ll_layout()["num_local_experts"]
        num_slots = self.num_ranks * self.num_max_dispatch_tokens_per_rank
        dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
        data = torch.empty(num_local, num_slots, self.hidden, dtype=dtype, device=device)
        if not use_fp8:
            return data, None, None, _C.LL_SCALES_FP32_ROW_MAJOR
        groups = self.hidden // FP8_GROUP_SIZE
        if use_ue8m0:
            groups, scale_dtype = groups // UE8M0_GROUP_WORDS, torch.int32
            formats = (_C.LL_SCALES_UE8M0_ROW_MAJOR, _C.LL_SCALES_UE8M0_COL_MAJOR)
        else:
            scale_dtype, formats = torch.float32, (_C.LL_SCALES_FP32_ROW_MAJOR, _C.LL_SCALES_FP32_COL_MAJOR)
        if col_major:
            storage = torch.empty(num_local, groups, num_slots, dtype=scale_dtype, device=device)
            return data, storage, storage.transpose(1, 2), formats[1]
        storage = torch.empty(num_local, num_slots, groups, dtype=scale_dtype, device=device)
        return data, storage, storage, formats[0]

    def _ll_check_dispatch_options(
        self, use_fp8: Any, round_scale: Any, use_ue8m0: Any, col_major: Any, recv_layout: Any
    ) -> None:
        for name, value in (
            ("use_fp8", use_fp8),
            ("round_scale", round_scale),
            ("use_ue8m0", use_ue8m0),
            ("use_tma_aligned_col_major_sf", col_major),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
        if recv_layout not in RECV_LAYOUTS:
            raise ValueError(f"recv_layout must be one of {RECV_LAYOUTS}, got {recv_layout!r}")
        if round_scale and not use_fp8:
            raise ValueError("round_scale=True rounds fp8 scales to powers of two: it needs use_fp8=True")
        if use_ue8m0:
            if not round_scale:
                raise ValueError("use_ue8m0=True packs power-of-two scales: it needs round_scale=True")
            if self.hidden % (UE8M0_GROUP_WORDS * FP8_GROUP_SIZE) != 0:
                raise ValueError(
                    f"use_ue8m0=True packs 4 groups of 128 channels per int32: hidden must be a multiple of 512, "
                    f"got {self.hidden}"
                )
        if recv_layout == "per_source" and use_fp8 and (use_ue8m0 or col_major):
            option = "use_ue8m0" if use_ue8m0 else "use_tma_aligned_col_major_sf"
            raise ValueError(
                f"{option}=True needs recv_layout='compact' (per-source rows are the window's own fp32 row-major "
                "scales, returned without a copy)"
            )

    @staticmethod
    def _ll_check_stats(name: str, value: Any, dtype: torch.dtype, length: int, device: torch.device) -> None:
        if value is None:
            return
        kind = str(dtype).removeprefix("torch.")
        _require_tensor(name, value, f"{kind} [{length}]")
        if value.dtype != dtype or list(value.shape) != [length] or not value.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {kind} [{length}] tensor, got {describe_with_device(value)}")
        if value.device != device:
            raise ValueError(f"{name} must be on {device} (the buffer's device), got {describe_with_device(value)}")

    # --------------------------------------------------------------- validation

    def _ll_check_settings(self, num_max_dispatch_tokens_per_rank: Any, num_experts: Any) -> None:
        if self.num_max_dispatch_tokens_per_rank <= 0:
            raise ValueError(
                "this buffer has no low-latency region: construct it with num_max_dispatch_tokens_per_rank > 0 "
                "and num_experts"
            )
        if num_max_dispatch_tokens_per_rank != self.num_max_dispatch_tokens_per_rank:
            raise ValueError(
                f"num_max_dispatch_tokens_per_rank must equal the buffer's ({self.num_max_dispatch_tokens_per_rank}), "
                f"got {num_max_dispatch_tokens_per_rank!r}"
            )
        if num_experts != self.num_experts:
            raise ValueError(f"num_experts must equal the buffer's ({self.num_experts}), got {num_experts!r}")

    @staticmethod
    def _ll_check_modes(async_finish: bool, return_recv_hook: bool) -> None:
        if async_finish and return_recv_hook:
            raise ValueError(
                "async_finish=True and return_recv_hook=True cannot be combined: with a hook the receive phase "
                "runs when hook() is called, so there is no finished operation for an event to mark"
            )

    def _ll_check_outstanding(self, operation: str) -> None:
        if self._ll_num_pending >= MAX_OUTSTANDING:
            raise RuntimeError(
                f"at most two low-latency operations may be outstanding (the LL region is double buffered): "
                f"{self._ll_num_pending} receive hooks are still uncalled; call one before {operation}"
            )

    def _ll_check_dispatch_inputs(self, x: Any, topk_idx: Any, device: torch.device) -> tuple[int, int]:
        cap = self.num_max_dispatch_tokens_per_rank
        _require_tensor("x", x, f"bfloat16 [T, {self.hidden}]")
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            raise ValueError(f"x must be bfloat16 [T, {self.hidden}], got {describe_with_device(x)}")
        num_tokens, hidden = x.shape
        if hidden % FP8_GROUP_SIZE != 0:
            raise ValueError(f"x hidden size must be a multiple of {FP8_GROUP_SIZE}, got H={hidden}")
        if hidden != self.hidden:
            raise ValueError(
                f"x must be bfloat16 [T, {self.hidden}] (the buffer's hidden), got {describe_with_device(x)}"
            )
        if num_tokens > cap:
            raise ValueError(
                f"x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank={cap} "
                "(the low-latency cap the buffer was sized for)"
            )
        if x.device != device:
            raise ValueError(f"x must be on {device} (the buffer's device), got {describe_with_device(x)}")
        _require_tensor("topk_idx", topk_idx, f"int64 [{num_tokens}, K]")
        if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
            raise ValueError(f"topk_idx must be int64 [{num_tokens}, K], got {describe_with_device(topk_idx)}")
        num_topk = topk_idx.shape[1]
        if not 1 <= num_topk <= self.num_ll_topk:
            raise ValueError(
                f"topk_idx must have 1 <= K <= {self.num_ll_topk} (the low-latency top-k the buffer was sized for), "
                f"got {describe_with_device(topk_idx)}"
            )
        if topk_idx.device != device:
            raise ValueError(
                f"topk_idx must be on {device} (the buffer's device), got {describe_with_device(topk_idx)}"
            )
        return num_tokens, num_topk

    def _ll_check_handle(self, handle: Any) -> None:
        if not isinstance(handle, LowLatencyHandle):
            raise TypeError(
                f"handle must be the LowLatencyHandle of a low_latency_dispatch, got {type(handle).__name__}"
            )
        if handle.owner_id != self._serial:
            raise ValueError("handle comes from a low_latency_dispatch of another buffer")
        if not handle.received:
            raise RuntimeError(
                "the dispatch of this handle has not received yet: call its hook before low_latency_combine"
            )
        distance = self._ll_num_ops - handle.op_index
        if distance > MAX_COMBINE_DISTANCE:
            raise RuntimeError(
                f"handle is stale: {distance - 1} low-latency operations ran since its dispatch, whose data "
                f"has been released; low_latency_combine must be at most the {MAX_COMBINE_DISTANCE}nd LL "
                "operation after the dispatch"
            )

    def _ll_check_combine_inputs(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        handle: LowLatencyHandle,
        out: Any,
        device: torch.device,
    ) -> None:
        num_local = self._ll_layout()["num_local_experts"]
        expected = [num_local, self.num_ranks * self.num_max_dispatch_tokens_per_rank, self.hidden]
        _require_tensor("x", x, f"bfloat16 {expected}")
        if x.dtype != torch.bfloat16 or list(x.shape) != expected:
            raise ValueError(
                f"x must be bfloat16 {expected} (like the dispatch's recv_x), got {describe_with_device(x)}"
            )
        if x.device != device:
            raise ValueError(f"x must be on {device} (the buffer's device), got {describe_with_device(x)}")
        shape = [handle.num_tokens, handle.num_topk]
        for name, tensor, dtype in (("topk_idx", topk_idx, torch.int64), ("topk_weights", topk_weights, torch.float32)):
            _require_tensor(name, tensor, f"{str(dtype).removeprefix('torch.')} {shape}")
            if tensor.dtype != dtype or list(tensor.shape) != shape:
                raise ValueError(
                    f"{name} must be {str(dtype).removeprefix('torch.')} {shape} (the dispatch's T and K), "
                    f"got {describe_with_device(tensor)}"
                )
            if tensor.device != device:
                raise ValueError(
                    f"{name} must be on {device} (the buffer's device), got {describe_with_device(tensor)}"
                )
        if out is not None:
            out_shape = [handle.num_tokens, self.hidden]
            _require_tensor("out", out, f"bfloat16 {out_shape}")
            if out.dtype != torch.bfloat16 or list(out.shape) != out_shape:
                raise ValueError(f"out must be bfloat16 {out_shape}, got {describe_with_device(out)}")
            if out.device != device or not out.is_contiguous() or out.data_ptr() % _ROW_ALIGNMENT != 0:
                raise ValueError(
                    f"out must be contiguous, 16-byte aligned and on {device} (the buffer's device), "
                    f"got {describe_with_device(out)}"
                )
