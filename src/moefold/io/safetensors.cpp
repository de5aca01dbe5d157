#include "moefold/io/safetensors.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <numeric>
#include <unordered_set>

#include "moefold/core/error.h"
#include "moefold/core/fault_points.h"
#include "moefold/io/json_limits.h"

namespace moefold {

static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using ordered_json = nlohmann::ordered_json;

// The reference implementation refuses headers above 100 MB; so do we (a corrupt length
// field should not make us parse gigabytes).
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

bool is_float(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16; }

template <class T>
T read_as(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <class Src>
double load_one(const uint8_t* p) {
  if constexpr (std::is_same_v<Src, uint16_t>) {
    return bf16_to_f32(read_as<uint16_t>(p));
  } else {
    return static_cast<double>(read_as<Src>(p));
  }
}

template <class Dst>
void store_one(uint8_t* p, double v) {
  Dst d;
  if constexpr (std::is_same_v<Dst, uint16_t>) {
    d = f32_to_bf16(static_cast<float>(v));
  } else {
    d = static_cast<Dst>(v);
  }
  std::memcpy(p, &d, sizeof(Dst));
}

// bf16 is carried as its uint16_t bit pattern.
template <class F>
void dispatch_storage_float(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      f.template operator()<float>();
      return;
    case DType::f64:
      f.template operator()<double>();
      return;
    case DType::bf16:
      f.template operator()<uint16_t>();
      return;
    default:
      MF_CHECK(false, "not a float dtype: ", dtype_name(t));
  }
}

// n elements of float dtype `src` -> float dtype `dst`; either pointer may be unaligned.
// f32 -> bf16 rounds to nearest even; f64 goes through f32 on its way to bf16.
void convert_floats(DType src, const uint8_t* s, DType dst, uint8_t* d, int64_t n) {
  if (src == dst) {
    std::memcpy(d, s, static_cast<size_t>(n) * dtype_size(src));
    return;
  }
  dispatch_storage_float(src, [&]<class S>() {
    dispatch_storage_float(dst, [&]<class D>() {
      for (int64_t i = 0; i < n; ++i) store_one<D>(d + i * sizeof(D), load_one<S>(s + i * sizeof(S)));
    });
  });
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

class File {
 public:
  explicit File(const std::string& path) : path_(path), f_(std::fopen(path.c_str(), "wb")) {
    if (!f_) MF_FAIL(path_, ": cannot create: ", std::strerror(errno));
  }
  ~File() {
    if (f_) {
      std::fclose(f_);
      std::remove(path_.c_str());  // unfinished: do not leave a half-written file behind
    }
  }
  void write(const void* p, size_t n) {
    if (n > 0 && std::fwrite(p, 1, n, f_) != n) MF_FAIL(path_, ": write failed: ", std::strerror(errno));
  }
  void close() {
    FILE* f = std::exchange(f_, nullptr);
    if (std::fclose(f) != 0) {
      int e = errno;
      std::remove(path_.c_str());
      MF_FAIL(path_, ": close failed: ", std::strerror(e));
    }
  }

 private:
  std::string path_;
  FILE* f_;
};

}  // namespace

void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata) {
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json m = ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  std::unordered_set<std::string> seen;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    const Tensor& t = e.tensor;
    if (e.name.empty() || e.name == "__metadata__") MF_FAIL(path, ": invalid tensor name '", e.name, "'");
    if (!seen.insert(e.name).second) MF_FAIL(path, ": tensor '", e.name, "' given twice");
    MF_CHECK(t.defined() && t.device() == Device::cpu && t.contiguous(), "tensor '", e.name, "' ", t.str());
    if (t.dtype() != e.dtype && !(is_float(t.dtype()) && is_float(e.dtype)))
      MF_FAIL(path, ": tensor '", e.name, "': cannot store ", dtype_name(t.dtype()), " as ", dtype_name(e.dtype));
    uint64_t nbytes = static_cast<uint64_t>(t.numel()) * dtype_size(e.dtype);
    ordered_json shape = ordered_json::array();
    for (int d = 0; d < t.ndim(); ++d) shape.push_back(t.size(d));
    header[e.name] = {{"dtype", dtype_name(e.dtype)}, {"shape", shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-byte aligned (the spec's padding)
  uint64_t n = text.size();

  File f(path);
  f.write(&n, sizeof n);
  f.write(text.data(), text.size());
  constexpr int64_t kChunk = 1 << 16;  // elements converted per write
  std::vector<uint8_t> buf;
  for (const auto& e : entries) {
    if (int err = fault_point("safetensors.tensor")) MF_FAIL(path, ": write failed: ", std::strerror(err));
    const Tensor& t = e.tensor;
    const auto* src = static_cast<const uint8_t*>(t.data());
    if (t.dtype() == e.dtype) {
      f.write(src, t.nbytes());
      continue;
    }
    buf.resize(kChunk * dtype_size(e.dtype));
    for (int64_t i = 0; i < t.numel(); i += kChunk) {
      int64_t m = std::min(kChunk, t.numel() - i);
      convert_floats(t.dtype(), src + i * dtype_size(t.dtype()), e.dtype, buf.data(), m);
      f.write(buf.data(), static_cast<size_t>(m) * dtype_size(e.dtype));
    }
  }
  f.close();
}

int64_t SafetensorsTensor::numel() const {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

std::string SafetensorsTensor::shape_str() const { return shape_string(shape); }

SafetensorsReader::SafetensorsReader(const std::string& path) : file_(path) {
  const uint64_t size = file_.size();
  const uint8_t* base = file_.data();
  if (size < 8) MF_FAIL(path, ": file has ", size, " bytes, too short for the 8-byte header length");
  const uint64_t n = read_as<uint64_t>(base);
  if (n == 0 || n > size - 8 || n > kMaxHeaderBytes)
    MF_FAIL(path, ": bad header length ", n, ": file has ", size, " bytes");

  ordered_json header;
  try {
    header = parse_json_limited<ordered_json>(path, base + 8, base + 8 + n);
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(path, ": header is not valid JSON: ", e.what());
  }
  if (!header.is_object()) MF_FAIL(path, ": header is not a JSON object");

  struct Range {
    uint64_t begin, end;
  };
  std::vector<Range> ranges;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) MF_FAIL(path, ": '__metadata__' is not a JSON object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) MF_FAIL(path, ": '__metadata__' key '", mk, "' is not a string");
        metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    if (!value.is_object()) MF_FAIL(path, ": tensor '", key, "': entry is not a JSON object");
    SafetensorsTensor t;
    t.name = key;
    auto dt = value.find("dtype");
    if (dt == value.end() || !dt->is_string()) MF_FAIL(path, ": tensor '", key, "': missing string 'dtype'");
    if (!dtype_from_name(dt->get<std::string>(), &t.dtype))
      MF_FAIL(path, ": tensor '", key, "' has unknown dtype '", dt->get<std::string>(), "'");
    auto sh = value.find("shape");
    if (sh == value.end() || !sh->is_array())
      MF_FAIL(path, ": tensor '", key, "': 'shape' must be an array of non-negative integers");
    // int64, as SafetensorsTensor::numel() multiplies: every partial product must fit it.
    int64_t numel = 1;
    bool overflow = false;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        MF_FAIL(path, ": tensor '", key, "': 'shape' must be an array of non-negative integers, got ", sh->dump());
      t.shape.push_back(d.get<int64_t>());
      overflow |= __builtin_mul_overflow(numel, d.get<int64_t>(), &numel);
    }
    auto off = value.find("data_offsets");
    if (off == value.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned() || (*off)[0].get<uint64_t>() > (*off)[1].get<uint64_t>())
      MF_FAIL(path, ": tensor '", key, "': 'data_offsets' must be [begin, end] with 0 <= begin <= end");
    Range r{(*off)[0].get<uint64_t>(), (*off)[1].get<uint64_t>()};
    uint64_t want = 0;
    overflow |= __builtin_mul_overflow(static_cast<uint64_t>(numel), dtype_size(t.dtype), &want);
    if (overflow || want != r.end - r.begin)
      MF_FAIL(path, ": tensor '", key, "': shape ", t.shape_str(), " of ", dtype_name(t.dtype), " needs ",
              overflow ? std::string("an overflowing number of") : std::to_string(want), " bytes, data_offsets [",
              r.begin, ", ", r.end, "] hold ", r.end - r.begin);
    t.nbytes = static_cast<size_t>(want);
    index_.emplace(t.name, tensors_.size());
    tensors_.push_back(std::move(t));
    ranges.push_back(r);
  }

  const uint64_t data_start = 8 + n;
  const uint64_t data_size = size - data_start;
  uint64_t max_end = 0;
  for (const auto& r : ranges) max_end = std::max(max_end, r.end);
  if (max_end > data_size) MF_FAIL(path, ": truncated: header says ", max_end, " bytes of data, file has ", data_size);

  // The byte buffer must be fully indexed: sorted by offset, each tensor starts where the
  // previous one ends (no overlap, no hole), the last ends at the end of the file.
  std::vector<size_t> order(ranges.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return ranges[a].begin != ranges[b].begin ? ranges[a].begin < ranges[b].begin : ranges[a].end < ranges[b].end;
  });
  uint64_t pos = 0;
  const SafetensorsTensor* prev = nullptr;
  for (size_t i : order) {
    const Range& r = ranges[i];
    if (r.begin < pos)
      MF_FAIL(path, ": tensors '", prev->name, "' and '", tensors_[i].name, "' overlap (bytes [", r.begin, ", ",
              std::min(pos, r.end), ") of the data)");
    if (r.begin > pos)
      MF_FAIL(path, ": ", r.begin - pos, "-byte hole in the data before tensor '", tensors_[i].name, "' at offset ",
              r.begin);
    pos = r.end;
    prev = &tensors_[i];
    tensors_[i].data = base + data_start + r.begin;
  }
  if (pos != data_size) MF_FAIL(path, ": ", data_size - pos, " trailing bytes after the last tensor's data");
}

bool SafetensorsReader::contains(std::string_view name) const { return index_.count(std::string(name)) > 0; }

const SafetensorsTensor& SafetensorsReader::tensor(std::string_view name) const {
  auto it = index_.find(std::string(name));
  if (it == index_.end()) MF_FAIL(path(), ": no tensor '", name, "'");
  return tensors_[it->second];
}

void SafetensorsReader::load_into(std::string_view name, const Tensor& dst) const {
  const SafetensorsTensor& t = tensor(name);
  MF_CHECK(dst.defined() && dst.device() == Device::cpu && dst.contiguous(), "load_into ", dst.str());
  bool same = static_cast<int>(t.shape.size()) == dst.ndim();
  for (int d = 0; same && d < dst.ndim(); ++d) same = t.shape[d] == dst.size(d);
  if (!same) MF_FAIL(path(), ": tensor '", name, "' has shape ", t.shape_str(), ", expected ", dst.shape().str());
  auto* out = static_cast<uint8_t*>(dst.data());
  if (t.dtype == dst.dtype()) {
    std::memcpy(out, t.data, t.nbytes);
  } else if (is_float(t.dtype) && is_float(dst.dtype())) {
    convert_floats(t.dtype, t.data, dst.dtype(), out, dst.numel());
  } else {
    MF_FAIL(path(), ": tensor '", name, "' is ", dtype_name(t.dtype), ", cannot load into ", dtype_name(dst.dtype()));
  }
}

}  // namespace moefold
