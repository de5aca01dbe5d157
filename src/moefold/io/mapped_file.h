// MappedFile: a read-only memory map of a whole file (checkpoints, token datasets). Owns the
// mapping; errors opening or mapping are moefold::Error naming the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace moefold {

class MappedFile {
 public:
  MappedFile() = default;
  // Maps `path` read-only. An empty file maps to data() == nullptr, size() == 0.
  explicit MappedFile(std::string path);
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void release();

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace moefold
