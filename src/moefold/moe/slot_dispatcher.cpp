// SlotDispatcher: the expert-parallel exchange in fixed-size slots, every count on the device (see
// the header). Each leg is a gather into the slots, one all_to_all of fixed size and a gather out.
#include "moefold/moe/slot_dispatcher.h"

#include <algorithm>
#include <cmath>

#include "moefold/moe/ep_exchange.h"
#include "moefold/ops/moe_ops.h"

namespace moefold {

namespace {
constexpr int64_t kMaxSlotExperts = 1024;  // moe_ep_send_slots / moe_ep_recv_slots
}

int64_t SlotDispatcher::slot_rows(const MoeConfig& cfg, int64_t max_tokens, int ep_size) {
  MF_CHECK(ep_size >= 1 && cfg.num_experts % ep_size == 0, "SlotDispatcher: ", cfg.num_experts, " experts, EP ",
           ep_size);
  const int64_t local = cfg.num_experts / ep_size;
  if (cfg.capacity_factor > 0) return local * cfg.capacity(max_tokens);  // padded: exactly this
  const int64_t worst = max_tokens * std::min(cfg.num_experts_per_tok, local);
  if (!(cfg.ep_recv_factor > 0)) return worst;
  const double share = static_cast<double>(max_tokens * cfg.num_experts_per_tok) / ep_size;
  return std::min(worst, static_cast<int64_t>(std::ceil(cfg.ep_recv_factor * share)));
}

int64_t SlotDispatcher::expert_rows(const MoeConfig& cfg, int64_t max_tokens, int ep_size) {
  if (cfg.capacity_factor > 0) return ep_size * slot_rows(cfg, max_tokens, ep_size);
  return ep_max_recv_rows(cfg, max_tokens, ep_size);
}

SlotDispatcher::SlotDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep)
    : cfg_(cfg), hidden_(hidden), max_tokens_(max_tokens), ep_(ep) {
  MF_CHECK(hidden >= 1 && max_tokens >= 0, "SlotDispatcher: hidden ", hidden, ", max_tokens ", max_tokens);
  MF_CHECK(ep.size() >= 1 && cfg.num_experts % ep.size() == 0, "SlotDispatcher: moe.num_experts = ", cfg.num_experts,
           " not divisible by the ", ep.size(), " ranks of group '", ep.name(), "'");
  MF_CHECK(!(cfg.capacity_factor > 0) || cfg.pad_to_capacity,
           "SlotDispatcher: a capacity without moe.pad_to_capacity leaves row counts only the host knows");
  MF_CHECK(cfg.num_experts <= kMaxSlotExperts, "SlotDispatcher: moe.num_experts = ", cfg.num_experts, " > ",
           kMaxSlotExperts);
  p_n_ = ep.size();
  l_n_ = cfg.num_experts / p_n_;
  b_n_ = slot_rows(cfg, max_tokens, p_n_);
  r_max_ = expert_rows(cfg, max_tokens, p_n_);
  s_max_ = cfg.max_rows(max_tokens);
}

void SlotDispatcher::bind(Memory& mem) {
  ctx_ = &mem.exec();
  const int64_t e_n = cfg_.num_experts, x_n = p_n_ * b_n_, k_n = cfg_.num_experts_per_tok;
  home_counts_E_ = mem.act({e_n}, DType::i64);
  home_offsets_E1_ = mem.act({e_n + 1}, DType::i64);
  row_TK_ = mem.act({max_tokens_, k_n}, DType::i64);
  home_token_S_ = mem.act({s_max_}, DType::i64);
  slot_TK_ = mem.act({max_tokens_, k_n}, DType::i64);
  token_X_ = mem.act({x_n}, DType::i64);
  send_counts_PL_ = mem.act({p_n_, l_n_}, DType::i64);
  recv_counts_PL_ = mem.act({p_n_, l_n_}, DType::i64);
  src_R_ = mem.act({r_max_}, DType::i64);
  row_X_ = mem.act({x_n}, DType::i64);
  counts_L_ = mem.act({l_n_}, DType::i64);
  offsets_L1_ = mem.act({l_n_ + 1}, DType::i64);
  send_XH_ = mem.act({x_n, hidden_});
  recv_XH_ = mem.act({x_n, hidden_});
  home_XH_ = mem.act({x_n, hidden_});
  rows_dtype_ = row_dtype(mem.dtype());
  const Shape rows{r_max_, row_width(hidden_)};
  rows_RH_ = offload_rows_ ? mem.offloaded(rows, rows_dtype_) : mem.act(rows, rows_dtype_);
  own_overflow_ = mem.result({1}, DType::f64);
  own_fill_ = mem.result({1}, DType::f64);
  if (!mem.measuring()) {  // zero once: they only ever grow
    double zero = 0;
    own_overflow_.copy_from(Tensor(&zero, DType::f64, {1}));
    own_fill_.copy_from(Tensor(&zero, DType::f64, {1}));
  }
  plan_ = DispatchPlan{};
  combined_ = false;
}

void SlotDispatcher::check_plan(const DispatchPlan& plan, const char* op) const {
  MF_CHECK(&plan == &plan_, op, ": the plan is not this dispatcher's last dispatch");
}

const DispatchPlan& SlotDispatcher::dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                             const Tensor& topk_prob_TK) {
  const int64_t t_n = x_TH.size(0), x_n = p_n_ * b_n_, w = row_width(hidden_);
  MF_CHECK(t_n <= max_tokens_, "dispatch: x ", x_TH.str(), " for max_tokens ", max_tokens_);
  check_row_format(x_TH, w, rows_dtype_, "dispatch x");
  check_shape(topk_idx_TK, {t_n, cfg_.num_experts_per_tok}, "dispatch topk_idx");
  DispatchPlan& p = plan_;
  combined_ = false;
  p.num_tokens = t_n;
  p.capacity = cfg_.capacity(t_n);
  p.row_TK = row_TK_.slice(0, t_n);
  p.topk_prob_TK = topk_prob_TK;
  // 1. Home rows sorted by global expert (dropless or padded: their number is known), then their
  //    slots; the counts go out beside the rows and come back as the experts' layout.
  const int64_t s_n =
      moe_permute_plan(*ctx_, topk_idx_TK, topk_prob_TK, p.capacity, cfg_.pad_to_capacity,
                       PermutePlanOut{home_counts_E_, home_offsets_E1_, p.row_TK, home_token_S_}, false);
  p.token_R = home_token_S_.slice(0, s_n);
  const Tensor slot_TK = slot_TK_.slice(0, t_n);
  moe_ep_send_slots(*ctx_, home_offsets_E1_, home_token_S_, p.row_TK, b_n_, token_X_, slot_TK, send_counts_PL_,
                    overflow(), fill());
  ep_.all_to_all(send_counts_PL_, recv_counts_PL_);
  moe_ep_recv_slots(*ctx_, recv_counts_PL_, b_n_, src_R_, row_X_, counts_L_, offsets_L1_, overflow(), fill());
  // 2. The rows: x into the slots (free rows zero), across, and out into the experts' order.
  const Tensor send = rows_view(send_XH_, x_n, w, rows_dtype_), recv = rows_view(recv_XH_, x_n, w, rows_dtype_);
  moe_permute(*ctx_, x_TH, token_X_, send);
  ep_.all_to_all(send, recv);
  p.num_rows = r_max_;
  p.counts_E = counts_L_;
  p.offsets_E1 = offsets_L1_;
  p.rows_RH = rows_RH_;
  moe_permute(*ctx_, recv, src_R_, p.rows_RH);
  set_single_piece(p);
  return p;
}

void SlotDispatcher::combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) {
  check_plan(plan, "combine");
  check_shape(out_RH, {r_max_, hidden_}, "combine out");
  // Each output back into the slot its row came in (free rows zero), home, and summed per token.
  moe_permute(*ctx_, out_RH, row_X_, send_XH_);
  ep_.all_to_all(send_XH_, home_XH_);
  moe_combine(*ctx_, home_XH_, slot_TK_.slice(0, plan_.num_tokens), plan_.topk_prob_TK, y_TH);
  combined_ = true;
}

void SlotDispatcher::combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan,
                                      const Tensor& dout_RH, const Tensor& dprob_TK) {
  check_plan(plan, "combine_backward");
  MF_CHECK(combined_, "combine_backward: combine did not run on this plan");
  check_shape(out_RH, {r_max_, hidden_}, "combine_backward out");
  check_shape(dout_RH, {r_max_, hidden_}, "combine_backward dout");
  // dprob from the outputs kept at home; the slots' dout (zero in free rows) out to the experts.
  moe_combine_backward(*ctx_, home_XH_, slot_TK_.slice(0, plan_.num_tokens), plan_.topk_prob_TK, token_X_, dy_TH,
                       send_XH_, dprob_TK);
  ep_.all_to_all(send_XH_, recv_XH_);
  moe_permute(*ctx_, recv_XH_, src_R_, dout_RH);
}

void SlotDispatcher::dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) {
  check_plan(plan, "dispatch_backward");
  check_shape(drows_RH, {r_max_, hidden_}, "dispatch_backward drows");
  moe_permute(*ctx_, drows_RH, row_X_, send_XH_);
  ep_.all_to_all(send_XH_, recv_XH_);
  moe_permute_backward(*ctx_, recv_XH_, slot_TK_.slice(0, plan_.num_tokens), dx_TH);
}

}  // namespace moefold
