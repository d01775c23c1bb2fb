// libFuzzer target: the safetensors header parser on arbitrary bytes (scripts/fuzz.sh runs it).
#include <cstddef>
#include <cstdint>
#include <map>

#include "format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, ck::TensorInfo> tensors;
  ck::Status s = ck::parse_safetensors_header(data, size, "fuzz", &tensors);
  if (s.ok())
    for (auto& [name, t] : tensors) {
      // Every accepted tensor must lie inside the input.
      if (t.nbytes && (t.data < data || t.data + t.nbytes > data + size)) __builtin_trap();
    }
  return 0;
}
