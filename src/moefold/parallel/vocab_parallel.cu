// CUDA path of the vocabulary-parallel cross-entropy (vocab_parallel.h), reached from
// vocab_parallel.cpp after its checks; the forward's two all-reduces stay on the device.
// Gradient rule: dlogits WRITTEN. (The embedding's shard kernels are ops/cuda/embedding.cu's.)
// Shape letters: N rows (tokens), C channels, Vl vocabulary entries held by this rank.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/ops.h"
#include "moefold/parallel/vocab_parallel.h"

namespace moefold::cuda {

namespace {

constexpr int kRowThreads = 512;      // per logits row (as ops/cuda/cross_entropy.cu)
constexpr int kFinishThreads = 1024;  // the one block that finishes the rows and sums the losses

// 16-byte packs of a row (8 bf16 or 4 f32).
template <class T>
inline constexpr int kPack = 16 / static_cast<int>(sizeof(T));

// Whether rows of vl elements can be read (and written) in 16-byte packs.
template <class T>
bool packed_rows(int64_t vl, const void* a, const void* b) {
  return vl % kPack<T> == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
}

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

// ---- cross-entropy ------------------------------------------------------------------------------

// row_max[row] = max of the row's logits on this rank (exact: a logit, held in double).
template <class T, bool kVec>
__global__ void __launch_bounds__(kRowThreads) ce_row_max_kernel(const T* logits, int64_t vl, double* row_max) {
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
__global__ void __launch_bounds__(kRowThreads)
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
__global__ void __launch_bounds__(kFinishThreads)
    ce_finish_kernel(const int32_t* targets, const double* row_max, const double* sums, int64_t n, float* lse,
                     double* out) {
  double loss = 0;
  for (int64_t i = threadIdx.x; i < n; i += kFinishThreads) {
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
__global__ void __launch_bounds__(kRowThreads)
    ce_backward_kernel(const T* logits, const int32_t* targets, const float* lse, float gs, int64_t vl,
                       int64_t vocab_offset, T* dlogits) {
  const int64_t row = blockIdx.x;
  const int32_t t = targets[row];
  const bool ignored = t == kIgnoreTarget;
  if (!ignored && t < 0) __trap();  // REQUIRES: 0 <= target < V or kIgnoreTarget
  const T* x = logits + row * vl;
  T* d = dlogits + row * vl;
  if (ignored) {
    for (int64_t j = threadIdx.x; j < vl; j += kRowThreads) d[j] = from_float<T>(0.0f);
    return;
  }
  const int64_t local = t - vocab_offset;  // outside [0, vl): another rank's target
  const float l = lse[row];
  if constexpr (kVec) {
    constexpr int kN = kPack<T>;
    for (int64_t p = threadIdx.x; p < vl / kN; p += kRowThreads) {
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
    for (int64_t j = threadIdx.x; j < vl; j += kRowThreads) {
      float g = gs * expf(to_float(x[j]) - l);
      if (j == local) g -= gs;
      d[j] = from_float<T>(g);
    }
  }
}

}  // namespace

VocabParallelSums vocab_parallel_cross_entropy_forward(const ExecContext& ctx, Communicator& tp, const Tensor& logits_shard_NVl,
                                                       int64_t vocab_offset, const Tensor& targets_N,
                                                       const Tensor& lse_N, const VocabParallelScratch& scratch) {
  const char* what = "vocab_parallel_cross_entropy_forward";
  const int64_t n = logits_shard_NVl.size(0), vl = logits_shard_NVl.size(1);
  const unsigned grid = rows_grid(n, what);
  const Tensor max_n = scratch.max_N.slice(0, n);
  const Tensor sums = scratch.sums_2N1.slice(0, 2 * n + 1);
  double* const out = scratch.result_2.ptr<double>();
  // With one rank an all-reduce is the identity (and the self communicator takes host tensors only).
  const bool reduce = tp.size() > 1;
  dispatch_cuda_float(logits_shard_NVl.dtype(), [&]<class T>() {
    const bool vec = packed_rows<T>(vl, logits_shard_NVl.data(), logits_shard_NVl.data());
    auto* max_kernel = vec ? &ce_row_max_kernel<T, true> : &ce_row_max_kernel<T, false>;
    max_kernel<<<grid, kRowThreads, 0, stream_of(ctx)>>>(logits_shard_NVl.ptr<T>(), vl, max_n.ptr<double>());
    MF_CUDA_LAUNCHED("vocab_parallel_cross_entropy_forward row max");
    if (reduce) tp.all_reduce(max_n, ReduceOp::max);
    MF_CUDA_CHECK(cudaMemsetAsync(sums.ptr<double>() + 2 * n, 0, sizeof(double), stream_of(ctx)));  // the found count
    auto* sums_kernel = vec ? &ce_row_sums_kernel<T, true> : &ce_row_sums_kernel<T, false>;
    sums_kernel<<<grid, kRowThreads, 0, stream_of(ctx)>>>(logits_shard_NVl.ptr<T>(), targets_N.ptr<int32_t>(),
                                                    max_n.ptr<double>(), n, vl, vocab_offset, tp.rank() == 0,
                                                    sums.ptr<double>());
    MF_CUDA_LAUNCHED("vocab_parallel_cross_entropy_forward row sums");
  });
  if (reduce) tp.all_reduce(sums, ReduceOp::sum);
  ce_finish_kernel<<<1, kFinishThreads, 0, stream_of(ctx)>>>(targets_N.ptr<int32_t>(), max_n.ptr<double>(),
                                                       sums.ptr<double>(), n, lse_N.ptr<float>(), out);
  MF_CUDA_LAUNCHED("vocab_parallel_cross_entropy_forward finish");
  double host[2] = {0, 0};
  MF_CUDA_CHECK(cudaMemcpyAsync(host, out, sizeof(host), cudaMemcpyDeviceToHost, stream_of(ctx)));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  return {host[0], host[1]};
}

void vocab_parallel_cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_shard_NVl, int64_t vocab_offset,
                                           const Tensor& targets_N, const Tensor& lse_N, double grad_scale,
                                           const Tensor& dlogits_shard_NVl) {
  const char* what = "vocab_parallel_cross_entropy_backward";
  const int64_t n = logits_shard_NVl.size(0), vl = logits_shard_NVl.size(1);
  if (n == 0) return;
  const unsigned grid = rows_grid(n, what);
  dispatch_cuda_float(logits_shard_NVl.dtype(), [&]<class T>() {
    auto* kernel = packed_rows<T>(vl, logits_shard_NVl.data(), dlogits_shard_NVl.data())
                       ? &ce_backward_kernel<T, true>
                       : &ce_backward_kernel<T, false>;
    kernel<<<grid, kRowThreads, 0, stream_of(ctx)>>>(logits_shard_NVl.ptr<T>(), targets_N.ptr<int32_t>(), lse_N.ptr<float>(),
                                               static_cast<float>(grad_scale), vl, vocab_offset,
                                               dlogits_shard_NVl.ptr<T>());
  });
  MF_CUDA_LAUNCHED(what);
}

}  // namespace moefold::cuda
