// The CPU reference against the Hugging Face oracle fixtures (tests/fixtures/oracle/*): logits at
// every prompt position, greedy tokens, incremental decode and step_rows/commit rollback.
// Tolerance: relative L2 1e-4 per position. Both sides compute in fp32; the remaining difference
// is accumulation order (GEMM blocking, chunked vs recurrent DeltaNet), measured at ~1e-6.
#include <gtest/gtest.h>

#include <cstring>

#include "../common/fixtures.h"
#include "cpu/qwen4_exp.h"

using namespace ck;

namespace {

constexpr double kLogitTol = 1e-4;

struct Loaded {
  std::unique_ptr<Checkpoint> ck;
  std::unique_ptr<cpu::Model> model;
};

Loaded load(const std::string& dir) {
  Loaded l;
  auto ck = open_checkpoint(dir);
  EXPECT_TRUE(ck.ok()) << ck.status().message();
  if (!ck.ok()) return l;
  l.ck = std::move(ck).value();
  l.model = std::make_unique<cpu::Model>(l.ck->weights, l.ck->experts);
  return l;
}

class OracleFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(OracleFixture, PromptLogitsMatchOracle) {
  auto fx = test::load_fixture(GetParam());
  ASSERT_TRUE(fx.ok()) << fx.status().message();
  Loaded l = load(GetParam());
  ASSERT_TRUE(l.model);
  const int64_t V = l.model->cfg().vocab_size;
  ASSERT_EQ(fx->logits.size(), fx->prompt.size() * V);
  auto s = l.model->new_session();
  cpu::StepResult r;
  ASSERT_TRUE(s->step_rows(fx->prompt, false, true, &r).ok());
  std::vector<std::string> bad;
  double worst = 0;
  for (size_t t = 0; t < fx->prompt.size(); ++t) {
    double e = test::rel_l2(r.logits.data() + t * V, fx->logits.data() + t * V, V);
    worst = std::max(worst, e);
    if (!(e <= kLogitTol)) bad.push_back("position " + std::to_string(t) + ": rel L2 " + std::to_string(e));
  }
  std::string all;
  for (auto& b : bad) all += b + "\n";
  EXPECT_TRUE(bad.empty()) << bad.size() << " positions over " << kLogitTol << ":\n" << all;
  std::printf("  %s: worst rel L2 %.3g over %zu positions\n", GetParam().c_str(), worst, fx->prompt.size());
}

TEST_P(OracleFixture, GreedyTokensMatchOracle) {
  auto fx = test::load_fixture(GetParam());
  ASSERT_TRUE(fx.ok()) << fx.status().message();
  Loaded l = load(GetParam());
  ASSERT_TRUE(l.model);
  auto s = l.model->new_session();
  test::expect_greedy_tokens<cpu::StepResult>(*s, *fx);
}

TEST_P(OracleFixture, IncrementalDecodeEqualsFullForward) {
  auto fx = test::load_fixture(GetParam());
  ASSERT_TRUE(fx.ok());
  Loaded l = load(GetParam());
  ASSERT_TRUE(l.model);
  const int64_t V = l.model->cfg().vocab_size;
  auto full = l.model->new_session();
  cpu::StepResult all, one;
  ASSERT_TRUE(full->step_rows(fx->prompt, false, true, &all).ok());
  // Feed the prompt in uneven chunks (1, 2, 3, ... tokens) with commits in between.
  auto inc = l.model->new_session();
  size_t t = 0;
  for (size_t chunk = 1; t < fx->prompt.size(); ++chunk) {
    size_t n = std::min(chunk, fx->prompt.size() - t);
    ASSERT_TRUE(inc->step_rows(std::span(fx->prompt).subspan(t, n), false, true, &one).ok());
    inc->commit(static_cast<int>(n));
    for (size_t r = 0; r < n; ++r)
      ASSERT_LE(test::rel_l2(one.logits.data() + r * V, all.logits.data() + (t + r) * V, V), 1e-6) << "position " << t + r;
    t += n;
  }
}

// RowOutputs::kLast (a prompt's prefill): one output row, equal to the last row of a full step, and
// the same state afterwards.
TEST_P(OracleFixture, LastRowOutputsEqualTheFullStepsLastRow) {
  auto fx = test::load_fixture(GetParam());
  ASSERT_TRUE(fx.ok());
  Loaded l = load(GetParam());
  ASSERT_TRUE(l.model);
  const int64_t V = l.model->cfg().vocab_size, W = l.model->cfg().wide();
  const size_t T = fx->prompt.size();
  auto full = l.model->new_session();
  auto last = l.model->new_session();
  cpu::StepResult a, b;
  ASSERT_TRUE(full->step_rows(fx->prompt, false, true, &a).ok());
  ASSERT_TRUE(last->step_rows(fx->prompt, false, true, &b, cpu::RowOutputs::kLast).ok());
  ASSERT_EQ(b.argmax.size(), 1u);
  ASSERT_EQ(b.logits.size(), static_cast<size_t>(V));
  ASSERT_EQ(b.hidden.size(), static_cast<size_t>(W));
  EXPECT_EQ(b.argmax[0], a.argmax.back());
  EXPECT_EQ(0, std::memcmp(b.logits.data(), a.logits.data() + (T - 1) * V, sizeof(float) * V));
  EXPECT_EQ(0, std::memcmp(b.hidden.data(), a.hidden.data() + (T - 1) * W, sizeof(float) * W));
  full->commit(static_cast<int>(T));
  last->commit(static_cast<int>(T));
  int32_t tok[1] = {a.argmax.back()};
  ASSERT_TRUE(full->step_rows(tok, false, true, &a).ok());
  ASSERT_TRUE(last->step_rows(tok, false, true, &b).ok());
  EXPECT_EQ(0, std::memcmp(b.logits.data(), a.logits.data(), sizeof(float) * V));
}

TEST_P(OracleFixture, StepRowsRollbackEqualsPlainDecode) {
  auto fx = test::load_fixture(GetParam());
  ASSERT_TRUE(fx.ok());
  Loaded l = load(GetParam());
  ASSERT_TRUE(l.model);
  const int64_t V = l.model->cfg().vocab_size;
  const size_t half = fx->prompt.size() / 2;
  std::span<const int32_t> head(fx->prompt.data(), half);
  // Plain: the whole prompt one row at a time.
  auto plain = l.model->new_session();
  cpu::StepResult ref, r;
  ASSERT_TRUE(plain->step_rows(fx->prompt, false, true, &ref).ok());
  // Speculative: after the head, run 4 rows of which only the first k are accepted (the others
  // carry wrong "draft" tokens), then continue; every accepted row must equal the plain run.
  auto spec = l.model->new_session();
  ASSERT_TRUE(spec->step_rows(head, false, false, &r).ok());
  spec->commit(static_cast<int>(half));
  size_t t = half;
  int k = 1;
  while (t < fx->prompt.size()) {
    std::vector<int32_t> rows;
    int n_true = std::min<int>(k, static_cast<int>(fx->prompt.size() - t));
    for (int i = 0; i < n_true; ++i) rows.push_back(fx->prompt[t + i]);
    for (int i = 0; i < 3; ++i) rows.push_back((fx->prompt[t] + 7 * (i + 1)) % static_cast<int32_t>(V));  // wrong drafts
    ASSERT_TRUE(spec->step_rows(rows, true, true, &r).ok());
    spec->commit(n_true);
    for (int i = 0; i < n_true; ++i)
      ASSERT_LE(test::rel_l2(r.logits.data() + i * V, ref.logits.data() + (t + i) * V, V), 1e-6) << "position " << t + i;
    t += n_true;
    k = k % 3 + 1;
  }
  // And the state after all that still decodes like the plain session.
  plain->commit(static_cast<int>(fx->prompt.size()));
  int32_t tok[1] = {fx->greedy.empty() ? 0 : fx->greedy[0]};
  cpu::StepResult a, b;
  ASSERT_TRUE(plain->step_rows(tok, false, true, &a).ok());
  ASSERT_TRUE(spec->step_rows(tok, false, true, &b).ok());
  EXPECT_LE(test::rel_l2(b.logits.data(), a.logits.data(), V), 1e-6);
}

TEST_P(OracleFixture, OutOfVocabularyTokenIsAnError) {
  Loaded l = load(GetParam());
  ASSERT_TRUE(l.model);
  auto s = l.model->new_session();
  cpu::StepResult r;
  std::vector<int32_t> bad{1, static_cast<int32_t>(l.model->cfg().vocab_size)};
  Status st = s->step_rows(bad, false, false, &r);
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("outside the vocabulary"), std::string::npos) << st.message();
}

std::vector<std::string> all_fixtures() {
  auto v = test::fixture_dirs("oracle");
  return v;
}

std::string fixture_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param.substr(info.param.find_last_of('/') + 1);
  for (char& c : n)
    if (!isalnum(static_cast<unsigned char>(c))) c = '_';
  return n;
}

INSTANTIATE_TEST_SUITE_P(Oracle, OracleFixture, ::testing::ValuesIn(all_fixtures()), fixture_name);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(OracleFixture);

TEST(OracleFixtures, ArePresent) { EXPECT_GE(all_fixtures().size(), 4u) << "tests/fixtures/oracle/ lacks fixtures"; }

}  // namespace
