// How an op's entry point (ops/cpu/*.cpp) hands CUDA tensors to its CUDA implementation: after its
// arguments were checked there once, MF_ON_GPU(ctx, t, cuda::op(ctx, ...)) returns the CUDA
// call's result when `t` lives on the GPU. Host tensors run the CPU reference on the calling
// thread whatever the context; CUDA tensors need a CUDA execution context (checked).
#pragma once

#include "moefold/core/error.h"
#include "moefold/core/exec.h"

namespace moefold {

inline bool runs_on_gpu(const ExecContext& ctx, const Tensor& t, const char* what) {
  if (t.device() != Device::cuda) return false;
  MF_CHECK(ctx.device() == Device::cuda, what, ": CUDA tensor ", t.str(), " given a CPU execution context");
  return true;
}

}  // namespace moefold

#ifdef MOEFOLD_WITH_CUDA
#define MF_ON_GPU(ctx, t, call)                                \
  do {                                                         \
    if (::moefold::runs_on_gpu(ctx, t, __func__)) return call; \
  } while (0)
#else  // no CUDA tensors exist in this build
#define MF_ON_GPU(ctx, t, call) (void)::moefold::runs_on_gpu(ctx, t, __func__)
#endif
