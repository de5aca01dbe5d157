// MlaAttention forward/backward in terms of ops/ops.h; see mla.h. The head-wise assembly of q, k
// and v (split, pad) is strided copies of matrix views (ops, so it runs on either device; one
// fused kernel would save launches on the GPU).
#include "moefold/model/mla.h"

#include <algorithm>
#include <cmath>

#include "moefold/core/profile.h"
#include "moefold/ops/fp8.h"
#include "moefold/ops/ops.h"

namespace moefold {

namespace {
// rows x cols of `t`'s memory with row stride ld, from element `offset`.
MatrixView view(const Tensor& t, int64_t rows, int64_t cols, int64_t ld, int64_t offset) {
  return MatrixView{t, rows, cols, ld, offset};
}
}  // namespace

int64_t MlaAttention::core_head_dim(const ModelConfig& m) {
  return std::max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim);
}

MlaAttention::MlaAttention(const ModelConfig& m, int64_t batch, int64_t seq_len, std::string prefix,
                           double softmax_scale)
    : cfg_(m),
      batch_(batch),
      seq_len_(seq_len),
      tokens_(batch * seq_len),
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
  ctx_ = &mem.exec();
  const int64_t h = cfg_.hidden_size, n = tp ? tp->size() : 1, r = tp ? tp->rank() : 0;
  tp_ = n > 1 ? tp : nullptr;
  qh_ = cfg_.num_attention_heads / n;
  const int64_t q = qh_, nt = tokens_;
  const double std = cfg_.initializer_range;
  const ParamGroup tpg = ParamGroup::tensor_parallel;
  auto grad = [&](const char* name) { return mem.grad(prefix_ + name); };
  if (rq_ > 0) {
    wq_a_ = fp8_wq_a_.param(mem, {.name = prefix_ + ".q_a_proj.weight", .shape = {rq_, h}, .init_std = std}, fp8_qkv_);
    q_a_norm_ =
        mem.param({.name = prefix_ + ".q_a_layernorm.weight", .shape = {rq_}, .init = Init::ones, .decay = false});
    wq_b_ = fp8_wq_b_.param(mem,
                            {.name = prefix_ + ".q_b_proj.weight",
                             .shape = {q * dqk_, rq_},
                             .init_std = std,
                             .group = tpg,
                             .shard_offset = r * q * dqk_,
                             .global_rows = n * q * dqk_},
                            fp8_qkv_);
    dwq_a_ = grad(".q_a_proj.weight");
    dq_a_norm_ = grad(".q_a_layernorm.weight");
    dwq_b_ = grad(".q_b_proj.weight");
  } else {
    wq_b_ = fp8_wq_b_.param(mem,
                            {.name = prefix_ + ".q_proj.weight",
                             .shape = {q * dqk_, h},
                             .init_std = std,
                             .group = tpg,
                             .shard_offset = r * q * dqk_,
                             .global_rows = n * q * dqk_},
                            fp8_qkv_);
    dwq_b_ = grad(".q_proj.weight");
  }
  wkv_a_ = fp8_wkv_a_.param(
      mem, {.name = prefix_ + ".kv_a_proj_with_mqa.weight", .shape = {rkv_ + dr_, h}, .init_std = std}, fp8_qkv_);
  kv_a_norm_ =
      mem.param({.name = prefix_ + ".kv_a_layernorm.weight", .shape = {rkv_}, .init = Init::ones, .decay = false});
  wkv_b_ = fp8_wkv_b_.param(mem,
                            {.name = prefix_ + ".kv_b_proj.weight",
                             .shape = {q * (dn_ + dv_), rkv_},
                             .init_std = std,
                             .group = tpg,
                             .shard_offset = r * q * (dn_ + dv_),
                             .global_rows = n * q * (dn_ + dv_)},
                            fp8_qkv_);
  wo_ = fp8_wo_.param(mem,
                      {.name = prefix_ + ".o_proj.weight",
                       .shape = {h, q * dv_},
                       .init_std = std,
                       .group = tpg,
                       .global_rows = h,
                       .dim_shard = n > 1 ? DimShard{1, r * q * dv_, n * q * dv_, 1} : DimShard{}},
                      fp8_proj_);
  dwkv_a_ = grad(".kv_a_proj_with_mqa.weight");
  dkv_a_norm_ = grad(".kv_a_layernorm.weight");
  dwkv_b_ = grad(".kv_b_proj.weight");
  dwo_ = grad(".o_proj.weight");
  cp_ = cp;
  cos_ = cp ? cos_SD : cos_SD.slice(0, seq_len_);
  sin_ = cp ? sin_SD : sin_SD.slice(0, seq_len_);
  work_ = scratch->work_2SS;
  x_gathered_TH_ = offload_qkv_ ? mem.offloaded({tp_ ? nt : 0, h}) : mem.act({tp_ ? nt : 0, h});
  cq_raw_ = mem.act({nt, rq_});
  cq_ = mem.act({nt, rq_});
  cq_rstd_ = mem.act({rq_ > 0 ? nt : 0}, mem.master_dtype());
  kv_a_ = mem.act({nt, rkv_ + dr_});
  ckv_raw_ = mem.act({nt, rkv_});
  ckv_ = mem.act({nt, rkv_});
  ckv_rstd_ = mem.act({nt}, mem.master_dtype());
  {  // recomputed from the latents before backward (mla_up_proj)
    auto take = [&](Shape shape) { return recompute_up_proj_ ? mem.scratch(shape) : mem.act(shape); };
    auto core_input = [&](Shape shape) {  // also offloadable (core_attn)
      return recompute_up_proj_ ? mem.scratch(shape) : offload_core_ ? mem.offloaded(shape) : mem.act(shape);
    };
    q_raw_ = take({nt, q * dqk_});
    kvb_ = take({nt, q * (dn_ + dv_)});
    q_pe_ = take({batch_, seq_len_, q, dr_});
    k_pe_ = take({batch_, seq_len_, 1, dr_});
    q4_ = core_input({batch_, seq_len_, q, dp_});
    k4_ = core_input({batch_, seq_len_, q, dp_});
    v4_ = core_input({batch_, seq_len_, q, dp_});
  }
  {  // recomputed from q, k, v before backward (core_attn)
    auto take = [&](Shape shape, DType dtype, bool offload) {
      return recompute_core_ ? mem.scratch(shape, dtype)
             : offload       ? mem.offloaded(shape, dtype)
                             : mem.act(shape, dtype);
    };
    out4_ = take({batch_, seq_len_, q, dp_}, mem.dtype(), offload_core_);
    lse_ = take({batch_, q, seq_len_}, mem.master_dtype(), offload_core_);
    o_in_ = take({nt, q * dv_}, mem.dtype(), offload_proj_);
  }
  dy_full_ = mem.scratch({tp_ ? nt : 0, h});
  do_in_ = mem.scratch({nt, q * dv_});
  dout4_ = mem.scratch({batch_, seq_len_, q, dp_});
  dq4_ = mem.scratch({batch_, seq_len_, q, dp_});
  dk4_ = mem.scratch({batch_, seq_len_, q, dp_});
  dv4_ = mem.scratch({batch_, seq_len_, q, dp_});
  dq_raw_ = mem.scratch({nt, q * dqk_});
  dcq_ = mem.scratch({nt, rq_});
  dcq_raw_ = mem.scratch({nt, rq_});
  dkvb_ = mem.scratch({nt, q * (dn_ + dv_)});
  dckv_ = mem.scratch({nt, rkv_});
  dckv_raw_ = mem.scratch({nt, rkv_});
  dkv_a_ = mem.scratch({nt, rkv_ + dr_});
  dx_part_ = mem.scratch({nt, h});
  partial_ = mem.scratch({tp_ ? nt : 0, h});
  x_fp8_.bytes = fp8_qkv_ ? mem.scratch({fp8_shared_operand_bytes(nt, h)}, DType::u8) : Tensor();
}

void MlaAttention::forward(const Tensor& x_TH, const Tensor& y_TH) {
  const int64_t nt = tokens_, kvw = rkv_ + dr_;
  x_full_ = x_TH;
  if (tp_) {
    x_full_ = x_gathered_TH_;
    tp_->all_gather(x_TH, x_full_);
  }
  x_fp8_.reset();
  if (rq_ > 0) {
    linear_forward_in(*ctx_, fp8_wq_a_.get(), x_full_, wq_a_, cq_raw_, &x_fp8_);
    rmsnorm_forward(*ctx_, cq_raw_, q_a_norm_, cfg_.rms_norm_eps, cq_, cq_rstd_);
  }
  linear_forward_in(*ctx_, fp8_wkv_a_.get(), x_full_, wkv_a_, kv_a_, &x_fp8_);
  // kv_a = [latent, rotary key]: the latent normed.
  copy_matrix(*ctx_, view(kv_a_, nt, rkv_, kvw, 0), view(ckv_raw_, nt, rkv_, rkv_, 0));
  rmsnorm_forward(*ctx_, ckv_raw_, kv_a_norm_, cfg_.rms_norm_eps, ckv_, ckv_rstd_);
  up_forward();
  core_forward();
  if (tp_) {
    linear_forward_in(*ctx_, fp8_wo_.get(), o_in_, wo_, partial_);
    tp_->reduce_scatter(partial_, y_TH, ReduceOp::sum);
  } else {
    linear_forward_in(*ctx_, fp8_wo_.get(), o_in_, wo_, y_TH);
  }
}

void MlaAttention::up_forward() {
  const int64_t q = qh_, nt = tokens_, kvw = rkv_ + dr_, kvbw = dn_ + dv_;
  if (rq_ > 0)
    linear_forward_in(*ctx_, fp8_wq_b_.get(), cq_, wq_b_, q_raw_);
  else
    linear_forward_in(*ctx_, fp8_wq_b_.get(), x_full_, wq_b_, q_raw_, &x_fp8_);
  // The rotary key and every query head's rotary part, rotated; k_nope and v from the latent.
  copy_matrix(*ctx_, view(kv_a_, nt, dr_, kvw, rkv_), view(k_pe_, nt, dr_, dr_, 0));
  copy_matrix(*ctx_, view(q_raw_, nt * q, dr_, dqk_, dn_), view(q_pe_, nt * q, dr_, dr_, 0));
  linear_forward_in(*ctx_, fp8_wkv_b_.get(), ckv_, wkv_b_, kvb_);
  const bool il = cfg_.rope_interleave;
  if (cp_) {
    rope_forward_at(*ctx_, q_pe_, cp_->positions(), cos_, sin_, il);
    rope_forward_at(*ctx_, k_pe_, cp_->positions(), cos_, sin_, il);
  } else {
    rope_forward(*ctx_, q_pe_, cos_, sin_, il);
    rope_forward(*ctx_, k_pe_, cos_, sin_, il);
  }
  // Heads for the core: q = [q_nope, q_rot], k = [k_nope, k_rot (shared)], v, each padded with
  // zeros up to dp_ (written every time: the buffers may be workspace other layers use).
  if (dp_ > dqk_) {
    fill_matrix(*ctx_, view(q4_, nt * q, dp_ - dqk_, dp_, dqk_), 0);
    fill_matrix(*ctx_, view(k4_, nt * q, dp_ - dqk_, dp_, dqk_), 0);
  }
  if (dp_ > dv_) fill_matrix(*ctx_, view(v4_, nt * q, dp_ - dv_, dp_, dv_), 0);
  copy_matrix(*ctx_, view(q_raw_, nt * q, dn_, dqk_, 0), view(q4_, nt * q, dn_, dp_, 0));
  copy_matrix(*ctx_, view(q_pe_, nt * q, dr_, dr_, 0), view(q4_, nt * q, dr_, dp_, dn_));
  copy_matrix(*ctx_, view(kvb_, nt * q, dn_, kvbw, 0), view(k4_, nt * q, dn_, dp_, 0));
  for (int64_t hd = 0; hd < q; ++hd)
    copy_matrix(*ctx_, view(k_pe_, nt, dr_, dr_, 0), view(k4_, nt, dr_, q * dp_, hd * dp_ + dn_));
  copy_matrix(*ctx_, view(kvb_, nt * q, dv_, kvbw, dn_), view(v4_, nt * q, dv_, dp_, 0));
}

void MlaAttention::core_forward() {
  const int64_t q = qh_, nt = tokens_;
  {
    ProfileScope scope("attention core forward");
    if (cp_)
      cp_->forward(q4_, k4_, v4_, scale_, out4_, lse_);
    else
      attention_forward(*ctx_, q4_, k4_, v4_, scale_, out4_, lse_, work_.slice(0, seq_len_ * seq_len_));
  }
  copy_matrix(*ctx_, view(out4_, nt * q, dv_, dp_, 0), view(o_in_, nt * q, dv_, dv_, 0));
}

void MlaAttention::backward(const Tensor& dy_TH, const Tensor& dx_TH) {
  const int64_t q = qh_, nt = tokens_, kvw = rkv_ + dr_, kvbw = dn_ + dv_;
  x_fp8_.reset();  // the forward's operand (or this scratch's bytes) is gone
  if (recompute_up_proj_) {
    ProfileScope scope("recompute mla up projections");
    up_forward();
  }
  if (recompute_core_) {
    ProfileScope scope("recompute attention core");
    core_forward();
  }
  Tensor dy = dy_TH;
  if (tp_) {
    dy = dy_full_;
    tp_->all_gather(dy_TH, dy);
  }
  linear_backward_in(*ctx_, fp8_wo_.get(), o_in_, wo_, dy, do_in_, dwo_);
  if (dp_ > dv_) fill_matrix(*ctx_, view(dout4_, nt * q, dp_ - dv_, dp_, dv_), 0);  // workspace: zero padding
  copy_matrix(*ctx_, view(do_in_, nt * q, dv_, dv_, 0), view(dout4_, nt * q, dv_, dp_, 0));
  {
    ProfileScope scope("attention core backward");
    if (cp_)
      cp_->backward(q4_, k4_, v4_, out4_, lse_, dout4_, scale_, dq4_, dk4_, dv4_);
    else
      attention_backward(*ctx_, q4_, k4_, v4_, out4_, lse_, dout4_, scale_, dq4_, dk4_, dv4_, work_);
  }
  // Split the core's gradients back: q_nope and q_rot (per head), k_nope and v (into kv_b's
  // output), k_rot summed over the heads (one shared rotary key).
  copy_matrix(*ctx_, view(dq4_, nt * q, dn_, dp_, 0), view(dq_raw_, nt * q, dn_, dqk_, 0));
  copy_matrix(*ctx_, view(dq4_, nt * q, dr_, dp_, dn_), view(q_pe_, nt * q, dr_, dr_, 0));  // q_pe_ now holds d(q_rot)
  copy_matrix(*ctx_, view(dk4_, nt * q, dn_, dp_, 0), view(dkvb_, nt * q, dn_, kvbw, 0));
  copy_matrix(*ctx_, view(dv4_, nt * q, dv_, dp_, 0), view(dkvb_, nt * q, dv_, kvbw, dn_));
  copy_matrix(*ctx_, view(dk4_, nt, dr_, q * dp_, dn_), view(k_pe_, nt, dr_, dr_, 0));  // k_pe_ now holds d(k_rot)
  for (int64_t hd = 1; hd < q; ++hd)
    add_matrix(*ctx_, view(dk4_, nt, dr_, q * dp_, hd * dp_ + dn_), view(k_pe_, nt, dr_, dr_, 0));
  const bool il = cfg_.rope_interleave;
  if (cp_) {
    rope_backward_at(*ctx_, q_pe_, cp_->positions(), cos_, sin_, il);
    rope_backward_at(*ctx_, k_pe_, cp_->positions(), cos_, sin_, il);
  } else {
    rope_backward(*ctx_, q_pe_, cos_, sin_, il);
    rope_backward(*ctx_, k_pe_, cos_, sin_, il);
  }
  linear_backward_in(*ctx_, fp8_wkv_b_.get(), ckv_, wkv_b_, dkvb_, dckv_, dwkv_b_);
  rmsnorm_backward(*ctx_, ckv_raw_, kv_a_norm_, ckv_rstd_, dckv_, dckv_raw_, dkv_a_norm_);
  copy_matrix(*ctx_, view(dckv_raw_, nt, rkv_, rkv_, 0), view(dkv_a_, nt, rkv_, kvw, 0));
  copy_matrix(*ctx_, view(k_pe_, nt, dr_, dr_, 0), view(dkv_a_, nt, dr_, kvw, rkv_));
  copy_matrix(*ctx_, view(q_pe_, nt * q, dr_, dr_, 0), view(dq_raw_, nt * q, dr_, dqk_, dn_));
  const Tensor dx_full = tp_ ? partial_ : dx_TH;
  if (rq_ > 0) {
    linear_backward_in(*ctx_, fp8_wq_b_.get(), cq_, wq_b_, dq_raw_, dcq_, dwq_b_);
    rmsnorm_backward(*ctx_, cq_raw_, q_a_norm_, cq_rstd_, dcq_, dcq_raw_, dq_a_norm_);
    linear_backward_in(*ctx_, fp8_wq_a_.get(), x_full_, wq_a_, dcq_raw_, dx_full, dwq_a_, &x_fp8_);
  } else {
    linear_backward_in(*ctx_, fp8_wq_b_.get(), x_full_, wq_b_, dq_raw_, dx_full, dwq_b_, &x_fp8_);
  }
  linear_backward_in(*ctx_, fp8_wkv_a_.get(), x_full_, wkv_a_, dkv_a_, dx_part_, dwkv_a_, &x_fp8_);
  add_inplace(*ctx_, dx_full, dx_part_);
  if (tp_) tp_->reduce_scatter(dx_full, dx_TH, ReduceOp::sum);
}

}  // namespace moefold
