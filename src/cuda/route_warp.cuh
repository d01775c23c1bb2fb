// The decode route of one row on one warp (moe_route_warp_kernel's arithmetic), as device functions
// for the kernels that route for themselves: moe_route_warp_kernel (layers_moe.cu), and the decode
// experts' streaming kernels with CK_ROUTE_IN_EXPERTS=1 (gemv_experts.cu), which compute the same picks
// from the router's logits in every block instead of reading the pairs a route kernel wrote.
#pragma once

#include <cmath>

#include "cuda/common.h"
#include "cuda/device_ops.cuh"
#include "cuda/layers.h"

namespace ck::cuda {

// Slot t of row r's pairs: routed expert e with its weight (t < k), or the shared expert (t == k).
__device__ __forceinline__ ExpertPair make_route_pair(const MoeRouteArgs& a, int r, int t, int e, float weight) {
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
  return pr;
}

// A lane's share of a row's route: its picks of rounds lane and lane + 32 (expert, probability) and
// the picks' probability sum (every lane).
struct RoutePicks {
  int e0 = 0, e1 = 0;
  float p0 = 0.0f, p1 = 0.0f, ts = 0.0f;
};

// Row r's softmax over E <= 32 VPL logits and its top k (k <= 64) on the calling warp (all 32 lanes):
// lane l holds the probabilities of experts [VPL l, VPL l + VPL) in registers as order keys with its
// best (its head), and each of the k rounds takes the best head of the 32 lanes with one REDUX max and
// a ballot (ties to the lower index, NaN never wins over a number: block_topk's rules); only the lane
// that gave the pick looks for its next head. Slot t's weight: p_t / ts with norm_topk, else p_t.
template <int VPL>
__device__ __forceinline__ void route_row_picks(const MoeRouteArgs& a, int r, int lane, RoutePicks& out) {
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
  out.e0 = mine0, out.e1 = mine1, out.p0 = mine0_p, out.p1 = mine1_p, out.ts = ts;
}

// The weight of slot t's pick (t < k) as moe_route writes it.
__device__ __forceinline__ float route_slot_weight(const MoeRouteArgs& a, float p, float ts) {
  return a.norm_topk ? p / ts : p;
}

}  // namespace ck::cuda
