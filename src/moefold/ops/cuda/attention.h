// The CUDA side of causal grouped-query attention (ops/ops.h, "causal grouped-query attention";
// kernels in attention.cu): the same contracts as the CPU ops, for CUDA tensors. The CPU ops in
// ops/cpu/attention.cpp dispatch here when q is a CUDA tensor.
// Dtypes: q, k, v, out, dout, dq, dk, dv all float32 or all bfloat16 (one dtype per call); lse is
// float32 whatever the activations; positions are int32; every tensor contiguous on the GPU.
// Head dims 1..256. Compute is float32 throughout (scores, softmax, P and dS stay float; bf16 only
// at the loads and the final stores). Flash-attention tiling: S x S is never materialised, so the
// CPU API's work_* scratch is NOT used on the GPU (the CPU entry points do not pass it on; any
// tensor, even an empty one, may be given there) and these ops need no workspace at all.
// Backward is deterministic (no atomics): one pass over key tiles writes dk/dv (summing the Q/G
// query heads of each kv head in a fixed order), a second pass over query tiles writes dq.
// Gradient rule: dq, dk, dv WRITTEN. No host synchronisation.
#pragma once

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

// out_BSQD = softmax(q k^T * scale + causal mask) v; lse_BQS (f32) the natural-log log-sum-exp of
// each row of scale * q k^T over its visible keys.
void attention_forward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                       double scale, const Tensor& out_BSQD, const Tensor& lse_BQS);
// REQUIRES: out_BSQD and lse_BQS are those of attention_forward on the same q, k, v, scale.
void attention_backward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                        const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& dout_BSQD, double scale,
                        const Tensor& dq_BSQD, const Tensor& dk_BSGD, const Tensor& dv_BSGD);

// Explicit positions (i32 CUDA tensors q_pos_Sq, k_pos_Sk, any order): query i attends key j iff
// k_pos[j] <= q_pos[i]. The ops' REQUIRES that every query sees at least one key is NOT checked
// here (it would need the positions on the host); a query that sees no key gets out = 0,
// lse = -inf and zero gradients.
void attention_forward_at(const ExecContext& ctx, const Tensor& q_BSqQD, const Tensor& k_BSkGD, const Tensor& v_BSkGD,
                          const Tensor& q_pos_Sq, const Tensor& k_pos_Sk, double scale, const Tensor& out_BSqQD,
                          const Tensor& lse_BQSq);
void attention_backward_at(const ExecContext& ctx, const Tensor& q_BSqQD, const Tensor& k_BSkGD, const Tensor& v_BSkGD,
                           const Tensor& q_pos_Sq, const Tensor& k_pos_Sk, const Tensor& out_BSqQD,
                           const Tensor& lse_BQSq, const Tensor& dout_BSqQD, double scale, const Tensor& dq_BSqQD,
                           const Tensor& dk_BSkGD, const Tensor& dv_BSkGD);

}  // namespace moefold::cuda
