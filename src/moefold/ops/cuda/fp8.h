// The CUDA side of FP8 blockwise training (ops/fp8.h): the quantize / dequantize kernels
// (fp8_quantize.cu, bit for bit as the CPU reference) and the FP8 linear layers on CUTLASS's
// Hopper blockwise-scaled grouped GEMM (fp8_gemm_cutlass.cu). Same names and contracts as the ops
// in ops/fp8.h, whose entry points check the arguments and dispatch CUDA tensors here. Only in the
// CUDA build.
//
// GPU-specific conditions, checked here: inputs f32 or bf16 (no f64 on the GPU); the GEMMs take
// bf16 x, w, dy (y and dx bf16; dw f32 or bf16), I and O multiples of 16 (TMA moves rows of 16
// bytes of E4M3) and 16-byte aligned tensors, and need a build with CUTLASS's headers.
#pragma once

#include <cstdint>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/fp8.h"

namespace moefold::cuda {

// Whether this build has CUTLASS's headers (MOEFOLD_WITH_CUTLASS): without them the FP8 GEMMs
// fail with a clear error; the quantize ops work either way.
bool fp8_gemm_built();

// ---- quantization (ops/fp8.h; REQUIRES: the entry point's checks passed) -------------------------
void fp8_quantize_rows(const ExecContext& ctx, const Tensor& x_RK, const Tensor& q_RK, const Tensor& s_BR);
void fp8_quantize_cols(const ExecContext& ctx, const Tensor& x_RC, const Tensor& offsets_S1, const Tensor& qT_CP,
                       const Tensor& sT_BC);
void fp8_quantize_blocks(const ExecContext& ctx, const Tensor& w, const Tensor& q, const Tensor& s, const Tensor& qT,
                         const Tensor& sT, bool via_bf16);
void fp8_quantize_packed(const ExecContext& ctx, const Tensor& x_RK, const Tensor& p_RW);
void fp8_block_amax(const ExecContext& ctx, const Tensor& part, const Shape& whole, int64_t first, const Tensor& amax,
                    bool via_bf16);
void fp8_scales_from_amax(const ExecContext& ctx, const Tensor& amax_to_scale);
void fp8_quantize_part(const ExecContext& ctx, const Tensor& part, const Shape& whole, int64_t first, const Tensor& s,
                       const Tensor& q_part, bool via_bf16);
void fp8_transpose_blocks(const ExecContext& ctx, const Tensor& q, const Tensor& s, const Tensor& qT, const Tensor& sT);
void fp8_dequantize_rows(const ExecContext& ctx, const Tensor& q_RK, const Tensor& s_BR, const Tensor& x_RK);
void fp8_dequantize_packed(const ExecContext& ctx, const Tensor& p_RW, const Tensor& x_RK);
void fp8_swiglu_packed(const ExecContext& ctx, const Tensor& gu_R2F, const Tensor& p_RW);
void fp8_swiglu_backward_operands(const ExecContext& ctx, const Tensor& gu_R2F, const Tensor& dh_RF,
                                  const Tensor& offsets_E1, const Tensor& dgu_R2F, Fp8SharedOperands& dyq);
void fp8_dequantize_cols(const ExecContext& ctx, const Tensor& qT_CP, const Tensor& sT_BC, const Tensor& offsets_S1,
                         const Tensor& x_RC);
void fp8_dequantize_blocks(const ExecContext& ctx, const Tensor& q, const Tensor& s, const Tensor& w);

// ---- FP8 linear layers (ops/fp8.h; y, dx WRITTEN; dw ACCUMULATED unless accumulate == false) ----
// wq: the weight already quantized (null or undefined: quantized here into scratch).
// xin: x's shared operands (ops/fp8.h Fp8SharedOperands), or null.
void fp8_linear_forward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO,
                        const Fp8Weight* wq, Fp8SharedOperands* xin);
void fp8_linear_backward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO,
                         const Tensor& dx_NI, const Tensor& dw_OI, bool accumulate, const Fp8Weight* wq,
                         Fp8SharedOperands* xin);
void fp8_grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                const Tensor& offsets_E1, const Tensor& y_RO, const Fp8Weight* wq);
void fp8_grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                 const Tensor& offsets_E1, const Tensor& dy_RO, const Tensor& dx_RI,
                                 const Tensor& dw_EOI, bool accumulate, const Fp8Weight* wq, Fp8SharedOperands* dyq);

// ---- cuBLASLt's block-scaled FP8 GEMM (fp8_gemm_cublaslt.cu; the dense layers) -----------------
// out[m, n] (row-major, ld n; bf16 or f32) = a[m, K] b[n, K]^T + beta * out, both operands K-major
// E4M3 with row strides lda, ldb (bytes); a's scales per 1 x 128 tile along K ([K/128, m], m
// contiguous: the rows and cols layouts of ops/fp8.h); b's per 128 x 128 block (b_blocks: the
// blocks layout [ceil(n/128), ceil(K/128)] with its row stride padded to fp8_lt_block_ld, see
// fp8_lt_block_scales) or per 1 x 128 tile like a's. Returns false, running nothing, for shapes
// outside lt_fp8_gemm_serves or without a cuBLASLt algorithm (the caller runs CUTLASS).
bool lt_fp8_gemm_serves(int64_t m, int64_t n, int64_t k);
bool lt_fp8_gemm(const ExecContext& ctx, int64_t m, int64_t n, int64_t k, const uint8_t* a, int64_t lda,
                 const float* sa, const uint8_t* b, int64_t ldb, const float* sb, bool b_blocks, void* out,
                 DType out_dtype, float beta);
// GEMMs lt_fp8_gemm ran in this process (the tests' evidence of which kernel served a call).
int64_t lt_fp8_gemm_calls();
// The row stride cuBLASLt reads 128 x 128 block scales with: the blocks per row rounded up to 4.
inline int64_t fp8_lt_block_ld(int64_t cols) { return (cols + 3) / 4 * 4; }
// Block scales s [rows, cols] copied into padded [rows, fp8_lt_block_ld(cols)] (on ctx's stream).
void fp8_lt_block_scales(const ExecContext& ctx, const float* s, int64_t rows, int64_t cols, float* padded);

// ---- moefold's own grouped FP8 GEMM (fp8_grouped_gemm.cu; kernels.fp8_tile rows = own) ---------
// d[r, n] (bf16, [rows, n]) = a[r, :] b_e[n, :]^T for the rows r of group e (off: [groups + 1]
// device offsets, or nullptr: one group of all rows): a [rows, k] E4M3 with row stride lda (bytes)
// and scales sfa in launch_fp8_quantize_rows' grouped layout; b [groups, n, k] E4M3 with block
// scales sfb [groups, ceil(k / 128), ceil(n / 128)]. The bits of CUTLASS's blockwise kernel.
// REQUIRES: own_fp8_gemm_serves; a, b, d 16-byte aligned; an sm_90a GPU.
bool own_fp8_gemm_serves(int64_t groups, int64_t n, int64_t k, int64_t lda);
void own_fp8_grouped_gemm(const ExecContext& ctx, const uint8_t* a, int64_t lda, const float* sfa, int64_t rows,
                          const int64_t* off, int64_t groups, const uint8_t* b, const float* sfb, int64_t n, int64_t k,
                          void* d, const char* what);

// ---- raw launchers (fp8_quantize.cu), shared with the GEMMs' operand preparation -----------------
// x: device data of dtype f32 or bf16; outputs as in ops/fp8.h; everything on ctx's stream.

// The rows layout of x [rows, k]. group_offsets == nullptr: ops/fp8.h's scales s[b * rows + r].
// Else (device, [G + 1], rows grouped as by an expert offsets array): the GEMM's grouped layout,
// row r of group g (off[g] <= r < off[g + 1], m_g rows) has its tile b's scale at
// s[off[g] * B + b * m_g + (r - off[g])] (B = ceil(k / 128)): each group's scales are a packed
// [B, m_g] block, the per-group layout CUTLASS's grouped blockwise mainloop derives from the
// problem shape (fp8_gemm_cutlass.cu). One group of all rows is the plain layout.
void launch_fp8_quantize_rows(const ExecContext& ctx, const void* x, DType dtype, int64_t rows, int64_t k, uint8_t* q,
                              float* s, const int64_t* group_offsets, int64_t groups);
// The scales of packed rows p [rows, fp8_packed_width(k)] into s in the rows layout with group
// offsets as above (the forward's SFA when x arrives packed).
void launch_fp8_packed_scales(const ExecContext& ctx, const uint8_t* p, int64_t rows, int64_t k, float* s,
                              const int64_t* group_offsets, int64_t groups);
// The cols layout of x [rows, cols] into qT [cols, p] and sT [p / 128, cols], segments from the
// device offsets [segments + 1] (nullptr: one segment of all rows). REQUIRES: p % 128 == 0 and
// p >= the padded width the segments need (fp8_cols_width(rows, segments) suffices).
void launch_fp8_quantize_cols(const ExecContext& ctx, const void* x, DType dtype, int64_t rows, int64_t cols,
                              const int64_t* offsets, int64_t segments, int64_t p, uint8_t* qT, float* sT);
// Both layouts of bf16 x [rows, cols] from one read of x (an FP8 backward's dy: rows for the data
// gradient, cols for the weight gradient): q [rows, cols] and s as launch_fp8_quantize_rows with the
// segments as its groups (grouped_rows; else the plain layout s[b * rows + r]), qT and sT as
// launch_fp8_quantize_cols. The same bytes as those two. REQUIRES: fp8_rows_cols_fused_serves (else
// run the two), launch_fp8_quantize_cols's conditions on p.
bool fp8_rows_cols_fused_serves(DType dtype, int64_t cols, const void* x, const void* q);
void launch_fp8_quantize_rows_cols(const ExecContext& ctx, const void* x, DType dtype, int64_t rows, int64_t cols,
                                   const int64_t* offsets, int64_t segments, bool grouped_rows, uint8_t* q, float* s,
                                   int64_t p, uint8_t* qT, float* sT);
// launch_fp8_quantize_rows_cols of dgu = swiglu_backward(gu, dh) in the GateUp::pairs layout
// (cols = 2F; the values swiglu_backward's bf16 kernels write, computed as they are read): both
// operands of fc1's output gradient without dgu in memory. REQUIRES: fp8_swiglu_grad_fused_serves.
bool fp8_swiglu_grad_fused_serves(DType dtype, int64_t cols, const void* gu, const void* dh, const void* q);
void launch_fp8_swiglu_grad_rows_cols(const ExecContext& ctx, const void* gu, const void* dh, int64_t rows,
                                      int64_t cols, const int64_t* offsets, int64_t segments, uint8_t* q, float* s,
                                      int64_t p, uint8_t* qT, float* sT);
// The cols layout of packed rows x [rows, fp8_packed_width(cols)]'s values (the weight gradient's
// operand when x came packed; values exact, as launch_fp8_quantize_cols of their dequantization).
void launch_fp8_quantize_cols_packed(const ExecContext& ctx, const uint8_t* x, int64_t rows, int64_t cols,
                                     const int64_t* offsets, int64_t segments, int64_t p, uint8_t* qT, float* sT);
// The blocks layout of w [e, o, i]; any of q, s, qT, sT may be null (not written). via_bf16: w's
// values rounded to bf16 first.
void launch_fp8_quantize_blocks(const ExecContext& ctx, const void* w, DType dtype, int64_t e, int64_t o, int64_t i,
                                uint8_t* q, float* s, uint8_t* qT, float* sT, bool via_bf16);

}  // namespace moefold::cuda
