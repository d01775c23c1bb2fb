// Launchers for the layer-level kernels of the qwen4_exp forward (spec §4-§8), each over the rows of
// one step: hyper-connection gate/combine, the Gated DeltaNet conv and delta-rule recurrence, QSA
// attention decode (indexer with cached pooled block keys, top-k blocks, gated softmax attention),
// the PLE gate and dilated conv, the MoE router and the slot-ordered expert sum. Positions and tokens
// are read on the device from StepParams, so a captured graph replays for any position.
// The GEMVs between them are cuda::gemv (ops.h); the forward that strings them is cuda/qwen4_exp.cpp.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "cuda/dmatrix.h"
#include "cuda/ops.h"

namespace ck::cuda {

// What varies between steps, in device memory (copied from pinned memory at the start of a step).
struct StepParams {
  int64_t pos = 0;                 // position of row 0
  int32_t rows = 0;
  int32_t snap = 0;                // keep the recurrent state after every row but the last
  int32_t state_parity = 0;        // which of a DeltaNet layer's two state buffers holds its state (GdnRecArgs)
  int32_t tokens[kMaxChunkRows] = {};
};

// One-time kernel attributes (large dynamic shared memory); call before any step or graph capture.
void init_kernels();

// rope inverse frequencies exactly as cpu::rope computes them: 1 / fp32(theta^(2j / rot_dim)).
std::vector<float> rope_inv_freq(int rot_dim, double theta);

// R (rows, S*H): the embedding row of each row's token copied into every stream (spec §2 steps 1-2).
void embed_wide(const DMatrix& embed, const StepParams* sp, int rows, int S, int H, float* R, int ldR,
                cudaStream_t stream);

// Hyper-connection mix tail (spec §4): u (rows, H) = Σ_s sigmoid(g_s) ⊙ X_s / S, with g and X
// (rows, S*H) at leading dimension ldgx.
// With frag and gsum (H % 64 == 0), also u's v4 fragments and group sums, one vector per row, in
// the layout of cuda/ops.h Tc4Frags. With rfrag and rgsum too (2-8 rows), also the R-row layout of
// all rows (Tc4Frags::rfrag, R = tc4_rows_R(rows)), which the 2-8-row projections of u read.
void hc_gate_mean(const float* g, const float* X, int ldgx, int S, int H, float* u, int ldu, int rows,
                  cudaStream_t stream, uint2* frag = nullptr, float* gsum = nullptr, uint2* rfrag = nullptr,
                  float* rgsum = nullptr);
// Whether the mixes ask L2 for their residual R (and its combine weights) before their wait: the
// one-row mix (hc_mix.cu) and the 2-8-row norm (hc_combine_rmsnorm). CK_HC_R_PREFETCH=0: not.
bool hc_r_prefetch_on();
// Hyper-connection combine: R_s += o · w_s for s < S.
void hc_combine(float* R, int ldR, const float* o, int ldo, const float* w, int ldw, int S, int H, int rows,
                cudaStream_t stream);
// hc_combine, then the mix's input norm of the updated R: out (rows, S*H at ldR) = rmsnorm of each
// stream of H with `scale`, in one kernel with the same bits as the two launches. False (nothing
// launched) when the shape does not suit it (H < 2048, unaligned rows); then launch them apart.
// rinv: write each (row, stream)'s 1 / rms there ([rows][S]) instead of `out` (XNorm's form).
bool hc_combine_rmsnorm(float* R, int ldR, const float* o, int ldo, const float* w, int ldw, int S, int H,
                        const float* scale, float eps, float* out, int rows, cudaStream_t stream, float* rinv = nullptr);

// The whole mix of one row (spec §4) in one kernel (cuda/hc_mix.cu): with o, first the deferred
// combine R_s += o w_in_s (R is updated); then X = the grouped input norm of R, d = silu(down X / S),
// w_out = 2 sigmoid(inject X / S) when inject has rows, and u = Σ_s sigmoid(up d)_s ⊙ X_s / S, with
// u's v4 fragments and group sums when frag is set (cuda/ops.h Tc4Frags, one vector). False (nothing
// launched) when the matrices are not 4-bit in groups of 64 x 2^k, H or the low rank is not a
// multiple of 64, the scratch is short, or CK_HC_FUSED=0: then the unfused kernels run.
struct HcMixArgs {
  float* R = nullptr;                                     // (S * H) wide residual, one row
  const float* o = nullptr; const float* w_in = nullptr;  // the deferred combine, or o = nullptr
  // Or o is the MoE output still to be combined from its slots (moe_y != nullptr; moe_combine's
  // arguments for one row): the mix computes it element by element, and no moe_combine runs.
  const float* moe_y = nullptr; int moe_ldy = 0; const ExpertPair* moe_pairs = nullptr; int moe_k = 0;
  const float* moe_gl = nullptr;
  const float* norm = nullptr; float eps = 0.0f;          // hc_norm (S * H)
  DMatrix down, up, inject;                               // inject.rows == 0: no injection head
  float* w_out = nullptr;                                 // (inject.rows)
  float* u = nullptr;                                     // (H)
  uint2* frag = nullptr; float* gsum = nullptr;           // u's fragments, or nullptr
  int S = 0, H = 0;
  float* scratch = nullptr; size_t scratch_floats = 0;    // hc_mix_scratch_floats(S, H, low rank)
  unsigned* barrier = nullptr;                            // 64 words, zero before the first call
  // (Every mix on one barrier must run the same grid, i.e. the same S and H: hc_mix.cu grid_barrier_count.)
  // The partial products' exact sums (hc_mix.cu hc_acc_add): hc_mix_acc_words(S, low rank) words, zero
  // before the first call, then kept by the kernel; shared by every mix that shares `barrier` (one stream).
  // nullptr (or the exact sums off, the default): every consumer block adds all chunks' partials in chunk order.
  long long* acc = nullptr;
  // Debug (CK_HC_TIMING=1): per block, kHcStampWords words: its start (%globaltimer, ns), then the SM
  // cycles of each piece (kHcStampNames; 0 where the block has no share of it). nullptr: none.
  unsigned long long* stamps = nullptr;
};
constexpr int kHcStampWords = 10;
inline constexpr const char* kHcStampNames[kHcStampWords] = {
    "start after the first (ns)", "prefetch, wait for inputs", "combine + norm", "fragments, tiles' copies",
    "down tiles", "grid barrier", "sums or partials to shared", "d: sum + fragments", "up tiles", "gate mean + fragments"};
bool hc_mix_row(const HcMixArgs& a, cudaStream_t stream);
size_t hc_mix_scratch_floats(int S, int H, int lowrank);
size_t hc_mix_acc_words(int S, int lowrank);
// The exact sums: 1 on (CK_HC_EXACT_SUM=1), 0 off (the default: slower in the step, docs/roofline-cuda.md), 2 on with every
// partial out of range, so every mix takes the fallback (tests); set_hc_exact_sum(-1): the environment's.
int hc_exact_sum_mode();
void set_hc_exact_sum(int mode);
size_t hc_exact_sum_launches();  // launches (or graph captures) of the mix with its exact sums, for tests
// The one-row mix's phase 2 with its chunks' partials brought by the copy engine and summed in one flat
// loop (mode 1, CK_HC_BULK_PARTS=1), and with its up tiles copied to shared memory at its start too (mode
// 2, where they fit; tiled weights), and its chunk's down tiles too (mode 3, the default; 4 the tiles with
// loaded partials, 5 mode 3 with its factors read four at a time): the same words and the same additions
// in the same order as the loads' form (mode 0), so the same bits.
// set_hc_bulk_parts(-1): the environment's.
int hc_bulk_parts_mode();
void set_hc_bulk_parts(int mode);
size_t hc_bulk_parts_launches();  // launches (or graph captures) of the mix with bulk-copied partials, for tests
size_t hc_bulk_up_launches();     // and of those with the up tiles in shared memory
size_t hc_bulk_down_launches();   // and of those with the down tiles in shared memory too
// A deferred MoE output's slots combined in the one-row mix's phase 1 with every load issued first
// (device_ops.cuh moe_combine_elem_flat; top-k <= 16; mode 3 only): the same bits. On by default;
// CK_HC_FLAT_COMBINE=0 (or set_hc_flat_combine(0)) for the loop's form. set_hc_flat_combine(-1): the environment's.
bool hc_flat_combine_on();
void set_hc_flat_combine(int on);
size_t hc_flat_combine_launches();  // launches (or graph captures) of the mix that combine so, for tests
// The flat form with the tile pair that holds the inject head's tile staged in shared memory before the
// kernel's wait (CK_HC_STAGED_PAIR, on by default): the same words and MMAs, so the same bits.
// set_hc_staged_pair(-1): the environment's.
bool hc_staged_pair_on();
void set_hc_staged_pair(int on);
size_t hc_staged_pair_launches();  // launches (or graph captures) of the staged instance, for tests
// The flat (and staged) forms with a grid barrier of one atomic on the waiters' path (a count that wraps
// at a multiple of the grid; CK_HC_COUNT_BARRIER, on by default): the same bits.
// set_hc_count_barrier(-1): the environment's.
bool hc_count_barrier_on();
void set_hc_count_barrier(int on);
size_t hc_count_barrier_launches();  // launches (or graph captures) of the count barrier's instances, for tests
// The one-row mix's chunks of at least N 64-code groups (CK_HC_CHUNK_GROUPS=N; 1, the fewest that leave a
// chunk per block, by default): fewer blocks and fewer partials; the partials' boundaries move, so other
// roundings. set_hc_chunk_groups(-1): the environment's.
int hc_chunk_groups_min();
void set_hc_chunk_groups(int n);
size_t hc_chunk_groups_launches();  // launches (or graph captures) with larger chunks than the default's, for tests
void hc_mix_init();  // kernel attributes (init_kernels calls it)

// GDN causal depthwise conv (spec §6): y = silu(Σ taps · [history, x]) per channel, rows in order;
// the history (K-1, C) shifts per row; with sp->snap the history after row r < rows-1 goes to
// snaps + r * snap_stride.
struct GdnConvArgs {
  const float* x = nullptr; int ldx = 0;      // (rows, C) pre-conv in_proj_qkv output
  const float* taps = nullptr;                // (C, K)
  float* state = nullptr;                     // (K-1, C) oldest first
  float* snaps = nullptr; int64_t snap_stride = 0;
  float* y = nullptr; int ldy = 0;            // (rows, C)
  int C = 0, K = 0;
};
void gdn_conv(const GdnConvArgs& a, const StepParams* sp, int rows, cudaStream_t stream);
// The in_proj GEMV of a row-path step (jobs as gemv(); job 0 in_proj_qkv, whose output conv.x is) with
// the conv in its epilogue: each channel is convolved where it is finished (conv.y, the state and its
// snapshots as gdn_conv writes them), conv.x is not written, and no conv kernel follows. False when
// the jobs do not suit the tensor-core GEMV's two-kernel form or CK_CONV_IN_GEMV=0 (then call gemv
// and gdn_conv).
bool gemv_conv(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream,
               const Tc4Frags* pre, const GdnConvArgs& conv, const StepParams* sp);

// GDN delta rule per value head (spec §6), rows in order, state fp32 on the device, then the gated
// RMS norm (N2) of each head's output. Preconditions: dk <= 256, dv * ceil(dk/32) <= 512.
struct GdnRecArgs {
  const float* y = nullptr; int ldy = 0;      // (rows, 2*Kd + Vd) post-conv: q | k | v
  const float* z = nullptr; int ldz = 0;      // (rows, nv*dv) output gate input
  const float* b = nullptr; const float* a = nullptr; int ldab = 0;  // (rows, nv) each
  const float* a_log = nullptr; const float* dt_bias = nullptr;      // (nv)
  const float* norm = nullptr;                // (dv) plain N2 weight
  float* state = nullptr;                     // (nv, dk, dv)
  // A second state buffer (gdn_recurrent only; nullptr: the state is updated in place). With it,
  // sp->state_parity names the buffer that holds the state (0: state, 1: state_alt), and a step with
  // sp->snap writes the state after its last row into the other buffer, keeping the one before the
  // step for a replay of the rows a rollback keeps (Session::replay_deltanet), where the snapshots
  // below cost a full state write per row.
  float* state_alt = nullptr;
  float* snaps = nullptr; int64_t snap_stride = 0;  // sp->snap: the state after each row but the last (nullptr: none)
  float* out = nullptr; int ldo = 0;          // (rows, nv*dv)
  int nk = 0, nv = 0, dk = 0, dv = 0;
  float eps = 1e-6f;
  int sigmoid_gate = 1;                       // output_gate_type: sigmoid (1) or silu (0)
};
void gdn_recurrent(const GdnRecArgs& a, const StepParams* sp, int rows, cudaStream_t stream);
// Whether gdn_recurrent runs heads of dk x dv: a block of at most 512 threads holds a head's value
// columns (dv / 32 blocks of 32 where dv is a multiple of 32 from 64 to 1,024, else one block of dv)
// times its key dimension in parts of 32. Model::supports asks this before a model loads.
bool gdn_recurrent_fits(int dk, int dv);
// Whether a decode step's split heads (dv / 32 blocks of 32 columns, up to 8) make their output norm
// as one thread-block cluster instead of by a second kernel (the same bits; default on,
// CK_GDN_CLUSTER_NORM=0 for off).
void set_gdn_cluster_norm(bool on);
// With the cluster norm, the rows' norms after the row loop behind one cluster barrier (1, the
// default) or one barrier per row (0); -1: CK_GDN_NORM_DEFER decides (0: one a row). The same bits
// (GdnClusterNormEqualsNormKernel); +0.2-0.4% at 2-8 rows (H200 2026-12-02 18:27Z).
void set_gdn_norm_defer(int on);
// The DeltaNet recurrence with every row's inputs loaded before its row loop from `rows` rows on
// (default 2; -1: CK_GDN_PRELOAD_MIN_ROWS again). The same bits as the per-row form.
void set_gdn_preload_min_rows(int rows);

// The same delta rule and norm in the chunked form (64 rows at a time, WY representation; spec §6
// "Chunked prefill"): equal to gdn_recurrent up to fp32 rounding, much faster for long inputs. Takes
// no snapshots (a.snaps is ignored): for prefill chunks only. Needs gdn_chunked_fits(a).
bool gdn_chunked_fits(const GdnRecArgs& a);
void gdn_chunked(const GdnRecArgs& a, int rows, cudaStream_t stream);
// The chunked form's scan over the chunks: 1 on the tensor cores (3xTF32 products, the default), 0 in
// fp32 FMAs (CK_GDN_SCAN=fp32); -1 goes back to the environment (tests). set_gdn_scan_cols: the
// tensor-core scan's value columns per block, 64 (one block per SM, the default) or 32 (two;
// CK_GDN_SCAN_COLS=32).
void set_gdn_scan_tc(int on);
void set_gdn_scan_cols(int cols);

// QSA attention decode for the rows of a step (spec §7): q/k norms and RoPE, cache writes at
// pos+r, pooled block keys cached once per completed block, indexer block scores, top-k blocks (ties
// to the lower index), softmax attention over the selected tokens, sigmoid output gate. Row r
// attends to positions <= pos + r, including rows < r of the same step.
struct AttnArgs {
  const float* qg = nullptr; int ldqg = 0;    // (rows, nh*2*hd): per head [query | gate]
  const float* k = nullptr; int ldk = 0;      // (rows, nkv*hd)
  const float* v = nullptr; int ldv = 0;      // (rows, nkv*hd)
  const float* iqk = nullptr; int ldiqk = 0;  // (rows, (inh+1)*ihd): indexer queries, then the raw key
  const float* q_norm = nullptr; const float* k_norm = nullptr;    // (hd) 1+w
  const float* iq_norm = nullptr; const float* ik_norm = nullptr;  // (ihd) 1+w
  const float* inv_freq = nullptr; int rot = 0;                    // (rot/2)
  float* k_cache = nullptr; float* v_cache = nullptr;  // (max_ctx, nkv*hd) post-norm post-RoPE K, V
  float* idx_keys = nullptr;                  // (max_ctx, ihd) raw indexer keys
  float* blk_keys = nullptr;                  // (max_ctx/cr, ihd) pooled, normed, roped block keys
  float* q = nullptr; int ldq = 0;            // scratch (rows, nh*hd)
  float* iq = nullptr; int ldiq = 0;          // scratch (rows, inh*ihd)
  float* scores = nullptr; uint8_t* sel = nullptr; int64_t nb_max = 0;  // scratch (rows, nb_max)
  float* out = nullptr; int ldo = 0;          // (rows, nh*hd) gated attention output
  int nh = 0, nkv = 0, hd = 0, inh = 0, ihd = 0, cr = 0, block_topk = 0;
  float eps = 1e-6f;
  int prefetch_kv = 0;  // set by attention(): 1 unless CK_ATTN_KV_PREFETCH=0 (attn_prefetch_kv)
  int skip_dense = 0;   // set by attention(): the rows selecting every key went to the dense-rows kernel
  // Prefill chunks: the most keys a row of the call attends to (pos + rows), which the host knows there
  // (a decode step's graph reads the position on the device: 0). With it, attention() splits the
  // keys' K and V rows into their bf16 parts once for the call (attn_split_kv_kernel) into k_split and
  // v_split, which it sets.
  int64_t keys_bound = 0;
  uint2* k_split = nullptr;      // (keys_bound, nkv*hd/2): dimension pairs as {hi pair, lo pair}
  uint32_t* v_split = nullptr;   // (keys_bound, nkv*hd): {hi | lo << 16} per value
};
void attention(const AttnArgs& a, const StepParams* sp, int rows, cudaStream_t stream);
// The indexer's block scores of a step's rows (a.scores, for the rows with more complete blocks than
// block_topk, blocks below their count) from a.iq and a.blk_keys, as attention() computes them: for
// prefill chunks (rows > kMaxRows) a tiled product in the CPU reference's order and rounding, else a
// warp per (row, block). set_attn_scores_tiled(0) keeps the warp kernel for chunks too
// (CK_ATTN_SCORES_TILED=0), -1 goes back to the environment.
void attention_block_scores(const AttnArgs& a, const StepParams* sp, int rows, cudaStream_t stream);
void set_attn_scores_tiled(int on);
// The largest head_dim and indexer_head_dim attention() takes: attn_prep_kernel holds a head's row in
// (default-sized) shared memory; real models use 64-256.
constexpr int kMaxAttnHeadDim = 4096;
// Most tokens one query attends to: (block_topk + 1) * cr - 1.
int64_t attention_max_selected(int64_t block_topk, int64_t cr);
// Decode attention over the selected keys split across blocks, keys per split (tests, comparisons):
// 0 turns the split off, -1 goes back to CK_ATTN_SPLIT (default 256).
void set_attn_split_keys(int keys);
// Prefill rows that select every key (no more complete blocks than block_topk) in blocks of several
// rows with an online softmax, 64 (the default) or 32 MMA rows a block, or one block per row like the
// others (0); -1 goes back to CK_ATTN_DENSE.
void set_attn_dense(int mma_rows);
// K and V split once per prefill call for the tensor-core kernels (1, the default), or by each lane as
// it reads them (0); the same bits. -1 goes back to CK_ATTN_PRESPLIT.
void set_attn_presplit(int on);
// The per-row prefill kernel's Q fragments in registers (1, the default) or read from shared memory for
// every key tile (0); the same bits. -1 goes back to CK_ATTN_QREG.
void set_attn_qreg(int on);

// PLE (spec §5.5) after the key/value projections and the two grouped norms:
// G (rows, W) = sigmoid(ssqrt(<kn_s, qn_s> / sqrt(H))) · val for each stream s.
void ple_gate(const float* kn, const float* qn, int ld, const float* val, int ldv, int S, int H, float* G,
              int rows, cudaStream_t stream);
// The dilated depthwise conv over Gn (taps at t-(K-1)d .. t), R += G + silu(conv), rows in order; the
// history ((K-1)*d, W) shifts per row and is snapshotted like the GDN conv's.
struct PleConvArgs {
  const float* G = nullptr; const float* Gn = nullptr; int ld = 0;  // (rows, W)
  const float* taps = nullptr;                // (W, K)
  float* state = nullptr;                     // ((K-1)*d, W) oldest first
  float* snaps = nullptr; int64_t snap_stride = 0;
  float* R = nullptr; int ldR = 0;            // (rows, W) wide residual, updated
  int W = 0, K = 0, dil = 0;
};
void ple_conv(const PleConvArgs& a, const StepParams* sp, int rows, cudaStream_t stream);

// MoE router (spec §8): softmax over all experts, top-k (ties to the lower index), optional
// renormalisation; writes each row's k routed pairs in top-k order (views built from the expert table)
// then its shared-expert pair: pairs[r*(k+1) + t].
struct MoeRouteArgs {
  const float* logits = nullptr; int ld = 0;  // (rows, E)
  const float* logits2 = nullptr;             // (rows, E) at ld, added to logits when set (a split router)
  int E = 0, k = 0, norm_topk = 1;
  const ExpertSlot* table = nullptr;          // (E) this block's entries of the expert table
  int inter = 0, hidden = 0;
  DMatrix sh_gate, sh_up, sh_down;
  ExpertPair* pairs = nullptr;                // (rows * (k+1))
};
void moe_route(const MoeRouteArgs& a, int rows, cudaStream_t stream);
// The pair layout moe_route writes (k + 1 pairs a row, the shared expert last), for the experts'
// kernels that read it before their wait (dmatrix.h SharedSlot).
SharedSlot route_shared_slot(const MoeRouteArgs& a);
// out (rows, H) = fp32(Σ_t fp64(y_t · w_t)) in slot order + sigmoid(gl) · y_shared.
void moe_combine(const float* y, int ldy, const ExpertPair* pairs, int k, const float* gl, int ldgl, float* out,
                 int ldo, int H, int rows, cudaStream_t stream);

}  // namespace ck::cuda
