// The CUDA RMSNorm of ops/ops.h (rmsnorm.cu): the same names and contracts, in namespace
// moefold::cuda; ops/cpu/rmsnorm.cpp dispatches here for CUDA tensors. Gradient rule: dx WRITTEN,
// dw ACCUMULATED. Activations f32 or bf16 (compute and every reduction in f32); rstd f32. Every
// tensor a contiguous CUDA tensor; ops run on the context's stream and never synchronise the
// host. Only in the CUDA build.
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

// x and y of one dtype (f32 or bf16); w of x's dtype or f32; rstd f32. One warp per row for
// C <= 1024, one 256-thread block per row beyond; sums in float32.
void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, double eps, const Tensor& y_NC,
                     const Tensor& rstd_N);
// x, dy, dx of one dtype; w and dw each of x's dtype or f32; rstd f32; dw ACCUMULATED.
// Deterministic: dw is summed per column over fixed chunks of rows, then over the chunks in order
// (bit-identical run to run on one GPU model; the chunk count follows the SM count). One kernel:
// the chunks' partial sums live in the context's scratch, and each column tile's last chunk to
// finish (an atomic counter) adds them up. dx must not overlap x, dy, w, rstd or dw (checked).
void rmsnorm_backward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                      const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C);
// The fused forms of ops/ops.h, one kernel each, bit for bit the compositions of the CUDA ops.
void add_rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& a_NC, const Tensor& w_C, double eps,
                         const Tensor& h_NC, const Tensor& y_NC, const Tensor& rstd_N, const Tensor& h2_NC);
void rmsnorm_backward_add(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                          const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C);

}  // namespace moefold::cuda
