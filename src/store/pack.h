// `cherenkov pack`: rearranges a checkpoint (any layout of docs/formats.md) into a store
// (docs/store-format.md): experts.bin with one aligned record per (record layer, expert), optional
// experts3.bin / experts2.bin derived from Q4, dense.bin, ngram.bin and manifest.json, with the
// config, tokenizer and chat template copied beside them. Streams tensor by tensor (bounded memory);
// writes temporary names and renames them last, the manifest after everything else.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "store/lowbit.h"
#include "util/status.h"

namespace ck::store {

struct PackOptions {
  std::string src;                   // checkpoint directory
  std::string out;                   // store directory; empty: SRC.store beside SRC
  std::vector<int> low_bits;         // also write experts3.bin (3) and/or experts2.bin (2)
  LowBitMethod method = kDefaultLowBit;
  int threads = 0;                   // 0: all hardware threads
  bool sync = true;                  // fdatasync every file before renaming it into place
  bool force = false;                // repack even when a valid store of this source exists
  uint64_t fail_after_bytes = 0;     // tests: fail (as a crash would) once this many bytes are written
};

struct PackReport {
  std::string out;
  bool reused = false;               // a valid store of the same source was already there
  uint64_t bytes = 0;                // bytes written
  double seconds = 0, cpu_seconds = 0;
};

std::string default_store_dir(const std::string& src);
Result<PackReport> pack_store(const PackOptions& o);

// Files copied from the checkpoint beside the store when present (config first).
const std::vector<std::string>& store_side_files();

}  // namespace ck::store
