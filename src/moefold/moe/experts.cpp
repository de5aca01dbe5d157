// Routed SwiGLU experts over expert-contiguous rows: grouped_linear + swiglu (one fused op) ->
// grouped_linear.
#include "moefold/moe/experts.h"

#include <algorithm>
#include <utility>

#include "moefold/ops/fp8.h"
#include "moefold/ops/moe_ops.h"
#include "moefold/ops/ops.h"

namespace moefold {

Experts::Experts(const ExpertsShape& s, std::string prefix, double init_std)
    : num_experts_(s.num_experts),
      first_expert_(s.first_expert),
      total_experts_(s.total_experts > 0 ? s.total_experts : s.num_experts),
      hidden_(s.hidden),
      ffn_(s.ffn),
      ffn_first_(s.ffn_first),
      total_ffn_(s.total_ffn > 0 ? s.total_ffn : s.ffn),
      max_rows_(s.max_rows),
      prefix_(std::move(prefix)),
      init_std_(init_std) {
  MF_CHECK(s.num_experts >= 1 && s.hidden >= 1 && s.ffn >= 1 && s.max_rows >= 0, "Experts: E ", s.num_experts, ", H ",
           s.hidden, ", F ", s.ffn, ", max_rows ", s.max_rows);
  MF_CHECK(s.ffn_first >= 0 && s.ffn_first + s.ffn <= total_ffn_, "Experts: F slice [", s.ffn_first, ", ",
           s.ffn_first + s.ffn, ") of ", total_ffn_);
}

void Experts::bind(Memory& mem) {
  ctx_ = &mem.exec();
  const bool sharded = ffn_ != total_ffn_;
  const DimShard gate_up_shard = sharded ? DimShard{1, ffn_first_, total_ffn_, 2} : DimShard{};
  const DimShard down_shard = sharded ? DimShard{2, ffn_first_, total_ffn_, 1} : DimShard{};
  gate_up_E2FH_ = fp8_gate_up_.param(mem,
                                     {.name = prefix_ + ".experts.gate_up_proj",
                                      .shape = {num_experts_, 2 * ffn_, hidden_},
                                      .init_std = init_std_,
                                      .group = ParamGroup::expert,
                                      .shard_offset = first_expert_,
                                      .global_rows = total_experts_,
                                      .dim_shard = gate_up_shard},
                                     fp8_);
  down_EHF_ = fp8_down_.param(mem,
                              {.name = prefix_ + ".experts.down_proj",
                               .shape = {num_experts_, hidden_, ffn_},
                               .init_std = init_std_,
                               .group = ParamGroup::expert,
                               .shard_offset = first_expert_,
                               .global_rows = total_experts_,
                               .dim_shard = down_shard},
                              fp8_);
  dgate_up_E2FH_ = mem.grad(prefix_ + ".experts.gate_up_proj");
  ddown_EHF_ = mem.grad(prefix_ + ".experts.down_proj");
  gate_up_index_ = mem.grad_written_by_backward(prefix_ + ".experts.gate_up_proj");
  down_index_ = mem.grad_written_by_backward(prefix_ + ".experts.down_proj");
  mem_ = &mem;
  gu_R2F_ = offload_gu_ ? mem.offloaded({max_rows_, 2 * ffn_}) : mem.act({max_rows_, 2 * ffn_});
  // FP8: the SwiGLU's output is kept as fc2's packed FP8 operand (fp8_swiglu_packed), half the bytes.
  const Shape h_shape = fp8_ ? Shape{max_rows_, fp8_packed_width(ffn_)} : Shape{max_rows_, ffn_};
  const DType h_dtype = fp8_ ? DType::u8 : mem.dtype();
  h_RF_ = recompute_act_ ? mem.scratch(h_shape, h_dtype) : mem.act(h_shape, h_dtype);
  dh_RF_ = mem.scratch({max_rows_, ffn_});
  dgu_R2F_ = mem.scratch({max_rows_, 2 * ffn_});
  const int64_t dy_bytes = std::max(fp8_shared_operand_bytes(max_rows_, hidden_, num_experts_),
                                    fp8_shared_operand_bytes(max_rows_, 2 * ffn_, num_experts_, true));
  dy_fp8_.bytes = fp8_ ? mem.scratch({dy_bytes}, DType::u8) : Tensor();
}

void Experts::forward(const Tensor& rows_RH, const Tensor& offsets_E1, const Tensor& out_RH, int64_t first_row) {
  const int64_t r_n = rows_RH.size(0);
  MF_CHECK(first_row >= 0 && first_row + r_n <= max_rows_, "Experts: rows [", first_row, ", ", first_row + r_n,
           ") past max_rows ", max_rows_);
  const Tensor gu = gu_R2F_.slice(first_row, first_row + r_n), h = h_RF_.slice(first_row, first_row + r_n);
  if (fp8_) {
    fp8_grouped_linear_forward(*ctx_, rows_RH, gate_up_E2FH_, offsets_E1, gu, fp8_gate_up_.get());
    fp8_swiglu_packed(*ctx_, gu, h);  // h quantized where it is produced
    fp8_grouped_linear_forward(*ctx_, h, down_EHF_, offsets_E1, out_RH, fp8_down_.get());
    return;
  }
  grouped_linear_swiglu_forward(*ctx_, rows_RH, gate_up_E2FH_, offsets_E1, gu, h);
  grouped_linear_forward(*ctx_, h, down_EHF_, offsets_E1, out_RH);
}

void Experts::backward(const Tensor& rows_RH, const Tensor& offsets_E1, const Tensor& dout_RH, const Tensor& drows_RH,
                       int64_t first_row, const std::function<void()>& input_grads_done) {
  const int64_t r_n = rows_RH.size(0), r0 = first_row, r1 = first_row + r_n;
  MF_CHECK(r0 >= 0 && r1 <= max_rows_, "Experts: rows [", r0, ", ", r1, ") past max_rows ", max_rows_);
  const Tensor gu = gu_R2F_.slice(r0, r1), h = h_RF_.slice(r0, r1);
  const Tensor dh = dh_RF_.slice(r0, r1), dgu = dgu_R2F_.slice(r0, r1);
  MF_CHECK(mem_ != nullptr, "Experts::backward before bind");
  const bool accumulate = mem_->accumulate_grad(gate_up_index_);
  MF_CHECK(mem_->accumulate_grad(down_index_) == accumulate, "Experts: gate_up_proj and down_proj written apart");
  // grouped_linear_backward in this layer's precision (wq: w's FP8 copy). In FP8 each GEMM's data
  // gradient, run first, reads dy's operands from dy_fp8_ or quantizes dy for both, leaving the cols
  // operand there for the weight gradient (each layer's data gradient is followed by its weight
  // gradient).
  const auto linear_backward = [&](const Tensor& x, const Tensor& w, const Fp8Param& wq, const Tensor& dy,
                                   const Tensor& dx, const Tensor& dw) {
    if (fp8_)
      fp8_grouped_linear_backward(*ctx_, x, w, offsets_E1, dy, dx, dw, accumulate, wq.get(), &dy_fp8_);
    else
      grouped_linear_backward(*ctx_, x, w, offsets_E1, dy, dx, dw, accumulate);
  };
  // dh = dout @ down: in FP8 alone (the SwiGLU's backward follows down's weight gradient, straight
  // into fc1's dy operands), else with the SwiGLU's backward fused in.
  if (fp8_)
    linear_backward(h, down_EHF_, fp8_down_, dout_RH, dh, Tensor());
  else
    grouped_linear_swiglu_backward_data(*ctx_, dout_RH, down_EHF_, offsets_E1, gu, dh, dgu);
  // The forward's h came from the stored gu (moe_ops.h): swiglu_forward on it gives the same bits.
  if (recompute_act_) {
    if (fp8_)
      fp8_swiglu_packed(*ctx_, gu, h);
    else
      swiglu_forward(*ctx_, gu, h, GateUp::pairs);
  }
  linear_backward(h, down_EHF_, fp8_down_, dout_RH, Tensor(), ddown_EHF_);
  if (fp8_) fp8_swiglu_backward_operands(*ctx_, gu, dh, offsets_E1, dgu, dy_fp8_);
  if (!input_grads_done) {
    linear_backward(rows_RH, gate_up_E2FH_, fp8_gate_up_, dgu, drows_RH, dgate_up_E2FH_);
    return;
  }
  linear_backward(rows_RH, gate_up_E2FH_, fp8_gate_up_, dgu, drows_RH, Tensor());
  input_grads_done();
  linear_backward(rows_RH, gate_up_E2FH_, fp8_gate_up_, dgu, Tensor(), dgate_up_E2FH_);
}

}  // namespace moefold
