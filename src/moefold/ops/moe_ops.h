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

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold {

enum class ScoreFunc : uint8_t { softmax, sigmoid };

// How router logits become the k combine weights of each token (Qwen3-MoE: softmax + renorm;
// DeepSeek-V3: sigmoid + selection bias + group-limited top-k + renorm + scaling).
struct TopkRouting {
  ScoreFunc score_func = ScoreFunc::softmax;  // scores_TE = softmax or sigmoid(logits_TE)
  bool norm_topk_prob = true;                 // divide the k selected scores by their sum
  double scaling = 1.0;                       // multiplies the (renormalised) k probabilities
  int64_t n_group = 1;                        // experts form n_group contiguous groups of E / n_group (DeepSeek-V3)
  int64_t topk_group = 1;                     // the top-k is taken among the experts of the topk_group best groups
  Tensor bias_E{};                            // selection-only bias [E], f32 or the logits' dtype; undefined: none
};

// ---- router scores and top-k -------------------------------------------------------------------
// scores_TE = score_func(logits_TE); choice_te = scores_te + bias_e (bias 0 when undefined).
// Group-limited routing (DeepSeek-V3, Hugging Face's DeepseekV3MoE.route_tokens_to_experts): a
// group's score is the sum of its top-min(2, E/n_group) choices; only the topk_group best groups
// stay eligible. topk_idx_TK = the K highest choices among the eligible experts, in descending
// order; ties go to the lower group / expert index everywhere. topk_prob_TK = scaling *
// (renormalised) UNBIASED scores of the selected experts: the bias steers selection only.
// Experts of dropped groups are excluded (choice -inf); Hugging Face sets them to 0 instead
// (masked_fill(0.0)), which picks a different expert only when an eligible choice, scores + bias,
// is <= 0. Renormalisation divides by the plain sum (Hugging Face adds 1e-20 to it).
// K = topk_idx_TK.size(1). logits, scores and probs share one float dtype.
// REQUIRES: n_group divides E, 1 <= topk_group <= n_group, 1 <= K <= topk_group * E / n_group.
void router_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const TopkRouting& routing,
                         const Tensor& scores_TE, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK);
// dlogits_TE = d(sum dprob_TK * topk_prob_TK)/dlogits through the fixed selection (written). The
// bias and the groups only choose topk_idx_TK, so nothing flows to the bias.
void router_topk_backward(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& topk_idx_TK,
                          const TopkRouting& routing, const Tensor& dprob_TK, const Tensor& dlogits_TE);

// counts_E[e] = number of (t, k) with topk_idx_TK[t, k] == e (i64, written).
void topk_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& counts_E);

// The router losses below return their value; given loss_1 (f64 [1] on the device of their
// scores / logits), they write it there instead and return NaN without waiting for the device
// (a step whose layers never wait: the value is read after the layer, the same bits).

// ---- load-balancing loss (Switch Transformer eq. 4 / GShard, normalised as Megatron-Core's
// switch_load_balancing_loss_func): aux = E / (T*T*K) * sum_e (sum_t p_te) * counts_E[e], where
// p is the full score distribution (softmax scores; sigmoid scores normalised per token to sum
// 1). Exactly 1 for perfectly uniform routing. counts_E (i64) are the routed assignments before
// capacity dropping and carry no gradient.
// Split sequences (context parallelism): with counts_E summed over the ranks that share the
// micro-batch and total_tokens = T of all of them, each rank returns its share (the sum over the
// ranks is the aux loss of the whole micro-batch) and its tokens' gradient. 0: T of this call.
double aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E,
                        int64_t k, int64_t total_tokens = 0, const Tensor& loss_1 = Tensor());
// dlogits_TE = grad_scale * d(aux)/d(logits) (written).
void aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E,
                       int64_t k, double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens = 0);

// ---- sequence-level load-balancing loss (DeepSeek-V3, eq. 17-20; Megatron-Core's
// sequence_load_balancing_loss_func) --------------------------------------------------------------
// For each sequence b of S tokens: f_be = E / (K*S) * counts_BE[b, e] (selections of e in b),
// P_be = (1/S) sum_{t in b} p_te with p the full score distribution (softmax scores; sigmoid
// scores normalised per token to sum 1); loss = (1/B) sum_b sum_e f_be * P_be, exactly 1 for
// perfectly uniform routing. The counts carry no gradient.
//
// A rank may hold part of each sequence: context parallelism gives it local_seq_len = S / cp
// tokens of every sequence, laid out sequence after sequence ([B * local_seq_len] rows), and
// sequence parallelism gives each TP rank a contiguous slice of those rows. Local row t belongs to
// sequence (row_offset + t) / local_seq_len. With counts_BE summed over the ranks that share the
// micro-batch, each rank returns its share (the shares sum to the whole loss) and the gradient of
// its share, which is its tokens' gradient of the whole loss.
struct SeqLayout {
  int64_t local_seq_len = 0;  // tokens of each sequence held by this rank's group (S / cp)
  int64_t row_offset = 0;     // rows of the [B * local_seq_len] block before this rank's first row
  int64_t seq_len = 0;        // S, tokens of one whole sequence
};
// counts_BE[b, e] = selections of expert e by this rank's tokens of sequence b (i64, written;
// B = counts_BE.size(0), E = counts_BE.size(1)). REQUIRES: every local row maps into [0, B).
void seq_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const SeqLayout& layout,
                       const Tensor& counts_BE);
// This rank's share of the loss: E / (K * S^2 * B) * sum_t sum_e counts_BE[b(t), e] * p_te.
double seq_aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func,
                            const Tensor& counts_BE, int64_t k, const SeqLayout& layout,
                            const Tensor& loss_1 = Tensor());
// dlogits_TE = grad_scale * d(share)/d(logits) (written).
void seq_aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func,
                           const Tensor& counts_BE, int64_t k, const SeqLayout& layout, double grad_scale,
                           const Tensor& dlogits_TE);

// ---- aux-loss-free balancing (DeepSeek-V3 section 2.1.2; Megatron-Core's
// moe_router_bias_update_rate rule) ----------------------------------------------------------------
// bias_E[e] += rate * sign(mean(counts_E) - counts_E[e]), sign(0) = 0: under-loaded experts become
// more likely to be selected. counts_E (i64) are the selections of a whole step over every rank,
// so every rank applies the same update. bias_E: f32 or f64.
void expert_bias_update(const ExecContext& ctx, const Tensor& bias_E, const Tensor& counts_E, double rate);

// ---- a forward's router statistics into a step's sums (the trainer's, kept on the device) -------
// What one MoE layer's forward adds to its step's statistics, without the host seeing it:
//   sums_2[0] += aux_coeff * losses_3[0] + seq_aux_coeff * losses_3[1]   (load-balancing losses)
//   sums_2[1] += z_coeff * losses_3[2]                                    (z-loss)
//   load_E[e] += counts_E[e]
//   dropped_1[0] += sum_e max(0, counts_E[e] - capacity)   (the assignments the capacity drops;
//                   nothing when capacity <= 0: dropless)
// losses_3: f64 [3] (the router's aux, sequence aux and z before their coefficients); a term whose
// coefficient is 0 is left out (its loss may not have been computed). counts_E: i64 [E]; sums_2,
// load_E, dropped_1: f64. The products and sums in that order, in double, without fused
// multiply-adds: both devices give the same bits.
void moe_step_stats(const ExecContext& ctx, const Tensor& losses_3, double aux_coeff, double seq_aux_coeff,
                    double z_coeff, const Tensor& counts_E, int64_t capacity, const Tensor& sums_2,
                    const Tensor& load_E, const Tensor& dropped_1);

// ---- router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): z = mean_t (logsumexp_e logits_te)^2 ------
// The mean is over total_tokens (0: T of this call), as for the aux loss.
double z_loss_forward(const ExecContext& ctx, const Tensor& logits_TE, int64_t total_tokens = 0,
                      const Tensor& loss_1 = Tensor());
// dlogits_TE = grad_scale * 2 * lse_t / T * softmax(logits)_te (written).
void z_loss_backward(const ExecContext& ctx, const Tensor& logits_TE, double grad_scale, const Tensor& dlogits_TE,
                     int64_t total_tokens = 0);

// ---- permutation plan: tokens -> expert-contiguous rows ------------------------------------------
// Expert e's rows are [offsets_E1[e], offsets_E1[e+1]); within an expert, rows follow token
// order. capacity <= 0: dropless. capacity > 0: each expert keeps its `capacity` assignments of
// highest topk_prob (ties to the lower token) and drops the rest (row_TK = -1). pad: each expert
// gets exactly `capacity` rows; the unused ones have token_R = -1. A negative topk_idx is an empty
// slot (HierarchicalDispatcher's relayed tokens carry fewer than K experts): no row, row_TK = -1.
// Outputs (all i64, written): counts_E (rows per expert, padding included), offsets_E1 [E+1],
// row_TK [T, K], token_R (at least the returned number of rows R). Returns R. wait = false returns
// R without waiting for the device: dropless without empty slots it is T*K, padded E*capacity,
// and with a capacity and no padding the plan pads the last expert up to the bound
// B = min(T*K, E*capacity) (rows with token_R = -1, as padding: the experts compute zeros there)
// and returns B. On a GPU a bad index then stops the kernel (a device trap that the next CUDA call
// reports) instead of failing here.
// REQUIRES: topk_idx < E, its non-negative entries distinct within a token; token_R large enough
// (checked).
struct PermutePlanOut {
  Tensor counts_E;
  Tensor offsets_E1;
  Tensor row_TK;
  Tensor token_R;
};
int64_t moe_permute_plan(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK,
                         int64_t capacity, bool pad, const PermutePlanOut& out, bool wait = true);

// rows_RH[r] = x_TH[token_R[r]] (zero for padding rows). R = rows_RH.size(0) <= token_R.numel().
void moe_permute(const ExecContext& ctx, const Tensor& x_TH, const Tensor& token_R, const Tensor& rows_RH);
// dx_TH[t] = sum_k drows_RH[row_TK[t, k]] over kept assignments (written).
void moe_permute_backward(const ExecContext& ctx, const Tensor& drows_RH, const Tensor& row_TK, const Tensor& dx_TH);

// ---- combine: y_TH[t] = sum_k prob_TK[t, k] * out_RH[row_TK[t, k]] (dropped: 0), written ------
void moe_combine(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                 const Tensor& y_TH);
// dout_RH[row(t,k)] = prob_tk * dy_t and 0 in the padding rows (token_R[r] < 0: every other row
// is some kept assignment's, as moe_permute_plan makes them), dprob_TK[t, k] = <dy_t,
// out_RH[row(t,k)]> (0 when dropped); both written. R = dout_RH.size(0) <= token_R.numel().
void moe_combine_backward(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                          const Tensor& token_R, const Tensor& dy_TH, const Tensor& dout_RH, const Tensor& dprob_TK);

// ---- expert-parallel slots (SlotDispatcher): the exchange in fixed-size slots, counts on the device
// P EP peers of L local experts each (E = P * L global experts). The rows a rank sends to peer p
// travel in slot p: rows [p * B, (p + 1) * B) of a [P * B, H] buffer, expert-major over p's
// experts, B = slot_rows fixed at plan time, so the exchange needs no count on the host.
//
// The sending side, from moe_permute_plan over the E global experts (home_offsets_E1 = its
// offsets_E1, home_token_S = its token_R, row_TK = its row_TK): peer p's home rows (its experts'
// rows, in order) fill slot p; those past B rows do not fit. Written: token_X (i64 [P * B]) the
// token of each slot row, -1 where there is none (a free row or a padding row); slot_TK (i64
// [T, K]) the slot row of each assignment, -1 when dropped or when it did not fit; send_counts_PL
// (i64 [P, L]) the rows of each of p's experts in slot p. overflow_1 (f64 [1]) is ADDED the rows
// that did not fit. fill_1 (f64 [1], optional) is MAX-ed with the fill asked of the slots: the most
// home rows of one peer over B (above 1: some did not fit; B = 0 counts as 1 row). REQUIRES:
// home_offsets_E1 non-decreasing from 0, row_TK's rows below its last, E <= 1024; fill_1 >= 0.
void moe_ep_send_slots(const ExecContext& ctx, const Tensor& home_offsets_E1, const Tensor& home_token_S,
                       const Tensor& row_TK, int64_t slot_rows, const Tensor& token_X, const Tensor& slot_TK,
                       const Tensor& send_counts_PL, const Tensor& overflow_1, const Tensor& fill_1 = Tensor());
// The receiving side: recv_counts_PL (i64 [P, L]) the rows slot p brought for each local expert
// (peer p's send_counts_PL for this rank). The experts' R = src_R.numel() rows are expert-major,
// expert l's from every slot in slot order; rows past R do not fit, and the rows the slots leave
// free pad the LAST expert (offsets_L1[L] = R: grouped ops see all R rows; padding rows are zero
// rows, which compute and add nothing). Written: src_R (i64 [R]) the slot row of each expert row,
// -1 for padding; row_X (i64 [P * B]) the expert row of each slot row, -1 where there is none;
// counts_L (i64 [L], padding included) and offsets_L1 (i64 [L + 1]). overflow_1 (f64 [1]) is ADDED
// the rows that did not fit; fill_1 (f64 [1], optional) is MAX-ed with the rows that came over R (R = 0
// counts as 1 row). REQUIRES: counts >= 0, each slot's sum <= B, E = P * L <= 1024 (CUDA: the
// tables live in shared memory); fill_1 >= 0.
void moe_ep_recv_slots(const ExecContext& ctx, const Tensor& recv_counts_PL, int64_t slot_rows, const Tensor& src_R,
                       const Tensor& row_X, const Tensor& counts_L, const Tensor& offsets_L1, const Tensor& overflow_1,
                       const Tensor& fill_1 = Tensor());

// ---- node routing (HierarchicalDispatcher): each token crosses to a node once ---------------------
// The experts are split over nodes in contiguous blocks of `experts_per_node` (N * experts_per_node
// = E). A token's kept assignments (keep_row_TK[t, k] >= 0; undefined keep_row_TK: all kept) that
// share a node travel there as ONE row, carrying those experts and their probabilities.
// moe_node_route writes node_idx_TK (i32 [T, K]): the assignment's node for the first kept k of
// its token on that node (the "leader", which moe_permute_plan over N nodes gives the token's row
// on the node), -1 for the other k's and for dropped ones; and slot_TK (i32 [T, K]): the kept
// assignment's place among its token's kept assignments on the same node (0, 1, ...), -1 dropped.
void moe_node_route(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& keep_row_TK,
                    int64_t experts_per_node, const Tensor& node_idx_TK, const Tensor& slot_TK);
// With node_row_TK (moe_permute_plan over node_idx_TK: the leaders' rows, R0 rows in all): the
// travelling rows' experts and probabilities. meta_idx_RS (i32 [R0, S]) gets each row's experts as
// node-local indices (expert - node * experts_per_node) in slot order, -1 in unused slots;
// meta_prob_RS (prob dtype [R0, S]) their topk_prob, 0 in unused slots; assign_TK (i64 [T, K]) the
// flat place row * S + slot of each kept assignment, -1 for dropped ones. All written.
// REQUIRES: S >= the most kept assignments of a token on one node (min(K, experts_per_node)).
void moe_node_meta(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK,
                   const Tensor& node_idx_TK, const Tensor& slot_TK, const Tensor& node_row_TK,
                   int64_t experts_per_node, const Tensor& meta_idx_RS, const Tensor& meta_prob_RS,
                   const Tensor& assign_TK);
// dprob_TK[t, k] = dmeta_RS.flat[assign_TK[t, k]] (0 where assign_TK is -1), written: the
// gradient of the probabilities moe_node_meta sent, back in the tokens' order.
void moe_node_meta_backward(const ExecContext& ctx, const Tensor& dmeta_RS, const Tensor& assign_TK,
                            const Tensor& dprob_TK);

// ---- grouped linear: y[rows of e] = x[rows of e] @ w_EOI[e]^T for each expert e ---------------
// offsets_E1 (i64, [E+1]) delimit each expert's rows; offsets_E1[E] = R = x_RI.size(0). Experts
// with no rows are skipped (their dw is left untouched).
void grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                            const Tensor& y_RO);
// dx_RI written (skipped when undefined); dw_EOI (skipped when undefined) accumulated, or with accumulate == false
// written: dw_e = dy_e^T x_e for every expert, zero for experts without rows (the first
// backward of a step writes the expert gradients instead of adding to zeros: Memory's
// grad_written_by_backward).
void grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                             const Tensor& dy_RO, const Tensor& dx_RI, const Tensor& dw_EOI, bool accumulate = true);

// ---- grouped linear fused with SwiGLU (the routed experts' first layer and its gradient) -------
// The experts' gate_up weight interleaves gate and up rows (GateUp::pairs, ops.h), so its output
// gu has (g_j, u_j) in columns (2j, 2j + 1) and one GEMM epilogue can apply SwiGLU (CUDA with
// CUTLASS; elsewhere the same result from grouped_linear + swiglu). Both write all their outputs.
// gu_R2F = grouped_linear(x_RI, w_E2FI); h_RF = swiglu(gu) (pairs; h is computed from the stored
// (rounded) gu, so it equals swiglu_forward on gu).
void grouped_linear_swiglu_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_E2FI,
                                   const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& h_RF);
// The input gradient of the second layer, through SwiGLU: dh = dy_RO @ w_EOF per expert (the dx of
// grouped_linear_backward with input h), dgu_R2F = swiglu_backward(gu_R2F, dh) (pairs, dh rounded
// to the activation dtype first). dh_RF is a workspace (the fused path never writes it; its
// contents are unspecified afterwards).
void grouped_linear_swiglu_backward_data(const ExecContext& ctx, const Tensor& dy_RO, const Tensor& w_EOF,
                                         const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& dh_RF,
                                         const Tensor& dgu_R2F);

}  // namespace moefold
