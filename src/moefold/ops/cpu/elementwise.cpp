// Elementwise helpers on whole contiguous float tensors: y += x, sum of squares, x *= s.
// No gradients: these serve gradient accumulation, clipping and the optimizer.
#include <cmath>
#include <span>
#include <utility>

#include "moefold/core/rng.h"
#include "moefold/ops/dispatch.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/elementwise.h"
#include "moefold/ops/cuda/optimizer.h"
#endif

namespace moefold {

void add_inplace(const ExecContext& ctx, const Tensor& y, const Tensor& x) {
  MF_ON_GPU(ctx, y, cuda::add_inplace(ctx, y, x));
  MF_CHECK(y.numel() == x.numel() && y.dtype() == x.dtype() && y.contiguous() && x.contiguous() &&
               y.device() == Device::cpu && x.device() == Device::cpu,
           "add_inplace: ", y.str(), " += ", x.str());
  const int64_t n = y.numel();
  dispatch_float(y.dtype(), [&]<class T>() {
    T* yp = y.ptr<T>();
    const T* xp = x.ptr<T>();
    for (int64_t i = 0; i < n; ++i) yp[i] += xp[i];
  });
}

void add_two_inplace(const ExecContext& ctx, const Tensor& y, const Tensor& a, const Tensor& b) {
  MF_ON_GPU(ctx, y, cuda::add_two_inplace(ctx, y, a, b));
  add_inplace(ctx, y, a);
  add_inplace(ctx, y, b);
}

double sum_squares(const ExecContext& ctx, const Tensor& x) {
  MF_ON_GPU(ctx, x, cuda::sum_squares(ctx, x));
  MF_CHECK(x.contiguous() && x.device() == Device::cpu, "sum_squares: ", x.str());
  const int64_t n = x.numel();
  return dispatch_float(x.dtype(), [&]<class T>() {
    const T* xp = x.ptr<T>();
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(xp[i]) * static_cast<double>(xp[i]);
    return s;
  });
}

void sum_squares_each(const ExecContext& ctx, std::span<const Tensor> xs, std::span<double> out) {
  MF_CHECK(xs.size() <= kMaxSumSquares && out.size() == xs.size(), "sum_squares_each: ", xs.size(), " tensors, ",
           out.size(), " results (at most ", kMaxSumSquares, ")");
  if (xs.empty()) return;
  for (const Tensor& x : xs)
    MF_CHECK(x.numel() == 0 || x.device() == xs.front().device(), "sum_squares_each: ", x.str(), " vs ",
             xs.front().str());
  MF_ON_GPU(ctx, xs.front(), cuda::sum_squares_each(ctx, xs, out));
  for (size_t i = 0; i < xs.size(); ++i) out[i] = sum_squares(ctx, xs[i]);
}

void mtp_loss_accumulate(const ExecContext& ctx, const Tensor& losses_D, int64_t seq_len, double scaling,
                         const Tensor& out_1) {
  MF_CHECK(losses_D.dtype() == DType::f64 && out_1.dtype() == DType::f64 && out_1.numel() == 1 &&
               losses_D.contiguous() && losses_D.numel() < seq_len && losses_D.device() == out_1.device(),
           "mtp_loss_accumulate: losses ", losses_D.str(), ", out ", out_1.str(), ", seq_len ", seq_len);
  MF_ON_GPU(ctx, out_1, cuda::mtp_loss_accumulate(ctx, losses_D, seq_len, scaling, out_1));
  const int64_t d_n = losses_D.numel();
  if (d_n == 0) return;
  const double* l = losses_D.ptr<double>();
  double s = 0;
  for (int64_t k = 1; k <= d_n; ++k) s += l[k - 1] * static_cast<double>(seq_len) / static_cast<double>(seq_len - k);
  out_1.ptr<double>()[0] += s * scaling / static_cast<double>(d_n);
}

void scale_inplace(const ExecContext& ctx, const Tensor& x, double s) {
  MF_ON_GPU(ctx, x, cuda::scale_inplace(ctx, x, s));
  MF_CHECK(x.contiguous() && x.device() == Device::cpu, "scale_inplace: ", x.str());
  const int64_t n = x.numel();
  dispatch_float(x.dtype(), [&]<class T>() {
    T* xp = x.ptr<T>();
    const T st = static_cast<T>(s);
    for (int64_t i = 0; i < n; ++i) xp[i] *= st;
  });
}

AdamWBatch::AdamWBatch(std::vector<AdamWEntry> entries) : entries_(std::move(entries)) {
  if (entries_.empty()) return;
  const AdamWEntry& e0 = entries_.front();
  for (const AdamWEntry& e : entries_) {
    MF_CHECK(e.w.device() == e0.w.device() && e.g.dtype() == e0.g.dtype() && e.m.dtype() == e0.m.dtype() &&
                 e.v.dtype() == e0.v.dtype() && e.compute.defined() == e0.compute.defined() &&
                 (!e.compute.defined() || e.compute.dtype() == e0.compute.dtype()),
             "AdamWBatch: entry w ", e.w.str(), " g ", e.g.str(), " m ", e.m.str(), " v ", e.v.str(),
             " unlike the first's");
    for (const Tensor* t : {&e.g, &e.m, &e.v})
      MF_CHECK(t->numel() == e.w.numel() && t->contiguous() && e.w.contiguous(), "AdamWBatch: ", t->str(), " vs w ",
               e.w.str());
    if (e.compute.defined()) MF_CHECK(e.compute.numel() == e.w.numel(), "AdamWBatch: compute copy ", e.compute.str());
  }
#ifdef MOEFOLD_WITH_CUDA
  if (e0.w.device() == Device::cuda) table_ = cuda::adamw_batch_table(entries_, &blocks_);
#endif
}

AdamWBatch::AdamWBatch(AdamWBatch&& o) noexcept
    : entries_(std::move(o.entries_)), table_(std::exchange(o.table_, nullptr)), blocks_(o.blocks_) {}

AdamWBatch& AdamWBatch::operator=(AdamWBatch&& o) noexcept {
  std::swap(entries_, o.entries_);
  std::swap(table_, o.table_);
  std::swap(blocks_, o.blocks_);
  return *this;
}

AdamWBatch::~AdamWBatch() {
#ifdef MOEFOLD_WITH_CUDA
  if (table_ != nullptr) cuda::adamw_batch_free(table_);
#endif
}

void AdamWBatch::update(const ExecContext& ctx, const AdamWStep& s) const {
#ifdef MOEFOLD_WITH_CUDA
  if (table_ != nullptr) {
    cuda::adamw_batch_update(ctx, entries_, table_, blocks_, s);
    return;
  }
#endif
  for (const AdamWEntry& e : entries_) {
    AdamWStep each = s;
    if (!e.decay) each.weight_decay = 0;
    adamw_update(ctx, e.w, e.g, e.m, e.v, each, e.compute);
  }
}

void adamw_update(const ExecContext& ctx, const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                  const AdamWStep& s, const Tensor& w_compute) {
  MF_ON_GPU(ctx, w, cuda::adamw_update(ctx, w, g, m, v, s, w_compute));
  for (const Tensor* t : {&g, &m, &v})
    MF_CHECK(t->shape() == w.shape() && t->contiguous() && t->device() == Device::cpu, "adamw_update: ", t->str(),
             " vs w ", w.str());
  MF_CHECK(g.dtype() == w.dtype(), "adamw_update: gradient ", g.str(), " vs w ", w.str());
  for (const Tensor* t : {&m, &v})  // the moments: the weights' dtype, or bf16 beside f32 weights
    MF_CHECK(t->dtype() == w.dtype() || (t->dtype() == DType::bf16 && w.dtype() == DType::f32), "adamw_update: moment ",
             t->str(), " vs w ", w.str(), " (the weights' dtype, or bf16 with f32 weights)");
  MF_CHECK(!w_compute.defined(), "adamw_update: a compute copy is a GPU feature");
  const int64_t n = w.numel();
  dispatch_float(w.dtype(), [&]<class T>() {
    T* wp = w.ptr<T>();
    const T* gp = g.ptr<T>();
    const T tb1 = static_cast<T>(s.beta1), tb2 = static_cast<T>(s.beta2);
    const T step_size = static_cast<T>(s.lr / s.bias_correction1);
    const T inv_sqrt_bc2 = static_cast<T>(1.0 / std::sqrt(s.bias_correction2));
    const T wd = static_cast<T>(1.0 - s.lr * s.weight_decay), teps = static_cast<T>(s.eps);
    const T gs = static_cast<T>(s.grad_scale);
    // A moment is read into T and stored back in its own dtype (bf16: rounded to nearest even);
    // the weight's update uses the unrounded values, as the CUDA kernel does.
    auto load = [](const Tensor& t, int64_t j) -> T {
      if (t.dtype() == DType::bf16) return static_cast<T>(bf16_to_f32(static_cast<const uint16_t*>(t.data())[j]));
      return t.ptr<T>()[j];
    };
    auto store = [](const Tensor& t, int64_t j, T x) {
      if (t.dtype() == DType::bf16)
        static_cast<uint16_t*>(t.data())[j] = f32_to_bf16(static_cast<float>(x));
      else
        t.ptr<T>()[j] = x;
    };
    for (int64_t j = 0; j < n; ++j) {
      const T gj = gp[j] * gs;
      const T mj = tb1 * load(m, j) + (T(1) - tb1) * gj;
      const T vj = tb2 * load(v, j) + (T(1) - tb2) * gj * gj;
      store(m, j, mj);
      store(v, j, vj);
      wp[j] = wp[j] * wd - step_size * mj / (std::sqrt(vj) * inv_sqrt_bc2 + teps);
    }
  });
}

void fill_normal_any(const ExecContext& ctx, const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std,
                     uint64_t first_index) {
  MF_ON_GPU(ctx, t, cuda::fill_normal(ctx, t, seed, stream, mean, std, first_index));
  fill_normal(t, seed, stream, mean, std, first_index);
}

void cast(const ExecContext& ctx, const Tensor& src, const Tensor& dst) {
  MF_CHECK(src.numel() == dst.numel() && src.contiguous() && dst.contiguous() && src.device() == dst.device(),
           "cast: ", src.str(), " -> ", dst.str());
  MF_ON_GPU(ctx, src, cuda::cast(ctx, src, dst));
  MF_CHECK(src.device() == Device::cpu, "cast: ", src.str());
  const int64_t n = src.numel();
  auto load = [&](int64_t i) -> double {
    if (src.dtype() == DType::bf16) return bf16_to_f32(static_cast<const uint16_t*>(src.data())[i]);
    return dispatch_float(src.dtype(), [&]<class T>() { return static_cast<double>(src.ptr<T>()[i]); });
  };
  if (dst.dtype() == DType::bf16) {
    for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst.data())[i] = f32_to_bf16(static_cast<float>(load(i)));
    return;
  }
  dispatch_float(dst.dtype(), [&]<class T>() {
    for (int64_t i = 0; i < n; ++i) dst.ptr<T>()[i] = static_cast<T>(load(i));
  });
}

}  // namespace moefold
