// Prefill products of MLX 4-bit codes (the real checkpoint's form) in the factored form: the codes go
// to the tensor cores as they are (exact in bf16; mma_q4.cuh) and each 64-code group's scale and bias
// are applied to the group's sums, y += s * Σ q x + b * Σ x. Two users:
//  - the routed and shared experts, grouped per expert as in gemm.cu (group_pairs' tiles of up to
//    kGroupRows pairs of one expert);
//  - dense projections of a prefill chunk (gemm_tc hands them here when every job is 4-bit codes); on
//    Hopper (compute capability 9.0) their launch goes to gemm_q4_wg.cu's warpgroup-MMA kernel, the
//    same arithmetic on the same tiles (CK_Q4_WGMMA=0 keeps q4_tile_kernel).
// gemm.cu's kernels instead dequantize and split every weight into shared memory once per tile, which
// bounds them (with the ~20 rows an expert gets per 1,024-row chunk, and for the dense projections).
//
// The activations are split once per call into three bf16 parts, already in the lanes' fragment order
// (q4_xfrag_kernel), with each row's Σ x per group. By default the kernels stage and multiply only
// the first two parts: x rounded to ~16 significant bits (tools/split_error.py: ~1.5e-6 to 6.3e-6 of
// Σ|q x| per group) for two thirds of the MMAs; prefill 8,094 -> 8,841 tok/s at 8k tokens
// (docs/performance.md, eleventh session), and the oracle fixtures' chunked logits within 1.6e-5
// (their bound is 1e-4). With CK_PREFILL_PARTS=3 (or set_prefill_parts(3)) they multiply all three,
// and the products are exact (integer codes times 8-bit mantissas) and accumulate in fp32: results
// within fp32 rounding of the CPU's, closer than gemm.cu's tf32x3.
//
// The MMA computes yᵀ = W xᵀ: the codes are the A operand (16 output features by k16), unpacked into
// registers, and the activations the B operand (k16 by 8 tokens), so a lane's B fragment of one part
// is one 8-byte load of one token's row. (With the activations as A, a fragment mixes two tokens' rows:
// the first version assembled them with ~130 register moves per group and warp, a quarter of its
// instructions.)
//
// Block: 8 warps, a tile of 32 tokens (four n8 fragments) x 8 * 16 * MF output features (MF m16
// fragments per warp and matrix: 1 for gate/up, which has two matrices, 2 otherwise). Per 64-code
// group the block copies its filled rows' fragments (PARTS parts, 4 KB each), the group's scales and
// biases and its 8 KB of codes into shared memory with cp.async, two groups ahead, where every load of
// a warp is a contiguous 256-byte read (no bank conflicts); each warp then unpacks its codes and runs
// 4 x PARTS x MF x NW MMAs per k16 step and filled 8-token fragment. The copies each thread makes are
// worked out once per block. At 1,024-row chunks the kernel is bound by its instruction issue (~10
// per MMA, eleventh session: docs/roofline-cuda.md), not by memory or the tensor cores.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gemm_q4_wg.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"
#include "cuda/split_k.h"

namespace ck::cuda {
namespace {

constexpr int kQ4Threads = 128;  // q4_xfrag_kernel
constexpr int kQ4TileWarps = 8;  // q4_tile_kernel: 8 warps share their tokens' fragments (shared memory)
static_assert(kQ4TileWarps * 32 == 256, "q4_tile_kernel's staging gives each of 256 threads its copies");
constexpr int kQ4GroupU2 = 48;   // uint2 per row and group: 4 steps x 3 parts x 4 lanes t

// The bf16 parts of the activations the prefill products use (q4_tile_kernel's PARTS): 2, or 3 (exact
// products) with CK_PREFILL_PARTS=3 or set_prefill_parts(3).
int g_prefill_parts = -1;
int prefill_parts() {
  if (g_prefill_parts < 0) g_prefill_parts = env_is("CK_PREFILL_PARTS", "3") ? 3 : 2;
  return g_prefill_parts;
}

// Split activations of one row, per group: [step s][part p][lane t] of uint2 (pair A, pair B) in
// mma_q4.cuh's K order, the B fragment (b0, b1) of the MMA column that carries this row; then Σ x per
// group; only the first `parts` parts (the kernels multiply no others). With wg (the wgmma kernel,
// gemm_q4_wg.cu), each (step, part) holds the four lanes' pair A words, then their pair B words: the
// row's k values 0..7 and 8..15 of the step, one core-matrix row each. With wg == 2 (the tile layout
// of gemm_q4_wg.h's bulk kernel) each (tile of tile_rows rows, group) is one block of
// q4_wg_act_block_bytes(parts, tile_rows): (step, part) at (s parts + p) q4_wg_b_bytes(tile_rows), the
// row's two 16-byte halves at 256 (r / 8) + 16 (r % 8) and 128 bytes further (r = row % tile_rows: the
// core-matrix order the kernel's wgmmas read), then the tile's Σ x; the grid then covers whole tiles
// and rows past x_rows are zeros. grid (rows), block 128.
// sum_parts (wg == 0 only): Σ of the parts the kernels multiply, hi + mid (+ lo), instead of Σ x: what
// the codes-as-128 + q form (q4_tile_kernel's C128) needs for its 128 to cancel.
// row_inv (wg == 2 and two parts only): the fp16 form (mma_q4.cuh f16_row_scale): the row is scaled by
// 2^e first, its two parts are fp16, Σ x is of the scaled values, and row_inv[row] = 2^-e (every row of
// the grid, 1 past x_rows).
__global__ void __launch_bounds__(kQ4Threads) q4_xfrag_kernel(const float* __restrict__ x, int ldx, int x_rows, int K,
                                                              int groups, int parts, int wg, int tile_rows, uint2* xf,
                                                              float* gsum, int sum_parts = 0, float* row_inv = nullptr) {
  const int row = blockIdx.x;
  const bool real = row < x_rows;
  const float* xr = x + static_cast<size_t>(real ? row : 0) * ldx;
  const bool f16 = row_inv != nullptr;
  float sc = 1.0f;
  if (f16) {
    __shared__ float scratch[32];
    float m = 0.0f;
    for (int c = threadIdx.x; real && c < K; c += blockDim.x) m = fmaxf(m, fabsf(xr[c]));
    sc = f16_row_scale(block_max(m, scratch));
    if (threadIdx.x == 0) row_inv[row] = 1.0f / sc;
  }
  uint2* out = xf + static_cast<size_t>(row) * groups * kQ4GroupU2;
  const int tile_bytes = wg == 2 ? q4_wg_act_block_bytes(parts, tile_rows) : 0, b_bytes = q4_wg_b_bytes(tile_rows);
  const int r_t = wg == 2 ? row % tile_rows : 0;
  uint8_t* tile = reinterpret_cast<uint8_t*>(xf) + static_cast<size_t>(wg == 2 ? row / tile_rows : 0) * groups * tile_bytes;
  // Unrolled so that several iterations' loads are in flight at once (one round trip each, in order,
  // made this kernel ~60 us per 1,024-row chunk of the 10,240-wide mix input).
#pragma unroll 4
  for (int e = threadIdx.x; e < groups * 16; e += blockDim.x) {
    const int t = e % 4, s = (e / 4) % 4, G = e / 16;
    const int c = G * 64 + (2 * t + (s >> 1)) * 8 + 2 * (s & 1);
    uint2* o = out + static_cast<size_t>(G) * kQ4GroupU2 + s * 12 + t;
#pragma unroll
    for (int p = 0; p < 3; ++p) {
      if (p >= parts) break;
      uint2 v = make_uint2(0u, 0u);
      if (c < K && real && f16) {
        v.x = f16_pair(f16_part(xr[c] * sc, p), f16_part(xr[c + 4] * sc, p));
        v.y = f16_pair(f16_part(xr[c + 1] * sc, p), f16_part(xr[c + 5] * sc, p));
      } else if (c < K && real) {  // K % 64 == 0 for the groups that exist; rows of a shorter matrix read zeros
        v.x = bf16_pair(bf16_part(xr[c], p), bf16_part(xr[c + 4], p));
        v.y = bf16_pair(bf16_part(xr[c + 1], p), bf16_part(xr[c + 5], p));
      }
      if (wg == 2) {
        uint8_t* b = tile + static_cast<size_t>(G) * tile_bytes + (s * parts + p) * b_bytes + 256 * (r_t >> 3) +
                     16 * (r_t & 7) + 4 * t;
        *reinterpret_cast<uint32_t*>(b) = v.x;
        *reinterpret_cast<uint32_t*>(b + 128) = v.y;
      } else if (wg) {
        uint32_t* ow = reinterpret_cast<uint32_t*>(out + static_cast<size_t>(G) * kQ4GroupU2 + s * 12 + p * 4);
        ow[t] = v.x;
        ow[4 + t] = v.y;
      } else {
        o[p * 4] = v;
      }
    }
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll 4
  for (int G = warp; G < groups; G += blockDim.x >> 5) {
    float v = 0.0f;
    if (G * 64 < K && real) {
      if (sum_parts) {  // tc4_group_sum's order, of each value's multiplied parts
        auto used = [&](float e) {
          const float hi = bf16_part(e, 0), mid = bf16_part(e, 1);
          return parts == 3 ? hi + mid + bf16_part(e, 2) : hi + mid;  // exact in fp32
        };
        v = warp_sum(used(xr[G * 64 + lane]) + used(xr[G * 64 + lane + 32]));
      } else if (f16) {  // tc4_group_sum's order, of the scaled values (q4_xfrag_tiles8_kernel's)
        v = warp_sum(xr[G * 64 + lane] * sc + xr[G * 64 + lane + 32] * sc);
      } else {
        v = tc4_group_sum(xr + G * 64);
      }
    }
    if (lane == 0 && wg == 2)
      reinterpret_cast<float*>(tile + static_cast<size_t>(G) * tile_bytes + parts * 4 * b_bytes)[r_t] = v;
    else if (lane == 0)
      gsum[static_cast<size_t>(row) * groups + G] = v;
  }
}

// The tile layout (wg == 2 above) with whole-line stores: a block takes 8 consecutive rows, whose
// 16-byte pieces of each (tile, group, step, part, k half) are adjacent (128 bytes), and a warp one
// group of them at a time, staged in shared memory. The same bytes as q4_xfrag_kernel's wg == 2 form
// (the same elements through bf16_part and bf16_pair, Σ x in tc4_group_sum's order). Why: there each
// thread stored 4-byte words of one row, 16 bytes at a time in 16 places, so every 32-byte sector was
// written half by one block and half by another: 34 us for a 2,048-row chunk of the 2,560-wide in_proj
// input, 112 us for the 6,144-wide out_proj input (Nsight Compute, twenty-first session).
// grid (rows / 8, a multiple of tile_rows; the groups' splits: blockIdx.y takes groups y * 8 + warp,
// stepping 8 * gridDim.y), block 256; x rows 16-byte aligned (ldx % 4 == 0). Why the splits: a
// 496-row chunk is 62 blocks on 132 SMs, and the 10,240-wide mix input took 32 us (1.3 TB/s).
// row_inv (two parts only): the fp16 form, as q4_xfrag_kernel's: the block first finds its rows'
// largest magnitudes (every block of the rows' group splits does), the blocks of blockIdx.y == 0 write
// row_inv.
// xn (XNorm, cuda/ops.h; not with row_inv): x is the mix's R, each value normalised as it is staged,
// (R r) scale: the values the norm kernel would have written as X.
__global__ void __launch_bounds__(256) q4_xfrag_tiles8_kernel(const float* __restrict__ x, int ldx, int x_rows, int K,
                                                              int groups, int parts, int tile_rows, uint2* xf,
                                                              float* row_inv = nullptr, XNorm xn = XNorm{}) {
  __shared__ float stage[8][8][68];  // [warp][row][the group's 64 values, padded]
  __shared__ float row_sc[8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = blockIdx.x * 8, r_t0 = row0 % tile_rows;  // tile_rows % 8 == 0
  const bool f16 = row_inv != nullptr;
  if (f16) {
    // Each row's largest magnitude, read as the loop below reads (warp w: groups w, w + 8, ..., all of
    // them whatever the block's split; lane (row, t): 16 values of its row a group), into row_max as
    // bits (non-negative floats order as their bits; a NaN never wins fmaxf).
    __shared__ unsigned row_max[8];
    if (threadIdx.x < 8) row_max[threadIdx.x] = 0u;
    __syncthreads();
    const int row = lane >> 2, t = lane & 3;
    float m = 0.0f;
    if (row0 + row < x_rows) {
      const float* xr = x + static_cast<size_t>(row0 + row) * ldx + 16 * t;
#pragma unroll 2
      for (int G = warp; G < groups && G * 64 < K; G += 8)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 v = *reinterpret_cast<const float4*>(xr + static_cast<size_t>(G) * 64 + 4 * i);
          m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    if (t == 0) atomicMax(&row_max[row], __float_as_uint(m));
    __syncthreads();
    if (threadIdx.x < 8) {
      row_sc[threadIdx.x] = f16_row_scale(__uint_as_float(row_max[threadIdx.x]));
      if (blockIdx.y == 0) row_inv[row0 + threadIdx.x] = 1.0f / row_sc[threadIdx.x];
    }
    __syncthreads();
  }
  const int tile_bytes = q4_wg_act_block_bytes(parts, tile_rows), b_bytes = q4_wg_b_bytes(tile_rows);
  uint8_t* tile = reinterpret_cast<uint8_t*>(xf) + static_cast<size_t>(row0 / tile_rows) * groups * tile_bytes;
  float(*sx)[68] = stage[warp];
  const int row = lane >> 2, t = lane & 3;  // staging: 16 values of `row` from 16 t; fragments: row, lane t
  const bool real = row0 + row < x_rows;
  for (int G = static_cast<int>(blockIdx.y) * 8 + warp; G < groups; G += 8 * static_cast<int>(gridDim.y)) {
    const bool on = real && G * 64 < K;  // K % 64 == 0 for the groups that exist
    const float* src = x + static_cast<size_t>(on ? row0 + row : 0) * ldx + static_cast<size_t>(G) * 64 + 16 * t;
    const float sc = f16 ? row_sc[row] : 1.0f;  // (the fp16 form's scale: exact, 1 otherwise)
    // XNorm: this row's 1 / rms of the group's stream, and the norm weights' 16 values of lane t.
    const float xr = xn.rinv && on ? xn.rinv[static_cast<size_t>(row0 + row) * xn.S + G * 64 / xn.H] : 0.0f;
    const float* xw = xn.rinv ? xn.scale + static_cast<size_t>(G) * 64 + 16 * t : nullptr;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float4 v = on ? *reinterpret_cast<const float4*>(src + 4 * i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (f16) v = make_float4(v.x * sc, v.y * sc, v.z * sc, v.w * sc);
      if (xn.rinv && on) {  // rmsnorm_wide_tail's (v r) s
        const float4 w = *reinterpret_cast<const float4*>(xw + 4 * i);
        v = make_float4((v.x * xr) * w.x, (v.y * xr) * w.y, (v.z * xr) * w.z, (v.w * xr) * w.w);
      }
      *reinterpret_cast<float4*>(&sx[row][16 * t + 4 * i]) = v;
    }
    __syncwarp();
    uint8_t* gb = tile + static_cast<size_t>(G) * tile_bytes;
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int c = (2 * t + (s >> 1)) * 8 + 2 * (s & 1);
      const float x0 = sx[row][c], x1 = sx[row][c + 1], x4 = sx[row][c + 4], x5 = sx[row][c + 5];
#pragma unroll
      for (int p = 0; p < 3; ++p) {
        if (p >= parts) break;
        uint8_t* b = gb + (s * parts + p) * b_bytes + 256 * (r_t0 >> 3) + 16 * row + 4 * t;
        *reinterpret_cast<uint32_t*>(b) =
            f16 ? f16_pair(f16_part(x0, p), f16_part(x4, p)) : bf16_pair(bf16_part(x0, p), bf16_part(x4, p));
        *reinterpret_cast<uint32_t*>(b + 128) =
            f16 ? f16_pair(f16_part(x1, p), f16_part(x5, p)) : bf16_pair(bf16_part(x1, p), bf16_part(x5, p));
      }
    }
    float mine = 0.0f;
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      const float v = warp_sum(sx[r][lane] + sx[r][lane + 32]);  // tc4_group_sum's order
      if (lane == r) mine = v;
    }
    if (lane < 8) reinterpret_cast<float*>(gb + parts * 4 * b_bytes)[r_t0 + lane] = mine;
    __syncwarp();  // every lane is done with sx before the next group's staging
  }
}

// One group of a block in shared memory: its 32 tokens' B fragments, [step][part][token][lane t], so
// a warp's load of (step, part, 8 tokens) x 4 lanes t is 256 contiguous bytes; their Σ x; and the
// group's scale and bias of each of the block's output features (the 4-byte word that holds each, so
// cp.async can copy it whatever the element's alignment: an expert's weights come from DRAM once per
// chunk, and loaded in the epilogue their latency stalled every group). 18.1 KB with two parts, 22.1
// with three; q4_tile_kernel's STAGES of them.
template <int PARTS>
struct Q4StageT {
  uint2 xb[4][PARTS][32][4];
  float gsum[32];
  alignas(16) uint32_t sb[512];  // [matrix][feature][scale, bias]: NW * block features * 2 = 512 in every mode
  // With codes staged (q4_tile_kernel's SC): the group's 32 code bytes of each of the block's NW * BF =
  // 256 feature rows, [matrix * BF + feature][lane t]: a warp's 8 rows x 4 lanes are 256 contiguous bytes.
  alignas(16) uint2 codes[256][4];
};

enum Q4Mode : int { kQ4Dense = 0, kQ4GateUp = 1, kQ4Down = 2 };

struct Q4Args {
  // Experts: group_pairs' tiles, read on the device.
  const ExpertPair* pairs;
  const int32_t* order;
  const int2* tiles;
  const int32_t* n_tiles;
  // Dense: up to kMaxGemvJobs matrices over the same x rows [0, rows); blockIdx.x enumerates their
  // feature tiles, blockIdx.y the 32-row tiles of x.
  GemvJob job[kMaxGemvJobs];
  int32_t first_tile[kMaxGemvJobs + 1];
  int32_t n_jobs;
  int32_t rows;
  const uint2* xf;    // q4_xfrag_kernel's output for the x rows (dense/gate-up: tokens; down: pairs)
  const float* gsum;
  int groups;         // groups per x row in xf (the longest K / 64)
  float* y;           // experts: the output row per pair
  int ldy;
  // Dense split-K (few feature tiles over a long K, or a last wave mostly empty): block z takes groups
  // [z * k_groups, (z + 1) * k_groups) and writes its raw sums to split's scratch (cuda/split_k.h);
  // split_k_finish adds them.
  int k_groups;       // dense: groups per block (all of them without a split)
  SplitK split;
  bool all_fragments;  // CK_Q4_SKIP_EMPTY=0: every n8 fragment, full or not (to compare)
};

// m16 fragments (16 output features each) per warp and matrix: gate/up keeps 1 (two matrices'
// accumulators); dense and down take 2, so each B fragment (a token's part) feeds twice the MMAs.
template <int MODE>
__host__ __device__ constexpr int q4_mf() { return MODE == kQ4GateUp ? 1 : 2; }
template <int MODE>
__host__ __device__ constexpr int q4_block_features() { return kQ4TileWarps * 16 * q4_mf<MODE>(); }

// kQ4GateUp: h[pair] = silu(gate · x) * (up · x); kQ4Down: y[pair] = down · h; grid (features /
// q4_block_features, max tiles). kQ4Dense: y_job[row] = epi(w_job · x[row]); grid (feature tiles of all
// jobs, rows / 32, K splits). PARTS: the bf16 parts of x used, 2 (the default: x rounded to ~16
// significant bits, two thirds of the MMAs) or 3 (exact products; CK_PREFILL_PARTS=3).
// SC: the codes come through shared memory with the activations (cp.async, two groups ahead), instead
// of each warp loading its own one group ahead into registers (CK_Q4_STAGE_CODES=0).
// STAGES: shared-memory buffers, STAGES - 1 groups copied ahead (q4_stages()). C128: codes unpacked as
// 128 + q (code_pair_128, no subtraction) and the group's bias term (b - 128 s) Σ x̃, with Σ x̃ the sum
// of the multiplied parts (q4_xfrag_kernel's sum_parts); q4_codes128().
template <int MODE, int PARTS, bool SC, int STAGES, bool C128 = false>
__global__ void __launch_bounds__(kQ4TileWarps * 32, 2) q4_tile_kernel(const __grid_constant__ Q4Args a) {
  static_assert(PARTS == 2 || PARTS == 3, "two or three bf16 parts");
  static_assert(STAGES >= 3, "at least two groups ahead");
  using Q4Stage = Q4StageT<PARTS>;
  constexpr int AHEAD = STAGES - 1;
  constexpr int NW = MODE == kQ4GateUp ? 2 : 1, MF = q4_mf<MODE>(), BF = q4_block_features<MODE>();
  static_assert(NW * BF * 2 == 512, "Q4Stage::sb holds 512 words");
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  DMatrix w0, w1;
  int job = 0;
  int block_f0 = 0;
  int m0 = 0;
  int2 tile = make_int2(0, 0);
  if constexpr (MODE == kQ4Dense) {
    while (job + 1 < a.n_jobs && static_cast<int>(blockIdx.x) >= a.first_tile[job + 1]) ++job;
    w0 = a.job[job].w;
    block_f0 = (static_cast<int>(blockIdx.x) - a.first_tile[job]) * BF;
    m0 = static_cast<int>(blockIdx.y) * 32;
  } else {
    if (static_cast<int>(blockIdx.y) >= *a.n_tiles) return;  // uniform over the block
    tile = a.tiles[blockIdx.y];
    const ExpertPair& p0 = a.pairs[a.order[tile.x]];
    w0 = MODE == kQ4GateUp ? p0.gate : p0.down;
    w1 = p0.up;
    block_f0 = static_cast<int>(blockIdx.x) * BF;
  }
  const int f_warp = block_f0 + warp * 16 * MF;
  const bool active = f_warp < w0.rows;  // warp-uniform; idle warps still stage and meet the barriers
  // The tile's 32 token slots: the output row each stores to (-1 past the tile's rows) and the x row it
  // reads (row 0 past the end). Dense: the chunk's rows; experts: the tile's pairs (gate/up reads each
  // pair's token row, down the pair's own row of h).
  __shared__ int srow[32], drow[32];
  if (threadIdx.x < 32) {
    const int i = threadIdx.x;
    int d;
    if constexpr (MODE == kQ4Dense) d = m0 + i < a.rows ? m0 + i : -1;
    else d = i < tile.y ? a.order[tile.x + i] : -1;
    drow[i] = d;
    if constexpr (MODE == kQ4GateUp) srow[i] = d < 0 ? 0 : a.pairs[d].x_row;
    else srow[i] = d < 0 ? 0 : d;
  }
  __syncthreads();
  // The n8 fragments (8 tokens each) that hold any of the tile's rows: the others are neither staged
  // nor multiplied. An expert's tile is ~60% full at 1,024-row chunks (~20 pairs per expert) and holds
  // one or two pairs at short prompts, where most of the MMAs were on padding.
  const int nb_used = a.all_fragments ? 4 : MODE == kQ4Dense ? min(4, (a.rows - m0 + 7) / 8) : (tile.y + 7) / 8;
  const int K = w0.cols, gpg_shift = __ffs(w0.fmt.group / 64) - 1;  // groups per scale group: 2^k
  // This block's groups: all of K, or one split of it (dense split-K).
  const int g_begin = MODE == kQ4Dense ? static_cast<int>(blockIdx.z) * a.k_groups : 0;
  const int g_end = MODE == kQ4Dense ? min(K / 64, g_begin + a.k_groups) : K / 64;
  const size_t row_bytes = static_cast<size_t>(K) / 2, n_sg = K / w0.fmt.group;
  const uint8_t sk = w0.fmt.scale_kind;
  const int es = sk == static_cast<uint8_t>(WKind::F32) ? 4 : 2;  // bytes per scale or bias
  // The feature rows of this lane's A fragments (rows g and g+8 of each m16 fragment), clamped to the
  // matrix (rows past it are computed, never stored); their scales' word parity (below).
  int fr[MF][2], par0[MF][2];
#pragma unroll
  for (int mf = 0; mf < MF; ++mf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      fr[mf][h] = min(f_warp + mf * 16 + h * 8 + g, w0.rows - 1);
      par0[mf][h] = static_cast<int>((static_cast<int64_t>(fr[mf][h]) * n_sg) & 1);
    }
  extern __shared__ __align__(16) uint8_t q4_smem[];
  Q4Stage* stage = reinterpret_cast<Q4Stage*>(q4_smem);
  // Group G of the 32 tokens into `st`: 256 PARTS 16-byte copies of fragments, 32 sums, 512 scale/bias
  // words (and 512 16-byte copies of codes with SC); every thread issues at most PARTS + 1 + 2 (+ 2)
  // (blockDim is 256). The plan (which copy a thread makes, from where to where) does not change from
  // group to group, so it is worked out once here: done per group, its index arithmetic, shared-memory
  // row lookups and the matrix choice (kept on the stack) were 300 of a warp's ~715 instructions per
  // group, for ~53 MMAs (Nsight Compute, eleventh session).
  const int tid = threadIdx.x;
  // Fragment copy j: its uint2 offset in a.xf at group 0 (~0u: none), its byte offset in a stage.
  uint32_t xf_src[PARTS], xf_dst[PARTS];
#pragma unroll
  for (int j = 0; j < PARTS; ++j) {  // copy i: row r, step s, part p, 16-byte half
    const int i = tid + j * kQ4TileWarps * 32;
    const int r = i / (8 * PARTS), s = (i % (8 * PARTS)) / (2 * PARTS), p = (i % (2 * PARTS)) >> 1, half = i & 1;
    const bool on = r < 8 * nb_used;
    xf_src[j] = on ? static_cast<uint32_t>((srow[r] * a.groups) * kQ4GroupU2 + (s * 3 + p) * 4 + half * 2) : ~0u;
    xf_dst[j] = static_cast<uint32_t>(offsetof(Q4Stage, xb) + (((s * PARTS + p) * 32 + r) * 4 + half * 2) * sizeof(uint2));
  }
  // Matrices in 16-row tiles (dmatrix.h, WLayout::Tiles16; a block's matrices are all tiled or all
  // rows): the block's BF / 16 tiles of each matrix are runs of 576 bytes per group. Codes land in
  // `codes` as [matrix][tile][lane] 16-byte pieces (a warp's m16 fragment is one tile), the scale
  // words in `sb` as [matrix][tile][g][row g, row g + 8].
  const bool tiled = w0.tiled();
  constexpr int TB = BF / kTileRows;  // tiles per matrix in a block
  const int n_tiles = (w0.rows + kTileRows - 1) / kTileRows;
  auto tile_base = [&](int q, int tl) {  // tile tl of matrix q in the block at group 0, clamped to the matrix
    return (q == 0 ? w0 : w1).data +
           static_cast<size_t>(min(block_f0 / kTileRows + tl, n_tiles - 1)) * (K / 64) * kTileGroupBytes;
  };
  const uint8_t* code_src[SC ? 2 : 1];  // code copy j (SC): 16 bytes of feature row (i / 2) at group 0
  if constexpr (SC) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int i = tid + j * kQ4TileWarps * 32, q = (i >> 1) / BF, fl = (i >> 1) % BF;
      const size_t row = static_cast<size_t>(min(block_f0 + fl, w0.rows - 1));
      code_src[j] = tiled ? tile_base(q, (i >> 5) % TB) + 16 * (i & 31)
                          : (q == 0 ? w0 : w1).data + row * row_bytes + (i & 1) * 16;
    }
  }
  const size_t gsum_src = static_cast<size_t>(srow[tid & 31]) * a.groups;
  const uint8_t* sb_src[2];  // scale/bias word j: the feature row's first scale group
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = tid + j * kQ4TileWarps * 32;
    const int q = i / (2 * BF), fl = (i % (2 * BF)) >> 1;
    const DMatrix& w = q == 0 ? w0 : w1;
    // Tiled: threads < 4 NW TB (64) make one 16-byte copy each, of matrix tid / (4 TB).
    sb_src[j] = tiled ? tile_base(tid / (4 * TB), (tid >> 2) % TB) + 512 + 16 * (tid & 3)
                      : ((i & 1) ? w.biases : w.scales) + static_cast<size_t>(min(block_f0 + fl, w0.rows - 1)) * n_sg * es;
  }
  auto stage_group = [&](int G, Q4Stage& st) {
    uint8_t* base = reinterpret_cast<uint8_t*>(&st);
#pragma unroll
    for (int j = 0; j < PARTS; ++j)
      if (xf_src[j] != ~0u) cp_async16(base + xf_dst[j], a.xf + xf_src[j] + static_cast<size_t>(G) * kQ4GroupU2);
    if constexpr (SC) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
        cp_async16(&st.codes[0][0] + 2 * (tid + j * kQ4TileWarps * 32),
                   code_src[j] + static_cast<size_t>(G) * (tiled ? kTileGroupBytes : 32));
    }
    if (tid < 32) cp_async4(&st.gsum[tid], a.gsum + gsum_src + G);
    if (tiled) {
      if (tid < 4 * NW * TB) cp_async16(&st.sb[4 * tid], sb_src[0] + static_cast<size_t>(G) * kTileGroupBytes);
      return;
    }
    const size_t off = static_cast<size_t>(G >> gpg_shift) * es;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uintptr_t at = reinterpret_cast<uintptr_t>(sb_src[j] + off);
      cp_async4(&st.sb[tid + j * kQ4TileWarps * 32], reinterpret_cast<const void*>(at & ~uintptr_t{3}));
    }
  };
  static_assert(4 * NW * TB <= kQ4TileWarps * 32, "one scale copy per thread");
  const StagedScales scales(sk);  // a scale or bias from its staged 4-byte word
  auto load_codes = [&](int G, uint2 (&wq)[NW][MF][2]) {
#pragma unroll
    for (int q = 0; q < NW; ++q) {
      const DMatrix& w = q == 0 ? w0 : w1;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
        if (tiled) {
          const uint4 c = __ldg(reinterpret_cast<const uint4*>(tile_base(q, warp * MF + mf) +
                                                               static_cast<size_t>(G) * kTileGroupBytes) + lane);
          wq[q][mf][0] = make_uint2(c.x, c.y);
          wq[q][mf][1] = make_uint2(c.z, c.w);
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h)
            wq[q][mf][h] = __ldg(reinterpret_cast<const uint2*>(w.data + fr[mf][h] * row_bytes + G * 32 + 8 * t));
        }
    }
  };
  float acc[NW][MF][4][4] = {};  // [matrix][m16 fragment][n8 fragment (8 tokens)][d0..d3]
  uint2 wq[NW][MF][2] = {};
  // STAGES buffers, AHEAD = STAGES - 1 groups ahead: group G + AHEAD goes into the buffer group G - 1
  // used, after the barrier that says every warp is done with it (one barrier per group).
#pragma unroll
  for (int j = 0; j < AHEAD; ++j) {
    if (g_begin + j < g_end) stage_group(g_begin + j, stage[j]);
    cp_async_commit();  // possibly empty: one commit group per group, as in the loop
  }
  if (!SC && active) load_codes(g_begin, wq);

  for (int G = g_begin; G < g_end; ++G) {
    cp_async_wait<AHEAD - 1>();  // every committed group but the newest AHEAD - 1 is done: group G is
    __syncthreads();
    if (G + AHEAD < g_end) stage_group(G + AHEAD, stage[(G - g_begin + AHEAD) % STAGES]);
    cp_async_commit();  // possibly empty, so the count above stays one group per iteration
    const Q4Stage& st = stage[(G - g_begin) % STAGES];
    uint2 wn[NW][MF][2] = {};
    if (active) {
      if constexpr (SC) {
#pragma unroll
        for (int q = 0; q < NW; ++q)
#pragma unroll
          for (int mf = 0; mf < MF; ++mf)
            if (tiled) {
              const uint4 c = reinterpret_cast<const uint4*>(&st.codes[0][0])[(q * TB + warp * MF + mf) * 32 + lane];
              wq[q][mf][0] = make_uint2(c.x, c.y);
              wq[q][mf][1] = make_uint2(c.z, c.w);
            } else {
#pragma unroll
              for (int h = 0; h < 2; ++h) wq[q][mf][h] = st.codes[q * BF + warp * 16 * MF + mf * 16 + h * 8 + g][t];
            }
      } else if (G + 1 < g_end) {
        load_codes(G + 1, wn);
      }
      float d[NW][MF][4][4] = {};  // the group's Σ q x, fresh per group
      // The group's MMAs and its scale epilogue over the first NB n8 fragments. NB is a template
      // argument, chosen once per group from nb_used, so each form is fully unrolled and the compiler
      // interleaves the independent accumulators (a break inside one unrolled loop serialised them:
      // each pair of dependent MMAs on the same accumulator then waited for the other).
      auto group_mmas = [&](auto nb_count) {
        constexpr int NB = decltype(nb_count)::value;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          // A: the codes of feature rows g and g+8, k pairs A (2t, 2t+1) and B (2t+8, 2t+9) of step s.
          const int i0 = 2 * (s & 1);
          uint32_t af[NW][MF][4];
#pragma unroll
          for (int q = 0; q < NW; ++q)
#pragma unroll
            for (int mf = 0; mf < MF; ++mf) {
              const uint32_t w_g = (s >> 1) ? wq[q][mf][0].y : wq[q][mf][0].x;
              const uint32_t w_g8 = (s >> 1) ? wq[q][mf][1].y : wq[q][mf][1].x;
              af[q][mf][0] = C128 ? code_pair_128(w_g, i0) : code_pair_lop3(w_g, i0);
              af[q][mf][1] = C128 ? code_pair_128(w_g8, i0) : code_pair_lop3(w_g8, i0);
              af[q][mf][2] = C128 ? code_pair_128(w_g, i0 + 1) : code_pair_lop3(w_g, i0 + 1);
              af[q][mf][3] = C128 ? code_pair_128(w_g8, i0 + 1) : code_pair_lop3(w_g8, i0 + 1);
            }
#pragma unroll
          for (int nb = 0; nb < NB; ++nb) {
            // B: token nb*8 + g's pairs for lane t, PARTS parts.
            uint2 xb[PARTS];
#pragma unroll
            for (int pt = 0; pt < PARTS; ++pt) xb[pt] = st.xb[s][pt][nb * 8 + g][t];
#pragma unroll
            for (int q = 0; q < NW; ++q)
#pragma unroll
              for (int mf = 0; mf < MF; ++mf)
#pragma unroll
                for (int pt = PARTS - 1; pt >= 0; --pt)  // small parts first
                  mma_bf16(d[q][mf][nb], af[q][mf][0], af[q][mf][1], af[q][mf][2], af[q][mf][3], xb[pt].x, xb[pt].y);
          }
        }
        // y += s * Σ q x + b * Σ x for this group: features (g, g+8) of each m16 fragment, tokens
        // (2t, 2t+1) of each of the NB n8 fragments (the others hold no row of the tile).
        float2 sx[NB];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) sx[nb] = *reinterpret_cast<const float2*>(&st.gsum[nb * 8 + 2 * t]);
        const int sp = (G >> gpg_shift) & 1;
#pragma unroll
        for (int q = 0; q < NW; ++q)
#pragma unroll
          for (int mf = 0; mf < MF; ++mf) {
            const int fl = warp * 16 * MF + mf * 16 + g;
            float s0, b0, s1, b1;
            if (tiled) {  // [tile][g]: (scale, bias) of row g, then of row g + 8, bf16
              tile_scales(*reinterpret_cast<const uint2*>(&st.sb[(((q * TB + warp * MF + mf) * 8) + g) * 2]), s0, b0, s1,
                          b1);
            } else {
              const uint2 sb_g = *reinterpret_cast<const uint2*>(&st.sb[(q * BF + fl) * 2]);
              const uint2 sb_g8 = *reinterpret_cast<const uint2*>(&st.sb[(q * BF + fl + 8) * 2]);
              const uint32_t sel0 = scales.sel(par0[mf][0] ^ sp), sel1 = scales.sel(par0[mf][1] ^ sp);
              s0 = scales.value(sb_g.x, sel0), b0 = scales.value(sb_g.y, sel0);
              s1 = scales.value(sb_g8.x, sel1), b1 = scales.value(sb_g8.y, sel1);
            }
            if constexpr (C128) {
              b0 = bias_128(b0, s0);
              b1 = bias_128(b1, s1);
            }
#pragma unroll
            for (int nb = 0; nb < NB; ++nb) {
              float* c = acc[q][mf][nb];
              const float* e = d[q][mf][nb];
              c[0] = fmaf(s0, e[0], fmaf(b0, sx[nb].x, c[0]));
              c[1] = fmaf(s0, e[1], fmaf(b0, sx[nb].y, c[1]));
              c[2] = fmaf(s1, e[2], fmaf(b1, sx[nb].x, c[2]));
              c[3] = fmaf(s1, e[3], fmaf(b1, sx[nb].y, c[3]));
            }
          }
      };
      switch (nb_used) {  // block-uniform
        case 1: group_mmas(std::integral_constant<int, 1>{}); break;
        case 2: group_mmas(std::integral_constant<int, 2>{}); break;
        case 3: group_mmas(std::integral_constant<int, 3>{}); break;
        default: group_mmas(std::integral_constant<int, 4>{}); break;
      }
      if constexpr (!SC) {
#pragma unroll
        for (int q = 0; q < NW; ++q)
#pragma unroll
          for (int mf = 0; mf < MF; ++mf) {
            wq[q][mf][0] = wn[q][mf][0];
            wq[q][mf][1] = wn[q][mf][1];
          }
      }
    }
  }
  if (!active) return;
  // Store: d0/d1 are feature g at tokens 2t, 2t+1 of each n8 fragment, d2/d3 feature g+8. The output
  // and the dense job's epilogue are read here, not held in registers through the loop.
  float* const y = MODE == kQ4Dense ? a.job[job].y : a.y;
  const int ldy = MODE == kQ4Dense ? a.job[job].ldy : a.ldy;
  const Epilogue epi = MODE == kQ4Dense ? a.job[job].epi : Epilogue::None;
  const float epi_arg = MODE == kQ4Dense ? a.job[job].epi_arg : 1.0f;
#pragma unroll
  for (int nb = 0; nb < 4; ++nb)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int row = drow[nb * 8 + 2 * t + c];
      if (row < 0) continue;
      float* yr = y + static_cast<size_t>(row) * ldy;
      if (MODE == kQ4Dense && a.split.partial)
        yr = a.split.partial + blockIdx.z * a.split.stride + a.split.off[job] + static_cast<int64_t>(row) * w0.rows;
#pragma unroll
      for (int mf = 0; mf < MF; ++mf)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int f = f_warp + mf * 16 + h * 8 + g;
          if (f >= w0.rows) continue;
          const float v0 = acc[0][mf][nb][2 * h + c];
          if constexpr (MODE == kQ4GateUp) yr[f] = siluf_(v0) * acc[NW - 1][mf][nb][2 * h + c];
          else if constexpr (MODE == kQ4Dense) yr[f] = a.split.partial ? v0 : apply_epilogue(v0, epi, epi_arg);
          else yr[f] = v0;
        }
    }
}

// Scratch for one call's split activations (stream-ordered: freed after the call's kernels).
struct XFrag {
  uint8_t* mem = nullptr;
  uint2* xf = nullptr;
  float* gsum = nullptr;
  float* row_inv = nullptr;  // the fp16 form's 2^-e per row (null in the bf16 forms)
};

// Whether the tile layout is written by q4_xfrag_tiles8_kernel (the default; CK_XFRAG_TILES8=0 or
// set_xfrag_tiles8(0): q4_xfrag_kernel).
int g_xfrag_tiles8 = -1;
bool xfrag_tiles8_on() {
  if (g_xfrag_tiles8 < 0) g_xfrag_tiles8 = env_is("CK_XFRAG_TILES8", "0") ? 0 : 1;
  return g_xfrag_tiles8 == 1;
}

// Whether q4_xfrag_tiles8_kernel's grid splits the groups when the chunk has few rows (the default;
// CK_XFRAG_SPLIT=0 keeps one block per 8 rows, to compare).
bool xfrag_split_groups() {
  static const bool on = !env_is("CK_XFRAG_SPLIT", "0");
  return on;
}

// wg: 0 (q4_tile_kernel's layout), 1 (q4_wg_dense_kernel's) or 2 (q4_wg_bulk_kernel's tiles of
// tile_rows rows, Σ x inside). f16 (wg == 2, two parts): the fp16 form's parts and row scales.
XFrag make_xfrag(const float* x, int ldx, int rows, int K, int groups, int parts, cudaStream_t stream, int wg = 0,
                 int tile_rows = 64, bool sum_parts = false, bool f16 = false, const XNorm* xn = nullptr) {
  CK_REQUIRE(!f16 || (wg == 2 && parts == 2 && !sum_parts), "make_xfrag: the fp16 form with layout %d, %d parts", wg,
             parts);
  XFrag f;
  const int grid_rows = wg == 2 ? static_cast<int>(round_up(rows, tile_rows)) : rows;
  const size_t xf_bytes = wg == 2 ? static_cast<size_t>(grid_rows / tile_rows) * groups *
                                        q4_wg_act_block_bytes(parts, tile_rows)
                                  : static_cast<size_t>(rows) * groups * kQ4GroupU2 * sizeof(uint2);
  const size_t gsum_bytes = wg == 2 ? 0 : sizeof(float) * rows * groups;
  const size_t inv_bytes = f16 ? sizeof(float) * grid_rows : 0;
  CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&f.mem), xf_bytes + gsum_bytes + inv_bytes, stream));
  f.xf = reinterpret_cast<uint2*>(f.mem);
  f.gsum = wg == 2 ? nullptr : reinterpret_cast<float*>(f.mem + xf_bytes);
  f.row_inv = f16 ? reinterpret_cast<float*>(f.mem + xf_bytes + gsum_bytes) : nullptr;
  const bool tiles8 =
      wg == 2 && xfrag_tiles8_on() && tile_rows % 8 == 0 && ldx % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  CK_REQUIRE(!xn || (tiles8 && !f16), "make_xfrag: the mix's norm on the fly needs the 8-row split of bf16 parts");
  if (tiles8) {
    // Enough blocks for four per SM (at least), the groups split evenly between them.
    const int row_blocks = grid_rows / 8, max_splits = static_cast<int>(ceil_div(groups, 8));
    const int splits = xfrag_split_groups() ? std::clamp(static_cast<int>(ceil_div(4 * sm_count(), row_blocks)), 1, max_splits) : 1;
    q4_xfrag_tiles8_kernel<<<dim3(static_cast<unsigned>(row_blocks), static_cast<unsigned>(splits)), 256, 0, stream>>>(
        x, ldx, rows, K, groups, parts, tile_rows, f.xf, f.row_inv, xn ? *xn : XNorm{});
  } else
    q4_xfrag_kernel<<<static_cast<unsigned>(grid_rows), kQ4Threads, 0, stream>>>(
        x, ldx, rows, K, groups, parts, wg, tile_rows, f.xf, f.gsum, sum_parts ? 1 : 0, f.row_inv);
  CUDA_CHECK_LAUNCH();
  return f;
}

}  // namespace

bool expert_q4_ok(const DMatrix& m) {
  // Groups of 64 x 2^k: the decode kernels (gemv_tc4.cu, gemv_experts.cu: Tc4Rows) find a code's scale
  // group by a shift.
  const int gpg = m.fmt.group / 64;
  return m.quantized() && m.fmt.bits == 4 && m.fmt.group % 64 == 0 && (gpg & (gpg - 1)) == 0 &&
         m.cols % m.fmt.group == 0 && m.rows >= 1;
}

namespace {

template <int PARTS, int STAGES>
constexpr int q4_stages_bytes() { return STAGES * static_cast<int>(sizeof(Q4StageT<PARTS>)); }  // 3 stages, 2 parts: 54 KB

// q4_tile_kernel's shared-memory stages (CK_Q4_STAGES: 3, 4 or 6; set_q4_stages): 3 by default. A
// request becomes the largest compiled count not above it (at least 3).
int q4_compiled_stages(int v) { return v >= 6 ? 6 : v >= 4 ? 4 : 3; }
int g_q4_stages = -1;
int q4_stages() {
  if (g_q4_stages < 0) {
    const char* e = std::getenv("CK_Q4_STAGES");
    g_q4_stages = q4_compiled_stages(e ? std::atoi(e) : 3);
  }
  return g_q4_stages;
}

// Whether the grouped experts' products take q4_tile_kernel's C128 form (CK_Q4_CODES128=1;
// set_q4_codes128): off by default.
int g_q4_codes128 = -1;
bool q4_codes128() {
  if (g_q4_codes128 < 0) g_q4_codes128 = env_is("CK_Q4_CODES128", "1") ? 1 : 0;
  return g_q4_codes128 == 1;
}

// One launch of q4_tile_kernel<MODE, PARTS (prefill_parts), SC (codes staged unless
// CK_Q4_STAGE_CODES=0), STAGES (q4_stages; 3 without SC or with C128)>, empty fragments skipped unless
// CK_Q4_SKIP_EMPTY=0; the first launch of each form raises its dynamic shared-memory limit.
template <int MODE, int PARTS, bool SC, int STAGES, bool C128 = false>
void launch_q4_form(const dim3& grid, const Q4Args& a, cudaStream_t stream) {
  constexpr int smem = q4_stages_bytes<PARTS, STAGES>();
  static const bool ready = [] {
    CUDA_CHECK(cudaFuncSetAttribute(q4_tile_kernel<MODE, PARTS, SC, STAGES, C128>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return true;
  }();
  (void)ready;
  q4_tile_kernel<MODE, PARTS, SC, STAGES, C128><<<grid, kQ4TileWarps * 32, smem, stream>>>(a);
  CUDA_CHECK_LAUNCH();
}

template <int MODE, int PARTS>
void launch_q4_parts(const dim3& grid, const Q4Args& a, bool sc, bool c128, cudaStream_t stream) {
  if (c128) return launch_q4_form<MODE, PARTS, true, 3, true>(grid, a, stream);
  if (!sc) return launch_q4_form<MODE, PARTS, false, 3>(grid, a, stream);
  switch (q4_stages()) {
    case 6: return launch_q4_form<MODE, PARTS, true, 6>(grid, a, stream);
    case 4: return launch_q4_form<MODE, PARTS, true, 4>(grid, a, stream);
    default: return launch_q4_form<MODE, PARTS, true, 3>(grid, a, stream);
  }
}

// c128: the call's activations were split with sum_parts (launch_experts_q4): the C128 form.
template <int MODE>
void launch_q4_tile(const dim3& grid, Q4Args a, int parts, cudaStream_t stream, bool c128 = false) {
  static const bool sc = !env_is("CK_Q4_STAGE_CODES", "0");
  static const bool all_fragments = env_is("CK_Q4_SKIP_EMPTY", "0");
  a.all_fragments = all_fragments;
  if (parts == 2) launch_q4_parts<MODE, 2>(grid, a, sc, c128, stream);
  else launch_q4_parts<MODE, 3>(grid, a, sc, c128, stream);
}

// One grouped expert product: x (x_rows rows of width K, a multiple of 64) split into fragments, then
// q4_tile_kernel over (features / block, tiles).
template <int MODE>
void launch_experts_q4(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                       int max_tiles, int features, const float* x, int ldx, int x_rows, int K, float* y, int ldy,
                       cudaStream_t stream) {
  CK_REQUIRE(K % 64 == 0 && x_rows >= 1, "experts q4: K %d, rows %d", K, x_rows);
  const int groups = K / 64;
  const bool c128 = q4_codes128();
  XFrag f = make_xfrag(x, ldx, x_rows, K, groups, prefill_parts(), stream, 0, 64, c128);
  Q4Args a{};
  a.pairs = pairs; a.order = order; a.tiles = tiles; a.n_tiles = n_tiles;
  a.xf = f.xf; a.gsum = f.gsum; a.groups = groups; a.y = y; a.ldy = ldy;
  const dim3 grid(static_cast<unsigned>(ceil_div(features, q4_block_features<MODE>())), static_cast<unsigned>(max_tiles));
  launch_q4_tile<MODE>(grid, a, prefill_parts(), stream, c128);
  CUDA_CHECK(cudaFreeAsync(f.mem, stream));
}

}  // namespace

void set_prefill_parts(int parts) { g_prefill_parts = parts; }
void set_q4_codes128(int on) { g_q4_codes128 = on < 0 ? -1 : (on ? 1 : 0); }
void set_q4_stages(int stages) { g_q4_stages = stages < 0 ? -1 : q4_compiled_stages(stages); }
void set_xfrag_tiles8(int on) { g_xfrag_tiles8 = on < 0 ? -1 : (on ? 1 : 0); }

// Rows from which the dense products take the wgmma kernel: 256 (CK_Q4_WG_MIN_ROWS). It was 768 while
// the kernel took 64 tokens a block (at 496 rows it lost 5-7% of prefill, 2026-11-30 18:43Z: half the
// row tiles of q4_tile_kernel, one block per SM; 256 lost 2.3% at 512 tokens on 2026-12-01 02:15Z).
// With the 128-token bulk form, 256 gained 3-4% at 512 tokens in two calls (2026-12-01 04:41Z and
// 06:17Z) and left 2k and 8k level. set_q4_wg_min_rows: tests and comparisons.
static int g_q4_wg_min_rows = -1;
int q4_wg_min_rows() {
  if (g_q4_wg_min_rows < 0) {
    const char* e = std::getenv("CK_Q4_WG_MIN_ROWS");
    g_q4_wg_min_rows = e ? std::max(1, std::atoi(e)) : 256;
  }
  return g_q4_wg_min_rows;
}
// Set by set_q4_wg_min_rows: the tests choose the kernel by rows alone (no K threshold).
static bool g_q4_wg_rows_only = false;
void set_q4_wg_min_rows(int rows) {
  g_q4_wg_min_rows = rows < 0 ? -1 : std::max(1, rows);
  g_q4_wg_rows_only = rows >= 0;
}
static int g_q4_wg_wide = -1;  // set_q4_wg_wide: -1, CK_Q4_WG_WIDE decides (on unless "0")
void set_q4_wg_wide(int on) { g_q4_wg_wide = on < 0 ? -1 : (on ? 1 : 0); }
static int g_q4_wg_fold = -1;  // set_q4_wg_fold: -1, CK_Q4_WG_FOLD decides (3 unless "0" or "1")
void set_q4_wg_fold(int mode) { g_q4_wg_fold = mode < 0 ? -1 : mode == 3 ? 3 : (mode ? 1 : 0); }
static int g_q4_wg_f16 = -1;  // set_q4_wg_f16: -1, CK_Q4_WG_F16 decides (on unless "0"); 4: on, four warpgroups
void set_q4_wg_f16(int on) { g_q4_wg_f16 = on < 0 ? -1 : on == 4 ? 4 : (on ? 1 : 0); }
// Warpgroups a block in the fp16 form when fixed: 3 (set_q4_wg_f16(1), CK_Q4_WG_F16_WGS=3) or 4
// (set_q4_wg_f16(4), CK_Q4_WG_F16_WGS=4); 0: gemm_q4 chooses per call.
static int q4_wg_f16_units() {
  static const int env = env_is("CK_Q4_WG_F16_WGS", "4") ? 4 : env_is("CK_Q4_WG_F16_WGS", "3") ? 3 : 0;
  return g_q4_wg_f16 == 4 ? 4 : g_q4_wg_f16 == 1 ? 3 : env;
}

void expert_gate_up_q4(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                       int max_tiles, int max_inter, const float* x, int ldx, int x_rows, int hidden, float* h, int ldh,
                       cudaStream_t stream) {
  launch_experts_q4<kQ4GateUp>(pairs, order, tiles, n_tiles, max_tiles, max_inter, x, ldx, x_rows, hidden, h, ldh,
                               stream);
}

void expert_down_q4(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                    int max_tiles, int hidden, int max_inter, const float* h, int ldh, int n_pairs, float* y, int ldy,
                    cudaStream_t stream) {
  launch_experts_q4<kQ4Down>(pairs, order, tiles, n_tiles, max_tiles, hidden, h, ldh, n_pairs, max_inter, y, ldy,
                             stream);
}

// Which kernel gemm_q4 runs for these jobs (parts 2 or 3): none (ok false: gemm_tc's other kernels take
// them), q4_tile_kernel, or the warpgroup kernel in one of its forms.
struct Q4Form {
  bool ok = false;
  bool tiled = false;     // some job's matrix is in 16-row tiles
  int tiles = 0;          // q4_tile_kernel's feature tiles over all jobs
  bool wg = false;        // the warpgroup-MMA kernel (gemm_q4_wg.cu)
  bool bulk = false;      // its bulk-copy form
  int block_tokens = 64;  // tokens a block
  int fold_mode = 0;      // its folded form: 0 off, 1 two warpgroups a block, 3 three
  bool f16 = false;       // the folded three-warpgroup form in fp16 (gemm_q4_wg.cu "The fp16 form")
};
static Q4Form q4_form(const GemvJob* jobs, int n_jobs, int rows, int parts) {
  const int K = jobs[0].w.cols;
  Q4Form f;
  int& tiles = f.tiles;
  const bool tiled = f.tiled = any_tiled(jobs, n_jobs);  // only these kernels read them (no fallback to gemm.cu's)
  for (int j = 0; j < n_jobs; ++j) {
    if (!expert_q4_ok(jobs[j].w) || jobs[j].w.cols != K) return f;
    // q4_tile_kernel reads 2-byte scales and biases out of aligned 4-byte words.
    if (reinterpret_cast<uintptr_t>(jobs[j].w.scales) % 4 || reinterpret_cast<uintptr_t>(jobs[j].w.biases) % 4) return f;
    tiles += static_cast<int>(ceil_div(jobs[j].w.rows, q4_block_features<kQ4Dense>()));
  }
  static const bool on = !env_is("CK_Q4_DENSE", "0");
  CK_REQUIRE(!tiled || (on && K >= 256), "gemm_q4: a matrix in 16-row tiles (K %d) with CK_Q4_DENSE=0 or K < 256", K);
  if (K < 256 || !on) return f;
  // Hopper: chunks of at least q4_wg_min_rows() rows go to the warpgroup-MMA kernel (gemm_q4_wg.cu;
  // CK_Q4_WGMMA=0 keeps q4_tile_kernel): 64 tokens x 256 features per block, one block per SM.
  static const bool wg_ok = !env_is("CK_Q4_WGMMA", "0") && device_attribute(cudaDevAttrComputeCapabilityMajor) == 9 &&
                            device_attribute(cudaDevAttrComputeCapabilityMinor) == 0 && q4_wg_ready();
  static_assert(kQ4WgFeatures == q4_block_features<kQ4Dense>(), "the two dense kernels tile alike");
  static const int wg_tokens = env_is("CK_Q4_WG_TOKENS", "32") ? 32 : 64;  // 32: to compare
  // The warpgroup kernel's form for these jobs, if it takes them. Every matrix in 16-row tiles, 64
  // tokens per block: the bulk-copy form (CK_Q4_WG_BULK=0 keeps q4_wg_dense_kernel, to compare).
  static const bool bulk_on = !env_is("CK_Q4_WG_BULK", "0");
  const bool bulk_form = bulk_on && all_tiled(jobs, n_jobs) && wg_tokens == 64;
  // The bulk kernel with 128 tokens x 64 features per warpgroup, the default since 2026-12-01 (prefill
  // +4.0% / +3.2% at 2k / 8k tokens, 04:16Z); CK_Q4_WG_WIDE=0 or set_q4_wg_wide(0) keeps 64 x 128.
  static const bool wide_env = !env_is("CK_Q4_WG_WIDE", "0");
  const bool wide_on = g_q4_wg_wide < 0 ? wide_env : g_q4_wg_wide > 0;
  const int form_tokens = bulk_form && wide_on ? 128 : wg_tokens;
  // The 128-token bulk kernel's folded form (gemm_q4_wg.cu: the scales in the A operand, the bias term as
  // products, no per-group epilogue), two parts of x only, with three warpgroups a block: the default
  // since 2026-12-03 (H200, same call: the dense products -5% with two warpgroups a block, then -14%
  // to -19% more with three; prefill +4-7% at 8k tokens). CK_Q4_WG_FOLD=1 or set_q4_wg_fold(1) for two
  // warpgroups a block, 0 for the factored form.
  static const int fold_env = env_is("CK_Q4_WG_FOLD", "0") ? 0 : env_is("CK_Q4_WG_FOLD", "1") ? 1 : 3;
  const int fold_form = form_tokens == 128 && parts == 2 ? (g_q4_wg_fold < 0 ? fold_env : g_q4_wg_fold) : 0;
  // Calls with K < 512 (CK_Q4_WG_MIN_K) stay on q4_tile_kernel unless the folded three-warpgroup form
  // takes them: with a few groups per block (the mix's up projection, K = 320: five) the factored
  // warpgroup kernel's one block per SM waits on its copies, where q4_tile_kernel runs two (mix up
  // 3.13 -> 2.41 us per 8k prefill token, 2026-12-01 02:23Z); the folded form is faster there (mix up
  // 2.12 -> 1.96 at 8k, 2.60 -> 2.39 at 2k, 4.36 -> 4.19 at 512, profiles of 2026-12-03 17:58Z).
  static const int wg_min_k_env = [] {
    const char* e = std::getenv("CK_Q4_WG_MIN_K");
    return e ? std::max(0, std::atoi(e)) : -1;
  }();
  const int wg_min_k = wg_min_k_env >= 0 ? wg_min_k_env : fold_form == 3 ? 0 : 512;
  f.wg = wg_ok && rows >= q4_wg_min_rows() && (g_q4_wg_rows_only || K >= wg_min_k);
  f.bulk = f.wg && bulk_form;
  f.block_tokens = f.wg ? form_tokens : wg_tokens;
  f.fold_mode = f.wg ? fold_form : 0;
  // The folded form's fp16 arithmetic (A = s (q - 8) in one fp16 part, x in two fp16 parts of a scaled
  // row: two wgmmas per product instead of three) where every matrix's scales allow it and the call
  // has at least CK_Q4_WG_F16_MIN_ROWS output features (1,024): its activation split reads each x row
  // twice (the row's largest magnitude first), a cost per x element, while the MMAs it saves are per
  // x element and feature. H100 2026-12-06 (Nsight Compute, 8k-row chunks, us a call): in_proj
  // (16,480 features) 3,064 -> 2,722 for ~33 more in its split; the mix's down projection (324
  // features, K = 10,240) 290 -> 254 for ~133 more: a loss, so it keeps the bf16 form. CK_Q4_WG_F16=0
  // or set_q4_wg_f16(0) keeps the bf16 form everywhere; set_q4_wg_f16(1) takes the fp16 one whatever
  // the features (tests).
  static const bool f16_env = !env_is("CK_Q4_WG_F16", "0");
  static const int f16_min_rows = [] {
    const char* e = std::getenv("CK_Q4_WG_F16_MIN_ROWS");
    return e ? std::max(0, std::atoi(e)) : 1024;
  }();
  int64_t features = 0;
  for (int j = 0; j < n_jobs; ++j) features += jobs[j].w.rows;
  bool f16 = f.bulk && f.fold_mode == 3 &&
             (g_q4_wg_f16 < 0 ? f16_env && features >= f16_min_rows : g_q4_wg_f16 > 0);
  for (int j = 0; j < n_jobs && f16; ++j) f16 = jobs[j].w.fmt.f16_exact != 0;
  f.f16 = f16;
  f.ok = true;
  return f;
}

static std::atomic<uint64_t> g_hc_xnorm_calls{0};
uint64_t hc_xnorm_calls() { return g_hc_xnorm_calls.load(); }

bool gemm_q4(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream, int parts,
             const XNorm* xn) {
  if (n_jobs < 1 || n_jobs > kMaxGemvJobs || rows < 1) return false;
  if (parts == 0) parts = prefill_parts();
  CK_REQUIRE(parts == 2 || parts == 3, "gemm_q4: %d bf16 parts of x (2 or 3)", parts);
  const Q4Form form = q4_form(jobs, n_jobs, rows, parts);
  if (!form.ok) return false;
  const int K = jobs[0].w.cols;
  int tiles = form.tiles;
  const bool tiled = form.tiled, wg = form.wg, bulk = form.bulk;
  const int block_tokens = form.block_tokens, fold_mode = form.fold_mode;
  const bool fold = fold_mode > 0;
  // Split K when the grid fills its last wave poorly (two q4_tile_kernel blocks per SM, or one wgmma
  // block): the hyper-connection down projection (2 blocks per 64 tokens over K = 10,240: 64 blocks
  // for 2,048 rows) and the DeltaNet out projection (320 blocks: 1.2 waves). The fewest splits whose waves are
  // >= 85% full, each split at least 8 groups long; the partial sums cost a write and a read of the
  // output per split. K < 256 stays on gemm.cu.
  const int row_tiles = static_cast<int>(ceil_div(rows, wg ? block_tokens : 32)), groups = K / 64;
  const int64_t slots = (wg ? 1 : 2) * static_cast<int64_t>(sm_count());
  auto choose_splits = [&](int64_t blocks) {
    auto fill = [&](int s) {
      const double waves = static_cast<double>(blocks * s) / static_cast<double>(slots);
      return waves / std::ceil(waves);
    };
    int splits = 1;
    const int max_splits = std::min(16, groups / 8);
    for (int s = 2; fill(splits) < 0.85 && s <= max_splits; ++s)
      if (fill(s) > fill(splits)) splits = s;
    return splits;
  };
  Q4WgArgs w;
  if (wg) {
    w.n_jobs = n_jobs;
    for (int j = 0; j < n_jobs; ++j) w.job[j] = jobs[j];
    // The jobs' units (128 features, or 64 for 128 tokens), two to a block, three in the folded
    // three-warpgroup form, or three or four in its fp16 form (dense_args fills the rest).
    int per_block = fold_mode == 3 ? 3 : 2;
    if (form.f16) {
      // The fp16 form takes three or four units a block, whichever leaves the shorter estimated time:
      // waves x units a block x groups a block, four units 3% dearer per unit (their one set of A
      // registers) and each split of K 3% more (its partial sums and their reduce). H100 2026-12-06,
      // 8k-row chunks: in_proj 4.18 -> 4.29 us a token with four, out_proj 1.89 -> 1.86; at 496 rows,
      // where three leave a last wave 60% full (in_proj) or need 7 splits of K against 3 (out_proj,
      // o_proj), in_proj 6.2 -> 5.7, out_proj 4.3 -> 3.8, o_proj 1.42 -> 1.27. CK_Q4_WG_F16_WGS=3 or 4
      // fixes it.
      const int fixed = q4_wg_f16_units();
      auto cost = [&](int u) {
        const int64_t b = static_cast<int64_t>(q4_wg_units(w, q4_wg_unit_features(block_tokens), u)) * row_tiles;
        const int sp = choose_splits(b);
        const double waves = std::ceil(static_cast<double>(b * sp) / static_cast<double>(slots));
        return waves * u * std::ceil(static_cast<double>(groups) / sp) * (u == 4 ? 1.03 : 1.0) * (1.0 + 0.03 * (sp - 1));
      };
      per_block = fixed ? fixed : cost(4) < cost(3) ? 4 : 3;
    }
    tiles = q4_wg_units(w, q4_wg_unit_features(block_tokens), per_block);
  }
  const int64_t blocks = static_cast<int64_t>(tiles) * row_tiles;
  int splits = choose_splits(blocks);
  if (!wg && blocks < sm_count() && splits < 2 && !tiled) return false;
  const int k_groups = static_cast<int>(ceil_div(groups, splits));
  splits = static_cast<int>(ceil_div(groups, k_groups));
  CK_REQUIRE(!xn || (bulk && !form.f16), "gemm_q4: the mix's norm on the fly outside the bf16 bulk form");
  if (xn) g_hc_xnorm_calls.fetch_add(1);
  XFrag f = make_xfrag(x, ldx, rows, K, groups, parts, stream, bulk ? 2 : wg ? 1 : 0, block_tokens, false, form.f16, xn);
  const SplitK split = splits > 1 ? split_k_start(jobs, n_jobs, rows, splits, stream) : SplitK{};
  // The dense launch's arguments, the same fields in either kernel's struct (the jobs' blocks: w's
  // first_unit from q4_wg_units, or a's first_tile below).
  auto dense_args = [&](auto& d) {
    d.n_jobs = n_jobs;
    d.rows = rows;
    d.k_groups = k_groups;
    for (int j = 0; j < n_jobs; ++j) d.job[j] = jobs[j];
    d.xf = f.xf;
    d.gsum = f.gsum;
    d.groups = groups;
    d.split = split;
  };
  w.x_inv = f.row_inv;  // (the fp16 form's row scales; null otherwise)
  if (wg) {
    dense_args(w);
    if (bulk)
      launch_q4_wg_bulk(static_cast<unsigned>(tiles), static_cast<unsigned>(splits), w, parts, block_tokens, fold, stream);
    else launch_q4_wg_dense(static_cast<unsigned>(tiles), static_cast<unsigned>(splits), w, parts, block_tokens, stream);
  } else {
    Q4Args a{};
    dense_args(a);
    int t = 0;
    for (int j = 0; j < n_jobs; ++j) {
      a.first_tile[j] = t;
      t += static_cast<int>(ceil_div(jobs[j].w.rows, q4_block_features<kQ4Dense>()));
    }
    a.first_tile[n_jobs] = t;
    launch_q4_tile<kQ4Dense>(
        dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(row_tiles), static_cast<unsigned>(splits)), a, parts,
        stream);
  }
  if (splits > 1) split_k_finish(split, jobs, n_jobs, splits, stream);
  CUDA_CHECK(cudaFreeAsync(f.mem, stream));
  return true;
}

static int g_hc_up_gate_mean = -1;  // set_hc_up_gate_mean: -1, CK_HC_UP_GATE_MEAN decides (on unless "0")
void set_hc_up_gate_mean(int on) { g_hc_up_gate_mean = on < 0 ? -1 : (on ? 1 : 0); }
static bool hc_up_gate_mean_on() {
  static const bool env_on = !env_is("CK_HC_UP_GATE_MEAN", "0");
  return g_hc_up_gate_mean < 0 ? env_on : g_hc_up_gate_mean > 0;
}

static int g_hc_gm_persistent = -1;  // set_hc_gm_persistent: -1, CK_HC_GM_PERSISTENT decides (off unless "1")
void set_hc_gm_persistent(int on) { g_hc_gm_persistent = on < 0 ? -1 : (on ? 1 : 0); }
static bool hc_gm_persistent_on() {
  static const bool env_on = env_is("CK_HC_GM_PERSISTENT", "1");
  return g_hc_gm_persistent < 0 ? env_on : g_hc_gm_persistent > 0;
}

// Whether the persistent form takes an up projection whose prefill form is `form`.
static bool hc_gm_persistent_takes(const Q4Form& form, const GemvJob& up, int S) {
  return hc_gm_persistent_on() && form.ok && form.f16 && up.w.cols / 64 <= kQ4WgGateMeanMaxGroups &&
         q4_wg_gate_mean_persistent_ready(S);
}

bool hc_gm_persistent_applies(const GemvJob& up, int rows, int S) {
  return hc_gm_persistent_on() && hc_gm_persistent_takes(q4_form(&up, 1, rows, prefill_parts()), up, S);
}

bool hc_up_gate_mean(const GemvJob& up, const float* d, int ldd, int rows, const float* X, int ldX, int S, int H,
                     float* u, int ldu, cudaStream_t stream, const XNorm* xn) {
  if (!hc_up_gate_mean_on()) return false;
  if (rows < 1 || up.epi != Epilogue::None || H % 64 || up.w.rows != static_cast<int64_t>(S) * H || ldX % 4 || ldu % 4 ||
      reinterpret_cast<uintptr_t>(X) % 16 || reinterpret_cast<uintptr_t>(u) % 16)
    return false;
  const int parts = prefill_parts();
  const Q4Form form = q4_form(&up, 1, rows, parts);
  // The fused kernel is the folded three-warpgroup form of 128 tokens, the one gemm_q4 runs for the up
  // projection of a prefill chunk, so g is the same; no K split (K is hc_lowrank, 5 groups at the
  // released geometry, and gemm_q4 splits none below 16 groups; above, the sums would differ from its
  // split ones in rounding only).
  if (!form.ok || !form.bulk || form.block_tokens != 128 || form.fold_mode != 3 || !q4_wg_gate_mean_ready(S))
    return false;
  const int K = static_cast<int>(up.w.cols), groups = K / 64;
  Q4WgArgs w;
  w.n_jobs = 1;
  w.job[0] = up;
  q4_wg_units(w, q4_wg_unit_features(128), 3);
  w.rows = rows;
  w.groups = groups;
  w.k_groups = groups;
  w.hc_x = X;
  w.ld_x = ldX;
  if (xn) {  // X is R, normalised where the epilogue reads it
    w.hc_rinv = xn->rinv;
    w.hc_scale = xn->scale;
  }
  w.hc_u = u;
  w.ld_u = ldu;
  w.hc_s = S;
  w.hc_h = H;
  static const bool prefetch = !env_is("CK_HC_GM_PREFETCH", "0");
  w.hc_prefetch = prefetch ? 1 : 0;
  const bool persistent = hc_gm_persistent_takes(form, up, S);
  XFrag f = make_xfrag(d, ldd, rows, K, groups, parts, stream, 2, persistent ? 64 : 128, false, form.f16);
  w.xf = f.xf;
  w.gsum = f.gsum;
  w.x_inv = f.row_inv;
  if (persistent) launch_q4_wg_gate_mean_persistent(w, stream);
  else launch_q4_wg_gate_mean(w, stream);
  CUDA_CHECK(cudaFreeAsync(f.mem, stream));
  return true;
}

static int g_hc_xnorm = -1;  // set_hc_xnorm: -1, CK_HC_XNORM decides (on unless "0")
void set_hc_xnorm(int on) { g_hc_xnorm = on < 0 ? -1 : (on ? 1 : 0); }

bool hc_mix_xnorm_ok(const GemvJob* down, int n_down, const GemvJob& up, const float* R, int ldR, int rows, int S,
                     int H) {
  static const bool env_on = !env_is("CK_HC_XNORM", "0");
  if (!(g_hc_xnorm < 0 ? env_on : g_hc_xnorm > 0)) return false;
  if (!hc_up_gate_mean_on()) return false;
  if (rows <= kMaxRows || n_down < 1 || H % 64 || ldR % 4 || reinterpret_cast<uintptr_t>(R) % 16 || !xfrag_tiles8_on() ||
      up.epi != Epilogue::None || up.w.rows != static_cast<int64_t>(S) * H)
    return false;
  const int parts = prefill_parts();
  const Q4Form fd = q4_form(down, n_down, rows, parts), fu = q4_form(&up, 1, rows, parts);
  return fd.ok && fd.wg && fd.bulk && !fd.f16 && parts == 2 && fu.ok && fu.bulk && fu.block_tokens == 128 &&
         fu.fold_mode == 3 && q4_wg_gate_mean_ready(S);
}

}  // namespace ck::cuda
