"""DeepEP V2's module-level domain queries: how a process group splits into nodes, without a buffer.

``get_physical_domain_size(group)`` and ``get_logical_domain_size(group, allow_hybrid_mode=True)``
are collective (one all-gather of every rank's host and GPU) and give the same answers a buffer
built on that group would (``ElasticBuffer.get_physical_domain_size()`` /
``get_logical_domain_size()``): the same facts go through the same ``build_topology``.
"""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist

from deep_ep.topology import RankFacts, Topology, build_topology

__all__ = ["get_logical_domain_size", "get_physical_domain_size", "local_rank_facts"]


def local_rank_facts() -> RankFacts:
    """This process's host and current GPU, as a buffer reports them at construction."""
    if not torch.cuda.is_available():
        raise RuntimeError("deep_ep needs a CUDA device to describe this rank's GPU; none is available")
    properties = torch.cuda.get_device_properties(torch.cuda.current_device())
    return RankFacts(
        host=socket.gethostname(), device_uuid=str(properties.uuid), sm_count=properties.multi_processor_count
    )


def _group_topology(group: Any, allow_hybrid_mode: bool, num_ranks_per_node: int | None) -> Topology:
    facts: list[Any] = [None] * group.size()
    dist.all_gather_object(facts, local_rank_facts(), group=group)
    return build_topology(
        facts, group.rank(), num_ranks_per_node=num_ranks_per_node, allow_hybrid_mode=allow_hybrid_mode
    )


def get_physical_domain_size(group: Any, num_ranks_per_node: int | None = None) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of ``group`` as the hardware groups them (hosts; on one host the
    virtual nodes of ``num_ranks_per_node`` / ``EP_EMULATE_RANKS_PER_NODE``). Collective."""
    topology = _group_topology(group, True, num_ranks_per_node)
    return topology.num_rdma_ranks, topology.num_nvlink_ranks


def get_logical_domain_size(
    group: Any, allow_hybrid_mode: bool = True, num_ranks_per_node: int | None = None
) -> tuple[int, int]:
    """``(scale-out ranks, scale-up ranks)`` the HT kernels of a buffer on ``group`` would use:
    ``(nodes, ranks per node)`` in hybrid mode, ``(1, R)`` in direct mode. Collective; raises
    ``ValueError`` where a buffer would (ranks on several hosts without ``allow_hybrid_mode``)."""
    topology = _group_topology(group, allow_hybrid_mode, num_ranks_per_node)
    return topology.num_scaleout_ranks, topology.num_scaleup_ranks
