"""The all_to_all_single baseline (benchmarks/a2a_baseline.py) delivers exactly what the reference model
says HT dispatch and combine deliver (non-expand, no bias), bitwise, on gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from deep_ep.testing import launch
from deep_ep.testing.data import make_group_inputs
from deep_ep.testing.reference import ht_combine, ht_dispatch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from a2a_baseline import a2a_combine, a2a_dispatch  # noqa: E402

HIDDEN = 64
NUM_TOPK = 4
NUM_EXPERTS = 12
NUM_MAX_TOKENS = 40
SEEDS = (1, 2)


def _inputs(num_ranks: int, seed: int):
    return make_group_inputs(
        num_ranks, NUM_MAX_TOKENS, HIDDEN, NUM_EXPERTS, NUM_TOPK, seed=seed, use_fp8=False, with_weights=False
    )


# Per destination rank: +x, +2^24 x, -2^24 x. A row returned to the wrong token shows, and so does
# the summation order on 3 ranks: (x + 2^24 x) - 2^24 x rounds in fp32, (-2^24 x + 2^24 x) + x does not.
RANK_SCALES = (1.0, 2.0**24, -(2.0**24))


def _scaled(rows: torch.Tensor, rank: int) -> torch.Tensor:
    return (rows.float() * RANK_SCALES[rank]).to(torch.bfloat16)


def _run_baseline(rank, num_ranks, group, seeds):
    outputs = []
    for seed in seeds:
        data = _inputs(num_ranks, seed)
        recv_x, handle = a2a_dispatch(data.x[rank], data.topk_idx[rank], NUM_EXPERTS, group)
        outputs.append(
            {
                "recv_x": recv_x,
                "recv_splits": handle.recv_splits,
                "combined_identity": a2a_combine(recv_x, handle, group),
                "combined_scaled": a2a_combine(_scaled(recv_x, rank), handle, group),
            }
        )
    return outputs


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_baseline_matches_reference_dispatch_and_combine_bitwise(num_ranks):
    per_rank = launch(_run_baseline, num_ranks, SEEDS, timeout_secs=120)
    for case, seed in enumerate(SEEDS):
        data = _inputs(num_ranks, seed)
        # The generator's edge cases are what this test is about; make sure they are present.
        assert 0 in data.num_tokens
        assert any(bool((idx == -1).all(dim=1).any()) for idx in data.topk_idx if idx.shape[0] > 0)

        reference = ht_dispatch(data.dispatch_xs, data.topk_idx, None, NUM_EXPERTS)
        identity = ht_combine(reference, [result["x"] for result in reference], data.topk_idx, NUM_EXPERTS)
        scaled_ys = [_scaled(result["x"], dest) for dest, result in enumerate(reference)]
        scaled = ht_combine(reference, scaled_ys, data.topk_idx, NUM_EXPERTS)
        for rank in range(num_ranks):
            got = per_rank[rank][case]
            assert got["recv_splits"] == reference[rank]["num_recv_tokens_per_rank"]
            assert got["recv_x"].dtype == torch.bfloat16
            assert torch.equal(got["recv_x"], reference[rank]["x"]), f"dispatch rank {rank} seed {seed}"
            assert torch.equal(got["combined_identity"], identity[rank]["x"]), f"combine rank {rank} seed {seed}"
            assert torch.equal(got["combined_scaled"], scaled[rank]["x"]), f"combine rank {rank} seed {seed}"
            unrouted = (data.topk_idx[rank] == -1).all(dim=1)
            assert bool((got["combined_identity"][unrouted] == 0).all())


def test_dispatch_rejects_int32_topk_idx():
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"topk_idx must be int64 \[4, K\], got int32 \[4, 2\]"):
        a2a_dispatch(x, torch.zeros(4, 2, dtype=torch.int32), NUM_EXPERTS, None)
