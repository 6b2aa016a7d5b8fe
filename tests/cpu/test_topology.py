"""Topology arithmetic: domains, node emulation, several hosts, GPU sharing, backend and scale-out choice, SM cap."""

from __future__ import annotations

import pytest

from deep_ep.topology import (
    RankFacts,
    build_topology,
    choose_backend,
    choose_scaleout_transport,
    emulated_ranks_per_node,
    gpu_is_shared,
    ht_sm_cap,
    ll_uses_scaleout,
    ranks_per_host,
    requested_backend,
    requested_ll_scaleout,
    requested_scaleout_transport,
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
    assert not topology.spans_hosts


def test_emulated_nodes_split_one_host_into_hybrid_domains():
    facts = _facts(["a"] * 8, ["g"] * 8)
    topology = build_topology(facts, 5, num_ranks_per_node=2, allow_hybrid_mode=True)
    assert (topology.num_rdma_ranks, topology.num_nvlink_ranks) == (4, 2)
    assert (topology.num_scaleout_ranks, topology.num_scaleup_ranks) == (4, 2)
    assert (topology.scaleout_rank_idx(5), topology.scaleup_rank_idx(5)) == (2, 1)
    assert topology.ranks_per_gpu == 8
    assert not topology.spans_hosts


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


def _two_hosts() -> list[RankFacts]:
    return _facts(["a"] * 4 + ["b"] * 4, [f"g{i}" for i in range(4)] * 2)


def test_several_hosts_make_one_node_per_host():
    for rank in range(8):
        topology = build_topology(_two_hosts(), rank, num_ranks_per_node=None, allow_hybrid_mode=True)
        assert topology.spans_hosts
        assert (topology.num_rdma_ranks, topology.num_nvlink_ranks) == (2, 4)
        assert (topology.num_scaleout_ranks, topology.num_scaleup_ranks) == (2, 4)
        assert (topology.scaleout_rank_idx(rank), topology.scaleup_rank_idx(rank)) == (rank // 4, rank % 4)
        assert topology.ranks_per_gpu == 1  # g0 of host a and g0 of host b are different GPUs


def test_several_hosts_accept_a_node_size_equal_to_the_host():
    topology = build_topology(_two_hosts(), 5, num_ranks_per_node=4, allow_hybrid_mode=True)
    assert (topology.num_scaleout_ranks, topology.num_scaleup_ranks) == (2, 4)
    assert topology.spans_hosts


def test_several_hosts_one_rank_each():
    facts = _facts(["a", "b", "c"], ["g0"] * 3)
    topology = build_topology(facts, 2, num_ranks_per_node=None, allow_hybrid_mode=True)
    assert (topology.num_scaleout_ranks, topology.num_scaleup_ranks) == (3, 1)
    assert topology.spans_hosts


@pytest.mark.parametrize("node_size", [1, 2, 8])
def test_several_hosts_refuse_a_node_that_is_not_the_host(node_size):
    with pytest.raises(ValueError, match=f"a node is a host: .* must be 4 or unset, got {node_size}"):
        build_topology(_two_hosts(), 0, num_ranks_per_node=node_size, allow_hybrid_mode=True)


def test_several_hosts_refuse_an_emulated_node_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("EP_EMULATE_RANKS_PER_NODE", "2")
    with pytest.raises(ValueError, match="EP_EMULATE_RANKS_PER_NODE.*got 2"):
        build_topology(_two_hosts(), 0, num_ranks_per_node=None, allow_hybrid_mode=True)
    monkeypatch.setenv("EP_EMULATE_RANKS_PER_NODE", "4")
    topology = build_topology(_two_hosts(), 0, num_ranks_per_node=None, allow_hybrid_mode=True)
    assert topology.num_scaleup_ranks == 4


def test_several_hosts_refuse_direct_mode():
    with pytest.raises(ValueError, match="span 2 hosts.*direct mode \\(allow_hybrid_mode=False\\)"):
        build_topology(_two_hosts(), 0, num_ranks_per_node=None, allow_hybrid_mode=False)
    with pytest.raises(ValueError, match="allow_hybrid_mode=False"):
        build_topology(_two_hosts(), 0, num_ranks_per_node=4, allow_hybrid_mode=False)


def test_scaleout_transport_automatic_choice():
    for requested in (None, "", "  ", "auto"):
        assert choose_scaleout_transport(True, requested, backend="nccl") == "gin"
        assert choose_scaleout_transport(False, requested, backend="nccl") == "lsa"
        assert choose_scaleout_transport(False, requested, backend="ipc") == "lsa"


def test_scaleout_transport_explicit_on_one_host():
    for backend in ("nccl", "ipc"):
        assert choose_scaleout_transport(False, "lsa", backend=backend) == "lsa"
        assert choose_scaleout_transport(False, "lsa-deferred", backend=backend) == "lsa-deferred"
    assert choose_scaleout_transport(False, "gin", backend="nccl") == "gin"
    assert choose_scaleout_transport(False, " gin ", backend="nccl") == "gin"
    with pytest.raises(ValueError, match="'gin' needs NCCL GPU-initiated networking.*backend 'nccl' only.*'ipc'"):
        choose_scaleout_transport(False, "gin", backend="ipc")


def test_scaleout_transport_on_several_hosts():
    assert choose_scaleout_transport(True, "gin", backend="nccl") == "gin"
    for requested in ("lsa", "lsa-deferred"):
        with pytest.raises(ValueError, match=f"'{requested}' needs every rank load/store reachable.*several hosts"):
            choose_scaleout_transport(True, requested, backend="nccl")
    for requested in (None, "gin"):
        with pytest.raises(ValueError, match="ranks on several hosts need .*backend 'nccl' only, got backend 'ipc'"):
            choose_scaleout_transport(True, requested, backend="ipc")


@pytest.mark.parametrize("requested", ["nvshmem", "GIN", "lsa_deferred", "ibgda"])
def test_scaleout_transport_unknown_names_are_refused(requested):
    for spans_hosts in (False, True):
        with pytest.raises(ValueError, match="must be one of 'lsa', 'lsa-deferred', 'gin'"):
            choose_scaleout_transport(spans_hosts, requested, backend="nccl")


def test_scaleout_transport_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be 'nccl' or 'ipc'"):
        choose_scaleout_transport(False, None, backend="auto")


def test_scaleout_transport_request_reads_the_environment(monkeypatch):
    monkeypatch.delenv("EP_SCALEOUT_TRANSPORT", raising=False)
    assert requested_scaleout_transport() is None
    monkeypatch.setenv("EP_SCALEOUT_TRANSPORT", "  ")
    assert requested_scaleout_transport() is None
    monkeypatch.setenv("EP_SCALEOUT_TRANSPORT", " lsa-deferred ")
    assert requested_scaleout_transport() == "lsa-deferred"
    assert choose_scaleout_transport(False, requested_scaleout_transport(), backend="ipc") == "lsa-deferred"
    monkeypatch.setenv("EP_SCALEOUT_TRANSPORT", "bogus")
    with pytest.raises(ValueError, match="got 'bogus'"):
        choose_scaleout_transport(False, requested_scaleout_transport(), backend="nccl")


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


def test_ht_sm_cap_leaves_half_of_a_shared_gpu_to_compute():
    assert ht_sm_cap(132, 1) == 132
    assert ht_sm_cap(132, 2) == 33
    assert ht_sm_cap(132, 4) == 16
    assert ht_sm_cap(132, 8) == 8
    assert ht_sm_cap(4, 8) == 1
    for ranks in range(2, 9):
        assert ranks * ht_sm_cap(132, ranks) <= 66


def test_backend_none_reads_ep_backend(monkeypatch):
    monkeypatch.delenv("EP_BACKEND", raising=False)
    assert requested_backend(None) == "auto"
    monkeypatch.setenv("EP_BACKEND", "ipc")
    assert requested_backend(None) == "ipc"
    assert requested_backend("nccl") == "nccl"  # an explicit argument wins
    monkeypatch.setenv("EP_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be"):
        choose_backend(requested_backend(None), False)


def test_ll_uses_the_scaleout_transport_across_hosts_and_on_request():
    assert ll_uses_scaleout(True, 2, True, False)  # several hosts: always
    assert ll_uses_scaleout(True, 2, False, True)  # virtual nodes: on request
    assert not ll_uses_scaleout(True, 2, False, False)
    assert not ll_uses_scaleout(True, 1, False, True)  # one node: nothing to reach
    assert not ll_uses_scaleout(False, 2, True, True)  # no LL region


def test_ll_scaleout_request_reads_its_variable(monkeypatch):
    monkeypatch.delenv("EP_LL_SCALEOUT", raising=False)
    assert requested_ll_scaleout() is False
    monkeypatch.setenv("EP_LL_SCALEOUT", "1")
    assert requested_ll_scaleout() is True
    monkeypatch.setenv("EP_LL_SCALEOUT", "yes")
    with pytest.raises(ValueError, match="EP_LL_SCALEOUT must be 0 or 1"):
        requested_ll_scaleout()


def test_the_runtime_refuses_an_ht_cap_above_the_rank_share():
    # The runtime checks its configuration before it touches a GPU: this runs without one.
    from deep_ep import _C

    with pytest.raises(ValueError, match=r"max_ht_num_sms must be in \[0, max_num_sms=4\].*got 8"):
        _C.Runtime(0, 1, 1, 0, 0, 0, 10.0, 20.0, "ipc", 4, "lsa", 8)
