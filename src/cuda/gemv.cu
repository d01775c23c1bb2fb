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
//
// Files: this one holds v1 and the public entry points that choose a schedule (gemv(), matvec, the
// v1/v2 experts' expert_gate_up and expert_down, init_gemv); gemv_q.cu the v2/v3 kernels and their
// launchers; gemv_tc4.cu the v4 GEMV kernels and theirs; gemv_experts.cu the decode experts on the
// tensor cores; gemv_stream.cu the streamed v4 GEMV. gemv_internal.h holds what they share.
#include <algorithm>
#include <cstdint>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gemv_internal.h"
#include "cuda/gemv_stream.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

namespace ck::cuda {
namespace {

// Every row of x (stride ldx floats) starts 16-byte aligned: the vector paths' precondition.
bool rows_aligned16(const float* x, int ldx) { return reinterpret_cast<uintptr_t>(x) % 16 == 0 && ldx % 4 == 0; }

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

// blockIdx.y: the batch of R activation rows [R y, R y + R) of a launch over more than R rows
// (gemv_narrow_rows: prefill chunks through a matrix of a few rows).
template <int R, int M>
__global__ void __launch_bounds__(256) gemv_kernel(const __grid_constant__ GemvLaunch L, const float* __restrict__ x,
                                                   int ldx, int nx) {
  pdl_begin();
  __shared__ float red[9 * M * R];
  const int batch = static_cast<int>(blockIdx.y) * R;
  x += static_cast<size_t>(batch) * ldx;
  nx -= batch;
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
      jb.y[static_cast<size_t>(batch + r) * jb.ldy + row0 + m] =
          apply_epilogue(red[8 * M * R + threadIdx.x], jb.epi, jb.epi_arg);
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

int g_gemv_version = 0;  // 0: not yet read from the environment

int threads_for_units(int64_t units) {
  int64_t t = round_up(ceil_div(units, 2), 32);
  return static_cast<int>(std::clamp<int64_t>(t, 32, 256));
}

template <int R, int M>
void launch_gemv(const GemvLaunch& L, int blocks, int threads, const float* x, int ldx, int nx, cudaStream_t s) {
  launch(gemv_kernel<R, M>, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(ceil_div(nx, R))), threads, 0, s,
         L, x, ldx, nx);
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

// The arithmetic of 4/8-bit GEMVs: 4 (the default: 4-bit codes of tall matrices on the tensor cores,
// v4, the rest as 3), 3 (group sums on the CUDA cores for all; CK_GEMV=v3) or 2 (dequantize each code
// first; CK_GEMV=v2), the older ones kept to compare in one run.
int q_arith() {
  static const int a = env_is("CK_GEMV", "v2") ? 2 : env_is("CK_GEMV", "v3") ? 3 : 4;
  return a;
}

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
  init_gemv_q();  // gemv_q.cu: the v2/v3 kernels
  init_gemv_tc4();
}

int gemv_version() {
  if (g_gemv_version == 0) {
    g_gemv_version = env_is("CK_GEMV", "v1") ? 1 : 2;
  }
  return g_gemv_version;
}

void gemv(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream,
          const Tc4Frags* pre) {
  CK_REQUIRE(n_jobs >= 1 && n_jobs <= kMaxGemvJobs, "invariant");
  CK_REQUIRE(rows >= 1, "invariant");
  if (jobs[0].frags_out) jobs[0].frags_out->rR = 0;  // until a launch writes them (launch_tc4)
  if (rows > kMaxRows) return gemm_tc(jobs, n_jobs, x, ldx, rows, stream);
  const bool x_aligned = rows_aligned16(x, ldx);
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
  gemv_v1(jobs, n_jobs, x, ldx, rows, stream);
}

// The v1 kernel (any format; CUDA cores, fp32), over batches of 8 activation rows past 8 rows.
void gemv_v1(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream) {
  const bool x_aligned = rows_aligned16(x, ldx);
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

bool gemv_narrow_rows(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream) {
  static const bool on = !env_is("CK_GEMV_NARROW", "0");
  if (!on || any_tiled(jobs, n_jobs) || !rows_aligned16(x, ldx)) return false;
  for (int j = 0; j < n_jobs; ++j)
    if (jobs[j].w.rows > kNarrowRows || (jobs[j].w.quantized() && jobs[j].w.cols % 32 != 0)) return false;
  gemv_v1(jobs, n_jobs, x, ldx, rows, stream);
  return true;
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
  CK_REQUIRE(rows_aligned16(x, ldx), "invariant");
  if (codes48 && gemv_version() == 2) {
    expert_gate_up_q(pairs, n_pairs, max_inter, x, ldx, h, ldh, stream);  // gemv_q.cu
    return;
  }
  constexpr int M = 2;
  dim3 grid(static_cast<unsigned>(ceil_div(max_inter, M)), static_cast<unsigned>(n_pairs));
  launch(expert_gate_up_kernel<M>, grid, threads_for_units(ceil_div(hidden, 8)), 0, stream, pairs, x, ldx, h, ldh);
  CUDA_CHECK_LAUNCH();
}

void expert_down(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* h, int ldh, float* y,
                 int ldy, bool codes48, cudaStream_t stream) {
  CK_REQUIRE(n_pairs >= 1 && max_inter >= 1 && hidden >= 1, "invariant");
  CK_REQUIRE(reinterpret_cast<uintptr_t>(h) % 16 == 0 && ldh % 4 == 0, "invariant");
  if (codes48 && gemv_version() == 2) {
    expert_down_q(pairs, n_pairs, hidden, h, ldh, y, ldy, stream);  // gemv_q.cu
    return;
  }
  constexpr int M = 2;
  dim3 grid(static_cast<unsigned>(ceil_div(hidden, M)), static_cast<unsigned>(n_pairs));
  launch(expert_down_kernel<M>, grid, threads_for_units(ceil_div(max_inter, 8)), 0, stream, pairs, h, ldh, y, ldy);
  CUDA_CHECK_LAUNCH();
}

}  // namespace ck::cuda
