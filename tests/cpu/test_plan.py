"""deep_ep.plan: sizing through _C, closed forms, sampled routing statistics, analytic SM estimate."""

import itertools
import math

import numpy as np
import pytest
import torch

from deep_ep import _C
from deep_ep.plan import (
    PlanConfig,
    buffer_bytes,
    build_plan,
    cross_node_copies,
    expected_groups_touched,
    format_plan,
    high_throughput_bytes,
    low_latency_slots,
    node_limited_topk,
    random_scores,
    theoretical_num_qps,
    theoretical_num_sms,
    transfer_times,
    uniform_cross_node_copies,
    window_bytes,
)

MiB = 1 << 20


# ---- sizing ---------------------------------------------------------------------------------------


def test_low_latency_slots_deepseek_example():
    slots = low_latency_slots(64, 256, 128, 7168, True, num_topk=8)
    assert slots["message_bytes"] == 7168 + 7168 // 128 * 4 + 16 == 7408
    assert slots["recv_slot_bytes"] == 4 * 64 * 128 * 7408 == 242_745_344
    assert 231 * MiB < slots["recv_slot_bytes"] < 232 * MiB
    # 64 * 128 tokens x 8 messages over 256 experts: 4 local experts receive 128 * 8 messages.
    assert slots["expected_used_bytes"] == 128 * 8 * 7408
    assert slots["used_fraction"] == pytest.approx(1 / 32)
    assert slots["total_buffer_bytes"] == _C.low_latency_layout(64, 128, 7168, 256, 8)["region_bytes"]
    # The real reservation adds bf16-sized payloads, combine area and double buffering.
    assert slots["total_buffer_bytes"] > 2 * slots["recv_slot_bytes"]


def test_low_latency_message_bytes_bf16_is_two_bytes_per_channel_plus_header():
    assert low_latency_slots(8, 64, 32, 4096, False)["message_bytes"] == 2 * 4096 + 16


def test_low_latency_expected_use_scales_with_topk():
    top4 = low_latency_slots(16, 64, 64, 2048, num_topk=4)
    top8 = low_latency_slots(16, 64, 64, 2048, num_topk=8)
    assert top8["expected_used_bytes"] == 2 * top4["expected_used_bytes"]
    assert top8["recv_slot_bytes"] == top4["recv_slot_bytes"]


def test_high_throughput_bytes_are_the_c_geometry():
    for ranks, per_node in ((8, 8), (64, 8), (16, 4)):
        planned = high_throughput_bytes(ranks, per_node, 4096, 7168, 8, True)
        assert planned == dict(_C.high_throughput_layout(ranks, per_node, 4096, 7168, 8, True))
        assert planned["region_bytes"] >= max(planned["dispatch_bytes"], planned["combine_bytes"])
        assert planned["region_bytes"] % _C.WINDOW_ALIGN_BYTES == 0


def test_buffer_bytes_window_is_workspace_plus_both_regions():
    planned = buffer_bytes(64, 8, 256, 8, 7168, 4096, 128, True)
    ht, ll, window = planned["high_throughput"], planned["low_latency"], planned["window"]
    assert window == window_bytes(ht["region_bytes"], ll["total_buffer_bytes"])
    assert window["workspace_bytes"] == _C.WORKSPACE_BYTES
    assert window["total_bytes"] == _C.WORKSPACE_BYTES + ht["region_bytes"] + ll["total_buffer_bytes"]


def test_zero_copy_combine_sizing_is_the_c_geometry_and_one_node_only():
    planned = high_throughput_bytes(8, 8, 4096, 7168, 8, True, zero_copy_combine=True)
    assert planned == dict(_C.high_throughput_layout(8, 8, 4096, 7168, 8, True, True))
    assert (
        planned["region_bytes"]
        >= planned["zero_copy_combine_bytes"]
        > high_throughput_bytes(8, 8, 4096, 7168, 8, True)["region_bytes"]
    )
    plan = build_plan(PlanConfig(num_ranks=8, num_ranks_per_node=8, zero_copy_combine=True, num_sampled_tokens=64))
    assert plan["high_throughput"]["region_bytes"] == planned["region_bytes"]
    assert "HT zero-copy combine footprint" in format_plan(plan)
    with pytest.raises(ValueError, match="zero_copy_combine is direct mode only"):
        build_plan(PlanConfig(zero_copy_combine=True, num_sampled_tokens=64))


def test_sizing_errors_name_the_argument():
    with pytest.raises(ValueError, match="num_experts"):
        low_latency_slots(64, 100, 128, 7168)
    with pytest.raises(ValueError, match="hidden"):
        low_latency_slots(8, 64, 128, 7000)
    with pytest.raises(ValueError, match="num_ranks"):
        high_throughput_bytes(0, 1, 4096, 7168, 8, True)
    with pytest.raises(ValueError, match="num_ranks_per_node"):
        high_throughput_bytes(64, 3, 4096, 7168, 8, True)


# ---- closed forms -------------------------------------------------------------------------------


def _brute_force_groups_touched(num_experts, num_topk, num_groups):
    per_group = num_experts // num_groups
    subsets = list(itertools.combinations(range(num_experts), num_topk))
    return sum(len({e // per_group for e in subset}) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("num_experts,num_topk,num_groups", [(8, 3, 4), (12, 4, 3), (12, 2, 6), (6, 6, 2)])
def test_expected_groups_touched_matches_enumeration(num_experts, num_topk, num_groups):
    exact = expected_groups_touched(num_experts, num_topk, num_groups)
    assert exact == pytest.approx(_brute_force_groups_touched(num_experts, num_topk, num_groups), rel=1e-12)


def test_expected_groups_touched_closed_form_deepseek():
    miss = math.comb(224, 8) / math.comb(256, 8)
    assert expected_groups_touched(256, 8, 8) == 8 * (1 - miss)
    assert expected_groups_touched(256, 8, 1) == 1.0
    assert expected_groups_touched(256, 0, 8) == 0.0


def test_uniform_cross_node_copies_closed_forms():
    copies = uniform_cross_node_copies(256, 8, 64, 8)
    node_hit = 1 - math.comb(224, 8) / math.comb(256, 8)
    rank_hit = 1 - math.comb(252, 8) / math.comb(256, 8)
    assert copies["per_expert"] == 7.0
    assert copies["per_node"] == pytest.approx(7 * node_hit, rel=1e-15)
    assert copies["per_node"] == pytest.approx(4.6328, abs=1e-4)
    assert copies["per_rank"] == pytest.approx(56 * rank_hit, rel=1e-15)
    assert copies["nodes_per_token"] == pytest.approx(8 * node_hit, rel=1e-15)
    assert copies["ranks_per_token"] == pytest.approx(64 * rank_hit, rel=1e-15)


# ---- sampled routing --------------------------------------------------------------------------------


def test_cross_node_copies_hand_worked():
    # 16 experts, 8 ranks (2 experts each), 2 ranks per node -> 4 nodes of 4 experts.
    topk_idx = torch.tensor(
        [
            [0, 1, 4, 5],  # node 0 twice (rank 0), node 1 twice (rank 2)
            [4, 6, 8, -1],  # node 1 (ranks 2, 3), node 2 (rank 4)
            [-1, -1, -1, -1],  # nothing
            [15, 14, 2, 3],  # node 3 (rank 7), node 0 (rank 1)
        ]
    )
    copies = cross_node_copies(topk_idx, 16, 8, 2, src_node=0)
    assert copies["per_expert"] == (2 + 3 + 0 + 2) / 4
    assert copies["per_rank"] == (1 + 3 + 0 + 1) / 4
    assert copies["per_node"] == (1 + 2 + 0 + 1) / 4
    # The nodes holding the token's experts; the source node only when an expert is there.
    assert copies["nodes_per_token"] == (2 + 2 + 0 + 2) / 4
    assert copies["ranks_per_token"] == (2 + 3 + 0 + 2) / 4
    from_node_1 = cross_node_copies(topk_idx, 16, 8, 2, src_node=1)
    assert from_node_1["per_expert"] == (2 + 1 + 0 + 4) / 4
    assert from_node_1["nodes_per_token"] == copies["nodes_per_token"]


def test_cross_node_copies_accepts_numpy():
    topk_idx = torch.randint(-1, 64, (100, 6), generator=torch.Generator().manual_seed(3))
    assert cross_node_copies(topk_idx.numpy(), 64, 16, 4) == cross_node_copies(topk_idx, 64, 16, 4)
    assert cross_node_copies(topk_idx.numpy().astype(np.int32), 64, 16, 4) == cross_node_copies(topk_idx, 64, 16, 4)


def test_cross_node_copies_rejects_bad_input():
    with pytest.raises(ValueError, match="topk_idx entries must be -1 or in \\[0, num_experts=16\\)"):
        cross_node_copies(torch.tensor([[0, 16]]), 16, 8, 2)
    with pytest.raises(ValueError, match="topk_idx must be an integer"):
        cross_node_copies(torch.zeros(2, 2), 16, 8, 2)
    with pytest.raises(ValueError, match="src_node"):
        cross_node_copies(torch.tensor([[0]]), 16, 8, 2, src_node=4)
    with pytest.raises(ValueError, match="num_experts \\(12\\) must be a multiple of num_ranks \\(8\\)"):
        cross_node_copies(torch.tensor([[0]]), 12, 8, 2)
    with pytest.raises(ValueError, match="num_ranks_per_node"):
        cross_node_copies(torch.tensor([[0]]), 16, 8, 3)
    with pytest.raises(TypeError, match="topk_idx"):
        cross_node_copies([[0, 1]], 16, 8, 2)


def test_uniform_routing_sampled_matches_closed_forms():
    # 8 nodes x 8 GPUs, 256 experts, top-8: per-expert K(1 - 1/N) = 7.
    scores = random_scores(20000, 256, seed=1234)
    sampled = cross_node_copies(scores.topk(8, dim=-1).indices, 256, 64, 8)
    exact = uniform_cross_node_copies(256, 8, 64, 8)
    for key in exact:
        assert sampled[key] == pytest.approx(exact[key], abs=0.05), key


def test_node_limited_routing_touches_at_most_max_nodes():
    scores = random_scores(20000, 256, seed=1234)
    topk_idx = node_limited_topk(scores, 8, 8, 4)
    nodes = topk_idx // 32
    distinct_nodes = (torch.zeros(20000, 8, dtype=torch.bool).scatter_(1, nodes, True)).sum(dim=1)
    assert int(distinct_nodes.max()) <= 4
    limited = cross_node_copies(topk_idx, 256, 64, 8)
    unlimited = cross_node_copies(scores.topk(8, dim=-1).indices, 256, 64, 8)
    # Four of eight nodes, the source among them half the time: at most 4 * 7/8 other nodes.
    assert 3.3 < limited["per_node"] <= 3.5
    assert unlimited["per_node"] == pytest.approx(4.633, abs=0.05)
    assert limited["per_node"] < 0.5 * limited["per_expert"]
    assert limited["per_expert"] == pytest.approx(7.0, abs=0.05)


def test_node_limited_topk_prefers_the_node_with_the_best_pair():
    # 4 nodes of 2 experts, top-2 from 1 node: node 0 has the best single expert (0.9) but node 2
    # has the best pair (0.8 + 0.7), so both picks come from node 2, best first.
    scores = torch.tensor([[0.9, 0.1, 0.2, 0.3, 0.7, 0.8, 0.0, 0.5]])
    assert node_limited_topk(scores, 4, 2, 1).tolist() == [[5, 4]]
    assert node_limited_topk(scores, 4, 2, 4).tolist() == [[0, 5]]
    # top-3 from 2 nodes: node score = best 1 expert: nodes 0 (0.9) and 2 (0.8) are kept.
    assert node_limited_topk(scores, 4, 3, 2).tolist() == [[0, 5, 4]]


def test_node_limited_topk_keeps_input_kind_and_orders_by_score():
    scores = random_scores(64, 32, seed=7)
    from_numpy = node_limited_topk(scores.numpy(), 4, 6, 2)
    from_torch = node_limited_topk(scores, 4, 6, 2)
    assert isinstance(from_numpy, np.ndarray) and from_numpy.dtype == np.int64
    assert from_torch.dtype == torch.int64 and list(from_torch.shape) == [64, 6]
    assert np.array_equal(from_numpy, from_torch.numpy())
    picked = scores.gather(1, from_torch)
    assert bool((picked[:, :-1] >= picked[:, 1:]).all())
    assert torch.equal(node_limited_topk(scores, 4, 6, 4), scores.topk(6, dim=-1).indices)


def test_node_limited_topk_rejects_bad_arguments():
    scores = torch.rand(4, 16)
    with pytest.raises(ValueError, match="num_nodes"):
        node_limited_topk(scores, 3, 2, 1)
    with pytest.raises(ValueError, match="max_nodes"):
        node_limited_topk(scores, 4, 2, 5)
    with pytest.raises(ValueError, match="num_topk"):
        node_limited_topk(scores, 4, 9, 2)
    with pytest.raises(ValueError, match="scores"):
        node_limited_topk(torch.ones(4, 16, dtype=torch.int64), 4, 2, 1)


def test_transfer_times_is_copies_times_bytes_over_bandwidth():
    copies = {"per_expert": 7.0, "per_rank": 6.5, "per_node": 3.5, "nodes_per_token": 4.5}
    times = transfer_times(copies, message_bytes=7488, num_tokens=4096, link_gbs=50.0)
    assert set(times) == {"per_expert", "per_rank", "per_node"}
    assert times["per_expert"] == pytest.approx(7.0 * 4096 * 7488 / 50e9, rel=1e-15)
    assert times["per_node"] == pytest.approx(3.5 * 4096 * 7488 / 50e9, rel=1e-15)
    with pytest.raises(ValueError, match="link_gbs"):
        transfer_times(copies, message_bytes=7488, num_tokens=1, link_gbs=0)
    with pytest.raises(ValueError, match="copies must have keys"):
        transfer_times({"per_expert": 1.0}, message_bytes=7488, num_tokens=1, link_gbs=1)


# ---- analytic SM / QP estimate ----------------------------------------------------------------------


def test_theoretical_num_sms_single_node_ep8():
    # Direct: write rate = nvlink_gbs / (7/8) per unit -> nvlink_gbs / 43.75 SMs, x 1.25 -> 24 at 810 GB/s.
    assert theoretical_num_sms(256, 8, 8, 8, 1, nvlink_gbs=810) == 24
    assert theoretical_num_sms(256, 8, 8, 8, 1, nvlink_gbs=810, prefer_overlap_with_compute=False) == 64


def test_theoretical_num_sms_hybrid_is_rdma_bound_with_a_50_gbs_nic():
    assert theoretical_num_sms(256, 8, 16, 8, 2, nvlink_gbs=810, rdma_gbs=50) == 12
    assert theoretical_num_sms(256, 8, 32, 8, 4, nvlink_gbs=810, rdma_gbs=50) == 6


def test_theoretical_num_sms_is_even_at_least_four_and_clamped():
    assert theoretical_num_sms(256, 8, 8, 8, 1, nvlink_gbs=10) == 4
    assert theoretical_num_sms(256, 8, 8, 8, 1, nvlink_gbs=810, device_sms=20) == 20
    assert theoretical_num_sms(256, 8, 8, 8, 1, nvlink_gbs=810, prefer_overlap_with_compute=False, device_sms=48) == 48
    for nvlink_gbs in (100, 333, 500, 777, 1500):
        assert theoretical_num_sms(256, 8, 8, 8, 1, nvlink_gbs=nvlink_gbs) % 2 == 0
    # One rank moves nothing over any link: the whole device.
    assert theoretical_num_sms(256, 8, 1, 1, 1, nvlink_gbs=810, device_sms=132) == 132


def test_theoretical_num_sms_rejects_bad_topology():
    with pytest.raises(ValueError, match="num_nvlink_ranks"):
        theoretical_num_sms(256, 8, 16, 3, 1, nvlink_gbs=450)
    with pytest.raises(ValueError, match="num_scaleout_ranks"):
        theoretical_num_sms(256, 8, 16, 8, 3, nvlink_gbs=450)
    with pytest.raises(ValueError, match="nvlink_gbs"):
        theoretical_num_sms(256, 8, 8, 8, 1, nvlink_gbs=0)


def test_theoretical_num_qps():
    assert theoretical_num_qps(24, hybrid=False) == 9
    assert theoretical_num_qps(4, hybrid=False) == 4
    assert theoretical_num_qps(12, hybrid=True) == 12 * 16 + 1


# ---- the whole plan ---------------------------------------------------------------------------------


def test_build_plan_default_is_deepseek_like():
    plan = build_plan()
    assert plan["config"]["num_ranks"] == 64 and plan["config"]["max_nodes"] == 4
    assert plan["low_latency"]["message_bytes"] == 7408
    assert plan["high_throughput"] == high_throughput_bytes(64, 8, 4096, 7168, 8, True)
    assert plan["routing"]["uniform_exact"] == uniform_cross_node_copies(256, 8, 64, 8)
    assert plan["routing"]["node_limited_sampled"]["per_node"] < plan["routing"]["uniform_sampled"]["per_node"]
    assert plan["theoretical"]["num_sms_no_overlap"] >= 64
    ht_times = plan["transfer_times_s"]["high_throughput"]
    assert ht_times["message_bytes"] == plan["high_throughput"]["dispatch_token_bytes"]


@pytest.mark.parametrize(
    "changes,argument",
    [
        ({"num_ranks": 0}, "num_ranks"),
        ({"num_experts": 100}, "num_experts"),
        ({"hidden": 7000}, "hidden"),
        ({"num_ranks_per_node": 3}, "num_ranks_per_node"),
        ({"max_nodes": 9}, "max_nodes"),
        ({"num_topk": 0}, "num_topk"),
        ({"link_gbs": 0.0}, "link_gbs"),
    ],
)
def test_build_plan_rejects_bad_config_naming_the_argument(changes, argument):
    with pytest.raises(ValueError, match=argument):
        build_plan(PlanConfig(**changes))
