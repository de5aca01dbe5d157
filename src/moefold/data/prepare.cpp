#include "moefold/data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string_view>
#include <thread>

#include "moefold/core/error.h"
#include "moefold/data/bpe_tokenizer.h"
#include "moefold/data/byte_tokenizer.h"
#include "moefold/data/line_reader.h"
#include "moefold/data/ordered_pool.h"
#include "moefold/data/token_dataset.h"
#include "moefold/io/json_limits.h"

namespace moefold {

namespace {

namespace fs = std::filesystem;

// Token ids above this need 4 bytes per token (int32 for Megatron).
constexpr int64_t kMaxUint16Vocab = 65536;

// The EOS tokens prepare looks for in a tokenizer's added tokens when --eos-token is not given:
// GPT-2/Qwen, DeepSeek-V3, Llama-2/Mistral.
constexpr std::string_view kEosCandidates[] = {"<|endoftext|>", "<｜end▁of▁sentence｜>", "</s>"};

int32_t find_eos(const BpeTokenizer& tok, const std::string& eos_token) {
  if (!eos_token.empty()) {
    if (auto id = tok.token_id(eos_token)) return *id;
    MF_FAIL("prepare: --eos-token '", eos_token, "' is not a token of ", tok.path());
  }
  for (std::string_view t : kEosCandidates)
    if (auto id = tok.added_token_id(t)) return *id;
  MF_FAIL(tok.path(),
          ": none of <|endoftext|>, <｜end▁of▁sentence｜>, </s> is an added token; name the end-of-document token "
          "with --eos-token");
}

// git's heuristic for "binary": a NUL byte among the first 8000 bytes; we look at 8 KiB.
constexpr size_t kSniffBytes = 8192;

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && std::string_view(s).substr(s.size() - suffix.size()) == suffix;
}

// Regular files under `input`, sorted by path; `input` itself when it is a file.
std::vector<fs::path> list_files(const std::string& input) {
  std::error_code ec;
  fs::file_status st = fs::status(input, ec);
  if (fs::is_regular_file(st)) return {fs::path(input)};
  if (!fs::is_directory(st)) MF_FAIL("prepare: input '", input, "': no such file or directory");
  std::vector<fs::path> files;
  fs::recursive_directory_iterator it(input, fs::directory_options::skip_permission_denied, ec);
  if (ec) MF_FAIL("prepare: input '", input, "': ", ec.message());
  for (; it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) MF_FAIL("prepare: input '", input, "': ", ec.message());
    std::error_code fec;
    if (it->is_regular_file(fec)) files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) MF_FAIL("prepare: cannot read '", p.string(), "'");
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) MF_FAIL("prepare: error reading '", p.string(), "'");
  return s;
}

bool is_jsonl(const std::string& name) {
  return ends_with(name, ".jsonl") || ends_with(name, ".jsonl.gz") || ends_with(name, ".jsonl.zst");
}

bool is_blank(std::string_view line) { return line.find_first_not_of(" \t\r") == std::string_view::npos; }

bool looks_binary(std::string_view head) { return std::memchr(head.data(), '\0', head.size()) != nullptr; }

// Text handed to the tokenizing threads, in corpus order: about kBatchBytes of documents, so that a
// batch costs little to queue next to its tokenizing, and the batches in flight
// (kInFlightPerThread per thread) hold little memory however many threads there are.
constexpr size_t kBatchBytes = size_t{256} << 10;
constexpr size_t kInFlightPerThread = 2;

struct Document {
  std::string text;  // the whole document, or (line_no > 0) a .jsonl line holding it
  const fs::path* file;
  int64_t line_no;
};

struct Batch {
  std::vector<Document> documents;
  std::exception_ptr error;  // the reading failed after `documents`: raised in corpus order
};

// The batch's documents as tokens, each followed by EOS.
struct TokenizedBatch {
  std::vector<uint32_t> tokens;
  std::vector<size_t> ends;  // ends[i]: one past document i's EOS in `tokens`
  int64_t bad_lines = 0;     // .jsonl lines skipped (skip_bad_lines)
};

// The text of a .jsonl line (the string at o.json_key); nullopt for a bad line skipped under
// o.skip_bad_lines, which otherwise fails naming the file and line.
std::optional<std::string> jsonl_text(const Document& d, const PrepareOptions& o) {
  const std::string where = cat(d.file->string(), ":", d.line_no);
  std::string problem;
  try {
    auto j = parse_json_limited<nlohmann::json>(where, d.text.begin(), d.text.end());
    if (!j.is_object()) {
      problem = "not a JSON object";
    } else if (auto it = j.find(o.json_key); it == j.end()) {
      problem = cat("no key \"", o.json_key, "\" (--json-key)");
    } else if (!it->is_string()) {
      problem = cat("\"", o.json_key, "\" is not a string");
    } else {
      return std::move(it->get_ref<std::string&>());
    }
  } catch (const nlohmann::json::exception& e) {
    problem = cat("not JSON (", e.what(), ")");
  } catch (const Error& e) {
    problem = e.what();
  }
  if (!o.skip_bad_lines) MF_FAIL("prepare: ", where, ": ", problem, "; --skip-bad-lines skips such lines");
  return std::nullopt;
}

// Runs on the tokenizing threads, which share `bpe` (ByteTokenizer has no state).
TokenizedBatch tokenize(Batch& b, const BpeTokenizer* bpe, uint32_t eos_id, const PrepareOptions& o) {
  TokenizedBatch t;
  std::vector<int32_t> ids;
  for (Document& d : b.documents) {
    std::optional<std::string> json_text;
    if (d.line_no > 0) {
      json_text = jsonl_text(d, o);
      if (!json_text) {
        ++t.bad_lines;
        continue;
      }
    }
    const std::string& text = json_text ? *json_text : d.text;
    if (bpe) {
      ids.clear();
      bpe->encode(text, &ids);
      t.tokens.insert(t.tokens.end(), ids.begin(), ids.end());
    } else {
      ByteTokenizer::encode(text, &t.tokens);
    }
    t.tokens.push_back(eos_id);
    t.ends.push_back(t.tokens.size());
    std::string().swap(d.text);  // the batch's memory goes as its documents are done
  }
  if (b.error) std::rethrow_exception(b.error);
  return t;
}

// The corpus as batches of documents, in order: each file one document, or each non-blank line of
// a .jsonl[.gz|.zst] file one (read a chunk at a time). Counts files, skipped files and bytes.
class CorpusReader {
 public:
  CorpusReader(const std::vector<fs::path>& files, PrepareStats& stats) : files_(files), stats_(stats) {}

  // The next batch into `*b` (empty at the end); false once the corpus is read. A failure is left
  // in b->error, after the documents read before it, and ends the corpus.
  bool next(Batch* b) {
    size_t bytes = 0;
    try {
      while (bytes < kBatchBytes && file_idx_ < files_.size()) {
        if (!lines_) {
          open_next(b, &bytes);
          continue;
        }
        std::string line;
        try {
          if (!lines_->next(&line)) {
            ++stats_.files;
            stats_.bytes += lines_->bytes();
            lines_.reset();
            ++file_idx_;
            continue;
          }
        } catch (const Error& e) {
          MF_FAIL("prepare: ", e.what());
        }
        if (is_blank(line)) continue;
        bytes += line.size();
        b->documents.push_back({std::move(line), &files_[file_idx_], lines_->line_number()});
      }
    } catch (...) {
      b->error = std::current_exception();
      file_idx_ = files_.size();
      return false;
    }
    return file_idx_ < files_.size();
  }

 private:
  // Opens files_[file_idx_]: a .jsonl file becomes lines_; any other file is one document, added
  // to `b` (with its size to *bytes). Empty and binary files (a NUL byte in the first kSniffBytes)
  // are skipped. Moves to the next file unless lines_ is set.
  void open_next(Batch* b, size_t* bytes) {
    const fs::path& f = files_[file_idx_];
    const std::string name = f.filename().string();
    if (is_jsonl(name)) {
      try {
        lines_ = std::make_unique<LineReader>(f.string(), compression_of(name));
        const std::string_view head = lines_->head(kSniffBytes);
        if (!head.empty() && !looks_binary(head)) return;
        lines_.reset();
      } catch (const Error& e) {
        MF_FAIL("prepare: ", e.what());
      }
    } else {
      std::string text = read_file(f);
      if (!text.empty() && !looks_binary(std::string_view(text).substr(0, kSniffBytes))) {
        ++stats_.files;
        stats_.bytes += static_cast<int64_t>(text.size());
        *bytes += text.size();
        b->documents.push_back({std::move(text), &f, 0});
        ++file_idx_;
        return;
      }
    }
    ++stats_.skipped;
    ++file_idx_;
  }

  const std::vector<fs::path>& files_;
  PrepareStats& stats_;
  size_t file_idx_ = 0;
  std::unique_ptr<LineReader> lines_;  // the .jsonl file being read
};

void rename_or_fail(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) MF_FAIL("prepare: cannot rename '", from, "' to '", to, "': ", ec.message());
}

}  // namespace

PrepareStats prepare(const std::vector<std::string>& inputs, const std::string& output, TokenFormat format,
                     const PrepareOptions& options) {
  PrepareStats stats;
  std::string out = output;
  if (format == TokenFormat::plain) {
    if (!ends_with(out, ".tokens"))
      MF_FAIL("prepare: output '", output, "' must end with .tokens (or use the megatron format with a prefix)");
  } else {
    if (ends_with(out, ".bin") || ends_with(out, ".idx")) out.resize(out.size() - 4);
    if (fs::path(out).filename().empty()) MF_FAIL("prepare: output '", output, "' names no file prefix");
  }
  stats.output = out;
  if (inputs.empty()) MF_FAIL("prepare: no inputs");
  if (options.tokenizer.empty() && !options.eos_token.empty()) MF_FAIL("prepare: --eos-token needs --tokenizer");
  if (options.threads < 0) MF_FAIL("prepare: threads = ", options.threads, " must be >= 0 (0: all cores)");
  stats.threads =
      options.threads > 0 ? options.threads : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::optional<BpeTokenizer> bpe;
  stats.vocab_size = ByteTokenizer::kVocabSize;
  stats.eos_id = ByteTokenizer::kEos;
  if (!options.tokenizer.empty()) {
    bpe.emplace(options.tokenizer);
    stats.vocab_size = bpe->vocab_size();
    stats.eos_id = find_eos(*bpe, options.eos_token);
  }
  const bool wide = stats.vocab_size > kMaxUint16Vocab;

  std::vector<fs::path> files;
  for (const auto& in : inputs) {
    auto f = list_files(in);
    files.insert(files.end(), f.begin(), f.end());
  }

  const std::string tmp = out + ".tmp" + std::to_string(::getpid());
  std::vector<std::string> tmp_files, final_files;
  if (format == TokenFormat::plain) {
    tmp_files = {tmp};
    final_files = {out};
  } else {
    tmp_files = {tmp + ".bin", tmp + ".idx"};
    final_files = {out + ".bin", out + ".idx"};  // .idx last: its presence marks the dataset
  }
  try {
    TokenWriter w = format == TokenFormat::plain
                        ? TokenWriter::plain(tmp, wide ? 4 : 2)
                        : TokenWriter::megatron(tmp, wide ? MegatronDType::int32 : MegatronDType::uint16);
    // One tokenizer for every thread: BpeTokenizer::encode is thread-safe, its cache of merged
    // pre-tokens split into shards with a lock each (one lock made two threads no faster than one).
    const auto eos_id = static_cast<uint32_t>(stats.eos_id);
    auto work = [&](Batch& b) { return tokenize(b, bpe ? &*bpe : nullptr, eos_id, options); };
    // The reading and the writing stay on this thread, in corpus order; the tokenizing threads
    // take batches in any order and the pool gives their results back in the order pushed.
    OrderedPool<Batch, TokenizedBatch> pool(stats.threads, kInFlightPerThread * static_cast<size_t>(stats.threads) + 1,
                                            work);
    auto write = [&](const TokenizedBatch& t) {
      size_t begin = 0;
      for (size_t end : t.ends) {
        w.add_document(std::span<const uint32_t>(t.tokens.data() + begin, end - begin));
        begin = end;
      }
      stats.documents += static_cast<int64_t>(t.ends.size());
      stats.tokens += static_cast<int64_t>(t.tokens.size());
      stats.bad_lines += t.bad_lines;
    };
    CorpusReader reader(files, stats);
    for (bool more = true; more;) {
      Batch b;
      more = reader.next(&b);
      if (b.documents.empty() && !b.error) continue;
      while (pool.full()) write(pool.pop());
      pool.push(std::move(b));
    }
    while (pool.in_flight() > 0) write(pool.pop());
    w.finish();
    for (size_t i = 0; i < tmp_files.size(); ++i) rename_or_fail(tmp_files[i], final_files[i]);
  } catch (...) {
    std::error_code ec;
    for (const auto& t : tmp_files) fs::remove(t, ec);
    throw;
  }
  return stats;
}

std::vector<std::string> default_corpus_dirs() {
#ifdef MOEFOLD_DEFAULT_CORPUS
  return {MOEFOLD_DEFAULT_CORPUS};
#else
  return {"/usr/include"};
#endif
}

}  // namespace moefold
