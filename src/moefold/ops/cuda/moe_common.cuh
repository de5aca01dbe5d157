// Helpers shared by the CUDA MoE ops (router_topk.cu, router_losses.cu, permute_plan.cu,
// permute.cu): warp-level sums and maxima, grid sizing, the device-side REQUIRES, and the host
// checks of their tensors. Include after common.cuh.
#pragma once

#include <algorithm>
#include <cstdio>
#include <limits>

#include "moefold/ops/cuda/common.cuh"

namespace moefold::cuda {

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

inline int blocks_for(int64_t items, int64_t per_block) {
  return static_cast<int>(std::min<int64_t>(ceil_div(items, per_block), std::numeric_limits<int32_t>::max()));
}

inline void check_dtype(const Tensor& t, DType want, const char* what) {
  MF_CHECK(t.dtype() == want, what, ": ", t.str(), ", expected ", dtype_name(want));
}

// The CPU entry points (ops/cpu/*.cpp) check shapes before they hand CUDA tensors on; the CUDA
// ops check only what the device needs: a contiguous CUDA tensor of the dtype its kernel reads.
inline void check_cuda_dtype(const Tensor& t, DType want, const char* what) {
  check_cuda_tensor(t, what);
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

constexpr int kTokenWarps = 8;  // warps per block of the one-warp-per-token kernels

}  // namespace moefold::cuda
