// AllToAllDispatcher: EpExchange with one source per EP peer. Local permute, counts-first
// all-to-all-v over the EP group, and a peer-major -> expert-major reorder; every backward runs the
// same path in reverse.
#include "moefold/moe/all_to_all_dispatcher.h"

namespace moefold {

AllToAllDispatcher::AllToAllDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep)
    : ex_("AllToAllDispatcher", cfg, hidden, max_tokens, ep) {}

void AllToAllDispatcher::bind(Memory& mem) {
  ex_.bind(mem);
  plan_ = AllToAllPlan{};
}

const DispatchPlan& AllToAllDispatcher::dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                                 const Tensor& topk_prob_TK) {
  AllToAllPlan& p = plan_;
  // 1. This rank's tokens into home rows sorted by global expert, before any exchange.
  ex_.route_home(x_TH, topk_idx_TK, topk_prob_TK, p);
  // 2. Counts first: peer p's block of home_counts_E is the rows for p's L experts, so one
  //    equal-block all_to_all tells every rank how many rows each peer sends to each local expert.
  ex_.exchange_counts(ex_.home_counts_host(), p);
  p.recv_counts_PL = ex_.recv_counts().view({ex_.ep().size(), ex_.num_local()});
  // 3. Rows, received peer-major and reordered expert-major.
  ex_.to_experts(ex_.own_SH().slice(0, p.num_home_rows), p, p.rows_RH);
  return p;
}

void AllToAllDispatcher::combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) {
  ep_check_plan(plan, plan_, "combine");
  const AllToAllPlan& p = plan_;
  ex_.check_rows(out_RH, p, "combine out");
  // reorder^T, then the exchange in reverse: every output row returns to its token's home rank.
  ex_.from_experts(out_RH, p, ex_.home_SH().slice(0, p.num_home_rows));
  ex_.combine_home(p, y_TH);
}

void AllToAllDispatcher::combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan,
                                          const Tensor& dout_RH, const Tensor& dprob_TK) {
  ep_check_plan(plan, plan_, "combine_backward");
  const AllToAllPlan& p = plan_;
  // d(home rows) and dprob at home (dprob needs the outputs combine brought back), then forward.
  ex_.combine_backward_home(p, dy_TH, out_RH, dout_RH, dprob_TK);
  ex_.to_experts(ex_.own_SH().slice(0, p.num_home_rows), p, dout_RH);
}

void AllToAllDispatcher::dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) {
  ep_check_plan(plan, plan_, "dispatch_backward");
  const AllToAllPlan& p = plan_;
  ex_.check_rows(drows_RH, p, "dispatch_backward drows");
  ex_.from_experts(drows_RH, p, ex_.own_SH().slice(0, p.num_home_rows));
  ex_.dispatch_backward_home(p, dx_TH);
}

}  // namespace moefold
