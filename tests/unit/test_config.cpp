// config.json parsing and validation: both forms, derivations, and every rejection that
// transformers 5.17.0 makes (configuration_qwen4_exp.py validate_architecture), each naming the field.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "format/config.h"

using namespace ck;
using nlohmann::json;

namespace {

json base_text() {
  return json{{"model_type", "qwen4_exp_text"}, {"vocab_size", 256}, {"hidden_size", 64}, {"num_hidden_layers", 4},
              {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 32}, {"linear_key_head_dim", 16},
              {"linear_value_head_dim", 16}, {"linear_num_key_heads", 2}, {"linear_num_value_heads", 4},
              {"moe_intermediate_size", 32}, {"shared_expert_intermediate_size", 32}, {"num_experts", 8},
              {"num_experts_per_tok", 2}, {"hc_count", 3}, {"hc_lowrank", 16}, {"ple_layer_ids", {2}},
              {"ple_embed_dim", 64}, {"heads_per_ngram", 2}, {"ngram_vocab_size_base", 50}, {"indexer_n_heads", 2},
              {"indexer_kv_heads", 1}, {"indexer_head_dim", 32}, {"indexer_budget", 8}, {"indexer_compress_ratio", 4},
              {"eos_token_id", 3}, {"output_gate_type", "sigmoid"},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000.0}, {"partial_rotary_factor", 0.5}}}};
}

Result<ModelConfig> parse(const json& j) { return parse_config(j.dump(), "test/config.json"); }

void expect_error(const json& j, const std::string& needle) {
  auto r = parse(j);
  ASSERT_FALSE(r.ok()) << "accepted: " << j.dump();
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find("test/config.json"), std::string::npos) << r.status().message();
}

TEST(Config, FlatFormParsesAndDerives) {
  auto r = parse(base_text());
  ASSERT_TRUE(r.ok()) << r.status().message();
  const ModelConfig& c = *r;
  EXPECT_FALSE(c.nested);
  ASSERT_EQ(c.layer_types.size(), 4u);
  EXPECT_EQ(c.layer_types[3], LayerKind::SparseAttention);  // (i+1) % 4 == 0
  EXPECT_EQ(c.layer_types[0], LayerKind::LinearAttention);
  EXPECT_EQ(c.rotary_dim(), 16);
  EXPECT_EQ(c.ple_index_of_layer(1), 0);
  EXPECT_EQ(c.ple_index_of_layer(0), -1);
  EXPECT_EQ(c.wide(), 192);
  EXPECT_EQ(c.output_gate_type, "sigmoid");
}

TEST(Config, NestedFormReadsTextConfig) {
  json t = base_text();
  t.erase("model_type");
  json j{{"model_type", "qwen4_exp"}, {"text_config", t}, {"image_token_id", 248056}};
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->nested);
  EXPECT_EQ(r->hidden_size, 64);
}

TEST(Config, FullAttentionIsRenamedAndIntervalDerives) {
  json j = base_text();
  j["layer_types"] = {"linear_attention", "linear_attention", "full_attention", "qwen_sparse_attention"};
  j["ple_layer_ids"] = {1};
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->layer_types[2], LayerKind::SparseAttention);
  json k = base_text();
  k["full_attention_interval"] = 2;
  k["ple_layer_ids"] = {1};
  auto r2 = parse(k);
  ASSERT_TRUE(r2.ok()) << r2.status().message();
  EXPECT_EQ(r2->layer_types[1], LayerKind::SparseAttention);
  EXPECT_EQ(r2->layer_types[2], LayerKind::LinearAttention);
}

TEST(Config, RopeDefaultsAndTopLevelFallback) {
  json j = base_text();
  j.erase("rope_parameters");
  auto r = parse(j);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->partial_rotary_factor, 1.0);  // HF's fallback inside rope_parameters is 1.0
  EXPECT_EQ(r->rope_theta, 10000.0);
  j["partial_rotary_factor"] = 0.25;
  j["rope_theta"] = 1e7;
  r = parse(j);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->partial_rotary_factor, 0.25);
  EXPECT_EQ(r->rope_theta, 1e7);
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5e6}};
  r = parse(j);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->rope_theta, 5e6);             // the dict wins
  EXPECT_EQ(r->partial_rotary_factor, 0.25); // copied in where the dict lacks it
}

TEST(Config, RejectsWhatTheReferenceRejects) {
  json j;
  j = base_text(); j["model_type"] = "llama"; expect_error(j, "unknown architecture 'llama'");
  j = base_text(); j.erase("model_type"); expect_error(j, "model_type");
  j = base_text(); j["layer_types"] = {"linear_attention", "linear_attention", "linear_attention", "hybrid_indexed"};
  expect_error(j, "hybrid_indexed");
  j = base_text(); j["layer_types"] = {"linear_attention"}; expect_error(j, "layer_types has 1 entries");
  j = base_text(); j["output_gate_type"] = "relu"; expect_error(j, "output gate");
  j = base_text(); j["hc_count"] = 1; expect_error(j, "hc_count > 1");
  j = base_text(); j["num_experts"] = 0; j["num_experts_per_tok"] = 0; expect_error(j, "num_experts");
  j = base_text(); j["num_experts_per_tok"] = 9; expect_error(j, "num_experts_per_tok");
  j = base_text(); j["moe_intermediate_size"] = 0; expect_error(j, "moe_intermediate_size");
  j = base_text(); j.erase("indexer_budget"); expect_error(j, "indexer_budget");
  j = base_text(); j["indexer_kv_heads"] = 2; expect_error(j, "indexer_kv_heads=1");
  j = base_text(); j["indexer_budget"] = 10; expect_error(j, "divisible by indexer_compress_ratio");
  j = base_text(); j["indexer_head_dim"] = 8; expect_error(j, "rotary_dim");
  j = base_text(); j["indexer_n_heads"] = 0; expect_error(j, "positive");
  j = base_text(); j["ple_embed_dim"] = 62; expect_error(j, "ple_embed_dim");
  j = base_text(); j["ple_layer_ids"] = {5}; expect_error(j, "ple_layer_ids");
  j = base_text(); j["ple_layer_ids"] = {4}; expect_error(j, "only supported on linear_attention");
  j = base_text(); j.erase("eos_token_id"); expect_error(j, "eos_token_id");
  j = base_text(); j["eos_token_id"] = json::array(); expect_error(j, "eos_token_id");
  for (auto f : {"indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"})
    j.erase(f);
  expect_error(j, "eos_token_id");
  j = base_text();
  for (auto f : {"indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"})
    j.erase(f);
  expect_error(j, "no indexer");
}

TEST(Config, RejectsWrongTypes) {
  json j = base_text(); j["hidden_size"] = "64"; expect_error(j, "'hidden_size' must be an integer");
  j = base_text(); j["hidden_size"] = 64.5; expect_error(j, "'hidden_size' must be an integer");
  j = base_text(); j["norm_topk_prob"] = 1; expect_error(j, "'norm_topk_prob' must be true or false");
  j = base_text(); j["rms_norm_eps"] = "x"; expect_error(j, "rms_norm_eps");
  j = base_text(); j["ple_layer_ids"] = "2"; expect_error(j, "ple_layer_ids");
  j = base_text(); j["text_config"] = 5; j["model_type"] = "qwen4_exp"; expect_error(j, "text_config");
  j = base_text(); j["rope_parameters"]["rope_type"] = "yarn"; expect_error(j, "yarn");
  // Out of range: a cast would wrap (the fuzzer's 2,222,222,222,222,222,223 layers sized a vector).
  j = base_text(); j["num_hidden_layers"] = 2222222222222222223ull; expect_error(j, "'num_hidden_layers' is out of range");
  j = base_text(); j["hidden_size"] = -5000000000ll; expect_error(j, "'hidden_size' is out of range");
  j = base_text(); j["num_hidden_layers"] = 100000; expect_error(j, "num_hidden_layers must be at most 65536");
  auto fz = parse_config(R"({"model_type":"qwen4_exp_text","num_hidden_layers":2222222222222222223})", "test/config.json");
  ASSERT_FALSE(fz.ok());
  EXPECT_NE(fz.status().message().find("out of range"), std::string::npos) << fz.status().message();
  auto r = parse_config("{not json", "test/config.json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("invalid JSON"), std::string::npos);
  r = parse_config("[1,2]", "test/config.json");
  EXPECT_FALSE(r.ok());
}

TEST(Config, QuantizationBlock) {
  json j = base_text();
  j["quantization"] = {{"group_size", 64}, {"bits", 4}, {"language_model.model.layers.0.mlp.gate", {{"group_size", 64}, {"bits", 8}}},
                       {"language_model.model.layers.0.linear_attn.conv1d", false}};
  auto r = parse(j);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->quantization.present);
  EXPECT_EQ(r->quantization.for_module("language_model.model.layers.0.mlp.gate")->bits, 8);
  EXPECT_FALSE(r->quantization.for_module("language_model.model.layers.0.linear_attn.conv1d").has_value());
  EXPECT_EQ(r->quantization.for_module("x")->bits, 4);
  j["quantization"]["bits"] = 7;
  expect_error(j, "bits = 7");
}

}  // namespace
