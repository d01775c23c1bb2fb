// The JSON facade of util/json.h over nlohmann::json: the only translation unit that includes it.
#include "util/json.h"

#include <nlohmann/json.hpp>

namespace ck {

namespace json_detail {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

struct Access {
  static JsonRef ref(const json& j) { return JsonRef(&j, false); }
  static JsonRef ref(const ojson& j) { return JsonRef(&j, true); }
  static bool missing(const JsonRef& r) { return r.node_ == nullptr; }
  // Calls f with the node as const json& or const ojson&; the ref must exist.
  template <typename F>
  static decltype(auto) visit(const JsonRef& r, F&& f) {
    if (r.ordered_) return f(*static_cast<const ojson*>(r.node_));
    return f(*static_cast<const json*>(r.node_));
  }
  static void point(JsonRef& r, const void* node, bool ordered) {
    r.node_ = node;
    r.ordered_ = ordered;
  }
};

}  // namespace json_detail

using json_detail::Access;
using json_detail::json;
using json_detail::ojson;

namespace {

const json& null_json() {
  static const json n;
  return n;
}

template <typename J>
JsonType type_of(const J& j) {
  switch (j.type()) {
    case J::value_t::boolean: return JsonType::Bool;
    case J::value_t::number_integer: return JsonType::Int;
    case J::value_t::number_unsigned: return JsonType::Uint;
    case J::value_t::number_float: return JsonType::Double;
    case J::value_t::string: return JsonType::String;
    case J::value_t::array: return JsonType::Array;
    case J::value_t::object: return JsonType::Object;
    default: return JsonType::Null;  // null, binary (never parsed), discarded
  }
}

template <typename J>
std::string dump_as(const J& j, int indent) {
  return j.dump(indent, ' ', false, J::error_handler_t::replace);
}

// Deep copy of any node into a J (the converting constructor re-sorts or keeps the order).
template <typename J>
J copy_as(const JsonRef& v) {
  if (!v.exists()) return J();
  return Access::visit(v, [](const auto& n) { return J(n); });
}

Status mismatch(const JsonRef& r, const char* want) { return error("must be {}, got {}", want, r.dump()); }

}  // namespace

const char* json_type_name(JsonType t) {
  switch (t) {
    case JsonType::Null: return "null";
    case JsonType::Bool: return "a boolean";
    case JsonType::Int:
    case JsonType::Uint: return "an integer";
    case JsonType::Double: return "a number";
    case JsonType::String: return "a string";
    case JsonType::Array: return "an array";
    case JsonType::Object: return "an object";
  }
  return "?";
}

// ---- JsonRef ----

JsonType JsonRef::type() const {
  if (!node_) return JsonType::Null;
  return Access::visit(*this, [](const auto& j) { return type_of(j); });
}

bool JsonRef::is_integer() const {
  JsonType t = type();
  return t == JsonType::Int || t == JsonType::Uint;
}

bool JsonRef::is_number() const {
  JsonType t = type();
  return t == JsonType::Int || t == JsonType::Uint || t == JsonType::Double;
}

size_t JsonRef::size() const {
  if (!node_) return 0;
  return Access::visit(*this, [](const auto& j) -> size_t { return j.is_array() || j.is_object() ? j.size() : 0; });
}

bool JsonRef::contains(std::string_view key) const {
  if (!node_) return false;
  return Access::visit(*this, [&](const auto& j) { return j.is_object() && j.find(key) != j.end(); });
}

JsonRef JsonRef::operator[](std::string_view key) const {
  if (!node_) return {};
  return Access::visit(*this, [&](const auto& j) -> JsonRef {
    if (!j.is_object()) return {};
    auto it = j.find(key);
    return it == j.end() ? JsonRef() : Access::ref(*it);
  });
}

JsonRef JsonRef::operator[](size_t i) const {
  if (!node_) return {};
  return Access::visit(*this, [&](const auto& j) -> JsonRef {
    if (!j.is_array() || i >= j.size()) return {};
    return Access::ref(j[i]);
  });
}

Result<JsonRef> JsonRef::at(std::string_view key) const {
  if (!is_object()) return error("expected an object with '{}', got {}", key, dump());
  JsonRef v = (*this)[key];
  if (!v.exists()) return error("missing '{}'", key);
  return v;
}

Result<JsonRef> JsonRef::at(size_t i) const {
  if (!is_array()) return error("expected an array, got {}", dump());
  if (i >= size()) return error("index {} of an array of {} elements", i, size());
  return (*this)[i];
}

bool JsonRef::as_bool() const {
  CHECK(is_bool());
  return Access::visit(*this, [](const auto& j) { return j.template get<bool>(); });
}

int64_t JsonRef::as_int() const {
  CHECK(is_integer());
  return Access::visit(*this, [](const auto& j) { return j.template get<int64_t>(); });
}

uint64_t JsonRef::as_uint() const {
  CHECK(is_integer());
  return Access::visit(*this, [](const auto& j) { return j.template get<uint64_t>(); });
}

double JsonRef::as_double() const {
  CHECK(is_number());
  return Access::visit(*this, [](const auto& j) { return j.template get<double>(); });
}

const std::string& JsonRef::as_string() const {
  CHECK(is_string());
  return Access::visit(*this, [](const auto& j) -> const std::string& {
    return j.template get_ref<const std::string&>();
  });
}

Result<bool> JsonRef::to_bool() const {
  if (!is_bool()) return mismatch(*this, "true or false");
  return as_bool();
}

Result<int64_t> JsonRef::to_int() const {
  if (!is_integer() || (is_unsigned() && as_uint() > static_cast<uint64_t>(INT64_MAX)))
    return mismatch(*this, "an integer");
  return as_int();
}

Result<uint64_t> JsonRef::to_uint() const {
  if (!is_integer() || (!is_unsigned() && as_int() < 0)) return mismatch(*this, "a non-negative integer");
  return as_uint();
}

Result<double> JsonRef::to_double() const {
  if (!is_number()) return mismatch(*this, "a number");
  return as_double();
}

Result<std::string> JsonRef::to_string() const {
  if (!is_string()) return mismatch(*this, "a string");
  return as_string();
}

bool JsonRef::operator==(std::string_view s) const { return is_string() && as_string() == s; }

std::string JsonRef::dump(int indent) const {
  if (!node_) return dump_as(null_json(), indent);
  return Access::visit(*this, [&](const auto& j) { return dump_as(j, indent); });
}

std::vector<JsonMember> JsonRef::members() const {
  std::vector<JsonMember> out;
  if (!is_object()) return out;
  Access::visit(*this, [&](const auto& j) {
    out.reserve(j.size());
    for (auto it = j.begin(); it != j.end(); ++it) out.push_back({it.key(), Access::ref(it.value())});
  });
  return out;
}

// ---- JsonDoc ----

struct JsonDoc::Impl {
  bool ordered = false;
  json j;   // the root unless ordered
  ojson o;  // the root if ordered
  const void* root() const { return ordered ? static_cast<const void*>(&o) : static_cast<const void*>(&j); }
};

JsonDoc::JsonDoc() : JsonDoc(false) {}

JsonDoc::JsonDoc(bool ordered) : impl_(std::make_unique<Impl>()) {
  impl_->ordered = ordered;
  Access::point(*this, impl_->root(), ordered);
}

JsonDoc JsonDoc::object(bool ordered) {
  JsonDoc d(ordered);
  if (ordered) d.impl_->o = ojson::object();
  else d.impl_->j = json::object();
  return d;
}

JsonDoc JsonDoc::array(bool ordered) {
  JsonDoc d(ordered);
  if (ordered) d.impl_->o = ojson::array();
  else d.impl_->j = json::array();
  return d;
}

JsonDoc::JsonDoc(const JsonDoc& o) : JsonRef(), impl_(o.impl_ ? std::make_unique<Impl>(*o.impl_) : nullptr) {
  if (impl_) Access::point(*this, impl_->root(), impl_->ordered);
}

JsonDoc::JsonDoc(JsonDoc&& o) noexcept : JsonRef(o), impl_(std::move(o.impl_)) {
  Access::point(o, nullptr, false);
}

JsonDoc& JsonDoc::operator=(const JsonDoc& o) {
  if (this != &o) *this = JsonDoc(o);
  return *this;
}

JsonDoc& JsonDoc::operator=(JsonDoc&& o) noexcept {
  if (this != &o) {
    impl_ = std::move(o.impl_);
    static_cast<JsonRef&>(*this) = o;
    Access::point(o, nullptr, false);
  }
  return *this;
}

JsonDoc::~JsonDoc() = default;

bool JsonDoc::ordered() const { return impl_ && impl_->ordered; }

void JsonDoc::set(std::string_view key, JsonRef v) {
  CHECK(impl_ && (is_object() || is_null()));
  if (impl_->ordered) impl_->o[std::string(key)] = copy_as<ojson>(v);
  else impl_->j[std::string(key)] = copy_as<json>(v);
}

void JsonDoc::push_back(JsonRef v) {
  CHECK(impl_ && (is_array() || is_null()));
  if (impl_->ordered) impl_->o.push_back(copy_as<ojson>(v));
  else impl_->j.push_back(copy_as<json>(v));
}

// ---- parsing ----

namespace {

// Builds the document from the parser's events, so that one instantiation of nlohmann's parser
// (its SAX form, in parse_json_sax) serves both document types and the SAX users: each costs
// seconds of compile time. The events and errors are those of nlohmann's own DOM parser.
class BuildSax final : public JsonSax {
 public:
  explicit BuildSax(JsonBuilder& b) : b_(b) {}
  bool null() override { b_.null(); return true; }
  bool boolean(bool v) override { b_.value(v); return true; }
  bool integer(int64_t v) override { b_.value(static_cast<long long>(v)); return true; }
  bool unsigned_integer(uint64_t v) override { b_.value(static_cast<unsigned long long>(v)); return true; }
  bool number(double v) override { b_.value(v); return true; }
  bool string(std::string& v) override { b_.value(std::move(v)); return true; }
  bool key(std::string& k) override { b_.key(k); return true; }
  bool start_object() override { b_.begin_object(); return true; }
  bool end_object() override { b_.end_object(); return true; }
  bool start_array() override { b_.begin_array(); return true; }
  bool end_array() override { b_.end_array(); return true; }

 private:
  JsonBuilder& b_;
};

Result<JsonDoc> parse_into(std::string_view text, bool ordered) {
  JsonBuilder b(ordered);
  BuildSax sax(b);
  TRY(parse_json_sax(text, sax));
  return b.finish();
}

}  // namespace

Result<JsonDoc> parse_json(std::string_view text) { return parse_into(text, false); }
Result<JsonDoc> parse_json_ordered(std::string_view text) { return parse_into(text, true); }

std::string json_quote(std::string_view s) { return dump_as(json(std::string(s)), -1); }

// ---- JsonBuilder ----

namespace json_detail {

// The builder's stack for one document type: pointers to the open containers (each lives inside
// its parent's last member or element, which does not move while it is open).
template <typename J>
struct Stack {
  J root;
  bool has_root = false;
  std::vector<J*> open;
  std::vector<std::string> keys;  // per open container: the pending key (objects)
  std::vector<uint8_t> has_key;

  // Places v where the next value goes; returns it.
  J* put(J&& v) {
    if (open.empty()) {
      CHECK_MSG(!has_root, "JsonBuilder: a second top-level value");
      has_root = true;
      root = std::move(v);
      return &root;
    }
    J* top = open.back();
    if (top->is_object()) {
      CHECK_MSG(has_key.back(), "JsonBuilder: a value inside an object without a key");
      has_key.back() = 0;
      J& slot = (*top)[keys.back()];
      slot = std::move(v);
      return &slot;
    }
    top->push_back(std::move(v));
    return &top->back();
  }
  void begin(J&& container) {
    J* c = put(std::move(container));
    open.push_back(c);
    keys.emplace_back();
    has_key.push_back(0);
  }
  void end(bool object) {
    CHECK_MSG(!open.empty() && open.back()->is_object() == object, "JsonBuilder: unbalanced end_{}",
              object ? "object" : "array");
    CHECK_MSG(!has_key.back(), "JsonBuilder: key '{}' without a value", keys.back());
    open.pop_back();
    keys.pop_back();
    has_key.pop_back();
  }
  void key(std::string_view k) {
    CHECK_MSG(!open.empty() && open.back()->is_object(), "JsonBuilder: key '{}' outside an object", k);
    CHECK_MSG(!has_key.back(), "JsonBuilder: key '{}' after key '{}'", k, keys.back());
    keys.back().assign(k);
    has_key.back() = 1;
  }
};

}  // namespace json_detail

using json_detail::Stack;

struct JsonBuilder::Impl {
  bool ordered;
  Stack<json> s;
  Stack<ojson> os;
  // Calls f with the stack of this builder's document type.
  template <typename F>
  void with(F&& f) {
    if (ordered) f(os);
    else f(s);
  }
};

JsonBuilder::JsonBuilder(bool ordered) : impl_(std::make_unique<Impl>()) { impl_->ordered = ordered; }
JsonBuilder::JsonBuilder(JsonBuilder&&) noexcept = default;
JsonBuilder::~JsonBuilder() = default;

JsonBuilder& JsonBuilder::begin_object() {
  impl_->with([](auto& s) { s.begin(std::remove_reference_t<decltype(s.root)>::object()); });
  return *this;
}
JsonBuilder& JsonBuilder::end_object() {
  impl_->with([](auto& s) { s.end(true); });
  return *this;
}
JsonBuilder& JsonBuilder::begin_array() {
  impl_->with([](auto& s) { s.begin(std::remove_reference_t<decltype(s.root)>::array()); });
  return *this;
}
JsonBuilder& JsonBuilder::end_array() {
  impl_->with([](auto& s) { s.end(false); });
  return *this;
}
JsonBuilder& JsonBuilder::key(std::string_view k) {
  impl_->with([&](auto& s) { s.key(k); });
  return *this;
}

#define CK_BUILDER_PUT(expr)                                                                   \
  impl_->with([&](auto& s) {                                                                 \
    using J = std::remove_reference_t<decltype(s.root)>;                                     \
    s.put(J(expr));                                                                           \
  });                                                                                         \
  return *this

JsonBuilder& JsonBuilder::null() { CK_BUILDER_PUT(nullptr); }
JsonBuilder& JsonBuilder::value(bool v) { CK_BUILDER_PUT(v); }
JsonBuilder& JsonBuilder::value(long long v) { CK_BUILDER_PUT(static_cast<int64_t>(v)); }
JsonBuilder& JsonBuilder::value(unsigned long long v) { CK_BUILDER_PUT(static_cast<uint64_t>(v)); }
JsonBuilder& JsonBuilder::value(double v) { CK_BUILDER_PUT(v); }
JsonBuilder& JsonBuilder::value(std::string_view v) { CK_BUILDER_PUT(std::string(v)); }
JsonBuilder& JsonBuilder::value(std::string&& v) { CK_BUILDER_PUT(std::move(v)); }
JsonBuilder& JsonBuilder::value(std::span<const int64_t> v) { CK_BUILDER_PUT(std::vector<int64_t>(v.begin(), v.end())); }
JsonBuilder& JsonBuilder::value(std::span<const uint64_t> v) { CK_BUILDER_PUT(std::vector<uint64_t>(v.begin(), v.end())); }
JsonBuilder& JsonBuilder::value(std::span<const std::string> v) {
  CK_BUILDER_PUT(std::vector<std::string>(v.begin(), v.end()));
}
#undef CK_BUILDER_PUT

JsonBuilder& JsonBuilder::value(JsonRef v) {
  impl_->with([&](auto& s) { s.put(copy_as<std::remove_reference_t<decltype(s.root)>>(v)); });
  return *this;
}

size_t JsonBuilder::depth() const { return impl_->ordered ? impl_->os.open.size() : impl_->s.open.size(); }

JsonDoc JsonBuilder::finish() {
  JsonDoc doc(impl_->ordered);
  impl_->with([&](auto& s) {
    using J = std::remove_reference_t<decltype(s.root)>;
    CHECK_MSG(s.open.empty(), "JsonBuilder::finish with {} containers open", s.open.size());
    J* root = const_cast<J*>(static_cast<const J*>(Access::visit(doc, [](const auto& n) {
      return static_cast<const void*>(&n);
    })));
    *root = std::move(s.root);
    s.root = J();
    s.has_root = false;
  });
  return doc;
}

// ---- SAX ----

namespace {

class SaxAdapter final : public nlohmann::json_sax<json> {
 public:
  explicit SaxAdapter(JsonSax& s) : s_(s) {}
  bool null() override { return s_.null(); }
  bool boolean(bool v) override { return s_.boolean(v); }
  bool number_integer(number_integer_t v) override { return s_.integer(v); }
  bool number_unsigned(number_unsigned_t v) override { return s_.unsigned_integer(v); }
  bool number_float(number_float_t v, const string_t&) override { return s_.number(v); }
  bool string(string_t& v) override { return s_.string(v); }
  bool binary(binary_t&) override { return false; }
  bool start_object(std::size_t) override { return s_.start_object(); }
  bool key(string_t& k) override { return s_.key(k); }
  bool end_object() override { return s_.end_object(); }
  bool start_array(std::size_t) override { return s_.start_array(); }
  bool end_array() override { return s_.end_array(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& ex) override {
    error = ex.what();
    return false;
  }
  std::string error;

 private:
  JsonSax& s_;
};

}  // namespace

Status parse_json_sax(std::string_view text, JsonSax& sax) {
  SaxAdapter a(sax);
  try {
    if (json::sax_parse(text, &a)) return {};
  } catch (const json::exception& e) {
    return Status::error(e.what());
  }
  if (!a.error.empty()) return Status::error(a.error);
  return Status::error("stopped");
}

}  // namespace ck
