// Router forward/backward: matmul for the logits, moe_ops for scores, top-k and the aux losses.
// Every step is an op, so the router runs on either device. Under mixed precision (bf16 compute)
// logits, scores, top-k, losses and the gate's gradient are f32. The logits GEMM multiplies the
// bf16 input by the gate's bf16 copy with f32 accumulation into f32 logits, and its backward
// GEMMs take d(logits) rounded to bf16 (tensor cores: the GEMMs cost ~1% of the experts'); with
// moe.router_fp32_gemm it multiplies f32 copies of the input and the master gate instead, as
// Megatron-Core's moe_router_dtype=fp32, and d(x) comes back through an f32 buffer.
#include "moefold/moe/router.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "moefold/core/device.h"
#include "moefold/ops/moe_ops.h"
#include "moefold/ops/ops.h"

namespace moefold {

Router::Router(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, std::string prefix, double init_std)
    : cfg_(cfg), hidden_(hidden), max_tokens_(max_tokens), prefix_(std::move(prefix)), init_std_(init_std) {
  MF_CHECK(hidden >= 1 && max_tokens >= 0, "Router: hidden ", hidden, ", max_tokens ", max_tokens);
}

void Router::bind(Memory& mem) {
  ctx_ = &mem.exec();
  const int64_t e_n = cfg_.num_experts, k_n = cfg_.num_experts_per_tok;
  // Both keep their whole master on every rank with the distributed optimizer: the router reads
  // the f32 gate and writes the bias itself.
  gate_compute_EH_ = mem.param(
      {.name = prefix_ + ".gate.weight", .shape = {e_n, hidden_}, .init_std = init_std_, .full_master = true});
  gate_EH_ = mem.find(prefix_ + ".gate.weight")->value;  // the master weight
  dgate_EH_ = mem.grad(prefix_ + ".gate.weight");
  if (cfg_.expert_bias) {
    // Selection only (aux-loss-free balancing): nothing writes its gradient, so the gradient stays
    // at the zero the step's memset leaves, AdamW (zero moments, no decay) leaves the value
    // exactly as it is, and update_expert_bias is the one thing that moves it.
    mem.param({.name = prefix_ + ".gate.e_score_correction_bias",
               .shape = {e_n},
               .init = Init::zeros,
               .decay = false,
               .full_master = true});
    bias_E_ = mem.find(prefix_ + ".gate.e_score_correction_bias")->value;
  }
  const DType rd = mem.master_dtype();  // the router's dtype: f32 (f64 in gradient checks)
  mixed_ = mem.mixed_precision();
  fp32_gemm_ = mixed_ && cfg_.router_fp32_gemm;
  if (fp32_gemm_) gate_compute_EH_ = gate_EH_;
  x_buf_ = mem.act({fp32_gemm_ ? max_tokens_ : 0, hidden_}, rd);
  dx_buf_ = mem.scratch({fp32_gemm_ ? max_tokens_ : 0, hidden_}, rd);
  dx_cast_buf_ = mem.scratch({fp32_gemm_ ? max_tokens_ : 0, hidden_});
  dlogits_cast_buf_ = mem.scratch({mixed_ && !fp32_gemm_ ? max_tokens_ : 0, e_n});
  logits_buf_ = mem.act({max_tokens_, e_n}, rd);
  scores_buf_ = mem.act({max_tokens_, e_n}, rd);
  idx_buf_ = mem.act({max_tokens_, k_n}, DType::i32);
  prob_buf_ = mem.act({max_tokens_, k_n}, rd);
  dlogits_buf_ = mem.scratch({max_tokens_, e_n}, rd);
  dextra_buf_ = mem.scratch({max_tokens_, e_n}, rd);
  counts_E_ = mem.result({e_n}, DType::i64);  // the trainer reads it after the whole forward
  losses_3_ = mem.result({3}, DType::f64);    // and these
  group_counts_E_ = mem.act({e_n}, DType::i64);
  if (cfg_.seq_aux_loss_coeff > 0) seq_counts_buf_ = mem.act({std::max<int64_t>(num_seqs_, 1), e_n}, DType::i64);
  bound_ = true;
}

void Router::set_sequences(int64_t num_seqs, int64_t local_seq_len, int64_t row_offset, int64_t full_seq_len) {
  MF_CHECK(!bound_, "Router::set_sequences after bind");
  MF_CHECK(num_seqs >= 1 && local_seq_len >= 1 && row_offset >= 0 && full_seq_len >= local_seq_len,
           "Router::set_sequences: ", num_seqs, " sequences of ", full_seq_len, " tokens, ", local_seq_len,
           " local, from row ", row_offset);
  num_seqs_ = num_seqs;
  local_seq_len_ = local_seq_len;
  row_offset_ = row_offset;
  full_seq_len_ = full_seq_len;
}

void Router::update_expert_bias(const Tensor& counts_E, double rate) {
  MF_CHECK(cfg_.expert_bias && bias_E_.data(), "Router::update_expert_bias without moe.expert_bias (or unbound)");
  expert_bias_update(*ctx_, bias_E_, counts_E, rate);
}

void Router::forward(const Tensor& x_TH) {
  const int64_t t_n = x_TH.size(0);
  MF_CHECK(x_TH.ndim() == 2 && x_TH.size(1) == hidden_ && t_n <= max_tokens_ && x_TH.contiguous(), "Router: x ",
           x_TH.str(), " for hidden ", hidden_, ", max_tokens ", max_tokens_);
  logits_ = logits_buf_.slice(0, t_n);
  scores_ = scores_buf_.slice(0, t_n);
  topk_idx_ = idx_buf_.slice(0, t_n);
  topk_prob_ = prob_buf_.slice(0, t_n);
  const Tensor x = router_input(x_TH);
  matmul(*ctx_, as_matrix(x), false, as_matrix(gate_compute_EH_), true, as_matrix(logits_), 1, 0);
  if (gate_EH_.device() == Device::cpu) tie_equal_rows();
  TopkRouting routing = cfg_.routing();
  routing.bias_E = bias_E_;
  router_topk_forward(*ctx_, logits_, routing, scores_, topk_idx_, topk_prob_);
  topk_expert_counts(*ctx_, topk_idx_, counts_E_);
  // Router losses over the whole micro-batch when its sequences are split over a token group.
  const bool grouped = token_group_ && token_group_->size() > 1;
  group_counts_E_.copy_from(counts_E_, ctx_);
  total_tokens_ = t_n;
  if (grouped) {
    token_group_->all_reduce(group_counts_E_, ReduceOp::sum);
    total_tokens_ = t_n * token_group_->size();  // every rank of the group holds as many tokens
  }
  losses_read_ = false;
  aux_loss_forward(*ctx_, scores_, cfg_.scoring_func, group_counts_E_, cfg_.num_experts_per_tok, total_tokens_,
                   losses_3_.slice(0, 1));
  if (cfg_.seq_aux_loss_coeff > 0) {
    int64_t b_n = num_seqs_;
    if (num_seqs_ > 0) {
      seq_layout_ = {local_seq_len_, row_offset_, full_seq_len_};
    } else {  // one sequence: this forward's tokens (of every rank of the token group)
      b_n = 1;
      seq_layout_ = {std::max<int64_t>(t_n, 1), 0, std::max<int64_t>(total_tokens_, 1)};
    }
    seq_counts_BE_ = seq_counts_buf_.slice(0, b_n);
    seq_expert_counts(*ctx_, topk_idx_, seq_layout_, seq_counts_BE_);
    if (grouped) token_group_->all_reduce(seq_counts_BE_, ReduceOp::sum);
    seq_aux_loss_forward(*ctx_, scores_, cfg_.scoring_func, seq_counts_BE_, cfg_.num_experts_per_tok, seq_layout_,
                         losses_3_.slice(1, 2));
  }
  if (cfg_.z_loss_coeff > 0) z_loss_forward(*ctx_, logits_, total_tokens_, losses_3_.slice(2, 3));
}

void Router::add_step_stats(const Tensor& sums_2, const Tensor& load_E, const Tensor& dropped_1) const {
  moe_step_stats(*ctx_, losses_3_, cfg_.aux_loss_coeff, cfg_.seq_aux_loss_coeff > 0 ? cfg_.seq_aux_loss_coeff : 0.0,
                 cfg_.z_loss_coeff > 0 ? cfg_.z_loss_coeff : 0.0, counts_E_, cfg_.capacity(logits_.size(0)), sums_2,
                 load_E, dropped_1);
}

double Router::loss(int i) const {
  if (!losses_read_) {
    // From the GPU: waits. (A raw copy: no Tensor, whose shape would allocate in the step loop.)
    device_copy(losses_host_, Device::cpu, losses_3_.data(), losses_3_.device(), sizeof(losses_host_), ctx_->stream());
    losses_read_ = true;
  }
  return losses_host_[i];
}

Tensor Router::router_input(const Tensor& x_TH) {
  if (!fp32_gemm_) {
    check_same_dtype(x_TH, gate_compute_EH_, "Router x");
    return x_TH;
  }
  const Tensor x = x_buf_.slice(0, x_TH.size(0));
  cast(*ctx_, x_TH, x);
  return x;
}

void Router::tie_equal_rows() {
  // Equal gate rows give equal logits, exactly: an expert whose row is bitwise equal to an
  // earlier expert's takes that expert's logits. A GEMM computes its edge tiles in another order
  // than its full tiles, so equal rows can get logits an ulp apart (OpenBLAS 0.3.21: 17-49% of
  // probed shapes, on every core type), while an upcycled router (train/upcycle.h) has G equal
  // rows per copy of the dense MLP and needs exact ties for the top-K to select whole copies.
  // At most E^2 / 2 row compares, each stopping at the first differing byte. (CPU only: the GPU
  // path needs a device-side version before upcycled routers train there.)
  const int64_t t_n = logits_.size(0), e_n = cfg_.num_experts;
  dispatch_float(gate_EH_.dtype(), [&]<class T>() {
    const T* w = gate_EH_.ptr<T>();
    T* logits = logits_.ptr<T>();
    for (int64_t e = 1; e < e_n; ++e)
      for (int64_t d = 0; d < e; ++d)
        if (std::memcmp(w + e * hidden_, w + d * hidden_, static_cast<size_t>(hidden_) * sizeof(T)) == 0) {
          for (int64_t t = 0; t < t_n; ++t) logits[t * e_n + e] = logits[t * e_n + d];
          break;
        }
  });
}

void Router::backward(const Tensor& x_TH, const Tensor& dprob_TK, double loss_scale, const Tensor& dx_TH) {
  const int64_t t_n = x_TH.size(0);
  MF_CHECK(t_n == logits_.size(0), "Router::backward: ", t_n, " tokens, forward had ", logits_.size(0));
  check_shape(dx_TH, x_TH.shape(), "Router::backward dx");
  const Tensor dlogits = dlogits_buf_.slice(0, t_n), dextra = dextra_buf_.slice(0, t_n);
  router_topk_backward(*ctx_, scores_, topk_idx_, cfg_.routing(), dprob_TK, dlogits);
  if (cfg_.aux_loss_coeff > 0) {
    aux_loss_backward(*ctx_, scores_, cfg_.scoring_func, group_counts_E_, cfg_.num_experts_per_tok,
                      loss_scale * cfg_.aux_loss_coeff, dextra, total_tokens_);
    add_inplace(*ctx_, dlogits, dextra);
  }
  if (cfg_.seq_aux_loss_coeff > 0) {
    seq_aux_loss_backward(*ctx_, scores_, cfg_.scoring_func, seq_counts_BE_, cfg_.num_experts_per_tok, seq_layout_,
                          loss_scale * cfg_.seq_aux_loss_coeff, dextra);
    add_inplace(*ctx_, dlogits, dextra);
  }
  if (cfg_.z_loss_coeff > 0) {
    z_loss_backward(*ctx_, logits_, loss_scale * cfg_.z_loss_coeff, dextra, total_tokens_);
    add_inplace(*ctx_, dlogits, dextra);
  }
  // dgate += dlogits^T @ x (E x T @ T x H); dx += dlogits @ gate (T x E @ E x H): in the master
  // dtype without mixed precision; with it from bf16 d(logits) into the f32 dgate and straight
  // into dx, or in f32 through an f32 buffer for d(x) (router_fp32_gemm).
  if (mixed_ && !fp32_gemm_) {
    const Tensor dl = dlogits_cast_buf_.slice(0, t_n);
    cast(*ctx_, dlogits, dl);
    matmul(*ctx_, as_matrix(dl), true, as_matrix(x_TH), false, as_matrix(dgate_EH_), 1, 1);
    matmul(*ctx_, as_matrix(dl), false, as_matrix(gate_compute_EH_), false, as_matrix(dx_TH), 1, 1);
    return;
  }
  const Tensor x = fp32_gemm_ ? x_buf_.slice(0, t_n) : x_TH;
  matmul(*ctx_, as_matrix(dlogits), true, as_matrix(x), false, as_matrix(dgate_EH_), 1, 1);
  if (!fp32_gemm_) {
    matmul(*ctx_, as_matrix(dlogits), false, as_matrix(gate_EH_), false, as_matrix(dx_TH), 1, 1);
    return;
  }
  const Tensor dx = dx_buf_.slice(0, t_n), dx_cast = dx_cast_buf_.slice(0, t_n);
  matmul(*ctx_, as_matrix(dlogits), false, as_matrix(gate_EH_), false, as_matrix(dx), 1, 0);
  cast(*ctx_, dx, dx_cast);
  add_inplace(*ctx_, dx_TH, dx_cast);
}

}  // namespace moefold
