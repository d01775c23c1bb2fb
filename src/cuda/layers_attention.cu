// Layer-level kernels of the qwen4_exp forward (declared in cuda/layers.h), QSA attention: the q/k/v
// preparation, the indexer with cached pooled block keys, top-k blocks, and the gated softmax attention
// (decode, split decode, prefill heads, prefill on the tensor cores), then their launchers. Each kernel
// is the device twin of a piece of src/cpu/qwen4_exp.cpp and written to be read beside it. Where the CPU
// rounds a product before adding it, the kernels use __fmul_rn/__fadd_rn so no FMA contraction changes
// the bits.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/layers.h"
#include "cuda/layers_internal.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

namespace ck::cuda {
namespace {

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

// Prefill chunks: the same scores as a tiled product (attn_scores_kernel for a step of <= kMaxRows
// rows). attn_scores_kernel spends a warp per (row, block) on 4 x 128 products: two global loads a
// multiply-add, 4.35 ms per 8k chunk and attention layer (H200 2026-12-04, Nsight Compute durations:
// ~30% of the attention core, more than the dense-rows and prep kernels together). Here a block takes
// 64 rows x 64 blocks: the K rows and the queries of 4 heads at a time go to shared memory 32
// dimensions at a time, and each thread keeps 4 rows x 4 blocks x 4 heads of dot products in
// registers, so a multiply-add costs an eighth of a shared load.
// Each dot product runs in the CPU reference's order and rounding (cpu/qwen4_exp.cpp: product
// rounded, then added, dimension 0 first; heads in order, each max(dot, 0) added to s; s / sqrt(ihd)),
// so for the same q and block keys the scores are the CPU's bits (attn_scores_kernel's lane-strided
// FMA sums are not): the top-k sees the CPU's ties.
// grid (ceil(nb_max / 64), ceil(rows / 64)), block 256: thread (tx, ty) = (t % 16, t / 16) takes rows
// 4 ty .. 4 ty + 3 and blocks tx + 16 c. Needs ihd % 4 == 0, ldiq % 4 == 0 and 16-byte aligned iq and
// blk_keys (16-byte loads; attention_block_scores checks).
constexpr int kScoreTile = 64;     // rows and blocks of a tile
constexpr int kScoreDims = 32;     // dimensions staged at a time
constexpr int kScoreHeads = 4;     // query heads staged at a time
constexpr int kScoreLdk = kScoreDims + 1;  // an odd row stride: the 16 blocks a warp reads sit in 16 banks
__global__ void __launch_bounds__(256) attn_scores_tiled_kernel(const AttnArgs a, const StepParams* sp, int rows) {
  pdl_begin();
  __shared__ float ks[kScoreTile][kScoreLdk];                          // [block][dimension]
  __shared__ __align__(16) float qs[kScoreHeads][kScoreDims][kScoreTile];  // [head][dimension][row]
  const int r0 = blockIdx.y * kScoreTile, r_last = min(rows, r0 + kScoreTile) - 1;
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * kScoreTile;
  const int64_t pos = sp->pos, nb_last = (pos + r_last + 1) / a.cr;  // the tile's most complete blocks
  if (nb_last <= a.block_topk || b0 >= nb_last) return;                // uniform: no row needs these
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  float s[4][4] = {};  // [row 4 ty + j][block tx + 16 c]
  for (int h0 = 0; h0 < a.inh; h0 += kScoreHeads) {
    float dot[kScoreHeads][4][4] = {};
    for (int i0 = 0; i0 < a.ihd; i0 += kScoreDims) {
      const int di = min(kScoreDims, a.ihd - i0);
      __syncthreads();  // the last dimensions' readers are done
      // K rows: 16-byte loads along a row, 8 lanes a row (a warp's scalar stores fall in 32 banks).
      for (int e = threadIdx.x; e < kScoreTile * kScoreDims / 4; e += blockDim.x) {
        const int bb = e >> 3, d = 4 * (e & 7);
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (d < di && b0 + bb < nb_last) v = *reinterpret_cast<const float4*>(a.blk_keys + (b0 + bb) * a.ihd + i0 + d);
        ks[bb][d] = v.x; ks[bb][d + 1] = v.y; ks[bb][d + 2] = v.z; ks[bb][d + 3] = v.w;
      }
      // Queries transposed: a lane a row (16 bytes of it), so the stores along the rows are conflict-free.
      for (int e = threadIdx.x; e < kScoreHeads * kScoreTile * kScoreDims / 4; e += blockDim.x) {
        const int rr = e % kScoreTile, d = 4 * ((e / kScoreTile) % (kScoreDims / 4)), hh = e / (kScoreTile * kScoreDims / 4);
        const int r = r0 + rr, h = h0 + hh;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (d < di && r < rows && h < a.inh)
          v = *reinterpret_cast<const float4*>(a.iq + static_cast<size_t>(r) * a.ldiq + static_cast<size_t>(h) * a.ihd + i0 + d);
        qs[hh][d][rr] = v.x; qs[hh][d + 1][rr] = v.y; qs[hh][d + 2][rr] = v.z; qs[hh][d + 3][rr] = v.w;
      }
      __syncthreads();
#pragma unroll 4
      for (int d = 0; d < di; ++d) {
        float kv[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) kv[c] = ks[tx + 16 * c][d];
#pragma unroll
        for (int hh = 0; hh < kScoreHeads; ++hh) {
          const float4 q4 = *reinterpret_cast<const float4*>(&qs[hh][d][4 * ty]);
          const float q[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
          for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c) dot[hh][j][c] = __fadd_rn(dot[hh][j][c], __fmul_rn(q[j], kv[c]));
        }
      }
    }
#pragma unroll
    for (int hh = 0; hh < kScoreHeads; ++hh)
      if (h0 + hh < a.inh)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const float v = dot[hh][j][c];
            s[j][c] = __fadd_rn(s[j][c], v < 0.0f ? 0.0f : v);  // std::max(dot, 0.0f), NaN kept
          }
  }
  const float root = sqrtf(static_cast<float>(a.ihd));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = r0 + 4 * ty + j;
    if (r >= rows) break;
    const int64_t nb = (pos + r + 1) / a.cr;
    if (nb <= a.block_topk) continue;  // this row selects every block: attn_select_kernel reads no score
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int64_t b = b0 + tx + 16 * c;
      if (b < nb) a.scores[r * a.nb_max + b] = s[j][c] / root;
    }
  }
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
// A query with n keys selects every one of them (0..n-1, in order) when its context has no more
// complete blocks than block_topk (attn_select_kernel selects them all).
__host__ __device__ inline bool attn_row_dense(const AttnArgs& a, int64_t n) { return n / a.cr <= a.block_topk; }

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
template <bool SPLIT_WORDS>
__device__ __forceinline__ void attn_store_weight(float* p, int j, float w);  // (below, with the tensor-core kernels)
template <bool SPLIT_WORDS = false>
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
  for (int jj = lane; jj < m; jj += 32) attn_store_weight<SPLIT_WORDS>(ph, jj, ph[jj] / sum);
  for (int jj = m + lane; jj < pad; jj += 32) ph[jj] = 0.0f;  // (0.0f's bits are the split word of 0)
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
constexpr int kAttnScoreChains = 4;  // attn_heads_tc_kernel: independent accumulators of a key tile's scores

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

// ---- K and V split once per prefill chunk (SPLIT instances of the two kernels below)
//
// Each lane turns every K and V element it reads into its two bf16 parts (split_bf16x2: F2FP, two
// unpacks, two subtractions, F2FP per pair), and a row's block reads its selected keys afresh: an 8k
// chunk splits each key's row ~1,500 times. Nsight Compute on the per-row kernel (H200 2026-12-03
// 14:15Z, 8k tokens) counted those conversions as 37% of its instructions, issued at 35% of the SM's
// rate. attn_split_kv_kernel splits the context's keys once per call into scratch:
//  - K as pairs of dimensions (2i, 2i+1), each a hi word and a lo word (split_bf16x2), stored so
//    that lane t's two pairs of a 16-dimension step (dimensions 2t, 2t+1 and 2t+8, 2t+9) are one
//    16-byte quad {hi, hi', lo, lo'} (attn_split_k_word). A lane's B fragments of a step are then one
//    16-byte load (two 8-byte loads before) with no conversion, and each of the step's two B operands
//    (the hi words, the lo words) is an aligned register pair of the load as the MMA takes it: with
//    the quad as {hi, lo, hi', lo'} every MMA took its operand through two register moves (SASS);
//  - V per element: {hi, lo} in one word (hi in the low half), so the B fragment of two keys at one
//    dimension is two byte permutes (attn_pair_of_words) instead of a split; inside each 32-dimension
//    group (a warp's four 8-dimension tiles) dimension 8 nn + g at 4 g + nn (attn_split_v_pos), so
//    lane g's values of one key for the four tiles are one 16-byte load (four 4-byte loads before).
//    Needs hd % 32 == 0.
// The parts are the ones split_bf16x2 makes from the same floats: the same products, the same bits
// (the test compares them). Same bytes as the fp32 cache.
// The pair of a lane's two K or V values as the MMA's (hi, lo) operand words.
__device__ __forceinline__ uint2 attn_b_pair(float2 v) { return split_bf16x2(v.x, v.y); }
__device__ __forceinline__ uint2 attn_b_pair(uint2 v) { return v; }  // pre-split K
__device__ __forceinline__ uint2 attn_pair_of_words(uint32_t w0, uint32_t w1) {  // pre-split V: {hi | lo << 16}
  return make_uint2(__byte_perm(w0, w1, 0x5410), __byte_perm(w0, w1, 0x7632));
}
__device__ __forceinline__ uint2 attn_b_pair(float v0, float v1) { return split_bf16x2(v0, v1); }
__device__ __forceinline__ uint2 attn_b_pair(uint32_t v0, uint32_t v1) { return attn_pair_of_words(v0, v1); }
// With SPLIT the softmax weights too are stored as split words {hi | lo << 16}, V's form (their softmax
// writes them once per head and key; each of the 8 warps' P V split them again before).
template <bool SPLIT_WORDS>
__device__ __forceinline__ void attn_store_weight(float* p, int j, float w) {
  if constexpr (SPLIT_WORDS) {
    const uint2 h = split_bf16x2(w, 0.0f);
    reinterpret_cast<uint32_t*>(p)[j] = __byte_perm(h.x, h.y, 0x5410);
  } else {
    p[j] = w;
  }
}
// The A operand of the two keys' weights at pw (stored by attn_store_weight<SPLIT>).
template <bool SPLIT>
__device__ __forceinline__ uint2 attn_weight_pair(const float* pw) {
  using W = std::conditional_t<SPLIT, uint2, float2>;
  const W w = *reinterpret_cast<const W*>(pw);
  return attn_b_pair(w.x, w.y);
}

// Keys [0, n) of the cache into k_split / v_split (AttnArgs); grid (ceil(n nkv hd / 2 / 256)), block
// 256: one pair of floats of K and of V a thread.
// Where the hi word of pair i of a key row (dimensions 2i, 2i+1 of its nkv*hd) goes in the split copy's
// row, in words; its lo word is 2 further. Inside each 8-pair step, pair q at 4 (q % 4) + q / 4.
__device__ __forceinline__ int64_t attn_split_k_word(int64_t i) { return 2 * (i & ~int64_t{7}) + 4 * (i & 3) + ((i >> 2) & 1); }
// Where value e of a key row goes in the split copy's row (rows are whole 32-value groups: hd % 32 == 0).
__device__ __forceinline__ int64_t attn_split_v_pos(int64_t e) { return (e & ~int64_t{31}) + 4 * (e & 7) + ((e >> 3) & 3); }
__global__ void attn_split_kv_kernel(const AttnArgs a, int64_t n) {
  pdl_begin();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * a.nkv * a.hd / 2) return;
  // (A row's pairs, nkv*hd/2 of them, are a multiple of 8: the positions stay inside the row.)
  const uint2 k = split_bf16x2(a.k_cache[2 * i], a.k_cache[2 * i + 1]);
  uint32_t* kw = reinterpret_cast<uint32_t*>(a.k_split) + attn_split_k_word(i);
  kw[0] = k.x;
  kw[2] = k.y;
  const uint2 v = split_bf16x2(a.v_cache[2 * i], a.v_cache[2 * i + 1]);
  a.v_split[attn_split_v_pos(2 * i)] = __byte_perm(v.x, v.y, 0x5410);
  a.v_split[attn_split_v_pos(2 * i + 1)] = __byte_perm(v.x, v.y, 0x7632);
}

// Where the tensor-core kernels read K and V: the fp32 cache, or its split copy.
template <bool SPLIT>
struct AttnKv {
  using K = std::conditional_t<SPLIT, uint2, float2>;    // a pair of dimensions of a key row
  using V = std::conditional_t<SPLIT, uint32_t, float>;  // one value
  static __device__ __forceinline__ const K* k(const AttnArgs& a) {
    if constexpr (SPLIT) return a.k_split;
    else return reinterpret_cast<const float2*>(a.k_cache);
  }
  static __device__ __forceinline__ const V* v(const AttnArgs& a) {
    if constexpr (SPLIT) return a.v_split;
    else return a.v_cache;
  }
  // Lane g's values of one key (row vr, its KV head's column 0) at column g of the 8-dimension tiles
  // nt0 .. nt0 + 3 (those below ntiles; nt0 % 4 == 0).
  static __device__ __forceinline__ void load_v_tiles(const V* vr, int nt0, int ntiles, int g, V (&out)[4]) {
    if constexpr (SPLIT) {  // the four adjacent (attn_split_v_pos)
      const uint4 w = *reinterpret_cast<const uint4*>(vr + 8 * nt0 + 4 * g);
      out[0] = w.x; out[1] = w.y; out[2] = w.z; out[3] = w.w;
    } else {
#pragma unroll
      for (int nn = 0; nn < 4; ++nn) out[nn] = nt0 + nn < ntiles ? vr[(nt0 + nn) * 8 + g] : 0.0f;
    }
  }
};

// Lane (g, t)'s K operands of one key row kr (in pairs of dimensions, already offset by attn_k_lane):
// dimensions 2t, 2t+1 and 2t+8, 2t+9 of every 16-dimension step, all loads issued together.
// Steps [s0, s1) only, where given (attn_heads_tc_kernel loads a tile in two halves).
__device__ __forceinline__ void attn_load_key_steps(const float2* kr, int steps, float2 (&kx)[kAttnTcMaxSteps][2],
                                                    int s0 = 0, int s1 = kAttnTcMaxSteps) {
#pragma unroll
  for (int s = 0; s < kAttnTcMaxSteps; ++s)
    if (s >= s0 && s < s1 && s < steps) {
      kx[s][0] = kr[8 * s];
      kx[s][1] = kr[8 * s + 4];
    }
}
__device__ __forceinline__ void attn_load_key_steps(const uint2* kr, int steps, uint2 (&kx)[kAttnTcMaxSteps][2],
                                                    int s0 = 0, int s1 = kAttnTcMaxSteps) {
#pragma unroll
  for (int s = 0; s < kAttnTcMaxSteps; ++s)
    if (s >= s0 && s < s1 && s < steps) {  // the two pairs as {hi, hi', lo, lo'} (attn_split_k_word)
      const uint4 w = *reinterpret_cast<const uint4*>(kr + 8 * s);
      kx[s][0] = make_uint2(w.x, w.z);
      kx[s][1] = make_uint2(w.y, w.w);
    }
}
// The lane's first pair in a key row: t in the cache's order, 2t in the split copy's.
template <bool SPLIT>
__device__ __forceinline__ int attn_k_lane(int t) { return SPLIT ? 2 * t : t; }

// Selectable keys rounded up to 16 (the 16-key steps of P V).
__host__ __device__ inline int attn_cap16(const AttnArgs& a) { return (attn_cap(a) + 15) & ~15; }
// Floats per head row of the per-row kernel's scores and weights: cap16, then up to 8 mod 32, so the 8
// heads (g) of a warp's 8-byte accesses at keys 2t fall in distinct banks (two wavefronts a warp). At a
// stride of cap16 (2,064 at the released geometry, 16 mod 32) they were 2-4-way conflicts, a third of
// the kernel's shared-memory wavefronts (Nsight Compute at 8k).
__host__ __device__ inline int attn_tc_ldp(const AttnArgs& a) { return ((attn_cap16(a) + 23) & ~31) + 8; }
// Dynamic shared memory: the selected ids, the weights of hpg heads, the query fragments.
__host__ __device__ inline size_t attn_tc_smem(const AttnArgs& a) {
  return sizeof(int) * attn_cap16(a) + sizeof(float) * (a.nh / a.nkv) * attn_tc_ldp(a) +
         sizeof(uint4) * 2 * 32 * (a.hd / 16);
}

// grid (nkv, rows), block 256, dynamic shared memory attn_tc_smem. Needs hd % 16 == 0, hd <= 256,
// nh / nkv <= 16.
// QREG: each lane keeps its Q fragments of every step in registers (128 of them at hd 256) for the
// scores, instead of reading them from shared memory for every 8-key tile. Why: the block's 99 KB of
// scores leave one block (8 warps) an SM, so up to 255 registers a thread are free, and Nsight Compute
// on this kernel at 8k tokens (H200 2026-12-03 14:15Z) had the L1 (shared with shared memory) at 77% of
// its throughput and L2 at 39%: a tile's 32 16-byte fragment reads a lane are 2 KB of shared-memory
// traffic per key, as much as the key's K and V rows. CK_ATTN_QREG=0: from shared memory.
// SPLIT: K and V from their split copy (attn_split_kv_kernel), the same bits.
// STEPS: hd / 16 as a compile-time constant (0: read from a.hd), so the steps' loads and MMAs carry no
// predicates: with a run-time count every step's loads and MMAs were predicated, each MMA behind its
// own WARPSYNC, and half the key loads issued only after the first MMAs had waited for theirs (SASS).
// The same operations: the same bits.
template <bool QREG, bool SPLIT, int STEPS = 0>
__global__ void __launch_bounds__(kAttnTcWarps * 32) attn_heads_tc_kernel(const AttnArgs a, const StepParams* sp) {
  using KV = AttnKv<SPLIT>;
  pdl_begin();
  extern __shared__ __align__(16) float smem[];
  const int kv = blockIdx.x, r = blockIdx.y, hpg = a.nh / a.nkv, h0 = kv * hpg;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t n = sp->pos + r + 1;
  if (a.skip_dense && attn_row_dense(a, n)) return;  // uniform: attn_dense_rows_tc_kernel's row
  const int cap16 = attn_cap16(a), ldp = attn_tc_ldp(a), steps = STEPS ? STEPS : a.hd / 16;
  int* idx = reinterpret_cast<int*>(smem);
  float* p = smem + cap16;                               // [head][ldp]
  uint4* qf = reinterpret_cast<uint4*>(p + hpg * ldp);  // [step][part][lane]: A fragment words a0..a3
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
  uint4 qa[QREG ? kAttnTcMaxSteps : 1][2];  // QREG: the lane's fragments (hi, lo) of every step
  if constexpr (QREG) {
#pragma unroll
    for (int s = 0; s < kAttnTcMaxSteps; ++s)
      if (s < steps) {
        qa[s][0] = qf[(2 * s) * 32 + lane];
        qa[s][1] = qf[(2 * s + 1) * 32 + lane];
      }
  }
  auto q_frag = [&](int s, int part) -> uint4 {
    if constexpr (QREG) return qa[s][part];
    else return qf[(2 * s + part) * 32 + lane];
  };

  // Scores: warp w takes key tiles w, w + 8, ... of 8 keys (the MMA's n); lane (g, t) loads key g's
  // dimensions 2t, 2t+1, 2t+8, 2t+9 of every step. The loads are pipelined by halves of the steps:
  // once a half's MMAs are issued, its registers take the same half of the warp's next tile, so each
  // tile's loads fly during the tile before (issued all at once, each tile's first MMA waited for its
  // own loads: a tenth of the kernel's stall samples, Nsight Compute at 8k).
  const float scale = 1.0f / sqrtf(static_cast<float>(a.hd));
  const typename KV::K* kg = KV::k(a) + static_cast<size_t>(kv) * a.hd / 2 + attn_k_lane<SPLIT>(t);  // in pairs
  constexpr int kHalf = kAttnTcMaxSteps / 2;
  typename KV::K kx[kAttnTcMaxSteps][2];
  if (warp * 8 < m) attn_load_key_steps(kg + static_cast<size_t>(idx[warp * 8 + g]) * (kvw / 2), steps, kx);
  for (int kt = warp; kt * 8 < m; kt += kAttnTcWarps) {
    const bool next = (kt + kAttnTcWarps) * 8 < m;
    const typename KV::K* kn = kg + static_cast<size_t>(idx[next ? (kt + kAttnTcWarps) * 8 + g : 0]) * (kvw / 2);
    // Four accumulators, step s on chain s % 4, added at the end in a fixed order. Why: on one
    // accumulator a tile's 48 MMAs (16 steps x 3) were one dependent chain, with one block (8 warps)
    // an SM to hide it; each MMA waits for the one before.
    float dc[kAttnScoreChains][4] = {};
#pragma unroll
    for (int s = 0; s < kHalf; ++s)
      if (s < steps)
        mma_split(dc[s % kAttnScoreChains], q_frag(s, 0), q_frag(s, 1), attn_b_pair(kx[s][0]), attn_b_pair(kx[s][1]));
    if (next) attn_load_key_steps(kn, steps, kx, 0, kHalf);
#pragma unroll
    for (int s = kHalf; s < kAttnTcMaxSteps; ++s)
      if (s < steps)
        mma_split(dc[s % kAttnScoreChains], q_frag(s, 0), q_frag(s, 1), attn_b_pair(kx[s][0]), attn_b_pair(kx[s][1]));
    if (next) attn_load_key_steps(kn, steps, kx, kHalf, kAttnTcMaxSteps);
    float d[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] = (dc[0][e] + dc[1][e]) + (dc[2][e] + dc[3][e]);
    // d0, d1: head g, keys 8 kt + 2t, + 1; d2, d3: head g + 8.
    const int j = kt * 8 + 2 * t;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int head = g + 8 * hh;
      if (head >= hpg) continue;
      // Both keys in one 8-byte store: j + 1 < m16 (the tile is inside it), and the softmax reads only
      // [0, m) and zeroes [m, m16).
      *reinterpret_cast<float2*>(p + head * ldp + j) = make_float2(d[2 * hh] * scale, d[2 * hh + 1] * scale);
    }
  }
  __syncthreads();
  // Softmax per head (attn_heads_kernel's), zero weights for the keys past m up to m16.
  for (int h = warp; h < hpg; h += kAttnTcWarps) attn_softmax_warp<SPLIT>(p + h * ldp, m, m16);
  __syncthreads();

  // O = P V: warp w takes 8-dimension tiles 4w .. 4w+3 (then + 32); per 16-key step, A = the weights
  // of heads (g, g+8) for keys 2t, 2t+1 (a0, a1) and 2t+8, 2t+9 (a2, a3); B = those keys' values at
  // dimension g of each tile, kAttnTcVSteps steps' loads issued together.
  const typename KV::V* vg = KV::v(a) + static_cast<size_t>(kv) * a.hd;
  const int ntiles = a.hd / 8;
  const float* gate0 = a.qg + static_cast<size_t>(r) * a.ldqg + static_cast<size_t>(h0) * 2 * a.hd + a.hd;
  // The values' loads are buffered: later blocks' loads are issued before this block's MMAs (the first
  // use of a block's values, loaded just before, was the kernel's largest stall line: 15% of its
  // samples, Nsight Compute at 8k). Q's registers are free in this phase.
  using VBlock = typename KV::V[kAttnTcVSteps][4][4];  // [step][tile][key 2t, 2t+1, 2t+8, 2t+9]
  for (int nt0 = 4 * warp; nt0 < ntiles; nt0 += 4 * kAttnTcWarps) {
    float o[4][4] = {};
    auto load_v = [&](int j0, VBlock& v) {
#pragma unroll
      for (int u = 0; u < kAttnTcVSteps; ++u) {
        const int jb = j0 + 16 * u;
        if (jb >= m16) break;
        const int key[4] = {idx[jb + 2 * t], idx[jb + 2 * t + 1], idx[jb + 2 * t + 8], idx[jb + 2 * t + 9]};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          typename KV::V vt[4];
          KV::load_v_tiles(vg + static_cast<size_t>(key[c]) * kvw, nt0, ntiles, g, vt);
#pragma unroll
          for (int nn = 0; nn < 4; ++nn) v[u][nn][c] = vt[nn];
        }
      }
    };
    auto mma_v = [&](int j0, const VBlock& v) {
#pragma unroll
      for (int u = 0; u < kAttnTcVSteps; ++u) {
        const int jb = j0 + 16 * u;
        if (jb >= m16) break;
        uint2 w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int head = g + 8 * (i & 1);
          w[i] = head < hpg ? attn_weight_pair<SPLIT>(p + head * ldp + jb + 2 * t + 8 * (i >> 1)) : make_uint2(0u, 0u);
        }
        const uint4 ah = make_uint4(w[0].x, w[1].x, w[2].x, w[3].x), al = make_uint4(w[0].y, w[1].y, w[2].y, w[3].y);
#pragma unroll
        for (int nn = 0; nn < 4; ++nn)
          mma_split(o[nn], ah, al, attn_b_pair(v[u][nn][0], v[u][nn][1]), attn_b_pair(v[u][nn][2], v[u][nn][3]));
      }
    };
    // Three buffers, two blocks ahead: with one block ahead, each block's first use still waited on
    // its loads (L2 latency over 12 MMAs of 2 warps a scheduler); Q's 128 registers hold the third.
    constexpr int kBlockKeys = 16 * kAttnTcVSteps;
    VBlock va, vb, vc;
    load_v(0, va);
    if (kBlockKeys < m16) load_v(kBlockKeys, vb);
    for (int j0 = 0; j0 < m16; j0 += 3 * kBlockKeys) {
      if (j0 + 2 * kBlockKeys < m16) load_v(j0 + 2 * kBlockKeys, vc);
      mma_v(j0, va);
      if (j0 + kBlockKeys >= m16) break;
      if (j0 + 3 * kBlockKeys < m16) load_v(j0 + 3 * kBlockKeys, va);
      mma_v(j0 + kBlockKeys, vb);
      if (j0 + 2 * kBlockKeys >= m16) break;
      if (j0 + 4 * kBlockKeys < m16) load_v(j0 + 4 * kBlockKeys, vb);
      mma_v(j0 + 2 * kBlockKeys, vc);
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

// ---- Prefill attention of the dense rows on the tensor cores (CK_ATTN_DENSE=0: attn_heads_tc_kernel)
//
// A row whose context has no more complete blocks than block_topk selects every key 0..n-1 (dense
// causal attention): all of a 2k prompt's rows, the first 2,051 of an 8k prompt at the released
// geometry. attn_heads_tc_kernel reads each of their K and V rows once per (row, KV head), with 12 of
// an MMA's 16 rows busy, and spent ~5.4 us of a 2k prefill token on that (thirty-fourth session's
// profile). Here a block takes R = 64 / hpg consecutive rows of one KV head (5 at 12 heads per group:
// 60 MMA rows; M-row i is row i / hpg, head i % hpg), walks their keys in 64-key tiles with an
// online softmax (flash attention) and reads each K and V row once for all R rows. Products are
// attn_heads_tc_kernel's: two bf16 parts per operand, three MMAs, fp32 accumulators. Keys past a
// row's n weigh exactly 0 and tiles past it rescale by exactly 1, so a row's bits do not depend on
// which rows share its block or its chunk. The final division by the weights' sum comes after P V
// (attn_heads_tc_kernel divides each weight first): fp32 rounding apart, within the parity tests'
// tolerances (DenseAttentionRowsMatchThePerRowKernel).
// grid (nkv, ceil(rows / R)), block 256, dynamic shared memory attn_dense_smem. The per-row kernel
// skips these rows (AttnArgs::skip_dense). MAXM, the MMA rows of a block (R * hpg <= MAXM): 64 (one
// block an SM, 217 registers), or 32 (CK_ATTN_DENSE=32: twice the blocks, two an SM, 2-3% slower;
// the test checks it gives 64's bits).
constexpr int kAttnDenseKeys = 64;   // keys of a tile: 8 warps x the MMA's 8
// Floats per row of the score/weight tile: 8 mod 32, so the 8-byte stores and loads of a warp (rows g,
// keys 2t) fall in distinct banks; at 68 (4 mod 32) they were 2-way conflicts, 17% of the kernel's
// shared-memory wavefronts (Nsight Compute at 2k).
constexpr int kAttnDenseLds = kAttnDenseKeys + 8;

__host__ __device__ inline int attn_dense_rows_per_block(const AttnArgs& a, int maxm) { return maxm / (a.nh / a.nkv); }
__host__ __device__ inline int attn_dense_mtiles(const AttnArgs& a, int maxm) {
  return (attn_dense_rows_per_block(a, maxm) * (a.nh / a.nkv) + 15) / 16;
}
// The query fragments of every m16 tile and step, then the score/weight tile.
__host__ __device__ inline size_t attn_dense_smem(const AttnArgs& a, int maxm) {
  return sizeof(uint4) * 2 * 32 * (a.hd / 16) * attn_dense_mtiles(a, maxm) + sizeof(float) * maxm * kAttnDenseLds;
}

// STEPS: hd / 16 fixed at compile time (0: from a.hd), as attn_heads_tc_kernel's, and then the block's
// m16 tiles too (all MAXM / 16 of them: the launch checks), so no MMA is predicated.
template <int MAXM, bool SPLIT, int STEPS = 0>
__global__ void __launch_bounds__(kAttnTcWarps * 32, 64 / MAXM) attn_dense_rows_tc_kernel(const AttnArgs a,
                                                                                          const StepParams* sp,
                                                                                          int rows) {
  using KV = AttnKv<SPLIT>;
  constexpr int MAXMT = MAXM / 16, ROWS_PER_WARP = MAXM / kAttnTcWarps;
  pdl_begin();
  extern __shared__ __align__(16) float smem[];
  __shared__ float alpha[MAXM], lsum[MAXM];
  const int kv = blockIdx.x, hpg = a.nh / a.nkv, h0 = kv * hpg, R = attn_dense_rows_per_block(a, MAXM);
  const int r0 = blockIdx.y * R, MT = STEPS ? MAXMT : attn_dense_mtiles(a, MAXM);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int64_t n0 = sp->pos + r0 + 1;  // row r0's keys; row r0 + rr has n0 + rr
  // Dense rows are a prefix of the chunk (n grows with the row): this block's are its first nr.
  int nr = 0;
  while (nr < R && r0 + nr < rows && attn_row_dense(a, n0 + nr)) ++nr;
  if (nr == 0) return;  // uniform
  const int64_t n_max = n0 + nr - 1;
  const int mrows = nr * hpg, steps = STEPS ? STEPS : a.hd / 16, ntiles = a.hd / 8;
  const size_t kvw = static_cast<size_t>(a.nkv) * a.hd;
  uint4* qf = reinterpret_cast<uint4*>(smem);  // [mt][step][part][lane]
  float* sp_tile = smem + 4 * 2 * 32 * steps * MT;  // [M-row][kAttnDenseLds]: scores, then weights

  // Q's A fragments of each m16 tile (attn_heads_tc_kernel's layout); M-rows past the block's rows are
  // zeros.
  for (int e = threadIdx.x; e < MT * steps * 32; e += blockDim.x) {
    const int mt = e / (steps * 32), s = (e >> 5) % steps, l = e & 31, lg = l >> 2, lt = l & 3;
    uint2 w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = 16 * mt + lg + 8 * (i & 1), d = 16 * s + 2 * lt + 8 * (i >> 1);
      float2 v = make_float2(0.0f, 0.0f);
      if (row < mrows) {
        const int rr = row / hpg, head = row % hpg;
        v = *reinterpret_cast<const float2*>(a.q + static_cast<size_t>(r0 + rr) * a.ldq +
                                             static_cast<size_t>(h0 + head) * a.hd + d);
      }
      w[i] = split_bf16x2(v.x, v.y);
    }
    qf[((mt * steps + s) * 2) * 32 + l] = make_uint4(w[0].x, w[1].x, w[2].x, w[3].x);
    qf[((mt * steps + s) * 2 + 1) * 32 + l] = make_uint4(w[0].y, w[1].y, w[2].y, w[3].y);
  }
  __syncthreads();

  const float scale = 1.0f / sqrtf(static_cast<float>(a.hd));
  const typename KV::K* kg = KV::k(a) + static_cast<size_t>(kv) * a.hd / 2 + attn_k_lane<SPLIT>(t);  // in pairs
  const typename KV::V* vg = KV::v(a) + static_cast<size_t>(kv) * a.hd;
  float o[MAXMT][4][4] = {};  // [m-tile][dimension tile 4 warp + nn][C fragment]
  float mrun[ROWS_PER_WARP], lrun[ROWS_PER_WARP];
#pragma unroll
  for (int k = 0; k < ROWS_PER_WARP; ++k) { mrun[k] = -INFINITY; lrun[k] = 0.0f; }

  for (int64_t j0 = 0; j0 < n_max; j0 += kAttnDenseKeys) {
    // Scores: warp w takes keys j0 + 16 (w % 4) + (0..15) (two n8 tiles) for the m16 tiles 2 (w / 4) and
    // 2 (w / 4) + 1 (those below MT); lane (g, t) loads keys g and 8 + g's dimensions 2t, 2t+1, 2t+8,
    // 2t+9 of every step (keys past n_max read key n_max - 1: a valid row, weighed 0 below). Why two
    // key tiles a warp for two m16 tiles, not one for all four: each of a step's Q fragments (from
    // shared memory) then feeds two key tiles, so a tile of scores reads half the Q fragments (their
    // loads were the kernel's largest stall, short scoreboard 28%, Nsight Compute at 2k). Each score
    // is the same MMAs in the same order: the same bits. Only the fixed-step 64-row form (the default):
    // the others (run-time steps, 32 rows) would spill its 128 registers of keys, and keep the mapping
    // below (one key tile a warp for every m16 tile).
    constexpr int kKeyGroups = kAttnDenseKeys / 16;  // 16-key groups of a tile
    static_assert(kAttnTcWarps == 2 * kKeyGroups, "two m16 tile pairs x the key groups");
    const int kq = warp % kKeyGroups, mp = warp / kKeyGroups;
    const int64_t last = n_max - 1;
    if constexpr (STEPS == 0 || MAXM != 64) {
      if (j0 + 8 * warp < n_max) {
        typename KV::K kx[kAttnTcMaxSteps][2];
        attn_load_key_steps(kg + static_cast<size_t>(min(j0 + 8 * warp + g, last)) * (kvw / 2), steps, kx);
        float d[MAXMT][4] = {};
#pragma unroll
        for (int s = 0; s < kAttnTcMaxSteps; ++s)
          if (s < steps) {
            const uint2 b0 = attn_b_pair(kx[s][0]), b1 = attn_b_pair(kx[s][1]);
#pragma unroll
            for (int mt = 0; mt < MAXMT; ++mt)
              if (mt < MT)
                mma_split(d[mt], qf[((mt * steps + s) * 2) * 32 + lane], qf[((mt * steps + s) * 2 + 1) * 32 + lane],
                          b0, b1);
          }
        // d[mt] 0, 1: M-row 16 mt + g, keys 8 warp + 2t, + 1; 2, 3: M-row 16 mt + g + 8.
#pragma unroll
        for (int mt = 0; mt < MAXMT; ++mt)
          if (mt < MT)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              float* srow = sp_tile + (16 * mt + g + 8 * hh) * kAttnDenseLds + 8 * warp + 2 * t;
              *reinterpret_cast<float2*>(srow) = make_float2(d[mt][2 * hh] * scale, d[mt][2 * hh + 1] * scale);
            }
      }
    } else if (j0 + 16 * kq < n_max && 2 * mp < MT) {
      typename KV::K kx[2][kAttnTcMaxSteps][2];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
        attn_load_key_steps(kg + static_cast<size_t>(min(j0 + 16 * kq + 8 * nt + g, last)) * (kvw / 2), steps, kx[nt]);
      float d[2][2][4] = {};  // [m16 tile 2 mp + m][key tile nt][C fragment]
#pragma unroll
      for (int s = 0; s < kAttnTcMaxSteps; ++s)
        if (s < steps) {
#pragma unroll
          for (int m = 0; m < 2; ++m) {
            const int mt = 2 * mp + m;
            if (mt < MT) {
              const uint4 qh = qf[((mt * steps + s) * 2) * 32 + lane], ql = qf[((mt * steps + s) * 2 + 1) * 32 + lane];
#pragma unroll
              for (int nt = 0; nt < 2; ++nt)
                mma_split(d[m][nt], qh, ql, attn_b_pair(kx[nt][s][0]), attn_b_pair(kx[nt][s][1]));
            }
          }
        }
      // d[m][nt] 0, 1: M-row 16 mt + g, keys 16 kq + 8 nt + 2t, + 1; 2, 3: M-row 16 mt + g + 8.
#pragma unroll
      for (int m = 0; m < 2; ++m)
        if (2 * mp + m < MT)
#pragma unroll
          for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              float* srow = sp_tile + (16 * (2 * mp + m) + g + 8 * hh) * kAttnDenseLds + 16 * kq + 8 * nt + 2 * t;
              *reinterpret_cast<float2*>(srow) = make_float2(d[m][nt][2 * hh] * scale, d[m][nt][2 * hh + 1] * scale);
            }
    }
    // The tile's values for this warp's P V, loaded before the softmax so that their latency passes
    // under it (loaded at their step, each step's first MMA waited for its own loads). Keys past n_max
    // read key n_max - 1 (weighed 0). kx's registers are free from here.
    typename KV::V vt[kAttnDenseKeys / 16][4][4];  // [step][tile][key 2t, 2t+1, 2t+8, 2t+9]
    if (4 * warp < ntiles) {
#pragma unroll
      for (int u = 0; u < kAttnDenseKeys / 16; ++u) {
        const int64_t jb = j0 + 16 * u;
        const int64_t key[4] = {min(jb + 2 * t, last), min(jb + 2 * t + 1, last), min(jb + 2 * t + 8, last),
                                min(jb + 2 * t + 9, last)};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          typename KV::V v4[4];
          KV::load_v_tiles(vg + static_cast<size_t>(key[c]) * kvw, 4 * warp, ntiles, g, v4);
#pragma unroll
          for (int nn = 0; nn < 4; ++nn) vt[u][nn][c] = v4[nn];
        }
      }
    }
    __syncthreads();
    // Online softmax: warp w owns M-rows w, w + 8, ...; lane takes keys lane and lane + 32 of the tile.
#pragma unroll
    for (int k = 0; k < ROWS_PER_WARP; ++k) {
      const int row = warp + kAttnTcWarps * k;
      if (row >= 16 * MT) break;  // uniform
      const int64_t keys = row < mrows ? n0 + row / hpg - j0 : 0;  // keys of this row in the tile
      float* srow = sp_tile + row * kAttnDenseLds;
      const bool v0 = lane < keys, v1 = lane + 32 < keys;
      const float s0 = srow[lane], s1 = srow[lane + 32];
      const float mx = warp_max(fmaxf(v0 ? s0 : -INFINITY, v1 ? s1 : -INFINITY));
      const float mnew = fmaxf(mrun[k], mx);
      const float f = mnew == -INFINITY ? 1.0f : expf(mrun[k] - mnew);
      const float p0 = v0 ? expf(s0 - mnew) : 0.0f, p1 = v1 ? expf(s1 - mnew) : 0.0f;
      lrun[k] = lrun[k] * f + warp_sum(p0 + p1);
      mrun[k] = mnew;
      attn_store_weight<SPLIT>(srow, lane, p0);
      attn_store_weight<SPLIT>(srow, lane + 32, p1);
      if (lane == 0) alpha[row] = f;
    }
    __syncthreads();
    // O = alpha O + P V: warp w takes 8-dimension tiles 4w .. 4w+3; per 16-key step, A = the weights of
    // M-rows (g, g+8) for keys 2t, 2t+1 (a0, a1) and 2t+8, 2t+9 (a2, a3) of each m16 tile, B = those
    // keys' values at dimension g of each tile.
    if (4 * warp < ntiles) {
#pragma unroll
      for (int mt = 0; mt < MAXMT; ++mt)
        if (mt < MT) {
          const float f0 = alpha[16 * mt + g], f1 = alpha[16 * mt + g + 8];
#pragma unroll
          for (int nn = 0; nn < 4; ++nn) {
            o[mt][nn][0] *= f0; o[mt][nn][1] *= f0;
            o[mt][nn][2] *= f1; o[mt][nn][3] *= f1;
          }
        }
#pragma unroll
      for (int u = 0; u < kAttnDenseKeys / 16; ++u) {
        const int jb = 16 * u;
        if (j0 + jb >= n_max) break;  // uniform: weights of 0 from here
        uint2 vb[4][2];
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
          vb[nn][0] = attn_b_pair(vt[u][nn][0], vt[u][nn][1]);
          vb[nn][1] = attn_b_pair(vt[u][nn][2], vt[u][nn][3]);
        }
#pragma unroll
        for (int mt = 0; mt < MAXMT; ++mt)
          if (mt < MT) {
            uint2 w[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              w[i] = attn_weight_pair<SPLIT>(sp_tile + (16 * mt + g + 8 * (i & 1)) * kAttnDenseLds + jb + 2 * t +
                                             8 * (i >> 1));
            }
            const uint4 ah = make_uint4(w[0].x, w[1].x, w[2].x, w[3].x);
            const uint4 al = make_uint4(w[0].y, w[1].y, w[2].y, w[3].y);
#pragma unroll
            for (int nn = 0; nn < 4; ++nn) mma_split(o[mt][nn], ah, al, vb[nn][0], vb[nn][1]);
          }
      }
    }
    __syncthreads();  // the tile's weights are read before the next scores overwrite them
  }

  // out = O / l * sigmoid(gate): the row sums through shared memory to the warps holding O.
#pragma unroll
  for (int k = 0; k < ROWS_PER_WARP; ++k) {
    const int row = warp + kAttnTcWarps * k;
    if (row < MAXM && lane == 0) lsum[row] = lrun[k];
  }
  __syncthreads();
  if (4 * warp >= ntiles) return;
#pragma unroll
  for (int mt = 0; mt < MAXMT; ++mt)
    if (mt < MT)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = 16 * mt + g + 8 * hh;
        if (row >= mrows) continue;
        const int rr = row / hpg, head = row % hpg;
        const float l = lsum[row];
        const float* gate = a.qg + static_cast<size_t>(r0 + rr) * a.ldqg + static_cast<size_t>(h0 + head) * 2 * a.hd + a.hd;
        float* out = a.out + static_cast<size_t>(r0 + rr) * a.ldo + static_cast<size_t>(h0 + head) * a.hd;
#pragma unroll
        for (int nn = 0; nn < 4; ++nn) {
          if (4 * warp + nn >= ntiles) break;
          const int dim = 8 * (4 * warp + nn) + 2 * t;
          out[dim] = (o[mt][nn][2 * hh] / l) * sigmoidf_(gate[dim]);
          out[dim + 1] = (o[mt][nn][2 * hh + 1] / l) * sigmoidf_(gate[dim + 1]);
        }
      }
}

}  // namespace

void init_attention_kernels() {
  for (auto k : {attn_heads_tc_kernel<true, false>, attn_heads_tc_kernel<false, false>, attn_heads_tc_kernel<true, true>,
                 attn_heads_tc_kernel<false, true>, attn_heads_tc_kernel<true, true, 2>, attn_heads_tc_kernel<true, true, 4>,
                 attn_heads_tc_kernel<true, true, 8>, attn_heads_tc_kernel<true, true, 16>})
    CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  for (auto k : {attn_dense_rows_tc_kernel<64, false>, attn_dense_rows_tc_kernel<32, false>,
                 attn_dense_rows_tc_kernel<64, true>, attn_dense_rows_tc_kernel<32, true>,
                 attn_dense_rows_tc_kernel<64, true, 2>, attn_dense_rows_tc_kernel<64, true, 4>,
                 attn_dense_rows_tc_kernel<64, true, 8>, attn_dense_rows_tc_kernel<64, true, 16>})
    CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_decode_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_decode_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_decode_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_heads_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
  CUDA_CHECK(cudaFuncSetAttribute(attn_heads_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kAttnMaxSmem));
}

int64_t attention_max_selected(int64_t block_topk, int64_t cr) { return (block_topk + 1) * cr - 1; }

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

namespace {
int g_attn_dense = -1;  // -1: CK_ATTN_DENSE decides: 0, 32 or 64 (the default) MMA rows a block
int attn_dense_choice(int mma_rows) { return mma_rows == 0 ? 0 : mma_rows == 32 ? 32 : 64; }
int attn_dense_rows() {
  if (g_attn_dense < 0) {
    const char* e = std::getenv("CK_ATTN_DENSE");
    g_attn_dense = e ? attn_dense_choice(std::atoi(e)) : 64;
  }
  return g_attn_dense;
}
}  // namespace

void set_attn_dense(int mma_rows) { g_attn_dense = mma_rows < 0 ? -1 : attn_dense_choice(mma_rows); }

namespace {
// A kernel choice that is on unless its environment variable is "0", which a test may set (set(1 or
// 0)) or hand back to the environment (set(-1)).
struct AttnSwitch {
  const char* env;
  int v = -1;
  bool on() {
    if (v < 0) v = env_is(env, "0") ? 0 : 1;
    return v == 1;
  }
  void set(int on) { v = on < 0 ? -1 : (on ? 1 : 0); }
};
AttnSwitch g_attn_qreg{"CK_ATTN_QREG"};          // attn_heads_tc_kernel's Q fragments in registers
AttnSwitch g_attn_fixed_steps{"CK_ATTN_FIXED_STEPS"};  // ... and its step count a template argument
bool attn_fixed_steps() { return g_attn_fixed_steps.on(); }
AttnSwitch g_attn_presplit{"CK_ATTN_PRESPLIT"};  // K and V split once per prefill call
// The split copy's scratch at most (K and V together): 8k keys of the released geometry take 33.5 MB.
constexpr int64_t kAttnSplitMaxBytes = int64_t{512} << 20;
AttnSwitch g_attn_scores_tiled{"CK_ATTN_SCORES_TILED"};  // prefill chunks' block scores as a tiled product
}  // namespace

void set_attn_qreg(int on) { g_attn_qreg.set(on); }
void set_attn_presplit(int on) { g_attn_presplit.set(on); }

void set_attn_scores_tiled(int on) { g_attn_scores_tiled.set(on); }

void attention_block_scores(const AttnArgs& a, const StepParams* sp, int rows, cudaStream_t stream) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (rows > kMaxRows && g_attn_scores_tiled.on() && a.ihd % 4 == 0 && a.ldiq % 4 == 0 && aligned(a.iq) &&
      aligned(a.blk_keys)) {
    const dim3 grid(static_cast<unsigned>(ceil_div(a.nb_max, kScoreTile)), static_cast<unsigned>(ceil_div(rows, kScoreTile)));
    launch(attn_scores_tiled_kernel, grid, 256, 0, stream, a, sp, rows);
  } else {
    launch(attn_scores_kernel, dim3(static_cast<unsigned>(ceil_div(a.nb_max, 8)), rows), 256, 0, stream, a, sp);
  }
  CUDA_CHECK_LAUNCH();
}

void attention(const AttnArgs& args, const StepParams* sp, int rows, cudaStream_t stream) {
  static const bool prefetch_kv = !env_is("CK_ATTN_KV_PREFETCH", "0");
  AttnArgs a = args;
  a.prefetch_kv = prefetch_kv ? 1 : 0;
  CK_REQUIRE(a.cr >= 1 && a.block_topk >= 1 && a.nh % a.nkv == 0 && a.rot <= a.hd && a.rot <= a.ihd &&
                 std::max(a.hd, a.ihd) <= kMaxAttnHeadDim,
             "invariant");
  const int cap = static_cast<int>(attention_max_selected(a.block_topk, a.cr));
  const size_t dec_smem = static_cast<size_t>(cap) * 8;
  CK_REQUIRE(dec_smem <= kAttnMaxSmem, "attention: %d selectable keys do not fit in shared memory", cap);
  const int nprep = a.nh + a.nkv + a.inh + 1;
  launch(attn_prep_kernel, dim3(nprep, rows), 128, sizeof(float) * std::max(a.hd, a.ihd), stream, a, sp);
  CUDA_CHECK_LAUNCH();
  launch(attn_pool_kernel, rows, 128, sizeof(float) * a.ihd, stream, a, sp);
  CUDA_CHECK_LAUNCH();
  attention_block_scores(a, sp, rows, stream);
  launch(attn_select_kernel, rows, 256, 0, stream, a, sp);
  CUDA_CHECK_LAUNCH();
  const int hpg = a.nh / a.nkv;
  // Prefill chunks on the tensor cores: a block per (row, KV head) with all its query heads.
  static const bool tc_on = !env_is("CK_ATTN_TC", "0");
  if (tc_on && rows > kMaxRows && a.hd % 16 == 0 && a.hd <= 16 * kAttnTcMaxSteps && hpg <= 16 &&
      attn_tc_smem(a) <= kAttnMaxSmem) {
    // The keys' K and V rows split into their bf16 parts once (attn_split_kv_kernel), when the host
    // knows how many keys the rows attend to.
    const int64_t split_bytes = a.keys_bound * static_cast<int64_t>(a.nkv) * a.hd * 4;  // each of K and V
    const bool split = g_attn_presplit.on() && a.keys_bound > 0 && a.hd % 32 == 0 && 2 * split_bytes <= kAttnSplitMaxBytes;
    if (split) {
      a.k_split = static_cast<uint2*>(scratch_alloc(static_cast<size_t>(split_bytes), stream));
      a.v_split = static_cast<uint32_t*>(scratch_alloc(static_cast<size_t>(split_bytes), stream));
      const int64_t pairs = a.keys_bound * a.nkv * a.hd / 2;
      launch(attn_split_kv_kernel, static_cast<unsigned>(ceil_div(pairs, 256)), 256, 0, stream, a, a.keys_bound);
      CUDA_CHECK_LAUNCH();
    }
    // The rows that select every key first, in blocks of several rows (a block past them returns at
    // once: the launch does not know the position, which the step reads on the device).
    // hpg <= 16 here, so a block holds at least 2 rows.
    const int maxm = attn_dense_rows();
    if (maxm > 0 && attn_dense_smem(a, maxm) <= kAttnMaxSmem) {
      a.skip_dense = 1;
      const dim3 grid(static_cast<unsigned>(a.nkv),
                      static_cast<unsigned>(ceil_div(rows, attn_dense_rows_per_block(a, maxm))));
      auto dense = maxm == 32 ? (split ? attn_dense_rows_tc_kernel<32, true> : attn_dense_rows_tc_kernel<32, false>)
                              : (split ? attn_dense_rows_tc_kernel<64, true> : attn_dense_rows_tc_kernel<64, false>);
      if (maxm == 64 && split && attn_fixed_steps() && attn_dense_mtiles(a, 64) == 4) {  // the default form, fixed
        switch (a.hd) {
          case 32: dense = attn_dense_rows_tc_kernel<64, true, 2>; break;
          case 64: dense = attn_dense_rows_tc_kernel<64, true, 4>; break;
          case 128: dense = attn_dense_rows_tc_kernel<64, true, 8>; break;
          case 256: dense = attn_dense_rows_tc_kernel<64, true, 16>; break;
          default: break;
        }
      }
      launch(dense, grid, kAttnTcWarps * 32, attn_dense_smem(a, maxm), stream, a, sp, rows);
      CUDA_CHECK_LAUNCH();
    }
    auto per_row = g_attn_qreg.on() ? (split ? attn_heads_tc_kernel<true, true> : attn_heads_tc_kernel<true, false>)
                                    : (split ? attn_heads_tc_kernel<false, true> : attn_heads_tc_kernel<false, false>);
    if (g_attn_qreg.on() && split && attn_fixed_steps()) {  // the default form, its step count fixed
      switch (a.hd) {
        case 32: per_row = attn_heads_tc_kernel<true, true, 2>; break;
        case 64: per_row = attn_heads_tc_kernel<true, true, 4>; break;
        case 128: per_row = attn_heads_tc_kernel<true, true, 8>; break;
        case 256: per_row = attn_heads_tc_kernel<true, true, 16>; break;
        default: break;
      }
    }
    launch(per_row, dim3(static_cast<unsigned>(a.nkv), static_cast<unsigned>(rows)), kAttnTcWarps * 32, attn_tc_smem(a),
           stream, a, sp);
    CUDA_CHECK_LAUNCH();
    if (split) {
      scratch_free(a.v_split, stream);
      scratch_free(a.k_split, stream);
    }
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

}  // namespace ck::cuda
