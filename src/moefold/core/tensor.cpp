#include "moefold/core/tensor.h"

#include <cstring>

#include "moefold/core/device.h"
#include "moefold/core/exec.h"

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

Tensor Tensor::step_rows(int64_t first, int64_t step) const {
  MF_CHECK(shape_.ndim >= 1 && step >= 1 && 0 <= first && first <= shape_.dims[0], "rows ", first, "::", step, " of ",
           str());
  Tensor t = slice(first, shape_.dims[0]);
  t.shape_.dims[0] = (t.shape_.dims[0] + step - 1) / step;
  t.strides_[0] *= step;
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

namespace {
// A tensor as `rows` rows of `width` contiguous elements, `pitch` elements apart: its innermost
// contiguous block, then the leading dimensions, which must step by one uniform pitch. A
// contiguous tensor is one row of every element.
struct Rows {
  int64_t rows, width, pitch;
};
Rows rows_of(const Tensor& t) {
  int d = t.ndim() - 1;
  int64_t width = 1;
  for (; d >= 0 && (t.size(d) == 1 || t.stride(d) == width); --d) width *= t.size(d);
  if (d < 0) return {1, width, width};
  const int64_t pitch = t.stride(d);
  int64_t rows = 1;
  for (; d >= 0; rows *= t.size(d--))
    MF_CHECK(t.size(d) == 1 || t.stride(d) == pitch * rows, "copy: ", t.str(), " is not rows of contiguous elements");
  return {rows, width, pitch};
}
}  // namespace

void Tensor::copy_from(const Tensor& src, const ExecContext* on) const {
  MF_CHECK(dtype_ == src.dtype_ && numel() == src.numel(), "copy ", src.str(), " into ", str());
  if (!data_ || !nbytes()) return;
  const Rows d = rows_of(*this), s = rows_of(src);
  // A contiguous side takes the other side's rows; two row-strided sides must have rows alike.
  const int64_t width = d.rows == 1 ? s.width : d.width;
  MF_CHECK(s.rows == 1 || s.width == width, "copy ", src.str(), " into ", str(), ": rows of ", s.width, " vs ", width,
           " elements");
  const auto bytes = [&](int64_t elements) { return static_cast<size_t>(elements) * dtype_size(dtype_); };
  device_copy_2d(data_, bytes(d.rows == 1 ? width : d.pitch), device_, src.data_, bytes(s.rows == 1 ? width : s.pitch),
                 src.device_, bytes(width), static_cast<size_t>(numel() / width), on ? on->stream() : nullptr);
}

std::string Tensor::str() const { return std::string(dtype_name(dtype_)) + shape_.str(); }

void check_shape(const Tensor& t, const Shape& want, const char* what) {
  MF_CHECK(t.shape() == want, what, ": shape ", t.shape().str(), ", expected ", want.str());
}

void check_same_dtype(const Tensor& a, const Tensor& b, const char* what) {
  MF_CHECK(a.dtype() == b.dtype(), what, ": dtype ", dtype_name(a.dtype()), " vs ", dtype_name(b.dtype()));
}

}  // namespace moefold
