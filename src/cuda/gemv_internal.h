// Internal to the GEMV files: gemv.cu (v1 and the public entry points), gemv_q.cu (v2/v3, the CUDA
// cores), gemv_tc4.cu (v4, the tensor cores) and gemv_experts.cu (the decode experts on the tensor
// cores): the helpers more than one of them uses and the launchers one calls in another.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "cuda/common.h"
#include "cuda/ops.h"

namespace ck::cuda {

// gemv.cu: the arithmetic of 4/8-bit GEMVs, 4 (v4, the default), 3 or 2 (CK_GEMV=v3, v2).
int q_arith();
// gemv.cu: the v1 GEMV kernel for any number of rows (the reference arithmetic, over batches of 8 rows;
// gemv's last choice, and gemv_narrow_rows').
void gemv_v1(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream);

// An unsigned code below 2^23 as a float, without the slow integer-to-float conversion: the code is
// placed in the mantissa of 2^23 and 2^23 subtracted (exact).
__device__ __forceinline__ float code_to_float(uint32_t c) { return __uint_as_float(0x4B000000u | c) - 8388608.0f; }

constexpr int kTcBlockGroups = 40;    // groups of x a block holds as fragments (1,028 bytes each)

// Resident blocks per SM of a 256-thread kernel (asked once per kernel).
template <class K>
int blocks_per_sm(K kernel) {
  int n = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, 256, 0));
  return std::max(1, n);
}

// gemv_tc4.cu: raises gemv_tc4_rows_kernel's shared-memory limit at 5-8 rows (before any capture).
void init_gemv_tc4();

// gemv_q.cu
bool gemv_v2(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream);
void init_gemv_q();
void expert_gate_up_q(const ExpertPair* pairs, int n_pairs, int max_inter, const float* x, int ldx, float* h, int ldh,
                      cudaStream_t stream);
void expert_down_q(const ExpertPair* pairs, int n_pairs, int hidden, const float* h, int ldh, float* y, int ldy,
                   cudaStream_t stream);

// gemv_tc4.cu
struct ConvTail;
bool gemv_tc4(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream,
              const Tc4Frags* pre, const ConvTail* conv = nullptr);
void tc4_frag_vectors(const float* x, int ldx, int n_vec, int groups, size_t frag_elems, uint2* f, float* gs,
                      cudaStream_t s);

}  // namespace ck::cuda
