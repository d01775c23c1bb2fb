// The MTP head has no oracle (HF does not implement it), so these tests check its internal
// consistency: a checkpoint whose MTP head is built from the trunk's own tensors (fc_embedding = I,
// fc_hidden = 0, the attention layer and final mixer copied) must give exactly what the public layer
// pieces give for the same input; the head loads under both `mtp.` and `model.mtp.`; and its caches
// are positional (re-running a position after a rollback gives the same draft).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "../common/fixtures.h"
#include "../common/temp_dir.h"
#include "cpu/ops.h"
#include "cpu/qwen4_exp.h"
#include "format/weights.h"

using namespace ck;
using nlohmann::json;

namespace {

// Writes the given f32 tensors as one safetensors file.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>>& ts) {
  json h = json::object();
  std::string data;
  for (auto& [name, t] : ts) {
    size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(t.second.data()), t.second.size() * 4);
    h[name] = {{"dtype", "F32"}, {"shape", t.first}, {"data_offsets", {begin, data.size()}}};
  }
  std::string hs = h.dump();
  uint64_t n = hs.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  ASSERT_TRUE(write_file_atomic(path, out + hs + data).ok());
}

std::vector<float> as_f32(const TensorInfo& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) v[i] = load_float(t.dtype, t.data, static_cast<int64_t>(i));
  return v;
}

// A copy of a single-file HF fixture with an MTP head made of trunk tensors under `mtp_prefix`.
std::string build_mtp_checkpoint(const std::string& src, const std::string& mtp_prefix, int* attn_layer) {
  std::string dir = test::temp_dir("ck_mtp_");
  auto ck = open_checkpoint(src);
  EXPECT_TRUE(ck.ok());
  const ModelConfig& c = (*ck)->weights.cfg;
  *attn_layer = -1;
  for (int L = 0; L < c.num_hidden_layers; ++L)
    if (c.layer_types[L] == LayerKind::SparseAttention) { *attn_layer = L; break; }
  std::string lp = (*ck)->prefix + "layers." + std::to_string(*attn_layer) + ".";
  std::vector<std::pair<std::string, std::pair<std::vector<int64_t>, std::vector<float>>>> mtp;
  for (auto& [name, t] : (*ck)->tensors.all()) {
    if (name.rfind(lp, 0) == 0) mtp.push_back({mtp_prefix + "layers.0." + name.substr(lp.size()), {t.shape, as_f32(t)}});
    std::string mix = (*ck)->prefix + "hyper_connection_mixer.";
    if (name.rfind(mix, 0) == 0) mtp.push_back({mtp_prefix + "hyper_connection_mixer." + name.substr(mix.size()), {t.shape, as_f32(t)}});
  }
  const int64_t H = c.hidden_size, W = c.wide();
  std::vector<float> eye(H * H, 0.0f), zero(H * H, 0.0f);
  for (int64_t i = 0; i < H; ++i) eye[i * H + i] = 1.0f;
  mtp.push_back({mtp_prefix + "fc_embedding.weight", {{H, H}, eye}});
  mtp.push_back({mtp_prefix + "fc_hidden.weight", {{H, H}, zero}});
  mtp.push_back({mtp_prefix + "pre_fc_norm_embedding.weight", {{H}, std::vector<float>(H, 0.0f)}});
  mtp.push_back({mtp_prefix + "pre_fc_norm_hidden.weight", {{W}, std::vector<float>(W, 0.0f)}});
  write_safetensors(dir + "/mtp.safetensors", mtp);
  EXPECT_EQ(symlink((src + "/model.safetensors").c_str(), (dir + "/model.safetensors0").c_str()), 0);
  // An index that lists both files.
  json idx = {{"metadata", json::object()}, {"weight_map", json::object()}};
  for (auto& [name, t] : (*ck)->tensors.all()) idx["weight_map"][name] = "model.safetensors0";
  for (auto& t : mtp) idx["weight_map"][t.first] = "mtp.safetensors";
  EXPECT_TRUE(write_file_atomic(dir + "/model.safetensors.index.json", idx.dump()).ok());
  EXPECT_TRUE(write_file_atomic(dir + "/config.json", *read_file(src + "/config.json")).ok());
  return dir;
}

std::string hf_fixture() {
  for (auto& d : test::fixture_dirs("oracle"))
    if (file_exists(d + "/model.safetensors") && !file_exists(d + "/model.safetensors.index.json")) {
      auto ck = open_checkpoint(d);
      if (ck.ok() && (*ck)->layout != Layout::Mlx) return d;
    }
  return "";
}

TEST(Mtp, EqualsItsPiecesAndLoadsUnderBothPrefixes) {
  std::string src = hf_fixture();
  if (src.empty()) GTEST_SKIP() << "no single-file HF fixture";
  for (std::string prefix : {"mtp.", "model.mtp."}) {
    int attn_layer;
    std::string dir = build_mtp_checkpoint(src, prefix, &attn_layer);
    auto ck = open_checkpoint(dir);
    ASSERT_TRUE(ck.ok()) << ck.status().message();
    ASSERT_TRUE((*ck)->weights.mtp.has_value()) << "MTP head not found under " << prefix;
    cpu::Model model((*ck)->weights, (*ck)->experts);
    const ModelConfig& c = model.cfg();
    const int H = c.hidden_size, W = c.wide(), V = static_cast<int>(c.vocab_size);
    auto fx = test::load_fixture(src);
    ASSERT_TRUE(fx.ok());
    auto s = model.new_session();
    cpu::StepResult r;
    ASSERT_TRUE(s->step_rows(fx->prompt, false, false, &r).ok());
    s->commit(static_cast<int>(fx->prompt.size()));
    // Expected, from the pieces: R0 = [norm(E[x])]*S (fc_embedding = I, fc_hidden = 0), then the copied
    // attention layer, then the copied final mixer and the LM head. The MTP's own caches start empty.
    cpu::LayerState st;
    model.init_state(st, (*ck)->weights.layers[attn_layer]);
    std::vector<float> drafts(V), want(V), h_out(W), e(H), en(H), R(W), y(H);
    std::vector<float> ones(H, 1.0f);
    for (int t = 0; t < 8; ++t) {
      const int32_t x = fx->prompt[t + 1];
      ASSERT_TRUE(s->mtp_step(r.hidden.data() + t * W, x, t, drafts.data(), h_out.data()).ok());
      matrix_row((*ck)->weights.embed, x, e.data());
      cpu::rmsnorm_grouped(e.data(), H, H, ones.data(), static_cast<float>(c.rms_norm_eps), en.data());
      for (int k = 0; k < c.hc_count; ++k) std::memcpy(R.data() + k * H, en.data(), sizeof(float) * H);
      ASSERT_TRUE(model.layer_token((*ck)->weights.layers[attn_layer], c.num_hidden_layers, st, R.data(), x, t).ok());
      model.hc_mix((*ck)->weights.final_mixer, R.data(), y.data(), nullptr);
      cpu::matvec((*ck)->weights.lm_head, y.data(), want.data());
      EXPECT_LE(test::rel_l2(drafts.data(), want.data(), V), 1e-6) << prefix << " position " << t;
      EXPECT_LE(test::rel_l2(h_out.data(), R.data(), W), 1e-6) << prefix << " position " << t;
    }
    // Positional caches: redo position 5 after "rolling back" to it and get the same draft.
    std::vector<float> again(V);
    for (int t = 5; t < 8; ++t) {
      ASSERT_TRUE(s->mtp_step(r.hidden.data() + t * W, fx->prompt[t + 1], t, again.data(), h_out.data()).ok());
    }
    EXPECT_LE(test::rel_l2(again.data(), drafts.data(), V), 1e-6);
    // A bad draft token is an error, not a crash.
    EXPECT_FALSE(s->mtp_step(r.hidden.data(), V + 5, 0, again.data(), nullptr).ok());
  }
}

}  // namespace
