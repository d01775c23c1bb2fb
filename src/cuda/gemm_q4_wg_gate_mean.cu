// The prefill mix's up projection with its gate mean, as a persistent kernel (gemm_q4_wg.h:
// launch_q4_wg_gate_mean_persistent). The arithmetic of q4_wg_bulk_kernel's gate-mean form in fp16
// (gemm_q4_wg.cu, "The fp16 form"; wg_gate_mean_store), so the same bits of u.
//
// Off by default (CK_HC_GM_PERSISTENT=1 to compare): measured slower than the one-tile blocks it would
// replace, 714 against 579 us a call at 8k rows on an H100 (Nsight Compute durations, 2026-12-06,
// docs/roofline-cuda.md "Fiftieth session"): three warpgroups of 64-token tiles do not keep the tensor
// cores fed while the gate mean runs.
//
// Why: that form runs one 128-token tile a block, and its K is small (hc_lowrank = 320, five groups), so
// each block fills its pipeline, multiplies for a fifth of its life and then runs its gate mean while the
// tensor cores wait: 27 waves of one-tile blocks at 8k tokens, no unit a third busy (Nsight Compute,
// docs/roofline-cuda.md, forty-eighth session). Here a block stays:
//  - a cluster of S blocks (block s: stream s) takes a run of items, each a feature block's 192 features
//    for one tile of 64 tokens, consecutive tiles of one feature block where it can;
//  - each warp keeps its 16 rows' A fragments for all of K in registers (five groups: 80 registers), so
//    the weights are read once a run, not once a tile, and only the activations stream through the
//    stages (stage G: the item's group G, all copied as soon as the item before has finished with them);
//  - the gate mean of item k - 1 (CUDA cores: sigmoids, X's loads, the cluster's sums) runs while item
//    k's wgmmas do, its sums waiting in one of two products buffers;
//  - X (or R, with XNorm) of an item is asked of L2 an item ahead.
// 64 tokens a tile (one m64n64 wgmma tile a warpgroup) because 128 do not fit: 80 registers of A and 64
// of accumulators are more than three warpgroups have (65,536 a SM), and two products buffers of 128
// tokens (2 x 100 KB) more than the shared memory.
#include <cooperative_groups.h>

#include <algorithm>
#include <cstddef>

#include "cuda/bulk_copy.cuh"
#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gate_mean_cluster.cuh"
#include "cuda/gemm_q4_wg.h"
#include "cuda/wgmma.cuh"

namespace ck::cuda {
namespace {

constexpr int kGmTokens = 64;  // a tile: one m64n64 wgmma tile a warpgroup
constexpr int kGmWgs = 3, kGmThreads = 128 * kGmWgs, kGmFeatures = 64 * kGmWgs;
constexpr int kGmStages = kQ4WgGateMeanMaxGroups;  // stage G: group G of the item in the wgmmas
constexpr int kGmBBytes = q4_wg_b_bytes(kGmTokens);          // one (step, part) of B: 2 KB
constexpr int kGmAct = q4_wg_act_block_bytes(2, kGmTokens);  // a stage: one (tile, group) block, Σ x included
constexpr int kGmLd = kGmFeatures + 4;                       // a products row (floats): banks 8 t + g, no conflicts
constexpr int kGmPBytes = kGmTokens * kGmLd * 4;
constexpr int kGmWinBytes = 2 * kGmBBytes;  // a warpgroup's bias window: Σ x of its groups, two bf16 parts
constexpr int kGmSmem = kGmStages * kGmAct + kGmWgs * kGmWinBytes + 2 * kGmPBytes;
static_assert(kGmAct % 128 == 0 && kGmWinBytes % 128 == 0, "alignment of the stages and windows");
static_assert(kGmSmem <= 227 * 1024, "shared memory");
static_assert(kQ4WgGateMeanMaxGroups <= 16, "one bias window");
constexpr int kGmQuads = kGmFeatures / 4, kGmPer = kGmTokens * kGmQuads / kGmThreads;  // 8 quads a thread
static_assert(kGmTokens * kGmQuads % kGmThreads == 0, "whole quads a thread");

// Grid: (S x clusters), clusters of S along x; cluster c takes items [c n / C, (c + 1) n / C) of the n =
// n_fb x n_tiles items, item = feature block x n_tiles + tile (so a run keeps its feature block).
__global__ void __launch_bounds__(kGmThreads, 1)
    q4_wg_gate_mean_persistent_kernel(const __grid_constant__ Q4WgArgs a, int n_tiles, int n_fb) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wg = warp >> 2, wq = warp & 3;
  const int S = a.hc_s, H = a.hc_h, s = static_cast<int>(cluster.block_rank()), groups = a.groups;
  const int n_clusters = static_cast<int>(gridDim.x) / S, c = static_cast<int>(blockIdx.x) / S;
  const int64_t items = static_cast<int64_t>(n_tiles) * n_fb;
  const int it0 = static_cast<int>(items * c / n_clusters), it1 = static_cast<int>(items * (c + 1) / n_clusters);
  extern __shared__ __align__(128) uint8_t gm_smem[];
  uint8_t* const stages = gm_smem;
  uint8_t* const win = gm_smem + kGmStages * kGmAct + wg * kGmWinBytes;
  float* const P0 = reinterpret_cast<float*>(gm_smem + kGmStages * kGmAct + kGmWgs * kGmWinBytes);
  __shared__ uint64_t full[kGmStages], empty[kGmStages];
  __shared__ float tok_inv[kGmTokens], xn_r[kGmTokens];
  __shared__ float4 xn_w[kGmQuads];
  const bool xnorm = a.hc_rinv != nullptr;
  const int r_tok = tid & 127;  // this thread's token column in its warpgroup's window (< 64: it writes)
  if (tid == 0) {
    for (int i = 0; i < kGmStages; ++i) {
      mbar_init(&full[i]);
      mbar_init(&empty[i], kGmWgs * 4);
    }
    mbar_init_fence();
  }
  // The window's columns past the last group stay zero (their bias operands are zero too).
  for (int i = r_tok; i < kGmWinBytes / 16; i += 128) reinterpret_cast<uint4*>(win)[i] = make_uint4(0u, 0u, 0u, 0u);
  fence_proxy_async();
  __syncthreads();

  // Warp 0's lane 0 copies item k's activations (its tile's groups, group G into stage G) once every
  // warp is done with item k - 1's.
  auto produce = [&](int k) {
    if (lane == 0) {
      const int tile = (it0 + k) % n_tiles;
      for (int G = 0; G < groups; ++G) {
        if (k > 0) mbar_wait(&empty[G], (k - 1) & 1);
        mbar_arrive_expect(&full[G], kGmAct);
        bulk_copy_1d(stages + G * kGmAct,
                     reinterpret_cast<const uint8_t*>(a.xf) + (static_cast<size_t>(tile) * groups + G) * kGmAct, kGmAct,
                     &full[G]);
      }
    }
    __syncwarp();
  };
  if (warp == 0 && it0 < it1) produce(0);
  // Item it's X (64 rows x its 192 features of stream s) into L2: read by its gate mean only, an item later.
  auto prefetch_x = [&](int it) {
    const int f0 = kGmFeatures * (it / n_tiles), nf = min(kGmFeatures, H - f0), row0 = (it % n_tiles) * kGmTokens;
    constexpr int kLines = kGmFeatures / 32;
    for (int e = tid; e < kGmTokens * kLines; e += kGmThreads) {
      const int r = e / kLines, l = e - r * kLines;
      if (row0 + r < a.rows && 32 * l < nf)
        prefetch_l2(a.hc_x + static_cast<size_t>(row0 + r) * a.ld_x + s * H + f0 + 32 * l);
    }
  };

  // The gate mean of an item whose sums are in P (wg_gate_mean_store's steps and arithmetic): products
  // sigmoid(g_s) X_s in place (gate_mean), then (cluster barrier) block s adds the S blocks' products of
  // tokens [s 64 / S, + 64 / S) in stream order and writes u (gate_mean_sum). Both run while the next
  // item's wgmmas do.
  auto gate_mean = [&](int row0, int f0, int nf, float* P) {
    const int nq = nf / 4;
    const float* xs = a.hc_x + s * H + f0;
    // X's loads in two halves of kGmPer / 2 quads a thread (all eight at once spill the A fragments).
    constexpr int kHalf = kGmPer / 2;
    float4 xv[kHalf];
    auto load_x = [&](int k0) {
#pragma unroll
      for (int k = 0; k < kHalf; ++k) {
        const int e = tid + kGmThreads * (k0 + k), r = e / kGmQuads, q = e - r * kGmQuads;
        xv[k] = row0 + r < a.rows && q < nq
                    ? *reinterpret_cast<const float4*>(xs + static_cast<size_t>(row0 + r) * a.ld_x + 4 * q)
                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
    };
    auto products = [&](int k0) {
#pragma unroll
      for (int k = 0; k < kHalf; ++k) {
        const int e = tid + kGmThreads * (k0 + k), r = e / kGmQuads, q = e - r * kGmQuads;
        if (xnorm) {  // X = (R r) w, rmsnorm_wide_tail's formula
          const float rv = xn_r[r];
          const float4 w = xn_w[q];
          xv[k] = make_float4((xv[k].x * rv) * w.x, (xv[k].y * rv) * w.y, (xv[k].z * rv) * w.z, (xv[k].w * rv) * w.w);
        }
        float4* p = reinterpret_cast<float4*>(&P[r * kGmLd + 4 * q]);
        const float f = tok_inv[r];
        float4 v = *p;
        v = make_float4(v.x * f, v.y * f, v.z * f, v.w * f);
        const float4 sg = sigmoid4_(v);  // sigmoidf_'s bits
        *p = make_float4(__fmul_rn(sg.x, xv[k].x), __fmul_rn(sg.y, xv[k].y), __fmul_rn(sg.z, xv[k].z), __fmul_rn(sg.w, xv[k].w));
      }
    };
    load_x(0);
    __syncthreads();  // P, tok_inv, xn_r and xn_w are whole
    products(0);
    load_x(kHalf);
    products(kHalf);
  };
  auto gate_mean_sum = [&](int row0, int f0, int nf, const float* P) {
    gate_mean_cluster_sum<kGmTokens, kGmLd, kGmQuads, kGmThreads>(a, P, s, f0, nf / 4, [&](int r) {
      return row0 + r < a.rows ? row0 + r : -1;
    });
  };

  uint32_t ah[kQ4WgGateMeanMaxGroups][4][4] = {};  // this warp's 16 rows, all of K (fp16 A fragments)
  uint32_t bias_q[4] = {}, bias8_q[4] = {};          // its bias window operands: b, and 8 s
  float acc[32];
  int cur_fb = -1;
  int p_row0 = -1, p_f0 = 0, p_nf = 0;  // the item before, whose gate mean is pending (p_row0 >= 0)
  float* p_P = P0;
  for (int it = it0; it < it1; ++it) {
    const int k = it - it0, fb = it / n_tiles, tile = it % n_tiles, f0 = kGmFeatures * fb;
    const int nf = min(kGmFeatures, H - f0), row0 = tile * kGmTokens;
    if (fb != cur_fb) {  // a new feature block: its A fragments and biases (no wgmma is in flight here)
      cur_fb = fb;
      const DMatrix& m = a.job[0].w;
      const int unit = kGmWgs * fb + wg, n_mtiles = static_cast<int>((m.rows + kTileRows - 1) / kTileRows);
      // An idle warpgroup (past the stream's H / 64 units) multiplies the matrix's last tile (never
      // stored): a wgmma on a path the compiler cannot prove uniform serializes every wgmma (C7520).
      const int mt = unit < H / 64 ? (s * H + 64 * unit) / kTileRows + wq : n_mtiles - 1;
#pragma unroll
      for (int G = 0; G < kQ4WgGateMeanMaxGroups; ++G)
        if (G < groups) {
          const uint8_t* tg = m.tile_group(mt, G);
          wg_fold_frags_f16(*reinterpret_cast<const uint4*>(tg + 16 * lane), *reinterpret_cast<const uint2*>(tg + 512 + 8 * g),
                            ah[G]);
        }
      // Lane (g, t): window columns 2t, 2t + 1 of rows g (word 0) and g + 8 (1), 2t + 8, 2t + 9 (2, 3);
      // column G is group G's bf16 bias (the scale word's high half), or 8 s (exact in bf16).
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t b2 = 0u, e2 = 0u;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = 2 * t + 8 * (kk >> 1) + h;
          if (col >= groups) continue;
          const uint32_t w = reinterpret_cast<const uint32_t*>(m.tile_group(mt, col) + 512 + 8 * g)[kk & 1];
          const __nv_bfloat16 e = __float2bfloat16_rn(8.0f * __uint_as_float(w << 16));
          b2 |= (w >> 16) << (16 * h);
          e2 |= static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&e)) << (16 * h);
        }
        bias_q[kk] = b2;
        bias8_q[kk] = e2;
      }
    }
    prefetch_x(it);

    // The item's groups: the folded form's two fp16 wgmmas per k16 step (small part first), its Σ x into
    // the window's column G; the first wgmma of the item overwrites acc (the one-tile form adds it to
    // zeros: the same values, up to the sign of a zero, which the gate mean's sigmoid does not see).
#pragma unroll
    for (int G = 0; G < kQ4WgGateMeanMaxGroups; ++G) {
      if (G >= groups) continue;
      mbar_wait(&full[G], k & 1);
      const uint8_t* stage = stages + G * kGmAct;
      if (r_tok < kGmTokens) {
        const float sx = reinterpret_cast<const float*>(stage + 8 * kGmBBytes)[r_tok];
        const __nv_bfloat16 sx_hi = __float2bfloat16_rn(sx);
        const __nv_bfloat16 sx_lo = __float2bfloat16_rn(sx - __bfloat162float(sx_hi));
        const uint32_t col = 256 * (r_tok >> 3) + 16 * (r_tok & 7) + 128 * (G >> 3) + 2 * (G & 7);
        *reinterpret_cast<__nv_bfloat16*>(win + col) = sx_hi;
        *reinterpret_cast<__nv_bfloat16*>(win + kGmBBytes + col) = sx_lo;
      }
      const uint32_t xb = smem_u32(stage);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wg_mma_f16(acc, ah[G][kk], wg_desc(xb + (2 * kk + 1) * kGmBBytes, kWgLbo, kWgSbo), G > 0 || kk > 0);
        wg_mma_f16(acc, ah[G][kk], wg_desc(xb + 2 * kk * kGmBBytes, kWgLbo, kWgSbo), 1);
      }
      wg_commit();
    }
    // The window's bias products.
    fence_proxy_async();  // the window's Σ x, stored by the warpgroup's first 64 threads, for the wgmmas
    wg_bar(wg);
    wg_fence();
    const uint32_t wb = smem_u32(win);
    wg_mma(acc, bias_q, wg_desc(wb + kGmBBytes, kWgLbo, kWgSbo), 1);
    wg_mma(acc, bias_q, wg_desc(wb, kWgLbo, kWgSbo), 1);
    wg_mma(acc, bias8_q, wg_desc(wb + kGmBBytes, kWgLbo, kWgSbo), 1);
    wg_mma(acc, bias8_q, wg_desc(wb, kWgLbo, kWgSbo), 1);
    wg_commit();

    // While they run: the item before's gate mean. Between its products and its sums, this item's
    // group wgmmas are done (all but the bias products' commit group): its stages take the next item's
    // copies, which then fly during the sums.
    if (p_row0 >= 0) gate_mean(p_row0, p_f0, p_nf, p_P);
    wg_wait<1>();
    __syncwarp();
    if (lane == 0)
      for (int G = 0; G < groups; ++G) mbar_arrive(&empty[G]);
    if (warp == 0 && it + 1 < it1) produce(k + 1);
    if (p_row0 >= 0) gate_mean_sum(p_row0, p_f0, p_nf, p_P);

    // This item's sums: every wgmma done.
    wg_wait<0>();
    wg_keep(acc);
    // Its sums into products buffer k % 2 (its last readers, the cluster's blocks, read it before the
    // cluster barrier of the gate mean above), its tokens' 2^-e and 1 / rms, and its norm weights.
    float* const P = P0 + (k & 1) * kGmTokens * kGmLd;
    if (tid < kGmTokens) {
      tok_inv[tid] = a.x_inv[row0 + tid];  // (a.x_inv covers whole tiles)
      if (xnorm) xn_r[tid] = row0 + tid < a.rows ? a.hc_rinv[static_cast<size_t>(row0 + tid) * S + s] : 0.0f;
    }
    if (xnorm && tid < kGmQuads)
      xn_w[tid] = tid < nf / 4 ? *reinterpret_cast<const float4*>(a.hc_scale + s * H + f0 + 4 * tid)
                               : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int j = 0; j < kGmTokens / 8; ++j)
#pragma unroll
      for (int cc = 0; cc < 2; ++cc)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          P[(8 * j + 2 * t + cc) * kGmLd + 64 * wg + 16 * wq + 8 * h + g] = acc[4 * j + 2 * h + cc];
    p_row0 = row0;
    p_f0 = f0;
    p_nf = nf;
    p_P = P;
  }
  if (p_row0 >= 0) {
    gate_mean(p_row0, p_f0, p_nf, p_P);
    gate_mean_sum(p_row0, p_f0, p_nf, p_P);
  }
  cluster.sync();  // the others have read this block's products before it leaves
#else
  __trap();  // built for sm_90a only (CMakeLists.txt); q4_wg_gate_mean_persistent_ready() keeps others off
#endif
}

cudaLaunchConfig_t persistent_config(int S, unsigned clusters, cudaLaunchAttribute* attr, cudaStream_t stream) {
  return wg_cluster_config(dim3(static_cast<unsigned>(S) * clusters, 1, 1), kGmThreads, kGmSmem, S, attr, stream);
}

// The clusters of S blocks that can be resident at once (0: none; the kernel cannot run here).
int persistent_clusters(int S) {
  static int n[9] = {-1, -1, -1, -1, -1, -1, -1, -1, -1};
  if (S < 0 || S > 8) return 0;
  if (n[S] < 0) {
    n[S] = 0;
    if (cudaFuncSetAttribute(q4_wg_gate_mean_persistent_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kGmSmem) ==
        cudaSuccess) {
      cudaLaunchAttribute attr[1];
      const cudaLaunchConfig_t cfg = persistent_config(S, 1, attr, nullptr);
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, q4_wg_gate_mean_persistent_kernel, &cfg) == cudaSuccess)
        n[S] = clusters;
    }
    (void)cudaGetLastError();
  }
  return n[S];
}

}  // namespace

bool q4_wg_gate_mean_persistent_ready(int S) {
  return (S == 2 || S == 4 || S == 8) && q4_wg_ready() && persistent_clusters(S) > 0;
}

void launch_q4_wg_gate_mean_persistent(const Q4WgArgs& a, cudaStream_t stream) {
  CK_REQUIRE(a.n_jobs == 1 && a.k_groups == a.groups && a.groups >= 1 && a.groups <= kQ4WgGateMeanMaxGroups &&
                 !a.split.partial && a.hc_x && a.hc_u && a.x_inv && a.job[0].w.rows == a.hc_s * a.hc_h &&
                 a.hc_h % 64 == 0 && q4_wg_gate_mean_persistent_ready(a.hc_s),
             "q4_wg_gate_mean_persistent: %d jobs, %d of %d groups, S %d, H %d, fp16 parts %d", a.n_jobs, a.k_groups,
             a.groups, a.hc_s, a.hc_h, a.x_inv ? 1 : 0);
  const int n_tiles = static_cast<int>(ceil_div(a.rows, kGmTokens));
  const int n_fb = static_cast<int>(ceil_div(a.hc_h, kGmFeatures));
  const int64_t items = static_cast<int64_t>(n_tiles) * n_fb;
  const unsigned clusters = static_cast<unsigned>(std::min<int64_t>(persistent_clusters(a.hc_s), items));
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t cfg = persistent_config(a.hc_s, clusters, attr, stream);
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, q4_wg_gate_mean_persistent_kernel, a, n_tiles, n_fb));
}

}  // namespace ck::cuda
