// CPU reference of the expert-parallel slot plans (moe_ops.h, SlotDispatcher): where each row of a
// fixed-size slot exchange sits on the sending and on the receiving side. Integer arithmetic only;
// CUDA tensors go to ops/cuda/ep_slots.cu, which must give the same integers.
#include <algorithm>

#include "moefold/ops/cpu/moe_common.h"
#include "moefold/ops/dispatch.h"
#include "moefold/ops/moe_ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/ep_slots.h"
#endif

namespace moefold {

namespace {
constexpr int64_t kMaxSlotExperts = 1024;  // the CUDA kernels keep per-expert tables in shared memory

void check_vector(const Tensor& t, DType dtype, int64_t n, const char* what) {
  check_dtype(t, dtype, what);
  MF_CHECK(t.contiguous() && t.numel() == n, what, ": ", t.str(), ", expected ", n, " elements");
}

// fill_1 (optional) max-ed with rows / bound (a bound of 0 counts as 1 row).
void max_fill(const Tensor& fill_1, int64_t rows, int64_t bound) {
  if (!fill_1.defined()) return;
  double& f = fill_1.ptr<double>()[0];
  f = std::max(f, static_cast<double>(rows) / static_cast<double>(std::max<int64_t>(bound, 1)));
}
}  // namespace

void moe_ep_send_slots(const ExecContext& ctx, const Tensor& home_offsets_E1, const Tensor& home_token_S,
                       const Tensor& row_TK, int64_t slot_rows, const Tensor& token_X, const Tensor& slot_TK,
                       const Tensor& send_counts_PL, const Tensor& overflow_1, const Tensor& fill_1) {
  check_2d(send_counts_PL, "moe_ep_send_slots send_counts");
  check_dtype(send_counts_PL, DType::i64, "moe_ep_send_slots send_counts");
  const int64_t p_n = send_counts_PL.size(0), l_n = send_counts_PL.size(1), e_n = p_n * l_n, b_n = slot_rows;
  MF_CHECK(p_n >= 1 && l_n >= 1 && e_n <= kMaxSlotExperts && b_n >= 0, "moe_ep_send_slots: ", p_n, " peers of ", l_n,
           " experts (at most ", kMaxSlotExperts, " in all), slots of ", b_n, " rows");
  check_vector(home_offsets_E1, DType::i64, e_n + 1, "moe_ep_send_slots home_offsets");
  check_dtype(home_token_S, DType::i64, "moe_ep_send_slots home_token");
  check_2d(row_TK, "moe_ep_send_slots row_TK");
  check_dtype(row_TK, DType::i64, "moe_ep_send_slots row_TK");
  check_vector(token_X, DType::i64, p_n * b_n, "moe_ep_send_slots token_X");
  check_2d(slot_TK, "moe_ep_send_slots slot_TK");
  check_dtype(slot_TK, DType::i64, "moe_ep_send_slots slot_TK");
  check_shape(slot_TK, row_TK.shape(), "moe_ep_send_slots slot_TK");
  check_vector(overflow_1, DType::f64, 1, "moe_ep_send_slots overflow");
  if (fill_1.defined()) check_vector(fill_1, DType::f64, 1, "moe_ep_send_slots fill");
  MF_ON_GPU(ctx, send_counts_PL,
            cuda::moe_ep_send_slots(ctx, home_offsets_E1, home_token_S, row_TK, slot_rows, token_X, slot_TK,
                                    send_counts_PL, overflow_1, fill_1));
  check_on_cpu(send_counts_PL, "moe_ep_send_slots send_counts");
  const int64_t* off = home_offsets_E1.ptr<int64_t>();
  const int64_t* token = home_token_S.ptr<int64_t>();
  const int64_t s_n = off[e_n];
  MF_CHECK(off[0] == 0 && s_n <= home_token_S.numel(), "moe_ep_send_slots: ", s_n, " home rows, tokens ",
           home_token_S.str());
  int64_t* tok_x = token_X.ptr<int64_t>();
  int64_t* counts = send_counts_PL.ptr<int64_t>();
  int64_t lost = 0;
  for (int64_t p = 0; p < p_n; ++p) {
    const int64_t first = off[p * l_n], n = off[(p + 1) * l_n] - first;
    MF_CHECK(n >= 0, "moe_ep_send_slots: home offsets decrease at peer ", p);
    lost += std::max<int64_t>(0, n - b_n);
    max_fill(fill_1, n, b_n);
    for (int64_t i = 0; i < b_n; ++i) tok_x[p * b_n + i] = i < n ? token[first + i] : -1;
    for (int64_t l = 0; l < l_n; ++l) {
      const int64_t a = std::min(off[p * l_n + l] - first, b_n), b = std::min(off[p * l_n + l + 1] - first, b_n);
      counts[p * l_n + l] = b - a;
    }
  }
  const int64_t* row = row_TK.ptr<int64_t>();
  int64_t* slot = slot_TK.ptr<int64_t>();
  for (int64_t a = 0; a < row_TK.numel(); ++a) {
    const int64_t r = row[a];
    MF_CHECK(r < s_n, "moe_ep_send_slots: assignment ", a, " in home row ", r, " of ", s_n);
    if (r < 0) {
      slot[a] = -1;
      continue;
    }
    // The peer whose block holds row r: the last p with off[p * L] <= r.
    int64_t p = 0;
    while (p + 1 < p_n && off[(p + 1) * l_n] <= r) ++p;
    const int64_t i = r - off[p * l_n];
    slot[a] = i < b_n ? p * b_n + i : -1;
  }
  overflow_1.ptr<double>()[0] += static_cast<double>(lost);
}

void moe_ep_recv_slots(const ExecContext& ctx, const Tensor& recv_counts_PL, int64_t slot_rows, const Tensor& src_R,
                       const Tensor& row_X, const Tensor& counts_L, const Tensor& offsets_L1, const Tensor& overflow_1,
                       const Tensor& fill_1) {
  check_2d(recv_counts_PL, "moe_ep_recv_slots recv_counts");
  check_dtype(recv_counts_PL, DType::i64, "moe_ep_recv_slots recv_counts");
  const int64_t p_n = recv_counts_PL.size(0), l_n = recv_counts_PL.size(1), b_n = slot_rows;
  MF_CHECK(p_n >= 1 && l_n >= 1 && p_n * l_n <= kMaxSlotExperts && b_n >= 0, "moe_ep_recv_slots: ", p_n, " peers of ",
           l_n, " experts (at most ", kMaxSlotExperts, " in all), slots of ", b_n, " rows");
  check_dtype(src_R, DType::i64, "moe_ep_recv_slots src_R");
  MF_CHECK(src_R.contiguous(), "moe_ep_recv_slots src_R: ", src_R.str());
  check_vector(row_X, DType::i64, p_n * b_n, "moe_ep_recv_slots row_X");
  check_vector(counts_L, DType::i64, l_n, "moe_ep_recv_slots counts");
  check_vector(offsets_L1, DType::i64, l_n + 1, "moe_ep_recv_slots offsets");
  check_vector(overflow_1, DType::f64, 1, "moe_ep_recv_slots overflow");
  if (fill_1.defined()) check_vector(fill_1, DType::f64, 1, "moe_ep_recv_slots fill");
  MF_ON_GPU(
      ctx, recv_counts_PL,
      cuda::moe_ep_recv_slots(ctx, recv_counts_PL, slot_rows, src_R, row_X, counts_L, offsets_L1, overflow_1, fill_1));
  check_on_cpu(recv_counts_PL, "moe_ep_recv_slots recv_counts");
  const int64_t* c = recv_counts_PL.ptr<int64_t>();
  const int64_t r_n = src_R.numel();
  int64_t* src = src_R.ptr<int64_t>();
  int64_t* row = row_X.ptr<int64_t>();
  int64_t* counts = counts_L.ptr<int64_t>();
  int64_t* offsets = offsets_L1.ptr<int64_t>();
  std::fill(src, src + r_n, int64_t{-1});
  std::fill(row, row + p_n * b_n, int64_t{-1});
  for (int64_t p = 0; p < p_n; ++p) {
    int64_t in_slot = 0;
    for (int64_t l = 0; l < l_n; ++l) {
      MF_CHECK(c[p * l_n + l] >= 0, "moe_ep_recv_slots: slot ", p, " brings ", c[p * l_n + l], " rows for expert ", l);
      in_slot += c[p * l_n + l];
    }
    MF_CHECK(in_slot <= b_n, "moe_ep_recv_slots: slot ", p, " brings ", in_slot, " rows, slots hold ", b_n);
  }
  int64_t dst = 0;  // expert-major: expert l's rows from slot 0, slot 1, ...
  for (int64_t l = 0; l < l_n; ++l) {
    offsets[l] = std::min(dst, r_n);
    for (int64_t p = 0; p < p_n; ++p) {
      int64_t from = p * b_n;  // expert l's first row in slot p
      for (int64_t m = 0; m < l; ++m) from += c[p * l_n + m];
      for (int64_t j = 0; j < c[p * l_n + l]; ++j, ++dst)
        if (dst < r_n) {
          src[dst] = from + j;
          row[from + j] = dst;
        }
    }
  }
  offsets[l_n] = r_n;
  for (int64_t l = 0; l < l_n; ++l) counts[l] = offsets[l + 1] - offsets[l];
  overflow_1.ptr<double>()[0] += static_cast<double>(std::max<int64_t>(0, dst - r_n));
  max_fill(fill_1, dst, r_n);
}

}  // namespace moefold
