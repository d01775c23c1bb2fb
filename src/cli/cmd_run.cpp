// `cherenkov run [--model DIR] [PROMPT]`: text in, text out. Renders the model's chat template
// (or --raw), streams the reply to stdout as it is generated, stops at the model's EOS tokens, and
// prints prefill/decode speed to stderr. With no PROMPT and a terminal on stdin it chats turn by
// turn; with no PROMPT and piped stdin it reads the prompt from stdin.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/model_loader.h"
#include "cli/validators.h"
#include "engine/generator.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "util/file.h"
#include "util/json.h"

#ifndef CHERENKOV_DEFAULT_MODEL
#define CHERENKOV_DEFAULT_MODEL "models/cherenkov-tiny"
#endif

namespace {

// EOS ids: generation_config.json's eos_token_id (int or list), else config.json's.
std::vector<int32_t> stop_ids(const std::string& dir, const ck::ModelConfig& cfg) {
  std::vector<int32_t> ids;
  auto add = [&](ck::JsonRef v) {
    if (v.is_integer()) ids.push_back(static_cast<int32_t>(v.as_int()));
    else
      for (ck::JsonRef x : v.elements())
        if (x.is_integer()) ids.push_back(static_cast<int32_t>(x.as_int()));
  };
  auto gen = ck::read_file(ck::join_path(dir, "generation_config.json"));
  if (gen.ok()) {
    auto j = ck::parse_json(*gen);
    if (j.ok()) add((*j)["eos_token_id"]);
  }
  if (ids.empty())
    for (int64_t e : cfg.eos_token_ids) ids.push_back(static_cast<int32_t>(e));
  return ids;
}

std::string default_model() {
  if (const char* env = std::getenv("CHERENKOV_MODEL")) return env;
  if (ck::is_directory("models/cherenkov-tiny")) return "models/cherenkov-tiny";
  return CHERENKOV_DEFAULT_MODEL;
}

// {"role": role, "content": content}, keys in that order.
ck::JsonDoc message(const char* role, const std::string& content) {
  ck::JsonBuilder b(true);
  b.begin_object().field("role", role).field("content", content).end_object();
  return b.finish();
}

struct Chat {
  ck::engine::Model& model;
  const ck::text::Tokenizer& tok;
  const ck::text::ChatTemplate* tmpl;
  ck::JsonDoc extra;
  ck::engine::GenerateOptions opt;
  bool raw = false;
  std::optional<bool> thinking;
  ck::JsonDoc messages = ck::JsonDoc::array(true);
  std::unique_ptr<ck::engine::Session> session;
  std::unique_ptr<ck::engine::Generator> gen;
  std::vector<int32_t> fed;  // every token the session holds

  // One turn: returns the reply text.
  ck::Result<std::string> turn(const std::string& user) {
    std::vector<int32_t> ids;
    if (raw) {
      ids = tok.encode(user, true);
    } else {
      messages.push_back(message("user", user));
      ck::text::ChatTemplateInput in;
      in.messages = messages;
      in.add_generation_prompt = true;
      in.enable_thinking = thinking;
      in.extra = extra;
      auto text = tmpl->render(in);
      if (!text.ok()) return text.status();
      ids = tok.encode(*text, true);
    }
    // Reuse the session when the new prompt extends what it already holds; else start over.
    bool extends = session && ids.size() > fed.size() && std::equal(fed.begin(), fed.end(), ids.begin());
    std::vector<int32_t> feed;
    if (extends) {
      feed.assign(ids.begin() + static_cast<long>(fed.size()), ids.end());
    } else {
      const int64_t max_ctx = static_cast<int64_t>(ids.size()) + opt.max_tokens + 16;
      TRY(model.prefill_chunk_fits(max_ctx, opt.prefill_chunk));
      session = model.new_session(max_ctx, opt.prefill_chunk);
      gen = std::make_unique<ck::engine::Generator>(*session, model.cfg());
      fed.clear();
      feed = ids;
    }
    ck::text::StreamDecoder dec(tok, true);
    std::string reply;
    ck::engine::GenerateStats st;
    std::vector<int32_t> out;
    auto on_token = [&](int32_t id) {
      out.push_back(id);
      std::string piece = dec.push(id);
      reply += piece;
      std::fputs(piece.c_str(), stdout);
      std::fflush(stdout);
      return true;
    };
    TRY(gen->generate(feed, opt, on_token, &st));
    std::string tail = dec.flush();
    reply += tail;
    std::fputs(tail.c_str(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
    fed.insert(fed.end(), feed.begin(), feed.end());
    fed.insert(fed.end(), out.begin(), out.end());
    std::fprintf(stderr, "[%s] prefill %lld tok in %.2f s (%.1f tok/s), decode %lld tok in %.2f s (%.1f tok/s)%s\n",
                 model.backend(), static_cast<long long>(st.prompt_tokens), st.prefill_s, st.prefill_tok_s(),
                 static_cast<long long>(st.generated_tokens), st.decode_s, st.decode_tok_s(),
                 st.stopped_at_eos ? "" : " (max tokens)");
    if (!raw) messages.push_back(message("assistant", reply));
    // The stop token is not fed to the session; the next render re-adds the template's end marker,
    // so the next turn re-encodes from the assistant reply on (extends-check above handles it).
    return reply;
  }
};

int run_run(int argc, char** argv) {
  CLI::App app{"Generate text from a prompt (or chat, with no prompt on a terminal)."};
  std::string model_dir = default_model(), prompt, system, backend = "auto", thinking;
  bool raw = false;
  ck::engine::GenerateOptions opt;
  opt.max_tokens = 256;
  app.add_option("prompt", prompt, "the prompt; omitted: chat on a terminal, or read stdin");
  app.add_option("--model", model_dir, "checkpoint or store directory (default: the embedded small model)");
  app.add_option("--max-tokens", opt.max_tokens, "tokens to generate per reply")
      ->check(CLI::Range(1, ck::cli::kMaxTokensFlag));
  app.add_option("--temperature", opt.sampling.temperature, "0 = greedy")->check(ck::cli::at_least(0));
  app.add_option("--top-k", opt.sampling.top_k, "keep the k most likely tokens (0 = all)")
      ->check(CLI::Range(0, 1 << 30));
  app.add_option("--top-p", opt.sampling.top_p, "nucleus sampling threshold")->check(CLI::Range(0.0, 1.0));
  app.add_option("--presence-penalty", opt.sampling.presence_penalty, "penalty for tokens already present");
  app.add_option("--frequency-penalty", opt.sampling.frequency_penalty, "penalty per previous occurrence");
  app.add_option("--seed", opt.sampling.seed, "sampling seed (same seed, same text)");
  app.add_option("--system", system, "system message");
  app.add_option("--enable-thinking", thinking, "pass enable_thinking to the template")->check(CLI::IsMember({"true", "false"}));
  app.add_flag("--raw", raw, "no chat template: the prompt is fed as is");
  app.add_option("--backend", backend, "cpu, cuda or auto")->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  opt.prefill_chunk = 0;  // the backend's choice once the model is loaded
  app.add_option("--prefill-chunk", opt.prefill_chunk,
                 "prompt rows per prefill step; CUDA sizes its per-row GPU buffers by it (~0.8 MB a row at the "
                 "released geometry): fewer rows, less memory, slower prefill. 0: 2048, or up to 8192 where a "
                 "quarter of the GPU memory left after the weights holds them")
      ->check(CLI::Range(0, ck::engine::kMaxPrefillChunk))
      ->capture_default_str();
  ck::cli::LoadOptions load_opts;
  add_store_options(app, load_opts);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  auto loaded = ck::cli::load_model(model_dir, backend, load_opts);
  if (!loaded.ok()) {
    std::fprintf(stderr, "error: %s\n", loaded.status().message().c_str());
    return 1;
  }
  std::string tok_path = ck::join_path(model_dir, "tokenizer.json");
  auto tok = ck::text::Tokenizer::load(tok_path);
  if (!tok.ok()) {
    std::fprintf(stderr, "error: %s\n", tok.status().message().c_str());
    return 1;
  }
  ck::JsonDoc extra = ck::JsonDoc::object(true);
  std::optional<ck::text::ChatTemplate> tmpl;
  if (!raw) {
    auto t = ck::text::load_chat_template(model_dir, &extra);
    if (!t.ok()) {
      std::fprintf(stderr, "error: %s (use --raw to skip the template)\n", t.status().message().c_str());
      return 1;
    }
    tmpl = std::move(t).value();
  }
  const ck::ModelConfig& cfg = (*loaded)->engine->cfg();
  opt.stop_ids = stop_ids(model_dir, cfg);
  if (opt.prefill_chunk == 0) opt.prefill_chunk = (*loaded)->engine->default_prefill_chunk();
  Chat chat{*(*loaded)->engine, *tok, tmpl ? &*tmpl : nullptr, extra, opt, raw, {}, ck::JsonDoc::array(true), {}, {}, {}};
  if (!thinking.empty()) chat.thinking = thinking == "true";
  if (!system.empty()) chat.messages.push_back(message("system", system));

  const bool interactive = prompt.empty() && isatty(STDIN_FILENO);
  if (!interactive) {
    if (prompt.empty()) {
      std::string line;
      while (std::getline(std::cin, line)) prompt += line + "\n";
      if (!prompt.empty() && prompt.back() == '\n') prompt.pop_back();
    }
    auto r = chat.turn(prompt);
    if (!r.ok()) {
      std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
      return 1;
    }
    return 0;
  }
  std::fprintf(stderr, "cherenkov: chatting with %s (%s backend); an empty line or Ctrl-D ends.\n",
               model_dir.c_str(), chat.model.backend());
  std::string line;
  while (true) {
    std::fprintf(stderr, "> ");
    if (!std::getline(std::cin, line) || line.empty()) break;
    auto r = chat.turn(line);
    if (!r.ok()) std::fprintf(stderr, "error: %s\n", r.status().message().c_str());
  }
  return 0;
}

ck::cli::Registrar register_run("run", "generate text from a prompt, or chat (default: the embedded small model)", run_run);

}  // namespace
