// The Gated DeltaNet's causal depthwise conv over the in_proj_qkv channels (spec §6), one channel at a
// time: the decode conv kernel's code (layers_deltanet.cu), and the epilogue of the one-row in_proj GEMV
// (gemv_tc4.cu), which convolves each channel as it finishes it instead of handing it to that kernel.
#pragma once

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/layers.h"

namespace ck::cuda {

constexpr int kMaxConvHist = 7;  // GDN conv kernel <= 8

// One row of the depthwise conv for one channel: silu of tap K-1 times the current input, then plus
// each tap times the history (oldest first), as the CPU adds them; then the history shifts by xv.
__device__ __forceinline__ float conv_row(const float* taps, int K, float (&hist)[kMaxConvHist], float xv) {
  float acc = __fmul_rn(taps[K - 1], xv);  // tap K-1 is the current token
#pragma unroll
  for (int j = 0; j < kMaxConvHist; ++j)
    if (j < K - 1) acc = mul_add_rn(acc, taps[j], hist[j]);
#pragma unroll
  for (int j = 0; j < kMaxConvHist; ++j) {
    if (j < K - 2) hist[j] = hist[j + 1 < kMaxConvHist ? j + 1 : j];
    else if (j == K - 2) hist[j] = xv;
  }
  return siluf_(acc);
}

// Channel ch over `rows` rows in order: input(r) is the row's pre-conv value; writes a.y, the state
// after every row but the last when `snap` (a.snaps), and the final state. The channel's only writer.
template <class Input>
__device__ __forceinline__ void gdn_conv_channel(const GdnConvArgs& a, bool snap, int ch, int rows, Input input) {
  const int K = a.K, C = a.C;
  float hist[kMaxConvHist];
#pragma unroll
  for (int j = 0; j < kMaxConvHist; ++j) hist[j] = j < K - 1 ? a.state[static_cast<size_t>(j) * C + ch] : 0.0f;
  const float* taps = a.taps + static_cast<size_t>(ch) * K;
  for (int r = 0; r < rows; ++r) {
    const float xv = input(r);
    a.y[static_cast<size_t>(r) * a.ldy + ch] = conv_row(taps, K, hist, xv);
    if (snap && r + 1 < rows) {
      float* sn = a.snaps + static_cast<size_t>(r) * a.snap_stride;
#pragma unroll
      for (int j = 0; j < kMaxConvHist; ++j)
        if (j < K - 1) sn[static_cast<size_t>(j) * C + ch] = hist[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxConvHist; ++j)
    if (j < K - 1) a.state[static_cast<size_t>(j) * C + ch] = hist[j];
}

}  // namespace ck::cuda
