// The GPU GEMMs: a cuBLASLt wrapper on row-major device buffers (gemm.cu), and on it the CUDA
// implementations of linear and grouped linear (ops.h, moe_ops.h) and of matmul on matrix views.
// Same names, contracts and gradient rule as the CPU ops (activation grads WRITTEN, parameter
// grads ACCUMULATED); the CPU ops dispatch here for CUDA tensors. Only in the CUDA build.
//
// Numerics: every product accumulates in fp32 (CUBLAS_COMPUTE_32F, fp32 scale type). f32 inputs
// run in full fp32: TF32 would need CUBLAS_COMPUTE_32F_FAST_TF32, which we never ask for, so f32
// parity with the CPU stays at float rounding. Split-K algorithms may only reduce their partial
// sums in fp32 in the workspace (CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE), never through bf16 partial
// sums or in place in the output, so a given shape on a given GPU gives bit-identical results run
// to run. Measured on an H200 (cuBLASLt 13.0) against float64: f32 results 1e-7 relative (5e-7 at
// K = 768); bf16 results 1.7e-3 (one bf16 rounding), except 2.4e-3 for a few small-output
// algorithms with beta != 0 (as if alpha*op(A)op(B) were rounded to bf16 before adding beta*C).
//
// Resources: one cuBLASLt handle and one 32 MiB workspace per execution context (cuBLAS's
// recommended size on Hopper), created on the context's first GEMM and destroyed with it; a
// context's GEMMs run on its stream and share its workspace in stream order. Algorithms come from
// cuBLASLt's heuristic and are cached per (dtypes, transposes, m, n, k, leading dimensions,
// pointer alignments); a repeated shape costs a hash lookup and the launch, no allocation. A new
// shape costs the heuristic query (tens of microseconds) and one cache entry; the cache is
// cleared when it reaches 4096 entries.
#pragma once

#include <cstdint>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/ops.h"

namespace moefold::cuda {

// A row-major rows x cols matrix in device memory: element (i, j) at data + i * ld + j (elements).
struct DeviceMatrix {
  void* data = nullptr;      // element (0, 0)
  DType dtype = DType::f32;  // f32 or bf16
  int64_t rows = 0;          // rows of the stored (untransposed) matrix
  int64_t cols = 0;          // columns of the stored matrix
  int64_t ld = 0;            // row stride in elements, >= max(1, cols)
};

// c = alpha * op(a) @ op(b) + beta * c, op(x) = x^T when trans_x. op(a) is M x K, op(b) K x N, c is
// M x N (checked). beta == 0 never reads c (NaN in c does not propagate); K == 0 gives c = beta*c;
// M == 0 or N == 0 does nothing. Only c's M x N elements are written (its ld padding is not).
// Dtypes (a and b always alike): bf16 x bf16 -> bf16; bf16 x bf16 -> f32 (parameter gradients,
// router logits); f32 x f32 -> f32. cuBLASLt has no mixed a/b or f32 -> bf16 form: convert first.
// Any leading dimension and any element-aligned address (column blocks at odd offsets) work; the
// heuristic is told each address's alignment, so 16-byte-aligned addresses and leading dimensions
// get the fastest kernels. REQUIRES: c overlaps neither a nor b. Asynchronous on the context's stream.
void gemm(const ExecContext& ctx, const DeviceMatrix& a, bool trans_a, const DeviceMatrix& b, bool trans_b,
          const DeviceMatrix& c, double alpha, double beta);

// ---- linear (ops.h): y_NO = x_NI @ w_OI^T; dx = dy @ w (written, skipped when undefined);
// dw += dy^T @ x (accumulated) -------------------------------------------------------------------
// x, w, y, dy, dx share one dtype, f32 or bf16; dw is that dtype or f32 (bf16 operands with an
// fp32 gradient accumulator).
void linear_forward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO);
void linear_backward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO,
                     const Tensor& dx_NI, const Tensor& dw_OI);

// ---- grouped linear (moe_ops.h): expert e owns rows [offsets_E1[e], offsets_E1[e+1]) ------------
// y[rows of e] = x[rows of e] @ w_EOI[e]^T; dx written (skipped when undefined); dw_EOI[e] +=
// dy[rows of e]^T @ x[rows of e], left untouched for experts without rows (accumulate == false:
// dw_EOI[e] = ..., zero without rows). Dtypes as for linear; offsets_E1 is i64 on the GPU.
// KNOWN COST: each call copies the E+1 offsets to the host, which waits for the GPU (one small
// synchronising copy per call), then issues one cuBLASLt GEMM per non-empty expert (two in
// backward: dx and dw). Expert row counts change every step, so new shapes also pay the heuristic
// query. The follow-up is a device-side grouped GEMM (CUTLASS grouped GEMM or cuBLASLt grouped)
// that reads the offsets on the GPU: no host wait, one launch for all experts.
void grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                            const Tensor& y_RO);
void grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                             const Tensor& dy_RO, const Tensor& dx_RI, const Tensor& dw_EOI, bool accumulate);
// The SwiGLU-fused pair (moe_ops.h): CUTLASS epilogues where they serve (bf16, grouped_gemm_cutlass.h),
// else grouped_linear + swiglu (pairs).
void grouped_linear_swiglu_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_E2FI,
                                   const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& h_RF);
void grouped_linear_swiglu_backward_data(const ExecContext& ctx, const Tensor& dy_RO, const Tensor& w_EOF,
                                         const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& dh_RF,
                                         const Tensor& dgu_R2F);

// ---- matmul on matrix views (ops.h) --------------------------------------------------------------
// The views' shapes, bounds and overlap are checked by moefold::matmul; dtypes as for gemm.
void matmul(const ExecContext& ctx, const MatrixView& a, bool trans_a, const MatrixView& b, bool trans_b,
            const MatrixView& c, double alpha, double beta);

}  // namespace moefold::cuda
