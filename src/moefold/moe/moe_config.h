// Configuration of one MoE layer (the [moe] config section), keys named as Hugging Face names
// them where a name exists. validate() names the field that is wrong.
#pragma once

#include <cstdint>
#include <string>

#include "moefold/ops/moe_ops.h"  // ScoreFunc, TopkRouting (ops sit below moe)

namespace moefold {

struct MoeConfig {
  int64_t num_experts = 8;                      // E, routed experts per MoE layer
  int64_t num_experts_per_tok = 2;              // K, experts each token is sent to
  int64_t moe_intermediate_size = 128;          // F, FFN width of one expert
  ScoreFunc scoring_func = ScoreFunc::softmax;  // router scores from logits
  bool norm_topk_prob = true;                   // renormalise the k selected probabilities to sum 1
  double routed_scaling_factor = 1.0;           // multiplies the (renormalised) top-k probabilities
  double aux_loss_coeff = 1e-2;                 // Switch/GShard load-balancing loss weight (HF: router_aux_loss_coef)
  double z_loss_coeff = 0.0;                    // router z-loss weight (ST-MoE)
  double router_init_std = 0.0;                 // the gate's init std; 0: the model's initializer_range
  double capacity_factor = 0.0;                 // <= 0: dropless; else capacity = ceil(cf * T * K / E) per expert
  bool pad_to_capacity = false;                 // with a capacity: every expert gets exactly `capacity` rows
  int64_t n_group = 1;                          // DeepSeek-V3 group-limited routing: contiguous expert groups
  int64_t topk_group = 1;                       // groups each token may route into (the best by top-2 sum)
  bool expert_bias = false;                     // aux-loss-free balancing: selection bias gate.e_score_correction_bias
  double expert_bias_update_rate = 1e-3;        // bias step per update (Megatron: moe_router_bias_update_rate)
  double seq_aux_loss_coeff = 0.0;              // sequence-level load-balancing loss weight (DeepSeek-V3 eq. 17)
  int64_t n_shared_experts = 0;  // DeepSeek-V3 shared experts: one dense MLP of n * moe_intermediate_size
  // The shared experts on a second execution context (a CUDA stream of their own) beside the
  // routed experts' router, dispatch, experts and combine, joined before their output (and their
  // input gradient) is added: the same ops in the same order, so the same bits (Megatron-Core's
  // moe_shared_expert_overlap). Needs n_shared_experts > 0 and no tensor parallelism.
  bool shared_expert_overlap = false;
  // Under mixed precision, the router's logits GEMM: false multiplies the bf16 input by the bf16
  // copy of the gate with fp32 accumulation into fp32 logits (tensor cores); true multiplies fp32
  // copies of both (Megatron-Core's moe_router_dtype=fp32; ~10x slower on an H200). Scores, top-k,
  // losses and the gate's gradient are fp32 either way.
  bool router_fp32_gemm = false;
  // Expert parallelism (AllToAllDispatcher): each EP peer's rows travel in this many pieces, so
  // that the all-to-all of one piece runs while the experts compute another (1: one per peer).
  int64_t ep_overlap_chunks = 2;
  // Expert parallelism: the rows one rank's experts can receive per micro-batch, as a multiple of
  // the average (T x K: every rank's tokens spread evenly); 0: the worst case (every peer's
  // tokens on this rank's experts, P x T x min(K, L): P times the average). Every expert
  // activation buffer follows it. A dispatch that would exceed it fails on every rank of the EP
  // group with one line naming this key (checked at the counts exchange).
  double ep_recv_factor = 0;
  // FP8 dispatch (with train.fp8 = blockwise and the experts in FP8): each token is quantized once
  // (1 x 128 tiles along H, the experts' fc1 operand) before the permutation and travels to the
  // experts as FP8 codes plus scales (half the bytes of bf16); fc1 reads them as they are, its
  // weight gradient requantizes their values along the rows. The combine and every gradient stay
  // in the model's dtype (as DeepEP).
  bool fp8_dispatch = false;
  // The expert-parallel dispatcher: "alltoall" (every (token, expert) assignment travels to its
  // expert's rank; AllToAllDispatcher) or "hierarchical" (HierarchicalDispatcher: a token crosses
  // to another node once, carrying its experts there, and fans out over the node's fast links;
  // the combine sums within the node before the result crosses back).
  std::string dispatcher = "alltoall";

  // Throws moefold::Error naming the offending key ("moe.num_experts_per_tok = 9 must be <=
  // moe.num_experts = 8").
  void validate() const;
  // Rows per expert under a capacity factor for T tokens (0 when dropless).
  int64_t capacity(int64_t num_tokens) const;
  // Upper bound on dispatched rows for T tokens: T*K dropless, else min(T*K, E*capacity) (or
  // E*capacity exactly with padding).
  int64_t max_rows(int64_t num_tokens) const;
  // The router's score -> top-k probability settings (no bias: the Router adds its parameter).
  TopkRouting routing() const {
    return {scoring_func, norm_topk_prob, routed_scaling_factor, n_group, topk_group, Tensor{}};
  }
};

}  // namespace moefold
