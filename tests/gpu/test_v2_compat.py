"""DeepEP V2 client sequences through ``deep_ep.ElasticBuffer``, with V2's keyword names, checked
bitwise against the reference model (``deep_ep.testing.reference``).

The sequences follow what V2's clients do:

* Inference (the V2 backends of SGLang and vLLM). The buffer is built from the MoE shape with fp8
  sizing. Prefill sends fp8 tokens as rows (``expert_alignment=128`` for a contiguous grouped GEMM,
  ``num_sms`` / ``num_qps`` from the buffer's estimators); the expert folds the routing weights in
  (V2's combine does not weight) and combine sums; then a cached re-dispatch of the next
  activations behind ``capture()`` and a combine with a bias. Prefill also runs expanded with
  TMA-aligned column-major scales, a typed ``EventHandle`` as ``previous_event``,
  ``async_with_compute_stream`` and a pair of biases, then a cached expanded re-dispatch with
  weights. Decode runs without CPU sync: vLLM's rows with a per-call power-of-two
  ``num_max_tokens_per_rank``, and SGLang's expanded rows read by a masked grouped expert that finds
  each local expert's rows through the handle's prefix sums, eagerly and captured in a CUDA graph
  replayed with new routing.
* Training (Megatron-LM's and NeMo Automodel's wrappers). The buffer gets ``num_bytes`` from
  ``get_buffer_size_hint``. Two micro-batches go forward (dispatch, expert, combine, each behind
  ``capture()`` with outputs on the communication stream), then backward in reverse order with the
  forward handles: combine's backward is a cached dispatch of the output gradient, dispatch's
  backward a combine of the row gradients.
* Low-latency decode on a buffer that also has an LL region (``num_max_dispatch_tokens_per_rank``
  and ``num_experts`` are our constructor arguments, the LL calls keep V1's names: V2's
  ``ElasticBuffer`` has no LL calls). ``low_latency_dispatch(return_recv_hook=True)`` with fp8
  column-major scales, the hook, a masked grouped expert over rows ``[0, recv_count[l])``, then
  ``low_latency_combine`` with a hook; two micro-batches overlapped, UE8M0 scales, async and plain
  calls; HT prefill between the decode phases with nothing cleaned in between
  (``clean_low_latency_buffer`` exists on the V1 ``Buffer`` only: HT never touches the LL region).

Rows the kernels leave undefined (no CPU sync, past ``recv_count``) are NaN in the expert outputs
and weights handed to combine, so a combine that reads one fails the bitwise check.
``handle.recv_src_metadata`` is left to its own tests. Two probes pass dispatch inputs V2 accepts:
fp8 scales with column-major strides (copied to packed rows on the comm stream) and int32 packed
UE8M0 input scales (unpacked for the kernels, the received scales packed back the same way).

One launch per rank count runs every sequence and returns each rank's mismatches; the tests assert
on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from ht_checks import assert_bitwise_equal, device, keep_compute_stream_busy, split
from ll_calls import Expected, Inputs, NoHostSync, ll_expert_output, reference_case
from rank_results import capture, guarded, launch_once

import deep_ep
from deep_ep.fp8 import pack_ue8m0, per_token_cast_back, per_token_cast_to_fp8
from deep_ep.testing.data import make_group_inputs, make_tokens
from deep_ep.testing.reference import ht_combine, ht_dispatch, ll_valid_row_mask
from deep_ep.testing.reference_experts import expert_rows, expert_rows_expanded

GPU_TIMEOUT_SECS = 60  # a protocol bug fails the run in a minute instead of hanging it
NAN = float("nan")

# Inference: E is a multiple of every rank count of the suite (1, 2, 4, 8).
HIDDEN = 1024
NUM_TOPK = 8
NUM_EXPERTS = 64
PREFILL_TOKENS = 128  # the buffer's num_max_tokens_per_rank
DECODE_TOKENS = 32  # vLLM's per-call cap: the decode batch rounded up to a power of two
CONTIGUOUS_ALIGNMENT = 128  # rows per expert padded for a contiguous grouped GEMM
MASKED_ALIGNMENT = 16
GRAPH_INPUT_SETS = 2

# Training.
TRAIN_HIDDEN = 512
TRAIN_TOPK = 4
TRAIN_EXPERTS = 32
TRAIN_TOKENS = 96

# Low-latency decode (H a multiple of 512 for UE8M0 scales).
LL_TOKENS = 64
LL_HIDDEN = 1024
LL_TOPK = 8
LL_EXPERTS = 64

PROBE_TOKENS = 16


# ------------------------------------------------------------------------------------ helpers


class Checks:
    """Mismatches of one sequence, collected instead of raised: every rank runs the whole sequence
    (an assertion on one rank would leave its peers waiting in the next collective call)."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def true(self, condition: bool, what: str) -> None:
        if not condition:
            self.failures.append(what)

    def equal(self, name: str, actual: Any, expected: Any) -> None:
        try:
            assert_bitwise_equal(name, actual, expected)
        except AssertionError as error:
            self.failures.append(str(error))


@dataclass
class Group:
    """Every rank's inputs on this rank's device (the reference model needs all of them)."""

    xs: list  # bf16 [T, H], or (fp8 [T, H], fp32 scales [T, H / 128]), per rank
    topk_idxs: list[torch.Tensor]
    weights: list[torch.Tensor]
    num_tokens: list[int]


def _group(
    num_ranks: int,
    num_tokens: int,
    hidden: int,
    num_experts: int,
    num_topk: int,
    seed: int,
    *,
    use_fp8: bool,
    uneven: bool = True,
) -> Group:
    data = make_group_inputs(
        num_ranks, num_tokens, hidden, num_experts, num_topk, seed=seed, use_fp8=use_fp8, uneven=uneven
    )
    dev = device()
    xs = [(x[0].to(dev), x[1].to(dev)) if isinstance(x, tuple) else x.to(dev) for x in data.dispatch_xs]
    return Group(xs, [t.to(dev) for t in data.topk_idx], [w.to(dev) for w in data.topk_weights], data.num_tokens)


def _activations(num_tokens: list[int], hidden: int, seed: int, use_fp8: bool) -> list:
    """New activations for every rank (the next layer's input, a gradient), same token counts."""
    generator = torch.Generator().manual_seed(seed)
    xs = [make_tokens(count, hidden, generator).to(device()) for count in num_tokens]
    return [per_token_cast_to_fp8(x) for x in xs] if use_fp8 else xs


def _biases(num_tokens: list[int], hidden: int, seed: int, count: int) -> list:
    """One bias (a tensor) or two (a tuple) per rank, as combine's ``bias`` takes them."""
    generator = torch.Generator().manual_seed(seed)
    biases = []
    for tokens in num_tokens:
        terms = [make_tokens(tokens, hidden, generator).to(device()) for _ in range(count)]
        biases.append(terms[0] if count == 1 else tuple(terms))
    return biases


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _bf16_rows(x: Any) -> torch.Tensor:
    """bf16 rows of a dispatch input or output (fp8 dequantised; scales of any strides)."""
    data, scales = split(x)
    return data if scales is None else per_token_cast_back(data, scales)


def _reference_rows(received: dict) -> Any:
    return received["x"] if received["x_scales"] is None else (received["x"], received["x_scales"])


def _reference_expert_outputs(reference: list[dict], num_local: int, do_expand: bool) -> list[torch.Tensor]:
    """What each rank's expert returns for the rows the reference says it received: the same
    elementwise functions the sequences apply to the kernels' rows, so a bitwise-correct dispatch
    gives bitwise-identical combine inputs."""
    ys = []
    for dest, received in enumerate(reference):
        rows = _bf16_rows(_reference_rows(received))
        if do_expand:
            ys.append(expert_rows_expanded(rows, received["local_expert"], received["topk_weights"], dest, num_local))
        else:
            ys.append(expert_rows(rows, received["topk_idx"], received["topk_weights"], dest, num_local))
    return ys


def _expert_of_rows(handle: deep_ep.EPHandle, num_rows: int) -> torch.Tensor:
    """int64 [num_rows]: the local expert owning each expanded row, read from V2's handle fields as
    a masked grouped GEMM does (expert l owns rows ``[psum[l] - unaligned[l], psum[l])``); -1 for
    alignment padding and rows past the last expert. Device-side only (graph capturable)."""
    ends = handle.psum_num_recv_tokens_per_expert.to(torch.int64)
    starts = ends - handle.num_unaligned_recv_tokens_per_expert.to(torch.int64)
    rows = torch.arange(num_rows, device=ends.device)
    inside = (rows.unsqueeze(0) >= starts.unsqueeze(1)) & (rows.unsqueeze(0) < ends.unsqueeze(1))  # [L, rows]
    experts = torch.arange(ends.shape[0], device=ends.device).unsqueeze(1)
    return torch.where(inside.any(dim=0), (inside.to(torch.int64) * experts).sum(dim=0), -1)


def _worst_rows(num_ranks: int, num_tokens: int, num_topk: int, num_local: int, alignment: int) -> tuple[int, int]:
    """(rows, expanded rows) V2 allocates without CPU sync."""
    rows = num_ranks * num_tokens
    return rows, _align(rows * min(num_topk, num_local) + (alignment - 1) * num_local, alignment)


def _on_comm_stream(buffer: deep_ep.ElasticBuffer) -> dict:
    """Megatron's stream arguments: the comm stream waits for what the caller queued so far, outputs
    are allocated there, and the caller waits on the returned event."""
    return {"previous_event": buffer.capture(), "async_with_compute_stream": True, "allocate_on_comm_stream": True}


def _check_event(checks: Checks, step: str, event: Any, asynchronous: bool) -> None:
    checks.true(isinstance(event, deep_ep.EventOverlap), f"{step}: event is {type(event).__name__}")
    if isinstance(event, deep_ep.EventOverlap):
        checks.true((event.event is not None) == asynchronous, f"{step}: event.event with async={asynchronous}")


def _check_rows(
    checks: Checks,
    step: str,
    outputs: tuple,
    expected: dict,
    *,
    do_expand: bool,
    col_major: bool = False,
    num_rows: int | None = None,
) -> None:
    """Dispatch outputs against the reference: every row after a CPU sync; without one
    (``num_rows``: the worst-case row count allocated) the reference's rows, alignment padding
    included, at the front."""
    recv_x, recv_topk_idx, recv_topk_weights, _, _ = outputs
    data, scales = split(recv_x)
    rows = expected["x"].shape[0]
    allocated = rows if num_rows is None else num_rows
    checks.true(data.shape[0] == allocated, f"{step}: recv_x has {data.shape[0]} rows, expected {allocated}")
    checks.equal(f"{step}: recv_x", data[:rows], expected["x"])
    if expected["x_scales"] is None:
        checks.true(scales is None, f"{step}: bf16 dispatch returned scales")
    elif scales is not None:
        if col_major:
            if allocated > 0:
                want = (1, _align(allocated, 4))
                checks.true(scales.stride() == want, f"{step}: scales strides {scales.stride()}, expected {want}")
        else:
            checks.true(scales.is_contiguous(), f"{step}: scales strides {scales.stride()}, expected row-major")
        checks.equal(f"{step}: recv_x scales", scales[:rows], expected["x_scales"])
    else:
        checks.true(False, f"{step}: fp8 dispatch returned no scales")
    if do_expand:
        checks.true(recv_topk_idx is None, f"{step}: expand dispatch returned recv_topk_idx")
    else:
        checks.equal(
            f"{step}: recv_topk_idx", None if recv_topk_idx is None else recv_topk_idx[:rows], expected["topk_idx"]
        )
    weights = None if recv_topk_weights is None else recv_topk_weights[:rows]
    checks.equal(f"{step}: recv_topk_weights", weights, expected["topk_weights"])


def _check_handle(
    checks: Checks,
    step: str,
    handle: Any,
    expected: dict,
    *,
    do_expand: bool,
    worst_rows: tuple[int, int] | None = None,
) -> None:
    """V2's EPHandle counts (device prefix sums always exact; host sizes exact after a CPU sync,
    else ``worst_rows``)."""
    per_source = expected["num_recv_tokens_per_rank"]
    unaligned = expected["num_recv_tokens_per_expert"]
    aligned = expected["num_recv_tokens_per_expert_aligned"]
    ends = torch.tensor(aligned).cumsum(0)
    psum_expert = (ends - torch.tensor(aligned) + torch.tensor(unaligned)) if do_expand else ends
    wanted = {
        "psum_num_recv_tokens_per_scaleup_rank": torch.tensor(per_source).cumsum(0).tolist(),
        "num_unaligned_recv_tokens_per_expert": unaligned,
        "psum_num_recv_tokens_per_expert": psum_expert.tolist(),
    }
    for name, want in wanted.items():
        got = getattr(handle, name).tolist()
        checks.true(got == want, f"{step}: handle.{name} {got}, expected {want}")
    if worst_rows is None:
        sizes = {"num_recv_tokens": sum(per_source), "num_recv_tokens_per_expert_list": aligned}
        if do_expand:
            sizes["num_expanded_tokens"] = sum(aligned)
    else:
        sizes = {"num_recv_tokens": worst_rows[0], "num_recv_tokens_per_expert_list": []}
        if do_expand:
            sizes["num_expanded_tokens"] = worst_rows[1]
    for name, want in sizes.items():
        got = getattr(handle, name)
        checks.true(got == want, f"{step}: handle.{name} {got}, expected {want}")
    checks.true(handle.do_expand == do_expand, f"{step}: handle.do_expand {handle.do_expand}")


def _check_combined(checks: Checks, step: str, combined: Any, combined_weights: Any, want: dict) -> None:
    checks.equal(f"{step}: combined_x", combined, want["x"])
    checks.equal(f"{step}: combined_topk_weights", combined_weights, want["topk_weights"])


# ---------------------------------------------------------------------------------- inference


def _inference_buffer(group: Any) -> deep_ep.ElasticBuffer:
    """As SGLang's and vLLM's V2 backends build it: from the MoE shape, with fp8 sizing."""
    return deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=PREFILL_TOKENS,
        hidden=HIDDEN,
        num_topk=NUM_TOPK,
        use_fp8_dispatch=True,
        deterministic=False,
        allow_hybrid_mode=True,
        allow_multiple_reduction=True,
        prefer_overlap_with_compute=True,
        sl_idx=3,
        num_allocated_qps=0,
        num_cpu_timeout_secs=300,
        num_gpu_timeout_secs=GPU_TIMEOUT_SECS,
        explicitly_destroy=True,
    )


def _inference_attributes(buffer: deep_ep.ElasticBuffer, group: Any, rank: int, num_ranks: int) -> list[str]:
    """What the clients read back: ranks, the token cap, the domains (one host: direct mode) and
    ``num_bytes``, which Megatron compares with ``get_buffer_size_hint`` to decide on reuse."""
    checks = Checks()
    seen = (buffer.rank_idx, buffer.num_ranks, buffer.num_max_tokens_per_rank)
    checks.true(seen == (rank, num_ranks, PREFILL_TOKENS), f"(rank_idx, num_ranks, num_max_tokens_per_rank) {seen}")
    domains = buffer.get_logical_domain_size()
    checks.true(domains == (1, num_ranks), f"get_logical_domain_size() {domains}, expected (1, {num_ranks})")
    indices = (buffer.scaleout_rank_idx, buffer.scaleup_rank_idx)
    checks.true(indices == (0, rank), f"(scaleout_rank_idx, scaleup_rank_idx) {indices}")
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(group, PREFILL_TOKENS, HIDDEN, NUM_TOPK, use_fp8_dispatch=True)
    checks.true(buffer.num_bytes == hint, f"num_bytes {buffer.num_bytes} != get_buffer_size_hint {hint}")
    return checks.failures


def _prefill_rows(buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int) -> list[str]:
    """fp8 prefill as rows (contiguous grouped-GEMM layout), then a cached re-dispatch of the next
    activations and a combine with a bias."""
    checks = Checks()
    num_local = NUM_EXPERTS // num_ranks
    group = _group(num_ranks, PREFILL_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, 201, use_fp8=True)
    reference = ht_dispatch(
        group.xs, group.topk_idxs, group.weights, NUM_EXPERTS, expert_alignment=CONTIGUOUS_ALIGNMENT
    )
    num_sms = buffer.get_theoretical_num_sms(NUM_EXPERTS, NUM_TOPK)
    outputs = buffer.dispatch(
        group.xs[rank],
        topk_idx=group.topk_idxs[rank],
        topk_weights=group.weights[rank],
        num_experts=NUM_EXPERTS,
        expert_alignment=CONTIGUOUS_ALIGNMENT,
        num_sms=num_sms,
        num_qps=buffer.get_theoretical_num_qps(num_sms),
    )
    _check_event(checks, "dispatch", outputs[4], False)
    _check_rows(checks, "dispatch", outputs, reference[rank], do_expand=False)
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = outputs
    _check_handle(checks, "dispatch", handle, reference[rank], do_expand=False)
    checks.true(handle.num_sms == num_sms, f"handle.num_sms {handle.num_sms}, expected {num_sms}")

    # Weighted experts, then combine with the handle's SM count.
    y = expert_rows(_bf16_rows(recv_x), recv_topk_idx, recv_topk_weights, rank, num_local)
    combined, combined_weights, event = buffer.combine(y, handle)
    _check_event(checks, "combine", event, False)
    ys = _reference_expert_outputs(reference, num_local, do_expand=False)
    want = ht_combine(reference, ys, group.topk_idxs, NUM_EXPERTS)[rank]
    _check_combined(checks, "combine", combined, combined_weights, want)

    # The next activations with the same routing: a cached re-dispatch with the weights, queued
    # behind capture() while the caller's stream keeps working.
    xs = _activations(group.num_tokens, HIDDEN, 202, use_fp8=True)
    expected = ht_dispatch(xs, group.topk_idxs, group.weights, NUM_EXPERTS, expert_alignment=CONTIGUOUS_ALIGNMENT)
    cached = buffer.dispatch(xs[rank], topk_weights=group.weights[rank], handle=handle, **_on_comm_stream(buffer))
    keep_compute_stream_busy()
    _check_event(checks, "cached dispatch", cached[4], True)
    cached[4].current_stream_wait()
    _check_rows(checks, "cached dispatch", cached, expected[rank], do_expand=False)
    checks.true(cached[3] is handle, "cached dispatch returns another handle than the one it was given")

    biases = _biases(group.num_tokens, HIDDEN, 203, count=1)
    y = expert_rows(_bf16_rows(cached[0]), cached[1], cached[2], rank, num_local)
    combined, combined_weights, event = buffer.combine(
        y, handle, bias=biases[rank], previous_event=buffer.capture(), async_with_compute_stream=True
    )
    _check_event(checks, "combine with bias", event, True)
    event.current_stream_wait()
    ys = _reference_expert_outputs(expected, num_local, do_expand=False)
    want = ht_combine(expected, ys, group.topk_idxs, NUM_EXPERTS, biases=biases)[rank]
    _check_combined(checks, "combine with bias", combined, combined_weights, want)
    return checks.failures


def _prefill_expanded(buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int) -> list[str]:
    """fp8 prefill expanded (one row per (token, local expert), grouped by expert), TMA-aligned
    column-major scales, a typed EventHandle as previous_event; combine with weights and two
    biases; a cached expanded re-dispatch with weights."""
    checks = Checks()
    num_local = NUM_EXPERTS // num_ranks
    group = _group(num_ranks, PREFILL_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, 211, use_fp8=True)
    expand = {"expert_alignment": CONTIGUOUS_ALIGNMENT, "do_expand": True}
    reference = ht_dispatch(group.xs, group.topk_idxs, group.weights, NUM_EXPERTS, **expand)
    outputs = buffer.dispatch(
        group.xs[rank],
        topk_idx=group.topk_idxs[rank],
        topk_weights=group.weights[rank],
        num_experts=NUM_EXPERTS,
        use_tma_aligned_col_major_sf=True,
        previous_event=deep_ep.EventHandle(),
        async_with_compute_stream=True,
        allocate_on_comm_stream=True,
        **expand,
    )
    keep_compute_stream_busy()
    _check_event(checks, "dispatch", outputs[4], True)
    outputs[4].current_stream_wait()
    _check_rows(checks, "dispatch", outputs, reference[rank], do_expand=True, col_major=True)
    recv_x, _, recv_topk_weights, handle, _ = outputs
    _check_handle(checks, "dispatch", handle, reference[rank], do_expand=True)
    row_local = _expert_of_rows(handle, handle.num_expanded_tokens)
    checks.equal("local expert of each row (from the handle's prefix sums)", row_local, reference[rank]["local_expert"])

    y = expert_rows_expanded(_bf16_rows(recv_x), row_local, recv_topk_weights, rank, num_local)
    biases = _biases(group.num_tokens, HIDDEN, 212, count=2)
    combined, combined_weights, event = buffer.combine(
        y, handle, topk_weights=recv_topk_weights, bias=biases[rank], **_on_comm_stream(buffer)
    )
    _check_event(checks, "combine", event, True)
    event.current_stream_wait()
    ys = _reference_expert_outputs(reference, num_local, do_expand=True)
    weights_list = [r["topk_weights"] for r in reference]
    want = ht_combine(
        reference, ys, group.topk_idxs, NUM_EXPERTS, weights_list=weights_list, biases=biases, do_expand=True
    )[rank]
    _check_combined(checks, "combine", combined, combined_weights, want)

    xs = _activations(group.num_tokens, HIDDEN, 213, use_fp8=True)
    expected = ht_dispatch(xs, group.topk_idxs, group.weights, NUM_EXPERTS, **expand)
    cached = buffer.dispatch(
        xs[rank],
        topk_weights=group.weights[rank],
        handle=handle,
        use_tma_aligned_col_major_sf=True,
        do_zero_padding=True,
    )
    _check_rows(checks, "cached expanded dispatch", cached, expected[rank], do_expand=True, col_major=True)
    return checks.failures


def _decode_rows(buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int) -> list[str]:
    """vLLM-style decode: rows without CPU sync, the per-call cap a power of two below the buffer's,
    receive stats accumulated; experts run on the valid prefix only (``psum[-1]`` rows, on the
    device), the rest is NaN in what combine gets."""
    checks = Checks()
    num_local = NUM_EXPERTS // num_ranks
    group = _group(num_ranks, DECODE_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, 221, use_fp8=True)
    reference = ht_dispatch(group.xs, group.topk_idxs, group.weights, NUM_EXPERTS)
    stats_base = 5  # the kernels must add to the stats, not overwrite them
    stats = torch.full((num_local,), stats_base, dtype=torch.int32, device=device())
    outputs = buffer.dispatch(
        group.xs[rank],
        topk_idx=group.topk_idxs[rank],
        topk_weights=group.weights[rank],
        num_experts=NUM_EXPERTS,
        num_max_tokens_per_rank=DECODE_TOKENS,
        do_cpu_sync=False,
        cumulative_local_expert_recv_stats=stats,
    )
    worst = _worst_rows(num_ranks, DECODE_TOKENS, NUM_TOPK, num_local, 1)
    _check_rows(checks, "dispatch", outputs, reference[rank], do_expand=False, num_rows=worst[0])
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = outputs
    _check_handle(checks, "dispatch", handle, reference[rank], do_expand=False, worst_rows=worst)
    want_stats = [stats_base + count for count in reference[rank]["num_recv_tokens_per_expert"]]
    checks.true(stats.tolist() == want_stats, f"cumulative_local_expert_recv_stats {stats.tolist()} != {want_stats}")

    rows = torch.arange(split(recv_x)[0].shape[0], device=device())
    invalid = (rows >= handle.psum_num_recv_tokens_per_scaleup_rank[-1]).unsqueeze(1)
    y = expert_rows(_bf16_rows(recv_x), recv_topk_idx, recv_topk_weights, rank, num_local).masked_fill(invalid, NAN)
    combined, combined_weights, _ = buffer.combine(y, handle, topk_weights=recv_topk_weights.masked_fill(invalid, NAN))
    ys = _reference_expert_outputs(reference, num_local, do_expand=False)
    weights_list = [r["topk_weights"] for r in reference]
    want = ht_combine(reference, ys, group.topk_idxs, NUM_EXPERTS, weights_list=weights_list)[rank]
    _check_combined(checks, "combine", combined, combined_weights, want)
    return checks.failures


def _masked_decode_step(
    buffer: deep_ep.ElasticBuffer, x: Any, topk_idx: torch.Tensor, topk_weights: torch.Tensor, rank: int
) -> tuple:
    """SGLang-style decode: expanded rows without CPU sync (static shapes), column-major scales, a
    masked grouped expert over each local expert's rows, combine. Rows outside every expert's rows
    are NaN in what combine gets. Returns (dispatch outputs, expert of each row, combined x,
    combined weights)."""
    num_local = NUM_EXPERTS // buffer.num_ranks
    outputs = buffer.dispatch(
        x,
        topk_idx=topk_idx,
        topk_weights=topk_weights,
        num_experts=NUM_EXPERTS,
        num_max_tokens_per_rank=DECODE_TOKENS,
        expert_alignment=MASKED_ALIGNMENT,
        do_expand=True,
        do_cpu_sync=False,
        use_tma_aligned_col_major_sf=True,
    )
    recv_x, _, recv_topk_weights, handle, _ = outputs
    row_local = _expert_of_rows(handle, handle.num_expanded_tokens)
    invalid = row_local < 0
    y = expert_rows_expanded(_bf16_rows(recv_x), row_local, recv_topk_weights, rank, num_local)
    combined, combined_weights, _ = buffer.combine(
        y.masked_fill(invalid.unsqueeze(1), NAN), handle, topk_weights=recv_topk_weights.masked_fill(invalid, NAN)
    )
    return outputs, row_local, combined, combined_weights


def _masked_decode_expected(group: Group, rank: int, num_ranks: int) -> tuple[dict, dict]:
    num_local = NUM_EXPERTS // num_ranks
    reference = ht_dispatch(
        group.xs, group.topk_idxs, group.weights, NUM_EXPERTS, expert_alignment=MASKED_ALIGNMENT, do_expand=True
    )
    ys = _reference_expert_outputs(reference, num_local, do_expand=True)
    weights_list = [r["topk_weights"] for r in reference]
    want = ht_combine(reference, ys, group.topk_idxs, NUM_EXPERTS, weights_list=weights_list, do_expand=True)[rank]
    return reference[rank], want


def _check_masked_decode(checks: Checks, step: str, result: tuple, expected: dict, want: dict, num_ranks: int) -> None:
    outputs, row_local, combined, combined_weights = result
    worst = _worst_rows(num_ranks, DECODE_TOKENS, NUM_TOPK, NUM_EXPERTS // num_ranks, MASKED_ALIGNMENT)
    _check_rows(checks, step, outputs, expected, do_expand=True, col_major=True, num_rows=worst[1])
    _check_handle(checks, step, outputs[3], expected, do_expand=True, worst_rows=worst)
    rows = expected["x"].shape[0]
    checks.equal(f"{step}: local expert of each row", row_local[:rows], expected["local_expert"])
    checks.true(bool((row_local[rows:] == -1).all()), f"{step}: rows past the last expert are assigned to one")
    _check_combined(checks, step, combined, combined_weights, want)


def _without_handle_copy(buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int) -> list[str]:
    """``do_handle_copy=False``, as V2's test checks it: the handle's ``topk_idx`` is the caller's
    tensor (same storage), also after a cached re-dispatch, and with the default it is not. Each
    call runs once on the C++ host path (everyday arguments) and once on the Python path
    (``allocate_on_comm_stream=True``). Then the caller overwrites its routing tensor: combine and a
    cached re-dispatch through the handle still match the reference of the routing dispatched (the
    kernels read the handle's own sanitised copy)."""
    checks = Checks()
    num_local = NUM_EXPERTS // num_ranks
    group = _group(num_ranks, PREFILL_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, 261, use_fp8=True)
    reference = ht_dispatch(group.xs, group.topk_idxs, group.weights, NUM_EXPERTS)
    ys = _reference_expert_outputs(reference, num_local, do_expand=False)
    want = ht_combine(reference, ys, group.topk_idxs, NUM_EXPERTS)[rank]
    xs = _activations(group.num_tokens, HIDDEN, 262, use_fp8=True)
    expected = ht_dispatch(xs, group.topk_idxs, group.weights, NUM_EXPERTS)
    for path, options in (("host path", {}), ("Python path", {"allocate_on_comm_stream": True})):
        step = f"do_handle_copy=False ({path})"
        topk_idx = group.topk_idxs[rank].clone()
        outputs = buffer.dispatch(
            group.xs[rank],
            topk_idx=topk_idx,
            topk_weights=group.weights[rank],
            num_experts=NUM_EXPERTS,
            do_handle_copy=False,
            **options,
        )
        _check_rows(checks, step, outputs, reference[rank], do_expand=False)
        recv_x, recv_topk_idx, recv_topk_weights, handle, _ = outputs
        _check_handle(checks, step, handle, reference[rank], do_expand=False)
        checks.true(handle.topk_idx is topk_idx, f"{step}: handle.topk_idx is not the caller's tensor")
        checks.true(handle.topk_idx.data_ptr() == topk_idx.data_ptr(), f"{step}: handle.topk_idx has other storage")

        # The caller reuses its routing tensor: nothing the handle drives may change.
        topk_idx.copy_(topk_idx.flip(1).roll(1, dims=0))
        y = expert_rows(_bf16_rows(recv_x), recv_topk_idx, recv_topk_weights, rank, num_local)
        combined, combined_weights, _ = buffer.combine(y, handle, **options)
        _check_combined(checks, f"{step} combine", combined, combined_weights, want)
        cached = buffer.dispatch(xs[rank], topk_weights=group.weights[rank], handle=handle, **options)
        _check_rows(checks, f"{step} cached dispatch", cached, expected[rank], do_expand=False)
        checks.true(cached[3] is handle, f"{step}: cached dispatch returns another handle")
        checks.true(
            cached[3].topk_idx.data_ptr() == topk_idx.data_ptr(), f"{step}: cached handle.topk_idx has other storage"
        )

        copied = buffer.dispatch(
            group.xs[rank], topk_idx=group.topk_idxs[rank], topk_weights=group.weights[rank], num_experts=NUM_EXPERTS
        )[3]
        caller = group.topk_idxs[rank]
        # (A rank without tokens has empty tensors, whose data_ptr is 0 for every tensor.)
        checks.true(
            copied.topk_idx is not caller and (caller.numel() == 0 or copied.topk_idx.data_ptr() != caller.data_ptr()),
            f"{path}: with do_handle_copy=True (default) handle.topk_idx shares the caller's storage",
        )
    return checks.failures


def _decode_expanded(buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int) -> list[str]:
    checks = Checks()
    group = _group(num_ranks, DECODE_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, 231, use_fp8=True)
    result = _masked_decode_step(buffer, group.xs[rank], group.topk_idxs[rank], group.weights[rank], rank)
    expected, want = _masked_decode_expected(group, rank, num_ranks)
    _check_masked_decode(checks, "masked decode", result, expected, want, num_ranks)
    return checks.failures


def _inference(rank: int, num_ranks: int, group: Any) -> dict:
    results: dict[str, Any] = {}
    buffer = _inference_buffer(group)
    try:
        results["attributes"] = _inference_attributes(buffer, group, rank, num_ranks)
        for name, sequence in (
            ("prefill_rows", _prefill_rows),
            ("prefill_expanded", _prefill_expanded),
            ("decode_rows", _decode_rows),
            ("decode_expanded", _decode_expanded),
            ("without_handle_copy", _without_handle_copy),
        ):
            guarded(results, name, lambda sequence=sequence: sequence(buffer, rank, num_ranks))
        results["errors_after"] = capture(buffer.check_errors)
    finally:
        buffer.destroy()
    return results


def _decode_graph(rank: int, num_ranks: int, group: Any) -> list[str]:
    """The masked decode step captured once in a CUDA graph (after an eager warm-up on a side
    stream, the usual recipe) and replayed with new tokens, routing and weights."""
    checks = Checks()
    buffer = _inference_buffer(group)
    try:
        sets = [
            _group(num_ranks, DECODE_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, 240 + i, use_fp8=True, uneven=False)
            for i in range(GRAPH_INPUT_SETS)
        ]
        wanted = [_masked_decode_expected(inputs, rank, num_ranks) for inputs in sets]
        data, scales = sets[0].xs[rank]
        static_x = (data.clone(), scales.clone())
        static_idx = sets[0].topk_idxs[rank].clone()
        static_weights = sets[0].weights[rank].clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _masked_decode_step(buffer, static_x, static_idx, static_weights, rank)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = _masked_decode_step(buffer, static_x, static_idx, static_weights, rank)
        for replay in range(2 * GRAPH_INPUT_SETS):
            inputs = sets[(replay + 1) % GRAPH_INPUT_SETS]  # the first replay already has new inputs
            static_x[0].copy_(inputs.xs[rank][0])
            static_x[1].copy_(inputs.xs[rank][1])
            static_idx.copy_(inputs.topk_idxs[rank])
            static_weights.copy_(inputs.weights[rank])
            graph.replay()
            expected, want = wanted[(replay + 1) % GRAPH_INPUT_SETS]
            _check_masked_decode(checks, f"graph replay {replay}", result, expected, want, num_ranks)
        del graph
        kind, message = capture(buffer.check_errors)
        checks.true(kind is None, f"check_errors() after the replays: {kind}: {message}")
    finally:
        buffer.destroy()
    return checks.failures


# ----------------------------------------------------------------------------------- training


@dataclass(frozen=True)
class MicroBatch:
    seed: int
    expert_alignment: int
    combine_weights: bool  # combine forward carries the routing weights (their gradient flows back)


MICRO_BATCHES = (MicroBatch(301, 8, True), MicroBatch(302, 1, False))


def _training_forward(buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int, batch: MicroBatch, checks: Checks):
    """Dispatch, weighted experts, combine; each call behind capture() with its outputs on the
    communication stream. Returns what backward needs."""
    step = f"micro-batch {batch.seed} forward"
    num_local = TRAIN_EXPERTS // num_ranks
    group = _group(num_ranks, TRAIN_TOKENS, TRAIN_HIDDEN, TRAIN_EXPERTS, TRAIN_TOPK, batch.seed, use_fp8=False)
    reference = ht_dispatch(
        group.xs, group.topk_idxs, group.weights, TRAIN_EXPERTS, expert_alignment=batch.expert_alignment
    )
    outputs = buffer.dispatch(
        group.xs[rank],
        topk_idx=group.topk_idxs[rank],
        topk_weights=group.weights[rank],
        num_experts=TRAIN_EXPERTS,
        expert_alignment=batch.expert_alignment,
        num_sms=buffer.get_theoretical_num_sms(TRAIN_EXPERTS, TRAIN_TOPK),
        **_on_comm_stream(buffer),
    )
    _check_event(checks, f"{step} dispatch", outputs[4], True)
    outputs[4].current_stream_wait()
    _check_rows(checks, f"{step} dispatch", outputs, reference[rank], do_expand=False)
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = outputs
    _check_handle(checks, f"{step} dispatch", handle, reference[rank], do_expand=False)

    y = expert_rows(recv_x, recv_topk_idx, recv_topk_weights, rank, num_local)
    weights = recv_topk_weights if batch.combine_weights else None
    combined, combined_weights, event = buffer.combine(y, handle, topk_weights=weights, **_on_comm_stream(buffer))
    event.current_stream_wait()
    ys = _reference_expert_outputs(reference, num_local, do_expand=False)
    weights_list = [r["topk_weights"] for r in reference] if batch.combine_weights else None
    want = ht_combine(reference, ys, group.topk_idxs, TRAIN_EXPERTS, weights_list=weights_list)[rank]
    _check_combined(checks, f"{step} combine", combined, combined_weights, want)
    return group, reference, outputs


def _weight_gradient_stand_in(grad_rows: torch.Tensor, local_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K]: a stand-in for the expert's gradient of the received routing weights, non-zero
    on local slots only as the real one. The real one is a reduction over H whose order may depend
    on the row count; this one is elementwise, so the kernels' rows and the reference's agree bit
    for bit."""
    num_topk = local_idx.shape[1]
    return torch.where(local_idx >= 0, weights * grad_rows[:, :num_topk].float(), 0.0)


def _training_backward(
    buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int, batch: MicroBatch, forward: tuple, checks: Checks
) -> None:
    """Combine's backward (a cached dispatch of the output gradient, with the combined weights'
    gradient when combine had weights), the experts' backward, dispatch's backward (a combine of the
    row gradients, with the routing weights' gradient) with the forward handle."""
    step = f"micro-batch {batch.seed} backward"
    num_local = TRAIN_EXPERTS // num_ranks
    group, reference, (_, recv_topk_idx, recv_topk_weights, handle, _) = forward
    grads = _activations(group.num_tokens, TRAIN_HIDDEN, batch.seed + 50, use_fp8=False)
    generator = torch.Generator().manual_seed(batch.seed + 60)
    grad_weights = None
    if batch.combine_weights:
        grad_weights = [torch.randn(count, TRAIN_TOPK, generator=generator).to(device()) for count in group.num_tokens]
    expected = ht_dispatch(grads, group.topk_idxs, grad_weights, TRAIN_EXPERTS, expert_alignment=batch.expert_alignment)
    grad_rows = buffer.dispatch(
        grads[rank],
        topk_weights=None if grad_weights is None else grad_weights[rank],
        handle=handle,
        **_on_comm_stream(buffer),
    )
    grad_rows[4].current_stream_wait()
    _check_rows(checks, f"{step} cached dispatch of the output gradient", grad_rows, expected[rank], do_expand=False)

    # The expert scales each row by sum_k w_k (1 + e_k / 16): a diagonal linear map, so its input
    # gradient is the same map of the output gradient.
    grad_recv_x = expert_rows(grad_rows[0], recv_topk_idx, recv_topk_weights, rank, num_local)
    grad_recv_weights = _weight_gradient_stand_in(grad_rows[0], recv_topk_idx, recv_topk_weights)
    grad_x, grad_topk_weights, event = buffer.combine(
        grad_recv_x, handle, topk_weights=grad_recv_weights, **_on_comm_stream(buffer)
    )
    event.current_stream_wait()
    grad_ys = [
        expert_rows(e["x"], r["topk_idx"], r["topk_weights"], dest, num_local)
        for dest, (e, r) in enumerate(zip(expected, reference, strict=True))
    ]
    grad_weights_list = [
        _weight_gradient_stand_in(e["x"], r["topk_idx"], r["topk_weights"])
        for e, r in zip(expected, reference, strict=True)
    ]
    want = ht_combine(reference, grad_ys, group.topk_idxs, TRAIN_EXPERTS, weights_list=grad_weights_list)[rank]
    _check_combined(checks, f"{step} combine of the row gradients", grad_x, grad_topk_weights, want)


def _training(rank: int, num_ranks: int, group: Any) -> list[str]:
    """Two micro-batches forward, then backward in reverse order: each handle is used again after
    the other micro-batch's operations ran on the same buffer."""
    checks = Checks()
    num_bytes = deep_ep.ElasticBuffer.get_buffer_size_hint(group, TRAIN_TOKENS, TRAIN_HIDDEN, TRAIN_TOPK)
    buffer = deep_ep.ElasticBuffer(
        group,
        num_bytes=num_bytes,
        num_max_tokens_per_rank=TRAIN_TOKENS,
        hidden=TRAIN_HIDDEN,
        num_topk=TRAIN_TOPK,
        num_gpu_timeout_secs=GPU_TIMEOUT_SECS,
        explicitly_destroy=True,
    )
    try:
        checks.true(buffer.num_bytes == num_bytes, f"num_bytes {buffer.num_bytes} != the hint it was given {num_bytes}")
        forwards = [_training_forward(buffer, rank, num_ranks, batch, checks) for batch in MICRO_BATCHES]
        for batch, forward in reversed(list(zip(MICRO_BATCHES, forwards, strict=True))):
            _training_backward(buffer, rank, num_ranks, batch, forward, checks)
        kind, message = capture(buffer.check_errors)
        checks.true(kind is None, f"check_errors() after backward: {kind}: {message}")
    finally:
        buffer.destroy()
    return checks.failures


# ------------------------------------------------------------------------- low-latency decode


@dataclass(frozen=True)
class LLFormat:
    use_fp8: bool
    round_scale: bool = False
    use_ue8m0: bool = False

    def options(self) -> dict:
        """Scale options of low_latency_dispatch: fp8 scales column-major, as the masked GEMM reads them."""
        return {
            "use_fp8": self.use_fp8,
            "round_scale": self.round_scale,
            "use_ue8m0": self.use_ue8m0,
            "use_tma_aligned_col_major_sf": self.use_fp8,
        }


FP8 = LLFormat(True)
UE8M0 = LLFormat(True, round_scale=True, use_ue8m0=True)
BF16 = LLFormat(False)


def _ll_case(rank: int, num_ranks: int, seed: int, fmt: LLFormat) -> tuple[Inputs, Expected]:
    data = make_group_inputs(num_ranks, LL_TOKENS, LL_HIDDEN, LL_EXPERTS, LL_TOPK, seed=seed)
    return reference_case(rank, data, LL_EXPERTS, LL_TOKENS, use_fp8=fmt.use_fp8, round_scale=fmt.round_scale)


def _masked_ll_expert(recv_x: Any, recv_count: torch.Tensor, use_fp8: bool) -> torch.Tensor:
    """The masked grouped expert of decode: local expert l computes rows [0, recv_count[l]) only
    (``recv_count`` read on the device); the other rows are NaN."""
    y = ll_expert_output(recv_x, use_fp8)
    rows = torch.arange(y.shape[1], device=y.device)
    outside = rows.unsqueeze(0) >= recv_count.unsqueeze(1)
    return y.masked_fill(outside.unsqueeze(-1), NAN)


def _check_ll_dispatch(
    checks: Checks, step: str, fmt: LLFormat, recv_x: Any, recv_count: torch.Tensor, expected: Expected
) -> None:
    mine = expected.dispatch
    valid = ll_valid_row_mask(mine)  # rows [0, count) of each local expert
    num_local, num_slots = valid.shape
    checks.equal(f"{step}: recv_count", recv_count, mine["count"])
    if not fmt.use_fp8:
        checks.equal(f"{step}: recv_x (valid rows)", recv_x[valid], mine["x"][valid])
        return
    data, scales = recv_x
    checks.equal(f"{step}: recv_x fp8 (valid rows)", data[valid], mine["x"][valid])
    groups = LL_HIDDEN // 128
    width = groups // 4 if fmt.use_ue8m0 else groups
    layout = (tuple(scales.shape), scales.stride())
    want = ((num_local, num_slots, width), (width * num_slots, 1, num_slots))
    checks.true(layout == want, f"{step}: scales (shape, strides) {layout}, expected column-major {want}")
    want_scales = pack_ue8m0(mine["x_scales"][valid]) if fmt.use_ue8m0 else mine["x_scales"][valid]
    checks.equal(f"{step}: scales (valid rows)", scales[valid], want_scales)


def _ll_micro_batches(
    buffer: deep_ep.ElasticBuffer,
    checks: Checks,
    step: str,
    batches: list[tuple[Inputs, Expected, LLFormat]],
    stats: torch.Tensor,
    mode: str = "hook",
) -> None:
    """One decode step over ``batches`` (two: two-batch overlap): every dispatch is sent before any
    receives (two hooks pending at most), then the masked experts, then every combine. ``mode``:
    "hook" (return_recv_hook), "async" (async_finish) or "direct". No host synchronisation."""
    hooked, asynchronous = mode == "hook", mode == "async"
    with NoHostSync():
        dispatched = []
        for inputs, _, fmt in batches:
            recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
                inputs.x,
                inputs.topk_idx,
                LL_TOKENS,
                LL_EXPERTS,
                cumulative_local_expert_recv_stats=stats,
                async_finish=asynchronous,
                return_recv_hook=hooked,
                **fmt.options(),
            )
            if event is not None:
                event.current_stream_wait()
            dispatched.append((recv_x, recv_count, handle, hook))
        for *_, hook in dispatched:
            if hook is not None:
                hook()
        combined = []
        for (recv_x, recv_count, handle, _), (inputs, _, fmt) in zip(dispatched, batches, strict=True):
            y = _masked_ll_expert(recv_x, recv_count, fmt.use_fp8)
            out, event, hook = buffer.low_latency_combine(
                y,
                inputs.topk_idx,
                inputs.topk_weights,
                handle,
                async_finish=asynchronous,
                return_recv_hook=hooked,
            )
            if event is not None:
                event.current_stream_wait()
            combined.append((out, hook))
        for _, hook in combined:
            if hook is not None:
                hook()
    for index, ((recv_x, recv_count, _, _), (out, _), (_, expected, fmt)) in enumerate(
        zip(dispatched, combined, batches, strict=True)
    ):
        label = f"{step} micro-batch {index}"
        _check_ll_dispatch(checks, label, fmt, recv_x, recv_count, expected)
        checks.equal(f"{label}: combined_x", out, expected.combined)


def _prefill_phase(buffer: deep_ep.ElasticBuffer, rank: int, num_ranks: int, seed: int, checks: Checks) -> None:
    """An HT prefill round trip (bf16 rows, CPU sync) on the buffer that also decodes."""
    step = f"prefill {seed}"
    num_local = LL_EXPERTS // num_ranks
    group = _group(num_ranks, LL_TOKENS, LL_HIDDEN, LL_EXPERTS, LL_TOPK, seed, use_fp8=False)
    reference = ht_dispatch(group.xs, group.topk_idxs, group.weights, LL_EXPERTS)
    outputs = buffer.dispatch(
        group.xs[rank], topk_idx=group.topk_idxs[rank], topk_weights=group.weights[rank], num_experts=LL_EXPERTS
    )
    _check_rows(checks, step, outputs, reference[rank], do_expand=False)
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = outputs
    y = expert_rows(recv_x, recv_topk_idx, recv_topk_weights, rank, num_local)
    combined, combined_weights, _ = buffer.combine(y, handle, topk_weights=recv_topk_weights)
    ys = _reference_expert_outputs(reference, num_local, do_expand=False)
    weights_list = [r["topk_weights"] for r in reference]
    want = ht_combine(reference, ys, group.topk_idxs, LL_EXPERTS, weights_list=weights_list)[rank]
    _check_combined(checks, step, combined, combined_weights, want)


def _low_latency(rank: int, num_ranks: int, group: Any) -> list[str]:
    """Prefill, decode (hooks; two overlapped micro-batches), prefill again, decode (async, then
    without hook or event): every LL result against the reference with nothing cleaned between the
    phases; the receive stats accumulate over every decode dispatch."""
    checks = Checks()
    num_local = LL_EXPERTS // num_ranks
    buffer = deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=LL_TOKENS,
        hidden=LL_HIDDEN,
        num_topk=LL_TOPK,
        num_max_dispatch_tokens_per_rank=LL_TOKENS,
        num_experts=LL_EXPERTS,
        num_gpu_timeout_secs=GPU_TIMEOUT_SECS,
        explicitly_destroy=True,
    )
    try:
        stats = torch.zeros(num_local, dtype=torch.int32, device=device())
        counts = torch.zeros_like(stats)

        def decode(step: str, batches: list[tuple[int, LLFormat]], mode: str) -> None:
            cases = []
            for seed, fmt in batches:
                inputs, expected = _ll_case(rank, num_ranks, seed, fmt)
                cases.append((inputs, expected, fmt))
                counts.add_(expected.dispatch["count"])
            _ll_micro_batches(buffer, checks, step, cases, stats, mode)

        _prefill_phase(buffer, rank, num_ranks, 401, checks)
        decode("decode with hooks", [(411, FP8)], "hook")
        decode("decode two-batch overlap", [(412, FP8), (413, UE8M0)], "hook")
        _prefill_phase(buffer, rank, num_ranks, 402, checks)
        decode("decode async", [(414, BF16)], "async")
        decode("decode direct", [(415, FP8)], "direct")
        checks.equal("cumulative_local_expert_recv_stats (every decode dispatch)", stats, counts)
        kind, message = capture(buffer.check_errors)
        checks.true(kind is None, f"check_errors() after the phases: {kind}: {message}")
    finally:
        buffer.destroy()
    return checks.failures


# ------------------------------------------------------------------- V2 inputs refused (probes)


def _probe(buffer: deep_ep.ElasticBuffer, rank: int, x: Any, group: Group, expected: dict, want_scales: Any) -> dict:
    """Dispatch ``x`` (every rank alike); when accepted, the rows and scales against the reference."""
    checks = Checks()

    def call() -> None:
        recv_x, _, _, _, _ = buffer.dispatch(
            x, topk_idx=group.topk_idxs[rank], topk_weights=group.weights[rank], num_experts=NUM_EXPERTS
        )
        data, scales = split(recv_x)
        checks.equal("recv_x", data, expected["x"])
        checks.equal("recv_x scales", scales, want_scales)

    kind, message = capture(call)
    return {"kind": kind, "message": message, "failures": checks.failures, "errors_after": capture(buffer.check_errors)}


def _refused_v2_inputs(rank: int, num_ranks: int, group: Any) -> dict:
    """fp8 inputs V2's dispatch takes (scales of any strides; int32 packed UE8M0 scales), on every
    rank with the same token count so every rank decides alike."""
    buffer = deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=PROBE_TOKENS,
        hidden=HIDDEN,
        num_topk=NUM_TOPK,
        use_fp8_dispatch=True,
        num_gpu_timeout_secs=GPU_TIMEOUT_SECS,
        explicitly_destroy=True,
    )
    results = {}
    try:
        inputs = _group(num_ranks, PROBE_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, 501, use_fp8=True, uneven=False)
        expected = ht_dispatch(inputs.xs, inputs.topk_idxs, inputs.weights, NUM_EXPERTS)[rank]
        data, scales = inputs.xs[rank]
        # A TMA-aligned quantiser hands the scales over column-major: same values, strides (1, T).
        column_major = scales.t().contiguous().t()
        results["column_major_scales"] = _probe(
            buffer, rank, (data, column_major), inputs, expected, expected["x_scales"]
        )

        tokens = _activations(inputs.num_tokens, HIDDEN, 502, use_fp8=False)
        pow2 = [per_token_cast_to_fp8(x, round_scale=True) for x in tokens]
        expected = ht_dispatch(pow2, inputs.topk_idxs, inputs.weights, NUM_EXPERTS)[rank]
        packed = (pow2[rank][0], pack_ue8m0(pow2[rank][1]))
        results["ue8m0_scales"] = _probe(buffer, rank, packed, inputs, expected, pack_ue8m0(expected["x_scales"]))
    finally:
        buffer.destroy()
    return results


# ------------------------------------------------------------------------------------- launch


def _rank_main(rank: int, num_ranks: int, group: Any) -> dict:
    results: dict[str, Any] = {}
    guarded(results, "inference", lambda: _inference(rank, num_ranks, group))
    guarded(results, "training", lambda: _training(rank, num_ranks, group))
    guarded(results, "low_latency", lambda: _low_latency(rank, num_ranks, group))
    guarded(results, "refused_v2_inputs", lambda: _refused_v2_inputs(rank, num_ranks, group))
    # Last: a capture that goes wrong cannot disturb the other sequences.
    guarded(results, "decode_graph", lambda: _decode_graph(rank, num_ranks, group))
    return results


@pytest.fixture
def v2_results(num_ranks: int) -> list[dict]:
    """Per-rank results of every sequence, run once per rank count."""
    return launch_once(_rank_main, num_ranks)


def _lines(results: list[dict], *path: str) -> list[str]:
    """Every rank's mismatches at ``path`` (or the traceback of the exception that ended it)."""
    lines = []
    for rank, result in enumerate(results):
        value: Any = result
        for key in path:
            if isinstance(value, dict) and "exception" in value:
                break
            value = value[key]
        if isinstance(value, dict) and "exception" in value:
            lines.append(f"rank {rank}: {value['exception']}")
        else:
            lines += [f"rank {rank}: {line}" for line in value]
    return lines


def test_inference_buffer_reports_v2_attributes(v2_results: list[dict]) -> None:
    failures = _lines(v2_results, "inference", "attributes")
    for rank, result in enumerate(v2_results):
        errors = result["inference"].get("errors_after", (None, ""))
        if errors[0] is not None:
            failures.append(f"rank {rank}: check_errors() after the inference sequences: {errors}")
    assert not failures, "\n".join(failures)


def test_prefill_fp8_rows_cached_redispatch_and_bias_match_the_reference(v2_results: list[dict]) -> None:
    failures = _lines(v2_results, "inference", "prefill_rows")
    assert not failures, "\n".join(failures)


def test_prefill_expanded_with_column_major_scales_and_event_chain_matches_the_reference(
    v2_results: list[dict],
) -> None:
    failures = _lines(v2_results, "inference", "prefill_expanded")
    assert not failures, "\n".join(failures)


def test_decode_without_cpu_sync_reads_only_the_valid_rows(v2_results: list[dict]) -> None:
    failures = _lines(v2_results, "inference", "decode_rows") + _lines(v2_results, "inference", "decode_expanded")
    assert not failures, "\n".join(failures)


def test_dispatch_without_handle_copy_keeps_the_callers_topk_idx(v2_results: list[dict]) -> None:
    failures = _lines(v2_results, "inference", "without_handle_copy")
    assert not failures, "\n".join(failures)


def test_masked_decode_captured_in_a_cuda_graph_replays_with_new_routing(v2_results: list[dict]) -> None:
    failures = _lines(v2_results, "decode_graph")
    assert not failures, "\n".join(failures)


def test_training_forward_and_backward_calls_match_the_reference(v2_results: list[dict]) -> None:
    failures = _lines(v2_results, "training")
    assert not failures, "\n".join(failures)


def test_low_latency_decode_with_hooks_and_masked_experts_between_prefills(v2_results: list[dict]) -> None:
    failures = _lines(v2_results, "low_latency")
    assert not failures, "\n".join(failures)


def _accepted(v2_results: list[dict], probe: str) -> None:
    for rank, result in enumerate(v2_results):
        refused = result["refused_v2_inputs"]
        assert "exception" not in refused, f"rank {rank}: {refused['exception']}"
        outcome = refused[probe]
        assert outcome["kind"] is None, f"rank {rank}: {outcome['kind']}: {outcome['message']}"
        assert not outcome["failures"], f"rank {rank}: " + "\n".join(outcome["failures"])
        assert outcome["errors_after"] == (None, ""), f"rank {rank}: {outcome['errors_after']}"


def test_dispatch_takes_column_major_input_scales_as_v2_does(v2_results: list[dict]) -> None:
    _accepted(v2_results, "column_major_scales")


def test_dispatch_takes_packed_ue8m0_input_scales_as_v2_does(v2_results: list[dict]) -> None:
    _accepted(v2_results, "ue8m0_scales")
