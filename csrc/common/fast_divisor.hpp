// Division by a value fixed for a whole kernel (experts per rank, top-k): a multiply-high, an add
// and a shift, where the compiler emits ~20 dependent instructions for a runtime divisor (the notify
// divides every routing entry several times). Granlund & Montgomery's round-up method: with
// s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1, x / d = (mulhi(x, m) + x) >> s, exact for
// every x in [0, 2^31) (the sum stays below 2^32). tests/cpp checks it against plain division.
#pragma once

#include <cstdint>

#include "common/geometry.hpp"

namespace deep_ep {

class FastDivisor {
 public:
  // divisor in [1, 2^31].
  EP_HOST_DEVICE explicit FastDivisor(uint32_t divisor) : divisor_(divisor) {
    while ((uint64_t{1} << shift_) < divisor) ++shift_;
    multiplier_ = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift_) - divisor)) / divisor + 1);
  }

  // x in [0, 2^31).
  EP_HOST_DEVICE int quotient(int x) const {
    const auto value = static_cast<uint32_t>(x);
    return static_cast<int>((multiply_high(value) + value) >> shift_);
  }
  EP_HOST_DEVICE int remainder(int x) const { return x - quotient(x) * static_cast<int>(divisor_); }

 private:
  EP_HOST_DEVICE uint32_t multiply_high(uint32_t value) const {
#ifdef __CUDA_ARCH__
    return __umulhi(value, multiplier_);
#else
    return static_cast<uint32_t>((uint64_t{value} * multiplier_) >> 32);
#endif
  }

  uint32_t divisor_;
  uint32_t multiplier_ = 1;
  uint32_t shift_ = 0;
};

}  // namespace deep_ep
