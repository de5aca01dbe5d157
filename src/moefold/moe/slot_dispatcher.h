// Expert-parallel dispatch with the counts on the device (moe.dispatcher = "slots"): the same
// routing, experts and results as AllToAllDispatcher, without a host round trip, so a step of EP
// layers can be captured as a CUDA graph. The price is fixed sizes chosen at plan time:
// - every rank sends every EP peer one slot of B rows (slot_rows: the worst case, or
//   moe.ep_recv_factor times the average share T K / P), expert-major over the peer's experts,
//   in one all_to_all of fixed size; the per-expert counts travel beside it (an all_to_all of
//   [P, L] integers that stays on the device);
// - the local experts always get R = max_rows() rows (the worst case, or moe.ep_recv_factor
//   times T K), expert-major with each expert's rows in slot (peer) order; the rows the slots
//   leave free pad the last expert as zero rows, which compute and add nothing.
// Rows past either bound cannot be placed: they are left out (no memory outside the buffers is
// touched) and counted on the device into the overflow sink, which the trainer reads with the
// step's statistics and turns into a failed step naming moe.ep_recv_factor; the fill sink gets the
// largest share of a bound any dispatch asked for (the step's `ep_slot_fill`). Free slot rows travel
// as zeros, so the exchange moves P B rows each way whatever the routing (the slack of the bound).
// The whole home side is LocalDispatcher's ops over the slot layout: the home rows ARE the slots.
// Not pipelined (the experts run once all rows have arrived). Needs dropless routing or
// moe.pad_to_capacity (a capacity without padding knows its rows only on the host).
// Gradient rule: every backward WRITES its activation gradients (no parameters).
// Shape letters: T tokens (this rank), H hidden, K top-k, E global experts, L = E / P local
// experts, P EP peers, B rows per slot, X = P B slot rows, S home rows (this rank's tokens sorted
// by global expert), R rows handed to the local experts.
#pragma once

#include <cstdint>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/moe/dispatcher.h"
#include "moefold/moe/moe_config.h"

namespace moefold {

class SlotDispatcher final : public Dispatcher {
 public:
  // EP rank r holds global experts [r L, (r + 1) L). REQUIRES: cfg.validate() passes, E % P == 0,
  // dropless or padded routing, E <= 1024 (all MF_CHECK; config validation reports them to
  // users); every rank of `ep` constructs its dispatcher with the same cfg and max_tokens (the
  // slot sizes); `ep` outlives this dispatcher.
  SlotDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep);

  // B: rows of one slot. Padded: L x capacity (exactly what a peer sends). Dropless: the worst
  // case T min(K, L), or with moe.ep_recv_factor f > 0 at most ceil(f T K / P).
  static int64_t slot_rows(const MoeConfig& cfg, int64_t max_tokens, int ep_size);
  // R: the rows the local experts always get. Padded, P x B (exact); dropless, ep_max_recv_rows
  // (the worst case, or ceil(f T K)).
  static int64_t expert_rows(const MoeConfig& cfg, int64_t max_tokens, int ep_size);

  void bind(Memory& mem) override;
  int64_t num_local_experts() const override { return l_n_; }
  int64_t first_local_expert() const override { return ep_.rank() * l_n_; }
  int64_t max_rows() const override { return r_max_; }  // expert_rows
  int64_t slot_rows() const { return b_n_; }
  void set_overflow_sinks(const Tensor& overflow_1, const Tensor& fill_1) override {
    overflow_sink_ = overflow_1;
    fill_sink_ = fill_1;
  }
  // Where the overflow is added and the fill max-ed: the sinks, else the dispatcher's own
  // counters (zero after bind).
  const Tensor& overflow() const { return overflow_sink_.defined() ? overflow_sink_ : own_overflow_; }
  const Tensor& fill() const { return fill_sink_.defined() ? fill_sink_ : own_fill_; }
  // i64 [P, L] of the last dispatch: rows slot p brought for local expert l (padding excluded).
  const Tensor& recv_counts() const { return recv_counts_PL_; }

  // Collective over the EP group (every EP rank calls each of these together); nothing is read
  // back to the host.
  const DispatchPlan& dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) override;
  void combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) override;
  // REQUIRES: combine ran on this plan (dprob is computed at home from the outputs it brought).
  void combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan, const Tensor& dout_RH,
                        const Tensor& dprob_TK) override;
  void dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) override;

 private:
  void check_plan(const DispatchPlan& plan, const char* op) const;

  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  MoeConfig cfg_;
  int64_t hidden_, max_tokens_;
  Communicator& ep_;
  int64_t p_n_ = 1, l_n_ = 1, b_n_ = 0, r_max_ = 0, s_max_ = 0;
  DType rows_dtype_ = DType::f32;
  // Home plan (moe_permute_plan over the E global experts) and its slot layout.
  Tensor home_counts_E_, home_offsets_E1_, row_TK_, home_token_S_;
  Tensor slot_TK_, token_X_, send_counts_PL_, recv_counts_PL_;
  // Expert side: src_R_ (slot row of each expert row), row_X_ (expert row of each slot row).
  Tensor src_R_, row_X_, counts_L_, offsets_L1_;
  // Slots: send_XH_ and recv_XH_ carry each leg (dispatch in the rows' format: rows_view);
  // home_XH_ keeps the outputs combine brought home until combine_backward.
  Tensor send_XH_, recv_XH_, home_XH_, rows_RH_;
  Tensor own_overflow_, overflow_sink_, own_fill_, fill_sink_;
  DispatchPlan plan_;
  bool combined_ = false;
};

}  // namespace moefold
