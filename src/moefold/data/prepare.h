// prepare: turns text files into a token dataset, one document per file followed by an EOS
// token: with the byte tokenizer (EOS = ByteTokenizer::kEos), or with a Hugging Face byte-level
// BPE tokenizer.json (EOS = a token of its choosing). Documents are tokenized on several threads
// and written in corpus order: the same inputs give the same bytes, whatever the thread count.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefold {

// Token width: 2 bytes (uint16) while the vocabulary has at most 65536 ids, else 4 (int32).
enum class TokenFormat : uint8_t {
  plain,     // one ".tokens" file, 2 or 4 bytes per token
  megatron,  // PREFIX.bin + PREFIX.idx, dtype uint16 or int32, one sequence per document
};

struct PrepareOptions {
  std::string tokenizer;  // a Hugging Face tokenizer.json (byte-level BPE); empty: the byte tokenizer
  std::string eos_token;  // with `tokenizer`: the token ending each document; empty: the first of
                          // <|endoftext|>, <｜end▁of▁sentence｜>, </s> among its added tokens
  // Files named *.jsonl hold one document per line, a JSON object whose string `json_key` is the
  // text (Megatron's preprocess_data.py); blank lines are skipped. A line that is not such an
  // object is an error naming the file and line, or with skip_bad_lines skipped and counted.
  // *.jsonl.gz (gzip, any number of members) and *.jsonl.zst (zstd, any number of frames) are
  // the same, decompressed as they are read; corrupt or truncated data is an error naming the
  // file and the line reached.
  std::string json_key = "text";
  bool skip_bad_lines = false;
  // Tokenizing threads (0: std::thread::hardware_concurrency()), sharing one tokenizer. Reading and
  // writing stay on the calling thread.
  int threads = 0;
};

struct PrepareStats {
  int64_t files = 0;       // files tokenized (one document each, or a .jsonl[.gz|.zst] file's lines)
  int64_t documents = 0;   // documents written (each followed by EOS)
  int64_t bad_lines = 0;   // .jsonl lines skipped under skip_bad_lines
  int64_t skipped = 0;     // files skipped: empty, or a NUL byte in the first 8 KiB (binary)
  int64_t bytes = 0;       // bytes of the tokenized files (decompressed)
  int64_t tokens = 0;      // tokens written, EOS included
  int64_t vocab_size = 0;  // the tokenizer's ids are < vocab_size (model.vocab_size must be >= it)
  int64_t eos_id = 0;      // the token appended to each document
  int threads = 0;         // tokenizing threads used
  std::string output;      // what open_token_dataset() takes: the .tokens file or the prefix
};

// `inputs`: files and directories (walked recursively, files in sorted path order). `output`:
// a path ending ".tokens" for plain; a prefix with no extension for megatron (a trailing
// ".bin"/".idx" is stripped). Written under a temporary name, then renamed into place; an error
// while reading or tokenizing removes the temporary files and leaves an existing output as it was.
PrepareStats prepare(const std::vector<std::string>& inputs, const std::string& output,
                     TokenFormat format = TokenFormat::plain, const PrepareOptions& options = {});

// The corpus used when none is given: the directory baked in at build time
// (MOEFOLD_DEFAULT_CORPUS, the compiler's C++ standard library headers), else /usr/include.
std::vector<std::string> default_corpus_dirs();

}  // namespace moefold
