// AllToAllDispatcher: EpExchange with one source per EP peer. Local permute, counts-first, then
// the rows in rounds of point-to-point exchanges that run beside the experts (see the header);
// every backward runs the same path in reverse.
#include "moefold/moe/all_to_all_dispatcher.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "moefold/core/profile.h"
#include "moefold/ops/moe_ops.h"

namespace moefold {

AllToAllDispatcher::AllToAllDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep,
                                       EpTransportChoice transport)
    : choice_(transport),
      cfg_(cfg),
      ex_("AllToAllDispatcher", cfg, hidden, max_tokens, ep),
      layout_(ep.size(), ex_.num_local(), cfg.ep_overlap_chunks) {}

void AllToAllDispatcher::bind(Memory& mem) {
  ctx_ = &mem.exec();
  ex_.bind(mem, row_width(ex_.hidden()), row_dtype(mem.dtype()));
  const int64_t p_n = ex_.ep().size();
  all_counts_PE_ = mem.host_act({p_n, cfg_.num_experts}, DType::i64);
  // Own halves and all own rows (one own piece on one rank), then a piece per peer and round.
  piece_offsets_ = mem.mirrored({layout_.max_pieces(), ex_.num_local() + 1}, DType::i64);
  plan_ = AllToAllPlan{};
  outputs_left_ = drows_left_ = 0;
  mem_ = &mem;
  transport_.reset();  // the peer-visible block may be new: chosen (mapped) again by the next dispatch
}

const EpTransport& AllToAllDispatcher::transport() const {
  MF_CHECK(transport_ != nullptr, "AllToAllDispatcher::transport: no dispatch since bind");
  return *transport_;
}

int64_t AllToAllDispatcher::start_round(int64_t j, Leg leg, const Tensor& rows_RH) {
  const int me = ex_.ep().rank();
  const Schedule& sch = schedule(leg);
  // The home side: x rows out (own_SH as the dispatched rows), outputs in (home_SH), dout rows out
  // and drows in (own_SH).
  const Tensor& home_SH = leg == Leg::combine ? ex_.home_SH() : leg == Leg::dispatch ? ex_.own_rows() : ex_.own_SH();
  moves_.clear();
  for (const size_t i : sch.rounds[static_cast<size_t>(j)]) {
    const int q = sch.sources[i].peer;
    const auto [a, b] = layout_.home_part(me, q, j);
    const RowPiece& piece = (*sch.pieces)[i];
    moves_.push_back(EpMove{q, home_SH.slice(a, b), rows_RH.slice(piece.begin, piece.end),
                            layout_.home_part(q, me, j).first, layout_.piece_row(q, me, j)});
  }
  return transport_->start(leg, moves_);
}

void AllToAllDispatcher::check_piece(const Schedule& s, size_t piece) const {
  MF_CHECK(piece < s.pieces->size(), "AllToAllDispatcher: piece ", piece, " of ", s.pieces->size());
}

void AllToAllDispatcher::set_schedule(Schedule& s, std::vector<RowPiece>& pieces, const std::vector<size_t>& order) {
  const int64_t c_n = ex_.ep().size() > 1 ? cfg_.ep_overlap_chunks : 0;
  s.pieces = &pieces;
  pieces.clear();
  s.sources.clear();
  for (const size_t i : order) {
    const EpLayoutPiece& lp = laid_out_[i];
    const int64_t l_n = ex_.num_local(), at = static_cast<int64_t>(i);
    pieces.push_back(RowPiece{lp.begin, lp.end, piece_offsets_.dev.slice(at, at + 1).view({l_n + 1})});
    s.sources.push_back(lp.source);
  }
  s.rounds.resize(static_cast<size_t>(c_n));
  for (std::vector<size_t>& r : s.rounds) r.clear();
  for (size_t i = 0; i < pieces.size(); ++i)
    if (s.sources[i].round >= 0) s.rounds[static_cast<size_t>(s.sources[i].round)].push_back(i);
}

const DispatchPlan& AllToAllDispatcher::dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                                 const Tensor& topk_prob_TK) {
  AllToAllPlan& p = plan_;
  p.schedule = this;  // the rounds in flight: this dispatcher's PieceSchedule side
  const int me = ex_.ep().rank(), p_n = ex_.ep().size();
  const int64_t l_n = ex_.num_local(), c_n = p_n > 1 ? cfg_.ep_overlap_chunks : 0;
  // 1. This rank's tokens into home rows sorted by global expert, before any exchange (x is
  //    permuted below, straight into the rows that stay here).
  ex_.route_home(x_TH, topk_idx_TK, topk_prob_TK, p, false);
  if (transport_ == nullptr) transport_ = choose_ep_transport(choice_, ex_.ep(), *mem_, ex_);
  // 2. Counts first: every rank's home counts to every rank (an all_gather): how many rows each
  //    peer sends to each local expert, and where every rank puts the rows it receives.
  {
    ProfileScope scope("moe ep counts");  // a host round trip: the GPU idles in it
    ex_.gather_counts(all_counts_PE_, p);
  }
  p.recv_counts_PL = ex_.recv_counts().view({p_n, l_n});  // offsets_E1 stays undefined: see the pieces

  // 3. The pieces (EpLayout::lay_out): rows laid out [own rows | round 0: the peers from me + 1 on
  //    | round 1 | ...]; the layout names the own rows three times (first half, second half:
  //    forward; all: backward).
  layout_.set_counts(all_counts_PE_.ptr<int64_t>());
  const int64_t rows = layout_.lay_out(me, laid_out_, piece_offsets_.host.ptr<int64_t>());
  MF_CHECK(rows == p.num_rows, "dispatch: pieces hold ", rows, " rows of ", p.num_rows);
  const auto [hs0, hs1] = layout_.home_block(me, me);
  const int64_t n_self = hs1 - hs0;
  piece_offsets_.to_device(static_cast<int64_t>(laid_out_.size()), ctx_);
  // Forward: own half, the rounds, own half (layout 0, 3, 4, ..., 1): the first own half runs
  // while round 0 travels to the experts, the last one while the last round's outputs travel
  // home. Backward: all own rows as one piece (layout 2: fewer passes over the expert weight
  // gradients), then the rounds: dout of round 0 travels under the own rows, each round's drows
  // under its own weight gradient and the next round. One rank: the own rows, one piece.
  const size_t n_layout = laid_out_.size();
  order_.clear();
  if (p_n == 1) {
    order_.push_back(0);
  } else {
    order_.push_back(0);
    for (size_t i = 3; i < n_layout; ++i) order_.push_back(i);
    order_.push_back(1);
  }
  set_schedule(fwd_, p.pieces, order_);
  if (p_n > 1) {
    order_.pop_back();  // the last own half
    order_[0] = 2;      // all own rows for the first
  }
  set_schedule(bwd_, p.backward_pieces, order_);
  const Round fresh{-1, p_n - 1, false};
  rows_.assign(static_cast<size_t>(c_n), fresh);
  outputs_.assign(static_cast<size_t>(c_n), fresh);
  douts_.assign(static_cast<size_t>(c_n), fresh);
  drows_.assign(static_cast<size_t>(c_n), fresh);
  outputs_left_ = static_cast<int64_t>(p.pieces.size());
  drows_left_ = 0;

  // 4. x into the rows: the own block straight into the experts' rows, the others' blocks into the
  //    home rows that travel; then every round is started.
  p.rows_RH = ex_.rows_RH().slice(0, p.num_rows);
  const Tensor own = ex_.own_rows();
  const int64_t s_n = p.num_home_rows;
  if (hs0 > 0) moe_permute(*ctx_, x_TH, p.token_R.slice(0, hs0), own.slice(0, hs0));
  if (s_n > hs1) moe_permute(*ctx_, x_TH, p.token_R.slice(hs1, s_n), own.slice(hs1, s_n));
  moe_permute(*ctx_, x_TH, p.token_R.slice(hs0, hs1), p.rows_RH.slice(0, n_self));
  for (int64_t j = 0; j < c_n; ++j) rows_[static_cast<size_t>(j)].ticket = start_round(j, Leg::dispatch, p.rows_RH);
  return p;
}

void AllToAllDispatcher::wait_round(const Schedule& s, size_t piece, std::vector<Round>& rounds, const char* what) {
  check_piece(s, piece);
  const int64_t j = s.sources[piece].round;
  if (j < 0) return;  // own rows: in place already
  Round& r = rounds[static_cast<size_t>(j)];
  if (!r.waited) {
    ProfileScope scope(what);  // how long the context's stream waits: the exposed transfer
    transport_->wait(r.ticket);
  }
  r.waited = true;
}

void AllToAllDispatcher::piece_done(const Schedule& s, size_t piece, const Tensor& rows_RH, Leg leg,
                                    std::vector<Round>& rounds, int64_t& left, const char* what) {
  check_piece(s, piece);
  ex_.check_rows(rows_RH, plan_, what);
  const EpPieceSource& src = s.sources[piece];
  --left;
  if (src.round < 0) return;  // own rows: written at home
  Round& r = rounds[static_cast<size_t>(src.round)];
  MF_CHECK(r.pending > 0, what, ": piece ", piece, " reported twice");
  if (--r.pending == 0) r.ticket = start_round(src.round, leg, rows_RH);
}

Tensor AllToAllDispatcher::piece_rows(const Schedule& s, const DispatchPlan& plan, size_t piece, const Tensor& rows_RH,
                                      const Tensor& home_SH) const {
  ep_check_plan(plan, plan_, "piece_rows");
  check_piece(s, piece);
  const RowPiece& pc = (*s.pieces)[piece];
  const EpPieceSource& src = s.sources[piece];
  if (src.round < 0) return home_SH.slice(src.home, src.home + (pc.end - pc.begin));
  return rows_RH.slice(pc.begin, pc.end);
}

Tensor AllToAllDispatcher::output_rows(const DispatchPlan& plan, size_t piece, const Tensor& out_RH) const {
  return piece_rows(fwd_, plan, piece, out_RH, ex_.home_SH());
}
Tensor AllToAllDispatcher::output_grad_rows(const DispatchPlan& plan, size_t piece, const Tensor& dout_RH) const {
  return piece_rows(bwd_, plan, piece, dout_RH, ex_.own_SH());
}
Tensor AllToAllDispatcher::input_grad_rows(const DispatchPlan& plan, size_t piece, const Tensor& drows_RH) const {
  return piece_rows(bwd_, plan, piece, drows_RH, ex_.own_SH());
}

void AllToAllDispatcher::rows_arrived(size_t piece) { wait_round(fwd_, piece, rows_, "moe ep wait rows"); }

void AllToAllDispatcher::outputs_done(size_t piece, const Tensor& out_RH) {
  piece_done(fwd_, piece, out_RH, Leg::combine, outputs_, outputs_left_, "outputs_done");
}

void AllToAllDispatcher::combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) {
  ep_check_plan(plan, plan_, "combine");
  const AllToAllPlan& p = plan_;
  ex_.check_rows(out_RH, p, "combine out");
  MF_CHECK(outputs_left_ == 0, "combine: ", outputs_left_,
           " pieces' outputs were not reported by outputs_done (run the experts with run_experts_forward)");
  // Every output row is home: the own ones written there by the experts, the others brought by
  // the rounds.
  {
    ProfileScope scope("moe ep wait outputs");
    for (const Round& r : outputs_) transport_->wait(r.ticket);
  }
  ex_.combine_home(p, y_TH);
}

void AllToAllDispatcher::combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan,
                                          const Tensor& dout_RH, const Tensor& dprob_TK) {
  ep_check_plan(plan, plan_, "combine_backward");
  const AllToAllPlan& p = plan_;
  // d(home rows) into own_SH and dprob at home (dprob needs the outputs combine brought back),
  // then every round of the others' blocks started (the own rows' dout is read at home).
  ex_.combine_backward_home(p, dy_TH, out_RH, dout_RH, dprob_TK);
  const Round fresh{-1, ex_.ep().size() - 1, false};
  douts_.assign(douts_.size(), fresh);
  drows_.assign(drows_.size(), fresh);
  for (size_t j = 0; j < douts_.size(); ++j)
    douts_[j].ticket = start_round(static_cast<int64_t>(j), Leg::dout, dout_RH);
  drows_left_ = static_cast<int64_t>(p.backward_pieces.size());
}

void AllToAllDispatcher::output_grads_arrived(size_t piece) { wait_round(bwd_, piece, douts_, "moe ep wait dout"); }

// own_SH's home gradients of other ranks' experts are dead once sent (the rounds of dout left
// before these, in order on the communicator's stream or pulled before the peer pushes back): it
// takes their drows back.
void AllToAllDispatcher::input_grads_done(size_t piece, const Tensor& drows_RH) {
  piece_done(bwd_, piece, drows_RH, Leg::drows, drows_, drows_left_, "input_grads_done");
}

void AllToAllDispatcher::dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) {
  ep_check_plan(plan, plan_, "dispatch_backward");
  const AllToAllPlan& p = plan_;
  ex_.check_rows(drows_RH, p, "dispatch_backward drows");
  MF_CHECK(drows_left_ == 0, "dispatch_backward: ", drows_left_,
           " pieces' drows were not reported by input_grads_done (run the experts with run_experts_backward)");
  {
    ProfileScope scope("moe ep wait drows");
    for (const Round& r : drows_) transport_->wait(r.ticket);
  }
  ex_.dispatch_backward_home(p, dx_TH);
}

}  // namespace moefold
