// CPU reference of the MoE ops (moe_ops.h): plain loops, accumulation in the tensor's dtype except
// the scalar losses (double). Gradient rule: activation grads written, parameter grads accumulated.
#include "moefold/ops/moe_ops.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "moefold/ops/dispatch.h"
#include "moefold/ops/gemm.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/gemm_ops.h"
#include "moefold/ops/cuda/moe_ops_cuda.h"
#endif

namespace moefold {

namespace {

void check_2d(const Tensor& t, const char* what) {
  MF_CHECK(t.ndim() == 2 && t.contiguous() && t.device() == Device::cpu, what, ": ", t.str());
}

void check_dtype(const Tensor& t, DType want, const char* what) {
  MF_CHECK(t.dtype() == want, what, ": ", t.str(), ", expected ", dtype_name(want));
}

// Softmax of one row into out; returns log-sum-exp.
template <class T>
T softmax_row(const T* x, int64_t n, T* out) {
  T m = x[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, x[i]);
  T s = 0;
  for (int64_t i = 0; i < n; ++i) s += std::exp(x[i] - m);
  if (out)
    for (int64_t i = 0; i < n; ++i) out[i] = std::exp(x[i] - m) / s;
  return m + std::log(s);
}

void check_router(const Tensor& scores_TE, const Tensor& topk_idx_TK) {
  check_2d(scores_TE, "router scores");
  check_2d(topk_idx_TK, "router topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "router topk_idx");
  MF_CHECK(
      topk_idx_TK.size(0) == scores_TE.size(0) && topk_idx_TK.size(1) >= 1 && topk_idx_TK.size(1) <= scores_TE.size(1),
      "router: scores ", scores_TE.str(), ", topk_idx ", topk_idx_TK.str());
}

}  // namespace

// ---- router scores and top-k -------------------------------------------------------------------

namespace {

// One token's expert choice under group-limited, bias-steered routing (see router_topk_forward).
// Keeps no per-group storage, so the op allocates nothing: group scores are recomputed where
// needed (O((topk_group + K) * E) per token, fine for a reference).
template <class T>
class TokenChoice {
 public:
  TokenChoice(const T* s, const T* bias, const float* bias32, int64_t e_n, int64_t n_group, int64_t topk_group)
      : s_(s), bias_(bias), bias32_(bias32), g_size_(e_n / n_group), n_group_(n_group) {
    if (topk_group < n_group) find_last_kept(topk_group);
  }

  T choice(int64_t e) const {
    if (bias_) return s_[e] + bias_[e];
    if (bias32_) return s_[e] + static_cast<T>(bias32_[e]);
    return s_[e];
  }

  // Sum of the top-min(2, group size) choices of group g.
  T group_score(int64_t g) const {
    T first = -std::numeric_limits<T>::infinity(), second = first;
    for (int64_t e = g * g_size_; e < (g + 1) * g_size_; ++e) {
      const T c = choice(e);
      if (c > first) {
        second = first;
        first = c;
      } else if (c > second) {
        second = c;
      }
    }
    return g_size_ >= 2 ? first + second : first;
  }

  // Whether group g is among the topk_group best (score descending, ties to the lower index).
  bool kept(int64_t g) const { return last_ < 0 || g == last_ || before(group_score(g), g, last_score_, last_); }

  // The best eligible expert not in taken[0, n_taken) (ties to the lower index).
  int64_t best(const int32_t* taken, int64_t n_taken) const {
    int64_t best = -1;
    T best_c = 0;
    for (int64_t g = 0; g < n_group_; ++g) {
      if (!kept(g)) continue;
      for (int64_t e = g * g_size_; e < (g + 1) * g_size_; ++e) {
        bool is_taken = false;
        for (int64_t j = 0; j < n_taken; ++j) is_taken = is_taken || taken[j] == e;
        if (is_taken) continue;
        const T c = choice(e);
        if (best < 0 || c > best_c) {
          best = e;
          best_c = c;
        }
      }
    }
    return best;
  }

 private:
  static bool before(T a, int64_t ga, T b, int64_t gb) { return a > b || (a == b && ga < gb); }

  // The topk_group-th group in (score descending, index ascending) order: each pass takes the
  // best group strictly after the previous one in that order.
  void find_last_kept(int64_t topk_group) {
    for (int64_t j = 0; j < topk_group; ++j) {
      int64_t best = -1;
      T best_score = 0;
      for (int64_t g = 0; g < n_group_; ++g) {
        const T sg = group_score(g);
        if (last_ >= 0 && !before(last_score_, last_, sg, g)) continue;
        if (best < 0 || before(sg, g, best_score, best)) {
          best = g;
          best_score = sg;
        }
      }
      last_ = best;
      last_score_ = best_score;
    }
  }

  const T* s_;
  const T* bias_;
  const float* bias32_;
  int64_t g_size_, n_group_;
  int64_t last_ = -1;  // the worst kept group; -1: every group is kept
  T last_score_ = 0;
};

}  // namespace

void router_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const TopkRouting& routing,
                         const Tensor& scores_TE, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) {
  MF_ON_GPU(ctx, logits_TE, cuda::router_topk_forward(ctx, logits_TE, routing, scores_TE, topk_idx_TK, topk_prob_TK));
  check_router(logits_TE, topk_idx_TK);
  check_shape(scores_TE, logits_TE.shape(), "router_topk_forward scores");
  check_shape(topk_prob_TK, topk_idx_TK.shape(), "router_topk_forward topk_prob");
  check_same_dtype(logits_TE, scores_TE, "router_topk_forward scores");
  check_same_dtype(logits_TE, topk_prob_TK, "router_topk_forward topk_prob");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1), k_n = topk_idx_TK.size(1);
  const int64_t n_group = routing.n_group, topk_group = routing.topk_group;
  MF_CHECK(n_group >= 1 && e_n % n_group == 0 && topk_group >= 1 && topk_group <= n_group &&
               k_n <= topk_group * (e_n / n_group),
           "router_topk_forward: E ", e_n, ", n_group ", n_group, ", topk_group ", topk_group, ", K ", k_n);
  const Tensor& bias = routing.bias_E;
  if (bias.defined()) {
    MF_CHECK(bias.ndim() == 1 && bias.size(0) == e_n && bias.contiguous() && bias.device() == Device::cpu &&
                 (bias.dtype() == logits_TE.dtype() || bias.dtype() == DType::f32),
             "router_topk_forward bias: ", bias.str(), " for logits ", logits_TE.str());
  }
  dispatch_float(logits_TE.dtype(), [&]<class T>() {
    const T* logits = logits_TE.ptr<T>();
    T* scores = scores_TE.ptr<T>();
    int32_t* idx = topk_idx_TK.ptr<int32_t>();
    T* prob = topk_prob_TK.ptr<T>();
    const T* bias_t = bias.defined() && bias.dtype() == dtype_of<T>() ? bias.ptr<T>() : nullptr;
    const float* bias32 = bias.defined() && !bias_t ? bias.ptr<float>() : nullptr;
    for (int64_t t = 0; t < t_n; ++t) {
      const T* l = logits + t * e_n;
      T* s = scores + t * e_n;
      if (routing.score_func == ScoreFunc::softmax) {
        softmax_row(l, e_n, s);
      } else {
        for (int64_t e = 0; e < e_n; ++e) s[e] = T(1) / (T(1) + std::exp(-l[e]));
      }
      // Selection by repeated arg-max over the eligible experts not yet taken: strict '>' keeps
      // the lower expert index on ties. K is small (<= 8 in every preset), so O(E*K) is fine.
      const TokenChoice<T> choice(s, bias_t, bias32, e_n, n_group, topk_group);
      int32_t* ik = idx + t * k_n;
      T* pk = prob + t * k_n;
      T sum = 0;
      for (int64_t k = 0; k < k_n; ++k) {
        const int64_t best = choice.best(ik, k);
        ik[k] = static_cast<int32_t>(best);
        pk[k] = s[best];
        sum += s[best];
      }
      for (int64_t k = 0; k < k_n; ++k) {
        T p = routing.norm_topk_prob ? pk[k] / sum : pk[k];
        pk[k] = p * static_cast<T>(routing.scaling);
      }
    }
  });
}

void router_topk_backward(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& topk_idx_TK,
                          const TopkRouting& routing, const Tensor& dprob_TK, const Tensor& dlogits_TE) {
  MF_ON_GPU(ctx, scores_TE, cuda::router_topk_backward(ctx, scores_TE, topk_idx_TK, routing, dprob_TK, dlogits_TE));
  check_router(scores_TE, topk_idx_TK);
  check_shape(dprob_TK, topk_idx_TK.shape(), "router_topk_backward dprob");
  check_shape(dlogits_TE, scores_TE.shape(), "router_topk_backward dlogits");
  check_same_dtype(scores_TE, dprob_TK, "router_topk_backward dprob");
  check_same_dtype(scores_TE, dlogits_TE, "router_topk_backward dlogits");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), k_n = topk_idx_TK.size(1);
  dispatch_float(scores_TE.dtype(), [&]<class T>() {
    const T* scores = scores_TE.ptr<T>();
    const int32_t* idx = topk_idx_TK.ptr<int32_t>();
    const T* dprob = dprob_TK.ptr<T>();
    T* dl = dlogits_TE.ptr<T>();
    const T scaling = static_cast<T>(routing.scaling);
    for (int64_t t = 0; t < t_n; ++t) {
      const T* s = scores + t * e_n;
      const int32_t* ik = idx + t * k_n;
      const T* dp = dprob + t * k_n;
      T* d = dl + t * e_n;
      // ds: gradient w.r.t. the scores, non-zero only at the selected experts.
      for (int64_t e = 0; e < e_n; ++e) d[e] = 0;
      if (routing.norm_topk_prob) {
        // p_k = c * s_k / S with S = sum_j s_j: dS_j = c * (dp_j - sum_k dp_k s_k / S) / S.
        T sum = 0, dot = 0;
        for (int64_t k = 0; k < k_n; ++k) sum += s[ik[k]];
        for (int64_t k = 0; k < k_n; ++k) dot += dp[k] * s[ik[k]];
        for (int64_t k = 0; k < k_n; ++k) d[ik[k]] = scaling * (dp[k] - dot / sum) / sum;
      } else {
        for (int64_t k = 0; k < k_n; ++k) d[ik[k]] = scaling * dp[k];
      }
      if (routing.score_func == ScoreFunc::softmax) {
        T dot = 0;
        for (int64_t e = 0; e < e_n; ++e) dot += d[e] * s[e];
        for (int64_t e = 0; e < e_n; ++e) d[e] = s[e] * (d[e] - dot);
      } else {
        for (int64_t e = 0; e < e_n; ++e) d[e] = d[e] * s[e] * (T(1) - s[e]);
      }
    }
  });
}

void topk_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& counts_E) {
  MF_ON_GPU(ctx, topk_idx_TK, cuda::topk_expert_counts(ctx, topk_idx_TK, counts_E));
  check_2d(topk_idx_TK, "topk_expert_counts topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "topk_expert_counts topk_idx");
  check_dtype(counts_E, DType::i64, "topk_expert_counts counts");
  MF_CHECK(counts_E.ndim() == 1 && counts_E.contiguous(), "topk_expert_counts counts: ", counts_E.str());
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
                        int64_t k, int64_t total_tokens) {
  MF_ON_GPU(ctx, scores_TE, cuda::aux_loss_forward(ctx, scores_TE, score_func, counts_E, k, total_tokens));
  check_aux(scores_TE, counts_E, k);
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1);
  if (t_n == 0) return 0.0;
  const int64_t t_all = total_tokens > 0 ? total_tokens : t_n;
  const int64_t* counts = counts_E.ptr<int64_t>();
  return dispatch_float(scores_TE.dtype(), [&]<class T>() {
    const T* scores = scores_TE.ptr<T>();
    double total = 0;
    for (int64_t t = 0; t < t_n; ++t) total += weighted_prob_row(scores + t * e_n, e_n, score_func, counts);
    return total * static_cast<double>(e_n) / (static_cast<double>(t_all) * static_cast<double>(t_all) * k);
  });
}

void aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E,
                       int64_t k, double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens) {
  MF_ON_GPU(ctx, scores_TE,
            cuda::aux_loss_backward(ctx, scores_TE, score_func, counts_E, k, grad_scale, dlogits_TE, total_tokens));
  check_aux(scores_TE, counts_E, k);
  check_shape(dlogits_TE, scores_TE.shape(), "aux_loss_backward dlogits");
  check_same_dtype(scores_TE, dlogits_TE, "aux_loss_backward dlogits");
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
  MF_ON_GPU(ctx, topk_idx_TK, cuda::seq_expert_counts(ctx, topk_idx_TK, layout, counts_BE));
  check_2d(topk_idx_TK, "seq_expert_counts topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "seq_expert_counts topk_idx");
  check_2d(counts_BE, "seq_expert_counts counts");
  check_dtype(counts_BE, DType::i64, "seq_expert_counts counts");
  const int64_t t_n = topk_idx_TK.size(0), k_n = topk_idx_TK.size(1), e_n = counts_BE.size(1);
  check_seq_layout(layout, t_n, counts_BE.size(0), "seq_expert_counts");
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
                            const Tensor& counts_BE, int64_t k, const SeqLayout& layout) {
  MF_ON_GPU(ctx, scores_TE, cuda::seq_aux_loss_forward(ctx, scores_TE, score_func, counts_BE, k, layout));
  check_seq_aux(scores_TE, counts_BE, k, layout);
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), b_n = counts_BE.size(0);
  if (t_n == 0) return 0.0;
  const int64_t* counts = counts_BE.ptr<int64_t>();
  return dispatch_float(scores_TE.dtype(), [&]<class T>() {
    const T* scores = scores_TE.ptr<T>();
    double total = 0;
    for (int64_t t = 0; t < t_n; ++t) {
      const int64_t* cb = counts + (layout.row_offset + t) / layout.local_seq_len * e_n;
      total += weighted_prob_row(scores + t * e_n, e_n, score_func, cb);
    }
    const double s_n = static_cast<double>(layout.seq_len);
    return total * static_cast<double>(e_n) / (static_cast<double>(k) * s_n * s_n * static_cast<double>(b_n));
  });
}

void seq_aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func,
                           const Tensor& counts_BE, int64_t k, const SeqLayout& layout, double grad_scale,
                           const Tensor& dlogits_TE) {
  MF_ON_GPU(ctx, scores_TE,
            cuda::seq_aux_loss_backward(ctx, scores_TE, score_func, counts_BE, k, layout, grad_scale, dlogits_TE));
  check_seq_aux(scores_TE, counts_BE, k, layout);
  check_shape(dlogits_TE, scores_TE.shape(), "seq_aux_loss_backward dlogits");
  check_same_dtype(scores_TE, dlogits_TE, "seq_aux_loss_backward dlogits");
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
  MF_ON_GPU(ctx, bias_E, cuda::expert_bias_update(ctx, bias_E, counts_E, rate));
  check_dtype(counts_E, DType::i64, "expert_bias_update counts");
  MF_CHECK(bias_E.ndim() == 1 && bias_E.contiguous() && bias_E.device() == Device::cpu && counts_E.ndim() == 1 &&
               counts_E.contiguous() && counts_E.size(0) == bias_E.size(0),
           "expert_bias_update: bias ", bias_E.str(), ", counts ", counts_E.str());
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

// ---- router z-loss -----------------------------------------------------------------------------

double z_loss_forward(const ExecContext& ctx, const Tensor& logits_TE, int64_t total_tokens) {
  MF_ON_GPU(ctx, logits_TE, cuda::z_loss_forward(ctx, logits_TE, total_tokens));
  check_2d(logits_TE, "z_loss logits");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1);
  if (t_n == 0) return 0.0;
  return dispatch_float(logits_TE.dtype(), [&]<class T>() {
    const T* logits = logits_TE.ptr<T>();
    double total = 0;
    for (int64_t t = 0; t < t_n; ++t) {
      double lse = static_cast<double>(softmax_row<T>(logits + t * e_n, e_n, nullptr));
      total += lse * lse;
    }
    return total / static_cast<double>(total_tokens > 0 ? total_tokens : t_n);
  });
}

void z_loss_backward(const ExecContext& ctx, const Tensor& logits_TE, double grad_scale, const Tensor& dlogits_TE,
                     int64_t total_tokens) {
  MF_ON_GPU(ctx, logits_TE, cuda::z_loss_backward(ctx, logits_TE, grad_scale, dlogits_TE, total_tokens));
  check_2d(logits_TE, "z_loss logits");
  check_shape(dlogits_TE, logits_TE.shape(), "z_loss_backward dlogits");
  check_same_dtype(logits_TE, dlogits_TE, "z_loss_backward dlogits");
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

// ---- permutation plan --------------------------------------------------------------------------

int64_t moe_permute_plan(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK,
                         int64_t capacity, bool pad, const PermutePlanOut& out) {
  MF_ON_GPU(ctx, topk_idx_TK, cuda::moe_permute_plan(ctx, topk_idx_TK, topk_prob_TK, capacity, pad, out));
  check_2d(topk_idx_TK, "moe_permute_plan topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "moe_permute_plan topk_idx");
  check_shape(topk_prob_TK, topk_idx_TK.shape(), "moe_permute_plan topk_prob");
  check_shape(out.row_TK, topk_idx_TK.shape(), "moe_permute_plan row");
  for (const Tensor* t : {&out.counts_E, &out.offsets_E1, &out.row_TK, &out.token_R}) {
    check_dtype(*t, DType::i64, "moe_permute_plan output");
    MF_CHECK(t->contiguous());
  }
  const int64_t e_n = out.counts_E.numel(), t_n = topk_idx_TK.size(0), k_n = topk_idx_TK.size(1);
  const int64_t a_n = t_n * k_n;  // assignments a = t*K + k
  MF_CHECK(out.offsets_E1.numel() == e_n + 1, "offsets ", out.offsets_E1.str(), " for ", e_n, " experts");
  MF_CHECK(!pad || capacity > 0, "padding needs a capacity");
  const int32_t* idx = topk_idx_TK.ptr<int32_t>();
  int64_t* counts = out.counts_E.ptr<int64_t>();
  int64_t* offsets = out.offsets_E1.ptr<int64_t>();
  int64_t* grouped = out.row_TK.ptr<int64_t>();  // scratch first: assignments grouped by expert
  int64_t* token = out.token_R.ptr<int64_t>();
  const int64_t max_rows = out.token_R.numel();

  // 1. Assignments per expert, their start in `grouped`, then a stable bucket pass (token order).
  topk_expert_counts(ctx, topk_idx_TK, out.counts_E);
  for (int64_t t = 0; t < t_n; ++t)
    for (int64_t k = 0; k < k_n; ++k)
      for (int64_t j = 0; j < k; ++j)
        MF_CHECK(idx[t * k_n + j] != idx[t * k_n + k], "token ", t, " routed twice to expert ", idx[t * k_n + k]);
  offsets[0] = 0;
  for (int64_t e = 0; e < e_n; ++e) offsets[e + 1] = offsets[e] + counts[e];
  for (int64_t e = 0; e < e_n; ++e) counts[e] = offsets[e];  // cursors
  for (int64_t a = 0; a < a_n; ++a) grouped[counts[idx[a]]++] = a;

  // 2. Per expert: keep the highest probabilities (ties: lower token, i.e. lower a), back in
  //    token order; then lay the kept ones (and padding) out as rows. offsets[] is rewritten
  //    from group starts to row starts as we go; offsets[e+1] is read before it is rewritten.
  dispatch_float(topk_prob_TK.dtype(), [&]<class T>() {
    const T* prob = topk_prob_TK.ptr<T>();
    int64_t r = 0;
    int64_t begin = offsets[0];
    for (int64_t e = 0; e < e_n; ++e) {
      const int64_t end = offsets[e + 1];
      int64_t* seg = grouped + begin;
      const int64_t n = end - begin;
      int64_t kept = n;
      if (capacity > 0 && n > capacity) {
        std::sort(seg, seg + n,
                  [&](int64_t x, int64_t y) { return prob[x] > prob[y] || (prob[x] == prob[y] && x < y); });
        kept = capacity;
        std::sort(seg, seg + kept);
      }
      const int64_t rows = pad ? capacity : kept;
      MF_CHECK(r + rows <= max_rows, "permute plan needs more than ", max_rows, " rows");
      offsets[e] = r;
      counts[e] = rows;
      for (int64_t i = 0; i < kept; ++i) token[r + i] = seg[i];
      for (int64_t i = kept; i < rows; ++i) token[r + i] = -1;
      r += rows;
      begin = end;
    }
    offsets[e_n] = r;
  });

  // 3. Row of each assignment; token_R turns from assignment ids into token ids.
  const int64_t num_rows = offsets[e_n];
  for (int64_t a = 0; a < a_n; ++a) grouped[a] = -1;
  for (int64_t r = 0; r < num_rows; ++r) {
    if (token[r] < 0) continue;
    grouped[token[r]] = r;
    token[r] /= k_n;
  }
  return num_rows;
}

namespace {
void check_rows(const Tensor& rows_RH, const Tensor& x_TH, const char* what) {
  check_2d(rows_RH, what);
  check_2d(x_TH, what);
  check_same_dtype(rows_RH, x_TH, what);
  MF_CHECK(rows_RH.size(1) == x_TH.size(1), what, ": rows ", rows_RH.str(), ", tokens ", x_TH.str());
}
void check_row_map(const Tensor& row_TK, int64_t t_n, const char* what) {
  check_2d(row_TK, what);
  check_dtype(row_TK, DType::i64, what);
  MF_CHECK(row_TK.size(0) == t_n, what, ": ", row_TK.str(), " for ", t_n, " tokens");
}
}  // namespace

void moe_permute(const ExecContext& ctx, const Tensor& x_TH, const Tensor& token_R, const Tensor& rows_RH) {
  MF_ON_GPU(ctx, x_TH, cuda::moe_permute(ctx, x_TH, token_R, rows_RH));
  check_rows(rows_RH, x_TH, "moe_permute");
  check_dtype(token_R, DType::i64, "moe_permute token");
  const int64_t r_n = rows_RH.size(0), h_n = rows_RH.size(1), t_n = x_TH.size(0);
  MF_CHECK(token_R.contiguous() && token_R.numel() >= r_n, "moe_permute: token ", token_R.str(), " for ", r_n, " rows");
  const int64_t* token = token_R.ptr<int64_t>();
  dispatch_float(x_TH.dtype(), [&]<class T>() {
    const T* x = x_TH.ptr<T>();
    T* rows = rows_RH.ptr<T>();
    for (int64_t r = 0; r < r_n; ++r) {
      const int64_t t = token[r];
      MF_CHECK(t >= -1 && t < t_n, "row ", r, " reads token ", t, " of ", t_n);
      if (t < 0)
        std::fill(rows + r * h_n, rows + (r + 1) * h_n, T(0));
      else
        std::copy(x + t * h_n, x + (t + 1) * h_n, rows + r * h_n);
    }
  });
}

void moe_permute_backward(const ExecContext& ctx, const Tensor& drows_RH, const Tensor& row_TK, const Tensor& dx_TH) {
  MF_ON_GPU(ctx, drows_RH, cuda::moe_permute_backward(ctx, drows_RH, row_TK, dx_TH));
  check_rows(drows_RH, dx_TH, "moe_permute_backward");
  check_row_map(row_TK, dx_TH.size(0), "moe_permute_backward row");
  const int64_t t_n = dx_TH.size(0), h_n = dx_TH.size(1), k_n = row_TK.size(1), r_n = drows_RH.size(0);
  const int64_t* row = row_TK.ptr<int64_t>();
  dispatch_float(dx_TH.dtype(), [&]<class T>() {
    const T* drows = drows_RH.ptr<T>();
    T* dx = dx_TH.ptr<T>();
    for (int64_t t = 0; t < t_n; ++t) {
      T* d = dx + t * h_n;
      std::fill(d, d + h_n, T(0));
      for (int64_t k = 0; k < k_n; ++k) {
        const int64_t r = row[t * k_n + k];
        if (r < 0) continue;
        MF_CHECK(r < r_n, "row ", r, " of ", r_n);
        for (int64_t h = 0; h < h_n; ++h) d[h] += drows[r * h_n + h];
      }
    }
  });
}

// ---- combine -----------------------------------------------------------------------------------

void moe_combine(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                 const Tensor& y_TH) {
  MF_ON_GPU(ctx, out_RH, cuda::moe_combine(ctx, out_RH, row_TK, prob_TK, y_TH));
  check_rows(out_RH, y_TH, "moe_combine");
  check_row_map(row_TK, y_TH.size(0), "moe_combine row");
  check_shape(prob_TK, row_TK.shape(), "moe_combine prob");
  check_same_dtype(prob_TK, y_TH, "moe_combine prob");
  const int64_t t_n = y_TH.size(0), h_n = y_TH.size(1), k_n = row_TK.size(1), r_n = out_RH.size(0);
  const int64_t* row = row_TK.ptr<int64_t>();
  dispatch_float(y_TH.dtype(), [&]<class T>() {
    const T* out = out_RH.ptr<T>();
    const T* prob = prob_TK.ptr<T>();
    T* y = y_TH.ptr<T>();
    for (int64_t t = 0; t < t_n; ++t) {
      T* yt = y + t * h_n;
      std::fill(yt, yt + h_n, T(0));
      for (int64_t k = 0; k < k_n; ++k) {
        const int64_t r = row[t * k_n + k];
        if (r < 0) continue;
        MF_CHECK(r < r_n, "row ", r, " of ", r_n);
        const T p = prob[t * k_n + k];
        for (int64_t h = 0; h < h_n; ++h) yt[h] += p * out[r * h_n + h];
      }
    }
  });
}

void moe_combine_backward(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                          const Tensor& dy_TH, const Tensor& dout_RH, const Tensor& dprob_TK) {
  MF_ON_GPU(ctx, out_RH, cuda::moe_combine_backward(ctx, out_RH, row_TK, prob_TK, dy_TH, dout_RH, dprob_TK));
  check_rows(out_RH, dy_TH, "moe_combine_backward");
  check_row_map(row_TK, dy_TH.size(0), "moe_combine_backward row");
  check_shape(prob_TK, row_TK.shape(), "moe_combine_backward prob");
  check_shape(dprob_TK, row_TK.shape(), "moe_combine_backward dprob");
  check_shape(dout_RH, out_RH.shape(), "moe_combine_backward dout");
  check_same_dtype(prob_TK, dy_TH, "moe_combine_backward prob");
  check_same_dtype(dprob_TK, dy_TH, "moe_combine_backward dprob");
  check_same_dtype(dout_RH, dy_TH, "moe_combine_backward dout");
  const int64_t t_n = dy_TH.size(0), h_n = dy_TH.size(1), k_n = row_TK.size(1), r_n = out_RH.size(0);
  const int64_t* row = row_TK.ptr<int64_t>();
  dispatch_float(dy_TH.dtype(), [&]<class T>() {
    const T* out = out_RH.ptr<T>();
    const T* prob = prob_TK.ptr<T>();
    const T* dy = dy_TH.ptr<T>();
    T* dout = dout_RH.ptr<T>();
    T* dprob = dprob_TK.ptr<T>();
    std::fill(dout, dout + r_n * h_n, T(0));  // padding rows get no gradient
    for (int64_t t = 0; t < t_n; ++t) {
      const T* dyt = dy + t * h_n;
      for (int64_t k = 0; k < k_n; ++k) {
        const int64_t r = row[t * k_n + k];
        T dp = 0;
        if (r >= 0) {
          MF_CHECK(r < r_n, "row ", r, " of ", r_n);
          const T p = prob[t * k_n + k];
          for (int64_t h = 0; h < h_n; ++h) {
            dp += dyt[h] * out[r * h_n + h];
            dout[r * h_n + h] = p * dyt[h];
          }
        }
        dprob[t * k_n + k] = dp;
      }
    }
  });
}

// ---- grouped linear ----------------------------------------------------------------------------

namespace {
void check_grouped(const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1, const Tensor& y_RO) {
  check_2d(x_RI, "grouped_linear x");
  check_2d(y_RO, "grouped_linear y");
  check_dtype(offsets_E1, DType::i64, "grouped_linear offsets");
  MF_CHECK(w_EOI.ndim() == 3 && w_EOI.contiguous() && offsets_E1.numel() == w_EOI.size(0) + 1 &&
               x_RI.size(1) == w_EOI.size(2) && y_RO.size(1) == w_EOI.size(1) && x_RI.size(0) == y_RO.size(0),
           "grouped_linear: x ", x_RI.str(), ", w ", w_EOI.str(), ", offsets ", offsets_E1.str(), ", y ", y_RO.str());
  check_same_dtype(x_RI, w_EOI, "grouped_linear w");
  check_same_dtype(x_RI, y_RO, "grouped_linear y");
  const int64_t* off = offsets_E1.ptr<int64_t>();
  MF_CHECK(off[0] == 0 && off[w_EOI.size(0)] == x_RI.size(0), "grouped_linear: offsets span [", off[0], ", ",
           off[w_EOI.size(0)], ") for ", x_RI.size(0), " rows");
  for (int64_t e = 0; e < w_EOI.size(0); ++e) MF_CHECK(off[e] <= off[e + 1], "grouped_linear: offsets decrease");
}
}  // namespace

void grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                            const Tensor& y_RO) {
  MF_ON_GPU(ctx, x_RI, cuda::grouped_linear_forward(ctx, x_RI, w_EOI, offsets_E1, y_RO));
  check_grouped(x_RI, w_EOI, offsets_E1, y_RO);
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  const int64_t* off = offsets_E1.ptr<int64_t>();
  dispatch_float(x_RI.dtype(), [&]<class T>() {
    const T* x = x_RI.ptr<T>();
    const T* w = w_EOI.ptr<T>();
    T* y = y_RO.ptr<T>();
    for (int64_t e = 0; e < e_n; ++e) {
      const int64_t m = off[e + 1] - off[e];
      if (m == 0) continue;
      gemm<T>(false, true, m, o_n, i_n, T(1), x + off[e] * i_n, i_n, w + e * o_n * i_n, i_n, T(0), y + off[e] * o_n,
              o_n);
    }
  });
}

void grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                             const Tensor& dy_RO, const Tensor& dx_RI, const Tensor& dw_EOI, bool accumulate) {
  MF_ON_GPU(ctx, x_RI, cuda::grouped_linear_backward(ctx, x_RI, w_EOI, offsets_E1, dy_RO, dx_RI, dw_EOI, accumulate));
  check_grouped(x_RI, w_EOI, offsets_E1, dy_RO);
  if (dw_EOI.defined()) {
    check_shape(dw_EOI, w_EOI.shape(), "grouped_linear_backward dw");
    check_same_dtype(dw_EOI, w_EOI, "grouped_linear_backward dw");
  }
  if (dx_RI.defined()) {
    check_shape(dx_RI, x_RI.shape(), "grouped_linear_backward dx");
    check_same_dtype(dx_RI, x_RI, "grouped_linear_backward dx");
  }
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  const int64_t* off = offsets_E1.ptr<int64_t>();
  dispatch_float(x_RI.dtype(), [&]<class T>() {
    const T* x = x_RI.ptr<T>();
    const T* w = w_EOI.ptr<T>();
    const T* dy = dy_RO.ptr<T>();
    T* dw = dw_EOI.defined() ? dw_EOI.ptr<T>() : nullptr;
    if (dw != nullptr && !accumulate) std::fill(dw, dw + dw_EOI.numel(), T(0));
    for (int64_t e = 0; e < e_n; ++e) {
      const int64_t m = off[e + 1] - off[e];
      if (m == 0) continue;
      // dx = dy @ w (m x O @ O x I); dw += dy^T @ x (O x m @ m x I).
      if (dx_RI.defined())
        gemm<T>(false, false, m, i_n, o_n, T(1), dy + off[e] * o_n, o_n, w + e * o_n * i_n, i_n, T(0),
                dx_RI.ptr<T>() + off[e] * i_n, i_n);
      if (dw != nullptr)
        gemm<T>(true, false, o_n, i_n, m, T(1), dy + off[e] * o_n, o_n, x + off[e] * i_n, i_n, T(1), dw + e * o_n * i_n,
                i_n);
    }
  });
}

void grouped_linear_swiglu_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_E2FI,
                                   const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& h_RF) {
  MF_ON_GPU(ctx, x_RI, cuda::grouped_linear_swiglu_forward(ctx, x_RI, w_E2FI, offsets_E1, gu_R2F, h_RF));
  grouped_linear_forward(ctx, x_RI, w_E2FI, offsets_E1, gu_R2F);
  swiglu_forward(ctx, gu_R2F, h_RF, GateUp::pairs);
}

void grouped_linear_swiglu_backward_data(const ExecContext& ctx, const Tensor& dy_RO, const Tensor& w_EOF,
                                         const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& dh_RF,
                                         const Tensor& dgu_R2F) {
  MF_ON_GPU(ctx, dy_RO,
            cuda::grouped_linear_swiglu_backward_data(ctx, dy_RO, w_EOF, offsets_E1, gu_R2F, dh_RF, dgu_R2F));
  // dh as the layer input too: without a weight gradient the backward reads only its shape.
  grouped_linear_backward(ctx, dh_RF, w_EOF, offsets_E1, dy_RO, dh_RF, Tensor());
  swiglu_backward(ctx, gu_R2F, dh_RF, dgu_R2F, GateUp::pairs);
}

}  // namespace moefold
