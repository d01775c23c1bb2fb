// Byte-level BPE tokenizer (see tokenizer.h): loading and validating tokenizer.json, the encode
// pipeline (added tokens -> NFC -> regex split -> BPE) and decoding. The pipeline mirrors
// huggingface/tokenizers (tokenizer/added_vocabulary.rs, pre_tokenizers/byte_level.rs,
// models/bpe/word.rs) step for step, because "same ids as HF" is the contract.
#include "text/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <queue>
#include <unordered_map>

#include "util/json.h"

#include "text/utf8.h"
#include "util/file.h"
#include "util/log.h"

namespace ck::text {


// A named namespace, not an anonymous one: TokenizerImpl (declared in tokenizer.h, so of external
// linkage) holds these types, and GCC warns (-Wsubobject-linkage) about anonymous ones there.
namespace tokenizer_detail {

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100 onwards in byte order, so every byte has a visible, non-space character.
struct ByteLevelTable {
  uint32_t byte_to_cp[256];
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  ByteLevelTable() {
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : next++;
      cp_to_byte[byte_to_cp[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteLevelTable& byte_level() {
  static const ByteLevelTable t;
  return t;
}

// Maps a byte-level token string ("Ġthe") back to its bytes (" the"). False if some character is
// not one of the 256 byte characters.
bool byte_level_to_bytes(std::string_view token, std::string& out) {
  out.clear();
  const auto& t = byte_level();
  size_t i = 0;
  while (i < token.size()) {
    uint32_t cp = utf8_decode_at(token, i);
    auto it = t.cp_to_byte.find(cp);
    if (it == t.cp_to_byte.end()) return false;
    out += static_cast<char>(it->second);
  }
  return true;
}

// (left id, right id) -> (rank, merged id), open addressing. The merge lookup is the inner loop
// of BPE: key and value share one 16-byte entry so a probe touches one cache line (the table is
// 4 MB for 151k merges, far beyond L2), and std::unordered_map's node chasing cost about 2x.
class MergeTable {
 public:
  struct Value { int32_t rank; int32_t id; };
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 3 / 2) cap <<= 1;
    entries_.assign(cap, Entry{kEmpty, {0, 0}});
    mask_ = cap - 1;
  }
  // A repeated pair overwrites the earlier entry, as HF's HashMap collect does.
  void insert(int32_t a, int32_t b, Value v) {
    uint64_t k = key(a, b);
    for (size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (entries_[i].key == kEmpty || entries_[i].key == k) { entries_[i] = {k, v}; return; }
    }
  }
  const Value* find(int32_t a, int32_t b) const {
    uint64_t k = key(a, b);
    for (size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (entries_[i].key == k) return &entries_[i].value;
      if (entries_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  struct Entry {
    uint64_t key;
    Value value;
  };
  static constexpr uint64_t kEmpty = ~0ull;
  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  static size_t hash(uint64_t k) { return (k * 0x9E3779B97F4A7C15ull) >> 20; }
  std::vector<Entry> entries_;
  size_t mask_ = 0;
};

struct AddedToken {
  std::string content;
  int32_t id;
  bool special;
};

struct Splitter {
  std::string pattern;  // as written in tokenizer.json, for error messages
  pcre2_code* code = nullptr;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

std::atomic<uint64_t> g_next_tokenizer_serial{1};

// BPE results of recent pieces, 2-way set associative: a slot holds one short piece and its ids
// inline; a new piece evicts the older of its two slots. No allocation and one cache line or two
// per lookup; an std::unordered_map<std::string, std::vector> here cost a third of encode time.
// 64k slots hold the ~36k distinct pieces of 5 MB of Python source with few evictions.
class PieceCache {
 public:
  static constexpr size_t kMaxKey = 30;  // bytes; longer pieces bypass the cache
  static constexpr size_t kMaxIds = 6;
  struct alignas(64) Slot {
    uint64_t hash;
    uint8_t key_len, n_ids;
    char key[kMaxKey];
    int32_t ids[kMaxIds];
  };
  static_assert(sizeof(Slot) == 64);  // one cache line
  static uint64_t hash_of(std::string_view s) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ s.size();
    size_t i = 0;
    for (; i + 8 <= s.size(); i += 8) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      h = (h ^ w) * 0xFF51AFD7ED558CCDull;
      h ^= h >> 32;
    }
    uint64_t w = 0;
    std::memcpy(&w, s.data() + i, s.size() - i);
    h = (h ^ w) * 0xC4CEB9FE1A85EC53ull;
    return h ^ (h >> 29);
  }
  void reset() { slots_.assign(kSlots, Slot{}); }
  const Slot* find(std::string_view s, uint64_t h) const {
    size_t b = h & (kSlots - 2);
    for (size_t k = b; k < b + 2; ++k) {
      const Slot& e = slots_[k];
      if (e.hash == h && e.key_len == s.size() && std::memcmp(e.key, s.data(), s.size()) == 0) return &e;
    }
    return nullptr;
  }
  void put(std::string_view s, uint64_t h, const int32_t* ids, size_t n) {
    if (s.size() > kMaxKey || n > kMaxIds) return;
    size_t b = h & (kSlots - 2);
    slots_[b + 1] = slots_[b];  // the previous newest becomes the older
    Slot& e = slots_[b];
    e.hash = h;
    e.key_len = static_cast<uint8_t>(s.size());
    e.n_ids = static_cast<uint8_t>(n);
    std::memcpy(e.key, s.data(), s.size());
    std::memcpy(e.ids, ids, n * sizeof(int32_t));
  }

 private:
  static constexpr size_t kSlots = 1 << 16;  // 4 MB per thread
  std::vector<Slot> slots_;
};

// Per-thread scratch: PCRE2 match data and JIT stack (neither may be shared between threads)
// and the BPE piece cache, which belongs to one tokenizer at a time (`owner`).
struct ThreadScratch {
  pcre2_match_data* match_data = nullptr;
  pcre2_match_context* match_ctx = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  uint64_t owner = 0;
  PieceCache cache;
  ThreadScratch() {
    match_data = pcre2_match_data_create(16, nullptr);
    match_ctx = pcre2_match_context_create(nullptr);
    // The default 32 KiB JIT stack can run out on very long whitespace runs (the `\s+(?!\S)`
    // alternative backtracks); 4 MiB covers megabyte inputs.
    jit_stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(match_ctx, nullptr, jit_stack);
  }
  ~ThreadScratch() {
    pcre2_match_data_free(match_data);
    pcre2_match_context_free(match_ctx);
    pcre2_jit_stack_free(jit_stack);
  }
};
ThreadScratch& scratch() {
  thread_local ThreadScratch s;
  return s;
}

// Pieces up to this many bytes merge with a flat array scan instead of a heap.
constexpr int32_t kSmallPiece = 48;

}  // namespace tokenizer_detail
using namespace tokenizer_detail;

struct TokenizerImpl {
  uint64_t serial = 0;
  std::vector<std::string> tokens;  // id -> token as in tokenizer.json
  std::vector<std::string> bytes;   // id -> bytes it decodes to
  std::vector<uint8_t> special;     // id -> special added token
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> token_ids;
  int32_t byte_ids[256];
  MergeTable merges;
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab_bytes;  // for ignore_merges
  bool ignore_merges = false;

  std::vector<AddedToken> added;                    // sorted longest first
  std::vector<std::vector<uint16_t>> added_by_byte;  // first byte -> indices into `added`
  bool nfc = false;
  std::vector<Splitter> splitters;

  ~TokenizerImpl() {
    for (auto& s : splitters) pcre2_code_free(s.code);
  }

  void encode_segment(std::string_view seg, std::vector<int32_t>& ids) const;
  void split(std::string_view piece, size_t level, std::vector<int32_t>& ids) const;
  void bpe(std::string_view piece, std::vector<int32_t>& ids) const;
  void bpe_merge(std::string_view piece, std::vector<int32_t>& out) const;
};

// ---------------------------------------------------------------------------------------------
// Loading

namespace {

// tokenizer.json in one pass: model.vocab and model.merges (nearly all of its 11 MB) go straight
// into vectors, everything else becomes a DOM. Building the DOM for them (map nodes, string
// copies) and walking it again took most of a one-second load.
struct RawTokenizer {
  JsonDoc rest;  // the document without model.vocab / model.merges when those were streamed
  bool vocab_streamed = false, merges_streamed = false;
  std::vector<std::pair<std::string, int64_t>> vocab;
  std::vector<std::pair<std::string, std::string>> merges;
  std::string stream_error;  // the first malformed entry inside a streamed section
};

class TokenizerSax final : public JsonSax {
 public:
  explicit TokenizerSax(RawTokenizer& out) : out_(out) {}

  bool null() override {
    if (!stream_other()) dom().null();
    return true;
  }
  bool boolean(bool v) override {
    if (!stream_other()) dom().value(v);
    return true;
  }
  bool integer(int64_t v) override {
    if (!vocab_id(v) && !stream_other()) dom().value(v);
    return true;
  }
  bool unsigned_integer(uint64_t v) override {
    if (!vocab_id(v > static_cast<uint64_t>(INT64_MAX) ? -1 : static_cast<int64_t>(v)) && !stream_other()) dom().value(v);
    return true;
  }
  bool number(double v) override {
    if (!stream_other()) dom().value(v);
    return true;
  }
  bool string(std::string& v) override {
    if (mode_ == Mode::Merges && nest_ == 0) {
      size_t sp = v.find(' ');
      if (sp == std::string::npos || v.find(' ', sp + 1) != std::string::npos)
        stream_fail(fmt::format("model.merges[{}]: {} is not two tokens separated by one space", n_merges_, json_quote(v)));
      else
        out_.merges.emplace_back(v.substr(0, sp), v.substr(sp + 1));
      ++n_merges_;
      return true;
    }
    if (mode_ == Mode::Merges && nest_ == 1) {
      pair_.push_back(std::move(v));
      return true;
    }
    if (!stream_other()) dom().value(std::move(v));
    return true;
  }
  bool key(std::string& k) override {
    if (mode_ == Mode::Vocab) {
      vocab_key_ = std::move(k);
    } else if (mode_ == Mode::Dom) {
      keys_.back() = std::move(k);
      key_pending_ = true;
    }
    return true;
  }
  bool start_object() override {
    if (mode_ != Mode::Dom) {
      ++nest_;
      if (mode_ == Mode::Vocab) stream_fail(fmt::format("model.vocab[{}]: id is not an integer", json_quote(vocab_key_)));
      else merge_fail();
      return true;
    }
    if (at_model_key("vocab")) {
      key_pending_ = false;  // the member stays out of the DOM
      mode_ = Mode::Vocab;
      out_.vocab_streamed = true;
      out_.vocab.reserve(1 << 18);
      return true;
    }
    dom().begin_object();
    open(true);
    return true;
  }
  bool end_object() override {
    if (mode_ == Mode::Vocab && nest_ == 0) { mode_ = Mode::Dom; return true; }
    if (mode_ != Mode::Dom) { --nest_; return true; }
    dom_.end_object();
    close();
    return true;
  }
  bool start_array() override {
    if (mode_ == Mode::Merges) {
      if (++nest_ == 1) {
        pair_.clear();
        pair_bad_ = false;
      }
      else merge_fail();
      return true;
    }
    if (mode_ == Mode::Vocab) {
      ++nest_;
      stream_fail(fmt::format("model.vocab[{}]: id is not an integer", json_quote(vocab_key_)));
      return true;
    }
    if (at_model_key("merges")) {
      key_pending_ = false;
      mode_ = Mode::Merges;
      out_.merges_streamed = true;
      out_.merges.reserve(1 << 18);
      return true;
    }
    dom().begin_array();
    open(false);
    return true;
  }
  bool end_array() override {
    if (mode_ == Mode::Merges && nest_ == 0) { mode_ = Mode::Dom; return true; }
    if (mode_ == Mode::Merges && nest_ == 1) {
      if (pair_.size() == 2 && !pair_bad_) out_.merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
      else merge_fail();
      ++n_merges_;
      --nest_;
      return true;
    }
    if (mode_ != Mode::Dom) { --nest_; return true; }
    dom_.end_array();
    close();
    return true;
  }

  // The DOM of everything not streamed; only after a successful parse.
  JsonDoc finish() { return dom_.finish(); }

 private:
  enum class Mode { Dom, Vocab, Merges };

  // The DOM builder, after the key of the member that now gets its value.
  JsonBuilder& dom() {
    if (key_pending_) {
      dom_.key(keys_.back());
      key_pending_ = false;
    }
    return dom_;
  }
  bool vocab_id(int64_t v) {
    if (mode_ != Mode::Vocab || nest_ != 0) return false;
    out_.vocab.emplace_back(std::move(vocab_key_), v);
    return true;
  }
  // A value inside a streamed section that is not a vocab id or a merge string: an error there
  // (at the section's own level). False outside the streamed sections: the value goes to the DOM.
  bool stream_other() {
    if (mode_ == Mode::Vocab) {
      if (nest_ == 0) stream_fail(fmt::format("model.vocab[{}]: id is not an integer", json_quote(vocab_key_)));
      return true;
    }
    if (mode_ == Mode::Merges) {
      if (nest_ == 0) { merge_fail(); ++n_merges_; }
      else if (nest_ == 1) pair_bad_ = true;  // a non-string inside a pair
      return true;
    }
    return false;
  }
  void open(bool object) {
    keys_.emplace_back();
    is_object_.push_back(object);
  }
  void close() {
    keys_.pop_back();
    is_object_.pop_back();
  }
  // True when the container being opened is root["model"][key].
  bool at_model_key(const char* key) const {
    return keys_.size() == 2 && is_object_[0] && keys_[0] == "model" && is_object_[1] && keys_[1] == key;
  }
  void stream_fail(std::string msg) {
    if (out_.stream_error.empty()) out_.stream_error = std::move(msg);
  }
  void merge_fail() {
    stream_fail(fmt::format("model.merges[{}]: expected \"a b\" or [\"a\", \"b\"]", n_merges_));
  }

  RawTokenizer& out_;
  JsonBuilder dom_;
  Mode mode_ = Mode::Dom;
  int nest_ = 0;  // containers opened inside a streamed section
  std::vector<std::string> keys_;  // per open DOM container: the current key (objects)
  std::vector<bool> is_object_;
  bool key_pending_ = false;  // keys_.back() is not yet given to dom_
  std::string vocab_key_;
  std::vector<std::string> pair_;
  bool pair_bad_ = false;
  size_t n_merges_ = 0;
};

// An optional true/false field: `dflt` when absent. A null or any other type is an error.
Result<bool> flag(JsonRef obj, const char* key, bool dflt, const std::string& where) {
  if (!obj.contains(key)) return dflt;
  JsonRef v = obj[key];
  if (!v.is_bool()) return error("{}.{} must be true or false, got {}", where, key, v.dump());
  return v.as_bool();
}

Status check_bool_false(JsonRef obj, const char* key, const std::string& where) {
  JsonRef v = obj[key];
  if (!v.is_null() && !(v.is_bool() && !v.as_bool()))
    return error("{}.{} = {} is not supported", where, key, v.dump());
  return {};
}

// Compiles one Split regex. HF compiles it with Oniguruma, whose \s is exactly the Unicode
// White_Space property. PCRE2's \s (with UCP) differs: it lacks U+0085 and adds U+180E, and
// "a \u180eb" then splits differently. So \s and \S are spelled out as White_Space classes.
constexpr const char* kWhiteSpace =
    "\\t\\n\\x{0B}\\f\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

Result<pcre2_code*> compile_split_regex(const std::string& pattern, const std::string& where) {
  std::string p;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      char d = pattern[i + 1];
      if (d == 's') {
        p += in_class ? std::string(kWhiteSpace) : fmt::format("[{}]", kWhiteSpace);
      } else if (d == 'S') {
        if (in_class) return error("{}: `\\S` inside a character class is not supported: {}", where, pattern);
        p += fmt::format("[^{}]", kWhiteSpace);
      } else {
        p += c;
        p += d;
      }
      ++i;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      p += c;
      // A ']' right after '[' or '[^' is a literal, not the end of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') { p += '^'; ++i; }
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') { p += ']'; ++i; }
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    p += c;
  }
  int err = 0;
  PCRE2_SIZE err_off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(),
                                   PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
  if (!code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof buf);
    return error("{}: cannot compile split regex at offset {}: {}: {}", where, err_off,
                 reinterpret_cast<char*>(buf), pattern);
  }
  if (pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) != 0)
    LOG_WRN("text", "{}: PCRE2 JIT unavailable, regex split runs interpreted (slower)", where);
  return code;
}

// GPT-2's pattern, used by a ByteLevel pre-tokenizer with use_regex=true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

Status add_pre_tokenizer(TokenizerImpl& t, JsonRef pt, const std::string& where) {
  if (pt.is_null()) return {};
  if (!pt.is_object() || !pt["type"].is_string()) return error("{}: expected an object with a \"type\"", where);
  const std::string& type = pt["type"].as_string();
  if (type == "Sequence") {
    if (!pt.contains("pretokenizers") || !pt["pretokenizers"].is_array())
      return error("{}: Sequence without a \"pretokenizers\" array", where);
    for (size_t i = 0; i < pt["pretokenizers"].size(); ++i)
      TRY(add_pre_tokenizer(t, pt["pretokenizers"][i], fmt::format("{}.pretokenizers[{}]", where, i)));
    return {};
  }
  if (type == "Split") {
    JsonRef pat = pt["pattern"];
    std::string regex;
    if (pat["Regex"].is_string()) {
      regex = pat["Regex"].as_string();
    } else {
      return error("{}: Split needs {{\"pattern\": {{\"Regex\": ...}}}} (String patterns are not supported)", where);
    }
    if (!(pt["behavior"] == "Isolated"))
      return error("{}: Split behavior {} is not supported (only \"Isolated\")", where, pt["behavior"].dump());
    ASSIGN_OR_RETURN(bool invert, flag(pt, "invert", false, where));
    if (invert) return error("{}: Split with invert=true is not supported", where);
    ASSIGN_OR_RETURN(pcre2_code * code, compile_split_regex(regex, where));
    t.splitters.push_back({regex, code});
    return {};
  }
  if (type == "ByteLevel") {
    ASSIGN_OR_RETURN(bool add_prefix_space, flag(pt, "add_prefix_space", false, where));
    if (add_prefix_space) return error("{}: ByteLevel add_prefix_space=true is not supported", where);
    ASSIGN_OR_RETURN(bool use_regex, flag(pt, "use_regex", true, where));
    if (use_regex) {
      ASSIGN_OR_RETURN(pcre2_code * code, compile_split_regex(kGpt2Pattern, where));
      t.splitters.push_back({kGpt2Pattern, code});
    }
    return {};  // the byte->char mapping itself is implicit: we run BPE on bytes
  }
  return error("{}: pre-tokenizer type \"{}\" is not supported", where, type);
}

Status add_normalizer(TokenizerImpl& t, JsonRef n, const std::string& where) {
  if (n.is_null()) return {};
  if (!n.is_object() || !n["type"].is_string()) return error("{}: expected an object with a \"type\"", where);
  const std::string& type = n["type"].as_string();
  if (type == "NFC") { t.nfc = true; return {}; }
  if (type == "Sequence") {
    if (!n.contains("normalizers") || !n["normalizers"].is_array())
      return error("{}: Sequence without a \"normalizers\" array", where);
    for (size_t i = 0; i < n["normalizers"].size(); ++i)
      TRY(add_normalizer(t, n["normalizers"][i], fmt::format("{}.normalizers[{}]", where, i)));
    return {};
  }
  return error("{}: normalizer type \"{}\" is not supported (only NFC)", where, type);
}

Status set_id(TokenizerImpl& t, int64_t id, const std::string& token, const std::string& where) {
  if (id < 0 || id > 16 * 1024 * 1024) return error("{}: token id {} out of range", where, id);
  if (static_cast<size_t>(id) >= t.tokens.size()) {
    t.tokens.resize(id + 1);
    t.bytes.resize(id + 1);
    t.special.resize(id + 1, 0);
  }
  t.tokens[id] = token;
  t.token_ids[token] = id;
  return {};
}

Status load_impl(TokenizerImpl& t, const RawTokenizer& raw, const std::string& origin) {
  JsonRef root = raw.rest;
  if (!root.is_object()) return error("{}: top level is not a JSON object", origin);
  if (!root["model"].is_object()) return error("{}: missing \"model\" object", origin);
  JsonRef model = root["model"];
  std::string where = origin + ": model";
  if (model.contains("type") && !(model["type"] == "BPE"))
    return error("{}.type = {} is not supported (only BPE)", where, model["type"].dump());
  TRY(check_bool_false(model, "byte_fallback", where));
  if (model.contains("dropout") && !model["dropout"].is_null())
    return error("{}.dropout is set; BPE dropout is not supported", where);
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!model[k].is_null() && !(model[k] == ""))
      return error("{}.{} = {} is not supported", where, k, model[k].dump());
  }
  ASSIGN_OR_RETURN(t.ignore_merges, flag(model, "ignore_merges", false, where));
  if (!raw.vocab_streamed) return error("{}.vocab: expected an object of token -> id", where);
  if (!raw.merges_streamed) return error("{}.merges: expected an array", where);
  if (!raw.stream_error.empty()) return error("{}: {}", origin, raw.stream_error);
  // The normalizer first: added tokens check against it.
  TRY(add_normalizer(t, root["normalizer"], origin + ": normalizer"));

  t.token_ids.reserve(raw.vocab.size() + 1024);
  const std::string vocab_where = where + ".vocab";
  for (const auto& [token, id] : raw.vocab) TRY(set_id(t, id, token, vocab_where));
  std::fill(std::begin(t.byte_ids), std::end(t.byte_ids), -1);
  std::string buf;
  for (size_t id = 0; id < t.tokens.size(); ++id) {
    if (t.tokens[id].empty()) continue;
    if (!byte_level_to_bytes(t.tokens[id], buf)) continue;
    if (buf.size() == 1) t.byte_ids[static_cast<uint8_t>(buf[0])] = static_cast<int32_t>(id);
    if (t.ignore_merges) t.vocab_bytes[buf] = static_cast<int32_t>(id);
  }
  for (int b = 0; b < 256; ++b) {
    if (t.byte_ids[b] < 0)
      return error("{}.vocab: no token for byte 0x{:02X}; not a byte-level BPE vocabulary", where, b);
  }

  t.merges.reserve(raw.merges.size());
  std::string ab;
  for (size_t r = 0; r < raw.merges.size(); ++r) {
    const auto& [a, b] = raw.merges[r];
    ab.assign(a).append(b);
    auto ia = t.token_ids.find(a), ib = t.token_ids.find(b), iab = t.token_ids.find(ab);
    if (ia == t.token_ids.end() || ib == t.token_ids.end() || iab == t.token_ids.end())
      return error("{}.merges[{}]: [{}, {}] uses a token missing from the vocabulary", where, r, json_quote(a),
                   json_quote(b));
    t.merges.insert(ia->second, ib->second, {static_cast<int32_t>(r), iab->second});
  }

  if (!root["added_tokens"].is_null()) {
    JsonRef added = root["added_tokens"];
    if (!added.is_array()) return error("{}: added_tokens: expected an array", origin);
    for (size_t i = 0; i < added.size(); ++i) {
      JsonRef a = added[i];
      std::string w = fmt::format("{}: added_tokens[{}]", origin, i);
      if (!a.is_object() || !a["id"].is_integer() || !a["content"].is_string() || a["content"].as_string().empty())
        return error("{}: needs an integer \"id\" and a non-empty string \"content\"", w);
      const std::string& content = a["content"].as_string();
      if (!utf8_is_valid(content)) return error("{}: content is not valid UTF-8", w);
      for (const char* k : {"single_word", "lstrip", "rstrip"}) {
        ASSIGN_OR_RETURN(bool set, flag(a, k, false, w));
        if (set) return error("{}: {} = true is not supported ({})", w, k, content);
      }
      ASSIGN_OR_RETURN(bool normalized, flag(a, "normalized", false, w));
      if (normalized && t.nfc) return error("{}: normalized = true is not supported ({})", w, content);
      int32_t id = static_cast<int32_t>(a["id"].as_int());
      TRY(set_id(t, id, content, w));
      ASSIGN_OR_RETURN(bool special, flag(a, "special", false, w));
      t.special[id] = special;
      t.added.push_back({content, id, static_cast<bool>(t.special[id])});
    }
  }
  // Leftmost-longest matching: at one position, try the longest candidates first.
  std::stable_sort(t.added.begin(), t.added.end(),
                   [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
  t.added_by_byte.assign(256, {});
  for (size_t i = 0; i < t.added.size(); ++i)
    t.added_by_byte[static_cast<uint8_t>(t.added[i].content[0])].push_back(static_cast<uint16_t>(i));

  TRY(add_pre_tokenizer(t, root["pre_tokenizer"], origin + ": pre_tokenizer"));
  JsonRef dec = root["decoder"];
  if (!dec.is_object() || !(dec["type"] == "ByteLevel"))
    return error("{}: decoder: {} is not supported (only ByteLevel)", origin, dec.dump());

  // What each id decodes to, per HF's ByteLevel decoder: a token whose characters are all byte
  // characters maps to those bytes; any other token (an added token with a space, say) is taken
  // as its raw UTF-8.
  for (size_t id = 0; id < t.tokens.size(); ++id) {
    if (t.tokens[id].empty()) continue;
    if (!byte_level_to_bytes(t.tokens[id], t.bytes[id])) t.bytes[id] = t.tokens[id];
  }
  return {};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Encoding

// BPE of one pre-tokenized piece. Mirrors tokenizers' Word::merge_all: always apply the merge of
// lowest rank, the leftmost one on ties, until none applies. Large pieces use HF's heap of
// candidates (stale entries skipped when popped); small ones keep the ranks of adjacent pairs in
// a flat array, which gives the same result without allocating.
void TokenizerImpl::bpe_merge(std::string_view piece, std::vector<int32_t>& out) const {
  int32_t n = static_cast<int32_t>(piece.size());
  if (n <= kSmallPiece) {
    int32_t id[kSmallPiece];
    int32_t rank[kSmallPiece];  // rank[i]: merge of id[i], id[i+1]; INT32_MAX if none
    int32_t merged[kSmallPiece];
    for (int32_t i = 0; i < n; ++i) id[i] = byte_ids[static_cast<uint8_t>(piece[i])];
    auto look = [&](int32_t i) {
      const auto* m = merges.find(id[i], id[i + 1]);
      rank[i] = m ? m->rank : INT32_MAX;
      merged[i] = m ? m->id : -1;
    };
    for (int32_t i = 0; i + 1 < n; ++i) look(i);
    rank[n - 1] = INT32_MAX;  // no pair right of the last symbol; keeps the shifts below defined
    while (n > 1) {
      int32_t best = 0;
      for (int32_t i = 1; i + 1 < n; ++i) {
        if (rank[i] < rank[best]) best = i;
      }
      if (rank[best] == INT32_MAX) break;
      id[best] = merged[best];
      for (int32_t i = best + 1; i + 1 < n; ++i) {
        id[i] = id[i + 1];
        rank[i] = rank[i + 1];
        merged[i] = merged[i + 1];
      }
      --n;
      if (best > 0) look(best - 1);
      if (best + 1 < n) look(best);
    }
    out.insert(out.end(), id, id + n);
    return;
  }

  struct Sym { int32_t id, prev, next, len; };
  struct Cand {
    int32_t rank, pos, new_id;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::vector<Sym> sym(n);
  for (int32_t i = 0; i < n; ++i) sym[i] = {byte_ids[static_cast<uint8_t>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1, 1};
  std::vector<Cand> heap_store;
  heap_store.reserve(n);
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap(std::greater<Cand>(), std::move(heap_store));
  for (int32_t i = 0; i + 1 < n; ++i) {
    if (const auto* m = merges.find(sym[i].id, sym[i + 1].id)) heap.push({m->rank, i, m->id});
  }
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    Sym& s = sym[c.pos];
    if (s.len == 0 || s.next < 0) continue;
    Sym& r = sym[s.next];
    const auto* m = merges.find(s.id, r.id);
    // Stale if either side was merged since. Symbols only grow, so an equal merged id means
    // the very same pair.
    if (!m || m->id != c.new_id) continue;
    s.id = c.new_id;
    s.len += r.len;
    int32_t after = r.next;
    r.len = 0;
    s.next = after;
    if (after >= 0) sym[after].prev = c.pos;
    if (s.prev >= 0) {
      if (const auto* pm = merges.find(sym[s.prev].id, s.id)) heap.push({pm->rank, s.prev, pm->id});
    }
    if (after >= 0) {
      if (const auto* nm = merges.find(s.id, sym[after].id)) heap.push({nm->rank, c.pos, nm->id});
    }
  }
  for (int32_t i = 0; i >= 0 && i < n; i = sym[i].next) out.push_back(sym[i].id);
}

void TokenizerImpl::bpe(std::string_view piece, std::vector<int32_t>& ids) const {
  if (piece.size() == 1) {
    ids.push_back(byte_ids[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (ignore_merges) {
    auto it = vocab_bytes.find(piece);
    if (it != vocab_bytes.end()) { ids.push_back(it->second); return; }
  }
  if (piece.size() > PieceCache::kMaxKey) {
    bpe_merge(piece, ids);
    return;
  }
  ThreadScratch& s = scratch();
  if (s.owner != serial) {
    s.cache.reset();
    s.owner = serial;
  }
  uint64_t h = PieceCache::hash_of(piece);
  if (const PieceCache::Slot* e = s.cache.find(piece, h)) {
    ids.insert(ids.end(), e->ids, e->ids + e->n_ids);
    return;
  }
  size_t before = ids.size();
  bpe_merge(piece, ids);
  s.cache.put(piece, h, ids.data() + before, ids.size() - before);
}

// Applies splitters[level..] to `piece` (Isolated: matches and the gaps between them are pieces),
// then BPE to each final piece.
void TokenizerImpl::split(std::string_view piece, size_t level, std::vector<int32_t>& ids) const {
  if (piece.empty()) return;
  if (level == splitters.size()) {
    bpe(piece, ids);
    return;
  }
  ThreadScratch& s = scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
  size_t pos = 0;  // start of the next match search
  size_t emitted = 0;
  while (pos < piece.size()) {
    int rc = pcre2_jit_match(splitters[level].code, subject, piece.size(), pos, PCRE2_NO_UTF_CHECK,
                             s.match_data, s.match_ctx);
    if (rc == PCRE2_ERROR_JIT_BADOPTION)  // not JIT-compiled
      rc = pcre2_match(splitters[level].code, subject, piece.size(), pos, PCRE2_NO_UTF_CHECK, s.match_data,
                       s.match_ctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      // Only resource limits get here (JIT stack on pathological input). Keep going with the
      // rest as one piece rather than dropping text; the ids may then differ from HF's.
      LOG_WRN("text", "tokenizer: regex split failed (PCRE2 error {}) at byte {}; rest kept as one piece", rc, pos);
      break;
    }
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.match_data);
    size_t m0 = ov[0], m1 = ov[1];
    if (m0 > emitted) split(piece.substr(emitted, m0 - emitted), level + 1, ids);
    if (m1 > m0) split(piece.substr(m0, m1 - m0), level + 1, ids);
    emitted = m1;
    if (m1 == m0) {  // empty match: step one character (HF's find_iter does the same)
      size_t k = m1 + 1;
      while (k < piece.size() && (static_cast<uint8_t>(piece[k]) & 0xC0) == 0x80) ++k;
      pos = k;
    } else {
      pos = m1;
    }
  }
  if (emitted < piece.size()) split(piece.substr(emitted), level + 1, ids);
}

namespace {
// NFC, skipping ICU when no code point >= U+0300 is present: every character below U+0300 is
// NFC_QC=Yes and never composes with a preceding one, so such text is already normalized.
bool maybe_needs_nfc(std::string_view s) {
  for (char c : s) {
    if (static_cast<uint8_t>(c) >= 0xCC) return true;
  }
  return false;
}

const icu::Normalizer2* nfc_instance() {
  static const icu::Normalizer2* n = [] {
    UErrorCode st = U_ZERO_ERROR;
    const icu::Normalizer2* p = icu::Normalizer2::getNFCInstance(st);
    CHECK_MSG(U_SUCCESS(st), "ICU NFC normalizer unavailable: {}", u_errorName(st));
    return p;
  }();
  return n;
}
}  // namespace

void TokenizerImpl::encode_segment(std::string_view seg, std::vector<int32_t>& ids) const {
  if (seg.empty()) return;
  if (nfc && maybe_needs_nfc(seg)) {
    const icu::Normalizer2* n = nfc_instance();
    UErrorCode st = U_ZERO_ERROR;
    if (!n->isNormalizedUTF8(icu::StringPiece(seg.data(), static_cast<int32_t>(seg.size())), st) && U_SUCCESS(st)) {
      std::string out;
      icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(seg.size()));
      n->normalizeUTF8(0, icu::StringPiece(seg.data(), static_cast<int32_t>(seg.size())), sink, nullptr, st);
      CHECK_MSG(U_SUCCESS(st), "ICU NFC failed on valid UTF-8: {}", u_errorName(st));
      split(out, 0, ids);
      return;
    }
  }
  split(seg, 0, ids);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text_in, bool allow_special) const {
  std::vector<int32_t> ids;
  if (!impl_) return ids;
  const TokenizerImpl& t = *impl_;
  std::string repaired;
  std::string_view text = text_in;
  if (!utf8_is_valid(text)) {
    repaired = utf8_repair(text);
    text = repaired;
  }
  ids.reserve(text.size() / 3 + 4);
  size_t seg_start = 0, i = 0;
  const size_t n = text.size();
  while (i < n) {
    const auto& cands = t.added_by_byte[static_cast<uint8_t>(text[i])];
    if (cands.empty()) { ++i; continue; }
    const AddedToken* hit = nullptr;
    for (uint16_t k : cands) {
      const AddedToken& a = t.added[k];
      if (text.compare(i, a.content.size(), a.content) == 0) { hit = &a; break; }
    }
    if (!hit) { ++i; continue; }
    if (hit->special && !allow_special) {  // matched but kept as text, like HF's encode_special_tokens
      i += hit->content.size();
      continue;
    }
    t.encode_segment(text.substr(seg_start, i - seg_start), ids);
    ids.push_back(hit->id);
    i += hit->content.size();
    seg_start = i;
  }
  t.encode_segment(text.substr(seg_start), ids);
  return ids;
}

// ---------------------------------------------------------------------------------------------
// Public API

Tokenizer::Tokenizer() = default;
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Result<Tokenizer> Tokenizer::from_json(std::string_view json_text, const std::string& origin) {
  RawTokenizer raw;
  {
    TokenizerSax sax(raw);
    Status parsed = parse_json_sax(json_text, sax);
    if (!parsed.ok()) return error("{}: malformed JSON: {}", origin, parsed.message());
    raw.rest = sax.finish();
  }
  Tokenizer tok;
  tok.impl_ = std::make_unique<TokenizerImpl>();
  tok.impl_->serial = g_next_tokenizer_serial.fetch_add(1);
  TRY(load_impl(*tok.impl_, raw, origin));
  return tok;
}

Result<Tokenizer> Tokenizer::load(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, read_file(path));
  return from_json(text, path);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string raw;
  if (!impl_) return raw;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) continue;
    if (skip_special && impl_->special[id]) continue;
    raw += impl_->bytes[id];
  }
  if (utf8_is_valid(raw)) return raw;
  return utf8_repair(raw);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (!impl_) return std::nullopt;
  auto it = impl_->token_ids.find(token);
  if (it == impl_->token_ids.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string_view> Tokenizer::id_to_token(int32_t id) const {
  if (!impl_ || id < 0 || id >= vocab_size() || impl_->tokens[id].empty()) return std::nullopt;
  return std::string_view(impl_->tokens[id]);
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (!impl_ || id < 0 || id >= vocab_size()) return {};
  return impl_->bytes[id];
}

bool Tokenizer::is_special(int32_t id) const {
  return impl_ && id >= 0 && id < vocab_size() && impl_->special[id];
}

int32_t Tokenizer::vocab_size() const { return impl_ ? static_cast<int32_t>(impl_->tokens.size()) : 0; }

// ---------------------------------------------------------------------------------------------
// Streaming

std::string StreamDecoder::push(int32_t id) {
  if (skip_special_ && tokenizer_->is_special(id)) return {};
  pending_ += tokenizer_->token_bytes(id);
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    size_t ok = utf8_valid_prefix(std::string_view(pending_).substr(i));
    out.append(pending_, i, ok);
    i += ok;
    if (i >= pending_.size()) break;
    Utf8Char c = utf8_next(std::string_view(pending_).substr(i));
    if (c.step == Utf8Step::Truncated) break;  // may still complete: hold it back
    out += kReplacementChar;
    i += c.n_bytes;
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out = utf8_repair(pending_);
  pending_.clear();
  return out;
}

}  // namespace ck::text
