// `cherenkov bench-tokenizer`: encode speed of the tokenizer on one core, in MB/s of input text.
// The whole file is encoded in one call per iteration (or line by line with --lines, like many
// short prompts); the first iteration starts with a cold BPE cache, later ones reuse it, so both
// are reported. Figures go in docs/performance.md.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "cli/command.h"
#include "text/tokenizer.h"
#include "util/file.h"

namespace {

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
  double best_s = 1e30, first_s = 0;
  size_t n_tokens = 0;
  for (int it = 0; it < n_iter; ++it) {
    auto t0 = std::chrono::steady_clock::now();
    size_t n = 0;
    for (std::string_view c : chunks) n += tok->encode(c).size();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    n_tokens = n;
    if (it == 0) first_s = s;
    best_s = std::min(best_s, s);
  }
  std::printf("input %s: %.2f MB in %zu call(s), %zu tokens (%.2f bytes/token)\n", input_path.c_str(), mb,
              chunks.size(), n_tokens, text->size() / std::max<double>(1, n_tokens));
  std::printf("encode: first (cold cache) %.1f MB/s, best of %d %.1f MB/s (%.2f M tokens/s)\n", mb / first_s,
              n_iter, mb / best_s, n_tokens / best_s / 1e6);
  return 0;
}

ck::cli::Registrar reg("bench-tokenizer", "measure tokenizer encode speed (MB/s, one core)", run_bench_tokenizer);

}  // namespace
