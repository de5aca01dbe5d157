// The CUDA rotary position embedding of ops/ops.h (rope.cu): the same names and contracts, in
// namespace moefold::cuda; ops/cpu/rope.cpp dispatches here for CUDA tensors. x (or dx) rotated
// in place (the gradient WRITTEN). Every tensor a contiguous CUDA tensor; ops run on the context's
// stream and never synchronise the host. Only in the CUDA build.
// Positions are validated on the device: one outside the table aborts the kernel (__trap), which
// poisons the CUDA context so that the next CUDA call fails.
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

// x (or dx) f32 or bf16; cos/sin of x's dtype or f32; positions i32.
void rope_forward(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& cos_SD, const Tensor& sin_SD,
                  bool interleaved);
void rope_backward(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& cos_SD, const Tensor& sin_SD,
                   bool interleaved);
void rope_forward_at(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& positions_S, const Tensor& cos_PD,
                     const Tensor& sin_PD, bool interleaved);
void rope_backward_at(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& positions_S, const Tensor& cos_PD,
                      const Tensor& sin_PD, bool interleaved);

}  // namespace moefold::cuda
