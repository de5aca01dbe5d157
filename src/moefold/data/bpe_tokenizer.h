// BpeTokenizer: the byte-level BPE tokenizers of Hugging Face `tokenizer.json` files (as Qwen2/3,
// DeepSeek-V3 and GPT-2 ship them), encoding text to the ids the `tokenizers` library gives with
// `encode(text, add_special_tokens=False)`. Loading checks every key that changes the ids and
// fails, naming the file and the key, on anything it does not implement.
//
// The pipeline (the library's order): added tokens with normalized=false are cut out of the raw
// text (leftmost-longest match); each remaining piece is normalized, then added tokens with
// normalized=true are cut out of it; what remains goes through the pre-tokenizers (the Split
// regexes, then ByteLevel: GPT-2's regex when use_regex, then bytes -> GPT-2's printable code
// points), and each pre-token is merged by the BPE model (lowest merge rank first, leftmost on
// ties; with ignore_merges a pre-token that is itself in the vocabulary is one token).
//
// Supported:
//   normalizer     null, NFC, NFD, NFKC, NFKD, Sequence of these (empty included)
//   pre_tokenizer  ByteLevel, or a Sequence of Split (Regex or String pattern, behavior
//                  "Isolated", invert false) ending in ByteLevel, at most 64 in all;
//                  ByteLevel's add_prefix_space must be false
//   model          BPE: vocab, merges ("a b" strings or ["a","b"] pairs), ignore_merges,
//                  unk_token/fuse_unk; byte_fallback false, no dropout, no subword prefix or
//                  end-of-word suffix
//   added_tokens   matched verbatim (special or not) with single_word, lstrip and rstrip false;
//                  ids as the library assigns them (the vocabulary's id when the content is in
//                  it, else the next free id from the vocabulary size up)
// Ignored (no effect on the ids of `encode`): post_processor (it adds BOS/EOS only with
// add_special_tokens, which `moefold prepare` does not use: documents get their EOS from
// prepare), decoder, truncation, padding.
//
// Input that is not valid UTF-8 is read with each maximal invalid subsequence replaced by U+FFFD
// (as Python's `bytes.decode("utf-8", errors="replace")`), since the library only takes strings.
// Unicode tables: regex classes come from PCRE2 (10.42: Unicode 14) and normalization from
// utf8proc (2.6: Unicode 13), while tokenizers 0.23 uses Unicode 16: text with characters
// assigned after Unicode 13/14 (e.g. CJK extensions H and I) may split differently.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moefold {

class BpeTokenizer {
 public:
  // Loads `path` (a tokenizer.json). Fails with one line naming the file and the key.
  explicit BpeTokenizer(const std::string& path);
  ~BpeTokenizer();
  BpeTokenizer(BpeTokenizer&&) noexcept;
  BpeTokenizer& operator=(BpeTokenizer&&) noexcept;
  BpeTokenizer(const BpeTokenizer&) = delete;
  BpeTokenizer& operator=(const BpeTokenizer&) = delete;

  // The ids of `text` (no BOS/EOS added). Thread-safe.
  std::vector<int32_t> encode(std::string_view text) const;
  // Appends the ids of `text` to `out`.
  void encode(std::string_view text, std::vector<int32_t>* out) const;

  // Max id + 1 over the vocabulary and the added tokens: model.vocab_size must be at least this.
  int64_t vocab_size() const;
  // The id of `token` (an added token's content, else a vocabulary entry in its byte-level
  // spelling, e.g. "Ġthe"); nullopt when neither.
  std::optional<int32_t> token_id(std::string_view token) const;
  // The id of the added token whose content is `token`; nullopt when there is none.
  std::optional<int32_t> added_token_id(std::string_view token) const;
  const std::string& path() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// GPT-2's bytes_to_unicode: the printable code point standing for byte `b` in byte-level
// vocabularies ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF map to themselves; the other 68 bytes, in
// order, to U+0100..U+0143).
char32_t byte_level_code_point(uint8_t b);

}  // namespace moefold
