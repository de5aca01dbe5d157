// SwiGLU's arithmetic, shared by its own kernels (swiglu.cu) and the grouped GEMM epilogues that
// fuse it (grouped_gemm_cutlass.cu), so both compute alike: h = silu(g) * u, silu(g) = g *
// sigmoid(g); dg = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))), du = dh * silu(g).
// kBf16 (bf16 results): sigmoid through the hardware tanh, sigmoid(g) = (1 + tanh(g / 2)) / 2
// (tanh.approx.f32, one MUFU instruction, relative error ~2^-11: under bf16's 2^-9 rounding),
// where expf and a division take ~30 instructions, which a GEMM epilogue pays in series with
// its tile's math. Otherwise expf: full float accuracy (g -> -inf: sigmoid -> 0).
#pragma once

namespace moefold::cuda {

template <bool kBf16>
__device__ __forceinline__ float swiglu_sigmoid(float g) {
  if constexpr (kBf16) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(0.5f * g));
    return fmaf(0.5f, t, 0.5f);
  } else {
    return 1.0f / (1.0f + expf(-g));
  }
}

template <bool kBf16>
__device__ __forceinline__ float swiglu(float g, float u) {
  return g * swiglu_sigmoid<kBf16>(g) * u;
}

// d = dh: dg and du.
template <bool kBf16>
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float& dg, float& du) {
  const float sig = swiglu_sigmoid<kBf16>(g);
  dg = d * u * sig * (1.0f + g * (1.0f - sig));
  du = d * g * sig;
}

}  // namespace moefold::cuda
