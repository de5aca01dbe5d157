// LineReader: the lines of a text file, plain or compressed (gzip through zlib, zstd through
// libzstd), streamed: only the line being assembled and one buffer of decompressed text are in
// memory, whatever the size of the file. Concatenated gzip members and multi-frame zstd files are
// read to the end, as `zcat` and `zstdcat` read them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace moefold {

enum class Compression : uint8_t {
  none,
  gzip,  // RFC 1952, one or more members
  zstd,  // RFC 8878, one or more frames (skippable frames skipped)
};

// By name: ".gz" is gzip, ".zst" is zstd, anything else none.
Compression compression_of(std::string_view path);

class LineReader {
 public:
  // A line longer than this (not counting its '\n') is an error: a file without newlines must not
  // grow one string until memory runs out.
  static constexpr size_t kMaxLineBytes = size_t{1} << 30;

  // Opens `path`; fails (moefold::Error naming the file) when it cannot be opened.
  LineReader(const std::string& path, Compression compression, size_t max_line_bytes = kMaxLineBytes);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // The next line, without its '\n' (a '\r' before it is kept), into `*line`; false at the end
  // of the file, where a last line without '\n' still counts. Fails with one line naming the
  // file and the line being read ("FILE:LINE: ...") on a read error, corrupt or truncated
  // compressed data, or a line longer than max_line_bytes.
  bool next(std::string* line);
  // Up to `n` bytes of the start of the (decompressed) text, for sniffing; REQUIRES: no next()
  // yet and n <= kHeadBytes.
  std::string_view head(size_t n);
  static constexpr size_t kHeadBytes = size_t{1} << 16;

  int64_t line_number() const { return line_no_; }  // of the last line next() gave
  int64_t bytes() const { return bytes_; }          // decompressed bytes given by next() so far
  const std::string& path() const { return path_; }

  // The decompressor behind a LineReader: read() gives up to `cap` decompressed bytes, 0 only at
  // the end of the file, and fails with a reason (no file name: the reader adds it).
  struct Source {
    virtual ~Source() = default;
    virtual size_t read(char* dst, size_t cap) = 0;
  };

 private:
  bool fill();  // appends decoded bytes to buf_; false at the end of the file
  [[noreturn]] void fail(const std::string& why) const;

  std::string path_;
  size_t max_line_bytes_;
  std::unique_ptr<Source> src_;
  std::string buf_;  // decoded bytes; [pos_, end_) not yet given out
  size_t pos_ = 0, end_ = 0;
  bool eof_ = false;
  int64_t line_no_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace moefold
