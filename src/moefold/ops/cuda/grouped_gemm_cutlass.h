// The expert grouped GEMMs (ops/moe_ops.h grouped_linear_forward / _backward) through CUTLASS's
// Hopper grouped GEMM: one launch for every expert, the group sizes read on the device (no host
// read of the offsets). The default wherever it serves (docs/benchmarks.md: faster than cuBLASLt
// per expert at every benchmark shape); kernels.grouped_gemm = cublaslt selects cuBLASLt, one GEMM
// per expert after a host read of the offsets (gemm.cu). kernels.cutlass_tile picks the tile
// configuration per kind (core/kernel_options.h), kernels.gemm_sms the SMs they spread over. Same contracts as the ops
// (y, dx WRITTEN, dw ACCUMULATED); the offsets are trusted (they come from the permutation plan).
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

// Whether this build has CUTLASS's headers (CMake: MOEFOLD_WITH_CUTLASS).
bool cutlass_grouped_gemm_built();

// Run the op and return true, or return false having launched nothing when this path cannot
// serve the call (not built; not bf16 operands with a bf16 output / an f32 weight gradient; I or
// O not a multiple of 8; a pointer not 16-byte aligned). REQUIRES: the callers' checks passed.
bool cutlass_grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                    const Tensor& offsets_E1, const Tensor& y_RO);
bool cutlass_grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                     const Tensor& offsets_E1, const Tensor& dy_RO, const Tensor& dx_RI,
                                     const Tensor& dw_EOI, bool accumulate);

// The SwiGLU-fused kinds (ops/moe_ops.h grouped_linear_swiglu_*; gate and up interleaved, GateUp::pairs):
// forward: gu = x @ w^T stored as D, and h = silu(g) * u stored by the epilogue straight from the
// accumulator's (g, u) column pairs; backward data: dgu from dh = dy @ w in the epilogue, with gu
// loaded as the epilogue's source C and dgu stored as D, both viewed as F columns of 32-bit
// (bf16 g, bf16 u) pairs (dh is never stored). Tiles "large" or "pingpong" (kernels.cutlass_tile
// kinds swiglu_forward, default pingpong, and swiglu_dgrad, default large); "small" returns false
// (the unfused path), as do the forward for inputs wider than 2048 columns under
// kernels.fused_swiglu = auto (measured slower fused) and kernels.fused_swiglu = off. Same conditions as above
// otherwise (F a multiple of 8).
bool cutlass_grouped_linear_swiglu_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_E2FI,
                                           const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& h_RF);
bool cutlass_grouped_linear_swiglu_backward_data(const ExecContext& ctx, const Tensor& dy_RO, const Tensor& w_EOF,
                                                 const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& dgu_R2F);

}  // namespace moefold::cuda
