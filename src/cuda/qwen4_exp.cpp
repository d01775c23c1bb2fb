// The CUDA forward of qwen4_exp (cuda/qwen4_exp.h). enqueue_step() reads top to bottom like the CPU's
// token_forward/layer_token and puts a whole step on one stream with no host synchronisation; the
// same function is captured into a graph per (rows, want_logits) and replayed. Every buffer is fp32;
// activation buffers hold one prefill chunk's rows (the session's chunk_rows, at most kMaxChunkRows; a
// row-path step uses kMaxRows of them) at a leading dimension rounded up to 4 floats (16 bytes).
#include "cuda/qwen4_exp.h"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "cpu/ops.h"
#include "cuda/layers.h"
#include "cuda/ops.h"
#include "util/log.h"

namespace ck::cuda {

namespace {
int ld4(int64_t n) { return static_cast<int>(round_up(n, 4)); }

// Sums bytes and multiply-adds of the matrices a token reads.
struct Tally {
  double bytes = 0, macs = 0;
  void add(const DMatrix& m) {
    if (m.rows == 0) return;
    bytes += static_cast<double>(m.stored_bytes());
    macs += static_cast<double>(m.rows) * m.cols;
  }
  void add(const DHc& h) { add(h.down); add(h.up); add(h.inject); }
  // A decoder layer's dense matrices, the ones one token reads (its kind's mixer, PLE, router and
  // shared expert); routed experts are counted apart.
  void add(const DLayer& d) {
    add(d.hc_attn);
    add(d.hc_mlp);
    if (d.kind == LayerKind::LinearAttention) {
      for (const DMatrix* m : {&d.gdn.in_qkv, &d.gdn.in_z, &d.gdn.in_b, &d.gdn.in_a, &d.gdn.out}) add(*m);
    } else {
      for (const DMatrix* m : {&d.attn.q, &d.attn.k, &d.attn.v, &d.attn.o, &d.attn.index_qk}) add(*m);
    }
    if (d.ple) { add(d.ple->key); add(d.ple->value); }
    for (const DMatrix* m : {&d.moe.router, &d.moe.sh_gate, &d.moe.sh_up, &d.moe.sh_down, &d.moe.sh_expert_gate})
      add(*m);
  }
};
}  // namespace

// ==================================================================== Model

Status Model::supports(const ModelWeights& w) {
  const ModelConfig& c = w.cfg;
  if (c.num_experts_per_tok > 64 || c.num_experts > 8192)
    return error("CUDA engine: top-{} of {} experts is beyond its router (k <= 64, E <= 8192)", c.num_experts_per_tok,
                 c.num_experts);
  if (c.linear_conv_kernel_dim < 1 || c.linear_conv_kernel_dim > 8)
    return error("CUDA engine: GDN conv kernel {} (1..8 supported)", c.linear_conv_kernel_dim);
  bool has_attn = false, has_ple = false, has_gdn = false;
  for (const LayerWeights& lw : w.layers) {
    has_attn |= lw.kind == LayerKind::SparseAttention;
    has_gdn |= lw.kind == LayerKind::LinearAttention;
    has_ple |= lw.ple.has_value();
  }
  if (has_gdn && !gdn_recurrent_fits(c.linear_key_head_dim, c.linear_value_head_dim))
    return error("CUDA engine: GDN heads of linear_key_head_dim {} x linear_value_head_dim {} are beyond the "
                 "recurrent kernel (a block of at most 512 threads: value columns, in blocks of 32 where "
                 "linear_value_head_dim is a multiple of 32 from 64 to 1024, times ceil(linear_key_head_dim / 32))",
                 c.linear_key_head_dim, c.linear_value_head_dim);
  if (w.mtp) {  // §10: one attention layer, no PLE (mtp_step has no n-gram path)
    if (w.mtp->layer.kind != LayerKind::SparseAttention || w.mtp->layer.ple)
      return error("CUDA engine: the MTP head's layer must be a QSA attention layer without PLE");
    has_attn = true;
  }
  if (has_attn) {
    if (!c.has_indexer || c.indexer_compress_ratio < 1 || c.indexer_budget < c.indexer_compress_ratio)
      return error("CUDA engine: attention layers need the QSA indexer (compress ratio and budget)");
    if (c.rotary_dim() > c.head_dim || c.rotary_dim() > c.indexer_head_dim)
      return error("CUDA engine: rotary dim {} exceeds a head dim", c.rotary_dim());
    if (attention_max_selected(c.indexer_budget / c.indexer_compress_ratio, c.indexer_compress_ratio) * 8 > 200 * 1024)
      return error("CUDA engine: indexer_budget {} with indexer_compress_ratio {} selects more keys than the "
                   "attention kernel holds (indexer_budget + indexer_compress_ratio <= 25,601)",
                   c.indexer_budget, c.indexer_compress_ratio);
    // The attention's per-head kernels hold a head (of queries or of the indexer) in shared memory.
    if (std::max(c.head_dim, c.indexer_head_dim) > kMaxAttnHeadDim)
      return error("CUDA engine: head_dim {} / indexer_head_dim {} beyond the attention kernels' {}", c.head_dim,
                   c.indexer_head_dim, kMaxAttnHeadDim);
  }
  if (has_ple && (int64_t{c.ple_conv_kernel_size} - 1) * c.ngram_size > 32)
    return error("CUDA engine: PLE conv history (ple_conv_kernel_size - 1) * ngram_size = {} > 32",
                 (int64_t{c.ple_conv_kernel_size} - 1) * c.ngram_size);
  return {};
}

Result<std::unique_ptr<Model>> Model::create(const ModelWeights& w, std::shared_ptr<ExpertSource> experts) {
  TRY(supports(w));
  if (device_count() == 0) return error("--backend cuda: no CUDA device is visible");
  auto m = std::unique_ptr<Model>(new Model(w, std::move(experts), Deferred{}));
  TRY(m->init());
  return m;
}

Model::Model(const ModelWeights& w, std::shared_ptr<ExpertSource> experts, Deferred)
    : w_(w), experts_src_(std::move(experts)), ref_(w, experts_src_) {}

Model::Model(const ModelWeights& w, std::shared_ptr<ExpertSource> experts)
    : Model(w, std::move(experts), Deferred{}) {
  Status st = supports(w);
  if (st.ok()) st = init();
  CHECK_MSG(st.ok(), "cuda::Model: {}", st.message());
}

namespace {
// 2-8-row steps: the mix writes the R-row fragments of u and d for the projections that read them
// (Buffers::urfrag, dfr); CK_ROW_FRAGS=0 leaves those projections their own fragment kernels, to
// compare.
bool row_frags_on() {
  static const bool on = !env_is("CK_ROW_FRAGS", "0");
  return on;
}

// CK_GDN=recurrent keeps prefill chunks on the token-by-token delta rule (to compare).
bool gdn_chunked_enabled() {
  static const bool on = !env_is("CK_GDN", "recurrent");
  return on;
}

// One hyper-connection module (§4) on the device; its low-rank pair in 16-row tiles where they fit
// (weight_tiles_on(); CK_HC_TILES=0 keeps rows, to compare).
Status upload_hc(DenseUploader& up, const HcWeights& h, DHc* d) {
  static const bool tiles = !env_is("CK_HC_TILES", "0");
  const WLayout lay = tiles && weight_tiles_on() ? WLayout::Tiles16 : WLayout::Rows;
  d->norm = up.vector(h.norm);
  ASSIGN_OR_RETURN(d->down, up.matrix(h.down, lay));
  ASSIGN_OR_RETURN(d->up, up.matrix(h.up, lay));
  ASSIGN_OR_RETURN(d->inject, up.matrix(h.inject));
  static const bool inject_tiles = !env_is("CK_HC_INJECT_TILES", "0");  // 0: prefill's inject in rows (compare)
  if (inject_tiles && d->down.tiled() && h.inject.rows > 0 && h.inject.cols == h.down.cols) {
    ASSIGN_OR_RETURN(d->inject_tiles, up.padded_tiles(h.inject));
  }
  return {};
}
}  // namespace

// One decoder layer's dense weights (a trunk layer or the MTP's); its routed experts live in the pool.
Status Model::upload_layer(DenseUploader& up, const LayerWeights& lw, DLayer* d) {
  d->kind = lw.kind;
  TRY(upload_hc(up, lw.hc_attn, &d->hc_attn));
  TRY(upload_hc(up, lw.hc_mlp, &d->hc_mlp));
  // The projections that only the v4 GEMVs and gemm_q4 read go up in 16-row tiles where they fit
  // (dmatrix.h WLayout::Tiles16; CK_WEIGHT_TILES=0 keeps rows).
  const WLayout proj = weight_tiles_on() ? WLayout::Tiles16 : WLayout::Rows;
  if (lw.kind == LayerKind::LinearAttention) {
    ASSIGN_OR_RETURN(d->gdn.in_qkv, up.matrix(lw.gdn.in_qkv, proj));
    ASSIGN_OR_RETURN(d->gdn.in_z, up.matrix(lw.gdn.in_z, proj));
    ASSIGN_OR_RETURN(d->gdn.in_b, up.matrix(lw.gdn.in_b, proj));
    ASSIGN_OR_RETURN(d->gdn.in_a, up.matrix(lw.gdn.in_a, proj));
    ASSIGN_OR_RETURN(d->gdn.out, up.matrix(lw.gdn.out, proj));
    d->gdn.conv = up.vector(lw.gdn.conv);
    d->gdn.a_log = up.vector(lw.gdn.a_log);
    d->gdn.dt_bias = up.vector(lw.gdn.dt_bias);
    d->gdn.norm = up.vector(lw.gdn.norm);
  } else {
    ASSIGN_OR_RETURN(d->attn.q, up.matrix(lw.attn.q, proj));
    ASSIGN_OR_RETURN(d->attn.k, up.matrix(lw.attn.k, proj));
    ASSIGN_OR_RETURN(d->attn.v, up.matrix(lw.attn.v, proj));
    ASSIGN_OR_RETURN(d->attn.o, up.matrix(lw.attn.o, proj));
    ASSIGN_OR_RETURN(d->attn.index_qk, up.matrix(lw.attn.index_qk, proj));
    d->attn.q_norm = up.vector(lw.attn.q_norm);
    d->attn.k_norm = up.vector(lw.attn.k_norm);
    d->attn.iq_norm = up.vector(lw.attn.index_q_norm);
    d->attn.ik_norm = up.vector(lw.attn.index_k_norm);
  }
  if (lw.ple) {
    DPle p;
    // In tiles like the projections: prefill's key/value product then runs on the bulk-copy kernel.
    ASSIGN_OR_RETURN(p.key, up.matrix(lw.ple->key, proj));
    ASSIGN_OR_RETURN(p.value, up.matrix(lw.ple->value, proj));
    p.norm_key = up.vector(lw.ple->norm_key);
    p.norm_query = up.vector(lw.ple->norm_query);
    p.norm_conv = up.vector(lw.ple->norm_conv);
    p.conv = up.vector(lw.ple->conv);
    p.index = n_ple_++;
    d->ple = p;
  }
  ASSIGN_OR_RETURN(d->moe.router, up.matrix(lw.moe.router));
  // CK_ROUTER_SPLIT=0: prefill's router stays on gemm.cu's tf32x3 kernel (to compare).
  static const bool split_router = !env_is("CK_ROUTER_SPLIT", "0");
  NibbleSplit ns;
  // (K >= 256: gemm_q4 takes no less.)
  if (split_router && lw.moe.router.cols >= 256 && nibble_split(lw.moe.router, &ns)) {
    ASSIGN_OR_RETURN(d->moe.router_hi, up.transient_matrix(ns.hi, proj));
    ASSIGN_OR_RETURN(d->moe.router_lo, up.transient_matrix(ns.lo, proj));
  }
  const WLayout experts = expert_tiles_ ? WLayout::Tiles16 : WLayout::Rows;
  ASSIGN_OR_RETURN(d->moe.sh_gate, up.matrix(lw.moe.shared_gate, experts));
  ASSIGN_OR_RETURN(d->moe.sh_up, up.matrix(lw.moe.shared_up, experts));
  ASSIGN_OR_RETURN(d->moe.sh_down, up.matrix(lw.moe.shared_down, experts));
  ASSIGN_OR_RETURN(d->moe.sh_expert_gate, up.matrix(lw.moe.shared_expert_gate));
  return {};
}

bool Model::expert_tiles_fit() const {
  const ModelConfig& c = cfg();
  const int max_inter = std::max(c.moe_intermediate_size, c.shared_expert_intermediate_size);
  // CK_Q4_EXPERTS=0 sends prefill's experts to gemm.cu, which reads rows; CK_EXPERT_TILES=0 keeps the
  // experts in rows and the dense projections in tiles (to compare).
  if (!weight_tiles_on() || !expert_tc4_enabled() || env_is("CK_Q4_EXPERTS", "0") || env_is("CK_EXPERT_TILES", "0") ||
      c.hidden_size % 64 != 0 || max_inter % 64 != 0)
    return false;
  ExpertMatrices ex;
  std::vector<uint8_t> scratch;
  if (!experts_src_->get(0, 0, &ex, &scratch).ok() || !tiles16_fit(ex.gate) || !tiles16_fit(ex.down)) return false;
  // The shared experts go with the routed ones into the same kernels, so they must fit tiles too: the
  // decode experts' bulk-copy kernels take every pair of a tiled model in tiles (Model::tiled_experts)
  // and gemm_q4's expert modes need all of a layer's in one 4-bit form.
  auto shared_ok = [](const MoeWeights& mo) {
    return tiles16_fit(mo.shared_gate) && tiles16_fit(mo.shared_up) && tiles16_fit(mo.shared_down);
  };
  for (const LayerWeights& lw : w_.layers)
    if (!shared_ok(lw.moe)) return false;
  return !w_.mtp || shared_ok(w_.mtp->layer.moe);
}

Status Model::init() {
  const ModelConfig& c = cfg();
  LOG_INF("cuda", "device: {}", device_banner());
  // Before any kernel attribute: on a device without the build's images those abort.
  if (const std::string why = current_device_unsupported_reason(); !why.empty()) return error("--backend cuda: {}", why);
  init_kernels();
  expert_tiles_ = expert_tiles_fit();
  DenseUploader up(&arena_);
  ASSIGN_OR_RETURN(embed_, up.matrix(w_.embed));
  // The LM head stays in rows for the streamed GEMV: in tiles (CK_LM_HEAD_TILES=1, never when tied to
  // the embedding, which is gathered by row) it takes the v4 two-kernel form, which on 2026-11-30 was
  // slower at one row (511.5 against 522.6 tok/s, MTP draft 0.44 against 0.39 ms) and faster at four
  // (984 against 964): docs/performance.md, sixteenth session.
  static const bool head_tiles = env_is("CK_LM_HEAD_TILES", "1");
  const bool tied = w_.lm_head.data == w_.embed.data;
  ASSIGN_OR_RETURN(lm_head_,
                   up.matrix(w_.lm_head, head_tiles && !tied && weight_tiles_on() ? WLayout::Tiles16 : WLayout::Rows));
  TRY(upload_hc(up, w_.final_mixer, &final_mixer_));
  layers_.resize(w_.layers.size());
  for (size_t L = 0; L < w_.layers.size(); ++L) TRY(upload_layer(up, w_.layers[L], &layers_[L]));
  if (w_.mtp) {  // §10: the embedding and the LM head are the trunk's (uploaded once above)
    const MtpWeights& mw = *w_.mtp;
    DMtp d;
    d.norm_embedding = up.vector(mw.pre_fc_norm_embedding);
    d.norm_hidden = up.vector(mw.pre_fc_norm_hidden);
    ASSIGN_OR_RETURN(d.fc_embedding, up.matrix(mw.fc_embedding));
    ASSIGN_OR_RETURN(d.fc_hidden, up.matrix(mw.fc_hidden));
    TRY(upload_layer(up, mw.layer, &d.layer));
    TRY(upload_hc(up, mw.mixer, &d.mixer));
    mtp_ = std::move(d);
  }
  TRY(up.status());  // a vector that found no room (a matrix returns its own error)
  dense_bytes_ = up.bytes();
  tiled_dense_ = up.tiled_matrices();
  auto codes48 = [](const DMatrix& m) { return m.quantized() && (m.fmt.bits == 4 || m.fmt.bits == 8) && m.cols % 32 == 0; };
  const std::vector<float> inv = rope_inv_freq(c.rotary_dim(), c.rope_theta);
  inv_freq_.resize(std::max<size_t>(1, inv.size()));
  if (!inv.empty()) CUDA_CHECK(cudaMemcpy(inv_freq_.get(), inv.data(), inv.size() * sizeof(float), cudaMemcpyHostToDevice));
  max_inter_ = std::max(c.moe_intermediate_size, c.shared_expert_intermediate_size);
  // Record layer num_hidden_layers is the MTP's (format/weights.h ExpertSource); its table entries
  // follow the trunk's, at table + num_hidden_layers * num_experts.
  const int record_layers = static_cast<int>(w_.layers.size()) + (mtp_ ? 1 : 0);
  const uint64_t default_session_bytes = session_bytes(4096, kChunkRows);
  TRY(upload_experts(*experts_src_, record_layers, c.num_experts, c.moe_intermediate_size, c.hidden_size,
                     default_session_bytes, &pool_, expert_tiles_));
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  for (int rows = kMaxChunkRows; rows > kChunkRows; rows /= 2)
    if (session_bytes(4096, rows) <= free_bytes / 4) {
      default_chunk_rows_ = rows;
      break;
    }
  DMatrix g, u, dn;
  expert_views(nullptr, pool_.fmt, c.moe_intermediate_size, c.hidden_size, &g, &u, &dn);
  // CK_Q4_EXPERTS=0 keeps prefill's experts on gemm.cu's dequantizing kernels (gemm_q4.cu; to compare).
  const bool q4_on = !env_is("CK_Q4_EXPERTS", "0");
  auto set_codes48 = [&](DMoe& mo) {
    mo.codes48 = codes48(g) && codes48(dn) && codes48(mo.sh_gate) && codes48(mo.sh_up) && codes48(mo.sh_down);
    mo.q4 = q4_on && expert_q4_ok(g) && expert_q4_ok(dn) && expert_q4_ok(mo.sh_gate) && expert_q4_ok(mo.sh_up) &&
            expert_q4_ok(mo.sh_down) && max_inter_ % 64 == 0;
  };
  for (DLayer& d : layers_) set_codes48(d.moe);
  if (mtp_) set_codes48(mtp_->layer.moe);
  for (const DLayer& d : layers_)  // expert_tiles_fit promised the kernels that read tiles
    CK_REQUIRE(!expert_tiles_ || d.moe.q4, "experts in 16-row tiles without the 4-bit expert kernels");
  LOG_INF("cuda", "model: {} layers{}, H {}, {} experts top-{}; dense {:.2f} GB on device; {} matrices{} in 16-row tiles; "
          "prefill chunks of {} rows ({:.1f} GB free)",
          w_.layers.size(), mtp_ ? " + MTP" : "", c.hidden_size, c.num_experts, c.num_experts_per_tok,
          dense_bytes_ / 1e9, tiled_dense_, tiled_experts() ? " and the routed experts" : "", default_chunk_rows_,
          free_bytes / 1e9);
  return {};
}

int Model::chunk_rows_for(int chunk_rows) const {
  return std::clamp(chunk_rows > 0 ? chunk_rows : default_chunk_rows_, kMaxRows, kMaxChunkRows);
}

uint64_t Model::session_bytes(int64_t max_ctx, int chunk_rows) const {
  return Session::buffer_bytes(cfg(), max_inter_, max_ctx, chunk_rows_for(chunk_rows)) + state_bytes(max_ctx);
}

uint64_t Model::state_bytes(int64_t max_ctx) const {
  std::vector<std::pair<LayerKind, bool>> layers;
  for (const DLayer& d : layers_) layers.emplace_back(d.kind, d.ple.has_value());
  if (mtp_) layers.emplace_back(mtp_->layer.kind, mtp_->layer.ple.has_value());
  return Session::state_bytes(cfg(), layers, max_ctx);
}

Status Model::chunk_fits(int64_t max_ctx, int chunk_rows) const {
  const int rows = chunk_rows_for(chunk_rows);
  const uint64_t need = session_bytes(max_ctx, rows);
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (need > free_bytes) {
    // Name what is large: the caches grow with the context, the buffers with the chunk's rows.
    const uint64_t states = state_bytes(max_ctx);
    return error("a session of {} positions with prefill chunks of {} rows needs {:.2f} GB of GPU memory ({:.2f} GB "
                 "of it the layers' states and the attention caches of {} positions) and {:.2f} GB is free: ask "
                 "for {} (--max-tokens, a shorter prompt or --prefill-chunk)",
                 max_ctx, rows, need / 1e9, states / 1e9, max_ctx, free_bytes / 1e9,
                 states * 2 > need ? "fewer positions" : "fewer rows a chunk");
  }
  return {};
}

std::unique_ptr<Session> Model::new_session(int64_t max_ctx, int chunk_rows) const {
  return std::make_unique<Session>(*this, max_ctx, chunk_rows_for(chunk_rows));
}

double Model::active_bytes_per_token() const {
  Tally t;
  t.add(lm_head_);
  t.add(final_mixer_);
  for (const DLayer& d : layers_) t.add(d);
  const double embed_row = static_cast<double>(embed_.stored_bytes()) / std::max(1, embed_.rows);
  return t.bytes + embed_row +
         static_cast<double>(layers_.size()) * cfg().num_experts_per_tok * static_cast<double>(pool_.record_bytes);
}

double Model::mtp_bytes_per_step() const {
  if (!mtp_) return 0;
  Tally t;
  t.add(lm_head_);
  t.add(mtp_->fc_embedding);
  t.add(mtp_->fc_hidden);
  t.add(mtp_->mixer);
  t.add(mtp_->layer);
  const double embed_row = static_cast<double>(embed_.stored_bytes()) / std::max(1, embed_.rows);
  return t.bytes + embed_row + cfg().num_experts_per_tok * static_cast<double>(pool_.record_bytes);
}

double Model::macs_per_token() const {
  Tally t;
  t.add(lm_head_);
  t.add(final_mixer_);
  for (const DLayer& d : layers_) t.add(d);
  const ModelConfig& c = cfg();
  return t.macs + static_cast<double>(layers_.size()) * c.num_experts_per_tok * 3.0 * c.moe_intermediate_size *
                      c.hidden_size;
}

void Model::permute_expert_slots(uint64_t seed) {
  const size_t n = pool_.table_h.size();
  std::vector<size_t> perm(n);
  for (size_t i = 0; i < n; ++i) perm[i] = i;
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = n; i > 1; --i) {  // Fisher-Yates with an LCG: any fixed permutation will do
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(perm[i - 1], perm[(s >> 33) % i]);
  }
  DeviceBuffer<uint8_t> fresh(pool_.slots.size());
  for (size_t i = 0; i < n; ++i) {
    uint8_t* dst = fresh.get() + perm[i] * pool_.stride;
    CUDA_CHECK(cudaMemcpy(dst, pool_.table_h[i].addr, pool_.stride, cudaMemcpyDeviceToDevice));
    pool_.table_h[i].addr = dst;
  }
  pool_.slots = std::move(fresh);
  CUDA_CHECK(cudaMemcpy(pool_.table.get(), pool_.table_h.data(), n * sizeof(ExpertSlot), cudaMemcpyHostToDevice));
}

// ==================================================================== Session state

struct Session::LayerState {
  float* gdn_conv = nullptr;  // (K-1, C)
  // The delta rule's state (nv, dk, dv) in two buffers: state_parity_ names the one that holds it. A
  // step with snapshots writes the state after its last row into the other (GdnRecArgs::state_alt);
  // commit() then takes that one, or replays the rows it keeps on the one before (replay_deltanet).
  float* gdn_s = nullptr;
  float* gdn_s_alt = nullptr;
  float* gdn_s_snaps = nullptr;  // CK_GDN_SNAPSHOTS=1 only: the state after each row but the last, as before
  float* gdn_conv_snaps = nullptr;
  int64_t gdn_conv_n = 0, gdn_s_n = 0;
  // A row-path step's inputs of the delta rule (kMaxRows rows: post-conv q | k | v at ldC, β's and the
  // decay's logits at ldNV), kept per layer until the next step, for replay_deltanet.
  float *gdn_y = nullptr, *gdn_b = nullptr, *gdn_a = nullptr;
  float* k_cache = nullptr;   // (max_ctx, nkv*hd)
  float* v_cache = nullptr;
  float* idx_keys = nullptr;  // (max_ctx, ihd)
  float* blk_keys = nullptr;  // (max_ctx/cr, ihd)
  float* ple_conv = nullptr;  // ((K-1)*d, W)
  float* ple_snaps = nullptr;
  int64_t ple_n = 0;
};

// Every buffer of one layer's state, as (member, floats) to f: the constructor allocates them, and
// state_bytes counts the same list for the fit check (Model::chunk_fits), so the two cannot drift apart.
template <class F>
void Session::each_state_buffer(const ModelConfig& c, LayerKind kind, bool ple, int64_t max_ctx, bool replay,
                                LayerState& st, F&& f) {
  const int64_t snaps = kMaxRows - 1;  // the states after each row of a step but the last
  if (kind == LayerKind::LinearAttention) {
    st.gdn_conv_n = static_cast<int64_t>(c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim();
    st.gdn_s_n = static_cast<int64_t>(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim;
    f(st.gdn_conv, std::max<int64_t>(1, st.gdn_conv_n));
    f(st.gdn_s, st.gdn_s_n);
    if (replay) f(st.gdn_s_alt, st.gdn_s_n);
    else f(st.gdn_s_snaps, snaps * st.gdn_s_n);
    f(st.gdn_conv_snaps, std::max<int64_t>(1, snaps * st.gdn_conv_n));
    f(st.gdn_y, kMaxRows * ld4(c.gdn_conv_dim()));
    f(st.gdn_b, kMaxRows * ld4(c.linear_num_value_heads));
    f(st.gdn_a, kMaxRows * ld4(c.linear_num_value_heads));
  } else {
    const int64_t kvw = static_cast<int64_t>(c.num_key_value_heads) * c.head_dim;
    f(st.k_cache, max_ctx * kvw);
    f(st.v_cache, max_ctx * kvw);
    f(st.idx_keys, max_ctx * c.indexer_head_dim);
    f(st.blk_keys, indexer_blocks(c, max_ctx) * c.indexer_head_dim);
  }
  if (ple) {
    st.ple_n = static_cast<int64_t>(c.ple_conv_kernel_size - 1) * c.ngram_size * c.wide();
    f(st.ple_conv, std::max<int64_t>(1, st.ple_n));
    f(st.ple_snaps, std::max<int64_t>(1, snaps * st.ple_n));
  }
}

int64_t Session::indexer_blocks(const ModelConfig& c, int64_t max_ctx) {
  return c.indexer_compress_ratio > 0 ? std::max<int64_t>(1, max_ctx / c.indexer_compress_ratio) : 1;
}

bool Session::gdn_replay_on() { return !env_is("CK_GDN_SNAPSHOTS", "1"); }

uint64_t Session::state_bytes(const ModelConfig& c, const std::vector<std::pair<LayerKind, bool>>& layers,
                              int64_t max_ctx) {
  uint64_t bytes = 0;
  LayerState st;
  const bool replay = gdn_replay_on();
  for (const auto& [kind, ple] : layers)
    each_state_buffer(c, kind, ple, max_ctx, replay, st,
                      [&](float*&, int64_t n) { bytes += DeviceArena::footprint(sizeof(float) * n); });
  return bytes;
}

// Rows of the mix's g (the up projection's output, rows x W floats): a prefill chunk's up projection and
// gate mean run in pieces of this many rows where the fused kernel (hc_up_gate_mean) does not take
// them (other GPUs than Hopper, CK_HC_UP_GATE_MEAN=0), so g is not as long as the chunk: at 8,192 rows
// of the released geometry that is 84 MB instead of 336 MB. CK_HC_GATE_ROWS sets it (tests: >= 8).
static int hc_gate_rows() {
  static const int rows = [] {
    const char* e = std::getenv("CK_HC_GATE_ROWS");
    return e ? std::max(kMaxRows, std::atoi(e)) : 2048;
  }();
  return rows;
}

struct Session::Buffers {
  int hc_g_rows = 0;  // rows of hc_g (hc_gate_rows(), at most the chunk's)
  int ldW = 0, ldH = 0, ldS = 0, ldLR = 0, ldC = 0, ldVd = 0, ldNV = 0, ldQG = 0, ldKV = 0, ldIQK = 0, ldQ = 0,
      ldIQ = 0, ldE = 0, ldEx = 0, ldMI = 0, ldV = 0;
  int64_t nb_max = 1;
  StepParams* params = nullptr;
  StepParams* replay_params = nullptr;  // replay_deltanet's: its rows, no snapshots, the state's parity
  float *R = nullptr, *X = nullptr, *hc_d = nullptr, *hc_g = nullptr, *u = nullptr, *w = nullptr, *o = nullptr;
  float* hc_rinv = nullptr;  // [rows][S]: a prefill mix's 1 / rms per stream, when X is not written (XNorm)
  float *gx = nullptr, *gz = nullptr, *gb = nullptr, *ga = nullptr, *gy = nullptr, *go = nullptr;
  float *qg = nullptr, *ak = nullptr, *av = nullptr, *iqk = nullptr, *q = nullptr, *iq = nullptr, *scores = nullptr,
        *ao = nullptr;
  uint8_t* sel = nullptr;
  float* emb_step = nullptr;  // (n_ple, kMaxRows, ldE): a decode step's PLE rows (copies_at_ends_on)
  float *emb = nullptr, *pkey = nullptr, *pkn = nullptr, *pval = nullptr, *pqn = nullptr, *pG = nullptr, *pGn = nullptr;
  float *mlog = nullptr, *mlog2 = nullptr, *mgl = nullptr, *mh = nullptr, *my = nullptr, *mo = nullptr;
  ExpertPair* pairs = nullptr;
  unsigned* expert_counts = nullptr;  // the fused decode experts' per-pair counts (expert_tc4_fused), zero
  int32_t* order = nullptr;  // prefill chunks: pairs grouped per expert (group_pairs)
  int2* tiles = nullptr;
  int32_t* n_tiles = nullptr;
  int max_tiles = 0;
  float *fy = nullptr, *logits = nullptr, *argmax_scratch = nullptr;
  // u's v4 fragments (row-path steps, H % 64 == 0), written by the mix that writes u; ufr describes
  // what u holds now (nothing after a prefill chunk's mix).
  uint2* ufrag = nullptr;
  float* ugsum = nullptr;
  float* hc_scratch = nullptr;  // hc_mix_row's partial products, one row
  size_t hc_scratch_n = 0;
  unsigned* hc_barrier = nullptr;
  long long* hc_acc = nullptr;  // hc_mix_row's exact sums (two buffers), zeroed with the barrier
  unsigned long long* hc_stamps = nullptr;  // CK_HC_TIMING=1: the last one-row mix's per-block timing
  Tc4Frags ufr;
  // 2-8-row steps: the R-row fragments of u (beside ufrag) and of the mix's low-rank d, written by the
  // gate mean and by the down projection's reduce (cuda/ops.h Tc4Frags::rfrag); dfr holds d's buffers
  // (null: none) and describes what they hold.
  uint2* urfrag = nullptr;
  float* urgsum = nullptr;
  Tc4Frags dfr;
  int32_t* argmax = nullptr;
  // MTP head (one row): its StepParams, the embedding row e, N1(e), fe, the input hidden and its norm,
  // and S ones (the unit injection of fe into every stream).
  StepParams* mtp_params = nullptr;
  float *mtp_e = nullptr, *mtp_en = nullptr, *mtp_fe = nullptr, *mtp_h = nullptr, *mtp_hn = nullptr,
        *mtp_ones = nullptr;
};

// A session's per-row buffers at `rows` rows (the constructor below; the model's fit check keeps this
// much free beside the experts). An estimate: the per-layer states, snapshots and the MTP's buffers are
// left out (at the released geometry they are ~2% of it at 2,048 rows).
uint64_t Session::buffer_bytes(const ModelConfig& c, int max_inter, int64_t max_ctx, int rows) {
  const int64_t H = c.hidden_size, W = c.wide(), k1 = c.num_experts_per_tok + 1;
  const int64_t kvw = static_cast<int64_t>(c.num_key_value_heads) * c.head_dim;
  const int64_t nb = indexer_blocks(c, max_ctx);
  const int64_t per_row =
      4 * W + 5 * H + c.hc_lowrank + c.hc_count + 2 * c.gdn_conv_dim() + 2 * c.gdn_value_dim() +
      2 * c.linear_num_value_heads + static_cast<int64_t>(c.num_attention_heads) * c.head_dim * 4 + 2 * kvw +
      static_cast<int64_t>(2 * c.indexer_n_heads + 1) * c.indexer_head_dim + nb + std::max(1, c.ple_embed_dim) +
      2 * c.num_experts + 4 + k1 * (max_inter + H + 1);
  return static_cast<uint64_t>(rows) * (sizeof(float) * per_row + nb) +
         sizeof(float) * static_cast<uint64_t>(std::min(rows, hc_gate_rows())) * W +  // hc_g
         sizeof(float) * static_cast<uint64_t>(kLmRows) * c.vocab_size + kStepScratchBytes;
}

Session::Session(const Model& m, int64_t max_ctx, int chunk_rows)
    : m_(m), max_ctx_(max_ctx), gdn_replay_(gdn_replay_on()),
      chunk_rows_(std::clamp(chunk_rows, kMaxRows, kMaxChunkRows)), prefill_chunk_(chunk_rows_) {
  const ModelConfig& c = m.cfg();
  CHECK(max_ctx_ >= 1);
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&upload_stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&emb_free_, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventCreateWithFlags(&emb_ready_, cudaEventDisableTiming));
  const int H = c.hidden_size, S = c.hc_count, W = c.wide(), R = chunk_rows_;
  b_ = std::make_unique<Buffers>();
  Buffers& b = *b_;
  auto fbuf = [&](int64_t n) {
    float* p = static_cast<float*>(arena_.alloc(sizeof(float) * n));
    CUDA_CHECK(cudaMemset(p, 0, sizeof(float) * n));
    return p;
  };
  b.ldW = ld4(W); b.ldH = ld4(H); b.ldS = ld4(S); b.ldLR = ld4(c.hc_lowrank);
  b.ldC = ld4(c.gdn_conv_dim()); b.ldVd = ld4(c.gdn_value_dim()); b.ldNV = ld4(c.linear_num_value_heads);
  b.ldQG = ld4(static_cast<int64_t>(c.num_attention_heads) * 2 * c.head_dim);
  b.ldKV = ld4(static_cast<int64_t>(c.num_key_value_heads) * c.head_dim);
  b.ldIQK = ld4(static_cast<int64_t>(c.indexer_n_heads + 1) * c.indexer_head_dim);
  b.ldQ = ld4(static_cast<int64_t>(c.num_attention_heads) * c.head_dim);
  b.ldIQ = ld4(static_cast<int64_t>(c.indexer_n_heads) * c.indexer_head_dim);
  b.ldE = ld4(std::max(1, c.ple_embed_dim));
  b.ldEx = ld4(c.num_experts);
  b.ldMI = ld4(m.max_inter_);
  b.ldV = ld4(c.vocab_size);
  b.nb_max = indexer_blocks(c, max_ctx_);
  b.params = static_cast<StepParams*>(arena_.alloc(sizeof(StepParams)));
  b.replay_params = static_cast<StepParams*>(arena_.alloc(sizeof(StepParams)));
  step_scratch_.base = static_cast<uint8_t*>(arena_.alloc(kStepScratchBytes));
  step_scratch_.size = kStepScratchBytes;
  b.R = fbuf(R * b.ldW); b.X = fbuf(R * b.ldW); b.hc_d = fbuf(R * b.ldLR); b.hc_rinv = fbuf(R * c.hc_count); b.hc_g_rows = std::min(R, hc_gate_rows());
  b.hc_g = fbuf(static_cast<int64_t>(b.hc_g_rows) * b.ldW);
  b.u = fbuf(R * b.ldH); b.w = fbuf(R * b.ldS); b.o = fbuf(R * b.ldH);
  if (H % 64 == 0) {
    const int64_t groups = H / 64;
    b.ufrag = reinterpret_cast<uint2*>(fbuf(kMaxRows * groups * kOneFragWords * 2));  // Tc4Frags' layout
    b.ugsum = fbuf(kMaxRows * groups);
    if (row_frags_on()) {
      const int64_t d_groups = c.hc_lowrank / 64;  // (d's fragments only when it is whole groups)
      b.urfrag = reinterpret_cast<uint2*>(fbuf(groups * tc4_rows_frag_words(kMaxRows) * 2));
      b.urgsum = fbuf(groups * tc4_rows_gsum_floats(kMaxRows));
      if (d_groups > 0 && c.hc_lowrank % 64 == 0) {
        b.dfr.rfrag = reinterpret_cast<uint2*>(fbuf(d_groups * tc4_rows_frag_words(kMaxRows) * 2));
        b.dfr.rgsum = fbuf(d_groups * tc4_rows_gsum_floats(kMaxRows));
      }
    }
    b.hc_scratch_n = hc_mix_scratch_floats(S, H, c.hc_lowrank);
    b.hc_scratch = fbuf(static_cast<int64_t>(b.hc_scratch_n));
    b.hc_barrier = reinterpret_cast<unsigned*>(fbuf(64));  // zeroed by fbuf
    b.hc_acc = reinterpret_cast<long long*>(fbuf(static_cast<int64_t>(2 * hc_mix_acc_words(S, c.hc_lowrank))));
    if (env_is("CK_HC_TIMING", "1"))  // kHcStampWords words per block, one block per SM
      b.hc_stamps = reinterpret_cast<unsigned long long*>(fbuf(2 * kHcStampWords * sm_count()));
  }
  b.gx = fbuf(R * b.ldC); b.gz = fbuf(R * b.ldVd); b.gb = fbuf(R * b.ldNV); b.ga = fbuf(R * b.ldNV);
  b.gy = fbuf(R * b.ldC); b.go = fbuf(R * b.ldVd);
  b.qg = fbuf(R * b.ldQG); b.ak = fbuf(R * b.ldKV); b.av = fbuf(R * b.ldKV); b.iqk = fbuf(R * b.ldIQK);
  b.q = fbuf(R * b.ldQ); b.iq = fbuf(R * b.ldIQ); b.scores = fbuf(R * b.nb_max); b.ao = fbuf(R * b.ldQ);
  b.sel = static_cast<uint8_t*>(arena_.alloc(R * b.nb_max));
  CUDA_CHECK(cudaMemset(b.sel, 0, R * b.nb_max));
  // The PLE's five wide intermediates in three buffers, by when each is last read (enqueue_block, §5):
  // the key (read by its norm) and then the query's norm (read by the gate) and G's norm (read by the
  // conv) in X, which only the mixes use and the PLE runs between two mixes; the key's norm (read by the
  // gate) and G (read by the conv) in buffers of their own. 1.0 GB less GPU memory at 8,192-row chunks
  // of the released geometry; the same values.
  b.emb = fbuf(R * b.ldE); b.pkey = b.X; b.pkn = fbuf(R * b.ldW); b.pval = fbuf(R * b.ldH);
  b.emb_step = fbuf(std::max(1, m.n_ple_) * kMaxRows * b.ldE);
  b.pqn = b.X; b.pG = fbuf(R * b.ldW); b.pGn = b.X;
  const int n_pairs = R * (c.num_experts_per_tok + 1);
  b.mlog = fbuf(R * b.ldEx); b.mlog2 = fbuf(R * b.ldEx); b.mgl = fbuf(R * 4);
  b.pairs = static_cast<ExpertPair*>(arena_.alloc(sizeof(ExpertPair) * n_pairs));
  b.expert_counts = static_cast<unsigned*>(arena_.alloc(sizeof(unsigned) * expert_fused_counts(n_pairs)));
  CUDA_CHECK(cudaMemset(b.expert_counts, 0, sizeof(unsigned) * expert_fused_counts(n_pairs)));
  b.mh = fbuf(static_cast<int64_t>(n_pairs) * b.ldMI); b.my = fbuf(static_cast<int64_t>(n_pairs) * b.ldH);
  b.mo = fbuf(R * b.ldH);
  b.max_tiles = grouped_max_tiles(n_pairs, c.num_experts + 1);
  b.order = static_cast<int32_t*>(arena_.alloc(sizeof(int32_t) * n_pairs));
  b.tiles = static_cast<int2*>(arena_.alloc(sizeof(int2) * b.max_tiles));
  b.n_tiles = static_cast<int32_t*>(arena_.alloc(sizeof(int32_t)));
  b.fy = fbuf(R * b.ldH); b.logits = fbuf(static_cast<int64_t>(kLmRows) * b.ldV);
  b.argmax_scratch = fbuf(kLmRows * argmax_scratch_floats(c.vocab_size));
  b.argmax = static_cast<int32_t*>(arena_.alloc(sizeof(int32_t) * R));

  auto init_state = [&](const DLayer& d, LayerState& st) {
    each_state_buffer(c, d.kind, d.ple.has_value(), max_ctx_, gdn_replay_, st,
                      [&](float*& p, int64_t n) { p = fbuf(n); });
  };
  ls_.resize(m.layers_.size());
  for (size_t L = 0; L < ls_.size(); ++L) init_state(m.layers_[L], ls_[L]);
  if (m.mtp_) {  // its KV and indexer caches, max_ctx positions like the trunk's attention layers
    mtp_ls_ = std::make_unique<LayerState>();
    init_state(m.mtp_->layer, *mtp_ls_);
    b.mtp_params = static_cast<StepParams*>(arena_.alloc(sizeof(StepParams)));
    b.mtp_e = fbuf(b.ldH); b.mtp_en = fbuf(b.ldH); b.mtp_fe = fbuf(b.ldH);
    b.mtp_h = fbuf(b.ldW); b.mtp_hn = fbuf(b.ldW);
    b.mtp_ones = fbuf(b.ldS);
    const std::vector<float> ones(static_cast<size_t>(S), 1.0f);
    CUDA_CHECK(cudaMemcpy(b.mtp_ones, ones.data(), sizeof(float) * S, cudaMemcpyHostToDevice));
    mtp_params_h_.resize(sizeof(StepParams));
    mtp_in_h_.resize(static_cast<size_t>(W));
  }
  ngram_ctx_.assign(static_cast<size_t>(m.n_ple_),
                    std::vector<int64_t>(static_cast<size_t>(std::max(0, c.ngram_size - 1)), c.ple_eos()));
  params_h_.resize(sizeof(StepParams));
  ple_emb_h_.resize(static_cast<size_t>(std::max(1, m.n_ple_)) * R * b.ldE);
  std::memset(ple_emb_h_.get(), 0, ple_emb_h_.size() * sizeof(float));
  argmax_h_.resize(R);
  hidden_h_.resize(static_cast<size_t>(R) * b.ldW);
  logits_h_.resize(static_cast<size_t>(kLmRows) * b.ldV);
  CUDA_CHECK(cudaDeviceSynchronize());
}

Session::~Session() {
  for (auto& [key, g] : graphs_) cudaGraphExecDestroy(g.exec);
  for (StepGraph& g : mtp_graphs_)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  if (emb_free_) cudaEventDestroy(emb_free_);
  if (emb_ready_) cudaEventDestroy(emb_ready_);
  if (upload_stream_) cudaStreamDestroy(upload_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

// ==================================================================== the forward

void Session::tap(const std::string& name, const float* d, int rows, int64_t n, int64_t ld) {
  if (!taps_) return;
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<float>& v = (*taps_)[name];
  const size_t old = v.size();
  v.resize(old + static_cast<size_t>(rows) * n);
  CUDA_CHECK(cudaMemcpy2D(v.data() + old, n * sizeof(float), d, ld * sizeof(float), n * sizeof(float), rows,
                          cudaMemcpyDeviceToHost));
}

void Session::defer_combine(const float* o, const float* w, int rows, const PendingMoe& moe) {
  flush_combine();
  pending_combine_ = PendingCombine{o, w, rows, moe};
  if (taps_) flush_combine();  // taps read o and R right after
}

void Session::materialize_moe() {
  if (!pending_combine_ || !pending_combine_->moe.y) return;
  const PendingMoe& m = pending_combine_->moe;
  moe_combine(m.y, m.ldy, m.pairs, m.k, m.gl, m.ldgl, m.o, b_->ldH, m_.cfg().hidden_size, pending_combine_->rows,
              stream_);
  pending_combine_->moe.y = nullptr;
}

void Session::flush_combine() {
  if (!pending_combine_) return;
  materialize_moe();
  const ModelConfig& c = m_.cfg();
  Buffers& b = *b_;
  const PendingCombine pc = *pending_combine_;
  pending_combine_.reset();
  hc_combine(b.R, b.ldW, pc.o, b.ldH, pc.w, b.ldS, c.hc_count, c.hidden_size, pc.rows, stream_);
}

// §4 mix: u (rows, H) and, when hc has an injection head, w (rows, S). A deferred combine of the same
// rows goes into the input norm's kernel.
void Session::hc_mix(const DHc& hc, int rows, float* u, float* w) {
  const ModelConfig& c = m_.cfg();
  Buffers& b = *b_;
  const int H = c.hidden_size, S = c.hc_count, W = c.wide();
  const float eps = static_cast<float>(c.rms_norm_eps);
  if (rows == 1 && (!pending_combine_ || pending_combine_->rows == 1)) {  // one kernel (cuda/hc_mix.cu)
    HcMixArgs a;
    a.R = b.R;
    if (pending_combine_) {
      const PendingMoe& m = pending_combine_->moe;
      if (m.y) {  // the mix combines the MoE output itself
        a.moe_y = m.y;
        a.moe_ldy = m.ldy;
        a.moe_pairs = m.pairs;
        a.moe_k = m.k;
        a.moe_gl = m.gl;
      } else {
        a.o = pending_combine_->o;
      }
      a.w_in = pending_combine_->w;
    }
    a.norm = hc.norm;
    a.eps = eps;
    a.down = hc.down;
    a.up = hc.up;
    if (w) a.inject = hc.inject;
    a.w_out = w;
    a.u = u;
    const bool frags = u == b.u && b.ufrag;
    if (frags) {
      a.frag = b.ufrag;
      a.gsum = b.ugsum;
    }
    a.S = S;
    a.H = H;
    a.scratch = b.hc_scratch;
    a.scratch_floats = b.hc_scratch_n;
    a.barrier = b.hc_barrier;
    a.acc = b.hc_acc;
    a.stamps = b.hc_stamps;
    if (hc_mix_row(a, stream_)) {
      pending_combine_.reset();
      if (u == b.u) b.ufr = frags ? Tc4Frags{b.u, static_cast<int>(b.ldH), rows, H / 64, b.ufrag, b.ugsum} : Tc4Frags{};
      return;
    }
  }
  materialize_moe();
  GemvJob jobs[2];
  jobs[0].w = hc.down;  // divide by S before the activation (trap 4)
  jobs[0].y = b.hc_d;
  jobs[0].ldy = b.ldLR;
  jobs[0].epi = Epilogue::SiluDiv;
  jobs[0].epi_arg = static_cast<float>(S);
  int n = 1;
  if (w && hc.inject.rows > 0) {
    // A prefill chunk takes the tiled copy, so that the call runs on the bulk-copy kernel.
    jobs[1].w = rows > kMaxRows && hc.inject_tiles.data ? hc.inject_tiles : hc.inject;
    jobs[1].y = w;
    jobs[1].ldy = b.ldS;
    jobs[1].epi = Epilogue::TwoSigmoidDiv;
    jobs[1].epi_arg = static_cast<float>(S);
    n = 2;
  }
  // At 2-8 rows the down projection's reduce also writes d's fragments, which the up projection reads.
  const bool row_frags = rows >= 2 && rows <= kMaxRows && b.dfr.rfrag;
  jobs[0].frags_out = row_frags ? &b.dfr : nullptr;
  GemvJob up;
  up.w = hc.up;
  up.y = b.hc_g;
  up.ldy = static_cast<int32_t>(b.ldW);
  // The input norm. A prefill chunk whose down and up projections can normalise R where they read it
  // (hc_mix_xnorm_ok) has its norm write only each stream's 1 / rms: X's write and one read of it saved,
  // the same bits. Else X, with the deferred combine in the same kernel where it fits.
  const bool fused = pending_combine_ && pending_combine_->rows == rows;
  const bool xn_ok = fused && hc_mix_xnorm_ok(jobs, n, up, b.R, b.ldW, rows, S, H);
  const XNorm xn{b.hc_rinv, hc.norm, S, H};
  bool use_xn = false;
  if (fused && hc_combine_rmsnorm(b.R, b.ldW, pending_combine_->o, b.ldH, pending_combine_->w, b.ldS, S, H, hc.norm,
                                  eps, b.X, rows, stream_, xn_ok ? b.hc_rinv : nullptr)) {
    pending_combine_.reset();
    use_xn = xn_ok;
  } else {
    flush_combine();
    rmsnorm_grouped(b.R, W, H, hc.norm, eps, b.X, rows, b.ldW, stream_);
  }
  mark("hc mix: norm");  // (profiling: the prefill mix's pieces; "hc mix" is then its gate mean)
  if (use_xn) {
    CK_REQUIRE(gemm_q4(jobs, n, b.R, b.ldW, rows, stream_, 0, &xn), "hc mix: the down projection declined R");
  } else {
    gemv(jobs, n, b.X, b.ldW, rows, stream_);
  }
  mark("hc mix: down");
  if (rows > kMaxRows) {  // a prefill chunk (no fragments of u)
    // The up projection makes u itself (the gate mean in its epilogue: g stays on chip); where it cannot,
    // the two calls, in pieces of g's buffer's rows.
    if (hc_up_gate_mean(up, b.hc_d, b.ldLR, rows, use_xn ? b.R : b.X, b.ldW, S, H, u, b.ldH, stream_,
                        use_xn ? &xn : nullptr)) {
      mark("hc mix: up");
    } else {
      CK_REQUIRE(!use_xn, "hc mix: the up projection's gate mean declined R");
      for (int r0 = 0; r0 < rows; r0 += b.hc_g_rows) {
        const int n = std::min(b.hc_g_rows, rows - r0);
        gemv(&up, 1, b.hc_d + static_cast<size_t>(r0) * b.ldLR, b.ldLR, n, stream_);
        mark("hc mix: up");
        hc_gate_mean(b.hc_g, b.X + static_cast<size_t>(r0) * b.ldW, b.ldW, S, H, u + static_cast<size_t>(r0) * b.ldH,
                     b.ldH, n, stream_);
        mark("hc mix");
      }
    }
    if (u == b.u) b.ufr = Tc4Frags{};
    return;
  }
  gemv(&up, 1, b.hc_d, b.ldLR, rows, stream_, row_frags ? &b.dfr : nullptr);
  mark("hc mix: up");
  if (u == b.u && b.ufrag) {
    const bool rf = rows >= 2 && b.urfrag;
    hc_gate_mean(b.hc_g, b.X, b.ldW, S, H, u, b.ldH, rows, stream_, b.ufrag, b.ugsum, rf ? b.urfrag : nullptr,
                 rf ? b.urgsum : nullptr);
    b.ufr = Tc4Frags{b.u, static_cast<int>(b.ldH), rows, H / 64, b.ufrag, b.ugsum, rf ? b.urfrag : nullptr,
                     rf ? b.urgsum : nullptr, rf ? tc4_rows_R(rows) : 0};
  } else {
    hc_gate_mean(b.hc_g, b.X, b.ldW, S, H, u, b.ldH, rows, stream_);
    if (u == b.u) b.ufr = Tc4Frags{};
  }
}

// Whether a decode step's host copies sit at its ends (the default) or between its kernels
// (CK_COPIES_AT_ENDS=0, as before 2026-12-02): the PLE rows went up before the PLE layer's first GEMV,
// the pre-mixer residual came down between the final mixer and the LM head. A copy node between two
// kernels of a graph makes the second depend on it fully, so it cannot start early (programmatic
// launch) and overlap its prologue (the LM head's first ring of weights) with the kernel before. The
// PLE rows are on the host before the step starts; the LM head and argmax read fy and write logits and
// argmax, never R, so the late copy carries the same values. Measured (H200 2026-12-02 02:04Z, two
// interleaved rounds against CK_COPIES_AT_ENDS=0): 628.8 / 633.7 against 629.4 / 621.8 tok/s at one
// row, 1,310.0 / 1,324.9 against 1,325.5 / 1,299.2 at 4 rows: level (+0.5 / +0.7% in the means).
static bool copies_at_ends_on() {
  static const bool on = !env_is("CK_COPIES_AT_ENDS", "0");
  return on;
}
// Whether a step of `rows` has its PLE rows copied with its params (into b.emb_step) by enqueue_trunk.
static bool ple_rows_with_params(int rows) { return rows <= kMaxRows && copies_at_ends_on(); }
// Whether a prefill chunk of `rows` has its first PLE layer's rows (index 0) uploaded on upload_stream_
// by enqueue_trunk while the layers before it run (prefill chunks: direct launches, no capture), instead
// of in line before the PLE's product, where the stream waited for them (the profile's "ple" piece).
// Later PLE layers (the released model has one) share b.emb and keep the in-line copy.
// CK_PLE_EARLY_UPLOAD=0: in line, to compare.
static bool ple_rows_early(int rows) {
  static const bool on = !env_is("CK_PLE_EARLY_UPLOAD", "0");
  return on && rows > kMaxRows;
}

void Session::copy_hidden_down(int from, int rows) {
  Buffers& b = *b_;
  if (from < rows)
    CUDA_CHECK(cudaMemcpyAsync(hidden_h_.get() + static_cast<size_t>(from) * b.ldW, b.R + static_cast<size_t>(from) * b.ldW,
                               sizeof(float) * (rows - from) * b.ldW, cudaMemcpyDeviceToHost, stream_));
}

// The delta rule's arguments of DeltaNet layer d for a step of `rows` rows. A row-path step (at most
// kMaxRows rows, the only kind with snapshots) reads its inputs from the layer's own buffers, which
// outlive the step for replay_deltanet, and both state buffers (the device's StepParams say which holds
// the state, and whether the step writes the other); a prefill chunk reads the shared buffers and
// updates the state in place.
Session::GdnInputs Session::gdn_inputs(LayerState& st, int rows) const {
  const Buffers& b = *b_;
  return rows <= kMaxRows ? GdnInputs{st.gdn_y, st.gdn_b, st.gdn_a} : GdnInputs{b.gy, b.gb, b.ga};
}

GdnRecArgs Session::gdn_args(const DLayer& d, LayerState& st, int rows) const {
  const ModelConfig& c = m_.cfg();
  const Buffers& b = *b_;
  const DGdn& g = d.gdn;
  const bool row_path = rows <= kMaxRows;
  const GdnInputs in = gdn_inputs(st, rows);
  GdnRecArgs ra;
  ra.y = in.y; ra.ldy = b.ldC; ra.z = b.gz; ra.ldz = b.ldVd; ra.b = in.b; ra.a = in.a; ra.ldab = b.ldNV;
  ra.a_log = g.a_log; ra.dt_bias = g.dt_bias; ra.norm = g.norm;
  ra.state = row_path || state_parity_ == 0 ? st.gdn_s : st.gdn_s_alt;
  ra.state_alt = row_path ? st.gdn_s_alt : nullptr;  // (null under CK_GDN_SNAPSHOTS=1)
  if (!gdn_replay_) {
    ra.snaps = st.gdn_s_snaps;
    ra.snap_stride = st.gdn_s_n;
  }
  ra.out = b.go; ra.ldo = b.ldVd;
  ra.nk = c.linear_num_key_heads; ra.nv = c.linear_num_value_heads; ra.dk = c.linear_key_head_dim;
  ra.dv = c.linear_value_head_dim; ra.eps = static_cast<float>(c.rms_norm_eps);
  ra.sigmoid_gate = c.output_gate_type == "sigmoid" ? 1 : 0;
  return ra;
}

// One decoder layer (§2 a-c) on b.R: a trunk layer, or the MTP's. Positions and tokens come from the
// device StepParams `sp`; `table` is this block's entries of the expert table.
void Session::enqueue_block(const DLayer& d, LayerState& st, const ExpertSlot* table, const StepParams* sp,
                            const std::string& pre, int rows) {
  const ModelConfig& c = m_.cfg();
  Buffers& b = *b_;
  const int H = c.hidden_size, S = c.hc_count, W = c.wide();
  const float eps = static_cast<float>(c.rms_norm_eps);

  if (d.ple) {  // a: PLE adds to the residual before the attention mix (trap 17)
    flush_combine();  // the PLE reads R
    const DPle& p = *d.ple;
    const int E = c.ple_embed_dim;
    const float* emb = b.emb;
    if (ple_rows_with_params(rows)) {  // copied with the step's params (enqueue_trunk)
      emb = b.emb_step + static_cast<size_t>(p.index) * kMaxRows * b.ldE;
    } else if (p.index == 0 && ple_rows_early(rows)) {  // uploaded while the layers before ran (enqueue_trunk)
      CUDA_CHECK(cudaStreamWaitEvent(stream_, emb_ready_, 0));
    } else {
      CUDA_CHECK(cudaMemcpyAsync(b.emb, ple_emb_h_.get() + static_cast<size_t>(p.index) * chunk_rows_ * b.ldE,
                                 sizeof(float) * rows * b.ldE, cudaMemcpyHostToDevice, stream_));
    }
    GemvJob jobs[2];
    jobs[0].w = p.key; jobs[0].y = b.pkey; jobs[0].ldy = b.ldW;
    jobs[1].w = p.value; jobs[1].y = b.pval; jobs[1].ldy = b.ldH;
    gemv(jobs, 2, emb, b.ldE, rows, stream_);
    if (p.index == 0 && ple_rows_early(rows)) CUDA_CHECK(cudaEventRecord(emb_free_, stream_));  // the next upload may go
    (void)E;
    rmsnorm_grouped(b.pkey, W, H, p.norm_key, eps, b.pkn, rows, b.ldW, stream_);
    rmsnorm_grouped(b.R, W, H, p.norm_query, eps, b.pqn, rows, b.ldW, stream_);
    ple_gate(b.pkn, b.pqn, b.ldW, b.pval, b.ldH, S, H, b.pG, rows, stream_);
    rmsnorm_grouped(b.pG, W, H, p.norm_conv, eps, b.pGn, rows, b.ldW, stream_);
    PleConvArgs a;
    a.G = b.pG; a.Gn = b.pGn; a.ld = b.ldW; a.taps = p.conv;
    a.state = st.ple_conv; a.snaps = st.ple_snaps; a.snap_stride = st.ple_n;
    a.R = b.R; a.ldR = b.ldW; a.W = W; a.K = c.ple_conv_kernel_size; a.dil = c.ngram_size;
    ple_conv(a, sp, rows, stream_);
    mark("ple");
    tap(pre + "ple", b.R, rows, W, b.ldW);
  }

  hc_mix(d.hc_attn, rows, b.u, b.w);  // b
  mark("hc mix");
  tap(pre + "attn_u", b.u, rows, H, b.ldH);
  if (d.kind == LayerKind::LinearAttention) {
    const DGdn& g = d.gdn;
    const GdnInputs in = gdn_inputs(st, rows);  // the delta rule's inputs, written by the in_proj and the conv
    GemvJob jobs[4];
    jobs[0].w = g.in_qkv; jobs[0].y = b.gx; jobs[0].ldy = b.ldC;
    jobs[1].w = g.in_z; jobs[1].y = b.gz; jobs[1].ldy = b.ldVd;
    jobs[2].w = g.in_b; jobs[2].y = in.b; jobs[2].ldy = b.ldNV;
    jobs[3].w = g.in_a; jobs[3].y = in.a; jobs[3].ldy = b.ldNV;
    GdnConvArgs ca;
    ca.x = b.gx; ca.ldx = b.ldC; ca.taps = g.conv; ca.state = st.gdn_conv; ca.snaps = st.gdn_conv_snaps;
    ca.snap_stride = st.gdn_conv_n; ca.y = in.y; ca.ldy = b.ldC; ca.C = c.gdn_conv_dim(); ca.K = c.linear_conv_kernel_dim;
    const GdnRecArgs ra = gdn_args(d, st, rows);
    // Row-path steps: the conv in the GEMV's epilogue (no conv kernel and hand-over after it).
    if (gemv_conv(jobs, 4, b.u, b.ldH, rows, stream_, &b.ufr, ca, sp)) {
      mark("gdn in_proj");
    } else {
      gemv(jobs, 4, b.u, b.ldH, rows, stream_, &b.ufr);
      mark("gdn in_proj");
      gdn_conv(ca, sp, rows, stream_);
      mark("gdn conv");
    }
    // Prefill chunks (more rows than a row-path step, never snapshotted) take the chunked form.
    if (rows > kMaxRows && gdn_chunked_enabled() && gdn_chunked_fits(ra)) {
      gdn_chunked(ra, rows, stream_);
      mark("gdn delta rule (chunked)");
    } else {
      gdn_recurrent(ra, sp, rows, stream_);
      mark("gdn delta rule (recurrent)");
    }
    matvec(g.out, b.go, b.ldVd, b.o, b.ldH, rows, stream_);
    mark("gdn out_proj");
  } else {
    const DAttn& at = d.attn;
    GemvJob jobs[4];
    jobs[0].w = at.q; jobs[0].y = b.qg; jobs[0].ldy = b.ldQG;
    jobs[1].w = at.k; jobs[1].y = b.ak; jobs[1].ldy = b.ldKV;
    jobs[2].w = at.v; jobs[2].y = b.av; jobs[2].ldy = b.ldKV;
    jobs[3].w = at.index_qk; jobs[3].y = b.iqk; jobs[3].ldy = b.ldIQK;
    gemv(jobs, 4, b.u, b.ldH, rows, stream_, &b.ufr);
    mark("attn q/k/v/index proj");
    AttnArgs a;
    a.qg = b.qg; a.ldqg = b.ldQG; a.k = b.ak; a.ldk = b.ldKV; a.v = b.av; a.ldv = b.ldKV; a.iqk = b.iqk;
    a.ldiqk = b.ldIQK; a.q_norm = at.q_norm; a.k_norm = at.k_norm; a.iq_norm = at.iq_norm; a.ik_norm = at.ik_norm;
    a.inv_freq = m_.inv_freq_.get(); a.rot = c.rotary_dim();
    a.k_cache = st.k_cache; a.v_cache = st.v_cache; a.idx_keys = st.idx_keys; a.blk_keys = st.blk_keys;
    a.q = b.q; a.ldq = b.ldQ; a.iq = b.iq; a.ldiq = b.ldIQ; a.scores = b.scores; a.sel = b.sel; a.nb_max = b.nb_max;
    a.out = b.ao; a.ldo = b.ldQ;
    a.nh = c.num_attention_heads; a.nkv = c.num_key_value_heads; a.hd = c.head_dim; a.inh = c.indexer_n_heads;
    a.ihd = c.indexer_head_dim; a.cr = c.indexer_compress_ratio;
    a.block_topk = c.indexer_budget / c.indexer_compress_ratio; a.eps = eps;
    a.keys_bound = chunk_keys_;
    attention(a, sp, rows, stream_);
    mark("attn core");
    matvec(at.o, b.ao, b.ldQ, b.o, b.ldH, rows, stream_);
    mark("attn o_proj");
  }
  tap(pre + "attn_out", b.o, rows, H, b.ldH);
  defer_combine(b.o, b.w, rows);  // into the MoE mix's norm
  tap(pre + "post_attn", b.R, rows, W, b.ldW);

  hc_mix(d.hc_mlp, rows, b.u, b.w);  // c
  mark("hc mix");
  tap(pre + "moe_u", b.u, rows, H, b.ldH);
  const int k = c.num_experts_per_tok;
  {
    const DMoe& mo = d.moe;
    GemvJob jobs[2];
    jobs[0].w = mo.router; jobs[0].y = b.mlog; jobs[0].ldy = b.ldEx;
    jobs[1].w = mo.sh_expert_gate; jobs[1].y = b.mgl; jobs[1].ldy = 4;
    // A prefill chunk with the router's nibble split: logits = hi + lo on the 4-bit tensor-core
    // kernels with all three parts of x (exact products, fp32 sums; moe_route adds the two).
    // (gemm_q4 may decline a short chunk of matrices in rows: then the 8-bit router as on the row path.)
    GemvJob rj[2];
    rj[0].w = mo.router_hi; rj[0].y = b.mlog; rj[0].ldy = b.ldEx;
    rj[1].w = mo.router_lo; rj[1].y = b.mlog2; rj[1].ldy = b.ldEx;
    const bool split = rows > kMaxRows && mo.router_hi.data && gemm_q4(rj, 2, b.u, b.ldH, rows, stream_, 3);
    gemv(split ? &jobs[1] : jobs, split ? 1 : 2, b.u, b.ldH, rows, stream_, &b.ufr);  // (2-8 rows: u's fragments)
    mark("moe router");
    MoeRouteArgs ra;
    ra.logits = b.mlog; ra.ld = b.ldEx; ra.E = c.num_experts; ra.k = k; ra.norm_topk = c.norm_topk_prob ? 1 : 0;
    ra.logits2 = split ? b.mlog2 : nullptr;
    ra.table = table;
    ra.inter = c.moe_intermediate_size; ra.hidden = H;
    ra.sh_gate = mo.sh_gate; ra.sh_up = mo.sh_up; ra.sh_down = mo.sh_down; ra.pairs = b.pairs;
    moe_route(ra, rows, stream_);
    mark("moe route (top-k)");
    const int n_pairs = rows * (k + 1);
    if (rows > kMaxRows) {  // prefill chunk: each expert's weights once for all the rows that chose it
      group_pairs(b.pairs, n_pairs, c.num_experts + 1, b.order, b.tiles, b.n_tiles, stream_);
      mark("moe group pairs");
      // The grids cover this chunk's most tiles, not the session's b.max_tiles (blocks past the tile
      // count return at once, but a 512-row chunk in an 8,192-row session launched ~5x the blocks it
      // needs).
      const int max_tiles = grouped_max_tiles(n_pairs, c.num_experts + 1);
      if (mo.q4) {
        expert_gate_up_q4(b.pairs, b.order, b.tiles, b.n_tiles, max_tiles, m_.max_inter_, b.u, b.ldH, rows, H, b.mh,
                          b.ldMI, stream_);
        mark("moe experts gate/up");  // (then "moe experts" is the down product)
        expert_down_q4(b.pairs, b.order, b.tiles, b.n_tiles, max_tiles, H, m_.max_inter_, b.mh, b.ldMI, n_pairs,
                       b.my, b.ldH, stream_);
      } else {
        expert_gate_up_grouped(b.pairs, b.order, b.tiles, b.n_tiles, max_tiles, m_.max_inter_, b.u, b.ldH, b.mh,
                               b.ldMI, stream_);
        expert_down_grouped(b.pairs, b.order, b.tiles, b.n_tiles, max_tiles, H, b.mh, b.ldMI, b.my, b.ldH, stream_);
      }
      mark("moe experts");
    } else {
      if (mo.q4 && expert_tc4_enabled() && H % 64 == 0) {
        const SharedSlot sh = route_shared_slot(ra);
        // Tiled experts: gate/up and down as one kernel where it applies (expert_tc4_fused), else two.
        if (!m_.tiled_experts() || !expert_tc4_fused(b.pairs, n_pairs, m_.max_inter_, H, b.u, b.ldH, rows, b.mh,
                                                     b.ldMI, b.my, b.ldH, b.expert_counts, stream_, &b.ufr, &sh)) {
          expert_gate_up_tc4(b.pairs, n_pairs, m_.max_inter_, H, b.u, b.ldH, rows, b.mh, b.ldMI, stream_, &b.ufr,
                             m_.tiled_experts(), &sh);
          // (Right after gate/up: the down kernel reads the route's pairs before its wait, two kernels back.)
          expert_down_tc4(b.pairs, n_pairs, m_.max_inter_, H, b.mh, b.ldMI, b.my, b.ldH, stream_, m_.tiled_experts());
        }
      } else {
        expert_gate_up(b.pairs, n_pairs, m_.max_inter_, H, b.u, b.ldH, b.mh, b.ldMI, mo.codes48, stream_);
        expert_down(b.pairs, n_pairs, m_.max_inter_, H, b.mh, b.ldMI, b.my, b.ldH, mo.codes48, stream_);
      }
      mark("moe experts");
    }
    // o = the slots combined (moe_combine), deferred with the hyper-connection combine into the next
    // mix: at one row its first phase computes o itself (with taps, defer_combine runs both at once).
    PendingMoe pm;
    pm.y = b.my; pm.ldy = b.ldH; pm.pairs = b.pairs; pm.k = k; pm.gl = b.mgl; pm.ldgl = 4; pm.o = b.o;
    defer_combine(b.o, b.w, rows, pm);  // into the next mix's norm (profiling counts it there)
    static const bool in_mix = !env_is("CK_MOE_COMBINE_IN_MIX", "0");  // 0: moe_combine here, to compare
    if (!in_mix) materialize_moe();
  }
  tap(pre + "moe_out", b.o, rows, H, b.ldH);
  mark("combine");
  tap(pre + "post_moe", b.R, rows, W, b.ldW);
}

// Everything up to the final mixer's output fy (rows, H); the pre-mixer residual of rows [from, rows)
// goes to hidden_h_ (at the same row offsets): only the rows that produce outputs travel.
void Session::enqueue_trunk(int rows, int from) {
  const ModelConfig& c = m_.cfg();
  Buffers& b = *b_;
  const int H = c.hidden_size, S = c.hc_count;
  mark(nullptr);  // the start of the step (profiling)
  // Only the rows' tokens travel (a chunk's StepParams is 4 KB; a decode step needs 20 bytes of it).
  const size_t param_bytes = offsetof(StepParams, tokens) + sizeof(int32_t) * rows;
  CUDA_CHECK(cudaMemcpyAsync(b.params, params_h_.get(), param_bytes, cudaMemcpyHostToDevice, stream_));
  for (int i = 0; ple_rows_with_params(rows) && i < m_.n_ple_; ++i)  // a decode step's PLE rows too
    CUDA_CHECK(cudaMemcpyAsync(b.emb_step + static_cast<size_t>(i) * kMaxRows * b.ldE,
                               ple_emb_h_.get() + static_cast<size_t>(i) * chunk_rows_ * b.ldE,
                               sizeof(float) * rows * b.ldE, cudaMemcpyHostToDevice, stream_));
  // A prefill chunk's first PLE layer's rows (84 MB of fp32 at 8,192 rows) go up beside the layers
  // before it (ple_rows_early).
  if (ple_rows_early(rows) && m_.n_ple_ > 0) {
    CUDA_CHECK(cudaStreamWaitEvent(upload_stream_, emb_free_, 0));  // the chunk before has read b.emb
    CUDA_CHECK(cudaMemcpyAsync(b.emb, ple_emb_h_.get(), sizeof(float) * rows * b.ldE, cudaMemcpyHostToDevice,
                               upload_stream_));
    CUDA_CHECK(cudaEventRecord(emb_ready_, upload_stream_));
  }
  embed_wide(m_.embed_, b.params, rows, S, H, b.R, b.ldW, stream_);  // trap 5: the embedding in every stream
  mark("embed");
  for (size_t L = 0; L < m_.layers_.size(); ++L)
    enqueue_block(m_.layers_[L], ls_[L], m_.pool_.table.get() + L * static_cast<size_t>(c.num_experts), b.params,
                  "L" + std::to_string(L) + ".", rows);
  hc_mix(m_.final_mixer_, rows, b.fy, nullptr);  // §9: no final norm (it takes the last combine; R is final)
  CHECK_MSG(!pending_combine_, "a deferred combine outlived the trunk");
  copy_hidden_down(from, rows);
  mark("final mixer");
  tap("final_y", b.fy, rows, H, b.ldH);
}

void Session::enqueue_step(int rows, bool want_logits) {
  const ModelConfig& c = m_.cfg();
  Buffers& b = *b_;
  const bool late = copies_at_ends_on();
  enqueue_trunk(rows, late ? rows : 0);
  matvec(m_.lm_head_, b.fy, b.ldH, b.logits, b.ldV, rows, stream_);
  argmax(b.logits, c.vocab_size, b.argmax, rows, b.ldV, b.argmax_scratch, stream_);
  if (late) copy_hidden_down(0, rows);
  CUDA_CHECK(cudaMemcpyAsync(argmax_h_.get(), b.argmax, sizeof(int32_t) * rows, cudaMemcpyDeviceToHost, stream_));
  if (want_logits)
    CUDA_CHECK(cudaMemcpyAsync(logits_h_.get(), b.logits, sizeof(float) * rows * b.ldV, cudaMemcpyDeviceToHost,
                               stream_));
}

// ==================================================================== profiling

// Records an event after the work enqueued so far, attributed to `piece` (nullptr: the start). Only in
// prefill chunks, which launch directly (events inside a captured graph would not time the replay).
void Session::mark(const char* piece) {
  if (!profile_ || !marking_) return;
  cudaEvent_t e = nullptr;
  CUDA_CHECK(cudaEventCreate(&e));
  CUDA_CHECK(cudaEventRecord(e, stream_));
  marks_.emplace_back(piece ? piece : "", e);
}

// After the stream has synchronised: adds each interval to its piece and frees the events.
void Session::collect_marks() {
  for (size_t i = 1; i < marks_.size(); ++i) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second));
    if (!marks_[i].first.empty()) prof_ms_[marks_[i].first] += ms;
  }
  for (auto& [name, e] : marks_) CUDA_CHECK(cudaEventDestroy(e));
  marks_.clear();
}

std::vector<uint64_t> Session::hc_mix_stamps() {
  Buffers& b = *b_;
  if (!b.hc_stamps) return {};
  std::vector<uint64_t> h(static_cast<size_t>(kHcStampWords) * sm_count());
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  CUDA_CHECK(cudaMemcpy(h.data(), b.hc_stamps, h.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  return h;
}

std::vector<std::pair<std::string, double>> Session::take_profile() {
  std::vector<std::pair<std::string, double>> v(prof_ms_.begin(), prof_ms_.end());
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  prof_ms_.clear();
  return v;
}

// ==================================================================== steps

Status Session::run_chunk(std::span<const int32_t> tokens, int64_t pos, bool snap, bool want_logits, StepResult* out,
                          int row0, int first_out) {
  const ModelConfig& c = m_.cfg();
  const ModelWeights& w = m_.weights();
  const int rows = static_cast<int>(tokens.size());
  Buffers& b = *b_;
  StepParams p;
  p.pos = pos;
  p.rows = rows;
  p.snap = snap ? 1 : 0;
  p.state_parity = state_parity_;
  for (int r = 0; r < rows; ++r) p.tokens[r] = tokens[r];
  std::memcpy(params_h_.get(), &p, sizeof(p));
  // Host half of PLE (DESIGN §5): row ids from the tokens, rows dequantized into pinned memory (in
  // parallel for a prefill chunk: cpu::Model::ple_gather). With snapshots, every PLE layer's context
  // after each row but the last ([row][ple layer]), for restore_snapshot.
  if (m_.n_ple_ > 0) {
    ngram_snaps_.clear();
    if (snap && rows > 1)
      ngram_snaps_.assign(static_cast<size_t>(rows - 1), std::vector<std::vector<int64_t>>(ngram_ctx_.size()));
    std::vector<std::vector<int64_t>> after;
    for (size_t L = 0; L < m_.layers_.size(); ++L) {
      if (!m_.layers_[L].ple) continue;
      const int pi = m_.layers_[L].ple->index;
      float* dst = ple_emb_h_.get() + static_cast<size_t>(pi) * chunk_rows_ * b.ldE;
      m_.ref_.ple_gather(*w.layers[L].ple, ngram_ctx_[pi], tokens, dst, b.ldE, snap ? &after : nullptr);
      for (int r = 0; snap && r + 1 < rows; ++r) ngram_snaps_[r][pi] = std::move(after[r]);
    }
  }
  const int64_t V = c.vocab_size, W = c.wide();
  // Rows of this chunk from `start` on produce outputs: output row (row0 + r - first_out) of `out`.
  const int start = std::clamp(first_out - row0, 0, rows);
  auto out_row = [&](int r) { return static_cast<size_t>(row0 + r - first_out); };
  // From the pinned buffers into `out`: logits rows [r0, r0+n) of this chunk (`src` holds row r0 first,
  // rows b.ldV apart), and each output row's argmax and pre-mixer hidden.
  auto copy_logits = [&](int r0, int n, const float* src) {
    for (int r = 0; r < n; ++r)
      std::memcpy(out->logits.data() + out_row(r0 + r) * V, src + static_cast<size_t>(r) * b.ldV, sizeof(float) * V);
  };
  auto copy_rows = [&] {
    for (int r = start; r < rows; ++r) {
      out->argmax[out_row(r)] = argmax_h_[r];
      std::memcpy(out->hidden.data() + out_row(r) * W, hidden_h_.get() + static_cast<size_t>(r) * b.ldW,
                  sizeof(float) * W);
    }
  };
  if (rows > kMaxRows) {
    // Prefill chunk: direct launches (a few hundred per chunk against milliseconds of work), the LM head
    // in slices of kLmRows rows so the logits buffer stays small, and only over the output rows.
    marking_ = true;
    chunk_keys_ = pos + rows;
    enqueue_trunk(rows, start);
    chunk_keys_ = 0;
    for (int s0 = start; s0 < rows; s0 += kLmRows) {
      const int n = std::min(kLmRows, rows - s0);
      matvec(m_.lm_head_, b.fy + static_cast<size_t>(s0) * b.ldH, b.ldH, b.logits, b.ldV, n, stream_);
      argmax(b.logits, c.vocab_size, b.argmax + s0, n, b.ldV, b.argmax_scratch, stream_);
      mark("lm head");
      if (!want_logits) continue;
      CUDA_CHECK(cudaMemcpyAsync(logits_h_.get(), b.logits, sizeof(float) * n * b.ldV, cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      copy_logits(s0, n, logits_h_.get());
    }
    if (start < rows)
      CUDA_CHECK(cudaMemcpyAsync(argmax_h_.get() + start, b.argmax + start, sizeof(int32_t) * (rows - start),
                                 cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    marking_ = false;
    collect_marks();
    copy_rows();
    return {};
  }
  ScratchScope scratch(&step_scratch_);  // the step's kernel scratch without memory nodes in its graph
  if (use_graphs_ && !taps_) {
    const auto key = std::make_pair(rows, want_logits);
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      const std::string what = fmt::format("step graph, {} row(s){}", rows, want_logits ? " with logits" : "");
      it = graphs_.emplace(key, capture_graph([&] { enqueue_step(rows, want_logits); }, what)).first;
    }
    CUDA_CHECK(cudaGraphLaunch(it->second.exec, stream_));
  } else {
    enqueue_step(rows, want_logits);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  copy_rows();
  if (want_logits) copy_logits(start, rows - start, logits_h_.get() + static_cast<size_t>(start) * b.ldV);
  return {};
}

Session::StepGraph Session::capture_graph(const std::function<void()>& enqueue, const std::string& what) {
  StepGraph sg;
  cudaGraph_t g = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  enqueue();
  CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
  sg.shape = graph_shape(g);
  static const bool log_shape = env_is("CK_GRAPH_STATS", "1");
  if (log_shape) LOG_INF("cuda", "{}: {}", what, describe(sg.shape));
  CUDA_CHECK(cudaGraphInstantiate(&sg.exec, g, 0));
  CUDA_CHECK(cudaGraphDestroy(g));
  return sg;
}

Status Session::step_rows(std::span<const int32_t> tokens, bool snap, bool want_logits, StepResult* out,
                          RowOutputs which) {
  CHECK_MSG(pending_rows_ == 0, "step_rows called twice without commit");
  const ModelConfig& c = m_.cfg();
  if (tokens.empty()) return error("step_rows: no tokens");
  const int rows = static_cast<int>(tokens.size());
  for (int r = 0; r < rows; ++r)
    if (tokens[r] < 0 || tokens[r] >= c.vocab_size)
      return error("token id {} at position {} is outside the vocabulary [0, {})", tokens[r], pos_ + r, c.vocab_size);
  if (pos_ + rows > max_ctx_)
    return error("step_rows: positions {}..{} exceed the session's context of {} (--max-ctx)", pos_, pos_ + rows - 1,
                 max_ctx_);
  if (snap && rows > kMaxRows)
    return error("step_rows: snapshots need at most {} rows (got {})", kMaxRows, rows);
  const int64_t V = c.vocab_size, W = c.wide();
  const int first_out = which == RowOutputs::kLast ? rows - 1 : 0;
  const size_t n_out = static_cast<size_t>(rows - first_out);
  out->argmax.assign(n_out, 0);
  out->logits.assign(want_logits ? n_out * V : 0, 0.0f);
  out->hidden.assign(n_out * W, 0.0f);
  // Without snapshots, long inputs take the prefill path in chunks of prefill_chunk_ rows; what is left
  // (and every step with snapshots) takes the row path in steps of kMaxRows.
  for (int r0 = 0; r0 < rows;) {
    const int left = rows - r0;
    const int n = (!snap && prefill_chunk_ > kMaxRows && left > kMaxRows) ? std::min(prefill_chunk_, left)
                                                                          : std::min(kMaxRows, left);
    TRY(run_chunk(tokens.subspan(r0, n), pos_ + r0, snap, want_logits, out, r0, first_out));
    r0 += n;
  }
  pending_rows_ = rows;
  pending_snap_ = snap;
  return {};
}

// The conv and PLE states after row `row` of the last step, from its snapshots (the delta rule's state
// is replayed instead: replay_deltanet).
void Session::restore_snapshot(int row) {
  for (LayerState& st : ls_) {
    if (st.gdn_conv && st.gdn_conv_n > 0)
      CUDA_CHECK(cudaMemcpyAsync(st.gdn_conv, st.gdn_conv_snaps + row * st.gdn_conv_n, sizeof(float) * st.gdn_conv_n,
                                 cudaMemcpyDeviceToDevice, stream_));
    if (st.gdn_s_snaps)  // (CK_GDN_SNAPSHOTS=1)
      CUDA_CHECK(cudaMemcpyAsync(st.gdn_s, st.gdn_s_snaps + row * st.gdn_s_n, sizeof(float) * st.gdn_s_n,
                                 cudaMemcpyDeviceToDevice, stream_));
    if (st.ple_conv && st.ple_n > 0)
      CUDA_CHECK(cudaMemcpyAsync(st.ple_conv, st.ple_snaps + row * st.ple_n, sizeof(float) * st.ple_n,
                                 cudaMemcpyDeviceToDevice, stream_));
  }
  if (!ngram_snaps_.empty()) ngram_ctx_ = ngram_snaps_[row];
  CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// The delta rule's state after the first n rows of the last step (a step with snapshots, which left
// the state before it in the buffer state_parity_ names and its inputs in the layers' buffers): those
// rows again, in place on that buffer. The same kernel on the same inputs, so the same bits as the
// step's own rows (gdn_recurrent's forms of 1 and of 2-8 rows agree bit for bit: test_cuda_ops). Why
// not snapshots: a snapshot is a full state write per row in every step (3.1 MB a layer and row at the
// released geometry; 4-row decode 3.8-6.6% slower with them, H100 2026-12-07), a replay is paid only
// by the steps whose drafts are rejected.
void Session::replay_deltanet(int n) {
  StepParams p;
  p.pos = pos_;
  p.rows = n;
  p.snap = 0;
  p.state_parity = state_parity_;
  CUDA_CHECK(cudaMemcpyAsync(b_->replay_params, &p, offsetof(StepParams, tokens), cudaMemcpyHostToDevice, stream_));
  for (size_t L = 0; L < ls_.size(); ++L)
    if (m_.layers_[L].kind == LayerKind::LinearAttention)
      gdn_recurrent(gdn_args(m_.layers_[L], ls_[L], n), b_->replay_params, n, stream_);
  CUDA_CHECK(cudaStreamSynchronize(stream_));  // (p is on this stack)
}

void Session::commit(int n) {
  CHECK_MSG(n >= 1 && n <= pending_rows_, "commit({}) after a step of {} rows", n, pending_rows_);
  CHECK_MSG(n == pending_rows_ || pending_snap_, "commit({}) < rows {} needs snap", n, pending_rows_);
  if (gdn_replay_ && pending_snap_ && n == pending_rows_) {
    state_parity_ ^= 1;  // the step wrote the state after its last row into the other buffer
  } else if (n < pending_rows_) {
    if (gdn_replay_) replay_deltanet(n);
    restore_snapshot(n - 1);
  }
  pos_ += n;
  pending_rows_ = 0;
  ngram_snaps_.clear();
}

// ==================================================================== §10 MTP draft head

// The CPU's mtp_step on the device, fp32 throughout. One row, launched directly on the session's
// stream (no graph: a draft step is a few dozen launches; capturing it is later work), then one
// synchronisation. It uses the step buffers (b.R and the scratch of enqueue_block) but no trunk
// state, and its own StepParams, so the trunk's graphs and pending rows are untouched.
Status Session::mtp_step(const float* h_in, int32_t next_token, int64_t mtp_pos, float* logits, float* h_out) {
  if (!m_.has_mtp()) return error("this model has no MTP head");
  const ModelConfig& c = m_.cfg();
  if (next_token < 0 || next_token >= c.vocab_size)
    return error("MTP token id {} is outside the vocabulary [0, {})", next_token, c.vocab_size);
  if (mtp_pos < 0 || mtp_pos >= max_ctx_)
    return error("mtp_step: MTP position {} is outside the session's context of {} (--max-ctx)", mtp_pos, max_ctx_);
  const DMtp& mt = *m_.mtp_;
  Buffers& b = *b_;
  const int H = c.hidden_size, S = c.hc_count, W = c.wide();
  const float eps = static_cast<float>(c.rms_norm_eps);
  ScratchScope scratch(&step_scratch_);
  StepParams p;
  p.pos = mtp_pos;
  p.rows = 1;
  p.snap = 0;
  p.tokens[0] = next_token;
  std::memcpy(mtp_params_h_.get(), &p, sizeof(p));
  std::memcpy(mtp_in_h_.get(), h_in, sizeof(float) * W);
  // One submission, as a trunk step: the kernels between the inputs' copies and the outputs' copies,
  // captured once per session (the position and token come from b.mtp_params on the device).
  auto enqueue = [&] {
    CUDA_CHECK(cudaMemcpyAsync(b.mtp_params, mtp_params_h_.get(), sizeof(StepParams), cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(b.mtp_h, mtp_in_h_.get(), sizeof(float) * W, cudaMemcpyHostToDevice, stream_));
    // fe = fc_embedding · N1(E[x]): the embedding row as one "stream" of embed_wide.
    embed_wide(m_.embed_, b.mtp_params, 1, 1, H, b.mtp_e, b.ldH, stream_);
    rmsnorm_grouped(b.mtp_e, H, H, mt.norm_embedding, eps, b.mtp_en, 1, b.ldH, stream_);
    matvec(mt.fc_embedding, b.mtp_en, b.ldH, b.mtp_fe, b.ldH, 1, stream_);
    // pre_fc_norm_hidden: one RMS statistic per stream (grouped), as the CPU (spec §14 open question 1).
    rmsnorm_grouped(b.mtp_h, W, H, mt.norm_hidden, eps, b.mtp_hn, 1, b.ldW, stream_);
    // fh_s = fc_hidden · Hn_s for every stream: the S streams as S rows of H (ld = H), straight into R.
    for (int s0 = 0; s0 < S; s0 += kMaxRows)
      matvec(mt.fc_hidden, b.mtp_hn + static_cast<size_t>(s0) * H, H, b.R + static_cast<size_t>(s0) * H, H,
             std::min(kMaxRows, S - s0), stream_);
    // R0_s = fh_s + fe: hc_combine with unit weights is exactly that sum (fe · 1 is exact, one rounding).
    defer_combine(b.mtp_fe, b.mtp_ones, 1);  // into the layer's first mix norm
    tap("MTP.R0", b.R, 1, W, b.ldW);
    const ExpertSlot* table = m_.pool_.table.get() + static_cast<size_t>(c.num_hidden_layers) * c.num_experts;
    enqueue_block(mt.layer, *mtp_ls_, table, b.mtp_params, "MTP.", 1);
    hc_mix(mt.mixer, 1, b.fy, nullptr);  // the head's own final mixer, no norm after it (R is final after it)
    CHECK_MSG(!pending_combine_, "a deferred combine outlived the MTP step");
    tap("MTP.final_y", b.fy, 1, H, b.ldH);
    matvec(m_.lm_head_, b.fy, b.ldH, b.logits, b.ldV, 1, stream_);
    // After the LM head (which reads fy, not R): a copy between the mixer and the LM head would hold the
    // LM head's early start (as in a trunk step, copies_at_ends_on).
    if (h_out) copy_hidden_down(0, 1);
    CUDA_CHECK(cudaMemcpyAsync(logits_h_.get(), b.logits, sizeof(float) * c.vocab_size, cudaMemcpyDeviceToHost, stream_));
  };
  if (use_graphs_ && !taps_) {
    StepGraph& g = mtp_graphs_[h_out ? 1 : 0];
    if (!g.exec) g = capture_graph(enqueue, h_out ? "MTP step graph with h_out" : "MTP step graph");
    CUDA_CHECK(cudaGraphLaunch(g.exec, stream_));
  } else {
    enqueue();
  }
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::memcpy(logits, logits_h_.get(), sizeof(float) * c.vocab_size);
  if (h_out) std::memcpy(h_out, hidden_h_.get(), sizeof(float) * W);
  return {};
}

}  // namespace ck::cuda
