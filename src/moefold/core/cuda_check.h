// The CUDA runtime's error check, for code of the CUDA build only (include it under
// MOEFOLD_WITH_CUDA): a failed call becomes a moefold::Error naming the call and CUDA's message.
#pragma once

#include <cuda_runtime.h>

#include "moefold/core/error.h"

#define MF_CUDA_CHECK(expr)                                                                          \
  do {                                                                                               \
    const cudaError_t mf_err_ = (expr);                                                              \
    if (mf_err_ != cudaSuccess) MF_FAIL("CUDA error in ", #expr, ": ", cudaGetErrorString(mf_err_)); \
  } while (0)
