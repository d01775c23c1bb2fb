#include "engine/generator.h"

#include <algorithm>
#include <chrono>

namespace ck::engine {

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Status Generator::generate(std::span<const int32_t> prompt, const GenerateOptions& opt, const TokenCallback& on_token,
                           GenerateStats* stats) {
  *stats = GenerateStats{};
  if (prompt.empty()) return error("empty prompt: nothing to condition on");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= cfg_.vocab_size)
      return error("prompt token {} at index {} is outside the vocabulary [0, {})", prompt[i], i, cfg_.vocab_size);
  text::Sampler sampler(opt.sampling);
  const bool greedy = opt.sampling.temperature <= 0 && opt.sampling.presence_penalty == 0 &&
                      opt.sampling.frequency_penalty == 0;
  StepResult r;
  // Prefill in chunks; only the last chunk's last row produces outputs (its argmax, or its logits for
  // sampling): the LM head runs for that row alone.
  double t0 = now_s();
  const size_t chunk = static_cast<size_t>(std::max(1, opt.prefill_chunk));
  for (size_t i = 0; i < prompt.size(); i += chunk) {
    size_t n = std::min(chunk, prompt.size() - i);
    bool last = i + n == prompt.size();
    TRY(session_.step_rows(prompt.subspan(i, n), false, last && !greedy, &r, RowOutputs::kLast));
    session_.commit(static_cast<int>(n));
  }
  history_.insert(history_.end(), prompt.begin(), prompt.end());
  stats->prompt_tokens = static_cast<int64_t>(prompt.size());
  stats->prefill_s = now_s() - t0;

  const int64_t V = cfg_.vocab_size;
  double t1 = now_s();
  for (int produced = 0; produced < opt.max_tokens; ++produced) {
    int32_t next;
    if (greedy) {
      next = r.argmax.back();
    } else {
      std::span<const float> logits(r.logits.data() + (r.logits.size() / V - 1) * V, static_cast<size_t>(V));
      next = sampler.sample(logits, history_);
    }
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end()) {
      stats->stopped_at_eos = true;
      break;
    }
    ++stats->generated_tokens;
    history_.push_back(next);
    if (!on_token(next)) break;
    if (produced + 1 == opt.max_tokens) break;
    int32_t tok[1] = {next};
    TRY(session_.step_rows(tok, false, !greedy, &r));
    session_.commit(1);
  }
  stats->decode_s = now_s() - t1;
  return {};
}

}  // namespace ck::engine
