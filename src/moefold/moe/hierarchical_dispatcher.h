// Hierarchical expert-parallel dispatch (moe.dispatcher = "hierarchical"): across nodes the links
// are ten times slower than within one, so a token routed to several experts on one remote node
// must cross to that node once, not once per expert.
//
// The EP group of P ranks lies on N nodes of M consecutive EP ranks each (Mesh::ep_node: the M
// ranks of this rank's node; Mesh::ep_rail: the N ranks at this rank's place on theirs). Node n
// holds the experts [n M L, (n + 1) M L) (L per rank). A step of the forward:
//   1. home: each token's kept assignments (the capacity decided from this rank's T, as the
//      all-to-all dispatcher does) are grouped by node; each (token, node) pair becomes one row
//      carrying x and up to S = min(K, M L) of its experts there (node-local indices) with their
//      probabilities (moe_node_route, moe_permute_plan over the N nodes, moe_node_meta);
//   2. the rows cross over the rail (all_to_all_v: NCCL on GPUs, MPI on CPU ranks) to the rank
//      at this rank's place on each node, its own node included;
//   3. that rank, the relay, hands its rows on to the node's experts with an AllToAllDispatcher
//      over ep_node (peer copies on GPUs of one host), the rows as its tokens and their S experts
//      as their top-k (empty slots -1);
//   4. the inner combine sums each row's experts, weighted by their probabilities, at the relay
//      (the within-node reduction); that sum crosses back over the rail, and home adds its token's
//      node sums (moe_permute_backward).
// The backwards run the same path in reverse: dy crosses once per (token, node) and fans out at
// the relay, the probabilities' gradients and the relay's summed input gradients cross back.
// Results equal the all-to-all dispatcher's up to the order of the sums over k (grouped by node
// here). Bytes this rank sends to other nodes are counted per leg (inter_node()).
// Gradient rule: every backward WRITES its activation gradients (no parameters).
// Shape letters: T tokens (this rank), H hidden, K top-k, N nodes, M EP ranks per node, L local
// experts, S expert slots of a node row, R0 home node rows, R1 rows at the relay.
#pragma once

#include <cstdint>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/moe/all_to_all_dispatcher.h"
#include "moefold/moe/dispatcher.h"
#include "moefold/moe/moe_config.h"

namespace moefold {

// Bytes this rank sent to other nodes, per leg, since the last reset.
struct InterNodeBytes {
  int64_t dispatch = 0;  // x rows with their experts and probabilities
  int64_t combine = 0;   // the node sums back home
  int64_t dout = 0;      // dy rows out, the probabilities' gradients back
  int64_t drows = 0;     // the summed input gradients back home
  int64_t total() const { return dispatch + combine + dout + drows; }
};

class HierarchicalDispatcher final : public Dispatcher {
 public:
  // ep: the EP group; node, rail: its ranks on this rank's node and at this rank's place on every
  // node (Mesh::ep_node / ep_rail), so that the EP rank is rail.rank() * node.size() + node.rank().
  // transport: of the within-node exchange. REQUIRES: cfg.validate() passes; E % EP == 0; every
  // rank of ep constructs its dispatcher with the same cfg and max_tokens; the groups outlive it.
  HierarchicalDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep, Communicator& node,
                         Communicator& rail, EpTransportChoice transport = EpTransportChoice::automatic);

  void bind(Memory& mem) override;
  int64_t num_local_experts() const override { return inner_.num_local_experts(); }
  int64_t first_local_expert() const override { return ep_.rank() * inner_.num_local_experts(); }
  int64_t max_rows() const override { return inner_.max_rows(); }
  const InterNodeBytes& inter_node() const { return bytes_; }
  void reset_inter_node() { bytes_ = InterNodeBytes{}; }
  int64_t take_inter_node_bytes() override {
    const int64_t n = bytes_.total();
    reset_inter_node();
    return n;
  }
  // Rows of the last dispatch that crossed to other nodes: the (token, remote node) pairs.
  int64_t inter_node_rows() const { return remote_rows_; }

  // Collective over the EP group (the rail, then the node). The returned plan is the inner
  // dispatcher's: its rows are the relayed rows' assignments at this rank's experts.
  const DispatchPlan& dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) override;
  void combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) override;
  void combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan, const Tensor& dout_RH,
                        const Tensor& dprob_TK) override;
  void dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) override;

 private:
  // rows [*, width] of `from` (this rank's home rows, node-major, send_counts_ per rail peer) to
  // the rail peers and back: `out` leaves home for the relays, else the relays' rows go home.
  void cross(const Tensor& from, const Tensor& to, bool out, int64_t InterNodeBytes::*leg);
  void check_plan(const DispatchPlan& plan, const char* op) const;

  const ExecContext* ctx_ = nullptr;
  MoeConfig cfg_;
  int64_t hidden_, max_tokens_;
  Communicator &ep_, &node_, &rail_;
  int64_t nodes_, per_node_experts_, slots_;
  AllToAllDispatcher inner_;
  int64_t num_tokens_ = 0, home_rows_ = 0, relay_rows_ = 0, remote_rows_ = 0;
  InterNodeBytes bytes_;
  // Home: the capacity's keep plan (capacity only), the node routing, its plan (kept to backward).
  Tensor keep_counts_E_, keep_offsets_E1_, keep_row_TK_, keep_token_R_;
  Tensor node_idx_TK_, slot_TK_, node_offsets_N1_, node_row_TK_, node_token_R_, assign_TK_;
  Mirrored node_counts_N_;
  Tensor send_counts_N_, recv_counts_N_;  // host: rows to / from each rail peer
  // Home rows out and back (x, then the node sums, dy, dx), their experts, probabilities and the
  // probabilities' gradients; the relay's rows (x; y, dy, dx), experts, probabilities (kept: the
  // inner plan views them until its combine_backward) and their gradients.
  Tensor home_rows_XW_, home_h_XH_, home_idx_XS_, home_prob_XS_, home_dprob_XS_;
  Tensor relay_rows_YW_, relay_h_YH_, relay_idx_YS_, relay_prob_YS_, relay_dprob_YS_;
};

}  // namespace moefold
