// Big output files written in place by many threads (pwrite at known offsets) under a temporary
// name, renamed to the real name only by commit(): a crash or a kill leaves only `NAME.tmp`, never a
// half-written file under the real name. Also the free-space check done before a long write.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "util/status.h"

namespace ck::store {

class OutFile {
 public:
  OutFile() = default;
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;
  OutFile(OutFile&& o) noexcept { *this = std::move(o); }
  OutFile& operator=(OutFile&& o) noexcept;
  ~OutFile();  // unlinks the temporary file unless committed

  // Creates PATH.tmp (truncating a leftover one) with `size` bytes reserved.
  static Result<OutFile> create(const std::string& path, uint64_t size);
  // Thread-safe positional write of all n bytes.
  Status write_at(const void* data, size_t n, uint64_t offset) const;
  // The same for pieces written back to back from `offset` (a record gathered without a copy).
  struct Piece { const void* data; size_t n; };
  Status write_pieces_at(const std::vector<Piece>& pieces, uint64_t offset) const;
  // fdatasync (when `sync`), close, rename PATH.tmp -> PATH.
  Status commit(bool sync);
  const std::string& path() const { return path_; }
  int fd() const { return fd_; }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Fails with the numbers when the filesystem holding `dir` has fewer than `need` bytes free.
Status check_free_space(const std::string& dir, uint64_t need, const std::string& what);

// Creates `dir` (and parents) when missing.
Status make_dirs(const std::string& dir);

}  // namespace ck::store
