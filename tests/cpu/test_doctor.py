"""deep_ep.doctor: the findings for synthetic machines and groups, and the CLI on this machine."""

from __future__ import annotations

import json

import pytest

from deep_ep.doctor import Finding, check_group, check_local, main, merge_rank_findings

H200_SMS = 132


def _gpu(index: int, uuid: str, capability: str = "90") -> dict:
    return {
        "index": index,
        "name": "NVIDIA H200",
        "capability": capability,
        "sm_count": H200_SMS,
        "memory_gib": 139.8,
        "uuid": uuid,
    }


def _report(host: str = "node0", num_gpus: int = 1, device: int = 0, **overrides) -> dict:
    report = {
        "host": host,
        "python": "3.12.0",
        "torch": "2.11.0",
        "torch_cuda": "13.0",
        "deep_ep": "0.1.0",
        "cuda_archs": ["90"],
        "nccl_compiled": "2.28.9",
        "nccl_loaded": "2.28.9",
        "nccl_loaded_code": 22809,
        "nccl_libraries": ["/site-packages/nvidia/nccl/lib/libnccl.so.2"],
        "gpus": [_gpu(index, f"{host}-gpu{index}") for index in range(num_gpus)],
        "peer_access": [[True] * num_gpus for _ in range(num_gpus)],
        "current_device": device if num_gpus else None,
        "mps_running": False,
        "rdma_ports": [],
        "env": {},
    }
    report.update(overrides)
    return report


@pytest.fixture(autouse=True)
def _no_topology_overrides(monkeypatch):
    for name in ("EP_EMULATE_RANKS_PER_NODE", "EP_BACKEND", "EP_SCALEOUT_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)


def _levels(findings: list[Finding]) -> list[str]:
    return [finding.level for finding in findings]


def test_a_healthy_machine_has_no_findings():
    assert check_local(_report(num_gpus=8)) == []


def test_no_gpu_is_an_error_naming_the_visible_devices():
    findings = check_local(_report(num_gpus=0, env={"CUDA_VISIBLE_DEVICES": ""}))
    assert _levels(findings) == ["error"]
    assert "no CUDA GPU is visible (CUDA_VISIBLE_DEVICES=)" in findings[0].message


def test_a_gpu_the_kernels_were_not_compiled_for_is_an_error_with_the_rebuild_command():
    report = _report(gpus=[_gpu(0, "u0", capability="100")])
    (finding,) = check_local(report)
    assert finding.level == "error"
    assert "sm_100" in finding.message and "compiled for sm_90 only" in finding.message
    assert '-DEP_CUDA_ARCHS=100"' in finding.message


def test_an_nccl_older_than_2_28_is_an_error_and_two_nccl_libraries_a_warning():
    old = check_local(_report(nccl_loaded="2.27.3", nccl_loaded_code=22703))
    assert _levels(old) == ["error"] and "NCCL 2.27.3 is loaded" in old[0].message
    two = check_local(_report(nccl_libraries=["/a/libnccl.so.2", "/b/libnccl.so.2"]))
    assert _levels(two) == ["warning"] and "/a/libnccl.so.2, /b/libnccl.so.2" in two[0].message


def test_gpu_pairs_without_peer_access_are_named():
    access = [[True, False, True], [False, True, True], [True, True, True]]
    (finding,) = check_local(_report(num_gpus=3, peer_access=access))
    assert finding.level == "warning" and "without peer access: 0-1." in finding.message


def test_ranks_sharing_a_gpu_need_mps_and_eager_module_loading():
    shared = check_local(_report(), ranks_per_gpu=4)
    assert _levels(shared) == ["warning", "warning"]
    assert "4 ranks per GPU but NVIDIA MPS does not run" in shared[0].message
    assert "lazy module loading" in shared[1].message
    ready = _report(mps_running=True, env={"CUDA_MODULE_LOADING": "EAGER"})
    assert check_local(ready, ranks_per_gpu=4) == []


def test_ranks_that_disagree_on_a_version_are_an_error_naming_them():
    reports = [_report(num_gpus=2, device=rank) for rank in range(2)]
    reports[1]["deep_ep"] = "0.2.0"
    findings = check_group(reports)
    assert findings[0] == Finding("error", "the ranks disagree on deep_ep: 0.1.0 on ranks 0; 0.2.0 on ranks 1")


def test_one_host_one_gpu_per_rank_is_direct_mode_on_nccl():
    reports = [_report(num_gpus=8, device=rank) for rank in range(8)]
    (finding,) = check_group(reports)
    assert finding == Finding(
        "info",
        "8 ranks on 1 host(s), up to 1 per GPU; backend nccl; HT mode direct (one load/store domain); "
        f"SM cap per rank {H200_SMS} (HT kernels {H200_SMS})",
    )


def test_ranks_sharing_one_gpu_use_ipc_and_a_share_of_the_sms():
    reports = [_report(num_gpus=1, device=0) for _ in range(4)]
    (finding,) = check_group(reports)
    assert "up to 4 per GPU; backend ipc" in finding.message
    assert finding.message.endswith(f"SM cap per rank {H200_SMS // 4} (HT kernels {H200_SMS // 8})")


ACTIVE_IB_PORT = {"device": "mlx5_0", "port": "1", "state": "ACTIVE", "link_layer": "InfiniBand"}


def _two_hosts(**overrides) -> list[dict]:
    return [_report(host=f"node{rank // 2}", num_gpus=2, device=rank % 2, **overrides) for rank in range(4)]


def test_two_hosts_are_hybrid_over_gin_and_say_what_that_needs():
    reports = _two_hosts(rdma_ports=[ACTIVE_IB_PORT])
    topology, hosts = check_group(reports)
    assert "4 ranks on 2 host(s)" in topology.message
    assert "HT mode hybrid (2 nodes of 2 ranks, scale-out transport gin)" in topology.message
    assert hosts.level == "info" and "low-latency mode across hosts is built but not yet verified" in hosts.message
    refused = check_group(reports, allow_hybrid_mode=False)
    assert _levels(refused) == ["error"]
    assert refused[0].message.startswith("a buffer on this group would not build: the ranks span 2 hosts")


def test_the_same_finding_on_several_ranks_is_reported_once_with_their_ranks():
    shared = Finding("warning", "MPS is off")
    merged = merge_rank_findings([[shared], [shared, Finding("error", "no GPU")], []])
    assert merged == [Finding("warning", "ranks 0, 1: MPS is off"), Finding("error", "rank 1: no GPU")]


def test_the_cli_reports_this_machine_and_fails_without_a_gpu(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    import torch

    status = main(["--json"])
    output = json.loads(capsys.readouterr().out)
    assert output["report"]["cuda_archs"] and output["report"]["nccl_loaded"] == output["report"]["nccl_compiled"]
    if torch.cuda.is_available():
        assert status == (1 if any(f["level"] == "error" for f in output["findings"]) else 0)
    else:
        assert status == 1 and output["findings"][0]["level"] == "error"


def test_the_smoke_test_reports_a_pass_a_mismatch_and_a_failure(monkeypatch):
    import deep_ep.demo
    from deep_ep.doctor import smoke_test
    from deep_ep.errors import CommTimeoutError

    calls = []

    def passing(rank, num_ranks, group, num_experts, seed, *, low_latency, num_gpu_timeout_secs):
        calls.append((rank, num_ranks, num_experts, low_latency, num_gpu_timeout_secs))
        return {"rank": rank, "passed": {"ht_dispatch": True, "ht_combine": True}, "elapsed_ms": {}}

    monkeypatch.setattr(deep_ep.demo, "round_trip", passing)
    assert smoke_test(1, 3, None, low_latency=False, timeout=20.0) == Finding(
        "info", "round trip equals the reference model (ht_dispatch, ht_combine)"
    )
    assert calls == [(1, 3, 258, False, 20.0)]  # 256 experts rounded up to a multiple of 3 ranks

    def mismatching(*args, **kwargs):
        return {"rank": 0, "passed": {"ht_dispatch": True, "ll_combine": False}, "elapsed_ms": {}}

    monkeypatch.setattr(deep_ep.demo, "round_trip", mismatching)
    assert smoke_test(0, 2, None, low_latency=True, timeout=5.0) == Finding(
        "error", "round trip differs from the reference model in ll_combine"
    )

    def hanging(*args, **kwargs):
        raise CommTimeoutError("rank 0: dispatch timed out after 5 s in phase 'barrier arrival' waiting for rank 1")

    monkeypatch.setattr(deep_ep.demo, "round_trip", hanging)
    finding = smoke_test(0, 2, None, low_latency=True, timeout=5.0)
    assert finding.level == "error"
    assert finding.message.startswith("round trip failed: CommTimeoutError: rank 0: dispatch timed out")


def test_ranks_across_hosts_without_an_active_rdma_port_or_with_gin_disabled_are_errors():
    reports = _two_hosts(rdma_ports=[ACTIVE_IB_PORT])
    reports[2]["rdma_ports"] = [{**ACTIVE_IB_PORT, "state": "DOWN"}]
    reports[3]["rdma_ports"] = []
    errors = [finding.message for finding in check_group(reports) if finding.level == "error"]
    assert len(errors) == 1 and errors[0].startswith("ranks 2, 3 (hosts node1) have no active RDMA port")
    disabled = _two_hosts(rdma_ports=[ACTIVE_IB_PORT], env={"NCCL_IB_DISABLE": "1"})
    disabled[0]["env"] = {"NCCL_GIN_ENABLE": "0"}
    errors = [finding.message for finding in check_group(disabled) if finding.level == "error"]
    assert errors == [
        "NCCL_GIN_ENABLE=0 on ranks 0 disables GPU-initiated networking",
        "NCCL_IB_DISABLE=1 on ranks 1, 2, 3 disables NCCL's IB transport, which GIN runs over",
    ]
    # One host needs no RDMA port (the virtual nodes' lsa transport).
    one_host = [_report(num_gpus=4, device=rank) for rank in range(4)]
    assert not [finding for finding in check_group(one_host) if finding.level == "error"]


def test_rdma_ports_are_read_from_sysfs(tmp_path):
    from deep_ep.doctor import rdma_ports

    assert rdma_ports(str(tmp_path / "absent")) == []
    for device, port, state, layer in (
        ("mlx5_0", "1", "4: ACTIVE", "InfiniBand"),
        ("mlx5_1", "1", "1: DOWN", "Ethernet"),
    ):
        directory = tmp_path / device / "ports" / port
        directory.mkdir(parents=True)
        (directory / "state").write_text(state + "\n")
        (directory / "link_layer").write_text(layer + "\n")
    assert rdma_ports(str(tmp_path)) == [
        {"device": "mlx5_0", "port": "1", "state": "ACTIVE", "link_layer": "InfiniBand"},
        {"device": "mlx5_1", "port": "1", "state": "DOWN", "link_layer": "Ethernet"},
    ]
