#include "moefold/data/line_reader.h"

#include <zlib.h>
#include <zstd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "moefold/core/error.h"

namespace moefold {

namespace {

// Decoded bytes per LineReader buffer, and compressed bytes per read of the file: large enough
// that a call costs little next to the bytes it moves, small next to the caches' memory.
constexpr size_t kChunkBytes = size_t{1} << 20;
constexpr size_t kInBytes = size_t{256} << 10;

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The open file under every source; reads fail with the reason only (LineReader adds the name).
class File {
 public:
  explicit File(const std::string& path) : f_(std::fopen(path.c_str(), "rb")) {
    if (!f_) MF_FAIL("cannot read '", path, "': ", std::strerror(errno));
  }
  ~File() { std::fclose(f_); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  // Up to `cap` bytes; 0 at the end of the file.
  size_t read(void* dst, size_t cap) {
    const size_t n = std::fread(dst, 1, cap, f_);
    if (n == 0 && std::ferror(f_)) MF_FAIL("read error: ", std::strerror(errno));
    return n;
  }

 private:
  std::FILE* f_;
};

class PlainSource final : public LineReader::Source {
 public:
  explicit PlainSource(const std::string& path) : file_(path) {}
  size_t read(char* dst, size_t cap) override { return file_.read(dst, cap); }

 private:
  File file_;
};

// gzip: inflate with the gzip wrapper (windowBits 15 + 16), which checks each member's CRC-32 and
// length; at a member's end the stream is reset, so the next member (RFC 1952 section 2.2: a file
// is a series of members) continues the text.
class GzipSource final : public LineReader::Source {
 public:
  explicit GzipSource(const std::string& path) : file_(path), in_(kInBytes) {
    if (inflateInit2(&zs_, 15 + 16) != Z_OK) MF_FAIL("zlib: inflateInit2 failed (out of memory?)");
  }
  ~GzipSource() override { inflateEnd(&zs_); }

  size_t read(char* dst, size_t cap) override {
    zs_.next_out = reinterpret_cast<Bytef*>(dst);
    zs_.avail_out = static_cast<uInt>(cap);
    while (zs_.avail_out == cap) {
      if (zs_.avail_in == 0) {
        zs_.next_in = in_.data();
        zs_.avail_in = static_cast<uInt>(file_.read(in_.data(), in_.size()));
        if (zs_.avail_in == 0) {
          if (in_member_) MF_FAIL("truncated gzip data (the file ends inside a member)");
          if (!any_member_) MF_FAIL("truncated gzip data (an empty file)");
          return 0;
        }
      }
      in_member_ = true;
      const int r = inflate(&zs_, Z_NO_FLUSH);
      if (r == Z_STREAM_END) {
        in_member_ = false;
        any_member_ = true;
        if (inflateReset(&zs_) != Z_OK) MF_FAIL("zlib: inflateReset failed");
      } else if (r != Z_OK && !(r == Z_BUF_ERROR && zs_.avail_in == 0)) {
        MF_FAIL("corrupt gzip data (zlib: ", zs_.msg ? zs_.msg : zError(r), ")");
      }
    }
    return cap - zs_.avail_out;
  }

 private:
  File file_;
  std::vector<Bytef> in_;
  z_stream zs_{};
  bool in_member_ = false;   // bytes of a member given to inflate, its end not reached
  bool any_member_ = false;  // a whole member was read
};

// zstd: ZSTD_decompressStream reads frame after frame (skippable ones skipped); it returns 0 exactly
// when a frame is complete and flushed, so the end of the file with a non-zero return is a cut.
class ZstdSource final : public LineReader::Source {
 public:
  explicit ZstdSource(const std::string& path) : file_(path), in_(ZSTD_DStreamInSize()), dctx_(ZSTD_createDCtx()) {
    if (!dctx_) MF_FAIL("zstd: ZSTD_createDCtx failed (out of memory?)");
    // Windows up to 2 GiB, as `zstd -d --long=31` allows: large corpora are often compressed with
    // --long (the default limit, 128 MiB, refuses them); memory is only taken when a frame asks.
    ZSTD_DCtx_setParameter(dctx_, ZSTD_d_windowLogMax, 31);
  }
  ~ZstdSource() override { ZSTD_freeDCtx(dctx_); }

  size_t read(char* dst, size_t cap) override {
    ZSTD_outBuffer out{dst, cap, 0};
    for (;;) {
      if (ib_.pos == ib_.size && !eof_) {
        ib_ = {in_.data(), file_.read(in_.data(), in_.size()), 0};
        if (ib_.size == 0) {
          eof_ = true;
          if (!started_) MF_FAIL("truncated zstd data (an empty file)");
        }
        started_ = true;
      }
      const bool no_input = eof_ && ib_.pos == ib_.size;
      if (no_input && pending_ == 0) return out.pos;
      // With no input left this call only flushes what the context still holds.
      const size_t r = ZSTD_decompressStream(dctx_, &out, &ib_);
      if (ZSTD_isError(r)) MF_FAIL("corrupt zstd data (", ZSTD_getErrorName(r), ")");
      pending_ = r;
      if (out.pos > 0) return out.pos;
      if (no_input) MF_FAIL("truncated zstd data (the file ends inside a frame)");
    }
  }

 private:
  File file_;
  std::vector<char> in_;
  ZSTD_DCtx* dctx_;
  ZSTD_inBuffer ib_{nullptr, 0, 0};
  size_t pending_ = 0;  // the last ZSTD_decompressStream return: 0 at a frame's end
  bool eof_ = false, started_ = false;
};

}  // namespace

Compression compression_of(std::string_view path) {
  if (ends_with(path, ".gz")) return Compression::gzip;
  if (ends_with(path, ".zst")) return Compression::zstd;
  return Compression::none;
}

LineReader::LineReader(const std::string& path, Compression compression, size_t max_line_bytes)
    : path_(path), max_line_bytes_(max_line_bytes), buf_(kChunkBytes, '\0') {
  static_assert(kHeadBytes <= kChunkBytes);
  switch (compression) {
    case Compression::none:
      src_ = std::make_unique<PlainSource>(path);
      break;
    case Compression::gzip:
      src_ = std::make_unique<GzipSource>(path);
      break;
    case Compression::zstd:
      src_ = std::make_unique<ZstdSource>(path);
      break;
  }
}

LineReader::~LineReader() = default;

void LineReader::fail(const std::string& why) const { MF_FAIL(path_, ":", line_no_ + 1, ": ", why); }

bool LineReader::fill() {
  if (eof_) return false;
  if (pos_ == end_) pos_ = end_ = 0;
  MF_CHECK(end_ < buf_.size());
  size_t n = 0;
  try {
    n = src_->read(buf_.data() + end_, buf_.size() - end_);
  } catch (const Error& e) {
    fail(e.what());
  }
  end_ += n;
  eof_ = n == 0;
  return n > 0;
}

std::string_view LineReader::head(size_t n) {
  MF_CHECK(line_no_ == 0 && pos_ == 0 && n <= kHeadBytes);
  while (end_ < n && fill()) {
  }
  return std::string_view(buf_.data(), std::min(n, end_));
}

bool LineReader::next(std::string* line) {
  line->clear();
  bool any = false;  // bytes of this line seen (a last line without '\n' still counts)
  for (;;) {
    if (pos_ == end_ && !fill()) {
      if (!any) return false;
      break;
    }
    any = true;
    const char* s = buf_.data() + pos_;
    const size_t avail = end_ - pos_;
    const auto* nl = static_cast<const char*>(std::memchr(s, '\n', avail));
    const size_t take = nl ? static_cast<size_t>(nl - s) : avail;
    if (line->size() + take > max_line_bytes_) fail(cat("a line longer than ", max_line_bytes_, " bytes"));
    line->append(s, take);
    pos_ += take;
    bytes_ += static_cast<int64_t>(take);
    if (nl) {
      ++pos_;
      ++bytes_;
      break;
    }
  }
  ++line_no_;
  return true;
}

}  // namespace moefold
