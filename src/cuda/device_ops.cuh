// Device helpers shared by the kernel files (nvcc only): element access to a DMatrix (the CPU's
// matrix_row formula), (value, index) argmax merging with the lowest-index tie rule (spec trap 29),
// and a block-wide top-k. No kernels here.
#pragma once
#include <algorithm>
#include <climits>

#include "cuda/common.h"
#include "cuda/dmatrix.h"
#include "cuda/ops.h"

namespace ck::cuda {

// Code i of a little-endian stream of `bits`-bit codes (format/matrix.h get_code).
__device__ __forceinline__ uint32_t get_code_dev(const uint8_t* stream, int64_t i, int bits) {
  const uint64_t bit = static_cast<uint64_t>(i) * static_cast<uint64_t>(bits);
  const uint64_t byte = bit >> 3;
  const uint32_t shift = static_cast<uint32_t>(bit & 7);
  uint32_t v = stream[byte];
  if (shift + bits > 8) v |= static_cast<uint32_t>(stream[byte + 1]) << 8;
  if (shift + bits > 16) v |= static_cast<uint32_t>(stream[byte + 2]) << 16;
  return (v >> shift) & ((1u << bits) - 1u);
}

// Asks L2 for the 128-byte lines of [p, p + bytes) (a hint: nothing waits on it; one line for bytes
// <= 128). Kernels ask for what no kernel before them writes before their pdl_begin().
__device__ __forceinline__ void prefetch_l2(const void* p, int bytes = 1) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (int off = 0; off < bytes; off += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(b + off) : "memory");
}

__device__ __forceinline__ float load_kind(const uint8_t* base, int64_t i, uint8_t kind) {
  if (kind == static_cast<uint8_t>(WKind::F32)) return reinterpret_cast<const float*>(base)[i];
  const uint16_t h = reinterpret_cast<const uint16_t*>(base)[i];
  return kind == static_cast<uint8_t>(WKind::BF16) ? bf16_bits_to_float(h) : f16_bits_to_float(h);
}

// Element (r, c) of m in fp32: s * q + b for codes, rounded as the CPU's matrix_row (no FMA).
__device__ __forceinline__ float dmatrix_elem(const DMatrix& m, int64_t r, int64_t c) {
  if (m.quantized()) {
    const uint8_t* codes = m.data + static_cast<size_t>(r) * (static_cast<size_t>(m.cols) * m.fmt.bits / 8);
    const int64_t si = r * (m.cols / m.fmt.group) + c / m.fmt.group;
    const float s = load_kind(m.scales, si, m.fmt.scale_kind), b = load_kind(m.biases, si, m.fmt.scale_kind);
    return __fadd_rn(__fmul_rn(s, static_cast<float>(get_code_dev(codes, c, m.fmt.bits))), b);
  }
  return load_kind(m.data, r * m.cols + c, m.fmt.kind);
}

// acc + a * b with two roundings, as the CPU reference adds products (no FMA contraction).
// Polls the word at w with acquire loads until done(value) (one thread; its later reads see what the
// writer released before the value). A wait of seconds means a block that never became resident (a
// launch's occupancy check failed to hold, e.g. under MPS with fewer SMs): trap, so the step fails with
// a CUDA error instead of hanging.
template <class Done>
__device__ __forceinline__ void poll_acquire_until(const unsigned* w, Done done) {
  unsigned v;
  uint64_t t0, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(w) : "memory");
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - t0 > 2000000000ull) __trap();
  } while (!done(v));
}

__device__ __forceinline__ float mul_add_rn(float acc, float a, float b) { return __fadd_rn(acc, __fmul_rn(a, b)); }

// Asynchronous copies global -> shared (sm_80+): 16 bytes (bypassing L1) or 4 bytes, grouped by
// cp_async_commit; cp_async_wait<N> waits until at most N committed groups are still in flight.
// cp_async16_shared takes the destination as a shared-window address (a loop can step it in 32 bits).
__device__ __forceinline__ void cp_async16_shared(unsigned smem_addr, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  cp_async16_shared(static_cast<unsigned>(__cvta_generic_to_shared(smem)), gmem);
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// What a GEMV or GEMM applies to each output before it is stored (ops.h Epilogue; `d` is the divisor).
__device__ __forceinline__ float apply_epilogue(float y, Epilogue e, float d) {
  switch (e) {
    case Epilogue::SiluDiv: return siluf_(y / d);
    case Epilogue::TwoSigmoidDiv: return 2.0f * sigmoidf_(y / d);
    default: return y;
  }
}

// Element i of one row's MoE output (DESIGN §2, "Exactness"): Σ_t w_t y_t over the routed slots in
// top-k order, each product rounded to fp32 and the sum in fp64, wherever each expert came from;
// then + sigmoid(gate logit) times the shared expert's y (slot k). y: the row's k + 1 slots at ldy;
// pairs: the row's slots. moe_combine_kernel and the one-row mix (which takes the combine into its
// first phase) share it, so both give the same bits.
__device__ __forceinline__ float moe_combine_elem(const float* y, int64_t ldy, const ExpertPair* pairs, int k,
                                                  float gamma, int64_t i) {
  double acc = 0.0;
  for (int t = 0; t < k; ++t) acc += static_cast<double>(__fmul_rn(y[t * ldy + i], pairs[t].weight));
  return __fadd_rn(static_cast<float>(acc), __fmul_rn(gamma, y[k * ldy + i]));
}

// moe_combine_elem with every slot's load issued before the first addition (k <= kFlatCombineSlots):
// the same fp32 products and the same fp64 sum in slot order, so the same bits. Why: the loop above
// runs its runtime count in unrolled batches (8, then the rest), each a round trip to L2 that waits for
// the one before, after the gate's sigmoid (a branch the loads are not hoisted over); here all k + 2
// loads (the slots, the shared expert and the gate logit) are one round trip. The one-row mix's phase 1
// takes it (CK_HC_FLAT_COMBINE, on by default: one-row decode +2.3%, H200 2026-12-07).
constexpr int kFlatCombineSlots = 16;
__device__ __forceinline__ float moe_combine_elem_flat(const float* y, int64_t ldy, const ExpertPair* pairs, int k,
                                                       const float* gate_logit, int64_t i) {
  // Slots past k read slot k (the shared expert's, which exists) and are not added: unconditional loads,
  // which the compiler issues together (predicated ones it interleaved with the additions, a round trip each).
  const float ys = y[k * ldy + i], gl = *gate_logit;
  float yv[kFlatCombineSlots], wv[kFlatCombineSlots];
#pragma unroll
  for (int t = 0; t < kFlatCombineSlots; ++t) {
    const int u = t < k ? t : k;
    yv[t] = y[u * ldy + i];
    wv[t] = pairs[u].weight;
  }
  double acc = 0.0;
#pragma unroll
  for (int t = 0; t < kFlatCombineSlots; ++t)
    if (t < k) acc += static_cast<double>(__fmul_rn(yv[t], wv[t]));
  return __fadd_rn(static_cast<float>(acc), __fmul_rn(sigmoidf_(gl), ys));
}

// (v, i) beats (bv, bi): larger value, or equal value and lower index. NaN never beats anything.
__device__ __forceinline__ bool arg_better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    if (arg_better(v2, i2, v, i)) { v = v2; i = i2; }
  }
}

// Block-wide argmax; every thread gets the result. sv/si: 32 entries of shared memory each.
// Precondition: blockDim.x a multiple of 32. Contains __syncthreads.
__device__ __forceinline__ void block_argmax(float& v, int& i, float* sv, int* si) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
  warp_argmax(v, i);
  __syncthreads();
  if (lane == 0) { sv[warp] = v; si[warp] = i; }
  __syncthreads();
  v = -INFINITY;
  i = INT_MAX;
  for (int w = 0; w < n_warps; ++w)
    if (arg_better(sv[w], si[w], v, i)) { v = sv[w]; i = si[w]; }
}

// Indices of the k largest of v[0..n) into out[0..k) (shared or global memory), in descending order,
// ties to the lower index (cpu::topk_desc). flags: n bytes of shared memory; sv/si as block_argmax.
// k rounds of a block argmax: cheap for the router's k <= 64 over a few hundred experts.
__device__ __forceinline__ void block_topk(const float* v, int n, int k, int* out, uint8_t* flags, float* sv, int* si) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) flags[i] = 0;
  __syncthreads();
  for (int t = 0; t < k; ++t) {
    float bv = -INFINITY;
    int bi = INT_MAX;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
      if (!flags[i] && arg_better(v[i], i, bv, bi)) { bv = v[i]; bi = i; }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) {
      if (bi == INT_MAX)  // only NaNs left: take the lowest unused index
        for (bi = 0; flags[bi]; ++bi) {}
      out[t] = bi;
      flags[bi] = 1;
    }
    __syncthreads();
  }
}

// The tail of a wide RMS norm (rmsnorm_wide_kernel, hc_combine_rmsnorm_kernel): a 1,024-thread block
// holds one group of n4 float4 in v (thread j: elements j + 1024k), adds the squares in that order,
// and writes (v * r) * scale. Both kernels share it so the fused form rounds exactly as the plain one.
// rinv_out: thread 0 writes 1 / rms there and nothing goes to orow (the XNorm form, cuda/ops.h).
__device__ __forceinline__ void rmsnorm_wide_tail(const float4 (&v)[4], int n4, int64_t group, const float4* sr,
                                                  float eps, float4* orow, float* scratch, float* rinv_out = nullptr) {
  float4 sc[4];  // the scales, asked for before the block-wide sum (not one round trip after it)
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) sc[k] = sr[i];
  }
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
  ss = block_sum(ss, scratch);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(group) + eps);
  if (rinv_out) {
    if (threadIdx.x == 0) *rinv_out = r;
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) {
      const float4 s = sc[k];
      orow[i] = make_float4((v[k].x * r) * s.x, (v[k].y * r) * s.y, (v[k].z * r) * s.z, (v[k].w * r) * s.w);
    }
  }
}

// The block for rmsnorm_wide_tail's kernels: the fewest warps that hold a group of n4 float4 at four
// per thread (2,560 floats: 160 threads). Blocks of 1,024 threads left 384 idle at H = 2,560 and
// allowed two blocks per SM: a prefill chunk's 4,096 (stream, row) blocks ran in 16 waves of one
// memory round trip each.
inline unsigned rmsnorm_wide_block(int64_t group) {
  const int64_t threads = (group / 4 + 3) / 4;
  return static_cast<unsigned>(std::min<int64_t>(1024, std::max<int64_t>(32, (threads + 31) / 32 * 32)));
}

}  // namespace ck::cuda
