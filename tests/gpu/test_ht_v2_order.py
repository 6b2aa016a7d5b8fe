"""HT combine in DeepEP V2's order, bit for bit, and HT kernel names V2's benchmark scripts find.

- Combine order. Every source token gets an output per top-k lane, ``y[t, k]``
  (``deep_ep.testing.reference_v2.make_lane_outputs``: values whose sum depends on the order), and
  every rank builds its combine input from them as V2's test does: a received row is the token's
  lanes on this rank summed in lane order (the rank's partial), an expanded row is its lane's
  output. The combined rows must equal ``reference_v2.v2_combine``, our transcription of V2's
  ``refs.combine`` + ``ordered_accumulate``, bitwise: plain and expand ("reduced") combine, the
  zero-copy (pull) combine, direct and hybrid mode (virtual nodes: 2x1 at 2 ranks, 2x2 at 4, 2x4 and
  4x2 at 8), with 0, 1 and 2 biases. The routing puts each token's lanes in random order, so the
  ranks' last lanes are not in rank order; at two ranks or more the launch also checks that its data
  tells V2's order from ascending rank order (else the test could not fail on the old order).
  The routing has no repeated expert (V2's reference would count a repeat twice, the library once).
- Kernel names. V2's ``bench_kineto`` times a kernel by a substring of its name in
  ``torch.profiler``'s ``key_averages().table(..., max_name_column_width=100)`` and needs exactly one
  matching row per operation: ``dispatch_impl`` and ``dispatch_copy_epilogue_impl`` during a
  dispatch, ``combine_impl`` and ``combine_reduce_epilogue_impl`` during a combine. Profiled here for
  uncached, cached and expand dispatches, push and zero-copy combines, direct and hybrid.

One launch per rank count; each rank returns its mismatches and the tests assert on them.
"""

from __future__ import annotations

from typing import Any

import torch
from ht_checks import assert_bitwise_equal, device, make_buffer
from rank_results import launch_once

from deep_ep.testing.data import make_group_inputs
from deep_ep.testing.reference_v2 import combine_inputs_from_lanes, lanes_by_rank, make_lane_outputs, v2_combine

HIDDEN = 512
NUM_TOPK = 8
MAX_TOKENS = 64
SEED = 31
GPU_TIMEOUT_SECS = 60

V2_KERNEL_NAMES = ("dispatch_impl", "dispatch_copy_epilogue_impl", "combine_impl", "combine_reduce_epilogue_impl")
DISPATCH_ROWS = {
    "dispatch_impl": 1,
    "dispatch_copy_epilogue_impl": 1,
    "combine_impl": 0,
    "combine_reduce_epilogue_impl": 0,
}
PUSH_COMBINE_ROWS = {
    "dispatch_impl": 0,
    "dispatch_copy_epilogue_impl": 0,
    "combine_impl": 1,
    "combine_reduce_epilogue_impl": 1,
}
# The zero-copy combine is one kernel: no reduce row (V2's script then reads a reduce time of 0).
PULL_COMBINE_ROWS = {
    "dispatch_impl": 0,
    "dispatch_copy_epilogue_impl": 0,
    "combine_impl": 1,
    "combine_reduce_epilogue_impl": 0,
}


def _num_experts(num_ranks: int) -> int:
    """At least K experts, several per rank: a token often has more than one lane on a rank."""
    return max(16, 4 * num_ranks)


def _ranks_per_node(num_ranks: int) -> list[int | None]:
    """None (direct mode), then the virtual-node sizes of the hybrid runs."""
    return [None] + {2: [1], 4: [2], 8: [4, 2]}.get(num_ranks, [])


class _Inputs:
    """Every rank's tokens, routing and lane outputs, and the biases, on this rank's device."""

    def __init__(self, num_ranks: int) -> None:
        self.num_experts = _num_experts(num_ranks)
        self.num_local = self.num_experts // num_ranks
        data = make_group_inputs(
            num_ranks, MAX_TOKENS, HIDDEN, self.num_experts, NUM_TOPK, seed=SEED, with_weights=False
        )
        dev = device()
        self.xs = [x.to(dev) for x in data.x]
        self.topk_idxs = [idx.to(dev) for idx in data.topk_idx]
        generator = torch.Generator().manual_seed(SEED + 1)
        self.lanes = [make_lane_outputs(idx, HIDDEN, generator).to(dev) for idx in data.topk_idx]
        self.biases = {0: [None] * num_ranks}
        for count in (1, 2):
            terms = [
                [
                    make_lane_outputs(torch.zeros(n, 1, dtype=torch.int64), HIDDEN, generator)[:, 0].to(dev)
                    for n in data.num_tokens
                ]
                for _ in range(count)
            ]
            self.biases[count] = [term[0] if count == 1 else (term[0], term[1]) for term in zip(*terms, strict=True)]


def _combine_input(inputs: _Inputs, rank: int, handle: Any, do_expand: bool) -> torch.Tensor:
    """This rank's combine input from the lane outputs, placed by the handle's row arrays (as V2's
    test places its inputs through ``recv_src_metadata``)."""
    info = handle.recv_src_info[: handle.num_recv_tokens].long()
    if not do_expand:
        return combine_inputs_from_lanes(inputs.lanes, inputs.topk_idxs, info[:, 0], info[:, 1], rank, inputs.num_local)
    expanded_rows = handle.recv_expanded_row_idx[: handle.num_recv_tokens].long()
    x = torch.zeros(handle.num_expanded_tokens, HIDDEN, dtype=torch.bfloat16, device=device())
    for source, lanes in enumerate(inputs.lanes):
        mine = info[:, 0] == source
        token_lanes = lanes[info[mine, 1]]
        rows = expanded_rows[mine]
        used = rows >= 0
        x[rows[used]] = token_lanes[used]
    return x


def _v2_order_cases(buffer: Any, inputs: _Inputs, rank: int, num_ranks: int, ranks_per_node: int | None) -> dict:
    """Combines of every kind this buffer runs against V2's order; ``differs``: whether some result
    would have other bits in ascending rank order."""
    failures, differs = [], False
    mode = "direct" if ranks_per_node is None else f"{num_ranks // ranks_per_node}x{ranks_per_node} nodes"
    kinds = [("plain", False, False), ("expand", True, False)]
    if ranks_per_node is None:
        kinds.append(("zero-copy", False, True))
    for kind, do_expand, zero_copy in kinds:
        dispatched = buffer.dispatch(
            inputs.xs[rank],
            inputs.topk_idxs[rank],
            num_experts=inputs.num_experts,
            num_max_tokens_per_rank=MAX_TOKENS,
            do_expand=do_expand,
            zero_copy_recv=zero_copy,
        )
        handle = dispatched[3]
        rows = _combine_input(inputs, rank, handle, do_expand)
        for num_biases, biases in inputs.biases.items():
            x = rows
            if zero_copy:
                x = buffer.get_combine_input_buffer(handle)
                x.copy_(rows)
            combined, _, _ = buffer.combine(x, handle, bias=biases[rank], zero_copy=zero_copy)
            order = {} if ranks_per_node is None else {"num_ranks_per_node": ranks_per_node}
            lanes, topk_idx = inputs.lanes[rank], inputs.topk_idxs[rank]
            want = v2_combine(lanes, topk_idx, inputs.num_experts, num_ranks, bias=biases[rank], **order)
            try:
                assert_bitwise_equal(f"{mode}, {kind} combine, {num_biases} biases", combined, want)
            except AssertionError as error:
                failures.append(str(error))
            sorted_lanes, sorted_idx = lanes_by_rank(lanes, topk_idx, inputs.num_local)
            ascending = v2_combine(sorted_lanes, sorted_idx, inputs.num_experts, num_ranks, bias=biases[rank], **order)
            differs |= not torch.equal(ascending, want)
    return {"failures": failures, "differs": differs}


def _profiled_name_rows(run) -> dict[str, int]:
    """How many rows of the profiler's table (as V2's bench_kineto prints it) contain each V2 name
    while ``run()`` runs."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    lines = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
    return {name: sum(name in line for line in lines) for name in V2_KERNEL_NAMES}


def _kernel_name_cases(buffer: Any, inputs: _Inputs, rank: int, ranks_per_node: int | None) -> list[str]:
    """Each kind of dispatch and combine profiled alone: every V2 name in exactly the rows V2 expects."""
    failures = []
    mode = "direct" if ranks_per_node is None else f"{ranks_per_node} ranks per node"

    def expect(what: str, run, wanted: dict[str, int]) -> Any:
        result = {}
        counts = _profiled_name_rows(lambda: result.setdefault("value", run()))
        if counts != wanted:
            failures.append(f"{mode}, {what}: rows per V2 kernel name {counts}, expected {wanted}")
        return result["value"]

    def dispatch(**kwargs):
        return buffer.dispatch(
            inputs.xs[rank],
            inputs.topk_idxs[rank],
            num_experts=inputs.num_experts,
            num_max_tokens_per_rank=MAX_TOKENS,
            **kwargs,
        )

    plain = expect("dispatch", dispatch, DISPATCH_ROWS)
    expect("cached dispatch", lambda: buffer.dispatch(inputs.xs[rank], handle=plain[3]), DISPATCH_ROWS)
    expanded = expect("expand dispatch", lambda: dispatch(do_expand=True), DISPATCH_ROWS)
    for what, handle, do_expand in (("combine", plain[3], False), ("expand combine", expanded[3], True)):
        x = _combine_input(inputs, rank, handle, do_expand)
        expect(what, lambda x=x, handle=handle: buffer.combine(x, handle), PUSH_COMBINE_ROWS)
    if ranks_per_node is None:
        zero_copy = expect("zero-copy dispatch", lambda: dispatch(zero_copy_recv=True), DISPATCH_ROWS)
        x = buffer.get_combine_input_buffer(zero_copy[3])
        x.copy_(_combine_input(inputs, rank, zero_copy[3], False))
        expect("zero-copy combine", lambda: buffer.combine(x, zero_copy[3], zero_copy=True), PULL_COMBINE_ROWS)
    return failures


def _rank_main(rank: int, num_ranks: int, group: Any) -> dict:
    inputs = _Inputs(num_ranks)
    results: dict[str, Any] = {"order": {}, "names": {}}
    for ranks_per_node in _ranks_per_node(num_ranks):
        if ranks_per_node is None:
            buffer = make_buffer(
                group, MAX_TOKENS, HIDDEN, NUM_TOPK, zero_copy_combine=True, num_gpu_timeout_secs=GPU_TIMEOUT_SECS
            )
        else:
            buffer = make_buffer(
                group,
                MAX_TOKENS,
                HIDDEN,
                NUM_TOPK,
                num_ranks_per_node=ranks_per_node,
                allow_hybrid_mode=True,
                num_gpu_timeout_secs=GPU_TIMEOUT_SECS,
            )
        try:
            wanted_mode = "direct" if ranks_per_node is None else "hybrid"
            assert buffer.ht_mode == wanted_mode, f"ht_mode {buffer.ht_mode!r}, expected {wanted_mode!r}"
            results["order"][ranks_per_node] = _v2_order_cases(buffer, inputs, rank, num_ranks, ranks_per_node)
            results["names"][ranks_per_node] = _kernel_name_cases(buffer, inputs, rank, ranks_per_node)
        finally:
            buffer.destroy()
    return results


def _results(num_ranks: int) -> list[dict]:
    return launch_once(_rank_main, num_ranks)


def test_combine_sums_in_deep_ep_v2_order_bitwise(num_ranks):
    results = _results(num_ranks)
    failures = [
        f"rank {rank}: {line}"
        for rank, result in enumerate(results)
        for cases in result["order"].values()
        for line in cases["failures"]
    ]
    assert not failures, "\n".join(failures)
    if num_ranks >= 2:
        assert any(cases["differs"] for result in results for cases in result["order"].values()), (
            "the data should give other bits in ascending rank order"
        )


def test_ht_kernels_carry_deep_ep_v2_names_for_the_profiler(num_ranks):
    results = _results(num_ranks)
    failures = [
        f"rank {rank}: {line}"
        for rank, result in enumerate(results)
        for lines in result["names"].values()
        for line in lines
    ]
    assert not failures, "\n".join(failures)
