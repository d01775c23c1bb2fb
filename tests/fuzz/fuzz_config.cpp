// libFuzzer target: config.json parsing and validation on arbitrary text (scripts/fuzz.sh runs it).
#include <cstddef>
#include <cstdint>
#include <string>

#include "format/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  auto r = ck::parse_config(text, "fuzz");
  if (r.ok() && static_cast<int>(r->layer_types.size()) != r->num_hidden_layers) __builtin_trap();
  return 0;
}
