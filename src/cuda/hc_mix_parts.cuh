// Device pieces the one-row mix kernels share (hc_mix.cu, hc_mix_stream.cu): the grid barrier as one
// wrapping count, a tile pair's words staged in shared memory before a kernel's wait, a tile's rows from
// its MMA accumulators, and a group's v4 fragments from shared memory.
#pragma once

#include <cstdint>

#include "cuda/common.h"
#include "cuda/count_barrier.h"
#include "cuda/device_ops.cuh"
#include "cuda/mma_q4.cuh"

namespace ck::cuda {

// The 16-row one-row tile at rows row0.. of m over groups [G0, G1) against fragments f (group G at
// f + (G - G0) * 128) and group sums xg: the three column sums (hi, mid, lo) of rows g and g + 8 as
// acc (tc4_one_group's layout). UNROLL groups' loads are issued together.
// TILES (mma_q4.cuh Tc4Rows): m is known to be in tiles.
template <bool BF16S, int UNROLL, bool TILES = false>
__device__ __forceinline__ void hc_tile(const DMatrix& m, int row0, int G0, int G1, const uint2* f, const float* xg,
                                        float (&acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  Tc4Rows<BF16S, 4, TILES> tr;
  tr.init(m, min(row0 + g, static_cast<int>(m.rows) - 1), min(row0 + g + 8, static_cast<int>(m.rows) - 1), t);
#pragma unroll UNROLL
  for (int G = G0; G < G1; ++G)
    tc4_one_group(tr, G, f + static_cast<size_t>(G - G0) * 128 + lane, t == 0 ? xg[G - G0] : 0.0f, acc);
}

// grid_barrier with one atomic on the path: the arrivals count on in bar[48] (its own line after the
// generation's words), wrapping to 0 at wrap_at + 1, a multiple of the grid's blocks, so every launch
// finds it at a multiple of gridDim.x (zeroed at first; every launch on one barrier has the same grid:
// a session's mixes share one S and H). A block's arrival returns old = base + i; the last (i = N - 1)
// leaves at once, the others until the count has left [base, base + N). Why: in grid_barrier the
// waiters wait for the last block's second atomic, after its first returned and a release fence
// drained its reset of the count: about three L2 round trips after the last arrival where this has one
// (CK_HC_COUNT_BARRIER, on by default: one-row decode +1.1%, with the staged pair +1.4%, H100 2026-12-07).
// The arithmetic: cuda/count_barrier.h (tested on the CPU across the wrap).
__device__ __forceinline__ void grid_barrier_count(unsigned* bar, unsigned wrap_at, bool wait) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* cnt = bar + 48;
    unsigned old;
    asm volatile("fence.acq_rel.gpu;" ::: "memory");  // the block's writes (ordered by __syncthreads) first
    asm volatile("atom.inc.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(cnt), "r"(wrap_at) : "memory");
    const unsigned n = gridDim.x, base = count_barrier_base(old, n);
    if (wait && !count_barrier_last(old, n))
      poll_acquire_until(cnt, [&](unsigned v) { return count_barrier_released(v, base, n); });
  }
  __syncthreads();
}

// hc_tile_pair's words and scales for groups [G0, G1), written to shared memory for the warp that runs
// the pair later (hc_tile_pair_staged): word k of group G of lane l at out[(4 (G - G0) + k) 32 + l] (no
// bank conflicts). For a kernel's prologue, before its wait: weights never change. Why: the one-row mix's
// pair with the inject head's tile reads both tiles from L2 after the wait (the inject head is not in
// tiles, so not in the down tiles' copy), a round trip a group on the one warp every block then waits for.
template <bool BF16S>
__device__ __forceinline__ void hc_tile_pair_stage(const DMatrix& ma, int ra, const DMatrix& mb, int rb, int G0, int G1,
                                                   uint4* out) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  Tc4Rows<BF16S> ta, tb;
  ta.init(ma, min(ra + g, static_cast<int>(ma.rows) - 1), min(ra + g + 8, static_cast<int>(ma.rows) - 1), t);
  tb.init(mb, min(rb + g, static_cast<int>(mb.rows) - 1), min(rb + g + 8, static_cast<int>(mb.rows) - 1), t);
#pragma unroll 1
  for (int G = G0; G < G1; ++G) {
    uint2 wa0, wb0, wa1, wb1;
    float s[8];
    ta.load(G, wa0, wb0, s[0], s[1], s[2], s[3]);
    tb.load(G, wa1, wb1, s[4], s[5], s[6], s[7]);
    uint4* o = out + 4 * 32 * (G - G0) + lane;
    o[0] = make_uint4(wa0.x, wa0.y, wb0.x, wb0.y);
    o[32] = make_uint4(wa1.x, wa1.y, wb1.x, wb1.y);
    o[64] = make_uint4(__float_as_uint(s[0]), __float_as_uint(s[1]), __float_as_uint(s[2]), __float_as_uint(s[3]));
    o[96] = make_uint4(__float_as_uint(s[4]), __float_as_uint(s[5]), __float_as_uint(s[6]), __float_as_uint(s[7]));
  }
}

// hc_tile_pair from the words hc_tile_pair_stage wrote (the same lanes' values, the same MMAs in the same
// order: the same bits).
__device__ __forceinline__ void hc_tile_pair_staged(const uint4* in, int n_groups, const uint2* f, const float* xg,
                                                    float (&acc_a)[4], float (&acc_b)[4]) {
  const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll 2
  for (int G = 0; G < n_groups; ++G) {
    const uint4* p = in + 4 * 32 * G + lane;
    const uint4 w0 = p[0], w1 = p[32], s0 = p[64], s1 = p[96];
    const uint2* fg = f + static_cast<size_t>(G) * 128 + lane;
    const float xs = t == 0 ? xg[G] : 0.0f;
    tc4_one_mma(make_uint2(w0.x, w0.y), make_uint2(w0.z, w0.w), __uint_as_float(s0.x), __uint_as_float(s0.y),
                __uint_as_float(s0.z), __uint_as_float(s0.w), fg, xs, acc_a);
    tc4_one_mma(make_uint2(w1.x, w1.y), make_uint2(w1.z, w1.w), __uint_as_float(s1.x), __uint_as_float(s1.y),
                __uint_as_float(s1.z), __uint_as_float(s1.w), fg, xs, acc_b);
  }
}

// Rows g and g + 8 of a tile, (hi + mid) + lo, on lanes t == 0 (columns 0-2 sit on lanes t = 0 and 1).
__device__ __forceinline__ void hc_tile_rows(const float (&acc)[4], float& yg, float& yg8) {
  const float lo0 = __shfl_down_sync(0xffffffffu, acc[0], 1), lo2 = __shfl_down_sync(0xffffffffu, acc[2], 1);
  yg = (acc[0] + acc[1]) + lo0;
  yg8 = (acc[2] + acc[3]) + lo2;
}

// Group fragments and Σ x from 64 floats of shared memory (one warp).
__device__ __forceinline__ void hc_frag(const float* x64, uint2* f, float* gs) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  const float4* xp = reinterpret_cast<const float4*>(x64 + 16 * t);
  const float4 q[4] = {xp[0], xp[1], xp[2], xp[3]};
  const float s = tc4_one_frag(q, f);
  if (lane == 0) *gs = s;
}

// Groups G0, G0 + step, ... (< G1) of one 16-row tile whose Tiles16 words sit in shared memory (group G at
// tile + G x 576 bytes, tile_group_lds), against fragments f (group G at f + 128 G) and group sums xg:
// hc_tile's accumulators. UNROLL as hc_tile's.
template <int UNROLL>
__device__ __forceinline__ void hc_tile_lds(const uint8_t* tile, int G0, int G1, int step, const uint2* f, const float* xg,
                                            float (&acc)[4]) {
  const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll UNROLL
  for (int G = G0; G < G1; G += step) {
    uint2 wa, wb;
    float sa, ba, sb, bb;
    tile_group_lds(tile + static_cast<size_t>(G) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
    tc4_one_mma(wa, wb, sa, ba, sb, bb, f + static_cast<size_t>(G) * 128 + lane, t == 0 ? xg[G] : 0.0f, acc);
  }
}

// u's 64 values of group b (su, shared memory) as compact v4 fragments and group sum for the projections
// that read u (hc_gate_mean_kernel<true>'s layout and rounding). All THREADS threads of the block (tid,
// warp, lane: the caller's, so its registers serve).
template <int THREADS>
__device__ __forceinline__ void hc_u_frags(const float* su, int b, uint2* frag, float* gsum, int tid, int warp, int lane) {
#pragma unroll 1
  for (int e = tid; e < kOneFragWords; e += THREADS) frag[static_cast<size_t>(b) * kOneFragWords + e] = tc4_one_frag_elem(su, e);
  if (warp == 0) {
    const float s = tc4_group_sum(su);
    if (lane == 0) gsum[b] = s;
  }
}

}  // namespace ck::cuda
