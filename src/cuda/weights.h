// Uploading host weights (format/weights.h views over mapped checkpoint files) to the device: dense
// matrices and vectors into a DeviceArena, and every routed expert into one device array of
// fixed-stride slots with the (layer, expert) -> (slot address, precision) table that kernels follow.
// Host code only (compiled by the C++ compiler).
#pragma once
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "cuda/common.h"
#include "cuda/dmatrix.h"
#include "format/weights.h"

namespace ck::cuda {

// The device format of a host matrix, or an error naming it when the kernels cannot read it.
Result<WFormat> device_format(const Matrix& m);

// Whether a host matrix can be stored in 16-row tiles (dmatrix.h, WLayout::Tiles16): 4-bit codes in
// groups of 64 with bf16 scales, rows a multiple of 16, at least 256 columns (gemm_q4's smallest K).
bool tiles16_fit(const Matrix& m);
// The Tiles16 bytes of a matrix that tiles16_fit (rows / 16 x cols / 64 blocks of 576 bytes), written
// into out (its stored_bytes()); host code, so the CPU tests check the layout too.
void pack_tiles16(const Matrix& m, uint8_t* out);
// Whether a matrix that tiles16_fit has only scales s with s = 0 or 2^-17 <= |s| <= 2^12: then every
// s (q - 8), q a 4-bit code, is exact in fp16 (at most 11 significant bits, none below 2^-24, at most
// 2^15), the A operand of the prefill products' fp16 form (gemm_q4_wg.cu). Real checkpoints' scales
// are ~1e-3; a matrix outside the range keeps the bf16 form (WFormat::f16_exact).
bool tiles16_f16_exact(const Matrix& m);

// An 8-bit affine matrix as two 4-bit ones over the same columns, for the 4-bit prefill kernels: with
// q = 16 h + l, s q + b = (16 s) h + (s l + b), so W x = Hi x + Lo x, where Hi has codes h, scales
// 16 s (exact: a power of two) and biases 0, and Lo codes l with W's own scales and biases. False
// (nothing written) unless W has 8-bit codes in groups of 64 x 2^k with bf16 or f16 scales whose 16 s
// stays finite. The matrices point into *storage (and Lo at W's scales and biases).
struct NibbleSplit {
  Matrix hi, lo;
  std::vector<uint8_t> storage;
};
bool nibble_split(const Matrix& w, NibbleSplit* out);

// Dense weights on the device. Matrices with the same host bytes (a tied LM head) are uploaded once
// per layout. Asked for Tiles16, a matrix that does not fit them (tiles16_fit) keeps the row layout.
class DenseUploader {
 public:
  explicit DenseUploader(DeviceArena* arena) : arena_(arena) {}
  Result<DMatrix> matrix(const Matrix& m, WLayout layout = WLayout::Rows);
  // The same for a host matrix that dies after the upload (its address may come back for another):
  // never shared with a later matrix.
  Result<DMatrix> transient_matrix(const Matrix& m, WLayout layout = WLayout::Rows);
  // A 4-bit matrix of fewer rows than a tile multiple, padded with zero rows into 16-row tiles
  // (Tiles16) for the prefill kernels, which compute the padding and never store it: rows() stays
  // m.rows. An empty DMatrix when m does not fit tiles once padded (tiles16_fit).
  Result<DMatrix> padded_tiles(const Matrix& m);
  // A float vector (norm weights and the like). nullptr when the GPU has no room, and status() says so.
  const float* vector(const std::vector<float>& v);
  size_t bytes() const { return bytes_; }
  int tiled_matrices() const { return tiled_; }
  // An error when a vector found no room (a matrix returns its own).
  Status status() const { return vector_status_; }

 private:
  // Host bytes into the arena, or an error naming the tensor when the GPU has no room for them: a
  // model whose dense weights do not fit gets one error instead of an abort inside cudaMalloc.
  Result<const uint8_t*> put(const void* host, size_t bytes, const std::string& name);
  DeviceArena* arena_;
  Status vector_status_;
  std::map<std::pair<const uint8_t*, WLayout>, DMatrix> seen_;
  size_t bytes_ = 0;
  int tiled_ = 0;
};

// All routed experts of the trunk layers, resident: slot (layer * n_expert + expert).
struct ExpertPool {
  DeviceBuffer<uint8_t> slots;            // n_layers * n_expert records of `stride` bytes
  DeviceBuffer<ExpertSlot> table;         // (n_layers * n_expert) device copy of table_h
  std::vector<ExpertSlot> table_h;
  uint64_t stride = 0;                    // bytes per slot
  uint64_t record_bytes = 0;              // meaningful bytes per record (stride minus padding)
  WFormat fmt;
  int n_layers = 0, n_expert = 0;
};

// An error naming the sizes when the experts (n_layers x n_expert records of `stride` bytes) and
// `session_bytes` (one session's buffers) do not fit the GPU's free memory; CK_DEVICE_MEMORY_GB=N caps
// what counts as free (to leave room for other programs, and for the tests).
Status check_device_room(int n_layers, int n_expert, uint64_t stride, uint64_t session_bytes);
// Reads every (layer < n_layers, expert) from `src` and uploads it. All experts must share one format.
// Fails (check_device_room) before allocating when they cannot all be resident. With `tiles`, records
// whose matrices fit (tiles16_fit) go up in 16-row tiles (pool->fmt.layout says which).
Status upload_experts(ExpertSource& src, int n_layers, int n_expert, int inter, int hidden, uint64_t session_bytes,
                      ExpertPool* pool, bool tiles = false);

}  // namespace ck::cuda
