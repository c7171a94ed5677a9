#include "front/utf8.h"

#include <cstddef>

namespace switchyard::front {
namespace {

constexpr std::string_view kReplacement = "\xef\xbf\xbd";  // U+FFFD

// The range the byte after a lead byte must be in (Unicode's table of well-formed UTF-8),
// and the sequence's length; 0 for a byte that cannot start one.
struct Lead {
  std::size_t length;
  unsigned char low, high;
};

Lead lead_of(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};  // no surrogates
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

bool continuation(unsigned char b) { return b >= 0x80 && b <= 0xBF; }

}  // namespace

void utf8_append(std::string& pending, std::string_view in, std::string& text) {
  std::string all;
  std::string_view bytes = in;
  if (!pending.empty()) {
    all.reserve(pending.size() + in.size());
    all.append(pending).append(in);
    bytes = all;
  }
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::size_t n = bytes.size();
  std::size_t i = 0;
  std::size_t run = 0;  // where the well-formed bytes not yet appended start
  while (i < n) {
    if (b[i] < 0x80) {  // ASCII, the common case
      ++i;
      continue;
    }
    const Lead lead = lead_of(b[i]);
    std::size_t good = 0;  // how many bytes from i are a well-formed start
    if (lead.length > 0) {
      good = 1;
      if (i + 1 < n && b[i + 1] >= lead.low && b[i + 1] <= lead.high) {
        good = 2;
        while (good < lead.length && i + good < n && continuation(b[i + good])) ++good;
      }
      if (good == lead.length) {  // a whole character
        i += good;
        continue;
      }
      if (i + good == n) break;  // a start not finished yet: held
    }
    // CPython's quirk, kept: a surrogate's start (ED A0..BF) that ends the input is held
    // too (its decoder leaves it to the error handler, which may accept surrogates).
    if (b[i] == 0xED && i + 2 == n && b[i + 1] >= 0xA0 && b[i + 1] <= 0xBF) break;
    // Ill-formed: its maximal subpart (at least one byte) becomes one U+FFFD.
    text.append(bytes.data() + run, i - run);
    text.append(kReplacement);
    i += good > 0 ? good : 1;
    run = i;
  }
  text.append(bytes.data() + run, i - run);
  pending.assign(bytes.data() + i, n - i);
}

}  // namespace switchyard::front
