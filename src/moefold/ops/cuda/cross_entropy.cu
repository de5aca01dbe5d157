// CUDA softmax cross-entropy over the vocabulary (ops/ops.h): one block per row, an online
// (running max, rescaled sum-exp) pass over the logits in float32, lse_N saved in f32; the row
// losses are summed in float64 in a fixed order. Gradient rule: dlogits = grad_scale *
// (softmax - onehot(target)), WRITTEN; ignored rows (kIgnoreTarget) get zeros.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/norm_ops.h"
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

}  // namespace

double cross_entropy_forward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N, const Tensor& lse_N) {
  check_ce(logits_NV, targets_N, lse_N, "cross_entropy_forward");
  const int64_t n = logits_NV.size(0), v = logits_NV.size(1);
  if (n == 0) return 0.0;
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
  sum_kernel<<<1, kSumThreads, 0, stream_of(ctx)>>>(scratch, n, scratch + n);
  MF_CUDA_LAUNCHED("cross_entropy_forward sum");
  double loss = 0;
  MF_CUDA_CHECK(cudaMemcpyAsync(&loss, scratch + n, sizeof(double), cudaMemcpyDeviceToHost, stream_of(ctx)));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  return loss;
}

void cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_NV, const Tensor& targets_N, const Tensor& lse_N, double grad_scale,
                            const Tensor& dlogits_NV) {
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
    kernel<<<static_cast<unsigned>(n), kThreads, 0, stream_of(ctx)>>>(logits_NV.ptr<T>(), targets_N.ptr<int32_t>(),
                                                                lse_N.ptr<float>(), static_cast<float>(grad_scale),
                                                                dlogits_NV.ptr<T>(), v);
  });
  MF_CUDA_LAUNCHED("cross_entropy_backward");
}

}  // namespace moefold::cuda
