// Values of the chat-template interpreter with Python's semantics: truthiness, str(), repr(),
// ==, ordering, and json.dumps as transformers' tojson calls it; plus the Python string helpers
// (isspace, strip, float repr) they need. Internal to src/text (chat_template.cpp); the parser and
// evaluator live there. Errors are thrown as TemplateError and caught at the ChatTemplate API.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "util/json.h"

namespace ck::text::jinja {


struct TemplateError {
  int line;  // template line; 0 when no line applies (bad input data)
  std::string msg;
};
[[noreturn]] void fail(int line, std::string msg);

// Nesting limit for the recursive walks over values (JSON input, tojson, ==): deeper data, or a
// namespace stored inside itself, is an error instead of a stack overflow.
constexpr int kMaxValueDepth = 256;

struct Value;
struct Node;
using List = std::vector<Value>;
struct Dict {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, as Python dicts
  const Value* find(std::string_view k) const;
  void set(const std::string& k, Value v);
};
struct Callable;

struct Value {
  enum class K : uint8_t { Undefined, None, Bool, Int, Float, Str, List, Dict, Ns, Fn };
  K k = K::Undefined;
  bool b = false;
  bool tuple = false;  // a List written as (a, b): Python's (1, 2) != [1, 2]
  int64_t i = 0;
  double f = 0;
  std::string s;  // Str; for Undefined, the name that was looked up (error messages)
  std::shared_ptr<List> l;
  std::shared_ptr<Dict> d;  // Dict and Ns (a namespace is a mutable dict)
  std::shared_ptr<Callable> fn;

  static Value undefined(std::string hint = {}) { Value v; v.s = std::move(hint); return v; }
  static Value none() { Value v; v.k = K::None; return v; }
  static Value boolean(bool x) { Value v; v.k = K::Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.k = K::Int; v.i = x; return v; }
  static Value number(double x) { Value v; v.k = K::Float; v.f = x; return v; }
  static Value str(std::string x) { Value v; v.k = K::Str; v.s = std::move(x); return v; }
  static Value list(List x = {}) { Value v; v.k = K::List; v.l = std::make_shared<List>(std::move(x)); return v; }
  static Value dict(Dict x = {}) { Value v; v.k = K::Dict; v.d = std::make_shared<Dict>(std::move(x)); return v; }

  bool is_undefined() const { return k == K::Undefined; }
  bool is_num() const { return k == K::Bool || k == K::Int || k == K::Float; }
  double as_double() const { return k == K::Float ? f : k == K::Int ? static_cast<double>(i) : b ? 1.0 : 0.0; }
  int64_t as_int() const { return k == K::Int ? i : k == K::Bool ? (b ? 1 : 0) : static_cast<int64_t>(f); }
};

struct Callable {
  enum class Kind { Macro, Method, Builtin } kind;
  const Node* macro = nullptr;  // Macro
  std::string name;             // Method or Builtin
  Value self;                   // Method: the receiver
};

const char* type_name(const Value& v);
bool truthy(const Value& v);
std::string to_str(const Value& v);  // Python str(); Undefined prints as ""
std::string repr(const Value& v, int depth = 0);
bool equal(const Value& a, const Value& b, int depth = 0);
int compare(const Value& a, const Value& b, int line);  // <0, 0, >0; fails where Python cannot order
Value from_json(JsonRef j, int depth = 0);

// json.dumps(x, ensure_ascii, indent, separators, sort_keys) as Python writes it.
struct JsonStyle {
  bool ensure_ascii = false;
  int indent = -1;  // -1: None
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false;
};
void to_json(const Value& v, const JsonStyle& st, int level, std::string& out, int line);

// Python's definitions on UTF-8 strings.
bool py_isspace(uint32_t c);
std::vector<uint32_t> code_points(std::string_view s);
std::string from_code_points(const std::vector<uint32_t>& cps, size_t a, size_t b);
std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right);  // chars null: whitespace
std::string py_float_repr(double f);

}  // namespace ck::text::jinja
