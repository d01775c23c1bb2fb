// Sampler (see sampler.h). Order of operations follows vLLM/HF: penalties on raw logits, then
// temperature, top-k, softmax, top-p (HF TopPLogitsWarper: drop the tail whose mass is at most
// 1 - top_p, keep at least one token), then one uniform draw over what is left.
#include "text/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace ck::text {

Sampler::Sampler(SamplingParams params) : params_(params), rng_(params.seed) {}

int32_t Sampler::sample(std::span<const float> logits_in, std::span<const int32_t> history) {
  const int32_t n_vocab = static_cast<int32_t>(logits_in.size());
  if (n_vocab == 0) return -1;
  std::span<const float> logits = logits_in;

  if ((params_.presence_penalty != 0 || params_.frequency_penalty != 0) && !history.empty()) {
    logits_.assign(logits_in.begin(), logits_in.end());
    counts_.resize(n_vocab, 0);
    for (int32_t t : history) {
      if (t >= 0 && t < n_vocab) ++counts_[t];
    }
    for (int32_t t : history) {
      if (t < 0 || t >= n_vocab || counts_[t] == 0) continue;  // 0: already applied for t
      logits_[t] -= params_.presence_penalty + params_.frequency_penalty * static_cast<float>(counts_[t]);
      counts_[t] = 0;
    }
    logits = logits_;
  }

  // Greedy: strict > keeps the lowest index among equal maxima. NaN never wins.
  auto argmax = [&] {
    int32_t best = 0;
    for (int32_t i = 1; i < n_vocab; ++i) {
      if (logits[i] > logits[best] || std::isnan(logits[best])) best = i;
    }
    return best;
  };
  if (params_.temperature <= 0 || params_.top_k == 1) return argmax();

  // Candidates carry their logit, probability and id side by side: sorting an index array that
  // points into the logits costs 3x more on a 150k vocabulary (cache misses in the comparator).
  auto better = [](const Cand& x, const Cand& y) { return x.logit > y.logit || (x.logit == y.logit && x.id < y.id); };
  cands_.resize(n_vocab);
  for (int32_t i = 0; i < n_vocab; ++i) cands_[i] = {logits[i], 0.0f, i};
  int32_t n = n_vocab;
  if (params_.top_k > 0 && params_.top_k < n) {
    std::nth_element(cands_.begin(), cands_.begin() + params_.top_k, cands_.end(), better);
    n = params_.top_k;
  }
  const float inv_t = 1.0f / params_.temperature;
  float max_logit = -std::numeric_limits<float>::infinity();
  for (int32_t i = 0; i < n; ++i) max_logit = std::max(max_logit, cands_[i].logit);
  if (!std::isfinite(max_logit)) return argmax();
  double total = 0;
  for (int32_t i = 0; i < n; ++i) {
    float p = std::exp((cands_[i].logit - max_logit) * inv_t);
    cands_[i].p = std::isnan(p) ? 0.0f : p;
    total += cands_[i].p;
  }
  if (!(total > 0)) return argmax();

  if (params_.top_p < 1) {
    // Top-p needs the best candidates in order. Sorting all of a 250k vocabulary per token is
    // wasteful when a few hundred tokens carry the mass, so sort the best 1024 first and widen
    // (x8) only while the kept prefix has not reached the mass.
    const double cut = (1.0 - params_.top_p) * total;
    int32_t n_sorted = 0, m = std::min<int32_t>(n, 1024), keep = 0;
    double prefix = 0;
    for (;;) {
      if (m < n) std::nth_element(cands_.begin() + n_sorted, cands_.begin() + m, cands_.begin() + n, better);
      std::sort(cands_.begin() + n_sorted, cands_.begin() + m, better);
      n_sorted = m;
      // Keep tokens until the remaining tail has mass <= cut (HF keeps at least one).
      bool done = false;
      while (keep < n_sorted) {
        prefix += cands_[keep].p;
        ++keep;
        if (total - prefix <= cut) { done = true; break; }
      }
      if (done || n_sorted == n) break;
      m = std::min<int32_t>(n, m * 8);
    }
    n = keep;
  }
  double sum = 0;
  for (int32_t i = 0; i < n; ++i) sum += cands_[i].p;

  double u = uniform() * sum, acc = 0;
  for (int32_t i = 0; i < n; ++i) {
    acc += cands_[i].p;
    if (u < acc) return cands_[i].id;
  }
  return cands_[n - 1].id;  // rounding: u fell at the very top
}

}  // namespace ck::text
