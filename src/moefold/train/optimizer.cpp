#include "moefold/train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "moefold/ops/ops.h"

namespace moefold {

void AdamW::bind(const ExecContext& ctx, const std::vector<Param>& params) {
  ctx_ = &ctx;
  if (!params.empty()) arena_.set_device(params.front().value.device());  // moments beside the weights
  auto take_all = [&] {
    exp_avg_.clear();
    exp_avg_sq_.clear();
    for (const Param& p : params) {
      exp_avg_.push_back(arena_.take(p.value.dtype(), p.value.shape()));
      exp_avg_sq_.push_back(arena_.take(p.value.dtype(), p.value.shape()));
    }
  };
  take_all();  // measure
  arena_.allocate();
  take_all();
}

void AdamW::step(std::vector<Param>& params, double lr, double grad_scale) {
  MF_CHECK(params.size() == exp_avg_.size(), "optimizer bound to ", exp_avg_.size(), " parameters, stepping ",
           params.size());
  ++steps_;
  const double b1 = cfg_.adam_beta1, b2 = cfg_.adam_beta2, eps = cfg_.adam_eps;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(steps_));
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = params[i];
    const AdamWStep s{lr, b1, b2, eps, p.decay ? cfg_.weight_decay : 0.0, bc1, bc2, grad_scale};
    // With mixed precision the pass also refreshes the bf16 compute copy.
    adamw_update(*ctx_, p.value, p.grad, exp_avg_[i], exp_avg_sq_[i], s,
                 p.compute.data() != p.value.data() ? p.compute : Tensor());
  }
}

double clip_factor(double norm, double max_norm) {
  if (!(max_norm > 0)) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

double clip_grad_norm(const ExecContext& ctx, std::vector<Param>& params, double norm, double max_norm) {
  const double f = clip_factor(norm, max_norm);
  if (f < 1.0)
    for (Param& p : params) scale_inplace(ctx, p.grad, f);
  return f;
}

double learning_rate(const TrainConfig& c, int64_t step) {
  if (step < c.warmup_steps) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  const int64_t decay_steps = c.steps - c.warmup_steps;
  if (decay_steps <= 0 || step >= c.steps) return c.min_lr;
  const double progress = static_cast<double>(step - c.warmup_steps) / static_cast<double>(decay_steps);
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace moefold
