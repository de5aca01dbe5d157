// The CUDA permutation plan of ops/moe_ops.h (permute_plan.cu): the same name and contract, in
// namespace moefold::cuda; ops/cpu/permute_plan.cpp dispatches here for CUDA tensors. topk_idx
// i32, topk_prob f32, every plan tensor i64, all contiguous CUDA tensors. Integer arithmetic
// only: the plan is bit-identical to the CPU op's. Only in the CUDA build.
// Shapes and the dtypes both devices share are checked once, by the CPU entry point before it
// dispatches here; these ops check what only the GPU needs (device, contiguity, GPU-only dtypes,
// sizes that must fit an int, launch and shared-memory limits).
#pragma once

#include <cstdint>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/moe_ops.h"

namespace moefold::cuda {

// Waits for the GPU once: R, and the index checks, come back to the host, which checks the
// indices like the CPU op (an expert index E or more, a token routed twice; a negative one is an empty slot). Takes
// scratch (ScratchSlot::permute_plan). REQUIRES: T*K < 2^31, E <= 12288.
// wait = false: returns the R the caller knows (T*K dropless, E*capacity padded) without waiting;
// a kernel then checks the indices and R and traps where they fail.
int64_t moe_permute_plan(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK,
                         int64_t capacity, bool pad, const PermutePlanOut& out, bool wait);

}  // namespace moefold::cuda
