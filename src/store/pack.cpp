// The packer (pack.h). Three phases, each split into independent work items pulled by a pool of
// threads and written with pwrite at precomputed offsets: dense tensors (one item per tensor),
// n-gram blocks (one item per kNgramBlock of ngram.bin, so every block's checksum is computed from
// bytes in memory), expert records (one item per record, low-bit records derived from the fresh Q4
// record in the same item). Source pages are read through the checkpoint's memory map and dropped
// (MADV_DONTNEED) as soon as they are copied, so resident memory stays at a few buffers per thread.
#include "store/pack.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include "format/weights.h"
#include "store/manifest.h"
#include "store/outfile.h"
#include "store/progress.h"
#include "util/file.h"
#include "util/parallel.h"
#include "util/half.h"
#include "util/log.h"

namespace ck::store {

const std::vector<std::string>& store_side_files() {
  static const std::vector<std::string> files = {
      "config.json",          "generation_config.json", "tokenizer.json",    "tokenizer_config.json",
      "special_tokens_map.json", "chat_template.jinja",  "chat_template.json", "vocab.json",
      "merges.txt",           "added_tokens.json",      "tokenizer.model"};
  return files;
}

std::string default_store_dir(const std::string& src) {
  std::string s = src;
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s + ".store";
}

namespace {

constexpr uint64_t kPage = 4096;

bool is_expert_tensor(const std::string& n) {
  return n.find(".mlp.switch_mlp.") != std::string::npos || n.find(".mlp.experts.") != std::string::npos;
}
bool is_ngram_tensor(const std::string& n) { return n.find(".ple_embedding.ngram_embedding.") != std::string::npos; }
bool is_vision_tensor(const std::string& n) {
  return n.rfind("model.visual.", 0) == 0 || n.rfind("visual.", 0) == 0 || n.rfind("vision_tower.", 0) == 0 ||
         n.rfind("model.vision_tower.", 0) == 0;
}

// Drops the whole pages inside [p, p+n) from this process (they stay in the page cache).
void release(const void* p, size_t n) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p), b = a + n;
  a = (a + kPage - 1) & ~(kPage - 1);
  b &= ~(kPage - 1);
  if (b > a) ::madvise(reinterpret_cast<void*>(a), b - a, MADV_DONTNEED);
}
void prefetch(const void* p, size_t n) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~(kPage - 1), b = reinterpret_cast<uintptr_t>(p) + n;
  if (n) ::madvise(reinterpret_cast<void*>(a), b - a, MADV_WILLNEED);
}


// Quantizes rows [r0, r1) of float matrix m (MLX rule, bits/group) into codes/scales/biases laid out
// from row r0 (codes: rows back to back; scales/biases: [rows, cols/group] in scale_dtype).
void quantize_rows(const Matrix& m, int64_t r0, int64_t r1, int bits, int group, DType scale_dtype, uint8_t* codes,
                   uint8_t* scales, uint8_t* biases) {
  std::vector<float> row(m.cols);
  std::vector<uint32_t> q(group);
  const int64_t n_groups = m.cols / group;
  const size_t row_bytes = static_cast<size_t>(m.cols) * bits / 8;
  for (int64_t r = r0; r < r1; ++r) {
    matrix_row(m, r, row.data());
    uint8_t* out = codes + (r - r0) * row_bytes;
    std::memset(out, 0, row_bytes);
    for (int64_t g = 0; g < n_groups; ++g) {
      float s, b;
      quantize_group(row.data() + g * group, group, bits, q.data(), &s, &b);
      for (int i = 0; i < group; ++i) set_code(out, g * group + i, bits, q[i]);
      store_float(scale_dtype, scales, (r - r0) * n_groups + g, s);
      store_float(scale_dtype, biases, (r - r0) * n_groups + g, b);
    }
  }
}

// ---- expert records ----

PartLayout part_at(uint64_t* cursor_codes, uint64_t code_bytes, uint64_t scale_bytes) {
  PartLayout p;
  p.codes = *cursor_codes;
  p.code_bytes = code_bytes;
  p.scale_bytes = scale_bytes;
  *cursor_codes += code_bytes;
  return p;
}

// Codes of gate, up, down, then their scales, then their biases (DESIGN §1 "Store").
void lay_out_record(ExpertFile* f) {
  const int64_t I = f->gate_rows, H = f->gate_cols;
  uint64_t gate_codes, down_codes, gate_scales = 0, down_scales = 0;
  if (f->bits == 0) {
    gate_codes = static_cast<uint64_t>(I * H) * dtype_size(f->dtype);
    down_codes = gate_codes;
  } else {
    gate_codes = static_cast<uint64_t>(I * H) * f->bits / 8;
    down_codes = gate_codes;
    gate_scales = static_cast<uint64_t>(I * (H / f->group)) * dtype_size(f->scale_dtype);
    down_scales = static_cast<uint64_t>(f->down_rows * (f->down_cols / f->group)) * dtype_size(f->scale_dtype);
  }
  uint64_t c = 0;
  f->gate = part_at(&c, gate_codes, gate_scales);
  f->up = part_at(&c, gate_codes, gate_scales);
  f->down = part_at(&c, down_codes, down_scales);
  f->gate.scales = c; c += gate_scales;
  f->up.scales = c; c += gate_scales;
  f->down.scales = c; c += down_scales;
  f->gate.biases = c; c += gate_scales;
  f->up.biases = c; c += gate_scales;
  f->down.biases = c; c += down_scales;
  f->record_bytes = c;
  f->stride = align_up(c);
}

// "4-bit group 64 (BF16 scales)" or "BF16, unquantized": a matrix's stored format, for errors.
std::string format_name(const Matrix& m) {
  if (!m.quantized()) return fmt::format("{}, unquantized (input dimension {})", dtype_name(m.dtype), m.cols);
  return fmt::format("{}-bit group {} ({} scales)", m.bits, m.group_size, dtype_name(m.scale_dtype));
}

// A record holds its gate, up and down in one format, the same for every expert (DESIGN §1 "Store").
// MLX leaves a matrix unquantized where its input dimension is not a multiple of the group size, so
// a small model can mix formats inside an expert: the error names both matrices and the way out.
Status same_format(const Matrix& a, const Matrix& ref, int rl, int e) {
  if (a.quantized() != ref.quantized() || a.bits != ref.bits || a.group_size != ref.group_size ||
      a.dtype != ref.dtype || (a.quantized() && a.scale_dtype != ref.scale_dtype))
    return error("pack: {} (record layer {}, expert {}) is {}, but {} is {}: a store keeps every expert matrix in one "
                 "format; run this checkpoint without packing it (generate/run --model the checkpoint)",
                 a.name, rl, e, format_name(a), ref.name, format_name(ref));
  return {};
}

// Fills one primary record (stride bytes, zero padded) from the source views (the quantize and
// float methods; verbatim Q4 is written straight from the map).
void build_record(const ExpertFile& f, const ExpertMatrices& src, uint8_t* rec) {
  std::memset(rec + f.record_bytes, 0, f.stride - f.record_bytes);
  const Matrix* mats[3] = {&src.gate, &src.up, &src.down};
  const PartLayout* parts[3] = {&f.gate, &f.up, &f.down};
  for (int k = 0; k < 3; ++k) {
    const Matrix& m = *mats[k];
    const PartLayout& p = *parts[k];
    if (f.method == "copy") {
      std::memcpy(rec + p.codes, m.data, p.code_bytes);
      std::memcpy(rec + p.scales, m.scales, p.scale_bytes);
      std::memcpy(rec + p.biases, m.biases, p.scale_bytes);
    } else if (f.method == "float") {
      std::memcpy(rec + p.codes, m.data, p.code_bytes);
    } else {  // quantize
      quantize_rows(m, 0, m.rows, f.bits, f.group, f.scale_dtype, rec + p.codes, rec + p.scales, rec + p.biases);
    }
  }
}

void release_matrix(const Matrix& m) {
  release(m.data, m.quantized() ? static_cast<size_t>(m.rows) * m.row_code_bytes() : m.stored_bytes());
  if (m.quantized()) {
    size_t sb = static_cast<size_t>(m.rows * (m.cols / m.group_size)) * dtype_size(m.scale_dtype);
    release(m.scales, sb);
    release(m.biases, sb);
  }
}
void prefetch_matrix(const Matrix& m) {
  if (m.quantized()) {
    size_t sb = static_cast<size_t>(m.rows * (m.cols / m.group_size)) * dtype_size(m.scale_dtype);
    prefetch(m.data, static_cast<size_t>(m.rows) * m.row_code_bytes());
    prefetch(m.scales, sb);
    prefetch(m.biases, sb);
  } else {
    prefetch(m.data, m.stored_bytes());
  }
}

// ---- n-gram tables ----

struct NgramSource {
  NgramTable t;
  std::vector<Matrix> parts;  // the checkpoint's row ranges, in order
};

// Finds the part holding `row` and the row inside it.
const Matrix& part_of(const NgramSource& s, int64_t row, int64_t* local) {
  for (const Matrix& m : s.parts) {
    if (row < m.rows) { *local = row; return m; }
    row -= m.rows;
  }
  CHECK_MSG(false, "n-gram row past the table");
  return s.parts[0];
}

// Fills bytes [off, off+n) of ngram.bin from the sources: for every table region overlapping the
// range, the rows it covers are copied or quantized (a region piece is always whole rows because
// the range is cut at row boundaries first; the rest of the block is alignment padding).
void fill_ngram(const std::vector<NgramSource>& tables, uint64_t off, uint64_t n, uint8_t* out) {
  std::memset(out, 0, n);
  for (const NgramSource& s : tables) {
    const NgramTable& t = s.t;
    const bool quant = t.bits != 0;
    const uint64_t row_code = quant ? static_cast<uint64_t>(t.cols) * t.bits / 8 : t.cols * dtype_size(t.dtype);
    const uint64_t row_scale = quant ? static_cast<uint64_t>(t.cols / t.group) * dtype_size(t.scale_dtype) : 0;
    struct Region { uint64_t start, row_bytes; int kind; };  // kind 0 codes, 1 scales, 2 biases
    std::vector<Region> regions = {{t.codes_offset, row_code, 0}};
    if (quant) {
      regions.push_back({t.scales_offset, row_scale, 1});
      regions.push_back({t.biases_offset, row_scale, 2});
    }
    for (const Region& rg : regions) {
      uint64_t end = rg.start + rg.row_bytes * t.rows;
      uint64_t a = std::max(off, rg.start), b = std::min(off + n, end);
      if (a >= b) continue;
      // Whole rows covering [a, b); a row cut by the block boundary is produced whole and clipped.
      int64_t r0 = static_cast<int64_t>((a - rg.start) / rg.row_bytes);
      int64_t r1 = static_cast<int64_t>((b - rg.start + rg.row_bytes - 1) / rg.row_bytes);
      std::vector<uint8_t> codes, scales, biases;
      const int64_t chunk = 4096;
      for (int64_t c0 = r0; c0 < r1; c0 += chunk) {
        int64_t c1 = std::min(r1, c0 + chunk);
        std::vector<uint8_t> piece((c1 - c0) * rg.row_bytes);
        for (int64_t r = c0; r < c1;) {
          int64_t local;
          const Matrix& m = part_of(s, r, &local);
          int64_t take = std::min(c1 - r, m.rows - local);
          uint8_t* dst = piece.data() + (r - c0) * rg.row_bytes;
          if (t.method == "copy" || t.method == "float") {
            const uint8_t* src = rg.kind == 0 ? m.data + local * rg.row_bytes
                               : (rg.kind == 1 ? m.scales : m.biases) + local * rg.row_bytes;
            std::memcpy(dst, src, take * rg.row_bytes);
          } else {
            codes.resize(take * row_code);
            scales.resize(take * row_scale);
            biases.resize(take * row_scale);
            quantize_rows(m, local, local + take, t.bits, t.group, t.scale_dtype, codes.data(), scales.data(),
                          biases.data());
            const std::vector<uint8_t>& src = rg.kind == 0 ? codes : (rg.kind == 1 ? scales : biases);
            std::memcpy(dst, src.data(), take * rg.row_bytes);
          }
          r += take;
        }
        uint64_t p0 = rg.start + c0 * rg.row_bytes, p1 = p0 + piece.size();
        uint64_t x0 = std::max(p0, a), x1 = std::min(p1, b);
        std::memcpy(out + (x0 - off), piece.data() + (x0 - p0), x1 - x0);
      }
    }
  }
}

// ---- work distribution ----


bool store_files_present(const std::string& dir, const Manifest& m) {
  auto sized = [&](const std::string& f, uint64_t size) {
    struct stat st {};
    return ::stat(join_path(dir, f).c_str(), &st) == 0 && static_cast<uint64_t>(st.st_size) == size;
  };
  if (!sized(m.dense_file, m.dense_size) || !sized(m.ngram_file, m.ngram_size)) return false;
  for (const ExpertFile& e : m.experts)
    if (!sized(e.file, e.size)) return false;
  return true;
}

}  // namespace

Result<PackReport> pack_store(const PackOptions& o) {
  PackReport rep;
  rep.out = o.out.empty() ? default_store_dir(o.src) : o.out;
  const std::string& out = rep.out;
  for (int b : o.low_bits)
    if (b != 3 && b != 2) return error("pack: --experts {}: low-bit records are 3 or 2 bits (4 is always written)", b);
  ASSIGN_OR_RETURN(SourceIdentity id, source_identity(o.src));

  // Reuse: the same source, every requested precision present, every file of the right size.
  if (!o.force && is_store_dir(out)) {
    auto old = load_manifest(out);
    if (old.ok() && old->source.same_as(id) && store_files_present(out, *old)) {
      bool all = true;
      for (int b : o.low_bits)
        if (!old->expert_file(b)) all = false;
      if (all) {
        LOG_INF("store", "pack: {} already holds a valid store of {} (same files and headers); nothing to do "
                "(--force repacks)", out, o.src);
        rep.reused = true;
        return rep;
      }
    }
  }

  ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ck, open_checkpoint(o.src, true));
  const ModelConfig& cfg = ck->weights.cfg;
  ASSIGN_OR_RETURN(LayoutInfo li, detect_layout(ck->tensors));
  const int threads = o.threads > 0 ? o.threads : std::max(1u, std::thread::hardware_concurrency());

  Manifest m;
  m.layout = layout_name(li.layout);
  m.prefix = li.prefix;
  m.head = li.head;
  m.mtp_prefix = ck->weights.mtp ? mtp_prefix(ck->tensors) : "";
  m.n_layers = cfg.num_hidden_layers;
  m.n_experts = cfg.num_experts;
  m.hidden = cfg.hidden_size;
  m.moe_intermediate = cfg.moe_intermediate_size;
  m.vocab = cfg.vocab_size;
  m.source = id;
  const auto& table = ck->experts->table;
  m.n_record_layers = static_cast<int>(table.size());
  const int E = cfg.num_experts;
  const int64_t H = cfg.hidden_size, I = cfg.moe_intermediate_size;

  // ---- expert files ----
  const Matrix& ref = table[0][0].gate;
  for (int rl = 0; rl < m.n_record_layers; ++rl)
    for (int e = 0; e < E; ++e) {
      TRY(same_format(table[rl][e].gate, ref, rl, e));
      TRY(same_format(table[rl][e].up, ref, rl, e));
      TRY(same_format(table[rl][e].down, ref, rl, e));
    }
  ExpertFile primary;
  primary.file = "experts.bin";
  primary.gate_rows = I; primary.gate_cols = H; primary.down_rows = H; primary.down_cols = I;
  if (ref.quantized()) {
    primary.method = "copy";
    primary.bits = ref.bits;
    primary.group = ref.group_size;
    primary.scale_dtype = ref.scale_dtype;
  } else if (H % 64 == 0 && I % 64 == 0) {
    primary.method = "quantize";  // as tools/mlx_format.py hf_to_mlx would: 4 bits, group 64, bf16
    primary.bits = 4;
    primary.group = 64;
  } else {
    // Group 64 does not divide the rows: MLX conversion leaves such experts unquantized; so do we.
    primary.method = "float";
    primary.bits = 0;
    primary.group = 0;
    primary.dtype = ref.dtype;
  }
  lay_out_record(&primary);
  m.experts.push_back(primary);
  for (int b : o.low_bits) {
    if (primary.bits == 0)
      return error("pack: --experts {}: the checkpoint's experts cannot be quantized at group 64 (hidden {}, "
                   "intermediate {}), so there are no Q4 records to derive {}-bit ones from", b, H, I, b);
    if (primary.bits <= b)
      return error("pack: --experts {}: the experts are stored at {} bits already", b, primary.bits);
    ExpertFile f = primary;
    f.file = fmt::format("experts{}.bin", b);
    f.bits = b;
    f.method = lowbit_method_name(o.method);
    lay_out_record(&f);
    m.experts.push_back(f);
  }
  const uint64_t n_records = static_cast<uint64_t>(m.n_record_layers) * E;
  for (ExpertFile& f : m.experts) {
    f.size = n_records * f.stride;
    f.checksums.assign(n_records, 0);
  }

  // ---- dense tensors ----
  uint64_t cursor = 0;
  std::vector<const TensorInfo*> dense_src;
  for (auto& [name, t] : ck->tensors.all()) {
    if (is_expert_tensor(name) || is_ngram_tensor(name) || is_vision_tensor(name)) continue;
    DenseTensor d;
    d.name = name;
    d.dtype = t.dtype;
    d.shape = t.shape;
    d.offset = cursor;
    d.nbytes = t.nbytes;
    cursor = align_up(cursor + t.nbytes);
    m.dense.push_back(d);
    dense_src.push_back(&t);
  }
  m.dense_size = cursor;

  // ---- n-gram tables ----
  std::vector<NgramSource> ngram;
  cursor = 0;
  for (int L = 0; L < cfg.num_hidden_layers; ++L) {
    const auto& ple = ck->weights.layers[L].ple;
    if (!ple) continue;
    NgramSource s;
    s.parts = ple->table_parts;
    NgramTable& t = s.t;
    t.layer = L;
    t.module = li.prefix + "layers." + std::to_string(L) + ".ple.ple_embedding.ngram_embedding";
    t.rows = ple->table_rows();
    t.cols = cfg.ngram_row_dim();
    const Matrix& p0 = s.parts[0];
    for (const Matrix& p : s.parts)
      if (p.quantized() != p0.quantized() || p.bits != p0.bits || p.group_size != p0.group_size || p.dtype != p0.dtype ||
          p.scale_dtype != p0.scale_dtype)
        return error("{}: the n-gram table's parts are stored in different formats", p.name);
    if (p0.quantized()) {
      t.method = "copy";
      t.bits = p0.bits;
      t.group = p0.group_size;
      t.scale_dtype = p0.scale_dtype;
    } else if (t.cols % 32 == 0) {
      t.method = "quantize";  // 4 bits, group 32, bf16: the real checkpoint's n-gram format
      t.bits = 4;
      t.group = 32;
    } else {
      t.method = "float";
      t.bits = 0;
      t.group = 0;
      t.dtype = p0.dtype;
    }
    uint64_t row_code = t.bits ? static_cast<uint64_t>(t.cols) * t.bits / 8 : t.cols * dtype_size(t.dtype);
    t.codes_offset = cursor;
    t.codes_bytes = row_code * t.rows;
    cursor = align_up(cursor + t.codes_bytes);
    if (t.bits) {
      t.scale_bytes = static_cast<uint64_t>(t.rows) * (t.cols / t.group) * dtype_size(t.scale_dtype);
      t.scales_offset = cursor;
      cursor = align_up(cursor + t.scale_bytes);
      t.biases_offset = cursor;
      cursor = align_up(cursor + t.scale_bytes);
    }
    m.ngram.push_back(t);
    ngram.push_back(std::move(s));
  }
  m.ngram_size = cursor;
  const uint64_t n_blocks = (m.ngram_size + kNgramBlock - 1) / kNgramBlock;
  m.ngram_checksums.assign(n_blocks, 0);

  uint64_t total = m.dense_size + m.ngram_size;
  for (const ExpertFile& f : m.experts) total += f.size;

  // ---- the old store goes first: from here on, the directory holds no store until the manifest ----
  TRY(make_dirs(out));
  std::string manifest_path = join_path(out, "manifest.json");
  ::unlink(manifest_path.c_str());
  for (const char* f : {"experts.bin", "experts3.bin", "experts2.bin", "dense.bin", "ngram.bin"})
    ::unlink(join_path(out, f).c_str());
  TRY(check_free_space(out, total + (64 << 20), "the store"));
  LOG_INF("store", "pack: {} ({} layout, {} record layers x {} experts, {}) -> {}: {} to write", o.src, m.layout,
          m.n_record_layers, E, primary.method == "copy" ? fmt::format("Q{} copied", primary.bits)
                                                          : (primary.method == "quantize" ? "quantized to Q4" : "float"),
          out, format_bytes(total));

  Progress prog("pack", total);
  std::atomic<uint64_t> written{0};
  auto account = [&](uint64_t n) -> Status {
    prog.add(n);
    uint64_t w = written.fetch_add(n) + n;
    if (o.fail_after_bytes && w >= o.fail_after_bytes)
      return error("pack: simulated failure after {} bytes (--fail-after-bytes)", w);
    return {};
  };

  // Dense tensors: straight from the map to the file; one item per tensor.
  ASSIGN_OR_RETURN(OutFile dense_out, OutFile::create(join_path(out, m.dense_file), m.dense_size));
  TRY(parallel_for(m.dense.size(), threads, [&](size_t i, int) -> Status {
    DenseTensor& d = m.dense[i];
    const TensorInfo& t = *dense_src[i];
    d.xxh3 = XXH3_64bits(t.data, t.nbytes);
    TRY(dense_out.write_at(t.data, t.nbytes, d.offset));
    release(t.data, t.nbytes);
    return account(align_up(d.offset + d.nbytes) - d.offset);
  }));

  // N-gram blocks: filled in memory, hashed, written.
  ASSIGN_OR_RETURN(OutFile ngram_out, OutFile::create(join_path(out, m.ngram_file), m.ngram_size));
  {
    std::vector<std::vector<uint8_t>> bufs(threads);
    TRY(parallel_for(n_blocks, threads, [&](size_t b, int th) -> Status {
      uint64_t off = b * kNgramBlock, n = std::min(kNgramBlock, m.ngram_size - off);
      bufs[th].resize(kNgramBlock);
      fill_ngram(ngram, off, n, bufs[th].data());
      m.ngram_checksums[b] = XXH3_64bits(bufs[th].data(), n);
      TRY(ngram_out.write_at(bufs[th].data(), n, off));
      return account(n);
    }));
    for (NgramSource& s : ngram)
      for (const Matrix& p : s.parts) release_matrix(p);
  }

  // Expert records: one item per (record layer, expert); low-bit records derived from the new Q4 one.
  std::vector<OutFile> expert_out;
  for (const ExpertFile& f : m.experts) {
    ASSIGN_OR_RETURN(OutFile x, OutFile::create(join_path(out, f.file), f.size));
    expert_out.push_back(std::move(x));
  }
  {
    std::vector<std::vector<std::vector<uint8_t>>> bufs(threads, std::vector<std::vector<uint8_t>>(m.experts.size()));
    TRY(parallel_for(n_records, threads, [&](size_t k, int th) -> Status {
      const int rl = static_cast<int>(k / E), e = static_cast<int>(k % E);
      const ExpertMatrices& src = table[rl][e];
      if (k + 1 < n_records) {  // start reading the next record while this one is copied
        const ExpertMatrices& nx = table[(k + 1) / E][(k + 1) % E];
        prefetch_matrix(nx.gate);
        prefetch_matrix(nx.up);
        prefetch_matrix(nx.down);
      }
      auto& b = bufs[th];
      const ExpertFile& pf = m.experts[0];
      ExpertMatrices q4 = src;  // the Q4 matrices the low-bit records are derived from
      if (pf.method == "copy") {
        // Verbatim Q4: the record is gathered from the checkpoint's map straight into the file (no
        // copy through a buffer), hashed piece by piece.
        static const std::vector<uint8_t> zeros(kAlign, 0);
        const Matrix* mats[3] = {&src.gate, &src.up, &src.down};
        const PartLayout* parts[3] = {&pf.gate, &pf.up, &pf.down};
        std::vector<OutFile::Piece> pieces;
        for (int k3 = 0; k3 < 3; ++k3) pieces.push_back({mats[k3]->data, parts[k3]->code_bytes});
        for (int k3 = 0; k3 < 3; ++k3) pieces.push_back({mats[k3]->scales, parts[k3]->scale_bytes});
        for (int k3 = 0; k3 < 3; ++k3) pieces.push_back({mats[k3]->biases, parts[k3]->scale_bytes});
        XXH3_state_t* h = XXH3_createState();
        XXH3_64bits_reset(h);
        for (const auto& p : pieces) XXH3_64bits_update(h, p.data, p.n);
        m.experts[0].checksums[k] = XXH3_64bits_digest(h);
        XXH3_freeState(h);
        pieces.push_back({zeros.data(), pf.stride - pf.record_bytes});
        TRY(expert_out[0].write_pieces_at(pieces, k * pf.stride));
      } else {
        b[0].resize(pf.stride);
        build_record(pf, src, b[0].data());
        m.experts[0].checksums[k] = XXH3_64bits(b[0].data(), pf.record_bytes);
        TRY(expert_out[0].write_at(b[0].data(), pf.stride, k * pf.stride));
        q4 = record_views(pf, b[0].data());
      }
      TRY(account(pf.stride));
      for (size_t f = 1; f < m.experts.size(); ++f) {
        const ExpertFile& lf = m.experts[f];
        b[f].resize(lf.stride);
        uint8_t* rec = b[f].data();
        std::memset(rec + lf.record_bytes, 0, lf.stride - lf.record_bytes);
        lowbit_matrix(q4.gate, lf.bits, o.method, rec + lf.gate.codes, rec + lf.gate.scales, rec + lf.gate.biases);
        lowbit_matrix(q4.up, lf.bits, o.method, rec + lf.up.codes, rec + lf.up.scales, rec + lf.up.biases);
        lowbit_matrix(q4.down, lf.bits, o.method, rec + lf.down.codes, rec + lf.down.scales, rec + lf.down.biases);
        m.experts[f].checksums[k] = XXH3_64bits(rec, lf.record_bytes);
        TRY(expert_out[f].write_at(rec, lf.stride, k * lf.stride));
        TRY(account(lf.stride));
      }
      release_matrix(src.gate);
      release_matrix(src.up);
      release_matrix(src.down);
      return {};
    }));
  }

  // Everything is on disk under temporary names: rename, copy the side files, then the manifest.
  TRY(dense_out.commit(o.sync));
  TRY(ngram_out.commit(o.sync));
  for (OutFile& f : expert_out) TRY(f.commit(o.sync));
  for (const std::string& f : store_side_files()) {
    std::string p = join_path(o.src, f);
    if (!file_exists(p)) continue;
    ASSIGN_OR_RETURN(std::string bytes, read_file(p));
    if (f == "config.json") m.config_xxh3 = XXH3_64bits(bytes.data(), bytes.size());
    TRY(write_file_atomic(join_path(out, f), bytes));
    m.copied_files.push_back(f);
  }
  TRY(write_file_atomic(manifest_path, manifest_to_json(m)));
  rep.bytes = written.load();
  rep.seconds = prog.finish();
  rep.cpu_seconds = prog.cpu_seconds();
  return rep;
}

}  // namespace ck::store
