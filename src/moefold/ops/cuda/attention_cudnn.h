// cuDNN's fused attention (scaled dot-product attention, its flash-attention engines) for the
// plain causal grouped-query ops of ops/ops.h on the GPU, and the choice between it and moefold's
// own kernel (attention.h). Same contracts as attention.h: out, lse (f32, natural-log
// log-sum-exp of each row of scale * q k^T over its visible keys, [B, Q, S]) WRITTEN by forward;
// dq, dk, dv WRITTEN by backward. The _at variants (explicit positions) always use the own kernel.
//
// Which implementation serves a call: the context's kernels.attention (core/kernel_options.h):
//   auto:  cuDNN when this build has it and it supports the problem (bf16; head dim a multiple of
//          8, at most 256; 16-byte aligned pointers; cuDNN's own support check for the shape),
//          else the own kernel;
//   own:   always the own kernel;
//   cudnn: always cuDNN; a problem it cannot serve fails (moefold::Error) with cuDNN's reason.
// cuDNN's backward is deterministic (bit-identical reruns, as the own kernel's) unless
// kernels.deterministic_attention = false lets it use its faster engine with atomic dQ
// accumulation. Everything runs on the context's stream with the context's cuDNN handle; built
// graphs are cached per context and problem, and their workspace is the context's grow-only
// scratch (ScratchSlot::attention), so no step after the first allocates.
#pragma once

#include <cstdint>
#include <string>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

enum class AttentionImpl { own, cudnn };
const char* attention_impl_name(AttentionImpl impl);

// The GPU entry points of ops/ops.h's attention_forward / attention_backward: checks the tensors,
// then runs the implementation kernels.attention picks (above).
void attention_forward_dispatch(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD,
                                const Tensor& v_BSGD, double scale, const Tensor& out_BSQD, const Tensor& lse_BQS);
void attention_backward_dispatch(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD,
                                 const Tensor& v_BSGD, const Tensor& out_BSQD, const Tensor& lse_BQS,
                                 const Tensor& dout_BSQD, double scale, const Tensor& dq_BSQD, const Tensor& dk_BSGD,
                                 const Tensor& dv_BSGD);
// The implementation that served this process's last forward (backward = false) or backward
// dispatch (own before any call).
AttentionImpl last_attention_impl(bool backward);

// Whether this build contains the cuDNN path (CMake option MOEFOLD_CUDNN, on when cuDNN and its
// frontend headers were found); the version of the cuDNN library loaded at run time (e.g. 91900
// for 9.19.0; 0 without the cuDNN path); the frontend version compiled in (e.g. "1.32.0"; "").
bool cudnn_attention_built();
int64_t cudnn_runtime_version();
std::string cudnn_frontend_version();

struct CudnnAttentionOptions {
  bool deterministic = true;  // backward only: no atomics (cuDNN's dP-workspace engine on Hopper)
};

// One problem as cuDNN sees it: B, S, Q, G, D, dtype, scale, direction, determinism.
struct CudnnAttentionProblem {
  int64_t batch = 0, seq = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::bf16;
  double scale = 0;
  bool backward = false;
  bool deterministic = true;
};
// Whether cuDNN serves `p` (builds and caches its graph on the first ask, on the current GPU);
// when not, the reason goes to *why. Pointer alignment is checked per call, not here.
bool cudnn_attention_supported(const ExecContext& ctx, const CudnnAttentionProblem& p, std::string* why = nullptr);

// cuDNN attention with the contracts of attention.h's plain ops. The tensors are checked as
// there (aborting on misuse); then, when cuDNN cannot serve the problem, they return false having
// launched nothing, with the reason in *why (if given).
bool cudnn_attention_forward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                             double scale, const Tensor& out_BSQD, const Tensor& lse_BQS,
                             const CudnnAttentionOptions& opts = {}, std::string* why = nullptr);
bool cudnn_attention_backward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                              const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& dout_BSQD, double scale,
                              const Tensor& dq_BSQD, const Tensor& dk_BSGD, const Tensor& dv_BSGD,
                              const CudnnAttentionOptions& opts = {}, std::string* why = nullptr);

}  // namespace moefold::cuda
