// The last step of the prefill mix's fused gate mean, shared by its two forms: q4_wg_bulk_kernel's
// gate-mean epilogue (gemm_q4_wg.cu, wg_gate_mean_store) and the persistent kernel
// (gemm_q4_wg_gate_mean.cu). A cluster of S blocks (block s: stream s) holds, in each block's shared
// memory P, the products sigmoid(g_s) X_s of one tile of TN tokens x the block's features; block s adds
// the S blocks' products of tokens [s TN / S, (s + 1) TN / S) in stream order (hc_gate_mean_kernel's
// order) and writes u = sum / S in 16-byte stores.
#pragma once
#include <cooperative_groups.h>

#include "cuda/gemm_q4_wg.h"

namespace ck::cuda {

// P: [TN][LD] floats, kQuads quads of features a row (nq of them real); this block is stream s (its
// rank in the cluster); u's features f0 + [0, 4 nq). row_of(r): the chunk row of tile token r, or -1
// past the chunk (its sums are not written). Starts with the cluster barrier that makes every block's
// products visible.
template <int TN, int LD, int kQuads, int kThreads, class RowOf>
__device__ __forceinline__ void gate_mean_cluster_sum(const Q4WgArgs& a, const float* P, int s, int f0, int nq,
                                                      RowOf row_of) {
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int S = a.hc_s;
  cluster.sync();  // every block's products, visible to the cluster
  const int tok = TN / S;  // this block's tokens: [s tok, (s + 1) tok)
  for (int e = static_cast<int>(threadIdx.x); e < tok * kQuads; e += kThreads) {
    const int r = s * tok + e / kQuads, q = e % kQuads, row = row_of(r);
    if (row < 0 || q >= nq) continue;
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int b = 0; b < S; ++b) {
      const float4 v = *reinterpret_cast<const float4*>(cluster.map_shared_rank(&P[r * LD + 4 * q], b));
      sum = make_float4(__fadd_rn(sum.x, v.x), __fadd_rn(sum.y, v.y), __fadd_rn(sum.z, v.z), __fadd_rn(sum.w, v.w));
    }
    const float fs = static_cast<float>(S);
    *reinterpret_cast<float4*>(a.hc_u + static_cast<size_t>(row) * a.ld_u + f0 + 4 * q) =
        make_float4(sum.x / fs, sum.y / fs, sum.z / fs, sum.w / fs);
  }
}

}  // namespace ck::cuda
