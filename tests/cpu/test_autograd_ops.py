"""deep_ep.autograd and deep_ep.ops without a GPU.

A stand-in buffer (``FakeBuffer``) implements the HT dispatch / combine contract of docs/api.md on
CPU tensors with the repository's reference model (``deep_ep.testing.reference``), one Python
thread per rank exchanging inputs through a barrier. It returns real ``EPHandle`` objects with the
counts block laid out as the core lays it out, fills every row a worst-case (no CPU sync) output
leaves uninitialised with NaN / valid-looking expert ids, and asserts that every rank runs the same
collective in the same order. Against it:

* op registration, schemas, fake (meta) shapes under ``FakeTensorMode`` and ``torch.library.opcheck``;
* the gradients of ``deep_ep.autograd`` and of the custom ops, for 1 to 4 ranks, against a dense
  single-process reference of the whole group (bitwise where the library is bitwise);
* ``torch.compile(fullgraph=True)`` of a forward + backward through the ops (one rank);
* argument errors.

What only a GPU shows (the real kernels, several processes) is in tests/gpu/test_autograd.py.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import pytest
import torch

import deep_ep.autograd as ep_autograd
import deep_ep.ops as ep_ops
from deep_ep._util import align_up
from deep_ep.event import EventOverlap
from deep_ep.handle import EPHandle
from deep_ep.high_throughput import counts_layout
from deep_ep.testing.data import make_group_inputs, make_tokens
from deep_ep.testing.reference import ht_combine, ht_dispatch, sanitize_topk_idx
from deep_ep.testing.reference_experts import (
    dense_step,
    expert_rows,
    expert_rows_expanded,
    leaf,
    step_loss,
    step_results,
)

# ---------------------------------------------------------------------------------------------- fake group

_serials = itertools.count(10_000)


class FakeGroup:
    """Ranks as threads: ``exchange`` is an all-gather that also checks every rank runs the same
    collective (name) in the same order."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.barrier = threading.Barrier(num_ranks, timeout=60)
        self.slots: list = [None] * num_ranks

    def exchange(self, rank: int, name: str, payload):
        self.slots[rank] = (name, payload)
        self.barrier.wait()
        items = list(self.slots)
        self.barrier.wait()
        names = [item[0] for item in items]
        if len(set(names)) != 1:
            raise AssertionError(f"ranks ran different collectives at the same step: {names}")
        return [item[1] for item in items]


def _garbage_like(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point():
        return torch.full_like(tensor, float("nan"))
    return torch.zeros_like(tensor)  # a valid-looking expert id / source


class FakeBuffer:
    """The HT part of ElasticBuffer's contract on CPU (see the module docstring)."""

    def __init__(self, group: FakeGroup, rank: int, num_experts: int, num_max_tokens_per_rank: int) -> None:
        self.group = group
        self.rank_idx = rank
        self.num_ranks = group.num_ranks
        self.num_experts = num_experts
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.ht_mode = "direct"
        self._serial = next(_serials)
        self.calls: list[str] = []
        self.failed: list[tuple[str, Exception]] = []
        self.last_handle: EPHandle | None = None

    # -- failed-input hooks (the real buffer launches the operation without data)
    def _dispatch_without_input(self, handle, num_experts, error):
        self.failed.append(("dispatch", error))

    def _combine_without_input(self, x, handle, error):
        self.failed.append(("combine", error))

    def _check_handle(self, handle):
        if not isinstance(handle, EPHandle):
            raise TypeError(f"handle must be an EPHandle, got {type(handle).__name__}")
        if handle.owner_id != self._serial:
            raise ValueError("handle comes from a dispatch of another buffer")

    def dispatch(
        self,
        x,
        topk_idx=None,
        topk_weights=None,
        *,
        num_experts=None,
        num_max_tokens_per_rank=None,
        expert_alignment=1,
        num_sms=0,
        handle=None,
        do_cpu_sync=None,
        do_expand=False,
        previous_event=None,
        async_with_compute_stream=False,
        allocate_on_comm_stream=False,
    ):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
            raise ValueError(f"x must be contiguous bf16 [T, H], got {x!r:.80}")
        num_tokens, hidden = x.shape
        cached = handle is not None
        if cached:
            self._check_handle(handle)
            assert topk_idx is None and not do_cpu_sync and num_tokens == handle.num_tokens
            routing = handle.topk_idx.clone()
            num_experts, t_max = handle.num_experts, handle.num_max_tokens_per_rank
            expert_alignment, do_expand, exact = handle.expert_alignment, handle.do_expand, handle.is_exact
        else:
            num_experts = num_experts or self.num_experts
            t_max = num_max_tokens_per_rank or self.num_max_tokens_per_rank
            assert topk_idx.dtype == torch.int64 and topk_idx.shape[0] == num_tokens and num_tokens <= t_max
            routing = sanitize_topk_idx(topk_idx, num_experts)
            exact = True if do_cpu_sync is None else bool(do_cpu_sync)
        num_topk = routing.shape[1]
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32 and tuple(topk_weights.shape) == (num_tokens, num_topk)
            assert topk_weights.is_contiguous()
        self.calls.append("cached dispatch" if cached else "dispatch")
        everyone = self.group.exchange(
            self.rank_idx, self.calls[-1], (x, routing, topk_weights, num_experts, expert_alignment, do_expand)
        )
        assert len({(e[3], e[4], e[5], e[2] is None) for e in everyone}) == 1, "ranks disagree on the call"
        weights = None if topk_weights is None else [e[2] for e in everyone]
        ref = ht_dispatch(
            [e[0] for e in everyone],
            [e[1] for e in everyone],
            weights,
            num_experts,
            expert_alignment=expert_alignment,
            do_expand=do_expand,
        )[self.rank_idx]
        num_local = num_experts // self.num_ranks
        exact_rows = ref["x"].shape[0]
        exact_recv = sum(ref["num_recv_tokens_per_rank"])
        if cached:
            num_recv, num_expanded = handle.num_recv_tokens, handle.num_expanded_tokens
        elif exact:
            num_recv, num_expanded = exact_recv, sum(ref["num_recv_tokens_per_expert_aligned"])
        else:
            num_recv, num_expanded = ep_ops.worst_case_rows(
                self.num_ranks, t_max, num_topk, num_experts, expert_alignment
            )
        rows = num_expanded if do_expand else num_recv

        def place(value, shape):
            out = torch.zeros(shape, dtype=value.dtype)
            if not exact:
                out.copy_(_garbage_like(out))
            out[: value.shape[0]] = value
            if do_expand and not exact:  # padding rows: uninitialised too without CPU sync
                out[: value.shape[0]][ref["src_rank"] < 0] = _garbage_like(out[:1])
            return out

        recv_x = place(ref["x"], (rows, hidden))
        recv_topk_idx = None if do_expand else place(ref["topk_idx"], (rows, num_topk))
        recv_topk_weights = None
        if topk_weights is not None:
            recv_topk_weights = place(ref["topk_weights"], (rows,) if do_expand else (rows, num_topk))
        if cached:
            return recv_x, recv_topk_idx, recv_topk_weights, handle, EventOverlap(None)

        layout = counts_layout(self.num_ranks, num_local)
        counts = torch.zeros(layout["total"], dtype=torch.int32)
        per_source = torch.tensor(ref["num_recv_tokens_per_rank"], dtype=torch.int32)
        unaligned = torch.tensor(ref["num_recv_tokens_per_expert"], dtype=torch.int32)
        aligned = torch.tensor(ref["num_recv_tokens_per_expert_aligned"], dtype=torch.int32)
        starts = aligned.cumsum(0) - aligned
        fields = {
            "recv_per_source": per_source,
            "psum_per_source": per_source.cumsum(0),
            "unaligned_per_expert": unaligned,
            "expert_start": starts,
            "psum_per_expert": starts + unaligned if do_expand else aligned.cumsum(0),
        }
        for name, value in fields.items():
            counts[layout[name] : layout[name] + value.numel()] = value
        view = {name: counts[layout[name] : layout[name] + fields[name].numel()] for name in fields}
        src_info = torch.full((num_recv, 4), 7, dtype=torch.int32)
        if not do_expand:
            src_info[:exact_recv, 0] = ref["src_rank"].to(torch.int32)
            src_info[:exact_recv, 1] = ref["src_token"].to(torch.int32)
        new_handle = EPHandle(
            do_expand=do_expand,
            num_experts=num_experts,
            expert_alignment=expert_alignment,
            num_max_tokens_per_rank=t_max,
            num_sms=num_sms,
            topk_idx=routing,
            num_recv_tokens=num_recv,
            num_expanded_tokens=num_expanded,
            num_recv_tokens_per_expert_list=aligned.tolist() if exact else [],
            psum_num_recv_tokens_per_source=view["psum_per_source"],
            psum_num_recv_tokens_per_expert=view["psum_per_expert"],
            num_unaligned_recv_tokens_per_expert=view["unaligned_per_expert"],
            recv_src_info=src_info,
            dst_buffer_slot_idx=torch.arange(num_tokens * num_topk, dtype=torch.int32).view(num_tokens, num_topk),
            num_ranks=self.num_ranks,
            num_tokens=num_tokens,
            num_topk=num_topk,
            is_exact=exact,
            expert_slot_idx=-torch.arange(num_tokens * num_topk, dtype=torch.int32).view(num_tokens, num_topk),
            num_recv_tokens_per_scaleup_rank=view["recv_per_source"],
            expert_offsets_per_source=counts[
                layout["expert_offsets"] : layout["expert_offsets"] + self.num_ranks * num_local
            ].view(self.num_ranks, num_local),
            expert_start=view["expert_start"],
            recv_expanded_row_idx=torch.full((num_recv, num_topk), 3, dtype=torch.int32) if do_expand else None,
            counts=counts,
            owner_id=self._serial,
        )
        assert exact_rows <= rows
        self.last_handle = new_handle
        return recv_x, recv_topk_idx, recv_topk_weights, new_handle, EventOverlap(None)

    def combine(
        self,
        x,
        handle,
        *,
        topk_weights=None,
        bias=None,
        num_sms=0,
        previous_event=None,
        async_with_compute_stream=False,
        allocate_on_comm_stream=False,
    ):
        self._check_handle(handle)
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] != rows or not x.is_contiguous():
            raise ValueError(f"x must be contiguous bf16 [{rows}, H], got {x.dtype} {list(x.shape)}")
        shape = (rows,) if handle.do_expand else (rows, handle.num_topk)
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32 and tuple(topk_weights.shape) == shape
            assert topk_weights.is_contiguous()
        terms = [bias] if isinstance(bias, torch.Tensor) else list(bias or ())
        for term in terms:
            assert term is None or (
                term.dtype == torch.bfloat16 and tuple(term.shape) == (handle.num_tokens, x.shape[1])
            )
        self.calls.append("combine")
        everyone = self.group.exchange(
            self.rank_idx,
            "combine",
            (handle.topk_idx, x, topk_weights, bias, handle.num_experts, handle.expert_alignment, handle.do_expand),
        )
        assert len({(e[4], e[5], e[6], e[2] is None) for e in everyone}) == 1, "ranks disagree on the call"
        num_experts, alignment, do_expand = everyone[0][4:7]
        routings = [e[0] for e in everyone]
        placeholders = [torch.zeros(r.shape[0], 8, dtype=torch.bfloat16) for r in routings]
        layout = ht_dispatch(placeholders, routings, None, num_experts, expert_alignment=alignment, do_expand=do_expand)
        ys = [e[1][: r["src_rank"].numel()] for e, r in zip(everyone, layout, strict=True)]
        weights = None
        if topk_weights is not None:
            weights = [e[2][: r["src_rank"].numel()] for e, r in zip(everyone, layout, strict=True)]
        result = ht_combine(
            layout,
            ys,
            routings,
            num_experts,
            weights_list=weights,
            biases=[e[3] for e in everyone],
            do_expand=do_expand,
        )[self.rank_idx]
        return result["x"], result["topk_weights"], EventOverlap(None)


def run_ranks(num_ranks: int, fn, *args):
    """``fn(buffer, *args)`` on every rank (a thread each); results by rank, first failure raised."""
    group = FakeGroup(num_ranks)
    buffers = [FakeBuffer(group, rank, *args[:2]) for rank in range(num_ranks)]
    results: list = [None] * num_ranks
    errors: list = [None] * num_ranks

    def body(rank):
        try:
            results[rank] = fn(buffers[rank], *args[2:])
        except BaseException as error:  # noqa: BLE001 - reported below
            errors[rank] = error
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(num_ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for rank, error in enumerate(errors):
        if error is not None and not isinstance(error, threading.BrokenBarrierError):
            raise AssertionError(f"rank {rank} failed: {error!r}") from error
    if any(errors):
        raise AssertionError("a rank's barrier broke") from next(e for e in errors if e)
    calls = {tuple(buffer.calls) for buffer in buffers}
    assert len(calls) == 1, f"ranks ran different sequences of collectives: {calls}"
    return results


# ---------------------------------------------------------------------------------------------- the MoE step


@dataclass(frozen=True)
class Case:
    num_ranks: int
    num_local: int = 2
    num_topk: int = 3
    hidden: int = 32
    num_max_tokens: int = 12
    do_expand: bool = False
    expert_alignment: int = 1
    do_cpu_sync: bool = True
    with_weights: bool = True
    combine_weights: bool = False
    num_biases: int = 0
    seed: int = 0

    @property
    def num_experts(self) -> int:
        return self.num_local * self.num_ranks


def case_inputs(case: Case):
    data = make_group_inputs(
        case.num_ranks,
        case.num_max_tokens,
        case.hidden,
        case.num_experts,
        min(case.num_topk, case.num_experts),
        seed=case.seed,
        with_weights=case.with_weights,
    )
    generator = torch.Generator().manual_seed(case.seed + 1)
    grads, weight_grads, biases = [], [], []
    gains = [1 + 0.01 * torch.randn(case.hidden, generator=generator) for _ in range(case.num_ranks)]
    for count in data.num_tokens:
        grads.append(torch.randn(count, case.hidden, generator=generator))
        weight_grads.append(torch.randn(count, min(case.num_topk, case.num_experts), generator=generator))
        biases.append([make_tokens(count, case.hidden, generator) for _ in range(case.num_biases)])
    return data, grads, weight_grads, biases, gains


def library_step(buffer, case: Case, use_ops: bool):
    """One MoE step on this rank through deep_ep.autograd (or deep_ep.ops): forward and backward."""
    data, grads, weight_grads, biases, gains = case_inputs(case)
    rank = buffer.rank_idx
    gain = leaf(gains[rank])
    x = leaf(data.x[rank])
    w = leaf(None if data.topk_weights is None else data.topk_weights[rank])
    bias = [leaf(b) for b in biases[rank]]
    kwargs = {
        "num_max_tokens_per_rank": case.num_max_tokens,
        "expert_alignment": case.expert_alignment,
        "do_expand": case.do_expand,
    }
    if use_ops:
        assert not case.do_cpu_sync, "the ops always dispatch without CPU sync"
        recv_x, recv_idx, recv_w, handle = ep_ops.dispatch(
            buffer, x, data.topk_idx[rank], w, case.num_experts, **kwargs
        )
        row_local = ep_ops.expanded_row_experts(handle) if case.do_expand else None
    else:
        recv_x, recv_idx, recv_w, handle = ep_autograd.dispatch(
            buffer, x, data.topk_idx[rank], w, case.num_experts, do_cpu_sync=case.do_cpu_sync, **kwargs
        )
        row_local = ep_autograd.expanded_row_experts(handle) if case.do_expand else None
    if case.do_expand:
        y = expert_rows_expanded(recv_x, row_local, recv_w, rank, case.num_local, gain)
    else:
        y = expert_rows(recv_x, recv_idx, recv_w, rank, case.num_local, gain)
    combine_weights = recv_w * 2 if case.combine_weights else None
    bias_arg = None if not bias else (bias[0] if len(bias) == 1 else tuple(bias))
    combine = ep_ops.combine if use_ops else ep_autograd.combine
    out, combined_weights = combine(buffer, y, handle, topk_weights=combine_weights, bias=bias_arg)
    step_loss(out, combined_weights, grads[rank], weight_grads[rank]).backward()
    return step_results(out, combined_weights, x, w, bias, gain.grad)


def dense_reference(case: Case) -> list[dict]:
    """The whole group's MoE step in one process with plain torch autograd (per source rank)."""
    data, grads, weight_grads, biases, gains = case_inputs(case)
    num_ranks = case.num_ranks
    gains = [leaf(gain) for gain in gains]
    results = []
    for source in range(num_ranks):
        x = leaf(data.x[source])
        w = leaf(None if data.topk_weights is None else data.topk_weights[source])
        bias = [leaf(b) for b in biases[source]]
        routing = sanitize_topk_idx(data.topk_idx[source], case.num_experts)
        out, combined_weights = dense_step(
            x, w, bias, routing, gains, case.num_local, case.do_expand, case.combine_weights, num_ranks
        )
        step_loss(out, combined_weights, grads[source], weight_grads[source]).backward()
        results.append(step_results(out, combined_weights, x, w, bias))
    for rank, result in enumerate(results):  # a rank's expert gain collects every source's rows
        result["gain_grad"] = gains[rank].grad
    return results


def _bits(tensor):
    return tensor.view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def assert_bitwise(name, got, want):
    assert (got is None) == (want is None), f"{name}: {got is None=} {want is None=}"
    if want is None:
        return
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: {got.dtype} {got.shape} vs {want.dtype} {want.shape}"
    )
    assert torch.equal(_bits(got), _bits(want)), f"{name}: max diff {(got.float() - want.float()).abs().max()}"


def compare(case: Case, got: list[dict], want: list[dict]) -> None:
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        where = f"rank {rank} of {case}"
        assert_bitwise(f"out ({where})", g["out"], w["out"])
        assert_bitwise(f"combined_weights ({where})", g["combined_weights"], w["combined_weights"])
        assert_bitwise(f"x.grad ({where})", g["x_grad"], w["x_grad"])
        for index, (gb, wb) in enumerate(zip(g["bias_grads"], w["bias_grads"], strict=True)):
            assert_bitwise(f"bias[{index}].grad ({where})", gb, wb)
        # Gradients of weights and gains are fp32 sums (over H, over rows) whose order depends on the
        # tensor shapes (N received rows vs T tokens per source): equal up to fp32 rounding.
        for name in ("w_grad", "gain_grad"):
            assert (g[name] is None) == (w[name] is None), name
            if w[name] is not None:
                assert torch.isfinite(g[name]).all(), f"{name} ({where}) is not finite"
                torch.testing.assert_close(
                    g[name], w[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name, at=where: f"{n} {at}: {m}"
                )


CASES = [
    Case(1),
    Case(2, combine_weights=True, num_biases=1),
    Case(3, do_cpu_sync=False, num_biases=2, seed=3),
    Case(4, num_topk=4, with_weights=False, seed=4),
    Case(2, do_expand=True, expert_alignment=4, combine_weights=True, seed=5),
    Case(4, do_expand=True, expert_alignment=3, do_cpu_sync=False, num_biases=1, combine_weights=True, seed=6),
    Case(3, num_local=1, num_topk=3, do_cpu_sync=False, combine_weights=True, seed=7),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_autograd_matches_dense_reference(case):
    got = run_ranks(case.num_ranks, library_step, case.num_experts, case.num_max_tokens, case, False)
    compare(case, got, dense_reference(case))


@pytest.mark.parametrize(
    "case", [c for c in CASES if not c.do_cpu_sync] + [Case(2, do_cpu_sync=False, seed=8)], ids=str
)
def test_ops_match_dense_reference(case):
    got = run_ranks(case.num_ranks, library_step, case.num_experts, case.num_max_tokens, case, True)
    compare(case, got, dense_reference(case))


def _combine_weight_gradient(buffer, use_ops: bool, do_expand: bool):
    """combine(topk_weights=weights): the leaf's gradient is the token's weight gradient on the slots of
    this rank's experts (expand: the pair's slot) and 0 elsewhere, including rows past the valid ones."""
    num_ranks, rank = buffer.num_ranks, buffer.rank_idx
    data = make_group_inputs(num_ranks, 8, 16, buffer.num_experts, 3, seed=11)
    weight_grads = [
        torch.randn(n, 3, generator=torch.Generator().manual_seed(12 + r)) for r, n in enumerate(data.num_tokens)
    ]
    x, idx, w = data.x[rank], data.topk_idx[rank], data.topk_weights[rank]
    if use_ops:
        recv_x, recv_idx, recv_w, handle = ep_ops.dispatch(
            buffer, x, idx, w, num_max_tokens_per_rank=8, do_expand=do_expand
        )
        ep_handle = ep_ops.to_ep_handle(handle)
        combine = ep_ops.combine
    else:
        recv_x, recv_idx, recv_w, handle = ep_autograd.dispatch(
            buffer, x, idx, w, num_max_tokens_per_rank=8, do_expand=do_expand
        )
        ep_handle, combine = handle, ep_autograd.combine
    weights = leaf(recv_w)
    out, combined = combine(buffer, recv_x, handle, topk_weights=weights)
    (combined * weight_grads[rank]).sum().backward()
    # Expected: the routing of every source decides which slots of which received row are ours.
    routings = [sanitize_topk_idx(r, buffer.num_experts) for r in data.topk_idx]
    expected = torch.zeros_like(weights)
    num_local = buffer.num_experts // num_ranks
    placeholders = [torch.zeros(r.shape[0], 8, dtype=torch.bfloat16) for r in routings]
    layout = ht_dispatch(placeholders, routings, None, buffer.num_experts, do_expand=do_expand)[rank]
    for row, (source, token) in enumerate(zip(layout["src_rank"].tolist(), layout["src_token"].tolist(), strict=True)):
        if source < 0:
            continue
        experts = routings[source][token]
        mine = (experts >= 0) & (experts // num_local == rank)
        if do_expand:
            mine &= experts % num_local == layout["local_expert"][row]
            expected[row] = weight_grads[source][token][mine].sum()
        else:
            expected[row] = torch.where(mine, weight_grads[source][token], 0.0)
    assert ep_handle.num_tokens == x.shape[0]
    assert_bitwise("topk_weights.grad", weights.grad, expected)
    return True


@pytest.mark.parametrize("use_ops", [False, True], ids=["autograd", "ops"])
@pytest.mark.parametrize("do_expand", [False, True], ids=["rows", "expand"])
def test_combine_weight_gradient_is_the_owners_slot(use_ops, do_expand):
    assert all(run_ranks(3, _combine_weight_gradient, 6, 8, use_ops, do_expand))


# ------------------------------------------------------------------------------------------ ops: registration, shapes


def _single_buffer(num_ranks=1, num_experts=4, t_max=12) -> FakeBuffer:
    buffer = FakeBuffer(FakeGroup(num_ranks), 0, num_experts, t_max)
    ep_ops.register_buffer(buffer)
    return buffer


def test_ops_are_registered_with_effects_and_autograd():
    from torch._higher_order_ops.effects import _get_effect

    for name in ("ht_dispatch", "ht_cached_dispatch", "ht_combine"):
        op = getattr(torch.ops.deep_ep, name).default
        assert not op._schema.is_mutable, name
        assert _get_effect(op) is not None, f"{name} is not registered as effectful"
    schema = str(torch.ops.deep_ep.ht_dispatch.default._schema)
    assert "Tensor? topk_weights" in schema and "bool do_expand" in schema


@pytest.mark.parametrize("do_expand", [False, True])
def test_fake_shapes_are_the_worst_case(do_expand):
    from torch._subclasses.fake_tensor import FakeTensorMode

    num_ranks, num_local, t_max, hidden, num_topk, alignment = 4, 3, 16, 64, 5, 8
    buffer = FakeBuffer(FakeGroup(num_ranks), 0, num_ranks * num_local, t_max)
    buffer_id = ep_ops.register_buffer(buffer)
    num_rows, num_expanded = ep_ops.worst_case_rows(num_ranks, t_max, num_topk, num_ranks * num_local, alignment)
    assert num_rows == 64 and num_expanded == align_up(64 * 3 + 7 * 3, 8)
    with FakeTensorMode():
        x = torch.empty(10, hidden, dtype=torch.bfloat16)
        idx = torch.empty(10, num_topk, dtype=torch.int64)
        w = torch.empty(10, num_topk, dtype=torch.float32)
        outs = torch.ops.deep_ep.ht_dispatch(
            x, idx, w, buffer_id, num_ranks * num_local, t_max, alignment, 0, do_expand
        )
        recv_x, recv_idx, recv_w, routing, metadata, expanded, expert_counts = outs
        rows = num_expanded if do_expand else num_rows
        assert recv_x.shape == (rows, hidden) and recv_x.dtype == torch.bfloat16
        assert (
            recv_idx.shape == ((0, num_topk) if do_expand else (num_rows, num_topk)) and recv_idx.dtype == torch.int64
        )
        assert (
            recv_w.shape == ((num_expanded,) if do_expand else (num_rows, num_topk)) and recv_w.dtype == torch.float32
        )
        counts_total = counts_layout(num_ranks, num_local)["total"]
        assert routing.shape == (4 * 10 * num_topk + counts_total,) and routing.dtype == torch.int32
        assert metadata.shape == (num_rows, 4) and metadata.dtype == torch.int32
        assert expanded.shape == ((num_rows, num_topk) if do_expand else (0, num_topk))
        assert expert_counts.shape == (2, num_local) and expert_counts.dtype == torch.int32
        statics = (buffer_id, 10, hidden, num_topk, num_ranks * num_local, t_max, alignment, do_expand, 0)
        y = torch.empty(rows, 48, dtype=torch.bfloat16)
        combined, combined_w = torch.ops.deep_ep.ht_combine(
            y, routing, metadata, expanded, recv_w, None, None, *statics
        )
        assert combined.shape == (10, 48) and combined.dtype == torch.bfloat16
        assert combined_w.shape == (10, num_topk) and combined_w.dtype == torch.float32
        grad = torch.empty(10, 48, dtype=torch.bfloat16)
        back_x, back_idx, back_w = torch.ops.deep_ep.ht_cached_dispatch(
            grad, routing, metadata, expanded, None, *statics
        )
        assert back_x.shape == (rows, 48) and back_w.shape == (0,)


def _op_args(buffer, do_expand, with_weights=True):
    generator = torch.Generator().manual_seed(3)
    num_tokens, hidden, num_topk = 6, 16, 2
    x = make_tokens(num_tokens, hidden, generator)
    idx = torch.randint(0, buffer.num_experts, (num_tokens, num_topk), generator=generator)
    idx[:, 1] = (idx[:, 0] + 1) % buffer.num_experts
    w = torch.rand(num_tokens, num_topk, generator=generator) if with_weights else None
    return x, idx, w


@pytest.mark.parametrize("do_expand", [False, True])
def test_opcheck(do_expand):
    buffer = _single_buffer()
    x, idx, w = _op_args(buffer, do_expand)
    args = (x, idx, w, buffer._serial, buffer.num_experts, buffer.num_max_tokens_per_rank, 2, 0, do_expand)
    torch.library.opcheck(torch.ops.deep_ep.ht_dispatch.default, args)
    outs = torch.ops.deep_ep.ht_dispatch(*args)
    recv_x, _, recv_w, routing, metadata, expanded, _ = outs
    statics = (
        buffer._serial,
        x.shape[0],
        x.shape[1],
        idx.shape[1],
        buffer.num_experts,
        buffer.num_max_tokens_per_rank,
        2,
        do_expand,
        0,
    )
    combine_args = (recv_x, routing, metadata, expanded, recv_w, x, None, *statics)
    torch.library.opcheck(torch.ops.deep_ep.ht_combine.default, combine_args)
    torch.library.opcheck(torch.ops.deep_ep.ht_cached_dispatch.default, (x, routing, metadata, expanded, w, *statics))


def test_tensor_handle_round_trips_the_ep_handle():
    buffer = _single_buffer(num_experts=4)
    x, idx, w = _op_args(buffer, False)
    *_, handle = ep_ops.dispatch(buffer, x, idx, w, expert_alignment=2)
    original, rebuilt = buffer.last_handle, ep_ops.to_ep_handle(handle)
    for field in (
        "topk_idx",
        "expert_slot_idx",
        "dst_buffer_slot_idx",
        "counts",
        "recv_src_info",
        "recv_src_metadata",
        "psum_num_recv_tokens_per_scaleup_rank",
        "psum_num_recv_tokens_per_source",
        "psum_num_recv_tokens_per_expert",
        "num_unaligned_recv_tokens_per_expert",
        "num_recv_tokens_per_scaleup_rank",
        "expert_offsets_per_source",
        "expert_start",
    ):
        assert torch.equal(getattr(rebuilt, field), getattr(original, field)), field
    for field in ("num_recv_tokens", "num_expanded_tokens", "num_tokens", "num_topk", "num_experts", "owner_id"):
        assert getattr(rebuilt, field) == getattr(original, field), field
    assert rebuilt.is_exact is False and rebuilt.counts.data_ptr() % 16 == 0


def test_expanded_row_experts_and_valid_rows():
    # Two experts: counts 3 and 0 and 2, alignment 4: segments [0, 3), [4, 4), [4, 6); 12 rows.
    counts = torch.tensor([3, 0, 2], dtype=torch.int32)
    starts = torch.tensor([0, 4, 4], dtype=torch.int32)
    rows = ep_autograd.expert_of_rows(starts, counts, 12)
    assert rows.tolist() == [0, 0, 0, -1, 2, 2, -1, -1, -1, -1, -1, -1]
    psum = starts + counts
    mask = ep_autograd.valid_row_mask(torch.tensor([2, 5]), psum, counts, 12, True)
    assert mask.tolist() == [r >= 0 for r in rows.tolist()]
    assert ep_autograd.valid_row_mask(torch.tensor([2, 5]), psum, counts, 8, False).tolist() == [True] * 5 + [False] * 3


# ---------------------------------------------------------------------------------------------- torch.compile


def _compile_step(buffer, do_expand: bool):
    num_local = buffer.num_experts // buffer.num_ranks

    def step(x, idx, w):
        recv_x, recv_idx, recv_w, handle = ep_ops.dispatch(
            buffer, x, idx, w, num_max_tokens_per_rank=buffer.num_max_tokens_per_rank, do_expand=do_expand
        )
        if do_expand:
            y = expert_rows_expanded(recv_x, ep_ops.expanded_row_experts(handle), recv_w, 0, num_local)
        else:
            y = expert_rows(recv_x, recv_idx, recv_w, 0, num_local)
        out, combined_w = ep_ops.combine(buffer, y, handle, topk_weights=recv_w)
        return out, combined_w

    return step


def _run_step(step, x, idx, w):
    x, w = leaf(x), leaf(w)
    out, combined_w = step(x, idx, w)
    (out.float().sum() + (combined_w * 3).sum()).backward()
    return out.detach(), combined_w.detach(), x.grad, w.grad


@pytest.mark.parametrize("backend,do_expand", [("aot_eager", False), ("aot_eager", True), ("inductor", False)])
def test_compile_fullgraph_matches_eager(backend, do_expand):
    torch._dynamo.reset()
    buffer = _single_buffer(num_experts=4)
    x, idx, w = _op_args(buffer, do_expand)
    step = _compile_step(buffer, do_expand)
    eager = _run_step(step, x, idx, w)
    calls = len(buffer.calls)
    compiled = _run_step(torch.compile(step, fullgraph=True, backend=backend), x, idx, w)
    assert buffer.calls[calls:] == buffer.calls[:calls], "the compiled step runs the same collectives"
    names = ("out", "combined_weights", "x.grad", "w.grad")
    for name, got, want in zip(names, compiled, eager, strict=True):
        if backend == "aot_eager" or name in ("combined_weights",):
            assert_bitwise(f"{backend} {name}", got, want)
        else:  # inductor fuses the expert arithmetic (fp32, then one bf16 rounding): 1 bf16 ulp
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-5)


def test_compile_without_registration_names_the_fix():
    torch._dynamo.reset()
    buffer = FakeBuffer(FakeGroup(1), 0, 4, 12)  # never registered, never called eagerly
    x, idx, w = _op_args(buffer, False)
    step = _compile_step(buffer, False)
    with pytest.raises(Exception, match="register_buffer"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(x, idx, w)


# ---------------------------------------------------------------------------------------------- argument errors


def test_autograd_dispatch_refuses_fp8_after_taking_part():
    buffer = _single_buffer()
    x, idx, w = _op_args(buffer, False)
    pair = (x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], 1))
    with pytest.raises(ValueError, match="no gradient"):
        ep_autograd.dispatch(buffer, pair, idx, w)
    assert [name for name, _ in buffer.failed] == ["dispatch"] and buffer.calls == []


def test_autograd_refuses_async_with_compute_stream():
    buffer = _single_buffer()
    x, idx, w = _op_args(buffer, False)
    with pytest.raises(ValueError, match="async_with_compute_stream"):
        ep_autograd.dispatch(buffer, x, idx, w, async_with_compute_stream=True)
    recv_x, _, _, handle = ep_autograd.dispatch(buffer, x, idx, w)
    with pytest.raises(ValueError, match="async_with_compute_stream"):
        ep_autograd.combine(buffer, recv_x, handle, async_with_compute_stream=True)
    with pytest.raises(ValueError, match="at most two"):
        ep_autograd.combine(buffer, recv_x, handle, bias=(None, None, None))
    assert [name for name, _ in buffer.failed] == ["dispatch", "combine", "combine"]


def test_ops_argument_errors():
    buffer, other = _single_buffer(), _single_buffer()
    x, idx, w = _op_args(buffer, False)
    with pytest.raises(ValueError, match="bf16"):
        ep_ops.dispatch(buffer, x.float(), idx, w)
    recv_x, _, _, handle = ep_ops.dispatch(buffer, x, idx, w)
    with pytest.raises(ValueError, match="another buffer"):
        ep_ops.combine(other, recv_x, handle)
    with pytest.raises(TypeError, match="TensorHandle"):
        ep_ops.cached_dispatch(buffer, x, buffer.last_handle)
    with pytest.raises(RuntimeError, match="register_buffer"):
        ep_ops._lookup(-1)
    assert [name for name, _ in buffer.failed] == ["dispatch", "dispatch"]
    assert [name for name, _ in other.failed] == ["combine"]


def test_dispatch_without_grad_and_none_gradients():
    # Backward still runs every collective (with zeros) when only part of the outputs is used.
    def step(buffer):
        x = leaf(torch.ones(4, 16, dtype=torch.bfloat16))
        idx = torch.tensor([[0, 1]] * 4)
        w = leaf(torch.ones(4, 2))
        recv_x, _, recv_w, handle = ep_autograd.dispatch(buffer, x, idx, w, do_cpu_sync=buffer.rank_idx < 0)
        out, _ = ep_autograd.combine(buffer, recv_x.detach().clone(), handle)  # no grad path through x
        (recv_w.sum() + out.float().sum() * 0).backward()
        return x.grad, w.grad

    results = run_ranks(2, step, 4, 4)
    for x_grad, w_grad in results:
        assert x_grad is not None and torch.count_nonzero(x_grad) == 0
        assert w_grad is not None
