// Files: read-only memory maps, whole-file reads, and atomic writes (temporary name, then rename,
// so a crash never leaves a half-written file under the real name).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "util/status.h"

namespace ck {

class MappedFile {
 public:
  MappedFile() = default;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& o) noexcept { *this = std::move(o); }
  MappedFile& operator=(MappedFile&& o) noexcept;
  ~MappedFile();

  static Result<MappedFile> open(const std::string& path);
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

Result<std::string> read_file(const std::string& path);
// Writes to PATH.tmp.<pid>, fsyncs, then renames over PATH.
Status write_file_atomic(const std::string& path, std::string_view bytes);
bool file_exists(const std::string& path);
bool is_directory(const std::string& path);
std::string join_path(const std::string& dir, const std::string& name);

}  // namespace ck
