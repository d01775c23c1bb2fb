// JSON behind a small, non-template interface: nlohmann::json is included by util/json.cpp only.
// Why: its header and template instantiations cost 5-15 s of compile time in every translation
// unit that includes it, and the README's first command must build in under a minute on two
// cores. Everything here is compiled once, in util/json.cpp; the parser, the serializer (number
// formats, escaping) and their error messages are nlohmann's, so documents read and written
// through this header are byte-for-byte what nlohmann::json gave before.
//
//   JsonDoc   an owned document (parse_json, parse_json_ordered, JsonBuilder::finish)
//   JsonRef   a read-only view of one value inside a JsonDoc (type queries, lookup, iteration)
//   JsonBuilder  builds a document event by event (begin_object, key, value, end_object, ...)
//   JsonSax   event callbacks for parse_json_sax (streaming a large file without a DOM)
//
// Objects keep their keys sorted (std::map, as nlohmann::json) unless the document is "ordered"
// (input or insertion order, as nlohmann::ordered_json: Jinja's tojson needs it).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace ck {

namespace json_detail {
struct Access;
}

enum class JsonType : uint8_t { Null, Bool, Int, Uint, Double, String, Array, Object };

// "null", "a boolean", "an integer", "a number", "a string", "an array", "an object".
const char* json_type_name(JsonType t);

class JsonRef;

// One member of an object, from JsonRef::members().
struct JsonMember;

// A read-only view of one value of a JsonDoc; valid while the document lives and is not modified.
// A default-constructed ref, or the result of looking up a missing key or index, is "missing": it
// reads as null (exists() tells the two apart), so lookups chain safely: doc["a"]["b"].is_string().
class JsonRef {
 public:
  JsonRef() = default;

  bool exists() const { return node_ != nullptr; }
  JsonType type() const;  // Null when missing
  bool is_null() const { return type() == JsonType::Null; }
  bool is_bool() const { return type() == JsonType::Bool; }
  bool is_integer() const;  // Int or Uint (never a bool, never 1.0)
  bool is_unsigned() const { return type() == JsonType::Uint; }  // parsed non-negative integers are Uint
  bool is_double() const { return type() == JsonType::Double; }
  bool is_number() const;  // Int, Uint or Double
  bool is_string() const { return type() == JsonType::String; }
  bool is_array() const { return type() == JsonType::Array; }
  bool is_object() const { return type() == JsonType::Object; }

  // Elements of an array, members of an object; 0 for anything else.
  size_t size() const;
  bool empty() const { return size() == 0; }

  // Lookup: a missing ref when this is not an object (array) or has no such key (index).
  bool contains(std::string_view key) const;
  JsonRef operator[](std::string_view key) const;
  JsonRef operator[](size_t i) const;
  // Checked lookup: the error names the key or index ("missing 'bits'", "index 3 of 2 elements");
  // the caller prefixes the file and the path to this value.
  Result<JsonRef> at(std::string_view key) const;
  Result<JsonRef> at(size_t i) const;

  // Values. The caller checks the type first (a mismatch is a bug of ours: CHECK-fails):
  // as_int and as_uint need is_integer() and convert between signed and unsigned as static_cast
  // does; as_double needs is_number().
  bool as_bool() const;
  int64_t as_int() const;
  uint64_t as_uint() const;
  double as_double() const;
  const std::string& as_string() const;
  // Typed reads that report a mismatch instead: "must be an integer, got \"4\"" (the value as JSON).
  Result<bool> to_bool() const;
  Result<int64_t> to_int() const;
  Result<uint64_t> to_uint() const;  // also rejects negative integers
  Result<double> to_double() const;
  Result<std::string> to_string() const;

  // True when this is the string s.
  bool operator==(std::string_view s) const;

  // Serializes as nlohmann's dump(indent, ' ', false, replace): indent < 0 is the compact one-line
  // form; invalid UTF-8 in strings becomes U+FFFD. A missing value dumps as null.
  std::string dump(int indent = -1) const;

  // Iteration: the members of an object in the document's order (sorted keys unless ordered),
  // empty for anything else; the elements of an array, empty for anything else.
  std::vector<JsonMember> members() const;
  class Elements;
  Elements elements() const;

 private:
  friend struct json_detail::Access;
  JsonRef(const void* node, bool ordered) : node_(node), ordered_(ordered) {}
  const void* node_ = nullptr;  // nlohmann::json or nlohmann::ordered_json, by ordered_
  bool ordered_ = false;
};

struct JsonMember {
  const std::string& key;
  JsonRef value;
};

class JsonRef::Elements {
 public:
  class iterator {
   public:
    iterator(JsonRef a, size_t i) : a_(a), i_(i) {}
    JsonRef operator*() const { return a_[i_]; }
    iterator& operator++() { ++i_; return *this; }
    bool operator!=(const iterator& o) const { return i_ != o.i_; }

   private:
    JsonRef a_;
    size_t i_;
  };
  explicit Elements(JsonRef a) : a_(a), n_(a.is_array() ? a.size() : 0) {}
  iterator begin() const { return {a_, 0}; }
  iterator end() const { return {a_, n_}; }
  size_t size() const { return n_; }

 private:
  JsonRef a_;
  size_t n_;
};

inline JsonRef::Elements JsonRef::elements() const { return Elements(*this); }

// An owned JSON document; it is also a JsonRef to its root value. Moving keeps refs into it valid.
class JsonDoc : public JsonRef {
 public:
  JsonDoc();  // null, keys sorted
  explicit JsonDoc(bool ordered);  // null
  static JsonDoc object(bool ordered = false);
  static JsonDoc array(bool ordered = false);
  JsonDoc(const JsonDoc& o);
  JsonDoc(JsonDoc&& o) noexcept;
  JsonDoc& operator=(const JsonDoc& o);
  JsonDoc& operator=(JsonDoc&& o) noexcept;
  ~JsonDoc();

  bool ordered() const;
  // Edits of the root, deep-copying `v` (from any document, ordered or not). set() needs an
  // object root (replacing the key's value if it has one), push_back an array root; a null root
  // becomes one, as in nlohmann; another type CHECK-fails. Both may invalidate refs into this
  // document.
  void set(std::string_view key, JsonRef v);
  void push_back(JsonRef v);

 private:
  friend struct json_detail::Access;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Parses a whole JSON text. The error message is the parser's (position and what it expected);
// callers prefix the file or field it came from.
Result<JsonDoc> parse_json(std::string_view text);
Result<JsonDoc> parse_json_ordered(std::string_view text);  // keys in input order

// JSON text of one string, escaped as dump() escapes it ("a\"b" for a"b).
std::string json_quote(std::string_view s);

// Builds a document value by value, as a parser would: begin_object(), then key() before each
// member's value, end_object(); arrays alike. Keys of a sorted document may come in any order; a
// repeated key replaces the earlier value. Misuse (a value without a key inside an object,
// unbalanced ends, finish() with containers open) CHECK-fails.
class JsonBuilder {
 public:
  explicit JsonBuilder(bool ordered = false);
  JsonBuilder(JsonBuilder&&) noexcept;
  ~JsonBuilder();

  JsonBuilder& begin_object();
  JsonBuilder& end_object();
  JsonBuilder& begin_array();
  JsonBuilder& end_array();
  JsonBuilder& key(std::string_view k);

  JsonBuilder& null();
  JsonBuilder& value(bool v);
  JsonBuilder& value(int v) { return value(static_cast<long long>(v)); }
  JsonBuilder& value(long v) { return value(static_cast<long long>(v)); }
  JsonBuilder& value(long long v);
  JsonBuilder& value(unsigned v) { return value(static_cast<unsigned long long>(v)); }
  JsonBuilder& value(unsigned long v) { return value(static_cast<unsigned long long>(v)); }
  JsonBuilder& value(unsigned long long v);
  JsonBuilder& value(double v);
  JsonBuilder& value(const char* v) { return value(std::string_view(v)); }
  JsonBuilder& value(const std::string& v) { return value(std::string_view(v)); }
  JsonBuilder& value(std::string_view v);
  JsonBuilder& value(std::string&& v);  // moves the string into the document
  JsonBuilder& value(JsonRef v);  // a deep copy (a missing ref copies as null)
  // Arrays of numbers or strings.
  JsonBuilder& value(std::span<const int64_t> v);
  JsonBuilder& value(std::span<const uint64_t> v);
  JsonBuilder& value(std::span<const std::string> v);
  JsonBuilder& value(const std::vector<int64_t>& v) { return value(std::span<const int64_t>(v)); }
  JsonBuilder& value(const std::vector<uint64_t>& v) { return value(std::span<const uint64_t>(v)); }
  JsonBuilder& value(const std::vector<std::string>& v) { return value(std::span<const std::string>(v)); }

  // key(k).value(v)
  template <typename T>
  JsonBuilder& field(std::string_view k, T&& v) {
    key(k);
    return value(std::forward<T>(v));
  }

  // Depth of open containers (0 when the value is complete).
  size_t depth() const;
  // The document built so far; the builder is empty afterwards.
  JsonDoc finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Events of parse_json_sax. Return false to stop parsing (the parse then fails with "stopped").
// string() and key() may move from their argument.
class JsonSax {
 public:
  virtual ~JsonSax() = default;
  virtual bool null() = 0;
  virtual bool boolean(bool v) = 0;
  virtual bool integer(int64_t v) = 0;            // negative integers
  virtual bool unsigned_integer(uint64_t v) = 0;  // non-negative integers
  virtual bool number(double v) = 0;
  virtual bool string(std::string& v) = 0;
  virtual bool key(std::string& k) = 0;
  virtual bool start_object() = 0;
  virtual bool end_object() = 0;
  virtual bool start_array() = 0;
  virtual bool end_array() = 0;
};

// Parses `text` into events without building a document. The error message is the parser's, as
// parse_json gives it.
Status parse_json_sax(std::string_view text, JsonSax& sax);

}  // namespace ck
