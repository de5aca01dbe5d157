// The CUDA implementations of the MoE ops of ops/moe_ops.h (moe_ops.cu): the same functions,
// names and contracts (shapes, WRITTEN rules), in namespace moefold::cuda, for tensors on the GPU.
// ops/cpu/moe_ops.cpp dispatches here when the first tensor argument is a CUDA tensor. Only in
// the CUDA build (MOEFOLD_WITH_CUDA). Every tensor argument must be a contiguous CUDA tensor.
//
// Storage dtypes on the GPU:
//   router logits, scores, topk_prob, dprob of the router, dlogits of every loss: f32 only (the
//   router math stays fp32, DESIGN.md "Precision"); TopkRouting::bias_E: f32;
//   topk_idx: i32; counts and every plan tensor: i64;
//   permute / combine: tokens and rows (x, rows, drows, dx, out, y, dy, dout) f32 or bf16, all of
//   one dtype; the combine weights prob_TK / dprob_TK are f32 whatever that dtype is;
//   expert_bias_update: bias f32 or f64.
// Numerics: the router forward computes scores and the selection in f32 with the CPU reference's
// operation order for each score (a correctly rounded exp, IEEE add and divide), so selection
// matches the CPU op run in f32 except on choices within an ulp of each other; the backward ops
// and the losses compute per-token sums and their products in f64 and round once to f32.
// Reductions run in a fixed order: every op is deterministic run to run (the only atomics add
// integer counts).
//
// Host synchronisation: only the ops that return a host value (aux_loss_forward,
// seq_aux_loss_forward, z_loss_forward, moe_permute_plan) wait for the GPU, once each, and only
// they take scratch (the context's grow-only ScratchSlot buffers). The others only enqueue work.
// Violated REQUIRES that the host cannot see without waiting (an expert index outside [0, E) in
// topk_expert_counts / seq_expert_counts, a row or token index outside its tensor in the permute
// and combine ops) stop the kernel with a printed message and a device trap: the next CUDA call
// fails. moe_permute_plan checks its indices on the host like the CPU op (it waits anyway).
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/moe_ops.h"

namespace moefold::cuda {

// One warp per token. REQUIRES: E <= 1024, K <= 32 (DeepSeek-V3: E 256, K 8).
void router_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const TopkRouting& routing, const Tensor& scores_TE,
                         const Tensor& topk_idx_TK, const Tensor& topk_prob_TK);
// REQUIRES: K <= 32.
void router_topk_backward(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& topk_idx_TK, const TopkRouting& routing,
                          const Tensor& dprob_TK, const Tensor& dlogits_TE);

void topk_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& counts_E);
void seq_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const SeqLayout& layout, const Tensor& counts_BE);

double aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E, int64_t k,
                        int64_t total_tokens = 0);  // waits for the GPU
void aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E, int64_t k,
                       double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens = 0);
double seq_aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_BE, int64_t k,
                            const SeqLayout& layout);  // waits for the GPU
void seq_aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_BE, int64_t k,
                           const SeqLayout& layout, double grad_scale, const Tensor& dlogits_TE);
void expert_bias_update(const ExecContext& ctx, const Tensor& bias_E, const Tensor& counts_E, double rate);
double z_loss_forward(const ExecContext& ctx, const Tensor& logits_TE, int64_t total_tokens = 0);  // waits for the GPU
void z_loss_backward(const ExecContext& ctx, const Tensor& logits_TE, double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens = 0);

// Waits for the GPU once (R, and the index checks, come back to the host). topk_prob_TK: f32.
// The plan is bit-identical to the CPU op's. REQUIRES: T*K < 2^31, E <= 12288.
int64_t moe_permute_plan(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK, int64_t capacity, bool pad,
                         const PermutePlanOut& out);

void moe_permute(const ExecContext& ctx, const Tensor& x_TH, const Tensor& token_R, const Tensor& rows_RH);
// Sums the K rows of each token in f32, in k order (no atomics).
void moe_permute_backward(const ExecContext& ctx, const Tensor& drows_RH, const Tensor& row_TK, const Tensor& dx_TH);
// Accumulates in f32 in k order. prob_TK: f32.
void moe_combine(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK, const Tensor& y_TH);
// dout_RH is zeroed first (padding rows), then each kept (t, k) writes its row. prob_TK, dprob_TK: f32.
void moe_combine_backward(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK, const Tensor& dy_TH,
                          const Tensor& dout_RH, const Tensor& dprob_TK);

}  // namespace moefold::cuda
