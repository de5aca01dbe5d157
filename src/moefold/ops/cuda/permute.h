// The CUDA permute and combine of ops/moe_ops.h (permute.cu), forward and backward: the same names
// and contracts, in namespace moefold::cuda; ops/cpu/permute.cpp dispatches here for CUDA
// tensors. Gradient rule: drows, dx, dout, dprob WRITTEN. Tokens and rows (x, rows, drows, dx,
// out, y, dy, dout) f32 or bf16, all of one dtype; the combine weights prob_TK / dprob_TK f32
// whatever that dtype is; token_R and row_TK i64; all contiguous CUDA tensors. Sums over k run
// in f32 in k order (no atomics: deterministic). Outputs must not overlap inputs (the kernels
// read through restrict pointers). The ops only enqueue work. Only in the CUDA build.
// A row or token index outside its tensor stops the kernel with a printed message and a device
// trap: the next CUDA call fails (the host cannot see it without waiting).
// Shapes and the dtypes both devices share are checked once, by the CPU entry point before it
// dispatches here; these ops check what only the GPU needs (device, contiguity, GPU-only dtypes,
// sizes that must fit an int, launch and shared-memory limits).
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

void moe_permute(const ExecContext& ctx, const Tensor& x_TH, const Tensor& token_R, const Tensor& rows_RH);
// Sums the K rows of each token in f32, in k order.
void moe_permute_backward(const ExecContext& ctx, const Tensor& drows_RH, const Tensor& row_TK, const Tensor& dx_TH);
// Accumulates in f32 in k order.
void moe_combine(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                 const Tensor& y_TH);
// The padding rows (token_R[r] < 0) are zeroed by a kernel of their own (not the whole of dout_RH:
// the other rows are written once each), then each kept (t, k) writes its row.
void moe_combine_backward(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                          const Tensor& token_R, const Tensor& dy_TH, const Tensor& dout_RH, const Tensor& dprob_TK);

}  // namespace moefold::cuda
