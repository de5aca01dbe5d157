// Softmax cross-entropy over the vocabulary, numerically stable (max-shifted log-sum-exp, row
// sums in double); the forward returns the SUM of row losses and saves lse_N.
// Gradient rule: dlogits = grad_scale * (softmax - onehot(target)), WRITTEN.
// CUDA tensors go to ops/cuda/cross_entropy.cu.
#include <algorithm>
#include <cmath>
#include <limits>

#include "moefold/ops/dispatch.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/cross_entropy.h"
#endif

namespace moefold {

namespace {
void check_ce(const Tensor& logits, const Tensor& targets, const Tensor& lse, const char* what) {
  MF_CHECK(logits.ndim() == 2 && logits.contiguous() && logits.device() == Device::cpu, what, ": logits ",
           logits.str());
  check_shape(targets, {logits.size(0)}, what);
  check_shape(lse, {logits.size(0)}, what);
  MF_CHECK(targets.dtype() == DType::i32 && targets.contiguous() && targets.device() == Device::cpu, what, ": targets ",
           targets.str());
  MF_CHECK(lse.dtype() == logits.dtype() && lse.contiguous() && lse.device() == Device::cpu, what, ": lse ", lse.str());
}
}  // namespace

double cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N,
                             const Tensor& lse_N, const Tensor& loss_1) {
  if (loss_1.defined()) {
    MF_CHECK(loss_1.dtype() == DType::f64 && loss_1.numel() == 1 && loss_1.device() == logits_NV.device(),
             "cross_entropy_forward: loss ", loss_1.str(), " for logits ", logits_NV.str());
  }
  MF_ON_GPU(ctx, logits_NV, cuda::cross_entropy_forward(ctx, logits_NV, targets_N, lse_N, loss_1));
  check_ce(logits_NV, targets_N, lse_N, "cross_entropy_forward");
  const int64_t n = logits_NV.size(0), v = logits_NV.size(1);
  MF_CHECK(v > 0, "cross_entropy_forward: empty vocabulary");
  const int32_t* targets = targets_N.ptr<int32_t>();
  const double sum = dispatch_float(logits_NV.dtype(), [&]<class T>() {
    const T* logits = logits_NV.ptr<T>();
    T* lse = lse_N.ptr<T>();
    double loss = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T* row = logits + i * v;
      if (targets[i] == kIgnoreTarget) {
        lse[i] = T(0);
        continue;
      }
      MF_CHECK(targets[i] >= 0 && targets[i] < v, "cross_entropy_forward: target ", targets[i], " at ", i,
               " outside [0, ", v, ")");
      double m = row[0];
      for (int64_t j = 1; j < v; ++j) m = row[j] > m ? static_cast<double>(row[j]) : m;
      double sum = 0;
      for (int64_t j = 0; j < v; ++j) sum += std::exp(static_cast<double>(row[j]) - m);
      const double l = m + std::log(sum);
      lse[i] = static_cast<T>(l);
      loss += l - static_cast<double>(row[targets[i]]);
    }
    return loss;
  });
  if (!loss_1.defined()) return sum;
  loss_1.ptr<double>()[0] = sum;
  return std::numeric_limits<double>::quiet_NaN();
}

void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N,
                            const Tensor& lse_N, double grad_scale, const Tensor& dlogits_NV) {
  MF_ON_GPU(ctx, logits_NV, cuda::cross_entropy_backward(ctx, logits_NV, targets_N, lse_N, grad_scale, dlogits_NV));
  check_ce(logits_NV, targets_N, lse_N, "cross_entropy_backward");
  check_shape(dlogits_NV, logits_NV.shape(), "cross_entropy_backward dlogits");
  MF_CHECK(dlogits_NV.dtype() == logits_NV.dtype() && dlogits_NV.contiguous() && dlogits_NV.device() == Device::cpu,
           "cross_entropy_backward: dlogits ", dlogits_NV.str());
  const int64_t n = logits_NV.size(0), v = logits_NV.size(1);
  const int32_t* targets = targets_N.ptr<int32_t>();
  dispatch_float(logits_NV.dtype(), [&]<class T>() {
    const T* logits = logits_NV.ptr<T>();
    const T* lse = lse_N.ptr<T>();
    T* dlogits = dlogits_NV.ptr<T>();
    const T gs = static_cast<T>(grad_scale);
    for (int64_t i = 0; i < n; ++i) {
      if (targets[i] == kIgnoreTarget) {
        std::fill(dlogits + i * v, dlogits + (i + 1) * v, T(0));
        continue;
      }
      MF_CHECK(targets[i] >= 0 && targets[i] < v, "cross_entropy_backward: target ", targets[i], " at ", i,
               " outside [0, ", v, ")");
      for (int64_t j = 0; j < v; ++j) dlogits[i * v + j] = gs * std::exp(logits[i * v + j] - lse[i]);
      dlogits[i * v + targets[i]] -= gs;
    }
  });
}

}  // namespace moefold
