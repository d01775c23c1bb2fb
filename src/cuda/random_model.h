// Random in-memory qwen4_exp weights of any geometry and storage form (float f32/bf16/f16 or MLX
// affine codes), for the CUDA parity tests (awkward shapes the fixtures do not cover) and the
// benchmarks (the released geometry with fewer layers, no disk needed). Values are scaled so that
// activations keep unit size through the layers. Not a checkpoint: `cherenkov synth` writes those.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "format/weights.h"

namespace ck::cuda {

// How a family of matrices is stored: bits == 0 means floats of `dtype`.
struct WeightForm {
  DType dtype = DType::BF16;
  int bits = 0;
  int group = 64;
  DType scale_dtype = DType::BF16;
};

struct RandomModelOptions {
  WeightForm dense;                 // projections, hyper-connections, embedding, LM head
  WeightForm router;                // MoE router and shared-expert gate
  WeightForm experts;               // routed experts
  WeightForm ngram;                 // the PLE n-gram table
  uint64_t seed = 1;
  int threads = 0;                  // 0: all hardware threads
  bool mtp = false;                 // also an MTP head (spec §10; its experts are record layer L)
};

class RandomModel {
 public:
  ModelWeights weights;
  std::shared_ptr<CheckpointExperts> experts;
  size_t bytes() const { return bytes_; }

  // Owns a fresh uninitialised host allocation.
  uint8_t* alloc(size_t n);

 private:
  std::vector<std::unique_ptr<uint8_t[]>> blobs_;
  size_t bytes_ = 0;
};

// The released geometry (shared/spec/qwen4_exp.md §1.1) with `layers` trunk layers (QSA at i%4==3,
// PLE on layer 1) and a small n-gram table (base `ngram_base`).
ModelConfig released_config(int layers, int64_t ngram_base = 20000);

// Matrices whose columns are not a multiple of a quantized form's group fall back to bf16 (as MLX
// conversion leaves them). An MTP head when o.mtp.
std::unique_ptr<RandomModel> make_random_model(const ModelConfig& cfg, const RandomModelOptions& o);

}  // namespace ck::cuda
