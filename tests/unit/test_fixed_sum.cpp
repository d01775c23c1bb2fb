// The one-row mix's exact sums (src/cuda/fixed_sum.h), on the CPU: the split of a float into its two
// fixed-point parts is exact, the limbs' sum does not depend on the order of the additions, and its value
// is the true sum of the floats within one float rounding (checked against a 113-bit __float128 sum, which
// holds these sums exactly).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "cuda/fixed_sum.h"

namespace {

using ck::cuda::fixed_split;
using ck::cuda::fixed_value;

// Random floats of random sign with exponents in [lo, hi] (the mix's partial products span many scales).
std::vector<float> random_floats(std::mt19937_64& rng, int n, int lo, int hi) {
  std::uniform_real_distribution<float> m(1.0f, 2.0f);
  std::uniform_int_distribution<int> e(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(m(rng), e(rng)) * (rng() & 1 ? -1.0f : 1.0f);
  return v;
}

TEST(FixedSum, SplitIsExact) {
  std::mt19937_64 rng(1);
  for (float v : random_floats(rng, 200000, -53, 41)) {
    const auto p = fixed_split(v);
    // hi 2^-20 + lo 2^-76 equals v exactly (both terms and their sum are exact in __float128).
    const __float128 back = static_cast<__float128>(p.hi) * 0x1p-20Q + static_cast<__float128>(p.lo) * 0x1p-76Q;
    ASSERT_TRUE(back == static_cast<__float128>(v)) << v;
    ASSERT_LE(std::llabs(p.lo), 1ll << 55) << v;
  }
  EXPECT_EQ(fixed_split(0.0f).hi, 0);
  EXPECT_EQ(fixed_split(-0.0f).lo, 0);
}

TEST(FixedSum, SumIsTheTrueSumRoundedWhateverTheOrder) {
  std::mt19937_64 rng(2);
  int rounded_exactly = 0, cases = 0;
  for (int n : {1, 2, 20, 80, 128}) {
    const int log2n = n <= 1 ? 0 : static_cast<int>(std::ceil(std::log2(n)));
    for (int trial = 0; trial < 400; ++trial, ++cases) {
      // Values up to the range the kernel admits for n additions (fixed_limit), down to 2^-50.
      std::vector<float> v = random_floats(rng, n, -50, 41 - log2n);
      if (trial % 4 == 0) v = random_floats(rng, n, -3, 3);  // one scale, signs cancelling
      long long A = 0, B = 0;
      __float128 exact = 0;
      for (float x : v) {
        const auto p = fixed_split(x);
        A += p.hi;
        B += p.lo;
        exact += x;
      }
      ASSERT_LT(std::llabs(A), 1ll << 62);
      ASSERT_LT(std::llabs(B), 1ll << 62);
      std::shuffle(v.begin(), v.end(), rng);
      long long A2 = 0, B2 = 0;
      for (float x : v) {
        const auto p = fixed_split(x);
        A2 += p.hi;
        B2 += p.lo;
      }
      ASSERT_EQ(A, A2);
      ASSERT_EQ(B, B2);
      const float got = fixed_value(A, B), want = static_cast<float>(exact);
      // Rounded twice (53, then 24 bits): at most one float step from the true sum rounded once.
      ASSERT_LE(std::fabs(got - want), std::fabs(std::nextafter(want, INFINITY) - want)) << "n " << n;
      rounded_exactly += got == want;
    }
  }
  EXPECT_GE(rounded_exactly, cases * 99 / 100);
}

// Negative lo sums carry into A: fixed_value takes them as the floor of B / 2^56 plus the rest.
TEST(FixedSum, CarriesOfTheLowLimb) {
  EXPECT_EQ(fixed_value(0, -(1ll << 56)), -0x1p-20f);
  EXPECT_EQ(fixed_value(1, -(1ll << 55)), 0x1p-21f);
  EXPECT_EQ(fixed_value(3 << 20, 0), 3.0f);
  EXPECT_EQ(fixed_value(-(3ll << 20), 1ll << 56), -3.0f + 0x1p-20f);
}

}  // namespace
