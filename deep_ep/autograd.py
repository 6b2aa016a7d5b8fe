"""Autograd for high-throughput dispatch and combine (eager mode), as Megatron-LM's ``fused_a2a`` wraps DeepEP.

``dispatch`` copies each token to every rank that holds one of its experts: a broadcast, whose
gradient is the sum of the copies' gradients, which is what ``combine`` computes. ``combine`` sums a
token's rows from its destination ranks: its gradient hands the token's output gradient to every
row, which is what a cached ``dispatch`` (``handle=``) does. So:

* ``dispatch`` forward: ``buffer.dispatch``; backward: ``buffer.combine(grad_recv_x, handle,
  topk_weights=grad_recv_topk_weights)``. Its ``combined_topk_weights`` is the gradient of
  ``topk_weights``: slot ``k`` comes from the rank owning expert ``topk_idx[t, k]``.
* ``combine`` forward: ``buffer.combine``; backward: ``buffer.dispatch(grad_combined_x,
  handle=handle, topk_weights=grad_combined_topk_weights)`` (cached dispatch of the gradient); the
  received weights, kept on the slots of local experts only, are the gradient of ``topk_weights``;
  each bias gets ``grad_combined_x`` itself.

Every backward is a collective: all ranks must run backward over the same graph (autograd then runs
these calls in the same order on every rank: the forward order reversed). docs/autograd.md has the
contract, the precision and what is not covered; ``deep_ep.ops`` is the torch.compile path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deep_ep.handle import EPHandle

__all__ = ["combine", "dispatch", "expanded_row_experts"]


# ---------------------------------------------------------------------------------------------- helpers


def expert_of_rows(starts: torch.Tensor, counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """int64 ``[num_rows]``: the local expert whose segment ``[starts[l], starts[l] + counts[l])``
    holds each row of an expand dispatch output, -1 for alignment padding and rows past the last
    segment. Device-side only (no host sync, traceable by torch.compile)."""
    starts = starts.to(torch.int64).contiguous()
    rows = torch.arange(num_rows, device=starts.device)
    # Segment starts are non-decreasing (aligned exclusive prefix sums); searchsorted finds the last
    # expert starting at or before each row (an empty expert sharing its start with the next one is
    # skipped over, which is right: it owns no row).
    segment = torch.searchsorted(starts, rows, right=True) - 1
    clamped = segment.clamp(min=0)
    inside = (segment >= 0) & (rows < starts.gather(0, clamped) + counts.to(torch.int64).gather(0, clamped))
    return torch.where(inside, segment, -1)


def valid_row_mask(
    psum_per_source: torch.Tensor,
    psum_per_expert: torch.Tensor,
    unaligned_per_expert: torch.Tensor,
    num_rows: int,
    do_expand: bool,
) -> torch.Tensor:
    """bool ``[num_rows]`` on the handle's device: the rows of a dispatch output that hold data.

    Non-expand: the first ``N`` rows (``N = psum_per_source[-1]``, from the handle's
    ``psum_num_recv_tokens_per_source``). Expand: the rows of each local expert,
    ``[psum[l] - unaligned[l], psum[l])``; alignment padding and the rows past the last expert are
    not valid. Device-side only (no host sync, traceable by torch.compile).
    """
    if not do_expand:
        rows = torch.arange(num_rows, device=psum_per_source.device)
        return rows < psum_per_source[-1:].to(torch.int64)
    starts = psum_per_expert.to(torch.int64) - unaligned_per_expert.to(torch.int64)
    return expert_of_rows(starts, unaligned_per_expert, num_rows) >= 0


def expanded_row_experts(handle: EPHandle) -> torch.Tensor:
    """int64 ``[N']``: the local expert of each row of an expand dispatch's ``recv_x`` (-1 for
    padding and, without CPU sync, the rows past the last expert). Device-side, no host sync."""
    if not handle.do_expand:
        raise ValueError("expanded_row_experts needs the handle of an expand dispatch (do_expand=True)")
    counts = handle.num_unaligned_recv_tokens_per_expert
    starts = handle.psum_num_recv_tokens_per_expert.to(torch.int64) - counts.to(torch.int64)
    return expert_of_rows(starts, counts, handle.num_expanded_tokens)


def handle_valid_row_mask(handle: EPHandle) -> torch.Tensor:
    """``valid_row_mask`` of the dispatch outputs an ``EPHandle`` describes."""
    num_rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
    return valid_row_mask(
        handle.psum_num_recv_tokens_per_source,
        handle.psum_num_recv_tokens_per_expert,
        handle.num_unaligned_recv_tokens_per_expert,
        num_rows,
        handle.do_expand,
    )


def zero_invalid_rows(
    valid: torch.Tensor,
    recv_x: torch.Tensor,
    recv_topk_idx: torch.Tensor | None,
    recv_topk_weights: torch.Tensor | None,
) -> None:
    """In place: rows outside ``valid`` of a worst-case (no CPU sync) dispatch output become zero
    (``recv_topk_idx``: -1). The kernels leave them uninitialised; an expert layer reading them would
    otherwise put garbage (NaN included) into its weight gradients, and a later combine never reads
    them, so their gradient is zero too."""
    invalid = ~valid
    recv_x.masked_fill_(invalid.unsqueeze(1), 0)
    if recv_topk_idx is not None:
        recv_topk_idx.masked_fill_(invalid.unsqueeze(1), -1)
    if recv_topk_weights is not None:
        recv_topk_weights.masked_fill_(invalid.view(-1, *([1] * (recv_topk_weights.dim() - 1))), 0)


def kernel_input(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` as the kernels read it: ``dtype``, contiguous, 16-byte aligned (a gradient may be a
    strided or offset view)."""
    tensor = tensor.to(dtype).contiguous()
    if tensor.numel() > 0 and tensor.data_ptr() % 16 != 0:
        tensor = tensor.clone()
    return tensor


def take_part_and_raise(buffer: Any, operation: str, error: Exception, **details: Any) -> None:
    """Raise ``error`` after this rank took part in the operation without data, as the buffer does
    for its own argument errors (docs/api.md, "When something goes wrong"): its peers are already
    in the collective and must not wait for this rank."""
    hook = getattr(buffer, f"_{operation}_without_input", None)
    if hook is not None:
        if operation == "dispatch":
            hook(details.get("handle"), details.get("num_experts"), error)
        else:
            hook(details.get("x"), details.get("handle"), error)
    raise error


_REFUSED_KWARGS = {
    "async_with_compute_stream": (
        "async_with_compute_stream=True is not supported under autograd: outputs must be ready on the "
        "caller's stream (use previous_event / allocate_on_comm_stream to order against other work)"
    ),
}


def _check_refused(kwargs: dict[str, Any]) -> str | None:
    for name, message in _REFUSED_KWARGS.items():
        if kwargs.get(name):
            return message
    return None


def _split_bias(bias: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """``(bias0, bias1, given_as_tensor)`` of combine's ``bias`` argument (a tensor or up to two)."""
    if bias is None:
        return None, None, False
    if isinstance(bias, torch.Tensor):
        return bias, None, True
    if not isinstance(bias, Sequence) or len(bias) > 2:
        raise ValueError(f"bias must be None, a tensor or a sequence of at most two tensors, got {bias!r}")
    terms = list(bias) + [None] * (2 - len(bias))
    return terms[0], terms[1], False


# ---------------------------------------------------------------------------------------------- dispatch


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, buffer: Any, x: torch.Tensor, topk_idx: Any, topk_weights: Any, kwargs: dict) -> Any:
        recv_x, recv_topk_idx, recv_topk_weights, handle, _ = buffer.dispatch(x, topk_idx, topk_weights, **kwargs)
        if not handle.is_exact:
            zero_invalid_rows(handle_valid_row_mask(handle), recv_x, recv_topk_idx, recv_topk_weights)
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.recv_shape = tuple(recv_x.shape)
        ctx.weights_shape = None if recv_topk_weights is None else tuple(recv_topk_weights.shape)
        ctx.num_sms = kwargs.get("num_sms", 0)
        ctx.set_materialize_grads(False)
        if recv_topk_idx is not None:
            ctx.mark_non_differentiable(recv_topk_idx)
        return recv_x, recv_topk_idx, recv_topk_weights, handle

    @staticmethod
    def backward(ctx: Any, grad_recv_x: Any, _grad_idx: Any, grad_recv_topk_weights: Any, _grad_handle: Any) -> Any:
        # Always run the combine (and with weights iff the forward had weights): it is a collective
        # and its weights presence must agree across ranks, whatever this rank's gradients are.
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(ctx.recv_shape, dtype=torch.bfloat16, device=ctx.handle.topk_idx.device)
        grad_recv_x = kernel_input(grad_recv_x, torch.bfloat16)
        weights = None
        if ctx.weights_shape is not None:
            if grad_recv_topk_weights is None:
                weights = torch.zeros(ctx.weights_shape, dtype=torch.float32, device=grad_recv_x.device)
            else:
                weights = kernel_input(grad_recv_topk_weights, torch.float32)
        grad_x, grad_topk_weights, _ = ctx.buffer.combine(
            grad_recv_x, ctx.handle, topk_weights=weights, num_sms=ctx.num_sms
        )
        return None, grad_x, None, grad_topk_weights, None


def dispatch(
    buffer: Any,
    x: torch.Tensor,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    num_experts: int | None = None,
    **dispatch_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, EPHandle]:
    """``buffer.dispatch`` with a backward: ``(recv_x, recv_topk_idx, recv_topk_weights, handle)``.

    ``x`` must be bf16 ``[T, H]`` (an fp8 ``(data, scales)`` pair raises ``ValueError``: there is no
    gradient through a quantised input). ``dispatch_kwargs`` go to ``buffer.dispatch``
    (``num_max_tokens_per_rank``, ``expert_alignment``, ``num_sms``, ``handle``, ``do_cpu_sync``,
    ``do_expand``, ``previous_event``, ``allocate_on_comm_stream``, ...);
    ``async_with_compute_stream=True`` raises ``ValueError``. With ``do_cpu_sync=False`` the outputs
    have the worst-case row count and the rows past the valid ones are zeroed here (``recv_topk_idx``
    -1), so an expert layer may run over all rows.

    Backward (collective, every rank together): ``grad_x, grad_topk_weights =
    buffer.combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights)``: each token's copies'
    gradients summed in fp32 in combine's order (one term per rank, in ascending order of the rank's
    last top-k lane of the token; expand: per rank in top-k lane order first), rounded to bf16
    once. ``grad_topk_weights[t, k]`` is the gradient the rank owning expert ``topk_idx[t, k]``
    computed for slot ``k`` (non-expand: the gradient of a slot at a rank that does not own its
    expert is dropped, so use only the local slots of ``recv_topk_weights``, as an MoE layer does;
    0 for ``topk_idx == -1``).
    """
    kwargs = dict(dispatch_kwargs)
    if num_experts is not None:
        kwargs["num_experts"] = num_experts
    error: Exception | None = None
    if isinstance(x, (tuple, list)):
        error = ValueError(
            "deep_ep.autograd.dispatch takes bf16 x only: an fp8 (data, scales) pair has no gradient "
            "(dispatch bf16 and quantise after, or use buffer.dispatch without autograd)"
        )
    elif (message := _check_refused(kwargs)) is not None:
        error = ValueError(message)
    if error is not None:
        take_part_and_raise(buffer, "dispatch", error, handle=kwargs.get("handle"), num_experts=num_experts)
    return _Dispatch.apply(buffer, x, topk_idx, topk_weights, kwargs)


# ---------------------------------------------------------------------------------------------- combine


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        buffer: Any,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: Any,
        bias0: Any,
        bias1: Any,
        bias_as_tensor: bool,
        kwargs: dict,
    ) -> Any:
        if bias_as_tensor:
            bias: Any = bias0
        elif bias0 is None and bias1 is None:
            bias = None
        else:
            bias = (bias0, bias1)
        combined_x, combined_topk_weights, _ = buffer.combine(x, handle, topk_weights=topk_weights, bias=bias, **kwargs)
        ctx.buffer = buffer
        ctx.handle = handle
        ctx.combined_shape = tuple(combined_x.shape)
        ctx.has_weights = topk_weights is not None
        ctx.has_bias = (bias0 is not None, bias1 is not None)
        ctx.num_sms = kwargs.get("num_sms", 0)
        ctx.set_materialize_grads(False)
        return combined_x, combined_topk_weights

    @staticmethod
    def backward(ctx: Any, grad_combined_x: Any, grad_combined_topk_weights: Any) -> Any:
        handle: EPHandle = ctx.handle
        device = handle.topk_idx.device
        if grad_combined_x is None:
            grad_combined_x = torch.zeros(ctx.combined_shape, dtype=torch.bfloat16, device=device)
        grad_combined_x = kernel_input(grad_combined_x, torch.bfloat16)
        weights = None
        if ctx.has_weights:
            if grad_combined_topk_weights is None:
                shape = (handle.num_tokens, handle.num_topk)
                weights = torch.zeros(shape, dtype=torch.float32, device=device)
            else:
                weights = kernel_input(grad_combined_topk_weights, torch.float32)
        grad_x, recv_topk_idx, grad_weights, _, _ = ctx.buffer.dispatch(
            grad_combined_x, handle=handle, topk_weights=weights, num_sms=ctx.num_sms
        )
        if not handle.is_exact:
            zero_invalid_rows(handle_valid_row_mask(handle), grad_x, recv_topk_idx, grad_weights)
        if grad_weights is not None and not handle.do_expand:
            # combined_topk_weights[t, k] came from the owner of expert k only: the other ranks'
            # slot k had no influence, so their gradient is 0.
            grad_weights = grad_weights.masked_fill(recv_topk_idx < 0, 0)
        bias0_grad = grad_combined_x if ctx.has_bias[0] else None
        bias1_grad = grad_combined_x if ctx.has_bias[1] else None
        return None, grad_x, None, grad_weights, bias0_grad, bias1_grad, None, None


def combine(
    buffer: Any,
    x: torch.Tensor,
    handle: EPHandle,
    topk_weights: torch.Tensor | None = None,
    bias: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    **combine_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``buffer.combine`` with a backward: ``(combined_x, combined_topk_weights)``.

    Arguments as ``buffer.combine`` (``combine_kwargs``: ``num_sms``, ``previous_event``,
    ``allocate_on_comm_stream``, ...; ``async_with_compute_stream=True`` raises ``ValueError``).

    Backward (collective): ``buffer.dispatch(grad_combined_x, handle=handle,
    topk_weights=grad_combined_topk_weights)``: every row of ``x`` gets its token's output gradient
    (rows past the valid ones of a worst-case handle get 0); the gradient of ``topk_weights`` is the
    received gradient weights on the slots of this rank's experts (0 elsewhere; expand: the pair's
    weight); each bias gets ``grad_combined_x``. The bf16 rounding of the sum is treated as the
    identity.
    """
    try:
        bias0, bias1, bias_as_tensor = _split_bias(bias)
        if (message := _check_refused(combine_kwargs)) is not None:
            raise ValueError(message)
    except ValueError as error:
        take_part_and_raise(buffer, "combine", error, x=x, handle=handle)
    return _Combine.apply(buffer, x, handle, topk_weights, bias0, bias1, bias_as_tensor, dict(combine_kwargs))
