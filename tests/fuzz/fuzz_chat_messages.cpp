// libFuzzer target: the released model's chat template (tests/fixtures/templates/qwen3_5.jinja)
// rendered over arbitrary conversations: the input is JSON, {"messages": [...], "tools": ...} or a
// bare message array (scripts/fuzz.sh runs it). A render is an error or text; never a crash or hang.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "text/chat_template.h"
#include "util/file.h"
#include "util/json.h"

namespace {
const ck::text::ChatTemplate& released_template() {
  static const ck::text::ChatTemplate t = [] {
    auto src = ck::read_file(CK_FUZZ_TEMPLATE);
    if (!src.ok()) { std::fprintf(stderr, "%s\n", src.status().message().c_str()); __builtin_trap(); }
    auto p = ck::text::ChatTemplate::parse(*src, CK_FUZZ_TEMPLATE);
    if (!p.ok()) { std::fprintf(stderr, "%s\n", p.status().message().c_str()); __builtin_trap(); }
    return std::move(p).value();
  }();
  return t;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto doc = ck::parse_json_ordered(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!doc.ok()) return 0;
  ck::text::ChatTemplateInput in;
  const ck::JsonDoc& root = *doc;
  // A sub-value as a document of its own (the input's text round trip; ordered, as the CLI's).
  auto own = [](ck::JsonRef v) { return ck::parse_json_ordered(v.dump()); };
  if (root.is_object()) {
    if (!root.contains("messages")) return 0;
    auto m = own(root["messages"]);
    if (!m.ok()) __builtin_trap();
    in.messages = std::move(m).value();
    if (root.contains("tools")) {
      auto t = own(root["tools"]);
      if (!t.ok()) __builtin_trap();
      in.tools = std::move(t).value();
    }
    if (root.contains("enable_thinking") && root["enable_thinking"].is_bool())
      in.enable_thinking = root["enable_thinking"].as_bool();
  } else {
    in.messages = std::move(doc).value();
  }
  in.add_generation_prompt = size % 2 == 0;
  (void)released_template().render(in);
  return 0;
}
