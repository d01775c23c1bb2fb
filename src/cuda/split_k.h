// Dense split-K, shared by the prefill GEMMs (gemm.cu's tf32x3 kernel, gemm_q4.cu's 4-bit kernel):
// when a product has too few blocks to fill the GPU, block z of the grid sums only its slice of K and
// writes the raw sums to scratch; split_k_finish then adds the slices in index order (deterministic)
// and applies each job's epilogue.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ops.h"

namespace ck::cuda {

// Split z of job j, output row r, feature n: partial[z * stride + off[j] + r * N_j + n].
struct SplitK {
  float* partial = nullptr;  // null: no split (the kernels apply the epilogue themselves)
  int64_t stride = 0;        // floats per split: rows x Σ N_j
  int64_t off[kMaxGemvJobs + 1] = {};
};

// Lays out the jobs' slices and allocates `splits` of them (stream-ordered scratch).
SplitK split_k_start(const GemvJob* jobs, int n_jobs, int rows, int splits, cudaStream_t stream);
// y_j = epi_j(Σ_z partial_z) for every job, row and feature, then frees the scratch.
void split_k_finish(const SplitK& s, const GemvJob* jobs, int n_jobs, int splits, cudaStream_t stream);

}  // namespace ck::cuda
