// SwiGLU on a fused gate|up input: h = silu(g) * u with silu(g) = g * sigmoid(g).
// Backward: dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))), du = dh * silu(g).
// Layouts (GateUp, ops.h): halves g_j = gu[:, j], u_j = gu[:, F + j]; pairs g_j = gu[:, 2j],
// u_j = gu[:, 2j + 1]. CUDA tensors go to ops/cuda/swiglu.cu.
#include <cmath>

#include "moefold/ops/dispatch.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/swiglu.h"
#endif

namespace moefold {

namespace {
void check_swiglu(const Tensor& gu, const Tensor& h) {
  MF_CHECK(gu.ndim() == 2 && h.ndim() == 2 && gu.size(0) == h.size(0) && gu.size(1) == 2 * h.size(1),
           "swiglu: ", gu.str(), " -> ", h.str());
  MF_CHECK(gu.contiguous() && h.contiguous() && gu.dtype() == h.dtype() && gu.device() == Device::cpu &&
               h.device() == Device::cpu,
           "swiglu: ", gu.str(), " -> ", h.str(), " (contiguous cpu tensors of one dtype)");
}

}  // namespace

void swiglu_forward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& h_NF, GateUp layout) {
  MF_ON_GPU(ctx, gu_N2F, cuda::swiglu_forward(ctx, gu_N2F, h_NF, layout));
  check_swiglu(gu_N2F, h_NF);
  const int64_t n = h_NF.size(0), f = h_NF.size(1);
  const GateUpColumns col = gate_up_columns(layout, f);
  dispatch_float(h_NF.dtype(), [&]<class T>() {
    const T* gu = gu_N2F.ptr<T>();
    T* h = h_NF.ptr<T>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < f; ++j) {
        const int64_t at = i * 2 * f + col.step * j;  // g at `at`, u at `at + col.up`
        T g = gu[at], u = gu[at + col.up];
        h[i * f + j] = g / (T(1) + std::exp(-g)) * u;
      }
  });
}

void swiglu_backward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& dh_NF, const Tensor& dgu_N2F,
                     GateUp layout) {
  MF_ON_GPU(ctx, gu_N2F, cuda::swiglu_backward(ctx, gu_N2F, dh_NF, dgu_N2F, layout));
  check_swiglu(gu_N2F, dh_NF);
  check_shape(dgu_N2F, gu_N2F.shape(), "swiglu_backward dgu");
  MF_CHECK(dgu_N2F.contiguous() && dgu_N2F.dtype() == gu_N2F.dtype() && dgu_N2F.device() == Device::cpu,
           "swiglu_backward: dgu ", dgu_N2F.str());
  const int64_t n = dh_NF.size(0), f = dh_NF.size(1);
  const GateUpColumns col = gate_up_columns(layout, f);
  dispatch_float(dh_NF.dtype(), [&]<class T>() {
    const T* gu = gu_N2F.ptr<T>();
    const T* dh = dh_NF.ptr<T>();
    T* dgu = dgu_N2F.ptr<T>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < f; ++j) {
        const int64_t at = i * 2 * f + col.step * j;  // g at `at`, u at `at + col.up`
        T g = gu[at], u = gu[at + col.up], d = dh[i * f + j];
        T sig = T(1) / (T(1) + std::exp(-g));
        dgu[at] = d * u * sig * (T(1) + g * (T(1) - sig));
        dgu[at + col.up] = d * g * sig;
      }
  });
}

}  // namespace moefold
