"""A deterministic stand-in for expert computation and a training step's loss, shared by the
autograd tests (CPU stand-in buffer and GPU) and their dense references: expert ``e`` multiplies
its rows by ``1 + e / 16`` in fp32, optionally weighted and scaled by a learnable per-rank gain."""

from __future__ import annotations

import torch

from deep_ep.testing.reference_ht import last_lanes

__all__ = [
    "Fanout",
    "dense_step",
    "expert_rows",
    "expert_rows_expanded",
    "expert_scale",
    "leaf",
    "node_sum",
    "step_loss",
    "step_results",
]


def expert_scale(experts: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` multiplies by ``1 + e / 16`` (fp32)."""
    return 1.0 + experts.to(torch.float32) / 16.0


def expert_rows(x, local_idx, weights, rank: int, num_local: int, gain=None) -> torch.Tensor:
    """Non-expand rows at ``rank``: ``bf16(gain * sum_k w_k * (x * scale_k))`` over the local slots
    (fp32, k ascending). ``gain`` (fp32 ``[H]``, learnable) multiplies every row, as a dense layer
    would: NaN in a row past the valid ones (forward or gradient) would reach its gradient."""
    xf = x.float()
    acc = torch.zeros_like(xf)
    for k in range(local_idx.shape[1]):
        local = local_idx[:, k]
        term = xf * expert_scale(rank * num_local + local.clamp(min=0)).unsqueeze(1)
        if weights is not None:
            term = weights[:, k : k + 1] * term
        acc = acc + torch.where((local >= 0).unsqueeze(1), term, 0.0)
    return (acc if gain is None else acc * gain).to(torch.bfloat16)


def expert_rows_expanded(x, row_local, weights, rank: int, num_local: int, gain=None) -> torch.Tensor:
    """Expand rows (one (token, local expert) pair each; ``row_local`` -1 for padding)."""
    term = x.float() * expert_scale(rank * num_local + row_local.clamp(min=0)).unsqueeze(1)
    if weights is not None:
        term = weights.unsqueeze(1) * term
    y = torch.where((row_local >= 0).unsqueeze(1), term, 0.0)
    return (y if gain is None else y * gain).to(torch.bfloat16)


def leaf(tensor):
    """A fresh leaf that requires grad (None stays None)."""
    return None if tensor is None else tensor.detach().clone().requires_grad_(True)


def step_loss(out, combined_weights, grad, weight_grad):
    """``sum(out * grad)`` (+ ``sum(combined_weights * weight_grad)``): backward feeds exactly these
    output gradients."""
    loss = (out.float() * grad).sum()
    if combined_weights is not None:
        loss = loss + (combined_weights * weight_grad).sum()
    return loss


def step_results(out, combined_weights, x, w, biases, gain_grad=None) -> dict:
    """What a step produced: outputs and the gradients of its leaves."""
    return {
        "out": out.detach(),
        "combined_weights": None if combined_weights is None else combined_weights.detach(),
        "x_grad": x.grad,
        "w_grad": None if w is None else w.grad,
        "bias_grads": [b.grad for b in biases],
        "gain_grad": gain_grad,
    }


def node_sum(
    contributions: list[torch.Tensor], lane_rank: torch.Tensor, node_size: int, acc: torch.Tensor | None = None
) -> torch.Tensor:
    """Combine's order over ranks (DeepEP V2's), continuing ``acc`` (fp32; zeros when None).
    ``contributions[r]``: rank ``r``'s fp32 ``[T, H]`` term; ``lane_rank``: ``[T, K]``, the rank of
    each top-k lane's expert (-1: none). Direct (one node) adds each of a token's ranks in ascending
    order of the rank's last lane; hybrid adds, in ascending order of each node's last lane, the
    node's partial (its ranks' contributions summed the same way in fp32 from 0.0, rounded to bf16)."""
    acc = torch.zeros_like(contributions[0]) if acc is None else acc
    num_ranks = len(contributions)
    if node_size == num_ranks:
        return _add_by_last_lane(acc, contributions, lane_rank)
    lane_node = torch.where(lane_rank >= 0, lane_rank // node_size, -1)
    partials = []
    for node in range(num_ranks // node_size):
        on_node = torch.where(lane_node == node, lane_rank, -1)
        partial = _add_by_last_lane(torch.zeros_like(acc), contributions, on_node)
        partials.append(partial.to(torch.bfloat16).float())
    return _add_by_last_lane(acc, partials, lane_node)


def _add_by_last_lane(acc: torch.Tensor, terms: list[torch.Tensor], lane_owner: torch.Tensor) -> torch.Tensor:
    """``acc`` plus, per token, ``terms[o]`` of every owner ``o`` in ``lane_owner`` (``[T, K]``, -1:
    none) in ascending order of its last lane. Tokens an owner does not cover add +0.0, which leaves
    an accumulator started at +0.0 bit for bit as it is (and passes no gradient)."""
    last = last_lanes(lane_owner)
    for lane in range(lane_owner.shape[1]):
        for owner, term in enumerate(terms):
            here = (last[:, lane] & (lane_owner[:, lane] == owner)).unsqueeze(1)
            acc = acc + torch.where(here, term, 0.0)
    return acc


def _lane_order_sum(rows: list[torch.Tensor], lane_local: torch.Tensor) -> torch.Tensor:
    """A rank's expand partial: ``rows[l]`` (fp32 ``[T, H]``, local expert ``l``'s output) summed
    from 0.0 in top-k lane order (``lane_local``: ``[T, K]`` local expert of each lane on this rank,
    -1 elsewhere), rounded to bf16 (returned as fp32)."""
    partial = torch.zeros_like(rows[0])
    for lane in range(lane_local.shape[1]):
        for local, row in enumerate(rows):
            partial = partial + torch.where((lane_local[:, lane] == local).unsqueeze(1), row, 0.0)
    return partial.to(torch.bfloat16).float()


class Fanout(torch.autograd.Function):
    """The dense reference's dispatch: one copy of ``x`` per (rank, group); backward sums the
    copies' gradients as combine does (expand: per rank over its groups, the local experts, in
    top-k lane order in fp32, rounded to bf16; then over ranks in DeepEP V2's order, ``node_sum``).
    ``routing``: the sanitised ``[T, K]`` expert ids, ``num_local`` experts per rank."""

    @staticmethod
    def forward(ctx, x, routing, num_ranks, num_local, groups_per_rank, node_size):
        ctx.save_for_backward(routing)
        ctx.num_ranks, ctx.num_local, ctx.groups, ctx.node_size = num_ranks, num_local, groups_per_rank, node_size
        return tuple(x.clone() for _ in range(num_ranks * groups_per_rank))

    @staticmethod
    def backward(ctx, *grads):
        (routing,) = ctx.saved_tensors
        like = next(g for g in grads if g is not None)
        lane_rank = torch.where(routing >= 0, routing // ctx.num_local, -1)
        per_rank = []
        for rank in range(ctx.num_ranks):
            group_grads = [
                torch.zeros(like.shape, dtype=torch.float32, device=like.device) if grad is None else grad.float()
                for grad in grads[rank * ctx.groups : (rank + 1) * ctx.groups]
            ]
            if ctx.groups == 1:  # the rank's one row travels as it is
                per_rank.append((torch.zeros_like(group_grads[0]) + group_grads[0]).to(torch.bfloat16).float())
            else:
                lane_local = torch.where(lane_rank == rank, routing - rank * ctx.num_local, -1)
                per_rank.append(_lane_order_sum(group_grads, lane_local))
        summed = node_sum(per_rank, lane_rank, ctx.node_size).to(torch.bfloat16)
        return summed, None, None, None, None, None


def dense_step(
    x: torch.Tensor,
    w: torch.Tensor | None,
    bias: list[torch.Tensor],
    routing: torch.Tensor,
    gains: list[torch.Tensor],
    num_local: int,
    do_expand: bool,
    combine_weights: bool,
    node_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One source rank's MoE step on the whole group in one process, differentiable with plain
    torch autograd: ``(out, combined_weights)`` as dispatch -> expert rows -> combine give them
    (``routing`` sanitised; ``gains[r]`` rank ``r``'s learnable gain; nodes of ``node_size`` ranks,
    ``len(gains)`` for direct mode). ``combined_weights`` (with ``combine_weights``) is ``2 w`` on
    the routed slots, 0 elsewhere."""
    num_ranks = len(gains)
    groups = num_local if do_expand else 1
    copies = Fanout.apply(x, routing, num_ranks, num_local, groups, node_size)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for term in bias:
        acc = acc + term.float()
    lane_rank = torch.where(routing >= 0, routing // num_local, -1)
    contributions = []
    for rank in range(num_ranks):
        local = torch.where(lane_rank == rank, routing % num_local, -1)
        present = (local >= 0).any(dim=1)
        if not do_expand:
            contribution = expert_rows(copies[rank], local, w, rank, num_local, gains[rank]).float()
        else:
            rows = []
            for expert in range(num_local):
                match = local == expert
                has = match.any(dim=1)
                slot = match.to(torch.int64).argmax(dim=1, keepdim=True)
                pair_weights = None if w is None else w.gather(1, slot).squeeze(1)
                row_local = torch.where(has, expert, -1)
                y = expert_rows_expanded(
                    copies[rank * groups + expert], row_local, pair_weights, rank, num_local, gains[rank]
                )
                rows.append(y.float())
            contribution = _lane_order_sum(rows, local)
        contributions.append(torch.where(present.unsqueeze(1), contribution, 0.0))
    out = node_sum(contributions, lane_rank, node_size, acc).to(torch.bfloat16)
    combined_weights = torch.where(routing >= 0, w * 2, 0.0) if combine_weights else None
    return out, combined_weights
