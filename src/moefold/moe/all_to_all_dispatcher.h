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
#include "moefold/moe/moe_config.h"

namespace moefold {

// The DispatchPlan of an EP dispatch. The base fields mean what they mean for LocalDispatcher
// with two differences: counts_E / offsets_E1 / num_rows / rows_RH describe the L LOCAL experts'
// rows (received from every peer, expert-major: expert l's rows from peer 0, then peer 1, ...);
// row_TK / token_R are this rank's own permutation into the S home rows (capacity and padding
// applied locally, from this rank's T), not into rows_RH.
struct AllToAllPlan : DispatchPlan {
  int64_t num_home_rows = 0;  // S: rows this rank sends (its assignments, padding included)
  Tensor home_counts_E;       // i64 [E]: home rows per GLOBAL expert (what peers learn as counts)
  Tensor home_offsets_E1;     // i64 [E+1]: first home row of each global expert
  Tensor send_counts_P;       // i64 [P]: home rows to peer p (the rows of p's experts, in order)
  Tensor recv_counts_P;       // i64 [P]: rows received from peer p
  Tensor recv_counts_PL;      // i64 [P, L]: rows peer p sent to local expert l (padding included)
  Tensor gather_R;            // i64 [R]: rows_RH[r] = received[gather_R[r]] (peer-major -> expert-major)
  Tensor scatter_R;           // i64 [R]: received[i] = rows_RH[scatter_R[i]] (the inverse)
};

class AllToAllDispatcher final : public Dispatcher {
 public:
  // EP rank r holds global experts [r*L, (r+1)*L). REQUIRES: cfg.validate() passes; E % EP == 0
  // (MF_CHECK; config validation reports it to users); every rank of `ep` constructs its
  // dispatcher with the same cfg and max_tokens (they bound what a peer can send); `ep` outlives
  // this dispatcher.
  AllToAllDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep);

  // Most rows one rank can receive: EP times what one peer can send to one rank's L experts,
  // T * min(K, L) dropless (each token's K experts are distinct), L * capacity(T) padded, the
  // smaller of the two with a capacity. Every peer sends all its rows here in the worst case.
  static int64_t max_recv_rows(const MoeConfig& cfg, int64_t max_tokens, int ep_size);

  void bind(Memory& mem) override;
  int64_t num_local_experts() const override { return num_local_; }
  int64_t first_local_expert() const override { return ep_.rank() * num_local_; }
  int64_t max_rows() const override { return max_recv_rows(cfg_, max_tokens_, ep_.size()); }
  // The EP view of the last dispatch (REQUIRES: after dispatch).
  const AllToAllPlan& plan() const { return plan_; }
  Communicator& group() const { return ep_; }

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
  void check_plan(const DispatchPlan& plan, const char* op) const;

  MoeConfig cfg_;
  int64_t hidden_, max_tokens_, num_local_;
  Communicator& ep_;
  // Index buffers, sized for max_tokens; plan_ holds views of their used part.
  Tensor home_counts_E_, home_offsets_E1_, row_TK_, home_token_S_;
  Tensor recv_counts_PL_, send_counts_P_, recv_counts_P_, counts_L_, offsets_L1_, gather_R_, scatter_R_;
  // Row buffers: send_SH_ (x rows out in dispatch; then dy / dx rows in the backwards), home_SH_
  // (expert outputs back home, kept from combine to combine_backward), recv_RH_ (peer-major
  // staging for every exchange), rows_RH_ (the experts' input, kept until their backward).
  Tensor send_SH_, home_SH_, recv_RH_, rows_RH_;
  AllToAllPlan plan_;
  bool combined_ = false;
};

}  // namespace moefold
