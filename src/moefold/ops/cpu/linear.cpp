// Linear layer without bias, PyTorch weight layout: y_NO = x_NI @ w_OI^T, all through gemm.
// Gradient rule: dx = dy @ w (WRITTEN, skipped when dx is undefined); dw += dy^T @ x (ACCUMULATED).
#include "moefold/ops/gemm.h"
#include "moefold/ops/ops.h"

namespace moefold {

namespace {
void check_linear(const Tensor& x, const Tensor& w, const Tensor& y, const char* what) {
  MF_CHECK(x.ndim() == 2 && w.ndim() == 2 && x.size(1) == w.size(1), what, ": x ", x.str(), ", w ", w.str());
  check_shape(y, {x.size(0), w.size(0)}, what);
  MF_CHECK(x.dtype() == w.dtype() && y.dtype() == w.dtype(), what, ": dtypes ", x.str(), " ", w.str(), " ", y.str());
  MF_CHECK(x.contiguous() && w.contiguous() && y.contiguous(), what, ": not contiguous");
  MF_CHECK(x.device() == Device::cpu && w.device() == Device::cpu && y.device() == Device::cpu, what);
}
void check_like(const Tensor& t, const Tensor& ref, const char* what) {
  check_shape(t, ref.shape(), what);
  MF_CHECK(t.contiguous() && t.dtype() == ref.dtype() && t.device() == Device::cpu, what, ": ", t.str());
}
}  // namespace

void linear_forward(const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO) {
  check_linear(x_NI, w_OI, y_NO, "linear_forward");
  const int64_t n = x_NI.size(0), in = x_NI.size(1), out = w_OI.size(0);
  dispatch_float(x_NI.dtype(), [&]<class T>() {
    gemm<T>(false, true, n, out, in, T(1), x_NI.ptr<T>(), in, w_OI.ptr<T>(), in, T(0), y_NO.ptr<T>(), out);
  });
}

void linear_backward(const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO, const Tensor& dx_NI,
                     const Tensor& dw_OI) {
  check_linear(x_NI, w_OI, dy_NO, "linear_backward");
  if (dx_NI.defined()) check_like(dx_NI, x_NI, "linear_backward dx");
  check_like(dw_OI, w_OI, "linear_backward dw");
  const int64_t n = x_NI.size(0), in = x_NI.size(1), out = w_OI.size(0);
  dispatch_float(x_NI.dtype(), [&]<class T>() {
    const T* dy = dy_NO.ptr<T>();
    if (dx_NI.defined()) gemm<T>(false, false, n, in, out, T(1), dy, out, w_OI.ptr<T>(), in, T(0), dx_NI.ptr<T>(), in);
    gemm<T>(true, false, out, in, n, T(1), dy, out, x_NI.ptr<T>(), in, T(1), dw_OI.ptr<T>(), in);
  });
}

}  // namespace moefold
