// Chat template tests: every case of tests/fixtures/templates/cases.jsonl (rendered by
// transformers' apply_chat_template; written by tools/make_template_fixtures.py) must render
// byte for byte, or fail where transformers fails. Plus malformed templates: each must give an
// error naming the line, never a crash. A mismatch report lists every failing case.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <random>
#include <nlohmann/json.hpp>
#include <string>

#include "text/chat_template.h"
#include "util/file.h"
#include "util/json.h"

using ck::text::ChatTemplate;
using ck::text::ChatTemplateInput;
using ojson = nlohmann::ordered_json;

namespace {

// The fixture's value as the template input's document type.
ck::JsonDoc doc(const ojson& j) { return ck::parse_json_ordered(j.dump()).value(); }

const std::string kSrc = CK_SOURCE_DIR;

std::string show_diff(const std::string& want, const std::string& got) {
  size_t k = 0;
  while (k < want.size() && k < got.size() && want[k] == got[k]) ++k;
  size_t from = k > 40 ? k - 40 : 0;
  return fmt::format("first difference at byte {} (want {} bytes, got {})\n    want: {}\n    got:  {}", k, want.size(),
                     got.size(), ojson(want.substr(from, 100)).dump(), ojson(got.substr(from, 100)).dump());
}

std::string render_error(const ChatTemplate& t, const std::string& source = "") {
  ChatTemplateInput in;
  in.messages = doc(ojson::parse(R"([{"role": "user", "content": "hi"}])"));
  auto r = t.render(in);
  return r.ok() ? "(rendered: " + *r + ")" : r.status().message();
}

std::string parse_error(const std::string& source) {
  auto t = ChatTemplate::parse(source, "bad.jinja");
  if (!t.ok()) return t.status().message();
  return render_error(*t);
}

}  // namespace

TEST(ChatTemplate, MatchesTransformersOnEveryFixtureCase) {
  std::map<std::string, ChatTemplate> templates;
  {
    ck::JsonDoc extra;
    auto qwen3 = ck::text::load_chat_template(kSrc + "/tests/fixtures/tokenizer/qwen3", &extra);
    ASSERT_TRUE(qwen3.ok()) << qwen3.status().message();
    EXPECT_EQ(extra["eos_token"].dump(), "\"<|im_end|>\"");
    templates.emplace("qwen3", std::move(qwen3).value());
    for (const char* name : {"qwen3_5", "qwen2_5"}) {
      std::string path = kSrc + "/tests/fixtures/templates/" + name + ".jinja";
      auto text = ck::read_file(path);
      ASSERT_TRUE(text.ok()) << text.status().message();
      auto t = ChatTemplate::parse(*text, path);
      ASSERT_TRUE(t.ok()) << t.status().message();
      templates.emplace(name, std::move(t).value());
    }
  }
  std::ifstream in(kSrc + "/tests/fixtures/templates/cases.jsonl");
  ASSERT_TRUE(in) << "missing tests/fixtures/templates/cases.jsonl";
  std::string line;
  std::vector<std::string> failures;
  size_t n_cases = 0, n_conversations = 0;
  while (std::getline(in, line)) {
    ojson c = ojson::parse(line);
    ++n_cases;
    std::string tag = fmt::format("{} / {} (agp={}, enable_thinking={})", c["template"].get<std::string>(),
                                  c["name"].get<std::string>(), c["add_generation_prompt"].dump(), c["enable_thinking"].dump());
    const ChatTemplate* t;
    ChatTemplate inline_template;
    if (c["template"] == "inline") {
      auto parsed = ChatTemplate::parse(c["source"].get<std::string>(), c["name"].get<std::string>());
      if (!parsed.ok()) {
        if (!c.contains("error")) failures.push_back(tag + ": parse failed: " + parsed.status().message());
        continue;
      }
      inline_template = std::move(parsed).value();
      t = &inline_template;
    } else {
      ++n_conversations;
      t = &templates.at(c["template"].get<std::string>());
    }
    ChatTemplateInput input;
    input.messages = doc(c["messages"]);
    input.tools = doc(c["tools"]);
    input.add_generation_prompt = c["add_generation_prompt"].get<bool>();
    if (!c["enable_thinking"].is_null()) input.enable_thinking = c["enable_thinking"].get<bool>();
    input.extra = doc(c["extra"]);
    auto r = t->render(input);
    if (c.contains("error")) {
      if (r.ok()) failures.push_back(fmt::format("{}: transformers raised ({}) but we rendered", tag, c["error"].get<std::string>()));
      continue;
    }
    const std::string want = c["expected"].get<std::string>();
    if (!r.ok()) {
      failures.push_back(fmt::format("{}: render failed: {}", tag, r.status().message()));
    } else if (*r != want) {
      failures.push_back(fmt::format("{}: {}", tag, show_diff(want, *r)));
    }
  }
  EXPECT_GE(n_conversations, 20u * 2);
  if (!failures.empty()) {
    std::string all;
    for (auto& f : failures) all += "  " + f + "\n";
    ADD_FAILURE() << failures.size() << " mismatches over " << n_cases << " cases:\n" << all;
  }
}

TEST(ChatTemplate, MalformedTemplatesGiveLineErrors) {
  struct Case {
    const char* source;
    const char* expect;  // substring of the error
  };
  const Case cases[] = {
      {"line1\n{% if x %}\nno end", "bad.jinja: line 2: {% if %} is never closed"},
      {"{% for x in y %}{% endif %}", "unexpected {% endif %}"},
      {"a\nb\n{% include 'other.jinja' %}", "line 3: unsupported tag {% include %}"},
      {"{% extends 'base' %}", "unsupported tag {% extends %}"},
      {"{{ x | wordwrap }}", "line 1: unknown or unsupported filter 'wordwrap'"},
      {"\n\n{{ 1 is frobnicated }}", "line 3: unknown test 'frobnicated'"},
      {"{{ 1 + }}", "line 1: unexpected end of expression"},
      {"{{ 'unterminated }}", "unterminated string literal"},
      {"{{ x ", "unclosed tag"},
      {"{# never closed", "unclosed comment"},
      {"{% set %}", "expected a name"},
      {"{% for in x %}{% endfor %}", "expected 'in' in for loop"},
      {"{% endfor %}", "unexpected {% endfor %}"},
      {"{{ raise_exception('boom: bad input') }}", "raise_exception: boom: bad input"},
      {"x\n{{ foo.bar }}", "line 2: 'foo' is undefined"},
      {"{{ 'a' + 1 }}", "unsupported operand types for +: string and int"},
      {"{{ 1 // 0 }}", "division or modulo by zero"},
      {"{{ messages.nope() }}", "is not callable"},
      {"{% set ns = 3 %}{% set ns.a = 1 %}", "cannot assign attribute on non-namespace object 'ns'"},
      {"{{ 'x'.zfill(3) }}", "is not callable"},
      {"{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", "macro 'm' takes 1 arguments, 2 given"},
      {"{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", "macro recursion too deep"},
      {"{{ [1] | tojson(indent='x') }}", "string indents are not supported"},
      {"{{ undefined_x | tojson }}", "not JSON serializable"},
      {"{{ 1 < 'a' }}", "cannot compare int with string"},
      {"{% for x in 5 %}{% endfor %}", "'int' object is not iterable"},
      {"{{ 'a' @ 2 }}", "unexpected character '@'"},
  };
  for (const Case& c : cases) {
    std::string err = parse_error(c.source);
    EXPECT_NE(err.find(c.expect), std::string::npos) << "template: " << c.source << "\n  error: " << err;
  }
  auto not_utf8 = ChatTemplate::parse("\xff\xfe", "bin.jinja");
  ASSERT_FALSE(not_utf8.ok());
  EXPECT_NE(not_utf8.status().message().find("not valid UTF-8"), std::string::npos);
}

TEST(ChatTemplate, InputValidationAndLoading) {
  auto t = ChatTemplate::parse("{{ messages | length }}");
  ASSERT_TRUE(t.ok());
  ChatTemplateInput in;
  in.messages = ck::JsonDoc::object(true);
  EXPECT_FALSE(t->render(in).ok());
  in.messages = ck::JsonDoc::array(true);
  in.tools = doc("not a list");
  EXPECT_FALSE(t->render(in).ok());

  auto missing = ck::text::load_chat_template("/nonexistent/model", nullptr);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/model"), std::string::npos);

  // A config whose chat_template is a list: the "default" entry wins.
  std::string dir = std::string(CK_BINARY_DIR) + "/test_chat_template_dir";
  std::string cmd = "mkdir -p " + dir;
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  ASSERT_TRUE(ck::write_file_atomic(dir + "/tokenizer_config.json",
                                    R"({"eos_token": {"content": "</s>"}, "chat_template": [
                                        {"name": "tool_use", "template": "tools"},
                                        {"name": "default", "template": "{{ eos_token }}|{{ messages[0].content }}"}]})")
                  .ok());
  ck::JsonDoc extra;
  auto listed = ck::text::load_chat_template(dir, &extra);
  ASSERT_TRUE(listed.ok()) << listed.status().message();
  ChatTemplateInput in2;
  in2.messages = doc(ojson::parse(R"([{"role": "user", "content": "hey"}])"));
  in2.extra = extra;
  auto r = listed->render(in2);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(*r, "</s>|hey");

  ASSERT_TRUE(ck::write_file_atomic(dir + "/tokenizer_config.json", "{\"chat_template\": 42}").ok());
  auto bad = ck::text::load_chat_template(dir, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("expected a string or a list"), std::string::npos);

  ASSERT_TRUE(ck::write_file_atomic(dir + "/tokenizer_config.json", "{not json").ok());
  bad = ck::text::load_chat_template(dir, nullptr);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("malformed JSON"), std::string::npos);
}

// Randomly damaged copies of the Qwen3 template, and pathological ones: each must parse and
// render to a result or an error, never crash or hang. (A crash here fails the whole binary.)
TEST(ChatTemplate, DamagedTemplatesNeverCrash) {
  std::string config = *ck::read_file(kSrc + "/tests/fixtures/tokenizer/qwen3/tokenizer_config.json");
  std::string source = ojson::parse(config)["chat_template"].get<std::string>();
  ChatTemplateInput in;
  in.messages = doc(ojson::parse(R"([{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "<think>\nr\n</think>\n\nok", "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, 2]}}}]},
      {"role": "tool", "content": "res"}])"));
  in.tools = doc(ojson::parse(R"([{"type": "function", "function": {"name": "f"}}])"));
  in.add_generation_prompt = true;
  std::mt19937 rng(1234);
  const std::string alphabet = "{}%#-+()[]'\".|~ \n\tabcdefgiflnorstu0123456789=!<>,:*/";
  size_t n_ok = 0, n_err = 0;
  for (int k = 0; k < 1500; ++k) {
    std::string s = source;
    int n_edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < n_edits; ++e) {
      size_t at = rng() % (s.size() + 1);
      switch (rng() % 3) {
        case 0: s.erase(at, rng() % 12); break;
        case 1: s.insert(at, 1, alphabet[rng() % alphabet.size()]); break;
        default: s.insert(at, s.substr(rng() % s.size(), rng() % 40)); break;
      }
    }
    auto t = ChatTemplate::parse(s, "mutant");
    if (!t.ok()) { ++n_err; continue; }
    auto r = t->render(in);
    (r.ok() ? n_ok : n_err)++;
  }
  EXPECT_GT(n_ok, 0u);
  EXPECT_GT(n_err, 0u);

  const std::string deep_parens = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  EXPECT_NE(parse_error(deep_parens).find("nested too deeply"), std::string::npos);
  std::string deep_ifs;
  for (int k = 0; k < 5000; ++k) deep_ifs += "{% if true %}";
  EXPECT_NE(parse_error(deep_ifs).find("nested too deeply"), std::string::npos);
  std::string nots = "{{ " ;
  for (int k = 0; k < 5000; ++k) nots += "not ";
  EXPECT_NE(parse_error(nots + "x }}").find("nested too deeply"), std::string::npos);
  EXPECT_NE(parse_error("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns | tojson }}").find("nested too deeply"),
            std::string::npos);
  ChatTemplateInput deep;
  std::string nested = std::string(2000, '[') + std::string(2000, ']');
  deep.messages = doc(ojson::parse("[" + nested + "]"));
  auto t = ChatTemplate::parse("{{ messages | length }}");
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t->render(deep).ok());
}
