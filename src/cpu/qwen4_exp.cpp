// CPU reference forward of qwen4_exp, token by token, in fp32. Section numbers refer to
// shared/spec/qwen4_exp.md; HF means transformers 5.17.0 modeling_qwen4_exp.py. In fp32 the spec's
// bf16 roundings are identities, so each step below is the spec's formula without them.
#include "cpu/qwen4_exp.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/ops.h"

namespace ck::cpu {

Model::Model(const ModelWeights& w, std::shared_ptr<ExpertSource> experts) : w_(w), experts_(std::move(experts)) {}

// ---------------------------------------------------------------- §4 hyper-connections
void Model::hc_mix(const HcWeights& hc, const float* R, float* u, float* w) const {
  const ModelConfig& c = cfg();
  const int H = c.hidden_size, S = c.hc_count, W = c.wide();
  std::vector<float> X(W), d(c.hc_lowrank), g(W);
  rmsnorm_grouped(R, W, H, hc.norm.data(), static_cast<float>(c.rms_norm_eps), X.data());
  matvec(hc.down, X.data(), d.data());
  for (float& v : d) v = silu(v / static_cast<float>(S));  // divide by S before the activation (trap 4)
  matvec(hc.up, d.data(), g.data());
  for (int i = 0; i < H; ++i) {
    float acc = 0.0f;
    for (int s = 0; s < S; ++s) acc += sigmoid(g[s * H + i]) * X[s * H + i];
    u[i] = acc / static_cast<float>(S);
  }
  if (w && !hc.inject.empty()) {
    std::vector<float> l(S);
    matvec(hc.inject, X.data(), l.data());
    for (int s = 0; s < S; ++s) w[s] = 2.0f * sigmoid(l[s] / static_cast<float>(S));
  }
}

void Model::hc_combine(float* R, const float* o, const float* w) const {
  const int H = cfg().hidden_size, S = cfg().hc_count;
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < H; ++i) R[s * H + i] += o[i] * w[s];
}

// ---------------------------------------------------------------- §6 Gated DeltaNet
void Model::gdn_token(const GdnWeights& g, LayerState& st, const float* u, float* out) const {
  const ModelConfig& c = cfg();
  const int C = c.gdn_conv_dim(), K = c.linear_conv_kernel_dim;
  const int nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
  const int dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, Kd = c.gdn_key_dim();
  std::vector<float> x(C), z(nv * dv), b(nv), a(nv), y(C);
  matvec(g.in_qkv, u, x.data());
  matvec(g.in_z, u, z.data());
  matvec(g.in_b, u, b.data());
  matvec(g.in_a, u, a.data());
  // Causal depthwise conv: tap K-1 is the current token, history zero at the start (trap 14).
  for (int ch = 0; ch < C; ++ch) {
    float acc = g.conv[ch * K + (K - 1)] * x[ch];
    for (int j = 0; j < K - 1; ++j) acc += g.conv[ch * K + j] * st.gdn_conv[j * C + ch];
    y[ch] = silu(acc);
  }
  if (K > 1) {  // shift the history and append this token's pre-conv input
    std::memmove(st.gdn_conv.data(), st.gdn_conv.data() + C, sizeof(float) * C * (K - 2));
    std::memcpy(st.gdn_conv.data() + static_cast<size_t>(C) * (K - 2), x.data(), sizeof(float) * C);
  }
  float* q = y.data();
  float* k = y.data() + Kd;
  const float* v = y.data() + 2 * Kd;
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(dk));
  for (int h = 0; h < nk; ++h) {
    l2norm(q + h * dk, dk, 1e-6f);
    for (int i = 0; i < dk; ++i) q[h * dk + i] *= q_scale;  // 1/sqrt(dk) after the L2 norm (trap 13)
    l2norm(k + h * dk, dk, 1e-6f);
  }
  std::vector<float> o(nv * dv), m(dv), delta(dv);
  const int group = nv / nk;
  for (int h = 0; h < nv; ++h) {
    const int kh = h / group;  // repeat_interleave grouping (trap 12)
    const float beta = sigmoid(b[h]);
    const float gate = -std::exp(g.a_log[h]) * softplus(a[h] + g.dt_bias[h]);
    const float decay = std::exp(gate);
    float* S = st.gdn_s.data() + static_cast<size_t>(h) * dk * dv;
    const float* kk = k + kh * dk;
    const float* qq = q + kh * dk;
    for (int i = 0; i < dk * dv; ++i) S[i] *= decay;
    std::fill(m.begin(), m.end(), 0.0f);
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < dv; ++j) m[j] += S[i * dv + j] * kk[i];
    for (int j = 0; j < dv; ++j) delta[j] = beta * (v[h * dv + j] - m[j]);
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < dv; ++j) S[i * dv + j] += kk[i] * delta[j];
    float* oh = o.data() + h * dv;
    std::fill(oh, oh + dv, 0.0f);
    for (int i = 0; i < dk; ++i)
      for (int j = 0; j < dv; ++j) oh[j] += S[i * dv + j] * qq[i];
    // Gated RMS norm (N2): plain weight, then the output gate act(z).
    float ss = 0.0f;
    for (int j = 0; j < dv; ++j) ss += oh[j] * oh[j];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(dv) + static_cast<float>(c.rms_norm_eps));
    const bool sig = c.output_gate_type == "sigmoid";
    for (int j = 0; j < dv; ++j) {
      const float zz = z[h * dv + j];
      oh[j] = g.norm[j] * (oh[j] * r) * (sig ? sigmoid(zz) : silu(zz));
    }
  }
  matvec(g.out, o.data(), out);
}

// ---------------------------------------------------------------- §7 QSA attention
void Model::attn_token(const AttnWeights& a, LayerState& st, const float* u, int64_t pos, float* out) const {
  const ModelConfig& c = cfg();
  const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const int rot = c.rotary_dim();
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> qg(nh * 2 * hd), q(nh * hd), gate(nh * hd), k(nkv * hd), v(nkv * hd);
  matvec(a.q, u, qg.data());
  matvec(a.k, u, k.data());
  matvec(a.v, u, v.data());
  for (int h = 0; h < nh; ++h) {  // rows interleaved per head: [query | gate] (trap 6)
    rmsnorm_grouped(qg.data() + h * 2 * hd, hd, hd, a.q_norm.data(), eps, q.data() + h * hd);
    std::memcpy(gate.data() + h * hd, qg.data() + h * 2 * hd + hd, sizeof(float) * hd);
    rope(q.data() + h * hd, rot, pos, c.rope_theta);
  }
  for (int g = 0; g < nkv; ++g) {
    rmsnorm_grouped(k.data() + g * hd, hd, hd, a.k_norm.data(), eps, k.data() + g * hd);
    rope(k.data() + g * hd, rot, pos, c.rope_theta);
  }
  const size_t kv_w = static_cast<size_t>(nkv) * hd;
  if (st.k_cache.size() < (pos + 1) * kv_w) {
    st.k_cache.resize((pos + 1) * kv_w);
    st.v_cache.resize((pos + 1) * kv_w);
  }
  std::memcpy(st.k_cache.data() + pos * kv_w, k.data(), sizeof(float) * kv_w);
  std::memcpy(st.v_cache.data() + pos * kv_w, v.data(), sizeof(float) * kv_w);

  // §7.3 indexer: which tokens this query may attend to.
  const int inh = c.indexer_n_heads, ihd = c.indexer_head_dim, cr = c.indexer_compress_ratio;
  std::vector<float> iqk((inh + 1) * ihd), iq(inh * ihd);
  matvec(a.index_qk, u, iqk.data());
  if (st.idx_keys.size() < static_cast<size_t>((pos + 1) * ihd)) st.idx_keys.resize((pos + 1) * ihd);
  std::memcpy(st.idx_keys.data() + pos * ihd, iqk.data() + inh * ihd, sizeof(float) * ihd);  // raw key
  for (int h = 0; h < inh; ++h) {
    rmsnorm_grouped(iqk.data() + h * ihd, ihd, ihd, a.index_q_norm.data(), eps, iq.data() + h * ihd);
    rope(iq.data() + h * ihd, rot, pos, c.rope_theta);
  }
  const int64_t n = pos + 1, nb = n / cr;
  const int block_topk = c.indexer_budget / cr;
  std::vector<char> selected(static_cast<size_t>(n), 0);
  for (int64_t t = nb * cr; t < n; ++t) selected[t] = 1;  // the incomplete tail is always kept
  if (nb <= block_topk) {
    for (int64_t t = 0; t < nb * cr; ++t) selected[t] = 1;  // every block wins: dense causal
  } else {
    std::vector<float> scores(static_cast<size_t>(nb)), kb(ihd), kn(ihd);
    for (int64_t b = 0; b < nb; ++b) {
      // Mean of the raw keys, then k_layernorm, then RoPE at the block's first position (trap 9).
      std::fill(kb.begin(), kb.end(), 0.0f);
      for (int t = 0; t < cr; ++t)
        for (int i = 0; i < ihd; ++i) kb[i] += st.idx_keys[(b * cr + t) * ihd + i];
      for (int i = 0; i < ihd; ++i) kb[i] /= static_cast<float>(cr);
      rmsnorm_grouped(kb.data(), ihd, ihd, a.index_k_norm.data(), eps, kn.data());
      rope(kn.data(), rot, b * cr, c.rope_theta);
      float s = 0.0f;
      for (int h = 0; h < inh; ++h) {
        float dot = 0.0f;
        for (int i = 0; i < ihd; ++i) dot += iq[h * ihd + i] * kn[i];
        s += std::max(dot, 0.0f);
      }
      scores[b] = s / std::sqrt(static_cast<float>(ihd));
    }
    for (int b : topk_desc(scores, block_topk))
      for (int t = 0; t < cr; ++t) selected[b * cr + t] = 1;
  }

  // §7.4 gated GQA softmax attention over the selected keys.
  std::vector<float> attn(nh * hd, 0.0f), p(static_cast<size_t>(n));
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int rep = nh / nkv;
  for (int h = 0; h < nh; ++h) {
    const int g = h / rep;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      if (!selected[j]) continue;
      const float* kj = st.k_cache.data() + j * kv_w + g * hd;
      float s = 0.0f;
      for (int i = 0; i < hd; ++i) s += q[h * hd + i] * kj[i];
      p[j] = s * scale;
      mx = std::max(mx, p[j]);
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; ++j)
      if (selected[j]) { p[j] = std::exp(p[j] - mx); sum += p[j]; }
    float* ah = attn.data() + h * hd;
    for (int64_t j = 0; j < n; ++j) {
      if (!selected[j]) continue;
      const float* vj = st.v_cache.data() + j * kv_w + g * hd;
      const float pj = p[j] / sum;
      for (int i = 0; i < hd; ++i) ah[i] += pj * vj[i];
    }
  }
  for (int i = 0; i < nh * hd; ++i) attn[i] *= sigmoid(gate[i]);
  matvec(a.o, attn.data(), out);
}

// ---------------------------------------------------------------- §5 PLE
std::vector<int64_t> Model::ngram_rows(const PleWeights& p, std::vector<int64_t>& ctx, int32_t token) const {
  const ModelConfig& c = cfg();
  const int n_ctx = c.ngram_size - 1;
  const int64_t eos = c.ple_eos();
  // s_k for k = 0..n_ctx: the k-back token, replaced by EOS once an EOS lies between (trap 18).
  // ctx holds the previous n_ctx ids, oldest first.
  std::vector<int64_t> s(c.ngram_size);
  s[0] = token;
  bool blocked = false;
  for (int k = 1; k <= n_ctx; ++k) {
    int64_t prev = ctx[n_ctx - k];
    s[k] = blocked ? eos : prev;
    if (prev == eos) blocked = true;  // tokens further back are cut off by this EOS
  }
  std::vector<int64_t> rows;
  for (int order = 2; order <= c.ngram_size; ++order) {
    int64_t mixed = s[0] * p.multipliers[0];
    for (int k = 1; k < order; ++k) mixed ^= s[k] * p.multipliers[k];  // int64 products wrap as in torch
    for (int j = 0; j < c.heads_per_ngram; ++j) {
      const int head = (order - 2) * c.heads_per_ngram + j;
      int64_t m = mixed % p.head_sizes[head];
      if (m < 0) m += p.head_sizes[head];  // floor-mod (torch.remainder)
      rows.push_back(m + p.head_offsets[head]);
    }
  }
  if (n_ctx > 0) {
    std::rotate(ctx.begin(), ctx.begin() + 1, ctx.end());
    ctx.back() = token;
  }
  return rows;
}

void Model::ple_gather(const PleWeights& p, std::vector<int64_t>& ctx, std::span<const int32_t> tokens, float* out,
                       size_t ld, std::vector<std::vector<int64_t>>* ctx_after) const {
  const int n = static_cast<int>(tokens.size()), rd = cfg().ngram_row_dim();
  // The ids in order (each token's context is the tokens before it; cheap), then the table rows: a
  // prefill chunk's 2,048 tokens x 16 rows of dequantizing took 14 ms on one core, time in which the
  // GPU waits for the chunk (2026-12-01).
  std::vector<std::vector<int64_t>> ids(static_cast<size_t>(n));
  if (ctx_after) ctx_after->resize(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    ids[r] = ngram_rows(p, ctx, tokens[r]);
    if (ctx_after) (*ctx_after)[r] = ctx;
  }
#pragma omp parallel for schedule(static) if (n >= 64)
  for (int r = 0; r < n; ++r)
    for (size_t j = 0; j < ids[r].size(); ++j) p.table_row(ids[r][j], out + r * ld + j * rd);
}

void Model::ple_token(const PleWeights& p, LayerState& st, const float* R, int32_t token, float* out) const {
  const ModelConfig& c = cfg();
  const int H = c.hidden_size, S = c.hc_count, W = c.wide(), E = c.ple_embed_dim;
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> emb(E), key(W), kn(W), val(H), qn(W), G(W), Gn(W);
  ple_gather(p, st.ngram_ctx, std::span<const int32_t>(&token, 1), emb.data(), static_cast<size_t>(E));
  matvec(p.key, emb.data(), key.data());
  rmsnorm_grouped(key.data(), W, H, p.norm_key.data(), eps, kn.data());
  matvec(p.value, emb.data(), val.data());
  rmsnorm_grouped(R, W, H, p.norm_query.data(), eps, qn.data());
  for (int s = 0; s < S; ++s) {
    float a = 0.0f;
    for (int i = 0; i < H; ++i) a += kn[s * H + i] * qn[s * H + i];
    a /= std::sqrt(static_cast<float>(H));
    // Signed square root; the 1e-6 is a clamp (trap 16). sign(0) = 0.
    float sgn = a > 0 ? 1.0f : (a < 0 ? -1.0f : 0.0f);
    a = std::sqrt(std::max(std::fabs(a), 1e-6f)) * sgn;
    const float gate = sigmoid(a);
    for (int i = 0; i < H; ++i) G[s * H + i] = gate * val[i];
  }
  rmsnorm_grouped(G.data(), W, H, p.norm_conv.data(), eps, Gn.data());
  // Dilated depthwise conv over normed G: taps at t-(K-1)d .. t (trap 17), history oldest first.
  const int K = c.ple_conv_kernel_size, d = c.ngram_size, hist = (K - 1) * d;
  for (int ch = 0; ch < W; ++ch) {
    float acc = p.conv[ch * K + (K - 1)] * Gn[ch];
    for (int j = 0; j < K - 1; ++j) {
      const int back = (K - 1 - j) * d;  // how many steps back tap j looks
      acc += p.conv[ch * K + j] * st.ple_conv[(hist - back) * W + ch];
    }
    out[ch] = G[ch] + silu(acc);  // the residual adds the un-normalised G
  }
  if (hist > 0) {
    std::memmove(st.ple_conv.data(), st.ple_conv.data() + W, sizeof(float) * W * (hist - 1));
    std::memcpy(st.ple_conv.data() + static_cast<size_t>(W) * (hist - 1), Gn.data(), sizeof(float) * W);
  }
}

// ---------------------------------------------------------------- §8 MoE
Status Model::moe_token(const MoeWeights& m, int rl, const float* u, float* out) const {
  const ModelConfig& c = cfg();
  const int H = c.hidden_size, I = c.moe_intermediate_size, SI = c.shared_expert_intermediate_size;
  std::vector<float> logits(c.num_experts);
  matvec(m.router, u, logits.data());
  // Softmax over all experts, top-k (ties to the lower index), optional renormalisation.
  float mx = *std::max_element(logits.begin(), logits.end()), sum = 0.0f;
  for (float& l : logits) { l = std::exp(l - mx); sum += l; }
  for (float& l : logits) l /= sum;
  std::vector<int> top = topk_desc(logits, c.num_experts_per_tok);
  float top_sum = 0.0f;
  for (int e : top) top_sum += logits[e];
  // The sum over experts runs in top-k slot order, whatever tier an expert came from (DESIGN §2).
  std::vector<double> acc(H, 0.0);
  std::vector<float> gt(I), up(I), y(H);
  std::vector<uint8_t> scratch;
  for (int e : top) {
    const float weight = c.norm_topk_prob ? logits[e] / top_sum : logits[e];
    ExpertMatrices ex;
    TRY(experts_->get(rl, e, &ex, &scratch));
    matvec(ex.gate, u, gt.data());
    matvec(ex.up, u, up.data());
    for (int i = 0; i < I; ++i) gt[i] = silu(gt[i]) * up[i];
    matvec(ex.down, gt.data(), y.data());
    for (int i = 0; i < H; ++i) acc[i] += static_cast<double>(y[i] * weight);
  }
  std::vector<float> sg(SI), su(SI), sh(H);
  matvec(m.shared_gate, u, sg.data());
  matvec(m.shared_up, u, su.data());
  for (int i = 0; i < SI; ++i) sg[i] = silu(sg[i]) * su[i];
  matvec(m.shared_down, sg.data(), sh.data());
  float gl;
  matvec(m.shared_expert_gate, u, &gl);
  const float gamma = sigmoid(gl);
  for (int i = 0; i < H; ++i) out[i] = static_cast<float>(acc[i]) + gamma * sh[i];
  return {};
}

// ---------------------------------------------------------------- §2 decoder layer
Status Model::layer_token(const LayerWeights& lw, int rl, LayerState& st, float* R, int32_t token, int64_t pos) const {
  const ModelConfig& c = cfg();
  const int H = c.hidden_size, S = c.hc_count, W = c.wide();
  std::vector<float> u(H), o(H), w(S);
  if (lw.ple) {  // a: PLE adds to the residual before the attention mix (trap 17)
    std::vector<float> p(W);
    ple_token(*lw.ple, st, R, token, p.data());
    for (int i = 0; i < W; ++i) R[i] += p[i];
  }
  hc_mix(lw.hc_attn, R, u.data(), w.data());  // b
  if (lw.kind == LayerKind::LinearAttention) gdn_token(lw.gdn, st, u.data(), o.data());
  else attn_token(lw.attn, st, u.data(), pos, o.data());
  hc_combine(R, o.data(), w.data());
  hc_mix(lw.hc_mlp, R, u.data(), w.data());  // c
  TRY(moe_token(lw.moe, rl, u.data(), o.data()));
  hc_combine(R, o.data(), w.data());
  return {};
}

void Model::init_state(LayerState& st, const LayerWeights& lw) const {
  const ModelConfig& c = cfg();
  st = LayerState{};
  if (lw.kind == LayerKind::LinearAttention) {
    st.gdn_conv.assign(static_cast<size_t>(c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim(), 0.0f);
    st.gdn_s.assign(static_cast<size_t>(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim, 0.0f);
  }
  if (lw.ple) {
    st.ple_conv.assign(static_cast<size_t>(c.ple_conv_kernel_size - 1) * c.ngram_size * c.wide(), 0.0f);
    st.ngram_ctx.assign(static_cast<size_t>(c.ngram_size - 1), c.ple_eos());  // two virtual EOS tokens
  }
}

// ---------------------------------------------------------------- Session
Session::Session(const Model& model) : m_(model) {
  layers_.resize(model.weights().layers.size());
  for (size_t L = 0; L < layers_.size(); ++L) m_.init_state(layers_[L], model.weights().layers[L]);
  if (model.has_mtp()) m_.init_state(mtp_state_, model.weights().mtp->layer);
}

Status Session::token_forward(int32_t token, int64_t pos, float* logits, float* hidden) {
  const ModelWeights& w = m_.weights();
  const ModelConfig& c = w.cfg;
  if (token < 0 || token >= c.vocab_size)
    return error("token id {} at position {} is outside the vocabulary [0, {})", token, pos, c.vocab_size);
  const int H = c.hidden_size, W = c.wide();
  std::vector<float> R(W), e(H), y(H);
  matrix_row(w.embed, token, e.data());
  for (int s = 0; s < c.hc_count; ++s) std::memcpy(R.data() + s * H, e.data(), sizeof(float) * H);  // trap 5
  for (size_t L = 0; L < w.layers.size(); ++L)
    TRY(m_.layer_token(w.layers[L], static_cast<int>(L), layers_[L], R.data(), token, pos));
  if (hidden) std::memcpy(hidden, R.data(), sizeof(float) * W);
  if (!logits) return {};  // a row without outputs (RowOutputs::kLast)
  m_.hc_mix(w.final_mixer, R.data(), y.data(), nullptr);  // §9: no final norm
  matvec(w.lm_head, y.data(), logits);
  return {};
}

RecurrentSnapshot Session::snapshot() const {
  RecurrentSnapshot s;
  for (auto& L : layers_) {
    s.gdn_conv.push_back(L.gdn_conv);
    s.gdn_s.push_back(L.gdn_s);
    s.ple_conv.push_back(L.ple_conv);
    s.ngram_ctx.push_back(L.ngram_ctx);
  }
  return s;
}

void Session::restore(const RecurrentSnapshot& s) {
  for (size_t i = 0; i < layers_.size(); ++i) {
    layers_[i].gdn_conv = s.gdn_conv[i];
    layers_[i].gdn_s = s.gdn_s[i];
    layers_[i].ple_conv = s.ple_conv[i];
    layers_[i].ngram_ctx = s.ngram_ctx[i];
  }
}

Status Session::step_rows(std::span<const int32_t> tokens, bool snap, bool want_logits, StepResult* out,
                          RowOutputs which) {
  CHECK_MSG(pending_rows_ == 0, "step_rows called twice without commit");
  if (tokens.empty()) return error("step_rows: no tokens");
  const int64_t V = m_.cfg().vocab_size, W = m_.cfg().wide();
  const int rows = static_cast<int>(tokens.size());
  const int first_out = which == RowOutputs::kLast ? rows - 1 : 0;  // rows before it produce no outputs
  const int n_out = rows - first_out;
  out->argmax.assign(n_out, 0);
  out->logits.assign(want_logits ? n_out * V : 0, 0.0f);
  out->hidden.assign(static_cast<size_t>(n_out) * W, 0.0f);
  pending_snaps_.clear();
  RecurrentSnapshot before;
  if (snap) before = snapshot();
  std::vector<float> logits(V);
  for (int r = 0; r < rows; ++r) {
    const int o = r - first_out;  // output row, or negative: no outputs
    Status st = token_forward(tokens[r], pos_ + r, o >= 0 ? logits.data() : nullptr,
                              o >= 0 ? out->hidden.data() + o * W : nullptr);
    if (!st.ok()) {
      if (snap) restore(before);
      return st;
    }
    if (o >= 0) {
      out->argmax[o] = argmax(logits);
      if (want_logits) std::copy(logits.begin(), logits.end(), out->logits.begin() + o * V);
    }
    if (snap && r + 1 < rows) pending_snaps_.push_back(snapshot());
  }
  pending_rows_ = rows;
  pending_snap_ = snap;
  return {};
}

void Session::commit(int n) {
  CHECK_MSG(n >= 1 && n <= pending_rows_, "commit({}) after a step of {} rows", n, pending_rows_);
  CHECK_MSG(n == pending_rows_ || pending_snap_, "commit({}) < rows {} needs snap", n, pending_rows_);
  if (n < pending_rows_) restore(pending_snaps_[n - 1]);
  pos_ += n;
  pending_rows_ = 0;
  pending_snaps_.clear();
}

// ---------------------------------------------------------------- §10 MTP draft head
Status Session::mtp_step(const float* h_in, int32_t next_token, int64_t mtp_pos, float* logits, float* h_out) {
  if (!m_.has_mtp()) return error("this model has no MTP head");
  const ModelWeights& w = m_.weights();
  const ModelConfig& c = w.cfg;
  const MtpWeights& mt = *w.mtp;
  if (next_token < 0 || next_token >= c.vocab_size)
    return error("MTP token id {} is outside the vocabulary [0, {})", next_token, c.vocab_size);
  const int H = c.hidden_size, W = c.wide(), S = c.hc_count;
  const float eps = static_cast<float>(c.rms_norm_eps);
  std::vector<float> e(H), en(H), fe(H), hn(W), fh(H), R(W), y(H);
  matrix_row(w.embed, next_token, e.data());
  rmsnorm_grouped(e.data(), H, H, mt.pre_fc_norm_embedding.data(), eps, en.data());
  matvec(mt.fc_embedding, en.data(), fe.data());
  // pre_fc_norm_hidden: one RMS statistic per stream (grouped), as every other wide norm and as the
  // small model was trained (spec §14 open question 1; it only affects acceptance).
  rmsnorm_grouped(h_in, W, H, mt.pre_fc_norm_hidden.data(), eps, hn.data());
  for (int s = 0; s < S; ++s) {
    matvec(mt.fc_hidden, hn.data() + s * H, fh.data());
    for (int i = 0; i < H; ++i) R[s * H + i] = fe[i] + fh[i];
  }
  TRY(m_.layer_token(mt.layer, c.num_hidden_layers, mtp_state_, R.data(), next_token, mtp_pos));
  if (h_out) std::memcpy(h_out, R.data(), sizeof(float) * W);
  m_.hc_mix(mt.mixer, R.data(), y.data(), nullptr);
  matvec(w.lm_head, y.data(), logits);
  return {};
}

}  // namespace ck::cpu
