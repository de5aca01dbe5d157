// TokenDataset: a read-only, memory-mapped, flat token stream (all documents back to back),
// opened from a Megatron-LM indexed dataset (PREFIX.idx + PREFIX.bin, "MMIDIDX" version 1) or
// from our plain ".tokens" file; plus writers for both formats. Files are validated on open;
// every problem is one moefold::Error line naming the file.
//
// Plain ".tokens" layout (little-endian): "MFTOKENS" | u32 version = 1 | u32 bytes per token
// (2 or 4) | u64 token count | tokens (unsigned). Nothing may follow the tokens.
//
// Megatron .idx layout (megatron/core/datasets/indexed_dataset.py, _IndexWriter): 9-byte magic
// "MMIDIDX\0\0" | u64 version = 1 | u8 dtype code | u64 sequence count S | u64 document-index
// count D | i32 sizes[S] (tokens per sequence) | i64 pointers[S] (byte offset in .bin) | i64
// doc_idx[D] (sequence index where each document starts, from 0, last == S; so D = documents
// + 1) | [i8 modes[S], multimodal datasets only]. The .bin holds the sequences' tokens.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "moefold/io/mapped_file.h"

namespace moefold {

// Megatron's dtype codes (indexed_dataset.py, class DType).
enum class MegatronDType : uint8_t {
  uint8 = 1,
  int8 = 2,
  int16 = 3,
  int32 = 4,
  int64 = 5,
  float64 = 6,
  float32 = 7,
  uint16 = 8,
};

class TokenDataset {
 public:
  // The plain ".tokens" file at `path`.
  static TokenDataset open_plain(const std::string& path);
  // Megatron prefix: reads prefix + ".idx" and prefix + ".bin".
  static TokenDataset open_megatron(const std::string& prefix);

  // The file (plain) or prefix (Megatron) it was opened from; used in error messages.
  const std::string& path() const { return path_; }
  int64_t num_tokens() const { return num_tokens_; }
  // Documents in the file: Megatron's doc_idx count - 1; -1 for plain files (not recorded).
  int64_t num_documents() const { return num_documents_; }

  // Token `i` (REQUIRES: 0 <= i < num_tokens()); signed storage is reinterpreted.
  uint32_t token(int64_t i) const;
  // out[k] = token(begin + k) for k < count, as int32. REQUIRES: the range is inside the stream.
  // Does not allocate.
  void copy_tokens(int64_t begin, int64_t count, int32_t* out) const;

  // Largest token id in the stream (a full scan); -1 when empty.
  int64_t max_token() const;
  // Fails, naming the file, the first offending token id and its index, unless every token id
  // lies in [0, vocab_size).
  void check_vocab(int64_t vocab_size) const;

 private:
  enum class Elem : uint8_t { u8, i8, u16, i16, u32, i32, i64 };
  TokenDataset() = default;
  int64_t raw(int64_t i) const;  // the stored value, sign-extended

  std::string path_;
  MappedFile idx_;  // Megatron only
  MappedFile bin_;  // the token file (plain) or .bin (Megatron)
  const uint8_t* tokens_ = nullptr;
  Elem elem_ = Elem::u16;
  int elem_size_ = 2;
  int64_t num_tokens_ = 0;
  int64_t num_documents_ = -1;
};

// Opens `path`: ending ".tokens" -> plain file; else when path + ".idx" exists -> Megatron
// prefix; ending ".idx" / ".bin" -> the Megatron prefix before it; else fails
// ("data.path = '...': no such file, nor '....idx'/'.bin'").
TokenDataset open_token_dataset(const std::string& path);

// Streaming writer for either format; documents are appended in order. Nothing is renamed:
// callers that need atomicity write to a temporary name. Destroying an unfinished writer
// removes its files.
class TokenWriter {
 public:
  // Plain ".tokens" file at `path`, 2 or 4 bytes per token.
  static TokenWriter plain(const std::string& path, int bytes_per_token);
  // Megatron prefix + ".bin"/".idx", one sequence per document; integer dtypes only.
  static TokenWriter megatron(const std::string& prefix, MegatronDType dtype);

  TokenWriter(TokenWriter&& o) noexcept;
  TokenWriter& operator=(TokenWriter&&) = delete;
  TokenWriter(const TokenWriter&) = delete;
  ~TokenWriter();

  // Fails naming the file when a token does not fit the storage type.
  void add_document(std::span<const uint32_t> tokens);
  // Writes the header count (plain) or the .idx (Megatron) and closes the files.
  void finish();
  int64_t num_tokens() const { return num_tokens_; }

 private:
  TokenWriter() = default;
  void write(const void* p, size_t n);

  std::string path_;        // the plain file, or the .bin
  std::string idx_path_;    // empty for plain
  std::FILE* f_ = nullptr;  // open until finish()
  MegatronDType dtype_ = MegatronDType::uint16;
  int elem_size_ = 2;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> sizes_;  // tokens per document (Megatron); plain files only count them
  std::vector<uint8_t> buf_;
};

// One-shot helpers over TokenWriter.
void write_token_file(const std::string& path, std::span<const uint32_t> tokens, int bytes_per_token);
void write_megatron_dataset(const std::string& prefix, const std::vector<std::vector<uint32_t>>& documents,
                            MegatronDType dtype);

}  // namespace moefold
