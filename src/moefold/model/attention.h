// Causal self-attention of the Qwen3-MoE, Mixtral and OLMoE families: q/k/v projections, RMSNorm
// on q and k (Qwen3: per head; OLMoE: over the whole projection; Mixtral: none), rotary
// embedding, grouped-query causal attention, output projection. Gradient rule: dx written,
// parameter grads accumulated. Shape letters: T = B*S tokens of this rank's sequences (S = L under
// context parallelism), H hidden, Q/G query/kv heads held here, D head dim.
//
// Tensor parallelism (Megatron's, with sequence parallelism): the heads are split over the TP
// group (q/k/v projections column-parallel, the output projection row-parallel); the input and
// output hold T/tp tokens (this TP rank's rows), all-gathered before the projections and
// reduce-scattered after the output projection (and the reverse in backward).
#pragma once

#include <string>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/model/config.h"
#include "moefold/ops/fp8.h"
#include "moefold/parallel/context_parallel.h"

namespace moefold {

// Backward and tensor-parallel workspaces shared by every attention layer of a model.
struct AttentionScratch {
  Tensor dq_TQD, dk_TGD, dv_TGD, dout_TQD, dq_raw_TQD, dk_raw_TGD, dx_TH, work_2SS;
  Tensor dy_full_TH, partial_TH;  // tensor parallelism: gathered rows of dy, partial sums
  // q_dim / kv_dim: widths of the heads held here.
  void bind(Memory& mem, const ModelConfig& m, int64_t tokens, int64_t seq_len, int64_t q_dim, int64_t kv_dim);
};

// What a decoder layer needs of its attention (Attention here, MlaAttention in mla.h).
class SelfAttention {
 public:
  virtual ~SelfAttention() = default;
  // `cos_SD`/`sin_SD`: the model's RoPE table for the whole sequence; `scratch`: shared
  // workspaces; `cp`: the model's context-parallel core (null: the whole sequence is here);
  // `tp`: the tensor-parallel group (null or size 1: every head is here).
  virtual void bind(Memory& mem, const Tensor& cos_SD, const Tensor& sin_SD, AttentionScratch* scratch,
                    ContextParallelAttention* cp, Communicator* tp) = 0;
  // x_TH -> y_TH (written); T/tp rows each. Keeps a view of x_TH: unchanged until backward.
  virtual void forward(const Tensor& x_TH, const Tensor& y_TH) = 0;
  // dy_TH -> dx_TH (written).
  virtual void backward(const Tensor& dy_TH, const Tensor& dx_TH) = 0;
  // What backward recomputes instead of keeping (Recompute, config.h): the attention core's output
  // and log-sum-exp; MLA's up projections and the core's inputs (ignored by GQA attention).
  // REQUIRES: before bind.
  void set_recompute(bool core_attn, bool mla_up_proj) {
    recompute_core_ = core_attn;
    recompute_up_proj_ = mla_up_proj;
  }
  // What it keeps in the layer's offload slot (Offload, config.h): the projections' gathered input
  // (tensor parallelism; else the caller's norm output is that input), the core's q, k, v and
  // log-sum-exp (and MLA's core output), the output projection's input. REQUIRES: before bind.
  void set_offload(bool qkv_linear, bool core_attn, bool attn_proj) {
    offload_qkv_ = qkv_linear;
    offload_core_ = core_attn;
    offload_proj_ = attn_proj;
  }
  // Which projections run in FP8 (Fp8Linears, config.h: qkv incl. MLA's down and up projections;
  // the output projection). REQUIRES: before bind.
  void set_fp8(bool qkv, bool proj) {
    fp8_qkv_ = qkv;
    fp8_proj_ = proj;
  }

 protected:
  bool fp8_qkv_ = false, fp8_proj_ = false;
  bool recompute_core_ = false, recompute_up_proj_ = false;
  bool offload_qkv_ = false, offload_core_ = false, offload_proj_ = false;
};

enum class QkNorm : uint8_t { none, per_head, whole };

class Attention : public SelfAttention {
 public:
  // seq_len: tokens per sequence held here (S, or S/c under context parallelism).
  Attention(const ModelConfig& m, int64_t batch, int64_t seq_len, std::string prefix);

  void bind(Memory& mem, const Tensor& cos_SD, const Tensor& sin_SD, AttentionScratch* scratch,
            ContextParallelAttention* cp, Communicator* tp) override;
  void forward(const Tensor& x_TH, const Tensor& y_TH) override;
  void backward(const Tensor& dy_TH, const Tensor& dx_TH) override;

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  ModelConfig cfg_;
  int64_t batch_, seq_len_, tokens_;    // tokens_: tokens of the whole sequences here (all TP ranks' rows)
  int64_t q_heads_ = 0, kv_heads_ = 0;  // held here
  std::string prefix_;
  QkNorm qk_norm_ = QkNorm::per_head;
  Tensor wq_, wk_, wv_, wo_, q_norm_, k_norm_;
  Fp8Param fp8_wq_, fp8_wk_, fp8_wv_, fp8_wo_;  // their FP8 copies (set_fp8)
  Fp8SharedOperands x_fp8_;                     // x's FP8 operands, quantized once for q, k and v (scratch bytes)
  Tensor dwq_, dwk_, dwv_, dwo_, dq_norm_, dk_norm_;
  Tensor cos_, sin_;
  AttentionScratch* scratch_ = nullptr;
  ContextParallelAttention* cp_ = nullptr;
  Communicator* tp_ = nullptr;  // set when tp size > 1
  // saved for backward
  Tensor x_full_;         // the input of every TP rank's rows (x itself without TP)
  Tensor x_gathered_TH_;  // its buffer under tensor parallelism (this layer's own)
  Tensor q_raw_TQD_, k_raw_TGD_, v_TGD_, q_rstd_, k_rstd_, q_TQD_, k_TGD_;
  Tensor out_TQD_, lse_BQS_;  // scratch when the core is recomputed
  // The core: out and lse from q, k, v (after RoPE).
  void core_forward();
};

}  // namespace moefold
