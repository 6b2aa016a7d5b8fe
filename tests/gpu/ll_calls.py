"""The LL calls as the GPU tests make them: every mode (direct, hook, async) through one path, with
host synchronisation forbidden around the call itself; the expert stand-in between them; a rank's
inputs with what the reference model expects for them; and how a profiler sees the LL kernels."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deep_ep.fp8 import per_token_cast_back
from deep_ep.low_latency import KERNEL_NAMES
from deep_ep.testing.reference import ll_combine, ll_dispatch
from deep_ep.utils.testing import kineto_table_lines

# The words by which DeepEP's bench_kineto (copied by serving stacks) finds the LL kernels in a
# profile: each must name exactly one row of the profiler's table.
OPERATION_WORDS = ("dispatch", "combine")


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
    data, scales = recv_x if use_fp8 else (recv_x, None)
    if scales is not None:
        scales = unpack_ue8m0(scales) if scales.dtype == torch.int32 else scales
    y = torch.empty(data.shape, dtype=torch.bfloat16, device=data.device)
    # One local expert at a time: the fp32 temporaries of a whole [L, R*T_ll, H] cast would double
    # the memory of the 8-rank reference on a shared GPU.
    for local in range(data.shape[0]):
        rows = per_token_cast_back(data[local], scales[local].contiguous()) if scales is not None else data[local]
        torch.mul(rows, local % 3 + 1, out=y[local])  # in fp32, rounded to bf16 once: as bf16 * bf16
    return y


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
    results, ys = [], []
    # One destination at a time: its payload becomes its expert output, and only this rank's
    # received payload is kept (ll_combine reads only the origin of the other ranks' rows).
    for dest in range(len(xs)):
        (result,) = ll_dispatch(
            xs,
            idxs,
            num_experts,
            num_max_tokens,
            use_fp8=use_fp8,
            round_scale=round_scale,
            recv_layout=recv_layout,
            dests=[dest],
        )
        ys.append(ll_expert_output((result["x"], result["x_scales"]) if use_fp8 else result["x"], use_fp8))
        if dest != rank:
            result["x"] = result["x_scales"] = None
        results.append(result)
    combined = ll_combine(results, ys, idxs, weights, num_experts, num_max_tokens, sources=[rank])[0]
    return Inputs(xs[rank], idxs[rank], weights[rank]), Expected(results[rank], combined)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """Same-size integer view (fp8 has no comparison kernels); works on any strides."""
    views = {torch.float8_e4m3fn: torch.uint8, torch.bfloat16: torch.int16, torch.float32: torch.int32}
    return tensor.view(views[tensor.dtype]) if tensor.dtype in views else tensor


def kineto_table_rows(prof: Any, word: str) -> list[str]:
    """The lines of ``prof``'s key_averages table that contain ``word``, the table bench_kineto reads
    (one line per kernel word is what it needs)."""
    return [line for line in kineto_table_lines(prof) if word in line]


@dataclass
class LaunchProfile:
    """What a profiler saw of the LL kernels of one run."""

    names: list[str]  # full profiler names of the LL kernel launches, in launch order
    table_rows: dict[str, list[str]]  # per OPERATION_WORDS word: the key_averages table lines with it
    row_counts: dict[str, list[int]]  # per word: the launch count of each key_averages row with it


def profile_launches(run: Callable[[], Any]) -> tuple[LaunchProfile, Any]:
    """Profiles ``run()`` (CUDA activity only, as bench_kineto does); returns what the profiler saw
    of the LL kernels and what ``run()`` returned."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run()
        torch.cuda.synchronize()
    events = sorted(
        (event for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda event: event.time_range.start,
    )
    names = [event.name for event in events if any(kernel in event.name for kernel in KERNEL_NAMES)]
    averages = prof.key_averages()
    launches = LaunchProfile(
        names=names,
        table_rows={word: kineto_table_rows(prof, word) for word in OPERATION_WORDS},
        row_counts={word: [row.count for row in averages if word in row.key] for word in OPERATION_WORDS},
    )
    return launches, result


def launch_failures(label: str, launches: LaunchProfile, launches_per_operation: int) -> list[str]:
    """What differs from one LL dispatch and one LL combine each launched ``launches_per_operation``
    times (1 without a receive hook, 2 with one: send phase, then the hook's receive phase) as one
    kernel function per operation, each the only row of the profiler's table with its word."""
    failures = []
    launched = [kernel for name in launches.names for kernel in KERNEL_NAMES if kernel in name]
    wanted = [kernel for kernel in KERNEL_NAMES for _ in range(launches_per_operation)]
    if launched != wanted:
        failures.append(f"{label}: launched {launched}, expected {wanted}")
    for kernel in KERNEL_NAMES:
        instantiations = sorted({name for name in launches.names if kernel in name})
        if len(instantiations) > 1:
            failures.append(f"{label}: {kernel} launched as {instantiations}, expected one function")
    for word in OPERATION_WORDS:
        rows = launches.table_rows[word]
        if len(rows) != 1:
            failures.append(f"{label}: {len(rows)} profiler table rows contain {word!r}, expected 1: {rows}")
        if launches.row_counts[word] != [launches_per_operation]:
            failures.append(
                f"{label}: launch counts of the {word!r} rows {launches.row_counts[word]}, "
                f"expected [{launches_per_operation}]"
            )
    return failures
