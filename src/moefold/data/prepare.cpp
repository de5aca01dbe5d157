#include "moefold/data/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "moefold/core/error.h"
#include "moefold/data/byte_tokenizer.h"
#include "moefold/data/token_dataset.h"

namespace moefold {

namespace {

namespace fs = std::filesystem;

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

void rename_or_fail(const std::string& from, const std::string& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec) MF_FAIL("prepare: cannot rename '", from, "' to '", to, "': ", ec.message());
}

}  // namespace

PrepareStats prepare(const std::vector<std::string>& inputs, const std::string& output, TokenFormat format) {
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
    TokenWriter w =
        format == TokenFormat::plain ? TokenWriter::plain(tmp, 2) : TokenWriter::megatron(tmp, MegatronDType::uint16);
    std::vector<uint32_t> doc;
    for (const auto& f : files) {
      std::string text = read_file(f);
      if (text.empty() || std::memchr(text.data(), '\0', std::min(text.size(), kSniffBytes)) != nullptr) {
        ++stats.skipped;
        continue;
      }
      doc.clear();
      ByteTokenizer::encode(text, &doc);
      doc.push_back(ByteTokenizer::kEos);
      w.add_document(doc);
      ++stats.files;
      stats.bytes += static_cast<int64_t>(text.size());
      stats.tokens += static_cast<int64_t>(doc.size());
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
