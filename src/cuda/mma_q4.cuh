// Tensor-core pieces shared by the 4-bit GEMV (gemv.cu, v4) and the prefill experts (gemm_q4.cu):
// MLX 4-bit codes are small integers, exact in bf16, so they can be an MMA operand as they are, with
// the group's scale and bias applied after the product (s * Σ q x + b * Σ x). The fp32 activations
// are split into three bf16 parts (hi + mid + lo carry fp32's 24 bits), each multiplied exactly.
//
// The K order inside one 64-code group (both files use it; A and B only need the same permutation):
// lane (g = lane/4, t = lane%4) holds 8 bytes of a weight row per group, words 2t and 2t+1 (16
// codes). code_pair(w, i) gives codes i and i+4 of a word as one bf16x2. k16 step s of the group takes
// pairs 2(s&1) ("pair A", the fragment's k = 2t, 2t+1) and 2(s&1)+1 ("pair B", k = 2t+8, 2t+9) of
// word s/2, so the activations of step s for lane t are, at physical column c = 64G + (2t + s/2)*8 +
// 2(s&1): pair A = (x[c], x[c+4]), pair B = (x[c+1], x[c+5]).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "cuda/common.h"

namespace ck::cuda {

__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Part p (0 hi, 1 mid, 2 lo) of v: hi = bf16(v), mid = bf16(v - hi), lo = bf16(v - hi - mid). The
// residuals are exact in fp32, so hi + mid + lo carries v's 24 significant bits.
__device__ __forceinline__ float bf16_part(float v, int p) {
  float r = v;
  for (int i = 0; i < p; ++i) r -= __bfloat162float(__float2bfloat16_rn(r));
  return __bfloat162float(__float2bfloat16_rn(r));
}

// Codes i and i+4 of a 4-bit word as a bf16x2 of the exact integers: masked into the mantissa of 128
// (0x4300), then 128 subtracted (exact).
__device__ __forceinline__ uint32_t code_pair(uint32_t w, int i) {
  const uint32_t v = ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(128.0f, 128.0f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// d += a * b, m16n8k16, bf16 in, fp32 accumulate. Fragments (PTX ISA, g = lane/4, t = lane%4):
// a0 (row g, k 2t..2t+1), a1 (row g+8, same k), a2 (row g, k 2t+8..9), a3 (row g+8, k 2t+8..9);
// b0 (k 2t..2t+1, col g), b1 (k 2t+8..9, col g); d0/d1 (row g, cols 2t, 2t+1), d2/d3 (row g+8).
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Element e (= (step * NB + column block) * 32 + lane) of a group's B fragments for nx activation rows:
// MMA column n = 3r + p carries part p (hi, mid, lo) of row r, the other columns zeros. xg is the
// group's 64 floats of row 0, rows ldx apart. tc4_frag_kernel stores these; kernels that make the
// fragments of their own output (hc_gate_mean) call it too, so both round alike.
template <int NB>
__device__ __forceinline__ uint2 tc4_frag_elem(const float* xg, int ldx, int nx, int e) {
  const int lane = e & 31, nb = (e >> 5) % NB, s = e / (32 * NB);
  const int t = lane >> 3, n = nb * 8 + (lane & 7), r = n / 3, p = n % 3;
  if (r >= nx) return make_uint2(0u, 0u);
  const float* xr = xg + static_cast<size_t>(r) * ldx + (2 * t + (s >> 1)) * 8 + 2 * (s & 1);
  return make_uint2(bf16_pair(bf16_part(xr[0], p), bf16_part(xr[4], p)),
                    bf16_pair(bf16_part(xr[1], p), bf16_part(xr[5], p)));
}

// Σ x of a group's 64 floats (the bias term's factor), in the one order every v4 path uses: lane l
// adds x[l] + x[l + 32], then the warp's butterfly. Every lane of the warp calls it.
__device__ __forceinline__ float tc4_group_sum(const float* xg) {
  const int lane = threadIdx.x & 31;
  return warp_sum(xg[lane] + xg[lane + 32]);
}

}  // namespace ck::cuda
