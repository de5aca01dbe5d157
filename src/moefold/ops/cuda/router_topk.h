// The CUDA router scores and top-k of ops/moe_ops.h (router_topk.cu): the same names and
// contracts, in namespace moefold::cuda; ops/cpu/router_topk.cpp dispatches here for CUDA
// tensors. Gradient rule: dlogits WRITTEN. Every tensor a contiguous CUDA tensor; logits, scores,
// topk_prob, dprob and dlogits f32 only (the router math stays fp32, docs/architecture.md "Backends"),
// TopkRouting::bias_E f32, topk_idx i32. Both ops only enqueue work. Only in the CUDA build.
// Numerics: the forward computes scores and the selection in f32 with the CPU reference's
// operation order for each score (a correctly rounded exp, IEEE add and divide), so selection
// matches the CPU op run in f32 except on choices within an ulp of each other; the backward
// computes per-token sums and their products in f64 and rounds once to f32. Deterministic.
// Shapes and the dtypes both devices share are checked once, by the CPU entry point before it
// dispatches here; these ops check what only the GPU needs (device, contiguity, GPU-only dtypes,
// sizes that must fit an int, launch and shared-memory limits).
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/moe_ops.h"

namespace moefold::cuda {

// One warp per token. REQUIRES: E <= 1024, K <= 32 (DeepSeek-V3: E 256, K 8).
void router_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const TopkRouting& routing,
                         const Tensor& scores_TE, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK);
// REQUIRES: K <= 32. An expert index outside [0, E) stops the kernel with a printed message and a
// device trap: the next CUDA call fails.
void router_topk_backward(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& topk_idx_TK,
                          const TopkRouting& routing, const Tensor& dprob_TK, const Tensor& dlogits_TE);

}  // namespace moefold::cuda
