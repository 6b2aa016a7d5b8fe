"""A deterministic stand-in for expert computation and a training step's loss, shared by the
autograd tests (CPU stand-in buffer and GPU) and their dense references: expert ``e`` multiplies
its rows by ``1 + e / 16`` in fp32, optionally weighted and scaled by a learnable per-rank gain."""

from __future__ import annotations

import torch

__all__ = ["expert_rows", "expert_rows_expanded", "expert_scale", "leaf", "step_loss", "step_results"]


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
