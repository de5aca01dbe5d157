// The expert-parallel exchange shared by AllToAllDispatcher and AllGatherDispatcher (internal):
// home routing of this rank's tokens, the counts-first all_to_all_v over the EP group and the
// source-major <-> expert-major reorder, with the home-side steps of combine and the backwards.
// Gradient rule: every backward WRITES its activation gradients; each is its forward transposed.
// Shape letters: T tokens (this rank), H hidden, K top-k, E global experts, L = E / EP local
// experts, P EP peers, B sources per peer (1, or G ETP ranks), S home rows (this rank's tokens
// sorted by global expert, padding included; s_max bounds it), X rows sent over EP (peer-major),
// R rows handed to the local experts.
#pragma once

#include <cstdint>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/moe/dispatcher.h"
#include "moefold/moe/moe_config.h"

namespace moefold {

// What every EP plan holds on top of a DispatchPlan: counts_E / offsets_E1 / num_rows / rows_RH
// describe the L LOCAL experts' rows (expert-major, and within an expert by source); row_TK /
// token_R are this rank's own permutation into its S home rows, not into rows_RH.
struct EpPlan : DispatchPlan {
  int64_t num_home_rows = 0;  // S: this rank's home rows (its assignments, padding included)
  Tensor home_counts_E;       // i64 [E]: this rank's home rows per GLOBAL expert
  Tensor home_offsets_E1;     // i64 [E+1]: first home row of each global expert
  Tensor send_counts_P;       // i64 [P]: rows to EP peer p (the rows of p's experts, in order)
  Tensor recv_counts_P;       // i64 [P]: rows received from EP peer p
  Tensor gather_R;            // i64 [R]: rows_RH[r] = received[gather_R[r]] (source-major -> expert-major)
  Tensor scatter_R;           // i64 [R]: received[i] = rows_RH[scatter_R[i]] (the inverse)
};

// Most rows one rank can receive from the P = ep_size peers of one source each: P times what one
// peer can send to one rank's L experts, T * min(K, L) dropless (each token's K experts are
// distinct), L * capacity(T) padded, the smaller of the two with a capacity.
int64_t ep_max_recv_rows(const MoeConfig& cfg, int64_t max_tokens, int ep_size);

// REQUIRES: `plan` is `mine` (the dispatcher's last dispatch); aborts naming `op` otherwise.
void ep_check_plan(const DispatchPlan& plan, const EpPlan& mine, const char* op);

// Buffers and steps of an EP dispatch whose rows come from B sources per EP peer. The owning
// dispatcher fills its plan through these calls, in order: route_home, (its own send plan),
// exchange_counts, to_experts; combine and the backwards use the rest.
class EpExchange {
 public:
  // who: the owning dispatcher, for errors. etp: the ETP group whose G ranks are the sources of
  // each EP peer (F % G == 0 is checked), null for one source; with it the exchange also keeps
  // the buffers of the expert-major reorder (plan_reorder, to_experts, from_experts).
  // REQUIRES: cfg.validate() passes; E % EP == 0 (MF_CHECK); the groups outlive this object.
  EpExchange(const char* who, const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep,
             const Communicator* etp = nullptr);

  // Plans the shared buffers (index buffers, then own/home/recv/rows rows). row_width, row_dtype:
  // the rows the dispatch leg moves (Dispatcher::row_width / row_dtype: [*, H] in the model's
  // dtype, or packed FP8 rows with moe.fp8_dispatch): rows_RH holds them, and own_rows views
  // own_SH's memory as them; the other legs keep [*, H] in the model's dtype.
  void bind(Memory& mem, int64_t row_width, DType row_dtype);
  int64_t hidden() const { return hidden_; }
  int64_t num_local() const { return num_local_; }
  int64_t s_max() const { return s_max_; }
  // B * ep_max_recv_rows: every source of every peer sends all its rows here in the worst case.
  int64_t max_rows() const { return sources_ * ep_max_recv_rows(cfg_, max_tokens_, ep_.size()); }
  Communicator& ep() const { return ep_; }
  // own_SH, home_SH and rows_RH are peer-visible (Memory::peer_act).
  // [S max, H]: this rank's x rows after route_home, its home gradient in the backwards.
  const Tensor& own_SH() const { return own_SH_; }
  // [S max, H]: the (summed) expert outputs at home, kept from combine to combine_backward.
  const Tensor& home_SH() const { return home_SH_; }
  // [max_rows, H] (fp8_rows: [max_rows, W] packed): the rows handed to the experts (kept until
  // their backward).
  const Tensor& rows_RH() const { return rows_RH_; }
  // own_SH's memory as [S max] rows of the dispatched format (the x rows in dispatch).
  const Tensor& own_rows() const { return own_rows_; }
  // i64 [P * B * L], host: rows from (peer p, source b) to local expert l (after exchange_counts).
  const Tensor& recv_counts() const { return recv_counts_PBL_; }
  // i64 [E], host: home_counts_E of the last route_home.
  const Tensor& home_counts_host() const { return home_counts_E_.host; }

  // 1. Checks x_TH / topk_idx_TK, routes this rank's tokens into home rows sorted by global
  //    expert (LocalDispatcher's plan: capacity from this rank's T, drops and padding decided
  //    before any exchange) and, with permute_x, permutes x into own_SH. Fills num_tokens,
  //    capacity, row_TK, token_R, topk_prob_TK, num_home_rows, home_counts_E, home_offsets_E1.
  void route_home(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK, EpPlan& p,
                  bool permute_x = true);
  // 2. Collective over EP: block q of send_counts_PBL (i64 [P * B * L], host) is what peer q's experts
  //    get from each source. Fills num_rows, counts_E, send_counts_P, recv_counts_P.
  void exchange_counts(const Tensor& send_counts_PBL, EpPlan& p);
  // 2, one source per peer: the same plan from an all_gather of every rank's home counts into
  //    all_counts_PE (i64 [P, E], host), which also tells each rank every other rank's layout.
  void gather_counts(const Tensor& all_counts_PE, EpPlan& p);
  // 2b. The source-major -> expert-major reorder of to_experts / from_experts: fills offsets_E1,
  //    gather_R, scatter_R, rows_RH (received source-major, (q, b, l) blocks; expert l's rows from
  //    earlier sources come first).
  void plan_reorder(EpPlan& p);
  // 3. Collective: send_XH (peer-major, send_counts_P) -> rows_RH, expert-major. Rows of any
  //    width and dtype (x rows or output gradients); send and rows agree.
  void to_experts(const Tensor& send_XH, const EpPlan& p, const Tensor& rows_RH);
  // The transpose of to_experts: rows_RH -> send_XH.
  void from_experts(const Tensor& rows_RH, const EpPlan& p, const Tensor& send_XH);

  // REQUIRES: t_RH is [R, H] of the plan.
  void check_rows(const Tensor& t_RH, const EpPlan& p, const char* what) const;
  // y_TH from the outputs in home_SH (brought there by the caller); allows combine_backward.
  void combine_home(const EpPlan& p, const Tensor& y_TH);
  // The home gradient (into own_SH) and dprob from the outputs kept in home_SH; out_RH and
  // dout_RH are only shape-checked. REQUIRES: combine_home ran on this plan.
  void combine_backward_home(const EpPlan& p, const Tensor& dy_TH, const Tensor& out_RH, const Tensor& dout_RH,
                             const Tensor& dprob_TK);
  // dx_TH from the home gradient in own_SH (brought there by the caller).
  void dispatch_backward_home(const EpPlan& p, const Tensor& dx_TH);

 private:
  const ExecContext* ctx_ = nullptr;  // where its ops run: the Memory's it was bound through
  MoeConfig cfg_;
  int64_t hidden_, max_tokens_, num_local_, sources_, s_max_;
  Communicator& ep_;
  // Index buffers, sized for max_tokens; plans hold views of their used part. Counts and the
  // plans computed from them live on the host (Mirrored: also on the device where kernels read
  // them), so on a GPU every dispatch waits for its counts (as Megatron's all-to-all dispatcher does).
  Mirrored home_counts_E_;
  Tensor home_offsets_E1_, row_TK_, home_token_S_, recv_counts_PBL_, send_counts_P_, recv_counts_P_;
  Mirrored counts_L_, offsets_L1_, gather_R_, scatter_R_;
  // Row buffers: own_SH_ (x rows in dispatch; then dy / dx rows in the backwards), home_SH_
  // (expert outputs back home), recv_RH_ (source-major staging of the reorder), rows_RH_
  // (the experts' input, kept until their backward).
  Tensor own_SH_, home_SH_, recv_RH_, rows_RH_, own_rows_;
  int64_t row_width_ = 0;
  DType row_dtype_ = DType::f32;
  // Step 2's plan from send_counts_PBL and the received recv_counts_PBL_.
  void plan_counts(const Tensor& send_counts_PBL, EpPlan& p);
  bool reorders_ = false;
  bool combined_ = false;
};

}  // namespace moefold
