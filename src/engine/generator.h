// Generator: prompt prefill, the decode loop, sampling, stop conditions and statistics, above any
// backend's Session (shared/DESIGN.md §1). Streams each token to a callback as it is chosen. MTP
// drafting plugs in here in the next wave (the session already has step_rows/commit with rollback).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/session.h"
#include "text/sampler.h"

namespace ck::engine {

struct GenerateOptions {
  int max_tokens = 256;
  std::vector<int32_t> stop_ids;      // generation ends after emitting one of these (not included)
  text::SamplingParams sampling;
  // Rows per step_rows call during prefill. Only the last row produces outputs, so a call's memory does
  // not grow with it. Give the session the same number (Model::new_session's prefill_chunk): the CUDA
  // session runs at most that many rows per tensor-core chunk.
  int prefill_chunk = kDefaultPrefillChunk;
};

struct GenerateStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double prefill_s = 0;
  double decode_s = 0;
  bool stopped_at_eos = false;
  double prefill_tok_s() const { return prefill_s > 0 ? prompt_tokens / prefill_s : 0; }
  double decode_tok_s() const { return decode_s > 0 ? generated_tokens / decode_s : 0; }
};

// on_token(id) returns false to stop early (a user interrupt, a closed pipe).
using TokenCallback = std::function<bool(int32_t)>;

class Generator {
 public:
  Generator(Session& session, const ModelConfig& cfg) : session_(session), cfg_(cfg) {}

  // Appends `prompt` to the sequence, then samples up to max_tokens tokens. The history the
  // sampler's penalties see is every token this generator has fed, across turns.
  Status generate(std::span<const int32_t> prompt, const GenerateOptions& opt, const TokenCallback& on_token,
                  GenerateStats* stats);

 private:
  Session& session_;
  const ModelConfig& cfg_;
  std::vector<int32_t> history_;
};

}  // namespace ck::engine
