// Fuzz target: the token dataset readers (data/token_dataset.h). The input's first byte picks the
// format: even, a plain token file (the input from its second byte); odd, a Megatron .idx/.bin pair
// (bytes 1-4, little-endian, give the .idx's length, clamped; the rest is the .bin). Every token of
// an accepted dataset is read.
#include <algorithm>
#include <cstring>
#include <filesystem>

#include "fuzz_target.h"
#include "moefold/data/token_dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moefold;
  if (size < 1) return 0;
  const auto read_all = [](const TokenDataset& d) {
    volatile uint64_t sum = 0;
    for (int64_t i = 0; i < d.num_tokens(); ++i) sum = sum + d.token(i);
    (void)d.max_token();
  };
  if (data[0] % 2 == 0) {
    const std::string path = fuzz::write_input(data + 1, size - 1, ".tokens");
    fuzz::expect_ok_or_error([&] { read_all(TokenDataset::open_plain(path)); });
    std::filesystem::remove(path);
    return 0;
  }
  uint32_t idx_len = 0;
  if (size >= 5) std::memcpy(&idx_len, data + 1, 4);
  const size_t rest = size >= 5 ? size - 5 : 0;
  const size_t n_idx = std::min<size_t>(idx_len, rest);
  const uint8_t* body = data + (size >= 5 ? 5 : size);
  const std::string idx = fuzz::write_input(body, n_idx, ".idx");
  const std::string bin = fuzz::write_input(body + n_idx, rest - n_idx, ".bin");
  const std::string prefix = idx.substr(0, idx.size() - 4);
  fuzz::expect_ok_or_error([&] { read_all(TokenDataset::open_megatron(prefix)); });
  std::filesystem::remove(idx);
  std::filesystem::remove(bin);
  return 0;
}
