// Safetensors reader. Format: u64 little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data region.
#include "format/safetensors.h"

#include <dirent.h>

#include <algorithm>
#include <cstring>

#include "util/json.h"

namespace ck {


namespace {
struct DTypeRow { DType t; const char* name; size_t size; };
constexpr DTypeRow kDTypes[] = {
    {DType::F32, "F32", 4},  {DType::F16, "F16", 2},   {DType::BF16, "BF16", 2}, {DType::F64, "F64", 8},
    {DType::I64, "I64", 8},  {DType::I32, "I32", 4},   {DType::I16, "I16", 2},   {DType::I8, "I8", 1},
    {DType::U8, "U8", 1},    {DType::U32, "U32", 4},   {DType::U64, "U64", 8},   {DType::BOOL, "BOOL", 1},
    {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
};
}  // namespace

const char* dtype_name(DType t) {
  for (auto& r : kDTypes) if (r.t == t) return r.name;
  return "?";
}
size_t dtype_size(DType t) {
  for (auto& r : kDTypes) if (r.t == t) return r.size;
  return 0;
}
bool parse_dtype(const std::string& s, DType* out) {
  for (auto& r : kDTypes) if (s == r.name) { *out = r.t; return true; }
  return false;
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Status parse_safetensors_header(const uint8_t* file_data, size_t file_size, const std::string& origin,
                                std::map<std::string, TensorInfo>* out) {
  if (file_size < 8) return error("{}: truncated safetensors file ({} bytes, need at least 8)", origin, file_size);
  uint64_t header_len;
  std::memcpy(&header_len, file_data, 8);
  if (header_len > file_size - 8)
    return error("{}: header length {} points past the end of the file ({} bytes)", origin, header_len, file_size);
  if (header_len > (100u << 20)) return error("{}: header length {} exceeds 100 MB", origin, header_len);
  const uint8_t* data = file_data + 8 + header_len;
  size_t data_size = file_size - 8 - header_len;
  Result<JsonDoc> parsed = parse_json({reinterpret_cast<const char*>(file_data) + 8, static_cast<size_t>(header_len)});
  if (!parsed.ok()) return error("{}: corrupt safetensors header (invalid JSON: {})", origin, parsed.status().message());
  const JsonDoc& h = *parsed;
  if (!h.is_object()) return error("{}: safetensors header is not a JSON object", origin);
  std::vector<std::pair<size_t, size_t>> ranges;
  for (const auto& [name, v] : h.members()) {
    if (name == "__metadata__") continue;
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets"))
      return error("{}: tensor '{}': header entry needs dtype, shape and data_offsets", origin, name);
    TensorInfo t;
    t.name = name;
    t.file = origin;
    if (!v["dtype"].is_string() || !parse_dtype(v["dtype"].as_string(), &t.dtype))
      return error("{}: tensor '{}': unknown dtype {}", origin, name, v["dtype"].dump());
    if (!v["shape"].is_array()) return error("{}: tensor '{}': shape is not a list", origin, name);
    unsigned __int128 numel = 1;
    for (JsonRef d : v["shape"].elements()) {
      if (!d.is_unsigned()) return error("{}: tensor '{}': shape has a non-integer or negative entry", origin, name);
      t.shape.push_back(d.as_int());
      numel *= static_cast<uint64_t>(t.shape.back());
      if (numel > (static_cast<unsigned __int128>(1) << 62)) return error("{}: tensor '{}': shape too large", origin, name);
    }
    JsonRef off = v["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_unsigned() || !off[1].is_unsigned())
      return error("{}: tensor '{}': data_offsets must be two non-negative integers", origin, name);
    uint64_t begin = off[0].as_uint(), end = off[1].as_uint();
    if (begin > end) return error("{}: tensor '{}': data_offsets [{}, {}] are reversed", origin, name, begin, end);
    if (end > data_size)
      return error("{}: tensor '{}': data_offsets [{}, {}] point past the end of the data ({} bytes; file truncated?)",
                   origin, name, begin, end, data_size);
    uint64_t expect = static_cast<uint64_t>(numel) * dtype_size(t.dtype);
    if (end - begin != expect)
      return error("{}: tensor '{}': {} {} needs {} bytes but data_offsets span {}", origin, name,
                   dtype_name(t.dtype), t.shape_str(), expect, end - begin);
    t.data = data + begin;
    t.nbytes = end - begin;
    if (t.nbytes) ranges.emplace_back(begin, end);
    (*out)[name] = std::move(t);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second)
      return error("{}: tensors overlap in the data region at byte {}", origin, ranges[i].first);
  return {};
}

Result<TensorSet> TensorSet::open_files(const std::vector<std::string>& files) {
  TensorSet set;
  for (const std::string& f : files) {
    ASSIGN_OR_RETURN(MappedFile m, MappedFile::open(f));
    auto owned = std::make_unique<MappedFile>(std::move(m));
    std::map<std::string, TensorInfo> tensors;
    TRY(parse_safetensors_header(owned->data(), owned->size(), f, &tensors));
    for (auto& [name, t] : tensors) {
      if (set.tensors_.count(name))
        return error("{}: tensor '{}' also appears in {}", f, name, set.tensors_[name].file);
      set.tensors_[name] = std::move(t);
    }
    set.files_.push_back(std::move(owned));
    set.origin_ += (set.origin_.empty() ? "" : ", ") + f;
  }
  return set;
}

Result<TensorSet> TensorSet::open_dir(const std::string& dir) {
  std::string index = join_path(dir, "model.safetensors.index.json");
  std::vector<std::string> files;
  if (file_exists(index)) {
    ASSIGN_OR_RETURN(std::string text, read_file(index));
    Result<JsonDoc> parsed = parse_json(text);
    if (!parsed.ok()) return error("{}: invalid JSON: {}", index, parsed.status().message());
    const JsonDoc& j = *parsed;
    if (!j["weight_map"].is_object()) return error("{}: missing 'weight_map' object", index);
    const std::vector<JsonMember> weight_map = j["weight_map"].members();
    std::vector<std::string> names;
    for (const auto& [tensor, file] : weight_map) {
      if (!file.is_string()) return error("{}: weight_map['{}'] is not a file name", index, tensor);
      const std::string& f = file.as_string();
      if (f.find('/') != std::string::npos || f.find("..") != std::string::npos)
        return error("{}: weight_map['{}'] names a file outside the directory: {}", index, tensor, f);
      if (std::find(names.begin(), names.end(), f) == names.end()) names.push_back(f);
    }
    std::sort(names.begin(), names.end());
    for (auto& n : names) {
      std::string p = join_path(dir, n);
      if (!file_exists(p)) return error("{}: shard '{}' listed in the index does not exist", index, p);
      files.push_back(p);
    }
    ASSIGN_OR_RETURN(TensorSet set, open_files(files));
    for (const auto& [tensor, file] : weight_map) {
      const TensorInfo* t = set.find(tensor);
      if (!t) return error("{}: tensor '{}' is listed in the index but missing from {}", index, tensor, file.as_string());
    }
    set.origin_ = dir;
    return set;
  }
  std::string single = join_path(dir, "model.safetensors");
  if (file_exists(single)) {
    files.push_back(single);
  } else {
    DIR* d = opendir(dir.c_str());
    if (!d) return error("{}: cannot open model directory", dir);
    while (dirent* e = readdir(d)) {
      std::string n = e->d_name;
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) files.push_back(join_path(dir, n));
    }
    closedir(d);
    std::sort(files.begin(), files.end());
    if (files.empty()) return error("{}: no model.safetensors, index or *.safetensors files", dir);
  }
  ASSIGN_OR_RETURN(TensorSet set, open_files(files));
  set.origin_ = dir;
  return set;
}

TensorSet TensorSet::from_tensors(std::vector<std::unique_ptr<MappedFile>> files,
                                  std::map<std::string, TensorInfo> tensors, std::string origin) {
  TensorSet set;
  set.files_ = std::move(files);
  set.tensors_ = std::move(tensors);
  set.origin_ = std::move(origin);
  return set;
}

const TensorInfo* TensorSet::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

}  // namespace ck
