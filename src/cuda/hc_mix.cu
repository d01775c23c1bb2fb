// The hyper-connection mix of one decode row in one kernel (spec §4): the deferred combine, the grouped
// input norm, the low-rank down projection with the injection head, silu, the up projection, sigmoid
// and the mean over the streams, plus the v4 fragments of u for the projections that read it.
//
// Why: at one row these were four kernels per mix (combine + norm, down, up, gate mean), each
// latency-bound on ~1.6 MB matrices: 23.5 us of kernel time per mix in Nsight Compute, 33 mixes per
// step of the 16-layer synthetic model. This kernel takes 18.1 us there (docs/performance.md,
// "Seventh session", with the versions that were slower: one 16-block cluster, 27.8 us, too few SMs
// to issue a mix's instructions; a second grid barrier; large unrolled code, whose instruction fetch
// showed in every phase of a kernel that runs each piece of code once).
//
// A deferred MoE output (HcMixArgs::moe_y) is combined from its slots in phase 1, element by element
// (moe_combine_elem: the same bits as moe_combine_kernel), instead of by a kernel of its own before.
//
// Phases (at most one block per SM, all resident: the launch checks one block fits an SM and launches
// no more blocks than SMs, and under programmatic dependent launch the next kernel is only scheduled
// once every block of this one runs; the blocks without work after the barrier leave there):
//  1. Block c takes chunk c of the wide input (cg 64-code groups inside one stream): it applies the
//     deferred combine R += o w_s (and writes R back: each element has one owner), keeps x' = R n
//     (n the norm's scale), its sum of squares, and y_c = down_c x'_c for every down and inject row
//     (a warp's two tiles load together). The norm's 1 / rms is a per-stream factor, so it is applied
//     to the chunks' products after the grid barrier: down X = Σ_c r_s(c) y_c.
//  2. (grid barrier) Each block that has a group of u copies every chunk's y to shared memory and makes
//     all of d: Σ_c r_s(c) y_c in chunk order, silu(y / S), the same bits in every block; block 0 also
//     writes the injection weights 2 sigmoid(y / S). With the exact sums (CK_HC_EXACT_SUM=1, hc_acc_add
//     below), phase 1 also adds each y_c into its stream's fixed-point sums, and phase 2 reads those:
//     Σ_s r_s Y_s.
//  3. Block b takes u's 64-group b: the up rows s H + 64 b + i for every stream, X_s,i = (R_s,i r_s)
//     n_s,i (the CPU's norm formula), u_i = Σ_s sigmoid(g) X / S, and the group's v4 fragments.
// By default (CK_HC_BULK_PARTS=3, kP2BulkAll below) the copy engine moves the bytes: a block's down tiles
// (phase 1) and up tiles (phase 3) into shared memory when it starts, before its wait (weights never
// change), and the chunks' y after the barrier; the threads then read shared memory where they made L2
// round trips (one-row decode +2.0%, H100 2026-12-07). CK_HC_BULK_PARTS=0: the threads' loads.
// Loops that run at most once per thread at the released geometry (a block's 128 elements, its d rows,
// its u group, ...) are not unrolled (#pragma unroll 1): their copies were ~2 KB of the kernel's SASS;
// decode +0.5-1% in one call (H200 2026-12-01 18:30Z, within its spread).
// Arithmetic: the v4 one-row form (mma_q4.cuh: codes exact in bf16, x in three bf16 parts), the CPU's
// formulas for combine, norm, sigmoid, silu and the gate mean, sums in a fixed order (deterministic).
// The down product of the norm differs in rounding from the unfused kernels (r_s applied after the
// product, not to X before it), within the parity tolerances against the CPU reference (tests/parity).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <type_traits>

#include "cuda/bulk_copy.cuh"
#include "cuda/common.h"
#include "cuda/count_barrier.h"
#include "cuda/device_ops.cuh"
#include "cuda/fixed_sum.h"
#include "cuda/layers.h"
#include "cuda/mma_q4.cuh"

namespace ck::cuda {
namespace {

constexpr int kHcThreads = 512, kHcWarps = kHcThreads / 32;
constexpr int kHcMaxStreams = 8;
constexpr int kHcMaxLowrank = 1024;
constexpr int kHcMaxChunkGroups = 16;
constexpr int kHcMaxInject = 16;
constexpr int kHcMaxChunks = 256;
constexpr int kHcMaxPartialBytes = 160 * 1024;  // dynamic shared memory for phase 2
constexpr int kHcMaxDynamicBytes = 200 * 1024;  // and with the up tiles (kP2BulkUp), within 227 KB less the static

struct HcMixLaunch {
  HcMixArgs a;
  int lowrank;
  int cg, n_chunks;      // chunks of cg groups (inside one stream), one per block in phase 1
  int tiles_d, tiles_i;  // 16-row tiles of down and of inject
  float* ss;             // [n_chunks] sums of squares of the combined R per chunk
  float* part;           // [n_chunks][16 (tiles_d + tiles_i)] partial products ((hi + mid) + lo)
  unsigned* bar;         // grid barrier: arrivals (bar[0]), generation (bar[32]); grid_barrier_count's (bar[48])
  int leave_early;       // blocks without phase 2-3 work leave at the barrier (else all wait)
  unsigned wrap_at;      // grid_barrier_count's bound: a multiple of the grid's blocks, less one
  int prefetch;          // ask L2 for the block's weights before pdl_begin (CK_HC_OWN_PREFETCH)
  int norm_prefetch;     // and for its part of the norm's scale (CK_HC_NORM_PREFETCH=0: not)
  int r_prefetch;        // and for its chunk of R and the injection weights w_in (CK_HC_R_PREFETCH=0: not)
  // The exact sums of the partial products (HcMixArgs::acc; nullptr: phase 2 sums the 80 chunks' partials
  // itself, as before): two buffers of acc_words, this mix's chosen by the barrier's generation.
  long long* acc;
  int acc_stride;        // words of one stream's rows in one limb (low rank + one inject tile)
  int acc_words;         // one buffer: kHcAccFlagWords, then limb A and limb B, each S x acc_stride
  float acc_limit;       // a partial at or above this magnitude (or not finite) sends the mix to the fallback
};

// All blocks of the grid arrive here; those that `wait` leave once all have arrived, and then see
// every block's writes before the barrier (read other blocks' data with __ldcg: L1 is not coherent).
// The others leave at once (they have no work after it, and their SM is free for the next kernel's
// blocks sooner). Sense by generation (bar[32], its own line): a block reads the generation before it
// arrives (bar[0]); the last to arrive resets the count and then advances the generation with release
// semantics; the waiting others poll it with acquire loads.
__device__ __forceinline__ void grid_barrier(unsigned* bar, bool wait) {
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned* gen = bar + 32;
    unsigned g0, old;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(g0) : "l"(gen) : "memory");
    asm volatile("fence.acq_rel.gpu;" ::: "memory");  // the block's writes (ordered by __syncthreads) first
    asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], 1;" : "=r"(old) : "l"(bar) : "memory");
    if (old == gridDim.x - 1) {
      asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(bar) : "memory");
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(gen) : "memory");
    } else if (wait) {
      poll_acquire_until(gen, [&](unsigned g) { return g != g0; });  // (traps after seconds)
    }
  }
  __syncthreads();
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

// The exact sums of a row's partial products (HcMixArgs::acc). Why: every consumer block of phase 2 used to
// copy all chunks' partials (80 x 336 floats, 107 KB at the released geometry) and add them in chunk order,
// the same work in 40 blocks. Integer additions do not depend on their order, so the chunks add their
// partials into fixed-point limbs as they finish (cuda/fixed_sum.h), and a consumer reads S x 336 sums.
// The sums are nearer the true sum than the fp32 chain they replace, and the same bits whichever block
// adds first. A partial out of range (or not finite) sets the buffer's flag: the consumers then add the
// chunks' partials (always stored as well) straight from L2, in chunk order (the fp32 chain's bits).
constexpr int kHcAccFlagWords = 16;  // the flag word, padded so the limbs start on a 128-byte line

__device__ __forceinline__ void hc_acc_add(long long* buf, int stride, int S, int s, int j, float v, float limit) {
  if (!(fabsf(v) < limit)) {
    *reinterpret_cast<volatile long long*>(buf) = 1;
    return;
  }
  const FixedParts p = fixed_split(v);
  long long* a = buf + kHcAccFlagWords + s * stride + j;
  atomicAdd(reinterpret_cast<unsigned long long*>(a), static_cast<unsigned long long>(p.hi));
  atomicAdd(reinterpret_cast<unsigned long long*>(a + S * stride), static_cast<unsigned long long>(p.lo));
}

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

// Two tiles (rows ra.. of ma, rb.. of mb) over the same groups, both tiles' loads of a group issued
// before either's products: a warp's two tiles cost one memory round trip per group, not two.
// TILES: both matrices in tiles (an instance without the layout branch, whose loop is unrolled by 2
// so that two groups' loads go out together: hc_layout_kernels_on()).
template <bool BF16S, bool TILES = false>
__device__ __forceinline__ void hc_tile_pair(const DMatrix& ma, int ra, const DMatrix& mb, int rb, int G0, int G1,
                                             const uint2* f, const float* xg, float (&acc_a)[4], float (&acc_b)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  Tc4Rows<BF16S, 4, TILES> ta, tb;
  ta.init(ma, min(ra + g, static_cast<int>(ma.rows) - 1), min(ra + g + 8, static_cast<int>(ma.rows) - 1), t);
  tb.init(mb, min(rb + g, static_cast<int>(mb.rows) - 1), min(rb + g + 8, static_cast<int>(mb.rows) - 1), t);
  auto group = [&](int G) {
    uint2 wa0, wb0, wa1, wb1;
    float s[8];
    ta.load(G, wa0, wb0, s[0], s[1], s[2], s[3]);
    tb.load(G, wa1, wb1, s[4], s[5], s[6], s[7]);
    const uint2* fg = f + static_cast<size_t>(G - G0) * 128 + lane;
    const float xs = t == 0 ? xg[G - G0] : 0.0f;
    tc4_one_mma(wa0, wb0, s[0], s[1], s[2], s[3], fg, xs, acc_a);
    tc4_one_mma(wa1, wb1, s[4], s[5], s[6], s[7], fg, xs, acc_b);
  };
  // (One loop with `#pragma unroll(TILES ? 2 : 1)` would change the branching instance: its loop is
  // left to the compiler's own unrolling.)
  if constexpr (TILES) {
#pragma unroll 2
    for (int G = G0; G < G1; ++G) group(G);
  } else {
    for (int G = G0; G < G1; ++G) group(G);
  }
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

// TILES: the down and up projections in tiles, read by instances without the layout branch (the
// inject head's tiles keep it); hc_layout_kernels_on(), the default (CK_HC_LAYOUT_KERNELS=0: the
// branching instance). Measured 2026-12-01 22:2xZ: one-row decode +1.1 to +1.8% in four interleaved
// rounds (mean +1.35%).
// P2, how phase 2 gets d's sums (template flags, not tests of L: with the exact path's test in the one
// kernel its one-row decode lost ~6%, H200 2026-12-06):
//  kP2Loads: the chunks' partials copied to shared memory by the threads' 16-byte loads, summed in chunk
//            order (nested by stream);
//  kP2Exact: the exact sums (L.acc is set);
//  kP2Bulk:  the same partials copied by the copy engine (one thread's bulk copies, completed through an
//            mbarrier) while the threads make 1 / rms, then summed in one flat loop over the chunks: the
//            same additions in the same order as kP2Loads, so the same bits (CK_HC_BULK_PARTS=1).
//            Why: the loads' loop issues 4 loads and waits for them before their stores, so the 107 KB
//            came in ~4 dependent L2 round trips after the one for the sums of squares.
//  kP2BulkUp: kP2Bulk, and (TILES) the block's tiles of the up projection bulk-copied to shared memory
//            at its start, before its wait (weights never change), so phase 3's tiles read shared memory,
//            not L2, after the barrier (CK_HC_BULK_PARTS=2; the same bits: the same words).
//  kP2BulkAll: kP2BulkUp, and the chunk's groups of the down tiles the same way for phase 1 (the inject
//            head's tile still from L2) (CK_HC_BULK_PARTS=3, the default).
//  kP2LoadsTiles: kP2BulkAll's tiles with kP2Loads' partials (CK_HC_BULK_PARTS=4, to compare).
//  kP2BulkAll4: kP2BulkAll with the flat loop's 1 / rms factors read four at a time (one 16-byte shared
//            load for four chunks instead of four 4-byte loads; CK_HC_BULK_PARTS=5: level, H100 2026-12-07).
//  kP2BulkAllFlat: kP2BulkAll whose phase 1 issues every load of an element at once: a deferred MoE
//            output's slots by moe_combine_elem_flat (k <= 16), the norm's scale and the injection weight
//            with R (the default where it applies; CK_HC_FLAT_COMBINE=0 for kP2BulkAll): one-row decode
//            +2.3% (H200 2026-12-07, three rounds). An instance of its own: the same code as a runtime
//            branch in kP2BulkAll cost it 3.7% at one row (H100 2026-12-07; its instruction fetch).
//  kP2BulkAllStaged: kP2BulkAllFlat, and the tile pair with the inject head's tile (one warp's) staged
//            in shared memory before the wait by the block's last warp (hc_tile_pair_stage), so no warp
//            of phase 1 reads a weight from L2 after the wait (CK_HC_STAGED_PAIR, on: +1.0% at one row,
//            H100 2026-12-07; its stamps' "fragments + down tiles" 4.9k -> 3.0k cycles, median block).
//  kP2FlatCount, kP2StagedCount: kP2BulkAllFlat and kP2BulkAllStaged with grid_barrier_count
//            (CK_HC_COUNT_BARRIER, on: kP2StagedCount is the default where it applies).
//  kP2CutAfterBarrier, kP2CutBeforeBarrier: measuring only, never for results (CK_HC_CUT=1 / 2, like
//            CK_HOLLOW): kP2StagedCount whose blocks all leave after the grid barrier (no phases 2-3),
//            or after phase 1 without the barrier; u and w are not written. A step's time with a cut
//            against without is what the cut pieces cost inside the step, where the stamps say only
//            what they cost inside the kernel.
enum { kP2Loads = 0, kP2Exact = 1, kP2Bulk = 2, kP2BulkUp = 3, kP2BulkAll = 4, kP2LoadsTiles = 5, kP2BulkAll4 = 6,
       kP2BulkAllFlat = 7, kP2BulkAllStaged = 8, kP2FlatCount = 9, kP2StagedCount = 10, kP2CutAfterBarrier = 11,
       kP2CutBeforeBarrier = 12 };
// The measuring cuts (kernel and launch).
__host__ __device__ constexpr bool p2_cut(int p2) { return p2 == kP2CutAfterBarrier || p2 == kP2CutBeforeBarrier; }
// The forms with the inject head's tile pair staged before the wait (kernel and launch).
__host__ __device__ constexpr bool p2_staged_pair(int p2) {
  return p2 == kP2BulkAllStaged || p2 == kP2StagedCount || p2_cut(p2);
}
// The forms whose partials come by bulk copies (kernel and launch).
__host__ __device__ constexpr bool p2_bulk_partials(int p2) {
  return p2 == kP2Bulk || p2 == kP2BulkUp || p2 == kP2BulkAll || p2 == kP2BulkAll4 || p2 == kP2BulkAllFlat ||
         p2 == kP2FlatCount || p2_staged_pair(p2);
}
// Bytes of a consumer block's up tiles: S streams x 4 tiles x the low rank's groups (one stream's 4 tiles
// contiguous), after the partials in dynamic shared memory (the launch; the kernel writes it out).
__host__ __device__ constexpr size_t hc_up_tile_bytes(int S, int lowrank) {
  return static_cast<size_t>(S) * 4 * (lowrank / 64) * kTileGroupBytes;
}
template <bool BF16S, bool TILES, int P2>
__global__ void __launch_bounds__(kHcThreads, 1) hc_mix_row_kernel(const __grid_constant__ HcMixLaunch L) {
  constexpr bool EXACT = P2 == kP2Exact, BULK = p2_bulk_partials(P2);
  constexpr bool UP_SMEM = TILES && P2 >= kP2BulkUp, DOWN_SMEM = TILES && P2 >= kP2BulkAll;
  constexpr bool CUT = p2_cut(P2);
  constexpr bool COUNT = P2 == kP2FlatCount || P2 == kP2StagedCount || CUT;
  constexpr bool STAGED = p2_staged_pair(P2);
  constexpr bool FLAT = P2 == kP2BulkAllFlat || STAGED || COUNT;
  __shared__ __align__(16) uint2 frag[kHcMaxChunkGroups * 128];  // fragments: phase 1 of x', then of d
  __shared__ __align__(16) float xs[kHcMaxLowrank];              // phase 1: x' = R n of the chunk; then d
  __shared__ float xg[kHcMaxChunkGroups], gl[kHcMaxStreams][64], su[64], rinv[kHcMaxStreams], scratch[32];
  __shared__ __align__(16) float sss[kHcMaxChunks];
  extern __shared__ __align__(16) float sp[];  // phase 2: every chunk's partial products
  __shared__ __align__(8) uint64_t parts_bar;  // kP2Bulk: the partials' copies have landed
  __shared__ __align__(8) uint64_t up_bar;     // UP_SMEM: the up projection's tiles have landed
  __shared__ __align__(8) uint64_t down_bar;   // DOWN_SMEM: the down projection's tiles have landed
  const HcMixArgs& a = L.a;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int S = a.S, H = a.H, lowrank = L.lowrank, cg = L.cg, td = L.tiles_d + L.tiles_i;
  const int c = blockIdx.x;
  // UP_SMEM: the block's up tiles (S streams x 4 tiles x the low rank's groups, 576 bytes each) after the
  // partials in dynamic shared memory (the launch checks they fit and that a block has one u group).
  // DOWN_SMEM: then the chunk's groups of the down tiles (tiles_d x cg x 576 bytes).
  uint8_t* const up_tiles = reinterpret_cast<uint8_t*>(sp + static_cast<size_t>(L.n_chunks) * td * 16);
  // (hc_up_tile_bytes(S, lowrank) written out: the call compiled to other SASS than this measured form)
  uint8_t* const down_tiles = up_tiles + static_cast<size_t>(S) * 4 * (lowrank / 64) * kTileGroupBytes;
  // STAGED: then the pair with the inject head's tile, cg x 2 KB (hc_tile_pair_stage's layout).
  uint4* const staged = reinterpret_cast<uint4*>(down_tiles + static_cast<size_t>(L.tiles_d) * cg * kTileGroupBytes);
  if ((BULK || UP_SMEM) && tid == 0) {  // (phase 1's block sum and the grid barrier synchronise before use)
    if (BULK) mbar_init(&parts_bar, 1);
    if (UP_SMEM) mbar_init(&up_bar, 1);
    if (DOWN_SMEM) mbar_init(&down_bar, 1);
    mbar_init_fence();
    if (DOWN_SMEM && c < L.n_chunks) {
      const uint32_t tile_bytes = static_cast<uint32_t>(cg) * kTileGroupBytes;  // a tile's groups, contiguous
      mbar_arrive_expect(&down_bar, tile_bytes * L.tiles_d);
      for (int tl = 0; tl < L.tiles_d; ++tl)
        bulk_copy_1d(down_tiles + tl * tile_bytes, a.down.tile_group(tl, c * cg), tile_bytes, &down_bar);
    }
    if (UP_SMEM && static_cast<int>(blockIdx.x) < H / 64) {
      const uint32_t stream_bytes = 4u * (lowrank / 64) * kTileGroupBytes;  // hc_up_tile_bytes(1, lowrank)
      mbar_arrive_expect(&up_bar, stream_bytes * S);
      for (int s = 0; s < S; ++s)
        bulk_copy_1d(up_tiles + s * stream_bytes, a.up.tile_group((static_cast<size_t>(s) * H + 64 * blockIdx.x) / kTileRows, 0),
                     stream_bytes, &up_bar);
    }
  }

  // Debug timing (HcMixArgs::stamps, kHcStampWords per block): the entry time, then SM cycles per piece.
  const bool stamp = a.stamps != nullptr && tid == 0;
  unsigned long long* st = stamp ? a.stamps + kHcStampWords * blockIdx.x : nullptr;
  long long last = 0;
  if (stamp) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(st[0]));
    last = clock64();
  }
  auto mark = [&](int k) {
    if (stamp) {
      const long long now = clock64();
      st[k] = static_cast<unsigned long long>(now - last);
      last = now;
    }
  };

  // Weights never change: ask L2 for this block's shares (phases 1 and 3) while the kernel before runs.
  if (c < L.n_chunks && L.prefetch) {
    const int G0 = c * cg;
    const int first = a.down.tiled() ? a.down.rows : 0;  // tiled: a thread per tile, its groups contiguous
    if (a.down.tiled())  // (DOWN_SMEM too: the tile paired with the inject head's is read from L2)
      for (int tl = tid; tl < a.down.rows / kTileRows; tl += kHcThreads)
        prefetch_l2(a.down.tile_group(tl, G0), cg * kTileGroupBytes);
    for (int r = first + tid; r < a.down.rows + a.inject.rows; r += kHcThreads) {
      const DMatrix& m = r < a.down.rows ? a.down : a.inject;
      const int row = r < a.down.rows ? r : r - a.down.rows;
      prefetch_l2(m.data + static_cast<size_t>(row) * (m.cols / 2) + G0 * 32, cg * 32);
      const int gpr = m.cols / m.fmt.group, es = wkind_bytes(m.fmt.scale_kind), gshift = __ffs(m.fmt.group / 64) - 1;
      const size_t si = (static_cast<size_t>(row) * gpr + (G0 >> gshift)) * es;
      prefetch_l2(m.scales + si, es);
      prefetch_l2(m.biases + si, es);
    }
  }
  if (blockIdx.x < H / 64 && L.prefetch && !UP_SMEM) {
    const DMatrix& m = a.up;
    const int gpr = m.cols / m.fmt.group, es = wkind_bytes(m.fmt.scale_kind);
    for (int s = warp; s < S; s += kHcWarps) {  // a warp per stream: 64 contiguous rows
      const size_t r0 = static_cast<size_t>(s) * H + 64 * blockIdx.x;
      // (Tiled: the rows' 4 tiles are 4 x groups x 576 contiguous bytes, codes, scales and biases.)
      const size_t code_bytes = m.tiled() ? 4 * (m.cols / 64) * kTileGroupBytes : 64 * m.cols / 2;
      const uint8_t* start = m.tiled() ? m.tile_group(r0 / kTileRows, 0) : m.data + r0 * (m.cols / 2);
      for (int off = 128 * lane; off < static_cast<int>(code_bytes); off += 32 * 128) prefetch_l2(start + off, 1);
      if (m.tiled()) continue;
      for (int off = 128 * lane; off < 64 * gpr * es; off += 32 * 128) {
        prefetch_l2(m.scales + r0 * gpr * es + off, 1);
        prefetch_l2(m.biases + r0 * gpr * es + off, 1);
      }
    }
  }
  // The norm's scale (40 KB a mix at the released geometry): phase 1 reads the chunk's part, phase 3
  // its u group's in every stream. Like the weights, out of L2 again after a step's 1.5 GB.
  if (L.norm_prefetch && tid < 32) {
    const uint8_t* nb = reinterpret_cast<const uint8_t*>(a.norm);
    if (c < L.n_chunks && tid * 128 < cg * 64 * 4) prefetch_l2(nb + static_cast<size_t>(c) * cg * 256 + tid * 128, 1);
    if (blockIdx.x < H / 64 && tid < 2 * S)
      prefetch_l2(nb + (static_cast<size_t>(tid >> 1) * H + 64 * blockIdx.x) * 4 + (tid & 1) * 128, 1);
  }
  // The residual's chunk and the injection weights: written by the mix before this one, many kernels
  // back, and out of L2 since then (a step's 1.5 GB of weights pass through it). Phase 1 reads them
  // beside o (or the MoE slots), which the kernel just before wrote and L2 still holds: the DRAM round
  // trip of R was the longer of the two. A prefetch only moves lines into L2, the point of coherence,
  // so it is safe where the kernel before did write R (the MTP step's first mix): the read after the
  // wait sees that kernel's value.
  if (L.r_prefetch && c < L.n_chunks && tid < 32) {
    const uint8_t* rb = reinterpret_cast<const uint8_t*>(a.R + static_cast<size_t>(c) * cg * 64);
    if (tid * 128 < cg * 64 * 4) prefetch_l2(rb + tid * 128);
    if (tid == 31 && a.w_in) prefetch_l2(a.w_in);
  }
  // STAGED: the warp whose pair holds the inject head's tile (tiles_d, the only one: at most 16 inject
  // rows) is warp tiles_d mod 16 (the loop in phase 1); the block's last warp, which has none of phase
  // 1's elements at the released geometry (128 a chunk), stages that pair's words before its wait.
  const int stage_warp = STAGED && L.tiles_i > 0 ? L.tiles_d % kHcWarps : -1;
  auto mat = [&](int x) -> const DMatrix& { return x >= L.tiles_d ? a.inject : a.down; };
  auto row = [&](int x) { return 16 * (x >= L.tiles_d ? x - L.tiles_d : x); };
  auto pair_of = [&](int tile) { return tile + kHcWarps < td ? tile + kHcWarps : tile; };
  if (STAGED && stage_warp >= 0 && c < L.n_chunks && warp == kHcWarps - 1) {
    const int tb = pair_of(stage_warp);
    hc_tile_pair_stage<BF16S>(mat(stage_warp), row(stage_warp), mat(tb), row(tb), c * cg, (c + 1) * cg, staged);
  }
  pdl_begin();  // R, o and w come from the kernels before
  mark(1);
  // This mix's accumulators: the buffer of the barrier's generation parity (the generation advances once a
  // mix, at its barrier, after every block has read it here). The other buffer is the previous mix's, whose
  // readers are done (it ran before this kernel's wait): zero it for the next mix.
  long long* accum = nullptr;
  if (EXACT) {
    const unsigned gen = __ldcg(L.bar + 32);
    accum = L.acc + static_cast<size_t>(gen & 1u) * L.acc_words;
    long long* next = L.acc + static_cast<size_t>((gen & 1u) ^ 1u) * L.acc_words;
#pragma unroll 1
    for (int w = blockIdx.x * kHcThreads + tid; w < L.acc_words; w += gridDim.x * kHcThreads) next[w] = 0;
  }

  // 1. The chunk: combine, x' = R n, sum of squares, partial products of down and inject.
  if (c < L.n_chunks) {
    const int k0 = c * cg * 64, n = cg * 64, s = k0 / H;
    const float gamma = a.moe_y && !FLAT ? sigmoidf_(a.moe_gl[0]) : 0.0f;
    float sq = 0.0f;
#pragma unroll 1
    for (int e = tid; e < n; e += kHcThreads) {
      const int k = k0 + e;
      // FLAT: the norm's scale and the injection weight are loaded first. Read where they are used, the
      // norm's load waits for the store to R (they might alias) and the weight's for the combine: two
      // more round trips to L2 after the inputs' (SASS, 2026-12-07).
      float nk = 0.0f, w = 0.0f;
      if constexpr (FLAT) nk = a.norm[k], w = a.o || a.moe_y ? a.w_in[s] : 0.0f;
      float v = a.R[k];
      if (a.o || a.moe_y) {
        const float o = FLAT && a.moe_y ? moe_combine_elem_flat(a.moe_y, a.moe_ldy, a.moe_pairs, a.moe_k, a.moe_gl, k - s * H)
                        : a.moe_y       ? moe_combine_elem(a.moe_y, a.moe_ldy, a.moe_pairs, a.moe_k, gamma, k - s * H)
                                        : a.o[k - s * H];
        v = mul_add_rn(v, o, FLAT ? w : a.w_in[s]);
        a.R[k] = v;
      }
      sq += v * v;
      xs[e] = v * (FLAT ? nk : a.norm[k]);
    }
    sq = block_sum(sq, scratch);  // synchronises: xs is complete
    if (tid == 0) L.ss[c] = sq;
    mark(2);
#pragma unroll 1
    for (int G = warp; G < cg; G += kHcWarps) hc_frag(xs + 64 * G, frag + G * 128, xg + G);
    __syncthreads();
    // Tiles w and w + 16 of warp w together (td <= 2 kHcWarps, checked at launch). A warp with one
    // tile runs the pair on it twice and stores it once: a one-tile branch would add code to a kernel
    // whose instruction fetch shows (not measured; docs/performance.md "Seventh session").
    for (int tile = warp; tile < td && tile < kHcWarps; tile += 2 * kHcWarps) {
      const int tb = pair_of(tile);
      float acc_a[4] = {}, acc_b[4] = {};
      if (STAGED && tile == stage_warp) {  // (the block's syncs since the staging: phase 1's block sum)
        hc_tile_pair_staged(staged, cg, frag, xg, acc_a, acc_b);
      } else if (DOWN_SMEM && tb < L.tiles_d) {  // hc_tile_pair's words and products, from the copy: the same bits
        mbar_wait(&down_bar, 0);
        mark(3);  // (thread 0: its fragments, the block sync, and the wait for the chunk's down tiles)
        const uint8_t* ta = down_tiles + static_cast<size_t>(tile) * cg * kTileGroupBytes;
        const uint8_t* tbp = down_tiles + static_cast<size_t>(tb) * cg * kTileGroupBytes;
#pragma unroll 2
        for (int G = 0; G < cg; ++G) {
          uint2 wa0, wb0, wa1, wb1;
          float sc[8];
          tile_group_lds(ta + G * kTileGroupBytes, lane, wa0, wb0, sc[0], sc[1], sc[2], sc[3]);
          tile_group_lds(tbp + G * kTileGroupBytes, lane, wa1, wb1, sc[4], sc[5], sc[6], sc[7]);
          const uint2* fg = frag + G * 128 + lane;
          const float xsg = t == 0 ? xg[G] : 0.0f;
          tc4_one_mma(wa0, wb0, sc[0], sc[1], sc[2], sc[3], fg, xsg, acc_a);
          tc4_one_mma(wa1, wb1, sc[4], sc[5], sc[6], sc[7], fg, xsg, acc_b);
        }
      } else if constexpr (!STAGED) {  // (STAGED: every other pair is two down tiles, above)
        if (TILES && tb < L.tiles_d)  // (tile < tb: both down tiles)
          hc_tile_pair<BF16S, TILES>(a.down, row(tile), a.down, row(tb), c * cg, (c + 1) * cg, frag, xg, acc_a, acc_b);
        else
          hc_tile_pair<BF16S>(mat(tile), row(tile), mat(tb), row(tb), c * cg, (c + 1) * cg, frag, xg, acc_a, acc_b);
      }
      float y0, y1;
      hc_tile_rows(acc_a, y0, y1);
      float* p = L.part + static_cast<size_t>(c) * td * 16;
      // Rows of this chunk's stream that exist (an inject tile's rows past inject.rows are clamped copies).
      const int s = c * cg * 64 / H;
      auto add = [&](int j, float v) {
        if (j < 16 * L.tiles_d || j - 16 * L.tiles_d < a.inject.rows) hc_acc_add(accum, L.acc_stride, S, s, j, v, L.acc_limit);
      };
      // (Spreading a row pair's four additions over its four lanes measured level: H100 2026-12-07.)
      if (t == 0) {
        p[16 * tile + g] = y0;
        p[16 * tile + g + 8] = y1;
        if (EXACT) add(16 * tile + g, y0), add(16 * tile + g + 8, y1);
      }
      hc_tile_rows(acc_b, y0, y1);
      if (t == 0 && tb != tile) {
        p[16 * tb + g] = y0;
        p[16 * tb + g + 8] = y1;
        if (EXACT) add(16 * tb + g, y0), add(16 * tb + g + 8, y1);
      }
    }
  }
  // A block must not leave with copies into its shared memory in flight: a geometry where no warp's tile
  // pair is two down tiles would not have waited above.
  if (DOWN_SMEM && c < L.n_chunks && tid == 0) mbar_wait(&down_bar, 0);
  mark(4);
  // Only the blocks of u's groups have work after the barrier (phases 2 and 3).
  const bool consumer = static_cast<int>(blockIdx.x) < H / 64;
  if constexpr (CUT) {  // (measuring: the up tiles' copies land before the block leaves)
    if (P2 == kP2CutAfterBarrier) grid_barrier_count(L.bar, L.wrap_at, consumer || !L.leave_early);
    if (consumer && tid == 0) mbar_wait(&up_bar, 0);
    return;
  }
  if constexpr (COUNT) grid_barrier_count(L.bar, L.wrap_at, consumer || !L.leave_early);
  else grid_barrier(L.bar, consumer || !L.leave_early);
  if (!consumer && L.leave_early) {
    if (stamp)
      for (int k = 5; k < kHcStampWords; ++k) st[k] = 0;  // pieces this block does not run
    return;
  }
  mark(5);
  // kP2Bulk: the copy engine brings every chunk's partials while the threads make 1 / rms below. Thread 0
  // acquired the other blocks' partials at the barrier; the proxy fence orders the copies (the async
  // proxy) after that.
  if (BULK && tid == 0) {
    const uint32_t bytes = static_cast<uint32_t>(sizeof(float)) * L.n_chunks * td * 16;  // a multiple of 64
    asm volatile("fence.proxy.async.global;" ::: "memory");
    mbar_arrive_expect(&parts_bar, bytes);
    constexpr uint32_t kPiece = 16384;
    for (uint32_t off = 0; off < bytes; off += kPiece)
      bulk_copy_1d(reinterpret_cast<uint8_t*>(sp) + off, reinterpret_cast<const uint8_t*>(L.part) + off,
                   min(kPiece, bytes - off), &parts_bar);
  }

  // 1 / rms per stream: its chunks' sums of squares in chunk order (every block, for phases 2 and 3).
  // With accumulators, their sums (and the flag) come in the same round trip, to sp as S x 16 td floats.
  const int cps = H / (64 * cg);  // chunks per stream
  if (tid < L.n_chunks) sss[tid] = __ldcg(L.ss + tid);  // one round trip for all
  bool exact = false;
  if (EXACT) {
    // Every limb a thread needs is asked for before any is used: one round trip (4 x 336 sums over 512
    // threads at the released geometry: three pairs a thread).
    exact = __ldcg(accum) == 0;
    const int per = 16 * td;
    constexpr int kU = 4;
#pragma unroll 1
    for (int e0 = tid; e0 < S * per; e0 += kU * kHcThreads) {
      long long A[kU], B[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int e = e0 + u * kHcThreads;
        const long long* p = accum + kHcAccFlagWords + (e / per) * L.acc_stride + e % per;
        A[u] = e < S * per ? __ldcg(p) : 0;
        B[u] = e < S * per ? __ldcg(p + S * L.acc_stride) : 0;
      }
#pragma unroll
      for (int u = 0; u < kU; ++u)
        if (e0 + u * kHcThreads < S * per) sp[e0 + u * kHcThreads] = fixed_value(A[u], B[u]);
    }
  }
  __syncthreads();
  if (tid < S) {
    float tot = 0.0f;
    for (int k = 0; k < cps; ++k) tot += sss[tid * cps + k];
    rinv[tid] = 1.0f / sqrtf(tot / static_cast<float>(H) + a.eps);  // rmsnorm_wide_tail's formula
  }
  __syncthreads();

  // 2. Rows j of down (and inject): Σ_c r_s(c) y_c in chunk order, then silu(y / S) (2 sigmoid(y / S)
  // for inject). Every block that needs d makes all of it (the same bits everywhere): cheaper than a
  // second grid barrier. The partials come to shared memory in one round trip of 16-byte loads.
  const int ngd = lowrank / 64;
  if (static_cast<int>(blockIdx.x) < H / 64) {
    if (BULK) {
      if (tid < L.n_chunks) sss[tid] = rinv[tid / cps];  // each chunk's 1 / rms, for the flat loop below
      mbar_wait(&parts_bar, 0);
      __syncthreads();
    } else if (!EXACT) {
      const int n4 = L.n_chunks * td * 4;
      const float4* src = reinterpret_cast<const float4*>(L.part);
      float4* dst = reinterpret_cast<float4*>(sp);
#pragma unroll 4
      for (int e = tid; e < n4; e += kHcThreads) dst[e] = __ldcg(src + e);
      __syncthreads();
    }
    mark(6);
#pragma unroll 1
    for (int j = tid; j < 16 * td; j += kHcThreads) {
      float v = 0.0f;
      if (exact) {
        for (int s = 0; s < S; ++s) v += sp[s * td * 16 + j] * rinv[s];
      } else if (BULK) {
        // kP2Loads' additions in its order, in one loop over the chunks: the unrolled shared loads run on
        // across a stream's end (in the nested loop each stream's loads waited for the last one's sums).
        int k = 0;
        if (P2 == kP2BulkAll4) {  // the same additions, the factors of four chunks in one load
#pragma unroll 4
          for (; k + 4 <= L.n_chunks; k += 4) {
            const float4 r = *reinterpret_cast<const float4*>(sss + k);
            v += sp[k * td * 16 + j] * r.x;
            v += sp[(k + 1) * td * 16 + j] * r.y;
            v += sp[(k + 2) * td * 16 + j] * r.z;
            v += sp[(k + 3) * td * 16 + j] * r.w;
          }
        }
#pragma unroll 16
        for (; k < L.n_chunks; ++k) v += sp[k * td * 16 + j] * sss[k];
      } else {  // the chunks' partials in chunk order: copied to sp above, or (the fallback) from L2
#pragma unroll 1
        for (int s = 0, k = 0; s < S; ++s)
          for (int e = 0; e < cps; ++e, ++k)
            v += (EXACT ? __ldcg(L.part + static_cast<size_t>(k) * td * 16 + j) : sp[k * td * 16 + j]) * rinv[s];
      }
      if (j < lowrank) xs[j] = apply_epilogue(v, Epilogue::SiluDiv, static_cast<float>(S));  // trap 4: divide first
      else if (blockIdx.x == 0 && j >= 16 * L.tiles_d && j - 16 * L.tiles_d < a.inject.rows)
        a.w_out[j - 16 * L.tiles_d] = apply_epilogue(v, Epilogue::TwoSigmoidDiv, static_cast<float>(S));
    }
    __syncthreads();
#pragma unroll 1
    for (int G = warp; G < ngd; G += kHcWarps) hc_frag(xs + 64 * G, frag + G * 128, xg + G);
    __syncthreads();
    mark(7);
  }
#pragma unroll 1
  for (int b = blockIdx.x; b < H / 64; b += gridDim.x) {
    if (UP_SMEM) mbar_wait(&up_bar, 0);  // (long done: asked for at the kernel's start)
#pragma unroll 1
    for (int it = warp; it < 4 * S; it += kHcWarps) {  // (stream, 16-row tile)
      const int s = it >> 2, r0 = 16 * (it & 3);
      float acc[4] = {};
      if (UP_SMEM) {  // Tc4Rows' words for tiles, from the copy: the same bits
        const uint8_t* tile = up_tiles + static_cast<size_t>(it) * ngd * kTileGroupBytes;
#pragma unroll 2
        for (int G = 0; G < ngd; ++G) {
          uint2 wa, wb;
          float sa, ba, sb, bb;
          tile_group_lds(tile + G * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
          tc4_one_mma(wa, wb, sa, ba, sb, bb, frag + G * 128 + lane, t == 0 ? xg[G] : 0.0f, acc);
        }
      } else {
        hc_tile<BF16S, 2, TILES>(a.up, s * H + 64 * b + r0, 0, ngd, frag, xg, acc);
      }
      float y0, y1;
      hc_tile_rows(acc, y0, y1);
      if (t == 0) {
        gl[s][r0 + g] = y0;
        gl[s][r0 + g + 8] = y1;
      }
    }
    __syncthreads();
    mark(8);
    if (tid < 64) {  // hc_gate_mean_kernel's order
      const int i = 64 * b + tid;
      float acc = 0.0f;
      // Four streams at once: their R loads, then their sigmoids. One stream at a time, each sigmoid's
      // division (a branch region of its own) kept the next stream's load behind it: four round trips
      // and four ~24-instruction chains in a row, in every mix's tail. One-row decode +1.8% (H100,
      // 2026-12-06, one call against the build before; docs/roofline-cuda.md "Fiftieth session").
      for (int s0 = 0; s0 < S; s0 += 4) {
        float x[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int k = (s0 + j) * H + i;
          x[j] = s0 + j < S ? (__ldcg(a.R + k) * rinv[s0 + j]) * a.norm[k] : 0.0f;
        }
        // sigmoid4_: sigmoidf_'s bits, the four chains interleaved
        const float4 sg = sigmoid4_(make_float4(gl[s0][tid], s0 + 1 < S ? gl[s0 + 1][tid] : 0.0f,
                                                s0 + 2 < S ? gl[s0 + 2][tid] : 0.0f, s0 + 3 < S ? gl[s0 + 3][tid] : 0.0f));
        const float sv[4] = {sg.x, sg.y, sg.z, sg.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (s0 + j < S) acc = mul_add_rn(acc, sv[j], x[j]);
      }
      const float v = acc / static_cast<float>(S);
      a.u[i] = v;
      su[tid] = v;
    }
    if (a.frag) {  // u's compact v4 fragments and group sum (hc_gate_mean_kernel<true>'s layout and rounding)
      __syncthreads();
#pragma unroll 1
      for (int e = tid; e < kOneFragWords; e += kHcThreads)
        a.frag[static_cast<size_t>(b) * kOneFragWords + e] = tc4_one_frag_elem(su, e);
      if (warp == 0) {
        const float s = tc4_group_sum(su);
        if (lane == 0) a.gsum[b] = s;
      }
    }
    __syncthreads();  // gl and su are reused by the next group
    mark(9);
  }
}

// 4-bit codes in groups of 64 x 2^k (ops.h expert_q4_ok: Tc4Rows finds a scale group by a shift), of
// the given shape.
bool q4_suits(const DMatrix& m, int64_t rows, int64_t cols) { return expert_q4_ok(m) && m.rows == rows && m.cols == cols; }

}  // namespace

void hc_mix_init() {
  auto set = [](auto k) {
    CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kHcMaxDynamicBytes));
  };
  auto each_p2 = [&](auto bf16s, auto tiles) {
    set(hc_mix_row_kernel<bf16s(), tiles(), kP2Loads>);
    set(hc_mix_row_kernel<bf16s(), tiles(), kP2Exact>);
    set(hc_mix_row_kernel<bf16s(), tiles(), kP2Bulk>);
    if constexpr (tiles()) {  // (the up and down tiles' copies need tiles)
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2BulkUp>);
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2BulkAll>);
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2LoadsTiles>);
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2BulkAll4>);
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2BulkAllFlat>);
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2BulkAllStaged>);
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2FlatCount>);
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2StagedCount>);
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2CutAfterBarrier>);
      set(hc_mix_row_kernel<bf16s(), tiles(), kP2CutBeforeBarrier>);
    }
  };
  using T = std::true_type;
  using F = std::false_type;
  each_p2(T{}, T{}), each_p2(T{}, F{}), each_p2(F{}, T{}), each_p2(F{}, F{});
}

namespace {
int g_hc_exact_sum = -1;  // set_hc_exact_sum; -1: the environment's
std::atomic<size_t> g_hc_exact_launches{0};
// One buffer of the exact sums: the flag's words, then limbs A and B of S x (low rank + an inject tile).
size_t hc_acc_buffer_words(int S, int lowrank) {
  return kHcAccFlagWords + 2 * static_cast<size_t>(S) * (lowrank + kHcMaxInject);
}
}  // namespace

size_t hc_exact_sum_launches() { return g_hc_exact_launches.load(); }

int hc_exact_sum_mode() {
  // Off by default: measured slower in the step than the chunk-order kernel (H100 2026-12-07: 617.7-619.1
  // against 628.1-629.2 tok/s at one row; H200 661.3 / 651.8 against 673.1 for the build before it):
  // the reductions cost phase 1 more than the sums save phase 2 (docs/roofline-cuda.md, fifty-fourth session).
  static const int env_mode = env_is("CK_HC_EXACT_SUM", "1") ? 1 : env_is("CK_HC_EXACT_SUM", "2") ? 2 : 0;
  return g_hc_exact_sum < 0 ? env_mode : g_hc_exact_sum;
}
void set_hc_exact_sum(int mode) { g_hc_exact_sum = mode < 0 ? -1 : std::min(mode, 2); }

namespace {
int g_hc_bulk_parts = -1;  // set_hc_bulk_parts; -1: the environment's
std::atomic<size_t> g_hc_bulk_launches{0}, g_hc_bulk_up_launches{0}, g_hc_bulk_down_launches{0};
}  // namespace
size_t hc_bulk_parts_launches() { return g_hc_bulk_launches.load(); }
size_t hc_bulk_up_launches() { return g_hc_bulk_up_launches.load(); }
size_t hc_bulk_down_launches() { return g_hc_bulk_down_launches.load(); }
int hc_bulk_parts_mode() {
  // 3 by default: one-row decode +2.0% against 0 (H100 2026-12-07, three interleaved rounds: 639.1-644.4
  // against 627.2-631.3 tok/s); 1 lost 0.7% and 2 gained 1.0% in the same call (docs/roofline-cuda.md,
  // "Fifty-fifth session"). CK_HC_BULK_PARTS=0 / 1 / 2 / 4 to compare.
  static const int env_mode = [] {
    const char* v = std::getenv("CK_HC_BULK_PARTS");
    return v && v[0] >= '0' && v[0] <= '5' && v[1] == 0 ? v[0] - '0' : 3;
  }();
  return g_hc_bulk_parts < 0 ? env_mode : g_hc_bulk_parts;
}
void set_hc_bulk_parts(int mode) { g_hc_bulk_parts = mode < 0 ? -1 : std::min(mode, 5); }

namespace {
// A form of the one-row mix chosen by a variable (on by default unless `opt_in`: then only with it set
// to 1; off with 0), or where a test sets it (set(-1): the environment's again), and the launches that
// took it, for tests.
class HcSwitch {
 public:
  HcSwitch(const char* env, bool opt_in) : env_on_(opt_in ? env_is(env, "1") : !env_is(env, "0")) {}
  bool on() const { return forced_ < 0 ? env_on_ : forced_ > 0; }
  void set(int on) { forced_ = on < 0 ? -1 : on > 0; }
  void count() { ++launches_; }
  size_t launches() const { return launches_.load(); }

 private:
  bool env_on_;
  int forced_ = -1;
  std::atomic<size_t> launches_{0};
};
// On by default: one-row decode +2.3% against kP2BulkAll (H200 2026-12-07, three interleaved rounds:
// 708.6-709.9 against 692.8-694.2 tok/s; H100 +3.1%). CK_HC_FLAT_COMBINE=0 to compare.
HcSwitch g_hc_flat_combine("CK_HC_FLAT_COMBINE", false);
// On by default, both: one-row decode +1.4% against the flat form (H100 2026-12-07, three interleaved
// rounds: 661.6-671.0 against 654.9-658.8 tok/s; each alone +1.0% and +1.1%). =0 to compare.
HcSwitch g_hc_staged_pair("CK_HC_STAGED_PAIR", false);
HcSwitch g_hc_count_barrier("CK_HC_COUNT_BARRIER", false);
}  // namespace
bool hc_flat_combine_on() { return g_hc_flat_combine.on(); }
void set_hc_flat_combine(int on) { g_hc_flat_combine.set(on); }
size_t hc_flat_combine_launches() { return g_hc_flat_combine.launches(); }
bool hc_staged_pair_on() { return g_hc_staged_pair.on(); }
void set_hc_staged_pair(int on) { g_hc_staged_pair.set(on); }
size_t hc_staged_pair_launches() { return g_hc_staged_pair.launches(); }
bool hc_count_barrier_on() { return g_hc_count_barrier.on(); }
void set_hc_count_barrier(int on) { g_hc_count_barrier.set(on); }
size_t hc_count_barrier_launches() { return g_hc_count_barrier.launches(); }

namespace {
int g_hc_chunk_groups = -1;  // set_hc_chunk_groups; -1: the environment's
std::atomic<size_t> g_hc_chunk_group_launches{0};
}  // namespace
int hc_chunk_groups_min() {
  static const int env_min = [] {
    const char* v = std::getenv("CK_HC_CHUNK_GROUPS");
    return v ? std::max(1, std::atoi(v)) : 1;
  }();
  return g_hc_chunk_groups < 0 ? env_min : std::max(1, g_hc_chunk_groups);
}
void set_hc_chunk_groups(int n) { g_hc_chunk_groups = n < 0 ? -1 : n; }
size_t hc_chunk_groups_launches() { return g_hc_chunk_group_launches.load(); }

namespace {
// CK_HC_CUT=1 / 2 (measuring only: the mix's outputs are not written): kP2CutAfterBarrier / kP2CutBeforeBarrier.
int hc_cut_mode() {
  static const int mode = env_is("CK_HC_CUT", "1") ? 1 : env_is("CK_HC_CUT", "2") ? 2 : 0;
  return mode;
}
}  // namespace

size_t hc_mix_acc_words(int S, int lowrank) { return 2 * hc_acc_buffer_words(S, lowrank); }  // two buffers

size_t hc_mix_scratch_floats(int S, int H, int lowrank) {
  const size_t chunks = static_cast<size_t>(S) * H / 64;  // at most: chunks of one group
  return chunks * (lowrank + kHcMaxInject) + chunks;
}

bool hc_mix_row(const HcMixArgs& a, cudaStream_t stream) {
  static const bool on = !env_is("CK_HC_FUSED", "0");
  static const int blocks = [] {  // one block per SM, if one fits
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, hc_mix_row_kernel<true, false, kP2Loads>, kHcThreads, kHcMaxPartialBytes) == cudaSuccess &&
                   n >= 1
               ? sm_count()
               : 0;
  }();
  if (!on || blocks == 0 || !a.scratch || !a.barrier || a.S < 1 || a.S > kHcMaxStreams || a.H % 64 != 0) return false;
  const int W = a.S * a.H, lowrank = static_cast<int>(a.down.rows);
  if (lowrank % 64 != 0 || lowrank > kHcMaxLowrank || !q4_suits(a.down, lowrank, W) || !q4_suits(a.up, W, lowrank) ||
      (a.inject.rows > 0 && (!q4_suits(a.inject, a.inject.rows, W) || a.inject.rows > kHcMaxInject)))
    return false;
  if (a.scratch_floats < hc_mix_scratch_floats(a.S, a.H, lowrank)) return false;
  HcMixLaunch L{};  // (the exact sums' fields stay zero when they are off)
  L.a = a;
  L.lowrank = lowrank;
  // The fewest groups per chunk (a divisor of a stream's groups) that leave a chunk per block.
  // CK_HC_CHUNK_GROUPS=N (to measure): at least N, i.e. fewer, larger chunks and so fewer blocks (the
  // grid's last blocks enter when the kernel before frees their SMs) and fewer partials to add, for
  // more work a block; other sums' rounding (the partials' boundaries move), so not the default's bits.
  const int min_cg = hc_chunk_groups_min();
  const int gps = a.H / 64;
  L.cg = gps;
  int fewest = gps;
  for (int d = 1; d <= gps; ++d)
    if (gps % d == 0 && a.S * (gps / d) <= blocks) {
      fewest = std::min(fewest, d);
      if (d >= min_cg) {
        L.cg = d;
        break;
      }
    }
  if (L.cg != fewest) ++g_hc_chunk_group_launches;
  if (L.cg > kHcMaxChunkGroups) return false;
  L.n_chunks = a.S * gps / L.cg;
  if (L.n_chunks > blocks) return false;
  L.tiles_d = lowrank / 16;
  L.tiles_i = static_cast<int>(ceil_div(a.inject.rows, 16));
  if (L.tiles_d + L.tiles_i > 2 * kHcWarps || L.n_chunks > kHcMaxChunks) return false;
  size_t part_bytes = sizeof(float) * L.n_chunks * (L.tiles_d + L.tiles_i) * 16;
  if (part_bytes > kHcMaxPartialBytes) return false;
  // The exact sums (hc_acc_add) with CK_HC_EXACT_SUM=1; mode 2 (tests) sends every mix to the fallback.
  // Phase 2 then keeps S x 16 (tiles) sums in shared memory, not every chunk's partials. Each sum takes one
  // addition from each of its stream's chunks (cuda/fixed_sum.h bounds them).
  const int cps = gps / L.cg;
  const int exact_mode = a.acc && cps <= kFixedMaxAdditions ? hc_exact_sum_mode() : 0;
  L.acc = exact_mode > 0 ? a.acc : nullptr;
  if (L.acc) {
    L.acc_stride = lowrank + kHcMaxInject;
    L.acc_words = static_cast<int>(hc_acc_buffer_words(a.S, lowrank));
    L.acc_limit = exact_mode == 2 ? 0.0f : fixed_limit(cps);
    part_bytes = sizeof(float) * a.S * (L.tiles_d + L.tiles_i) * 16;
    ++g_hc_exact_launches;
  }
  L.part = a.scratch;  // 256-byte aligned (cudaMalloc): phase 2 reads it in 16-byte loads
  L.ss = L.part + L.n_chunks * (L.tiles_d + L.tiles_i) * 16;
  L.bar = a.barrier;
  const bool bf16s = a.down.fmt.scale_kind == static_cast<uint8_t>(WKind::BF16) &&
                     a.up.fmt.scale_kind == static_cast<uint8_t>(WKind::BF16) &&
                     (a.inject.rows == 0 || a.inject.fmt.scale_kind == static_cast<uint8_t>(WKind::BF16));
  // A block per chunk of phase 1 or group of u, whichever is more: the SMs beyond are free for the
  // next kernel's blocks (resident early under programmatic dependent launch, asking L2 for their
  // weights), and so are the chunk-only blocks' SMs after phase 1.
  // CK_HC_NARROW=0: a block on every SM, all waiting at the barrier (before 2026-11-30), to compare.
  static const bool narrow = !env_is("CK_HC_NARROW", "0");
  L.leave_early = narrow ? 1 : 0;
  static const bool prefetch = !env_is("CK_HC_OWN_PREFETCH", "0");  // 0: not, to compare
  L.prefetch = prefetch ? 1 : 0;
  static const bool norm_prefetch = !env_is("CK_HC_NORM_PREFETCH", "0");
  L.norm_prefetch = norm_prefetch ? 1 : 0;
  L.r_prefetch = hc_r_prefetch_on() ? 1 : 0;
  const dim3 grid(static_cast<unsigned>(narrow ? std::min(blocks, std::max(L.n_chunks, a.H / 64)) : blocks));
  const bool tiles = hc_layout_kernels_on() && a.down.tiled() && a.up.tiled();
  // The instance for (bf16 scales, tiles) with phase 2's form: the exact sums, the bulk copies or the loads.
  const int bulk = L.acc ? 0 : hc_bulk_parts_mode();
  // Modes 2-5 copy the up (and down) tiles after the partials, if they fit and every u group has its own
  // block; mode 3 (the default) without them takes the loads' form (0: the bulk partials alone lost).
  const size_t up_bytes = hc_up_tile_bytes(a.S, lowrank);
  const size_t down_bytes = static_cast<size_t>(L.tiles_d) * L.cg * kTileGroupBytes;
  const bool up_smem = bulk >= 2 && tiles && static_cast<int>(grid.x) >= a.H / 64 &&
                       part_bytes + up_bytes <= static_cast<size_t>(kHcMaxDynamicBytes);
  const bool down_smem = up_smem && bulk >= 3 && part_bytes + up_bytes + down_bytes <= static_cast<size_t>(kHcMaxDynamicBytes);
  // Mode 3 takes its flat form (CK_HC_FLAT_COMBINE, on) for a MoE output of at most 16 slots (or none).
  const bool flat = hc_flat_combine_on() && (!a.moe_y || a.moe_k <= kFlatCombineSlots);
  // CK_HC_STAGED_PAIR (on): the flat form with the inject head's tile pair staged before the wait, if its
  // words fit after the tiles (cg groups x 2 KB).
  const size_t stage_bytes = static_cast<size_t>(L.cg) * 4 * 32 * sizeof(uint4);
  const bool staged = flat && hc_staged_pair_on() &&
                      part_bytes + up_bytes + down_bytes + stage_bytes <= static_cast<size_t>(kHcMaxDynamicBytes);
  // CK_HC_COUNT_BARRIER (on): either with grid_barrier_count.
  const bool count = flat && hc_count_barrier_on();
  L.wrap_at = count_barrier_wrap(grid.x);
  int p2 = L.acc                           ? kP2Exact
                 : bulk == 1               ? kP2Bulk
                 : bulk == 2 && up_smem    ? kP2BulkUp
                 : bulk == 2               ? kP2Bulk
                 : bulk == 3 && down_smem && staged ? (count ? kP2StagedCount : kP2BulkAllStaged)
                 : bulk == 3 && down_smem && flat ? (count ? kP2FlatCount : kP2BulkAllFlat)
                 : bulk == 3 && down_smem  ? kP2BulkAll
                 : bulk == 4 && down_smem  ? kP2LoadsTiles
                 : bulk == 5 && down_smem  ? kP2BulkAll4
                                           : kP2Loads;
  if (p2 == kP2StagedCount && hc_cut_mode() > 0) {
    static bool told = false;
    if (!told) std::fprintf(stderr, "CK_HC_CUT=%d: the one-row mix is cut short (measuring only: garbage outputs)\n", hc_cut_mode());
    told = true;
    p2 = hc_cut_mode() == 1 ? kP2CutAfterBarrier : kP2CutBeforeBarrier;
  }
  const bool p2_staged = p2_staged_pair(p2);
  if ((p2 == kP2BulkAllFlat || p2 == kP2FlatCount || p2_staged) && a.moe_y) g_hc_flat_combine.count();
  if (p2_staged) g_hc_staged_pair.count();
  if (p2 == kP2FlatCount || p2 == kP2StagedCount) g_hc_count_barrier.count();
  if (p2_bulk_partials(p2)) ++g_hc_bulk_launches;
  if (p2 >= kP2BulkUp) ++g_hc_bulk_up_launches;
  if (p2 >= kP2BulkAll) ++g_hc_bulk_down_launches;
  const size_t smem = part_bytes + (p2 >= kP2BulkUp ? up_bytes : 0) + (p2 >= kP2BulkAll ? down_bytes : 0) +
                      (p2_staged ? stage_bytes : 0);
  auto go = [&](auto kernel) { launch(kernel, grid, kHcThreads, smem, stream, L); };
  auto go_exact = [&](auto bf16s_c, auto tiles_c) {
    if constexpr (tiles_c()) {  // (the tiles' copies have instances only with tiles)
      if (p2 == kP2BulkUp) return go(hc_mix_row_kernel<bf16s_c(), true, kP2BulkUp>);
      if (p2 == kP2BulkAll) return go(hc_mix_row_kernel<bf16s_c(), true, kP2BulkAll>);
      if (p2 == kP2LoadsTiles) return go(hc_mix_row_kernel<bf16s_c(), true, kP2LoadsTiles>);
      if (p2 == kP2BulkAll4) return go(hc_mix_row_kernel<bf16s_c(), true, kP2BulkAll4>);
      if (p2 == kP2BulkAllFlat) return go(hc_mix_row_kernel<bf16s_c(), true, kP2BulkAllFlat>);
      if (p2 == kP2BulkAllStaged) return go(hc_mix_row_kernel<bf16s_c(), true, kP2BulkAllStaged>);
      if (p2 == kP2FlatCount) return go(hc_mix_row_kernel<bf16s_c(), true, kP2FlatCount>);
      if (p2 == kP2StagedCount) return go(hc_mix_row_kernel<bf16s_c(), true, kP2StagedCount>);
      if (p2 == kP2CutAfterBarrier) return go(hc_mix_row_kernel<bf16s_c(), true, kP2CutAfterBarrier>);
      if (p2 == kP2CutBeforeBarrier) return go(hc_mix_row_kernel<bf16s_c(), true, kP2CutBeforeBarrier>);
    }
    if (p2 == kP2Exact) go(hc_mix_row_kernel<bf16s_c(), tiles_c(), kP2Exact>);
    else if (p2 == kP2Bulk) go(hc_mix_row_kernel<bf16s_c(), tiles_c(), kP2Bulk>);
    else go(hc_mix_row_kernel<bf16s_c(), tiles_c(), kP2Loads>);
  };
  using T = std::true_type;
  using F = std::false_type;
  if (tiles) bf16s ? go_exact(T{}, T{}) : go_exact(F{}, T{});
  else bf16s ? go_exact(T{}, F{}) : go_exact(F{}, F{});
  return true;
}

}  // namespace ck::cuda
