"""Closed-form traffic expectations and the analytic SM / QP estimate.

Everything here assumes balanced routing: each token picks ``K`` distinct experts uniformly among
``E``, experts contiguous per rank and ranks contiguous per node. ``theoretical_num_sms`` is the
model behind ``ElasticBuffer.get_theoretical_num_sms``: the fewest SMs whose HBM read and write
rates keep the bottleneck link busy.
"""

from __future__ import annotations

import math

from deep_ep.plan.routing import check_placement, require

# Safety factor on the bandwidth-derived SM count: per-SM rates are averages, and a few spare SMs
# absorb stragglers (uneven routing, a slow peer) without leaving the link idle.
SM_MARGIN = 1.25
MIN_SMS = 4
# When the caller does not overlap communication with compute, take the SMs that give peak speed.
NO_OVERLAP_MIN_SMS = 64
DIRECT_MAX_QPS = 9


def expected_groups_touched(num_experts: int, num_topk: int, num_groups: int) -> float:
    """Expected distinct groups hit by ``num_topk`` distinct uniform experts, experts split evenly over groups.

    A group is missed when all K experts fall among the ``E - E/g`` experts outside it, so
    ``f(g) = g * (1 - C(E - E/g, K) / C(E, K))`` (exact).
    """
    require(num_experts >= 1, f"num_experts must be >= 1, got {num_experts}")
    require(num_groups >= 1, f"num_groups must be >= 1, got {num_groups}")
    require(
        num_experts % num_groups == 0,
        f"num_experts ({num_experts}) must be a multiple of num_groups ({num_groups})",
    )
    require(0 <= num_topk <= num_experts, f"num_topk must be in [0, num_experts={num_experts}], got {num_topk}")
    miss = math.comb(num_experts - num_experts // num_groups, num_topk) / math.comb(num_experts, num_topk)
    return num_groups * (1.0 - miss)


def uniform_cross_node_copies(
    num_experts: int, num_topk: int, num_ranks: int, num_ranks_per_node: int
) -> dict[str, float]:
    """Closed-form expectation of ``traffic.cross_node_copies`` under uniform routing (no node limit).

    Keys as in ``cross_node_copies``: each of the K experts is off the source node with probability
    ``1 - 1/N``; each other rank / node is touched with the probability that not all K experts miss it.
    """
    check_placement(num_experts, num_ranks, num_ranks_per_node)
    require(1 <= num_topk <= num_experts, f"num_topk must be in [1, num_experts={num_experts}], got {num_topk}")
    num_nodes = num_ranks // num_ranks_per_node
    node_hit = expected_groups_touched(num_experts, num_topk, num_nodes) / num_nodes
    rank_hit = expected_groups_touched(num_experts, num_topk, num_ranks) / num_ranks
    return {
        "per_expert": num_topk * (1.0 - 1.0 / num_nodes),
        "per_rank": (num_ranks - num_ranks_per_node) * rank_hit,
        "per_node": (num_nodes - 1) * node_hit,
        "nodes_per_token": num_nodes * node_hit,
        "ranks_per_token": num_ranks * rank_hit,
    }


def theoretical_num_sms(
    num_experts: int,
    num_topk: int,
    num_ranks: int,
    num_nvlink_ranks: int,
    num_scaleout_ranks: int,
    *,
    nvlink_gbs: float,
    rdma_gbs: float = 0.0,
    sm_read_gbs: float = 200.0,
    sm_write_gbs: float = 50.0,
    prefer_overlap_with_compute: bool = True,
    device_sms: int = 132,
) -> int:
    """Fewest SMs (even, >= 4, <= device_sms) that keep the bottleneck link saturated.

    Traffic is counted per unit of data a rank sends over scale-up. ``k`` is the expected number of
    ranks a token touches, so a token read once from HBM feeds ``k`` sends (read 1/k per unit).
    Hybrid (``num_scaleout_ranks > 1``): the token is also staged once for scale-out, and forwarders
    re-read what arrived; scale-up carries ``1 - 1/SU`` of it. Direct: every unit is written into a
    receive slot, of which ``(NVL/R)(1 - 1/NVL)`` crosses NVLink. The bottleneck link's rate divided
    by its share of the traffic gives the data rate; dividing the HBM read and write it implies by
    the per-SM rates gives SMs. ``rdma_gbs=0`` means the scale-out link is not a bottleneck (e.g.
    emulated nodes over NVLink); direct mode is always sized as NVLink-bound.
    """
    require(num_ranks >= 1, f"num_ranks must be >= 1, got {num_ranks}")
    require(
        num_nvlink_ranks >= 1 and num_ranks % num_nvlink_ranks == 0,
        f"num_nvlink_ranks must divide num_ranks ({num_ranks}), got {num_nvlink_ranks}",
    )
    require(
        num_scaleout_ranks >= 1 and num_ranks % num_scaleout_ranks == 0,
        f"num_scaleout_ranks must divide num_ranks ({num_ranks}), got {num_scaleout_ranks}",
    )
    require(
        num_experts >= 1 and num_experts % num_ranks == 0,
        f"num_experts ({num_experts}) must be a positive multiple of num_ranks ({num_ranks})",
    )
    require(nvlink_gbs > 0, f"nvlink_gbs must be > 0, got {nvlink_gbs}")
    require(rdma_gbs >= 0, f"rdma_gbs must be >= 0 (0 = not a bottleneck), got {rdma_gbs}")
    require(sm_read_gbs > 0, f"sm_read_gbs must be > 0, got {sm_read_gbs}")
    require(sm_write_gbs > 0, f"sm_write_gbs must be > 0, got {sm_write_gbs}")
    require(device_sms >= 1, f"device_sms must be >= 1, got {device_sms}")

    ranks_touched = expected_groups_touched(num_experts, num_topk, num_ranks)
    read = 1.0 / ranks_touched
    write = 0.0
    if num_scaleout_ranks > 1:
        scaleout = num_scaleout_ranks
        scaleup = num_ranks // scaleout
        nodes_touched = expected_groups_touched(num_experts, num_topk, scaleout)
        # Scale-out send staging, plus the share that stays on this node and bypasses the network.
        write += read + read * nodes_touched / scaleout
        rdma_traffic = read * nodes_touched * (1.0 - 1.0 / scaleout)
        # Forwarders read each arrived token once per node it reached, then write every scale-up unit.
        read += nodes_touched / ranks_touched
        write += 1.0
        nvlink_traffic = 1.0 - 1.0 / scaleup
    else:
        nvl = num_nvlink_ranks
        if num_ranks // nvl > 1:
            write += read
        write += nvl / num_ranks
        nvlink_traffic = (nvl / num_ranks) * (1.0 - 1.0 / nvl)
        rdma_traffic = (num_ranks - nvl) / num_ranks

    rdma_bound = num_scaleout_ranks > 1 and rdma_gbs > 0 and rdma_traffic / rdma_gbs > nvlink_traffic / nvlink_gbs
    link_gbs, link_traffic = (rdma_gbs, rdma_traffic) if rdma_bound else (nvlink_gbs, nvlink_traffic)
    if link_traffic > 0:
        data_gbs = link_gbs / link_traffic
        sms = max(data_gbs * read / sm_read_gbs, data_gbs * write / sm_write_gbs)
    else:
        sms = float(device_sms)
    num_sms = max(MIN_SMS, math.ceil(SM_MARGIN * sms))
    num_sms += num_sms % 2
    if not prefer_overlap_with_compute:
        num_sms = max(num_sms, NO_OVERLAP_MIN_SMS)
    return min(num_sms, device_sms)


def theoretical_num_qps(num_sms: int, hybrid: bool) -> int:
    """Queue pairs to request for ``num_sms`` SMs: direct ``min(num_sms, 9)``, hybrid ``num_sms * 16 + 1``."""
    require(num_sms >= 1, f"num_sms must be >= 1, got {num_sms}")
    return num_sms * 16 + 1 if hybrid else min(num_sms, DIRECT_MAX_QPS)
