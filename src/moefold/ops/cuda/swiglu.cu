// CUDA SwiGLU on a fused gate|up input (ops/ops.h): h = silu(g) * u, silu(g) = g * sigmoid(g).
// Backward (dgu WRITTEN): dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))), du = dh * silu(g).
#include <algorithm>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/norm_ops.h"

namespace moefold::cuda {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>(ceil_div(n, kThreads), 65535 * 8)); }

// expf (not __expf): full float accuracy; for g -> -inf, 1 + exp(-g) -> inf and sigmoid -> 0.
__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// One thread per (n, f): gate at gu[n, f], up at gu[n, F + f].
template <class T>
__global__ void swiglu_forward_kernel(const T* gu, T* h, int64_t f, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / f, j = i - row * f;
    const float g = to_float(gu[row * 2 * f + j]), u = to_float(gu[row * 2 * f + f + j]);
    h[i] = from_float<T>(g * sigmoid(g) * u);
  }
}

// bf16 rows whose width F is a multiple of 8 and whose buffers are 16-byte aligned: one thread
// per 8 elements (16-byte loads and stores), the memory-bound pass at full width.
constexpr int kVec = 8;
struct alignas(16) Bf16x8 {
  __nv_bfloat16 v[kVec];
};

__global__ void swiglu_forward_vec_kernel(const Bf16x8* gu, Bf16x8* h, int64_t chunks, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks, c = i - row * chunks;
    const Bf16x8 g = gu[row * 2 * chunks + c], u = gu[row * 2 * chunks + chunks + c];
    Bf16x8 out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float gf = __bfloat162float(g.v[k]);
      out.v[k] = __float2bfloat16(gf * sigmoid(gf) * __bfloat162float(u.v[k]));
    }
    h[i] = out;
  }
}

__global__ void swiglu_backward_vec_kernel(const Bf16x8* gu, const Bf16x8* dh, Bf16x8* dgu, int64_t chunks,
                                           int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks, c = i - row * chunks;
    const Bf16x8 g = gu[row * 2 * chunks + c], u = gu[row * 2 * chunks + chunks + c], d = dh[i];
    Bf16x8 dg, du;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float gf = __bfloat162float(g.v[k]), uf = __bfloat162float(u.v[k]), df = __bfloat162float(d.v[k]);
      const float sig = sigmoid(gf);
      dg.v[k] = __float2bfloat16(df * uf * sig * (1.0f + gf * (1.0f - sig)));
      du.v[k] = __float2bfloat16(df * gf * sig);
    }
    dgu[row * 2 * chunks + c] = dg;
    dgu[row * 2 * chunks + chunks + c] = du;
  }
}

bool vectorizable(const Tensor& a, const Tensor& b, const Tensor& c, int64_t f) {
  const auto aligned = [](const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; };
  return a.dtype() == DType::bf16 && f % kVec == 0 && aligned(a) && aligned(b) && (!c.defined() || aligned(c));
}

template <class T>
__global__ void swiglu_backward_kernel(const T* gu, const T* dh, T* dgu, int64_t f, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / f, j = i - row * f;
    const float g = to_float(gu[row * 2 * f + j]), u = to_float(gu[row * 2 * f + f + j]), d = to_float(dh[i]);
    const float sig = sigmoid(g);
    dgu[row * 2 * f + j] = from_float<T>(d * u * sig * (1.0f + g * (1.0f - sig)));
    dgu[row * 2 * f + f + j] = from_float<T>(d * g * sig);
  }
}

void check_swiglu(const Tensor& gu, const Tensor& h, const char* what) {
  check_cuda_tensor(gu, what);
  check_cuda_tensor(h, what);
  MF_CHECK(gu.ndim() == 2 && h.ndim() == 2 && gu.size(0) == h.size(0) && gu.size(1) == 2 * h.size(1), what, ": ",
           gu.str(), " -> ", h.str());
  MF_CHECK(gu.dtype() == h.dtype(), what, ": ", gu.str(), " vs ", h.str());
}

}  // namespace

void swiglu_forward(const Tensor& gu_N2F, const Tensor& h_NF) {
  check_swiglu(gu_N2F, h_NF, "swiglu_forward");
  const int64_t total = h_NF.numel(), f = h_NF.size(1);
  if (total == 0) return;
  if (vectorizable(gu_N2F, h_NF, Tensor(), f)) {
    const int64_t chunks = f / kVec, n = total / kVec;
    swiglu_forward_vec_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(static_cast<const Bf16x8*>(gu_N2F.data()),
                                                                        static_cast<Bf16x8*>(h_NF.data()), chunks, n);
    MF_CUDA_LAUNCHED("swiglu_forward");
    return;
  }
  dispatch_cuda_float(h_NF.dtype(), [&]<class T>() {
    swiglu_forward_kernel<T><<<blocks_for(total), kThreads, 0, stream()>>>(gu_N2F.ptr<T>(), h_NF.ptr<T>(), f, total);
  });
  MF_CUDA_LAUNCHED("swiglu_forward");
}

void swiglu_backward(const Tensor& gu_N2F, const Tensor& dh_NF, const Tensor& dgu_N2F) {
  check_swiglu(gu_N2F, dh_NF, "swiglu_backward");
  check_cuda_tensor(dgu_N2F, "swiglu_backward dgu");
  check_shape(dgu_N2F, gu_N2F.shape(), "swiglu_backward dgu");
  MF_CHECK(dgu_N2F.dtype() == gu_N2F.dtype(), "swiglu_backward: dgu ", dgu_N2F.str(), " vs gu ", gu_N2F.str());
  const int64_t total = dh_NF.numel(), f = dh_NF.size(1);
  if (total == 0) return;
  if (vectorizable(gu_N2F, dh_NF, dgu_N2F, f)) {
    const int64_t chunks = f / kVec, n = total / kVec;
    swiglu_backward_vec_kernel<<<blocks_for(n), kThreads, 0, stream()>>>(
        static_cast<const Bf16x8*>(gu_N2F.data()), static_cast<const Bf16x8*>(dh_NF.data()),
        static_cast<Bf16x8*>(dgu_N2F.data()), chunks, n);
    MF_CUDA_LAUNCHED("swiglu_backward");
    return;
  }
  dispatch_cuda_float(dh_NF.dtype(), [&]<class T>() {
    swiglu_backward_kernel<T>
        <<<blocks_for(total), kThreads, 0, stream()>>>(gu_N2F.ptr<T>(), dh_NF.ptr<T>(), dgu_N2F.ptr<T>(), f, total);
  });
  MF_CUDA_LAUNCHED("swiglu_backward");
}

}  // namespace moefold::cuda
