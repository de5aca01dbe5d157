// Shared by the CUDA ops (ops/cuda/*.cu): error checks, the context's stream, bf16/float access.
// Every op runs on the stream of the execution context it is given (core/exec.h), checks its
// launch, and never synchronises the host unless its header says so.
#pragma once

#include <cuda_bf16.h>

#include "moefold/core/cuda_check.h"
#include "moefold/core/device.h"
#include "moefold/core/error.h"
#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold {
// bf16 device storage: Tensor::ptr<__nv_bfloat16>() checks the dtype like any other type.
template <>
constexpr DType dtype_of<__nv_bfloat16>() {
  return DType::bf16;
}
}  // namespace moefold

namespace moefold::cuda {

// After a kernel launch: a launch error (bad configuration, no device code for this GPU) fails.
#define MF_CUDA_LAUNCHED(what)                                                                       \
  do {                                                                                               \
    const cudaError_t mf_err_ = cudaGetLastError();                                                  \
    if (mf_err_ != cudaSuccess) MF_FAIL("CUDA launch of ", what, ": ", cudaGetErrorString(mf_err_)); \
  } while (0)

// The stream an op runs on: its execution context's (core/exec.h).
inline cudaStream_t stream_of(const ExecContext& ctx) { return static_cast<cudaStream_t>(ctx.stream()); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Loads and stores in float whatever the storage type (float or bf16).
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// N elements of T as one aligned access (16 bytes: one vector load or store).
template <class T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// "The last block to arrive" of `total` blocks sharing `counter` (a zeroed word, e.g. from
// ScratchSlot::arrivals): every thread of the block calls it after writing its results; true in
// the last block, whose later reads see every block's results. The counter is zero again after
// (ready for the next launch).
__device__ __forceinline__ bool block_is_last_to_arrive(unsigned* counter, unsigned total) {
  __shared__ bool last;
  __threadfence();  // this thread's results are visible before its block counts itself in
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(counter, 1u) == total - 1;
    if (last) *counter = 0;  // every block has counted itself in
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// Calls f.template operator()<T>() with T = float or __nv_bfloat16 for the tensor's dtype.
template <class F>
decltype(auto) dispatch_cuda_float(DType t, F&& f) {
  switch (t) {
    case DType::f32:
      return f.template operator()<float>();
    case DType::bf16:
      return f.template operator()<__nv_bfloat16>();
    default:
      break;
  }
  MF_FAIL("CUDA op: dtype ", dtype_name(t), " is not supported (f32, bf16)");
}

inline void check_cuda_tensor(const Tensor& t, const char* what) {
  MF_CHECK(t.device() == Device::cuda && t.contiguous(), what, ": ", t.str(), " must be a contiguous CUDA tensor");
}

}  // namespace moefold::cuda
