#include "moefold/data/npy.h"

#include <cstring>
#include <fstream>
#include <limits>
#include <regex>

#include "moefold/core/error.h"
#include "moefold/io/mapped_file.h"

namespace moefold {

namespace {

// The value of 'key' in the header dict (a Python literal), or "" when absent.
std::string dict_value(const std::string& header, const std::string& key) {
  std::smatch m;
  const std::regex re("'" + key + R"('\s*:\s*('[^']*'|True|False|\([^)]*\)))");
  return std::regex_search(header, m, re) ? m[1].str() : std::string();
}

}  // namespace

NpyTokens read_npy_tokens(const std::string& path) {
  MappedFile f(path);
  const uint8_t* p = f.data();
  const size_t n = f.size();
  if (n < 10 || std::memcmp(p, "\x93NUMPY", 6) != 0) MF_FAIL(path, ": not a .npy file (bad magic)");
  const int major = p[6];
  size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = static_cast<size_t>(p[8]) | static_cast<size_t>(p[9]) << 8;
    start = 10;
  } else if (major == 2 || major == 3) {
    if (n < 12) MF_FAIL(path, ": truncated .npy header");
    header_len = static_cast<size_t>(p[8]) | static_cast<size_t>(p[9]) << 8 | static_cast<size_t>(p[10]) << 16 |
                 static_cast<size_t>(p[11]) << 24;
    start = 12;
  } else {
    MF_FAIL(path, ": unsupported .npy format version ", major);
  }
  if (start + header_len > n) MF_FAIL(path, ": truncated .npy header");
  const std::string header(reinterpret_cast<const char*>(p + start), header_len);
  const std::string descr = dict_value(header, "descr"), order = dict_value(header, "fortran_order"),
                    shape = dict_value(header, "shape");
  if (descr.empty() || order.empty() || shape.empty()) MF_FAIL(path, ": malformed .npy header: ", header);
  if (order != "False") MF_FAIL(path, ": Fortran-ordered arrays are not supported (save with C order)");
  int elem = 0;
  if (descr == "'<i4'")
    elem = 4;
  else if (descr == "'<i8'")
    elem = 8;
  else
    MF_FAIL(path, ": dtype ", descr, " is not supported (expected int32 '<i4' or int64 '<i8')");
  std::smatch m;
  const std::string dims = shape.substr(1, shape.size() - 2);
  if (!std::regex_match(dims, m, std::regex(R"(\s*(\d+)\s*,\s*(\d+)\s*,?\s*)")))
    MF_FAIL(path, ": expected a 2-D array (one sequence per row), shape is ", shape);
  NpyTokens out;
  out.rows = std::stoll(m[1].str());
  out.cols = std::stoll(m[2].str());
  const size_t data = start + header_len, want = static_cast<size_t>(out.rows * out.cols) * static_cast<size_t>(elem);
  if (n - data != want)
    MF_FAIL(path, ": truncated or oversized: shape ", shape, " needs ", want, " data bytes, file has ", n - data);
  out.tokens.resize(static_cast<size_t>(out.rows * out.cols));
  for (size_t i = 0; i < out.tokens.size(); ++i) {
    if (elem == 4) {
      std::memcpy(&out.tokens[i], p + data + 4 * i, 4);
    } else {
      int64_t v;
      std::memcpy(&v, p + data + 8 * i, 8);
      if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
        MF_FAIL(path, ": token ", v, " at index ", i, " does not fit int32");
      out.tokens[i] = static_cast<int32_t>(v);
    }
  }
  return out;
}

void write_npy_tokens(const std::string& path, const std::vector<int32_t>& tokens, int64_t rows, int64_t cols) {
  MF_CHECK(static_cast<int64_t>(tokens.size()) == rows * cols, "npy ", rows, " x ", cols);
  std::string header = cat("{'descr': '<i4', 'fortran_order': False, 'shape': (", rows, ", ", cols, "), }");
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  const char le[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  f.write(le, 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 4));
  if (!f) MF_FAIL(path, ": cannot write");
}

}  // namespace moefold
