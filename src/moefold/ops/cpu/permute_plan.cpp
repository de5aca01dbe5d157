// CPU reference of the permutation plan (moe_ops.h): tokens -> expert-contiguous rows, with
// capacity dropping and padding (a stable bucket pass, then a sort per over-full expert). No
// gradient (integer indices). CUDA tensors go to ops/cuda/permute_plan.cu.
#include <algorithm>

#include "moefold/ops/cpu/moe_common.h"
#include "moefold/ops/dispatch.h"
#include "moefold/ops/moe_ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/permute_plan.h"
#endif

namespace moefold {

// ---- permutation plan --------------------------------------------------------------------------

int64_t moe_permute_plan(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK,
                         int64_t capacity, bool pad, const PermutePlanOut& out, bool wait) {
  check_2d(topk_idx_TK, "moe_permute_plan topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "moe_permute_plan topk_idx");
  check_shape(topk_prob_TK, topk_idx_TK.shape(), "moe_permute_plan topk_prob");
  check_shape(out.row_TK, topk_idx_TK.shape(), "moe_permute_plan row");
  for (const Tensor* t : {&out.counts_E, &out.offsets_E1, &out.row_TK, &out.token_R}) {
    check_dtype(*t, DType::i64, "moe_permute_plan output");
    MF_CHECK(t->contiguous());
  }
  const int64_t e_n = out.counts_E.numel(), t_n = topk_idx_TK.size(0), k_n = topk_idx_TK.size(1);
  const int64_t a_n = t_n * k_n;  // assignments a = t*K + k
  MF_CHECK(out.offsets_E1.numel() == e_n + 1, "offsets ", out.offsets_E1.str(), " for ", e_n, " experts");
  MF_CHECK(!pad || capacity > 0, "padding needs a capacity");
  MF_ON_GPU(ctx, topk_idx_TK, cuda::moe_permute_plan(ctx, topk_idx_TK, topk_prob_TK, capacity, pad, out, wait));
  check_on_cpu(topk_idx_TK, "moe_permute_plan topk_idx");
  const int32_t* idx = topk_idx_TK.ptr<int32_t>();
  int64_t* counts = out.counts_E.ptr<int64_t>();
  int64_t* offsets = out.offsets_E1.ptr<int64_t>();
  int64_t* grouped = out.row_TK.ptr<int64_t>();  // scratch first: assignments grouped by expert
  int64_t* token = out.token_R.ptr<int64_t>();
  const int64_t max_rows = out.token_R.numel();

  // 1. Assignments per expert, their start in `grouped`, then a stable bucket pass (token order).
  std::fill(counts, counts + e_n, int64_t{0});
  for (int64_t a = 0; a < a_n; ++a) {
    MF_CHECK(idx[a] < e_n, "expert index ", idx[a], " out of [0, ", e_n, ")");
    if (idx[a] >= 0) ++counts[idx[a]];  // negative: an empty slot
  }
  for (int64_t t = 0; t < t_n; ++t)
    for (int64_t k = 0; k < k_n; ++k)
      for (int64_t j = 0; j < k; ++j)
        MF_CHECK(idx[t * k_n + k] < 0 || idx[t * k_n + j] != idx[t * k_n + k], "token ", t, " routed twice to expert ",
                 idx[t * k_n + k]);
  offsets[0] = 0;
  for (int64_t e = 0; e < e_n; ++e) offsets[e + 1] = offsets[e] + counts[e];
  for (int64_t e = 0; e < e_n; ++e) counts[e] = offsets[e];  // cursors
  for (int64_t a = 0; a < a_n; ++a)
    if (idx[a] >= 0) grouped[counts[idx[a]]++] = a;

  // 2. Per expert: keep the highest probabilities (ties: lower token, i.e. lower a), back in
  //    token order; then lay the kept ones (and padding) out as rows. offsets[] is rewritten
  //    from group starts to row starts as we go; offsets[e+1] is read before it is rewritten.
  dispatch_float(topk_prob_TK.dtype(), [&]<class T>() {
    const T* prob = topk_prob_TK.ptr<T>();
    int64_t r = 0;
    int64_t begin = offsets[0];
    for (int64_t e = 0; e < e_n; ++e) {
      const int64_t end = offsets[e + 1];
      int64_t* seg = grouped + begin;
      const int64_t n = end - begin;
      int64_t kept = n;
      if (capacity > 0 && n > capacity) {
        std::sort(seg, seg + n,
                  [&](int64_t x, int64_t y) { return prob[x] > prob[y] || (prob[x] == prob[y] && x < y); });
        kept = capacity;
        std::sort(seg, seg + kept);
      }
      const int64_t rows = pad ? capacity : kept;
      MF_CHECK(r + rows <= max_rows, "permute plan needs more than ", max_rows, " rows");
      offsets[e] = r;
      counts[e] = rows;
      for (int64_t i = 0; i < kept; ++i) token[r + i] = seg[i];
      for (int64_t i = kept; i < rows; ++i) token[r + i] = -1;
      r += rows;
      begin = end;
    }
    if (!wait && capacity > 0 && !pad && e_n > 0) {  // the last expert padded up to the bound
      const int64_t bound = std::min(a_n, e_n * capacity);
      MF_CHECK(bound <= max_rows, "permute plan needs more than ", max_rows, " rows");
      for (int64_t i = r; i < bound; ++i) token[i] = -1;
      counts[e_n - 1] += std::max<int64_t>(bound - r, 0);
      r = std::max(r, bound);
    }
    offsets[e_n] = r;
  });

  // 3. Row of each assignment; token_R turns from assignment ids into token ids.
  const int64_t num_rows = offsets[e_n];
  const int64_t known = pad ? e_n * capacity : capacity > 0 ? std::min(a_n, e_n * capacity) : a_n;
  MF_CHECK(wait || num_rows == known, "moe_permute_plan: ", num_rows, " rows where the caller expects ", known,
           " (an empty slot without waiting?)");
  for (int64_t a = 0; a < a_n; ++a) grouped[a] = -1;
  for (int64_t r = 0; r < num_rows; ++r) {
    if (token[r] < 0) continue;
    grouped[token[r]] = r;
    token[r] /= k_n;
  }
  return num_rows;
}

}  // namespace moefold
