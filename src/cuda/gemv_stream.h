// 1-8 activation rows through large 4-bit matrices with the weights streamed into shared memory by
// tensor-map copies (gemv_stream.cu): the path gemv() takes for the LM head of a decode step (and of
// a prompt's last row, and of a multi-row step).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/ops.h"

namespace ck::cuda {

// Launches y = epi(W x) for 1-8 rows of x (ldx apart; one row: 16-byte aligned) when every job is
// 4-bit codes in groups of 64 with 16-byte aligned codes, scales and biases, K a multiple of 512, the
// jobs hold at least the threshold's tiles x groups (set_gemv_stream_min_work, CK_GEMV_STREAM_MIN)
// and the block's shared memory fits; false otherwise, or with CK_GEMV_STREAM=0 (CK_GEMV_STREAM_ROWS=0:
// one row only). bf16s: every job's scales are bf16.
bool gemv_stream(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, bool bf16s, cudaStream_t s);
// Kernel attributes (init_gemv calls it, before any graph capture).
void gemv_stream_init();

}  // namespace ck::cuda
