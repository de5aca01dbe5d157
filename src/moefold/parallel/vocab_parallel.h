// Vocabulary parallelism for tensor parallelism (Megatron-LM's VocabParallelEmbedding and
// vocab_parallel_cross_entropy; Shoeybi et al. 2019, sec. 3): each TP rank holds a contiguous
// slice [vocab_offset, vocab_offset + Vl) of the vocabulary, of the embedding table and of the
// output logits, so neither the table nor the N x V logits are ever materialised whole.
// Gradient rules: dtable ACCUMULATED (+=), dlogits WRITTEN (as in ops.h).
// Shape letters: N rows (tokens), C channels, Vl vocabulary entries held by this rank.
//
// Devices and dtypes: every tensor of a call (ids and targets included) on one device.
//  - CPU: table and rows of one dtype, f32 or f64; logits, dlogits and lse of one dtype, f32 or f64.
//  - CUDA (the shard ops of ops/cuda/embedding.h and cross_entropy.h): table and out_partial of
//    one dtype, f32 or bf16; dout f32 or bf16 and dtable of dout's dtype or f32 (mixed
//    precision: bf16 rows, the f32 master gradient); logits and dlogits of one dtype, f32 or
//    bf16, read and computed in f32; lse ALWAYS f32, as in ops/cuda (a bf16 lse near 10 is off by
//    up to 0.03, i.e. 3% in every probability of the backward); the scratch in device memory
//    (bound through a CUDA Memory).
//    Ids and targets are validated on the device (__trap, as in ops/cuda/embedding.h).
#pragma once

#include <cstdint>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"

namespace moefold {

// ---- embedding --------------------------------------------------------------------------------
// out_partial_NC[n] = table_shard_VlC[ids_N[n] - vocab_offset] when the id falls inside this
// rank's shard, else ZERO. No communication: the caller sums the partials over the TP group
// (all_reduce, or reduce_scatter over rows with sequence parallelism).
// ids are i32 GLOBAL ids; REQUIRES: ids >= 0, vocab_offset >= 0.
void vocab_parallel_embedding_forward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& table_shard_VlC,
                                      int64_t vocab_offset, const Tensor& out_partial_NC);
// dout_NC: the full gradient of these N tokens' embeddings (after the backward of the caller's
// all_reduce / reduce_scatter, i.e. identical on every TP rank). Only rows whose id falls inside
// the shard are accumulated into dtable_shard_VlC. Repeated ids are added in token order on both
// devices (CUDA: without atomics, the first token of an id owns its row, as in
// ops/cuda/embedding.cu, whose shard kernels serve both), so the result is deterministic; with an
// f32 dtable the CUDA result is the CPU's bit for bit. CUDA cost: O(N^2) id compares per shard.
void vocab_parallel_embedding_backward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& dout_NC,
                                       int64_t vocab_offset, const Tensor& dtable_shard_VlC);

// ---- cross-entropy ------------------------------------------------------------------------------
// Per-row reduction buffers of the forward, float64 whatever the compute dtype (the plain
// cross_entropy_forward also reduces rows in double, so TP = 1 reproduces it bit for bit).
// Bind twice through Memory (measuring, then real), like every other workspace.
struct VocabParallelScratch {
  Tensor max_N;     // f64 [max_rows]: the row max, all-reduced with max
  Tensor sums_2N1;  // f64 [2 * max_rows + 1]: sum of exp | target logit | rows whose target was found
  Tensor result_2;  // f64 [2]: the loss sum and the found count (CUDA: the one copy to the host)
  int64_t max_rows = 0;

  void bind(Memory& mem, int64_t max_rows);
};

// Collective over `tp` (every TP rank calls it with its own logits shard and the same targets).
// Numerically stable over the whole vocabulary: one all_reduce(max) of the N row maxima, then one
// all_reduce(sum) of [sum_j exp(logit_j - max) | the target logit picked by its owner | a count
// of rows whose target some rank owned]; the count must equal N (a target outside every shard,
// or shards that overlap, abort here instead of silently giving a wrong loss).
// Returns the SUM over rows of lse - logit[target], the same value on every TP rank; writes the
// global log-sum-exp of each row to lse_N (CPU: logits' dtype; CUDA: f32) for the backward.
// Ignored rows (kIgnoreTarget): no loss, lse 0, counted as found on TP rank 0 only.
// CUDA: row sums of f32 exps in f64, the row losses summed on the device in a fixed order
// (deterministic); WAITS for the GPU once, for one copy of the loss and the found count. With one
// rank the all-reduces are skipped (the identity).
// REQUIRES: targets i32 in [0, V) of the global vocabulary, N <= scratch.max_rows, Vl > 0.
double vocab_parallel_cross_entropy_forward(const ExecContext& ctx, Communicator& tp, const Tensor& logits_shard_NVl,
                                            int64_t vocab_offset, const Tensor& targets_N, const Tensor& lse_N,
                                            const VocabParallelScratch& scratch);
// dlogits_shard = grad_scale * (softmax - onehot(target)) on this rank's columns, from the saved
// global lse: no communication. WRITTEN; may be the logits tensor itself (in place).
void vocab_parallel_cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_shard_NVl, int64_t vocab_offset,
                                           const Tensor& targets_N, const Tensor& lse_N, double grad_scale,
                                           const Tensor& dlogits_shard_NVl);

}  // namespace moefold
