// Dense SwiGLU MLP: y = down(silu(gate(x)) * up(x)) — the FFN of dense layers (Qwen3-MoE's
// mlp_only_layers, DeepSeek-V3's first_k_dense_replace) and of DeepSeek-V3's shared experts.
// Gradient rule: dx written, parameter grads accumulated. Shape letters: T rows here, N rows of
// every TP rank, H hidden, F intermediate (F/tp held here).
//
// Tensor parallelism (Megatron's, with sequence parallelism): gate and up are column-parallel
// (rows of F split), down is row-parallel; the T input rows are all-gathered before and the
// partial outputs reduce-scattered after (the reverse in backward), as in Attention.
#pragma once

#include <cstdint>
#include <string>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/ops/fp8.h"

namespace moefold {

class DenseMlp {
 public:
  // rows: residual rows here (T); tokens: rows of every TP rank (N = T * tp). prefix: e.g.
  // "model.layers.0.mlp" (parameters "<prefix>.gate_proj.weight", ".up_proj", ".down_proj").
  DenseMlp(int64_t hidden, int64_t ffn, int64_t rows, int64_t tokens, std::string prefix, double init_std);

  // on: backward runs the forward again first instead of keeping its activations (Recompute's mlp
  // and shared_experts). REQUIRES: before bind.
  void set_recompute(bool on) { recompute_ = on; }
  // on: its three projections run in FP8 (Fp8Linears, config.h). REQUIRES: before bind.
  void set_fp8(bool on) { fp8_ = on; }
  // tp: the tensor-parallel group (null or size 1: the whole F here). on: the context its ops run
  // on (null: the Memory's; another one needs no tensor parallelism).
  void bind(Memory& mem, Communicator* tp, const ExecContext* on = nullptr);
  // x_TH -> y_TH (written). Keeps what backward needs (x_TH itself must not change until then).
  void forward(const Tensor& x_TH, const Tensor& y_TH);
  // dy_TH -> dx_TH (written).
  void backward(const Tensor& dy_TH, const Tensor& dx_TH);

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: bind's `on`, or the Memory's it was bound through
  int64_t hidden_, ffn_, rows_, tokens_;
  int64_t ffn_here_ = 0;  // F held here
  std::string prefix_;
  double init_std_;
  Communicator* tp_ = nullptr;
  bool recompute_ = false, fp8_ = false;
  Tensor gate_FH_, up_FH_, down_HF_, dgate_FH_, dup_FH_, ddown_HF_;
  Fp8Param fp8_gate_, fp8_up_, fp8_down_;                    // their FP8 copies (set_fp8)
  Tensor x_in_, x_full_, x_gathered_NH_, gu_N2F_, h_NF_;     // saved for backward (scratch when recomputed)
  Tensor dy_full_NH_, dh_NF_, dgu_N2F_, partial_NH_, y_TH_;  // scratch (y_TH_: the recomputed output)
  Tensor dx_up_NH_;  // FP8: the up projection's data gradient (the FP8 GEMMs write theirs)

  // FP8: gate and up each into a contiguous [N, F] buffer, copied into their half of gu (the FP8
  // GEMMs write whole contiguous outputs); backward copies each half of dgu into dh_NF_ (free by then).
  void fp8_gate_up_forward();
  void fp8_gate_up_backward(const Tensor& dx);
};

}  // namespace moefold
