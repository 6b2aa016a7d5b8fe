"""Per-token, per-128-channel E4M3 quantisation shared by the reference model and the API.

Every GPU kernel that casts to FP8 (LL dispatch, fp8 HT inputs built on the device) is compared
bitwise against these functions, so it must do exactly the same arithmetic, group by group:

1. ``amax = max(|x|)`` over the 128 channels, in fp32, then ``amax = max(amax, 1e-4f)``;
2. ``inv = 448.0f / amax`` as an IEEE correctly rounded fp32 division (``__fdiv_rn``; never
   ``448 * (1 / amax)`` and never ``--use_fast_math``, both of which round twice);
3. ``q = e4m3(x_fp32 * inv)``: one fp32 multiply (``__fmul_rn``) then a round-to-nearest-even
   conversion (``__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)``). Since ``|x| <= amax``
   the product never rounds above 448, so saturating and non-saturating conversions agree;
4. ``scale = amax / 448.0f``, again a correctly rounded fp32 division (not ``amax * (1/448)``).

Inputs whose fp32 value is subnormal must not be flushed to zero (no ``-ftz=true``).

PyTorch rewrites ``scalar / tensor`` as ``tensor.reciprocal() * scalar`` and, on CUDA, ``tensor /
cpu_scalar`` as a multiply by the reciprocal; both round twice. The divisions below therefore
divide by or into a tensor on the data's own device.
"""

import torch

__all__ = ["FP8_GROUP_SIZE", "FP8_MAX", "per_token_cast_to_fp8", "per_token_cast_back"]

FP8_GROUP_SIZE = 128
FP8_MAX = 448.0
_AMAX_FLOOR = 1e-4


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"


def _num_groups(name: str, tensor: torch.Tensor) -> int:
    if tensor.dim() < 2:
        raise ValueError(f"{name} must be [T, H] (or [..., T, H]), got {_describe(tensor)}")
    hidden = tensor.shape[-1]
    if hidden % FP8_GROUP_SIZE != 0:
        raise ValueError(f"{name} hidden size must be a multiple of {FP8_GROUP_SIZE} for fp8, got H={hidden}")
    return hidden // FP8_GROUP_SIZE


def per_token_cast_to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` (bf16 or fp32 ``[..., T, H]``) to ``(fp8_e4m3fn [..., T, H], fp32 [..., T, H/128])``.

    ``scales[..., t, g]`` is ``amax / 448`` of channels ``[128 g, 128 g + 128)`` of token ``t``.
    """
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {_describe(x)}")
    num_groups = _num_groups("x", x)
    grouped = x.float().reshape(*x.shape[:-1], num_groups, FP8_GROUP_SIZE)
    amax = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR)
    fp8_max = torch.full_like(amax, FP8_MAX)
    quantised = (grouped * torch.div(fp8_max, amax)).to(torch.float8_e4m3fn)
    scales = torch.div(amax, fp8_max).squeeze(-1)
    return quantised.reshape(x.shape), scales


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise ``(fp8 [..., T, H], fp32 [..., T, H/128])`` to bf16: ``bf16(float(q) * scale)``."""
    if x_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x_fp8 must be float8_e4m3fn, got {_describe(x_fp8)}")
    num_groups = _num_groups("x_fp8", x_fp8)
    expected_shape = (*x_fp8.shape[:-1], num_groups)
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected_shape:
        raise ValueError(f"scales must be float32 {list(expected_shape)}, got {_describe(scales)}")
    grouped = x_fp8.float().reshape(*expected_shape, FP8_GROUP_SIZE)
    return (grouped * scales.unsqueeze(-1)).to(torch.bfloat16).reshape(x_fp8.shape)
