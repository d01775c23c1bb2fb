// Random in-memory weights (random_model.h). Two passes: the first lays out every tensor and records
// what fills it, the second fills all of them on worker threads from counter-seeded generators, so
// the released geometry's tens of GB are ready in seconds and the bytes do not depend on threading.
#include "cuda/random_model.h"

#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include "util/half.h"

namespace ck::cuda {

namespace {

uint64_t mix64(uint64_t v) {
  v += 0x9E3779B97F4A7C15ull;
  v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9ull;
  v = (v ^ (v >> 27)) * 0x94D049BB133111EBull;
  return v ^ (v >> 31);
}

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(mix64(seed)) {}
  uint64_t next() {
    s += 0xa0761d6478bd642full;
    __uint128_t t = static_cast<__uint128_t>(s) * (s ^ 0xe7037ed1a0b428dbull);
    return static_cast<uint64_t>(t >> 64) ^ static_cast<uint64_t>(t);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }  // [0, 1)
};

void store_float(DType t, uint8_t* base, size_t i, float v) {
  switch (t) {
    case DType::F32: std::memcpy(base + 4 * i, &v, 4); break;
    case DType::BF16: { uint16_t h = f32_to_bf16(v); std::memcpy(base + 2 * i, &h, 2); break; }
    default: { uint16_t h = f32_to_f16(v); std::memcpy(base + 2 * i, &h, 2); break; }
  }
}

// Builds tensors; fills are deferred to run() so they can go in parallel.
class Builder {
 public:
  Builder(RandomModel* m, uint64_t seed) : m_(m), seed_(seed) {}

  // A [rows, cols] matrix with values about U(-amp, amp).
  Matrix matrix(int64_t rows, int64_t cols, WeightForm f, float amp, const std::string& name) {
    if (f.bits != 0 && cols % f.group != 0) f = WeightForm{};  // bf16 fallback
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.name = name;
    const uint64_t stream = next_stream();
    if (f.bits == 0) {
      m.dtype = f.dtype;
      const size_t n = static_cast<size_t>(rows * cols);
      uint8_t* p = m_->alloc(n * dtype_size(f.dtype));
      m.data = p;
      tasks_.push_back([=] {
        Rng r(stream);
        for (size_t i = 0; i < n; ++i) store_float(f.dtype, p, i, (2.0f * r.uniform() - 1.0f) * amp);
      });
      return m;
    }
    m.dtype = DType::U32;
    m.bits = f.bits;
    m.group_size = f.group;
    m.scale_dtype = f.scale_dtype;
    const size_t code_bytes = static_cast<size_t>(rows) * cols * f.bits / 8;
    const size_t groups = static_cast<size_t>(rows) * (cols / f.group);
    uint8_t* codes = m_->alloc(code_bytes);
    uint8_t* sc = m_->alloc(groups * dtype_size(f.scale_dtype));
    uint8_t* bi = m_->alloc(groups * dtype_size(f.scale_dtype));
    m.data = codes;
    m.scales = sc;
    m.biases = bi;
    // Codes: random bits, split in chunks so one big matrix spreads over the threads.
    constexpr size_t kChunk = size_t{8} << 20;
    for (size_t c0 = 0; c0 < code_bytes; c0 += kChunk) {
      const size_t c1 = std::min(code_bytes, c0 + kChunk);
      const uint64_t cs = mix64(stream ^ (c0 + 1));
      tasks_.push_back([=] {
        Rng r(cs);
        size_t i = c0;
        for (; i + 8 <= c1; i += 8) {
          const uint64_t v = r.next();
          std::memcpy(codes + i, &v, 8);
        }
        for (; i < c1; ++i) codes[i] = static_cast<uint8_t>(r.next());
      });
    }
    const float levels = static_cast<float>((1 << f.bits) - 1);
    tasks_.push_back([=] {
      Rng r(stream ^ 0x5ca1e);
      for (size_t g = 0; g < groups; ++g) {
        const float s = 2.0f * amp / levels * (0.75f + 0.5f * r.uniform());
        store_float(f.scale_dtype, sc, g, s);
        store_float(f.scale_dtype, bi, g, -0.5f * levels * s);
      }
    });
    return m;
  }

  std::vector<float> vec(int64_t n, float lo, float hi) {
    std::vector<float> v(static_cast<size_t>(n));
    Rng r(next_stream());
    for (float& x : v) x = lo + (hi - lo) * r.uniform();
    return v;
  }

  void run(int threads) {
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    std::atomic<size_t> next{0};
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&] {
        for (size_t i; (i = next.fetch_add(1)) < tasks_.size();) tasks_[i]();
      });
    for (auto& th : pool) th.join();
    tasks_.clear();
  }

 private:
  uint64_t next_stream() { return mix64(seed_ ^ mix64(++counter_)); }
  RandomModel* m_;
  uint64_t seed_;
  uint64_t counter_ = 0;
  std::vector<std::function<void()>> tasks_;
};

float amp_for(int64_t cols) { return std::sqrt(3.0f / static_cast<float>(cols)); }

}  // namespace

uint8_t* RandomModel::alloc(size_t n) {
  blobs_.emplace_back(new uint8_t[std::max<size_t>(n, 1)]);
  bytes_ += n;
  return blobs_.back().get();
}

ModelConfig released_config(int layers, int64_t ngram_base) {
  ModelConfig c;
  c.model_type = "qwen4_exp_text";
  c.vocab_size = 248320;
  c.hidden_size = 2560;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 24;
  c.num_key_value_heads = 2;
  c.head_dim = 256;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.25;
  c.linear_conv_kernel_dim = 4;
  c.linear_key_head_dim = 128;
  c.linear_value_head_dim = 128;
  c.linear_num_key_heads = 16;
  c.linear_num_value_heads = 48;
  c.output_gate_type = "sigmoid";
  c.num_experts = 512;
  c.num_experts_per_tok = 10;
  c.moe_intermediate_size = 640;
  c.shared_expert_intermediate_size = 640;
  c.norm_topk_prob = true;
  c.hc_count = 4;
  c.hc_lowrank = 320;
  c.ple_layer_ids = layers >= 2 ? std::vector<int>{2} : std::vector<int>{};
  c.ple_embed_dim = 2560;
  c.ple_conv_kernel_size = 4;
  c.ngram_size = 3;
  c.heads_per_ngram = 8;
  c.ngram_vocab_size_base = ngram_base;
  c.has_indexer = true;
  c.indexer_n_heads = 4;
  c.indexer_kv_heads = 1;
  c.indexer_head_dim = 128;
  c.indexer_budget = 2048;
  c.indexer_compress_ratio = 4;
  c.eos_token_ids = {248044};
  c.layer_types.clear();
  for (int i = 0; i < layers; ++i)
    c.layer_types.push_back((i + 1) % 4 == 0 ? LayerKind::SparseAttention : LayerKind::LinearAttention);
  return c;
}

std::unique_ptr<RandomModel> make_random_model(const ModelConfig& cfg, const RandomModelOptions& o) {
  auto rm = std::make_unique<RandomModel>();
  Builder b(rm.get(), o.seed);
  ModelWeights& w = rm->weights;
  w.cfg = cfg;
  const ModelConfig& c = cfg;
  const int64_t H = c.hidden_size, W = c.wide(), S = c.hc_count, V = c.vocab_size;
  auto hc = [&](bool inject, const std::string& name) {
    HcWeights h;
    h.norm = b.vec(W, 0.8f, 1.2f);
    h.down = b.matrix(c.hc_lowrank, W, o.dense, amp_for(W), name + ".down");
    h.up = b.matrix(W, c.hc_lowrank, o.dense, amp_for(c.hc_lowrank), name + ".up");
    if (inject) h.inject = b.matrix(S, W, o.dense, amp_for(W), name + ".inject");
    return h;
  };
  w.embed = b.matrix(V, H, o.dense, 1.0f, "embed");
  w.lm_head = b.matrix(V, H, o.dense, amp_for(H), "lm_head");
  w.final_mixer = hc(false, "final_mixer");
  rm->experts = std::make_shared<CheckpointExperts>();
  // Record layers: the trunk's, then the MTP head's (format/weights.h ExpertSource).
  rm->experts->table.resize(static_cast<size_t>(c.num_hidden_layers + (o.mtp ? 1 : 0)));
  w.layers.resize(static_cast<size_t>(c.num_hidden_layers));
  const int64_t I = c.moe_intermediate_size, SI = c.shared_expert_intermediate_size;
  // One decoder layer's weights (trunk layer L, or the MTP head's at record layer num_hidden_layers).
  auto make_layer = [&](LayerWeights& lw, int L, LayerKind kind, const std::string& p) {
    lw.kind = kind;
    lw.hc_attn = hc(true, p + ".hc_attn");
    lw.hc_mlp = hc(true, p + ".hc_mlp");
    if (lw.kind == LayerKind::LinearAttention) {
      const int64_t Kd = c.gdn_key_dim(), Vd = c.gdn_value_dim(), nv = c.linear_num_value_heads;
      lw.gdn.in_qkv = b.matrix(2 * Kd + Vd, H, o.dense, amp_for(H), p + ".in_qkv");
      lw.gdn.in_z = b.matrix(Vd, H, o.dense, amp_for(H), p + ".in_z");
      lw.gdn.in_b = b.matrix(nv, H, o.dense, amp_for(H), p + ".in_b");
      lw.gdn.in_a = b.matrix(nv, H, o.dense, amp_for(H), p + ".in_a");
      lw.gdn.out = b.matrix(H, Vd, o.dense, amp_for(Vd), p + ".out");
      lw.gdn.conv = b.vec(c.gdn_conv_dim() * static_cast<int64_t>(c.linear_conv_kernel_dim), -0.6f, 0.6f);
      lw.gdn.a_log = b.vec(nv, -2.0f, 0.5f);
      lw.gdn.dt_bias = b.vec(nv, -1.0f, 1.0f);
      lw.gdn.norm = b.vec(c.linear_value_head_dim, 0.8f, 1.2f);
    } else {
      const int64_t nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
      lw.attn.q = b.matrix(nh * 2 * hd, H, o.dense, amp_for(H), p + ".q");
      lw.attn.k = b.matrix(nkv * hd, H, o.dense, amp_for(H), p + ".k");
      lw.attn.v = b.matrix(nkv * hd, H, o.dense, amp_for(H), p + ".v");
      lw.attn.o = b.matrix(H, nh * hd, o.dense, amp_for(nh * hd), p + ".o");
      lw.attn.q_norm = b.vec(hd, 0.8f, 1.2f);
      lw.attn.k_norm = b.vec(hd, 0.8f, 1.2f);
      lw.attn.index_qk =
          b.matrix(static_cast<int64_t>(c.indexer_n_heads + 1) * c.indexer_head_dim, H, o.dense, amp_for(H), p + ".iqk");
      lw.attn.index_q_norm = b.vec(c.indexer_head_dim, 0.8f, 1.2f);
      lw.attn.index_k_norm = b.vec(c.indexer_head_dim, 0.8f, 1.2f);
    }
    const int pi = L < c.num_hidden_layers ? c.ple_index_of_layer(L) : -1;
    if (pi >= 0) {
      PleWeights pw;
      const int64_t E = c.ple_embed_dim;
      pw.ple_index = pi;
      pw.key = b.matrix(W, E, o.dense, amp_for(E), p + ".ple.key");
      pw.value = b.matrix(H, E, o.dense, amp_for(E), p + ".ple.value");
      pw.norm_key = b.vec(W, 0.8f, 1.2f);
      pw.norm_query = b.vec(W, 0.8f, 1.2f);
      pw.norm_conv = b.vec(W, 0.8f, 1.2f);
      pw.conv = b.vec(W * c.ple_conv_kernel_size, -0.6f, 0.6f);
      pw.multipliers = ngram_multipliers(c, pi);
      pw.head_sizes = ngram_head_sizes(c, pi);
      int64_t total = 0;
      for (int64_t s : pw.head_sizes) { pw.head_offsets.push_back(total); total += s; }
      const int64_t div = c.make_ngram_vocab_size_divisible_by;
      const int64_t padded = (total + div - 1) / div * div;
      pw.table_parts.push_back(b.matrix(padded, c.ngram_row_dim(), o.ngram, 1.0f, p + ".ple.table"));
      lw.ple = std::move(pw);
    }
    lw.moe.router = b.matrix(c.num_experts, H, o.router, amp_for(H), p + ".router");
    lw.moe.shared_gate = b.matrix(SI, H, o.dense, amp_for(H), p + ".sh_gate");
    lw.moe.shared_up = b.matrix(SI, H, o.dense, amp_for(H), p + ".sh_up");
    lw.moe.shared_down = b.matrix(H, SI, o.dense, amp_for(SI), p + ".sh_down");
    lw.moe.shared_expert_gate = b.matrix(1, H, o.router, amp_for(H), p + ".sh_expert_gate");
    auto& ex = rm->experts->table[L];
    ex.resize(static_cast<size_t>(c.num_experts));
    for (int e = 0; e < c.num_experts; ++e) {
      const std::string q = p + ".expert" + std::to_string(e);
      ex[e].gate = b.matrix(I, H, o.experts, amp_for(H), q + ".gate");
      ex[e].up = b.matrix(I, H, o.experts, amp_for(H), q + ".up");
      ex[e].down = b.matrix(H, I, o.experts, amp_for(I), q + ".down");
    }
  };
  for (int L = 0; L < c.num_hidden_layers; ++L) make_layer(w.layers[L], L, c.layer_types[L], "layers." + std::to_string(L));
  if (o.mtp) {  // spec §10: norms of the embedding and the wide hidden, two H x H projections, a QSA layer, a mixer
    MtpWeights m;
    m.pre_fc_norm_embedding = b.vec(H, 0.8f, 1.2f);
    m.pre_fc_norm_hidden = b.vec(W, 0.8f, 1.2f);
    m.fc_embedding = b.matrix(H, H, o.dense, amp_for(2 * H), "mtp.fc_embedding");
    m.fc_hidden = b.matrix(H, H, o.dense, amp_for(2 * H), "mtp.fc_hidden");
    make_layer(m.layer, c.num_hidden_layers, LayerKind::SparseAttention, "mtp.layer");
    m.mixer = hc(false, "mtp.mixer");
    w.mtp = std::move(m);
  }
  b.run(o.threads);
  return rm;
}

}  // namespace ck::cuda
