// Layer-level kernels of the qwen4_exp forward (declared in cuda/layers.h), the Gated DeltaNet: the conv,
// the delta-rule recurrence and its out norms, and the chunked form of the delta rule (prefill: prep,
// scan, tensor-core scan), then their launchers. Each kernel is the device twin of a piece of
// src/cpu/qwen4_exp.cpp and written to be read beside it. Recurrent pieces (GDN conv and delta rule) loop
// over the step's rows inside the kernel, one thread or block per independent channel or head, so the
// state is read and written once per step. Where the CPU rounds a product before adding it, the kernels
// use __fmul_rn/__fadd_rn so no FMA contraction changes the bits.
#include <algorithm>
#include <cmath>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gdn_conv.cuh"
#include "cuda/layers.h"
#include "cuda/layers_internal.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

#include <cooperative_groups.h>

namespace ck::cuda {
namespace {
namespace cg = cooperative_groups;

// ------------------------------------------------------------------ Gated DeltaNet

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
__device__ __forceinline__ float gdn_gated_out_z(const GdnRecArgs& a, int j, float o, float rr, float zz) {
  const float act = a.sigmoid_gate ? sigmoidf_(zz) : siluf_(zz);
  return __fmul_rn(__fmul_rn(a.norm[j], __fmul_rn(o, rr)), act);
}
__device__ __forceinline__ float gdn_gated_out(const GdnRecArgs& a, int r, int h, int j, float o, float rr) {
  return gdn_gated_out_z(a, j, o, rr, a.z[static_cast<size_t>(r) * a.ldz + static_cast<size_t>(h) * a.dv + j]);
}

// How a split head's output norm is made: in the kernel when one block holds the head (or when the
// head's blocks form a cluster, GdnNorm::Cluster), else by gdn_out_norm_kernel after it.
enum class GdnNorm : int { Block = 0, Kernel = 1, Cluster = 2 };

// early: the state comes into registers, and the head's constants into L2, before the wait on the kernel
// before (the in_proj GEMV). Nothing in a step writes them before this kernel (the previous step's
// last write, or a rollback's copy, finished before the step began), and the kernels that may still
// run then are the one before and its predecessor's tail: the state's 64 KB a head came from DRAM
// after the wait, a dependent round trip on the step's critical path (param_prefetch_on()).
// DEFER_NORM (GdnNorm::Cluster only; the default, CK_GDN_NORM_DEFER=0 for one barrier a row): the
// rows' output norms after the row loop, behind one cluster barrier instead of one per row (H200
// 2026-12-02 18:27Z, three interleaved rounds each: +0.4% at 4 rows, +0.2% at 8 and at 2). Warp 0
// keeps each row's o (its 32 columns) in shared memory; the sums, their order and the outputs are
// the per-row form's (the same bits); a 4-row step has three cluster barriers fewer per DeltaNet
// layer on its chain (the delta rule of later rows never reads the norm).
// PRELOAD (2-8-row steps: gdn_preload_min_rows(), CK_GDN_PRELOAD_MIN_ROWS; H200 2026-12-02: level at 2
// and 4 rows, +1.3% and +1.5% at 8 rows in two calls, level at one row, where it is off): every
// row's inputs before the row loop. The per-row form waits, row by row, for q and k (then two block
// sums, four barriers), for β and the decay's inputs, for v and for z: three to four dependent L2
// round trips and nine barriers a row. Here all the rows' loads go out together after the wait; the
// q/k norms of all rows come from one reduction (each value's warp butterfly and warp order as
// block_sum's, so the same bits); v, z, β and the decay wait in shared memory; and the row loop is the
// state's two sums, two barriers a row (the partials of m and of o in separate buffers, so neither
// needs a barrier before its reuse). The arithmetic of each value is the per-row form's: the same bits
// (GdnClusterNormEqualsNormKernel). That it is level at 4 rows says the 4-row step's ~22 us a layer
// in this kernel (hollowed) is not these waits. Dynamic shared memory: gdn_recurrent()'s smem_pre.
// Its static shared memory (scratch, ss_part and o_rows below) is at most this much, in any instance:
// the launcher keeps it and the dynamic part within the 48 KB a kernel gets without asking.
constexpr size_t kGdnRecStaticBytes = sizeof(float) * (2 * kMaxRows * 32 + kMaxRows + kMaxRows * 32);
template <bool DEFER_NORM, bool PRELOAD>
__global__ void __launch_bounds__(512) gdn_recurrent_kernel(const GdnRecArgs a, const StepParams* sp, int rows,
                                                            GdnNorm norm_mode, int early) {
  extern __shared__ float sh[];
  __shared__ float scratch[PRELOAD ? 2 * kMaxRows * 32 : 32];
  __shared__ float ss_part[kMaxRows];  // GdnNorm::Cluster: this block's Σ o² per row, read by the cluster
  __shared__ float o_rows[DEFER_NORM ? kMaxRows : 1][32];  // warp 0's o of each row (cols == 32 in a cluster)
  static_assert(sizeof(scratch) + sizeof(ss_part) + sizeof(o_rows) <= kGdnRecStaticBytes, "kGdnRecStaticBytes");
  const int h = blockIdx.x, dk = a.dk, dv = a.dv, parts = (dk + kKeyPart - 1) / kKeyPart;
  // Value columns are independent in the delta rule (column j of S only needs (Sᵀk)_j): block y owns
  // `cols` of them. With one block per head the norm is fused; with a cluster of the head's blocks
  // (cols == 32: warp 0 holds the block's columns) too; otherwise gdn_out_norm_kernel follows.
  const int cols = dv / static_cast<int>(gridDim.y), jc0 = static_cast<int>(blockIdx.y) * cols;
  const bool fused_norm = norm_mode == GdnNorm::Block;
  const int nr = PRELOAD ? rows : 1;  // rows of q and k kept in shared memory
  float* sq = sh;                      // [nr][dk]
  float* sk = sh + nr * dk;            // [nr][dk]
  float* red = sh + 2 * nr * dk;       // [parts][cols]: the partials of m (and of o without PRELOAD)
  float* red_o = red + parts * cols;   // PRELOAD: [parts][cols], the partials of o
  float* rv = red_o + parts * cols;    // PRELOAD: [rows][blockDim] each thread's v, then z
  float* rz = rv + rows * blockDim.x;
  float* rbeta = rz + rows * blockDim.x;  // PRELOAD: [rows] β, then [rows] the decay
  float* rdecay = rbeta + rows;
  const int tid = threadIdx.x, jl = tid % cols, j = jc0 + jl, p = tid / cols;
  const bool active = p < parts;
  const int kh = h / (a.nv / a.nk);  // repeat_interleave grouping (trap 12)
  const int Kd = a.nk * dk;
  const float q_scale = 1.0f / sqrtf(static_cast<float>(dk));
  // The state before the step (S) and where the state after it goes (S_out): in place, or with a second
  // buffer (GdnRecArgs::state_alt) the one sp->state_parity names and, in a step with snapshots, the
  // other, so the start state stays for a replay (Session::replay_deltanet). (sp is read before the
  // wait: the step's params were copied before its first kernel started.)
  float* S = a.state;
  float* S_out = a.state;
  if (a.state_alt) {
    const bool alt = sp->state_parity != 0;
    S = alt ? a.state_alt : a.state;
    S_out = sp->snap != 0 ? (alt ? a.state : a.state_alt) : S;
  }
  S += static_cast<size_t>(h) * dk * dv;
  S_out += static_cast<size_t>(h) * dk * dv;

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
  // Row r's gated norm of o (its z preloaded or read now).
  auto gated_out = [&](int r, float o, float rr) {
    if constexpr (PRELOAD) return gdn_gated_out_z(a, j, o, rr, rz[r * blockDim.x + tid]);
    else return gdn_gated_out(a, r, h, j, o, rr);
  };
  // Row r's output o of column j, normed where this kernel makes the norm.
  auto row_out = [&](int r, float o) {
    auto gated = [&](float rr) { return gated_out(r, o, rr); };
    if (fused_norm) {
      // Gated RMS norm (N2) over the head's dv outputs: plain weight, then act(z).
      const float ss = block_sum((active && p == 0) ? o * o : 0.0f, scratch);
      const float rr = 1.0f / sqrtf(ss / static_cast<float>(dv) + a.eps);
      if (active && p == 0) a.out[static_cast<size_t>(r) * a.ldo + h * dv + j] = gated(rr);
    } else if (norm_mode == GdnNorm::Cluster) {
      // The same norm across the head's blocks: block y's warp 0 sums its 32 columns (warp y of
      // gdn_out_norm_kernel's block_sum), then every block adds the blocks' sums in rank order from
      // distributed shared memory (that block_sum's warp order): the same bits as the two kernels.
      cg::cluster_group cluster = cg::this_cluster();
      if (tid < 32) {
        const float v = warp_sum(o * o);
        if (tid == 0) ss_part[r] = v;
        if constexpr (DEFER_NORM) o_rows[r][tid] = o;
      }
      if constexpr (!DEFER_NORM) {
        cluster.sync();
        float ss = 0.0f;
        for (unsigned y = 0; y < gridDim.y; ++y) ss += *cluster.map_shared_rank(ss_part + r, y);
        const float rr = 1.0f / sqrtf(ss / static_cast<float>(dv) + a.eps);
        if (active && p == 0) a.out[static_cast<size_t>(r) * a.ldo + h * dv + j] = gated(rr);
      }
    } else if (active && p == 0) {
      a.out[static_cast<size_t>(r) * a.ldo + h * dv + j] = o;  // normed by gdn_out_norm_kernel
    }
  };
  if constexpr (PRELOAD) {
    // Every row's loads, then the sums of squares of all rows' q and k in one reduction.
    float ss[2 * kMaxRows];
#pragma unroll
    for (int v = 0; v < 2 * kMaxRows; ++v) ss[v] = 0.0f;
    for (int i = tid; i < dk; i += blockDim.x) {
      float qv[kMaxRows], kv[kMaxRows];
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r)
        if (r < rows) {
          const float* yr = a.y + static_cast<size_t>(r) * a.ldy;
          qv[r] = yr[kh * dk + i];
          kv[r] = yr[Kd + kh * dk + i];
        }
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r)
        if (r < rows) {
          sq[r * dk + i] = qv[r];
          sk[r * dk + i] = kv[r];
          ss[2 * r] += qv[r] * qv[r];
          ss[2 * r + 1] += kv[r] * kv[r];
        }
    }
    const bool gated = norm_mode != GdnNorm::Kernel && active && p == 0;
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r)
      if (r < rows) {
        const float* yr = a.y + static_cast<size_t>(r) * a.ldy;
        rv[r * blockDim.x + tid] = yr[2 * Kd + h * dv + j];
        if (gated) rz[r * blockDim.x + tid] = a.z[static_cast<size_t>(r) * a.ldz + static_cast<size_t>(h) * a.dv + j];
      }
    if (tid < rows) {
      rbeta[tid] = sigmoidf_(a.b[static_cast<size_t>(tid) * a.ldab + h]);
      const float gate = -expf(a.a_log[h]) * softplusf_(a.a[static_cast<size_t>(tid) * a.ldab + h] + a.dt_bias[h]);
      rdecay[tid] = expf(gate);
    }
    // block_sum of each value (its butterfly, its warp order), all values behind one barrier.
    const int lane = tid & 31, warp = tid >> 5, n_warps = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int v = 0; v < 2 * kMaxRows; ++v)
      if (v < 2 * rows) {
        const float w = warp_sum(ss[v]);
        if (lane == 0) scratch[v * 32 + warp] = w;
      }
    __syncthreads();
    for (int v = 0; v < 2 * rows; v += 2) {
      float tq = 0.0f, tk = 0.0f;
      for (int w = 0; w < n_warps; ++w) {
        tq += scratch[v * 32 + w];
        tk += scratch[(v + 1) * 32 + w];
      }
      const float rq = 1.0f / sqrtf(tq + 1e-6f), rk = 1.0f / sqrtf(tk + 1e-6f);
      const int r = v >> 1;
      for (int i = tid; i < dk; i += blockDim.x) {  // this thread's own elements: no barrier before
        sq[r * dk + i] = (sq[r * dk + i] * rq) * q_scale;
        sk[r * dk + i] = sk[r * dk + i] * rk;
      }
    }
    __syncthreads();
  }
  for (int r = 0; r < rows; ++r) {
    const float* yr = a.y + static_cast<size_t>(r) * a.ldy;
    const float* sqr = sq + (PRELOAD ? r * dk : 0);  // this row's normed q and k
    const float* skr = sk + (PRELOAD ? r * dk : 0);
    float beta, decay;
    if constexpr (PRELOAD) {
      beta = rbeta[r];
      decay = rdecay[r];
    } else {
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
      beta = sigmoidf_(a.b[static_cast<size_t>(r) * a.ldab + h]);
      const float gate = -expf(a.a_log[h]) * softplusf_(a.a[static_cast<size_t>(r) * a.ldab + h] + a.dt_bias[h]);
      decay = expf(gate);
    }
    // m = Sᵀ k after the decay.
    float pm = 0.0f;
#pragma unroll
    for (int t = 0; t < kKeyPart; ++t) {
      const int i = p * kKeyPart + t;
      if (active && i < dk) {
        Sreg[t] *= decay;
        pm += Sreg[t] * skr[i];
      }
    }
    if (active) red[p * cols + jl] = pm;
    __syncthreads();
    float m = 0.0f;
    for (int pp = 0; pp < parts; ++pp) m += red[pp * cols + jl];
    // PRELOAD: the partials of o go to red_o, so red needs no barrier before its reuse by the next row
    // (whose first write follows this row's second barrier); without it red is reused below.
    if constexpr (!PRELOAD) __syncthreads();
    float* ro = PRELOAD ? red_o : red;
    const float delta = beta * ((PRELOAD ? rv[r * blockDim.x + tid] : yr[2 * Kd + h * dv + j]) - m);
    float po = 0.0f;
#pragma unroll
    for (int t = 0; t < kKeyPart; ++t) {
      const int i = p * kKeyPart + t;
      if (active && i < dk) {
        Sreg[t] += skr[i] * delta;
        po += Sreg[t] * sqr[i];
      }
    }
    if (active) ro[p * cols + jl] = po;
    __syncthreads();
    float o = 0.0f;
    for (int pp = 0; pp < parts; ++pp) o += ro[pp * cols + jl];
    row_out(r, o);
    if (snap && r + 1 < rows && a.snaps) {
      float* Sn = a.snaps + static_cast<size_t>(r) * a.snap_stride + static_cast<size_t>(h) * dk * dv;
#pragma unroll
      for (int t = 0; t < kKeyPart; ++t) {
        const int i = p * kKeyPart + t;
        if (active && i < dk) Sn[static_cast<size_t>(i) * dv + j] = Sreg[t];
      }
    }
    if constexpr (!PRELOAD) __syncthreads();  // sq/sk/red are rewritten by the next row
  }
#pragma unroll
  for (int t = 0; t < kKeyPart; ++t) {
    const int i = p * kKeyPart + t;
    if (active && i < dk) S_out[static_cast<size_t>(i) * dv + j] = Sreg[t];
  }
  if constexpr (DEFER_NORM) {  // every row's norm, after one cluster barrier (GdnNorm::Cluster only)
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's ss_part (and this block's o_rows: the barrier orders the block too)
    for (int r = 0; r < rows; ++r) {
      float ss = 0.0f;
      for (unsigned y = 0; y < gridDim.y; ++y) ss += *cluster.map_shared_rank(ss_part + r, y);
      const float rr = 1.0f / sqrtf(ss / static_cast<float>(dv) + a.eps);
      if (active && p == 0)
        a.out[static_cast<size_t>(r) * a.ldo + h * dv + j] = gated_out(r, o_rows[r][jl], rr);
    }
  }
  if (norm_mode == GdnNorm::Cluster) cg::this_cluster().sync();  // the others may still read ss_part
}

// The chunked form's largest dk and dv: shared memory, the scan's four state rows per thread, and
// gdn_out_norm_rows_kernel's values a lane.
constexpr int kGdnChunkMaxDim = 128;

// grid (rows), block 256: the same norm after gdn_chunked, one warp per head (the chunked form's sums
// are in another order anyway, and 48 heads x 1,024 rows of one-warp blocks would mostly wait).
// A lane's values (dv <= kGdnChunkMaxDim: 4) and their gates are loaded once, all before the first
// store: with o[j] read again beside its gate after the sum, each store kept the next value's loads
// behind it (o may alias z as far as the compiler knows): a round trip per value.
__global__ void gdn_out_norm_rows_kernel(const GdnRecArgs a) {
  pdl_begin();
  constexpr int kPer = kGdnChunkMaxDim / 32;  // (gdn_chunked_fits checks dv)
  const int r = blockIdx.x, lane = threadIdx.x & 31, dv = a.dv;
  for (int h = threadIdx.x >> 5; h < a.nv; h += blockDim.x >> 5) {
    float* o = a.out + static_cast<size_t>(r) * a.ldo + static_cast<size_t>(h) * dv;
    const float* z = a.z + static_cast<size_t>(r) * a.ldz + static_cast<size_t>(h) * dv;
    float ov[kPer], zv[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int j = lane + 32 * k;
      if (j < dv) {
        ov[k] = o[j];
        zv[k] = z[j];
      }
    }
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k)
      if (lane + 32 * k < dv) ss += ov[k] * ov[k];
    ss = warp_sum(ss);
    const float rr = 1.0f / sqrtf(ss / static_cast<float>(dv) + a.eps);
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int j = lane + 32 * k;
      if (j < dv) o[j] = gdn_gated_out_z(a, j, ov[k], rr, zv[k]);
    }
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
// Leading dimension of the prep kernel's q, k (and v) rows: whole float4 quads of max(dk, dv), and an odd
// number of quads, so the 8 rows that a phase of 16-byte loads reads fall in different banks: 4 (q | 1)
// for q = ceil(max(dk, dv) / 4). (Written out long: the short form, equal for every dk and dv, changed
// the prep kernel's SASS, and this one is the form tested on the GPU.)
__host__ __device__ constexpr int gdn_prep_ld(int dk, int dv) {
  return ((dk > dv ? dk : dv) + 3) / 4 % 2 == 1 ? ((dk > dv ? dk : dv) + 3) / 4 * 4
                                                 : ((dk > dv ? dk : dv) + 3) / 4 * 4 + 4;
}
size_t gdn_prep_smem(int dk, int dv) {
  constexpr int C = kGdnChunk;
  const int ld = gdn_prep_ld(dk, dv);
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
// The q, k and v rows come in by cp.async (4-byte copies into rows of an odd number of quads: the
// products below read them in 16-byte loads without bank conflicts): with plain loads, each guarded
// load and its store were one round trip in turn, ~30% of the kernel's time (Nsight Compute,
// twenty-first session). W and U are solved from (I + L) X = B by forward substitution, each thread
// one column of B (W's with the warps 0-3, U's with 4-7), without forming T = (I + L)⁻¹: T's
// substitution (64 steps, one block barrier each, 64 threads busy) and the products T B were ~48% of
// the kernel's time.
__global__ void __launch_bounds__(256, 2) gdn_chunk_prep_kernel(const GdnRecArgs a, int rows, float* records) {
  pdl_begin();
  extern __shared__ float4 prep_sh4[];
  constexpr int C = kGdnChunk, ldt = kGdnPrepLdt, kWarps = 8;
  const int h = blockIdx.x, c = blockIdx.y, dk = a.dk, dv = a.dv, ld = gdn_prep_ld(dk, dv), dk4 = (dk + 3) / 4 * 4;
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
      } else if (i < dk4) {  // the last quad's columns past dk: zeros for the products' 16-byte loads
        qs[t * ld + i] = 0.0f;
        ks[t * ld + i] = 0.0f;
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

  // k̂ k̂ᵀ and q̂ k̂ᵀ: thread (ty, tx) holds rows ty + 16m and columns tx + 16n (odd quad strides: no bank
  // conflicts). L goes to shared memory (transposed), P to the record. Both are lower triangular, so the
  // blocks n > m (every column past every row of the block) are not computed: 10 of 16 products.
  const GdnChunkLayout lay(dk, dv);
  float* rec = records + (static_cast<size_t>(c) * a.nv + h) * lay.size;
  {
    const int ty = tid / 16, tx = tid % 16;
    // Four columns i at a time, in 16-byte loads (12 loads for 80 products; scalar loads were 48),
    // summed in the order of i as before; the last quad's columns past dk are zeros.
    float kk[4][4] = {}, qk[4][4] = {};
#pragma unroll 1
    for (int i = 0; i < dk4; i += 4) {
      float4 kt[4], qt[4], kc[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        kt[m] = *reinterpret_cast<const float4*>(&ks[(ty + 16 * m) * ld + i]);
        qt[m] = *reinterpret_cast<const float4*>(&qs[(ty + 16 * m) * ld + i]);
        kc[m] = *reinterpret_cast<const float4*>(&ks[(tx + 16 * m) * ld + i]);
      }
#pragma unroll
      for (int m = 0; m < 4; ++m)
#pragma unroll
        for (int q = 0; q <= m; ++q) {  // q > m: columns past every row of the pair (s > t), not used
          kk[m][q] += kt[m].x * kc[q].x;
          kk[m][q] += kt[m].y * kc[q].y;
          kk[m][q] += kt[m].z * kc[q].z;
          kk[m][q] += kt[m].w * kc[q].w;
          qk[m][q] += qt[m].x * kc[q].x;
          qk[m][q] += qt[m].y * kc[q].y;
          qk[m][q] += qt[m].z * kc[q].z;
          qk[m][q] += qt[m].w * kc[q].w;
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
// The 16-byte form: the source rows are contiguous, so a thread's copies are its flat quads o, o + n, ...
// of the source, and only their shared-memory places (padded rows) need the (row, quad) of o, stepped
// with a carry, as a 32-bit shared address. Why: a division of the flat index and 64-bit pointer
// arithmetic per copy were ~24 instructions a copy, a quarter of the scan's (SASS, forty-first session).
__device__ __forceinline__ void stage_async(float* dst, int ld, const float* src, int rows, int cols) {
  if ((cols & 3) == 0) {
    const int q = cols / 4, nt = static_cast<int>(blockDim.x), n = rows * q;
    const int dt = nt / q, di = nt - dt * q;
    const int o0 = static_cast<int>(threadIdx.x), t = o0 / q;
    int i = o0 - t * q;
    unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(dst + t * ld + 4 * i));
    const unsigned step = 4u * static_cast<unsigned>(dt * ld + 4 * di), wrap = 4u * static_cast<unsigned>(ld - 4 * q);
    const float* g = src + 4 * o0;
    const int count = o0 < n ? (n - o0 + nt - 1) / nt : 0;
    for (int k = 0; k < count; ++k, g += 4 * nt) {
      cp_async16_shared(sa, g);
      i += di;
      sa += step;
      if (i >= q) {
        i -= q;
        sa += wrap;
      }
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
// session); this one ~560 us (419 us since the forty-first session's cheaper splits and copies).
// A block takes NC value columns (64, or 32 with CK_GDN_SCAN_COLS=32). Warp w: phases 1 and 2 (64 x NC
// outputs) the m16 tile w % 4 and half the n8 tiles (w / 4 picks which half); phase 3 (the dk x NC
// state) the m16 tile w and all n8 tiles, whose accumulators hold the state between chunks (written
// to shared memory for the next chunk's B operands). Phase 1 and the (e^G q̂) S half of phase 2 share
// their B fragments (S) in one pass.
// Shared memory: the [C][ldk] record buffers (ldk = 16 ceil(dk / 16) + 4, their columns past dk
// zero, so k steps of 8 and m16 tiles past dk add zeros), P [C][68], S [dk16][NC] and v_new [C][NC],
// the last two with their 8-column groups swizzled by row (conflict-free B fragment loads).
// Record buffers: three at 64 columns (one block an SM), two at 32 (two blocks an SM). With two, the
// next chunk's e^G q̂ can only be copied once phase 3 has read k̂d, and each chunk began by waiting for
// that copy (its first cp.async wait was the scan's largest stall line, forty-first session); with
// three it is copied after phase 1, beside k̂d and the next W.
__host__ __device__ constexpr int gdn_tc_dk16(int dk) { return (dk + 15) / 16 * 16; }
__host__ __device__ constexpr int gdn_tc_ld(int dk) { return gdn_tc_dk16(dk) + 4; }
__host__ __device__ constexpr int gdn_tc_bufs(int cols) { return cols == 64 ? 3 : 2; }
size_t gdn_scan_tc_smem(int dk, int cols) {
  constexpr int C = kGdnChunk;
  return sizeof(float) *
         (gdn_tc_bufs(cols) * C * gdn_tc_ld(dk) + C * kGdnScanLdP + gdn_tc_dk16(dk) * cols + C * cols);
}
// x as two tf32 operands, in three instructions: hi = x rounded to nearest (ties away) by the bias at
// bit 12, lo = x - hi (exact: hi and x are within a factor of 2), both left with their low 13 bits for
// the MMA, which reads only the top 19 (nvcc's own lowering of cvt.rna.tf32.f32 on sm_90 feeds the MMA
// the biased word unmasked, and ptxas keeps it so). lo is thus truncated to tf32 (within 2^-21 |x|;
// cvt.rna's 2^-22). Why: cvt.rna.tf32.f32 is emulated (bias, |x| < inf test, select: 4 instructions),
// so the split was 9 instructions an operand, ~half of the scan's instructions (Nsight Compute, forty-
// first session). NaN survives: a NaN whose biased word wraps into the sign reads as 0 in hi, and
// x - hi is NaN in lo.
__device__ __forceinline__ void tf32_split(float x, uint32_t& hi, uint32_t& lo) {
  hi = __float_as_uint(x) + 0x1000u;
  lo = __float_as_uint(x - __uint_as_float(hi & 0xffffe000u));
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
// k_end: the k steps past it are known to multiply zeros (P is lower triangular), a multiple of 16.
template <int NC, int N, class LoadA>
__device__ __forceinline__ void gdn_mma_over_chunk(LoadA load_a, const float* vn, const int (&boff)[N],
                                                   float (&acc)[N][4], int k_end = kGdnChunk) {
#pragma unroll 2
  for (int k0 = 0; k0 < k_end; k0 += 8) {
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
  constexpr int NBUF = gdn_tc_bufs(NC);     // record buffers
  pdl_begin();
  extern __shared__ float4 sh4[];
  constexpr int C = kGdnChunk, ldp = kGdnScanLdP;
  const int h = blockIdx.x, c0 = blockIdx.y * NC, dk = a.dk, dv = a.dv, ld = gdn_tc_ld(dk), dk16 = gdn_tc_dk16(dk);
  float* sh = reinterpret_cast<float*>(sh4);
  float* Pm = sh + NBUF * C * ld;  // [C][ldp]; the NBUF [C][ld] buffers come first
  float* Ss = Pm + C * ldp;      // [dk16][NC] swizzled: this block's state columns
  float* vn = Ss + dk16 * NC;    // [C][NC] swizzled: v_new
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const GdnChunkLayout lay(dk, dv);
  const int chunks = (rows + C - 1) / C;
  auto record = [&](int c) { return records + (static_cast<size_t>(c) * a.nv + h) * lay.size; };
  // Columns [dk, ld) of every buffer: zero once (the copies write only columns < dk).
  for (int idx = tid; idx < NBUF * C * (ld - dk); idx += blockDim.x) {
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
    // W(c) and e^G q̂(c); with three buffers the third (k̂d(c - 1)'s, read) takes e^G q̂(c + 1).
    float* wb = sh + (c % NBUF) * C * ld;
    float* qb = sh + ((c + 1) % NBUF) * C * ld;
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
    if (NBUF == 3 && more) stage_async(sh + ((c + 2) % NBUF) * C * ld, ld, record(c + 1) + lay.qd, C, dk);
    cp_async_commit();  // (possibly empty) a group of its own: phase 3 waits for k̂d(c) only

    // Phase 2, second half: out += P v_new, over k = chunk rows.
    gdn_mma_over_chunk<NC>(
        [&](int k0, float (&ap)[4]) {
          const float* pp = Pm + ap2 + k0;
          ap[0] = pp[0]; ap[1] = pp[8 * ldp]; ap[2] = pp[4]; ap[3] = pp[8 * ldp + 4];
        },
        vn, b12, o, 16 * (mt + 1));  // P[t][s] = 0 for s > t: the m16 tile mt ends at column 16 mt + 15
#pragma unroll
    for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int row = c * C + 16 * mt + g + 8 * (e >> 1), col = c0 + n0 + 8 * nt + 2 * t + (e & 1);
        if (row < rows && col < dv) a.out[static_cast<size_t>(row) * a.ldo + static_cast<size_t>(h) * dv + col] = o[nt][e];
      }
    const float dl = rec[lay.dl];
    cp_async_wait<1>();  // e^(G_last-G) k̂(c) (and W(c+1)); not the newest group (e^G q̂(c + 1))
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
    if (NBUF == 2 && more) stage_async(wb, ld, record(c + 1) + lay.qd, C, dk);
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

}  // namespace

void init_deltanet_kernels() {
  CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_prep_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(gdn_prep_smem(kGdnChunkMaxDim, kGdnChunkMaxDim))));
  CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(gdn_scan_smem(kGdnChunkMaxDim))));
  CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan_tc_kernel<32, 2>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(gdn_scan_tc_smem(kGdnChunkMaxDim, 32))));
  CUDA_CHECK(cudaFuncSetAttribute(gdn_chunk_scan_tc_kernel<64, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(gdn_scan_tc_smem(kGdnChunkMaxDim, 64))));
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

namespace {
int g_gdn_norm_defer = -1;  // -1: not yet read from CK_GDN_NORM_DEFER
}  // namespace

void set_gdn_norm_defer(int on) { g_gdn_norm_defer = on < 0 ? -1 : (on ? 1 : 0); }

namespace {
int g_gdn_preload_min_rows = -1;  // -1: not yet read from CK_GDN_PRELOAD_MIN_ROWS
int gdn_preload_min_rows() {
  if (g_gdn_preload_min_rows < 0) {
    const char* e = std::getenv("CK_GDN_PRELOAD_MIN_ROWS");
    g_gdn_preload_min_rows = e ? std::max(1, std::atoi(e)) : 2;
  }
  return g_gdn_preload_min_rows;
}
}  // namespace

void set_gdn_preload_min_rows(int rows) { g_gdn_preload_min_rows = rows < 0 ? -1 : std::max(1, rows); }

namespace {
// gdn_recurrent_kernel's block for heads of dk x dv. Each head's value columns split over blocks of 32
// (4x the blocks at dv 128: 48 heads alone use a third of the GPU), which make the norm as a cluster
// or in a second kernel; small heads keep one block and the fused norm. A thread holds kKeyPart rows
// of its column's state: `parts` threads a column.
struct GdnRecShape {
  int parts, split, cols, threads;
  size_t smem;  // dynamic shared memory of the per-row form
  GdnRecShape(int dk, int dv)
      : parts(static_cast<int>(ceil_div(dk, kKeyPart))),
        split((dv % 32 == 0 && dv >= 64 && dv <= 1024) ? dv / 32 : 1),
        cols(dv / split),
        threads(static_cast<int>(round_up(static_cast<int64_t>(cols) * parts, 32))),
        smem(sizeof(float) * (2 * static_cast<size_t>(dk) + static_cast<size_t>(parts) * cols)) {}
  // A block of at most 512 threads (the kernel's launch bounds) within the default shared memory.
  bool fits() const { return threads <= 512 && smem + kGdnRecStaticBytes <= 48 * 1024; }
};

}  // namespace

bool gdn_recurrent_fits(int dk, int dv) {
  return dk >= 1 && dv >= 1 && dk <= 1 << 20 && dv <= 1 << 20 && GdnRecShape(dk, dv).fits();
}

void gdn_recurrent(const GdnRecArgs& a, const StepParams* sp, int rows, cudaStream_t stream) {
  const GdnRecShape g(a.dk, a.dv);
  CK_REQUIRE(a.dk >= 1 && a.dv >= 1 && g.fits() && a.nk >= 1 && a.nv % a.nk == 0, "GDN dims dk %d dv %d nk %d nv %d",
             a.dk, a.dv, a.nk, a.nv);
  const int parts = g.parts, split = g.split, cols = g.cols, threads = g.threads;
  const size_t smem = g.smem;
  // Every row's inputs before the row loop (gdn_recurrent_kernel's PRELOAD) from 2 rows on
  // (CK_GDN_PRELOAD_MIN_ROWS=N: from N rows; 9 turns it off), where its shared memory fits the default
  // with the kernel's static part (large key dims: the per-row form).
  const size_t smem_pre = sizeof(float) * (2 * static_cast<size_t>(rows) * a.dk + 2 * parts * cols +
                                           2 * static_cast<size_t>(rows) * threads + 2 * rows);
  const bool preload =
      rows >= gdn_preload_min_rows() && rows <= kMaxRows && smem_pre + kGdnRecStaticBytes <= 48 * 1024;
  // A split head's blocks as one thread-block cluster make the norm themselves (no second kernel and
  // its hand-over); CK_GDN_CLUSTER_NORM=0 keeps gdn_out_norm_kernel, to compare.
  if (g_gdn_cluster_norm < 0) g_gdn_cluster_norm = env_is("CK_GDN_CLUSTER_NORM", "0") ? 0 : 1;
  const bool cluster = g_gdn_cluster_norm == 1 && split > 1 && split <= 8 && cols == 32 && rows <= kMaxRows;
  const GdnNorm mode = split == 1 ? GdnNorm::Block : cluster ? GdnNorm::Cluster : GdnNorm::Kernel;
  if (g_gdn_norm_defer < 0) g_gdn_norm_defer = env_is("CK_GDN_NORM_DEFER", "0") ? 0 : 1;  // (gdn_recurrent_kernel)
  const bool defer = g_gdn_norm_defer == 1 && mode == GdnNorm::Cluster;
  auto kernel = preload ? (defer ? gdn_recurrent_kernel<true, true> : gdn_recurrent_kernel<false, true>)
                        : (defer ? gdn_recurrent_kernel<true, false> : gdn_recurrent_kernel<false, false>);
  launch_cluster(kernel, dim3(a.nv, split), threads, preload ? smem_pre : smem, stream, dim3(1, cluster ? split : 1, 1),
                 a, sp, rows, mode, param_prefetch_on() ? 1 : 0);
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
// (CK_GDN_SCAN_COLS=32; 64 by default; -1: not yet read).
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
  // 64 columns (one block an SM) by default: +0.3-0.9% at 2k and 8k in three rounds of two calls once
  // the scan's conversions and copies were cheap (H200 2026-12-04 03:22Z and 03:29Z); level before.
  if (g_gdn_scan_cols < 0) g_gdn_scan_cols = env_is("CK_GDN_SCAN_COLS", "32") ? 32 : 64;
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

}  // namespace ck::cuda
