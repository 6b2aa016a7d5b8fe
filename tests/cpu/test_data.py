"""The seeded input generators: valid routing, the promised mix of edge cases, determinism."""

import pytest
import torch

from deep_ep.testing.data import make_group_inputs, make_routing, make_tokens, make_weights, uneven_token_counts
from deep_ep.testing.reference import ht_dispatch, ll_dispatch


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_distinct_valid_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    assert topk_idx.dtype == torch.int64
    assert ((topk_idx >= -1) & (topk_idx < num_experts)).all()
    for row in topk_idx.tolist():
        chosen = [expert for expert in row if expert >= 0]
        assert len(chosen) == len(set(chosen)), row


@pytest.mark.parametrize(("num_experts", "num_topk"), [(8, 8), (16, 4), (256, 8), (3, 1)])
def test_routing_has_distinct_ids_in_range(num_experts, num_topk):
    topk_idx = make_routing(500, num_experts, num_topk, generator=generator(), hot_expert=num_experts - 1)
    assert list(topk_idx.shape) == [500, num_topk]
    assert_distinct_valid_ids(topk_idx, num_experts)


def test_routing_minus_one_ratio_and_empty_tokens():
    topk_idx = make_routing(4000, 64, 8, generator=generator(), minus_one_ratio=0.2, all_minus_one_tokens=3)
    assert (topk_idx == -1).all(dim=1).sum() == 3
    assert abs((topk_idx == -1).float().mean().item() - 0.2) < 0.02
    no_minus_one = make_routing(500, 64, 8, generator=generator(), minus_one_ratio=0.0, all_minus_one_tokens=0)
    assert (no_minus_one >= 0).all()


def test_routing_with_few_tokens_empties_at_most_all_of_them():
    topk_idx = make_routing(2, 8, 2, generator=generator(), all_minus_one_tokens=5)
    assert (topk_idx == -1).all()
    assert make_routing(0, 8, 2, generator=generator()).shape == (0, 2)


def test_routing_hot_expert_is_selected_by_about_hot_ratio_of_tokens():
    num_tokens, num_experts, num_topk = 4000, 256, 8
    topk_idx = make_routing(num_tokens, num_experts, num_topk, generator=generator(), hot_expert=7, hot_ratio=0.5)
    hot_share = (topk_idx == 7).any(dim=1).float().mean().item()
    # Forced on half of the tokens plus those picking it at random (about K / E of the rest).
    assert 0.47 < hot_share < 0.56
    other_share = (topk_idx == 8).any(dim=1).float().mean().item()
    assert other_share < 0.06
    # The hot expert lands in every slot, not only slot 0.
    assert (topk_idx == 7).any(dim=0).all()


def test_routing_rejects_impossible_requests():
    with pytest.raises(ValueError, match="num_topk"):
        make_routing(4, 4, 5, generator=generator())
    with pytest.raises(ValueError, match="hot_expert"):
        make_routing(4, 4, 2, generator=generator(), hot_expert=4)
    with pytest.raises(ValueError, match="minus_one_ratio"):
        make_routing(4, 4, 2, generator=generator(), minus_one_ratio=1.5)


def test_weights_are_positive_fp32_everywhere():
    topk_idx = make_routing(300, 16, 4, generator=generator())
    weights = make_weights(topk_idx, generator())
    assert weights.dtype == torch.float32 and weights.shape == topk_idx.shape
    assert (weights > 0).all()


def test_tokens_are_random_and_never_zero():
    x = make_tokens(256, 512, generator())
    assert x.dtype == torch.bfloat16 and list(x.shape) == [256, 512]
    assert (x != 0).all()
    assert 0.9 < x.float().std().item() < 1.1
    assert make_tokens(4, 128, generator(), dtype=torch.float32).dtype == torch.float32


def test_uneven_token_counts_include_zero_and_the_cap():
    for seed in range(20):
        counts = uneven_token_counts(8, 100, generator(seed))
        assert len(counts) == 8 and all(0 <= count <= 100 for count in counts)
        assert 0 in counts and 100 in counts
    assert 0 not in uneven_token_counts(8, 100, generator(), zero_rank=False)
    assert uneven_token_counts(1, 100, generator()) == [100]
    assert len(set(uneven_token_counts(8, 1000, generator()))) > 3


def test_group_inputs_are_a_pure_function_of_the_seed():
    kwargs = dict(num_ranks=4, num_max_tokens=64, hidden=256, num_experts=16, num_topk=4, use_fp8=True, hot_expert=3)
    first, second = make_group_inputs(**kwargs, seed=5), make_group_inputs(**kwargs, seed=5)
    other = make_group_inputs(**kwargs, seed=6)
    assert first.num_tokens == second.num_tokens
    for rank in range(4):
        assert torch.equal(first.x[rank], second.x[rank])
        assert torch.equal(first.topk_idx[rank], second.topk_idx[rank])
        assert torch.equal(first.topk_weights[rank], second.topk_weights[rank])
        assert torch.equal(first.x_fp8[rank][0].view(torch.uint8), second.x_fp8[rank][0].view(torch.uint8))
    assert first.num_tokens != other.num_tokens or not all(
        torch.equal(a, b) for a, b in zip(first.topk_idx, other.topk_idx, strict=True)
    )


def test_group_inputs_shapes_and_options():
    group = make_group_inputs(4, 32, 256, 8, 2, seed=1, use_fp8=True)
    assert 0 in group.num_tokens and 32 in group.num_tokens
    for rank, count in enumerate(group.num_tokens):
        assert list(group.x[rank].shape) == [count, 256]
        assert list(group.topk_idx[rank].shape) == [count, 2]
        assert list(group.x_fp8[rank][1].shape) == [count, 2]
    assert group.dispatch_xs[0] is group.x_fp8[0]
    plain = make_group_inputs(2, 16, 128, 4, 2, seed=1, with_weights=False, uneven=False)
    assert plain.num_tokens == [16, 16] and plain.topk_weights is None and plain.x_fp8 is None
    assert plain.dispatch_xs[1] is plain.x[1]


def test_reference_accepts_generated_inputs():
    group = make_group_inputs(4, 48, 256, 16, 4, seed=2, use_fp8=True, hot_expert=0)
    results = ht_dispatch(group.dispatch_xs, group.topk_idx, group.topk_weights, 16, expert_alignment=8)
    assert sum(sum(r["num_recv_tokens_per_rank"]) for r in results) > 0
    ll_results = ll_dispatch(group.x, group.topk_idx, 16, 48)
    # Every (token, valid expert) pair lands in exactly one LL slot.
    assert sum(int(r["count"].sum()) for r in ll_results) == sum(int((t >= 0).sum()) for t in group.topk_idx)
