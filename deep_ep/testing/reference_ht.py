"""Reference model of high-throughput dispatch and combine for a whole EP group.

Notation: R ranks, E experts, L = E / R local experts; expert ``e`` lives on rank ``e // L`` with
local id ``e % L``. Inputs are lists indexed by rank; outputs are one dict per rank. The GPU
kernels are compared bitwise against these results, so every ordering and every fp32 operation
below is part of the contract (see the ``ht_dispatch`` and ``ht_combine`` docstrings). Routing is
taken through ``sanitize_topk_idx``: an id outside ``[-1, E)`` or repeated within its row (after
its first slot) is -1 everywhere below, as in the library.
"""

from collections.abc import Callable

import torch

from deep_ep._util import align_up, describe
from deep_ep.testing.reference_inputs import (
    GroupInputs,
    TokenInput,
    check_group,
    check_topk_idx,
    local_expert_ids,
    num_local_experts,
    sanitize_topk_idx,
)

__all__ = [
    "ht_dispatch",
    "ht_combine",
    "ht_src_info",
    "ht_expanded_row_idx",
    "last_lanes",
    "v2_recv_src_metadata",
]

BiasInput = torch.Tensor | tuple[torch.Tensor | None, ...] | list[torch.Tensor | None] | None


def ht_dispatch(
    xs: list[TokenInput],
    topk_idxs: list[torch.Tensor],
    topk_weights_list: list[torch.Tensor] | None,
    num_experts: int,
    *,
    expert_alignment: int = 1,
    do_expand: bool = False,
) -> list[dict]:
    """What every destination rank receives.

    Token ``t`` of source ``s`` goes to rank ``d`` once if any of its experts lives on ``d``
    (routing sanitised: a repeated or out-of-range id is -1). Non-expand: rows ordered by
    ``(s, t)``; keys ``x``, ``x_scales`` (None for bf16), ``topk_idx`` (local ids, -1 for experts
    elsewhere and for sanitised slots), ``topk_weights`` (the full source row unchanged, or None),
    ``src_rank``, ``src_token``. Expand: one row per (token, local expert), grouped by local
    expert, group ``l`` starting at the sum of the aligned sizes of groups ``< l``, rows inside
    a group ordered by ``(s, t)``; padding rows are zero with ``src_rank = src_token =
    local_expert = -1``; ``topk_weights`` is 1-D (that pair's weight). Both carry
    ``num_recv_tokens_per_rank`` [R], ``num_recv_tokens_per_expert`` [L] (unaligned) and
    ``num_recv_tokens_per_expert_aligned`` [L].
    """
    if expert_alignment < 1:
        raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")
    group = check_group(xs, topk_idxs, topk_weights_list, num_experts)
    build = _dispatch_expanded if do_expand else _dispatch_rows
    return [build(group, rank, expert_alignment) for rank in range(group.num_ranks)]


def _received_tokens(group: GroupInputs, source: int, dest: int) -> torch.Tensor:
    return _received_by(group.topk_idx[source], dest, group.num_local_experts)


def _count_lists(group: GroupInputs, dest: int, per_expert: list[int], alignment: int) -> dict:
    return {
        "num_recv_tokens_per_rank": [
            _received_tokens(group, source, dest).numel() for source in range(group.num_ranks)
        ],
        "num_recv_tokens_per_expert": per_expert,
        "num_recv_tokens_per_expert_aligned": [align_up(count, alignment) for count in per_expert],
    }


def _dispatch_rows(group: GroupInputs, dest: int, alignment: int) -> dict:
    x, scales, topk_idx, weights, src_rank, src_token = [], [], [], [], [], []
    for source in range(group.num_ranks):
        tokens = _received_tokens(group, source, dest)
        x.append(group.data[source][tokens])
        if group.scales is not None:
            scales.append(group.scales[source][tokens])
        topk_idx.append(local_expert_ids(group.topk_idx[source], dest, group.num_local_experts)[tokens])
        if group.topk_weights is not None:
            weights.append(group.topk_weights[source][tokens])
        src_rank.append(torch.full_like(tokens, source))
        src_token.append(tokens)
    recv_topk_idx = torch.cat(topk_idx)
    # Sanitised ids in a row are distinct, so counting matches is counting the rows that hold each local expert.
    per_expert = [int((recv_topk_idx == local).sum()) for local in range(group.num_local_experts)]
    return {
        "x": torch.cat(x).view(group.payload_dtype),
        "x_scales": torch.cat(scales) if group.scales is not None else None,
        "topk_idx": recv_topk_idx,
        "topk_weights": torch.cat(weights) if group.topk_weights is not None else None,
        "src_rank": torch.cat(src_rank),
        "src_token": torch.cat(src_token),
        **_count_lists(group, dest, per_expert, alignment),
    }


def _dispatch_expanded(group: GroupInputs, dest: int, alignment: int) -> dict:
    # pieces[l] = per source (tokens, slots) of the tokens that selected local expert l.
    pieces = []
    for local in range(group.num_local_experts):
        expert = dest * group.num_local_experts + local
        pieces.append([(group.topk_idx[source] == expert).nonzero(as_tuple=True) for source in range(group.num_ranks)])
    per_expert = [sum(tokens.numel() for tokens, _ in per_source) for per_source in pieces]
    counts = _count_lists(group, dest, per_expert, alignment)
    num_rows = sum(counts["num_recv_tokens_per_expert_aligned"])

    device, hidden = group.device, group.hidden
    x = torch.zeros(num_rows, hidden, dtype=group.data[0].dtype, device=device)
    scales = None
    if group.scales is not None:
        scales = torch.zeros(num_rows, group.scales[0].shape[1], dtype=torch.float32, device=device)
    weights = None if group.topk_weights is None else torch.zeros(num_rows, dtype=torch.float32, device=device)
    src_rank, src_token, local_expert = (
        torch.full((num_rows,), -1, dtype=torch.int64, device=device) for _ in range(3)
    )

    offset = 0
    for local, per_source in enumerate(pieces):
        row = offset
        for source, (tokens, slots) in enumerate(per_source):
            rows = slice(row, row + tokens.numel())
            x[rows] = group.data[source][tokens]
            if scales is not None:
                scales[rows] = group.scales[source][tokens]
            if weights is not None:
                weights[rows] = group.topk_weights[source][tokens, slots]
            src_rank[rows] = source
            src_token[rows] = tokens
            local_expert[rows] = local
            row += tokens.numel()
        offset += counts["num_recv_tokens_per_expert_aligned"][local]
    return {
        "x": x.view(group.payload_dtype),
        "x_scales": scales,
        "topk_weights": weights,
        "src_rank": src_rank,
        "src_token": src_token,
        "local_expert": local_expert,
        **counts,
    }


def ht_src_info(
    topk_idxs: list[torch.Tensor], num_experts: int, *, num_ranks_per_node: int | None = None
) -> list[torch.Tensor]:
    """What dispatch keeps of each received row for combine (``EPHandle.recv_src_info``): one int32
    ``[N, 4]`` per destination rank ``d``, rows in the non-expand order (source rank, source token)
    whatever the dispatch mode. Columns: source rank ``s``, source token ``t``, ``j`` and the
    master lane.

    ``j`` is the row's combine slot at the source: the number of the token's distinct destination
    ranks below ``d``, counted over all ranks in direct mode (``num_ranks_per_node`` None or R) and
    over the ranks of ``d``'s node in hybrid mode (``num_ranks_per_node = S``: rank ``d`` is on node
    ``d // S``, whose forwarder sums them). The master lane is the first top-k slot ``k`` whose
    expert lives on ``d`` (DeepEP V2's ``master_src_topk_idx``). Routing is sanitised as in
    ``ht_dispatch``.
    """
    routing, num_local = _sanitized_routing(topk_idxs, num_experts)
    num_ranks = len(routing)
    node_size = _check_num_ranks_per_node(num_ranks_per_node, num_ranks)
    results = []
    for dest in range(num_ranks):
        scope_first = dest // node_size * node_size
        pieces = []
        for source, topk_idx in enumerate(routing):
            tokens = _received_by(topk_idx, dest, num_local)
            selected = topk_idx[tokens]
            expert_rank = torch.where(selected >= 0, selected // num_local, torch.full_like(selected, -1))
            # visits[i, r]: row i's token goes to rank r (once, however many of its experts r holds).
            all_ranks = torch.arange(num_ranks, device=selected.device)
            visits = (expert_rank.unsqueeze(2) == all_ranks).any(dim=1)
            combine_row = visits[:, scope_first:dest].sum(dim=1)
            # The smallest slot whose expert is on dest (every received token has one).
            lanes = torch.arange(selected.shape[1], device=selected.device).expand_as(selected)
            master_lane = torch.where(expert_rank == dest, lanes, selected.shape[1]).min(dim=1).values
            pieces.append(torch.stack([torch.full_like(tokens, source), tokens, combine_row, master_lane], dim=1))
        results.append(torch.cat(pieces).to(torch.int32))
    return results


def ht_expanded_row_idx(
    topk_idxs: list[torch.Tensor], num_experts: int, *, expert_alignment: int = 1
) -> list[torch.Tensor]:
    """``EPHandle.recv_expanded_row_idx`` of an expand dispatch: one int32 ``[N, K]`` per destination
    rank, rows in the non-expand order (as ``ht_src_info``): entry ``[i, k]`` is the row of the
    expand output (``ht_dispatch(..., do_expand=True)``) holding received row ``i`` for the expert
    of slot ``k``, -1 where that expert lives elsewhere (or the slot is -1 after sanitising).
    """
    if expert_alignment < 1:
        raise ValueError(f"expert_alignment must be >= 1, got {expert_alignment}")
    routing, num_local = _sanitized_routing(topk_idxs, num_experts)
    results = []
    for dest in range(len(routing)):
        local_ids = torch.cat(
            [
                local_expert_ids(topk_idx, dest, num_local)[_received_by(topk_idx, dest, num_local)]
                for topk_idx in routing
            ]
        )
        expanded = torch.full(local_ids.shape, -1, dtype=torch.int32, device=local_ids.device)
        group_start = 0
        for local in range(num_local):
            # Group ``local`` lists its rows in received-row order, (source, token) ascending.
            rows, slots = (local_ids == local).nonzero(as_tuple=True)
            expanded[rows, slots] = torch.arange(
                group_start, group_start + rows.numel(), dtype=torch.int32, device=local_ids.device
            )
            group_start += align_up(rows.numel(), expert_alignment)
        results.append(expanded)
    return results


def v2_recv_src_metadata(
    src_info: torch.Tensor,
    num_topk: int,
    num_max_tokens_per_rank: int,
    expanded_row_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepEP V2's ``recv_src_metadata`` of one rank (``EPHandle.recv_src_metadata``): int32
    ``[N, K + 2]`` from that rank's ``ht_src_info`` rows. Column 0: the source's global token id
    ``s * T_max + t``; column 1: ``s * K + master lane``; columns ``2 .. K + 1``: the expand dispatch's
    ``expanded_row_idx`` rows (``ht_expanded_row_idx``), or -1 everywhere without it (non-expand)."""
    num_rows = src_info.shape[0]
    if src_info.dim() != 2 or src_info.shape[1] != 4:
        raise ValueError(f"src_info must be [N, 4] (ht_src_info), got {describe(src_info)}")
    if expanded_row_idx is not None and list(expanded_row_idx.shape) != [num_rows, num_topk]:
        raise ValueError(f"expanded_row_idx must be [{num_rows}, {num_topk}], got {describe(expanded_row_idx)}")
    info = src_info.to(torch.int64)
    global_token = info[:, 0] * num_max_tokens_per_rank + info[:, 1]
    master = info[:, 0] * num_topk + info[:, 3]
    if expanded_row_idx is None:
        lanes = torch.full((num_rows, num_topk), -1, dtype=torch.int64, device=src_info.device)
    else:
        lanes = expanded_row_idx.to(torch.int64)
    return torch.cat([global_token.unsqueeze(1), master.unsqueeze(1), lanes], dim=1).to(torch.int32)


def _sanitized_routing(topk_idxs: list[torch.Tensor], num_experts: int) -> tuple[list[torch.Tensor], int]:
    """Every rank's sanitised routing and L, with the checks ``ht_dispatch`` applies to it."""
    num_local = num_local_experts(num_experts, len(topk_idxs))
    num_topk = topk_idxs[0].shape[-1]
    for rank, topk_idx in enumerate(topk_idxs):
        check_topk_idx(f"topk_idxs[{rank}]", topk_idx, topk_idx.shape[0])
        if topk_idx.shape[1] != num_topk:
            raise ValueError(f"topk_idxs[{rank}] must have K={num_topk} like topk_idxs[0], got {describe(topk_idx)}")
    return [sanitize_topk_idx(topk_idx, num_experts) for topk_idx in topk_idxs], num_local


def _received_by(topk_idx: torch.Tensor, dest: int, num_local: int) -> torch.Tensor:
    """Tokens of one source (sanitised routing) that go to ``dest``, ascending."""
    return (local_expert_ids(topk_idx, dest, num_local) >= 0).any(dim=1).nonzero().squeeze(1)


def ht_combine(
    dispatch_results: list[dict],
    ys: list[torch.Tensor],
    topk_idxs: list[torch.Tensor],
    num_experts: int,
    *,
    weights_list: list[torch.Tensor] | None = None,
    biases: list[BiasInput] | None = None,
    do_expand: bool = False,
    num_ranks_per_node: int | None = None,
) -> list[dict]:
    """What combine returns on every source rank: ``{"x": bf16 [T, H], "topk_weights": fp32 [T, K] or None}``.

    The order is DeepEP V2's reference combine (``deep_ep/utils/refs.py``: ``combine`` with
    ``reduce_in_local``, plus ``reduce_in_scaleup`` in hybrid mode, then ``ordered_accumulate``),
    on the sanitised routing. Lane ``k`` of a token is its top-k slot ``k``; an owner's *last lane*
    is the highest lane whose expert it holds (a rank ``e // L``, or a node ``e // (L * S)``).

    ``ys[d]`` holds one bf16 row per row of ``dispatch_results[d]`` (expand padding is ignored).
    The contribution ``c_d`` of destination rank ``d`` to a token is the received row
    (non-expand) or, in expand mode, the fp32 sum (from 0.0) of the token's rows at that rank
    in lane order, rounded to bf16 because that partial travels as bf16.

    Direct order (``num_ranks_per_node`` None or R), per token, in fp32 starting at 0.0: add
    ``bias0``, then ``bias1``, then ``c_d`` of each of the token's destination ranks in ascending
    order of ``d``'s last lane, then round to bf16 once (nearest even).

    Hybrid order (``num_ranks_per_node = S < R``; rank ``d`` is on node ``d // S``), per token:
    the partial of node ``n`` is ``P_n = bf16(((0.0 + c_d0) + c_d1) + ...)`` over the token's
    destination ranks on ``n`` in ascending order of their last lanes (fp32, rounded once: the
    partial travels back over scale-out as bf16), defined only for nodes holding one of the token's
    experts; then, in fp32 from 0.0: ``bias0``, ``bias1``, ``P_n`` for each such node in ascending
    order of ``n``'s last lane, and one rounding to bf16. With S = 1 every partial is its rank's
    ``c_d``, so the result equals the direct order's.

    V2 starts from ``bias0 + bias1`` rather than 0.0 and adds zero lanes too: the same bits (only
    the sign of a zero sum could differ, and neither form ends in -0.0). A repeated expert id is -1
    after sanitising, so its lane is no lane of its rank (V2's reference would add such a lane's
    output twice; the library counts it once and reports the id).

    Combined weights (both orders): slot ``k`` is read from the rank owning expert
    ``topk_idx[t, k]`` (0.0 where it is -1, which includes a repeated or out-of-range id: the
    routing is sanitised as in ``ht_dispatch``).
    """
    num_ranks = len(topk_idxs)
    num_local = num_local_experts(num_experts, num_ranks)
    node_size = _check_num_ranks_per_node(num_ranks_per_node, num_ranks)
    _check_combine_inputs(dispatch_results, ys, weights_list, biases, num_ranks, do_expand)
    hidden = ys[0].shape[1]
    results = []
    for source in range(num_ranks):
        check_topk_idx(f"topk_idxs[{source}]", topk_idxs[source], topk_idxs[source].shape[0])
        topk_idx = sanitize_topk_idx(topk_idxs[source], num_experts)
        row_of = [
            _row_lookup(dispatch_results[dest], source, topk_idx.shape[0], num_local, do_expand)
            for dest in range(num_ranks)
        ]
        acc = torch.zeros(topk_idx.shape[0], hidden, dtype=torch.float32, device=ys[0].device)
        for bias in _bias_terms(biases, source, topk_idx.shape[0], hidden):
            acc = acc + bias.float()
        for dest in range(num_ranks):
            _check_lookup_matches_routing(row_of[dest], topk_idx, source, dest, num_local, do_expand)
        acc = _add_terms_in_v2_order(acc, ys, row_of, topk_idx, num_local, node_size, do_expand)
        weights = None
        if weights_list is not None:
            weights = _combined_weights(weights_list, row_of, topk_idx, num_local, do_expand)
        results.append({"x": acc.to(torch.bfloat16), "topk_weights": weights})
    return results


def _add_terms_in_v2_order(
    acc: torch.Tensor,
    ys: list[torch.Tensor],
    row_of: list[torch.Tensor],
    topk_idx: torch.Tensor,
    num_local: int,
    node_size: int,
    do_expand: bool,
) -> torch.Tensor:
    """``acc`` plus one source's terms in DeepEP V2's order: its destination ranks' contributions
    (direct), or its node partials (hybrid), each in ascending order of the owner's last lane."""
    lane_rank = torch.where(topk_idx >= 0, topk_idx // num_local, -1)

    def rank_term(dest: int, tokens: torch.Tensor) -> torch.Tensor:
        return _contribution(ys[dest], row_of[dest], topk_idx, dest, num_local, tokens, do_expand)

    if node_size == len(ys):
        return _add_in_lane_order(acc, lane_rank, rank_term)
    lane_node = torch.where(lane_rank >= 0, lane_rank // node_size, -1)

    def node_term(node: int, tokens: torch.Tensor) -> torch.Tensor:
        return _node_partial(node, tokens, lane_rank, lane_node, rank_term, acc.shape[1])

    return _add_in_lane_order(acc, lane_node, node_term)


def last_lanes(lane_owner: torch.Tensor) -> torch.Tensor:
    """bool ``[T, K]``: lane ``k`` holds an owner (>= 0) that no later lane of its token holds."""
    last = lane_owner >= 0
    for lane in range(lane_owner.shape[1] - 1):
        later = lane_owner[:, lane + 1 :] == lane_owner[:, lane : lane + 1]
        last[:, lane] &= ~later.any(dim=1)
    return last


def _add_in_lane_order(
    acc: torch.Tensor, lane_owner: torch.Tensor, term: Callable[[int, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """``acc`` (fp32, a row per token) plus, token by token, the term of each distinct owner in
    ``lane_owner`` (``[T, K]``, -1: none) in ascending order of the owner's last lane: DeepEP V2
    leaves an owner's partial on that lane and sums the lanes in order. ``term(owner, tokens)`` is
    that owner's fp32 term for those tokens (indices into ``acc``'s rows)."""
    last = last_lanes(lane_owner)
    for lane in range(lane_owner.shape[1]):
        owners = lane_owner[:, lane]
        for owner in owners[last[:, lane]].unique().tolist():
            tokens = (last[:, lane] & (owners == owner)).nonzero().squeeze(1)
            acc[tokens] = acc[tokens] + term(owner, tokens)
    return acc


def _node_partial(
    node: int,
    tokens: torch.Tensor,
    lane_rank: torch.Tensor,
    lane_node: torch.Tensor,
    rank_term: Callable[[int, torch.Tensor], torch.Tensor],
    hidden: int,
) -> torch.Tensor:
    """The node partial of ``tokens`` (each with an expert on ``node``): the fp32 sum from 0.0 of
    the node's rank contributions in ascending order of each rank's last lane, rounded to bf16 once
    (returned as fp32)."""
    on_node = torch.where(lane_node[tokens] == node, lane_rank[tokens], -1)
    partial = torch.zeros(tokens.numel(), hidden, dtype=torch.float32, device=lane_rank.device)
    partial = _add_in_lane_order(partial, on_node, lambda dest, picked: rank_term(dest, tokens[picked]))
    return partial.to(torch.bfloat16).float()


def _check_num_ranks_per_node(num_ranks_per_node: int | None, num_ranks: int) -> int:
    """Ranks per node (R for None); S must be a positive divisor of R."""
    if num_ranks_per_node is None:
        return num_ranks
    if not isinstance(num_ranks_per_node, int) or isinstance(num_ranks_per_node, bool):
        raise TypeError(f"num_ranks_per_node must be an int or None, got {type(num_ranks_per_node).__name__}")
    if num_ranks_per_node < 1 or num_ranks % num_ranks_per_node != 0:
        raise ValueError(
            f"num_ranks_per_node must be a positive divisor of num_ranks ({num_ranks}), got {num_ranks_per_node}"
        )
    return num_ranks_per_node


def _check_combine_inputs(
    dispatch_results: list[dict],
    ys: list[torch.Tensor],
    weights_list: list[torch.Tensor] | None,
    biases: list[BiasInput] | None,
    num_ranks: int,
    do_expand: bool,
) -> None:
    for name, value in (("dispatch_results", dispatch_results), ("ys", ys), ("weights_list", weights_list)):
        if value is not None and len(value) != num_ranks:
            raise ValueError(f"{name} must have one entry per rank ({num_ranks}), got {len(value)}")
    if biases is not None and len(biases) != num_ranks:
        raise ValueError(f"biases must have one entry per source rank ({num_ranks}), got {len(biases)}")
    hidden = ys[0].shape[-1]
    for dest, (result, y) in enumerate(zip(dispatch_results, ys, strict=True)):
        if ("local_expert" in result) != do_expand:
            raise ValueError(f"dispatch_results[{dest}] was not built with do_expand={do_expand}")
        num_rows = result["src_rank"].numel()
        if y.dtype != torch.bfloat16 or list(y.shape) != [num_rows, hidden]:
            raise ValueError(f"ys[{dest}] must be bfloat16 [{num_rows}, {hidden}], got {describe(y)}")
        if weights_list is not None:
            expected = [num_rows] if do_expand else [num_rows, result["topk_idx"].shape[1]]
            if weights_list[dest].dtype != torch.float32 or list(weights_list[dest].shape) != expected:
                raise ValueError(f"weights_list[{dest}] must be float32 {expected}, got {describe(weights_list[dest])}")


def _bias_terms(biases: list[BiasInput] | None, source: int, num_tokens: int, hidden: int) -> list[torch.Tensor]:
    bias = None if biases is None else biases[source]
    terms = [bias] if isinstance(bias, torch.Tensor) else [term for term in (bias or ()) if term is not None]
    if len(terms) > 2:
        raise ValueError(f"biases[{source}] may hold at most two tensors, got {len(terms)}")
    for term in terms:
        if term.dtype != torch.bfloat16 or list(term.shape) != [num_tokens, hidden]:
            raise ValueError(f"biases[{source}] must be bfloat16 [{num_tokens}, {hidden}], got {describe(term)}")
    return terms


def _row_lookup(result: dict, source: int, num_tokens: int, num_local: int, do_expand: bool) -> torch.Tensor:
    """Row of ``result`` holding each token of ``source``: [T] (non-expand) or [T, L] (expand), -1 if none."""
    rows = (result["src_rank"] == source).nonzero().squeeze(1)
    tokens = result["src_token"][rows]
    device = result["src_rank"].device
    if not do_expand:
        lookup = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        lookup[tokens] = rows
        return lookup
    lookup = torch.full((num_tokens, num_local), -1, dtype=torch.int64, device=device)
    lookup[tokens, result["local_expert"][rows]] = rows
    return lookup


def _check_lookup_matches_routing(
    row_of: torch.Tensor, topk_idx: torch.Tensor, source: int, dest: int, num_local: int, do_expand: bool
) -> None:
    local_ids = local_expert_ids(topk_idx, dest, num_local)
    if do_expand:
        expected = torch.zeros_like(row_of, dtype=torch.bool)
        tokens, slots = (local_ids >= 0).nonzero(as_tuple=True)
        expected[tokens, local_ids[tokens, slots]] = True
    else:
        expected = (local_ids >= 0).any(dim=1)
    if not torch.equal(row_of >= 0, expected):
        raise ValueError(f"dispatch_results[{dest}] does not hold the tokens topk_idxs[{source}] routes to rank {dest}")


def _contribution(
    y: torch.Tensor,
    row_of: torch.Tensor,
    topk_idx: torch.Tensor,
    dest: int,
    num_local: int,
    tokens: torch.Tensor,
    do_expand: bool,
) -> torch.Tensor:
    """fp32 ``c_dest`` of ``tokens`` (each routed to ``dest``): the received row, or in expand mode
    the fp32 sum from 0.0 of the token's rows at ``dest`` in lane order, rounded to bf16."""
    if not do_expand:
        return y[row_of[tokens]].float()
    local_ids = local_expert_ids(topk_idx[tokens], dest, num_local)
    partial = torch.zeros(tokens.numel(), y.shape[1], dtype=torch.float32, device=y.device)
    for lane in range(local_ids.shape[1]):
        has = (local_ids[:, lane] >= 0).nonzero().squeeze(1)
        rows = row_of[tokens[has], local_ids[has, lane]]
        partial[has] = partial[has] + y[rows].float()
    return partial.to(torch.bfloat16).float()


def _combined_weights(
    weights_list: list[torch.Tensor],
    row_of: list[torch.Tensor],
    topk_idx: torch.Tensor,
    num_local: int,
    do_expand: bool,
) -> torch.Tensor:
    combined = torch.zeros(topk_idx.shape, dtype=torch.float32, device=weights_list[0].device)
    for slot in range(topk_idx.shape[1]):
        experts = topk_idx[:, slot]
        for dest, dest_rows in enumerate(row_of):
            tokens = ((experts >= 0) & (experts // num_local == dest)).nonzero().squeeze(1)
            if do_expand:
                combined[tokens, slot] = weights_list[dest][dest_rows[tokens, experts[tokens] % num_local]]
            else:
                combined[tokens, slot] = weights_list[dest][dest_rows[tokens], slot]
    return combined
