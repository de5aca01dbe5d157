// NumPy .npy files (format versions 1.0-3.0): the 2-D integer arrays `moefold eval` reads, one
// sequence per row, and float32 arrays (logits). Everything is validated; problems are one moefold::Error line naming
// the file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moefold {

struct NpyTokens {
  int64_t rows = 0, cols = 0;
  std::vector<int32_t> tokens;  // row-major rows x cols
};

// Reads a C-order 2-D array of little-endian int32 ('<i4') or int64 ('<i8', values must fit int32).
NpyTokens read_npy_tokens(const std::string& path);

// Writes `tokens` (rows x cols, row-major) as a '<i4' .npy file (format 1.0).
void write_npy_tokens(const std::string& path, const std::vector<int32_t>& tokens, int64_t rows, int64_t cols);

// A C-order float32 ('<f4') array of any rank (`moefold eval --logits`, parity fixtures).
struct NpyFloats {
  std::vector<int64_t> shape;
  std::vector<float> values;  // row-major
};
NpyFloats read_npy_f32(const std::string& path);
void write_npy_f32(const std::string& path, const std::vector<float>& values, const std::vector<int64_t>& shape);

// A float32 array that grows on disk one slice at a time, shape (n, slice_shape...), readable by
// numpy (and read_npy_f32) while it grows: each append writes the slice's bytes first, then n in
// the header, which keeps one size (128 bytes, padded with spaces). A slice written after the
// header's last update (a crash between the two) is cut off when the file is opened again.
class NpyAppender {
 public:
  // Opens `path`: its first `keep` slices are kept when it holds this slice shape (a resumed run),
  // anything after them is cut off; keep 0 (or no such file) starts it empty. A file of another
  // dtype, slice shape or header size is an Error naming it.
  NpyAppender(std::string path, std::vector<int64_t> slice_shape, int64_t keep);
  ~NpyAppender();
  NpyAppender(const NpyAppender&) = delete;
  NpyAppender& operator=(const NpyAppender&) = delete;
  // Appends one slice (slice_shape's element count of floats).
  void append(const float* slice);
  int64_t size() const { return n_; }  // slices in the file

 private:
  void write_header();
  std::string path_;
  std::vector<int64_t> slice_shape_;
  size_t slice_bytes_ = 0;
  int64_t n_ = 0;
  int fd_ = -1;
};

}  // namespace moefold
