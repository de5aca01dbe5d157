// CPU reference of the grouped linear of the experts (moe_ops.h): one gemm per expert on its rows,
// and the SwiGLU-fused pair as grouped_linear + swiglu. Gradient rule: dx WRITTEN, dw ACCUMULATED
// (or written, accumulate == false). CUDA tensors go to ops/cuda/gemm.cu.
#include <algorithm>

#include "moefold/ops/cpu/moe_common.h"
#include "moefold/ops/dispatch.h"
#include "moefold/ops/gemm.h"
#include "moefold/ops/moe_ops.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/gemm.h"
#endif

namespace moefold {

// ---- grouped linear ----------------------------------------------------------------------------

namespace {
void check_grouped(const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1, const Tensor& y_RO) {
  check_2d(x_RI, "grouped_linear x");
  check_2d(y_RO, "grouped_linear y");
  check_on_cpu(x_RI, "grouped_linear x");
  check_on_cpu(y_RO, "grouped_linear y");
  check_dtype(offsets_E1, DType::i64, "grouped_linear offsets");
  MF_CHECK(w_EOI.ndim() == 3 && w_EOI.contiguous() && offsets_E1.numel() == w_EOI.size(0) + 1 &&
               x_RI.size(1) == w_EOI.size(2) && y_RO.size(1) == w_EOI.size(1) && x_RI.size(0) == y_RO.size(0),
           "grouped_linear: x ", x_RI.str(), ", w ", w_EOI.str(), ", offsets ", offsets_E1.str(), ", y ", y_RO.str());
  check_same_dtype(x_RI, w_EOI, "grouped_linear w");
  check_same_dtype(x_RI, y_RO, "grouped_linear y");
  const int64_t* off = offsets_E1.ptr<int64_t>();
  MF_CHECK(off[0] == 0 && off[w_EOI.size(0)] == x_RI.size(0), "grouped_linear: offsets span [", off[0], ", ",
           off[w_EOI.size(0)], ") for ", x_RI.size(0), " rows");
  for (int64_t e = 0; e < w_EOI.size(0); ++e) MF_CHECK(off[e] <= off[e + 1], "grouped_linear: offsets decrease");
}
}  // namespace

void grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                            const Tensor& y_RO) {
  MF_ON_GPU(ctx, x_RI, cuda::grouped_linear_forward(ctx, x_RI, w_EOI, offsets_E1, y_RO));
  check_grouped(x_RI, w_EOI, offsets_E1, y_RO);
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  const int64_t* off = offsets_E1.ptr<int64_t>();
  dispatch_float(x_RI.dtype(), [&]<class T>() {
    const T* x = x_RI.ptr<T>();
    const T* w = w_EOI.ptr<T>();
    T* y = y_RO.ptr<T>();
    for (int64_t e = 0; e < e_n; ++e) {
      const int64_t m = off[e + 1] - off[e];
      if (m == 0) continue;
      gemm<T>(false, true, m, o_n, i_n, T(1), x + off[e] * i_n, i_n, w + e * o_n * i_n, i_n, T(0), y + off[e] * o_n,
              o_n);
    }
  });
}

void grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                             const Tensor& dy_RO, const Tensor& dx_RI, const Tensor& dw_EOI, bool accumulate) {
  MF_ON_GPU(ctx, x_RI, cuda::grouped_linear_backward(ctx, x_RI, w_EOI, offsets_E1, dy_RO, dx_RI, dw_EOI, accumulate));
  check_grouped(x_RI, w_EOI, offsets_E1, dy_RO);
  if (dw_EOI.defined()) {
    check_shape(dw_EOI, w_EOI.shape(), "grouped_linear_backward dw");
    check_same_dtype(dw_EOI, w_EOI, "grouped_linear_backward dw");
  }
  if (dx_RI.defined()) {
    check_shape(dx_RI, x_RI.shape(), "grouped_linear_backward dx");
    check_same_dtype(dx_RI, x_RI, "grouped_linear_backward dx");
  }
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  const int64_t* off = offsets_E1.ptr<int64_t>();
  dispatch_float(x_RI.dtype(), [&]<class T>() {
    const T* x = x_RI.ptr<T>();
    const T* w = w_EOI.ptr<T>();
    const T* dy = dy_RO.ptr<T>();
    T* dw = dw_EOI.defined() ? dw_EOI.ptr<T>() : nullptr;
    if (dw != nullptr && !accumulate) std::fill(dw, dw + dw_EOI.numel(), T(0));
    for (int64_t e = 0; e < e_n; ++e) {
      const int64_t m = off[e + 1] - off[e];
      if (m == 0) continue;
      // dx = dy @ w (m x O @ O x I); dw += dy^T @ x (O x m @ m x I).
      if (dx_RI.defined())
        gemm<T>(false, false, m, i_n, o_n, T(1), dy + off[e] * o_n, o_n, w + e * o_n * i_n, i_n, T(0),
                dx_RI.ptr<T>() + off[e] * i_n, i_n);
      if (dw != nullptr)
        gemm<T>(true, false, o_n, i_n, m, T(1), dy + off[e] * o_n, o_n, x + off[e] * i_n, i_n, T(1), dw + e * o_n * i_n,
                i_n);
    }
  });
}

void grouped_linear_swiglu_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_E2FI,
                                   const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& h_RF) {
  MF_ON_GPU(ctx, x_RI, cuda::grouped_linear_swiglu_forward(ctx, x_RI, w_E2FI, offsets_E1, gu_R2F, h_RF));
  grouped_linear_forward(ctx, x_RI, w_E2FI, offsets_E1, gu_R2F);
  swiglu_forward(ctx, gu_R2F, h_RF, GateUp::pairs);
}

void grouped_linear_swiglu_backward_data(const ExecContext& ctx, const Tensor& dy_RO, const Tensor& w_EOF,
                                         const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& dh_RF,
                                         const Tensor& dgu_R2F) {
  MF_ON_GPU(ctx, dy_RO,
            cuda::grouped_linear_swiglu_backward_data(ctx, dy_RO, w_EOF, offsets_E1, gu_R2F, dh_RF, dgu_R2F));
  // dh as the layer input too: without a weight gradient the backward reads only its shape.
  grouped_linear_backward(ctx, dh_RF, w_EOF, offsets_E1, dy_RO, dh_RF, Tensor());
  swiglu_backward(ctx, gu_R2F, dh_RF, dgu_R2F, GateUp::pairs);
}

}  // namespace moefold
