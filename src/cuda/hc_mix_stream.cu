// The one-row mix by stream (spec §4; CK_HC_BY_STREAM): hc_mix.cu's kernel with its phase 1 split by
// (stream, 16-row tile of down) instead of by chunk of the wide input.
//
// Why: in hc_mix.cu each of 80 blocks makes the partial products of every down row over its chunk of
// 128 columns, so after the grid barrier each of the 40 consumer blocks copies 80 chunks' partials
// (107 KB at the released geometry) and adds them in chunk order: ~6.7k cycles a mix, on the step's
// path (docs/roofline-cuda.md, fifty-second and fifty-eighth sessions). Every tuning of that exchange
// lost. Here block (s, t) makes tile t of down over all of stream s's columns, so a row of d has S
// partials (one a stream) where it had 80, and a consumer reads S x low rank floats (5 KB).
// The price: each block needs all of its stream's X, so the combine and the norm of a stream run in
// each of its tiles_d blocks (20 at the released geometry): H elements a block, read from L2.
//
// Phases (one block an SM, all resident, as in hc_mix.cu):
//  1. Block c < S tiles_d, c = s tiles_d + t: v = R_s + o w_s (the deferred combine; not written
//     back here: other blocks of the stream read R_s until the barrier), 1 / rms of the stream from
//     its own block sum, X_s = (v r_s) n (the CPU's norm formula, the same as phase 3's), X_s's v4
//     fragments, and down's tile t against them from its copy in shared memory (warps over groups,
//     their rows added in warp order). Its share of the stream's groups also goes through the inject
//     head's tile (staged in shared memory before the wait, as in hc_mix.cu).
//  2. (grid barrier) d_j = Σ_s p_s,j in stream order, silu(d / S); block 0 adds the inject head's
//     partials in block order and writes 2 sigmoid(l / S).
//  3. Block b takes u's 64-group b as in hc_mix.cu, and writes the combined R of its elements: the
//     only block that reads or writes them after the barrier.
// A deferred MoE output (CK_HC_BY_STREAM=2) is combined from its slots in every block of phase 1
// (moe_combine_elem_flat: the same bits as moe_combine_kernel), and the stream-0 blocks store o for
// phase 3. The sums' order differs from hc_mix.cu's (per stream, not per chunk), so other roundings,
// within the parity tolerances against the CPU reference (test_cuda_ops OneRowMixByStream...).
// Status (2026-12-07): its first form failed that test (the w_in / w_out race fixed below) and measured
// -5.1% (mode 1) and -10.4% (mode 2) at one row on an H100, with block 0's inject sum as one thread's
// chain of 80 loads (also fixed). This form has not run on a GPU (docs/roofline-cuda.md, sixtieth session).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <type_traits>

#include "cuda/bulk_copy.cuh"
#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/hc_mix_parts.cuh"
#include "cuda/layers.h"
#include "cuda/mma_q4.cuh"

namespace ck::cuda {
namespace {

constexpr int kStThreads = 512, kStWarps = kStThreads / 32;
constexpr int kStMaxStreams = 8;
constexpr int kStMaxGroups = 48;  // 64-code groups of one stream: H <= 3,072
constexpr int kStPerThread = kStMaxGroups * 64 / kStThreads;
constexpr int kStMaxLowrank = 1024;
constexpr int kStMaxInject = 16;
constexpr int kStMaxInjectGroups = 8;  // a block's share of a stream's groups
constexpr int kStMaxWorkPerLane = 8;   // phase 1's blocks (at most 256) over a warp's lanes
constexpr int kStMaxDynamicBytes = 200 * 1024;

struct HcStreamLaunch {
  HcMixArgs a;
  int lowrank, gps, tiles_d;  // the low rank, 64-code groups a stream, 16-row tiles of down
  int n_work;                 // phase 1's blocks: S x tiles_d
  float* part;                // [S][lowrank]: stream s's products of the down rows (r_s applied)
  float* ipart;               // [n_work][16]: the inject head's products over each block's groups
  float* rinv;                // [S]: 1 / rms of each stream
  float* o;                   // [H]: a MoE output's combined o, for phase 3 (MOE only)
  unsigned* bar;              // grid_barrier_count's words (its count at bar[48])
  unsigned wrap_at;
  int leave_early;
};

// Dynamic shared memory: the fragments (max(groups a stream, low rank / 64) x 1 KB), down's tile over the
// stream (gps x 576 bytes), the consumer's up tiles (S x 4 x low rank / 64 x 576), the staged inject pair.
__host__ __device__ constexpr size_t st_frag_bytes(int gps, int lowrank) {
  return static_cast<size_t>(gps > lowrank / 64 ? gps : lowrank / 64) * 128 * sizeof(uint2);
}
__host__ __device__ constexpr size_t st_up_bytes(int S, int lowrank) {
  return static_cast<size_t>(S) * 4 * (lowrank / 64) * kTileGroupBytes;
}

// UP_SMEM: the consumer's up tiles copied to shared memory at its start (as hc_mix.cu's default); without
// it they are asked of L2 there and read from L2 after the barrier, and the block's shared memory (~83 KB
// at the released geometry, not ~129) leaves room beside one expert down block (CK_HC_BY_STREAM_UP=0).
template <bool BF16S, bool MOE, bool UP_SMEM>
__global__ void __launch_bounds__(kStThreads, 1) hc_mix_stream_kernel(const __grid_constant__ HcStreamLaunch L) {
  __shared__ __align__(16) float xs[kStMaxGroups * 64];  // phase 1: the stream's X; phase 2: d
  __shared__ float xg[kStMaxGroups], red[kStWarps][16], ired[16], gl[kStMaxStreams][64], su[64], rinv[kStMaxStreams];
  __shared__ float win[kStMaxStreams];  // the combine's injection weights, read before the barrier
  __shared__ float scratch[32];
  __shared__ __align__(8) uint64_t down_bar, up_bar;
  extern __shared__ __align__(16) uint8_t dyn[];
  const HcMixArgs& a = L.a;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int S = a.S, H = a.H, gps = L.gps, td = L.tiles_d, ngd = L.lowrank / 64;
  const int c = blockIdx.x;
  const bool worker = c < L.n_work, consumer = c < H / 64;
  const int s = worker ? c / td : 0, tl = worker ? c % td : 0;
  const int Gi0 = tl * gps / td, Gi1 = (tl + 1) * gps / td;  // the block's share of the stream's groups
  uint2* const frag = reinterpret_cast<uint2*>(dyn);
  uint8_t* const down_tile = dyn + st_frag_bytes(gps, L.lowrank);
  uint8_t* const up_tiles = down_tile + static_cast<size_t>(gps) * kTileGroupBytes;
  uint4* const staged = reinterpret_cast<uint4*>(up_tiles + (UP_SMEM ? st_up_bytes(S, L.lowrank) : 0));
  const bool inject = a.inject.rows > 0;

  // Before the wait (weights never change): the copies of down's tile over the stream and of the
  // consumer's up tiles, the inject pair staged by the last warp, and L2 asked for R and the norm's scale.
  if (tid == 0) {
    mbar_init(&down_bar, 1);
    mbar_init(&up_bar, 1);
    mbar_init_fence();
    if (worker) {
      const uint32_t bytes = static_cast<uint32_t>(gps) * kTileGroupBytes;  // a tile's groups, contiguous
      mbar_arrive_expect(&down_bar, bytes);
      bulk_copy_1d(down_tile, a.down.tile_group(tl, static_cast<size_t>(s) * gps), bytes, &down_bar);
    }
    if (UP_SMEM && consumer) {
      const uint32_t stream_bytes = 4u * ngd * kTileGroupBytes;
      mbar_arrive_expect(&up_bar, stream_bytes * S);
      for (int q = 0; q < S; ++q)
        bulk_copy_1d(up_tiles + q * stream_bytes, a.up.tile_group((static_cast<size_t>(q) * H + 64 * c) / kTileRows, 0),
                     stream_bytes, &up_bar);
    }
  }
  if (worker && inject && Gi1 > Gi0 && warp == kStWarps - 1)
    hc_tile_pair_stage<BF16S>(a.inject, 0, a.inject, 0, s * gps + Gi0, s * gps + Gi1, staged);
  if (worker) {  // this block's share of the stream's lines (its 20 siblings ask for the others)
    const uint8_t* rb = reinterpret_cast<const uint8_t*>(a.R + static_cast<size_t>(s) * H);
    const uint8_t* nb = reinterpret_cast<const uint8_t*>(a.norm + static_cast<size_t>(s) * H);
    for (int l = tl + td * tid; l * 128 < H * 4; l += td * kStThreads) prefetch_l2(rb + l * 128), prefetch_l2(nb + l * 128);
  }
  if (!UP_SMEM && consumer) {  // the up tiles: a stream's 4 tiles are contiguous
    const size_t stream_bytes = 4 * static_cast<size_t>(ngd) * kTileGroupBytes;
    for (size_t off = 128 * static_cast<size_t>(tid); off < stream_bytes * S; off += 128 * kStThreads) {
      const size_t q = off / stream_bytes;
      prefetch_l2(a.up.tile_group((q * H + 64 * c) / kTileRows, 0) + off % stream_bytes);
    }
  }
  if (consumer && tid < 2 * S) {  // phase 3's elements: 64 a stream
    const size_t k = static_cast<size_t>(tid >> 1) * H + 64 * c + 32 * (tid & 1);
    prefetch_l2(a.R + k), prefetch_l2(a.norm + k);
  }
  pdl_begin();  // R, o and w come from the kernels before
  // The injection weights w_in, once, before the barrier: the session passes one buffer as this mix's w_in
  // and w_out, and block 0 writes w_out after the barrier while phase 3 combines (the first form read
  // w_in there: other blocks saw the new weights, a race whose logits were 5% off; H100 2026-12-07).
  const bool combine = MOE || a.o;
  if (tid < S) win[tid] = combine ? a.w_in[tid] : 0.0f;
  __syncthreads();

  // 1. The stream's combine and norm, then down's tile t over it.
  if (worker) {
    const float w = win[s];
    float v[kStPerThread], nv[kStPerThread];
    float sq = 0.0f;
#pragma unroll
    for (int q = 0; q < kStPerThread; ++q) {
      const int e = tid + q * kStThreads;
      v[q] = nv[q] = 0.0f;
      if (e < H) {
        const size_t k = static_cast<size_t>(s) * H + e;
        nv[q] = a.norm[k];
        // R and o through L2 only: other blocks write them (R in phase 3 of this kernel, for the mixes
        // after), and an SM's L1 is not coherent with their stores.
        float r = __ldcg(a.R + k);
        if constexpr (MOE) {
          const float o = moe_combine_elem_flat(a.moe_y, a.moe_ldy, a.moe_pairs, a.moe_k, a.moe_gl, e);
          r = mul_add_rn(r, o, w);
          if (s == 0 && e >= 64 * Gi0 && e < 64 * Gi1) L.o[e] = o;  // for phase 3 (each element once)
        } else if (combine) {
          r = mul_add_rn(r, __ldcg(a.o + e), w);
        }
        v[q] = r;
      }
    }
#pragma unroll
    for (int q = 0; q < kStPerThread; ++q) sq += v[q] * v[q];
    const float r_s = 1.0f / sqrtf(block_sum(sq, scratch) / static_cast<float>(H) + a.eps);  // rmsnorm_wide_tail's formula
#pragma unroll
    for (int q = 0; q < kStPerThread; ++q)
      if (tid + q * kStThreads < H) xs[tid + q * kStThreads] = (v[q] * r_s) * nv[q];
    __syncthreads();
#pragma unroll 1
    for (int G = warp; G < gps; G += kStWarps) hc_frag(xs + 64 * G, frag + G * 128, xg + G);
    __syncthreads();
    mbar_wait(&down_bar, 0);
    float acc[4] = {};
    hc_tile_lds<1>(down_tile, warp, gps, kStWarps, frag, xg, acc);
    float y0, y1;
    hc_tile_rows(acc, y0, y1);
    if (t == 0) red[warp][g] = y0, red[warp][g + 8] = y1;
    if (warp == kStWarps - 1) {  // the inject head's tile over the block's groups (none: zeros)
      float ia[4] = {}, ib[4] = {};
      if (inject && Gi1 > Gi0) hc_tile_pair_staged(staged, Gi1 - Gi0, frag + Gi0 * 128, xg + Gi0, ia, ib);
      hc_tile_rows(ia, y0, y1);
      if (t == 0) ired[g] = y0, ired[g + 8] = y1;
    }
    __syncthreads();
    if (tid < 16) {
      float y = 0.0f;
      for (int k = 0; k < kStWarps; ++k) y += red[k][tid];
      L.part[static_cast<size_t>(s) * L.lowrank + 16 * tl + tid] = y;
    } else if (tid < 32) {
      L.ipart[static_cast<size_t>(c) * 16 + tid - 16] = ired[tid - 16];
    } else if (tid == 32 && tl == 0) {
      L.rinv[s] = r_s;
    }
  }
  grid_barrier_count(L.bar, L.wrap_at, consumer || !L.leave_early);
  if (!consumer) return;

  // 2. d = Σ_s p_s in stream order, silu(d / S); block 0: the injection weights.
  if (tid < S) rinv[tid] = __ldcg(L.rinv + tid);
#pragma unroll 1
  for (int j = tid; j < L.lowrank; j += kStThreads) {
    float p[kStMaxStreams];
#pragma unroll
    for (int q = 0; q < kStMaxStreams; ++q) p[q] = q < S ? __ldcg(L.part + static_cast<size_t>(q) * L.lowrank + j) : 0.0f;
    float d = 0.0f;
#pragma unroll
    for (int q = 0; q < kStMaxStreams; ++q)
      if (q < S) d += p[q];
    xs[j] = apply_epilogue(d, Epilogue::SiluDiv, static_cast<float>(S));  // trap 4: divide first
  }
  if (c == 0 && warp < a.inject.rows) {
    // Warp r adds row r's n_work partials: each lane its blocks lane, lane + 32, ... (every load asked
    // for at once), then the lanes in a fixed tree. Why: one thread's chain of 80 loads, even unrolled
    // by 8, was ten L2 round trips on block 0's path (~3-4 us a mix; H100 2026-12-07).
    float p[kStMaxWorkPerLane];
#pragma unroll
    for (int q = 0; q < kStMaxWorkPerLane; ++q) {
      const int k = lane + 32 * q;
      p[q] = k < L.n_work ? __ldcg(L.ipart + static_cast<size_t>(k) * 16 + warp) : 0.0f;
    }
    float l = 0.0f;
#pragma unroll
    for (int q = 0; q < kStMaxWorkPerLane; ++q) l += p[q];
    l = warp_sum(l);
    if (lane == 0) a.w_out[warp] = apply_epilogue(l, Epilogue::TwoSigmoidDiv, static_cast<float>(S));
  }
  __syncthreads();
#pragma unroll 1
  for (int G = warp; G < ngd; G += kStWarps) hc_frag(xs + 64 * G, frag + G * 128, xg + G);
  __syncthreads();

  // 3. u's group c: the up rows of every stream from their copy, then the gate mean (hc_mix.cu's order).
  if (UP_SMEM) mbar_wait(&up_bar, 0);
#pragma unroll 1
  for (int it = warp; it < 4 * S; it += kStWarps) {  // (stream, 16-row tile)
    const int q = it >> 2, r0 = 16 * (it & 3);
    float acc[4] = {};
    if (UP_SMEM) hc_tile_lds<2>(up_tiles + static_cast<size_t>(it) * ngd * kTileGroupBytes, 0, ngd, 1, frag, xg, acc);
    else hc_tile<BF16S, 2, true>(a.up, q * H + 64 * c + r0, 0, ngd, frag, xg, acc);
    float y0, y1;
    hc_tile_rows(acc, y0, y1);
    if (t == 0) gl[q][r0 + g] = y0, gl[q][r0 + g + 8] = y1;
  }
  __syncthreads();
  if (tid < 64) {
    const int i = 64 * c + tid;
    const float o = MOE ? __ldcg(L.o + i) : combine ? __ldcg(a.o + i) : 0.0f;
    float acc = 0.0f;
    for (int s0 = 0; s0 < S; s0 += 4) {
      float x[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const size_t k = static_cast<size_t>(s0 + j) * H + i;
        x[j] = 0.0f;
        if (s0 + j < S) {
          float r = __ldcg(a.R + k);
          if (combine) {
            r = mul_add_rn(r, o, win[s0 + j]);
            a.R[k] = r;  // the combined residual: this block is its element's one reader and writer now
          }
          x[j] = (r * rinv[s0 + j]) * a.norm[k];
        }
      }
      const float4 sg = sigmoid4_(make_float4(gl[s0][tid], s0 + 1 < S ? gl[s0 + 1][tid] : 0.0f,
                                              s0 + 2 < S ? gl[s0 + 2][tid] : 0.0f, s0 + 3 < S ? gl[s0 + 3][tid] : 0.0f));
      const float sv[4] = {sg.x, sg.y, sg.z, sg.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        if (s0 + j < S) acc = mul_add_rn(acc, sv[j], x[j]);
    }
    const float u = acc / static_cast<float>(S);
    a.u[i] = u;
    su[tid] = u;
  }
  if (a.frag) {
    __syncthreads();
    hc_u_frags<kStThreads>(su, c, a.frag, a.gsum, tid, warp, lane);
  }
}

bool q4_tiles(const DMatrix& m, int64_t rows, int64_t cols) {
  return expert_q4_ok(m) && m.tiled() && m.rows == rows && m.cols == cols;
}

int g_by_stream = -1;     // set_hc_by_stream; -1: the environment's
int g_by_stream_up = -1;  // set_hc_by_stream_up_smem; -1: the environment's
std::atomic<size_t> g_by_stream_launches{0};

}  // namespace

int hc_by_stream_mode() {
  // Off by default until measured in the step (CK_HC_BY_STREAM=1: mixes without a MoE output to combine;
  // 2: every one-row mix).
  static const int env_mode = env_is("CK_HC_BY_STREAM", "1") ? 1 : env_is("CK_HC_BY_STREAM", "2") ? 2 : 0;
  return g_by_stream < 0 ? env_mode : std::min(g_by_stream, 2);
}
void set_hc_by_stream(int mode) { g_by_stream = mode < 0 ? -1 : mode; }
bool hc_by_stream_up_smem() {
  static const bool on = !env_is("CK_HC_BY_STREAM_UP", "0");
  return g_by_stream_up < 0 ? on : g_by_stream_up > 0;
}
void set_hc_by_stream_up_smem(int on) { g_by_stream_up = on < 0 ? -1 : on > 0; }
size_t hc_by_stream_launches() { return g_by_stream_launches.load(); }

void hc_mix_stream_init() {
  auto set = [](auto k) {
    CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kStMaxDynamicBytes));
  };
  set(hc_mix_stream_kernel<true, false, true>);
  set(hc_mix_stream_kernel<true, true, true>);
  set(hc_mix_stream_kernel<false, false, true>);
  set(hc_mix_stream_kernel<false, true, true>);
  set(hc_mix_stream_kernel<true, false, false>);
  set(hc_mix_stream_kernel<true, true, false>);
  set(hc_mix_stream_kernel<false, false, false>);
  set(hc_mix_stream_kernel<false, true, false>);
}

bool hc_mix_row_by_stream(const HcMixArgs& a, cudaStream_t stream) {
  const int mode = hc_by_stream_mode();
  const bool moe = a.moe_y != nullptr;
  if (mode == 0 || (moe && (mode < 2 || a.moe_k > kFlatCombineSlots)) || a.stamps || !hc_layout_kernels_on()) return false;
  if (a.S < 1 || a.S > kStMaxStreams || a.H % 64 != 0 || a.H / 64 > kStMaxGroups || !a.scratch || !a.barrier) return false;
  const int W = a.S * a.H, lowrank = static_cast<int>(a.down.rows);
  if (lowrank % 64 != 0 || lowrank > kStMaxLowrank || !q4_tiles(a.down, lowrank, W) || !q4_tiles(a.up, W, lowrank) ||
      (a.inject.rows > 0 && (!expert_q4_ok(a.inject) || a.inject.cols != W || a.inject.rows > kStMaxInject)))
    return false;
  HcStreamLaunch L{};
  L.a = a;
  L.lowrank = lowrank;
  L.gps = a.H / 64;
  L.tiles_d = lowrank / 16;
  L.n_work = a.S * L.tiles_d;
  const int blocks = sm_count();
  const int grid = std::max(L.n_work, a.H / 64);
  if (grid > blocks || L.n_work > 32 * kStMaxWorkPerLane || ceil_div(L.gps, L.tiles_d) > kStMaxInjectGroups) return false;
  const bool up_smem = hc_by_stream_up_smem();
  const size_t smem = st_frag_bytes(L.gps, lowrank) + static_cast<size_t>(L.gps) * kTileGroupBytes + (up_smem ? st_up_bytes(a.S, lowrank) : 0) +
                      (a.inject.rows > 0 ? static_cast<size_t>(ceil_div(L.gps, L.tiles_d)) * 4 * 32 * sizeof(uint4) : 0);
  if (smem > static_cast<size_t>(kStMaxDynamicBytes)) return false;
  // Scratch: the streams' partials, the inject partials, 1 / rms (padded), o.
  const size_t need = static_cast<size_t>(a.S) * lowrank + static_cast<size_t>(L.n_work) * 16 + kStMaxStreams + a.H;
  if (a.scratch_floats < need) return false;
  L.part = a.scratch;
  L.ipart = L.part + static_cast<size_t>(a.S) * lowrank;
  L.rinv = L.ipart + static_cast<size_t>(L.n_work) * 16;
  L.o = L.rinv + kStMaxStreams;
  // Its own count (bar[56]): hc_mix.cu's count (bar[48]) runs other grids where the geometry differs.
  L.bar = a.barrier + 8;
  L.wrap_at = count_barrier_wrap(static_cast<unsigned>(grid));
  static const bool narrow = !env_is("CK_HC_NARROW", "0");
  L.leave_early = narrow ? 1 : 0;
  const bool bf16s = a.down.fmt.scale_kind == static_cast<uint8_t>(WKind::BF16) &&
                     a.up.fmt.scale_kind == static_cast<uint8_t>(WKind::BF16) &&
                     (a.inject.rows == 0 || a.inject.fmt.scale_kind == static_cast<uint8_t>(WKind::BF16));
  auto go = [&](auto kernel) { launch(kernel, dim3(grid), kStThreads, smem, stream, L); };
  auto pick = [&](auto up) {
    if (bf16s) moe ? go(hc_mix_stream_kernel<true, true, up()>) : go(hc_mix_stream_kernel<true, false, up()>);
    else moe ? go(hc_mix_stream_kernel<false, true, up()>) : go(hc_mix_stream_kernel<false, false, up()>);
  };
  up_smem ? pick(std::true_type{}) : pick(std::false_type{});
  ++g_by_stream_launches;
  return true;
}

}  // namespace ck::cuda
