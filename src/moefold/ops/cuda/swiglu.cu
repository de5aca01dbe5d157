// CUDA SwiGLU on a fused gate|up input (ops/ops.h): h = silu(g) * u, silu(g) = g * sigmoid(g).
// Backward (dgu WRITTEN): dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))), du = dh * silu(g).
// The arithmetic (swiglu.cuh): bf16 results take the tanh-based sigmoid, f32 the exact one.
// Both GateUp layouts: halves (g_j = gu[:, j], u_j = gu[:, F + j]) and pairs (g_j = gu[:, 2j],
// u_j = gu[:, 2j + 1], i.e. h's flat element i reads gu's flat elements 2i and 2i + 1).
#include <algorithm>
#include <type_traits>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/swiglu.cuh"
#include "moefold/ops/cuda/swiglu.h"

namespace moefold::cuda {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>(ceil_div(n, kThreads), 65535 * 8)); }

// One thread per (n, f), either layout.
template <class T>
__global__ void swiglu_forward_kernel(const T* gu, T* h, int64_t f, GateUpColumns col, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / f, g = row * 2 * f + col.step * (i - row * f);
    h[i] = from_float<T>(swiglu<std::is_same_v<T, __nv_bfloat16>>(to_float(gu[g]), to_float(gu[g + col.up])));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* gu, const T* dh, T* dgu, int64_t f, GateUpColumns col, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / f, g = row * 2 * f + col.step * (i - row * f);
    float dg, du;
    swiglu_grad<std::is_same_v<T, __nv_bfloat16>>(to_float(gu[g]), to_float(gu[g + col.up]), to_float(dh[i]), dg, du);
    dgu[g] = from_float<T>(dg);
    dgu[g + col.up] = from_float<T>(du);
  }
}

// bf16 at full width, the memory-bound pass with 16-byte loads and stores. Halves: rows whose
// width F is a multiple of 8, one thread per 8 units (8 g, 8 u, 8 h). Pairs: a multiple of 4
// units in all, one thread per 4 units (16 bytes of gu: 4 (g, u) pairs; 8 bytes of h).
constexpr int kVec = 8;
struct alignas(16) Bf16x8 {
  __nv_bfloat16 v[kVec];
};
struct alignas(8) Bf16x4 {
  __nv_bfloat16 v[kVec / 2];
};

__global__ void swiglu_forward_halves_kernel(const Bf16x8* gu, Bf16x8* h, int64_t chunks, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks, c = i - row * chunks;
    const Bf16x8 g = gu[row * 2 * chunks + c], u = gu[row * 2 * chunks + chunks + c];
    Bf16x8 out;
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      out.v[k] = __float2bfloat16(swiglu<true>(__bfloat162float(g.v[k]), __bfloat162float(u.v[k])));
    h[i] = out;
  }
}

__global__ void swiglu_backward_halves_kernel(const Bf16x8* gu, const Bf16x8* dh, Bf16x8* dgu, int64_t chunks,
                                              int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / chunks, c = i - row * chunks;
    const Bf16x8 g = gu[row * 2 * chunks + c], u = gu[row * 2 * chunks + chunks + c], d = dh[i];
    Bf16x8 dg, du;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float dgf, duf;
      swiglu_grad<true>(__bfloat162float(g.v[k]), __bfloat162float(u.v[k]), __bfloat162float(d.v[k]), dgf, duf);
      dg.v[k] = __float2bfloat16(dgf);
      du.v[k] = __float2bfloat16(duf);
    }
    dgu[row * 2 * chunks + c] = dg;
    dgu[row * 2 * chunks + chunks + c] = du;
  }
}

__global__ void swiglu_forward_pairs_kernel(const Bf16x8* gu, Bf16x4* h, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Bf16x8 gu8 = gu[i];
    Bf16x4 out;
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k)
      out.v[k] = __float2bfloat16(swiglu<true>(__bfloat162float(gu8.v[2 * k]), __bfloat162float(gu8.v[2 * k + 1])));
    h[i] = out;
  }
}

__global__ void swiglu_backward_pairs_kernel(const Bf16x8* gu, const Bf16x4* dh, Bf16x8* dgu, int64_t total) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Bf16x8 gu8 = gu[i];
    const Bf16x4 d = dh[i];
    Bf16x8 out;
#pragma unroll
    for (int k = 0; k < kVec / 2; ++k) {
      float dg, du;
      swiglu_grad<true>(__bfloat162float(gu8.v[2 * k]), __bfloat162float(gu8.v[2 * k + 1]), __bfloat162float(d.v[k]),
                        dg, du);
      out.v[2 * k] = __float2bfloat16(dg);
      out.v[2 * k + 1] = __float2bfloat16(du);
    }
    dgu[i] = out;
  }
}

// Units per thread of the 16-byte kernels for these tensors (gu, h or dh, dgu or undefined), or
// 0 when they do not qualify (not bf16, width, alignment): halves 8 (F % 8 == 0, every buffer
// 16-byte aligned); pairs 4 (N * F % 4 == 0, gu and dgu 16-byte, h 8-byte aligned).
int vector_units(const Tensor& gu, const Tensor& h, const Tensor& dgu, GateUp layout) {
  const auto aligned = [](const Tensor& t, uintptr_t bytes) {
    return !t.defined() || reinterpret_cast<uintptr_t>(t.data()) % bytes == 0;
  };
  if (gu.dtype() != DType::bf16 || !aligned(gu, 16) || !aligned(dgu, 16)) return 0;
  if (layout == GateUp::pairs) return h.numel() % (kVec / 2) == 0 && aligned(h, 8) ? kVec / 2 : 0;
  return h.size(1) % kVec == 0 && aligned(h, 16) ? kVec : 0;
}

void check_swiglu(const Tensor& gu, const Tensor& h, const char* what) {
  check_cuda_tensor(gu, what);
  check_cuda_tensor(h, what);
  MF_CHECK(gu.ndim() == 2 && h.ndim() == 2 && gu.size(0) == h.size(0) && gu.size(1) == 2 * h.size(1), what, ": ",
           gu.str(), " -> ", h.str());
  MF_CHECK(gu.dtype() == h.dtype(), what, ": ", gu.str(), " vs ", h.str());
}

}  // namespace

void swiglu_forward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& h_NF, GateUp layout) {
  check_swiglu(gu_N2F, h_NF, "swiglu_forward");
  const int64_t total = h_NF.numel(), f = h_NF.size(1);
  if (total == 0) return;
  const auto* gu8 = static_cast<const Bf16x8*>(gu_N2F.data());
  if (const int units = vector_units(gu_N2F, h_NF, Tensor(), layout)) {
    const int64_t n = total / units;
    if (layout == GateUp::pairs)
      swiglu_forward_pairs_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(gu8,
                                                                                  static_cast<Bf16x4*>(h_NF.data()), n);
    else
      swiglu_forward_halves_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
          gu8, static_cast<Bf16x8*>(h_NF.data()), f / units, n);
    MF_CUDA_LAUNCHED("swiglu_forward");
    return;
  }
  dispatch_cuda_float(h_NF.dtype(), [&]<class T>() {
    swiglu_forward_kernel<T><<<blocks_for(total), kThreads, 0, stream_of(ctx)>>>(gu_N2F.ptr<T>(), h_NF.ptr<T>(), f,
                                                                                 gate_up_columns(layout, f), total);
  });
  MF_CUDA_LAUNCHED("swiglu_forward");
}

void swiglu_backward(const ExecContext& ctx, const Tensor& gu_N2F, const Tensor& dh_NF, const Tensor& dgu_N2F,
                     GateUp layout) {
  check_swiglu(gu_N2F, dh_NF, "swiglu_backward");
  check_cuda_tensor(dgu_N2F, "swiglu_backward dgu");
  check_shape(dgu_N2F, gu_N2F.shape(), "swiglu_backward dgu");
  MF_CHECK(dgu_N2F.dtype() == gu_N2F.dtype(), "swiglu_backward: dgu ", dgu_N2F.str(), " vs gu ", gu_N2F.str());
  const int64_t total = dh_NF.numel(), f = dh_NF.size(1);
  if (total == 0) return;
  const auto* gu8 = static_cast<const Bf16x8*>(gu_N2F.data());
  auto* dgu8 = static_cast<Bf16x8*>(dgu_N2F.data());
  if (const int units = vector_units(gu_N2F, dh_NF, dgu_N2F, layout)) {
    const int64_t n = total / units;
    if (layout == GateUp::pairs)
      swiglu_backward_pairs_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
          gu8, static_cast<const Bf16x4*>(dh_NF.data()), dgu8, n);
    else
      swiglu_backward_halves_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
          gu8, static_cast<const Bf16x8*>(dh_NF.data()), dgu8, f / units, n);
    MF_CUDA_LAUNCHED("swiglu_backward");
    return;
  }
  dispatch_cuda_float(dh_NF.dtype(), [&]<class T>() {
    swiglu_backward_kernel<T><<<blocks_for(total), kThreads, 0, stream_of(ctx)>>>(
        gu_N2F.ptr<T>(), dh_NF.ptr<T>(), dgu_N2F.ptr<T>(), f, gate_up_columns(layout, f), total);
  });
  MF_CUDA_LAUNCHED("swiglu_backward");
}

}  // namespace moefold::cuda
