// Layer-level kernels of the qwen4_exp forward (declared in cuda/layers.h), first stage: the embedding
// and the hyper-connections (gate mean, combine, combine with the mix's input RMS norm), then their
// launchers. Each kernel is the device twin of a piece of src/cpu/qwen4_exp.cpp and written to be read
// beside it. Where the CPU rounds a product before adding it, the kernels use __fmul_rn/__fadd_rn so no
// FMA contraction changes the bits.
#include <algorithm>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/layers.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

namespace ck::cuda {
namespace {

int block_for(int64_t n, int max_threads = 256) {
  return static_cast<int>(std::clamp<int64_t>(round_up(n, 32), 32, max_threads));
}

// ------------------------------------------------------------------ embedding, hyper-connections

// grid (rows), any block.
__global__ void embed_wide_kernel(const DMatrix embed, const StepParams* sp, int S, int H, float* R, int ldR) {
  pdl_begin();
  const int64_t tok = sp->tokens[blockIdx.x];
  float* Rr = R + static_cast<size_t>(blockIdx.x) * ldR;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const float v = dmatrix_elem(embed, tok, i);
    for (int s = 0; s < S; ++s) Rr[s * H + i] = v;
  }
}

// grid (ceil(H/256), rows), block 256. FRAG: also the v4 B fragments and group sums of u (Tc4Frags,
// one vector per row; H % 64 == 0), so the one-row GEMVs and the decode experts that read u launch no
// fragment kernel: a block's 256 floats are 4 whole groups.
template <bool FRAG>
__global__ void hc_gate_mean_kernel(const float* g, const float* X, int ldgx, int S, int H, float* u, int ldu,
                                    uint2* frag, float* gsum) {
  pdl_begin();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float v = 0.0f;
  if (i < H) {
    const float* gr = g + static_cast<size_t>(blockIdx.y) * ldgx;
    const float* xr = X + static_cast<size_t>(blockIdx.y) * ldgx;
    constexpr int kBatch = 8;  // streams whose loads are issued before their products
    float acc = 0.0f;
    for (int s0 = 0; s0 < S; s0 += kBatch) {
      float gv[kBatch], xv[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (s0 + b < S) {
          gv[b] = gr[(s0 + b) * H + i];
          xv[b] = xr[(s0 + b) * H + i];
        }
      float sg[kBatch];  // sigmoid4_: sigmoidf_'s bits, four interleaved
#pragma unroll
      for (int b = 0; b < kBatch; b += 4) {
        const float4 v = sigmoid4_(make_float4(s0 + b < S ? gv[b] : 0.0f, s0 + b + 1 < S ? gv[b + 1] : 0.0f,
                                               s0 + b + 2 < S ? gv[b + 2] : 0.0f, s0 + b + 3 < S ? gv[b + 3] : 0.0f));
        sg[b] = v.x, sg[b + 1] = v.y, sg[b + 2] = v.z, sg[b + 3] = v.w;
      }
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (s0 + b < S) acc = mul_add_rn(acc, sg[b], xv[b]);
    }
    v = acc / static_cast<float>(S);
    u[static_cast<size_t>(blockIdx.y) * ldu + i] = v;
  }
  if constexpr (FRAG) {
    __shared__ float su[256];
    su[threadIdx.x] = v;
    __syncthreads();
    const int groups = H / 64, g0 = blockIdx.x * 4, ng = min(4, groups - g0);
    uint2* fr = frag + (static_cast<size_t>(blockIdx.y) * groups + g0) * kOneFragWords;  // the compact layout
    for (int e = threadIdx.x; e < ng * kOneFragWords; e += blockDim.x)
      fr[e] = tc4_one_frag_elem(su + (e / kOneFragWords) * 64, e % kOneFragWords);
    // Σ x per group, as tc4_frag_kernel<1>.
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < ng) {
      const float t = tc4_group_sum(su + warp * 64);
      if (lane == 0) gsum[static_cast<size_t>(blockIdx.y) * groups + g0 + warp] = t;
    }
  }
}

// hc_gate_mean_kernel<true> for 2-8 rows at once, and the R-row fragments of u as well: grid (H / 64),
// block 64; block G takes u's group G of every row (the same loads and arithmetic per element, so the
// same u, compact fragments and sums), then writes the group in tc4_frag_kernel<R>'s layout from
// shared memory (its words and bits). Why: the 2-8-row projections of u (the DeltaNet in_proj,
// attention's q/k/v) ran a fragment kernel of their own first.
template <int R>
__global__ void __launch_bounds__(64) hc_gate_mean_rows_kernel(const float* g, const float* X, int ldgx, int S, int H,
                                                               int nx, float* u, int ldu, uint2* frag, float* gsum,
                                                               uint2* rfrag, float* rgsum) {
  constexpr int NB = (3 * R + 7) / 8, NC = 8 * NB, FW = 4 * NB * 32;
  __shared__ float su[R][64];
  pdl_begin();
  const int G = blockIdx.x, i = 64 * G + threadIdx.x, groups = H / 64;
  // Every row's loads of a batch of streams are issued before their products (one L2 round trip per
  // batch, not per row); each row adds its streams in hc_gate_mean_kernel's order.
  constexpr int kBatch = R <= 4 ? 4 : 2;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
#pragma unroll 1
  for (int s0 = 0; s0 < S; s0 += kBatch) {
    float gv[R][kBatch], xv[R][kBatch];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (r < nx && s0 + b < S) {
          gv[r][b] = g[static_cast<size_t>(r) * ldgx + (s0 + b) * H + i];
          xv[r][b] = X[static_cast<size_t>(r) * ldgx + (s0 + b) * H + i];
        }
    // The batch's R x kBatch sigmoids four at a time (sigmoid4_: sigmoidf_'s bits; one at a time, each
    // was a dependent chain issued alone).
    static_assert(R * kBatch % 4 == 0, "whole quads of sigmoids");
    float sg[R][kBatch];
#pragma unroll
    for (int q = 0; q < R * kBatch; q += 4) {
      float in[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = (q + j) / kBatch, b = (q + j) % kBatch;
        in[j] = r < nx && s0 + b < S ? gv[r][b] : 0.0f;
      }
      const float4 o = sigmoid4_(make_float4(in[0], in[1], in[2], in[3]));
      const float out[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) sg[(q + j) / kBatch][(q + j) % kBatch] = out[j];
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (r < nx && s0 + b < S) acc[r] = mul_add_rn(acc[r], sg[r][b], xv[r][b]);
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v = 0.0f;
    if (r < nx) {
      v = acc[r] / static_cast<float>(S);
      u[static_cast<size_t>(r) * ldu + i] = v;
    }
    su[r][threadIdx.x] = v;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll 1
  for (int r = 0; r < nx; ++r) {  // the compact one-row layout of each row (hc_gate_mean_kernel<true>)
    uint2* fr = frag + (static_cast<size_t>(r) * groups + G) * kOneFragWords;
    for (int e = threadIdx.x; e < kOneFragWords; e += blockDim.x) fr[e] = tc4_one_frag_elem(&su[r][0], e);
    if (warp == (r & 1)) {
      const float t = tc4_group_sum(&su[r][0]);
      if (lane == 0) gsum[static_cast<size_t>(r) * groups + G] = t;
    }
  }
  tc4_rows_group_frags<NB>(&su[0][0], 64, nx, rfrag + static_cast<size_t>(G) * FW,
                           rgsum + static_cast<size_t>(G) * NC);
}

// grid (ceil(S*H/256), rows), block 256.
__global__ void hc_combine_kernel(float* R, int ldR, const float* o, int ldo, const float* w, int ldw, int S, int H) {
  pdl_begin();
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= S * H) return;
  const int s = idx / H, i = idx % H;
  float* Rr = R + static_cast<size_t>(blockIdx.y) * ldR;
  Rr[idx] = mul_add_rn(Rr[idx], o[static_cast<size_t>(blockIdx.y) * ldo + i], w[static_cast<size_t>(blockIdx.y) * ldw + s]);
}

// grid (S, rows), block rmsnorm_wide_block(H): hc_combine_kernel for stream s of row r, then
// rmsnorm_wide_kernel of the updated stream (the hyper-connection mix's input norm, spec §4), in one
// kernel: the same operations on the same values (so the same bits as the two launches), one launch
// less per mix.
__global__ void __launch_bounds__(1024) hc_combine_rmsnorm_kernel(float* R, int64_t ldR, const float* o, int64_t ldo,
                                                                  const float* w, int ldw, int64_t H,
                                                                  const float* __restrict__ scale, float eps,
                                                                  float* out, int r_prefetch, float* rinv) {
  const int s = blockIdx.x, r = blockIdx.y;
  float4* Rr = reinterpret_cast<float4*>(R + r * ldR + s * H);
  // R (and w): written by the mix before, many kernels back, and out of L2 since; o is the kernel
  // before's (hc_mix_row_kernel's R prefetch says why, and why a prefetch is safe). A line a thread.
  if (r_prefetch) {
    for (int64_t off = threadIdx.x * 32; off < H; off += blockDim.x * 32) prefetch_l2(R + r * ldR + s * H + off);
    if (threadIdx.x == 0) prefetch_l2(w + static_cast<size_t>(r) * ldw);
  }
  pdl_begin();
  __shared__ float scratch[32];
  const float4* orow = reinterpret_cast<const float4*>(o + r * ldo);
  const float ws = w[static_cast<size_t>(r) * ldw + s];
  const int n4 = static_cast<int>(H / 4);
  // Every load first, then the combine and its stores: R may alias o as far as the compiler knows, so
  // with the store of R in the same loop each element's loads waited behind the one before (four round
  // trips a thread at H = 2,560, SASS).
  float4 v[4], ov[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    v[k] = ov[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i < n4) {
      v[k] = Rr[i];
      ov[k] = orow[i];
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) {
      const float4 a = v[k], b = ov[k];
      v[k] = make_float4(mul_add_rn(a.x, b.x, ws), mul_add_rn(a.y, b.y, ws), mul_add_rn(a.z, b.z, ws),
                         mul_add_rn(a.w, b.w, ws));
      Rr[i] = v[k];
    }
  }
  rmsnorm_wide_tail(v, n4, H, reinterpret_cast<const float4*>(scale + s * H), eps,
                    reinterpret_cast<float4*>(out + r * ldR + s * H), scratch,
                    rinv ? rinv + static_cast<size_t>(r) * gridDim.x + s : nullptr);
}

}  // namespace

void embed_wide(const DMatrix& embed, const StepParams* sp, int rows, int S, int H, float* R, int ldR,
                cudaStream_t stream) {
  launch(embed_wide_kernel, rows, block_for(H), 0, stream, embed, sp, S, H, R, ldR);
  CUDA_CHECK_LAUNCH();
}

void hc_gate_mean(const float* g, const float* X, int ldgx, int S, int H, float* u, int ldu, int rows,
                  cudaStream_t stream, uint2* frag, float* gsum, uint2* rfrag, float* rgsum) {
  const dim3 grid(static_cast<unsigned>(ceil_div(H, 256)), static_cast<unsigned>(rows));
  if (frag && rfrag && rows >= 2 && rows <= kMaxRows) {
    CK_REQUIRE(gsum && rgsum && H % 64 == 0, "hc_gate_mean: fragments need H %% 64 == 0 (H %d)", H);
    const unsigned gx = static_cast<unsigned>(H / 64);
    switch (tc4_rows_R(rows)) {
      case 2: launch(hc_gate_mean_rows_kernel<2>, gx, 64, 0, stream, g, X, ldgx, S, H, rows, u, ldu, frag, gsum, rfrag, rgsum); break;
      case 4: launch(hc_gate_mean_rows_kernel<4>, gx, 64, 0, stream, g, X, ldgx, S, H, rows, u, ldu, frag, gsum, rfrag, rgsum); break;
      default: launch(hc_gate_mean_rows_kernel<8>, gx, 64, 0, stream, g, X, ldgx, S, H, rows, u, ldu, frag, gsum, rfrag, rgsum); break;
    }
  } else if (frag) {
    CK_REQUIRE(gsum && H % 64 == 0, "hc_gate_mean: fragments need H %% 64 == 0 (H %d)", H);
    launch(hc_gate_mean_kernel<true>, grid, 256, 0, stream, g, X, ldgx, S, H, u, ldu, frag, gsum);
  } else {
    launch(hc_gate_mean_kernel<false>, grid, 256, 0, stream, g, X, ldgx, S, H, u, ldu, frag, gsum);
  }
  CUDA_CHECK_LAUNCH();
}

void hc_combine(float* R, int ldR, const float* o, int ldo, const float* w, int ldw, int S, int H, int rows,
                cudaStream_t stream) {
  launch(hc_combine_kernel, dim3(static_cast<unsigned>(ceil_div(S * H, 256)), rows), 256, 0, stream, R, ldR, o, ldo, w,
                                                                                                  ldw, S, H);
  CUDA_CHECK_LAUNCH();
}

bool hc_r_prefetch_on() {
  static const bool on = !env_is("CK_HC_R_PREFETCH", "0");
  return on;
}

bool hc_combine_rmsnorm(float* R, int ldR, const float* o, int ldo, const float* w, int ldw, int S, int H,
                        const float* scale, float eps, float* out, int rows, cudaStream_t stream, float* rinv) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  // The shape rmsnorm_grouped sends to its wide kernel, and float4 rows of o.
  if (H < 2048 || H % 4 != 0 || H > 16 * 1024 || ldR % 4 != 0 || ldo % 4 != 0 || !aligned(R) || !aligned(o) ||
      (!rinv && !aligned(out)) || !aligned(scale))
    return false;
  launch(hc_combine_rmsnorm_kernel, dim3(static_cast<unsigned>(S), static_cast<unsigned>(rows)), rmsnorm_wide_block(H),
         0, stream, R, int64_t{ldR}, o, int64_t{ldo}, w, ldw, int64_t{H}, scale, eps, out, hc_r_prefetch_on() ? 1 : 0,
         rinv);
  CUDA_CHECK_LAUNCH();
  return true;
}

namespace {
// Every 32-bit pattern x once: thread i takes patterns 4 i .. 4 i + 3 of each 2^32 / stride slice.
__global__ void sigmoid4_check_kernel(unsigned long long* mismatches) {
  unsigned long long bad = 0;
  const uint64_t stride = 4ull * gridDim.x * blockDim.x;
  for (uint64_t p = 4ull * (blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x); p < (1ull << 32); p += stride) {
    const float4 v = make_float4(__uint_as_float(static_cast<uint32_t>(p)), __uint_as_float(static_cast<uint32_t>(p + 1)),
                                 __uint_as_float(static_cast<uint32_t>(p + 2)), __uint_as_float(static_cast<uint32_t>(p + 3)));
    const float4 r = sigmoid4_(v);
    const float e[4] = {sigmoidf_(v.x), sigmoidf_(v.y), sigmoidf_(v.z), sigmoidf_(v.w)};
    const float g[4] = {r.x, r.y, r.z, r.w};
    for (int k = 0; k < 4; ++k)
      bad += __float_as_uint(e[k]) != __float_as_uint(g[k]) && !(isnan(e[k]) && isnan(g[k]));
  }
  if (bad) atomicAdd(mismatches, bad);
}
}  // namespace

int64_t sigmoid4_mismatches() {
  DeviceBuffer<unsigned long long> n(1);
  CUDA_CHECK(cudaMemset(n.get(), 0, sizeof(unsigned long long)));
  sigmoid4_check_kernel<<<4 * sm_count(), 256>>>(n.get());
  CUDA_CHECK_LAUNCH();
  unsigned long long h = 0;
  CUDA_CHECK(cudaMemcpy(&h, n.get(), sizeof(h), cudaMemcpyDeviceToHost));
  return static_cast<int64_t>(h);
}

}  // namespace ck::cuda
