// AllGatherDispatcher: local permute, all-gather of the home rows over ETP, then EpExchange with
// the G ETP ranks as the sources of each EP peer (counts-first all_to_all_v, source-major ->
// expert-major reorder); the way back runs the same path in reverse and ends in a reduce-scatter
// over ETP, which sums the F-slices' partial rows.
#include "moefold/moe/all_gather_dispatcher.h"

#include <algorithm>

#include "moefold/ops/moe_ops.h"

namespace moefold {

AllGatherDispatcher::AllGatherDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens, Communicator& etp,
                                         Communicator* ep)
    : cfg_(cfg),
      hidden_(hidden),
      etp_(etp),
      self_ep_(ep == nullptr ? make_self_communicator("ep") : nullptr),
      ex_("AllGatherDispatcher", cfg, hidden, max_tokens, ep == nullptr ? *self_ep_ : *ep, &etp) {}

void AllGatherDispatcher::bind(Memory& mem) {
  ctx_ = &mem.exec();
  ex_.bind(mem, row_width(ex_.hidden()), row_dtype(mem.dtype()));
  const int64_t e_n = cfg_.num_experts, l_n = ex_.num_local(), p_n = ex_.ep().size(), g_n = etp_.size();
  const int64_t gs_max = g_n * ex_.s_max();
  home_counts_GE_ = mem.host_act({g_n * e_n}, DType::i64);
  send_counts_PGL_ = mem.host_act({p_n * g_n * l_n}, DType::i64);
  pack_X_ = mem.mirrored({gs_max}, DType::i64);
  unpack_GS_ = mem.mirrored({gs_max}, DType::i64);
  gathered_GSH_ = mem.act({gs_max, hidden_});
  send_XH_ = mem.act({gs_max, hidden_});
  plan_ = AllGatherPlan{};
}

const DispatchPlan& AllGatherDispatcher::dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                                  const Tensor& topk_prob_TK) {
  const int64_t e_n = cfg_.num_experts, l_n = ex_.num_local(), p_n = ex_.ep().size(), g_n = etp_.size();
  const int64_t s_max = ex_.s_max();
  AllGatherPlan& p = plan_;
  // 1. This rank's tokens into home rows sorted by global expert, before any exchange.
  ex_.route_home(x_TH, topk_idx_TK, topk_prob_TK, p);

  // 2. Every ETP rank's home counts; from them the EP send plan of all G sources: to peer q go, for
  //    each source g, g's home rows of q's experts (contiguous in g's block of s_max rows).
  etp_.all_gather(ex_.home_counts_host(), home_counts_GE_);
  p.home_counts_GE = home_counts_GE_.view({g_n, e_n});
  const int64_t* counts_ge = home_counts_GE_.ptr<int64_t>();
  int64_t* send_pgl = send_counts_PGL_.ptr<int64_t>();
  int64_t* pack = pack_X_.host.ptr<int64_t>();
  int64_t* unpack = unpack_GS_.host.ptr<int64_t>();
  std::fill(unpack, unpack + g_n * s_max, int64_t{-1});
  int64_t x_n = 0;
  for (int64_t q = 0; q < p_n; ++q)
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
      MF_CHECK(first + n <= s_max, "dispatch: ETP rank ", g, " of group '", etp_.name(), "' has ", first + n,
               " home rows, buffers hold ", s_max, " (ranks disagree on config or max_tokens?)");
      for (int64_t i = 0; i < n; ++i) {
        pack[x_n + i] = g * s_max + first + i;
        unpack[g * s_max + first + i] = x_n + i;
      }
      x_n += n;
    }
  p.num_send_rows = x_n;
  pack_X_.to_device(x_n, ctx_);
  unpack_GS_.to_device(-1, ctx_);
  p.pack_X = pack_X_.dev.slice(0, x_n);
  p.unpack_GS = unpack_GS_.dev;

  // 3. Counts over EP: block q of send_counts_PGL is what peer q's experts get from each source.
  ex_.exchange_counts(send_counts_PGL_, p);
  ex_.plan_reorder(p);
  set_single_piece(p);
  p.recv_counts_PGL = ex_.recv_counts().view({p_n, g_n, l_n});
  // 4. Rows: all-gathered over ETP, sent over EP, reordered expert-major.
  rows_out(ex_.own_rows(), p.rows_RH);
  return p;
}

void AllGatherDispatcher::rows_out(const Tensor& home_SH, const Tensor& rows_RH) {
  const AllGatherPlan& p = plan_;
  // The rows' format (x rows, maybe packed FP8, or output gradients) in the staging buffers.
  const int64_t width = rows_RH.size(1);
  const DType dtype = rows_RH.dtype();
  check_row_format(home_SH, width, dtype, "AllGatherDispatcher home rows");
  const Tensor gathered = rows_view(gathered_GSH_, gathered_GSH_.size(0), width, dtype);
  // Rows of home_SH past this rank's S travel in the all-gather but pack_X never reads them.
  etp_.all_gather(home_SH, gathered);
  const Tensor send = rows_view(send_XH_, p.num_send_rows, width, dtype);
  moe_permute(*ctx_, gathered, p.pack_X, send);
  ex_.to_experts(send, p, rows_RH);
}

void AllGatherDispatcher::rows_back(const Tensor& rows_RH, const Tensor& home_SH) {
  const AllGatherPlan& p = plan_;
  const Tensor send = send_XH_.slice(0, p.num_send_rows);
  ex_.from_experts(rows_RH, p, send);
  // Unused rows of the G blocks become zero, so the sum below only adds real rows.
  moe_permute(*ctx_, send, p.unpack_GS, gathered_GSH_);
  etp_.reduce_scatter(gathered_GSH_, home_SH, ReduceOp::sum);
}

void AllGatherDispatcher::combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) {
  ep_check_plan(plan, plan_, "combine");
  const AllGatherPlan& p = plan_;
  ex_.check_rows(out_RH, p, "combine out");
  // Summing the F-slices before weighting: combine is linear in the outputs, and dprob then needs
  // no reduction of its own.
  rows_back(out_RH, ex_.home_SH());
  ex_.combine_home(p, y_TH);
}

void AllGatherDispatcher::combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan,
                                           const Tensor& dout_RH, const Tensor& dprob_TK) {
  ep_check_plan(plan, plan_, "combine_backward");
  ex_.combine_backward_home(plan_, dy_TH, out_RH, dout_RH, dprob_TK);
  rows_out(ex_.own_SH(), dout_RH);
}

void AllGatherDispatcher::dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) {
  ep_check_plan(plan, plan_, "dispatch_backward");
  const AllGatherPlan& p = plan_;
  ex_.check_rows(drows_RH, p, "dispatch_backward drows");
  rows_back(drows_RH, ex_.own_SH());
  ex_.dispatch_backward_home(p, dx_TH);
}

}  // namespace moefold
