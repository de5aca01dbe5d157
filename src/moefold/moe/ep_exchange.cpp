// EpExchange: local permute (moe_ops), counts-first all_to_all_v over the EP group and the
// source-major <-> expert-major reorder, shared by the all-to-all and all-gather dispatchers.
#include "moefold/moe/ep_exchange.h"

#include <algorithm>
#include <cmath>

#include "moefold/ops/moe_ops.h"

namespace moefold {

int64_t ep_max_recv_rows(const MoeConfig& cfg, int64_t max_tokens, int ep_size) {
  MF_CHECK(ep_size >= 1 && cfg.num_experts % ep_size == 0, "max_recv_rows: ", cfg.num_experts, " experts, EP ",
           ep_size);
  const int64_t local = cfg.num_experts / ep_size;
  // capacity(T) and the row counts below grow with T, so max_tokens bounds every smaller T.
  const int64_t dropless = max_tokens * std::min(cfg.num_experts_per_tok, local);
  const int64_t cap = cfg.capacity(max_tokens);
  int64_t per_peer = dropless;
  if (cfg.capacity_factor > 0) per_peer = cfg.pad_to_capacity ? local * cap : std::min(dropless, local * cap);
  const int64_t worst = ep_size * per_peer;
  if (!(cfg.ep_recv_factor > 0)) return worst;
  const auto planned =
      static_cast<int64_t>(std::ceil(cfg.ep_recv_factor * static_cast<double>(max_tokens * cfg.num_experts_per_tok)));
  return std::min(worst, planned);
}

void ep_check_plan(const DispatchPlan& plan, const EpPlan& mine, const char* op) {
  MF_CHECK(&plan == &mine, op, ": the plan is not this dispatcher's last dispatch");
}

EpExchange::EpExchange(const char* who, const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& ep,
                       const Communicator* etp)
    : cfg_(cfg),
      hidden_(hidden),
      max_tokens_(max_tokens),
      num_local_(0),
      sources_(1),
      s_max_(0),
      ep_(ep),
      reorders_(etp != nullptr) {
  MF_CHECK(hidden >= 1 && max_tokens >= 0, who, ": hidden ", hidden, ", max_tokens ", max_tokens);
  if (etp != nullptr) {
    MF_CHECK(etp->size() >= 1 && cfg.moe_intermediate_size % etp->size() == 0, who,
             ": moe.moe_intermediate_size = ", cfg.moe_intermediate_size, " not divisible by the ", etp->size(),
             " ranks of group '", etp->name(), "'");
    sources_ = etp->size();
  }
  MF_CHECK(ep.size() >= 1 && cfg.num_experts % ep.size() == 0, who, ": moe.num_experts = ", cfg.num_experts,
           " not divisible by the ", ep.size(), " ranks of group '", ep.name(), "'");
  num_local_ = cfg.num_experts / ep.size();
  s_max_ = cfg.max_rows(max_tokens);
}

void EpExchange::bind(Memory& mem, int64_t row_width, DType row_dtype) {
  ctx_ = &mem.exec();
  row_width_ = row_width;
  row_dtype_ = row_dtype;
  const int64_t e_n = cfg_.num_experts, l_n = num_local_, p_n = ep_.size(), r_max = max_rows();
  // Counts and the plans built from them are host arrays (the host plans the exchange and the
  // communicator reads counts on the host); the device gets what its kernels read.
  home_counts_E_ = mem.mirrored({e_n}, DType::i64);
  home_offsets_E1_ = mem.act({e_n + 1}, DType::i64);
  row_TK_ = mem.act({max_tokens_, cfg_.num_experts_per_tok}, DType::i64);
  home_token_S_ = mem.act({s_max_}, DType::i64);
  recv_counts_PBL_ = mem.host_act({p_n * sources_ * l_n}, DType::i64);
  send_counts_P_ = mem.host_act({p_n}, DType::i64);
  recv_counts_P_ = mem.host_act({p_n}, DType::i64);
  counts_L_ = mem.mirrored({l_n}, DType::i64);
  offsets_L1_ = mem.mirrored({l_n + 1}, DType::i64);
  // The reorder's buffers only where it runs (the ETP dispatcher's; see plan_reorder).
  const int64_t r_reorder = reorders_ ? r_max : 0;
  gather_R_ = mem.mirrored({r_reorder}, DType::i64);
  scatter_R_ = mem.mirrored({r_reorder}, DType::i64);
  // Peer-visible: other GPUs of the host copy rows straight into them (see AllToAllDispatcher).
  own_SH_ = mem.peer_act({s_max_, hidden_});
  home_SH_ = mem.peer_act({s_max_, hidden_});
  recv_RH_ = mem.act({r_reorder, hidden_});
  rows_RH_ = mem.peer_act({r_max, row_width_}, row_dtype_);
  own_rows_ = rows_view(own_SH_, s_max_, row_width_, row_dtype_);
  combined_ = false;
}

void EpExchange::route_home(const Tensor& x_TH, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK, EpPlan& p,
                            bool permute_x) {
  const int64_t t_n = x_TH.size(0);
  MF_CHECK(t_n <= max_tokens_, "dispatch: x ", x_TH.str(), " for max_tokens ", max_tokens_);
  check_row_format(x_TH, row_width_, row_dtype_, "dispatch x");
  check_shape(topk_idx_TK, {t_n, cfg_.num_experts_per_tok}, "dispatch topk_idx");
  combined_ = false;
  p.num_tokens = t_n;
  p.capacity = cfg_.capacity(t_n);
  p.row_TK = row_TK_.slice(0, t_n);
  p.home_counts_E = home_counts_E_.dev;
  p.home_offsets_E1 = home_offsets_E1_;
  p.num_home_rows = moe_permute_plan(*ctx_, topk_idx_TK, topk_prob_TK, p.capacity, cfg_.pad_to_capacity,
                                     PermutePlanOut{home_counts_E_.dev, home_offsets_E1_, p.row_TK, home_token_S_});
  home_counts_E_.to_host(-1, ctx_);
  p.token_R = home_token_S_.slice(0, p.num_home_rows);
  p.topk_prob_TK = topk_prob_TK;
  if (permute_x) moe_permute(*ctx_, x_TH, p.token_R, own_rows_.slice(0, p.num_home_rows));
}

void EpExchange::exchange_counts(const Tensor& send_counts_PBL, EpPlan& p) {
  ep_.all_to_all(send_counts_PBL, recv_counts_PBL_);
  plan_counts(send_counts_PBL, p);
}

void EpExchange::gather_counts(const Tensor& all_counts_PE, EpPlan& p) {
  const int64_t e_n = cfg_.num_experts, l_n = num_local_, p_n = ep_.size(), me = ep_.rank();
  MF_CHECK(sources_ == 1, "gather_counts: one source per EP peer only");
  check_shape(all_counts_PE, {p_n, e_n}, "gather_counts all_counts");
  ep_.all_gather(home_counts_E_.host.view({1, e_n}), all_counts_PE);
  const int64_t* all = all_counts_PE.ptr<int64_t>();
  int64_t* recv = recv_counts_PBL_.ptr<int64_t>();
  for (int64_t q = 0; q < p_n; ++q)
    for (int64_t l = 0; l < l_n; ++l) recv[q * l_n + l] = all[q * e_n + me * l_n + l];
  plan_counts(home_counts_E_.host, p);
}

void EpExchange::plan_counts(const Tensor& send_counts_PBL, EpPlan& p) {
  const int64_t l_n = num_local_, p_n = ep_.size(), bl_n = sources_ * l_n;
  MF_CHECK(send_counts_PBL.device() == Device::cpu, "exchange_counts: send counts ", send_counts_PBL.str(),
           " must be host memory");
  const int64_t* send_pbl = send_counts_PBL.ptr<int64_t>();
  const int64_t* recv_pbl = recv_counts_PBL_.ptr<int64_t>();
  int64_t* send_p = send_counts_P_.ptr<int64_t>();
  int64_t* recv_p = recv_counts_P_.ptr<int64_t>();
  int64_t* counts = counts_L_.host.ptr<int64_t>();
  int64_t* offsets = offsets_L1_.host.ptr<int64_t>();
  std::fill(counts, counts + l_n, int64_t{0});
  for (int64_t q = 0; q < p_n; ++q) {
    send_p[q] = 0;
    recv_p[q] = 0;
    for (int64_t i = q * bl_n; i < (q + 1) * bl_n; ++i) {
      const int64_t n = recv_pbl[i];
      MF_CHECK(n >= 0, "dispatch: peer ", q, " of group '", ep_.name(), "' sends ", n, " rows to local expert ",
               i % l_n);
      send_p[q] += send_pbl[i];
      recv_p[q] += n;
      counts[i % l_n] += n;
    }
  }
  offsets[0] = 0;
  for (int64_t l = 0; l < l_n; ++l) offsets[l + 1] = offsets[l] + counts[l];
  const int64_t r_n = offsets[l_n];
  if (cfg_.ep_recv_factor > 0) {  // the planned bound can be exceeded: every rank learns whether any rank did
    int64_t most = r_n;
    ep_.all_reduce(Tensor(&most, DType::i64, {1}), ReduceOp::max);
    if (most > max_rows())
      MF_FAIL("moe.ep_recv_factor = ", cfg_.ep_recv_factor, ": a rank of EP group '", ep_.name(), "' received ", most,
              " expert rows in one dispatch, more than the ", max_rows(),
              " its buffers were planned for; raise moe.ep_recv_factor (moefold plan shows what it costs) or set it "
              "to 0 (the worst case)");
  }
  // Holds unless a peer was built with a larger max_tokens or another config (a REQUIRES).
  MF_CHECK(r_n <= max_rows(), "dispatch: ", r_n, " rows received on rank ", ep_.rank(), " of group '", ep_.name(),
           "', buffers hold ", max_rows(), " (peers disagree on config or max_tokens?)");
  p.num_rows = r_n;
  counts_L_.to_device(-1, ctx_);
  p.counts_E = counts_L_.dev;
  p.send_counts_P = send_counts_P_;
  p.recv_counts_P = recv_counts_P_;
}

void EpExchange::plan_reorder(EpPlan& p) {
  MF_CHECK(reorders_, "plan_reorder: this EpExchange was built without an ETP group (no reorder buffers)");
  const int64_t l_n = num_local_, p_n = ep_.size(), r_n = p.num_rows;
  const int64_t* recv_pbl = recv_counts_PBL_.ptr<int64_t>();
  const int64_t* offsets = offsets_L1_.host.ptr<int64_t>();
  // Received source-major ((q, b, l) blocks); expert l's rows from earlier sources come first.
  int64_t* gather = gather_R_.host.ptr<int64_t>();
  int64_t* scatter = scatter_R_.host.ptr<int64_t>();
  int64_t src = 0;  // first received row of block (b, l)
  for (int64_t b = 0; b < p_n * sources_; ++b)
    for (int64_t l = 0; l < l_n; ++l) {
      int64_t dst = offsets[l];
      for (int64_t b2 = 0; b2 < b; ++b2) dst += recv_pbl[b2 * l_n + l];
      for (int64_t i = 0, n = recv_pbl[b * l_n + l]; i < n; ++i) {
        gather[dst + i] = src + i;
        scatter[src + i] = dst + i;
      }
      src += recv_pbl[b * l_n + l];
    }
  offsets_L1_.to_device(-1, ctx_);
  p.offsets_E1 = offsets_L1_.dev;
  gather_R_.to_device(r_n, ctx_);
  scatter_R_.to_device(r_n, ctx_);
  p.gather_R = gather_R_.dev.slice(0, r_n);
  p.scatter_R = scatter_R_.dev.slice(0, r_n);
  p.rows_RH = rows_RH_.slice(0, r_n);
}

void EpExchange::to_experts(const Tensor& send_XH, const EpPlan& p, const Tensor& rows_RH) {
  const Tensor recv = rows_view(recv_RH_, p.num_rows, rows_RH.size(1), rows_RH.dtype());
  ep_.all_to_all_v(send_XH, p.send_counts_P.ptr<int64_t>(), recv, p.recv_counts_P.ptr<int64_t>());
  moe_permute(*ctx_, recv, p.gather_R, rows_RH);
}

void EpExchange::from_experts(const Tensor& rows_RH, const EpPlan& p, const Tensor& send_XH) {
  const Tensor recv = recv_RH_.slice(0, p.num_rows);
  moe_permute(*ctx_, rows_RH, p.scatter_R, recv);
  ep_.all_to_all_v(recv, p.recv_counts_P.ptr<int64_t>(), send_XH, p.send_counts_P.ptr<int64_t>());
}

void EpExchange::check_rows(const Tensor& t_RH, const EpPlan& p, const char* what) const {
  check_shape(t_RH, {p.num_rows, hidden_}, what);
}

void EpExchange::combine_home(const EpPlan& p, const Tensor& y_TH) {
  moe_combine(*ctx_, home_SH_.slice(0, p.num_home_rows), p.row_TK, p.topk_prob_TK, y_TH);
  combined_ = true;
}

void EpExchange::combine_backward_home(const EpPlan& p, const Tensor& dy_TH, const Tensor& out_RH,
                                       const Tensor& dout_RH, const Tensor& dprob_TK) {
  MF_CHECK(combined_, "combine_backward before combine");
  check_rows(out_RH, p, "combine_backward out");
  check_rows(dout_RH, p, "combine_backward dout");
  // own_SH_'s x rows are dead since dispatch: it holds the home gradient.
  moe_combine_backward(*ctx_, home_SH_.slice(0, p.num_home_rows), p.row_TK, p.topk_prob_TK, p.token_R, dy_TH,
                       own_SH_.slice(0, p.num_home_rows), dprob_TK);
}

void EpExchange::dispatch_backward_home(const EpPlan& p, const Tensor& dx_TH) {
  moe_permute_backward(*ctx_, own_SH_.slice(0, p.num_home_rows), p.row_TK, dx_TH);
}

}  // namespace moefold
