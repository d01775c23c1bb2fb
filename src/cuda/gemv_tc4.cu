// GEMV for 1-8 activation rows, v4: MLX 4-bit (and, at some shapes, 8-bit) codes in groups of 64 x 2^k
// on the tensor cores, its kernels (the fragment kernel, the tile and pair kernels, their split-K
// reduces, the one-row kernel with block-built fragments), then their launchers and gemv_tc4, which
// gemv() (gemv.cu) tries first. fp32 activations and fp32 accumulation throughout.
//
// Schedules (docs/roofline-cuda.md):
//  v4 (4-bit codes, MLX groups of 64 x 2^k): the tensor cores. One activation row: 4- and 8-bit codes
//     of matrices up to kTcInWarpMax tiles x groups go to gemv_tc4_one_kernel (fragments built in the
//     block, K split over a thread-block cluster: one launch), the largest (the LM head) to the
//     streamed GEMV (gemv_stream.cu: weights brought into shared memory by tensor-map copies), the
//     others (in_proj, the attention projections) to a fragment kernel plus gemv_tc4_kernel; 2-8 rows
//     of tall 4-bit matrices to gemv_tc4_kernel. CK_GEMV=v3 turns v4 off, CK_GEMV_INWARP=0 the
//     one-row kernel, CK_GEMV_STREAM=0 the streamed one.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gdn_conv.cuh"
#include "cuda/gemv_internal.h"
#include "cuda/gemv_stream.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

#include <cooperative_groups.h>

namespace ck::cuda {
namespace {
namespace cg = cooperative_groups;

// ------------------------------------------------------------------ v4: 4-bit codes on the tensor cores

// The MLX 4-bit codes are small integers, exact in bf16, so a warp can multiply 16 weight rows by the
// activations with mma.m16n8k16 (bf16 in, fp32 accumulate) instead of dequantizing every code on the
// CUDA cores. The activations are not exact in bf16: each fp32 x is split into three bf16 parts
// (hi + mid + lo, 24 significant bits: fp32's), which go in three columns of the B operand, so one MMA
// serves up to two activation rows (3 columns each). Per 64-code group, as in the v3 arithmetic,
// y += s * Σ q x + b * Σ x, with Σ q x from the MMAs (fresh accumulators per group) and Σ x per group
// computed once. Per code this costs ~0.5 instructions (a SHF + LOP3 per pair: the codes come out as
// 128 + q, and the 128 goes into the bias, mma_q4.cuh code_pair_128) instead of ~3.
//
// K order: any permutation of k inside an MMA is fine as long as A and B use the same one. Lane
// (g = lane/4, t = lane%4) reads 8 bytes (two u32 words, 16 codes) of its rows g and g+8 per group:
// words 2t and 2t+1. A word's nibble pairs (i, i+4) come out of one mask as a bf16x2 (code i low,
// code i+4 high); step s of the group's 4 k16 steps takes pairs 2(s&1) and 2(s&1)+1 of word s/2.
// tc4_frag_kernel writes the B fragments (the x parts at the same physical columns) once per call, in
// the order lanes read them, so every warp loads them with one coalesced 8-byte load per step.
// Where v4 wins (H200, docs/performance.md): 2-8 activation rows on matrices of >= 1024 rows and
// >= 1024 columns (kernel lab: in_proj 8 rows 77.6 -> 30.9 us), and one row on jobs of >= 4096 rows in
// all (the LM head 272 -> 228 us; the DeltaNet in_proj and the attention q/k/v projections: decode
// 312 -> 329 tok/s end to end). The kernel lab timed back-to-back direct launches, which the host's
// launch cost bounds at ~20 us, so it hid the gain at one row on the projections: decode runs as a
// graph. Short K (the hyper-connection up projection, K = 320) stays on v3.
// True when every job suits the v4 kernels (codes of `bits` bits, 4 or 8, the same for all jobs,
// groups of 64 x 2^k, cols a multiple of the group); *bf16s when all their scales are bf16. Only the
// one-row kernel takes 8-bit codes (the routers).
bool tc4_suits(const GemvJob* jobs, int n_jobs, bool* bf16s, int* bits) {
  *bf16s = true;
  *bits = jobs[0].w.fmt.bits;
  for (int j = 0; j < n_jobs; ++j) {
    const DMatrix& w = jobs[j].w;
    const int gpg = w.fmt.group / 64;
    if (!w.quantized() || (w.fmt.bits != 4 && w.fmt.bits != 8) || w.fmt.bits != *bits || w.fmt.group % 64 != 0 ||
        (gpg & (gpg - 1)) != 0 || w.cols % w.fmt.group != 0)
      return false;
    *bf16s = *bf16s && w.fmt.scale_kind == static_cast<uint8_t>(WKind::BF16);
  }
  return true;
}

constexpr int kTcMinRows = 1024, kTcMinCols = 1024, kTcMinRowsOneRow = 4096;

struct TcLaunch {
  GemvJob job[kMaxGemvJobs];
  int32_t first_tile[kMaxGemvJobs + 1];  // job j owns 16-row tiles [first_tile[j], first_tile[j+1])
  int32_t n_jobs;
  int32_t groups;                        // K / 64
  int32_t ks;                            // warps that split one tile's groups (1, 2, 4, 8)
  const uint2* frag;                     // [groups][4 steps][NB][32 lanes]; one row: compact, [groups][48]
  const float* gsum;                     // [groups][8 NB]: Σ x of the group on each row's hi column; one row: [groups]
  int32_t prefetch;                      // ask L2 for the warp's weights before pdl_begin (CK_GEMV_PREFETCH)
  int32_t conv_prefetch;                 // and for its conv channels' taps and state (param_prefetch_on())
  GdnConvArgs conv;                      // gemv_tc4_kernel with conv.y: job 0's rows are conv channels
  const StepParams* conv_sp;             // (its x is not written: the conv output is)
  int32_t kb;                            // gemv_tc4_kernel: blocks (grid y) that split K; 1: none
  float* partial;                        // kb > 1: [kb][tiles * 16][R] sums, added by gemv_tc4_reduce_kernel
};

// grid (groups, vectors), block 128: group blockIdx.x's B fragments for R activation rows (nx real;
// the other columns zero), and its Σ x per column (one warp per column, a fixed shuffle order). With
// several vectors (gridDim.y > 1, R = 1: the decode experts' inputs), vector v's rows start at
// x + v * vec_x and its fragments and sums at frag + v * vec_frag, gsum + v * vec_gsum. R = 1 writes
// the compact one-row layout (mma_q4.cuh tc4_one_frag_elem) and one Σ x per group.
template <int R>
__global__ void __launch_bounds__(128) tc4_frag_kernel(const float* __restrict__ x, int ldx, int nx, uint2* frag,
                                                       float* gsum, int64_t vec_x = 0, int64_t vec_frag = 0,
                                                       int64_t vec_gsum = 0) {
  pdl_begin();
  constexpr int NB = (3 * R + 7) / 8, NC = 8 * NB;
  const int G = blockIdx.x;
  x += blockIdx.y * vec_x;
  frag += blockIdx.y * vec_frag;
  gsum += blockIdx.y * vec_gsum;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if constexpr (R == 1) {  // the compact one-row layout (mma_q4.cuh kOneFragWords), one Σ x per group
    for (int e = threadIdx.x; e < kOneFragWords; e += blockDim.x)
      frag[static_cast<size_t>(G) * kOneFragWords + e] = tc4_one_frag_elem(x + G * 64, e);
    if (warp == 0) {
      const float v = tc4_group_sum(x + G * 64);
      if (lane == 0) gsum[G] = v;
    }
  } else {
    tc4_rows_group_frags<NB>(x + G * 64, ldx, nx, frag + static_cast<size_t>(G) * 4 * NB * 32, gsum + G * NC);
  }
}

// The conv of a tile's 16 channels in a GEMV's epilogue reads their taps (16 K floats) and state (K - 1
// rows of 16 floats): first touches of the step, otherwise a DRAM round trip at the end. One warp asks
// L2 for them (lane by lane) before its pdl_begin.
__device__ __forceinline__ void conv_tile_prefetch(const GdnConvArgs& c, int row0, int lane) {
  const float* at = nullptr;
  if (lane * 32 < 16 * c.K) at = c.taps + static_cast<size_t>(row0) * c.K + 32 * lane;
  else if (lane >= 8 && lane - 8 < c.K - 1) at = c.state + static_cast<size_t>(lane - 8) * c.C + row0;
  if (at) prefetch_l2(at);
}

// The tile at rows row0.. of job j, one warp: value(m, r) is row m's sum for activation row r. Job 0's
// rows are the DeltaNet conv's channels with L.conv.y (lanes < 16, each channel over the rows in
// order); otherwise y = epi(value).
template <int R, class Value>
__device__ __forceinline__ void tc4_tile_epilogue(const TcLaunch& L, int j, int row0, int nx, const Value& value) {
  const int lane = threadIdx.x & 31;
  const GemvJob& jb = L.job[j];
  if (L.conv.y && j == 0) {
    if (lane < 16 && row0 + lane < jb.w.rows)
      gdn_conv_channel(L.conv, L.conv_sp->snap != 0, row0 + lane, nx, [&](int r) { return value(lane, r); });
    return;
  }
  for (int o = lane; o < 16 * R; o += 32) {
    const int m = o / R, r = o % R;
    if (r >= nx || row0 + m >= jb.w.rows) continue;
    jb.y[static_cast<size_t>(r) * jb.ldy + row0 + m] = apply_epilogue(value(m, r), jb.epi, jb.epi_arg);
  }
}

// block 256 = 8 warps = 8/ks tiles of 16 rows, each tile's groups split over ks warps (added in a
// fixed order through shared memory). grid: (tiles / (8/ks), kb): with kb > 1 block y takes the y-th
// of kb slices of the groups and writes its sums to L.partial, which gemv_tc4_reduce_kernel adds in
// slice order (R >= 2, no conv).
// Register caps keep 3-4 blocks (24-32 warps) per SM: with fewer the loads in flight cannot cover DRAM
// latency (1 block per SM, uncapped: lm_head at 1.2 TB/s).
// BITS = 8 (2-8 rows: the router and the shared expert's gate): the codes' nibbles on the same fragments
// (tc8_group_mma), two blocks per SM (twice the accumulators; such matrices are small: 32 blocks).
template <int R, bool BF16S, int BITS = 4>
__global__ void __launch_bounds__(256, BITS == 8 ? 2 : R <= 2 ? 4 : 3) gemv_tc4_kernel(const __grid_constant__ TcLaunch L,
                                                                                    int nx) {
  static_assert(BITS == 4 || R > 1, "the one-row 8-bit codes take gemv_tc4_one_kernel");
  constexpr int NB = (3 * R + 7) / 8, NC = 8 * NB;
  __shared__ float red[8][16][NC + 1];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ks = L.ks, part = warp % ks, tile = blockIdx.x * (8 / ks) + warp / ks;
  const int n_tiles = L.first_tile[L.n_jobs];
  int j = 0;
  while (j + 1 < L.n_jobs && tile >= L.first_tile[j + 1]) ++j;
  const DMatrix& w = L.job[j].w;
  const int row0 = (tile - L.first_tile[j]) * 16;
  float acc[NB][4] = {};
  const int per_z = (L.groups + L.kb - 1) / L.kb, Z0 = min(L.groups, static_cast<int>(blockIdx.y) * per_z),
            Z1 = min(L.groups, Z0 + per_z);
  const int per = (Z1 - Z0 + ks - 1) / ks, G0 = min(Z1, Z0 + part * per), G1 = min(Z1, G0 + per);
  Tc4Rows<BF16S, BITS> tr;
  if (tile < n_tiles) {
    tr.init(w, min(row0 + g, w.rows - 1), min(row0 + g + 8, w.rows - 1), t);
    if (L.prefetch) tr.prefetch(G0, G1, t);
    if (L.conv_prefetch && L.conv.y && j == 0 && part == 0) conv_tile_prefetch(L.conv, row0, lane);
  }
  pdl_begin();  // the fragments and group sums come from the kernel before
  if (tile < n_tiles) {
#pragma unroll 4
    for (int G = G0; G < G1; ++G) {
      std::conditional_t<BITS == 8, uint4, uint2> wa, wb;
      float sa, ba, sb, bb;
      tr.load(G, wa, wb, sa, ba, sb, bb);
      // One row: the compact fragments (mma_q4.cuh kOneFragWords) and one Σ x per group, on column 0.
      const uint2* fg = R == 1 ? L.frag + static_cast<size_t>(G) * kOneFragWords + tc4_one_frag_lane(g, t)
                               : L.frag + static_cast<size_t>(G) * 4 * NB * 32 + t * 8 + g;
      float d[NB][4] = {};  // the group's Σ (128 + q) x (8-bit: Σ q x), fresh per group
      if constexpr (BITS == 8) {
        tc8_group_mma<NB>(wa, wb, [&](int s, int nb) { return __ldg(fg + (s * NB + nb) * 32); }, d);
      } else {
        tc4_group_mma<NB>(wa, wb, [&](int s, int nb) {
          return R == 1 ? tc4_one_frag_ld(fg, s) : __ldg(fg + (s * NB + nb) * 32);
        }, d);
      }
      if constexpr (R == 1) {
        ba = bias_128(ba, sa);  // the codes are 128 + q (code_pair_128)
        bb = bias_128(bb, sb);
        const float x0 = t == 0 ? __ldg(L.gsum + G) : 0.0f;
        acc[0][0] = fmaf(sa, d[0][0], fmaf(ba, x0, acc[0][0]));
        acc[0][1] = fmaf(sa, d[0][1], acc[0][1]);
        acc[0][2] = fmaf(sb, d[0][2], fmaf(bb, x0, acc[0][2]));
        acc[0][3] = fmaf(sb, d[0][3], acc[0][3]);
      } else {
        const float* gs = L.gsum + G * NC + 2 * t;
        tc4_group_accumulate<NB, BITS == 4>(d, sa, ba, sb, bb, [&](int nb, int c) { return __ldg(gs + nb * 8 + c); }, acc);
      }
    }
  }
  // Rows g, g+8 x columns (2t, 2t+1) of each MMA -> this warp's tile in shared memory.
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    red[warp][g][nb * 8 + 2 * t] = acc[nb][0];
    red[warp][g][nb * 8 + 2 * t + 1] = acc[nb][1];
    red[warp][g + 8][nb * 8 + 2 * t] = acc[nb][2];
    red[warp][g + 8][nb * 8 + 2 * t + 1] = acc[nb][3];
  }
  __syncthreads();
  if (part != 0 || tile >= n_tiles) return;
  // The tile's ks parts in index order, then y = hi + mid + lo per row.
  auto value = [&](int m, int r) {
    float c[3];
    for (int q = 0; q < 3; ++q) {
      float v = 0.0f;
      for (int k = 0; k < ks; ++k) v += red[warp + k][m][3 * r + q];
      c[q] = v;
    }
    return (c[0] + c[1]) + c[2];
  };
  if (L.conv.y && j == 0) {  // the DeltaNet conv of channel row0 + lane over the rows, in order
    if (lane < 16 && row0 + lane < w.rows)
      gdn_conv_channel(L.conv, L.conv_sp->snap != 0, row0 + lane, nx, [&](int r) { return value(lane, r); });
    return;
  }
  if (L.kb > 1) {  // this slice's sums, for gemv_tc4_reduce_kernel
    float* p = L.partial + (static_cast<size_t>(blockIdx.y) * n_tiles + tile) * 16 * R;
    for (int o = lane; o < 16 * R; o += 32) {
      const int m = o / R, r = o % R;
      if (r < nx && row0 + m < w.rows) p[o] = value(m, r);
    }
    return;
  }
  tc4_tile_epilogue<R>(L, j, row0, nx, value);
}

// R activation rows through tiled 4-bit matrices with each warp on two tiles: block b takes tiles 2b
// and 2b + 1 (any jobs), and warp w groups [w per, (w + 1) per) of both (per = ceil(groups / 8)), both
// tiles' loads of a group issued before either's products, the eight parts of a tile added in warp
// order through shared memory; then the epilogue of gemv_tc4_kernel<R> (the DeltaNet conv for job 0's
// channels with L.conv.y, else y = epi(value)). No K split over blocks (L.kb is 1). R = 1 reads the
// compact one-row fragments; R = 2, 4 gemv_tc4_kernel<R>'s fragments, loaded once for both tiles.
// Why: gemv_tc4_kernel<1> gives each warp one tile and a quarter of its groups (ks = 4: 10 groups at
// K = 2,560), one group's loads in flight at a time (its Tc4Rows load branches on the layout, and the
// compiler does not hoist the next group's loads over it): ten dependent round trips to L2 a warp. In
// Nsight Compute (H200 2026-12-02 07:11Z, the in_proj at one row, 515 blocks): 16.4 us for 24 MB, 51%
// of the warps' samples on long scoreboard, 21% of all on the first group's weights. Here the same
// warps (4,120 for 1,030 tiles: one wave at 4 blocks per SM) make five round trips, each twice the
// bytes: 13.86 us alone (Nsight Compute, 07:23Z), one-row decode +1.1% in the second of two calls
// (07:30Z: 648.1 / 653.2 / 652.8 tok/s against 642.9 / 644.6 / 645.6; 07:21Z: 653.4 / 653.8 / 655.9
// against 651.4 / 644.2 / 638.2). The parts are eight of five groups instead of four of ten, so the
// sums round differently from gemv_tc4_kernel<1> (CK_GEMV_PAIRS=0 launches that instead). The one-row
// out projections stay on gemv_tc4_one_kernel: on this kernel with x's fragment kernel before it,
// decode lost 4.1%.
// R = 2, 4: the same pairing for the 2-4-row in_proj and q/k/v, whose gemv_tc4_kernel<R> has the same
// ks = 4 and ten groups a warp. Measured (H200 2026-12-02 12:33Z, three interleaved rounds against
// CK_GEMV_PAIRS_ROWS=0): 4-row decode 1,461 / 1,470 / 1,465 tok/s against 1,419 / 1,431 / 1,420
// (+3.0%), 2-row 1,027 / 1,021 against 1,001 / 1,004 (+2.2%). Its CPU checks: InProjGemvConvolvesInItsEpilogue
// (the tiled 3-row case) and the 2-8-row model tests. R = 8 is not taken: unrolled once it still
// spills 208 bytes at the 3-blocks-an-SM cap.
// grid ceil(tiles / 2), block 256.
template <int R, bool BF16S>
__global__ void __launch_bounds__(256, R <= 2 ? 4 : 3) gemv_tc4_pair_kernel(const __grid_constant__ TcLaunch L,
                                                                          int nx) {
  // Columns kept per tile row: one row's (hi, mid, lo), or gemv_tc4_kernel<R>'s NC (+1: its padding).
  constexpr int NB = (3 * R + 7) / 8, NC = 8 * NB, NR = R == 1 ? 3 : NC + 1;
  __shared__ float red[8][2][16][NR];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int n_tiles = L.first_tile[L.n_jobs];
  int jq[2], rq[2];  // each tile's job and first row (a block's second tile past the end repeats the first)
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int tile = min(static_cast<int>(blockIdx.x) * 2 + q, n_tiles - 1);
    int j = 0;
    while (j + 1 < L.n_jobs && tile >= L.first_tile[j + 1]) ++j;
    jq[q] = j;
    rq[q] = (tile - L.first_tile[j]) * 16;
  }
  const bool second = static_cast<int>(blockIdx.x) * 2 + 1 < n_tiles;
  const int per = (L.groups + 7) / 8, G0 = min(L.groups, warp * per), G1 = min(L.groups, G0 + per);
  Tc4Rows<BF16S, 4, true> tr[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const DMatrix& w = L.job[jq[q]].w;
    tr[q].init(w, min(rq[q] + g, w.rows - 1), min(rq[q] + g + 8, w.rows - 1), t);
    if (L.prefetch && (q == 0 || second)) tr[q].prefetch(G0, G1, t);
  }
  // The conv channels' taps and state: warp q for tile q.
  if (L.conv_prefetch && L.conv.y && warp < 2 && jq[warp] == 0 && (warp == 0 || second))
    conv_tile_prefetch(L.conv, rq[warp], lane);
  pdl_begin();  // the fragments and group sums come from the kernel before
  float acc[2][NB][4] = {};
  constexpr int kUnroll = R == 1 ? 2 : 1;  // (2-8 rows unrolled twice spilled: 68 bytes at R = 4)
#pragma unroll kUnroll
  for (int G = G0; G < G1; ++G) {
    uint2 wa[2], wb[2];
    float sa[2], ba[2], sb[2], bb[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) tr[q].load(G, wa[q], wb[q], sa[q], ba[q], sb[q], bb[q]);
    if constexpr (R == 1) {  // the compact one-row fragments and one Σ x per group
      uint2 b[4];
      const float x0 = tc4_one_frags_group(L.frag + tc4_one_frag_lane(g, t), L.gsum, G, t, b);
#pragma unroll
      for (int q = 0; q < 2; ++q) tc4_one_mma_regs(wa[q], wb[q], sa[q], ba[q], sb[q], bb[q], b, x0, acc[q][0]);
    } else {  // gemv_tc4_kernel<R>'s loads and arithmetic, the fragments once for both tiles
      const uint2* fg = L.frag + static_cast<size_t>(G) * 4 * NB * 32 + t * 8 + g;
      uint2 b[4][NB];
#pragma unroll
      for (int st = 0; st < 4; ++st)
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) b[st][nb] = __ldg(fg + (st * NB + nb) * 32);
      const float* gs = L.gsum + G * NC + 2 * t;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        float d[NB][4] = {};
        tc4_group_mma<NB>(wa[q], wb[q], [&](int st, int nb) { return b[st][nb]; }, d);
        tc4_group_accumulate<NB, true>(d, sa[q], ba[q], sb[q], bb[q], [&](int nb, int c) { return __ldg(gs + nb * 8 + c); },
                                       acc[q]);
      }
    }
  }
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    if constexpr (R == 1) {  // columns 0-2 (hi, mid, lo) of rows g and g + 8: lanes t = 0 (0, 1) and t = 1 (2)
      if (t == 0) {
        red[warp][q][g][0] = acc[q][0][0];
        red[warp][q][g][1] = acc[q][0][1];
        red[warp][q][g + 8][0] = acc[q][0][2];
        red[warp][q][g + 8][1] = acc[q][0][3];
      } else if (t == 1) {
        red[warp][q][g][2] = acc[q][0][0];
        red[warp][q][g + 8][2] = acc[q][0][2];
      }
    } else {  // rows g, g + 8 x columns (2t, 2t + 1) of each MMA
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        red[warp][q][g][nb * 8 + 2 * t] = acc[q][nb][0];
        red[warp][q][g][nb * 8 + 2 * t + 1] = acc[q][nb][1];
        red[warp][q][g + 8][nb * 8 + 2 * t] = acc[q][nb][2];
        red[warp][q][g + 8][nb * 8 + 2 * t + 1] = acc[q][nb][3];
      }
    }
  }
  __syncthreads();
  // Warp q (of 0, 1) finishes tile q: each row's columns summed over the parts in warp order, then
  // (hi + mid) + lo.
  if constexpr (R == 1) {  // lane m < 16: row m
    if (warp >= 2 || lane >= 16 || (warp == 1 && !second)) return;
    const int q = warp, m = lane, j = jq[q], row = rq[q] + m;
    const DMatrix& w = L.job[j].w;
    if (row >= w.rows) return;
    float c[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      float v = 0.0f;
#pragma unroll
      for (int pw = 0; pw < 8; ++pw) v += red[pw][q][m][k];
      c[k] = v;
    }
    const float value = (c[0] + c[1]) + c[2];
    if (L.conv.y && j == 0) {  // the DeltaNet conv of channel `row` (one activation row)
      gdn_conv_channel(L.conv, L.conv_sp->snap != 0, row, nx, [&](int) { return value; });
      return;
    }
    const GemvJob& jb = L.job[j];
    jb.y[row] = apply_epilogue(value, jb.epi, jb.epi_arg);
    return;
  }
  if (warp >= 2 || (warp == 1 && !second)) return;
  const int q = warp, j = jq[q], row0 = rq[q];
  auto value = [&](int m, int r) {
    float c[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      float v = 0.0f;
#pragma unroll
      for (int pw = 0; pw < 8; ++pw) v += red[pw][q][m][3 * r + k];
      c[k] = v;
    }
    return (c[0] + c[1]) + c[2];
  };
  tc4_tile_epilogue<R>(L, j, row0, nx, value);
}

// grid ceil(tiles 16 R / 256), block 256: y = epi(Σ_z partial_z) for each (job row, activation row),
// the kb slices of gemv_tc4_kernel added in slice order.
template <int R>
__global__ void gemv_tc4_reduce_kernel(const __grid_constant__ TcLaunch L, int nx) {
  pdl_begin();
  const int n_tiles = L.first_tile[L.n_jobs];
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);  // (tile 16 + m) R + r
  if (i >= n_tiles * 16 * R) return;
  const int r = i % R, tm = i / R, tile = tm / 16;
  if (r >= nx) return;
  int j = 0;
  while (j + 1 < L.n_jobs && tile >= L.first_tile[j + 1]) ++j;
  const GemvJob& jb = L.job[j];
  const int row = (tile - L.first_tile[j]) * 16 + tm % 16;
  if (row >= jb.w.rows) return;
  float v = 0.0f;
  for (int z = 0; z < L.kb; ++z) v += L.partial[static_cast<size_t>(z) * n_tiles * 16 * R + i];
  jb.y[static_cast<size_t>(r) * jb.ldy + row] = apply_epilogue(v, jb.epi, jb.epi_arg);
}

// gemv_tc4_reduce_kernel for launches whose job 0 also hands its output on as R-row fragments
// (GemvJob::frags_out): grid ceil(tiles 16 / 64), block 256; block b adds the outputs of rows
// [64 b, 64 b + 64) for every activation row, the same sums and epilogue, and when those rows are
// 64-group b of job 0's output (job 0's rows a multiple of 64) it writes the group's fragments and
// sums from them: tc4_frag_kernel<R>'s words and bits, read from shared memory instead of y.
// Why: at 2-8 rows the mix's low-rank d (5 groups) went through a fragment kernel of its own before
// the up projection, a kernel boundary and an L2 round trip on the step's chain (33 a step).
template <int R>
__global__ void __launch_bounds__(256) gemv_tc4_reduce_frag_kernel(const __grid_constant__ TcLaunch L, int nx,
                                                                   uint2* __restrict__ frag, float* __restrict__ gsum) {
  constexpr int NB = (3 * R + 7) / 8, NC = 8 * NB;
  __shared__ float sy[R][64];
  pdl_begin();
  const int n_tiles = L.first_tile[L.n_jobs];
  const int G = static_cast<int>(blockIdx.x);
#pragma unroll 1
  for (int q = static_cast<int>(threadIdx.x); q < 64 * R; q += blockDim.x) {
    const int i = G * 64 * R + q;  // (tile 16 + m) R + r, as gemv_tc4_reduce_kernel
    const int r = i % R, tm = i / R, tile = tm / 16;
    float out = 0.0f;
    if (tile < n_tiles && r < nx) {
      int j = 0;
      while (j + 1 < L.n_jobs && tile >= L.first_tile[j + 1]) ++j;
      const GemvJob& jb = L.job[j];
      const int row = (tile - L.first_tile[j]) * 16 + tm % 16;
      if (row < jb.w.rows) {
        float v = 0.0f;
        for (int z = 0; z < L.kb; ++z) v += L.partial[static_cast<size_t>(z) * n_tiles * 16 * R + i];
        out = apply_epilogue(v, jb.epi, jb.epi_arg);
        jb.y[static_cast<size_t>(r) * jb.ldy + row] = out;
      }
    }
    sy[r][q / R] = out;
  }
  if (64 * (G + 1) > L.job[0].w.rows) return;  // not one of job 0's groups (the same on every thread)
  __syncthreads();
  tc4_rows_group_frags<NB>(&sy[0][0], 64, nx, frag + static_cast<size_t>(G) * 4 * NB * 32, gsum + G * NC);
}

// v4 at one activation row with the fragments built in the block (decode's small and middle-sized
// matrices: the hyper-connection down 320 x 10,240 and up 10,240 x 320, the DeltaNet out projection
// 2,560 x 6,144). The two-kernel form above spends a fragment-kernel launch (~3 us in a graph) and,
// for short wide matrices, the v3 path spent a split-K reduce kernel (~2.6 us) on top of ~8 us of
// work: these jobs are latency-bound.
// K is split over the kb blocks of a thread-block cluster (grid x = kb, cluster (kb, 1, 1)) and, inside
// a block's K range, over ks warps; a block holds 8 / ks tiles of 16 rows. The block first turns its K
// range of x into B fragments in shared memory (lane (g, t) of a warp reads the 16 floats x[64G + 16t,
// +16) of a group, its words' columns (mma_q4.cuh), and lanes g = 0, 1, 2 make the hi, mid and lo
// parts of MMA columns 0-2; the other lanes give zero columns), once per group for all its tiles. The
// cluster's rank-0 block adds the parts in index order (warps, then blocks) from the others' shared
// memory: deterministic, no global scratch, no second kernel.
// Tiles x groups of a launch. Above it (the DeltaNet in_proj: 1,030 x 40) the two-kernel form was
// faster on 2026-11-30: 427.8 against 422.1 tok/s with in_proj here (CK_GEMV_INWARP_MAX=65536).
constexpr int kTcInWarpMax = 16384;

// Where a warp of gemv_tc4_one_kernel / gemv_tc4_rows_kernel works: its tile (of job j, first row
// row0), its part of the tile's K split over the block's warps, the block's K range [B0, B1) (cluster
// rank blockIdx.x of kb, per_b groups a rank) and the warp's part [G0, G1) of it.
struct TcOnePlace {
  int tile, part, j, row0, per_b, B0, B1, G0, G1;
  __device__ __forceinline__ TcOnePlace(const TcLaunch& L, int warp, int kb) {
    const int ks = L.ks;
    tile = blockIdx.y * (8 / ks) + warp / ks;
    part = warp % ks;
    j = 0;
    while (j + 1 < L.n_jobs && tile >= L.first_tile[j + 1]) ++j;
    row0 = (tile - L.first_tile[j]) * 16;
    per_b = (L.groups + kb - 1) / kb;
    B0 = min(L.groups, static_cast<int>(blockIdx.x) * per_b);
    B1 = min(L.groups, B0 + per_b);
    const int per = (B1 - B0 + ks - 1) / ks;
    G0 = min(B1, B0 + part * per);
    G1 = min(B1, G0 + per);
  }
};

// Dynamic shared memory: [range groups][4 steps][32 lanes] uint2 fragments, then [range groups] Σ x.
template <bool BF16S, int BITS>
__global__ void __launch_bounds__(256, 3) gemv_tc4_one_kernel(const __grid_constant__ TcLaunch L,
                                                              const float* __restrict__ x, int kb) {
  extern __shared__ uint2 sfrag[];
  __shared__ float red[8][16][3];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ks = L.ks, n_tiles = L.first_tile[L.n_jobs];
  const TcOnePlace at(L, warp, kb);
  const int tile = at.tile, part = at.part, j = at.j, row0 = at.row0, per_b = at.per_b, B0 = at.B0, B1 = at.B1,
            G0 = at.G0, G1 = at.G1;
  const DMatrix& w = L.job[j].w;
  float* sgs = reinterpret_cast<float*>(sfrag + static_cast<size_t>(per_b) * 4 * 32);
  float acc[4] = {};
  Tc4Rows<BF16S, BITS> tr;
  if (tile < n_tiles) {
    tr.init(w, min(row0 + g, w.rows - 1), min(row0 + g + 8, w.rows - 1), t);
    if (L.prefetch) tr.prefetch(G0, G1, t);
  }
  pdl_begin();  // x comes from the kernel before
  one_row_frags_in_block<2>(x, B0, B1, sfrag, sgs);
  __syncthreads();
  if (tile < n_tiles) {
#pragma unroll 2
    for (int G = G0; G < G1; ++G) {
      const float xs = t == 0 ? sgs[G - B0] : 0.0f;
      if constexpr (BITS == 4) {
        tc4_one_group(tr, G, sfrag + static_cast<size_t>(G - B0) * 4 * 32 + lane, xs, acc);
      } else {
        // 8-bit codes: two nibble MMAs a step (tc8_group_mma), plain codes.
        const uint2* f = sfrag + static_cast<size_t>(G - B0) * 4 * 32 + lane;
        float sa, ba, sb, bb;
        uint4 wa, wb;
        tr.load(G, wa, wb, sa, ba, sb, bb);
        float dd[1][4] = {};
        tc8_group_mma<1>(wa, wb, [&](int s, int) { return f[32 * s]; }, dd);
        const float(&d)[4] = dd[0];
        acc[0] = fmaf(sa, d[0], fmaf(ba, xs, acc[0]));
        acc[1] = fmaf(sa, d[1], acc[1]);
        acc[2] = fmaf(sb, d[2], fmaf(bb, xs, acc[2]));
        acc[3] = fmaf(sb, d[3], acc[3]);
      }
    }
  }
  // Columns 0-2 (hi, mid, lo) of rows g and g+8: lanes t = 0 (columns 0, 1) and t = 1 (column 2).
  if (t == 0) {
    red[warp][g][0] = acc[0];
    red[warp][g][1] = acc[1];
    red[warp][g + 8][0] = acc[2];
    red[warp][g + 8][1] = acc[3];
  } else if (t == 1) {
    red[warp][g][2] = acc[0];
    red[warp][g + 8][2] = acc[2];
  }
  __syncthreads();
  // Each block adds its tiles' ks parts in index order (into the first part's slot), then the
  // cluster's rank 0 adds the blocks' sums in rank order. The kb remote loads are issued together:
  // one dependent DSMEM load after another cost ~0.1 us each (13.5 us per call with kb = ks = 8).
  const bool owner = part == 0 && tile < n_tiles && lane < 16;
  if (owner)
    for (int q = 0; q < 3; ++q) {
      float v = red[warp][lane][q];
      for (int k = 1; k < ks; ++k) v += red[warp + k][lane][q];
      red[warp][lane][q] = v;
    }
  cg::cluster_group cluster = cg::this_cluster();
  if (kb > 1) cluster.sync();
  if (blockIdx.x == 0 && owner && row0 + lane < w.rows) {
    constexpr int kMaxKb = 8;
    float part_sum[kMaxKb][3];
#pragma unroll
    for (int r = 0; r < kMaxKb; ++r)
      if (r < kb) {
        const float(*rr)[16][3] = r == 0 ? red : cluster.map_shared_rank(red, r);
#pragma unroll
        for (int q = 0; q < 3; ++q) part_sum[r][q] = rr[warp][lane][q];
      }
    float c[3];
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      c[q] = part_sum[0][q];
#pragma unroll
      for (int r = 1; r < kMaxKb; ++r)
        if (r < kb) c[q] += part_sum[r][q];
    }
    const GemvJob& jb = L.job[j];
    jb.y[row0 + lane] = apply_epilogue((c[0] + c[1]) + c[2], jb.epi, jb.epi_arg);
  }
  if (kb > 1) cluster.sync();  // the other blocks' shared memory stays until rank 0 has read it
}

// gemv_tc4_one_kernel for 2-8 activation rows (row r at x + r ldx; nx of them), 4-bit codes: the same
// split of K over a cluster's blocks and a block's warps, the same tiles, and the same MMAs. NS (1, 2
// or 4) sets of B fragments, one MMA each per step on the same unpacked codes: set c carries row 2c in
// columns 0-2 and row 2c + 1 in columns 3-5, which the one-row kernel leaves zero (mma_q4.cuh
// tc4_one_frag<2>; past nx a set repeats the last row, whose copy is not written). Row 0's sums are
// the one-row kernel's, in the same order, and every other row's the same order over its columns: each
// row gets the bits the one-row kernel gives it alone. Why: a 2-8-row step (a token and its drafts)
// ran its small and middle-sized GEMVs as a fragment kernel, the tile kernel and, where K is split over
// blocks, a reduce (the mixes' down projections), where one row runs one launch: the 2-row step's
// GEMVs cost twice the one-row step's for the same weights, the 4-row step's 2.6 times (sixty-third
// session, docs/roofline-cuda.md). Dynamic shared memory: the NS sets' fragments (set c of the block's
// nb groups at sfrag + c nb 128), then [NS][nb][2] Σ x. NS = 4 keeps two blocks an SM (its 16
// accumulators and 16 products a group do not fit 85 registers; rows_block_groups).
template <bool BF16S, int NS>
__global__ void __launch_bounds__(256, NS == 4 ? 2 : 3) gemv_tc4_rows_kernel(const __grid_constant__ TcLaunch L,
                                                               const float* __restrict__ x, int ldx, int nx, int kb) {
  extern __shared__ uint2 sfrag[];
  __shared__ float red[8][16][6 * NS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ks = L.ks, n_tiles = L.first_tile[L.n_jobs];
  const TcOnePlace at(L, warp, kb);
  const int tile = at.tile, part = at.part, j = at.j, row0 = at.row0, per_b = at.per_b, B0 = at.B0, B1 = at.B1,
            nb = B1 - B0, G0 = at.G0, G1 = at.G1;
  const DMatrix& w = L.job[j].w;
  float* sgs = reinterpret_cast<float*>(sfrag + static_cast<size_t>(NS) * per_b * 4 * 32);
  float acc[NS][4] = {};
  Tc4Rows<BF16S, 4> tr;
  if (tile < n_tiles) {
    tr.init(w, min(row0 + g, w.rows - 1), min(row0 + g + 8, w.rows - 1), t);
    if (L.prefetch) tr.prefetch(G0, G1, t);
  }
  pdl_begin();  // x comes from the kernel before
  if constexpr (NS == 1) {
    one_row_frags_in_block<2, 2>(x, B0, B1, sfrag, sgs, ldx);
  } else {  // 8 / NS warps a set: set c of rows 2c and 2c + 1, the last row again where there are fewer
    constexpr int W = 8 / NS;
    const int c = warp / W, ra = min(2 * c, nx - 1), rb = min(2 * c + 1, nx - 1);
    one_row_frags_in_warps<2, false, 2>(x + static_cast<size_t>(ra) * ldx, B0, B1, sfrag + c * nb * 128,
                                        sgs + 2 * c * nb, warp % W, W, (rb - ra) * ldx);
  }
  __syncthreads();
  if (tile < n_tiles) {
#pragma unroll 2
    for (int G = G0; G < G1; ++G) {
      float sa, ba, sb, bb;
      uint2 wa, wb;
      tr.load(G, wa, wb, sa, ba, sb, bb);
      const uint2* f = sfrag + static_cast<size_t>(G - B0) * 4 * 32 + lane;
      float d[NS][4] = {};
      tc4_group_mma<NS>(wa, wb, [&](int s, int c) { return f[c * nb * 128 + 32 * s]; }, d);
      const float bia = bias_128(ba, sa), bib = bias_128(bb, sb);
#pragma unroll
      for (int c = 0; c < NS; ++c) {  // the bias terms on each row's hi column: 0 (t = 0) and 3 (t = 1)
        const float* gs = sgs + 2 * (c * nb + G - B0);
        const float xs0 = t == 0 ? gs[0] : 0.0f, xs1 = t == 1 ? gs[1] : 0.0f;
        acc[c][0] = fmaf(sa, d[c][0], fmaf(bia, xs0, acc[c][0]));
        acc[c][1] = fmaf(sa, d[c][1], fmaf(bia, xs1, acc[c][1]));
        acc[c][2] = fmaf(sb, d[c][2], fmaf(bib, xs0, acc[c][2]));
        acc[c][3] = fmaf(sb, d[c][3], fmaf(bib, xs1, acc[c][3]));
      }
    }
  }
  // Columns 0-5 of each set (row 2c's hi, mid, lo, then row 2c + 1's) of rows g and g + 8: lanes
  // t = 0, 1, 2. The sums below are gemv_tc4_one_kernel's over 6 NS columns instead of three, written
  // out again: the same code as a helper shared with that kernel moved its SASS (8 instructions), which
  // is measured on the one-row step's path.
  if (t < 3)
#pragma unroll
    for (int c = 0; c < NS; ++c) {
      red[warp][g][6 * c + 2 * t] = acc[c][0];
      red[warp][g][6 * c + 2 * t + 1] = acc[c][1];
      red[warp][g + 8][6 * c + 2 * t] = acc[c][2];
      red[warp][g + 8][6 * c + 2 * t + 1] = acc[c][3];
    }
  __syncthreads();
  const bool owner = part == 0 && tile < n_tiles && lane < 16;
  if (owner)
    for (int q = 0; q < 6 * NS; ++q) {
      float v = red[warp][lane][q];
      for (int k = 1; k < ks; ++k) v += red[warp + k][lane][q];
      red[warp][lane][q] = v;
    }
  cg::cluster_group cluster = cg::this_cluster();
  if (kb > 1) cluster.sync();
  if (blockIdx.x == 0 && owner && row0 + lane < w.rows) {
    constexpr int kMaxKb = 8;
    const GemvJob& jb = L.job[j];
#pragma unroll
    for (int c = 0; c < NS; ++c) {  // a set at a time: 48 partial sums in registers, not 48 NS
      float part_sum[kMaxKb][6];
#pragma unroll
      for (int r = 0; r < kMaxKb; ++r)
        if (r < kb) {
          const float(*rr)[16][6 * NS] = r == 0 ? red : cluster.map_shared_rank(red, r);
#pragma unroll
          for (int q = 0; q < 6; ++q) part_sum[r][q] = rr[warp][lane][6 * c + q];
        }
      float s[6];
#pragma unroll
      for (int q = 0; q < 6; ++q) {
        s[q] = part_sum[0][q];
#pragma unroll
        for (int r = 1; r < kMaxKb; ++r)
          if (r < kb) s[q] += part_sum[r][q];
      }
      if (2 * c < nx)
        jb.y[static_cast<size_t>(2 * c) * jb.ldy + row0 + lane] = apply_epilogue((s[0] + s[1]) + s[2], jb.epi, jb.epi_arg);
      if (2 * c + 1 < nx)
        jb.y[static_cast<size_t>(2 * c + 1) * jb.ldy + row0 + lane] =
            apply_epilogue((s[3] + s[4]) + s[5], jb.epi, jb.epi_arg);
    }
  }
  if (kb > 1) cluster.sync();  // the other blocks' shared memory stays until rank 0 has read it
}

// gemv_tc4's K split over blocks applies while the grid would have fewer blocks than this
// (CK_GEMV_TC_SPLIT_BELOW; 0 turns it off): the SM count by default (H200 08:34Z, decode at 4 rows
// 1,127 / 1,138 tok/s with it, 1,121 / 1,115 at half of it, 1,062 / 1,076 without a split): the mix's
// down projection (21 blocks, ks 8) takes 8 slices (4 at half), its up projection (80 blocks) 2.
int tc_split_below() {
  static const int v = [] {
    const char* e = std::getenv("CK_GEMV_TC_SPLIT_BELOW");
    return e ? std::max(0, std::atoi(e)) : sm_count();
  }();
  return v;
}

// That split is made only for a K of at least this many groups (CK_GEMV_SPLIT_MIN_GROUPS; default 8):
// the 2-8-row mix's up projection (K = 320: 5 groups) was cut into slices of 3 and 2 groups a warp
// with a reduce kernel after them, one more kernel per mix (33 a step) for two groups less on each
// warp's chain.
// Unsplit (H200 2026-12-02 12:42Z, two interleaved rounds, 4 rows): 1,495.9 / 1,492.2 tok/s against
// 1,478.5 / 1,490.1 (+0.6%), 390 kernels a step instead of 423; 12:57Z 1,470.0 / 1,475.6 against
// 1,460.8 / 1,458.6; at 2 rows level (1,025.7 / 1,018.2 against 1,030.6 / 1,017.6).
// CK_GEMV_SPLIT_MIN_GROUPS=0: split as before. A floor of 48 (the 8-bit routers, K = 2,560, unsplit
// too; 374 kernels) read +1.0% at 12:57Z and level at 13:09Z (1,450.2 / 1,466.3 against 1,464.8 /
// 1,460.0), and sends tiled K = 2,560 calls that had split to gemv_tc4_pair_kernel, whose sums round
// differently from the row layout's (TiledWeightsGiveTheRowLayoutsBits): not taken.
int tc_split_min_groups() {
  static const int v = [] {
    const char* e = std::getenv("CK_GEMV_SPLIT_MIN_GROUPS");
    return e ? std::max(0, std::atoi(e)) : 8;
  }();
  return v;
}

template <int R>
void launch_tc4(TcLaunch L, const float* x, int ldx, int nx, bool bf16s, int bits, cudaStream_t s, const Tc4Frags* pre) {
  constexpr int NB = (3 * R + 7) / 8;
  const unsigned grid = static_cast<unsigned>(ceil_div(L.first_tile[L.n_jobs], 8 / L.ks));
  uint8_t* scratch = nullptr;
  Tc4Frags* out = L.job[0].frags_out;  // (gemv() cleared its rR; set below when this launch writes them)
  if (R == 1 && pre && pre->covers(x, ldx, 1, L.groups)) {  // fragments made by the producer of x
    L.frag = pre->frag;
    L.gsum = pre->gsum;
  } else if (R > 1 && pre && pre->covers_rows(x, ldx, nx, L.groups, R)) {  // the same, in the R-row layout
    L.frag = pre->rfrag;
    L.gsum = pre->rgsum;
  } else {  // this call's own, stream-ordered (so graph-capturable)
    const size_t frag_bytes = static_cast<size_t>(L.groups) * 4 * NB * 32 * sizeof(uint2);
    scratch = static_cast<decltype(scratch)>(scratch_alloc(frag_bytes + sizeof(float) * L.groups * 8 * NB, s));
    uint2* frag = reinterpret_cast<uint2*>(scratch);
    float* gsum = reinterpret_cast<float*>(scratch + frag_bytes);
    Tc4Frags own;
    tc4_make_frags(x, ldx, nx, L.groups, frag, gsum, &own, s);  // (tc4_frag_kernel<R>: nx rows make this R)
    L.frag = frag;
    L.gsum = gsum;
  }
  // K split over blocks (2-8 rows, no conv, K of tc_split_min_groups() groups or more) while the grid
  // has fewer blocks than tc_split_below() and each warp keeps at least two groups: the hyper-connection mix's down projection at 2-8 rows (21
  // tiles, K = 10,240, on the tile kernel because its weights are tiles) ran on 21 blocks, 16.7 us a
  // call at 4 rows (Nsight Compute, 2026-12-01 08:29Z), ~0.1 TB/s.
  const int n_tiles = L.first_tile[L.n_jobs];
  if (R > 1 && !L.conv.y && L.groups >= tc_split_min_groups())  // (L.kb is 1 from tc_launch_of)
    while (L.kb < 8 && static_cast<int>(grid) * L.kb < tc_split_below() && L.groups >= 4 * L.ks * L.kb) L.kb *= 2;
  // Tiles only, no K split: two tiles a warp (gemv_tc4_pair_kernel) at 1, 2 and 4 rows (at 8 it
  // spills 208 bytes). CK_GEMV_PAIRS=0: at no row count; CK_GEMV_PAIRS_ROWS=0: at one row only. (The
  // pair kernel instead of a K split, for the 2-4-row out projections' 160 tiles: level, 12:42Z.)
  {
    static const bool pairs_on = !env_is("CK_GEMV_PAIRS", "0"), pairs_rows = !env_is("CK_GEMV_PAIRS_ROWS", "0");
    bool all_tiled = true;
    for (int j = 0; j < L.n_jobs; ++j) all_tiled = all_tiled && L.job[j].w.tiled();
    if (pairs_on && (R == 1 || (pairs_rows && R <= 4)) && bits == 4 && all_tiled && L.kb == 1 && L.groups >= 16) {
      const unsigned pgrid = static_cast<unsigned>(ceil_div(n_tiles, 2));
      launch(bf16s ? gemv_tc4_pair_kernel<R, true> : gemv_tc4_pair_kernel<R, false>, pgrid, 256, 0, s, L, nx);
      CUDA_CHECK_LAUNCH();
      if (scratch) scratch_free(scratch, s);
      return;
    }
  }
  if (L.kb > 1)
    L.partial = static_cast<decltype(L.partial)>(scratch_alloc(sizeof(float) * L.kb * n_tiles * 16 * R, s));
  const dim3 g2(grid, static_cast<unsigned>(L.kb));
  auto kernel = bf16s ? gemv_tc4_kernel<R, true> : gemv_tc4_kernel<R, false>;
  if constexpr (R > 1)  // gemv_tc4's 8-bit rows
    if (bits == 8) kernel = bf16s ? gemv_tc4_kernel<R, true, 8> : gemv_tc4_kernel<R, false, 8>;
  launch(kernel, g2, 256, 0, s, L, nx);
  CUDA_CHECK_LAUNCH();
  if (L.kb > 1) {
    if (R > 1 && out && out->rfrag && out->rgsum && L.job[0].w.rows % 64 == 0) {  // job 0's output as fragments too
      launch(gemv_tc4_reduce_frag_kernel<R>, static_cast<unsigned>(ceil_div(n_tiles * 16, 64)), 256, 0, s, L, nx,
             out->rfrag, out->rgsum);
      out->x = L.job[0].y;
      out->ldx = L.job[0].ldy;
      out->rows = nx;
      out->groups = L.job[0].w.rows / 64;
      out->rR = R;
    } else {
      launch(gemv_tc4_reduce_kernel<R>, static_cast<unsigned>(ceil_div(n_tiles * 16 * R, 256)), 256, 0, s, L, nx);
    }
    CUDA_CHECK_LAUNCH();
    scratch_free(L.partial, s);
  }
  if (scratch) scratch_free(scratch, s);
}

// A v4 launch's jobs cut into 16-row tiles (ks still to choose). n_jobs in [1, kMaxGemvJobs].
TcLaunch tc_launch_of(const GemvJob* jobs, int n_jobs) {
  TcLaunch L{};
  L.kb = 1;
  static const bool prefetch = !env_is("CK_GEMV_PREFETCH", "0");  // 0: not, to compare
  L.prefetch = prefetch ? 1 : 0;
  L.conv_prefetch = param_prefetch_on() ? 1 : 0;
  L.n_jobs = n_jobs;
  L.groups = jobs[0].w.cols / 64;
  int tiles = 0;
  for (int j = 0; j < n_jobs && j < kMaxGemvJobs; ++j) {
    L.job[j] = jobs[j];
    L.first_tile[j] = tiles;
    tiles += static_cast<int>(ceil_div(jobs[j].w.rows, 16));
  }
  L.first_tile[n_jobs] = tiles;
  return L;
}

int g_block_rows = -1;  // gemv_block_rows(): -1 not yet read from CK_GEMV_BLOCK_ROWS

// Groups of x a block of gemv_tc4_one_kernel / gemv_tc4_rows_kernel holds as fragments, by MMA column
// sets: 40 (1,028 bytes each, three blocks an SM) at one set, 20 at two (the same bytes), and 20 at
// four (~81 KB, two blocks an SM, once init_gemv_tc4 has raised the limit; 10 before): the 5-8-row
// steps' widest GEMVs (the mixes' down projections: 160 groups over 8 blocks) then fit as at 1-4 rows.
bool g_rows4_wide = false;  // init_gemv_tc4 raised the 4-set form's limit
int rows_block_groups(int sets) {
  return sets == 4 ? (g_rows4_wide ? kTcBlockGroups / 2 : kTcBlockGroups / 4) : kTcBlockGroups / sets;
}
// The fragments, then Σ x: one float a group at one row, two a set from two rows on.
size_t rows_block_smem(int rows, int sets, int per_b) {
  return static_cast<size_t>(per_b) * (sets * 4 * 32 * sizeof(uint2) + (rows == 1 ? 1 : 2 * sets) * sizeof(float));
}

// The one-row v4 launch with block-built fragments (gemv_tc4_one_kernel; 2-8 rows gemv_tc4_rows_kernel
// up to gemv_block_rows(), ops.h), or false when the jobs are too large for it
// (tiles x groups > kTcInWarpMax, CK_GEMV_INWARP_MAX to move it), x is not 16-byte aligned, or
// CK_GEMV_INWARP=0.
bool gemv_tc4_one(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, bool bf16s, int bits,
                  cudaStream_t s) {
  static const bool on = !env_is("CK_GEMV_INWARP", "0");
  if (rows > 1 && (rows > gemv_block_rows() || bits != 4 || ldx % 4 != 0)) return false;
  const int sets = rows <= 2 ? 1 : rows <= 4 ? 2 : 4;  // MMA column sets of two rows each
  static const int64_t max_work = [] {
    const char* e = std::getenv("CK_GEMV_INWARP_MAX");
    return e ? std::max<int64_t>(1, std::atoll(e)) : int64_t{kTcInWarpMax};
  }();
  if (!on || n_jobs < 1 || n_jobs > kMaxGemvJobs || reinterpret_cast<uintptr_t>(x) % 16 != 0) return false;
  TcLaunch L = tc_launch_of(jobs, n_jobs);
  const int tiles = L.first_tile[n_jobs];
  if (static_cast<int64_t>(tiles) * L.groups > max_work) return false;
  // Split K into more parts while there are too few warps for the GPU (~16 per SM) and each part keeps
  // at least two groups: over the blocks of a cluster first (each block's fragments then serve all
  // its tiles), then over the warps of a block. A block holds at most rows_block_groups(sets) groups.
  const int block_groups = rows_block_groups(sets);
  int parts = 1;
  while (parts < 64 && tiles * parts < sm_count() * 16 && L.groups >= 4 * parts) parts *= 2;
  int kb = std::min(parts, 8);
  while (kb < 8 && ceil_div(L.groups, kb) > block_groups) kb *= 2;
  const int per_b = static_cast<int>(ceil_div(L.groups, kb));
  if (per_b > block_groups) return false;
  L.ks = std::max(1, parts / kb);
  const size_t smem = rows_block_smem(rows, sets, per_b);
  const dim3 grid(static_cast<unsigned>(kb), static_cast<unsigned>(ceil_div(tiles, 8 / L.ks)), 1),
      cluster(static_cast<unsigned>(kb), 1, 1);
  auto go = [&](auto kernel) { launch_cluster(kernel, grid, 256, smem, s, cluster, L, x, kb); };
  auto go_rows = [&](auto kernel) { launch_cluster(kernel, grid, 256, smem, s, cluster, L, x, ldx, rows, kb); };
  if (rows > 1) {  // (4-bit codes: checked above)
    if (sets == 1) {
      if (bf16s) go_rows(gemv_tc4_rows_kernel<true, 1>);
      else go_rows(gemv_tc4_rows_kernel<false, 1>);
    } else if (sets == 2) {
      if (bf16s) go_rows(gemv_tc4_rows_kernel<true, 2>);
      else go_rows(gemv_tc4_rows_kernel<false, 2>);
    } else {
      if (bf16s) go_rows(gemv_tc4_rows_kernel<true, 4>);
      else go_rows(gemv_tc4_rows_kernel<false, 4>);
    }
  } else if (bits == 8) {
    if (bf16s) go(gemv_tc4_one_kernel<true, 8>);
    else go(gemv_tc4_one_kernel<false, 8>);
  } else {
    if (bf16s) go(gemv_tc4_one_kernel<true, 4>);
    else go(gemv_tc4_one_kernel<false, 4>);
  }
  return true;
}
}  // namespace

void init_gemv_tc4() {
  const int smem = static_cast<int>(rows_block_smem(kMaxRows, 4, kTcBlockGroups / 2));
  g_rows4_wide =
      cudaFuncSetAttribute(gemv_tc4_rows_kernel<true, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess &&
      cudaFuncSetAttribute(gemv_tc4_rows_kernel<false, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) == cudaSuccess;
  if (!g_rows4_wide) (void)cudaGetLastError();  // (no image for this device: 10 groups a block, as before)
}

void set_gemv_block_rows(int rows) { g_block_rows = rows < 0 ? -1 : std::clamp(rows, 1, kMaxRows); }
int gemv_block_rows() {
  if (g_block_rows < 0) {
    const char* e = std::getenv("CK_GEMV_BLOCK_ROWS");
    g_block_rows = e ? std::clamp(std::atoi(e), 1, kMaxRows) : 1;
  }
  return g_block_rows;
}

// The DeltaNet conv for gemv_tc4's epilogue (gemv_conv).
struct ConvTail {
  GdnConvArgs a;
  const StepParams* sp;
};

// The v4 launch, or false when the jobs do not suit it: not all 4-bit codes in groups of 64 or 128,
// a shape where v3 is faster (kTcMin*), or CK_GEMV asks for v2/v3. With `conv` (job 0 the DeltaNet's
// in_proj_qkv, conv->a.x its output), only the two-kernel form, whose epilogue then convolves job 0's
// channels instead of writing them.
bool gemv_tc4(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream,
              const Tc4Frags* pre, const ConvTail* conv) {
  bool bf16s = false;
  int bits = 0;
  if (q_arith() != 4 || n_jobs < 1 || n_jobs > kMaxGemvJobs || !tc4_suits(jobs, n_jobs, &bf16s, &bits)) return false;
  int total_rows = 0;
  for (int j = 0; j < n_jobs; ++j) total_rows += jobs[j].w.rows;
  const bool tiled = any_tiled(jobs, n_jobs);  // only the v4 kernels read them: no size threshold then
  if (!conv && bits == 4 && gemv_stream(jobs, n_jobs, x, ldx, rows, bf16s, stream)) return true;
  if (!conv && gemv_tc4_one(jobs, n_jobs, x, ldx, rows, bf16s, bits, stream)) return true;
  // 8-bit codes at 2-8 rows (the router and the shared expert's gate), whatever their size: the v3
  // CUDA-core GEMV and its reduce took 13.7 us a layer at 4 rows inside the step (CK_HOLLOW, H200
  // 2026-12-02), for 1.4 MB. CK_GEMV_TC8_ROWS=0: v3 as before.
  static const bool tc8_rows = !env_is("CK_GEMV_TC8_ROWS", "0");
  const bool eight = bits == 8 && tc8_rows && rows >= 2 && rows <= kMaxRows && !conv && !tiled;
  if (bits != 4 && !eight) return false;
  // CK_GEMV_TC_ONE_ROW=N moves the one-row threshold (total rows of the jobs) to compare.
  static const int one_row_min = [] {
    const char* e = std::getenv("CK_GEMV_TC_ONE_ROW");
    return e ? std::max(1, std::atoi(e)) : kTcMinRowsOneRow;
  }();
  if (!eight && !tiled && (total_rows < (rows == 1 ? one_row_min : kTcMinRows) || jobs[0].w.cols < kTcMinCols))
    return false;
  TcLaunch L = tc_launch_of(jobs, n_jobs);
  const int tiles = L.first_tile[n_jobs];
  // Split each tile's groups over more warps while there are too few warps to keep every SM's memory
  // pipe busy (~16 per SM) and each keeps at least 4 groups.
  int ks = 1;
  while (ks < 8 && tiles * ks < sm_count() * 16 && L.groups >= 8 * ks) ks *= 2;
  L.ks = ks;
  if (conv) {
    L.conv = conv->a;
    L.conv_sp = conv->sp;
  }
  switch (tc4_rows_R(rows)) {
    case 1: launch_tc4<1>(L, x, ldx, rows, bf16s, bits, stream, pre); break;
    case 2: launch_tc4<2>(L, x, ldx, rows, bf16s, bits, stream, pre); break;
    case 4: launch_tc4<4>(L, x, ldx, rows, bf16s, bits, stream, pre); break;
    default: launch_tc4<8>(L, x, ldx, rows, bf16s, bits, stream, pre); break;
  }
  return true;
}

bool gemv_conv(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream,
               const Tc4Frags* pre, const GdnConvArgs& conv, const StepParams* sp) {
  // CK_CONV_IN_GEMV=0: the conv kernel after the GEMV, to compare.
  static const bool on = !env_is("CK_CONV_IN_GEMV", "0");
  if (!on || rows < 1 || rows > kMaxRows || gemv_version() != 2 || conv.x != jobs[0].y || conv.ldx != jobs[0].ldy ||
      conv.C != jobs[0].w.rows || conv.K < 1 || conv.K - 1 > kMaxConvHist || !conv.y || !sp)
    return false;
  for (int j = 0; j < n_jobs; ++j)
    if (jobs[j].w.cols != jobs[0].w.cols || !jobs[j].y) return false;
  if (reinterpret_cast<uintptr_t>(x) % 16 != 0 || ldx % 4 != 0) return false;
  ConvTail ct{conv, sp};
  return gemv_tc4(jobs, n_jobs, x, ldx, rows, stream, pre, &ct);
}

void tc4_make_frags(const float* x, int ldx, int rows, int groups, uint2* frag, float* gsum, Tc4Frags* f,
                    cudaStream_t stream) {
  CK_REQUIRE(rows >= 1 && rows <= kMaxRows && groups >= 1 && frag && gsum && f, "tc4_make_frags: %d rows, %d groups",
             rows, groups);
  *f = Tc4Frags{};
  f->x = x;
  f->ldx = ldx;
  f->rows = rows;
  f->groups = groups;
  const unsigned grid = static_cast<unsigned>(groups);
  const int64_t z = 0;
  switch (tc4_rows_R(rows)) {
    case 1:
      launch(tc4_frag_kernel<1>, dim3(grid, 1), 128, 0, stream, x, ldx, 1, frag, gsum, z, z, z);
      f->frag = frag;
      f->gsum = gsum;
      break;
    case 2: launch(tc4_frag_kernel<2>, grid, 128, 0, stream, x, ldx, rows, frag, gsum, z, z, z); break;
    case 4: launch(tc4_frag_kernel<4>, grid, 128, 0, stream, x, ldx, rows, frag, gsum, z, z, z); break;
    default: launch(tc4_frag_kernel<8>, grid, 128, 0, stream, x, ldx, rows, frag, gsum, z, z, z); break;
  }
  CUDA_CHECK_LAUNCH();
  if (rows > 1) {
    f->rfrag = frag;
    f->rgsum = gsum;
    f->rR = tc4_rows_R(rows);
  }
}

// tc4_frag_kernel<1> over n_vec vectors (rows of x at ldx), vector v's fragments at f + v * frag_elems
// and its group sums at gs + v * groups: the decode experts' inputs (gemv_experts.cu launch_expert_tc4).
void tc4_frag_vectors(const float* x, int ldx, int n_vec, int groups, size_t frag_elems, uint2* f, float* gs,
                      cudaStream_t s) {
  launch(tc4_frag_kernel<1>, dim3(static_cast<unsigned>(groups), static_cast<unsigned>(n_vec)), 128, 0, s, x, ldx,
         1, f, gs, static_cast<int64_t>(ldx), static_cast<int64_t>(frag_elems), static_cast<int64_t>(groups));
  CUDA_CHECK_LAUNCH();
}

}  // namespace ck::cuda
