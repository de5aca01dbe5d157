#include "moefold/parallel/context_parallel.h"

#include <cstring>

#include "moefold/core/error.h"
#include "moefold/ops/ops.h"

namespace moefold {

namespace {
void check_cp(int64_t seq_len, int cp_size, int cp_rank, const char* what) {
  MF_CHECK(cp_size > 0 && cp_rank >= 0 && cp_rank < cp_size, what, ": cp rank ", cp_rank, " of ", cp_size);
  MF_CHECK(seq_len > 0 && seq_len % (2 * static_cast<int64_t>(cp_size)) == 0, what, ": sequence ", seq_len,
           " not a multiple of 2 x cp = ", 2 * cp_size, " (causal load balancing)");
}

// Global position of local token l of CP rank r (chunks of `chunk` tokens: r, then 2c-1-r).
int64_t position_of(int64_t chunk, int cp_size, int cp_rank, int64_t l) {
  return l < chunk ? cp_rank * chunk + l : (2 * static_cast<int64_t>(cp_size) - 1 - cp_rank) * chunk + (l - chunk);
}

// Bytes of one [b, s] row of a contiguous [B, S, ...] tensor.
size_t row_bytes(const Tensor& t) {
  return static_cast<size_t>(t.numel() / (t.size(0) * t.size(1))) * dtype_size(t.dtype());
}

void check_pair(const Tensor& full_BS, const Tensor& local_BL, int cp_size, const char* what) {
  MF_CHECK(full_BS.ndim() >= 2 && local_BL.ndim() == full_BS.ndim() && full_BS.contiguous() && local_BL.contiguous() &&
               full_BS.dtype() == local_BL.dtype() && full_BS.device() == Device::cpu &&
               local_BL.device() == Device::cpu,
           what, ": full ", full_BS.str(), ", local ", local_BL.str());
  MF_CHECK(local_BL.size(0) == full_BS.size(0) && local_BL.size(1) * cp_size == full_BS.size(1) &&
               local_BL.numel() * cp_size == full_BS.numel(),
           what, ": local ", local_BL.str(), " is not full ", full_BS.str(), " over cp = ", cp_size);
}
}  // namespace

void cp_positions(int64_t seq_len, int cp_size, int cp_rank, int32_t* positions_out) {
  check_cp(seq_len, cp_size, cp_rank, "cp_positions");
  const int64_t chunk = seq_len / (2 * cp_size);
  for (int64_t l = 0; l < 2 * chunk; ++l)
    positions_out[l] = static_cast<int32_t>(position_of(chunk, cp_size, cp_rank, l));
}

void cp_shard_sequence(const Tensor& full_BS, int cp_size, int cp_rank, const Tensor& local_BL) {
  const char* what = "cp_shard_sequence";
  check_cp(full_BS.ndim() >= 2 ? full_BS.size(1) : 0, cp_size, cp_rank, what);
  check_pair(full_BS, local_BL, cp_size, what);
  const int64_t s = full_BS.size(1), len = local_BL.size(1), chunk = len / 2;
  const size_t rb = row_bytes(full_BS);
  const char* src = static_cast<const char*>(full_BS.data());
  char* dst = static_cast<char*>(local_BL.data());
  for (int64_t b = 0; b < full_BS.size(0); ++b)
    for (int64_t l = 0; l < len; ++l)
      std::memcpy(dst + (b * len + l) * rb, src + (b * s + position_of(chunk, cp_size, cp_rank, l)) * rb, rb);
}

void cp_gather_sequence(Communicator& cp, const Tensor& local_BL, const Tensor& scratch_cBL, const Tensor& full_BS) {
  const char* what = "cp_gather_sequence";
  const int c = cp.size();
  check_cp(full_BS.ndim() >= 2 ? full_BS.size(1) : 0, c, cp.rank(), what);
  check_pair(full_BS, local_BL, c, what);
  MF_CHECK(scratch_cBL.dtype() == local_BL.dtype() && scratch_cBL.contiguous() &&
               scratch_cBL.numel() >= c * local_BL.numel(),
           what, ": scratch ", scratch_cBL.str(), " smaller than ", c, " x local ", local_BL.str());
  const int64_t n = local_BL.numel();
  const Tensor recv = scratch_cBL.view({scratch_cBL.numel()}).slice(0, c * n).view({c, n});
  cp.all_gather(local_BL.view({1, n}), recv);
  const int64_t s = full_BS.size(1), len = local_BL.size(1), chunk = len / 2, nb = full_BS.size(0);
  const size_t rb = row_bytes(full_BS);
  const char* src = static_cast<const char*>(recv.data());
  char* dst = static_cast<char*>(full_BS.data());
  for (int r = 0; r < c; ++r)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t l = 0; l < len; ++l)
        std::memcpy(dst + (b * s + position_of(chunk, c, r, l)) * rb, src + ((r * nb + b) * len + l) * rb, rb);
}

ContextParallelAttention::ContextParallelAttention(Communicator& cp, const CpAttentionShape& shape)
    : cp_(cp), shape_(shape), cp_size_(cp.size()), cp_rank_(cp.rank()) {
  const char* what = "ContextParallelAttention";
  check_cp(shape.seq_len, cp_size_, cp_rank_, what);
  MF_CHECK(shape.batch > 0 && shape.head_dim > 0, what, ": batch ", shape.batch, ", head_dim ", shape.head_dim);
  MF_CHECK(shape.num_kv_heads > 0 && shape.num_q_heads % shape.num_kv_heads == 0, what, ": num_q_heads ",
           shape.num_q_heads, " not a multiple of num_kv_heads ", shape.num_kv_heads);
  local_len_ = shape.seq_len / cp_size_;
}

void ContextParallelAttention::bind(Memory& mem) {
  ctx_ = &mem.exec();
  const int64_t b = shape_.batch, s = shape_.seq_len, g = shape_.num_kv_heads, d = shape_.head_dim;
  q_pos_L_ = mem.mirrored({local_len_}, DType::i32);
  k_pos_S_ = mem.mirrored({s}, DType::i32);
  k_all_BSGD_ = mem.act({b, s, g, d});
  v_all_BSGD_ = mem.act({b, s, g, d});
  dk_all_BSGD_ = mem.act({b, s, g, d});
  dv_all_BSGD_ = mem.act({b, s, g, d});
  exchange_cBLGD_ = mem.act({cp_size_, b, local_len_, g, d});
  work_2LS_ = mem.act({2, local_len_, s});
  if (mem.measuring()) return;
  cp_positions(s, cp_size_, cp_rank_, q_pos_L_.host.ptr<int32_t>());
  for (int r = 0; r < cp_size_; ++r) cp_positions(s, cp_size_, r, k_pos_S_.host.ptr<int32_t>() + r * local_len_);
  q_pos_L_.to_device(-1, ctx_);
  k_pos_S_.to_device(-1, ctx_);
}

// Rank r's block of the exchange buffer ([B, L, G, D] of rank r) and its place in [B, S, G, D]:
// one B-row matrix each, so a copy between them is one strided copy on either device.
std::pair<MatrixView, MatrixView> ContextParallelAttention::blocks(const Tensor& all_BSGD, int r) const {
  const int64_t nb = shape_.batch, len = local_len_, s = shape_.seq_len;
  const int64_t per_key = shape_.num_kv_heads * shape_.head_dim, block = len * per_key;
  return {MatrixView{exchange_cBLGD_, nb, block, block, r * nb * block},
          MatrixView{all_BSGD, nb, block, s * per_key, r * len * per_key}};
}

void ContextParallelAttention::check_local(const Tensor& t, int64_t heads, const char* what) const {
  check_shape(t, {shape_.batch, local_len_, heads, shape_.head_dim}, what);
  MF_CHECK(t.dtype() == k_all_BSGD_.dtype() && t.contiguous(), what, ": ", t.str(), " vs workspace ",
           k_all_BSGD_.str());
}

void ContextParallelAttention::gather(const Tensor& local_BLGD, const Tensor& all_BSGD) {
  const int64_t n = local_BLGD.numel();
  cp_.all_gather(local_BLGD.view({1, n}), exchange_cBLGD_.view({cp_size_, n}));
  // [c, B, L, G, D] -> [B, c*L, G, D]: rank r's block of each batch row lands at keys [r*L, (r+1)*L).
  for (int r = 0; r < cp_size_; ++r) {
    const auto [exchange, all] = blocks(all_BSGD, r);
    copy_matrix(*ctx_, exchange, all);
  }
}

void ContextParallelAttention::reduce_scatter(const Tensor& all_BSGD, const Tensor& local_BLGD) {
  const int64_t n = local_BLGD.numel();
  for (int r = 0; r < cp_size_; ++r) {
    const auto [exchange, all] = blocks(all_BSGD, r);
    copy_matrix(*ctx_, all, exchange);
  }
  cp_.reduce_scatter(exchange_cBLGD_.view({cp_size_, n}), local_BLGD.view({1, n}), ReduceOp::sum);
}

void ContextParallelAttention::forward(const Tensor& q_BLQD, const Tensor& k_BLGD, const Tensor& v_BLGD, double scale,
                                       const Tensor& out_BLQD, const Tensor& lse_BQL) {
  const char* what = "ContextParallelAttention::forward";
  check_local(q_BLQD, shape_.num_q_heads, what);
  check_local(k_BLGD, shape_.num_kv_heads, what);
  check_local(v_BLGD, shape_.num_kv_heads, what);
  gather(k_BLGD, k_all_BSGD_);
  gather(v_BLGD, v_all_BSGD_);
  attention_forward_at(*ctx_, q_BLQD, k_all_BSGD_, v_all_BSGD_, q_pos_L_.dev, k_pos_S_.dev, scale, out_BLQD, lse_BQL,
                       work_2LS_);
}

void ContextParallelAttention::backward(const Tensor& q_BLQD, const Tensor& k_BLGD, const Tensor& v_BLGD,
                                        const Tensor& out_BLQD, const Tensor& lse_BQL, const Tensor& dout_BLQD,
                                        double scale, const Tensor& dq_BLQD, const Tensor& dk_BLGD,
                                        const Tensor& dv_BLGD) {
  const char* what = "ContextParallelAttention::backward";
  check_local(q_BLQD, shape_.num_q_heads, what);
  check_local(k_BLGD, shape_.num_kv_heads, what);
  check_local(v_BLGD, shape_.num_kv_heads, what);
  check_local(dk_BLGD, shape_.num_kv_heads, what);
  check_local(dv_BLGD, shape_.num_kv_heads, what);
  gather(k_BLGD, k_all_BSGD_);  // again: the workspace may have served other layers since forward
  gather(v_BLGD, v_all_BSGD_);
  attention_backward_at(*ctx_, q_BLQD, k_all_BSGD_, v_all_BSGD_, q_pos_L_.dev, k_pos_S_.dev, out_BLQD, lse_BQL,
                        dout_BLQD, scale, dq_BLQD, dk_all_BSGD_, dv_all_BSGD_, work_2LS_);
  reduce_scatter(dk_all_BSGD_, dk_BLGD);
  reduce_scatter(dv_all_BSGD_, dv_BLGD);
}

}  // namespace moefold
