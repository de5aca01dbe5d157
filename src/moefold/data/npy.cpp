#include "moefold/data/npy.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string_view>

#include "moefold/core/error.h"
#include "moefold/io/mapped_file.h"

namespace moefold {

namespace {

bool is_space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }

// The value of 'key' in the header dict (a Python literal: a quoted string, True, False or a
// tuple), or "" when absent. Scanned by hand: std::regex recursed once per character matched, so a
// 40 kB descr overflowed the stack.
std::string dict_value(const std::string& header, const std::string& key) {
  const std::string quoted = "'" + key + "'";
  for (size_t at = header.find(quoted); at != std::string::npos; at = header.find(quoted, at + 1)) {
    size_t i = at + quoted.size();
    while (i < header.size() && is_space(header[i])) ++i;
    if (i == header.size() || header[i] != ':') continue;
    for (++i; i < header.size() && is_space(header[i]);) ++i;
    const std::string_view rest = std::string_view(header).substr(i);
    if (rest.starts_with("True")) return "True";
    if (rest.starts_with("False")) return "False";
    const char close = rest.starts_with('\'') ? '\'' : rest.starts_with('(') ? ')' : '\0';
    const size_t end = close == '\0' ? std::string_view::npos : rest.find(close, 1);
    if (end != std::string_view::npos) return std::string(rest.substr(0, end + 1));
  }
  return "";
}

}  // namespace

namespace {

struct NpyHeader {
  std::string descr, shape_text;
  std::vector<int64_t> shape;
  size_t data = 0;  // offset of the first element
};

NpyHeader read_header(const std::string& path, const uint8_t* p, size_t n) {
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
  NpyHeader h;
  h.descr = dict_value(header, "descr");
  h.shape_text = dict_value(header, "shape");
  const std::string order = dict_value(header, "fortran_order");
  if (h.descr.empty() || order.empty() || h.shape_text.empty()) MF_FAIL(path, ": malformed .npy header: ", header);
  if (order != "False") MF_FAIL(path, ": Fortran-ordered arrays are not supported (save with C order)");
  // The tuple's items as numpy writes them: "(4, 17)", "(4,)", "()" (Python 2: "4L"). A sign, a
  // fraction or a name is refused rather than read around ("(-2, 3)" is not (2, 3)).
  const std::string dims = h.shape_text.substr(1, h.shape_text.size() - 2);
  for (size_t begin = 0; begin <= dims.size();) {
    const size_t end = std::min(dims.find(',', begin), dims.size());
    size_t b = begin, e = end;
    while (b < e && is_space(dims[b])) ++b;
    while (e > b && is_space(dims[e - 1])) --e;
    if (e - b > 1 && dims[e - 1] == 'L') --e;
    const std::string_view item(dims.data() + b, e - b);
    if (item.empty() && end == dims.size()) break;  // "()", or the trailing comma of "(4,)"
    if (item.empty() || !std::all_of(item.begin(), item.end(), [](char c) { return c >= '0' && c <= '9'; }))
      MF_FAIL(path, ": shape ", h.shape_text, " is not a tuple of non-negative integers");
    if (item.size() > 15) MF_FAIL(path, ": shape ", h.shape_text, " has a dimension of ", item.size(), " digits");
    h.shape.push_back(std::stoll(std::string(item)));
    begin = end + 1;
  }
  h.data = start + header_len;
  return h;
}

// The elements of h's shape, each `elem` bytes, checked to be exactly the file's data after the
// header (`n` bytes in all): overflow-safe, so no shape can make a reader allocate or copy more.
size_t checked_elements(const std::string& path, const NpyHeader& h, size_t elem, size_t n) {
  size_t count = 1, bytes = 0;
  for (const int64_t d : h.shape)
    if (__builtin_mul_overflow(count, static_cast<size_t>(d), &count))
      MF_FAIL(path, ": shape ", h.shape_text, " has more elements than memory can hold");
  if (__builtin_mul_overflow(count, elem, &bytes) || n - h.data != bytes)
    MF_FAIL(path, ": truncated or oversized: shape ", h.shape_text, " needs ", count, " x ", elem,
            " data bytes, file has ", n - h.data);
  return count;
}

std::string shape_text(const std::vector<int64_t>& shape) {  // numpy's own spelling: (4, 17) and (4,)
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += cat(i ? ", " : "", shape[i]);
  if (shape.size() == 1) dims += ",";
  return cat("(", dims, ")");
}

void write_npy(const std::string& path, const char* descr, const std::vector<int64_t>& shape, const void* data,
               size_t bytes) {
  std::string header = cat("{'descr': '", descr, "', 'fortran_order': False, 'shape': ", shape_text(shape), ", }");
  const size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write("\x93NUMPY\x01\x00", 8);
  const uint16_t len = static_cast<uint16_t>(header.size());
  const char le[2] = {static_cast<char>(len & 0xff), static_cast<char>(len >> 8)};
  f.write(le, 2);
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  if (!f) MF_FAIL(path, ": cannot write");
}

}  // namespace

NpyTokens read_npy_tokens(const std::string& path) {
  MappedFile f(path);
  const uint8_t* p = f.data();
  const size_t n = f.size();
  const NpyHeader h = read_header(path, p, n);
  int elem = 0;
  if (h.descr == "'<i4'")
    elem = 4;
  else if (h.descr == "'<i8'")
    elem = 8;
  else
    MF_FAIL(path, ": dtype ", h.descr, " is not supported (expected int32 '<i4' or int64 '<i8')");
  if (h.shape.size() != 2) MF_FAIL(path, ": expected a 2-D array (one sequence per row), shape is ", h.shape_text);
  NpyTokens out;
  const size_t count = checked_elements(path, h, static_cast<size_t>(elem), n), data = h.data;
  out.rows = h.shape[0];
  out.cols = h.shape[1];
  out.tokens.resize(count);
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

NpyFloats read_npy_f32(const std::string& path) {
  MappedFile f(path);
  const NpyHeader h = read_header(path, f.data(), f.size());
  if (h.descr != "'<f4'") MF_FAIL(path, ": dtype ", h.descr, " is not supported (expected float32 '<f4')");
  NpyFloats out;
  out.shape = h.shape;
  const size_t count = checked_elements(path, h, 4, f.size());
  out.values.resize(count);
  if (count > 0) std::memcpy(out.values.data(), f.data() + h.data, 4 * count);
  return out;
}

void write_npy_f32(const std::string& path, const std::vector<float>& values, const std::vector<int64_t>& shape) {
  size_t count = 1;
  for (int64_t d : shape) count *= static_cast<size_t>(d);
  MF_CHECK(values.size() == count, "npy: ", values.size(), " values for the shape");
  write_npy(path, "<f4", shape, values.data(), 4 * count);
}

namespace {
constexpr size_t kAppenderHeader = 128;  // magic, version, length and the padded dict: room for any n

void write_all(int fd, const void* data, size_t bytes, off_t at, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t w = ::pwrite(fd, p, bytes, at);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) MF_FAIL(path, ": write failed: ", std::strerror(errno));
    p += w;
    bytes -= static_cast<size_t>(w);
    at += w;
  }
}
}  // namespace

NpyAppender::NpyAppender(std::string path, std::vector<int64_t> slice_shape, int64_t keep)
    : path_(std::move(path)), slice_shape_(std::move(slice_shape)) {
  size_t count = 1;
  for (int64_t d : slice_shape_) {
    MF_CHECK(d >= 0, "NpyAppender: slice dimension ", d);
    count *= static_cast<size_t>(d);
  }
  slice_bytes_ = 4 * count;
  if (keep > 0 && std::filesystem::is_regular_file(path_)) {
    MappedFile f(path_);
    const NpyHeader h = read_header(path_, f.data(), f.size());
    const std::vector<int64_t> have(h.shape.begin() + (h.shape.empty() ? 0 : 1), h.shape.end());
    if (h.descr != "'<f4'" || h.shape.empty() || have != slice_shape_ || h.data != kAppenderHeader)
      MF_FAIL(path_, ": holds ", h.descr, " ", h.shape_text, ", not the float32 slices ", shape_text(slice_shape_),
              " this run appends (move it away to start a new one)");
    const size_t whole = slice_bytes_ > 0 ? (f.size() - h.data) / slice_bytes_ : static_cast<size_t>(h.shape[0]);
    n_ = std::min({keep, h.shape[0], static_cast<int64_t>(whole)});
  }
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) MF_FAIL(path_, ": cannot open: ", std::strerror(errno));
  if (::ftruncate(fd_, static_cast<off_t>(kAppenderHeader + static_cast<size_t>(n_) * slice_bytes_)) != 0)
    MF_FAIL(path_, ": cannot truncate: ", std::strerror(errno));
  write_header();
}

NpyAppender::~NpyAppender() {
  if (fd_ >= 0) ::close(fd_);
}

void NpyAppender::write_header() {
  std::vector<int64_t> shape = {n_};
  shape.insert(shape.end(), slice_shape_.begin(), slice_shape_.end());
  std::string header = cat("{'descr': '<f4', 'fortran_order': False, 'shape': ", shape_text(shape), ", }");
  MF_CHECK(10 + header.size() + 1 <= kAppenderHeader, "NpyAppender: header ", header);
  header.append(kAppenderHeader - 10 - header.size() - 1, ' ');
  header += '\n';
  std::string bytes("\x93NUMPY\x01\x00", 8);
  bytes += static_cast<char>(header.size() & 0xff);
  bytes += static_cast<char>(header.size() >> 8);
  bytes += header;
  write_all(fd_, bytes.data(), bytes.size(), 0, path_);
}

void NpyAppender::append(const float* slice) {
  write_all(fd_, slice, slice_bytes_, static_cast<off_t>(kAppenderHeader + static_cast<size_t>(n_) * slice_bytes_),
            path_);
  ++n_;
  write_header();
}

void write_npy_tokens(const std::string& path, const std::vector<int32_t>& tokens, int64_t rows, int64_t cols) {
  MF_CHECK(static_cast<int64_t>(tokens.size()) == rows * cols, "npy ", rows, " x ", cols);
  write_npy(path, "<i4", {rows, cols}, tokens.data(), tokens.size() * 4);
}

}  // namespace moefold
