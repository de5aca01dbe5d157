// Elementwise helpers on whole contiguous float tensors: y += x, sum of squares, x *= s.
// No gradients: these serve gradient accumulation, clipping and the optimizer.
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/cuda_ops.h"
#endif

namespace moefold {

void add_inplace(const Tensor& y, const Tensor& x) {
#ifdef MOEFOLD_WITH_CUDA
  if (y.device() == Device::cuda) return cuda::add_inplace(y, x);
#endif
  MF_CHECK(y.numel() == x.numel() && y.dtype() == x.dtype() && y.contiguous() && x.contiguous() &&
               y.device() == Device::cpu && x.device() == Device::cpu,
           "add_inplace: ", y.str(), " += ", x.str());
  const int64_t n = y.numel();
  dispatch_float(y.dtype(), [&]<class T>() {
    T* yp = y.ptr<T>();
    const T* xp = x.ptr<T>();
    for (int64_t i = 0; i < n; ++i) yp[i] += xp[i];
  });
}

double sum_squares(const Tensor& x) {
#ifdef MOEFOLD_WITH_CUDA
  if (x.device() == Device::cuda) return cuda::sum_squares(x);
#endif
  MF_CHECK(x.contiguous() && x.device() == Device::cpu, "sum_squares: ", x.str());
  const int64_t n = x.numel();
  return dispatch_float(x.dtype(), [&]<class T>() {
    const T* xp = x.ptr<T>();
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(xp[i]) * static_cast<double>(xp[i]);
    return s;
  });
}

void scale_inplace(const Tensor& x, double s) {
#ifdef MOEFOLD_WITH_CUDA
  if (x.device() == Device::cuda) return cuda::scale_inplace(x, s);
#endif
  MF_CHECK(x.contiguous() && x.device() == Device::cpu, "scale_inplace: ", x.str());
  const int64_t n = x.numel();
  dispatch_float(x.dtype(), [&]<class T>() {
    T* xp = x.ptr<T>();
    const T st = static_cast<T>(s);
    for (int64_t i = 0; i < n; ++i) xp[i] *= st;
  });
}

}  // namespace moefold
