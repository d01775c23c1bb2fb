// `cherenkov template`: renders a model's chat template for a conversation and prints the prompt
// exactly (no newline added), as transformers' apply_chat_template(tokenize=False) would. The
// template and the bos/eos token strings come from the model directory (see load_chat_template).
#include <CLI/CLI.hpp>

#include <cstdio>

#include "cli/command.h"
#include "text/chat_template.h"
#include "util/file.h"
#include "util/json.h"

namespace {

// Reads a JSON file (keys in file order); on failure prints one error line naming the file and
// returns false.
bool read_json(const std::string& path, ck::JsonDoc& out) {
  auto text = ck::read_file(path);
  if (!text.ok()) {
    std::fprintf(stderr, "error: %s\n", text.status().message().c_str());
    return false;
  }
  auto parsed = ck::parse_json_ordered(*text);
  if (!parsed.ok()) {
    std::fprintf(stderr, "error: %s: malformed JSON: %s\n", path.c_str(), parsed.status().message().c_str());
    return false;
  }
  out = std::move(*parsed);
  return true;
}

int run_template(int argc, char** argv) {
  CLI::App app{"Render a model's chat template for a conversation (prints the prompt exactly)"};
  std::string model_dir, messages_path, tools_path, vars_path, thinking;
  bool add_generation_prompt = false;
  app.add_option("--model", model_dir, "model directory (chat_template.jinja or tokenizer_config.json)")->required();
  app.add_option("--messages", messages_path, "JSON file: the list of messages")->required();
  app.add_option("--tools", tools_path, "JSON file: the list of tool definitions");
  app.add_option("--vars", vars_path, "JSON file: an object of extra template variables");
  app.add_flag("--add-generation-prompt", add_generation_prompt, "end with the assistant turn header");
  app.add_option("--enable-thinking", thinking, "true|false (unset: the template's default)")
      ->check(CLI::IsMember({"true", "false"}));
  CLI11_PARSE(app, argc, argv);

  ck::text::ChatTemplateInput in;
  auto tmpl = ck::text::load_chat_template(model_dir, &in.extra);
  if (!tmpl.ok()) {
    std::fprintf(stderr, "error: %s\n", tmpl.status().message().c_str());
    return 1;
  }
  if (!read_json(messages_path, in.messages)) return 1;
  if (!in.messages.is_array()) {
    std::fprintf(stderr, "error: %s: expected a JSON array of messages\n", messages_path.c_str());
    return 1;
  }
  if (!tools_path.empty()) {
    if (!read_json(tools_path, in.tools)) return 1;
    if (!in.tools.is_array()) {
      std::fprintf(stderr, "error: %s: expected a JSON array of tools\n", tools_path.c_str());
      return 1;
    }
  }
  if (!vars_path.empty()) {
    ck::JsonDoc vars;
    if (!read_json(vars_path, vars)) return 1;
    if (!vars.is_object()) {
      std::fprintf(stderr, "error: %s: expected a JSON object of variables\n", vars_path.c_str());
      return 1;
    }
    for (const auto& [key, value] : vars.members()) in.extra.set(key, value);
  }
  in.add_generation_prompt = add_generation_prompt;
  if (!thinking.empty()) in.enable_thinking = thinking == "true";

  auto prompt = tmpl->render(in);
  if (!prompt.ok()) {
    std::fprintf(stderr, "error: %s\n", prompt.status().message().c_str());
    return 1;
  }
  std::fwrite(prompt->data(), 1, prompt->size(), stdout);
  return 0;
}

ck::cli::Registrar register_template("template", "render a model's chat template for a conversation", run_template);

}  // namespace
