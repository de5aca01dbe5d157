// The CUDA token embedding of ops/ops.h (embedding.cu), and its shard form for vocabulary
// parallelism (parallel/vocab_parallel.cpp): the same names and contracts, in namespace
// moefold::cuda; ops/cpu/embedding.cpp dispatches here for CUDA tensors. Gradient rule: dtable
// ACCUMULATED. Every tensor a contiguous CUDA tensor; ops run on the context's stream and never
// synchronise the host. Only in the CUDA build.
// Ids are validated on the device: an id outside its range aborts the kernel (__trap), which
// poisons the CUDA context so that the next CUDA call fails; the host cannot check them without
// a synchronisation.
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

// ids i32; table and out of one dtype (f32 or bf16).
void embedding_forward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& table_VC, const Tensor& out_NC);
// dout f32 or bf16; dtable of dout's dtype or f32. Deterministic without atomics: the first
// occurrence of each id owns its row of dtable and adds up every occurrence in token order, so
// repeated ids are exact and the result is bit-identical run to run. Costs O(N^2) i32 compares
// (ids stay in L2) and ceil(N / 2048) * 264 bytes of shared memory per block. REQUIRES: that fits
// the device's opt-in shared memory per block (N up to 1.8M tokens on H100/H200). A very
// frequent id is summed by one block, so heavy skew (one id in most tokens) is slow.
void embedding_backward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& dout_NC, const Tensor& dtable_VC);
// The same for a shard of the table: rows [vocab_offset, vocab_offset + Vl) of the vocabulary
// (vocabulary parallelism). ids are global, >= 0; an id outside the shard gives a zero row
// (forward) and no gradient (backward). With an f32 dtable both backwards equal the CPU's
// token-order sums bit for bit.
void embedding_shard_forward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& table_VlC, int64_t vocab_offset,
                             const Tensor& out_NC);
void embedding_shard_backward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& dout_NC, int64_t vocab_offset,
                              const Tensor& dtable_VlC);

}  // namespace moefold::cuda
