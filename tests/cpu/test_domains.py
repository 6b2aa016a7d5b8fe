"""deep_ep.get_physical_domain_size / get_logical_domain_size over a real (one-process, gloo) group,
with this rank's GPU facts supplied by the test (no GPU here)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import deep_ep
from deep_ep import domains
from deep_ep.topology import RankFacts


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(domains, "local_rank_facts", lambda: RankFacts("host-a", "GPU-0", 132))
    monkeypatch.delenv("EP_EMULATE_RANKS_PER_NODE", raising=False)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_one_rank_is_one_node_in_both_views(group) -> None:
    assert deep_ep.get_physical_domain_size(group) == (1, 1)
    assert deep_ep.get_logical_domain_size(group) == (1, 1)
    assert deep_ep.get_logical_domain_size(group, allow_hybrid_mode=False) == (1, 1)


def test_the_queries_agree_with_build_topology_on_the_gathered_facts(group, monkeypatch) -> None:
    seen = []
    real = domains.build_topology

    def recording(facts, rank, **kwargs):
        seen.append((facts, rank, kwargs))
        return real(facts, rank, **kwargs)

    monkeypatch.setattr(domains, "build_topology", recording)
    deep_ep.get_logical_domain_size(group, allow_hybrid_mode=False, num_ranks_per_node=1)
    assert seen == [([RankFacts("host-a", "GPU-0", 132)], 0, {"num_ranks_per_node": 1, "allow_hybrid_mode": False})]
