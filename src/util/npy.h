// NumPy .npy files (format version 1.0): float32 and int64 arrays, C order. Used by
// `generate --logits-out` and by the tests that read oracle fixtures.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "util/status.h"

namespace ck {

struct NpyArray {
  std::string dtype;            // "<f4", "<i8", "<i4"
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;   // raw little-endian elements
  int64_t numel() const;
  std::vector<float> as_f32() const;    // converts <f4/<f8/<f2 to float
  std::vector<int64_t> as_i64() const;  // converts <i8/<i4 to int64
};

Result<NpyArray> read_npy(const std::string& path);
Status write_npy_f32(const std::string& path, const float* data, const std::vector<int64_t>& shape);

}  // namespace ck
