// HierarchicalDispatcher: tokens cross nodes once over the rail, then an AllToAllDispatcher
// within the node (see the header); every backward runs the same path in reverse.
#include "moefold/moe/hierarchical_dispatcher.h"

#include <algorithm>

#include "moefold/core/profile.h"
#include "moefold/ops/moe_ops.h"

namespace moefold {

namespace {

// The within-node dispatcher's config: the node's M L experts, each relayed row's S slots as its
// top-k, dropless (home decided the drops) and unpadded (padding changes no result). Its planned
// receive buffers keep moe.ep_recv_factor's meaning, a multiple of the average T K rows per rank:
// the relay's N T rows of S slots average T K / (N S) of them each.
MoeConfig node_config(const MoeConfig& cfg, int64_t node_experts, int64_t slots, int64_t nodes) {
  MoeConfig c = cfg;
  c.num_experts = node_experts;
  c.num_experts_per_tok = slots;
  c.capacity_factor = 0;
  c.pad_to_capacity = false;
  c.n_group = c.topk_group = 1;
  c.expert_bias = false;
  c.dispatcher = "alltoall";
  const double per_row = static_cast<double>(cfg.num_experts_per_tok) / static_cast<double>(nodes * slots);
  c.ep_recv_factor = cfg.ep_recv_factor > 0 ? std::max(1.0, cfg.ep_recv_factor * per_row) : 0;
  return c;
}

int64_t local_experts(const MoeConfig& cfg, const Communicator& ep) {
  MF_CHECK(ep.size() >= 1 && cfg.num_experts % ep.size() == 0,
           "HierarchicalDispatcher: moe.num_experts = ", cfg.num_experts, " not divisible by the ", ep.size(),
           " ranks of group '", ep.name(), "'");
  return cfg.num_experts / ep.size();
}

}  // namespace

HierarchicalDispatcher::HierarchicalDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens,
                                               Communicator& ep, Communicator& node, Communicator& rail,
                                               EpTransportChoice transport)
    : cfg_(cfg),
      hidden_(hidden),
      max_tokens_(max_tokens),
      ep_(ep),
      node_(node),
      rail_(rail),
      nodes_(rail.size()),
      per_node_experts_(local_experts(cfg, ep) * node.size()),
      slots_(std::min(cfg.num_experts_per_tok, per_node_experts_)),
      inner_(node_config(cfg, per_node_experts_, slots_, rail.size()), hidden, rail.size() * max_tokens, node,
             transport) {
  MF_CHECK(node.size() * rail.size() == ep.size() && ep.rank() == rail.rank() * node.size() + node.rank(),
           "HierarchicalDispatcher: EP rank ", ep.rank(), " of ", ep.size(), " is not rank ", rail.rank(), " of the ",
           rail.size(), " nodes x rank ", node.rank(), " of ", node.size(), " on the node");
}

void HierarchicalDispatcher::bind(Memory& mem) {
  ctx_ = &mem.exec();
  inner_.set_offload_rows(offload_rows_);
  inner_.set_fp8_rows(fp8_rows_);
  inner_.bind(mem);
  const int64_t t_n = max_tokens_, k_n = cfg_.num_experts_per_tok, e_n = cfg_.num_experts, n_n = nodes_;
  const int64_t r0 = t_n * std::min(k_n, n_n), r1 = n_n * t_n, w = row_width(hidden_), s_n = slots_;
  const DType rows = row_dtype(mem.dtype()), prob = mem.master_dtype();
  // Kept from dispatch to the backwards: the home plan and the counts.
  node_row_TK_ = mem.act({t_n, k_n}, DType::i64);
  node_token_R_ = mem.act({r0}, DType::i64);
  assign_TK_ = mem.act({t_n, k_n}, DType::i64);
  node_counts_N_ = mem.mirrored({n_n}, DType::i64);
  send_counts_N_ = mem.host_act({n_n}, DType::i64);
  recv_counts_N_ = mem.host_act({n_n}, DType::i64);
  relay_prob_YS_ = mem.act({r1, s_n}, prob);  // the inner plan's topk_prob until its combine_backward
  // Used within one call each.
  const bool capacity = cfg_.capacity_factor > 0;
  keep_counts_E_ = mem.scratch({capacity ? e_n : 0}, DType::i64);
  keep_offsets_E1_ = mem.scratch({capacity ? e_n + 1 : 0}, DType::i64);
  keep_row_TK_ = mem.scratch({capacity ? t_n : 0, k_n}, DType::i64);
  keep_token_R_ = mem.scratch({capacity ? cfg_.max_rows(t_n) : 0}, DType::i64);
  node_idx_TK_ = mem.scratch({t_n, k_n}, DType::i32);
  slot_TK_ = mem.scratch({t_n, k_n}, DType::i32);
  node_offsets_N1_ = mem.scratch({n_n + 1}, DType::i64);
  home_rows_XW_ = mem.scratch({r0, w}, rows);
  home_h_XH_ = mem.scratch({r0, hidden_});
  home_idx_XS_ = mem.scratch({r0, s_n}, DType::i32);
  home_prob_XS_ = mem.scratch({r0, s_n}, prob);
  home_dprob_XS_ = mem.scratch({r0, s_n}, prob);
  relay_rows_YW_ = mem.scratch({r1, w}, rows);
  relay_h_YH_ = mem.scratch({r1, hidden_});
  relay_idx_YS_ = mem.scratch({r1, s_n}, DType::i32);
  relay_dprob_YS_ = mem.scratch({r1, s_n}, prob);
  num_tokens_ = home_rows_ = relay_rows_ = remote_rows_ = 0;
}

void HierarchicalDispatcher::cross(const Tensor& from, const Tensor& to, bool out, int64_t InterNodeBytes::*leg) {
  const int64_t* send = (out ? send_counts_N_ : recv_counts_N_).ptr<int64_t>();
  const int64_t* recv = (out ? recv_counts_N_ : send_counts_N_).ptr<int64_t>();
  rail_.all_to_all_v(from, send, to, recv);
  const int64_t row_bytes = from.size(1) * static_cast<int64_t>(dtype_size(from.dtype()));
  for (int q = 0; q < rail_.size(); ++q)
    if (q != rail_.rank()) bytes_.*leg += send[q] * row_bytes;
}

void HierarchicalDispatcher::check_plan(const DispatchPlan& plan, const char* op) const {
  MF_CHECK(&plan == &inner_.plan(), "HierarchicalDispatcher::", op,
           ": the plan is not this dispatcher's last dispatch");
}

const DispatchPlan& HierarchicalDispatcher::dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                                     const Tensor& topk_prob_TK) {
  const int64_t t_n = x_TH.size(0), k_n = cfg_.num_experts_per_tok;
  MF_CHECK(ctx_ != nullptr, "HierarchicalDispatcher::dispatch before bind");
  MF_CHECK(t_n <= max_tokens_, "HierarchicalDispatcher::dispatch: ", t_n, " tokens, buffers hold ", max_tokens_);
  check_row_format(x_TH, row_width(hidden_), home_rows_XW_.dtype(), "HierarchicalDispatcher::dispatch x");
  check_shape(topk_idx_TK, {t_n, k_n}, "HierarchicalDispatcher::dispatch topk_idx");
  check_shape(topk_prob_TK, {t_n, k_n}, "HierarchicalDispatcher::dispatch topk_prob");
  MF_CHECK(topk_prob_TK.dtype() == home_prob_XS_.dtype(), "HierarchicalDispatcher::dispatch: topk_prob ",
           topk_prob_TK.str(), ", expected ", dtype_name(home_prob_XS_.dtype()));
  num_tokens_ = t_n;
  // 1. What the capacity keeps (from this rank's T, as the all-to-all dispatcher decides), each
  //    token's kept assignments grouped by node, one row per (token, node) pair: node-major home
  //    rows with their experts and probabilities.
  Tensor keep;
  if (cfg_.capacity_factor > 0) {
    keep = keep_row_TK_.slice(0, t_n);
    moe_permute_plan(*ctx_, topk_idx_TK, topk_prob_TK, cfg_.capacity(t_n), false,
                     PermutePlanOut{keep_counts_E_, keep_offsets_E1_, keep, keep_token_R_});
  }
  const Tensor node_idx = node_idx_TK_.slice(0, t_n), slot = slot_TK_.slice(0, t_n);
  const Tensor node_row = node_row_TK_.slice(0, t_n);
  moe_node_route(*ctx_, topk_idx_TK, keep, per_node_experts_, node_idx, slot);
  home_rows_ = moe_permute_plan(*ctx_, node_idx, topk_prob_TK, 0, false,
                                PermutePlanOut{node_counts_N_.dev, node_offsets_N1_, node_row, node_token_R_});
  moe_node_meta(*ctx_, topk_idx_TK, topk_prob_TK, node_idx, slot, node_row, per_node_experts_,
                home_idx_XS_.slice(0, home_rows_), home_prob_XS_.slice(0, home_rows_), assign_TK_.slice(0, t_n));
  moe_permute(*ctx_, x_TH, node_token_R_.slice(0, home_rows_), home_rows_XW_.slice(0, home_rows_));
  // 2. Counts over the rail, then the rows cross: once per (token, node).
  {
    ProfileScope scope("moe rail counts");  // a host round trip
    node_counts_N_.to_host(-1, ctx_);
    send_counts_N_.copy_from(node_counts_N_.host);
    rail_.all_to_all(send_counts_N_, recv_counts_N_);
  }
  const int64_t* send = send_counts_N_.ptr<int64_t>();
  const int64_t* recv = recv_counts_N_.ptr<int64_t>();
  relay_rows_ = remote_rows_ = 0;
  for (int q = 0; q < rail_.size(); ++q) {
    relay_rows_ += recv[q];
    if (q != rail_.rank()) remote_rows_ += send[q];
  }
  MF_CHECK(relay_rows_ <= relay_rows_YW_.size(0), "HierarchicalDispatcher: ", relay_rows_, " rows relayed on rank ",
           rail_.rank(), " of group '", rail_.name(), "', buffers hold ", relay_rows_YW_.size(0),
           " (peers disagree on config or max_tokens?)");
  const int64_t r0 = home_rows_, r1 = relay_rows_;
  {
    ProfileScope scope("moe rail dispatch");
    cross(home_rows_XW_.slice(0, r0), relay_rows_YW_.slice(0, r1), true, &InterNodeBytes::dispatch);
    cross(home_idx_XS_.slice(0, r0), relay_idx_YS_.slice(0, r1), true, &InterNodeBytes::dispatch);
    cross(home_prob_XS_.slice(0, r0), relay_prob_YS_.slice(0, r1), true, &InterNodeBytes::dispatch);
  }
  // 3. The relayed rows to the node's experts.
  return inner_.dispatch(relay_rows_YW_.slice(0, r1), relay_idx_YS_.slice(0, r1), relay_prob_YS_.slice(0, r1));
}

void HierarchicalDispatcher::combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) {
  check_plan(plan, "combine");
  check_shape(y_TH, {num_tokens_, hidden_}, "HierarchicalDispatcher::combine y");
  const Tensor relay_y = relay_h_YH_.slice(0, relay_rows_), home_y = home_h_XH_.slice(0, home_rows_);
  inner_.combine(out_RH, plan, relay_y);  // each relayed row: its experts' weighted sum
  {
    ProfileScope scope("moe rail combine");
    cross(relay_y, home_y, false, &InterNodeBytes::combine);
  }
  moe_permute_backward(*ctx_, home_y, node_row_TK_.slice(0, num_tokens_), y_TH);  // + over the token's nodes
}

void HierarchicalDispatcher::combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan,
                                              const Tensor& dout_RH, const Tensor& dprob_TK) {
  check_plan(plan, "combine_backward");
  const int64_t t_n = num_tokens_;
  check_shape(dy_TH, {t_n, hidden_}, "HierarchicalDispatcher::combine_backward dy");
  check_shape(dprob_TK, {t_n, cfg_.num_experts_per_tok}, "HierarchicalDispatcher::combine_backward dprob");
  const Tensor home_dy = home_h_XH_.slice(0, home_rows_), relay_dy = relay_h_YH_.slice(0, relay_rows_);
  const Tensor relay_dprob = relay_dprob_YS_.slice(0, relay_rows_), home_dprob = home_dprob_XS_.slice(0, home_rows_);
  moe_permute(*ctx_, dy_TH, node_token_R_.slice(0, home_rows_), home_dy);  // each node sum's gradient: dy
  {
    ProfileScope scope("moe rail dout");
    cross(home_dy, relay_dy, true, &InterNodeBytes::dout);
  }
  inner_.combine_backward(relay_dy, out_RH, plan, dout_RH, relay_dprob);
  {
    ProfileScope scope("moe rail dprob");
    cross(relay_dprob, home_dprob, false, &InterNodeBytes::dout);
  }
  moe_node_meta_backward(*ctx_, home_dprob, assign_TK_.slice(0, t_n), dprob_TK);
}

void HierarchicalDispatcher::dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) {
  check_plan(plan, "dispatch_backward");
  check_shape(dx_TH, {num_tokens_, hidden_}, "HierarchicalDispatcher::dispatch_backward dx");
  const Tensor relay_dx = relay_h_YH_.slice(0, relay_rows_), home_dx = home_h_XH_.slice(0, home_rows_);
  inner_.dispatch_backward(drows_RH, plan, relay_dx);  // each relayed row: the sum over its experts
  {
    ProfileScope scope("moe rail drows");
    cross(relay_dx, home_dx, false, &InterNodeBytes::drows);
  }
  moe_permute_backward(*ctx_, home_dx, node_row_TK_.slice(0, num_tokens_), dx_TH);
}

}  // namespace moefold
