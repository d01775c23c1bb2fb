// Matrix: a non-owning view of one weight matrix [rows, cols] in any stored form: float (f32, bf16,
// f16) or MLX affine quantized (codes + per-group scales and biases; shared/spec/mlx_affine.md).
// The CPU reference and the packer read weights only through this view, so every checkpoint
// layout and every store record looks the same to them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "format/safetensors.h"

namespace ck {

struct Matrix {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::F32;          // element type for float matrices; U32 for quantized codes
  const uint8_t* data = nullptr;     // float: rows*cols elements; quantized: packed codes, rows*cols*bits/8 bytes
  // Quantized only:
  int bits = 0;                      // 0 = not quantized
  int group_size = 0;
  DType scale_dtype = DType::BF16;   // dtype of scales and biases
  const uint8_t* scales = nullptr;   // [rows, cols/group_size]
  const uint8_t* biases = nullptr;   // [rows, cols/group_size]
  std::string name;                  // for error messages

  bool quantized() const { return bits != 0; }
  bool empty() const { return data == nullptr; }
  size_t row_code_bytes() const { return static_cast<size_t>(cols) * bits / 8; }
  // Bytes of the whole matrix as stored (codes, scales and biases).
  size_t stored_bytes() const;
  // A view of rows [r0, r0+n).
  Matrix row_slice(int64_t r0, int64_t n) const;
};

// Reads element i of a float array of the given dtype.
float load_float(DType dtype, const uint8_t* base, int64_t i);
// Writes element i of a float array (f32, bf16 or f16, rounded to nearest even).
void store_float(DType dtype, uint8_t* base, int64_t i, float v);

// Code i of a little-endian bit stream of `bits`-bit codes. MLX packs 2/4/8-bit codes in u32 words
// lowest bits first and 3/5/6-bit codes in 3- or 5-byte units lowest bits first: in every case code i
// occupies bits [i*bits, (i+1)*bits) of the byte stream.
inline uint32_t get_code(const uint8_t* stream, int64_t i, int bits) {
  uint64_t bit = static_cast<uint64_t>(i) * static_cast<uint64_t>(bits);
  uint64_t byte = bit >> 3;
  uint32_t shift = static_cast<uint32_t>(bit & 7);
  uint32_t v = stream[byte];
  if (shift + bits > 8) v |= static_cast<uint32_t>(stream[byte + 1]) << 8;
  if (shift + bits > 16) v |= static_cast<uint32_t>(stream[byte + 2]) << 16;
  return (v >> shift) & ((1u << bits) - 1u);
}

inline void set_code(uint8_t* stream, int64_t i, int bits, uint32_t code) {
  for (int b = 0; b < bits; ++b) {
    uint64_t bit = static_cast<uint64_t>(i) * bits + b;
    uint8_t mask = static_cast<uint8_t>(1u << (bit & 7));
    if ((code >> b) & 1u) stream[bit >> 3] |= mask;
    else stream[bit >> 3] &= static_cast<uint8_t>(~mask);
  }
}

// Dequantizes (or converts) row r into out[cols] as fp32.
void matrix_row(const Matrix& m, int64_t r, float* out);

// MLX affine quantizer (shared/spec/mlx_affine.md, "The quantizer's rule") for one group of g
// values: writes g codes and returns the fp32 scale and bias.
void quantize_group(const float* w, int g, int bits, uint32_t* codes, float* scale, float* bias);

}  // namespace ck
