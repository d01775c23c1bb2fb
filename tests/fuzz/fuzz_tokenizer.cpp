// libFuzzer target: tokenizer.json loading on arbitrary text, then encode and decode of a fixed
// string with whatever loaded (scripts/fuzz.sh runs it). A load is an error or a usable tokenizer.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "text/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  auto t = ck::text::Tokenizer::from_json(text, "fuzz");
  if (!t.ok()) return 0;
  const std::vector<int32_t> ids = t->encode("Hello, world! <|im_start|>  x\xff\n12345 caf\xc3\xa9");
  for (int32_t id : ids)
    if (id < 0 || id >= t->vocab_size()) __builtin_trap();
  (void)t->decode(ids);
  return 0;
}
