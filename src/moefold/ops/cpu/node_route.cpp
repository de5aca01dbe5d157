// CPU reference of the node routing ops (moe_ops.h): which node rows a token's kept assignments
// travel in, the experts and probabilities those rows carry, and the gradient of those
// probabilities. No gradient otherwise (integer indices). CUDA tensors go to ops/cuda/node_route.cu.
#include "moefold/ops/cpu/moe_common.h"
#include "moefold/ops/dispatch.h"
#include "moefold/ops/moe_ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/node_route.h"
#endif

namespace moefold {

void moe_node_route(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& keep_row_TK,
                    int64_t experts_per_node, const Tensor& node_idx_TK, const Tensor& slot_TK) {
  check_2d(topk_idx_TK, "moe_node_route topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "moe_node_route topk_idx");
  for (const Tensor* t : {&node_idx_TK, &slot_TK}) {
    check_dtype(*t, DType::i32, "moe_node_route output");
    check_shape(*t, topk_idx_TK.shape(), "moe_node_route output");
    MF_CHECK(t->contiguous(), "moe_node_route output: ", t->str());
  }
  if (keep_row_TK.defined()) {
    check_dtype(keep_row_TK, DType::i64, "moe_node_route keep_row");
    check_shape(keep_row_TK, topk_idx_TK.shape(), "moe_node_route keep_row");
  }
  MF_CHECK(experts_per_node >= 1, "moe_node_route: ", experts_per_node, " experts per node");
  MF_ON_GPU(ctx, topk_idx_TK,
            cuda::moe_node_route(ctx, topk_idx_TK, keep_row_TK, experts_per_node, node_idx_TK, slot_TK));
  check_on_cpu(topk_idx_TK, "moe_node_route topk_idx");
  const int64_t t_n = topk_idx_TK.size(0), k_n = topk_idx_TK.size(1);
  const int32_t* idx = topk_idx_TK.ptr<int32_t>();
  const int64_t* keep = keep_row_TK.defined() ? keep_row_TK.ptr<int64_t>() : nullptr;
  int32_t* node = node_idx_TK.ptr<int32_t>();
  int32_t* slot = slot_TK.ptr<int32_t>();
  for (int64_t t = 0; t < t_n; ++t)
    for (int64_t k = 0; k < k_n; ++k) {
      const int64_t a = t * k_n + k;
      node[a] = slot[a] = -1;
      if (idx[a] < 0 || (keep != nullptr && keep[a] < 0)) continue;
      const int32_t n = static_cast<int32_t>(idx[a] / experts_per_node);
      int32_t before = 0;  // kept assignments of this token on node n at lower k
      for (int64_t j = 0; j < k; ++j) {
        const int64_t b = t * k_n + j;
        before += idx[b] >= 0 && (keep == nullptr || keep[b] >= 0) && idx[b] / experts_per_node == n;
      }
      slot[a] = before;
      if (before == 0) node[a] = n;
    }
}

void moe_node_meta(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK,
                   const Tensor& node_idx_TK, const Tensor& slot_TK, const Tensor& node_row_TK,
                   int64_t experts_per_node, const Tensor& meta_idx_RS, const Tensor& meta_prob_RS,
                   const Tensor& assign_TK) {
  check_2d(topk_idx_TK, "moe_node_meta topk_idx");
  check_dtype(topk_idx_TK, DType::i32, "moe_node_meta topk_idx");
  const Shape tk = topk_idx_TK.shape();
  check_shape(topk_prob_TK, tk, "moe_node_meta topk_prob");
  for (const Tensor* t : {&node_idx_TK, &slot_TK}) {
    check_dtype(*t, DType::i32, "moe_node_meta node_idx / slot");
    check_shape(*t, tk, "moe_node_meta node_idx / slot");
  }
  for (const Tensor* t : {&node_row_TK, &assign_TK}) {
    check_dtype(*t, DType::i64, "moe_node_meta node_row / assign");
    check_shape(*t, tk, "moe_node_meta node_row / assign");
  }
  check_2d(meta_idx_RS, "moe_node_meta meta_idx");
  check_2d(meta_prob_RS, "moe_node_meta meta_prob");
  check_dtype(meta_idx_RS, DType::i32, "moe_node_meta meta_idx");
  check_shape(meta_prob_RS, meta_idx_RS.shape(), "moe_node_meta meta_prob");
  MF_CHECK(meta_prob_RS.dtype() == topk_prob_TK.dtype(), "moe_node_meta: meta_prob ", meta_prob_RS.str(),
           ", topk_prob ", topk_prob_TK.str());
  MF_CHECK(experts_per_node >= 1, "moe_node_meta: ", experts_per_node, " experts per node");
  MF_ON_GPU(ctx, topk_idx_TK,
            cuda::moe_node_meta(ctx, topk_idx_TK, topk_prob_TK, node_idx_TK, slot_TK, node_row_TK, experts_per_node,
                                meta_idx_RS, meta_prob_RS, assign_TK));
  check_on_cpu(topk_idx_TK, "moe_node_meta topk_idx");
  const int64_t t_n = tk[0], k_n = tk[1], r_n = meta_idx_RS.size(0), s_n = meta_idx_RS.size(1);
  const int32_t* idx = topk_idx_TK.ptr<int32_t>();
  const int32_t* node = node_idx_TK.ptr<int32_t>();
  const int32_t* slot = slot_TK.ptr<int32_t>();
  const int64_t* row = node_row_TK.ptr<int64_t>();
  int32_t* meta_idx = meta_idx_RS.ptr<int32_t>();
  int64_t* assign = assign_TK.ptr<int64_t>();
  for (int64_t i = 0; i < r_n * s_n; ++i) meta_idx[i] = -1;
  dispatch_float(topk_prob_TK.dtype(), [&]<class T>() {
    const T* prob = topk_prob_TK.ptr<T>();
    T* meta_prob = meta_prob_RS.ptr<T>();
    for (int64_t i = 0; i < r_n * s_n; ++i) meta_prob[i] = T(0);
    for (int64_t t = 0; t < t_n; ++t)
      for (int64_t k = 0; k < k_n; ++k) {
        const int64_t a = t * k_n + k;
        assign[a] = -1;
        if (slot[a] < 0) continue;
        const int32_t n = static_cast<int32_t>(idx[a] / experts_per_node);
        int64_t r = -1;  // the row of the token's leader on node n
        for (int64_t j = 0; j <= k && r < 0; ++j)
          if (node[t * k_n + j] == n) r = row[t * k_n + j];
        MF_CHECK(r >= 0 && r < r_n && slot[a] < s_n, "moe_node_meta: assignment (", t, ", ", k, ") to row ", r, " of ",
                 r_n, ", slot ", slot[a], " of ", s_n);
        const int64_t at = r * s_n + slot[a];
        meta_idx[at] = static_cast<int32_t>(idx[a] - n * experts_per_node);
        meta_prob[at] = prob[a];
        assign[a] = at;
      }
  });
}

void moe_node_meta_backward(const ExecContext& ctx, const Tensor& dmeta_RS, const Tensor& assign_TK,
                            const Tensor& dprob_TK) {
  check_2d(dmeta_RS, "moe_node_meta_backward dmeta");
  check_2d(dprob_TK, "moe_node_meta_backward dprob");
  check_dtype(assign_TK, DType::i64, "moe_node_meta_backward assign");
  check_shape(assign_TK, dprob_TK.shape(), "moe_node_meta_backward assign");
  MF_CHECK(dmeta_RS.dtype() == dprob_TK.dtype(), "moe_node_meta_backward: dmeta ", dmeta_RS.str(), ", dprob ",
           dprob_TK.str());
  MF_ON_GPU(ctx, dprob_TK, cuda::moe_node_meta_backward(ctx, dmeta_RS, assign_TK, dprob_TK));
  check_on_cpu(dprob_TK, "moe_node_meta_backward dprob");
  const int64_t n = dprob_TK.numel(), m = dmeta_RS.numel();
  const int64_t* assign = assign_TK.ptr<int64_t>();
  dispatch_float(dprob_TK.dtype(), [&]<class T>() {
    const T* src = dmeta_RS.ptr<T>();
    T* dst = dprob_TK.ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      MF_CHECK(assign[i] < m, "moe_node_meta_backward: place ", assign[i], " of ", m);
      dst[i] = assign[i] >= 0 ? src[assign[i]] : T(0);
    }
  });
}

}  // namespace moefold
