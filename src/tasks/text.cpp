#include "tasks/text.h"

#include "winnow/error.h"

namespace winnow::tasks::text {

std::vector<std::int64_t> encode(const std::string& s) {
  std::vector<std::int64_t> out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) {
    // Through unsigned char, so bytes >= 128 report as 128..255 rather than negative codes.
    const int c = static_cast<unsigned char>(s[i]);
    if (c == '\n') {
      out.push_back(0);
    } else if (c >= ' ' && c <= '~') {
      out.push_back(c - ' ' + 1);
    } else {
      throw Error(ErrorKind::invalid_argument,
                  "text::encode: character code " + std::to_string(c) + " at position " +
                      std::to_string(i) + " is not printable ASCII or '\\n'");
    }
  }
  return out;
}

std::string decode(const std::vector<std::int64_t>& tokens) {
  std::string out;
  out.reserve(tokens.size());
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::int64_t t = tokens[i];
    if (t < 0 || t >= kVocab) {
      throw Error(ErrorKind::invalid_argument,
                  "text::decode: token " + std::to_string(t) + " at position " +
                      std::to_string(i) + ": expected in [0, " + std::to_string(kVocab) + ")");
    }
    out.push_back(t == 0 ? '\n' : static_cast<char>(' ' + t - 1));
  }
  return out;
}

}  // namespace winnow::tasks::text
