// Expert tensor parallelism (Megatron-Core's MoEAllGatherTokenDispatcher with ETP): every expert's
// FFN F is split over the ETP group, so every ETP rank must see the same rows. Each rank routes
// its own tokens into home rows exactly as LocalDispatcher does (capacity from its own T), the
// home rows are all-gathered over ETP, then exchanged over EP (all_to_all_v among the ranks of
// this etp_rank) so that every rank's L experts see the rows of all ETP x EP sources, expert-major.
// The experts' outputs are partial (one F-slice each); combine sends them back and reduce-scatters
// them over ETP (the sum over F-slices) before weighting them at home.
// Gradient rule: every backward WRITES its activation gradients (no parameters); each data
// backward is its forward path reversed (all-gather <-> reduce-scatter, all_to_all_v back).
// Shape letters: T tokens (this rank), H hidden, K top-k, E global experts, L = E / EP local
// experts, G ETP ranks, P EP peers, S home rows (this rank's tokens sorted by global expert,
// padding included; s_max bounds it), X rows sent over EP (all G sources), R rows handed to the
// local experts.
#pragma once

#include <cstdint>
#include <memory>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/moe/dispatcher.h"
#include "moefold/moe/ep_exchange.h"
#include "moefold/moe/moe_config.h"

namespace moefold {

// The DispatchPlan of an ETP (x EP) dispatch: the fields of EpPlan, whose sources are the G ETP
// ranks of each EP peer (within a local expert: EP peer q, then ETP rank g), and the ETP send plan.
struct AllGatherPlan : EpPlan {
  int64_t num_send_rows = 0;  // X: rows sent over EP (every ETP source's rows, by EP peer)
  Tensor home_counts_GE;      // i64 [G, E], host: home_counts_E of every ETP rank (all-gathered)
  Tensor recv_counts_PGL;     // i64 [P, G, L]: rows from (EP peer p, its ETP source g) to local expert l
  Tensor pack_X;              // i64 [X]: send[i] = gathered[pack_X[i]] (gathered: [G * s_max] rows)
  Tensor unpack_GS;           // i64 [G * s_max]: gathered[j] = send[unpack_GS[j]] (-1: row unused, 0)
};

class AllGatherDispatcher final : public Dispatcher {
 public:
  // ETP rank g holds F-slice [g*F/G, (g+1)*F/G) of every local expert; EP rank p (ep: the ranks of
  // this etp_rank; null: no expert parallelism) holds global experts [p*L, (p+1)*L). REQUIRES:
  // cfg.validate() passes; F % G == 0 and E % P == 0 (MF_CHECK; config validation reports them to
  // users); every rank of both groups builds its dispatcher with the same cfg and max_tokens; the
  // groups outlive this dispatcher.
  AllGatherDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& etp,
                      Communicator* ep = nullptr);

  void bind(Memory& mem) override;
  int64_t num_local_experts() const override { return ex_.num_local(); }
  int64_t first_local_expert() const override { return ex_.ep().rank() * ex_.num_local(); }
  // G times AllToAllDispatcher's bound: G * P sources, each sending at most what one rank's
  // tokens can put on L experts.
  int64_t max_rows() const override { return ex_.max_rows(); }
  // The F-slice the experts fed by this dispatcher hold.
  int64_t ffn_local() const { return cfg_.moe_intermediate_size / etp_.size(); }
  int64_t ffn_first() const { return etp_.rank() * ffn_local(); }
  FfnSlice ffn_slice(int64_t) const override { return {ffn_first(), ffn_local()}; }
  const AllGatherPlan& plan() const { return plan_; }  // REQUIRES: after dispatch
  Communicator& etp_group() const { return etp_; }
  Communicator& ep_group() const { return ex_.ep(); }

  // Collective over ETP (all-gather), then over EP (counts, rows).
  const DispatchPlan& dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) override;
  // Collective. out_RH holds this rank's PARTIAL expert outputs; the summed home outputs are kept
  // for combine_backward.
  void combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) override;
  // Collective. dprob is computed at home from the summed outputs (out_RH only shape-checked);
  // dout_RH is the full gradient of every row (the same on every ETP rank). REQUIRES: combine ran.
  void combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan, const Tensor& dout_RH,
                        const Tensor& dprob_TK) override;
  // Collective. drows_RH is PARTIAL (one F-slice); the reduce-scatter over ETP sums it.
  void dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) override;

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  // home_SH rows of every ETP rank -> rows_RH (dispatch, combine_backward).
  void rows_out(const Tensor& home_SH, const Tensor& rows_RH);
  // rows_RH -> the sum over ETP of every ETP rank's rows, at their home (combine, dispatch_backward).
  void rows_back(const Tensor& rows_RH, const Tensor& home_SH);

  MoeConfig cfg_;
  int64_t hidden_;
  Communicator& etp_;
  std::unique_ptr<Communicator> self_ep_;  // the one-rank EP group when none is given
  // The EP exchange of G sources per peer: home routing, own_SH (x rows in dispatch, dhome in the
  // backwards), home_SH (summed outputs, kept from combine to combine_backward), EP staging, rows.
  EpExchange ex_;
  // The ETP side (max sizes; plan_ holds views of their used part): gathered_GSH_ (G blocks of
  // s_max rows), send_XH_ (rows over EP, peer-major).
  Tensor home_counts_GE_, send_counts_PGL_;  // host
  Mirrored pack_X_, unpack_GS_;
  Tensor gathered_GSH_, send_XH_;
  AllGatherPlan plan_;
};

}  // namespace moefold
