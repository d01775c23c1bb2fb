// Layer-level kernels of the qwen4_exp forward (declared in cuda/layers.h), each the device twin of
// a piece of src/cpu/qwen4_exp.cpp and written to be read beside it, one file per stage of the data
// flow: layers_hc.cu (embedding, hyper-connections), layers_deltanet.cu (Gated DeltaNet, recurrent and
// chunked), layers_attention.cu (QSA attention), layers_ple.cu (PLE), layers_moe.cu (MoE). This file
// holds what they share: init_kernels, which calls each file's attribute set-up (layers_internal.h),
// and rope_inv_freq.
#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda/common.h"
#include "cuda/layers.h"
#include "cuda/layers_internal.h"
#include "cuda/ops.h"

namespace ck::cuda {

void init_kernels() {
  init_gemv();
  hc_mix_init();
  // Kernels take their scratch with cudaMallocAsync (split-K partials, activation fragments, the chunked
  // delta rule's records: ~220 MB per 2,048-row prefill chunk at the released geometry). By default
  // the pool hands memory back to the driver at every synchronisation, so each prefill chunk would map
  // it again; keep up to 512 MB pooled instead.
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t keep = uint64_t{512} << 20;
  CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  init_deltanet_kernels();
  init_attention_kernels();
}

std::vector<float> rope_inv_freq(int rot_dim, double theta) {
  std::vector<float> f(static_cast<size_t>(rot_dim / 2));
  for (int j = 0; j < rot_dim / 2; ++j)
    f[j] = 1.0f / static_cast<float>(std::pow(theta, static_cast<double>(2 * j) / rot_dim));
  return f;
}

}  // namespace ck::cuda
