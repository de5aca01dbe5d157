// Qwen3 causal self-attention: q/k/v projections, per-head RMSNorm on q and k, rotary
// embedding, grouped-query causal attention, output projection. Gradient rule: dx written,
// parameter grads accumulated. Shape letters: T = B*S tokens, H hidden, Q/G query/kv heads, D head dim.
#pragma once

#include <string>

#include "moefold/core/memory.h"
#include "moefold/model/config.h"
#include "moefold/parallel/context_parallel.h"

namespace moefold {

// Backward workspaces shared by every attention layer of a model (bound once).
struct AttentionScratch {
  Tensor dq_TQD, dk_TGD, dv_TGD, dout_TQD, dq_raw_TQD, dk_raw_TGD, dx_TH, work_2SS;
  void bind(Memory& mem, const ModelConfig& m, int64_t tokens, int64_t seq_len);
};

class Attention {
 public:
  // seq_len: tokens per sequence held here (S, or S/c under context parallelism).
  Attention(const ModelConfig& m, int64_t batch, int64_t seq_len, std::string prefix);

  // `cos_SD`/`sin_SD`: the model's RoPE table for the whole sequence; `scratch`: shared backward
  // workspaces; `cp`: the model's context-parallel core (null: the whole sequence is here).
  void bind(Memory& mem, const Tensor& cos_SD, const Tensor& sin_SD, AttentionScratch* scratch,
            ContextParallelAttention* cp);
  // x_TH -> y_TH (written). Keeps a view of x_TH: it must stay unchanged until backward.
  void forward(const Tensor& x_TH, const Tensor& y_TH);
  // dy_TH -> dx_TH (written).
  void backward(const Tensor& dy_TH, const Tensor& dx_TH);

 private:
  ModelConfig m_;
  int64_t b_, s_, t_;
  std::string prefix_;
  Tensor wq_, wk_, wv_, wo_, q_norm_, k_norm_;
  Tensor dwq_, dwk_, dwv_, dwo_, dq_norm_, dk_norm_;
  Tensor cos_, sin_;
  AttentionScratch* scratch_ = nullptr;
  ContextParallelAttention* cp_ = nullptr;
  // saved for backward
  Tensor x_;
  Tensor q_raw_TQD_, k_raw_TGD_, v_TGD_, q_rstd_, k_rstd_, q_TQD_, k_TGD_, out_TQD_, lse_BQS_;
};

}  // namespace moefold
