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

With ``round_scale=True`` (power-of-two scales, as DeepEP's ``round_scale`` / UE8M0 paths) steps
2-4 become, after the same step 1:

2. ``t = amax * (1.0f / 448.0f)``: one correctly rounded fp32 multiply (``__fmul_rn``) by the fp32
   constant nearest ``1/448`` (bits ``0x3b124925``). ``t`` can differ by an ulp from ``amax / 448``,
   though over every fp32 mantissa the ``e`` below comes out the same;
3. ``e = ceil(log2(t))`` taken exactly from ``t``'s bits: ``exp_field(t) - 127``, plus 1 when the
   mantissa bits are non-zero (``t`` is always a positive normal: ``t >= 1e-4 / 448``);
4. ``scale = 2**e`` and ``q = e4m3(x_fp32 * 2**-e)``, both powers of two built from bits
   (``(e + 127) << 23`` and ``(127 - e) << 23`` as fp32; no ``exp2f``), the multiply exact and the
   conversion round-to-nearest-even and saturating. ``|x| * 2**-e <= amax * 2**-e <= 448`` (checked
   over every fp32 mantissa of ``amax``), so saturation never triggers here either.

``pack_ue8m0`` turns such power-of-two scales into DeepEP's packed UE8M0 layout: int32 words that
hold the exponent bytes ``(bits >> 23) & 0xff`` of four consecutive groups, the first group in the
lowest byte.

Inputs whose fp32 value is subnormal must not be flushed to zero (no ``-ftz=true``); non-finite
inputs are outside the contract.

PyTorch rewrites ``scalar / tensor`` as ``tensor.reciprocal() * scalar`` and, on CUDA, ``tensor /
cpu_scalar`` as a multiply by the reciprocal; both round twice. The divisions below therefore
divide by or into a tensor on the data's own device, and the ``round_scale`` multiply uses an fp32
tensor holding ``1/448`` (so the constant is rounded to fp32 before the multiply, as in a kernel).
"""

import torch

from deep_ep._util import describe

__all__ = [
    "FP8_GROUP_SIZE",
    "FP8_MAX",
    "per_token_cast_to_fp8",
    "per_token_cast_back",
    "pack_ue8m0",
    "pack_ue8m0_unchecked",
    "unpack_ue8m0",
]

FP8_GROUP_SIZE = 128
FP8_MAX = 448.0
_AMAX_FLOOR = 1e-4
_FP32_EXPONENT_BIAS = 127
_FP32_MANTISSA_BITS = 23
_UE8M0_PER_WORD = 4


def _num_groups(name: str, tensor: torch.Tensor) -> int:
    if tensor.dim() < 2:
        raise ValueError(f"{name} must be [T, H] (or [..., T, H]), got {describe(tensor)}")
    hidden = tensor.shape[-1]
    if hidden % FP8_GROUP_SIZE != 0:
        raise ValueError(f"{name} hidden size must be a multiple of {FP8_GROUP_SIZE} for fp8, got H={hidden}")
    return hidden // FP8_GROUP_SIZE


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 ``2**exponent`` built exactly from its bits (``exponent`` int32 in ``[-126, 127]``)."""
    return ((exponent + _FP32_EXPONENT_BIAS) << _FP32_MANTISSA_BITS).view(torch.float32)


def per_token_cast_to_fp8(x: torch.Tensor, *, round_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` (bf16 or fp32 ``[..., T, H]``) to ``(fp8_e4m3fn [..., T, H], fp32 [..., T, H/128])``.

    ``scales[..., t, g]`` is ``amax / 448`` of channels ``[128 g, 128 g + 128)`` of token ``t``; with
    ``round_scale`` it is the power of two ``2**ceil(log2(fp32(amax * fp32(1/448))))`` (module docstring).
    """
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {describe(x)}")
    num_groups = _num_groups("x", x)
    grouped = x.float().reshape(*x.shape[:-1], num_groups, FP8_GROUP_SIZE)
    amax = grouped.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR)
    if round_scale:
        scaled = amax * torch.full_like(amax, 1.0 / FP8_MAX)
        bits = scaled.view(torch.int32)
        mantissa_mask = (1 << _FP32_MANTISSA_BITS) - 1
        exponent = ((bits >> _FP32_MANTISSA_BITS) & 0xFF) - _FP32_EXPONENT_BIAS + (bits & mantissa_mask).ne(0).int()
        quantised = (grouped * _power_of_two(-exponent)).to(torch.float8_e4m3fn)
        scales = _power_of_two(exponent).squeeze(-1)
        return quantised.reshape(x.shape), scales
    fp8_max = torch.full_like(amax, FP8_MAX)
    quantised = (grouped * torch.div(fp8_max, amax)).to(torch.float8_e4m3fn)
    scales = torch.div(amax, fp8_max).squeeze(-1)
    return quantised.reshape(x.shape), scales


def per_token_cast_back(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Dequantise ``(fp8 [..., T, H], fp32 [..., T, H/128])`` to bf16: ``bf16(float(q) * scale)``."""
    if x_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x_fp8 must be float8_e4m3fn, got {describe(x_fp8)}")
    num_groups = _num_groups("x_fp8", x_fp8)
    expected_shape = (*x_fp8.shape[:-1], num_groups)
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected_shape:
        raise ValueError(f"scales must be float32 {list(expected_shape)}, got {describe(scales)}")
    grouped = x_fp8.float().reshape(*expected_shape, FP8_GROUP_SIZE)
    return (grouped * scales.unsqueeze(-1)).to(torch.bfloat16).reshape(x_fp8.shape)


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Pack fp32 power-of-two scales ``[..., G]`` (``G % 4 == 0``) into int32 ``[..., G/4]``.

    Word ``w`` holds the UE8M0 exponent bytes ``(float_bits(scale) >> 23) & 0xff`` of groups
    ``4w .. 4w+3``, group ``4w`` in the lowest byte. Every scale must be a positive normal power of
    two (``2**e`` with ``-126 <= e <= 127``), as ``per_token_cast_to_fp8(..., round_scale=True)`` gives.
    """
    if scales.dtype != torch.float32 or scales.dim() < 1:
        raise ValueError(f"scales must be float32 [..., G], got {describe(scales)}")
    num_groups = scales.shape[-1]
    if num_groups % _UE8M0_PER_WORD != 0:
        raise ValueError(
            f"scales' last dimension G must be a multiple of {_UE8M0_PER_WORD} to pack UE8M0 bytes "
            f"into int32 words, got G={num_groups}"
        )
    bits = scales.contiguous().view(torch.int32)
    exponent_bytes = (bits >> _FP32_MANTISSA_BITS) & 0xFF
    # Sign bit clear, mantissa zero, exponent field neither 0 (zero/subnormal) nor 255 (inf/nan).
    not_power_of_two = (bits & ((1 << _FP32_MANTISSA_BITS) - 1)).ne(0) | (bits < 0)
    not_power_of_two |= (exponent_bytes == 0) | (exponent_bytes == 0xFF)
    if not_power_of_two.any():
        index = tuple(int(i) for i in not_power_of_two.nonzero()[0])
        raise ValueError(
            f"scales must be positive normal powers of two (2**e, -126 <= e <= 127) to pack as UE8M0, "
            f"got {scales[index].item()!r} at index {list(index)}"
        )
    return pack_ue8m0_unchecked(scales)


def pack_ue8m0_unchecked(scales: torch.Tensor) -> torch.Tensor:
    """``pack_ue8m0`` without the checks (no host synchronisation): the exponent byte of every
    fp32 scale ``[..., G]``, whatever its mantissa, packed four per int32 word."""
    num_groups = scales.shape[-1]
    exponent_bytes = (scales.contiguous().view(torch.int32) >> _FP32_MANTISSA_BITS) & 0xFF
    grouped = exponent_bytes.to(torch.int64).reshape(*scales.shape[:-1], num_groups // _UE8M0_PER_WORD, 4)
    shifts = torch.arange(0, 32, 8, dtype=torch.int64, device=scales.device)
    words = (grouped << shifts).sum(dim=-1)
    # Bytes >= 0x80 in the top position set the int32 sign bit: wrap explicitly, not through a cast.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[..., G/4]`` of packed UE8M0 exponent bytes (or the bytes themselves, uint8
    ``[..., G]``) -> fp32 ``[..., G]`` powers of two (the inverse of ``pack_ue8m0``; a zero byte
    gives 0.0)."""
    exponents = packed.contiguous().view(torch.uint8).to(torch.int32)
    return (exponents << _FP32_MANTISSA_BITS).view(torch.float32)
