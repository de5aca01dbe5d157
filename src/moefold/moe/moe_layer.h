// The MoE layer that replaces a dense MLP: Router -> Dispatcher.dispatch -> Experts ->
// Dispatcher.combine (docs/architecture.md, "What one training step does"). Parallelism lives in the
// dispatcher, which comes in from outside (LocalDispatcher by default).
// Gradient rule: dx written; parameter grads accumulated. Shape letters: T tokens, H hidden.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "moefold/core/memory.h"
#include "moefold/moe/dispatcher.h"
#include "moefold/moe/experts.h"
#include "moefold/moe/moe_config.h"
#include "moefold/moe/router.h"

namespace moefold {

// The experts over the pieces of `plan` (a dispatcher's last dispatch), with the calls of its
// PieceSchedule (dispatcher.h) around each piece when it pipelines: the outputs written where the
// schedule puts them (the rows of out_RH, R rows, unless it keeps some elsewhere). MoeLayer and
// the benchmark run the experts through these.
void run_experts_forward(const DispatchPlan& plan, Experts& experts, const Tensor& out_RH);
// Backward, over plan.backward_pieces: drows_RH written, expert gradients as Experts::backward.
void run_experts_backward(const DispatchPlan& plan, Experts& experts, const Tensor& dout_RH, const Tensor& drows_RH);

class MoeLayer {
 public:
  // Validates cfg (throws moefold::Error). prefix: e.g. "model.layers.3.mlp" (HF Qwen3-MoE).
  MoeLayer(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, std::string prefix);
  // Same, with a dispatcher from outside (e.g. all-to-all over an EP group); experts are sized
  // by dispatcher->num_local_experts(); an AllGatherDispatcher (expert tensor parallelism) also
  // gives them its F-slice (ffn_local() columns from ffn_first()).
  MoeLayer(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, std::string prefix,
           std::unique_ptr<Dispatcher> dispatcher);

  // Std of the Init::normal parameters (gate and experts); default 0.02. REQUIRES: before bind.
  void set_init_std(double std);
  // What backward recomputes instead of keeping (Recompute, config.h): the experts' SwiGLU output
  // (moe_act); the whole layer (moe): router, dispatch, experts and combine run again before its
  // backward, from the kept input. REQUIRES: before bind.
  void set_recompute(bool experts_act, bool whole) {
    recompute_act_ = experts_act;
    recompute_whole_ = whole;
  }
  // What it keeps in the layer's offload slot (Offload, config.h): the experts' permuted input rows
  // (expert_fc1: where the dispatcher owns them, Dispatcher::set_offload_rows), their first layer's
  // output (moe_act). REQUIRES: before bind.
  void set_offload(bool expert_fc1, bool moe_act) {
    offload_rows_ = expert_fc1;
    offload_gu_ = moe_act;
  }
  // on: the experts' GEMMs run in FP8 (Experts::set_fp8), and with moe.fp8_dispatch the tokens
  // travel to them as packed FP8 rows (Dispatcher::set_fp8_rows). REQUIRES: before bind.
  void set_fp8(bool on) {
    experts_.set_fp8(on);
    fp8_rows_ = on && cfg_.fp8_dispatch;
  }
  // parallel.overlap_moe_a2a: another micro-batch's modules run between the phases below, so the
  // backward's output and input gradient rows live in Memory::exchange_scratch instead of the
  // shared scratch. REQUIRES: before bind; not with recompute of the whole layer.
  void set_phased(bool on) { phased_ = on; }
  // Parameters and buffers; called in both binding passes of a Memory.
  void bind(Memory& mem);
  // See Router::set_token_group (context parallelism splits each sequence over a group).
  void set_token_group(Communicator* group) { router_.set_token_group(group); }
  // See Router::set_sequences (sequence-level aux loss). REQUIRES: before bind.
  void set_sequences(int64_t num_seqs, int64_t local_seq_len, int64_t row_offset, int64_t full_seq_len) {
    router_.set_sequences(num_seqs, local_seq_len, row_offset, full_seq_len);
  }
  // Aux-loss-free balancing: see Router::update_expert_bias (counts_E: i64 tokens per expert over
  // a step, summed over every rank).
  void update_expert_bias(const Tensor& counts_E, double rate) { router_.update_expert_bias(counts_E, rate); }
  // Hook for after parameter initialisation (nothing to derive on the CPU).
  void init_done() {}

  // y_TH written. REQUIRES: T <= max_tokens, bound and allocated; x_TH unchanged until backward
  // (a view of it is kept). Saves what else backward needs.
  void forward(const Tensor& x_TH, const Tensor& y_TH);
  // dx_TH written; parameter grads accumulated; includes the gradient of
  // loss_scale * (aux_loss_coeff * aux + z_loss_coeff * z). REQUIRES: after forward.
  void backward(const Tensor& dy_TH, const Tensor& dx_TH, double loss_scale);

  // forward and backward in three phases each, split where rows start to travel (expert
  // parallelism): forward = router and dispatch | experts | combine; backward = combine's backward
  // | experts | dispatch's and the router's backward. In between, only exchanges of this layer
  // and kept tensors are in flight (no scratch), so another micro-batch's modules may run there.
  void forward_dispatch(const Tensor& x_TH);
  void forward_experts();
  void forward_combine(const Tensor& y_TH);
  void backward_combine(const Tensor& dy_TH);
  void backward_experts();
  void backward_dispatch(const Tensor& dx_TH, double loss_scale);

  // From the last forward, already multiplied by their coefficients.
  void forward_replayed() { router_.forward_replayed(); }  // see DecoderLayer::forward_replayed
  double aux_loss() const { return router_.aux_loss(); }
  double z_loss() const { return router_.z_loss(); }
  double seq_aux_loss() const { return router_.seq_aux_loss(); }
  // Tokens routed to each expert by the last forward (before capacity dropping), E entries.
  const int64_t* expert_counts() const { return router_.tokens_per_expert().ptr<int64_t>(); }
  int64_t num_experts() const { return cfg_.num_experts; }

  const MoeConfig& config() const { return cfg_; }
  const Router& router() const { return router_; }
  const Dispatcher& dispatcher() const { return *dispatcher_; }
  Dispatcher& dispatcher() { return *dispatcher_; }
  const Experts& experts() const { return experts_; }
  const DispatchPlan& plan() const { return *plan_; }  // REQUIRES: after forward

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  MoeConfig cfg_;
  int64_t hidden_, max_tokens_;
  std::string prefix_;
  double init_std_ = 0.02;
  // The router's: moe.router_init_std, or (0) the layer's init_std_.
  double router_init_std() const { return cfg_.router_init_std > 0 ? cfg_.router_init_std : init_std_; }
  std::unique_ptr<Dispatcher> dispatcher_;
  Router router_;
  Experts experts_;
  bool recompute_act_ = false, recompute_whole_ = false, offload_rows_ = false, offload_gu_ = false;
  bool phased_ = false;
  bool fp8_rows_ = false;  // moe.fp8_dispatch in effect
  Tensor packed_TW_;       // fp8_rows_: the tokens quantized for dispatch (scratch)
  Tensor x_TH_;            // the input (a view of the caller's)
  Tensor out_RH_;          // the experts' outputs (max_rows rows)
  Tensor dout_RH_, drows_RH_,
      dprob_TK_;  // scratch (or exchange_scratch): backward workspaces (max_rows / max_tokens rows)
  Tensor y_TH_;   // scratch: the recomputed output (moe)
  const DispatchPlan* plan_ = nullptr;
  int64_t num_tokens_ = 0;
};

}  // namespace moefold
