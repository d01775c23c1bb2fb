// Order-independent exact sums of fp32 values in two 64-bit fixed-point limbs, for the one-row mix's
// partial products (hc_mix.cu: every chunk adds its partials with integer atomics as it finishes, and the
// readers get the same bits whichever chunk came first). Host and device: the CPU unit test
// (tests/unit/test_fixed_sum.cpp) checks the arithmetic the kernel runs.
//
// A value v with |v| < 2^42 is split exactly into hi = round(v 2^20) and lo = (v - hi 2^-20) 2^76: hi has at
// most v's 24 significant bits, so hi 2^-20 is a float and the rest is v's bits below 2^-20 (|rest| <=
// 2^-21, so |lo| <= 2^55). lo is exact while v's last bit is at or above 2^-76 (|v| >= ~2^-53); below, the
// rest rounds at 2^-76. Limb A adds the hi's, limb B the lo's: n additions of values below 2^(42 - log2 n)
// keep |A| below 2^62 (fixed_limit), and |B| stays below 2^62 for n <= kFixedMaxAdditions. fixed_value
// moves B's carries into A, adds A 2^-20 + B 2^-76 in double and rounds to float: the exact sum rounded
// twice (to 53, then 24 bits), the same bits for the same limbs.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define CK_FIXED_HD __host__ __device__ __forceinline__
#else
#define CK_FIXED_HD inline
#endif

namespace ck::cuda {

struct FixedParts {
  long long hi, lo;
};

CK_FIXED_HD FixedParts fixed_split(float v) {
#if defined(__CUDA_ARCH__)
  const long long hi = __float2ll_rn(v * 0x1p20f);
  const float rest = v - __ll2float_rn(hi) * 0x1p-20f;
  return {hi, __float2ll_rn(rest * 0x1p76f)};
#else
  const long long hi = std::llrint(v * 0x1p20f);
  const float rest = v - static_cast<float>(hi) * 0x1p-20f;
  return {hi, std::llrint(rest * 0x1p76f)};
#endif
}

// Additions into one pair of limbs at most: limb B gains up to 2^55 each and stays below 2^62.
constexpr int kFixedMaxAdditions = 128;

// The bound on |v| for n additions (n <= kFixedMaxAdditions): |hi| < 2^(62 - ceil(log2 n)) each, so limb A
// stays below 2^62. A value at or above it (or not finite) is the caller's to handle.
inline float fixed_limit(int n) {
  int log2n = 0;
  while ((1 << log2n) < n) ++log2n;
  return std::ldexp(1.0f, 62 - 20 - log2n);
}

CK_FIXED_HD float fixed_value(long long A, long long B) {
  const long long carry = B >> 56;              // floor(B / 2^56)
  const long long b = B - carry * (1ll << 56);  // [0, 2^56)
  return static_cast<float>(static_cast<double>(A + carry) * 0x1p-20 + static_cast<double>(b) * 0x1p-76);
}

}  // namespace ck::cuda
