// Kernel lab for the CUDA engine: the GEMVs of one layer of the released geometry (MLX affine 4-bit,
// group 64, bf16 scales; the router at 8 bits) and the routed-expert products, timed in isolation with
// CUDA events and reported as GB/s of weight bytes beside the measured copy bandwidth. Each shape
// rotates over copies of its matrix totalling >= 512 MB, so the 60 MB L2 never serves the weights.
// Linked into bench_cuda (bench/e2e/); validation of these kernels is tests/parity/test_cuda_ops.cpp.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/common.h"
#include "cuda/dmatrix.h"
#include "cuda/ops.h"

namespace ck::bench {

namespace {

using namespace ck::cuda;

struct DeviceMatrices {
  DeviceBuffer<uint8_t> buf;
  std::vector<DMatrix> copies;
};

// Random bytes in 16-row tiles (dmatrix.h WLayout::Tiles16): each 576-byte (tile, group) block's 512
// code bytes at random, its 16 scale words (bf16 scale low, bf16 bias high) valid numbers.
void fill_tiles(uint8_t* p, size_t bytes, std::mt19937_64& rng) {
  for (size_t i = 0; i + 8 <= bytes; i += 8) { uint64_t v = rng(); std::memcpy(p + i, &v, 8); }
  for (size_t b = 0; b + kTileGroupBytes <= bytes; b += kTileGroupBytes)
    for (int w = 0; w < 16; ++w) {
      const uint32_t v = (0x3c00u + (rng() & 0xff)) | ((0xbd00u + (rng() & 0xff)) << 16);
      std::memcpy(p + b + 512 + 4 * w, &v, 4);
    }
}

// Random codes, valid bf16 scales and biases, `copies` times; `tiles`: in 16-row tiles (the engine's
// layout for its 4-bit matrices, Model's weight_tiles_on), else the row layout.
DeviceMatrices make_copies(int rows, int cols, int bits, int group, size_t min_total, std::mt19937_64& rng,
                           bool tiles = false) {
  DMatrix proto;
  proto.rows = rows;
  proto.cols = cols;
  proto.fmt.kind = static_cast<uint8_t>(WKind::Q);
  proto.fmt.bits = static_cast<uint8_t>(bits);
  proto.fmt.group = static_cast<uint16_t>(group);
  proto.fmt.scale_kind = static_cast<uint8_t>(WKind::BF16);
  if (tiles) {
    proto.fmt.layout = static_cast<uint8_t>(WLayout::Tiles16);
    const size_t one = align256(proto.stored_bytes());
    const size_t n = std::clamp<size_t>((min_total + one - 1) / one, 1, 256);
    DeviceMatrices d;
    d.buf.resize(n * one);
    std::vector<uint8_t> bytes(proto.stored_bytes());
    fill_tiles(bytes.data(), bytes.size(), rng);
    for (size_t c = 0; c < n; ++c) {
      CUDA_CHECK(cudaMemcpy(d.buf.get() + c * one, bytes.data(), bytes.size(), cudaMemcpyHostToDevice));
      DMatrix m = proto;
      m.data = d.buf.get() + c * one;
      d.copies.push_back(m);
    }
    return d;
  }
  const size_t db = align256(proto.data_bytes()), sb = align256(proto.scale_bytes()), one = db + 2 * sb;
  const size_t n = std::clamp<size_t>((min_total + one - 1) / one, 1, 256);
  DeviceMatrices d;
  d.buf.resize(n * one);
  std::vector<uint8_t> codes(proto.data_bytes());
  for (size_t i = 0; i + 8 <= codes.size(); i += 8) { uint64_t v = rng(); std::memcpy(&codes[i], &v, 8); }
  std::vector<uint16_t> scales(proto.scale_bytes() / 2), biases(scales.size());
  for (size_t i = 0; i < scales.size(); ++i) { scales[i] = 0x3c00 + (rng() & 0xff); biases[i] = 0xbd00 + (rng() & 0xff); }
  for (size_t c = 0; c < n; ++c) {
    uint8_t* base = d.buf.get() + c * one;
    CUDA_CHECK(cudaMemcpy(base, codes.data(), codes.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(base + db, scales.data(), proto.scale_bytes(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(base + db + sb, biases.data(), proto.scale_bytes(), cudaMemcpyHostToDevice));
    DMatrix m = proto;
    m.data = base;
    m.scales = base + db;
    m.biases = base + db + sb;
    d.copies.push_back(m);
  }
  return d;
}

// Milliseconds per call of f(i), median over batches of launches (f launches on `stream`).
template <class F>
double time_ms(int iters, F&& f, cudaStream_t stream = nullptr) {
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) f(i);
  std::vector<double> t;
  for (int b = 0; b < 5; ++b) {
    CUDA_CHECK(cudaEventRecord(e0, stream));
    for (int i = 0; i < iters; ++i) f(b * iters + i);
    CUDA_CHECK(cudaEventRecord(e1, stream));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms / iters);
  }
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

void run_kernel_benchmarks(double copy_gbs, FILE* out) {
  auto emit = [&](const std::string& s) {
    std::fputs(s.c_str(), stdout);
    std::fflush(stdout);
    if (out) { std::fputs(s.c_str(), out); std::fflush(out); }
  };
  std::mt19937_64 rng(5);
  struct Shape { const char* name; int rows, cols, bits; };
  const Shape shapes[] = {
      {"gdn in_proj_qkv", 10240, 2560, 4}, {"attn q_proj", 12288, 2560, 4}, {"gdn in_proj_z", 6144, 2560, 4},
      {"gdn out_proj", 2560, 6144, 4},     {"hc down", 320, 10240, 4},      {"hc up", 10240, 320, 4},
      {"router (8-bit)", 512, 2560, 8},    {"lm_head", 248320, 2560, 4},
  };
  DeviceBuffer<float> x(static_cast<size_t>(kMaxRows) * 10240), y(static_cast<size_t>(kMaxRows) * 248320);
  {
    std::vector<float> h(x.size());
    std::normal_distribution<float> nd;
    for (float& v : h) v = nd(rng);
    CUDA_CHECK(cudaMemcpy(x.get(), h.data(), h.size() * 4, cudaMemcpyHostToDevice));
  }
  char line[512];
  // x's fragments for the "graph" lines (the largest K and R: 160 groups at 8 rows).
  DeviceBuffer<uint2> frag_buf(static_cast<size_t>(160) * tc4_rows_frag_words(kMaxRows));
  DeviceBuffer<float> gsum_buf(static_cast<size_t>(160) * tc4_rows_gsum_floats(kMaxRows));
  cudaStream_t gs;
  CUDA_CHECK(cudaStreamCreateWithFlags(&gs, cudaStreamNonBlocking));
  constexpr int kGraphCalls = 20;
  // The graphs' kernel scratch (split-K partials) from a stack, as a step's: no memory nodes.
  DeviceBuffer<uint8_t> scratch_buf(kStepScratchBytes);
  StepScratch step_scratch;
  step_scratch.base = scratch_buf.get();
  step_scratch.size = kStepScratchBytes;
  // Each shape in the row layout and, for the 4-bit ones, in 16-row tiles: the engine's layout for
  // them (the row-layout lines are what CK_WEIGHT_TILES=0 runs, and the 8-bit router's only layout).
  // The "rows" and "tiles" lines time each call alone, with x's fragment kernel where the GEMV needs
  // one. The "graph" lines time the tiled GEMVs as a decode step runs them: x's fragments made
  // beforehand (the step's producers write them; the in-warp one-row kernel makes its own anyway) and
  // kGraphCalls calls on rotating copies captured in one graph, so each call's blocks start early
  // (programmatic dependent launch) and ask L2 for their weights while the call before runs.
  for (const Shape& s : shapes) {
    for (int form = 0; form < 3; ++form) {
      const bool tiles = form > 0, graph = form == 2;
      if (tiles && s.bits != 4) continue;
      if (graph && s.cols / 64 > 160) continue;
      DeviceMatrices dm = make_copies(s.rows, s.cols, s.bits, 64, size_t{512} << 20, rng, tiles);
      const double bytes = static_cast<double>(dm.copies[0].stored_bytes());
      for (int rows : {1, 4, 8}) {
        double ms = 0.0;
        if (!graph) {
          ms = time_ms(20, [&](int i) {
            matvec(dm.copies[i % dm.copies.size()], x.get(), s.cols, y.get(), s.rows, rows, nullptr);
          });
        } else {
          Tc4Frags pre;
          tc4_make_frags(x.get(), s.cols, rows, s.cols / 64, frag_buf.get(), gsum_buf.get(), &pre, gs);
          cudaGraph_t g;
          cudaGraphExec_t exec;
          CUDA_CHECK(cudaStreamBeginCapture(gs, cudaStreamCaptureModeThreadLocal));
          ScratchScope scope(&step_scratch);
          for (int i = 0; i < kGraphCalls; ++i) {
            GemvJob job;
            job.w = dm.copies[i % dm.copies.size()];
            job.y = y.get();
            job.ldy = s.rows;
            gemv(&job, 1, x.get(), s.cols, rows, gs, &pre);
          }
          CUDA_CHECK(cudaStreamEndCapture(gs, &g));
          CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
          ms = time_ms(5, [&](int) { CUDA_CHECK(cudaGraphLaunch(exec, gs)); }, gs) / kGraphCalls;
          CUDA_CHECK(cudaGraphExecDestroy(exec));
          CUDA_CHECK(cudaGraphDestroy(g));
        }
        std::snprintf(line, sizeof(line),
                      "kernel   gemv %-16s %6dx%-6d q%d %-5s rows %d  %8.1f us  %7.1f GB/s  (%3.0f%% of copy bw)\n", s.name,
                      s.rows, s.cols, s.bits, graph ? "graph" : tiles ? "tiles" : "rows", rows, ms * 1e3,
                      bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs);
        emit(line);
      }
    }
  }
  CUDA_CHECK(cudaStreamSynchronize(gs));
  CUDA_CHECK(cudaStreamDestroy(gs));
  // Routed + shared experts of one MoE block: 11 (row, expert) pairs per row over a pool of 96 records.
  const int I = 640, H = 2560, k = 10, n_rec = 96;
  WFormat f;
  f.kind = static_cast<uint8_t>(WKind::Q);
  f.bits = 4;
  f.group = 64;
  f.scale_kind = static_cast<uint8_t>(WKind::BF16);
  const ExpertLayout lay = expert_layout(f, I, H);
  DeviceBuffer<uint8_t> pool(lay.bytes * n_rec);
  {
    std::vector<uint8_t> rec(lay.bytes);
    for (size_t i = 0; i + 8 <= rec.size(); i += 8) { uint64_t v = rng(); std::memcpy(&rec[i], &v, 8); }
    for (uint64_t off : {lay.gate_s, lay.up_s, lay.down_s, lay.gate_b, lay.up_b, lay.down_b}) {
      const bool bias = off == lay.gate_b || off == lay.up_b || off == lay.down_b;
      const size_t n = (off == lay.down_s || off == lay.down_b) ? static_cast<size_t>(H) * (I / 64) : static_cast<size_t>(I) * (H / 64);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t v = static_cast<uint16_t>((bias ? 0xbd00 : 0x3c00) + (rng() & 0xff));
        std::memcpy(&rec[off + 2 * i], &v, 2);
      }
    }
    for (int r = 0; r < n_rec; ++r) CUDA_CHECK(cudaMemcpy(pool.get() + r * lay.bytes, rec.data(), rec.size(), cudaMemcpyHostToDevice));
  }
  // Each row count's pairs over the pool (8 sets of random records), gate/up then down by `run`.
  auto time_experts = [&](const uint8_t* base, WFormat fm, uint64_t rec_stride, const char* label, const char* note,
                          auto run) {
    DMatrix g0, u0, d0;
    expert_views(base, fm, I, H, &g0, &u0, &d0);
    const double rec_bytes = static_cast<double>(2 * g0.stored_bytes() + d0.stored_bytes());
    for (int rows : {1, 4, 8}) {
      const int n_pairs = rows * (k + 1), n_sets = 8;
      std::vector<ExpertPair> hp(static_cast<size_t>(n_pairs) * n_sets);
      for (int sidx = 0; sidx < n_sets; ++sidx)
        for (int p = 0; p < n_pairs; ++p) {
          ExpertPair& e = hp[sidx * n_pairs + p];
          expert_views(base + (rng() % n_rec) * rec_stride, fm, I, H, &e.gate, &e.up, &e.down);
          e.x_row = p / (k + 1);
          e.weight = 0.1f;
        }
      DeviceBuffer<ExpertPair> dp(hp.size());
      CUDA_CHECK(cudaMemcpy(dp.get(), hp.data(), hp.size() * sizeof(ExpertPair), cudaMemcpyHostToDevice));
      DeviceBuffer<float> h(static_cast<size_t>(n_pairs) * I), yo(static_cast<size_t>(n_pairs) * H);
      const double ms = time_ms(20, [&](int i) {
        run(dp.get() + (i % n_sets) * n_pairs, n_pairs, rows, h.get(), yo.get());
      });
      const double bytes = n_pairs * rec_bytes;
      std::snprintf(line, sizeof(line), "kernel   experts %-8s %2d pairs (rows %d, top-%d + shared)  %8.1f us  %7.1f GB/s  (%3.0f%% of copy bw; "
                    "per-pair reads, %s)\n",
                    label, n_pairs, rows, k, ms * 1e3, bytes / (ms * 1e-3) / 1e9, 100.0 * bytes / (ms * 1e-3) / 1e9 / copy_gbs,
                    note);
      emit(line);
    }
  };
  time_experts(pool.get(), f, lay.bytes, "rows v3", "no sharing between rows",
               [&](const ExpertPair* ps, int n_pairs, int, float* h, float* yo) {
                 expert_gate_up(ps, n_pairs, I, H, x.get(), H, h, I, true, nullptr);
                 expert_down(ps, n_pairs, I, H, h, I, yo, H, true, nullptr);
               });
  // The same pairs over records in 16-row tiles through the tensor-core kernels the engine's decode
  // steps run (expert_*_tc4 with all_tiled: the streaming kernels unless CK_EXPERT_STREAM=0 /
  // CK_EXPERT_DOWN_STREAM=0), x's fragments made by their own kernel (the engine's come from the mix).
  WFormat ft = f;
  ft.layout = static_cast<uint8_t>(WLayout::Tiles16);
  const ExpertLayout tlay = expert_layout(ft, I, H);
  DeviceBuffer<uint8_t> tpool(tlay.bytes * n_rec);
  {
    std::vector<uint8_t> rec(tlay.bytes, 0);
    DMatrix tg, tu, td;
    expert_views(nullptr, ft, I, H, &tg, &tu, &td);
    fill_tiles(rec.data() + tlay.gate, tg.stored_bytes(), rng);
    fill_tiles(rec.data() + tlay.up, tu.stored_bytes(), rng);
    fill_tiles(rec.data() + tlay.down, td.stored_bytes(), rng);
    for (int r = 0; r < n_rec; ++r)
      CUDA_CHECK(cudaMemcpy(tpool.get() + r * tlay.bytes, rec.data(), rec.size(), cudaMemcpyHostToDevice));
  }
  time_experts(tpool.get(), ft, tlay.bytes, "tiles tc", "with x's fragment kernel",
               [&](const ExpertPair* ps, int n_pairs, int rows, float* h, float* yo) {
                 expert_gate_up_tc4(ps, n_pairs, I, H, x.get(), H, rows, h, I, nullptr, nullptr, true);
                 expert_down_tc4(ps, n_pairs, I, H, h, I, yo, H, nullptr, true);
               });
}

}  // namespace ck::bench
