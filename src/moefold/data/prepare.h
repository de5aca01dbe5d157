// prepare: turns text files into a token dataset with the byte tokenizer (one document per
// file, followed by ByteTokenizer::kEos). Deterministic: the same inputs give the same bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefold {

enum class TokenFormat : uint8_t {
  plain,     // one ".tokens" file, 2 bytes per token
  megatron,  // PREFIX.bin + PREFIX.idx, dtype uint16, one sequence per document
};

struct PrepareStats {
  int64_t files = 0;    // files tokenized (one document each)
  int64_t skipped = 0;  // files skipped: empty, or a NUL byte in the first 8 KiB (binary)
  int64_t bytes = 0;    // bytes of the tokenized files
  int64_t tokens = 0;   // tokens written, EOS included
  std::string output;   // what open_token_dataset() takes: the .tokens file or the prefix
};

// `inputs`: files and directories (walked recursively, files in sorted path order). `output`:
// a path ending ".tokens" for plain; a prefix with no extension for megatron (a trailing
// ".bin"/".idx" is stripped). Written under a temporary name, then renamed into place.
PrepareStats prepare(const std::vector<std::string>& inputs, const std::string& output,
                     TokenFormat format = TokenFormat::plain);

// The corpus used when none is given: the directory baked in at build time
// (MOEFOLD_DEFAULT_CORPUS, the compiler's C++ standard library headers), else /usr/include.
std::vector<std::string> default_corpus_dirs();

}  // namespace moefold
