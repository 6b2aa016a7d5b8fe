"""The LL calls as the GPU tests make them: every mode (direct, hook, async) through one path, with
host synchronisation forbidden around the call itself; the expert stand-in between them; and a
rank's inputs with what the reference model expects for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from deep_ep.fp8 import per_token_cast_back
from deep_ep.testing.reference import ll_combine, ll_dispatch


class NoHostSync:
    """set_sync_debug_mode('error') around LL calls only (the reference and the checks sync)."""

    def __enter__(self) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode(0)


def ll_dispatch_call(
    buffer: Any, x: torch.Tensor, topk_idx: torch.Tensor, use_fp8: bool, mode: str, **options: Any
) -> tuple:
    """``(recv_x, recv_count, handle, hook)``: ``hook`` is None unless ``mode`` is 'hook' (then the
    caller calls it); with 'async' the caller's stream already waits for the event. ``options``:
    further low_latency_dispatch keywords (layout, scale format, stats)."""
    with NoHostSync():
        recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
            x,
            topk_idx,
            buffer.num_max_dispatch_tokens_per_rank,
            buffer.num_experts,
            use_fp8=use_fp8,
            async_finish=mode == "async",
            return_recv_hook=mode == "hook",
            **options,
        )
        assert (event is not None) == (mode == "async") and (hook is not None) == (mode == "hook")
        if event is not None:
            event.current_stream_wait()
    return recv_x, recv_count, handle, hook


def ll_combine_call(
    buffer: Any,
    y: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: Any,
    mode: str,
    out: torch.Tensor | None = None,
    **options: Any,
) -> tuple:
    """``(combined, hook)`` as ``ll_dispatch_call``."""
    with NoHostSync():
        combined, event, hook = buffer.low_latency_combine(
            y,
            topk_idx,
            topk_weights,
            handle,
            async_finish=mode == "async",
            return_recv_hook=mode == "hook",
            out=out,
            **options,
        )
        assert (event is not None) == (mode == "async") and (hook is not None) == (mode == "hook")
        if event is not None:
            event.current_stream_wait()
    return combined, hook


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """fp32 ``[..., 4 W]`` power-of-two scales from int32 ``[..., W]`` UE8M0 words (group 4w + b in
    byte b of word w)."""
    shifts = torch.arange(4, device=packed.device, dtype=torch.int32) * 8
    exponents = (packed.unsqueeze(-1) >> shifts) & 0xFF
    return (exponents << 23).view(torch.float32).reshape(*packed.shape[:-1], packed.shape[-1] * 4)


def ll_expert_output(recv_x: Any, use_fp8: bool) -> torch.Tensor:
    """A deterministic 'expert': dequantise, then scale local expert l by (l % 3 + 1) in bf16.

    Same arithmetic on the reference's tensors and on the kernels' views, so a bitwise-correct
    dispatch gives bitwise-identical combine inputs on the valid rows."""
    if use_fp8:
        data, scales = recv_x
        y = per_token_cast_back(data, unpack_ue8m0(scales) if scales.dtype == torch.int32 else scales.contiguous())
    else:
        y = recv_x
    factors = (torch.arange(y.shape[0], device=y.device) % 3 + 1).to(torch.bfloat16)
    return y * factors.view(-1, 1, 1)


@dataclass
class Inputs:
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


@dataclass
class Expected:
    """This rank's part of the reference: dispatch result dict and combine output."""

    dispatch: dict
    combined: torch.Tensor


def reference_case(
    rank: int,
    data: Any,
    num_experts: int,
    num_max_tokens: int,
    *,
    use_fp8: bool,
    round_scale: bool = False,
    recv_layout: str = "compact",
) -> tuple[Inputs, Expected]:
    """This rank's inputs from ``data`` (``make_group_inputs``, on the current GPU) and what the
    reference says it receives and gets back from a combine of ``ll_expert_output``."""
    device = torch.device("cuda", torch.cuda.current_device())
    xs = [x.to(device) for x in data.x]
    idxs = [idx.to(device) for idx in data.topk_idx]
    weights = [w.to(device) for w in data.topk_weights]
    results = ll_dispatch(
        xs, idxs, num_experts, num_max_tokens, use_fp8=use_fp8, round_scale=round_scale, recv_layout=recv_layout
    )
    ys = []
    for dest, result in enumerate(results):
        ys.append(ll_expert_output((result["x"], result["x_scales"]) if use_fp8 else result["x"], use_fp8))
        if dest != rank:  # ll_combine reads only the origin of the other ranks' rows: free their payloads
            result["x"] = result["x_scales"] = None
    combined = ll_combine(results, ys, idxs, weights, num_experts, num_max_tokens)[rank]
    return Inputs(xs[rank], idxs[rank], weights[rank]), Expected(results[rank], combined)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Same-size integer view (fp8 has no comparison kernels); works on any strides."""
    views = {torch.float8_e4m3fn: torch.uint8, torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return tensor.view(views[tensor.dtype]) if tensor.dtype in views else tensor
