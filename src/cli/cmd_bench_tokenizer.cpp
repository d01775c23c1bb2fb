// `cherenkov bench-tokenizer`: encode speed of the tokenizer on one core, in MB/s of input text.
// The whole file is encoded in one call per iteration (or line by line with --lines, like many
// short prompts); the first iteration starts with a cold BPE cache, later ones reuse it, so both
// are reported. Wall time and this thread's CPU time are both measured: on a shared machine the
// CPU time still says what one core does. Figures go in docs/performance.md.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>

#include "cli/command.h"
#include "text/tokenizer.h"
#include "util/file.h"

namespace {

double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int run_bench_tokenizer(int argc, char** argv) {
  CLI::App app{"Measure tokenizer encode speed (MB/s, one thread)"};
  std::string tokenizer_path, input_path;
  int n_iter = 5;
  bool by_line = false;
  app.add_option("--tokenizer", tokenizer_path, "tokenizer.json")->required();
  app.add_option("--input", input_path, "UTF-8 text file to encode")->required();
  app.add_option("--iters", n_iter, "iterations (the first has a cold cache)")->check(CLI::Range(1, 1000));
  app.add_flag("--lines", by_line, "encode each line (newline included) separately");
  CLI11_PARSE(app, argc, argv);

  auto tok = ck::text::Tokenizer::load(tokenizer_path);
  if (!tok.ok()) {
    std::fprintf(stderr, "error: %s\n", tok.status().message().c_str());
    return 1;
  }
  auto text = ck::read_file(input_path);
  if (!text.ok()) {
    std::fprintf(stderr, "error: %s\n", text.status().message().c_str());
    return 1;
  }
  const double mb = text->size() / 1e6;
  std::vector<std::string_view> chunks;
  if (by_line) {
    std::string_view all = *text;
    while (!all.empty()) {
      size_t nl = all.find('\n');
      size_t len = nl == std::string_view::npos ? all.size() : nl + 1;
      chunks.push_back(all.substr(0, len));
      all.remove_prefix(len);
    }
  } else {
    chunks.push_back(*text);
  }
  double best_s = 1e30, first_s = 0, best_cpu_s = 1e30, first_cpu_s = 0;
  size_t n_tokens = 0;
  for (int it = 0; it < n_iter; ++it) {
    auto t0 = std::chrono::steady_clock::now();
    double c0 = thread_cpu_s();
    size_t n = 0;
    for (std::string_view c : chunks) n += tok->encode(c).size();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double cpu = thread_cpu_s() - c0;
    n_tokens = n;
    if (it == 0) { first_s = s; first_cpu_s = cpu; }
    best_s = std::min(best_s, s);
    best_cpu_s = std::min(best_cpu_s, cpu);
  }
  std::printf("input %s: %.2f MB in %zu call(s), %zu tokens (%.2f bytes/token)\n", input_path.c_str(), mb,
              chunks.size(), n_tokens, text->size() / std::max<double>(1, n_tokens));
  std::printf("encode wall: first (cold cache) %.1f MB/s, best of %d %.1f MB/s (%.2f M tokens/s)\n", mb / first_s,
              n_iter, mb / best_s, n_tokens / best_s / 1e6);
  std::printf("encode cpu:  first (cold cache) %.1f MB/s, best of %d %.1f MB/s (%.2f M tokens/s)\n",
              mb / first_cpu_s, n_iter, mb / best_cpu_s, n_tokens / best_cpu_s / 1e6);
  return 0;
}

ck::cli::Registrar register_bench_tokenizer("bench-tokenizer", "measure tokenizer encode speed (MB/s, one core)", run_bench_tokenizer);

}  // namespace
