// CUDA MoE ops (ops/moe_ops.h, contracts in moe_ops_cuda.h): router top-k, expert counts, the
// load-balancing and z losses, the permutation plan, permute and combine, forward and backward.
// Gradient rule: activation gradients (dlogits, drows, dx, dout, dprob) are written.
#include "moefold/ops/cuda/common.cuh"
// (common.cuh first: it declares dtype_of<__nv_bfloat16>.)
#include <algorithm>
#include <cstdio>
#include <limits>
#include <vector>

#include "moefold/ops/cuda/moe_ops_cuda.h"

namespace moefold::cuda {

namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarp = 32;
constexpr size_t kSharedBudget = 48 * 1024;  // dynamic shared memory without an opt-in

// A violated REQUIRES that only the kernel can see: print it and stop the kernel (the next CUDA
// call reports the failure). Used for indices the host could check only by waiting.
#define MF_DEVICE_REQUIRE(cond, fmt, ...)                                    \
  do {                                                                       \
    if (!(cond)) {                                                           \
      printf("moefold: CUDA kernel %s: " fmt "\n", __func__, ##__VA_ARGS__); \
      __trap();                                                              \
    }                                                                        \
  } while (0)

int blocks_for(int64_t items, int64_t per_block) {
  return static_cast<int>(std::min<int64_t>(ceil_div(items, per_block), std::numeric_limits<int32_t>::max()));
}

void check_dtype(const Tensor& t, DType want, const char* what) {
  MF_CHECK(t.dtype() == want, what, ": ", t.str(), ", expected ", dtype_name(want));
}

void check_2d(const Tensor& t, DType want, const char* what) {
  check_cuda_tensor(t, what);
  MF_CHECK(t.ndim() == 2, what, ": ", t.str(), " must be 2-d");
  check_dtype(t, want, what);
}

// ---- warp helpers (every lane returns the same value: xor butterflies add commutatively) ------

template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

// ---- router scores and top-k -------------------------------------------------------------------

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
void launch_router_topk_forward(const ExecContext& ctx, const float* logits, const float* bias, int64_t t_n, int e_n, int k_n, bool softmax,
                                int n_group, int topk_group, bool norm, float scaling, float* scores, int32_t* idx,
                                float* prob) {
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

// ---- expert counts -----------------------------------------------------------------------------

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

// Per-token value (weighted_prob_row for the aux losses, lse^2 for the z-loss) summed over the
// tokens of each block in a fixed order: partial[block].
template <int kKind>  // 0: aux (scores, counts), 1: z-loss (logits)
__global__ void row_loss_kernel(const float* x, int64_t t_n, int e_n, bool softmax, const int64_t* counts,
                                int64_t row_offset, int64_t local_seq_len, double* partial) {
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
}

// Sum over tokens of the per-token value, on the host (waits for the GPU).
template <int kKind>
double row_loss_sum(const ExecContext& ctx, const float* x, int64_t t_n, int e_n, bool softmax, const int64_t* counts, int64_t row_offset,
                    int64_t local_seq_len, const char* what) {
  const int blocks = std::min(blocks_for(t_n, kLossWarps), kLossMaxBlocks);
  auto* partial = static_cast<double*>(ctx.scratch(ScratchSlot::router_loss, blocks * sizeof(double)));
  row_loss_kernel<kKind>
      <<<blocks, kLossWarps * kWarp, 0, stream_of(ctx)>>>(x, t_n, e_n, softmax, counts, row_offset, local_seq_len, partial);
  MF_CUDA_LAUNCHED(what);
  double host[kLossMaxBlocks];
  MF_CUDA_CHECK(cudaMemcpyAsync(host, partial, blocks * sizeof(double), cudaMemcpyDeviceToHost, stream_of(ctx)));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  double total = 0;
  for (int i = 0; i < blocks; ++i) total += host[i];
  return total;
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

// ---- permutation plan --------------------------------------------------------------------------
// Assignments a = t*K + k are cut into tiles of kPlanTile, one warp per tile. (1) Each tile counts
// its assignments per expert; (2) per expert, an exclusive scan over the tiles turns the counts
// into each tile's first position within the expert; (3) one block lays the experts out (their
// assignment and row offsets); (4) each tile gives its assignments their positions in token order
// (a match_any rank within each 32-chunk); (5) with a capacity, one block per expert selects the
// kept assignments (radix select of the capacity-th largest (prob, -a) key) and lays out rows and
// padding. Integer arithmetic only: the plan is bit-identical to the CPU's.

constexpr int kPlanTile = 512;
constexpr int kPlanWarps = 4;
constexpr int kPlanThreads = 256;

// Values the plan returns to the host (set to all ones before the plan).
enum PlanInfo : int {
  kRows = 0,   // R
  kBadIndex,   // the first assignment whose expert index is outside [0, E)
  kDuplicate,  // the first assignment whose expert an earlier k of its token chose
  kNumPlanInfo,
};
constexpr unsigned long long kNoAssignment = ~0ull;

__global__ void plan_tile_counts_kernel(const int32_t* idx, int64_t a_n, int k_n, int e_n, int64_t num_tiles,
                                        int* tile_base, unsigned long long* info) {
  extern __shared__ int plan_cnt[];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kPlanWarps + warp;
  if (tile >= num_tiles) return;
  int* cnt = plan_cnt + warp * e_n;
  for (int e = lane; e < e_n; e += kWarp) cnt[e] = 0;
  __syncwarp();
  const int64_t end = std::min<int64_t>(a_n, (tile + 1) * kPlanTile);
  for (int64_t a = tile * kPlanTile + lane; a < end; a += kWarp) {
    const int e = idx[a];
    if (e < 0 || e >= e_n) {
      atomicMin(&info[kBadIndex], static_cast<unsigned long long>(a));
      continue;
    }
    atomicAdd(&cnt[e], 1);
    const int64_t first = a - a % k_n;
    for (int64_t b = first; b < a; ++b)
      if (idx[b] == e) atomicMin(&info[kDuplicate], static_cast<unsigned long long>(a));
  }
  __syncwarp();
  for (int e = lane; e < e_n; e += kWarp) tile_base[tile * e_n + e] = cnt[e];
}

// One thread per expert: the tiles' counts become their first position within the expert.
__global__ void plan_expert_scan_kernel(int* tile_base, int64_t num_tiles, int e_n, int64_t* n_assign) {
  const int e = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= e_n) return;
  int64_t running = 0;
  for (int64_t tile = 0; tile < num_tiles; ++tile) {
    const int v = tile_base[tile * e_n + e];
    tile_base[tile * e_n + e] = static_cast<int>(running);
    running += v;
  }
  n_assign[e] = running;
}

// Exclusive scan over the block (blockDim.x a multiple of 32); *total = the block's sum.
__device__ int64_t block_exclusive_scan(int64_t v, int64_t* total) {
  __shared__ int64_t warp_sums[32];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int n_warps = static_cast<int>(blockDim.x) / kWarp;
  int64_t x = v;
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const int64_t y = __shfl_up_sync(kFullMask, x, off);
    if (lane >= off) x += y;
  }
  if (lane == kWarp - 1) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < n_warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < kWarp; off <<= 1) {
      const int64_t y = __shfl_up_sync(kFullMask, w, off);
      if (lane >= off) w += y;
    }
    if (lane < n_warps) warp_sums[lane] = w;
  }
  __syncthreads();
  const int64_t prefix = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[n_warps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return prefix;
}

// One block: rows per expert (dropless: all; capacity: at most `capacity`; pad: exactly
// `capacity`), the assignment offsets, the row offsets, counts_E, offsets_E1 and R.
__global__ void plan_offsets_kernel(const int64_t* n_assign, int e_n, int64_t capacity, bool pad, int64_t* assign_off,
                                    int64_t* counts, int64_t* offsets, unsigned long long* info) {
  int64_t carry_a = 0, carry_r = 0;
  for (int e0 = 0; e0 < e_n; e0 += static_cast<int>(blockDim.x)) {
    const int e = e0 + static_cast<int>(threadIdx.x);
    const int64_t n = e < e_n ? n_assign[e] : 0;
    const int64_t rows = e >= e_n ? 0 : capacity <= 0 ? n : pad ? capacity : std::min(n, capacity);
    int64_t total_a, total_r;
    const int64_t pa = block_exclusive_scan(n, &total_a);
    const int64_t pr = block_exclusive_scan(rows, &total_r);
    if (e < e_n) {
      assign_off[e] = carry_a + pa;
      offsets[e] = carry_r + pr;
      counts[e] = rows;
    }
    carry_a += total_a;
    carry_r += total_r;
  }
  if (threadIdx.x == 0) {
    offsets[e_n] = carry_r;
    info[kRows] = static_cast<unsigned long long>(carry_r);
  }
}

// Positions in token order within each expert (see above). Dropless: the rows themselves;
// with a capacity: the assignment ids grouped by expert, for plan_capacity_kernel.
__global__ void plan_scatter_kernel(const int32_t* idx, int64_t a_n, int k_n, int e_n, int64_t num_tiles,
                                    const int* tile_base, const int64_t* assign_off, const int64_t* offsets,
                                    int64_t max_rows, bool dropless, int64_t* row, int64_t* token, int* grouped) {
  extern __shared__ int plan_cnt[];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kPlanWarps + warp;
  if (tile >= num_tiles) return;
  int* cnt = plan_cnt + warp * e_n;
  for (int e = lane; e < e_n; e += kWarp) cnt[e] = tile_base[tile * e_n + e];
  __syncwarp();
  const int64_t begin = tile * kPlanTile, end = std::min<int64_t>(a_n, begin + kPlanTile);
  for (int64_t a0 = begin; a0 < end; a0 += kWarp) {  // every lane runs every chunk (match_any)
    const int64_t a = a0 + lane;
    int e = a < end ? idx[a] : -1;
    if (e >= e_n) e = -1;
    const unsigned peers = __match_any_sync(kFullMask, e);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    const int pos = e >= 0 ? cnt[e] + rank : 0;
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) cnt[e] += __popc(peers);
    __syncwarp();
    if (a >= end) continue;
    if (dropless) {
      const int64_t r = e >= 0 ? offsets[e] + pos : -1;
      row[a] = r;
      if (r >= 0 && r < max_rows) token[r] = a / k_n;
    } else if (e >= 0) {
      grouped[assign_off[e] + pos] = static_cast<int>(a);
    }
  }
}

// Larger key = kept first: the higher probability, then the lower assignment (token) index.
// -0 and +0 compare equal on the CPU, so both map to the key of +0.
__device__ __forceinline__ uint64_t plan_key(int a, const float* prob) {
  float p = prob[a];
  if (p == 0.f) p = 0.f;
  uint32_t u = __float_as_uint(p);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(a));
}

// One block per expert: keep the `capacity` largest keys (a radix select of the capacity-th
// largest, 8 bits at a time: the keys are distinct), in token order, then the padding rows.
__global__ void plan_capacity_kernel(const int* grouped, const float* prob, const int64_t* n_assign,
                                     const int64_t* assign_off, const int64_t* offsets, const int64_t* counts,
                                     int64_t capacity, int k_n, int64_t max_rows, int64_t* row, int64_t* token) {
  __shared__ unsigned hist[256];
  __shared__ unsigned sel_digit, sel_need;
  const int e = static_cast<int>(blockIdx.x);
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t n = n_assign[e], r0 = offsets[e], rows = counts[e];
  const int* seg = grouped + assign_off[e];
  const bool drops = n > capacity;
  uint64_t threshold = 0;
  if (drops) {
    uint64_t prefix = 0, mask = 0;
    unsigned need = static_cast<unsigned>(capacity);
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int i = static_cast<int>(threadIdx.x); i < 256; i += static_cast<int>(blockDim.x)) hist[i] = 0;
      __syncthreads();
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const uint64_t key = plan_key(seg[i], prob);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      if (warp == 0) {
        // Lane l covers the digits 255 - 8l down to 248 - 8l; exactly one lane holds the need-th.
        unsigned local = 0;
        for (int q = 0; q < 8; ++q) local += hist[255 - 8 * lane - q];
        unsigned incl = local;
#pragma unroll
        for (int off = 1; off < kWarp; off <<= 1) {
          const unsigned y = __shfl_up_sync(kFullMask, incl, off);
          if (lane >= off) incl += y;
        }
        unsigned cum = incl - local;
        if (cum < need && need <= incl) {
          for (int q = 0; q < 8; ++q) {
            const int d = 255 - 8 * lane - q;
            if (cum + hist[d] >= need) {
              sel_digit = static_cast<unsigned>(d);
              sel_need = need - cum;
              break;
            }
            cum += hist[d];
          }
        }
      }
      __syncthreads();
      prefix |= static_cast<uint64_t>(sel_digit) << shift;
      mask |= 0xffull << shift;
      need = sel_need;
    }
    threshold = prefix;
  }
  int64_t carry = 0;
  for (int64_t i0 = 0; i0 < n; i0 += blockDim.x) {  // block-uniform trip count (block scans inside)
    const int64_t i = i0 + threadIdx.x;
    const int a = i < n ? seg[i] : 0;
    const bool keep = i < n && (!drops || plan_key(a, prob) >= threshold);
    int64_t total;
    const int64_t rank = carry + block_exclusive_scan(keep ? 1 : 0, &total);
    carry += total;
    if (i >= n) continue;
    if (keep) {
      const int64_t r = r0 + rank;
      row[a] = r;
      if (r < max_rows) token[r] = a / k_n;
    } else {
      row[a] = -1;
    }
  }
  for (int64_t i = carry + threadIdx.x; i < rows; i += blockDim.x)
    if (r0 + i < max_rows) token[r0 + i] = -1;
}

// ---- permute and combine -----------------------------------------------------------------------
// One block per row (permute) or token (the others), VEC elements per thread access: 16 bytes
// when the row length and the pointers allow it. Sums over k run in k order, in f32.

template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <class T, int VEC>
__global__ void permute_kernel(const T* x, const int64_t* token, int64_t r_n, int64_t t_n, int64_t h_n, T* rows) {
  using P = Pack<T, VEC>;
  const int64_t nv = h_n / VEC;
  for (int64_t r = blockIdx.x; r < r_n; r += gridDim.x) {
    const int64_t t = token[r];
    MF_DEVICE_REQUIRE(t >= -1 && t < t_n, "row %lld reads token %lld of %lld", static_cast<long long>(r),
                      static_cast<long long>(t), static_cast<long long>(t_n));
    P* dst = reinterpret_cast<P*>(rows + r * h_n);
    if (t < 0) {
      P z;
#pragma unroll
      for (int q = 0; q < VEC; ++q) z.v[q] = from_float<T>(0.f);
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) dst[v] = z;
    } else {
      const P* src = reinterpret_cast<const P*>(x + t * h_n);
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) dst[v] = src[v];
    }
  }
}

// y_t = sum_k w_tk * in[row_tk] over kept rows (w = prob, or 1 when prob is null).
template <class T, int VEC>
__global__ void gather_sum_kernel(const T* in, const int64_t* row, const float* prob, int64_t t_n, int k_n, int64_t r_n,
                                  int64_t h_n, T* y) {
  using P = Pack<T, VEC>;
  const int64_t nv = h_n / VEC;
  for (int64_t t = blockIdx.x; t < t_n; t += gridDim.x) {
    const int64_t* rt = row + t * k_n;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      float acc[VEC];
#pragma unroll
      for (int q = 0; q < VEC; ++q) acc[q] = 0.f;
      for (int k = 0; k < k_n; ++k) {
        const int64_t r = rt[k];
        if (r < 0) continue;
        MF_DEVICE_REQUIRE(r < r_n, "token %lld reads row %lld of %lld", static_cast<long long>(t),
                          static_cast<long long>(r), static_cast<long long>(r_n));
        const float w = prob ? prob[t * k_n + k] : 1.f;
        const P p = reinterpret_cast<const P*>(in + r * h_n)[v];
#pragma unroll
        for (int q = 0; q < VEC; ++q) acc[q] += w * to_float(p.v[q]);
      }
      P out;
#pragma unroll
      for (int q = 0; q < VEC; ++q) out.v[q] = from_float<T>(acc[q]);
      reinterpret_cast<P*>(y + t * h_n)[v] = out;
    }
  }
}

constexpr int kCombineChunk = 8;  // k handled per pass (register accumulators)

// dout[row_tk] = prob_tk * dy_t and dprob_tk = <dy_t, out[row_tk]> (0 when dropped); dout's
// other rows were zeroed before. dy_t is read once per chunk of kCombineChunk k.
template <class T, int VEC>
__global__ void combine_backward_kernel(const T* out, const int64_t* row, const float* prob, const T* dy, int64_t t_n,
                                        int k_n, int64_t r_n, int64_t h_n, T* dout, float* dprob) {
  using P = Pack<T, VEC>;
  __shared__ float partial[32][kCombineChunk];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int n_warps = static_cast<int>(blockDim.x) / kWarp;
  const int64_t nv = h_n / VEC;
  for (int64_t t = blockIdx.x; t < t_n; t += gridDim.x) {
    for (int k0 = 0; k0 < k_n; k0 += kCombineChunk) {
      int64_t r[kCombineChunk];
      float p[kCombineChunk], dot[kCombineChunk];
#pragma unroll
      for (int q = 0; q < kCombineChunk; ++q) {
        const int k = k0 + q;
        r[q] = k < k_n ? row[t * k_n + k] : -1;
        MF_DEVICE_REQUIRE(r[q] < r_n, "token %lld reads row %lld of %lld", static_cast<long long>(t),
                          static_cast<long long>(r[q]), static_cast<long long>(r_n));
        p[q] = r[q] >= 0 ? prob[t * k_n + k] : 0.f;
        dot[q] = 0.f;
      }
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
        const P g = reinterpret_cast<const P*>(dy + t * h_n)[v];
        float gf[VEC];
#pragma unroll
        for (int q = 0; q < VEC; ++q) gf[q] = to_float(g.v[q]);
#pragma unroll
        for (int q = 0; q < kCombineChunk; ++q) {
          if (r[q] < 0) continue;
          const P o = reinterpret_cast<const P*>(out + r[q] * h_n)[v];
          P d;
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            dot[q] += gf[i] * to_float(o.v[i]);
            d.v[i] = from_float<T>(p[q] * gf[i]);
          }
          reinterpret_cast<P*>(dout + r[q] * h_n)[v] = d;
        }
      }
#pragma unroll
      for (int q = 0; q < kCombineChunk; ++q) {
        const float s = warp_sum(dot[q]);
        if (lane == 0) partial[warp][q] = s;
      }
      __syncthreads();
      if (threadIdx.x < kCombineChunk && k0 + static_cast<int>(threadIdx.x) < k_n) {
        float s = 0.f;
        for (int w = 0; w < n_warps; ++w) s += partial[w][threadIdx.x];
        dprob[t * k_n + k0 + threadIdx.x] = s;  // a dropped k summed no terms: 0
      }
      __syncthreads();  // partial is reused by the next chunk
    }
  }
}

// The widest access (elements, a power of two, 16 bytes at most) that divides h_n and keeps every
// row of every pointer aligned.
template <class T>
int vec_width(int64_t h_n, std::initializer_list<const void*> ptrs) {
  int vec = static_cast<int>(16 / sizeof(T));
  auto fits = [&](int v) {
    if (h_n % v != 0) return false;
    for (const void* p : ptrs)
      if (reinterpret_cast<uintptr_t>(p) % (static_cast<uintptr_t>(v) * sizeof(T)) != 0) return false;
    return true;
  };
  while (vec > 1 && !fits(vec)) vec /= 2;
  return vec;
}

// Calls f.template operator()<VEC>() for vec in {1, 2, 4, 8} (8 only for 2-byte types).
template <class T, class F>
void dispatch_vec(int vec, F&& f) {
  if (vec == 1) {
    f.template operator()<1>();
  } else if (vec == 2) {
    f.template operator()<2>();
  } else if (vec == 4) {
    f.template operator()<4>();
  } else {
    MF_CHECK(vec == 8 && sizeof(T) <= 2, "vector width ", vec);
    if constexpr (sizeof(T) <= 2) f.template operator()<8>();
  }
}

int row_threads(int64_t n_vec) {
  return static_cast<int>(std::clamp<int64_t>(ceil_div(n_vec, kWarp) * kWarp, 32, 256));
}

constexpr int64_t kMaxRowBlocks = 1 << 20;

void check_rows(const Tensor& rows_RH, const Tensor& x_TH, const char* what) {
  check_cuda_tensor(rows_RH, what);
  check_cuda_tensor(x_TH, what);
  MF_CHECK(
      rows_RH.ndim() == 2 && x_TH.ndim() == 2 && rows_RH.dtype() == x_TH.dtype() && rows_RH.size(1) == x_TH.size(1),
      what, ": rows ", rows_RH.str(), ", tokens ", x_TH.str());
}

void check_row_map(const Tensor& row_TK, int64_t t_n, const char* what) {
  check_2d(row_TK, DType::i64, what);
  MF_CHECK(row_TK.size(0) == t_n, what, ": ", row_TK.str(), " for ", t_n, " tokens");
}

// counts: [E] (aux_loss, counts_ndim 1) or [B, E] (seq_aux_loss, counts_ndim 2).
void check_aux(const Tensor& scores_TE, const Tensor& counts, int counts_ndim, int64_t k, const char* what) {
  check_2d(scores_TE, DType::f32, what);
  check_cuda_tensor(counts, what);
  check_dtype(counts, DType::i64, what);
  MF_CHECK(counts.ndim() == counts_ndim && counts.size(counts_ndim - 1) == scores_TE.size(1) && k >= 1 &&
               scores_TE.size(1) <= std::numeric_limits<int>::max(),
           what, ": scores ", scores_TE.str(), ", counts ", counts.str(), ", k ", k);
}

void check_seq_layout(const SeqLayout& layout, int64_t t_n, int64_t b_n, const char* what) {
  MF_CHECK(layout.local_seq_len >= 1 && layout.seq_len >= layout.local_seq_len && layout.row_offset >= 0 &&
               (t_n == 0 || (layout.row_offset + t_n - 1) / layout.local_seq_len < b_n),
           what, ": ", t_n, " rows from row ", layout.row_offset, " in ", b_n, " sequences of ", layout.local_seq_len,
           " local tokens (", layout.seq_len, " in all)");
}

constexpr int kTokenWarps = 8;  // warps per block of the one-warp-per-token kernels

}  // namespace

// ---- router scores and top-k -------------------------------------------------------------------

void router_topk_forward(const ExecContext& ctx, const Tensor& logits_TE, const TopkRouting& routing, const Tensor& scores_TE,
                         const Tensor& topk_idx_TK, const Tensor& topk_prob_TK) {
  check_2d(logits_TE, DType::f32, "router_topk_forward logits");
  check_2d(scores_TE, DType::f32, "router_topk_forward scores");
  check_2d(topk_idx_TK, DType::i32, "router_topk_forward topk_idx");
  check_2d(topk_prob_TK, DType::f32, "router_topk_forward topk_prob");
  check_shape(scores_TE, logits_TE.shape(), "router_topk_forward scores");
  check_shape(topk_prob_TK, topk_idx_TK.shape(), "router_topk_forward topk_prob");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1), k_n = topk_idx_TK.size(1);
  const int64_t n_group = routing.n_group, topk_group = routing.topk_group;
  MF_CHECK(topk_idx_TK.size(0) == t_n && k_n >= 1 && k_n <= 32 && e_n <= 1024,
           "router_topk_forward (CUDA: E <= 1024, K <= 32): logits ", logits_TE.str(), ", topk_idx ",
           topk_idx_TK.str());
  MF_CHECK(n_group >= 1 && e_n % n_group == 0 && topk_group >= 1 && topk_group <= n_group &&
               k_n <= topk_group * (e_n / n_group),
           "router_topk_forward: E ", e_n, ", n_group ", n_group, ", topk_group ", topk_group, ", K ", k_n);
  const Tensor& bias = routing.bias_E;
  if (bias.defined()) {
    check_cuda_tensor(bias, "router_topk_forward bias");
    MF_CHECK(bias.ndim() == 1 && bias.size(0) == e_n && bias.dtype() == DType::f32,
             "router_topk_forward bias (CUDA: f32): ", bias.str(), " for logits ", logits_TE.str());
  }
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

void router_topk_backward(const ExecContext& ctx, const Tensor& scores_TE, const Tensor& topk_idx_TK, const TopkRouting& routing,
                          const Tensor& dprob_TK, const Tensor& dlogits_TE) {
  check_2d(scores_TE, DType::f32, "router_topk_backward scores");
  check_2d(topk_idx_TK, DType::i32, "router_topk_backward topk_idx");
  check_2d(dprob_TK, DType::f32, "router_topk_backward dprob");
  check_2d(dlogits_TE, DType::f32, "router_topk_backward dlogits");
  check_shape(dprob_TK, topk_idx_TK.shape(), "router_topk_backward dprob");
  check_shape(dlogits_TE, scores_TE.shape(), "router_topk_backward dlogits");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), k_n = topk_idx_TK.size(1);
  MF_CHECK(topk_idx_TK.size(0) == t_n && k_n >= 1 && k_n <= 32 && k_n <= e_n && e_n <= std::numeric_limits<int>::max(),
           "router_topk_backward (CUDA: K <= 32): scores ", scores_TE.str(), ", topk_idx ", topk_idx_TK.str());
  if (t_n == 0) return;
  router_topk_backward_kernel<<<blocks_for(t_n, kTokenWarps), kTokenWarps * kWarp, 0, stream_of(ctx)>>>(
      scores_TE.ptr<float>(), topk_idx_TK.ptr<int32_t>(), dprob_TK.ptr<float>(), t_n, static_cast<int>(e_n),
      static_cast<int>(k_n), routing.score_func == ScoreFunc::softmax, routing.norm_topk_prob, routing.scaling,
      dlogits_TE.ptr<float>());
  MF_CUDA_LAUNCHED("router_topk_backward");
}

void topk_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& counts_E) {
  check_2d(topk_idx_TK, DType::i32, "topk_expert_counts topk_idx");
  check_cuda_tensor(counts_E, "topk_expert_counts counts");
  check_dtype(counts_E, DType::i64, "topk_expert_counts counts");
  MF_CHECK(counts_E.ndim() == 1 && counts_E.size(0) <= std::numeric_limits<int>::max(),
           "topk_expert_counts counts: ", counts_E.str());
  launch_counts(ctx, topk_idx_TK.ptr<int32_t>(), topk_idx_TK.numel(), static_cast<int>(counts_E.size(0)),
                counts_E.ptr<int64_t>());
}

void seq_expert_counts(const ExecContext& ctx, const Tensor& topk_idx_TK, const SeqLayout& layout, const Tensor& counts_BE) {
  check_2d(topk_idx_TK, DType::i32, "seq_expert_counts topk_idx");
  check_2d(counts_BE, DType::i64, "seq_expert_counts counts");
  const int64_t t_n = topk_idx_TK.size(0), k_n = topk_idx_TK.size(1), e_n = counts_BE.size(1);
  MF_CHECK(e_n <= std::numeric_limits<int>::max() && k_n >= 1, "seq_expert_counts: ", topk_idx_TK.str(), ", ",
           counts_BE.str());
  check_seq_layout(layout, t_n, counts_BE.size(0), "seq_expert_counts");
  MF_CUDA_CHECK(cudaMemsetAsync(counts_BE.data(), 0, counts_BE.nbytes(), stream_of(ctx)));
  const int64_t n = topk_idx_TK.numel();
  if (n == 0) return;
  seq_expert_counts_kernel<<<std::min(blocks_for(n, kCountThreads), 1024), kCountThreads, 0, stream_of(ctx)>>>(
      topk_idx_TK.ptr<int32_t>(), n, static_cast<int>(k_n), static_cast<int>(e_n), layout.row_offset,
      layout.local_seq_len, reinterpret_cast<unsigned long long*>(counts_BE.ptr<int64_t>()));
  MF_CUDA_LAUNCHED("seq_expert_counts");
}

// ---- load-balancing losses ---------------------------------------------------------------------

double aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E, int64_t k,
                        int64_t total_tokens) {
  check_aux(scores_TE, counts_E, 1, k, "aux_loss_forward");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1);
  if (t_n == 0) return 0.0;
  const int64_t t_all = total_tokens > 0 ? total_tokens : t_n;
  const double total =
      row_loss_sum<0>(ctx, scores_TE.ptr<float>(), t_n, static_cast<int>(e_n), score_func == ScoreFunc::softmax,
                      counts_E.ptr<int64_t>(), 0, t_n, "aux_loss_forward");
  return total * static_cast<double>(e_n) / (static_cast<double>(t_all) * static_cast<double>(t_all) * k);
}

void aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_E, int64_t k,
                       double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens) {
  check_aux(scores_TE, counts_E, 1, k, "aux_loss_backward");
  check_2d(dlogits_TE, DType::f32, "aux_loss_backward dlogits");
  check_shape(dlogits_TE, scores_TE.shape(), "aux_loss_backward dlogits");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1);
  if (t_n == 0) return;
  const double t_all = static_cast<double>(total_tokens > 0 ? total_tokens : t_n);
  const double c0 = grad_scale * static_cast<double>(e_n) / (t_all * t_all * static_cast<double>(k));
  weighted_prob_backward_kernel<<<blocks_for(t_n, kTokenWarps), kTokenWarps * kWarp, 0, stream_of(ctx)>>>(
      scores_TE.ptr<float>(), t_n, static_cast<int>(e_n), score_func == ScoreFunc::softmax, counts_E.ptr<int64_t>(), 0,
      t_n, c0, dlogits_TE.ptr<float>());
  MF_CUDA_LAUNCHED("aux_loss_backward");
}

double seq_aux_loss_forward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_BE, int64_t k,
                            const SeqLayout& layout) {
  check_aux(scores_TE, counts_BE, 2, k, "seq_aux_loss_forward");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), b_n = counts_BE.size(0);
  check_seq_layout(layout, t_n, b_n, "seq_aux_loss_forward");
  if (t_n == 0) return 0.0;
  const double total =
      row_loss_sum<0>(ctx, scores_TE.ptr<float>(), t_n, static_cast<int>(e_n), score_func == ScoreFunc::softmax,
                      counts_BE.ptr<int64_t>(), layout.row_offset, layout.local_seq_len, "seq_aux_loss_forward");
  const double s_n = static_cast<double>(layout.seq_len);
  return total * static_cast<double>(e_n) / (static_cast<double>(k) * s_n * s_n * static_cast<double>(b_n));
}

void seq_aux_loss_backward(const ExecContext& ctx, const Tensor& scores_TE, ScoreFunc score_func, const Tensor& counts_BE, int64_t k,
                           const SeqLayout& layout, double grad_scale, const Tensor& dlogits_TE) {
  check_aux(scores_TE, counts_BE, 2, k, "seq_aux_loss_backward");
  check_2d(dlogits_TE, DType::f32, "seq_aux_loss_backward dlogits");
  check_shape(dlogits_TE, scores_TE.shape(), "seq_aux_loss_backward dlogits");
  const int64_t t_n = scores_TE.size(0), e_n = scores_TE.size(1), b_n = counts_BE.size(0);
  check_seq_layout(layout, t_n, b_n, "seq_aux_loss_backward");
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
  check_dtype(counts_E, DType::i64, "expert_bias_update counts");
  MF_CHECK(bias_E.ndim() == 1 && counts_E.ndim() == 1 && counts_E.size(0) == bias_E.size(0) &&
               bias_E.size(0) <= std::numeric_limits<int>::max(),
           "expert_bias_update: bias ", bias_E.str(), ", counts ", counts_E.str());
  const int e_n = static_cast<int>(bias_E.size(0));
  if (e_n == 0) return;
  if (bias_E.dtype() == DType::f64) {
    expert_bias_update_kernel<double>
        <<<1, 1024, 0, stream_of(ctx)>>>(bias_E.ptr<double>(), counts_E.ptr<int64_t>(), e_n, rate);
  } else {
    check_dtype(bias_E, DType::f32, "expert_bias_update bias (CUDA: f32 or f64)");
    expert_bias_update_kernel<float><<<1, 1024, 0, stream_of(ctx)>>>(bias_E.ptr<float>(), counts_E.ptr<int64_t>(), e_n, rate);
  }
  MF_CUDA_LAUNCHED("expert_bias_update");
}

// ---- router z-loss -----------------------------------------------------------------------------

double z_loss_forward(const ExecContext& ctx, const Tensor& logits_TE, int64_t total_tokens) {
  check_2d(logits_TE, DType::f32, "z_loss logits");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1);
  if (t_n == 0) return 0.0;
  const double total =
      row_loss_sum<1>(ctx, logits_TE.ptr<float>(), t_n, static_cast<int>(e_n), true, nullptr, 0, t_n, "z_loss_forward");
  return total / static_cast<double>(total_tokens > 0 ? total_tokens : t_n);
}

void z_loss_backward(const ExecContext& ctx, const Tensor& logits_TE, double grad_scale, const Tensor& dlogits_TE, int64_t total_tokens) {
  check_2d(logits_TE, DType::f32, "z_loss logits");
  check_2d(dlogits_TE, DType::f32, "z_loss_backward dlogits");
  check_shape(dlogits_TE, logits_TE.shape(), "z_loss_backward dlogits");
  const int64_t t_n = logits_TE.size(0), e_n = logits_TE.size(1);
  if (t_n == 0) return;
  const double c = grad_scale * 2.0 / static_cast<double>(total_tokens > 0 ? total_tokens : t_n);
  z_loss_backward_kernel<<<blocks_for(t_n, kTokenWarps), kTokenWarps * kWarp, 0, stream_of(ctx)>>>(
      logits_TE.ptr<float>(), t_n, static_cast<int>(e_n), c, dlogits_TE.ptr<float>());
  MF_CUDA_LAUNCHED("z_loss_backward");
}

// ---- permutation plan --------------------------------------------------------------------------

int64_t moe_permute_plan(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK, int64_t capacity, bool pad,
                         const PermutePlanOut& out) {
  check_2d(topk_idx_TK, DType::i32, "moe_permute_plan topk_idx");
  check_2d(topk_prob_TK, DType::f32, "moe_permute_plan topk_prob (CUDA: f32)");
  check_shape(topk_prob_TK, topk_idx_TK.shape(), "moe_permute_plan topk_prob");
  check_shape(out.row_TK, topk_idx_TK.shape(), "moe_permute_plan row");
  for (const Tensor* t : {&out.counts_E, &out.offsets_E1, &out.row_TK, &out.token_R}) {
    check_cuda_tensor(*t, "moe_permute_plan output");
    check_dtype(*t, DType::i64, "moe_permute_plan output");
  }
  const int64_t e_n = out.counts_E.numel(), t_n = topk_idx_TK.size(0), k_n = topk_idx_TK.size(1);
  const int64_t a_n = t_n * k_n;  // assignments a = t*K + k
  MF_CHECK(out.offsets_E1.numel() == e_n + 1, "offsets ", out.offsets_E1.str(), " for ", e_n, " experts");
  MF_CHECK(!pad || capacity > 0, "padding needs a capacity");
  MF_CHECK(e_n >= 1 && k_n >= 1 && a_n < (int64_t{1} << 31) && e_n * sizeof(int) * kPlanWarps <= kSharedBudget,
           "moe_permute_plan (CUDA: T*K < 2^31, E <= ", kSharedBudget / sizeof(int) / kPlanWarps, "): topk_idx ",
           topk_idx_TK.str(), ", ", e_n, " experts");
  const int64_t max_rows = out.token_R.numel();
  const bool dropless = capacity <= 0;
  const int e = static_cast<int>(e_n), k = static_cast<int>(k_n);
  const int64_t num_tiles = ceil_div(a_n, kPlanTile);

  // Scratch (grow-only): info | n_assign[E] | assign_off[E] | tile_base | grouped.
  const size_t info_bytes = kNumPlanInfo * sizeof(unsigned long long);
  const size_t base_bytes = static_cast<size_t>(num_tiles * e_n) * sizeof(int);
  const size_t grouped_bytes = dropless ? 0 : static_cast<size_t>(a_n) * sizeof(int);
  const size_t bytes = info_bytes + 2 * static_cast<size_t>(e_n) * sizeof(int64_t) + base_bytes + grouped_bytes;
  auto* scratch = static_cast<char*>(ctx.scratch(ScratchSlot::permute_plan, bytes));
  auto* info = reinterpret_cast<unsigned long long*>(scratch);
  auto* n_assign = reinterpret_cast<int64_t*>(scratch + info_bytes);
  int64_t* assign_off = n_assign + e_n;
  auto* tile_base = reinterpret_cast<int*>(assign_off + e_n);
  int* grouped = tile_base + num_tiles * e_n;
  MF_CUDA_CHECK(cudaMemsetAsync(info, 0xff, info_bytes, stream_of(ctx)));

  const int32_t* idx = topk_idx_TK.ptr<int32_t>();
  int64_t* counts = out.counts_E.ptr<int64_t>();
  int64_t* offsets = out.offsets_E1.ptr<int64_t>();
  int64_t* row = out.row_TK.ptr<int64_t>();
  int64_t* token = out.token_R.ptr<int64_t>();
  const size_t tile_shared = static_cast<size_t>(kPlanWarps) * e_n * sizeof(int);
  const int tile_blocks = blocks_for(num_tiles, kPlanWarps);
  if (num_tiles > 0) {
    plan_tile_counts_kernel<<<tile_blocks, kPlanWarps * kWarp, tile_shared, stream_of(ctx)>>>(idx, a_n, k, e, num_tiles,
                                                                                        tile_base, info);
    MF_CUDA_LAUNCHED("moe_permute_plan counts");
  }
  plan_expert_scan_kernel<<<blocks_for(e_n, 128), 128, 0, stream_of(ctx)>>>(tile_base, num_tiles, e, n_assign);
  MF_CUDA_LAUNCHED("moe_permute_plan scan");
  plan_offsets_kernel<<<1, 1024, 0, stream_of(ctx)>>>(n_assign, e, capacity, pad, assign_off, counts, offsets, info);
  MF_CUDA_LAUNCHED("moe_permute_plan offsets");
  if (num_tiles > 0) {
    plan_scatter_kernel<<<tile_blocks, kPlanWarps * kWarp, tile_shared, stream_of(ctx)>>>(
        idx, a_n, k, e, num_tiles, tile_base, assign_off, offsets, max_rows, dropless, row, token, grouped);
    MF_CUDA_LAUNCHED("moe_permute_plan scatter");
  }
  if (!dropless) {
    plan_capacity_kernel<<<e, kPlanThreads, 0, stream_of(ctx)>>>(grouped, topk_prob_TK.ptr<float>(), n_assign, assign_off,
                                                           offsets, counts, capacity, k, max_rows, row, token);
    MF_CUDA_LAUNCHED("moe_permute_plan capacity");
  }
  unsigned long long host[kNumPlanInfo];
  MF_CUDA_CHECK(cudaMemcpyAsync(host, info, info_bytes, cudaMemcpyDeviceToHost, stream_of(ctx)));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  if (host[kBadIndex] != kNoAssignment) {
    // The index itself, for the CPU op's message (one more small copy: this is the failure path).
    const auto a = static_cast<int64_t>(host[kBadIndex]);
    int32_t bad = 0;
    device_copy(&bad, Device::cpu, idx + a, Device::cuda, sizeof(bad), ctx.stream());
    MF_CHECK(false, "expert index ", bad, " out of [0, ", e_n, ")");
  }
  if (host[kDuplicate] != kNoAssignment) {
    const auto a = static_cast<int64_t>(host[kDuplicate]);
    int32_t dup = 0;
    device_copy(&dup, Device::cpu, idx + a, Device::cuda, sizeof(dup), ctx.stream());
    MF_CHECK(false, "token ", a / k_n, " routed twice to expert ", dup);
  }
  const auto num_rows = static_cast<int64_t>(host[kRows]);
  MF_CHECK(num_rows <= max_rows, "permute plan needs more than ", max_rows, " rows");
  return num_rows;
}

// ---- permute and combine -----------------------------------------------------------------------

void moe_permute(const ExecContext& ctx, const Tensor& x_TH, const Tensor& token_R, const Tensor& rows_RH) {
  check_rows(rows_RH, x_TH, "moe_permute");
  check_cuda_tensor(token_R, "moe_permute token");
  check_dtype(token_R, DType::i64, "moe_permute token");
  const int64_t r_n = rows_RH.size(0), h_n = rows_RH.size(1), t_n = x_TH.size(0);
  MF_CHECK(token_R.numel() >= r_n, "moe_permute: token ", token_R.str(), " for ", r_n, " rows");
  if (r_n == 0 || h_n == 0) return;
  dispatch_cuda_float(x_TH.dtype(), [&]<class T>() {
    const T* x = x_TH.ptr<T>();
    T* rows = rows_RH.ptr<T>();
    dispatch_vec<T>(vec_width<T>(h_n, {x, rows}), [&]<int VEC>() {
      permute_kernel<T, VEC><<<static_cast<int>(std::min(r_n, kMaxRowBlocks)), row_threads(h_n / VEC), 0, stream_of(ctx)>>>(
          x, token_R.ptr<int64_t>(), r_n, t_n, h_n, rows);
    });
  });
  MF_CUDA_LAUNCHED("moe_permute");
}

void moe_permute_backward(const ExecContext& ctx, const Tensor& drows_RH, const Tensor& row_TK, const Tensor& dx_TH) {
  check_rows(drows_RH, dx_TH, "moe_permute_backward");
  check_row_map(row_TK, dx_TH.size(0), "moe_permute_backward row");
  const int64_t t_n = dx_TH.size(0), h_n = dx_TH.size(1), k_n = row_TK.size(1), r_n = drows_RH.size(0);
  MF_CHECK(k_n <= std::numeric_limits<int>::max(), "moe_permute_backward: ", row_TK.str());
  if (t_n == 0 || h_n == 0) return;
  dispatch_cuda_float(dx_TH.dtype(), [&]<class T>() {
    const T* drows = drows_RH.ptr<T>();
    T* dx = dx_TH.ptr<T>();
    dispatch_vec<T>(vec_width<T>(h_n, {drows, dx}), [&]<int VEC>() {
      gather_sum_kernel<T, VEC>
          <<<static_cast<int>(std::min(t_n, kMaxRowBlocks)), row_threads(h_n / VEC), 0, stream_of(ctx)>>>(
              drows, row_TK.ptr<int64_t>(), nullptr, t_n, static_cast<int>(k_n), r_n, h_n, dx);
    });
  });
  MF_CUDA_LAUNCHED("moe_permute_backward");
}

// ---- combine -----------------------------------------------------------------------------------

void moe_combine(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK, const Tensor& y_TH) {
  check_rows(out_RH, y_TH, "moe_combine");
  check_row_map(row_TK, y_TH.size(0), "moe_combine row");
  check_2d(prob_TK, DType::f32, "moe_combine prob (CUDA: f32)");
  check_shape(prob_TK, row_TK.shape(), "moe_combine prob");
  const int64_t t_n = y_TH.size(0), h_n = y_TH.size(1), k_n = row_TK.size(1), r_n = out_RH.size(0);
  MF_CHECK(k_n <= std::numeric_limits<int>::max(), "moe_combine: ", row_TK.str());
  if (t_n == 0 || h_n == 0) return;
  dispatch_cuda_float(y_TH.dtype(), [&]<class T>() {
    const T* out = out_RH.ptr<T>();
    T* y = y_TH.ptr<T>();
    dispatch_vec<T>(vec_width<T>(h_n, {out, y}), [&]<int VEC>() {
      gather_sum_kernel<T, VEC>
          <<<static_cast<int>(std::min(t_n, kMaxRowBlocks)), row_threads(h_n / VEC), 0, stream_of(ctx)>>>(
              out, row_TK.ptr<int64_t>(), prob_TK.ptr<float>(), t_n, static_cast<int>(k_n), r_n, h_n, y);
    });
  });
  MF_CUDA_LAUNCHED("moe_combine");
}

void moe_combine_backward(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK, const Tensor& dy_TH,
                          const Tensor& dout_RH, const Tensor& dprob_TK) {
  check_rows(out_RH, dy_TH, "moe_combine_backward");
  check_rows(dout_RH, dy_TH, "moe_combine_backward dout");
  check_row_map(row_TK, dy_TH.size(0), "moe_combine_backward row");
  check_2d(prob_TK, DType::f32, "moe_combine_backward prob (CUDA: f32)");
  check_2d(dprob_TK, DType::f32, "moe_combine_backward dprob (CUDA: f32)");
  check_shape(prob_TK, row_TK.shape(), "moe_combine_backward prob");
  check_shape(dprob_TK, row_TK.shape(), "moe_combine_backward dprob");
  check_shape(dout_RH, out_RH.shape(), "moe_combine_backward dout");
  const int64_t t_n = dy_TH.size(0), h_n = dy_TH.size(1), k_n = row_TK.size(1), r_n = out_RH.size(0);
  MF_CHECK(k_n <= std::numeric_limits<int>::max(), "moe_combine_backward: ", row_TK.str());
  // Padding rows (and rows no kept assignment reads) get no gradient.
  if (dout_RH.nbytes() > 0) MF_CUDA_CHECK(cudaMemsetAsync(dout_RH.data(), 0, dout_RH.nbytes(), stream_of(ctx)));
  if (t_n == 0 || k_n == 0) return;
  dispatch_cuda_float(dy_TH.dtype(), [&]<class T>() {
    const T* out = out_RH.ptr<T>();
    const T* dy = dy_TH.ptr<T>();
    T* dout = dout_RH.ptr<T>();
    dispatch_vec<T>(vec_width<T>(h_n, {out, dy, dout}), [&]<int VEC>() {
      combine_backward_kernel<T, VEC>
          <<<static_cast<int>(std::min(t_n, kMaxRowBlocks)), row_threads(h_n / VEC), 0, stream_of(ctx)>>>(
              out, row_TK.ptr<int64_t>(), prob_TK.ptr<float>(), dy, t_n, static_cast<int>(k_n), r_n, h_n, dout,
              dprob_TK.ptr<float>());
    });
  });
  MF_CUDA_LAUNCHED("moe_combine_backward");
}

}  // namespace moefold::cuda
