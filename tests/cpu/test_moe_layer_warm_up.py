"""MoELayer.warm_up (examples/moe_layer.py) meets every GEMM shape the layer can run, on the CPU.

Ranks that share a GPU must not load a kernel between communication calls (docs/testing.md), so the
warm-up runs the experts at every row count an expert can receive: here the shapes it runs are
recorded and compared with that set, and the parameters keep no gradient afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import moe_layer  # noqa: E402  (examples/ is not a package)


class _Buffer:
    """What MoELayer reads of a buffer: 4 ranks, this one rank 1, an LL region of 16 tokens per rank."""

    num_ranks = 4
    rank_idx = 1
    num_max_dispatch_tokens_per_rank = 16

    def get_logical_domain_size(self) -> tuple[int, int]:
        return 1, 4


def test_warm_up_runs_every_aligned_row_count_and_the_decode_shapes(monkeypatch):
    cfg = moe_layer.MoEConfig(hidden=256, ffn_hidden=128, num_experts=8, num_topk=2, expert_alignment=16)
    layer = moe_layer.MoELayer(_Buffer(), cfg, torch.device("cpu"))
    shapes = []
    original = moe_layer.expert_mlp

    def recording_mlp(rows, w1, w2):
        shapes.append(tuple(rows.shape))
        return original(rows, w1, w2)

    monkeypatch.setattr(moe_layer, "expert_mlp", recording_mlp)
    num_tokens = 40  # per rank: an expert receives at most 4 * 40 = 160 rows, 10 aligned counts
    layer.warm_up(num_tokens)

    local = layer.num_local_experts
    ht_rows = [shape[0] for shape in shapes if len(shape) == 2 and shape[0] > 0]
    assert ht_rows == list(range(16, 161, 16))
    # Every other local expert of a warm-up step is empty (a zero-row GEMM, as in a real step).
    assert sum(1 for shape in shapes if len(shape) == 2 and shape[0] == 0) == len(ht_rows) * (local - 1)
    decode = [shape for shape in shapes if len(shape) == 3]
    assert decode == [(local, 4 * 16, 256)] * 2  # bf16 and fp8 receive
    assert all(parameter.grad is None for parameter in layer.parameters())
