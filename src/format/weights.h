// The qwen4_exp weights as the engines see them: every tensor of shared/spec/qwen4_exp.md §12 resolved
// from any accepted checkpoint layout (docs/formats.md: Hugging Face per-expert or fused, with or
// without the `model.language_model.` prefix; MLX with `switch_mlp` and folded norms) into views
// (Matrix) over the memory-mapped files. Small vectors (norm scales, conv taps, gates) are copied
// out as fp32, with the `1 + w` of zero-centred norms applied exactly once. Routed experts are
// reached only through ExpertSource, so a store or a bounded pool can serve them instead.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "format/config.h"
#include "format/matrix.h"
#include "format/safetensors.h"

namespace ck {

// One gated residual ("hyper-connection") module; `inject` is empty on the final mixers.
struct HcWeights {
  std::vector<float> norm;   // (W) effective N1 scale 1+w
  Matrix down;               // (hc_lowrank, W)
  Matrix up;                 // (W, hc_lowrank)
  Matrix inject;             // (S, W) or empty
};

struct GdnWeights {
  Matrix in_qkv;             // (2*Kd + Vd, H)
  Matrix in_z;               // (Vd, H)
  Matrix in_b, in_a;         // (n_value_heads, H)
  Matrix out;                // (H, Vd)
  std::vector<float> conv;   // (conv_dim, kernel) taps, tap kernel-1 is the current token
  std::vector<float> a_log, dt_bias;  // (n_value_heads)
  std::vector<float> norm;   // (value_head_dim) plain N2 weight
};

struct AttnWeights {
  Matrix q;                  // (n_heads * 2 * head_dim, H), per head [query | gate]
  Matrix k, v;               // (n_kv_heads * head_dim, H)
  Matrix o;                  // (H, n_heads * head_dim)
  std::vector<float> q_norm, k_norm;   // (head_dim) 1+w
  Matrix index_qk;           // ((idx_heads + 1) * idx_head_dim, H)
  std::vector<float> index_q_norm, index_k_norm;  // (idx_head_dim) 1+w
};

struct PleWeights {
  int ple_index = 0;                 // rank among the PLE layers (seeds the hash)
  Matrix key;                        // (W, ple_embed_dim)
  Matrix value;                      // (H, ple_embed_dim)
  std::vector<float> norm_key, norm_query, norm_conv;  // (W) 1+w
  std::vector<float> conv;           // (W, ple_conv_kernel) taps
  std::vector<Matrix> table_parts;   // n-gram rows, concatenated in order: (rows_k, row_dim) each
  std::vector<int64_t> multipliers;  // (ngram_size)
  std::vector<int64_t> head_offsets, head_sizes;  // (n_heads)
  int64_t table_rows() const;
  void table_row(int64_t row, float* out) const;  // out: (row_dim)
};

struct MoeWeights {
  Matrix router;             // (n_experts, H)
  Matrix shared_gate, shared_up;  // (shared_I, H)
  Matrix shared_down;        // (H, shared_I)
  Matrix shared_expert_gate; // (1, H)
};

struct LayerWeights {
  LayerKind kind = LayerKind::LinearAttention;
  std::optional<PleWeights> ple;
  HcWeights hc_attn, hc_mlp;
  GdnWeights gdn;            // when kind == LinearAttention
  AttnWeights attn;          // when kind == SparseAttention
  MoeWeights moe;
};

struct MtpWeights {
  std::vector<float> pre_fc_norm_embedding;  // (H) 1+w
  std::vector<float> pre_fc_norm_hidden;     // (W) 1+w
  Matrix fc_embedding;                       // (H, H)
  Matrix fc_hidden;                          // (H, H)
  LayerWeights layer;                        // a QSA attention layer with its own experts
  HcWeights mixer;
};

// One routed expert's three matrices.
struct ExpertMatrices {
  Matrix gate, up;   // (I, H)
  Matrix down;       // (H, I)
};

// Where routed experts come from. Record layers: trunk layers 0..L-1, then the MTP layer L.
// `scratch` may hold the bytes the returned views point into (a store reads records into it).
class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  virtual Status get(int record_layer, int expert, ExpertMatrices* out, std::vector<uint8_t>* scratch) = 0;
};

// Views straight into the checkpoint's files.
class CheckpointExperts : public ExpertSource {
 public:
  std::vector<std::vector<ExpertMatrices>> table;  // [record_layer][expert]
  Status get(int record_layer, int expert, ExpertMatrices* out, std::vector<uint8_t>*) override;
};

struct ModelWeights {
  ModelConfig cfg;
  Matrix embed;              // (vocab, H)
  Matrix lm_head;            // (vocab, H); the embedding when tied
  HcWeights final_mixer;
  std::vector<LayerWeights> layers;
  std::optional<MtpWeights> mtp;
};

enum class Layout { HfPerExpert, HfFused, Mlx };
const char* layout_name(Layout l);

// A checkpoint directory opened for inference: the mapped files, the resolved weights and the
// experts as views. Keep it alive while the weights are used.
struct Checkpoint {
  std::string dir;
  Layout layout = Layout::HfPerExpert;
  std::string prefix;        // trunk tensor prefix, e.g. "model.language_model."
  TensorSet tensors;
  ModelWeights weights;
  std::shared_ptr<CheckpointExperts> experts;
};

// The layout and tensor prefixes of a tensor set, told from the embedding's name.
struct LayoutInfo {
  Layout layout = Layout::HfPerExpert;
  std::string prefix;        // trunk prefix, e.g. "model.language_model." or "language_model.model."
  std::string head;          // LM head module, e.g. "lm_head" or "language_model.lm_head"
};
Result<LayoutInfo> detect_layout(const TensorSet& ts);

// The MTP head's tensor prefix ("mtp.", "model.mtp.", ...), or "" when the set has no MTP head.
std::string mtp_prefix(const TensorSet& ts);

// Resolves and checks every tensor the text model needs from `ts` (a checkpoint, or a store's
// dense.bin + ngram.bin seen as one tensor set). `experts` null: routed experts are not resolved
// (a store serves them); otherwise their views fill experts->table, MTP layer last.
Result<ModelWeights> resolve_weights(const TensorSet& ts, const ModelConfig& cfg, const LayoutInfo& li, bool load_mtp,
                                     CheckpointExperts* experts);

// Opens DIR (config.json + safetensors), resolves and checks every tensor the text model needs.
// `load_mtp`: also resolve the MTP head when the checkpoint has one.
Result<std::unique_ptr<Checkpoint>> open_checkpoint(const std::string& dir, bool load_mtp = true);

// PLE hash constants (spec §5.2), computed from the config.
std::vector<int64_t> ngram_multipliers(const ModelConfig& cfg, int ple_index);
std::vector<int64_t> ngram_head_sizes(const ModelConfig& cfg, int ple_index);

}  // namespace ck
