#include "moefold/core/tensor.h"

#include <cstring>

#include "moefold/core/device.h"

namespace moefold {

Shape::Shape(std::initializer_list<int64_t> d) {
  MF_CHECK(d.size() <= kMaxDims, "too many dims");
  for (int64_t x : d) dims[ndim++] = x;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= dims[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim != o.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (dims[i] != o.dims[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

Tensor::Tensor(void* data, DType dtype, Shape shape, Device device)
    : data_(data), dtype_(dtype), device_(device), shape_(shape) {
  int64_t s = 1;
  for (int i = shape_.ndim - 1; i >= 0; --i) {
    MF_CHECK(shape_.dims[i] >= 0, "negative dim in ", shape_.str());
    strides_[i] = s;
    s *= shape_.dims[i];
  }
}

bool Tensor::contiguous() const {
  int64_t s = 1;
  for (int i = shape_.ndim - 1; i >= 0; --i) {
    if (shape_.dims[i] != 1 && strides_[i] != s) return false;
    s *= shape_.dims[i];
  }
  return true;
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  MF_CHECK(shape_.ndim >= 1 && 0 <= begin && begin <= end && end <= shape_.dims[0], "slice [", begin, ", ", end,
           ") of ", str());
  Tensor t = *this;
  t.shape_.dims[0] = end - begin;
  if (data_) t.data_ = static_cast<char*>(data_) + begin * strides_[0] * static_cast<int64_t>(dtype_size(dtype_));
  return t;
}

Tensor Tensor::view(Shape shape) const {
  MF_CHECK(contiguous() && shape.numel() == numel(), "view ", str(), " as ", shape.str());
  return Tensor(data_, dtype_, shape, device_);
}

void Tensor::zero() const {
  MF_CHECK(contiguous(), "zero ", str());
  if (!data_) return;
  if (device_ == Device::cuda)
    device_zero(data_, nbytes());
  else
    std::memset(data_, 0, nbytes());
}

void Tensor::copy_from(const Tensor& src) const {
  MF_CHECK(contiguous() && src.contiguous() && dtype_ == src.dtype_ && numel() == src.numel(), "copy ", src.str(),
           " into ", str());
  if (!data_ || !nbytes()) return;
  if (device_ == Device::cpu && src.device_ == Device::cpu)
    std::memmove(data_, src.data_, nbytes());
  else
    device_copy(data_, device_, src.data_, src.device_, nbytes());
}

std::string Tensor::str() const { return std::string(dtype_name(dtype_)) + shape_.str(); }

void check_shape(const Tensor& t, const Shape& want, const char* what) {
  MF_CHECK(t.shape() == want, what, ": shape ", t.shape().str(), ", expected ", want.str());
}

void check_same_dtype(const Tensor& a, const Tensor& b, const char* what) {
  MF_CHECK(a.dtype() == b.dtype(), what, ": dtype ", dtype_name(a.dtype()), " vs ", dtype_name(b.dtype()));
}

}  // namespace moefold
