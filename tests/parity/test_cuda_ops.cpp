// Parity of the CUDA ops with their CPU twins (src/cpu/ops.h, src/cpu/qwen4_exp.cpp) on seeded random
// inputs and awkward shapes: every GEMV weight format and row count, epilogues, expert products through
// ExpertPair views, the router, norms, RoPE, top-k and argmax (ties), and the layer pieces through a
// whole random model of awkward geometry, compared piece by piece ("taps"). Each case prints its max
// absolute error and NMSE. Skips when no CUDA device is visible (CI); always compiles.
//
// Tolerances: |gpu - cpu| <= atol + rtol * |cpu|, per kind, with the reason:
//  - sums of n fp32 products in another order (GEMV, dot products): atol = 8 * sqrt(n) * 2^-24 * Σ|terms|
//    (the standard bound on reordered fp32 summation, a factor 8 of margin), rtol = 0;
//  - norms (one reordered sum of squares, then elementwise): rtol 4e-6, atol 1e-7;
//  - RoPE (CUDA sinf/cosf are within 2 ulp of the host's): atol 1e-6 * max|x|;
//  - dequantized gathers, top-k and argmax: exact.
//  - whole-model pieces (errors accumulate over layers): relative L2 <= 1e-4 per piece, the same bound
//    the oracle fixtures use.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/ops.h"
#include "cpu/qwen4_exp.h"
#include "util/half.h"

#if CHERENKOV_HAVE_CUDA
#include "cuda/layers.h"
#include "cuda/ops.h"
#include "cuda/qwen4_exp.h"
#include "cuda/random_model.h"
#include "cuda/weights.h"
#endif

namespace {

#if CHERENKOV_HAVE_CUDA
using namespace ck;
using namespace ck::cuda;

bool have_gpu() {
  static const bool g = device_count() > 0;
  return g;
}
#define REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

// ------------------------------------------------------------------ comparison

struct Diff {
  double max_abs = 0, nmse = 0;
  int64_t bad = 0, first_bad = -1;
  double got_at_bad = 0, ref_at_bad = 0, tol_at_bad = 0;
};

// Elementwise with a per-element tolerance tol[i] (or atol + rtol |ref| when tol is empty).
Diff compare(const std::vector<float>& got, const std::vector<float>& ref, const std::vector<double>& tol, double atol,
             double rtol) {
  Diff d;
  double se = 0, sr = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = got[i], r = ref[i];
    const double e = std::fabs(g - r);
    const bool nan_ok = std::isnan(g) == std::isnan(r);
    const double t = tol.empty() ? atol + rtol * std::fabs(r) : tol[i];
    if (!nan_ok || e > t || std::isnan(e) != std::isnan(r)) {
      if (d.first_bad < 0) { d.first_bad = static_cast<int64_t>(i); d.got_at_bad = g; d.ref_at_bad = r; d.tol_at_bad = t; }
      ++d.bad;
    }
    if (!std::isnan(e)) d.max_abs = std::max(d.max_abs, e);
    se += std::isnan(e) ? 0 : e * e;
    sr += r * r;
  }
  d.nmse = sr > 0 ? se / sr : se;
  return d;
}

void report(const std::string& what, const Diff& d) {
  std::printf("  %-58s max_abs %.3e  nmse %.3e%s\n", what.c_str(), d.max_abs, d.nmse, d.bad ? "  FAIL" : "");
  EXPECT_EQ(d.bad, 0) << what << ": " << d.bad << " elements out of tolerance; first at " << d.first_bad << ": gpu "
                      << d.got_at_bad << " cpu " << d.ref_at_bad << " tol " << d.tol_at_bad;
}

template <class T>
T* to_device(const std::vector<T>& v, DeviceBuffer<T>* buf) {
  buf->resize(std::max<size_t>(1, v.size()));
  if (!v.empty()) CUDA_CHECK(cudaMemcpy(buf->get(), v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return buf->get();
}
template <class T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// An absolute tolerance at the scale of the whole output: fp32 dots of a few thousand terms in another
// order differ by ~sqrt(n) * 2^-24 * |typical value|, far below 1e-5 of the largest value.
double scale_atol(const std::vector<float>& ref, double frac = 1e-5) {
  double m = 0;
  for (float v : ref) m = std::max(m, static_cast<double>(std::fabs(v)));
  return frac * m;
}

std::vector<float> randn(size_t n, std::mt19937_64& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// A host matrix that owns its bytes.
struct HostMatrix {
  Matrix m;
  std::vector<uint8_t> data, scales, biases;
};

HostMatrix make_matrix(int64_t rows, int64_t cols, const WeightForm& f, std::mt19937_64& rng) {
  HostMatrix h;
  h.m.rows = rows;
  h.m.cols = cols;
  h.m.name = "test";
  std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
  if (f.bits == 0) {
    h.m.dtype = f.dtype;
    h.data.resize(static_cast<size_t>(rows * cols) * dtype_size(f.dtype));
    for (int64_t i = 0; i < rows * cols; ++i) {
      const float v = ud(rng);
      if (f.dtype == DType::F32) std::memcpy(h.data.data() + 4 * i, &v, 4);
      else {
        const uint16_t b = f.dtype == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
        std::memcpy(h.data.data() + 2 * i, &b, 2);
      }
    }
    h.m.data = h.data.data();
    return h;
  }
  h.m.dtype = DType::U32;
  h.m.bits = f.bits;
  h.m.group_size = f.group;
  h.m.scale_dtype = f.scale_dtype;
  h.data.resize(static_cast<size_t>(rows) * cols * f.bits / 8);
  for (auto& b : h.data) b = static_cast<uint8_t>(rng());
  const size_t groups = static_cast<size_t>(rows * (cols / f.group)), ss = dtype_size(f.scale_dtype);
  h.scales.resize(groups * ss);
  h.biases.resize(groups * ss);
  for (size_t g = 0; g < groups; ++g) {
    const float s = 0.01f + 0.02f * (ud(rng) + 1.0f), b = ud(rng) * 0.1f;
    for (auto [v, dst] : {std::pair{s, h.scales.data()}, std::pair{b, h.biases.data()}}) {
      if (f.scale_dtype == DType::F32) std::memcpy(dst + 4 * g, &v, 4);
      else {
        const uint16_t x = f.scale_dtype == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
        std::memcpy(dst + 2 * g, &x, 2);
      }
    }
  }
  h.m.data = h.data.data();
  h.m.scales = h.scales.data();
  h.m.biases = h.biases.data();
  return h;
}

std::string form_name(const WeightForm& f) {
  if (f.bits == 0) return dtype_name(f.dtype);
  return "q" + std::to_string(f.bits) + "g" + std::to_string(f.group) + "/" + dtype_name(f.scale_dtype);
}

// Per-output tolerance of a reordered fp32 dot product: 8 sqrt(n) eps Σ|w_c x_c| (+ a floor). Output
// rows in parallel, and each group's Σ|x| once per input row: at the prefill tests' shapes (800 rows of
// 4,160 x 2,560) this bound cost more host time than the GPU work it checks.
std::vector<double> dot_tolerance(const Matrix& w, const std::vector<float>& x, int rows, int ldx) {
  std::vector<double> tol(static_cast<size_t>(rows) * w.rows);
  const double k = 8.0 * std::sqrt(static_cast<double>(w.cols)) * 5.96e-8;
  const int64_t ng = w.quantized() ? w.cols / w.group_size : 0;
  std::vector<double> xabs(static_cast<size_t>(rows) * ng);  // Σ|x| per (input row, group)
  for (int r = 0; r < rows; ++r)
    for (int64_t g = 0; g < ng; ++g) {
      double a = 0;
      for (int i = 0; i < w.group_size; ++i) a += std::fabs(x[r * ldx + g * w.group_size + i]);
      xabs[r * ng + g] = a;
    }
#pragma omp parallel
  {
    std::vector<float> wr(static_cast<size_t>(w.cols));
#pragma omp for schedule(static)
    for (int64_t o = 0; o < w.rows; ++o) {
      matrix_row(w, o, wr.data());
      for (int r = 0; r < rows; ++r) {
        double s = 0;
        for (int64_t c = 0; c < w.cols; ++c) s += std::fabs(static_cast<double>(wr[c]) * x[r * ldx + c]);
        // Quantized: the CPU splits each weight into s*q and b; bound both terms.
        for (int64_t g = 0; g < ng; ++g)
          s += std::fabs(load_float(w.scale_dtype, w.biases, o * ng + g)) * xabs[r * ng + g];
        tol[static_cast<size_t>(r) * w.rows + o] = k * s + 1e-30;
      }
    }
  }
  return tol;
}

// ------------------------------------------------------------------ GEMV

struct GemvCase {
  int64_t rows, cols;
  WeightForm f;
};

TEST(CudaOps, MatvecAllFormatsAndRowCounts) {
  REQUIRE_GPU();
  std::mt19937_64 rng(1234);
  const WeightForm f32{DType::F32}, bf16{DType::BF16}, f16{DType::F16};
  auto q = [](int bits, int group, DType sd) { return WeightForm{DType::U32, bits, group, sd}; };
  const std::vector<GemvCase> cases = {
      {1, 1, f32},       {3, 7, f32},       {33, 48, f32},     {5, 3, bf16},      {300, 48, bf16},
      {17, 1000, f16},   {9, 24, f16},      {129, 64, f32},
      {1, 32, q(4, 32, DType::BF16)},       {37, 64, q(4, 64, DType::BF16)},     {300, 2560, q(4, 64, DType::BF16)},
      {65, 128, q(4, 128, DType::F16)},     {40, 96, q(4, 32, DType::F32)},      {33, 64, q(8, 64, DType::BF16)},
      {70, 256, q(8, 128, DType::BF16)},    {31, 64, q(2, 32, DType::BF16)},     {45, 128, q(2, 64, DType::F16)},
      {29, 96, q(3, 32, DType::BF16)},      {50, 192, q(3, 64, DType::BF16)},    {12, 640, q(3, 128, DType::F32)},
      {4100, 64, q(4, 64, DType::BF16)},    {17000, 32, q(4, 32, DType::BF16)},  {4099, 40, bf16},
      // Tall 4-bit matrices take the tensor-core GEMV (v4): one K segment, several (groups of 128,
      // 8 rows: 3 MMAs per step), and a row count that is not a multiple of 16.
      {2048, 2560, q(4, 64, DType::BF16)},  {1100, 6144, q(4, 128, DType::F16)}, {1037, 1024, q(4, 64, DType::F32)},
      {65600, 1024, q(4, 64, DType::BF16)},  // one activation row too (the LM head's shape class)
      // One row of large matrices: the streamed GEMV (gemv_stream.cu; its threshold lowered below),
      // f16 and f32 scales, a last tile of 7 and of 9 rows.
      {20007, 2560, q(4, 64, DType::F16)},   {17001, 1536, q(4, 64, DType::F32)},
      {40000, 320, q(4, 64, DType::BF16)},   // prefill's 4-bit GEMM over a short K (the hc up projection's)
      // One row of short, wide 4-bit matrices: the in-warp tensor-core GEMV with K split over the
      // blocks of a cluster (the hyper-connection down projection's shape; a lone row, as the
      // shared-expert gate).
      {320, 10240, q(4, 64, DType::BF16)},  {1, 2560, q(4, 64, DType::BF16)},  {16, 4096, q(4, 128, DType::F16)},
      {2560, 6144, q(4, 64, DType::BF16)},  {700, 192, q(4, 64, DType::F32)},
      // 8-bit codes at 2-8 rows take the tile kernel's nibble MMAs (tc8_group_mma): the router's shape
      // and the shared expert's one-row gate.
      {512, 2560, q(8, 64, DType::BF16)},   {1, 2560, q(8, 64, DType::BF16)},
  };
  DeviceArena arena;
  set_gemv_stream_min_work(16385);  // the one-row matrices of more than 1,024 tiles x 16 groups
  const int64_t streamed_before = gemv_stream_launches();
  for (const GemvCase& gc : cases) {
    HostMatrix hm = make_matrix(gc.rows, gc.cols, gc.f, rng);
    DenseUploader up(&arena);
    auto dm = up.matrix(hm.m);
    ASSERT_TRUE(dm.ok()) << dm.status().message();
    // The CPU reference dominates this test's time: large matrices get fewer row counts (one of each
    // path: 1 row, the tensor-core GEMV's 2-8, prefill's > kMaxRows).
    // (2, 4 and 5 rows of the large ones: the streamed GEMV's multi-row forms, R = 2, 4, 8.)
    const bool large = gc.rows * gc.cols > (int64_t{8} << 20);
    for (int rows : large ? std::vector<int>{1, 2, 4, 5, 9} : std::vector<int>{1, 2, 3, 4, 5, 8, 9, 70}) {
      const int ldx = static_cast<int>(round_up(gc.cols, 4)) + 4, ldy = static_cast<int>(gc.rows) + 3;
      std::vector<float> x = randn(static_cast<size_t>(rows) * ldx, rng);
      std::vector<float> ref(static_cast<size_t>(rows) * gc.rows);
      for (int r = 0; r < rows; ++r) ck::cpu::matvec(hm.m, x.data() + r * ldx, ref.data() + r * gc.rows);
      std::vector<double> tol = dot_tolerance(hm.m, x, rows, ldx);
      // Over kMaxRows rows gemv() takes the tensor-core path (tf32x3 products, the same for both
      // versions: run once). Its per-product error is ~2^-21 instead of fp32's 2^-24: a wider bound.
      const bool tc = rows > kMaxRows;
      if (tc)
        for (double& t : tol) t *= 32.0;
      // Over kMaxRows: both dense 4-bit kernels on Hopper (the warpgroup-MMA one as version 1 here, by
      // its row threshold; elsewhere both runs take q4_tile_kernel).
      for (int version : {1, 2}) {
        if (tc) set_q4_wg_min_rows(version == 1 ? 1 : 1 << 30);
        else set_gemv_version(version);
        DeviceBuffer<float> xd, yd(static_cast<size_t>(rows) * ldy);
        matvec(*dm, to_device(x, &xd), ldx, yd.get(), ldy, rows, nullptr);
        std::vector<float> yh = to_host(yd.get(), static_cast<size_t>(rows) * ldy), got(ref.size());
        for (int r = 0; r < rows; ++r)
          std::memcpy(got.data() + r * gc.rows, yh.data() + r * ldy, sizeof(float) * gc.rows);
        const std::string path =
            tc ? (version == 1 ? "matvec tc wg " : "matvec tc ") : "matvec v" + std::to_string(version) + " ";
        report(path + form_name(gc.f) + " [" + std::to_string(gc.rows) + "x" + std::to_string(gc.cols) + "] rows " +
                   std::to_string(rows),
               compare(got, ref, tol, 0, 0));
      }
    }
  }
  // The three cases above the threshold at one row, and at 2, 4 and 5 rows unless CK_GEMV_STREAM_ROWS=0
  // keeps multi-row steps on the tile kernel, under version 2.
  EXPECT_GE(gemv_stream_launches() - streamed_before, env_is("CK_GEMV_STREAM_ROWS", "0") ? 3 : 12);
  set_gemv_stream_min_work(-1);
  set_gemv_version(2);
  set_q4_wg_min_rows(-1);
}

TEST(CudaOps, GemvMultiJobWithEpilogues) {
  REQUIRE_GPU();
  // Mixed formats (v1 path), then all codes under v2 and v1 (split K over blocks: few rows), then
  // three tall-enough 4-bit jobs: 5 rows (the tensor-core GEMV, 3 MMAs per step), then 70 rows over
  // enough features for prefill's factored 4-bit GEMM (gemm_q4), then one row over 4,175 rows of
  // 4-bit jobs (the tensor-core GEMV at one row, as for the DeltaNet in_proj), then 70 rows over few
  // features and a long K (gemm_q4 split over K, as the hyper-connection down projection), then one
  // row of the three 4-bit jobs on the streamed GEMV (its threshold lowered to take them).
  for (int variant = 0; variant < 8; ++variant) {
  set_gemv_version(variant == 2 ? 1 : 2);
  set_gemv_stream_min_work(variant == 7 ? 0 : -1);
  std::mt19937_64 rng(77 + variant);
  const int cols = variant == 6 ? 10240 : variant == 7 ? 2560 : variant >= 3 ? 3840 : variant ? 2560 : 64;
  const int rows = variant == 5 || variant == 7 ? 1 : variant == 4 || variant == 6 ? 70 : variant ? 5 : 3, ldx = cols;
  const int na = variant == 6 ? 300 : variant >= 5 ? 4100 : variant == 4 ? 12000 : variant == 3 ? 1000 : 40, ld_a = na;
  const WeightForm q4{DType::U32, 4, 64, DType::BF16}, q8{DType::U32, 8, 64, DType::BF16};
  HostMatrix a = make_matrix(na, cols, variant ? q4 : WeightForm{DType::U32, 4, 32, DType::BF16}, rng);
  HostMatrix b = make_matrix(5, cols, variant >= 3 ? q4 : variant ? q8 : WeightForm{DType::BF16}, rng);
  HostMatrix c = make_matrix(variant >= 3 ? 70 : 7, cols, variant ? q4 : WeightForm{DType::F32}, rng);
  const int nc = static_cast<int>(c.m.rows);
  DeviceArena arena;
  DenseUploader up(&arena);
  std::vector<float> x = randn(rows * ldx, rng);
  DeviceBuffer<float> xd, ya(rows * ld_a), yb(rows * 8), yc(rows * nc);
  CUDA_CHECK(cudaMemset(ya.get(), 0xff, ya.bytes()));  // poison: every output must be written
  GemvJob jobs[3];
  jobs[0].w = *up.matrix(a.m); jobs[0].y = ya.get(); jobs[0].ldy = ld_a; jobs[0].epi = Epilogue::SiluDiv; jobs[0].epi_arg = 3.0f;
  jobs[1].w = *up.matrix(b.m); jobs[1].y = yb.get(); jobs[1].ldy = 8; jobs[1].epi = Epilogue::TwoSigmoidDiv; jobs[1].epi_arg = 4.0f;
  jobs[2].w = *up.matrix(c.m); jobs[2].y = yc.get(); jobs[2].ldy = nc;
  const int64_t streamed_before = gemv_stream_launches();
  gemv(jobs, 3, to_device(x, &xd), ldx, rows, nullptr);
  if (variant == 7) {
    EXPECT_EQ(gemv_stream_launches() - streamed_before, 1);
  }
  const HostMatrix* hm[3] = {&a, &b, &c};
  const DeviceBuffer<float>* yd[3] = {&ya, &yb, &yc};
  for (int j = 0; j < 3; ++j) {
    const int n = static_cast<int>(hm[j]->m.rows), ld = jobs[j].ldy;
    std::vector<float> ref(rows * n), got(rows * n), yh = to_host(yd[j]->get(), rows * ld);
    for (int r = 0; r < rows; ++r) {
      ck::cpu::matvec(hm[j]->m, x.data() + r * ldx, ref.data() + r * n);
      for (int o = 0; o < n; ++o) {
        float& v = ref[r * n + o];
        if (j == 0) v = ck::cpu::silu(v / 3.0f);
        if (j == 1) v = 2.0f * ck::cpu::sigmoid(v / 4.0f);
        got[r * n + o] = yh[r * ld + o];
      }
    }
    report("gemv variant " + std::to_string(variant) + " job " + std::to_string(j) + " with epilogue",
           compare(got, ref, {}, scale_atol(ref), 1e-4));
  }
  }
  set_gemv_stream_min_work(-1);
  set_gemv_version(2);
}

// Prefill chunks through matrices of at most kNarrowRows rows (the shared expert's one-row 8-bit gate,
// a 5-row bf16 matrix): gemm_tc hands them to the v1 GEMV over batches of 8 rows (gemv_narrow_rows),
// which must write every row of an awkward count (a last batch of 5 rows) against the CPU.
TEST(CudaOps, GemmNarrowMatricesOverManyRows) {
  REQUIRE_GPU();
  std::mt19937_64 rng(4242);
  const int cols = 2560;
  const WeightForm q8{DType::U32, 8, 64, DType::BF16};
  HostMatrix a = make_matrix(1, cols, q8, rng), b = make_matrix(5, cols, WeightForm{DType::BF16}, rng);
  DeviceArena arena;
  DenseUploader up(&arena);
  for (int rows : {13, 301}) {
    std::vector<float> x = randn(static_cast<size_t>(rows) * cols, rng);
    DeviceBuffer<float> xd, ya(rows * 4), yb(rows * 8);
    CUDA_CHECK(cudaMemset(ya.get(), 0xff, ya.bytes()));  // poison: every output must be written
    CUDA_CHECK(cudaMemset(yb.get(), 0xff, yb.bytes()));
    GemvJob jobs[2];
    jobs[0].w = *up.matrix(a.m); jobs[0].y = ya.get(); jobs[0].ldy = 4;
    jobs[1].w = *up.matrix(b.m); jobs[1].y = yb.get(); jobs[1].ldy = 8; jobs[1].epi = Epilogue::TwoSigmoidDiv;
    jobs[1].epi_arg = 4.0f;
    ASSERT_TRUE(gemv_narrow_rows(jobs, 2, to_device(x, &xd), cols, rows, nullptr));
    gemm_tc(jobs, 2, xd.get(), cols, rows, nullptr);  // the same through the public entry point
    const HostMatrix* hm[2] = {&a, &b};
    const DeviceBuffer<float>* yd[2] = {&ya, &yb};
    for (int j = 0; j < 2; ++j) {
      const int n = static_cast<int>(hm[j]->m.rows), ld = jobs[j].ldy;
      std::vector<float> ref(static_cast<size_t>(rows) * n), got(ref.size()), yh = to_host(yd[j]->get(), rows * ld);
      for (int r = 0; r < rows; ++r) {
        ck::cpu::matvec(hm[j]->m, x.data() + static_cast<size_t>(r) * cols, ref.data() + static_cast<size_t>(r) * n);
        for (int o = 0; o < n; ++o) {
          float& v = ref[r * n + o];
          if (j == 1) v = 2.0f * ck::cpu::sigmoid(v / 4.0f);
          got[r * n + o] = yh[r * ld + o];
        }
      }
      report("narrow job " + std::to_string(j) + " rows " + std::to_string(rows),
             compare(got, ref, {}, scale_atol(ref), 1e-4));
    }
  }
  // Wider than kNarrowRows, or x misaligned: declined, nothing launched.
  HostMatrix c = make_matrix(kNarrowRows + 1, cols, q8, rng);
  GemvJob wide;
  wide.w = *up.matrix(c.m);
  DeviceBuffer<float> xd(16 * cols), yw(16 * 16);
  wide.y = yw.get();
  wide.ldy = 16;
  EXPECT_FALSE(gemv_narrow_rows(&wide, 1, xd.get(), cols, 16, nullptr));
  GemvJob one;
  one.w = *up.matrix(a.m);
  one.y = yw.get();
  one.ldy = 16;
  EXPECT_FALSE(gemv_narrow_rows(&one, 1, xd.get() + 1, cols, 15, nullptr));
}

// The MoE output of prefill rows (moe_combine: 4 elements a thread where H and the strides allow):
// Σ_t w_t y_t with each product rounded to fp32 and the sum in fp64 in slot order, then + gamma y_k,
// bit for bit against that formula on the host, for k not a multiple of 4 and H not a multiple of the
// block's 1,024 elements. gl = 0 makes gamma = sigmoid(0) = 0.5 exactly on both sides.
TEST(CudaOps, MoeCombineGivesTheSlotOrderBits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(909);
  for (const auto& [H, k, rows] : std::vector<std::tuple<int, int, int>>{{2560, 10, 37}, {264, 3, 5}, {1028, 8, 9}}) {
    const int ldy = H + 4, ldo = H + 8;
    std::vector<float> y = randn(static_cast<size_t>(rows) * (k + 1) * ldy, rng), gl(static_cast<size_t>(rows) * 4, 0.0f);
    std::vector<ExpertPair> pairs(static_cast<size_t>(rows) * (k + 1));
    std::uniform_real_distribution<float> wdist(0.01f, 0.5f);
    for (ExpertPair& p : pairs) p.weight = wdist(rng);
    DeviceBuffer<float> yd, gld, od(static_cast<size_t>(rows) * ldo);
    DeviceBuffer<ExpertPair> pd;
    CUDA_CHECK(cudaMemset(od.get(), 0xff, od.bytes()));
    moe_combine(to_device(y, &yd), ldy, to_device(pairs, &pd), k, to_device(gl, &gld), 4, od.get(), ldo, H, rows,
                nullptr);
    const std::vector<float> got = to_host(od.get(), od.size());
    int differ = 0;
    for (int r = 0; r < rows; ++r)
      for (int i = 0; i < H; ++i) {
        const float* yr = y.data() + static_cast<size_t>(r) * (k + 1) * ldy;
        double acc = 0.0;
        for (int t = 0; t < k; ++t) acc += static_cast<double>(yr[t * ldy + i] * pairs[r * (k + 1) + t].weight);
        const float want = static_cast<float>(acc) + 0.5f * yr[k * ldy + i];
        if (std::memcmp(&want, &got[static_cast<size_t>(r) * ldo + i], 4) != 0) ++differ;
      }
    EXPECT_EQ(differ, 0) << "H " << H << " k " << k << " rows " << rows;
  }
}

// ------------------------------------------------------------------ 16-row weight tiles

// The Tiles16 layout as cuda/dmatrix.h states it, read back element by element on the host (no GPU):
// every code, scale and bias of a packed matrix sits where the comment says.
// The 8-bit router as two 4-bit matrices for the prefill kernels (cuda/weights.h nibble_split): on the
// CPU, Hi x + Lo x equals W x to fp32 rounding, in both scale types; other forms are refused. Host
// code: runs without a GPU.
TEST(CudaOps, NibbleSplitOfEightBitCodesIsExact) {
  std::mt19937_64 rng(808);
  for (DType sd : {DType::BF16, DType::F16})
    for (int group : {64, 128}) {
      HostMatrix w = make_matrix(48, 640, WeightForm{DType::U32, 8, group, sd}, rng);
      NibbleSplit ns;
      ASSERT_TRUE(nibble_split(w.m, &ns));
      ASSERT_EQ(ns.hi.bits, 4);
      ASSERT_EQ(ns.lo.bits, 4);
      std::vector<float> x = randn(640, rng), y(48), yh(48), yl(48);
      ck::cpu::matvec(w.m, x.data(), y.data());
      ck::cpu::matvec(ns.hi, x.data(), yh.data());
      ck::cpu::matvec(ns.lo, x.data(), yl.data());
      double worst = 0, scale = 0;
      for (int r = 0; r < 48; ++r) {
        worst = std::max(worst, std::fabs(static_cast<double>(yh[r]) + yl[r] - y[r]));
        scale = std::max(scale, std::fabs(static_cast<double>(y[r])));
      }
      EXPECT_LE(worst, 1e-5 * scale) << "group " << group;
      // Every code survives: the high and low nibbles put back together.
      for (int64_t i = 0; i < 48 * 640; ++i)
        ASSERT_EQ(get_code(w.m.data, i, 8), 16 * get_code(ns.hi.data, i, 4) + get_code(ns.lo.data, i, 4)) << i;
    }
  NibbleSplit ns;
  EXPECT_FALSE(nibble_split(make_matrix(16, 256, WeightForm{DType::U32, 4, 64, DType::BF16}, rng).m, &ns));
  EXPECT_FALSE(nibble_split(make_matrix(16, 256, WeightForm{DType::BF16}, rng).m, &ns));
}

TEST(CudaOps, TilesHoldEveryCodeScaleAndBiasWhereTheLayoutSays) {
  std::mt19937_64 rng(4242);
  const WeightForm q4{DType::U32, 4, 64, DType::BF16};
  // (The last is large enough for pack_tiles16's threads.)
  for (auto [rows, cols] : {std::pair{16, 256}, std::pair{48, 640}, std::pair{160, 2560}, std::pair{2048, 2560}}) {
    HostMatrix hm = make_matrix(rows, cols, q4, rng);
    ASSERT_TRUE(tiles16_fit(hm.m));
    std::vector<uint8_t> tiles(hm.m.stored_bytes());
    pack_tiles16(hm.m, tiles.data());
    const int groups = cols / 64;
    const auto* sc = reinterpret_cast<const uint16_t*>(hm.m.scales);
    const auto* bi = reinterpret_cast<const uint16_t*>(hm.m.biases);
    int64_t bad = 0;
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) {
        const int T = r / 16, g = r % 8, hi = (r % 16) / 8, G = c / 64, byte = (c % 64) / 2, t = byte / 8;
        const uint8_t* blk = tiles.data() + (static_cast<size_t>(T) * groups + G) * kTileGroupBytes;
        const uint32_t want = get_code(hm.m.data + static_cast<size_t>(r) * cols / 2, c, 4);
        const uint32_t got = get_code(blk + 16 * (4 * g + t) + 8 * hi, (c % 64) % 16, 4);
        uint16_t s_got, b_got;
        std::memcpy(&s_got, blk + 512 + 8 * g + 4 * hi, 2);
        std::memcpy(&b_got, blk + 512 + 8 * g + 4 * hi + 2, 2);
        bad += got != want || s_got != sc[r * groups + G] || b_got != bi[r * groups + G];
      }
    EXPECT_EQ(bad, 0) << rows << "x" << cols;
  }
  // What does not fit stays in rows: 8-bit codes, groups of 32, f16 scales, 24 rows, 128 columns.
  const WeightForm no[] = {{DType::U32, 8, 64, DType::BF16}, {DType::U32, 4, 32, DType::BF16},
                           {DType::U32, 4, 64, DType::F16}};
  for (const WeightForm& f : no) EXPECT_FALSE(tiles16_fit(make_matrix(32, 512, f, rng).m));
  EXPECT_FALSE(tiles16_fit(make_matrix(24, 512, q4, rng).m));
  EXPECT_FALSE(tiles16_fit(make_matrix(32, 128, q4, rng).m));
}

// The CPU's matvec of m over n rows of x (row stride ldx): n x m.rows.
std::vector<float> cpu_rows(const Matrix& m, const std::vector<float>& x, int ldx, int n) {
  std::vector<float> ref(static_cast<size_t>(n) * m.rows);
  for (int r = 0; r < n; ++r)
    ck::cpu::matvec(m, x.data() + static_cast<size_t>(r) * ldx, ref.data() + static_cast<size_t>(r) * m.rows);
  return ref;
}

// n rows of an output (on the host, at ldy) against ref (cpu_rows), with the prefill products'
// tolerance when n > kMaxRows (x in two bf16 parts, ~16 bits).
void report_rows_vs_cpu(const std::string& what, const Matrix& m, const std::vector<float>& x, int ldx, int n,
                        const std::vector<float>& ref, const std::vector<float>& out, int ldy) {
  const int rows = static_cast<int>(m.rows);
  std::vector<float> got(ref.size());
  for (int r = 0; r < n; ++r)
    std::memcpy(got.data() + static_cast<size_t>(r) * rows, out.data() + static_cast<size_t>(r) * ldy,
                sizeof(float) * rows);
  std::vector<double> tol = dot_tolerance(m, x, n, ldx);
  if (n > kMaxRows)
    for (double& t : tol) t *= 32.0;
  report(what, compare(got, ref, tol, 0, 0));
}

// Rows (of n, at ldy) whose first `width` outputs differ in any bit between two host copies.
int64_t rows_with_different_bits(const std::vector<float>& a, const std::vector<float>& b, int n, int ldy, int width) {
  int64_t diff = 0;
  for (int r = 0; r < n; ++r)
    diff += std::memcmp(a.data() + static_cast<size_t>(r) * ldy, b.data() + static_cast<size_t>(r) * ldy,
                        sizeof(float) * width) != 0;
  return diff;
}

// One job's output (n rows of x, at ldy on the device) against the CPU's matvec of its matrix.
void report_job_vs_cpu(const std::string& what, const Matrix& m, const std::vector<float>& x, int K, int n,
                       const float* y, int ldy) {
  report_rows_vs_cpu(what, m, x, K, n, cpu_rows(m, x, K, n), to_host(y, static_cast<size_t>(n) * ldy), ldy);
}

// The same matrices in the row layout and in 16-row tiles through every kernel that reads tiles: the
// v4 GEMVs at 1-8 rows (the one-row kernel with K over a cluster; the two-kernel form, whose epilogue
// also runs the DeltaNet conv) and both prefill kernels. Where the row layout takes the same kernel the
// outputs must be the same bits (the same arithmetic in the same order); small shapes, which the row
// layout sends to other kernels, are checked against the CPU.
TEST(CudaOps, TiledWeightsGiveTheRowLayoutsBits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(99);
  const WeightForm q4{DType::U32, 4, 64, DType::BF16};
  struct Case {
    int rows, cols;
  };
  const Case cases[] = {{4160, 2560}, {2560, 6144}, {1024, 1024}, {48, 256}, {320, 10240}};
  // Whether the row layout takes the same kernel as the tiles (gemv_tc4.cu's gemv_tc4): at one row the
  // in-warp kernel up to 16,384 tile-groups, else from 4,096 rows (with CK_GEMV_BLOCK_ROWS, 2-8 rows
  // take gemv_tc4_rows_kernel up to 16,384 tile-groups, whatever the size, so below 1,024 x 1,024 both
  // layouts take it and are held to the CPU here); at 2-8 rows from 1,024 x 1,024;
  // over kMaxRows gemm_q4, where it has blocks enough (not at 48 rows).
  auto same_path = [](const Case& c, int n) {
    // (Past 16,384 tile-groups at one row the tiles take gemv_tc4_pair_kernel, whose sums round
    // differently: InProjGemvConvolvesInItsEpilogue checks it. No case here is that large.)
    if (n == 1) return (c.rows / 16) * (c.cols / 64) <= 16384;
    if (n <= kMaxRows) return c.rows >= 1024 && c.cols >= 1024;
    return c.rows >= 1024;
  };
  DeviceArena arena;
  for (const Case& c : cases) {
    HostMatrix hm = make_matrix(c.rows, c.cols, q4, rng);
    DenseUploader up(&arena);
    const DMatrix rows_m = *up.matrix(hm.m), tiled_m = *up.matrix(hm.m, WLayout::Tiles16);
    ASSERT_FALSE(rows_m.tiled());
    ASSERT_TRUE(tiled_m.tiled());
    for (int n : {1, 2, 4, 5, 8, 70, 800}) {
      const int ldx = c.cols + 4, ldy = c.rows + 3;
      std::vector<float> x = randn(static_cast<size_t>(n) * ldx, rng);
      DeviceBuffer<float> xd;
      to_device(x, &xd);
      // Prefill (n > 8): both kernels, each for both layouts (with tiles, the warpgroup kernel's bulk-
      // copy form: gemm_q4_wg.h, in its 64-token form, whose blocks and K split are the cp.async
      // kernel's; WideWarpgroupTilesMatchCpu checks the other); at 800 rows the warpgroup kernels with
      // x in three parts too.
      set_q4_wg_wide(0);
      for (int form : {0, 1, 2}) {
        const int wg = form > 0, parts = form == 2 ? 3 : 2;
        if ((n <= kMaxRows && wg) || (parts == 3 && n != 800)) continue;
        set_q4_wg_min_rows(wg ? 1 : 1 << 30);
        set_prefill_parts(parts);
        std::vector<float> out[2];
        for (int lay = 0; lay < 2; ++lay) {
          DeviceBuffer<float> yd(static_cast<size_t>(n) * ldy);
          matvec(lay ? tiled_m : rows_m, xd.get(), ldx, yd.get(), ldy, n, nullptr);
          out[lay] = to_host(yd.get(), static_cast<size_t>(n) * ldy);
        }
        const std::string what = "tiles " + std::to_string(c.rows) + "x" + std::to_string(c.cols) + " rows " +
                                 std::to_string(n) + (n > kMaxRows ? (wg ? " wgmma" : " q4_tile") : "") +
                                 (parts == 3 ? " 3 parts" : "");
        if (same_path(c, n)) {
          const int64_t diff = rows_with_different_bits(out[0], out[1], n, ldy, c.rows);
          std::printf("  %-58s %s\n", what.c_str(), diff ? "DIFFERENT BITS" : "same bits");
          EXPECT_EQ(diff, 0) << what;
        } else {  // the tiles' kernels against the CPU (the rows took v3, or gemm.cu's)
          report_rows_vs_cpu(what, hm.m, x, ldx, n, cpu_rows(hm.m, x, ldx, n), out[1], ldy);
        }
      }
      set_prefill_parts(-1);
    }
  }
  set_q4_wg_min_rows(-1);
  set_q4_wg_wide(-1);
  // A tiled job in one call with jobs the tiles' kernels do not take (a bf16 matrix, 8-bit codes):
  // gemv and gemm_tc split the call, each job against the CPU.
  HostMatrix a = make_matrix(2048, 2560, q4, rng), b = make_matrix(5, 2560, WeightForm{DType::BF16}, rng),
             c = make_matrix(64, 2560, WeightForm{DType::U32, 8, 64, DType::BF16}, rng);
  DenseUploader up(&arena);
  const HostMatrix* hm[3] = {&a, &b, &c};
  GemvJob jobs[3];
  jobs[0].w = *up.matrix(a.m, WLayout::Tiles16);
  jobs[1].w = *up.matrix(b.m, WLayout::Tiles16);  // does not fit tiles: stays in rows
  jobs[2].w = *up.matrix(c.m, WLayout::Tiles16);
  ASSERT_TRUE(jobs[0].w.tiled() && !jobs[1].w.tiled() && !jobs[2].w.tiled());
  for (int n : {1, 4, 70}) {
    std::vector<float> x = randn(static_cast<size_t>(n) * 2560, rng);
    DeviceBuffer<float> xd, yd[3];
    for (int j = 0; j < 3; ++j) {
      yd[j].resize(static_cast<size_t>(n) * hm[j]->m.rows);
      jobs[j].y = yd[j].get();
      jobs[j].ldy = static_cast<int>(hm[j]->m.rows);
    }
    gemv(jobs, 3, to_device(x, &xd), 2560, n, nullptr);
    for (int j = 0; j < 3; ++j)
      report_job_vs_cpu("tiles beside other formats, job " + std::to_string(j) + " rows " + std::to_string(n),
                        hm[j]->m, x, 2560, n, yd[j].get(), jobs[j].ldy);
  }
}

// tc4_make_frags (the kernel lab's stand-in for a producer) hands a GEMV the bits of its own fragment
// kernel: a tiled in_proj-sized matrix at one row (gemv_tc4_pair_kernel, compact fragments) and at 3
// rows (gemv_tc4_kernel<4>, the R-row layout).
TEST(CudaOps, MadeFragmentsGiveTheGemvsOwnBits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(41);
  const int out = 10240, cols = 2560, groups = cols / 64;
  HostMatrix hm = make_matrix(out, cols, WeightForm{DType::U32, 4, 64, DType::BF16}, rng);
  DeviceArena arena;
  DenseUploader up(&arena);
  GemvJob job;
  job.w = *up.matrix(hm.m, WLayout::Tiles16);
  job.ldy = out;
  ASSERT_TRUE(job.w.tiled());
  DeviceBuffer<uint2> frag(static_cast<size_t>(groups) * tc4_rows_frag_words(kMaxRows));
  DeviceBuffer<float> gsum(static_cast<size_t>(groups) * tc4_rows_gsum_floats(kMaxRows));
  for (int n : {1, 3}) {
    const std::vector<float> x = randn(static_cast<size_t>(n) * cols, rng);
    DeviceBuffer<float> xd, y[2];
    to_device(x, &xd);
    std::vector<float> got[2];
    for (int made : {0, 1}) {
      y[made].resize(static_cast<size_t>(n) * out);
      job.y = y[made].get();
      Tc4Frags pre;
      if (made) tc4_make_frags(xd.get(), cols, n, groups, frag.get(), gsum.get(), &pre, nullptr);
      gemv(&job, 1, xd.get(), cols, n, nullptr, made ? &pre : nullptr);
      got[made] = to_host(y[made].get(), y[made].size());
    }
    EXPECT_EQ(0, std::memcmp(got[0].data(), got[1].data(), got[0].size() * sizeof(float))) << n << " rows";
    report_job_vs_cpu("made fragments, " + std::to_string(n) + " rows", hm.m, x, cols, n, y[1].get(), out);
  }
}

// Fragments made by the producer of a 2-8-row GEMV's input (cuda/ops.h Tc4Frags::rfrag) give the bits
// of the GEMV's own fragment kernel: the mix's down projection handing d on from its reduce
// (GemvJob::frags_out, the hyper-connection's shapes: 320 + 16 rows, K = 10,240, split over blocks),
// and the gate mean handing u on (hc_gate_mean with rfrag) to a 2-8-row projection of u.
TEST(CudaOps, ProducerFragmentsGiveTheFragmentKernelsBits) {
  REQUIRE_GPU();
  std::mt19937_64 rng(77);
  const WeightForm q4{DType::U32, 4, 64, DType::BF16};
  const int lowrank = 320, W = 10240, S = 4, H = W / S, proj_rows = 8192;  // (8,192: one row takes launch_tc4<1>)
  HostMatrix down = make_matrix(lowrank, W, q4, rng), inject = make_matrix(16, W, q4, rng),
             upm = make_matrix(W, lowrank, q4, rng), proj = make_matrix(proj_rows, H, q4, rng);
  DeviceArena arena;
  DenseUploader up(&arena);
  const DMatrix down_t = *up.matrix(down.m, WLayout::Tiles16), inject_t = *up.matrix(inject.m, WLayout::Tiles16),
                up_t = *up.matrix(upm.m, WLayout::Tiles16), proj_t = *up.matrix(proj.m, WLayout::Tiles16);
  const int d_groups = lowrank / 64, u_groups = H / 64;
  DeviceBuffer<uint2> dfrag(static_cast<size_t>(d_groups) * tc4_rows_frag_words(kMaxRows)),
      ufrag(static_cast<size_t>(kMaxRows) * u_groups * kOneFragWords),
      urfrag(static_cast<size_t>(u_groups) * tc4_rows_frag_words(kMaxRows));
  DeviceBuffer<float> dgsum(static_cast<size_t>(d_groups) * tc4_rows_gsum_floats(kMaxRows)),
      ugsum(static_cast<size_t>(kMaxRows) * u_groups), urgsum(static_cast<size_t>(u_groups) * tc4_rows_gsum_floats(kMaxRows));
  for (int n : {2, 3, 4, 6, 8}) {
    SCOPED_TRACE("rows " + std::to_string(n));
    const std::vector<float> x = randn(static_cast<size_t>(n) * W, rng), gv = randn(static_cast<size_t>(n) * W, rng);
    DeviceBuffer<float> xd, gd, dd(static_cast<size_t>(n) * lowrank), wd(static_cast<size_t>(n) * 16), ud(static_cast<size_t>(n) * H);
    to_device(x, &xd);
    to_device(gv, &gd);
    // d = silu(down x / S), with the injection head beside it, as the mix runs it.
    Tc4Frags dfr;
    dfr.rfrag = dfrag.get();
    dfr.rgsum = dgsum.get();
    GemvJob jobs[2];
    jobs[0].w = down_t; jobs[0].y = dd.get(); jobs[0].ldy = lowrank; jobs[0].epi = Epilogue::SiluDiv; jobs[0].epi_arg = S;
    jobs[0].frags_out = &dfr;
    jobs[1].w = inject_t; jobs[1].y = wd.get(); jobs[1].ldy = 16; jobs[1].epi = Epilogue::TwoSigmoidDiv; jobs[1].epi_arg = S;
    gemv(jobs, 2, xd.get(), W, n, nullptr);
    if (n <= gemv_block_rows()) {
      // gemv_tc4_rows_kernel: its blocks make their own fragments
      ASSERT_EQ(dfr.rR, 0) << "d's fragments reported, but gemv_tc4_rows_kernel writes none";
    } else {
      ASSERT_EQ(dfr.rR, tc4_rows_R(n)) << "the down projection's reduce did not write d's fragments";
      ASSERT_TRUE(dfr.covers_rows(dd.get(), lowrank, n, d_groups, tc4_rows_R(n)));
    }
    const std::vector<float> d_made = to_host(dd.get(), static_cast<size_t>(n) * lowrank);
    jobs[0].frags_out = nullptr;
    gemv(jobs, 2, xd.get(), W, n, nullptr);
    EXPECT_EQ(rows_with_different_bits(d_made, to_host(dd.get(), static_cast<size_t>(n) * lowrank), n, lowrank, lowrank), 0)
        << "d with and without its fragments";
    std::vector<float> g_out[2];
    for (int pre : {0, 1}) {
      DeviceBuffer<float> yd(static_cast<size_t>(n) * W);
      CUDA_CHECK(cudaMemset(yd.get(), 0xff, yd.bytes()));
      GemvJob j;
      j.w = up_t; j.y = yd.get(); j.ldy = W;
      gemv(&j, 1, dd.get(), lowrank, n, nullptr, pre ? &dfr : nullptr);
      g_out[pre] = to_host(yd.get(), static_cast<size_t>(n) * W);
    }
    EXPECT_EQ(rows_with_different_bits(g_out[0], g_out[1], n, W, W), 0) << "the up projection with d's fragments";
    report_rows_vs_cpu("up projection of d, rows " + std::to_string(n), upm.m, d_made, lowrank, n,
                       cpu_rows(upm.m, d_made, lowrank, n), g_out[1], W);
    // u = the gate mean, with its R-row fragments, then a 2-8-row projection of u.
    hc_gate_mean(gd.get(), xd.get(), W, S, H, ud.get(), H, n, nullptr, ufrag.get(), ugsum.get(), urfrag.get(), urgsum.get());
    const std::vector<float> u_made = to_host(ud.get(), static_cast<size_t>(n) * H);
    hc_gate_mean(gd.get(), xd.get(), W, S, H, ud.get(), H, n, nullptr);
    EXPECT_EQ(rows_with_different_bits(u_made, to_host(ud.get(), static_cast<size_t>(n) * H), n, H, H), 0)
        << "u with and without its fragments";
    const Tc4Frags ufr{ud.get(), H, n, u_groups, ufrag.get(), ugsum.get(), urfrag.get(), urgsum.get(), tc4_rows_R(n)};
    std::vector<float> p_out[2];
    for (int pre : {0, 1}) {
      DeviceBuffer<float> yd(static_cast<size_t>(n) * proj_rows);
      GemvJob j;
      j.w = proj_t; j.y = yd.get(); j.ldy = proj_rows;
      gemv(&j, 1, ud.get(), H, n, nullptr, pre ? &ufr : nullptr);
      p_out[pre] = to_host(yd.get(), static_cast<size_t>(n) * proj_rows);
    }
    EXPECT_EQ(rows_with_different_bits(p_out[0], p_out[1], n, proj_rows, proj_rows), 0) << "a projection of u with u's fragments";
    // The one-row layout the gate mean wrote beside it: each row's projection from it, bit for bit.
    for (int r = 0; r < n; ++r) {
      const Tc4Frags one{ud.get() + static_cast<size_t>(r) * H, H, 1, u_groups, ufrag.get() + static_cast<size_t>(r) * u_groups * kOneFragWords,
                         ugsum.get() + static_cast<size_t>(r) * u_groups};
      std::vector<float> o[2];
      for (int pre : {0, 1}) {
        DeviceBuffer<float> yd(proj_rows);
        GemvJob j;
        j.w = proj_t; j.y = yd.get(); j.ldy = proj_rows;
        gemv(&j, 1, ud.get() + static_cast<size_t>(r) * H, H, 1, nullptr, pre ? &one : nullptr);
        o[pre] = to_host(yd.get(), proj_rows);
      }
      EXPECT_EQ(rows_with_different_bits(o[0], o[1], 1, proj_rows, proj_rows), 0) << "row " << r << " from the compact layout";
    }
  }
}

// gemv_tc4_rows_kernel (set_gemv_block_rows(8)): 2-8 rows of the decode step's small and middle-sized
// 4-bit shapes (the mix's down projection with its injection head and their epilogues, its up
// projection, the DeltaNet out projection, a short untiled matrix), tiles and rows, against the CPU;
// and each row the bits of the one-row kernel on that row alone, since row 2c + 1's three parts take
// MMA columns 3-5 of set c's MMAs, row 2c's columns 0-2, each bias term added as row 0's is.
TEST(CudaOps, FewRowGemvGivesTheOneRowBits) {
  REQUIRE_GPU();
  init_kernels();  // (gemv_tc4_rows_kernel's 20 groups a block at 5-8 rows: the mix's down projection)
  std::mt19937_64 rng(78);
  const WeightForm q4{DType::U32, 4, 64, DType::BF16};
  struct Case {
    int rows, cols, rows2;  // rows2 > 0: a second job beside it (the injection head), K the same
    bool tiles;
  };
  const Case cases[] = {{320, 10240, 16, true}, {320, 10240, 4, false}, {10240, 320, 0, true},
                        {2560, 6144, 0, true},  {2560, 6144, 0, false}, {48, 256, 0, false}};
  set_gemv_block_rows(kMaxRows);
  DeviceArena arena;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.rows << "x" << c.cols << (c.tiles ? " tiles" : " rows"));
    HostMatrix a = make_matrix(c.rows, c.cols, q4, rng), b = make_matrix(std::max(1, c.rows2), c.cols, q4, rng);
    DenseUploader up(&arena);
    const WLayout lay = c.tiles ? WLayout::Tiles16 : WLayout::Rows;
    const DMatrix am = *up.matrix(a.m, lay), bm = *up.matrix(b.m);
    const int ldx = c.cols + 4, n_jobs = c.rows2 > 0 ? 2 : 1;
    const std::vector<float> x = randn(static_cast<size_t>(kMaxRows) * ldx, rng);
    DeviceBuffer<float> xd;
    to_device(x, &xd);
    auto run = [&](const float* xp, int n, std::vector<float>* ya, std::vector<float>* yb) {
      DeviceBuffer<float> da(static_cast<size_t>(n) * c.rows), db(static_cast<size_t>(n) * std::max(1, c.rows2));
      GemvJob jobs[2];
      jobs[0].w = am; jobs[0].y = da.get(); jobs[0].ldy = c.rows;
      if (n_jobs == 2) {  // the mix's epilogues: silu(y / S), 2 sigmoid(y / S)
        jobs[0].epi = Epilogue::SiluDiv; jobs[0].epi_arg = 4.0f;
        jobs[1].w = bm; jobs[1].y = db.get(); jobs[1].ldy = c.rows2;
        jobs[1].epi = Epilogue::TwoSigmoidDiv; jobs[1].epi_arg = 4.0f;
      }
      gemv(jobs, n_jobs, xp, ldx, n, nullptr);
      *ya = to_host(da.get(), static_cast<size_t>(n) * c.rows);
      if (n_jobs == 2) *yb = to_host(db.get(), static_cast<size_t>(n) * c.rows2);
    };
    for (int n = 2; n <= kMaxRows; ++n) {
      SCOPED_TRACE(::testing::Message() << n << " rows");
      std::vector<float> ya2, yb2;
      run(xd.get(), n, &ya2, &yb2);
      if (n_jobs == 1) report_rows_vs_cpu(std::to_string(n) + "-row gemv", a.m, x, ldx, n, cpu_rows(a.m, x, ldx, n), ya2, c.rows);
      for (int r = 0; r < n; ++r) {
        std::vector<float> ya1, yb1;
        run(xd.get() + static_cast<size_t>(r) * ldx, 1, &ya1, &yb1);
        EXPECT_EQ(0, std::memcmp(ya1.data(), ya2.data() + static_cast<size_t>(r) * c.rows, sizeof(float) * c.rows))
            << "row " << r << ": not the one-row kernel's bits";
        if (n_jobs == 2) {
          EXPECT_EQ(0, std::memcmp(yb1.data(), yb2.data() + static_cast<size_t>(r) * c.rows2, sizeof(float) * c.rows2))
              << "row " << r << ", second job: not the one-row kernel's bits";
        }
      }
    }
  }
  set_gemv_block_rows(-1);
}

// The gate mean's four-at-a-time sigmoid (common.h sigmoid4_) against sigmoidf_ on every float.
TEST(CudaOps, SigmoidFourGivesTheLibraryBits) {
  REQUIRE_GPU();
  EXPECT_EQ(sigmoid4_mismatches(), 0);
}

// The prefill mix's up projection with the gate mean as its epilogue (hc_up_gate_mean: clusters of S
// blocks, g never written) against the two calls it replaces, gemv(up) and hc_gate_mean: the same bits
// of u. Shapes: the released geometry, and small ones whose last feature block has idle warpgroups
// (H / 64 not a multiple of 3), with 2 and 8 streams and a shorter K; row counts with a partial last
// tile of 128 tokens.
TEST(CudaOps, UpGateMeanGivesTheUnfusedBits) {
  REQUIRE_GPU();
  init_kernels();
  std::mt19937_64 rng(41);
  const WeightForm q4{DType::U32, 4, 64, DType::BF16};
  struct Case {
    int S, H, lowrank, rows;
  };
  const Case cases[] = {{4, 2560, 320, 300}, {4, 2560, 320, 2048}, {2, 448, 256, 700}, {8, 128, 320, 257},
                        {4, 1024, 256, 1000}, {2, 1600, 320, 300}};
  for (const Case& c : cases) {
    SCOPED_TRACE("S " + std::to_string(c.S) + ", H " + std::to_string(c.H) + ", rows " + std::to_string(c.rows));
    const int W = c.S * c.H, n = c.rows;
    HostMatrix upm = make_matrix(W, c.lowrank, q4, rng);
    DeviceArena arena;
    DenseUploader upl(&arena);
    GemvJob up;
    up.w = *upl.matrix(upm.m, WLayout::Tiles16);
    ASSERT_TRUE(up.w.tiled());
    const std::vector<float> d = randn(static_cast<size_t>(n) * c.lowrank, rng), X = randn(static_cast<size_t>(n) * W, rng);
    DeviceBuffer<float> dd, xd, gd(static_cast<size_t>(n) * W), ud(static_cast<size_t>(n) * c.H);
    to_device(d, &dd);
    to_device(X, &xd);
    up.y = gd.get();
    up.ldy = W;
    // The unfused calls, the one-tile fused blocks and (where it applies) the persistent fused form.
    std::vector<float> u[3];
    set_hc_gm_persistent(1);
    const bool persistent = hc_gm_persistent_applies(up, n, c.S);
    set_hc_gm_persistent(-1);
    if (W >= 2048) {
      EXPECT_TRUE(persistent) << "the fp16 form's shapes take the persistent kernel";
    }
    for (int fused : {0, 1, 2}) {
      CUDA_CHECK(cudaMemset(ud.get(), 0xff, ud.bytes()));
      if (fused == 2 && !persistent) {
        u[2] = u[1];
        continue;
      }
      if (fused) {
        set_hc_gm_persistent(fused == 2 ? 1 : 0);
        ASSERT_TRUE(hc_up_gate_mean(up, dd.get(), c.lowrank, n, xd.get(), W, c.S, c.H, ud.get(), c.H, nullptr))
            << "the fused kernel did not take the call";
        set_hc_gm_persistent(-1);
      } else {
        gemv(&up, 1, dd.get(), c.lowrank, n, nullptr);
        hc_gate_mean(gd.get(), xd.get(), W, c.S, c.H, ud.get(), c.H, n, nullptr);
      }
      CUDA_CHECK(cudaDeviceSynchronize());
      u[fused] = to_host(ud.get(), static_cast<size_t>(n) * c.H);
    }
    const int64_t diff = rows_with_different_bits(u[0], u[1], n, c.H, c.H);
    const int64_t diff_p = rows_with_different_bits(u[0], u[2], n, c.H, c.H);
    std::printf("  up + gate mean, S %d, H %d, K %d, %d rows: %lld rows differ, persistent form%s: %lld\n", c.S,
                c.H, c.lowrank, n, static_cast<long long>(diff), persistent ? "" : " (not taken)",
                static_cast<long long>(diff_p));
    EXPECT_EQ(diff, 0);
    EXPECT_EQ(diff_p, 0) << "the persistent form";
    double mag = 0.0;
    for (float v : u[1]) mag = std::max(mag, std::fabs(static_cast<double>(v)));
    EXPECT_GT(mag, 1e-3) << "u is not all zeros";
    EXPECT_TRUE(std::isfinite(mag));
  }
  set_hc_up_gate_mean(0);
  GemvJob none;
  EXPECT_FALSE(hc_up_gate_mean(none, nullptr, 0, 300, nullptr, 0, 4, 2560, nullptr, 0, nullptr)) << "switched off";
  set_hc_up_gate_mean(-1);
}

// The bulk-copy warpgroup kernel with 128 tokens x 64 features per warpgroup (set_q4_wg_wide): tiled
// matrices of assorted heights (a 64-feature unit left idle, a partial one) and K (a split K), at 2
// and 3 parts of x, against the CPU. (Its split-K choice may differ from the 64-token kernels', so its
// sums need not have their bits.) Its activations split by the 8-row kernel and row by row: the same
// bits.
TEST(CudaOps, WideWarpgroupTilesMatchCpu) {
  REQUIRE_GPU();
  std::mt19937_64 rng(321);
  const WeightForm q4{DType::U32, 4, 64, DType::BF16};
  struct Case {
    int rows, cols;
  };
  const Case cases[] = {{4160, 2560}, {2560, 6144}, {48, 256}, {320, 10240}};
  DeviceArena arena;
  set_q4_wg_min_rows(1);
  set_q4_wg_wide(1);
  for (const Case& c : cases) {
    HostMatrix hm = make_matrix(c.rows, c.cols, q4, rng);
    DenseUploader up(&arena);
    const DMatrix tiled_m = *up.matrix(hm.m, WLayout::Tiles16);
    ASSERT_TRUE(tiled_m.tiled());
    for (int n : {70, 200}) {
      const int ldx = c.cols + 4, ldy = c.rows + 3;
      std::vector<float> x = randn(static_cast<size_t>(n) * ldx, rng);
      DeviceBuffer<float> xd;
      to_device(x, &xd);
      const std::vector<float> ref = cpu_rows(hm.m, x, ldx, n);
      // Parts of x; 4: two parts in the folded form (set_q4_wg_fold(1)), 5: the same with three
      // warpgroups a block (set_q4_wg_fold(3)), 6: that in fp16 (set_q4_wg_f16(1)), 7: fp16 with four
      // warpgroups a block (set_q4_wg_f16(4)).
      for (int variant : {2, 3, 4, 5, 6, 7}) {
        const int parts = variant == 3 ? 3 : 2;
        set_prefill_parts(parts);
        set_q4_wg_fold(variant == 4 ? 1 : variant >= 5 ? 3 : 0);
        set_q4_wg_f16(variant == 6 ? 1 : variant == 7 ? 4 : 0);
        const std::string what = "wide tiles " + std::to_string(c.rows) + "x" + std::to_string(c.cols) + " rows " +
                                 std::to_string(n) + " parts " + std::to_string(parts) +
                                 (variant == 4   ? " folded"
                                  : variant == 5 ? " folded, 3 warpgroups"
                                  : variant == 6 ? " folded, 3 warpgroups, fp16"
                                  : variant == 7 ? " folded, 4 warpgroups, fp16"
                                                 : "");
        std::vector<float> out[2];
        for (int tiles8 : {1, 0}) {  // the activations split by the 8-row kernel, then row by row
          set_xfrag_tiles8(tiles8);
          DeviceBuffer<float> yd(static_cast<size_t>(n) * ldy);
          matvec(tiled_m, xd.get(), ldx, yd.get(), ldy, n, nullptr);
          out[tiles8] = to_host(yd.get(), static_cast<size_t>(n) * ldy);
        }
        report_rows_vs_cpu(what, hm.m, x, ldx, n, ref, out[1], ldy);
        EXPECT_EQ(rows_with_different_bits(out[0], out[1], n, ldy, c.rows), 0)
            << what << ": the two activation splits give different bits";
      }
    }
  }
  set_prefill_parts(-1);
  set_xfrag_tiles8(-1);
  set_q4_wg_fold(-1);
  set_q4_wg_f16(-1);
  set_q4_wg_wide(-1);
  set_q4_wg_min_rows(-1);
}

// The folded form's fp16 arithmetic (gemm_q4_wg.cu "The fp16 form") scales each row of x by a power of
// two before its fp16 parts: rows of every magnitude must come out as the CPU's, within the same
// tolerance as the bf16 form (relative to Σ|w x|). Rows of ~1, 1e-30, 1e30, zeros, fp32 subnormals, one
// spike of 1e20 among ~1, and values near fp16's 65504 and 2^-24 unscaled. Both activation splits give
// the same bits. A matrix with a scale outside [2^-17, 2^12] is not f16_exact and keeps the bf16 form
// (the same bits as with the fp16 form switched off).
TEST(CudaOps, FoldedFp16FormKeepsRowsOfAnyMagnitude) {
  REQUIRE_GPU();
  std::mt19937_64 rng(777);
  const WeightForm q4{DType::U32, 4, 64, DType::BF16};
  DeviceArena arena;
  set_q4_wg_min_rows(1);
  set_q4_wg_wide(1);
  set_q4_wg_fold(3);
  set_prefill_parts(2);
  for (int out_of_range : {0, 1}) {
    HostMatrix hm = make_matrix(320, 2560, q4, rng);
    if (out_of_range) {  // one group's scale below 2^-17: s (q - 8) would lose bits in fp16
      const uint16_t tiny = f32_to_bf16(0x1p-20f);
      std::memcpy(hm.scales.data() + 2 * 17, &tiny, 2);
    }
    DenseUploader up(&arena);
    const DMatrix dm = *up.matrix(hm.m, WLayout::Tiles16);
    ASSERT_TRUE(dm.tiled());
    EXPECT_EQ(dm.fmt.f16_exact, out_of_range ? 0 : 1);
    const int n = 200, ldx = 2560 + 4, ldy = 320 + 3;
    std::vector<float> x = randn(static_cast<size_t>(n) * ldx, rng);
    const float factors[] = {1.0f, 1e-30f, 1e30f, 0.0f, 1e-41f, 1.0f, 3e4f, 1e-7f};
    for (int r = 0; r < n; ++r) {
      float* xr = x.data() + static_cast<size_t>(r) * ldx;
      const int kind = r % 8;
      for (int c = 0; c < 2560; ++c) xr[c] *= factors[kind];
      if (kind == 5) xr[(r * 37) % 2560] = 1e20f;  // one spike
    }
    DeviceBuffer<float> xd;
    to_device(x, &xd);
    const std::vector<float> ref = cpu_rows(hm.m, x, ldx, n);
    std::vector<float> out[4];  // fp16 form with the 8-row split, row by row; the bf16 form; fp16, 4 warpgroups
    for (int v = 0; v < 4; ++v) {
      set_q4_wg_f16(v < 2 ? 1 : v == 3 ? 4 : 0);
      set_xfrag_tiles8(v == 1 ? 0 : 1);
      DeviceBuffer<float> yd(static_cast<size_t>(n) * ldy);
      matvec(dm, xd.get(), ldx, yd.get(), ldy, n, nullptr);
      out[v] = to_host(yd.get(), static_cast<size_t>(n) * ldy);
      const std::string what = std::string(out_of_range ? "scale out of range, " : "") +
                               (v == 3   ? "fp16 form, 4 warpgroups"
                                : v == 2 ? "bf16 form"
                                : v == 1 ? "fp16 form, row-by-row split"
                                         : "fp16 form");
      report_rows_vs_cpu("rows of any magnitude, " + what, hm.m, x, ldx, n, ref, out[v], ldy);
      for (int r = 0; r < n; ++r)
        for (int f = 0; f < 320; ++f) {
          const float y = out[v][static_cast<size_t>(r) * ldy + f];
          ASSERT_TRUE(std::isfinite(y)) << what << ": row " << r << " feature " << f;
          if (r % 8 == 3) {
            ASSERT_EQ(y, 0.0f) << what << ": a zero row gives " << y;
          }
        }
    }
    EXPECT_EQ(rows_with_different_bits(out[0], out[1], n, ldy, 320), 0) << "the two splits differ";
    if (out_of_range)
      EXPECT_EQ(rows_with_different_bits(out[0], out[2], n, ldy, 320), 0) << "not f16_exact: the bf16 form's bits";
    else
      EXPECT_GT(rows_with_different_bits(out[0], out[2], n, ldy, 320), 0) << "the fp16 form did not run";
  }
  set_prefill_parts(-1);
  set_xfrag_tiles8(-1);
  set_q4_wg_fold(-1);
  set_q4_wg_f16(-1);
  set_q4_wg_wide(-1);
  set_q4_wg_min_rows(-1);
}

// Prefill jobs of assorted heights in one warpgroup-MMA call (gemm_q4_wg.cu): consecutive 128-feature
// units share a block whatever their jobs (the mix's 320-row down projection and its 4-row injection
// head take two blocks), so one block's two warpgroups may read matrices of different layouts (tiles
// beside rows: the 4-, 200- and 130-row matrices do not fit tiles) and scale types (f16 beside bf16).
// Every job against the CPU, in the row layout, with tiles where they fit and with the short ones padded
// into tiles, with and without the f16-scaled job in the call.
TEST(CudaOps, PrefillJobsShareWarpgroupBlocks) {
  REQUIRE_GPU();
  std::mt19937_64 rng(123);
  const WeightForm q4{DType::U32, 4, 64, DType::BF16}, q4f16{DType::U32, 4, 64, DType::F16};
  const int K = 2560, n = 800;
  static_assert(kMaxGemvJobs >= 4, "four jobs per call below");
  std::vector<HostMatrix> hm;
  for (int h : {320, 4, 48, 200, 130}) hm.push_back(make_matrix(h, K, q4, rng));
  hm.push_back(make_matrix(96, K, q4f16, rng));
  const std::vector<int> calls[] = {{0, 1, 2, 3}, {0, 1, 5, 4}, {1, 4, 0}};  // (the second with the f16 job)
  std::vector<float> x = randn(static_cast<size_t>(n) * K, rng);
  DeviceBuffer<float> xd;
  to_device(x, &xd);
  DeviceArena arena;
  set_q4_wg_min_rows(1);
  // lay 0: rows; 1: tiles where they fit; 2: the others padded into tiles too (padded_tiles, as the
  // mix's injection head: the call then runs on the bulk-copy kernel), but the f16-scaled job.
  for (int lay = 0; lay < 3; ++lay)
    for (const std::vector<int>& call : calls) {
      DenseUploader up(&arena);
      const int n_jobs = static_cast<int>(call.size());
      GemvJob jobs[kMaxGemvJobs];
      DeviceBuffer<float> yd[kMaxGemvJobs];
      for (int j = 0; j < n_jobs; ++j) {
        const Matrix& m = hm[call[j]].m;
        jobs[j].w = *up.matrix(m, lay ? WLayout::Tiles16 : WLayout::Rows);
        if (lay == 2 && !jobs[j].w.tiled()) {
          const DMatrix padded = *up.padded_tiles(m);
          if (m.scale_dtype == DType::BF16) {
            ASSERT_TRUE(padded.tiled() && padded.rows == m.rows);
            jobs[j].w = padded;
          }
        }
        yd[j].resize(static_cast<size_t>(n) * (m.rows + 1));
        jobs[j].y = yd[j].get();
        jobs[j].ldy = static_cast<int>(m.rows) + 1;
      }
      gemv(jobs, n_jobs, xd.get(), K, n, nullptr);
      for (int j = 0; j < n_jobs; ++j) {
        const Matrix& m = hm[call[j]].m;
        report_job_vs_cpu(std::string(lay == 2 ? "padded tiles" : lay ? "tiles" : "rows") + ", job " + std::to_string(j) + " of " +
                              std::to_string(n_jobs) + " (" + std::to_string(m.rows) + " rows" +
                              (m.scale_dtype == DType::F16 ? ", f16 scales)" : ")"),
                          m, x, K, n, yd[j].get(), jobs[j].ldy);
      }
    }
  set_q4_wg_min_rows(-1);
}

// ------------------------------------------------------------------ experts through pair views

// The CPU's expert product for one input row: h = silu(gate · x) * (up · x) (inter), y = down · h (H).
void cpu_expert(const Matrix& gate, const Matrix& up, const Matrix& down, const float* x, std::vector<float>* h,
                std::vector<float>* y) {
  const int inter = static_cast<int>(gate.rows);
  std::vector<float> u(inter);
  h->assign(inter, 0.0f);
  y->assign(down.rows, 0.0f);
  ck::cpu::matvec(gate, x, h->data());
  ck::cpu::matvec(up, x, u.data());
  for (int i = 0; i < inter; ++i) (*h)[i] = ck::cpu::silu((*h)[i]) * u[i];
  ck::cpu::matvec(down, h->data(), y->data());
}

TEST(CudaOps, ExpertProductsThroughPairViews) {
  REQUIRE_GPU();
  // Mixed formats; then 4/8-bit codes only, v2 and v1; then 4-bit codes only (groups of 64 and 128,
  // bf16/f16/f32 scales) through the tensor-core decode kernels (expert_*_tc4), at 3 activation rows;
  // then the same in 16-row tiles (group 64, bf16 scales), through the bulk-copy kernels.
  for (int variant = 0; variant < 5; ++variant) {
  const bool codes48 = variant > 0, tc4 = variant >= 3, tiled = variant == 4;
  set_gemv_version(variant == 2 ? 1 : 2);
  std::mt19937_64 rng(99 + variant);
  // Every intermediate size is a multiple of every group below (the 2026-11-29 GPU run had SI = 320
  // with a group-128 form: a matrix the uploader rejects, which this test then used anyway).
  const int H = codes48 ? 2560 : 128, I = codes48 ? 640 : 128, SI = codes48 ? 384 : 64, k = 3, rows = tc4 ? 3 : 2;
  const WeightForm mixed[] = {WeightForm{DType::U32, 4, 64, DType::BF16},
                              codes48 ? WeightForm{DType::U32, 8, 64, DType::BF16} : WeightForm{DType::U32, 3, 32, DType::BF16},
                              codes48 ? WeightForm{DType::U32, 4, 32, DType::F16} : WeightForm{DType::BF16},
                              codes48 ? WeightForm{DType::U32, 4, 128, DType::F32} : WeightForm{DType::F32}};
  const WeightForm q4only[] = {WeightForm{DType::U32, 4, 64, DType::BF16}, WeightForm{DType::U32, 4, 128, DType::BF16},
                               WeightForm{DType::U32, 4, 64, DType::F16}, WeightForm{DType::U32, 4, 128, DType::F32}};
  const WeightForm q4tiles[] = {WeightForm{DType::U32, 4, 64, DType::BF16}, WeightForm{DType::U32, 4, 64, DType::BF16},
                                WeightForm{DType::U32, 4, 64, DType::BF16}, WeightForm{DType::U32, 4, 64, DType::BF16}};
  const WeightForm* forms = tiled ? q4tiles : tc4 ? q4only : mixed;
  const WLayout layout = tiled ? WLayout::Tiles16 : WLayout::Rows;
  DeviceArena arena;
  DenseUploader up(&arena);
  struct Ex { HostMatrix g, u, d; };
  std::vector<Ex> ex;
  std::vector<ExpertPair> pairs;
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t <= k; ++t) {
      const int inter = t == k ? SI : I;
      const WeightForm& f = forms[(r * (k + 1) + t) % 4];
      ex.push_back({make_matrix(inter, H, f, rng), make_matrix(inter, H, f, rng), make_matrix(H, inter, f, rng)});
      ExpertPair p;
      auto g = up.matrix(ex.back().g.m, layout), u = up.matrix(ex.back().u.m, layout), d = up.matrix(ex.back().d.m, layout);
      ASSERT_TRUE(g.ok() && u.ok() && d.ok()) << "pair " << pairs.size() << ": a matrix the kernels cannot read";
      ASSERT_EQ(g->tiled(), tiled);
      p.gate = *g;
      p.up = *u;
      p.down = *d;
      p.x_row = r;
      p.weight = 0.1f * (t + 1);
      pairs.push_back(p);
    }
  const int n_pairs = static_cast<int>(pairs.size()), ldh = I, ldy = H;
  std::vector<float> x = randn(rows * H, rng);
  DeviceBuffer<float> xd, hd(n_pairs * ldh), yd(n_pairs * ldy);
  CUDA_CHECK(cudaMemset(yd.get(), 0xff, yd.bytes()));  // poison: every output must be written
  DeviceBuffer<ExpertPair> pd;
  if (tc4) {
    expert_gate_up_tc4(to_device(pairs, &pd), n_pairs, std::max(I, SI), H, to_device(x, &xd), H, rows, hd.get(), ldh,
                       nullptr, nullptr, tiled);
    expert_down_tc4(pd.get(), n_pairs, std::max(I, SI), H, hd.get(), ldh, yd.get(), ldy, nullptr, tiled);
    if (tiled) {
      // The streaming kernels (the default) against the bulk kernels, and against themselves with 7
      // blocks (runs of ~60 tiles or ~9 chunks through their two stages, the shared expert's tiles past
      // its rows inside them): the same bits of h and y.
      const std::vector<float> h_default = to_host(hd.get(), n_pairs * ldh), y_default = to_host(yd.get(), n_pairs * ldy);
      for (int blocks : {0, 7}) {
        if (blocks == 0) set_expert_stream(0);
        else set_expert_stream(1, blocks);
        DeviceBuffer<float> h2(n_pairs * ldh), y2(n_pairs * ldy);
        CUDA_CHECK(cudaMemcpy(h2.get(), hd.get(), h2.bytes(), cudaMemcpyDeviceToDevice));  // rows past a pair's inter
        CUDA_CHECK(cudaMemset(y2.get(), 0xff, y2.bytes()));
        expert_gate_up_tc4(pd.get(), n_pairs, std::max(I, SI), H, xd.get(), H, rows, h2.get(), ldh, nullptr, nullptr,
                           true);
        expert_down_tc4(pd.get(), n_pairs, std::max(I, SI), H, h2.get(), ldh, y2.get(), ldy, nullptr, true);
        const std::vector<float> h_other = to_host(h2.get(), n_pairs * ldh), y_other = to_host(y2.get(), n_pairs * ldy);
        const char* what = blocks == 0 ? "the bulk kernels" : "the streaming kernels with 7 blocks";
        EXPECT_EQ(std::memcmp(h_other.data(), h_default.data(), h_other.size() * sizeof(float)), 0)
            << what << ": h differs from the default's";
        EXPECT_EQ(std::memcmp(y_other.data(), y_default.data(), y_other.size() * sizeof(float)), 0)
            << what << ": y differs from the default's";
      }
      set_expert_stream(-1);
      // The fused kernel (expert_tc4_fused: gate/up and down in one), in blocks of two teams and of one,
      // with every resident block and with 7 (14 or 7 teams of many tiles and chunks, whose chunks wait
      // for other teams' tiles), each twice:
      // its counts must come back to zero for the next call. The same bits of h and y as the two kernels.
      DeviceBuffer<unsigned> counts(expert_fused_counts(n_pairs));
      CUDA_CHECK(cudaMemset(counts.get(), 0, counts.bytes()));
      for (int mode : {1, 2})  // blocks of two teams, of one team
      for (int blocks : {0, 0, 7, 7}) {
        set_expert_fused(mode);
        set_expert_stream(1, blocks);
        DeviceBuffer<float> h2(n_pairs * ldh), y2(n_pairs * ldy);
        CUDA_CHECK(cudaMemcpy(h2.get(), hd.get(), h2.bytes(), cudaMemcpyDeviceToDevice));  // rows past a pair's inter
        CUDA_CHECK(cudaMemset(y2.get(), 0xff, y2.bytes()));
        ASSERT_TRUE(expert_tc4_fused(pd.get(), n_pairs, std::max(I, SI), H, xd.get(), H, rows, h2.get(), ldh, y2.get(),
                                     ldy, counts.get(), nullptr))
            << "the fused kernel did not apply to the tiled pairs";
        const std::vector<float> h_other = to_host(h2.get(), n_pairs * ldh), y_other = to_host(y2.get(), n_pairs * ldy);
        EXPECT_EQ(std::memcmp(h_other.data(), h_default.data(), h_other.size() * sizeof(float)), 0)
            << "the fused kernel (mode " << mode << ") with " << blocks << " blocks (0: all): h differs from the two kernels'";
        EXPECT_EQ(std::memcmp(y_other.data(), y_default.data(), y_other.size() * sizeof(float)), 0)
            << "the fused kernel (mode " << mode << ") with " << blocks << " blocks (0: all): y differs from the two kernels'";
        const std::vector<unsigned> left = to_host(counts.get(), expert_fused_counts(n_pairs));
        EXPECT_EQ(std::count(left.begin(), left.end(), 0u), static_cast<long>(left.size()))
            << "the fused kernel left its counts non-zero";
      }
      set_expert_fused(-1);
      set_expert_stream(-1);
    }
  } else {
    expert_gate_up(to_device(pairs, &pd), n_pairs, std::max(I, SI), H, to_device(x, &xd), H, hd.get(), ldh, codes48,
                   nullptr);
    expert_down(pd.get(), n_pairs, std::max(I, SI), H, hd.get(), ldh, yd.get(), ldy, codes48, nullptr);
  }
  std::vector<float> hh = to_host(hd.get(), n_pairs * ldh), yh = to_host(yd.get(), n_pairs * ldy);
  for (int p = 0; p < n_pairs; ++p) {
    const Ex& e = ex[p];
    const int inter = static_cast<int>(e.g.m.rows);
    std::vector<float> gt, y;
    cpu_expert(e.g.m, e.u.m, e.d.m, x.data() + pairs[p].x_row * H, &gt, &y);
    std::vector<float> g1(hh.begin() + p * ldh, hh.begin() + p * ldh + inter), g2(yh.begin() + p * ldy, yh.begin() + p * ldy + H);
    const std::string tag = "experts variant " + std::to_string(variant) + " pair " + std::to_string(p);
    report(tag + " gate/up (inter " + std::to_string(inter) + ")", compare(g1, gt, {}, scale_atol(gt), 1e-4));
    report(tag + " down", compare(g2, y, {}, scale_atol(y), 1e-4));
  }
  }
  set_gemv_version(2);
}

// Prefill experts: pairs grouped per expert (group_pairs), each expert's tiles through the tensor
// cores, against the CPU per pair. Experts of several formats and two intermediate sizes; one expert
// chosen by more than kGroupRows pairs (several tiles), one by none.
// `q4`: every form is 4-bit codes in groups of 64k, and the factored tensor-core kernels
// (expert_*_q4) run instead of gemm.cu's.
// outputs: each pair's h and y, as the kernels wrote them (bit comparisons of variants).
void check_grouped_experts(const WeightForm (&forms)[7], bool q4, uint64_t seed, std::vector<float>* outputs = nullptr) {
  std::mt19937_64 rng(seed);
  const int H = 256, I = 128, SI = 192, E = 6, rows = 40, k = 3;
  DeviceArena arena;
  DenseUploader up(&arena);
  struct Ex { HostMatrix g, u, d; DMatrix dg, du, dd; };
  std::vector<Ex> ex;
  for (int e = 0; e <= E; ++e) {  // expert E is the shared one
    const int inter = e == E ? SI : I;
    Ex x{make_matrix(inter, H, forms[e], rng), make_matrix(inter, H, forms[e], rng), make_matrix(H, inter, forms[e], rng),
         {}, {}, {}};
    auto g = up.matrix(x.g.m), u = up.matrix(x.u.m), d = up.matrix(x.d.m);
    ASSERT_TRUE(g.ok() && u.ok() && d.ok());
    x.dg = *g; x.du = *u; x.dd = *d;
    ex.push_back(std::move(x));
  }
  std::vector<ExpertPair> pairs;
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t <= k; ++t) {
      // Expert 0 for every row (40 pairs: two tiles), expert 5 never, the rest at random.
      const int e = t == k ? E : t == 0 ? 0 : 1 + static_cast<int>(rng() % 4);
      ExpertPair p;
      p.gate = ex[e].dg; p.up = ex[e].du; p.down = ex[e].dd;
      p.x_row = r;
      p.group = e;
      pairs.push_back(p);
    }
  const int n_pairs = static_cast<int>(pairs.size()), ldh = SI + 4, ldy = H + 4;
  const int max_tiles = grouped_max_tiles(n_pairs, E + 1);
  std::vector<float> x = randn(rows * H, rng);
  DeviceBuffer<float> xd, hd(n_pairs * ldh), yd(n_pairs * ldy);
  CUDA_CHECK(cudaMemset(yd.get(), 0xff, yd.bytes()));  // poison: every output must be written
  DeviceBuffer<ExpertPair> pd;
  DeviceBuffer<int32_t> order(n_pairs), n_tiles(1);
  DeviceBuffer<int2> tiles(max_tiles);
  to_device(pairs, &pd);
  group_pairs(pd.get(), n_pairs, E + 1, order.get(), tiles.get(), n_tiles.get(), nullptr);
  if (q4) {
    for (const Ex& e : ex) ASSERT_TRUE(expert_q4_ok(e.dg) && expert_q4_ok(e.du) && expert_q4_ok(e.dd));
    expert_gate_up_q4(pd.get(), order.get(), tiles.get(), n_tiles.get(), max_tiles, SI, to_device(x, &xd), H, rows, H,
                      hd.get(), ldh, nullptr);
    expert_down_q4(pd.get(), order.get(), tiles.get(), n_tiles.get(), max_tiles, H, SI, hd.get(), ldh, n_pairs,
                   yd.get(), ldy, nullptr);
  } else {
    expert_gate_up_grouped(pd.get(), order.get(), tiles.get(), n_tiles.get(), max_tiles, SI, to_device(x, &xd), H,
                           hd.get(), ldh, nullptr);
    expert_down_grouped(pd.get(), order.get(), tiles.get(), n_tiles.get(), max_tiles, H, hd.get(), ldh, yd.get(), ldy,
                        nullptr);
  }
  std::vector<float> hh = to_host(hd.get(), n_pairs * ldh), yh = to_host(yd.get(), n_pairs * ldy);
  if (outputs) outputs->clear();
  for (int p = 0; p < n_pairs; ++p) {
    const Ex& e = ex[pairs[p].group];
    const int inter = static_cast<int>(e.g.m.rows);
    std::vector<float> gt, y;
    cpu_expert(e.g.m, e.u.m, e.d.m, x.data() + pairs[p].x_row * H, &gt, &y);
    std::vector<float> g1(hh.begin() + p * ldh, hh.begin() + p * ldh + inter), g2(yh.begin() + p * ldy, yh.begin() + p * ldy + H);
    if (outputs) {
      outputs->insert(outputs->end(), g1.begin(), g1.end());
      outputs->insert(outputs->end(), g2.begin(), g2.end());
    }
    const std::string tag = std::string(q4 ? "q4 " : "") + "grouped experts pair " + std::to_string(p) + " (expert " + std::to_string(pairs[p].group) + ")";
    // tf32x3 products: per-product error ~2^-21 (fp32: 2^-24), so elements that cancel to near zero
    // get an absolute bound of 1e-4 of the largest output (the GEMV tests use 1e-5). The q4 kernels'
    // products are exact; the same bound holds them.
    report(tag + " gate/up", compare(g1, gt, {}, scale_atol(gt, 1e-4), 1e-4));
    report(tag + " down", compare(g2, y, {}, scale_atol(y, 1e-4), 1e-4));
  }
}

// group_pairs on its own: an 8,192-row chunk's worth of pairs (top-10 + the shared expert over 512
// experts, several blocks of the three kernels), skewed so one expert takes a fifth of the routed
// pairs and some none; and a chunk smaller than one block. `order` must be a permutation whose groups
// are contiguous and in group order, and the tiles must cut each group into runs of at most
// kGroupRows pairs, in order, with the count on the device.
TEST(CudaOps, GroupPairsSortsByExpertIntoTiles) {
  REQUIRE_GPU();
  std::mt19937_64 rng(77);
  for (const int rows : {8192, 37}) {
    const int k = 10, E = 512, n_groups = E + 1;
    std::vector<ExpertPair> pairs;
    for (int r = 0; r < rows; ++r)
      for (int t = 0; t <= k; ++t) {
        ExpertPair p;
        p.x_row = r;
        p.group = t == k ? E : (rng() % 5 == 0 ? 7 : static_cast<int>(rng() % (E / 2)) * 2);  // odd experts: none
        pairs.push_back(p);
      }
    const int n_pairs = static_cast<int>(pairs.size()), max_tiles = grouped_max_tiles(n_pairs, n_groups);
    DeviceBuffer<ExpertPair> pd;
    DeviceBuffer<int32_t> order(n_pairs), n_tiles(1);
    DeviceBuffer<int2> tiles(max_tiles);
    group_pairs(to_device(pairs, &pd), n_pairs, n_groups, order.get(), tiles.get(), n_tiles.get(), nullptr);
    const std::vector<int32_t> o = to_host(order.get(), n_pairs), nt = to_host(n_tiles.get(), 1);
    const std::vector<int2> tl = to_host(tiles.get(), max_tiles);
    std::vector<int> seen(n_pairs, 0), count(n_groups, 0);
    for (const ExpertPair& p : pairs) ++count[p.group];
    int at = 0, expect_tiles = 0;
    for (int g = 0; g < n_groups; ++g) {
      for (int i = 0; i < count[g]; ++i, ++at) {
        ASSERT_GE(o[at], 0);
        ASSERT_LT(o[at], n_pairs);
        EXPECT_EQ(pairs[o[at]].group, g) << "rows " << rows << ": place " << at;
        ++seen[o[at]];
      }
      expect_tiles += (count[g] + kGroupRows - 1) / kGroupRows;
    }
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), n_pairs) << "rows " << rows << ": order is not a permutation";
    ASSERT_EQ(nt[0], expect_tiles) << "rows " << rows;
    int next = 0;
    for (int t = 0; t < nt[0]; ++t) {
      EXPECT_EQ(tl[t].x, next) << "rows " << rows << ": tile " << t;
      EXPECT_GE(tl[t].y, 1);
      EXPECT_LE(tl[t].y, kGroupRows);
      for (int i = 1; i < tl[t].y; ++i) EXPECT_EQ(pairs[o[next + i]].group, pairs[o[next]].group) << "tile " << t;
      next += tl[t].y;
    }
    EXPECT_EQ(next, n_pairs);
  }
}

TEST(CudaOps, GroupedExpertsMatchCpu) {
  REQUIRE_GPU();
  const WeightForm forms[7] = {WeightForm{DType::U32, 4, 64, DType::BF16}, WeightForm{DType::U32, 8, 64, DType::BF16},
                               WeightForm{DType::U32, 3, 32, DType::BF16}, WeightForm{DType::BF16},
                               WeightForm{DType::U32, 4, 32, DType::F16},  WeightForm{DType::F32},
                               WeightForm{DType::U32, 4, 64, DType::BF16}};
  check_grouped_experts(forms, false, 4242);
}

// The factored 4-bit kernels: groups of 64 and 128, bf16/f16/f32 scales, the same tiles (expert 0 in
// two tiles, expert 5 in none, a wider shared expert); x in two bf16 parts (the default) and three;
// 3, 4 and 6 shared-memory stages (set_q4_stages, more stages than the 4 groups of K = 256 included),
// which must give the same bits; and the codes unpacked as 128 + q (set_q4_codes128).
TEST(CudaOps, GroupedExpertsQ4MatchCpu) {
  REQUIRE_GPU();
  const WeightForm forms[7] = {WeightForm{DType::U32, 4, 64, DType::BF16},  WeightForm{DType::U32, 4, 128, DType::BF16},
                               WeightForm{DType::U32, 4, 64, DType::F16},   WeightForm{DType::U32, 4, 64, DType::F32},
                               WeightForm{DType::U32, 4, 128, DType::F16},  WeightForm{DType::U32, 4, 64, DType::BF16},
                               WeightForm{DType::U32, 4, 64, DType::BF16}};
  for (int parts : {2, 3}) {
    set_prefill_parts(parts);
    std::vector<float> first;
    for (int stages : {3, 4, 6}) {
      SCOPED_TRACE("bf16 parts " + std::to_string(parts) + ", stages " + std::to_string(stages));
      set_q4_stages(stages);
      std::vector<float> out;
      check_grouped_experts(forms, true, 4243, &out);
      if (first.empty()) first = out;
      ASSERT_EQ(out.size(), first.size());
      EXPECT_EQ(std::memcmp(out.data(), first.data(), sizeof(float) * out.size()), 0) << "stages change the bits";
    }
    // The codes as 128 + q (set_q4_codes128): other sums, the same bounds against the CPU.
    SCOPED_TRACE("bf16 parts " + std::to_string(parts) + ", codes as 128 + q");
    set_q4_stages(3);
    set_q4_codes128(1);
    check_grouped_experts(forms, true, 4243);
    set_q4_codes128(-1);
  }
  set_q4_stages(-1);
  set_prefill_parts(-1);
}

TEST(CudaOps, RouterSoftmaxTopkAndTable) {
  REQUIRE_GPU();
  std::mt19937_64 rng(5);
  for (auto [E, k, norm] : {std::tuple{8, 1, 1}, std::tuple{64, 6, 0}, std::tuple{512, 10, 1}, std::tuple{33, 33, 1},
                              std::tuple{1024, 64, 0},    // a warp per row: 32 experts per lane, 65 slots
                              std::tuple{2000, 8, 1}}) {  // over 1,024 experts: the block kernel
    const int rows = 5, H = 64, I = 32;
    std::vector<float> logits = randn(rows * E, rng, 2.0f);
    logits[1] = logits[2];  // a tie: the lower index wins
    // Row 1: a tie at the top across two lanes of the warp kernel (experts 15 and 16 at E = 512: lanes
    // 0 and 1), and one inside a lane (3 and 4). Row 3: every logit equal (the lowest k indices).
    // Row 4: a NaN logit, so every probability is NaN (the kernels' rule: the lowest k indices).
    if (E > 16) {
      const float top = *std::max_element(logits.begin() + E, logits.begin() + 2 * E) + 1.0f;
      logits[E + 15] = logits[E + 16] = logits[E + 3] = logits[E + 4] = top;
    }
    std::fill(logits.begin() + 3 * E, logits.begin() + 4 * E, 0.25f);
    logits[4 * E + E / 2] = std::nanf("");
    // A fake table: slot addresses that encode the expert id, so the pairs name what was picked.
    std::vector<ExpertSlot> table(E);
    WFormat f;
    f.kind = static_cast<uint8_t>(WKind::BF16);
    const uint64_t stride = expert_layout(f, I, H).bytes;
    for (int e = 0; e < E; ++e) { table[e].addr = reinterpret_cast<const uint8_t*>(0x100000 + e * stride); table[e].fmt = f; }
    DeviceBuffer<float> ld;
    DeviceBuffer<ExpertSlot> td;
    DeviceBuffer<ExpertPair> pd(rows * (k + 1));
    MoeRouteArgs a;
    a.logits = to_device(logits, &ld); a.ld = E; a.E = E; a.k = k; a.norm_topk = norm; a.table = to_device(table, &td);
    a.inter = I; a.hidden = H; a.pairs = pd.get();
    moe_route(a, rows, nullptr);
    std::vector<ExpertPair> got = to_host(pd.get(), rows * (k + 1));
    for (int r = 0; r < rows; ++r) {
      std::vector<float> p(logits.begin() + r * E, logits.begin() + (r + 1) * E);
      float mx = *std::max_element(p.begin(), p.end()), sum = 0;
      for (float& v : p) { v = std::exp(v - mx); sum += v; }
      for (float& v : p) v /= sum;
      std::vector<int> top = ck::cpu::topk_desc(p, k);
      if (r == 4) {  // all NaN: topk_desc's order is not defined there
        ASSERT_TRUE(std::isnan(p[0]));
        std::iota(top.begin(), top.end(), 0);
      }
      float ts = 0;
      for (int e : top) ts += p[e];
      std::vector<float> gw, rw;
      for (int t = 0; t < k; ++t) {
        const int e = static_cast<int>((reinterpret_cast<uint64_t>(got[r * (k + 1) + t].gate.data) - 0x100000) / stride);
        EXPECT_EQ(e, top[t]) << "E " << E << " row " << r << " slot " << t;
        EXPECT_EQ(got[r * (k + 1) + t].x_row, r);
        gw.push_back(got[r * (k + 1) + t].weight);
        rw.push_back(norm ? p[top[t]] / ts : p[top[t]]);
      }
      if (r == 4) {
        for (float w : gw) EXPECT_TRUE(std::isnan(w)) << "E " << E << ": a NaN row's weights";
        continue;
      }
      report("router E " + std::to_string(E) + " k " + std::to_string(k) + " row " + std::to_string(r) + " weights",
             compare(gw, rw, {}, 1e-7, 1e-5));
    }
  }
}

// The DeltaNet in_proj GEMV of a row-path step with the conv in its epilogue (gemv_conv) against the
// GEMV followed by the conv kernel: the same conv output, snapshots, final state and other jobs'
// outputs, bit for bit, at 1, 3 and 8 rows (the last two keeping snapshots), in the row layout (rows
// that are no tile multiple) and in 16-row tiles (at one row the tiles take gemv_tc4_pair_kernel: 413
// + 6 tiles, so one block's two tiles are in different jobs and the last block's second is past the
// end); each GEMV's outputs also against the CPU.
TEST(CudaOps, InProjGemvConvolvesInItsEpilogue) {
  REQUIRE_GPU();
  std::mt19937_64 rng(32);
  const int cols = 2560, K = 4;
  const WeightForm q4{DType::U32, 4, 64, DType::BF16};
  DeviceArena arena;
  DenseUploader up(&arena);
  for (WLayout layout : {WLayout::Rows, WLayout::Tiles16}) {
  // Above the one-row kernel's size (tiles x groups > 16,384), so both forms take gemv_tc4_kernel (or,
  // tiled at one row, gemv_tc4_pair_kernel).
  const bool tiles = layout == WLayout::Tiles16;
  const int C = tiles ? 6608 : 6600, nz = tiles ? 96 : 70;
  HostMatrix qkv = make_matrix(C, cols, q4, rng), z = make_matrix(nz, cols, q4, rng);
  const std::vector<float> taps = randn(static_cast<size_t>(C) * K, rng, 0.5f);
  const std::vector<float> state0 = randn(static_cast<size_t>(K - 1) * C, rng);
  DeviceBuffer<float> tapd, stated, snaps(static_cast<size_t>(kMaxRows) * (K - 1) * C), xd;
  for (int rows : {1, 3, 8}) {
    const std::string what = std::string(tiles ? "tiles, " : "rows, ") + std::to_string(rows) + " rows";
    const std::vector<float> x = randn(static_cast<size_t>(rows) * cols, rng);
    DeviceBuffer<float> gx(static_cast<size_t>(rows) * C), gy(static_cast<size_t>(rows) * C), gz(static_cast<size_t>(rows) * nz);
    GemvJob jobs[2];
    jobs[0].w = *up.matrix(qkv.m, layout); jobs[0].y = gx.get(); jobs[0].ldy = C;
    jobs[1].w = *up.matrix(z.m, layout); jobs[1].y = gz.get(); jobs[1].ldy = nz;
    ASSERT_EQ(jobs[0].w.tiled(), tiles);
    StepParams sp;
    sp.rows = rows;
    sp.snap = rows > 1 ? 1 : 0;
    DeviceBuffer<StepParams> spd(1);
    CUDA_CHECK(cudaMemcpy(spd.get(), &sp, sizeof(sp), cudaMemcpyHostToDevice));
    GdnConvArgs ca;
    ca.x = gx.get(); ca.ldx = C; ca.taps = to_device(taps, &tapd); ca.snaps = snaps.get(); ca.snap_stride = static_cast<int64_t>(K - 1) * C;
    ca.y = gy.get(); ca.ldy = C; ca.C = C; ca.K = K;
    to_device(x, &xd);
    std::vector<float> y[2], st[2], sn[2], zo[2];
    for (int fused : {0, 1}) {
      ca.state = to_device(state0, &stated);
      CUDA_CHECK(cudaMemset(gy.get(), 0xff, gy.bytes()));
      CUDA_CHECK(cudaMemset(snaps.get(), 0, snaps.bytes()));
      if (fused) {
        ASSERT_TRUE(gemv_conv(jobs, 2, xd.get(), cols, rows, nullptr, nullptr, ca, spd.get())) << rows << " rows";
      } else {
        gemv(jobs, 2, xd.get(), cols, rows, nullptr);
        report_job_vs_cpu(what + ": in_proj before the conv", qkv.m, x, cols, rows, gx.get(), C);
        gdn_conv(ca, spd.get(), rows, nullptr);
      }
      CUDA_CHECK(cudaDeviceSynchronize());
      y[fused] = to_host(gy.get(), static_cast<size_t>(rows) * C);
      st[fused] = to_host(stated.get(), state0.size());
      sn[fused] = to_host(snaps.get(), static_cast<size_t>(kMaxRows) * (K - 1) * C);
      zo[fused] = to_host(gz.get(), static_cast<size_t>(rows) * nz);
    }
    EXPECT_EQ(0, std::memcmp(y[0].data(), y[1].data(), y[0].size() * sizeof(float))) << what << ": conv output";
    EXPECT_EQ(0, std::memcmp(st[0].data(), st[1].data(), st[0].size() * sizeof(float))) << what << ": state";
    EXPECT_EQ(0, std::memcmp(sn[0].data(), sn[1].data(), sn[0].size() * sizeof(float))) << what << ": snapshots";
    EXPECT_EQ(0, std::memcmp(zo[0].data(), zo[1].data(), zo[0].size() * sizeof(float))) << what << ": job 1";
    report_job_vs_cpu(what + ": job 1", z.m, x, cols, rows, gz.get(), nz);
    EXPECT_NE(st[1], state0) << "the state moved";
  }
  }
}

// ------------------------------------------------------------------ norms, RoPE, top-k, argmax, gathers

TEST(CudaOps, NormsAndRope) {
  REQUIRE_GPU();
  std::mt19937_64 rng(11);
  for (auto [n, group] : {std::pair{1, 1}, std::pair{48, 16}, std::pair{10240, 2560}, std::pair{10240, 10240},
                              std::pair{300, 300}, std::pair{96, 32}, std::pair{4100, 4100}}) {
    const int rows = 5, ld = n + 4;
    std::vector<float> x = randn(rows * ld, rng, 3.0f), scale = randn(n, rng);
    std::vector<float> ref(rows * n), got(rows * n);
    for (int r = 0; r < rows; ++r) ck::cpu::rmsnorm_grouped(x.data() + r * ld, n, group, scale.data(), 1e-6f, ref.data() + r * n);
    DeviceBuffer<float> xd, sd, od(rows * ld);
    rmsnorm_grouped(to_device(x, &xd), n, group, to_device(scale, &sd), 1e-6f, od.get(), rows, ld, nullptr);
    std::vector<float> oh = to_host(od.get(), rows * ld);
    for (int r = 0; r < rows; ++r) std::memcpy(got.data() + r * n, oh.data() + r * ld, sizeof(float) * n);
    report("rmsnorm_grouped n " + std::to_string(n) + " group " + std::to_string(group), compare(got, ref, {}, 1e-7, 4e-6));
    // l2norm in place
    for (int r = 0; r < rows; ++r) {
      std::vector<float> v(x.begin() + r * ld, x.begin() + r * ld + n);
      ck::cpu::l2norm(v.data(), n, 1e-6f);
      std::copy(v.begin(), v.end(), ref.begin() + r * n);
    }
    l2norm(xd.get(), n, 1e-6f, rows, ld, nullptr);
    oh = to_host(xd.get(), rows * ld);
    for (int r = 0; r < rows; ++r) std::memcpy(got.data() + r * n, oh.data() + r * ld, sizeof(float) * n);
    report("l2norm n " + std::to_string(n), compare(got, ref, {}, 1e-7, 4e-6));
  }
  for (auto [dim, rot, theta, pos] : {std::tuple{32, 8, 1e4, 0}, std::tuple{256, 64, 1e7, 5000}, std::tuple{32, 24, 5e5, 123456},
                                      std::tuple{16, 16, 1e6, 7}}) {
    const int rows = 4, ld = dim;
    std::vector<float> x = randn(rows * ld, rng), ref = x;
    for (int r = 0; r < rows; ++r) ck::cpu::rope(ref.data() + r * ld, rot, pos + r, theta);
    DeviceBuffer<float> xd, fd;
    rope(to_device(x, &xd), rot, pos, to_device(rope_inv_freq(rot, theta), &fd), rows, ld, nullptr);
    float mx = 0;
    for (float v : x) mx = std::max(mx, std::fabs(v));
    report("rope dim " + std::to_string(dim) + " rot " + std::to_string(rot) + " pos " + std::to_string(pos),
           compare(to_host(xd.get(), rows * ld), ref, {}, 1e-6 * mx, 0));
  }
}

// topk_desc of one row v against the expected indices.
void expect_topk(const std::vector<float>& v, int k, const std::vector<int>& want, const char* what) {
  DeviceBuffer<float> vd;
  DeviceBuffer<int32_t> id(k);
  topk_desc(to_device(v, &vd), static_cast<int>(v.size()), k, id.get(), 1, static_cast<int>(v.size()), nullptr);
  std::vector<int32_t> got = to_host(id.get(), k);
  for (int t = 0; t < k; ++t) EXPECT_EQ(got[t], want[t]) << what << ", slot " << t;
}

TEST(CudaOps, TopkAndArgmaxTies) {
  REQUIRE_GPU();
  std::mt19937_64 rng(3);
  for (auto [n, k] : {std::pair{1, 1}, std::pair{10, 3}, std::pair{512, 10}, std::pair{1000, 64}, std::pair{7, 7}}) {
    const int rows = 3;
    std::vector<float> v = randn(rows * n, rng);
    for (int i = 0; i + 3 < n; i += 4) v[i + 3] = v[i];            // ties everywhere
    if (n >= 4) v[n + 2] = v[n + 1] = 1e9f;                          // a tie at the top of row 1
    DeviceBuffer<float> vd;
    DeviceBuffer<int32_t> id(rows * k);
    topk_desc(to_device(v, &vd), n, k, id.get(), rows, n, nullptr);
    std::vector<int32_t> got = to_host(id.get(), rows * k);
    for (int r = 0; r < rows; ++r) {
      std::vector<int> ref = ck::cpu::topk_desc(std::span<const float>(v.data() + r * n, n), k);
      for (int t = 0; t < k; ++t) EXPECT_EQ(got[r * k + t], ref[t]) << "topk n " << n << " k " << k << " row " << r << " slot " << t;
    }
  }
  {  // NaNs never win: the finite values in order, then (only NaNs left) the lowest unused indices
    const int n = 70, k = 12;
    std::vector<float> v(n, std::nanf(""));
    std::vector<int> want;
    for (int i : {65, 3, 40, 7, 33, 12, 50, 21, 69, 0}) { v[i] = static_cast<float>(i % 11) - 0.01f * i; want.push_back(i); }
    std::sort(want.begin(), want.end(), [&](int a, int b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
    want.push_back(1);
    want.push_back(2);
    expect_topk(v, k, want, "topk with NaNs");
  }
  {  // -0 ties +0 (the lower index first), -inf comes before NaN, all of them taken
    const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
    const std::vector<float> v = {0.0f, -inf, -0.0f, -1.0f, -0.0f, nan, -inf, 2.0f, 0.0f, nan, -1.0f};
    const int n = static_cast<int>(v.size()), k = n;
    expect_topk(v, k, {7, 0, 2, 4, 8, 3, 10, 1, 6, 5, 9}, "topk with signed zeros and infinities");
  }
  for (int64_t n : {int64_t{1}, int64_t{100}, int64_t{8192}, int64_t{8193}, int64_t{248320}}) {
    const int rows = 4;
    std::vector<float> v = randn(static_cast<size_t>(rows * n), rng);
    if (n > 10) { v[n + 5] = v[n + n - 1] = 50.0f; v[3 * n + n - 1] = 60.0f; v[3 * n + 9000 % n] = 60.0f; }
    DeviceBuffer<float> vd, sd(rows * argmax_scratch_floats(n));
    DeviceBuffer<int32_t> od(rows);
    argmax(to_device(v, &vd), n, od.get(), rows, n, sd.get(), nullptr);
    std::vector<int32_t> got = to_host(od.get(), rows);
    for (int r = 0; r < rows; ++r)
      EXPECT_EQ(got[r], ck::cpu::argmax(std::span<const float>(v.data() + r * n, n))) << "argmax n " << n << " row " << r;
  }
}

TEST(CudaOps, GatherRowsExact) {
  REQUIRE_GPU();
  std::mt19937_64 rng(8);
  for (const WeightForm& f : {WeightForm{DType::F32}, WeightForm{DType::BF16}, WeightForm{DType::F16},
                              WeightForm{DType::U32, 4, 64, DType::BF16}, WeightForm{DType::U32, 3, 32, DType::F16},
                              WeightForm{DType::U32, 2, 32, DType::BF16}, WeightForm{DType::U32, 8, 128, DType::F32}}) {
    const int64_t V = 50, cols = f.bits ? 128 : 37;
    HostMatrix hm = make_matrix(V, cols, f, rng);
    DeviceArena arena;
    DenseUploader up(&arena);
    const std::vector<int32_t> ids = {0, 49, 7, 7, 23};
    std::vector<float> ref(ids.size() * cols);
    for (size_t r = 0; r < ids.size(); ++r) matrix_row(hm.m, ids[r], ref.data() + r * cols);
    DeviceBuffer<int32_t> idd;
    DeviceBuffer<float> od(ids.size() * cols);
    gather_rows(*up.matrix(hm.m), to_device(ids, &idd), static_cast<int>(ids.size()), od.get(), cols, nullptr);
    report("gather_rows " + form_name(f) + " (exact)", compare(to_host(od.get(), ref.size()), ref, {}, 0, 0));
  }
}

// ------------------------------------------------------------------ layer pieces on random models

// Awkward geometries the oracle fixtures do not have: odd head dims, GDN dk not a multiple of 32,
// shared and routed intermediate sizes that differ, 2/3-bit experts, f16 scales, PLE with ngram 4,
// indexer ratio 2 and 3, more complete blocks than the budget.
struct Geometry {
  std::string name;
  ModelConfig cfg;
  RandomModelOptions opt;
};

ModelConfig base_config() {
  ModelConfig c;
  c.model_type = "qwen4_exp_text";
  c.rms_norm_eps = 1e-6;
  c.has_indexer = true;
  c.indexer_kv_heads = 1;
  c.make_ngram_vocab_size_divisible_by = 64;
  c.seed = 1234;
  return c;
}

std::vector<Geometry> geometries() {
  std::vector<Geometry> gs;
  {
    Geometry g{"bf16 H48 hc3 GDN12x12 QSA r2 silu", base_config(), {}};
    ModelConfig& c = g.cfg;
    c.vocab_size = 300; c.hidden_size = 48; c.hc_count = 3; c.hc_lowrank = 24;
    c.num_hidden_layers = 4;
    c.layer_types = {LayerKind::LinearAttention, LayerKind::LinearAttention, LayerKind::SparseAttention,
                     LayerKind::LinearAttention};
    c.num_attention_heads = 3; c.num_key_value_heads = 1; c.head_dim = 32; c.partial_rotary_factor = 0.75;
    c.rope_theta = 5e5;
    c.indexer_n_heads = 3; c.indexer_head_dim = 32; c.indexer_budget = 10; c.indexer_compress_ratio = 2;
    c.linear_conv_kernel_dim = 4; c.linear_key_head_dim = 12; c.linear_value_head_dim = 12;
    c.linear_num_key_heads = 2; c.linear_num_value_heads = 4; c.output_gate_type = "silu";
    c.num_experts = 32; c.num_experts_per_tok = 5; c.norm_topk_prob = false;
    c.moe_intermediate_size = 32; c.shared_expert_intermediate_size = 48;
    c.ple_layer_ids = {1, 2}; c.ple_embed_dim = 48; c.ple_conv_kernel_size = 4; c.ngram_size = 3; c.heads_per_ngram = 4;
    c.ngram_vocab_size_base = 50; c.eos_token_ids = {7};
    g.opt.dense = WeightForm{DType::BF16};
    g.opt.router = WeightForm{DType::BF16};
    g.opt.experts = WeightForm{DType::F32};
    g.opt.ngram = WeightForm{DType::F32};
    gs.push_back(g);
  }
  {
    Geometry g{"q4 dense, q4 experts, q8 router, q4g32 n-gram", base_config(), {}};
    ModelConfig& c = g.cfg;
    c.vocab_size = 256; c.hidden_size = 64; c.hc_count = 4; c.hc_lowrank = 32;
    c.num_hidden_layers = 4;
    c.layer_types = {LayerKind::LinearAttention, LayerKind::SparseAttention, LayerKind::LinearAttention,
                     LayerKind::SparseAttention};
    c.num_attention_heads = 2; c.num_key_value_heads = 1; c.head_dim = 64; c.partial_rotary_factor = 0.25;
    c.rope_theta = 1e7;
    c.indexer_n_heads = 2; c.indexer_head_dim = 64; c.indexer_budget = 16; c.indexer_compress_ratio = 4;
    c.linear_conv_kernel_dim = 4; c.linear_key_head_dim = 32; c.linear_value_head_dim = 32;
    c.linear_num_key_heads = 2; c.linear_num_value_heads = 4; c.output_gate_type = "sigmoid";
    c.num_experts = 32; c.num_experts_per_tok = 4; c.norm_topk_prob = true;
    c.moe_intermediate_size = 64; c.shared_expert_intermediate_size = 64;
    c.ple_layer_ids = {1}; c.ple_embed_dim = 64; c.ple_conv_kernel_size = 4; c.ngram_size = 3; c.heads_per_ngram = 1;
    c.ngram_vocab_size_base = 100; c.eos_token_ids = {2};
    g.opt.dense = WeightForm{DType::U32, 4, 32, DType::BF16};
    g.opt.router = WeightForm{DType::U32, 8, 64, DType::BF16};
    g.opt.experts = WeightForm{DType::U32, 4, 64, DType::BF16};
    g.opt.ngram = WeightForm{DType::U32, 4, 32, DType::BF16};
    gs.push_back(g);
  }
  {
    Geometry g{"f16 dense, q3 experts, q2 router, dk40 dv24, ngram4", base_config(), {}};
    ModelConfig& c = g.cfg;
    c.vocab_size = 200; c.hidden_size = 128; c.hc_count = 2; c.hc_lowrank = 64;
    c.num_hidden_layers = 3;
    c.layer_types = {LayerKind::LinearAttention, LayerKind::SparseAttention, LayerKind::LinearAttention};
    c.num_attention_heads = 4; c.num_key_value_heads = 2; c.head_dim = 48; c.partial_rotary_factor = 0.5;
    c.rope_theta = 1e4;
    c.indexer_n_heads = 1; c.indexer_head_dim = 48; c.indexer_budget = 9; c.indexer_compress_ratio = 3;
    c.linear_conv_kernel_dim = 3; c.linear_key_head_dim = 40; c.linear_value_head_dim = 24;
    c.linear_num_key_heads = 1; c.linear_num_value_heads = 3; c.output_gate_type = "sigmoid";
    c.num_experts = 16; c.num_experts_per_tok = 3; c.norm_topk_prob = true;
    c.moe_intermediate_size = 96; c.shared_expert_intermediate_size = 32;
    c.ple_layer_ids = {1, 3}; c.ple_embed_dim = 48; c.ple_conv_kernel_size = 4; c.ngram_size = 4; c.heads_per_ngram = 2;
    c.ngram_vocab_size_base = 40; c.eos_token_ids = {199};
    g.opt.dense = WeightForm{DType::F16};
    g.opt.router = WeightForm{DType::U32, 2, 32, DType::F16};
    g.opt.experts = WeightForm{DType::U32, 3, 32, DType::F16};
    g.opt.ngram = WeightForm{DType::BF16};
    gs.push_back(g);
  }
  {
    // Every mix matrix 4-bit in groups of 64 with H and the low rank multiples of 64: one-row mixes take
    // the fused kernel (cuda/hc_mix.cu): 20 one-group chunks of the wide input, u in 5 groups, d in 4
    // (the up projection loops over several groups). The projections, the mixes' low-rank pairs and the
    // experts (intermediate 256) fit 16-row tiles, so every kernel that reads tiles runs here
    // (dmatrix.h WLayout::Tiles16).
    Geometry g{"q4g64 H320 hc4 low rank 256 (fused one-row mix, tiles)", base_config(), {}};
    ModelConfig& c = g.cfg;
    c.vocab_size = 256; c.hidden_size = 320; c.hc_count = 4; c.hc_lowrank = 256;
    c.num_hidden_layers = 3;
    c.layer_types = {LayerKind::LinearAttention, LayerKind::SparseAttention, LayerKind::LinearAttention};
    c.num_attention_heads = 4; c.num_key_value_heads = 2; c.head_dim = 64; c.partial_rotary_factor = 0.5;
    c.rope_theta = 1e6;
    c.indexer_n_heads = 2; c.indexer_head_dim = 64; c.indexer_budget = 12; c.indexer_compress_ratio = 3;
    c.linear_conv_kernel_dim = 4; c.linear_key_head_dim = 32; c.linear_value_head_dim = 32;
    c.linear_num_key_heads = 2; c.linear_num_value_heads = 4; c.output_gate_type = "sigmoid";
    c.num_experts = 16; c.num_experts_per_tok = 4; c.norm_topk_prob = true;
    c.moe_intermediate_size = 256; c.shared_expert_intermediate_size = 256;
    c.ple_layer_ids = {1}; c.ple_embed_dim = 64; c.ple_conv_kernel_size = 4; c.ngram_size = 3; c.heads_per_ngram = 2;
    c.ngram_vocab_size_base = 60; c.eos_token_ids = {3};
    g.opt.dense = WeightForm{DType::U32, 4, 64, DType::BF16};
    g.opt.router = WeightForm{DType::U32, 8, 64, DType::BF16};
    g.opt.experts = WeightForm{DType::U32, 4, 64, DType::BF16};
    g.opt.ngram = WeightForm{DType::U32, 4, 64, DType::BF16};
    gs.push_back(g);
  }
  return gs;
}

std::vector<int32_t> random_tokens(int n, int64_t vocab, int64_t eos, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = static_cast<int32_t>(rng() % vocab);
  if (n > 10) t[5] = t[n / 2] = static_cast<int32_t>(eos);
  return t;
}

// The CPU reference's layer_token, cut at the same points as the CUDA taps.
void cpu_taps(const ck::cpu::Model& m, const std::vector<int32_t>& tokens, std::map<std::string, std::vector<float>>* taps,
              std::vector<float>* logits) {
  const ModelWeights& w = m.weights();
  const ModelConfig& c = w.cfg;
  const int H = c.hidden_size, W = c.wide(), S = c.hc_count;
  std::vector<ck::cpu::LayerState> st(w.layers.size());
  for (size_t L = 0; L < st.size(); ++L) m.init_state(st[L], w.layers[L]);
  auto put = [&](const std::string& name, const float* v, int n) { (*taps)[name].insert((*taps)[name].end(), v, v + n); };
  for (size_t t = 0; t < tokens.size(); ++t) {
    std::vector<float> R(W), e(H), u(H), o(H), wt(S), y(H), lg(c.vocab_size);
    matrix_row(w.embed, tokens[t], e.data());
    for (int s = 0; s < S; ++s) std::copy(e.begin(), e.end(), R.begin() + s * H);
    for (size_t L = 0; L < w.layers.size(); ++L) {
      const LayerWeights& lw = w.layers[L];
      const std::string pre = "L" + std::to_string(L) + ".";
      if (lw.ple) {
        std::vector<float> p(W);
        m.ple_token(*lw.ple, st[L], R.data(), tokens[t], p.data());
        for (int i = 0; i < W; ++i) R[i] += p[i];
        put(pre + "ple", R.data(), W);
      }
      m.hc_mix(lw.hc_attn, R.data(), u.data(), wt.data());
      put(pre + "attn_u", u.data(), H);
      if (lw.kind == LayerKind::LinearAttention) m.gdn_token(lw.gdn, st[L], u.data(), o.data());
      else m.attn_token(lw.attn, st[L], u.data(), static_cast<int64_t>(t), o.data());
      put(pre + "attn_out", o.data(), H);
      m.hc_combine(R.data(), o.data(), wt.data());
      put(pre + "post_attn", R.data(), W);
      m.hc_mix(lw.hc_mlp, R.data(), u.data(), wt.data());
      put(pre + "moe_u", u.data(), H);
      ASSERT_TRUE(m.moe_token(lw.moe, static_cast<int>(L), u.data(), o.data()).ok());
      put(pre + "moe_out", o.data(), H);
      m.hc_combine(R.data(), o.data(), wt.data());
      put(pre + "post_moe", R.data(), W);
    }
    m.hc_mix(w.final_mixer, R.data(), y.data(), nullptr);
    put("final_y", y.data(), H);
    ck::cpu::matvec(w.lm_head, y.data(), lg.data());
    logits->insert(logits->end(), lg.begin(), lg.end());
  }
}

double rel_l2(const float* a, const float* b, size_t n) {
  double e = 0, r = 0;
  for (size_t i = 0; i < n; ++i) { e += (double(a[i]) - b[i]) * (double(a[i]) - b[i]); r += double(b[i]) * b[i]; }
  return r > 0 ? std::sqrt(e / r) : std::sqrt(e);
}

// The Gated DeltaNet delta rule and its gated norm (spec §6), in double precision on the host: the
// ground truth both device forms (token by token, and chunks of 64 in WY form) are held to.
struct GdnCase {
  int nk, nv, dk, dv, rows;
};
void gdn_reference(const GdnCase& g, const std::vector<float>& y, const std::vector<float>& z,
                   const std::vector<float>& b, const std::vector<float>& a, const std::vector<float>& a_log,
                   const std::vector<float>& dt_bias, const std::vector<float>& norm, std::vector<double>* S,
                   std::vector<double>* out) {
  const int Kd = g.nk * g.dk, ldy = 2 * Kd + g.nv * g.dv, Vd = g.nv * g.dv;
  out->assign(static_cast<size_t>(g.rows) * Vd, 0.0);
  for (int r = 0; r < g.rows; ++r)
    for (int h = 0; h < g.nv; ++h) {
      const int kh = h / (g.nv / g.nk);
      const float* yr = y.data() + static_cast<size_t>(r) * ldy;
      std::vector<double> q(g.dk), k(g.dk), o(g.dv);
      double sq = 0, sk = 0;
      for (int i = 0; i < g.dk; ++i) {
        q[i] = yr[kh * g.dk + i];
        k[i] = yr[Kd + kh * g.dk + i];
        sq += q[i] * q[i];
        sk += k[i] * k[i];
      }
      for (int i = 0; i < g.dk; ++i) {
        q[i] = q[i] / std::sqrt(sq + 1e-6) / std::sqrt(static_cast<double>(g.dk));
        k[i] = k[i] / std::sqrt(sk + 1e-6);
      }
      const double beta = 1.0 / (1.0 + std::exp(-double(b[r * g.nv + h])));
      const double x = double(a[r * g.nv + h]) + dt_bias[h];
      const double decay = std::exp(-std::exp(double(a_log[h])) * (x > 20 ? x : std::log1p(std::exp(x))));
      double* Sh = S->data() + static_cast<size_t>(h) * g.dk * g.dv;
      for (int j = 0; j < g.dv; ++j) {
        double m = 0;
        for (int i = 0; i < g.dk; ++i) m += (Sh[i * g.dv + j] *= decay) * k[i];
        const double delta = beta * (yr[2 * Kd + h * g.dv + j] - m);
        double oj = 0;
        for (int i = 0; i < g.dk; ++i) oj += (Sh[i * g.dv + j] += k[i] * delta) * q[i];
        o[j] = oj;
      }
      double ss = 0;
      for (double v : o) ss += v * v;
      const double rr = 1.0 / std::sqrt(ss / g.dv + 1e-6);
      for (int j = 0; j < g.dv; ++j) {
        const double zz = z[static_cast<size_t>(r) * Vd + h * g.dv + j];
        (*out)[static_cast<size_t>(r) * Vd + h * g.dv + j] = norm[j] * (o[j] * rr) / (1.0 + std::exp(-zz));
      }
    }
}

// One delta-rule problem for the device forms: random inputs (slow and fast decays) from a nonzero
// state, the double-precision reference, and the inputs on the device with their GdnRecArgs (ra.state
// is set by reset_state before each run).
struct GdnProblem {
  std::vector<float> state0, ref_out, ref_state;
  DeviceBuffer<float> yd, zd, bd, ad, ald, dtd, nd, sd, od;
  DeviceBuffer<StepParams> spd{1};
  GdnRecArgs ra;
  GdnProblem(const GdnCase& g, std::mt19937_64& rng) {
    const int Kd = g.nk * g.dk, Vd = g.nv * g.dv, ldy = 2 * Kd + Vd;
    std::vector<float> y = randn(static_cast<size_t>(g.rows) * ldy, rng), z = randn(static_cast<size_t>(g.rows) * Vd, rng);
    std::vector<float> b = randn(static_cast<size_t>(g.rows) * g.nv, rng, 2.0f), a = randn(static_cast<size_t>(g.rows) * g.nv, rng);
    std::vector<float> a_log(g.nv), dt_bias = randn(g.nv, rng, 0.5f), norm = randn(g.dv, rng, 0.3f);
    std::uniform_real_distribution<float> ul(-4.0f, 1.5f);  // slow and fast decays
    for (float& v : a_log) v = ul(rng);
    for (float& v : norm) v += 1.0f;
    state0 = randn(static_cast<size_t>(g.nv) * g.dk * g.dv, rng, 0.5f);
    std::vector<double> S(state0.begin(), state0.end()), out;
    gdn_reference(g, y, z, b, a, a_log, dt_bias, norm, &S, &out);
    ref_out.assign(out.begin(), out.end());
    ref_state.assign(S.begin(), S.end());
    od.resize(static_cast<size_t>(g.rows) * Vd);
    const StepParams sp;
    CUDA_CHECK(cudaMemcpy(spd.get(), &sp, sizeof(sp), cudaMemcpyHostToDevice));
    ra.y = to_device(y, &yd); ra.ldy = ldy; ra.z = to_device(z, &zd); ra.ldz = Vd;
    ra.b = to_device(b, &bd); ra.a = to_device(a, &ad); ra.ldab = g.nv;
    ra.a_log = to_device(a_log, &ald); ra.dt_bias = to_device(dt_bias, &dtd); ra.norm = to_device(norm, &nd);
    ra.out = od.get(); ra.ldo = Vd;
    ra.nk = g.nk; ra.nv = g.nv; ra.dk = g.dk; ra.dv = g.dv; ra.eps = 1e-6f; ra.sigmoid_gate = 1;
  }
  void reset_state() { ra.state = to_device(state0, &sd); }
  std::vector<float> out() const { return to_host(od.get(), ref_out.size()); }
  std::vector<float> state() const { return to_host(sd.get(), ref_state.size()); }
};

// The device forms of the delta rule (the recurrence; chunks with the fp32 scan and with the tensor-core
// scan) against the double-precision recurrence, from a nonzero state,
// over row counts around the chunk size and head sizes that are not multiples of 32. Tolerance: relative
// L2 <= 2e-5 over the outputs and the final state (fp32 through 64-step chunks; the whole-model bound
// is 1e-4).
TEST(CudaOps, GdnChunkedAndRecurrentMatchDouble) {
  REQUIRE_GPU();
  init_kernels();
  std::mt19937_64 rng(21);
  const GdnCase cases[] = {{2, 4, 12, 12, 1},   {2, 4, 32, 32, 63},  {1, 3, 40, 24, 64},     {2, 4, 32, 32, 65},
                           {1, 2, 128, 100, 77}, {2, 2, 128, 128, 130}, {16, 48, 128, 128, 200},
                           {1, 2, 72, 56, 300},  {2, 2, 10, 33, 70}};
  for (const GdnCase& g : cases) {
    GdnProblem p(g, rng);
    ASSERT_TRUE(gdn_chunked_fits(p.ra));
    // form 0: the recurrence; 1: chunked, fp32 scan; 2, 3: chunked, tensor-core scan (3xTF32), 32 and
    // 64 value columns per block.
    for (int form : {0, 1, 2, 3}) {
      p.reset_state();
      if (form == 0) {
        gdn_recurrent(p.ra, p.spd.get(), g.rows, nullptr);
      } else {
        set_gdn_scan_tc(form >= 2);
        set_gdn_scan_cols(form == 3 ? 64 : 32);
        gdn_chunked(p.ra, g.rows, nullptr);
      }
      CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> out = p.out(), st = p.state();
      const double e_out = rel_l2(out.data(), p.ref_out.data(), out.size());
      const double e_st = rel_l2(st.data(), p.ref_state.data(), st.size());
      std::printf("  gdn %-12s nk %2d nv %2d dk %3d dv %3d rows %3d: out rel_l2 %.3e, state rel_l2 %.3e\n",
                  form == 0 ? "recurrent" : form == 1 ? "chunked fp32" : form == 2 ? "chunked tc" : "chunked tc64", g.nk,
                  g.nv, g.dk, g.dv, g.rows, e_out, e_st);
      EXPECT_LE(e_out, 2e-5);
      EXPECT_LE(e_st, 2e-5);
    }
  }
  set_gdn_scan_tc(-1);
  set_gdn_scan_cols(-1);
}

// Heads beyond the chunked form (dk or dv > 128) run the recurrence, in prefill chunks too: key dims
// up to 16 parts of 32 with the value columns split in blocks of 32 (gdn_recurrent_fits), on row
// counts of the row path (every row's inputs preloaded where they fit 48 KB with the kernel's static
// shared memory) and beyond it. Against the double-precision recurrence, as above.
TEST(CudaOps, GdnRecurrentTakesLargeHeads) {
  REQUIRE_GPU();
  init_kernels();
  std::mt19937_64 rng(23);
  const GdnCase cases[] = {{1, 2, 256, 128, 8}, {1, 2, 256, 128, 20}, {1, 1, 192, 192, 3}, {2, 2, 256, 256, 7},
                           {1, 1, 512, 64, 2},  {1, 2, 160, 96, 8},   {1, 1, 256, 56, 8}};
  for (const GdnCase& g : cases) {
    ASSERT_TRUE(gdn_recurrent_fits(g.dk, g.dv)) << g.dk << " x " << g.dv;
    GdnProblem p(g, rng);
    p.reset_state();
    gdn_recurrent(p.ra, p.spd.get(), g.rows, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = p.out(), st = p.state();
    const double e_out = rel_l2(out.data(), p.ref_out.data(), out.size());
    const double e_st = rel_l2(st.data(), p.ref_state.data(), st.size());
    std::printf("  gdn recurrent nk %d nv %d dk %3d dv %3d rows %2d: out rel_l2 %.3e, state rel_l2 %.3e\n", g.nk, g.nv,
                g.dk, g.dv, g.rows, e_out, e_st);
    EXPECT_LE(e_out, 2e-5);
    EXPECT_LE(e_st, 2e-5);
  }
}

// A decode step's split heads make their output norm as a thread-block cluster (set_gdn_cluster_norm):
// the same bits as the recurrence followed by gdn_out_norm_kernel, and within the double-precision
// bound. Row counts of the row path (<= kMaxRows), one to eight 32-column blocks per head, and one
// head in one block (dv 40: the block's own norm). Variant 2: the cluster's norms deferred to after the
// row loop (set_gdn_norm_defer), the same bits again. Each variant also with every row's inputs loaded
// before the row loop (set_gdn_preload_min_rows(1)): the same bits as without.
TEST(CudaOps, GdnClusterNormEqualsNormKernel) {
  REQUIRE_GPU();
  init_kernels();
  std::mt19937_64 rng(22);
  const GdnCase cases[] = {{2, 4, 32, 64, 1}, {16, 48, 128, 128, 1}, {16, 48, 128, 128, 3}, {1, 3, 40, 96, 8},
                           {2, 2, 64, 256, 5}, {16, 48, 128, 128, 4}, {1, 2, 48, 40, 6}, {16, 48, 128, 128, 8}};
  for (const GdnCase& g : cases) {
    GdnProblem p(g, rng);
    std::vector<float> outs[3], states[3];
    for (int preload : {0, 1}) {
      set_gdn_preload_min_rows(preload ? 1 : kMaxRows + 1);
      for (int variant : {0, 1, 2}) {
        set_gdn_cluster_norm(variant >= 1);
        set_gdn_norm_defer(variant == 2 ? 1 : 0);
        p.reset_state();
        gdn_recurrent(p.ra, p.spd.get(), g.rows, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        if (preload == 0) {
          outs[variant] = p.out();
          states[variant] = p.state();
        } else {
          EXPECT_EQ(0, std::memcmp(outs[variant].data(), p.out().data(), outs[variant].size() * sizeof(float)))
              << "preloaded rows: outputs differ, variant " << variant << ", rows " << g.rows;
          EXPECT_EQ(0, std::memcmp(states[variant].data(), p.state().data(), states[variant].size() * sizeof(float)))
              << "preloaded rows: states differ, variant " << variant << ", rows " << g.rows;
        }
      }
    }
    set_gdn_preload_min_rows(-1);
    set_gdn_cluster_norm(true);
    set_gdn_norm_defer(-1);
    EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[2].data(), outs[0].size() * sizeof(float))) << "deferred norms differ";
    EXPECT_EQ(0, std::memcmp(states[0].data(), states[2].data(), states[0].size() * sizeof(float)))
        << "states differ (deferred norms)";
    const double e_out = rel_l2(outs[1].data(), p.ref_out.data(), p.ref_out.size());
    std::printf("  gdn cluster norm nk %2d nv %2d dk %3d dv %3d rows %d: out rel_l2 %.3e\n", g.nk, g.nv, g.dk, g.dv,
                g.rows, e_out);
    EXPECT_LE(e_out, 2e-5);
    EXPECT_EQ(0, std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float))) << "outputs differ";
    EXPECT_EQ(0, std::memcmp(states[0].data(), states[1].data(), states[0].size() * sizeof(float))) << "states differ";
  }
}

// Steps with snapshots keep the state from before them (GdnRecArgs::state_alt, sp->state_parity): the
// state after the step goes to the other buffer, and a rollback replays the rows it keeps on the buffer
// from before (Session::replay_deltanet), with no snapshot of the state. Against the in-place step that
// writes a snapshot after every row: the same outputs and final state, the start state untouched, and
// for every n < rows the state replayed over the first n rows equal to snapshot n - 1, bit for bit
// (n = 1 replays with the per-row form, the step ran the preloaded one). Both parities; split heads in a
// cluster and a head in one block.
TEST(CudaOps, GdnReplayEqualsSnapshots) {
  REQUIRE_GPU();
  init_kernels();
  std::mt19937_64 rng(23);
  const GdnCase cases[] = {{16, 48, 128, 128, 2}, {16, 48, 128, 128, 4}, {2, 4, 32, 64, 8}, {1, 2, 48, 40, 5}};
  auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  for (const GdnCase& g : cases) {
    SCOPED_TRACE(::testing::Message() << "nv " << g.nv << " dk " << g.dk << " dv " << g.dv << " rows " << g.rows);
    GdnProblem p(g, rng);
    const size_t n_state = p.state0.size();
    DeviceBuffer<float> snaps(static_cast<size_t>(kMaxRows - 1) * n_state);
    auto put_params = [&](int rows, int snap, int parity) {
      StepParams sp;
      sp.rows = rows;
      sp.snap = snap;
      sp.state_parity = parity;
      CUDA_CHECK(cudaMemcpy(p.spd.get(), &sp, sizeof(sp), cudaMemcpyHostToDevice));
    };
    put_params(g.rows, 1, 0);
    p.reset_state();
    GdnRecArgs ref = p.ra;
    ref.snaps = snaps.get();
    ref.snap_stride = static_cast<int64_t>(n_state);
    gdn_recurrent(ref, p.spd.get(), g.rows, nullptr);
    const std::vector<float> ref_out = p.out(), ref_final = p.state();
    const std::vector<float> ref_snaps = to_host(snaps.get(), (g.rows - 1) * n_state);
    for (int parity : {0, 1}) {
      DeviceBuffer<float> before, after;
      float* held = to_device(p.state0, &before);
      float* other = to_device(std::vector<float>(n_state, 7.0f), &after);
      GdnRecArgs ra = p.ra;
      ra.state = parity ? other : held;
      ra.state_alt = parity ? held : other;
      put_params(g.rows, 1, parity);
      gdn_recurrent(ra, p.spd.get(), g.rows, nullptr);
      EXPECT_TRUE(same(p.out(), ref_out)) << "parity " << parity << ": outputs differ";
      EXPECT_TRUE(same(to_host(other, n_state), ref_final)) << "parity " << parity << ": final state differs";
      EXPECT_TRUE(same(to_host(held, n_state), p.state0)) << "parity " << parity << ": the start state changed";
      for (int n = 1; n < g.rows; ++n) {
        CUDA_CHECK(cudaMemcpy(held, p.state0.data(), n_state * sizeof(float), cudaMemcpyHostToDevice));
        put_params(n, 0, parity);
        gdn_recurrent(ra, p.spd.get(), n, nullptr);
        const std::vector<float> snap(ref_snaps.begin() + (n - 1) * n_state, ref_snaps.begin() + n * n_state);
        EXPECT_TRUE(same(to_host(held, n_state), snap)) << "parity " << parity << ": replay of " << n << " rows";
      }
    }
  }
}

// The host half of PLE as a CUDA step gathers it (cpu::Model::ple_gather: ids in order, table rows in
// parallel from 64 tokens) against ple_token's own order, token by token: the same bits and the same
// contexts after each token, for every PLE layer of the geometries (f32, q4g32 and bf16 tables,
// n-gram 3 and 4, EOS in the stream). Host only: runs without a GPU.
TEST(CudaOps, PleGatherEqualsTokenByToken) {
  for (const Geometry& g : geometries()) {
    SCOPED_TRACE(g.name);
    auto rm = make_random_model(g.cfg, g.opt);
    ck::cpu::Model cm(rm->weights, rm->experts);
    const int rd = g.cfg.ngram_row_dim(), T = 300;
    const std::vector<int32_t> tokens = random_tokens(T, g.cfg.vocab_size, g.cfg.ple_eos(), 77);
    int n_ple = 0;
    for (size_t L = 0; L < rm->weights.layers.size(); ++L) {
      if (!rm->weights.layers[L].ple) continue;
      ++n_ple;
      const PleWeights& pw = *rm->weights.layers[L].ple;
      const std::vector<int64_t> ctx0(static_cast<size_t>(g.cfg.ngram_size - 1), g.cfg.ple_eos());
      std::vector<int64_t> ctx_ref = ctx0, ctx = ctx0;
      const size_t ld = static_cast<size_t>(g.cfg.ple_embed_dim) + 5;
      std::vector<float> ref(T * ld, 0.0f), got(T * ld, 0.0f);
      std::vector<std::vector<int64_t>> ctx_refs;
      for (int r = 0; r < T; ++r) {
        const std::vector<int64_t> ids = cm.ngram_rows(pw, ctx_ref, tokens[r]);
        for (size_t j = 0; j < ids.size(); ++j) pw.table_row(ids[j], ref.data() + r * ld + j * rd);
        ctx_refs.push_back(ctx_ref);
      }
      std::vector<std::vector<int64_t>> after;
      cm.ple_gather(pw, ctx, tokens, got.data(), ld, &after);
      EXPECT_EQ(0, std::memcmp(ref.data(), got.data(), ref.size() * sizeof(float))) << "layer " << L;
      EXPECT_EQ(ctx_refs, after) << "layer " << L;
      EXPECT_EQ(ctx_ref, ctx) << "layer " << L;
      // A decode step's few rows take the serial loop: the same.
      std::vector<int64_t> c1 = ctx0, c2 = ctx0;
      std::vector<float> a(3 * ld, 0.0f), b(3 * ld, 0.0f);
      cm.ple_gather(pw, c1, std::span<const int32_t>(tokens.data(), 3), a.data(), ld);
      std::memcpy(b.data(), got.data(), 3 * ld * sizeof(float));
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "layer " << L << ", 3 rows";
    }
    EXPECT_GT(n_ple, 0);
  }
}

TEST(CudaOps, LayerPiecesOnRandomModels) {
  REQUIRE_GPU();
  for (const Geometry& g : geometries()) {
    SCOPED_TRACE(g.name);
    std::printf("geometry: %s\n", g.name.c_str());
    auto rm = make_random_model(g.cfg, g.opt);
    ck::cpu::Model cm(rm->weights, rm->experts);
    auto dm = Model::create(rm->weights, rm->experts);
    ASSERT_TRUE(dm.ok()) << dm.status().message();
    if (g.name.find("tiles") != std::string::npos) {  // the kernels that read tiles are what is tested
      EXPECT_TRUE((*dm)->tiled_experts());
      EXPECT_GE((*dm)->tiled_dense_matrices(), 8);
    }
    const int T = 45;
    const std::vector<int32_t> tokens = random_tokens(T, g.cfg.vocab_size, g.cfg.ple_eos(), 42);
    std::map<std::string, std::vector<float>> ref, got;
    std::vector<float> ref_logits;
    cpu_taps(cm, tokens, &ref, &ref_logits);
    auto s = (*dm)->new_session(64);
    s->set_taps(&got);
    StepResult res;
    std::vector<float> logits;
    int pos = 0;
    for (int n : {1, 3, 8, 2, 5, 1, 7, 4, 6, 8}) {  // 45 rows in steps of every size
      ASSERT_TRUE(s->step_rows(std::span<const int32_t>(tokens.data() + pos, n), false, true, &res).ok());
      s->commit(n);
      logits.insert(logits.end(), res.logits.begin(), res.logits.end());
      pos += n;
    }
    ASSERT_EQ(pos, T);
    for (auto& [name, rv] : ref) {
      ASSERT_TRUE(got.count(name)) << "no CUDA tap " << name;
      const std::vector<float>& gv = got[name];
      ASSERT_EQ(gv.size(), rv.size()) << name;
      const double rl = rel_l2(gv.data(), rv.data(), rv.size());
      Diff d = compare(gv, rv, {}, 0, 0);
      std::printf("  %-24s rel_l2 %.3e  max_abs %.3e  nmse %.3e%s\n", name.c_str(), rl, d.max_abs, d.nmse,
                  rl > 1e-4 ? "  FAIL" : "");
      EXPECT_LE(rl, 1e-4) << "first piece out of tolerance names the culprit: " << name;
    }
    const double rl = rel_l2(logits.data(), ref_logits.data(), ref_logits.size());
    std::printf("  %-24s rel_l2 %.3e\n", "logits", rl);
    EXPECT_LE(rl, 1e-4);
  }
}

TEST(CudaOps, GraphsEqualDirectLaunches) {
  REQUIRE_GPU();
  const Geometry g = geometries()[1];
  auto rm = make_random_model(g.cfg, g.opt);
  auto dm = Model::create(rm->weights, rm->experts);
  ASSERT_TRUE(dm.ok()) << dm.status().message();
  const std::vector<int32_t> tokens = random_tokens(30, g.cfg.vocab_size, g.cfg.ple_eos(), 9);
  std::vector<float> a, b;
  for (bool graphs : {true, false}) {
    auto s = (*dm)->new_session(64);
    s->set_use_graphs(graphs);
    StepResult res;
    for (int pos = 0, n = 1; pos < 30; pos += n, n = n % 8 + 1) {
      n = std::min(n, 30 - pos);
      ASSERT_TRUE(s->step_rows(std::span<const int32_t>(tokens.data() + pos, n), false, true, &res).ok());
      s->commit(n);
      (graphs ? a : b).insert((graphs ? a : b).end(), res.logits.begin(), res.logits.end());
    }
  }
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << "graph replay and direct launches differ";
}

// The logits of 30 random tokens fed in steps of 1, 2, ..., 8 rows (then 1 again), each step
// committed, in a session made after set(0) and in one made after set(1): the same bits expected
// (`what` names the switch in the failure). set(-1) after.
template <class Set>
void expect_switch_keeps_logits(const Model& m, const Geometry& g, uint64_t seed, Set set, const char* what) {
  const std::vector<int32_t> tokens = random_tokens(30, g.cfg.vocab_size, g.cfg.ple_eos(), seed);
  std::vector<float> out[2];
  for (int on : {0, 1}) {
    set(on);
    auto s = m.new_session(64);
    StepResult res;
    for (int pos = 0, n = 1; pos < 30; pos += n, n = n % 8 + 1) {
      n = std::min(n, 30 - pos);
      ASSERT_TRUE(s->step_rows(std::span<const int32_t>(tokens.data() + pos, n), false, true, &res).ok());
      s->commit(n);
      out[on].insert(out[on].end(), res.logits.begin(), res.logits.end());
    }
  }
  set(-1);
  ASSERT_EQ(out[0].size(), out[1].size());
  EXPECT_EQ(std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)), 0) << what;
}

// expect_switch_keeps_logits for a one-row mix form chosen by a switch, and that the form ran (its launch
// count grew): a form that never ran would keep the logits trivially.
template <class Set, class Count>
void expect_form_keeps_logits(const Model& m, const Geometry& g, uint64_t seed, Set set, Count launches,
                              const char* what, const char* not_run) {
  const size_t before = launches();
  expect_switch_keeps_logits(m, g, seed, set, what);
  EXPECT_GT(launches(), before) << not_run;
}

// fn(model, geometry) on the given geometries (indices into geometries()).
template <class Fn>
void for_each_model(std::initializer_list<int> which, Fn fn) {
  for (int gi : which) {
    const Geometry g = geometries()[gi];
    SCOPED_TRACE(g.name);
    auto rm = make_random_model(g.cfg, g.opt);
    auto dm = Model::create(rm->weights, rm->experts);
    ASSERT_TRUE(dm.ok()) << dm.status().message();
    fn(**dm, g);
  }
}

// The one-row mix's kernel instance for tiles (set_layout_kernels: no layout branch per group) gives
// the default instance's logits bit for bit, at steps of 1 to 8 rows: on the fused one-row mix's geometry
// (3) and on the 4-bit geometry (1, whose mixes take the unfused kernels: low rank 32, groups of 32).
TEST(CudaOps, LayoutKernelsGiveTheSameLogits) {
  REQUIRE_GPU();
  for_each_model({1, 3}, [](const Model& m, const Geometry& g) {
    expect_switch_keeps_logits(m, g, 11, [](int on) { set_layout_kernels(on); },
                               "the layout kernels' logits differ from the default kernels'");
  });
}

// The one-row mix's forms of phase 2 and of its tiles (set_hc_bulk_parts): the partials brought by bulk
// copies and summed in one flat loop (1), with the up tiles bulk-copied to shared memory at the start too
// (2), and the down tiles (3, the default), the tiles with the loaded partials (4), 3 with the flat loop's
// factors four at a time (5). Each gives the loads' form's logits (0) bit for bit (the same words, the same
// additions in the same order), at steps of 1 to 8 rows, in the instances for tiles and for rows
// (set_layout_kernels(0): modes 2-5 then copy no tiles; 3-5 fall back to 0). On the one geometry whose
// one-row mixes take hc_mix.cu's kernel (3).
TEST(CudaOps, OneRowMixBulkPartialsGiveTheLoadsBits) {
  REQUIRE_GPU();
  for_each_model({3}, [](const Model& m, const Geometry& g) {
    for (int mode : {1, 2, 3, 4, 5})
      for (int layout : {-1, 0}) {
        SCOPED_TRACE(fmt::format("mode {}, {}", mode, layout < 0 ? "default layout" : "rows"));
        set_layout_kernels(layout);
        const size_t launches = hc_bulk_parts_launches(), up = hc_bulk_up_launches(), down = hc_bulk_down_launches();
        expect_switch_keeps_logits(m, g, 19, [mode](int on) { set_hc_bulk_parts(on > 0 ? mode : on); },
                                   "the bulk-copied partials' or tiles' logits differ from the loaded ones'");
        const bool tiles = layout < 0;
        EXPECT_EQ(hc_bulk_parts_launches() > launches, mode <= 2 || ((mode == 3 || mode == 5) && tiles)) << "the partials' copies";
        EXPECT_EQ(hc_bulk_up_launches() > up, mode >= 2 && tiles) << "the up tiles' copies";
        EXPECT_EQ(hc_bulk_down_launches() > down, mode >= 3 && tiles) << "the down tiles' copies";
      }
    set_layout_kernels(-1);
  });
}

// A deferred MoE output combined in the one-row mix with every slot's load first (hc_mix.cu's
// kP2BulkAllFlat's form, moe_combine_elem_flat, set_hc_flat_combine(1), the default) against the
// kP2BulkAll instance's loop (0): the same products and the same fp64 sum in slot order, so the same logits bits.
// On the one geometry whose one-row mixes take hc_mix.cu's kernel (3), with its tiles (the form needs them).
TEST(CudaOps, OneRowMixFlatCombineGivesTheLoopsBits) {
  REQUIRE_GPU();
  for_each_model({3}, [](const Model& m, const Geometry& g) {
    expect_form_keeps_logits(m, g, 23, [](int on) { set_hc_flat_combine(on); }, hc_flat_combine_launches,
                             "the flat combine's logits differ from the loop's",
                             "no one-row mix combined a MoE output the flat way");
  });
}

// The one-row mix's flat form with the inject head's tile pair staged in shared memory before the wait
// (hc_mix.cu's kP2StagedCount, set_hc_staged_pair(1), the default) against the flat form (0): the same words and
// MMAs in the same order, so the same logits bits.
TEST(CudaOps, OneRowMixStagedPairGivesTheFlatBits) {
  REQUIRE_GPU();
  for_each_model({3}, [](const Model& m, const Geometry& g) {
    expect_form_keeps_logits(m, g, 29, [](int on) { set_hc_staged_pair(on); }, hc_staged_pair_launches,
                             "the staged pair's logits differ from the flat form's",
                             "no one-row mix took the staged instance");
  });
}

// The one-row mix's grid barrier as one wrapping count (hc_mix.cu grid_barrier_count,
// set_hc_count_barrier(1)) against the generation barrier (0), with the flat form and the staged pair:
// the same arithmetic, so the same logits bits (a barrier that let a block through early would read
// partial products not yet written: other bits, or a trap where it never let one through).
TEST(CudaOps, OneRowMixCountBarrierGivesTheSameBits) {
  REQUIRE_GPU();
  for_each_model({3}, [](const Model& m, const Geometry& g) {
    for (int staged : {0, 1}) {
      SCOPED_TRACE(staged ? "staged pair" : "flat form");
      set_hc_staged_pair(staged);
      const size_t launches = hc_count_barrier_launches(), staged_launches = hc_staged_pair_launches();
      expect_switch_keeps_logits(m, g, 37, [](int on) { set_hc_count_barrier(on); },
                                 "the count barrier's logits differ from the generation barrier's");
      EXPECT_GT(hc_count_barrier_launches(), launches) << "no one-row mix took a count barrier's instance";
      EXPECT_EQ(hc_staged_pair_launches() > staged_launches, staged == 1);
    }
    set_hc_staged_pair(-1);
  });
}

// The logits of `tokens` in a new session, one row a step (every mix is the one-row kernel).
std::vector<float> one_row_logits(const Model& m, const std::vector<int32_t>& tokens) {
  auto s = m.new_session(64);
  std::vector<float> out;
  StepResult res;
  for (size_t pos = 0; pos < tokens.size(); ++pos) {
    EXPECT_TRUE(s->step_rows(std::span<const int32_t>(tokens.data() + pos, 1), false, true, &res).ok());
    s->commit(1);
    out.insert(out.end(), res.logits.begin(), res.logits.end());
  }
  return out;
}

// `form`'s logits differ from `base`'s by roundings only (within the CPU parity tolerance), and `again`
// (the same form in a second session) has form's bits.
void expect_rounding_only(const std::vector<float>& form, const std::vector<float>& base, const std::vector<float>& again,
                          const Geometry& g, const char* what) {
  ASSERT_EQ(form.size(), base.size());
  const double rl = rel_l2(form.data(), base.data(), form.size());
  std::printf("  %-60s %s: logits rel L2 %.3g\n", g.name.c_str(), what, rl);
  EXPECT_LE(rl, 1e-4);  // LayerPiecesOnRandomModels' tolerance against the CPU
  ASSERT_EQ(again.size(), form.size());
  EXPECT_EQ(std::memcmp(form.data(), again.data(), form.size() * sizeof(float)), 0)
      << what << ": other bits in a second session";
}

// One-row logits of 24 random tokens with set(base_mode), then twice with set(form_mode): the form ran
// (its launch count grew, and did not under the base), and moves the logits by roundings only
// (expect_rounding_only). set(-1) after.
template <class Set, class Count>
void expect_form_rounds_only(const Model& m, const Geometry& g, uint64_t seed, Set set, Count launches, int base_mode,
                             int form_mode, const char* not_run, const char* what) {
  const std::vector<int32_t> tokens = random_tokens(24, g.cfg.vocab_size, g.cfg.ple_eos(), seed);
  auto run = [&](int mode) {
    set(mode);
    return one_row_logits(m, tokens);
  };
  const size_t before = launches();
  const std::vector<float> base = run(base_mode);
  EXPECT_EQ(launches(), before);
  const std::vector<float> form = run(form_mode), again = run(form_mode);
  EXPECT_GT(launches(), before) << not_run;
  set(-1);
  expect_rounding_only(form, base, again, g, what);
}

// The one-row mix's phase 2 from the exact sums of its chunks' partial products (hc_mix.cu hc_acc_add,
// set_hc_exact_sum(1)) against every consumer block adding the partials in chunk order (0): the sums
// round once instead of at every addition, so the logits move by roundings only (within the CPU parity
// tolerance); the same bits on a second session (the accumulators' two buffers alternate every mix and
// are zeroed for the next one: a buffer left dirty would add one mix's partials into another's). With
// every partial out of range (set_hc_exact_sum(2)), each mix takes the fallback, the chunk-order sums
// read from L2: the old bits. On the one geometry whose one-row mixes take hc_mix.cu's kernel (3).
TEST(CudaOps, OneRowMixExactSumsMatchTheChunkOrderSums) {
  REQUIRE_GPU();
  for_each_model({3}, [](const Model& m, const Geometry& g) {
    expect_switch_keeps_logits(m, g, 15, [](int on) { set_hc_exact_sum(on > 0 ? 2 : on); },
                               "the exact sums' fallback changed the chunk-order sums' logits");
    expect_form_rounds_only(m, g, 16, [](int mode) { set_hc_exact_sum(mode); }, hc_exact_sum_launches, 0, 1,
                            "the one-row mix did not take its exact sums", "exact sums against chunk order");
  });
}

// The one-row mix in fewer, larger chunks (set_hc_chunk_groups(5): at geometry 3's H of 320, one chunk a
// stream instead of five) against the default chunks: the partials' boundaries move, so the logits move by
// roundings only (within the CPU parity tolerance), and the same bits in a second session.
TEST(CudaOps, OneRowMixLargerChunksStayWithinTolerance) {
  REQUIRE_GPU();
  for_each_model({3}, [](const Model& m, const Geometry& g) {
    expect_form_rounds_only(m, g, 43, [](int min_groups) { set_hc_chunk_groups(min_groups); }, hc_chunk_groups_launches,
                            1, 5, "no one-row mix took larger chunks", "larger chunks against the default's");
  });
}

// expect_switch_keeps_logits on every geometry whose experts are in tiles (Model::tiled_experts; at
// least one is, or the switch's path did not run).
template <class Set>
void expect_tiled_switch_keeps_logits(uint64_t seed, Set set, const char* what) {
  int tiled = 0;
  for (const Geometry& g : geometries()) {
    SCOPED_TRACE(g.name);
    auto rm = make_random_model(g.cfg, g.opt);
    auto dm = Model::create(rm->weights, rm->experts);
    ASSERT_TRUE(dm.ok()) << dm.status().message();
    if (!(*dm)->tiled_experts()) continue;
    ++tiled;
    expect_switch_keeps_logits(**dm, g, seed, set, what);
  }
  EXPECT_GE(tiled, 1) << "no geometry has its experts in tiles, so this switch's path did not run (" << what << ")";
}

// The shared expert's gate/up blocks copying their tiles before their wait (set_expert_shared_early,
// the default) read the same matrices and vector as after it: logits bit for bit at steps of 1-8 rows.
TEST(CudaOps, SharedExpertEarlyGivesTheSameLogits) {
  REQUIRE_GPU();
  expect_tiled_switch_keeps_logits(12, [](int on) { set_expert_shared_early(on); },
                                   "the shared expert's early copy changed the logits");
}

// The tiled experts through the streaming kernels (set_expert_stream, the default; 5 blocks, so each
// runs many tiles) and through a block per tile or chunk: logits bit for bit at steps of 1-8 rows.
TEST(CudaOps, ExpertStreamGivesTheSameLogits) {
  REQUIRE_GPU();
  expect_tiled_switch_keeps_logits(13, [](int on) { set_expert_stream(on, on > 0 ? 5 : 0); },
                                   "the streaming expert kernels changed the logits");
}

// The tiled experts' gate/up and down as one kernel (set_expert_fused(1) and (2), off by default; 5 blocks, so
// each team runs many tiles and chunks and waits on other blocks' tiles) and as the two streaming
// kernels: logits bit for bit at steps of 1-8 rows.
TEST(CudaOps, ExpertFusedGivesTheSameLogits) {
  REQUIRE_GPU();
  for (int mode : {1, 2})  // blocks of two teams, of one team
    expect_tiled_switch_keeps_logits(14, [mode](int on) {
      set_expert_fused(on > 0 ? mode : on);
      if (on < 0) set_expert_stream(-1);
      else set_expert_stream(1, on > 0 ? 5 : 0);
    }, mode == 1 ? "the fused expert kernel changed the logits" : "the one-team fused expert kernel changed the logits");
}

// A model whose experts cannot all be resident fails at creation with one error naming the sizes
// (CK_DEVICE_MEMORY_GB caps the free memory counted), instead of inside cudaMalloc; with room it loads.
TEST(CudaOps, ModelTooLargeForTheGpuFailsCleanly) {
  REQUIRE_GPU();
  const Geometry g = geometries()[0];
  auto rm = make_random_model(g.cfg, g.opt);
  ASSERT_EQ(setenv("CK_DEVICE_MEMORY_GB", "0.001", 1), 0);
  auto small = Model::create(rm->weights, rm->experts);
  ASSERT_EQ(unsetenv("CK_DEVICE_MEMORY_GB"), 0);
  ASSERT_FALSE(small.ok());
  EXPECT_NE(small.status().message().find("the routed experts need"), std::string::npos) << small.status().message();
  EXPECT_NE(small.status().message().find("GiB are free"), std::string::npos) << small.status().message();
  ASSERT_EQ(setenv("CK_DEVICE_MEMORY_GB", "lots", 1), 0);  // a bad value is named, not read as 0
  auto bad = Model::create(rm->weights, rm->experts);
  ASSERT_EQ(unsetenv("CK_DEVICE_MEMORY_GB"), 0);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("CK_DEVICE_MEMORY_GB=lots"), std::string::npos) << bad.status().message();
  auto fits = Model::create(rm->weights, rm->experts);
  EXPECT_TRUE(fits.ok()) << fits.status().message();
}

// A GPU without room for the dense weights (all but 64 MB of it taken here before the model loads):
// one error naming the tensor that found none, not an abort inside cudaMalloc; with the room back it
// loads.
TEST(CudaOps, DenseWeightsTooLargeForTheGpuFailClean) {
  REQUIRE_GPU();
  const Geometry g = geometries()[0];
  auto rm = make_random_model(g.cfg, g.opt);
  init_kernels();  // (their modules and attributes first: the test starves the weights, not the kernels)
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  const size_t keep = size_t{64} << 20;
  ASSERT_GT(free_b, keep);
  void* hog = nullptr;
  if (cudaMalloc(&hog, free_b - keep) != cudaSuccess) {  // (a fragmented device: not this test's subject)
    (void)cudaGetLastError();
    GTEST_SKIP() << "could not take all but 64 MB of the GPU's memory";
  }
  auto starved = Model::create(rm->weights, rm->experts);
  CUDA_CHECK(cudaFree(hog));
  ASSERT_FALSE(starved.ok());
  EXPECT_NE(starved.status().message().find("dense weights do not fit"), std::string::npos)
      << starved.status().message();
  auto fits = Model::create(rm->weights, rm->experts);
  EXPECT_TRUE(fits.ok()) << fits.status().message();
}

// A whole prefill through chunks of 32 rows with every expert matrix (routed and shared) 4-bit in groups
// of 64, so the experts take the factored tensor-core kernels (gemm_q4.cu), against the CPU.
TEST(CudaOps, PrefillChunksWithQ4ExpertsMatchCpu) {
  REQUIRE_GPU();
  Geometry g = geometries()[1];
  g.cfg.hc_lowrank = 64;  // every dense matrix's columns a multiple of 64
  g.opt.dense = WeightForm{DType::U32, 4, 64, DType::BF16};
  auto rm = make_random_model(g.cfg, g.opt);
  ck::cpu::Model cm(rm->weights, rm->experts);
  auto dm = Model::create(rm->weights, rm->experts);
  ASSERT_TRUE(dm.ok()) << dm.status().message();
  ASSERT_TRUE((*dm)->prefill_experts_q4());
  const int T = 100;
  const std::vector<int32_t> tokens = random_tokens(T, g.cfg.vocab_size, g.cfg.ple_eos(), 11);
  std::map<std::string, std::vector<float>> ref;
  std::vector<float> ref_logits;
  cpu_taps(cm, tokens, &ref, &ref_logits);
  for (int parts : {2, 3}) {  // x in two bf16 parts (the default) and three (exact products)
    set_prefill_parts(parts);
    auto s = (*dm)->new_session(128);
    s->set_prefill_chunk(32);
    StepResult res;
    ASSERT_TRUE(s->step_rows(tokens, false, true, &res).ok());
    ASSERT_EQ(res.logits.size(), ref_logits.size());
    const double rl = rel_l2(res.logits.data(), ref_logits.data(), ref_logits.size());
    std::printf("  q4 experts, prefill chunks of 32, %d bf16 parts: logits rel_l2 %.3e\n", parts, rl);
    EXPECT_LE(rl, 1e-4) << parts << " parts";
  }
  set_prefill_parts(-1);
}

// A prefill chunk's mix normalises R where its down projection's activation split and its up
// projection's gate mean read it (XNorm: the norm kernel writes each stream's 1 / rms, not X): the same
// values as the X it no longer writes, so the same logits, bit for bit, on every geometry, with the
// warpgroup kernels' folded three-warpgroup form (the one the mix's products take at the released
// geometry). The counter shows the path ran: on the last geometry, the fused one-row mix's at H = 2,048
// (hc_combine_rmsnorm's fused kernel, which writes the 1 / rms, takes H >= 2,048; the others keep X).
TEST(CudaOps, PrefillMixNormWhereReadGivesTheSameBits) {
  REQUIRE_GPU();
  std::vector<Geometry> gs = geometries();
  {
    Geometry g = gs.back();  // q4g64 H320 hc4 low rank 256, tiles
    g.name = "q4g64 H2048 hc4 low rank 256, tiles";
    g.cfg.hidden_size = 2048;
    gs.push_back(g);
  }
  for (size_t gi = 0; gi < gs.size(); ++gi) {
    const Geometry& g = gs[gi];
    SCOPED_TRACE(g.name);
    auto rm = make_random_model(g.cfg, g.opt);
    auto dm = Model::create(rm->weights, rm->experts);
    ASSERT_TRUE(dm.ok()) << dm.status().message();
    const std::vector<int32_t> tokens = random_tokens(100, g.cfg.vocab_size, g.cfg.ple_eos(), 21);
    set_q4_wg_min_rows(1);
    set_q4_wg_wide(1);
    set_q4_wg_fold(3);
    std::vector<float> logits[2];
    uint64_t used[2] = {};
    for (int on : {1, 0}) {
      set_hc_xnorm(on);
      const uint64_t before = hc_xnorm_calls();
      auto s = (*dm)->new_session(128);
      s->set_prefill_chunk(40);
      StepResult res;
      ASSERT_TRUE(s->step_rows(tokens, false, true, &res).ok());
      logits[on] = res.logits;
      used[on] = hc_xnorm_calls() - before;
    }
    set_hc_xnorm(-1);
    set_q4_wg_min_rows(-1);
    set_q4_wg_wide(-1);
    set_q4_wg_fold(-1);
    std::printf("  %s: %llu of the mix's down projections normalised R where read\n", g.name.c_str(),
                static_cast<unsigned long long>(used[1]));
    if (gi + 1 == gs.size()) {
      EXPECT_GT(used[1], 0u) << "the mix never took the norm on the fly";
    }
    EXPECT_EQ(used[0], 0u);
    ASSERT_EQ(logits[0].size(), logits[1].size());
    EXPECT_EQ(std::memcmp(logits[0].data(), logits[1].data(), sizeof(float) * logits[0].size()), 0)
        << "the logits' bits differ with the norm applied where read";
  }
}

// Prefill chunks (more rows than a row-path step) take their own kernels: the chunked delta rule, the
// grouped GEMMs, and attention with the query heads of one KV head in a block (attn_heads_kernel).
// Every geometry, plus 24 query heads over 2 KV heads (12 per group, so two blocks of 6, as the
// released model), through chunks of 40 rows (the GDN conv's row blocks are 32: one reads the state,
// the next its history from the chunk) against the CPU.
TEST(CudaOps, PrefillChunksMatchCpuOnEveryGeometry) {
  REQUIRE_GPU();
  std::vector<Geometry> gs = geometries();
  {
    Geometry g = gs[0];
    g.name += ", 24 heads over 2 KV heads";
    g.cfg.num_attention_heads = 24;
    g.cfg.num_key_value_heads = 2;
    gs.push_back(g);
  }
  for (const Geometry& g : gs) {
    SCOPED_TRACE(g.name);
    auto rm = make_random_model(g.cfg, g.opt);
    ck::cpu::Model cm(rm->weights, rm->experts);
    auto dm = Model::create(rm->weights, rm->experts);
    ASSERT_TRUE(dm.ok()) << dm.status().message();
    const int T = 100;
    const std::vector<int32_t> tokens = random_tokens(T, g.cfg.vocab_size, g.cfg.ple_eos(), 13);
    std::map<std::string, std::vector<float>> ref;
    std::vector<float> ref_logits;
    cpu_taps(cm, tokens, &ref, &ref_logits);
    // Both dense 4-bit kernels on Hopper: the warpgroup-MMA one (below its row threshold only here),
    // where every matrix is in tiles in its 64- and its 128-token bulk-copy forms (set_q4_wg_wide).
    // 3: the 128-token bulk form folded (set_q4_wg_fold), 4: folded with three warpgroups a block,
    // 5: that in fp16 (set_q4_wg_f16), 6: fp16 with four warpgroups a block.
    for (int form : {0, 1, 2, 3, 4, 5, 6}) {
      set_q4_wg_min_rows(form ? 1 : -1);
      set_q4_wg_wide(form >= 2 ? 1 : 0);
      set_q4_wg_fold(form == 3 ? 1 : form >= 4 ? 3 : 0);
      set_q4_wg_f16(form == 5 ? 1 : form == 6 ? 4 : 0);
      auto s = (*dm)->new_session(128);
      s->set_prefill_chunk(40);
      StepResult res;
      ASSERT_TRUE(s->step_rows(tokens, false, true, &res).ok());
      ASSERT_EQ(res.logits.size(), ref_logits.size());
      const double rl = rel_l2(res.logits.data(), ref_logits.data(), ref_logits.size());
      std::printf("  %s, prefill chunks of 40%s: logits rel_l2 %.3e\n", g.name.c_str(),
                  form == 1   ? " (wgmma dense)"
                  : form == 2 ? " (wgmma dense, 128-token bulk form)"
                  : form == 3 ? " (wgmma dense, 128-token bulk form, folded)"
                  : form == 4 ? " (wgmma dense, 128-token bulk form, folded, 3 warpgroups)"
                  : form == 5 ? " (wgmma dense, 128-token bulk form, folded, 3 warpgroups, fp16)"
                  : form == 6 ? " (wgmma dense, 128-token bulk form, folded, 4 warpgroups, fp16)"
                              : "",
                  rl);
      EXPECT_LE(rl, 1e-4);
    }
    set_q4_wg_min_rows(-1);
    set_q4_wg_wide(-1);
    set_q4_wg_fold(-1);
    set_q4_wg_f16(-1);
  }
}

// Prefill rows that select every key go to attn_dense_rows_tc_kernel (R = 64 / hpg rows of one KV head
// per block, online softmax over 64-key tiles): against one block per row (set_attn_dense(0)) and the
// CPU; bit for bit, 32 MMA rows a block against 64, the per-row kernel's Q fragments from registers
// against shared memory, and K and V split once per call against split by each lane. A budget of 160
// keys, so the dense rows span three tiles; chunks of 48 rows (one chunk holds dense and selecting
// rows, the later ones none of the first kind) and one chunk of all 240 rows; 3, 12 and 16 query
// heads per KV head (21, 5 and 4 rows per block), head dims 32 and 64.
TEST(CudaOps, DenseAttentionRowsMatchThePerRowKernel) {
  REQUIRE_GPU();
  const std::vector<Geometry> all = geometries();
  std::vector<Geometry> gs = {all[0], all[0], all[0], all[1]};
  gs[1].name += ", 24 heads over 2 KV heads";
  gs[1].cfg.num_attention_heads = 24;
  gs[1].cfg.num_key_value_heads = 2;
  gs[2].name += ", 16 heads over 1 KV head";
  gs[2].cfg.num_attention_heads = 16;
  for (Geometry& g : gs) g.cfg.indexer_budget = 160;
  const int T = 240;
  for (const Geometry& g : gs) {
    SCOPED_TRACE(g.name);
    const int cr = g.cfg.indexer_compress_ratio, topk = g.cfg.indexer_budget / cr;
    ASSERT_GT((topk + 1) * cr - 1, 128) << "the dense rows must span more than two 64-key tiles";
    ASSERT_LT((topk + 1) * cr - 1, T) << "the prompt must go past the dense rows";
    auto rm = make_random_model(g.cfg, g.opt);
    ck::cpu::Model cm(rm->weights, rm->experts);
    auto dm = Model::create(rm->weights, rm->experts);
    ASSERT_TRUE(dm.ok()) << dm.status().message();
    const std::vector<int32_t> tokens = random_tokens(T, g.cfg.vocab_size, g.cfg.ple_eos(), 19);
    std::map<std::string, std::vector<float>> ref;
    std::vector<float> ref_logits;
    cpu_taps(cm, tokens, &ref, &ref_logits);
    for (int chunk : {48, T}) {
      // 0: the per-row kernel alone, 1 and 2: the dense-rows kernel (64 and 32 MMA rows) before it, 3:
      // the per-row kernel with its Q fragments in shared memory, 4 and 5: 1 and 0 with K and V split by
      // each lane as it reads them instead of once per call.
      std::vector<float> logits[6];
      for (int dense : {0, 1, 2, 3, 4, 5}) {
        set_attn_dense(dense == 0 || dense == 3 || dense == 5 ? 0 : dense == 2 ? 32 : 64);
        set_attn_qreg(dense == 3 ? 0 : 1);
        set_attn_presplit(dense >= 4 ? 0 : 1);
        auto s = (*dm)->new_session(256);
        s->set_prefill_chunk(chunk);
        StepResult res;
        ASSERT_TRUE(s->step_rows(tokens, false, true, &res).ok());
        ASSERT_EQ(res.logits.size(), ref_logits.size());
        logits[dense] = res.logits;
      }
      const double cpu_dense = rel_l2(logits[1].data(), ref_logits.data(), ref_logits.size());
      const double cpu_rows = rel_l2(logits[0].data(), ref_logits.data(), ref_logits.size());
      const double dense_rows = rel_l2(logits[1].data(), logits[0].data(), ref_logits.size());
      std::printf("  %s, chunks of %d: logits rel_l2 dense-rows kernel %.3e, per-row kernel %.3e (vs CPU), "
                  "between them %.3e\n", g.name.c_str(), chunk, cpu_dense, cpu_rows, dense_rows);
      EXPECT_LE(cpu_dense, 1e-4);
      EXPECT_LE(cpu_rows, 1e-4);
      EXPECT_LE(dense_rows, 2e-5);  // the same products, another order of the softmax's divisions
      // 32 MMA rows a block: other rows share a block, the same bits (a row's do not depend on them).
      EXPECT_EQ(logits[2], logits[1]);
      // The per-row kernel's Q fragments from registers or shared memory, K and V split once or by every
      // lane: the same operands, the same bits.
      EXPECT_EQ(logits[3], logits[0]);
      EXPECT_EQ(logits[4], logits[1]);
      EXPECT_EQ(logits[5], logits[0]);
    }
  }
  set_attn_dense(-1);
  set_attn_qreg(-1);
  set_attn_presplit(-1);
}

// The indexer's block scores (attention_block_scores) on random queries and block keys: the tiled
// prefill kernel gives the CPU reference's bits (its order and rounding: each product rounded, then
// added, dimension 0 first; heads in order; / sqrt(ihd)), the warp kernel (a step's rows, and chunks
// with set_attn_scores_tiled(0)) agrees within fp32 rounding of another order. Neither writes a
// score the top-k does not read (rows that select every block, blocks past a row's count). Shapes:
// the released one (4 x 128, cr 4), heads not a multiple of the 4 staged at a time with a head size
// not a multiple of the 32 staged at a time and a padded query row, cr 1, row counts across the
// 64-row tiles, rows that start below the budget and cross it.
TEST(CudaOps, BlockScoresTiledGiveTheCpuBits) {
  REQUIRE_GPU();
  init_kernels();
  struct Case { int inh, ihd, ldiq_pad, cr, topk, rows; int64_t pos; };
  const Case cases[] = {{4, 128, 0, 4, 8, 150, 40}, {5, 36, 4, 3, 5, 77, 0}, {1, 8, 0, 1, 70, 9, 100},
                        {4, 128, 0, 4, 512, 200, 2000}, {3, 64, 8, 2, 16, 130, 1}};
  std::mt19937_64 rng(29);
  const float sentinel = 12345.0f;
  for (const Case& k : cases) {
    const int ldiq = k.inh * k.ihd + k.ldiq_pad;
    const int64_t nb_max = (k.pos + k.rows) / k.cr;
    std::vector<float> iq = randn(static_cast<size_t>(k.rows) * ldiq, rng);
    std::vector<float> keys = randn(static_cast<size_t>(nb_max) * k.ihd, rng);
    std::vector<float> want(static_cast<size_t>(k.rows) * nb_max, sentinel);
    std::vector<double> scale(want.size(), 0.0);  // sum of |q_i k_i| / sqrt(ihd): what fp32 rounding is relative to
    for (int r = 0; r < k.rows; ++r) {
      const int64_t nb = (k.pos + r + 1) / k.cr;
      if (nb <= k.topk) continue;
      for (int64_t b = 0; b < nb; ++b) {
        float sum = 0.0f;
        for (int h = 0; h < k.inh; ++h) {
          float dot = 0.0f;
          for (int i = 0; i < k.ihd; ++i) {
            const float q = iq[static_cast<size_t>(r) * ldiq + h * k.ihd + i], kk = keys[b * k.ihd + i];
            dot += q * kk;
            scale[r * nb_max + b] += std::fabs(static_cast<double>(q) * kk);
          }
          sum += std::max(dot, 0.0f);
        }
        want[r * nb_max + b] = sum / std::sqrt(static_cast<float>(k.ihd));
        scale[r * nb_max + b] /= std::sqrt(static_cast<double>(k.ihd));
      }
    }
    DeviceBuffer<float> iqd, kd, sd;
    DeviceBuffer<StepParams> spd(1);
    StepParams sp;
    sp.pos = k.pos;
    CUDA_CHECK(cudaMemcpy(spd.get(), &sp, sizeof(sp), cudaMemcpyHostToDevice));
    AttnArgs a;
    a.iq = to_device(iq, &iqd);
    a.ldiq = ldiq;
    a.blk_keys = to_device(keys, &kd);
    a.nb_max = nb_max;
    a.inh = k.inh;
    a.ihd = k.ihd;
    a.cr = k.cr;
    a.block_topk = k.topk;
    for (int tiled : {1, 0}) {
      set_attn_scores_tiled(tiled);
      const std::vector<float> init(want.size(), sentinel);
      a.scores = to_device(init, &sd);
      attention_block_scores(a, spd.get(), k.rows, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> got = to_host(a.scores, want.size());
      size_t differ = 0, scored = 0;
      double worst = 0.0;
      for (size_t e = 0; e < want.size(); ++e) {
        if (want[e] == sentinel) {
          EXPECT_EQ(got[e], sentinel) << "a score the top-k does not read, entry " << e;
          continue;
        }
        ++scored;
        differ += std::memcmp(&got[e], &want[e], sizeof(float)) != 0;
        worst = std::max(worst, std::fabs(static_cast<double>(got[e]) - want[e]) / scale[e]);
      }
      std::printf("  block scores %s: inh %d ihd %3d cr %d topk %3d rows %3d pos %4lld: %zu scores, %zu differ from the CPU's bits, worst error %.2e of sum |q k|\n",
                  tiled && k.rows > kMaxRows ? "tiled" : "warp ", k.inh, k.ihd, k.cr, k.topk, k.rows,
                  static_cast<long long>(k.pos), scored, differ, worst);
      EXPECT_GT(scored, 0u);
      if (tiled && k.rows > kMaxRows) {
        EXPECT_EQ(differ, 0u);
      }
      EXPECT_LE(worst, 1e-5) << "error relative to the sum of |q k|";
    }
  }
  set_attn_scores_tiled(-1);
}

// Attention over a context of more compressed blocks than a block has threads (attn_gather_selected
// gives each thread a run of blocks): 880 tokens of prefill chunks, then one-row decode steps, every
// row's logits against the CPU; decode attention in one block per head, then split over blocks of 4
// selected keys (attn_decode_split_kernel: 3 splits of the 11 keys a query selects here).
TEST(CudaOps, LongContextAttentionMatchesCpu) {
  REQUIRE_GPU();
  const Geometry g = geometries()[0];
  SCOPED_TRACE(g.name);
  auto rm = make_random_model(g.cfg, g.opt);
  ck::cpu::Model cm(rm->weights, rm->experts);
  auto dm = Model::create(rm->weights, rm->experts);
  ASSERT_TRUE(dm.ok()) << dm.status().message();
  const int T = 900, P = 880, V = static_cast<int>(g.cfg.vocab_size);
  ASSERT_GT(P / g.cfg.indexer_compress_ratio, 256) << "the context must exceed one block per thread";
  const std::vector<int32_t> tokens = random_tokens(T, g.cfg.vocab_size, g.cfg.ple_eos(), 17);
  std::map<std::string, std::vector<float>> ref;
  std::vector<float> ref_logits;
  cpu_taps(cm, tokens, &ref, &ref_logits);
  // The prefill rows do not depend on the split: the decode rows are compared on their own, with the
  // CPU and with each other (the split adds in another order: fp32 rounding, not the same bits).
  std::vector<float> unsplit;
  for (int split_keys : {0, 4}) {
    set_attn_split_keys(split_keys);
    auto s = (*dm)->new_session(1024);
    s->set_prefill_chunk(256);
    StepResult res;
    ASSERT_TRUE(s->step_rows(std::span<const int32_t>(tokens.data(), P), false, true, &res).ok());
    s->commit(P);
    const double prefill = rel_l2(res.logits.data(), ref_logits.data(), static_cast<size_t>(P) * V);
    double decode = 0.0, vs_unsplit = 0.0;
    std::vector<float> rows;
    for (int pos = P; pos < T; ++pos) {
      ASSERT_TRUE(s->step_rows(std::span<const int32_t>(tokens.data() + pos, 1), false, true, &res).ok());
      s->commit(1);
      decode = std::max(decode, rel_l2(res.logits.data(), ref_logits.data() + static_cast<size_t>(pos) * V, V));
      rows.insert(rows.end(), res.logits.begin(), res.logits.begin() + V);
    }
    if (split_keys == 0) unsplit = rows;
    else vs_unsplit = rel_l2(rows.data(), unsplit.data(), rows.size());
    std::printf("  %s, %d tokens, decode split keys %d: logits rel_l2 prefill %.3e, decode %.3e (vs unsplit %.3e)\n",
                g.name.c_str(), T, split_keys, prefill, decode, vs_unsplit);
    EXPECT_LE(prefill, 1e-4);
    EXPECT_LE(decode, 1e-4);
    EXPECT_LE(vs_unsplit, 1e-5);
  }
  set_attn_split_keys(-1);
}

// The MTP head (spec §10) of a random model with 4-bit dense and expert matrices (the fixtures' heads
// are bf16): CUDA mtp_step against the CPU's on the same inputs, the CPU trunk's hiddens at the
// prompt's positions, then a chain of drafts from the CPU head's own outputs.
TEST(CudaOps, MtpHeadOnRandomModelMatchesCpu) {
  REQUIRE_GPU();
  Geometry g = geometries()[1];
  g.opt.mtp = true;
  auto rm = make_random_model(g.cfg, g.opt);
  ASSERT_TRUE(rm->weights.mtp.has_value());
  ck::cpu::Model cm(rm->weights, rm->experts);
  auto dm = Model::create(rm->weights, rm->experts);
  ASSERT_TRUE(dm.ok()) << dm.status().message();
  ASSERT_TRUE((*dm)->has_mtp());
  const int T = 24, V = static_cast<int>(g.cfg.vocab_size), W = static_cast<int>(g.cfg.wide());
  const std::vector<int32_t> tokens = random_tokens(T, g.cfg.vocab_size, g.cfg.ple_eos(), 5);
  auto cs = cm.new_session();
  ck::cpu::StepResult tr;
  ASSERT_TRUE(cs->step_rows(tokens, false, false, &tr).ok());
  cs->commit(T);
  auto gs = (*dm)->new_session(64);
  std::vector<float> lc(V), lg(V), hc(W), hg(W);
  double worst = 0;
  auto both = [&](const float* h, int32_t x, int64_t pos) {
    ASSERT_TRUE(cs->mtp_step(h, x, pos, lc.data(), hc.data()).ok());
    Status st = gs->mtp_step(h, x, pos, lg.data(), hg.data());
    ASSERT_TRUE(st.ok()) << st.message();
    const double el = rel_l2(lg.data(), lc.data(), V), eh = rel_l2(hg.data(), hc.data(), W);
    worst = std::max({worst, el, eh});
    EXPECT_LE(el, 1e-4) << "logits at MTP position " << pos;
    EXPECT_LE(eh, 1e-4) << "h_out at MTP position " << pos;
  };
  for (int t = 0; t + 1 < T; ++t) both(tr.hidden.data() + static_cast<size_t>(t) * W, tokens[t + 1], t);
  std::vector<float> h(tr.hidden.end() - W, tr.hidden.end());
  int32_t x = tokens[0];
  for (int k = 0; k < 6; ++k) {
    both(h.data(), x, T - 1 + k);
    h = hc;
    x = static_cast<int32_t>(std::max_element(lc.begin(), lc.end()) - lc.begin());
  }
  std::printf("  random q4 MTP head: worst rel L2 %.3g over %d steps\n", worst, T - 1 + 6);
}

// The step scratch (common.h scratch_alloc) is a stack inside a ScratchScope: 256-byte aligned
// pieces, a free pops the piece and everything after it, nested scopes restore the outer one. Host
// memory stands in for the device arena: inside a scope that has room, no CUDA call is made, so this
// runs without a GPU. Outside a scope, and past the stack's end, the stream-ordered allocator (GPU only).
TEST(CudaOps, StepScratchIsAStackInsideItsScope) {
  std::vector<uint8_t> host(4096);
  StepScratch sc;
  sc.base = host.data();
  sc.size = host.size();
  StepScratch inner;
  std::vector<uint8_t> host2(1024);
  inner.base = host2.data();
  inner.size = host2.size();
  {
    ScratchScope scope(&sc);
    void* a = scratch_alloc(100, nullptr);
    void* b = scratch_alloc(300, nullptr);
    EXPECT_EQ(a, sc.base);
    EXPECT_EQ(b, sc.base + 256);  // 100 bytes rounded up to 256
    EXPECT_EQ(sc.top, 256u + 512u);
    scratch_free(b, nullptr);
    EXPECT_EQ(sc.top, 256u);
    void* c = scratch_alloc(16, nullptr);
    EXPECT_EQ(c, b);  // b's place again
    {
      ScratchScope nested(&inner);
      EXPECT_EQ(scratch_alloc(8, nullptr), inner.base);
      EXPECT_EQ(sc.top, 512u);  // the outer stack is untouched
    }
    EXPECT_EQ(scratch_alloc(8, nullptr), sc.base + 512);  // the outer scope again
    scratch_free(a, nullptr);  // out of order: pops everything after a too
    EXPECT_EQ(sc.top, 0u);
    scratch_free(c, nullptr);  // already popped: the top stays
    EXPECT_EQ(sc.top, 0u);
    if (have_gpu()) {  // past the end: a device allocation, freed to the stream-ordered allocator
      void* big = scratch_alloc(host.size() + 1, nullptr);
      EXPECT_TRUE(big < static_cast<void*>(sc.base) || big >= static_cast<void*>(sc.base + sc.size));
      scratch_free(big, nullptr);
      CUDA_CHECK(cudaStreamSynchronize(nullptr));
    }
  }
  if (have_gpu()) {  // no scope: the stream-ordered allocator
    void* d = scratch_alloc(64, nullptr);
    EXPECT_NE(d, nullptr);
    scratch_free(d, nullptr);
    CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }
}

#else
TEST(CudaOps, NotBuilt) { GTEST_SKIP() << "this build has no CUDA engine"; }
#endif

}  // namespace
