// The CUDA implementations of ops/ops.h and ops/moe_ops.h: the same functions, names and
// contracts (shapes, WRITTEN/ACCUMULATED rules), in namespace moefold::cuda, for tensors on the
// GPU. The ops in ops/cpu/*.cpp dispatch here when their tensors are CUDA tensors, so callers
// never name a backend. Storage dtypes: float32 and bfloat16 (bf16 activations and weights with
// float32 accumulation; router logits and scores, statistics such as rstd and lse in float32),
// as each declaration below says. Every op runs on the stream of the execution context it is
// given (core/exec.h). Only in the CUDA build (MOEFOLD_WITH_CUDA).
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/ops.h"

namespace moefold::cuda {

// ---- elementwise (elementwise.cu): f32 or bf16, accumulation in f32 -----------------------------
void add_inplace(const ExecContext& ctx, const Tensor& y, const Tensor& x);
double sum_squares(const ExecContext& ctx, const Tensor& x);  // waits for the GPU (returns a host value)
void cast(const ExecContext& ctx, const Tensor& src, const Tensor& dst);
// ops.h fill_normal_any on the GPU (f32 or bf16, contiguous).
void fill_normal(const ExecContext& ctx, const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std,
                 uint64_t first_index);  // f32 <-> bf16 (or equal dtypes: a copy)
void scale_inplace(const ExecContext& ctx, const Tensor& x, double s);

// ---- AdamW (optimizer.cu): w, g, m, v f32; w_compute (optional) bf16 or f32 ---------------------
void adamw_update(const ExecContext& ctx, const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWStep& s,
                  const Tensor& w_compute);

}  // namespace moefold::cuda
