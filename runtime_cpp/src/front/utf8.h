// Incremental UTF-8, read as Python's incremental decoder reads it with errors="replace"
// (codecs.getincrementaldecoder("utf-8")(errors="replace")), so that text made here is the
// text the control plane's detokenizer makes from the same bytes.
#pragma once

#include <string>
#include <string_view>

namespace switchyard::front {

// Appends to `text` the characters of `pending` + `in` as UTF-8, and keeps in `pending`
// the start of a character not finished yet. Each maximal subpart of an ill-formed
// sequence (Unicode's "U+FFFD substitution of maximal subparts", which CPython follows)
// becomes one U+FFFD; a start that can only be ill-formed is replaced at once, not held
// (but for a surrogate's first two bytes at the end, which CPython holds).
void utf8_append(std::string& pending, std::string_view in, std::string& text);

}  // namespace switchyard::front
