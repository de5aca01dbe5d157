// What the CUTLASS grouped GEMMs share (grouped_gemm_cutlass.cu: bf16 experts; fp8_gemm_cutlass.cu:
// FP8 blockwise): per-group argument arrays carved from one scratch block, the SMs the persistent
// kernels spread over, zeros for the written weight gradients of experts without rows, and the
// checked can_implement / initialise / run of one grouped GEMM. Include only where CUTLASS's
// headers are (MOEFOLD_WITH_CUTLASS), after them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moefold/core/error.h"
#include "moefold/core/exec.h"
#include "moefold/ops/cuda/common.cuh"

namespace moefold::cuda::cutlass_grouped {

// Arrays of `groups` entries each, every one 16-byte aligned, taken in turn from one block. A
// carver of a null base measures: bytes() after the same takes is what a block needs.
class ArgCarver {
 public:
  ArgCarver(void* base, int64_t groups)
      : base_(reinterpret_cast<uintptr_t>(base)), p_(base_), n_(static_cast<size_t>(groups)) {}
  template <class T>
  T* take() {
    p_ = (p_ + 15) & ~uintptr_t{15};
    T* r = reinterpret_cast<T*>(p_);
    p_ += sizeof(T) * n_;
    return r;
  }
  // The bytes taken so far, with the slack a base that is not 16-byte aligned needs.
  size_t bytes() const { return static_cast<size_t>(p_ - base_) + 15; }

 private:
  uintptr_t base_, p_;
  size_t n_;
};

// The SMs the persistent grouped GEMMs spread over: all of them, or kernels.gemm_sms to leave
// some to a transfer running beside them (expert parallelism: NCCL's blocks take SMs, and a
// persistent kernel whose blocks wait for them finishes late). Queried once per context.
struct HardwareState final : ExecLibraryState {
  explicit HardwareState(const ExecContext& ctx) {
    MF_CUDA_CHECK(cudaGetDevice(&info.device_id));
    info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(info.device_id);
    if (const int n = ctx.kernels().gemm_sms; n > 0) {
      if (n > info.sm_count) MF_FAIL("kernels.gemm_sms = ", n, ": this GPU has ", info.sm_count, " SMs");
      info.sm_count = n;
    }
  }
  cutlass::KernelHardwareInfo info;
};
inline cutlass::KernelHardwareInfo hardware_info(const ExecContext& ctx) {
  return ctx.library<HardwareState>(ExecLibrary::cutlass).info;
}

// dw_e = 0 for every expert e without rows (blockIdx.y = e; the other experts' blocks exit).
template <class T>
__global__ void zero_empty_experts_kernel(T* dw, const int64_t* __restrict__ off, int64_t per) {
  const int64_t e = blockIdx.y;
  if (off[e + 1] != off[e]) return;
  T* d = dw + e * per;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    d[i] = T(0.0f);
}
// A written (beta = 0) weight gradient of e_n experts of `per` elements: the experts without rows
// get no tiles, so their gradient is zeroed here (the offsets are read on the device).
template <class T>
void zero_empty_experts(const ExecContext& ctx, T* dw, const int64_t* off, int64_t e_n, int64_t per, const char* what) {
  const dim3 grid(64, static_cast<unsigned>(e_n));
  zero_empty_experts_kernel<<<grid, 256, 0, stream_of(ctx)>>>(dw, off, per);
  MF_CUDA_LAUNCHED(what);
}

// can_implement, the workspace (context scratch), initialize and run of one grouped GEMM.
template <class Gemm>
void run_gemm(const ExecContext& ctx, const typename Gemm::Arguments& args, const char* what) {
  Gemm gemm;
  const cutlass::Status ok = gemm.can_implement(args);
  MF_CHECK(ok == cutlass::Status::kSuccess, what, ": CUTLASS cannot run this grouped GEMM (",
           cutlassGetStatusString(ok), ")");
  void* ws = ctx.scratch(ScratchSlot::grouped_gemm_workspace, Gemm::get_workspace_size(args));
  const cutlass::Status init = gemm.initialize(args, ws, stream_of(ctx));
  MF_CHECK(init == cutlass::Status::kSuccess, what, ": CUTLASS initialize: ", cutlassGetStatusString(init));
  const cutlass::Status run = gemm.run(stream_of(ctx));
  MF_CHECK(run == cutlass::Status::kSuccess, what, ": CUTLASS run: ", cutlassGetStatusString(run));
  MF_CUDA_LAUNCHED(what);
}

}  // namespace moefold::cuda::cutlass_grouped
