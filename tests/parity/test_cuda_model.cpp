// The CUDA engine against the Hugging Face oracle fixtures (tests/fixtures/oracle/*) and against the
// CPU reference: logits at every prompt position (relative L2 <= 1e-4, the bound the CPU reference
// meets), greedy tokens wherever the oracle's margin exceeds 1e-3, incremental decode and
// step_rows/commit rollback equal to plain decoding, and logits that do not change by a bit when the
// experts move to other slots. Skips when no CUDA device is visible (CI); always compiles.
#include <gtest/gtest.h>

#include <cstring>

#include "../common/fixtures.h"
#include "cpu/qwen4_exp.h"
#if CHERENKOV_HAVE_CUDA
#include "cuda/qwen4_exp.h"
#endif

using namespace ck;

namespace {

constexpr double kLogitTol = 1e-4;    // vs the oracle, as test_cpu_reference
constexpr double kSelfTol = 1e-6;     // between two row-path runs that differ only in how rows are grouped
// Prefill chunks (tensor cores, bf16x3 products: each fp32 operand as two bf16 parts, the lo*lo term
// dropped, ~2^-16 relative per product) against the fp32 row path of the same engine.
constexpr double kChunkTol = 1e-4;
constexpr float kMarginFloor = 1e-3f;

std::vector<std::string> all_fixtures() { return test::fixture_dirs("oracle"); }

std::string fixture_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param.substr(info.param.find_last_of('/') + 1);
  for (char& c : n)
    if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

class CudaOracle : public ::testing::TestWithParam<std::string> {};

#if CHERENKOV_HAVE_CUDA
// The two ways a prompt runs: the row path only (GEMV, steps of kMaxRows) and prefill chunks.
struct PathCase { const char* name; int chunk; };
constexpr PathCase kPaths[] = {{"rows", 0}, {"chunks", cuda::kChunkRows}};

bool have_gpu() {
  static const bool g = cuda::device_count() > 0;
  return g;
}

struct Loaded {
  std::unique_ptr<Checkpoint> ck;
  std::unique_ptr<cuda::Model> model;
};

Loaded load(const std::string& dir) {
  Loaded l;
  auto ck = open_checkpoint(dir);
  EXPECT_TRUE(ck.ok()) << ck.status().message();
  if (!ck.ok()) return l;
  l.ck = std::move(ck).value();
  auto m = cuda::Model::create(l.ck->weights, l.ck->experts);
  EXPECT_TRUE(m.ok()) << m.status().message();
  if (m.ok()) l.model = std::move(m).value();
  return l;
}

#define SETUP()                                            \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";       \
  auto fx = test::load_fixture(GetParam());                \
  ASSERT_TRUE(fx.ok()) << fx.status().message();           \
  Loaded l = load(GetParam());                             \
  ASSERT_TRUE(l.model);                                    \
  const int64_t V = l.model->cfg().vocab_size;             \
  (void)V

TEST_P(CudaOracle, PromptLogitsMatchOracle) {
  SETUP();
  ASSERT_EQ(fx->logits.size(), fx->prompt.size() * V);
  for (const PathCase& path : kPaths) {
    auto s = l.model->new_session(256);
    s->set_prefill_chunk(path.chunk);
    cuda::StepResult r;
    ASSERT_TRUE(s->step_rows(fx->prompt, false, true, &r).ok());
    std::string bad;
    int n_bad = 0;
    double worst = 0;
    for (size_t t = 0; t < fx->prompt.size(); ++t) {
      const double e = test::rel_l2(r.logits.data() + t * V, fx->logits.data() + t * V, V);
      worst = std::max(worst, e);
      if (!(e <= kLogitTol)) { ++n_bad; bad += "position " + std::to_string(t) + ": rel L2 " + std::to_string(e) + "\n"; }
    }
    EXPECT_EQ(n_bad, 0) << path.name << ": " << n_bad << " positions over " << kLogitTol << ":\n" << bad;
    std::printf("  %s: cuda (%s) vs oracle, worst rel L2 %.3g over %zu positions\n", fixture_name({GetParam(), 0}).c_str(),
                path.name, worst, fx->prompt.size());
  }
}

TEST_P(CudaOracle, MatchesCpuReference) {
  SETUP();
  cpu::Model cm(l.ck->weights, l.ck->experts);
  auto cs = cm.new_session();
  cpu::StepResult a;
  ASSERT_TRUE(cs->step_rows(fx->prompt, false, true, &a).ok());
  for (const PathCase& path : kPaths) {
    auto s = l.model->new_session(256);
    s->set_prefill_chunk(path.chunk);
    cpu::StepResult b;
    ASSERT_TRUE(s->step_rows(fx->prompt, false, true, &b).ok());
    double worst = 0, max_abs = 0;
    int argmax_diff = 0;
    for (size_t t = 0; t < fx->prompt.size(); ++t) {
      worst = std::max(worst, test::rel_l2(b.logits.data() + t * V, a.logits.data() + t * V, V));
      for (int64_t i = 0; i < V; ++i) max_abs = std::max<double>(max_abs, std::fabs(b.logits[t * V + i] - a.logits[t * V + i]));
      argmax_diff += a.argmax[t] != b.argmax[t];
    }
    std::printf("  %s: cuda (%s) vs cpu, worst rel L2 %.3g, max |logit diff| %.3g, argmax differs at %d of %zu positions\n",
                fixture_name({GetParam(), 0}).c_str(), path.name, worst, max_abs, argmax_diff, fx->prompt.size());
    EXPECT_LE(worst, kLogitTol) << path.name;
  }
}

// Prefill chunks of 16 rows (several chunks, then a row-path tail) against the row path.
TEST_P(CudaOracle, PrefillChunksMatchRowPath) {
  SETUP();
  auto rows = l.model->new_session(256);
  rows->set_prefill_chunk(0);
  auto chunks = l.model->new_session(256);
  chunks->set_prefill_chunk(16);
  cuda::StepResult a, b;
  ASSERT_TRUE(rows->step_rows(fx->prompt, false, true, &a).ok());
  ASSERT_TRUE(chunks->step_rows(fx->prompt, false, true, &b).ok());
  double worst = 0;
  for (size_t t = 0; t < fx->prompt.size(); ++t)
    worst = std::max(worst, test::rel_l2(b.logits.data() + t * V, a.logits.data() + t * V, V));
  std::printf("  %s: chunks of 16 vs row path, worst rel L2 %.3g\n", fixture_name({GetParam(), 0}).c_str(), worst);
  EXPECT_LE(worst, kChunkTol);
  // Decoding after a chunked prefill continues from the same state.
  rows->commit(static_cast<int>(fx->prompt.size()));
  chunks->commit(static_cast<int>(fx->prompt.size()));
  int32_t tok[1] = {a.argmax.back()};
  ASSERT_TRUE(rows->step_rows(tok, false, true, &a).ok());
  ASSERT_TRUE(chunks->step_rows(tok, false, true, &b).ok());
  EXPECT_LE(test::rel_l2(b.logits.data(), a.logits.data(), V), kChunkTol);
}

TEST_P(CudaOracle, GreedyTokensMatchOracle) {
  SETUP();
  auto s = l.model->new_session(256);
  cuda::StepResult r;
  ASSERT_TRUE(s->step_rows(fx->prompt, false, false, &r).ok());
  s->commit(static_cast<int>(fx->prompt.size()));
  int32_t next = r.argmax.back();
  for (size_t i = 0; i < fx->greedy.size(); ++i) {
    if (fx->margins[i] > kMarginFloor) {
      ASSERT_EQ(next, fx->greedy[i]) << "greedy token " << i << " (oracle margin " << fx->margins[i] << ")";
    }  // below the margin the oracle's own choice is rounding noise; follow the oracle's token
    int32_t tok[1] = {fx->greedy[i]};
    ASSERT_TRUE(s->step_rows(tok, false, false, &r).ok());
    s->commit(1);
    next = r.argmax[0];
  }
}

TEST_P(CudaOracle, IncrementalDecodeEqualsFullForward) {
  SETUP();
  auto full = l.model->new_session(256);
  full->set_prefill_chunk(0);  // the row path: grouping rows must not change a bit (prefill chunks: own test)
  cuda::StepResult all, one;
  ASSERT_TRUE(full->step_rows(fx->prompt, false, true, &all).ok());
  auto inc = l.model->new_session(256);
  inc->set_prefill_chunk(0);
  size_t t = 0;
  for (size_t chunk = 1; t < fx->prompt.size(); ++chunk) {
    const size_t n = std::min(chunk % 11, fx->prompt.size() - t) + (chunk % 11 == 0);  // 1..10 rows, then 1
    ASSERT_TRUE(inc->step_rows(std::span(fx->prompt).subspan(t, n), false, true, &one).ok());
    inc->commit(static_cast<int>(n));
    for (size_t r = 0; r < n; ++r)
      ASSERT_LE(test::rel_l2(one.logits.data() + r * V, all.logits.data() + (t + r) * V, V), kSelfTol) << "position " << t + r;
    t += n;
  }
}

TEST_P(CudaOracle, StepRowsRollbackEqualsPlainDecode) {
  SETUP();
  const size_t half = fx->prompt.size() / 2;
  std::span<const int32_t> head(fx->prompt.data(), half);
  auto plain = l.model->new_session(256);
  plain->set_prefill_chunk(0);
  cuda::StepResult ref, r;
  ASSERT_TRUE(plain->step_rows(fx->prompt, false, true, &ref).ok());
  // After the head: steps of k true rows plus 3 wrong drafts, only the k accepted.
  auto spec = l.model->new_session(256);
  spec->set_prefill_chunk(0);
  ASSERT_TRUE(spec->step_rows(head, false, false, &r).ok());
  spec->commit(static_cast<int>(half));
  size_t t = half;
  int k = 1;
  while (t < fx->prompt.size()) {
    std::vector<int32_t> rows;
    const int n_true = std::min<int>(k, static_cast<int>(fx->prompt.size() - t));
    for (int i = 0; i < n_true; ++i) rows.push_back(fx->prompt[t + i]);
    for (int i = 0; i < 3; ++i) rows.push_back((fx->prompt[t] + 7 * (i + 1)) % static_cast<int32_t>(V));
    ASSERT_TRUE(spec->step_rows(rows, true, true, &r).ok());
    spec->commit(n_true);
    for (int i = 0; i < n_true; ++i)
      ASSERT_LE(test::rel_l2(r.logits.data() + i * V, ref.logits.data() + (t + i) * V, V), kSelfTol) << "position " << t + i;
    t += n_true;
    k = k % 5 + 1;
  }
  plain->commit(static_cast<int>(fx->prompt.size()));
  int32_t tok[1] = {fx->greedy.empty() ? 0 : fx->greedy[0]};
  cuda::StepResult a, b;
  ASSERT_TRUE(plain->step_rows(tok, false, true, &a).ok());
  ASSERT_TRUE(spec->step_rows(tok, false, true, &b).ok());
  EXPECT_LE(test::rel_l2(b.logits.data(), a.logits.data(), V), kSelfTol);
}

TEST_P(CudaOracle, ExpertPlacementDoesNotChangeLogits) {
  SETUP();
  std::vector<float> before[2];
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) l.model->permute_expert_slots(12345);
    for (int p = 0; p < 2; ++p) {
      auto s = l.model->new_session(256);
      s->set_prefill_chunk(kPaths[p].chunk);
      cuda::StepResult r;
      ASSERT_TRUE(s->step_rows(fx->prompt, false, true, &r).ok());
      if (pass == 0) before[p] = r.logits;
      else EXPECT_EQ(std::memcmp(before[p].data(), r.logits.data(), before[p].size() * sizeof(float)), 0)
          << kPaths[p].name << ": the logits changed when the experts moved to other slots";
    }
  }
}

TEST_P(CudaOracle, OutOfVocabularyTokenIsAnError) {
  SETUP();
  auto s = l.model->new_session(256);
  cuda::StepResult r;
  std::vector<int32_t> bad{1, static_cast<int32_t>(V)};
  Status st = s->step_rows(bad, false, false, &r);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("outside the vocabulary"), std::string::npos) << st.message();
}

#else
TEST_P(CudaOracle, NotBuilt) { GTEST_SKIP() << "this build has no CUDA engine"; }
#endif

INSTANTIATE_TEST_SUITE_P(Oracle, CudaOracle, ::testing::ValuesIn(all_fixtures()), fixture_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(CudaOracle);

}  // namespace
