// Character-level tokens for the text tasks (ABCDigits, passkey): printable ASCII and the
// newline, so that small models see every character and renderings read as plain text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace winnow::tasks::text {

// '\n' is 0; ' ' (32) .. '~' (126) are 1 .. 95.
constexpr std::int64_t kVocab = 96;

// Throws winnow::Error (invalid_argument) naming the code and position of the first character
// (or token) outside the vocabulary.
std::vector<std::int64_t> encode(const std::string& s);
std::string decode(const std::vector<std::int64_t>& tokens);

}  // namespace winnow::tasks::text
