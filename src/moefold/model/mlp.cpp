// DenseMlp forward/backward: gate and up written side by side into one [N, 2F] buffer (one GEMM
// where their weights lie back to back, else two into column blocks of leading dimension 2F), so
// the fused SwiGLU op runs on it unchanged. Every step is an op, so the layer runs wherever its
// tensors are (CPU or GPU).
#include "moefold/model/mlp.h"

#include "moefold/core/profile.h"
#include "moefold/ops/fp8.h"
#include "moefold/ops/ops.h"

namespace moefold {

namespace {
// a and b as one [2 x rows, cols] matrix where they lie back to back in memory (the Memory lays
// out gate and up, and their gradients, in binding order), else undefined: then two GEMMs.
Tensor stacked(const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined() || a.dtype() != b.dtype() || a.device() != b.device() || !(a.shape() == b.shape()) ||
      a.shape().ndim != 2 || static_cast<const char*>(a.data()) + a.nbytes() != b.data())
    return {};
  return Tensor(a.data(), a.dtype(), {2 * a.size(0), a.size(1)}, a.device());
}
}  // namespace

DenseMlp::DenseMlp(int64_t hidden, int64_t ffn, int64_t rows, int64_t tokens, std::string prefix, double init_std)
    : hidden_(hidden), ffn_(ffn), rows_(rows), tokens_(tokens), prefix_(std::move(prefix)), init_std_(init_std) {
  MF_CHECK(hidden >= 1 && ffn >= 1 && rows >= 0 && tokens >= rows, "DenseMlp: hidden ", hidden, ", ffn ", ffn,
           ", rows ", rows, ", tokens ", tokens);
}

void DenseMlp::bind(Memory& mem, Communicator* tp, const ExecContext* on) {
  ctx_ = on ? on : &mem.exec();
  MF_CHECK(on == nullptr || tp == nullptr || tp->size() == 1, prefix_,
           ": tensor parallelism's collectives order with the Memory's context, not another");
  const int64_t n = tp ? tp->size() : 1, r = tp ? tp->rank() : 0;
  MF_CHECK(ffn_ % n == 0 && tokens_ == rows_ * n, prefix_, ": F ", ffn_, ", rows ", rows_, " over ", n, " TP ranks");
  tp_ = n > 1 ? tp : nullptr;
  ffn_here_ = ffn_ / n;
  const ParamGroup tpg = ParamGroup::tensor_parallel;
  gate_FH_ = fp8_gate_.param(mem,
                             {.name = prefix_ + ".gate_proj.weight",
                              .shape = {ffn_here_, hidden_},
                              .init_std = init_std_,
                              .group = tpg,
                              .shard_offset = r * ffn_here_,
                              .global_rows = ffn_},
                             fp8_);
  up_FH_ = fp8_up_.param(mem,
                         {.name = prefix_ + ".up_proj.weight",
                          .shape = {ffn_here_, hidden_},
                          .init_std = init_std_,
                          .group = tpg,
                          .shard_offset = r * ffn_here_,
                          .global_rows = ffn_},
                         fp8_);
  down_HF_ = fp8_down_.param(mem,
                             {.name = prefix_ + ".down_proj.weight",
                              .shape = {hidden_, ffn_here_},
                              .init_std = init_std_,
                              .group = tpg,
                              .global_rows = hidden_,
                              .dim_shard = n > 1 ? DimShard{1, r * ffn_here_, ffn_, 1} : DimShard{}},
                             fp8_);
  dgate_FH_ = mem.grad(prefix_ + ".gate_proj.weight");
  dup_FH_ = mem.grad(prefix_ + ".up_proj.weight");
  ddown_HF_ = mem.grad(prefix_ + ".down_proj.weight");
  {
    const Memory::ScratchActs recomputed(mem, recompute_);
    x_gathered_NH_ = mem.act({tp_ ? tokens_ : 0, hidden_});
    gu_N2F_ = mem.act({tokens_, 2 * ffn_here_});
    h_NF_ = mem.act({tokens_, ffn_here_});
  }
  dy_full_NH_ = mem.scratch({tp_ ? tokens_ : 0, hidden_});
  dh_NF_ = mem.scratch({tokens_, ffn_here_});
  dgu_N2F_ = mem.scratch({tokens_, 2 * ffn_here_});
  partial_NH_ = mem.scratch({tp_ ? tokens_ : 0, hidden_});
  y_TH_ = mem.scratch({recompute_ ? rows_ : 0, hidden_});
  dx_up_NH_ = mem.scratch({fp8_ ? tokens_ : 0, hidden_});
}

void DenseMlp::fp8_gate_up_forward() {
  // h is free until the SwiGLU writes it.
  fp8_linear_forward(*ctx_, x_full_, gate_FH_, h_NF_, fp8_gate_.get(ctx_));
  copy_matrix(*ctx_, as_matrix(h_NF_), column_block(gu_N2F_, 0, ffn_here_));
  fp8_linear_forward(*ctx_, x_full_, up_FH_, h_NF_, fp8_up_.get(ctx_));
  copy_matrix(*ctx_, as_matrix(h_NF_), column_block(gu_N2F_, ffn_here_, 2 * ffn_here_));
}

void DenseMlp::fp8_gate_up_backward(const Tensor& dx) {
  // dh is free once the SwiGLU's backward has read it.
  copy_matrix(*ctx_, column_block(dgu_N2F_, 0, ffn_here_), as_matrix(dh_NF_));
  fp8_linear_backward(*ctx_, x_full_, gate_FH_, dh_NF_, dx, dgate_FH_, true, fp8_gate_.get(ctx_));
  copy_matrix(*ctx_, column_block(dgu_N2F_, ffn_here_, 2 * ffn_here_), as_matrix(dh_NF_));
  fp8_linear_backward(*ctx_, x_full_, up_FH_, dh_NF_, dx_up_NH_, dup_FH_, true, fp8_up_.get(ctx_));
  add_inplace(*ctx_, dx, dx_up_NH_);
}

void DenseMlp::forward(const Tensor& x_TH, const Tensor& y_TH) {
  check_shape(x_TH, {rows_, hidden_}, "DenseMlp x");
  check_shape(y_TH, {rows_, hidden_}, "DenseMlp y");
  x_in_ = x_TH;
  x_full_ = x_TH;
  if (tp_) {
    x_full_ = x_gathered_NH_;
    tp_->all_gather(x_TH, x_full_);
  }
  const Tensor y = tp_ ? partial_NH_ : y_TH;
  // gu[:, :F] = x @ gate^T, gu[:, F:] = x @ up^T
  if (fp8_) {
    fp8_gate_up_forward();
  } else if (const Tensor gate_up = stacked(gate_FH_, up_FH_); gate_up.defined()) {  // one GEMM, N = 2F
    matmul(*ctx_, as_matrix(x_full_), false, as_matrix(gate_up), true, as_matrix(gu_N2F_), 1, 0);
  } else {
    matmul(*ctx_, as_matrix(x_full_), false, as_matrix(gate_FH_), true, column_block(gu_N2F_, 0, ffn_here_), 1, 0);
    matmul(*ctx_, as_matrix(x_full_), false, as_matrix(up_FH_), true, column_block(gu_N2F_, ffn_here_, 2 * ffn_here_),
           1, 0);
  }
  swiglu_forward(*ctx_, gu_N2F_, h_NF_);
  linear_forward_in(*ctx_, fp8_down_.get(ctx_), h_NF_, down_HF_, y);
  if (tp_) tp_->reduce_scatter(partial_NH_, y_TH, ReduceOp::sum);
}

void DenseMlp::backward(const Tensor& dy_TH, const Tensor& dx_TH) {
  check_shape(dy_TH, {rows_, hidden_}, "DenseMlp dy");
  check_shape(dx_TH, {rows_, hidden_}, "DenseMlp dx");
  if (recompute_) {
    ProfileScope scope("recompute mlp forward");
    forward(x_in_, y_TH_);
  }
  Tensor dy = dy_TH;
  if (tp_) {
    dy = dy_full_NH_;
    tp_->all_gather(dy_TH, dy);
  }
  linear_backward_in(*ctx_, fp8_down_.get(ctx_), h_NF_, down_HF_, dy, dh_NF_, ddown_HF_);
  swiglu_backward(*ctx_, gu_N2F_, dh_NF_, dgu_N2F_);
  const Tensor dx = tp_ ? partial_NH_ : dx_TH;
  if (fp8_) {
    fp8_gate_up_backward(dx);
    if (tp_) tp_->reduce_scatter(partial_NH_, dx_TH, ReduceOp::sum);
    return;
  }
  // dgate += dgu[:, :F]^T x; dup += dgu[:, F:]^T x; dx = dgu[:, :F] gate + dgu[:, F:] up: where
  // gate and up (and their gradients) are one [2F, H] matrix, one GEMM each with N or K = 2F (dx
  // then rounded once, not after each half).
  const MatrixView dg = column_block(dgu_N2F_, 0, ffn_here_), du = column_block(dgu_N2F_, ffn_here_, 2 * ffn_here_);
  if (const Tensor dgate_up = stacked(dgate_FH_, dup_FH_); dgate_up.defined()) {
    matmul(*ctx_, as_matrix(dgu_N2F_), true, as_matrix(x_full_), false, as_matrix(dgate_up), 1, 1);
  } else {
    matmul(*ctx_, dg, true, as_matrix(x_full_), false, as_matrix(dgate_FH_), 1, 1);
    matmul(*ctx_, du, true, as_matrix(x_full_), false, as_matrix(dup_FH_), 1, 1);
  }
  if (const Tensor gate_up = stacked(gate_FH_, up_FH_); gate_up.defined()) {
    matmul(*ctx_, as_matrix(dgu_N2F_), false, as_matrix(gate_up), false, as_matrix(dx), 1, 0);
  } else {
    matmul(*ctx_, dg, false, as_matrix(gate_FH_), false, as_matrix(dx), 1, 0);
    matmul(*ctx_, du, false, as_matrix(up_FH_), false, as_matrix(dx), 1, 1);
  }
  if (tp_) tp_->reduce_scatter(partial_NH_, dx_TH, ReduceOp::sum);
}

}  // namespace moefold
