// CPU reference of the router scores and top-k (moe_ops.h): plain loops in the logits' dtype.
// Gradient rule: dlogits WRITTEN, through the fixed selection (nothing flows to the bias).
// CUDA tensors go to ops/cuda/router_topk.cu.
#include <cmath>
#include <limits>

#include "moefold/ops/cpu/moe_common.h"
#include "moefold/ops/dispatch.h"
#include "moefold/ops/moe_ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/router_topk.h"
#endif

namespace moefold {

namespace {

void check_router(const Tensor& scores_TE, const Tensor& topk_idx_TK) {
  check_2d(scores_TE, "router scores");
  check_2d(topk_idx_TK, "router topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "router topk_idx");
  MF_CHECK(
      topk_idx_TK.size(0) == scores_TE.size(0) && topk_idx_TK.size(1) >= 1 && topk_idx_TK.size(1) <= scores_TE.size(1),
      "router: scores ", scores_TE.str(), ", topk_idx ", topk_idx_TK.str());
}

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
    MF_CHECK(bias.ndim() == 1 && bias.size(0) == e_n && bias.contiguous() && bias.device() == logits_TE.device() &&
                 (bias.dtype() == logits_TE.dtype() || bias.dtype() == DType::f32),
             "router_topk_forward bias: ", bias.str(), " for logits ", logits_TE.str());
  }
  MF_ON_GPU(ctx, logits_TE, cuda::router_topk_forward(ctx, logits_TE, routing, scores_TE, topk_idx_TK, topk_prob_TK));
  check_on_cpu(logits_TE, "router scores");
  check_on_cpu(topk_idx_TK, "router topk_idx");
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
  check_router(scores_TE, topk_idx_TK);
  check_shape(dprob_TK, topk_idx_TK.shape(), "router_topk_backward dprob");
  check_shape(dlogits_TE, scores_TE.shape(), "router_topk_backward dlogits");
  check_same_dtype(scores_TE, dprob_TK, "router_topk_backward dprob");
  check_same_dtype(scores_TE, dlogits_TE, "router_topk_backward dlogits");
  MF_ON_GPU(ctx, scores_TE, cuda::router_topk_backward(ctx, scores_TE, topk_idx_TK, routing, dprob_TK, dlogits_TE));
  check_on_cpu(scores_TE, "router scores");
  check_on_cpu(topk_idx_TK, "router topk_idx");
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

}  // namespace moefold
