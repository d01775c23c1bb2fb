// Reading a packed store (docs/store-format.md): open_store() maps dense.bin and ngram.bin, checks
// the manifest against config.json and resolves the model's weights from them; StoreExperts serves
// expert records from experts.bin (or experts3/2.bin) on demand with pread, checking checksums per
// --verify-reads; verify_store() checks every checksum of a store.
#pragma once
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "format/weights.h"
#include "store/manifest.h"

namespace ck::store {

// When StoreExperts checks a record's checksum: every read; the first read of each record and 1 in
// 64 later ones; or never.
enum class VerifyReads { Always, Sampled, Never };
bool parse_verify_reads(const std::string& s, VerifyReads* out);

// "layer 3, expert 17", or "MTP layer (record layer 48), expert 17".
std::string record_name(const Manifest& m, int record_layer, int expert);

class StoreExperts : public ExpertSource {
 public:
  ~StoreExperts() override;
  // `bits` 4 reads experts.bin, 3 or 2 the derived files.
  static Result<std::shared_ptr<StoreExperts>> open(const std::string& dir, const Manifest& m, int bits,
                                                    VerifyReads verify);
  // Reads the record into `scratch` and returns views into it.
  Status get(int record_layer, int expert, ExpertMatrices* out, std::vector<uint8_t>* scratch) override;
  const ExpertFile& file() const { return f_; }
  uint64_t reads() const { return reads_.load(); }
  uint64_t verified() const { return verified_.load(); }

 private:
  StoreExperts(const Manifest& m, const ExpertFile& f) : m_(m), f_(f) {}
  const Manifest m_;
  ExpertFile f_;
  std::string path_;
  int fd_ = -1;
  VerifyReads verify_ = VerifyReads::Sampled;
  std::unique_ptr<std::atomic<uint8_t>[]> seen_;  // per record: read (and checked) once
  std::atomic<uint64_t> reads_{0}, verified_{0};
};

struct StoreOptions {
  int expert_bits = 4;               // 4: experts.bin; 3 or 2: experts3/2.bin
  VerifyReads verify = VerifyReads::Sampled;
  bool load_mtp = true;
};

// An opened store: keep it alive while `weights` are used.
struct Store {
  std::string dir;
  Manifest manifest;
  TensorSet tensors;                 // dense.bin tensors + the n-gram tables of ngram.bin
  ModelWeights weights;
  std::shared_ptr<StoreExperts> experts;
};

Result<std::unique_ptr<Store>> open_store(const std::string& dir, const StoreOptions& o = {});

struct VerifyReport {
  uint64_t records = 0, tensors = 0, blocks = 0, bytes = 0;
  std::vector<std::string> failures;  // one line each, naming the file and the record or tensor
  double seconds = 0;
};

// Checks the manifest against config.json and the files, and every checksum. Failures are collected
// (all of them), not returned as an error; an error means the store could not be read at all.
Result<VerifyReport> verify_store(const std::string& dir, int threads = 0);

}  // namespace ck::store
