// Weight-layout lab: does the MLX row-major layout bound the one-row 4-bit GEMVs?
// gemv_tc4_kernel's lane (g, t) reads, per 64-code group, 8 bytes of row g and 8 of row g + 8 (two
// loads over 8 rows' lines each) and four 2-byte scales and biases (four loads over 8 rows' lines
// each): ~48 L1 lines touched per warp and 576-byte group. The tiled form keeps each (16-row tile,
// group) as 576 contiguous bytes in the lanes' order: one 16-byte load of codes and one 8-byte load
// of scales per lane (5 lines). Each form runs with loads only and with the v4 arithmetic (codes as
// bf16 MMA operands, one activation row, fragments from global memory as gemv_tc4_kernel<1>), over
// ten copies of an in_proj-sized matrix (16,384 x 2,560, 23.6 MB; 236 MB in all, past L2) in a CUDA
// graph of 40 launches, beside a plain read of the same bytes. Variants of the tiled arithmetic: the
// one row's B fragments in a compact layout (only MMA columns 0-2's lanes load), none loaded at all
// (their cost), the LOP3 unpacking, and each warp's range bulk-copied to shared memory first.
// Built by scripts/prepare_devcarry.sh (nvcc, sm_90, -Isrc); run on the GPU machine: ./gemv_layout_lab
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <vector>

#include "cuda/bulk_copy.cuh"
#include "lab_check.h"


constexpr int kRows = 16384, kCols = 2560, kGroups = kCols / 64, kTiles = kRows / 16, kCopies = 10;
constexpr size_t kCodeBytes = size_t(kRows) * kCols / 2, kScaleElems = size_t(kRows) * kGroups;
constexpr size_t kTileGroupBytes = 576;  // 512 code bytes + 16 rows x (scale, bias) bf16
constexpr size_t kTiledBytes = size_t(kTiles) * kGroups * kTileGroupBytes;

__device__ __forceinline__ uint32_t code_pair(uint32_t w, int i) {
  const uint32_t v = ((w >> (4 * i)) & 0x000F000Fu) | 0x43004300u;
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(128.0f, 128.0f));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// code_pair with the mask and the exponent in one LOP3 (mma_q4.cuh's code_pair_lop3).
__device__ __forceinline__ uint32_t code_pair_lop3(uint32_t w, int i) {
  uint32_t m;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(m) : "r"(w >> (4 * i)), "n"(0x000F000Fu), "r"(0x43004300u));
  const __nv_bfloat162 r = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&m), __floats2bfloat162_rn(128.0f, 128.0f));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float bf(unsigned short b) { return __uint_as_float(uint32_t(b) << 16); }

struct Mat {
  const uint8_t* codes;           // rows layout: [rows][cols / 2]
  const unsigned short* scales;   // [rows][groups]
  const unsigned short* biases;
  const uint8_t* tiled;           // tiled layout: [tile][group][576]
};

// One group's weights for lane (g, t). TILED bit 0: the codes tiled (otherwise rows); bit 1: the scales
// and biases tiled (otherwise two row-major arrays). Both tiled: the 576-byte blocks; codes only: the
// 512-byte code blocks with the scales in their own [tile][group] 64-byte blocks, and so on.
template <int TILED>
__device__ __forceinline__ void load_group(const Mat& m, int tile, int G, int g, int t, uint2& wa, uint2& wb, float& sa,
                                           float& ba, float& sb, float& bb) {
  const uint8_t* p = m.tiled + (size_t(tile) * kGroups + G) * kTileGroupBytes;
  const int ra = tile * 16 + g, rb = ra + 8;
  if constexpr (TILED & 1) {
    const uint4 c = __ldg(reinterpret_cast<const uint4*>(TILED == 1 ? m.tiled + (size_t(tile) * kGroups + G) * 512 : p) + 4 * g + t);
    wa = make_uint2(c.x, c.y);
    wb = make_uint2(c.z, c.w);
  } else {
    wa = __ldg(reinterpret_cast<const uint2*>(m.codes + size_t(ra) * (kCols / 2) + G * 32 + 8 * t));
    wb = __ldg(reinterpret_cast<const uint2*>(m.codes + size_t(rb) * (kCols / 2) + G * 32 + 8 * t));
  }
  if constexpr (TILED & 2) {
    const uint2 s = __ldg(reinterpret_cast<const uint2*>(TILED == 2 ? m.tiled + (size_t(tile) * kGroups + G) * 64 : p + 512) + g);
    sa = __uint_as_float(s.x << 16);
    ba = __uint_as_float(s.x & 0xFFFF0000u);
    sb = __uint_as_float(s.y << 16);
    bb = __uint_as_float(s.y & 0xFFFF0000u);
  } else {
    sa = bf(__ldg(m.scales + size_t(ra) * kGroups + G));
    ba = bf(__ldg(m.biases + size_t(ra) * kGroups + G));
    sb = bf(__ldg(m.scales + size_t(rb) * kGroups + G));
    bb = bf(__ldg(m.biases + size_t(rb) * kGroups + G));
  }
}

// One (tile, group) of the v4 arithmetic for lane (g, t): acc += s Σ q x + b Σ x for rows g (acc[0..1])
// and g + 8 (acc[2..3]). VAR (gemv_lab's): 0 the fragments as gemv_tc4_kernel<1> reads them ([G][step]
// [32 lanes], 1 KB per group, 5/8 of it the zero columns 3-7); 1 only the 12 lanes of columns 0-2
// load, from a compact [G][step][12] layout (384 bytes per group); 2 no fragment loads at all (what
// they cost, at most); 3 as 0 with code_pair_lop3; 4 as 1 with code_pair_lop3.
template <int VAR>
__device__ __forceinline__ void group_mma(uint2 wa, uint2 wb, float sa, float ba, float sb, float bb,
                                          const uint2* __restrict__ frag, const float* __restrict__ gsum, int G,
                                          float (&acc)[4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const uint2* fg = frag + size_t(G) * 4 * 32 + t * 8 + g;
  const uint2* fc = frag + size_t(G) * 4 * 12 + t * 3 + g;
  float d[4] = {};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const uint32_t xa = (s >> 1) ? wa.y : wa.x, xb = (s >> 1) ? wb.y : wb.x;
    const int i0 = 2 * (s & 1);
    uint2 b;
    if constexpr (VAR == 1 || VAR == 4) b = g < 3 ? __ldg(fc + s * 12) : make_uint2(0u, 0u);
    else if constexpr (VAR == 2) b = make_uint2(uint32_t(lane), uint32_t(G));
    else b = __ldg(fg + s * 32);
    if constexpr (VAR >= 3)
      mma_bf16(d, code_pair_lop3(xa, i0), code_pair_lop3(xb, i0), code_pair_lop3(xa, i0 + 1), code_pair_lop3(xb, i0 + 1),
               b.x, b.y);
    else
      mma_bf16(d, code_pair(xa, i0), code_pair(xb, i0), code_pair(xa, i0 + 1), code_pair(xb, i0 + 1), b.x, b.y);
  }
  const float x0 = __ldg(gsum + G * 8 + 2 * t), x1 = __ldg(gsum + G * 8 + 2 * t + 1);
  acc[0] = fmaf(sa, d[0], fmaf(ba, x0, acc[0]));
  acc[1] = fmaf(sa, d[1], fmaf(ba, x1, acc[1]));
  acc[2] = fmaf(sb, d[2], fmaf(bb, x0, acc[2]));
  acc[3] = fmaf(sb, d[3], fmaf(bb, x1, acc[3]));
}

// block 256 = 8 / ks tiles x ks warps splitting a tile's groups. MMA: the v4 arithmetic (group_mma, of
// variant VAR); otherwise the loaded words are only folded into a sum (so the loads stay).
template <int TILED, bool MMA, int VAR = 0>
__global__ void __launch_bounds__(256, 4) gemv_lab(Mat m, const uint2* __restrict__ frag, const float* __restrict__ gsum,
                                                   int ks, float* y) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int part = warp % ks, tile = blockIdx.x * (8 / ks) + warp / ks;
  const int per = (kGroups + ks - 1) / ks, G0 = min(kGroups, part * per), G1 = min(kGroups, G0 + per);
  float acc[4] = {};
  uint32_t fold = 0;
#pragma unroll 4
  for (int G = G0; G < G1; ++G) {
    uint2 wa, wb;
    float sa, ba, sb, bb;
    load_group<TILED>(m, tile, G, g, t, wa, wb, sa, ba, sb, bb);
    if constexpr (MMA) {
      group_mma<VAR>(wa, wb, sa, ba, sb, bb, frag, gsum, G, acc);
    } else {
      fold += wa.x ^ wa.y ^ wb.x ^ wb.y;
      acc[0] += sa + ba + sb + bb;
    }
  }
  const float v = acc[0] + acc[1] + acc[2] + acc[3] + float(fold & 1);
  if (v == 12345.678f) y[tile * 16 + g] = v;  // never true for the lab's data: keeps the work
}

// The tiled form with each warp's whole range (its part of its tile's groups: contiguous bytes in the
// tiled layout) brought to shared memory by one bulk copy, issued by lane 0 at the start, then the
// same arithmetic from shared memory. In a graph with programmatic dependent launch the copy could be
// issued before the wait for the kernel before (weights never change).
__global__ void __launch_bounds__(256, 4) gemv_lab_bulk(Mat m, const uint2* __restrict__ frag,
                                                        const float* __restrict__ gsum, int ks, float* y) {
  extern __shared__ uint4 stage[];
  __shared__ uint64_t bar[8];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int part = warp % ks, tile = blockIdx.x * (8 / ks) + warp / ks;
  const int per = (kGroups + ks - 1) / ks, G0 = min(kGroups, part * per), G1 = min(kGroups, G0 + per);
  uint4* mine = stage + size_t(warp) * per * (kTileGroupBytes / 16);
  if (lane == 0) {
    ck::cuda::mbar_init(&bar[warp]);
    ck::cuda::mbar_init_fence();
    const uint32_t bytes = uint32_t(G1 - G0) * kTileGroupBytes;
    ck::cuda::mbar_arrive_expect(&bar[warp], bytes);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     ck::cuda::smem_u32(mine)),
                 "l"(m.tiled + (size_t(tile) * kGroups + G0) * kTileGroupBytes), "r"(bytes), "r"(ck::cuda::smem_u32(&bar[warp]))
                 : "memory");
  }
  __syncwarp();
  ck::cuda::mbar_wait(&bar[warp], 0);
  float acc[4] = {};
#pragma unroll 2
  for (int G = G0; G < G1; ++G) {
    const uint4* p = mine + (G - G0) * (kTileGroupBytes / 16);
    const uint4 c = p[4 * g + t];
    const uint2 sw = reinterpret_cast<const uint2*>(p + 32)[g];
    const uint2 wa = make_uint2(c.x, c.y), wb = make_uint2(c.z, c.w);
    const float sa = __uint_as_float(sw.x << 16), ba = __uint_as_float(sw.x & 0xFFFF0000u);
    const float sb = __uint_as_float(sw.y << 16), bb = __uint_as_float(sw.y & 0xFFFF0000u);
    group_mma<0>(wa, wb, sa, ba, sb, bb, frag, gsum, G, acc);
  }
  const float v = acc[0] + acc[1] + acc[2] + acc[3];
  if (v == 12345.678f) y[tile * 16 + g] = v;
}

__global__ void read_lab(const uint4* __restrict__ p, size_t n, float* y) {
  uint32_t f = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldg(p + i);
    f ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (f == 0x12345678u) y[0] = 1.0f;
}

template <typename Launch>
double time_graph(Launch launch, int launches, cudaStream_t st) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < launches; ++i) launch(i % kCopies, st);
  CHECK(cudaStreamEndCapture(st, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaEventRecord(e0, st));
    CHECK(cudaGraphLaunch(exec, st));
    CHECK(cudaEventRecord(e1, st));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, double(ms) * 1e3 / launches);
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return best;  // us per launch
}

int main() {
  cudaStream_t st;
  CHECK(cudaStreamCreate(&st));
  std::vector<Mat> mats(kCopies);
  std::vector<uint8_t> h(kTiledBytes);
  for (size_t i = 0; i < h.size(); ++i) h[i] = uint8_t((i * 2654435761u) >> 13);
  for (auto& m : mats) {  // random bytes; scales and biases bf16 of small magnitude
    uint8_t *c, *tl;
    unsigned short *s, *b;
    CHECK(cudaMalloc(&c, kCodeBytes));
    CHECK(cudaMalloc(&s, kScaleElems * 2));
    CHECK(cudaMalloc(&b, kScaleElems * 2));
    CHECK(cudaMalloc(&tl, kTiledBytes));
    CHECK(cudaMemcpy(c, h.data(), kCodeBytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(s, 0x3c, kScaleElems * 2));
    CHECK(cudaMemset(b, 0x3c, kScaleElems * 2));
    CHECK(cudaMemcpy(tl, h.data(), kTiledBytes, cudaMemcpyHostToDevice));
    m = Mat{c, s, b, tl};
  }
  uint2* frag;
  float *gsum, *y;
  CHECK(cudaMalloc(&frag, size_t(kGroups) * 4 * 32 * sizeof(uint2)));
  CHECK(cudaMalloc(&gsum, size_t(kGroups) * 8 * sizeof(float)));
  CHECK(cudaMalloc(&y, kRows * sizeof(float)));
  CHECK(cudaMemset(frag, 0x3c, size_t(kGroups) * 4 * 32 * sizeof(uint2)));
  CHECK(cudaMemset(gsum, 0, size_t(kGroups) * 8 * sizeof(float)));
  const double bytes = double(kTiledBytes);  // the same 576 bytes per tile-group in both layouts
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int launches = 40;
  const double rd = time_graph(
      [&](int c, cudaStream_t s) { read_lab<<<sms * 8, 256, 0, s>>>(reinterpret_cast<const uint4*>(mats[c].tiled), kTiledBytes / 16, y); },
      launches, st);
  std::printf("layout-lab plain read of %.1f MB: %.2f us per launch, %.0f GB/s\n", bytes / 1e6, rd, bytes / rd / 1e3);
  for (int ks : {2, 4, 8}) {
    const unsigned grid = kTiles / (8 / ks);
    auto run = [&](auto kernel, const char* name) {
      const double us = time_graph([&](int c, cudaStream_t s) { kernel<<<grid, 256, 0, s>>>(mats[c], frag, gsum, ks, y); },
                                   launches, st);
      std::printf("layout-lab ks %d %-24s %7.2f us per launch, %5.0f GB/s\n", ks, name, us, bytes / us / 1e3);
    };
    run(gemv_lab<0, false>, "rows loads");
    run(gemv_lab<3, false>, "tiled loads");
    run(gemv_lab<0, true>, "rows mma");
    run(gemv_lab<1, true>, "codes-tiled mma");
    run(gemv_lab<2, true>, "scales-tiled mma");
    run(gemv_lab<3, true>, "tiled mma");
    run(gemv_lab<3, true, 1>, "tiled mma compact frags");
    run(gemv_lab<3, true, 2>, "tiled mma no frag loads");
    run(gemv_lab<3, true, 3>, "tiled mma lop3");
    run(gemv_lab<3, true, 4>, "tiled mma compact+lop3");
    const int per = (kGroups + ks - 1) / ks, smem = 8 * per * int(kTileGroupBytes);
    CHECK(cudaFuncSetAttribute(gemv_lab_bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const double us = time_graph(
        [&](int c, cudaStream_t s) { gemv_lab_bulk<<<grid, 256, smem, s>>>(mats[c], frag, gsum, ks, y); }, launches, st);
    std::printf("layout-lab ks %d %-24s %7.2f us per launch, %5.0f GB/s (%d KB shared per block)\n", ks, "tiled bulk mma", us,
                bytes / us / 1e3, smem / 1024);
  }
  CHECK(cudaGetLastError());
  return 0;
}
