// UTF-8 as the tokenizers need it: where a valid character starts and how long it is.
#pragma once

#include <cstddef>
#include <string_view>

namespace cputrain {

// The length of the valid UTF-8 character at text[pos] (1 to 4), or 0 where the bytes there are
// not one (a stray continuation byte, a truncated sequence, an overlong form, a surrogate, or a
// code point above U+10FFFF).
inline size_t utf8_length(std::string_view text, size_t pos) {
  const auto at = [&](size_t i) { return static_cast<unsigned char>(text[pos + i]); };
  const unsigned char c = at(0);
  if (c < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // the range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (pos + n > text.size() || at(1) < lo || at(1) > hi) return 0;
  for (size_t i = 2; i < n; ++i)
    if ((at(i) & 0xC0) != 0x80) return 0;
  return n;
}

}  // namespace cputrain
