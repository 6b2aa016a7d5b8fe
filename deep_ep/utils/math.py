"""``deep_ep.utils.math`` as DeepEP's clients and tests import it: the per-token FP8 casts with
DeepEP's interface, and the small numeric helpers DeepEP's test scripts use.

The casts keep DeepEP's contract where it differs from ``deep_ep.fp8`` (the strict casts our
kernels are checked against):

- input is 2-D ``[m, n]`` and ``n`` may be any size: each row is zero-padded to a multiple of 128
  before grouping, the fp8 result is cut back to ``n`` columns and the scales have
  ``ceil(n / 128)`` columns (a zero pad never changes a group's amax);
- bf16, fp16 and fp32 inputs are accepted (converted to fp32 exactly);
- ``per_token_cast_back`` also takes int32 scales holding four packed UE8M0 exponents (one byte per
  128-channel group, lowest byte first; byte ``b`` means ``2 ** (b - 127)``), scales of any
  strides, and an empty input (returned as empty bf16).

The arithmetic of each 128-channel group is ``deep_ep.fp8``'s: ``amax = max(max|x|, 1e-4)``,
``q = e4m3(x * (448 / amax))``, ``scale = amax / 448``, both divisions correctly rounded in fp32.
DeepEP writes ``448 / amax`` as a Python scalar divided by a tensor, which PyTorch may evaluate as
a reciprocal and a multiply (two roundings); where the two quotients are one ulp apart, a product
on an fp8 rounding tie lands one fp8 step away. Ours is the arithmetic our LL kernels reproduce
bitwise, so a cast here matches what our LL dispatch produces.
"""

from __future__ import annotations

from typing import Any

import torch

from deep_ep import fp8
from deep_ep._util import describe

__all__ = [
    "align",
    "calc_diff",
    "ceil_div",
    "count_bytes",
    "create_grouped_scores",
    "hash_tensor",
    "hash_tensors",
    "inplace_unique",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "safe_div",
]

_GROUP = fp8.FP8_GROUP_SIZE
_CAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def ceil_div(x: int, y: int) -> int:
    """``x / y`` rounded up (integers)."""
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    """The smallest multiple of ``y`` that is ``>= x``."""
    return ceil_div(x, y) * y


def safe_div(a: float, b: float) -> float:
    """``a / b``, with ``0 / 0 = 0``; any other division by zero raises ``ZeroDivisionError``."""
    try:
        return a / b
    except ZeroDivisionError:
        if a == 0:
            return 0
        raise


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepEP's similarity error ``1 - 2 Σ(x'y') / Σ(x'² + y'²)`` with ``x' = x + 1``, ``y' = y + 1``
    in float64: 0 for equal tensors, small for close ones (the shift keeps all-zero tensors finite)."""
    xs = x.double() + 1
    ys = y.double() + 1
    similarity = 2 * (xs * ys).sum() / (xs * xs + ys * ys).sum()
    return (1 - similarity).item()


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` (bf16, fp16 or fp32 ``[m, n]``, any ``n``) per token and 128-channel group.

    Returns ``(fp8_e4m3fn [m, n], fp32 [m, ceil(n / 128)])``; ``scales[t, g]`` is ``amax / 448`` of
    channels ``[128 g, 128 g + 128)`` of token ``t`` (missing channels of the last group count as 0).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.dtype not in _CAST_DTYPES:
        raise ValueError(f"x must be a 2-D bfloat16, float16 or float32 tensor [m, n], got {describe(x)}")
    num_tokens, hidden = x.shape
    padded_hidden = align(hidden, _GROUP)
    values = x if x.dtype != torch.float16 else x.float()
    if padded_hidden != hidden:
        values = torch.nn.functional.pad(values, (0, padded_hidden - hidden))
    quantised, scales = fp8.per_token_cast_to_fp8(values)
    if padded_hidden != hidden:
        quantised = quantised[:, :hidden].contiguous()
    return quantised, scales.reshape(num_tokens, padded_hidden // _GROUP)


def per_token_cast_back(x_fp8: torch.Tensor, x_scales: torch.Tensor) -> torch.Tensor:
    """Dequantise ``(float8_e4m3fn [m, n], scales)`` to bf16 ``[m, n]``: ``bf16(float(q) * scale)``.

    Scales are read as DeepEP's helper reads them, by their contents in row-major order whatever
    the tensor's shape: fp32 holding ``m * ceil(n / 128)`` scales (``[m, ceil(n / 128)]`` of any
    strides, e.g. column-major, or any other shape with that many elements), or int32 whose bytes
    are ``m * ceil(n / 128)`` UE8M0 exponents (four per int, lowest byte first: the LL dispatch's
    packed scales, also after ``.contiguous().view(-1, n // 128)`` as DeepEP's LL test views them).
    An empty ``x_fp8`` is returned as bf16.
    """
    if not isinstance(x_fp8, torch.Tensor) or not isinstance(x_scales, torch.Tensor):
        raise TypeError(f"x_fp8 and x_scales must be tensors, got {type(x_fp8).__name__} and {type(x_scales).__name__}")
    if x_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x_fp8 must be float8_e4m3fn, got {describe(x_fp8)}")
    if x_fp8.numel() == 0:
        return x_fp8.to(torch.bfloat16)
    if x_fp8.dim() != 2:
        raise ValueError(f"x_fp8 must be 2-D [m, n], got {describe(x_fp8)}")
    num_tokens, hidden = x_fp8.shape
    padded_hidden = align(hidden, _GROUP)
    num_groups = padded_hidden // _GROUP
    scales = _scales_by_contents(x_scales, num_tokens, num_groups)
    values = x_fp8.float()
    if padded_hidden != hidden:
        values = torch.nn.functional.pad(values, (0, padded_hidden - hidden))
    grouped = values.view(num_tokens, num_groups, _GROUP)
    restored = (grouped * scales.unsqueeze(-1)).to(torch.bfloat16).view(num_tokens, padded_hidden)
    return restored[:, :hidden].contiguous() if padded_hidden != hidden else restored


def _scales_by_contents(x_scales: torch.Tensor, num_tokens: int, num_groups: int) -> torch.Tensor:
    """fp32 ``[num_tokens, num_groups]`` from scales holding that many values (fp32) or exponent
    bytes (int32, packed UE8M0), read in row-major order."""
    if x_scales.dtype == torch.float32:
        if tuple(x_scales.shape) == (num_tokens, num_groups):
            return x_scales  # any strides: indexed, not reinterpreted
        if x_scales.numel() == num_tokens * num_groups:
            return x_scales.reshape(num_tokens, num_groups)
        raise ValueError(
            f"scales must hold {num_tokens} x {num_groups} float32 values ([m, ceil(n / 128)]), "
            f"got {describe(x_scales)}"
        )
    if x_scales.dtype == torch.int32:
        if 4 * x_scales.numel() != num_tokens * num_groups:
            raise ValueError(
                f"packed UE8M0 scales must hold {num_tokens} x {num_groups} exponent bytes (four per int32: "
                f"{num_tokens * num_groups / 4:g} ints), got {describe(x_scales)}"
            )
        # unpack_ue8m0 reads its input byte by byte, so the bytes in token rows unpack as they are.
        return fp8.unpack_ue8m0(x_scales.reshape(-1).view(torch.uint8).reshape(num_tokens, num_groups))
    raise ValueError(f"x_scales must be float32 or int32 (packed UE8M0), got {describe(x_scales)}")


def inplace_unique(x: torch.Tensor, num_slots: int) -> None:
    """Rewrite each row of ``x`` (integer ``[rows, cols]``, negatives = empty) in place as its
    distinct values in ``[0, num_slots)``, in descending order, then ``-1`` padding."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got {describe(x)}")
    present = torch.zeros((x.shape[0], num_slots + 1), dtype=torch.bool, device=x.device)
    present.scatter_(1, x.masked_fill(x < 0, num_slots).long(), True)
    slots = torch.arange(num_slots, device=x.device, dtype=x.dtype).expand(x.shape[0], num_slots)
    unique = torch.where(present[:, :num_slots], slots, torch.full_like(slots, -1))
    unique = unique.sort(dim=1, descending=True).values
    width = min(num_slots, x.shape[1])
    x.fill_(-1)
    x[:, :width] = unique[:, :width]


def create_grouped_scores(scores: torch.Tensor, group_idx: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``scores [T, E]`` with every expert outside the groups named in ``group_idx [T, k]`` zeroed
    (experts split into ``num_groups`` contiguous groups)."""
    num_tokens, num_experts = scores.shape
    selected = torch.zeros((num_tokens, num_groups), dtype=torch.bool, device=scores.device)
    selected.scatter_(1, group_idx.long(), True)
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    return (grouped * selected.unsqueeze(-1)).view(num_tokens, num_experts)


def hash_tensor(t: torch.Tensor) -> int:
    """Order-independent checksum: the sum of the elements viewed as int32 (4-byte dtypes) or of
    the bytes (any other dtype)."""
    t = t.contiguous()
    if t.element_size() == 4:
        return int(t.view(torch.int32).sum().item())
    return int(t.view(torch.uint8).sum().item())


def hash_tensors(*tensors: Any) -> int:
    """XOR of ``hash_tensor`` over the tensors, descending into tuples and lists; other values are
    skipped."""
    value = 0
    for item in tensors:
        if isinstance(item, (tuple, list)):
            value ^= hash_tensors(*item)
        elif isinstance(item, torch.Tensor):
            value ^= hash_tensor(item)
    return value


def count_bytes(*tensors: Any) -> int:
    """Bytes of the tensors, descending into tuples and lists; ``None`` counts 0."""
    total = 0
    for item in tensors:
        if isinstance(item, (tuple, list)):
            total += count_bytes(*item)
        elif item is not None:
            total += item.numel() * item.element_size()
    return total
