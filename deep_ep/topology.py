"""Topology arithmetic for a buffer: physical and logical domains, GPU sharing, backend and scale-out choice.

Pure functions over facts gathered from every rank, so they are unit-tested without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class RankFacts:
    """What one rank reports about itself at construction (gathered from every rank)."""

    host: str
    device_uuid: str
    sm_count: int


@dataclass(frozen=True)
class Topology:
    num_ranks: int
    num_rdma_ranks: int  # physical scale-out domains (nodes; virtual nodes under emulation)
    num_nvlink_ranks: int  # ranks per physical load/store domain
    num_scaleout_ranks: int  # logical
    num_scaleup_ranks: int  # logical
    ranks_per_gpu: int  # ranks of this host sharing this rank's GPU
    spans_hosts: bool  # the ranks are on several hosts (then nodes are hosts and the mode is hybrid)

    def scaleout_rank_idx(self, rank: int) -> int:
        return rank // self.num_scaleup_ranks

    def scaleup_rank_idx(self, rank: int) -> int:
        return rank % self.num_scaleup_ranks


def emulated_ranks_per_node(num_ranks_per_node: int | None) -> int | None:
    """The constructor argument, else env EP_EMULATE_RANKS_PER_NODE, else None."""
    if num_ranks_per_node is not None:
        return num_ranks_per_node
    value = os.environ.get("EP_EMULATE_RANKS_PER_NODE", "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"EP_EMULATE_RANKS_PER_NODE must be an integer, got {value!r}") from None


def ranks_per_host(hosts: list[str]) -> int:
    """Ranks per host; hosts must hold equal, contiguous blocks of ranks (global rank = node * size + local)."""
    blocks: list[tuple[str, int]] = []
    for host in hosts:
        if blocks and blocks[-1][0] == host:
            blocks[-1] = (host, blocks[-1][1] + 1)
        else:
            blocks.append((host, 1))
    seen = [host for host, _ in blocks]
    if len(set(seen)) != len(seen):
        raise ValueError(
            f"ranks of a host must be contiguous (global rank = node * ranks_per_node + local index), "
            f"got host order {hosts}"
        )
    sizes = {size for _, size in blocks}
    if len(sizes) != 1:
        raise ValueError(f"every host must hold the same number of ranks, got {[size for _, size in blocks]}")
    return sizes.pop()


def build_topology(
    facts: list[RankFacts], rank: int, *, num_ranks_per_node: int | None, allow_hybrid_mode: bool
) -> Topology:
    """Domains of the group as seen by ``rank``.

    On one host a node is ``num_ranks_per_node`` (else env ``EP_EMULATE_RANKS_PER_NODE``, else the
    whole host) consecutive ranks. Ranks on several hosts need hybrid mode (``allow_hybrid_mode``):
    only the ranks of one host reach each other by load/store, so a node is exactly a host, and
    the node size, if given, must equal the ranks per host.
    """
    num_ranks = len(facts)
    per_host = ranks_per_host([fact.host for fact in facts])
    num_hosts = num_ranks // per_host
    spans_hosts = num_hosts > 1
    node_size = emulated_ranks_per_node(num_ranks_per_node)
    if spans_hosts:
        if not allow_hybrid_mode:
            raise ValueError(
                f"the ranks span {num_hosts} hosts, which needs hybrid mode: direct mode (allow_hybrid_mode=False) "
                f"needs every rank load/store reachable from every other, i.e. all ranks on one host"
            )
        if node_size is not None and node_size != per_host:
            raise ValueError(
                f"the ranks span {num_hosts} hosts of {per_host} ranks, so a node is a host: num_ranks_per_node "
                f"(or EP_EMULATE_RANKS_PER_NODE) must be {per_host} or unset, got {node_size}"
            )
    if node_size is None:
        node_size = per_host
    if node_size < 1 or num_ranks % node_size != 0:
        raise ValueError(f"num_ranks_per_node must divide the group size {num_ranks}, got {node_size}")
    num_nodes = num_ranks // node_size
    hybrid = allow_hybrid_mode and num_nodes > 1
    my_gpu = (facts[rank].host, facts[rank].device_uuid)
    ranks_per_gpu = sum(1 for fact in facts if (fact.host, fact.device_uuid) == my_gpu)
    return Topology(
        num_ranks=num_ranks,
        num_rdma_ranks=num_nodes,
        num_nvlink_ranks=node_size,
        num_scaleout_ranks=num_nodes if hybrid else 1,
        num_scaleup_ranks=node_size if hybrid else num_ranks,
        ranks_per_gpu=ranks_per_gpu,
        spans_hosts=spans_hosts,
    )


SCALEOUT_TRANSPORTS = ("lsa", "lsa-deferred", "gin")


def requested_scaleout_transport() -> str | None:
    """Env ``EP_SCALEOUT_TRANSPORT``, stripped; None when unset or empty (automatic choice)."""
    value = os.environ.get("EP_SCALEOUT_TRANSPORT", "").strip()
    return value or None


def requested_ll_scaleout() -> bool:
    """Env ``EP_LL_SCALEOUT=1``: LL reaches the ranks of other virtual nodes through the scale-out
    transport too (for testing it on one host; across hosts it always does)."""
    value = os.environ.get("EP_LL_SCALEOUT", "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"EP_LL_SCALEOUT must be 0 or 1, got {value!r}")
    return value == "1"


def ll_uses_scaleout(has_ll_region: bool, num_scaleout_ranks: int, spans_hosts: bool, requested: bool) -> bool:
    """Whether LL reaches the ranks of other nodes through the scale-out transport: always when
    the ranks span hosts (no load/store there), on request between the virtual nodes of one host,
    never with one node or without an LL region."""
    return has_ll_region and num_scaleout_ranks > 1 and (spans_hosts or requested)


def choose_scaleout_transport(spans_hosts: bool, requested: str | None, *, backend: str) -> str:
    """How hybrid mode moves bytes between nodes: 'lsa', 'lsa-deferred' or 'gin'.

    ``requested`` (env ``EP_SCALEOUT_TRANSPORT``) None, empty or 'auto' chooses: 'gin' (NCCL
    GPU-initiated networking) when the ranks span hosts, else 'lsa' (load/store between the virtual
    nodes of one host). 'lsa' and 'lsa-deferred' need every rank load/store reachable, so they are
    refused on several hosts. 'gin' works on an NCCL window only, so it needs ``backend`` 'nccl'
    (on one host too, where NCCL loops the traffic through the host's RDMA NIC).
    """
    if backend not in ("nccl", "ipc"):
        raise ValueError(f"backend must be 'nccl' or 'ipc' when choosing the scale-out transport, got {backend!r}")
    if requested is not None:
        requested = requested.strip()
    if not requested or requested == "auto":
        choice = "gin" if spans_hosts else "lsa"
    elif requested in SCALEOUT_TRANSPORTS:
        choice = requested
    else:
        raise ValueError(
            f"EP_SCALEOUT_TRANSPORT must be one of 'lsa', 'lsa-deferred', 'gin' (or unset / 'auto' for the automatic "
            f"choice), got {requested!r}"
        )
    if spans_hosts and choice != "gin":
        raise ValueError(
            f"scale-out transport {choice!r} needs every rank load/store reachable, but the ranks span several "
            f"hosts; use 'gin' (or leave EP_SCALEOUT_TRANSPORT unset)"
        )
    if choice == "gin" and backend != "nccl":
        where = "ranks on several hosts need" if spans_hosts else "scale-out transport 'gin' needs"
        raise ValueError(
            f"{where} NCCL GPU-initiated networking (gin), which works on backend 'nccl' only, got backend {backend!r}"
        )
    return choice


def gpu_is_shared(facts: list[RankFacts]) -> bool:
    gpus = [(fact.host, fact.device_uuid) for fact in facts]
    return len(set(gpus)) != len(gpus)


def requested_backend(backend: str | None) -> str:
    """The constructor's ``backend``; None reads env ``EP_BACKEND`` (default "auto")."""
    if backend is None:
        backend = os.environ.get("EP_BACKEND", "").strip() or "auto"
    return backend


def choose_backend(requested: str, shared_gpu: bool) -> str:
    """'auto' → 'nccl' when every rank has its own GPU, else 'ipc' (NCCL refuses two ranks on one GPU)."""
    if requested not in ("auto", "nccl", "ipc"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'ipc', got {requested!r}")
    if requested == "nccl" and shared_gpu:
        raise ValueError(
            "backend='nccl' cannot serve ranks that share a GPU (NCCL refuses duplicate GPUs); use backend='ipc'"
        )
    if requested == "auto":
        return "ipc" if shared_gpu else "nccl"
    return requested


def sm_cap(sm_count: int, ranks_per_gpu: int) -> int:
    """SMs one rank may use: every rank's spinning kernels must fit on the GPU at once."""
    return max(1, sm_count // max(1, ranks_per_gpu))


def ht_sm_cap(sm_count: int, ranks_per_gpu: int) -> int:
    """SMs one rank's HT dispatch / combine kernels may use (``num_sms``).

    One rank per GPU: all of them. Ranks sharing a GPU: half of the rank's share, so that the
    sharing ranks' HT kernels leave half the GPU to compute. HT kernels synchronise their whole
    grid (every CTA resident at once) while the peers' kernels spin; with the full share (every
    SM taken when all ranks spin) a rank whose expert GEMMs run beside its peers' HT kernels could
    not get its own grid resident until the peers' deadline. Measured on one H200 under MPS with
    the example MoE layer's training steps: at 4 ranks 33 SMs per rank timed out in the second
    step, 16 and 8 passed; at 8 ranks 16 timed out in the third step, 8 passed.
    """
    share = sm_cap(sm_count, ranks_per_gpu)
    return share if ranks_per_gpu <= 1 else max(1, share // 2)


def mps_is_running() -> bool:
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe_dir, "control"))
