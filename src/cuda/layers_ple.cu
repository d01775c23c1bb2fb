// Layer-level kernels of the qwen4_exp forward (declared in cuda/layers.h), PLE: the gate and the
// dilated conv, then their launchers. Each kernel is the device twin of a piece of src/cpu/qwen4_exp.cpp
// and written to be read beside it. The conv (recurrent) loops over the step's rows inside the kernel,
// one thread per independent channel, so the state is read and written once per step. Where the CPU
// rounds a product before adding it, the kernels use __fmul_rn/__fadd_rn so no FMA contraction changes
// the bits.
#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/layers.h"
#include "cuda/ops.h"

namespace ck::cuda {
namespace {

// ------------------------------------------------------------------ PLE

// grid (S, rows), block 256.
__global__ void ple_gate_kernel(const float* kn, const float* qn, int ld, const float* val, int ldv, int H, float* G) {
  pdl_begin();
  __shared__ float scratch[32];
  const int s = blockIdx.x, r = blockIdx.y;
  const float* k = kn + static_cast<size_t>(r) * ld + static_cast<size_t>(s) * H;
  const float* q = qn + static_cast<size_t>(r) * ld + static_cast<size_t>(s) * H;
  float a = 0.0f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) a += k[i] * q[i];
  a = block_sum(a, scratch);
  a /= sqrtf(static_cast<float>(H));
  // Signed square root; the 1e-6 is a clamp (trap 16). sign(0) = 0.
  const float sgn = a > 0 ? 1.0f : (a < 0 ? -1.0f : 0.0f);
  a = sqrtf(fmaxf(fabsf(a), 1e-6f)) * sgn;
  const float gate = sigmoidf_(a);
  for (int i = threadIdx.x; i < H; i += blockDim.x)
    G[static_cast<size_t>(r) * ld + static_cast<size_t>(s) * H + i] = gate * val[static_cast<size_t>(r) * ldv + i];
}

constexpr int kMaxPleHist = 32;

// grid (ceil(W/256)), block 256: one thread per channel, rows in order. The history is a local array
// indexed at run time (local memory, L1-resident: a few dozen floats per thread).
__global__ void ple_conv_kernel(const PleConvArgs a, const StepParams* sp, int rows) {
  pdl_begin();
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= a.W) return;
  const int K = a.K, d = a.dil, hl = (K - 1) * d, W = a.W;
  const bool snap = sp->snap != 0;
  float hist[kMaxPleHist];
  for (int j = 0; j < hl; ++j) hist[j] = a.state[static_cast<size_t>(j) * W + ch];
  const float* taps = a.taps + static_cast<size_t>(ch) * K;
  for (int r = 0; r < rows; ++r) {
    const float gn = a.Gn[static_cast<size_t>(r) * a.ld + ch];
    float acc = __fmul_rn(taps[K - 1], gn);
    for (int j = 0; j < K - 1; ++j) acc = mul_add_rn(acc, taps[j], hist[hl - (K - 1 - j) * d]);
    const float out = __fadd_rn(a.G[static_cast<size_t>(r) * a.ld + ch], siluf_(acc));  // un-normalised G
    float* Rr = a.R + static_cast<size_t>(r) * a.ldR;
    Rr[ch] = __fadd_rn(Rr[ch], out);
    for (int j = 0; j + 1 < hl; ++j) hist[j] = hist[j + 1];
    if (hl > 0) hist[hl - 1] = gn;
    if (snap && r + 1 < rows) {
      float* sn = a.snaps + static_cast<size_t>(r) * a.snap_stride;
      for (int j = 0; j < hl; ++j) sn[static_cast<size_t>(j) * W + ch] = hist[j];
    }
  }
  for (int j = 0; j < hl; ++j) a.state[static_cast<size_t>(j) * W + ch] = hist[j];
}

// Prefill chunks (never snapshotted): the same convolution with the rows split into blocks of
// kPleRowBlock, one thread per (channel, row block), as gdn_conv_rows_kernel. A row's history is the
// (K-1)·dil inputs before it, so a row block reads it from Gn, and only row block 0 from the state,
// which it then replaces with the chunk's last inputs (no other block touches the state). Each output
// is the same operations in the same order as ple_conv_kernel's. The row-ordered kernel ran 40 blocks of
// one thread per channel over 1,024 rows (1.23 ms per chunk, eleventh session).
// grid (ceil(W/256), ceil(rows / kPleRowBlock)), block 256.
constexpr int kPleRowBlock = 32;  // >= kMaxPleHist, so only row block 0 reads the state
__global__ void ple_conv_rows_kernel(const PleConvArgs a, int rows) {
  pdl_begin();
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= a.W) return;
  const int K = a.K, d = a.dil, hl = (K - 1) * d, W = a.W;
  const int r0 = blockIdx.y * kPleRowBlock, r1 = min(rows, r0 + kPleRowBlock);
  // Input at chunk row t (t < 0: the state, oldest first).
  auto input = [&](int t) -> float {
    return t >= 0 ? a.Gn[static_cast<size_t>(t) * a.ld + ch] : a.state[static_cast<size_t>(hl + t) * W + ch];
  };
  const float* taps = a.taps + static_cast<size_t>(ch) * K;
  for (int r = r0; r < r1; ++r) {
    float acc = __fmul_rn(taps[K - 1], a.Gn[static_cast<size_t>(r) * a.ld + ch]);
    for (int j = 0; j < K - 1; ++j) acc = mul_add_rn(acc, taps[j], input(r - (K - 1 - j) * d));
    const float out = __fadd_rn(a.G[static_cast<size_t>(r) * a.ld + ch], siluf_(acc));  // un-normalised G
    float* Rr = a.R + static_cast<size_t>(r) * a.ldR;
    Rr[ch] = __fadd_rn(Rr[ch], out);
  }
  if (blockIdx.y == 0) {  // the new state: the chunk's last hl inputs (old state where rows < hl)
    float last[kMaxPleHist];
#pragma unroll
    for (int j = 0; j < kMaxPleHist; ++j) last[j] = j < hl ? input(rows - hl + j) : 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxPleHist; ++j)
      if (j < hl) a.state[static_cast<size_t>(j) * W + ch] = last[j];
  }
}

}  // namespace

void ple_gate(const float* kn, const float* qn, int ld, const float* val, int ldv, int S, int H, float* G, int rows,
              cudaStream_t stream) {
  launch(ple_gate_kernel, dim3(S, rows), 256, 0, stream, kn, qn, ld, val, ldv, H, G);
  CUDA_CHECK_LAUNCH();
}

void ple_conv(const PleConvArgs& a, const StepParams* sp, int rows, cudaStream_t stream) {
  CK_REQUIRE(a.K >= 1 && (a.K - 1) * a.dil <= kMaxPleHist, "PLE conv history %d > %d", (a.K - 1) * a.dil, kMaxPleHist);
  static_assert(kPleRowBlock >= kMaxPleHist, "row blocks past the first read their history from Gn");
  if (rows > kMaxRows)  // a prefill chunk: no snapshots
    launch(ple_conv_rows_kernel,
           dim3(static_cast<unsigned>(ceil_div(a.W, 256)), static_cast<unsigned>(ceil_div(rows, kPleRowBlock))), 256, 0,
           stream, a, rows);
  else
    launch(ple_conv_kernel, static_cast<unsigned>(ceil_div(a.W, 256)), 256, 0, stream, a, sp, rows);
  CUDA_CHECK_LAUNCH();
}

}  // namespace ck::cuda
