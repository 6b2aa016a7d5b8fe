"""``deep_ep.utils.envs`` as DeepEP's test scripts import it: process-group setup for the ranks a
script spawns on one node (``init_dist``), seeds, a printing barrier, and the host probes DeepEP
keeps here (domain sizes, NVLink and RDMA bandwidth).

The one deliberate difference from DeepEP is in ``init_dist``: several ranks of a node may share a
GPU (e.g. eight ranks on one GPU under NVIDIA MPS). Then each rank takes GPU
``local_rank % torch.cuda.device_count()`` and the process group is ``gloo``, because NCCL refuses
two ranks on one GPU; this library works on gloo groups. With a GPU per rank the group is ``nccl``
as in DeepEP.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import re
import subprocess

import torch
import torch.distributed as dist

__all__ = [
    "check_fast_rdma_atomic_support",
    "check_torch_deterministic",
    "dist_print",
    "get_global_seed",
    "get_local_seed",
    "get_logical_domain_size",
    "get_nvlink_gbs",
    "get_physical_domain_size",
    "get_rdma_gbs",
    "init_dist",
    "init_seed",
    "process_group_backend",
]

_DEFAULT_NIC_NAME = os.getenv("EP_NIC_NAME", "mlx5_0")
_ENV_DEFAULTS = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "8361", "WORLD_SIZE": "1", "RANK": "0"}

_state = {"local_rank": None, "local_seed": 0, "global_seed": 0}


def init_seed(global_seed: int) -> None:
    """Seed ``torch`` and ``random`` with ``global_seed + rank`` (the rank in the default group,
    which must exist); ``get_global_seed`` returns ``global_seed`` afterwards."""
    local_seed = global_seed + dist.get_rank()
    _state["global_seed"] = global_seed
    _state["local_seed"] = local_seed
    torch.manual_seed(local_seed)
    random.seed(local_seed)


def get_local_seed() -> int:
    """The seed of this rank: the last ``init_seed`` argument plus the rank."""
    return _state["local_seed"]


def get_global_seed() -> int:
    """The last ``init_seed`` argument (0 before any call)."""
    return _state["global_seed"]


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Print ``s`` on every rank (or, with ``once_in_node``, on local rank 0 of each node only),
    then wait at a barrier of the default group. Needs ``init_dist`` first."""
    if _state["local_rank"] is None:
        raise RuntimeError("dist_print needs init_dist to have run in this process")
    if not once_in_node or _state["local_rank"] == 0:
        print(s, flush=True)
    dist.barrier()


def process_group_backend(num_local_ranks: int, num_gpus: int) -> str:
    """``nccl`` when every local rank has a GPU of its own, else ``gloo`` (ranks share GPUs, which
    NCCL refuses, or there is no GPU)."""
    return "nccl" if 0 < num_local_ranks <= num_gpus else "gloo"


def _visible_gpu_count() -> int:
    """GPUs this process may use, counted through NVML where torch can (no CUDA call yet, so the
    module-loading mode can still be chosen afterwards), else by the CUDA runtime."""
    if not torch.cuda.is_initialized():
        try:
            count = torch.cuda._device_count_nvml()
            if count >= 0:
                return count
        except Exception:  # noqa: BLE001 - fall back to the CUDA runtime's count
            pass
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _prepare_shared_gpu_process() -> None:
    """Environment for ranks sharing a GPU, set before CUDA starts in this process: every kernel
    module loaded eagerly (deep_ep.testing.rank_process explains the lazy-loading stall under MPS;
    ``EP_LAUNCH_MODULE_LOADING`` overrides the mode)."""
    from deep_ep.testing.rank_process import MODULE_LOADING_ENV, MODULE_LOADING_OVERRIDE_ENV

    if torch.cuda.is_initialized():
        return
    os.environ[MODULE_LOADING_ENV] = os.environ.get(MODULE_LOADING_OVERRIDE_ENV) or "EAGER"


def _gather_into_any_shape(all_gather_into_tensor):
    """``dist.all_gather_into_tensor`` accepting what NCCL accepts on gloo too: an output of
    ``world * input.numel()`` elements in any shape (DeepEP's scripts gather ``[T, K]`` into
    ``[R, T, K]``; gloo wants ``[R * T, K]``). The output is viewed that way, no copy."""

    @functools.wraps(all_gather_into_tensor)
    def gather(output_tensor, input_tensor, group=None, async_op=False):
        stacked = output_tensor
        if (
            input_tensor.dim() > 0
            and output_tensor.is_contiguous()
            and output_tensor.shape[1:] != input_tensor.shape[1:]
            and output_tensor.numel() % max(input_tensor[0].numel(), 1) == 0
        ):
            stacked = output_tensor.view(-1, *input_tensor.shape[1:])
        return all_gather_into_tensor(stacked, input_tensor, group=group, async_op=async_op)

    gather.deep_ep_shim = True
    return gather


def _allow_any_gather_shape_on_gloo() -> None:
    if not getattr(dist.all_gather_into_tensor, "deep_ep_shim", False):
        dist.all_gather_into_tensor = _gather_into_any_shape(dist.all_gather_into_tensor)


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> tuple[int, int, dist.ProcessGroup]:
    """Join the default process group as rank ``RANK * num_local_ranks + local_rank`` of
    ``WORLD_SIZE * num_local_ranks`` and return ``(rank, world_size, group)``.

    The environment is read as DeepEP reads it: ``MASTER_ADDR`` (default 127.0.0.1),
    ``MASTER_PORT`` (default 8361; the rendezvous is ``tcp://MASTER_ADDR:MASTER_PORT``),
    ``WORLD_SIZE`` = the number of **nodes** (default 1) and ``RANK`` = this node's index (default
    0). ``group`` is a new group of every rank; ``torch``'s default dtype becomes bfloat16, its
    default device CUDA, and the seeds are set by ``init_seed(seed)``.

    Differences from DeepEP, for nodes with fewer GPUs than ranks:

    - the rank's GPU is ``local_rank % torch.cuda.device_count()`` (DeepEP: ``local_rank``);
    - the backend is ``nccl`` when each local rank has a GPU of its own, else ``gloo`` (NCCL refuses
      two ranks on one GPU; this library's buffers work on gloo groups);
    - ranks sharing a GPU (run them under NVIDIA MPS) load every kernel module eagerly
      (``CUDA_MODULE_LOADING=EAGER`` when CUDA has not started yet in the process), bound torch's
      caching allocator to their share of the GPU and warm up cuBLAS before returning, as
      ``deep_ep.testing.launch`` does for its ranks;
    - on gloo, ``dist.all_gather_into_tensor`` takes an output of any shape with the right number
      of elements, as NCCL does (the scripts gather ``[T, K]`` rows into ``[R, T, K]``);
    - every rank uses ``cpu_count / num_local_ranks`` intra-op threads;
    - without any GPU the group is gloo and the default device stays the CPU.

    NVLink multicast is left off (``NCCL_NVLS_ENABLE=0`` and the like, unless already set).
    """
    from deep_ep.testing.rank_process import SAFE_ENV, cap_cached_memory
    from deep_ep.testing.warm_up import warm_up_cuda_libraries

    ip = os.getenv("MASTER_ADDR", _ENV_DEFAULTS["MASTER_ADDR"])
    port = int(os.getenv("MASTER_PORT", _ENV_DEFAULTS["MASTER_PORT"]))
    num_nodes = int(os.getenv("WORLD_SIZE", _ENV_DEFAULTS["WORLD_SIZE"]))
    node_rank = int(os.getenv("RANK", _ENV_DEFAULTS["RANK"]))
    if not 0 <= local_rank < num_local_ranks:
        raise ValueError(f"local_rank must be in [0, {num_local_ranks}), got {local_rank}")
    _state["local_rank"] = local_rank
    for name, value in SAFE_ENV.items():
        os.environ.setdefault(name, value)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_local_ranks))

    num_gpus = _visible_gpu_count()
    backend = process_group_backend(num_local_ranks, num_gpus)
    shares_gpu = 0 < num_gpus < num_local_ranks
    if shares_gpu:
        _prepare_shared_gpu_process()
    device = local_rank % num_gpus if num_gpus > 0 else None
    if device is not None:
        torch.cuda.set_device(device)
        if shares_gpu:
            cap_cached_memory(num_local_ranks, num_gpus, device)

    params = {
        "backend": backend,
        "init_method": f"tcp://{ip}:{port}",
        "world_size": num_nodes * num_local_ranks,
        "rank": node_rank * num_local_ranks + local_rank,
    }
    if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
        params["device_id"] = torch.device("cuda", device)
    dist.init_process_group(**params)
    if backend == "gloo":
        _allow_any_gather_shape_on_gloo()

    torch.set_default_dtype(torch.bfloat16)
    if device is not None:
        torch.set_default_device("cuda")
        if shares_gpu:
            # Before any peer can spin on this rank (deep_ep/testing/warm_up.py); the scripts call
            # init_dist inside torch.inference_mode, where the warm-up's backward needs grad mode.
            with torch.inference_mode(False), torch.enable_grad():
                warm_up_cuda_libraries(torch.device("cuda", device))

    init_seed(seed)
    world_size = dist.get_world_size()
    return dist.get_rank(), world_size, dist.new_group(list(range(world_size)))


def get_physical_domain_size(group: dist.ProcessGroup) -> tuple[int, int]:
    """``(nodes, ranks per node)`` of ``group``: ``deep_ep.get_physical_domain_size`` (collective)."""
    from deep_ep import domains

    return domains.get_physical_domain_size(group)


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True) -> tuple[int, int]:
    """``(scale-out ranks, scale-up ranks)`` a buffer on ``group`` would use:
    ``deep_ep.get_logical_domain_size`` (collective)."""
    from deep_ep import domains

    return domains.get_logical_domain_size(group, allow_hybrid_mode)


def check_torch_deterministic() -> None:
    """Raise ``AssertionError`` when torch's deterministic algorithms and its filling of
    uninitialised memory are both on (``torch.empty`` then launches a fill kernel, which may overlap
    the communication stream)."""
    import torch.utils.deterministic

    both = torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
    assert not both, "disable torch.utils.deterministic.fill_uninitialized_memory with deterministic algorithms"


def _command_output(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def parse_nvlink_gbs(nvlink_status: str) -> float:
    """Sum of the link speeds (GB/s) of the first GPU in ``nvidia-smi nvlink -s`` output; 0 when
    it lists none."""
    blocks = re.split(r"^(?=GPU \d+:)", nvlink_status, flags=re.MULTILINE)
    first = next((block for block in blocks if block.startswith("GPU ")), "")
    return sum(float(speed) for speed in re.findall(r"Link \d+:\s*([\d.]+) GB/s", first))


def parse_ibstat_ca(ibstat: str, nic_name: str) -> tuple[str | None, int | None]:
    """``(CA type, rate in Gb/s of its first port)`` of ``nic_name`` in ``ibstat`` output, None for
    what it does not list."""
    blocks = re.split(r"^(?=CA ')", ibstat, flags=re.MULTILINE)
    block = next((b for b in blocks if b.startswith(f"CA '{nic_name}'")), None)
    if block is None:
        return None, None
    ca_type = re.search(r"CA type:\s*(\S+)", block)
    rate = re.search(r"Rate:\s*(\d+)", block)
    return (ca_type.group(1) if ca_type else None), (int(rate.group(1)) if rate else None)


@functools.lru_cache
def get_nvlink_gbs(factor: float = 0.9) -> float:
    """Total NVLink bandwidth of GPU 0 in GB/s (``nvidia-smi nvlink -s``) times ``factor``; 0 (with a
    message) when it cannot be read. Cached."""
    try:
        total = parse_nvlink_gbs(_command_output(["nvidia-smi", "nvlink", "-s"]))
        if total <= 0:
            raise ValueError("no NVLink listed")
        return total * factor
    except Exception as error:  # noqa: BLE001 - a probe: report and return 0
        print(f"Failed to get NVLink connection speed: {error}")
        return 0


@functools.lru_cache
def check_fast_rdma_atomic_support(nic_name: str = _DEFAULT_NIC_NAME) -> bool:
    """Whether ``ibstat`` lists ``nic_name`` as an MT4131 adapter (fast RDMA atomics). Cached."""
    try:
        ca_type, _ = parse_ibstat_ca(_command_output(["ibstat"]), nic_name)
    except Exception:  # noqa: BLE001 - no ibstat: no fast atomics
        return False
    return ca_type == "MT4131"


@functools.lru_cache
def get_rdma_gbs(nic_name: str = _DEFAULT_NIC_NAME) -> float:
    """RDMA bandwidth of ``nic_name`` in GB/s (its ``ibstat`` rate / 8); 0 (with a message) when it
    cannot be read. Cached."""
    try:
        _, rate = parse_ibstat_ca(_command_output(["ibstat"]), nic_name)
        if rate is None:
            raise ValueError(f"no rate listed for {nic_name}")
        return rate / 8
    except Exception as error:  # noqa: BLE001 - a probe: report and return 0
        print(f"Failed to get RDMA connection speed: {error}")
        return 0
