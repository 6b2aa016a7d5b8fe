"""Pre-flight check before building buffers: what decides whether they can be built, how they will run,
and what would fail (or hang) later, with the fix.

    python -m deep_ep.doctor [--ranks-per-gpu N] [--json]                  # this machine
    torchrun --nproc-per-node 8 [--nnodes ...] -m deep_ep.doctor [--smoke]  # every rank of the group

One machine: the versions (deep_ep, torch, NCCL loaded and compiled against, the kernels' GPU
architectures), the GPUs and their peer access, MPS and module loading for ranks sharing a GPU.
Under torchrun (``RANK`` / ``WORLD_SIZE`` set) every rank checks itself, then rank 0 compares the
ranks (versions must agree: a rank on another build reads the window at other offsets) and prints
the topology a buffer on that group would use: hosts, ranks per GPU, backend, HT mode (direct or
hybrid), scale-out transport and the SM cap. The process group is gloo (objects only), so ranks
sharing a GPU can run it too. ``--smoke`` then builds a buffer on the group and runs the demo's
round trips (HT, and LL when the ranks are on one host), each output compared bitwise with the
reference model, with a 20 s device deadline (``--timeout``): a hang becomes a CommTimeoutError that
names the missing peer. Exit status 1 when any rank has an error finding.

An NCCL mismatch stops ``import deep_ep`` itself (with the fix in the message), before this runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

import deep_ep
from deep_ep import _C
from deep_ep._nccl_check import format_nccl_version, loaded_nccl_libraries
from deep_ep.topology import (
    RankFacts,
    build_topology,
    choose_backend,
    choose_scaleout_transport,
    gpu_is_shared,
    ht_sm_cap,
    mps_is_running,
    requested_backend,
    requested_scaleout_transport,
    sm_cap,
)

MIN_NCCL_VERSION_CODE = 22800  # NCCL 2.28: the device API (LSA pointers, GIN) the kernels use
# Environment variables a report lists: ours, and those of the libraries that change how we run.
ENV_PREFIXES = ("EP_", "NCCL_", "CUDA_", "NVSHMEM_", "TORCH_SYMM_MEM", "PYTORCH_CUDA_ALLOC_CONF")
# Values that must agree across the ranks of a group.
AGREEING_FIELDS = ("deep_ep", "torch", "nccl_loaded", "cuda_archs")
RDMA_SYSFS = "/sys/class/infiniband"  # one directory per RDMA device (InfiniBand or RoCE)
# NCCL settings that take away what GIN (the scale-out transport between hosts) needs: (name, value, why).
GIN_BLOCKERS = (
    ("NCCL_GIN_ENABLE", "0", "disables GPU-initiated networking"),
    ("NCCL_IB_DISABLE", "1", "disables NCCL's IB transport, which GIN runs over"),
    ("NCCL_GIN_NCONTEXTS", "0", "leaves GIN no context"),
)


@dataclass(frozen=True)
class Finding:
    level: str  # "error": a buffer would fail or hang; "warning": works, with a cost or a hazard; "info"
    message: str


def rdma_ports(root: str = RDMA_SYSFS) -> list[dict[str, str]]:
    """Every RDMA device port: ``{"device", "port", "state", "link_layer"}`` (state e.g. ``ACTIVE``,
    link layer ``InfiniBand`` or ``Ethernet`` for RoCE); empty without RDMA devices."""
    ports = []
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return ports
    for device in devices:
        ports_dir = os.path.join(root, device, "ports")
        try:
            numbers = sorted(os.listdir(ports_dir))
        except OSError:
            continue
        for number in numbers:
            fields = {}
            for name in ("state", "link_layer"):
                try:
                    with open(os.path.join(ports_dir, number, name)) as file:
                        fields[name] = file.read().strip()
                except OSError:
                    fields[name] = "unknown"
            state = fields["state"].split(":", 1)[-1].strip()  # "4: ACTIVE" -> "ACTIVE"
            ports.append({"device": device, "port": number, "state": state, "link_layer": fields["link_layer"]})
    return ports


def local_report() -> dict[str, Any]:
    """This process's facts (no collective call)."""
    gpus = []
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for index in range(num_gpus):
        properties = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "index": index,
                "name": properties.name,
                "capability": f"{properties.major}{properties.minor}",
                "sm_count": properties.multi_processor_count,
                "memory_gib": round(properties.total_memory / 2**30, 1),
                "uuid": str(properties.uuid),
            }
        )
    gpu_range = range(num_gpus)
    peer_access = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in gpu_range] for i in gpu_range]
    loaded = _C.nccl_loaded_version()
    return {
        "host": socket.gethostname(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "deep_ep": deep_ep.__version__,
        "cuda_archs": _C.cuda_archs().split(","),
        "nccl_compiled": format_nccl_version(_C.nccl_compiled_version()),
        "nccl_loaded": format_nccl_version(loaded),
        "nccl_loaded_code": loaded,
        "nccl_libraries": loaded_nccl_libraries(),
        "gpus": gpus,
        "peer_access": peer_access,
        "current_device": torch.cuda.current_device() if num_gpus else None,
        "mps_running": mps_is_running(),
        "rdma_ports": rdma_ports(),
        "env": {name: value for name, value in sorted(os.environ.items()) if name.startswith(ENV_PREFIXES)},
    }


def check_local(report: dict[str, Any], ranks_per_gpu: int = 1) -> list[Finding]:
    """Findings about one machine; ``ranks_per_gpu``: how many ranks will share each GPU."""
    findings = []
    gpus = report["gpus"]
    if not gpus:
        visible = report["env"].get("CUDA_VISIBLE_DEVICES", "unset")
        findings.append(
            Finding("error", f"no CUDA GPU is visible (CUDA_VISIBLE_DEVICES={visible}): every rank needs a GPU")
        )
    archs = report["cuda_archs"]
    for gpu in gpus:
        if gpu["capability"] not in archs:
            findings.append(
                Finding(
                    "error",
                    f"GPU {gpu['index']} ({gpu['name']}) is sm_{gpu['capability']}, but the kernels were compiled for "
                    f"sm_{', sm_'.join(archs)} only (SASS, no PTX to JIT), so they cannot load: rebuild with "
                    f'CMAKE_ARGS="-DEP_CUDA_ARCHS={gpu["capability"]}" pip install --no-build-isolation --no-deps -e .',
                )
            )
    if report["nccl_loaded_code"] < MIN_NCCL_VERSION_CODE:
        findings.append(
            Finding("error", f"NCCL {report['nccl_loaded']} is loaded; deep_ep needs NCCL >= 2.28 (its device API)")
        )
    if len(report["nccl_libraries"]) > 1:
        findings.append(
            Finding(
                "warning",
                f"{len(report['nccl_libraries'])} different NCCL libraries are loaded: "
                f"{', '.join(report['nccl_libraries'])}; a communicator made by one is invalid in the other "
                "(import torch first; check LD_PRELOAD / LD_LIBRARY_PATH)",
            )
        )
    access = report["peer_access"]
    blocked = [(i, j) for i in range(len(access)) for j in range(i + 1, len(access)) if not access[i][j]]
    if blocked:
        pairs = ", ".join(f"{i}-{j}" for i, j in blocked)
        findings.append(
            Finding(
                "warning",
                f"GPU pairs without peer access: {pairs}. Ranks on such GPUs cannot be in one load/store domain "
                "(direct mode, low-latency mode and the NVLink leg of hybrid mode need it); check `nvidia-smi topo "
                "-m` and the platform's P2P / IOMMU settings",
            )
        )
    if ranks_per_gpu > 1 and gpus:
        if not report["mps_running"]:
            pipe = report["env"].get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
            findings.append(
                Finding(
                    "warning",
                    f"{ranks_per_gpu} ranks per GPU but NVIDIA MPS does not run (no control pipe in {pipe}): without "
                    "it the ranks' kernels time-slice and every cross-rank wait costs milliseconds "
                    "(start nvidia-cuda-mps-control -d with the same CUDA_MPS_PIPE_DIRECTORY for every rank)",
                )
            )
        if report["env"].get("CUDA_MODULE_LOADING", "LAZY").upper() != "EAGER":
            findings.append(
                Finding(
                    "warning",
                    f"{ranks_per_gpu} ranks per GPU with lazy module loading: under MPS a rank's first use of a "
                    "kernel may wait for the peers' spinning kernels until their deadline; set "
                    "CUDA_MODULE_LOADING=EAGER before CUDA starts and run each compute path once before communicating",
                )
            )
    return findings


def check_group(reports: list[dict[str, Any]], *, allow_hybrid_mode: bool = True) -> list[Finding]:
    """Findings about the group (``reports`` by rank): agreement, and the topology a buffer would use."""
    findings = []
    for field in AGREEING_FIELDS:
        values: dict[str, list[int]] = {}
        for rank, report in enumerate(reports):
            values.setdefault(str(report[field]), []).append(rank)
        if len(values) > 1:
            listing = "; ".join(f"{value} on ranks {_ranks_text(ranks)}" for value, ranks in values.items())
            findings.append(Finding("error", f"the ranks disagree on {field}: {listing}"))
    if any(report["current_device"] is None for report in reports):
        return findings  # no topology without a GPU per rank (check_local reported it)
    facts = [
        RankFacts(
            host=report["host"],
            device_uuid=report["gpus"][report["current_device"]]["uuid"],
            sm_count=report["gpus"][report["current_device"]]["sm_count"],
        )
        for report in reports
    ]
    try:
        topology = build_topology(facts, 0, num_ranks_per_node=None, allow_hybrid_mode=allow_hybrid_mode)
        backend = choose_backend(requested_backend(None), gpu_is_shared(facts))
        hybrid = topology.num_scaleout_ranks > 1
        transport = (
            choose_scaleout_transport(topology.spans_hosts, requested_scaleout_transport(), backend=backend)
            if hybrid
            else None
        )
    except ValueError as error:
        findings.append(Finding("error", f"a buffer on this group would not build: {error}"))
        return findings
    num_hosts = len({fact.host for fact in facts})
    per_gpu = max(sum(1 for other in facts if (other.host, other.device_uuid) == gpu) for gpu in _gpus_of(facts))
    sm_count = min(fact.sm_count for fact in facts)
    mode = (
        f"hybrid ({topology.num_scaleout_ranks} nodes of {topology.num_scaleup_ranks} ranks, scale-out "
        f"transport {transport})"
        if hybrid
        else "direct (one load/store domain)"
    )
    findings.append(
        Finding(
            "info",
            f"{topology.num_ranks} ranks on {num_hosts} host(s), up to {per_gpu} per GPU; backend {backend}; HT mode "
            f"{mode}; SM cap per rank {sm_cap(sm_count, per_gpu)} (HT kernels {ht_sm_cap(sm_count, per_gpu)})",
        )
    )
    if topology.spans_hosts:
        findings.append(
            Finding(
                "info",
                "the ranks span hosts: hybrid HT mode and low-latency mode reach the other hosts through NCCL GIN "
                "(an RDMA NIC); low-latency mode across hosts is built but not yet verified on a GPU, and --smoke "
                "checks it on one host only",
            )
        )
        findings += _gin_findings(reports)
    return findings


def _gin_findings(reports: list[dict[str, Any]]) -> list[Finding]:
    """What would make the GIN transport fail on ranks that span hosts: no active RDMA port, or an
    NCCL setting that disables what GIN needs (the buffer would raise at construction)."""
    findings = []
    inactive = [rank for rank, report in enumerate(reports) if not _has_active_port(report)]
    if inactive:
        hosts = sorted({reports[rank]["host"] for rank in inactive})
        findings.append(
            Finding(
                "error",
                f"ranks {_ranks_text(inactive)} (hosts {', '.join(hosts)}) have no active RDMA port in {RDMA_SYSFS}: "
                "hybrid mode between hosts needs NCCL GIN over InfiniBand or RoCE (and GPUDirect RDMA through "
                "nvidia-peermem or DMA-BUF)",
            )
        )
    for name, value, why in GIN_BLOCKERS:
        ranks = [rank for rank, report in enumerate(reports) if report["env"].get(name, "").strip() == value]
        if ranks:
            findings.append(Finding("error", f"{name}={value} on ranks {_ranks_text(ranks)} {why}"))
    return findings


def _has_active_port(report: dict[str, Any]) -> bool:
    return any(port["state"] == "ACTIVE" for port in report.get("rdma_ports", []))


def _gpus_of(facts: list[RankFacts]) -> set[tuple[str, str]]:
    return {(fact.host, fact.device_uuid) for fact in facts}


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def format_report(report: dict[str, Any], findings: list[Finding]) -> str:
    """The human-readable report of one machine and its findings (errors first)."""
    lines = [
        f"deep_ep {report['deep_ep']} on {report['host']}: torch {report['torch']} (CUDA {report['torch_cuda']}), "
        f"NCCL {report['nccl_loaded']} loaded / {report['nccl_compiled']} compiled, kernels for "
        f"sm_{', sm_'.join(report['cuda_archs'])}, MPS {'running' if report['mps_running'] else 'not running'}"
    ]
    for gpu in report["gpus"]:
        lines.append(
            f"  GPU {gpu['index']}: {gpu['name']} (sm_{gpu['capability']}, {gpu['sm_count']} SMs, "
            f"{gpu['memory_gib']} GiB)"
        )
    order = {"error": 0, "warning": 1, "info": 2}
    for finding in sorted(findings, key=lambda item: order[item.level]):
        lines.append(f"[{finding.level}] {finding.message}")
    if not any(finding.level == "error" for finding in findings):
        lines.append("[ok] no errors")
    return "\n".join(lines)


def _group_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group("gloo")
    try:
        report = local_report()
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, report)
        uuid = report["gpus"][report["current_device"]]["uuid"] if report["current_device"] is not None else None
        ranks_per_gpu = sum(
            1
            for other in reports
            if other["host"] == report["host"]
            and other["current_device"] is not None
            and other["gpus"][other["current_device"]]["uuid"] == uuid
        )
        local = check_local(report, ranks_per_gpu)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, [asdict(finding) for finding in local])
        per_rank = [[Finding(**item) for item in items] for items in gathered]
        findings = check_group(reports, allow_hybrid_mode=not args.no_hybrid) + merge_rank_findings(per_rank)
        if args.smoke and not any(finding.level == "error" for finding in findings):
            spans_hosts = len({other["host"] for other in reports}) > 1
            outcome = smoke_test(rank, world, dist.group.WORLD, low_latency=not spans_hosts, timeout=args.timeout)
            outcomes: list[Any] = [None] * world
            dist.all_gather_object(outcomes, asdict(outcome))
            findings += merge_rank_findings([[Finding(**item)] for item in outcomes])
    finally:
        dist.destroy_process_group()
    if rank == 0:
        if args.json:
            print(json.dumps({"reports": reports, "findings": [asdict(finding) for finding in findings]}))
        else:
            print(format_report(reports[0], findings))
    return 1 if any(finding.level == "error" for finding in findings) else 0


def smoke_test(rank: int, num_ranks: int, group: Any, *, low_latency: bool, timeout: float) -> Finding:
    """This rank's outcome of the demo's checked round trips (deep_ep.demo.round_trip) on ``group``:
    one HT dispatch -> identity expert -> combine, and with ``low_latency`` one LL dispatch -> combine,
    every output compared bitwise with the reference model; device waits end after ``timeout`` s."""
    from deep_ep.demo import demo_num_experts, round_trip

    try:
        result = round_trip(
            rank,
            num_ranks,
            group,
            demo_num_experts(num_ranks),
            seed=0,
            low_latency=low_latency,
            num_gpu_timeout_secs=timeout,
        )
    except Exception as error:  # noqa: BLE001 - every failure is a finding, named by its type
        return Finding("error", f"round trip failed: {type(error).__name__}: {error}")
    failed = [name for name, passed in result["passed"].items() if not passed]
    if failed:
        return Finding("error", f"round trip differs from the reference model in {', '.join(failed)}")
    return Finding("info", "round trip equals the reference model (" + ", ".join(result["passed"]) + ")")


def merge_rank_findings(per_rank: list[list[Finding]]) -> list[Finding]:
    """One finding per distinct message, naming the ranks that reported it."""
    merged: dict[Finding, list[int]] = {}
    for rank, findings in enumerate(per_rank):
        for finding in findings:
            merged.setdefault(finding, []).append(rank)
    return [
        Finding(finding.level, f"rank{'s' if len(ranks) > 1 else ''} {_ranks_text(ranks)}: {finding.message}")
        for finding, ranks in merged.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks-per-gpu", type=int, default=1, help="ranks that will share each GPU (one machine)")
    parser.add_argument("--no-hybrid", action="store_true", help="check as allow_hybrid_mode=False (torchrun)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="torchrun: when no check fails, build a buffer on the group and run the demo's checked round trips "
        "(HT, and LL on one host)",
    )
    parser.add_argument("--timeout", type=float, default=20.0, help="--smoke: device wait deadline in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")
    args = parser.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _group_main(args)
    report = local_report()
    findings = check_local(report, args.ranks_per_gpu)
    if args.json:
        print(json.dumps({"report": report, "findings": [asdict(finding) for finding in findings]}))
    else:
        print(format_report(report, findings))
    return 1 if any(finding.level == "error" for finding in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
