"""deep_ep.doctor on a GPU machine: this machine checks clean, and under torchrun every rank agrees
and the group's checked round trip (--smoke) equals the reference model.

Both run the module as a user would (a subprocess: ``python -m deep_ep.doctor``, ``torchrun ... -m
deep_ep.doctor``). Ranks beyond the GPUs share them, as in the rest of the suite, so the torchrun
ranks get CUDA_MODULE_LOADING=EAGER (the launcher's setting) and need MPS running.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

SMOKE_TIMEOUT_SECS = 20
PROCESS_TIMEOUT_SECS = 300


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=PROCESS_TIMEOUT_SECS)


def test_this_machine_has_no_error_finding():
    done = _run([sys.executable, "-m", "deep_ep.doctor", "--json"], dict(os.environ))
    assert done.returncode == 0, done.stdout + done.stderr
    output = json.loads(done.stdout)
    report = output["report"]
    assert len(report["gpus"]) == torch.cuda.device_count()
    assert all(gpu["capability"] in report["cuda_archs"] for gpu in report["gpus"]), report
    assert report["nccl_loaded"] == report["nccl_compiled"]
    assert not [finding for finding in output["findings"] if finding["level"] == "error"], output["findings"]


def test_the_group_agrees_and_its_round_trip_equals_the_reference(num_ranks):
    env = dict(os.environ)
    if num_ranks > torch.cuda.device_count():
        env["CUDA_MODULE_LOADING"] = "EAGER"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={num_ranks}",
        "-m",
        "deep_ep.doctor",
        "--smoke",
        f"--timeout={SMOKE_TIMEOUT_SECS}",
        "--json",
    ]
    done = _run(command, env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, done.stdout + done.stderr  # rank 0 prints one JSON object
    findings = json.loads(lines[0])["findings"]
    assert done.returncode == 0, findings
    messages = [finding["message"] for finding in findings]
    everyone = ", ".join(str(rank) for rank in range(num_ranks))
    smoke = [message for message in messages if "round trip equals the reference model" in message]
    assert smoke and smoke[0].startswith(f"rank{'s' if num_ranks > 1 else ''} {everyone}:"), messages
    assert any(message.startswith(f"{num_ranks} ranks on 1 host(s)") for message in messages), messages
