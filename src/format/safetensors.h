// Safetensors files through mmap: one file, or a sharded set behind model.safetensors.index.json.
// The header is checked against the file before any tensor is touched: size bounds, known dtypes,
// shape x dtype == byte length, offsets inside the data region, no overlaps.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "util/file.h"
#include "util/status.h"

namespace ck {

enum class DType { F32, F16, BF16, F64, I64, I32, I16, I8, U8, U32, U64, BOOL, F8_E4M3, F8_E5M2 };

const char* dtype_name(DType t);
size_t dtype_size(DType t);
bool parse_dtype(const std::string& s, DType* out);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // points into the mapped file
  size_t nbytes = 0;
  std::string file;               // the file it lives in (for error messages)
  int64_t numel() const;
  std::string shape_str() const;  // "[2, 3]"
};

// Parses a safetensors header held in memory (the fuzz target calls this directly).
// `data_region` is the bytes after the header; tensor pointers are set into it.
Status parse_safetensors_header(const uint8_t* file_data, size_t file_size, const std::string& origin,
                                std::map<std::string, TensorInfo>* out);

// All tensors of a checkpoint directory (single or sharded), memory-mapped.
class TensorSet {
 public:
  // `dir` holds model.safetensors or model.safetensors.index.json (or any *.safetensors files).
  static Result<TensorSet> open_dir(const std::string& dir);
  static Result<TensorSet> open_files(const std::vector<std::string>& files);
  // Tensors described elsewhere (a store's manifest) over files mapped by the caller: the set keeps
  // `files` alive; every TensorInfo must point into one of them. `origin` names the set in errors.
  static TensorSet from_tensors(std::vector<std::unique_ptr<MappedFile>> files,
                                std::map<std::string, TensorInfo> tensors, std::string origin);

  const TensorInfo* find(const std::string& name) const;
  const std::map<std::string, TensorInfo>& all() const { return tensors_; }
  const std::string& origin() const { return origin_; }

 private:
  std::vector<std::unique_ptr<MappedFile>> files_;
  std::map<std::string, TensorInfo> tensors_;
  std::string origin_;
};

}  // namespace ck
