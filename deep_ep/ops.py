"""HT dispatch and combine as torch.library custom ops: ``torch.compile(fullgraph=True)`` of an MoE
layer with no graph break around the communication, forward and backward.

Design (docs/autograd.md has the full story):

* **Static shapes.** An uncached dispatch knows its output row count only after a CPU sync, so the
  ops always dispatch with ``do_cpu_sync=False``: outputs have the worst-case row count
  (``R * T_max`` rows; expand ``align(R * T_max * min(K, L) + (a - 1) * L, a)``), a pure function
  of static ints, which the fake (meta) kernels return. Rows past the valid ones are zeroed (index
  -1) so later layers can run over all of them.
* **The buffer travels as an int.** A custom op takes tensors and scalars only, so a buffer is known
  to the ops by its serial number (``buffer._serial``, the ``owner_id`` of its handles) in a
  process-wide registry of weak references. Eager calls register the buffer; under torch.compile
  the fake kernels look it up at trace time, so call ``register_buffer(buffer)`` (or run one eager
  call) before compiling.
* **The handle travels as tensors + static ints** (:class:`TensorHandle`). The dispatch op returns
  one int32 tensor holding a copy of the handle's small device arrays (routing, slots, counts and,
  in hybrid mode, the hybrid routing: ``4*T*K + C (+ hybrid)`` ints, laid out as the library lays
  them out), plus ``recv_src_info`` and the expand row map. The combine and cached-dispatch
  ops rebuild an ``EPHandle`` from them on the host (views, no copy) and call the buffer.
* **Autograd** is registered on the ops (``torch.library.register_autograd``): dispatch's backward
  is the combine op, combine's backward is the cached-dispatch op, cached dispatch's backward is
  the combine op again (see ``deep_ep.autograd`` for the gradient semantics, which are the same).
* **Ordering.** The ops are registered as ORDERED effectful ops, so compiler passes keep them in
  program order (every rank must run the same collectives in the same order).
"""

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from deep_ep import _C
from deep_ep.autograd import expert_of_rows, kernel_input, valid_row_mask, zero_invalid_rows
from deep_ep.handle import EPHandle
from deep_ep.high_throughput import counts_field_sizes, counts_layout, worst_case_rows

__all__ = [
    "TensorHandle",
    "cached_dispatch",
    "combine",
    "dispatch",
    "expanded_row_experts",
    "register_buffer",
    "to_ep_handle",
    "worst_case_rows",
]

_BUFFERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


class TensorHandle(NamedTuple):
    """What the dispatch op returns instead of an ``EPHandle``: three tensors and static ints.

    ``routing``: int32 ``[4*T*K + C (+ hybrid ints)]``: the handle's routing (int64 ``[T, K]`` as
    int32 pairs), ``expert_slot_idx``, ``dst_buffer_slot_idx``, the counts block (``C`` ints:
    per-source counts and prefix sums, per-expert counts, ...) and, in hybrid mode, the hybrid
    routing. ``recv_src_info``: int32 ``[N, 4]`` (``to_ep_handle(handle).recv_src_metadata`` gives
    DeepEP V2's ``[N, K + 2]`` view of it). ``recv_expanded_row_idx``: int32 ``[N, K]``
    after an expand dispatch, else ``[0, K]``. ``expert_counts``: int32 ``[2, L]``, rows received
    per local expert (unaligned) and, after an expand dispatch, the first row of each expert's
    segment (a copy for the caller: grouped GEMMs; the ops do not read it). ``num_rows``: rows of
    ``recv_x`` (worst case). The other ints are the dispatch's settings.
    """

    routing: torch.Tensor
    recv_src_info: torch.Tensor
    recv_expanded_row_idx: torch.Tensor
    expert_counts: torch.Tensor
    num_rows: int
    buffer_id: int
    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    num_max_tokens_per_rank: int
    expert_alignment: int
    do_expand: bool
    num_sms: int

    def statics(self) -> tuple:
        return (
            self.buffer_id,
            self.num_tokens,
            self.hidden,
            self.num_topk,
            self.num_experts,
            self.num_max_tokens_per_rank,
            self.expert_alignment,
            self.do_expand,
            self.num_sms,
        )


# ---------------------------------------------------------------------------------------------- registry


def register_buffer(buffer: Any) -> int:
    """Make ``buffer`` known to the ops (a weak reference, keyed by ``buffer._serial``); returns the
    id. Eager calls of ``dispatch`` / ``combine`` / ``cached_dispatch`` do it themselves; call it
    before the first ``torch.compile``d call when no eager call ran first."""
    _BUFFERS[buffer._serial] = buffer
    return buffer._serial


def _lookup(buffer_id: int) -> Any:
    buffer = _BUFFERS.get(buffer_id)
    if buffer is None:
        raise RuntimeError(
            f"no ElasticBuffer with id {buffer_id} is registered with deep_ep.ops: call "
            "deep_ep.ops.register_buffer(buffer) before torch.compile traces a function using it (and keep "
            "the buffer alive while compiled code runs)"
        )
    return buffer


def _buffer_id(buffer: Any) -> int:
    if not torch.compiler.is_compiling():
        register_buffer(buffer)
    return buffer._serial


# ---------------------------------------------------------------------------------------------- shapes


def _hybrid_layout(buffer: Any, num_tokens: Any, hidden: int, num_topk: int, num_experts: int, t_max: int) -> tuple:
    """``(hybrid routing ints, num_nodes, home_node, scaleout_row_bytes)``: zeros in direct mode."""
    if getattr(buffer, "ht_mode", "direct") != "hybrid":
        return 0, 1, 0, 0
    call = buffer._ht_call(t_max, hidden, num_topk, num_experts, False)
    if not call.hybrid:
        return 0, 1, 0, 0
    # The hybrid routing size is a function of T computed by the core: a symbolic T is specialised.
    ints = _C.ht_hybrid_routing_ints(call, int(num_tokens))
    return ints, call.num_nodes, buffer.scaleout_rank_idx, call.scaleout_row_bytes


def _routing_ints(buffer: Any, num_tokens: Any, hidden: int, num_topk: int, num_experts: int, t_max: int) -> Any:
    num_local = num_experts // buffer.num_ranks
    counts = counts_layout(buffer.num_ranks, num_local)["total"]
    hybrid = _hybrid_layout(buffer, num_tokens, hidden, num_topk, num_experts, t_max)[0]
    return 4 * num_tokens * num_topk + counts + hybrid


def _pack(handle: EPHandle) -> torch.Tensor:
    """One int32 copy of the handle's small arrays, in the core's layout (routing, expert slot, dst
    slot, counts, hybrid routing). A copy: custom op outputs may not alias each other."""
    parts = [
        handle.routing.contiguous().view(torch.int32).reshape(-1),
        handle.expert_slot_idx.reshape(-1),
        handle.dst_buffer_slot_idx.reshape(-1),
        handle.counts.reshape(-1),
    ]
    if handle.hybrid_routing is not None:
        parts.append(handle.hybrid_routing.reshape(-1))
    return torch.cat(parts)


def _unpack(
    routing: torch.Tensor,
    recv_src_info: torch.Tensor,
    recv_expanded_row_idx: torch.Tensor,
    buffer_id: int,
    num_tokens: int,
    hidden: int,
    num_topk: int,
    num_experts: int,
    t_max: int,
    expert_alignment: int,
    do_expand: bool,
    num_sms: int,
) -> tuple[Any, EPHandle]:
    """``(buffer, EPHandle)`` rebuilt from a TensorHandle's parts (views of ``routing``)."""
    buffer = _lookup(buffer_id)
    num_ranks = buffer.num_ranks
    num_local = num_experts // num_ranks
    routing = kernel_input(routing, torch.int32)
    entries = num_tokens * num_topk
    counts_total = counts_layout(num_ranks, num_local)["total"]
    hybrid_ints, num_nodes, home_node, row_bytes = _hybrid_layout(
        buffer, num_tokens, hidden, num_topk, num_experts, t_max
    )
    expected = 4 * entries + counts_total + hybrid_ints
    if routing.numel() != expected:
        raise ValueError(
            f"TensorHandle.routing must hold {expected} int32 (4*T*K + counts + hybrid routing for T={num_tokens}, "
            f"K={num_topk}), got {routing.numel()}: a handle of another dispatch shape"
        )
    topk_idx = routing[: 2 * entries].view(torch.int64).view(num_tokens, num_topk)
    expert_slot = routing[2 * entries : 3 * entries].view(num_tokens, num_topk)
    dst_slot = routing[3 * entries : 4 * entries].view(num_tokens, num_topk)
    counts = routing[4 * entries : 4 * entries + counts_total]
    recv_per_source, psum_per_source, expert_offsets, unaligned, expert_start, psum_per_expert = counts.split(
        counts_field_sizes(num_ranks, num_local)
    )
    hybrid = routing[4 * entries + counts_total :] if hybrid_ints else None
    num_rows, num_expanded = worst_case_rows(num_ranks, t_max, num_topk, num_experts, expert_alignment)
    handle = EPHandle(
        do_expand=do_expand,
        num_experts=num_experts,
        expert_alignment=expert_alignment,
        num_max_tokens_per_rank=t_max,
        num_sms=num_sms,
        topk_idx=topk_idx,
        num_recv_tokens=num_rows,
        num_expanded_tokens=num_expanded,
        num_recv_tokens_per_expert_list=[],
        psum_num_recv_tokens_per_source=psum_per_source,
        psum_num_recv_tokens_per_expert=psum_per_expert,
        num_unaligned_recv_tokens_per_expert=unaligned,
        recv_src_info=kernel_input(recv_src_info, torch.int32),
        dst_buffer_slot_idx=dst_slot,
        num_ranks=num_ranks,
        num_tokens=num_tokens,
        num_topk=num_topk,
        is_exact=False,
        expert_slot_idx=expert_slot,
        num_recv_tokens_per_scaleup_rank=recv_per_source,
        expert_offsets_per_source=expert_offsets.view(num_ranks, num_local),
        expert_start=expert_start,
        recv_expanded_row_idx=kernel_input(recv_expanded_row_idx, torch.int32) if do_expand else None,
        counts=counts,
        owner_id=buffer._serial,
        hybrid_routing=hybrid,
        num_nodes=num_nodes,
        home_node=home_node,
        scaleout_row_bytes=row_bytes,
    )
    return buffer, handle


def to_ep_handle(handle: TensorHandle) -> EPHandle:
    """The ``EPHandle`` a TensorHandle stands for (eager use: its stats, or ``buffer.combine``)."""
    return _unpack(handle.routing, handle.recv_src_info, handle.recv_expanded_row_idx, *handle.statics())[1]


def _dispatch_outputs(outputs: tuple, num_topk: int, device: torch.device) -> tuple:
    """Worst-case outputs with the invalid rows zeroed, ``None`` replaced by empty placeholders."""
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = outputs
    num_rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
    valid = valid_row_mask(
        handle.psum_num_recv_tokens_per_source,
        handle.psum_num_recv_tokens_per_expert,
        handle.num_unaligned_recv_tokens_per_expert,
        num_rows,
        handle.do_expand,
    )
    zero_invalid_rows(valid, recv_x, recv_topk_idx, recv_topk_weights)
    if recv_topk_idx is None:
        recv_topk_idx = torch.empty((0, num_topk), dtype=torch.int64, device=device)
    if recv_topk_weights is None:
        recv_topk_weights = torch.empty((0,), dtype=torch.float32, device=device)
    return recv_x, recv_topk_idx, recv_topk_weights


# ---------------------------------------------------------------------------------------------- ops

_HandleOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@torch.library.custom_op("deep_ep::ht_dispatch", mutates_args=())
def _ht_dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    buffer_id: int,
    num_experts: int,
    num_max_tokens_per_rank: int,
    expert_alignment: int,
    num_sms: int,
    do_expand: bool,
) -> _HandleOut:
    buffer = _lookup(buffer_id)
    outputs = buffer.dispatch(
        kernel_input(x, x.dtype),
        kernel_input(topk_idx, topk_idx.dtype),
        None if topk_weights is None else kernel_input(topk_weights, topk_weights.dtype),
        num_experts=num_experts,
        num_max_tokens_per_rank=num_max_tokens_per_rank,
        expert_alignment=expert_alignment,
        num_sms=num_sms,
        do_cpu_sync=False,
        do_expand=do_expand,
    )
    handle = outputs[3]
    recv_x, recv_topk_idx, recv_topk_weights = _dispatch_outputs(outputs, topk_idx.shape[1], x.device)
    num_topk = topk_idx.shape[1]
    expanded = handle.recv_expanded_row_idx
    if expanded is None:
        expanded = torch.empty((0, num_topk), dtype=torch.int32, device=x.device)
    unaligned = handle.num_unaligned_recv_tokens_per_expert
    starts = handle.psum_num_recv_tokens_per_expert - unaligned
    expert_counts = torch.stack([unaligned, starts]).to(torch.int32)
    return recv_x, recv_topk_idx, recv_topk_weights, _pack(handle), handle.recv_src_info, expanded, expert_counts


def _fake_dispatch_outputs(
    x: torch.Tensor,
    buffer: Any,
    num_topk: int,
    num_experts: int,
    num_max_tokens_per_rank: int,
    expert_alignment: int,
    do_expand: bool,
    with_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Fake ``(recv_x, recv_topk_idx, recv_topk_weights)`` of a dispatch without CPU sync (worst-case
    rows; the uncached and the cached op return the same), and the worst-case received row count."""
    num_rows, num_expanded = worst_case_rows(
        buffer.num_ranks, num_max_tokens_per_rank, num_topk, num_experts, expert_alignment
    )
    recv_x = x.new_empty((num_expanded if do_expand else num_rows, x.shape[1]))
    recv_topk_idx = x.new_empty((0, num_topk) if do_expand else (num_rows, num_topk), dtype=torch.int64)
    if not with_weights:
        weights_shape: tuple = (0,)
    else:
        weights_shape = (num_expanded,) if do_expand else (num_rows, num_topk)
    return recv_x, recv_topk_idx, x.new_empty(weights_shape, dtype=torch.float32), num_rows


@_ht_dispatch.register_fake
def _ht_dispatch_fake(
    x, topk_idx, topk_weights, buffer_id, num_experts, num_max_tokens_per_rank, expert_alignment, num_sms, do_expand
):
    buffer = _lookup(buffer_id)
    num_tokens, hidden = x.shape
    num_topk = topk_idx.shape[1]
    recv_x, recv_topk_idx, recv_topk_weights, num_rows = _fake_dispatch_outputs(
        x, buffer, num_topk, num_experts, num_max_tokens_per_rank, expert_alignment, do_expand, topk_weights is not None
    )
    ints = _routing_ints(buffer, num_tokens, hidden, num_topk, num_experts, num_max_tokens_per_rank)
    routing = x.new_empty((ints,), dtype=torch.int32)
    src_info = x.new_empty((num_rows, _C.HT_SRC_INFO_COLUMNS), dtype=torch.int32)
    expanded = x.new_empty((num_rows, num_topk) if do_expand else (0, num_topk), dtype=torch.int32)
    expert_counts = x.new_empty((2, num_experts // buffer.num_ranks), dtype=torch.int32)
    return recv_x, recv_topk_idx, recv_topk_weights, routing, src_info, expanded, expert_counts


@torch.library.custom_op("deep_ep::ht_cached_dispatch", mutates_args=())
def _ht_cached_dispatch(
    x: torch.Tensor,
    routing: torch.Tensor,
    recv_src_info: torch.Tensor,
    recv_expanded_row_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    buffer_id: int,
    num_tokens: int,
    hidden: int,
    num_topk: int,
    num_experts: int,
    num_max_tokens_per_rank: int,
    expert_alignment: int,
    do_expand: bool,
    num_sms: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    buffer, handle = _unpack(
        routing,
        recv_src_info,
        recv_expanded_row_idx,
        buffer_id,
        num_tokens,
        hidden,
        num_topk,
        num_experts,
        num_max_tokens_per_rank,
        expert_alignment,
        do_expand,
        num_sms,
    )
    outputs = buffer.dispatch(
        kernel_input(x, x.dtype),
        handle=handle,
        topk_weights=None if topk_weights is None else kernel_input(topk_weights, topk_weights.dtype),
        num_sms=num_sms,
    )
    return _dispatch_outputs(outputs, num_topk, x.device)


@_ht_cached_dispatch.register_fake
def _ht_cached_dispatch_fake(
    x,
    routing,
    recv_src_info,
    recv_expanded_row_idx,
    topk_weights,
    buffer_id,
    num_tokens,
    hidden,
    num_topk,
    num_experts,
    num_max_tokens_per_rank,
    expert_alignment,
    do_expand,
    num_sms,
):
    recv_x, recv_topk_idx, recv_topk_weights, _ = _fake_dispatch_outputs(
        x,
        _lookup(buffer_id),
        num_topk,
        num_experts,
        num_max_tokens_per_rank,
        expert_alignment,
        do_expand,
        topk_weights is not None,
    )
    return recv_x, recv_topk_idx, recv_topk_weights


@torch.library.custom_op("deep_ep::ht_combine", mutates_args=())
def _ht_combine(
    x: torch.Tensor,
    routing: torch.Tensor,
    recv_src_info: torch.Tensor,
    recv_expanded_row_idx: torch.Tensor,
    topk_weights: torch.Tensor | None,
    bias0: torch.Tensor | None,
    bias1: torch.Tensor | None,
    buffer_id: int,
    num_tokens: int,
    hidden: int,
    num_topk: int,
    num_experts: int,
    num_max_tokens_per_rank: int,
    expert_alignment: int,
    do_expand: bool,
    num_sms: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    buffer, handle = _unpack(
        routing,
        recv_src_info,
        recv_expanded_row_idx,
        buffer_id,
        num_tokens,
        hidden,
        num_topk,
        num_experts,
        num_max_tokens_per_rank,
        expert_alignment,
        do_expand,
        num_sms,
    )
    biases = None
    if bias0 is not None or bias1 is not None:
        biases = tuple(None if b is None else kernel_input(b, b.dtype) for b in (bias0, bias1))
    combined_x, combined_topk_weights, _ = buffer.combine(
        kernel_input(x, x.dtype),
        handle,
        topk_weights=None if topk_weights is None else kernel_input(topk_weights, topk_weights.dtype),
        bias=biases,
        num_sms=num_sms,
    )
    if combined_topk_weights is None:
        combined_topk_weights = torch.empty((0,), dtype=torch.float32, device=x.device)
    return combined_x, combined_topk_weights


@_ht_combine.register_fake
def _ht_combine_fake(
    x,
    routing,
    recv_src_info,
    recv_expanded_row_idx,
    topk_weights,
    bias0,
    bias1,
    buffer_id,
    num_tokens,
    hidden,
    num_topk,
    num_experts,
    num_max_tokens_per_rank,
    expert_alignment,
    do_expand,
    num_sms,
):
    _lookup(buffer_id)
    combined_x = x.new_empty((num_tokens, x.shape[1]))
    weights_shape = (0,) if topk_weights is None else (num_tokens, num_topk)
    return combined_x, x.new_empty(weights_shape, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- autograd


def _zeros_if_none(grad: Any, shape: Any, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(shape, dtype=dtype) if grad is None else grad


def _dispatch_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    x, topk_idx, topk_weights, buffer_id, num_experts, t_max, alignment, num_sms, do_expand = inputs
    recv_x, _, recv_topk_weights, routing, src_info, expanded, _ = output
    ctx.statics = (
        buffer_id,
        x.shape[0],
        x.shape[1],
        topk_idx.shape[1],
        num_experts,
        t_max,
        alignment,
        do_expand,
        num_sms,
    )
    _save_backward_state(
        ctx, recv_x, recv_topk_weights if topk_weights is not None else None, routing, src_info, expanded
    )


def _save_backward_state(
    ctx: Any, recv_x: Any, recv_topk_weights: Any, routing: Any, src_info: Any, expanded: Any
) -> None:
    ctx.recv_shape = recv_x.shape
    ctx.weights_shape = None if recv_topk_weights is None else recv_topk_weights.shape
    ctx.save_for_backward(routing, src_info, expanded)


def _combine_of_gradients(ctx: Any, grad_recv_x: Any, grad_recv_topk_weights: Any) -> tuple:
    """Backward of a (cached) dispatch: the combine op over the gradients (always run: collective)."""
    routing, src_info, expanded = ctx.saved_tensors
    grad_recv_x = _zeros_if_none(grad_recv_x, ctx.recv_shape, torch.bfloat16, routing)
    weights = None
    if ctx.weights_shape is not None:
        weights = _zeros_if_none(grad_recv_topk_weights, ctx.weights_shape, torch.float32, routing)
    grad_x, grad_weights = torch.ops.deep_ep.ht_combine(
        grad_recv_x.to(torch.bfloat16), routing, src_info, expanded, weights, None, None, *ctx.statics
    )
    return grad_x, (grad_weights if ctx.weights_shape is not None else None)


def _dispatch_backward(ctx: Any, grad_recv_x: Any, _grad_idx: Any, grad_recv_topk_weights: Any, *_unused: Any) -> tuple:
    grad_x, grad_weights = _combine_of_gradients(ctx, grad_recv_x, grad_recv_topk_weights)
    return (grad_x, None, grad_weights) + (None,) * 6


def _cached_dispatch_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    _x, routing, src_info, expanded, topk_weights, *statics = inputs
    recv_x, _, recv_topk_weights = output
    ctx.statics = tuple(statics)
    _save_backward_state(
        ctx, recv_x, recv_topk_weights if topk_weights is not None else None, routing, src_info, expanded
    )


def _cached_dispatch_backward(ctx: Any, grad_recv_x: Any, _grad_idx: Any, grad_recv_topk_weights: Any) -> tuple:
    grad_x, grad_weights = _combine_of_gradients(ctx, grad_recv_x, grad_recv_topk_weights)
    return (grad_x, None, None, None, grad_weights) + (None,) * 9


def _combine_setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    _x, routing, src_info, expanded, topk_weights, bias0, bias1, *statics = inputs
    combined_x, _ = output
    ctx.statics = tuple(statics)
    ctx.combined_shape = combined_x.shape
    ctx.has_weights = topk_weights is not None
    ctx.has_bias = (bias0 is not None, bias1 is not None)
    ctx.save_for_backward(routing, src_info, expanded)


def _combine_backward(ctx: Any, grad_combined_x: Any, grad_combined_topk_weights: Any) -> tuple:
    routing, src_info, expanded = ctx.saved_tensors
    # statics: (buffer_id, num_tokens, hidden, num_topk, num_experts, T_max, alignment, do_expand, num_sms)
    num_tokens, num_topk, do_expand = ctx.statics[1], ctx.statics[3], ctx.statics[7]
    grad = _zeros_if_none(grad_combined_x, ctx.combined_shape, torch.bfloat16, routing).to(torch.bfloat16)
    weights = None
    if ctx.has_weights:
        weights = _zeros_if_none(grad_combined_topk_weights, (num_tokens, num_topk), torch.float32, routing)
    grad_x, recv_topk_idx, grad_weights = torch.ops.deep_ep.ht_cached_dispatch(
        grad, routing, src_info, expanded, weights, *ctx.statics
    )
    if not ctx.has_weights:
        grad_weights = None
    elif not do_expand:
        # combined_topk_weights[t, k] came from the owner of expert k only (see deep_ep.autograd).
        grad_weights = grad_weights.masked_fill(recv_topk_idx < 0, 0)
    bias0 = grad if ctx.has_bias[0] else None
    bias1 = grad if ctx.has_bias[1] else None
    return (grad_x, None, None, None, grad_weights, bias0, bias1) + (None,) * 9


torch.library.register_autograd("deep_ep::ht_dispatch", _dispatch_backward, setup_context=_dispatch_setup_context)
torch.library.register_autograd(
    "deep_ep::ht_cached_dispatch", _cached_dispatch_backward, setup_context=_cached_dispatch_setup_context
)
torch.library.register_autograd("deep_ep::ht_combine", _combine_backward, setup_context=_combine_setup_context)

for _name in ("deep_ep::ht_dispatch", "deep_ep::ht_cached_dispatch", "deep_ep::ht_combine"):
    torch.library._register_effectful_op(_name, torch.library.EffectType.ORDERED)


# ---------------------------------------------------------------------------------------------- public API


def _fail(buffer: Any, operation: str, error: Exception, **details: Any) -> None:
    """Raise ``error``; in eager mode after taking part in the operation without data (the peers
    are in the collective). Under torch.compile this runs at trace time, before any collective."""
    if not torch.compiler.is_compiling():
        from deep_ep.autograd import take_part_and_raise

        take_part_and_raise(buffer, operation, error, **details)
    raise error


def _check_handle(buffer: Any, handle: Any, operation: str, x: Any) -> None:
    # A failing cached dispatch takes part in the cached protocol (the handle's T_max is all it
    # reads); a failing combine sends no row (the handle is not this buffer's EPHandle).
    details = {"x": x, "handle": handle} if operation == "dispatch" else {"x": x, "handle": None}
    if not isinstance(handle, TensorHandle):
        error: Exception = TypeError(f"handle must be a deep_ep.ops.TensorHandle, got {type(handle).__name__}")
        _fail(buffer, operation, error, **details)
    if handle.buffer_id != buffer._serial:
        error = ValueError("handle comes from a dispatch of another buffer: pass it to the buffer that dispatched")
        _fail(buffer, operation, error, **details)


def dispatch(
    buffer: Any,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
    num_experts: int | None = None,
    *,
    num_max_tokens_per_rank: int | None = None,
    expert_alignment: int = 1,
    num_sms: int = 0,
    do_expand: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, TensorHandle]:
    """HT dispatch as a custom op (always ``do_cpu_sync=False``): ``(recv_x, recv_topk_idx,
    recv_topk_weights, handle)``.

    Outputs have the worst-case row count (``worst_case_rows``); rows past the valid ones are zero
    (``recv_topk_idx`` -1). ``recv_topk_idx`` is None after an expand dispatch, ``recv_topk_weights``
    None without weights. ``x``: bf16 ``[T, H]`` (fp8 is not offered: no gradient). Differentiable
    in ``x`` and ``topk_weights``; backward is the combine op (collective)."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        what = type(x).__name__ if not isinstance(x, torch.Tensor) else str(x.dtype)
        _fail(
            buffer,
            "dispatch",
            ValueError(f"deep_ep.ops.dispatch takes bf16 x [T, H], got {what}"),
            num_experts=num_experts,
        )
    if num_experts is None:
        num_experts = buffer.num_experts
    if num_max_tokens_per_rank is None:
        num_max_tokens_per_rank = buffer.num_max_tokens_per_rank
    if not num_experts or not num_max_tokens_per_rank:
        _fail(
            buffer,
            "dispatch",
            ValueError(
                "deep_ep.ops.dispatch needs num_experts and num_max_tokens_per_rank (given, or set on the buffer): "
                "they fix the worst-case output shapes"
            ),
            num_experts=num_experts or None,
        )
    outputs = torch.ops.deep_ep.ht_dispatch(
        x,
        topk_idx,
        topk_weights,
        _buffer_id(buffer),
        num_experts,
        num_max_tokens_per_rank,
        expert_alignment,
        num_sms,
        do_expand,
    )
    recv_x, recv_topk_idx, recv_topk_weights, routing, src_info, expanded, expert_counts = outputs
    handle = TensorHandle(
        routing,
        src_info,
        expanded,
        expert_counts,
        recv_x.shape[0],
        buffer._serial,
        x.shape[0],
        x.shape[1],
        topk_idx.shape[1],
        num_experts,
        num_max_tokens_per_rank,
        expert_alignment,
        do_expand,
        num_sms,
    )
    return (
        recv_x,
        None if do_expand else recv_topk_idx,
        None if topk_weights is None else recv_topk_weights,
        handle,
    )


def cached_dispatch(
    buffer: Any, x: torch.Tensor, handle: TensorHandle, topk_weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Cached HT dispatch (the handle's routing) as a custom op: ``(recv_x, recv_topk_idx,
    recv_topk_weights)`` with the handle's worst-case rows, invalid rows zero. Differentiable;
    backward is the combine op."""
    _check_handle(buffer, handle, "dispatch", x)
    recv_x, recv_topk_idx, recv_topk_weights = torch.ops.deep_ep.ht_cached_dispatch(
        x,
        handle.routing,
        handle.recv_src_info,
        handle.recv_expanded_row_idx,
        topk_weights,
        *_statics_with_registration(buffer, handle),
    )
    return (
        recv_x,
        None if handle.do_expand else recv_topk_idx,
        None if topk_weights is None else recv_topk_weights,
    )


def expanded_row_experts(handle: TensorHandle) -> torch.Tensor:
    """int64 ``[num_rows]``: the local expert of each row of an expand dispatch's ``recv_x`` (-1 for
    padding and rows past the last expert), from ``handle.expert_counts``. Traceable."""
    if not handle.do_expand:
        raise ValueError("expanded_row_experts needs the handle of an expand dispatch (do_expand=True)")
    return expert_of_rows(handle.expert_counts[1], handle.expert_counts[0], handle.num_rows)


def _statics_with_registration(buffer: Any, handle: TensorHandle) -> tuple:
    _buffer_id(buffer)
    return handle.statics()


def combine(
    buffer: Any,
    x: torch.Tensor,
    handle: TensorHandle,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HT combine as a custom op: ``(combined_x [T, H], combined_topk_weights [T, K] or None)``.
    ``x`` has the handle's worst-case rows (only the valid ones are read). Differentiable in ``x``,
    ``topk_weights`` and ``bias``; backward is the cached-dispatch op (collective)."""
    _check_handle(buffer, handle, "combine", x)
    if bias is None or isinstance(bias, torch.Tensor):
        bias0, bias1 = bias, None
    else:
        terms = list(bias)
        if len(terms) > 2:
            _fail(buffer, "combine", ValueError(f"bias may hold at most two tensors, got {len(terms)}"), x=x)
        bias0, bias1 = (terms + [None, None])[:2]
    combined_x, combined_topk_weights = torch.ops.deep_ep.ht_combine(
        x,
        handle.routing,
        handle.recv_src_info,
        handle.recv_expanded_row_idx,
        topk_weights,
        bias0,
        bias1,
        *_statics_with_registration(buffer, handle),
    )
    return combined_x, None if topk_weights is None else combined_topk_weights
