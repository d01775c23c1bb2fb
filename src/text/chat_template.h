// Chat templates: our own interpreter for the subset of Jinja that Qwen-family templates use
// (for/if/set/macro, namespace, loop variables, the common filters and tests, Python string
// methods), rendering like transformers' apply_chat_template (trim_blocks, lstrip_blocks,
// loopcontrols, its tojson). A construct outside the subset is an error naming the template line,
// never a silently different prompt. Checked byte for byte by tests/unit/test_chat_template.cpp.
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "util/json.h"

#include "util/status.h"

namespace ck::text {

struct TemplateProgram;

struct ChatTemplateInput {
  // Ordered documents (parse_json_ordered, JsonBuilder(true)): tool schemas and arguments are
  // rendered with tojson, and transformers keeps their key order (Python dicts).
  JsonDoc messages = JsonDoc::array(true);
  JsonDoc tools = JsonDoc(true);  // null: no tools (the template sees `tools` as none)
  bool add_generation_prompt = false;
  // Unset: the template sees `enable_thinking` as undefined (each template picks its default).
  std::optional<bool> enable_thinking;
  // More template variables (bos_token, eos_token, anything the template reads).
  JsonDoc extra = JsonDoc::object(true);
};

class ChatTemplate {
 public:
  ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;
  ~ChatTemplate();

  // `origin` names the template in error messages ("tokenizer_config.json: chat_template").
  static Result<ChatTemplate> parse(std::string_view source, const std::string& origin = "template");
  Result<std::string> render(const ChatTemplateInput& input) const;

 private:
  std::shared_ptr<const TemplateProgram> program_;
};

// Finds the chat template of a model directory: DIR/chat_template.jinja, else `chat_template`
// in DIR/tokenizer_config.json (a string, or a list of {name, template} where "default" wins).
// Also fills `extra` with bos_token/eos_token (strings or {"content": ...}) from the config.
// `extra` is an object (or null) document; ordered, so its keys keep their order.
Result<ChatTemplate> load_chat_template(const std::string& model_dir, JsonDoc* extra);

}  // namespace ck::text
