// The CUDA elementwise helpers of ops/ops.h (elementwise.cu): the same functions, names and
// contracts, in namespace moefold::cuda, for tensors on the GPU; ops/cpu/elementwise.cpp
// dispatches here for CUDA tensors. Storage f32 or bf16, accumulation in f32. Every op runs on the
// stream of the execution context it is given (core/exec.h). Only in the CUDA build. No gradients.
#pragma once

#include <span>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

void add_inplace(const ExecContext& ctx, const Tensor& y, const Tensor& x);
void add_two_inplace(const ExecContext& ctx, const Tensor& y, const Tensor& a, const Tensor& b);
void mtp_loss_accumulate(const ExecContext& ctx, const Tensor& losses_D, int64_t seq_len, double scaling,
                         const Tensor& out_1);
double sum_squares(const ExecContext& ctx, const Tensor& x);  // waits for the GPU (returns a host value)
void sum_squares_each(const ExecContext& ctx, std::span<const Tensor> xs, std::span<double> out);  // one wait
void cast(const ExecContext& ctx, const Tensor& src, const Tensor& dst);  // f32 <-> bf16 (or equal dtypes: a copy)
// ops.h fill_normal_any on the GPU (f32 or bf16, contiguous).
void fill_normal(const ExecContext& ctx, const Tensor& t, uint64_t seed, uint64_t stream, double mean, double std,
                 uint64_t first_index);
void scale_inplace(const ExecContext& ctx, const Tensor& x, double s);

}  // namespace moefold::cuda
