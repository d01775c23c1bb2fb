// Hopper's warpgroup MMAs (wgmma, sm_90a) as the prefill kernels use them: descriptors, fences, the
// m64nNk16 shapes with A from registers, the folded form's A fragments, and the register and barrier
// helpers that keep the wgmmas asynchronous. Shared by gemm_q4_wg.cu and gemm_q4_wg_gate_mean.cu (both
// built for sm_90a only: CMakeLists.txt).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/mma_q4.cuh"

namespace ck::cuda {

constexpr uint32_t kWgLbo = 128, kWgSbo = 256;  // bytes: k-half to k-half, 8-token block to the next

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading and
// stride byte offsets, each >> 4; no swizzle.
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// Shared memory written by this thread's generic-proxy stores (cp.async) becomes visible to wgmma.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d (+)= A B for one m64n32k16: A from registers (mma.m16n8k16's A fragment of this warp's 16 rows),
// B by descriptor. scale_d == 0: d = A B.
__device__ __forceinline__ void wg_mma(float (&d)[16], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, "
      "p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}
// The m64n64k16 wgmma for bf16 (wg_mma) or fp16 (wg_mma_f16: the gate mean's persistent form, 64 tokens
// a tile) operands: one asm statement, TYPE the operands' type in its mnemonic.
#define CK_WG_MMA_M64N64(TYPE)                                                                                      \
  asm volatile(                                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                                 \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "                                             \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "  \
      "%23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"                  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),     \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),    \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])                  \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d))
__device__ __forceinline__ void wg_mma(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  CK_WG_MMA_M64N64("bf16");
}
__device__ __forceinline__ void wg_mma_f16(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  CK_WG_MMA_M64N64("f16");
}
#undef CK_WG_MMA_M64N64
// The m64n128k16 wgmma for bf16 (wg_mma) or fp16 (wg_mma_f16, the folded form's fp16 arithmetic)
// operands: one asm statement, TYPE the operands' type in its mnemonic.
#define CK_WG_MMA_M64N128(TYPE)                                                                                     \
  asm volatile(                                                                                                    \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                                 \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " "                                            \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "       \
      "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "        \
      "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "        \
      "%62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"                                                      \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),     \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),    \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),    \
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),    \
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),    \
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),    \
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])                  \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d))
__device__ __forceinline__ void wg_mma(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  CK_WG_MMA_M64N128("bf16");
}
__device__ __forceinline__ void wg_mma_f16(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  CK_WG_MMA_M64N128("f16");
}
#undef CK_WG_MMA_M64N128

// The group's 4 steps x MF tiles x PARTS wgmmas into d (the first of each tile overwrites it); B of
// (step s, part p) at xb + (s PARTS + p) b_bytes.
template <int PARTS, int MF, int ND>
__device__ __forceinline__ void wg_issue(uint32_t xb, uint32_t b_bytes, const uint32_t (&af)[4][MF][4],
                                         float (&d)[MF][ND]) {
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int mf = 0; mf < MF; ++mf)
#pragma unroll
      for (int p = PARTS - 1; p >= 0; --p)  // small parts first
        wg_mma(d[mf], af[s][mf], wg_desc(xb + (s * PARTS + p) * b_bytes, kWgLbo, kWgSbo), s > 0 || p < PARTS - 1);
}

// ---- The folded form (q4_wg_bulk_kernel<2, 128, true>): the scale in the A operand
//
// One m64 tile's A fragments for a group's 4 k16 steps as the two bf16 parts of s q: hi = bf16(s q)
// and lo = s q - hi, from the codes (code_pair_lop3, rows g and g + 8 as in wg_a_frags) and the rows'
// bf16 scales (the low halves of the tile's scale words sw.x, row g, and sw.y, row g + 8). Exact: s has
// 8 significant bits and q at most 4, so s q has at most 12 and its remainder after hi at most 4, which
// bf16 holds; the fused multiply-add rounds s q - hi once, to itself.
__device__ __forceinline__ void wg_fold_frags(const uint4& c, uint2 sw, uint32_t (&ah)[4][4], uint32_t (&al)[4][4]) {
  const uint32_t s0 = __byte_perm(sw.x, 0u, 0x1010u), s1 = __byte_perm(sw.y, 0u, 0x1010u);
  const __nv_bfloat162 sg = *reinterpret_cast<const __nv_bfloat162*>(&s0), sg8 = *reinterpret_cast<const __nv_bfloat162*>(&s1);
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t w_g = (s >> 1) ? c.y : c.x, w_g8 = (s >> 1) ? c.w : c.z;
    const int i0 = 2 * (s & 1);
    const uint32_t q[4] = {code_pair_lop3(w_g, i0), code_pair_lop3(w_g8, i0), code_pair_lop3(w_g, i0 + 1),
                           code_pair_lop3(w_g8, i0 + 1)};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const __nv_bfloat162 qr = *reinterpret_cast<const __nv_bfloat162*>(&q[r]);
      const __nv_bfloat162 sc = (r & 1) ? sg8 : sg;
      const __nv_bfloat162 hi = __hmul2(qr, sc);
      const __nv_bfloat162 lo = __hfma2(qr, sc, __hneg2(hi));
      ah[s][r] = *reinterpret_cast<const uint32_t*>(&hi);
      al[s][r] = *reinterpret_cast<const uint32_t*>(&lo);
    }
  }
}

// ---- The fp16 form (q4_wg_bulk_kernel<2, 128, true, 3, GM, true>): two wgmmas per product, not three
//
// The same A fragments as one fp16 part: s (q - 8) (code_pair_f16m8, then one product by the row's
// scale as fp16), exact where the matrix's scales allow it (WFormat::f16_exact: at most 11 significant
// bits, none below fp16's 2^-24, at most 2^15). x comes in two fp16 parts of its row scaled by 2^e
// (mma_q4.cuh f16_row_scale: 22 significant bits against two bf16 parts' 16), so a product is two
// wgmmas (A x lo, A x hi) where the bf16 form takes three and leaves lo x lo out. The bias term is
// Σ_G (b_G + 8 s_G) Σ x_G (the 8 that q - 8 took out), its two windows products as in the bf16 form
// (bf16: b and 8 s are exact there) over Σ x of the scaled row; the sums are multiplied by 2^-e when
// they are stored (exact).
__device__ __forceinline__ void wg_fold_frags_f16(const uint4& c, uint2 sw, uint32_t (&ah)[4][4]) {
  const __half2 sg = __float2half2_rn(__uint_as_float(sw.x << 16)), sg8 = __float2half2_rn(__uint_as_float(sw.y << 16));
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t w_g = (s >> 1) ? c.y : c.x, w_g8 = (s >> 1) ? c.w : c.z;
    const int i0 = 2 * (s & 1);
    const uint32_t q[4] = {code_pair_f16m8(w_g, i0), code_pair_f16m8(w_g8, i0), code_pair_f16m8(w_g, i0 + 1),
                           code_pair_f16m8(w_g8, i0 + 1)};
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const __half2 p = __hmul2(*reinterpret_cast<const __half2*>(&q[r]), (r & 1) ? sg8 : sg);
      ah[s][r] = *reinterpret_cast<const uint32_t*>(&p);
    }
  }
}

// Registers that an issued wgmma still reads (A fragments) or writes (accumulators) must keep their
// values: the compiler sees each wgmma as done when its asm statement ends and may reuse them. An
// empty asm that "modifies" them after the wait that completes the wgmma keeps them live until there
// (CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void wg_keep(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
__device__ __forceinline__ void wg_keep(uint32_t (&r)[4][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) wg_keep(r[s]);
}
template <int N>
__device__ __forceinline__ void wg_keep(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// A barrier of one warpgroup's 128 threads (named barrier 1 + wg; 0 is __syncthreads).
__device__ __forceinline__ void wg_bar(int wg) {
  if (wg == 3) asm volatile("bar.sync 4, 128;" ::: "memory");
  else if (wg == 2) asm volatile("bar.sync 3, 128;" ::: "memory");
  else if (wg) asm volatile("bar.sync 2, 128;" ::: "memory");
  else asm volatile("bar.sync 1, 128;" ::: "memory");
}
#endif

}  // namespace ck::cuda
