// Multi-head latent attention (DeepSeek-V2/V3, as Hugging Face's DeepseekV3Attention computes it):
//   q      = q_b(rmsnorm(q_a(x)))            (q_proj(x) when q_lora_rank = 0)   [T, Q, Dn + Dr]
//   kv_a   = kv_a_proj_with_mqa(x)           [T, R + Dr]
//   latent = rmsnorm(kv_a[:, :R]); k_rot = rope(kv_a[:, R:]), one rotary key shared by every head
//   k_nope, v = kv_b(latent)                 [T, Q, Dn], [T, Q, Dv]
//   q = [q_nope, rope(q_rot)], k = [k_nope, k_rot]; causal attention with scale
//   (Dn + Dr)^-0.5 (times YaRN's mscale^2); y = o_proj(out) [T, H].
// With rope_interleave the rotary dims pair (x0, x1), (x2, x3), ... (DeepSeek's checkpoint
// layout): the RoPE ops rotate those pairs in place (HF de-interleaves first; the same
// permutation of q's and k's columns leaves every q.k, hence the attention, unchanged).
// The attention core takes one head width for q, k and v: q and k are padded with zeros to
// max(Dn + Dr, Dv), v likewise (exact: zeros add nothing to q.k and give zero output columns).
//
// Tensor parallelism: heads split over TP (q_b / q_proj / kv_b column-parallel, o_proj
// row-parallel); q_a, kv_a and their norms are replicated and computed on every TP rank's rows
// (their gradients are partial per rank and summed by the dense-group reduction, like the
// other replicated parameters). Sequence parallelism as in Attention. Context parallelism through
// the model's ContextParallelAttention (shape Q/tp heads for q and kv, width max(Dn + Dr, Dv)).
#pragma once

#include <string>
#include <vector>

#include "moefold/model/attention.h"

namespace moefold {

class MlaAttention : public SelfAttention {
 public:
  // seq_len: tokens per sequence held here; softmax_scale: from the config (YaRN mscale applied).
  MlaAttention(const ModelConfig& m, int64_t batch, int64_t seq_len, std::string prefix, double softmax_scale);
  void bind(Memory& mem, const Tensor& cos_SD, const Tensor& sin_SD, AttentionScratch* scratch,
            ContextParallelAttention* cp, Communicator* tp) override;
  void forward(const Tensor& x_TH, const Tensor& y_TH) override;
  void backward(const Tensor& dy_TH, const Tensor& dx_TH) override;

  // The width the attention core sees: max(qk_nope + qk_rope, v_head_dim).
  static int64_t core_head_dim(const ModelConfig& m);

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  ModelConfig cfg_;
  int64_t batch_, seq_len_, tokens_;  // tokens_: tokens of the whole sequences here (all TP rows)
  std::string prefix_;
  double scale_;
  int64_t qh_ = 0;                              // heads held here
  int64_t dn_, dr_, dv_, dqk_, dp_, rq_, rkv_;  // widths: nope, rope, v, qk, padded core, q/kv latent
  Communicator* tp_ = nullptr;
  ContextParallelAttention* cp_ = nullptr;
  Tensor cos_, sin_;
  // parameters and gradients (q_a/q_a_norm/q_b with q-LoRA, else q_proj in wq_b_)
  Tensor wq_a_, q_a_norm_, wq_b_, wkv_a_, kv_a_norm_, wkv_b_, wo_;
  Fp8Param fp8_wq_a_, fp8_wq_b_, fp8_wkv_a_, fp8_wkv_b_, fp8_wo_;  // their FP8 copies (set_fp8)
  // x's FP8 operands, quantized once for the projections reading x (q_a or q, and kv_a; scratch)
  Fp8SharedOperands x_fp8_;
  Tensor dwq_a_, dq_a_norm_, dwq_b_, dwkv_a_, dkv_a_norm_, dwkv_b_, dwo_;
  // From the latents (and x without q-LoRA) to the core's q4_, k4_, v4_ (recomputed: mla_up_proj).
  void up_forward();
  // The core, and its output for o_proj (o_in_) (recomputed: core_attn).
  void core_forward();
  // saved for backward
  Tensor x_full_, x_gathered_TH_;
  Tensor cq_raw_, cq_, cq_rstd_, q_raw_, kv_a_, ckv_raw_, ckv_, ckv_rstd_, kvb_;
  Tensor q_pe_, k_pe_, q4_, k4_, v4_, out4_, lse_, o_in_;
  // backward workspaces
  Tensor dy_full_, do_in_, dout4_, dq4_, dk4_, dv4_, dq_raw_, dcq_, dcq_raw_, dkvb_, dckv_, dckv_raw_, dkv_a_, dx_part_,
      partial_, work_;
};

}  // namespace moefold
