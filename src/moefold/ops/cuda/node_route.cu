// CUDA node routing (ops/moe_ops.h, contracts in node_route.h): one thread per token, its K
// assignments in k order as the CPU reference walks them.
#include "moefold/ops/cuda/common.cuh"
// (common.cuh first: it declares dtype_of<__nv_bfloat16>.)
#include "moefold/ops/cuda/moe_common.cuh"
#include "moefold/ops/cuda/node_route.h"

namespace moefold::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool kept(const int32_t* idx, const int64_t* keep, int64_t a) {
  return idx[a] >= 0 && (keep == nullptr || keep[a] >= 0);
}

__global__ void node_route_kernel(const int32_t* idx, const int64_t* keep, int64_t t_n, int k_n, int64_t per_node,
                                  int32_t* node, int32_t* slot) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= t_n) return;
  for (int k = 0; k < k_n; ++k) {
    const int64_t a = t * k_n + k;
    node[a] = slot[a] = -1;
    if (!kept(idx, keep, a)) continue;
    const int32_t n = static_cast<int32_t>(idx[a] / per_node);
    int32_t before = 0;
    for (int j = 0; j < k; ++j) {
      const int64_t b = t * k_n + j;
      before += kept(idx, keep, b) && idx[b] / per_node == n;
    }
    slot[a] = before;
    if (before == 0) node[a] = n;
  }
}

__global__ void fill_meta_kernel(int64_t n, int32_t* meta_idx, float* meta_prob) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    meta_idx[i] = -1;
    meta_prob[i] = 0.f;
  }
}

__global__ void node_meta_kernel(const int32_t* idx, const float* prob, const int32_t* node, const int32_t* slot,
                                 const int64_t* row, int64_t t_n, int k_n, int64_t per_node, int64_t r_n, int64_t s_n,
                                 int32_t* meta_idx, float* meta_prob, int64_t* assign) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= t_n) return;
  for (int k = 0; k < k_n; ++k) {
    const int64_t a = t * k_n + k;
    assign[a] = -1;
    if (slot[a] < 0) continue;
    const int32_t n = static_cast<int32_t>(idx[a] / per_node);
    int64_t r = -1;
    for (int j = 0; j <= k && r < 0; ++j)
      if (node[t * k_n + j] == n) r = row[t * k_n + j];
    MF_DEVICE_REQUIRE(r >= 0 && r < r_n && slot[a] < s_n, "moe_node_meta: assignment %lld to row %lld of %lld",
                      static_cast<long long>(a), static_cast<long long>(r), static_cast<long long>(r_n));
    const int64_t at = r * s_n + slot[a];
    meta_idx[at] = static_cast<int32_t>(idx[a] - n * per_node);
    meta_prob[at] = prob[a];
    assign[a] = at;
  }
}

__global__ void node_meta_backward_kernel(const float* dmeta, int64_t m, const int64_t* assign, int64_t n,
                                          float* dprob) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t at = assign[i];
    MF_DEVICE_REQUIRE(at < m, "moe_node_meta_backward: place %lld of %lld", static_cast<long long>(at),
                      static_cast<long long>(m));
    dprob[i] = at >= 0 ? dmeta[at] : 0.f;
  }
}

}  // namespace

void moe_node_route(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& keep_row_TK,
                    int64_t experts_per_node, const Tensor& node_idx_TK, const Tensor& slot_TK) {
  check_cuda_tensor(topk_idx_TK, "moe_node_route topk_idx");
  check_cuda_tensor(node_idx_TK, "moe_node_route node_idx");
  check_cuda_tensor(slot_TK, "moe_node_route slot");
  if (keep_row_TK.defined()) check_cuda_tensor(keep_row_TK, "moe_node_route keep_row");
  const int64_t t_n = topk_idx_TK.size(0);
  if (t_n == 0) return;
  node_route_kernel<<<blocks_for(t_n, kThreads), kThreads, 0, stream_of(ctx)>>>(
      topk_idx_TK.ptr<int32_t>(), keep_row_TK.defined() ? keep_row_TK.ptr<int64_t>() : nullptr, t_n,
      static_cast<int>(topk_idx_TK.size(1)), experts_per_node, node_idx_TK.ptr<int32_t>(), slot_TK.ptr<int32_t>());
  MF_CUDA_LAUNCHED("moe_node_route");
}

void moe_node_meta(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK,
                   const Tensor& node_idx_TK, const Tensor& slot_TK, const Tensor& node_row_TK,
                   int64_t experts_per_node, const Tensor& meta_idx_RS, const Tensor& meta_prob_RS,
                   const Tensor& assign_TK) {
  for (const Tensor* t : {&topk_idx_TK, &node_idx_TK, &slot_TK, &node_row_TK, &meta_idx_RS, &assign_TK})
    check_cuda_tensor(*t, "moe_node_meta");
  check_cuda_dtype(topk_prob_TK, DType::f32, "moe_node_meta topk_prob (CUDA: f32)");
  check_cuda_dtype(meta_prob_RS, DType::f32, "moe_node_meta meta_prob (CUDA: f32)");
  const int64_t t_n = topk_idx_TK.size(0), m = meta_idx_RS.numel();
  if (m > 0) {
    fill_meta_kernel<<<blocks_for(m, kThreads), kThreads, 0, stream_of(ctx)>>>(m, meta_idx_RS.ptr<int32_t>(),
                                                                               meta_prob_RS.ptr<float>());
    MF_CUDA_LAUNCHED("moe_node_meta fill");
  }
  if (t_n == 0) return;
  node_meta_kernel<<<blocks_for(t_n, kThreads), kThreads, 0, stream_of(ctx)>>>(
      topk_idx_TK.ptr<int32_t>(), topk_prob_TK.ptr<float>(), node_idx_TK.ptr<int32_t>(), slot_TK.ptr<int32_t>(),
      node_row_TK.ptr<int64_t>(), t_n, static_cast<int>(topk_idx_TK.size(1)), experts_per_node, meta_idx_RS.size(0),
      meta_idx_RS.size(1), meta_idx_RS.ptr<int32_t>(), meta_prob_RS.ptr<float>(), assign_TK.ptr<int64_t>());
  MF_CUDA_LAUNCHED("moe_node_meta");
}

void moe_node_meta_backward(const ExecContext& ctx, const Tensor& dmeta_RS, const Tensor& assign_TK,
                            const Tensor& dprob_TK) {
  check_cuda_tensor(assign_TK, "moe_node_meta_backward assign");
  check_cuda_dtype(dmeta_RS, DType::f32, "moe_node_meta_backward dmeta (CUDA: f32)");
  check_cuda_dtype(dprob_TK, DType::f32, "moe_node_meta_backward dprob (CUDA: f32)");
  const int64_t n = dprob_TK.numel();
  if (n == 0) return;
  node_meta_backward_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
      dmeta_RS.ptr<float>(), dmeta_RS.numel(), assign_TK.ptr<int64_t>(), n, dprob_TK.ptr<float>());
  MF_CUDA_LAUNCHED("moe_node_meta_backward");
}

}  // namespace moefold::cuda
