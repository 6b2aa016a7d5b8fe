"""deep_ep.autograd and deep_ep.ops on the GPU: one MoE step (dispatch -> per-expert function ->
weighted combine), forward and backward, on every rank, against a dense single-process reference of
the whole group; and torch.compile(fullgraph=True) of the step through the custom ops against eager.

The reference (``dense_reference``) holds every rank's inputs (seeded generators) and computes, with
plain torch autograd, what the step produces for each source rank: per destination rank the same
expert function on the tokens routed there, summed like combine (fp32 from 0.0: biases, then
destination ranks in ascending order of each rank's last top-k lane, one bf16 rounding; expand: per
rank over its rows in top-k lane order first, rounded to bf16; hybrid: per node first). Dispatch
is modelled by ``Fanout`` (deep_ep.testing.reference_experts, shared with the CPU tests): one copy
of ``x`` per (rank, local expert group) whose backward sums the copies' gradients in that same
order, which is the library's contract for dispatch's backward (a combine). Every value and
gradient that is a fixed sequence of elementwise fp32 operations is compared bitwise: outputs,
combined weights, ``x.grad``, bias grads.
Gradients of the routing weights and of the experts' gains are fp32 reductions (over H, over rows)
whose order depends on the tensor shapes (the library reduces over N received rows, the reference
over T tokens per source), so they are compared with a tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from ht_checks import assert_bitwise_equal, device, make_buffer

import deep_ep.autograd as ep_autograd
import deep_ep.ops as ep_ops
from deep_ep.testing import launch
from deep_ep.testing.data import make_group_inputs, make_tokens
from deep_ep.testing.reference import ht_dispatch, sanitize_topk_idx
from deep_ep.testing.reference_experts import (
    dense_step,
    expert_rows,
    expert_rows_expanded,
    leaf,
    step_loss,
    step_results,
)

HIDDEN = 256
MAX_TOKENS = 128
MAX_TOPK = 4


# ---------------------------------------------------------------------------------------------- the step


@dataclass(frozen=True)
class Case:
    name: str
    num_local: int = 2
    num_topk: int = 4
    do_expand: bool = False
    expert_alignment: int = 1
    do_cpu_sync: bool = True
    with_weights: bool = True
    combine_weights: bool = False
    num_biases: int = 0
    seed: int = 0

    def num_experts(self, num_ranks: int) -> int:
        return self.num_local * num_ranks

    def topk(self, num_ranks: int) -> int:
        return min(self.num_topk, self.num_experts(num_ranks))


CASES = [
    Case("rows sync weights+bias", combine_weights=True, num_biases=1, seed=1),
    Case("rows no-sync 2 biases", do_cpu_sync=False, num_biases=2, seed=2),
    Case("rows no weights", with_weights=False, num_local=3, seed=3),
    Case("expand a8 sync", do_expand=True, expert_alignment=8, combine_weights=True, seed=4),
    Case("expand a4 no-sync bias", do_expand=True, expert_alignment=4, do_cpu_sync=False, num_biases=1, seed=5),
    Case("rows no-sync combine weights", do_cpu_sync=False, combine_weights=True, num_local=1, seed=6),
]


def case_inputs(case: Case, num_ranks: int):
    """Every rank's inputs on the device, a pure function of the case (the same on every rank)."""
    data = make_group_inputs(
        num_ranks,
        MAX_TOKENS,
        HIDDEN,
        case.num_experts(num_ranks),
        case.topk(num_ranks),
        seed=case.seed,
        with_weights=case.with_weights,
    )
    generator = torch.Generator().manual_seed(case.seed + 1000)
    dev = device()
    grads, weight_grads, biases = [], [], []
    gains = [(1 + 0.01 * torch.randn(HIDDEN, generator=generator)).to(dev) for _ in range(num_ranks)]
    for count in data.num_tokens:
        grads.append(torch.randn(count, HIDDEN, generator=generator).to(dev))
        weight_grads.append(torch.randn(count, case.topk(num_ranks), generator=generator).to(dev))
        biases.append([make_tokens(count, HIDDEN, generator).to(dev) for _ in range(case.num_biases)])
    xs = [x.to(dev) for x in data.x]
    topk_idxs = [t.to(dev) for t in data.topk_idx]
    weights = None if data.topk_weights is None else [w.to(dev) for w in data.topk_weights]
    return xs, topk_idxs, weights, grads, weight_grads, biases, gains


def library_step(buffer, rank: int, num_ranks: int, case: Case, use_ops: bool) -> dict:
    """One MoE step on this rank through deep_ep.autograd (or the custom ops), forward and backward."""
    xs, topk_idxs, weights, grads, weight_grads, biases, gains = case_inputs(case, num_ranks)
    num_experts = case.num_experts(num_ranks)
    x, gain = leaf(xs[rank]), leaf(gains[rank])
    w = leaf(None if weights is None else weights[rank])
    bias = [leaf(b) for b in biases[rank]]
    kwargs = {
        "num_max_tokens_per_rank": MAX_TOKENS,
        "expert_alignment": case.expert_alignment,
        "do_expand": case.do_expand,
    }
    if use_ops:
        recv_x, recv_idx, recv_w, handle = ep_ops.dispatch(buffer, x, topk_idxs[rank], w, num_experts, **kwargs)
        row_local = ep_ops.expanded_row_experts(handle) if case.do_expand else None
        combine = ep_ops.combine
    else:
        recv_x, recv_idx, recv_w, handle = ep_autograd.dispatch(
            buffer, x, topk_idxs[rank], w, num_experts, do_cpu_sync=case.do_cpu_sync, **kwargs
        )
        row_local = ep_autograd.expanded_row_experts(handle) if case.do_expand else None
        combine = ep_autograd.combine
    if case.do_expand:
        y = expert_rows_expanded(recv_x, row_local, recv_w, rank, case.num_local, gain)
    else:
        y = expert_rows(recv_x, recv_idx, recv_w, rank, case.num_local, gain)
    combine_weights = recv_w * 2 if case.combine_weights else None
    bias_arg = None if not bias else (bias[0] if len(bias) == 1 else tuple(bias))
    out, combined_weights = combine(buffer, y, handle, topk_weights=combine_weights, bias=bias_arg)
    step_loss(out, combined_weights, grads[rank], weight_grads[rank]).backward()
    return step_results(out, combined_weights, x, w, bias, gain.grad)


def dense_reference(case: Case, num_ranks: int, node_size: int | None = None) -> list[dict]:
    """The whole group's step in one process, plain torch autograd (results per source rank);
    ``node_size``: hybrid mode's combine order with nodes of that many ranks (None: direct)."""
    node_size = node_size or num_ranks
    xs, topk_idxs, weights, grads, weight_grads, biases, gains = case_inputs(case, num_ranks)
    num_experts = case.num_experts(num_ranks)
    gains = [leaf(gain) for gain in gains]
    results = []
    for source in range(num_ranks):
        x = leaf(xs[source])
        w = leaf(None if weights is None else weights[source])
        bias = [leaf(b) for b in biases[source]]
        routing = sanitize_topk_idx(topk_idxs[source], num_experts)
        out, combined_weights = dense_step(
            x, w, bias, routing, gains, case.num_local, case.do_expand, case.combine_weights, node_size
        )
        step_loss(out, combined_weights, grads[source], weight_grads[source]).backward()
        results.append(step_results(out, combined_weights, x, w, bias, None))
    for rank, result in enumerate(results):  # a rank's gain collects every source's rows
        result["gain_grad"] = gains[rank].grad
    return results


def _assert_reductions_close(name: str, got, want) -> None:
    """fp32 sums whose order depends on tensor shapes: equal up to fp32 rounding of the sum."""
    assert (got is None) == (want is None), f"{name}: {got is None=} {want is None=}"
    if want is None:
        return
    assert torch.isfinite(got).all(), f"{name}: not finite"
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{name}: {m}")


def compare(label: str, got: dict, want: dict) -> None:
    assert_bitwise_equal(f"{label}: out", got["out"], want["out"])
    assert_bitwise_equal(f"{label}: combined_weights", got["combined_weights"], want["combined_weights"])
    assert_bitwise_equal(f"{label}: x.grad", got["x_grad"], want["x_grad"])
    for index, (g, w) in enumerate(zip(got["bias_grads"], want["bias_grads"], strict=True)):
        assert_bitwise_equal(f"{label}: bias[{index}].grad", g, w)
    _assert_reductions_close(f"{label}: topk_weights.grad", got["w_grad"], want["w_grad"])
    _assert_reductions_close(f"{label}: gain.grad", got["gain_grad"], want["gain_grad"])


def _buffer(group):
    return make_buffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=MAX_TOPK)


# ---------------------------------------------------------------------------------------------- autograd


def _autograd_vs_reference(rank, num_ranks, group):
    buffer = _buffer(group)
    try:
        for case in CASES:
            want = dense_reference(case, num_ranks)[rank]
            compare(
                f"{case.name} autograd (rank {rank}/{num_ranks})",
                library_step(buffer, rank, num_ranks, case, False),
                want,
            )
            if not case.do_cpu_sync:  # the ops always dispatch without CPU sync
                compare(
                    f"{case.name} ops (rank {rank}/{num_ranks})",
                    library_step(buffer, rank, num_ranks, case, True),
                    want,
                )
        buffer.barrier(with_cpu_sync=True)
        buffer.check_errors()
    finally:
        buffer.destroy()


def test_autograd_and_ops_match_dense_reference(num_ranks):
    launch(_autograd_vs_reference, num_ranks)


HYBRID_CASES = [
    Case("hybrid rows no-sync weights+bias", do_cpu_sync=False, combine_weights=True, num_biases=1, seed=21),
    Case("hybrid expand a4 sync", do_expand=True, expert_alignment=4, combine_weights=True, seed=22),
    Case(
        "hybrid expand a2 no-sync 2 biases",
        do_expand=True,
        expert_alignment=2,
        do_cpu_sync=False,
        num_biases=2,
        seed=23,
    ),
]


def hybrid_node_size(num_ranks: int) -> int:
    return num_ranks // 2 if num_ranks >= 4 and num_ranks % 2 == 0 else 1


def _hybrid_vs_reference(rank, num_ranks, group):
    node_size = hybrid_node_size(num_ranks)
    buffer = make_buffer(
        group,
        num_max_tokens_per_rank=MAX_TOKENS,
        hidden=HIDDEN,
        num_topk=MAX_TOPK,
        num_ranks_per_node=node_size,
        allow_hybrid_mode=True,
    )
    try:
        assert buffer.ht_mode == "hybrid", buffer.ht_mode
        for case in HYBRID_CASES:
            want = dense_reference(case, num_ranks, node_size)[rank]
            label = f"{case.name} nodes of {node_size} (rank {rank}/{num_ranks})"
            compare(f"{label} autograd", library_step(buffer, rank, num_ranks, case, False), want)
            if not case.do_cpu_sync:
                compare(f"{label} ops", library_step(buffer, rank, num_ranks, case, True), want)
        buffer.barrier(with_cpu_sync=True)
        buffer.check_errors()
    finally:
        buffer.destroy()


def test_hybrid_mode_matches_dense_reference(num_ranks):
    if num_ranks < 2:
        pytest.skip("hybrid mode needs at least two (virtual) nodes")
    launch(_hybrid_vs_reference, num_ranks)


def _combine_weight_gradient(rank, num_ranks, group):
    """combine(topk_weights=weights) alone: the leaf's gradient is the token's weight gradient on the
    slots of this rank's experts (expand: the pair's slot), 0 elsewhere and in rows past the valid
    ones of a worst-case (no CPU sync) handle."""
    buffer = _buffer(group)
    try:
        num_experts = 2 * num_ranks
        num_local = 2
        data = make_group_inputs(num_ranks, MAX_TOKENS, HIDDEN, num_experts, min(3, num_experts), seed=40)
        dev = device()
        generator = torch.Generator().manual_seed(41)
        weight_grads = [torch.randn(n, min(3, num_experts), generator=generator).to(dev) for n in data.num_tokens]
        routings = [sanitize_topk_idx(r.to(dev), num_experts) for r in data.topk_idx]
        for do_expand, use_ops in ((False, False), (True, False), (False, True), (True, True)):
            x, idx, w = data.x[rank].to(dev), data.topk_idx[rank].to(dev), data.topk_weights[rank].to(dev)
            kwargs = {"num_max_tokens_per_rank": MAX_TOKENS, "do_expand": do_expand}
            if use_ops:
                recv_x, _, recv_w, handle = ep_ops.dispatch(buffer, x, idx, w, num_experts, **kwargs)
                combine = ep_ops.combine
            else:
                recv_x, _, recv_w, handle = ep_autograd.dispatch(
                    buffer, x, idx, w, num_experts, do_cpu_sync=False, **kwargs
                )
                combine = ep_autograd.combine
            weights = leaf(recv_w)
            _, combined = combine(buffer, recv_x, handle, topk_weights=weights)
            (combined * weight_grads[rank]).sum().backward()
            placeholders = [torch.zeros(r.shape[0], 8, dtype=torch.bfloat16, device=dev) for r in routings]
            layout = ht_dispatch(placeholders, routings, None, num_experts, do_expand=do_expand)[rank]
            expected = torch.zeros_like(weights)
            sources, tokens = layout["src_rank"], layout["src_token"]
            for source in range(num_ranks):
                rows = (sources == source).nonzero().squeeze(1)
                experts = routings[source][tokens[rows]]
                mine = (experts >= 0) & (experts // num_local == rank)
                grads = weight_grads[source][tokens[rows]]
                if do_expand:
                    mine &= (experts % num_local) == layout["local_expert"][rows].unsqueeze(1)
                    expected[rows] = torch.where(mine, grads, 0.0).sum(dim=1)
                else:
                    expected[rows] = torch.where(mine, grads, 0.0)
            assert_bitwise_equal(f"topk_weights.grad expand={do_expand} ops={use_ops}", weights.grad, expected)
        buffer.check_errors()
    finally:
        buffer.destroy()


def test_combine_weight_gradient_is_the_owners_slot(num_ranks):
    launch(_combine_weight_gradient, num_ranks)


# ---------------------------------------------------------------------------------------------- torch.compile


def _compiled_step(buffer, rank, num_ranks, do_expand):
    num_local = 2
    num_experts = num_local * num_ranks

    def step(x, idx, w, gain):
        recv_x, recv_idx, recv_w, handle = ep_ops.dispatch(
            buffer, x, idx, w, num_experts, num_max_tokens_per_rank=MAX_TOKENS, do_expand=do_expand, expert_alignment=4
        )
        if do_expand:
            y = expert_rows_expanded(recv_x, ep_ops.expanded_row_experts(handle), recv_w, rank, num_local, gain)
        else:
            y = expert_rows(recv_x, recv_idx, recv_w, rank, num_local, gain)
        return ep_ops.combine(buffer, y, handle, topk_weights=recv_w)

    return step


def _run(step, inputs):
    x, idx, w, gain, grad, weight_grad = inputs
    x, w, gain = leaf(x), leaf(w), leaf(gain)
    out, combined = step(x, idx, w, gain)
    step_loss(out, combined, grad, weight_grad).backward()
    return {
        "out": out.detach(),
        "combined": combined.detach(),
        "x.grad": x.grad,
        "w.grad": w.grad,
        "gain.grad": gain.grad,
    }


def _compile_vs_eager(rank, num_ranks, group):
    import torch._inductor.config as inductor_config

    inductor_config.compile_threads = 1  # many ranks compile at once on one host
    buffer = _buffer(group)
    try:
        ep_ops.register_buffer(buffer)
        case = Case("compile", seed=50)
        xs, topk_idxs, weights, grads, weight_grads, _, gains = case_inputs(case, num_ranks)
        inputs = (xs[rank], topk_idxs[rank], weights[rank], gains[rank], grads[rank], weight_grads[rank])
        for backend, do_expand in (("aot_eager", False), ("aot_eager", True), ("inductor", False)):
            torch._dynamo.reset()
            step = _compiled_step(buffer, rank, num_ranks, do_expand)
            eager = _run(step, inputs)
            compiled = _run(torch.compile(step, fullgraph=True, backend=backend), inputs)
            again = _run(torch.compile(step, fullgraph=True, backend=backend), inputs)  # cached graph
            label = f"{backend} expand={do_expand} (rank {rank}/{num_ranks})"
            for name in eager:
                for run, got in (("first", compiled), ("second", again)):
                    if backend == "aot_eager" or name == "combined":
                        # aot_eager runs the same kernels as eager: bitwise.
                        assert_bitwise_equal(f"{label} {run}: {name}", got[name], eager[name])
                    else:
                        # inductor fuses the expert arithmetic (fp32 FMA contraction, one bf16
                        # rounding per row): values within a couple of bf16 ulps of eager.
                        scale = max(1.0, float(eager[name].float().abs().max())) if eager[name].numel() else 1.0
                        torch.testing.assert_close(
                            got[name].float(),
                            eager[name].float(),
                            rtol=2**-6,
                            atol=2**-6 * scale,
                            msg=lambda m, n=name, r=run, at=label: f"{at} {r}: {n}: {m}",
                        )
        buffer.check_errors()
    finally:
        buffer.destroy()


def test_compile_fullgraph_matches_eager(num_ranks):
    launch(_compile_vs_eager, num_ranks)
