// bench_cuda: end-to-end tok/s of the CUDA engine, each figure beside its ceiling measured in the same
// run (docs/performance.md "CUDA engine"):
//   ceilings  device-to-device copy bandwidth (cudaMemcpy of 2 GiB, read + write bytes), host-to-device
//             over pinned memory, and the bf16 matrix rate through cuBLAS (dlopen'ed; "not measured"
//             when no libcublas is found);
//   decode    1 row and 4 rows per step (tok/s) vs weight bytes per step / copy bandwidth;
//   prefill   512, 2048, 8192 tokens (chunks of --prefill-chunk rows, by default the model's
//             default_chunk_rows, on the tensor cores) vs FLOPs / bf16 rate; every session, decode's
//             too, has that many rows of buffers;
//   kernels   single-layer-geometry GEMVs and the expert products in isolation (bench/kernels/).
// Model: --model DIR (any checkpoint) or --synth-layers N (the released geometry, random MLX-style
// 4-bit weights built in memory: no disk). Not a CMake target: scripts/prepare_devcarry.sh builds it.
#include <dlfcn.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/common.h"
#include "cuda/layers.h"
#include "cuda/qwen4_exp.h"
#include "cuda/random_model.h"
#include "util/log.h"

namespace ck::bench {
// bench/kernels/kernels.cpp
void run_kernel_benchmarks(double copy_gbs, FILE* out);
}

namespace {

using namespace ck;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void emit(FILE* out, const char* fmt_str, ...) __attribute__((format(printf, 2, 3)));
void emit(FILE* out, const char* fmt_str, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt_str);
  std::vsnprintf(buf, sizeof(buf), fmt_str, ap);
  va_end(ap);
  std::fputs(buf, stdout);
  std::fflush(stdout);
  if (out) { std::fputs(buf, out); std::fflush(out); }
}

// CK_HC_TIMING=1: where the blocks of the step's last one-row mix (the final mixer) spent their time
// (the session's stamps, HcMixArgs::stamps): each block's start against the first block's
// (globaltimer), and its SM cycles in each piece (cuda::kHcStampNames), as min / median / p90 / max
// over the blocks that ran it (the grid may be smaller than the stamps' one block per SM, and blocks
// without work after phase 1 leave at the barrier: their later pieces read 0).
void report_hc_mix_timing(cuda::Session& s, FILE* out) {
  const std::vector<uint64_t> st = s.hc_mix_stamps();
  constexpr int W = cuda::kHcStampWords;
  if (st.empty()) return;
  const size_t n = st.size() / W;
  uint64_t first = UINT64_MAX;
  for (size_t b = 0; b < n; ++b)
    if (st[W * b] != 0) first = std::min(first, st[W * b]);
  for (int k = 0; k < W; ++k) {
    std::vector<double> v;
    for (size_t b = 0; b < n; ++b)
      if (st[W * b] != 0 && (k == 0 || st[W * b + k] != 0))
        v.push_back(static_cast<double>(k == 0 ? st[W * b] - first : st[W * b + k]));
    if (v.empty()) continue;
    std::sort(v.begin(), v.end());
    emit(out, "hc_mix   %-28s min %9.0f  median %9.0f  p90 %9.0f  max %9.0f  (%zu blocks)\n", cuda::kHcStampNames[k],
         v.front(), v[v.size() / 2], v[v.size() * 9 / 10], v.back(), v.size());
  }
  // CK_HC_TIMING_BLOCKS=1 too: every block's line (its start in ns after the first block's, then its
  // pieces in SM cycles, kHcStampNames' order), to see which blocks end phase 1 last.
  if (!cuda::env_is("CK_HC_TIMING_BLOCKS", "1")) return;
  for (size_t b = 0; b < n; ++b) {
    if (st[W * b] == 0) continue;
    emit(out, "hc_mix_block %3zu  start %6llu", b, static_cast<unsigned long long>(st[W * b] - first));
    for (int k = 1; k < W; ++k) emit(out, " %6llu", static_cast<unsigned long long>(st[W * b + k]));
    emit(out, "\n");
  }
}

// CK_EXPERT_TIMING=1: when the blocks of the step's last decode expert kernels (streaming gate/up and
// down, or fused: cuda::expert_stamps) entered, ended their programmatic-launch wait and left, in us
// after the first expert block's entry, as first / median / last over the blocks; with CK_HC_TIMING=1
// also when the next kernel, the final mixer, started its blocks on the same clock.
void report_expert_timing(cuda::Session& s, FILE* out) {
  if (!cuda::expert_timing_on()) return;
  const std::vector<uint64_t> st = cuda::expert_stamps();
  constexpr int B = cuda::kExpertStampBlocks, W = cuda::kExpertStampWords;
  auto at = [&](int k, int b, int w) { return st[(static_cast<size_t>(k) * B + b) * W + w]; };
  // The kernels of the last step: those whose latest entry is within 1 ms of the latest of all (a
  // kernel the step did not launch keeps an older run's stamps).
  uint64_t latest[cuda::kExpertStampKernels] = {}, t0 = UINT64_MAX;
  for (int k = 0; k < cuda::kExpertStampKernels; ++k)
    for (int b = 0; b < B; ++b) latest[k] = std::max(latest[k], at(k, b, 0));
  const uint64_t last = *std::max_element(latest, latest + cuda::kExpertStampKernels);
  auto in_step = [&](int k) { return latest[k] != 0 && latest[k] + 1000000 >= last; };
  for (int k = 0; k < cuda::kExpertStampKernels; ++k)
    for (int b = 0; b < B; ++b)
      if (in_step(k) && at(k, b, 0) != 0) t0 = std::min(t0, at(k, b, 0));
  if (t0 == UINT64_MAX) return;
  static const char* kernels[] = {"gate/up", "down", "fused"};
  static const char* points[] = {"entry", "wait ended", "exit"};
  auto row = [&](const char* kernel, const char* point, std::vector<double> v) {
    if (v.empty()) return;
    std::sort(v.begin(), v.end());
    emit(out, "experts  %-8s %-11s first %8.2f  median %8.2f  p90 %8.2f  last %8.2f us  (%zu blocks)\n", kernel, point,
         v.front(), v[v.size() / 2], v[v.size() * 9 / 10], v.back(), v.size());
  };
  for (int k = 0; k < cuda::kExpertStampKernels; ++k)
    for (int w = 0; w < 3 && in_step(k); ++w) {
      std::vector<double> v;
      for (int b = 0; b < B; ++b)
        if (at(k, b, 0) >= t0 && at(k, b, w) >= t0) v.push_back((at(k, b, w) - t0) * 1e-3);
      row(kernels[k], points[w], v);
    }
  const std::vector<uint64_t> hc = s.hc_mix_stamps();  // entries first, then SM cycles (cuda::kHcStampWords)
  std::vector<double> v;
  for (size_t b = 0; b < hc.size() / cuda::kHcStampWords; ++b)
    if (hc[b * cuda::kHcStampWords] >= t0) v.push_back((hc[b * cuda::kHcStampWords] - t0) * 1e-3);
  row("mix", "entry", v);
}

// GB/s of a device-to-device cudaMemcpy of `bytes`, counting bytes read plus bytes written.
double measure_d2d(size_t bytes) {
  cuda::DeviceBuffer<uint8_t> a(bytes), b(bytes);
  std::vector<uint8_t> h(size_t{64} << 20);
  std::mt19937_64 rng(1);
  for (size_t i = 0; i < h.size(); i += 8) { uint64_t v = rng(); std::memcpy(&h[i], &v, 8); }
  for (size_t o = 0; o < bytes; o += h.size())
    CUDA_CHECK(cudaMemcpy(a.get() + o, h.data(), std::min(h.size(), bytes - o), cudaMemcpyHostToDevice));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> t;
  for (int i = 0; i < 12; ++i) {
    CUDA_CHECK(cudaEventRecord(e0));
    CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice));
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 2) t.push_back(ms);
  }
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  return 2.0 * bytes / (median(t) * 1e-3) / 1e9;
}

double measure_h2d(size_t bytes) {
  cuda::PinnedBuffer<uint8_t> h(bytes);
  std::memset(h.get(), 1, bytes);
  cuda::DeviceBuffer<uint8_t> d(bytes);
  std::vector<double> t;
  for (int i = 0; i < 6; ++i) {
    auto t0 = Clock::now();
    CUDA_CHECK(cudaMemcpy(d.get(), h.get(), bytes, cudaMemcpyHostToDevice));
    if (i >= 1) t.push_back(seconds_since(t0));
  }
  return bytes / median(t) / 1e9;
}

// bf16 GEMM rate through cuBLAS, loaded at run time (no link dependency). 0 when unavailable.
double measure_bf16_tflops(std::string* how) {
  const char* env = std::getenv("CK_CUBLAS");
  void* lib = nullptr;
  for (const char* name : {env ? env : "", "libcublas.so.13", "libcublas.so.12", "libcublas.so"})
    if (*name && (lib = dlopen(name, RTLD_NOW | RTLD_LOCAL))) { *how = name; break; }
  if (!lib) { *how = "no libcublas found (set CK_CUBLAS)"; return 0; }
  using CreateFn = int (*)(void**);
  using DestroyFn = int (*)(void*);
  using GemmExFn = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                           const void*, void*, int, int, int, int);
  auto create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
  auto destroy = reinterpret_cast<DestroyFn>(dlsym(lib, "cublasDestroy_v2"));
  auto gemm = reinterpret_cast<GemmExFn>(dlsym(lib, "cublasGemmEx"));
  if (!create || !destroy || !gemm) { *how += ": symbols missing"; return 0; }
  void* handle = nullptr;
  if (create(&handle) != 0) { *how += ": cublasCreate failed"; return 0; }
  const int n = 8192;
  std::vector<uint16_t> h(static_cast<size_t>(n) * n);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> ud(-1, 1);
  for (auto& v : h) { float f = ud(rng); uint32_t u; std::memcpy(&u, &f, 4); v = static_cast<uint16_t>(u >> 16); }
  cuda::DeviceBuffer<uint16_t> A(h.size()), B(h.size()), C(h.size());
  CUDA_CHECK(cudaMemcpy(A.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(B.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  const float alpha = 1.0f, beta = 0.0f;
  constexpr int kOpN = 0, kBF16 = 14, kCompute32F = 68, kAlgoDefault = -1;
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> t;
  int rc = 0;
  for (int i = 0; i < 13 && rc == 0; ++i) {
    CUDA_CHECK(cudaEventRecord(e0));
    rc = gemm(handle, kOpN, kOpN, n, n, n, &alpha, A.get(), kBF16, n, B.get(), kBF16, n, &beta, C.get(), kBF16, n,
              kCompute32F, kAlgoDefault);
    CUDA_CHECK(cudaEventRecord(e1));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (i >= 3) t.push_back(ms);
  }
  destroy(handle);
  if (rc != 0) { *how += ": cublasGemmEx failed"; return 0; }
  return 2.0 * n * n * static_cast<double>(n) / (median(t) * 1e-3) / 1e12;
}

struct Args {
  std::string model_dir, out_path;
  int synth_layers = 16;
  std::vector<int> prefill = {512, 2048, 8192};
  int decode_steps = 48;
  std::vector<int> decode_rows = {1, 4};
  int decode_context = 64;  // prompt tokens before the timed decode steps
  bool kernels = true;
  bool mtp = false;  // the synthetic model gets an MTP head; its draft step is timed
  int prefill_chunk = 0;  // rows of one prefill chunk (the sessions' buffers); 0: the model's default
};

// A whole decimal int, or -1 (every numeric flag here wants a positive value, so callers reject it).
int parse_int(const std::string& v) {
  int x = 0;
  const auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  return ec == std::errc() && p == v.data() + v.size() ? x : -1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (s == "--model") a.model_dir = next();
    else if (s == "--synth-layers") a.synth_layers = parse_int(next());
    else if (s == "--out") a.out_path = next();
    else if (s == "--decode-steps") a.decode_steps = parse_int(next());
    else if (s == "--no-kernels") a.kernels = false;
    else if (s == "--mtp") a.mtp = true;
    else if (s == "--no-prefill") a.prefill.clear();  // decode only (an empty --prefill, as one word)
    else if (s == "--decode-rows") a.decode_rows = {parse_int(next())};
    else if (s == "--decode-context") a.decode_context = parse_int(next());
    else if (s == "--prefill-chunk") a.prefill_chunk = parse_int(next());
    else if (s == "--prefill") {
      a.prefill.clear();
      std::string v = next();
      for (size_t p = 0; p < v.size();) {
        size_t e = v.find(',', p);
        if (e == std::string::npos) e = v.size();
        const std::string tok = v.substr(p, e - p);
        const int T = parse_int(tok);
        if (T <= 2 * cuda::kMaxRows) {  // the first 2 kMaxRows tokens warm the session's graphs
          std::fprintf(stderr, "bench_cuda: --prefill %s: each size must be a number above %d\n", tok.c_str(),
                       2 * cuda::kMaxRows);
          return 2;
        }
        a.prefill.push_back(T);
        p = e + 1;
      }
    } else {
      std::fprintf(stderr, "usage: bench_cuda [--model DIR | --synth-layers N] [--prefill 512,2048,8192 | --no-prefill] "
                           "[--prefill-chunk N] [--decode-steps N] [--decode-rows R] [--decode-context T] "
                           "[--no-kernels] [--mtp] [--out FILE]\n");
      return 2;
    }
  }
  if (a.synth_layers < 1 || a.decode_steps < 0 || a.decode_rows[0] < 1 || a.decode_rows[0] > cuda::kMaxRows ||
      a.decode_context < 1 || (a.prefill_chunk != 0 && (a.prefill_chunk <= cuda::kMaxRows || a.prefill_chunk > cuda::kMaxChunkRows))) {
    std::fprintf(stderr, "bench_cuda: --synth-layers wants a number >= 1, --decode-steps >= 0, --decode-rows 1-%d, "
                         "--decode-context >= 1, --prefill-chunk 0 or %d-%d\n",
                 cuda::kMaxRows, cuda::kMaxRows + 1, cuda::kMaxChunkRows);
    return 2;
  }
  if (cuda::device_count() == 0) {
    std::fprintf(stderr, "bench_cuda: no CUDA device\n");
    return 1;
  }
  FILE* out = a.out_path.empty() ? nullptr : std::fopen(a.out_path.c_str(), "w");
  emit(out, "# bench_cuda: %s\n", cuda::device_banner().c_str());

  // ---- ceilings
  const double copy_gbs = measure_d2d(size_t{2} << 30);
  const double h2d_gbs = measure_h2d(size_t{1} << 30);
  std::string how;
  const double tflops = measure_bf16_tflops(&how);
  emit(out, "ceiling  d2d copy            %8.1f GB/s  (cudaMemcpy 2 GiB, read+write bytes, median of 10)\n", copy_gbs);
  emit(out, "ceiling  h2d pinned          %8.1f GB/s  (1 GiB, median of 5)\n", h2d_gbs);
  if (tflops > 0) emit(out, "ceiling  bf16 matmul         %8.1f TFLOP/s (cuBLAS GemmEx 8192^3, random data; %s)\n", tflops, how.c_str());
  else emit(out, "ceiling  bf16 matmul         not measured (%s)\n", how.c_str());

  if (a.kernels) ck::bench::run_kernel_benchmarks(copy_gbs, out);

  // ---- the model
  std::unique_ptr<Checkpoint> ckpt;
  std::unique_ptr<cuda::RandomModel> rm;
  const ModelWeights* w = nullptr;
  std::shared_ptr<ExpertSource> experts;
  auto t0 = Clock::now();
  if (!a.model_dir.empty()) {
    auto c = open_checkpoint(a.model_dir, false);
    if (!c.ok()) { std::fprintf(stderr, "error: %s\n", c.status().message().c_str()); return 1; }
    ckpt = std::move(c).value();
    w = &ckpt->weights;
    experts = ckpt->experts;
  } else {
    cuda::RandomModelOptions o;  // the real MLX checkpoint's forms: Q4 g64, routers Q8, n-gram Q4 g32
    o.dense = cuda::WeightForm{DType::U32, 4, 64, DType::BF16};
    o.router = cuda::WeightForm{DType::U32, 8, 64, DType::BF16};
    o.experts = cuda::WeightForm{DType::U32, 4, 64, DType::BF16};
    o.ngram = cuda::WeightForm{DType::U32, 4, 32, DType::BF16};
    o.mtp = a.mtp;
    rm = cuda::make_random_model(cuda::released_config(a.synth_layers), o);
    w = &rm->weights;
    experts = rm->experts;
  }
  const double t_build = seconds_since(t0);
  t0 = Clock::now();
  auto mr = cuda::Model::create(*w, experts);
  if (!mr.ok()) { std::fprintf(stderr, "error: %s\n", mr.status().message().c_str()); return 1; }
  std::unique_ptr<cuda::Model> m = std::move(mr).value();
  const double t_upload = seconds_since(t0);
  const ModelConfig& c = m->cfg();
  emit(out, "model    %s: %d layers, H %d, %d experts top-%d, dense %.2f GB + experts %.2f GB on device "
            "(built %.1f s, uploaded %.1f s)\n",
       a.model_dir.empty() ? "synthetic released geometry (Q4 g64)" : a.model_dir.c_str(), c.num_hidden_layers,
       c.hidden_size, c.num_experts, c.num_experts_per_tok, m->dense_bytes() / 1e9,
       m->experts().slots.bytes() / 1e9, t_build, t_upload);

  const double bytes_tok = m->active_bytes_per_token();
  const double expert_rec = static_cast<double>(m->experts().record_bytes);
  const double dense_tok = bytes_tok - c.num_hidden_layers * c.num_experts_per_tok * expert_rec;
  const double flops_tok = 2.0 * m->macs_per_token();
  emit(out, "model    weight bytes per decode token %.3f GB (dense %.3f + %d x %d experts x %.2f MB); %.2f GFLOP per token\n",
       bytes_tok / 1e9, dense_tok / 1e9, c.num_hidden_layers, c.num_experts_per_tok, expert_rec / 1e6, flops_tok / 1e9);

  std::mt19937 rng(11);
  auto rand_tokens = [&](int n) {
    std::vector<int32_t> t(n);
    for (auto& v : t) v = static_cast<int32_t>(rng() % c.vocab_size);
    return t;
  };
  cuda::StepResult res;
  // After each timed run, one untimed step with its logits: they must all be finite. Why: a kernel that
  // writes NaN still runs, and faster: NaN router logits route every token to the same lowest-index
  // experts (the kernels' rule), whose tiles are then full. A 16-token experts kernel with a wrong
  // staging offset measured +20% at 512 tokens that way (2026-12-04) before its tests caught it.
  auto outputs_finite = [&](cuda::Session& s, const char* what) {
    cuda::StepResult r;
    const int32_t tok[1] = {static_cast<int32_t>(rng() % c.vocab_size)};
    if (!s.step_rows(tok, false, true, &r).ok()) return false;
    for (float v : r.logits)
      if (!std::isfinite(v)) {
        std::fprintf(stderr, "bench_cuda: %s left the model producing non-finite logits: its figure is not valid\n", what);
        return false;
      }
    return true;
  };
  // Every session's chunk rows (its per-row buffers), decode's too: a session serves both.
  const int chunk = m->chunk_rows_for(a.prefill_chunk);
  emit(out, "session  chunks of %d rows (every session's per-row buffers: %.2f GB)%s\n", chunk,
       m->session_bytes(4096, chunk) / 1e9, a.prefill_chunk > 0 ? " (--prefill-chunk)" : " (the model's default)");

  // ---- decode, 1 and 4 rows per step, after a prompt of decode_context tokens (--decode-steps 0: none)
  if (a.decode_steps == 0) emit(out, "decode   not timed (--decode-steps 0)\n");
  for (int rows : a.decode_steps > 0 ? a.decode_rows : std::vector<int>{}) {
    const int ctx = a.decode_context;
    auto s = m->new_session(std::max(4096, ctx + (a.decode_steps + 3) * rows + 16), chunk);
    std::vector<int32_t> prompt = rand_tokens(ctx);
    if (!s->step_rows(prompt, false, false, &res, cuda::RowOutputs::kLast).ok()) return 1;
    s->commit(ctx);
    std::vector<double> t;
    int32_t next = res.argmax.back();
    for (int i = 0; i < a.decode_steps + 3; ++i) {
      std::vector<int32_t> toks(rows);
      toks[0] = next;
      for (int r = 1; r < rows; ++r) toks[r] = static_cast<int32_t>(rng() % c.vocab_size);  // drafts
      auto ts = Clock::now();
      // Steps of several rows snapshot their recurrent state after each row, as a speculative step must
      // (CK_BENCH_SNAP=0: not, to measure what the snapshots cost; every row is committed either way).
      if (!s->step_rows(toks, rows > 1 && !cuda::env_is("CK_BENCH_SNAP", "0"), false, &res).ok()) return 1;
      s->commit(rows);
      if (i >= 3) t.push_back(seconds_since(ts));  // the first steps capture the graph
      next = res.argmax.back();
    }
    const double step_s = median(t);
    if (rows == 1) report_hc_mix_timing(*s, out);
    report_expert_timing(*s, out);
    if (!outputs_finite(*s, rows == 1 ? "decode at 1 row" : "decode at several rows")) return 1;
    // Ceiling: the weights one step must read once. With r rows the experts are the union of the rows'
    // choices: E (1 - (1 - k/E)^r) per layer when routing is random (this model's is).
    const double k = c.num_experts_per_tok, E = c.num_experts;
    const double uniq = E * (1.0 - std::pow(1.0 - k / E, rows));
    const double step_bytes = dense_tok + c.num_hidden_layers * uniq * expert_rec;
    const double ceil_tps = rows / (step_bytes / (copy_gbs * 1e9));
    const std::string at = ctx == 64 ? "" : " at context " + std::to_string(ctx);
    emit(out, "decode   %d row%s/step   %8.1f tok/s  (%.3f ms/step, median of %zu)   ceiling %8.1f tok/s "
              "(%.3f GB/step / %.0f GB/s)   %.0f%% of ceiling%s\n",
         rows, rows > 1 ? "s" : " ", rows / step_s, step_s * 1e3, t.size(), ceil_tps, step_bytes / 1e9, copy_gbs,
         100.0 * (rows / step_s) / ceil_tps, at.c_str());
    // CK_GRAPH_KERNELS=1: the step graph's kernels by name and count (cuda::describe), not the totals only.
    if (const cuda::GraphShape* g = s->step_graph_shape(rows, false))
      emit(out, "graph    %d row%s/step   %s\n", rows, rows > 1 ? "s" : " ",
           (std::getenv("CK_GRAPH_KERNELS") ? cuda::describe(*g) : cuda::summary(*g)).c_str());
  }

  // ---- MTP draft step (one graph a step; then with every kernel launched directly, to compare), after a
  // 64-token prompt
  for (const bool graphs : {true, false}) {
    if (!m->has_mtp() || a.decode_steps == 0) break;
    auto s = m->new_session(4096, chunk);
    s->set_use_graphs(graphs);
    std::vector<int32_t> prompt = rand_tokens(64);
    if (!s->step_rows(prompt, false, false, &res).ok()) return 1;
    s->commit(64);
    std::vector<float> h(static_cast<size_t>(c.wide())), h_out(h.size()), logits(static_cast<size_t>(c.vocab_size));
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& v : h) v = nd(rng);
    std::vector<double> t;
    for (int i = 0; i < a.decode_steps + 3; ++i) {
      auto ts = Clock::now();
      if (!s->mtp_step(h.data(), static_cast<int32_t>(rng() % c.vocab_size), i, logits.data(), h_out.data()).ok())
        return 1;
      if (i >= 3) t.push_back(seconds_since(ts));  // the first step captures the graph
      h.swap(h_out);
    }
    const double step_s = median(t), bytes = m->mtp_bytes_per_step();
    emit(out, "mtp      draft step%s %8.3f ms  (median of %zu; logits copied to the host)   ceiling %.3f ms "
              "(%.3f GB / %.0f GB/s)   %.0f%% of ceiling\n",
         graphs ? "        " : ", direct", step_s * 1e3, t.size(), bytes / (copy_gbs * 1e9) * 1e3, bytes / 1e9, copy_gbs,
         100.0 * (bytes / (copy_gbs * 1e9)) / step_s);
    if (const cuda::GraphShape* g = graphs ? s->mtp_graph_shape(true) : nullptr)
      emit(out, "graph    mtp draft step  %s\n", cuda::summary(*g).c_str());
  }

  // ---- prefill
  // One untimed prefill first (up to one full chunk in a session of its own), so the first
  // size timed does not pay the process's one-time costs: the chunk kernels' first launches (lazy
  // module loading) and the scratch pool's growth to its kept size. Without it the first prefill of
  // a process showed e.g. the mix's down projection at 11.7 instead of ~5 us per token (2026-12-01).
  if (!a.prefill.empty()) {
    const int T = std::min(*std::max_element(a.prefill.begin(), a.prefill.end()), chunk + 2 * cuda::kMaxRows);
    auto s = m->new_session(T + 16, chunk);
    std::vector<int32_t> prompt = rand_tokens(T);
    if (!s->step_rows(prompt, false, false, &res, cuda::RowOutputs::kLast).ok()) return 1;
  }
  for (int T : a.prefill) {
    // The first kMaxRows*2 tokens run untimed: they capture the session's graph (graphs are per
    // session); the rest, a multiple of kMaxRows rows, is timed.
    const int warm = 2 * cuda::kMaxRows;
    auto s = m->new_session(T + 16, chunk);
    const bool profile = std::getenv("CK_PROFILE") != nullptr;  // per-piece GPU time of the chunks
    s->set_profile(profile);
    std::vector<int32_t> prompt = rand_tokens(T);
    // As the generator prefills a prompt: outputs (the LM head) for the last row only.
    if (!s->step_rows(std::span<const int32_t>(prompt.data(), warm), false, false, &res, cuda::RowOutputs::kLast).ok())
      return 1;
    s->commit(warm);
    auto ts = Clock::now();
    if (!s->step_rows(std::span<const int32_t>(prompt.data() + warm, T - warm), false, false, &res,
                      cuda::RowOutputs::kLast).ok())
      return 1;
    const double sec = seconds_since(ts);
    s->commit(T - warm);
    const int timed = T - warm;
    // FLOPs per prompt token: the trunk's, plus the one LM head row spread over the timed rows.
    const double lm_flops = 2.0 * static_cast<double>(c.vocab_size) * c.hidden_size;
    const double ceil_c = tflops > 0 ? tflops * 1e12 / (flops_tok - lm_flops + lm_flops / timed) : 0;
    // The row path reads every weight once per step of kMaxRows rows: its own bound.
    const double k = c.num_experts_per_tok, E = c.num_experts, R = cuda::kMaxRows;
    const double step_bytes = dense_tok + c.num_hidden_layers * E * (1.0 - std::pow(1.0 - k / E, R)) * expert_rec;
    const double ceil_row = R / (step_bytes / (copy_gbs * 1e9));
    // The profile is taken before the check's step (which would add its own pieces); nothing is printed
    // for a run whose outputs are not finite.
    const auto prof = profile ? s->take_profile() : decltype(s->take_profile()){};
    if (!outputs_finite(*s, "prefill")) return 1;
    emit(out, "prefill  %5d tokens      %8.1f tok/s  (%.3f s for %d rows)   ceiling %8.0f tok/s (FLOPs / bf16 rate)%s; "
              "row-path bound %.0f tok/s (weights once per %d rows); chunks of %d rows\n",
         T, timed / sec, sec, timed, ceil_c, tflops > 0 ? "" : " [no bf16 rate: not measured]", ceil_row, cuda::kMaxRows,
         chunk);
    if (profile) {
      double total = 0;
      for (const auto& [piece, ms] : prof) total += ms;
      for (const auto& [piece, ms] : prof)
        emit(out, "profile  prefill %5d  %-22s %9.2f ms  %5.1f%%  (%.2f us/token)\n", T, piece.c_str(), ms,
             100.0 * ms / total, 1e3 * ms / timed);
      // The pieces are GPU time between events; what the wall time has beyond them is the host's
      // (the PLE rows' gather between chunks, launches) and the gaps it leaves on the GPU.
      emit(out, "profile  prefill %5d  all pieces             %9.2f ms of %.2f ms wall (%.1f%%)\n", T, total,
           sec * 1e3, 100.0 * total / (sec * 1e3));
    }
  }
  if (out) std::fclose(out);
  return 0;
}
