// Router: logits = x @ gate^T, scores and top-k (moe_ops.h) with DeepSeek-V3's selection bias and
// group-limited routing, and the auxiliary losses it owns (load balancing, sequence-level load
// balancing, z-loss), already multiplied by their coefficients.
// Gradient rule: dgate accumulated; dx ADDED to (the router is a branch off the layer input,
// which the dispatcher's backward writes first); the selection bias gets no gradient.
// Shape letters: T tokens, H hidden, E experts, K top-k, B sequences.
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

  // "<prefix>.gate.weight" [E, H] (Qwen3-MoE's name), with cfg.expert_bias also
  // "<prefix>.gate.e_score_correction_bias" [E] (DeepSeek-V3's name), and the saved activations.
  // Logits, scores and probabilities use the master dtype: fp32 (f64 in gradient checks), also
  // under mixed precision, where the logits GEMM takes bf16 operands with fp32 accumulation unless
  // cfg.router_fp32_gemm (then fp32 copies of the input and the master gate).
  void bind(Memory& mem);

  // Computes logits, scores, top-k, the per-expert counts and the two losses for x_TH.
  void forward(const Tensor& x_TH);
  // The ranks that split each micro-batch's sequences with this one (context parallelism): the
  // aux and z losses are then computed over the whole micro-batch, this rank returning its share
  // (null or size 1: this rank's tokens are the micro-batch). REQUIRES: every rank of the group
  // routes as many tokens. Not owned.
  void set_token_group(Communicator* group) { token_group_ = group; }
  // How this rank's rows split into sequences, for the sequence-level aux loss (moe_ops.h,
  // SeqLayout): the micro-batch holds num_seqs sequences of full_seq_len tokens, local_seq_len of
  // each on this rank's token group (full_seq_len / cp) laid out sequence after sequence; this
  // rank's rows start at row_offset of that block (sequence parallelism). Without this call (the
  // model makes it for every MoE layer; tests may not) the tokens of a forward are one sequence
  // (T, or T times the token group's size, every rank holding as many). REQUIRES: before bind
  // (it sizes the [B, E] counts).
  void set_sequences(int64_t num_seqs, int64_t local_seq_len, int64_t row_offset, int64_t full_seq_len);
  // dprob_TK: gradient of the main loss w.r.t. topk_prob. Adds loss_scale * (aux_loss_coeff *
  // d aux + seq_aux_loss_coeff * d seq_aux + z_loss_coeff * d z) to the logit gradient; dgate
  // accumulated; dx_TH += dlogits @ gate. REQUIRES: the same x_TH as forward.
  void backward(const Tensor& x_TH, const Tensor& dprob_TK, double loss_scale, const Tensor& dx_TH);
  // Aux-loss-free balancing: bias_e += rate * sign(mean(counts_E) - counts_E[e]) (moe_ops.h,
  // expert_bias_update). counts_E: i64 [E], selections summed over a step and every rank, so all
  // ranks apply the same update. REQUIRES: cfg.expert_bias, bound.
  void update_expert_bias(const Tensor& counts_E, double rate);

  // Views of the last forward (T rows).
  const Tensor& logits() const { return logits_; }
  const Tensor& scores() const { return scores_; }
  const Tensor& topk_idx() const { return topk_idx_; }           // i32 [T, K]
  const Tensor& topk_prob() const { return topk_prob_; }         // [T, K]
  const Tensor& tokens_per_expert() const { return counts_E_; }  // i64 [E], before capacity dropping
  // The losses of the last forward (0 before one). The forward leaves them on the device (it never
  // waits for them); the first of these calls after it reads them (waits for the device).
  double aux_loss() const { return cfg_.aux_loss_coeff * loss(0); }  // aux_loss_coeff * aux
  // Its forward's device work ran again (a CUDA graph replayed it): the losses are new.
  void forward_replayed() { losses_read_ = false; }
  double seq_aux_loss() const {  // seq_aux_loss_coeff * seq aux (this rank's share)
    return cfg_.seq_aux_loss_coeff > 0 ? cfg_.seq_aux_loss_coeff * loss(1) : 0.0;
  }
  double z_loss() const { return cfg_.z_loss_coeff > 0 ? cfg_.z_loss_coeff * loss(2) : 0.0; }  // z_loss_coeff * z
  const Tensor& expert_bias() const { return bias_E_; }  // [E]; undefined without cfg.expert_bias
  // What the last forward adds to a step's statistics, queued on its stream (moe_step_stats):
  // aux_loss() + seq_aux_loss() into sums_2[0], z_loss() into sums_2[1], tokens_per_expert() into
  // load_E, the assignments the capacity drops into dropped_1. Nothing waits.
  void add_step_stats(const Tensor& sums_2, const Tensor& load_E, const Tensor& dropped_1) const;

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  // The logits GEMM's input: x itself, or its f32 cast for an fp32 GEMM under mixed precision.
  Tensor router_input(const Tensor& x_TH);
  // CPU: experts with bitwise-equal gate rows get bitwise-equal logits (upcycled routers).
  void tie_equal_rows();

  MoeConfig cfg_;
  int64_t hidden_, max_tokens_;
  std::string prefix_;
  double init_std_;
  Tensor gate_EH_, dgate_EH_;
  Tensor gate_compute_EH_;  // the gate the logits GEMM reads: gate_EH_, or its bf16 copy (mixed, no fp32 GEMM)
  Tensor bias_E_;           // selection bias (cfg.expert_bias); its gradient is never written
  bool mixed_ = false;      // bf16 compute: scores, top-k and losses in f32
  bool fp32_gemm_ = false;  // mixed precision with cfg.router_fp32_gemm
  Tensor x_buf_, dx_buf_, dx_cast_buf_;  // fp32 GEMM: f32 input, f32 d(x), d(x) in the compute dtype
  Tensor dlogits_cast_buf_;              // bf16 GEMM: d(logits) in bf16
  Tensor logits_buf_, scores_buf_, idx_buf_, prob_buf_, dlogits_buf_, dextra_buf_, counts_E_;
  Tensor group_counts_E_;  // counts_E_ summed over the token group
  Communicator* token_group_ = nullptr;
  int64_t total_tokens_ = 0;  // tokens of the micro-batch over the token group
  // Sequence-level aux loss (cfg.seq_aux_loss_coeff > 0): layout from set_sequences (num_seqs_ 0:
  // never called), the layout of the last forward, and its counts summed over the token group.
  int64_t num_seqs_ = 0, local_seq_len_ = 0, row_offset_ = 0, full_seq_len_ = 0;
  bool bound_ = false;
  SeqLayout seq_layout_;
  Tensor seq_counts_buf_, seq_counts_BE_;
  Tensor logits_, scores_, topk_idx_, topk_prob_;
  // f64 [3] where the forward writes aux, seq aux and z (before their coefficients), and their
  // host copy once read.
  Tensor losses_3_;
  mutable double losses_host_[3] = {0, 0, 0};
  mutable bool losses_read_ = true;  // nothing to read before the first forward
  double loss(int i) const;
};

}  // namespace moefold
