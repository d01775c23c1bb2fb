// Tensor-name resolution for every accepted layout (docs/formats.md) and the shape checks that turn
// a wrong checkpoint into one clear error naming the tensor, the expected and the actual shape.
#include "format/weights.h"

#include <algorithm>
#include <cstring>
#include <regex>

namespace ck {

const char* layout_name(Layout l) {
  switch (l) {
    case Layout::HfPerExpert: return "hf-per-expert";
    case Layout::HfFused: return "hf-fused";
    case Layout::Mlx: return "mlx";
  }
  return "?";
}

int64_t PleWeights::table_rows() const {
  int64_t n = 0;
  for (auto& m : table_parts) n += m.rows;
  return n;
}

void PleWeights::table_row(int64_t row, float* out) const {
  for (auto& m : table_parts) {
    if (row < m.rows) { matrix_row(m, row, out); return; }
    row -= m.rows;
  }
  CHECK_MSG(false, "n-gram row {} past the table", row);
}

Status CheckpointExperts::get(int record_layer, int expert, ExpertMatrices* out, std::vector<uint8_t>*) {
  if (record_layer < 0 || record_layer >= static_cast<int>(table.size()) || expert < 0 ||
      expert >= static_cast<int>(table[record_layer].size()))
    return error("expert ({}, {}) out of range", record_layer, expert);
  *out = table[record_layer][expert];
  return {};
}

// ---- PLE hash constants (spec §5.2; HF _build_layer_multipliers, _find_nth_prime_after) ----

namespace {
uint64_t splitmix64(uint64_t v) {
  v += 0x9E3779B97F4A7C15ull;
  v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
  v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
  return v ^ (v >> 31);
}
bool is_prime(int64_t v) {
  if (v < 2) return false;
  if (v % 2 == 0) return v == 2;
  for (int64_t d = 3; d * d <= v; d += 2)
    if (v % d == 0) return false;
  return true;
}
}  // namespace

std::vector<int64_t> ngram_multipliers(const ModelConfig& cfg, int ple_index) {
  uint64_t multiplier_max = static_cast<uint64_t>(INT64_MAX) / static_cast<uint64_t>(cfg.vocab_size);
  uint64_t half = std::max<uint64_t>(1, multiplier_max / 2);
  uint64_t base = cfg.seed + 10007ull * static_cast<uint64_t>(ple_index);
  std::vector<int64_t> m;
  for (int j = 0; j < cfg.ngram_size; ++j) {
    uint64_t v = base + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(j + 1);
    m.push_back(static_cast<int64_t>(2 * (splitmix64(v) % half) + 1));
  }
  return m;
}

std::vector<int64_t> ngram_head_sizes(const ModelConfig& cfg, int ple_index) {
  // Head g's size is the (g+1)-th prime strictly greater than base-1, g the global head index.
  int n_heads = cfg.ngram_heads();
  int first = ple_index * n_heads, last = first + n_heads;
  std::vector<int64_t> sizes;
  int64_t candidate = cfg.ngram_vocab_size_base - 1;
  int found = 0;
  while (found < last) {
    ++candidate;
    if (is_prime(candidate)) {
      if (found >= first) sizes.push_back(candidate);
      ++found;
    }
  }
  return sizes;
}

namespace {

// Resolves names for one layout and builds checked views.
class Resolver {
 public:
  Resolver(const TensorSet& ts, const ModelConfig& cfg, Layout layout) : ts_(ts), cfg_(cfg), layout_(layout) {}

  bool mlx() const { return layout_ == Layout::Mlx; }

  const TensorInfo* find(const std::string& name) const { return ts_.find(name); }

  Status missing(const std::string& name) const {
    return error("{}: missing tensor '{}'", ts_.origin(), name);
  }

  // A weight matrix `base`.weight [rows, cols], float or MLX-quantized (base.scales/.biases present).
  Status matrix(const std::string& base, int64_t rows, int64_t cols, Matrix* out) const {
    return stacked_slice(base, -1, 0, rows, cols, out);
  }

  // Expert `e` of a stacked [E, rows, cols] tensor, or a plain [rows, cols] tensor when e < 0.
  Status stacked_slice(const std::string& base, int64_t n_stack, int64_t e, int64_t rows, int64_t cols,
                       Matrix* out, const std::string& weight_suffix = ".weight") const {
    std::string wname = base + weight_suffix;
    const TensorInfo* w = find(wname);
    if (!w) return missing(wname);
    const TensorInfo* s = find(base + ".scales");
    const TensorInfo* b = find(base + ".biases");
    auto want_shape = [&](int64_t last) {
      std::vector<int64_t> v;
      if (n_stack >= 0) v.push_back(n_stack);
      v.push_back(rows);
      v.push_back(last);
      return v;
    };
    auto shape_str = [](const std::vector<int64_t>& v) {
      std::string r = "[";
      for (size_t i = 0; i < v.size(); ++i) r += (i ? ", " : "") + std::to_string(v[i]);
      return r + "]";
    };
    Matrix m;
    m.name = wname;
    m.rows = rows;
    m.cols = cols;
    int64_t stack_index = n_stack >= 0 ? e : 0;
    if (s) {
      if (!b) return missing(base + ".biases");
      if (w->dtype != DType::U32)
        return error("{}: tensor '{}' has quantization scales but dtype {} (expected U32 codes)", w->file, wname,
                     dtype_name(w->dtype));
      if (s->shape.empty() || w->shape.empty()) return error("{}: tensor '{}': bad quantized shapes", w->file, wname);
      int64_t n_groups = s->shape.back(), words = w->shape.back();
      if (n_groups <= 0 || cols % n_groups != 0)
        return error("{}: tensor '{}': scales have {} groups per row, which does not divide {} columns", s->file,
                     base + ".scales", n_groups, cols);
      int group = static_cast<int>(cols / n_groups);
      if (words * 32 % cols != 0)
        return error("{}: tensor '{}': {} u32 words per row do not pack {} columns at a whole bit width", w->file, wname,
                     words, cols);
      int bits = static_cast<int>(words * 32 / cols);
      if (bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8)
        return error("{}: tensor '{}': {} bits per code is not an MLX affine width", w->file, wname, bits);
      if (group != 32 && group != 64 && group != 128)
        return error("{}: tensor '{}': group size {} is not 32, 64 or 128", w->file, wname, group);
      if (w->shape != want_shape(words))
        return error("{}: tensor '{}': shape {} (expected {} for {} x {} at {} bits)", w->file, wname, w->shape_str(),
                     shape_str(want_shape(words)), rows, cols, bits);
      if (s->shape != want_shape(n_groups) || b->shape != s->shape)
        return error("{}: tensor '{}': scales/biases shapes {} / {} (expected {})", s->file, base + ".scales",
                     s->shape_str(), b->shape_str(), shape_str(want_shape(n_groups)));
      if (s->dtype != b->dtype || (s->dtype != DType::BF16 && s->dtype != DType::F16 && s->dtype != DType::F32))
        return error("{}: tensor '{}': scales/biases dtype {} / {} (expected matching bf16, f16 or f32)", s->file,
                     base + ".scales", dtype_name(s->dtype), dtype_name(b->dtype));
      if (cfg_.quantization.present) {
        std::string module = base;
        auto spec = cfg_.quantization.for_module(module);
        if (spec && (spec->bits != bits || spec->group_size != group))
          return error("{}: tensor '{}' is stored at {} bits, group {}, but config.json quantization says {} bits, "
                       "group {}", w->file, wname, bits, group, spec->bits, spec->group_size);
      }
      m.dtype = DType::U32;
      m.bits = bits;
      m.group_size = group;
      m.scale_dtype = s->dtype;
      size_t code_bytes = static_cast<size_t>(rows) * cols * bits / 8;
      size_t scale_bytes = static_cast<size_t>(rows) * n_groups * dtype_size(s->dtype);
      m.data = w->data + static_cast<size_t>(stack_index) * code_bytes;
      m.scales = s->data + static_cast<size_t>(stack_index) * scale_bytes;
      m.biases = b->data + static_cast<size_t>(stack_index) * scale_bytes;
    } else {
      if (w->dtype != DType::F32 && w->dtype != DType::BF16 && w->dtype != DType::F16)
        return error("{}: tensor '{}' has dtype {} (expected F32, BF16 or F16, or U32 codes with scales)", w->file,
                     wname, dtype_name(w->dtype));
      if (w->shape != want_shape(cols))
        return error("{}: tensor '{}': shape {} (expected {})", w->file, wname, w->shape_str(),
                     shape_str(want_shape(cols)));
      m.dtype = w->dtype;
      m.data = w->data + static_cast<size_t>(stack_index) * rows * cols * dtype_size(w->dtype);
    }
    *out = m;
    return {};
  }

  // A float vector of n values; `zero_centred`: N1 norm weights get 1+w (HF stores w; MLX folded it).
  Status vector(const std::string& name, int64_t n, bool zero_centred, std::vector<float>* out) const {
    const TensorInfo* t = find(name);
    if (!t) return missing(name);
    if (t->dtype != DType::F32 && t->dtype != DType::BF16 && t->dtype != DType::F16)
      return error("{}: tensor '{}' has dtype {} (expected F32, BF16 or F16)", t->file, name, dtype_name(t->dtype));
    if (t->numel() != n || t->shape.size() != 1)
      return error("{}: tensor '{}': shape {} (expected [{}])", t->file, name, t->shape_str(), n);
    out->resize(static_cast<size_t>(n));
    bool add_one = zero_centred && !mlx();
    for (int64_t i = 0; i < n; ++i) (*out)[i] = load_float(t->dtype, t->data, i) + (add_one ? 1.0f : 0.0f);
    return {};
  }

  // Depthwise conv taps: HF [C, 1, K], MLX [C, K, 1]; both keep K contiguous per channel.
  Status conv(const std::string& name, int64_t channels, int64_t kernel, std::vector<float>* out) const {
    const TensorInfo* t = find(name);
    if (!t) return missing(name);
    std::vector<int64_t> hf{channels, 1, kernel}, mlx_shape{channels, kernel, 1};
    if (t->shape != hf && t->shape != mlx_shape)
      return error("{}: tensor '{}': shape {} (expected [{}, 1, {}] or [{}, {}, 1])", t->file, name, t->shape_str(),
                   channels, kernel, channels, kernel);
    if (t->dtype != DType::F32 && t->dtype != DType::BF16 && t->dtype != DType::F16)
      return error("{}: tensor '{}' has dtype {} (expected a float type)", t->file, name, dtype_name(t->dtype));
    out->resize(static_cast<size_t>(channels * kernel));
    for (int64_t i = 0; i < channels * kernel; ++i) (*out)[i] = load_float(t->dtype, t->data, i);
    return {};
  }

  Status hc(const std::string& p, bool with_inject, HcWeights* out) const {
    const int64_t W = cfg_.wide(), R = cfg_.hc_lowrank;
    TRY(vector(p + ".hc_norm.weight", W, true, &out->norm));
    TRY(matrix(p + ".input_mix_weight_down", R, W, &out->down));
    TRY(matrix(p + ".input_mix_weight_up", W, R, &out->up));
    if (with_inject) TRY(matrix(p + ".block_inject_weight", cfg_.hc_count, W, &out->inject));
    return {};
  }

  Status gdn(const std::string& p, GdnWeights* g) const {
    const int64_t H = cfg_.hidden_size, Vd = cfg_.gdn_value_dim(), nv = cfg_.linear_num_value_heads;
    TRY(matrix(p + ".in_proj_qkv", cfg_.gdn_conv_dim(), H, &g->in_qkv));
    TRY(matrix(p + ".in_proj_z", Vd, H, &g->in_z));
    TRY(matrix(p + ".in_proj_b", nv, H, &g->in_b));
    TRY(matrix(p + ".in_proj_a", nv, H, &g->in_a));
    TRY(matrix(p + ".out_proj", H, Vd, &g->out));
    TRY(conv(p + ".conv1d.weight", cfg_.gdn_conv_dim(), cfg_.linear_conv_kernel_dim, &g->conv));
    TRY(vector(p + ".A_log", nv, false, &g->a_log));
    TRY(vector(p + ".dt_bias", nv, false, &g->dt_bias));
    TRY(vector(p + ".norm.weight", cfg_.linear_value_head_dim, false, &g->norm));
    return {};
  }

  Status attn(const std::string& p, AttnWeights* a) const {
    const int64_t H = cfg_.hidden_size, hd = cfg_.head_dim;
    TRY(matrix(p + ".q_proj", cfg_.num_attention_heads * hd * 2, H, &a->q));
    TRY(matrix(p + ".k_proj", cfg_.num_key_value_heads * hd, H, &a->k));
    TRY(matrix(p + ".v_proj", cfg_.num_key_value_heads * hd, H, &a->v));
    TRY(matrix(p + ".o_proj", H, cfg_.num_attention_heads * hd, &a->o));
    TRY(vector(p + ".q_norm.weight", hd, true, &a->q_norm));
    TRY(vector(p + ".k_norm.weight", hd, true, &a->k_norm));
    const int64_t ihd = cfg_.indexer_head_dim;
    TRY(matrix(p + ".indexer.index_qk_proj", (cfg_.indexer_n_heads + 1) * ihd, H, &a->index_qk));
    TRY(vector(p + ".indexer.q_layernorm.weight", ihd, true, &a->index_q_norm));
    TRY(vector(p + ".indexer.k_layernorm.weight", ihd, true, &a->index_k_norm));
    return {};
  }

  Status ple(const std::string& p, int ple_index, PleWeights* w) const {
    const int64_t H = cfg_.hidden_size, W = cfg_.wide(), E = cfg_.ple_embed_dim;
    w->ple_index = ple_index;
    TRY(matrix(p + ".key_proj", W, E, &w->key));
    TRY(matrix(p + ".value_proj", H, E, &w->value));
    TRY(vector(p + ".norm_key.weight", W, true, &w->norm_key));
    TRY(vector(p + ".norm_query.weight", W, true, &w->norm_query));
    TRY(vector(p + ".norm_conv.weight", W, true, &w->norm_conv));
    TRY(conv(p + ".conv1d.weight", W, cfg_.ple_conv_kernel_size, &w->conv));
    w->multipliers = ngram_multipliers(cfg_, ple_index);
    w->head_sizes = ngram_head_sizes(cfg_, ple_index);
    int64_t total = 0;
    for (int64_t s : w->head_sizes) { w->head_offsets.push_back(total); total += s; }
    int64_t div = cfg_.make_ngram_vocab_size_divisible_by;
    int64_t padded = (total + div - 1) / div * div;
    const int64_t row_dim = cfg_.ngram_row_dim();
    // The table: one tensor, or numbered shards concatenated in numeric order (spec trap 19).
    std::string tb = p + ".ple_embedding.ngram_embedding";
    if (find(tb + ".weight")) {
      Matrix m;
      TRY(matrix(tb, padded, row_dim, &m));
      w->table_parts.push_back(m);
    } else {
      std::vector<std::pair<int, std::string>> shards;
      std::regex shard_re(std::regex_replace(tb, std::regex(R"([.])"), R"(\.)") + R"(\.shard_(\d+)\.weight)");
      for (auto& [name, t] : ts_.all()) {
        std::smatch mm;
        if (std::regex_match(name, mm, shard_re)) shards.emplace_back(std::stoi(mm[1].str()), tb + ".shard_" + mm[1].str());
      }
      if (shards.empty()) return missing(tb + ".weight (or .shard_0.weight ...)");
      std::sort(shards.begin(), shards.end());
      for (size_t i = 0; i < shards.size(); ++i)
        if (shards[i].first != static_cast<int>(i))
          return error("{}: n-gram table shards are not numbered 0..{}: shard_{} is missing", ts_.origin(),
                       shards.size() - 1, i);
      int64_t rows_total = 0;
      for (auto& [k, base] : shards) {
        const TensorInfo* t = find(base + ".weight");
        if (t->shape.size() != 2) return error("{}: tensor '{}.weight': shape {} (expected 2-D)", t->file, base, t->shape_str());
        Matrix m;
        TRY(matrix(base, t->shape[0], row_dim, &m));
        rows_total += m.rows;
        w->table_parts.push_back(m);
      }
      if (rows_total != padded)
        return error("{}: n-gram table shards hold {} rows in all (expected {} = {} hashed rows padded to a multiple "
                     "of {})", ts_.origin(), rows_total, padded, total, div);
    }
    // The int64 buffers, when present, must agree with the config (never routed through floats).
    auto check_buffer = [&](const std::string& name, const std::vector<int64_t>& want) -> Status {
      const TensorInfo* t = find(p + ".ple_embedding." + name);
      if (!t) return {};
      if (t->dtype != DType::I64 || t->numel() != static_cast<int64_t>(want.size()))
        return error("{}: tensor '{}': {} {} (expected I64 [{}])", t->file, t->name, dtype_name(t->dtype), t->shape_str(),
                     want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        int64_t v;
        std::memcpy(&v, t->data + 8 * i, 8);
        if (v != want[i])
          return error("{}: tensor '{}'[{}] = {} but the config gives {} (seed, vocab or ngram settings differ)",
                       t->file, t->name, i, v, want[i]);
      }
      return {};
    };
    TRY(check_buffer("layer_multipliers", w->multipliers));
    TRY(check_buffer("ngram_heads_vocab_sizes", w->head_sizes));
    TRY(check_buffer("ngram_heads_offsets", w->head_offsets));
    return {};
  }

  Status moe(const std::string& p, MoeWeights* m) const {
    const int64_t H = cfg_.hidden_size, S = cfg_.shared_expert_intermediate_size;
    TRY(matrix(p + ".gate", cfg_.num_experts, H, &m->router));
    TRY(matrix(p + ".shared_expert.gate_proj", S, H, &m->shared_gate));
    TRY(matrix(p + ".shared_expert.up_proj", S, H, &m->shared_up));
    TRY(matrix(p + ".shared_expert.down_proj", H, S, &m->shared_down));
    TRY(matrix(p + ".shared_expert_gate", 1, H, &m->shared_expert_gate));
    return {};
  }

  // The routed experts of MoE prefix `p` ("….mlp"), in whichever layout.
  Status experts(const std::string& p, std::vector<ExpertMatrices>* out) const {
    const int64_t E = cfg_.num_experts, I = cfg_.moe_intermediate_size, H = cfg_.hidden_size;
    out->resize(static_cast<size_t>(E));
    if (mlx() || find(p + ".switch_mlp.gate_proj.weight")) {
      for (int64_t e = 0; e < E; ++e) {
        TRY(stacked_slice(p + ".switch_mlp.gate_proj", E, e, I, H, &(*out)[e].gate));
        TRY(stacked_slice(p + ".switch_mlp.up_proj", E, e, I, H, &(*out)[e].up));
        TRY(stacked_slice(p + ".switch_mlp.down_proj", E, e, H, I, &(*out)[e].down));
      }
    } else if (find(p + ".experts.gate_up_proj")) {
      for (int64_t e = 0; e < E; ++e) {
        Matrix gu;
        TRY(stacked_slice(p + ".experts.gate_up_proj", E, e, 2 * I, H, &gu, ""));
        (*out)[e].gate = gu.row_slice(0, I);   // the gate is the first half (spec trap 21)
        (*out)[e].up = gu.row_slice(I, I);
        TRY(stacked_slice(p + ".experts.down_proj", E, e, H, I, &(*out)[e].down, ""));
      }
    } else {
      for (int64_t e = 0; e < E; ++e) {
        std::string b = p + ".experts." + std::to_string(e);
        TRY(matrix(b + ".gate_proj", I, H, &(*out)[e].gate));
        TRY(matrix(b + ".up_proj", I, H, &(*out)[e].up));
        TRY(matrix(b + ".down_proj", H, I, &(*out)[e].down));
      }
    }
    return {};
  }

  // `experts_out` null: the routed experts are served elsewhere (a store) and not resolved here.
  Status layer(const std::string& p, int layer_index, LayerKind kind, LayerWeights* lw,
               std::vector<ExpertMatrices>* experts_out) const {
    lw->kind = kind;
    TRY(hc(p + ".attn_hyper_connection", true, &lw->hc_attn));
    TRY(hc(p + ".mlp_hyper_connection", true, &lw->hc_mlp));
    if (kind == LayerKind::LinearAttention) TRY(gdn(p + ".linear_attn", &lw->gdn));
    else TRY(attn(p + ".self_attn", &lw->attn));
    int ple_index = layer_index >= 0 ? cfg_.ple_index_of_layer(layer_index) : -1;
    if (ple_index >= 0) {
      lw->ple.emplace();
      TRY(ple(p + ".ple", ple_index, &*lw->ple));
    }
    TRY(moe(p + ".mlp", &lw->moe));
    if (experts_out) TRY(experts(p + ".mlp", experts_out));
    return {};
  }

 private:
  const TensorSet& ts_;
  const ModelConfig& cfg_;
  Layout layout_;
};

}  // namespace

Result<LayoutInfo> detect_layout(const TensorSet& ts) {
  LayoutInfo li;
  if (ts.find("language_model.model.embed_tokens.weight")) {
    li.layout = Layout::Mlx;
    li.prefix = "language_model.model.";
    li.head = "language_model.lm_head";
  } else if (ts.find("model.language_model.embed_tokens.weight")) {
    li.prefix = "model.language_model.";
    li.head = "lm_head";
  } else if (ts.find("model.embed_tokens.weight")) {
    li.prefix = "model.";
    li.head = "lm_head";
  } else {
    return error("{}: no embedding tensor found (looked for model.language_model.embed_tokens.weight, "
                 "model.embed_tokens.weight and language_model.model.embed_tokens.weight)", ts.origin());
  }
  if (li.layout != Layout::Mlx) {
    bool fused = false;
    for (auto& [name, t] : ts.all())
      if (name.find(".mlp.experts.gate_up_proj") != std::string::npos) fused = true;
    li.layout = fused ? Layout::HfFused : Layout::HfPerExpert;
  }
  return li;
}

Result<ModelWeights> resolve_weights(const TensorSet& ts, const ModelConfig& cfg, const LayoutInfo& li, bool load_mtp,
                                     CheckpointExperts* experts) {
  Resolver r(ts, cfg, li.layout);
  ModelWeights w;
  w.cfg = cfg;
  const int64_t V = cfg.vocab_size, H = cfg.hidden_size;
  TRY(r.matrix(li.prefix + "embed_tokens", V, H, &w.embed));
  if (cfg.tie_word_embeddings && !ts.find(li.head + ".weight")) w.lm_head = w.embed;
  else TRY(r.matrix(li.head, V, H, &w.lm_head));
  TRY(r.hc(li.prefix + "hyper_connection_mixer", false, &w.final_mixer));
  if (experts) experts->table.assign(static_cast<size_t>(cfg.num_hidden_layers), {});
  w.layers.resize(static_cast<size_t>(cfg.num_hidden_layers));
  for (int L = 0; L < cfg.num_hidden_layers; ++L)
    TRY(r.layer(li.prefix + "layers." + std::to_string(L), L, cfg.layer_types[L], &w.layers[L],
                experts ? &experts->table[L] : nullptr));

  // MTP head: present when its tensors are; `mtp.` or `model.mtp.` (or `language_model.mtp.`).
  if (load_mtp) {
    std::string mp = mtp_prefix(ts);
    if (!mp.empty()) {
      MtpWeights m;
      TRY(r.vector(mp + "pre_fc_norm_embedding.weight", H, true, &m.pre_fc_norm_embedding));
      TRY(r.vector(mp + "pre_fc_norm_hidden.weight", cfg.wide(), true, &m.pre_fc_norm_hidden));
      TRY(r.matrix(mp + "fc_embedding", H, H, &m.fc_embedding));
      TRY(r.matrix(mp + "fc_hidden", H, H, &m.fc_hidden));
      if (experts) experts->table.emplace_back();
      TRY(r.layer(mp + "layers.0", -1, LayerKind::SparseAttention, &m.layer, experts ? &experts->table.back() : nullptr));
      TRY(r.hc(mp + "hyper_connection_mixer", false, &m.mixer));
      w.mtp = std::move(m);
    }
  }
  return w;
}

std::string mtp_prefix(const TensorSet& ts) {
  for (const char* cand : {"mtp.", "model.mtp.", "language_model.mtp.", "language_model.model.mtp."})
    if (ts.find(std::string(cand) + "fc_embedding.weight")) return cand;
  return "";
}

Result<std::unique_ptr<Checkpoint>> open_checkpoint(const std::string& dir, bool load_mtp) {
  auto ck = std::make_unique<Checkpoint>();
  ck->dir = dir;
  ASSIGN_OR_RETURN(ModelConfig cfg, load_config(dir));
  ASSIGN_OR_RETURN(ck->tensors, TensorSet::open_dir(dir));
  ASSIGN_OR_RETURN(LayoutInfo li, detect_layout(ck->tensors));
  ck->layout = li.layout;
  ck->prefix = li.prefix;
  ck->experts = std::make_shared<CheckpointExperts>();
  ASSIGN_OR_RETURN(ck->weights, resolve_weights(ck->tensors, cfg, li, load_mtp, ck->experts.get()));
  return ck;
}

}  // namespace ck
