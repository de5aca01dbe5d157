// Attention forward/backward in terms of the ops in ops/ops.h; see attention.h.
#include "moefold/model/attention.h"

#include <cmath>

#include "moefold/ops/ops.h"

namespace moefold {

void AttentionScratch::bind(Memory& mem, const ModelConfig& m, int64_t tokens, int64_t seq_len) {
  const int64_t qd = m.num_attention_heads * m.head_dim, gd = m.num_key_value_heads * m.head_dim;
  dq_TQD = mem.act({tokens, qd});
  dk_TGD = mem.act({tokens, gd});
  dv_TGD = mem.act({tokens, gd});
  dout_TQD = mem.act({tokens, qd});
  dq_raw_TQD = mem.act({tokens, qd});
  dk_raw_TGD = mem.act({tokens, gd});
  dx_TH = mem.act({tokens, m.hidden_size});
  work_2SS = mem.act({2 * seq_len * seq_len});
}

Attention::Attention(const ModelConfig& m, int64_t batch, int64_t seq_len, std::string prefix)
    : m_(m), b_(batch), s_(seq_len), t_(batch * seq_len), prefix_(std::move(prefix)) {}

void Attention::bind(Memory& mem, const Tensor& cos_SD, const Tensor& sin_SD, AttentionScratch* scratch,
                     ContextParallelAttention* cp) {
  const int64_t h = m_.hidden_size, d = m_.head_dim, q = m_.num_attention_heads, g = m_.num_key_value_heads;
  const double std = m_.initializer_range;
  wq_ = mem.param(prefix_ + ".q_proj.weight", {q * d, h}, Init::normal, std, true);
  wk_ = mem.param(prefix_ + ".k_proj.weight", {g * d, h}, Init::normal, std, true);
  wv_ = mem.param(prefix_ + ".v_proj.weight", {g * d, h}, Init::normal, std, true);
  wo_ = mem.param(prefix_ + ".o_proj.weight", {h, q * d}, Init::normal, std, true);
  q_norm_ = mem.param(prefix_ + ".q_norm.weight", {d}, Init::ones, 0, false);
  k_norm_ = mem.param(prefix_ + ".k_norm.weight", {d}, Init::ones, 0, false);
  dwq_ = mem.grad(prefix_ + ".q_proj.weight");
  dwk_ = mem.grad(prefix_ + ".k_proj.weight");
  dwv_ = mem.grad(prefix_ + ".v_proj.weight");
  dwo_ = mem.grad(prefix_ + ".o_proj.weight");
  dq_norm_ = mem.grad(prefix_ + ".q_norm.weight");
  dk_norm_ = mem.grad(prefix_ + ".k_norm.weight");
  cp_ = cp;
  cos_ = cp ? cos_SD : cos_SD.slice(0, s_);
  sin_ = cp ? sin_SD : sin_SD.slice(0, s_);
  scratch_ = scratch;
  q_raw_TQD_ = mem.act({t_, q * d});
  k_raw_TGD_ = mem.act({t_, g * d});
  v_TGD_ = mem.act({t_, g * d});
  q_rstd_ = mem.act({t_ * q});
  k_rstd_ = mem.act({t_ * g});
  q_TQD_ = mem.act({t_, q * d});
  k_TGD_ = mem.act({t_, g * d});
  out_TQD_ = mem.act({t_, q * d});
  lse_BQS_ = mem.act({b_, q, s_});
}

void Attention::forward(const Tensor& x_TH, const Tensor& y_TH) {
  const int64_t d = m_.head_dim, q = m_.num_attention_heads, g = m_.num_key_value_heads;
  x_ = x_TH;
  linear_forward(x_TH, wq_, q_raw_TQD_);
  linear_forward(x_TH, wk_, k_raw_TGD_);
  linear_forward(x_TH, wv_, v_TGD_);
  // Per-head RMSNorm on q and k (Qwen3), then RoPE in place.
  rmsnorm_forward(q_raw_TQD_.view({t_ * q, d}), q_norm_, m_.rms_norm_eps, q_TQD_.view({t_ * q, d}), q_rstd_);
  rmsnorm_forward(k_raw_TGD_.view({t_ * g, d}), k_norm_, m_.rms_norm_eps, k_TGD_.view({t_ * g, d}), k_rstd_);
  Tensor q4 = q_TQD_.view({b_, s_, q, d}), k4 = k_TGD_.view({b_, s_, g, d}), v4 = v_TGD_.view({b_, s_, g, d});
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (cp_) {  // this rank's chunks of the sequence, against every key of the CP group
    rope_forward_at(q4, cp_->positions(), cos_, sin_);
    rope_forward_at(k4, cp_->positions(), cos_, sin_);
    cp_->forward(q4, k4, v4, scale, out_TQD_.view({b_, s_, q, d}), lse_BQS_);
  } else {
    rope_forward(q4, cos_, sin_);
    rope_forward(k4, cos_, sin_);
    attention_forward(q4, k4, v4, scale, out_TQD_.view({b_, s_, q, d}), lse_BQS_, scratch_->work_2SS.slice(0, s_ * s_));
  }
  linear_forward(out_TQD_, wo_, y_TH);
}

void Attention::backward(const Tensor& dy_TH, const Tensor& dx_TH) {
  const int64_t d = m_.head_dim, q = m_.num_attention_heads, g = m_.num_key_value_heads;
  AttentionScratch& w = *scratch_;
  linear_backward(out_TQD_, wo_, dy_TH, w.dout_TQD, dwo_);
  auto q4 = [&](const Tensor& t) { return t.view({b_, s_, q, d}); };
  auto g4 = [&](const Tensor& t) { return t.view({b_, s_, g, d}); };
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (cp_) {
    cp_->backward(q4(q_TQD_), g4(k_TGD_), g4(v_TGD_), q4(out_TQD_), lse_BQS_, q4(w.dout_TQD), scale, q4(w.dq_TQD),
                  g4(w.dk_TGD), g4(w.dv_TGD));
    rope_backward_at(q4(w.dq_TQD), cp_->positions(), cos_, sin_);
    rope_backward_at(g4(w.dk_TGD), cp_->positions(), cos_, sin_);
  } else {
    attention_backward(q4(q_TQD_), g4(k_TGD_), g4(v_TGD_), q4(out_TQD_), lse_BQS_, q4(w.dout_TQD), scale, q4(w.dq_TQD),
                       g4(w.dk_TGD), g4(w.dv_TGD), w.work_2SS);
    rope_backward(q4(w.dq_TQD), cos_, sin_);
    rope_backward(g4(w.dk_TGD), cos_, sin_);
  }
  rmsnorm_backward(q_raw_TQD_.view({t_ * q, d}), q_norm_, q_rstd_, w.dq_TQD.view({t_ * q, d}),
                   w.dq_raw_TQD.view({t_ * q, d}), dq_norm_);
  rmsnorm_backward(k_raw_TGD_.view({t_ * g, d}), k_norm_, k_rstd_, w.dk_TGD.view({t_ * g, d}),
                   w.dk_raw_TGD.view({t_ * g, d}), dk_norm_);
  linear_backward(x_, wq_, w.dq_raw_TQD, dx_TH, dwq_);
  linear_backward(x_, wk_, w.dk_raw_TGD, w.dx_TH, dwk_);
  add_inplace(dx_TH, w.dx_TH);
  linear_backward(x_, wv_, w.dv_TGD, w.dx_TH, dwv_);
  add_inplace(dx_TH, w.dx_TH);
}

}  // namespace moefold
