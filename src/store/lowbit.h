// Low-bit expert records derived from 4-bit ones (shared/DESIGN.md §1 "Store", experts3/2.bin):
// every group keeps its size and gets a new scale and bias, so a 3- or 2-bit record has the same
// layout as the Q4 one with narrower codes. Two methods, measured in docs/performance.md:
//   TopBits: the known method: the top bits of each code, decoded at the middle of the bucket of Q4
//            codes they stand for, with the same scale and bias (exact in bf16 up to the bias).
//   Refit:   per group, the least-squares scale, bias and codes against the Q4-dequantized values.
#pragma once
#include <cstdint>
#include <string>

#include "format/matrix.h"

namespace ck::store {

enum class LowBitMethod { TopBits, Refit };
const char* lowbit_method_name(LowBitMethod m);
bool parse_lowbit_method(const std::string& s, LowBitMethod* out);

// The default: the method with the lower error in docs/performance.md "Low-bit expert records".
constexpr LowBitMethod kDefaultLowBit = LowBitMethod::Refit;

// Converts one group of Q-`src_bits` codes (scale s, bias b) to `dst_bits`: writes g codes and the
// new scale and bias, rounded to `scale_dtype` (the stored values; codes are chosen for them).
void lowbit_group(const uint32_t* q, int g, int src_bits, float s, float b, int dst_bits, LowBitMethod m,
                  DType scale_dtype, uint32_t* out_codes, float* out_scale, float* out_bias);

// Converts matrix `src` (quantized, src.bits > dst_bits) into dst_bits codes (rows * cols * dst_bits/8
// bytes, rows packed back to back as MLX does) and scales/biases in src.scale_dtype.
void lowbit_matrix(const Matrix& src, int dst_bits, LowBitMethod m, uint8_t* codes, uint8_t* scales, uint8_t* biases);

// Sum of squared differences between the dequantized values of `a` and `b` (same shape), for the
// error figures; `n` gets the element count.
double matrix_sq_error(const Matrix& a, const Matrix& b, int64_t* n);

}  // namespace ck::store
