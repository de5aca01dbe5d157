// CUDA softmax cross-entropy over the vocabulary (ops/ops.h, contracts in cross_entropy.h): one
// block per row, an online (running max, rescaled sum-exp) pass over the logits in float32, lse_N
// saved in f32; the row losses are summed in float64 in a fixed order. Also the phases of the
// vocabulary-parallel form (parallel/vocab_parallel.cpp all-reduces between them): row max, row
// sums of exp and the owned target logit, finish, and the shard backward. Gradient rule: dlogits
// = grad_scale * (softmax - onehot(target)), WRITTEN; ignored rows (kIgnoreTarget) get zeros.
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/cross_entropy.h"
#include "moefold/ops/ops.h"

namespace moefold::cuda {

namespace {

constexpr int kThreads = 512;      // per row: V = 152k gives each thread ~300 logits
constexpr int kSumThreads = 1024;  // the one block that adds the row losses

// A running softmax denominator: s = sum_j exp(x_j - m) over the logits seen, m their max.
struct MaxSum {
  float m;
  float s;
};

// Merges two partial (m, s); symmetric in its arguments, so every order of a butterfly gives
// every lane the same bits. Empty partials have m = -inf, s = 0.
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ MaxSum warp_combine(MaxSum v) {
  for (int o = 16; o > 0; o /= 2) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = combine(v, other);
  }
  return v;
}

// 16-byte packs of logits (8 bf16 or 4 f32): loads wide enough to keep HBM busy.
template <class T>
inline constexpr int kPack = 16 / static_cast<int>(sizeof(T));

template <class T>
__device__ __forceinline__ void load_pack(const T* p, float (&f)[kPack<T>]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  T e[kPack<T>];
  memcpy(e, &raw, sizeof(raw));
#pragma unroll
  for (int i = 0; i < kPack<T>; ++i) f[i] = to_float(e[i]);
}

template <class T>
__device__ __forceinline__ void store_pack(T* p, const float (&f)[kPack<T>]) {
  T e[kPack<T>];
#pragma unroll
  for (int i = 0; i < kPack<T>; ++i) e[i] = from_float<T>(f[i]);
  uint4 raw;
  memcpy(&raw, e, sizeof(raw));
  *reinterpret_cast<uint4*>(p) = raw;
}

// Adds one logit to a running (m, s): -inf adds nothing, NaN propagates into s.
__device__ __forceinline__ void add_logit(MaxSum& acc, float val) {
  if (val > acc.m) {
    acc.s = acc.s * expf(acc.m - val) + 1.0f;  // exp(-inf) = 0 for the first one
    acc.m = val;
  } else if (val != -INFINITY) {
    acc.s += expf(val - acc.m);
  }
}

// Adds a pack: one rescale to the pack's max, then one exp per logit.
template <int kN>
__device__ __forceinline__ void add_pack(MaxSum& acc, const float (&f)[kN]) {
  float pm = f[0];
#pragma unroll
  for (int i = 1; i < kN; ++i) pm = fmaxf(pm, f[i]);
  if (pm > acc.m) {
    acc.s *= expf(acc.m - pm);
    acc.m = pm;
  }
#pragma unroll
  for (int i = 0; i < kN; ++i)
    if (f[i] != -INFINITY) acc.s += expf(f[i] - acc.m);  // f[i] > -inf implies acc.m > -inf
}

// Row `blockIdx.x`: lse and the row loss lse - logit[target] (in double); both 0 when ignored.
// kVec: rows are read in 16-byte packs (V a multiple of the pack, logits 16-byte aligned).
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    ce_forward_kernel(const T* logits, const int32_t* targets, float* lse, double* row_loss, int64_t v) {
  __shared__ MaxSum warp_part[kThreads / 32];
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  if (t == kIgnoreTarget) {
    if (threadIdx.x == 0) {
      lse[row] = 0.0f;
      row_loss[row] = 0.0;
    }
    return;
  }
  if (t < 0 || t >= v) __trap();  // REQUIRES: 0 <= target < V or kIgnoreTarget
  const T* x = logits + row * v;
  MaxSum acc{-INFINITY, 0.0f};
  if constexpr (kVec) {
#pragma unroll 2
    for (int64_t p = threadIdx.x; p < v / kPack<T>; p += kThreads) {
      float f[kPack<T>];
      load_pack(x + p * kPack<T>, f);
      add_pack(acc, f);
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += kThreads) add_logit(acc, to_float(x[j]));
  }
  acc = warp_combine(acc);
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x != 0) return;
  MaxSum total = warp_part[0];
  for (int i = 1; i < kThreads / 32; ++i) total = combine(total, warp_part[i]);
  const double l = static_cast<double>(total.m) + log(static_cast<double>(total.s));
  lse[row] = static_cast<float>(l);
  row_loss[row] = l - static_cast<double>(to_float(x[t]));
}

// out[0] = sum of row_loss[0..n) in a fixed order (one block).
__global__ void __launch_bounds__(kSumThreads) sum_kernel(const double* row_loss, int64_t n, double* out) {
  __shared__ double part[kSumThreads];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += kSumThreads) s += row_loss[i];
  part[threadIdx.x] = s;
  __syncthreads();
  for (int w = kSumThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) out[0] = part[0];
}

// Each element is read and written by the same thread, so dlogits may be logits (in place).
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    ce_backward_kernel(const T* logits, const int32_t* targets, const float* lse, float grad_scale, T* dlogits,
                       int64_t v) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  T* d = dlogits + row * v;
  const T* x = logits + row * v;
  const bool ignored = t == kIgnoreTarget;
  if (!ignored && (t < 0 || t >= v)) __trap();  // REQUIRES: 0 <= target < V or kIgnoreTarget
  const float l = ignored ? 0.0f : lse[row];
  const float gs = ignored ? 0.0f : grad_scale;
  if constexpr (kVec) {
    constexpr int kN = kPack<T>;
#pragma unroll 2
    for (int64_t p = threadIdx.x; p < v / kN; p += kThreads) {
      float f[kN];
      if (ignored) {
#pragma unroll
        for (int i = 0; i < kN; ++i) f[i] = 0.0f;
      } else {
        load_pack(x + p * kN, f);
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          const float prob = expf(f[i] - l);
          f[i] = gs * (p * kN + i == t ? prob - 1.0f : prob);
        }
      }
      store_pack(d + p * kN, f);
    }
  } else {
    for (int64_t j = threadIdx.x; j < v; j += kThreads) {
      if (ignored) {
        d[j] = from_float<T>(0.0f);
      } else {
        const float prob = expf(to_float(x[j]) - l);
        d[j] = from_float<T>(gs * (j == t ? prob - 1.0f : prob));
      }
    }
  }
}

// Whether rows can be read (and written) in 16-byte packs.
template <class T>
bool packed_rows(int64_t v, const void* a, const void* b) {
  return v % kPack<T> == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

void check_ce(const Tensor& logits, const Tensor& targets, const Tensor& lse, const char* what) {
  check_cuda_tensor(logits, what);
  check_cuda_tensor(targets, what);
  check_cuda_tensor(lse, what);
  MF_CHECK(logits.ndim() == 2 && logits.size(1) > 0 && logits.size(0) <= INT32_MAX, what, ": logits ", logits.str());
  check_shape(targets, {logits.size(0)}, what);
  check_shape(lse, {logits.size(0)}, what);
  MF_CHECK(targets.dtype() == DType::i32, what, ": targets ", targets.str(), " must be i32");
  MF_CHECK(lse.dtype() == DType::f32, what, ": lse ", lse.str(), " must be f32");
}

// ---- vocabulary-parallel shards -----------------------------------------------------------------

unsigned rows_grid(int64_t n, const char* what) {
  MF_CHECK(n <= INT32_MAX, what, ": ", n, " rows (one block each)");
  return static_cast<unsigned>(n);
}

// Calls f(j, value) for this thread's share of row x[0, vl), in float; kVec: 16-byte loads.
template <class T, bool kVec, class F>
__device__ __forceinline__ void for_each_in_row(const T* x, int64_t vl, F&& f) {
  if constexpr (kVec) {
    constexpr int kN = kPack<T>;
    for (int64_t p = threadIdx.x; p < vl / kN; p += blockDim.x) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + p * kN);
      T e[kN];
      memcpy(e, &raw, sizeof(raw));
#pragma unroll
      for (int i = 0; i < kN; ++i) f(p * kN + i, to_float(e[i]));
    }
  } else {
    for (int64_t j = threadIdx.x; j < vl; j += blockDim.x) f(j, to_float(x[j]));
  }
}

// Block reductions in a fixed order (deterministic); the result is valid in thread 0 only.
// REQUIRES: blockDim.x a multiple of 32, at most 1024; every thread calls.
__device__ __forceinline__ float block_max(float v) {
  __shared__ float part[32];
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0)
    for (unsigned w = 1; w < blockDim.x / 32; ++w) v = fmaxf(v, part[w]);
  return v;
}

__device__ __forceinline__ double block_sum(double v) {
  __shared__ double part[32];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0)
    for (unsigned w = 1; w < blockDim.x / 32; ++w) v += part[w];
  return v;
}

// row_max[row] = max of the row's logits on this rank (exact: a logit, held in double).
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads) ce_row_max_kernel(const T* logits, int64_t vl, double* row_max) {
  float m = -INFINITY;
  for_each_in_row<T, kVec>(logits + blockIdx.x * vl, vl, [&](int64_t, float x) { m = fmaxf(m, x); });
  m = block_max(m);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

// With the global row max: sums[row] = sum_j exp(x_j - max) over this rank's columns (f32 exps,
// added in f64), sums[n + row] = the target logit where this rank owns the target (else 0), and
// one count into sums[2n] per owned target (ignored rows: sum 1, logit 0, counted where
// count_ignored, i.e. on TP rank 0). The count is an integer in double: atomics add it exactly.
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    ce_row_sums_kernel(const T* logits, const int32_t* targets, const double* row_max, int64_t n, int64_t vl,
                       int64_t vocab_offset, bool count_ignored, double* sums) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  if (t == kIgnoreTarget) {
    if (threadIdx.x == 0) {
      sums[row] = 1.0;
      sums[n + row] = 0.0;
      if (count_ignored) atomicAdd(sums + 2 * n, 1.0);
    }
    return;
  }
  if (t < 0) __trap();  // REQUIRES: 0 <= target < V or kIgnoreTarget (>= V: the found count fails)
  const T* x = logits + row * vl;
  const float m = static_cast<float>(row_max[row]);
  double s = 0;
  for_each_in_row<T, kVec>(x, vl, [&](int64_t, float v) { s += static_cast<double>(expf(v - m)); });
  s = block_sum(s);
  if (threadIdx.x != 0) return;
  sums[row] = s;
  const int64_t local = t - vocab_offset;
  // A one-hot pick: exactly one rank contributes a non-zero, so the all-reduced sum is exact.
  const bool mine = local >= 0 && local < vl;
  sums[n + row] = mine ? static_cast<double>(to_float(x[local])) : 0.0;
  if (mine) atomicAdd(sums + 2 * n, 1.0);
}

// One block: lse[row] = max + log(sum) (0 for ignored rows); out[0] = sum of the row losses
// lse - target logit in a fixed order, out[1] = the found count.
__global__ void __launch_bounds__(kSumThreads)
    ce_finish_kernel(const int32_t* targets, const double* row_max, const double* sums, int64_t n, float* lse,
                     double* out) {
  double loss = 0;
  for (int64_t i = threadIdx.x; i < n; i += kSumThreads) {
    if (targets[i] == kIgnoreTarget) {
      lse[i] = 0.0f;
      continue;
    }
    const double l = row_max[i] + log(sums[i]);
    lse[i] = static_cast<float>(l);
    loss += l - sums[n + i];
  }
  loss = block_sum(loss);
  if (threadIdx.x == 0) {
    out[0] = loss;
    out[1] = sums[2 * n];
  }
}

// dlogits = gs * exp(x - lse), minus gs at an owned target: the CPU's expression, in f32. Each
// element is read and written by the same thread, so dlogits may be logits (in place).
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    ce_shard_backward_kernel(const T* logits, const int32_t* targets, const float* lse, float gs, int64_t vl,
                             int64_t vocab_offset, T* dlogits) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  const bool ignored = t == kIgnoreTarget;
  if (!ignored && t < 0) __trap();  // REQUIRES: 0 <= target < V or kIgnoreTarget
  const T* x = logits + row * vl;
  T* d = dlogits + row * vl;
  if (ignored) {
    for (int64_t j = threadIdx.x; j < vl; j += kThreads) d[j] = from_float<T>(0.0f);
    return;
  }
  const int64_t local = t - vocab_offset;  // outside [0, vl): another rank's target
  const float l = lse[row];
  if constexpr (kVec) {
    constexpr int kN = kPack<T>;
    for (int64_t p = threadIdx.x; p < vl / kN; p += kThreads) {
      const uint4 raw = *reinterpret_cast<const uint4*>(x + p * kN);
      T e[kN];
      memcpy(e, &raw, sizeof(raw));
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        float g = gs * expf(to_float(e[i]) - l);
        if (p * kN + i == local) g -= gs;
        e[i] = from_float<T>(g);
      }
      uint4 out;
      memcpy(&out, e, sizeof(out));
      *reinterpret_cast<uint4*>(d + p * kN) = out;
    }
  } else {
    for (int64_t j = threadIdx.x; j < vl; j += kThreads) {
      float g = gs * expf(to_float(x[j]) - l);
      if (j == local) g -= gs;
      d[j] = from_float<T>(g);
    }
  }
}

}  // namespace

double cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N,
                             const Tensor& lse_N, const Tensor& loss_1) {
  check_ce(logits_NV, targets_N, lse_N, "cross_entropy_forward");
  if (loss_1.defined()) check_cuda_tensor(loss_1, "cross_entropy_forward loss");
  const int64_t n = logits_NV.size(0), v = logits_NV.size(1);
  if (n == 0) {
    if (!loss_1.defined()) return 0.0;
    MF_CUDA_CHECK(cudaMemsetAsync(loss_1.data(), 0, sizeof(double), stream_of(ctx)));
    return std::numeric_limits<double>::quiet_NaN();
  }
  // Row losses then their sum (the last element).
  auto* scratch =
      static_cast<double*>(ctx.scratch(ScratchSlot::cross_entropy, static_cast<size_t>(n + 1) * sizeof(double)));
  dispatch_cuda_float(logits_NV.dtype(), [&]<class T>() {
    auto* kernel = packed_rows<T>(v, logits_NV.data(), logits_NV.data()) ? &ce_forward_kernel<T, true>
                                                                         : &ce_forward_kernel<T, false>;
    kernel<<<static_cast<unsigned>(n), kThreads, 0, stream_of(ctx)>>>(logits_NV.ptr<T>(), targets_N.ptr<int32_t>(),
                                                                      lse_N.ptr<float>(), scratch, v);
  });
  MF_CUDA_LAUNCHED("cross_entropy_forward rows");
  double* sum = loss_1.defined() ? loss_1.ptr<double>() : scratch + n;
  sum_kernel<<<1, kSumThreads, 0, stream_of(ctx)>>>(scratch, n, sum);
  MF_CUDA_LAUNCHED("cross_entropy_forward sum");
  if (loss_1.defined()) return std::numeric_limits<double>::quiet_NaN();
  double loss = 0;
  MF_CUDA_CHECK(cudaMemcpyAsync(&loss, scratch + n, sizeof(double), cudaMemcpyDeviceToHost, stream_of(ctx)));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  return loss;
}

void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N,
                            const Tensor& lse_N, double grad_scale, const Tensor& dlogits_NV) {
  check_ce(logits_NV, targets_N, lse_N, "cross_entropy_backward");
  check_cuda_tensor(dlogits_NV, "cross_entropy_backward dlogits");
  check_shape(dlogits_NV, logits_NV.shape(), "cross_entropy_backward dlogits");
  MF_CHECK(dlogits_NV.dtype() == logits_NV.dtype(), "cross_entropy_backward: dlogits ", dlogits_NV.str(), " vs logits ",
           logits_NV.str());
  const int64_t n = logits_NV.size(0), v = logits_NV.size(1);
  if (n == 0) return;
  dispatch_cuda_float(logits_NV.dtype(), [&]<class T>() {
    auto* kernel = packed_rows<T>(v, logits_NV.data(), dlogits_NV.data()) ? &ce_backward_kernel<T, true>
                                                                          : &ce_backward_kernel<T, false>;
    kernel<<<static_cast<unsigned>(n), kThreads, 0, stream_of(ctx)>>>(
        logits_NV.ptr<T>(), targets_N.ptr<int32_t>(), lse_N.ptr<float>(), static_cast<float>(grad_scale),
        dlogits_NV.ptr<T>(), v);
  });
  MF_CUDA_LAUNCHED("cross_entropy_backward");
}

// ---- vocabulary-parallel shards -----------------------------------------------------------------

void cross_entropy_shard_row_max(const ExecContext& ctx, const Tensor& logits_shard_NVl, const Tensor& row_max_N) {
  const int64_t n = logits_shard_NVl.size(0), vl = logits_shard_NVl.size(1);
  const unsigned grid = rows_grid(n, "cross_entropy_shard_row_max");
  dispatch_cuda_float(logits_shard_NVl.dtype(), [&]<class T>() {
    const bool vec = packed_rows<T>(vl, logits_shard_NVl.data(), logits_shard_NVl.data());
    auto* kernel = vec ? &ce_row_max_kernel<T, true> : &ce_row_max_kernel<T, false>;
    kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(logits_shard_NVl.ptr<T>(), vl, row_max_N.ptr<double>());
    MF_CUDA_LAUNCHED("cross_entropy_shard_row_max");
  });
}

void cross_entropy_shard_sums(const ExecContext& ctx, const Tensor& logits_shard_NVl, const Tensor& targets_N,
                              const Tensor& row_max_N, int64_t vocab_offset, bool count_ignored,
                              const Tensor& sums_2N1) {
  const int64_t n = logits_shard_NVl.size(0), vl = logits_shard_NVl.size(1);
  const unsigned grid = rows_grid(n, "cross_entropy_shard_sums");
  dispatch_cuda_float(logits_shard_NVl.dtype(), [&]<class T>() {
    const bool vec = packed_rows<T>(vl, logits_shard_NVl.data(), logits_shard_NVl.data());
    MF_CUDA_CHECK(cudaMemsetAsync(sums_2N1.ptr<double>() + 2 * n, 0, sizeof(double), stream_of(ctx)));  // the count
    auto* kernel = vec ? &ce_row_sums_kernel<T, true> : &ce_row_sums_kernel<T, false>;
    kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(logits_shard_NVl.ptr<T>(), targets_N.ptr<int32_t>(),
                                                  row_max_N.ptr<double>(), n, vl, vocab_offset, count_ignored,
                                                  sums_2N1.ptr<double>());
    MF_CUDA_LAUNCHED("cross_entropy_shard_sums");
  });
}

CrossEntropyShardTotals cross_entropy_shard_finish(const ExecContext& ctx, const Tensor& targets_N,
                                                   const Tensor& row_max_N, const Tensor& sums_2N1, const Tensor& lse_N,
                                                   const Tensor& result_2) {
  const int64_t n = targets_N.size(0);
  double* const out = result_2.ptr<double>();
  ce_finish_kernel<<<1, kSumThreads, 0, stream_of(ctx)>>>(targets_N.ptr<int32_t>(), row_max_N.ptr<double>(),
                                                          sums_2N1.ptr<double>(), n, lse_N.ptr<float>(), out);
  MF_CUDA_LAUNCHED("cross_entropy_shard_finish");
  double host[2] = {0, 0};
  MF_CUDA_CHECK(cudaMemcpyAsync(host, out, sizeof(host), cudaMemcpyDeviceToHost, stream_of(ctx)));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  return {host[0], host[1]};
}

void cross_entropy_shard_backward(const ExecContext& ctx, const Tensor& logits_shard_NVl, int64_t vocab_offset,
                                  const Tensor& targets_N, const Tensor& lse_N, double grad_scale,
                                  const Tensor& dlogits_shard_NVl) {
  const char* what = "cross_entropy_shard_backward";
  const int64_t n = logits_shard_NVl.size(0), vl = logits_shard_NVl.size(1);
  if (n == 0) return;
  const unsigned grid = rows_grid(n, what);
  dispatch_cuda_float(logits_shard_NVl.dtype(), [&]<class T>() {
    auto* kernel = packed_rows<T>(vl, logits_shard_NVl.data(), dlogits_shard_NVl.data())
                       ? &ce_shard_backward_kernel<T, true>
                       : &ce_shard_backward_kernel<T, false>;
    kernel<<<grid, kThreads, 0, stream_of(ctx)>>>(logits_shard_NVl.ptr<T>(), targets_N.ptr<int32_t>(),
                                                  lse_N.ptr<float>(), static_cast<float>(grad_scale), vl, vocab_offset,
                                                  dlogits_shard_NVl.ptr<T>());
  });
  MF_CUDA_LAUNCHED(what);
}

}  // namespace moefold::cuda
