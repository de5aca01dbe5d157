// Router forward/backward: gemm for the logits, moe_ops for scores, top-k and the aux losses.
#include "moefold/moe/router.h"

#include <utility>

#include "moefold/ops/gemm.h"
#include "moefold/ops/moe_ops.h"

namespace moefold {

Router::Router(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, std::string prefix, double init_std)
    : cfg_(cfg), hidden_(hidden), max_tokens_(max_tokens), prefix_(std::move(prefix)), init_std_(init_std) {
  MF_CHECK(hidden >= 1 && max_tokens >= 0, "Router: hidden ", hidden, ", max_tokens ", max_tokens);
}

void Router::bind(Memory& mem) {
  const int64_t e_n = cfg_.num_experts, k_n = cfg_.num_experts_per_tok;
  gate_EH_ = mem.param(prefix_ + ".gate.weight", {e_n, hidden_}, Init::normal, init_std_, true);
  dgate_EH_ = mem.grad(prefix_ + ".gate.weight");
  logits_buf_ = mem.act({max_tokens_, e_n});
  scores_buf_ = mem.act({max_tokens_, e_n});
  idx_buf_ = mem.act({max_tokens_, k_n}, DType::i32);
  prob_buf_ = mem.act({max_tokens_, k_n});
  dlogits_buf_ = mem.act({max_tokens_, e_n});
  dextra_buf_ = mem.act({max_tokens_, e_n});
  counts_E_ = mem.act({e_n}, DType::i64);
  group_counts_E_ = mem.act({e_n}, DType::i64);
}

void Router::forward(const Tensor& x_TH) {
  const int64_t t_n = x_TH.size(0), e_n = cfg_.num_experts;
  MF_CHECK(x_TH.ndim() == 2 && x_TH.size(1) == hidden_ && t_n <= max_tokens_ && x_TH.contiguous(), "Router: x ",
           x_TH.str(), " for hidden ", hidden_, ", max_tokens ", max_tokens_);
  check_same_dtype(x_TH, gate_EH_, "Router x");
  logits_ = logits_buf_.slice(0, t_n);
  scores_ = scores_buf_.slice(0, t_n);
  topk_idx_ = idx_buf_.slice(0, t_n);
  topk_prob_ = prob_buf_.slice(0, t_n);
  dispatch_float(x_TH.dtype(), [&]<class T>() {
    gemm<T>(false, true, t_n, e_n, hidden_, T(1), x_TH.ptr<T>(), hidden_, gate_EH_.ptr<T>(), hidden_, T(0),
            logits_.ptr<T>(), e_n);
  });
  router_topk_forward(logits_, cfg_.routing(), scores_, topk_idx_, topk_prob_);
  topk_expert_counts(topk_idx_, counts_E_);
  // Router losses over the whole micro-batch when its sequences are split over a token group.
  group_counts_E_.copy_from(counts_E_);
  total_tokens_ = t_n;
  if (token_group_ && token_group_->size() > 1) {
    token_group_->all_reduce(group_counts_E_, ReduceOp::sum);
    total_tokens_ = t_n * token_group_->size();  // every rank of the group holds as many tokens
  }
  aux_loss_ = cfg_.aux_loss_coeff *
              aux_loss_forward(scores_, cfg_.scoring_func, group_counts_E_, cfg_.num_experts_per_tok, total_tokens_);
  z_loss_ = cfg_.z_loss_coeff > 0 ? cfg_.z_loss_coeff * z_loss_forward(logits_, total_tokens_) : 0.0;
}

void Router::backward(const Tensor& x_TH, const Tensor& dprob_TK, double loss_scale, const Tensor& dx_TH) {
  const int64_t t_n = x_TH.size(0), e_n = cfg_.num_experts;
  MF_CHECK(t_n == logits_.size(0), "Router::backward: ", t_n, " tokens, forward had ", logits_.size(0));
  check_shape(dx_TH, x_TH.shape(), "Router::backward dx");
  const Tensor dlogits = dlogits_buf_.slice(0, t_n), dextra = dextra_buf_.slice(0, t_n);
  router_topk_backward(scores_, topk_idx_, cfg_.routing(), dprob_TK, dlogits);
  dispatch_float(x_TH.dtype(), [&]<class T>() {
    T* d = dlogits.ptr<T>();
    const T* extra = dextra.ptr<T>();
    auto add_extra = [&] {
      for (int64_t i = 0; i < t_n * e_n; ++i) d[i] += extra[i];
    };
    if (cfg_.aux_loss_coeff > 0) {
      aux_loss_backward(scores_, cfg_.scoring_func, group_counts_E_, cfg_.num_experts_per_tok,
                        loss_scale * cfg_.aux_loss_coeff, dextra, total_tokens_);
      add_extra();
    }
    if (cfg_.z_loss_coeff > 0) {
      z_loss_backward(logits_, loss_scale * cfg_.z_loss_coeff, dextra, total_tokens_);
      add_extra();
    }
    // dgate += dlogits^T @ x (E x T @ T x H); dx += dlogits @ gate (T x E @ E x H).
    gemm<T>(true, false, e_n, hidden_, t_n, T(1), d, e_n, x_TH.ptr<T>(), hidden_, T(1), dgate_EH_.ptr<T>(), hidden_);
    gemm<T>(false, false, t_n, hidden_, e_n, T(1), d, e_n, gate_EH_.ptr<T>(), hidden_, T(1), dx_TH.ptr<T>(), hidden_);
  });
}

}  // namespace moefold
