// The dense 4-bit prefill product on warpgroup MMAs (gemm_q4_wg.h). Why: q4_tile_kernel issues one
// mma.sync per m16n8k16 and loads every B fragment into registers with its own instructions; at
// 1,024-row chunks it reaches ~35% of the mma.sync rate, bound by its instruction issue and shared-
// memory reads (docs/roofline-cuda.md). A wgmma.m64n64k16 here does the work of 32 of those MMAs in
// one instruction and reads the activations straight from shared memory. Measured (H200, 2026-11-30
// 18:40Z, one call against CK_Q4_WGMMA=0): the mixes' projections 14.16 -> 13.20 us per 8k prefill
// token, the DeltaNet out_proj 4.68 -> 4.35, the attention o_proj 1.56 -> 1.45, the in_proj (K =
// 2,560) unchanged at 8.7. With 32 tokens per block it was slower than q4_tile_kernel (in_proj 10.8).
//
// Block: 256 threads = 2 warpgroups, TN = 64 tokens x 256 output features; warpgroup w takes features
// [128 w, 128 w + 128) as two m64 tiles (mf). Per 64-code group:
//  - the block copies the group's activations (B), codes, scales, biases and Σ x into shared memory
//    with cp.async, two groups ahead (three buffers), as q4_tile_kernel does;
//  - each warp unpacks its rows' codes into A fragments (registers: wgmma's m64nNk16 A layout is
//    mma.m16n8k16's, one m16 slice per warp) for the group's 4 k16 steps;
//  - the warpgroup issues 4 steps x 2 tiles x PARTS wgmmas into the group's sums d (the first of each
//    tile overwrites d), waits for them, and adds s d + b Σ x to its accumulators (fp32, in group
//    order: the same sums as q4_tile_kernel, up to the order of the tensor core's additions; the
//    parity tests run this kernel on the GPU machine).
// B in shared memory: per (step, part) TN x 32 bytes of 8 x 8 "core matrices" (8 tokens x 8 k values,
// 16 bytes per token), K-major without swizzle: token r at byte 256 (r / 8) + 16 (r % 8), k values
// 8..15 at +128. q4_xfrag_kernel (its wg layout) writes the global fragments so that each 16-byte
// half is one copy.
#include "cuda/gemm_q4_wg.h"

#include <cooperative_groups.h>

#include <cstddef>
#include <utility>

#include "cuda/bulk_copy.cuh"
#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gate_mean_cluster.cuh"
#include "cuda/mma_q4.cuh"
#include "cuda/wgmma.cuh"

namespace ck::cuda {
namespace {

constexpr int kWgThreads = 256;
constexpr int kWgGroupU2 = 48;  // uint2 per x row and group in q4_xfrag_kernel's output (3 parts)

// One group of a block in shared memory, for TN tokens.
template <int TN>
struct WgStage {
  static constexpr int kBBytes = TN * 32;  // one (step, part): TN tokens x 16 k values of bf16
  alignas(128) uint8_t xb[4 * 3 * kBBytes];   // [step][part] (PARTS used): the B core matrices
  alignas(16) uint2 codes[kQ4WgFeatures][4];  // [feature][lane t]: the group's 32 code bytes per row
  alignas(16) uint32_t sb[2 * kQ4WgFeatures];  // [feature][scale, bias] words
  float gsum[TN];
};
constexpr int kWgStages = 3;  // the group in the MMAs, two being copied
template <int TN>
constexpr int wg_smem() { return kWgStages * static_cast<int>(sizeof(WgStage<TN>)); }


// The block's WGS units (q4_wg_units; two, or three in the folded form's three-warpgroup blocks): unit
// u's job, and its first feature row in that job's matrix (every job has the same K; a unit past the
// last job's is idle: its first row is its job's row count).
template <int WGS>
__device__ __forceinline__ void wg_block_units(const Q4WgArgs& a, int (&ujob)[WGS], int (&uf0)[WGS]) {
#pragma unroll
  for (int u = 0; u < WGS; ++u) {
    const int unit = WGS * static_cast<int>(blockIdx.x) + u;
    int j = 0;
    while (j + 1 < a.n_jobs && unit >= a.first_unit[j + 1]) ++j;
    ujob[u] = j;
    uf0[u] = unit < a.first_unit[a.n_jobs] ? (unit - a.first_unit[j]) * a.unit_features : a.job[j].w.rows;
  }
}

// Arrays of two or three read by a select, not an index: an indexed read puts the array on the stack.
template <class T>
__device__ __forceinline__ T wg_pick(const T (&v)[2], int u) { return u ? v[1] : v[0]; }
template <class T>
__device__ __forceinline__ T wg_pick(const T (&v)[3], int u) { return u == 2 ? v[2] : u ? v[1] : v[0]; }
template <class T>
__device__ __forceinline__ T wg_pick(const T (&v)[4], int u) { return u == 3 ? v[3] : u == 2 ? v[2] : u ? v[1] : v[0]; }

// One m64 tile's A fragments (this warp's 16-row slice) for a group's 4 k16 steps, in
// q4_tile_kernel's code_pair_lop3 order, from the 8 code bytes of row g (c0) and of row g + 8 (c8).
template <int MF>
__device__ __forceinline__ void wg_a_frags(uint2 c0, uint2 c8, int mf, uint32_t (&af)[4][MF][4]) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t w_g = (s >> 1) ? c0.y : c0.x, w_g8 = (s >> 1) ? c8.y : c8.x;
    const int i0 = 2 * (s & 1);
    af[s][mf][0] = code_pair_lop3(w_g, i0);
    af[s][mf][1] = code_pair_lop3(w_g8, i0);
    af[s][mf][2] = code_pair_lop3(w_g, i0 + 1);
    af[s][mf][3] = code_pair_lop3(w_g8, i0 + 1);
  }
}

// acc += s Σ q x + b Σ x for one tile's group sums d: rows g (s0, b0) and g + 8 (s1, b1); tokens
// 8 j + 2 t and + 1, whose Σ x are sx[j].
template <int NJ, int ND>
__device__ __forceinline__ void wg_add_group(float (&acc)[ND], const float (&d)[ND], float s0, float b0, float s1,
                                             float b1, const float2 (&sx)[NJ]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    float* c = &acc[4 * j];
    const float* e = &d[4 * j];
    c[0] = fmaf(s0, e[0], fmaf(b0, sx[j].x, c[0]));
    c[1] = fmaf(s0, e[1], fmaf(b0, sx[j].y, c[1]));
    c[2] = fmaf(s1, e[2], fmaf(b1, sx[j].x, c[2]));
    c[3] = fmaf(s1, e[3], fmaf(b1, sx[j].y, c[3]));
  }
}

// The warpgroup's outputs: features f_wg + [0, 64 MF) of its job (those below the matrix's rows),
// tokens drow[] (-1: past the chunk), through the job's epilogue, or into its split-K partial sums.
// SCALE (the fp16 form): each token's sums times inv[its column] (2^-e, exact) first.
template <int NJ, bool SCALE = false, int MF, int ND>
__device__ __forceinline__ void wg_store(const Q4WgArgs& a, int job, int f_wg, const float (&acc)[MF][ND],
                                         const int* drow, const float* inv = nullptr) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, wq = (threadIdx.x >> 5) & 3;
  const int w_rows = a.job[job].w.rows;
  float* const y = a.job[job].y;
  const int ldy = a.job[job].ldy;
  const Epilogue epi = a.job[job].epi;
  const float epi_arg = a.job[job].epi_arg;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int row = drow[8 * j + 2 * t + c];
      if (row < 0) continue;
      float* yr = y + static_cast<size_t>(row) * ldy;
      if (a.split.partial)
        yr = a.split.partial + blockIdx.z * a.split.stride + a.split.off[job] + static_cast<int64_t>(row) * w_rows;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int f = f_wg + 64 * mf + 16 * wq + 8 * h + g;
          if (f >= w_rows) continue;
          float v = acc[mf][4 * j + 2 * h + c];
          if constexpr (SCALE) v *= inv[8 * j + 2 * t + c];
          yr[f] = a.split.partial ? v : apply_epilogue(v, epi, epi_arg);
        }
    }
}

// The gate-mean form's units (launch_q4_wg_gate_mean): block x of a cluster of S takes stream s = x % S
// and the stream's units 3 (x / S) + u, u < 3, so its 192 rows of the up matrix are s H + [64 (3 (x / S)),
// + 192); a unit past the stream's H / 64 is idle (its first row the matrix's row count, as above).
// The block's place in that form: its stream s, and u's features f0 + [0, nf) it takes.
template <int WGS>
struct WgGateMeanBlock {
  int s, f0, nf;
  __device__ __forceinline__ explicit WgGateMeanBlock(const Q4WgArgs& a)
      : s(static_cast<int>(blockIdx.x) % a.hc_s), f0(64 * WGS * (static_cast<int>(blockIdx.x) / a.hc_s)),
        nf(min(64 * WGS, a.hc_h - f0)) {}
};
template <int WGS>
__device__ __forceinline__ void wg_stream_units(const Q4WgArgs& a, int (&ujob)[WGS], int (&uf0)[WGS]) {
  const WgGateMeanBlock<WGS> blk(a);
  const int s = blk.s, fb = blk.f0 / 64;  // the block's first unit of its stream
#pragma unroll
  for (int u = 0; u < WGS; ++u) {
    const int unit = fb + u;
    ujob[u] = 0;
    uf0[u] = unit < a.hc_h / 64 ? s * a.hc_h + 64 * unit : a.job[0].w.rows;
  }
}

// The gate-mean form asks L2 for its block's X (TN rows x 192 floats of stream s) when it starts: X is
// the mix's norm output, written before this kernel, and read only by the epilogue, whose loads then
// come from L2 instead of waiting on memory at the end of the block.
template <int TN, int WGS>
__device__ __forceinline__ void wg_gate_mean_prefetch(const Q4WgArgs& a, const int* drow) {
  constexpr int kLines = 64 * WGS / 32;  // 128-byte lines of a row's features
  const WgGateMeanBlock<WGS> blk(a);
  const int s = blk.s, f0 = blk.f0, nf = blk.nf, H = a.hc_h;
  for (int e = threadIdx.x; e < TN * kLines; e += blockDim.x) {
    const int r = e / kLines, l = e - r * kLines, row = drow[r];
    if (row >= 0 && 32 * l < nf) prefetch_l2(a.hc_x + static_cast<size_t>(row) * a.ld_x + s * H + f0 + 32 * l);
  }
}

// The gate mean of spec §4 from the up projection's sums acc (this warpgroup's 64 features x TN tokens
// of stream s, in wg_store's layout), for the block's features f0 + [0, 64 WGS) of u and its TN tokens:
//  1. g into shared memory as [token][feature] (the stages are free once every wgmma is done);
//  2. each product sigmoid(g_s) X_s in place, X read in 16-byte loads along the features;
//  3. (cluster barrier) block s of the cluster adds the S blocks' products of tokens [s TN / S, + TN / S)
//     in stream order, from their shared memory, and writes u = Σ / S in 16-byte stores.
// The arithmetic of hc_gate_mean_kernel (acc = 0, then acc + sigmoid(g) X rounded twice per stream, then
// / S), and the same g as the unfused call (every unit's K loop is the same), so the same bits of u.
// SCALE (the fp16 form): g = P inv[token] (2^-e, exact) before its sigmoid.
template <int TN, int WGS, bool SCALE = false>
__device__ __forceinline__ void wg_gate_mean_store(const Q4WgArgs& a, const float (&acc)[TN / 2], const int* drow,
                                                   uint8_t* smem, const float* inv = nullptr) {
  namespace cg = cooperative_groups;
  constexpr int kF = 64 * WGS, kLd = kF + 4, kQuads = kF / 4, kThreads = 128 * WGS, kJ = TN / 8;
  const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3, wq = (tid >> 5) & 3, wg = tid >> 7;
  const WgGateMeanBlock<WGS> blk(a);
  const int S = a.hc_s, H = a.hc_h, s = blk.s, f0 = blk.f0, nf = blk.nf;  // u's features f0 + [0, nf) here
  float* P = reinterpret_cast<float*>(smem);  // [TN][kLd]
  // XNorm: the block's tokens' 1 / rms of stream s and its features' norm weights, loaded here so that
  // they fly while g goes to P, then kept in shared memory and read there beside X's (R's) loads below
  // (read from global memory after those, they were a second round trip: the up projection +17% at 8k).
  __shared__ float xn_r[TN];
  __shared__ float4 xn_w[kQuads];
  const bool xnorm = a.hc_rinv != nullptr;
  float xr = 0.0f;
  float4 xw = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (xnorm) {
    if (tid < TN && drow[tid] >= 0) xr = a.hc_rinv[static_cast<size_t>(drow[tid]) * S + s];
    if (tid < kQuads && tid < nf / 4) xw = *reinterpret_cast<const float4*>(a.hc_scale + s * H + f0 + 4 * tid);
  }
  __syncthreads();  // every warpgroup's wgmmas are done (each waited for its own): the stages are free
  // g as it is into P: any arithmetic on acc here (a sigmoid, a product) is read by ptxas as non-wgmma
  // instructions defining a wgmma's accumulator registers inside its pipeline, and it then serializes
  // every wgmma of the kernel (C7515).
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c)
#pragma unroll
      for (int h = 0; h < 2; ++h)  // banks 8 t + g: no conflicts
        P[(8 * j + 2 * t + c) * kLd + 64 * wg + 16 * wq + 8 * h + g] = acc[4 * j + 2 * h + c];
  if (xnorm) {
    if (tid < TN) xn_r[tid] = xr;
    if (tid < kQuads) xn_w[tid] = xw;
  }
  // Each product sigmoid(g_s) X_s in place, X in 16-byte loads along the features (every load first).
  constexpr int kPer = TN * kQuads / kThreads;  // 16 quads a thread
  static_assert(TN * kQuads % kThreads == 0, "whole quads a thread");
  const int nq = nf / 4;
  const float* xs = a.hc_x + s * H + f0;
  float4 xv[kPer];
  __syncthreads();  // P is whole: the quads below are other threads' g
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int e = tid + kThreads * k, r = e / kQuads, q = e - r * kQuads, row = drow[r];
    xv[k] = row >= 0 && q < nq ? *reinterpret_cast<const float4*>(xs + static_cast<size_t>(row) * a.ld_x + 4 * q)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  if (xnorm) {  // X = (R r) w, rmsnorm_wide_tail's formula (xn_r and xn_w whole: the barrier above)
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int e = tid + kThreads * k, r = e / kQuads, q = e - r * kQuads;
      const float rv = xn_r[r];
      const float4 w = xn_w[q];
      xv[k] = make_float4((xv[k].x * rv) * w.x, (xv[k].y * rv) * w.y, (xv[k].z * rv) * w.z, (xv[k].w * rv) * w.w);
    }
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int e = tid + kThreads * k, r = e / kQuads, q = e - r * kQuads;
    float4* p = reinterpret_cast<float4*>(&P[r * kLd + 4 * q]);
    float4 v = *p;
    if constexpr (SCALE) {
      const float f = inv[r];
      v = make_float4(v.x * f, v.y * f, v.z * f, v.w * f);
    }
    const float4 sg = sigmoid4_(v);  // sigmoidf_'s bits
    *p = make_float4(__fmul_rn(sg.x, xv[k].x), __fmul_rn(sg.y, xv[k].y), __fmul_rn(sg.z, xv[k].z), __fmul_rn(sg.w, xv[k].w));
  }
  gate_mean_cluster_sum<TN, kLd, kQuads, kThreads>(a, P, s, f0, nq, [&](int r) { return drow[r]; });
  cg::this_cluster().sync();  // the others have read this block's products before it leaves
}

// y_job[row] = epi(w_job · x[row]) for the dense jobs; grid (feature tiles, rows / TN, K splits). TN: 64
// tokens per block (32 with CK_Q4_WG_TOKENS=32, to compare).
template <int PARTS, int TN>
__global__ void __launch_bounds__(kWgThreads, 1) q4_wg_dense_kernel(const __grid_constant__ Q4WgArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(PARTS == 2 || PARTS == 3, "two or three bf16 parts");
  static_assert(TN == 32 || TN == 64, "the wgmma shapes below");
  constexpr int NJ = TN / 8, ND = TN / 2, kStages = kWgStages;
  constexpr int kBBytes = WgStage<TN>::kBBytes;
  using Stage = WgStage<TN>;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup; warp within it (its 16 rows of each m64 tile)
  int ujob[2], uf0[2];  // the block's two units
  wg_block_units(a, ujob, uf0);
  const int job = wg_pick(ujob, wg);
  const DMatrix w0 = a.job[job].w;  // this warpgroup's matrix
  const int m0 = static_cast<int>(blockIdx.y) * TN;
  const int f_wg = wg_pick(uf0, wg);
  const bool active = f_wg < w0.rows;  // warpgroup-uniform; idle warpgroups still stage and meet the barriers
  __shared__ int drow[TN];
  __shared__ int srow[TN];
  if (tid < TN) {
    const int d = m0 + tid < a.rows ? m0 + tid : -1;
    drow[tid] = d;
    srow[tid] = d < 0 ? 0 : d;  // rows past the chunk read row 0 (their products are never stored)
  }
  __syncthreads();
  const int K = w0.cols, gpg_shift = __ffs(w0.fmt.group / 64) - 1;
  const int g_begin = static_cast<int>(blockIdx.z) * a.k_groups;
  const int g_end = min(K / 64, g_begin + a.k_groups);
  const size_t row_bytes = static_cast<size_t>(K) / 2, n_sg = K / w0.fmt.group;
  const uint8_t sk = w0.fmt.scale_kind;
  // This lane's feature rows g, g + 8 of each m64 tile's 16-row slice, and their scales' word parity.
  int par0[2][2];
#pragma unroll
  for (int mf = 0; mf < 2; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int fr = min(f_wg + 64 * mf + 16 * wq + 8 * h + g, w0.rows - 1);
      par0[mf][h] = static_cast<int>((static_cast<int64_t>(fr) * n_sg) & 1);
    }
  extern __shared__ __align__(128) uint8_t wg_smem[];
  Stage* stage = reinterpret_cast<Stage*>(wg_smem);
  // The copy plan, worked out once (q4_tile_kernel's reasons). Activation copy j: token r, step s,
  // part p, k half j1: 16 bytes from its row's group block to its core-matrix row.
  constexpr int kXCopies = PARTS * TN / 32;  // per thread: 4 steps x PARTS x 2 halves x TN / 256
  uint32_t xf_src[kXCopies], xf_dst[kXCopies];
#pragma unroll
  for (int j = 0; j < kXCopies; ++j) {
    const int i = tid + j * kWgThreads, j1 = i & 1, q = (i >> 1) % (4 * PARTS), r = (i >> 1) / (4 * PARTS);
    const int s = q / PARTS, p = q % PARTS;
    xf_src[j] = static_cast<uint32_t>(srow[r] * a.groups * kWgGroupU2 + (s * 3 + p) * 4 + j1 * 2);
    xf_dst[j] = static_cast<uint32_t>(offsetof(Stage, xb) + (s * PARTS + p) * kBBytes + (r >> 3) * 256 + j1 * 128 +
                                      (r & 7) * 16);
  }
  // A matrix in 16-row tiles (dmatrix.h, WLayout::Tiles16): a unit's 8 tiles of a group are 8 runs of
  // 576 bytes; codes land in `codes` as [tile][lane] 16-byte pieces (a warp's m16 slice is one tile),
  // the scale words in `sb` from word 256 u as [tile][g][row g, row g + 8]. A matrix in rows: codes as
  // [feature][lane t], scale and bias words as [feature][2]. Unit u's codes are uint2 [512 u, 512 u +
  // 512) and its scale words [256 u, 256 u + 256) in either layout, so the two units of a block may
  // differ in layout and scale type (each warpgroup reads its own unit's).
  const bool tiled = w0.tiled();
  bool utiled[2];
  int ushift[2], ues[2];
  size_t un_sg[2];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const DMatrix& m = a.job[ujob[u]].w;
    utiled[u] = m.tiled();
    ushift[u] = __ffs(m.fmt.group / 64) - 1;
    ues[u] = m.fmt.scale_kind == static_cast<uint8_t>(WKind::F32) ? 4 : 2;
    un_sg[u] = K / m.fmt.group;
  }
  auto tile_base = [&](int tl) {  // tile tl of the block (unit tl / 8's tile tl % 8) at group 0, clamped
    const DMatrix& m = a.job[wg_pick(ujob, tl >> 3)].w;
    const int n_tiles = (m.rows + kTileRows - 1) / kTileRows;
    return m.tile_group(min(wg_pick(uf0, tl >> 3) / kTileRows + (tl & 7), n_tiles - 1), 0);
  };
  // Copy j of the codes and of the row layout's scale words belongs to unit j (block feature i / 2).
  const uint8_t* code_src[2];
  const uint8_t* sb_src[2];
  size_t code_step[2];  // bytes from one group's codes to the next's
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = tid + j * kWgThreads;
    const DMatrix& m = a.job[ujob[j]].w;
    const size_t row = static_cast<size_t>(min(uf0[j] + ((i >> 1) & 127), m.rows - 1));
    code_src[j] = utiled[j] ? tile_base(i >> 5) + 16 * (i & 31) : m.data + row * row_bytes + (i & 1) * 16;
    code_step[j] = utiled[j] ? kTileGroupBytes : 32;
    sb_src[j] = utiled[j] ? nullptr : ((i & 1) ? m.biases : m.scales) + row * un_sg[j] * ues[j];
  }
  // Tiled units' scale words: threads 32 u .. 32 u + 31 copy unit u's, 16 bytes each.
  const bool sb_tile = tid < 64 && wg_pick(utiled, (tid >> 5) & 1);
  const uint8_t* sb_tile_src = tile_base((tid >> 2) & 15) + 512 + 16 * (tid & 3);
  const int sb_tile_dst = 256 * ((tid >> 5) & 1) + 4 * (tid & 31);
  const size_t gsum_src = static_cast<size_t>(srow[tid % TN]) * a.groups;
  auto stage_group = [&](int G, Stage& st) {
    uint8_t* base = reinterpret_cast<uint8_t*>(&st);
#pragma unroll
    for (int j = 0; j < kXCopies; ++j)
      cp_async16(base + xf_dst[j], a.xf + xf_src[j] + static_cast<size_t>(G) * kWgGroupU2);
#pragma unroll
    for (int j = 0; j < 2; ++j)
      cp_async16(&st.codes[0][0] + 2 * (tid + j * kWgThreads), code_src[j] + static_cast<size_t>(G) * code_step[j]);
    if (tid < TN) cp_async4(&st.gsum[tid], a.gsum + gsum_src + G);
    if (sb_tile) cp_async16(&st.sb[sb_tile_dst], sb_tile_src + static_cast<size_t>(G) * kTileGroupBytes);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (utiled[j]) continue;
      const uintptr_t at = reinterpret_cast<uintptr_t>(sb_src[j] + static_cast<size_t>(G >> ushift[j]) * ues[j]);
      cp_async4(&st.sb[tid + j * kWgThreads], reinterpret_cast<const void*>(at & ~uintptr_t{3}));
    }
  };
  const StagedScales scales(sk);  // a scale or bias from its staged 4-byte word

  float acc[2][ND] = {};  // [m64 tile][n8 block j * 4 + (row g: 0, 1; row g + 8: 2, 3)]
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  // The group's A fragments (its 4 k16 steps, q4_tile_kernel's code_pair_lop3 order): rows g, g + 8.
  auto unpack = [&](const Stage& st, uint32_t (&af)[4][2][4]) {
#pragma unroll
    for (int mf = 0; mf < 2; ++mf) {
      const int fl = 128 * wg + 64 * mf + 16 * wq + g;
      uint2 c0, c8;
      if (tiled) {
        const uint4 c = reinterpret_cast<const uint4*>(&st.codes[0][0])[(8 * wg + 4 * mf + wq) * 32 + lane];
        c0 = make_uint2(c.x, c.y);
        c8 = make_uint2(c.z, c.w);
      } else {
        c0 = st.codes[fl][t];
        c8 = st.codes[fl + 8][t];
      }
      wg_a_frags(c0, c8, mf, af);
    }
  };
  auto issue = [&](int sidx, const uint32_t (&af)[4][2][4], float (&d)[2][ND]) {
    wg_issue<PARTS>(smem_base + static_cast<uint32_t>(sidx * sizeof(Stage) + offsetof(Stage, xb)), kBBytes, af, d);
  };
  // y += s Σ q x + b Σ x for group G from its sums d: rows g, g + 8 of each tile; tokens 8 j + 2 t, + 1.
  auto epilogue = [&](int G, const Stage& st, const float (&d)[2][ND]) {
    float2 sx[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) sx[j] = *reinterpret_cast<const float2*>(&st.gsum[8 * j + 2 * t]);
    const int sp = (G >> gpg_shift) & 1;
#pragma unroll
    for (int mf = 0; mf < 2; ++mf) {
      const int fl = 128 * wg + 64 * mf + 16 * wq + g;
      float s0, b0, s1, b1;
      if (tiled) {  // [tile][g]: (scale, bias) of row g, then of row g + 8, bf16
        tile_scales(*reinterpret_cast<const uint2*>(&st.sb[256 * wg + ((4 * mf + wq) * 8 + g) * 2]), s0, b0, s1, b1);
      } else {
        const uint2 sb_g = *reinterpret_cast<const uint2*>(&st.sb[fl * 2]);
        const uint2 sb_g8 = *reinterpret_cast<const uint2*>(&st.sb[(fl + 8) * 2]);
        const uint32_t sel0 = scales.sel(par0[mf][0] ^ sp), sel1 = scales.sel(par0[mf][1] ^ sp);
        s0 = scales.value(sb_g.x, sel0), b0 = scales.value(sb_g.y, sel0);
        s1 = scales.value(sb_g8.x, sel1), b1 = scales.value(sb_g8.y, sel1);
      }
      wg_add_group(acc[mf], d[mf], s0, b0, s1, b1, sx);
    }
  };
  stage_group(g_begin, stage[0]);
  cp_async_commit();
  if (g_begin + 1 < g_end) stage_group(g_begin + 1, stage[1]);
  cp_async_commit();
  // Per group: copies done, unpack, the group's wgmmas, wait for them, add their sums; the two
  // warpgroups of the block overlap one's sums with the other's MMAs. (A software pipeline that adds
  // group G - 1's sums while group G's wgmmas run needs two sets of sums and A fragments: at 32 tokens
  // it was slower than this loop, 12.1 against 10.8 us per 8k token on the DeltaNet in_proj; at 64
  // tokens it does not fit the registers.)
  float d[2][ND];
  uint32_t af[4][2][4];
  for (int G = g_begin; G < g_end; ++G) {
    cp_async_wait<1>();   // this thread's copies of group G are done
    fence_proxy_async();  // ... and visible to the wgmmas (async proxy)
    __syncthreads();      // everyone's are; and every warpgroup is done with group G - 1's buffer
    if (G + 2 < g_end) stage_group(G + 2, stage[(G - g_begin + 2) % kStages]);
    cp_async_commit();
    const int sidx = (G - g_begin) % kStages;
    if (active) {
      unpack(stage[sidx], af);
      wg_fence();
      issue(sidx, af, d);
      wg_commit();
      wg_wait<0>();
      epilogue(G, stage[sidx], d);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  if (active) wg_store<NJ>(a, job, f_wg, acc, drow);
#else
  __trap();  // built for sm_90a only (CMakeLists.txt); q4_wg_ready() keeps other devices off this path
#endif
}

// ---- The same product when every unit is in 16-row tiles, fed by bulk copies
//
// Why: Nsight Compute on q4_wg_dense_kernel (the DeltaNet in_proj at 2,048 rows, 2026-12-01 03:05Z:
// 1.34 ms, ~26% of the bf16 MMA rate) put a third of its warps' stall samples on its copies: each
// thread issues ~8 cp.async per group (2,048 per block), and the instructions after them wait for the
// copy queue (long scoreboard 14%, LSU 7%, MIO 7%); another 16% waited at the per-group block barrier.
// Here one warp asks for a group's whole stage with 17 bulk copies: the activations' block (laid out
// by q4_xfrag_kernel exactly as shared memory holds it, Σ x included) and the 16 (tile, group) runs of
// 576 bytes of the two units. Stages complete on mbarriers, and each warp says when it is done with a
// stage (a second mbarrier), so the two warpgroups are no longer in lock step at every group: the
// copy of group G + kWgAhead waits only until every warp is past group G + kWgAhead - (stages).
// The arithmetic is q4_wg_dense_kernel's (the same helpers, in the same order: the same bits).
// Measured (2026-12-01 03:21Z, one call): that in_proj 1.34 -> 1.20 ms in Nsight Compute (its L2
// throughput 47% -> 13%: a bulk copy is far fewer L2 requests), 8.03 -> 7.35 us per 8k prefill token
// in the profile; the other products (out_proj, the router's halves, o_proj) level; prefill's totals
// within the calls' spread. So the copies were not what bounds these products (the data waits remain,
// now at the mbarriers); nor is L2 bandwidth: blocks in clusters of two that multicast the shared
// activations (half the L2 reads) were slower (in_proj 1.48 ms: the cross-block releases cost a
// cluster-scope fence per warp and group, and tie the pair's pace together).
//
// TN = 128 (the default; CK_Q4_WG_WIDE=0 or set_q4_wg_wide(0) keeps TN = 64): a warpgroup takes 64
// features as one m64n128k16 tile instead of 128 as two m64n64k16 tiles: the same outputs per block and
// group with half the wgmmas and half the A unpacking. Measured (03:37Z, one call, profiles at 8k
// tokens): in_proj 7.29 -> 6.26 us per token, out_proj 3.51 -> 3.11, the router's halves 1.64 -> 1.56,
// o_proj 1.16 -> 1.03; prefill +2.4% / +3.5% at 2k / 8k (+4.0% / +3.2% at 04:16Z, when its tests against
// the CPU passed: WideWarpgroupTilesMatchCpu, the prefill chunk test and the model tests). Its sums
// match q4_wg_dense_kernel's bits where both choose the same K split (2,560 x 6,144 at 70 rows) and
// differ exactly where the splits differ (its blocks cover other row counts).
constexpr int kWgAhead = 3;
// A unit's tiles of one group: 128 features (8 tiles) with 64 tokens per block, 64 (4) with 128.
CK_HD constexpr int wg_unit_bytes(int tokens) { return q4_wg_unit_features(tokens) / kTileRows * kTileGroupBytes; }
// One stage: [the activations' tile-group block (q4_wg_act_block_bytes)][unit 0's tiles][unit 1's]...
CK_HD constexpr int wg_bulk_stage_bytes(int parts, int tokens, int wgs = 2) {
  return q4_wg_act_block_bytes(parts, tokens) + wgs * wg_unit_bytes(tokens);
}
// The folded form's bias windows: each warpgroup's two windows of two parts (q4_wg_b_bytes each).
CK_HD constexpr int wg_fold_bytes(int tokens, bool fold, int wgs) { return fold ? wgs * 2 * 2 * q4_wg_b_bytes(tokens) : 0; }
// Stages: five, or as many as fit 220 KB with the windows (four at 128 tokens and three parts, and in
// the folded form's three-warpgroup blocks).
CK_HD constexpr int wg_bulk_stages(int parts, int tokens, bool fold = false, int wgs = 2) {
  const int fit = (220 * 1024 - wg_fold_bytes(tokens, fold, wgs)) / wg_bulk_stage_bytes(parts, tokens, wgs);
  return fit < 5 ? fit : 5;
}
constexpr int wg_bulk_smem(int parts, int tokens, bool fold = false, int wgs = 2) {
  return wg_bulk_stages(parts, tokens, fold, wgs) * wg_bulk_stage_bytes(parts, tokens, wgs) + wg_fold_bytes(tokens, fold, wgs);
}
static_assert(wg_bulk_smem(2, 128, true) <= 220 * 1024 && wg_bulk_smem(2, 128, true, 3) <= 220 * 1024,
              "the folded forms' shared memory");
static_assert(wg_bulk_stages(2, 128, true) == 5 && wg_bulk_stages(2, 128, true, 3) == 4, "the folded forms' stages");
static_assert(wg_bulk_stage_bytes(2, 64) % 128 == 0 && wg_bulk_stage_bytes(3, 64) % 128 == 0 &&
                  wg_bulk_stage_bytes(2, 128) % 128 == 0 && wg_bulk_stage_bytes(3, 128) % 128 == 0,
              "stage alignment");
static_assert(wg_bulk_stages(3, 128) > kWgAhead, "stages for the copies ahead");

// y_job[row] = epi(w_job · x[row]) for dense jobs all in 16-row tiles, TN tokens per block (64: a
// warpgroup takes 128 features as two m64 tiles; 128: 64 features, one m64n128 tile); grid (feature
// tiles, rows / TN, K splits); x from q4_xfrag_kernel's tile layout for TN rows (a.xf).
// WGS warpgroups a block, one unit each (3: the folded form only, its default; a.units_per_block).
// GM: the mix's gate mean as the epilogue (launch_q4_wg_gate_mean; wg_gate_mean_store says how).
// F16: the folded form's fp16 arithmetic ("The fp16 form" above; a.x_inv the rows' 2^-e).
template <int PARTS, int TN, bool FOLD = false, int WGS = 2, bool GM = false, bool F16 = false>
__global__ void __launch_bounds__(WGS * 128, 1) q4_wg_bulk_kernel(const __grid_constant__ Q4WgArgs a) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(PARTS == 2 || PARTS == 3, "two or three bf16 parts");
  static_assert(TN == 64 || TN == 128, "the wgmma shapes");
  static_assert(WGS == 2 || (WGS == 3 && FOLD) || (WGS == 4 && F16), "three warpgroups folded, four in fp16");
  static_assert(!GM || (FOLD && WGS == 3), "the gate mean in the folded three-warpgroup form only");
  static_assert(!F16 || (FOLD && WGS >= 3), "the fp16 form of the folded three- or four-warpgroup form only");
  static_assert(!GM || TN * (64 * WGS + 4) * 4 <= wg_bulk_stages(PARTS, TN, FOLD, WGS) * wg_bulk_stage_bytes(PARTS, TN, WGS),
                "the gate mean's products fit the stages");
  constexpr int MF = 128 / TN, NJ = TN / 8, ND = TN / 2, kBBytes = q4_wg_b_bytes(TN);
  constexpr int kStages = wg_bulk_stages(PARTS, TN, FOLD, WGS), kUnitBytes = wg_unit_bytes(TN);
  constexpr int kStage = wg_bulk_stage_bytes(PARTS, TN, WGS), kAct = q4_wg_act_block_bytes(PARTS, TN);
  constexpr int kTileCopies = WGS * 4 * MF;  // the units' tiles
  constexpr int kAhead = kStages - 2 < kWgAhead ? kStages - 2 : kWgAhead;  // groups copied ahead
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  int ujob[WGS], uf0[WGS];
  if constexpr (GM) wg_stream_units(a, ujob, uf0);
  else wg_block_units(a, ujob, uf0);
  const int job = wg_pick(ujob, wg), f_wg = wg_pick(uf0, wg);
  const DMatrix w0 = a.job[job].w;
  const bool active = f_wg < w0.rows;  // warpgroup-uniform; idle warpgroups still meet the barriers
  const int m0 = static_cast<int>(blockIdx.y) * TN;
  const int g_begin = static_cast<int>(blockIdx.z) * a.k_groups;
  const int g_end = min(a.groups, g_begin + a.k_groups);
  __shared__ int drow[TN];
  __shared__ float tok_inv[F16 ? TN : 1];  // the fp16 form's 2^-e of each token (a.x_inv covers whole tiles)
  __shared__ uint64_t full[kStages], empty[kStages];
  if (tid < TN) drow[tid] = m0 + tid < a.rows ? m0 + tid : -1;
  if constexpr (F16)
    if (tid < TN) tok_inv[tid] = a.x_inv[m0 + tid];
  if (tid == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbar_init(&full[i]);
      mbar_init(&empty[i], WGS * 4);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if constexpr (GM)
    if (a.hc_prefetch) wg_gate_mean_prefetch<TN, WGS>(a, drow);
  extern __shared__ __align__(128) uint8_t wg_smem[];
  // Warp 0's copies: lane l < kTileCopies unit l / (4 MF)'s tile l % (4 MF) (clamped to the matrix's
  // last tile: rows past it are computed, never stored), lane kTileCopies the activations' block.
  const uint8_t* src = nullptr;
  uint32_t dst = 0, bytes = 0;
  size_t step = 0;
  if (warp == 0 && lane < kTileCopies) {
    const int u = lane / (4 * MF);
    const DMatrix& m = a.job[wg_pick(ujob, u)].w;
    const int n_tiles = (m.rows + kTileRows - 1) / kTileRows;
    src = m.tile_group(min(wg_pick(uf0, u) / kTileRows + lane % (4 * MF), n_tiles - 1), 0);
    dst = static_cast<uint32_t>(kAct + lane * kTileGroupBytes);
    bytes = kTileGroupBytes;
    step = kTileGroupBytes;
  } else if (warp == 0 && lane == kTileCopies) {
    src = reinterpret_cast<const uint8_t*>(a.xf) + static_cast<size_t>(blockIdx.y) * a.groups * kAct;
    bytes = kAct;
    step = kAct;
  }
  auto produce = [&](int G) {  // warp 0: group G into its stage
    const int i = G - g_begin, st = i % kStages;
    if (lane == 0) {
      if (i >= kStages) mbar_wait(&empty[st], (i / kStages - 1) & 1);  // every warp is done with it
      mbar_arrive_expect(&full[st], kStage);
    }
    __syncwarp();
    if (bytes) bulk_copy_1d(wg_smem + st * kStage + dst, src + static_cast<size_t>(G) * step, bytes, &full[st]);
  };
  if (warp == 0)
    for (int G = g_begin; G < min(g_end, g_begin + kAhead); ++G) produce(G);

  float acc[MF][ND] = {};
  const uint32_t smem_base = smem_u32(wg_smem);
  if constexpr (!FOLD) {
    float d[MF][ND];
    uint32_t af[4][MF][4];
    for (int G = g_begin; G < g_end; ++G) {
      const int i = G - g_begin, st = i % kStages;
      if (warp == 0 && G + kAhead < g_end) produce(G + kAhead);
      mbar_wait(&full[st], (i / kStages) & 1);
      if (active) {
        const uint8_t* stage = wg_smem + st * kStage;
        const uint8_t* unit = stage + kAct + wg * kUnitBytes;
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          const uint4 c = *reinterpret_cast<const uint4*>(unit + (4 * mf + wq) * kTileGroupBytes + 16 * lane);
          wg_a_frags(make_uint2(c.x, c.y), make_uint2(c.z, c.w), mf, af);
        }
        wg_fence();
        wg_issue<PARTS>(smem_base + static_cast<uint32_t>(st * kStage), kBBytes, af, d);
        wg_commit();
        wg_wait<0>();
        float2 sx[NJ];
        const float* gsum = reinterpret_cast<const float*>(stage + PARTS * 4 * kBBytes);
#pragma unroll
        for (int j = 0; j < NJ; ++j) sx[j] = *reinterpret_cast<const float2*>(&gsum[8 * j + 2 * t]);
#pragma unroll
        for (int mf = 0; mf < MF; ++mf) {
          float s0, b0, s1, b1;
          tile_scales(*reinterpret_cast<const uint2*>(unit + (4 * mf + wq) * kTileGroupBytes + 512 + 8 * g), s0, b0, s1,
                      b1);
          wg_add_group(acc[mf], d[mf], s0, b0, s1, b1, sx);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[st]);
    }
  } else {
    // The folded form (the default; CK_Q4_WG_FOLD): A = the two bf16 parts of s q (wg_fold_frags), so
    // the wgmmas accumulate y itself over all of K: no group sums d, no wait for them, no epilogue per
    // group. A warpgroup issues group G's 12 wgmmas (4 steps x three of the four products of two parts
    // by two: hi w x lo x, lo w x hi x, hi w x hi x; lo w x lo x, < 2^-18 of each term, is left out,
    // less than the two parts of x leave out of x) while G - 1's run, with two sets of A registers (the
    // loop takes groups in pairs); group G - 2's completion frees its A registers and its stage.
    // The bias term Σ_G b_G Σ x_G is products too: each group's Σ x (two bf16 parts) goes into column
    // G % 16 of a window of B (16 k columns, two windows alternating, each warpgroup its own, written
    // by its 128 threads), the rows' bf16 biases into the warp's bias_w; after a window's last group,
    // its A fragment comes from bias_w and two wgmmas add the window. Sums in another order than the
    // factored form's (the tensor core adds across groups), within the parity tolerances against the
    // CPU. With WGS = 3 (the default) a block is three such warpgroups (384 threads at 167 registers):
    // three warps a scheduler hide the chains that bound two (docs/roofline-cuda.md, thirty-seventh).
    static_assert(PARTS == 2 && TN == 128, "the folded form: two parts, one m64n128 tile a warpgroup");
    static_assert(kStages >= kAhead + 2, "a stage is free two groups after its wgmmas were issued");
    uint8_t* const win = wg_smem + kStages * kStage + wg * 4 * kBBytes;  // [window][part][B core matrices]
    const int r_tok = tid & 127;  // this thread's token column in the windows
    const uint32_t win_off = 256 * (r_tok >> 3) + 16 * (r_tok & 7);
    for (int i = r_tok; i < kBBytes / 4; i += 128) reinterpret_cast<uint4*>(win)[i] = make_uint4(0u, 0u, 0u, 0u);
    fence_proxy_async();
    wg_bar(wg);
    uint32_t ah0[4][4], al0[4][4], ah1[4][4], al1[4][4];  // (al unused in the fp16 form)
    uint32_t bias_q[4], bias8_q[4];
    // The window's biases of this warp's 16 rows, [row][column]: the A fragment is loaded from here
    // after a wait (registers of a wgmma that were defined while wgmmas were in flight, as a fragment
    // built group by group would be, serialize every wgmma: ptxas C7513).
    __shared__ __align__(16) uint16_t bias_s[4 * WGS][16][16];
    uint16_t (&bias_w)[16][16] = bias_s[warp];
    // The fp16 form's second bias operand, 8 s (bf16, exact), laid out as bias_w.
    __shared__ __align__(16) uint16_t bias8_s[F16 ? 4 * WGS : 1][16][16];
    uint16_t (&bias8_w)[16][16] = bias8_s[F16 ? warp : 0];
    // Four warpgroups (fp16 only): one set of A registers (128 a thread at most), so a group waits for
    // the one before it; the other warpgroups' groups fill the gap. At 128 registers ptxas serializes
    // this instance's wgmmas (C7512, "insufficient register resources"; tests/cuda/wgmma_async.sh
    // knows it): measured so, it is ~3% slower a unit than three warpgroups, and gemm_q4 takes it only
    // where its fuller waves make up for that (docs/performance.md, forty-sixth session).
    constexpr bool kOneA = WGS == 4;
    auto group = [&](int G, uint32_t (&ah)[4][4], uint32_t (&al)[4][4]) {
      const int i = G - g_begin, st = i % kStages;
      // Group G - 2's wgmmas are done (G - 1's too with one set of A registers): its A registers (these)
      // and its stage are free.
      if constexpr (kOneA) wg_wait<0>();
      else wg_wait<1>();
      wg_keep(ah);
      if constexpr (!F16) wg_keep(al);
      if (i >= 2) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&empty[(i - 2) % kStages]);
      }
      if (warp == 0 && G + kAhead < g_end) produce(G + kAhead);
      mbar_wait(&full[st], (i / kStages) & 1);
      // An idle warpgroup multiplies its clamped tiles too (never stored): a wgmma on a path the
      // compiler cannot prove uniform serializes every wgmma of the kernel (ptxas C7520).
      const uint8_t* stage = wg_smem + st * kStage;
      const uint8_t* tile = stage + kAct + wg * kUnitBytes + wq * kTileGroupBytes;
      const uint2 sw = *reinterpret_cast<const uint2*>(tile + 512 + 8 * g);
      if constexpr (F16) wg_fold_frags_f16(*reinterpret_cast<const uint4*>(tile + 16 * lane), sw, ah);
      else wg_fold_frags(*reinterpret_cast<const uint4*>(tile + 16 * lane), sw, ah, al);
      const int j = i & 15;  // the group's column in its window
      uint8_t* const w = win + ((i >> 4) & 1) * 2 * kBBytes;
      const float sx = reinterpret_cast<const float*>(stage + PARTS * 4 * kBBytes)[r_tok];
      const __nv_bfloat16 sx_hi = __float2bfloat16_rn(sx);
      const __nv_bfloat16 sx_lo = __float2bfloat16_rn(sx - __bfloat162float(sx_hi));
      const uint32_t col = win_off + 128 * (j >> 3) + 2 * (j & 7);
      *reinterpret_cast<__nv_bfloat16*>(w + col) = sx_hi;
      *reinterpret_cast<__nv_bfloat16*>(w + kBBytes + col) = sx_lo;
      if (t == 0) {  // rows g and g + 8's bf16 biases (the high halves of their scale words)
        bias_w[g][j] = static_cast<uint16_t>(sw.x >> 16);
        bias_w[g + 8][j] = static_cast<uint16_t>(sw.y >> 16);
        if constexpr (F16) {  // and 8 s (exact in bf16)
          const __nv_bfloat16 e0 = __float2bfloat16_rn(8.0f * __uint_as_float(sw.x << 16));
          const __nv_bfloat16 e8 = __float2bfloat16_rn(8.0f * __uint_as_float(sw.y << 16));
          bias8_w[g][j] = *reinterpret_cast<const uint16_t*>(&e0);
          bias8_w[g + 8][j] = *reinterpret_cast<const uint16_t*>(&e8);
        }
      }
      const uint32_t xb = smem_base + static_cast<uint32_t>(st * kStage);
      wg_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) {  // small products first
        if constexpr (F16) {
          wg_mma_f16(acc[0], ah[s], wg_desc(xb + (2 * s + 1) * kBBytes, kWgLbo, kWgSbo), 1);
          wg_mma_f16(acc[0], ah[s], wg_desc(xb + 2 * s * kBBytes, kWgLbo, kWgSbo), 1);
        } else {
          wg_mma(acc[0], ah[s], wg_desc(xb + (2 * s + 1) * kBBytes, kWgLbo, kWgSbo), 1);
          wg_mma(acc[0], al[s], wg_desc(xb + 2 * s * kBBytes, kWgLbo, kWgSbo), 1);
          wg_mma(acc[0], ah[s], wg_desc(xb + 2 * s * kBBytes, kWgLbo, kWgSbo), 1);
        }
      }
      wg_commit();
    };
    // The window's bias products (a commit group of their own), once its groups are issued.
    auto flush = [&](int i_last) {
      // bias_q is set after a wait (see bias_s); this retires the group before last, and the one before
      // it read the previous window's bias_q.
      wg_wait<1>();
      wg_keep(bias_q);
      if constexpr (F16) wg_keep(bias8_q);
      fence_proxy_async();  // the window's Σ x, stored by every thread, for the wgmmas
      wg_bar(wg);  // (and the warp's bias_w)
      // Lane (g, t): columns 2t, 2t + 1 of rows g (word 0) and g + 8 (1), 2t + 8, 2t + 9 (2, 3); the
      // columns past a short last window are zero.
      const int n_cols = i_last % 16 + 1;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int row = g + 8 * (k & 1), c = 2 * t + 8 * (k >> 1);
        const uint32_t v = *reinterpret_cast<const uint32_t*>(&bias_w[row][c]);
        bias_q[k] = c + 1 < n_cols ? v : c < n_cols ? (v & 0xFFFFu) : 0u;
        if constexpr (F16) {
          const uint32_t v8 = *reinterpret_cast<const uint32_t*>(&bias8_w[row][c]);
          bias8_q[k] = c + 1 < n_cols ? v8 : c < n_cols ? (v8 & 0xFFFFu) : 0u;
        }
      }
      wg_fence();
      const uint32_t wb = smem_u32(win + ((i_last >> 4) & 1) * 2 * kBBytes);
      wg_mma(acc[0], bias_q, wg_desc(wb + kBBytes, kWgLbo, kWgSbo), 1);
      wg_mma(acc[0], bias_q, wg_desc(wb, kWgLbo, kWgSbo), 1);
      if constexpr (F16) {
        wg_mma(acc[0], bias8_q, wg_desc(wb + kBBytes, kWgLbo, kWgSbo), 1);
        wg_mma(acc[0], bias8_q, wg_desc(wb, kWgLbo, kWgSbo), 1);
      }
      wg_commit();
      __syncwarp();  // every lane has read bias_w before the next window's first writes
    };
    // Windows of 16 groups, their groups in pairs (a wgmma on a path that depends on the group, such
    // as the flush inside the pair loop, serializes every wgmma of the kernel: ptxas C7520).
    for (int W = g_begin; W < g_end; W += 16) {
      const int W_end = min(W + 16, g_end);
      for (int G = W; G < W_end; G += 2) {
        group(G, ah0, al0);
        if (G + 1 < W_end) {
          if constexpr (kOneA) group(G + 1, ah0, al0);
          else group(G + 1, ah1, al1);
        }
      }
      flush(W_end - 1 - g_begin);
    }
    wg_wait<0>();
    wg_keep(acc[0]);
  }
  if constexpr (GM) wg_gate_mean_store<TN, WGS, F16>(a, acc[0], drow, wg_smem, tok_inv);
  else if (active) wg_store<NJ, F16>(a, job, f_wg, acc, drow, tok_inv);
#else
  __trap();  // built for sm_90a only (CMakeLists.txt); q4_wg_ready() keeps other devices off this path
#endif
}

// The kernel for (parts, tokens per block) and its dynamic shared memory.
using WgKernel = void (*)(Q4WgArgs);
WgKernel wg_kernel(int parts, int tokens, int* smem) {
  if (tokens == 32) {
    *smem = wg_smem<32>();
    return parts == 3 ? q4_wg_dense_kernel<3, 32> : q4_wg_dense_kernel<2, 32>;
  }
  *smem = wg_smem<64>();
  return parts == 3 ? q4_wg_dense_kernel<3, 64> : q4_wg_dense_kernel<2, 64>;
}

}  // namespace

int q4_wg_units(Q4WgArgs& a, int unit_features, int per_block) {
  a.unit_features = unit_features;
  a.units_per_block = per_block;
  int u = 0;
  for (int j = 0; j < a.n_jobs; ++j) {
    a.first_unit[j] = u;
    u += (a.job[j].w.rows + unit_features - 1) / unit_features;
  }
  a.first_unit[a.n_jobs] = u;
  return (u + per_block - 1) / per_block;
}

bool q4_wg_ready() {
  static const bool ready = [] {
    cudaFuncAttributes at{};
    const std::pair<WgKernel, int> bulk[] = {
        {q4_wg_bulk_kernel<2, 64>, wg_bulk_smem(2, 64)}, {q4_wg_bulk_kernel<3, 64>, wg_bulk_smem(3, 64)},
        {q4_wg_bulk_kernel<2, 128>, wg_bulk_smem(2, 128)}, {q4_wg_bulk_kernel<3, 128>, wg_bulk_smem(3, 128)},
        {q4_wg_bulk_kernel<2, 128, true>, wg_bulk_smem(2, 128, true)},
        {q4_wg_bulk_kernel<2, 128, true, 3>, wg_bulk_smem(2, 128, true, 3)},
        {q4_wg_bulk_kernel<2, 128, true, 3, true>, wg_bulk_smem(2, 128, true, 3)},
        {q4_wg_bulk_kernel<2, 128, true, 3, false, true>, wg_bulk_smem(2, 128, true, 3)},
        {q4_wg_bulk_kernel<2, 128, true, 3, true, true>, wg_bulk_smem(2, 128, true, 3)},
        {q4_wg_bulk_kernel<2, 128, true, 4, false, true>, wg_bulk_smem(2, 128, true, 4)}};
    for (const auto& [k, smem] : bulk)
      if (cudaFuncGetAttributes(&at, k) != cudaSuccess ||
          cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
      }
    for (int parts : {2, 3})
      for (int tokens : {32, 64}) {
        int smem = 0;
        const WgKernel k = wg_kernel(parts, tokens, &smem);
        if (cudaFuncGetAttributes(&at, k) != cudaSuccess ||
            cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
          (void)cudaGetLastError();  // no image for this device: not an error of the run
          return false;
        }
      }
    return true;
  }();
  return ready;
}

void launch_q4_wg_dense(unsigned feature_tiles, unsigned splits, const Q4WgArgs& a, int parts, int tokens,
                        cudaStream_t stream) {
  CK_REQUIRE(a.units_per_block == 2, "q4_wg_dense: %d units a block", a.units_per_block);
  int smem = 0;
  const WgKernel k = wg_kernel(parts, tokens, &smem);
  const dim3 grid(feature_tiles, static_cast<unsigned>((a.rows + tokens - 1) / tokens), splits);
  k<<<grid, kWgThreads, smem, stream>>>(a);
  CUDA_CHECK_LAUNCH();
}

void launch_q4_wg_bulk(unsigned feature_tiles, unsigned splits, const Q4WgArgs& a, int parts, int tokens, bool fold,
                       cudaStream_t stream) {
  const dim3 grid(feature_tiles, static_cast<unsigned>((a.rows + tokens - 1) / tokens), splits);
  const int wgs = a.units_per_block;
  CK_REQUIRE(wgs == 2 || (wgs >= 3 && fold), "q4_wg_bulk: %d units a block", wgs);
  CK_REQUIRE(!fold || (parts == 2 && tokens == 128), "q4_wg_bulk: the folded form with %d parts, %d tokens", parts,
             tokens);
  CK_REQUIRE(!a.x_inv || (fold && wgs >= 3), "q4_wg_bulk: the fp16 form with %d units a block", wgs);
  CK_REQUIRE(wgs != 4 || a.x_inv, "q4_wg_bulk: four units a block in the fp16 form only");
  const int smem = wg_bulk_smem(parts, tokens, fold, wgs);
  if (wgs == 4) q4_wg_bulk_kernel<2, 128, true, 4, false, true><<<grid, 4 * 128, smem, stream>>>(a);
  else if (fold && wgs == 3 && a.x_inv) q4_wg_bulk_kernel<2, 128, true, 3, false, true><<<grid, 3 * 128, smem, stream>>>(a);
  else if (fold && wgs == 3) q4_wg_bulk_kernel<2, 128, true, 3><<<grid, 3 * 128, smem, stream>>>(a);
  else if (fold) q4_wg_bulk_kernel<2, 128, true><<<grid, kWgThreads, smem, stream>>>(a);
  else if (tokens == 128 && parts == 3) q4_wg_bulk_kernel<3, 128><<<grid, kWgThreads, smem, stream>>>(a);
  else if (tokens == 128) q4_wg_bulk_kernel<2, 128><<<grid, kWgThreads, smem, stream>>>(a);
  else if (parts == 3) q4_wg_bulk_kernel<3, 64><<<grid, kWgThreads, smem, stream>>>(a);
  else q4_wg_bulk_kernel<2, 64><<<grid, kWgThreads, smem, stream>>>(a);
  CUDA_CHECK_LAUNCH();
}

// One cluster of S blocks a feature block: grid (S ceil(H / 192), rows / 128), the K loop whole (the
// up projection's K is hc_lowrank: 5 groups at the released geometry).
static cudaLaunchConfig_t gate_mean_config(const Q4WgArgs& a, cudaLaunchAttribute* attr, cudaStream_t stream) {
  constexpr int kF = 64 * 3;
  const dim3 grid(static_cast<unsigned>(a.hc_s * ((a.hc_h + kF - 1) / kF)), static_cast<unsigned>((a.rows + 127) / 128), 1);
  return wg_cluster_config(grid, 3 * 128, wg_bulk_smem(2, 128, true, 3), a.hc_s, attr, stream);
}

bool q4_wg_gate_mean_ready(int S) {
  if (S != 2 && S != 4 && S != 8) return false;
  if (!q4_wg_ready()) return false;
  static int ready[9] = {-1, -1, -1, -1, -1, -1, -1, -1, -1};
  if (ready[S] < 0) {
    Q4WgArgs a;
    a.hc_s = S;
    a.hc_h = 64 * 3;
    a.rows = 128;
    cudaLaunchAttribute attr[1];
    const cudaLaunchConfig_t cfg = gate_mean_config(a, attr, nullptr);
    int clusters = 0, clusters16 = 0;  // (both forms: the fp16 one has more static shared memory)
    cudaError_t e = cudaOccupancyMaxActiveClusters(&clusters, q4_wg_bulk_kernel<2, 128, true, 3, true>, &cfg);
    if (e == cudaSuccess)
      e = cudaOccupancyMaxActiveClusters(&clusters16, q4_wg_bulk_kernel<2, 128, true, 3, true, true>, &cfg);
    if (e != cudaSuccess) (void)cudaGetLastError();
    ready[S] = e == cudaSuccess && clusters > 0 && clusters16 > 0 ? 1 : 0;
  }
  return ready[S] == 1;
}

void launch_q4_wg_gate_mean(const Q4WgArgs& a, cudaStream_t stream) {
  CK_REQUIRE(a.n_jobs == 1 && a.units_per_block == 3 && a.unit_features == 64 && a.k_groups == a.groups &&
                 !a.split.partial && a.hc_x && a.hc_u && a.job[0].w.rows == a.hc_s * a.hc_h && a.hc_h % 64 == 0,
             "q4_wg_gate_mean: %d jobs, %d units a block of %d features, %d of %d groups, S %d, H %d", a.n_jobs,
             a.units_per_block, a.unit_features, a.k_groups, a.groups, a.hc_s, a.hc_h);
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = gate_mean_config(a, attr, stream);
  if (a.x_inv) CUDA_CHECK(cudaLaunchKernelEx(&cfg, q4_wg_bulk_kernel<2, 128, true, 3, true, true>, a));
  else CUDA_CHECK(cudaLaunchKernelEx(&cfg, q4_wg_bulk_kernel<2, 128, true, 3, true>, a));
}

}  // namespace ck::cuda
