// Fuzz target: the tokenizer.json loader (data/bpe_tokenizer.h); an accepted tokenizer encodes a
// fixed text with letters, digits, spaces, punctuation and multi-byte characters.
#include <filesystem>

#include "fuzz_target.h"
#include "moefold/data/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moefold;
  const std::string path = fuzz::write_input(data, size, "-tokenizer.json");
  fuzz::expect_ok_or_error([&] {
    const BpeTokenizer tok(path);
    volatile size_t n = tok.encode("Hello, world! 1234 \xC3\xA9t\xC3\xA9  \xE4\xB8\xAD\xE6\x96\x87\n\tend").size();
    (void)n;
    (void)tok.vocab_size();
  });
  std::filesystem::remove(path);
  return 0;
}
