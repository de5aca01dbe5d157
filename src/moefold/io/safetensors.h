// safetensors files (https://github.com/huggingface/safetensors): u64 little-endian header
// length N, N bytes of JSON header (space-padded so the data starts 8-byte aligned), then the
// tensors' bytes back to back in the order given. Readers validate everything; every problem
// is one moefold::Error line naming the file and the tensor or key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "moefold/core/tensor.h"
#include "moefold/io/mapped_file.h"

namespace moefold {

// One tensor to write: `tensor` is a contiguous cpu view; it is stored as `dtype` (equal to
// the tensor's dtype, or a float conversion among F32/F64/BF16, e.g. f32 -> BF16).
struct SafetensorsEntry {
  std::string name;
  Tensor tensor;
  DType dtype;
};

// Writes `path` (not atomically: the caller writes to a temporary name and renames). Offsets
// follow the order of `entries` with no holes (the format forbids holes; the reference reader
// rejects them). `metadata` goes under "__metadata__" when not empty.
void write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                       const std::map<std::string, std::string>& metadata = {});

// A validated tensor of a mapped file; `data` points into the mapping (unaligned in general).
struct SafetensorsTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const uint8_t* data;
  size_t nbytes;

  int64_t numel() const;
  std::string shape_str() const;  // "[10, 4]"
};

class SafetensorsReader {
 public:
  // Maps and validates `path`: header length, JSON, dtypes, shape x dtype size == byte range,
  // ranges inside the data, no overlaps or holes, no truncation.
  explicit SafetensorsReader(const std::string& path);

  const std::string& path() const { return file_.path(); }
  // In header order (write order for our own files).
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(std::string_view name) const;
  // Fails naming the file and tensor when absent.
  const SafetensorsTensor& tensor(std::string_view name) const;

  // Copies tensor `name` into `dst` (contiguous, cpu), converting BF16/F32/F64 to dst's float
  // dtype; other dtypes load only into the same dtype. Fails when absent or shapes differ.
  void load_into(std::string_view name, const Tensor& dst) const;

 private:
  MappedFile file_;
  std::vector<SafetensorsTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moefold
