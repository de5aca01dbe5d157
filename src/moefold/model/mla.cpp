// MlaAttention forward/backward in terms of ops/ops.h; see mla.h. The head-wise assembly of q, k
// and v (split, de-interleave, pad) is plain index arithmetic here: it moves no more bytes than
// the projections' outputs.
#include "moefold/model/mla.h"

#include <algorithm>
#include <cmath>

#include "moefold/ops/ops.h"

namespace moefold {

int64_t MlaAttention::core_head_dim(const ModelConfig& m) {
  return std::max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim);
}

MlaAttention::MlaAttention(const ModelConfig& m, int64_t batch, int64_t seq_len, std::string prefix,
                           double softmax_scale)
    : m_(m),
      b_(batch),
      s_(seq_len),
      t_(batch * seq_len),
      prefix_(std::move(prefix)),
      scale_(softmax_scale),
      dn_(m.qk_nope_head_dim),
      dr_(m.qk_rope_head_dim),
      dv_(m.v_head_dim),
      dqk_(m.qk_nope_head_dim + m.qk_rope_head_dim),
      dp_(core_head_dim(m)),
      rq_(m.q_lora_rank),
      rkv_(m.kv_lora_rank) {
  MF_CHECK(dr_ % 2 == 0, prefix_, ": qk_rope_head_dim ", dr_, " must be even");
}

void MlaAttention::bind(Memory& mem, const Tensor& cos_SD, const Tensor& sin_SD, AttentionScratch* scratch,
                        ContextParallelAttention* cp, Communicator* tp) {
  const int64_t h = m_.hidden_size, n = tp ? tp->size() : 1, r = tp ? tp->rank() : 0;
  tp_ = n > 1 ? tp : nullptr;
  qh_ = m_.num_attention_heads / n;
  const int64_t q = qh_, nt = t_;
  const double std = m_.initializer_range;
  const ParamGroup tpg = ParamGroup::tensor_parallel;
  auto grad = [&](const char* name) { return mem.grad(prefix_ + name); };
  if (rq_ > 0) {
    wq_a_ = mem.param(prefix_ + ".q_a_proj.weight", {rq_, h}, Init::normal, std, true);
    q_a_norm_ = mem.param(prefix_ + ".q_a_layernorm.weight", {rq_}, Init::ones, 0, false);
    wq_b_ = mem.param(prefix_ + ".q_b_proj.weight", {q * dqk_, rq_}, Init::normal, std, true, tpg, r * q * dqk_,
                      n * q * dqk_);
    dwq_a_ = grad(".q_a_proj.weight");
    dq_a_norm_ = grad(".q_a_layernorm.weight");
    dwq_b_ = grad(".q_b_proj.weight");
  } else {
    wq_b_ =
        mem.param(prefix_ + ".q_proj.weight", {q * dqk_, h}, Init::normal, std, true, tpg, r * q * dqk_, n * q * dqk_);
    dwq_b_ = grad(".q_proj.weight");
  }
  wkv_a_ = mem.param(prefix_ + ".kv_a_proj_with_mqa.weight", {rkv_ + dr_, h}, Init::normal, std, true);
  kv_a_norm_ = mem.param(prefix_ + ".kv_a_layernorm.weight", {rkv_}, Init::ones, 0, false);
  wkv_b_ = mem.param(prefix_ + ".kv_b_proj.weight", {q * (dn_ + dv_), rkv_}, Init::normal, std, true, tpg,
                     r * q * (dn_ + dv_), n * q * (dn_ + dv_));
  wo_ = mem.param(prefix_ + ".o_proj.weight", {h, q * dv_}, Init::normal, std, true, tpg, 0, h,
                  n > 1 ? DimShard{1, r * q * dv_, n * q * dv_, 1} : DimShard{});
  dwkv_a_ = grad(".kv_a_proj_with_mqa.weight");
  dkv_a_norm_ = grad(".kv_a_layernorm.weight");
  dwkv_b_ = grad(".kv_b_proj.weight");
  dwo_ = grad(".o_proj.weight");
  cp_ = cp;
  cos_ = cp ? cos_SD : cos_SD.slice(0, s_);
  sin_ = cp ? sin_SD : sin_SD.slice(0, s_);
  work_ = scratch->work_2SS;
  x_gathered_TH_ = mem.act({tp_ ? nt : 0, h});
  cq_raw_ = mem.act({nt, rq_});
  cq_ = mem.act({nt, rq_});
  cq_rstd_ = mem.act({rq_ > 0 ? nt : 0});
  q_raw_ = mem.act({nt, q * dqk_});
  kv_a_ = mem.act({nt, rkv_ + dr_});
  ckv_raw_ = mem.act({nt, rkv_});
  ckv_ = mem.act({nt, rkv_});
  ckv_rstd_ = mem.act({nt});
  kvb_ = mem.act({nt, q * (dn_ + dv_)});
  q_pe_ = mem.act({b_, s_, q, dr_});
  k_pe_ = mem.act({b_, s_, 1, dr_});
  q4_ = mem.act({b_, s_, q, dp_});
  k4_ = mem.act({b_, s_, q, dp_});
  v4_ = mem.act({b_, s_, q, dp_});
  out4_ = mem.act({b_, s_, q, dp_});
  lse_ = mem.act({b_, q, s_});
  o_in_ = mem.act({nt, q * dv_});
  dy_full_ = mem.act({tp_ ? nt : 0, h});
  do_in_ = mem.act({nt, q * dv_});
  dout4_ = mem.act({b_, s_, q, dp_});
  dq4_ = mem.act({b_, s_, q, dp_});
  dk4_ = mem.act({b_, s_, q, dp_});
  dv4_ = mem.act({b_, s_, q, dp_});
  dq_raw_ = mem.act({nt, q * dqk_});
  dcq_ = mem.act({nt, rq_});
  dcq_raw_ = mem.act({nt, rq_});
  dkvb_ = mem.act({nt, q * (dn_ + dv_)});
  dckv_ = mem.act({nt, rkv_});
  dckv_raw_ = mem.act({nt, rkv_});
  dkv_a_ = mem.act({nt, rkv_ + dr_});
  dx_part_ = mem.act({nt, h});
  partial_ = mem.act({tp_ ? nt : 0, h});
}

void MlaAttention::forward(const Tensor& x_TH, const Tensor& y_TH) {
  const int64_t q = qh_, nt = t_, kvw = rkv_ + dr_, kvbw = dn_ + dv_;
  x_full_ = x_TH;
  if (tp_) {
    x_full_ = x_gathered_TH_;
    tp_->all_gather(x_TH, x_full_);
  }
  if (rq_ > 0) {
    linear_forward(x_full_, wq_a_, cq_raw_);
    rmsnorm_forward(cq_raw_, q_a_norm_, m_.rms_norm_eps, cq_, cq_rstd_);
    linear_forward(cq_, wq_b_, q_raw_);
  } else {
    linear_forward(x_full_, wq_b_, q_raw_);
  }
  linear_forward(x_full_, wkv_a_, kv_a_);
  dispatch_float(x_TH.dtype(), [&]<class T>() {
    const T* kva = kv_a_.ptr<T>();
    T* craw = ckv_raw_.ptr<T>();
    T* kpe = k_pe_.ptr<T>();
    const T* qr = q_raw_.ptr<T>();
    T* qpe = q_pe_.ptr<T>();
    for (int64_t t = 0; t < nt; ++t) {
      std::copy(kva + t * kvw, kva + t * kvw + rkv_, craw + t * rkv_);
      std::copy(kva + t * kvw + rkv_, kva + (t + 1) * kvw, kpe + t * dr_);
      for (int64_t hd = 0; hd < q; ++hd)
        std::copy(qr + (t * q + hd) * dqk_ + dn_, qr + (t * q + hd + 1) * dqk_, qpe + (t * q + hd) * dr_);
    }
  });
  rmsnorm_forward(ckv_raw_, kv_a_norm_, m_.rms_norm_eps, ckv_, ckv_rstd_);
  linear_forward(ckv_, wkv_b_, kvb_);
  const bool il = m_.rope_interleave;
  if (cp_) {
    rope_forward_at(q_pe_, cp_->positions(), cos_, sin_, il);
    rope_forward_at(k_pe_, cp_->positions(), cos_, sin_, il);
  } else {
    rope_forward(q_pe_, cos_, sin_, il);
    rope_forward(k_pe_, cos_, sin_, il);
  }
  dispatch_float(x_TH.dtype(), [&]<class T>() {
    const T* qr = q_raw_.ptr<T>();
    const T* qpe = q_pe_.ptr<T>();
    const T* kpe = k_pe_.ptr<T>();
    const T* kvb = kvb_.ptr<T>();
    T* q4 = q4_.ptr<T>();
    T* k4 = k4_.ptr<T>();
    T* v4 = v4_.ptr<T>();
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t hd = 0; hd < q; ++hd) {
        const int64_t row = (t * q + hd) * dp_;
        const T* qsrc = qr + (t * q + hd) * dqk_;
        const T* kvsrc = kvb + (t * q + hd) * kvbw;
        std::fill(q4 + row, q4 + row + dp_, T(0));
        std::fill(k4 + row, k4 + row + dp_, T(0));
        std::fill(v4 + row, v4 + row + dp_, T(0));
        std::copy(qsrc, qsrc + dn_, q4 + row);
        std::copy(qpe + (t * q + hd) * dr_, qpe + (t * q + hd + 1) * dr_, q4 + row + dn_);
        std::copy(kvsrc, kvsrc + dn_, k4 + row);
        std::copy(kpe + t * dr_, kpe + (t + 1) * dr_, k4 + row + dn_);
        std::copy(kvsrc + dn_, kvsrc + kvbw, v4 + row);
      }
  });
  if (cp_)
    cp_->forward(q4_, k4_, v4_, scale_, out4_, lse_);
  else
    attention_forward(q4_, k4_, v4_, scale_, out4_, lse_, work_.slice(0, s_ * s_));
  dispatch_float(x_TH.dtype(), [&]<class T>() {
    const T* out = out4_.ptr<T>();
    T* o = o_in_.ptr<T>();
    for (int64_t th = 0; th < nt * q; ++th) std::copy(out + th * dp_, out + th * dp_ + dv_, o + th * dv_);
  });
  if (tp_) {
    linear_forward(o_in_, wo_, partial_);
    tp_->reduce_scatter(partial_, y_TH, ReduceOp::sum);
  } else {
    linear_forward(o_in_, wo_, y_TH);
  }
}

void MlaAttention::backward(const Tensor& dy_TH, const Tensor& dx_TH) {
  const int64_t q = qh_, nt = t_, kvw = rkv_ + dr_, kvbw = dn_ + dv_;
  Tensor dy = dy_TH;
  if (tp_) {
    dy = dy_full_;
    tp_->all_gather(dy_TH, dy);
  }
  linear_backward(o_in_, wo_, dy, do_in_, dwo_);
  dispatch_float(dy_TH.dtype(), [&]<class T>() {
    const T* d = do_in_.ptr<T>();
    T* dout = dout4_.ptr<T>();
    for (int64_t th = 0; th < nt * q; ++th) {
      std::copy(d + th * dv_, d + (th + 1) * dv_, dout + th * dp_);
      std::fill(dout + th * dp_ + dv_, dout + (th + 1) * dp_, T(0));
    }
  });
  if (cp_)
    cp_->backward(q4_, k4_, v4_, out4_, lse_, dout4_, scale_, dq4_, dk4_, dv4_);
  else
    attention_backward(q4_, k4_, v4_, out4_, lse_, dout4_, scale_, dq4_, dk4_, dv4_, work_);
  // Split the core's gradients back: q_nope and q_rot (per head), k_nope and v (into kv_b's
  // output), k_rot summed over the heads (one shared rotary key).
  dispatch_float(dy_TH.dtype(), [&]<class T>() {
    const T* dq4 = dq4_.ptr<T>();
    const T* dk4 = dk4_.ptr<T>();
    const T* dv4 = dv4_.ptr<T>();
    T* dqr = dq_raw_.ptr<T>();
    T* dqpe = q_pe_.ptr<T>();  // q_pe's values are not needed any more: reuse it for the gradient
    T* dkpe = k_pe_.ptr<T>();
    T* dkvb = dkvb_.ptr<T>();
    for (int64_t t = 0; t < nt; ++t) {
      std::fill(dkpe + t * dr_, dkpe + (t + 1) * dr_, T(0));
      for (int64_t hd = 0; hd < q; ++hd) {
        const int64_t row = (t * q + hd) * dp_;
        std::copy(dq4 + row, dq4 + row + dn_, dqr + (t * q + hd) * dqk_);
        std::copy(dq4 + row + dn_, dq4 + row + dqk_, dqpe + (t * q + hd) * dr_);
        std::copy(dk4 + row, dk4 + row + dn_, dkvb + (t * q + hd) * kvbw);
        std::copy(dv4 + row, dv4 + row + dv_, dkvb + (t * q + hd) * kvbw + dn_);
        for (int64_t j = 0; j < dr_; ++j) dkpe[t * dr_ + j] += dk4[row + dn_ + j];
      }
    }
  });
  const bool il = m_.rope_interleave;
  if (cp_) {
    rope_backward_at(q_pe_, cp_->positions(), cos_, sin_, il);
    rope_backward_at(k_pe_, cp_->positions(), cos_, sin_, il);
  } else {
    rope_backward(q_pe_, cos_, sin_, il);
    rope_backward(k_pe_, cos_, sin_, il);
  }
  linear_backward(ckv_, wkv_b_, dkvb_, dckv_, dwkv_b_);
  rmsnorm_backward(ckv_raw_, kv_a_norm_, ckv_rstd_, dckv_, dckv_raw_, dkv_a_norm_);
  dispatch_float(dy_TH.dtype(), [&]<class T>() {
    const T* dqpe = q_pe_.ptr<T>();
    const T* dkpe = k_pe_.ptr<T>();
    const T* dcraw = dckv_raw_.ptr<T>();
    T* dqr = dq_raw_.ptr<T>();
    T* dkva = dkv_a_.ptr<T>();
    for (int64_t t = 0; t < nt; ++t) {
      std::copy(dcraw + t * rkv_, dcraw + (t + 1) * rkv_, dkva + t * kvw);
      std::copy(dkpe + t * dr_, dkpe + (t + 1) * dr_, dkva + t * kvw + rkv_);
      for (int64_t hd = 0; hd < q; ++hd)
        std::copy(dqpe + (t * q + hd) * dr_, dqpe + (t * q + hd + 1) * dr_, dqr + (t * q + hd) * dqk_ + dn_);
    }
  });
  const Tensor dx_full = tp_ ? partial_ : dx_TH;
  if (rq_ > 0) {
    linear_backward(cq_, wq_b_, dq_raw_, dcq_, dwq_b_);
    rmsnorm_backward(cq_raw_, q_a_norm_, cq_rstd_, dcq_, dcq_raw_, dq_a_norm_);
    linear_backward(x_full_, wq_a_, dcq_raw_, dx_full, dwq_a_);
  } else {
    linear_backward(x_full_, wq_b_, dq_raw_, dx_full, dwq_b_);
  }
  linear_backward(x_full_, wkv_a_, dkv_a_, dx_part_, dwkv_a_);
  add_inplace(dx_full, dx_part_);
  if (tp_) tp_->reduce_scatter(dx_full, dx_TH, ReduceOp::sum);
}

}  // namespace moefold
