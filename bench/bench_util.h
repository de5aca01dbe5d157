// Helpers of the GPU benchmark executables (bench/*.cpp): self-freeing device tensors, random
// bf16 fills and median timings on the compute stream.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "moefold/core/device.h"
#include "moefold/core/dtype.h"
#include "moefold/core/tensor.h"

namespace moefold::bench {

// A device tensor that frees itself.
class DeviceTensor {
 public:
  DeviceTensor(Shape shape, DType dtype)
      : p_(device_malloc(static_cast<size_t>(shape.numel()) * dtype_size(dtype))), t_(p_, dtype, shape, Device::cuda) {}
  ~DeviceTensor() { device_free(p_); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  const Tensor& operator*() const { return t_; }

 private:
  void* p_;
  Tensor t_;
};

// Uniform on [-sqrt(3), sqrt(3)] (unit variance), rounded to bf16: xorshift64*, fast enough for
// the 10^8 elements of the largest shape.
inline void fill_random(const Tensor& t, uint64_t seed) {
  std::vector<uint16_t> h(static_cast<size_t>(t.numel()));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (uint16_t& v : h) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    const double u = static_cast<double>((x * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53;  // [0, 1)
    v = f32_to_bf16(static_cast<float>((2 * u - 1) * std::sqrt(3.0)));
  }
  device_copy(t.data(), Device::cuda, h.data(), Device::cpu, h.size() * 2);
}

// Median milliseconds of `runs` timed calls of f after `warmup` untimed ones (CUDA events).
// rest_ms > 0: the GPU idles that long before each timed call (a kernel timed on a rested GPU
// against the same kernel back to back: what sustained load, e.g. the clock under the power limit,
// costs it).
inline double time_ms(int runs, int warmup, const std::function<void()>& f, int rest_ms = 0) {
  for (int i = 0; i < warmup; ++i) f();
  StreamTimer timer;
  std::vector<double> ms;
  for (int i = 0; i < runs; ++i) {
    if (rest_ms > 0) {
      device_synchronize();
      std::this_thread::sleep_for(std::chrono::milliseconds(rest_ms));
    }
    timer.start(Device::cuda);
    f();
    timer.stop();
    ms.push_back(timer.elapsed_ms());
  }
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  return n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
}

}  // namespace moefold::bench
