"""Topology arithmetic: domains, node emulation, GPU sharing, backend choice, SM cap."""

from __future__ import annotations

import pytest

from deep_ep.topology import (
    RankFacts,
    build_topology,
    choose_backend,
    emulated_ranks_per_node,
    gpu_is_shared,
    ranks_per_host,
    requested_backend,
    sm_cap,
)


def _facts(hosts: list[str], gpus: list[str]) -> list[RankFacts]:
    return [RankFacts(host=host, device_uuid=gpu, sm_count=132) for host, gpu in zip(hosts, gpus, strict=True)]


def test_one_host_is_one_direct_domain():
    facts = _facts(["a"] * 8, [f"gpu{i}" for i in range(8)])
    topology = build_topology(facts, 3, num_ranks_per_node=None, allow_hybrid_mode=True)
    assert (topology.num_rdma_ranks, topology.num_nvlink_ranks) == (1, 8)
    assert (topology.num_scaleout_ranks, topology.num_scaleup_ranks) == (1, 8)
    assert topology.ranks_per_gpu == 1
    assert (topology.scaleout_rank_idx(3), topology.scaleup_rank_idx(3)) == (0, 3)


def test_emulated_nodes_split_one_host_into_hybrid_domains():
    facts = _facts(["a"] * 8, ["g"] * 8)
    topology = build_topology(facts, 5, num_ranks_per_node=2, allow_hybrid_mode=True)
    assert (topology.num_rdma_ranks, topology.num_nvlink_ranks) == (4, 2)
    assert (topology.num_scaleout_ranks, topology.num_scaleup_ranks) == (4, 2)
    assert (topology.scaleout_rank_idx(5), topology.scaleup_rank_idx(5)) == (2, 1)
    assert topology.ranks_per_gpu == 8


def test_hybrid_disallowed_keeps_one_logical_domain():
    facts = _facts(["a"] * 4, ["g"] * 4)
    topology = build_topology(facts, 0, num_ranks_per_node=2, allow_hybrid_mode=False)
    assert (topology.num_scaleout_ranks, topology.num_scaleup_ranks) == (1, 4)
    assert topology.num_rdma_ranks == 2


def test_emulation_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("EP_EMULATE_RANKS_PER_NODE", "4")
    assert emulated_ranks_per_node(None) == 4
    assert emulated_ranks_per_node(2) == 2
    monkeypatch.setenv("EP_EMULATE_RANKS_PER_NODE", "four")
    with pytest.raises(ValueError, match="EP_EMULATE_RANKS_PER_NODE"):
        emulated_ranks_per_node(None)


def test_node_size_must_divide_the_group():
    facts = _facts(["a"] * 6, ["g"] * 6)
    with pytest.raises(ValueError, match="num_ranks_per_node must divide the group size 6, got 4"):
        build_topology(facts, 0, num_ranks_per_node=4, allow_hybrid_mode=True)


def test_interleaved_hosts_are_rejected():
    with pytest.raises(ValueError, match="contiguous"):
        ranks_per_host(["a", "b", "a", "b"])
    with pytest.raises(ValueError, match="same number of ranks"):
        ranks_per_host(["a", "a", "a", "b"])
    assert ranks_per_host(["a", "a", "b", "b"]) == 2


def test_several_hosts_need_scale_out_which_is_not_implemented():
    facts = _facts(["a", "a", "b", "b"], ["g0", "g1", "g0", "g1"])
    with pytest.raises(NotImplementedError, match="2 hosts"):
        build_topology(facts, 0, num_ranks_per_node=None, allow_hybrid_mode=True)


def test_backend_choice_follows_gpu_sharing():
    shared = _facts(["a"] * 4, ["g0", "g1", "g0", "g1"])
    private = _facts(["a"] * 2, ["g0", "g1"])
    assert gpu_is_shared(shared) and not gpu_is_shared(private)
    assert choose_backend("auto", True) == "ipc"
    assert choose_backend("auto", False) == "nccl"
    assert choose_backend("ipc", False) == "ipc"
    with pytest.raises(ValueError, match="use backend='ipc'"):
        choose_backend("nccl", True)
    with pytest.raises(ValueError, match="'auto', 'nccl' or 'ipc'"):
        choose_backend("nvshmem", False)


def test_sm_cap_splits_the_gpu_between_sharing_ranks():
    assert sm_cap(132, 1) == 132
    assert sm_cap(132, 8) == 16
    assert sm_cap(132, 3) == 44


def test_backend_none_reads_ep_backend(monkeypatch):
    monkeypatch.delenv("EP_BACKEND", raising=False)
    assert requested_backend(None) == "auto"
    monkeypatch.setenv("EP_BACKEND", "ipc")
    assert requested_backend(None) == "ipc"
    assert requested_backend("nccl") == "nccl"  # an explicit argument wins
    monkeypatch.setenv("EP_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be"):
        choose_backend(requested_backend(None), False)
