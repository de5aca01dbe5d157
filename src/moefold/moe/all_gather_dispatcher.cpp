// AllGatherDispatcher: local permute (moe_ops), all-gather of the home rows over ETP, counts-first
// all_to_all_v over EP, and a source-major -> expert-major reorder; the way back runs the same
// path in reverse and ends in a reduce-scatter over ETP, which sums the F-slices' partial rows.
#include "moefold/moe/all_gather_dispatcher.h"

#include <algorithm>

#include "moefold/moe/all_to_all_dispatcher.h"
#include "moefold/ops/moe_ops.h"

namespace moefold {

AllGatherDispatcher::AllGatherDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& etp,
                                         Communicator* ep)
    : cfg_(cfg), hidden_(hidden), max_tokens_(max_tokens), s_max_(0), num_local_(0), etp_(etp), ep_(ep) {
  MF_CHECK(hidden >= 1 && max_tokens >= 0, "AllGatherDispatcher: hidden ", hidden, ", max_tokens ", max_tokens);
  if (ep_ == nullptr) {
    self_ep_ = make_self_communicator("ep");
    ep_ = self_ep_.get();
  }
  MF_CHECK(etp.size() >= 1 && cfg.moe_intermediate_size % etp.size() == 0,
           "AllGatherDispatcher: moe.moe_intermediate_size = ", cfg.moe_intermediate_size, " not divisible by the ",
           etp.size(), " ranks of group '", etp.name(), "'");
  MF_CHECK(ep_->size() >= 1 && cfg.num_experts % ep_->size() == 0,
           "AllGatherDispatcher: moe.num_experts = ", cfg.num_experts, " not divisible by the ", ep_->size(),
           " ranks of group '", ep_->name(), "'");
  num_local_ = cfg.num_experts / ep_->size();
  s_max_ = cfg.max_rows(max_tokens);
}

int64_t AllGatherDispatcher::max_rows() const {
  return etp_.size() * AllToAllDispatcher::max_recv_rows(cfg_, max_tokens_, ep_->size());
}

void AllGatherDispatcher::bind(Memory& mem) {
  const int64_t e_n = cfg_.num_experts, l_n = num_local_, p_n = ep_->size(), g_n = etp_.size();
  const int64_t r_max = max_rows(), gs_max = g_n * s_max_;
  home_counts_E_ = mem.act({e_n}, DType::i64);
  home_offsets_E1_ = mem.act({e_n + 1}, DType::i64);
  row_TK_ = mem.act({max_tokens_, cfg_.num_experts_per_tok}, DType::i64);
  home_token_S_ = mem.act({s_max_}, DType::i64);
  home_counts_GE_ = mem.act({g_n * e_n}, DType::i64);
  send_counts_PGL_ = mem.act({p_n * g_n * l_n}, DType::i64);
  recv_counts_PGL_ = mem.act({p_n * g_n * l_n}, DType::i64);
  send_counts_P_ = mem.act({p_n}, DType::i64);
  recv_counts_P_ = mem.act({p_n}, DType::i64);
  counts_L_ = mem.act({l_n}, DType::i64);
  offsets_L1_ = mem.act({l_n + 1}, DType::i64);
  pack_X_ = mem.act({gs_max}, DType::i64);
  unpack_GS_ = mem.act({gs_max}, DType::i64);
  gather_R_ = mem.act({r_max}, DType::i64);
  scatter_R_ = mem.act({r_max}, DType::i64);
  own_SH_ = mem.act({s_max_, hidden_});
  home_SH_ = mem.act({s_max_, hidden_});
  gathered_GSH_ = mem.act({gs_max, hidden_});
  send_XH_ = mem.act({gs_max, hidden_});
  recv_RH_ = mem.act({r_max, hidden_});
  rows_RH_ = mem.act({r_max, hidden_});
  plan_ = AllGatherPlan{};
  combined_ = false;
}

const DispatchPlan& AllGatherDispatcher::dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                                  const Tensor& topk_prob_TK) {
  const int64_t t_n = x_TH.size(0), e_n = cfg_.num_experts, l_n = num_local_, p_n = ep_->size(), g_n = etp_.size();
  MF_CHECK(x_TH.ndim() == 2 && x_TH.size(1) == hidden_ && t_n <= max_tokens_, "dispatch: x ", x_TH.str(),
           " for hidden ", hidden_, ", max_tokens ", max_tokens_);
  check_shape(topk_idx_TK, {t_n, cfg_.num_experts_per_tok}, "dispatch topk_idx");
  AllGatherPlan& p = plan_;
  combined_ = false;

  // 1. This rank's tokens into home rows sorted by global expert (LocalDispatcher's plan): capacity
  //    (from this rank's T), drops and padding are decided here, before any exchange.
  p.num_tokens = t_n;
  p.capacity = cfg_.capacity(t_n);
  p.row_TK = row_TK_.slice(0, t_n);
  p.home_counts_E = home_counts_E_;
  p.home_offsets_E1 = home_offsets_E1_;
  p.num_home_rows = moe_permute_plan(topk_idx_TK, topk_prob_TK, p.capacity, cfg_.pad_to_capacity,
                                     PermutePlanOut{home_counts_E_, home_offsets_E1_, p.row_TK, home_token_S_});
  p.token_R = home_token_S_.slice(0, p.num_home_rows);
  p.topk_prob_TK = topk_prob_TK;
  moe_permute(x_TH, p.token_R, own_SH_.slice(0, p.num_home_rows));

  // 2. Every ETP rank's home counts; from them the EP send plan of all G sources: to peer q go, for
  //    each source g, g's home rows of q's experts (contiguous in g's block of s_max rows).
  etp_.all_gather(home_counts_E_, home_counts_GE_);
  p.home_counts_GE = home_counts_GE_.view({g_n, e_n});
  const int64_t* counts_ge = home_counts_GE_.ptr<int64_t>();
  int64_t* send_pgl = send_counts_PGL_.ptr<int64_t>();
  int64_t* send_p = send_counts_P_.ptr<int64_t>();
  int64_t* pack = pack_X_.ptr<int64_t>();
  int64_t* unpack = unpack_GS_.ptr<int64_t>();
  std::fill(unpack, unpack + g_n * s_max_, int64_t{-1});
  int64_t x_n = 0;
  for (int64_t q = 0; q < p_n; ++q) {
    send_p[q] = 0;
    for (int64_t g = 0; g < g_n; ++g) {
      int64_t first = 0;  // g's first home row of expert q*L
      for (int64_t e = 0; e < q * l_n; ++e) first += counts_ge[g * e_n + e];
      int64_t n = 0;
      for (int64_t l = 0; l < l_n; ++l) {
        const int64_t c = counts_ge[g * e_n + q * l_n + l];
        MF_CHECK(c >= 0, "dispatch: ETP rank ", g, " of group '", etp_.name(), "' has ", c, " rows for expert ",
                 q * l_n + l);
        send_pgl[(q * g_n + g) * l_n + l] = c;
        n += c;
      }
      MF_CHECK(first + n <= s_max_, "dispatch: ETP rank ", g, " of group '", etp_.name(), "' has ", first + n,
               " home rows, buffers hold ", s_max_, " (ranks disagree on config or max_tokens?)");
      for (int64_t i = 0; i < n; ++i) {
        pack[x_n + i] = g * s_max_ + first + i;
        unpack[g * s_max_ + first + i] = x_n + i;
      }
      x_n += n;
      send_p[q] += n;
    }
  }
  p.num_send_rows = x_n;
  p.pack_X = pack_X_.slice(0, x_n);
  p.unpack_GS = unpack_GS_;

  // 3. Counts over EP: block q of send_counts_PGL is what peer q's experts get from each source.
  ep_->all_to_all(send_counts_PGL_, recv_counts_PGL_);
  const int64_t* recv_pgl = recv_counts_PGL_.ptr<int64_t>();
  int64_t* recv_p = recv_counts_P_.ptr<int64_t>();
  int64_t* counts = counts_L_.ptr<int64_t>();
  int64_t* offsets = offsets_L1_.ptr<int64_t>();
  std::fill(counts, counts + l_n, int64_t{0});
  const int64_t b_n = p_n * g_n;  // sources b = q * G + g, in the order rows are received
  for (int64_t q = 0; q < p_n; ++q) {
    recv_p[q] = 0;
    for (int64_t i = q * g_n * l_n; i < (q + 1) * g_n * l_n; ++i) {
      MF_CHECK(recv_pgl[i] >= 0, "dispatch: peer ", q, " of group '", ep_->name(), "' sends ", recv_pgl[i], " rows");
      recv_p[q] += recv_pgl[i];
      counts[i % l_n] += recv_pgl[i];
    }
  }
  offsets[0] = 0;
  for (int64_t l = 0; l < l_n; ++l) offsets[l + 1] = offsets[l] + counts[l];
  const int64_t r_n = offsets[l_n];
  MF_CHECK(r_n <= max_rows(), "dispatch: ", r_n, " rows received on rank ", ep_->rank(), " of group '", ep_->name(),
           "', buffers hold ", max_rows(), " (peers disagree on config or max_tokens?)");
  p.num_rows = r_n;
  p.counts_E = counts_L_;
  p.offsets_E1 = offsets_L1_;
  p.send_counts_P = send_counts_P_;
  p.recv_counts_P = recv_counts_P_;
  p.recv_counts_PGL = recv_counts_PGL_.view({p_n, g_n, l_n});

  // 4. Received source-major ((q, g, l) blocks); expert l's rows from earlier sources come first.
  int64_t* gather = gather_R_.ptr<int64_t>();
  int64_t* scatter = scatter_R_.ptr<int64_t>();
  int64_t src = 0;
  for (int64_t b = 0; b < b_n; ++b)
    for (int64_t l = 0; l < l_n; ++l) {
      int64_t dst = offsets[l];
      for (int64_t b2 = 0; b2 < b; ++b2) dst += recv_pgl[b2 * l_n + l];
      for (int64_t i = 0, n = recv_pgl[b * l_n + l]; i < n; ++i) {
        gather[dst + i] = src + i;
        scatter[src + i] = dst + i;
      }
      src += recv_pgl[b * l_n + l];
    }
  p.gather_R = gather_R_.slice(0, r_n);
  p.scatter_R = scatter_R_.slice(0, r_n);
  p.rows_RH = rows_RH_.slice(0, r_n);
  rows_out(own_SH_, p.rows_RH);
  return p;
}

void AllGatherDispatcher::rows_out(const Tensor& home_SH, const Tensor& rows_RH) {
  const AllGatherPlan& p = plan_;
  // Rows of home_SH past this rank's S travel in the all-gather but pack_X never reads them.
  etp_.all_gather(home_SH, gathered_GSH_);
  const Tensor send = send_XH_.slice(0, p.num_send_rows), recv = recv_RH_.slice(0, p.num_rows);
  moe_permute(gathered_GSH_, p.pack_X, send);
  ep_->all_to_all_v(send, p.send_counts_P.ptr<int64_t>(), recv, p.recv_counts_P.ptr<int64_t>());
  moe_permute(recv, p.gather_R, rows_RH);
}

void AllGatherDispatcher::rows_back(const Tensor& rows_RH, const Tensor& home_SH) {
  const AllGatherPlan& p = plan_;
  const Tensor send = send_XH_.slice(0, p.num_send_rows), recv = recv_RH_.slice(0, p.num_rows);
  moe_permute(rows_RH, p.scatter_R, recv);
  ep_->all_to_all_v(recv, p.recv_counts_P.ptr<int64_t>(), send, p.send_counts_P.ptr<int64_t>());
  // Unused rows of the G blocks become zero, so the sum below only adds real rows.
  moe_permute(send, p.unpack_GS, gathered_GSH_);
  etp_.reduce_scatter(gathered_GSH_, home_SH, ReduceOp::sum);
}

void AllGatherDispatcher::check_plan(const DispatchPlan& plan, const char* op) const {
  MF_CHECK(&plan == &plan_, op, ": the plan is not this dispatcher's last dispatch");
}

void AllGatherDispatcher::combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) {
  check_plan(plan, "combine");
  const AllGatherPlan& p = plan_;
  check_shape(out_RH, {p.num_rows, hidden_}, "combine out");
  // Summing the F-slices before weighting: combine is linear in the outputs, and dprob then needs
  // no reduction of its own.
  rows_back(out_RH, home_SH_);
  moe_combine(home_SH_.slice(0, p.num_home_rows), p.row_TK, p.topk_prob_TK, y_TH);
  combined_ = true;
}

void AllGatherDispatcher::combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan,
                                           const Tensor& dout_RH, const Tensor& dprob_TK) {
  check_plan(plan, "combine_backward");
  MF_CHECK(combined_, "combine_backward before combine");
  const AllGatherPlan& p = plan_;
  check_shape(out_RH, {p.num_rows, hidden_}, "combine_backward out");
  check_shape(dout_RH, {p.num_rows, hidden_}, "combine_backward dout");
  // own_SH_'s x rows are dead since dispatch: it holds the home gradient.
  moe_combine_backward(home_SH_.slice(0, p.num_home_rows), p.row_TK, p.topk_prob_TK, dy_TH,
                       own_SH_.slice(0, p.num_home_rows), dprob_TK);
  rows_out(own_SH_, dout_RH);
}

void AllGatherDispatcher::dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) {
  check_plan(plan, "dispatch_backward");
  const AllGatherPlan& p = plan_;
  check_shape(drows_RH, {p.num_rows, hidden_}, "dispatch_backward drows");
  rows_back(drows_RH, own_SH_);
  moe_permute_backward(own_SH_.slice(0, p.num_home_rows), p.row_TK, dx_TH);
}

}  // namespace moefold
