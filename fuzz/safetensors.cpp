// Fuzz target: the safetensors reader (io/safetensors.h). Every tensor the reader accepts is read
// whole (its bytes summed and loaded into a tensor of its dtype), so a range the header declares
// past the mapping is an out-of-bounds read.
#include "moefold/io/safetensors.h"

#include <filesystem>
#include <vector>

#include "fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moefold;
  const std::string path = fuzz::write_input(data, size, ".safetensors");
  fuzz::expect_ok_or_error([&] {
    SafetensorsReader r(path);
    volatile uint64_t sum = 0;
    for (const SafetensorsTensor& t : r.tensors()) {
      for (size_t i = 0; i < t.nbytes; ++i) sum = sum + t.data[i];
      if (t.numel() > (int64_t{1} << 20)) continue;  // keep one input's work small
      std::vector<std::byte> buf(t.nbytes + 1);
      Shape shape;
      shape.ndim = static_cast<int>(t.shape.size());
      if (shape.ndim > kMaxDims) continue;
      for (int d = 0; d < shape.ndim; ++d) shape.dims[d] = t.shape[static_cast<size_t>(d)];
      r.load_into(t.name, Tensor(buf.data(), t.dtype, shape));
    }
  });
  std::filesystem::remove(path);
  return 0;
}
