// manifest.json reading and writing, and the source identity (manifest.h). Checksums are written
// as 16-digit hex strings: JSON numbers above 2^53 do not survive every reader.
#include "store/manifest.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <type_traits>

#include "util/json.h"

#include "util/file.h"

namespace ck::store {


std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

const ExpertFile* Manifest::expert_file(int bits) const {
  if (bits == 4) return experts.empty() ? nullptr : &experts[0];
  for (const ExpertFile& e : experts)
    if (e.bits == bits && &e != &experts[0]) return &e;
  return nullptr;
}

ExpertMatrices record_views(const ExpertFile& f, const uint8_t* record) {
  auto view = [&](const PartLayout& p, int64_t rows, int64_t cols, const char* name) {
    Matrix m;
    m.rows = rows;
    m.cols = cols;
    m.data = record + p.codes;
    m.name = name;
    if (f.bits == 0) {
      m.dtype = f.dtype;
    } else {
      m.dtype = DType::U32;
      m.bits = f.bits;
      m.group_size = f.group;
      m.scale_dtype = f.scale_dtype;
      m.scales = record + p.scales;
      m.biases = record + p.biases;
    }
    return m;
  };
  ExpertMatrices e;
  e.gate = view(f.gate, f.gate_rows, f.gate_cols, "gate_proj");
  e.up = view(f.up, f.gate_rows, f.gate_cols, "up_proj");
  e.down = view(f.down, f.down_rows, f.down_cols, "down_proj");
  return e;
}

namespace {

void part_json(JsonBuilder& b, const char* name, const PartLayout& p) {
  b.key(name).begin_object();
  b.field("codes", p.codes).field("scales", p.scales).field("biases", p.biases).field("code_bytes", p.code_bytes);
  b.field("scale_bytes", p.scale_bytes).end_object();
}

// Field access that turns a missing or mistyped key into an error naming the manifest and the key.
struct J {
  JsonRef j;
  std::string where;
  Status need(const char* k) const {
    if (!j.contains(k)) return error("{}: missing '{}'", where, k);
    return {};
  }
  Status wrong(const char* k) const { return error("{}: '{}' has the wrong type ({})", where, k, j[k].dump()); }
  Status get(const char* k, std::string* out) const {
    TRY(need(k));
    if (!j[k].is_string()) return wrong(k);
    *out = j[k].as_string();
    return {};
  }
  template <typename T>
    requires std::is_integral_v<T>
  Status get(const char* k, T* out) const {
    TRY(need(k));
    if (!j[k].is_integer()) return wrong(k);
    *out = std::is_signed_v<T> ? static_cast<T>(j[k].as_int()) : static_cast<T>(j[k].as_uint());
    return {};
  }
  Status get(const char* k, std::vector<int64_t>* out) const {
    TRY(need(k));
    if (!j[k].is_array()) return wrong(k);
    out->clear();
    for (JsonRef v : j[k].elements()) {
      if (!v.is_integer()) return wrong(k);
      out->push_back(v.as_int());
    }
    return {};
  }
  Status get(const char* k, std::vector<std::string>* out) const {
    TRY(need(k));
    if (!j[k].is_array()) return wrong(k);
    out->clear();
    for (JsonRef v : j[k].elements()) {
      if (!v.is_string()) return wrong(k);
      out->push_back(v.as_string());
    }
    return {};
  }
  // The elements of list k.
  Result<JsonRef::Elements> list(const char* k) const {
    TRY(need(k));
    if (!j[k].is_array()) return error("{}: '{}' must be a list, got {}", where, k, json_type_name(j[k].type()));
    return j[k].elements();
  }
  Status dtype(const char* k, DType* out) const {
    std::string s;
    TRY(get(k, &s));
    if (!parse_dtype(s, out)) return error("{}: '{}' = '{}' is not a dtype", where, k, s);
    return {};
  }
  Status hex(const char* k, uint64_t* out) const {
    std::string s;
    TRY(get(k, &s));
    return parse_hex(s, k, out);
  }
  Status parse_hex(const std::string& s, const char* k, uint64_t* out) const {
    if (s.size() != 16 || s.find_first_not_of("0123456789abcdef") != std::string::npos)
      return error("{}: '{}' = '{}' is not a 16-digit hex checksum", where, k, s);
    *out = std::stoull(s, nullptr, 16);
    return {};
  }
  J at(const char* k) const { return J{j[k], where + "." + k}; }
};

Status parse_part(const J& j, PartLayout* p) {
  TRY(j.get("codes", &p->codes));
  TRY(j.get("scales", &p->scales));
  TRY(j.get("biases", &p->biases));
  TRY(j.get("code_bytes", &p->code_bytes));
  TRY(j.get("scale_bytes", &p->scale_bytes));
  return {};
}

}  // namespace

// Keys are sorted (the builder's document keeps them so), as nlohmann::json wrote them before.
std::string manifest_to_json(const Manifest& m) {
  JsonBuilder b;
  b.begin_object();
  b.field("format", "cherenkov-store").field("version", m.version);
  b.key("geometry").begin_object();
  b.field("layout", m.layout).field("prefix", m.prefix).field("head", m.head).field("mtp_prefix", m.mtp_prefix);
  b.field("n_layers", m.n_layers).field("n_record_layers", m.n_record_layers).field("n_experts", m.n_experts);
  b.field("hidden", m.hidden).field("moe_intermediate", m.moe_intermediate).field("vocab", m.vocab);
  b.end_object();
  b.field("config_xxh3", hex64(m.config_xxh3));
  b.key("source").begin_object().field("dir", m.source.dir).key("files").begin_array();
  for (auto& f : m.source.files)
    b.begin_object().field("name", f.name).field("size", f.size).field("mtime_ns", f.mtime_ns).end_object();
  b.end_array().field("headers_xxh3", hex64(m.source.headers_xxh3)).end_object();
  b.field("copied_files", m.copied_files);
  b.key("experts").begin_array();
  for (const ExpertFile& e : m.experts) {
    b.begin_object();
    b.field("file", e.file).field("bits", e.bits).field("group", e.group).field("dtype", dtype_name(e.dtype));
    b.field("scale_dtype", dtype_name(e.scale_dtype)).field("method", e.method);
    b.key("gate_shape").begin_array().value(e.gate_rows).value(e.gate_cols).end_array();
    b.key("down_shape").begin_array().value(e.down_rows).value(e.down_cols).end_array();
    part_json(b, "gate", e.gate);
    part_json(b, "up", e.up);
    part_json(b, "down", e.down);
    b.field("record_bytes", e.record_bytes).field("stride", e.stride).field("size", e.size);
    b.key("checksums").begin_array();
    for (uint64_t c : e.checksums) b.value(hex64(c));
    b.end_array().end_object();
  }
  b.end_array();
  b.key("dense").begin_object().field("file", m.dense_file).field("size", m.dense_size).key("tensors").begin_array();
  for (const DenseTensor& t : m.dense) {
    b.begin_object().field("name", t.name).field("dtype", dtype_name(t.dtype)).field("shape", t.shape);
    b.field("offset", t.offset).field("nbytes", t.nbytes).field("xxh3", hex64(t.xxh3)).end_object();
  }
  b.end_array().end_object();
  b.key("ngram").begin_object().field("file", m.ngram_file).field("size", m.ngram_size).field("block", kNgramBlock);
  b.key("tables").begin_array();
  for (const NgramTable& t : m.ngram) {
    b.begin_object().field("layer", t.layer).field("module", t.module).field("rows", t.rows).field("cols", t.cols);
    b.field("bits", t.bits).field("group", t.group).field("dtype", dtype_name(t.dtype));
    b.field("scale_dtype", dtype_name(t.scale_dtype)).field("method", t.method).field("codes_offset", t.codes_offset);
    b.field("codes_bytes", t.codes_bytes).field("scales_offset", t.scales_offset);
    b.field("biases_offset", t.biases_offset).field("scale_bytes", t.scale_bytes).end_object();
  }
  b.end_array().key("checksums").begin_array();
  for (uint64_t c : m.ngram_checksums) b.value(hex64(c));
  b.end_array().end_object();
  b.end_object();
  return b.finish().dump(1) + "\n";
}

Result<Manifest> parse_manifest(const std::string& text, const std::string& origin) {
  Result<JsonDoc> parsed = parse_json(text);
  if (!parsed.ok()) return error("{}: invalid JSON: {}", origin, parsed.status().message());
  const JsonDoc& j = *parsed;
  J r{j, origin};
  Manifest m;
  std::string fmt_name;
  TRY(r.get("format", &fmt_name));
  if (fmt_name != "cherenkov-store") return error("{}: format is '{}', not 'cherenkov-store'", origin, fmt_name);
  TRY(r.get("version", &m.version));
  if (m.version != kStoreVersion)
    return error("{}: store version {} (this build reads version {}; repack the checkpoint)", origin, m.version,
                 kStoreVersion);
  TRY(r.need("geometry"));
  J g = r.at("geometry");
  TRY(g.get("layout", &m.layout));
  TRY(g.get("prefix", &m.prefix));
  TRY(g.get("head", &m.head));
  TRY(g.get("mtp_prefix", &m.mtp_prefix));
  TRY(g.get("n_layers", &m.n_layers));
  TRY(g.get("n_record_layers", &m.n_record_layers));
  TRY(g.get("n_experts", &m.n_experts));
  TRY(g.get("hidden", &m.hidden));
  TRY(g.get("moe_intermediate", &m.moe_intermediate));
  TRY(g.get("vocab", &m.vocab));
  TRY(r.hex("config_xxh3", &m.config_xxh3));
  TRY(r.need("source"));
  J s = r.at("source");
  TRY(s.get("dir", &m.source.dir));
  TRY(s.hex("headers_xxh3", &m.source.headers_xxh3));
  ASSIGN_OR_RETURN(JsonRef::Elements files, s.list("files"));
  for (JsonRef f : files) {
    J jf{f, origin + ".source.files[]"};
    SourceFile sf;
    TRY(jf.get("name", &sf.name));
    TRY(jf.get("size", &sf.size));
    TRY(jf.get("mtime_ns", &sf.mtime_ns));
    m.source.files.push_back(sf);
  }
  if (j.contains("copied_files")) TRY(r.get("copied_files", &m.copied_files));
  TRY(r.need("experts"));
  if (!j["experts"].is_array() || j["experts"].empty()) return error("{}: 'experts' must be a non-empty list", origin);
  for (size_t i = 0; i < j["experts"].size(); ++i) {
    J e{j["experts"][i], fmt::format("{}.experts[{}]", origin, i)};
    ExpertFile f;
    TRY(e.get("file", &f.file));
    TRY(e.get("bits", &f.bits));
    TRY(e.get("group", &f.group));
    TRY(e.dtype("dtype", &f.dtype));
    TRY(e.dtype("scale_dtype", &f.scale_dtype));
    TRY(e.get("method", &f.method));
    std::vector<int64_t> gs, ds;
    TRY(e.get("gate_shape", &gs));
    TRY(e.get("down_shape", &ds));
    if (gs.size() != 2 || ds.size() != 2) return error("{}: gate_shape/down_shape must have 2 entries", e.where);
    f.gate_rows = gs[0]; f.gate_cols = gs[1]; f.down_rows = ds[0]; f.down_cols = ds[1];
    TRY(e.need("gate"));
    TRY(e.need("up"));
    TRY(e.need("down"));
    TRY(parse_part(e.at("gate"), &f.gate));
    TRY(parse_part(e.at("up"), &f.up));
    TRY(parse_part(e.at("down"), &f.down));
    TRY(e.get("record_bytes", &f.record_bytes));
    TRY(e.get("stride", &f.stride));
    TRY(e.get("size", &f.size));
    std::vector<std::string> sums;
    TRY(e.get("checksums", &sums));
    f.checksums.resize(sums.size());
    for (size_t k = 0; k < sums.size(); ++k) TRY(e.parse_hex(sums[k], "checksums[]", &f.checksums[k]));
    if (f.file.find('/') != std::string::npos) return error("{}: file '{}' must be a plain name", e.where, f.file);
    if (f.stride < f.record_bytes || f.stride % kAlign)
      return error("{}: stride {} must be a multiple of {} and >= record_bytes {}", e.where, f.stride, kAlign,
                   f.record_bytes);
    m.experts.push_back(std::move(f));
  }
  TRY(r.need("dense"));
  J d = r.at("dense");
  TRY(d.get("file", &m.dense_file));
  TRY(d.get("size", &m.dense_size));
  ASSIGN_OR_RETURN(JsonRef::Elements tensors, d.list("tensors"));
  for (JsonRef t : tensors) {
    J jt{t, origin + ".dense.tensors[]"};
    DenseTensor dt;
    TRY(jt.get("name", &dt.name));
    TRY(jt.dtype("dtype", &dt.dtype));
    TRY(jt.get("shape", &dt.shape));
    TRY(jt.get("offset", &dt.offset));
    TRY(jt.get("nbytes", &dt.nbytes));
    TRY(jt.hex("xxh3", &dt.xxh3));
    m.dense.push_back(std::move(dt));
  }
  TRY(r.need("ngram"));
  J n = r.at("ngram");
  TRY(n.get("file", &m.ngram_file));
  TRY(n.get("size", &m.ngram_size));
  uint64_t block = 0;
  TRY(n.get("block", &block));
  if (block != kNgramBlock) return error("{}: ngram.block {} (this build uses {})", origin, block, kNgramBlock);
  ASSIGN_OR_RETURN(JsonRef::Elements tables, n.list("tables"));
  for (JsonRef t : tables) {
    J jt{t, origin + ".ngram.tables[]"};
    NgramTable nt;
    TRY(jt.get("layer", &nt.layer));
    TRY(jt.get("module", &nt.module));
    TRY(jt.get("rows", &nt.rows));
    TRY(jt.get("cols", &nt.cols));
    TRY(jt.get("bits", &nt.bits));
    TRY(jt.get("group", &nt.group));
    TRY(jt.dtype("dtype", &nt.dtype));
    TRY(jt.dtype("scale_dtype", &nt.scale_dtype));
    TRY(jt.get("method", &nt.method));
    TRY(jt.get("codes_offset", &nt.codes_offset));
    TRY(jt.get("codes_bytes", &nt.codes_bytes));
    TRY(jt.get("scales_offset", &nt.scales_offset));
    TRY(jt.get("biases_offset", &nt.biases_offset));
    TRY(jt.get("scale_bytes", &nt.scale_bytes));
    m.ngram.push_back(std::move(nt));
  }
  std::vector<std::string> nsums;
  TRY(n.get("checksums", &nsums));
  m.ngram_checksums.resize(nsums.size());
  for (size_t k = 0; k < nsums.size(); ++k) TRY(n.parse_hex(nsums[k], "checksums[]", &m.ngram_checksums[k]));
  if (m.dense_file.find('/') != std::string::npos || m.ngram_file.find('/') != std::string::npos)
    return error("{}: file names must be plain names", origin);
  return m;
}

bool is_store_dir(const std::string& dir) { return file_exists(join_path(dir, "manifest.json")); }

Result<Manifest> load_manifest(const std::string& store_dir) {
  std::string path = join_path(store_dir, "manifest.json");
  ASSIGN_OR_RETURN(std::string text, read_file(path));
  return parse_manifest(text, path);
}

Result<SourceIdentity> source_identity(const std::string& dir) {
  SourceIdentity id;
  id.dir = dir;
  DIR* d = opendir(dir.c_str());
  if (!d) return error("{}: cannot open directory: {}", dir, std::strerror(errno));
  std::vector<std::string> names;
  while (dirent* e = readdir(d)) {
    std::string n = e->d_name;
    bool st = n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0;
    if (st || n == "config.json" || n == "model.safetensors.index.json") names.push_back(n);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  Status status;
  for (const std::string& n : names) {
    std::string p = join_path(dir, n);
    struct stat sb {};
    if (::stat(p.c_str(), &sb) != 0) { status = error("{}: cannot stat: {}", p, std::strerror(errno)); break; }
    id.files.push_back({n, static_cast<uint64_t>(sb.st_size),
                        static_cast<int64_t>(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec});
    XXH3_64bits_update(h, n.data(), n.size());
    if (n == "config.json") {
      auto text = read_file(p);
      if (!text.ok()) { status = text.status(); break; }
      XXH3_64bits_update(h, text->data(), text->size());
    } else if (n != "model.safetensors.index.json") {
      // The header only (8-byte length + JSON): cheap, and it changes whenever a tensor's place does.
      int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) { status = error("{}: cannot open: {}", p, std::strerror(errno)); break; }
      uint64_t len = 0;
      std::string hdr;
      if (::pread(fd, &len, 8, 0) == 8 && len <= (100u << 20) && len + 8 <= static_cast<uint64_t>(sb.st_size)) {
        hdr.resize(len);
        if (::pread(fd, hdr.data(), len, 8) != static_cast<ssize_t>(len)) hdr.clear();
      }
      ::close(fd);
      XXH3_64bits_update(h, &len, 8);
      XXH3_64bits_update(h, hdr.data(), hdr.size());
    }
  }
  id.headers_xxh3 = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  if (!status.ok()) return status;
  if (id.files.empty()) return error("{}: no config.json or *.safetensors files", dir);
  return id;
}

Status check_manifest_config(const Manifest& m, const ModelConfig& cfg, uint64_t config_xxh3) {
  if (config_xxh3 != m.config_xxh3)
    return error("{}: config.json does not match the store's manifest (XXH3 {} vs {} recorded at pack time); "
                 "the store was packed from a different config: repack it", cfg.path, hex64(config_xxh3),
                 hex64(m.config_xxh3));
  auto mismatch = [&](const char* what, int64_t have, int64_t want) {
    return error("{}: {} is {} but the store's manifest says {}: repack the store", cfg.path, what, have, want);
  };
  if (cfg.num_hidden_layers != m.n_layers) return mismatch("num_hidden_layers", cfg.num_hidden_layers, m.n_layers);
  if (cfg.num_experts != m.n_experts) return mismatch("num_experts", cfg.num_experts, m.n_experts);
  if (cfg.hidden_size != m.hidden) return mismatch("hidden_size", cfg.hidden_size, m.hidden);
  if (cfg.moe_intermediate_size != m.moe_intermediate)
    return mismatch("moe_intermediate_size", cfg.moe_intermediate_size, m.moe_intermediate);
  if (cfg.vocab_size != m.vocab) return mismatch("vocab_size", cfg.vocab_size, m.vocab);
  return {};
}

}  // namespace ck::store
