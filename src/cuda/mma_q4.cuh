// Tensor-core pieces shared by the 4-bit GEMV (gemv_tc4.cu, gemv_experts.cu) and the prefill experts (gemm_q4.cu):
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
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common.h"
#include "cuda/dmatrix.h"

namespace ck::cuda {

__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Part p (0 hi, 1 mid, 2 lo) of v: hi = bf16(v), mid = bf16(v - hi), lo = bf16(v - hi - mid). The
// residuals are exact in fp32, so hi + mid + lo carries v's 24 significant bits.
// All three are computed and one is selected, without branches: with a loop of p rounds, a runtime p
// (the lane's MMA column, e % 3) made the compiler unroll the loop with remainders, ~600 SASS
// instructions for the 48 fragment words of one group in the one-row mix (2026-12-01). Same bits.
// (bf16_part_pair below is its two-value form, for kernels that pack both halves of a word at once.)
__device__ __forceinline__ float bf16_part(float v, int p) {
  const float hi = __bfloat162float(__float2bfloat16_rn(v));
  const float r1 = v - hi;
  const float mid = __bfloat162float(__float2bfloat16_rn(r1));
  const float lo = __bfloat162float(__float2bfloat16_rn(r1 - mid));
  return p == 0 ? hi : p == 1 ? mid : lo;
}

// Codes i and i+4 of a 4-bit word as a bf16x2 of the exact integers: masked into the mantissa of 128
// (0x4300), then 128 subtracted (exact).
__device__ __forceinline__ uint32_t code_pair(uint32_t w, int i) {
  const uint32_t v = ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(128.0f, 128.0f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// (a & MASK) | c in one LOP3 (for two constants the compiler emits an AND and an OR).
template <uint32_t MASK>
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(c));
  return d;
}

// code_pair with the mask and the exponent in one LOP3: a pair costs a shift, a LOP3 and a
// subtraction instead of a shift, two LOP3 and a subtraction. Every 4-bit tensor-core kernel uses it:
// the one-row streamed GEMV (gemv_stream.cu, where it made the difference between no gain and +1.5%
// decode), the prefill 4-bit GEMMs (gemm_q4.cu: +5% prefill, eleventh session, once their staging
// plan and staged codes had freed registers; before that, with 128 registers taken, the constant's
// register cost more than it saved), and since the weights are in tiles (sixteenth session) the v4
// GEMVs, the one-row mix and the decode experts: decode +3.8% (539.5 against 519.4 tok/s, one call),
// their loads no longer hiding the unpacking. Same bits as code_pair. Since 2026-12-01 the one-row
// and decode kernels take code_pair_128 instead (no subtraction at all); the prefill GEMMs keep this.
__device__ __forceinline__ uint32_t code_pair_lop3(uint32_t w, int i) {
  const uint32_t m = and_or<0x000F000Fu>(w >> (4 * i), 0x43004300u);
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&m), __floats2bfloat162_rn(128.0f, 128.0f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// ---- fp16 parts (the folded prefill form's fp16 arithmetic, gemm_q4_wg.cu "fp16 form")
//
// fp16 carries 11 significant bits to bf16's 8, so two fp16 parts of x carry 22 (two bf16 parts: 16),
// but its range is narrow (normal from 2^-14, largest 65504). So the split first scales each row of x
// by a power of two, 2^e, chosen from the row's largest magnitude M (f16_row_scale: M 2^e in [2^14,
// 2^15)); the products' sums are multiplied by 2^-e afterwards (exact). Then hi = fp16(x 2^e) is
// normal for every element within 2^28 of M, and lo = fp16(x 2^e - hi) keeps its 11 bits for elements
// within 2^17 of M; below that lo goes subnormal, an absolute error under 2^-25 in the scaled units,
// 2^-39 M: far below the fp32 rounding of a sum that M enters.
// The scale 2^e for a row whose largest magnitude is m (1 for 0, a NaN or an infinity: those rows'
// sums are NaN or infinite whatever the scale). e is clamped to [-126, 126] so 2^e and 2^-e are normal.
__device__ __forceinline__ float f16_row_scale(float m) {
  if (!(m > 0.0f) || isinf(m)) return 1.0f;
  int E = 0;
  (void)frexpf(m, &E);  // m in [2^(E-1), 2^E)
  return ldexpf(1.0f, max(-126, min(126, 15 - E)));
}
// Part p (0 hi, 1 lo) of the scaled value v as fp16 bits: hi = fp16(v), lo = fp16(v - hi) (v - hi is
// exact in fp32).
__device__ __forceinline__ __half f16_part(float v, int p) {
  const __half hi = __float2half_rn(v);
  return p == 0 ? hi : __float2half_rn(v - __half2float(hi));
}
__device__ __forceinline__ uint32_t f16_pair(__half lo, __half hi) {
  const __half2 v = __halves2half2(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<const uint32_t*>(&v);
}
// Codes i and i+4 of a 4-bit word as an fp16x2 of q - 8 (exact): masked into the mantissa of 1024
// (0x6400), then 1032 subtracted. s (q - 8) has at most 11 significant bits (s 8, |q - 8| <= 8 at
// most 3), so it is exact in fp16 where the scales' range allows it (weights.h tiles16_f16_exact).
__device__ __forceinline__ uint32_t code_pair_f16m8(uint32_t w, int i) {
  const uint32_t m = and_or<0x000F000Fu>(w >> (4 * i), 0x64006400u);
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&m), __floats2half2_rn(1032.0f, 1032.0f));
  return *reinterpret_cast<const uint32_t*>(&r);
}

// Codes i and i+4 of a 4-bit word as a bf16x2 of 128 + code (exact): code_pair_lop3 without its
// subtraction, one instruction in three of the unpacking. The one-row and decode kernels (tc4_one_mma,
// gemv_tc4_kernel, the decode experts) take it and fold the 128 into the group's bias term:
// s Σ (128 + q) x + (b - 128 s) Σ x = s Σ q x + b Σ x. b - 128 s is exact in fp32 (two bf16 values a
// few binades apart). The price is precision: the MMA sums terms ~17x larger than Σ q x before the
// bias term cancels them, so these kernels' results move ~5x further from the prefill kernels' than
// before (tests/parity/test_cuda_model.cpp kSelfTol), still far inside the tolerance against the
// oracle (1e-4). Decode +1.6% at one row (docs/performance.md, 2026-12-01).
__device__ __forceinline__ uint32_t code_pair_128(uint32_t w, int i) {
  return and_or<0x000F000Fu>(w >> (4 * i), 0x43004300u);
}
// The bias that goes with code_pair_128's products: b - 128 s.
__device__ __forceinline__ float bias_128(float b, float s) { return fmaf(-128.0f, s, b); }

// A scale or bias of a 4-bit matrix from the aligned 4-byte word that holds it: the prefill GEMMs
// (gemm_q4.cu, gemm_q4_wg.cu) stage those words with cp.async whatever the element's alignment.
// Which half holds a 2-byte one is the parity of its element index (scales and biases start 4-byte
// aligned: gemm_q4 checks the dense jobs; expert records are 256-byte aligned, cuda/dmatrix.h
// expert_layout). One byte permutation places the value: bf16 into the high half (zeros below), f16
// into the low half, f32 as it is.
struct StagedScales {
  bool f16s;
  uint32_t sel_lo, sel_hi;
  __device__ explicit StagedScales(uint8_t kind)
      : f16s(kind == static_cast<uint8_t>(WKind::F16)),
        sel_lo(kind == static_cast<uint8_t>(WKind::F32) ? 0x3210u : f16s ? 0x4410u : 0x1044u),
        sel_hi(kind == static_cast<uint8_t>(WKind::F32) ? 0x3210u : f16s ? 0x4432u : 0x3244u) {}
  // The byte selector for an element of index parity `par`.
  __device__ uint32_t sel(int par) const { return par ? sel_hi : sel_lo; }
  __device__ float value(uint32_t word, uint32_t selector) const {
    const uint32_t v = __byte_perm(word, 0u, selector);
    return f16s ? f16_bits_to_float(static_cast<uint16_t>(v)) : __uint_as_float(v);
  }
};

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

// One 64-code group of a 16-row tile (lane (g, t) holds rows g and g + 8's code words wa, wb) against NB
// n8 blocks of B fragments of 1-8 activation rows: d[nb] = Σ (128 + q) x (code_pair_128's products,
// fresh per group), the fragment of MMA step s and block nb from load_b(s, nb). Then
// tc4_group_accumulate adds the group into acc (2-8 rows; gemv_tc4_kernel's one-row form adds its
// single column itself). Used by gemv_tc4_kernel and gemv_stream_rows_kernel.
template <int NB, class LoadB>
__device__ __forceinline__ void tc4_group_mma(uint2 wa, uint2 wb, const LoadB& load_b, float (&d)[NB][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t xa = (s >> 1) ? wa.y : wa.x, xb = (s >> 1) ? wb.y : wb.x;
    const int i0 = 2 * (s & 1);
    const uint32_t a0 = code_pair_128(xa, i0), a1 = code_pair_128(xb, i0), a2 = code_pair_128(xa, i0 + 1),
                   a3 = code_pair_128(xb, i0 + 1);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint2 b = load_b(s, nb);
      mma_bf16(d[nb], a0, a1, a2, a3, b.x, b.y);
    }
  }
}

// The same for 8-bit codes: lane (g, t) holds the 16 code bytes of rows g and g + 8 in wa, wb (lane
// t's bytes of a row are columns 16t + 4k + i: word k, byte i). Step s's pair A (columns c, c + 4;
// c = 16t + 8(s>>1) + 2(s&1), the columns tc4_group_mma's step s takes, so the B fragments are the
// same) is byte 2(s&1) of words 2(s>>1) and 2(s>>1) + 1, pair B the next byte. A code q = 16 qh + ql:
// its nibbles are exact bf16 operands, so two MMAs (ql and qh) per step and block, and d = Σ ql x +
// 16 Σ qh x = Σ q x: plain codes (tc4_group_accumulate<NB, false>). gemv_tc4_one_kernel's 8-bit form
// (NB = 1) and gemv_tc4_kernel's at 2-8 rows.
template <int NB, class LoadB>
__device__ __forceinline__ void tc8_group_mma(const uint4& wa, const uint4& wb, const LoadB& load_b, float (&d)[NB][4]) {
  float dh[NB][4] = {};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t la = (s >> 1) ? wa.z : wa.x, ha = (s >> 1) ? wa.w : wa.y;
    const uint32_t lb = (s >> 1) ? wb.z : wb.x, hb = (s >> 1) ? wb.w : wb.y;
    const uint32_t b0 = 2 * (s & 1), b1 = b0 + 1;
    const uint32_t sel0 = b0 | (b0 << 4) | ((4 + b0) << 8) | ((4 + b0) << 12);
    const uint32_t sel1 = b1 | (b1 << 4) | ((4 + b1) << 8) | ((4 + b1) << 12);
    const uint32_t pa0 = __byte_perm(la, ha, sel0), pa1 = __byte_perm(la, ha, sel1);
    const uint32_t pb0 = __byte_perm(lb, hb, sel0), pb1 = __byte_perm(lb, hb, sel1);
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      const uint2 bf = load_b(s, nb);
      mma_bf16(d[nb], code_pair(pa0, 0), code_pair(pb0, 0), code_pair(pa1, 0), code_pair(pb1, 0), bf.x, bf.y);
      mma_bf16(dh[nb], code_pair(pa0, 1), code_pair(pb0, 1), code_pair(pa1, 1), code_pair(pb1, 1), bf.x, bf.y);
    }
  }
#pragma unroll
  for (int nb = 0; nb < NB; ++nb)
#pragma unroll
    for (int k = 0; k < 4; ++k) d[nb][k] = fmaf(16.0f, dh[nb][k], d[nb][k]);
}

// acc += the group's products d scaled by rows g, g + 8's scales (sa, sb), plus their biases (ba, bb,
// as stored: with CODES_128 the 128 of the codes is folded in here) times the group sums of columns 2t
// and 2t + 1 of each block, gsum(nb, c) for c = 0, 1.
template <int NB, bool CODES_128 = true, class GroupSum>
__device__ __forceinline__ void tc4_group_accumulate(const float (&d)[NB][4], float sa, float ba, float sb, float bb,
                                                     const GroupSum& gsum, float (&acc)[NB][4]) {
  if constexpr (CODES_128) {
    ba = bias_128(ba, sa);  // the codes are 128 + q (code_pair_128)
    bb = bias_128(bb, sb);
  }
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    const float x0 = gsum(nb, 0), x1 = gsum(nb, 1);
    acc[nb][0] = fmaf(sa, d[nb][0], fmaf(ba, x0, acc[nb][0]));
    acc[nb][1] = fmaf(sa, d[nb][1], fmaf(ba, x1, acc[nb][1]));
    acc[nb][2] = fmaf(sb, d[nb][2], fmaf(bb, x0, acc[nb][2]));
    acc[nb][3] = fmaf(sb, d[nb][3], fmaf(bb, x1, acc[nb][3]));
  }
}

// Element e (= (step * NB + column block) * 32 + lane) of a group's B fragments for nx activation rows:
// MMA column n = 3r + p carries part p (hi, mid, lo) of row r, the other columns zeros. xg is the
// group's 64 floats of row 0, rows ldx apart. tc4_frag_kernel stores these; kernels that make the
// fragments of their own output (hc_gate_mean) call it too, so both round alike.
// In two halves (tc4_frag_src, tc4_frag_pack) for callers that issue several elements' loads before
// converting any: where element e's floats start (xr[0], xr[4], xr[1], xr[5] are its four; nullptr for
// a column past the rows, all zeros) and its part p; then the packing.
template <int NB>
__device__ __forceinline__ const float* tc4_frag_src(const float* xg, int ldx, int nx, int e, int& p) {
  const int lane = e & 31, nb = (e >> 5) % NB, s = e / (32 * NB);
  const int t = lane >> 3, n = nb * 8 + (lane & 7), r = n / 3;
  p = n % 3;
  if (r >= nx) return nullptr;
  return xg + static_cast<size_t>(r) * ldx + (2 * t + (s >> 1)) * 8 + 2 * (s & 1);
}
__device__ __forceinline__ uint2 tc4_frag_pack(float x0, float x4, float x1, float x5, int p) {
  return make_uint2(bf16_pair(bf16_part(x0, p), bf16_part(x4, p)), bf16_pair(bf16_part(x1, p), bf16_part(x5, p)));
}
template <int NB>
__device__ __forceinline__ uint2 tc4_frag_elem(const float* xg, int ldx, int nx, int e) {
  int p;
  const float* xr = tc4_frag_src<NB>(xg, ldx, nx, e, p);
  return xr ? tc4_frag_pack(xr[0], xr[4], xr[1], xr[5], p) : make_uint2(0u, 0u);
}

// One activation row's B fragments in global memory, compact (cuda/ops.h Tc4Frags, kOneFragWords in
// cuda/dmatrix.h): of the MMA's 8 columns only 0-2 (hi, mid, lo) are non-zero, so only they are
// stored: per group 4 steps x 12 words, step s's word for lane (g < 3, t) at [s][3t + g] (384 bytes a
// group, where tc4_frag_elem<1>'s full layout takes 1,024 and 5/8 of them zeros). The lanes of
// columns 3-7 load copies of column 0-2 words (tc4_one_frag_ld): those columns' products are never
// read (the one-row kernels take columns 0-2 of d only), and an unpredicated load of the same lines
// costs no select.
// Why: at one row the fragments' loads were more L1 lines per group than the weights' tiles (the
// weight-layout lab, 2026-11-30 22:51Z: 11.2 -> 10.0 us on an in_proj-sized GEMV, as fast as no loads
// at all). In the engine the gain did not show alone (decode within 1% of the full layout, 2026-12-01
// 00:06Z-00:13Z); with code_pair_128 it keeps the 4-row step level, where code_pair_128 without it
// lost 1.4% (00:19Z: the decode experts read one such vector per pair).
// Word e (< kOneFragWords) of a group's compact fragments, xg its 64 floats: tc4_frag_elem<1>'s word
// for the same step, lane and column, the same bits.
__device__ __forceinline__ uint2 tc4_one_frag_elem(const float* xg, int e) {
  const int s = e / 12, t = (e % 12) / 3, p = e % 3;
  const float* xr = xg + (2 * t + (s >> 1)) * 8 + 2 * (s & 1);
  return make_uint2(bf16_pair(bf16_part(xr[0], p), bf16_part(xr[4], p)),
                    bf16_pair(bf16_part(xr[1], p), bf16_part(xr[5], p)));
}
// Step s's B fragment of lane (g, t) from a group's compact fragments fg (the group's base plus
// tc4_one_frag_lane). Columns 3-7 (g >= 3) get column 0's word: their products are not used.
__device__ __forceinline__ uint2 tc4_one_frag_ld(const uint2* __restrict__ fg, int s) {
  return __ldg(fg + 12 * s);
}
// The lane's offset inside a group's compact fragments.
__device__ __forceinline__ int tc4_one_frag_lane(int g, int t) { return 3 * t + (g < 3 ? g : 0); }
// Group G's 4 steps of compact fragments into b, from a vector's fragments fv (plus tc4_one_frag_lane)
// and group sums gv; returns the group's Σ x on lanes t == 0, zero on the others (tc4_one_mma's xs).
__device__ __forceinline__ float tc4_one_frags_group(const uint2* __restrict__ fv, const float* __restrict__ gv, int G,
                                                     int t, uint2 (&b)[4]) {
  const float xs = t == 0 ? __ldg(gv + G) : 0.0f;
#pragma unroll
  for (int s = 0; s < 4; ++s) b[s] = tc4_one_frag_ld(fv + static_cast<size_t>(G) * kOneFragWords, s);
  return xs;
}

// Σ x of a group's 64 floats (the bias term's factor), in the one order every v4 path uses: lane l
// adds x[l] + x[l + 32], then the warp's butterfly. Every lane of the warp calls it.
__device__ __forceinline__ float tc4_group_sum(const float* xg) {
  const int lane = threadIdx.x & 31;
  return warp_sum(xg[lane] + xg[lane + 32]);
}

// Group g's R-row fragments (4 NB 32 words at frag) and its Σ x per MMA column (8 NB floats at gsum,
// on each row's hi column, zero on the others) from the group's 64 floats of nx rows at xg, rows ldx
// apart, by the block's threads: what tc4_frag_kernel<R> writes, and the kernels that hand their own
// output on as fragments (the 2-8-row gate mean, gemv_tc4_reduce_frag_kernel) write the same way.
template <int NB>
__device__ __forceinline__ void tc4_rows_group_frags(const float* xg, int ldx, int nx, uint2* frag, float* gsum) {
  constexpr int NC = 8 * NB;
  for (int e = threadIdx.x; e < 4 * NB * 32; e += blockDim.x) frag[e] = tc4_frag_elem<NB>(xg, ldx, nx, e);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int n = warp; n < NC; n += blockDim.x >> 5) {
    const int r = n / 3;
    float v = 0.0f;
    if (n % 3 == 0 && r < nx) v = tc4_group_sum(xg + static_cast<size_t>(r) * ldx);  // on the hi column
    if (lane == 0) gsum[n] = v;
  }
}

__device__ __forceinline__ float load_scale_elem(const uint8_t* base, size_t i, uint8_t kind) {
  if (kind == static_cast<uint8_t>(WKind::F32)) return reinterpret_cast<const float*>(base)[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(base)[i];
  return kind == static_cast<uint8_t>(WKind::BF16) ? bf16_bits_to_float(h) : f16_bits_to_float(h);
}

// The scale and bias of rows g and g + 8 from a Tiles16 word pair (dmatrix.h: bf16 scale, bias of
// row g in w.x, of row g + 8 in w.y; a bf16 is the high half of its fp32).
__device__ __forceinline__ void tile_scales(uint2 w, float& sa, float& ba, float& sb, float& bb) {
  sa = __uint_as_float(w.x << 16);
  ba = __uint_as_float(w.x & 0xFFFF0000u);
  sb = __uint_as_float(w.y << 16);
  bb = __uint_as_float(w.y & 0xFFFF0000u);
}

// A lane's words of one Tiles16 (tile, group) block: its 16 code bytes c (row g's 8, then row g + 8's)
// and its scale word pair sw, as the v4 arithmetic takes them.
__device__ __forceinline__ void tile_words(const uint4& c, uint2 sw, uint2& wa, uint2& wb, float& sa, float& ba,
                                           float& sb, float& bb) {
  wa = make_uint2(c.x, c.y);
  wb = make_uint2(c.z, c.w);
  tile_scales(sw, sa, ba, sb, bb);
}

// Lane (g, t)'s words of one Tiles16 (tile, group) block `tg` in shared memory, as Tc4Rows::load gives
// them from global (the kernels that bulk-copy whole tiles: gemv_experts.cu expert_*_bulk_kernel).
__device__ __forceinline__ void tile_group_lds(const uint8_t* tg, int lane, uint2& wa, uint2& wb, float& sa, float& ba,
                                               float& sb, float& bb) {
  tile_words(*reinterpret_cast<const uint4*>(tg + 16 * lane), *reinterpret_cast<const uint2*>(tg + 512 + 8 * (lane >> 2)),
             wa, wb, sa, ba, sb, bb);
}

// Rows g and g+8 of a 16-row tile of a 4-bit matrix as the v4 kernels read them per 64-code group:
// the lane's 8 code bytes of each row, and each row's scale and bias (a scale group spans 2^gshift
// 64-code groups; the launches check the group is 64 times a power of two). BF16S: bf16 scales (the
// checkpoints' form) are read without the per-load kind switch. In the row layout this is 2 code
// loads and 4 scale loads per group over ~48 cache lines a warp; a Tiles16 matrix (dmatrix.h) gives
// the same values in one 16-byte and one 8-byte load per lane (the branch is warp-uniform: a tile
// belongs to one matrix).
// TILES: an instance for a matrix known to be in tiles (load() has one path and no branch); false:
// the warp's matrix decides, per group.
template <bool BF16S, int BITS = 4, bool TILES = false>
struct Tc4Rows {
  static constexpr int kGroupBytes = 8 * BITS;  // one row's 64 codes
  const uint8_t* pa;
  const uint8_t* pb;
  const uint8_t* scales;
  const uint8_t* biases;
  uint32_t sa0, sb0;  // element index of group 0's scale and bias for each row
  int gshift;
  uint8_t sk;
  bool tiled;         // Tiles16: pa is the lane's 16 bytes of group 0, pb its scale word pair's
  __device__ __forceinline__ void init(const DMatrix& w, int ra, int rb, int t) {
    const size_t row_bytes = static_cast<size_t>(w.cols) * BITS / 8;
    const uint32_t n_groups = static_cast<uint32_t>(w.cols / w.fmt.group);
    tiled = BITS == 4 && w.tiled();
    if (tiled) {  // ra = 16 T + g (rb = ra + 8: the same tile)
      const uint8_t* tile = w.data + static_cast<size_t>(ra >> 4) * n_groups * kTileGroupBytes;
      pa = tile + 16 * (4 * (ra & 7) + t);
      pb = tile + 512 + 8 * (ra & 7);
      return;
    }
    pa = w.data + ra * row_bytes + 2 * BITS * t;  // lane t's 16 codes: 8 bytes at 4 bits, 16 at 8
    pb = w.data + rb * row_bytes + 2 * BITS * t;
    scales = w.scales;
    biases = w.biases;
    sa0 = static_cast<uint32_t>(ra) * n_groups;
    sb0 = static_cast<uint32_t>(rb) * n_groups;
    gshift = __ffs(w.fmt.group / 64) - 1;
    sk = w.fmt.scale_kind;
  }
  // Asks L2 for groups [G0, G1) of both rows' codes and the lines of their scales and biases (lanes
  // t == 0; Tiles16: the warp's one contiguous range, by lane 0). For a kernel's prologue before
  // pdl_begin(): weights never change, so this overlaps the kernel before (docs/roofline-cuda.md,
  // "Fifth session").
  __device__ __forceinline__ void prefetch(int G0, int G1, int t) const {
    if (t != 0 || G1 <= G0) return;
    if (tiled) {
      if ((threadIdx.x & 31) == 0) {
        const uint8_t* at = pa + static_cast<size_t>(G0) * kTileGroupBytes;  // lane 0's bytes start the tile
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at), "r"((G1 - G0) * kTileGroupBytes) : "memory");
      }
      return;
    }
    const uint32_t bytes = static_cast<uint32_t>(G1 - G0) * kGroupBytes;
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pa + G0 * kGroupBytes), "r"(bytes) : "memory");
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(pb + G0 * kGroupBytes), "r"(bytes) : "memory");
    const uint32_t es = sk == static_cast<uint8_t>(WKind::F32) ? 4 : 2, sg = static_cast<uint32_t>(G0) >> gshift;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(scales + (sa0 + sg) * es) : "memory");
    asm volatile("prefetch.global.L2 [%0];" ::"l"(biases + (sa0 + sg) * es) : "memory");
    asm volatile("prefetch.global.L2 [%0];" ::"l"(scales + (sb0 + sg) * es) : "memory");
    asm volatile("prefetch.global.L2 [%0];" ::"l"(biases + (sb0 + sg) * es) : "memory");
  }
  __device__ __forceinline__ float elem(const uint8_t* base, uint32_t i) const {
    if constexpr (BF16S) return bf16_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(base) + i));
    else return load_scale_elem(base, i, sk);
  }
  __device__ __forceinline__ void scales_of(int G, float& sa, float& ba, float& sb, float& bb) const {
    const uint32_t sg = static_cast<uint32_t>(G) >> gshift;
    sa = elem(scales, sa0 + sg);
    ba = elem(biases, sa0 + sg);
    sb = elem(scales, sb0 + sg);
    bb = elem(biases, sb0 + sg);
  }
  // Without TILES the branch on `tiled` sits in every group of a kernel's loop, and the compiler
  // does not move the next unrolled groups' loads above it (the SASS issues a group's loads after
  // the MMAs of the group before); the TILES instance has no branch.
  __device__ __forceinline__ void load(int G, uint2& wa, uint2& wb, float& sa, float& ba, float& sb, float& bb) const {
    static_assert(BITS == 4, "4-bit codes");
    if (TILES || tiled) {
      tile_words(__ldg(reinterpret_cast<const uint4*>(pa + static_cast<size_t>(G) * kTileGroupBytes)),
                 __ldg(reinterpret_cast<const uint2*>(pb + static_cast<size_t>(G) * kTileGroupBytes)), wa, wb, sa, ba, sb,
                 bb);
      return;
    }
    wa = __ldg(reinterpret_cast<const uint2*>(pa + G * kGroupBytes));
    wb = __ldg(reinterpret_cast<const uint2*>(pb + G * kGroupBytes));
    scales_of(G, sa, ba, sb, bb);
  }
  __device__ __forceinline__ void load(int G, uint4& wa, uint4& wb, float& sa, float& ba, float& sb, float& bb) const {
    static_assert(BITS == 8, "8-bit codes");
    wa = __ldg(reinterpret_cast<const uint4*>(pa + G * kGroupBytes));
    wb = __ldg(reinterpret_cast<const uint4*>(pb + G * kGroupBytes));
    scales_of(G, sa, ba, sb, bb);
  }
};

// Part p (0 hi, 1 mid, 2 lo; see bf16_part) of a and b as one bf16x2, without branches: lanes of one
// warp ask for different parts.
__device__ __forceinline__ uint32_t bf16_part_pair(float a, float b, int p) {
  const __nv_bfloat162 hi = __floats2bfloat162_rn(a, b);
  const float2 hf = __bfloat1622float2(hi);
  const float a1 = a - hf.x, b1 = b - hf.y;
  const __nv_bfloat162 mid = __floats2bfloat162_rn(a1, b1);
  const float2 mf = __bfloat1622float2(mid);
  const __nv_bfloat162 lo = __floats2bfloat162_rn(a1 - mf.x, b1 - mf.y);
  const __nv_bfloat162 r = p == 0 ? hi : p == 1 ? mid : lo;
  return *reinterpret_cast<const uint32_t*>(&r);
}

// One activation row's B fragments of one 64-code group, as the kernels that build them in shared
// memory lay them out (gemv_tc4_one_kernel, hc_mix_row_kernel): lane (g, t) holds x[16t, 16t + 16)
// of the group in q; lanes g = 0, 1, 2 store the hi, mid and lo parts (MMA columns 0-2), the other
// lanes zero columns; step s of the group at f[32 s + lane]. Step s's pairs: A = (x[c], x[c+4]),
// B = (x[c+1], x[c+5]) at c = 16t + {0, 2, 8, 10}. Returns Σ x of the group on every lane (the
// lane's 16 in one fixed order, then over t): the bias term's factor.
// NR = 2 (gemv_tc4_rows_kernel): two rows, row 1's parts in MMA columns 3-5 (lanes g = 3-5 hold row 1's
// x in q), columns 6-7 zero; each lane's Σ x is its row's, in the same order.
template <int NR = 1>
__device__ __forceinline__ float tc4_one_frag(const float4 (&q)[4], uint2* f) {
  static_assert(NR == 1 || NR == 2, "one or two rows");
  const int lane = threadIdx.x & 31, g = lane >> 2;
  // The x part this lane's MMA column carries (hi, mid, lo), and whether the column is a row's at all.
  const int p = NR == 1 ? (g < 3 ? g : 0) : (g < 6 ? g % 3 : 0);
  const uint32_t keep = g < 3 * NR ? ~0u : 0u;
  float gs = ((q[0].x + q[0].y) + (q[0].z + q[0].w)) + ((q[1].x + q[1].y) + (q[1].z + q[1].w)) +
             (((q[2].x + q[2].y) + (q[2].z + q[2].w)) + ((q[3].x + q[3].y) + (q[3].z + q[3].w)));
  gs += __shfl_xor_sync(0xffffffffu, gs, 1);
  gs += __shfl_xor_sync(0xffffffffu, gs, 2);
  f += lane;
  f[0] = make_uint2(bf16_part_pair(q[0].x, q[1].x, p) & keep, bf16_part_pair(q[0].y, q[1].y, p) & keep);
  f[32] = make_uint2(bf16_part_pair(q[0].z, q[1].z, p) & keep, bf16_part_pair(q[0].w, q[1].w, p) & keep);
  f[64] = make_uint2(bf16_part_pair(q[2].x, q[3].x, p) & keep, bf16_part_pair(q[2].y, q[3].y, p) & keep);
  f[96] = make_uint2(bf16_part_pair(q[2].z, q[3].z, p) & keep, bf16_part_pair(q[2].w, q[3].w, p) & keep);
  return gs;
}

// Groups [G0, G1) of one activation row x as B fragments in shared memory (tc4_one_frag's layout:
// group G at sfrag + (G - G0) * 128) and their sums at sgs[G - G0]; warp w of the block's W takes
// groups G0 + w, G0 + w + W, ..., BATCH of them at a time with all their loads of x issued before the
// first conversion. The caller syncs the block before reading them.
// Why BATCH: the fragments are built after the kernel's wait for x, before its first product, so
// each further group a warp took one at a time was one more L2 round trip on the step's critical path
// (at one row: 2 for most GEMVs' blocks, 3 in the streamed LM head's).
// one_row_frags_in_warps: the same by W warps of the block (warp: the caller's index among them), for
// kernels whose warps are split into parts with different work; L2_ONLY: x read through L2 only
// (ld.global.cg), for an x that other blocks of the same kernel wrote (L1 is not coherent).
// NR = 2: two rows (row 1 at x + ldx) in tc4_one_frag<2>'s layout, row r's sums at sgs[2 (G - G0) + r].
template <int BATCH, bool L2_ONLY = false, int NR = 1>
__device__ __forceinline__ void one_row_frags_in_warps(const float* x, int G0, int G1, uint2* sfrag, float* sgs,
                                                       int warp, int W, int ldx = 0) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  if constexpr (NR == 2) {
    const int g = lane >> 2;
    x += g >= 3 && g < 6 ? ldx : 0;  // lanes g = 3-5 carry row 1
  }
  for (int Gs = G0 + warp; Gs < G1; Gs += BATCH * W) {
    // Past the range a batch's member is group Gs again (the same words and sum stored twice): no
    // branch between the loads and their uses, which kept the compiler from issuing them together.
    int G[BATCH];
    float4 q[BATCH][4];
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      G[b] = Gs + b * W < G1 ? Gs + b * W : Gs;
      const float4* xp = reinterpret_cast<const float4*>(x + 64 * G[b] + 16 * t);
#pragma unroll
      for (int i = 0; i < 4; ++i) q[b][i] = L2_ONLY ? __ldcg(xp + i) : __ldg(xp + i);
    }
#pragma unroll
    for (int b = 0; b < BATCH; ++b) {
      const float gs = tc4_one_frag<NR>(q[b], sfrag + static_cast<size_t>(G[b] - G0) * 128);
      if (lane == 0) sgs[NR * (G[b] - G0)] = gs;
      if (NR == 2 && lane == 12) sgs[NR * (G[b] - G0) + 1] = gs;  // (g = 3: row 1)
    }
  }
}
template <int BATCH, int NR = 1>
__device__ __forceinline__ void one_row_frags_in_block(const float* x, int G0, int G1, uint2* sfrag, float* sgs,
                                                       int ldx = 0) {
  one_row_frags_in_warps<BATCH, false, NR>(x, G0, G1, sfrag, sgs, threadIdx.x >> 5, blockDim.x >> 5, ldx);
}

// The group's Σ (128 + q) x of a one-row tile's rows g and g + 8 (d[0..1], d[2..3]; columns 2t, 2t + 1),
// fresh per group, from its codes and 4 steps of B fragments bf.
__device__ __forceinline__ void tc4_group_d(const uint2& wa, const uint2& wb, const uint2 (&bf)[4], float (&d)[4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t xa = (s >> 1) ? wa.y : wa.x, xb = (s >> 1) ? wb.y : wb.x;
    const int i0 = 2 * (s & 1);
    mma_bf16(d, code_pair_128(xa, i0), code_pair_128(xb, i0), code_pair_128(xa, i0 + 1), code_pair_128(xb, i0 + 1),
             bf[s].x, bf[s].y);
  }
}

// One 64-code group of a one-row tile, its codes and scales already loaded (Tc4Rows::load or
// tile_group_lds), against the group's 4 steps of B fragments bf (xs: the group's Σ x on lanes t == 0,
// zero on the others): acc += s Σ q x + b Σ x for rows g (acc[0..1]) and g + 8 (acc[2..3]), columns 2t
// and 2t + 1, the 128 of code_pair_128 folded into the bias.
__device__ __forceinline__ void tc4_one_mma_regs(const uint2& wa, const uint2& wb, float sa, float ba, float sb,
                                                 float bb, const uint2 (&bf)[4], float xs, float (&acc)[4]) {
  float d[4] = {};
  tc4_group_d(wa, wb, bf, d);
  acc[0] = fmaf(sa, d[0], fmaf(bias_128(ba, sa), xs, acc[0]));
  acc[1] = fmaf(sa, d[1], acc[1]);
  acc[2] = fmaf(sb, d[2], fmaf(bias_128(bb, sb), xs, acc[2]));
  acc[3] = fmaf(sb, d[3], acc[3]);
}
// tc4_one_mma_regs with the fragments tc4_one_frag laid out in shared memory (f: the group's base
// plus the lane).
__device__ __forceinline__ void tc4_one_mma(const uint2& wa, const uint2& wb, float sa, float ba, float sb, float bb,
                                            const uint2* f, float xs, float (&acc)[4]) {
  const uint2 bf[4] = {f[0], f[32], f[64], f[96]};
  tc4_one_mma_regs(wa, wb, sa, ba, sb, bb, bf, xs, acc);
}

// tc4_one_mma with the group's loads.
template <bool BF16S, bool TILES>
__device__ __forceinline__ void tc4_one_group(const Tc4Rows<BF16S, 4, TILES>& tr, int G, const uint2* f, float xs,
                                              float (&acc)[4]) {
  float sa, ba, sb, bb;
  uint2 wa, wb;
  tr.load(G, wa, wb, sa, ba, sb, bb);
  tc4_one_mma(wa, wb, sa, ba, sb, bb, f, xs, acc);
}

}  // namespace ck::cuda
