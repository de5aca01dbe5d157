// Routed experts: E SwiGLU MLPs run as a grouped GEMM over expert-contiguous rows (CPU: one gemm
// per expert), out = down(silu(gate(x)) * up(x)). Parameters are fused as Hugging Face's
// (gate_up_proj, down_proj), except that gate and up rows interleave (see bind).
// Expert tensor parallelism (Megatron-Core ETP): with ffn < total_ffn this holds the F-slice
// [ffn_first, ffn_first + ffn) of every expert and forward yields a PARTIAL output (the full one
// is the sum over the ETP group, which the AllGatherDispatcher takes); drows is partial likewise.
// Gradient rule: drows written; parameter grads accumulated. Experts with no rows are skipped.
// Shape letters: R rows, H hidden, F expert FFN, E local experts.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "moefold/core/memory.h"
#include "moefold/ops/fp8.h"

namespace moefold {

// Which experts, and which slice of each, a rank holds: experts [first_expert, first_expert +
// num_experts) of total_experts (expert parallelism), F columns [ffn_first, ffn_first + ffn) of
// total_ffn (expert tensor parallelism). Held weights are ParamGroup::expert shards.
struct ExpertsShape {
  int64_t num_experts = 0;    // E held here
  int64_t hidden = 0;         // H
  int64_t ffn = 0;            // F held here
  int64_t max_rows = 0;       // bound on R (Dispatcher::max_rows())
  int64_t first_expert = 0;   // global index of the first expert held here
  int64_t total_experts = 0;  // experts of the whole layer (0: num_experts)
  int64_t ffn_first = 0;      // first of total_ffn held here
  int64_t total_ffn = 0;      // F of the whole layer (0: ffn, unsharded)
};

class Experts {
 public:
  // prefix: e.g. "model.layers.3.mlp".
  Experts(const ExpertsShape& shape, std::string prefix, double init_std);

  // "<prefix>.experts.gate_up_proj" [E, 2F, H] (row 2j of each expert: gate_proj row j, row
  // 2j + 1: up_proj row j, so gu's columns pair up alike, GateUp::pairs in ops.h, and one thread
  // of a GEMM epilogue holds both inputs of a SwiGLU unit; files keep Hugging Face's separate
  // gate_proj and up_proj, hf_names.h) and "<prefix>.experts.down_proj" [E, H, F]; plus the
  // saved activations. F-sharded: gate_up holds the gate and up rows [ffn_first, +F),
  // interleaved, i.e. rows [2 ffn_first, 2 (ffn_first + F)) of the whole (DimShard dim 1, 2
  // chunks of total_ffn), and down_proj columns [ffn_first, +F) (DimShard dim 2, 1 chunk).
  void bind(Memory& mem);
  // on: the SwiGLU output is not kept; backward computes it again from the kept gate|up output
  // (Recompute's moe_act). REQUIRES: before bind.
  void set_recompute_act(bool on) { recompute_act_ = on; }
  // on: the gate|up output (the SwiGLU's input) is Memory::offloaded. REQUIRES: before bind.
  void set_offload_gate_up(bool on) { offload_gu_ = on; }
  // on: both grouped linears run in FP8 (ops/fp8.h; the SwiGLU then runs apart from the GEMMs and
  // writes its output as fc2's packed FP8 operand, kept so for the backward: fp8_swiglu_packed).
  void set_fp8(bool on) { fp8_ = on; }

  // out_RH = experts(rows_RH) with expert e on rows [offsets_E1[e], offsets_E1[e+1]). Saves the
  // gate|up and SwiGLU activations as rows [first_row, first_row + R) of its saved buffers: a
  // layer's rows may run in pieces (DispatchPlan::pieces), each with its own first_row.
  // REQUIRES: rows_RH unchanged until backward; first_row + R <= max_rows.
  void forward(const Tensor& rows_RH, const Tensor& offsets_E1, const Tensor& out_RH, int64_t first_row = 0);
  // drows_RH written; expert weight grads written by the first backward of each gradient
  // generation (Memory::grad_written_by_backward: zero_grads does not zero them), accumulated by
  // the later ones (so pieces add up). Same rows, offsets and first_row as forward.
  // input_grads_done, if given, runs once drows_RH is written, before the weight gradient of the
  // first linear layer (a pipelined dispatcher starts sending drows meanwhile).
  void backward(const Tensor& rows_RH, const Tensor& offsets_E1, const Tensor& dout_RH, const Tensor& drows_RH,
                int64_t first_row = 0, const std::function<void()>& input_grads_done = {});

  const Tensor& gate_up_proj() const { return gate_up_E2FH_; }
  // FP8 (set_fp8): the weights' copies for this step, quantized now if the weights changed
  // (Fp8Param); null without FP8.
  const Fp8Weight* fp8_gate_up() { return fp8_gate_up_.get(); }
  const Fp8Weight* fp8_down() { return fp8_down_.get(); }
  const Tensor& down_proj() const { return down_EHF_; }
  int64_t ffn() const { return ffn_; }              // F held here
  int64_t ffn_first() const { return ffn_first_; }  // first of total_ffn held here

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  int64_t num_experts_, first_expert_, total_experts_, hidden_, ffn_, ffn_first_, total_ffn_, max_rows_;
  std::string prefix_;
  double init_std_;
  Tensor gate_up_E2FH_, down_EHF_, dgate_up_E2FH_, ddown_EHF_;
  bool recompute_act_ = false, offload_gu_ = false, fp8_ = false;
  Fp8Param fp8_gate_up_, fp8_down_;  // the weights' FP8 copies (quantized once per step)
  Fp8SharedOperands dy_fp8_;  // FP8: an output gradient's cols operand, from its data gradient to its weight gradient
  Tensor gu_R2F_, h_RF_;      // saved by forward (max_rows rows; h_RF_ scratch with recompute_act_)
  Tensor dh_RF_, dgu_R2F_;    // scratch: backward workspaces
  Memory* mem_ = nullptr;     // for its gradients' generation (accumulate_grad)
  size_t gate_up_index_ = 0, down_index_ = 0;  // the weights' parameter indices (Memory::accumulate_grad)
};

}  // namespace moefold
