// CUDA path of the vocabulary-parallel embedding and cross-entropy (vocab_parallel.h), reached
// from vocab_parallel.cpp after its checks; the forward's two all-reduces stay on the device.
// Gradient rules: dtable ACCUMULATED (deterministic, without atomics), dlogits WRITTEN.
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
constexpr int kEmbThreads = 256;      // embedding: the forward's grid-stride blocks, one backward block per token
// Embedding backward: ids compared per thread per block-wide vote (earlier duplicates) and per
// pass (later matches), and dtable columns per thread per column pass.
constexpr int kIdsPerVote = kEmbThreads * 16;
constexpr int kIdsPerThread = 8;
constexpr int kIdsPerPass = kEmbThreads * kIdsPerThread;  // 2048 ids: 64 match words per pass
constexpr int kWordsPerPass = kIdsPerPass / 32;
constexpr int kColsPerThread = 4;

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

// ---- embedding ----------------------------------------------------------------------------------

template <class T>
__global__ void embedding_forward_kernel(const int32_t* ids, const T* table, T* out, int64_t n, int64_t c, int64_t vl,
                                         int64_t vocab_offset) {
  const int64_t total = n * c;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / c, col = i - row * c;
    const int32_t id = ids[row];
    if (id < 0) __trap();  // REQUIRES: ids >= 0
    const int64_t local = id - vocab_offset;
    out[i] = local >= 0 && local < vl ? table[local * c + col] : from_float<T>(0.0f);
  }
}

// One block per token `owner`. Outside the shard, or when an earlier token has the same id, the
// block exits; otherwise it owns row id - vocab_offset of dtable and adds the dout rows of every
// token at or after `owner` with that id, in token order, per column in a float that starts from
// the old value (so an f32 dtable gets exactly the CPU's sums). Exactly one block writes each
// touched row. The later matches are found again for each column pass (ids stay in L2), which
// keeps shared memory fixed whatever N.
template <class T, class G>
__global__ void __launch_bounds__(kEmbThreads)
    embedding_backward_kernel(const int32_t* ids, const T* dout, G* dtable, int64_t n, int64_t c, int64_t vl,
                              int64_t vocab_offset) {
  __shared__ uint32_t match_bits[kWordsPerPass];
  const int64_t owner = blockIdx.x;
  const int32_t id = ids[owner];
  if (id < 0) __trap();  // REQUIRES: ids >= 0
  const int64_t local = id - vocab_offset;
  if (local < 0 || local >= vl) return;  // block-uniform
  for (int64_t base = 0; base < owner; base += kIdsPerVote) {
    // Loads at clamped (valid) indices without branches, so that all of them are in flight.
    bool dup = false;
#pragma unroll
    for (int k = 0; k < kIdsPerVote / kEmbThreads; ++k) {
      const int64_t m = base + k * kEmbThreads + threadIdx.x;
      dup |= (m < owner) & (ids[m < owner ? m : 0] == id);
    }
    if (__syncthreads_or(dup)) return;  // block-uniform
  }

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  G* row = dtable + local * c;
  for (int64_t c0 = 0; c0 < c; c0 += kEmbThreads * kColsPerThread) {
    int64_t col[kColsPerThread];
    float acc[kColsPerThread];
#pragma unroll
    for (int k = 0; k < kColsPerThread; ++k) {
      col[k] = c0 + k * kEmbThreads + threadIdx.x;
      acc[k] = col[k] < c ? to_float(row[col[k]]) : 0.0f;
    }
    for (int64_t base = owner; base < n; base += kIdsPerPass) {
      // Bit b of match_bits[w]: ids[base + 32 w + b] == id.
#pragma unroll
      for (int k = 0; k < kIdsPerThread; ++k) {
        const int64_t m = base + k * kEmbThreads + threadIdx.x;
        const unsigned bits = __ballot_sync(0xffffffffu, (m < n) & (ids[m < n ? m : 0] == id));
        if (lane == 0) match_bits[k * (kEmbThreads / 32) + warp] = bits;
      }
      __syncthreads();
      for (int w = 0; w < kWordsPerPass; ++w) {  // block-uniform walk, in token order
        for (uint32_t bits = match_bits[w]; bits != 0; bits &= bits - 1) {
          const T* src = dout + (base + w * 32 + (__ffs(static_cast<int>(bits)) - 1)) * c;
#pragma unroll
          for (int k = 0; k < kColsPerThread; ++k)
            if (col[k] < c) acc[k] += to_float(src[col[k]]);
        }
      }
      __syncthreads();  // before the next pass overwrites match_bits
    }
#pragma unroll
    for (int k = 0; k < kColsPerThread; ++k)
      if (col[k] < c) row[col[k]] = from_float<G>(acc[k]);
  }
}

}  // namespace

void vocab_parallel_embedding_forward(const Tensor& ids_N, const Tensor& table_shard_VlC, int64_t vocab_offset,
                                      const Tensor& out_partial_NC) {
  const int64_t n = ids_N.size(0), vl = table_shard_VlC.size(0), c = table_shard_VlC.size(1);
  if (n * c == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(n * c, kEmbThreads), 65535 * 8));
  dispatch_cuda_float(table_shard_VlC.dtype(), [&]<class T>() {
    embedding_forward_kernel<T><<<blocks, kEmbThreads, 0, stream()>>>(ids_N.ptr<int32_t>(), table_shard_VlC.ptr<T>(),
                                                                      out_partial_NC.ptr<T>(), n, c, vl, vocab_offset);
  });
  MF_CUDA_LAUNCHED("vocab_parallel_embedding_forward");
}

void vocab_parallel_embedding_backward(const Tensor& ids_N, const Tensor& dout_NC, int64_t vocab_offset,
                                       const Tensor& dtable_shard_VlC) {
  const int64_t n = ids_N.size(0), vl = dtable_shard_VlC.size(0), c = dtable_shard_VlC.size(1);
  if (n * c == 0 || vl == 0) return;
  const unsigned grid = rows_grid(n, "vocab_parallel_embedding_backward");
  dispatch_cuda_float(dout_NC.dtype(), [&]<class T>() {
    auto launch = [&]<class G>() {
      embedding_backward_kernel<T, G><<<grid, kEmbThreads, 0, stream()>>>(
          ids_N.ptr<int32_t>(), dout_NC.ptr<T>(), dtable_shard_VlC.ptr<G>(), n, c, vl, vocab_offset);
    };
    if (dtable_shard_VlC.dtype() == dout_NC.dtype())
      launch.template operator()<T>();
    else
      launch.template operator()<float>();  // the f32 master gradient of bf16 rows
  });
  MF_CUDA_LAUNCHED("vocab_parallel_embedding_backward");
}

VocabParallelSums vocab_parallel_cross_entropy_forward(Communicator& tp, const Tensor& logits_shard_NVl,
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
    max_kernel<<<grid, kRowThreads, 0, stream()>>>(logits_shard_NVl.ptr<T>(), vl, max_n.ptr<double>());
    MF_CUDA_LAUNCHED("vocab_parallel_cross_entropy_forward row max");
    if (reduce) tp.all_reduce(max_n, ReduceOp::max);
    MF_CUDA_CHECK(cudaMemsetAsync(sums.ptr<double>() + 2 * n, 0, sizeof(double), stream()));  // the found count
    auto* sums_kernel = vec ? &ce_row_sums_kernel<T, true> : &ce_row_sums_kernel<T, false>;
    sums_kernel<<<grid, kRowThreads, 0, stream()>>>(logits_shard_NVl.ptr<T>(), targets_N.ptr<int32_t>(),
                                                    max_n.ptr<double>(), n, vl, vocab_offset, tp.rank() == 0,
                                                    sums.ptr<double>());
    MF_CUDA_LAUNCHED("vocab_parallel_cross_entropy_forward row sums");
  });
  if (reduce) tp.all_reduce(sums, ReduceOp::sum);
  ce_finish_kernel<<<1, kFinishThreads, 0, stream()>>>(targets_N.ptr<int32_t>(), max_n.ptr<double>(),
                                                       sums.ptr<double>(), n, lse_N.ptr<float>(), out);
  MF_CUDA_LAUNCHED("vocab_parallel_cross_entropy_forward finish");
  double host[2] = {0, 0};
  MF_CUDA_CHECK(cudaMemcpyAsync(host, out, sizeof(host), cudaMemcpyDeviceToHost, stream()));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return {host[0], host[1]};
}

void vocab_parallel_cross_entropy_backward(const Tensor& logits_shard_NVl, int64_t vocab_offset,
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
    kernel<<<grid, kRowThreads, 0, stream()>>>(logits_shard_NVl.ptr<T>(), targets_N.ptr<int32_t>(), lse_N.ptr<float>(),
                                               static_cast<float>(grad_scale), vl, vocab_offset,
                                               dlogits_shard_NVl.ptr<T>());
  });
  MF_CUDA_LAUNCHED(what);
}

}  // namespace moefold::cuda
