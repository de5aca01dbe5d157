// Helpers for the GPU parity tests (tests/test_*_cuda*.cpp): every CUDA op against its CPU op
// on fresh random inputs. Without a GPU (or without CUDA in the build) each test calls
// GTEST_SKIP, which CTest reports as skipped, never as passed.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "moefold/core/device.h"
#include "moefold/core/tensor.h"
#include "testing.h"

namespace moefold::testing {

#define MF_REQUIRE_GPU()                                                                             \
  do {                                                                                               \
    if (::moefold::cuda_device_count() == 0)                                                         \
      GTEST_SKIP() << (::moefold::cuda_built() ? "no GPU visible" : "built without CUDA (no nvcc)"); \
  } while (0)

// Device tensors for one test, freed at its end.
class DevicePool {
 public:
  DevicePool() = default;
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;
  ~DevicePool() {
    for (void* p : ptrs_) device_free(p);
  }
  Tensor empty(Shape shape, DType dtype) {
    void* p = device_malloc(static_cast<size_t>(shape.numel()) * dtype_size(dtype));
    ptrs_.push_back(p);
    return Tensor(p, dtype, shape, Device::cuda);
  }
  // A device copy of host tensor `h` (any float dtype, or i32/i64 as is) stored as `dtype`.
  Tensor upload(const Tensor& h, DType dtype) {
    Tensor d = empty(h.shape(), dtype);
    const int64_t n = h.numel();
    if (dtype == DType::i32 || dtype == DType::i64 || dtype == h.dtype()) {
      MF_CHECK(dtype == h.dtype(), "upload: ", h.str(), " as ", dtype_name(dtype));
      d.copy_from(h);
      return d;
    }
    std::vector<uint16_t> b16;
    std::vector<float> f32;
    if (dtype == DType::bf16) {
      b16.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) b16[i] = f32_to_bf16(static_cast<float>(value_at(h, i)));
      device_copy(d.data(), Device::cuda, b16.data(), Device::cpu, b16.size() * 2);
    } else {
      MF_CHECK(dtype == DType::f32, "upload as ", dtype_name(dtype));
      f32.resize(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) f32[i] = static_cast<float>(value_at(h, i));
      device_copy(d.data(), Device::cuda, f32.data(), Device::cpu, f32.size() * 4);
    }
    return d;
  }
  // Garbage in a device tensor (for outputs that must be WRITTEN): NaN bit patterns for floats.
  Tensor poisoned(Shape shape, DType dtype) {
    Tensor d = empty(shape, dtype);
    std::vector<uint8_t> bytes(static_cast<size_t>(d.nbytes()), 0xff);
    device_copy(d.data(), Device::cuda, bytes.data(), Device::cpu, bytes.size());
    return d;
  }

 private:
  std::vector<void*> ptrs_;
};

// The host f64 values of a device (or host) tensor of any float dtype.
inline std::vector<double> download(const Tensor& d) {
  const int64_t n = d.numel();
  std::vector<double> out(static_cast<size_t>(n));
  std::vector<uint8_t> bytes(static_cast<size_t>(d.nbytes()));
  device_copy(bytes.data(), Device::cpu, d.data(), d.device(), bytes.size());
  for (int64_t i = 0; i < n; ++i) {
    switch (d.dtype()) {
      case DType::f32: {
        float f;
        std::memcpy(&f, bytes.data() + 4 * i, 4);
        out[i] = f;
        break;
      }
      case DType::f64:
        std::memcpy(&out[i], bytes.data() + 8 * i, 8);
        break;
      case DType::bf16: {
        uint16_t h;
        std::memcpy(&h, bytes.data() + 2 * i, 2);
        out[i] = bf16_to_f32(h);
        break;
      }
      case DType::i32: {
        int32_t v;
        std::memcpy(&v, bytes.data() + 4 * i, 4);
        out[i] = v;
        break;
      }
      case DType::i64: {
        int64_t v;
        std::memcpy(&v, bytes.data() + 8 * i, 8);
        out[i] = static_cast<double>(v);
        break;
      }
      default:
        MF_FAIL("download: ", d.str());
    }
  }
  return out;
}

// Host tensor `h` rounded through `dtype` (bf16: what the GPU op sees), as f64: the CPU
// reference then runs on exactly the GPU's inputs.
inline Tensor rounded(Pool& pool, const Tensor& h, DType dtype) {
  Tensor r = pool.zeros(h.shape(), DType::f64);
  for (int64_t i = 0; i < h.numel(); ++i) {
    const double v = value_at(h, i);
    set_value_at(r, i,
                 dtype == DType::bf16  ? bf16_to_f32(f32_to_bf16(static_cast<float>(v)))
                 : dtype == DType::f32 ? static_cast<double>(static_cast<float>(v))
                                       : v);
  }
  return r;
}

// ||gpu - ref|| / ||ref|| (Frobenius), the parity measure of every GPU test: fp32 lands far under 1e-3;
// bf16 outputs between 1e-3 and 1e-2. Any NaN gives +inf.
// The same between two equally long lists (the reference last).
inline double rel_error(const std::vector<double>& gpu, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = gpu[i], r = ref[i];
    if (!std::isfinite(g)) return INFINITY;
    num += (g - r) * (g - r);
    den += r * r;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
inline double rel_error(const std::vector<double>& gpu, const Tensor& ref) {
  std::vector<double> r(static_cast<size_t>(ref.numel()));
  for (int64_t i = 0; i < ref.numel(); ++i) r[static_cast<size_t>(i)] = value_at(ref, i);
  return rel_error(gpu, r);
}

}  // namespace moefold::testing
