"""Hand-worked cases for the low-latency reference model (R=2, E=4, L=2, K=2, T_ll=3).

Routing (expert e lives on rank e // 2, local id e % 2):
  rank 0: token 0 → [0, 3], token 1 → [2, 3], token 2 → [-1, 1]
  rank 1: token 0 → [1, 0], token 1 → [-1, -1], token 2 → [3, -1]
Receive rows of source s start at s * T_ll = 3 s.
"""

import numpy as np
import pytest
import torch

from deep_ep.testing.reference import ll_combine, ll_dispatch, ll_valid_row_mask, sanitize_topk_idx

NUM_EXPERTS = 4
HIDDEN = 128
NUM_MAX_TOKENS = 3
TOPK_IDXS = [torch.tensor([[0, 3], [2, 3], [-1, 1]]), torch.tensor([[1, 0], [-1, -1], [3, -1]])]
WEIGHTS = [torch.tensor([[0.5, 0.25], [1.5, 2.0], [3.0, 0.75]]), torch.tensor([[4.0, 5.0], [6.0, 7.0], [8.0, 9.0]])]
# Channel pattern whose multiples by 448 are exact E4M3 values; amax of a row is its scale factor v.
PATTERN = torch.tensor([1.0, 0.5, -0.25, 0.125]).repeat(HIDDEN // 4)


def tokens(values_per_rank: list[list[float]]) -> list[torch.Tensor]:
    return [torch.tensor(values).unsqueeze(1).mul(PATTERN).bfloat16() for values in values_per_rank]


def filled(values: list[list[float]]) -> torch.Tensor:
    """bf16 [L, 6, H] where row (l, i) is filled with values[l][i]."""
    return torch.tensor(values).unsqueeze(2).expand(-1, -1, HIDDEN).bfloat16()


def test_dispatch_places_tokens_in_per_source_slots():
    xs = tokens([[1, 2, 3], [11, 12, 13]])
    rank0, rank1 = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=False)
    assert rank0["src_token"].tolist() == [[0, -1, -1, 0, -1, -1], [2, -1, -1, 0, -1, -1]]
    assert rank0["topk_slot"].tolist() == [[0, -1, -1, 1, -1, -1], [1, -1, -1, 0, -1, -1]]
    assert rank1["src_token"].tolist() == [[1, -1, -1, -1, -1, -1], [0, 1, -1, 2, -1, -1]]
    assert rank1["topk_slot"].tolist() == [[0, -1, -1, -1, -1, -1], [1, 1, -1, 0, -1, -1]]
    expected_rank1 = torch.zeros(2, 6, HIDDEN)
    expected_rank1[0, 0] = 2 * PATTERN
    expected_rank1[1, 0], expected_rank1[1, 1], expected_rank1[1, 3] = PATTERN, 2 * PATTERN, 13 * PATTERN
    assert rank1["x"].dtype == torch.bfloat16 and torch.equal(rank1["x"].float(), expected_rank1)
    assert rank1["x_scales"] is None


def test_dispatch_counts_per_expert_and_per_source():
    results = ll_dispatch(tokens([[1, 2, 3], [11, 12, 13]]), TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS)
    assert results[0]["count"].dtype == torch.int32
    assert results[0]["count"].tolist() == [2, 2] and results[0]["count_per_source"].tolist() == [[1, 1], [1, 1]]
    assert results[1]["count"].tolist() == [1, 3] and results[1]["count_per_source"].tolist() == [[1, 0], [2, 1]]


def test_valid_row_mask_marks_exactly_the_dispatched_rows():
    rank0, _ = ll_dispatch(tokens([[1, 2, 3], [11, 12, 13]]), TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS)
    mask = ll_valid_row_mask(rank0)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[True, False, False, True, False, False]] * 2


def test_fp8_dispatch_casts_each_source_row():
    # Row values v * PATTERN: amax v, so q = 448 * PATTERN and scale = v / 448 (exact for these v).
    xs = tokens([[7, 14, 28], [56, 112, 224]])
    _, rank1 = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=True)
    assert rank1["x"].dtype == torch.float8_e4m3fn
    assert rank1["x_scales"].squeeze(2).tolist() == [[1 / 32, 0, 0, 0, 0, 0], [1 / 64, 1 / 32, 0, 1 / 2, 0, 0]]
    valid = ll_valid_row_mask(rank1)
    assert torch.equal(rank1["x"][valid].float(), (448 * PATTERN).expand(4, -1))
    assert rank1["x"][~valid].view(torch.uint8).eq(0).all()


def test_fp8_dispatch_scale_uses_correctly_rounded_division():
    xs = tokens([[3, 3, 3], [3, 3, 3]])
    rank0, _ = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=True)
    assert rank0["x_scales"][0, 0, 0].item() == float(np.float32(3.0) / np.float32(448.0))


def test_combine_weights_each_expert_output_and_sums_slots():
    results = ll_dispatch(tokens([[1, 2, 3], [11, 12, 13]]), TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=False)
    ys = [
        filled([[2, 999, 999, 4, 999, 999], [8, 999, 999, 16, 999, 999]]),
        filled([[3, 999, 999, 999, 999, 999], [5, 6, 999, 7, 999, 999]]),
    ]
    rank0, rank1 = ll_combine(results, ys, TOPK_IDXS, WEIGHTS, NUM_EXPERTS, NUM_MAX_TOKENS)
    # rank 0: t0 = 0.5*2 + 0.25*5, t1 = 1.5*3 + 2*6, t2 = 0.75*8
    # rank 1: t0 = 4*16 + 5*4, t1 sends nothing, t2 = 8*7
    assert rank0.dtype == torch.bfloat16
    assert torch.equal(rank0, torch.tensor([2.25, 16.5, 6.0]).unsqueeze(1).expand(-1, HIDDEN).bfloat16())
    assert torch.equal(rank1, torch.tensor([84.0, 0.0, 56.0]).unsqueeze(1).expand(-1, HIDDEN).bfloat16())


def test_combine_rounds_to_bf16_once_after_fp32_accumulation():
    # One rank, three experts: 1 + 2^-8 + 2^-9 is exact in fp32 and rounds to 1 + 2^-7 in bf16;
    # rounding after each add would give 1 (the second add is a tie).
    topk_idx = [torch.tensor([[0, 1, 2]])]
    results = ll_dispatch([torch.ones(1, HIDDEN).bfloat16()], topk_idx, 3, 1, use_fp8=False)
    ys = [torch.tensor([1.0, 2.0**-8, 2.0**-9]).view(3, 1, 1).expand(-1, -1, HIDDEN).bfloat16()]
    (out,) = ll_combine(results, ys, topk_idx, [torch.ones(1, 3)], 3, 1)
    assert out[0, 0].item() == 1 + 2.0**-7


def test_combine_rounds_the_product_before_adding():
    # Slot 0 gives acc = -(1 + 2^-7). Slot 1: w * y = (1 + 2^-23)(1 + 2^-7) = 1 + 2^-7 + 2^-23 + 2^-30
    # rounds to 1 + 2^-7 + 2^-23 in fp32, so acc becomes 2^-23. A fused multiply-add would keep
    # 2^-23 + 2^-30, which bf16 represents exactly.
    topk_idx = [torch.tensor([[0, 1]])]
    results = ll_dispatch([torch.ones(1, HIDDEN).bfloat16()], topk_idx, 2, 1, use_fp8=False)
    ys = [torch.tensor([-(1 + 2.0**-7), 1 + 2.0**-7]).view(2, 1, 1).expand(-1, -1, HIDDEN).bfloat16()]
    weights = [torch.tensor([[1.0, 1 + 2.0**-23]])]
    (out,) = ll_combine(results, ys, topk_idx, weights, 2, 1)
    assert out[0, 0].item() == 2.0**-23
    assert torch.tensor(2.0**-23 + 2.0**-30).bfloat16().item() == 2.0**-23 + 2.0**-30


def test_dispatch_rejects_more_tokens_than_the_cap():
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank=2"):
        ll_dispatch(tokens([[1, 2, 3], [11, 12, 13]]), TOPK_IDXS, NUM_EXPERTS, 2)


def test_dispatch_rejects_fp8_hidden_not_a_multiple_of_128():
    narrow = [x[:, :64].contiguous() for x in tokens([[1, 2, 3], [11, 12, 13]])]
    with pytest.raises(ValueError, match="multiple of 128"):
        ll_dispatch(narrow, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=True)
    assert ll_dispatch(narrow, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=False)[0]["x"].shape[-1] == 64


def test_dispatch_rejects_topk_idx_that_is_not_int64():
    with pytest.raises(ValueError, match=r"topk_idxs\[0\] must be int64"):
        ll_dispatch(tokens([[1, 2, 3], [11, 12, 13]]), [TOPK_IDXS[0].int(), TOPK_IDXS[1]], NUM_EXPERTS, NUM_MAX_TOKENS)


# Repeated and out-of-range ids (R=2, E=4, K=3, T_ll=2); only the first occurrence counts:
#   rank 0: token 0 → [3, 1, 3] ≡ [3, 1, -1], token 1 → [0, 0, 2] ≡ [0, -1, 2]
#   rank 1: token 0 → [2, 2, 2] ≡ [2, -1, -1], token 1 → [5, -2, 1] ≡ [-1, -1, 1]
BAD_MAX_TOKENS = 2
BAD_TOPK_IDXS = [torch.tensor([[3, 1, 3], [0, 0, 2]]), torch.tensor([[2, 2, 2], [5, -2, 1]])]
BAD_WEIGHTS = [
    torch.tensor([[0.5, 0.25, 8.0], [1.5, 16.0, 2.0]]),
    torch.tensor([[4.0, 32.0, 64.0], [6.0, 7.0, 9.0]]),
]


def test_dispatch_sends_a_repeated_expert_once_in_the_slot_of_its_first_occurrence():
    xs = tokens([[1, 2], [11, 12]])
    rank0, rank1 = ll_dispatch(xs, BAD_TOPK_IDXS, NUM_EXPERTS, BAD_MAX_TOKENS, use_fp8=False)
    # Rank 1, local 1 (expert 3): rank 0's token 0 once, from slot 0 (not again from slot 2).
    # Rank 1, local 0 (expert 2): rank 0's token 1 (slot 2), rank 1's token 0 once (slot 0).
    assert rank1["src_token"].tolist() == [[1, -1, 0, -1], [0, -1, -1, -1]]
    assert rank1["topk_slot"].tolist() == [[2, -1, 0, -1], [0, -1, -1, -1]]
    assert rank1["count"].tolist() == [2, 1] and rank1["count_per_source"].tolist() == [[1, 1], [1, 0]]
    # Rank 0, local 0 (expert 0): rank 0's token 1 once (slot 0); local 1 (expert 1): rank 0's token 0
    # (slot 1) and rank 1's token 1 (slot 2: its out-of-range ids 5 and -2 are skipped).
    assert rank0["src_token"].tolist() == [[1, -1, -1, -1], [0, -1, 1, -1]]
    assert rank0["topk_slot"].tolist() == [[0, -1, -1, -1], [1, -1, 2, -1]]
    assert rank0["count"].tolist() == [1, 2] and rank0["count_per_source"].tolist() == [[1, 0], [1, 1]]
    assert torch.equal(rank1["x"][0, 2].float(), 11 * PATTERN) and torch.equal(rank1["x"][1, 0].float(), PATTERN)


def test_dispatch_of_bad_ids_equals_that_of_the_sanitized_routing():
    xs = tokens([[1, 2], [11, 12]])
    clean = [sanitize_topk_idx(t, NUM_EXPERTS) for t in BAD_TOPK_IDXS]
    got = ll_dispatch(xs, BAD_TOPK_IDXS, NUM_EXPERTS, BAD_MAX_TOKENS)
    want = ll_dispatch(xs, clean, NUM_EXPERTS, BAD_MAX_TOKENS)
    for got_rank, want_rank in zip(got, want, strict=True):
        for key in ("x", "x_scales", "count", "count_per_source", "src_token", "topk_slot"):
            assert torch.equal(got_rank[key].view(torch.uint8), want_rank[key].view(torch.uint8)), key


def test_combine_sums_a_repeated_expert_once_with_the_weight_of_its_first_slot():
    results = ll_dispatch(tokens([[1, 2], [11, 12]]), BAD_TOPK_IDXS, NUM_EXPERTS, BAD_MAX_TOKENS, use_fp8=False)
    ys = [filled([[3, 999, 999, 999], [5, 999, 7, 999]]), filled([[11, 999, 13, 999], [17, 999, 999, 999]])]
    rank0, rank1 = ll_combine(results, ys, BAD_TOPK_IDXS, BAD_WEIGHTS, NUM_EXPERTS, BAD_MAX_TOKENS)
    # rank 0: t0 = 0.5*17 (expert 3) + 0.25*5 (expert 1), its repeat of expert 3 (w=8) skipped;
    #         t1 = 1.5*3 (expert 0) + 2*11 (expert 2), its repeat of expert 0 (w=16) skipped.
    # rank 1: t0 = 4*13 (expert 2 once, not 4 + 32 + 64 times it); t1 = 9*7 (only expert 1 is valid).
    assert torch.equal(rank0, torch.tensor([9.75, 26.5]).unsqueeze(1).expand(-1, HIDDEN).bfloat16())
    assert torch.equal(rank1, torch.tensor([52.0, 63.0]).unsqueeze(1).expand(-1, HIDDEN).bfloat16())


def test_combine_rejects_mismatched_outputs():
    results = ll_dispatch(tokens([[1, 2, 3], [11, 12, 13]]), TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS)
    with pytest.raises(ValueError, match=r"ys\[0\] must be bfloat16 \[2, 6, 128\]"):
        ll_combine(results, [torch.zeros(2, 5, HIDDEN).bfloat16()] * 2, TOPK_IDXS, WEIGHTS, NUM_EXPERTS, NUM_MAX_TOKENS)
    with pytest.raises(ValueError, match="lacks a token"):
        ll_combine(results, [filled([[0] * 6] * 2)] * 2, TOPK_IDXS[::-1], WEIGHTS, NUM_EXPERTS, NUM_MAX_TOKENS)
