// The CUDA softmax cross-entropy of ops/ops.h (cross_entropy.cu): the same names and contracts, in
// namespace moefold::cuda; ops/cpu/cross_entropy.cpp dispatches here for CUDA tensors. Also the
// phases of the vocabulary-parallel cross-entropy, between which parallel/vocab_parallel.cpp
// all-reduces over its TP group (ops may not depend on comm). Gradient rule: dlogits WRITTEN.
// logits f32 or bf16, computed in f32; lse f32; targets i32. Every tensor a contiguous CUDA
// tensor. Only in the CUDA build.
// Targets are validated on the device: a target outside [0, V) other than kIgnoreTarget aborts
// the kernel (__trap), which poisons the CUDA context so that the next CUDA call fails.
#pragma once

#include <cstdint>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

// logits [N, V]; targets (kIgnoreTarget: no loss, lse 0). One block per row with an online max /
// sum-exp over the vocabulary in float32 (16-byte loads when V and the pointers allow, element by
// element otherwise); the row losses are summed in float64 in a fixed order (deterministic). WAITS
// for the GPU and returns the host sum of row losses, or with loss_1 (a CUDA f64 [1]) writes the
// sum there and returns NaN without waiting (uses the context's scratch: N + 1 doubles).
double cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N,
                             const Tensor& lse_N, const Tensor& loss_1);
// dlogits in the logits' dtype, WRITTEN (ignored rows zero); may be the logits tensor itself
// (in place: each element is read before it is written, by the same thread).
void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N,
                            const Tensor& lse_N, double grad_scale, const Tensor& dlogits_NV);

// ---- vocabulary-parallel shards (parallel/vocab_parallel.h) -------------------------------------
// This rank holds columns [vocab_offset, vocab_offset + Vl) of the logits. The forward runs as
// row_max, all_reduce(max) of row_max_N, sums, all_reduce(sum) of sums_2N1, finish. One block per
// row (N <= INT32_MAX, checked), rows read in 16-byte packs when Vl and the pointers allow.
// row_max_N and sums_2N1 (f64 [N] and [2N + 1], N = logits rows) are the caller's device buffers.
// REQUIRES: arguments the vocab-parallel entry points checked; N > 0; Vl > 0.

// row_max_N[i] = the max of row i's logits on this rank (exact: a logit, held in double).
void cross_entropy_shard_row_max(const ExecContext& ctx, const Tensor& logits_shard_NVl, const Tensor& row_max_N);
// With the global row max: sums_2N1[i] = sum_j exp(x_j - max) over this rank's columns (f32 exps,
// added in f64), sums_2N1[N + i] = the target logit where this rank owns the target (else 0), and
// sums_2N1[2N] = the rows whose target this rank owns (written: the count is zeroed first), plus
// the ignored rows where count_ignored (TP rank 0 only; their sum is 1, their logit 0). The count
// is an integer in double, added exactly.
void cross_entropy_shard_sums(const ExecContext& ctx, const Tensor& logits_shard_NVl, const Tensor& targets_N,
                              const Tensor& row_max_N, int64_t vocab_offset, bool count_ignored,
                              const Tensor& sums_2N1);
struct CrossEntropyShardTotals {
  double loss;   // sum over rows of lse - logit[target]
  double found;  // rows whose target some rank owned (must be N)
};
// From the all-reduced row max and sums: lse_N[i] = max + log(sum) (0 for ignored rows), and the
// loss (row losses summed on the device in a fixed order) and found count, through the device
// buffer result_2 (f64 [2]). WAITS for the GPU once, for that one copy.
CrossEntropyShardTotals cross_entropy_shard_finish(const ExecContext& ctx, const Tensor& targets_N,
                                                   const Tensor& row_max_N, const Tensor& sums_2N1, const Tensor& lse_N,
                                                   const Tensor& result_2);
// dlogits_shard = grad_scale * (softmax - onehot(target)) on this rank's columns from the global
// lse (f32, the CPU's expression); WRITTEN, ignored rows zero; may be the logits tensor itself.
void cross_entropy_shard_backward(const ExecContext& ctx, const Tensor& logits_shard_NVl, int64_t vocab_offset,
                                  const Tensor& targets_N, const Tensor& lse_N, double grad_scale,
                                  const Tensor& dlogits_shard_NVl);

}  // namespace moefold::cuda
