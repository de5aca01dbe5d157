// AllToAllDispatcher: local permute (moe_ops), counts-first all-to-all-v over the EP group, and a
// peer-major -> expert-major reorder; every backward runs the same path in reverse.
#include "moefold/moe/all_to_all_dispatcher.h"

#include <algorithm>

#include "moefold/ops/moe_ops.h"

namespace moefold {

AllToAllDispatcher::AllToAllDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep)
    : cfg_(cfg), hidden_(hidden), max_tokens_(max_tokens), num_local_(0), ep_(ep) {
  MF_CHECK(hidden >= 1 && max_tokens >= 0, "AllToAllDispatcher: hidden ", hidden, ", max_tokens ", max_tokens);
  MF_CHECK(ep.size() >= 1 && cfg.num_experts % ep.size() == 0,
           "AllToAllDispatcher: moe.num_experts = ", cfg.num_experts, " not divisible by the ", ep.size(),
           " ranks of group '", ep.name(), "'");
  num_local_ = cfg.num_experts / ep.size();
}

int64_t AllToAllDispatcher::max_recv_rows(const MoeConfig& cfg, int64_t max_tokens, int ep_size) {
  MF_CHECK(ep_size >= 1 && cfg.num_experts % ep_size == 0, "max_recv_rows: ", cfg.num_experts, " experts, EP ",
           ep_size);
  const int64_t local = cfg.num_experts / ep_size;
  // capacity(T) and the row counts below grow with T, so max_tokens bounds every smaller T.
  const int64_t dropless = max_tokens * std::min(cfg.num_experts_per_tok, local);
  const int64_t cap = cfg.capacity(max_tokens);
  int64_t per_peer = dropless;
  if (cfg.capacity_factor > 0) per_peer = cfg.pad_to_capacity ? local * cap : std::min(dropless, local * cap);
  return ep_size * per_peer;
}

void AllToAllDispatcher::bind(Memory& mem) {
  const int64_t e_n = cfg_.num_experts, l_n = num_local_, p_n = ep_.size();
  const int64_t s_max = cfg_.max_rows(max_tokens_), r_max = max_rows();
  home_counts_E_ = mem.act({e_n}, DType::i64);
  home_offsets_E1_ = mem.act({e_n + 1}, DType::i64);
  row_TK_ = mem.act({max_tokens_, cfg_.num_experts_per_tok}, DType::i64);
  home_token_S_ = mem.act({s_max}, DType::i64);
  recv_counts_PL_ = mem.act({p_n * l_n}, DType::i64);
  send_counts_P_ = mem.act({p_n}, DType::i64);
  recv_counts_P_ = mem.act({p_n}, DType::i64);
  counts_L_ = mem.act({l_n}, DType::i64);
  offsets_L1_ = mem.act({l_n + 1}, DType::i64);
  gather_R_ = mem.act({r_max}, DType::i64);
  scatter_R_ = mem.act({r_max}, DType::i64);
  send_SH_ = mem.act({s_max, hidden_});
  home_SH_ = mem.act({s_max, hidden_});
  recv_RH_ = mem.act({r_max, hidden_});
  rows_RH_ = mem.act({r_max, hidden_});
  plan_ = AllToAllPlan{};
  combined_ = false;
}

const DispatchPlan& AllToAllDispatcher::dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                                 const Tensor& topk_prob_TK) {
  const int64_t t_n = x_TH.size(0), l_n = num_local_, p_n = ep_.size();
  MF_CHECK(x_TH.ndim() == 2 && x_TH.size(1) == hidden_ && t_n <= max_tokens_, "dispatch: x ", x_TH.str(),
           " for hidden ", hidden_, ", max_tokens ", max_tokens_);
  check_shape(topk_idx_TK, {t_n, cfg_.num_experts_per_tok}, "dispatch topk_idx");
  AllToAllPlan& p = plan_;
  combined_ = false;

  // 1. This rank's tokens into home rows sorted by global expert: LocalDispatcher's plan, so
  //    capacity (from this rank's T), drops and padding are decided here, before any exchange.
  p.num_tokens = t_n;
  p.capacity = cfg_.capacity(t_n);
  p.row_TK = row_TK_.slice(0, t_n);
  p.home_counts_E = home_counts_E_;
  p.home_offsets_E1 = home_offsets_E1_;
  p.num_home_rows = moe_permute_plan(topk_idx_TK, topk_prob_TK, p.capacity, cfg_.pad_to_capacity,
                                     PermutePlanOut{home_counts_E_, home_offsets_E1_, p.row_TK, home_token_S_});
  p.token_R = home_token_S_.slice(0, p.num_home_rows);
  p.topk_prob_TK = topk_prob_TK;
  const Tensor send = send_SH_.slice(0, p.num_home_rows);
  moe_permute(x_TH, p.token_R, send);

  // 2. Counts first: peer p's block of home_counts_E is the rows for p's L experts, so one
  //    equal-block all_to_all tells every rank how many rows each peer sends to each local expert.
  ep_.all_to_all(home_counts_E_, recv_counts_PL_);
  const int64_t* home_off = home_offsets_E1_.ptr<int64_t>();
  const int64_t* recv_pl = recv_counts_PL_.ptr<int64_t>();
  int64_t* send_p = send_counts_P_.ptr<int64_t>();
  int64_t* recv_p = recv_counts_P_.ptr<int64_t>();
  int64_t* counts = counts_L_.ptr<int64_t>();
  int64_t* offsets = offsets_L1_.ptr<int64_t>();
  std::fill(counts, counts + l_n, int64_t{0});
  for (int64_t q = 0; q < p_n; ++q) {
    send_p[q] = home_off[(q + 1) * l_n] - home_off[q * l_n];
    recv_p[q] = 0;
    for (int64_t l = 0; l < l_n; ++l) {
      const int64_t n = recv_pl[q * l_n + l];
      MF_CHECK(n >= 0, "dispatch: peer ", q, " of group '", ep_.name(), "' sends ", n, " rows to local expert ", l);
      recv_p[q] += n;
      counts[l] += n;
    }
  }
  offsets[0] = 0;
  for (int64_t l = 0; l < l_n; ++l) offsets[l + 1] = offsets[l] + counts[l];
  const int64_t r_n = offsets[l_n];
  // Holds unless a peer was built with a larger max_tokens or another config (a REQUIRES).
  MF_CHECK(r_n <= max_rows(), "dispatch: ", r_n, " rows received on rank ", ep_.rank(), " of group '", ep_.name(),
           "', buffers hold ", max_rows(), " (peers disagree on config or max_tokens?)");
  p.num_rows = r_n;
  p.counts_E = counts_L_;
  p.offsets_E1 = offsets_L1_;
  p.send_counts_P = send_counts_P_;
  p.recv_counts_P = recv_counts_P_;
  p.recv_counts_PL = recv_counts_PL_.view({p_n, l_n});

  // 3. Rows: received peer-major, (peer q, local expert l) blocks in that order.
  const Tensor recv = recv_RH_.slice(0, r_n);
  ep_.all_to_all_v(send, send_p, recv, recv_p);

  // 4. Reorder peer-major -> expert-major, so each local expert's rows are contiguous.
  int64_t* gather = gather_R_.ptr<int64_t>();
  int64_t* scatter = scatter_R_.ptr<int64_t>();
  int64_t src = 0;  // first received row of block (q, l)
  for (int64_t q = 0; q < p_n; ++q)
    for (int64_t l = 0; l < l_n; ++l) {
      // Expert l's rows from peers before q come first.
      int64_t dst = offsets[l];
      for (int64_t q2 = 0; q2 < q; ++q2) dst += recv_pl[q2 * l_n + l];
      for (int64_t i = 0, n = recv_pl[q * l_n + l]; i < n; ++i) {
        gather[dst + i] = src + i;
        scatter[src + i] = dst + i;
      }
      src += recv_pl[q * l_n + l];
    }
  p.gather_R = gather_R_.slice(0, r_n);
  p.scatter_R = scatter_R_.slice(0, r_n);
  p.rows_RH = rows_RH_.slice(0, r_n);
  moe_permute(recv, p.gather_R, p.rows_RH);
  return p;
}

void AllToAllDispatcher::check_plan(const DispatchPlan& plan, const char* op) const {
  MF_CHECK(&plan == &plan_, op, ": the plan is not this dispatcher's last dispatch");
}

void AllToAllDispatcher::combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) {
  check_plan(plan, "combine");
  const AllToAllPlan& p = plan_;
  check_shape(out_RH, {p.num_rows, hidden_}, "combine out");
  // reorder^T, then the exchange in reverse: every output row returns to its token's home rank.
  const Tensor back = recv_RH_.slice(0, p.num_rows), home = home_SH_.slice(0, p.num_home_rows);
  moe_permute(out_RH, p.scatter_R, back);
  ep_.all_to_all_v(back, p.recv_counts_P.ptr<int64_t>(), home, p.send_counts_P.ptr<int64_t>());
  moe_combine(home, p.row_TK, p.topk_prob_TK, y_TH);
  combined_ = true;
}

void AllToAllDispatcher::combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan,
                                          const Tensor& dout_RH, const Tensor& dprob_TK) {
  check_plan(plan, "combine_backward");
  MF_CHECK(combined_, "combine_backward before combine");
  const AllToAllPlan& p = plan_;
  check_shape(out_RH, {p.num_rows, hidden_}, "combine_backward out");
  check_shape(dout_RH, {p.num_rows, hidden_}, "combine_backward dout");
  // d(home rows) and dprob at home (dprob needs the outputs combine brought back); the x rows in
  // send_SH_ are dead since dispatch, so it holds the home gradient.
  const Tensor home = home_SH_.slice(0, p.num_home_rows), dhome = send_SH_.slice(0, p.num_home_rows);
  moe_combine_backward(home, p.row_TK, p.topk_prob_TK, dy_TH, dhome, dprob_TK);
  const Tensor drecv = recv_RH_.slice(0, p.num_rows);
  ep_.all_to_all_v(dhome, p.send_counts_P.ptr<int64_t>(), drecv, p.recv_counts_P.ptr<int64_t>());
  moe_permute(drecv, p.gather_R, dout_RH);
}

void AllToAllDispatcher::dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) {
  check_plan(plan, "dispatch_backward");
  const AllToAllPlan& p = plan_;
  check_shape(drows_RH, {p.num_rows, hidden_}, "dispatch_backward drows");
  const Tensor back = recv_RH_.slice(0, p.num_rows), dhome = send_SH_.slice(0, p.num_home_rows);
  moe_permute(drows_RH, p.scatter_R, back);
  ep_.all_to_all_v(back, p.recv_counts_P.ptr<int64_t>(), dhome, p.send_counts_P.ptr<int64_t>());
  moe_permute_backward(dhome, p.row_TK, dx_TH);
}

}  // namespace moefold
