"""Shared pieces of the HT GPU tests: buffers, bitwise comparisons, group inputs on the device,
expert stand-ins and the reference run of one case."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

import deep_ep
from deep_ep.fp8 import per_token_cast_back
from deep_ep.testing.data import make_group_inputs, make_tokens
from deep_ep.testing.reference import ht_combine, ht_dispatch
from deep_ep.testing.reference_ht import ht_expanded_row_idx, ht_src_info, v2_recv_src_metadata
from deep_ep.testing.reference_v2 import v2_psum_num_recv_tokens_per_scaleup_rank

# One buffer serves every case of a launch: sized for the largest (bf16 is the larger payload).
MAX_TOKENS = 4096
MAX_HIDDEN = 7168
MAX_TOPK = 8


def make_buffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=MAX_HIDDEN, num_topk=MAX_TOPK, **kwargs):
    return deep_ep.ElasticBuffer(
        group,
        num_max_tokens_per_rank=num_max_tokens_per_rank,
        hidden=hidden,
        num_topk=num_topk,
        explicitly_destroy=True,
        **kwargs,
    )


@contextlib.contextmanager
def emulated_ranks_per_node(per_node: int) -> Iterator[None]:
    """EP_EMULATE_RANKS_PER_NODE set to ``per_node`` (virtual nodes) for the buffers built inside,
    restored after."""
    previous = os.environ.get("EP_EMULATE_RANKS_PER_NODE")
    os.environ["EP_EMULATE_RANKS_PER_NODE"] = str(per_node)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("EP_EMULATE_RANKS_PER_NODE", None)
        else:
            os.environ["EP_EMULATE_RANKS_PER_NODE"] = previous


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(view)


def assert_bitwise_equal(name: str, actual, expected) -> None:
    if expected is None:
        assert actual is None, f"{name}: expected None, got a tensor"
        return
    assert actual is not None, f"{name}: expected a tensor, got None"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {list(actual.shape)}, expected {list(expected.shape)}"
    )
    got, want = _bits(actual), _bits(expected.to(actual.device))
    if not torch.equal(got, want):
        differ = (got != want).nonzero()
        first = tuple(differ[0].tolist())
        raise AssertionError(
            f"{name}: {differ.shape[0]} elements differ, first at {list(first)}: "
            f"got {actual[first].item()!r}, expected {expected.to(actual.device)[first].item()!r}"
        )


def split(x):
    """(data, scales or None) of a dispatch input or output."""
    return (x[0], x[1]) if isinstance(x, (tuple, list)) else (x, None)


def expert_output(received, dest: int, scale: bool) -> torch.Tensor:
    """What the tests' "expert" returns for the rows rank ``dest`` received: the bf16 rows
    (dequantized for fp8), optionally scaled by a per-rank factor so ranks contribute different
    values. Elementwise, so the same on every rank and bitwise reproducible."""
    data, scales = split(received)
    rows = per_token_cast_back(data, scales) if scales is not None else data
    if scale:
        rows = (rows.float() * (1.0 + 0.25 * dest)).to(torch.bfloat16)
    return rows


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    num_topk: int
    num_experts: int  # -1: one expert per rank
    num_max_tokens: int
    use_fp8: bool
    do_expand: bool = False
    expert_alignment: int = 1
    num_biases: int = 0
    with_weights: bool = True
    hot_expert: int | None = None
    scale_outputs: bool = True  # False: identity experts (dispatch -> combine round trip)
    seed: int = 0

    def experts(self, num_ranks: int) -> int:
        return num_ranks if self.num_experts < 0 else self.num_experts

    def topk(self, num_ranks: int) -> int:
        return min(self.num_topk, self.experts(num_ranks))


@dataclass
class GroupOnDevice:
    xs: list
    topk_idxs: list[torch.Tensor]
    weights: list[torch.Tensor] | None
    num_tokens: list[int]


def group_inputs(case: Case, num_ranks: int) -> GroupOnDevice:
    data = make_group_inputs(
        num_ranks,
        case.num_max_tokens,
        case.hidden,
        case.experts(num_ranks),
        case.topk(num_ranks),
        seed=case.seed,
        use_fp8=case.use_fp8,
        with_weights=case.with_weights,
        hot_expert=case.hot_expert,
    )
    dev = device()
    xs = [(x[0].to(dev), x[1].to(dev)) if isinstance(x, tuple) else x.to(dev) for x in data.dispatch_xs]
    weights = None if data.topk_weights is None else [w.to(dev) for w in data.topk_weights]
    return GroupOnDevice(xs, [t.to(dev) for t in data.topk_idx], weights, list(data.num_tokens))


def group_biases(case: Case, num_tokens: list[int]) -> list | None:
    if case.num_biases == 0:
        return None
    generator = torch.Generator().manual_seed(10_000 + case.seed)
    biases = []
    for count in num_tokens:
        terms = [make_tokens(count, case.hidden, generator).to(device()) for _ in range(case.num_biases)]
        biases.append(terms[0] if case.num_biases == 1 else tuple(terms))
    return biases


def check_src_metadata(
    case: Case, rank: int, inputs: GroupOnDevice, handle, num_ranks_per_node: int | None = None
) -> None:
    """The handle's per-row source arrays bitwise against the reference: ``recv_src_info`` (what
    combine reads; ``j`` counted within the node in hybrid mode, ``num_ranks_per_node``), the
    expand row map, and DeepEP V2's ``recv_src_metadata`` built from them. A handle without CPU
    sync is compared on its received rows only (the rest of its worst-case rows is undefined)."""
    num_experts = case.experts(len(inputs.topk_idxs))
    num_topk = inputs.topk_idxs[rank].shape[1]
    info = ht_src_info(inputs.topk_idxs, num_experts, num_ranks_per_node=num_ranks_per_node)[rank]
    expanded = None
    if case.do_expand:
        expanded = ht_expanded_row_idx(inputs.topk_idxs, num_experts, expert_alignment=case.expert_alignment)[rank]
    metadata = v2_recv_src_metadata(info, num_topk, case.num_max_tokens, expanded)
    rows = slice(None) if handle.is_exact else slice(0, info.shape[0])
    assert_bitwise_equal("recv_src_info", handle.recv_src_info[rows], info)
    if case.do_expand:
        assert_bitwise_equal("recv_expanded_row_idx", handle.recv_expanded_row_idx[rows], expanded)
    else:
        assert handle.recv_expanded_row_idx is None, "recv_expanded_row_idx without expand"
    assert_bitwise_equal("recv_src_metadata (DeepEP V2 layout)", handle.recv_src_metadata[rows], metadata)


def check_dispatch(
    case: Case,
    rank: int,
    expected: dict,
    outputs: tuple,
    inputs: GroupOnDevice,
    num_ranks_per_node: int | None = None,
) -> None:
    """One rank's dispatch outputs and handle against the reference (``expected``: its
    ``ht_dispatch`` result; ``inputs``: the group's, for the handle's source arrays)."""
    recv_x, recv_topk_idx, recv_topk_weights, handle, _ = outputs
    data, scales = split(recv_x)
    assert_bitwise_equal("recv_x", data, expected["x"])
    assert_bitwise_equal("recv_x scales", scales, expected["x_scales"])
    assert_bitwise_equal("recv_topk_weights", recv_topk_weights, expected["topk_weights"])
    stats = handle.stats
    assert stats["tokens_per_source_rank"].tolist() == expected["num_recv_tokens_per_rank"], "tokens per source rank"
    assert stats["tokens_per_local_expert"].tolist() == expected["num_recv_tokens_per_expert"], "tokens per expert"
    assert handle.num_recv_tokens_per_expert_list == expected["num_recv_tokens_per_expert_aligned"], "aligned counts"
    psum = torch.tensor(expected["num_recv_tokens_per_rank"]).cumsum(0).tolist()
    assert handle.psum_num_recv_tokens_per_source.tolist() == psum, "psum per source rank"
    # DeepEP V2's field: per scale-up peer (summed over nodes) in hybrid mode, per rank in direct mode.
    v2_psum = v2_psum_num_recv_tokens_per_scaleup_rank(
        inputs.topk_idxs, case.experts(len(inputs.topk_idxs)), rank, num_ranks_per_node
    )
    peer_psum = handle.psum_num_recv_tokens_per_scaleup_rank
    assert peer_psum.dtype == torch.int32 and peer_psum.device == handle.counts.device, "V2 psum dtype/device"
    assert peer_psum.tolist() == v2_psum, f"psum per scale-up peer {peer_psum.tolist()}, V2 {v2_psum}"
    assert handle.num_recv_tokens == sum(expected["num_recv_tokens_per_rank"]), "num_recv_tokens"
    if case.do_expand:
        assert recv_topk_idx is None, "expand mode returns no recv_topk_idx"
        assert handle.num_expanded_tokens == expected["x"].shape[0], "num_expanded_tokens"
    else:
        assert_bitwise_equal("recv_topk_idx", recv_topk_idx, expected["topk_idx"])
        info = handle.recv_src_info
        assert_bitwise_equal("recv_src_info source rank", info[:, 0].long(), expected["src_rank"])
        assert_bitwise_equal("recv_src_info source token", info[:, 1].long(), expected["src_token"])
    check_src_metadata(case, rank, inputs, handle, num_ranks_per_node)


def run_case(
    buffer,
    rank: int,
    num_ranks: int,
    case: Case,
    *,
    inputs: GroupOnDevice | None = None,
    num_ranks_per_node: int | None = None,
    check_handle=None,
) -> None:
    """Dispatch and combine one case on this rank; compare both bitwise with the reference.

    ``inputs`` replaces the seeded group inputs of ``case`` (e.g. other routing); ``num_ranks_per_node``
    (hybrid mode) selects the reference's hierarchical combine order (None: direct order);
    ``check_handle(inputs, handle)`` runs extra checks on the dispatch's handle."""
    try:
        group = group_inputs(case, num_ranks) if inputs is None else inputs
        num_experts = case.experts(num_ranks)
        reference = ht_dispatch(
            group.xs,
            group.topk_idxs,
            group.weights,
            num_experts,
            expert_alignment=case.expert_alignment,
            do_expand=case.do_expand,
        )
        outputs = buffer.dispatch(
            group.xs[rank],
            group.topk_idxs[rank],
            None if group.weights is None else group.weights[rank],
            num_experts=num_experts,
            num_max_tokens_per_rank=case.num_max_tokens,
            expert_alignment=case.expert_alignment,
            do_expand=case.do_expand,
        )
        check_dispatch(case, rank, reference[rank], outputs, group, num_ranks_per_node)
        if check_handle is not None:
            check_handle(group, outputs[3])

        ys = [
            expert_output((r["x"], r["x_scales"]) if r["x_scales"] is not None else r["x"], dest, case.scale_outputs)
            for dest, r in enumerate(reference)
        ]
        weights_list = None if group.weights is None else [r["topk_weights"] for r in reference]
        biases = group_biases(case, group.num_tokens)
        # The keyword only when asked for: the direct callers use the reference exactly as before.
        order = {} if num_ranks_per_node is None else {"num_ranks_per_node": num_ranks_per_node}
        expected = ht_combine(
            reference,
            ys,
            group.topk_idxs,
            num_experts,
            weights_list=weights_list,
            biases=biases,
            do_expand=case.do_expand,
            **order,
        )[rank]
        recv_x, _, recv_topk_weights, handle, _ = outputs
        combined, combined_weights, _ = buffer.combine(
            expert_output(recv_x, rank, case.scale_outputs),
            handle,
            topk_weights=recv_topk_weights,
            bias=None if biases is None else biases[rank],
        )
        assert_bitwise_equal("combined_x", combined, expected["x"])
        assert_bitwise_equal("combined_topk_weights", combined_weights, expected["topk_weights"])
    except AssertionError as error:
        raise AssertionError(f"case '{case.name}' (rank {rank} of {num_ranks}): {error}") from error


def dispatch_case(buffer, rank: int, case: Case, inputs, **kwargs):
    """One rank's dispatch of ``case`` with ``inputs`` (xs, topk_idxs, weights per rank); with
    ``handle=`` a cached dispatch (routing and settings come from the handle)."""
    weights = None if inputs.weights is None else inputs.weights[rank]
    if "handle" in kwargs:
        return buffer.dispatch(inputs.xs[rank], topk_weights=weights, **kwargs)
    return buffer.dispatch(
        inputs.xs[rank],
        inputs.topk_idxs[rank],
        weights,
        num_experts=case.experts(len(inputs.xs)),
        num_max_tokens_per_rank=case.num_max_tokens,
        expert_alignment=case.expert_alignment,
        do_expand=case.do_expand,
        **kwargs,
    )


def assert_outputs_equal(name: str, got: tuple, want: tuple, num_rows: int | None = None) -> None:
    """Bitwise equality of two dispatch results, on the first num_rows rows when given."""
    rows = slice(None) if num_rows is None else slice(0, num_rows)
    for part, actual, expected in (
        ("recv_x", split(got[0])[0], split(want[0])[0]),
        ("scales", split(got[0])[1], split(want[0])[1]),
        ("recv_topk_idx", got[1], want[1]),
        ("recv_topk_weights", got[2], want[2]),
    ):
        if expected is None:
            assert actual is None, f"{name}: {part} should be None"
            continue
        assert_bitwise_equal(f"{name}: {part}", actual[rows], expected[rows])


def keep_compute_stream_busy() -> None:
    """Work on the caller's stream while the communication stream runs."""
    busy = torch.randn(2048, 2048, device=device())
    for _ in range(4):
        busy = busy @ busy / 2048
