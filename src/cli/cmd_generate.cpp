// `cherenkov generate`: the ids-in, ids-out contract that tests and outside checks use
// (shared/DESIGN.md §7). Greedy decoding; stdout is the generated ids, comma-separated, on one line.
// It never stops early at EOS: exactly --max-tokens ids are generated, as the oracle fixtures do.
// --backend picks the engine (auto: cuda when a GPU is visible); --check runs the CPU reference beside
// it on the same tokens and prints the max logit difference of every step to stderr.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/model_loader.h"
#include "cli/validators.h"
#include "util/npy.h"

namespace {

bool parse_ids(const std::string& s, std::vector<int32_t>* out, std::string* err) {
  size_t pos = 0;
  while (pos <= s.size()) {
    size_t end = s.find(',', pos);
    if (end == std::string::npos) end = s.size();
    std::string tok = s.substr(pos, end - pos);
    size_t a = tok.find_first_not_of(" \t\n"), b = tok.find_last_not_of(" \t\n");
    tok = a == std::string::npos ? "" : tok.substr(a, b - a + 1);
    if (tok.empty()) { *err = "empty entry in --prompt-ids"; return false; }
    char* e = nullptr;
    long long v = std::strtoll(tok.c_str(), &e, 10);
    if (*e != '\0' || v < 0 || v > INT32_MAX) { *err = "'" + tok + "' in --prompt-ids is not a token id"; return false; }
    out->push_back(static_cast<int32_t>(v));
    pos = end + 1;
  }
  return true;
}

int run_generate(int argc, char** argv) {
  CLI::App app{"Greedy generation from token ids; prints the generated ids comma-separated on one line."};
  std::string model_dir, prompt, logits_out, backend = "auto";
  int max_tokens = 16;
  int prefill_chunk = 0;  // the backend's choice
  bool check = false;
  app.add_option("--model", model_dir, "checkpoint or store directory")->required();
  app.add_option("--prompt-ids", prompt, "prompt token ids, comma-separated (e.g. 1,2,3)")->required();
  app.add_option("--max-tokens", max_tokens, "number of tokens to generate")
      ->check(CLI::Range(0, ck::cli::kMaxTokensFlag));
  app.add_option("--logits-out", logits_out, "write float32 logits of every prompt position, [T, vocab], as .npy");
  app.add_option("--backend", backend, "cpu (the reference), cuda, or auto (cuda when a GPU is visible)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_option("--prefill-chunk", prefill_chunk,
                 "CUDA: prompt rows per tensor-core chunk; its per-row GPU buffers are sized by it. 0: 2048, or "
                 "up to 8192 where a quarter of the GPU memory left after the weights holds them")
      ->check(CLI::Range(0, ck::engine::kMaxPrefillChunk))
      ->capture_default_str();
  ck::cli::LoadOptions load_opts;
  add_store_options(app, load_opts);
  app.add_flag("--check", check, "run the CPU reference beside the backend; print the max logit difference per step");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  std::vector<int32_t> ids;
  std::string err;
  if (!parse_ids(prompt, &ids, &err)) {
    std::fprintf(stderr, "error: %s\n", err.c_str());
    return 2;
  }
  auto loaded = ck::cli::load_model(model_dir, backend, load_opts);
  if (!loaded.ok()) {
    std::fprintf(stderr, "error: %s\n", loaded.status().message().c_str());
    return 1;
  }
  auto& lm = *loaded;
  const int64_t V = lm->engine->cfg().vocab_size;
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] >= V) {
      std::fprintf(stderr, "error: --prompt-ids: token id %d at index %zu is outside the vocabulary [0, %lld)\n",
                   ids[i], i, static_cast<long long>(V));
      return 2;
    }
  const int64_t max_ctx = static_cast<int64_t>(ids.size()) + max_tokens + 1;
  if (prefill_chunk == 0) prefill_chunk = lm->engine->default_prefill_chunk();
  if (const ck::Status fits = lm->engine->prefill_chunk_fits(max_ctx, prefill_chunk); !fits.ok()) {
    std::fprintf(stderr, "error: %s\n", fits.message().c_str());
    return 1;
  }
  auto session = lm->engine->new_session(max_ctx, prefill_chunk);
  std::unique_ptr<ck::engine::Session> ref;  // --check: the CPU reference on the same tokens
  if (check) ref = ck::engine::CpuModel(*lm->model).new_session(max_ctx);
  ck::engine::StepResult res, ref_res;
  int step_no = 0;
  // Steps both sessions; with --check, reports the max |logit difference| over the step's rows.
  auto step = [&](std::span<const int32_t> toks, bool want_logits) -> ck::Status {
    const int64_t pos = session->pos();
    TRY(session->step_rows(toks, false, want_logits || check, &res));
    session->commit(static_cast<int>(toks.size()));
    if (check) {
      TRY(ref->step_rows(toks, false, true, &ref_res));
      ref->commit(static_cast<int>(toks.size()));
      float max_diff = 0.0f;
      for (size_t i = 0; i < res.logits.size(); ++i) max_diff = std::max(max_diff, std::fabs(res.logits[i] - ref_res.logits[i]));
      std::fprintf(stderr, "check: step %d (pos %lld, %zu rows, %s vs cpu): max |logit diff| %.3e, last argmax %d vs %d%s\n",
                   step_no, static_cast<long long>(pos), toks.size(), lm->engine->backend(), max_diff, res.argmax.back(),
                   ref_res.argmax.back(), res.argmax == ref_res.argmax ? "" : "  ARGMAX DIFFERS");
    }
    ++step_no;
    return {};
  };
  ck::Status st = step(ids, !logits_out.empty());
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.message().c_str());
    return 1;
  }
  if (!logits_out.empty()) {
    st = ck::write_npy_f32(logits_out, res.logits.data(), {static_cast<int64_t>(ids.size()), V});
    if (!st.ok()) {
      std::fprintf(stderr, "error: %s\n", st.message().c_str());
      return 1;
    }
  }
  std::vector<int32_t> out;
  int32_t next = res.argmax.back();
  for (int i = 0; i < max_tokens; ++i) {
    out.push_back(next);
    if (i + 1 == max_tokens) break;
    int32_t tok[1] = {next};
    st = step(tok, false);
    if (!st.ok()) {
      std::fprintf(stderr, "error: %s\n", st.message().c_str());
      return 1;
    }
    next = res.argmax[0];
  }
  std::string line;
  for (size_t i = 0; i < out.size(); ++i) line += (i ? "," : "") + std::to_string(out[i]);
  std::printf("%s\n", line.c_str());
  return 0;
}

ck::cli::Registrar register_generate("generate", "greedy generation from token ids (the test contract)", run_generate);

}  // namespace
