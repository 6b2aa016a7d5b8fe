"""Hand-worked cases for the high-throughput reference model (R=2, E=4, L=2, K=2).

Routing used throughout (expert e lives on rank e // 2, local id e % 2):
  rank 0: token 0 → experts [0, 3] (ranks 0 and 1), token 1 → [2, 3] (rank 1 twice → sent once),
          token 2 → [-1, 1] (rank 0)
  rank 1: token 0 → [1, 0] (rank 0 twice), token 1 → [-1, -1] (nowhere), token 2 → [3, -1] (rank 1)
Token rows are constant: rank 0 tokens hold 1, 2, 3; rank 1 tokens hold 11, 12, 13.
"""

import pytest
import torch

from deep_ep.testing.reference import ht_combine, ht_dispatch, sanitize_topk_idx
from deep_ep.testing.reference_ht import ht_expanded_row_idx, ht_src_info, v2_recv_src_metadata
from deep_ep.testing.reference_v2 import (
    combine_inputs_from_lanes,
    lanes_by_rank,
    make_lane_outputs,
    v2_combine,
    v2_lane_partials,
)

NUM_EXPERTS = 4
HIDDEN = 128
TOPK_IDXS = [torch.tensor([[0, 3], [2, 3], [-1, 1]]), torch.tensor([[1, 0], [-1, -1], [3, -1]])]
WEIGHTS = [torch.tensor([[0.5, 0.25], [1.5, 2.0], [3.0, 0.75]]), torch.tensor([[4.0, 5.0], [6.0, 7.0], [8.0, 9.0]])]


def rows(*values: float, hidden: int = HIDDEN) -> torch.Tensor:
    """bf16 [len(values), H] whose row i is filled with values[i]."""
    return torch.tensor(values, dtype=torch.float32).unsqueeze(1).expand(-1, hidden).bfloat16()


def tokens() -> list[torch.Tensor]:
    return [rows(1, 2, 3), rows(11, 12, 13)]


def dispatch(**kwargs) -> list[dict]:
    return ht_dispatch(tokens(), TOPK_IDXS, WEIGHTS, NUM_EXPERTS, **kwargs)


def test_dispatch_orders_rows_by_source_rank_then_token():
    rank0, rank1 = dispatch()
    assert torch.equal(rank0["x"], rows(1, 3, 11))
    assert rank0["src_rank"].tolist() == [0, 0, 1] and rank0["src_token"].tolist() == [0, 2, 0]
    assert torch.equal(rank1["x"], rows(1, 2, 13))
    assert rank1["src_rank"].tolist() == [0, 0, 1] and rank1["src_token"].tolist() == [0, 1, 2]
    assert rank0["x_scales"] is None and rank1["x_scales"] is None


def test_dispatch_maps_topk_idx_to_local_ids_and_minus_one_elsewhere():
    rank0, rank1 = dispatch()
    assert rank0["topk_idx"].tolist() == [[0, -1], [-1, 1], [1, 0]]
    assert rank1["topk_idx"].tolist() == [[-1, 1], [0, 1], [1, -1]]
    assert rank0["topk_idx"].dtype == torch.int64


def test_dispatch_carries_full_weight_rows_unchanged():
    rank0, rank1 = dispatch()
    assert rank0["topk_weights"].tolist() == [[0.5, 0.25], [3.0, 0.75], [4.0, 5.0]]
    assert rank1["topk_weights"].tolist() == [[0.5, 0.25], [1.5, 2.0], [8.0, 9.0]]


def test_dispatch_without_weights_returns_none():
    rank0, _ = ht_dispatch(tokens(), TOPK_IDXS, None, NUM_EXPERTS)
    assert rank0["topk_weights"] is None


def test_dispatch_counts_a_token_once_per_rank_and_aligns_expert_counts():
    rank0, rank1 = dispatch(expert_alignment=4)
    assert rank0["num_recv_tokens_per_rank"] == [2, 1]
    assert rank0["num_recv_tokens_per_expert"] == [2, 2]
    assert rank0["num_recv_tokens_per_expert_aligned"] == [4, 4]
    # Rank 0's token 1 selects both experts of rank 1 but arrives once.
    assert rank1["num_recv_tokens_per_rank"] == [2, 1]
    assert rank1["num_recv_tokens_per_expert"] == [1, 3]
    assert rank1["num_recv_tokens_per_expert_aligned"] == [4, 4]


def test_dispatch_moves_fp8_payload_with_its_scales():
    fp8_tokens = [(x.float().div(8).to(torch.float8_e4m3fn), torch.full((3, 1), 0.0)) for x in tokens()]
    for rank, (_, scales) in enumerate(fp8_tokens):
        scales[:, 0] = torch.tensor([1.0, 2.0, 3.0]) + 10 * rank
    rank0, rank1 = ht_dispatch(fp8_tokens, TOPK_IDXS, WEIGHTS, NUM_EXPERTS)
    assert rank0["x"].dtype == torch.float8_e4m3fn
    assert torch.equal(rank0["x"].float(), rows(1, 3, 11).float().div(8).to(torch.float8_e4m3fn).float())
    assert rank0["x_scales"].tolist() == [[1.0], [3.0], [11.0]]
    assert rank1["x_scales"].tolist() == [[1.0], [2.0], [13.0]]


def test_expand_groups_rows_by_local_expert_with_aligned_zero_padding():
    rank0, rank1 = dispatch(expert_alignment=4, do_expand=True)
    assert torch.equal(rank0["x"], rows(1, 11, 0, 0, 3, 11, 0, 0))
    assert rank0["local_expert"].tolist() == [0, 0, -1, -1, 1, 1, -1, -1]
    assert rank0["src_rank"].tolist() == [0, 1, -1, -1, 0, 1, -1, -1]
    assert rank0["src_token"].tolist() == [0, 0, -1, -1, 2, 0, -1, -1]
    assert rank0["topk_weights"].tolist() == [0.5, 5.0, 0.0, 0.0, 0.75, 4.0, 0.0, 0.0]
    assert torch.equal(rank1["x"], rows(2, 0, 0, 0, 1, 2, 13, 0))
    assert rank1["local_expert"].tolist() == [0, -1, -1, -1, 1, 1, 1, -1]
    assert rank1["src_rank"].tolist() == [0, -1, -1, -1, 0, 0, 1, -1]
    assert rank1["src_token"].tolist() == [1, -1, -1, -1, 0, 1, 2, -1]
    assert rank1["topk_weights"].tolist() == [1.5, 0.0, 0.0, 0.0, 0.25, 2.0, 8.0, 0.0]
    assert rank1["num_recv_tokens_per_expert"] == [1, 3]
    assert rank1["num_recv_tokens_per_expert_aligned"] == [4, 4]
    assert rank1["num_recv_tokens_per_rank"] == [2, 1]
    assert "topk_idx" not in rank1


def test_expand_without_alignment_packs_groups():
    rank0, rank1 = dispatch(do_expand=True)
    assert torch.equal(rank0["x"], rows(1, 11, 3, 11))
    assert rank0["local_expert"].tolist() == [0, 0, 1, 1]
    assert torch.equal(rank1["x"], rows(2, 1, 2, 13))


def test_expand_pads_fp8_scales_with_zero():
    fp8_tokens = [(x.float().to(torch.float8_e4m3fn), torch.ones(3, 1) * (rank + 2)) for rank, x in enumerate(tokens())]
    rank0, _ = ht_dispatch(fp8_tokens, TOPK_IDXS, None, NUM_EXPERTS, expert_alignment=4, do_expand=True)
    assert rank0["x_scales"].squeeze(1).tolist() == [2.0, 3.0, 0.0, 0.0, 2.0, 3.0, 0.0, 0.0]
    assert rank0["x"].view(torch.uint8)[2:4].eq(0).all() and rank0["topk_weights"] is None


def test_dispatch_handles_a_rank_without_tokens():
    topk_idxs = [torch.tensor([[3, 0]]), torch.zeros(0, 2, dtype=torch.int64)]
    results = ht_dispatch([rows(5), rows(hidden=HIDDEN)], topk_idxs, None, NUM_EXPERTS)
    assert [r["num_recv_tokens_per_rank"] for r in results] == [[1, 0], [1, 0]]
    combined = ht_combine(results, [r["x"] for r in results], topk_idxs, NUM_EXPERTS)
    assert torch.equal(combined[0]["x"], rows(10)) and list(combined[1]["x"].shape) == [0, HIDDEN]


def test_combine_sums_contributions_of_every_destination():
    results = dispatch()
    ys = [rows(1, 3, 11), rows(2, 4, 26)]  # each received row times (destination rank + 1)
    rank0, rank1 = ht_combine(results, ys, TOPK_IDXS, NUM_EXPERTS)
    assert torch.equal(rank0["x"], rows(1 + 2, 4, 3))
    assert torch.equal(rank1["x"], rows(11, 0, 26))
    assert rank0["topk_weights"] is None


def test_combine_adds_one_or_two_biases_before_contributions():
    results = dispatch()
    ys = [rows(1, 3, 11), rows(2, 4, 26)]
    biases = [(rows(1, 2, 3), rows(0.25, 0.25, 0.25)), rows(1, 1, 1)]
    rank0, rank1 = ht_combine(results, ys, TOPK_IDXS, NUM_EXPERTS, biases=biases)
    assert torch.equal(rank0["x"], rows(4.25, 6.25, 6.25))
    # Rank 1's token 1 went nowhere: it gets its bias only.
    assert torch.equal(rank1["x"], rows(12, 1, 27))


def test_combine_rounds_to_bf16_once_after_summing_in_fp32():
    # Token (0, 0): bias 2^-9, then 1 (rank 0), then 2^-8 (rank 1). fp32 holds 1 + 3 * 2^-9,
    # which rounds to 1 + 2^-7; rounding after every add would give 1 (the second add is a tie).
    results = dispatch()
    ys = [rows(1, 0, 0), rows(2.0**-8, 0, 0)]
    biases = [rows(2.0**-9, 0, 0), None]
    rank0, _ = ht_combine(results, ys, TOPK_IDXS, NUM_EXPERTS, biases=biases)
    assert rank0["x"][0, 0].item() == 1 + 2.0**-7


def test_combine_adds_ranks_in_order_of_their_last_lane():
    # DeepEP V2's order. R=3, E=6 (L=2), K=4: rank 0's token picks experts [3, 0, 4, 2], on ranks
    # [1, 0, 2, 1]: last lanes r0 -> 1, r2 -> 2, r1 -> 3. With c0 = 2^24, c1 = 1, c2 = -2^24:
    # (2^24 - 2^24) + 1 = 1. Ascending ranks (2^24 + 1 = 2^24, a tie to even, then - 2^24) and first
    # lanes (r1, r0, r2: 1 + 2^24 = 2^24, then - 2^24) both give 0.
    topk_idxs = [torch.tensor([[3, 0, 4, 2]])] + [torch.zeros(0, 4, dtype=torch.int64)] * 2
    results = ht_dispatch([rows(1), rows(hidden=HIDDEN), rows(hidden=HIDDEN)], topk_idxs, None, 6)
    ys = [rows(2.0**24), rows(1), rows(-(2.0**24))]
    rank0 = ht_combine(results, ys, topk_idxs, 6)[0]
    assert torch.equal(rank0["x"], rows(1))
    # The biases still come first: 0.5 + 2^24 = 2^24 (0.5 lost), - 2^24, + 1.
    biased = ht_combine(results, ys, topk_idxs, 6, biases=[rows(0.5), None, None])[0]
    assert torch.equal(biased["x"], rows(1))


def test_combine_gathers_weights_from_the_rank_owning_each_expert():
    results = dispatch()
    ys = [r["x"] for r in results]
    weights_list = [
        torch.tensor([[10.0, 11.0], [12.0, 13.0], [14.0, 15.0]]),
        torch.tensor([[20.0, 21.0], [22.0, 23.0], [24.0, 25.0]]),
    ]
    rank0, rank1 = ht_combine(results, ys, TOPK_IDXS, NUM_EXPERTS, weights_list=weights_list)
    assert rank0["topk_weights"].tolist() == [[10.0, 21.0], [22.0, 23.0], [0.0, 13.0]]
    assert rank1["topk_weights"].tolist() == [[14.0, 15.0], [0.0, 0.0], [24.0, 0.0]]


def test_expand_combine_sums_expert_rows_and_ignores_padding():
    results = dispatch(expert_alignment=4, do_expand=True)
    # Each expanded row times (local expert + 1); padding rows hold 999.
    ys = [rows(1, 11, 999, 999, 6, 22, 999, 999), rows(2, 999, 999, 999, 2, 4, 26, 999)]
    weights_list = [
        torch.tensor([10.0, 11.0, -1, -1, 12.0, 13.0, -1, -1]),
        torch.tensor([20.0, -1, -1, -1, 21.0, 22.0, 23.0, -1]),
    ]
    rank0, rank1 = ht_combine(results, ys, TOPK_IDXS, NUM_EXPERTS, weights_list=weights_list, do_expand=True)
    assert torch.equal(rank0["x"], rows(3, 6, 6))
    assert torch.equal(rank1["x"], rows(33, 0, 26))
    assert rank0["topk_weights"].tolist() == [[10.0, 21.0], [20.0, 22.0], [0.0, 12.0]]
    assert rank1["topk_weights"].tolist() == [[13.0, 11.0], [0.0, 0.0], [23.0, 0.0]]


def test_expand_combine_rounds_each_rank_partial_to_bf16():
    # Token (0, 1) has experts l0 and l1 on rank 1: partial 1 + 2^-8 rounds (tie, even) to 1 before
    # travelling; with bias 2^-9 the total is 1 + 2^-9 → 1. Without the partial rounding it
    # would be 1 + 3 * 2^-9 → 1 + 2^-7.
    results = dispatch(expert_alignment=4, do_expand=True)
    ys = [rows(0, 0, 0, 0, 0, 0, 0, 0), rows(1, 0, 0, 0, 0, 2.0**-8, 0, 0)]
    biases = [rows(0, 2.0**-9, 0), None]
    rank0, _ = ht_combine(results, ys, TOPK_IDXS, NUM_EXPERTS, biases=biases, do_expand=True)
    assert rank0["x"][1, 0].item() == 1.0


def test_expand_combine_sums_a_ranks_rows_in_lane_order():
    # R=2, E=8 (L=4), K=4: rank 0's token picks experts [2, 0, 5, 1]. Rank 0's expanded rows, in row
    # (= local expert) order: l0 = 2^24 (lane 1), l1 = 1 (lane 3), l2 = -2^24 (lane 0). Lane order:
    # (-2^24 + 2^24) + 1 = 1; row order: 2^24 + 1 = 2^24 (tie, even), then 0. Rank 1 adds 0.
    topk_idxs = [torch.tensor([[2, 0, 5, 1]]), torch.zeros(0, 4, dtype=torch.int64)]
    results = ht_dispatch([rows(1), rows(hidden=HIDDEN)], topk_idxs, None, 8, do_expand=True)
    assert [r["local_expert"].tolist() for r in results] == [[0, 1, 2], [1]]
    ys = [rows(2.0**24, 1, -(2.0**24)), rows(0)]
    rank0 = ht_combine(results, ys, topk_idxs, 8, do_expand=True)[0]
    assert torch.equal(rank0["x"], rows(1))


def test_dispatch_rejects_topk_idx_that_is_not_int64_t_by_k():
    with pytest.raises(ValueError, match=r"topk_idxs\[0\] must be int64"):
        ht_dispatch(tokens(), [TOPK_IDXS[0].int(), TOPK_IDXS[1]], None, NUM_EXPERTS)
    with pytest.raises(ValueError, match=r"topk_idxs\[1\] must be int64 \[3, K\]"):
        ht_dispatch(tokens(), [TOPK_IDXS[0], TOPK_IDXS[1][:2]], None, NUM_EXPERTS)


# Repeated and out-of-range ids (R=2, E=4, K=3). Only the first occurrence of an expert in a row
# counts; ids outside [-1, 4) count as -1:
#   rank 0: token 0 → [3, 1, 3] ≡ [3, 1, -1], token 1 → [0, 0, 2] ≡ [0, -1, 2]
#   rank 1: token 0 → [2, 2, 2] ≡ [2, -1, -1], token 1 → [5, -2, 1] ≡ [-1, -1, 1]
BAD_TOPK_IDXS = [torch.tensor([[3, 1, 3], [0, 0, 2]]), torch.tensor([[2, 2, 2], [5, -2, 1]])]
SANITIZED_TOPK_IDXS = [torch.tensor([[3, 1, -1], [0, -1, 2]]), torch.tensor([[2, -1, -1], [-1, -1, 1]])]
BAD_WEIGHTS = [
    torch.tensor([[0.5, 0.25, 8.0], [1.5, 16.0, 2.0]]),
    torch.tensor([[4.0, 32.0, 64.0], [6.0, 7.0, 9.0]]),
]


def bad_routing_tokens() -> list[torch.Tensor]:
    return [rows(1, 2), rows(11, 12)]


def test_sanitize_keeps_the_first_occurrence_and_drops_repeats_and_out_of_range_ids():
    topk_idx = torch.tensor([[1, 1, 1], [2, -1, 2], [-1, -1, 3], [0, 4, 0], [-5, 3, 3], [3, 2, 1]], dtype=torch.int32)
    original = topk_idx.clone()
    sanitized = sanitize_topk_idx(topk_idx, NUM_EXPERTS)
    assert sanitized.dtype == torch.int64 and sanitized.shape == topk_idx.shape
    assert sanitized.tolist() == [[1, -1, -1], [2, -1, -1], [-1, -1, 3], [0, -1, -1], [-1, 3, -1], [3, 2, 1]]
    assert torch.equal(topk_idx, original), "the input must not be modified"
    as_int64 = original.long()
    assert sanitize_topk_idx(as_int64, NUM_EXPERTS).data_ptr() != as_int64.data_ptr(), "must return a copy"
    for bad, sanitized in zip(BAD_TOPK_IDXS, SANITIZED_TOPK_IDXS, strict=True):
        assert torch.equal(sanitize_topk_idx(bad, NUM_EXPERTS), sanitized)


def test_sanitize_rejects_non_integer_ids_and_bad_num_experts():
    with pytest.raises(ValueError, match="integer tensor"):
        sanitize_topk_idx(torch.zeros(2, 2), NUM_EXPERTS)
    with pytest.raises(ValueError, match="integer tensor"):
        sanitize_topk_idx(torch.zeros(4, dtype=torch.int64), NUM_EXPERTS)
    with pytest.raises(TypeError, match="tensor"):
        sanitize_topk_idx([[0, 1]], NUM_EXPERTS)
    with pytest.raises(ValueError, match="num_experts"):
        sanitize_topk_idx(TOPK_IDXS[0], 0)


@pytest.mark.parametrize(
    "topk_idx",
    [
        torch.tensor([[1, 1], [0, -1], [2, 3]]),
        torch.tensor([[0, 4], [0, -1], [2, 3]]),
        torch.tensor([[0, -2], [0, -1], [2, 3]]),
    ],
)
def test_dispatch_and_combine_of_bad_ids_equal_those_of_the_sanitized_routing(topk_idx):
    bad = [topk_idx, TOPK_IDXS[1]]
    clean = [sanitize_topk_idx(t, NUM_EXPERTS) for t in bad]
    for do_expand in (False, True):
        got = ht_dispatch(tokens(), bad, WEIGHTS, NUM_EXPERTS, do_expand=do_expand, expert_alignment=2)
        want = ht_dispatch(tokens(), clean, WEIGHTS, NUM_EXPERTS, do_expand=do_expand, expert_alignment=2)
        for got_rank, want_rank in zip(got, want, strict=True):
            assert got_rank.keys() == want_rank.keys()
            for key, value in want_rank.items():
                same = torch.equal(got_rank[key], value) if isinstance(value, torch.Tensor) else got_rank[key] == value
                assert same, (do_expand, key)
        ys = [r["x"] for r in want]
        weights_list = [r["topk_weights"] for r in want]
        combined_bad = ht_combine(want, ys, bad, NUM_EXPERTS, weights_list=weights_list, do_expand=do_expand)
        combined_clean = ht_combine(want, ys, clean, NUM_EXPERTS, weights_list=weights_list, do_expand=do_expand)
        for got_rank, want_rank in zip(combined_bad, combined_clean, strict=True):
            assert torch.equal(got_rank["x"], want_rank["x"])
            assert torch.equal(got_rank["topk_weights"], want_rank["topk_weights"])


def test_dispatch_sends_a_repeated_expert_once_with_the_repeat_slot_minus_one():
    rank0, rank1 = ht_dispatch(bad_routing_tokens(), BAD_TOPK_IDXS, BAD_WEIGHTS, NUM_EXPERTS)
    # Rank 1 holds experts 2 and 3: rank 0's token 0 picks expert 3 twice and arrives once, its
    # slot 2 (the repeat) reads -1; rank 1's token 0 picks expert 2 three times, slot 0 counts.
    assert torch.equal(rank1["x"], rows(1, 2, 11))
    assert rank1["src_rank"].tolist() == [0, 0, 1] and rank1["src_token"].tolist() == [0, 1, 0]
    assert rank1["topk_idx"].tolist() == [[1, -1, -1], [-1, -1, 0], [0, -1, -1]]
    assert rank1["num_recv_tokens_per_rank"] == [2, 1]
    assert rank1["num_recv_tokens_per_expert"] == [2, 1]
    # Rank 0 holds experts 0 and 1: token 1 of rank 0 picks expert 0 twice; the out-of-range ids of
    # rank 1's token 1 count as -1, its expert 1 still arrives.
    assert torch.equal(rank0["x"], rows(1, 2, 12))
    assert rank0["topk_idx"].tolist() == [[-1, 1, -1], [0, -1, -1], [-1, -1, 1]]
    assert rank0["num_recv_tokens_per_rank"] == [2, 1]
    assert rank0["num_recv_tokens_per_expert"] == [1, 2]
    # Weights travel as the full source row, the repeat's weight included (combine ignores it).
    assert rank1["topk_weights"].tolist() == [[0.5, 0.25, 8.0], [1.5, 16.0, 2.0], [4.0, 32.0, 64.0]]


def test_expand_gives_a_repeated_expert_one_row_weighted_by_its_first_slot():
    rank0, rank1 = ht_dispatch(bad_routing_tokens(), BAD_TOPK_IDXS, BAD_WEIGHTS, NUM_EXPERTS, do_expand=True)
    # Rank 1: local expert 0 (expert 2) gets rank 0's token 1 (slot 2) and rank 1's token 0 (slot 0,
    # not three rows); local expert 1 (expert 3) gets rank 0's token 0 once (slot 0, not slot 2).
    assert torch.equal(rank1["x"], rows(2, 11, 1))
    assert rank1["local_expert"].tolist() == [0, 0, 1]
    assert rank1["src_rank"].tolist() == [0, 1, 0] and rank1["src_token"].tolist() == [1, 0, 0]
    assert rank1["topk_weights"].tolist() == [2.0, 4.0, 0.5]
    assert rank1["num_recv_tokens_per_expert"] == [2, 1]
    assert torch.equal(rank0["x"], rows(2, 1, 12))
    assert rank0["topk_weights"].tolist() == [1.5, 0.25, 9.0]


def test_combine_counts_a_row_with_a_repeated_expert_once():
    for do_expand in (False, True):
        results = ht_dispatch(bad_routing_tokens(), BAD_TOPK_IDXS, None, NUM_EXPERTS, do_expand=do_expand)
        # Identity experts: a token comes back once from each rank holding one of its (first) experts.
        rank0, rank1 = ht_combine(results, [r["x"] for r in results], BAD_TOPK_IDXS, NUM_EXPERTS, do_expand=do_expand)
        assert torch.equal(rank0["x"], rows(1 + 1, 2 + 2)), do_expand
        assert torch.equal(rank1["x"], rows(11, 12)), do_expand


def test_combined_weights_are_zero_in_the_slot_of_a_repeated_or_out_of_range_id():
    for do_expand in (False, True):
        results = ht_dispatch(bad_routing_tokens(), BAD_TOPK_IDXS, BAD_WEIGHTS, NUM_EXPERTS, do_expand=do_expand)
        weights_list = [r["topk_weights"] for r in results]
        rank0, rank1 = ht_combine(
            results,
            [r["x"] for r in results],
            BAD_TOPK_IDXS,
            NUM_EXPERTS,
            weights_list=weights_list,
            do_expand=do_expand,
        )
        assert rank0["topk_weights"].tolist() == [[0.5, 0.25, 0.0], [1.5, 0.0, 2.0]], do_expand
        assert rank1["topk_weights"].tolist() == [[4.0, 0.0, 0.0], [0.0, 0.0, 9.0]], do_expand


def test_dispatch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="multiple of the 2 ranks"):
        ht_dispatch(tokens(), TOPK_IDXS, None, 3)
    with pytest.raises(ValueError, match="expert_alignment"):
        ht_dispatch(tokens(), TOPK_IDXS, None, NUM_EXPERTS, expert_alignment=0)
    with pytest.raises(ValueError, match="mix"):
        ht_dispatch(
            [tokens()[0], (tokens()[1].float().to(torch.float8_e4m3fn), torch.ones(3, 1))], TOPK_IDXS, None, NUM_EXPERTS
        )
    with pytest.raises(ValueError, match="topk_weights_list"):
        ht_dispatch(tokens(), TOPK_IDXS, [WEIGHTS[0], WEIGHTS[1][:2]], NUM_EXPERTS)


def test_combine_rejects_mismatched_inputs():
    results = dispatch()
    with pytest.raises(ValueError, match=r"ys\[1\] must be bfloat16 \[3, 128\]"):
        ht_combine(results, [rows(1, 2, 3), rows(1, 2)], TOPK_IDXS, NUM_EXPERTS)
    with pytest.raises(ValueError, match="do_expand=True"):
        ht_combine(results, [rows(1, 2, 3), rows(1, 2, 3)], TOPK_IDXS, NUM_EXPERTS, do_expand=True)
    with pytest.raises(ValueError, match="does not hold"):
        ht_combine(results, [rows(1, 2, 3), rows(1, 2, 3)], TOPK_IDXS[::-1], NUM_EXPERTS)


# Hybrid combine order (num_ranks_per_node = S < R), DeepEP V2's: per token, each node's destination
# ranks are summed in fp32 in order of their last top-k lane and rounded to bf16 once, then biases and
# node partials (in order of each node's last lane) are summed in fp32 and rounded once. R=4, E=4
# (L=1, expert e on rank e), K=3, S=2: nodes {0, 1} and {2, 3}.
#   rank 0: token 0 → [2, 0, 1] (ranks 0, 1 on node 0; rank 2 on node 1), token 1 → [3, -1, -1]
#           (node 1 only), token 2 → [-1, -1, -1] (nowhere)
#   ranks 1, 2: no tokens; rank 3: token 0 → [0, 3, 1] (ranks 0, 1 on node 0; rank 3 on node 1)
# Received rows, ordered (source rank, token): rank 0: (0,0) (3,0); rank 1: (0,0) (3,0);
# rank 2: (0,0); rank 3: (0,1) (3,0).
HYBRID_EXPERTS = 4
HYBRID_TOPK_IDXS = [
    torch.tensor([[2, 0, 1], [3, -1, -1], [-1, -1, -1]]),
    torch.zeros(0, 3, dtype=torch.int64),
    torch.zeros(0, 3, dtype=torch.int64),
    torch.tensor([[0, 3, 1]]),
]
# Token (0, 0): c0 = 1, c1 = 2^-8 (node 0), c2 = 2^-8 (node 1). Direct: 1 + 2^-7 exactly.
# Hybrid: P0 = bf16(1 + 2^-8) = 1 (tie, even), P1 = 2^-8, out = bf16(1 + 2^-8) = 1.
# Token (3, 0): c0 = 256, c1 = 1 (node 0), c3 = -256 (node 1). Direct: 1. Hybrid: P0 = bf16(257)
# = 256 (tie, even: bf16 steps by 2 there), P1 = -256, out = 0.
HYBRID_YS = [rows(1, 256), rows(2.0**-8, 1), rows(2.0**-8), rows(5, -256)]


def hybrid_dispatch(**kwargs) -> list[dict]:
    xs = [rows(1, 2, 3), rows(hidden=HIDDEN), rows(hidden=HIDDEN), rows(4)]
    return ht_dispatch(xs, HYBRID_TOPK_IDXS, None, HYBRID_EXPERTS, **kwargs)


def test_hybrid_combine_rounds_each_node_partial_to_bf16():
    results = hybrid_dispatch()
    assert [r["src_rank"].tolist() for r in results] == [[0, 3], [0, 3], [0], [0, 3]]
    assert [r["src_token"].tolist() for r in results] == [[0, 0], [0, 0], [0], [1, 0]]
    direct = ht_combine(results, HYBRID_YS, HYBRID_TOPK_IDXS, HYBRID_EXPERTS)
    hybrid = ht_combine(results, HYBRID_YS, HYBRID_TOPK_IDXS, HYBRID_EXPERTS, num_ranks_per_node=2)
    assert torch.equal(direct[0]["x"], rows(1 + 2.0**-7, 5, 0))
    assert torch.equal(hybrid[0]["x"], rows(1, 5, 0))
    assert torch.equal(direct[3]["x"], rows(1))
    assert torch.equal(hybrid[3]["x"], rows(0))
    for rank in (1, 2):
        assert list(hybrid[rank]["x"].shape) == [0, HIDDEN]
    assert all(r["topk_weights"] is None for r in hybrid)


def test_hybrid_combine_adds_biases_first_then_node_partials():
    # Token (0, 0) with bias 2^-8. Direct: 2^-8 + 1 + 2^-8 + 2^-8 = 1 + 1.5 * 2^-7, a tie that
    # rounds to 1 + 2^-6. Hybrid: 2^-8 + P0 (= 1) + P1 (= 2^-8) = 1 + 2^-7, exact in bf16.
    # Token (0, 2) went nowhere: its bias alone, as in direct mode.
    results = hybrid_dispatch()
    biases = [(rows(2.0**-8, 0, 7), None), None, None, rows(0.5)]
    direct = ht_combine(results, HYBRID_YS, HYBRID_TOPK_IDXS, HYBRID_EXPERTS, biases=biases)
    hybrid = ht_combine(results, HYBRID_YS, HYBRID_TOPK_IDXS, HYBRID_EXPERTS, biases=biases, num_ranks_per_node=2)
    assert torch.equal(direct[0]["x"], rows(1 + 2.0**-6, 5, 7))
    assert torch.equal(hybrid[0]["x"], rows(1 + 2.0**-7, 5, 7))
    # Token (3, 0): 0.5 + 256 + (-256) = 0.5 in hybrid; 0.5 + 256 + 1 - 256 = 1.5 direct.
    assert torch.equal(hybrid[3]["x"], rows(0.5)) and torch.equal(direct[3]["x"], rows(1.5))


def test_hybrid_combine_visits_nodes_in_order_of_their_last_lane():
    # R=6, E=6, S=2: rank 0's token picks experts [1, 5, 2, 0]: node 0 (ranks 1, 0) has lanes 0 and 3,
    # node 2 (rank 5) lane 1, node 1 (rank 2) lane 2. Partials: P0 = bf16(c1 + c0) = -2^24, P1 = c2 = 1,
    # P2 = c5 = 2^24. Last lanes give n2, n1, n0: 2^24 + 1 = 2^24 (tie, even), then 0. Ascending
    # nodes (-2^24 + 1, exact, + 2^24) or first lanes (n0, n2, n1) would give 1.
    topk_idxs = [torch.tensor([[1, 5, 2, 0]])] + [torch.zeros(0, 4, dtype=torch.int64)] * 5
    xs = [rows(1)] + [rows(hidden=HIDDEN)] * 5
    results = ht_dispatch(xs, topk_idxs, None, 6)
    ys = [rows(0), rows(-(2.0**24)), rows(1), rows(hidden=HIDDEN), rows(hidden=HIDDEN), rows(2.0**24)]
    hybrid = ht_combine(results, ys, topk_idxs, 6, num_ranks_per_node=2)
    assert torch.equal(hybrid[0]["x"], rows(0))


def test_hybrid_combine_sums_the_ranks_of_a_node_in_order_of_their_last_lane():
    # R=6, E=6, S=3: rank 0's token picks experts [2, 4, 0, 1]: node 0 holds c2 = -2^24 (lane 0),
    # c0 = 2^24 (lane 2), c1 = 1 (lane 3); node 1 holds c4 = 3 (lane 1). Last lanes: P0 = bf16((-2^24 +
    # 2^24) + 1) = 1, then nodes n1 (lane 1), n0 (lane 3): 3 + 1 = 4. Ascending ranks would give
    # 2^24 + 1 = 2^24 (tie, even), P0 = 0 and out = 3.
    topk_idxs = [torch.tensor([[2, 4, 0, 1]])] + [torch.zeros(0, 4, dtype=torch.int64)] * 5
    xs = [rows(1)] + [rows(hidden=HIDDEN)] * 5
    results = ht_dispatch(xs, topk_idxs, None, 6)
    ys = [rows(2.0**24), rows(1), rows(-(2.0**24)), rows(hidden=HIDDEN), rows(3), rows(hidden=HIDDEN)]
    hybrid = ht_combine(results, ys, topk_idxs, 6, num_ranks_per_node=3)
    assert torch.equal(hybrid[0]["x"], rows(4))


def test_hybrid_expand_combine_rounds_rank_partials_then_node_partials():
    # R=4, E=8 (L=2), S=2: rank 0's token picks experts [3, 0, 4, 2]: rank 0 (local 0), rank 1
    # (locals 0 and 1), rank 2 (local 0). Expanded rows: rank 0: 2^-8; rank 1: 1 (local 0),
    # 2^-8 (local 1); rank 2: 2^-8.
    # c0 = 2^-8, c1 = bf16(1 + 2^-8) = 1, c2 = 2^-8. P0 = bf16(2^-8 + 1) = 1, P1 = 2^-8, out = 1.
    # Direct: 2^-8 + 1 + 2^-8 = 1 + 2^-7. Without the rank rounding P0 would be 1 + 2^-7 and the
    # output 1 + 2^-6 (tie, even).
    topk_idxs = [torch.tensor([[3, 0, 4, 2]])] + [torch.zeros(0, 4, dtype=torch.int64)] * 3
    xs = [rows(1)] + [rows(hidden=HIDDEN)] * 3
    results = ht_dispatch(xs, topk_idxs, None, 8, do_expand=True)
    assert [r["local_expert"].tolist() for r in results] == [[0], [0, 1], [0], []]
    ys = [rows(2.0**-8), rows(1, 2.0**-8), rows(2.0**-8), rows(hidden=HIDDEN)]
    weights_list = [torch.tensor([10.0]), torch.tensor([11.0, 12.0]), torch.tensor([13.0]), torch.zeros(0)]
    kwargs = {"weights_list": weights_list, "do_expand": True}
    direct = ht_combine(results, ys, topk_idxs, 8, **kwargs)
    hybrid = ht_combine(results, ys, topk_idxs, 8, num_ranks_per_node=2, **kwargs)
    assert torch.equal(direct[0]["x"], rows(1 + 2.0**-7))
    assert torch.equal(hybrid[0]["x"], rows(1))
    assert hybrid[0]["topk_weights"].tolist() == [[12.0, 10.0, 13.0, 11.0]]
    assert torch.equal(hybrid[0]["topk_weights"], direct[0]["topk_weights"])


def test_hybrid_combine_with_one_node_or_one_rank_per_node_equals_direct():
    results = hybrid_dispatch()
    biases = [(rows(2.0**-8, 0, 7), rows(2.0**-9, 1, 1)), None, None, rows(0.5)]
    direct = ht_combine(results, HYBRID_YS, HYBRID_TOPK_IDXS, HYBRID_EXPERTS, biases=biases)
    for node_size in (1, 4):
        got = ht_combine(
            results, HYBRID_YS, HYBRID_TOPK_IDXS, HYBRID_EXPERTS, biases=biases, num_ranks_per_node=node_size
        )
        for got_rank, want_rank in zip(got, direct, strict=True):
            assert torch.equal(got_rank["x"], want_rank["x"]), node_size
    # S = 2 differs on this input, so the equalities above are not vacuous.
    two = ht_combine(results, HYBRID_YS, HYBRID_TOPK_IDXS, HYBRID_EXPERTS, biases=biases, num_ranks_per_node=2)
    assert not torch.equal(two[0]["x"], direct[0]["x"])


def _random_lane_group(num_ranks: int, num_experts: int, num_topk: int, num_tokens: int, do_expand: bool, seed: int):
    """Routing with distinct experts per token in random lane order (some lanes -1), an output per
    (token, lane), and every rank's combine input built from those outputs as V2's test builds it."""
    generator = torch.Generator().manual_seed(seed)
    topk_idxs, lanes = [], []
    for _ in range(num_ranks):
        idx = torch.rand(num_tokens, num_experts, generator=generator).topk(num_topk, dim=1).indices
        idx[torch.rand(num_tokens, num_topk, generator=generator) < 0.2] = -1
        topk_idxs.append(idx)
        lanes.append(make_lane_outputs(idx, HIDDEN, generator))
    xs = [rows(*range(num_tokens)) for _ in range(num_ranks)]
    weights = [torch.rand(num_tokens, num_topk, generator=generator) for _ in range(num_ranks)]
    results = ht_dispatch(xs, topk_idxs, weights, num_experts, do_expand=do_expand, expert_alignment=2)
    num_local = num_experts // num_ranks
    ys = [
        combine_inputs_from_lanes(
            lanes, topk_idxs, r["src_rank"], r["src_token"], dest, num_local, r["local_expert"] if do_expand else None
        )
        for dest, r in enumerate(results)
    ]
    weights_list = [r["topk_weights"] * 3 for r in results]
    return results, ys, topk_idxs, lanes, weights_list


def _biases(count: int, num_ranks: int, num_tokens: int, seed: int) -> list:
    generator = torch.Generator().manual_seed(seed)
    biases = []
    for _ in range(num_ranks):
        terms = [
            make_lane_outputs(torch.zeros(num_tokens, 1, dtype=torch.int64), HIDDEN, generator)[:, 0]
            for _ in range(count)
        ]
        biases.append(None if count == 0 else terms[0] if count == 1 else tuple(terms))
    return biases


@pytest.mark.parametrize("num_biases", [0, 1, 2])
@pytest.mark.parametrize("do_expand", [False, True])
@pytest.mark.parametrize("node_size", [None, 1, 2, 4])
def test_combine_equals_deep_ep_v2_reference_order_on_random_data(node_size, do_expand, num_biases):
    """ht_combine against an independent transcription of DeepEP V2's refs.combine (per-lane outputs:
    grouped by rank, then by node in hybrid mode, partials on each group's last lane, lanes summed
    in order), bit for bit; and the data tells V2's order from ascending rank order."""
    num_ranks, num_experts, num_topk, num_tokens = 8, 16, 6, 24
    results, ys, topk_idxs, lanes, weights_list = _random_lane_group(
        num_ranks, num_experts, num_topk, num_tokens, do_expand, seed=10 * num_biases + (node_size or 0)
    )
    biases = _biases(num_biases, num_ranks, num_tokens, seed=7 + num_biases)
    order = {} if node_size is None else {"num_ranks_per_node": node_size}
    combined = ht_combine(
        results, ys, topk_idxs, num_experts, weights_list=weights_list, biases=biases, do_expand=do_expand, **order
    )
    num_local = num_experts // num_ranks
    differs = False
    for source in range(num_ranks):
        want = v2_combine(lanes[source], topk_idxs[source], num_experts, num_ranks, bias=biases[source], **order)
        assert torch.equal(combined[source]["x"].view(torch.int16), want.view(torch.int16)), source
        sorted_lanes, sorted_idx = lanes_by_rank(lanes[source], topk_idxs[source], num_local)
        ascending = v2_combine(sorted_lanes, sorted_idx, num_experts, num_ranks, bias=biases[source], **order)
        differs |= not torch.equal(ascending, want)
    assert differs, "the random data should tell V2's order from ascending rank order"


@pytest.mark.parametrize("do_expand", [False, True])
@pytest.mark.parametrize("node_size", [2, 4])
def test_hybrid_combine_differs_from_direct_only_in_x(do_expand, node_size):
    num_experts = 16
    results, ys, topk_idxs, _, weights_list = _random_lane_group(8, num_experts, 4, 12, do_expand, seed=node_size)
    biases = _biases(2, 8, 12, seed=node_size)
    kwargs = {"biases": biases, "weights_list": weights_list, "do_expand": do_expand}
    hybrid = ht_combine(results, ys, topk_idxs, num_experts, num_ranks_per_node=node_size, **kwargs)
    direct = ht_combine(results, ys, topk_idxs, num_experts, **kwargs)
    differs = False
    for got, direct_rank in zip(hybrid, direct, strict=True):
        assert torch.equal(got["topk_weights"], direct_rank["topk_weights"])
        differs |= not torch.equal(got["x"], direct_rank["x"])
    assert differs, "the random data should tell the hybrid order from the direct one"


def test_v2_transcription_sums_a_group_in_lane_order_on_its_last_lane():
    # One token, K=4, L=1: lanes on ranks [2, 0, 2, 2] hold -2^24, 5, 2^24, 1. Rank 2's partial
    # ((-2^24 + 2^24) + 1 = 1) lands on lane 3, rank 0's (5) on lane 1; the rest are zero.
    lanes = torch.tensor([[-(2.0**24), 5.0, 2.0**24, 1.0]]).unsqueeze(-1).expand(-1, -1, 2).bfloat16()
    group = torch.tensor([[2, 0, 2, 2]])
    partials = v2_lane_partials(lanes, group)
    assert partials[0, :, 0].tolist() == [0.0, 5.0, 0.0, 1.0]
    assert v2_combine(lanes, group, 3, 3, bias=rows(0.5, hidden=2)).tolist() == [[6.5, 6.5]]


@pytest.mark.parametrize("node_size", [0, -2, 3, 8])
def test_combine_rejects_num_ranks_per_node_that_does_not_divide_num_ranks(node_size):
    results = hybrid_dispatch()
    with pytest.raises(
        ValueError, match=rf"num_ranks_per_node must be a positive divisor of num_ranks \(4\), got {node_size}"
    ):
        ht_combine(results, HYBRID_YS, HYBRID_TOPK_IDXS, HYBRID_EXPERTS, num_ranks_per_node=node_size)


def test_combine_rejects_num_ranks_per_node_that_is_not_an_int():
    results = hybrid_dispatch()
    with pytest.raises(TypeError, match="num_ranks_per_node must be an int or None, got float"):
        ht_combine(results, HYBRID_YS, HYBRID_TOPK_IDXS, HYBRID_EXPERTS, num_ranks_per_node=2.0)


# ------------------------------------------------------------------ source info and DeepEP V2's recv_src_metadata

# R = 2, E = 4 (rank 1 holds experts 2 and 3), K = 3, T_max = 4. Rank 1 receives source 0's tokens
# 0, 1, 2 and source 1's token 0; source 1's token 1 goes nowhere. Token [3, -1, 2] and token
# [2, 3, 1] have two experts on rank 1: the master lane is the first of them.
SRC_TOPK_IDXS = [torch.tensor([[1, 2, 0], [3, -1, 2], [-1, 0, 3]]), torch.tensor([[2, 3, 1], [-1, -1, -1]])]
SRC_T_MAX = 4
# Per rank: (source rank, source token, j, master lane). j on rank 1 counts rank 0 where the token
# also went there.
SRC_INFO = [
    [[0, 0, 0, 0], [0, 2, 0, 1], [1, 0, 0, 2]],
    [[0, 0, 1, 1], [0, 1, 0, 0], [0, 2, 1, 2], [1, 0, 1, 0]],
]
# Alignment 4. Rank 0: expert 0 rows 0, 1 (received rows 0, 1), expert 1 from row 4 (received rows
# 0, 2). Rank 1: expert 2 rows 0, 1, 2 (received rows 0, 1, 3), expert 3 from row 4 (rows 1, 2, 3).
EXPANDED_ROWS = [
    [[4, -1, 0], [-1, 1, -1], [-1, -1, 5]],
    [[-1, 0, -1], [4, -1, 1], [-1, -1, 5], [2, 6, -1]],
]


def test_src_info_holds_source_combine_slot_and_first_local_lane():
    info = ht_src_info(SRC_TOPK_IDXS, NUM_EXPERTS)
    assert [rank.tolist() for rank in info] == SRC_INFO
    assert all(rank.dtype == torch.int32 for rank in info)


def test_src_info_rows_are_the_non_expand_dispatch_rows():
    xs = [rows(1, 2, 3), rows(11, 12)]
    for rank, (plain, info) in enumerate(
        zip(ht_dispatch(xs, SRC_TOPK_IDXS, None, NUM_EXPERTS), ht_src_info(SRC_TOPK_IDXS, NUM_EXPERTS), strict=True)
    ):
        assert info[:, 0].tolist() == plain["src_rank"].tolist(), rank
        assert info[:, 1].tolist() == plain["src_token"].tolist(), rank


def test_src_info_counts_the_combine_slot_within_the_node_in_hybrid_mode():
    # R = 4, one expert per rank, a token to ranks 3, 1 and 2; nodes {0, 1} and {2, 3}. The
    # out-of-range id 9 and the repeat of 3 are -1 after sanitising: never a master lane.
    topk_idxs = [torch.tensor([[9, 3, 1, 3, 2]])] + [torch.empty(0, 5, dtype=torch.int64)] * 3
    direct = ht_src_info(topk_idxs, 4)
    hybrid = ht_src_info(topk_idxs, 4, num_ranks_per_node=2)
    assert direct[0].shape == (0, 4) and hybrid[0].shape == (0, 4)
    assert [rank.tolist() for rank in direct[1:]] == [[[0, 0, 0, 2]], [[0, 0, 1, 4]], [[0, 0, 2, 1]]]
    assert [rank.tolist() for rank in hybrid[1:]] == [[[0, 0, 0, 2]], [[0, 0, 0, 4]], [[0, 0, 1, 1]]]


def test_expanded_row_idx_points_at_the_expand_rows_of_each_lane():
    expanded = ht_expanded_row_idx(SRC_TOPK_IDXS, NUM_EXPERTS, expert_alignment=4)
    assert [rank.tolist() for rank in expanded] == EXPANDED_ROWS
    # The same rows as the expand dispatch's: row expanded[i, k] came from received row i's token.
    xs = [rows(1, 2, 3), rows(11, 12)]
    results = ht_dispatch(xs, SRC_TOPK_IDXS, None, NUM_EXPERTS, do_expand=True, expert_alignment=4)
    for result, info, rank_rows in zip(results, ht_src_info(SRC_TOPK_IDXS, NUM_EXPERTS), expanded, strict=True):
        for i, k in (rank_rows >= 0).nonzero().tolist():
            row = rank_rows[i, k]
            assert (result["src_rank"][row], result["src_token"][row]) == (info[i, 0], info[i, 1])


def test_v2_recv_src_metadata_has_global_token_master_and_expanded_rows():
    info = ht_src_info(SRC_TOPK_IDXS, NUM_EXPERTS)[1]
    plain = v2_recv_src_metadata(info, 3, SRC_T_MAX)
    expanded = ht_expanded_row_idx(SRC_TOPK_IDXS, NUM_EXPERTS, expert_alignment=4)[1]
    expand = v2_recv_src_metadata(info, 3, SRC_T_MAX, expanded)
    # Column 0: s * T_max + t; column 1: s * K + master lane.
    heads = [[0, 1], [1, 0], [2, 2], [4, 3]]
    assert plain.dtype == torch.int32 and plain.tolist() == [head + [-1, -1, -1] for head in heads]
    assert expand.tolist() == [head + lanes for head, lanes in zip(heads, EXPANDED_ROWS[1], strict=True)]


def test_v2_recv_src_metadata_rejects_other_shapes():
    info = torch.zeros(2, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"src_info must be \[N, 4\]"):
        v2_recv_src_metadata(torch.zeros(2, 3, dtype=torch.int32), 3, 4)
    with pytest.raises(ValueError, match=r"expanded_row_idx must be \[2, 3\]"):
        v2_recv_src_metadata(info, 3, 4, torch.zeros(2, 2, dtype=torch.int32))
