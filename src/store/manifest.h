// manifest.json of a packed store (docs/store-format.md): the geometry, where every record and
// tensor lives, bits and strides, an XXH3-64 checksum per expert record, per dense tensor and per
// n-gram block, and the identity of the checkpoint it was packed from. It is written last, so a
// directory without a manifest that parses is not a store.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "format/config.h"
#include "format/safetensors.h"
#include "format/weights.h"
#include "util/status.h"

namespace ck::store {

constexpr int kStoreVersion = 1;
constexpr uint64_t kAlign = 4096;          // records, tensors and regions start on 4 KiB (direct I/O)
constexpr uint64_t kNgramBlock = 16 << 20; // n-gram checksums cover blocks of this many file bytes

inline uint64_t align_up(uint64_t v, uint64_t a = kAlign) { return (v + a - 1) / a * a; }

// One file of the source checkpoint, as it was when packed.
struct SourceFile {
  std::string name;
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  bool operator==(const SourceFile&) const = default;
};

struct SourceIdentity {
  std::string dir;                   // informational; a moved checkpoint is still the same source
  std::vector<SourceFile> files;     // config.json, the index, every *.safetensors, sorted by name
  uint64_t headers_xxh3 = 0;         // over config.json and every safetensors header
  // Same files (names, sizes, mtimes) and same headers.
  bool same_as(const SourceIdentity& o) const { return files == o.files && headers_xxh3 == o.headers_xxh3; }
};

// Where one matrix's parts sit inside an expert record (bytes from the record's start).
struct PartLayout {
  uint64_t codes = 0, scales = 0, biases = 0;  // scales/biases unused for float records
  uint64_t code_bytes = 0, scale_bytes = 0;    // per part
};

// One expert file (experts.bin, experts3.bin, experts2.bin): records of one precision.
struct ExpertFile {
  std::string file;
  int bits = 4;                      // 0: float records (dtype below), from a source whose experts
                                     // could not be quantized at group 64
  int group = 64;
  DType dtype = DType::U32;          // U32 codes, or the float dtype of a float record
  DType scale_dtype = DType::BF16;
  std::string method;                // "copy" (verbatim Q4), "quantize" (from floats), "topbits", "refit", "float"
  int64_t gate_rows = 0, gate_cols = 0, down_rows = 0, down_cols = 0;  // (I, H) and (H, I)
  PartLayout gate, up, down;
  uint64_t record_bytes = 0;         // unpadded
  uint64_t stride = 0;               // record_bytes rounded up to kAlign
  uint64_t size = 0;                 // file size = records * stride
  std::vector<uint64_t> checksums;   // XXH3-64 of the record_bytes of each record, [layer * experts + expert]
};

// One tensor of dense.bin (verbatim from the source, under its source name).
struct DenseTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  uint64_t offset = 0, nbytes = 0;
  uint64_t xxh3 = 0;
};

// One PLE n-gram table of ngram.bin, exposed to the loader as the tensor set
// `<module>.{weight,scales,biases}` (an MLX-style single table, whatever the source layout).
struct NgramTable {
  int layer = 0;                     // 0-based trunk layer
  std::string module;                // e.g. "model.layers.1.ple.ple_embedding.ngram_embedding"
  int64_t rows = 0, cols = 0;        // rows padded as in the checkpoint; cols = row width
  int bits = 4, group = 32;          // bits 0: float table of `dtype`
  DType dtype = DType::U32;
  DType scale_dtype = DType::BF16;
  std::string method;                // "copy", "quantize" or "float"
  uint64_t codes_offset = 0, codes_bytes = 0;
  uint64_t scales_offset = 0, biases_offset = 0, scale_bytes = 0;
};

struct Manifest {
  int version = kStoreVersion;
  // Geometry (checked against config.json at load).
  std::string layout;                // layout_name() of the source
  std::string prefix, head, mtp_prefix;
  int n_layers = 0;                  // trunk layers
  int n_record_layers = 0;           // trunk layers + 1 when the MTP head is packed
  int n_experts = 0;
  int hidden = 0, moe_intermediate = 0;
  int64_t vocab = 0;
  uint64_t config_xxh3 = 0;          // of the config.json copied beside the manifest
  SourceIdentity source;
  std::vector<ExpertFile> experts;   // experts.bin first
  std::string dense_file = "dense.bin";
  uint64_t dense_size = 0;
  std::vector<DenseTensor> dense;
  std::string ngram_file = "ngram.bin";
  uint64_t ngram_size = 0;
  std::vector<NgramTable> ngram;
  std::vector<uint64_t> ngram_checksums;  // XXH3-64 of each kNgramBlock of ngram.bin (the last one short)
  std::vector<std::string> copied_files;  // config, tokenizer, template, ... copied beside the store

  // The expert file with `bits` (4: experts.bin, whatever its precision), or null.
  const ExpertFile* expert_file(int bits) const;
};

// Views of the gate, up and down matrices of one record of `f` held at `record` (record_bytes long).
ExpertMatrices record_views(const ExpertFile& f, const uint8_t* record);

std::string manifest_to_json(const Manifest& m);
Result<Manifest> parse_manifest(const std::string& text, const std::string& origin);
Result<Manifest> load_manifest(const std::string& store_dir);
// True when DIR holds a manifest.json (a store, valid or not).
bool is_store_dir(const std::string& dir);

// The identity of a checkpoint directory (file names, sizes, mtimes, XXH3 of config + headers).
Result<SourceIdentity> source_identity(const std::string& dir);

// Checks the manifest against the parsed config.json beside it (geometry, config hash).
Status check_manifest_config(const Manifest& m, const ModelConfig& cfg, uint64_t config_xxh3);

std::string hex64(uint64_t v);

}  // namespace ck::store
