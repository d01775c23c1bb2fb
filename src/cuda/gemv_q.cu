// GEMV for 1-8 activation rows, v2/v3: MLX affine 4- and 8-bit codes on the CUDA cores, and the
// routed/shared expert products over the same codes, then their launchers (gemv.cu chooses the
// schedule). fp32 activations and fp32 accumulation throughout.
//
// Schedules (docs/roofline-cuda.md):
//  v2 (4- and 8-bit codes, the real checkpoint's forms): each warp owns a group of RPW output rows and
//     sweeps their codes in units of CPU codes per lane (16-byte loads for one activation row); a unit
//     of x is loaded once and applied to the RPW rows; warps reduce with shuffles only; a grid-stride
//     loop keeps every resident warp busy; wide, short matrices split K over up to 8 warps of a block
//     (added in a fixed order through shared memory) and, when still too few blocks, over up to 8
//     blocks (partial sums added in index order by a second kernel). Deterministic: no atomics. Its
//     inner loop (qtile, "v3 arithmetic") sums raw codes times x per unit and applies scale and bias
//     once per unit; the older arithmetic (qtile_v2, each code dequantized first) stays selectable
//     with CK_GEMV=v2.
#include <algorithm>
#include <cstdint>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gemv_internal.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

namespace ck::cuda {
namespace {

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

}  // namespace

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

// init_gemv's part (gemv.cu): the v2/v3 kernels' occupancy, asked before any graph capture.
void init_gemv_q() {
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

// expert_gate_up for 4/8-bit codes at gemv_version() 2 (gemv.cu): the v2/v3 kernels.
void expert_gate_up_q(const ExpertPair* pairs, int n_pairs, int max_inter, const float* x, int ldx, float* h, int ldh,
                      cudaStream_t stream) {
  const bool v3 = q_arith() != 2;
  static const int occ3 = blocks_per_sm(expert_gate_up_q_kernel<true>);
  static const int occ2 = blocks_per_sm(expert_gate_up_q_kernel<false>);
  const int n_rg = static_cast<int>(ceil_div(max_inter, kRpw));
  const int grid = static_cast<int>(
      std::min<int64_t>(ceil_div(static_cast<int64_t>(n_pairs) * n_rg, 8), sm_count() * (v3 ? occ3 : occ2)));
  if (v3) launch(expert_gate_up_q_kernel<true>, grid, 256, 0, stream, pairs, n_pairs, n_rg, x, ldx, h, ldh);
  else launch(expert_gate_up_q_kernel<false>, grid, 256, 0, stream, pairs, n_pairs, n_rg, x, ldx, h, ldh);
  CUDA_CHECK_LAUNCH();
}

// expert_down for 4/8-bit codes at gemv_version() 2 (gemv.cu): the v2/v3 kernels.
void expert_down_q(const ExpertPair* pairs, int n_pairs, int hidden, const float* h, int ldh, float* y, int ldy,
                   cudaStream_t stream) {
  const bool v3 = q_arith() != 2;
  static const int occ3 = blocks_per_sm(expert_down_q_kernel<true>);
  static const int occ2 = blocks_per_sm(expert_down_q_kernel<false>);
  const int n_rg = static_cast<int>(ceil_div(hidden, kRpw));
  const int grid = static_cast<int>(
      std::min<int64_t>(ceil_div(static_cast<int64_t>(n_pairs) * n_rg, 8), sm_count() * (v3 ? occ3 : occ2)));
  if (v3) launch(expert_down_q_kernel<true>, grid, 256, 0, stream, pairs, n_pairs, n_rg, h, ldh, y, ldy);
  else launch(expert_down_q_kernel<false>, grid, 256, 0, stream, pairs, n_pairs, n_rg, h, ldh, y, ldy);
  CUDA_CHECK_LAUNCH();
}

}  // namespace ck::cuda
