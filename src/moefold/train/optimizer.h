// AdamW with decoupled weight decay (Loshchilov & Hutter, 2019) and fp32 (compute-dtype)
// state, global-norm gradient clipping, and the warmup + cosine learning-rate schedule.
// Weight decay is skipped for parameters registered with decay = false (norms, biases).
#pragma once

#include <cstdint>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/model/config.h"

namespace moefold {

class AdamW {
 public:
  explicit AdamW(const TrainConfig& cfg) : cfg_(cfg) {}

  // Reserves first and second moments for every parameter (zero-initialised).
  void bind(const ExecContext& ctx, const std::vector<Param>& params);
  // One update with learning rate `lr` from the gradients times grad_scale (clip_factor: global-
  // norm clipping in the same pass, the gradients themselves left as they are); increments step().
  void step(std::vector<Param>& params, double lr, double grad_scale = 1.0);

  int64_t num_steps() const { return steps_; }
  void set_num_steps(int64_t t) { steps_ = t; }
  // exp_avg / exp_avg_sq of parameter i (same order as bind's params).
  const Tensor& exp_avg(size_t i) const { return exp_avg_[i]; }
  const Tensor& exp_avg_sq(size_t i) const { return exp_avg_sq_[i]; }

 private:
  const ExecContext* ctx_ = nullptr;  // where the update runs (bind)
  TrainConfig cfg_;
  Arena arena_;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  int64_t steps_ = 0;
};

// The global-norm clipping factor: min(1, max_norm / (norm + 1e-6)) when max_norm > 0, else 1.
double clip_factor(double norm, double max_norm);
// Scales every gradient by clip_factor(norm, max_norm); returns the factor.
double clip_grad_norm(const ExecContext& ctx, std::vector<Param>& params, double norm, double max_norm);

// Learning rate for optimizer step `step` (0-based): linear warmup to cfg.lr over
// cfg.warmup_steps, then cosine decay to cfg.min_lr at cfg.steps, constant min_lr after.
double learning_rate(const TrainConfig& cfg, int64_t step);

}  // namespace moefold
