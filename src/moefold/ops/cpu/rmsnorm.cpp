// RMSNorm over the last dim (Qwen3/Llama): y = w * x * r with r = 1/sqrt(mean(x^2) + eps).
// Backward: dx = r * (w*dy) - x * r^3 / C * sum_c(w*dy*x) (WRITTEN); dw += sum_n dy * x * r
// (ACCUMULATED). Row sums are accumulated in double.
// CUDA tensors go to ops/cuda/rmsnorm.cu.
#include <cmath>

#include "moefold/ops/dispatch.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/rmsnorm.h"
#endif

namespace moefold {

namespace {
void check_rmsnorm(const Tensor& x, const Tensor& w, const Tensor& rstd, const char* what) {
  MF_CHECK(x.ndim() == 2 && x.contiguous() && x.device() == Device::cpu, what, ": x ", x.str());
  check_shape(w, {x.size(1)}, what);
  check_shape(rstd, {x.size(0)}, what);
  MF_CHECK(w.contiguous() && rstd.contiguous() && w.dtype() == x.dtype() && rstd.dtype() == x.dtype() &&
               w.device() == Device::cpu && rstd.device() == Device::cpu,
           what, ": x ", x.str(), ", w ", w.str(), ", rstd ", rstd.str());
}
void check_like(const Tensor& t, const Tensor& ref, const char* what) {
  check_shape(t, ref.shape(), what);
  MF_CHECK(t.contiguous() && t.dtype() == ref.dtype() && t.device() == Device::cpu, what, ": ", t.str());
}
}  // namespace

void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, double eps, const Tensor& y_NC,
                     const Tensor& rstd_N) {
  MF_ON_GPU(ctx, x_NC, cuda::rmsnorm_forward(ctx, x_NC, w_C, eps, y_NC, rstd_N));
  check_rmsnorm(x_NC, w_C, rstd_N, "rmsnorm_forward");
  check_like(y_NC, x_NC, "rmsnorm_forward y");
  const int64_t n = x_NC.size(0), c = x_NC.size(1);
  dispatch_float(x_NC.dtype(), [&]<class T>() {
    const T* x = x_NC.ptr<T>();
    const T* w = w_C.ptr<T>();
    T* y = y_NC.ptr<T>();
    T* rstd = rstd_N.ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      const T* xr = x + i * c;
      double ss = 0;
      for (int64_t j = 0; j < c; ++j) ss += static_cast<double>(xr[j]) * static_cast<double>(xr[j]);
      const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(c) + eps));
      rstd[i] = r;
      for (int64_t j = 0; j < c; ++j) y[i * c + j] = w[j] * (xr[j] * r);
    }
  });
}

void rmsnorm_backward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                      const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C) {
  MF_ON_GPU(ctx, x_NC, cuda::rmsnorm_backward(ctx, x_NC, w_C, rstd_N, dy_NC, dx_NC, dw_C));
  check_rmsnorm(x_NC, w_C, rstd_N, "rmsnorm_backward");
  check_like(dy_NC, x_NC, "rmsnorm_backward dy");
  check_like(dx_NC, x_NC, "rmsnorm_backward dx");
  check_like(dw_C, w_C, "rmsnorm_backward dw");
  const int64_t n = x_NC.size(0), c = x_NC.size(1);
  dispatch_float(x_NC.dtype(), [&]<class T>() {
    const T* x = x_NC.ptr<T>();
    const T* w = w_C.ptr<T>();
    const T* rstd = rstd_N.ptr<T>();
    const T* dy = dy_NC.ptr<T>();
    T* dx = dx_NC.ptr<T>();
    T* dw = dw_C.ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      const T* xr = x + i * c;
      const T* dyr = dy + i * c;
      const T r = rstd[i];
      double dot = 0;  // sum_c (w*dy) * x
      for (int64_t j = 0; j < c; ++j) dot += static_cast<double>(w[j] * dyr[j]) * static_cast<double>(xr[j]);
      const T k = static_cast<T>(dot * static_cast<double>(r) * static_cast<double>(r) * static_cast<double>(r) /
                                 static_cast<double>(c));
      for (int64_t j = 0; j < c; ++j) {
        dx[i * c + j] = r * (w[j] * dyr[j]) - xr[j] * k;
        dw[j] += dyr[j] * (xr[j] * r);
      }
    }
  });
}

}  // namespace moefold
