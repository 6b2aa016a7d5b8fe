"""Hand-worked cases for the low-latency reference model (R=2, E=4, L=2, K=2, T_ll=3).

Routing (expert e lives on rank e // 2, local id e % 2):
  rank 0: token 0 → [0, 3], token 1 → [2, 3], token 2 → [-1, 1]
  rank 1: token 0 → [1, 0], token 1 → [-1, -1], token 2 → [3, -1]
recv_layout="per_source": receive rows of source s start at s * T_ll = 3 s.
recv_layout="compact" (the default): an expert's rows are packed from row 0, source 0's first.
"""

import numpy as np
import pytest
import torch

from deep_ep.fp8 import per_token_cast_to_fp8
from deep_ep.testing.data import make_group_inputs
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
    rank0, rank1 = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=False, recv_layout="per_source")
    assert rank0["src_rank"].tolist() == [[0, -1, -1, 1, -1, -1], [0, -1, -1, 1, -1, -1]]
    assert rank1["src_rank"].tolist() == [[0, -1, -1, -1, -1, -1], [0, 0, -1, 1, -1, -1]]
    assert rank0["src_token"].tolist() == [[0, -1, -1, 0, -1, -1], [2, -1, -1, 0, -1, -1]]
    assert rank0["topk_slot"].tolist() == [[0, -1, -1, 1, -1, -1], [1, -1, -1, 0, -1, -1]]
    assert rank1["src_token"].tolist() == [[1, -1, -1, -1, -1, -1], [0, 1, -1, 2, -1, -1]]
    assert rank1["topk_slot"].tolist() == [[0, -1, -1, -1, -1, -1], [1, 1, -1, 0, -1, -1]]
    expected_rank1 = torch.zeros(2, 6, HIDDEN)
    expected_rank1[0, 0] = 2 * PATTERN
    expected_rank1[1, 0], expected_rank1[1, 1], expected_rank1[1, 3] = PATTERN, 2 * PATTERN, 13 * PATTERN
    assert rank1["x"].dtype == torch.bfloat16 and torch.equal(rank1["x"].float(), expected_rank1)
    assert rank1["x_scales"] is None


def test_dispatch_packs_compact_rows_by_source_then_token():
    xs = tokens([[1, 2, 3], [11, 12, 13]])
    rank0, rank1 = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=False)
    assert rank0["src_rank"].tolist() == [[0, 1, -1, -1, -1, -1], [0, 1, -1, -1, -1, -1]]
    assert rank0["src_token"].tolist() == [[0, 0, -1, -1, -1, -1], [2, 0, -1, -1, -1, -1]]
    assert rank0["topk_slot"].tolist() == [[0, 1, -1, -1, -1, -1], [1, 0, -1, -1, -1, -1]]
    assert rank1["src_rank"].tolist() == [[0, -1, -1, -1, -1, -1], [0, 0, 1, -1, -1, -1]]
    assert rank1["src_token"].tolist() == [[1, -1, -1, -1, -1, -1], [0, 1, 2, -1, -1, -1]]
    assert rank1["topk_slot"].tolist() == [[0, -1, -1, -1, -1, -1], [1, 1, 0, -1, -1, -1]]
    expected_rank1 = torch.zeros(2, 6, HIDDEN)
    expected_rank1[0, 0] = 2 * PATTERN
    expected_rank1[1, 0], expected_rank1[1, 1], expected_rank1[1, 2] = PATTERN, 2 * PATTERN, 13 * PATTERN
    assert rank1["x"].dtype == torch.bfloat16 and torch.equal(rank1["x"].float(), expected_rank1)
    assert rank1["count"].tolist() == [1, 3] and rank1["count_per_source"].tolist() == [[1, 0], [2, 1]]


def test_layout_range_holds_begin_and_count_of_each_source_block():
    xs = tokens([[1, 2, 3], [11, 12, 13]])
    compact = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=False)
    per_source = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=False, recv_layout="per_source")
    assert compact[0]["layout_range"].dtype == torch.int64
    # Compact begins are the exclusive prefix sums of the counts over sources; per-source ones s * T_ll.
    assert compact[0]["layout_range"].tolist() == [[(0 << 32) | 1, (1 << 32) | 1], [(0 << 32) | 1, (1 << 32) | 1]]
    assert compact[1]["layout_range"].tolist() == [[(0 << 32) | 1, (1 << 32) | 0], [(0 << 32) | 2, (2 << 32) | 1]]
    assert per_source[0]["layout_range"].tolist() == [[1, (3 << 32) | 1], [1, (3 << 32) | 1]]
    assert per_source[1]["layout_range"].tolist() == [[1, (3 << 32) | 0], [2, (3 << 32) | 1]]


def test_dispatch_counts_per_expert_and_per_source():
    results = ll_dispatch(tokens([[1, 2, 3], [11, 12, 13]]), TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS)
    assert results[0]["count"].dtype == torch.int32
    assert results[0]["count"].tolist() == [2, 2] and results[0]["count_per_source"].tolist() == [[1, 1], [1, 1]]
    assert results[1]["count"].tolist() == [1, 3] and results[1]["count_per_source"].tolist() == [[1, 0], [2, 1]]


def test_valid_row_mask_marks_exactly_the_dispatched_rows():
    xs = tokens([[1, 2, 3], [11, 12, 13]])
    rank0, _ = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, recv_layout="per_source")
    mask = ll_valid_row_mask(rank0)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[True, False, False, True, False, False]] * 2
    _, rank1 = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS)
    assert ll_valid_row_mask(rank1).tolist() == [[True] + [False] * 5, [True] * 3 + [False] * 3]


def test_fp8_dispatch_casts_each_source_row():
    # Row values v * PATTERN: amax v, so q = 448 * PATTERN and scale = v / 448 (exact for these v).
    xs = tokens([[7, 14, 28], [56, 112, 224]])
    _, rank1 = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=True, recv_layout="per_source")
    assert rank1["x"].dtype == torch.float8_e4m3fn
    assert rank1["x_scales"].squeeze(2).tolist() == [[1 / 32, 0, 0, 0, 0, 0], [1 / 64, 1 / 32, 0, 1 / 2, 0, 0]]
    valid = ll_valid_row_mask(rank1)
    assert torch.equal(rank1["x"][valid].float(), (448 * PATTERN).expand(4, -1))
    assert rank1["x"][~valid].view(torch.uint8).eq(0).all()


def test_fp8_dispatch_scale_uses_correctly_rounded_division():
    xs = tokens([[3, 3, 3], [3, 3, 3]])
    rank0, _ = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=True)
    assert rank0["x_scales"][0, 0, 0].item() == float(np.float32(3.0) / np.float32(448.0))


def test_round_scale_dispatch_sends_power_of_two_scales():
    # Amax 3: scale 3/448 without round_scale, 2^ceil(log2(3/448)) = 2^-7 with it (q = 3 * 128 = 384).
    # Amax 7: 7 * fp32(1/448) is exactly 2^-6, so the scale stays 1/64 (q = 448).
    xs = tokens([[3, 3, 3], [7, 7, 7]])
    rank0, _ = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, round_scale=True)
    assert rank0["x_scales"].squeeze(2).tolist() == [[2.0**-7, 2.0**-6, 0, 0, 0, 0], [2.0**-7, 2.0**-6, 0, 0, 0, 0]]
    assert rank0["x"][0, 0].float()[:4].tolist() == [384.0, 192.0, -96.0, 48.0]
    assert torch.equal(rank0["x"][0, 1].float(), 448 * PATTERN)


def test_round_scale_dispatch_rows_equal_the_rounded_cast_of_the_source_token():
    group = make_group_inputs(3, 8, 256, 6, 2, seed=11)
    for layout in ("compact", "per_source"):
        results = ll_dispatch(group.x, group.topk_idx, 6, 8, round_scale=True, recv_layout=layout)
        casts = [per_token_cast_to_fp8(x, round_scale=True) for x in group.x]
        for result in results:
            valid = ll_valid_row_mask(result)
            origins = list(zip(result["src_rank"][valid].tolist(), result["src_token"][valid].tolist(), strict=True))
            want_x = torch.stack([casts[s][0][t].view(torch.uint8) for s, t in origins])
            want_scales = torch.stack([casts[s][1][t] for s, t in origins])
            assert torch.equal(result["x"][valid].view(torch.uint8), want_x)
            assert torch.equal(result["x_scales"][valid], want_scales)


@pytest.mark.parametrize(
    "layout, ys_values",
    [
        (
            "per_source",
            [
                [[2, 999, 999, 4, 999, 999], [8, 999, 999, 16, 999, 999]],
                [[3, 999, 999, 999, 999, 999], [5, 6, 999, 7, 999, 999]],
            ],
        ),
        (
            "compact",
            [
                [[2, 4, 999, 999, 999, 999], [8, 16, 999, 999, 999, 999]],
                [[3, 999, 999, 999, 999, 999], [5, 6, 7, 999, 999, 999]],
            ],
        ),
    ],
)
def test_combine_weights_each_expert_output_and_sums_slots(layout, ys_values):
    xs = tokens([[1, 2, 3], [11, 12, 13]])
    results = ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=False, recv_layout=layout)
    ys = [filled(values) for values in ys_values]
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


RESULT_TENSORS = (
    "x",
    "x_scales",
    "count",
    "count_per_source",
    "src_rank",
    "src_token",
    "topk_slot",
    "layout_range",
)


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
    rank0, rank1 = ll_dispatch(xs, BAD_TOPK_IDXS, NUM_EXPERTS, BAD_MAX_TOKENS, use_fp8=False, recv_layout="per_source")
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


@pytest.mark.parametrize("layout", ["compact", "per_source"])
def test_dispatch_of_bad_ids_equals_that_of_the_sanitized_routing(layout):
    xs = tokens([[1, 2], [11, 12]])
    clean = [sanitize_topk_idx(t, NUM_EXPERTS) for t in BAD_TOPK_IDXS]
    got = ll_dispatch(xs, BAD_TOPK_IDXS, NUM_EXPERTS, BAD_MAX_TOKENS, recv_layout=layout)
    want = ll_dispatch(xs, clean, NUM_EXPERTS, BAD_MAX_TOKENS, recv_layout=layout)
    for got_rank, want_rank in zip(got, want, strict=True):
        for key in RESULT_TENSORS:
            assert torch.equal(got_rank[key].view(torch.uint8), want_rank[key].view(torch.uint8)), key


def test_combine_sums_a_repeated_expert_once_with_the_weight_of_its_first_slot():
    xs = tokens([[1, 2], [11, 12]])
    results = ll_dispatch(xs, BAD_TOPK_IDXS, NUM_EXPERTS, BAD_MAX_TOKENS, use_fp8=False, recv_layout="per_source")
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
    short = [TOPK_IDXS[0][:2], TOPK_IDXS[1]]
    with pytest.raises(ValueError, match=r"holds token 2 of rank 0, which has only 2 tokens"):
        ll_combine(results, [filled([[0] * 6] * 2)] * 2, short, [WEIGHTS[0][:2], WEIGHTS[1]], NUM_EXPERTS, 3)


def test_dispatch_rejects_an_unknown_layout_and_round_scale_without_fp8():
    xs = tokens([[1, 2, 3], [11, 12, 13]])
    with pytest.raises(ValueError, match=r"recv_layout must be one of \('compact', 'per_source'\), got 'packed'"):
        ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, recv_layout="packed")
    with pytest.raises(ValueError, match="round_scale=True .* needs use_fp8=True"):
        ll_dispatch(xs, TOPK_IDXS, NUM_EXPERTS, NUM_MAX_TOKENS, use_fp8=False, round_scale=True)


# Random groups: compact and per-source results hold the same rows, only placed differently.
GROUP_CASES = [
    dict(num_ranks=2, num_max_tokens=5, hidden=128, num_experts=4, num_topk=2, seed=0),
    dict(num_ranks=4, num_max_tokens=12, hidden=256, num_experts=16, num_topk=4, seed=1),
    dict(num_ranks=3, num_max_tokens=7, hidden=128, num_experts=9, num_topk=3, seed=2, hot_expert=4),
]


def _group(case: dict, use_fp8: bool = True, round_scale: bool = False) -> tuple[list[dict], list[dict], object]:
    case = dict(case)
    num_ranks, num_max_tokens = case.pop("num_ranks"), case.pop("num_max_tokens")
    hidden, num_experts, num_topk = case.pop("hidden"), case.pop("num_experts"), case.pop("num_topk")
    group = make_group_inputs(num_ranks, num_max_tokens, hidden, num_experts, num_topk, **case)
    kwargs = dict(use_fp8=use_fp8, round_scale=round_scale)
    compact = ll_dispatch(group.x, group.topk_idx, num_experts, num_max_tokens, **kwargs)
    per_source = ll_dispatch(group.x, group.topk_idx, num_experts, num_max_tokens, recv_layout="per_source", **kwargs)
    return compact, per_source, group


def _rows_by_origin(result: dict) -> dict:
    """(local expert, source rank, source token) → receive row, over the valid rows."""
    local_ids, rows = ll_valid_row_mask(result).nonzero(as_tuple=True)
    sources, source_tokens = result["src_rank"][local_ids, rows].tolist(), result["src_token"][local_ids, rows].tolist()
    origins = zip(local_ids.tolist(), sources, source_tokens, strict=True)
    return {origin: row for origin, row in zip(origins, rows.tolist(), strict=True)}


def _relayout(y: torch.Tensor, src: dict, dst: dict) -> torch.Tensor:
    """``y`` laid out like ``src``'s rows, moved to ``dst``'s rows (other rows NaN)."""
    moved = torch.full_like(y, float("nan"))
    dst_rows = _rows_by_origin(dst)
    for (local, source, token), row in _rows_by_origin(src).items():
        moved[local, dst_rows[(local, source, token)]] = y[local, row]
    return moved


@pytest.mark.parametrize("case", GROUP_CASES)
@pytest.mark.parametrize("round_scale", [False, True])
def test_compact_and_per_source_hold_the_same_rows(case, round_scale):
    compact, per_source, _ = _group(case, round_scale=round_scale)
    for packed, spread in zip(compact, per_source, strict=True):
        packed_rows, spread_rows = _rows_by_origin(packed), _rows_by_origin(spread)
        assert packed_rows.keys() == spread_rows.keys()
        for key in ("count", "count_per_source"):
            assert torch.equal(packed[key], spread[key])
        for (local, source, token), row in packed_rows.items():
            other = spread_rows[(local, source, token)]
            assert torch.equal(packed["x"][local, row].view(torch.uint8), spread["x"][local, other].view(torch.uint8))
            assert torch.equal(packed["x_scales"][local, row], spread["x_scales"][local, other])
            assert packed["topk_slot"][local, row] == spread["topk_slot"][local, other]
        # Invalid rows carry nothing.
        invalid = ~ll_valid_row_mask(packed)
        assert packed["src_rank"][invalid].eq(-1).all() and packed["topk_slot"][invalid].eq(-1).all()
        assert packed["x"][invalid].view(torch.uint8).eq(0).all() and packed["x_scales"][invalid].eq(0).all()


@pytest.mark.parametrize("case", GROUP_CASES)
def test_compact_rows_are_packed_and_ordered_by_source_then_token(case):
    compact, _, _ = _group(case)
    for result in compact:
        for local, count in enumerate(result["count"].tolist()):
            valid = ll_valid_row_mask(result)[local]
            assert valid[:count].all() and not valid[count:].any()
            sources, source_tokens = (
                result["src_rank"][local, :count].tolist(),
                result["src_token"][local, :count].tolist(),
            )
            order = list(zip(sources, source_tokens, strict=True))
            assert order == sorted(order) and len(set(order)) == count


@pytest.mark.parametrize("case", GROUP_CASES)
def test_layout_range_is_consistent_with_counts_and_rows(case):
    compact, per_source, _ = _group(case)
    num_max_tokens = case["num_max_tokens"]
    for layout, results in (("compact", compact), ("per_source", per_source)):
        for result in results:
            layout_range = result["layout_range"]
            begin, count = layout_range >> 32, layout_range & 0xFFFFFFFF
            assert torch.equal(count, result["count_per_source"].long())
            num_sources = count.shape[1]
            if layout == "compact":
                assert torch.equal(begin, count.cumsum(dim=1) - count)
            else:
                assert torch.equal(begin, (torch.arange(num_sources) * num_max_tokens).expand_as(begin))
            for local in range(count.shape[0]):
                for source in range(num_sources):
                    first, n = int(begin[local, source]), int(count[local, source])
                    assert result["src_rank"][local, first : first + n].eq(source).all()
                    assert torch.equal(
                        result["src_token"][local, first : first + n].sort().values,
                        result["src_token"][local, first : first + n],
                    )
                    assert int((result["src_rank"][local] == source).sum()) == n


@pytest.mark.parametrize("case", GROUP_CASES)
def test_combine_is_identical_for_both_layouts(case):
    compact, per_source, group = _group(case, use_fp8=False)
    num_experts, num_max_tokens = case["num_experts"], case["num_max_tokens"]
    generator = torch.Generator().manual_seed(case["seed"] + 100)
    # Expert outputs on the valid rows only: NaN elsewhere proves combine reads no other row.
    ys_spread = [_relayout(torch.randn(r["x"].shape, generator=generator).bfloat16(), r, r) for r in per_source]
    ys_packed = [_relayout(y, spread, packed) for y, spread, packed in zip(ys_spread, per_source, compact, strict=True)]
    want = ll_combine(per_source, ys_spread, group.topk_idx, group.topk_weights, num_experts, num_max_tokens)
    got = ll_combine(compact, ys_packed, group.topk_idx, group.topk_weights, num_experts, num_max_tokens)
    for got_rank, want_rank in zip(got, want, strict=True):
        assert torch.equal(got_rank.view(torch.int16), want_rank.view(torch.int16))
        assert not got_rank.isnan().any()
