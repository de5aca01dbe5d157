// Attention forward/backward in terms of the ops in ops/ops.h; see attention.h.
#include "moefold/model/attention.h"

#include <cmath>

#include "moefold/core/profile.h"
#include "moefold/ops/fp8.h"
#include "moefold/ops/ops.h"

namespace moefold {

void AttentionScratch::bind(Memory& mem, const ModelConfig& m, int64_t tokens, int64_t seq_len, int64_t q_dim,
                            int64_t kv_dim) {
  dq_TQD = mem.act({tokens, q_dim});
  dk_TGD = mem.act({tokens, kv_dim});
  dv_TGD = mem.act({tokens, kv_dim});
  dout_TQD = mem.act({tokens, q_dim});
  dq_raw_TQD = mem.act({tokens, q_dim});
  dk_raw_TGD = mem.act({tokens, kv_dim});
  dx_TH = mem.act({tokens, m.hidden_size});
  work_2SS = mem.act({2 * seq_len * seq_len});
  dy_full_TH = mem.act({tokens, m.hidden_size});
  partial_TH = mem.act({tokens, m.hidden_size});
}

Attention::Attention(const ModelConfig& m, int64_t batch, int64_t seq_len, std::string prefix)
    : cfg_(m),
      batch_(batch),
      seq_len_(seq_len),
      tokens_(batch * seq_len),
      prefix_(std::move(prefix)),
      qk_norm_(m.architecture == "mixtral" ? QkNorm::none
               : m.architecture == "olmoe" ? QkNorm::whole
                                           : QkNorm::per_head) {}

void Attention::bind(Memory& mem, const Tensor& cos_SD, const Tensor& sin_SD, AttentionScratch* scratch,
                     ContextParallelAttention* cp, Communicator* tp) {
  ctx_ = &mem.exec();
  const int64_t h = cfg_.hidden_size, d = cfg_.head_dim;
  const int64_t n = tp ? tp->size() : 1, r = tp ? tp->rank() : 0;
  tp_ = n > 1 ? tp : nullptr;
  q_heads_ = cfg_.num_attention_heads / n;
  kv_heads_ = cfg_.num_key_value_heads / n;
  const int64_t q = q_heads_, g = kv_heads_;
  const double std = cfg_.initializer_range;
  const ParamGroup tpg = ParamGroup::tensor_parallel;
  // Column-parallel: this rank's heads are rows [r * heads * D, ...) of each projection.
  wq_ = fp8_wq_.param(mem,
                      {.name = prefix_ + ".q_proj.weight",
                       .shape = {q * d, h},
                       .init_std = std,
                       .group = tpg,
                       .shard_offset = r * q * d,
                       .global_rows = n * q * d},
                      fp8_qkv_);
  wk_ = fp8_wk_.param(mem,
                      {.name = prefix_ + ".k_proj.weight",
                       .shape = {g * d, h},
                       .init_std = std,
                       .group = tpg,
                       .shard_offset = r * g * d,
                       .global_rows = n * g * d},
                      fp8_qkv_);
  wv_ = fp8_wv_.param(mem,
                      {.name = prefix_ + ".v_proj.weight",
                       .shape = {g * d, h},
                       .init_std = std,
                       .group = tpg,
                       .shard_offset = r * g * d,
                       .global_rows = n * g * d},
                      fp8_qkv_);
  // Row-parallel: this rank's heads are columns of the output projection.
  wo_ = fp8_wo_.param(mem,
                      {.name = prefix_ + ".o_proj.weight",
                       .shape = {h, q * d},
                       .init_std = std,
                       .group = tpg,
                       .global_rows = h,
                       .dim_shard = n > 1 ? DimShard{1, r * q * d, n * q * d, 1} : DimShard{}},
                      fp8_proj_);
  if (qk_norm_ != QkNorm::none) {  // OLMoE's whole-projection norms need every head here (no TP)
    const bool whole = qk_norm_ == QkNorm::whole;
    MF_CHECK(!whole || n == 1, prefix_, ": whole-projection q/k norms under tensor parallelism");
    q_norm_ = mem.param(
        {.name = prefix_ + ".q_norm.weight", .shape = {whole ? q * d : d}, .init = Init::ones, .decay = false});
    k_norm_ = mem.param(
        {.name = prefix_ + ".k_norm.weight", .shape = {whole ? g * d : d}, .init = Init::ones, .decay = false});
    dq_norm_ = mem.grad(prefix_ + ".q_norm.weight");
    dk_norm_ = mem.grad(prefix_ + ".k_norm.weight");
  }
  dwq_ = mem.grad(prefix_ + ".q_proj.weight");
  dwk_ = mem.grad(prefix_ + ".k_proj.weight");
  dwv_ = mem.grad(prefix_ + ".v_proj.weight");
  dwo_ = mem.grad(prefix_ + ".o_proj.weight");
  cp_ = cp;
  cos_ = cp ? cos_SD : cos_SD.slice(0, seq_len_);
  sin_ = cp ? sin_SD : sin_SD.slice(0, seq_len_);
  scratch_ = scratch;
  q_raw_TQD_ = mem.act({tokens_, q * d});
  k_raw_TGD_ = mem.act({tokens_, g * d});
  v_TGD_ = offload_core_ ? mem.offloaded({tokens_, g * d}) : mem.act({tokens_, g * d});
  q_rstd_ = mem.act({tokens_ * q}, mem.master_dtype());
  k_rstd_ = mem.act({tokens_ * g}, mem.master_dtype());
  auto kept = [&mem](bool offload, Shape shape, DType dtype) {
    return offload ? mem.offloaded(shape, dtype) : mem.act(shape, dtype);
  };
  const DType dt = mem.dtype();
  q_TQD_ = kept(offload_core_, {tokens_, q * d}, dt);
  k_TGD_ = kept(offload_core_, {tokens_, g * d}, dt);
  out_TQD_ = recompute_core_ ? mem.scratch({tokens_, q * d}) : kept(offload_proj_, {tokens_, q * d}, dt);
  lse_BQS_ = recompute_core_ ? mem.scratch({batch_, q, seq_len_}, mem.master_dtype())
                             : kept(offload_core_, {batch_, q, seq_len_}, mem.master_dtype());
  x_gathered_TH_ = kept(offload_qkv_, {tp_ ? tokens_ : 0, h}, dt);
  x_fp8_.bytes = fp8_qkv_ ? mem.scratch({fp8_shared_operand_bytes(tokens_, h)}, DType::u8) : Tensor();
}

void Attention::forward(const Tensor& x_TH, const Tensor& y_TH) {
  const int64_t d = cfg_.head_dim, q = q_heads_, g = kv_heads_;
  x_full_ = x_TH;
  if (tp_) {  // sequence parallel -> tensor parallel: every TP rank's rows
    x_full_ = x_gathered_TH_;
    tp_->all_gather(x_TH, x_full_);
  }
  x_fp8_.reset();
  if (qk_norm_ == QkNorm::none) {
    linear_forward_in(*ctx_, fp8_wq_.get(), x_full_, wq_, q_TQD_, &x_fp8_);
    linear_forward_in(*ctx_, fp8_wk_.get(), x_full_, wk_, k_TGD_, &x_fp8_);
  } else {
    linear_forward_in(*ctx_, fp8_wq_.get(), x_full_, wq_, q_raw_TQD_, &x_fp8_);
    linear_forward_in(*ctx_, fp8_wk_.get(), x_full_, wk_, k_raw_TGD_, &x_fp8_);
    // RMSNorm on q and k: per head (Qwen3) or over the whole projection (OLMoE).
    const int64_t qr = qk_norm_ == QkNorm::whole ? tokens_ : tokens_ * q,
                  kr = qk_norm_ == QkNorm::whole ? tokens_ : tokens_ * g;
    rmsnorm_forward(*ctx_, q_raw_TQD_.view({qr, tokens_ * q * d / qr}), q_norm_, cfg_.rms_norm_eps,
                    q_TQD_.view({qr, tokens_ * q * d / qr}), q_rstd_.slice(0, qr));
    rmsnorm_forward(*ctx_, k_raw_TGD_.view({kr, tokens_ * g * d / kr}), k_norm_, cfg_.rms_norm_eps,
                    k_TGD_.view({kr, tokens_ * g * d / kr}), k_rstd_.slice(0, kr));
  }
  linear_forward_in(*ctx_, fp8_wv_.get(), x_full_, wv_, v_TGD_, &x_fp8_);
  // RoPE in place.
  const Tensor q4 = q_TQD_.view({batch_, seq_len_, q, d}), k4 = k_TGD_.view({batch_, seq_len_, g, d});
  if (cp_) {  // this rank's chunks of the sequence, against every key of the CP group
    rope_forward_at(*ctx_, q4, cp_->positions(), cos_, sin_);
    rope_forward_at(*ctx_, k4, cp_->positions(), cos_, sin_);
  } else {
    rope_forward(*ctx_, q4, cos_, sin_);
    rope_forward(*ctx_, k4, cos_, sin_);
  }
  core_forward();
  if (tp_) {  // row-parallel: partial sums over the heads, summed and split back into rows
    linear_forward_in(*ctx_, fp8_wo_.get(), out_TQD_, wo_, scratch_->partial_TH);
    tp_->reduce_scatter(scratch_->partial_TH, y_TH, ReduceOp::sum);
  } else {
    linear_forward_in(*ctx_, fp8_wo_.get(), out_TQD_, wo_, y_TH);
  }
}

void Attention::core_forward() {
  const int64_t d = cfg_.head_dim, q = q_heads_, g = kv_heads_;
  const Tensor q4 = q_TQD_.view({batch_, seq_len_, q, d}), k4 = k_TGD_.view({batch_, seq_len_, g, d}),
               v4 = v_TGD_.view({batch_, seq_len_, g, d}), out4 = out_TQD_.view({batch_, seq_len_, q, d});
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  ProfileScope scope("attention core forward");
  if (cp_)
    cp_->forward(q4, k4, v4, scale, out4, lse_BQS_);
  else
    attention_forward(*ctx_, q4, k4, v4, scale, out4, lse_BQS_, scratch_->work_2SS.slice(0, seq_len_ * seq_len_));
}

void Attention::backward(const Tensor& dy_TH, const Tensor& dx_TH) {
  const int64_t d = cfg_.head_dim, q = q_heads_, g = kv_heads_;
  AttentionScratch& w = *scratch_;
  if (recompute_core_) {
    ProfileScope scope("recompute attention core");
    core_forward();
  }
  Tensor dy = dy_TH;
  if (tp_) {
    dy = w.dy_full_TH;
    tp_->all_gather(dy_TH, dy);
  }
  linear_backward_in(*ctx_, fp8_wo_.get(), out_TQD_, wo_, dy, w.dout_TQD, dwo_);
  auto q4 = [&](const Tensor& t) { return t.view({batch_, seq_len_, q, d}); };
  auto g4 = [&](const Tensor& t) { return t.view({batch_, seq_len_, g, d}); };
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (cp_) {
    {
      ProfileScope scope("attention core backward");
      cp_->backward(q4(q_TQD_), g4(k_TGD_), g4(v_TGD_), q4(out_TQD_), lse_BQS_, q4(w.dout_TQD), scale, q4(w.dq_TQD),
                    g4(w.dk_TGD), g4(w.dv_TGD));
    }
    rope_backward_at(*ctx_, q4(w.dq_TQD), cp_->positions(), cos_, sin_);
    rope_backward_at(*ctx_, g4(w.dk_TGD), cp_->positions(), cos_, sin_);
  } else {
    {
      ProfileScope scope("attention core backward");
      attention_backward(*ctx_, q4(q_TQD_), g4(k_TGD_), g4(v_TGD_), q4(out_TQD_), lse_BQS_, q4(w.dout_TQD), scale,
                         q4(w.dq_TQD), g4(w.dk_TGD), g4(w.dv_TGD), w.work_2SS);
    }
    rope_backward(*ctx_, q4(w.dq_TQD), cos_, sin_);
    rope_backward(*ctx_, g4(w.dk_TGD), cos_, sin_);
  }
  Tensor dq_raw = w.dq_TQD, dk_raw = w.dk_TGD;  // without q/k norms: the projections' outputs
  if (qk_norm_ != QkNorm::none) {
    const int64_t qr = qk_norm_ == QkNorm::whole ? tokens_ : tokens_ * q,
                  kr = qk_norm_ == QkNorm::whole ? tokens_ : tokens_ * g;
    const int64_t qc = tokens_ * q * d / qr, kc = tokens_ * g * d / kr;
    rmsnorm_backward(*ctx_, q_raw_TQD_.view({qr, qc}), q_norm_, q_rstd_.slice(0, qr), w.dq_TQD.view({qr, qc}),
                     w.dq_raw_TQD.view({qr, qc}), dq_norm_);
    rmsnorm_backward(*ctx_, k_raw_TGD_.view({kr, kc}), k_norm_, k_rstd_.slice(0, kr), w.dk_TGD.view({kr, kc}),
                     w.dk_raw_TGD.view({kr, kc}), dk_norm_);
    dq_raw = w.dq_raw_TQD;
    dk_raw = w.dk_raw_TGD;
  }
  // d(x) over every row: this rank's heads' part, summed over TP and split back into rows.
  const Tensor dx_full = tp_ ? w.partial_TH : dx_TH;
  x_fp8_.reset();  // the forward's operand (or this scratch's bytes) is gone
  linear_backward_in(*ctx_, fp8_wq_.get(), x_full_, wq_, dq_raw, dx_full, dwq_, &x_fp8_);
  linear_backward_in(*ctx_, fp8_wk_.get(), x_full_, wk_, dk_raw, w.dx_TH, dwk_, &x_fp8_);
  add_inplace(*ctx_, dx_full, w.dx_TH);
  linear_backward_in(*ctx_, fp8_wv_.get(), x_full_, wv_, w.dv_TGD, w.dx_TH, dwv_, &x_fp8_);
  add_inplace(*ctx_, dx_full, w.dx_TH);
  if (tp_) tp_->reduce_scatter(dx_full, dx_TH, ReduceOp::sum);
}

}  // namespace moefold
