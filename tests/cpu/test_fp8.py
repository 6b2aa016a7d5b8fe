"""Hand-worked checks of the per-token E4M3 cast that GPU kernels must reproduce bitwise."""

import numpy as np
import pytest
import torch

from deep_ep.fp8 import per_token_cast_back, per_token_cast_to_fp8


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
