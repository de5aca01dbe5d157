// CUDA router statistics and losses (ops/moe_ops.h, contracts in router_losses.h): expert counts,
// the load-balancing losses (batch and sequence level), the z-loss and the aux-loss-free bias
// update. Gradient rule: dlogits WRITTEN; the counts carry no gradient.
#include "moefold/ops/cuda/common.cuh"
// (common.cuh first: it declares dtype_of<__nv_bfloat16>.)
#include <algorithm>
#include <limits>

#include "moefold/ops/cuda/moe_common.cuh"
#include "moefold/ops/cuda/router_losses.h"

namespace moefold::cuda {

namespace {

// counts[e] += selections of e; a block histogram in shared memory (kShared) or global atomics.
template <bool kShared>
__global__ void expert_counts_kernel(const int32_t* idx, int64_t n, int e_n, unsigned long long* counts) {
  extern __shared__ unsigned hist[];
  if (kShared) {
    for (int e = static_cast<int>(threadIdx.x); e < e_n; e += static_cast<int>(blockDim.x)) hist[e] = 0;
    __syncthreads();
  }
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = idx[i];
    MF_DEVICE_REQUIRE(e >= 0 && e < e_n, "expert index %d out of [0, %d)", e, e_n);
    if (kShared)
      atomicAdd(&hist[e], 1u);
    else
      atomicAdd(&counts[e], 1ull);
  }
  if (kShared) {
    __syncthreads();
    for (int e = static_cast<int>(threadIdx.x); e < e_n; e += static_cast<int>(blockDim.x))
      if (hist[e]) atomicAdd(&counts[e], static_cast<unsigned long long>(hist[e]));
  }
}

// counts_BE[b(t), e] += 1 for each selection (t, e); b(t) = (row_offset + t) / local_seq_len.
__global__ void seq_expert_counts_kernel(const int32_t* idx, int64_t n, int k_n, int e_n, int64_t row_offset,
                                         int64_t local_seq_len, unsigned long long* counts) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int e = idx[i];
    MF_DEVICE_REQUIRE(e >= 0 && e < e_n, "expert index %d out of [0, %d)", e, e_n);
    const int64_t b = (row_offset + i / k_n) / local_seq_len;
    atomicAdd(&counts[b * e_n + e], 1ull);
  }
}

constexpr int kCountThreads = 256;

void launch_counts(const ExecContext& ctx, const int32_t* idx, int64_t n, int e_n, int64_t* counts) {
  MF_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(e_n) * sizeof(int64_t), stream_of(ctx)));
  if (n == 0) return;
  const int blocks = std::min(blocks_for(n, kCountThreads), 1024);
  auto* c = reinterpret_cast<unsigned long long*>(counts);
  const size_t shared = static_cast<size_t>(e_n) * sizeof(unsigned);
  if (shared <= kSharedBudget)
    expert_counts_kernel<true><<<blocks, kCountThreads, shared, stream_of(ctx)>>>(idx, n, e_n, c);
  else
    expert_counts_kernel<false><<<blocks, kCountThreads, 0, stream_of(ctx)>>>(idx, n, e_n, c);
  MF_CUDA_LAUNCHED("topk_expert_counts");
}

// ---- load-balancing and z losses ---------------------------------------------------------------
// One warp per token, in f64. Token t reads the counts row of its sequence, (row_offset + t) /
// local_seq_len (the batch-level aux loss: one row, local_seq_len = T).

constexpr int kLossWarps = 8;
constexpr int kLossMaxBlocks = 1024;  // fixed: the partial sums, so the result, depend on T only

// sum_e counts_e * p_e for one token, p the full score distribution (sigmoid: s / sum s).
__device__ double weighted_prob_row(const float* s, int e_n, bool softmax, const int64_t* counts) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  double norm = 1, total = 0;
  if (!softmax) {
    norm = 0;
    for (int e = lane; e < e_n; e += kWarp) norm += static_cast<double>(s[e]);
    norm = warp_sum(norm);
  }
  for (int e = lane; e < e_n; e += kWarp) total += static_cast<double>(s[e]) / norm * static_cast<double>(counts[e]);
  return warp_sum(total);
}

// Where row_loss_kernel's last block puts the loss (out null: the host adds the partial sums).
struct LossFinish {
  unsigned* arrived = nullptr;  // blocks done (zero before and after the kernel)
  double mul = 1, div = 1;
  double* out = nullptr;  // f64 [1]: the partial sums in order, times mul, over div
};

// Per-token value (weighted_prob_row for the aux losses, lse^2 for the z-loss) summed over the
// tokens of each block in a fixed order: partial[block]; with fin.out, the last block to finish
// adds the partials in block order (one thread: the host loop's additions) into *fin.out.
template <int kKind>  // 0: aux (scores, counts), 1: z-loss (logits)
__global__ void row_loss_kernel(const float* x, int64_t t_n, int e_n, bool softmax, const int64_t* counts,
                                int64_t row_offset, int64_t local_seq_len, double* partial, LossFinish fin) {
  __shared__ double warp_total[kLossWarps];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  double acc = 0;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kLossWarps + warp; t < t_n;
       t += static_cast<int64_t>(gridDim.x) * kLossWarps) {
    const float* row = x + t * e_n;
    if constexpr (kKind == 0) {
      acc += weighted_prob_row(row, e_n, softmax, counts + (row_offset + t) / local_seq_len * e_n);
    } else {
      float m = -INFINITY;
      for (int e = lane; e < e_n; e += kWarp) m = fmaxf(m, row[e]);
      m = warp_max(m);
      double sum = 0;
      for (int e = lane; e < e_n; e += kWarp) sum += exp(static_cast<double>(row[e]) - m);
      const double lse = m + log(warp_sum(sum));
      acc += lse * lse;
    }
  }
  if (lane == 0) warp_total[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int w = 0; w < kLossWarps; ++w) s += warp_total[w];
    partial[blockIdx.x] = s;
  }
  if (fin.out == nullptr || !block_is_last_to_arrive(fin.arrived, gridDim.x) || threadIdx.x != 0) return;
  double total = 0;
  for (unsigned i = 0; i < gridDim.x; ++i) total += __ldcg(partial + i);
  fin.out[0] = total * fin.mul / fin.div;
}

// Sum over tokens of the per-token value, times mul, over div: returned (waits for the GPU), or
// with `out` (f64 [1] on the GPU) written there without waiting, NaN returned.
template <int kKind>
double row_loss(const ExecContext& ctx, const float* x, int64_t t_n, int e_n, bool softmax, const int64_t* counts,
                int64_t row_offset, int64_t local_seq_len, double mul, double div, const Tensor& out,
                const char* what) {
  if (out.defined()) check_cuda_tensor(out, what);  // f64 [1]: checked by the CPU entry
  if (t_n == 0) {
    if (out.defined()) MF_CUDA_CHECK(cudaMemsetAsync(out.data(), 0, sizeof(double), stream_of(ctx)));
    return out.defined() ? std::numeric_limits<double>::quiet_NaN() : 0.0;
  }
  const int blocks = std::min(blocks_for(t_n, kLossWarps), kLossMaxBlocks);
  auto* partial = static_cast<double*>(ctx.scratch(ScratchSlot::router_loss, blocks * sizeof(double)));
  LossFinish fin;
  if (out.defined())
    fin = {static_cast<unsigned*>(ctx.scratch(ScratchSlot::arrivals, sizeof(unsigned))), mul, div, out.ptr<double>()};
  row_loss_kernel<kKind><<<blocks, kLossWarps * kWarp, 0, stream_of(ctx)>>>(x, t_n, e_n, softmax, counts, row_offset,
                                                                            local_seq_len, partial, fin);
  MF_CUDA_LAUNCHED(what);
  if (out.defined()) return std::numeric_limits<double>::quiet_NaN();
  double host[kLossMaxBlocks];
  MF_CUDA_CHECK(cudaMemcpyAsync(host, partial, blocks * sizeof(double), cudaMemcpyDeviceToHost, stream_of(ctx)));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  double total = 0;
  for (int i = 0; i < blocks; ++i) total += host[i];
  return total * mul / div;
}

// dlogits = d(c0 * sum_e counts_e p_e)/d(logits) for each token (written), in f64: with
// c_e = c0 * counts_e, softmax: dl_e = p_e (c_e - sum_f c_f p_f); sigmoid p = s / S:
// dl_e = (c_e - sum_f c_f s_f / S) / S * s_e (1 - s_e).
__global__ void weighted_prob_backward_kernel(const float* scores, int64_t t_n, int e_n, bool softmax,
                                              const int64_t* counts, int64_t row_offset, int64_t local_seq_len,
                                              double c0, float* dlogits) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (t >= t_n) return;
  const float* s = scores + t * e_n;
  const int64_t* cb = counts + (row_offset + t) / local_seq_len * e_n;
  float* d = dlogits + t * e_n;
  double sum = 0, dot = 0;
  for (int e = lane; e < e_n; e += kWarp) {
    const double se = s[e];
    sum += se;
    dot += c0 * static_cast<double>(cb[e]) * se;
  }
  sum = warp_sum(sum);
  dot = warp_sum(dot);
  for (int e = lane; e < e_n; e += kWarp) {
    const double se = s[e], ce = c0 * static_cast<double>(cb[e]);
    d[e] = static_cast<float>(softmax ? se * (ce - dot) : (ce - dot / sum) / sum * se * (1.0 - se));
  }
}

// dlogits = c * lse_t * softmax(logits_t) (written), in f64.
__global__ void z_loss_backward_kernel(const float* logits, int64_t t_n, int e_n, double c, float* dlogits) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (t >= t_n) return;
  const float* l = logits + t * e_n;
  float m = -INFINITY;
  for (int e = lane; e < e_n; e += kWarp) m = fmaxf(m, l[e]);
  m = warp_max(m);
  double sum = 0;
  for (int e = lane; e < e_n; e += kWarp) sum += exp(static_cast<double>(l[e]) - m);
  sum = warp_sum(sum);
  const double scale = c * (m + log(sum)) / sum;
  for (int e = lane; e < e_n; e += kWarp)
    dlogits[t * e_n + e] = static_cast<float>(exp(static_cast<double>(l[e]) - m) * scale);
}

// One block: the integer total, then bias_e += rate * sign(total - E * counts_e), as the CPU.
template <class T>
__global__ void expert_bias_update_kernel(T* bias, const int64_t* counts, int e_n, double rate) {
  __shared__ long long warp_total[32];
  __shared__ long long total;
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  long long s = 0;
  for (int e = static_cast<int>(threadIdx.x); e < e_n; e += static_cast<int>(blockDim.x)) s += counts[e];
  s = warp_sum(s);
  if (lane == 0) warp_total[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    long long all = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x) / kWarp; ++w) all += warp_total[w];
    total = all;
  }
  __syncthreads();
  for (int e = static_cast<int>(threadIdx.x); e < e_n; e += static_cast<int>(blockDim.x)) {
    const long long diff = total - static_cast<long long>(e_n) * counts[e];
    const int sign = (diff > 0) - (diff < 0);
    bias[e] = bias[e] + static_cast<T>(rate * sign);
  }
}

// One warp: moe_step_stats (moe_ops.h), the CPU's arithmetic (no fused multiply-adds).
__global__ void moe_step_stats_kernel(const double* losses, double aux_coeff, double seq_aux_coeff, double z_coeff,
                                      const int64_t* counts, int e_n, long long capacity, double* sums, double* load,
                                      double* dropped) {
  const int lane = static_cast<int>(threadIdx.x);
  for (int e = lane; e < e_n; e += kWarp) load[e] = __dadd_rn(load[e], static_cast<double>(counts[e]));
  if (capacity > 0) {
    long long d = 0;
    for (int e = lane; e < e_n; e += kWarp) d += max(static_cast<long long>(counts[e]) - capacity, 0LL);
    d = warp_sum(d);
    if (lane == 0) dropped[0] = __dadd_rn(dropped[0], static_cast<double>(d));
  }
  if (lane == 0) {
    double aux = 0, z = 0;
    if (aux_coeff != 0) aux = __dmul_rn(aux_coeff, losses[0]);
    if (seq_aux_coeff != 0) aux = __dadd_rn(aux, __dmul_rn(seq_aux_coeff, losses[1]));
    if (z_coeff != 0) z = __dmul_rn(z_coeff, losses[2]);
    sums[0] = __dadd_rn(sums[0], aux);
    sums[1] = __dadd_rn(sums[1], z);
  }
}

// The device side of the load-balancing losses' arguments: f32 scores, E within int.
void check_aux(const Tensor& scores_TE, const Tensor& counts, const char* what) {
  check_cuda_dtype(scores_TE, DType::f32, what);
  check_cuda_tensor(counts, what);
  MF_CHECK(scores_TE.size(1) <= std::numeric_limits<int>::max(), what, ": scores ", scores_TE.str());
}

}  // namespace

void topk_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& counts_E) {
  check_cuda_tensor(topk_idx_TK, "topk_expert_counts topk_idx");
  check_cuda_tensor(counts_E, "topk_expert_counts counts");
  MF_CHECK(counts_E.size(0) <= std::numeric_limits<int>::max(), "topk_expert_counts counts: ", counts_E.str());
  launch_counts(ctx, topk_idx_TK.ptr<int32_t>(), topk_idx_TK.numel(), static_cast<int>(counts_E.size(0)),
                counts_E.ptr<int64_t>());
}

void seq_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const SeqLayout& layout,
                       const Tensor& counts_BE) {
  check_cuda_tensor(topk_idx_TK, "seq_expert_counts topk_idx");
  check_cuda_tensor(counts_BE, "seq_expert_counts counts");
  const int64_t k_n = topk_idx_TK.size(1), e_n = counts_BE.size(1);
  MF_CHECK(e_n <= std::numeric_limits<int>::max() && k_n >= 1, "seq_expert_counts (CUDA: K >= 1): ", topk_idx_TK.str(),
           ", ", counts_BE.str());
  MF_CUDA_CHECK(cudaMemsetAsync(counts_BE.data(), 0, counts_BE.nbytes(), stream_of(ctx)));
  const int64_t n = topk_idx_TK.numel();
  if (n == 0) return;
  seq_expert_counts_kernel<<<std::min(blocks_for(n, kCountThreads), 1024), kCountThreads, 0, stream_of(ctx)>>>(
      topk_idx_TK.ptr<int32_t>(), n, static_cast<int>(k_n), static_cast<int>(e_n), layout.row_offset,
      layout.local_seq_len, reinterpret_cast<unsigned long long*>(counts_BE.ptr<int64_t>()));
  MF_CUDA_LAUNCHED("seq_expert_counts");
}

// ---- load-balancing losses ---------------------------------------------------------------------

double aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E,
                        int64_t k, int64_t total_tokens, const Tensor& loss_1) {
  check_aux(scores_TE, counts_E, "aux_loss_forward");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1);
  const int64_t t_all = total_tokens > 0 ? total_tokens : t_n;
  return row_loss<0>(ctx, scores_TE.ptr<float>(), t_n, static_cast<int>(e_n), score_func == ScoreFunc::softmax,
                     counts_E.ptr<int64_t>(), 0, t_n, static_cast<double>(e_n),
                     static_cast<double>(t_all) * static_cast<double>(t_all) * static_cast<double>(k), loss_1,
                     "aux_loss_forward");
}

void aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E,
                       int64_t k, double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens) {
  check_aux(scores_TE, counts_E, "aux_loss_backward");
  check_cuda_dtype(dlogits_TE, DType::f32, "aux_loss_backward dlogits");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1);
  if (t_n == 0) return;
  const double t_all = static_cast<double>(total_tokens > 0 ? total_tokens : t_n);
  const double c0 = grad_scale * static_cast<double>(e_n) / (t_all * t_all * static_cast<double>(k));
  weighted_prob_backward_kernel<<<blocks_for(t_n, kTokenWarps), kTokenWarps * kWarp, 0, stream_of(ctx)>>>(
      scores_TE.ptr<float>(), t_n, static_cast<int>(e_n), score_func == ScoreFunc::softmax, counts_E.ptr<int64_t>(), 0,
      t_n, c0, dlogits_TE.ptr<float>());
  MF_CUDA_LAUNCHED("aux_loss_backward");
}

double seq_aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func,
                            const Tensor& counts_BE, int64_t k, const SeqLayout& layout, const Tensor& loss_1) {
  check_aux(scores_TE, counts_BE, "seq_aux_loss_forward");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), b_n = counts_BE.size(0);
  const double s_n = static_cast<double>(layout.seq_len);
  return row_loss<0>(ctx, scores_TE.ptr<float>(), t_n, static_cast<int>(e_n), score_func == ScoreFunc::softmax,
                     counts_BE.ptr<int64_t>(), layout.row_offset, layout.local_seq_len, static_cast<double>(e_n),
                     static_cast<double>(k) * s_n * s_n * static_cast<double>(b_n), loss_1, "seq_aux_loss_forward");
}

void seq_aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func,
                           const Tensor& counts_BE, int64_t k, const SeqLayout& layout, double grad_scale,
                           const Tensor& dlogits_TE) {
  check_aux(scores_TE, counts_BE, "seq_aux_loss_backward");
  check_cuda_dtype(dlogits_TE, DType::f32, "seq_aux_loss_backward dlogits");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), b_n = counts_BE.size(0);
  if (t_n == 0) return;
  const double s_n = static_cast<double>(layout.seq_len);
  const double c0 =
      grad_scale * static_cast<double>(e_n) / (static_cast<double>(k) * s_n * s_n * static_cast<double>(b_n));
  weighted_prob_backward_kernel<<<blocks_for(t_n, kTokenWarps), kTokenWarps * kWarp, 0, stream_of(ctx)>>>(
      scores_TE.ptr<float>(), t_n, static_cast<int>(e_n), score_func == ScoreFunc::softmax, counts_BE.ptr<int64_t>(),
      layout.row_offset, layout.local_seq_len, c0, dlogits_TE.ptr<float>());
  MF_CUDA_LAUNCHED("seq_aux_loss_backward");
}

// ---- aux-loss-free balancing -------------------------------------------------------------------

void expert_bias_update(const ExecContext& ctx, const Tensor& bias_E, const Tensor& counts_E, double rate) {
  check_cuda_tensor(bias_E, "expert_bias_update bias");
  check_cuda_tensor(counts_E, "expert_bias_update counts");
  MF_CHECK(bias_E.size(0) <= std::numeric_limits<int>::max(), "expert_bias_update: bias ", bias_E.str());
  const int e_n = static_cast<int>(bias_E.size(0));
  if (e_n == 0) return;
  if (bias_E.dtype() == DType::f64) {
    expert_bias_update_kernel<double>
        <<<1, 1024, 0, stream_of(ctx)>>>(bias_E.ptr<double>(), counts_E.ptr<int64_t>(), e_n, rate);
  } else {
    check_dtype(bias_E, DType::f32, "expert_bias_update bias (CUDA: f32 or f64)");
    expert_bias_update_kernel<float>
        <<<1, 1024, 0, stream_of(ctx)>>>(bias_E.ptr<float>(), counts_E.ptr<int64_t>(), e_n, rate);
  }
  MF_CUDA_LAUNCHED("expert_bias_update");
}

void moe_step_stats(const ExecContext& ctx, const Tensor& losses_3, double aux_coeff, double seq_aux_coeff,
                    double z_coeff, const Tensor& counts_E, int64_t capacity, const Tensor& sums_2,
                    const Tensor& load_E, const Tensor& dropped_1) {
  for (const Tensor* t : {&losses_3, &counts_E, &sums_2, &load_E, &dropped_1}) check_cuda_tensor(*t, "moe_step_stats");
  MF_CHECK(counts_E.numel() <= std::numeric_limits<int>::max(), "moe_step_stats: counts ", counts_E.str());
  moe_step_stats_kernel<<<1, kWarp, 0, stream_of(ctx)>>>(losses_3.ptr<double>(), aux_coeff, seq_aux_coeff, z_coeff,
                                                         counts_E.ptr<int64_t>(), static_cast<int>(counts_E.numel()),
                                                         capacity, sums_2.ptr<double>(), load_E.ptr<double>(),
                                                         dropped_1.ptr<double>());
  MF_CUDA_LAUNCHED("moe_step_stats");
}

// ---- router z-loss -----------------------------------------------------------------------------

double z_loss_forward(const ExecContext& ctx, const Tensor& logits_TE, int64_t total_tokens, const Tensor& loss_1) {
  check_cuda_dtype(logits_TE, DType::f32, "z_loss logits");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1);
  return row_loss<1>(ctx, logits_TE.ptr<float>(), t_n, static_cast<int>(e_n), true, nullptr, 0, t_n, 1.0,
                     static_cast<double>(total_tokens > 0 ? total_tokens : t_n), loss_1, "z_loss_forward");
}

void z_loss_backward(const ExecContext& ctx, const Tensor& logits_TE, double grad_scale, const Tensor& dlogits_TE,
                     int64_t total_tokens) {
  check_cuda_dtype(logits_TE, DType::f32, "z_loss logits");
  check_cuda_dtype(dlogits_TE, DType::f32, "z_loss_backward dlogits");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1);
  if (t_n == 0) return;
  const double c = grad_scale * 2.0 / static_cast<double>(total_tokens > 0 ? total_tokens : t_n);
  z_loss_backward_kernel<<<blocks_for(t_n, kTokenWarps), kTokenWarps * kWarp, 0, stream_of(ctx)>>>(
      logits_TE.ptr<float>(), t_n, static_cast<int>(e_n), c, dlogits_TE.ptr<float>());
  MF_CUDA_LAUNCHED("z_loss_backward");
}

}  // namespace moefold::cuda
