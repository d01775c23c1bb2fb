// The JSON facade (util/json.h): parsing and its errors, lookups and typed reads, the builder's
// output (escaping, number formats, key order) and the SAX events.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "util/json.h"

using namespace ck;

namespace {

JsonDoc parse_ok(std::string_view text, bool ordered = false) {
  auto r = ordered ? parse_json_ordered(text) : parse_json(text);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r).value() : JsonDoc();
}

std::string parse_err(std::string_view text) {
  auto r = parse_json(text);
  return r.ok() ? std::string("(parsed)") : r.status().message();
}

}  // namespace

TEST(Json, ParseErrorsNamePosition) {
  EXPECT_NE(parse_err("{not json").find("parse error at line 1, column 3"), std::string::npos) << parse_err("{not json");
  EXPECT_NE(parse_err("").find("parse error"), std::string::npos);
  EXPECT_NE(parse_err("[1, 2").find("unexpected end of input"), std::string::npos);
  EXPECT_NE(parse_err("{\"a\": 1} x").find("expected end of input"), std::string::npos);
  EXPECT_NE(parse_err("\"\\ud800\"").find("surrogate"), std::string::npos);
  EXPECT_FALSE(parse_json_ordered("{").ok());
}

TEST(Json, TypesAndLookups) {
  JsonDoc d = parse_ok(R"({"n": null, "b": true, "i": -3, "u": 7, "f": 1.5, "s": "x", "a": [1, "2"], "o": {"k": 1}})");
  EXPECT_TRUE(d.is_object());
  EXPECT_EQ(d.size(), 8u);
  EXPECT_TRUE(d["n"].is_null());
  EXPECT_TRUE(d["n"].exists());
  EXPECT_TRUE(d["b"].is_bool());
  EXPECT_EQ(d["i"].type(), JsonType::Int);
  EXPECT_EQ(d["u"].type(), JsonType::Uint);
  EXPECT_TRUE(d["i"].is_integer());
  EXPECT_TRUE(d["u"].is_integer());
  EXPECT_FALSE(d["f"].is_integer());
  EXPECT_TRUE(d["f"].is_number());
  EXPECT_FALSE(d["b"].is_number());
  EXPECT_EQ(d["i"].as_int(), -3);
  EXPECT_EQ(d["u"].as_uint(), 7u);
  EXPECT_EQ(d["u"].as_double(), 7.0);
  EXPECT_EQ(d["s"].as_string(), "x");
  EXPECT_TRUE(d["s"] == "x");
  EXPECT_FALSE(d["i"] == "x");
  EXPECT_EQ(d["a"].size(), 2u);
  EXPECT_EQ(d["a"][1].as_string(), "2");
  EXPECT_TRUE(d.contains("o"));
  EXPECT_FALSE(d.contains("zz"));
  EXPECT_FALSE(d["a"].contains("0"));
  // Missing values read as null and chain.
  EXPECT_FALSE(d["zz"].exists());
  EXPECT_TRUE(d["zz"].is_null());
  EXPECT_FALSE(d["zz"]["y"][3].exists());
  EXPECT_FALSE(d["a"][2].exists());
  EXPECT_FALSE(d["s"]["k"].exists());
  EXPECT_EQ(d["zz"].dump(), "null");
  EXPECT_EQ(d["zz"].size(), 0u);
  EXPECT_EQ(d["s"].size(), 0u);
}

TEST(Json, CheckedLookupsAndTypedReads) {
  JsonDoc d = parse_ok(R"({"bits": "4", "a": [1], "neg": -1, "big": 18446744073709551615})");
  auto miss = d.at("group_size");
  ASSERT_FALSE(miss.ok());
  EXPECT_EQ(miss.status().message(), "missing 'group_size'");
  auto idx = d["a"].at(3);
  ASSERT_FALSE(idx.ok());
  EXPECT_EQ(idx.status().message(), "index 3 of an array of 1 elements");
  EXPECT_FALSE(d["a"].at("x").ok());
  ASSERT_TRUE(d.at("bits").ok());
  auto bits = d["bits"].to_int();
  ASSERT_FALSE(bits.ok());
  EXPECT_EQ(bits.status().message(), "must be an integer, got \"4\"");
  EXPECT_EQ(*d["bits"].to_string(), "4");
  EXPECT_FALSE(d["bits"].to_bool().ok());
  EXPECT_FALSE(d["bits"].to_double().ok());
  EXPECT_FALSE(d["neg"].to_uint().ok());
  EXPECT_EQ(*d["neg"].to_int(), -1);
  EXPECT_FALSE(d["big"].to_int().ok());  // above INT64_MAX
  EXPECT_EQ(*d["big"].to_uint(), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(*d["a"][0].to_double(), 1.0);
}

// Safetensors data_offsets are uint64: no rounding through double anywhere.
TEST(Json, LargeIntegers) {
  JsonDoc d = parse_ok("[18446744073709551615, 9007199254740993, -9223372036854775808, 12345678901234567890]");
  EXPECT_EQ(d[0].as_uint(), 18446744073709551615ull);
  EXPECT_EQ(d[1].as_uint(), 9007199254740993ull);  // 2^53 + 1
  EXPECT_EQ(d[2].as_int(), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(d[3].as_uint(), 12345678901234567890ull);
  EXPECT_EQ(d.dump(), "[18446744073709551615,9007199254740993,-9223372036854775808,12345678901234567890]");
  JsonBuilder b;
  b.begin_array().value(uint64_t{18446744073709551615ull}).value(int64_t{-9223372036854775807 - 1}).end_array();
  EXPECT_EQ(b.finish().dump(), "[18446744073709551615,-9223372036854775808]");
  // Beyond uint64: a double, as nlohmann reads it.
  EXPECT_TRUE(parse_ok("[18446744073709551616]")[0].is_double());
}

TEST(Json, DoublesRoundTrip) {
  const double values[] = {0.1, 1e-6, 1e-300, 5e-324, 1.7976931348623157e308, -2.5, 1e21, 123456.789, 1.0 / 3};
  for (double v : values) {
    JsonBuilder b;
    b.value(v);
    std::string text = b.finish().dump();
    JsonDoc back = parse_ok(text);
    ASSERT_TRUE(back.is_double()) << text;
    EXPECT_EQ(back.as_double(), v) << text;
  }
  JsonBuilder b;
  b.begin_array().value(1e-6).value(10000.0).value(0.5).value(1e21).value(-0.0).end_array();
  EXPECT_EQ(b.finish().dump(), "[1e-06,10000.0,0.5,1e+21,-0.0]");
  JsonBuilder nan;
  nan.value(std::nan(""));
  EXPECT_EQ(nan.finish().dump(), "null");
}

TEST(Json, EscapingAndUnicode) {
  JsonBuilder b;
  b.begin_object()
      .field("q", "a\"b\\c")
      .field("ctl", std::string("\n\t\x01\x1f", 4))
      .field("utf8", "h\xC3\xA9 \xE4\xBD\xA0 \xF0\x9F\x98\x80")
      .field("bad", "a\xFF" "b\xC3")
      .end_object();
  JsonDoc d = b.finish();
  EXPECT_EQ(d.dump(), "{\"bad\":\"a\xEF\xBF\xBD" "b\xEF\xBF\xBD\",\"ctl\":\"\\n\\t\\u0001\\u001f\",\"q\":\"a\\\"b\\\\c\","
                      "\"utf8\":\"h\xC3\xA9 \xE4\xBD\xA0 \xF0\x9F\x98\x80\"}");
  EXPECT_EQ(json_quote("a\"\n"), "\"a\\\"\\n\"");
  EXPECT_EQ(json_quote("\xFF"), "\"\xEF\xBF\xBD\"");
  // \u escapes, surrogate pairs included, decode to UTF-8.
  JsonDoc u = parse_ok(R"(["\u00e9", "\ud83d\ude00", "\u0000x"])");
  EXPECT_EQ(u[0].as_string(), "\xC3\xA9");
  EXPECT_EQ(u[1].as_string(), "\xF0\x9F\x98\x80");
  EXPECT_EQ(u[2].as_string(), std::string("\0x", 2));
  EXPECT_EQ(u.dump(), "[\"\xC3\xA9\",\"\xF0\x9F\x98\x80\",\"\\u0000x\"]");
}

TEST(Json, KeyOrderAndIndent) {
  const char* text = R"({"b": 1, "a": {"d": [], "c": {}}})";
  EXPECT_EQ(parse_ok(text).dump(), R"({"a":{"c":{},"d":[]},"b":1})");
  JsonDoc o = parse_ok(text, true);
  EXPECT_TRUE(o.ordered());
  EXPECT_EQ(o.dump(), R"({"b":1,"a":{"d":[],"c":{}}})");
  EXPECT_EQ(o.dump(1), "{\n \"b\": 1,\n \"a\": {\n  \"d\": [],\n  \"c\": {}\n }\n}");
  std::vector<std::string> keys;
  for (const JsonMember& m : o.members()) keys.push_back(m.key);
  EXPECT_EQ(keys, (std::vector<std::string>{"b", "a"}));
  keys.clear();
  JsonDoc sorted = parse_ok(text);
  for (const JsonMember& m : sorted.members()) keys.push_back(m.key);
  EXPECT_EQ(keys, (std::vector<std::string>{"a", "b"}));
  int64_t sum = 0;
  JsonDoc a = parse_ok("[1, 2, 3]");
  for (JsonRef v : a.elements()) sum += v.as_int();
  EXPECT_EQ(sum, 6);
  EXPECT_EQ(parse_ok("{}").elements().size(), 0u);
  EXPECT_TRUE(parse_ok("[1]").members().empty());
}

TEST(Json, BuilderSortedAndOrdered) {
  for (bool ordered : {false, true}) {
    JsonBuilder b(ordered);
    b.begin_object().field("z", 1).key("arr").begin_array().value(true).null().value("s").end_array();
    b.field("shape", std::vector<int64_t>{2, 3}).field("names", std::vector<std::string>{"x", "y"});
    b.key("a").begin_object().field("k", 2.5).end_object();
    b.field("z", 2);  // a repeated key replaces
    b.end_object();
    EXPECT_EQ(b.depth(), 0u);
    JsonDoc d = b.finish();
    EXPECT_EQ(d.ordered(), ordered);
    EXPECT_EQ(d.dump(), ordered ? R"({"z":2,"arr":[true,null,"s"],"shape":[2,3],"names":["x","y"],"a":{"k":2.5}})"
                                : R"({"a":{"k":2.5},"arr":[true,null,"s"],"names":["x","y"],"shape":[2,3],"z":2})");
  }
}

TEST(Json, DocEditsAndCopies) {
  JsonDoc src = parse_ok(R"({"b": 1, "a": [1, {"y": 1, "x": 2}]})");
  JsonDoc o = JsonDoc::object(true);
  o.set("k2", src["a"]);
  o.set("k1", src);
  o.set("k2", src["b"]);  // replaces, keeps its place
  EXPECT_EQ(o.dump(), R"({"k2":1,"k1":{"a":[1,{"x":2,"y":1}],"b":1}})");
  JsonDoc arr = JsonDoc::array();
  arr.push_back(parse_ok(R"({"q": 1, "p": 2})", true));
  arr.push_back(JsonRef());
  EXPECT_EQ(arr.dump(), R"([{"p":2,"q":1},null])");
  JsonDoc copy = arr;
  JsonDoc moved = std::move(arr);
  EXPECT_EQ(copy.dump(), moved.dump());
  JsonRef inner = moved[0];
  JsonDoc moved2 = std::move(moved);
  EXPECT_EQ(inner["p"].as_int(), 2);  // refs survive a move of the document
  JsonDoc empty;
  EXPECT_TRUE(empty.is_null());
  EXPECT_EQ(empty.dump(), "null");
}

namespace {
struct Recorder : JsonSax {
  std::string log;
  bool null() override { log += "n "; return true; }
  bool boolean(bool v) override { log += v ? "T " : "F "; return true; }
  bool integer(int64_t v) override { log += "i" + std::to_string(v) + " "; return true; }
  bool unsigned_integer(uint64_t v) override { log += "u" + std::to_string(v) + " "; return true; }
  bool number(double v) override { log += "d" + std::to_string(v) + " "; return true; }
  bool string(std::string& v) override { log += "s:" + v + " "; return true; }
  bool key(std::string& k) override { log += "k:" + k + " "; return k != "stop"; }
  bool start_object() override { log += "{ "; return true; }
  bool end_object() override { log += "} "; return true; }
  bool start_array() override { log += "[ "; return true; }
  bool end_array() override { log += "] "; return true; }
};
}  // namespace

TEST(Json, SaxEvents) {
  Recorder r;
  ASSERT_TRUE(parse_json_sax(R"({"a": [null, true, -2, 3, 0.5, "x"], "b": {}})", r).ok());
  EXPECT_EQ(r.log, "{ k:a [ n T i-2 u3 d0.500000 s:x ] k:b { } } ");
  Recorder bad;
  Status s = parse_json_sax("[1, }", bad);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("parse error at line 1, column 5"), std::string::npos) << s.message();
  Recorder stop;
  EXPECT_EQ(parse_json_sax(R"({"stop": 1})", stop).message(), "stopped");
}

// The facade parses through nlohmann's SAX parser into a JsonBuilder: the documents, dumps and
// error messages are those of nlohmann's own parse() (what the code before the facade used).
TEST(Json, SameAsNlohmannParse) {
  const char* good[] = {
      R"({"b": [1, -2, 3.25, 1e300, 18446744073709551616, "x\u00e9\n"], "a": {"z": null, "y": false}, "b2": {}})",
      R"({"k": 1, "k": 2, "j": [[], [{}]]})",  // a repeated key: the last value wins
      "  [0.1, 1E+2, -0.0, 123456789012345678901234567890]  ",
      "\"just a string\"", "42", "true", "null"};
  for (const char* t : good) {
    JsonDoc sorted = parse_ok(t), ordered = parse_ok(t, true);
    EXPECT_EQ(sorted.dump(), nlohmann::json::parse(t).dump()) << t;
    EXPECT_EQ(ordered.dump(2), nlohmann::ordered_json::parse(t).dump(2)) << t;
  }
  const char* bad[] = {"", "{", "[1,]", "{\"a\" 1}", "[1] 2", "\"\\x\"", "tru", "01", "[1e400]", "[\"\x01\"]", "{\"a\":}"};
  for (const char* t : bad) {
    std::string want;
    try {
      [[maybe_unused]] const nlohmann::json parsed = nlohmann::json::parse(t);
    } catch (const nlohmann::json::exception& e) {
      want = e.what();
    }
    ASSERT_FALSE(want.empty()) << t;
    EXPECT_EQ(parse_err(t), want) << t;
    auto o = parse_json_ordered(t);
    ASSERT_FALSE(o.ok());
    EXPECT_EQ(o.status().message(), want) << t;
  }
}
