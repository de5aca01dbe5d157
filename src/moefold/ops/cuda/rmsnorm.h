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
// (bit-identical run to run on one GPU model; the chunk count follows the SM count).
// The per-chunk partial sums (f32, at most N/2 rows of them) live in dx's storage, which is
// free until dx is written last, so the op needs no workspace; hence dx must not overlap x, dy,
// w, rstd or dw (checked). A dx not 4-byte aligned gets one chunk (correct, slower).
void rmsnorm_backward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                      const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C);

}  // namespace moefold::cuda
