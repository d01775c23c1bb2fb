// config.json -> ModelConfig. The checks follow transformers 5.17.0 configuration_qwen4_exp.py
// (Qwen4ExpTextConfig.__post_init__ and validate_architecture); each error names the file and field.
#include "format/config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>

#include "util/json.h"

#include "util/file.h"

namespace ck {


std::optional<QuantSpec> QuantConfig::for_module(const std::string& module_path) const {
  auto it = overrides.find(module_path);
  if (it != overrides.end()) return it->second;
  return global;
}

int ModelConfig::ple_index_of_layer(int layer) const {
  for (size_t i = 0; i < ple_layer_ids.size(); ++i)
    if (ple_layer_ids[i] - 1 == layer) return static_cast<int>(i);
  return -1;
}

namespace {

// More layers than any model has or will: a bound before num_hidden_layers sizes anything.
constexpr int kMaxLayers = 65536;

// Typed field readers. HF's @strict dataclass rejects a value of the wrong type; so do we.
struct Reader {
  JsonRef obj;
  std::string origin;  // "config.json" or "config.json: text_config"

  Status bad(const std::string& key, const std::string& want) const {
    return error("{}: field '{}' must be {}, got {}", origin, key, want, obj[key].dump());
  }
  bool has(const std::string& key) const { return obj.contains(key) && !obj[key].is_null(); }

  template <typename T>
  Status get_int(const std::string& key, T* out, bool nullable = false) const {
    if (!obj.contains(key)) return {};
    JsonRef v = obj[key];
    if (v.is_null()) return nullable ? Status{} : bad(key, "an integer");
    if (!v.is_integer()) return bad(key, "an integer");
    // In T's range (a cast would wrap: 2^61 layers read as a plausible count).
    if (v.is_unsigned() ? v.as_uint() > static_cast<uint64_t>(std::numeric_limits<T>::max())
                        : v.as_int() < static_cast<int64_t>(std::numeric_limits<T>::min()))
      return error("{}: field '{}' is out of range for {}-bit integers, got {}", origin, key, 8 * sizeof(T), v.dump());
    *out = static_cast<T>(v.as_int());
    return {};
  }
  Status get_float(const std::string& key, double* out) const {
    if (!obj.contains(key)) return {};
    JsonRef v = obj[key];
    if (!v.is_number()) return bad(key, "a number");
    *out = v.as_double();
    return {};
  }
  Status get_bool(const std::string& key, bool* out) const {
    if (!obj.contains(key)) return {};
    JsonRef v = obj[key];
    if (!v.is_bool()) return bad(key, "true or false");
    *out = v.as_bool();
    return {};
  }
  Status get_string(const std::string& key, std::string* out, bool nullable = false) const {
    if (!obj.contains(key)) return {};
    JsonRef v = obj[key];
    if (v.is_null() && nullable) return {};
    if (!v.is_string()) return bad(key, "a string");
    *out = v.as_string();
    return {};
  }
};

Status parse_quantization(JsonRef q, const std::string& origin, QuantConfig* out) {
  if (!q.is_object()) return error("{}: 'quantization' must be an object", origin);
  out->present = true;
  auto spec_of = [&](JsonRef v, const std::string& where, QuantSpec* s) -> Status {
    if (v.contains("bits")) {
      if (!v["bits"].is_integer()) return error("{}: {}.bits must be an integer", origin, where);
      s->bits = static_cast<int>(v["bits"].as_int());
    }
    if (v.contains("group_size")) {
      if (!v["group_size"].is_integer()) return error("{}: {}.group_size must be an integer", origin, where);
      s->group_size = static_cast<int>(v["group_size"].as_int());
    }
    if (s->bits != 2 && s->bits != 3 && s->bits != 4 && s->bits != 5 && s->bits != 6 && s->bits != 8)
      return error("{}: {}.bits = {} is not an MLX affine width (2, 3, 4, 5, 6, 8)", origin, where, s->bits);
    if (s->group_size != 32 && s->group_size != 64 && s->group_size != 128)
      return error("{}: {}.group_size = {} is not 32, 64 or 128", origin, where, s->group_size);
    return {};
  };
  TRY(spec_of(q, "quantization", &out->global));
  for (const auto& [key, value] : q.members()) {
    if (key == "bits" || key == "group_size" || key == "mode" || key == "quant_method") continue;
    if (value.is_bool()) {
      if (!value.as_bool()) out->overrides[key] = std::nullopt;
      else out->overrides[key] = out->global;
    } else if (value.is_object()) {
      QuantSpec s = out->global;
      TRY(spec_of(value, "quantization['" + key + "']", &s));
      out->overrides[key] = s;
    }
  }
  if (q["mode"].is_string() && q["mode"].as_string() != "affine")
    return error("{}: quantization mode '{}' is not supported (only MLX affine)", origin, q["mode"].as_string());
  return {};
}

Status parse_text(JsonRef t, const std::string& origin, ModelConfig* c) {
  Reader r{t, origin};
  TRY(r.get_int("vocab_size", &c->vocab_size));
  TRY(r.get_int("hidden_size", &c->hidden_size));
  TRY(r.get_int("num_hidden_layers", &c->num_hidden_layers));
  // Bounded before anything is sized by it (layer_types below, the weights' names later).
  if (c->num_hidden_layers > kMaxLayers)
    return error("{}: num_hidden_layers must be at most {}, got {}", origin, kMaxLayers, c->num_hidden_layers);
  TRY(r.get_int("num_attention_heads", &c->num_attention_heads));
  TRY(r.get_int("num_key_value_heads", &c->num_key_value_heads));
  TRY(r.get_int("head_dim", &c->head_dim));
  TRY(r.get_string("hidden_act", &c->hidden_act));
  TRY(r.get_float("rms_norm_eps", &c->rms_norm_eps));
  TRY(r.get_bool("tie_word_embeddings", &c->tie_word_embeddings));
  TRY(r.get_int("linear_conv_kernel_dim", &c->linear_conv_kernel_dim));
  TRY(r.get_int("linear_key_head_dim", &c->linear_key_head_dim));
  TRY(r.get_int("linear_value_head_dim", &c->linear_value_head_dim));
  TRY(r.get_int("linear_num_key_heads", &c->linear_num_key_heads));
  TRY(r.get_int("linear_num_value_heads", &c->linear_num_value_heads));
  TRY(r.get_int("num_experts", &c->num_experts));
  TRY(r.get_int("num_experts_per_tok", &c->num_experts_per_tok));
  TRY(r.get_int("moe_intermediate_size", &c->moe_intermediate_size));
  TRY(r.get_int("shared_expert_intermediate_size", &c->shared_expert_intermediate_size));
  TRY(r.get_bool("norm_topk_prob", &c->norm_topk_prob));
  TRY(r.get_int("hc_count", &c->hc_count));
  TRY(r.get_int("hc_lowrank", &c->hc_lowrank));
  TRY(r.get_int("ple_conv_kernel_size", &c->ple_conv_kernel_size));
  TRY(r.get_int("ngram_size", &c->ngram_size));
  TRY(r.get_int("heads_per_ngram", &c->heads_per_ngram));
  TRY(r.get_int("ngram_vocab_size_base", &c->ngram_vocab_size_base));
  TRY(r.get_int("make_ngram_vocab_size_divisible_by", &c->make_ngram_vocab_size_divisible_by));
  TRY(r.get_int("seed", &c->seed));
  TRY(r.get_int("split_ngram_parts", &c->split_ngram_parts));
  TRY(r.get_int("mtp_num_hidden_layers", &c->mtp_num_hidden_layers, true));

  // Output gate: `output_gate_type or hidden_act`.
  std::string gate;
  TRY(r.get_string("output_gate_type", &gate, true));
  c->output_gate_type = gate.empty() ? c->hidden_act : gate;

  // PLE ids: HF sorts and de-duplicates; ple_embed_dim defaults to hidden_size.
  if (r.has("ple_layer_ids")) {
    JsonRef ids = t["ple_layer_ids"];
    if (!ids.is_array()) return r.bad("ple_layer_ids", "a list of integers");
    std::set<int> uniq;
    for (JsonRef v : ids.elements()) {
      if (!v.is_integer()) return r.bad("ple_layer_ids", "a list of integers");
      uniq.insert(static_cast<int>(v.as_int()));
    }
    c->ple_layer_ids.assign(uniq.begin(), uniq.end());
  }
  c->ple_embed_dim = c->hidden_size;
  TRY(r.get_int("ple_embed_dim", &c->ple_embed_dim, true));

  // Indexer: five optional fields, all or none.
  const char* qsa_fields[] = {"indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                              "indexer_compress_ratio"};
  int* qsa_values[] = {&c->indexer_n_heads, &c->indexer_kv_heads, &c->indexer_head_dim, &c->indexer_budget,
                       &c->indexer_compress_ratio};
  std::vector<std::string> missing;
  int n_set = 0;
  for (int i = 0; i < 5; ++i) {
    if (r.has(qsa_fields[i])) {
      TRY(r.get_int(qsa_fields[i], qsa_values[i]));
      ++n_set;
    } else {
      missing.push_back(qsa_fields[i]);
    }
  }
  c->has_indexer = n_set > 0;

  // RoPE: rope_parameters, with a top-level rope_theta / partial_rotary_factor copied in only
  // where the dict lacks the key (transformers 5.17.0 standardisation).
  std::string rope_type = "default";
  if (r.has("rope_theta")) TRY(r.get_float("rope_theta", &c->rope_theta));
  if (r.has("partial_rotary_factor")) TRY(r.get_float("partial_rotary_factor", &c->partial_rotary_factor));
  if (r.has("rope_parameters")) {
    JsonRef rp = t["rope_parameters"];
    if (!rp.is_object()) return r.bad("rope_parameters", "an object");
    Reader rr{rp, origin + ": rope_parameters"};
    TRY(rr.get_float("rope_theta", &c->rope_theta));
    TRY(rr.get_float("partial_rotary_factor", &c->partial_rotary_factor));
    TRY(rr.get_string("rope_type", &rope_type));
    if (rp.contains("type") && !rp.contains("rope_type")) TRY(rr.get_string("type", &rope_type));
  } else if (!r.has("partial_rotary_factor")) {
    c->partial_rotary_factor = 1.0;
  }
  if (rope_type != "default")
    return error("{}: rope_parameters.rope_type '{}' is not supported (only 'default')", origin, rope_type);
  if (!(c->rope_theta > 0)) return error("{}: rope_theta must be > 0, got {}", origin, c->rope_theta);
  if (!(c->partial_rotary_factor > 0 && c->partial_rotary_factor <= 1))
    return error("{}: partial_rotary_factor must be in (0, 1], got {}", origin, c->partial_rotary_factor);

  // layer_types: given (with "full_attention" renamed), or derived from full_attention_interval.
  if (r.has("layer_types")) {
    JsonRef lt = t["layer_types"];
    if (!lt.is_array()) return r.bad("layer_types", "a list of strings");
    std::vector<std::string> unsupported;
    for (JsonRef v : lt.elements()) {
      if (!v.is_string()) return r.bad("layer_types", "a list of strings");
      const std::string& s = v.as_string();
      if (s == "linear_attention") c->layer_types.push_back(LayerKind::LinearAttention);
      else if (s == "qwen_sparse_attention" || s == "full_attention") c->layer_types.push_back(LayerKind::SparseAttention);
      else unsupported.push_back(s);
    }
    if (!unsupported.empty()) {
      std::sort(unsupported.begin(), unsupported.end());
      unsupported.erase(std::unique(unsupported.begin(), unsupported.end()), unsupported.end());
      std::string list;
      for (auto& s : unsupported) list += (list.empty() ? "'" : ", '") + s + "'";
      return error("{}: layer_types: unsupported Qwen4-Exp layer types [{}] (accepted: linear_attention, "
                   "qwen_sparse_attention, full_attention)", origin, list);
    }
  } else {
    int interval = 4;
    TRY(r.get_int("full_attention_interval", &interval));
    if (interval <= 0) return error("{}: full_attention_interval must be > 0, got {}", origin, interval);
    for (int i = 0; i < c->num_hidden_layers; ++i)
      c->layer_types.push_back((i + 1) % interval ? LayerKind::LinearAttention : LayerKind::SparseAttention);
  }

  // eos_token_id: int or list.
  if (r.has("eos_token_id")) {
    JsonRef e = t["eos_token_id"];
    if (e.is_integer()) c->eos_token_ids.push_back(e.as_int());
    else if (e.is_array()) {
      for (JsonRef v : e.elements()) {
        if (!v.is_integer()) return r.bad("eos_token_id", "an integer or a list of integers");
        c->eos_token_ids.push_back(v.as_int());
      }
    } else {
      return r.bad("eos_token_id", "an integer or a list of integers");
    }
  }

  // ---- validate_architecture (5.17.0), then the engine's own limits ----
  auto positive = [&](const char* name, int64_t v) -> Status {
    if (v <= 0) return error("{}: {} must be > 0, got {}", origin, name, v);
    return {};
  };
  TRY(positive("vocab_size", c->vocab_size));
  TRY(positive("hidden_size", c->hidden_size));
  TRY(positive("num_hidden_layers", c->num_hidden_layers));
  if (static_cast<int>(c->layer_types.size()) != c->num_hidden_layers)
    return error("{}: layer_types has {} entries but num_hidden_layers is {}", origin, c->layer_types.size(),
                 c->num_hidden_layers);
  if (c->output_gate_type != "sigmoid" && c->output_gate_type != "silu")
    return error("{}: unsupported Qwen4-Exp output gate activation '{}' (output_gate_type or hidden_act must be "
                 "sigmoid or silu)", origin, c->output_gate_type);
  if (c->hidden_act != "silu")
    return error("{}: hidden_act '{}' is not supported (the experts and the GDN conv use silu)", origin, c->hidden_act);
  if (c->hc_count <= 1) return error("{}: Qwen4-Exp requires hc_count > 1, got {}", origin, c->hc_count);
  if (c->num_experts <= 0) return error("{}: num_experts must be > 0, got {}", origin, c->num_experts);
  if (!(0 < c->num_experts_per_tok && c->num_experts_per_tok <= c->num_experts))
    return error("{}: num_experts_per_tok must be in [1, num_experts], got {} and {}", origin, c->num_experts_per_tok,
                 c->num_experts);
  if (c->moe_intermediate_size <= 0 || c->shared_expert_intermediate_size <= 0)
    return error("{}: moe_intermediate_size and shared_expert_intermediate_size must be > 0", origin);
  if (c->has_indexer) {
    if (!missing.empty()) {
      std::string list;
      for (auto& s : missing) list += (list.empty() ? "" : ", ") + s;
      return error("{}: QSA config is missing required fields: {}", origin, list);
    }
    for (int i = 0; i < 5; ++i)
      if (*qsa_values[i] <= 0) return error("{}: QSA config values must be positive: {} = {}", origin, qsa_fields[i], *qsa_values[i]);
    if (c->indexer_kv_heads != 1) return error("{}: Qwen4-Exp QSA requires indexer_kv_heads=1, got {}", origin, c->indexer_kv_heads);
    if (c->indexer_budget % c->indexer_compress_ratio != 0)
      return error("{}: indexer_budget ({}) must be divisible by indexer_compress_ratio ({})", origin, c->indexer_budget,
                   c->indexer_compress_ratio);
    if (c->rotary_dim() > c->indexer_head_dim)
      return error("{}: attention RoPE dimensions must fit the QSA index head: rotary_dim={}, indexer_head_dim={}", origin,
                   c->rotary_dim(), c->indexer_head_dim);
  }
  if (!c->ple_layer_ids.empty()) {
    int heads = c->ngram_heads();
    if (heads <= 0 || c->ple_embed_dim <= 0 || c->ple_embed_dim % heads != 0)
      return error("{}: ple_embed_dim and the number of n-gram heads must be positive, and ple_embed_dim must be "
                   "divisible by the number of heads: {} % {} != 0", origin, c->ple_embed_dim, heads);
    for (int id : c->ple_layer_ids)
      if (id < 1 || id > c->num_hidden_layers)
        return error("{}: ple_layer_ids must contain one-indexed ids in [1, {}], got {}", origin, c->num_hidden_layers, id);
    for (int id : c->ple_layer_ids)
      if (c->layer_types[id - 1] != LayerKind::LinearAttention)
        return error("{}: Qwen4-Exp PLE is only supported on linear_attention layers, got PLE on layer {}", origin, id);
    if (c->eos_token_ids.empty())
      return error("{}: eos_token_id must be set when Qwen4-Exp PLE layers are enabled", origin);
  }
  // HF 5.17.0 builds an indexer in every attention layer; without the indexer fields, model
  // construction fails. There is no dense-attention fallback.
  bool any_attention = std::count(c->layer_types.begin(), c->layer_types.end(), LayerKind::SparseAttention) > 0;
  if (any_attention && !c->has_indexer)
    return error("{}: the model has attention layers but no indexer_* fields (QSA is required; there is no dense "
                 "fallback)", origin);
  // Shapes the engine relies on.
  TRY(positive("num_attention_heads", c->num_attention_heads));
  TRY(positive("num_key_value_heads", c->num_key_value_heads));
  TRY(positive("head_dim", c->head_dim));
  if (c->num_attention_heads % c->num_key_value_heads != 0)
    return error("{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", origin,
                 c->num_attention_heads, c->num_key_value_heads);
  TRY(positive("linear_num_key_heads", c->linear_num_key_heads));
  TRY(positive("linear_num_value_heads", c->linear_num_value_heads));
  TRY(positive("linear_key_head_dim", c->linear_key_head_dim));
  TRY(positive("linear_value_head_dim", c->linear_value_head_dim));
  TRY(positive("linear_conv_kernel_dim", c->linear_conv_kernel_dim));
  TRY(positive("hc_lowrank", c->hc_lowrank));
  if (c->linear_num_value_heads % c->linear_num_key_heads != 0)
    return error("{}: linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})", origin,
                 c->linear_num_value_heads, c->linear_num_key_heads);
  if (c->rotary_dim() % 2 != 0 || c->rotary_dim() <= 0)
    return error("{}: rotary dimension int(head_dim * partial_rotary_factor) = {} must be even and > 0", origin, c->rotary_dim());
  if (!c->ple_layer_ids.empty()) {
    TRY(positive("ple_conv_kernel_size", c->ple_conv_kernel_size));
    TRY(positive("ngram_vocab_size_base", c->ngram_vocab_size_base));
    TRY(positive("make_ngram_vocab_size_divisible_by", c->make_ngram_vocab_size_divisible_by));
    if (c->ngram_size < 2) return error("{}: ngram_size must be >= 2, got {}", origin, c->ngram_size);
  }
  return {};
}

}  // namespace

Result<ModelConfig> parse_config(const std::string& json_text, const std::string& origin) {
  Result<JsonDoc> parsed = parse_json(json_text);
  if (!parsed.ok()) return error("{}: invalid JSON: {}", origin, parsed.status().message());
  const JsonDoc& j = *parsed;
  if (!j.is_object()) return error("{}: top level must be a JSON object", origin);
  ModelConfig c;
  c.path = origin;
  if (!j["model_type"].is_string())
    return error("{}: missing 'model_type' (expected 'qwen4_exp' or 'qwen4_exp_text')", origin);
  c.model_type = j["model_type"].as_string();
  JsonRef text = j;
  std::string text_origin = origin;
  if (c.model_type == "qwen4_exp") {
    c.nested = true;
    static const JsonDoc empty = JsonDoc::object();
    if (!j["text_config"].is_null()) {
      if (!j["text_config"].is_object()) return error("{}: 'text_config' must be an object", origin);
      text = j["text_config"];
    } else {
      text = empty;
    }
    text_origin = origin + ": text_config";
    if (text.contains("model_type") && !(text["model_type"] == "qwen4_exp_text"))
      return error("{}: model_type is {} (expected 'qwen4_exp_text')", text_origin, text["model_type"].dump());
  } else if (c.model_type != "qwen4_exp_text") {
    return error("{}: unknown architecture '{}' (expected model_type 'qwen4_exp' or 'qwen4_exp_text')", origin,
                 c.model_type);
  }
  // A top-level tie_word_embeddings applies to the nested form unless the text config says otherwise.
  if (c.nested && j["tie_word_embeddings"].is_bool()) c.tie_word_embeddings = j["tie_word_embeddings"].as_bool();
  TRY(parse_text(text, text_origin, &c));
  // MTP depth may sit at the top level in vendor configs.
  if (c.mtp_num_hidden_layers == 0 && j["mtp_num_hidden_layers"].is_integer())
    c.mtp_num_hidden_layers = static_cast<int>(j["mtp_num_hidden_layers"].as_int());
  if (c.mtp_num_hidden_layers < 0 || c.mtp_num_hidden_layers > 1)
    return error("{}: mtp_num_hidden_layers = {} (only 0 or 1 is supported)", origin, c.mtp_num_hidden_layers);
  for (const char* key : {"quantization", "quantization_config"}) {
    if (j[key].is_object() && !c.quantization.present) {
      JsonRef q = j[key];
      if (q["quant_method"].is_string() && !(q["quant_method"] == "mlx")) {
        return error("{}: {}.quant_method '{}' is not supported (MLX affine only)", origin, key,
                     q["quant_method"].as_string());
      }
      TRY(parse_quantization(q, origin, &c.quantization));
    }
  }
  return c;
}

Result<ModelConfig> load_config(const std::string& path) {
  std::string file = is_directory(path) ? join_path(path, "config.json") : path;
  ASSIGN_OR_RETURN(std::string text, read_file(file));
  return parse_config(text, file);
}

}  // namespace ck
