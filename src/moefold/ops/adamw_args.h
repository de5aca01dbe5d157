// AdamW's per-step constants in f32, derived from AdamWStep one way for the GPU kernel
// (ops/cuda/optimizer.cu) and the host update (ops/cpu/adamw_host.cpp): both then round every
// operation on its own (no fused multiply-adds), in the same order, so they give the same bits.
#pragma once

#include <cmath>

#include "moefold/ops/ops.h"

namespace moefold {

struct AdamWArgs {
  float b1, omb1, b2, omb2, step_size, inv_sqrt_bc2, wd, eps, gs;
};

inline AdamWArgs adamw_args(const AdamWStep& s) {
  const float b1 = static_cast<float>(s.beta1), b2 = static_cast<float>(s.beta2);
  return AdamWArgs{b1,
                   1.0f - b1,
                   b2,
                   1.0f - b2,
                   static_cast<float>(s.lr / s.bias_correction1),
                   static_cast<float>(1.0 / std::sqrt(s.bias_correction2)),
                   static_cast<float>(1.0 - s.lr * s.weight_decay),
                   static_cast<float>(s.eps),
                   static_cast<float>(s.grad_scale)};
}

}  // namespace moefold
