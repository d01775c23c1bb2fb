// Reference ops in plain fp32 loops: the building blocks of the CPU forward (src/cpu/qwen4_exp.cpp)
// and the twins of the CUDA kernels (src/cuda/), which are tested against them. Readable first.
#pragma once
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "format/matrix.h"

namespace ck::cpu {

// y (rows) = W (rows, cols) · x (cols). Quantized W is dequantized group by group.
void matvec(const Matrix& w, const float* x, float* y);

// Zero-centred or plain RMS norm with one statistic per group of `group` values (spec §3 N1):
// out[i] = x[i] * rsqrt(mean_group(x^2) + eps) * scale[i].  n must be a multiple of group.
void rmsnorm_grouped(const float* x, int64_t n, int64_t group, const float* scale, float eps, float* out);

// x * rsqrt(sum(x^2) + eps) (spec §3 N3), in place.
void l2norm(float* x, int64_t n, float eps);

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }
// torch.nn.functional.softplus: identity above the threshold 20.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// NeoX half rotation of the first `rot_dim` dims of x at position `pos` (spec §7.2).
void rope(float* x, int rot_dim, int64_t pos, double theta);

// Indices of the k largest values, ties broken by the lower index (spec trap 29), in descending order.
std::vector<int> topk_desc(std::span<const float> v, int k);

// Index of the largest value; the lowest index on ties.
int argmax(std::span<const float> v);

}  // namespace ck::cpu
