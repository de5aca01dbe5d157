// Tensor: a non-owning view (pointer, dtype, shape, strides, device) over memory that an Arena
// owns. Views are cheap values; ops check shapes and dtypes once at their entry point.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "moefold/core/dtype.h"
#include "moefold/core/error.h"

namespace moefold {

enum class Device : uint8_t { cpu, cuda };
class ExecContext;  // core/exec.h

inline constexpr int kMaxDims = 6;

struct Shape {
  std::array<int64_t, kMaxDims> dims{};
  int ndim = 0;

  Shape() = default;
  Shape(std::initializer_list<int64_t> d);
  int64_t operator[](int i) const { return dims[i < 0 ? i + ndim : i]; }
  int64_t numel() const;
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[2, 3, 4]"
};

class Tensor {
 public:
  Tensor() = default;
  // A contiguous (row-major) view of `data`.
  Tensor(void* data, DType dtype, Shape shape, Device device = Device::cpu);

  void* data() const { return data_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return shape_.ndim; }
  int64_t size(int d) const { return shape_[d]; }
  int64_t stride(int d) const { return strides_[d < 0 ? d + shape_.ndim : d]; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool defined() const { return shape_.ndim > 0; }
  bool contiguous() const;

  // Typed pointer; aborts when T does not match the dtype.
  template <class T>
  T* ptr() const {
    MF_CHECK(dtype_of<T>() == dtype_, "tensor is ", dtype_name(dtype_), ", accessed as ", dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
  }

  // Rows [begin, end) along dimension 0; stays contiguous when this view is.
  Tensor slice(int64_t begin, int64_t end) const;
  // Rows first, first + step, first + 2 * step, ... along dimension 0 (Python's t[first::step]):
  // a row-strided view for step > 1, each row laid out as before. REQUIRES: step >= 1.
  Tensor step_rows(int64_t first, int64_t step) const;
  // Same memory, new shape; REQUIRES: contiguous and equal numel.
  Tensor view(Shape shape) const;
  // Sets every element to zero. REQUIRES: contiguous, cpu.
  void zero() const;
  // Copies elements from `src` (same dtype and numel), in row-major order, between any two of
  // host and device memory (device_copy_2d). Each side is contiguous or "rows of contiguous
  // elements": a contiguous innermost block (the row) whose leading dimensions step by one
  // uniform row pitch, e.g. a step_rows view; two such sides need rows of one width. Device
  // copies run on the stream of `on` (core/exec.h; null: the primary stream), ordered with the
  // ops of that context; a copy to the host waits for them.
  void copy_from(const Tensor& src, const ExecContext* on = nullptr) const;

  std::string str() const;  // "f32[2, 3]"

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu;
  Shape shape_;
  std::array<int64_t, kMaxDims> strides_{};
};

// Entry-point checks used by ops (REQUIRES-style, abort on internal misuse).
void check_shape(const Tensor& t, const Shape& want, const char* what);
void check_same_dtype(const Tensor& a, const Tensor& b, const char* what);

// Calls f.template operator()<T>() with T = float or double according to `t`; aborts otherwise.
template <class F>
decltype(auto) dispatch_float(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      return f.template operator()<float>();
    case DType::f64:
      return f.template operator()<double>();
    default:
      break;
  }
  check_failed("float dtype", "dispatch_float", __FILE__, __LINE__, std::string(dtype_name(t)));
}

}  // namespace moefold
