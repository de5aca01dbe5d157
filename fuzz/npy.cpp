// Fuzz target: the .npy readers (data/npy.h): token arrays and f32 arrays.
#include "moefold/data/npy.h"

#include <filesystem>

#include "fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moefold;
  const std::string path = fuzz::write_input(data, size, ".npy");
  fuzz::expect_ok_or_error([&] {
    volatile int64_t sum = 0;
    for (const int32_t t : read_npy_tokens(path).tokens) sum = sum + t;
  });
  fuzz::expect_ok_or_error([&] {
    volatile float sum = 0;
    for (const float v : read_npy_f32(path).values) sum = sum + v;
  });
  std::filesystem::remove(path);
  return 0;
}
