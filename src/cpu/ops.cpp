#include "cpu/ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "util/status.h"

namespace ck::cpu {

namespace {
// Σ_c w[c]·x[c] over one quantized row, w = scale·q + bias: per group, scale·Σ (q - m)·x + (bias +
// scale·m)·Σ x with m = 2^(bits-1), the codes' midpoint. The same sum as scale·Σ q·x + bias·Σ x, but
// MLX's bias is about -m·scale (the group's minimum), so that form adds two terms ~m times the result
// that cancel: ~m times its rounding (8-bit codes: 128x). Centred, the two terms are the size of the
// weights' own: the reference stays as close to the dequantized fp32 weights the oracle multiplies as
// a float matrix would. (scale·m is exact: m is a power of two.)
float quant_row_dot(const Matrix& w, int64_t r, const float* x, const float* group_sums) {
  const uint8_t* codes = w.data + static_cast<size_t>(r) * w.row_code_bytes();
  const int64_t n_groups = w.cols / w.group_size;
  const float mid = static_cast<float>(1 << (w.bits - 1));
  float acc = 0.0f;
  for (int64_t g = 0; g < n_groups; ++g) {
    float qx = 0.0f;
    const int64_t c0 = g * w.group_size;
    if (w.bits == 4) {
      const uint8_t* b = codes + c0 / 2;
      for (int i = 0; i < w.group_size; i += 2) {
        uint8_t byte = b[i / 2];
        qx += static_cast<float>((byte & 15) - 8) * x[c0 + i] + static_cast<float>((byte >> 4) - 8) * x[c0 + i + 1];
      }
    } else {
      for (int i = 0; i < w.group_size; ++i)
        qx += (static_cast<float>(get_code(codes, c0 + i, w.bits)) - mid) * x[c0 + i];
    }
    float s = load_float(w.scale_dtype, w.scales, r * n_groups + g);
    float bias = load_float(w.scale_dtype, w.biases, r * n_groups + g);
    acc += s * qx + (bias + s * mid) * group_sums[g];
  }
  return acc;
}
}  // namespace

void matvec(const Matrix& w, const float* x, float* y) {
  CHECK(!w.empty());
  if (w.quantized()) {
    const int64_t n_groups = w.cols / w.group_size;
    std::vector<float> sums(static_cast<size_t>(n_groups), 0.0f);
    for (int64_t g = 0; g < n_groups; ++g)
      for (int i = 0; i < w.group_size; ++i) sums[g] += x[g * w.group_size + i];
#pragma omp parallel for schedule(static) if (w.rows * w.cols > (1 << 18))
    for (int64_t r = 0; r < w.rows; ++r) y[r] = quant_row_dot(w, r, x, sums.data());
    return;
  }
#pragma omp parallel for schedule(static) if (w.rows * w.cols > (1 << 18))
  for (int64_t r = 0; r < w.rows; ++r) {
    float acc = 0.0f;
    if (w.dtype == DType::F32) {
      const float* row = reinterpret_cast<const float*>(w.data) + r * w.cols;
      for (int64_t c = 0; c < w.cols; ++c) acc += row[c] * x[c];
    } else {
      const uint8_t* row = w.data + static_cast<size_t>(r * w.cols) * dtype_size(w.dtype);
      for (int64_t c = 0; c < w.cols; ++c) acc += load_float(w.dtype, row, c) * x[c];
    }
    y[r] = acc;
  }
}

void rmsnorm_grouped(const float* x, int64_t n, int64_t group, const float* scale, float eps, float* out) {
  CHECK(group > 0 && n % group == 0);
  for (int64_t g0 = 0; g0 < n; g0 += group) {
    float ss = 0.0f;
    for (int64_t i = 0; i < group; ++i) ss += x[g0 + i] * x[g0 + i];
    float r = 1.0f / std::sqrt(ss / static_cast<float>(group) + eps);
    for (int64_t i = 0; i < group; ++i) out[g0 + i] = (x[g0 + i] * r) * scale[g0 + i];
  }
}

void l2norm(float* x, int64_t n, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  float r = 1.0f / std::sqrt(ss + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= r;
}

void rope(float* x, int rot_dim, int64_t pos, double theta) {
  const int half = rot_dim / 2;
  for (int j = 0; j < half; ++j) {
    // inv_freq in fp32 as torch computes it: 1 / theta^(2j / rot_dim).
    float inv_freq = 1.0f / static_cast<float>(std::pow(theta, static_cast<double>(2 * j) / rot_dim));
    float angle = static_cast<float>(pos) * inv_freq;
    float c = std::cos(angle), s = std::sin(angle);
    float a = x[j], b = x[j + half];
    x[j] = a * c - b * s;
    x[j + half] = b * c + a * s;
  }
}

std::vector<int> topk_desc(std::span<const float> v, int k) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  k = std::min<int>(k, static_cast<int>(v.size()));
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  });
  idx.resize(static_cast<size_t>(k));
  return idx;
}

int argmax(std::span<const float> v) {
  int best = 0;
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] > v[best]) best = static_cast<int>(i);
  return best;
}

}  // namespace ck::cpu
