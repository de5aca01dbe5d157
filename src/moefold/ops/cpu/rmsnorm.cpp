// RMSNorm over the last dim (Qwen3/Llama): y = w * x * r with r = 1/sqrt(mean(x^2) + eps).
// Backward: dx = r * (w*dy) - x * r^3 / C * sum_c(w*dy*x) (WRITTEN); dw += sum_n dy * x * r
// (ACCUMULATED; rmsnorm_backward_add ADDS dx). Row sums are accumulated in double.
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

// rmsnorm_forward's arithmetic (arguments checked by the caller).
void norm_rows(const Tensor& x_NC, const Tensor& w_C, double eps, const Tensor& y_NC, const Tensor& rstd_N) {
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

// rmsnorm_backward (add: rmsnorm_backward_add) after the checks.
void backward_rows(const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N, const Tensor& dy_NC,
                   const Tensor& dx_NC, const Tensor& dw_C, bool add, const char* what) {
  check_rmsnorm(x_NC, w_C, rstd_N, what);
  check_like(dy_NC, x_NC, what);
  check_like(dx_NC, x_NC, what);
  check_like(dw_C, w_C, what);
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
        const T g = r * (w[j] * dyr[j]) - xr[j] * k;
        dx[i * c + j] = add ? dx[i * c + j] + g : g;
        dw[j] += dyr[j] * (xr[j] * r);
      }
    }
  });
}
}  // namespace

void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, double eps, const Tensor& y_NC,
                     const Tensor& rstd_N) {
  MF_ON_GPU(ctx, x_NC, cuda::rmsnorm_forward(ctx, x_NC, w_C, eps, y_NC, rstd_N));
  check_rmsnorm(x_NC, w_C, rstd_N, "rmsnorm_forward");
  check_like(y_NC, x_NC, "rmsnorm_forward y");
  norm_rows(x_NC, w_C, eps, y_NC, rstd_N);
}

void add_rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& a_NC, const Tensor& w_C, double eps,
                         const Tensor& h_NC, const Tensor& y_NC, const Tensor& rstd_N, const Tensor& h2_NC) {
  MF_ON_GPU(ctx, x_NC, cuda::add_rmsnorm_forward(ctx, x_NC, a_NC, w_C, eps, h_NC, y_NC, rstd_N, h2_NC));
  check_rmsnorm(x_NC, w_C, rstd_N, "add_rmsnorm_forward");
  check_like(a_NC, x_NC, "add_rmsnorm_forward a");
  check_like(h_NC, x_NC, "add_rmsnorm_forward h");
  check_like(y_NC, x_NC, "add_rmsnorm_forward y");
  if (h2_NC.defined()) check_like(h2_NC, x_NC, "add_rmsnorm_forward h2");
  dispatch_float(x_NC.dtype(), [&]<class T>() {
    const T* x = x_NC.ptr<T>();
    const T* a = a_NC.ptr<T>();
    T* h = h_NC.ptr<T>();
    T* h2 = h2_NC.defined() ? h2_NC.ptr<T>() : nullptr;
    for (int64_t i = 0; i < x_NC.numel(); ++i) {
      h[i] = x[i] + a[i];
      if (h2 != nullptr) h2[i] = h[i];
    }
  });
  norm_rows(h_NC, w_C, eps, y_NC, rstd_N);
}

void rmsnorm_backward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                      const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C) {
  MF_ON_GPU(ctx, x_NC, cuda::rmsnorm_backward(ctx, x_NC, w_C, rstd_N, dy_NC, dx_NC, dw_C));
  backward_rows(x_NC, w_C, rstd_N, dy_NC, dx_NC, dw_C, false, "rmsnorm_backward");
}

void rmsnorm_backward_add(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                          const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C) {
  MF_ON_GPU(ctx, x_NC, cuda::rmsnorm_backward_add(ctx, x_NC, w_C, rstd_N, dy_NC, dx_NC, dw_C));
  backward_rows(x_NC, w_C, rstd_N, dy_NC, dx_NC, dw_C, true, "rmsnorm_backward_add");
}

}  // namespace moefold
