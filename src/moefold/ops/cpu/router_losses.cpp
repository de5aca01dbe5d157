// CPU reference of the router statistics and losses (moe_ops.h): expert counts, the
// load-balancing losses (batch and sequence level), the aux-loss-free bias update and the
// z-loss; the scalar losses are accumulated in double. Gradient rule: dlogits WRITTEN; the
// counts carry no gradient. CUDA tensors go to ops/cuda/router_losses.cu.
#include <algorithm>
#include <cmath>
#include <limits>

#include "moefold/ops/cpu/moe_common.h"
#include "moefold/ops/dispatch.h"
#include "moefold/ops/moe_ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/router_losses.h"
#endif

namespace moefold {

void topk_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& counts_E) {
  check_2d(topk_idx_TK, "topk_expert_counts topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "topk_expert_counts topk_idx");
  check_dtype(counts_E, DType::i64, "topk_expert_counts counts");
  MF_CHECK(counts_E.ndim() == 1 && counts_E.contiguous(), "topk_expert_counts counts: ", counts_E.str());
  MF_ON_GPU(ctx, topk_idx_TK, cuda::topk_expert_counts(ctx, topk_idx_TK, counts_E));
  check_on_cpu(topk_idx_TK, "topk_expert_counts topk_idx");
  const int64_t e_n = counts_E.size(0);
  const int32_t* idx = topk_idx_TK.ptr<int32_t>();
  int64_t* counts = counts_E.ptr<int64_t>();
  for (int64_t e = 0; e < e_n; ++e) counts[e] = 0;
  for (int64_t i = 0; i < topk_idx_TK.numel(); ++i) {
    MF_CHECK(idx[i] >= 0 && idx[i] < e_n, "expert index ", idx[i], " out of [0, ", e_n, ")");
    ++counts[idx[i]];
  }
}

// ---- load-balancing losses ---------------------------------------------------------------------

namespace {
// A loss's optional output (moe_ops.h): f64 [1].
void check_loss_out(const Tensor& loss_1, const char* what) {
  if (!loss_1.defined()) return;
  check_dtype(loss_1, DType::f64, what);
  MF_CHECK(loss_1.numel() == 1, what, ": loss ", loss_1.str());
}
// The value returned, or written to loss_1 (a host tensor here) and NaN returned.
double deliver(double value, const Tensor& loss_1) {
  if (!loss_1.defined()) return value;
  check_on_cpu(loss_1, "router loss output");
  loss_1.ptr<double>()[0] = value;
  return std::numeric_limits<double>::quiet_NaN();
}
void check_aux(const Tensor& scores_TE, const Tensor& counts_E, int64_t k) {
  check_2d(scores_TE, "aux_loss scores");
  check_dtype(counts_E, DType::i64, "aux_loss counts");
  MF_CHECK(counts_E.ndim() == 1 && counts_E.size(0) == scores_TE.size(1) && k >= 1, "aux_loss: scores ",
           scores_TE.str(), ", counts ", counts_E.str(), ", k ", k);
}

// sum_e counts[e] * p_e for one token, p = the full score distribution (softmax scores; sigmoid
// scores normalised to sum 1). Both load-balancing losses are sums of this over tokens.
template <class T>
double weighted_prob_row(const T* s, int64_t e_n, ScoreFunc score_func, const int64_t* counts) {
  double norm = 1;
  if (score_func == ScoreFunc::sigmoid) {
    norm = 0;
    for (int64_t e = 0; e < e_n; ++e) norm += static_cast<double>(s[e]);
  }
  double total = 0;
  for (int64_t e = 0; e < e_n; ++e) total += static_cast<double>(s[e]) / norm * static_cast<double>(counts[e]);
  return total;
}

// d = d(c0 * weighted_prob_row)/d(logits) for one token (written): with c_e = c0 * counts[e],
// softmax p = softmax(l): dl_e = p_e (c_e - sum_f c_f p_f); sigmoid p = s / S, s = sigmoid(l):
// ds_e = (c_e - sum_f c_f p_f) / S, dl_e = ds_e s_e (1 - s_e).
template <class T>
void weighted_prob_row_backward(const T* s, int64_t e_n, ScoreFunc score_func, const int64_t* counts, double c0, T* d) {
  auto c = [&](int64_t e) { return static_cast<T>(c0 * static_cast<double>(counts[e])); };
  if (score_func == ScoreFunc::softmax) {
    T dot = 0;
    for (int64_t e = 0; e < e_n; ++e) dot += c(e) * s[e];
    for (int64_t e = 0; e < e_n; ++e) d[e] = s[e] * (c(e) - dot);
  } else {
    T sum = 0, dot = 0;
    for (int64_t e = 0; e < e_n; ++e) sum += s[e];
    for (int64_t e = 0; e < e_n; ++e) dot += c(e) * s[e] / sum;
    for (int64_t e = 0; e < e_n; ++e) d[e] = (c(e) - dot) / sum * s[e] * (T(1) - s[e]);
  }
}
}  // namespace

double aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E,
                        int64_t k, int64_t total_tokens, const Tensor& loss_1) {
  check_aux(scores_TE, counts_E, k);
  check_loss_out(loss_1, "aux_loss_forward");
  MF_ON_GPU(ctx, scores_TE, cuda::aux_loss_forward(ctx, scores_TE, score_func, counts_E, k, total_tokens, loss_1));
  check_on_cpu(scores_TE, "aux_loss scores");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1);
  if (t_n == 0) return deliver(0.0, loss_1);
  const int64_t t_all = total_tokens > 0 ? total_tokens : t_n;
  const int64_t* counts = counts_E.ptr<int64_t>();
  return deliver(dispatch_float(scores_TE.dtype(),
                                [&]<class T>() {
                                  const T* scores = scores_TE.ptr<T>();
                                  double total = 0;
                                  for (int64_t t = 0; t < t_n; ++t)
                                    total += weighted_prob_row(scores + t * e_n, e_n, score_func, counts);
                                  return total * static_cast<double>(e_n) /
                                         (static_cast<double>(t_all) * static_cast<double>(t_all) * k);
                                }),
                 loss_1);
}

void aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E,
                       int64_t k, double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens) {
  check_aux(scores_TE, counts_E, k);
  check_shape(dlogits_TE, scores_TE.shape(), "aux_loss_backward dlogits");
  check_same_dtype(scores_TE, dlogits_TE, "aux_loss_backward dlogits");
  MF_ON_GPU(ctx, scores_TE,
            cuda::aux_loss_backward(ctx, scores_TE, score_func, counts_E, k, grad_scale, dlogits_TE, total_tokens));
  check_on_cpu(scores_TE, "aux_loss scores");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1);
  if (t_n == 0) return;
  const int64_t* counts = counts_E.ptr<int64_t>();
  // d(aux)/d(p_te) = c_e = grad_scale * E / (T*T*K) * counts_e, the same for every token.
  const double t_all = static_cast<double>(total_tokens > 0 ? total_tokens : t_n);
  const double c0 = grad_scale * static_cast<double>(e_n) / (t_all * t_all * static_cast<double>(k));
  dispatch_float(scores_TE.dtype(), [&]<class T>() {
    const T* scores = scores_TE.ptr<T>();
    T* dl = dlogits_TE.ptr<T>();
    for (int64_t t = 0; t < t_n; ++t)
      weighted_prob_row_backward(scores + t * e_n, e_n, score_func, counts, c0, dl + t * e_n);
  });
}

namespace {
// Checks a sequence layout against T local rows and B sequences.
void check_seq_layout(const SeqLayout& layout, int64_t t_n, int64_t b_n, const char* what) {
  MF_CHECK(layout.local_seq_len >= 1 && layout.seq_len >= layout.local_seq_len && layout.row_offset >= 0 &&
               (t_n == 0 || (layout.row_offset + t_n - 1) / layout.local_seq_len < b_n),
           what, ": ", t_n, " rows from row ", layout.row_offset, " in ", b_n, " sequences of ", layout.local_seq_len,
           " local tokens (", layout.seq_len, " in all)");
}
void check_seq_aux(const Tensor& scores_TE, const Tensor& counts_BE, int64_t k, const SeqLayout& layout) {
  check_2d(scores_TE, "seq_aux_loss scores");
  check_2d(counts_BE, "seq_aux_loss counts");
  check_dtype(counts_BE, DType::i64, "seq_aux_loss counts");
  MF_CHECK(counts_BE.size(1) == scores_TE.size(1) && k >= 1, "seq_aux_loss: scores ", scores_TE.str(), ", counts ",
           counts_BE.str(), ", k ", k);
  check_seq_layout(layout, scores_TE.size(0), counts_BE.size(0), "seq_aux_loss");
}
}  // namespace

void seq_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const SeqLayout& layout,
                       const Tensor& counts_BE) {
  check_2d(topk_idx_TK, "seq_expert_counts topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "seq_expert_counts topk_idx");
  check_2d(counts_BE, "seq_expert_counts counts");
  check_dtype(counts_BE, DType::i64, "seq_expert_counts counts");
  const int64_t t_n = topk_idx_TK.size(0), k_n = topk_idx_TK.size(1), e_n = counts_BE.size(1);
  check_seq_layout(layout, t_n, counts_BE.size(0), "seq_expert_counts");
  MF_ON_GPU(ctx, topk_idx_TK, cuda::seq_expert_counts(ctx, topk_idx_TK, layout, counts_BE));
  check_on_cpu(topk_idx_TK, "seq_expert_counts topk_idx");
  check_on_cpu(counts_BE, "seq_expert_counts counts");
  const int32_t* idx = topk_idx_TK.ptr<int32_t>();
  int64_t* counts = counts_BE.ptr<int64_t>();
  counts_BE.zero();
  for (int64_t t = 0; t < t_n; ++t) {
    int64_t* cb = counts + (layout.row_offset + t) / layout.local_seq_len * e_n;
    for (int64_t k = 0; k < k_n; ++k) {
      const int32_t e = idx[t * k_n + k];
      MF_CHECK(e >= 0 && e < e_n, "expert index ", e, " out of [0, ", e_n, ")");
      ++cb[e];
    }
  }
}

double seq_aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func,
                            const Tensor& counts_BE, int64_t k, const SeqLayout& layout, const Tensor& loss_1) {
  check_seq_aux(scores_TE, counts_BE, k, layout);
  check_loss_out(loss_1, "seq_aux_loss_forward");
  MF_ON_GPU(ctx, scores_TE, cuda::seq_aux_loss_forward(ctx, scores_TE, score_func, counts_BE, k, layout, loss_1));
  check_on_cpu(scores_TE, "seq_aux_loss scores");
  check_on_cpu(counts_BE, "seq_aux_loss counts");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), b_n = counts_BE.size(0);
  if (t_n == 0) return deliver(0.0, loss_1);
  const int64_t* counts = counts_BE.ptr<int64_t>();
  return deliver(dispatch_float(scores_TE.dtype(),
                                [&]<class T>() {
                                  const T* scores = scores_TE.ptr<T>();
                                  double total = 0;
                                  for (int64_t t = 0; t < t_n; ++t) {
                                    const int64_t* cb = counts + (layout.row_offset + t) / layout.local_seq_len * e_n;
                                    total += weighted_prob_row(scores + t * e_n, e_n, score_func, cb);
                                  }
                                  const double s_n = static_cast<double>(layout.seq_len);
                                  return total * static_cast<double>(e_n) /
                                         (static_cast<double>(k) * s_n * s_n * static_cast<double>(b_n));
                                }),
                 loss_1);
}

void seq_aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func,
                           const Tensor& counts_BE, int64_t k, const SeqLayout& layout, double grad_scale,
                           const Tensor& dlogits_TE) {
  check_seq_aux(scores_TE, counts_BE, k, layout);
  check_shape(dlogits_TE, scores_TE.shape(), "seq_aux_loss_backward dlogits");
  check_same_dtype(scores_TE, dlogits_TE, "seq_aux_loss_backward dlogits");
  MF_ON_GPU(ctx, scores_TE,
            cuda::seq_aux_loss_backward(ctx, scores_TE, score_func, counts_BE, k, layout, grad_scale, dlogits_TE));
  check_on_cpu(scores_TE, "seq_aux_loss scores");
  check_on_cpu(counts_BE, "seq_aux_loss counts");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), b_n = counts_BE.size(0);
  if (t_n == 0) return;
  const int64_t* counts = counts_BE.ptr<int64_t>();
  // d(loss)/d(p_te) = grad_scale * E / (K*S*S*B) * counts_BE[b(t), e].
  const double s_n = static_cast<double>(layout.seq_len);
  const double c0 =
      grad_scale * static_cast<double>(e_n) / (static_cast<double>(k) * s_n * s_n * static_cast<double>(b_n));
  dispatch_float(scores_TE.dtype(), [&]<class T>() {
    const T* scores = scores_TE.ptr<T>();
    T* dl = dlogits_TE.ptr<T>();
    for (int64_t t = 0; t < t_n; ++t) {
      const int64_t* cb = counts + (layout.row_offset + t) / layout.local_seq_len * e_n;
      weighted_prob_row_backward(scores + t * e_n, e_n, score_func, cb, c0, dl + t * e_n);
    }
  });
}

// ---- aux-loss-free balancing -------------------------------------------------------------------

void expert_bias_update(const ExecContext& ctx, const Tensor& bias_E, const Tensor& counts_E, double rate) {
  check_dtype(counts_E, DType::i64, "expert_bias_update counts");
  MF_CHECK(bias_E.ndim() == 1 && bias_E.contiguous() && counts_E.ndim() == 1 && counts_E.contiguous() &&
               counts_E.size(0) == bias_E.size(0),
           "expert_bias_update: bias ", bias_E.str(), ", counts ", counts_E.str());
  MF_ON_GPU(ctx, bias_E, cuda::expert_bias_update(ctx, bias_E, counts_E, rate));
  check_on_cpu(bias_E, "expert_bias_update bias");
  const int64_t e_n = bias_E.size(0);
  const int64_t* counts = counts_E.ptr<int64_t>();
  int64_t total = 0;
  for (int64_t e = 0; e < e_n; ++e) total += counts[e];
  dispatch_float(bias_E.dtype(), [&]<class T>() {
    T* bias = bias_E.ptr<T>();
    for (int64_t e = 0; e < e_n; ++e) {
      // sign(mean - counts_e) = sign(total - E * counts_e), exact in integers (no 0 lost to rounding).
      const int64_t diff = total - e_n * counts[e];
      const int sign = (diff > 0) - (diff < 0);
      bias[e] += static_cast<T>(rate * sign);
    }
  });
}

// ---- a forward's statistics into a step's sums ---------------------------------------------------

void moe_step_stats(const ExecContext& ctx, const Tensor& losses_3, double aux_coeff, double seq_aux_coeff,
                    double z_coeff, const Tensor& counts_E, int64_t capacity, const Tensor& sums_2,
                    const Tensor& load_E, const Tensor& dropped_1) {
  const char* what = "moe_step_stats";
  check_dtype(losses_3, DType::f64, what);
  check_dtype(counts_E, DType::i64, what);
  check_dtype(sums_2, DType::f64, what);
  check_dtype(load_E, DType::f64, what);
  check_dtype(dropped_1, DType::f64, what);
  MF_CHECK(losses_3.numel() == 3 && sums_2.numel() == 2 && dropped_1.numel() == 1 && counts_E.ndim() == 1 &&
               load_E.numel() == counts_E.numel() && losses_3.contiguous() && counts_E.contiguous() &&
               sums_2.contiguous() && load_E.contiguous(),
           what, ": losses ", losses_3.str(), ", counts ", counts_E.str(), ", sums ", sums_2.str(), ", load ",
           load_E.str(), ", dropped ", dropped_1.str());
  MF_ON_GPU(ctx, counts_E,
            cuda::moe_step_stats(ctx, losses_3, aux_coeff, seq_aux_coeff, z_coeff, counts_E, capacity, sums_2, load_E,
                                 dropped_1));
  for (const Tensor* t : {&losses_3, &counts_E, &sums_2, &load_E, &dropped_1}) check_on_cpu(*t, what);
  const double* l = losses_3.ptr<double>();
  double* sums = sums_2.ptr<double>();
  double aux = 0, z = 0;
  if (aux_coeff != 0) aux = aux_coeff * l[0];
  if (seq_aux_coeff != 0) aux = aux + seq_aux_coeff * l[1];
  if (z_coeff != 0) z = z_coeff * l[2];
  sums[0] += aux;
  sums[1] += z;
  const int64_t e_n = counts_E.size(0);
  const int64_t* counts = counts_E.ptr<int64_t>();
  double* load = load_E.ptr<double>();
  for (int64_t e = 0; e < e_n; ++e) load[e] += static_cast<double>(counts[e]);
  if (capacity <= 0) return;
  int64_t dropped = 0;
  for (int64_t e = 0; e < e_n; ++e) dropped += std::max<int64_t>(counts[e] - capacity, 0);
  dropped_1.ptr<double>()[0] += static_cast<double>(dropped);
}

// ---- router z-loss -----------------------------------------------------------------------------

double z_loss_forward(const ExecContext& ctx, const Tensor& logits_TE, int64_t total_tokens, const Tensor& loss_1) {
  check_2d(logits_TE, "z_loss logits");
  check_loss_out(loss_1, "z_loss_forward");
  MF_ON_GPU(ctx, logits_TE, cuda::z_loss_forward(ctx, logits_TE, total_tokens, loss_1));
  check_on_cpu(logits_TE, "z_loss logits");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1);
  if (t_n == 0) return deliver(0.0, loss_1);
  return deliver(dispatch_float(logits_TE.dtype(),
                                [&]<class T>() {
                                  const T* logits = logits_TE.ptr<T>();
                                  double total = 0;
                                  for (int64_t t = 0; t < t_n; ++t) {
                                    double lse = static_cast<double>(softmax_row<T>(logits + t * e_n, e_n, nullptr));
                                    total += lse * lse;
                                  }
                                  return total / static_cast<double>(total_tokens > 0 ? total_tokens : t_n);
                                }),
                 loss_1);
}

void z_loss_backward(const ExecContext& ctx, const Tensor& logits_TE, double grad_scale, const Tensor& dlogits_TE,
                     int64_t total_tokens) {
  check_2d(logits_TE, "z_loss logits");
  check_shape(dlogits_TE, logits_TE.shape(), "z_loss_backward dlogits");
  check_same_dtype(logits_TE, dlogits_TE, "z_loss_backward dlogits");
  MF_ON_GPU(ctx, logits_TE, cuda::z_loss_backward(ctx, logits_TE, grad_scale, dlogits_TE, total_tokens));
  check_on_cpu(logits_TE, "z_loss logits");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1);
  if (t_n == 0) return;
  dispatch_float(logits_TE.dtype(), [&]<class T>() {
    const T* logits = logits_TE.ptr<T>();
    T* dl = dlogits_TE.ptr<T>();
    for (int64_t t = 0; t < t_n; ++t) {
      T* d = dl + t * e_n;
      T lse = softmax_row<T>(logits + t * e_n, e_n, d);  // d = softmax
      T c = static_cast<T>(grad_scale * 2.0 / static_cast<double>(total_tokens > 0 ? total_tokens : t_n)) * lse;
      for (int64_t e = 0; e < e_n; ++e) d[e] *= c;
    }
  });
}

}  // namespace moefold
