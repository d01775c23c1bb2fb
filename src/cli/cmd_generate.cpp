// `cherenkov generate`: the ids-in, ids-out contract that tests and outside checks use
// (shared/DESIGN.md §7). Greedy decoding; stdout is the generated ids, comma-separated, on one line.
// It never stops early at EOS: exactly --max-tokens ids are generated, as the oracle fixtures do.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/model_loader.h"
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
  std::string model_dir, prompt, logits_out, backend = "cpu";
  int max_tokens = 16;
  app.add_option("--model", model_dir, "checkpoint or store directory")->required();
  app.add_option("--prompt-ids", prompt, "prompt token ids, comma-separated (e.g. 1,2,3)")->required();
  app.add_option("--max-tokens", max_tokens, "number of tokens to generate")->check(CLI::NonNegativeNumber);
  app.add_option("--logits-out", logits_out, "write float32 logits of every prompt position, [T, vocab], as .npy");
  app.add_option("--backend", backend, "cpu (the reference)")->check(CLI::IsMember({"cpu", "cuda"}));
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
  auto loaded = ck::cli::load_model(model_dir, backend);
  if (!loaded.ok()) {
    std::fprintf(stderr, "error: %s\n", loaded.status().message().c_str());
    return 1;
  }
  auto& lm = *loaded;
  const int64_t V = lm->model->cfg().vocab_size;
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] >= V) {
      std::fprintf(stderr, "error: --prompt-ids: token id %d at index %zu is outside the vocabulary [0, %lld)\n",
                   ids[i], i, static_cast<long long>(V));
      return 2;
    }
  auto session = lm->model->new_session();
  ck::cpu::StepResult res;
  ck::Status st = session->step_rows(ids, false, !logits_out.empty(), &res);
  if (!st.ok()) {
    std::fprintf(stderr, "error: %s\n", st.message().c_str());
    return 1;
  }
  session->commit(static_cast<int>(ids.size()));
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
    st = session->step_rows(tok, false, false, &res);
    if (!st.ok()) {
      std::fprintf(stderr, "error: %s\n", st.message().c_str());
      return 1;
    }
    session->commit(1);
    next = res.argmax[0];
  }
  std::string line;
  for (size_t i = 0; i < out.size(); ++i) line += (i ? "," : "") + std::to_string(out[i]);
  std::printf("%s\n", line.c_str());
  return 0;
}

ck::cli::Registrar reg("generate", "greedy generation from token ids (the test contract)", run_generate);

}  // namespace
