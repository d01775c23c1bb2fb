// libFuzzer target: a store's manifest.json parsing on arbitrary text (scripts/fuzz.sh runs it); what
// parses must serialize again.
#include <cstddef>
#include <cstdint>
#include <string>

#include "store/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  auto m = ck::store::parse_manifest(text, "fuzz");
  if (m.ok()) (void)ck::store::manifest_to_json(*m);
  return 0;
}
