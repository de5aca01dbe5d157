// LocalDispatcher: permute / combine on one process through the moe_ops reference ops.
#include "moefold/moe/dispatcher.h"

#include "moefold/ops/fp8.h"
#include "moefold/ops/moe_ops.h"

namespace moefold {

int64_t Dispatcher::row_width(int64_t hidden) const { return fp8_rows_ ? fp8_packed_width(hidden) : hidden; }

Tensor rows_view(const Tensor& buf, int64_t rows, int64_t width, DType dtype) {
  const size_t bytes = static_cast<size_t>(rows * width) * dtype_size(dtype);
  MF_CHECK(buf.contiguous() && bytes <= buf.nbytes(), "rows_view: ", rows, " x ", width, " ", dtype_name(dtype), " in ",
           buf.str());
  return Tensor(buf.data(), dtype, {rows, width}, buf.device());
}

void check_row_format(const Tensor& rows, int64_t width, DType dtype, const char* what) {
  MF_CHECK(rows.ndim() == 2 && rows.size(1) == width && rows.dtype() == dtype, what, ": rows ", rows.str(),
           " where [R, ", width, "] ", dtype_name(dtype), " rows were expected");
}

void set_single_piece(DispatchPlan& plan) {
  plan.pieces.assign(1, RowPiece{0, plan.num_rows, plan.offsets_E1});
  plan.backward_pieces = plan.pieces;
}

LocalDispatcher::LocalDispatcher(const MoeConfig& cfg, int64_t hidden, int64_t max_tokens)
    : cfg_(cfg), hidden_(hidden), max_tokens_(max_tokens) {
  MF_CHECK(hidden >= 1 && max_tokens >= 0, "LocalDispatcher: hidden ", hidden, ", max_tokens ", max_tokens);
}

void LocalDispatcher::bind(Memory& mem) {
  ctx_ = &mem.exec();
  const int64_t e_n = cfg_.num_experts, r_max = max_rows();
  counts_E_ = mem.act({e_n}, DType::i64);
  offsets_E1_ = mem.act({e_n + 1}, DType::i64);
  row_TK_ = mem.act({max_tokens_, cfg_.num_experts_per_tok}, DType::i64);
  token_R_ = mem.act({r_max}, DType::i64);
  rows_dtype_ = row_dtype(mem.dtype());
  const Shape rows{r_max, row_width(hidden_)};
  rows_RH_ = offload_rows_ ? mem.offloaded(rows, rows_dtype_) : mem.act(rows, rows_dtype_);
  plan_ = DispatchPlan{};
}

const DispatchPlan& LocalDispatcher::dispatch(const Tensor& x_TH, const Tensor& topk_idx_TK,
                                              const Tensor& topk_prob_TK) {
  const int64_t t_n = x_TH.size(0);
  MF_CHECK(t_n <= max_tokens_, "dispatch: x ", x_TH.str(), " for max_tokens ", max_tokens_);
  check_row_format(x_TH, row_width(hidden_), rows_dtype_, "dispatch x");
  check_shape(topk_idx_TK, {t_n, cfg_.num_experts_per_tok}, "dispatch topk_idx");
  DispatchPlan& p = plan_;
  p.num_tokens = t_n;
  p.capacity = cfg_.capacity(t_n);
  p.counts_E = counts_E_;
  p.offsets_E1 = offsets_E1_;
  p.row_TK = row_TK_.slice(0, t_n);
  // Dropless (T*K rows) or padded (E*capacity), the rows are known: the host does not wait. With a
  // capacity and no padding it waits for R, unless told not to (then the last expert is padded up
  // to the bound).
  const bool known = !(cfg_.capacity_factor > 0) || cfg_.pad_to_capacity;
  p.num_rows =
      moe_permute_plan(*ctx_, topk_idx_TK, topk_prob_TK, p.capacity, cfg_.pad_to_capacity,
                       PermutePlanOut{p.counts_E, p.offsets_E1, p.row_TK, token_R_}, !known && !without_waiting_);
  p.token_R = token_R_.slice(0, p.num_rows);
  p.rows_RH = rows_RH_.slice(0, p.num_rows);
  p.topk_prob_TK = topk_prob_TK;
  moe_permute(*ctx_, x_TH, p.token_R, p.rows_RH);
  set_single_piece(p);
  return p;
}

void LocalDispatcher::combine(const Tensor& out_RH, const DispatchPlan& plan, const Tensor& y_TH) {
  moe_combine(*ctx_, out_RH, plan.row_TK, plan.topk_prob_TK, y_TH);
}

void LocalDispatcher::combine_backward(const Tensor& dy_TH, const Tensor& out_RH, const DispatchPlan& plan,
                                       const Tensor& dout_RH, const Tensor& dprob_TK) {
  moe_combine_backward(*ctx_, out_RH, plan.row_TK, plan.topk_prob_TK, plan.token_R, dy_TH, dout_RH, dprob_TK);
}

void LocalDispatcher::dispatch_backward(const Tensor& drows_RH, const DispatchPlan& plan, const Tensor& dx_TH) {
  moe_permute_backward(*ctx_, drows_RH, plan.row_TK, dx_TH);
}

}  // namespace moefold
