// Layer-level kernels of the qwen4_exp forward (declared in cuda/layers.h), MoE: the router (top-k
// experts and their weights, the route's pairs) and the slot-ordered expert sum, then their launchers.
// Each kernel is the device twin of a piece of src/cpu/qwen4_exp.cpp and written to be read beside it.
// Where the CPU rounds a product before adding it, the kernels use __fmul_rn/__fadd_rn so no FMA
// contraction changes the bits.
#include <algorithm>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/layers.h"
#include "cuda/ops.h"

namespace ck::cuda {
namespace {

// ------------------------------------------------------------------ MoE

constexpr int kMaxCombineSlots = 64;  // moe_combine4_kernel's routed slots (moe_route allows k <= 64)

// Slot t of row r's pairs: routed expert e with its weight (t < k), or the shared expert (t == k).
__device__ __forceinline__ void write_route_pair(const MoeRouteArgs& a, int r, int t, int e, float weight) {
  ExpertPair pr;
  pr.x_row = r;
  if (t < a.k) {
    const ExpertSlot slot = a.table[e];
    expert_views(slot.addr, slot.fmt, a.inter, a.hidden, &pr.gate, &pr.up, &pr.down);
    pr.weight = weight;
    pr.group = e;
  } else {
    pr.gate = a.sh_gate;
    pr.up = a.sh_up;
    pr.down = a.sh_down;
    pr.weight = 0.0f;
    pr.group = a.E;
  }
  a.pairs[static_cast<size_t>(r) * (a.k + 1) + t] = pr;
}

// grid (rows), block 256, dynamic shared memory E floats + E bytes. Any E (moe_route_warp_kernel
// takes E <= 1,024).
__global__ void moe_route_kernel(const MoeRouteArgs a) {
  pdl_begin();
  extern __shared__ float prob[];
  __shared__ float scratch[32];
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ int top[64];
  __shared__ float top_sum;
  uint8_t* flags = reinterpret_cast<uint8_t*>(prob + a.E);
  const int r = blockIdx.x;
  const float* lg = a.logits + static_cast<size_t>(r) * a.ld;
  const float* lg2 = a.logits2 ? a.logits2 + static_cast<size_t>(r) * a.ld : nullptr;
  auto logit = [&](int e) { return lg2 ? lg[e] + lg2[e] : lg[e]; };
  float mx = -INFINITY;
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) mx = fmaxf(mx, logit(e));
  mx = block_max(mx, scratch);
  float sum = 0.0f;
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) {
    const float v = expf(logit(e) - mx);
    prob[e] = v;
    sum += v;
  }
  sum = block_sum(sum, scratch);
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) prob[e] /= sum;
  __syncthreads();
  block_topk(prob, a.E, a.k, top, flags, sv, si);
  if (threadIdx.x == 0) {
    float ts = 0.0f;
    for (int t = 0; t < a.k; ++t) ts += prob[top[t]];
    top_sum = ts;
  }
  __syncthreads();
  for (int t = threadIdx.x; t <= a.k; t += blockDim.x) {
    const int e = t < a.k ? top[t] : 0;
    write_route_pair(a, r, t, e, t < a.k ? (a.norm_topk ? prob[e] / top_sum : prob[e]) : 0.0f);
  }
}

// The same routing with one warp per row and no block barriers, for E <= 32 VPL: lane l holds the
// probabilities of experts [VPL l, VPL l + VPL) in registers as order keys with its best (its head),
// and each of the k rounds takes the best head of the 32 lanes with one REDUX max and a ballot (ties
// to the lower index, NaN never wins over a number: block_topk's rules); only the lane that gave the
// pick looks for its next head. The softmax sums in another order than the block kernel (a warp's
// butterfly): probabilities may differ from it in the last bit.
// Why: until 2026-12-06 every lane scanned its 16 unused values each round with the float tie and NaN
// rules, then the warp ran a 5-level shuffle argmax: ~200 instructions a round at ~4 cycles each on
// one warp, 58% of the kernel's 8.9 us on an H100 (Nsight Compute source counters), on the decode
// step's critical path between the router and the experts, once per layer. Now 7.52 us alone (was
// 8.84 in the same build's call), decode +1.1% at one row and +0.7% at 4 (H100 2026-12-06 05:43Z, two
// interleaved rounds against the previous build). (A bitonic sort of each lane's keys first, then
// popping heads, compiled to branches and saved only 18% of the instructions: 8.84 -> 8.32 us, decode
// level.)
// grid (ceil(rows / 8)), block 32 min(rows, 8).
template <int VPL>
__global__ void __launch_bounds__(256) moe_route_warp_kernel(const MoeRouteArgs a, int rows, int prefetch_table) {
  // The expert table (param_prefetch_on()): constant during a step, read once the picks are known, and
  // out of L2 again by the next step (8 KB of lines at E = 512: a DRAM round trip in the route's tail).
  if (prefetch_table && blockIdx.x == 0) {
    const uint8_t* tb = reinterpret_cast<const uint8_t*>(a.table);
    const int bytes = a.E * static_cast<int>(sizeof(ExpertSlot));
    for (int off = 128 * static_cast<int>(threadIdx.x); off < bytes; off += 128 * static_cast<int>(blockDim.x))
      prefetch_l2(tb + off);
  }
  pdl_begin();
  const int lane = threadIdx.x & 31, r = static_cast<int>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  if (r >= rows) return;
  const float* lg = a.logits + static_cast<size_t>(r) * a.ld;
  const float* lg2 = a.logits2 ? a.logits2 + static_cast<size_t>(r) * a.ld : nullptr;
  const int e0 = VPL * lane;
  float p[VPL];
#pragma unroll
  for (int j = 0; j < VPL; ++j) p[j] = e0 + j < a.E ? lg[e0 + j] : -INFINITY;
  if (lg2)
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (e0 + j < a.E) p[j] += lg2[e0 + j];
  float mx = p[0];
#pragma unroll
  for (int j = 1; j < VPL; ++j) mx = fmaxf(mx, p[j]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < VPL; ++j) {
    p[j] = e0 + j < a.E ? expf(p[j] - mx) : 0.0f;
    sum += p[j];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int j = 0; j < VPL; ++j) p[j] /= sum;
  // The lane's values as order keys: a probability's bits + 2 (monotone for p >= 0, which softmax
  // gives), 1 for a NaN (picked only once no number is left), 0 for a pick or an expert past E (never
  // picked). The lane's head: its largest key, the lowest index among equals.
  uint32_t key[VPL];
#pragma unroll
  for (int j = 0; j < VPL; ++j) key[j] = e0 + j >= a.E ? 0u : p[j] != p[j] ? 1u : __float_as_uint(p[j]) + 2u;
  uint32_t hk = 0u;
  int hj = 0;
  auto find_head = [&] {
    hk = 0u;
    hj = 0;
#pragma unroll
    for (int j = 0; j < VPL; ++j)
      if (key[j] > hk) {
        hk = key[j];
        hj = j;
      }
  };
  find_head();
  int mine0 = 0, mine1 = 0;  // lane l keeps the picks of rounds l and l + 32 (k <= 64)
  float mine0_p = 0.0f, mine1_p = 0.0f;
  float ts = 0.0f;
  // Each round: the largest head of the 32 lanes (one REDUX), the lowest lane holding it (a lane holds
  // lower indices than the lanes after it), whose head is the pick; that lane alone finds its next head.
  // The pick's probability is its key's bits.
#pragma unroll 1
  for (int t = 0; t < a.k; ++t) {
    const uint32_t mk = __reduce_max_sync(0xffffffffu, hk);
    const int owner = __ffs(__ballot_sync(0xffffffffu, hk == mk)) - 1;
    const int bi = __shfl_sync(0xffffffffu, e0 + hj, owner);
    const float pv = mk >= 2u ? __uint_as_float(mk - 2u) : __int_as_float(0x7fc00000);  // (a NaN)
    if (lane == owner) {
#pragma unroll
      for (int j = 0; j < VPL; ++j)
        if (j == hj) key[j] = 0u;
      find_head();
    }
    ts += pv;  // block kernel's order: the picks' probabilities in round order
    if (t == lane) {
      mine0 = bi;
      mine0_p = pv;
    } else if (t == lane + 32) {
      mine1 = bi;
      mine1_p = pv;
    }
  }
  // The lane's slots t = lane + 32 h: its picks of rounds lane and lane + 32, and (t == k) the shared
  // expert's, through one call site (three inlined copies of write_route_pair, and the rounds' loop
  // unrolled, made 35 KB of SASS at E = 512; now 26 KB; decode level, H200 2026-12-01 18:30Z).
#pragma unroll 1
  for (int h = 0; h < 3; ++h) {
    const int t = lane + 32 * h;
    if (t > a.k) break;
    const int e = h == 0 ? mine0 : h == 1 ? mine1 : 0;
    const float pv = h == 0 ? mine0_p : h == 1 ? mine1_p : 0.0f;
    write_route_pair(a, r, t, e, t < a.k ? (a.norm_topk ? pv / ts : pv) : 0.0f);
  }
}

// grid (ceil(H/256), rows), block 256.
__global__ void moe_combine_kernel(const float* y, int ldy, const ExpertPair* pairs, int k, const float* gl, int ldgl,
                                   float* out, int ldo, int H) {
  pdl_begin();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= H) return;
  const int r = blockIdx.y;
  const size_t p0 = static_cast<size_t>(r) * (k + 1);
  const float gamma = sigmoidf_(gl[static_cast<size_t>(r) * ldgl]);
  out[static_cast<size_t>(r) * ldo + i] = moe_combine_elem(y + p0 * ldy, ldy, pairs + p0, k, gamma, i);
}

// moe_combine_kernel with 4 elements a thread: the row's weights read once into shared memory, and
// the slots' 16-byte loads issued 4 slots at a time before their adds. The same products and the same
// fp64 sum in slot order as moe_combine_elem, so the same bits.
// Why: moe_combine_elem's loop keeps one 4-byte load in flight a thread (each add waits for its load,
// and the weight it multiplies is a load from a 200-byte ExpertPair): a 496-row combine of 11 slots
// read at ~1.9 TB/s on an H100 (30.3 us a layer, Nsight Compute 2026-12-06); this kernel takes 26.4 us
// there, 94.8 us for 2,032 rows and 339 us for 8,176 (2.97 TB/s: the H100's copy rate).
// grid (ceil(H / 1024), rows), block 256; H, ldy and ldo multiples of 4, y and out 16-byte aligned.
__global__ void moe_combine4_kernel(const float* y, int ldy, const ExpertPair* pairs, int k, const float* gl, int ldgl,
                                    float* out, int ldo, int H) {
  __shared__ float wt[kMaxCombineSlots];
  pdl_begin();
  const int r = blockIdx.y;
  const size_t p0 = static_cast<size_t>(r) * (k + 1);
  for (int t = threadIdx.x; t < k; t += blockDim.x) wt[t] = pairs[p0 + t].weight;
  __syncthreads();
  const int i = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= H) return;
  const float* yr = y + p0 * ldy + i;
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  auto slot = [&](int t) { return *reinterpret_cast<const float4*>(yr + static_cast<size_t>(t) * ldy); };
  auto add = [&](const float4& q, float w) {  // moe_combine_elem's terms: fp32 products, fp64 sums
    acc[0] += static_cast<double>(__fmul_rn(q.x, w));
    acc[1] += static_cast<double>(__fmul_rn(q.y, w));
    acc[2] += static_cast<double>(__fmul_rn(q.z, w));
    acc[3] += static_cast<double>(__fmul_rn(q.w, w));
  };
  int t = 0;
  for (; t + 4 <= k; t += 4) {
    float4 q[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) q[u] = slot(t + u);
#pragma unroll
    for (int u = 0; u < 4; ++u) add(q[u], wt[t + u]);
  }
  for (; t < k; ++t) add(slot(t), wt[t]);
  const float gamma = sigmoidf_(gl[static_cast<size_t>(r) * ldgl]);
  const float4 ys = slot(k);
  float4 o;
  o.x = __fadd_rn(static_cast<float>(acc[0]), __fmul_rn(gamma, ys.x));
  o.y = __fadd_rn(static_cast<float>(acc[1]), __fmul_rn(gamma, ys.y));
  o.z = __fadd_rn(static_cast<float>(acc[2]), __fmul_rn(gamma, ys.z));
  o.w = __fadd_rn(static_cast<float>(acc[3]), __fmul_rn(gamma, ys.w));
  *reinterpret_cast<float4*>(out + static_cast<size_t>(r) * ldo + i) = o;
}

}  // namespace

SharedSlot route_shared_slot(const MoeRouteArgs& a) {  // write_route_pair's layout
  SharedSlot sh;
  sh.k1 = a.k + 1;
  sh.gate = a.sh_gate;
  sh.up = a.sh_up;
  return sh;
}

void moe_route(const MoeRouteArgs& a, int rows, cudaStream_t stream) {
  CK_REQUIRE(a.k >= 1 && a.k <= 64 && a.k <= a.E && a.E <= 8192, "invariant");
  // A warp per row up to 1,024 experts (CK_ROUTE_WARP=0: the block kernel, to compare).
  static const bool warp = !env_is("CK_ROUTE_WARP", "0");
  const int vpl = static_cast<int>(ceil_div(a.E, 32));
  if (warp && vpl <= 32) {
    const unsigned grid = static_cast<unsigned>(ceil_div(rows, 8)), block = 32 * std::min(rows, 8);
    const int pt = param_prefetch_on() ? 1 : 0;
    if (vpl <= 1) launch(moe_route_warp_kernel<1>, grid, block, 0, stream, a, rows, pt);
    else if (vpl <= 2) launch(moe_route_warp_kernel<2>, grid, block, 0, stream, a, rows, pt);
    else if (vpl <= 4) launch(moe_route_warp_kernel<4>, grid, block, 0, stream, a, rows, pt);
    else if (vpl <= 8) launch(moe_route_warp_kernel<8>, grid, block, 0, stream, a, rows, pt);
    else if (vpl <= 16) launch(moe_route_warp_kernel<16>, grid, block, 0, stream, a, rows, pt);
    else launch(moe_route_warp_kernel<32>, grid, block, 0, stream, a, rows, pt);
  } else {
    launch(moe_route_kernel, rows, 256, sizeof(float) * a.E + a.E, stream, a);
  }
  CUDA_CHECK_LAUNCH();
}

void moe_combine(const float* y, int ldy, const ExpertPair* pairs, int k, const float* gl, int ldgl, float* out,
                 int ldo, int H, int rows, cudaStream_t stream) {
  // CK_MOE_COMBINE4=0: one element a thread (moe_combine_kernel), to compare.
  static const bool four = !env_is("CK_MOE_COMBINE4", "0");
  const bool aligned = (reinterpret_cast<uintptr_t>(y) | reinterpret_cast<uintptr_t>(out)) % 16 == 0;
  if (four && aligned && H % 4 == 0 && ldy % 4 == 0 && ldo % 4 == 0 && k <= kMaxCombineSlots)
    launch(moe_combine4_kernel, dim3(static_cast<unsigned>(ceil_div(H, 1024)), rows), 256, 0, stream, y, ldy, pairs, k,
           gl, ldgl, out, ldo, H);
  else
    launch(moe_combine_kernel, dim3(static_cast<unsigned>(ceil_div(H, 256)), rows), 256, 0, stream, y, ldy, pairs, k,
           gl, ldgl, out, ldo, H);
  CUDA_CHECK_LAUNCH();
}

}  // namespace ck::cuda
