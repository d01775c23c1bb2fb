// The embedded default model (models/cherenkov-tiny, MLX 4-bit) against the fixture its training
// script wrote with its own PyTorch model on the dequantized weights (tests/fixtures/small_model):
// trunk logits at every prompt position, greedy tokens, and the MTP head's draft logits, which no
// Hugging Face oracle has (tools/small_model_arch.py is their reference).
#include <gtest/gtest.h>

#include "../common/fixtures.h"
#include "../common/temp_dir.h"
#include "cpu/qwen4_exp.h"
#include "store/pack.h"
#include "store/store.h"

#include <unistd.h>

using namespace ck;

namespace {

const std::string kModel = test::source_dir() + "/models/cherenkov-tiny";
const std::string kFixture = test::source_dir() + "/tests/fixtures/small_model";

// Checks trunk logits, MTP drafts and greedy tokens of `model` against the fixture.
void check_against_fixture(const cpu::Model& model, const test::Fixture* fx_in);

TEST(SmallModel, TrunkAndMtpMatchTheTrainingReference) {
  auto fx = test::load_fixture(kFixture);
  ASSERT_TRUE(fx.ok()) << fx.status().message();
  auto ck = open_checkpoint(kModel);
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  ASSERT_EQ((*ck)->layout, Layout::Mlx);
  ASSERT_TRUE((*ck)->weights.mtp.has_value());
  cpu::Model model((*ck)->weights, (*ck)->experts);
  check_against_fixture(model, &*fx);
}

// The same model packed into a store (dense.bin, experts.bin read on demand, ngram.bin).
TEST(SmallModel, PackedStoreMatchesTheTrainingReference) {
  auto fx = test::load_fixture(kFixture);
  ASSERT_TRUE(fx.ok()) << fx.status().message();
  std::string dir = test::temp_dir("ck_small_store_") + "/store";
  store::PackOptions o;
  o.src = kModel;
  o.out = dir;
  o.sync = false;
  auto rep = store::pack_store(o);
  ASSERT_TRUE(rep.ok()) << rep.status().message();
  store::StoreOptions so;
  so.verify = store::VerifyReads::Always;
  auto st = store::open_store(dir, so);
  ASSERT_TRUE(st.ok()) << st.status().message();
  ASSERT_TRUE((*st)->weights.mtp.has_value());
  cpu::Model model((*st)->weights, (*st)->experts);
  check_against_fixture(model, &*fx);
}

void check_against_fixture(const cpu::Model& model, const test::Fixture* fx) {
  const int64_t V = model.cfg().vocab_size, W = model.cfg().wide();
  const size_t T = fx->prompt.size();
  auto s = model.new_session();
  cpu::StepResult r;
  ASSERT_TRUE(s->step_rows(fx->prompt, false, true, &r).ok());
  s->commit(static_cast<int>(T));
  double worst = 0;
  for (size_t t = 0; t < T; ++t) {
    double e = test::rel_l2(r.logits.data() + t * V, fx->logits.data() + t * V, V);
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-4) << "trunk position " << t;
  }
  std::printf("  trunk: worst rel L2 %.3g over %zu positions\n", worst, T);
  // MTP: row t drafts from (R_last[t], x_{t+1}) at position t.
  ASSERT_EQ(fx->mtp_logits.size(), (T - 1) * V);
  std::vector<float> draft(V), h(W);
  double mtp_worst = 0;
  for (size_t t = 0; t + 1 < T; ++t) {
    ASSERT_TRUE(s->mtp_step(r.hidden.data() + t * W, fx->prompt[t + 1], static_cast<int64_t>(t), draft.data(), h.data()).ok());
    double e = test::rel_l2(draft.data(), fx->mtp_logits.data() + t * V, V);
    mtp_worst = std::max(mtp_worst, e);
    EXPECT_LE(e, 1e-4) << "MTP position " << t;
  }
  std::printf("  MTP: worst rel L2 %.3g over %zu positions\n", mtp_worst, T - 1);
  // Greedy continuation, where the reference's margin is clear.
  int32_t next = r.argmax.back();
  for (size_t i = 0; i < fx->greedy.size(); ++i) {
    if (fx->margins[i] > 1e-3f) {
      ASSERT_EQ(next, fx->greedy[i]) << "greedy token " << i;
    }
    int32_t tok[1] = {fx->greedy[i]};
    ASSERT_TRUE(s->step_rows(tok, false, false, &r).ok());
    s->commit(1);
    next = r.argmax[0];
  }
}

}  // namespace
