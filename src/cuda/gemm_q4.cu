// Prefill products of MLX 4-bit codes (the real checkpoint's form) in the factored form: the codes go
// to the tensor cores as they are (exact in bf16; mma_q4.cuh) and each 64-code group's scale and bias
// are applied to the group's sums, y += s * Σ q x + b * Σ x. Two users:
//  - the routed and shared experts, grouped per expert as in gemm.cu (group_pairs' tiles of up to
//    kGroupRows pairs of one expert);
//  - dense projections of a prefill chunk (gemm_tc hands them here when every job is 4-bit codes and
//    the grid is large enough).
// gemm.cu's kernels instead dequantize and split every weight into shared memory once per tile, which
// bounds them (with the ~20 rows an expert gets per 1,024-row chunk, and for the dense projections).
//
// The activations are split once per call into three bf16 parts, already in the lanes' fragment order
// (q4_xfrag_kernel), with each row's Σ x per group; the products are then exact (integer codes times
// 8-bit mantissas) and accumulate in fp32: results within fp32 rounding of the CPU's, closer than
// gemm.cu's tf32x3.
//
// Block: 8 warps, a tile of 32 rows (two m16 fragments) x 8 * 8 * NT output features (NT n8 fragments
// per warp: 2 for gate/up, 4 otherwise). The block copies each 64-code group's A fragments of its 32
// rows (3 parts, 12 KB) and the group's scales and biases into shared memory with cp.async, two groups
// ahead, in a layout where every fragment load of a warp is a contiguous 512- or 256-byte read (no bank
// conflicts); each warp loads 8 bytes of codes per feature row and matrix (one group ahead, in
// registers) and runs 3 x 2 x NT MMAs per k16 step and matrix. (The first version read the A fragments
// from global memory in every warp, 12 scattered 8-byte loads per step: L1 was the limit, ~70% busy at
// 1.2 instructions issued per cycle. Staging the codes too, 8 KB more per buffer, measured no faster.)
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

namespace ck::cuda {
namespace {

constexpr int kQ4Threads = 128;      // q4_xfrag_kernel
constexpr int kQ4TileWarps = 8;      // q4_tile_kernel: 8 warps share their rows' A fragments (shared memory)
static_assert(kQ4TileWarps * 32 == 256, "q4_tile_kernel's staging gives each of 256 threads its copies");

// Split activations of one row, per group: 16 uint4 then 16 uint2, entry e = s * 4 + t (k16 step s,
// lane t): the uint4 holds parts 0 and 1 (hi, mid) and the uint2 part 2 (lo), each as (pair A, pair B)
// of mma_q4.cuh's K order; then Σ x per group. grid (rows), block 128.
constexpr int kQ4GroupU2 = 48;
constexpr int kQ4Stages = 3;  // q4_tile_kernel's shared-memory buffers of A fragments  // uint2 per row and group: 16 x (2 + 1)

__global__ void __launch_bounds__(kQ4Threads) q4_xfrag_kernel(const float* __restrict__ x, int ldx, int K, int groups,
                                                              uint2* xf, float* gsum) {
  const int row = blockIdx.x;
  const float* xr = x + static_cast<size_t>(row) * ldx;
  uint2* out = xf + static_cast<size_t>(row) * groups * kQ4GroupU2;
  for (int e = threadIdx.x; e < groups * 16; e += blockDim.x) {
    const int t = e % 4, s = (e / 4) % 4, G = e / 16;
    const int c = G * 64 + (2 * t + (s >> 1)) * 8 + 2 * (s & 1);
    uint2 v[3] = {};
    if (c < K) {  // K % 64 == 0 for the groups that exist; rows of a shorter matrix read zeros
#pragma unroll
      for (int p = 0; p < 3; ++p) {
        v[p].x = bf16_pair(bf16_part(xr[c], p), bf16_part(xr[c + 4], p));
        v[p].y = bf16_pair(bf16_part(xr[c + 1], p), bf16_part(xr[c + 5], p));
      }
    }
    uint2* o = out + static_cast<size_t>(G) * kQ4GroupU2;
    reinterpret_cast<uint4*>(o)[e % 16] = make_uint4(v[0].x, v[0].y, v[1].x, v[1].y);
    o[32 + e % 16] = v[2];
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int G = warp; G < groups; G += blockDim.x >> 5) {
    const float v = G * 64 < K ? warp_sum(xr[G * 64 + lane] + xr[G * 64 + 32 + lane]) : 0.0f;
    if (lane == 0) gsum[static_cast<size_t>(row) * groups + G] = v;
  }
}

// One group's A fragments of a block's 32 rows in shared memory: [step][row][lane t], so a warp's
// load of (step, 8 rows) x 4 lanes t is contiguous. 12.1 KB; kQ4Stages of them.
// Also the group's scale and bias of each of the block's output features (the 4-byte word that holds
// each, so cp.async can copy it whatever the element's alignment): an expert's weights come from DRAM
// once per chunk, and loaded in the epilogue their latency stalled every group.
struct Q4Stage {
  uint4 a01[4][32][4];  // parts 0 and 1
  uint2 a2[4][32][4];   // part 2
  float gsum[32];
  alignas(16) uint32_t sb[512];  // [matrix][feature][scale, bias]: NW * block features * 2 = 512 in every mode
};

enum Q4Mode : int { kQ4Dense = 0, kQ4GateUp = 1, kQ4Down = 2 };

struct Q4Args {
  // Experts: group_pairs' tiles, read on the device.
  const ExpertPair* pairs;
  const int32_t* order;
  const int2* tiles;
  const int32_t* n_tiles;
  // Dense: up to kMaxGemvJobs matrices over the same x rows [0, rows); blockIdx.x enumerates their
  // 64-feature tiles, blockIdx.y the 32-row tiles of x.
  GemvJob job[kMaxGemvJobs];
  int32_t first_tile[kMaxGemvJobs + 1];
  int32_t n_jobs;
  int32_t rows;
  const uint2* xf;    // q4_xfrag_kernel's output for the x rows (dense/gate-up: tokens; down: pairs)
  const float* gsum;
  int groups;         // groups per x row in xf (the longest K / 64)
  float* y;           // experts: the output row per pair
  int ldy;
  // Dense split-K (few feature tiles over a long K: the hyper-connection down projection): block z
  // takes groups [z * k_groups, (z + 1) * k_groups) and writes its raw sums to
  // partial[z * partial_stride + partial_off[job] + row * N + n]; q4_reduce_kernel finishes.
  int k_groups;       // dense: groups per block (all of them without a split)
  float* partial;
  int64_t partial_stride;
  int64_t partial_off[kMaxGemvJobs + 1];
};

// Output features per warp: NT n8 fragments. Gate/up keeps 2 (two matrices' accumulators); dense and
// down take 4, so each A fragment (the three x parts) feeds twice the MMAs.
template <int MODE>
__host__ __device__ constexpr int q4_nt() { return MODE == kQ4GateUp ? 2 : 4; }
template <int MODE>
__host__ __device__ constexpr int q4_block_features() { return kQ4TileWarps * 8 * q4_nt<MODE>(); }

// kQ4GateUp: h[pair] = silu(gate · x) * (up · x); kQ4Down: y[pair] = down · h; grid (features /
// q4_block_features, max tiles). kQ4Dense: y_job[row] = epi(w_job · x[row]); grid (feature tiles of all
// jobs, rows / 32).
// STAGED: the A fragments through shared memory (above); otherwise each warp loads its own from global
// memory (two loads per row pair and step, through L1). CK_Q4_STAGE picks per use (q4_staged).
template <int MODE, bool STAGED>
__global__ void __launch_bounds__(kQ4TileWarps * 32, 2) q4_tile_kernel(const __grid_constant__ Q4Args a) {
  constexpr int NW = MODE == kQ4GateUp ? 2 : 1, NT = q4_nt<MODE>(), BF = q4_block_features<MODE>();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  DMatrix w0, w1;
  int job = 0;
  float* y = a.y;
  int ldy = a.ldy, f_warp = 0;
  Epilogue epi = Epilogue::None;
  float epi_arg = 1.0f;
  // The output row of each of the tile's 32 slots this lane stores (rows g, g+8 of both m16
  // fragments), -1 past the tile's rows; src_of_slot gives the x row slot i reads (row 0 past the end).
  int dst[2][2];
  int m0 = 0;
  int2 tile = make_int2(0, 0);
  if constexpr (MODE == kQ4Dense) {
    int& j = job;
    while (j + 1 < a.n_jobs && static_cast<int>(blockIdx.x) >= a.first_tile[j + 1]) ++j;
    w0 = a.job[j].w;
    y = a.job[j].y;
    ldy = a.job[j].ldy;
    epi = a.job[j].epi;
    epi_arg = a.job[j].epi_arg;
    f_warp = (static_cast<int>(blockIdx.x) - a.first_tile[j]) * BF + warp * 8 * NT;
    m0 = static_cast<int>(blockIdx.y) * 32;
  } else {
    if (static_cast<int>(blockIdx.y) >= *a.n_tiles) return;  // uniform over the block
    tile = a.tiles[blockIdx.y];
    const ExpertPair& p0 = a.pairs[a.order[tile.x]];
    w0 = MODE == kQ4GateUp ? p0.gate : p0.down;
    w1 = p0.up;
    f_warp = static_cast<int>(blockIdx.x) * BF + warp * 8 * NT;
  }
  // Dense: the chunk's rows; experts: the tile's pairs (gate/up reads each pair's token row, down the
  // pair's own row of h).
  auto dst_of_slot = [&](int i) -> int {
    if constexpr (MODE == kQ4Dense) return m0 + i < a.rows ? m0 + i : -1;
    else return i < tile.y ? a.order[tile.x + i] : -1;
  };
  auto src_of_slot = [&](int i) -> int {
    const int p = dst_of_slot(i);
    if constexpr (MODE == kQ4GateUp) return p < 0 ? 0 : a.pairs[p].x_row;
    else return p < 0 ? 0 : p;
  };
#pragma unroll
  for (int mf = 0; mf < 2; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) dst[mf][h] = dst_of_slot(mf * 16 + h * 8 + g);
  const int block_f0 = f_warp - warp * 8 * NT;
  const bool active = f_warp < w0.rows;  // warp-uniform; idle warps still stage and meet the barriers
  const int K = w0.cols, gpg = w0.fmt.group / 64;
  // This block's groups: all of K, or one split of it (dense split-K).
  const int g_begin = MODE == kQ4Dense ? static_cast<int>(blockIdx.z) * a.k_groups : 0;
  const int g_end = MODE == kQ4Dense ? min(K / 64, g_begin + a.k_groups) : K / 64;
  const size_t row_bytes = static_cast<size_t>(K) / 2, n_sg = K / w0.fmt.group;
  const uint8_t sk = w0.fmt.scale_kind;
  const int es = sk == static_cast<uint8_t>(WKind::F32) ? 4 : 2;  // bytes per scale or bias
  // Feature rows this lane loads codes of (col g of each n8 fragment), and the two output features
  // (cols 2t, 2t+1) whose scales it applies; rows past the matrix are clamped (never stored).
  int fr[NT], fo[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    fr[nt] = min(f_warp + nt * 8 + g, w0.rows - 1);
    fo[nt][0] = min(f_warp + nt * 8 + 2 * t, w0.rows - 1);
    fo[nt][1] = min(f_warp + nt * 8 + 2 * t + 1, w0.rows - 1);
  }
  __shared__ Q4Stage stage[kQ4Stages];
  __shared__ int srow[32];
  if (threadIdx.x < 32) srow[threadIdx.x] = src_of_slot(threadIdx.x);
  __syncthreads();
  // Group G of the 32 rows into `st`: 512 16-byte copies of parts 0-1, 256 of part 2 (two lanes' worth
  // each), 32 sums; every thread issues 3 or 4 (blockDim is 256).
  const uint4* xf4 = reinterpret_cast<const uint4*>(a.xf);
  auto stage_group = [&](int G, Q4Stage& st) {
    const int tid = threadIdx.x;
#pragma unroll
    for (int i = tid; i < 512; i += kQ4TileWarps * 32) {
      const int r = i >> 4, e = i & 15;
      cp_async16(&st.a01[e >> 2][r][e & 3], xf4 + (static_cast<size_t>(srow[r]) * a.groups + G) * (kQ4GroupU2 / 2) + e);
    }
    {
      const int r = tid >> 3, e2 = tid & 7;
      cp_async16(&st.a2[e2 >> 1][r][(e2 & 1) * 2],
                 a.xf + (static_cast<size_t>(srow[r]) * a.groups + G) * kQ4GroupU2 + 32 + e2 * 2);
    }
    if (tid < 32) cp_async4(&st.gsum[tid], a.gsum + static_cast<size_t>(srow[tid]) * a.groups + G);
    const size_t sg = G / gpg;
#pragma unroll
    for (int i = tid; i < 2 * NW * BF; i += kQ4TileWarps * 32) {
      const int q = i / (2 * BF), fl = (i % (2 * BF)) >> 1;
      const DMatrix& w = q == 0 ? w0 : w1;
      const uintptr_t at = reinterpret_cast<uintptr_t>((i & 1) ? w.biases : w.scales) +
                           (static_cast<size_t>(min(block_f0 + fl, w0.rows - 1)) * n_sg + sg) * es;
      cp_async4(&st.sb[i], reinterpret_cast<const void*>(at & ~uintptr_t{3}));
    }
  };
  // A scale or bias from its staged 4-byte word: which half holds a 2-byte one is the parity of its
  // element index (scales and biases start 4-byte aligned: gemm_q4 checks the dense jobs; expert
  // records are 256-byte aligned, cuda/dmatrix.h expert_layout). par0: the parity of fo * n_sg, for
  // each of the lane's output features; the group's scale index sg adds its own.
  auto from_word = [&](uint32_t word, int par) -> float {
    if (sk == static_cast<uint8_t>(WKind::F32)) return __uint_as_float(word);
    if (sk == static_cast<uint8_t>(WKind::BF16)) return __uint_as_float(par ? word & 0xffff0000u : word << 16);
    return f16_bits_to_float(static_cast<uint16_t>(par ? word >> 16 : word & 0xffffu));
  };
  int par0[NT][2];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int c = 0; c < 2; ++c) par0[nt][c] = static_cast<int>((static_cast<int64_t>(fo[nt][c]) * n_sg) & 1);
  auto load_codes = [&](int G, uint2 (&wq)[NW][NT]) {
#pragma unroll
    for (int q = 0; q < NW; ++q) {
      const DMatrix& w = q == 0 ? w0 : w1;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        wq[q][nt] = __ldg(reinterpret_cast<const uint2*>(w.data + fr[nt] * row_bytes + G * 32 + 8 * t));
    }
  };
  float acc[NW][2][NT][4] = {};
  uint2 wq[NW][NT] = {};

  // Three buffers, two groups ahead: group G + 2 goes into the buffer group G - 1 used, after the
  // barrier that says every warp is done with it (one barrier per group).
  if constexpr (STAGED) {
    stage_group(g_begin, stage[0]);
    cp_async_commit();
    if (g_begin + 1 < g_end) stage_group(g_begin + 1, stage[1]);
    cp_async_commit();
  }
  if (active) load_codes(g_begin, wq);

  for (int G = g_begin; G < g_end; ++G) {
    if constexpr (STAGED) {
      cp_async_wait<1>();  // every committed group but the newest is done: group G is
      __syncthreads();
      if (G + 2 < g_end) stage_group(G + 2, stage[(G - g_begin + 2) % kQ4Stages]);
      cp_async_commit();  // possibly empty, so the count above stays one group per iteration
    }
    const Q4Stage& st = stage[(G - g_begin) % kQ4Stages];
    uint2 wn[NW][NT] = {};
    if (active) {
      if (G + 1 < g_end) load_codes(G + 1, wn);
      float d[NW][2][NT][4] = {};  // the group's Σ q x, fresh per group
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        // A: this step's pairs of rows g and g+8 of each m16 fragment, three parts each.
        uint2 xa[2][2][3];
#pragma unroll
        for (int mf = 0; mf < 2; ++mf)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = mf * 16 + h * 8 + g;
            uint4 v;
            if constexpr (STAGED) {
              v = st.a01[s][r][t];
              xa[mf][h][2] = st.a2[s][r][t];
            } else {
              const size_t base = static_cast<size_t>(srow[r]) * a.groups + G;
              v = __ldg(xf4 + base * (kQ4GroupU2 / 2) + s * 4 + t);
              xa[mf][h][2] = __ldg(a.xf + base * kQ4GroupU2 + 32 + s * 4 + t);
            }
            xa[mf][h][0] = make_uint2(v.x, v.y);
            xa[mf][h][1] = make_uint2(v.z, v.w);
          }
        const int i0 = 2 * (s & 1);
#pragma unroll
        for (int q = 0; q < NW; ++q)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint32_t wd = (s >> 1) ? wq[q][nt].y : wq[q][nt].x;
            const uint32_t b0 = code_pair(wd, i0), b1 = code_pair(wd, i0 + 1);
#pragma unroll
            for (int mf = 0; mf < 2; ++mf)
#pragma unroll
              for (int pt = 2; pt >= 0; --pt)  // small parts first
                mma_bf16(d[q][mf][nt], xa[mf][0][pt].x, xa[mf][1][pt].x, xa[mf][0][pt].y, xa[mf][1][pt].y, b0, b1);
          }
      }
      // y += s * Σ q x + b * Σ x for this group: features (2t, 2t+1) of each n8 fragment, rows (g, g+8).
      float sx[2][2];
#pragma unroll
      for (int mf = 0; mf < 2; ++mf)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = mf * 16 + h * 8 + g;
          if constexpr (STAGED) sx[mf][h] = st.gsum[r];
          else sx[mf][h] = __ldg(a.gsum + static_cast<size_t>(srow[r]) * a.groups + G);
        }
      const size_t sg = G / gpg;
#pragma unroll
      for (int q = 0; q < NW; ++q) {
        const DMatrix& w = q == 0 ? w0 : w1;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          float s0, b0, s1, b1;
          if constexpr (STAGED) {
            // (scale, bias) of features fl and fl + 1: 16 contiguous bytes.
            const int fl = warp * 8 * NT + nt * 8 + 2 * t, sp = static_cast<int>(sg & 1);
            const uint4 w4 = *reinterpret_cast<const uint4*>(&st.sb[(q * BF + fl) * 2]);
            s0 = from_word(w4.x, par0[nt][0] ^ sp);
            b0 = from_word(w4.y, par0[nt][0] ^ sp);
            s1 = from_word(w4.z, par0[nt][1] ^ sp);
            b1 = from_word(w4.w, par0[nt][1] ^ sp);
          } else {
            s0 = load_kind(w.scales, fo[nt][0] * n_sg + sg, sk), b0 = load_kind(w.biases, fo[nt][0] * n_sg + sg, sk);
            s1 = load_kind(w.scales, fo[nt][1] * n_sg + sg, sk), b1 = load_kind(w.biases, fo[nt][1] * n_sg + sg, sk);
          }
#pragma unroll
          for (int mf = 0; mf < 2; ++mf) {
            float* c = acc[q][mf][nt];
            const float* e = d[q][mf][nt];
            c[0] = fmaf(s0, e[0], fmaf(b0, sx[mf][0], c[0]));
            c[1] = fmaf(s1, e[1], fmaf(b1, sx[mf][0], c[1]));
            c[2] = fmaf(s0, e[2], fmaf(b0, sx[mf][1], c[2]));
            c[3] = fmaf(s1, e[3], fmaf(b1, sx[mf][1], c[3]));
          }
        }
      }
    }
#pragma unroll
    for (int q = 0; q < NW; ++q)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) wq[q][nt] = wn[q][nt];
  }
  if (!active) return;
  // Store: slot (mf, h) row, features f_warp + nt*8 + 2t + {0, 1}.
#pragma unroll
  for (int mf = 0; mf < 2; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (dst[mf][h] < 0) continue;
      float* yr = y + static_cast<size_t>(dst[mf][h]) * ldy;
      if (MODE == kQ4Dense && a.partial)
        yr = a.partial + blockIdx.z * a.partial_stride + a.partial_off[job] + static_cast<int64_t>(dst[mf][h]) * w0.rows;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int f = f_warp + nt * 8 + 2 * t + c;
          if (f >= w0.rows) continue;
          const float v0 = acc[0][mf][nt][2 * h + c];
          if constexpr (MODE == kQ4GateUp) yr[f] = siluf_(v0) * acc[NW - 1][mf][nt][2 * h + c];
          else if constexpr (MODE == kQ4Dense) yr[f] = a.partial ? v0 : apply_epilogue(v0, epi, epi_arg);
          else yr[f] = v0;
        }
    }
}

// y = epi(Σ_z partial_z) for every (job, row, n) of a dense split-K product, the splits added in
// index order (deterministic). grid (ceil(total / 256)), block 256.
__global__ void q4_reduce_kernel(const __grid_constant__ Q4Args a, int splits) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= a.partial_stride) return;
  int j = 0;
  while (j + 1 < a.n_jobs && t >= a.partial_off[j + 1]) ++j;
  const GemvJob& jb = a.job[j];
  const int64_t e = t - a.partial_off[j], row = e / jb.w.rows, n = e % jb.w.rows;
  float v = 0.0f;
  for (int z = 0; z < splits; ++z) v += a.partial[static_cast<size_t>(z) * a.partial_stride + t];
  jb.y[row * jb.ldy + n] = apply_epilogue(v, jb.epi, jb.epi_arg);
}

// Scratch for one call's split activations (stream-ordered: freed after the call's kernels).
struct XFrag {
  uint8_t* mem = nullptr;
  uint2* xf = nullptr;
  float* gsum = nullptr;
};

XFrag make_xfrag(const float* x, int ldx, int rows, int K, int groups, cudaStream_t stream) {
  XFrag f;
  const size_t xf_bytes = static_cast<size_t>(rows) * groups * kQ4GroupU2 * sizeof(uint2);
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&f.mem), xf_bytes + sizeof(float) * rows * groups, stream));
  f.xf = reinterpret_cast<uint2*>(f.mem);
  f.gsum = reinterpret_cast<float*>(f.mem + xf_bytes);
  q4_xfrag_kernel<<<static_cast<unsigned>(rows), kQ4Threads, 0, stream>>>(x, ldx, K, groups, f.xf, f.gsum);
  CUDA_CHECK_LAUNCH();
  return f;
}

}  // namespace

bool expert_q4_ok(const DMatrix& m) {
  // Groups of 64 x 2^k: the decode kernels (gemv.cu, Tc4Rows) find a code's scale group by a shift.
  const int gpg = m.fmt.group / 64;
  return m.quantized() && m.fmt.bits == 4 && m.fmt.group % 64 == 0 && (gpg & (gpg - 1)) == 0 &&
         m.cols % m.fmt.group == 0 && m.rows >= 1;
}

namespace {

// Which products stage their A fragments in shared memory. Measured (H200, 16-layer synthetic model,
// prefill, 2,048 tokens): staged, the dense projections took 14-25% less time and the experts 14% less
// than unstaged (the same kernel reading its fragments through L1). CK_Q4_STAGE=dense|none to compare.
bool q4_staged(int mode) {
  static const int pick = env_is("CK_Q4_STAGE", "none") ? 0 : env_is("CK_Q4_STAGE", "dense") ? 1 : 2;
  return pick == 2 || (pick == 1 && mode == kQ4Dense);
}

// One grouped expert product: x (x_rows rows of width K, a multiple of 64) split into fragments, then
// q4_tile_kernel over (features / block, tiles).
template <int MODE>
void launch_experts_q4(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                       int max_tiles, int features, const float* x, int ldx, int x_rows, int K, float* y, int ldy,
                       cudaStream_t stream) {
  CK_REQUIRE(K % 64 == 0 && x_rows >= 1, "experts q4: K %d, rows %d", K, x_rows);
  const int groups = K / 64;
  XFrag f = make_xfrag(x, ldx, x_rows, K, groups, stream);
  Q4Args a{};
  a.pairs = pairs; a.order = order; a.tiles = tiles; a.n_tiles = n_tiles;
  a.xf = f.xf; a.gsum = f.gsum; a.groups = groups; a.y = y; a.ldy = ldy;
  const dim3 grid(static_cast<unsigned>(ceil_div(features, q4_block_features<MODE>())), static_cast<unsigned>(max_tiles));
  if (q4_staged(MODE)) q4_tile_kernel<MODE, true><<<grid, kQ4TileWarps * 32, 0, stream>>>(a);
  else q4_tile_kernel<MODE, false><<<grid, kQ4TileWarps * 32, 0, stream>>>(a);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaFreeAsync(f.mem, stream));
}

}  // namespace

void expert_gate_up_q4(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                       int max_tiles, int max_inter, const float* x, int ldx, int x_rows, int hidden, float* h, int ldh,
                       cudaStream_t stream) {
  launch_experts_q4<kQ4GateUp>(pairs, order, tiles, n_tiles, max_tiles, max_inter, x, ldx, x_rows, hidden, h, ldh,
                               stream);
}

void expert_down_q4(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                    int max_tiles, int hidden, int max_inter, const float* h, int ldh, int n_pairs, float* y, int ldy,
                    cudaStream_t stream) {
  launch_experts_q4<kQ4Down>(pairs, order, tiles, n_tiles, max_tiles, hidden, h, ldh, n_pairs, max_inter, y, ldy,
                             stream);
}

bool gemm_q4(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream) {
  if (n_jobs < 1 || n_jobs > kMaxGemvJobs || rows < 1) return false;
  const int K = jobs[0].w.cols;
  int tiles = 0;
  for (int j = 0; j < n_jobs; ++j) {
    if (!expert_q4_ok(jobs[j].w) || jobs[j].w.cols != K) return false;
    // q4_tile_kernel reads 2-byte scales and biases out of aligned 4-byte words.
    if (reinterpret_cast<uintptr_t>(jobs[j].w.scales) % 4 || reinterpret_cast<uintptr_t>(jobs[j].w.biases) % 4) return false;
    tiles += static_cast<int>(ceil_div(jobs[j].w.rows, q4_block_features<kQ4Dense>()));
  }
  // Split K when the grid fills its last wave poorly (two blocks per SM): the hyper-connection down
  // projection (3 feature tiles over K = 10,240: 96 blocks for 1,024 rows) and the DeltaNet out
  // projection (320 blocks: 1.2 waves). The fewest splits whose waves are >= 85% full, each split at
  // least 8 groups long; the partial sums cost a write and a read of the output per split. K < 256
  // stays on gemm.cu.
  const int row_tiles = static_cast<int>(ceil_div(rows, 32)), groups = K / 64;
  if (K < 256) return false;
  const int64_t blocks = static_cast<int64_t>(tiles) * row_tiles, slots = 2 * static_cast<int64_t>(sm_count());
  auto fill = [&](int s) {
    const double waves = static_cast<double>(blocks * s) / static_cast<double>(slots);
    return waves / std::ceil(waves);
  };
  int splits = 1;
  const int max_splits = std::min(16, groups / 8);
  for (int s = 2; fill(splits) < 0.85 && s <= max_splits; ++s)
    if (fill(s) > fill(splits)) splits = s;
  if (blocks < sm_count() && splits < 2) return false;
  const int k_groups = static_cast<int>(ceil_div(groups, splits));
  splits = static_cast<int>(ceil_div(groups, k_groups));
  static const bool on = !env_is("CK_Q4_DENSE", "0");
  if (!on) return false;
  XFrag f = make_xfrag(x, ldx, rows, K, groups, stream);
  Q4Args a{};
  a.n_jobs = n_jobs;
  a.rows = rows;
  a.k_groups = k_groups;
  int t = 0;
  for (int j = 0; j < n_jobs; ++j) {
    a.job[j] = jobs[j];
    a.first_tile[j] = t;
    t += static_cast<int>(ceil_div(jobs[j].w.rows, q4_block_features<kQ4Dense>()));
  }
  a.first_tile[n_jobs] = t;
  a.xf = f.xf; a.gsum = f.gsum; a.groups = groups;
  if (splits > 1) {
    int64_t total = 0;
    for (int j = 0; j < n_jobs; ++j) {
      a.partial_off[j] = total;
      total += static_cast<int64_t>(rows) * jobs[j].w.rows;
    }
    a.partial_off[n_jobs] = total;
    a.partial_stride = total;
    CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&a.partial), sizeof(float) * total * splits, stream));
  }
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(row_tiles), static_cast<unsigned>(splits));
  if (q4_staged(kQ4Dense)) q4_tile_kernel<kQ4Dense, true><<<grid, kQ4TileWarps * 32, 0, stream>>>(a);
  else q4_tile_kernel<kQ4Dense, false><<<grid, kQ4TileWarps * 32, 0, stream>>>(a);
  CUDA_CHECK_LAUNCH();
  if (splits > 1) {
    q4_reduce_kernel<<<static_cast<unsigned>(ceil_div(a.partial_stride, 256)), 256, 0, stream>>>(a, splits);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaFreeAsync(a.partial, stream));
  }
  CUDA_CHECK(cudaFreeAsync(f.mem, stream));
  return true;
}

}  // namespace ck::cuda
