// Layer-level kernels of the qwen4_exp forward (declared in cuda/layers.h), each the device twin of
// a piece of src/cpu/qwen4_exp.cpp and written to be read beside it. Recurrent pieces (GDN conv and
// delta rule, PLE conv) loop over the step's rows inside the kernel, one thread or block per
// independent channel or head, so the state is read and written once per step. Where the CPU rounds a
// product before adding it, the kernels use __fmul_rn/__fadd_rn so no FMA contraction changes the bits.
#include <algorithm>
#include <cmath>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gdn_conv.cuh"
#include "cuda/layers.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

#include <cooperative_groups.h>

namespace ck::cuda {
namespace {
namespace cg = cooperative_groups;

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
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (s0 + b < S) acc = mul_add_rn(acc, sigmoidf_(gv[b]), xv[b]);
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
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int b = 0; b < kBatch; ++b)
        if (r < nx && s0 + b < S) acc[r] = mul_add_rn(acc[r], sigmoidf_(gv[r][b]), xv[r][b]);
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

// ------------------------------------------------------------------ Gated DeltaNet

// grid (S, rows), block rmsnorm_wide_block(H): hc_combine_kernel for stream s of row r, then
// rmsnorm_wide_kernel of the updated stream (the hyper-connection mix's input norm, spec §4), in one
// kernel: the same operations on the same values (so the same bits as the two launches), one launch
// less per mix.
__global__ void __launch_bounds__(1024) hc_combine_rmsnorm_kernel(float* R, int64_t ldR, const float* o, int64_t ldo,
                                                                  const float* w, int ldw, int64_t H,
                                                                  const float* __restrict__ scale, float eps,
                                                                  float* out, int r_prefetch) {
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
  float4 v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    v[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i < n4) {
      const float4 a = Rr[i], b = orow[i];
      v[k] = make_float4(mul_add_rn(a.x, b.x, ws), mul_add_rn(a.y, b.y, ws), mul_add_rn(a.z, b.z, ws),
                         mul_add_rn(a.w, b.w, ws));
      Rr[i] = v[k];
    }
  }
  rmsnorm_wide_tail(v, n4, H, reinterpret_cast<const float4*>(scale + s * H), eps,
                    reinterpret_cast<float4*>(out + r * ldR + s * H), scratch);
}

// grid (ceil(C/256)), block 256: one thread per channel, rows in order.
__global__ void gdn_conv_kernel(const GdnConvArgs a, const StepParams* sp, int rows) {
  pdl_begin();
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= a.C) return;
  gdn_conv_channel(a, sp->snap != 0, ch, rows, [&](int r) { return a.x[static_cast<size_t>(r) * a.ldx + ch]; });
}

// Prefill chunks (never snapshotted): the same convolution with the rows split into blocks of
// kConvRowBlock, one thread per (channel, row block). The conv is not recurrent (a row's history is the
// K-1 inputs before it), so a row block reads its history from x, and only row block 0 from the state,
// which it then replaces with the chunk's last K-1 inputs (no other block touches the state). Each
// output is the same operations in the same order as gdn_conv_kernel's. The row-ordered kernel ran 40
// blocks of one thread per channel over 1,024 rows (0.68 ms per layer and chunk).
// grid (ceil(C/256), ceil(rows / kConvRowBlock)), block 256.
constexpr int kConvRowBlock = 32;  // >= kMaxConvHist, so only row block 0 reads the state
__global__ void gdn_conv_rows_kernel(const GdnConvArgs a, int rows) {
  pdl_begin();
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= a.C) return;
  const int K = a.K, C = a.C, r0 = blockIdx.y * kConvRowBlock, r1 = min(rows, r0 + kConvRowBlock);
  // Input at chunk row t (t < 0: the state, oldest first).
  auto input = [&](int t) -> float {
    return t >= 0 ? a.x[static_cast<size_t>(t) * a.ldx + ch] : a.state[static_cast<size_t>(K - 1 + t) * C + ch];
  };
  float hist[kMaxConvHist];
#pragma unroll
  for (int j = 0; j < kMaxConvHist; ++j) hist[j] = j < K - 1 ? input(r0 - (K - 1) + j) : 0.0f;
  const float* taps = a.taps + static_cast<size_t>(ch) * K;
  for (int r = r0; r < r1; ++r) {
    const float xv = a.x[static_cast<size_t>(r) * a.ldx + ch];
    a.y[static_cast<size_t>(r) * a.ldy + ch] = conv_row(taps, K, hist, xv);
  }
  if (blockIdx.y == 0) {  // the new state: the last K-1 inputs of the chunk (old state where rows < K-1)
    float last[kMaxConvHist];
#pragma unroll
    for (int j = 0; j < kMaxConvHist; ++j) last[j] = j < K - 1 ? input(rows - (K - 1) + j) : 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxConvHist; ++j)
      if (j < K - 1) a.state[static_cast<size_t>(j) * C + ch] = last[j];
  }
}

constexpr int kKeyPart = 32;  // state rows (key dims) held in registers per thread

// grid (nv), block round_up(dv * parts, 32) <= 512 threads, parts = ceil(dk / 32). Thread (j, p) holds
// S[p*32 .. p*32+31][j] of its head in registers for the whole step; sums over the key dimension are
// per-part partials added in part order through shared memory.
// Dynamic shared memory: (2*dk + parts*dv) floats.
// The gated RMS norm (N2) of value column j of head h, row r: plain weight, then act(z). `rr` is the
// head's 1 / rms.
__device__ __forceinline__ float gdn_gated_out(const GdnRecArgs& a, int r, int h, int j, float o, float rr) {
  const float zz = a.z[static_cast<size_t>(r) * a.ldz + static_cast<size_t>(h) * a.dv + j];
  const float act = a.sigmoid_gate ? sigmoidf_(zz) : siluf_(zz);
  return __fmul_rn(__fmul_rn(a.norm[j], __fmul_rn(o, rr)), act);
}

// How a split head's output norm is made: in the kernel when one block holds the head (or when the
// head's blocks form a cluster, GdnNorm::Cluster), else by gdn_out_norm_kernel after it.
enum class GdnNorm : int { Block = 0, Kernel = 1, Cluster = 2 };

// early: the state comes into registers, and the head's constants into L2, before the wait on the kernel
// before (the in_proj GEMV). Nothing in a step writes them before this kernel (the previous step's
// last write, or a rollback's copy, finished before the step began), and the kernels that may still
// run then are the one before and its predecessor's tail: the state's 64 KB a head came from DRAM
// after the wait, a dependent round trip on the step's critical path (param_prefetch_on()).
__global__ void __launch_bounds__(512) gdn_recurrent_kernel(const GdnRecArgs a, const StepParams* sp, int rows,
                                                            GdnNorm norm_mode, int early) {
  extern __shared__ float sh[];
  __shared__ float scratch[32];
  __shared__ float ss_part[kMaxRows];  // GdnNorm::Cluster: this block's Σ o² per row, read by the cluster
  const int h = blockIdx.x, dk = a.dk, dv = a.dv, parts = (dk + kKeyPart - 1) / kKeyPart;
  // Value columns are independent in the delta rule (column j of S only needs (Sᵀk)_j): block y owns
  // `cols` of them. With one block per head the norm is fused; with a cluster of the head's blocks
  // (cols == 32: warp 0 holds the block's columns) too; otherwise gdn_out_norm_kernel follows.
  const int cols = dv / static_cast<int>(gridDim.y), jc0 = static_cast<int>(blockIdx.y) * cols;
  const bool fused_norm = norm_mode == GdnNorm::Block;
  float* sq = sh;
  float* sk = sh + dk;
  float* red = sh + 2 * dk;
  const int tid = threadIdx.x, jl = tid % cols, j = jc0 + jl, p = tid / cols;
  const bool active = p < parts;
  const int kh = h / (a.nv / a.nk);  // repeat_interleave grouping (trap 12)
  const int Kd = a.nk * dk;
  const float q_scale = 1.0f / sqrtf(static_cast<float>(dk));
  float* S = a.state + static_cast<size_t>(h) * dk * dv;

  float Sreg[kKeyPart];
  auto load_state = [&]() {
#pragma unroll
    for (int t = 0; t < kKeyPart; ++t) {
      const int i = p * kKeyPart + t;
      Sreg[t] = (active && i < dk) ? S[static_cast<size_t>(i) * dv + j] : 0.0f;
    }
  };
  if (early) {
    load_state();
    if (tid == 0) {
      prefetch_l2(a.a_log + h);
      prefetch_l2(a.dt_bias + h);
    }
    if (tid * 32 < dv) prefetch_l2(a.norm + 32 * tid);
  }
  pdl_begin();
  if (!early) load_state();
  const bool snap = sp->snap != 0;
  for (int r = 0; r < rows; ++r) {
    const float* yr = a.y + static_cast<size_t>(r) * a.ldy;
    // L2 norms of this head's q and k (N3), then q / sqrt(dk) (trap 13).
    float ssq = 0.0f, ssk = 0.0f;
    for (int i = tid; i < dk; i += blockDim.x) {
      const float qv = yr[kh * dk + i], kv = yr[Kd + kh * dk + i];
      sq[i] = qv;
      sk[i] = kv;
      ssq += qv * qv;
      ssk += kv * kv;
    }
    ssq = block_sum(ssq, scratch);
    ssk = block_sum(ssk, scratch);
    const float rq = 1.0f / sqrtf(ssq + 1e-6f), rk = 1.0f / sqrtf(ssk + 1e-6f);
    for (int i = tid; i < dk; i += blockDim.x) {
      sq[i] = (sq[i] * rq) * q_scale;
      sk[i] = sk[i] * rk;
    }
    __syncthreads();
    const float beta = sigmoidf_(a.b[static_cast<size_t>(r) * a.ldab + h]);
    const float gate = -expf(a.a_log[h]) * softplusf_(a.a[static_cast<size_t>(r) * a.ldab + h] + a.dt_bias[h]);
    const float decay = expf(gate);
    // m = Sᵀ k after the decay.
    float pm = 0.0f;
#pragma unroll
    for (int t = 0; t < kKeyPart; ++t) {
      const int i = p * kKeyPart + t;
      if (active && i < dk) {
        Sreg[t] *= decay;
        pm += Sreg[t] * sk[i];
      }
    }
    if (active) red[p * cols + jl] = pm;
    __syncthreads();
    float m = 0.0f;
    for (int pp = 0; pp < parts; ++pp) m += red[pp * cols + jl];
    __syncthreads();  // red is reused below
    const float delta = beta * (yr[2 * Kd + h * dv + j] - m);
    float po = 0.0f;
#pragma unroll
    for (int t = 0; t < kKeyPart; ++t) {
      const int i = p * kKeyPart + t;
      if (active && i < dk) {
        Sreg[t] += sk[i] * delta;
        po += Sreg[t] * sq[i];
      }
    }
    if (active) red[p * cols + jl] = po;
    __syncthreads();
    float o = 0.0f;
    for (int pp = 0; pp < parts; ++pp) o += red[pp * cols + jl];
    if (fused_norm) {
      // Gated RMS norm (N2) over the head's dv outputs: plain weight, then act(z).
      const float ss = block_sum((active && p == 0) ? o * o : 0.0f, scratch);
      const float rr = 1.0f / sqrtf(ss / static_cast<float>(dv) + a.eps);
      if (active && p == 0) a.out[static_cast<size_t>(r) * a.ldo + h * dv + j] = gdn_gated_out(a, r, h, j, o, rr);
    } else if (norm_mode == GdnNorm::Cluster) {
      // The same norm across the head's blocks: block y's warp 0 sums its 32 columns (warp y of
      // gdn_out_norm_kernel's block_sum), then every block adds the blocks' sums in rank order from
      // distributed shared memory (that block_sum's warp order): the same bits as the two kernels.
      cg::cluster_group cluster = cg::this_cluster();
      if (tid < 32) {
        const float v = warp_sum(o * o);
        if (tid == 0) ss_part[r] = v;
      }
      cluster.sync();
      float ss = 0.0f;
      for (unsigned y = 0; y < gridDim.y; ++y) ss += *cluster.map_shared_rank(ss_part + r, y);
      const float rr = 1.0f / sqrtf(ss / static_cast<float>(dv) + a.eps);
      if (active && p == 0) a.out[static_cast<size_t>(r) * a.ldo + h * dv + j] = gdn_gated_out(a, r, h, j, o, rr);
    } else if (active && p == 0) {
      a.out[static_cast<size_t>(r) * a.ldo + h * dv + j] = o;  // normed by gdn_out_norm_kernel
    }
    if (snap && r + 1 < rows) {
      float* Sn = a.snaps + static_cast<size_t>(r) * a.snap_stride + static_cast<size_t>(h) * dk * dv;
#pragma unroll
      for (int t = 0; t < kKeyPart; ++t) {
        const int i = p * kKeyPart + t;
        if (active && i < dk) Sn[static_cast<size_t>(i) * dv + j] = Sreg[t];
      }
    }
    __syncthreads();  // sq/sk/red are rewritten by the next row
  }
#pragma unroll
  for (int t = 0; t < kKeyPart; ++t) {
    const int i = p * kKeyPart + t;
    if (active && i < dk) S[static_cast<size_t>(i) * dv + j] = Sreg[t];
  }
  if (norm_mode == GdnNorm::Cluster) cg::this_cluster().sync();  // the others may still read ss_part
}

// grid (rows), block 256: the same norm after gdn_chunked, one warp per head (the chunked form's sums
// are in another order anyway, and 48 heads x 1,024 rows of one-warp blocks would mostly wait).
__global__ void gdn_out_norm_rows_kernel(const GdnRecArgs a) {
  pdl_begin();
  const int r = blockIdx.x, lane = threadIdx.x & 31, dv = a.dv;
  for (int h = threadIdx.x >> 5; h < a.nv; h += blockDim.x >> 5) {
    float* o = a.out + static_cast<size_t>(r) * a.ldo + static_cast<size_t>(h) * dv;
    float ss = 0.0f;
    for (int j = lane; j < dv; j += 32) ss += o[j] * o[j];
    ss = warp_sum(ss);
    const float rr = 1.0f / sqrtf(ss / static_cast<float>(dv) + a.eps);
    for (int j = lane; j < dv; j += 32) o[j] = gdn_gated_out(a, r, h, j, o[j], rr);
  }
}

// grid (nv, rows), block round_up(dv, 32): the gated RMS norm (N2) of each head's output, in place,
// after a split gdn_recurrent_kernel. Thread j holds column j, as in the fused form, so the sum of
// squares adds the same values in the same order.
__global__ void gdn_out_norm_kernel(const GdnRecArgs a) {
  pdl_begin();
  __shared__ float scratch[32];
  const int h = blockIdx.x, r = blockIdx.y, j = threadIdx.x, dv = a.dv;
  float* o = a.out + static_cast<size_t>(r) * a.ldo + static_cast<size_t>(h) * dv;
  const float v = j < dv ? o[j] : 0.0f;
  const float ss = block_sum(v * v, scratch);
  const float rr = 1.0f / sqrtf(ss / static_cast<float>(dv) + a.eps);
  if (j < dv) o[j] = gdn_gated_out(a, r, h, j, v, rr);
}

// ------------------------------------------------------------------ Gated DeltaNet, chunked (prefill)

// The delta rule 64 rows at a time (spec §6 "Chunked prefill", the form transformers and FLA use). It is
// the recurrence rearranged, so only fp32 rounding differs. Within a chunk, with cumulative log decays
// G_t = g_0 + ... + g_t, and L[t][s] = β_t (k̂_t·k̂_s) e^(G_t - G_s) for s < t, T = (I + L)⁻¹ gives
//   U = T (β v),   W = T (β e^G k̂)                                   (need no state)
// and then, with S the state before the chunk:
//   v_new = U - W S
//   out   = (e^G q̂) S + P v_new,         P[t][s] = (q̂_t·k̂_s) e^(G_t - G_s) for s <= t
//   S     = e^(G_last) S + (e^(G_last - G) k̂)ᵀ v_new
// gdn_chunk_prep_kernel computes every chunk's W, U, e^G q̂, e^(G_last-G) k̂, P and e^(G_last) at once
// (one block per head and chunk); gdn_chunk_scan_kernel then walks the chunks in order with the state
// in shared memory, one block per head and 32 value columns (columns are independent, as in the
// recurrent kernel). Rows past the input are zero (k̂ = q̂ = 0, β = 0, g = 0), which changes nothing.
constexpr int kGdnChunk = 64;
constexpr int kGdnScanCols = 32;
constexpr int kGdnChunkMaxDim = 128;  // dk and dv: shared memory, and the scan's four state rows per thread

// One (chunk, head) record of the prep kernel's output, offsets in floats.
struct GdnChunkLayout {
  int64_t w, u, qd, kd, p, dl, size;
  __host__ __device__ GdnChunkLayout(int dk, int dv) {
    w = 0;
    u = w + int64_t{kGdnChunk} * dk;
    qd = u + int64_t{kGdnChunk} * dv;
    kd = qd + int64_t{kGdnChunk} * dk;
    p = kd + int64_t{kGdnChunk} * dk;
    dl = p + int64_t{kGdnChunk} * kGdnChunk;
    size = dl + 4;  // keeps every record 16-byte aligned
  }
};

// Leading dimension of the prep kernel's transposed L (LT[s][t] = L[t][s]): rows of 16-byte multiples,
// so the solve reads L[t0 .. t0 + 7][s] as two float4.
constexpr int kGdnPrepLdt = kGdnChunk + 4;
size_t gdn_prep_smem(int dk, int dv) {
  constexpr int C = kGdnChunk;
  const int ld = std::max(dk, dv) + 1;
  return sizeof(float) * (2 * C * ld + C * kGdnPrepLdt + 3 * C);
}
// Leading dimension of a staged [C][dk] block in the scan: a multiple of 4 (16-byte copies) whose rows
// fall in different banks for the four rows a warp reads at once.
__host__ __device__ constexpr int gdn_scan_ld(int dk) { return (dk + 3) / 4 * 4 + 4; }
constexpr int kGdnScanLdP = kGdnChunk + 4;
size_t gdn_scan_smem(int dk) {
  constexpr int C = kGdnChunk;
  return sizeof(float) * (2 * C * gdn_scan_ld(dk) + C * kGdnScanLdP + dk * kGdnScanCols + C * kGdnScanCols);
}

// grid (nv, chunks), block 256, dynamic shared memory gdn_prep_smem(dk, dv).
// The q, k and v rows come in by cp.async (4-byte copies into odd-stride rows: the products below read
// them without bank conflicts): with plain loads, each guarded load and its store were one round trip
// in turn, ~30% of the kernel's time (Nsight Compute, twenty-first session). W and U are solved from
// (I + L) X = B by forward substitution, each thread one column of B (W's with the warps 0-3, U's with
// 4-7), without forming T = (I + L)⁻¹: T's substitution (64 steps, one block barrier each, 64 threads
// busy) and the products T B were ~48% of the kernel's time.
__global__ void __launch_bounds__(256, 2) gdn_chunk_prep_kernel(const GdnRecArgs a, int rows, float* records) {
  pdl_begin();
  extern __shared__ float4 prep_sh4[];
  constexpr int C = kGdnChunk, ldt = kGdnPrepLdt, kWarps = 8;
  const int h = blockIdx.x, c = blockIdx.y, dk = a.dk, dv = a.dv, ld = max(dk, dv) + 1;
  float* qs = reinterpret_cast<float*>(prep_sh4);  // [C][ld]  q̂ / sqrt(dk); later β v, then U
  float* ks = qs + C * ld;    // [C][ld]  k̂; later β e^G k̂, then W
  float* LT = ks + C * ld;    // [C][ldt] LT[s][t] = L[t][s] (zero for s >= t); C ld is a multiple of 4
  float* G = LT + C * ldt;    // [C] cumulative log decay
  float* beta = G + C;        // [C]
  float* coef = beta + C;     // [C] β e^G
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r0 = c * C, n = min(C, rows - r0);
  const int kh = h / (a.nv / a.nk), Kd = a.nk * dk;  // repeat_interleave grouping (trap 12)
  const float q_scale = 1.0f / sqrtf(static_cast<float>(dk));

  // Raw q and k rows (zeros past the input), then one warp per row: L2 norms (N3), β, g.
#pragma unroll
  for (int tt = 0; tt < C / kWarps; ++tt) {
    const int t = warp + kWarps * tt;
    const float* yr = a.y + static_cast<size_t>(r0 + t) * a.ldy;
#pragma unroll
    for (int ii = 0; ii < kGdnChunkMaxDim / 32; ++ii) {
      const int i = lane + 32 * ii;
      if (i < dk) {
        if (t < n) {
          cp_async4(&qs[t * ld + i], yr + kh * dk + i);
          cp_async4(&ks[t * ld + i], yr + Kd + kh * dk + i);
        } else {
          qs[t * ld + i] = 0.0f;
          ks[t * ld + i] = 0.0f;
        }
      }
    }
  }
  cp_async_commit();
  if (tid < C) {
    const int t = tid;
    float bt = 0.0f, gt = 0.0f;
    if (t < n) {
      bt = sigmoidf_(a.b[static_cast<size_t>(r0 + t) * a.ldab + h]);
      gt = -expf(a.a_log[h]) * softplusf_(a.a[static_cast<size_t>(r0 + t) * a.ldab + h] + a.dt_bias[h]);
    }
    beta[t] = bt;
    G[t] = gt;
  }
  cp_async_wait<0>();
  __syncthreads();
  for (int t = warp; t < C; t += kWarps) {
    float ssq = 0.0f, ssk = 0.0f;
    for (int i = lane; i < dk; i += 32) {
      ssq += qs[t * ld + i] * qs[t * ld + i];
      ssk += ks[t * ld + i] * ks[t * ld + i];
    }
    ssq = warp_sum(ssq);
    ssk = warp_sum(ssk);
    const float rq = 1.0f / sqrtf(ssq + 1e-6f), rk = 1.0f / sqrtf(ssk + 1e-6f);
    for (int i = lane; i < dk; i += 32) {
      qs[t * ld + i] = (qs[t * ld + i] * rq) * q_scale;
      ks[t * ld + i] = ks[t * ld + i] * rk;
    }
  }
  if (tid == 0) {
    float acc = 0.0f;
    for (int t = 0; t < C; ++t) G[t] = acc += G[t];
  }
  __syncthreads();
  if (tid < C) coef[tid] = beta[tid] * expf(G[tid]);

  // k̂ k̂ᵀ and q̂ k̂ᵀ: thread (ty, tx) holds rows ty + 16m and columns tx + 16n (odd strides: no bank
  // conflicts). L goes to shared memory (transposed), P to the record.
  const GdnChunkLayout lay(dk, dv);
  float* rec = records + (static_cast<size_t>(c) * a.nv + h) * lay.size;
  {
    const int ty = tid / 16, tx = tid % 16;
    float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll 4
    for (int i = 0; i < dk; ++i) {
      float kt[4], qt[4], kc[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        kt[m] = ks[(ty + 16 * m) * ld + i];
        qt[m] = qs[(ty + 16 * m) * ld + i];
        kc[m] = ks[(tx + 16 * m) * ld + i];
      }
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          kk[m][q] += kt[m] * kc[q];
          qk[m][q] += qt[m] * kc[q];
        }
    }
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int t = ty + 16 * m, s = tx + 16 * q;
        const float d = s <= t ? expf(G[t] - G[s]) : 0.0f;
        LT[s * ldt + t] = s < t ? beta[t] * kk[m][q] * d : 0.0f;
        rec[lay.p + t * C + s] = qk[m][q] * d;
      }
  }
  // The decayed q̂ and k̂ the scan multiplies the state with; then q̂'s space takes β v and k̂'s β e^G k̂.
  const float g_last = G[C - 1];
  for (int t = warp; t < C; t += kWarps) {
    const float eq = expf(G[t]), ek = expf(g_last - G[t]);
    for (int i = lane; i < dk; i += 32) {
      rec[lay.qd + t * dk + i] = qs[t * ld + i] * eq;
      rec[lay.kd + t * dk + i] = ks[t * ld + i] * ek;
    }
  }
  if (tid == 0) rec[lay.dl] = expf(g_last);
  __syncthreads();  // L complete; q̂ and k̂ read for the last time
#pragma unroll
  for (int tt = 0; tt < C / kWarps; ++tt) {
    const int t = warp + kWarps * tt;
    const float* vr = a.y + static_cast<size_t>(r0 + t) * a.ldy + 2 * Kd + static_cast<size_t>(h) * dv;
#pragma unroll
    for (int ii = 0; ii < kGdnChunkMaxDim / 32; ++ii) {
      const int j = lane + 32 * ii;
      if (j < dv) {
        if (t < n) cp_async4(&qs[t * ld + j], vr + j);
        else qs[t * ld + j] = 0.0f;
      }
      if (j < dk) ks[t * ld + j] *= coef[t];
    }
  }
  cp_async_commit();
  cp_async_wait<0>();  // this thread's own copies, which it scales: β v
#pragma unroll
  for (int tt = 0; tt < C / kWarps; ++tt) {
    const int t = warp + kWarps * tt;
#pragma unroll
    for (int ii = 0; ii < kGdnChunkMaxDim / 32; ++ii) {
      const int j = lane + 32 * ii;
      if (j < dv && t < n) qs[t * ld + j] = beta[t] * qs[t * ld + j];
    }
  }
  __syncthreads();

  // (I + L) X = B for B = β e^G k̂ (X = W) and B = β v (X = U): X[t] = B[t] - Σ_{s<t} L[t][s] X[s], in
  // place, 8 rows at a time (8 independent sums per thread; the rows before come from shared memory,
  // written by this same thread), then the 8 rows' triangle among themselves. No thread reads another's
  // column, so no barrier is needed.
  const int col = tid & (kGdnChunkMaxDim - 1), which = tid / kGdnChunkMaxDim;  // 0: W, 1: U
  const int ncols = which ? dv : dk;
  if (col < ncols) {
    float* X = (which ? qs : ks) + col;
    float* out = rec + (which ? lay.u : lay.w) + col;
#pragma unroll 1
    for (int t0 = 0; t0 < C; t0 += 8) {
      float acc[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = X[(t0 + i) * ld];
#pragma unroll 4
      for (int s = 0; s < t0; ++s) {
        const float x = X[s * ld];
        const float4 l0 = *reinterpret_cast<const float4*>(&LT[s * ldt + t0]);
        const float4 l1 = *reinterpret_cast<const float4*>(&LT[s * ldt + t0 + 4]);
        acc[0] -= l0.x * x; acc[1] -= l0.y * x; acc[2] -= l0.z * x; acc[3] -= l0.w * x;
        acc[4] -= l1.x * x; acc[5] -= l1.y * x; acc[6] -= l1.z * x; acc[7] -= l1.w * x;
      }
#pragma unroll
      for (int i = 1; i < 8; ++i)
#pragma unroll
        for (int i2 = 0; i2 < i; ++i2) acc[i] -= LT[(t0 + i2) * ldt + t0 + i] * acc[i2];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        X[(t0 + i) * ld] = acc[i];
        out[(t0 + i) * ncols] = acc[i];
      }
    }
  }
}

// Starts copying a [rows][cols] block (rows of `cols` floats) into shared memory rows of `ld` floats.
__device__ __forceinline__ void stage_async(float* dst, int ld, const float* src, int rows, int cols) {
  if ((cols & 3) == 0) {
    const int q = cols / 4;
    for (int idx = threadIdx.x; idx < rows * q; idx += blockDim.x) {
      const int t = idx / q, i = (idx - t * q) * 4;
      cp_async16(dst + t * ld + i, src + t * cols + i);
    }
  } else {
    for (int idx = threadIdx.x; idx < rows * cols; idx += blockDim.x) {
      const int t = idx / cols;
      cp_async4(dst + t * ld + (idx - t * cols), src + idx);
    }
  }
}

// acc[m][q] += Σ_{i < n} a[(ty + 32m) * lda + i] * b[i * ldb + j0 + q]: the scan's products, two rows
// of a shared-memory block times four columns, in ascending i. b rows 16-byte aligned.
__device__ __forceinline__ void rows2_cols4_add(float (&acc)[2][4], const float* a, int lda, const float* b, int ldb,
                                                int n, int ty, int j0) {
#pragma unroll 4
  for (int i = 0; i < n; ++i) {
    const float4 b4 = *reinterpret_cast<const float4*>(&b[i * ldb + j0]);
    const float a0 = a[ty * lda + i], a1 = a[(ty + 32) * lda + i];
    acc[0][0] += a0 * b4.x; acc[0][1] += a0 * b4.y; acc[0][2] += a0 * b4.z; acc[0][3] += a0 * b4.w;
    acc[1][0] += a1 * b4.x; acc[1][1] += a1 * b4.y; acc[1][2] += a1 * b4.z; acc[1][3] += a1 * b4.w;
  }
}

// grid (nv, ceil(dv / 32)), block 256, dynamic shared memory gdn_scan_smem(dk). Thread (ty, tx) computes
// rows ty and ty + 32 of each chunk (state rows ty + 32m in the update) at columns 4tx .. 4tx+3.
// The record's three [C][dk] blocks go through two buffers with cp.async, each loaded while the phase
// before the one that needs it runs: W(c) in buf[c&1] and e^G q̂(c) in the other; after phase 1 the
// first takes e^(G_last-G) k̂(c); after phase 2 the second takes W(c+1) (and P(c+1)); after phase 3 the
// first takes e^G q̂(c+1).
__global__ void __launch_bounds__(256, 2) gdn_chunk_scan_kernel(const GdnRecArgs a, int rows, const float* records) {
  pdl_begin();
  extern __shared__ float4 sh4[];
  constexpr int C = kGdnChunk, NC = kGdnScanCols, ldp = kGdnScanLdP;
  const int h = blockIdx.x, c0 = blockIdx.y * NC, dk = a.dk, dv = a.dv, ld = gdn_scan_ld(dk);
  float* sh = reinterpret_cast<float*>(sh4);
  float* Pm = sh + 2 * C * ld;   // [C][ldp]; the two [C][ld] buffers come first
  float* Ss = Pm + C * ldp;      // [dk][NC] this block's state columns
  float* vn = Ss + dk * NC;      // [C][NC] v_new
  const int tid = threadIdx.x, ty = tid / 8, tx = tid % 8, j0 = 4 * tx;
  const GdnChunkLayout lay(dk, dv);
  const int chunks = (rows + C - 1) / C;
  auto record = [&](int c) { return records + (static_cast<size_t>(c) * a.nv + h) * lay.size; };
  stage_async(sh, ld, record(0) + lay.w, C, dk);
  stage_async(Pm, ldp, record(0) + lay.p, C, C);
  cp_async_commit();
  stage_async(sh + C * ld, ld, record(0) + lay.qd, C, dk);
  cp_async_commit();
  float* S = a.state + static_cast<size_t>(h) * dk * dv;
  for (int idx = tid; idx < dk * NC; idx += blockDim.x) {
    const int i = idx / NC, j = idx % NC;
    Ss[idx] = c0 + j < dv ? S[static_cast<size_t>(i) * dv + c0 + j] : 0.0f;
  }
  for (int c = 0; c < chunks; ++c) {
    const float* rec = record(c);
    float* wb = sh + (c & 1) * C * ld;
    float* qb = sh + ((c + 1) & 1) * C * ld;
    const bool more = c + 1 < chunks;
    float u[2][4];  // U's columns of this thread, read early
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int col = c0 + j0 + q;
        u[m][q] = col < dv ? rec[lay.u + (ty + 32 * m) * dv + col] : 0.0f;
      }
    cp_async_wait<1>();  // W(c), P(c)
    __syncthreads();

    // Phase 1: v_new = U - W S
    float acc[2][4] = {};
    rows2_cols4_add(acc, wb, ld, Ss, NC, dk, ty, j0);
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int q = 0; q < 4; ++q) vn[(ty + 32 * m) * NC + j0 + q] = u[m][q] - acc[m][q];
    __syncthreads();
    stage_async(wb, ld, rec + lay.kd, C, dk);
    cp_async_commit();
    cp_async_wait<1>();  // e^G q̂(c)
    __syncthreads();

    // Phase 2: out = (e^G q̂) S + P v_new
    float o[2][4] = {};
    rows2_cols4_add(o, qb, ld, Ss, NC, dk, ty, j0);
    rows2_cols4_add(o, Pm, ldp, vn, NC, C, ty, j0);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int row = c * C + ty + 32 * m;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int col = c0 + j0 + q;
        if (row < rows && col < dv) a.out[static_cast<size_t>(row) * a.ldo + static_cast<size_t>(h) * dv + col] = o[m][q];
      }
    }
    __syncthreads();
    if (more) {
      stage_async(qb, ld, record(c + 1) + lay.w, C, dk);
      stage_async(Pm, ldp, record(c + 1) + lay.p, C, C);
    }
    cp_async_commit();
    const float dl = rec[lay.dl];
    cp_async_wait<1>();  // e^(G_last-G) k̂(c)
    __syncthreads();

    // Phase 3: S = e^(G_last) S + (e^(G_last-G) k̂)ᵀ v_new
    float up[4][4] = {};
#pragma unroll 4
    for (int t = 0; t < C; ++t) {
      const float4 v4 = *reinterpret_cast<const float4*>(&vn[t * NC + j0]);
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int i = ty + 32 * m;
        const float kd = i < dk ? wb[t * ld + i] : 0.0f;
        up[m][0] += kd * v4.x; up[m][1] += kd * v4.y; up[m][2] += kd * v4.z; up[m][3] += kd * v4.w;
      }
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int i = ty + 32 * m;
      if (i < dk)
#pragma unroll
        for (int q = 0; q < 4; ++q) Ss[i * NC + j0 + q] = dl * Ss[i * NC + j0 + q] + up[m][q];
    }
    __syncthreads();
    if (more) stage_async(wb, ld, record(c + 1) + lay.qd, C, dk);
    cp_async_commit();
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  for (int idx = tid; idx < dk * NC; idx += blockDim.x) {
    const int i = idx / NC, j = idx % NC;
    if (c0 + j < dv) S[static_cast<size_t>(i) * dv + c0 + j] = Ss[idx];
  }
}

// The same scan on the tensor cores (CK_GDN_SCAN=fp32 keeps gdn_chunk_scan_kernel): each product as
// mma.sync.m16n8k8 in 3xTF32 (a = a_hi + a_lo, b likewise, a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi, each
// part tf32: ~22 significant bits of each operand, accumulated in fp32), the state in fp32 as before.
// Why: the fp32 kernel issued ~3 instructions per multiply-add (the FMA and its shared-memory operands)
// and spent most of its time waiting at its barriers for its slowest warps; with 192 blocks on 132 SMs
// it took ~754 us per layer and 2,048-row chunk, more than half of the delta rule (twenty-first
// session); this one ~560 us.
// A block takes NC value columns (32, or 64 with CK_GDN_SCAN_COLS=64). Warp w: phases 1 and 2 (64 x NC
// outputs) the m16 tile w % 4 and half the n8 tiles (w / 4 picks which half); phase 3 (the dk x NC
// state) the m16 tile w and all n8 tiles, whose accumulators hold the state between chunks (written
// to shared memory for the next chunk's B operands). Phase 1 and the (e^G q̂) S half of phase 2 share
// their B fragments (S) in one pass.
// Shared memory: the two [C][ldk] record buffers (ldk = 16 ceil(dk / 16) + 4, their columns past dk
// zero, so k steps of 8 and m16 tiles past dk add zeros), P [C][68], S [dk16][NC] and v_new [C][NC],
// the last two with their 8-column groups swizzled by row (conflict-free B fragment loads).
__host__ __device__ constexpr int gdn_tc_dk16(int dk) { return (dk + 15) / 16 * 16; }
__host__ __device__ constexpr int gdn_tc_ld(int dk) { return gdn_tc_dk16(dk) + 4; }
size_t gdn_scan_tc_smem(int dk, int cols) {
  constexpr int C = kGdnChunk;
  return sizeof(float) * (2 * C * gdn_tc_ld(dk) + C * kGdnScanLdP + gdn_tc_dk16(dk) * cols + C * cols);
}
__device__ __forceinline__ uint32_t tf32_of(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void tf32_split(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_of(x);
  lo = tf32_of(x - __uint_as_float(hi));
}
// d += a b, m16n8k8, tf32 operands (PTX ISA fragment layouts: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4),
// a3 (g + 8, t + 4); b0 (k t, n g), b1 (k t + 4, n g); d0..d3 (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)).
__device__ __forceinline__ void mma_tf32(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// An operand fragment in its two tf32 parts.
template <int N>
struct Tf32Frag {
  uint32_t hi[N], lo[N];
  __device__ __forceinline__ explicit Tf32Frag(const float (&v)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) tf32_split(v[i], hi[i], lo[i]);
  }
};
// 3xTF32: the small parts' products first.
__device__ __forceinline__ void mma_3xtf32(float (&d)[4], const Tf32Frag<4>& a, const Tf32Frag<2>& b) {
  mma_tf32(d, a.lo[0], a.lo[1], a.lo[2], a.lo[3], b.hi[0], b.hi[1]);
  mma_tf32(d, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b.lo[0], b.lo[1]);
  mma_tf32(d, a.hi[0], a.hi[1], a.hi[2], a.hi[3], b.hi[0], b.hi[1]);
}
// Element (row i, column j < NC) of a swizzled [rows][NC] block: 8-column groups XOR (i % 4).
template <int NC>
__device__ __forceinline__ int gdn_swz(int i, int j) { return i * NC + (j ^ ((i & 3) << 3)); }
// A lane's B fragment (rows k0 + t and k0 + t + 4, column col) of a swizzled block: with k0 a multiple
// of 8 both rows' swizzle is t's, so the lane's place is off + NC k0 with off = gdn_swz<NC>(t, col),
// and the loops add to it (the indices computed afresh were most of the kernel's instructions).
template <int NC>
__device__ __forceinline__ void gdn_b_frag(const float* m, int off, float (&b)[2]) {
  b[0] = m[off];
  b[1] = m[off + 4 * NC];
}

// acc[nt] += A v_new over k = the chunk's rows, for the N n8 tiles whose B places (at k0 = 0) are
// boff: load_a(k0, a) gives the lane's A fragment of the k step at k0 (phase 2's P, phase 3's k̂dᵀ).
template <int NC, int N, class LoadA>
__device__ __forceinline__ void gdn_mma_over_chunk(LoadA load_a, const float* vn, const int (&boff)[N],
                                                   float (&acc)[N][4]) {
#pragma unroll 2
  for (int k0 = 0; k0 < kGdnChunk; k0 += 8) {
    float av[4], b[N][2];
    load_a(k0, av);
#pragma unroll
    for (int nt = 0; nt < N; ++nt) gdn_b_frag<NC>(vn + NC * k0, boff[nt], b[nt]);
    const Tf32Frag<4> fa(av);
#pragma unroll
    for (int nt = 0; nt < N; ++nt) mma_3xtf32(acc[nt], fa, Tf32Frag<2>(b[nt]));
  }
}

// grid (nv, ceil(dv / NC)), block 256, dynamic shared memory gdn_scan_tc_smem(dk, NC). NC: the value
// columns of a block, 32 (two blocks per SM) or 64 (one block per SM, twice the products per barrier).
template <int NC, int MINB>
__global__ void __launch_bounds__(256, MINB) gdn_chunk_scan_tc_kernel(const GdnRecArgs a, int rows, const float* records) {
  static_assert(NC == 32 || NC == 64, "32 or 64 columns a block");
  constexpr int NT = NC / 8, NTW = NT / 2;  // n8 tiles of the block; of a warp in phases 1-2
  pdl_begin();
  extern __shared__ float4 sh4[];
  constexpr int C = kGdnChunk, ldp = kGdnScanLdP;
  const int h = blockIdx.x, c0 = blockIdx.y * NC, dk = a.dk, dv = a.dv, ld = gdn_tc_ld(dk), dk16 = gdn_tc_dk16(dk);
  float* sh = reinterpret_cast<float*>(sh4);
  float* Pm = sh + 2 * C * ld;   // [C][ldp]; the two [C][ld] buffers come first
  float* Ss = Pm + C * ldp;      // [dk16][NC] swizzled: this block's state columns
  float* vn = Ss + dk16 * NC;    // [C][NC] swizzled: v_new
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const GdnChunkLayout lay(dk, dv);
  const int chunks = (rows + C - 1) / C;
  auto record = [&](int c) { return records + (static_cast<size_t>(c) * a.nv + h) * lay.size; };
  // Columns [dk, ld) of both buffers: zero once (the copies write only columns < dk).
  for (int idx = tid; idx < 2 * C * (ld - dk); idx += blockDim.x) {
    const int r = idx / (ld - dk);
    sh[r * ld + dk + (idx - r * (ld - dk))] = 0.0f;
  }
  __syncthreads();  // before any copy lands in a row these stores touch
  stage_async(sh, ld, record(0) + lay.w, C, dk);
  stage_async(Pm, ldp, record(0) + lay.p, C, C);
  stage_async(sh + C * ld, ld, record(0) + lay.qd, C, dk);
  cp_async_commit();
  // The state: warp w's m16 tile w, all NT n8 tiles, in registers; rows past dk and columns past dv zero.
  float* S = a.state + static_cast<size_t>(h) * dk * dv;
  const bool st_warp = 16 * warp < dk16;
  float sacc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * warp + g + 8 * (e >> 1), j = 8 * nt + 2 * t + (e & 1);
      sacc[nt][e] = st_warp && i < dk && c0 + j < dv ? S[static_cast<size_t>(i) * dv + c0 + j] : 0.0f;
    }
  auto store_state = [&]() {
    if (!st_warp) return;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + g + 8 * (e >> 1), j = 8 * nt + 2 * t + (e & 1);
        Ss[gdn_swz<NC>(i, j)] = sacc[nt][e];
      }
  };
  store_state();
  // Phases 1-2: m16 tile mt, n8 tiles n0 / 8 .. n0 / 8 + NTW - 1. The lane's fragment places at k0 = 0:
  // A of phases 1-2 (rows 16 mt + g, + 8; columns t, t + 4), A of phase 3 (k̂d transposed), B.
  const int mt = warp & 3, n0 = (warp >> 2) * (NC / 2);
  const int a12 = (16 * mt + g) * ld + t, ap2 = (16 * mt + g) * ldp + t, a3 = t * ld + 16 * warp + g;
  int b12[NTW], b3[NT];
#pragma unroll
  for (int nt = 0; nt < NTW; ++nt) b12[nt] = gdn_swz<NC>(t, n0 + 8 * nt + g);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) b3[nt] = gdn_swz<NC>(t, 8 * nt + g);
  for (int c = 0; c < chunks; ++c) {
    const float* rec = record(c);
    float* wb = sh + (c & 1) * C * ld;
    float* qb = sh + ((c + 1) & 1) * C * ld;
    const bool more = c + 1 < chunks;
    float u[NTW][4];  // U at this thread's accumulator places, read early
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * mt + g + 8 * (e >> 1), col = c0 + n0 + 8 * nt + 2 * t + (e & 1);
        u[nt][e] = col < dv ? rec[lay.u + row * dv + col] : 0.0f;
      }
    cp_async_wait<0>();  // W(c), P(c), e^G q̂(c)
    __syncthreads();

    // Phase 1 (W S) and the first half of phase 2 ((e^G q̂) S), over k = state rows.
    float ws[NTW][4] = {}, o[NTW][4] = {};
    const float* pw = wb + a12;
    const float* pq = qb + a12;
    const float* ps = Ss;
    for (int k0 = 0; k0 < dk16; k0 += 8, pw += 8, pq += 8, ps += 8 * NC) {
      float aw[4], aq[4], b[NTW][2];
      aw[0] = pw[0]; aw[1] = pw[8 * ld]; aw[2] = pw[4]; aw[3] = pw[8 * ld + 4];
      aq[0] = pq[0]; aq[1] = pq[8 * ld]; aq[2] = pq[4]; aq[3] = pq[8 * ld + 4];
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) gdn_b_frag<NC>(ps, b12[nt], b[nt]);
      const Tf32Frag<4> fw(aw), fq(aq);
#pragma unroll
      for (int nt = 0; nt < NTW; ++nt) {
        const Tf32Frag<2> fb(b[nt]);
        mma_3xtf32(ws[nt], fw, fb);
        mma_3xtf32(o[nt], fq, fb);
      }
    }
    // v_new = U - W S
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = 16 * mt + g + 8 * (e >> 1), col = n0 + 8 * nt + 2 * t + (e & 1);
        vn[gdn_swz<NC>(row, col)] = u[nt][e] - ws[nt][e];
      }
    __syncthreads();  // v_new complete; W(c) and e^G q̂(c) read for the last time
    stage_async(wb, ld, rec + lay.kd, C, dk);
    if (more) stage_async(qb, ld, record(c + 1) + lay.w, C, dk);
    cp_async_commit();

    // Phase 2, second half: out += P v_new, over k = chunk rows.
    gdn_mma_over_chunk<NC>(
        [&](int k0, float (&ap)[4]) {
          const float* pp = Pm + ap2 + k0;
          ap[0] = pp[0]; ap[1] = pp[8 * ldp]; ap[2] = pp[4]; ap[3] = pp[8 * ldp + 4];
        },
        vn, b12, o);
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = c * C + 16 * mt + g + 8 * (e >> 1), col = c0 + n0 + 8 * nt + 2 * t + (e & 1);
        if (row < rows && col < dv) a.out[static_cast<size_t>(row) * a.ldo + static_cast<size_t>(h) * dv + col] = o[nt][e];
      }
    const float dl = rec[lay.dl];
    cp_async_wait<0>();  // e^(G_last-G) k̂(c) (and W(c+1))
    __syncthreads();     // ... for every thread; P(c) read for the last time
    if (more) stage_async(Pm, ldp, record(c + 1) + lay.p, C, C);
    cp_async_commit();

    // Phase 3: S = e^(G_last) S + (e^(G_last-G) k̂)ᵀ v_new, over k = chunk rows; A[i][k] = k̂d[k][i].
    if (st_warp) {
      float up[NT][4] = {};
      gdn_mma_over_chunk<NC>(
          [&](int k0, float (&ak)[4]) {
            const float* pk = wb + a3 + k0 * ld;
            ak[0] = pk[0]; ak[1] = pk[8]; ak[2] = pk[4 * ld]; ak[3] = pk[4 * ld + 8];
          },
          vn, b3, up);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[nt][e] = dl * sacc[nt][e] + up[nt][e];
    }
    __syncthreads();  // every warp is done with S (phases 1-2), v_new and k̂d(c)
    store_state();
    if (more) stage_async(wb, ld, record(c + 1) + lay.qd, C, dk);
    cp_async_commit();
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  if (st_warp)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * warp + g + 8 * (e >> 1), j = 8 * nt + 2 * t + (e & 1);
        if (i < dk && c0 + j < dv) S[static_cast<size_t>(i) * dv + c0 + j] = sacc[nt][e];
      }
}

// ------------------------------------------------------------------ QSA attention

// Dynamic shared memory the attention kernels may take (their limit, raised once in init_kernels).
constexpr int kAttnMaxSmem = 200 * 1024;

// Normalises src (n values, N1 with `norm`) into buf, then writes buf to dst with RoPE at `pos` on the
// first `rot` dims. Block-wide; contains __syncthreads.
__device__ void norm_rope_to(const float* src, int n, const float* norm, float eps, const float* inv_freq, int rot,
                             int64_t pos, float* buf, float* dst, float* scratch) {
  float ss = 0.0f;
  for (int i = threadIdx.x; i < n; i += blockDim.x) ss += src[i] * src[i];
  ss = block_sum(ss, scratch);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(n) + eps);
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = (src[i] * r) * norm[i];
  __syncthreads();
  const int half = rot / 2;
  const float pf = static_cast<float>(pos);
  for (int jj = threadIdx.x; jj < half; jj += blockDim.x) {
    const float angle = pf * inv_freq[jj];
    const float c = cosf(angle), s = sinf(angle);
    const float x0 = buf[jj], x1 = buf[jj + half];
    dst[jj] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    dst[jj + half] = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
  }
  for (int i = rot + threadIdx.x; i < n; i += blockDim.x) dst[i] = buf[i];
  __syncthreads();
}

// grid (nh + nkv + inh + 1, rows), block 128, dynamic shared memory max(hd, ihd) floats.
// Blocks: query heads, then KV heads (K to the cache after norm+RoPE, V copied), then indexer query
// heads, then one block that stores the raw indexer key.
__global__ void attn_prep_kernel(const AttnArgs a, const StepParams* sp) {
  pdl_begin();
  extern __shared__ float buf[];
  __shared__ float scratch[32];
  const int b = blockIdx.x, r = blockIdx.y;
  const int64_t pos = sp->pos + r;
  const size_t kvw = static_cast<size_t>(a.nkv) * a.hd;
  if (b < a.nh) {
    norm_rope_to(a.qg + static_cast<size_t>(r) * a.ldqg + static_cast<size_t>(b) * 2 * a.hd, a.hd, a.q_norm, a.eps,
                 a.inv_freq, a.rot, pos, buf, a.q + static_cast<size_t>(r) * a.ldq + static_cast<size_t>(b) * a.hd,
                 scratch);
  } else if (b < a.nh + a.nkv) {
    const int g = b - a.nh;
    norm_rope_to(a.k + static_cast<size_t>(r) * a.ldk + static_cast<size_t>(g) * a.hd, a.hd, a.k_norm, a.eps,
                 a.inv_freq, a.rot, pos, buf, a.k_cache + pos * kvw + static_cast<size_t>(g) * a.hd, scratch);
    for (int i = threadIdx.x; i < a.hd; i += blockDim.x)
      a.v_cache[pos * kvw + static_cast<size_t>(g) * a.hd + i] = a.v[static_cast<size_t>(r) * a.ldv + g * a.hd + i];
  } else if (b < a.nh + a.nkv + a.inh) {
    const int hh = b - a.nh - a.nkv;
    norm_rope_to(a.iqk + static_cast<size_t>(r) * a.ldiqk + static_cast<size_t>(hh) * a.ihd, a.ihd, a.iq_norm, a.eps,
                 a.inv_freq, a.rot, pos, buf, a.iq + static_cast<size_t>(r) * a.ldiq + static_cast<size_t>(hh) * a.ihd,
                 scratch);
  } else {
    for (int i = threadIdx.x; i < a.ihd; i += blockDim.x)
      a.idx_keys[pos * a.ihd + i] = a.iqk[static_cast<size_t>(r) * a.ldiqk + static_cast<size_t>(a.inh) * a.ihd + i];
  }
}

// grid (rows), block 128, dynamic shared memory ihd floats. Row r whose position completes block b
// stores b's pooled key: mean of the raw keys, k norm, RoPE at the block's first position (trap 9).
// A block's key never changes afterwards; rolled-back rows rewrite it when their position is redone.
__global__ void attn_pool_kernel(const AttnArgs a, const StepParams* sp) {
  pdl_begin();
  extern __shared__ float buf[];
  __shared__ float scratch[32];
  const int64_t pos = sp->pos + blockIdx.x;
  if ((pos + 1) % a.cr != 0) return;  // uniform over the block
  const int64_t b = (pos + 1) / a.cr - 1;
  float* mean = a.blk_keys + b * a.ihd;  // used as the source buffer, then overwritten by the result
  for (int i = threadIdx.x; i < a.ihd; i += blockDim.x) {
    float kb = 0.0f;
    for (int t = 0; t < a.cr; ++t) kb += a.idx_keys[(b * a.cr + t) * a.ihd + i];
    mean[i] = kb / static_cast<float>(a.cr);
  }
  __syncthreads();
  norm_rope_to(mean, a.ihd, a.ik_norm, a.eps, a.inv_freq, a.rot, b * a.cr, buf, mean, scratch);
}

// grid (ceil(nb_max / 8), rows), block 256: one warp per block b. Only rows with more complete blocks
// than the budget need scores.
__global__ void attn_scores_kernel(const AttnArgs a, const StepParams* sp) {
  pdl_begin();
  const int r = blockIdx.y, lane = threadIdx.x & 31;
  const int64_t n = sp->pos + r + 1, nb = n / a.cr;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (nb <= a.block_topk || b >= nb) return;  // warp-uniform; no block barrier below
  const float* kn = a.blk_keys + b * a.ihd;
  float s = 0.0f;
  for (int hh = 0; hh < a.inh; ++hh) {
    const float* q = a.iq + static_cast<size_t>(r) * a.ldiq + static_cast<size_t>(hh) * a.ihd;
    float dot = 0.0f;
    for (int i = lane; i < a.ihd; i += 32) dot += q[i] * kn[i];
    dot = warp_sum(dot);
    s += fmaxf(dot, 0.0f);
  }
  if (lane == 0) a.scores[r * a.nb_max + b] = s / sqrtf(static_cast<float>(a.ihd));
}

// A block score as an unsigned key with the same order (larger score, larger key); -0 counts as +0,
// as the float comparison does.
__device__ __forceinline__ uint32_t score_key(float f) {
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// grid (rows), block 256. sel[b] = 1 when block b is among the block_topk best (rank under "higher
// score, then lower index"), or for every block when nb <= block_topk. O(nb) per row: a radix select
// (four 8-bit passes) finds the key T of the block_topk-th best and how many of the blocks scoring
// exactly T are taken; those are the lowest-index ones (an ordered scan). Same set as ranking every
// block against every other (the first version: O(nb^2) per row, 4 us of a prefill token at 8k).
__global__ void __launch_bounds__(256) attn_select_kernel(const AttnArgs a, const StepParams* sp) {
  pdl_begin();
  __shared__ uint32_t hist[256];
  __shared__ uint32_t prefix_s, remaining_s, ties_before;
  __shared__ uint32_t warp_ties[8];
  const int r = blockIdx.x;
  const int64_t n = sp->pos + r + 1, nb = n / a.cr;
  uint8_t* sel = a.sel + r * a.nb_max;
  if (nb <= a.block_topk) {  // uniform over the block
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) sel[b] = 1;
    return;
  }
  const float* sc = a.scores + r * a.nb_max;
  if (threadIdx.x == 0) { prefix_s = 0; remaining_s = static_cast<uint32_t>(a.block_topk); }
  for (int shift = 24; shift >= 0; shift -= 8) {
    hist[threadIdx.x] = 0;
    __syncthreads();
    const uint32_t prefix = prefix_s;
    const uint32_t high_mask = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
    for (int64_t b = threadIdx.x; b < nb; b += blockDim.x) {
      const uint32_t k = score_key(sc[b]);
      if ((k & high_mask) == (prefix & high_mask)) atomicAdd(&hist[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t above = 0, rem = remaining_s;
      int d = 255;
      for (; d > 0; --d) {
        if (above + hist[d] >= rem) break;
        above += hist[d];
      }
      remaining_s = rem - above;  // how many of the keys with this digit (and below) are still to take
      prefix_s = prefix | (static_cast<uint32_t>(d) << shift);
    }
    __syncthreads();
  }
  const uint32_t T = prefix_s, take_ties = remaining_s;
  if (threadIdx.x == 0) ties_before = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t b0 = 0; b0 < nb; b0 += blockDim.x) {
    const int64_t b = b0 + threadIdx.x;
    const uint32_t k = b < nb ? score_key(sc[b]) : 0u;
    const bool tie = b < nb && k == T;
    const uint32_t mask = __ballot_sync(0xffffffffu, tie);
    if (lane == 0) warp_ties[warp] = __popc(mask);
    __syncthreads();
    uint32_t before = ties_before;
    for (int w = 0; w < warp; ++w) before += warp_ties[w];
    before += __popc(mask & ((1u << lane) - 1u));
    if (b < nb) sel[b] = (k > T || (tie && before < take_ties)) ? 1 : 0;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t total = 0;
      for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) total += warp_ties[w];
      ties_before += total;
    }
    __syncthreads();
  }
}

// Most tokens one query attends to (attention_max_selected): the selected blocks and the last, incomplete one.
__host__ __device__ inline int attn_cap(const AttnArgs& a) { return (a.block_topk + 1) * a.cr - 1; }

// The token ids row r attends to, compacted in ascending order into idx (block-wide; returns how
// many): every token of a selected block, and the tokens of the incomplete last block. Thread i takes
// a contiguous run of compressed blocks, counts its selected ones, and finds where its tokens go with
// one scan over the threads' counts: three block barriers whatever the context (a pass of 256 tokens
// with three barriers each was 32 passes at 8k tokens).
__device__ int attn_gather_selected(const AttnArgs& a, int r, int64_t n, int* idx) {
  __shared__ int warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int64_t nb = n / a.cr;
  const uint8_t* sel = a.sel + r * a.nb_max;
  const int64_t per = (nb + blockDim.x - 1) / blockDim.x;
  const int64_t b0 = min(nb, threadIdx.x * per), b1 = min(nb, b0 + per);
  int count = 0;
  for (int64_t b = b0; b < b1; ++b) count += sel[b] != 0;
  // Exclusive scan of count over the block: within the warp, then over the warps' sums.
  int incl = count;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  int before = incl - count, all = 0;
  for (int w = 0; w < n_warps; ++w) {
    if (w < warp) before += warp_sums[w];
    all += warp_sums[w];
  }
  int off = before * a.cr;
  for (int64_t b = b0; b < b1; ++b)
    if (sel[b] != 0)
      for (int j = 0; j < a.cr; ++j) idx[off++] = static_cast<int>(b * a.cr + j);
  const int tail = static_cast<int>(n - nb * a.cr);  // the incomplete last block, always attended
  for (int j = threadIdx.x; j < tail; j += blockDim.x) idx[all * a.cr + j] = static_cast<int>(nb * a.cr + j);
  __syncthreads();  // idx is complete; warp_sums may be reused by the next call
  return all * a.cr + tail;
}

// grid (nh, rows), block 256, dynamic shared memory cap * 8 bytes (cap = attention_max_selected).
// Selected token ids are compacted in ascending order, so the softmax and the weighted sum of V run
// in the CPU's key order.
// BATCHED (the default; CK_ATTN_DECODE_BATCH=0 for the former loops): a warp's dot products take
// kAttnDotKeys keys at once and the weighted sum of V issues kAttnVLoads rows' loads before adding
// them, so a key or value row costs a fraction of a memory round trip instead of one each (the
// former loops waited on L2 once per key and per 4 value rows: 25 us per layer at ~150 selected keys
// in Nsight Compute, 2026-11-30). The same arithmetic in the same order: the same bits.
constexpr int kAttnDotKeys = 8;
constexpr int kAttnVLoads = 16;

// Scores q · k / sqrt(hd) of the selected keys idx[0, m) into p[0, m): a warp takes kAttnDotKeys keys
// at once (keys past m read idx[0] and are not stored); each dot in lane order, then a warp sum.
__device__ __forceinline__ void attn_scores_batched(const AttnArgs& a, const float* q, int g, const int* idx, int m,
                                                    float* p) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const size_t kvw = static_cast<size_t>(a.nkv) * a.hd;
  const float scale = 1.0f / sqrtf(static_cast<float>(a.hd));
  for (int j0 = warp * kAttnDotKeys; j0 < m; j0 += n_warps * kAttnDotKeys) {
    const float* kj[kAttnDotKeys];
    float dot[kAttnDotKeys];
#pragma unroll
    for (int b = 0; b < kAttnDotKeys; ++b) {
      kj[b] = a.k_cache + static_cast<size_t>(idx[j0 + b < m ? j0 + b : 0]) * kvw + static_cast<size_t>(g) * a.hd;
      dot[b] = 0.0f;
    }
    for (int i = lane; i < a.hd; i += 32) {
      const float qi = q[i];
#pragma unroll
      for (int b = 0; b < kAttnDotKeys; ++b) dot[b] += qi * kj[b][i];
    }
#pragma unroll
    for (int b = 0; b < kAttnDotKeys; ++b) {
      const float d = warp_sum(dot[b]);
      if (lane == 0 && j0 + b < m) p[j0 + b] = d * scale;
    }
  }
}

// Σ_j p[j] v_j[i] over the selected keys idx[0, m) in j order, kAttnVLoads value rows' loads issued
// before their adds (vg: the KV head's column 0 of the value cache, rows kvw apart).
__device__ __forceinline__ float attn_vsum_batched(const float* vg, size_t kvw, const int* idx, const float* p, int m,
                                                   int i) {
  float acc = 0.0f;
  int jj = 0;
  for (; jj + kAttnVLoads <= m; jj += kAttnVLoads) {
    float v[kAttnVLoads];
#pragma unroll
    for (int u = 0; u < kAttnVLoads; ++u) v[u] = vg[static_cast<size_t>(idx[jj + u]) * kvw + i];
#pragma unroll
    for (int u = 0; u < kAttnVLoads; ++u) acc = mul_add_rn(acc, p[jj + u], v[u]);
  }
#pragma unroll 4
  for (; jj < m; ++jj) acc = mul_add_rn(acc, p[jj], vg[static_cast<size_t>(idx[jj]) * kvw + i]);
  return acc;
}

// p[j] = exp(p[j] - mx) over [0, m), mx = max p; returns Σ p (block-wide). Its barriers publish p.
__device__ __forceinline__ float attn_exp_scores(float* p, int m, float* scratch, float& mx) {
  mx = -INFINITY;
  for (int jj = threadIdx.x; jj < m; jj += blockDim.x) mx = fmaxf(mx, p[jj]);
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (int jj = threadIdx.x; jj < m; jj += blockDim.x) {
    const float e = expf(p[jj] - mx);
    p[jj] = e;
    sum += e;
  }
  return block_sum(sum, scratch);
}

// Before the kernel's wait: when row r selects every key (no more complete blocks than block_topk, so
// its keys are the positions 0..n-1 in order), asks L2 for the K and V rows of keys [j0, j1) of KV head
// g. They were written in earlier steps, and a step's 1.5 GB of weights has pushed them out of L2
// since: read after the wait they are a DRAM round trip on the step's chain (docs/roofline-cuda.md,
// "first touches"). One block per KV head asks (the first query head of its group). The current
// position's row, which attn_prep_kernel writes four kernels back, is asked for too: a prefetch only
// moves lines into L2, the point of coherence, so it cannot make a later read stale. Measured (H200
// 2026-12-02 02:04Z, three interleaved rounds, context 64-192): one-row decode 632.7 / 637.4 / 635.9
// tok/s against 628.8 / 633.7 / 623.7 (+1.0%), 4 rows level; the GPU tests passed with it.
// CK_ATTN_KV_PREFETCH=0: not.
__device__ __forceinline__ void attn_prefetch_kv(const AttnArgs& a, int h, int64_t n, int splits, int split) {
  const int hpg = a.nh / a.nkv;
  if (!a.prefetch_kv || h % hpg != 0 || n / a.cr > a.block_topk) return;
  const int64_t per = (n + splits - 1) / splits, j0 = min(n, split * per), j1 = min(n, j0 + per);
  const size_t kvw = static_cast<size_t>(a.nkv) * a.hd, off = static_cast<size_t>(h / hpg) * a.hd;
  const int bytes = a.hd * static_cast<int>(sizeof(float));
  for (int64_t j = j0 + threadIdx.x; j < j1; j += blockDim.x) {
    prefetch_l2(a.k_cache + j * kvw + off, bytes);
    prefetch_l2(a.v_cache + j * kvw + off, bytes);
  }
}

template <bool BATCHED>
__global__ void attn_decode_kernel(const AttnArgs a, const StepParams* sp) {
  attn_prefetch_kv(a, blockIdx.x, sp->pos + blockIdx.y + 1, 1, 0);
  pdl_begin();
  extern __shared__ float smem[];
  __shared__ float scratch[32];
  const int h = blockIdx.x, r = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int64_t n = sp->pos + r + 1;
  const int cap = attn_cap(a);
  int* idx = reinterpret_cast<int*>(smem);
  float* p = smem + cap;
  const int m = attn_gather_selected(a, r, n, idx);
  const int g = h / (a.nh / a.nkv);
  const size_t kvw = static_cast<size_t>(a.nkv) * a.hd;
  const float* q = a.q + static_cast<size_t>(r) * a.ldq + static_cast<size_t>(h) * a.hd;
  const float scale = 1.0f / sqrtf(static_cast<float>(a.hd));
  if constexpr (BATCHED) {
    attn_scores_batched(a, q, g, idx, m, p);
  } else {
    for (int jj = warp; jj < m; jj += n_warps) {
      const float* kj = a.k_cache + static_cast<size_t>(idx[jj]) * kvw + static_cast<size_t>(g) * a.hd;
      float dot = 0.0f;
      for (int i = lane; i < a.hd; i += 32) dot += q[i] * kj[i];
      dot = warp_sum(dot);
      if (lane == 0) p[jj] = dot * scale;
    }
  }
  __syncthreads();
  float mx;
  const float sum = attn_exp_scores(p, m, scratch, mx);
  // The weights p / sum once per key (as the CPU: the same IEEE quotient), not once per key and column:
  // the division was most of this kernel's time at long contexts.
  for (int jj = threadIdx.x; jj < m; jj += blockDim.x) p[jj] = p[jj] / sum;
  __syncthreads();
  const float* gate = a.qg + static_cast<size_t>(r) * a.ldqg + static_cast<size_t>(h) * 2 * a.hd + a.hd;
  const float* vg = a.v_cache + static_cast<size_t>(g) * a.hd;
  for (int i = threadIdx.x; i < a.hd; i += blockDim.x) {
    float acc = 0.0f;
    if constexpr (BATCHED) {
      acc = attn_vsum_batched(vg, kvw, idx, p, m, i);
    } else {
#pragma unroll 4
      for (int jj = 0; jj < m; ++jj) acc = mul_add_rn(acc, p[jj], vg[static_cast<size_t>(idx[jj]) * kvw + i]);
    }
    a.out[static_cast<size_t>(r) * a.ldo + static_cast<size_t>(h) * a.hd + i] = acc * sigmoidf_(gate[i]);
  }
}

// Decode attention split over the selected keys (flash-decoding): at long contexts
// one block per query head (24 blocks at the released geometry) walks up to 2,051 keys, ~290 us per
// layer at 8k tokens of context. Block (h, r, s) takes split s of the row's selected keys (a
// contiguous range, key order kept inside it): their scores, the split's max mx_s, its Σ e_j
// (e_j = exp(score_j - mx_s)) and its Σ e_j v_j, into part [(r nh + h) splits + s][2 + hd]; then
// attn_decode_combine_kernel adds the splits in split order, each scaled by exp(mx_s - M):
// out = (Σ_s o_s e^(mx_s - M)) / (Σ_s l_s e^(mx_s - M)) * sigmoid(gate). Within fp32 rounding of
// attn_decode_kernel, not the same bits (it divides each weight before the weighted sum).
// grid (nh, rows, splits), block 256, dynamic shared memory (cap + per_split) * 4 bytes.
__global__ void attn_decode_split_kernel(const AttnArgs a, const StepParams* sp, int splits, float* part) {
  attn_prefetch_kv(a, blockIdx.x, sp->pos + blockIdx.y + 1, splits, blockIdx.z);
  pdl_begin();
  extern __shared__ float smem[];
  __shared__ float scratch[32];
  const int h = blockIdx.x, r = blockIdx.y, sp_i = blockIdx.z;
  const int64_t n = sp->pos + r + 1;
  const int cap = attn_cap(a);
  int* idx = reinterpret_cast<int*>(smem);
  float* p = smem + cap;
  const int m = attn_gather_selected(a, r, n, idx);
  const int per = (m + splits - 1) / splits, j0 = min(m, sp_i * per), j1 = min(m, j0 + per), mk = j1 - j0;
  const int g = h / (a.nh / a.nkv);
  const size_t kvw = static_cast<size_t>(a.nkv) * a.hd;
  const float* q = a.q + static_cast<size_t>(r) * a.ldq + static_cast<size_t>(h) * a.hd;
  attn_scores_batched(a, q, g, idx + j0, mk, p);
  __syncthreads();
  float mx;
  const float sum = attn_exp_scores(p, mk, scratch, mx);
  float* out = part + (static_cast<size_t>(r * a.nh + h) * splits + sp_i) * (a.hd + 2);
  if (threadIdx.x == 0) {
    out[0] = mx;  // -inf for an empty split: the combine skips it (its sum is 0)
    out[1] = sum;
  }
  const float* vg = a.v_cache + static_cast<size_t>(g) * a.hd;
  for (int i = threadIdx.x; i < a.hd; i += blockDim.x) out[2 + i] = attn_vsum_batched(vg, kvw, idx + j0, p, mk, i);
}

// grid (nh, rows), block 256: the splits of attn_decode_split_kernel in split order.
__global__ void attn_decode_combine_kernel(const AttnArgs a, int splits, const float* part) {
  pdl_begin();
  const int h = blockIdx.x, r = blockIdx.y;
  const float* base = part + static_cast<size_t>(r * a.nh + h) * splits * (a.hd + 2);
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s)
    if (base[s * (a.hd + 2) + 1] > 0.0f) M = fmaxf(M, base[s * (a.hd + 2)]);
  float L = 0.0f;
  for (int s = 0; s < splits; ++s) {
    const float l = base[s * (a.hd + 2) + 1];
    if (l > 0.0f) L += l * expf(base[s * (a.hd + 2)] - M);
  }
  const float* gate = a.qg + static_cast<size_t>(r) * a.ldqg + static_cast<size_t>(h) * 2 * a.hd + a.hd;
  for (int i = threadIdx.x; i < a.hd; i += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < splits; ++s) {
      const float* ps = base + s * (a.hd + 2);
      if (ps[1] > 0.0f) o += ps[2 + i] * expf(ps[0] - M);
    }
    a.out[static_cast<size_t>(r) * a.ldo + static_cast<size_t>(h) * a.hd + i] = (o / L) * sigmoidf_(gate[i]);
  }
}

// Prefill chunks: the query heads that share a KV head, up to kAttnHeadsPerBlock per block, so each
// selected key and value row is read once for all of them (attn_decode_kernel reads it once per head:
// 12 times at the released geometry, and its loads were most of its instructions). The weighted sum
// of V is the same as attn_decode_kernel's (key order, product rounded, then added); the dot products
// add each lane's 8 consecutive dimensions, then across the warp (another order than
// attn_decode_kernel's, within fp32 rounding of it).
constexpr int kAttnHeadsPerBlock = 8;  // one warp per head in the softmax

// Heads per block for a group of hpg query heads: the group in ceil(hpg / 8) even chunks.
__host__ __device__ inline int attn_heads_chunks(int hpg) { return (hpg + kAttnHeadsPerBlock - 1) / kAttnHeadsPerBlock; }
__host__ __device__ inline int attn_heads_per_block(int hpg) {
  const int c = attn_heads_chunks(hpg);
  return (hpg + c - 1) / c;
}
// Selectable keys rounded up to 4 (float4 reads of the weights).
__host__ __device__ inline int attn_cap4(const AttnArgs& a) { return (attn_cap(a) + 3) & ~3; }

// One head's softmax over its scores ph[0, m) by one warp, as attn_decode_kernel: the max, exp(p - max)
// and their sum, then one division per key; ph[m, pad) are set to zero (the readers' tail).
__device__ __forceinline__ void attn_softmax_warp(float* ph, int m, int pad) {
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
  for (int jj = lane; jj < m; jj += 32) mx = fmaxf(mx, ph[jj]);
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int jj = lane; jj < m; jj += 32) {
    const float e = expf(ph[jj] - mx);
    ph[jj] = e;
    sum += e;
  }
  sum = warp_sum(sum);
  for (int jj = lane; jj < m; jj += 32) ph[jj] = ph[jj] / sum;
  for (int jj = m + lane; jj < pad; jj += 32) ph[jj] = 0.0f;
}

// One step of a transposing warp sum of 2 STEP values per lane: the lanes with bit STEP set keep the
// upper half, the others the lower, each adding its partner's copy of the half it keeps; then the
// next step on the kept half. After STEP = 16 .. 1, lane l holds the warp's sum of value l.
template <int STEP>
__device__ __forceinline__ void transpose_sum(float (&v)[32], int lane) {
  const bool upper = (lane & STEP) != 0;
#pragma unroll
  for (int i = 0; i < STEP; ++i) {
    const float send = upper ? v[i] : v[i + STEP], keep = upper ? v[i + STEP] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, STEP);
  }
  if constexpr (STEP > 1) transpose_sum<STEP / 2>(v, lane);
}

// grid (nkv * chunks, rows), block 256, dynamic shared memory (1 + heads per block) * cap4 * 4 bytes.
// Needs hd % 8 == 0 and hd <= 256 (a lane's 8 dimensions of a key row as two float4).
template <bool BUTTERFLY>
__global__ void __launch_bounds__(256) attn_heads_kernel(const AttnArgs a, const StepParams* sp) {
  pdl_begin();
  extern __shared__ float smem[];
  constexpr int MAXH = kAttnHeadsPerBlock;
  const int r = blockIdx.y, hpg = a.nh / a.nkv, chunks = attn_heads_chunks(hpg), hb = attn_heads_per_block(hpg);
  const int g = blockIdx.x / chunks, c = blockIdx.x % chunks;
  const int h0 = g * hpg + c * hb, nhb = min(hb, hpg - c * hb);  // this block's heads h0 .. h0+nhb-1
  if (nhb <= 0) return;  // uniform over the block
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  const int64_t n = sp->pos + r + 1;
  const int cap4 = attn_cap4(a);
  int* idx = reinterpret_cast<int*>(smem);
  float* p = smem + cap4;  // [head][cap4]
  const int m = attn_gather_selected(a, r, n, idx);
  const size_t kvw = static_cast<size_t>(a.nkv) * a.hd;
  const float scale = 1.0f / sqrtf(static_cast<float>(a.hd));

  // Scores: warp per key; lane holds dimensions 8*lane .. 8*lane+7 of each head's query.
  const bool has = lane * 8 < a.hd;
  float q[MAXH][8];
#pragma unroll
  for (int h = 0; h < MAXH; ++h) {
    const float* qh = a.q + static_cast<size_t>(r) * a.ldq + static_cast<size_t>(h0 + min(h, nhb - 1)) * a.hd + lane * 8;
    float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
    if (has && h < nhb) { lo = *reinterpret_cast<const float4*>(qh); hi = *reinterpret_cast<const float4*>(qh + 4); }
    q[h][0] = lo.x; q[h][1] = lo.y; q[h][2] = lo.z; q[h][3] = lo.w;
    q[h][4] = hi.x; q[h][5] = hi.y; q[h][6] = hi.z; q[h][7] = hi.w;
  }
  // Four keys per warp and pass, their loads issued together (one key at a time, each pass waited for
  // its load: the kernel was latency-bound).
  constexpr int KU = 4;
  const float* kg = a.k_cache + static_cast<size_t>(g) * a.hd + lane * 8;
  for (int jb = warp * KU; jb < m; jb += n_warps * KU) {
    float k[KU][8] = {};
#pragma unroll
    for (int u = 0; u < KU; ++u)
      if (has && jb + u < m) {
        const float* kr = kg + static_cast<size_t>(idx[jb + u]) * kvw;
        const float4 lo = *reinterpret_cast<const float4*>(kr), hi = *reinterpret_cast<const float4*>(kr + 4);
        k[u][0] = lo.x; k[u][1] = lo.y; k[u][2] = lo.z; k[u][3] = lo.w;
        k[u][4] = hi.x; k[u][5] = hi.y; k[u][6] = hi.z; k[u][7] = hi.w;
      }
    if constexpr (BUTTERFLY) {
      // The KU x MAXH partial dots (value u * MAXH + h) summed over the warp by a transposing
      // butterfly: at each step a lane keeps half of its values and adds its partner's copy of that
      // half, so 16 + 8 + 4 + 2 + 1 = 31 shuffles give all 32 sums (a warp_sum per dot took 5 each:
      // 120 for 6 heads). Lane l ends with value l. Absent heads and keys are zeros.
      static_assert(KU * MAXH == 32, "one value per lane");
      float v[32];
#pragma unroll
      for (int u = 0; u < KU; ++u)
#pragma unroll
        for (int h = 0; h < MAXH; ++h) {
          float dot = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) dot = fmaf(q[h][i], k[u][i], dot);
          v[u * MAXH + h] = dot;
        }
      transpose_sum<16>(v, lane);
      const int u = lane / MAXH, h = lane % MAXH;
      if (h < nhb && jb + u < m) p[h * cap4 + jb + u] = v[0] * scale;
    } else {
#pragma unroll
      for (int u = 0; u < KU; ++u) {
        if (jb + u >= m) break;  // uniform
#pragma unroll
        for (int h = 0; h < MAXH; ++h) {
          if (h >= nhb) break;  // uniform
          float dot = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) dot = fmaf(q[h][i], k[u][i], dot);
          dot = warp_sum(dot);
          if (lane == 0) p[h * cap4 + jb + u] = dot * scale;
        }
      }
    }
  }
  __syncthreads();
  // Softmax: warp w for head w (the float4 reads' tail zeroed).
  if (warp < nhb) attn_softmax_warp(p + warp * cap4, m, (m + 3) & ~3);
  if (threadIdx.x < ((m + 3) & ~3) - m) idx[m + threadIdx.x] = idx[0];  // a valid row for the tail
  __syncthreads();
  // Σ_j p_j v_j in key order, thread per dimension, sixteen keys per pass with their value loads
  // issued together (the tail's weights are 0 and come last, so they add +0 to a finished sum).
  const float* vg = a.v_cache + static_cast<size_t>(g) * a.hd;
  for (int i = threadIdx.x; i < a.hd; i += blockDim.x) {
    float acc[MAXH] = {};
    const int m4 = (m + 3) & ~3;
    for (int j0 = 0; j0 < m4; j0 += 16) {
      const int nq = min(4, (m4 - j0) / 4);  // groups of four keys in this pass
      float v[16];
#pragma unroll
      for (int qd = 0; qd < 4; ++qd) {
        if (qd < nq) {
          const int4 id = *reinterpret_cast<const int4*>(idx + j0 + 4 * qd);
          v[4 * qd + 0] = vg[static_cast<size_t>(id.x) * kvw + i];
          v[4 * qd + 1] = vg[static_cast<size_t>(id.y) * kvw + i];
          v[4 * qd + 2] = vg[static_cast<size_t>(id.z) * kvw + i];
          v[4 * qd + 3] = vg[static_cast<size_t>(id.w) * kvw + i];
        }
      }
#pragma unroll
      for (int qd = 0; qd < 4; ++qd) {
        if (qd >= nq) break;  // uniform
#pragma unroll
        for (int h = 0; h < MAXH; ++h) {
          if (h >= nhb) break;  // uniform
          const float4 w = *reinterpret_cast<const float4*>(p + h * cap4 + j0 + 4 * qd);
          acc[h] = mul_add_rn(mul_add_rn(mul_add_rn(mul_add_rn(acc[h], w.x, v[4 * qd]), w.y, v[4 * qd + 1]), w.z,
                                         v[4 * qd + 2]),
                              w.w, v[4 * qd + 3]);
        }
      }
    }
#pragma unroll
    for (int h = 0; h < MAXH; ++h) {
      if (h >= nhb) break;
      const float* gate = a.qg + static_cast<size_t>(r) * a.ldqg + static_cast<size_t>(h0 + h) * 2 * a.hd + a.hd;
      a.out[static_cast<size_t>(r) * a.ldo + static_cast<size_t>(h0 + h) * a.hd + i] = acc[h] * sigmoidf_(gate[i]);
    }
  }
}

// ---- Prefill attention on the tensor cores (CK_ATTN_TC=0: attn_heads_kernel)
//
// attn_heads_kernel does ~51 GFLOP of fp32 FMAs per 1,024-row chunk and attention layer at 8k tokens
// of context (1.22 ms, near the CUDA-core rate; 17.5 us of an 8k prefill token's ~100 us, eleventh
// session). Here a block takes one (row, KV head) with all of the group's query heads (hpg <= 16) as
// the 16 rows of m16n8k16 MMAs: scores S = Q K^T over the selected keys, then O = P V. Each operand is
// split into two bf16 parts (hi = bf16(v), lo = bf16(v - hi): 16 significant bits), and a product is
// three MMAs (lo hi, hi lo, hi hi; lo lo is below fp32's rounding of the sum) with fp32 accumulators.
// The softmax is attn_heads_kernel's (max, exp, one division per key) on the scores in shared memory.
// The sums run in the MMAs' order, with the operands rounded to 16 bits: another rounding than the
// fp32 kernels', within the parity tests' tolerances (tests/parity: the prefill chunk tests and the
// oracle fixtures run it). Each K and V row is read once per group (attn_heads_kernel: once per chunk
// of <= 8 heads, twice at the released 12 heads per group).
constexpr int kAttnTcWarps = 8;
constexpr int kAttnTcMaxSteps = 16;  // hd <= 256: 16-dimension steps of the scores
constexpr int kAttnTcVSteps = 4;     // 16-key steps of P V whose value loads are issued together

// hi and lo parts of (a, b) as two bf16x2 words (.x hi, .y lo); a in the low half.
__device__ __forceinline__ uint2 split_bf16x2(float a, float b) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(a - hf.x, b - hf.y);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&h), *reinterpret_cast<const uint32_t*>(&l));
}

// d += (ah + al)(bh + bl) without al bl: A parts as 4 words each, B parts as (b0, b1).
__device__ __forceinline__ void mma_split(float (&d)[4], const uint4& ah, const uint4& al, const uint2& b0,
                                          const uint2& b1) {
  mma_bf16(d, al.x, al.y, al.z, al.w, b0.x, b1.x);
  mma_bf16(d, ah.x, ah.y, ah.z, ah.w, b0.y, b1.y);
  mma_bf16(d, ah.x, ah.y, ah.z, ah.w, b0.x, b1.x);
}

// Selectable keys rounded up to 16 (the 16-key steps of P V).
__host__ __device__ inline int attn_cap16(const AttnArgs& a) { return (attn_cap(a) + 15) & ~15; }
// Dynamic shared memory: the selected ids, the weights of hpg heads, the query fragments.
__host__ __device__ inline size_t attn_tc_smem(const AttnArgs& a) {
  return sizeof(int) * attn_cap16(a) + sizeof(float) * (a.nh / a.nkv) * attn_cap16(a) +
         sizeof(uint4) * 2 * 32 * (a.hd / 16);
}

// grid (nkv, rows), block 256, dynamic shared memory attn_tc_smem. Needs hd % 16 == 0, hd <= 256,
// nh / nkv <= 16.
__global__ void __launch_bounds__(kAttnTcWarps * 32) attn_heads_tc_kernel(const AttnArgs a, const StepParams* sp) {
  pdl_begin();
  extern __shared__ __align__(16) float smem[];
  const int kv = blockIdx.x, r = blockIdx.y, hpg = a.nh / a.nkv, h0 = kv * hpg;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t n = sp->pos + r + 1;
  const int cap16 = attn_cap16(a), steps = a.hd / 16;
  int* idx = reinterpret_cast<int*>(smem);
  float* p = smem + cap16;                                 // [head][cap16]
  uint4* qf = reinterpret_cast<uint4*>(p + hpg * cap16);  // [step][part][lane]: A fragment words a0..a3
  const int m = attn_gather_selected(a, r, n, idx);       // (synchronises: idx is complete)
  const int m16 = (m + 15) & ~15;
  const size_t kvw = static_cast<size_t>(a.nkv) * a.hd;

  // Q's A fragments: a0 (head g, dims 2t, 2t+1), a1 (head g+8, the same), a2 / a3 (dims 2t+8, 2t+9) of
  // each 16-dimension step; heads past hpg are zeros.
  const float* qrow = a.q + static_cast<size_t>(r) * a.ldq + static_cast<size_t>(h0) * a.hd;
  for (int e = threadIdx.x; e < steps * 32; e += blockDim.x) {
    const int s = e >> 5, l = e & 31, lg = l >> 2, lt = l & 3;
    uint2 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int head = lg + 8 * (i & 1), d = 16 * s + 2 * lt + 8 * (i >> 1);
      float2 v = make_float2(0.0f, 0.0f);
      if (head < hpg) v = *reinterpret_cast<const float2*>(qrow + static_cast<size_t>(head) * a.hd + d);
      w[i] = split_bf16x2(v.x, v.y);
    }
    qf[(2 * s) * 32 + l] = make_uint4(w[0].x, w[1].x, w[2].x, w[3].x);
    qf[(2 * s + 1) * 32 + l] = make_uint4(w[0].y, w[1].y, w[2].y, w[3].y);
  }
  if (threadIdx.x < m16 - m) idx[m + threadIdx.x] = idx[0];  // valid rows for the last keys' loads
  __syncthreads();

  // Scores: warp w takes key tiles w, w + 8, ... of 8 keys (the MMA's n); lane (g, t) loads key g's
  // dimensions 2t, 2t+1, 2t+8, 2t+9 of every step, all steps' loads issued together.
  const float scale = 1.0f / sqrtf(static_cast<float>(a.hd));
  const float* kg = a.k_cache + static_cast<size_t>(kv) * a.hd + 2 * t;
  for (int kt = warp; kt * 8 < m; kt += kAttnTcWarps) {
    const float* kr = kg + static_cast<size_t>(idx[kt * 8 + g]) * kvw;
    float2 kx[kAttnTcMaxSteps][2];
#pragma unroll
    for (int s = 0; s < kAttnTcMaxSteps; ++s)
      if (s < steps) {
        kx[s][0] = *reinterpret_cast<const float2*>(kr + 16 * s);
        kx[s][1] = *reinterpret_cast<const float2*>(kr + 16 * s + 8);
      }
    float d[4] = {};
#pragma unroll
    for (int s = 0; s < kAttnTcMaxSteps; ++s)
      if (s < steps)
        mma_split(d, qf[(2 * s) * 32 + lane], qf[(2 * s + 1) * 32 + lane], split_bf16x2(kx[s][0].x, kx[s][0].y),
                  split_bf16x2(kx[s][1].x, kx[s][1].y));
    // d0, d1: head g, keys 8 kt + 2t, + 1; d2, d3: head g + 8.
    const int j = kt * 8 + 2 * t;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int head = g + 8 * hh;
      if (head >= hpg) continue;
      if (j < m) p[head * cap16 + j] = d[2 * hh] * scale;
      if (j + 1 < m) p[head * cap16 + j + 1] = d[2 * hh + 1] * scale;
    }
  }
  __syncthreads();
  // Softmax per head (attn_heads_kernel's), zero weights for the keys past m up to m16.
  for (int h = warp; h < hpg; h += kAttnTcWarps) attn_softmax_warp(p + h * cap16, m, m16);
  __syncthreads();

  // O = P V: warp w takes 8-dimension tiles 4w .. 4w+3 (then + 32); per 16-key step, A = the weights
  // of heads (g, g+8) for keys 2t, 2t+1 (a0, a1) and 2t+8, 2t+9 (a2, a3); B = those keys' values at
  // dimension g of each tile, kAttnTcVSteps steps' loads issued together.
  const float* vg = a.v_cache + static_cast<size_t>(kv) * a.hd + g;
  const int ntiles = a.hd / 8;
  const float* gate0 = a.qg + static_cast<size_t>(r) * a.ldqg + static_cast<size_t>(h0) * 2 * a.hd + a.hd;
  for (int nt0 = 4 * warp; nt0 < ntiles; nt0 += 4 * kAttnTcWarps) {
    float o[4][4] = {};
    for (int j0 = 0; j0 < m16; j0 += 16 * kAttnTcVSteps) {
      float v[kAttnTcVSteps][4][4];  // [step][tile][key 2t, 2t+1, 2t+8, 2t+9]
#pragma unroll
      for (int u = 0; u < kAttnTcVSteps; ++u) {
        const int jb = j0 + 16 * u;
        if (jb >= m16) break;
        const int key[4] = {idx[jb + 2 * t], idx[jb + 2 * t + 1], idx[jb + 2 * t + 8], idx[jb + 2 * t + 9]};
#pragma unroll
        for (int nn = 0; nn < 4; ++nn)
#pragma unroll
          for (int c = 0; c < 4; ++c)
            v[u][nn][c] = nt0 + nn < ntiles ? vg[static_cast<size_t>(key[c]) * kvw + (nt0 + nn) * 8] : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kAttnTcVSteps; ++u) {
        const int jb = j0 + 16 * u;
        if (jb >= m16) break;
        uint2 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int head = g + 8 * (i & 1);
          float2 pw = make_float2(0.0f, 0.0f);
          if (head < hpg) pw = *reinterpret_cast<const float2*>(p + head * cap16 + jb + 2 * t + 8 * (i >> 1));
          w[i] = split_bf16x2(pw.x, pw.y);
        }
        const uint4 ah = make_uint4(w[0].x, w[1].x, w[2].x, w[3].x), al = make_uint4(w[0].y, w[1].y, w[2].y, w[3].y);
#pragma unroll
        for (int nn = 0; nn < 4; ++nn)
          mma_split(o[nn], ah, al, split_bf16x2(v[u][nn][0], v[u][nn][1]), split_bf16x2(v[u][nn][2], v[u][nn][3]));
      }
    }
    // o[nn]: d0, d1 = head g, dimensions 8 (nt0 + nn) + 2t, + 1; d2, d3 = head g + 8.
#pragma unroll
    for (int nn = 0; nn < 4; ++nn) {
      if (nt0 + nn >= ntiles) break;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int head = g + 8 * hh;
        if (head >= hpg) continue;
        const int dim = 8 * (nt0 + nn) + 2 * t;
        const float* gate = gate0 + static_cast<size_t>(head) * 2 * a.hd;
        float* out = a.out + static_cast<size_t>(r) * a.ldo + static_cast<size_t>(h0 + head) * a.hd + dim;
        out[0] = o[nn][2 * hh] * sigmoidf_(gate[dim]);
        out[1] = o[nn][2 * hh + 1] * sigmoidf_(gate[dim + 1]);
      }
    }
  }
}

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

// ------------------------------------------------------------------ MoE

// Slot t of row r's pairs: routed expert e with its weight (t < k), or the shared expert (t == k).
__device__ __forceinline__ void write_route_pair(const MoeRouteArgs& a, int r, int t, int e, float weight) {
  ExpertPair pr;
  pr.x_row = r;
  if (t < a.k) {
    const ExpertSlot slot = a.table[e];
    expert_views(slot.addr, slot.fmt, a.inter, a.hidden, &pr.gate, &pr.up, &pr.down);
    pr.weight = weight;
    pr.group = e;
  } else {
    pr.gate = a.sh_gate;
    pr.up = a.sh_up;
    pr.down = a.sh_down;
    pr.weight = 0.0f;
    pr.group = a.E;
  }
  a.pairs[static_cast<size_t>(r) * (a.k + 1) + t] = pr;
}

// grid (rows), block 256, dynamic shared memory E floats + E bytes. Any E (moe_route_warp_kernel
// takes E <= 1,024).
__global__ void moe_route_kernel(const MoeRouteArgs a) {
  pdl_begin();
  extern __shared__ float prob[];
  __shared__ float scratch[32];
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ int top[64];
  __shared__ float top_sum;
  uint8_t* flags = reinterpret_cast<uint8_t*>(prob + a.E);
  const int r = blockIdx.x;
  const float* lg = a.logits + static_cast<size_t>(r) * a.ld;
  const float* lg2 = a.logits2 ? a.logits2 + static_cast<size_t>(r) * a.ld : nullptr;
  auto logit = [&](int e) { return lg2 ? lg[e] + lg2[e] : lg[e]; };
  float mx = -INFINITY;
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) mx = fmaxf(mx, logit(e));
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) {
    const float v = expf(logit(e) - mx);
    prob[e] = v;
    sum += v;
  }
  sum = block_sum(sum, scratch);
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) prob[e] /= sum;
  __syncthreads();
  block_topk(prob, a.E, a.k, top, flags, sv, si);
  if (threadIdx.x == 0) {
    float ts = 0.0f;
    for (int t = 0; t < a.k; ++t) ts += prob[top[t]];
    top_sum = ts;
  }
  __syncthreads();
  for (int t = threadIdx.x; t <= a.k; t += blockDim.x) {
    const int e = t < a.k ? top[t] : 0;
    write_route_pair(a, r, t, e, t < a.k ? (a.norm_topk ? prob[e] / top_sum : prob[e]) : 0.0f);
  }
}

// The same routing with one warp per row and no block barriers, for E <= 32 VPL: lane l holds the
// probabilities of experts [VPL l, VPL l + VPL) in registers, and each of the k rounds is a scan of
// the lane's unused values and a warp argmax (ties to the lower index, NaN never wins: block_topk's
// rules). (The rounds as a lane max tree of order keys, a REDUX max and a ballot measured 0.4-0.6%
// slower, H200 2026-12-01 21:04Z.) Routing cost ~8 us per layer inside a one-row decode step's graph
// with the block kernel (CK_HOLLOW, 2026-11-30); this kernel takes 0.4-1.4 us of it away (decode
// +0.3-1.2%, same call), so the block kernel's k rounds of barriers were a small part of that time. The softmax sums in
// another order than the block kernel (a warp's butterfly): probabilities may differ from it in the
// last bit.
// grid (ceil(rows / 8)), block 32 min(rows, 8).
template <int VPL>
__global__ void __launch_bounds__(256) moe_route_warp_kernel(const MoeRouteArgs a, int rows, int prefetch_table) {
  // The expert table (param_prefetch_on()): constant during a step, read once the picks are known, and
  // out of L2 again by the next step (8 KB of lines at E = 512: a DRAM round trip in the route's tail).
  if (prefetch_table && blockIdx.x == 0) {
    const uint8_t* tb = reinterpret_cast<const uint8_t*>(a.table);
    const int bytes = a.E * static_cast<int>(sizeof(ExpertSlot));
    for (int off = 128 * static_cast<int>(threadIdx.x); off < bytes; off += 128 * static_cast<int>(blockDim.x))
      prefetch_l2(tb + off);
  }
  pdl_begin();
  const int lane = threadIdx.x & 31, r = static_cast<int>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (r >= rows) return;
  const float* lg = a.logits + static_cast<size_t>(r) * a.ld;
  const float* lg2 = a.logits2 ? a.logits2 + static_cast<size_t>(r) * a.ld : nullptr;
  const int e0 = VPL * lane;
  float p[VPL];
#pragma unroll
  for (int j = 0; j < VPL; ++j) p[j] = e0 + j < a.E ? lg[e0 + j] : -INFINITY;
  if (lg2)
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (e0 + j < a.E) p[j] += lg2[e0 + j];
  float mx = p[0];
#pragma unroll
  for (int j = 1; j < VPL; ++j) mx = fmaxf(mx, p[j]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    p[j] = e0 + j < a.E ? expf(p[j] - mx) : 0.0f;
    sum += p[j];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < VPL; ++j) p[j] /= sum;
  uint32_t used = 0;  // bit j: expert e0 + j taken (or past E)
#pragma unroll
  for (int j = 0; j < VPL; ++j)
    if (e0 + j >= a.E) used |= 1u << j;
  int mine0 = 0, mine1 = 0;  // lane l keeps the picks of rounds l and l + 32 (k <= 64)
  float mine0_p = 0.0f, mine1_p = 0.0f;
  float ts = 0.0f;
#pragma unroll 1
  for (int t = 0; t < a.k; ++t) {
    float bv = -INFINITY;
    int bi = INT_MAX;
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (!(used >> j & 1u) && arg_better(p[j], e0 + j, bv, bi)) { bv = p[j]; bi = e0 + j; }
    warp_argmax(bv, bi);
    if (bi == INT_MAX) {  // only NaNs left: the lowest unused index
      int lo = INT_MAX;
#pragma unroll
      for (int j = VPL - 1; j >= 0; --j)
        if (!(used >> j & 1u)) lo = e0 + j;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
      bi = lo;
    }
    const int owner = bi / VPL, jb = bi - owner * VPL;
    float pv = 0.0f;
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (j == jb) pv = p[j];
    pv = __shfl_sync(0xffffffffu, pv, owner);  // the pick's probability (bv, or the NaN)
    if (lane == owner) used |= 1u << jb;
    ts += pv;  // block kernel's order: the picks' probabilities in round order
    if (t == lane) {
      mine0 = bi;
      mine0_p = pv;
    } else if (t == lane + 32) {
      mine1 = bi;
      mine1_p = pv;
    }
  }
  // The lane's slots t = lane + 32 h: its picks of rounds lane and lane + 32, and (t == k) the shared
  // expert's, through one call site (three inlined copies of write_route_pair, and the rounds' loop
  // unrolled, made 35 KB of SASS at E = 512; now 26 KB; decode level, H200 2026-12-01 18:30Z).
#pragma unroll 1
  for (int h = 0; h < 3; ++h) {
    const int t = lane + 32 * h;
    if (t > a.k) break;
    const int e = h == 0 ? mine0 : h == 1 ? mine1 : 0;
    const float pv = h == 0 ? mine0_p : h == 1 ? mine1_p : 0.0f;
    write_route_pair(a, r, t, e, t < a.k ? (a.norm_topk ? pv / ts : pv) : 0.0f);
  }
}

// grid (ceil(H/256), rows), block 256.
__global__ void moe_combine_kernel(const float* y, int ldy, const ExpertPair* pairs, int k, const float* gl, int ldgl,
                                   float* out, int ldo, int H) {
  pdl_begin();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= H) return;
  const int r = blockIdx.y;
  const size_t p0 = static_cast<size_t>(r) * (k + 1);
  const float gamma = sigmoidf_(gl[static_cast<size_t>(r) * ldgl]);
  out[static_cast<size_t>(r) * ldo + i] = moe_combine_elem(y + p0 * ldy, ldy, pairs + p0, k, gamma, i);
}

}  // namespace

void init_kernels() {
  init_gemv();
  hc_mix_init();
  // Kernels take their scratch with cudaMallocAsync (split-K partials, activation fragments, the chunked
  // delta rule's records: ~220 MB per 2,048-row prefill chunk at the released geometry). By default
  // the pool hands memory back to the driver at every synchronisation, so each prefill chunk would map
  // it again; keep up to 512 MB pooled instead.
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t keep = uint64_t{512} << 20;
  CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(gdn_prep_smem(kGdnChunkMaxDim, kGdnChunkMaxDim))));
  CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(gdn_scan_smem(kGdnChunkMaxDim))));
  CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan_tc_kernel<32, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(gdn_scan_tc_smem(kGdnChunkMaxDim, 32))));
  CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan_tc_kernel<64, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(gdn_scan_tc_smem(kGdnChunkMaxDim, 64))));
  CUDA_CHECK(cudaFuncSetAttribute(attn_heads_tc_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_decode_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_decode_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_decode_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_heads_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_heads_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
}

std::vector<float> rope_inv_freq(int rot_dim, double theta) {
  std::vector<float> f(static_cast<size_t>(rot_dim / 2));
  for (int j = 0; j < rot_dim / 2; ++j)
    f[j] = 1.0f / static_cast<float>(std::pow(theta, static_cast<double>(2 * j) / rot_dim));
  return f;
}

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
                        const float* scale, float eps, float* out, int rows, cudaStream_t stream) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  // The shape rmsnorm_grouped sends to its wide kernel, and float4 rows of o.
  if (H < 2048 || H % 4 != 0 || H > 16 * 1024 || ldR % 4 != 0 || ldo % 4 != 0 || !aligned(R) || !aligned(o) ||
      !aligned(out) || !aligned(scale))
    return false;
  launch(hc_combine_rmsnorm_kernel, dim3(static_cast<unsigned>(S), static_cast<unsigned>(rows)), rmsnorm_wide_block(H),
         0, stream, R, int64_t{ldR}, o, int64_t{ldo}, w, ldw, int64_t{H}, scale, eps, out, hc_r_prefetch_on() ? 1 : 0);
  CUDA_CHECK_LAUNCH();
  return true;
}

void gdn_conv(const GdnConvArgs& a, const StepParams* sp, int rows, cudaStream_t stream) {
  CK_REQUIRE(a.K >= 1 && a.K - 1 <= kMaxConvHist, "GDN conv kernel %d > %d", a.K, kMaxConvHist + 1);
  static_assert(kConvRowBlock >= kMaxConvHist, "row blocks past the first read their history from x");
  if (rows > kMaxRows)  // a prefill chunk: no snapshots
    launch(gdn_conv_rows_kernel,
           dim3(static_cast<unsigned>(ceil_div(a.C, 256)), static_cast<unsigned>(ceil_div(rows, kConvRowBlock))), 256, 0,
           stream, a, rows);
  else
    launch(gdn_conv_kernel, static_cast<unsigned>(ceil_div(a.C, 256)), 256, 0, stream, a, sp, rows);
  CUDA_CHECK_LAUNCH();
}

namespace {
int g_gdn_cluster_norm = -1;  // -1: not yet read from CK_GDN_CLUSTER_NORM
}  // namespace

void set_gdn_cluster_norm(bool on) { g_gdn_cluster_norm = on ? 1 : 0; }

void gdn_recurrent(const GdnRecArgs& a, const StepParams* sp, int rows, cudaStream_t stream) {
  const int parts = static_cast<int>(ceil_div(a.dk, kKeyPart));
  CK_REQUIRE(a.dk <= 256 && a.dv * parts <= 512 && a.nv % a.nk == 0, "GDN dims dk %d dv %d nk %d nv %d", a.dk, a.dv,
            a.nk, a.nv);
  // Split each head's value columns over blocks of 32 (4x the blocks at dv 128: 48 heads alone use a
  // third of the GPU), then norm in a second kernel; small heads keep one block and the fused norm.
  const int split = (a.dv % 32 == 0 && a.dv >= 64 && a.dv <= 1024) ? a.dv / 32 : 1;
  const int cols = a.dv / split;
  const int threads = static_cast<int>(round_up(cols * parts, 32));
  const size_t smem = sizeof(float) * (2 * a.dk + parts * cols);
  // A split head's blocks as one thread-block cluster make the norm themselves (no second kernel and
  // its hand-over); CK_GDN_CLUSTER_NORM=0 keeps gdn_out_norm_kernel, to compare.
  if (g_gdn_cluster_norm < 0) g_gdn_cluster_norm = env_is("CK_GDN_CLUSTER_NORM", "0") ? 0 : 1;
  const bool cluster = g_gdn_cluster_norm == 1 && split > 1 && split <= 8 && cols == 32 && rows <= kMaxRows;
  const GdnNorm mode = split == 1 ? GdnNorm::Block : cluster ? GdnNorm::Cluster : GdnNorm::Kernel;
  launch_cluster(gdn_recurrent_kernel, dim3(a.nv, split), threads, smem, stream, dim3(1, cluster ? split : 1, 1), a,
                 sp, rows, mode, param_prefetch_on() ? 1 : 0);
  CUDA_CHECK_LAUNCH();
  if (mode == GdnNorm::Kernel) {
    launch(gdn_out_norm_kernel, dim3(a.nv, rows), static_cast<unsigned>(round_up(a.dv, 32)), 0, stream, a);
    CUDA_CHECK_LAUNCH();
  }
}

bool gdn_chunked_fits(const GdnRecArgs& a) {
  return a.dk >= 1 && a.dk <= kGdnChunkMaxDim && a.dv >= 1 && a.dv <= kGdnChunkMaxDim && a.nk >= 1 && a.nv % a.nk == 0;
}

// Which scan the chunked delta rule runs: -1 not yet read (CK_GDN_SCAN=fp32: the fp32 kernel), 1 the
// 3xTF32 tensor-core kernel, 0 the fp32 one. The tensor-core kernel's value columns per block: 32 or 64
// (CK_GDN_SCAN_COLS; -1: not yet read).
static int g_gdn_scan_tc = -1;
static int g_gdn_scan_cols = -1;
void set_gdn_scan_tc(int on) { g_gdn_scan_tc = on < 0 ? -1 : (on ? 1 : 0); }
void set_gdn_scan_cols(int cols) { g_gdn_scan_cols = cols == 32 || cols == 64 ? cols : -1; }

void gdn_chunked(const GdnRecArgs& a, int rows, cudaStream_t stream) {
  CK_REQUIRE(gdn_chunked_fits(a), "GDN dims dk %d dv %d nk %d nv %d (chunked form: dk, dv <= %d)", a.dk, a.dv, a.nk,
             a.nv, kGdnChunkMaxDim);
  if (rows <= 0) return;
  const int chunks = static_cast<int>(ceil_div(rows, kGdnChunk));
  const GdnChunkLayout lay(a.dk, a.dv);
  float* records = nullptr;  // stream-ordered scratch, pooled by the driver
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&records), sizeof(float) * lay.size * chunks * a.nv, stream));
  launch(gdn_chunk_prep_kernel, dim3(a.nv, chunks), 256, gdn_prep_smem(a.dk, a.dv), stream, a, rows, records);
  CUDA_CHECK_LAUNCH();
  if (g_gdn_scan_tc < 0) g_gdn_scan_tc = env_is("CK_GDN_SCAN", "fp32") ? 0 : 1;
  if (g_gdn_scan_cols < 0) g_gdn_scan_cols = env_is("CK_GDN_SCAN_COLS", "64") ? 64 : 32;
  const int cols = g_gdn_scan_tc ? g_gdn_scan_cols : kGdnScanCols;
  const dim3 scan_grid(a.nv, static_cast<unsigned>(ceil_div(a.dv, cols)));
  if (!g_gdn_scan_tc)
    launch(gdn_chunk_scan_kernel, scan_grid, 256, gdn_scan_smem(a.dk), stream, a, rows, records);
  else if (cols == 64)
    launch(gdn_chunk_scan_tc_kernel<64, 1>, scan_grid, 256, gdn_scan_tc_smem(a.dk, 64), stream, a, rows, records);
  else
    launch(gdn_chunk_scan_tc_kernel<32, 2>, scan_grid, 256, gdn_scan_tc_smem(a.dk, 32), stream, a, rows, records);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaFreeAsync(records, stream));
  launch(gdn_out_norm_rows_kernel, rows, 256, 0, stream, a);
  CUDA_CHECK_LAUNCH();
}

int64_t attention_max_selected(int block_topk, int cr) { return static_cast<int64_t>(block_topk + 1) * cr - 1; }

namespace {
// Selected keys per split of the split decode attention; -1: not yet read (CK_ATTN_SPLIT: keys per
// split, 0 to turn the split off). Splits are sized by the most keys a query can select (a graph is
// replayed at every position), at most kAttnMaxSplits.
constexpr int kAttnSplitKeys = 256;
constexpr int kAttnMaxSplits = 16;
int g_attn_split_keys = -1;
int attn_decode_splits(int cap) {
  if (g_attn_split_keys < 0) {
    const char* e = std::getenv("CK_ATTN_SPLIT");
    g_attn_split_keys = e ? std::max(0, std::atoi(e)) : kAttnSplitKeys;
  }
  if (g_attn_split_keys == 0) return 1;
  return static_cast<int>(std::min<int64_t>(kAttnMaxSplits, ceil_div(cap, g_attn_split_keys)));
}
}  // namespace

void set_attn_split_keys(int keys) { g_attn_split_keys = keys; }

void attention(const AttnArgs& args, const StepParams* sp, int rows, cudaStream_t stream) {
  static const bool prefetch_kv = !env_is("CK_ATTN_KV_PREFETCH", "0");
  AttnArgs a = args;
  a.prefetch_kv = prefetch_kv ? 1 : 0;
  CK_REQUIRE(a.cr >= 1 && a.block_topk >= 1 && a.nh % a.nkv == 0 && a.rot <= a.hd && a.rot <= a.ihd, "invariant");
  const int cap = static_cast<int>(attention_max_selected(a.block_topk, a.cr));
  const size_t dec_smem = static_cast<size_t>(cap) * 8;
  CK_REQUIRE(dec_smem <= kAttnMaxSmem, "attention: %d selectable keys do not fit in shared memory", cap);
  const int nprep = a.nh + a.nkv + a.inh + 1;
  launch(attn_prep_kernel, dim3(nprep, rows), 128, sizeof(float) * std::max(a.hd, a.ihd), stream, a, sp);
  CUDA_CHECK_LAUNCH();
  launch(attn_pool_kernel, rows, 128, sizeof(float) * a.ihd, stream, a, sp);
  CUDA_CHECK_LAUNCH();
  launch(attn_scores_kernel, dim3(static_cast<unsigned>(ceil_div(a.nb_max, 8)), rows), 256, 0, stream, a, sp);
  CUDA_CHECK_LAUNCH();
  launch(attn_select_kernel, rows, 256, 0, stream, a, sp);
  CUDA_CHECK_LAUNCH();
  const int hpg = a.nh / a.nkv;
  // Prefill chunks on the tensor cores: a block per (row, KV head) with all its query heads.
  static const bool tc_on = !env_is("CK_ATTN_TC", "0");
  if (tc_on && rows > kMaxRows && a.hd % 16 == 0 && a.hd <= 16 * kAttnTcMaxSteps && hpg <= 16 &&
      attn_tc_smem(a) <= kAttnMaxSmem) {
    launch(attn_heads_tc_kernel, dim3(static_cast<unsigned>(a.nkv), static_cast<unsigned>(rows)), kAttnTcWarps * 32,
           attn_tc_smem(a), stream, a, sp);
    CUDA_CHECK_LAUNCH();
    return;
  }
  // Prefill chunks: the heads of one KV head together (CK_ATTN_HEADS=0 keeps one block per head).
  static const bool heads_on = !env_is("CK_ATTN_HEADS", "0");
  const size_t heads_smem = static_cast<size_t>(1 + attn_heads_per_block(hpg)) * attn_cap4(a) * sizeof(float);
  if (heads_on && rows > kMaxRows && a.hd % 8 == 0 && a.hd <= 256 && heads_smem <= kAttnMaxSmem) {
    // CK_ATTN_BUTTERFLY=0: one warp sum per dot product (the sixth session's kernel).
    static const bool butterfly = !env_is("CK_ATTN_BUTTERFLY", "0");
    const dim3 grid(static_cast<unsigned>(a.nkv * attn_heads_chunks(hpg)), static_cast<unsigned>(rows));
    if (butterfly) launch(attn_heads_kernel<true>, grid, 256, heads_smem, stream, a, sp);
    else launch(attn_heads_kernel<false>, grid, 256, heads_smem, stream, a, sp);
  } else {
    const int splits = attn_decode_splits(cap);
    if (splits > 1) {
      const int per = static_cast<int>(ceil_div(cap, splits));
      // The step's scratch (common.h scratch_alloc).
      float* part = static_cast<float*>(scratch_alloc(sizeof(float) * rows * a.nh * splits * (a.hd + 2), stream));
      launch(attn_decode_split_kernel, dim3(a.nh, rows, splits), 256, sizeof(float) * (cap + per), stream, a, sp, splits,
             part);
      CUDA_CHECK_LAUNCH();
      launch(attn_decode_combine_kernel, dim3(a.nh, rows), 256, 0, stream, a, splits, static_cast<const float*>(part));
      CUDA_CHECK_LAUNCH();
      scratch_free(part, stream);
      return;
    }
    static const bool batched = !env_is("CK_ATTN_DECODE_BATCH", "0");
    if (batched) launch(attn_decode_kernel<true>, dim3(a.nh, rows), 256, dec_smem, stream, a, sp);
    else launch(attn_decode_kernel<false>, dim3(a.nh, rows), 256, dec_smem, stream, a, sp);
  }
  CUDA_CHECK_LAUNCH();
}

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

SharedSlot route_shared_slot(const MoeRouteArgs& a) {  // write_route_pair's layout
  SharedSlot sh;
  sh.k1 = a.k + 1;
  sh.gate = a.sh_gate;
  sh.up = a.sh_up;
  return sh;
}

void moe_route(const MoeRouteArgs& a, int rows, cudaStream_t stream) {
  CK_REQUIRE(a.k >= 1 && a.k <= 64 && a.k <= a.E && a.E <= 8192, "invariant");
  // A warp per row up to 1,024 experts (CK_ROUTE_WARP=0: the block kernel, to compare).
  static const bool warp = !env_is("CK_ROUTE_WARP", "0");
  const int vpl = static_cast<int>(ceil_div(a.E, 32));
  if (warp && vpl <= 32) {
    const unsigned grid = static_cast<unsigned>(ceil_div(rows, 8)), block = 32 * std::min(rows, 8);
    const int pt = param_prefetch_on() ? 1 : 0;
    if (vpl <= 1) launch(moe_route_warp_kernel<1>, grid, block, 0, stream, a, rows, pt);
    else if (vpl <= 2) launch(moe_route_warp_kernel<2>, grid, block, 0, stream, a, rows, pt);
    else if (vpl <= 4) launch(moe_route_warp_kernel<4>, grid, block, 0, stream, a, rows, pt);
    else if (vpl <= 8) launch(moe_route_warp_kernel<8>, grid, block, 0, stream, a, rows, pt);
    else if (vpl <= 16) launch(moe_route_warp_kernel<16>, grid, block, 0, stream, a, rows, pt);
    else launch(moe_route_warp_kernel<32>, grid, block, 0, stream, a, rows, pt);
  } else {
    launch(moe_route_kernel, rows, 256, sizeof(float) * a.E + a.E, stream, a);
  }
  CUDA_CHECK_LAUNCH();
}

void moe_combine(const float* y, int ldy, const ExpertPair* pairs, int k, const float* gl, int ldgl, float* out,
                 int ldo, int H, int rows, cudaStream_t stream) {
  launch(moe_combine_kernel, dim3(static_cast<unsigned>(ceil_div(H, 256)), rows), 256, 0, stream, y, ldy, pairs, k, gl,
                                                                                                ldgl, out, ldo, H);
  CUDA_CHECK_LAUNCH();
}

}  // namespace ck::cuda
