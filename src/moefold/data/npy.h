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

}  // namespace moefold
