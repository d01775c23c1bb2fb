// libFuzzer target: Jinja chat template parsing on arbitrary text, then one render with two messages
// (scripts/fuzz.sh runs it). Either step may fail with an error; neither may crash or hang.
#include <cstddef>
#include <cstdint>
#include <string>

#include "text/chat_template.h"
#include "util/json.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  auto t = ck::text::ChatTemplate::parse(text, "fuzz");
  if (!t.ok()) return 0;
  ck::text::ChatTemplateInput in;
  auto msgs = ck::parse_json_ordered(R"([{"role":"system","content":"s"},{"role":"user","content":"hi"}])");
  if (!msgs.ok()) __builtin_trap();
  in.messages = std::move(msgs).value();
  in.add_generation_prompt = true;
  (void)t->render(in);
  return 0;
}
