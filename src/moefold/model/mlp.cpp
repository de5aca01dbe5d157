// DenseMlp forward/backward: two GEMMs write gate and up side by side into one [N, 2F] buffer
// (leading dimension 2F), so the fused SwiGLU op runs on it unchanged.
#include "moefold/model/mlp.h"

#include "moefold/ops/gemm.h"
#include "moefold/ops/ops.h"

namespace moefold {

DenseMlp::DenseMlp(int64_t hidden, int64_t ffn, int64_t rows, int64_t tokens, std::string prefix, double init_std)
    : h_(hidden), ffn_(ffn), t_(rows), n_(tokens), prefix_(std::move(prefix)), init_std_(init_std) {
  MF_CHECK(hidden >= 1 && ffn >= 1 && rows >= 0 && tokens >= rows, "DenseMlp: hidden ", hidden, ", ffn ", ffn,
           ", rows ", rows, ", tokens ", tokens);
}

void DenseMlp::bind(Memory& mem, Communicator* tp) {
  const int64_t n = tp ? tp->size() : 1, r = tp ? tp->rank() : 0;
  MF_CHECK(ffn_ % n == 0 && n_ == t_ * n, prefix_, ": F ", ffn_, ", rows ", t_, " over ", n, " TP ranks");
  tp_ = n > 1 ? tp : nullptr;
  f_ = ffn_ / n;
  const ParamGroup tpg = ParamGroup::tensor_parallel;
  gate_FH_ = mem.param(prefix_ + ".gate_proj.weight", {f_, h_}, Init::normal, init_std_, true, tpg, r * f_, ffn_);
  up_FH_ = mem.param(prefix_ + ".up_proj.weight", {f_, h_}, Init::normal, init_std_, true, tpg, r * f_, ffn_);
  down_HF_ = mem.param(prefix_ + ".down_proj.weight", {h_, f_}, Init::normal, init_std_, true, tpg, 0, h_,
                       n > 1 ? DimShard{1, r * f_, ffn_, 1} : DimShard{});
  dgate_FH_ = mem.grad(prefix_ + ".gate_proj.weight");
  dup_FH_ = mem.grad(prefix_ + ".up_proj.weight");
  ddown_HF_ = mem.grad(prefix_ + ".down_proj.weight");
  x_gathered_NH_ = mem.act({tp_ ? n_ : 0, h_});
  gu_N2F_ = mem.act({n_, 2 * f_});
  h_NF_ = mem.act({n_, f_});
  dy_full_NH_ = mem.act({tp_ ? n_ : 0, h_});
  dh_NF_ = mem.act({n_, f_});
  dgu_N2F_ = mem.act({n_, 2 * f_});
  partial_NH_ = mem.act({tp_ ? n_ : 0, h_});
}

void DenseMlp::forward(const Tensor& x_TH, const Tensor& y_TH) {
  check_shape(x_TH, {t_, h_}, "DenseMlp x");
  check_shape(y_TH, {t_, h_}, "DenseMlp y");
  x_full_ = x_TH;
  if (tp_) {
    x_full_ = x_gathered_NH_;
    tp_->all_gather(x_TH, x_full_);
  }
  const int64_t n = n_, f = f_, h = h_;
  const Tensor y = tp_ ? partial_NH_ : y_TH;
  dispatch_float(x_TH.dtype(), [&]<class T>() {
    T* gu = gu_N2F_.ptr<T>();
    const T* x = x_full_.ptr<T>();
    // gu[:, :F] = x @ gate^T, gu[:, F:] = x @ up^T
    gemm<T>(false, true, n, f, h, T(1), x, h, gate_FH_.ptr<T>(), h, T(0), gu, 2 * f);
    gemm<T>(false, true, n, f, h, T(1), x, h, up_FH_.ptr<T>(), h, T(0), gu + f, 2 * f);
  });
  swiglu_forward(gu_N2F_, h_NF_);
  linear_forward(h_NF_, down_HF_, y);
  if (tp_) tp_->reduce_scatter(partial_NH_, y_TH, ReduceOp::sum);
}

void DenseMlp::backward(const Tensor& dy_TH, const Tensor& dx_TH) {
  check_shape(dy_TH, {t_, h_}, "DenseMlp dy");
  check_shape(dx_TH, {t_, h_}, "DenseMlp dx");
  Tensor dy = dy_TH;
  if (tp_) {
    dy = dy_full_NH_;
    tp_->all_gather(dy_TH, dy);
  }
  linear_backward(h_NF_, down_HF_, dy, dh_NF_, ddown_HF_);
  swiglu_backward(gu_N2F_, dh_NF_, dgu_N2F_);
  const Tensor dx = tp_ ? partial_NH_ : dx_TH;
  const int64_t n = n_, f = f_, h = h_;
  dispatch_float(dy_TH.dtype(), [&]<class T>() {
    const T* dgu = dgu_N2F_.ptr<T>();
    const T* x = x_full_.ptr<T>();
    // dgate += dgu[:, :F]^T x; dup += dgu[:, F:]^T x; dx = dgu[:, :F] gate + dgu[:, F:] up
    gemm<T>(true, false, f, h, n, T(1), dgu, 2 * f, x, h, T(1), dgate_FH_.ptr<T>(), h);
    gemm<T>(true, false, f, h, n, T(1), dgu + f, 2 * f, x, h, T(1), dup_FH_.ptr<T>(), h);
    gemm<T>(false, false, n, h, f, T(1), dgu, 2 * f, gate_FH_.ptr<T>(), h, T(0), dx.ptr<T>(), h);
    gemm<T>(false, false, n, h, f, T(1), dgu + f, 2 * f, up_FH_.ptr<T>(), h, T(1), dx.ptr<T>(), h);
  });
  if (tp_) tp_->reduce_scatter(partial_NH_, dx_TH, ReduceOp::sum);
}

}  // namespace moefold
