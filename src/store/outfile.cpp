// OutFile and the disk-space check; see outfile.h. Writes go through the page cache (pwrite,
// pwritev); durability comes from fdatasync before the rename, not from O_DIRECT.
#include "store/outfile.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "store/progress.h"

namespace ck::store {

OutFile& OutFile::operator=(OutFile&& o) noexcept {
  if (this != &o) {
    this->~OutFile();
    path_ = std::move(o.path_);
    tmp_ = std::move(o.tmp_);
    fd_ = o.fd_;
    committed_ = o.committed_;
    o.fd_ = -1;
    o.committed_ = true;
  }
  return *this;
}

OutFile::~OutFile() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!committed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
  committed_ = true;
}

Result<OutFile> OutFile::create(const std::string& path, uint64_t size) {
  OutFile f;
  f.path_ = path;
  f.tmp_ = path + ".tmp";
  f.fd_ = ::open(f.tmp_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f.fd_ < 0) return error("{}: cannot create: {}", f.tmp_, std::strerror(errno));
  // Reserve the blocks now so that a full disk fails here, not hours in (ENOSPC on a later write).
  if (size > 0) {
    // fallocate(2), not posix_fallocate: glibc's fallback for filesystems without it writes every block.
    int rc = ::fallocate(f.fd_, 0, 0, static_cast<off_t>(size)) ? errno : 0;
    if (rc == EOPNOTSUPP || rc == ENOSYS) rc = ::ftruncate(f.fd_, static_cast<off_t>(size)) ? errno : 0;
    if (rc != 0) return error("{}: cannot reserve {} bytes: {}", f.tmp_, size, std::strerror(rc));
  }
  return f;
}

Status OutFile::write_at(const void* data, size_t n, uint64_t offset) const {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return error("{}: write of {} bytes at offset {} failed: {}", tmp_, n, offset, std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return {};
}

Status OutFile::write_pieces_at(const std::vector<Piece>& pieces, uint64_t offset) const {
  std::vector<iovec> iov;
  uint64_t total = 0;
  for (const Piece& p : pieces) {
    if (!p.n) continue;
    iov.push_back({const_cast<void*>(p.data), p.n});
    total += p.n;
  }
  size_t first = 0;
  while (first < iov.size()) {
    int cnt = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    ssize_t w = ::pwritev(fd_, iov.data() + first, cnt, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return error("{}: write of {} bytes at offset {} failed: {}", tmp_, total, offset, std::strerror(errno));
    }
    offset += static_cast<uint64_t>(w);
    // Skip the pieces written; a partial piece keeps its tail.
    size_t left = static_cast<size_t>(w);
    while (first < iov.size() && left >= iov[first].iov_len) left -= iov[first++].iov_len;
    if (first < iov.size()) {
      iov[first].iov_base = static_cast<uint8_t*>(iov[first].iov_base) + left;
      iov[first].iov_len -= left;
    }
  }
  return {};
}

Status OutFile::commit(bool sync) {
  if (sync && ::fdatasync(fd_) != 0) return error("{}: fdatasync failed: {}", tmp_, std::strerror(errno));
  if (::close(fd_) != 0) {
    fd_ = -1;
    return error("{}: close failed: {}", tmp_, std::strerror(errno));
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    return error("{}: cannot rename into place: {}", path_, std::strerror(errno));
  committed_ = true;
  return {};
}

Status check_free_space(const std::string& dir, uint64_t need, const std::string& what) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return error("{}: statvfs failed: {}", dir, std::strerror(errno));
  uint64_t avail = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  if (avail < need)
    return error("{}: not enough free disk space for {}: need {} ({} bytes), {} available", dir, what,
                 format_bytes(need), need, format_bytes(avail));
  return {};
}

Status make_dirs(const std::string& dir) {
  if (dir.empty()) return {};
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    cur = dir.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST)
      return error("{}: cannot create directory: {}", cur, std::strerror(errno));
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return error("{}: not a directory", dir);
  return {};
}

}  // namespace ck::store
