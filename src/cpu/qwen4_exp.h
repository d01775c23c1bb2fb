// The CPU reference of the qwen4_exp text model in fp32, written to be read beside
// shared/spec/qwen4_exp.md (section numbers in comments). It is the oracle for the CUDA engine and
// runs in CI. One Session is one sequence: its caches (§11) plus step_rows/commit with rollback of
// the recurrent state (shared/DESIGN.md §1 "Session").
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "format/weights.h"

namespace ck::cpu {

// Per-layer sequence state. Positional caches (KV, raw indexer keys) are indexed by position and
// simply overwritten past `pos`; recurrent state (GDN, conv histories, n-gram context) is what a
// snapshot saves.
struct LayerState {
  // GDN (§6): last (kernel-1) pre-conv qkv vectors, oldest first; recurrent S per value head.
  std::vector<float> gdn_conv;   // (kernel-1, conv_dim)
  std::vector<float> gdn_s;      // (n_value_heads, key_head_dim, value_head_dim)
  // QSA attention (§7): post-norm post-RoPE K, V and the raw indexer key of every position.
  std::vector<float> k_cache;    // (positions, n_kv_heads * head_dim)
  std::vector<float> v_cache;    // (positions, n_kv_heads * head_dim)
  std::vector<float> idx_keys;   // (positions, indexer_head_dim)
  // PLE (§5): last (kernel-1)*dilation normed conv inputs, oldest first; last ngram_size-1 ids.
  std::vector<float> ple_conv;   // ((kernel-1)*ngram_size, W)
  std::vector<int64_t> ngram_ctx;
};

// The recurrent part of a sequence's state: what rollback restores.
struct RecurrentSnapshot {
  std::vector<std::vector<float>> gdn_conv, gdn_s, ple_conv;
  std::vector<std::vector<int64_t>> ngram_ctx;
};

// Which rows of a step produce outputs. A prompt's prefill needs only its last row: kLast skips the
// final mixer and LM head of every other row (on a 248k vocabulary the LM head is a large share of
// prefill), and the StepResult then holds that one row.
enum class RowOutputs { kEvery, kLast };

struct StepResult {
  std::vector<int32_t> argmax;            // (n) greedy token per output row
  std::vector<float> logits;              // (n, vocab) when requested
  std::vector<float> hidden;              // (n, W) pre-mixer wide residual R_last, for MTP
  // n = rows of the step (RowOutputs::kEvery) or 1, its last row (RowOutputs::kLast).
};

class Model;

class Session {
 public:
  explicit Session(const Model& model);

  // Runs `tokens` at positions pos().. as rows; nothing is committed until commit(n). With `snap`,
  // the recurrent state after every row is kept so that commit(n < rows) can roll back.
  Status step_rows(std::span<const int32_t> tokens, bool snap, bool want_logits, StepResult* out,
                   RowOutputs which = RowOutputs::kEvery);
  // Accepts the first n rows of the last step_rows (n >= 1; n < rows needs snap).
  void commit(int n);
  int64_t pos() const { return pos_; }

  // MTP draft (spec §10): hidden `h_in` (W) and next token id at MTP position `mtp_pos`; writes the
  // draft logits (vocab) and the new wide hidden (W). The MTP's own KV caches live here.
  Status mtp_step(const float* h_in, int32_t next_token, int64_t mtp_pos, float* logits, float* h_out);

 private:
  Status token_forward(int32_t token, int64_t pos, float* logits, float* hidden);
  RecurrentSnapshot snapshot() const;
  void restore(const RecurrentSnapshot& s);

  const Model& m_;
  std::vector<LayerState> layers_;
  LayerState mtp_state_;
  int64_t pos_ = 0;
  int pending_rows_ = 0;
  bool pending_snap_ = false;
  std::vector<RecurrentSnapshot> pending_snaps_;  // state after row i, for i < rows-1
};

class Model {
 public:
  Model(const ModelWeights& w, std::shared_ptr<ExpertSource> experts);
  const ModelConfig& cfg() const { return w_.cfg; }
  const ModelWeights& weights() const { return w_; }
  bool has_mtp() const { return w_.mtp.has_value(); }
  std::unique_ptr<Session> new_session() const { return std::make_unique<Session>(*this); }

  // ---- the layer pieces, each one spec section; public for tests and the CUDA parity checks ----
  // §4 mix: u (H) and injection weights w (S, or none when hc has no inject head).
  void hc_mix(const HcWeights& hc, const float* R, float* u, float* w) const;
  // §4 combine: R_s += o · w_s.
  void hc_combine(float* R, const float* o, const float* w) const;
  // §6 one token through a GDN layer; updates st.gdn_conv / gdn_s.
  void gdn_token(const GdnWeights& g, LayerState& st, const float* u, float* out) const;
  // §7 one token through a QSA attention layer at position pos; writes caches at pos.
  void attn_token(const AttnWeights& a, LayerState& st, const float* u, int64_t pos, float* out) const;
  // §5 PLE contribution added to R (W) for token at pos; updates st.ple_conv / ngram_ctx.
  void ple_token(const PleWeights& p, LayerState& st, const float* R, int32_t token, float* out) const;
  // §8 MoE of record layer `rl` (trunk layer, or n_layers for MTP).
  Status moe_token(const MoeWeights& m, int rl, const float* u, float* out) const;
  // §5.1-5.3: the n-gram row ids of `token` given the context (updated).
  std::vector<int64_t> ngram_rows(const PleWeights& p, std::vector<int64_t>& ctx, int32_t token) const;
  // §5.1-5.4 for a run of tokens (ple_token's one, a CUDA step's rows on the host): each token's row
  // ids in order (ctx advances token by token; ctx_after, when given, gets the context after each
  // token), then its table rows dequantized to out + r * ld, head-major (ple_token's embedding). Rows
  // are read in parallel from 64 tokens on; the values do not depend on it.
  void ple_gather(const PleWeights& p, std::vector<int64_t>& ctx, std::span<const int32_t> tokens, float* out,
                  size_t ld, std::vector<std::vector<int64_t>>* ctx_after = nullptr) const;
  // One whole decoder layer (§2 a-c) on the wide residual R.
  Status layer_token(const LayerWeights& lw, int rl, LayerState& st, float* R, int32_t token, int64_t pos) const;

  void init_state(LayerState& st, const LayerWeights& lw) const;

 private:
  const ModelWeights& w_;
  std::shared_ptr<ExpertSource> experts_;
};

}  // namespace ck::cpu
