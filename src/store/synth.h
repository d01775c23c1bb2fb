// `cherenkov synth`: writes a random checkpoint with the released model's geometry (shared/spec/
// qwen4_exp.md §1: Qwen3.8-Flash-Next) in the MLX 4-bit group-64 form of docs/formats.md, for
// benchmarks and tests that need real sizes without the real weights. Fewer layers, experts, a
// smaller vocabulary and a smaller n-gram table are options; per-layer geometry never changes.
#pragma once
#include <cstdint>
#include <string>

#include "util/status.h"

namespace ck::store {

struct SynthOptions {
  std::string geometry = "qwen3.8-flash-next";  // the only geometry so far
  std::string out;                               // output directory (created)
  int layers = 0;             // trunk layers; 0: the geometry's 48. The GDN/QSA pattern (QSA at i%4==3) is kept
  uint64_t seed = 1;
  int64_t vocab = 0;          // 0: 248320. eos = 248044 when it fits, else vocab-1
  int experts = 0;            // routed experts per layer; 0: 512. top-k = min(10, experts)
  // n-gram table size base (config ngram_vocab_size_base): 20M gives the real 320M-row table
  // (~32 GB at Q4); the synth default keeps 16 heads of ~20k rows (~26 MB).
  int64_t ngram_base = 20000;
  bool mtp = true;            // include the MTP head (record layer `layers`)
  uint64_t shard_bytes = 3ull << 30;  // a new shard starts once a shard holds this much
  int threads = 0;            // 0: all hardware threads
  bool sync = true;           // fdatasync every shard before renaming it into place
};

struct SynthReport {
  uint64_t bytes = 0;         // tensor bytes written
  double seconds = 0;
  double cpu_seconds = 0;     // process CPU time (the rate per CPU second survives a busy machine)
  int shards = 0;
};

// Writes config.json, model-XXXXX-of-YYYYY.safetensors and model.safetensors.index.json into
// o.out. Deterministic in (geometry, options, seed): the same bytes whatever o.threads is.
Result<SynthReport> synth_checkpoint(const SynthOptions& o);

}  // namespace ck::store
