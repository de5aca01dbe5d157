// CUDA router scores and top-k (ops/moe_ops.h, contracts in router_topk.h), forward and backward:
// one warp per token. Gradient rule: dlogits WRITTEN (nothing flows to the selection bias).
#include "moefold/ops/cuda/common.cuh"
// (common.cuh first: it declares dtype_of<__nv_bfloat16>.)
#include <algorithm>
#include <limits>

#include "moefold/ops/cuda/moe_common.cuh"
#include "moefold/ops/cuda/router_topk.h"

namespace moefold::cuda {

namespace {

// exp rounded once from the double result: correctly rounded except within ~2^-29 of a rounding
// boundary. The CPU reference's expf (glibc, < 0.502 ulp) differs from it in ~6e-4 of the inputs,
// by one ulp; a score computed from the same f32 input is otherwise bit-identical on both sides.
__device__ __forceinline__ float exp_f32(float x) { return static_cast<float>(exp(static_cast<double>(x))); }

// A selection candidate: choice value c of expert (or group) e; e < 0: none.
struct Cand {
  float c;
  int e;
};

// The CPU's repeated arg-max order: the higher choice first, ties to the lower index. A strict
// total order on candidates (NaN choices are mapped to -inf before they get here), so every lane
// of a butterfly ends with the same winner.
__device__ __forceinline__ bool beats(Cand a, Cand b) {
  return a.e >= 0 && (b.e < 0 || a.c > b.c || (a.c == b.c && a.e < b.e));
}

__device__ __forceinline__ Cand warp_best(Cand a) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) {
    const Cand o{__shfl_xor_sync(kFullMask, a.c, off), __shfl_xor_sync(kFullMask, a.e, off)};
    if (beats(o, a)) a = o;
  }
  return a;
}

__device__ __forceinline__ float no_nan(float x) { return x != x ? -INFINITY : x; }

// One warp per token; lane l holds experts l + 32 j, j < V. Shared memory per warp: the scores
// s[E], the choices c[E] and the group scores g[n_group]. The arithmetic of each score, choice
// and group score repeats the CPU reference's f32 operations one for one (IEEE add and divide,
// no contraction), the sums over experts run as a butterfly (a common factor of a token's scores,
// which keeps their order), and the selection is the CPU's: group pass, then K arg-max passes.
template <int V>
__global__ void router_topk_forward_kernel(const float* logits, const float* bias, int64_t t_n, int e_n, int k_n,
                                           bool softmax, int n_group, int topk_group, bool norm, float scaling,
                                           float* scores, int32_t* idx_out, float* prob_out) {
  extern __shared__ float shared[];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (t >= t_n) return;  // whole warps only: nothing below synchronises the block
  float* s_sh = shared + static_cast<int64_t>(warp) * (2 * e_n + n_group);
  float* c_sh = s_sh + e_n;
  float* g_sh = c_sh + e_n;
  const float* l = logits + t * e_n;

  float s[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = lane + kWarp * j;
    s[j] = e < e_n ? l[e] : -INFINITY;
  }
  if (softmax) {
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < V; ++j) m = fmaxf(m, s[j]);
    m = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      s[j] = lane + kWarp * j < e_n ? exp_f32(__fsub_rn(s[j], m)) : 0.f;
      sum = __fadd_rn(sum, s[j]);
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] = __fdiv_rn(s[j], sum);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) s[j] = __fdiv_rn(1.f, __fadd_rn(1.f, exp_f32(-s[j])));
  }

  float c[V];
  float* scores_t = scores + t * e_n;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = lane + kWarp * j;
    c[j] = -INFINITY;
    if (e < e_n) {
      c[j] = no_nan(bias ? __fadd_rn(s[j], bias[e]) : s[j]);
      s_sh[e] = s[j];
      c_sh[e] = c[j];
      scores_t[e] = s[j];
    }
  }
  __syncwarp();

  // Group-limited routing: the topk_group-th best group (last, last_score) bounds the kept ones.
  const int g_size = e_n / n_group;
  int last = -1;
  float last_score = 0.f;
  if (topk_group < n_group) {
    for (int g = lane; g < n_group; g += kWarp) {
      float first = -INFINITY, second = -INFINITY;
      for (int e = g * g_size; e < (g + 1) * g_size; ++e) {
        const float x = c_sh[e];
        if (x > first) {
          second = first;
          first = x;
        } else if (x > second) {
          second = x;
        }
      }
      g_sh[g] = no_nan(g_size >= 2 ? __fadd_rn(first, second) : first);
    }
    __syncwarp();
    for (int pass = 0; pass < topk_group; ++pass) {
      Cand best{0.f, -1};
      for (int g = lane; g < n_group; g += kWarp) {
        const Cand cand{g_sh[g], g};
        if (last >= 0 && !beats(Cand{last_score, last}, cand)) continue;  // only groups after `last`
        if (beats(cand, best)) best = cand;
      }
      best = warp_best(best);
      last = best.e;
      last_score = best.c;
    }
  }

  unsigned eligible = 0;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const int e = lane + kWarp * j;
    if (e < e_n) {
      const int g = e / g_size;
      if (last < 0 || g == last || beats(Cand{g_sh[g], g}, Cand{last_score, last})) eligible |= 1u << j;
    }
  }

  int my_idx = -1;  // lane k < K: the k-th selected expert and its unbiased score
  float my_s = 0.f;
  for (int k = 0; k < k_n; ++k) {
    Cand best{0.f, -1};
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const Cand cand{c[j], lane + kWarp * j};
      if (((eligible >> j) & 1u) && beats(cand, best)) best = cand;
    }
    best = warp_best(best);
    if (best.e >= 0 && best.e % kWarp == lane) eligible &= ~(1u << (best.e / kWarp));
    if (lane == k) {
      my_idx = best.e;
      my_s = best.e >= 0 ? s_sh[best.e] : 0.f;
    }
  }
  // The CPU's sum: in k order, in f32.
  float sum = 0.f;
  for (int k = 0; k < k_n; ++k) sum = __fadd_rn(sum, __shfl_sync(kFullMask, my_s, k));
  if (lane < k_n) {
    const float p = norm ? __fdiv_rn(my_s, sum) : my_s;
    idx_out[t * k_n + lane] = my_idx;
    prob_out[t * k_n + lane] = __fmul_rn(p, scaling);
  }
}

template <int V>
void launch_router_topk_forward(const ExecContext& ctx, const float* logits, const float* bias, int64_t t_n, int e_n,
                                int k_n, bool softmax, int n_group, int topk_group, bool norm, float scaling,
                                float* scores, int32_t* idx, float* prob) {
  const size_t per_warp = static_cast<size_t>(2 * e_n + n_group) * sizeof(float);
  const int warps = static_cast<int>(std::clamp<size_t>(kSharedBudget / per_warp, 1, 8));
  router_topk_forward_kernel<V><<<blocks_for(t_n, warps), warps * kWarp, warps * per_warp, stream_of(ctx)>>>(
      logits, bias, t_n, e_n, k_n, softmax, n_group, topk_group, norm, scaling, scores, idx, prob);
}

// One warp per token, in f64: ds at the K selected experts (renormalisation and scaling), then
// through the softmax or the sigmoid to every expert's logit.
__global__ void router_topk_backward_kernel(const float* scores, const int32_t* idx, const float* dprob, int64_t t_n,
                                            int e_n, int k_n, bool softmax, bool norm, double scaling, float* dlogits) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (t >= t_n) return;
  const float* s = scores + t * e_n;
  int ek = -1;
  double sk = 0, dpk = 0;
  if (lane < k_n) {
    ek = idx[t * k_n + lane];
    MF_DEVICE_REQUIRE(ek >= 0 && ek < e_n, "token %lld selects expert %d of %d", static_cast<long long>(t), ek, e_n);
    sk = s[ek];
    dpk = dprob[t * k_n + lane];
  }
  double dk = scaling * dpk;
  if (norm) {
    // p_k = c * s_k / S with S = sum_j s_j: dS_k = c * (dp_k - sum_j dp_j s_j / S) / S.
    const double sum = warp_sum(sk), dot = warp_sum(dpk * sk);
    dk = lane < k_n ? scaling * (dpk - dot / sum) / sum : 0.0;
  }
  const double dot = softmax ? warp_sum(dk * sk) : 0.0;
  float* d = dlogits + t * e_n;
  for (int e0 = 0; e0 < e_n; e0 += kWarp) {
    const int e = e0 + lane;
    double de = 0;
    for (int k = 0; k < k_n; ++k) {
      const int ekk = __shfl_sync(kFullMask, ek, k);
      const double dkk = __shfl_sync(kFullMask, dk, k);
      if (ekk == e) de = dkk;
    }
    if (e < e_n) {
      const double se = s[e];
      d[e] = static_cast<float>(softmax ? se * (de - dot) : de * se * (1.0 - se));
    }
  }
}

}  // namespace

// ---- router scores and top-k -------------------------------------------------------------------

void router_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const TopkRouting& routing,
                         const Tensor& scores_TE, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) {
  check_cuda_dtype(logits_TE, DType::f32, "router_topk_forward logits");
  check_cuda_dtype(scores_TE, DType::f32, "router_topk_forward scores");
  check_cuda_tensor(topk_idx_TK, "router_topk_forward topk_idx");
  check_cuda_dtype(topk_prob_TK, DType::f32, "router_topk_forward topk_prob");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1), k_n = topk_idx_TK.size(1);
  const int64_t n_group = routing.n_group, topk_group = routing.topk_group;
  MF_CHECK(k_n <= 32 && e_n <= 1024, "router_topk_forward (CUDA: E <= 1024, K <= 32): logits ", logits_TE.str(),
           ", topk_idx ", topk_idx_TK.str());
  const Tensor& bias = routing.bias_E;
  if (bias.defined()) check_cuda_dtype(bias, DType::f32, "router_topk_forward bias (CUDA: f32)");
  if (t_n == 0) return;
  const float* b = bias.defined() ? bias.ptr<float>() : nullptr;
  const bool softmax = routing.score_func == ScoreFunc::softmax;
  const int e = static_cast<int>(e_n), k = static_cast<int>(k_n), ng = static_cast<int>(n_group),
            tg = static_cast<int>(topk_group);
  const auto scaling = static_cast<float>(routing.scaling);
  auto launch = [&]<int V>() {
    launch_router_topk_forward<V>(ctx, logits_TE.ptr<float>(), b, t_n, e, k, softmax, ng, tg, routing.norm_topk_prob,
                                  scaling, scores_TE.ptr<float>(), topk_idx_TK.ptr<int32_t>(),
                                  topk_prob_TK.ptr<float>());
  };
  if (e_n <= 32)
    launch.template operator()<1>();
  else if (e_n <= 64)
    launch.template operator()<2>();
  else if (e_n <= 128)
    launch.template operator()<4>();
  else if (e_n <= 256)
    launch.template operator()<8>();
  else if (e_n <= 512)
    launch.template operator()<16>();
  else
    launch.template operator()<32>();
  MF_CUDA_LAUNCHED("router_topk_forward");
}

void router_topk_backward(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& topk_idx_TK,
                          const TopkRouting& routing, const Tensor& dprob_TK, const Tensor& dlogits_TE) {
  check_cuda_dtype(scores_TE, DType::f32, "router_topk_backward scores");
  check_cuda_tensor(topk_idx_TK, "router_topk_backward topk_idx");
  check_cuda_dtype(dprob_TK, DType::f32, "router_topk_backward dprob");
  check_cuda_dtype(dlogits_TE, DType::f32, "router_topk_backward dlogits");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), k_n = topk_idx_TK.size(1);
  MF_CHECK(k_n <= 32 && e_n <= std::numeric_limits<int>::max(), "router_topk_backward (CUDA: K <= 32): scores ",
           scores_TE.str(), ", topk_idx ", topk_idx_TK.str());
  if (t_n == 0) return;
  router_topk_backward_kernel<<<blocks_for(t_n, kTokenWarps), kTokenWarps * kWarp, 0, stream_of(ctx)>>>(
      scores_TE.ptr<float>(), topk_idx_TK.ptr<int32_t>(), dprob_TK.ptr<float>(), t_n, static_cast<int>(e_n),
      static_cast<int>(k_n), routing.score_func == ScoreFunc::softmax, routing.norm_topk_prob, routing.scaling,
      dlogits_TE.ptr<float>());
  MF_CUDA_LAUNCHED("router_topk_backward");
}

}  // namespace moefold::cuda
