// Device helpers shared by the kernel files (nvcc only): element access to a DMatrix (the CPU's
// matrix_row formula), (value, index) argmax merging with the lowest-index tie rule (spec trap 29),
// and a block-wide top-k. No kernels here.
#pragma once
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
__device__ __forceinline__ float mul_add_rn(float acc, float a, float b) { return __fadd_rn(acc, __fmul_rn(a, b)); }

// Asynchronous copies global -> shared (sm_80+): 16 bytes (bypassing L1) or 4 bytes, grouped by
// cp_async_commit; cp_async_wait<N> waits until at most N committed groups are still in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
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

// The rank key of a top-k value: unsigned order = float order (-0 taken as +0), NaN lowest (key 0,
// below -inf's 0x007fffff), so "larger key, then lower index" is arg_better's order with NaNs last.
__device__ __forceinline__ uint32_t topk_key(float f) {
  if (f != f) return 0u;
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// block_topk's shared memory.
struct TopkScratch {
  uint32_t hist[256];
  uint32_t warp_ties[32];
  uint32_t key[64];
  int idx[64];
  uint32_t prefix, remaining, n_sel;
};

// Indices of the k largest of v[0..n) into out[0..k) (shared or global memory), in descending order,
// ties to the lower index, NaNs after every number (cpu::topk_desc; arg_better's order). k <= 64,
// k <= n; blockDim.x a multiple of 32.
// A radix select (attn_select_kernel's): four passes over the 8-bit digits of topk_key find the key T
// of the k-th best and how many of the keys equal to T to take (the lowest-index ones); warp 0 finds
// each pass's digit with a scan over the 256 bins. Then the k chosen are compacted and each finds its
// place by counting the chosen that beat it. The former form, k rounds of a block argmax, was a chain
// of 10 dependent warp reductions and 30 barriers for the router: ~5.7 us of its 9.6 us (Nsight
// Compute warp sampling, 2026-11-30).
__device__ __forceinline__ void block_topk(const float* v, int n, int k, int* out, TopkScratch& s) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n_warps = blockDim.x >> 5;
  if (tid == 0) {
    s.prefix = 0;
    s.remaining = static_cast<uint32_t>(k);
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += blockDim.x) s.hist[b] = 0;
    __syncthreads();  // also publishes prefix and remaining
    const uint32_t prefix = s.prefix, rem = s.remaining;
    const uint32_t high = shift == 24 ? 0u : ~((1u << (shift + 8)) - 1u);
    for (int i0 = 0; i0 < n; i0 += blockDim.x) {  // one atomic per digit and warp: the keys crowd few digits
      const int i = i0 + tid;
      const uint32_t key = i < n ? topk_key(v[i]) : 0u;
      const uint32_t digit = i < n && (key & high) == (prefix & high) ? (key >> shift) & 255u : 256u;
      const uint32_t peers = __match_any_sync(0xffffffffu, digit);
      if (digit < 256u && lane == __ffs(peers) - 1) atomicAdd(&s.hist[digit], static_cast<uint32_t>(__popc(peers)));
    }
    __syncthreads();
    if (warp == 0) {  // lane l holds digits 255 - 8l down to 248 - 8l
      uint32_t c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = s.hist[255 - 8 * lane - j];
        sum += c[j];
      }
      uint32_t incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const uint32_t u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      uint32_t above = incl - sum;  // keys in higher digits
      if (above < rem && rem <= incl) {  // exactly one lane: the k-th best's digit is here
        int d = 255 - 8 * lane;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (above + c[j] >= rem) {
            d = 255 - 8 * lane - j;
            break;
          }
          above += c[j];
        }
        s.remaining = rem - above;  // of the keys with this digit, how many to take
        s.prefix = prefix | (static_cast<uint32_t>(d) << shift);
      }
    }
    __syncthreads();
  }
  const uint32_t T = s.prefix, take_ties = s.remaining;
  if (tid == 0) s.n_sel = 0;
  // The chosen: every key above T, and the first take_ties keys equal to T in index order.
  uint32_t ties_before = 0;  // keys equal to T in the chunks before (the same on every thread)
  for (int i0 = 0; i0 < n; i0 += blockDim.x) {
    const int i = i0 + tid;
    const uint32_t key = i < n ? topk_key(v[i]) : 0u;
    const bool tie = i < n && key == T;
    const uint32_t mask = __ballot_sync(0xffffffffu, tie);
    if (lane == 0) s.warp_ties[warp] = __popc(mask);
    __syncthreads();
    uint32_t before = ties_before + __popc(mask & ((1u << lane) - 1u));
    for (int w = 0; w < n_warps; ++w) {
      if (w < warp) before += s.warp_ties[w];
      ties_before += s.warp_ties[w];
    }
    if (i < n && (key > T || (tie && before < take_ties))) {
      const uint32_t slot = atomicAdd(&s.n_sel, 1u);
      s.key[slot] = key;
      s.idx[slot] = i;
    }
    __syncthreads();  // warp_ties read by all before the next chunk writes it; the chosen complete
  }
  if (tid < k) {  // place = how many of the chosen beat this one
    const uint32_t key = s.key[tid];
    const int idx = s.idx[tid];
    int place = 0;
    for (int j = 0; j < k; ++j) place += (s.key[j] > key || (s.key[j] == key && s.idx[j] < idx)) ? 1 : 0;
    out[place] = idx;
  }
  __syncthreads();
}

// The tail of a wide RMS norm (rmsnorm_wide_kernel, hc_combine_rmsnorm_kernel): a 1,024-thread block
// holds one group of n4 float4 in v (thread j: elements j + 1024k), adds the squares in that order,
// and writes (v * r) * scale. Both kernels share it so the fused form rounds exactly as the plain one.
__device__ __forceinline__ void rmsnorm_wide_tail(const float4 (&v)[4], int n4, int64_t group, const float4* sr,
                                                  float eps, float4* orow, float* scratch) {
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < 4; ++k) ss += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
  ss = block_sum(ss, scratch);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(group) + eps);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) {
      const float4 s = sr[i];
      orow[i] = make_float4((v[k].x * r) * s.x, (v[k].y * r) * s.y, (v[k].z * r) * s.z, (v[k].w * r) * s.w);
    }
  }
}

}  // namespace ck::cuda
