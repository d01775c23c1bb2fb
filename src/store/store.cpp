// Store reading, on-demand expert records and verification (store.h). dense.bin and ngram.bin are
// memory-mapped and seen as one TensorSet; expert records are read with pread, never mapped, so a
// corrupt or missing record is an error on its read rather than a SIGBUS.
#include "store/store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>

#include "store/progress.h"
#include "util/file.h"
#include "util/parallel.h"
#include "util/log.h"

namespace ck::store {

bool parse_verify_reads(const std::string& s, VerifyReads* out) {
  if (s == "always") { *out = VerifyReads::Always; return true; }
  if (s == "sampled") { *out = VerifyReads::Sampled; return true; }
  if (s == "never") { *out = VerifyReads::Never; return true; }
  return false;
}

std::string record_name(const Manifest& m, int rl, int e) {
  if (rl >= m.n_layers) return fmt::format("MTP layer (record layer {}), expert {}", rl, e);
  return fmt::format("layer {}, expert {}", rl, e);
}

namespace {

Result<uint64_t> file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return error("{}: cannot stat: {}", path, std::strerror(errno));
  return static_cast<uint64_t>(st.st_size);
}

// Reads exactly n bytes at off; a short read returns the count read so far.
Status pread_all(int fd, uint8_t* buf, size_t n, uint64_t off, size_t* got) {
  *got = 0;
  while (*got < n) {
    ssize_t r = ::pread(fd, buf + *got, n - *got, static_cast<off_t>(off + *got));
    if (r < 0) {
      if (errno == EINTR) continue;
      return error("{}", std::strerror(errno));
    }
    if (r == 0) break;
    *got += static_cast<size_t>(r);
  }
  return {};
}

Result<Layout> parse_layout(const std::string& s) {
  for (Layout l : {Layout::HfPerExpert, Layout::HfFused, Layout::Mlx})
    if (s == layout_name(l)) return l;
  return error("unknown source layout '{}' in the manifest", s);
}


}  // namespace

// ---------------------------------------------------------------- StoreExperts

StoreExperts::~StoreExperts() {
  if (fd_ >= 0) ::close(fd_);
}

Result<std::shared_ptr<StoreExperts>> StoreExperts::open(const std::string& dir, const Manifest& m, int bits,
                                                         VerifyReads verify) {
  const ExpertFile* f = m.expert_file(bits);
  if (!f) {
    std::string have;
    for (const ExpertFile& e : m.experts) have += (have.empty() ? "" : ", ") + e.file;
    return error("{}: --experts {}: the store has no {}-bit records (it has {}); pack with --experts 4,{}", dir, bits,
                 bits, have, bits);
  }
  const uint64_t n_records = static_cast<uint64_t>(m.n_record_layers) * m.n_experts;
  if (f->checksums.size() != n_records)
    return error("{}: manifest lists {} checksums for {} but the geometry has {} records", dir, f->checksums.size(),
                 f->file, n_records);
  std::shared_ptr<StoreExperts> s(new StoreExperts(m, *f));
  s->path_ = join_path(dir, f->file);
  s->verify_ = verify;
  s->seen_.reset(new std::atomic<uint8_t>[n_records]());
  ASSIGN_OR_RETURN(uint64_t size, file_size(s->path_));
  if (size < f->size) {
    uint64_t first = size / f->stride;  // the first record not wholly present
    return error("{}: {} bytes but the manifest says {}: the file is truncated; records from {} on are missing "
                 "(run `cherenkov verify {}`)", s->path_, size, f->size,
                 record_name(m, static_cast<int>(first / m.n_experts), static_cast<int>(first % m.n_experts)), dir);
  }
  if (size > f->size)
    return error("{}: {} bytes but the manifest says {}: the file does not belong to this manifest", s->path_, size,
                 f->size);
  s->fd_ = ::open(s->path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (s->fd_ < 0) return error("{}: cannot open: {}", s->path_, std::strerror(errno));
  return s;
}

Status StoreExperts::get(int rl, int e, ExpertMatrices* out, std::vector<uint8_t>* scratch) {
  if (rl < 0 || rl >= m_.n_record_layers || e < 0 || e >= m_.n_experts)
    return error("{}: expert ({}, {}) out of range ({} record layers x {} experts)", path_, rl, e, m_.n_record_layers,
                 m_.n_experts);
  const uint64_t k = static_cast<uint64_t>(rl) * m_.n_experts + e, off = k * f_.stride;
  if (scratch->size() < f_.record_bytes) scratch->resize(f_.record_bytes);
  size_t got = 0;
  Status st = pread_all(fd_, scratch->data(), f_.record_bytes, off, &got);
  if (!st.ok())
    return error("{}: reading the record of {} at offset {} failed: {}", path_, record_name(m_, rl, e), off,
                 st.message());
  if (got != f_.record_bytes)
    return error("{}: record of {} at offset {}: short read, {} of {} bytes (file truncated?)", path_,
                 record_name(m_, rl, e), off, got, f_.record_bytes);
  uint64_t n = reads_.fetch_add(1);
  bool check = verify_ == VerifyReads::Always ||
               (verify_ == VerifyReads::Sampled && (seen_[k].exchange(1) == 0 || n % 64 == 0));
  if (check) {
    verified_.fetch_add(1);
    uint64_t h = XXH3_64bits(scratch->data(), f_.record_bytes);
    if (h != f_.checksums[k]) {
      seen_[k] = 0;  // a corrupt record is checked again on its next read
      return error("{}: record of {} at offset {}: checksum mismatch (XXH3 {}, manifest {}): the store is corrupt; "
                   "run `cherenkov verify` and repack", path_, record_name(m_, rl, e), off, hex64(h),
                   hex64(f_.checksums[k]));
    }
  }
  *out = record_views(f_, scratch->data());
  return {};
}

// ---------------------------------------------------------------- open_store

Result<std::unique_ptr<Store>> open_store(const std::string& dir, const StoreOptions& o) {
  auto s = std::make_unique<Store>();
  s->dir = dir;
  ASSIGN_OR_RETURN(s->manifest, load_manifest(dir));
  const Manifest& m = s->manifest;
  std::string config_path = join_path(dir, "config.json");
  ASSIGN_OR_RETURN(std::string config_text, read_file(config_path));
  ASSIGN_OR_RETURN(ModelConfig cfg, parse_config(config_text, config_path));
  TRY(check_manifest_config(m, cfg, XXH3_64bits(config_text.data(), config_text.size())));

  std::vector<std::unique_ptr<MappedFile>> files;
  std::map<std::string, TensorInfo> tensors;
  auto map = [&](const std::string& name, uint64_t want) -> Result<const MappedFile*> {
    std::string p = join_path(dir, name);
    ASSIGN_OR_RETURN(MappedFile mf, MappedFile::open(p));
    if (mf.size() != want)
      return error("{}: {} bytes but the manifest says {}: the file is {} (run `cherenkov verify {}`)", p, mf.size(),
                   want, mf.size() < want ? "truncated" : "not the one the manifest describes", dir);
    files.push_back(std::make_unique<MappedFile>(std::move(mf)));
    return files.back().get();
  };
  ASSIGN_OR_RETURN(const MappedFile* dense, map(m.dense_file, m.dense_size));
  for (const DenseTensor& d : m.dense) {
    TensorInfo t;
    t.name = d.name;
    t.dtype = d.dtype;
    t.shape = d.shape;
    t.nbytes = d.nbytes;
    t.file = dense->path();
    if (d.offset + d.nbytes > dense->size() || static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype) != d.nbytes)
      return error("{}: manifest entry for tensor '{}' ({} {}, {} bytes at {}) does not fit the file", dense->path(),
                   d.name, dtype_name(d.dtype), t.shape_str(), d.nbytes, d.offset);
    t.data = dense->data() + d.offset;
    if (o.verify != VerifyReads::Never && XXH3_64bits(t.data, t.nbytes) != d.xxh3)
      return error("{}: tensor '{}' at offset {}: checksum mismatch: the store is corrupt (run `cherenkov verify {}`)",
                   dense->path(), d.name, d.offset, dir);
    tensors[d.name] = std::move(t);
  }
  ASSIGN_OR_RETURN(const MappedFile* ngram, map(m.ngram_file, m.ngram_size));
  for (const NgramTable& nt : m.ngram) {
    auto add = [&](const std::string& name, DType dt, std::vector<int64_t> shape, uint64_t off, uint64_t nbytes) -> Status {
      TensorInfo t;
      t.name = name;
      t.dtype = dt;
      t.shape = std::move(shape);
      t.nbytes = nbytes;
      t.file = ngram->path();
      if (off + nbytes > ngram->size() || static_cast<uint64_t>(t.numel()) * dtype_size(dt) != nbytes)
        return error("{}: manifest entry for '{}' does not fit the file", ngram->path(), name);
      t.data = ngram->data() + off;
      tensors[name] = std::move(t);
      return {};
    };
    if (nt.bits == 0) {
      TRY(add(nt.module + ".weight", nt.dtype, {nt.rows, nt.cols}, nt.codes_offset, nt.codes_bytes));
    } else {
      TRY(add(nt.module + ".weight", DType::U32, {nt.rows, nt.cols * nt.bits / 32}, nt.codes_offset, nt.codes_bytes));
      TRY(add(nt.module + ".scales", nt.scale_dtype, {nt.rows, nt.cols / nt.group}, nt.scales_offset, nt.scale_bytes));
      TRY(add(nt.module + ".biases", nt.scale_dtype, {nt.rows, nt.cols / nt.group}, nt.biases_offset, nt.scale_bytes));
    }
  }
  s->tensors = TensorSet::from_tensors(std::move(files), std::move(tensors), dir);

  LayoutInfo li;
  auto layout = parse_layout(m.layout);
  if (!layout.ok()) return layout.status().with_context(join_path(dir, "manifest.json"));
  li.layout = *layout;
  li.prefix = m.prefix;
  li.head = m.head;
  ASSIGN_OR_RETURN(s->weights, resolve_weights(s->tensors, cfg, li, o.load_mtp, nullptr));
  const int want_record_layers = cfg.num_hidden_layers + (m.mtp_prefix.empty() ? 0 : 1);
  if (m.n_record_layers != want_record_layers)
    return error("{}: manifest has {} record layers; the config and MTP head need {}", dir, m.n_record_layers,
                 want_record_layers);
  ASSIGN_OR_RETURN(s->experts, StoreExperts::open(dir, m, o.expert_bits, o.verify));
  LOG_INF("store", "opened store {}: {} layers{}, {} experts from {} ({}), dense {}, n-gram {}", dir, m.n_layers,
          m.mtp_prefix.empty() ? "" : " + MTP", m.n_experts, s->experts->file().file,
          s->experts->file().bits ? fmt::format("Q{}", s->experts->file().bits) : "float",
          format_bytes(m.dense_size), format_bytes(m.ngram_size));
  return s;
}

// ---------------------------------------------------------------- verify_store

Result<VerifyReport> verify_store(const std::string& dir, int threads) {
  VerifyReport rep;
  if (threads <= 0) threads = std::max(1u, std::thread::hardware_concurrency());
  ASSIGN_OR_RETURN(Manifest m, load_manifest(dir));
  std::mutex mu;
  auto fail = [&](std::string line) {
    std::lock_guard<std::mutex> lock(mu);
    rep.failures.push_back(std::move(line));
  };
  // The config beside the manifest.
  {
    std::string config_path = join_path(dir, "config.json");
    auto text = read_file(config_path);
    if (!text.ok()) {
      fail(text.status().message());
    } else {
      auto cfg = parse_config(*text, config_path);
      if (!cfg.ok()) fail(cfg.status().message());
      else {
        Status st = check_manifest_config(m, *cfg, XXH3_64bits(text->data(), text->size()));
        if (!st.ok()) fail(st.message());
      }
    }
  }
  struct Target { std::string path; uint64_t want; int fd = -1; uint64_t have = 0; };
  auto open_target = [&](const std::string& name, uint64_t want) {
    Target t{join_path(dir, name), want};
    auto sz = file_size(t.path);
    if (!sz.ok()) { fail(sz.status().message()); return t; }
    t.have = *sz;
    if (t.have != want)
      fail(fmt::format("{}: {} bytes but the manifest says {} ({})", t.path, t.have, want,
                       t.have < want ? "truncated" : "too long"));
    t.fd = ::open(t.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (t.fd < 0) fail(fmt::format("{}: cannot open: {}", t.path, std::strerror(errno)));
    return t;
  };
  uint64_t total = m.dense_size + m.ngram_size;
  for (const ExpertFile& f : m.experts) total += f.size;
  Progress prog("verify", total);
  std::vector<std::vector<uint8_t>> bufs(threads);
  // Reads [off, off+n) of t and returns its XXH3, or a failure line naming `what`.
  auto check = [&](const Target& t, uint64_t off, uint64_t n, uint64_t want, const std::string& what, int th) {
    if (t.fd < 0) return;
    if (off + n > t.have) {
      fail(fmt::format("{}: {} at offset {}: missing ({} bytes past the end of the file)", t.path, what, off,
                       off + n - t.have));
      return;
    }
    bufs[th].resize(std::max<size_t>(bufs[th].size(), n));
    size_t got = 0;
    Status st = pread_all(t.fd, bufs[th].data(), n, off, &got);
    if (!st.ok() || got != n) {
      fail(fmt::format("{}: {} at offset {}: read failed ({})", t.path, what, off, st.ok() ? "short read" : st.message()));
      return;
    }
    uint64_t h = XXH3_64bits(bufs[th].data(), n);
    if (h != want) fail(fmt::format("{}: {} at offset {}: checksum mismatch (XXH3 {}, manifest {})", t.path, what, off,
                                    hex64(h), hex64(want)));
    prog.add(n);
  };
  Target dense = open_target(m.dense_file, m.dense_size);
  TRY(parallel_for(m.dense.size(), threads, [&](size_t i, int th) -> Status {
    const DenseTensor& d = m.dense[i];
    check(dense, d.offset, d.nbytes, d.xxh3, "tensor '" + d.name + "'", th);
    return {};
  }));
  rep.tensors = m.dense.size();
  Target ngram = open_target(m.ngram_file, m.ngram_size);
  const uint64_t n_blocks = (m.ngram_size + kNgramBlock - 1) / kNgramBlock;
  if (m.ngram_checksums.size() != n_blocks)
    fail(fmt::format("{}: manifest has {} n-gram block checksums, the size needs {}", ngram.path,
                     m.ngram_checksums.size(), n_blocks));
  else
    TRY(parallel_for(n_blocks, threads, [&](size_t b, int th) -> Status {
      uint64_t off = b * kNgramBlock;
      check(ngram, off, std::min(kNgramBlock, m.ngram_size - off), m.ngram_checksums[b], fmt::format("block {}", b), th);
      return {};
    }));
  rep.blocks = n_blocks;
  const uint64_t n_records = static_cast<uint64_t>(m.n_record_layers) * m.n_experts;
  for (const ExpertFile& f : m.experts) {
    Target t = open_target(f.file, f.size);
    if (f.checksums.size() != n_records) {
      fail(fmt::format("{}: manifest has {} checksums for {} records", t.path, f.checksums.size(), n_records));
    } else {
      TRY(parallel_for(n_records, threads, [&](size_t k, int th) -> Status {
        check(t, k * f.stride, f.record_bytes, f.checksums[k],
              "record of " + record_name(m, static_cast<int>(k / m.n_experts), static_cast<int>(k % m.n_experts)), th);
        return {};
      }));
      rep.records += n_records;
    }
    if (t.fd >= 0) ::close(t.fd);
  }
  if (dense.fd >= 0) ::close(dense.fd);
  if (ngram.fd >= 0) ::close(ngram.fd);
  rep.bytes = prog.done();
  rep.seconds = prog.finish();
  return rep;
}

}  // namespace ck::store
