// Instruction-fetch lab: does code that runs once, straight through, cost more than its instructions?
// The one-row hyper-connection mix is ~4,000 SASS instructions that each block runs once, and each of
// its pieces takes 2-5k cycles whatever its data (docs/roofline-cuda.md, fifteenth session). Here the
// same FFMAs run as straight-line code (fully unrolled) and as a small loop, in blocks shaped like
// the mix's (512 threads) and as one warp, each launched twice in a row: if the straight-line form
// costs far more cycles than the loop, instruction fetch bounds code that runs once.
// Built by scripts/prepare_devcarry.sh (nvcc, sm_90); run on the GPU machine: ./icache_lab
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "lab_check.h"

// N FFMAs per thread over 8 independent accumulators. STRAIGHT: fully unrolled (N instructions of
// code); otherwise a loop of N / 64 turns over a 64-FFMA body. Thread 0 of each block stores the SM
// cycles of the region in cycles[blockIdx.x].
template <int N, bool STRAIGHT>
__global__ void ffma_region(const float* in, float* out, long long* cycles) {
  float a[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) a[i] = in[(threadIdx.x + i) & 31];
  const float m = in[32], c = in[33];
  __syncthreads();
  const long long t0 = clock64();
  if constexpr (STRAIGHT) {
#pragma unroll
    for (int i = 0; i < N; ++i) a[i & 7] = fmaf(a[i & 7], m, c);
  } else {
#pragma unroll 1
    for (int k = 0; k < N / 64; ++k) {
#pragma unroll
      for (int i = 0; i < 64; ++i) a[i & 7] = fmaf(a[i & 7], m, c);
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += a[i];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int N, bool STRAIGHT>
int run(const char* name, int blocks, int threads, const float* in, float* out, long long* cycles) {
  std::vector<long long> h(blocks);
  for (int launch = 1; launch <= 2; ++launch) {
    ffma_region<N, STRAIGHT><<<blocks, threads>>>(in, out, cycles);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(h.data(), cycles, sizeof(long long) * blocks, cudaMemcpyDeviceToHost));
    std::sort(h.begin(), h.end());
    const double issue = static_cast<double>(N) * (threads / 32) / 4.0;  // one warp-instruction per cycle per scheduler
    std::printf("icache  %-9s N %5d  %4d threads  launch %d: median %7lld cycles (max %7lld); %6.2f cycles per FFMA per warp; issue floor %7.0f\n",
                name, N, threads, launch, h[blocks / 2], h[blocks - 1],
                static_cast<double>(h[blocks / 2]) / N, issue);
  }
  return 0;
}

int main() {
  const int blocks = 80;
  float *in = nullptr, *out = nullptr;
  long long* cycles = nullptr;
  CHECK(cudaMalloc(&in, 64 * sizeof(float)));
  CHECK(cudaMalloc(&out, blocks * 512 * sizeof(float)));
  CHECK(cudaMalloc(&cycles, blocks * sizeof(long long)));
  std::vector<float> h(64, 1.0001f);
  h[33] = 0.5f;
  CHECK(cudaMemcpy(in, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
  for (int threads : {32, 512}) {
    if (run<512, true>("straight", blocks, threads, in, out, cycles) || run<512, false>("loop", blocks, threads, in, out, cycles) ||
        run<2048, true>("straight", blocks, threads, in, out, cycles) || run<2048, false>("loop", blocks, threads, in, out, cycles) ||
        run<4096, true>("straight", blocks, threads, in, out, cycles) || run<4096, false>("loop", blocks, threads, in, out, cycles) ||
        run<8192, true>("straight", blocks, threads, in, out, cycles) || run<8192, false>("loop", blocks, threads, in, out, cycles))
      return 1;
  }
  return 0;
}
