// FastDivisor: the notify's divisions by experts-per-rank and top-k must equal plain division.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "common/fast_divisor.hpp"

namespace deep_ep {
namespace {

TEST(FastDivisor, EqualsPlainDivisionForSmallDividendsAndDivisors) {
  for (int divisor = 1; divisor <= 1100; ++divisor) {
    const FastDivisor fast(static_cast<uint32_t>(divisor));
    for (int x = 0; x < 70000; x += (x < 4096 ? 1 : 7)) {
      ASSERT_EQ(fast.quotient(x), x / divisor) << "x=" << x << " divisor=" << divisor;
      ASSERT_EQ(fast.remainder(x), x % divisor) << "x=" << x << " divisor=" << divisor;
    }
  }
}

TEST(FastDivisor, EqualsPlainDivisionUpToTheLargestDividend) {
  std::mt19937 generator(7);
  std::uniform_int_distribution<int> dividend(0, INT32_MAX);
  const int divisors[] = {1,  2,   3,   5,   7,   8,   9,   32,   36,    48,       64,
                          96, 127, 128, 129, 255, 256, 288, 1000, 65537, INT32_MAX};
  for (const int divisor : divisors) {
    const FastDivisor fast(static_cast<uint32_t>(divisor));
    for (const int x : {0, divisor - 1, divisor, INT32_MAX - 1, INT32_MAX}) {
      ASSERT_EQ(fast.quotient(x), x / divisor) << "x=" << x << " divisor=" << divisor;
    }
    for (int i = 0; i < 200000; ++i) {
      const int x = dividend(generator);
      ASSERT_EQ(fast.quotient(x), x / divisor) << "x=" << x << " divisor=" << divisor;
    }
  }
}

}  // namespace
}  // namespace deep_ep
