// The CUDA node routing ops of ops/moe_ops.h (node_route.cu): the same names and contracts, in
// namespace moefold::cuda; ops/cpu/node_route.cpp dispatches here for CUDA tensors. Indices i32 /
// i64 as there, probabilities f32; all contiguous CUDA tensors. Integer arithmetic and copies
// only: the results are bit-identical to the CPU ops'. The ops only enqueue work (a place outside
// its tensor stops the kernel with a printed message and a device trap). Only in the CUDA build.
#pragma once

#include <cstdint>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

void moe_node_route(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& keep_row_TK,
                    int64_t experts_per_node, const Tensor& node_idx_TK, const Tensor& slot_TK);
void moe_node_meta(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK,
                   const Tensor& node_idx_TK, const Tensor& slot_TK, const Tensor& node_row_TK,
                   int64_t experts_per_node, const Tensor& meta_idx_RS, const Tensor& meta_prob_RS,
                   const Tensor& assign_TK);
void moe_node_meta_backward(const ExecContext& ctx, const Tensor& dmeta_RS, const Tensor& assign_TK,
                            const Tensor& dprob_TK);

}  // namespace moefold::cuda
