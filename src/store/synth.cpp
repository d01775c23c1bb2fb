// Synthetic checkpoint writer (synth.h). Quantized codes are drawn directly from random bits, never
// by quantizing floats: that is what lets it write faster than a disk (several GB/s per core). The
// codes of a 4-bit weight are the sum of two uniform 3-bit values and one random bit (triangular on
// 0..15, mean 7.5, std 3.28: roughly the bell shape that MLX's quantizer gives a trained model's
// groups); each group's scale is chosen so that the weight's std is `sigma` and its bias puts the
// group's mean near 0, with bias = the value of code 0 as MLX's rule leaves it (mlx_affine.md).
#include "store/synth.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "util/json.h"

#include "format/safetensors.h"
#include "store/outfile.h"
#include "store/progress.h"
#include "store/rng.h"
#include "util/file.h"
#include "util/half.h"
#include "util/log.h"

namespace ck::store {


namespace {

// The released model's text geometry (spec §1.1).
struct Geometry {
  int64_t vocab = 248320;
  int hidden = 2560, layers = 48, heads = 24, kv_heads = 2, head_dim = 256;
  int gdn_k_heads = 16, gdn_v_heads = 48, gdn_head_dim = 128, conv_kernel = 4;
  int experts = 512, top_k = 10, moe_inter = 640, shared_inter = 640;
  int hc = 4, hc_lowrank = 320;
  int ple_layer_id = 2, ngram = 3, heads_per_ngram = 8, ple_kernel = 4;
  int idx_heads = 4, idx_head_dim = 128, idx_budget = 2048, idx_ratio = 4;
  double rope_theta = 1e7, partial_rotary = 0.25;
  int64_t eos = 248044;
};

enum class Gen { Codes, Scales, Biases, Norm, Uniform, ALog };

struct Plan {
  std::string name;
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
  Gen gen = Gen::Norm;
  int bits = 4;
  float sigma = 0;       // weight std (quantized modules)
  float lo = 0, hi = 0;  // Uniform range
  uint64_t stream = 0;
  int shard = 0;
  uint64_t offset = 0;   // in the shard's data region
};

constexpr uint64_t kBlock = 64 << 10;   // RNG block of the code stream (the unit of determinism)
constexpr uint64_t kChunk = 4 << 20;    // work item
constexpr uint64_t kElemBlock = 4096;   // RNG block of scales/biases, in elements

// Mean and std of the triangular codes (sum of two uniform (bits-1)-bit values and one bit).
double code_mean(int bits) { return ((1 << (bits - 1)) - 1) + 0.5; }
double code_std(int bits) {
  double m = 1 << (bits - 1);
  return std::sqrt(2 * (m * m - 1) / 12.0 + 0.25);
}

class Planner {
 public:
  Planner(uint64_t seed) : seed_(seed) {}
  std::vector<Plan> plans;
  std::map<std::string, std::pair<int, int>> overrides;  // module -> (group_size, bits) other than 64, 4

  // A quantized linear module: weight (codes), scales, biases; `stack` > 0 adds a leading expert axis.
  void quant(const std::string& m, int64_t rows, int64_t cols, int bits, int group, float sigma, int64_t stack = 0) {
    std::vector<int64_t> lead;
    if (stack > 0) lead.push_back(stack);
    auto shape = [&](int64_t last) { auto v = lead; v.push_back(rows); v.push_back(last); return v; };
    int64_t n = (stack > 0 ? stack : 1) * rows;
    uint64_t stream = stream_seed(seed_, m);
    Plan w{m + ".weight", DType::U32, shape(cols * bits / 32), static_cast<uint64_t>(n * cols * bits / 8), Gen::Codes, bits,
           sigma, 0, 0, stream_seed(seed_, m + ".weight")};
    Plan s{m + ".scales", DType::BF16, shape(cols / group), static_cast<uint64_t>(n * (cols / group) * 2), Gen::Scales,
           bits, sigma, 0, 0, stream};
    Plan b = s;
    b.name = m + ".biases";
    b.gen = Gen::Biases;
    plans.push_back(w);
    plans.push_back(s);
    plans.push_back(b);
    if (bits != 4 || group != 64) overrides[m] = {group, bits};
  }
  void linear(const std::string& m, int64_t rows, int64_t cols) { quant(m, rows, cols, 4, 64, 1.0f / std::sqrt(float(cols))); }
  // Routers 4x wider than 1/sqrt(fan_in): router logits of std ~2, so top-k picks are clear and
  // differ between tokens, as a trained router's do.
  void router(const std::string& m, int64_t rows, int64_t cols) { quant(m, rows, cols, 8, 64, 4.0f / std::sqrt(float(cols))); }
  void vec(const std::string& name, std::vector<int64_t> shape, Gen gen, float lo = 0, float hi = 0) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    plans.push_back(Plan{name, DType::BF16, std::move(shape), static_cast<uint64_t>(n * 2), gen, 0, 0, lo, hi,
                         stream_seed(seed_, name)});
  }
  void norm(const std::string& name, int64_t n) { vec(name, {n}, Gen::Norm); }

 private:
  uint64_t seed_;
};

void plan_hc(Planner& p, const std::string& m, const Geometry& g, bool inject) {
  const int64_t W = int64_t(g.hc) * g.hidden;
  p.norm(m + ".hc_norm.weight", W);
  p.linear(m + ".input_mix_weight_down", g.hc_lowrank, W);
  p.linear(m + ".input_mix_weight_up", W, g.hc_lowrank);
  if (inject) p.linear(m + ".block_inject_weight", g.hc, W);
}

void plan_attn(Planner& p, const std::string& m, const Geometry& g) {
  p.linear(m + ".q_proj", int64_t(g.heads) * g.head_dim * 2, g.hidden);
  p.linear(m + ".k_proj", int64_t(g.kv_heads) * g.head_dim, g.hidden);
  p.linear(m + ".v_proj", int64_t(g.kv_heads) * g.head_dim, g.hidden);
  p.linear(m + ".o_proj", g.hidden, int64_t(g.heads) * g.head_dim);
  p.norm(m + ".q_norm.weight", g.head_dim);
  p.norm(m + ".k_norm.weight", g.head_dim);
  p.linear(m + ".indexer.index_qk_proj", int64_t(g.idx_heads + 1) * g.idx_head_dim, g.hidden);
  p.norm(m + ".indexer.q_layernorm.weight", g.idx_head_dim);
  p.norm(m + ".indexer.k_layernorm.weight", g.idx_head_dim);
}

void plan_gdn(Planner& p, const std::string& m, const Geometry& g) {
  const int64_t kd = int64_t(g.gdn_k_heads) * g.gdn_head_dim, vd = int64_t(g.gdn_v_heads) * g.gdn_head_dim;
  const int64_t conv = 2 * kd + vd;
  p.linear(m + ".in_proj_qkv", conv, g.hidden);
  p.linear(m + ".in_proj_z", vd, g.hidden);
  p.linear(m + ".in_proj_b", g.gdn_v_heads, g.hidden);
  p.linear(m + ".in_proj_a", g.gdn_v_heads, g.hidden);
  // Conv taps: MLX stores [C, K, 1]. About unit gain over the window.
  float c = 1.0f / std::sqrt(float(g.conv_kernel));
  p.vec(m + ".conv1d.weight", {conv, g.conv_kernel, 1}, Gen::Uniform, -c, c);
  p.vec(m + ".A_log", {g.gdn_v_heads}, Gen::ALog);                 // log A, A ~ U(1, 16)
  p.vec(m + ".dt_bias", {g.gdn_v_heads}, Gen::Uniform, -0.5f, 0.5f);
  p.norm(m + ".norm.weight", g.gdn_head_dim);                      // plain N2 weight, near 1
  p.linear(m + ".out_proj", g.hidden, vd);
}

void plan_moe(Planner& p, const std::string& m, const Geometry& g) {
  p.router(m + ".gate", g.experts, g.hidden);
  p.quant(m + ".switch_mlp.gate_proj", g.moe_inter, g.hidden, 4, 64, 1.0f / std::sqrt(float(g.hidden)), g.experts);
  p.quant(m + ".switch_mlp.up_proj", g.moe_inter, g.hidden, 4, 64, 1.0f / std::sqrt(float(g.hidden)), g.experts);
  p.quant(m + ".switch_mlp.down_proj", g.hidden, g.moe_inter, 4, 64, 1.0f / std::sqrt(float(g.moe_inter)), g.experts);
  p.linear(m + ".shared_expert.gate_proj", g.shared_inter, g.hidden);
  p.linear(m + ".shared_expert.up_proj", g.shared_inter, g.hidden);
  p.linear(m + ".shared_expert.down_proj", g.hidden, g.shared_inter);
  p.router(m + ".shared_expert_gate", 1, g.hidden);
}

int64_t ngram_rows(const Geometry& g, int64_t base) {
  // Sum of the 16 primes above base-1 (spec §5.2), padded to a multiple of 128.
  auto is_prime = [](int64_t v) {
    if (v < 2) return false;
    if (v % 2 == 0) return v == 2;
    for (int64_t d = 3; d * d <= v; d += 2)
      if (v % d == 0) return false;
    return true;
  };
  int heads = (g.ngram - 1) * g.heads_per_ngram;
  int64_t total = 0, cand = base - 1;
  for (int found = 0; found < heads;) {
    ++cand;
    if (is_prime(cand)) { total += cand; ++found; }
  }
  return (total + 127) / 128 * 128;
}

void plan_layer(Planner& p, const std::string& m, int layer, bool attention, const Geometry& g, int64_t ngram_base) {
  const int64_t W = int64_t(g.hc) * g.hidden;
  plan_hc(p, m + ".attn_hyper_connection", g, true);
  plan_hc(p, m + ".mlp_hyper_connection", g, true);
  if (attention) plan_attn(p, m + ".self_attn", g);
  else plan_gdn(p, m + ".linear_attn", g);
  if (layer == g.ple_layer_id - 1) {
    const std::string q = m + ".ple";
    const int64_t E = g.hidden;  // ple_embed_dim = hidden_size
    p.linear(q + ".key_proj", W, E);
    p.linear(q + ".value_proj", g.hidden, E);
    p.norm(q + ".norm_key.weight", W);
    p.norm(q + ".norm_query.weight", W);
    p.norm(q + ".norm_conv.weight", W);
    float c = 1.0f / std::sqrt(float(g.ple_kernel));
    p.vec(q + ".conv1d.weight", {W, g.ple_kernel, 1}, Gen::Uniform, -c, c);
    int64_t row_dim = E / ((g.ngram - 1) * g.heads_per_ngram);
    p.quant(q + ".ple_embedding.ngram_embedding", ngram_rows(g, ngram_base), row_dim, 4, 32, 1.0f);
  }
  plan_moe(p, m + ".mlp", g);
}

// config.json. Its keys come out sorted (the builder's document keeps them so), as nlohmann::json
// wrote them before: the bytes, and so the headers hash of packed stores, stay the same.
JsonDoc make_config(const Geometry& g, const SynthOptions& o, JsonRef quantization) {
  JsonBuilder b;
  b.begin_object();
  b.field("model_type", "qwen4_exp");
  b.key("architectures").begin_array().value("Qwen4ExpForConditionalGeneration").end_array();
  b.field("tie_word_embeddings", false);
  b.key("text_config").begin_object();
  b.field("model_type", "qwen4_exp_text");
  b.field("vocab_size", g.vocab);
  b.field("hidden_size", g.hidden);
  b.field("num_hidden_layers", g.layers);
  b.field("num_attention_heads", g.heads);
  b.field("num_key_value_heads", g.kv_heads);
  b.field("head_dim", g.head_dim);
  b.field("hidden_act", "silu");
  b.field("rms_norm_eps", 1e-6);
  b.key("rope_parameters").begin_object();
  b.field("rope_type", "default").field("rope_theta", g.rope_theta).field("partial_rotary_factor", g.partial_rotary);
  b.key("mrope_section").begin_array().value(11).value(11).value(10).end_array();
  b.field("mrope_interleaved", true).end_object();
  b.field("max_position_embeddings", 262144);
  b.field("attention_bias", false);
  b.field("linear_conv_kernel_dim", g.conv_kernel);
  b.field("linear_key_head_dim", g.gdn_head_dim);
  b.field("linear_value_head_dim", g.gdn_head_dim);
  b.field("linear_num_key_heads", g.gdn_k_heads);
  b.field("linear_num_value_heads", g.gdn_v_heads);
  b.field("output_gate_type", "sigmoid");
  b.field("num_experts", g.experts);
  b.field("num_experts_per_tok", g.top_k);
  b.field("moe_intermediate_size", g.moe_inter);
  b.field("shared_expert_intermediate_size", g.shared_inter);
  b.field("norm_topk_prob", true);
  b.field("hc_count", g.hc);
  b.field("hc_lowrank", g.hc_lowrank);
  b.key("ple_layer_ids").begin_array().value(g.ple_layer_id).end_array();
  b.field("ple_embed_dim", g.hidden);
  b.field("ple_conv_kernel_size", g.ple_kernel);
  b.field("ngram_size", g.ngram);
  b.field("heads_per_ngram", g.heads_per_ngram);
  b.field("ngram_vocab_size_base", o.ngram_base);
  b.field("make_ngram_vocab_size_divisible_by", 128);
  b.field("split_ngram_parts", 128);
  b.field("indexer_n_heads", g.idx_heads);
  b.field("indexer_kv_heads", 1);
  b.field("indexer_head_dim", g.idx_head_dim);
  b.field("indexer_budget", g.idx_budget);
  b.field("indexer_compress_ratio", g.idx_ratio);
  b.key("layer_types").begin_array();
  for (int i = 0; i < g.layers; ++i) b.value((i % 4 == 3) ? "full_attention" : "linear_attention");
  b.end_array();
  b.field("eos_token_id", g.eos);
  b.field("bos_token_id", g.eos);
  b.field("tie_word_embeddings", false);
  b.field("mamba_ssm_dtype", "float32");
  b.field("dtype", "bfloat16");
  if (o.mtp) {
    b.field("mtp_num_hidden_layers", 1);
    b.field("mtp_use_dedicated_embeddings", false);
    b.key("mtp").begin_object().field("hybrid", true);
    b.key("layer_types").begin_array().value("full_attention").end_array();
    b.key("mtp_use_hidden_state_from_layer").null();
    b.field("num_hidden_layers", 1).field("rope_theta", g.rope_theta).end_object();
  }
  b.end_object();  // text_config
  b.field("quantization", quantization);
  b.field("quantization_config", quantization);
  b.key("cherenkov_synth").begin_object();
  b.field("geometry", o.geometry).field("seed", o.seed).field("generator", "cherenkov synth 1");
  b.field("note", "random weights: not a trained model").end_object();
  b.end_object();
  return b.finish();
}

// Fills out[0, n) with bytes [off, off+n) of tensor p. For codes, off and n are multiples of kBlock
// except at the tensor's end; for element tensors, multiples of the element size.
void generate(const Plan& p, uint64_t off, uint64_t n, uint8_t* out) {
  switch (p.gen) {
    case Gen::Codes: {
      const uint64_t m_lo = p.bits == 4 ? 0x7777777777777777ull : 0x7f7f7f7f7f7f7f7full;
      const uint64_t m_bit = p.bits == 4 ? 0x1111111111111111ull : 0x0101010101010101ull;
      const int top = p.bits - 1;  // the lane's top bit of A supplies the extra random bit
      for (uint64_t b0 = off; b0 < off + n; b0 += kBlock) {
        WyRand rng(mix64(p.stream ^ mix64(b0 / kBlock)));
        uint64_t len = std::min(kBlock, off + n - b0);
        uint8_t* dst = out + (b0 - off);
        uint64_t i = 0;
        for (; i + 8 <= len; i += 8) {
          uint64_t a = rng.next(), b = rng.next();
          uint64_t w = (a & m_lo) + (b & m_lo) + ((a >> top) & m_bit);  // no carry between lanes: max 2^bits-1
          std::memcpy(dst + i, &w, 8);
        }
        if (i < len) {
          uint64_t a = rng.next(), b = rng.next();
          uint64_t w = (a & m_lo) + (b & m_lo) + ((a >> top) & m_bit);
          std::memcpy(dst + i, &w, len - i);
        }
      }
      return;
    }
    case Gen::Scales:
    case Gen::Biases: {
      // Each group draws one 64-bit value h: 8 bits pick the scale's magnitude (sigma/code_std
      // times a jitter in [0.8, 1.2), so groups differ in range), 4 bits an offset d of the group
      // mean in [-0.5, 0.5) codes, 1 bit the sign. bias = -(mean + d)·scale: the value of code 0, as
      // MLX's rule leaves it. The tables make a group cost one wyrand step; negating the bf16 scale
      // negates the bias exactly, so the sign is one XOR. One stream per block of kElemBlock groups,
      // read identically by the scales and the biases tensor.
      const float mean = static_cast<float>(code_mean(p.bits)), inv_sd = static_cast<float>(1.0 / code_std(p.bits));
      uint16_t scale_tab[256], bias_tab[256 * 16];
      for (int i = 0; i < 256; ++i) {
        float sc = bf16_to_f32(f32_to_bf16(p.sigma * inv_sd * (0.8f + 0.4f * (i + 0.5f) / 256.0f)));
        scale_tab[i] = f32_to_bf16(sc);
        for (int j = 0; j < 16; ++j) bias_tab[i * 16 + j] = f32_to_bf16(-(mean + (j + 0.5f) / 16.0f - 0.5f) * sc);
      }
      const uint64_t e0 = off / 2, e1 = (off + n) / 2;
      for (uint64_t b0 = e0 / kElemBlock * kElemBlock; b0 < e1; b0 += kElemBlock) {
        WyRand rng(mix64(p.stream ^ mix64(b0 / kElemBlock)));
        const uint64_t end = std::min(e1, b0 + kElemBlock);
        for (uint64_t e = b0; e < end; ++e) {
          uint64_t h = rng.next();
          if (e < e0) continue;
          uint16_t sign = static_cast<uint16_t>((h >> 12) & 1) << 15;
          uint16_t v = (p.gen == Gen::Scales ? scale_tab[(h >> 4) & 255] : bias_tab[h & 4095]) ^ sign;
          std::memcpy(out + (e * 2 - off), &v, 2);
        }
      }
      return;
    }
    default: {
      for (uint64_t e = off / 2; e < (off + n) / 2; ++e) {
        float u = hash_uniform(p.stream, e), v = 0;
        if (p.gen == Gen::Norm) v = 1.0f + 0.1f * (u - 0.5f);
        else if (p.gen == Gen::Uniform) v = p.lo + (p.hi - p.lo) * u;
        else v = std::log(1.0f + 15.0f * u);  // Gen::ALog
        uint16_t bits = f32_to_bf16(v);
        std::memcpy(out + (e * 2 - off), &bits, 2);
      }
      return;
    }
  }
}

struct Shard {
  std::string name;
  std::string header;   // 8-byte length + JSON, padded to 8 bytes
  uint64_t data_bytes = 0;
};

}  // namespace

Result<SynthReport> synth_checkpoint(const SynthOptions& o) {
  if (o.geometry != "qwen3.8-flash-next")
    return error("synth: unknown geometry '{}' (known: qwen3.8-flash-next)", o.geometry);
  if (o.out.empty()) return error("synth: --out is required");
  Geometry g;
  if (o.layers < 0 || o.layers > 1000) return error("synth: --layers {} out of range", o.layers);
  if (o.layers) g.layers = o.layers;
  if (g.layers < g.ple_layer_id)
    return error("synth: --layers {}: the geometry's PLE layer is layer id {} (1-based), so at least {} layers are needed",
                 g.layers, g.ple_layer_id, g.ple_layer_id);
  if (o.vocab) g.vocab = o.vocab;
  if (g.vocab < 16 || g.vocab % 64 != 0) return error("synth: --vocab {} must be a multiple of 64 and >= 16", g.vocab);
  if (g.eos >= g.vocab) g.eos = g.vocab - 1;
  if (o.experts) g.experts = o.experts;
  if (g.experts < 1) return error("synth: --experts must be >= 1");
  g.top_k = std::min(g.top_k, g.experts);
  if (o.ngram_base < 2 || o.ngram_base > 20000000) return error("synth: --ngram-base {} out of range [2, 20000000]", o.ngram_base);

  Planner p(o.seed);
  const std::string T = "language_model.model.";
  p.quant(T + "embed_tokens", g.vocab, g.hidden, 4, 64, 1.0f);
  // The head 4x wider than 1/sqrt(fan_in): logits of std ~2, a trained model's range, not ~0.5.
  p.quant("language_model.lm_head", g.vocab, g.hidden, 4, 64, 4.0f / std::sqrt(float(g.hidden)));
  plan_hc(p, T + "hyper_connection_mixer", g, false);
  for (int L = 0; L < g.layers; ++L) plan_layer(p, T + "layers." + std::to_string(L), L, L % 4 == 3, g, o.ngram_base);
  if (o.mtp) {
    p.norm("mtp.pre_fc_norm_embedding.weight", g.hidden);
    p.norm("mtp.pre_fc_norm_hidden.weight", int64_t(g.hc) * g.hidden);
    p.linear("mtp.fc_embedding", g.hidden, g.hidden);
    p.linear("mtp.fc_hidden", g.hidden, g.hidden);
    plan_layer(p, "mtp.layers.0", -1, true, g, o.ngram_base);
    plan_hc(p, "mtp.hyper_connection_mixer", g, false);
  }
  JsonBuilder qb;
  qb.begin_object().field("group_size", 64).field("bits", 4);
  for (const auto& [module, gb] : p.overrides)
    qb.key(module).begin_object().field("group_size", gb.first).field("bits", gb.second).end_object();
  const JsonDoc quantization = qb.end_object().finish();

  // Shards in plan order, a new one once the current holds shard_bytes.
  std::vector<Shard> shards(1);
  uint64_t total = 0;
  for (Plan& t : p.plans) {
    if (shards.back().data_bytes > 0 && shards.back().data_bytes + t.nbytes > o.shard_bytes) shards.emplace_back();
    t.shard = static_cast<int>(shards.size()) - 1;
    t.offset = shards.back().data_bytes;
    shards.back().data_bytes += t.nbytes;
    total += t.nbytes;
  }
  const int n_shards = static_cast<int>(shards.size());
  std::vector<JsonBuilder> headers(n_shards);
  for (JsonBuilder& h : headers) h.begin_object().key("__metadata__").begin_object().field("format", "mlx").end_object();
  for (const Plan& t : p.plans) {
    JsonBuilder& h = headers[t.shard];
    h.key(t.name).begin_object().field("dtype", dtype_name(t.dtype)).field("shape", t.shape);
    h.key("data_offsets").begin_array().value(t.offset).value(t.offset + t.nbytes).end_array().end_object();
  }
  for (int s = 0; s < n_shards; ++s) {
    shards[s].name = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, n_shards);
    std::string h = headers[s].end_object().finish().dump();
    h.append((8 - h.size() % 8) % 8, ' ');
    uint64_t len = h.size();
    shards[s].header.assign(reinterpret_cast<const char*>(&len), 8);
    shards[s].header += h;
  }

  TRY(make_dirs(o.out));
  uint64_t file_bytes = 0;
  for (auto& s : shards) file_bytes += s.header.size() + s.data_bytes;
  TRY(check_free_space(o.out, file_bytes + (64 << 20), "the synthetic checkpoint"));
  // config.json goes last: until then the directory holds no loadable checkpoint. A stale one goes first.
  std::string config_path = join_path(o.out, "config.json");
  ::unlink(config_path.c_str());

  std::vector<OutFile> files;
  for (auto& s : shards) {
    ASSIGN_OR_RETURN(OutFile f, OutFile::create(join_path(o.out, s.name), s.header.size() + s.data_bytes));
    TRY(f.write_at(s.header.data(), s.header.size(), 0));
    files.push_back(std::move(f));
  }
  struct Item { const Plan* t; uint64_t off, n; };
  std::vector<Item> items;
  for (const Plan& t : p.plans)
    for (uint64_t off = 0; off < t.nbytes; off += kChunk) items.push_back({&t, off, std::min(kChunk, t.nbytes - off)});
  LOG_INF("store", "synth: {} layers{}, {} experts, vocab {}, {} tensors, {} in {} shard(s) -> {}", g.layers,
          o.mtp ? " + MTP" : "", g.experts, g.vocab, p.plans.size(), format_bytes(total), n_shards, o.out);
  Progress prog("synth", total);
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<Status> errors(std::max(1, o.threads > 0 ? o.threads : static_cast<int>(std::thread::hardware_concurrency())));
  auto worker = [&](int id) {
    std::vector<uint8_t> buf(kChunk);
    for (size_t i; !failed && (i = next.fetch_add(1)) < items.size();) {
      const Item& it = items[i];
      generate(*it.t, it.off, it.n, buf.data());
      const Shard& sh = shards[it.t->shard];
      Status st = files[it.t->shard].write_at(buf.data(), it.n, sh.header.size() + it.t->offset + it.off);
      if (!st.ok()) { errors[id] = st; failed = true; return; }
      prog.add(it.n);
    }
  };
  std::vector<std::thread> pool;
  for (size_t i = 0; i < errors.size(); ++i) pool.emplace_back(worker, static_cast<int>(i));
  for (auto& th : pool) th.join();
  for (auto& e : errors) TRY(e);
  for (auto& f : files) TRY(f.commit(o.sync));
  JsonBuilder index;
  index.begin_object().key("metadata").begin_object().field("total_size", total).field("format", "mlx").end_object();
  index.key("weight_map").begin_object();
  for (const Plan& t : p.plans) index.field(t.name, shards[t.shard].name);
  index.end_object().end_object();
  TRY(write_file_atomic(join_path(o.out, "model.safetensors.index.json"), index.finish().dump(2) + "\n"));
  JsonBuilder gen_cfg;
  gen_cfg.begin_object().field("bos_token_id", g.eos).field("eos_token_id", g.eos).field("do_sample", false).end_object();
  TRY(write_file_atomic(join_path(o.out, "generation_config.json"), gen_cfg.finish().dump(2) + "\n"));
  TRY(write_file_atomic(config_path, make_config(g, o, quantization).dump(2) + "\n"));
  SynthReport r;
  r.bytes = total;
  r.seconds = prog.finish();
  r.cpu_seconds = prog.cpu_seconds();
  r.shards = n_shards;
  return r;
}

}  // namespace ck::store
