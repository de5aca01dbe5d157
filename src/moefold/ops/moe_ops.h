// MoE ops, forward and backward side by side: router scores + top-k, the load-balancing and z
// losses, the permutation of tokens into expert-contiguous rows (with capacity dropping and
// padding), the weighted un-permute (combine), and the grouped linear the experts run on.
//
// Gradient rule: gradients of activations (dlogits, drows, dx, dprob) are WRITTEN; gradients of
// parameters (dw of grouped_linear) are ACCUMULATED (+=).
// Shape letters: T tokens, H hidden, E experts, K top-k, R dispatched rows, I/O linear in/out.
// Integer tensors: topk_idx_TK is i32; every plan tensor (counts, offsets, rows, tokens) is i64.
#pragma once

#include <cstdint>

#include "moefold/core/tensor.h"

namespace moefold {

enum class ScoreFunc : uint8_t { softmax, sigmoid };

// How router logits become the k combine weights of each token (Qwen3-MoE: softmax + renorm;
// DeepSeek-V3: sigmoid + renorm + scaling).
struct TopkRouting {
  ScoreFunc score_func = ScoreFunc::softmax;  // scores_TE = softmax or sigmoid(logits_TE)
  bool norm_topk_prob = true;                 // divide the k selected scores by their sum
  double scaling = 1.0;                       // multiplies the (renormalised) k probabilities
};

// ---- router scores and top-k -------------------------------------------------------------------
// scores_TE = score_func(logits_TE); topk_idx_TK = the K highest scores of each token in
// descending order, ties to the lower expert index; topk_prob_TK = scaling * (renormalised)
// selected scores. K = topk_idx_TK.size(1) <= E. logits, scores and probs share one float dtype.
void router_topk_forward(const Tensor& logits_TE, const TopkRouting& routing, const Tensor& scores_TE,
                         const Tensor& topk_idx_TK, const Tensor& topk_prob_TK);
// dlogits_TE = d(sum dprob_TK * topk_prob_TK)/dlogits through the fixed selection (written).
void router_topk_backward(const Tensor& scores_TE, const Tensor& topk_idx_TK, const TopkRouting& routing,
                          const Tensor& dprob_TK, const Tensor& dlogits_TE);

// counts_E[e] = number of (t, k) with topk_idx_TK[t, k] == e (i64, written).
void topk_expert_counts(const Tensor& topk_idx_TK, const Tensor& counts_E);

// ---- load-balancing loss (Switch Transformer eq. 4 / GShard, normalised as Megatron-Core's
// switch_load_balancing_loss_func): aux = E / (T*T*K) * sum_e (sum_t p_te) * counts_E[e], where
// p is the full score distribution (softmax scores; sigmoid scores normalised per token to sum
// 1). Exactly 1 for perfectly uniform routing. counts_E (i64) are the routed assignments before
// capacity dropping and carry no gradient.
// Split sequences (context parallelism): with counts_E summed over the ranks that share the
// micro-batch and total_tokens = T of all of them, each rank returns its share (the sum over the
// ranks is the aux loss of the whole micro-batch) and its tokens' gradient. 0: T of this call.
double aux_loss_forward(const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E, int64_t k,
                        int64_t total_tokens = 0);
// dlogits_TE = grad_scale * d(aux)/d(logits) (written).
void aux_loss_backward(const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E, int64_t k,
                       double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens = 0);

// ---- router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): z = mean_t (logsumexp_e logits_te)^2 ------
// The mean is over total_tokens (0: T of this call), as for the aux loss.
double z_loss_forward(const Tensor& logits_TE, int64_t total_tokens = 0);
// dlogits_TE = grad_scale * 2 * lse_t / T * softmax(logits)_te (written).
void z_loss_backward(const Tensor& logits_TE, double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens = 0);

// ---- permutation plan: tokens -> expert-contiguous rows ------------------------------------------
// Expert e's rows are [offsets_E1[e], offsets_E1[e+1]); within an expert, rows follow token
// order. capacity <= 0: dropless. capacity > 0: each expert keeps its `capacity` assignments of
// highest topk_prob (ties to the lower token) and drops the rest (row_TK = -1). pad: each expert
// gets exactly `capacity` rows; the unused ones have token_R = -1.
// Outputs (all i64, written): counts_E (rows per expert, padding included), offsets_E1 [E+1],
// row_TK [T, K], token_R (at least the returned number of rows R). Returns R.
// REQUIRES: topk_idx in [0, E) and distinct within a token; token_R large enough (checked).
struct PermutePlanOut {
  Tensor counts_E;
  Tensor offsets_E1;
  Tensor row_TK;
  Tensor token_R;
};
int64_t moe_permute_plan(const Tensor& topk_idx_TK, const Tensor& topk_prob_TK, int64_t capacity, bool pad,
                         const PermutePlanOut& out);

// rows_RH[r] = x_TH[token_R[r]] (zero for padding rows). R = rows_RH.size(0) <= token_R.numel().
void moe_permute(const Tensor& x_TH, const Tensor& token_R, const Tensor& rows_RH);
// dx_TH[t] = sum_k drows_RH[row_TK[t, k]] over kept assignments (written).
void moe_permute_backward(const Tensor& drows_RH, const Tensor& row_TK, const Tensor& dx_TH);

// ---- combine: y_TH[t] = sum_k prob_TK[t, k] * out_RH[row_TK[t, k]] (dropped: 0), written ------
void moe_combine(const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK, const Tensor& y_TH);
// dout_RH[row(t,k)] = prob_tk * dy_t (padding rows 0), dprob_TK[t, k] = <dy_t, out_RH[row(t,k)]>
// (0 when dropped); both written.
void moe_combine_backward(const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK, const Tensor& dy_TH,
                          const Tensor& dout_RH, const Tensor& dprob_TK);

// ---- grouped linear: y[rows of e] = x[rows of e] @ w_EOI[e]^T for each expert e ---------------
// offsets_E1 (i64, [E+1]) delimit each expert's rows; offsets_E1[E] = R = x_RI.size(0). Experts
// with no rows are skipped (their dw is left untouched).
void grouped_linear_forward(const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1, const Tensor& y_RO);
// dx_RI written (skipped when undefined), dw_EOI accumulated.
void grouped_linear_backward(const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1, const Tensor& dy_RO,
                             const Tensor& dx_RI, const Tensor& dw_EOI);

}  // namespace moefold
