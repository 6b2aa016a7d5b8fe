"""Validation and routing rules shared by the high-throughput and low-latency reference models.

Bad expert ids are not refused: the library reports them as errors but still defines its outputs
by a sanitised routing (``sanitize_topk_idx``), and the reference models that same routing so the
GPU kernels can be judged on such inputs too.
"""

from dataclasses import dataclass

import torch

from deep_ep._util import describe
from deep_ep.fp8 import FP8_GROUP_SIZE

TokenInput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def as_bytes_if_fp8(payload: torch.Tensor) -> torch.Tensor:
    """fp8 rows are gathered and scattered as bytes: not every device's indexing kernels cover float8."""
    return payload.view(torch.uint8) if payload.dtype == torch.float8_e4m3fn else payload


def num_local_experts(num_experts: int, num_ranks: int) -> int:
    if num_ranks < 1:
        raise ValueError(f"the group must have at least one rank, got {num_ranks}")
    if num_experts < 1 or num_experts % num_ranks != 0:
        raise ValueError(f"num_experts must be a positive multiple of the {num_ranks} ranks, got {num_experts}")
    return num_experts // num_ranks


def check_topk_idx(name: str, topk_idx: torch.Tensor, num_tokens: int) -> None:
    if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        raise ValueError(f"{name} must be int64 [{num_tokens}, K], got {describe(topk_idx)}")


def sanitize_topk_idx(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The routing the library acts on: a copy of ``topk_idx`` (int64, same shape) in which an id
    outside ``[-1, num_experts)``, and an id already selected at an earlier slot of the same row,
    are -1. Only the first occurrence of an expert in a row counts; the library still reports
    both kinds of entry as errors."""
    if not isinstance(topk_idx, torch.Tensor):
        raise TypeError(f"topk_idx must be a tensor, got {type(topk_idx).__name__}")
    if topk_idx.dim() != 2 or topk_idx.dtype == torch.bool or topk_idx.is_floating_point() or topk_idx.is_complex():
        raise ValueError(f"topk_idx must be an integer tensor [T, K], got {describe(topk_idx)}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    sanitized = topk_idx.to(torch.int64, copy=True)
    sanitized[(sanitized < -1) | (sanitized >= num_experts)] = -1
    num_topk = sanitized.shape[1]
    # repeated[t, k]: some slot j < k of row t holds the same expert (-1 entries never count).
    same = sanitized.unsqueeze(2) == sanitized.unsqueeze(1)
    earlier = torch.ones(num_topk, num_topk, dtype=torch.bool, device=sanitized.device).tril(diagonal=-1)
    repeated = (same & earlier).any(dim=2) & (sanitized >= 0)
    sanitized[repeated] = -1
    return sanitized


def split_token_input(name: str, x: TokenInput) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(data, scales)`` for a bf16 tensor or an ``(fp8, fp32 scales)`` pair."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            raise ValueError(f"{name} must be bfloat16 [T, H] or an (fp8, scales) pair, got {describe(x)}")
        return x, None
    if not isinstance(x, (tuple, list)) or len(x) != 2:
        raise ValueError(f"{name} must be a bfloat16 tensor or an (fp8, scales) pair, got {type(x).__name__}")
    data, scales = x
    if data.dtype != torch.float8_e4m3fn or data.dim() != 2 or data.shape[1] % FP8_GROUP_SIZE != 0:
        raise ValueError(f"{name}[0] must be float8_e4m3fn [T, H] with H % {FP8_GROUP_SIZE} == 0, got {describe(data)}")
    expected = [data.shape[0], data.shape[1] // FP8_GROUP_SIZE]
    if scales.dtype != torch.float32 or list(scales.shape) != expected:
        raise ValueError(f"{name}[1] must be float32 {expected}, got {describe(scales)}")
    return data, scales


@dataclass(frozen=True)
class GroupInputs:
    """Every rank's validated dispatch inputs; fp8 ``data`` is viewed as uint8 (``payload_dtype`` says so)
    and ``topk_idx`` is the sanitised routing (``sanitize_topk_idx``)."""

    num_ranks: int
    num_local_experts: int
    hidden: int
    num_topk: int
    payload_dtype: torch.dtype
    data: list[torch.Tensor]
    scales: list[torch.Tensor] | None
    topk_idx: list[torch.Tensor]
    topk_weights: list[torch.Tensor] | None

    @property
    def device(self) -> torch.device:
        return self.data[0].device


def check_group(
    xs: list[TokenInput],
    topk_idxs: list[torch.Tensor],
    topk_weights_list: list[torch.Tensor] | None,
    num_experts: int,
) -> GroupInputs:
    num_ranks = len(xs)
    local_experts = num_local_experts(num_experts, num_ranks)
    if len(topk_idxs) != num_ranks:
        raise ValueError(f"topk_idxs must have one entry per rank ({num_ranks}), got {len(topk_idxs)}")
    if topk_weights_list is not None and len(topk_weights_list) != num_ranks:
        raise ValueError(f"topk_weights_list must have one entry per rank ({num_ranks}), got {len(topk_weights_list)}")
    pairs = [split_token_input(f"xs[{rank}]", x) for rank, x in enumerate(xs)]
    data = [pair[0] for pair in pairs]
    is_fp8 = [pair[1] is not None for pair in pairs]
    if any(is_fp8) != all(is_fp8):
        raise ValueError("xs must be all bfloat16 or all (fp8, scales) pairs, got a mix")
    hidden, num_topk = data[0].shape[1], topk_idxs[0].shape[-1]
    for rank in range(num_ranks):
        if data[rank].shape[1] != hidden:
            raise ValueError(f"xs[{rank}] must have hidden size {hidden} like xs[0], got {describe(data[rank])}")
        check_topk_idx(f"topk_idxs[{rank}]", topk_idxs[rank], data[rank].shape[0])
        if topk_idxs[rank].shape[1] != num_topk:
            raise ValueError(
                f"topk_idxs[{rank}] must have K={num_topk} like topk_idxs[0], got {describe(topk_idxs[rank])}"
            )
        if topk_weights_list is not None:
            weights = topk_weights_list[rank]
            if weights.dtype != torch.float32 or weights.shape != topk_idxs[rank].shape:
                raise ValueError(
                    f"topk_weights_list[{rank}] must be float32 {list(topk_idxs[rank].shape)}, got {describe(weights)}"
                )
    return GroupInputs(
        num_ranks=num_ranks,
        num_local_experts=local_experts,
        hidden=hidden,
        num_topk=num_topk,
        payload_dtype=data[0].dtype,
        data=[as_bytes_if_fp8(payload) for payload in data],
        scales=[pair[1] for pair in pairs] if all(is_fp8) else None,
        topk_idx=[sanitize_topk_idx(topk_idx, num_experts) for topk_idx in topk_idxs],
        topk_weights=None if topk_weights_list is None else list(topk_weights_list),
    )


def local_expert_ids(topk_idx: torch.Tensor, rank: int, num_local: int) -> torch.Tensor:
    """``topk_idx - rank * L`` where the expert lives on ``rank``, else -1."""
    owned = (topk_idx >= 0) & (topk_idx // num_local == rank)
    return torch.where(owned, topk_idx - rank * num_local, torch.full_like(topk_idx, -1))
