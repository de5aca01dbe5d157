// Fuzz target: a run's config.toml (model/config.h load_config: TOML parsing, every key's type and
// value, the whole config's validation).
#include "moefold/model/config.h"

#include <filesystem>

#include "fuzz_target.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moefold;
  const std::string path = fuzz::write_input(data, size, "-config.toml");
  fuzz::expect_ok_or_error([&] { (void)config_to_toml(load_config(path, {})); });
  std::filesystem::remove(path);
  return 0;
}
