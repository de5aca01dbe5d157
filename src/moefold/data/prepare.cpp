#include "moefold/data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>

#include "moefold/core/error.h"
#include "moefold/data/bpe_tokenizer.h"
#include "moefold/data/byte_tokenizer.h"
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

// The documents of a .jsonl file's text: each non-blank line's string at `key`.
template <class F>
void for_each_jsonl_document(const fs::path& path, const std::string& text, const PrepareOptions& o,
                             PrepareStats& stats, F&& document) {
  size_t start = 0;
  for (int64_t line_no = 1; start < text.size(); ++line_no) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + start, end - start);
    start = end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = cat(path.string(), ":", line_no);
    std::string problem;
    try {
      const auto j = parse_json_limited<nlohmann::json>(where, line.begin(), line.end());
      if (!j.is_object())
        problem = "not a JSON object";
      else if (!j.contains(o.json_key))
        problem = cat("no key \"", o.json_key, "\" (--json-key)");
      else if (!j[o.json_key].is_string())
        problem = cat("\"", o.json_key, "\" is not a string");
      else
        document(j[o.json_key].get_ref<const std::string&>());
    } catch (const nlohmann::json::exception& e) {
      problem = cat("not JSON (", e.what(), ")");
    } catch (const Error& e) {
      problem = e.what();
    }
    if (problem.empty()) continue;
    if (!o.skip_bad_lines) MF_FAIL("prepare: ", where, ": ", problem, "; --skip-bad-lines skips such lines");
    ++stats.bad_lines;
  }
}

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
    std::vector<uint32_t> doc;
    std::vector<int32_t> ids;
    auto add_document = [&](const std::string& text) {
      doc.clear();
      if (bpe) {
        ids.clear();
        bpe->encode(text, &ids);
        doc.assign(ids.begin(), ids.end());
      } else {
        ByteTokenizer::encode(text, &doc);
      }
      doc.push_back(static_cast<uint32_t>(stats.eos_id));
      w.add_document(doc);
      ++stats.documents;
      stats.tokens += static_cast<int64_t>(doc.size());
    };
    for (const auto& f : files) {
      const std::string name = f.filename().string();
      if (ends_with(name, ".jsonl.gz") || ends_with(name, ".jsonl.zst"))
        MF_FAIL("prepare: ", f.string(), ": compressed JSONL is not read yet; decompress it to .jsonl first");
      std::string text = read_file(f);
      if (text.empty() || std::memchr(text.data(), '\0', std::min(text.size(), kSniffBytes)) != nullptr) {
        ++stats.skipped;
        continue;
      }
      if (ends_with(name, ".jsonl"))
        for_each_jsonl_document(f, text, options, stats, add_document);
      else
        add_document(text);
      ++stats.files;
      stats.bytes += static_cast<int64_t>(text.size());
    }
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
