// GEMV for 1-8 activation rows over any stored weight format (MLX affine 2/3/4/8-bit codes with
// f32/bf16/f16 scales and biases, or f32/bf16/f16 floats), and the routed/shared expert products that
// read their matrices from ExpertPair views built on the device from the expert table. fp32 activations
// and fp32 accumulation throughout (the CPU reference's arithmetic, up to summation order).
//
// Schedules (docs/roofline-cuda.md):
//  v4 (4-bit codes, MLX groups of 64 x 2^k): the tensor cores. One activation row: 4- and 8-bit codes
//     of matrices up to kTcInWarpMax tiles x groups go to gemv_tc4_one_kernel (fragments built in the
//     block, K split over a thread-block cluster: one launch), the largest (the LM head) to the
//     streamed GEMV (gemv_stream.cu: weights brought into shared memory by tensor-map copies), the
//     others (in_proj, the attention projections) to a fragment kernel plus gemv_tc4_kernel; 2-8 rows
//     of tall 4-bit matrices to gemv_tc4_kernel. CK_GEMV=v3 turns v4 off, CK_GEMV_INWARP=0 the
//     one-row kernel, CK_GEMV_STREAM=0 the streamed one.
//  v2 (4- and 8-bit codes, the real checkpoint's forms): each warp owns a group of RPW output rows and
//     sweeps their codes in units of CPU codes per lane (16-byte loads for one activation row); a unit
//     of x is loaded once and applied to the RPW rows; warps reduce with shuffles only; a grid-stride
//     loop keeps every resident warp busy; wide, short matrices split K over up to 8 warps of a block
//     (added in a fixed order through shared memory) and, when still too few blocks, over up to 8
//     blocks (partial sums added in index order by a second kernel). Deterministic: no atomics. Its
//     inner loop (qtile, "v3 arithmetic") sums raw codes times x per unit and applies scale and bias
//     once per unit; the older arithmetic (qtile_v2, each code dequantized first) stays selectable
//     with CK_GEMV=v2.
//  v1 (every format): one block per M output rows, threads striding over units, a block reduction.
//     Kept for the other formats, and selectable (set_gemv_version(1), CK_GEMV=v1) as the reference.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "cuda/bulk_copy.cuh"
#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gdn_conv.cuh"
#include "cuda/gemv_stream.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

#include <cooperative_groups.h>

namespace ck::cuda {
namespace {
namespace cg = cooperative_groups;

// Which inner loop a matrix takes. Vector float paths need cols % unit == 0 and an aligned x.
enum Path : int32_t { kQ2, kQ3, kQ4, kQ8, kF32v, kBF16v, kF16v, kF32s, kBF16s, kF16s };

CK_HD inline int32_t gemv_path(const DMatrix& w, bool x_aligned) {
  switch (static_cast<WKind>(w.fmt.kind)) {
    case WKind::Q:
      return w.fmt.bits == 2 ? kQ2 : w.fmt.bits == 3 ? kQ3 : w.fmt.bits == 4 ? kQ4 : kQ8;
    case WKind::F32:
      return (x_aligned && w.cols % 4 == 0) ? kF32v : kF32s;
    case WKind::BF16:
      return (x_aligned && w.cols % 8 == 0) ? kBF16v : kBF16s;
    default:
      return (x_aligned && w.cols % 8 == 0) ? kF16v : kF16s;
  }
}

CK_HD inline int path_unit(int32_t p) {
  switch (p) {
    case kQ2: return 16;
    case kQ3: return 32;
    case kQ4: return 8;
    case kQ8: return 4;
    case kF32v: return 4;
    case kBF16v: case kF16v: return 8;
    default: return 1;
  }
}

// An unsigned code below 2^23 as a float, without the slow integer-to-float conversion: the code is
// placed in the mantissa of 2^23 and 2^23 subtracted (exact).
__device__ __forceinline__ float code_to_float(uint32_t c) { return __uint_as_float(0x4B000000u | c) - 8388608.0f; }

template <int R>
__device__ __forceinline__ const float* x_row(const float* x, int ldx, int nx, int r) {
  return x + static_cast<size_t>(r < nx ? r : nx - 1) * ldx;  // padding rows repeat the last real row
}

// Applies `kUnit` dequantized weights wv to R activation rows at column c0.
template <int R, int kUnit>
__device__ __forceinline__ void apply_unit_vec(const float (&wv)[kUnit], const float* __restrict__ x, int ldx, int nx,
                                               size_t c0, float (&acc)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float* xr = x_row<R>(x, ldx, nx, r) + c0;
#pragma unroll
    for (int i = 0; i < kUnit; i += 4) {
      const float4 xv = __ldg(reinterpret_cast<const float4*>(xr + i));
      acc[r] = fmaf(wv[i + 0], xv.x, acc[r]);
      acc[r] = fmaf(wv[i + 1], xv.y, acc[r]);
      acc[r] = fmaf(wv[i + 2], xv.z, acc[r]);
      acc[r] = fmaf(wv[i + 3], xv.w, acc[r]);
    }
  }
}

// MLX affine codes: w = scale * q + bias per group (shared/spec/mlx_affine.md). A unit is a whole
// number of u32 words: 8 codes at 4 bits, 4 at 8, 16 at 2, 32 (3 words) at 3 bits. Preconditions:
// cols % 32 == 0 (so rows start 4-byte aligned and a unit never straddles a group).
template <int BITS>
struct DotQ {
  static constexpr int kUnit = (BITS == 3) ? 32 : 32 / BITS;
  static constexpr int kWords = kUnit * BITS / 32;
  template <int R>
  __device__ __forceinline__ static void run(const DMatrix& w, int row, int u, const float* __restrict__ x, int ldx,
                                             int nx, float (&acc)[R]) {
    const size_t row_bytes = static_cast<size_t>(w.cols) * BITS / 8;
    const uint32_t* wp = reinterpret_cast<const uint32_t*>(w.data + row * row_bytes) + static_cast<size_t>(u) * kWords;
    uint32_t words[kWords];
#pragma unroll
    for (int i = 0; i < kWords; ++i) words[i] = __ldg(wp + i);
    const int group = w.fmt.group;
    const size_t si = static_cast<size_t>(row) * (w.cols / group) + (u * kUnit) / group;
    const float s = load_scale_elem(w.scales, si, w.fmt.scale_kind);
    const float b = load_scale_elem(w.biases, si, w.fmt.scale_kind);
    float wv[kUnit];
#pragma unroll
    for (int i = 0; i < kUnit; ++i) {
      const int bit = i * BITS, wi = bit >> 5, sh = bit & 31;
      uint32_t c = words[wi] >> sh;
      if (sh + BITS > 32) c |= words[wi + 1] << (32 - sh);
      c &= (1u << BITS) - 1u;
      wv[i] = fmaf(code_to_float(c), s, b);
    }
    apply_unit_vec<R, kUnit>(wv, x, ldx, nx, static_cast<size_t>(u) * kUnit, acc);
  }
};

// Float weights, 16 bytes per unit. Preconditions: cols % kUnit == 0, x 16-byte aligned, ldx % 4 == 0.
template <WKind K>
struct DotFV {
  static constexpr int kUnit = K == WKind::F32 ? 4 : 8;
  template <int R>
  __device__ __forceinline__ static void run(const DMatrix& w, int row, int u, const float* __restrict__ x, int ldx,
                                             int nx, float (&acc)[R]) {
    const size_t e0 = static_cast<size_t>(row) * w.cols + static_cast<size_t>(u) * kUnit;
    float wv[kUnit];
    if constexpr (K == WKind::F32) {
      const float4 v = __ldg(reinterpret_cast<const float4*>(w.data) + e0 / 4);
      wv[0] = v.x; wv[1] = v.y; wv[2] = v.z; wv[3] = v.w;
    } else {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(w.data + e0 * 2));
      const uint32_t p[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if constexpr (K == WKind::BF16) {
          wv[2 * i] = __uint_as_float(p[i] << 16);
          wv[2 * i + 1] = __uint_as_float(p[i] & 0xffff0000u);
        } else {
          wv[2 * i] = f16_bits_to_float(static_cast<uint16_t>(p[i] & 0xffffu));
          wv[2 * i + 1] = f16_bits_to_float(static_cast<uint16_t>(p[i] >> 16));
        }
      }
    }
    apply_unit_vec<R, kUnit>(wv, x, ldx, nx, static_cast<size_t>(u) * kUnit, acc);
  }
};

// Float weights one element at a time: any cols, any x alignment (the tiny fixture shapes).
template <WKind K>
struct DotFS {
  static constexpr int kUnit = 1;
  template <int R>
  __device__ __forceinline__ static void run(const DMatrix& w, int row, int u, const float* __restrict__ x, int ldx,
                                             int nx, float (&acc)[R]) {
    const size_t e = static_cast<size_t>(row) * w.cols + u;
    float wv;
    if constexpr (K == WKind::F32) wv = __ldg(reinterpret_cast<const float*>(w.data) + e);
    else if constexpr (K == WKind::BF16) wv = bf16_bits_to_float(__ldg(reinterpret_cast<const uint16_t*>(w.data) + e));
    else wv = f16_bits_to_float(__ldg(reinterpret_cast<const uint16_t*>(w.data) + e));
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = fmaf(wv, __ldg(x_row<R>(x, ldx, nx, r) + u), acc[r]);
  }
};

// This thread's share of rows [row0, row0+M) of w against R rows of x.
template <class D, int R, int M>
__device__ __forceinline__ void gemv_tile(const DMatrix& w, int row0, const float* __restrict__ x, int ldx, int nx,
                                          float (&acc)[M][R]) {
  const int n_units = w.cols / D::kUnit;
#pragma unroll 2
  for (int u = threadIdx.x; u < n_units; u += blockDim.x) {
#pragma unroll
    for (int m = 0; m < M; ++m)
      if (row0 + m < w.rows) D::template run<R>(w, row0 + m, u, x, ldx, nx, acc[m]);
  }
}

template <int R, int M>
__device__ __forceinline__ void tile_dispatch(int32_t path, const DMatrix& w, int row0, const float* __restrict__ x,
                                              int ldx, int nx, float (&acc)[M][R]) {
  switch (path) {
    case kQ2: gemv_tile<DotQ<2>, R, M>(w, row0, x, ldx, nx, acc); break;
    case kQ3: gemv_tile<DotQ<3>, R, M>(w, row0, x, ldx, nx, acc); break;
    case kQ4: gemv_tile<DotQ<4>, R, M>(w, row0, x, ldx, nx, acc); break;
    case kQ8: gemv_tile<DotQ<8>, R, M>(w, row0, x, ldx, nx, acc); break;
    case kF32v: gemv_tile<DotFV<WKind::F32>, R, M>(w, row0, x, ldx, nx, acc); break;
    case kBF16v: gemv_tile<DotFV<WKind::BF16>, R, M>(w, row0, x, ldx, nx, acc); break;
    case kF16v: gemv_tile<DotFV<WKind::F16>, R, M>(w, row0, x, ldx, nx, acc); break;
    case kF32s: gemv_tile<DotFS<WKind::F32>, R, M>(w, row0, x, ldx, nx, acc); break;
    case kBF16s: gemv_tile<DotFS<WKind::BF16>, R, M>(w, row0, x, ldx, nx, acc); break;
    default: gemv_tile<DotFS<WKind::F16>, R, M>(w, row0, x, ldx, nx, acc); break;
  }
}

// Sums N per-thread values over the block into red[0..N) (fixed order: warps in index order).
// Precondition: blockDim.x a multiple of 32, at most 256; red holds 8*N floats. All threads call it.
template <int N>
__device__ __forceinline__ void block_reduce_n(float (&v)[N], float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = warp_sum(v[i]);
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) red[warp * N + i] = v[i];
  }
  __syncthreads();
  if (threadIdx.x < N) {
    float t = 0.0f;
    for (int w = 0; w < n_warps; ++w) t += red[w * N + threadIdx.x];
    red[8 * N + threadIdx.x] = t;  // the totals live after the per-warp partials
  }
  __syncthreads();
}

struct GemvLaunch {
  GemvJob job[kMaxGemvJobs];
  int32_t path[kMaxGemvJobs];
  int32_t first_block[kMaxGemvJobs + 1];  // job j owns blocks [first_block[j], first_block[j+1])
  int32_t n_jobs;
};

template <int R, int M>
__global__ void __launch_bounds__(256) gemv_kernel(const __grid_constant__ GemvLaunch L, const float* __restrict__ x,
                                                   int ldx, int nx) {
  pdl_begin();
  __shared__ float red[9 * M * R];
  int j = 0;
  while (j + 1 < L.n_jobs && static_cast<int>(blockIdx.x) >= L.first_block[j + 1]) ++j;
  const DMatrix& w = L.job[j].w;
  const int row0 = (static_cast<int>(blockIdx.x) - L.first_block[j]) * M;
  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
  tile_dispatch<R, M>(L.path[j], w, row0, x, ldx, nx, acc);
  float flat[M * R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) flat[m * R + r] = acc[m][r];
  block_reduce_n<M * R>(flat, red);
  if (threadIdx.x < M * R) {
    const int m = threadIdx.x / R, r = threadIdx.x % R;
    if (r < nx && row0 + m < w.rows) {
      const GemvJob& jb = L.job[j];
      jb.y[static_cast<size_t>(r) * jb.ldy + row0 + m] = apply_epilogue(red[8 * M * R + threadIdx.x], jb.epi, jb.epi_arg);
    }
  }
}

// Expert products: blockIdx.y is the pair, blockIdx.x the tile of M output rows. The views come from
// device memory (built by the router from the expert table), so formats are read per block.
// Preconditions: x and h rows 16-byte aligned (ld % 4 == 0); blockDim.x a multiple of 32, <= 256.
template <int M>
__global__ void __launch_bounds__(256) expert_gate_up_kernel(const ExpertPair* __restrict__ pairs,
                                                             const float* __restrict__ x, int ldx, float* __restrict__ h,
                                                             int ldh) {
  pdl_begin();
  __shared__ float red[9 * 2 * M];
  const ExpertPair& p = pairs[blockIdx.y];
  const DMatrix gate = p.gate, up = p.up;
  const int row0 = static_cast<int>(blockIdx.x) * M;
  if (row0 >= gate.rows) return;  // uniform over the block
  const float* xr = x + static_cast<size_t>(p.x_row) * ldx;
  float ag[M][1], au[M][1];
#pragma unroll
  for (int m = 0; m < M; ++m) ag[m][0] = au[m][0] = 0.0f;
  tile_dispatch<1, M>(gemv_path(gate, true), gate, row0, xr, ldx, 1, ag);
  tile_dispatch<1, M>(gemv_path(up, true), up, row0, xr, ldx, 1, au);
  float flat[2 * M];
#pragma unroll
  for (int m = 0; m < M; ++m) { flat[m] = ag[m][0]; flat[M + m] = au[m][0]; }
  block_reduce_n<2 * M>(flat, red);
  if (threadIdx.x < M && row0 + static_cast<int>(threadIdx.x) < gate.rows) {
    const float g = red[16 * M + threadIdx.x], u = red[17 * M + threadIdx.x];  // totals: 8*N onwards, N = 2M
    h[static_cast<size_t>(blockIdx.y) * ldh + row0 + threadIdx.x] = siluf_(g) * u;
  }
}

template <int M>
__global__ void __launch_bounds__(256) expert_down_kernel(const ExpertPair* __restrict__ pairs,
                                                          const float* __restrict__ h, int ldh, float* __restrict__ y,
                                                          int ldy) {
  pdl_begin();
  __shared__ float red[9 * M];
  const DMatrix down = pairs[blockIdx.y].down;
  const int row0 = static_cast<int>(blockIdx.x) * M;
  if (row0 >= down.rows) return;
  const float* hr = h + static_cast<size_t>(blockIdx.y) * ldh;
  float acc[M][1];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m][0] = 0.0f;
  tile_dispatch<1, M>(gemv_path(down, true), down, row0, hr, ldh, 1, acc);
  float flat[M];
#pragma unroll
  for (int m = 0; m < M; ++m) flat[m] = acc[m][0];
  block_reduce_n<M>(flat, red);
  if (threadIdx.x < M && row0 + static_cast<int>(threadIdx.x) < down.rows)
    y[static_cast<size_t>(blockIdx.y) * ldy + row0 + threadIdx.x] = red[8 * M + threadIdx.x];
}


// ------------------------------------------------------------------ v2: 4/8-bit codes, warp per rows

// One unit: CPU codes of BITS bits = CPU*BITS/32 u32 words, loaded with the widest aligned access.
// Preconditions: cols % 32 == 0 (rows start 16-byte aligned at 4 bits, 32 at 8), group % CPU == 0.
template <int BITS, int CPU>
__device__ __forceinline__ void load_unit(const uint8_t* p, uint32_t (&w)[CPU * BITS / 32]) {
  constexpr int kW = CPU * BITS / 32;
  if constexpr (kW % 4 == 0) {
#pragma unroll
    for (int i = 0; i < kW / 4; ++i) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = v.x; w[4 * i + 1] = v.y; w[4 * i + 2] = v.z; w[4 * i + 3] = v.w;
    }
  } else if constexpr (kW == 2) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x; w[1] = v.y;
  } else {
    w[0] = __ldg(reinterpret_cast<const uint32_t*>(p));
  }
}

// A byte of `v` (k = 0..3, below 256) as a float: PRMT places it in the mantissa of 2^23 (one integer
// instruction), and 2^23 is subtracted (exact).
__device__ __forceinline__ float byte_to_float(uint32_t v, int k) {
  return __uint_as_float(__byte_perm(v, 0x4B000000u, 0x7540u + k)) - 8388608.0f;
}

// v3 arithmetic (the default): per unit of CPU codes (never straddling a group), Σ q·x is accumulated
// from the raw codes and scale and bias are applied once: Σ (s q + b) x = s Σ q x + b Σ x. Codes are
// turned into floats two nibbles per byte: one LOP3 masks 4 low (or, after a shift, 4 high) nibbles,
// then one PRMT + FADD per code. Per code and activation row that is ~2.4 + R instructions instead of
// ~5 + R. Same loads and schedule as the v2 arithmetic (qtile_v2, kept for CK_GEMV=v2).
template <int BITS, int CPU, int R, int RPW>
__device__ __forceinline__ void qtile(const DMatrix& w, int row0, const float* __restrict__ x, int ldx, int nx, int u0,
                                      int u1, int lane, float (&acc)[RPW][R]) {
  constexpr int kW = CPU * BITS / 32;
  const size_t row_bytes = static_cast<size_t>(w.cols) * BITS / 8;
  const int n_groups = w.cols / w.fmt.group, upg = w.fmt.group / CPU;
  const uint8_t sk = w.fmt.scale_kind;
  const uint8_t* rp[RPW];
  size_t srow[RPW];
#pragma unroll
  for (int m = 0; m < RPW; ++m) {
    const int rc = min(row0 + m, w.rows - 1);
    rp[m] = w.data + rc * row_bytes;
    srow[m] = static_cast<size_t>(rc) * n_groups;
  }
  for (int u = u0 + lane; u < u1; u += 32) {
    const int g = u / upg;
    uint32_t wd[RPW][kW];
    float s[RPW], b[RPW];
#pragma unroll
    for (int m = 0; m < RPW; ++m) {
      load_unit<BITS, CPU>(rp[m] + static_cast<size_t>(u) * kW * 4, wd[m]);
      s[m] = load_scale_elem(w.scales, srow[m] + g, sk);
      b[m] = load_scale_elem(w.biases, srow[m] + g, sk);
    }
    // Word by word: the x values of one word's codes are loaded, summed and applied to the RPW rows,
    // so only 4-8 x values per activation row are live at a time.
    float sq[RPW][R], sx[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      sx[r] = 0.0f;
#pragma unroll
      for (int m = 0; m < RPW; ++m) sq[m][r] = 0.0f;
    }
#pragma unroll
    for (int wi = 0; wi < kW; ++wi) {
      constexpr int kC = 32 / BITS;  // codes per word
      float xv[R][kC];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float* xr = x + static_cast<size_t>(r < nx ? r : nx - 1) * ldx + static_cast<size_t>(u) * CPU + wi * kC;
#pragma unroll
        for (int i = 0; i < kC; i += 4) {
          const float4 t = __ldg(reinterpret_cast<const float4*>(xr + i));
          xv[r][i] = t.x; xv[r][i + 1] = t.y; xv[r][i + 2] = t.z; xv[r][i + 3] = t.w;
        }
#pragma unroll
        for (int i = 0; i < kC; ++i) sx[r] += xv[r][i];
      }
#pragma unroll
      for (int m = 0; m < RPW; ++m) {
        if constexpr (BITS == 4) {
          const uint32_t lo = wd[m][wi] & 0x0F0F0F0Fu, hi = (wd[m][wi] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float q0 = byte_to_float(lo, k), q1 = byte_to_float(hi, k);
#pragma unroll
            for (int r = 0; r < R; ++r) {
              sq[m][r] = fmaf(q0, xv[r][2 * k], sq[m][r]);
              sq[m][r] = fmaf(q1, xv[r][2 * k + 1], sq[m][r]);
            }
          }
        } else {
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            const float q = byte_to_float(wd[m][wi], k);
#pragma unroll
            for (int r = 0; r < R; ++r) sq[m][r] = fmaf(q, xv[r][k], sq[m][r]);
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < RPW; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[m][r] = fmaf(s[m], sq[m][r], fmaf(b[m], sx[r], acc[m][r]));
  }
}

// The v2 arithmetic (CK_GEMV=v2): every code dequantized to s·q + b before its FMA.
// acc[m][r] += Σ_{c in units [u0, u1) of this lane} w[row0+m][c] · x_r[c]. Rows past the matrix are
// clamped to its last row (their sums are never stored), so every load is unconditional and the RPW
// loads of a unit can all be in flight together.
template <int BITS, int CPU, int R, int RPW>
__device__ __forceinline__ void qtile_v2(const DMatrix& w, int row0, const float* __restrict__ x, int ldx, int nx, int u0,
                                      int u1, int lane, float (&acc)[RPW][R]) {
  constexpr int kW = CPU * BITS / 32;
  const size_t row_bytes = static_cast<size_t>(w.cols) * BITS / 8;
  const int n_groups = w.cols / w.fmt.group, upg = w.fmt.group / CPU;
  const uint8_t sk = w.fmt.scale_kind;
  int rows_c[RPW];
#pragma unroll
  for (int m = 0; m < RPW; ++m) rows_c[m] = min(row0 + m, w.rows - 1);
  for (int u = u0 + lane; u < u1; u += 32) {
    float xv[R][CPU];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float* xr = x + static_cast<size_t>(r < nx ? r : nx - 1) * ldx + static_cast<size_t>(u) * CPU;
#pragma unroll
      for (int i = 0; i < CPU; i += 4) {
        const float4 t = __ldg(reinterpret_cast<const float4*>(xr + i));
        xv[r][i] = t.x; xv[r][i + 1] = t.y; xv[r][i + 2] = t.z; xv[r][i + 3] = t.w;
      }
    }
    const int g = u / upg;
    uint32_t wd[RPW][kW];
    float s[RPW], b[RPW];
#pragma unroll
    for (int m = 0; m < RPW; ++m) {
      load_unit<BITS, CPU>(w.data + rows_c[m] * row_bytes + static_cast<size_t>(u) * kW * 4, wd[m]);
      const size_t si = static_cast<size_t>(rows_c[m]) * n_groups + g;
      s[m] = load_scale_elem(w.scales, si, sk);
      b[m] = load_scale_elem(w.biases, si, sk);
    }
#pragma unroll
    for (int m = 0; m < RPW; ++m) {
#pragma unroll
      for (int i = 0; i < CPU; ++i) {
        const uint32_t c = (wd[m][(i * BITS) >> 5] >> ((i * BITS) & 31)) & ((1u << BITS) - 1u);
        const float wv = fmaf(code_to_float(c), s[m], b[m]);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[m][r] = fmaf(wv, xv[r][i], acc[m][r]);
      }
    }
  }
}

template <bool V3, int BITS, int CPU, int R, int RPW>
__device__ __forceinline__ void qtile_sel(const DMatrix& w, int row0, const float* __restrict__ x, int ldx, int nx,
                                          int u0, int u1, int lane, float (&acc)[RPW][R]) {
  if constexpr (V3) qtile<BITS, CPU, R, RPW>(w, row0, x, ldx, nx, u0, u1, lane, acc);
  else qtile_v2<BITS, CPU, R, RPW>(w, row0, x, ldx, nx, u0, u1, lane, acc);
}

constexpr int kRpw = 4;  // output rows per warp

struct QLaunch {
  GemvJob job[kMaxGemvJobs];
  int32_t bits[kMaxGemvJobs];
  int32_t first_batch[kMaxGemvJobs + 1];  // job j owns batches [first_batch[j], first_batch[j+1])
  int32_t part_off[kMaxGemvJobs];         // split-K: job j's rows start here in a partial-sum slice
  int32_t n_jobs;
  int32_t ks;                             // warps of a block that split one row group's columns (1-8)
  int32_t kb;                             // blocks that split them (1: no split-K across blocks)
  int32_t part_rows;                      // split-K: rows of all jobs (Σ w.rows); a slice is part_rows*R
  float* partial;                         // split-K: kb slices of raw sums; gemv_q_reduce_kernel finishes
};

// block 256 (8 warps): a batch is 8/ks row groups of one job and one of kb slices of K; warp w takes
// row group w/ks and the (w%ks)-th part of that slice. Grid-stride over batches (the loop is uniform
// over the block, so its barriers are safe). With kb > 1 the raw sums go to L.partial and
// gemv_q_reduce_kernel adds the slices in index order (deterministic) and applies the epilogue.
// v3: at most 80 registers (3 blocks, 24 warps per SM) for 1 activation row and for 2 rows over short
// units, 128 (2 blocks) for 2 rows over 16-code units and 4 rows; 8 rows unbounded (a cap spills).
template <int CPU, int R, bool V3>
__global__ void __launch_bounds__(256, !V3 ? 1 : (R == 1 || (R == 2 && CPU == 8)) ? 3 : R <= 4 ? 2 : 1) gemv_q_kernel(const __grid_constant__ QLaunch L, const float* __restrict__ x,
                                                     int ldx, int nx) {
  pdl_begin();
  __shared__ float red[8][kRpw * R];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ks = L.ks, gpb = 8 / ks, my_ks = warp % ks, my_g = warp / ks;
  const int n_batches = L.first_batch[L.n_jobs];
  for (int batch = blockIdx.x; batch < n_batches; batch += gridDim.x) {
    int j = 0;
    while (j + 1 < L.n_jobs && batch >= L.first_batch[j + 1]) ++j;
    const DMatrix& w = L.job[j].w;
    const int local = batch - L.first_batch[j], kslice = local % L.kb;
    const int row0 = ((local / L.kb) * gpb + my_g) * kRpw;
    const int U = w.cols / CPU, n_parts = ks * L.kb, per = (U + n_parts - 1) / n_parts;
    const int u0 = min(U, (kslice * ks + my_ks) * per), u1 = min(U, u0 + per);
    float acc[kRpw][R];
#pragma unroll
    for (int m = 0; m < kRpw; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
    if (row0 < w.rows) {
      if (L.bits[j] == 4) qtile_sel<V3, 4, CPU, R, kRpw>(w, row0, x, ldx, nx, u0, u1, lane, acc);
      else qtile_sel<V3, 8, CPU, R, kRpw>(w, row0, x, ldx, nx, u0, u1, lane, acc);
    }
#pragma unroll
    for (int m = 0; m < kRpw; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[m][r] = warp_sum(acc[m][r]);
    if (ks > 1) {
      if (lane == 0) {
#pragma unroll
        for (int m = 0; m < kRpw; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r) red[warp][m * R + r] = acc[m][r];
      }
      __syncthreads();
      if (my_ks == 0) {
#pragma unroll
        for (int m = 0; m < kRpw; ++m)
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float t = 0.0f;
            for (int k = 0; k < ks; ++k) t += red[warp + k][m * R + r];
            acc[m][r] = t;
          }
      }
      __syncthreads();
    }
    if (my_ks == 0 && row0 < w.rows) {
      const GemvJob& jb = L.job[j];
      float* part = L.partial ? L.partial + static_cast<size_t>(kslice) * L.part_rows * R + L.part_off[j] : nullptr;
#pragma unroll
      for (int m = 0; m < kRpw; ++m)
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (lane == m * R + r && row0 + m < w.rows && r < nx) {
            if (part) part[static_cast<size_t>(r) * L.part_rows + row0 + m] = acc[m][r];
            else jb.y[static_cast<size_t>(r) * jb.ldy + row0 + m] = apply_epilogue(acc[m][r], jb.epi, jb.epi_arg);
          }
    }
  }
}

// Split-K finish: y = epi(Σ_{z < kb} partial_z) per (job, activation row, output row), the slices
// added in index order. grid-stride over rows * part_rows elements.
__global__ void gemv_q_reduce_kernel(const __grid_constant__ QLaunch L, int rows, int R) {
  pdl_begin();
  const int total = rows * L.part_rows;
  for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < total; t += gridDim.x * blockDim.x) {
    const int r = t / L.part_rows, i = t % L.part_rows;
    int j = 0;
    while (j + 1 < L.n_jobs && i >= L.part_off[j + 1]) ++j;
    float v = 0.0f;
    for (int z = 0; z < L.kb; ++z) v += L.partial[(static_cast<size_t>(z) * R + r) * L.part_rows + i];
    const GemvJob& jb = L.job[j];
    jb.y[static_cast<size_t>(r) * jb.ldy + (i - L.part_off[j])] = apply_epilogue(v, jb.epi, jb.epi_arg);
  }
}

// Experts, v2: a warp per (pair, group of kRpw rows), grid-stride, no block barriers.
// Preconditions: every pair's matrices are 4- or 8-bit codes (cols % 32 == 0); x/h rows 16-byte aligned.
template <bool V3>
__global__ void __launch_bounds__(256, V3 ? 2 : 1) expert_gate_up_q_kernel(const ExpertPair* __restrict__ pairs, int n_pairs,
                                                               int n_rg, const float* __restrict__ x, int ldx,
                                                               float* __restrict__ h, int ldh) {
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int total = n_pairs * n_rg;
  for (int wu = blockIdx.x * 8 + warp; wu < total; wu += gridDim.x * 8) {
    const int p = wu / n_rg, row0 = (wu % n_rg) * kRpw;
    const DMatrix gate = pairs[p].gate, up = pairs[p].up;
    if (row0 >= gate.rows) continue;  // warp-uniform
    const float* xr = x + static_cast<size_t>(pairs[p].x_row) * ldx;
    float ag[kRpw][1], au[kRpw][1];
#pragma unroll
    for (int m = 0; m < kRpw; ++m) ag[m][0] = au[m][0] = 0.0f;
    const int U = gate.cols / 32;
    if (gate.fmt.bits == 4) {
      qtile_sel<V3, 4, 32, 1, kRpw>(gate, row0, xr, ldx, 1, 0, U, lane, ag);
      qtile_sel<V3, 4, 32, 1, kRpw>(up, row0, xr, ldx, 1, 0, U, lane, au);
    } else {
      qtile_sel<V3, 8, 32, 1, kRpw>(gate, row0, xr, ldx, 1, 0, U, lane, ag);
      qtile_sel<V3, 8, 32, 1, kRpw>(up, row0, xr, ldx, 1, 0, U, lane, au);
    }
#pragma unroll
    for (int m = 0; m < kRpw; ++m) {
      const float g = warp_sum(ag[m][0]), u = warp_sum(au[m][0]);
      if (lane == m && row0 + m < gate.rows) h[static_cast<size_t>(p) * ldh + row0 + m] = siluf_(g) * u;
    }
  }
}

template <bool V3>
__global__ void __launch_bounds__(256, V3 ? 3 : 1) expert_down_q_kernel(const ExpertPair* __restrict__ pairs, int n_pairs, int n_rg,
                                                            const float* __restrict__ h, int ldh, float* __restrict__ y,
                                                            int ldy) {
  pdl_begin();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int total = n_pairs * n_rg;
  for (int wu = blockIdx.x * 8 + warp; wu < total; wu += gridDim.x * 8) {
    const int p = wu / n_rg, row0 = (wu % n_rg) * kRpw;
    const DMatrix down = pairs[p].down;
    if (row0 >= down.rows) continue;
    const float* hr = h + static_cast<size_t>(p) * ldh;
    float acc[kRpw][1];
#pragma unroll
    for (int m = 0; m < kRpw; ++m) acc[m][0] = 0.0f;
    const int U = down.cols / 8;
    if (down.fmt.bits == 4) qtile_sel<V3, 4, 8, 1, kRpw>(down, row0, hr, ldh, 1, 0, U, lane, acc);
    else qtile_sel<V3, 8, 8, 1, kRpw>(down, row0, hr, ldh, 1, 0, U, lane, acc);
#pragma unroll
    for (int m = 0; m < kRpw; ++m) {
      const float v = warp_sum(acc[m][0]);
      if (lane == m && row0 + m < down.rows) y[static_cast<size_t>(p) * ldy + row0 + m] = v;
    }
  }
}


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
constexpr int kTcBlockGroups = 40;    // groups of x a block holds as fragments (1,028 bytes each)

// Rows g and g + 8 of a one-row tile (tc4_one_mma's acc: columns 0-2 on lanes t = 0 and 1), summed
// (hi + mid) + lo, into y[row0 + g] and y[row0 + g + 8] below `rows`.
__device__ __forceinline__ void one_row_tile_store(const float (&acc)[4], float* y, int row0, int rows) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float lo_g = __shfl_down_sync(0xffffffffu, acc[0], 1), lo_g8 = __shfl_down_sync(0xffffffffu, acc[2], 1);
  if (t == 0) {
    if (row0 + g < rows) y[row0 + g] = (acc[0] + acc[1]) + lo_g;
    if (row0 + g + 8 < rows) y[row0 + g + 8] = (acc[2] + acc[3]) + lo_g8;
  }
}

// Dynamic shared memory: [range groups][4 steps][32 lanes] uint2 fragments, then [range groups] Σ x.
template <bool BF16S, int BITS>
__global__ void __launch_bounds__(256, 3) gemv_tc4_one_kernel(const __grid_constant__ TcLaunch L,
                                                              const float* __restrict__ x, int kb) {
  extern __shared__ uint2 sfrag[];
  __shared__ float red[8][16][3];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int ks = L.ks, tile = blockIdx.y * (8 / ks) + warp / ks, part = warp % ks;
  const int n_tiles = L.first_tile[L.n_jobs];
  int j = 0;
  while (j + 1 < L.n_jobs && tile >= L.first_tile[j + 1]) ++j;
  const DMatrix& w = L.job[j].w;
  const int row0 = (tile - L.first_tile[j]) * 16;
  // The block's K range (cluster rank blockIdx.x of kb), then this warp's part of it.
  const int per_b = (L.groups + kb - 1) / kb, B0 = min(L.groups, static_cast<int>(blockIdx.x) * per_b),
            B1 = min(L.groups, B0 + per_b);
  const int per = (B1 - B0 + ks - 1) / ks, G0 = min(B1, B0 + part * per), G1 = min(B1, G0 + per);
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

// The decode experts' partial tiles in shared memory (one activation row): part k's rows g and g + 8,
// columns 0-2 (hi, mid, lo), which lanes t = 0 (columns 0, 1) and t = 1 (column 2) hold in acc.
__device__ __forceinline__ void one_row_stash(float (&r)[16][4], const float (&acc)[4], int g, int t) {
  if (t < 2) {
    r[g][2 * t] = acc[0];
    r[g + 8][2 * t] = acc[2];
    if (t == 0) {
      r[g][1] = acc[1];
      r[g + 8][1] = acc[3];
    }
  }
}

// Row `row` of matrix m's tile from parts [0, n) of one_row_stash: each column summed over the parts in
// index order, then (hi + mid) + lo.
template <int NM>
__device__ __forceinline__ float one_row_value(const float (*red)[NM][16][4], int n, int m, int row) {
  float c[3];
  for (int q = 0; q < 3; ++q) {
    float sum = 0.0f;
    for (int k = 0; k < n; ++k) sum += red[k][m][row][q];
    c[q] = sum;
  }
  return (c[0] + c[1]) + c[2];
}

// The group loop of expert_tc4_kernel: NM matrices (gate and up, or down) of one pair, rows row0 + g
// and row0 + g + 8, groups [G0, G1), against the vector's fragments fv and group sums gv.
template <int NM, bool BF16S, int UNROLL>
__device__ __forceinline__ void expert_tc4_groups(const DMatrix (&w)[NM], int row0, int G0, int G1,
                                                  const uint2* __restrict__ fv, const float* __restrict__ gv,
                                                  float (&acc)[NM][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  Tc4Rows<BF16S> tr[NM];
#pragma unroll
  for (int m = 0; m < NM; ++m) tr[m].init(w[m], min(row0 + g, w[m].rows - 1), min(row0 + g + 8, w[m].rows - 1), t);
#pragma unroll UNROLL
  for (int G = G0; G < G1; ++G) {
    uint2 b[4];
    const float x0 = tc4_one_frags_group(fv, gv, G, t, b);
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      uint2 wa, wb;
      float sa, ba, sb, bb;
      tr[m].load(G, wa, wb, sa, ba, sb, bb);
      tc4_one_mma_regs(wa, wb, sa, ba, sb, bb, b, x0, acc[m]);
    }
  }
}

// Decode experts on the tensor cores (v4 arithmetic, one activation vector per pair): warp (pair, tile
// of 16 rows, part) runs the gemv_tc4_kernel loop over its part of the pair's groups with the
// fragments of the pair's vector (GATE_UP: row pairs[p].x_row of x, both gate and up; otherwise row p
// of h through down). Each pair's matrices are read from its device-side view (any 4-bit form in
// groups of 64k, bf16/f16/f32 scales), so the kernel follows the expert table like the v3 kernels.
// GATE_UP writes h[p] = silu(gate x) * (up x); otherwise y[p] = down h[p]. grid: tiles / (8 / ks).
template <bool GATE_UP, int UNROLL>
__global__ void __launch_bounds__(256, GATE_UP ? 2 : 3) expert_tc4_kernel(const ExpertPair* __restrict__ pairs, int n_pairs,
                                                            int tiles_per_pair, int ks, const uint2* __restrict__ frag,
                                                            const float* __restrict__ gsum, int vec_groups,
                                                            float* __restrict__ out, int ldo) {
  pdl_begin();
  constexpr int NM = GATE_UP ? 2 : 1;
  __shared__ float red[8][NM][16][4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int part = warp % ks, tile_all = blockIdx.x * (8 / ks) + warp / ks;
  const int p = tile_all / tiles_per_pair, row0 = (tile_all % tiles_per_pair) * 16;
  DMatrix w[NM];
  bool valid = p < n_pairs;
  int vec = 0;
  if (valid) {
    const ExpertPair& pr = pairs[p];
    w[0] = GATE_UP ? pr.gate : pr.down;
    if constexpr (GATE_UP) w[NM - 1] = pr.up;
    vec = GATE_UP ? pr.x_row : p;
    valid = row0 < w[0].rows;
  }
  float acc[NM][4] = {};
  if (valid) {
    const int groups = w[0].cols / 64, per = (groups + ks - 1) / ks;
    const int G0 = min(groups, part * per), G1 = min(groups, G0 + per);
    const uint2* fv = frag + static_cast<size_t>(vec) * vec_groups * kOneFragWords + tc4_one_frag_lane(g, t);
    const float* gv = gsum + static_cast<size_t>(vec) * vec_groups;
    const uint8_t bf = static_cast<uint8_t>(WKind::BF16);
    if (w[0].fmt.scale_kind == bf && w[NM - 1].fmt.scale_kind == bf)
      expert_tc4_groups<NM, true, UNROLL>(w, row0, G0, G1, fv, gv, acc);
    else
      expert_tc4_groups<NM, false, UNROLL>(w, row0, G0, G1, fv, gv, acc);
  }
#pragma unroll
  for (int m = 0; m < NM; ++m) one_row_stash(red[warp][m], acc[m], g, t);
  __syncthreads();
  if (part != 0 || !valid || lane >= 16 || row0 + lane >= w[0].rows) return;
  float v[NM];
#pragma unroll
  for (int m = 0; m < NM; ++m) v[m] = one_row_value<NM>(red + warp, ks, m, lane);
  out[static_cast<size_t>(p) * ldo + row0 + lane] = GATE_UP ? siluf_(v[0]) * v[NM - 1] : v[0];
}

// Decode experts' gate and up products when the experts are in 16-row tiles (Model::tiled_experts):
// block (pair p, tile T) takes tile T of the pair's gate and up matrices, each all of its groups as
// one contiguous run of groups x 576 bytes, into shared memory with one bulk copy per matrix; then its
// 8 warps split the groups (warp w: [w per, (w + 1) per)), read codes and scales from shared memory
// and the vector's compact fragments (Tc4Frags) from global, and add their parts in warp order.
// Why: expert_tc4_kernel's warps load their tile groups one 576-byte group per warp at a time, two
// groups in flight, so a kernel of 20 MB (11 pairs of the full geometry) is a chain of memory round
// trips per warp; here a block asks for its 46 KB at once and every block of the kernel is resident
// (4 per SM), so the whole kernel's bytes are in flight from its start. Decode +3.4% at one row,
// +8.6% at 4 rows (564.4 against 546.1 and 1,052.4 against 968.5 tok/s, 2026-12-01 00:36Z, one call).
// grid (n_pairs * tiles_per_pair), block 256, dynamic shared memory 2 * groups * kTileGroupBytes.
// sh.k1 > 0 (the default; CK_EXPERT_SHARED_EARLY=0: not): the pairs follow the route's layout
// (SharedSlot), so the shared expert's blocks know their matrices and vector at their start and copy
// their tiles before the wait, while the route runs; after it only the routed experts' tiles are on
// the way. Measured (H200 2026-12-02 00:2xZ, three interleaved rounds): one-row decode 627.2 / 629.5
// / 629.3 tok/s against 615.6 / 620.9 / 622.5 (+1.5%), 4 rows 1,245.1 / 1,248.9 / 1,245.7 against
// 1,230.6 / 1,240.1 / 1,245.5 (+0.6%); the model tests passed with it.
__global__ void __launch_bounds__(256, 4) expert_gate_up_bulk_kernel(const ExpertPair* __restrict__ pairs,
                                                                    int tiles_per_pair, const uint2* __restrict__ frag,
                                                                    const float* __restrict__ gsum, int vec_groups,
                                                                    float* __restrict__ out, int ldo,
                                                                    const __grid_constant__ SharedSlot sh) {
  extern __shared__ __align__(128) uint8_t stile[];  // [gate, up][groups][576]
  __shared__ uint64_t bar;
  __shared__ float red[8][2][16][4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int p = blockIdx.x / tiles_per_pair, tile = blockIdx.x % tiles_per_pair, row0 = tile * kTileRows;
  const bool shared = sh.k1 > 0 && p % sh.k1 == sh.k1 - 1;  // block-uniform
  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_init_fence();
  }
  __syncthreads();
  const int groups = vec_groups;
  const uint32_t bytes = static_cast<uint32_t>(groups) * kTileGroupBytes;
  auto ask = [&](const DMatrix& gate, const DMatrix& up) {  // thread 0: the tile of both matrices
    mbar_arrive_expect(&bar, 2 * bytes);
    bulk_copy_1d(stile, gate.tile_group(tile, 0), bytes, &bar);
    bulk_copy_1d(stile + bytes, up.tile_group(tile, 0), bytes, &bar);
  };
  if (shared && threadIdx.x == 0 && row0 < sh.gate.rows) ask(sh.gate, sh.up);  // weights never change
  pdl_begin();  // the pairs (route) and the fragments (the mix) come from the kernels before
  const DMatrix gate = shared ? sh.gate : pairs[p].gate, up = shared ? sh.up : pairs[p].up;
  const int vec = shared ? p / sh.k1 : pairs[p].x_row;
  if (row0 >= gate.rows) return;  // block-uniform: this pair has fewer tiles (the shared expert's size)
  if (!gate.tiled() || !up.tiled() || gate.cols != vec_groups * 64 || up.cols != gate.cols) __trap();  // launch promise
  if (!shared && threadIdx.x == 0) ask(gate, up);
  const int per = (groups + 7) / 8, G0 = min(groups, warp * per), G1 = min(groups, G0 + per);
  const uint2* fv = frag + static_cast<size_t>(vec) * vec_groups * kOneFragWords + tc4_one_frag_lane(g, t);
  const float* gv = gsum + static_cast<size_t>(vec) * vec_groups;
  float acc[2][4] = {};
  mbar_wait(&bar, 0);
#pragma unroll 2
  for (int G = G0; G < G1; ++G) {
    uint2 b[4];
    const float x0 = tc4_one_frags_group(fv, gv, G, t, b);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      uint2 wa, wb;
      float sa, ba, sb, bb;
      tile_group_lds(stile + m * bytes + static_cast<size_t>(G) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
      tc4_one_mma_regs(wa, wb, sa, ba, sb, bb, b, x0, acc[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) one_row_stash(red[warp][m], acc[m], g, t);
  __syncthreads();
  if (warp != 0 || lane >= 16 || row0 + lane >= gate.rows) return;
  const float v0 = one_row_value<2>(red, 8, 0, lane), v1 = one_row_value<2>(red, 8, 1, lane);
  out[static_cast<size_t>(p) * ldo + row0 + lane] = siluf_(v0) * v1;
}

// expert_gate_up_bulk_kernel as a streaming loop: block b takes the contiguous run of tiles
// [b per, (b + 1) per) of all pairs' tiles (tile j: pair j / tiles_per_pair, tile j % tiles_per_pair),
// two at a time in flight through two shared-memory stages: while its warps multiply tile i, tile
// i + 1's copy is landing, and tile i + 2's is asked for as soon as tile i's stage is read. Each
// tile's arithmetic (the warps' split of the groups, the order of their parts) is the bulk kernel's,
// so the outputs are its bits.
// Why: the bulk kernel's 4-row grid is 1,760 blocks of one tile, 4 resident per SM (3.3 waves): a
// block's stage holds nothing in flight while it multiplies, starts, or ends, and its last wave is a
// third full. Nsight Compute (H200 2026-12-02 04:28Z, 4 rows): 31.4 us for 81 MB, 2.56 TB/s (53% of
// DRAM), 16.5 cycles per issued instruction, 44% of them waiting on L1TEX, 44,000 local-memory
// spill requests (64 registers a thread at 4 blocks per SM). Here 2 blocks per SM (128 registers) keep
// 4 tiles per SM asked for at every moment until their runs end.
// grid ceil(tiles / per) (all resident: per = ceil(tiles / resident blocks)), block 256, dynamic
// shared memory 4 * groups * kTileGroupBytes. sh: as in the bulk kernel (the shared expert's tiles
// among a block's first two are asked for before the wait).
constexpr int kStreamWarpGroups = 6;  // the streaming kernel's groups a warp at most (K <= 48 groups)
__global__ void __launch_bounds__(256, 2) expert_gate_up_stream_kernel(const ExpertPair* __restrict__ pairs,
                                                                      int tiles_per_pair, int n_tiles, int per,
                                                                      const uint2* __restrict__ frag,
                                                                      const float* __restrict__ gsum, int vec_groups,
                                                                      float* __restrict__ out, int ldo,
                                                                      const __grid_constant__ SharedSlot sh) {
  extern __shared__ __align__(128) uint8_t stile[];  // [stage][gate, up][groups][576]
  __shared__ uint64_t bar[2];
  __shared__ float red[2][8][2][16][4];
  constexpr int kAsker = 32;  // warp 1's lane 0 asks for the copies (warp 0 writes the outputs)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int first = blockIdx.x * per, n = min(per, n_tiles - first);
  const int groups = vec_groups;
  const uint32_t bytes = static_cast<uint32_t>(groups) * kTileGroupBytes;
  if (threadIdx.x == 0) {
    mbar_init(&bar[0]);
    mbar_init(&bar[1]);
    mbar_init_fence();
  }
  __syncthreads();
  auto is_shared = [&](int i) { const int p = (first + i) / tiles_per_pair; return sh.k1 > 0 && p % sh.k1 == sh.k1 - 1; };
  // Local tile i's matrices and vector (pairs[] only after the wait, unless the pair is the shared one).
  auto tile_of = [&](int i, DMatrix& gate, DMatrix& up, int& vec, int& row0) {
    const int p = (first + i) / tiles_per_pair;
    row0 = ((first + i) % tiles_per_pair) * kTileRows;
    const bool shd = is_shared(i);
    gate = shd ? sh.gate : pairs[p].gate;
    up = shd ? sh.up : pairs[p].up;
    vec = shd ? p / sh.k1 : pairs[p].x_row;
  };
  // Stage i % 2 asks for tile i (a tile past its pair's rows asks for no bytes: its phase completes).
  auto ask = [&](int i) {
    DMatrix gate, up;
    int vec, row0;
    tile_of(i, gate, up, vec, row0);
    uint64_t* b = &bar[i & 1];
    if (row0 >= gate.rows) {
      mbar_arrive_expect(b, 0);
      return;
    }
    uint8_t* st = stile + (i & 1) * 2 * bytes;
    const int tile = row0 / kTileRows;
    mbar_arrive_expect(b, 2 * bytes);
    bulk_copy_1d(st, gate.tile_group(tile, 0), bytes, b);
    bulk_copy_1d(st + bytes, up.tile_group(tile, 0), bytes, b);
  };
  const bool early0 = n > 0 && is_shared(0), early1 = n > 1 && is_shared(1);
  if (threadIdx.x == kAsker) {  // weights never change: the shared expert's tiles before the wait
    if (early0) ask(0);
    if (early1) ask(1);
  }
  pdl_begin();  // the pairs (route) and the fragments (the mix) come from the kernels before
  if (threadIdx.x == kAsker) {
    if (n > 0 && !early0) ask(0);
    if (n > 1 && !early1) ask(1);
  }
  const int per_w = (groups + 7) / 8, G0 = min(groups, warp * per_w), G1 = min(groups, G0 + per_w);
  // The warp's groups' fragments in registers, loaded when the vector changes (a run's tiles are mostly
  // one pair's) and before the wait for the tile, so their L2 round trip overlaps the copy instead of
  // following it group by group.
  uint2 fb[kStreamWarpGroups][4];
  float fx[kStreamWarpGroups];
  int frag_vec = -1;
  for (int i = 0; i < n; ++i) {
    const int s = i & 1;
    DMatrix gate, up;
    int vec, row0;
    tile_of(i, gate, up, vec, row0);
    const bool valid = row0 < gate.rows;  // block-uniform
    if (valid && (!gate.tiled() || !up.tiled() || gate.cols != vec_groups * 64 || up.cols != gate.cols)) __trap();
    if (valid && vec != frag_vec) {
      const uint2* fv = frag + static_cast<size_t>(vec) * vec_groups * kOneFragWords + tc4_one_frag_lane(g, t);
      const float* gv = gsum + static_cast<size_t>(vec) * vec_groups;
#pragma unroll
      for (int j = 0; j < kStreamWarpGroups; ++j)
        if (G0 + j < G1) fx[j] = tc4_one_frags_group(fv, gv, G0 + j, t, fb[j]);
      frag_vec = vec;
    }
    mbar_wait(&bar[s], (i >> 1) & 1);
    if (valid) {
      const uint8_t* st = stile + s * 2 * bytes;
      float acc[2][4] = {};
#pragma unroll
      for (int j = 0; j < kStreamWarpGroups; ++j) {
        if (G0 + j >= G1) break;
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          uint2 wa, wb;
          float sa, ba, sb, bb;
          tile_group_lds(st + m * bytes + static_cast<size_t>(G0 + j) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
          tc4_one_mma_regs(wa, wb, sa, ba, sb, bb, fb[j], fx[j], acc[m]);
        }
      }
#pragma unroll
      for (int m = 0; m < 2; ++m) one_row_stash(red[s][warp][m], acc[m], g, t);
    }
    __syncthreads();  // stage s read, red[s] written
    if (threadIdx.x == kAsker && i + 2 < n) ask(i + 2);
    if (valid && warp == 0 && lane < 16 && row0 + lane < gate.rows) {
      const int p = (first + i) / tiles_per_pair;
      const float v0 = one_row_value<2>(red[s], 8, 0, lane), v1 = one_row_value<2>(red[s], 8, 1, lane);
      out[static_cast<size_t>(p) * ldo + row0 + lane] = siluf_(v0) * v1;
    }
  }
}

// Where expert_down_bulk_kernel's tiles start in its dynamic shared memory (after the fragments and
// group sums, rounded up to 128 bytes), and its whole size.
__host__ __device__ constexpr size_t bulk_down_tiles_offset(int max_groups) {
  return (static_cast<size_t>(max_groups) * (4 * 32 * sizeof(uint2) + sizeof(float)) + 127) / 128 * 128;
}
__host__ __device__ constexpr size_t bulk_down_smem(int max_groups) {
  return bulk_down_tiles_offset(max_groups) + 8 * static_cast<size_t>(max_groups) * kTileGroupBytes;
}

// Decode experts' down products with each pair's h turned into fragments in the block (tc4_one_frag,
// as gemv_tc4_one_kernel does with x): no fragment kernel between gate/up and down (16 launches of
// ~3 us per step in Nsight Compute). Block b takes 8 tiles of 16 output rows of pair b / bpp (bpp =
// ceil(rows / 128) blocks per pair), each warp one tile over all of the pair's groups (K = the pair's
// intermediate size, at most kTcBlockGroups groups), in the one-row v4 arithmetic.
// grid (n_pairs * bpp), block 256, dynamic shared memory max_groups * (4 * 32 uint2 + 1 float).
template <bool BF16S>
__device__ __forceinline__ void expert_down_one_tile(const DMatrix& w, int row0, int groups, const uint2* sfrag,
                                                     const float* sgs, float (&acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  Tc4Rows<BF16S, 4> tr;
  tr.init(w, min(row0 + g, w.rows - 1), min(row0 + g + 8, w.rows - 1), t);
#pragma unroll 2
  for (int G = 0; G < groups; ++G)
    tc4_one_group(tr, G, sfrag + static_cast<size_t>(G) * 4 * 32 + lane, t == 0 ? sgs[G] : 0.0f, acc);
}

__global__ void __launch_bounds__(256, 3) expert_down_one_kernel(const ExpertPair* __restrict__ pairs, int bpp,
                                                                 int max_groups, const float* __restrict__ h, int ldh,
                                                                 float* __restrict__ y, int ldy) {
  extern __shared__ uint2 sfrag[];
  pdl_begin();  // the pairs (route) and h (gate/up) come from the kernels before
  const int warp = threadIdx.x >> 5;
  const int p = blockIdx.x / bpp, row0 = ((blockIdx.x % bpp) * 8 + warp) * 16;
  const DMatrix w = pairs[p].down;
  const int groups = w.cols / 64;
  float* sgs = reinterpret_cast<float*>(sfrag + static_cast<size_t>(max_groups) * 4 * 32);
  one_row_frags_in_block<2>(h + static_cast<size_t>(p) * ldh, 0, groups, sfrag, sgs);
  __syncthreads();
  if (row0 >= w.rows) return;  // warp-uniform; no barrier below
  float acc[4] = {};
  if (w.fmt.scale_kind == static_cast<uint8_t>(WKind::BF16)) expert_down_one_tile<true>(w, row0, groups, sfrag, sgs, acc);
  else expert_down_one_tile<false>(w, row0, groups, sfrag, sgs, acc);
  one_row_tile_store(acc, y + static_cast<size_t>(p) * ldy, row0, w.rows);
}

// expert_down_one_kernel for tiled experts (Model::tiled_experts): the block's 8 tiles of the pair's
// down matrix are one contiguous run (8 x groups x 576 bytes), asked for by one bulk copy before the
// block turns h into fragments, so the copy and the fragments overlap; then each warp takes its tile
// from shared memory in the same order and arithmetic as expert_down_one_tile (the same bits).
// Decode +1.0% at one row, +1.4% at 4 rows against gate/up by bulk copies alone (2026-12-01 ~00:39Z).
// grid (n_pairs * bpp), block 256, dynamic shared memory: the fragments (max_groups * (4 * 32 uint2 +
// 1 float)), then the tiles (8 * max_groups * kTileGroupBytes, at a 128-byte boundary).
// early (CK_EXPERT_DOWN_EARLY=0: not): the block reads its pair and asks for its tiles before its wait,
// while the gate/up kernel still runs. The pairs come from the route, two kernels back (route, [x's
// fragments,] gate/up, down): the route has ended before the gate/up kernel's blocks passed their
// wait, and this kernel starts only after they all have. H200 2026-12-01 10:27Z, same call: one-row
// decode 600.2 / 598.3 / 601.4 tok/s against 589.7 / 580.5 late; 4 rows level.
__global__ void __launch_bounds__(256, 3) expert_down_bulk_kernel(const ExpertPair* __restrict__ pairs, int bpp,
                                                                  int max_groups, const float* __restrict__ h, int ldh,
                                                                  float* __restrict__ y, int ldy, int early) {
  extern __shared__ __align__(128) uint2 sfrag[];
  __shared__ uint64_t bar;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int p = blockIdx.x / bpp, T0 = (blockIdx.x % bpp) * 8, row0 = (T0 + warp) * kTileRows;
  float* sgs = reinterpret_cast<float*>(sfrag + static_cast<size_t>(max_groups) * 4 * 32);
  uint8_t* stile = reinterpret_cast<uint8_t*>(sfrag) + bulk_down_tiles_offset(max_groups);
  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_init_fence();
  }
  __syncthreads();
  if (!early) pdl_begin();  // the pairs (route) and h (gate/up) come from the kernels before
  const DMatrix w = pairs[p].down;
  const int groups = w.cols / 64, n_tiles = min(8, w.rows / kTileRows - T0);
  if (n_tiles <= 0) return;  // block-uniform
  if (!w.tiled() || groups > max_groups) __trap();  // the launch's promise
  const uint32_t bytes = static_cast<uint32_t>(n_tiles) * groups * kTileGroupBytes;
  if (threadIdx.x == 0) {
    mbar_arrive_expect(&bar, bytes);
    bulk_copy_1d(stile, w.tile_group(T0, 0), bytes, &bar);
  }
  if (early) pdl_begin();  // h comes from the kernel before
  one_row_frags_in_block<2>(h + static_cast<size_t>(p) * ldh, 0, groups, sfrag, sgs);
  __syncthreads();
  mbar_wait(&bar, 0);
  if (warp >= n_tiles) return;  // warp-uniform; no barrier below
  float acc[4] = {};
  const uint8_t* tile = stile + static_cast<size_t>(warp) * groups * kTileGroupBytes;
#pragma unroll 2
  for (int G = 0; G < groups; ++G) {
    uint2 wa, wb;
    float sa, ba, sb, bb;
    tile_group_lds(tile + static_cast<size_t>(G) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
    tc4_one_mma(wa, wb, sa, ba, sb, bb, sfrag + static_cast<size_t>(G) * 4 * 32 + lane, t == 0 ? sgs[G] : 0.0f, acc);
  }
  one_row_tile_store(acc, y + static_cast<size_t>(p) * ldy, row0, w.rows);
}

// expert_down_bulk_kernel as a streaming loop, like expert_gate_up_stream_kernel: chunk c is pair
// c / bpp's 8 tiles from tile (c % bpp) * 8; block b takes the run [b per, (b + 1) per) of chunks, two
// in flight through two shared-memory stages, and turns h into fragments once per pair in its run
// (the bulk kernel does it once per chunk: 20 times per pair at H = 2,560). Each tile's arithmetic is
// the bulk kernel's (the same bits). The pairs are read before the wait as the bulk kernel's `early`
// does (expert_down_tc4's contract); h after it.
// Why: Nsight Compute (H200 2026-12-02 04:38Z, 4 rows): the bulk kernel is 16.6 us for 36 MB (1.6 TB/s,
// 33% of DRAM) at 2.56 instructions a cycle, 880 blocks of one chunk, 3 resident per SM.
// grid ceil(chunks / per), block 256, dynamic shared memory bulk_down_stream_smem(max_groups).
__host__ __device__ constexpr size_t bulk_down_stream_smem(int max_groups) {
  return bulk_down_tiles_offset(max_groups) + 2 * 8 * static_cast<size_t>(max_groups) * kTileGroupBytes;
}
constexpr size_t kDownStreamMaxSmem = 110 * 1024;  // two blocks per SM at max_groups 10 (H200: 227 KB)
__global__ void __launch_bounds__(256, 2) expert_down_stream_kernel(const ExpertPair* __restrict__ pairs, int bpp,
                                                                    int n_chunks, int per, int max_groups,
                                                                    const float* __restrict__ h, int ldh,
                                                                    float* __restrict__ y, int ldy) {
  extern __shared__ __align__(128) uint2 sfrag[];
  __shared__ uint64_t bar[2];
  constexpr int kAsker = 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int first = blockIdx.x * per, n = min(per, n_chunks - first);
  float* sgs = reinterpret_cast<float*>(sfrag + static_cast<size_t>(max_groups) * 4 * 32);
  uint8_t* stiles = reinterpret_cast<uint8_t*>(sfrag) + bulk_down_tiles_offset(max_groups);
  const size_t stage_bytes = 8 * static_cast<size_t>(max_groups) * kTileGroupBytes;
  if (threadIdx.x == 0) {
    mbar_init(&bar[0]);
    mbar_init(&bar[1]);
    mbar_init_fence();
  }
  __syncthreads();
  // Stage i % 2 asks for local chunk i's tiles (none past the pair's rows: its phase completes).
  auto ask = [&](int i) {
    const int c = first + i, T0 = (c % bpp) * 8;
    const DMatrix w = pairs[c / bpp].down;
    const int n_tiles = min(8, w.rows / kTileRows - T0);
    uint64_t* b = &bar[i & 1];
    if (n_tiles <= 0) {
      mbar_arrive_expect(b, 0);
      return;
    }
    const uint32_t bytes = static_cast<uint32_t>(n_tiles) * (w.cols / 64) * kTileGroupBytes;
    mbar_arrive_expect(b, bytes);
    bulk_copy_1d(stiles + (i & 1) * stage_bytes, w.tile_group(T0, 0), bytes, b);
  };
  if (threadIdx.x == kAsker) {  // the pairs are two kernels old (expert_down_tc4's contract)
    if (n > 0) ask(0);
    if (n > 1) ask(1);
  }
  pdl_begin();  // h comes from the kernel before
  int frag_pair = -1;
  for (int i = 0; i < n; ++i) {
    const int c = first + i, p = c / bpp, T0 = (c % bpp) * 8, row0 = (T0 + warp) * kTileRows;
    const DMatrix w = pairs[p].down;
    const int groups = w.cols / 64, n_tiles = min(8, w.rows / kTileRows - T0);
    if (n_tiles > 0 && (!w.tiled() || groups > max_groups)) __trap();  // the launch's promise
    if (n_tiles > 0 && p != frag_pair) {  // block-uniform; the last barrier ended every read of them
      one_row_frags_in_block<2>(h + static_cast<size_t>(p) * ldh, 0, groups, sfrag, sgs);
      __syncthreads();
      frag_pair = p;
    }
    mbar_wait(&bar[i & 1], (i >> 1) & 1);
    if (warp < n_tiles) {
      float acc[4] = {};
      const uint8_t* tile = stiles + (i & 1) * stage_bytes + static_cast<size_t>(warp) * groups * kTileGroupBytes;
#pragma unroll 2
      for (int G = 0; G < groups; ++G) {
        uint2 wa, wb;
        float sa, ba, sb, bb;
        tile_group_lds(tile + static_cast<size_t>(G) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
        tc4_one_mma(wa, wb, sa, ba, sb, bb, sfrag + static_cast<size_t>(G) * 4 * 32 + lane, t == 0 ? sgs[G] : 0.0f,
                    acc);
      }
      one_row_tile_store(acc, y + static_cast<size_t>(p) * ldy, row0, w.rows);
    }
    __syncthreads();  // stage i % 2 read
    if (threadIdx.x == kAsker && i + 2 < n) ask(i + 2);
  }
}

int g_gemv_version = 0;  // 0: not yet read from the environment

// The arithmetic of 4/8-bit GEMVs: 4 (the default: 4-bit codes of tall matrices on the tensor cores,
// v4, the rest as 3), 3 (group sums on the CUDA cores for all; CK_GEMV=v3) or 2 (dequantize each code
// first; CK_GEMV=v2), the older ones kept to compare in one run.
int q_arith() {
  static const int a = env_is("CK_GEMV", "v2") ? 2 : env_is("CK_GEMV", "v3") ? 3 : 4;
  return a;
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
  // K split over blocks (2-8 rows, no conv) while the grid has fewer blocks than tc_split_below() and
  // each warp keeps at least two groups: the hyper-connection mix's down projection at 2-8 rows (21
  // tiles, K = 10,240, on the tile kernel because its weights are tiles) ran on 21 blocks, 16.7 us a
  // call at 4 rows (Nsight Compute, 2026-12-01 08:29Z), ~0.1 TB/s.
  const int n_tiles = L.first_tile[L.n_jobs];
  // No split of a K under split_min_groups groups (CK_GEMV_SPLIT_MIN_GROUPS; default 8): the 2-8-row
  // mix's up projection (K = 320: 5 groups) was cut into slices of 3 and 2 groups a warp with a reduce
  // kernel after them, one more kernel per mix (33 a step) for two groups less on each warp's chain.
  // Unsplit (H200 2026-12-02 12:42Z, two interleaved rounds, 4 rows): 1,495.9 / 1,492.2 tok/s against
  // 1,478.5 / 1,490.1 (+0.6%), 390 kernels a step instead of 423; 12:57Z 1,470.0 / 1,475.6 against
  // 1,460.8 / 1,458.6; at 2 rows level (1,025.7 / 1,018.2 against 1,030.6 / 1,017.6).
  // CK_GEMV_SPLIT_MIN_GROUPS=0: split as before. A floor of 48 (the 8-bit routers, K = 2,560, unsplit
  // too; 374 kernels) read +1.0% at 12:57Z and level at 13:09Z (1,450.2 / 1,466.3 against 1,464.8 /
  // 1,460.0), and sends tiled K = 2,560 calls that had split to gemv_tc4_pair_kernel, whose sums round
  // differently from the row layout's (TiledWeightsGiveTheRowLayoutsBits): not taken.
  static const int split_min_groups = [] {
    const char* e = std::getenv("CK_GEMV_SPLIT_MIN_GROUPS");
    return e ? std::max(0, std::atoi(e)) : 8;
  }();
  if (R > 1 && !L.conv.y && L.groups >= split_min_groups)  // (L.kb is 1 from tc_launch_of)
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

// The one-row v4 launch with block-built fragments (gemv_tc4_one_kernel), or false when the jobs are
// too large for it (tiles x groups > kTcInWarpMax, CK_GEMV_INWARP_MAX to move it), x is not 16-byte
// aligned, or CK_GEMV_INWARP=0.
bool gemv_tc4_one(const GemvJob* jobs, int n_jobs, const float* x, bool bf16s, int bits, cudaStream_t s) {
  static const bool on = !env_is("CK_GEMV_INWARP", "0");
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
  // its tiles), then over the warps of a block. A block holds at most kTcBlockGroups groups of x.
  int parts = 1;
  while (parts < 64 && tiles * parts < sm_count() * 16 && L.groups >= 4 * parts) parts *= 2;
  int kb = std::min(parts, 8);
  while (kb < 8 && ceil_div(L.groups, kb) > kTcBlockGroups) kb *= 2;
  const int per_b = static_cast<int>(ceil_div(L.groups, kb));
  if (per_b > kTcBlockGroups) return false;
  L.ks = std::max(1, parts / kb);
  const size_t smem = static_cast<size_t>(per_b) * (4 * 32 * sizeof(uint2) + sizeof(float));
  const dim3 grid(static_cast<unsigned>(kb), static_cast<unsigned>(ceil_div(tiles, 8 / L.ks)), 1),
      cluster(static_cast<unsigned>(kb), 1, 1);
  auto go = [&](auto kernel) { launch_cluster(kernel, grid, 256, smem, s, cluster, L, x, kb); };
  if (bits == 8) {
    if (bf16s) go(gemv_tc4_one_kernel<true, 8>);
    else go(gemv_tc4_one_kernel<false, 8>);
  } else {
    if (bf16s) go(gemv_tc4_one_kernel<true, 4>);
    else go(gemv_tc4_one_kernel<false, 4>);
  }
  return true;
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
              const Tc4Frags* pre, const ConvTail* conv = nullptr) {
  bool bf16s = false;
  int bits = 0;
  if (q_arith() != 4 || n_jobs < 1 || n_jobs > kMaxGemvJobs || !tc4_suits(jobs, n_jobs, &bf16s, &bits)) return false;
  int total_rows = 0;
  for (int j = 0; j < n_jobs; ++j) total_rows += jobs[j].w.rows;
  const bool tiled = any_tiled(jobs, n_jobs);  // only the v4 kernels read them: no size threshold then
  if (!conv && bits == 4 && gemv_stream(jobs, n_jobs, x, ldx, rows, bf16s, stream)) return true;
  if (!conv && rows == 1 && gemv_tc4_one(jobs, n_jobs, x, bf16s, bits, stream)) return true;
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

// Resident blocks per SM of a 256-thread kernel (asked once per kernel).
template <class K>
int blocks_per_sm(K kernel) {
  int n = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, 256, 0));
  return std::max(1, n);
}

template <int CPU, int R, bool V3>
void launch_gemv_q_a(QLaunch L, const float* x, int ldx, int nx, cudaStream_t s) {
  static const int occ = blocks_per_sm(gemv_q_kernel<CPU, R, V3>);
  const int grid = std::min(L.first_batch[L.n_jobs], sm_count() * occ);
  if (L.kb > 1) {
    L.partial = static_cast<decltype(L.partial)>(scratch_alloc(sizeof(float) * L.kb * R * L.part_rows, s));
  }
  launch(gemv_q_kernel<CPU, R, V3>, grid, 256, 0, s, L, x, ldx, nx);
  CUDA_CHECK_LAUNCH();
  if (L.kb > 1) {
    const int total = nx * L.part_rows;
    launch(gemv_q_reduce_kernel, static_cast<unsigned>(ceil_div(total, 256)), 256, 0, s, L, nx, R);
    CUDA_CHECK_LAUNCH();
    scratch_free(L.partial, s);
  }
}

template <int CPU, int R>
void launch_gemv_q(const QLaunch& L, const float* x, int ldx, int nx, cudaStream_t s) {
  if (q_arith() != 2) launch_gemv_q_a<CPU, R, true>(L, x, ldx, nx, s);
  else launch_gemv_q_a<CPU, R, false>(L, x, ldx, nx, s);
}

// The v2 launch, or false when some job is not 4/8-bit codes.
bool gemv_v2(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream) {
  QLaunch L{};
  L.n_jobs = n_jobs;
  int total_groups = 0;
  for (int j = 0; j < n_jobs; ++j) {
    const DMatrix& w = jobs[j].w;
    if (!w.quantized() || (w.fmt.bits != 4 && w.fmt.bits != 8) || w.cols % 32 != 0) return false;
    L.job[j] = jobs[j];
    L.bits[j] = w.fmt.bits;
    total_groups += static_cast<int>(ceil_div(w.rows, kRpw));
  }
  const int cols = jobs[0].w.cols;
  int cpu = rows == 1 ? (cols >= 1024 ? 32 : 8) : rows == 2 ? (cols >= 1024 ? 16 : 8) : 8;
  // Short, wide matrices (the hyper-connection down projection: 320 rows of 10240; the router: 512 of
  // 2560) have too few row groups for the GPU: 8-code units give K enough units to split over all 8
  // warps of a block (2-4x the blocks of 32-code units). Kernel lab, H200: hc down 14.7 -> 13.4 us,
  // router 13.1 -> 9.0 us; decode +3%.
  if (rows == 1 && total_groups < sm_count() * 2) cpu = 8;
  const int U = cols / cpu;
  // Split the columns over more warps while there are too few row groups to fill the GPU and each
  // warp keeps at least two full sweeps of its lanes.
  int ks = 1;
  while (ks < 8 && total_groups * ks < sm_count() * 16 && U >= 64 * ks * 2) ks *= 2;
  L.ks = ks;
  const int gpb = 8 / ks;
  int row_batches = 0;
  for (int j = 0; j < n_jobs; ++j) row_batches += static_cast<int>(ceil_div(ceil_div(jobs[j].w.rows, kRpw), gpb));
  // Still fewer blocks than two per SM (the hyper-connection down projection: 81 blocks; the router: 33;
  // the DeltaNet out projection: 80): split K over blocks too, while each warp keeps at least one full
  // sweep of its lanes (docs/performance.md, "split-K over blocks").
  int kb = 1;
  while (kb < 8 && row_batches * kb < 2 * sm_count() && U >= 32 * ks * kb * 2) kb *= 2;
  L.kb = kb;
  int batches = 0, part_rows = 0;
  for (int j = 0; j < n_jobs; ++j) {
    L.first_batch[j] = batches;
    L.part_off[j] = part_rows;
    batches += static_cast<int>(ceil_div(ceil_div(jobs[j].w.rows, kRpw), gpb)) * kb;
    part_rows += jobs[j].w.rows;
  }
  L.first_batch[n_jobs] = batches;
  L.part_rows = part_rows;
  L.partial = nullptr;
  if (rows == 1) {
    if (cpu == 32) launch_gemv_q<32, 1>(L, x, ldx, rows, stream);
    else launch_gemv_q<8, 1>(L, x, ldx, rows, stream);
  } else if (rows == 2) {
    if (cpu == 16) launch_gemv_q<16, 2>(L, x, ldx, rows, stream);
    else launch_gemv_q<8, 2>(L, x, ldx, rows, stream);
  } else if (rows <= 4) {
    launch_gemv_q<8, 4>(L, x, ldx, rows, stream);
  } else {
    launch_gemv_q<8, 8>(L, x, ldx, rows, stream);
  }
  return true;
}

int threads_for_units(int64_t units) {
  int64_t t = round_up(ceil_div(units, 2), 32);
  return static_cast<int>(std::clamp<int64_t>(t, 32, 256));
}

template <int R, int M>
void launch_gemv(const GemvLaunch& L, int blocks, int threads, const float* x, int ldx, int nx, cudaStream_t s) {
  launch(gemv_kernel<R, M>, blocks, threads, 0, s, L, x, ldx, nx);
  CUDA_CHECK_LAUNCH();
}

template <int R>
void launch_gemv_m(int m, const GemvLaunch& L, int blocks, int threads, const float* x, int ldx, int nx,
                   cudaStream_t s) {
  if (m == 4) launch_gemv<R, 4>(L, blocks, threads, x, ldx, nx, s);
  else if (m == 2) launch_gemv<R, 2>(L, blocks, threads, x, ldx, nx, s);
  else launch_gemv<R, 1>(L, blocks, threads, x, ldx, nx, s);
}

}  // namespace

bool weight_tiles_on() {
  static const bool on = !env_is("CK_WEIGHT_TILES", "0") && !env_is("CK_Q4_DENSE", "0");
  return on && gemv_version() == 2 && q_arith() == 4;
}

void set_gemv_version(int v) { g_gemv_version = v == 1 ? 1 : 2; }

void init_gemv() {
  (void)sm_count();
  (void)gemv_version();
  gemv_stream_init();
  // The occupancy of each kernel is asked on its first launch; ask now, before any graph capture.
  (void)q_arith();
  static const int occ[] = {
      blocks_per_sm(gemv_q_kernel<32, 1, true>),  blocks_per_sm(gemv_q_kernel<8, 1, true>),
      blocks_per_sm(gemv_q_kernel<16, 2, true>),  blocks_per_sm(gemv_q_kernel<8, 2, true>),
      blocks_per_sm(gemv_q_kernel<8, 4, true>),   blocks_per_sm(gemv_q_kernel<8, 8, true>),
      blocks_per_sm(expert_gate_up_q_kernel<true>), blocks_per_sm(expert_down_q_kernel<true>),
      blocks_per_sm(gemv_q_kernel<32, 1, false>), blocks_per_sm(gemv_q_kernel<8, 1, false>),
      blocks_per_sm(gemv_q_kernel<16, 2, false>), blocks_per_sm(gemv_q_kernel<8, 2, false>),
      blocks_per_sm(gemv_q_kernel<8, 4, false>),  blocks_per_sm(gemv_q_kernel<8, 8, false>),
      blocks_per_sm(expert_gate_up_q_kernel<false>), blocks_per_sm(expert_down_q_kernel<false>)};
  (void)occ;
}

int gemv_version() {
  if (g_gemv_version == 0) {
    g_gemv_version = env_is("CK_GEMV", "v1") ? 1 : 2;
  }
  return g_gemv_version;
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

void gemv(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream,
          const Tc4Frags* pre) {
  CK_REQUIRE(n_jobs >= 1 && n_jobs <= kMaxGemvJobs, "invariant");
  CK_REQUIRE(rows >= 1, "invariant");
  if (jobs[0].frags_out) jobs[0].frags_out->rR = 0;  // until a launch writes them (launch_tc4)
  if (rows > kMaxRows) return gemm_tc(jobs, n_jobs, x, ldx, rows, stream);
  const bool x_aligned = reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0;
  for (int j = 0; j < n_jobs; ++j)
    CK_REQUIRE(jobs[j].w.cols == jobs[0].w.cols && jobs[j].w.rows >= 1 && jobs[j].w.data && jobs[j].y,
               "gemv: job %d: %d x %d matrix, output %p (job 0 has %d cols)", j, jobs[j].w.rows, jobs[j].w.cols,
               static_cast<void*>(jobs[j].y), jobs[0].w.cols);
  if (gemv_version() == 2 && gemv_tc4(jobs, n_jobs, x, ldx, rows, stream, pre)) return;
  // A tiled job beside jobs the v4 kernels do not take (a matrix left in bf16, other bits): one launch
  // per job, so each goes its own way.
  const bool tiled = any_tiled(jobs, n_jobs);
  if (tiled && n_jobs > 1) {
    for (int j = 0; j < n_jobs; ++j) gemv(&jobs[j], 1, x, ldx, rows, stream, pre);
    return;
  }
  CK_REQUIRE(!tiled, "gemv: a matrix in 16-row tiles, which only the v4 kernels read (CK_GEMV asks for "
             "another; CK_WEIGHT_TILES=0 uploads row layouts)");
  if (gemv_version() == 2 && x_aligned && gemv_v2(jobs, n_jobs, x, ldx, rows, stream)) return;
  GemvLaunch L{};
  L.n_jobs = n_jobs;
  int max_rows = 0;
  int64_t max_units = 1;
  for (int j = 0; j < n_jobs; ++j) {
    const DMatrix& w = jobs[j].w;
    CK_REQUIRE(w.cols == jobs[0].w.cols, "gemv: job %d has %d cols, job 0 has %d", j, w.cols, jobs[0].w.cols);
    CK_REQUIRE(w.rows >= 1 && w.data != nullptr && jobs[j].y != nullptr, "invariant");
    if (w.quantized())
      CK_REQUIRE(x_aligned && w.cols % 32 == 0, "gemv: quantized matrix needs an aligned x and cols %% 32 == 0 (cols %d)",
                w.cols);
    L.job[j] = jobs[j];
    L.path[j] = gemv_path(w, x_aligned);
    max_rows = std::max(max_rows, w.rows);
    max_units = std::max<int64_t>(max_units, w.cols / path_unit(L.path[j]));
  }
  // More rows per block only where there are rows enough to keep every SM busy.
  const int m = max_rows >= 16384 ? 4 : max_rows >= 4096 ? 2 : 1;
  int blocks = 0;
  for (int j = 0; j < n_jobs; ++j) {
    L.first_block[j] = blocks;
    blocks += static_cast<int>(ceil_div(jobs[j].w.rows, m));
  }
  L.first_block[n_jobs] = blocks;
  const int threads = threads_for_units(max_units);
  if (rows == 1) launch_gemv_m<1>(m, L, blocks, threads, x, ldx, rows, stream);
  else if (rows == 2) launch_gemv_m<2>(m, L, blocks, threads, x, ldx, rows, stream);
  else if (rows <= 4) launch_gemv_m<4>(m, L, blocks, threads, x, ldx, rows, stream);
  else launch_gemv_m<8>(m, L, blocks, threads, x, ldx, rows, stream);
}

namespace {
int g_layout_kernels = -1;  // set_layout_kernels; -1: the environment's
}  // namespace
void set_layout_kernels(int on) { g_layout_kernels = on < 0 ? -1 : (on ? 1 : 0); }
bool hc_layout_kernels_on() {
  static const bool env_on = !env_is("CK_HC_LAYOUT_KERNELS", "0");  // on since 2026-12-01 (+1.35% at one row)
  return g_layout_kernels < 0 ? env_on : g_layout_kernels != 0;
}

void matvec(const DMatrix& w, const float* x, int ldx, float* y, int ldy, int rows, cudaStream_t stream) {
  GemvJob j;
  j.w = w;
  j.y = y;
  j.ldy = ldy;
  gemv(&j, 1, x, ldx, rows, stream);
}

void expert_gate_up(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* x, int ldx, float* h,
                    int ldh, bool codes48, cudaStream_t stream) {
  CK_REQUIRE(n_pairs >= 1 && max_inter >= 1 && hidden >= 1, "invariant");
  CK_REQUIRE(reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0, "invariant");
  if (codes48 && gemv_version() == 2) {
    const bool v3 = q_arith() != 2;
    static const int occ3 = blocks_per_sm(expert_gate_up_q_kernel<true>);
    static const int occ2 = blocks_per_sm(expert_gate_up_q_kernel<false>);
    const int n_rg = static_cast<int>(ceil_div(max_inter, kRpw));
    const int grid = static_cast<int>(
        std::min<int64_t>(ceil_div(static_cast<int64_t>(n_pairs) * n_rg, 8), sm_count() * (v3 ? occ3 : occ2)));
    if (v3) launch(expert_gate_up_q_kernel<true>, grid, 256, 0, stream, pairs, n_pairs, n_rg, x, ldx, h, ldh);
    else launch(expert_gate_up_q_kernel<false>, grid, 256, 0, stream, pairs, n_pairs, n_rg, x, ldx, h, ldh);
    CUDA_CHECK_LAUNCH();
    return;
  }
  constexpr int M = 2;
  dim3 grid(static_cast<unsigned>(ceil_div(max_inter, M)), static_cast<unsigned>(n_pairs));
  launch(expert_gate_up_kernel<M>, grid, threads_for_units(ceil_div(hidden, 8)), 0, stream, pairs, x, ldx, h, ldh);
  CUDA_CHECK_LAUNCH();
}

bool expert_tc4_enabled() {
  static const bool on = !env_is("CK_EXPERT_TC4", "0");
  return on && q_arith() == 4;
}

namespace {
// The K split of the decode experts (warps per 16-row tile, 8 / ks tiles per block). "double": the
// first rule, doubling while the warps are fewer than 16 per SM (gate/up at the released geometry: 440
// tiles -> ks 8, 3,520 warps, more than one wave of resident blocks); "fit" (the default): the largest
// split whose blocks all fit in one wave of resident blocks, each part keeping at least 4 groups.
// CK_EXPERT_KS="double", or "a/b" fixed splits for gate/up and down (comparisons).
int expert_k_split(bool gate_up, int tiles, int groups, int resident_blocks) {
  static const std::string mode = [] {
    const char* e = std::getenv("CK_EXPERT_KS");
    return std::string(e ? e : "fit");
  }();
  int ks = 1;
  if (mode == "double") {
    while (ks < 8 && tiles * ks < sm_count() * 16 && groups >= 8 * ks) ks *= 2;
  } else if (mode == "fit") {
    while (ks < 8 && ceil_div(tiles, 8 / (2 * ks)) <= resident_blocks && groups >= 4 * 2 * ks) ks *= 2;
  } else {
    const size_t comma = mode.find('/');
    const int want = std::atoi((gate_up || comma == std::string::npos ? mode : mode.substr(comma + 1)).c_str());
    while (ks < 8 && 2 * ks <= want && groups >= 2 * ks) ks *= 2;
  }
  return ks;
}

// Fragments of n_vec vectors of K = 64 * groups floats (rows of x at ldx), then expert_tc4_kernel over
// n_pairs pairs of at most max_rows rows, each tile's groups split over expert_k_split's warps.
// Dynamic shared memory the bulk-copy expert kernels may ask for: gate/up tiles of K up to 44 groups.
constexpr size_t kBulkMaxSmem = 100 * 1024;
// Whether tiled decode experts take the bulk-copy kernels (CK_EXPERT_BULK=0: the direct loads, to compare).
bool expert_bulk_on() {
  static const bool on = !env_is("CK_EXPERT_BULK", "0");
  return on;
}

int g_expert_stream = -1;  // set_expert_stream; -1: the environment's
int g_expert_stream_blocks = 0;  // set_expert_stream's block count; 0: every resident block
// Whether tiled decode experts' gate/up takes the streaming kernel (CK_EXPERT_STREAM=0: the bulk
// kernel, one tile a block, to compare).
bool expert_stream_on() {
  static const bool env_on = !env_is("CK_EXPERT_STREAM", "0");
  return g_expert_stream < 0 ? env_on : g_expert_stream != 0;
}

// The same for down (CK_EXPERT_DOWN_STREAM=0: the bulk kernel, one chunk of 8 tiles a block).
bool expert_down_stream_on() {
  static const bool env_on = !env_is("CK_EXPERT_DOWN_STREAM", "0");
  return g_expert_stream < 0 ? env_on : g_expert_stream != 0;
}

// A streaming kernel's run length: `units` (tiles or chunks) spread over every block that can be
// resident at once (256 threads and `smem` bytes of dynamic shared memory each; the occupancy asked
// once per size), or over set_expert_stream's block count (tests): per = ceil(units / blocks). The
// kernel's dynamic shared memory limit is raised to `max_smem` on its first call.
struct StreamLaunchCache {
  bool smem_limit_set = false;
  size_t smem = 0;
  int blocks_per_sm = 0;
};
template <class Kernel>
int stream_run_length(Kernel kernel, size_t max_smem, size_t smem, int units, StreamLaunchCache& c) {
  if (!c.smem_limit_set) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_smem)));
    c.smem_limit_set = true;
  }
  if (c.blocks_per_sm == 0 || c.smem != smem) {
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c.blocks_per_sm, kernel, 256, smem));
    c.blocks_per_sm = std::max(1, c.blocks_per_sm);
    c.smem = smem;
  }
  const int blocks = g_expert_stream_blocks > 0 ? g_expert_stream_blocks : sm_count() * c.blocks_per_sm;
  return static_cast<int>(ceil_div(units, blocks));
}

int g_shared_early = -1;  // set_expert_shared_early; -1: the environment's
bool expert_shared_early_on() {
  static const bool env_on = !env_is("CK_EXPERT_SHARED_EARLY", "0");
  return g_shared_early < 0 ? env_on : g_shared_early != 0;
}

template <bool GATE_UP>
void launch_expert_tc4(const ExpertPair* pairs, int n_pairs, int max_rows, int groups, const float* x, int ldx,
                       int n_vec, float* out, int ldo, cudaStream_t s, const Tc4Frags* pre, bool all_tiled,
                       const SharedSlot* shared = nullptr) {
  const size_t frag_elems = static_cast<size_t>(groups) * kOneFragWords;  // the compact one-row layout
  uint8_t* scratch = nullptr;
  const uint2* frag = nullptr;
  const float* gsum = nullptr;
  if (pre && pre->covers(x, ldx, n_vec, groups)) {  // fragments made by the producer of x
    frag = pre->frag;
    gsum = pre->gsum;
  } else {
    scratch = static_cast<decltype(scratch)>(
        scratch_alloc(n_vec * (frag_elems * sizeof(uint2) + sizeof(float) * groups), s));
    uint2* f = reinterpret_cast<uint2*>(scratch);
    float* gs = reinterpret_cast<float*>(scratch + n_vec * frag_elems * sizeof(uint2));
    launch(tc4_frag_kernel<1>, dim3(static_cast<unsigned>(groups), static_cast<unsigned>(n_vec)), 128, 0, s, x, ldx,
           1, f, gs, static_cast<int64_t>(ldx), static_cast<int64_t>(frag_elems), static_cast<int64_t>(groups));
    CUDA_CHECK_LAUNCH();
    frag = f;
    gsum = gs;
  }
  const int tiles_per_pair = static_cast<int>(ceil_div(max_rows, 16)), tiles = n_pairs * tiles_per_pair;
  // Tiled experts: gate and up through bulk copies.
  const size_t bulk_smem = 2 * static_cast<size_t>(groups) * kTileGroupBytes;
  if (GATE_UP && all_tiled && expert_bulk_on() && bulk_smem <= kBulkMaxSmem) {
    static const bool attr = [] {
      CUDA_CHECK(cudaFuncSetAttribute(expert_gate_up_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kBulkMaxSmem));
      return true;
    }();
    (void)attr;
    SharedSlot sh;
    if (expert_shared_early_on() && shared && shared->k1 > 0 && n_pairs % shared->k1 == 0) sh = *shared;
    if (expert_stream_on() && 2 * bulk_smem <= kBulkMaxSmem && ceil_div(groups, 8) <= kStreamWarpGroups) {
      static StreamLaunchCache cache;
      const int per = stream_run_length(expert_gate_up_stream_kernel, kBulkMaxSmem, 2 * bulk_smem, tiles, cache);
      launch(expert_gate_up_stream_kernel, static_cast<unsigned>(ceil_div(tiles, per)), 256, 2 * bulk_smem, s, pairs,
             tiles_per_pair, tiles, per, frag, gsum, groups, out, ldo, sh);
      CUDA_CHECK_LAUNCH();
      if (scratch) scratch_free(scratch, s);
      return;
    }
    launch(expert_gate_up_bulk_kernel, static_cast<unsigned>(tiles), 256, bulk_smem, s, pairs, tiles_per_pair, frag,
           gsum, groups, out, ldo, sh);
    CUDA_CHECK_LAUNCH();
    if (scratch) scratch_free(scratch, s);
    return;
  }
  static const int occ = blocks_per_sm(expert_tc4_kernel<GATE_UP, 2>);
  const int ks = expert_k_split(GATE_UP, tiles, groups, sm_count() * occ);
  // Group loop unrolled twice: four times measured 422 against 429 tok/s (2026-11-30), and again
  // 506.3 against 509.6 with the one-wave split.
  const unsigned grid = static_cast<unsigned>(ceil_div(tiles, 8 / ks));
  launch(expert_tc4_kernel<GATE_UP, 2>, grid, 256, 0, s, pairs, n_pairs, tiles_per_pair, ks, frag, gsum, groups, out,
         ldo);
  CUDA_CHECK_LAUNCH();
  if (scratch) scratch_free(scratch, s);
}
}  // namespace

void set_expert_shared_early(int on) { g_shared_early = on < 0 ? -1 : (on ? 1 : 0); }
void set_expert_stream(int on, int blocks) {
  g_expert_stream = on < 0 ? -1 : (on ? 1 : 0);
  g_expert_stream_blocks = on > 0 ? std::max(0, blocks) : 0;
}

void expert_gate_up_tc4(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* x, int ldx,
                        int x_rows, float* h, int ldh, cudaStream_t stream, const Tc4Frags* pre, bool all_tiled,
                        const SharedSlot* shared) {
  CK_REQUIRE(n_pairs >= 1 && x_rows >= 1 && hidden % 64 == 0 && max_inter >= 1, "invariant");
  launch_expert_tc4<true>(pairs, n_pairs, max_inter, hidden / 64, x, ldx, x_rows, h, ldh, stream, pre, all_tiled,
                          shared);
}

void expert_down_tc4(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* h, int ldh, float* y,
                     int ldy, cudaStream_t stream, bool all_tiled) {
  CK_REQUIRE(n_pairs >= 1 && max_inter % 64 == 0 && hidden >= 1, "invariant");
  // The fragments in the block unless the pairs' K is beyond a block's fragment memory (or
  // CK_EXPERT_DOWN_ONE=0: the fragment kernel and expert_tc4_kernel, to compare).
  static const bool one = !env_is("CK_EXPERT_DOWN_ONE", "0");
  const int max_groups = max_inter / 64;
  // Tiled experts: the block's tiles by one bulk copy.
  if (one && expert_bulk_on() && all_tiled && max_groups <= kTcBlockGroups && bulk_down_smem(max_groups) <= kBulkMaxSmem &&
      hidden % 16 == 0 && reinterpret_cast<uintptr_t>(h) % 16 == 0 && ldh % 4 == 0) {
    static const bool attr = [] {
      CUDA_CHECK(cudaFuncSetAttribute(expert_down_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkMaxSmem));
      return true;
    }();
    (void)attr;
    const int bpp = static_cast<int>(ceil_div(hidden, 128));
    static const int early = env_is("CK_EXPERT_DOWN_EARLY", "0") ? 0 : 1;
    const size_t ssmem = bulk_down_stream_smem(max_groups);
    if (expert_down_stream_on() && early && ssmem <= kDownStreamMaxSmem) {
      static StreamLaunchCache cache;
      const int chunks = n_pairs * bpp;
      const int per = stream_run_length(expert_down_stream_kernel, kDownStreamMaxSmem, ssmem, chunks, cache);
      launch(expert_down_stream_kernel, static_cast<unsigned>(ceil_div(chunks, per)), 256, ssmem, stream, pairs, bpp,
             chunks, per, max_groups, h, ldh, y, ldy);
      CUDA_CHECK_LAUNCH();
      return;
    }
    launch(expert_down_bulk_kernel, static_cast<unsigned>(n_pairs * bpp), 256, bulk_down_smem(max_groups), stream, pairs,
           bpp, max_groups, h, ldh, y, ldy, early);
    CUDA_CHECK_LAUNCH();
    return;
  }
  if (one && max_groups <= kTcBlockGroups && reinterpret_cast<uintptr_t>(h) % 16 == 0 && ldh % 4 == 0) {
    const int bpp = static_cast<int>(ceil_div(hidden, 128));
    launch(expert_down_one_kernel, static_cast<unsigned>(n_pairs * bpp), 256,
           static_cast<size_t>(max_groups) * (4 * 32 * sizeof(uint2) + sizeof(float)), stream, pairs, bpp, max_groups,
           h, ldh, y, ldy);
    CUDA_CHECK_LAUNCH();
    return;
  }
  launch_expert_tc4<false>(pairs, n_pairs, hidden, max_inter / 64, h, ldh, n_pairs, y, ldy, stream, nullptr, false);
}

void expert_down(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* h, int ldh, float* y,
                 int ldy, bool codes48, cudaStream_t stream) {
  CK_REQUIRE(n_pairs >= 1 && max_inter >= 1 && hidden >= 1, "invariant");
  CK_REQUIRE(reinterpret_cast<uintptr_t>(h) % 16 == 0 && ldh % 4 == 0, "invariant");
  if (codes48 && gemv_version() == 2) {
    const bool v3 = q_arith() != 2;
    static const int occ3 = blocks_per_sm(expert_down_q_kernel<true>);
    static const int occ2 = blocks_per_sm(expert_down_q_kernel<false>);
    const int n_rg = static_cast<int>(ceil_div(hidden, kRpw));
    const int grid = static_cast<int>(
        std::min<int64_t>(ceil_div(static_cast<int64_t>(n_pairs) * n_rg, 8), sm_count() * (v3 ? occ3 : occ2)));
    if (v3) launch(expert_down_q_kernel<true>, grid, 256, 0, stream, pairs, n_pairs, n_rg, h, ldh, y, ldy);
    else launch(expert_down_q_kernel<false>, grid, 256, 0, stream, pairs, n_pairs, n_rg, h, ldh, y, ldy);
    CUDA_CHECK_LAUNCH();
    return;
  }
  constexpr int M = 2;
  dim3 grid(static_cast<unsigned>(ceil_div(hidden, M)), static_cast<unsigned>(n_pairs));
  launch(expert_down_kernel<M>, grid, threads_for_units(ceil_div(max_inter, 8)), 0, stream, pairs, h, ldh, y, ldy);
  CUDA_CHECK_LAUNCH();
}

}  // namespace ck::cuda
