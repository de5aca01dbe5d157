#include "moefold/data/byte_tokenizer.h"

namespace moefold {

void ByteTokenizer::encode(std::string_view text, std::vector<uint32_t>* out) {
  out->reserve(out->size() + text.size());
  for (char c : text) out->push_back(static_cast<uint8_t>(c));
}

std::vector<uint32_t> ByteTokenizer::encode(std::string_view text) {
  std::vector<uint32_t> out;
  encode(text, &out);
  return out;
}

std::string ByteTokenizer::decode(std::span<const uint32_t> tokens, std::string_view eos) {
  std::string s;
  s.reserve(tokens.size());
  for (uint32_t t : tokens) {
    if (t < 256) {
      s.push_back(static_cast<char>(static_cast<uint8_t>(t)));
    } else if (t == kEos) {
      s.append(eos);
    } else {
      s.append("\xEF\xBF\xBD");  // U+FFFD REPLACEMENT CHARACTER
    }
  }
  return s;
}

}  // namespace moefold
