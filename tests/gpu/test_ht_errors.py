"""HT dispatch/combine refuse bad input with a message naming the argument, the value and the rule,
before any launch (every rank raises, so no rank waits for another); an expert id >= E is found on
the device, reported as ValueError, and the buffer keeps working."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ht_checks import device, make_buffer

import deep_ep
from deep_ep.testing import launch
from deep_ep.testing.data import make_routing, make_tokens, make_weights

TOKENS = 128
HIDDEN = 1024
EXPERTS = 64
TOPK = 4


def _inputs(rank, num_tokens=TOKENS):
    generator = torch.Generator().manual_seed(77 + rank)
    topk_idx = make_routing(num_tokens, EXPERTS, TOPK, generator=generator).to(device())
    weights = make_weights(topk_idx, generator).to(device())
    x = make_tokens(num_tokens, HIDDEN, generator).to(device())
    return x, topk_idx, weights


def _round_trip_ok(buffer, rank):
    x, topk_idx, weights = _inputs(rank)
    recv_x, _, recv_weights, handle, _ = buffer.dispatch(x, topk_idx, weights, num_experts=EXPERTS)
    combined, combined_weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_weights)
    num_local = EXPERTS // buffer.num_ranks
    ranks = torch.where(topk_idx >= 0, topk_idx // num_local, torch.full_like(topk_idx, -1))
    copies = torch.stack([(ranks == dest).any(dim=1) for dest in range(buffer.num_ranks)], dim=1).sum(dim=1)
    assert torch.equal(combined, (x.float() * copies.unsqueeze(1).float()).to(torch.bfloat16))
    assert torch.equal(combined_weights, torch.where(topk_idx >= 0, weights, torch.zeros_like(weights)))
    return handle, recv_x


def _bad_inputs(rank, num_ranks, group):
    buffer = make_buffer(group, num_max_tokens_per_rank=TOKENS, hidden=HIDDEN, num_topk=TOPK)
    try:
        x, topk_idx, weights = _inputs(rank)
        dispatch = buffer.dispatch

        def refuses(pattern, call, error=ValueError):
            with pytest.raises(error, match=pattern):
                call()

        refuses(r"x must be bfloat16 \[T, H\].*float32", lambda: dispatch(x.float(), topk_idx, num_experts=EXPERTS))
        refuses(
            r"x must be bfloat16 \[T, H\].*\[1, 128, 1024\]",
            lambda: dispatch(x.unsqueeze(0), topk_idx, num_experts=EXPERTS),
        )
        refuses(r"x must be on this buffer's device", lambda: dispatch(x.cpu(), topk_idx, num_experts=EXPERTS))
        refuses(r"x must be contiguous", lambda: dispatch(x[:, ::2], topk_idx, num_experts=EXPERTS))
        refuses(r"topk_idx must be int64 \[128, K\].*int32", lambda: dispatch(x, topk_idx.int(), num_experts=EXPERTS))
        refuses(r"topk_idx must be contiguous", lambda: dispatch(x, topk_idx.t().contiguous().t(), num_experts=EXPERTS))
        refuses(
            r"topk_weights must be float32 \[128, 4\]",
            lambda: dispatch(x, topk_idx, weights[:, :2].contiguous(), num_experts=EXPERTS),
        )
        refuses(
            r"K must be in \[1, 4\].*K=6",
            lambda: dispatch(x, torch.cat([topk_idx, topk_idx[:, :2]], 1), num_experts=EXPERTS),
        )
        big = make_tokens(TOKENS + 1, HIDDEN, torch.Generator().manual_seed(1)).to(device())
        refuses(
            r"T=129 tokens, more than num_max_tokens_per_rank=128",
            lambda: dispatch(
                big, torch.zeros(TOKENS + 1, TOPK, dtype=torch.int64, device=device()), num_experts=EXPERTS
            ),
        )
        if num_ranks > 1:
            refuses(
                rf"num_experts \({EXPERTS + 1}\) must be a multiple of num_ranks \({num_ranks}\)",
                lambda: dispatch(x, topk_idx, num_experts=EXPERTS + 1),
            )
        fp8 = torch.zeros(TOKENS, 200, dtype=torch.float8_e4m3fn, device=device())
        scales = torch.ones(TOKENS, 1, dtype=torch.float32, device=device())
        refuses(r"multiple of 128 for fp8.*H=200", lambda: dispatch((fp8, scales), topk_idx, num_experts=EXPERTS))
        fp8 = torch.zeros(TOKENS, HIDDEN, dtype=torch.float8_e4m3fn, device=device())
        refuses(
            r"x\[1\] \(scales\) must be float32 \[T, H/128\].*expected \[128, 8\], got float32 \[128, 1\]",
            lambda: dispatch((fp8, scales), topk_idx, num_experts=EXPERTS),
        )
        refuses(
            r"num_sms=100000 exceeds this rank's SM cap",
            lambda: dispatch(x, topk_idx, num_experts=EXPERTS, num_sms=100_000),
        )
        refuses(
            r"BufferTooSmall|needs \d+ bytes of the HT region",
            lambda: dispatch(x, topk_idx, num_experts=EXPERTS, num_max_tokens_per_rank=TOKENS * 64),
            deep_ep.BufferTooSmallError,
        )

        handle, recv_x = _round_trip_ok(buffer, rank)
        refuses(r"topk_idx must be None with handle=", lambda: dispatch(x, topk_idx, handle=handle))
        refuses(
            r"x must be bfloat16 \[\d+, H\]",
            lambda: buffer.combine(recv_x[:-1] if len(recv_x) else recv_x.new_empty(1, HIDDEN), handle),
        )
        refuses(
            r"bias must be bfloat16 \[128, 1024\]",
            lambda: buffer.combine(recv_x, handle, bias=torch.zeros(TOKENS, 8, dtype=torch.bfloat16, device=device())),
        )
        refuses(r"bias must be a tensor or a pair", lambda: buffer.combine(recv_x, handle, bias=(x, x, x)))
        refuses(r"handle must be the EPHandle", lambda: buffer.combine(recv_x, None), TypeError)
        foreign = dataclasses.replace(handle, owner_id=handle.owner_id + 1_000)
        refuses(r"handle comes from a dispatch of another buffer", lambda: buffer.combine(recv_x, foreign))
        refuses(r"handle comes from a dispatch of another buffer", lambda: dispatch(x, handle=foreign))

        # Device-detected: an expert id >= E on rank 0 only; every rank still completes the protocol.
        bad = topk_idx.clone()
        if rank == 0:
            bad[TOKENS // 2, 1] = EXPERTS + 5
            refuses(rf"expert id {EXPERTS + 5} outside", lambda: dispatch(x, bad, weights, num_experts=EXPERTS))
        else:
            dispatch(x, bad, weights, num_experts=EXPERTS)
        buffer.barrier(with_cpu_sync=True)
        _round_trip_ok(buffer, rank)
        buffer._check_device_errors()
        assert buffer._debug_count_dirty_workspace_bytes() == 0, "workspace not back to zero"
    finally:
        buffer.destroy()


def test_bad_inputs_raise_naming_argument_value_and_rule_and_buffer_survives(num_ranks):
    launch(_bad_inputs, num_ranks)
