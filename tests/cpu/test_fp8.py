"""Hand-worked checks of the per-token E4M3 cast that GPU kernels must reproduce bitwise."""

import math

import numpy as np
import pytest
import torch

from deep_ep.fp8 import pack_ue8m0, pack_ue8m0_unchecked, per_token_cast_back, per_token_cast_to_fp8, unpack_ue8m0


def _row(values: list[float], hidden: int = 128) -> torch.Tensor:
    row = torch.zeros(hidden)
    row[: len(values)] = torch.tensor(values)
    return row


def test_group_with_amax_448_keeps_exact_values_and_scale_one():
    x = _row([448.0, -448.0, 1.0, 0.5, 2.0, -3.0, 0.0, 240.0]).unsqueeze(0).bfloat16()
    quantised, scales = per_token_cast_to_fp8(x)
    assert quantised.dtype == torch.float8_e4m3fn and list(quantised.shape) == [1, 128]
    assert scales.dtype == torch.float32 and scales.tolist() == [[1.0]]
    assert torch.equal(quantised.float(), x.float())


def test_power_of_two_amax_scales_exactly():
    # amax 7: 448 / 7 = 64 exactly and scale = 7 / 448 = 1 / 64.
    x = _row([7.0, 3.5, -0.25, 1.0]).unsqueeze(0)
    quantised, scales = per_token_cast_to_fp8(x)
    assert scales.tolist() == [[1.0 / 64.0]]
    assert quantised.float()[0, :5].tolist() == [448.0, 224.0, -16.0, 64.0, 0.0]


def test_cast_rounds_to_nearest_even():
    # amax 7 → products 17 and 19 sit halfway between E4M3 neighbours (spacing 2 in [16, 32)):
    # 17 → 16 (even mantissa 000), 19 → 20 (even mantissa 010).
    x = _row([7.0, 17.0 / 64.0, 19.0 / 64.0, -17.0 / 64.0]).unsqueeze(0).bfloat16()
    quantised, _ = per_token_cast_to_fp8(x)
    assert quantised.float()[0, :4].tolist() == [448.0, 16.0, 20.0, -16.0]


def test_cast_keeps_subnormals_with_round_to_nearest_even():
    # amax 448 → scale 1. E4M3 subnormals are multiples of 2^-9: 2^-10 is a tie → 0 (even),
    # 3 * 2^-11 = 0.75 * 2^-9 → 2^-9, 5 * 2^-10 = 2.5 * 2^-9 → 2 * 2^-9 (even).
    x = _row([448.0, 2.0**-10, 3 * 2.0**-11, 5 * 2.0**-10]).unsqueeze(0).bfloat16()
    quantised, _ = per_token_cast_to_fp8(x)
    assert quantised.float()[0, :4].tolist() == [448.0, 0.0, 2.0**-9, 2 * 2.0**-9]


def test_divisions_are_correctly_rounded_not_reciprocal_multiplies():
    # For amax 3 the correctly rounded fp32 quotients differ from the reciprocal-multiply ones.
    amax = np.float32(3.0)
    expected_scale = amax / np.float32(448.0)
    assert expected_scale != amax * (np.float32(1.0) / np.float32(448.0))
    # 448 / 3 = 149.33 in fp32; E4M3 spacing is 16 in [128, 256), 32 in [256, 448], 8 in [64, 128).
    x = _row([3.0, 1.0, -2.0, 0.5]).unsqueeze(0)
    quantised, scales = per_token_cast_to_fp8(x)
    assert scales[0, 0].item() == float(expected_scale)
    assert quantised.float()[0, :4].tolist() == [448.0, 144.0, -288.0, 72.0]


def test_quotient_rounding_decides_a_subnormal_tie():
    # amax 1.5, x = 1.125 * 2^-14: with the correctly rounded 448 / 1.5 the fp32 product is exactly
    # 21 * 2^-10, halfway between E4M3 subnormals 10 * 2^-9 and 11 * 2^-9 → 10 * 2^-9 (even).
    # The reciprocal-multiply quotient is one ulp larger and would round up to 11 * 2^-9.
    x_value = np.float32(1.125 * 2.0**-14)
    assert x_value * (np.float32(448.0) / np.float32(1.5)) == np.float32(21 * 2.0**-10)
    x = _row([1.5, float(x_value)]).unsqueeze(0).bfloat16()
    quantised, _ = per_token_cast_to_fp8(x)
    assert quantised.float()[0, 1].item() == 10 * 2.0**-9


def test_zero_group_clamps_amax_to_1e_minus_4():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    x[0, 128] = 448.0
    quantised, scales = per_token_cast_to_fp8(x)
    assert scales[0, 0].item() == float(np.float32(1e-4) / np.float32(448.0))
    assert scales[0, 1].item() == 1.0
    assert quantised.view(torch.uint8)[0, :128].eq(0).all()


def test_groups_and_tokens_are_scaled_independently():
    x = torch.stack([torch.cat([_row([1.0]), _row([224.0])]), torch.cat([_row([-14.0]), _row([0.5])])])
    _, scales = per_token_cast_to_fp8(x.bfloat16())
    one_over_448 = float(np.float32(1.0) / np.float32(448.0))
    half_over_448 = float(np.float32(0.5) / np.float32(448.0))
    assert scales.tolist() == [[one_over_448, 0.5], [1.0 / 32.0, half_over_448]]


def test_leading_dimensions_match_row_by_row_cast():
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    quantised, scales = per_token_cast_to_fp8(x)
    flat_quantised, flat_scales = per_token_cast_to_fp8(x.reshape(6, 256))
    assert torch.equal(quantised.view(torch.uint8).reshape(6, 256), flat_quantised.view(torch.uint8))
    assert torch.equal(scales.reshape(6, 2), flat_scales)


def test_cast_back_multiplies_by_the_group_scale():
    quantised = torch.tensor([[448.0] * 128 + [-16.0] * 128]).to(torch.float8_e4m3fn)
    scales = torch.tensor([[0.5, 0.125]])
    restored = per_token_cast_back(quantised, scales)
    assert restored.dtype == torch.bfloat16
    assert restored[0, :128].eq(224.0).all() and restored[0, 128:].eq(-2.0).all()


def test_round_trip_stays_within_fp8_precision():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)).bfloat16()
    quantised, scales = per_token_cast_to_fp8(x)
    restored = per_token_cast_back(quantised, scales).float()
    reference = x.float()
    # E4M3 keeps 3 mantissa bits (relative error <= 2^-4 for normals, absolute <= 2^-10 * scale
    # in the subnormal range); the final bf16 rounding adds up to 2^-8 relative.
    group_scales = scales.repeat_interleave(128, dim=1)
    bound = reference.abs() * (2.0**-4 + 2.0**-8) * (1 + 2.0**-4) + group_scales * 2.0**-10
    assert ((restored - reference).abs() <= bound).all()


def test_cast_rejects_hidden_not_multiple_of_128():
    with pytest.raises(ValueError, match="multiple of 128"):
        per_token_cast_to_fp8(torch.ones(2, 100, dtype=torch.bfloat16))


def test_cast_rejects_integer_input_and_one_dimensional_input():
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        per_token_cast_to_fp8(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        per_token_cast_to_fp8(torch.ones(128, dtype=torch.bfloat16))


def test_cast_back_rejects_mismatched_scales():
    quantised = torch.zeros(2, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scales must be float32"):
        per_token_cast_back(quantised, torch.ones(2, 3))
    with pytest.raises(ValueError, match="x_fp8 must be float8_e4m3fn"):
        per_token_cast_back(torch.zeros(2, 256), torch.ones(2, 2))


# --- round_scale: power-of-two scales ---------------------------------------------------------

ONE_OVER_448 = np.float32(1.0) / np.float32(448.0)
# Every finite non-negative E4M3 value, ascending; codes 0..126 (0x7f is NaN), so an even code is an
# even mantissa.
E4M3_VALUES = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double().numpy()


def _e4m3_round_nearest_even(values: np.ndarray) -> np.ndarray:
    """Independent E4M3 rounding of exact float64 values: nearest table entry, ties to the even code."""
    magnitude = np.abs(values)
    upper = np.clip(np.searchsorted(E4M3_VALUES, magnitude), 0, len(E4M3_VALUES) - 1)
    lower = np.clip(upper - 1, 0, None)
    below, above = magnitude - E4M3_VALUES[lower], E4M3_VALUES[upper] - magnitude
    take_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    return np.copysign(E4M3_VALUES[np.where(take_upper, upper, lower)], values)


def _straightforward_round_scale_cast(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The spec's rule written out group by group with numpy float32 and math.frexp."""
    values = x.float().numpy().reshape(x.shape[0], -1, 128)
    quantised, scales = np.zeros(values.shape), np.zeros(values.shape[:2])
    for token in range(values.shape[0]):
        for group in range(values.shape[1]):
            amax = max(np.abs(values[token, group]).max(), np.float32(1e-4))
            t = np.float32(amax) * ONE_OVER_448  # one fp32 multiply, correctly rounded
            mantissa, exponent = math.frexp(float(t))  # t = mantissa * 2**exponent, mantissa in [0.5, 1)
            e = exponent - 1 if mantissa == 0.5 else exponent  # ceil(log2(t))
            scales[token, group] = 2.0**e
            quantised[token, group] = _e4m3_round_nearest_even(values[token, group].astype(np.float64) * 2.0**-e)
    return quantised.reshape(x.shape), scales


def _round_scale_inputs(dtype: torch.dtype) -> torch.Tensor:
    """[T, 512] rows with magnitudes from 2**-40 to 2**40, amaxes at and next to 448 * 2**k (in the
    input dtype), amaxes on the first/last channel of a group, zero and below-the-clamp groups."""
    generator = torch.Generator().manual_seed(7)
    rows = [torch.randn(512, generator=generator) * 2.0 ** float(k) for k in range(-40, 41, 4)]
    for k in (-12, -3, 0, 1, 7, 20):
        exact = torch.tensor(448 * 2.0**k).to(dtype)
        for amax in (exact, torch.nextafter(exact, exact * 2), torch.nextafter(exact, exact * 0)):
            row = (torch.rand(512, generator=generator) * 2 - 1) * 448 * 2.0**k
            row[[0, 127, 128, 383, 511]] = amax.float() * torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
            rows.append(row)
    boundary = torch.randn(512, generator=generator)
    boundary[127], boundary[128] = 1000.0, -0.001  # adjacent channels of different groups
    rows.append(boundary)
    small = torch.zeros(512)
    small[128:256] = 3e-5  # amax below the 1e-4 clamp
    small[256:384] = torch.randn(128, generator=generator) * 1e-3
    rows.append(small)
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_scale_matches_a_straightforward_implementation_exactly(dtype):
    x = _round_scale_inputs(dtype)
    quantised, scales = per_token_cast_to_fp8(x, round_scale=True)
    expected_quantised, expected_scales = _straightforward_round_scale_cast(x)
    assert quantised.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert np.array_equal(scales.double().numpy(), expected_scales)
    assert np.array_equal(quantised.double().numpy(), expected_quantised)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_scale_scales_are_powers_of_two_covering_amax(dtype):
    x = _round_scale_inputs(dtype)
    _, scales = per_token_cast_to_fp8(x, round_scale=True)
    bits = scales.view(torch.int32)
    assert bits.bitwise_and((1 << 23) - 1).eq(0).all() and bits.gt(0).all()
    # scale = 2**ceil(log2(amax / 448)) up to the rounding of t: amax / 448 <= scale < 2 * amax / 448.
    amax = x.float().reshape(x.shape[0], -1, 128).abs().amax(dim=-1).clamp(min=1e-4).double()
    assert (amax / 448 <= scales.double() * (1 + 2.0**-22)).all()
    assert (scales.double() < 2 * amax / 448).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_round_scale_round_trip_stays_within_fp8_precision(dtype):
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)).mul(37.0).to(dtype)
    quantised, scales = per_token_cast_to_fp8(x, round_scale=True)
    restored = per_token_cast_back(quantised, scales).float()
    reference = x.float()
    # As the non-rounded cast: q keeps 3 mantissa bits, subnormals are multiples of 2^-9 * scale.
    group_scales = scales.repeat_interleave(128, dim=1)
    bound = reference.abs() * (2.0**-4 + 2.0**-8) * (1 + 2.0**-4) + group_scales * 2.0**-10
    assert ((restored - reference).abs() <= bound).all()


def test_round_scale_hand_worked_groups():
    # amax 7: t = 7 * fp32(1/448) rounds to exactly 2^-6, so e = -6 and q = x * 64 (amax → 448).
    # amax 3: t = 0.0066964 is not a power of two; ceil(log2(t)) = -7, so q = x * 128 (3 → 384).
    # amax 448 * (1 + 2^-23) (the fp32 after 448): t > 1, e = 1 and q = x / 2 (amax → 224).
    just_above = float(np.nextafter(np.float32(448.0), np.float32(1000.0)))
    x = torch.cat([_row([7.0, 3.5, -0.25]), _row([3.0, 1.0, -2.0, 0.5]), _row([just_above, 448.0])]).unsqueeze(0)
    quantised, scales = per_token_cast_to_fp8(x, round_scale=True)
    assert scales.tolist() == [[2.0**-6, 2.0**-7, 2.0]]
    q = quantised.float()[0]
    assert q[:3].tolist() == [448.0, 224.0, -16.0]
    assert q[128:132].tolist() == [384.0, 128.0, -256.0, 64.0]
    assert q[256:258].tolist() == [224.0, 224.0]


def test_round_scale_clamps_amax_to_1e_minus_4():
    # t = fp32(1e-4) * fp32(1/448) = 2.23e-7, between 2^-23 and 2^-22: scale 2^-22 for a zero group and
    # for one whose amax is under the clamp (3e-5 * 2^22 = 125.8 → E4M3 128).
    x = torch.zeros(1, 384)
    x[0, 128] = 3e-5
    x[0, 256] = 448.0
    quantised, scales = per_token_cast_to_fp8(x, round_scale=True)
    assert scales.tolist() == [[2.0**-22, 2.0**-22, 1.0]]
    assert quantised.view(torch.uint8)[0, :128].eq(0).all()
    assert quantised.float()[0, 128].item() == 128.0


def test_round_scale_false_is_the_default_cast():
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    quantised, scales = per_token_cast_to_fp8(x, round_scale=False)
    default_quantised, default_scales = per_token_cast_to_fp8(x)
    assert torch.equal(quantised.view(torch.uint8), default_quantised.view(torch.uint8))
    assert torch.equal(scales, default_scales)


def test_round_scale_keeps_leading_dimensions():
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(5)).bfloat16()
    quantised, scales = per_token_cast_to_fp8(x, round_scale=True)
    flat_quantised, flat_scales = per_token_cast_to_fp8(x.reshape(6, 256), round_scale=True)
    assert torch.equal(quantised.view(torch.uint8).reshape(6, 256), flat_quantised.view(torch.uint8))
    assert torch.equal(scales.reshape(6, 2), flat_scales)


# --- pack_ue8m0 -------------------------------------------------------------------------------


def test_pack_ue8m0_puts_group_4w_in_the_lowest_byte():
    # Exponent bytes: 2^-22 → 105 (0x69), 1 → 127 (0x7f), 2 → 128 (0x80), 2^-126 → 1.
    scales = torch.tensor([[2.0**-22, 1.0, 2.0, 2.0**-126, 1.0, 1.0, 1.0, 2.0**127]])
    packed = pack_ue8m0(scales)
    assert packed.dtype == torch.int32 and list(packed.shape) == [1, 2]
    assert packed[0, 0].item() == 0x01_80_7F_69
    # A top byte >= 0x80 sets the int32 sign bit: 0xfe7f7f7f as a signed word.
    assert packed[0, 1].item() == 0xFE_7F_7F_7F - (1 << 32)
    assert packed.view(torch.uint8).tolist() == [[0x69, 0x7F, 0x80, 0x01, 0x7F, 0x7F, 0x7F, 0xFE]]


def test_pack_ue8m0_of_round_scale_scales_round_trips():
    x = torch.randn(2, 3, 1024, generator=torch.Generator().manual_seed(6)).mul(100.0).bfloat16()
    _, scales = per_token_cast_to_fp8(x, round_scale=True)
    packed = pack_ue8m0(scales)
    assert list(packed.shape) == [2, 3, 2]
    shifts = torch.tensor([0, 8, 16, 24])
    exponent_bytes = (packed.unsqueeze(-1).long() >> shifts) & 0xFF
    unpacked = (exponent_bytes.reshape(2, 3, 8).int() << 23).view(torch.float32)
    assert torch.equal(unpacked, scales)
    # Column-major views (as the TMA-aligned scales) pack by value, not by storage order.
    assert torch.equal(pack_ue8m0(scales.transpose(-1, -2).contiguous().transpose(-1, -2)), packed)


def test_unpack_ue8m0_inverts_pack_and_the_unchecked_pack_agrees_on_powers_of_two():
    x = torch.randn(5, 2048, generator=torch.Generator().manual_seed(7)).mul(30.0).bfloat16()
    _, scales = per_token_cast_to_fp8(x, round_scale=True)
    packed = pack_ue8m0(scales)
    assert torch.equal(pack_ue8m0_unchecked(scales), packed)
    assert torch.equal(unpack_ue8m0(packed), scales)
    assert unpack_ue8m0(torch.tensor([[0x01_80_7F_00]], dtype=torch.int32)).tolist() == [[0.0, 1.0, 2.0, 2.0**-126]]


@pytest.mark.parametrize(
    "bad",
    [3.0, 0.0, -1.0, -0.0, float("inf"), float("nan"), 2.0**-130, 1.5 * 2.0**-3],
)
def test_pack_ue8m0_rejects_scales_that_are_not_positive_normal_powers_of_two(bad):
    scales = torch.ones(2, 4)
    scales[1, 2] = bad
    with pytest.raises(ValueError, match=r"positive normal powers of two.*at index \[1, 2\]") as error:
        pack_ue8m0(scales)
    assert repr(scales[1, 2].item()) in str(error.value)


def test_pack_ue8m0_rejects_groups_not_a_multiple_of_4_and_non_float32():
    with pytest.raises(ValueError, match="multiple of 4.*G=6"):
        pack_ue8m0(torch.ones(2, 6))
    with pytest.raises(ValueError, match="scales must be float32"):
        pack_ue8m0(torch.ones(2, 4, dtype=torch.float64))
