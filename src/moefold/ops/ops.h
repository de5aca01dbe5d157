// Every dense op of the model, forward and backward side by side (one CPU reference each in
// ops/cpu/, CUDA later in ops/cuda/). Tensor-level entry points check shapes and dtypes once,
// then dispatch on dtype (f32, or f64 for gradient checks) and device.
//
// Gradient rule for every backward below: gradients of activations (dx, dq, ...) are WRITTEN;
// gradients of parameters (dw, dtable) are ACCUMULATED (+=), so micro-batches add up.
// Shape letters: N rows (tokens), C channels, I/O linear in/out, V vocab, B batch, S sequence,
// Q query heads, G kv heads, D head dim, F expert FFN.
#pragma once

#include "moefold/core/tensor.h"

namespace moefold {

// ---- elementwise helpers -------------------------------------------------------------------
// y += x. REQUIRES: same dtype and numel, contiguous.
void add_inplace(const Tensor& y, const Tensor& x);
// Sum of squares of all elements, accumulated in double.
double sum_squares(const Tensor& x);
// x *= s.
void scale_inplace(const Tensor& x, double s);

// ---- embedding: out_NC[n] = table_VC[ids_N[n]] ---------------------------------------------
// ids are i32; REQUIRES: 0 <= id < V (the data loader validates token ids).
void embedding_forward(const Tensor& ids_N, const Tensor& table_VC, const Tensor& out_NC);
void embedding_backward(const Tensor& ids_N, const Tensor& dout_NC, const Tensor& dtable_VC);

// ---- RMSNorm (Qwen3/Llama form): y = w * x / sqrt(mean(x^2) + eps) over the last dim ---------
// rstd_N saves 1/sqrt(mean(x^2)+eps) for backward.
void rmsnorm_forward(const Tensor& x_NC, const Tensor& w_C, double eps, const Tensor& y_NC, const Tensor& rstd_N);
void rmsnorm_backward(const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N, const Tensor& dy_NC,
                      const Tensor& dx_NC, const Tensor& dw_C);

// ---- linear without bias: y_NO = x_NI @ w_OI^T (PyTorch/HF weight layout) ------------------
// dx may be undefined (Tensor{}) to skip the input gradient.
void linear_forward(const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO);
void linear_backward(const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO, const Tensor& dx_NI,
                     const Tensor& dw_OI);

// ---- rotary position embedding (HF "rotate_half" form, non-interleaved) --------------------
// Table for positions 0..S-1: inv_freq_j = theta^(-2j/D), angle = s * inv_freq_j;
// cos_SD/sin_SD hold each angle twice ([j] and [j + D/2]), as HF builds them.
void rope_table(double theta, const Tensor& cos_SD, const Tensor& sin_SD);
// x_BSHD (H heads) rotated in place: x = x*cos + rotate_half(x)*sin at position s.
void rope_forward(const Tensor& x_BSHD, const Tensor& cos_SD, const Tensor& sin_SD);
// The transpose: d = d*cos - ... ; in place on the gradient.
void rope_backward(const Tensor& dx_BSHD, const Tensor& cos_SD, const Tensor& sin_SD);

// ---- causal grouped-query attention ---------------------------------------------------------
// q_BSQD, k_BSGD, v_BSGD with Q % G == 0 (query head h reads kv head h / (Q/G));
// out_BSQD = softmax(q k^T * scale + causal mask) v; lse_BQS saves each row's log-sum-exp.
// work_SS: scratch of at least S*S elements (two such for backward: work_2SS holds 2*S*S).
void attention_forward(const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD, double scale,
                       const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& work_SS);
void attention_backward(const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD, const Tensor& out_BSQD,
                        const Tensor& lse_BQS, const Tensor& dout_BSQD, double scale, const Tensor& dq_BSQD,
                        const Tensor& dk_BSGD, const Tensor& dv_BSGD, const Tensor& work_2SS);

// ---- SwiGLU: h_NF = silu(gu[:, :F]) * gu[:, F:] on a fused gate|up input gu_N2F ------------
void swiglu_forward(const Tensor& gu_N2F, const Tensor& h_NF);
void swiglu_backward(const Tensor& gu_N2F, const Tensor& dh_NF, const Tensor& dgu_N2F);

// ---- softmax cross-entropy over the vocabulary ------------------------------------------------
// Returns the SUM over rows of -log softmax(logits)[target] (double); lse_N saved for backward.
// Targets are i32 in [0, V).
double cross_entropy_forward(const Tensor& logits_NV, const Tensor& targets_N, const Tensor& lse_N);
// dlogits = grad_scale * (softmax(logits) - onehot(target)); grad_scale is d(loss)/d(row loss),
// e.g. 1 / (tokens in the global batch).
void cross_entropy_backward(const Tensor& logits_NV, const Tensor& targets_N, const Tensor& lse_N, double grad_scale,
                            const Tensor& dlogits_NV);

}  // namespace moefold
