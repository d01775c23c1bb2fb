// Python semantics of template values (see jinja_value.h): str/repr/==/ordering, JSON in
// (messages, tools) and out (tojson, as Python's json.dumps writes it), and string helpers.
#include "text/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include <fmt/format.h>

#include "text/utf8.h"

namespace ck::text::jinja {

[[noreturn]] void fail(int line, std::string msg) { throw TemplateError{line, std::move(msg)}; }

// ---------------------------------------------------------------------------------------------
// Unicode helpers with Python's definitions

// Python's str.isspace(): bidi class WS/B/S or category Zs.
bool py_isspace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::vector<uint32_t> code_points(std::string_view s) {
  std::vector<uint32_t> cps;
  for (size_t i = 0; i < s.size();) cps.push_back(utf8_decode_at(s, i));
  return cps;
}

std::string from_code_points(const std::vector<uint32_t>& cps, size_t a, size_t b) {
  std::string out;
  for (size_t k = a; k < b; ++k) utf8_append(out, cps[k]);
  return out;
}

// str.strip/lstrip/rstrip: `chars` null means whitespace.
std::string py_strip(std::string_view s, const std::string* chars, bool left, bool right) {
  std::vector<uint32_t> cps = code_points(s);
  std::vector<uint32_t> set;
  if (chars) set = code_points(*chars);
  auto drop = [&](uint32_t c) { return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_isspace(c); };
  size_t a = 0, b = cps.size();
  if (left) while (a < b && drop(cps[a])) ++a;
  if (right) while (b > a && drop(cps[b - 1])) --b;
  return from_code_points(cps, a, b);
}

// Python's float repr: shortest round-trip digits; scientific when the exponent is < -4 or >= 16.
std::string py_float_repr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  if (f == 0) return std::signbit(f) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, f, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  std::string sign;
  if (sci[0] == '-') { sign = "-"; sci.erase(0, 1); }
  size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  int exp10 = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mant) if (c != '.') digits += c;
  if (exp10 < -4 || exp10 >= 16) {
    std::string m = digits.substr(0, 1);
    if (digits.size() > 1) m += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp10 < 0 ? '-' : '+', std::abs(exp10));
    return sign + m + eb;
  }
  std::string out;
  if (exp10 < 0) {
    out = "0." + std::string(-exp10 - 1, '0') + digits;
  } else if (static_cast<int>(digits.size()) <= exp10 + 1) {
    out = digits + std::string(exp10 + 1 - digits.size(), '0') + ".0";
  } else {
    out = digits.substr(0, exp10 + 1) + "." + digits.substr(exp10 + 1);
  }
  return sign + out;
}

// ---------------------------------------------------------------------------------------------
// Values




const Value* Dict::find(std::string_view k) const {
  for (auto& [key, v] : items) if (key == k) return &v;
  return nullptr;
}
void Dict::set(const std::string& k, Value v) {
  for (auto& [key, old] : items) {
    if (key == k) { old = std::move(v); return; }
  }
  items.emplace_back(k, std::move(v));
}


const char* type_name(const Value& v) {
  switch (v.k) {
    case Value::K::Undefined: return "undefined";
    case Value::K::None: return "none";
    case Value::K::Bool: return "bool";
    case Value::K::Int: return "int";
    case Value::K::Float: return "float";
    case Value::K::Str: return "string";
    case Value::K::List: return "list";
    case Value::K::Dict: return "dict";
    case Value::K::Ns: return "namespace";
    case Value::K::Fn: return "function";
  }
  return "?";
}

bool truthy(const Value& v) {
  switch (v.k) {
    case Value::K::Undefined: case Value::K::None: return false;
    case Value::K::Bool: return v.b;
    case Value::K::Int: return v.i != 0;
    case Value::K::Float: return v.f != 0;
    case Value::K::Str: return !v.s.empty();
    case Value::K::List: return !v.l->empty();
    case Value::K::Dict: return !v.d->items.empty();
    default: return true;
  }
}

std::string py_str_repr(const std::string& s) {
  bool has_sq = s.find('\'') != std::string::npos, has_dq = s.find('"') != std::string::npos;
  char q = has_sq && !has_dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(q)) { out += '\\'; out += q; }
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) { char b[8]; std::snprintf(b, sizeof b, "\\x%02x", c); out += b; }
    else out += static_cast<char>(c);
  }
  return out + q;
}

std::string repr(const Value& v, int depth) {
  if (depth > kMaxValueDepth) fail(0, "value nested too deeply to print");
  if (v.k == Value::K::Str) return py_str_repr(v.s);
  if (v.k == Value::K::List) {
    std::string out = v.tuple ? "(" : "[";
    for (size_t n = 0; n < v.l->size(); ++n) out += (n ? ", " : "") + repr((*v.l)[n], depth + 1);
    if (v.tuple && v.l->size() == 1) out += ",";
    return out + (v.tuple ? ")" : "]");
  }
  if (v.k == Value::K::Dict) {
    std::string out = "{";
    size_t n = 0;
    for (auto& [key, x] : v.d->items) out += (n++ ? ", " : "") + py_str_repr(key) + ": " + repr(x, depth + 1);
    return out + "}";
  }
  return to_str(v);
}

// Python str(); Jinja prints Undefined as "".
std::string to_str(const Value& v) {
  switch (v.k) {
    case Value::K::Undefined: return "";
    case Value::K::None: return "None";
    case Value::K::Bool: return v.b ? "True" : "False";
    case Value::K::Int: return std::to_string(v.i);
    case Value::K::Float: return py_float_repr(v.f);
    case Value::K::Str: return v.s;
    case Value::K::List: case Value::K::Dict: return repr(v);
    case Value::K::Ns: return "<Namespace>";
    case Value::K::Fn: return "<function>";
  }
  return "";
}

bool equal(const Value& a, const Value& b, int depth) {
  if (depth > kMaxValueDepth) fail(0, "comparison of values nested too deeply (or containing themselves)");
  if (a.is_num() && b.is_num()) {
    if (a.k == Value::K::Float || b.k == Value::K::Float) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.k != b.k) return false;
  switch (a.k) {
    case Value::K::Undefined: case Value::K::None: return true;
    case Value::K::Str: return a.s == b.s;
    case Value::K::List:
      if (a.tuple != b.tuple || a.l->size() != b.l->size()) return false;
      for (size_t n = 0; n < a.l->size(); ++n) if (!equal((*a.l)[n], (*b.l)[n], depth + 1)) return false;
      return true;
    case Value::K::Dict: case Value::K::Ns:
      if (a.d->items.size() != b.d->items.size()) return false;
      for (auto& [key, x] : a.d->items) {
        const Value* y = b.d->find(key);
        if (!y || !equal(x, *y, depth + 1)) return false;
      }
      return true;
    default: return a.fn == b.fn;
  }
}

// <0, 0, >0 like Python's ordering; errors for types Python cannot order.
int compare(const Value& a, const Value& b, int line) {
  if (a.is_num() && b.is_num()) {
    double x = a.as_double(), y = b.as_double();
    if (a.k != Value::K::Float && b.k != Value::K::Float) { int64_t p = a.as_int(), q = b.as_int(); return p < q ? -1 : p > q; }
    return x < y ? -1 : x > y;
  }
  if (a.k == Value::K::Str && b.k == Value::K::Str) return a.s.compare(b.s) < 0 ? -1 : a.s == b.s ? 0 : 1;  // UTF-8 order = code point order
  if (a.k == Value::K::List && b.k == Value::K::List) {
    for (size_t n = 0; n < a.l->size() && n < b.l->size(); ++n) {
      int c = compare((*a.l)[n], (*b.l)[n], line);
      if (c) return c;
    }
    return a.l->size() < b.l->size() ? -1 : a.l->size() > b.l->size();
  }
  fail(line, fmt::format("cannot compare {} with {}", type_name(a), type_name(b)));
}

Value from_json(JsonRef j, int depth) {
  if (depth > kMaxValueDepth) fail(0, "input JSON nested too deeply");
  switch (j.type()) {
    case JsonType::Null: return Value::none();
    case JsonType::Bool: return Value::boolean(j.as_bool());
    case JsonType::Int: return Value::integer(j.as_int());
    case JsonType::Uint: return Value::integer(static_cast<int64_t>(j.as_uint()));
    case JsonType::Double: return Value::number(j.as_double());
    case JsonType::String: return Value::str(j.as_string());
    case JsonType::Array: {
      List l;
      for (JsonRef x : j.elements()) l.push_back(from_json(x, depth + 1));
      return Value::list(std::move(l));
    }
    case JsonType::Object: {
      Dict d;
      for (const auto& [key, value] : j.members()) d.items.emplace_back(key, from_json(value, depth + 1));
      return Value::dict(std::move(d));
    }
  }
  return Value::none();
}


void json_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  for (size_t n = 0; n < s.size();) {
    unsigned char c = s[n];
    if (c == '"') { out += "\\\""; ++n; }
    else if (c == '\\') { out += "\\\\"; ++n; }
    else if (c == '\n') { out += "\\n"; ++n; }
    else if (c == '\r') { out += "\\r"; ++n; }
    else if (c == '\t') { out += "\\t"; ++n; }
    else if (c == '\b') { out += "\\b"; ++n; }
    else if (c == '\f') { out += "\\f"; ++n; }
    else if (c < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\u%04x", c); out += b; ++n; }
    else if (c < 0x80 || !ensure_ascii) { out += static_cast<char>(c); ++n; }
    else {
      uint32_t cp = utf8_decode_at(s, n);
      char b[16];
      if (cp >= 0x10000) {
        cp -= 0x10000;
        std::snprintf(b, sizeof b, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
      } else {
        std::snprintf(b, sizeof b, "\\u%04x", cp);
      }
      out += b;
    }
  }
  out += '"';
}

void to_json(const Value& v, const JsonStyle& st, int level, std::string& out, int line) {
  if (level > kMaxValueDepth) fail(line, "tojson: value nested too deeply (or contains itself)");
  auto newline = [&](int lvl) {
    if (st.indent >= 0) { out += '\n'; out += std::string(static_cast<size_t>(st.indent) * lvl, ' '); }
  };
  switch (v.k) {
    case Value::K::None: out += "null"; return;
    case Value::K::Bool: out += v.b ? "true" : "false"; return;
    case Value::K::Int: out += std::to_string(v.i); return;
    case Value::K::Float:
      out += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity") : py_float_repr(v.f);
      return;
    case Value::K::Str: json_string(v.s, st.ensure_ascii, out); return;
    case Value::K::List: {
      if (v.l->empty()) { out += "[]"; return; }
      out += '[';
      for (size_t n = 0; n < v.l->size(); ++n) {
        if (n) out += st.item_sep;
        newline(level + 1);
        to_json((*v.l)[n], st, level + 1, out, line);
      }
      newline(level);
      out += ']';
      return;
    }
    case Value::K::Dict: case Value::K::Ns: {
      if (v.d->items.empty()) { out += "{}"; return; }
      std::vector<const std::pair<std::string, Value>*> items;
      for (auto& kv : v.d->items) items.push_back(&kv);
      if (st.sort_keys) std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t n = 0; n < items.size(); ++n) {
        if (n) out += st.item_sep;
        newline(level + 1);
        json_string(items[n]->first, st.ensure_ascii, out);
        out += st.key_sep;
        to_json(items[n]->second, st, level + 1, out, line);
      }
      newline(level);
      out += '}';
      return;
    }
    default: fail(line, fmt::format("tojson: object of type {} is not JSON serializable", type_name(v)));
  }
}

}  // namespace ck::text::jinja
