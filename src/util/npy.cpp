#include "util/npy.h"

#include <cstring>

#include "util/file.h"
#include "util/half.h"

namespace ck {

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<float> NpyArray::as_f32() const {
  std::vector<float> out(static_cast<size_t>(numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype == "<f4") std::memcpy(&out[i], bytes.data() + 4 * i, 4);
    else if (dtype == "<f8") { double d; std::memcpy(&d, bytes.data() + 8 * i, 8); out[i] = static_cast<float>(d); }
    else if (dtype == "<f2") { uint16_t h; std::memcpy(&h, bytes.data() + 2 * i, 2); out[i] = f16_to_f32(h); }
  }
  return out;
}

std::vector<int64_t> NpyArray::as_i64() const {
  std::vector<int64_t> out(static_cast<size_t>(numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (dtype == "<i8") std::memcpy(&out[i], bytes.data() + 8 * i, 8);
    else if (dtype == "<i4") { int32_t v; std::memcpy(&v, bytes.data() + 4 * i, 4); out[i] = v; }
  }
  return out;
}

Result<NpyArray> read_npy(const std::string& path) {
  ASSIGN_OR_RETURN(std::string raw, read_file(path));
  if (raw.size() < 10 || raw.compare(0, 6, "\x93NUMPY") != 0) return error("{}: not a .npy file", path);
  uint8_t major = static_cast<uint8_t>(raw[6]);
  size_t header_len, header_start;
  if (major == 1) {
    header_len = static_cast<uint8_t>(raw[8]) | (static_cast<uint8_t>(raw[9]) << 8);
    header_start = 10;
  } else {
    if (raw.size() < 12) return error("{}: truncated .npy header", path);
    uint32_t hl;
    std::memcpy(&hl, raw.data() + 8, 4);
    header_len = hl;
    header_start = 12;
  }
  if (header_start + header_len > raw.size()) return error("{}: truncated .npy header", path);
  std::string header = raw.substr(header_start, header_len);
  NpyArray a;
  auto descr = header.find("'descr':");
  auto q1 = header.find('\'', descr + 8);
  auto q2 = header.find('\'', q1 + 1);
  if (descr == std::string::npos || q1 == std::string::npos || q2 == std::string::npos)
    return error("{}: .npy header has no descr", path);
  a.dtype = header.substr(q1 + 1, q2 - q1 - 1);
  if (header.find("'fortran_order': True") != std::string::npos) return error("{}: Fortran order unsupported", path);
  auto sh = header.find("'shape':");
  auto p1 = header.find('(', sh), p2 = header.find(')', p1);
  if (sh == std::string::npos || p1 == std::string::npos || p2 == std::string::npos)
    return error("{}: .npy header has no shape", path);
  std::string dims = header.substr(p1 + 1, p2 - p1 - 1);
  size_t pos = 0;
  while (pos < dims.size()) {
    while (pos < dims.size() && (dims[pos] == ' ' || dims[pos] == ',')) ++pos;
    if (pos >= dims.size()) break;
    size_t end = pos;
    while (end < dims.size() && dims[end] >= '0' && dims[end] <= '9') ++end;
    if (end == pos) return error("{}: bad shape in .npy header", path);
    a.shape.push_back(std::stoll(dims.substr(pos, end - pos)));
    pos = end;
  }
  size_t elem = 0;
  if (a.dtype == "<f4" || a.dtype == "<i4") elem = 4;
  else if (a.dtype == "<f8" || a.dtype == "<i8") elem = 8;
  else if (a.dtype == "<f2") elem = 2;
  else return error("{}: unsupported .npy dtype {}", path, a.dtype);
  size_t data_start = header_start + header_len;
  size_t need = static_cast<size_t>(a.numel()) * elem;
  if (raw.size() - data_start < need) return error("{}: .npy data truncated ({} of {} bytes)", path, raw.size() - data_start, need);
  a.bytes.assign(raw.begin() + static_cast<long>(data_start), raw.begin() + static_cast<long>(data_start + need));
  return a;
}

Status write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape) {
  std::string dims;
  int64_t n = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    dims += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dims += ", ";
    n *= shape[i];
  }
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>((header.size() >> 8) & 0xff);
  out += header;
  out.append(reinterpret_cast<const char*>(data), static_cast<size_t>(n) * 4);
  return write_file_atomic(path, out);
}

}  // namespace ck
