// The CUDA AdamW update of ops/ops.h (optimizer.cu): the same contract (AdamWStep), in namespace
// moefold::cuda, for tensors on the GPU; ops/cpu/elementwise.cpp dispatches here for CUDA tensors.
// w, g, m, v f32 (fp32 master weights and moments); w_compute (optional) bf16 or f32. Runs on the
// context's stream. Only in the CUDA build.
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/ops.h"  // AdamWStep

namespace moefold::cuda {

void adamw_update(const ExecContext& ctx, const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                  const AdamWStep& s, const Tensor& w_compute);

}  // namespace moefold::cuda
