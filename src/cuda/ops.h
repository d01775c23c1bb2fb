// The CUDA ops: launchers for every kernel of the forward, on device pointers, enqueued on a stream
// (nothing here synchronises). Each op handles `rows` activation rows (1..kMaxRows) at once; row r of
// a buffer starts at ptr + r * ld. Ops that have a twin in src/cpu/ops.h keep its name and argument
// order, with rows/ld/stream appended; tests/parity/test_cuda_ops.cpp checks each against the twin.
// The layer-level kernels (hyper-connections, GDN, QSA attention, PLE, MoE) are declared in
// cuda/layers.h. Kernel files: gemv*.cu (matvec, experts), ops.cu (the rest of this header).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "cuda/dmatrix.h"

namespace ck::cuda {

// What a GEMV applies to each output before it is stored (saves a launch for the tiny activations
// between projections). `arg` is the divisor d.
enum class Epilogue : int32_t {
  None = 0,
  SiluDiv = 1,        // silu(y / d)           (hyper-connection down projection, spec §4)
  TwoSigmoidDiv = 2,  // 2 * sigmoid(y / d)    (hyper-connection injection weights, spec §4)
};

struct Tc4Frags;

// One matrix of a multi-GEMV launch: y[r * ldy + o] = epi(Σ_c w[o][c] · x[r * ldx + c]).
struct GemvJob {
  DMatrix w;
  float* y = nullptr;
  int32_t ldy = 0;
  Epilogue epi = Epilogue::None;
  float epi_arg = 1.0f;
  // Job 0 only (host side; no kernel reads it): where a 2-8-row launch whose K split ends in a reduce
  // kernel also writes the R-row v4 fragments of y (Tc4Frags::rfrag/rgsum, buffers the caller sized
  // with tc4_rows_frag_words / tc4_rows_gsum_floats for kMaxRows), so the GEMV that reads y next
  // launches no fragment kernel. The launch sets its x/ldx/rows/groups/rR when it wrote them and
  // clears rR when it did not (another path, or w.rows % 64 != 0).
  Tc4Frags* frags_out = nullptr;
};
constexpr int kMaxGemvJobs = 4;
// Whether a launch has a matrix in 16-row tiles (dmatrix.h WLayout::Tiles16), which only the
// tensor-core kernels read.
inline bool any_tiled(const GemvJob* jobs, int n_jobs) {
  for (int j = 0; j < n_jobs; ++j)
    if (jobs[j].w.tiled()) return true;
  return false;
}
inline bool all_tiled(const GemvJob* jobs, int n_jobs) {
  for (int j = 0; j < n_jobs; ++j)
    if (!jobs[j].w.tiled()) return false;
  return true;
}

// y (rows, w.rows) = x (rows, w.cols) · wᵀ for up to kMaxGemvJobs matrices that read the same x, in
// one launch. Preconditions: every job's w.cols equals the x width; x is 16-byte aligned and ldx % 4
// == 0 whenever a job is quantized (quantized cols are multiples of 32). rows > kMaxRows go to gemm_tc.
// v4 B fragments and group sums of `rows` vectors (row r at x + r * ldx, K = 64 * groups), laid out
// and rounded as the fragment kernel makes them one vector at a time (gemv_tc4.cu tc4_frag_kernel<1>):
// hc_gate_mean writes them for the mix output u, and the one-row tensor-core GEMVs and the decode
// experts that read u take them instead of launching their own fragment kernel.
// Beside them (or alone), the layout a 2-8-row tensor-core GEMV of rR rows reads (tc4_frag_kernel<rR>:
// all `rows` vectors of a group in one block of words): the 2-8-row mix writes it for u and for its
// low-rank d, so the projections that read those launch no fragment kernel either.
struct Tc4Frags {
  const float* x = nullptr;
  int ldx = 0, rows = 0, groups = 0;
  const uint2* frag = nullptr;  // [rows][groups][kOneFragWords]: the compact one-row layout (mma_q4.cuh)
  const float* gsum = nullptr;  // [rows][groups]
  uint2* rfrag = nullptr;       // [groups][tc4_rows_frag_words(rR)]: the R-row layout (null: none)
  float* rgsum = nullptr;       // [groups][tc4_rows_gsum_floats(rR)]
  int rR = 0;                   // the R (2, 4 or 8) rfrag is laid out for; 0: rfrag holds nothing
  bool covers(const float* x_, int ldx_, int rows_, int groups_) const {
    return x && frag && x == x_ && (rows_ == 1 || ldx == ldx_) && rows >= rows_ && groups == groups_;
  }
  bool covers_rows(const float* x_, int ldx_, int rows_, int groups_, int R) const {
    return x && rfrag && rR == R && x == x_ && ldx == ldx_ && rows == rows_ && groups == groups_;
  }
};
// The R a 2-8-row tensor-core GEMV of `rows` rows runs at, and its per-group fragment sizes.
constexpr int tc4_rows_R(int rows) { return rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8; }
constexpr int tc4_rows_frag_words(int R) { return 4 * ((3 * R + 7) / 8) * 32; }
constexpr int tc4_rows_gsum_floats(int R) { return 8 * ((3 * R + 7) / 8); }
void gemv(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream,
          const Tc4Frags* pre = nullptr);
// x's v4 fragments as a GEMV's producer would hand them on (`pre`): one row in the compact layout
// (frag: groups x kOneFragWords words, gsum: groups floats), 2-8 rows in the R-row layout (groups x
// tc4_rows_frag_words(R) words, groups x tc4_rows_gsum_floats(R) floats, R = tc4_rows_R(rows)); the
// same bits as the GEMV's own fragment kernel. For the kernel lab and tests.
void tc4_make_frags(const float* x, int ldx, int rows, int groups, uint2* frag, float* gsum, Tc4Frags* f,
                    cudaStream_t stream);

// Prefill chunks through matrices of at most kNarrowRows rows (the shared expert's gate: one row): the
// v1 GEMV kernel (any format, fp32 on the CUDA cores) over batches of 8 activation rows, where
// gemm_tc's tiles would be 1/64 full and split K into a reduce kernel (20.5 + 5.3 us a layer for a
// 496-row chunk on an H100, 2026-12-06; this path 7.5 us, and 14.2 / 37.4 us for 2,032 / 8,176 rows).
// False (nothing launched) when a job is wider, in tiles, or x is not 16-byte aligned;
// CK_GEMV_NARROW=0 always declines, to compare.
constexpr int kNarrowRows = 8;
bool gemv_narrow_rows(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream);

// The twin of cpu::matvec for `rows` rows: y (rows, w.rows) = x (rows, w.cols) · wᵀ.
void matvec(const DMatrix& w, const float* x, int ldx, float* y, int ldy, int rows, cudaStream_t stream);

// Tensor-core product for many rows (gemm.cu; gemv() sends rows > kMaxRows here): the same contract
// as gemv for any number of rows, tf32x3 arithmetic (within ~1e-6 of fp32, not bit-equal to gemv).
void gemm_tc(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream);
// gemm_tc's first choice (gemm_q4.cu): when every job is 4-bit codes in groups of 64 x 2^k with 4-byte
// aligned scales and biases, and K >= 256, the factored tensor-core form (x in two bf16 parts by
// default, see set_prefill_parts), K split over blocks where the grid would fill its last wave poorly;
// false otherwise, or with CK_Q4_DENSE=0. parts: 2 or 3 bf16 parts of x for this call (0: the default).
// The hyper-connection mix's input norm applied where its output is read (a prefill chunk's down
// projection and gate mean) instead of written: X[row][k] = (R[row][k] rinv[row S + k / H]) scale[k],
// rmsnorm_wide_tail's formula, so the same bits as the X the norm kernel would write.
struct XNorm {
  const float* rinv = nullptr;   // [rows][S]: each stream's 1 / rms
  const float* scale = nullptr;  // [S H]: the norm's weights
  int S = 0, H = 0;
};
// xn: x is the mix's R, normalised on the fly (only where hc_mix_xnorm_ok says the call takes it).
bool gemm_q4(const GemvJob* jobs, int n_jobs, const float* x, int ldx, int rows, cudaStream_t stream, int parts = 0,
             const XNorm* xn = nullptr);
// The hyper-connection mix's up projection and gate mean of a prefill chunk in one kernel (spec §4: u =
// Σ_s sigmoid(g_s) X_s / S with g = up · d, never written): the same bits of u as gemv(up) followed by
// hc_gate_mean, without g's round trip through memory (gemm_q4_wg.h: the folded warpgroup kernel, in
// clusters of S blocks). False where that kernel would not run the up projection (other devices or
// forms, S not 2, 4 or 8, unaligned X or u) or with CK_HC_UP_GATE_MEAN=0: then nothing is done.
// set_hc_up_gate_mean(1 or 0) sets it (tests), -1 goes back to the environment's.
bool hc_up_gate_mean(const GemvJob& up, const float* d, int ldd, int rows, const float* X, int ldX, int S, int H,
                     float* u, int ldu, cudaStream_t stream, const XNorm* xn = nullptr);
void set_hc_up_gate_mean(int on);
// Its persistent form (gemm_q4_wg_gate_mean.cu: clusters that stay, 64-token tiles, the weights in
// registers) where it applies (the fp16 form, K <= 320); the same bits. Off by default (both of its forms
// measured slower than the one-tile blocks: docs/roofline-cuda.md, fiftieth session); CK_HC_GM_PERSISTENT=1 or
// set_hc_gm_persistent(1) takes it, 0 not, -1 back to the environment's.
void set_hc_gm_persistent(int on);
// How many of the 2^32 float inputs sigmoid4_ (common.h) gives other bits than sigmoidf_ for (NaNs
// alike count as equal): 0 is the contract (tests).
int64_t sigmoid4_mismatches();
// Whether hc_up_gate_mean takes the persistent form for this up projection and row count (when it takes
// the call at all).
bool hc_gm_persistent_applies(const GemvJob& up, int rows, int S);
// Whether a prefill chunk's mix can skip writing X (its norm writes only each stream's 1 / rms, and the
// down projection's activation split and the up projection's gate mean normalise R as they read it):
// the down jobs on the warpgroup kernel's two-part bf16 bulk form with the 8-row split, the up projection
// with its gate mean, R 16-byte aligned. Saves X's write (40 KB a token a mix at the released geometry)
// and its read by the split. CK_HC_XNORM=0 or set_hc_xnorm(0): X written as before; -1 back to the
// environment's.
bool hc_mix_xnorm_ok(const GemvJob* down, int n_down, const GemvJob& up, const float* R, int ldR, int rows, int S,
                     int H);
void set_hc_xnorm(int on);
// How many gemm_q4 calls have normalised the mix's R on the fly (XNorm) in this process (tests).
uint64_t hc_xnorm_calls();
// The bf16 parts of the activations the factored 4-bit kernels multiply (gemm_q4, expert_*_q4): 2 (the
// default, x to ~16 significant bits) or 3 (exact products); -1 goes back to CK_PREFILL_PARTS.
void set_prefill_parts(int parts);
// Shared-memory stages of q4_tile_kernel (the prefill experts' products): 3, 4 or 6, copying one group
// fewer ahead; -1 goes back to CK_Q4_STAGES (3 by default). The same bits.
void set_q4_stages(int stages);
// Whether the grouped experts' 4-bit prefill products unpack codes as 128 + q and fold the 128 into the
// group's bias term over Σ of the multiplied parts of x (as the decode kernels do: larger terms in the
// MMAs' sums, one instruction fewer per two codes); -1 goes back to CK_Q4_CODES128 (off unless "1").
void set_q4_codes128(int on);
// Whether the one-row mix launches its kernel instance compiled for down and up projections in tiles
// (no layout branch in each group of its loops; the default, +1.35% at one row on 2026-12-01) or the
// instance that branches per group (CK_HC_LAYOUT_KERNELS=0); the same bits. set_layout_kernels(1 or
// 0) sets it (tests), -1 goes back to the environment's. (The GEMVs' instances for one layout were
// measured 1-3% slower at 1-4 rows, 2026-12-01, and removed.)
void set_layout_kernels(int on);
bool hc_layout_kernels_on();
// Whether the bulk kernel's activation tiles are split by the 8-row kernel with whole-line stores (1,
// the default) or row by row (0, CK_XFRAG_TILES8=0); the same bytes. -1: the environment's (tests).
void set_xfrag_tiles8(int on);
// On Hopper, gemm_q4 calls of at least this many rows run the warpgroup-MMA kernel (gemm_q4_wg.h):
// 256 by default (CK_Q4_WG_MIN_ROWS), if K >= 512 (CK_Q4_WG_MIN_K); set_q4_wg_min_rows(n) chooses by
// rows alone (set_q4_wg_min_rows(1) sends every call there: the tests), -1 goes back to the defaults.
int q4_wg_min_rows();
void set_q4_wg_min_rows(int rows);
// Whether the warpgroup kernel's bulk-copy form (every matrix of the call in tiles) takes 128 tokens x
// 64 features per warpgroup (the default) instead of 64 x 128: 1 or 0; -1 goes back to CK_Q4_WG_WIDE
// (on unless "0"; tests).
void set_q4_wg_wide(int on);
// The folded form of the 128-token bulk kernel (gemm_q4_wg.cu), two parts of x: 1 on, 3 on with three
// warpgroups a block (the default), 0 off, -1 back to CK_Q4_WG_FOLD (3 unless "0" or "1"; tests).
void set_q4_wg_fold(int mode);
// The folded three-warpgroup form's fp16 arithmetic (gemm_q4_wg.cu "The fp16 form"), for calls whose
// matrices all have WFormat::f16_exact: 1 on for every such call, 0 off (the bf16 folded form), -1
// back to CK_Q4_WG_F16 (on unless "0") for calls of at least CK_Q4_WG_F16_MIN_ROWS features; 4: on, with four
// warpgroups a block (CK_Q4_WG_F16_WGS=4; tests).
void set_q4_wg_f16(int on);

// Which GEMV schedule runs (gemv.cu): 2, the default (tensor cores for tall 4-bit matrices, a warp per
// row group for the other 4/8-bit codes; other formats fall back to 1), or 1 (block per rows, every
// format). CK_GEMV=v1 in the environment picks 1; CK_GEMV=v3 keeps 4-bit codes off the tensor cores.
void set_gemv_version(int v);
int gemv_version();
// GEMVs of 2 to this many rows (4-bit codes, up to 16,384 tiles x groups) take gemv_tc4_rows_kernel
// (fragments built in the block, K split over a cluster, one launch) instead of a fragment kernel, the
// tile kernel and, for K split over blocks, a reduce: 1 (none) by default until measured on a GPU
// (written 2026-12-07); CK_GEMV_BLOCK_ROWS=N or set_gemv_block_rows(N); -1 goes back to the environment's.
void set_gemv_block_rows(int rows);
int gemv_block_rows();
// Whether the uploads may put dense 4-bit matrices in 16-row tiles (dmatrix.h WLayout::Tiles16): the
// v4 GEMVs and gemm_q4 read them, and those are the paths taken (not with CK_GEMV=v1/v2/v3 or
// CK_Q4_DENSE=0); CK_WEIGHT_TILES=0 keeps every matrix in the row layout (to compare).
bool weight_tiles_on();
// The smallest one-row job (16-row tiles x 64-code groups) that takes the streamed GEMV
// (gemv_stream.h); a negative value restores the default (CK_GEMV_STREAM_MIN, else 100,000). For
// tests and comparisons.
void set_gemv_stream_min_work(int64_t work);
// Launches of the streamed GEMV so far in this process (tests check the path they mean ran).
int64_t gemv_stream_launches();
// Reads the device's SM count and the kernels' occupancy once (before any graph capture).
void init_gemv();

// Routed and shared experts of one MoE block (spec §8), over `n_pairs` (row, expert) pairs.
// h (n_pairs, ldh) = silu(gate · x_row) * (up · x_row), rows up to max_inter (pairs with a smaller
// intermediate size leave the rest untouched). `codes48`: the caller guarantees every pair's matrices
// are 4- or 8-bit codes (the faster schedule); otherwise any format.
void expert_gate_up(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* x, int ldx,
                    float* h, int ldh, bool codes48, cudaStream_t stream);
// y (n_pairs, hidden) = down · h_pair.
void expert_down(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* h, int ldh, float* y,
                 int ldy, bool codes48, cudaStream_t stream);

// The same two products on the tensor cores (the v4 GEMV arithmetic, gemv_experts.cu), for the decode steps.
// Preconditions: every pair's matrices are 4-bit codes in groups of 64 x 2^k (expert_q4_ok), hidden and
// max_inter multiples of 64; x has x_rows rows (the pairs' x_row values). expert_tc4_enabled():
// the GEMV arithmetic is v4 and CK_EXPERT_TC4 is not 0.
bool expert_tc4_enabled();
// all_tiled: every pair's gate and up are Tiles16 (Model::tiled_experts): gate/up by bulk copies of
// whole tiles (the kernel traps on a matrix that is not).
// shared: the pairs are the route's (SharedSlot: k1 a row, the shared expert last), so the tiled form's
// shared-expert blocks copy their tiles before their wait (CK_EXPERT_SHARED_EARLY=0: not; the same
// bits). set_expert_shared_early(1 or 0) sets it (tests), -1 goes back to the environment's.
void expert_gate_up_tc4(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* x, int ldx,
                        int x_rows, float* h, int ldh, cudaStream_t stream, const Tc4Frags* pre = nullptr,
                        bool all_tiled = false, const SharedSlot* shared = nullptr);
void set_expert_shared_early(int on);
// The tiled form's gate/up and down as one streaming loop per block (two tiles or chunks in flight a
// block; gemv_experts.cu expert_*_stream_kernel) rather than a block per tile or chunk (CK_EXPERT_STREAM=0
// for gate/up, CK_EXPERT_DOWN_STREAM=0 for down): the same bits. set_expert_stream(1 or 0) sets both
// (tests), -1 goes back to the environment's; blocks > 0 (tests): that many blocks, so each runs many
// tiles through its two stages, instead of every resident one.
void set_expert_stream(int on, int blocks = 0);
// expert_down_tc4's contract with its caller: the pairs were written two or more kernels before it (the
// route, then gate/up), not by the kernel just before: its tiled form reads them before its
// programmatic-launch wait (CK_EXPERT_DOWN_EARLY). h is the kernel just before's output.
void expert_down_tc4(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* h, int ldh, float* y,
                     int ldy, cudaStream_t stream, bool all_tiled = false);
// expert_gate_up_tc4 then expert_down_tc4 of tiled experts (Model::tiled_experts) as one kernel
// (gemv_experts.cu expert_tc4_fused_kernel): the same h and y bits. Returns false, launching nothing,
// where it does not apply (off by default, as it measured slower: CK_EXPERT_FUSED=1 or
// set_expert_fused(1) turn it on; the streaming kernels off; K or shared memory beyond the kernel's;
// no counts): the caller then launches the two. counts: expert_fused_counts(n_pairs) zeroed words,
// which the kernel leaves zero (one set per stream: kernels that share it must not overlap).
bool expert_tc4_fused(const ExpertPair* pairs, int n_pairs, int max_inter, int hidden, const float* x, int ldx,
                      int x_rows, float* h, int ldh, float* y, int ldy, unsigned* counts, cudaStream_t stream,
                      const Tc4Frags* pre = nullptr, const SharedSlot* shared = nullptr);
size_t expert_fused_counts(int n_pairs);
// Debug timing of the decode expert kernels (CK_EXPERT_TIMING=1, read once): each block of the last
// streaming gate/up (kernel 0), streaming down (1) and fused (2) kernel launched leaves its entry, the
// end of its programmatic-launch wait and its exit (%globaltimer, ns; 0: not run) and its SM.
// expert_stamps(): [kernel][block][word], blocks past kExpertStampBlocks not kept.
constexpr int kExpertStampKernels = 3, kExpertStampBlocks = 512, kExpertStampWords = 4;
constexpr int kExpertStampGateUp = 0, kExpertStampDown = 1, kExpertStampFused = 2;
bool expert_timing_on();
std::vector<uint64_t> expert_stamps();
// set_expert_fused(1, 2 or 0): the fused kernel in blocks of two teams, of one team (CK_EXPERT_FUSED=2), or
// not (tests); -1 goes back to the environment's.
void set_expert_fused(int on);

// The same expert products for a prefill chunk, grouped per expert (gemm.cu): group_pairs sorts the
// pairs by ExpertPair::group (n_groups = n_experts + 1, the shared expert last) into `order` and cuts
// each group into tiles of at most kGroupRows pairs; the grouped kernels then read each expert's
// weights once per tile instead of once per pair. Tile count and list stay on the device (no sync);
// launches are sized by grouped_max_tiles. Buffers: order (n_pairs), tiles (grouped_max_tiles).
constexpr int kGroupRows = 32;
int grouped_max_tiles(int n_pairs, int n_groups);
void group_pairs(const ExpertPair* pairs, int n_pairs, int n_groups, int32_t* order, int2* tiles, int32_t* n_tiles,
                 cudaStream_t stream);
void expert_gate_up_grouped(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                            int max_tiles, int max_inter, const float* x, int ldx, float* h, int ldh,
                            cudaStream_t stream);
void expert_down_grouped(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                         int max_tiles, int hidden, const float* h, int ldh, float* y, int ldy, cudaStream_t stream);

// The same grouped products when every expert matrix is MLX 4-bit codes in groups of 64 x 2^k
// (expert_q4_ok), in the factored form on the tensor cores (gemm_q4.cu): codes as exact bf16 MMA
// operands, the activations split into bf16 parts once per call (two or three multiplied:
// set_prefill_parts), scale and bias per group after the product. gate/up reads x rows [0, x_rows)
// of width hidden; down reads the n_pairs rows of h (width max_inter, a multiple of 64).
bool expert_q4_ok(const DMatrix& m);
void expert_gate_up_q4(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                       int max_tiles, int max_inter, const float* x, int ldx, int x_rows, int hidden, float* h, int ldh,
                       cudaStream_t stream);
void expert_down_q4(const ExpertPair* pairs, const int32_t* order, const int2* tiles, const int32_t* n_tiles,
                    int max_tiles, int hidden, int max_inter, const float* h, int ldh, int n_pairs, float* y, int ldy,
                    cudaStream_t stream);

// cpu::rmsnorm_grouped on `rows` rows: one statistic per group of `group` values; scale (n) fp32.
void rmsnorm_grouped(const float* x, int64_t n, int64_t group, const float* scale, float eps, float* out, int rows,
                     int64_t ld, cudaStream_t stream);

// cpu::l2norm on `rows` rows, in place.
void l2norm(float* x, int64_t n, float eps, int rows, int64_t ld, cudaStream_t stream);

// cpu::rope on `rows` rows, in place; row r rotates at position pos + r. inv_freq (rot_dim/2) fp32 on
// the device, computed by rope_inv_freq (host) exactly as the CPU computes it.
void rope(float* x, int rot_dim, int64_t pos, const float* inv_freq, int rows, int64_t ld, cudaStream_t stream);

// cpu::topk_desc on `rows` rows: idx (rows, k) int32, descending, ties to the lower index.
// Precondition: k <= n, k <= 64.
void topk_desc(const float* v, int n, int k, int32_t* idx, int rows, int64_t ld, cudaStream_t stream);

// cpu::argmax on `rows` rows (lowest index on ties): out (rows) int32. `scratch` holds
// argmax_scratch_floats(n) floats per row (device).
void argmax(const float* v, int64_t n, int32_t* out, int rows, int64_t ld, float* scratch, cudaStream_t stream);
int64_t argmax_scratch_floats(int64_t n);

// out (rows, cols) = fp32 rows `ids[r]` of m (dequantized as cpu matrix_row does), ids on the device.
void gather_rows(const DMatrix& m, const int32_t* ids, int rows, float* out, int64_t ld, cudaStream_t stream);

}  // namespace ck::cuda
