// The qwen4_exp text configuration: every field of shared/spec/qwen4_exp.md §1, parsed from
// config.json in either form (`qwen4_exp` with `text_config`, or flat `qwen4_exp_text`), with the
// derivations (layer_types, rope_parameters) and validation of transformers 5.17.0's
// configuration_qwen4_exp.py (validate_architecture), so a config the reference rejects is rejected
// here with its reason. Also the MLX `quantization` block.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "util/status.h"

namespace ck {

enum class LayerKind { LinearAttention, SparseAttention };  // GDN, or QSA gated attention + indexer

struct QuantSpec {
  int bits = 4;
  int group_size = 64;
};

// MLX `quantization` block: a global spec plus per-module overrides (nullopt = left unquantized).
struct QuantConfig {
  bool present = false;
  QuantSpec global;
  std::map<std::string, std::optional<QuantSpec>> overrides;  // key: module path, e.g. "language_model.model.layers.0.mlp.gate"
  // The spec of a module given its path; nullopt when the module is explicitly unquantized.
  std::optional<QuantSpec> for_module(const std::string& module_path) const;
};

struct ModelConfig {
  std::string path;           // config.json it came from, for error messages
  std::string model_type;     // "qwen4_exp" or "qwen4_exp_text"
  bool nested = false;        // text fields under text_config

  int64_t vocab_size = 248320;
  int hidden_size = 2048;
  int num_hidden_layers = 40;
  int num_attention_heads = 16;
  int num_key_value_heads = 2;
  int head_dim = 256;
  std::string hidden_act = "silu";
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;

  // RoPE (rope_parameters; text positions make mRoPE a plain rotary).
  double rope_theta = 10000.0;
  double partial_rotary_factor = 1.0;

  // Gated DeltaNet.
  int linear_conv_kernel_dim = 4;
  int linear_key_head_dim = 128;
  int linear_value_head_dim = 128;
  int linear_num_key_heads = 16;
  int linear_num_value_heads = 32;
  std::string output_gate_type;  // resolved: "sigmoid" or "silu"

  // MoE.
  int num_experts = 512;
  int num_experts_per_tok = 10;
  int moe_intermediate_size = 512;
  int shared_expert_intermediate_size = 512;
  bool norm_topk_prob = true;

  // Hyper-connections.
  int hc_count = 4;
  int hc_lowrank = 320;

  // PLE.
  std::vector<int> ple_layer_ids;  // 1-based, sorted, unique (as HF's __post_init__ leaves them)
  int ple_embed_dim = 0;           // defaults to hidden_size
  int ple_conv_kernel_size = 4;
  int ngram_size = 3;
  int heads_per_ngram = 8;
  int64_t ngram_vocab_size_base = 20000000;
  int64_t make_ngram_vocab_size_divisible_by = 128;
  uint64_t seed = 1234;
  int split_ngram_parts = 512;

  // QSA indexer (all set or none).
  bool has_indexer = false;
  int indexer_n_heads = 0;
  int indexer_kv_heads = 0;
  int indexer_head_dim = 0;
  int indexer_budget = 0;
  int indexer_compress_ratio = 0;

  std::vector<LayerKind> layer_types;
  std::vector<int64_t> eos_token_ids;  // as given (int or list)

  // MTP (not an HF field; vendor configs carry it).
  int mtp_num_hidden_layers = 0;

  QuantConfig quantization;

  // Derived helpers.
  int rotary_dim() const { return static_cast<int>(head_dim * partial_rotary_factor); }
  int wide() const { return hc_count * hidden_size; }
  int gdn_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int gdn_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int gdn_conv_dim() const { return 2 * gdn_key_dim() + gdn_value_dim(); }
  int ngram_heads() const { return (ngram_size - 1) * heads_per_ngram; }
  int ngram_row_dim() const { return ple_embed_dim / ngram_heads(); }
  int64_t ple_eos() const { return eos_token_ids.empty() ? -1 : eos_token_ids[0]; }
  // 0-based decoder layer -> rank among PLE layers, or -1.
  int ple_index_of_layer(int layer) const;
};

// Parses and validates. `path` is a config.json file or a directory holding one.
Result<ModelConfig> load_config(const std::string& path);
Result<ModelConfig> parse_config(const std::string& json_text, const std::string& origin);

}  // namespace ck
