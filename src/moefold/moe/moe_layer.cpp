// MoeLayer: wires Router, Dispatcher and Experts, and owns the buffers between them.
#include "moefold/moe/moe_layer.h"

#include <utility>

#include "moefold/core/profile.h"
#include "moefold/ops/fp8.h"

namespace moefold {

namespace {
const MoeConfig& validated(const MoeConfig& cfg) {
  cfg.validate();
  return cfg;
}

// The experts the dispatcher feeds: its experts, and its slice of their F columns.
Experts make_experts(const MoeConfig& cfg, const Dispatcher& d, int64_t hidden, const std::string& prefix,
                     double init_std) {
  const FfnSlice f = d.ffn_slice(cfg.moe_intermediate_size);
  return Experts(ExpertsShape{.num_experts = d.num_local_experts(),
                              .hidden = hidden,
                              .ffn = f.size,
                              .max_rows = d.max_rows(),
                              .first_expert = d.first_local_expert(),
                              .total_experts = cfg.num_experts,
                              .ffn_first = f.first,
                              .total_ffn = cfg.moe_intermediate_size},
                 prefix, init_std);
}
}  // namespace

void run_experts_forward(const DispatchPlan& plan, Experts& experts, const Tensor& out_RH) {
  check_shape(out_RH, {plan.num_rows, out_RH.size(1)}, "run_experts_forward out");
  PieceSchedule* s = plan.schedule;
  for (size_t i = 0; i < plan.pieces.size(); ++i) {
    const RowPiece& piece = plan.pieces[i];
    if (s) s->rows_arrived(i);
    ProfileScope scope("moe experts piece forward");
    const Tensor out = s ? s->output_rows(plan, i, out_RH) : out_RH.slice(piece.begin, piece.end);
    experts.forward(plan.rows_RH.slice(piece.begin, piece.end), piece.offsets_E1, out, piece.begin);
    if (s) s->outputs_done(i, out_RH);
  }
}

void run_experts_backward(const DispatchPlan& plan, Experts& experts, const Tensor& dout_RH, const Tensor& drows_RH) {
  check_shape(dout_RH, {plan.num_rows, dout_RH.size(1)}, "run_experts_backward dout");
  check_shape(drows_RH, {plan.num_rows, drows_RH.size(1)}, "run_experts_backward drows");
  PieceSchedule* s = plan.schedule;
  // The callback captures one pointer, so std::function keeps it without a heap allocation.
  struct Done {
    PieceSchedule* s;
    const Tensor& drows;
    size_t piece;
  } done{s, drows_RH, 0};
  for (size_t i = 0; i < plan.backward_pieces.size(); ++i) {
    const RowPiece& piece = plan.backward_pieces[i];
    if (s) s->output_grads_arrived(i);
    ProfileScope scope("moe experts piece backward");
    done.piece = i;
    const Tensor dout = s ? s->output_grad_rows(plan, i, dout_RH) : dout_RH.slice(piece.begin, piece.end);
    const Tensor drows = s ? s->input_grad_rows(plan, i, drows_RH) : drows_RH.slice(piece.begin, piece.end);
    // Experts::backward splits its first layer's GEMMs (input gradient, then weight gradient)
    // around the callback; it is passed whether or not a schedule waits, so every dispatcher runs
    // the same kernels in the same order.
    experts.backward(plan.rows_RH.slice(piece.begin, piece.end), piece.offsets_E1, dout, drows, piece.begin, [&done] {
      if (done.s) done.s->input_grads_done(done.piece, done.drows);
    });
  }
}

MoeLayer::MoeLayer(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, std::string prefix)
    : MoeLayer(cfg, hidden, max_tokens, std::move(prefix), std::make_unique<LocalDispatcher>(cfg, hidden, max_tokens)) {
}

MoeLayer::MoeLayer(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, std::string prefix,
                   std::unique_ptr<Dispatcher> dispatcher)
    : cfg_(validated(cfg)),
      hidden_(hidden),
      max_tokens_(max_tokens),
      prefix_(std::move(prefix)),
      dispatcher_(std::move(dispatcher)),
      router_(cfg_, hidden, max_tokens, prefix_, router_init_std()),
      experts_(make_experts(cfg_, *dispatcher_, hidden, prefix_, init_std_)) {
  MF_CHECK(hidden >= 1 && max_tokens >= 0, "MoeLayer: hidden ", hidden, ", max_tokens ", max_tokens);
}

void MoeLayer::set_init_std(double std) {
  init_std_ = std;
  router_ = Router(cfg_, hidden_, max_tokens_, prefix_, router_init_std());
  experts_ = make_experts(cfg_, *dispatcher_, hidden_, prefix_, init_std_);
}

void MoeLayer::bind(Memory& mem) {
  ctx_ = &mem.exec();
  const int64_t r_max = dispatcher_->max_rows();
  {  // recomputed whole: everything it keeps is workspace, refilled before backward
    const Memory::ScratchActs recomputed(mem, recompute_whole_);
    router_.bind(mem);
    dispatcher_->set_offload_rows(offload_rows_);
    dispatcher_->set_fp8_rows(fp8_rows_);
    dispatcher_->bind(mem);
    packed_TW_ = fp8_rows_ ? mem.scratch({max_tokens_, fp8_packed_width(hidden_)}, DType::u8) : Tensor();
    experts_.set_recompute_act(recompute_act_);
    experts_.set_offload_gate_up(offload_gu_);
    experts_.bind(mem);
    out_RH_ = mem.act({r_max, hidden_});
  }
  MF_CHECK(!phased_ || !recompute_whole_, "MoeLayer: phased with the whole layer recomputed");
  auto kept_across_phases = [&](Shape shape, DType dtype) {
    return phased_ ? mem.exchange_scratch(shape, dtype) : mem.scratch(shape, dtype);
  };
  dout_RH_ = kept_across_phases({r_max, hidden_}, mem.dtype());
  drows_RH_ = kept_across_phases({r_max, hidden_}, mem.dtype());
  dprob_TK_ = kept_across_phases({max_tokens_, cfg_.num_experts_per_tok}, mem.master_dtype());  // the router's dtype
  y_TH_ = mem.scratch({recompute_whole_ ? max_tokens_ : 0, hidden_});
  x_TH_ = Tensor();
  plan_ = nullptr;
}

void MoeLayer::forward(const Tensor& x_TH, const Tensor& y_TH) {
  forward_dispatch(x_TH);
  forward_experts();
  forward_combine(y_TH);
}

void MoeLayer::forward_dispatch(const Tensor& x_TH) {
  const int64_t t_n = x_TH.size(0);
  MF_CHECK(x_TH.ndim() == 2 && x_TH.size(1) == hidden_ && t_n <= max_tokens_, "MoeLayer: x ", x_TH.str(),
           " for hidden ", hidden_, ", max_tokens ", max_tokens_);
  num_tokens_ = t_n;
  x_TH_ = x_TH;
  {  // the router's losses come back to the host here
    ProfileScope scope("moe router forward");
    router_.forward(x_TH);
  }
  ProfileScope scope("moe dispatch forward");
  Tensor tokens = x_TH;
  if (fp8_rows_) {  // each token quantized once, before it is copied to its k experts
    tokens = packed_TW_.slice(0, t_n);
    fp8_quantize_packed(*ctx_, x_TH, tokens);
  }
  plan_ = &dispatcher_->dispatch(tokens, router_.topk_idx(), router_.topk_prob());
}

void MoeLayer::forward_experts() {
  ProfileScope scope("moe experts forward");
  run_experts_forward(*plan_, experts_, out_RH_.slice(0, plan_->num_rows));
}

void MoeLayer::forward_combine(const Tensor& y_TH) {
  check_shape(y_TH, x_TH_.shape(), "MoeLayer y");
  ProfileScope scope("moe combine forward");
  dispatcher_->combine(out_RH_.slice(0, plan_->num_rows), *plan_, y_TH);
}

void MoeLayer::backward(const Tensor& dy_TH, const Tensor& dx_TH, double loss_scale) {
  backward_combine(dy_TH);
  backward_experts();
  backward_dispatch(dx_TH, loss_scale);
}

void MoeLayer::backward_combine(const Tensor& dy_TH) {
  MF_CHECK(plan_ != nullptr, "MoeLayer::backward before forward");
  if (recompute_whole_) {
    ProfileScope scope("recompute moe forward");
    const Tensor x = x_TH_;  // forward sets x_TH_ again
    forward(x, y_TH_.slice(0, num_tokens_));
  }
  const int64_t t_n = num_tokens_, r_n = plan_->num_rows;
  check_shape(dy_TH, {t_n, hidden_}, "MoeLayer dy");
  ProfileScope scope("moe combine backward");
  dispatcher_->combine_backward(dy_TH, out_RH_.slice(0, r_n), *plan_, dout_RH_.slice(0, r_n), dprob_TK_.slice(0, t_n));
}

void MoeLayer::backward_experts() {
  const int64_t r_n = plan_->num_rows;
  ProfileScope scope("moe experts backward");
  run_experts_backward(*plan_, experts_, dout_RH_.slice(0, r_n), drows_RH_.slice(0, r_n));
}

void MoeLayer::backward_dispatch(const Tensor& dx_TH, double loss_scale) {
  const int64_t t_n = num_tokens_;
  check_shape(dx_TH, {t_n, hidden_}, "MoeLayer dx");
  {
    ProfileScope scope("moe dispatch backward");
    dispatcher_->dispatch_backward(drows_RH_.slice(0, plan_->num_rows), *plan_, dx_TH);
  }
  ProfileScope scope("moe router backward");
  router_.backward(x_TH_, dprob_TK_.slice(0, t_n), loss_scale, dx_TH);  // adds the router branch to dx
}

}  // namespace moefold
