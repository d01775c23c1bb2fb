// Tokenizer tests: ids and decoded text identical to Hugging Face `tokenizers` on every case of
// tests/fixtures/tokenizer/cases.jsonl (written by tools/make_tokenizer_fixtures.py), the streaming
// detokenizer on characters split across tokens, and clear errors for malformed tokenizer.json.
// A mismatch report lists every failing case, not just the first.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/tokenizer.h"
#include "text/utf8.h"

using ck::text::StreamDecoder;
using ck::text::Tokenizer;
using json = nlohmann::json;

namespace {

const std::string kDir = std::string(CK_SOURCE_DIR) + "/tests/fixtures/tokenizer";

const Tokenizer& qwen3() {
  static Tokenizer* tok = [] {
    auto r = Tokenizer::load(kDir + "/qwen3/tokenizer.json");
    if (!r.ok()) {
      ADD_FAILURE() << r.status().message();
      return new Tokenizer();
    }
    return new Tokenizer(std::move(r).value());
  }();
  return *tok;
}

std::string from_hex(const std::string& h) {
  std::string out;
  for (size_t i = 0; i + 1 < h.size(); i += 2) out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
  return out;
}

std::string ids_str(const std::vector<int32_t>& ids, size_t max_n = 40) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size() && i < max_n; ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  if (ids.size() > max_n) s += ",... (" + std::to_string(ids.size()) + " ids)";
  return s + "]";
}

std::string preview(const std::string& s) {
  std::string p = json(ck::text::utf8_repair(s.substr(0, 80))).dump();
  return s.size() > 80 ? p + "..." : p;
}

}  // namespace

TEST(Tokenizer, MatchesHuggingFaceOnEveryFixtureCase) {
  const Tokenizer& tok = qwen3();
  ASSERT_GT(tok.vocab_size(), 0);
  std::ifstream in(kDir + "/cases.jsonl");
  ASSERT_TRUE(in) << "missing " << kDir << "/cases.jsonl (run tools/make_tokenizer_fixtures.py)";
  std::string line;
  size_t n_cases = 0;
  std::vector<std::string> failures;
  while (std::getline(in, line)) {
    json c = json::parse(line);
    ++n_cases;
    std::string text = c.contains("hex") ? from_hex(c["hex"]) : c["text"].get<std::string>();
    std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    std::string tag = fmt::format("case {} ({}) {}", c["i"].get<int>(), c["cat"].get<std::string>(), preview(text));

    std::vector<int32_t> got = tok.encode(text, c["special"].get<bool>());
    if (got != want) {
      size_t k = 0;
      while (k < got.size() && k < want.size() && got[k] == want[k]) ++k;
      failures.push_back(fmt::format("{}: ids differ at index {}\n    want {}\n    got  {}", tag, k,
                                     ids_str(std::vector<int32_t>(want.begin() + k, want.end())),
                                     ids_str(std::vector<int32_t>(got.begin() + std::min(k, got.size()), got.end()))));
    }
    // Decoding is checked on HF's ids, so a decode bug shows even where encode also differs.
    std::string dec = tok.decode(want);
    if (dec != c["decoded"].get<std::string>())
      failures.push_back(fmt::format("{}: decode differs: got {}", tag, preview(dec)));
    if (tok.decode(want, true) != c["decoded_skip"].get<std::string>())
      failures.push_back(fmt::format("{}: decode(skip_special) differs", tag));

    StreamDecoder sd(tok);
    std::string streamed;
    bool broken = false;
    for (int32_t id : want) {
      std::string piece = sd.push(id);
      broken |= !ck::text::utf8_is_valid(piece);
      streamed += piece;
    }
    streamed += sd.flush();
    if (broken) failures.push_back(fmt::format("{}: StreamDecoder emitted broken UTF-8", tag));
    if (streamed != dec) failures.push_back(fmt::format("{}: streamed text != decode", tag));
  }
  EXPECT_GE(n_cases, 2000u);
  if (!failures.empty()) {
    std::string all;
    for (auto& f : failures) all += "  " + f + "\n";
    ADD_FAILURE() << failures.size() << " mismatches over " << n_cases << " cases:\n" << all;
  }
}

TEST(Tokenizer, Lookups) {
  const Tokenizer& tok = qwen3();
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.token_to_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok.token_to_id("Ġthe"), 279);
  EXPECT_EQ(tok.token_to_id("no such token"), std::nullopt);
  EXPECT_EQ(tok.id_to_token(279), "Ġthe");
  EXPECT_EQ(tok.id_to_token(151645), "<|im_end|>");
  EXPECT_EQ(tok.id_to_token(-1), std::nullopt);
  EXPECT_EQ(tok.id_to_token(151669), std::nullopt);
  EXPECT_EQ(tok.token_bytes(279), " the");
  EXPECT_TRUE(tok.is_special(151645));
  EXPECT_FALSE(tok.is_special(151667));  // <think> is an added token but not special
  EXPECT_FALSE(tok.is_special(279));
  // Out-of-range ids are skipped by decode, as HF does.
  std::vector<int32_t> ids = {9707, -5, 999999999, 11};
  EXPECT_EQ(tok.decode(ids), "Hello,");
}

// The UTF-8 bytes of one character arrive in separate tokens: nothing is emitted until the
// character is complete, and an impossible continuation becomes U+FFFD at once.
TEST(StreamDecoder, HoldsBackSplitCharacters) {
  const Tokenizer& tok = qwen3();
  auto byte_token = [&](uint8_t b) {
    for (int32_t id = 0; id < tok.vocab_size(); ++id) {
      std::string_view v = tok.token_bytes(id);
      if (v.size() == 1 && static_cast<uint8_t>(v[0]) == b) return id;
    }
    return -1;
  };
  // U+1F600 = F0 9F 98 80
  std::vector<int32_t> emoji = {byte_token(0xF0), byte_token(0x9F), byte_token(0x98), byte_token(0x80)};
  StreamDecoder sd(tok);
  EXPECT_EQ(sd.push(emoji[0]), "");
  EXPECT_EQ(sd.push(emoji[1]), "");
  EXPECT_EQ(sd.push(emoji[2]), "");
  EXPECT_EQ(sd.push(emoji[3]), "\xF0\x9F\x98\x80");
  EXPECT_EQ(sd.flush(), "");

  // "a" then the first two bytes of a 3-byte character, then "b": the held bytes can never
  // complete, so they become one U+FFFD (Python's errors="replace" gives the same).
  StreamDecoder sd2(tok);
  EXPECT_EQ(sd2.push(*tok.token_to_id("a")), "a");
  EXPECT_EQ(sd2.push(byte_token(0xE4)), "");
  EXPECT_EQ(sd2.push(byte_token(0xBD)), "");
  EXPECT_EQ(sd2.push(*tok.token_to_id("b")), "\xEF\xBF\xBD" "b");
  // A stray continuation byte is invalid on arrival.
  EXPECT_EQ(sd2.push(byte_token(0x80)), "\xEF\xBF\xBD");
  // An incomplete tail at the end of the stream is flushed as U+FFFD.
  EXPECT_EQ(sd2.push(byte_token(0xF0)), "");
  EXPECT_EQ(sd2.flush(), "\xEF\xBF\xBD");

  // Real tokens of a CJK + emoji string, pushed one by one: every piece is valid UTF-8.
  std::string text = "你好😀👨‍👩‍👧 𪚥 é";
  std::vector<int32_t> ids = tok.encode(text);
  StreamDecoder sd3(tok);
  std::string out;
  for (int32_t id : ids) {
    std::string p = sd3.push(id);
    EXPECT_TRUE(ck::text::utf8_is_valid(p));
    out += p;
  }
  out += sd3.flush();
  EXPECT_EQ(out, text);

  StreamDecoder skip(tok, /*skip_special=*/true);
  EXPECT_EQ(skip.push(151644), "");
  EXPECT_EQ(skip.push(*tok.token_to_id("a")), "a");
}

TEST(Tokenizer, Utf8Repair) {
  using ck::text::utf8_repair;
  EXPECT_EQ(utf8_repair("abc"), "abc");
  EXPECT_EQ(utf8_repair("a\xFF" "b"), "a\xEF\xBF\xBD" "b");
  EXPECT_EQ(utf8_repair("\xE2\x82"), "\xEF\xBF\xBD");              // one maximal subpart
  EXPECT_EQ(utf8_repair("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(utf8_repair("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong
}

namespace {
std::string err_of(const std::string& json_text) {
  auto r = Tokenizer::from_json(json_text, "bad.json");
  return r.ok() ? std::string("(loaded)") : r.status().message();
}
// A minimal valid byte-level tokenizer.json, to be broken one field at a time.
json minimal_tokenizer() {
  json vocab = json::object();
  // GPT-2's byte characters: printable Latin-1 map to themselves, the rest from U+0100 on.
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    std::string ch;
    ck::text::utf8_append(ch, printable ? b : next++);
    vocab[ch] = b;
  }
  vocab["ab"] = 256;
  return json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"a b"})}}},
              {"normalizer", nullptr},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"decoder", {{"type", "ByteLevel"}}},
              {"added_tokens", json::array({{{"id", 257}, {"content", "<|x|>"}, {"special", true}}})}};
}
}  // namespace

TEST(Tokenizer, MinimalTokenizerWorks) {
  auto r = Tokenizer::from_json(minimal_tokenizer().dump(), "min.json");
  ASSERT_TRUE(r.ok()) << r.status().message();
  std::vector<int32_t> ids = r->encode("ab<|x|>ba");
  EXPECT_EQ(ids, (std::vector<int32_t>{256, 257, 'b', 'a'}));
  EXPECT_EQ(r->decode(ids), "ab<|x|>ba");
  EXPECT_EQ(r->decode(ids, true), "abba");
}

TEST(Tokenizer, MalformedTokenizerJsonGivesErrors) {
  EXPECT_NE(err_of("{not json").find("bad.json: malformed JSON"), std::string::npos);
  EXPECT_NE(err_of("[]").find("not a JSON object"), std::string::npos);
  EXPECT_NE(err_of("{}").find("missing \"model\""), std::string::npos);

  json t = minimal_tokenizer();
  t["model"]["type"] = "WordPiece";
  EXPECT_NE(err_of(t.dump()).find("only BPE"), std::string::npos);

  t = minimal_tokenizer();
  t["model"]["merges"] = json::array({"a zz"});
  EXPECT_NE(err_of(t.dump()).find("merges[0]"), std::string::npos);

  t = minimal_tokenizer();
  t["model"]["merges"] = json::array({42});
  EXPECT_NE(err_of(t.dump()).find("merges[0]"), std::string::npos);

  t = minimal_tokenizer();
  t["model"]["vocab"].erase("a");
  t["model"]["merges"] = json::array();
  EXPECT_NE(err_of(t.dump()).find("no token for byte 0x61"), std::string::npos);

  t = minimal_tokenizer();
  t["model"]["vocab"]["a"] = "zero";
  EXPECT_NE(err_of(t.dump()).find("not an integer"), std::string::npos);

  t = minimal_tokenizer();
  t["model"]["vocab"]["a"] = -3;
  EXPECT_NE(err_of(t.dump()).find("out of range"), std::string::npos);

  t = minimal_tokenizer();
  t["normalizer"] = {{"type", "Lowercase"}};
  EXPECT_NE(err_of(t.dump()).find("normalizer type \"Lowercase\""), std::string::npos);

  t = minimal_tokenizer();
  t["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}};
  EXPECT_NE(err_of(t.dump()).find("cannot compile split regex"), std::string::npos);

  t = minimal_tokenizer();
  t["decoder"] = nullptr;
  EXPECT_NE(err_of(t.dump()).find("decoder"), std::string::npos);

  t = minimal_tokenizer();
  t["added_tokens"] = json::array({{{"id", "x"}}});
  EXPECT_NE(err_of(t.dump()).find("added_tokens[0]"), std::string::npos);

  t = minimal_tokenizer();
  t["model"]["vocab"] = json::array();
  EXPECT_NE(err_of(t.dump()).find("model.vocab"), std::string::npos);

  auto missing = Tokenizer::load("/nonexistent/tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/tokenizer.json"), std::string::npos);
}

// Random bytes, including invalid UTF-8 and special-token fragments: encode never crashes,
// every id is in range, decode gives valid UTF-8, and ASCII text round-trips exactly.
TEST(Tokenizer, RandomBytesNeverCrash) {
  const Tokenizer& tok = qwen3();
  std::mt19937 rng(99);
  const std::string pieces[] = {"<|im_start|>", "<|im_end|>", "<think>", "<|", "\xF0\x9F", "\xE4\xBD\xA0", " ", "\n", "'s"};
  for (int k = 0; k < 2000; ++k) {
    std::string s;
    size_t len = rng() % 200;
    bool ascii = k % 2 == 0;
    while (s.size() < len) {
      if (!ascii && rng() % 8 == 0) s += pieces[rng() % std::size(pieces)];
      else s += static_cast<char>(ascii ? 32 + rng() % 95 : rng() % 256);
    }
    std::vector<int32_t> ids = tok.encode(s, rng() % 2 == 0);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size()) << id;
    std::string back = tok.decode(ids);
    ASSERT_TRUE(ck::text::utf8_is_valid(back));
    if (ascii) {
      EXPECT_EQ(back, s);
    }
  }
}
