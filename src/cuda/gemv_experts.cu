// The decode experts' products on the tensor cores (the v4 GEMV arithmetic, one activation vector per
// pair, 1-8 rows of a step): the routed/shared experts' gate/up and down matrices read from ExpertPair
// views built on the device from the expert table, by direct loads (expert_tc4_kernel) or, for experts
// in 16-row tiles, by bulk copies into shared memory (one tile or chunk a block, or a streaming loop),
// with down's fragments built in the block; then their launchers (expert_gate_up_tc4, expert_down_tc4).
// The v1 and v2/v3 expert products are in gemv.cu and gemv_q.cu.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/bulk_copy.cuh"
#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/gemv_internal.h"
#include "cuda/mma_q4.cuh"
#include "cuda/ops.h"

namespace ck::cuda {
namespace {

// Debug timing (CK_EXPERT_TIMING=1: expert_timing_on()): each block of the step's last streaming
// gate/up, streaming down and fused kernel writes its entry, the end of its programmatic-launch wait
// and its exit (%globaltimer, ns) and its SM, so a step's expert hand-overs can be read against each
// other (bench_cuda prints them). Only the STAMP instances write; the default ones have no trace of it.
__device__ unsigned long long g_expert_stamps[kExpertStampKernels][kExpertStampBlocks][kExpertStampWords];
template <bool STAMP>
__device__ __forceinline__ void expert_stamp(int kernel, int point) {
  if constexpr (STAMP) {
    if (threadIdx.x == 0 && blockIdx.x < kExpertStampBlocks) {
      unsigned long long t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      g_expert_stamps[kernel][blockIdx.x][point] = t;
      if (point == 0) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        g_expert_stamps[kernel][blockIdx.x][3] = sm;
      }
    }
  }
}
// The block's exit: after every thread's work.
template <bool STAMP>
__device__ __forceinline__ void expert_stamp_exit(int kernel) {
  if constexpr (STAMP) {
    __syncthreads();
    expert_stamp<true>(kernel, 2);
  }
}

// Rows g and g + 8 of a one-row tile (tc4_one_mma's acc: columns 0-2 on lanes t = 0 and 1), summed
// (hi + mid) + lo, into y[row0 + g] and y[row0 + g + 8] below `rows`.
__device__ __forceinline__ void one_row_tile_store(const float (&acc)[4], float* y, int row0, int rows) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const float lo_g = __shfl_down_sync(0xffffffffu, acc[0], 1), lo_g8 = __shfl_down_sync(0xffffffffu, acc[2], 1);
  if (t == 0) {
    if (row0 + g < rows) y[row0 + g] = (acc[0] + acc[1]) + lo_g;
    if (row0 + g + 8 < rows) y[row0 + g + 8] = (acc[2] + acc[3]) + lo_g8;
  }
}

// The decode experts' partial tiles in shared memory (one activation row): part k's rows g and g + 8,
// columns 0-2 (hi, mid, lo), which lanes t = 0 (columns 0, 1) and t = 1 (column 2) hold in acc.
__device__ __forceinline__ void one_row_stash(float (&r)[16][4], const float (&acc)[4], int g, int t) {
  if (t < 2) {
    r[g][2 * t] = acc[0];
    r[g + 8][2 * t] = acc[2];
    if (t == 0) {
      r[g][1] = acc[1];
      r[g + 8][1] = acc[3];
    }
  }
}

// Row `row` of matrix m's tile from parts [0, n) of one_row_stash: each column summed over the parts in
// index order, then (hi + mid) + lo.
template <int NM>
__device__ __forceinline__ float one_row_value(const float (*red)[NM][16][4], int n, int m, int row) {
  float c[3];
  for (int q = 0; q < 3; ++q) {
    float sum = 0.0f;
    for (int k = 0; k < n; ++k) sum += red[k][m][row][q];
    c[q] = sum;
  }
  return (c[0] + c[1]) + c[2];
}

// The group loop of expert_tc4_kernel: NM matrices (gate and up, or down) of one pair, rows row0 + g
// and row0 + g + 8, groups [G0, G1), against the vector's fragments fv and group sums gv.
template <int NM, bool BF16S, int UNROLL>
__device__ __forceinline__ void expert_tc4_groups(const DMatrix (&w)[NM], int row0, int G0, int G1,
                                                  const uint2* __restrict__ fv, const float* __restrict__ gv,
                                                  float (&acc)[NM][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  Tc4Rows<BF16S> tr[NM];
#pragma unroll
  for (int m = 0; m < NM; ++m) tr[m].init(w[m], min(row0 + g, w[m].rows - 1), min(row0 + g + 8, w[m].rows - 1), t);
#pragma unroll UNROLL
  for (int G = G0; G < G1; ++G) {
    uint2 b[4];
    const float x0 = tc4_one_frags_group(fv, gv, G, t, b);
#pragma unroll
    for (int m = 0; m < NM; ++m) {
      uint2 wa, wb;
      float sa, ba, sb, bb;
      tr[m].load(G, wa, wb, sa, ba, sb, bb);
      tc4_one_mma_regs(wa, wb, sa, ba, sb, bb, b, x0, acc[m]);
    }
  }
}

// Decode experts on the tensor cores (v4 arithmetic, one activation vector per pair): warp (pair, tile
// of 16 rows, part) runs the gemv_tc4_kernel loop over its part of the pair's groups with the
// fragments of the pair's vector (GATE_UP: row pairs[p].x_row of x, both gate and up; otherwise row p
// of h through down). Each pair's matrices are read from its device-side view (any 4-bit form in
// groups of 64k, bf16/f16/f32 scales), so the kernel follows the expert table like the v3 kernels.
// GATE_UP writes h[p] = silu(gate x) * (up x); otherwise y[p] = down h[p]. grid: tiles / (8 / ks).
template <bool GATE_UP, int UNROLL>
__global__ void __launch_bounds__(256, GATE_UP ? 2 : 3) expert_tc4_kernel(const ExpertPair* __restrict__ pairs, int n_pairs,
                                                            int tiles_per_pair, int ks, const uint2* __restrict__ frag,
                                                            const float* __restrict__ gsum, int vec_groups,
                                                            float* __restrict__ out, int ldo) {
  pdl_begin();
  constexpr int NM = GATE_UP ? 2 : 1;
  __shared__ float red[8][NM][16][4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int part = warp % ks, tile_all = blockIdx.x * (8 / ks) + warp / ks;
  const int p = tile_all / tiles_per_pair, row0 = (tile_all % tiles_per_pair) * 16;
  DMatrix w[NM];
  bool valid = p < n_pairs;
  int vec = 0;
  if (valid) {
    const ExpertPair& pr = pairs[p];
    w[0] = GATE_UP ? pr.gate : pr.down;
    if constexpr (GATE_UP) w[NM - 1] = pr.up;
    vec = GATE_UP ? pr.x_row : p;
    valid = row0 < w[0].rows;
  }
  float acc[NM][4] = {};
  if (valid) {
    const int groups = w[0].cols / 64, per = (groups + ks - 1) / ks;
    const int G0 = min(groups, part * per), G1 = min(groups, G0 + per);
    const uint2* fv = frag + static_cast<size_t>(vec) * vec_groups * kOneFragWords + tc4_one_frag_lane(g, t);
    const float* gv = gsum + static_cast<size_t>(vec) * vec_groups;
    const uint8_t bf = static_cast<uint8_t>(WKind::BF16);
    if (w[0].fmt.scale_kind == bf && w[NM - 1].fmt.scale_kind == bf)
      expert_tc4_groups<NM, true, UNROLL>(w, row0, G0, G1, fv, gv, acc);
    else
      expert_tc4_groups<NM, false, UNROLL>(w, row0, G0, G1, fv, gv, acc);
  }
#pragma unroll
  for (int m = 0; m < NM; ++m) one_row_stash(red[warp][m], acc[m], g, t);
  __syncthreads();
  if (part != 0 || !valid || lane >= 16 || row0 + lane >= w[0].rows) return;
  float v[NM];
#pragma unroll
  for (int m = 0; m < NM; ++m) v[m] = one_row_value<NM>(red + warp, ks, m, lane);
  out[static_cast<size_t>(p) * ldo + row0 + lane] = GATE_UP ? siluf_(v[0]) * v[NM - 1] : v[0];
}

// Decode experts' gate and up products when the experts are in 16-row tiles (Model::tiled_experts):
// block (pair p, tile T) takes tile T of the pair's gate and up matrices, each all of its groups as
// one contiguous run of groups x 576 bytes, into shared memory with one bulk copy per matrix; then its
// 8 warps split the groups (warp w: [w per, (w + 1) per)), read codes and scales from shared memory
// and the vector's compact fragments (Tc4Frags) from global, and add their parts in warp order.
// Why: expert_tc4_kernel's warps load their tile groups one 576-byte group per warp at a time, two
// groups in flight, so a kernel of 20 MB (11 pairs of the full geometry) is a chain of memory round
// trips per warp; here a block asks for its 46 KB at once and every block of the kernel is resident
// (4 per SM), so the whole kernel's bytes are in flight from its start. Decode +3.4% at one row,
// +8.6% at 4 rows (564.4 against 546.1 and 1,052.4 against 968.5 tok/s, 2026-12-01 00:36Z, one call).
// grid (n_pairs * tiles_per_pair), block 256, dynamic shared memory 2 * groups * kTileGroupBytes.
// sh.k1 > 0 (the default; CK_EXPERT_SHARED_EARLY=0: not): the pairs follow the route's layout
// (SharedSlot), so the shared expert's blocks know their matrices and vector at their start and copy
// their tiles before the wait, while the route runs; after it only the routed experts' tiles are on
// the way. Measured (H200 2026-12-02 00:2xZ, three interleaved rounds): one-row decode 627.2 / 629.5
// / 629.3 tok/s against 615.6 / 620.9 / 622.5 (+1.5%), 4 rows 1,245.1 / 1,248.9 / 1,245.7 against
// 1,230.6 / 1,240.1 / 1,245.5 (+0.6%); the model tests passed with it.
__global__ void __launch_bounds__(256, 4) expert_gate_up_bulk_kernel(const ExpertPair* __restrict__ pairs,
                                                                    int tiles_per_pair, const uint2* __restrict__ frag,
                                                                    const float* __restrict__ gsum, int vec_groups,
                                                                    float* __restrict__ out, int ldo,
                                                                    const __grid_constant__ SharedSlot sh) {
  extern __shared__ __align__(128) uint8_t stile[];  // [gate, up][groups][576]
  __shared__ uint64_t bar;
  __shared__ float red[8][2][16][4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int p = blockIdx.x / tiles_per_pair, tile = blockIdx.x % tiles_per_pair, row0 = tile * kTileRows;
  const bool shared = sh.k1 > 0 && p % sh.k1 == sh.k1 - 1;  // block-uniform
  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_init_fence();
  }
  __syncthreads();
  const int groups = vec_groups;
  const uint32_t bytes = static_cast<uint32_t>(groups) * kTileGroupBytes;
  auto ask = [&](const DMatrix& gate, const DMatrix& up) {  // thread 0: the tile of both matrices
    mbar_arrive_expect(&bar, 2 * bytes);
    bulk_copy_1d(stile, gate.tile_group(tile, 0), bytes, &bar);
    bulk_copy_1d(stile + bytes, up.tile_group(tile, 0), bytes, &bar);
  };
  if (shared && threadIdx.x == 0 && row0 < sh.gate.rows) ask(sh.gate, sh.up);  // weights never change
  pdl_begin();  // the pairs (route) and the fragments (the mix) come from the kernels before
  const DMatrix gate = shared ? sh.gate : pairs[p].gate, up = shared ? sh.up : pairs[p].up;
  const int vec = shared ? p / sh.k1 : pairs[p].x_row;
  if (row0 >= gate.rows) return;  // block-uniform: this pair has fewer tiles (the shared expert's size)
  if (!gate.tiled() || !up.tiled() || gate.cols != vec_groups * 64 || up.cols != gate.cols) __trap();  // launch promise
  if (!shared && threadIdx.x == 0) ask(gate, up);
  const int per = (groups + 7) / 8, G0 = min(groups, warp * per), G1 = min(groups, G0 + per);
  const uint2* fv = frag + static_cast<size_t>(vec) * vec_groups * kOneFragWords + tc4_one_frag_lane(g, t);
  const float* gv = gsum + static_cast<size_t>(vec) * vec_groups;
  float acc[2][4] = {};
  mbar_wait(&bar, 0);
#pragma unroll 2
  for (int G = G0; G < G1; ++G) {
    uint2 b[4];
    const float x0 = tc4_one_frags_group(fv, gv, G, t, b);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      uint2 wa, wb;
      float sa, ba, sb, bb;
      tile_group_lds(stile + m * bytes + static_cast<size_t>(G) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
      tc4_one_mma_regs(wa, wb, sa, ba, sb, bb, b, x0, acc[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) one_row_stash(red[warp][m], acc[m], g, t);
  __syncthreads();
  if (warp != 0 || lane >= 16 || row0 + lane >= gate.rows) return;
  const float v0 = one_row_value<2>(red, 8, 0, lane), v1 = one_row_value<2>(red, 8, 1, lane);
  out[static_cast<size_t>(p) * ldo + row0 + lane] = siluf_(v0) * v1;
}

constexpr int kStreamWarpGroups = 6;  // the streaming kernel's groups a warp at most (K <= 48 groups)

// Gate/up tile j of all pairs' tiles (tpp a pair): whether its pair is the shared expert's (SharedSlot,
// known before the kernel's wait), and its matrices, vector and first row (pairs[] only after the wait,
// unless the pair is the shared one).
__device__ __forceinline__ bool gate_up_tile_shared(const SharedSlot& sh, int tpp, int j) {
  const int p = j / tpp;
  return sh.k1 > 0 && p % sh.k1 == sh.k1 - 1;
}
__device__ __forceinline__ void gate_up_tile_of(const ExpertPair* __restrict__ pairs, const SharedSlot& sh, int tpp,
                                                int j, DMatrix& gate, DMatrix& up, int& vec, int& row0) {
  const int p = j / tpp;
  row0 = (j % tpp) * kTileRows;
  const bool shd = gate_up_tile_shared(sh, tpp, j);
  gate = shd ? sh.gate : pairs[p].gate;
  up = shd ? sh.up : pairs[p].up;
  vec = shd ? p / sh.k1 : pairs[p].x_row;
}

// The streaming gate/up loop's pieces (expert_gate_up_stream_kernel and the fused kernel's teams):
// a warp's groups [G0, G1) of vector vec's fragments into registers, and one tile's products from its
// stage (gate at st, up at st + bytes) against them, stashed in red_w for the epilogue.
__device__ __forceinline__ void gate_up_frags_to_regs(const uint2* __restrict__ frag, const float* __restrict__ gsum,
                                                      int vec, int vec_groups, int G0, int G1, int g, int t,
                                                      uint2 (&fb)[kStreamWarpGroups][4], float (&fx)[kStreamWarpGroups]) {
  const uint2* fv = frag + static_cast<size_t>(vec) * vec_groups * kOneFragWords + tc4_one_frag_lane(g, t);
  const float* gv = gsum + static_cast<size_t>(vec) * vec_groups;
#pragma unroll
  for (int j = 0; j < kStreamWarpGroups; ++j)
    if (G0 + j < G1) fx[j] = tc4_one_frags_group(fv, gv, G0 + j, t, fb[j]);
}
__device__ __forceinline__ void gate_up_tile_products(const uint8_t* st, uint32_t bytes, int G0, int G1, int lane,
                                                      const uint2 (&fb)[kStreamWarpGroups][4],
                                                      const float (&fx)[kStreamWarpGroups], float (*red_w)[16][4]) {
  const int g = lane >> 2, t = lane & 3;
  float acc[2][4] = {};
#pragma unroll
  for (int j = 0; j < kStreamWarpGroups; ++j) {
    if (G0 + j >= G1) break;
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      uint2 wa, wb;
      float sa, ba, sb, bb;
      tile_group_lds(st + m * bytes + static_cast<size_t>(G0 + j) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
      tc4_one_mma_regs(wa, wb, sa, ba, sb, bb, fb[j], fx[j], acc[m]);
    }
  }
#pragma unroll
  for (int m = 0; m < 2; ++m) one_row_stash(red_w[m], acc[m], g, t);
}

// expert_gate_up_bulk_kernel as a streaming loop: block b takes the contiguous run of tiles
// [b per, (b + 1) per) of all pairs' tiles (tile j: pair j / tiles_per_pair, tile j % tiles_per_pair),
// two at a time in flight through two shared-memory stages: while its warps multiply tile i, tile
// i + 1's copy is landing, and tile i + 2's is asked for as soon as tile i's stage is read. Each
// tile's arithmetic (the warps' split of the groups, the order of their parts) is the bulk kernel's,
// so the outputs are its bits.
// Why: the bulk kernel's 4-row grid is 1,760 blocks of one tile, 4 resident per SM (3.3 waves): a
// block's stage holds nothing in flight while it multiplies, starts, or ends, and its last wave is a
// third full. Nsight Compute (H200 2026-12-02 04:28Z, 4 rows): 31.4 us for 81 MB, 2.56 TB/s (53% of
// DRAM), 16.5 cycles per issued instruction, 44% of them waiting on L1TEX, 44,000 local-memory
// spill requests (64 registers a thread at 4 blocks per SM). Here 2 blocks per SM (128 registers) keep
// 4 tiles per SM asked for at every moment until their runs end.
// grid ceil(tiles / per) (all resident: per = ceil(tiles / resident blocks)), block 256, dynamic
// shared memory 4 * groups * kTileGroupBytes. sh: as in the bulk kernel (the shared expert's tiles
// among a block's first two are asked for before the wait).
template <bool STAMP = false>
__global__ void __launch_bounds__(256, 2) expert_gate_up_stream_kernel(const ExpertPair* __restrict__ pairs,
                                                                      int tiles_per_pair, int n_tiles, int per,
                                                                      const uint2* __restrict__ frag,
                                                                      const float* __restrict__ gsum, int vec_groups,
                                                                      float* __restrict__ out, int ldo,
                                                                      const __grid_constant__ SharedSlot sh) {
  expert_stamp<STAMP>(kExpertStampGateUp, 0);
  extern __shared__ __align__(128) uint8_t stile[];  // [stage][gate, up][groups][576]
  __shared__ uint64_t bar[2];
  __shared__ float red[2][8][2][16][4];
  constexpr int kAsker = 32;  // warp 1's lane 0 asks for the copies (warp 0 writes the outputs)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int first = blockIdx.x * per, n = min(per, n_tiles - first);
  const int groups = vec_groups;
  const uint32_t bytes = static_cast<uint32_t>(groups) * kTileGroupBytes;
  if (threadIdx.x == 0) {
    mbar_init(&bar[0]);
    mbar_init(&bar[1]);
    mbar_init_fence();
  }
  __syncthreads();
  auto is_shared = [&](int i) { return gate_up_tile_shared(sh, tiles_per_pair, first + i); };
  // Local tile i's matrices and vector.
  auto tile_of = [&](int i, DMatrix& gate, DMatrix& up, int& vec, int& row0) {
    gate_up_tile_of(pairs, sh, tiles_per_pair, first + i, gate, up, vec, row0);
  };
  // Stage i % 2 asks for tile i (a tile past its pair's rows asks for no bytes: its phase completes).
  auto ask = [&](int i) {
    DMatrix gate, up;
    int vec, row0;
    tile_of(i, gate, up, vec, row0);
    uint64_t* b = &bar[i & 1];
    if (row0 >= gate.rows) {
      mbar_arrive_expect(b, 0);
      return;
    }
    uint8_t* st = stile + (i & 1) * 2 * bytes;
    const int tile = row0 / kTileRows;
    mbar_arrive_expect(b, 2 * bytes);
    bulk_copy_1d(st, gate.tile_group(tile, 0), bytes, b);
    bulk_copy_1d(st + bytes, up.tile_group(tile, 0), bytes, b);
  };
  const bool early0 = n > 0 && is_shared(0), early1 = n > 1 && is_shared(1);
  if (threadIdx.x == kAsker) {  // weights never change: the shared expert's tiles before the wait
    if (early0) ask(0);
    if (early1) ask(1);
  }
  pdl_begin();  // the pairs (route) and the fragments (the mix) come from the kernels before
  expert_stamp<STAMP>(kExpertStampGateUp, 1);
  if (threadIdx.x == kAsker) {
    if (n > 0 && !early0) ask(0);
    if (n > 1 && !early1) ask(1);
  }
  const int per_w = (groups + 7) / 8, G0 = min(groups, warp * per_w), G1 = min(groups, G0 + per_w);
  // The warp's groups' fragments in registers, loaded when the vector changes (a run's tiles are mostly
  // one pair's) and before the wait for the tile, so their L2 round trip overlaps the copy instead of
  // following it group by group.
  uint2 fb[kStreamWarpGroups][4];
  float fx[kStreamWarpGroups];
  int frag_vec = -1;
  for (int i = 0; i < n; ++i) {
    const int s = i & 1;
    DMatrix gate, up;
    int vec, row0;
    tile_of(i, gate, up, vec, row0);
    const bool valid = row0 < gate.rows;  // block-uniform
    if (valid && (!gate.tiled() || !up.tiled() || gate.cols != vec_groups * 64 || up.cols != gate.cols)) __trap();
    if (valid && vec != frag_vec) {
      gate_up_frags_to_regs(frag, gsum, vec, vec_groups, G0, G1, g, t, fb, fx);
      frag_vec = vec;
    }
    mbar_wait(&bar[s], (i >> 1) & 1);
    if (valid) gate_up_tile_products(stile + s * 2 * bytes, bytes, G0, G1, lane, fb, fx, red[s][warp]);
    __syncthreads();  // stage s read, red[s] written
    if (threadIdx.x == kAsker && i + 2 < n) ask(i + 2);
    if (valid && warp == 0 && lane < 16 && row0 + lane < gate.rows) {
      const int p = (first + i) / tiles_per_pair;
      const float v0 = one_row_value<2>(red[s], 8, 0, lane), v1 = one_row_value<2>(red[s], 8, 1, lane);
      out[static_cast<size_t>(p) * ldo + row0 + lane] = siluf_(v0) * v1;
    }
  }
  expert_stamp_exit<STAMP>(kExpertStampGateUp);
}

// A team's barrier in the fused kernel: one named barrier of its 256 threads.
struct TeamSync {
  int id;  // 1 or 2 (0 is __syncthreads')
  __device__ __forceinline__ void operator()() const { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
};
// The same where a block is one team (CK_EXPERT_FUSED=2): the block's barrier.
struct BlockSync {
  __device__ __forceinline__ void operator()() const { __syncthreads(); }
};

// Where expert_down_bulk_kernel's tiles start in its dynamic shared memory (after the fragments and
// group sums, rounded up to 128 bytes), and its whole size.
__host__ __device__ constexpr size_t bulk_down_tiles_offset(int max_groups) {
  return (static_cast<size_t>(max_groups) * (4 * 32 * sizeof(uint2) + sizeof(float)) + 127) / 128 * 128;
}
__host__ __device__ constexpr size_t bulk_down_smem(int max_groups) {
  return bulk_down_tiles_offset(max_groups) + 8 * static_cast<size_t>(max_groups) * kTileGroupBytes;
}

// Decode experts' down products with each pair's h turned into fragments in the block (tc4_one_frag,
// as gemv_tc4_one_kernel does with x): no fragment kernel between gate/up and down (16 launches of
// ~3 us per step in Nsight Compute). Block b takes 8 tiles of 16 output rows of pair b / bpp (bpp =
// ceil(rows / 128) blocks per pair), each warp one tile over all of the pair's groups (K = the pair's
// intermediate size, at most kTcBlockGroups groups), in the one-row v4 arithmetic.
// grid (n_pairs * bpp), block 256, dynamic shared memory max_groups * (4 * 32 uint2 + 1 float).
template <bool BF16S>
__device__ __forceinline__ void expert_down_one_tile(const DMatrix& w, int row0, int groups, const uint2* sfrag,
                                                     const float* sgs, float (&acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  Tc4Rows<BF16S, 4> tr;
  tr.init(w, min(row0 + g, w.rows - 1), min(row0 + g + 8, w.rows - 1), t);
#pragma unroll 2
  for (int G = 0; G < groups; ++G)
    tc4_one_group(tr, G, sfrag + static_cast<size_t>(G) * 4 * 32 + lane, t == 0 ? sgs[G] : 0.0f, acc);
}

__global__ void __launch_bounds__(256, 3) expert_down_one_kernel(const ExpertPair* __restrict__ pairs, int bpp,
                                                                 int max_groups, const float* __restrict__ h, int ldh,
                                                                 float* __restrict__ y, int ldy) {
  extern __shared__ uint2 sfrag[];
  pdl_begin();  // the pairs (route) and h (gate/up) come from the kernels before
  const int warp = threadIdx.x >> 5;
  const int p = blockIdx.x / bpp, row0 = ((blockIdx.x % bpp) * 8 + warp) * 16;
  const DMatrix w = pairs[p].down;
  const int groups = w.cols / 64;
  float* sgs = reinterpret_cast<float*>(sfrag + static_cast<size_t>(max_groups) * 4 * 32);
  one_row_frags_in_block<2>(h + static_cast<size_t>(p) * ldh, 0, groups, sfrag, sgs);
  __syncthreads();
  if (row0 >= w.rows) return;  // warp-uniform; no barrier below
  float acc[4] = {};
  if (w.fmt.scale_kind == static_cast<uint8_t>(WKind::BF16)) expert_down_one_tile<true>(w, row0, groups, sfrag, sgs, acc);
  else expert_down_one_tile<false>(w, row0, groups, sfrag, sgs, acc);
  one_row_tile_store(acc, y + static_cast<size_t>(p) * ldy, row0, w.rows);
}

// expert_down_one_kernel for tiled experts (Model::tiled_experts): the block's 8 tiles of the pair's
// down matrix are one contiguous run (8 x groups x 576 bytes), asked for by one bulk copy before the
// block turns h into fragments, so the copy and the fragments overlap; then each warp takes its tile
// from shared memory in the same order and arithmetic as expert_down_one_tile (the same bits).
// Decode +1.0% at one row, +1.4% at 4 rows against gate/up by bulk copies alone (2026-12-01 ~00:39Z).
// grid (n_pairs * bpp), block 256, dynamic shared memory: the fragments (max_groups * (4 * 32 uint2 +
// 1 float)), then the tiles (8 * max_groups * kTileGroupBytes, at a 128-byte boundary).
// early (CK_EXPERT_DOWN_EARLY=0: not): the block reads its pair and asks for its tiles before its wait,
// while the gate/up kernel still runs. The pairs come from the route, two kernels back (route, [x's
// fragments,] gate/up, down): the route has ended before the gate/up kernel's blocks passed their
// wait, and this kernel starts only after they all have. H200 2026-12-01 10:27Z, same call: one-row
// decode 600.2 / 598.3 / 601.4 tok/s against 589.7 / 580.5 late; 4 rows level.
__global__ void __launch_bounds__(256, 3) expert_down_bulk_kernel(const ExpertPair* __restrict__ pairs, int bpp,
                                                                  int max_groups, const float* __restrict__ h, int ldh,
                                                                  float* __restrict__ y, int ldy, int early) {
  extern __shared__ __align__(128) uint2 sfrag[];
  __shared__ uint64_t bar;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int p = blockIdx.x / bpp, T0 = (blockIdx.x % bpp) * 8, row0 = (T0 + warp) * kTileRows;
  float* sgs = reinterpret_cast<float*>(sfrag + static_cast<size_t>(max_groups) * 4 * 32);
  uint8_t* stile = reinterpret_cast<uint8_t*>(sfrag) + bulk_down_tiles_offset(max_groups);
  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_init_fence();
  }
  __syncthreads();
  if (!early) pdl_begin();  // the pairs (route) and h (gate/up) come from the kernels before
  const DMatrix w = pairs[p].down;
  const int groups = w.cols / 64, n_tiles = min(8, w.rows / kTileRows - T0);
  if (n_tiles <= 0) return;  // block-uniform
  if (!w.tiled() || groups > max_groups) __trap();  // the launch's promise
  const uint32_t bytes = static_cast<uint32_t>(n_tiles) * groups * kTileGroupBytes;
  if (threadIdx.x == 0) {
    mbar_arrive_expect(&bar, bytes);
    bulk_copy_1d(stile, w.tile_group(T0, 0), bytes, &bar);
  }
  if (early) pdl_begin();  // h comes from the kernel before
  one_row_frags_in_block<2>(h + static_cast<size_t>(p) * ldh, 0, groups, sfrag, sgs);
  __syncthreads();
  mbar_wait(&bar, 0);
  if (warp >= n_tiles) return;  // warp-uniform; no barrier below
  float acc[4] = {};
  const uint8_t* tile = stile + static_cast<size_t>(warp) * groups * kTileGroupBytes;
#pragma unroll 2
  for (int G = 0; G < groups; ++G) {
    uint2 wa, wb;
    float sa, ba, sb, bb;
    tile_group_lds(tile + static_cast<size_t>(G) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
    tc4_one_mma(wa, wb, sa, ba, sb, bb, sfrag + static_cast<size_t>(G) * 4 * 32 + lane, t == 0 ? sgs[G] : 0.0f, acc);
  }
  one_row_tile_store(acc, y + static_cast<size_t>(p) * ldy, row0, w.rows);
}

// One warp's down tile from shared memory (groups groups of kTileGroupBytes at tile) against h's
// fragments in shared memory (sfrag, sums sgs): the arithmetic of expert_down_bulk_kernel and
// expert_down_stream_kernel (whose loops stay written out: their code is measured as it is), for the
// fused kernel's teams.
__device__ __forceinline__ void down_tile_products(const uint8_t* tile, int groups, int lane, const uint2* sfrag,
                                                   const float* sgs, float (&acc)[4]) {
  const int t = lane & 3;
#pragma unroll 2
  for (int G = 0; G < groups; ++G) {
    uint2 wa, wb;
    float sa, ba, sb, bb;
    tile_group_lds(tile + static_cast<size_t>(G) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
    tc4_one_mma(wa, wb, sa, ba, sb, bb, sfrag + static_cast<size_t>(G) * 4 * 32 + lane, t == 0 ? sgs[G] : 0.0f, acc);
  }
}

// expert_down_bulk_kernel as a streaming loop, like expert_gate_up_stream_kernel: chunk c is pair
// c / bpp's 8 tiles from tile (c % bpp) * 8; block b takes the run [b per, (b + 1) per) of chunks, two
// in flight through two shared-memory stages, and turns h into fragments once per pair in its run
// (the bulk kernel does it once per chunk: 20 times per pair at H = 2,560). Each tile's arithmetic is
// the bulk kernel's (the same bits). The pairs are read before the wait as the bulk kernel's `early`
// does (expert_down_tc4's contract); h after it.
// Why: Nsight Compute (H200 2026-12-02 04:38Z, 4 rows): the bulk kernel is 16.6 us for 36 MB (1.6 TB/s,
// 33% of DRAM) at 2.56 instructions a cycle, 880 blocks of one chunk, 3 resident per SM.
// grid ceil(chunks / per), block 256, dynamic shared memory bulk_down_stream_smem(max_groups).
__host__ __device__ constexpr size_t bulk_down_stream_smem(int max_groups) {
  return bulk_down_tiles_offset(max_groups) + 2 * 8 * static_cast<size_t>(max_groups) * kTileGroupBytes;
}
constexpr size_t kDownStreamMaxSmem = 110 * 1024;  // two blocks per SM at max_groups 10 (H200: 227 KB)

// The fused kernel's stage: a gate/up tile (both matrices) or a down chunk (8 tiles), the larger.
__host__ __device__ constexpr size_t fused_stage_bytes(int groups, int max_groups) {
  return (2 * static_cast<size_t>(groups) > 8 * static_cast<size_t>(max_groups) ? 2 * static_cast<size_t>(groups)
                                                                                 : 8 * static_cast<size_t>(max_groups)) *
         kTileGroupBytes;
}
// The fused kernel's dynamic shared memory: each team's two stages and down fragments.
__host__ __device__ constexpr size_t fused_smem(int groups, int max_groups, int teams) {
  return teams * (2 * fused_stage_bytes(groups, max_groups) + bulk_down_tiles_offset(max_groups));
}

// The fused kernel's per-pair counts (n_pairs each, zero between kernels): ready[p], pair p's gate/up
// tiles stored; ready[n_pairs + p], pair p's down chunks that have read them. The last chunk to read
// a pair puts both back to zero, so the next layer's kernel finds them zero (its wait orders it after
// this kernel's end).
struct PairCounts {
  unsigned* ready;
  int n_pairs;
  int tiles_per_pair;  // a pair's gate/up tiles, its rows or not
  int bpp;             // a pair's down chunks
};

template <bool STAMP = false>
__global__ void __launch_bounds__(256, 2) expert_down_stream_kernel(const ExpertPair* __restrict__ pairs, int bpp,
                                                                    int n_chunks, int per, int max_groups,
                                                                    const float* __restrict__ h, int ldh,
                                                                    float* __restrict__ y, int ldy) {
  expert_stamp<STAMP>(kExpertStampDown, 0);
  extern __shared__ __align__(128) uint2 sfrag[];
  __shared__ uint64_t bar[2];
  constexpr int kAsker = 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
  const int first = blockIdx.x * per, n = min(per, n_chunks - first);
  float* sgs = reinterpret_cast<float*>(sfrag + static_cast<size_t>(max_groups) * 4 * 32);
  uint8_t* stiles = reinterpret_cast<uint8_t*>(sfrag) + bulk_down_tiles_offset(max_groups);
  const size_t stage_bytes = 8 * static_cast<size_t>(max_groups) * kTileGroupBytes;
  if (threadIdx.x == 0) {
    mbar_init(&bar[0]);
    mbar_init(&bar[1]);
    mbar_init_fence();
  }
  __syncthreads();
  // Stage i % 2 asks for local chunk i's tiles (none past the pair's rows: its phase completes).
  auto ask = [&](int i) {
    const int c = first + i, T0 = (c % bpp) * 8;
    const DMatrix w = pairs[c / bpp].down;
    const int n_tiles = min(8, w.rows / kTileRows - T0);
    uint64_t* b = &bar[i & 1];
    if (n_tiles <= 0) {
      mbar_arrive_expect(b, 0);
      return;
    }
    const uint32_t bytes = static_cast<uint32_t>(n_tiles) * (w.cols / 64) * kTileGroupBytes;
    mbar_arrive_expect(b, bytes);
    bulk_copy_1d(stiles + (i & 1) * stage_bytes, w.tile_group(T0, 0), bytes, b);
  };
  if (threadIdx.x == kAsker) {  // the pairs are two kernels old (expert_down_tc4's contract)
    if (n > 0) ask(0);
    if (n > 1) ask(1);
  }
  pdl_begin();  // h comes from the kernel before
  expert_stamp<STAMP>(kExpertStampDown, 1);
  int frag_pair = -1;
  for (int i = 0; i < n; ++i) {
    const int c = first + i, p = c / bpp, T0 = (c % bpp) * 8, row0 = (T0 + warp) * kTileRows;
    const DMatrix w = pairs[p].down;
    const int groups = w.cols / 64, n_tiles = min(8, w.rows / kTileRows - T0);
    if (n_tiles > 0 && (!w.tiled() || groups > max_groups)) __trap();  // the launch's promise
    if (n_tiles > 0 && p != frag_pair) {  // block-uniform; the last barrier ended every read of them
      one_row_frags_in_block<2>(h + static_cast<size_t>(p) * ldh, 0, groups, sfrag, sgs);
      __syncthreads();
      frag_pair = p;
    }
    mbar_wait(&bar[i & 1], (i >> 1) & 1);
    if (warp < n_tiles) {
      float acc[4] = {};
      const uint8_t* tile = stiles + (i & 1) * stage_bytes + static_cast<size_t>(warp) * groups * kTileGroupBytes;
#pragma unroll 2
      for (int G = 0; G < groups; ++G) {
        uint2 wa, wb;
        float sa, ba, sb, bb;
        tile_group_lds(tile + static_cast<size_t>(G) * kTileGroupBytes, lane, wa, wb, sa, ba, sb, bb);
        tc4_one_mma(wa, wb, sa, ba, sb, bb, sfrag + static_cast<size_t>(G) * 4 * 32 + lane, t == 0 ? sgs[G] : 0.0f,
                    acc);
      }
      one_row_tile_store(acc, y + static_cast<size_t>(p) * ldy, row0, w.rows);
    }
    __syncthreads();  // stage i % 2 read
    if (threadIdx.x == kAsker && i + 2 < n) ask(i + 2);
  }
  expert_stamp_exit<STAMP>(kExpertStampDown);
}

// Pair p's gate/up tiles are all stored (the fused kernel's count says so): thread tid 0 waits, then
// the team's barrier; the team then reads h through L2 only.
template <class Sync>
__device__ __forceinline__ void wait_pair_ready(const PairCounts& counts, int p, int tid, Sync sync) {
  if (tid == 0)
    poll_acquire_until(counts.ready + p, [&](unsigned v) { return v >= static_cast<unsigned>(counts.tiles_per_pair); });
  sync();
}

// The fused kernel's team: 8 warps (tid 0..255) and one ring of two stages over the team's units, first
// its gate/up tiles [t_first, t_first + t_n), then its down chunks [c_first, c_first + c_n): unit u's
// bytes are asked for as soon as unit u - 2 has left its stage, so a team's down chunks stream while
// its last tiles are multiplied. Each tile's and chunk's arithmetic is expert_gate_up_stream_kernel's
// and expert_down_stream_kernel's (the same bits). stage_bytes: the larger of a tile's and a chunk's.
// sfrag: down's fragments and sums (bulk_down_tiles_offset(max_groups) bytes).
template <bool STAMP, class Sync>
__device__ __forceinline__ void experts_team_run(const ExpertPair* __restrict__ pairs, int t_first, int t_n, int c_first,
                                                 int c_n, const uint2* __restrict__ frag, const float* __restrict__ gsum,
                                                 int vec_groups, float* __restrict__ h, int ldh, int max_groups,
                                                 float* __restrict__ y, int ldy, const SharedSlot& sh,
                                                 const PairCounts& counts, uint8_t* stages, size_t stage_bytes,
                                                 uint2* sfrag, uint64_t* bar, float (*red)[8][2][16][4], int tid,
                                                 Sync sync) {
  constexpr int kAsker = 32;  // warp 1's lane 0 asks for the copies (warp 0 writes gate/up's outputs)
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int groups = vec_groups, tpp = counts.tiles_per_pair, bpp = counts.bpp, n_units = t_n + c_n;
  const uint32_t bytes = static_cast<uint32_t>(groups) * kTileGroupBytes;  // one matrix of a gate/up tile
  float* sgs = reinterpret_cast<float*>(sfrag + static_cast<size_t>(max_groups) * 4 * 32);
  // Unit u into stage u % 2 (none past a matrix's rows: its phase completes).
  auto ask = [&](int u) {
    uint64_t* b = &bar[u & 1];
    uint8_t* st = stages + (u & 1) * stage_bytes;
    if (u < t_n) {
      DMatrix gate, up;
      int vec, row0;
      gate_up_tile_of(pairs, sh, tpp, t_first + u, gate, up, vec, row0);
      if (row0 >= gate.rows) {
        mbar_arrive_expect(b, 0);
        return;
      }
      mbar_arrive_expect(b, 2 * bytes);
      bulk_copy_1d(st, gate.tile_group(row0 / kTileRows, 0), bytes, b);
      bulk_copy_1d(st + bytes, up.tile_group(row0 / kTileRows, 0), bytes, b);
      return;
    }
    const int c = c_first + u - t_n, T0 = (c % bpp) * 8;
    const DMatrix w = pairs[c / bpp].down;
    const int n_tiles = min(8, w.rows / kTileRows - T0);
    if (n_tiles <= 0) {
      mbar_arrive_expect(b, 0);
      return;
    }
    const uint32_t cb = static_cast<uint32_t>(n_tiles) * (w.cols / 64) * kTileGroupBytes;
    mbar_arrive_expect(b, cb);
    bulk_copy_1d(st, w.tile_group(T0, 0), cb, b);
  };
  const bool early0 = t_n > 0 && gate_up_tile_shared(sh, tpp, t_first),
             early1 = t_n > 1 && gate_up_tile_shared(sh, tpp, t_first + 1);
  if (tid == kAsker) {  // weights never change: the shared expert's tiles before the wait
    if (early0) ask(0);
    if (early1) ask(1);
  }
  pdl_begin();  // the pairs (route) and the fragments (the mix) come from the kernels before
  expert_stamp<STAMP>(kExpertStampFused, 1);
  if (tid == kAsker) {
    if (n_units > 0 && !early0) ask(0);
    if (n_units > 1 && !early1) ask(1);
  }
  const int per_w = (groups + 7) / 8, G0 = min(groups, warp * per_w), G1 = min(groups, G0 + per_w);
  uint2 fb[kStreamWarpGroups][4];
  float fx[kStreamWarpGroups];
  int frag_vec = -1, frag_pair = -1;
  unsigned unreleased = 0;  // warp 0: the team's stored tiles of the current pair not yet counted
  for (int u = 0; u < n_units; ++u) {
    const int s = u & 1;
    const uint8_t* st = stages + s * stage_bytes;
    // A gate/up tile: expert_gate_up_stream_kernel's loop body, written out again here. (One helper
    // for both changed that default kernel's code, 114 -> 116 registers, which no device call measured.)
    if (u < t_n) {
      DMatrix gate, up;
      int vec, row0;
      gate_up_tile_of(pairs, sh, tpp, t_first + u, gate, up, vec, row0);
      const bool valid = row0 < gate.rows;  // team-uniform
      if (valid && (!gate.tiled() || !up.tiled() || gate.cols != vec_groups * 64 || up.cols != gate.cols)) __trap();
      if (valid && vec != frag_vec) {
        gate_up_frags_to_regs(frag, gsum, vec, vec_groups, G0, G1, g, t, fb, fx);
        frag_vec = vec;
      }
      mbar_wait(&bar[s], (u >> 1) & 1);
      if (valid) gate_up_tile_products(st, bytes, G0, G1, lane, fb, fx, red[s][warp]);
      sync();  // stage s read, red[s] written
      if (tid == kAsker && u + 2 < n_units) ask(u + 2);
      if (warp == 0) {
        const int p = (t_first + u) / tpp;
        if (valid && lane < 16 && row0 + lane < gate.rows) {
          const float v0 = one_row_value<2>(red[s], 8, 0, lane), v1 = one_row_value<2>(red[s], 8, 1, lane);
          h[static_cast<size_t>(p) * ldh + row0 + lane] = siluf_(v0) * v1;
        }
        // The team's tiles of one pair are released together, after the last of them: one GPU-scope
        // fence a pair, not one a tile (the fence holds warp 0, and the team's next barrier with it).
        ++unreleased;
        if (u + 1 >= t_n || (t_first + u + 1) / tpp != p) {
          __syncwarp();  // the warp's stores of the tiles, then one release of them with the pair's count
          if (lane == 0) {
            asm volatile("fence.acq_rel.gpu;" ::: "memory");
            asm volatile("red.relaxed.gpu.global.add.u32 [%0], %1;" ::"l"(counts.ready + p), "r"(unreleased) : "memory");
          }
          unreleased = 0;
        }
      }
      continue;
    }
    // A down chunk: expert_down_stream_kernel's loop body, once its pair's h is all stored.
    const int c = c_first + u - t_n, p = c / bpp, T0 = (c % bpp) * 8, row0 = (T0 + warp) * kTileRows;
    const DMatrix w = pairs[p].down;
    const int kg = w.cols / 64, n_tiles = min(8, w.rows / kTileRows - T0);
    if (n_tiles > 0 && (!w.tiled() || kg > max_groups)) __trap();  // the launch's promise
    if (p != frag_pair) {  // team-uniform; the last barrier ended every read of the fragments
      wait_pair_ready(counts, p, tid, sync);
      one_row_frags_in_warps<2, true>(h + static_cast<size_t>(p) * ldh, 0, kg, sfrag, sgs, warp, 8);
      sync();
      frag_pair = p;
    }
    if (tid == 0) {  // this chunk has read the pair's h; the last one puts the counts back
      if (atomicAdd(counts.ready + counts.n_pairs + p, 1u) == static_cast<unsigned>(bpp) - 1) {
        counts.ready[p] = 0;
        counts.ready[counts.n_pairs + p] = 0;
      }
    }
    mbar_wait(&bar[s], (u >> 1) & 1);
    if (warp < n_tiles) {
      float acc[4] = {};
      down_tile_products(st + static_cast<size_t>(warp) * kg * kTileGroupBytes, kg, lane, sfrag, sgs, acc);
      one_row_tile_store(acc, y + static_cast<size_t>(p) * ldy, row0, w.rows);
    }
    sync();  // stage s read
    if (tid == kAsker && u + 2 < n_units) ask(u + 2);
  }
}

// Decode experts' gate/up and down in one kernel (CK_EXPERT_FUSED=1; off by default: slower, below):
// 512 threads a block, two teams of 8 warps (experts_team_run), one block an SM, all resident. Team k
// of the grid's 2B (k = team x B + block) takes its share of the gate/up tiles (the first teams one
// more) and of the down chunks (the last teams one more), so each SM gets the same number of units
// within one.
// Why: as two kernels, down's bytes can only stream once its blocks find room beside the gate/up
// kernel's, and a kernel boundary sits between them. Here gate/up keeps its two streaming blocks an SM
// (two teams, 4 tiles in flight an SM), down's chunks take the stages the tiles free, and a pair's down
// waits only for that pair's tiles (ready counts in global memory: PairCounts).
// No deadlock: a team waits only for tiles, which every team takes before any chunk and multiplies
// without waiting for anything but their copies, and every block is resident (the grid is at most the
// blocks that fit at once: one an SM of two teams, two of one team).
// Measured (H100 2026-12-06, docs/roofline-cuda.md "Fifty-first session" and "Fifty-second session"):
// alone it is faster (Nsight Compute, 4 layers: 21.9 us against 15.4 + 9.7 us for the two kernels), but
// the one-row step is ~3% slower (two teams -3.4%, blocks of one team -2.9%; 4 rows -1 to -2%). The
// per-block stamps (CK_EXPERT_TIMING=1) show that the start is not why: every block is resident before
// the route ends, in both forms. From the route's end to the last block's exit it takes 17.2-17.6 us
// against 15.9 us for the two kernels: a chunk waits for its pair's tiles, which the teams finish at
// about the moment all tiles are done, so the counts buy nothing over a kernel boundary at one row and
// cost their fences and polls; alone, the two kernels lose the overlap of down's copies with gate/up
// that they have in the step. (A first form, warps 0-7 on gate/up and 8-15 on down: -7%.)
// grid = SMs x blocks an SM, block 256 TEAMS, dynamic shared memory TEAMS x (2 stage_bytes + the
// fragments: fused_smem). TEAMS = 1 (CK_EXPERT_FUSED=2): blocks of one team, 256 threads, two an SM: a block needs half an SM
// to start and leaves when its own team is done.
template <int TEAMS, bool STAMP = false>
__global__ void __launch_bounds__(256 * TEAMS, 2 / TEAMS) expert_tc4_fused_kernel(
    const ExpertPair* __restrict__ pairs, int n_tiles, const uint2* __restrict__ frag, const float* __restrict__ gsum,
    int vec_groups, float* __restrict__ h, int ldh, int n_chunks, int max_groups, float* __restrict__ y, int ldy,
    const __grid_constant__ SharedSlot sh, const __grid_constant__ PairCounts counts) {
  expert_stamp<STAMP>(kExpertStampFused, 0);
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ uint64_t bar[TEAMS][2];
  __shared__ float red[TEAMS][2][8][2][16][4];
  if (threadIdx.x == 0) {
    for (int i = 0; i < TEAMS; ++i)
      for (int j = 0; j < 2; ++j) mbar_init(&bar[i][j]);
    mbar_init_fence();
  }
  __syncthreads();
  const int team = TEAMS == 1 ? 0 : threadIdx.x >> 8, K = TEAMS * gridDim.x, k = team * gridDim.x + blockIdx.x;
  const int tq = n_tiles / K, tr = n_tiles % K, cq = n_chunks / K, cr = n_chunks % K;
  const int t_first = k * tq + min(k, tr), t_n = tq + (k < tr ? 1 : 0);
  const int c_first = k * cq + max(0, k - (K - cr)), c_n = cq + (k >= K - cr ? 1 : 0);
  const size_t stage_bytes = fused_stage_bytes(vec_groups, max_groups);
  uint8_t* mine = smem + team * (2 * stage_bytes + bulk_down_tiles_offset(max_groups));
  auto run = [&](auto sync) {
    experts_team_run<STAMP>(pairs, t_first, t_n, c_first, c_n, frag, gsum, vec_groups, h, ldh, max_groups, y, ldy, sh, counts,
                     mine + bulk_down_tiles_offset(max_groups), stage_bytes, reinterpret_cast<uint2*>(mine), bar[team],
                     red[team], threadIdx.x & 255, sync);
  };
  if constexpr (TEAMS == 1) run(BlockSync{});
  else run(TeamSync{1 + team});
  expert_stamp_exit<STAMP>(kExpertStampFused);
}
}  // namespace

bool expert_tc4_enabled() {
  static const bool on = !env_is("CK_EXPERT_TC4", "0");
  return on && q_arith() == 4;
}

namespace {
// The K split of the decode experts (warps per 16-row tile, 8 / ks tiles per block). "double": the
// first rule, doubling while the warps are fewer than 16 per SM (gate/up at the released geometry: 440
// tiles -> ks 8, 3,520 warps, more than one wave of resident blocks); "fit" (the default): the largest
// split whose blocks all fit in one wave of resident blocks, each part keeping at least 4 groups.
// CK_EXPERT_KS="double", or "a/b" fixed splits for gate/up and down (comparisons).
int expert_k_split(bool gate_up, int tiles, int groups, int resident_blocks) {
  static const std::string mode = [] {
    const char* e = std::getenv("CK_EXPERT_KS");
    return std::string(e ? e : "fit");
  }();
  int ks = 1;
  if (mode == "double") {
    while (ks < 8 && tiles * ks < sm_count() * 16 && groups >= 8 * ks) ks *= 2;
  } else if (mode == "fit") {
    while (ks < 8 && ceil_div(tiles, 8 / (2 * ks)) <= resident_blocks && groups >= 4 * 2 * ks) ks *= 2;
  } else {
    const size_t comma = mode.find('/');
    const int want = std::atoi((gate_up || comma == std::string::npos ? mode : mode.substr(comma + 1)).c_str());
    while (ks < 8 && 2 * ks <= want && groups >= 2 * ks) ks *= 2;
  }
  return ks;
}

// Fragments of n_vec vectors of K = 64 * groups floats (rows of x at ldx), then expert_tc4_kernel over
// n_pairs pairs of at most max_rows rows, each tile's groups split over expert_k_split's warps.
// Dynamic shared memory the bulk-copy expert kernels may ask for: gate/up tiles of K up to 44 groups.
constexpr size_t kBulkMaxSmem = 100 * 1024;
// Whether tiled decode experts take the bulk-copy kernels (CK_EXPERT_BULK=0: the direct loads, to compare).
bool expert_bulk_on() {
  static const bool on = !env_is("CK_EXPERT_BULK", "0");
  return on;
}

int g_expert_stream = -1;  // set_expert_stream; -1: the environment's
int g_expert_stream_blocks = 0;  // set_expert_stream's block count; 0: every resident block
// Whether tiled decode experts' gate/up takes the streaming kernel (CK_EXPERT_STREAM=0: the bulk
// kernel, one tile a block, to compare).
bool expert_stream_on() {
  static const bool env_on = !env_is("CK_EXPERT_STREAM", "0");
  return g_expert_stream < 0 ? env_on : g_expert_stream != 0;
}

// The same for down (CK_EXPERT_DOWN_STREAM=0: the bulk kernel, one chunk of 8 tiles a block).
bool expert_down_stream_on() {
  static const bool env_on = !env_is("CK_EXPERT_DOWN_STREAM", "0");
  return g_expert_stream < 0 ? env_on : g_expert_stream != 0;
}

// A streaming kernel's run length: `units` (tiles or chunks) spread over every block that can be
// resident at once (256 threads and `smem` bytes of dynamic shared memory each; the occupancy asked
// once per size), or over set_expert_stream's block count (tests): per = ceil(units / blocks). The
// kernel's dynamic shared memory limit is raised to `max_smem` on its first call.
struct StreamLaunchCache {
  bool smem_limit_set = false;
  size_t smem = 0;
  int blocks_per_sm = 0;
};
template <class Kernel>
int stream_run_length(Kernel kernel, size_t max_smem, size_t smem, int units, StreamLaunchCache& c) {
  if (!c.smem_limit_set) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_smem)));
    c.smem_limit_set = true;
  }
  if (c.blocks_per_sm == 0 || c.smem != smem) {
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c.blocks_per_sm, kernel, 256, smem));
    c.blocks_per_sm = std::max(1, c.blocks_per_sm);
    c.smem = smem;
  }
  const int blocks = g_expert_stream_blocks > 0 ? g_expert_stream_blocks : sm_count() * c.blocks_per_sm;
  return static_cast<int>(ceil_div(units, blocks));
}

// The STAMP instance of a kernel when CK_EXPERT_TIMING=1 (its dynamic shared memory limit raised to
// max_smem at each call: a debug run), else the default one.
template <class Kernel>
Kernel stamped_or_not(Kernel plain, Kernel stamped, size_t max_smem) {
  if (!expert_timing_on()) return plain;
  CUDA_CHECK(cudaFuncSetAttribute(stamped, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_smem)));
  return stamped;
}

int g_shared_early = -1;  // set_expert_shared_early; -1: the environment's
bool expert_shared_early_on() {
  static const bool env_on = !env_is("CK_EXPERT_SHARED_EARLY", "0");
  return g_shared_early < 0 ? env_on : g_shared_early != 0;
}

// The slot the gate/up kernels take the shared expert's tiles from before their wait: the caller's, if
// the pairs follow its layout and CK_EXPERT_SHARED_EARLY is not 0; else none (k1 = 0).
SharedSlot early_shared_slot(const SharedSlot* shared, int n_pairs) {
  SharedSlot sh;
  if (expert_shared_early_on() && shared && shared->k1 > 0 && n_pairs % shared->k1 == 0) sh = *shared;
  return sh;
}

// The compact one-row fragments of x's n_vec rows (Tc4Frags): the producer's, when it made them
// (pre), else made here in step scratch, which the caller frees (the returned pointer) after its launch.
uint8_t* frags_for(const float* x, int ldx, int n_vec, int groups, const Tc4Frags* pre, const uint2** frag,
                   const float** gsum, cudaStream_t s) {
  if (pre && pre->covers(x, ldx, n_vec, groups)) {  // fragments made by the producer of x
    *frag = pre->frag;
    *gsum = pre->gsum;
    return nullptr;
  }
  const size_t frag_elems = static_cast<size_t>(groups) * kOneFragWords;  // the compact one-row layout
  uint8_t* scratch =
      static_cast<uint8_t*>(scratch_alloc(n_vec * (frag_elems * sizeof(uint2) + sizeof(float) * groups), s));
  uint2* f = reinterpret_cast<uint2*>(scratch);
  float* gs = reinterpret_cast<float*>(scratch + n_vec * frag_elems * sizeof(uint2));
  tc4_frag_vectors(x, ldx, n_vec, groups, frag_elems, f, gs, s);  // gemv_tc4.cu: tc4_frag_kernel<1>
  *frag = f;
  *gsum = gs;
  return scratch;
}

int g_expert_fused = -1;  // set_expert_fused; -1: the environment's
// The fused kernel's dynamic shared memory at most (one block an SM: H100/H200 allow 227 KB).
constexpr size_t kFusedMaxSmem = 206 * 1024;

template <bool GATE_UP>
void launch_expert_tc4(const ExpertPair* pairs, int n_pairs, int max_rows, int groups, const float* x, int ldx,
                       int n_vec, float* out, int ldo, cudaStream_t s, const Tc4Frags* pre, bool all_tiled,
                       const SharedSlot* shared = nullptr) {
  const uint2* frag = nullptr;
  const float* gsum = nullptr;
  uint8_t* scratch = frags_for(x, ldx, n_vec, groups, pre, &frag, &gsum, s);
  const int tiles_per_pair = static_cast<int>(ceil_div(max_rows, 16)), tiles = n_pairs * tiles_per_pair;
  // Tiled experts: gate and up through bulk copies.
  const size_t bulk_smem = 2 * static_cast<size_t>(groups) * kTileGroupBytes;
  if (GATE_UP && all_tiled && expert_bulk_on() && bulk_smem <= kBulkMaxSmem) {
    static const bool attr = [] {
      CUDA_CHECK(cudaFuncSetAttribute(expert_gate_up_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kBulkMaxSmem));
      return true;
    }();
    (void)attr;
    const SharedSlot sh = early_shared_slot(shared, n_pairs);
    if (expert_stream_on() && 2 * bulk_smem <= kBulkMaxSmem && ceil_div(groups, 8) <= kStreamWarpGroups) {
      static StreamLaunchCache cache;
      const int per = stream_run_length(expert_gate_up_stream_kernel<false>, kBulkMaxSmem, 2 * bulk_smem, tiles, cache);
      launch(stamped_or_not(expert_gate_up_stream_kernel<false>, expert_gate_up_stream_kernel<true>, kBulkMaxSmem),
             static_cast<unsigned>(ceil_div(tiles, per)), 256, 2 * bulk_smem, s, pairs, tiles_per_pair, tiles, per, frag,
             gsum, groups, out, ldo, sh);
      CUDA_CHECK_LAUNCH();
      if (scratch) scratch_free(scratch, s);
      return;
    }
    launch(expert_gate_up_bulk_kernel, static_cast<unsigned>(tiles), 256, bulk_smem, s, pairs, tiles_per_pair, frag,
           gsum, groups, out, ldo, sh);
    CUDA_CHECK_LAUNCH();
    if (scratch) scratch_free(scratch, s);
    return;
  }
  static const int occ = blocks_per_sm(expert_tc4_kernel<GATE_UP, 2>);
  const int ks = expert_k_split(GATE_UP, tiles, groups, sm_count() * occ);
  // Group loop unrolled twice: four times measured 422 against 429 tok/s (2026-11-30), and again
  // 506.3 against 509.6 with the one-wave split.
  const unsigned grid = static_cast<unsigned>(ceil_div(tiles, 8 / ks));
  launch(expert_tc4_kernel<GATE_UP, 2>, grid, 256, 0, s, pairs, n_pairs, tiles_per_pair, ks, frag, gsum, groups, out,
         ldo);
  CUDA_CHECK_LAUNCH();
  if (scratch) scratch_free(scratch, s);
}
}  // namespace

void set_expert_shared_early(int on) { g_shared_early = on < 0 ? -1 : (on ? 1 : 0); }
void set_expert_stream(int on, int blocks) {
  g_expert_stream = on < 0 ? -1 : (on ? 1 : 0);
  g_expert_stream_blocks = on > 0 ? std::max(0, blocks) : 0;
}

void expert_gate_up_tc4(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* x, int ldx,
                        int x_rows, float* h, int ldh, cudaStream_t stream, const Tc4Frags* pre, bool all_tiled,
                        const SharedSlot* shared) {
  CK_REQUIRE(n_pairs >= 1 && x_rows >= 1 && hidden % 64 == 0 && max_inter >= 1, "invariant");
  launch_expert_tc4<true>(pairs, n_pairs, max_inter, hidden / 64, x, ldx, x_rows, h, ldh, stream, pre, all_tiled,
                          shared);
}

void expert_down_tc4(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* h, int ldh, float* y,
                     int ldy, cudaStream_t stream, bool all_tiled) {
  CK_REQUIRE(n_pairs >= 1 && max_inter % 64 == 0 && hidden >= 1, "invariant");
  // The fragments in the block unless the pairs' K is beyond a block's fragment memory (or
  // CK_EXPERT_DOWN_ONE=0: the fragment kernel and expert_tc4_kernel, to compare).
  static const bool one = !env_is("CK_EXPERT_DOWN_ONE", "0");
  const int max_groups = max_inter / 64;
  // Tiled experts: the block's tiles by one bulk copy.
  if (one && expert_bulk_on() && all_tiled && max_groups <= kTcBlockGroups && bulk_down_smem(max_groups) <= kBulkMaxSmem &&
      hidden % 16 == 0 && reinterpret_cast<uintptr_t>(h) % 16 == 0 && ldh % 4 == 0) {
    static const bool attr = [] {
      CUDA_CHECK(cudaFuncSetAttribute(expert_down_bulk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkMaxSmem));
      return true;
    }();
    (void)attr;
    const int bpp = static_cast<int>(ceil_div(hidden, 128));
    static const int early = env_is("CK_EXPERT_DOWN_EARLY", "0") ? 0 : 1;
    const size_t ssmem = bulk_down_stream_smem(max_groups);
    if (expert_down_stream_on() && early && ssmem <= kDownStreamMaxSmem) {
      static StreamLaunchCache cache;
      const int chunks = n_pairs * bpp;
      const int per = stream_run_length(expert_down_stream_kernel<false>, kDownStreamMaxSmem, ssmem, chunks, cache);
      launch(stamped_or_not(expert_down_stream_kernel<false>, expert_down_stream_kernel<true>, kDownStreamMaxSmem),
             static_cast<unsigned>(ceil_div(chunks, per)), 256, ssmem, stream, pairs, bpp, chunks, per, max_groups, h,
             ldh, y, ldy);
      CUDA_CHECK_LAUNCH();
      return;
    }
    launch(expert_down_bulk_kernel, static_cast<unsigned>(n_pairs * bpp), 256, bulk_down_smem(max_groups), stream, pairs,
           bpp, max_groups, h, ldh, y, ldy, early);
    CUDA_CHECK_LAUNCH();
    return;
  }
  if (one && max_groups <= kTcBlockGroups && reinterpret_cast<uintptr_t>(h) % 16 == 0 && ldh % 4 == 0) {
    const int bpp = static_cast<int>(ceil_div(hidden, 128));
    launch(expert_down_one_kernel, static_cast<unsigned>(n_pairs * bpp), 256,
           static_cast<size_t>(max_groups) * (4 * 32 * sizeof(uint2) + sizeof(float)), stream, pairs, bpp, max_groups,
           h, ldh, y, ldy);
    CUDA_CHECK_LAUNCH();
    return;
  }
  launch_expert_tc4<false>(pairs, n_pairs, hidden, max_inter / 64, h, ldh, n_pairs, y, ldy, stream, nullptr, false);
}

// 0: off; 1: blocks of two teams (expert_tc4_fused_kernel<2>); 2: blocks of one team (<1>).
int expert_fused_mode() {
  static const int env_mode = env_is("CK_EXPERT_FUSED", "1") ? 1 : env_is("CK_EXPERT_FUSED", "2") ? 2 : 0;
  return g_expert_fused < 0 ? env_mode : g_expert_fused;
}
void set_expert_fused(int mode) { g_expert_fused = mode < 0 ? -1 : std::min(mode, 2); }

size_t expert_fused_counts(int n_pairs) { return 2 * static_cast<size_t>(n_pairs); }

bool expert_timing_on() {
  static const bool on = env_is("CK_EXPERT_TIMING", "1");
  return on;
}

std::vector<uint64_t> expert_stamps() {
  std::vector<uint64_t> st(static_cast<size_t>(kExpertStampKernels) * kExpertStampBlocks * kExpertStampWords);
  CUDA_CHECK(cudaMemcpyFromSymbol(st.data(), g_expert_stamps, st.size() * sizeof(uint64_t)));
  return st;
}

namespace {
// Blocks of the fused kernel with TEAMS teams (dynamic shared memory smem) resident an SM.
template <int TEAMS>
int fused_blocks_per_sm(size_t smem) {
  static StreamLaunchCache c;
  if (!c.smem_limit_set) {
    CUDA_CHECK(cudaFuncSetAttribute(expert_tc4_fused_kernel<TEAMS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kFusedMaxSmem)));
    c.smem_limit_set = true;
  }
  if (c.smem != smem) {
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c.blocks_per_sm, expert_tc4_fused_kernel<TEAMS>,
                                                             256 * TEAMS, smem));
    c.smem = smem;
  }
  return c.blocks_per_sm;
}
}  // namespace

bool expert_tc4_fused(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* x, int ldx,
                      int x_rows, float* h, int ldh, float* y, int ldy, unsigned* counts, cudaStream_t stream,
                      const Tc4Frags* pre, const SharedSlot* shared) {
  CK_REQUIRE(n_pairs >= 1 && x_rows >= 1 && hidden % 64 == 0 && max_inter % 64 == 0, "invariant");
  const int groups = hidden / 64, max_groups = max_inter / 64, mode = expert_fused_mode(), teams = mode == 1 ? 2 : 1;
  const size_t smem = fused_smem(groups, max_groups, teams);
  if (mode == 0 || !expert_bulk_on() || !expert_stream_on() || !counts || ceil_div(groups, 8) > kStreamWarpGroups ||
      max_groups > kTcBlockGroups || smem > kFusedMaxSmem || hidden % 16 != 0 ||
      reinterpret_cast<uintptr_t>(h) % 16 != 0 || ldh % 4 != 0)
    return false;
  const int blocks_per_sm = teams == 2 ? fused_blocks_per_sm<2>(smem) : fused_blocks_per_sm<1>(smem);
  if (blocks_per_sm < 1) return false;  // teams wait for other blocks' tiles: all must be resident
  const uint2* frag = nullptr;
  const float* gsum = nullptr;
  uint8_t* scratch = frags_for(x, ldx, x_rows, groups, pre, &frag, &gsum, stream);
  const SharedSlot sh = early_shared_slot(shared, n_pairs);
  const int tiles_per_pair = static_cast<int>(ceil_div(max_inter, 16)), bpp = static_cast<int>(ceil_div(hidden, 128));
  const int blocks = g_expert_stream_blocks > 0 ? std::min(g_expert_stream_blocks, sm_count() * blocks_per_sm)
                                                : sm_count() * blocks_per_sm;
  const PairCounts pc{counts, n_pairs, tiles_per_pair, bpp};
  const auto kernel = teams == 2 ? stamped_or_not(expert_tc4_fused_kernel<2>, expert_tc4_fused_kernel<2, true>, kFusedMaxSmem)
                                  : stamped_or_not(expert_tc4_fused_kernel<1>, expert_tc4_fused_kernel<1, true>, kFusedMaxSmem);
  launch(kernel, static_cast<unsigned>(blocks), 256 * teams, smem, stream, pairs, n_pairs * tiles_per_pair, frag, gsum,
         groups, h, ldh, n_pairs * bpp, max_groups, y, ldy, sh, pc);
  CUDA_CHECK_LAUNCH();
  if (scratch) scratch_free(scratch, stream);
  return true;
}

}  // namespace ck::cuda
