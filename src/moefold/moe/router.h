// Router: logits = x @ gate^T, scores and top-k (moe_ops.h), and the two auxiliary losses it
// owns (load balancing and z-loss), already multiplied by their coefficients.
// Gradient rule: dgate accumulated; dx ADDED to (the router is a branch off the layer input,
// which the dispatcher's backward writes first).
// Shape letters: T tokens, H hidden, E experts, K top-k.
#pragma once

#include <cstdint>
#include <string>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/moe/moe_config.h"

namespace moefold {

class Router {
 public:
  // REQUIRES: cfg.validate() passes. prefix: e.g. "model.layers.3.mlp".
  Router(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, std::string prefix, double init_std);

  // "<prefix>.gate.weight" [E, H] (Qwen3-MoE's name) and the saved activations. Logits, scores
  // and probabilities use the compute dtype: fp32 on the CPU (f64 in gradient checks).
  void bind(Memory& mem);

  // Computes logits, scores, top-k, the per-expert counts and the two losses for x_TH.
  void forward(const Tensor& x_TH);
  // The ranks that split each micro-batch's sequences with this one (context parallelism): the
  // aux and z losses are then computed over the whole micro-batch, this rank returning its share
  // (null or size 1: this rank's tokens are the micro-batch). REQUIRES: every rank of the group
  // routes as many tokens. Not owned.
  void set_token_group(Communicator* group) { token_group_ = group; }
  // dprob_TK: gradient of the main loss w.r.t. topk_prob. Adds loss_scale * (aux_loss_coeff *
  // d aux + z_loss_coeff * d z) to the logit gradient; dgate accumulated; dx_TH += dlogits @ gate.
  // REQUIRES: the same x_TH as forward.
  void backward(const Tensor& x_TH, const Tensor& dprob_TK, double loss_scale, const Tensor& dx_TH);

  // Views of the last forward (T rows).
  const Tensor& logits() const { return logits_; }
  const Tensor& scores() const { return scores_; }
  const Tensor& topk_idx() const { return topk_idx_; }           // i32 [T, K]
  const Tensor& topk_prob() const { return topk_prob_; }         // [T, K]
  const Tensor& tokens_per_expert() const { return counts_E_; }  // i64 [E], before capacity dropping
  double aux_loss() const { return aux_loss_; }                  // aux_loss_coeff * aux
  double z_loss() const { return z_loss_; }                      // z_loss_coeff * z

 private:
  MoeConfig cfg_;
  int64_t hidden_, max_tokens_;
  std::string prefix_;
  double init_std_;
  Tensor gate_EH_, dgate_EH_;
  Tensor logits_buf_, scores_buf_, idx_buf_, prob_buf_, dlogits_buf_, dextra_buf_, counts_E_;
  Tensor group_counts_E_;  // counts_E_ summed over the token group
  Communicator* token_group_ = nullptr;
  int64_t total_tokens_ = 0;  // tokens of the micro-batch over the token group
  Tensor logits_, scores_, topk_idx_, topk_prob_;
  double aux_loss_ = 0, z_loss_ = 0;
};

}  // namespace moefold
