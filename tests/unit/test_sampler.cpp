// Sampler tests: greedy and its tie rule, penalties, seeded reproducibility, and sampling
// statistics against softmax with a fixed seed (top-k and top-p must exclude what they must).
// Tolerances: with N draws a frequency has standard deviation sqrt(p(1-p)/N) <= 0.5/sqrt(N);
// 0.01 at N = 200k is over 8 sigma, so a pass is not luck and a failure is a real bias.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "text/sampler.h"

using ck::text::Sampler;
using ck::text::SamplingParams;

namespace {

std::vector<double> softmax(const std::vector<float>& logits, float t) {
  double mx = -1e30, sum = 0;
  for (float l : logits) mx = std::max<double>(mx, l / t);
  std::vector<double> p(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) sum += p[i] = std::exp(logits[i] / t - mx);
  for (auto& x : p) x /= sum;
  return p;
}

std::vector<double> frequencies(Sampler& s, const std::vector<float>& logits, int n_draws) {
  std::vector<double> f(logits.size(), 0);
  for (int i = 0; i < n_draws; ++i) {
    int32_t t = s.sample(logits, {});
    EXPECT_GE(t, 0);
    EXPECT_LT(t, static_cast<int32_t>(logits.size()));
    f[t] += 1.0 / n_draws;
  }
  return f;
}

constexpr int kDraws = 200000;
constexpr double kTol = 0.01;

}  // namespace

TEST(Sampler, GreedyPicksMaxLowestIndexOnTies) {
  Sampler s({});
  std::vector<float> l = {0.1f, 3.0f, -2.0f, 3.0f, 1.0f};
  EXPECT_EQ(s.sample(l, {}), 1);
  std::vector<float> all_equal(10, 0.5f);
  EXPECT_EQ(s.sample(all_equal, {}), 0);
  std::vector<float> with_nan = {NAN, 1.0f, 2.0f};
  EXPECT_EQ(s.sample(with_nan, {}), 2);
  // top_k=1 is greedy whatever the temperature.
  Sampler k1({.temperature = 5.0f, .top_k = 1, .seed = 3});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(k1.sample(l, {}), 1);
}

TEST(Sampler, PresenceAndFrequencyPenalties) {
  std::vector<float> l = {2.0f, 1.5f, 0.0f};
  std::vector<int32_t> hist = {0};
  Sampler none({});
  EXPECT_EQ(none.sample(l, hist), 0);
  Sampler presence({.presence_penalty = 1.0f});
  EXPECT_EQ(presence.sample(l, hist), 1);  // 2 - 1 < 1.5
  Sampler freq({.frequency_penalty = 0.2f});
  std::vector<int32_t> twice = {0, 0};
  EXPECT_EQ(freq.sample(l, twice), 0);  // 2 - 0.4 > 1.5
  std::vector<int32_t> thrice = {0, 5000, 0, -1, 0};  // out-of-range ids are ignored
  EXPECT_EQ(freq.sample(l, thrice), 1);  // 2 - 0.6 < 1.5
  // Penalties do not leak into the next call.
  EXPECT_EQ(freq.sample(l, {}), 0);
}

TEST(Sampler, SameSeedSameSequence) {
  std::vector<float> l(1000);
  for (size_t i = 0; i < l.size(); ++i) l[i] = std::sin(static_cast<float>(i) * 0.37f) * 3;
  SamplingParams p{.temperature = 0.9f, .top_p = 0.95f, .top_k = 50, .seed = 1234};
  Sampler a(p), b(p);
  p.seed = 1235;
  Sampler c(p);
  std::vector<int32_t> sa, sb, sc;
  for (int i = 0; i < 200; ++i) {
    sa.push_back(a.sample(l, sa));
    sb.push_back(b.sample(l, sb));
    sc.push_back(c.sample(l, sc));
  }
  EXPECT_EQ(sa, sb);
  EXPECT_NE(sa, sc);
}

TEST(Sampler, FrequenciesMatchSoftmax) {
  std::vector<float> l = {1.0f, 2.0f, 3.0f, 0.5f, -1.0f};
  for (float t : {1.0f, 0.5f, 2.0f}) {
    Sampler s({.temperature = t, .seed = 42});
    auto f = frequencies(s, l, kDraws);
    auto p = softmax(l, t);
    for (size_t i = 0; i < l.size(); ++i) EXPECT_NEAR(f[i], p[i], kTol) << "T=" << t << " token " << i;
  }
}

TEST(Sampler, TopKKeepsOnlyTheBest) {
  std::vector<float> l = {1.0f, 2.0f, 3.0f, 0.5f, 2.5f};
  Sampler s({.temperature = 1.0f, .top_k = 2, .seed = 7});
  auto f = frequencies(s, l, kDraws);
  auto p = softmax({3.0f, 2.5f}, 1.0f);
  EXPECT_NEAR(f[2], p[0], kTol);
  EXPECT_NEAR(f[4], p[1], kTol);
  EXPECT_EQ(f[0] + f[1] + f[3], 0.0);
}

TEST(Sampler, TopPKeepsSmallestSetReachingP) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (logits are their logs).
  std::vector<float> l = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  {
    Sampler s({.temperature = 1.0f, .top_p = 0.75f, .seed = 11});
    auto f = frequencies(s, l, kDraws);
    EXPECT_NEAR(f[1], 0.5 / 0.8, kTol);
    EXPECT_NEAR(f[3], 0.3 / 0.8, kTol);
    EXPECT_EQ(f[0] + f[2], 0.0);
  }
  {
    Sampler s({.temperature = 1.0f, .top_p = 0.9f, .seed = 12});
    auto f = frequencies(s, l, kDraws);
    EXPECT_NEAR(f[0], 0.15 / 0.95, kTol);
    EXPECT_EQ(f[2], 0.0);
  }
  {
    Sampler s({.temperature = 1.0f, .top_p = 0.1f, .seed = 13});  // always keeps one
    auto f = frequencies(s, l, 1000);
    EXPECT_NEAR(f[1], 1.0, 1e-9);
  }
}

// A real-sized vocabulary with a long flat tail: top-p must widen past its first 1024
// candidates, and a masked (-inf) token is never drawn.
TEST(Sampler, LargeVocabularyTopP) {
  const int n = 151669;
  std::vector<float> l(n, 0.0f);
  l[77] = 8.0f;  // p = e^8 / (e^8 + n - 2) ~ 0.02: the mass is in the tail
  l[5] = -INFINITY;
  Sampler s({.temperature = 1.0f, .top_p = 0.99f, .seed = 5});
  std::vector<int32_t> seen;
  for (int i = 0; i < 40; ++i) {
    int32_t t = s.sample(l, {});
    ASSERT_NE(t, 5);
    seen.push_back(t);
  }
  std::sort(seen.begin(), seen.end());
  size_t n_distinct = std::unique(seen.begin(), seen.end()) - seen.begin();
  EXPECT_GT(n_distinct, 35u);
  EXPECT_GT(seen[n_distinct - 1], 100000);  // draws reach far beyond the first 1024 ids
}
