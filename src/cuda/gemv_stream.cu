// One activation row (and, below, 2-8 rows) through the largest 4-bit matrix of a decode step (the LM
// head: 9,496 tiles x 40 groups at the released geometry) with the weights streamed into shared memory
// by the tensor memory accelerator (TMA), instead of each warp loading them into registers.
//
// Why: the two-kernel v4 form (fragment kernel + gemv_tc4_kernel, gemv_tc4.cu) reached 1.66 TB/s on the
// LM head against a copy rate of ~4.2 TB/s: with registers capped for 3-4 blocks per SM, a warp keeps
// few loads in flight. Here every warp owns a ring of kStages shared-memory stages; a stage (16 rows x
// 8 groups of codes, their scales and biases) is filled by four 2D tensor-map copies issued by one
// lane and completes an mbarrier, so each SM keeps ~80 KB of weights in flight whatever the compute
// does. The first stages are requested before pdl_begin() (weights never change).
//
// History (H200, same-call comparisons, docs/performance.md): the first form filled a stage with 48
// per-row cp.async.bulk copies: LM head 187 us (1.94 TB/s) against ~214 for the two kernels, decode
// 461-463 against 456 tok/s. The tensor-map copies (2026-11-30 10:30Z): decode 477.4 against 460-463
// tok/s, the MTP draft step 0.398 against 0.469-0.489 ms. Its codes were unpacked with code_pair_lop3
// (without it the per-row form gained nothing), since 2026-12-01 through tc4_one_mma's code_pair_128.
//
// Arithmetic: the v4 one-row arithmetic of gemv_tc4_one_kernel (mma_q4.cuh: tc4_one_frag builds the
// B fragments of x in shared memory once per block, tc4_one_mma per group). A warp owns whole 16-row
// tiles (tile = warp id + k * warps in the grid) and adds a tile's groups in index order: no split K,
// no reduction, deterministic.
//
// Shared-memory layout of a stage (5,120 bytes, 1024-aligned for the swizzle): codes as two boxes of
// [16 rows][128 bytes] in the 128-byte swizzle (16-byte chunk c of row r lands at chunk c ^ (r & 7),
// so the 8 rows g = 0..7 a quad-group reads hit different banks), then scales [16][8] and biases
// [16][8] dense at kScalesAt and kScalesAt + 512. Rows past the matrix arrive as zeros (never stored).
#include <cuda.h>  // CUtensorMap (the encoder comes through the runtime: no link to libcuda)

#include <algorithm>
#include <cstdlib>

#include "cuda/bulk_copy.cuh"
#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gemv_stream.h"
#include "cuda/mma_q4.cuh"

namespace ck::cuda {
namespace {

// One block of 16 warps per SM, 2 stages per warp. With the per-row copies, 8 warps x 3 stages were
// slower (LM head 260 against 187 us); with the tensor-map copies, 12 x 3 and 8 x 4 measured the same
// as 16 x 2 (decode ~472 tok/s each, 2026-11-30 11:07Z).
constexpr int kWarps = 16;
constexpr int kStages = 2;
constexpr int kChunk = 8;         // 64-code groups per stage: 512 codes, 256 bytes of a row
constexpr int kStageBytes = 5120;  // 2 x 2,048 bytes of codes, 512 of scales, 512 of biases
constexpr int kScalesAt = 4096;
constexpr int kFragGroupBytes = 4 * 32 * 8;  // one group's B fragments (tc4_one_frag)
constexpr int kRingBytes = kWarps * kStages * kStageBytes;
constexpr int kBarBytes = kWarps * kStages * 8;
// Matrices of at least this many tiles x groups take this kernel: the LM head (9,496 x 40 at the
// released geometry), not the DeltaNet in_proj or the attention projections (~1,030 x 40). A block
// of ~220 KB cannot be resident beside the kernel before, so this kernel starts its copies only when
// that one has ended, while gemv_tc4_kernel's small blocks are resident early and ask L2 for their
// weights during it: on the 25 MB in_proj that overlap wins (8-warp form, decode 421 tok/s with
// every one-row matrix above 16,384 tile-groups here against 455 with none, same call).
// set_gemv_stream_min_work moves it (tests, comparisons).
constexpr int64_t kStreamMinWork = 100000;
int64_t g_min_work = -1;  // -1: not yet read (CK_GEMV_STREAM_MIN)
int64_t g_launches = 0;

struct StreamLaunch {
  CUtensorMap tmap[kMaxGemvJobs][3];  // each job's codes, scales, biases
  GemvJob job[kMaxGemvJobs];
  int32_t first_tile[kMaxGemvJobs + 1];  // job j owns 16-row tiles [first_tile[j], first_tile[j+1])
  int32_t n_jobs;
  int32_t groups;  // K / 64
  int32_t chunks;  // groups / kChunk
};

__device__ __forceinline__ int job_of(const StreamLaunch& L, int tile) {
  int j = 0;
  while (j + 1 < L.n_jobs && tile >= L.first_tile[j + 1]) ++j;
  return j;
}

// Asks for unit u of this warp (its (u / chunks)-th tile, chunk u % chunks) into `stage`: lane 0
// announces the bytes and issues the four copies.
__device__ __forceinline__ void issue(const StreamLaunch& L, int u, int gw, int W, uint8_t* stage, uint64_t* bar) {
  if ((threadIdx.x & 31) == 0) {
    const int tile = gw + (u / L.chunks) * W, c = u % L.chunks;
    const int j = job_of(L, tile);
    const int row0 = (tile - L.first_tile[j]) * 16;
    mbar_arrive_expect(bar, 16 * (kChunk * 32 + 2 * kChunk * wkind_bytes(L.job[j].w.fmt.scale_kind)));
    tma_copy_2d(stage, &L.tmap[j][0], c * (kChunk * 32), row0, bar);
    tma_copy_2d(stage + 2048, &L.tmap[j][0], c * (kChunk * 32) + 128, row0, bar);
    tma_copy_2d(stage + kScalesAt, &L.tmap[j][1], c * kChunk, row0, bar);
    tma_copy_2d(stage + kScalesAt + 512, &L.tmap[j][2], c * kChunk, row0, bar);
  }
  __syncwarp();
}

template <bool BF16S>
__device__ __forceinline__ float stage_scale(const uint8_t* p, int i, uint8_t kind) {
  if constexpr (BF16S) return bf16_bits_to_float(reinterpret_cast<const uint16_t*>(p)[i]);
  else return load_scale_elem(p, i, kind);
}

// The tile rows lane group g multiplies: stage_row<PERM>(g) and stage_row<PERM>(g) + 8 as the MMA's
// rows g and g + 8. PERM (the 2-8-row kernel): a permutation of the tile's rows (each output row's sum
// is the same). Why: a 64-bit shared load is served per half warp (g = 0-3, then 4-7), and each lane
// reads 8 of its row's 32 bytes of a group. Under the 128-byte swizzle rows r and r ^ 1 put a group's
// two 16-byte chunks on the same banks, so rows g = 0-3 took two wavefronts where one suffices
// (Nsight Compute, 2026-12-01 22:21Z: 2x the ideal on every code load of gemv_stream_rows_kernel<4>).
// Rows 0, 2, 4, 6 (then 1, 3, 5, 7) fall on four different bank ranges. The one-row kernel keeps
// rows g: permuted, its decode was 0.2-1.1% slower in three rounds (22:27Z; its shared loads are
// fewer: one row's fragments, not four).
template <bool PERM>
__device__ __forceinline__ int stage_row(int g) { return PERM ? ((g & 3) << 1) | (g >> 2) : g; }

// Group i of a stage, as lane (g, t) reads it: the code words of rows r = stage_row<PERM>(g) and r + 8
// (row r's 16-byte chunk ch of box i / 4 sits at chunk ch ^ (r & 7): the 128-byte swizzle), their
// scales and biases.
template <bool BF16S, bool PERM>
__device__ __forceinline__ void stage_group(const uint8_t* st, int i, uint8_t sk, uint2& wa, uint2& wb, float& sa,
                                            float& ba, float& sb, float& bb) {
  const int lane = threadIdx.x & 31, r = stage_row<PERM>(lane >> 2), t = lane & 3;
  const int es = wkind_bytes(sk);
  const uint8_t* sc = st + kScalesAt;
  const int ch = ((i & 3) * 2 + (t >> 1)) ^ r;
  const uint8_t* box = st + (i >> 2) * 2048 + ch * 16 + (t & 1) * 8;
  wa = *reinterpret_cast<const uint2*>(box + r * 128);
  wb = *reinterpret_cast<const uint2*>(box + (r + 8) * 128);
  sa = stage_scale<BF16S>(sc + r * 8 * es, i, sk);
  sb = stage_scale<BF16S>(sc + (r + 8) * 8 * es, i, sk);
  ba = stage_scale<BF16S>(sc + 512 + r * 8 * es, i, sk);
  bb = stage_scale<BF16S>(sc + 512 + (r + 8) * 8 * es, i, sk);
}

// A warp's start on its ring (warp gw of GW in the grid): its kStages barriers, then its first
// stages asked for (before pdl_begin: weights never change). Returns the warp's units (tiles x chunks).
__device__ __forceinline__ int ring_begin(const StreamLaunch& L, int gw, int GW, uint8_t* ring, uint64_t* bars) {
  const int n_tiles = L.first_tile[L.n_jobs];
  const int n_units = gw < n_tiles ? ((n_tiles - 1 - gw) / GW + 1) * L.chunks : 0;
  if ((threadIdx.x & 31) < kStages) mbar_init(&bars[threadIdx.x & 31]);
  mbar_init_fence();
  __syncwarp();
  for (int u = 0; u < kStages && u < n_units; ++u) issue(L, u, gw, GW, ring + u * kStageBytes, &bars[u]);
  return n_units;
}

// grid: one block per SM (sm_count), block 512. Dynamic shared memory: the warps' rings, their
// barriers, then the x fragments [groups][4 steps][32 lanes] and the groups' Σ x.
template <bool BF16S>
__global__ void __launch_bounds__(kWarps * 32, 1) gemv_stream_kernel(const __grid_constant__ StreamLaunch L,
                                                                     const float* __restrict__ x) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint8_t* ring = smem + warp * kStages * kStageBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kRingBytes) + warp * kStages;
  uint2* sfrag = reinterpret_cast<uint2*>(smem + kRingBytes + kBarBytes);
  float* sgs = reinterpret_cast<float*>(smem + kRingBytes + kBarBytes + static_cast<size_t>(L.groups) * kFragGroupBytes);
  const int gw = blockIdx.x * kWarps + warp, W = gridDim.x * kWarps;
  const int n_units = ring_begin(L, gw, W, ring, bars);

  pdl_begin();  // x comes from the kernel before
  one_row_frags_in_block<3>(x, 0, L.groups, sfrag, sgs);  // (K = 2,560: 40 groups over 16 warps)
  __syncthreads();

  float acc[4] = {};
  for (int u = 0; u < n_units; ++u) {
    const int s = u % kStages;
    mbar_wait(&bars[s], static_cast<uint32_t>(u / kStages) & 1u);
    const int tile = gw + (u / L.chunks) * W, c = u % L.chunks;
    const int j = job_of(L, tile);
    const uint8_t sk = L.job[j].w.fmt.scale_kind;
    const uint8_t* st = ring + s * kStageBytes;
#pragma unroll
    for (int i = 0; i < kChunk; ++i) {
      const int G = c * kChunk + i;
      uint2 wa, wb;
      float sa, ba, sb, bb;
      stage_group<BF16S, false>(st, i, sk, wa, wb, sa, ba, sb, bb);
      tc4_one_mma(wa, wb, sa, ba, sb, bb, sfrag + static_cast<size_t>(G) * 128 + lane, t == 0 ? sgs[G] : 0.0f, acc);
    }
    __syncwarp();  // every lane has read the stage: it can be refilled
    if (u + kStages < n_units) issue(L, u + kStages, gw, W, ring + s * kStageBytes, &bars[s]);
    if (c == L.chunks - 1) {
      // Columns 0-2 (hi, mid, lo) of rows g and g + 8: lanes t = 0 (columns 0, 1) and t = 1 (column 2).
      const float c2a = __shfl_down_sync(0xffffffffu, acc[0], 1), c2b = __shfl_down_sync(0xffffffffu, acc[2], 1);
      const GemvJob& jb = L.job[j];
      const int row0 = (tile - L.first_tile[j]) * 16;
      if (t == 0 && row0 + g < jb.w.rows) jb.y[row0 + g] = apply_epilogue((acc[0] + acc[1]) + c2a, jb.epi, jb.epi_arg);
      if (t == 0 && row0 + g + 8 < jb.w.rows)
        jb.y[row0 + g + 8] = apply_epilogue((acc[2] + acc[3]) + c2b, jb.epi, jb.epi_arg);
      acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
    }
  }
}

size_t smem_bytes(int groups) {
  return static_cast<size_t>(kRingBytes) + kBarBytes + static_cast<size_t>(groups) * (kFragGroupBytes + sizeof(float));
}

// ---- 2-8 activation rows (the LM head of a multi-row step: MTP verification, the 4-row benchmark)
//
// Why: there the LM head ran on gemv_tc4_kernel<4> at ~1 TB/s (340 us of a 3.75 ms 4-row step alone,
// Nsight Compute 2026-12-01 08:29Z), where this ring reads the same matrix at ~2.8 TB/s for one row.
// The same ring and copies; gemv_tc4_kernel<R>'s arithmetic (tc4_frag_elem<NB>'s fragments of the R
// rows' three parts, NB n8 column blocks, one MMA per block and k16 step; group sums on the hi columns;
// y = (hi + mid + lo) per row through shared memory), with a warp's tile's groups in index order:
// the same sums as gemv_tc4_kernel with its groups on one warp (ks = 1, the LM head's case).
// Fewer warps than at one row where the fragments take more shared memory (R = 4: 80 KB of them at
// K = 2,560).
// Measured (H200, 2026-12-01 10:15Z, same call): 4-row decode 1,167 / 1,191 tok/s against 1,144 with
// CK_GEMV_STREAM_ROWS=0 and 1,140 / 1,147 on the build before. The multi-row threshold lowered to the
// in_proj and the attention projections (CK_GEMV_STREAM_ROWS_MIN=30000 / 8000 / 1000): 1,184 / 1,187 /
// 1,183, level with the default.
template <int R>
struct RowsLayout {
  static constexpr int NB = (3 * R + 7) / 8, NC = 8 * NB;
  static constexpr int W = R <= 2 ? 16 : R <= 4 ? 12 : 8;  // warps a block
  static constexpr int kRing = W * kStages * kStageBytes, kBars = W * kStages * 8;
  static constexpr int kFragWordsPerGroup = 4 * NB * 32;
  static CK_HD size_t frag_bytes(int groups) { return static_cast<size_t>(groups) * kFragWordsPerGroup * sizeof(uint2); }
  // Ring, barriers, fragments, group sums [groups][NC], then per warp a [16][NC + 1] tile of sums.
  static size_t smem(int groups) {
    return static_cast<size_t>(kRing) + kBars + frag_bytes(groups) + sizeof(float) * groups * NC +
           sizeof(float) * W * 16 * (NC + 1);
  }
};

// grid: one block per SM at most, block RowsLayout<R>::W warps. x: nx <= R rows at ldx.
template <bool BF16S, int R>
__global__ void __launch_bounds__(RowsLayout<R>::W * 32, 1) gemv_stream_rows_kernel(const __grid_constant__ StreamLaunch L,
                                                                                    const float* __restrict__ x, int ldx,
                                                                                    int nx) {
  using Lay = RowsLayout<R>;
  constexpr int NB = Lay::NB, NC = Lay::NC, W = Lay::W, FW = Lay::kFragWordsPerGroup;
  extern __shared__ __align__(1024) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  uint8_t* ring = smem + warp * kStages * kStageBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Lay::kRing) + warp * kStages;
  uint2* sfrag = reinterpret_cast<uint2*>(smem + Lay::kRing + Lay::kBars);
  float* sgs = reinterpret_cast<float*>(smem + Lay::kRing + Lay::kBars + Lay::frag_bytes(L.groups));
  float* red = sgs + static_cast<size_t>(L.groups) * NC + warp * 16 * (NC + 1);
  const int gw = blockIdx.x * W + warp, GW = gridDim.x * W;
  const int n_units = ring_begin(L, gw, GW, ring, bars);

  // Zero group sums (only the real rows' hi columns get one below), while x is still being written.
  for (int e = threadIdx.x; e < L.groups * NC; e += blockDim.x) sgs[e] = 0.0f;
  __syncthreads();
  pdl_begin();  // x comes from the kernel before
  // The rows' fragments (tc4_frag_kernel<R>'s layout and bits) and the sums of the real rows on their
  // hi columns (3 r), a warp per (group, row), each thread's work in batches whose loads of x are
  // issued together: one at a time, the ~27 fragment words a thread makes at 4 rows (K = 2,560) and a
  // warp's ~14 sums were ~41 dependent L2 round trips, 16% of the kernel's warp samples before its
  // first MMA (Nsight Compute, 2026-12-01 22:27Z, while its ring of weights sat full).
  // Each 32-word block is stored in lane order (word t * 8 + g of tc4_frag_elem's layout at lane
  // 4 g + t), so that a warp's fragment loads are 32 consecutive words: in the kernels' layout the
  // half warp g = 0-3 hit each bank twice (2x the ideal wavefronts, Nsight Compute 2026-12-01).
  constexpr int kFragBatch = 8, kSumBatch = 4;
  const int n_words = L.groups * FW, n_sums = L.groups * nx;
  for (int e0 = threadIdx.x; e0 < n_words; e0 += kFragBatch * blockDim.x) {
    float4 v[kFragBatch];  // tc4_frag_elem's four floats, loaded from x itself for a zero word
    int part[kFragBatch];
    bool zero[kFragBatch];
#pragma unroll
    for (int b = 0; b < kFragBatch; ++b) {
      const int e = e0 + b * blockDim.x, G = e / FW;
      part[b] = 0;
      const float* xr = e < n_words ? tc4_frag_src<NB>(x + 64 * G, ldx, nx, e - G * FW, part[b]) : nullptr;
      zero[b] = xr == nullptr;
      if (zero[b]) xr = x;
      v[b] = make_float4(xr[0], xr[4], xr[1], xr[5]);
    }
#pragma unroll
    for (int b = 0; b < kFragBatch; ++b) {
      const int e = e0 + b * blockDim.x, G = e / FW, w = e - G * FW;
      if (e < n_words)
        sfrag[G * FW + (w & ~31) + (w & 7) * 4 + ((w >> 3) & 3)] =
            zero[b] ? make_uint2(0u, 0u) : tc4_frag_pack(v[b].x, v[b].y, v[b].z, v[b].w, part[b]);
    }
  }
  for (int task0 = warp; task0 < n_sums; task0 += kSumBatch * W) {
    float v[kSumBatch];
#pragma unroll
    for (int b = 0; b < kSumBatch; ++b) {  // tc4_group_sum's terms, then its butterfly below
      const int task = task0 + b * W, G = task / nx, r = task - G * nx;
      const float* xg = task < n_sums ? x + static_cast<size_t>(r) * ldx + 64 * G : x;
      const float terms = xg[lane] + xg[lane + 32];
      v[b] = task < n_sums ? terms : 0.0f;
    }
#pragma unroll
    for (int b = 0; b < kSumBatch; ++b) {
      const int task = task0 + b * W, G = task / nx, r = task - G * nx;
      const float sum = warp_sum(v[b]);
      if (lane == 0 && task < n_sums) sgs[G * NC + 3 * r] = sum;
    }
  }
  __syncthreads();

  float acc[NB][4] = {};
  for (int u = 0; u < n_units; ++u) {
    const int s = u % kStages;
    mbar_wait(&bars[s], static_cast<uint32_t>(u / kStages) & 1u);
    const int tile = gw + (u / L.chunks) * GW, c = u % L.chunks;
    const int j = job_of(L, tile);
    const uint8_t sk = L.job[j].w.fmt.scale_kind;
    const uint8_t* st = ring + s * kStageBytes;
#pragma unroll 2
    for (int i = 0; i < kChunk; ++i) {
      const int G = c * kChunk + i;
      uint2 wa, wb;
      float sa, ba, sb, bb;
      stage_group<BF16S, true>(st, i, sk, wa, wb, sa, ba, sb, bb);
      const uint2* fg = sfrag + static_cast<size_t>(G) * FW + lane;
      float d[NB][4] = {};  // gemv_tc4_kernel's loop body
      tc4_group_mma<NB>(wa, wb, [&](int s4, int nb) { return fg[(s4 * NB + nb) * 32]; }, d);
      const float* gs = sgs + G * NC + 2 * t;
      tc4_group_accumulate<NB>(d, sa, ba, sb, bb, [&](int nb, int c) { return gs[nb * 8 + c]; }, acc);
    }
    __syncwarp();  // every lane has read the stage: it can be refilled
    if (u + kStages < n_units) issue(L, u + kStages, gw, GW, ring + s * kStageBytes, &bars[s]);
    if (c == L.chunks - 1) {
      // The MMA's rows g, g + 8 (tile rows r = stage_row<true>(g), r + 8) x columns (2t, 2t + 1) of
      // each block -> the warp's [16][NC + 1] tile, then y = (hi + mid) + lo per (row, activation
      // row), as gemv_tc4_kernel's value() adds them.
      const int r = stage_row<true>(g);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        red[r * (NC + 1) + nb * 8 + 2 * t] = acc[nb][0];
        red[r * (NC + 1) + nb * 8 + 2 * t + 1] = acc[nb][1];
        red[(r + 8) * (NC + 1) + nb * 8 + 2 * t] = acc[nb][2];
        red[(r + 8) * (NC + 1) + nb * 8 + 2 * t + 1] = acc[nb][3];
        acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
      }
      __syncwarp();
      const GemvJob& jb = L.job[j];
      const int row0 = (tile - L.first_tile[j]) * 16;
      for (int o = lane; o < 16 * R; o += 32) {
        const int m = o / R, r = o % R;
        if (r >= nx || row0 + m >= jb.w.rows) continue;
        const float* cr = red + m * (NC + 1) + 3 * r;
        const float v = ((0.0f + cr[0]) + (0.0f + cr[1])) + (0.0f + cr[2]);
        jb.y[static_cast<size_t>(r) * jb.ldy + row0 + m] = apply_epilogue(v, jb.epi, jb.epi_arg);
      }
      __syncwarp();  // the tile is read before the next one is written
    }
  }
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link to libcuda); null when the
// driver does not offer it (the caller then falls back to gemv_tc4_kernel).
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A 2D map over `rows` rows of `inner` elements (row pitch `pitch` bytes) in boxes of box_inner x 16
// rows. False when the driver refuses it.
bool encode_map(CUtensorMap* m, const void* base, CUtensorMapDataType type, uint64_t inner, uint64_t rows,
                uint64_t pitch, uint32_t box_inner, CUtensorMapSwizzle swizzle) {
  const EncodeTiled fn = encode_tiled();
  if (!fn) return false;
  const cuuint64_t dims[2] = {inner, rows}, strides[1] = {pitch};
  const cuuint32_t box[2] = {box_inner, 16}, elem_strides[2] = {1, 1};
  return fn(m, type, 2, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A job's three maps: codes in boxes of 128 bytes (the 128-byte swizzle's widest), scales and biases
// in boxes of kChunk elements.
bool encode_job_maps(const DMatrix& w, int groups, CUtensorMap (&m)[3]) {
  const bool f32 = w.fmt.scale_kind == static_cast<uint8_t>(WKind::F32);
  const CUtensorMapDataType st = f32 ? CU_TENSOR_MAP_DATA_TYPE_UINT32 : CU_TENSOR_MAP_DATA_TYPE_UINT16;
  const uint64_t row_bytes = static_cast<uint64_t>(w.cols) / 2, es = f32 ? 4 : 2;
  return encode_map(&m[0], w.data, CU_TENSOR_MAP_DATA_TYPE_UINT8, row_bytes, w.rows, row_bytes, 128,
                    CU_TENSOR_MAP_SWIZZLE_128B) &&
         encode_map(&m[1], w.scales, st, groups, w.rows, groups * es, kChunk, CU_TENSOR_MAP_SWIZZLE_NONE) &&
         encode_map(&m[2], w.biases, st, groups, w.rows, groups * es, kChunk, CU_TENSOR_MAP_SWIZZLE_NONE);
}

int max_smem_optin() {
  static const int v = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin);
  return v;
}

int64_t min_work() {
  if (g_min_work < 0) {
    const char* e = std::getenv("CK_GEMV_STREAM_MIN");
    g_min_work = e ? std::max<int64_t>(0, std::atoll(e)) : kStreamMinWork;
  }
  return g_min_work;
}

// Steps of 2-8 rows: their own threshold (CK_GEMV_STREAM_ROWS_MIN; unset: the one-row threshold). At
// 2-8 rows the tile kernel needs a fragment kernel before it and reads the fragments from L2 per warp,
// which this kernel builds once per block in shared memory.
int64_t rows_min_work() {
  static const int64_t v = [] {
    const char* e = std::getenv("CK_GEMV_STREAM_ROWS_MIN");
    return e ? std::max<int64_t>(0, std::atoll(e)) : int64_t{-1};
  }();
  return v < 0 ? min_work() : v;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void set_gemv_stream_min_work(int64_t work) { g_min_work = work < 0 ? -1 : work; }  // -1: read again
int64_t gemv_stream_launches() { return g_launches; }

void gemv_stream_init() {
  static const bool done = [] {
    for (auto k : {gemv_stream_kernel<true>, gemv_stream_kernel<false>})
      CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem_optin()));
    for (auto k : {gemv_stream_rows_kernel<true, 2>, gemv_stream_rows_kernel<false, 2>, gemv_stream_rows_kernel<true, 4>,
                   gemv_stream_rows_kernel<false, 4>, gemv_stream_rows_kernel<true, 8>, gemv_stream_rows_kernel<false, 8>})
      CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem_optin()));
    (void)min_work();
    return true;
  }();
  (void)done;
}

// The launch of 2-8 rows (R = 2, 4 or 8 by nx), or false when its shared memory does not fit.
template <int R>
bool launch_rows(const StreamLaunch& L, int tiles, const float* x, int ldx, int nx, bool bf16s, cudaStream_t s) {
  using Lay = RowsLayout<R>;
  const size_t smem = Lay::smem(L.groups);
  if (smem > static_cast<size_t>(max_smem_optin())) return false;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(sm_count(), ceil_div(tiles, Lay::W)));
  if (bf16s) launch(gemv_stream_rows_kernel<true, R>, grid, Lay::W * 32, smem, s, L, x, ldx, nx);
  else launch(gemv_stream_rows_kernel<false, R>, grid, Lay::W * 32, smem, s, L, x, ldx, nx);
  return true;
}

bool gemv_stream(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, bool bf16s, cudaStream_t s) {
  static const bool on = !env_is("CK_GEMV_STREAM", "0");
  static const bool rows_on = !env_is("CK_GEMV_STREAM_ROWS", "0");
  gemv_stream_init();  // once (init_gemv calls it before any capture; direct callers get it here)
  if (!on || n_jobs < 1 || n_jobs > kMaxGemvJobs || rows < 1 || rows > 8 || (rows > 1 && !rows_on)) return false;
  if (rows == 1 && !aligned16(x)) return false;
  StreamLaunch L{};
  L.n_jobs = n_jobs;
  const int cols = jobs[0].w.cols;
  if (cols % (64 * kChunk) != 0) return false;
  L.groups = cols / 64;
  L.chunks = L.groups / kChunk;
  int tiles = 0;
  for (int j = 0; j < n_jobs; ++j) {
    const DMatrix& w = jobs[j].w;
    // 4-bit codes in groups of 64, 16-byte aligned (a tensor map's base and row pitch must be), in
    // the row layout (the tensor maps' boxes are rows).
    if (!w.quantized() || w.fmt.bits != 4 || w.fmt.group != 64 || w.cols != cols || w.rows < 1 || w.tiled() ||
        !aligned16(w.data) || !aligned16(w.scales) || !aligned16(w.biases))
      return false;
    L.job[j] = jobs[j];
    L.first_tile[j] = tiles;
    tiles += static_cast<int>(ceil_div(w.rows, 16));
  }
  L.first_tile[n_jobs] = tiles;
  const size_t smem = rows == 1 ? smem_bytes(L.groups)
                      : rows <= 2 ? RowsLayout<2>::smem(L.groups)
                      : rows <= 4 ? RowsLayout<4>::smem(L.groups)
                                  : RowsLayout<8>::smem(L.groups);
  const int64_t need = rows > 1 ? rows_min_work() : min_work();
  if (static_cast<int64_t>(tiles) * L.groups < need || smem > static_cast<size_t>(max_smem_optin())) return false;
  // The tensor maps last: each is a driver call, and most one-row launches (every direct launch of an
  // MTP draft step, every projection below the threshold) stop at the checks above.
  for (int j = 0; j < n_jobs; ++j)
    if (!encode_job_maps(jobs[j].w, L.groups, L.tmap[j])) return false;
  if (rows > 1) {
    const bool ok = rows <= 2   ? launch_rows<2>(L, tiles, x, ldx, rows, bf16s, s)
                    : rows <= 4 ? launch_rows<4>(L, tiles, x, ldx, rows, bf16s, s)
                                : launch_rows<8>(L, tiles, x, ldx, rows, bf16s, s);
    if (!ok) return false;
  } else {
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(sm_count(), ceil_div(tiles, kWarps)));
    if (bf16s) launch(gemv_stream_kernel<true>, grid, kWarps * 32, smem, s, L, x);
    else launch(gemv_stream_kernel<false>, grid, kWarps * 32, smem, s, L, x);
  }
  CUDA_CHECK_LAUNCH();
  ++g_launches;
  return true;
}

}  // namespace ck::cuda
