// The CUDA engine for qwen4_exp: cuda::Model (dense weights uploaded, every routed expert resident in
// a slot array behind the expert table) and cuda::Session, which mirrors cpu::Session (step_rows with
// per-row snapshots of the conv/PLE state on the device and the DeltaNet state from before the step,
// commit(n) with rollback: the delta rule's kept rows replayed). Each step
// of up to kMaxRows rows is one stream submission: a CUDA graph captured per (rows, want_logits) and
// replayed, with positions and tokens read on the device. Longer calls without snapshots run as prefill
// chunks of up to kMaxChunkRows rows (kChunkRows by default) on the tensor cores (cuda/gemm.cu: dense projections as GEMMs, experts
// grouped per expert, the other kernels over all the chunk's rows). The MTP draft head (spec §10) runs
// as Session::mtp_step, one token at a time with direct launches (no graph yet).
// Host-compiled header: no device code here.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cpu/qwen4_exp.h"
#include "cuda/common.h"
#include "cuda/dmatrix.h"
#include "cuda/graph_shape.h"
#include "cuda/weights.h"
#include "format/weights.h"

namespace ck::cuda {

using StepResult = cpu::StepResult;
using RowOutputs = cpu::RowOutputs;
struct StepParams;  // cuda/layers.h
struct GdnRecArgs;  // cuda/layers.h

struct DHc {
  const float* norm = nullptr;  // (W)
  DMatrix down, up, inject;     // inject: rows == 0 on the final mixers
  // inject padded to one 16-row tile (rows() is inject's) when down is in tiles: prefill chunks then
  // run down and inject in one call of the bulk-copy warpgroup kernel. Empty otherwise.
  DMatrix inject_tiles;
};
struct DGdn {
  DMatrix in_qkv, in_z, in_b, in_a, out;
  const float* conv = nullptr;  // (C, K)
  const float* a_log = nullptr;
  const float* dt_bias = nullptr;
  const float* norm = nullptr;
};
struct DAttn {
  DMatrix q, k, v, o, index_qk;
  const float *q_norm = nullptr, *k_norm = nullptr, *iq_norm = nullptr, *ik_norm = nullptr;
};
struct DPle {
  DMatrix key, value;
  const float *norm_key = nullptr, *norm_query = nullptr, *norm_conv = nullptr, *conv = nullptr;
  int index = 0;  // rank among the PLE layers (host buffers, n-gram context)
};
struct DMoe {
  DMatrix router, sh_gate, sh_up, sh_down, sh_expert_gate;
  // An 8-bit router as two 4-bit matrices (weights.h nibble_split) for prefill chunks, whose logits are
  // the sum of the two products (the 4-bit tensor-core kernels, all three parts of x: exact products);
  // empty otherwise. The row path keeps `router`.
  DMatrix router_hi, router_lo;
  bool codes48 = false;  // routed and shared experts all 4/8-bit codes: the faster expert kernels apply
  bool q4 = false;       // ... all 4-bit codes in groups of 64k: prefill's factored tensor-core experts
};
struct DLayer {
  LayerKind kind = LayerKind::LinearAttention;
  DHc hc_attn, hc_mlp;
  DGdn gdn;
  DAttn attn;
  std::optional<DPle> ple;
  DMoe moe;
};
// The MTP draft head (spec §10): its input projections, one attention decoder layer with its own
// experts (record layer num_hidden_layers of the expert pool) and its own final mixer.
struct DMtp {
  const float* norm_embedding = nullptr;  // (H) 1+w
  const float* norm_hidden = nullptr;     // (W) 1+w
  DMatrix fc_embedding, fc_hidden;        // (H, H) each
  DLayer layer;
  DHc mixer;
};

class Session;

class Model {
 public:
  // Uploads the dense weights and every trunk expert. Aborts on a model the kernels cannot run; use
  // create() to get that as a Status instead.
  Model(const ModelWeights& w, std::shared_ptr<ExpertSource> experts);
  static Result<std::unique_ptr<Model>> create(const ModelWeights& w, std::shared_ptr<ExpertSource> experts);
  // Whether the CUDA kernels support this geometry and these formats (checked before any upload).
  static Status supports(const ModelWeights& w);

  const ModelConfig& cfg() const { return w_.cfg; }
  const ModelWeights& weights() const { return w_; }
  const cpu::Model& reference() const { return ref_; }  // the host half: n-gram ids and rows
  bool has_mtp() const { return mtp_.has_value(); }
  // Whether prefill chunks run every trunk layer's experts in the factored 4-bit form (gemm_q4.cu).
  bool prefill_experts_q4() const {
    for (const DLayer& d : layers_)
      if (!d.moe.q4) return false;
    return !layers_.empty();
  }
  // max_ctx: positions the session's caches hold (attention KV, indexer keys).
  // chunk_rows: the rows of one prefill chunk, kMaxRows..kMaxChunkRows (clamped); the session's
  // per-row buffers hold that many rows (~0.8 MB of GPU memory per row at the released geometry).
  // chunk_rows 0: default_chunk_rows().
  std::unique_ptr<Session> new_session(int64_t max_ctx = 4096, int chunk_rows = 0) const;
  // A session's chunk rows unless its caller asks: the largest of kMaxChunkRows, half that, ... down to
  // kChunkRows whose buffers (at 4,096 positions) take at most a quarter of the GPU memory left free
  // after the weights, when the model was loaded. Larger chunks read each expert's weights fewer times
  // (prefill at 8k tokens: chunks of 8,192 rows +9% against 2,048 on the H200, docs/performance.md,
  // thirty-fourth session); a 16-32 GB GPU keeps kChunkRows. (vLLM also sizes its default batched
  // tokens by the GPU's memory.)
  int default_chunk_rows() const { return default_chunk_rows_; }
  // Whether a session of max_ctx positions and chunk_rows rows a chunk fits the GPU memory free now (an
  // error that names the positions, the chunk, the bytes and what is free, for a front end to report
  // before new_session, whose allocations would otherwise abort).
  Status chunk_fits(int64_t max_ctx, int chunk_rows) const;
  // A session's chunk rows for a caller's chunk_rows (0: default_chunk_rows()), clamped as the
  // session clamps them; and the GPU memory of a session: its per-row buffers (Session::buffer_bytes)
  // and its layers' states and caches (state_bytes, Session::state_bytes).
  int chunk_rows_for(int chunk_rows) const;
  uint64_t session_bytes(int64_t max_ctx, int chunk_rows) const;
  uint64_t state_bytes(int64_t max_ctx) const;

  // Sizes, for the banner and the benchmark ceilings.
  size_t dense_bytes() const { return dense_bytes_; }
  // How many dense matrices went up in 16-row tiles, and whether the experts did (dmatrix.h Tiles16).
  int tiled_dense_matrices() const { return tiled_dense_; }
  bool tiled_experts() const { return pool_.fmt.layout == static_cast<uint8_t>(WLayout::Tiles16); }
  const ExpertPool& experts() const { return pool_; }
  // Weight bytes one decode token reads: dense matrices it touches (one embedding row) plus k experts
  // per layer. The trunk only: MTP draft steps are extra work a driver counts itself.
  double active_bytes_per_token() const;
  // Weight bytes of one MTP draft step (its layer, projections and mixer, k routed experts, the LM
  // head, one embedding row); 0 without the head.
  double mtp_bytes_per_step() const;
  // Multiply-adds per token (x2 = FLOPs) of the matrices a token uses, attention scores excluded
  // (the trunk only, as above).
  double macs_per_token() const;

  // Moves every expert record to another slot (a seeded permutation into a fresh slot array) and
  // rewrites the table in place (the MTP's experts included). Kernels reach experts only through the
  // table, so results must not change by a bit (tests/parity/test_cuda_model.cpp). Not while a step runs.
  void permute_expert_slots(uint64_t seed);

 private:
  friend class Session;
  struct Deferred {};
  Model(const ModelWeights& w, std::shared_ptr<ExpertSource> experts, Deferred);  // no upload yet
  Status init();
  Status upload_layer(DenseUploader& up, const LayerWeights& lw, DLayer* d);
  // Whether the experts (routed and shared, all of them) can go up in 16-row tiles: they fit them, and
  // every row count takes the tensor-core expert kernels that read tiles (decode's v4, prefill's
  // gemm_q4). tiled_experts() then promises the decode kernels that every pair is tiled.
  bool expert_tiles_fit() const;

  const ModelWeights& w_;
  std::shared_ptr<ExpertSource> experts_src_;
  cpu::Model ref_;
  DeviceArena arena_;
  size_t dense_bytes_ = 0;
  DMatrix embed_, lm_head_;
  DHc final_mixer_;
  std::vector<DLayer> layers_;
  std::optional<DMtp> mtp_;
  ExpertPool pool_;  // record layers 0..L-1 of the trunk, then the MTP's layer L when it exists
  DeviceBuffer<float> inv_freq_;  // (rotary_dim / 2)
  int max_inter_ = 0;
  int default_chunk_rows_ = kChunkRows;
  int n_ple_ = 0;
  bool expert_tiles_ = false;  // the routed and shared experts in 16-row tiles (expert_tiles_fit)
  int tiled_dense_ = 0;
};

class Session {
 public:
  Session(const Model& m, int64_t max_ctx, int chunk_rows = kChunkRows);
  // GPU memory of a session's per-row buffers at `rows` rows per chunk (an estimate; Model::create
  // keeps it free beside the experts).
  static uint64_t buffer_bytes(const ModelConfig& c, int max_inter, int64_t max_ctx, int rows);
  // GPU memory of its per-layer states and caches, exactly: the DeltaNet and conv states with their
  // snapshots, the attention's K, V and indexer caches of max_ctx positions, the PLE conv states.
  // `layers`: each layer's kind and whether it has PLE (the MTP head's layer too, where there is one).
  static uint64_t state_bytes(const ModelConfig& c, const std::vector<std::pair<LayerKind, bool>>& layers,
                              int64_t max_ctx);
  // GPU memory this session took (tests: Model::session_bytes must cover it).
  size_t device_bytes() const { return arena_.bytes_used(); }
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // As cpu::Session::step_rows. Rows beyond kMaxRows run as consecutive device steps; `snap` is
  // limited to kMaxRows rows.
  Status step_rows(std::span<const int32_t> tokens, bool snap, bool want_logits, StepResult* out,
                   RowOutputs which = RowOutputs::kEvery);
  void commit(int n);
  int64_t pos() const { return pos_; }
  int64_t max_ctx() const { return max_ctx_; }

  // As cpu::Session::mtp_step (spec §10): one MTP draft step at position mtp_pos (< max_ctx) from the
  // wide hidden h_in (W floats, host) and the next token; writes the draft logits (vocab, host) and,
  // when h_out is not null, the new wide hidden (W, host). The MTP's own KV/indexer caches live in
  // this session, indexed by position: redoing a position overwrites its slot. Positions after a
  // rollback point must be redone in increasing order (as §10's driving does): a block's pooled
  // indexer key is recomputed when the block's last position is written, as in the trunk.
  // Independent of the trunk's state; may run between step_rows and commit. Synchronous.
  Status mtp_step(const float* h_in, int32_t next_token, int64_t mtp_pos, float* logits, float* h_out);

  // Graphs on (default) or off (every kernel launched directly, same kernels, same results).
  void set_use_graphs(bool on) { use_graphs_ = on; }
  // The shape of the captured graph of a step of `rows` rows (nodes, early and full kernel edges), or
  // null before such a step has run with graphs on. CK_GRAPH_STATS=1 also logs it at capture.
  const GraphShape* step_graph_shape(int rows, bool want_logits) const {
    auto it = graphs_.find({rows, want_logits});
    return it == graphs_.end() ? nullptr : &it->second.shape;
  }
  // The same for the MTP draft step (with or without its h_out copy).
  const GraphShape* mtp_graph_shape(bool with_hidden) const {
    const StepGraph& g = mtp_graphs_[with_hidden ? 1 : 0];
    return g.exec ? &g.shape : nullptr;
  }
  // Rows per prefill chunk (the tensor-core path for inputs longer than kMaxRows, taken when a step
  // needs no snapshots), at most the session's chunk_rows; <= kMaxRows turns it off (every row through
  // the GEMV path: bit-for-bit independent of how rows are grouped, which the tests compare).
  void set_prefill_chunk(int rows) { prefill_chunk_ = std::min(rows, chunk_rows_); }
  int chunk_rows() const { return chunk_rows_; }
  // Profiling of prefill chunks: GPU time per piece of the forward ("gdn recurrent", "moe experts",
  // ...; events between the pieces), summed over layers and chunks until take_profile(), which returns
  // the sums in ms, largest first, and clears them. Off by default (events cost a little).
  void set_profile(bool on) { profile_ = on; }
  std::vector<std::pair<std::string, double>> take_profile();
  // Debug: with CK_HC_TIMING=1 in the environment when the session was made, the last one-row
  // hyper-connection mix's timing, kHcStampWords words per block (HcMixArgs::stamps); empty otherwise.
  std::vector<uint64_t> hc_mix_stamps();
  // Debug: with a map, each step records named intermediates ("L3.post_attn", ...; rows x width,
  // row-major) of its rows; launches directly and synchronises after each piece. Not for speed.
  void set_taps(std::map<std::string, std::vector<float>>* taps) { taps_ = taps; }

 private:
  struct LayerState;
  template <class F>
  static void each_state_buffer(const ModelConfig& c, LayerKind kind, bool ple, int64_t max_ctx, bool replay,
                                LayerState& st, F&& f);
  static int64_t indexer_blocks(const ModelConfig& c, int64_t max_ctx);  // the indexer's blocks of max_ctx
  static bool gdn_replay_on();  // the delta rule rolls back by replay (not CK_GDN_SNAPSHOTS=1)
  // Rows [row0, row0 + tokens.size()) of a step_rows call; rows from first_out on produce outputs (as
  // output row r - first_out of `out`).
  Status run_chunk(std::span<const int32_t> tokens, int64_t pos, bool snap, bool want_logits, StepResult* out,
                   int row0, int first_out);
  void enqueue_trunk(int rows, int from);
  void copy_hidden_down(int from, int rows);  // pre-mixer residual rows [from, rows) into hidden_h_
  void mark(const char* piece);
  void collect_marks();
  void enqueue_step(int rows, bool want_logits);
  void enqueue_block(const DLayer& d, LayerState& st, const ExpertSlot* table, const StepParams* sp,
                     const std::string& tap_prefix, int rows);
  void hc_mix(const DHc& hc, int rows, float* u, float* w);
  // The hyper-connection combine R_s += o · w_s that ends a block's attention or MoE part (and the MTP's
  // R0) is deferred, so that the next mix's input norm takes it in the same kernel
  // (hc_combine_rmsnorm); flush_combine() launches it alone where something else reads R first (the
  // PLE, taps). o at ldH and w at ldS of the Buffers.
  // The MoE output o itself can be deferred too (moe.y set): its slots' y and weights, combined by
  // the one-row mix's first phase (no moe_combine launch), or by moe_combine into o wherever
  // something else takes the pending combine (materialize_moe).
  struct PendingMoe {
    const float* y = nullptr;  // the slots' outputs (rows * (k + 1), at ldy); nullptr: o is ready
    int ldy = 0;
    const ExpertPair* pairs = nullptr;
    int k = 0;
    const float* gl = nullptr;  // the shared expert's gate logit per row, at ldgl
    int ldgl = 0;
    float* o = nullptr;  // where moe_combine writes o (the pending combine's o, at ldH)
  };
  struct PendingCombine {
    const float* o;
    const float* w;
    int rows;
    PendingMoe moe;
  };
  std::optional<PendingCombine> pending_combine_;
  void defer_combine(const float* o, const float* w, int rows) { defer_combine(o, w, rows, PendingMoe()); }
  void defer_combine(const float* o, const float* w, int rows, const PendingMoe& moe);
  void materialize_moe();
  void flush_combine();
  void tap(const std::string& name, const float* d, int rows, int64_t n, int64_t ld);
  void restore_snapshot(int row);
  void replay_deltanet(int n);
  struct GdnInputs {
    float *y, *b, *a;  // post-conv q | k | v (at ldC), β's and the decay's logits (at ldNV)
  };
  GdnInputs gdn_inputs(LayerState& st, int rows) const;
  GdnRecArgs gdn_args(const DLayer& d, LayerState& st, int rows) const;

  const Model& m_;
  int64_t max_ctx_;
  int64_t pos_ = 0;
  int pending_rows_ = 0;
  bool pending_snap_ = false;
  // A rollback replays the delta rule's kept rows from the state before the step (replay_deltanet);
  // CK_GDN_SNAPSHOTS=1 at the session's construction: the state is snapshotted after every row instead
  // (as before 2026-12-07; to compare: the same bits).
  bool gdn_replay_;
  int state_parity_ = 0;  // which of each DeltaNet layer's two state buffers holds its state (LayerState)
  bool use_graphs_ = true;
  int chunk_rows_;     // rows the per-row buffers hold
  int prefill_chunk_;  // rows per prefill chunk, <= chunk_rows_
  bool profile_ = false, marking_ = false;
  int64_t chunk_keys_ = 0;  // during a prefill chunk: pos + rows, the most keys its rows attend to (AttnArgs)
  std::vector<std::pair<std::string, cudaEvent_t>> marks_;
  std::map<std::string, double> prof_ms_;
  std::map<std::string, std::vector<float>>* taps_ = nullptr;

  cudaStream_t stream_ = nullptr;
  // A prefill chunk's rows of its first PLE layer travel on upload_stream_ while the layers before it
  // run (enqueue_trunk, ple_rows_early); emb_free_ says the chunk before has read b.emb, emb_ready_ that the rows are in.
  cudaStream_t upload_stream_ = nullptr;
  cudaEvent_t emb_free_ = nullptr, emb_ready_ = nullptr;
  DeviceArena arena_{size_t{64} << 20};
  StepScratch step_scratch_;  // the decode steps' kernel scratch (common.h ScratchScope), from arena_
  std::vector<LayerState> ls_;
  std::unique_ptr<LayerState> mtp_ls_;  // the MTP layer's caches, when the model has the head
  // Host recurrent state: the n-gram context of each PLE layer, and its snapshots.
  std::vector<std::vector<int64_t>> ngram_ctx_;
  std::vector<std::vector<std::vector<int64_t>>> ngram_snaps_;  // [row][ple layer]

  // Step inputs and outputs in pinned memory; the graph's copies read/write them at replay.
  PinnedBuffer<uint8_t> params_h_;   // StepParams
  PinnedBuffer<float> ple_emb_h_;    // (n_ple, kMaxRows, ldE)
  PinnedBuffer<int32_t> argmax_h_;   // (kMaxRows)
  PinnedBuffer<float> hidden_h_;     // (kMaxRows, ldW)
  PinnedBuffer<float> logits_h_;     // (kMaxRows, ldV)
  // The MTP step's own inputs (the trunk's StepParams stay as the trunk's graphs left them).
  PinnedBuffer<uint8_t> mtp_params_h_;  // StepParams
  PinnedBuffer<float> mtp_in_h_;        // (W)

  struct Buffers;
  std::unique_ptr<Buffers> b_;
  struct StepGraph {
    cudaGraphExec_t exec = nullptr;
    GraphShape shape;  // read from the capture before instantiation
  };
  // What `enqueue` puts on stream_, captured and instantiated (CK_GRAPH_STATS=1 logs its shape as `what`).
  StepGraph capture_graph(const std::function<void()>& enqueue, const std::string& what);
  std::map<std::pair<int, bool>, StepGraph> graphs_;  // trunk steps by (rows, want_logits)
  StepGraph mtp_graphs_[2];                            // MTP draft steps without / with the h_out copy
};

}  // namespace ck::cuda
