// What the benchmarks' reports share (moe_layer_bench, train_bench, fp8_error_bench).
#pragma once

#include <cstdio>
#include <string>

namespace moefold::bench_format {

// One number through a printf format ("%.3f"), as a string.
inline std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

}  // namespace moefold::bench_format
