// Expert-parallel dispatch (Megatron-Core's all-to-all token dispatcher, parallel folding's MoE
// side): the E experts are split over the EP group in contiguous blocks, each rank routes its own
// tokens exactly as LocalDispatcher does, then exchanges counts (all_gather) and rows so that
// every rank's experts see their rows from all EP ranks.
//
// Pipelined: the rows from each peer travel in moe.ep_overlap_chunks rounds while the experts run
// the pieces that are already here: first half of this rank's own rows (which never travel), then
// each round as it lands, last the other own half while the last round's outputs travel home
// (each round's outputs leave as soon as the experts finish it). The backward runs all own rows
// as one piece (each piece adds a pass over the f32 expert weight gradients) while round 0's dout
// arrives, then the rounds, each round's drows leaving as soon as its input gradients are done.
// On one rank the own rows are one piece. The own rows' outputs and gradients never leave home:
// the experts write and read them there. Only the grouped GEMMs' row order differs from an
// unpipelined dispatch: the experts' rows are grouped by source, each piece expert-major.
// Transport (EpTransport, chosen by parallel.ep_transport at the first dispatch): PeerMemory
// copies into the peers' rows where the EP group's GPUs share a host (copy engines: no SMs taken
// from the experts' GEMMs), else the communicator's start_exchange (NCCL send/recv).
// Gradient rule: every backward WRITES its activation gradients (no parameters); each data
// backward is the transpose of its forward path.
// Shape letters: T tokens (this rank), H hidden, K top-k, E global experts, L = E / EP local
// experts, P EP peers, C pieces per peer (rounds), S home rows (this rank's tokens sorted by
// global expert, padding included), R rows handed to the local experts (received from all peers).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/moe/dispatcher.h"
#include "moefold/moe/ep_exchange.h"
#include "moefold/moe/ep_layout.h"
#include "moefold/moe/ep_transport.h"
#include "moefold/moe/moe_config.h"

namespace moefold {

// The DispatchPlan of an EP dispatch (the fields of EpPlan, whose sources are the P peers;
// gather_R / scatter_R stay undefined: the rows are never reordered expert-major).
struct AllToAllPlan : EpPlan {
  Tensor recv_counts_PL;  // i64 [P, L]: rows peer p sent to local expert l (padding included)
};

class AllToAllDispatcher final : public Dispatcher, private PieceSchedule {
 public:
  // EP rank r holds global experts [r*L, (r+1)*L). REQUIRES: cfg.validate() passes; E % EP == 0
  // (MF_CHECK; config validation reports it to users); every rank of `ep` constructs its
  // dispatcher with the same cfg and max_tokens (they bound what a peer can send); `ep` outlives
  // this dispatcher.
  AllToAllDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep,
                     EpTransportChoice transport = EpTransportChoice::automatic);

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
  // The transport the rounds travel by (REQUIRES: after the first dispatch since bind).
  const EpTransport& transport() const;

  // Collective over the EP group (count exchange, then the rounds of rows are started): every EP
  // rank calls it together. Returns before the rows of other ranks have arrived: the plan's
  // schedule says when each piece's have (PieceSchedule::rows_arrived).
  const DispatchPlan& dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) override;
  // Collective. Waits for the outputs started home by outputs_done and keeps them at home for
  // combine_backward.
  void combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) override;
  // Collective. dprob is computed at home from the outputs combine brought back (out_RH is only
  // shape-checked); the dout rows of other ranks' tokens are started (output_grads_arrived).
  void combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan, const Tensor& dout_RH,
                        const Tensor& dprob_TK) override;
  // Collective. Waits for the drows started home by input_grads_done.
  void dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) override;

 private:
  // Its plans' PieceSchedule (the rounds of rows in flight). The own pieces' outputs go straight
  // home (home_SH), their output gradients are read and their input gradients written at home
  // (own_SH: each row's dout is dead once the experts' second linear layer has its gradients,
  // before the first one writes drows).
  Tensor output_rows(const DispatchPlan& plan, size_t piece, const Tensor& out_RH) const override;
  Tensor output_grad_rows(const DispatchPlan& plan, size_t piece, const Tensor& dout_RH) const override;
  Tensor input_grad_rows(const DispatchPlan& plan, size_t piece, const Tensor& drows_RH) const override;
  void rows_arrived(size_t piece) override;
  void outputs_done(size_t piece, const Tensor& out_RH) override;
  void output_grads_arrived(size_t piece) override;
  void input_grads_done(size_t piece, const Tensor& drows_RH) override;

  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  EpTransportChoice choice_;
  // One direction of one round in flight: the exchange's ticket, and the pieces still to finish
  // before it starts (outputs / drows) or whether the context's stream waited for it (rows / dout).
  struct Round {
    int64_t ticket = -1;
    int64_t pending = 0;
    bool waited = false;
  };
  using Leg = EpLeg;
  // Starts round j of `leg` between the home rows (own_SH / home_SH) and the round's pieces of
  // `rows_RH` (the experts' rows, outputs, output gradients or input gradients).
  int64_t start_round(int64_t j, Leg leg, const Tensor& rows_RH);
  // The pieces of a direction, their sources and each round's pieces: forward (dispatch and
  // combine) runs plan_.pieces, backward (dout and drows) plan_.backward_pieces.
  struct Schedule {
    std::vector<RowPiece>* pieces = nullptr;
    std::vector<EpPieceSource> sources;       // by piece
    std::vector<std::vector<size_t>> rounds;  // by round: its pieces, one per peer
  };
  const Schedule& schedule(Leg leg) const { return leg == Leg::dispatch || leg == Leg::combine ? fwd_ : bwd_; }
  // Fills `s` with the layout pieces `order` (indices into laid_out_).
  void set_schedule(Schedule& s, std::vector<RowPiece>& pieces, const std::vector<size_t>& order);
  void check_piece(const Schedule& s, size_t piece) const;
  // rows_arrived / output_grads_arrived: the context's stream waits for the piece's round once.
  void wait_round(const Schedule& s, size_t piece, std::vector<Round>& rounds, const char* what);
  // outputs_done / input_grads_done: the piece's rows of rows_RH go home with the last piece of
  // their round (that round started); the own pieces' are home already.
  void piece_done(const Schedule& s, size_t piece, const Tensor& rows_RH, Leg leg, std::vector<Round>& rounds,
                  int64_t& left, const char* what);
  // The own piece's home rows of `home_SH`, or the piece's rows of `rows_RH`.
  Tensor piece_rows(const Schedule& s, const DispatchPlan& plan, size_t piece, const Tensor& rows_RH,
                    const Tensor& home_SH) const;

  MoeConfig cfg_;
  EpExchange ex_;
  AllToAllPlan plan_;
  const Memory* mem_ = nullptr;
  std::unique_ptr<EpTransport> transport_;  // null until the first dispatch after bind
  Tensor all_counts_PE_;                    // i64 [P, E], host: every rank's home counts (last dispatch)
  EpLayout layout_;                         // where every row goes, from all_counts_PE_
  Mirrored piece_offsets_;                  // i64 [pieces, L + 1]: every piece's expert offsets
  Schedule fwd_, bwd_;
  std::vector<Round> rows_, outputs_, douts_, drows_;  // by round
  // Scratch kept between dispatches (no allocation in a step once they have grown).
  std::vector<EpLayoutPiece> laid_out_;
  std::vector<size_t> order_;
  std::vector<EpMove> moves_;
  int64_t outputs_left_ = 0, drows_left_ = 0;  // pieces not yet done this pass
};

}  // namespace moefold
