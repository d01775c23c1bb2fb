// UTF-8 validation and lossy repair, shared by the tokenizer, the streaming detokenizer and the
// chat templates. Invalid bytes become U+FFFD one "maximal subpart" at a time (Unicode 15 §3.9,
// the same rule as Rust's String::from_utf8_lossy and Python's bytes.decode(errors="replace")),
// so our output matches Hugging Face tokenizers byte for byte. No allocation on valid input.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace ck::text {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

enum class Utf8Step { Valid, Invalid, Truncated };

struct Utf8Char {
  Utf8Step step;
  size_t n_bytes;  // Valid: the character's length. Invalid/Truncated: the maximal subpart (>= 1).
};

// Classifies the character starting at s[0]. Truncated means s ends inside a character that is
// valid so far (a streaming decoder should wait for more bytes).
Utf8Char utf8_next(std::string_view s);

// Length of the longest valid UTF-8 prefix of s.
size_t utf8_valid_prefix(std::string_view s);
inline bool utf8_is_valid(std::string_view s) { return utf8_valid_prefix(s) == s.size(); }

// Replaces each maximal invalid subpart with U+FFFD. A truncated sequence at the end counts as one
// invalid subpart.
std::string utf8_repair(std::string_view s);

// Number of Unicode scalar values in valid UTF-8 (Python's len(str); used by templates).
size_t utf8_length(std::string_view s);

// Appends the UTF-8 encoding of cp (cp must be a scalar value).
void utf8_append(std::string& out, uint32_t cp);

// Decodes the character at s[i] (valid UTF-8 assumed) and advances i.
uint32_t utf8_decode_at(std::string_view s, size_t& i);

}  // namespace ck::text
