"""Low-latency dispatch and combine across (virtual) nodes, over the scale-out transport.

With ``EP_LL_SCALEOUT=1`` a buffer of several virtual nodes sends LL messages to the ranks of other
nodes with the transport's put + signal (staged rows, arrival and release signals) and keeps
load/store inside a node: the path ranks on several hosts take over GIN. Run here with the two
one-host transports: ``lsa`` (stores through the peer table) and ``lsa-deferred`` (a put's bytes
land only when a signal covering it is sent, or at flush, so a signal that does not cover its data
or a staging row reused too early shows as wrong data).

The scenarios are test_low_latency.py's, unchanged: every case bitwise against the reference model
(fp8 / bf16, hooks, async, compact and per-source rows, zero-copy combine, UE8M0 scales), CUDA
graphs with hooks (50 replays), a slow rank that must never have unread data overwritten, LL
interleaved with HT (hybrid mode on these buffers), release counts run past 2^31 and 2^32 (as
signals and published counts across nodes), and the kernel launches of each mode (one kernel
function per operation, the instantiation that reaches other nodes). Topologies: 8 ranks as 2x4 and 4x2, 4 ranks as
2x2; each (topology, transport) is one launch.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import test_low_latency as ll
import torch

from deep_ep.testing import launch

TRANSPORTS = ("lsa", "lsa-deferred")
# (ranks, ranks per node)
TOPOLOGIES = [
    pytest.param(8, 4, id="2x4"),
    pytest.param(8, 2, id="4x2"),
    pytest.param(4, 2, id="2x2"),
]


def _rank_main(rank: int, num_ranks: int, group: Any, ranks_per_node: int, transport: str) -> dict:
    # Read when each buffer is built; every rank sets the same values.
    os.environ["EP_LL_SCALEOUT"] = "1"
    os.environ["EP_SCALEOUT_TRANSPORT"] = transport
    # Fewer graph replays than test_low_latency.py (still every area and input set many times over):
    # this file runs its scenarios once per (topology, transport).
    ll.GRAPH_REPLAYS = 50
    results: dict[str, Any] = {}
    for spec, cases in ll.SPECS:
        buffer = ll._make_buffer(group, spec, num_ranks, num_ranks_per_node=ranks_per_node)
        try:
            results["ll_scaleout"] = buffer.ll_scaleout
            results["transport"] = buffer.scaleout_transport
            results.setdefault("reference", {}).update(ll._reference_cases(buffer, rank, num_ranks, spec, cases))
            results.setdefault("dirty_workspace_bytes", {})[spec.name] = buffer._debug_count_dirty_workspace_bytes()
            if spec.name == "E64_H2048":
                results["graph_hook"] = ll._cuda_graph(buffer, rank, num_ranks, spec, with_hook=True)
            if spec.with_high_throughput:
                results["skew"] = ll._skew(buffer, rank, num_ranks, spec)
                results["interleave"] = ll._interleave_with_high_throughput(buffer, rank, num_ranks, spec)
                results["launches"] = ll._launches(buffer, rank, num_ranks, spec)
        finally:
            buffer.destroy()
        torch.cuda.empty_cache()
    # Across nodes the releases are signals and the published counts a workspace array: both 64-bit.
    results["near_overflow"] = ll._counts_near_overflow(group, rank, num_ranks, num_ranks_per_node=ranks_per_node)
    return results


def _results(num_ranks: int, topology_ranks: int, ranks_per_node: int, transport: str) -> list[dict]:
    if num_ranks != topology_ranks:
        pytest.skip(
            f"{topology_ranks // ranks_per_node}x{ranks_per_node} virtual nodes need {topology_ranks} ranks; "
            f"this run launches {num_ranks} (EP_TEST_RANKS)"
        )
    return launch(_rank_main, num_ranks, ranks_per_node, transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("topology_ranks, ranks_per_node", TOPOLOGIES)
def test_low_latency_across_virtual_nodes_matches_the_reference_bitwise(
    num_ranks: int, topology_ranks: int, ranks_per_node: int, transport: str
) -> None:
    results = _results(num_ranks, topology_ranks, ranks_per_node, transport)
    for rank, result in enumerate(results):
        assert result["ll_scaleout"] and result["transport"] == transport, (rank, result["transport"])
        dirty = result["dirty_workspace_bytes"]
        assert all(count == 0 for count in dirty.values()), (rank, dirty)
    failures = []
    for key in ("reference", "graph_hook", "skew", "interleave", "launches", "near_overflow"):
        failures += [f"{key}: {failure}" for failure in ll._all_failures(results, key)]
    assert not failures, "\n".join(failures)
