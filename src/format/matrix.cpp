#include "format/matrix.h"

#include <cmath>
#include <cstring>

#include "util/half.h"
#include "util/status.h"

namespace ck {

size_t Matrix::stored_bytes() const {
  if (!quantized()) return static_cast<size_t>(rows * cols) * dtype_size(dtype);
  size_t groups = static_cast<size_t>(rows * (cols / group_size));
  return static_cast<size_t>(rows) * row_code_bytes() + 2 * groups * dtype_size(scale_dtype);
}

Matrix Matrix::row_slice(int64_t r0, int64_t n) const {
  CHECK(r0 >= 0 && n >= 0 && r0 + n <= rows);
  Matrix s = *this;
  s.rows = n;
  if (!quantized()) {
    s.data = data + static_cast<size_t>(r0 * cols) * dtype_size(dtype);
  } else {
    s.data = data + static_cast<size_t>(r0) * row_code_bytes();
    size_t gstride = static_cast<size_t>(cols / group_size) * dtype_size(scale_dtype);
    s.scales = scales + static_cast<size_t>(r0) * gstride;
    s.biases = biases + static_cast<size_t>(r0) * gstride;
  }
  return s;
}

float load_float(DType dtype, const uint8_t* base, int64_t i) {
  switch (dtype) {
    case DType::F32: { float f; std::memcpy(&f, base + 4 * i, 4); return f; }
    case DType::BF16: { uint16_t h; std::memcpy(&h, base + 2 * i, 2); return bf16_to_f32(h); }
    case DType::F16: { uint16_t h; std::memcpy(&h, base + 2 * i, 2); return f16_to_f32(h); }
    case DType::F64: { double d; std::memcpy(&d, base + 8 * i, 8); return static_cast<float>(d); }
    default: CHECK_MSG(false, "load_float: dtype {} is not a float type", dtype_name(dtype));
  }
  return 0;
}

void store_float(DType dtype, uint8_t* base, int64_t i, float v) {
  switch (dtype) {
    case DType::F32: std::memcpy(base + 4 * i, &v, 4); return;
    case DType::BF16: { uint16_t h = f32_to_bf16(v); std::memcpy(base + 2 * i, &h, 2); return; }
    case DType::F16: { uint16_t h = f32_to_f16(v); std::memcpy(base + 2 * i, &h, 2); return; }
    default: CHECK_MSG(false, "store_float: dtype {} is not a writable float type", dtype_name(dtype));
  }
}

void matrix_row(const Matrix& m, int64_t r, float* out) {
  if (!m.quantized()) {
    const uint8_t* row = m.data + static_cast<size_t>(r * m.cols) * dtype_size(m.dtype);
    if (m.dtype == DType::F32) { std::memcpy(out, row, static_cast<size_t>(m.cols) * 4); return; }
    for (int64_t c = 0; c < m.cols; ++c) out[c] = load_float(m.dtype, row, c);
    return;
  }
  const uint8_t* codes = m.data + static_cast<size_t>(r) * m.row_code_bytes();
  int64_t n_groups = m.cols / m.group_size;
  for (int64_t g = 0; g < n_groups; ++g) {
    float s = load_float(m.scale_dtype, m.scales, r * n_groups + g);
    float b = load_float(m.scale_dtype, m.biases, r * n_groups + g);
    for (int i = 0; i < m.group_size; ++i) {
      int64_t c = g * m.group_size + i;
      out[c] = s * static_cast<float>(get_code(codes, c, m.bits)) + b;
    }
  }
}

void quantize_group(const float* w, int g, int bits, uint32_t* codes, float* scale_out, float* bias_out) {
  const float n_bins = static_cast<float>((1u << bits) - 1u);
  float mn = w[0], mx = w[0];
  for (int i = 1; i < g; ++i) { mn = std::fmin(mn, w[i]); mx = std::fmax(mx, w[i]); }
  float scale = std::fmax((mx - mn) / n_bins, 1e-7f);
  // The edge is the end with the larger magnitude; the scale's sign follows it.
  bool min_edge = std::fabs(mn) > std::fabs(mx);
  float edge = min_edge ? mn : mx;
  if (!min_edge) scale = -scale;
  float q0 = std::rint(edge / scale);
  float bias = 0.0f;
  if (q0 != 0.0f) {
    scale = edge / q0;
    bias = edge;
  }
  for (int i = 0; i < g; ++i) {
    float q = std::rint((w[i] - bias) / scale);
    q = std::fmin(std::fmax(q, 0.0f), n_bins);
    codes[i] = static_cast<uint32_t>(q);
  }
  *scale_out = scale;
  *bias_out = bias;
}

}  // namespace ck
