// Byte-level tokenizer: token = byte value 0..255, end-of-document = 256. Needs no vocabulary
// file, so any text corpus trains out of the box; vocab_size >= kVocabSize.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace moefold {

class ByteTokenizer {
 public:
  static constexpr uint32_t kEos = 256;
  static constexpr int64_t kVocabSize = 257;

  // Appends one token per byte of `text` to `out` (no EOS: documents add it themselves).
  static void encode(std::string_view text, std::vector<uint32_t>* out);
  static std::vector<uint32_t> encode(std::string_view text);
  // Bytes for ids < 256; kEos becomes `eos` (default: nothing); ids above kEos (a padded
  // vocabulary) become U+FFFD so generated text stays printable.
  static std::string decode(std::span<const uint32_t> tokens, std::string_view eos = {});
};

}  // namespace moefold
