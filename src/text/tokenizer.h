// Byte-level BPE tokenizer loaded from a Hugging Face tokenizer.json of the Qwen/GPT-2 kind:
// added tokens matched first, NFC normalizer, regex Split pre-tokenizer (PCRE2, JIT), ByteLevel
// byte->char mapping, BPE merges by rank, ByteLevel decoder, and a streaming detokenizer.
// Anything in tokenizer.json outside that family (WordPiece, Unigram, other normalizers) is a load
// error naming the field, never a silent difference. Verified id-for-id against HF `tokenizers`
// by tests/unit/test_tokenizer.cpp.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "util/status.h"

namespace ck::text {

struct TokenizerImpl;

class Tokenizer {
 public:
  Tokenizer();
  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  static Result<Tokenizer> load(const std::string& path);
  // `origin` names the source in error messages.
  static Result<Tokenizer> from_json(std::string_view json_text, const std::string& origin);

  // Invalid UTF-8 in `text` is first repaired the way Python's bytes.decode(errors="replace")
  // does (one U+FFFD per maximal invalid subpart): HF's encode takes a Rust &str, so the only
  // way to hand it such bytes is that repaired string. With allow_special=false, special added
  // tokens (<|im_start|>...) in the text are tokenized as plain text, like HF's
  // `encode_special_tokens=True`; non-special added tokens (<think>, <tool_call>) still match.
  // Thread-safe: the BPE cache is per thread.
  std::vector<int32_t> encode(std::string_view text, bool allow_special = true) const;

  // Concatenates the tokens' bytes and repairs invalid UTF-8 with U+FFFD (HF's ByteLevel decoder
  // + from_utf8_lossy). Ids outside the vocabulary are skipped, as HF does.
  std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token as written in tokenizer.json (byte-level form, e.g. "Ġthe"); nullopt if out of range.
  std::optional<std::string_view> id_to_token(int32_t id) const;
  // The raw bytes a token decodes to (may be an incomplete UTF-8 sequence); empty if out of range.
  std::string_view token_bytes(int32_t id) const;
  bool is_special(int32_t id) const;
  // Largest id + 1, added tokens included (HF get_vocab_size(with_added_tokens=True)).
  int32_t vocab_size() const;

 private:
  std::unique_ptr<TokenizerImpl> impl_;
};

// Streaming detokenizer: push ids one at a time and get back only complete UTF-8 characters.
// Bytes of a character split across tokens are held until it completes; bytes that can never
// complete become U+FFFD right away. Concatenating every push() and the final flush() equals
// Tokenizer::decode of the whole sequence.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false)
      : tokenizer_(&tokenizer), skip_special_(skip_special) {}
  std::string push(int32_t id);
  // Emits whatever is held back (an incomplete sequence becomes U+FFFD) and resets.
  std::string flush();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_;
  std::string pending_;  // at most 3 bytes: a valid but incomplete UTF-8 prefix
};

}  // namespace ck::text
