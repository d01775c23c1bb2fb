// UTF-8 validation and lossy repair (see utf8.h). The byte ranges follow Unicode 15 Table 3-7,
// which rejects overlong forms, surrogates (ED A0..BF) and code points above U+10FFFF.
#include "text/utf8.h"

#include <cstring>

namespace ck::text {

Utf8Char utf8_next(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  size_t n = s.size();
  uint8_t b0 = p[0];
  if (b0 < 0x80) return {Utf8Step::Valid, 1};
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {Utf8Step::Invalid, 1};  // 80..C1 and F5..FF never start a character
  }
  for (size_t k = 1; k < need; ++k) {
    if (k >= n) return {Utf8Step::Truncated, k};
    uint8_t b = p[k];
    uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return {Utf8Step::Invalid, k};
  }
  return {Utf8Step::Valid, need};
}

size_t utf8_valid_prefix(std::string_view s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      std::memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ull) break;
      i += 8;
    }
    if (i >= n) break;
    if (static_cast<uint8_t>(s[i]) < 0x80) { ++i; continue; }
    Utf8Char c = utf8_next(s.substr(i));
    if (c.step != Utf8Step::Valid) return i;
    i += c.n_bytes;
  }
  return n;
}

std::string utf8_repair(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  size_t i = 0;
  while (i < s.size()) {
    size_t ok = utf8_valid_prefix(s.substr(i));
    out.append(s.substr(i, ok));
    i += ok;
    if (i >= s.size()) break;
    Utf8Char c = utf8_next(s.substr(i));
    out.append(kReplacementChar);
    i += c.n_bytes;
  }
  return out;
}

size_t utf8_length(std::string_view s) {
  size_t n = 0;
  for (char c : s) n += (static_cast<uint8_t>(c) & 0xC0) != 0x80;
  return n;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

uint32_t utf8_decode_at(std::string_view s, size_t& i) {
  auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i + k])); };
  uint32_t b0 = b(0);
  if (b0 < 0x80) { i += 1; return b0; }
  if (b0 < 0xE0) { uint32_t cp = ((b0 & 0x1F) << 6) | (b(1) & 0x3F); i += 2; return cp; }
  if (b0 < 0xF0) {
    uint32_t cp = ((b0 & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    i += 3;
    return cp;
  }
  uint32_t cp = ((b0 & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  i += 4;
  return cp;
}

}  // namespace ck::text
