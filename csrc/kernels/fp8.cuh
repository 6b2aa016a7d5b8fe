// Per-(token, 128 channels) E4M3 quantisation on the device, bit-for-bit the arithmetic of
// deep_ep/fp8.py (the reference every fp8 kernel is compared with):
//   amax  = max(|x|) over the group in fp32, floored at 1e-4
//   inv   = 448 / amax     (one correctly rounded division, never 448 * (1 / amax))
//   q     = e4m3_rn_satfinite(x * inv)   (one fp32 multiply, then round to nearest even)
//   scale = amax / 448     (again one correctly rounded division)
// With power-of-two scales (DeepEP's round_scale):
//   t     = amax * fp32(1/448)   (one rounded multiply), floored amax as above
//   e     = ceil(log2(t)), exactly, from t's bits (exponent, +1 when the mantissa is non-zero)
//   scale = 2^e, inv = 2^-e, q = e4m3_rn_satfinite(x * inv) (an exact multiply)
// The intrinsics below are used instead of operators so that neither --use_fast_math nor FMA
// contraction can change a single rounding.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace deep_ep::fp8 {

constexpr float kE4m3Max = 448.0f;
constexpr float kAmaxFloor = 1e-4f;
constexpr float kInvE4m3Max = 1.0f / 448.0f;  // fp32(1/448), folded at compile time

// Eight bf16 channels (one 16-byte vector) widened to fp32; the widening is exact.
struct Channels8 {
  float value[8];
};

__device__ __forceinline__ Channels8 widen_bf16x8(const int4& packed) {
  Channels8 channels;
  const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 pair = __bfloat1622float2(pairs[i]);
    channels.value[2 * i] = pair.x;
    channels.value[2 * i + 1] = pair.y;
  }
  return channels;
}

__device__ __forceinline__ float abs_max(const Channels8& channels) {
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(channels.value[i]));
  return amax;
}

// `group_amax` is the max over all 128 channels of the group (already reduced across lanes).
__device__ __forceinline__ float inverse_scale(float group_amax) {
  return __fdiv_rn(kE4m3Max, fmaxf(group_amax, kAmaxFloor));
}

__device__ __forceinline__ float scale(float group_amax) { return __fdiv_rn(fmaxf(group_amax, kAmaxFloor), kE4m3Max); }

// Power-of-two scales: the exponent e of scale = 2^e for a group's amax.
__device__ __forceinline__ int pow2_scale_exponent(float group_amax) {
  const uint32_t bits = __float_as_uint(__fmul_rn(fmaxf(group_amax, kAmaxFloor), kInvE4m3Max));
  return static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
}

// 2^e as fp32 for the exponents pow2_scale_exponent yields (normal numbers only).
__device__ __forceinline__ float exp2_exact(int e) { return __uint_as_float(static_cast<uint32_t>(e + 127) << 23); }

// Eight channels to eight E4M3 bytes (little-endian channel order, as torch stores them).
__device__ __forceinline__ uint2 quantise8(const Channels8& channels, float inv_scale) {
  uint32_t words[2];
#pragma unroll
  for (int word = 0; word < 2; ++word) {
    uint32_t packed = 0;
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      const int i = word * 4 + pair * 2;
      const float2 scaled =
          make_float2(__fmul_rn(channels.value[i], inv_scale), __fmul_rn(channels.value[i + 1], inv_scale));
      const __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(scaled, __NV_SATFINITE, __NV_E4M3);
      packed |= static_cast<uint32_t>(q) << (16 * pair);
    }
    words[word] = packed;
  }
  return make_uint2(words[0], words[1]);
}

}  // namespace deep_ep::fp8
