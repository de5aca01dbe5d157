// Model FLOPs per token of one forward pass, by part: the one count behind model_size()'s
// train_flops_per_token (moefold info, bench train, the trainer's TFLOP/s) and the performance
// model's per-op times (train/perf_model.h), so the two never disagree. Defined in model_size.cpp.
#pragma once

#include <cstdint>

#include "moefold/model/config.h"

namespace moefold {

// 2 FLOPs per multiply-add of every weight a token passes through; the causal attention core counts
// QK^T and PV each halved by the mask. Training is 3 x the forward; recomputation is not counted.
struct ModelFlops {
  double attn_proj = 0;       // per decoder layer: q/k/v/o projections (MLA: down and up projections)
  double attn_core = 0;       // per decoder layer: QK^T and PV at the given sequence length
  double router = 0;          // per MoE layer: the gate's logits
  double experts = 0;         // per MoE layer: the K routed experts' SwiGLU MLPs
  double shared_experts = 0;  // per MoE layer: the shared experts' MLP
  double dense_mlp = 0;       // per dense layer (first_k_dense_replace, mlp_only_layers)
  double lm_head = 0;         // the output projection, once (and once more per MTP depth)
  double mtp_proj = 0;        // per MTP depth: eh_proj (its decoder layer counts as one MoE layer)
  int64_t moe_layers = 0, dense_layers = 0, mtp_depth = 0;

  double attention() const { return attn_proj + attn_core; }
  double moe() const { return router + experts + shared_experts; }
  // One forward of the whole model, MTP modules included.
  double forward() const;
};

ModelFlops model_flops(const ModelConfig& m, const MoeConfig& e, int64_t seq_len);

}  // namespace moefold
