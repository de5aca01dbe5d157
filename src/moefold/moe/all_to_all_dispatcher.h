// Expert-parallel dispatch (Megatron-Core's all-to-all token dispatcher, parallel folding's MoE
// side): the E experts are split over the EP group in contiguous blocks, each rank routes its own
// tokens exactly as LocalDispatcher does, then exchanges counts (all_to_all) and rows
// (all_to_all_v) so that every rank's experts see their rows from all EP ranks, expert-major.
// Gradient rule: every backward WRITES its activation gradients (no parameters); each data
// backward is the transpose of its forward path (reorder^T, all_to_all_v back, un-permute).
// Shape letters: T tokens (this rank), H hidden, K top-k, E global experts, L = E / EP local
// experts, P EP peers, S home rows (this rank's tokens sorted by global expert, padding included),
// R rows handed to the local experts (received from all peers).
#pragma once

#include <cstdint>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/moe/dispatcher.h"
#include "moefold/moe/ep_exchange.h"
#include "moefold/moe/moe_config.h"

namespace moefold {

// The DispatchPlan of an EP dispatch (the fields of EpPlan, whose sources are the P peers).
struct AllToAllPlan : EpPlan {
  Tensor recv_counts_PL;  // i64 [P, L]: rows peer p sent to local expert l (padding included)
};

class AllToAllDispatcher final : public Dispatcher {
 public:
  // EP rank r holds global experts [r*L, (r+1)*L). REQUIRES: cfg.validate() passes; E % EP == 0
  // (MF_CHECK; config validation reports it to users); every rank of `ep` constructs its
  // dispatcher with the same cfg and max_tokens (they bound what a peer can send); `ep` outlives
  // this dispatcher.
  AllToAllDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep);

  // Most rows one rank can receive (ep_max_recv_rows): every peer sends all its rows here in the
  // worst case.
  static int64_t max_recv_rows(const MoeConfig& cfg, int64_t max_tokens, int ep_size) {
    return ep_max_recv_rows(cfg, max_tokens, ep_size);
  }

  void bind(Memory& mem) override;
  int64_t num_local_experts() const override { return ex_.num_local(); }
  int64_t first_local_expert() const override { return ex_.ep().rank() * ex_.num_local(); }
  int64_t max_rows() const override { return ex_.max_rows(); }
  // The EP view of the last dispatch (REQUIRES: after dispatch).
  const AllToAllPlan& plan() const { return plan_; }
  Communicator& group() const { return ex_.ep(); }

  // Collective over the EP group (count exchange, then rows): every EP rank calls it together.
  const DispatchPlan& dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) override;
  // Collective. Sends the expert outputs home and keeps them there for combine_backward.
  void combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) override;
  // Collective. dprob is computed at home from the outputs combine brought back (out_RH is only
  // shape-checked). REQUIRES: combine() ran on this plan.
  void combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan, const Tensor& dout_RH,
                        const Tensor& dprob_TK) override;
  // Collective.
  void dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) override;

 private:
  // Buffers and steps; the home rows (own_SH) are this rank's send rows.
  EpExchange ex_;
  AllToAllPlan plan_;
};

}  // namespace moefold
