"""deep_ep.utils.{envs,testing,gate,refs,math}: the names and signatures DeepEP's test scripts import,
init_dist's backend and device choice, the gate and reference semantics on small CPU tensors
(refs.dispatch across two gloo processes started by init_dist), bench on the host, and
scripts/run_deepep_tests.sh against stand-in scripts."""

from __future__ import annotations

import inspect
import json
import math as pymath
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deep_ep.testing.reference_ht import ht_dispatch
from deep_ep.testing.reference_v2 import v2_combine
from deep_ep.utils import envs, gate, refs, testing
from deep_ep.utils import math as ep_math

REPO = Path(__file__).resolve().parents[2]

# What DeepEP's test scripts (tests/legacy/test_{intranode,internode,low_latency}.py,
# tests/elastic/test_{ep,barrier}.py, tests/utils/test_gate.py) import from deep_ep.utils.
IMPORTED_NAMES = {
    envs: ("init_dist", "init_seed", "dist_print"),
    testing: ("bench", "bench_kineto"),
    gate: ("get_unbalanced_scores",),
    refs: ("dispatch", "combine", "generate_pre_combine_data", "ordered_accumulate"),
    ep_math: (
        "align",
        "calc_diff",
        "ceil_div",
        "count_bytes",
        "create_grouped_scores",
        "hash_tensor",
        "inplace_unique",
        "per_token_cast_back",
        "per_token_cast_to_fp8",
        "safe_div",
    ),
}

_ = inspect.Parameter.empty
# DeepEP's positional parameters and defaults; ours may add keyword-only ones after them.
SIGNATURES = {
    envs.init_dist: [("local_rank", _), ("num_local_ranks", _), ("seed", 0)],
    envs.init_seed: [("global_seed", _)],
    envs.dist_print: [("s", ""), ("once_in_node", False)],
    testing.bench: [("fn", _), ("num_warmups", 50), ("num_tests", 50), ("post_fn", None), ("flush_l2", True)],
    testing.bench_kineto: [
        ("fn", _),
        ("kernel_names", _),
        ("num_tests", 30),
        ("suppress_kineto_output", False),
        ("trace_path", None),
        ("flush_l2", True),
        ("barrier_comm_profiling", False),
        ("num_kernels_per_period", 1),
        ("barrier", None),
    ],
    gate.get_unbalanced_scores: [
        ("num_tokens", _),
        ("num_experts", _),
        ("num_ranks", _),
        ("num_topk", _),
        ("ratio", _),
        ("precise", _),
    ],
    refs.dispatch: [
        ("x", _),
        ("topk_idx", _),
        ("topk_weights", _),
        ("num_max_tokens_per_rank", _),
        ("num_experts", _),
    ],
    refs.combine: [
        ("y", _),
        ("topk_idx", _),
        ("num_scaleout_ranks", _),
        ("num_scaleup_ranks", _),
        ("num_experts", _),
        ("bias", _),
        ("reduce_in_local", _),
        ("reduce_in_scaleup", _),
    ],
    refs.generate_pre_combine_data: [
        ("src_token_global_idx", _),
        ("num_max_tokens_per_rank", _),
        ("num_topk", _),
        ("hidden", _),
    ],
    refs.ordered_accumulate: [("data", _), ("initial_value", None)],
}


def test_every_name_deepeps_scripts_import_exists():
    missing = [
        f"{module.__name__}.{name}"
        for module, names in IMPORTED_NAMES.items()
        for name in names
        if not hasattr(module, name)
    ]
    assert not missing


@pytest.mark.parametrize("function", list(SIGNATURES), ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_signature_matches_deepep(function):
    parameters = list(inspect.signature(function).parameters.values())
    positional = [p for p in parameters if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert [(p.name, p.default) for p in positional] == SIGNATURES[function]
    extra = [p for p in parameters if p.kind != inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert all(p.kind == inspect.Parameter.KEYWORD_ONLY and p.default is not _ for p in extra)


# ---- init_dist: backend and device choice (mocked GPUs) ----


class _Stop(Exception):
    pass


def _init_dist_choices(monkeypatch, num_gpus: int, local_rank: int, num_local_ranks: int) -> dict:
    """What init_dist asks of torch with ``num_gpus`` GPUs, up to the process group's creation."""
    import torch.distributed as dist

    import deep_ep.testing.rank_process as rank_process

    seen: dict = {"set_device": [], "cap": []}
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "4567")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    monkeypatch.delenv("EP_LAUNCH_MODULE_LOADING", raising=False)
    monkeypatch.setattr(envs, "_visible_gpu_count", lambda: num_gpus)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen["set_device"].append(device))
    monkeypatch.setattr(rank_process, "cap_cached_memory", lambda *args: seen["cap"].append(args))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.setdefault("threads", n))

    def fake_init_process_group(**params):
        seen["params"] = params
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", fake_init_process_group)
    with pytest.raises(_Stop):
        envs.init_dist(local_rank, num_local_ranks)
    seen["module_loading"] = os.environ.get("CUDA_MODULE_LOADING")
    return seen


def test_init_dist_ranks_sharing_one_gpu_use_gloo_and_gpu_zero(monkeypatch):
    seen = _init_dist_choices(monkeypatch, num_gpus=1, local_rank=3, num_local_ranks=4)
    assert seen["params"] == {"backend": "gloo", "init_method": "tcp://10.1.2.3:4567", "world_size": 8, "rank": 7}
    assert seen["set_device"] == [0]
    assert seen["cap"] == [(4, 1, 0)]  # the caching allocator bounded to the rank's share
    assert seen["module_loading"] == "EAGER"
    assert seen["threads"] == max(1, (os.cpu_count() or 1) // 4)


def test_init_dist_ranks_over_two_gpus_map_round_robin(monkeypatch):
    seen = _init_dist_choices(monkeypatch, num_gpus=2, local_rank=3, num_local_ranks=4)
    assert seen["params"]["backend"] == "gloo"
    assert seen["set_device"] == [1]


def test_init_dist_gpu_per_rank_uses_nccl_with_device_id(monkeypatch):
    seen = _init_dist_choices(monkeypatch, num_gpus=8, local_rank=3, num_local_ranks=8)
    params = seen["params"]
    assert params["backend"] == "nccl"
    assert (params["world_size"], params["rank"]) == (16, 11)
    if "device_id" in inspect.signature(torch.distributed.init_process_group).parameters:
        assert params["device_id"] == torch.device("cuda", 3)
    assert seen["set_device"] == [3]
    assert seen["cap"] == []
    assert seen["module_loading"] is None


def test_process_group_backend():
    assert envs.process_group_backend(8, 8) == "nccl"
    assert envs.process_group_backend(4, 8) == "nccl"
    assert envs.process_group_backend(8, 1) == "gloo"
    assert envs.process_group_backend(1, 0) == "gloo"


def test_init_dist_rejects_a_local_rank_out_of_range():
    with pytest.raises(ValueError, match="local_rank"):
        envs.init_dist(4, 4)


# ---- init_dist for real (gloo on the CPU) and refs.dispatch across two processes ----

HIDDEN = 256
NUM_TOPK = 3
NUM_EXPERTS = 8
MAX_TOKENS = 12


def _rank_inputs(rank: int, fp8: bool):
    """Rank ``rank``'s dispatch inputs, the same wherever they are built."""
    generator = torch.Generator().manual_seed(100 + rank)
    num_tokens = MAX_TOKENS - 3 * rank
    # Explicit dtypes: init_dist makes bfloat16 the default.
    scores = torch.rand(num_tokens, NUM_EXPERTS, generator=generator, dtype=torch.float32)
    topk_idx = scores.topk(NUM_TOPK, dim=1).indices
    topk_idx[torch.rand(num_tokens, NUM_TOPK, generator=generator, dtype=torch.float32) < 0.2] = -1
    weights = torch.rand(num_tokens, NUM_TOPK, generator=generator, dtype=torch.float32)
    x = torch.randn(num_tokens, HIDDEN, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    if fp8:
        x = ep_math.per_token_cast_to_fp8(x)
    return x, topk_idx, weights


def _dist_worker(local_rank: int, num_local_ranks: int, queue) -> None:
    import torch.distributed as dist

    result: dict = {}
    try:
        rank, num_ranks, group = envs.init_dist(local_rank, num_local_ranks, seed=5)
        result["init"] = (rank, num_ranks, group.size(), dist.get_backend(), torch.get_default_dtype())
        result["seeds"] = (envs.get_global_seed(), envs.get_local_seed())
        envs.dist_print(f"rank {rank} ready", once_in_node=True)
        for fp8 in (False, True):
            x, topk_idx, weights = _rank_inputs(rank, fp8)
            got = refs.dispatch(x, topk_idx, weights, MAX_TOKENS, NUM_EXPERTS)
            expected = ht_dispatch(
                [_rank_inputs(r, fp8)[0] for r in range(num_ranks)],
                [_rank_inputs(r, fp8)[1] for r in range(num_ranks)],
                [_rank_inputs(r, fp8)[2] for r in range(num_ranks)],
                NUM_EXPERTS,
            )[rank]
            recv_x, recv_topk_idx, recv_weights, recv_src, counts = got
            data = recv_x[0].view(torch.uint8) if fp8 else recv_x
            checks = {
                "x": torch.equal(data, expected["x"].view(torch.uint8) if fp8 else expected["x"]),
                "scales": (not fp8) or torch.equal(recv_x[1], expected["x_scales"]),
                "topk_idx": torch.equal(recv_topk_idx, expected["topk_idx"]),
                "weights": torch.equal(recv_weights, expected["topk_weights"]),
                "src": torch.equal(recv_src, (expected["src_rank"] * MAX_TOKENS + expected["src_token"]).int()),
                "counts": counts.tolist() == expected["num_recv_tokens_per_rank"],
                "dtypes": (recv_src.dtype, counts.dtype) == (torch.int32, torch.int32),
            }
            result[f"dispatch_fp8={fp8}"] = checks
        # Same token, same synthetic outputs on every rank: all-gather rank 0's token 1 row.
        row = refs.generate_pre_combine_data(torch.tensor([1]), MAX_TOKENS, NUM_TOPK, 16)
        rows = [torch.empty_like(row) for _ in range(num_ranks)]
        dist.all_gather(rows, row)
        result["same_data"] = all(torch.equal(rows[0], other) for other in rows)
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        result["error"] = repr(error)
    queue.put((local_rank, result))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_init_dist_and_refs_dispatch_over_two_gloo_ranks(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the children see no GPU: gloo on the CPU
    context = torch.multiprocessing.get_context("spawn")
    queue = context.SimpleQueue()
    torch.multiprocessing.spawn(_dist_worker, args=(2, queue), nprocs=2)
    results = dict(queue.get() for _ in range(2))
    for rank in range(2):
        result = results[rank]
        assert "error" not in result, result["error"]
        assert result["init"] == (rank, 2, 2, "gloo", torch.bfloat16)
        assert result["seeds"] == (5, 5 + rank)
        for fp8 in (False, True):
            assert all(result[f"dispatch_fp8={fp8}"].values()), result[f"dispatch_fp8={fp8}"]
        assert result["same_data"]


# ---- refs on one process ----


def test_ordered_accumulate_adds_lanes_in_order_in_fp32():
    big = 2.0**24
    data = torch.tensor([[[big], [1.0], [-big]]], dtype=torch.bfloat16)
    # fp32: (2^24 + 1) rounds to 2^24, so the lane order leaves 0; any other order could leave 1.
    assert refs.ordered_accumulate(data).item() == 0.0
    assert refs.ordered_accumulate(data[:, [0, 2, 1]]).item() == 1.0
    # The initial value comes first: 0.5 is absorbed by 2^24 before the big lanes cancel.
    initial = torch.tensor([[0.5]], dtype=torch.float32)
    assert refs.ordered_accumulate(data[:, [0, 2, 1]], initial).item() == 1.0
    small = torch.tensor([[[1.0], [2.0], [4.0]]], dtype=torch.bfloat16)
    assert refs.ordered_accumulate(small, initial).item() == 7.5
    assert refs.ordered_accumulate(data).dtype == torch.bfloat16


def _grouped_reduce_loops(y: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Per token, each group's lanes summed in fp32 in lane order onto the group's last lane."""
    out = torch.zeros_like(y)
    for t in range(y.shape[0]):
        ids = group[t].tolist()
        for k, gid in enumerate(ids):
            if gid in ids[k + 1 :]:
                continue
            total = torch.zeros(y.shape[2], dtype=torch.float32)
            for j in range(k + 1):
                if ids[j] == gid:
                    total = total + y[t, j].float()
            out[t, k] = total.to(y.dtype)
    return out


def _combine_inputs(seed: int = 3, num_tokens: int = 6, num_topk: int = 5, hidden: int = 8, num_experts: int = 16):
    generator = torch.Generator().manual_seed(seed)
    topk_idx = torch.stack([torch.randperm(num_experts, generator=generator)[:num_topk] for _ in range(num_tokens)])
    topk_idx[0, 1] = -1
    exponents = torch.randint(-10, 20, (num_tokens, num_topk, hidden), generator=generator).float()
    y = (torch.randn(num_tokens, num_topk, hidden, generator=generator).sign() * 2.0**exponents).to(torch.bfloat16)
    y[topk_idx == -1] = 0
    bias = torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16)
    return y, topk_idx, bias, num_experts


@pytest.mark.parametrize("recipe", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("domains", [(1, 4), (2, 2), (4, 1)])
def test_combine_is_v2_grouped_order(recipe, domains):
    y, topk_idx, bias, num_experts = _combine_inputs()
    num_scaleout, num_scaleup = domains
    num_local = num_experts // (num_scaleout * num_scaleup)
    expected = y
    if recipe[0]:
        expected = _grouped_reduce_loops(expected, torch.div(topk_idx, num_local, rounding_mode="floor"))
    if recipe[1]:
        expected = _grouped_reduce_loops(expected, torch.div(topk_idx, num_local * num_scaleup, rounding_mode="floor"))
    for b in (None, bias, (bias, bias * 2)):
        initial = None if b is None else (b[0].float() + b[1].float() if isinstance(b, tuple) else b.float())
        got = refs.combine(y, topk_idx, num_scaleout, num_scaleup, num_experts, b, *recipe)
        assert torch.equal(got, refs.ordered_accumulate(expected, initial))


def test_combine_matches_reference_v2():
    y, topk_idx, bias, num_experts = _combine_inputs(seed=8)
    direct = refs.combine(y, topk_idx, 1, 4, num_experts, bias, True, False)
    assert torch.equal(direct, v2_combine(y, topk_idx, num_experts, 4, bias=bias))
    hybrid = refs.combine(y, topk_idx, 2, 2, num_experts, bias, True, True)
    assert torch.equal(hybrid, v2_combine(y, topk_idx, num_experts, 4, num_ranks_per_node=2, bias=bias))


def test_combine_rejects_scaleup_without_local_reduction():
    y, topk_idx, bias, num_experts = _combine_inputs()
    with pytest.raises(ValueError):
        refs.combine(y, topk_idx, 1, 4, num_experts, bias, False, True)


def test_generate_pre_combine_data_formula(monkeypatch):
    monkeypatch.setitem(envs._state, "global_seed", 7)
    ids = torch.tensor([0, 5, 13], dtype=torch.int32)
    data = refs.generate_pre_combine_data(ids, 10, 3, 4, num_ranks=2)
    assert data.shape == (3, 3, 4) and data.dtype == torch.bfloat16
    max_seed = 2 * 10 * 3
    for i, g in enumerate(ids.tolist()):
        for j in range(3):
            frequency = ((g * 3 + j) * 131071 % max_seed + 1) / max_seed
            for k in range(4):
                expected = pymath.sin(frequency * (k + 1) + pymath.sin(7.0))
                assert abs(data[i, j, k].item() - expected) <= 1e-2 * max(1.0, abs(expected))


# ---- gate ----


def _reached_counts(scores: torch.Tensor, num_ranks: int, num_topk: int) -> torch.Tensor:
    topk_idx = scores.topk(num_topk, dim=1).indices // (scores.shape[1] // num_ranks)
    reached = torch.zeros(scores.shape[0], num_ranks, dtype=torch.bool).scatter_(1, topk_idx, True)
    return reached.sum(dim=0).float()


@pytest.mark.parametrize(
    ("num_ranks", "num_experts_per_rank", "num_topk", "ratio"),
    [(8, 8, 8, 1.0), (8, 8, 8, 2.0), (16, 4, 6, 4.0), (2, 4, 4, 1.0)],
)
def test_precise_unbalanced_scores_meet_the_ratio(num_ranks, num_experts_per_rank, num_topk, ratio):
    torch.manual_seed(0)
    num_experts = num_ranks * num_experts_per_rank
    total = torch.zeros(num_ranks)
    for _ in range(4):
        scores = gate.get_unbalanced_scores(4096, num_experts, num_ranks, num_topk, ratio, True, device="cpu")
        assert scores.shape == (4096, num_experts) and scores.dtype == torch.float32
        values = scores.topk(num_topk + 1, dim=1).values
        assert (values[:, :num_topk] > 0.9).all() and (values[:, num_topk] < 0.9).all()
        total += _reached_counts(scores, num_ranks, num_topk)
    others = total[1:]
    assert abs(total[0].item() / others.min().item() - ratio) / ratio < 0.1
    assert others.max().item() / others.min().item() < 1.02


def test_random_unbalanced_scores_approach_the_ratio():
    torch.manual_seed(1)
    scores = gate.get_unbalanced_scores(4096, 64, 8, 6, 3.0, False, device="cpu")
    counts = _reached_counts(scores, 8, 6)
    assert abs(counts[0].item() / counts[1:].mean().item() - 3.0) < 0.45
    balanced = gate.get_unbalanced_scores(64, 64, 8, 6, 1.0, False, device="cpu")
    assert balanced.min() >= 0 and balanced.max() < 1


def test_gate_edge_sizes():
    assert gate.get_unbalanced_scores(1, 16, 4, 2, 2.0, True, device="cpu").shape == (1, 16)
    assert gate.get_unbalanced_scores(0, 16, 4, 2, 2.0, True, device="cpu").shape == (0, 16)
    one_rank = gate.get_unbalanced_scores(8, 4, 1, 2, 1.0, True, device="cpu")
    assert (one_rank.topk(2, dim=1).values > 0.9).all()
    with pytest.raises(ValueError, match="ratio"):
        gate.get_unbalanced_scores(8, 16, 4, 2, 0.5, True, device="cpu")


# ---- testing ----


def test_bench_times_a_host_callable_without_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = {"fn": 0, "post": 0}

    def fn():
        calls["fn"] += 1

    def post():
        calls["post"] += 1

    average, minimum, maximum = testing.bench(fn, num_warmups=3, num_tests=5, post_fn=post)
    assert calls == {"fn": 8, "post": 5}
    assert 0 <= minimum <= average <= maximum
    with pytest.raises(ValueError):
        testing.bench(fn, num_tests=1)


def test_bench_kineto_under_nvidia_tools_measures_nothing(monkeypatch):
    monkeypatch.setenv("EP_USE_NVIDIA_TOOLS", "1")

    def never():
        raise AssertionError("not called")

    assert testing.bench_kineto(never, "dispatch") == 1
    assert testing.bench_kineto(never, ("dispatch", "combine")) == (1, 1)
    with pytest.raises(TypeError):
        testing.bench_kineto(never, ["dispatch"])


TABLE = """\
-------------------------------------------------------  ------------  ------------  ------------
                                                   Name    Self CUDA   CUDA total  CUDA time avg    # of Calls
-------------------------------------------------------  ------------  ------------  ------------
void deep_ep::(anonymous namespace)::ll_dispatch_kernel<...      1.200ms       1.200ms      40.000us            30
void deep_ep::(anonymous namespace)::ll_combine_kernel<...      900.000us     900.000us      30.000us            30
void deep_ep::(anonymous namespace)::notify_kernel(...)         2.000s        2.000s       1.000s             2
-------------------------------------------------------  ------------  ------------  ------------"""


def test_kernel_durations_from_table():
    lines = TABLE.split("\n")
    durations = testing.kernel_durations_from_table(lines, ("dispatch", "combine", "notify", "barrier"))
    assert durations == pytest.approx([40e-6, 30e-6, 1.0, 0])
    with pytest.raises(AssertionError, match="kernel"):
        testing.kernel_durations_from_table(lines, ("kernel",))


def test_durations_per_period_from_trace():
    events = [{"cat": "cuda_runtime", "name": "cudaLaunchKernel ll_dispatch_kernel", "ts": 0, "dur": 99}]
    for period in range(3):
        events.append({"cat": "kernel", "name": "void ll_dispatch_kernel<1>", "ts": 10 * period, "dur": 2.0})
        events.append({"cat": "kernel", "name": "void ll_dispatch_kernel<1>", "ts": 10 * period + 5, "dur": 4.0})
    durations = testing._durations_per_period({"traceEvents": events}, "dispatch", 2)
    assert durations == pytest.approx([2e-6, 4e-6])
    with pytest.raises(AssertionError):
        testing._durations_per_period({"traceEvents": events[:2]}, "dispatch", 2)


def test_suppress_stdout_stderr_silences_file_descriptors(capfd):
    with testing.suppress_stdout_stderr():
        print("hidden")
        os.write(1, b"hidden fd\n")
        os.write(2, b"hidden err\n")
    print("shown")
    out, err = capfd.readouterr()
    assert out == "shown\n" and err == ""


# ---- envs probes ----


def test_probe_parsers():
    nvlink = "GPU 0: H100 (UUID: x)\n\t Link 0: 26.562 GB/s\n\t Link 1: 26.562 GB/s\nGPU 1: H100\n\t Link 0: 1 GB/s\n"
    assert envs.parse_nvlink_gbs(nvlink) == pytest.approx(53.124)
    ibstat = "CA 'mlx5_0'\n\tCA type: MT4129\n\tPort 1:\n\t\tRate: 400\nCA 'mlx5_1'\n\tCA type: MT4131\n\t\tRate: 800\n"
    assert envs.parse_ibstat_ca(ibstat, "mlx5_0") == ("MT4129", 400)
    assert envs.parse_ibstat_ca(ibstat, "mlx5_1") == ("MT4131", 800)
    assert envs.parse_ibstat_ca(ibstat, "mlx5_9") == (None, None)


def test_dist_print_needs_init_dist(monkeypatch):
    monkeypatch.setitem(envs._state, "local_rank", None)
    with pytest.raises(RuntimeError, match="init_dist"):
        envs.dist_print("x")


# ---- scripts/run_deepep_tests.sh with stand-in scripts ----

_STAND_IN = """\
import json, os, sys
print("ARGS " + json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in
      ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "EP_EMULATE_RANKS_PER_NODE", "CUDA_MODULE_LOADING")}}))
sys.exit(int(os.environ.get("STAND_IN_RC_" + os.path.basename(sys.argv[0]).removesuffix(".py"), "0")))
"""


def _stand_in_args(log: Path) -> list[dict]:
    return [json.loads(line[5:]) for line in log.read_text().splitlines() if line.startswith("ARGS ")]


def test_run_deepep_tests_script(tmp_path):
    tests_dir = tmp_path / "tests"
    for script in (
        "legacy/test_intranode.py",
        "legacy/test_internode.py",
        "legacy/test_low_latency.py",
        "elastic/test_ep.py",
        "elastic/test_barrier.py",
    ):
        (tests_dir / script).parent.mkdir(parents=True, exist_ok=True)
        (tests_dir / script).write_text(_STAND_IN)
    logs = tmp_path / "logs"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "EP_DEEPEP_RANKS": "4",
        "EP_DEEPEP_TIMEOUT": "120",
        "STAND_IN_RC_test_barrier": "3",
    }
    env.pop("EP_EMULATE_RANKS_PER_NODE", None)
    run = subprocess.run(
        ["bash", str(REPO / "scripts/run_deepep_tests.sh"), str(tests_dir), str(logs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    summary = (logs / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == [
        "intranode",
        "low_latency",
        "ep",
        "ep_hybrid",
        "ep_perf",
        "barrier",
        "internode",
    ]
    assert [line.split(",")[0].split("rc=")[1] for line in summary] == ["0", "0", "0", "0", "0", "3", "0"]

    intranode = _stand_in_args(logs / "intranode.log")[0]
    assert intranode["argv"][:2] == ["--num-processes", "4"]
    assert intranode["env"] | {"MASTER_PORT": None} == {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": None,
        "WORLD_SIZE": "1",
        "RANK": "0",
        "EP_EMULATE_RANKS_PER_NODE": None,
        "CUDA_MODULE_LOADING": "EAGER",
    }
    assert "--skip-perf-test" in _stand_in_args(logs / "ep.log")[0]["argv"]
    assert _stand_in_args(logs / "ep_hybrid.log")[0]["env"]["EP_EMULATE_RANKS_PER_NODE"] == "2"
    assert "--test-first-only" in _stand_in_args(logs / "ep_perf.log")[0]["argv"]
    nodes = _stand_in_args(logs / "internode.log")
    assert sorted(node["env"]["RANK"] for node in nodes) == ["0", "1"]
    assert {node["env"]["WORLD_SIZE"] for node in nodes} == {"2"}
    assert {node["env"]["EP_EMULATE_RANKS_PER_NODE"] for node in nodes} == {"8"}
    assert len({node["env"]["MASTER_PORT"] for node in nodes}) == 1
    assert all(node["argv"][:2] == ["--num-processes", "8"] for node in nodes)


def test_gather_shim_views_a_stacked_output_as_gloo_wants_it():
    from deep_ep.utils.envs import _gather_into_any_shape

    seen = []

    def fake_all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        seen.append(tuple(output_tensor.shape))
        output_tensor.copy_(input_tensor.repeat(output_tensor.shape[0] // input_tensor.shape[0], 1))

    gather = _gather_into_any_shape(fake_all_gather_into_tensor)
    stacked = torch.empty(3, 4, 2)
    gather(stacked, torch.ones(4, 2))
    assert seen == [(12, 2)] and torch.equal(stacked, torch.ones(3, 4, 2))
    flat = torch.empty(12, 2)
    gather(flat, torch.ones(4, 2))
    assert seen[-1] == (12, 2)
    assert gather.deep_ep_shim


def test_kineto_table_lines_reads_the_table_bench_kineto_reads():
    seen = {}

    class Averages:
        def table(self, **kwargs):
            seen.update(kwargs)
            return "header\nrow dispatch\nrow combine"

    class Profiler:
        def key_averages(self):
            return Averages()

    assert testing.kineto_table_lines(Profiler()) == ["header", "row dispatch", "row combine"]
    assert seen == {"sort_by": "cuda_time_total", "max_name_column_width": 100}
