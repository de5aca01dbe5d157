// Helpers shared by the CPU references of the MoE ops (router_topk.cpp, router_losses.cpp,
// permute_plan.cpp, permute.cpp, grouped_linear.cpp): argument checks and a softmax row. For
// those files only (other ops' files keep checks of these names to themselves).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "moefold/core/error.h"
#include "moefold/core/tensor.h"

namespace moefold {

// The entry points check shapes and dtypes before they hand CUDA tensors on (ops/dispatch.h), so
// these accept either device; check_on_cpu then guards the CPU loops.
inline void check_2d(const Tensor& t, const char* what) {
  MF_CHECK(t.ndim() == 2 && t.contiguous(), what, ": ", t.str());
}

inline void check_on_cpu(const Tensor& t, const char* what) {
  MF_CHECK(t.device() == Device::cpu, what, ": ", t.str());
}

inline void check_dtype(const Tensor& t, DType want, const char* what) {
  MF_CHECK(t.dtype() == want, what, ": ", t.str(), ", expected ", dtype_name(want));
}

// Softmax of one row into out (skipped when null); returns log-sum-exp.
template <class T>
T softmax_row(const T* x, int64_t n, T* out) {
  T m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(x[i] - m);
  if (out)
    for (int64_t i = 0; i < n; ++i) out[i] = std::exp(x[i] - m) / s;
  return m + std::log(s);
}

}  // namespace moefold
