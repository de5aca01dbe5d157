// The CUDA SwiGLU of ops/ops.h (swiglu.cu; its arithmetic in swiglu.cuh): the same names and
// contracts, in namespace moefold::cuda; ops/cpu/swiglu.cpp dispatches here for CUDA tensors.
// Gradient rule: dgu WRITTEN. Every tensor a contiguous CUDA tensor; ops run on the context's
// stream and never synchronise the host. Only in the CUDA build.
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/ops.h"  // GateUp

namespace moefold::cuda {

// gu, h, dh, dgu of one dtype (f32 or bf16); layout as in ops.h (GateUp). bf16 runs 16-byte
// vectors when widths and alignment allow (halves: F % 8 == 0; pairs: N * F % 4 == 0).
void swiglu_forward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& h_NF, GateUp layout);
void swiglu_backward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& dh_NF, const Tensor& dgu_N2F,
                     GateUp layout);

}  // namespace moefold::cuda
