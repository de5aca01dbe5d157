// The CUDA router statistics and losses of ops/moe_ops.h (router_losses.cu): expert counts (per
// batch and per sequence), the load-balancing losses, the z-loss and the aux-loss-free bias
// update, with the same names and contracts, in namespace moefold::cuda; ops/cpu/router_losses.cpp
// dispatches here for CUDA tensors. Gradient rule: dlogits WRITTEN. Every tensor a contiguous
// CUDA tensor; scores, logits and dlogits f32 only; topk_idx i32; counts i64; the bias f32 or f64.
// Only in the CUDA build.
// Numerics: per-token sums and their products in f64, rounded once to f32; reductions in a fixed
// order, so every op is deterministic run to run (the only atomics add integer counts).
// Host synchronisation: the forwards return a host value and wait for the GPU, once each; only
// they take scratch (ScratchSlot::router_loss). The others only enqueue work.
// An expert index outside [0, E) in the counts stops the kernel with a printed message and a
// device trap: the next CUDA call fails (the host cannot see it without waiting).
// Shapes and the dtypes both devices share are checked once, by the CPU entry point before it
// dispatches here; these ops check what only the GPU needs (device, contiguity, GPU-only dtypes,
// sizes that must fit an int, launch and shared-memory limits).
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/moe_ops.h"

namespace moefold::cuda {

void topk_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& counts_E);
void seq_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const SeqLayout& layout,
                       const Tensor& counts_BE);

// The losses wait for the GPU unless given loss_1 (see moe_ops.h).
double aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E,
                        int64_t k, int64_t total_tokens, const Tensor& loss_1);
void aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E,
                       int64_t k, double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens = 0);
double seq_aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func,
                            const Tensor& counts_BE, int64_t k, const SeqLayout& layout, const Tensor& loss_1);
void seq_aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func,
                           const Tensor& counts_BE, int64_t k, const SeqLayout& layout, double grad_scale,
                           const Tensor& dlogits_TE);
void expert_bias_update(const ExecContext& ctx, const Tensor& bias_E, const Tensor& counts_E, double rate);
void moe_step_stats(const ExecContext& ctx, const Tensor& losses_3, double aux_coeff, double seq_aux_coeff,
                    double z_coeff, const Tensor& counts_E, int64_t capacity, const Tensor& sums_2,
                    const Tensor& load_E, const Tensor& dropped_1);
double z_loss_forward(const ExecContext& ctx, const Tensor& logits_TE, int64_t total_tokens, const Tensor& loss_1);
void z_loss_backward(const ExecContext& ctx, const Tensor& logits_TE, double grad_scale, const Tensor& dlogits_TE,
                     int64_t total_tokens = 0);

}  // namespace moefold::cuda
