// Next-token sampling from logits: presence/frequency penalties, then greedy (temperature 0) or
// temperature + top-k + top-p with a seeded generator, so one seed always gives the same tokens
// on every platform. Runs on the host, once per generated token per sequence.
#pragma once
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace ck::text {

struct SamplingParams {
  float temperature = 0;  // 0: greedy (argmax, lowest index on ties)
  float top_p = 1;        // keep the smallest top set whose probability mass reaches top_p
  int top_k = 0;          // 0: no limit
  // OpenAI semantics: logit[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t],
  // counting t in `history` (the caller passes the tokens it wants penalized, usually the output).
  float presence_penalty = 0, frequency_penalty = 0;
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  // logits: (n_vocab) fp32 for the next position. history: token ids, for the penalties.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> history);
  const SamplingParams& params() const { return params_; }

 private:
  // A double in [0, 1) from the top 53 bits: spelled out because std::uniform_real_distribution
  // differs between standard libraries, and "same seed, same tokens" should hold everywhere.
  double uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<float> logits_;        // (n_vocab) penalized logits
  std::vector<int32_t> counts_;      // (n_vocab) occurrences in history; reset after each call
  struct Cand {
    float logit, p;  // p: unnormalized probability exp((logit - max) / temperature)
    int32_t id;
  };
  std::vector<Cand> cands_;  // tokens still in play, best first once sorted
};

}  // namespace ck::text
