// The CUDA implementations of the row-wise ops of ops/ops.h: embedding, RMSNorm, RoPE, SwiGLU and
// softmax cross-entropy, with the same names and contracts (shapes; activation grads WRITTEN,
// parameter grads ACCUMULATED), in namespace moefold::cuda. The CPU ops dispatch here when their
// tensors are CUDA tensors; callers never name a backend. Activations are float32 or bfloat16
// (compute and every reduction in float32); statistics (rstd, lse) are float32; a parameter
// gradient may be float32 while the activations are bfloat16. Every tensor must be a contiguous
// CUDA tensor. Only in the CUDA build (MOEFOLD_WITH_CUDA). No op synchronises the host except
// cross_entropy_forward, which returns a host value.
//
// Indices (ids, positions, targets) are validated on the device: an index outside its range
// aborts the kernel (__trap), which poisons the CUDA context so that the next CUDA call fails;
// the host cannot check them without a synchronisation.
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/ops.h"  // GateUp

namespace moefold::cuda {

// ---- embedding (embedding.cu) ----------------------------------------------------------------
// ids i32; table and out of one dtype (f32 or bf16).
void embedding_forward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& table_VC, const Tensor& out_NC);
// dout f32 or bf16; dtable of dout's dtype or f32. Deterministic without atomics: the first
// occurrence of each id owns its row of dtable and adds up every occurrence in token order, so
// repeated ids are exact and the result is bit-identical run to run. Costs O(N^2) i32 compares
// (ids stay in L2) and ceil(N / 2048) * 264 bytes of shared memory per block. REQUIRES: that fits
// the device's opt-in shared memory per block (N up to 1.8M tokens on H100/H200). A very
// frequent id is summed by one block, so heavy skew (one id in most tokens) is slow.
void embedding_backward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& dout_NC, const Tensor& dtable_VC);
// The same for a shard of the table: rows [vocab_offset, vocab_offset + Vl) of the vocabulary
// (vocabulary parallelism). ids are global, >= 0; an id outside the shard gives a zero row
// (forward) and no gradient (backward). With an f32 dtable both backwards equal the CPU's
// token-order sums bit for bit.
void embedding_shard_forward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& table_VlC, int64_t vocab_offset, const Tensor& out_NC);
void embedding_shard_backward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& dout_NC, int64_t vocab_offset,
                              const Tensor& dtable_VlC);

// ---- RMSNorm (rmsnorm.cu) --------------------------------------------------------------------
// x and y of one dtype (f32 or bf16); w of x's dtype or f32; rstd f32. One warp per row for
// C <= 1024, one 256-thread block per row beyond; sums in float32.
void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, double eps, const Tensor& y_NC, const Tensor& rstd_N);
// x, dy, dx of one dtype; w and dw each of x's dtype or f32; rstd f32; dw ACCUMULATED.
// Deterministic: dw is summed per column over fixed chunks of rows, then over the chunks in order
// (bit-identical run to run on one GPU model; the chunk count follows the SM count).
// The per-chunk partial sums (f32, at most N/2 rows of them) live in dx's storage, which is
// free until dx is written last, so the op needs no workspace; hence dx must not overlap x, dy,
// w, rstd or dw (checked). A dx not 4-byte aligned gets one chunk (correct, slower).
void rmsnorm_backward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N, const Tensor& dy_NC,
                      const Tensor& dx_NC, const Tensor& dw_C);

// ---- RoPE (rope.cu) --------------------------------------------------------------------------
// x (or dx) f32 or bf16, rotated in place; cos/sin of x's dtype or f32; positions i32.
void rope_forward(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& cos_SD, const Tensor& sin_SD, bool interleaved);
void rope_backward(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& cos_SD, const Tensor& sin_SD, bool interleaved);
void rope_forward_at(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& positions_S, const Tensor& cos_PD, const Tensor& sin_PD,
                     bool interleaved);
void rope_backward_at(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& positions_S, const Tensor& cos_PD, const Tensor& sin_PD,
                      bool interleaved);

// ---- SwiGLU (swiglu.cu) ----------------------------------------------------------------------
// gu, h, dh, dgu of one dtype (f32 or bf16); layout as in ops.h (GateUp). bf16 runs 16-byte
// vectors when widths and alignment allow (halves: F % 8 == 0; pairs: N * F % 4 == 0).
void swiglu_forward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& h_NF, GateUp layout);
void swiglu_backward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& dh_NF, const Tensor& dgu_N2F, GateUp layout);

// ---- softmax cross-entropy (cross_entropy.cu) ------------------------------------------------
// logits f32 or bf16 [N, V]; targets i32 (kIgnoreTarget: no loss, lse 0); lse f32. One block per
// row with an online max / sum-exp over the vocabulary in float32 (16-byte loads when V and the
// pointers allow, element by element otherwise); the row losses are summed in float64 in a fixed
// order (deterministic). WAITS for the GPU: returns the host sum of row losses (uses the
// context's scratch: N + 1 doubles).
double cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N, const Tensor& lse_N);
// dlogits in the logits' dtype, WRITTEN (ignored rows zero); may be the logits tensor itself
// (in place: each element is read before it is written, by the same thread).
void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N, const Tensor& lse_N, double grad_scale,
                            const Tensor& dlogits_NV);

}  // namespace moefold::cuda
