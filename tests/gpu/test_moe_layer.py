"""The example MoE layer (examples/moe_layer.py) on deep_ep against the dense single-process model.

One launch per rank count (EP_TEST_RANKS) runs ``moe_layer.check_rank`` on every rank: for each
router variant (softmax top-k; sigmoid, renormalised, node-limited to 2 of 4 expert groups) one
training step through HT dispatch/combine (plain, two micro-batches in sequence, two micro-batches
overlapped on two streams), the LL decode forward (fp8 and bf16) plain, sequential and overlapped.

Tolerance (``moe_layer.TOLERANCES``): the layer computes in bf16 (GEMM outputs, the weighted rows and
each rank's partial sum are rounded to bf16, whose rounding error is at most 2^-9 of the value) and
the dense model in fp32 on the same bf16 parameters with bitwise the same routing. About six
roundings forward and as many again backward, plus GEMMs accumulating in their own order, keep the
difference at a few 2^-9 of the largest entry (at most 0.9 % measured with CPU matmuls); the test
accepts max|layer - dense| <= 2^-5 (3.1 %) of max|dense| for outputs and for the gradients of x, of
the experts' W1 / W2 and of the router weight (summed over the ranks). One lost (token, expert)
contribution shows as 8 % to 90 %.

Bitwise: overlapping changes only which stream issues a call, never a kernel or a shape, so the
overlapped micro-batches equal the sequential micro-batches bit for bit (HT outputs and every
gradient; LL outputs). LL runs the same batched GEMM shape ``[L, R*T_ll, H]`` whatever the batch and
combines per token, so its micro-batches equal the plain forward bit for bit too. HT micro-batches
run GEMMs of other sizes than the whole batch, whose accumulation order may differ: that comparison
is the tolerance one (``HT two-batch ...`` errors against the dense model).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import moe_layer  # noqa: E402  (examples/ is not a package)
from rank_results import launch_once  # noqa: E402

# A device wait that never ends fails in 30 s naming the peer and phase (CommTimeoutError), and the
# launch as a whole gets 300 s. Known failure at 4 and 8 ranks on one H200 (2 ranks pass), measured
# 2026-12-02 with a 10 s deadline: (1) without warm-up, one rank's first expert GEMM call blocked on
# the host for exactly the peers' deadline (cuBLAS loads a kernel's module on first use, and under
# MPS that waits for the peers' spinning kernels: docs/testing.md); MoELayer.warm_up and the
# launcher's warm-up removed every host stall. (2) Still open: with no host call blocking, a device
# wait on one rank times out right after the first training step (4 ranks) or after the third
# (8 ranks), and the other ranks' next notify completes the moment it does. The phase and peer of
# that timeout were not captured; next step: read them from the CommTimeoutError message (it now
# lists each rank's last calls and names the call its kernel belonged to). Hypothesis to test: at 4
# ranks each rank's communication kernels take 33 SMs (the 132 / 4 cap; the estimate asks for more),
# so while three peers spin, the fourth rank's GEMMs get 33 SMs; a persistent cuBLAS kernel sized
# for all 132 SMs whose CTAs wait for each other (stream-K / split-K fix-up) then cannot finish
# until the peers time out and free theirs. Experiments: CUBLAS_WORKSPACE_CONFIG=:0:0 with
# CUBLASLT_WORKSPACE_SIZE=0 (no workspace: no fix-up algorithms), or fewer communication SMs
# (EP_TEST_MOE_NUM_SMS=8: a num_sms below the cap leaves room for a whole GEMM grid).
CONFIG = moe_layer.CheckConfig(gpu_timeout_secs=30.0)
# Diagnosis knob: EP_TEST_MOE_NUM_SMS=n runs the HT calls with n communication SMs per rank.
if os.environ.get("EP_TEST_MOE_NUM_SMS"):
    _num_sms = int(os.environ["EP_TEST_MOE_NUM_SMS"])
    CONFIG = replace(CONFIG, variants=tuple((name, replace(cfg, num_sms=_num_sms)) for name, cfg in CONFIG.variants))
LAUNCH_TIMEOUT_SECS = 300.0


@pytest.fixture
def moe_results(num_ranks: int) -> list[dict]:
    """Per-rank ``check_rank`` results, run once per rank count."""
    return launch_once(moe_layer.check_rank, num_ranks, CONFIG, timeout_secs=LAUNCH_TIMEOUT_SECS)


def _error_failures(per_rank: list[dict], prefix: str) -> list[str]:
    failures = []
    for rank, results in enumerate(per_rank):
        for variant, result in results.items():
            for name, (error, tolerance) in result["errors"].items():
                if name.startswith(prefix) and not error <= tolerance:
                    failures.append(f"rank {rank} {variant}: {name}: relative error {error:.3g} > {tolerance:.3g}")
    return failures


def _bitwise_failures(per_rank: list[dict], prefix: str) -> list[str]:
    failures = []
    for rank, results in enumerate(per_rank):
        for variant, result in results.items():
            for name, differ in result["bitwise"].items():
                if name.startswith(prefix) and differ != 0:
                    what = f"{differ} elements differ" if differ > 0 else "shapes or dtypes differ"
                    failures.append(f"rank {rank} {variant}: {name}: {what}")
    return failures


def test_routing_equals_the_dense_models_and_node_limit_holds(moe_results: list[dict]) -> None:
    failures = [
        f"rank {rank} {variant}: {name}"
        for rank, results in enumerate(moe_results)
        for variant, result in results.items()
        for name, passed in result["checks"].items()
        if not passed
    ]
    assert not failures, "\n".join(failures)
    for results in moe_results:
        assert "every token within max_nodes=2 nodes" in results["sigmoid-node-limited"]["checks"]


def test_ht_forward_and_backward_match_the_dense_model_within_bf16_tolerance(moe_results: list[dict]) -> None:
    """Output, and the gradients of x, W1, W2 (this rank's experts) and the router weight."""
    failures = _error_failures(moe_results, "HT plain ")
    assert not failures, "\n".join(failures)


def test_ht_two_batch_step_matches_the_dense_model_within_bf16_tolerance(moe_results: list[dict]) -> None:
    failures = _error_failures(moe_results, "HT two-batch")
    assert not failures, "\n".join(failures)


def test_ht_two_batch_overlap_equals_sequential_micro_batches_bitwise(moe_results: list[dict]) -> None:
    """Output and every gradient (x, W1, W2, router weight before the cross-rank sum)."""
    assert all(len([n for n in r["bitwise"] if n.startswith("HT")]) == 5 for r in moe_results[0].values())
    failures = _bitwise_failures(moe_results, "HT two-batch overlap")
    assert not failures, "\n".join(failures)


def test_ll_decode_forward_matches_the_dense_model_within_bf16_tolerance(moe_results: list[dict]) -> None:
    """fp8 dispatch against the dense model on fp8-cast inputs, bf16 dispatch against the plain one."""
    failures = _error_failures(moe_results, "LL ")
    assert not failures, "\n".join(failures)


def test_ll_two_batch_overlap_equals_sequential_and_plain_forward_bitwise(moe_results: list[dict]) -> None:
    failures = _bitwise_failures(moe_results, "LL ")
    assert not failures, "\n".join(failures)
