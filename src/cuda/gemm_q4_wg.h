// The dense 4-bit prefill product on Hopper's warpgroup MMAs (wgmma, sm_90a), the same arithmetic as
// gemm_q4.cu's q4_tile_kernel<kQ4Dense> (codes exact in bf16, the activations in PARTS bf16 parts, a
// group's Σ q x in fp32, then y += s Σ q x + b Σ x): gemm_q4() hands its launch here when the device
// runs sm_90a code (compute capability 9.0) and CK_Q4_WGMMA is not 0.
//
// This file's kernel is built for sm_90a only (CMakeLists.txt: its own library), so the rest of the
// engine keeps its architecture list; q4_wg_ready() says whether this device can run it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common.h"
#include "cuda/ops.h"
#include "cuda/split_k.h"

namespace ck::cuda {

// Output features per block: 2 warpgroups x 2 m64 tiles (q4_tile_kernel's dense block is as wide).
constexpr int kQ4WgFeatures = 256;
// Output features per warpgroup: a block's unit of work. Block b's warpgroups take units 2 b and
// 2 b + 1, which may belong to different jobs (q4_wg_units).
constexpr int kQ4WgUnitFeatures = 128;
// A warpgroup's unit for blocks of `tokens` tokens (64 x 128 or 128 x 64 outputs per group).
CK_HD constexpr int q4_wg_unit_features(int tokens) { return 64 * kQ4WgUnitFeatures / tokens; }

struct Q4WgArgs {
  GemvJob job[kMaxGemvJobs];  // up to kMaxGemvJobs matrices over the same x rows [0, rows)
  int32_t first_unit[kMaxGemvJobs + 1];  // job j's units: [first_unit[j], first_unit[j + 1])
  int32_t unit_features = kQ4WgUnitFeatures;  // features per unit (a warpgroup's share of a block)
  int32_t n_jobs = 0;
  int32_t rows = 0;
  const uint2* xf = nullptr;  // q4_xfrag_kernel's output: its wgmma row layout, or its tile layout (bulk)
  const float* gsum = nullptr;
  int groups = 0;             // groups per x row in xf
  int k_groups = 0;           // groups per block (split-K: block z takes [z k_groups, (z + 1) k_groups))
  SplitK split;
  int32_t units_per_block = 2;  // warpgroups a block: 2, or 3 (the folded form's); set by q4_wg_units
  // The hyper-connection gate mean in the up projection's epilogue (launch_q4_wg_gate_mean only): the
  // normalised streams X (rows x ld_x, stream s at s hc_h), the block input u (rows x ld_u), S streams.
  const float* hc_x = nullptr;
  int32_t ld_x = 0;
  float* hc_u = nullptr;
  int32_t ld_u = 0;
  int32_t hc_s = 0, hc_h = 0;
  int32_t hc_prefetch = 1;  // ask L2 for the block's X when it starts (CK_HC_GM_PREFETCH=0: not)
  // XNorm (cuda/ops.h): hc_x is the mix's R, and X = (R hc_rinv[row S + s]) hc_scale[s H + f] where read.
  const float* hc_rinv = nullptr;
  const float* hc_scale = nullptr;
  // The folded form's fp16 arithmetic (gemm_q4_wg.cu "The fp16 form"): xf holds two fp16 parts of each
  // x row scaled by 2^e, and x_inv[row] = 2^-e (rows padded to the tile). Null: the bf16 parts.
  const float* x_inv = nullptr;
};

// Lays the jobs' 128-feature units out for q4_wg_dense_kernel (a.first_unit) and returns the blocks
// they take: consecutive units share a block whatever their jobs (layouts and scale types may differ),
// so the hyper-connection down projection (320 rows, tiles) and its injection head (4 rows, row
// layout) take 2 blocks per token tile, not 3.
// per_block: units a block (a.units_per_block: 2; 3 for the folded form's three-warpgroup blocks).
int q4_wg_units(Q4WgArgs& a, int unit_features = kQ4WgUnitFeatures, int per_block = 2);
// The kernel image loads on this device and its shared-memory limit is raised (call once, before any
// graph capture). False: use q4_tile_kernel.
bool q4_wg_ready();
// Over feature tiles of all jobs x ceil(rows / tokens) x K splits; parts: 2 or 3; tokens per block: 64
// (or 32).
void launch_q4_wg_dense(unsigned feature_tiles, unsigned splits, const Q4WgArgs& a, int parts, int tokens,
                        cudaStream_t stream);

// The same product when every job's matrix is in 16-row tiles (DMatrix::tiled), fed by bulk copies
// (gemm_q4_wg.cu says why): `tokens` per block, 128 (the default: units of 64 features, q4_wg_units(a,
// 64)) or 64 (units of 128 features: q4_wg_units(a); CK_Q4_WG_WIDE=0). a.xf holds the activations in
// q4_xfrag_kernel's tile layout for tiles of `tokens` rows: per tile and group one block of
// q4_wg_act_block_bytes(parts, tokens) bytes, laid out as the kernel's shared memory holds it (Σ x
// included; a.gsum is not read).
// fold (two parts and 128 tokens only): the folded form, the scales in the A operand and the bias term
// as products (gemm_q4_wg.cu), with a.units_per_block warpgroups a block (2 or 3, as q4_wg_units laid
// the units out); else the factored form (two units a block).
void launch_q4_wg_bulk(unsigned feature_tiles, unsigned splits, const Q4WgArgs& a, int parts, int tokens, bool fold,
                       cudaStream_t stream);
// The mix's up projection (one job: S H rows in tiles, no epilogue) with the gate mean of spec §4 as its
// epilogue, u = Σ_s sigmoid(g_s) X_s / S, so g never goes to memory: the folded three-warpgroup form with
// 128 tokens, its blocks in clusters of S (a.hc_s: 2, 4 or 8), block s of a cluster taking stream s's
// rows of the same 192 features; a.hc_* say where X and u are. q4_wg_gate_mean_ready(S): whether this
// device runs such clusters.
bool q4_wg_gate_mean_ready(int S);
void launch_q4_wg_gate_mean(const Q4WgArgs& a, cudaStream_t stream);
// The gate-mean kernels' launch: grid, block and dynamic shared memory, in clusters of S blocks along x
// (attr: the one launch attribute, which the configuration points to).
inline cudaLaunchConfig_t wg_cluster_config(dim3 grid, unsigned threads, int smem, int S, cudaLaunchAttribute* attr,
                                            cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(S);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}
// The same product and gate mean as a persistent kernel (gemm_q4_wg_gate_mean.cu says why), for the
// fp16 form (a.x_inv) with K of at most kQ4WgGateMeanMaxGroups groups: clusters of S blocks that each
// take a run of (192 features, 64-token tile) items, so a.xf holds q4_xfrag_kernel's tile layout for tiles
// of 64 rows. The same bits of u as launch_q4_wg_gate_mean.
constexpr int kQ4WgGateMeanMaxGroups = 5;  // K <= 320: a warp's A fragments of all of K in registers
bool q4_wg_gate_mean_persistent_ready(int S);
void launch_q4_wg_gate_mean_persistent(const Q4WgArgs& a, cudaStream_t stream);
// One (tile of `rows` rows, group) block of the tile layout: (step s, part p) of B core matrices at
// (s parts + p) q4_wg_b_bytes(rows) (the rows x 16 k values of bf16), then the rows' Σ x (floats).
CK_HD constexpr int q4_wg_b_bytes(int rows) { return rows * 32; }
CK_HD constexpr int q4_wg_act_block_bytes(int parts, int rows) { return parts * 4 * q4_wg_b_bytes(rows) + rows * 4; }

}  // namespace ck::cuda
