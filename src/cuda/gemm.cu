// Tensor-core matrix products for prefill chunks (more than kMaxRows rows at once): the dense
// projections (gemv() hands rows > kMaxRows here) and the routed/shared experts grouped per expert,
// so each expert's weights are read once per chunk for all the rows that chose it.
//
// Arithmetic ("tf32x3", the default): the weight tile is dequantized to fp32 in shared memory exactly
// as the CPU does (s * q + b), then every fp32 operand v is split into two tf32 parts, hi = tf32(v) and
// lo = tf32(v - hi), and the product is hi·hi + hi·lo + lo·hi on the tensor cores with fp32
// accumulation (the dropped lo·lo term is ~2^-21 of the product). Results stay within ~1e-6 of fp32
// (not bit-identical to the row path: the tests state the tolerance). CK_TC=bf16x3 selects bf16 parts
// instead (~1e-5 of fp32, 27-34% faster prefill).
//
// Tiles: a block of 4 warps computes BM = 16*MF rows x 64 output features, sweeping K in steps of 32;
// each warp owns 16 output features and MF row fragments (dense: BM 64; experts: BM kGroupRows). The
// next tile's global loads are issued into registers before the current tile's products (fetch16 /
// dequant16), so their latency overlaps the tensor-core work. Short, wide dense matrices split K over
// more blocks and add the partial sums in a fixed order (deterministic). Every weight is dequantized
// and split once per tile: with few rows per expert that, not the tensor cores, bounds the expert
// products (docs/roofline-cuda.md).
#include <cuda_bf16.h>
#include <mma.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/ops.h"
#include "cuda/split_k.h"

namespace ck::cuda {
namespace {

using namespace nvcuda;

constexpr int kBN = 64;       // output features per block
constexpr int kBK = 32;       // K per shared-memory tile
constexpr int kThreads = 128;  // 4 warps, 16 output features each

// The two operand splits (TcArith): tf32x3 (the default: tf32 parts, 21 significant bits, results
// within ~1e-6 of fp32) or bf16x3 (CK_TC=bf16x3: bf16 parts, 16 bits, ~1e-5; twice the tensor-core
// rate, 27-34% faster prefill on the H200, docs/performance.md).
template <bool kTf32>
struct TcArith {
  using T = __nv_bfloat16;  // element type of the shared-memory tiles
  using Prec = __nv_bfloat16;
  static constexpr int kK = 16;  // K of one WMMA product
  static constexpr int kLd = kBK + 8;  // row pitch of the tiles (a multiple of 8 elements)
  __device__ static void split(float v, T& hi, T& lo) {
    hi = __float2bfloat16_rn(v);
    lo = __float2bfloat16_rn(v - __bfloat162float(hi));
  }
};
template <>
struct TcArith<true> {
  using T = float;
  using Prec = wmma::precision::tf32;
  static constexpr int kK = 8;
  static constexpr int kLd = kBK + 4;  // a multiple of 4 elements
  __device__ static void split(float v, T& hi, T& lo) {
    hi = wmma::__float_to_tf32(v);
    lo = wmma::__float_to_tf32(v - hi);
  }
};

enum Mode : int { kDense = 0, kGateUp = 1, kDown = 2 };

struct TcArgs {
  // Dense: up to kMaxGemvJobs matrices over the same x; block x enumerates their 64-feature tiles.
  GemvJob job[kMaxGemvJobs];
  int first_tile[kMaxGemvJobs + 1] = {};
  int n_jobs = 0;
  int rows = 0;  // dense: x rows
  const float* x = nullptr;
  int ldx = 0;
  int K = 0;
  // Grouped experts: tiles of up to BM pairs of one expert (group_pairs), read on the device.
  const ExpertPair* pairs = nullptr;
  const int32_t* order = nullptr;  // pair indices grouped by expert
  const int2* tiles = nullptr;     // (first index into order, count)
  const int32_t* n_tiles = nullptr;
  float* y = nullptr;  // experts: output row per pair
  int ldy = 0;
  // Dense split-K (short, wide matrices such as the hyper-connection down projection, which would
  // otherwise give a few dozen blocks): block z covers K [z*k_chunk, (z+1)*k_chunk) and writes raw sums
  // to split's scratch (cuda/split_k.h); split_k_finish adds them.
  int k_chunk = 0;
  SplitK split;
};


// 16 consecutive weights w[n][k0 .. k0+16) in two steps, so a tile's global loads are in flight while
// the tensor cores work on the previous tile: fetch16 issues the loads into registers (raw codes, scale
// and bias), dequant16 turns them into fp32 with the CPU's rounding (s * q + b, no FMA). Rows past the
// end read as zero; rare forms (2/3-bit codes, f16/f32, a ragged tail) are read element by element in
// dequant16 (no prefetch).
enum WPath : int { kWZero = 0, kWQ4 = 1, kWQ8 = 2, kWBF16 = 3, kWElem = 4 };
struct WRaw {
  uint4 a, b;
  float s, bias;
  int path;
};

__device__ __forceinline__ void fetch16(const DMatrix& w, int n, int k0, WRaw& r) {
  r.path = kWElem;
  if (n >= w.rows) { r.path = kWZero; return; }
  const bool full = k0 + 16 <= w.cols;
  if (w.quantized() && full && (w.fmt.bits == 4 || w.fmt.bits == 8) && w.cols % 32 == 0) {
    // k0 is a multiple of 16 and groups are >= 32 wide: one scale and bias for the 16 codes.
    const size_t row_bytes = static_cast<size_t>(w.cols) * w.fmt.bits / 8;
    const int64_t si = static_cast<int64_t>(n) * (w.cols / w.fmt.group) + k0 / w.fmt.group;
    r.s = load_kind(w.scales, si, w.fmt.scale_kind);
    r.bias = load_kind(w.biases, si, w.fmt.scale_kind);
    const uint8_t* p = w.data + n * row_bytes + static_cast<size_t>(k0) * w.fmt.bits / 8;
    if (w.fmt.bits == 4) {
      const uint2 q = *reinterpret_cast<const uint2*>(p);
      r.a = make_uint4(q.x, q.y, 0, 0);
      r.path = kWQ4;
    } else {
      r.a = *reinterpret_cast<const uint4*>(p);
      r.path = kWQ8;
    }
  } else if (!w.quantized() && full && w.fmt.kind == static_cast<uint8_t>(WKind::BF16) && w.cols % 8 == 0) {
    const uint4* p = reinterpret_cast<const uint4*>(w.data + (static_cast<size_t>(n) * w.cols + k0) * 2);
    r.a = p[0];
    r.b = p[1];
    r.path = kWBF16;
  }
}

__device__ __forceinline__ void dequant16(const DMatrix& w, int n, int k0, const WRaw& r, float (&v)[16]) {
  if (r.path == kWQ4) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[i] = __fadd_rn(__fmul_rn(r.s, static_cast<float>((r.a.x >> (4 * i)) & 15u)), r.bias);
      v[8 + i] = __fadd_rn(__fmul_rn(r.s, static_cast<float>((r.a.y >> (4 * i)) & 15u)), r.bias);
    }
  } else if (r.path == kWQ8) {
    const uint32_t words[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
#pragma unroll
    for (int i = 0; i < 16; ++i)
      v[i] = __fadd_rn(__fmul_rn(r.s, static_cast<float>((words[i / 4] >> (8 * (i % 4))) & 255u)), r.bias);
  } else if (r.path == kWBF16) {
    const uint32_t words[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[2 * i] = __uint_as_float(words[i] << 16);
      v[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  } else if (r.path == kWZero) {
#pragma unroll
    for (int i = 0; i < 16; ++i) v[i] = 0.0f;
  } else {
    for (int i = 0; i < 16; ++i) v[i] = k0 + i < w.cols ? dmatrix_elem(w, n, k0 + i) : 0.0f;
  }
}

// The operand tiles, and (after the last product) the block's results in the same bytes.
template <int MF, int NW, class A>
union TcSmem {
  struct {
    typename A::T xh[16 * MF][A::kLd], xl[16 * MF][A::kLd];
    typename A::T wh[NW][kBN][A::kLd], wl[NW][kBN][A::kLd];
  } t;
  float out[NW][16 * MF][kBN + 4];
};

// Rows of the block: src[i] (the x row, or -1 past the end), dst[i] (the output row).
// Dense: x rows m0+i, outputs the same. Gate/up: x = the pair's x_row, output = the pair. Down: both
// are the pair (h is per pair).
template <int MF, int MODE, bool kTf32>
__global__ void __launch_bounds__(kThreads) tc_kernel(const __grid_constant__ TcArgs a) {
  using A = TcArith<kTf32>;
  constexpr int BM = 16 * MF, KK = A::kK, kLd = A::kLd;
  constexpr int NW = MODE == kGateUp ? 2 : 1;
  __shared__ __align__(128) TcSmem<MF, NW, A> sm;
  __shared__ int src[BM], dst[BM];
  __shared__ int n_rows_s;

  DMatrix w0, w1;
  int job = 0, n0 = 0, K = a.K, ldy = a.ldy;
  float* y = a.y;
  Epilogue epi = Epilogue::None;
  float epi_arg = 1.0f;
  if constexpr (MODE == kDense) {
    int j = 0;
    while (j + 1 < a.n_jobs && static_cast<int>(blockIdx.x) >= a.first_tile[j + 1]) ++j;
    job = j;
    w0 = a.job[j].w;
    n0 = (static_cast<int>(blockIdx.x) - a.first_tile[j]) * kBN;
    y = a.job[j].y;
    ldy = a.job[j].ldy;
    epi = a.job[j].epi;
    epi_arg = a.job[j].epi_arg;
    const int m0 = static_cast<int>(blockIdx.y) * BM;
    if (threadIdx.x < BM) {
      const int r = m0 + static_cast<int>(threadIdx.x);
      src[threadIdx.x] = r < a.rows ? r : -1;
      dst[threadIdx.x] = r;
    }
    if (threadIdx.x == 0) n_rows_s = min(BM, a.rows - m0);
  } else {
    if (static_cast<int>(blockIdx.y) >= *a.n_tiles) return;  // uniform over the block
    const int2 t = a.tiles[blockIdx.y];
    const ExpertPair& p0 = a.pairs[a.order[t.x]];
    w0 = MODE == kGateUp ? p0.gate : p0.down;
    w1 = p0.up;
    n0 = static_cast<int>(blockIdx.x) * kBN;
    K = w0.cols;
    if (threadIdx.x < BM) {
      const int i = static_cast<int>(threadIdx.x);
      const int p = i < t.y ? a.order[t.x + i] : -1;
      src[i] = p < 0 ? -1 : MODE == kGateUp ? a.pairs[p].x_row : p;
      dst[i] = p;
    }
    if (threadIdx.x == 0) n_rows_s = t.y;
  }
  if (n0 >= w0.rows) return;  // uniform: this expert is narrower than the widest
  __syncthreads();

  const int warp = threadIdx.x >> 5;
  wmma::fragment<wmma::accumulator, 16, 16, KK, float> acc[NW][MF];
#pragma unroll
  for (int q = 0; q < NW; ++q)
#pragma unroll
    for (int f = 0; f < MF; ++f) wmma::fill_fragment(acc[q][f], 0.0f);

  const bool x_vec = (a.ldx % 4 == 0) && (reinterpret_cast<uintptr_t>(a.x) % 16 == 0);
  // This block's K range: all of K, or one split of it (dense split-K, partial sums to a.partial).
  const int k_begin = MODE == kDense ? static_cast<int>(blockIdx.z) * a.k_chunk : 0;
  const int k_end = MODE == kDense ? min(K, k_begin + a.k_chunk) : K;
  // Per thread: MF float4 of the x tile (BM x 32 = 128*MF float4), 16 weights of each W tile.
  const int wn = threadIdx.x >> 1, wc = (threadIdx.x & 1) * 16;
  float4 xr[MF];
  WRaw wr[NW];
  auto fetch = [&](int k0) {
#pragma unroll
    for (int f = 0; f < MF; ++f) {
      const int e = threadIdx.x + f * kThreads;
      const int i = e / (kBK / 4), c = (e % (kBK / 4)) * 4;
      const int r = src[i];
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (r >= 0) {
        const float* xp = a.x + static_cast<size_t>(r) * a.ldx + k0 + c;
        if (x_vec && k0 + c + 4 <= K) {
          v = *reinterpret_cast<const float4*>(xp);
        } else {
          v.x = k0 + c + 0 < K ? xp[0] : 0.0f;
          v.y = k0 + c + 1 < K ? xp[1] : 0.0f;
          v.z = k0 + c + 2 < K ? xp[2] : 0.0f;
          v.w = k0 + c + 3 < K ? xp[3] : 0.0f;
        }
      }
      xr[f] = v;
    }
#pragma unroll
    for (int q = 0; q < NW; ++q) fetch16(q == 0 ? w0 : w1, n0 + wn, k0 + wc, wr[q]);
  };
  auto store = [&](int k0) {
#pragma unroll
    for (int f = 0; f < MF; ++f) {
      const int e = threadIdx.x + f * kThreads;
      const int i = e / (kBK / 4), c = (e % (kBK / 4)) * 4;
      A::split(xr[f].x, sm.t.xh[i][c + 0], sm.t.xl[i][c + 0]);
      A::split(xr[f].y, sm.t.xh[i][c + 1], sm.t.xl[i][c + 1]);
      A::split(xr[f].z, sm.t.xh[i][c + 2], sm.t.xl[i][c + 2]);
      A::split(xr[f].w, sm.t.xh[i][c + 3], sm.t.xl[i][c + 3]);
    }
#pragma unroll
    for (int q = 0; q < NW; ++q) {
      float v[16];
      dequant16(q == 0 ? w0 : w1, n0 + wn, k0 + wc, wr[q], v);
#pragma unroll
      for (int t = 0; t < 16; ++t) A::split(v[t], sm.t.wh[q][wn][wc + t], sm.t.wl[q][wn][wc + t]);
    }
  };

  if (k_begin < k_end) fetch(k_begin);
  for (int k0 = k_begin; k0 < k_end; k0 += kBK) {
    __syncthreads();  // the previous tile is consumed
    store(k0);
    __syncthreads();
    if (k0 + kBK < k_end) fetch(k0 + kBK);  // in flight during the products below
#pragma unroll
    for (int kk = 0; kk < kBK; kk += KK) {
      wmma::fragment<wmma::matrix_a, 16, 16, KK, typename A::Prec, wmma::row_major> ah[MF], al[MF];
#pragma unroll
      for (int f = 0; f < MF; ++f) {
        wmma::load_matrix_sync(ah[f], &sm.t.xh[f * 16][kk], kLd);
        wmma::load_matrix_sync(al[f], &sm.t.xl[f * 16][kk], kLd);
      }
#pragma unroll
      for (int q = 0; q < NW; ++q) {
        // B = Wᵀ: element (k, n) is w[n][k], i.e. the [n][k] tile read column-major.
        wmma::fragment<wmma::matrix_b, 16, 16, KK, typename A::Prec, wmma::col_major> bh, bl;
        wmma::load_matrix_sync(bh, &sm.t.wh[q][warp * 16][kk], kLd);
        wmma::load_matrix_sync(bl, &sm.t.wl[q][warp * 16][kk], kLd);
#pragma unroll
        for (int f = 0; f < MF; ++f) {
          wmma::mma_sync(acc[q][f], al[f], bh, acc[q][f]);  // small terms first
          wmma::mma_sync(acc[q][f], ah[f], bl, acc[q][f]);
          wmma::mma_sync(acc[q][f], ah[f], bh, acc[q][f]);
        }
      }
    }
  }
  __syncthreads();  // every warp is done with the tiles: their bytes now hold the results
#pragma unroll
  for (int q = 0; q < NW; ++q)
#pragma unroll
    for (int f = 0; f < MF; ++f)
      wmma::store_matrix_sync(&sm.out[q][f * 16][warp * 16], acc[q][f], kBN + 4, wmma::mem_row_major);
  __syncthreads();
  const int n_rows = n_rows_s;
  for (int e = threadIdx.x; e < BM * kBN; e += kThreads) {
    const int i = e / kBN, c = e % kBN;
    if (i >= n_rows || n0 + c >= w0.rows) continue;
    float v = sm.out[0][i][c];
    if constexpr (MODE == kGateUp) {
      v = siluf_(v) * sm.out[1][i][c];
    } else if constexpr (MODE == kDense) {
      if (a.split.partial) {  // split-K: the raw partial sum; split_k_finish adds the splits in order
        a.split.partial[static_cast<size_t>(blockIdx.z) * a.split.stride + a.split.off[job] +
                        static_cast<size_t>(dst[i]) * w0.rows + n0 + c] = v;
        continue;
      }
      v = apply_epilogue(v, epi, epi_arg);
    }
    y[static_cast<size_t>(dst[i]) * ldy + n0 + c] = v;
  }
}

// Inclusive scans of two values over the warp (Hillis-Steele, shuffles up).
__device__ __forceinline__ void warp_inclusive_scan2(int& a, int& b) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int ya = __shfl_up_sync(0xffffffffu, a, o), yb = __shfl_up_sync(0xffffffffu, b, o);
    if (lane >= o) {
      a += ya;
      b += yb;
    }
  }
}

// Grouping a chunk's pairs by expert (ExpertPair::group): a counting sort in three kernels, then the
// tile list. Order inside a group may differ between runs; no result depends on it (each pair's
// products are its own column's, whatever its tile or place). Why three: one block of 1,024 threads
// walking an 8,192-row chunk's ~90k pairs twice took ~200 us a MoE layer (0.9% of an 8k prefill,
// fortieth session), its loads of the pairs one round trip after another on one SM; and thread 0
// walking all 512 experts alone had taken it to ~36 us per layer and 1,024-row chunk (twelfth).
constexpr int kGroupThreads = 256;
constexpr int kGroupPairsPerThread = 8;
constexpr int kGroupPairsPerBlock = kGroupThreads * kGroupPairsPerThread;

// This thread's pair i of the block's kGroupPairsPerBlock (group_count_kernel, group_scatter_kernel).
__device__ __forceinline__ int block_pair(int i) {
  return static_cast<int>(blockIdx.x) * kGroupPairsPerBlock + static_cast<int>(threadIdx.x) + i * kGroupThreads;
}
// The groups of this thread's pairs, -1 past the end. Every load first: one round trip, not eight.
__device__ __forceinline__ void load_block_groups(const ExpertPair* pairs, int n_pairs, int (&grp)[kGroupPairsPerThread]) {
#pragma unroll
  for (int i = 0; i < kGroupPairsPerThread; ++i) grp[i] = block_pair(i) < n_pairs ? pairs[block_pair(i)].group : -1;
}

// count[g] += the pairs of group g among this block's kGroupPairsPerBlock (a histogram in shared
// memory first, so one global atomic per group and block). grid (ceil(n_pairs / kGroupPairsPerBlock)).
__global__ void __launch_bounds__(kGroupThreads) group_count_kernel(const ExpertPair* pairs, int n_pairs, int n_groups,
                                                                    int* count) {
  extern __shared__ int hist[];
  for (int g = threadIdx.x; g < n_groups; g += blockDim.x) hist[g] = 0;
  __syncthreads();
  int grp[kGroupPairsPerThread];
  load_block_groups(pairs, n_pairs, grp);
#pragma unroll
  for (int i = 0; i < kGroupPairsPerThread; ++i)
    if (grp[i] >= 0) atomicAdd(&hist[grp[i]], 1);
  __syncthreads();
  for (int g = threadIdx.x; g < n_groups; g += blockDim.x)
    if (hist[g]) atomicAdd(&count[g], hist[g]);
}

// One block: each group's first place in `order` (into cursor) and its tiles of up to bm pairs. The
// pair and tile offsets are block-wide scans over runs of groups (warp scans, then a scan of the
// warps' totals), in group order.
__global__ void group_scan_kernel(const int* count, int n_groups, int bm, int* cursor, int2* tiles, int32_t* n_tiles) {
  __shared__ int warp_pairs[32], warp_tiles[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  // This thread's run of groups [g0, g1): its pairs and tiles, then their exclusive offsets.
  const int per = (n_groups + blockDim.x - 1) / blockDim.x;
  const int g0 = min(n_groups, static_cast<int>(threadIdx.x) * per), g1 = min(n_groups, g0 + per);
  int np = 0, nt = 0;
  for (int g = g0; g < g1; ++g) {
    np += count[g];
    nt += (count[g] + bm - 1) / bm;
  }
  int ip = np, it = nt;
  warp_inclusive_scan2(ip, it);
  if (lane == 31) {
    warp_pairs[warp] = ip;
    warp_tiles[warp] = it;
  }
  __syncthreads();
  if (warp == 0) {
    int vp = lane < n_warps ? warp_pairs[lane] : 0, vt = lane < n_warps ? warp_tiles[lane] : 0;
    warp_inclusive_scan2(vp, vt);
    warp_pairs[lane] = vp;
    warp_tiles[lane] = vt;
  }
  __syncthreads();
  int o = ip - np + (warp > 0 ? warp_pairs[warp - 1] : 0), ot = it - nt + (warp > 0 ? warp_tiles[warp - 1] : 0);
  for (int g = g0; g < g1; ++g) {
    const int n = count[g];
    cursor[g] = o;
    for (int t = 0; t < n; t += bm) tiles[ot++] = make_int2(o + t, min(bm, n - t));
    o += n;
  }
  if (threadIdx.x == blockDim.x - 1) *n_tiles = ot;  // the last run ends at the total
}

// order[cursor[g] + ...] = the block's pairs of group g: their ranks inside the block from a shared
// histogram, the block's range of each group from one global atomic per group and block. The grid of
// group_count_kernel.
__global__ void __launch_bounds__(kGroupThreads) group_scatter_kernel(const ExpertPair* pairs, int n_pairs, int n_groups,
                                                                      int* cursor, int32_t* order) {
  extern __shared__ int sh[];
  int* hist = sh;
  int* base = sh + n_groups;
  for (int g = threadIdx.x; g < n_groups; g += blockDim.x) hist[g] = 0;
  __syncthreads();
  int grp[kGroupPairsPerThread], rank[kGroupPairsPerThread];
  load_block_groups(pairs, n_pairs, grp);
#pragma unroll
  for (int i = 0; i < kGroupPairsPerThread; ++i) rank[i] = grp[i] >= 0 ? atomicAdd(&hist[grp[i]], 1) : 0;
  __syncthreads();
  for (int g = threadIdx.x; g < n_groups; g += blockDim.x)
    if (hist[g]) base[g] = atomicAdd(&cursor[g], hist[g]);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kGroupPairsPerThread; ++i)
    if (grp[i] >= 0) order[base[grp[i]] + rank[i]] = block_pair(i);
}

struct SplitKReduceArgs {
  SplitK s;
  GemvJob job[kMaxGemvJobs];
  int n_jobs;
};

// y = epi(Σ_z partial_z) for every (job, row, n), the splits added in index order (deterministic).
// grid (ceil(stride / 256)), block 256.
__global__ void split_k_reduce_kernel(const __grid_constant__ SplitKReduceArgs a, int splits) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= a.s.stride) return;
  int j = 0;
  while (j + 1 < a.n_jobs && t >= a.s.off[j + 1]) ++j;
  const GemvJob& jb = a.job[j];
  const int64_t local = t - a.s.off[j], r = local / jb.w.rows, n = local % jb.w.rows;
  float v = 0.0f;
  for (int z = 0; z < splits; ++z) v += a.s.partial[static_cast<size_t>(z) * a.s.stride + t];
  jb.y[r * jb.ldy + n] = apply_epilogue(v, jb.epi, jb.epi_arg);
}

// tf32x3 unless CK_TC=bf16x3 (read once).
bool use_tf32() {
  static const bool tf32 = !env_is("CK_TC", "bf16x3");
  return tf32;
}

template <int MF, int MODE>
void launch(const TcArgs& a, dim3 grid, cudaStream_t s) {
  if (use_tf32()) tc_kernel<MF, MODE, true><<<grid, kThreads, 0, s>>>(a);
  else tc_kernel<MF, MODE, false><<<grid, kThreads, 0, s>>>(a);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

// A group's tiles are ceil(count / kGroupRows) <= count / kGroupRows + 1 when it has pairs, none when it
// has none, and at most min(n_groups, n_pairs) groups have pairs.
int grouped_max_tiles(int n_pairs, int n_groups) {
  return static_cast<int>(ceil_div(n_pairs, kGroupRows)) + std::min(n_groups, n_pairs);
}

void gemm_tc(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream) {
  CK_REQUIRE(n_jobs >= 1 && n_jobs <= kMaxGemvJobs && rows >= 1, "invariant");
  if (gemm_q4(jobs, n_jobs, x, ldx, rows, stream)) return;
  // Only gemm_q4 reads 16-row tiles: a tiled job beside jobs it does not take goes alone.
  const bool tiled = any_tiled(jobs, n_jobs);
  if (tiled && n_jobs > 1) {
    for (int j = 0; j < n_jobs; ++j) gemm_tc(&jobs[j], 1, x, ldx, rows, stream);
    return;
  }
  CK_REQUIRE(!tiled, "gemm_tc: a matrix in 16-row tiles that gemm_q4 did not take (K %d)", jobs[0].w.cols);
  TcArgs a;
  a.n_jobs = n_jobs;
  a.rows = rows;
  a.x = x;
  a.ldx = ldx;
  a.K = jobs[0].w.cols;
  int tiles = 0;
  for (int j = 0; j < n_jobs; ++j) {
    CK_REQUIRE(jobs[j].w.cols == a.K && jobs[j].w.rows >= 1 && jobs[j].y, "gemm_tc: job %d", j);
    a.job[j] = jobs[j];
    a.first_tile[j] = tiles;
    tiles += static_cast<int>(ceil_div(jobs[j].w.rows, kBN));
  }
  a.first_tile[n_jobs] = tiles;
  const int m_tiles = static_cast<int>(ceil_div(rows, 64));
  // Fewer blocks than two waves and a long K: split K so every SM gets work.
  const int blocks = tiles * m_tiles, want = 2 * sm_count();
  int splits = 1;
  if (blocks < want && a.K >= 8 * kBK) splits = std::min<int>({16, static_cast<int>(ceil_div(want, blocks)), a.K / (4 * kBK)});
  a.k_chunk = static_cast<int>(round_up(ceil_div(a.K, splits), kBK));
  splits = static_cast<int>(ceil_div(a.K, a.k_chunk));
  if (splits == 1) {
    launch<4, kDense>(a, dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(m_tiles), 1), stream);
    return;
  }
  a.split = split_k_start(jobs, n_jobs, rows, splits, stream);
  launch<4, kDense>(a, dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(m_tiles), static_cast<unsigned>(splits)),
                    stream);
  split_k_finish(a.split, jobs, n_jobs, splits, stream);
}

SplitK split_k_start(const GemvJob* jobs, int n_jobs, int rows, int splits, cudaStream_t stream) {
  SplitK s;
  for (int j = 0; j < n_jobs; ++j) {
    s.off[j] = s.stride;
    s.stride += static_cast<int64_t>(rows) * jobs[j].w.rows;
  }
  s.off[n_jobs] = s.stride;
  // Stream-ordered scratch: safe for any number of sessions and streams, pooled by the driver.
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&s.partial), sizeof(float) * s.stride * splits, stream));
  return s;
}

void split_k_finish(const SplitK& s, const GemvJob* jobs, int n_jobs, int splits, cudaStream_t stream) {
  SplitKReduceArgs a{};
  a.s = s;
  a.n_jobs = n_jobs;
  for (int j = 0; j < n_jobs; ++j) a.job[j] = jobs[j];
  split_k_reduce_kernel<<<static_cast<unsigned>(ceil_div(s.stride, 256)), 256, 0, stream>>>(a, splits);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaFreeAsync(s.partial, stream));
}

void group_pairs(const ExpertPair* pairs, int n_pairs, int n_groups, int32_t* order, int2* tiles, int32_t* n_tiles,
                 cudaStream_t stream) {
  CK_REQUIRE(n_pairs >= 1 && n_groups >= 1 && n_groups <= 16384, "invariant");
  static const bool ready = [] {  // the histograms' shared memory: up to 2 x 16,384 ints
    CUDA_CHECK(cudaFuncSetAttribute(group_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 16384 * 4));
    CUDA_CHECK(cudaFuncSetAttribute(group_scatter_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * 16384 * 4));
    return true;
  }();
  (void)ready;
  // Stream-ordered scratch (as split_k_start's): each group's count, then its cursor.
  int* scratch = nullptr;
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch), sizeof(int) * 2 * n_groups, stream));
  int* count = scratch;
  int* cursor = scratch + n_groups;
  CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof(int) * n_groups, stream));
  const unsigned blocks = static_cast<unsigned>(ceil_div(n_pairs, kGroupPairsPerBlock));
  group_count_kernel<<<blocks, kGroupThreads, sizeof(int) * n_groups, stream>>>(pairs, n_pairs, n_groups, count);
  CUDA_CHECK_LAUNCH();
  group_scan_kernel<<<1, 1024, 0, stream>>>(count, n_groups, kGroupRows, cursor, tiles, n_tiles);
  CUDA_CHECK_LAUNCH();
  group_scatter_kernel<<<blocks, kGroupThreads, sizeof(int) * 2 * n_groups, stream>>>(pairs, n_pairs, n_groups, cursor,
                                                                                      order);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaFreeAsync(scratch, stream));
}

void expert_gate_up_grouped(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                            int max_tiles, int max_inter, const float* x, int ldx, float* h, int ldh,
                            cudaStream_t stream) {
  TcArgs a;
  a.pairs = pairs; a.order = order; a.tiles = tiles; a.n_tiles = n_tiles;
  a.x = x; a.ldx = ldx; a.y = h; a.ldy = ldh;
  launch<kGroupRows / 16, kGateUp>(a, dim3(static_cast<unsigned>(ceil_div(max_inter, kBN)), static_cast<unsigned>(max_tiles)),
                     stream);
}

void expert_down_grouped(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                         int max_tiles, int hidden, const float* h, int ldh, float* y, int ldy, cudaStream_t stream) {
  TcArgs a;
  a.pairs = pairs; a.order = order; a.tiles = tiles; a.n_tiles = n_tiles;
  a.x = h; a.ldx = ldh; a.y = y; a.ldy = ldy;
  launch<kGroupRows / 16, kDown>(a, dim3(static_cast<unsigned>(ceil_div(hidden, kBN)), static_cast<unsigned>(max_tiles)), stream);
}

}  // namespace ck::cuda
