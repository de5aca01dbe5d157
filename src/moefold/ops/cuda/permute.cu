// CUDA permute and combine (ops/moe_ops.h, contracts in permute.h), forward and backward: tokens
// to expert rows and the weighted sum back. Gradient rule: drows, dx, dout, dprob WRITTEN.
#include "moefold/ops/cuda/common.cuh"
// (common.cuh first: it declares dtype_of<__nv_bfloat16>.)
#include <algorithm>
#include <limits>

#include "moefold/ops/cuda/moe_common.cuh"
#include "moefold/ops/cuda/permute.h"

namespace moefold::cuda {

namespace {

// One block per row (permute) or token (the others), VEC elements per thread access: 16 bytes
// when the row length and the pointers allow it. Sums over k run in k order, in f32.

// Loads in flight: the sums over k issue the loads of a chunk of rows before they use any of them,
// so a thread pays its memory latency once per chunk, not once per row (the arithmetic and its
// order are those of one row at a time). Chunks as measured (docs/benchmarks.md, session 38): four
// rows for the weighted sum (8 cost it occupancy, 124 registers: 7% slower at Qwen3-30B-A3B),
// eight for the combine's backward (5% faster than four at DeepSeek-V3). Permute copies one vector
// at a time: at Qwen3-30B-A3B's width a thread has one vector of a row, and four held at once cost
// occupancy (dispatch +43%).
constexpr int kSumChunk = 4;
constexpr int kCombineBackwardChunk = 8;

template <class T, int VEC>
__global__ void permute_kernel(const T* x, const int64_t* token, int64_t r_n, int64_t t_n, int64_t h_n, T* rows) {
  using P = Pack<T, VEC>;
  const int64_t nv = h_n / VEC;
  for (int64_t r = blockIdx.x; r < r_n; r += gridDim.x) {
    const int64_t t = token[r];
    MF_DEVICE_REQUIRE(t >= -1 && t < t_n, "row %lld reads token %lld of %lld", static_cast<long long>(r),
                      static_cast<long long>(t), static_cast<long long>(t_n));
    P* dst = reinterpret_cast<P*>(rows + r * h_n);
    if (t < 0) {
      P z;
#pragma unroll
      for (int q = 0; q < VEC; ++q) z.v[q] = from_float<T>(0.f);
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) dst[v] = z;
    } else {
      const P* src = reinterpret_cast<const P*>(x + t * h_n);
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) dst[v] = src[v];
    }
  }
}

// y_t = sum_k w_tk * in[row_tk] over kept rows (w = prob, or 1 when prob is null), in k order.
template <class T, int VEC>
__global__ void gather_sum_kernel(const T* __restrict__ in, const int64_t* __restrict__ row,
                                  const float* __restrict__ prob, int64_t t_n, int k_n, int64_t r_n, int64_t h_n,
                                  T* __restrict__ y) {
  using P = Pack<T, VEC>;
  const int64_t nv = h_n / VEC;
  for (int64_t t = blockIdx.x; t < t_n; t += gridDim.x) {
    const int64_t* rt = row + t * k_n;
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
      float acc[VEC];
#pragma unroll
      for (int q = 0; q < VEC; ++q) acc[q] = 0.f;
      for (int k0 = 0; k0 < k_n; k0 += kSumChunk) {
        int64_t r[kSumChunk];
        float w[kSumChunk];
        P p[kSumChunk];
#pragma unroll
        for (int c = 0; c < kSumChunk; ++c) {
          const int k = k0 + c;
          r[c] = k < k_n ? rt[k] : -1;
          MF_DEVICE_REQUIRE(r[c] < r_n, "token %lld reads row %lld of %lld", static_cast<long long>(t),
                            static_cast<long long>(r[c]), static_cast<long long>(r_n));
          w[c] = prob && r[c] >= 0 ? prob[t * k_n + k] : 1.f;
        }
#pragma unroll
        for (int c = 0; c < kSumChunk; ++c)
          if (r[c] >= 0) p[c] = reinterpret_cast<const P*>(in + r[c] * h_n)[v];
#pragma unroll
        for (int c = 0; c < kSumChunk; ++c) {
          if (r[c] < 0) continue;
#pragma unroll
          for (int q = 0; q < VEC; ++q) acc[q] += w[c] * to_float(p[c].v[q]);
        }
      }
      P out;
#pragma unroll
      for (int q = 0; q < VEC; ++q) out.v[q] = from_float<T>(acc[q]);
      reinterpret_cast<P*>(y + t * h_n)[v] = out;
    }
  }
}

// dout[row_tk] = prob_tk * dy_t and dprob_tk = <dy_t, out[row_tk]> (0 when dropped); dout's
// other rows were zeroed before. dy_t is read once per chunk of kCombineBackwardChunk k.
template <class T, int VEC>
__global__ void combine_backward_kernel(const T* __restrict__ out, const int64_t* __restrict__ row,
                                        const float* __restrict__ prob, const T* __restrict__ dy, int64_t t_n, int k_n,
                                        int64_t r_n, int64_t h_n, T* __restrict__ dout, float* __restrict__ dprob) {
  using P = Pack<T, VEC>;
  __shared__ float partial[32][kCombineBackwardChunk];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int n_warps = static_cast<int>(blockDim.x) / kWarp;
  const int64_t nv = h_n / VEC;
  for (int64_t t = blockIdx.x; t < t_n; t += gridDim.x) {
    for (int k0 = 0; k0 < k_n; k0 += kCombineBackwardChunk) {
      int64_t r[kCombineBackwardChunk];
      float p[kCombineBackwardChunk], dot[kCombineBackwardChunk];
#pragma unroll
      for (int q = 0; q < kCombineBackwardChunk; ++q) {
        const int k = k0 + q;
        r[q] = k < k_n ? row[t * k_n + k] : -1;
        MF_DEVICE_REQUIRE(r[q] < r_n, "token %lld reads row %lld of %lld", static_cast<long long>(t),
                          static_cast<long long>(r[q]), static_cast<long long>(r_n));
        p[q] = r[q] >= 0 ? prob[t * k_n + k] : 0.f;
        dot[q] = 0.f;
      }
      for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) {
        const P g = reinterpret_cast<const P*>(dy + t * h_n)[v];
        P o[kCombineBackwardChunk];
#pragma unroll
        for (int q = 0; q < kCombineBackwardChunk; ++q)
          if (r[q] >= 0) o[q] = reinterpret_cast<const P*>(out + r[q] * h_n)[v];
        float gf[VEC];
#pragma unroll
        for (int q = 0; q < VEC; ++q) gf[q] = to_float(g.v[q]);
#pragma unroll
        for (int q = 0; q < kCombineBackwardChunk; ++q) {
          if (r[q] < 0) continue;
          P d;
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            dot[q] += gf[i] * to_float(o[q].v[i]);
            d.v[i] = from_float<T>(p[q] * gf[i]);
          }
          reinterpret_cast<P*>(dout + r[q] * h_n)[v] = d;
        }
      }
#pragma unroll
      for (int q = 0; q < kCombineBackwardChunk; ++q) {
        const float s = warp_sum(dot[q]);
        if (lane == 0) partial[warp][q] = s;
      }
      __syncthreads();
      if (threadIdx.x < kCombineBackwardChunk && k0 + static_cast<int>(threadIdx.x) < k_n) {
        float s = 0.f;
        for (int w = 0; w < n_warps; ++w) s += partial[w][threadIdx.x];
        dprob[t * k_n + k0 + threadIdx.x] = s;  // a dropped k summed no terms: 0
      }
      __syncthreads();  // partial is reused by the next chunk
    }
  }
}

// rows[r] = 0 where token[r] < 0 (the padding rows); one block per row, the others return at once.
template <class T, int VEC>
__global__ void zero_padding_rows_kernel(const int64_t* token, int64_t r_n, int64_t h_n, T* rows) {
  using P = Pack<T, VEC>;
  const int64_t nv = h_n / VEC;
  P z;
#pragma unroll
  for (int q = 0; q < VEC; ++q) z.v[q] = from_float<T>(0.f);
  for (int64_t r = blockIdx.x; r < r_n; r += gridDim.x) {
    if (token[r] >= 0) continue;
    P* dst = reinterpret_cast<P*>(rows + r * h_n);
    for (int64_t v = threadIdx.x; v < nv; v += blockDim.x) dst[v] = z;
  }
}

// The widest access (elements, a power of two, 16 bytes at most) that divides h_n and keeps every
// row of every pointer aligned.
template <class T>
int vec_width(int64_t h_n, std::initializer_list<const void*> ptrs) {
  int vec = static_cast<int>(16 / sizeof(T));
  auto fits = [&](int v) {
    if (h_n % v != 0) return false;
    for (const void* p : ptrs)
      if (reinterpret_cast<uintptr_t>(p) % (static_cast<uintptr_t>(v) * sizeof(T)) != 0) return false;
    return true;
  };
  while (vec > 1 && !fits(vec)) vec /= 2;
  return vec;
}

// Calls f.template operator()<VEC>() for vec in {1, 2, 4, 8} (8 only for 2-byte types).
template <class T, class F>
void dispatch_vec(int vec, F&& f) {
  if (vec == 1) {
    f.template operator()<1>();
  } else if (vec == 2) {
    f.template operator()<2>();
  } else if (vec == 4) {
    f.template operator()<4>();
  } else {
    MF_CHECK(vec == 8 && sizeof(T) <= 2, "vector width ", vec);
    if constexpr (sizeof(T) <= 2) f.template operator()<8>();
  }
}

int row_threads(int64_t n_vec) {
  return static_cast<int>(std::clamp<int64_t>(ceil_div(n_vec, kWarp) * kWarp, 32, 256));
}

constexpr int64_t kMaxRowBlocks = 1 << 20;

// The rows, the tokens and the row map (or token_R) are contiguous CUDA tensors; their shapes and
// dtypes were checked by the CPU entry point (ops/cpu/permute.cpp).
void check_on_device(const Tensor& rows_RH, const Tensor& x_TH, const Tensor& map, const char* what) {
  check_cuda_tensor(rows_RH, what);
  check_cuda_tensor(x_TH, what);
  check_cuda_tensor(map, what);
}

}  // namespace

// ---- permute and combine -----------------------------------------------------------------------

void moe_permute(const ExecContext& ctx, const Tensor& x_TH, const Tensor& token_R, const Tensor& rows_RH) {
  check_on_device(rows_RH, x_TH, token_R, "moe_permute");
  const int64_t r_n = rows_RH.size(0), h_n = rows_RH.size(1), t_n = x_TH.size(0);
  if (r_n == 0 || h_n == 0) return;
  dispatch_cuda_float(x_TH.dtype(), [&]<class T>() {
    const T* x = x_TH.ptr<T>();
    T* rows = rows_RH.ptr<T>();
    dispatch_vec<T>(vec_width<T>(h_n, {x, rows}), [&]<int VEC>() {
      permute_kernel<T, VEC>
          <<<static_cast<int>(std::min(r_n, kMaxRowBlocks)), row_threads(h_n / VEC), 0, stream_of(ctx)>>>(
              x, token_R.ptr<int64_t>(), r_n, t_n, h_n, rows);
    });
  });
  MF_CUDA_LAUNCHED("moe_permute");
}

void moe_permute_backward(const ExecContext& ctx, const Tensor& drows_RH, const Tensor& row_TK, const Tensor& dx_TH) {
  check_on_device(drows_RH, dx_TH, row_TK, "moe_permute_backward");
  const int64_t t_n = dx_TH.size(0), h_n = dx_TH.size(1), k_n = row_TK.size(1), r_n = drows_RH.size(0);
  MF_CHECK(k_n <= std::numeric_limits<int>::max(), "moe_permute_backward: ", row_TK.str());
  if (t_n == 0 || h_n == 0) return;
  dispatch_cuda_float(dx_TH.dtype(), [&]<class T>() {
    const T* drows = drows_RH.ptr<T>();
    T* dx = dx_TH.ptr<T>();
    dispatch_vec<T>(vec_width<T>(h_n, {drows, dx}), [&]<int VEC>() {
      gather_sum_kernel<T, VEC>
          <<<static_cast<int>(std::min(t_n, kMaxRowBlocks)), row_threads(h_n / VEC), 0, stream_of(ctx)>>>(
              drows, row_TK.ptr<int64_t>(), nullptr, t_n, static_cast<int>(k_n), r_n, h_n, dx);
    });
  });
  MF_CUDA_LAUNCHED("moe_permute_backward");
}

// ---- combine -----------------------------------------------------------------------------------

void moe_combine(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                 const Tensor& y_TH) {
  check_on_device(out_RH, y_TH, row_TK, "moe_combine");
  check_cuda_dtype(prob_TK, DType::f32, "moe_combine prob (CUDA: f32)");
  const int64_t t_n = y_TH.size(0), h_n = y_TH.size(1), k_n = row_TK.size(1), r_n = out_RH.size(0);
  MF_CHECK(k_n <= std::numeric_limits<int>::max(), "moe_combine: ", row_TK.str());
  if (t_n == 0 || h_n == 0) return;
  dispatch_cuda_float(y_TH.dtype(), [&]<class T>() {
    const T* out = out_RH.ptr<T>();
    T* y = y_TH.ptr<T>();
    dispatch_vec<T>(vec_width<T>(h_n, {out, y}), [&]<int VEC>() {
      gather_sum_kernel<T, VEC>
          <<<static_cast<int>(std::min(t_n, kMaxRowBlocks)), row_threads(h_n / VEC), 0, stream_of(ctx)>>>(
              out, row_TK.ptr<int64_t>(), prob_TK.ptr<float>(), t_n, static_cast<int>(k_n), r_n, h_n, y);
    });
  });
  MF_CUDA_LAUNCHED("moe_combine");
}

void moe_combine_backward(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                          const Tensor& token_R, const Tensor& dy_TH, const Tensor& dout_RH, const Tensor& dprob_TK) {
  check_on_device(out_RH, dy_TH, row_TK, "moe_combine_backward");
  check_cuda_tensor(dout_RH, "moe_combine_backward dout");
  check_cuda_tensor(token_R, "moe_combine_backward token");
  check_cuda_dtype(prob_TK, DType::f32, "moe_combine_backward prob (CUDA: f32)");
  check_cuda_dtype(dprob_TK, DType::f32, "moe_combine_backward dprob (CUDA: f32)");
  const int64_t t_n = dy_TH.size(0), h_n = dy_TH.size(1), k_n = row_TK.size(1), r_n = out_RH.size(0);
  MF_CHECK(k_n <= std::numeric_limits<int>::max(), "moe_combine_backward: ", row_TK.str());
  // Padding rows get no gradient (only they: a memset of all of dout would write every other row
  // twice, 0.94 GB at DeepSeek-V3's 65,536 rows).
  dispatch_cuda_float(dy_TH.dtype(), [&]<class T>() {
    T* dout = dout_RH.ptr<T>();
    if (r_n == 0 || h_n == 0) return;
    dispatch_vec<T>(vec_width<T>(h_n, {dout}), [&]<int VEC>() {
      zero_padding_rows_kernel<T, VEC>
          <<<static_cast<int>(std::min(r_n, kMaxRowBlocks)), row_threads(h_n / VEC), 0, stream_of(ctx)>>>(
              token_R.ptr<int64_t>(), r_n, h_n, dout);
    });
  });
  MF_CUDA_LAUNCHED("moe_combine_backward (padding rows)");
  if (t_n == 0 || k_n == 0) return;
  dispatch_cuda_float(dy_TH.dtype(), [&]<class T>() {
    const T* out = out_RH.ptr<T>();
    const T* dy = dy_TH.ptr<T>();
    T* dout = dout_RH.ptr<T>();
    dispatch_vec<T>(vec_width<T>(h_n, {out, dy, dout}), [&]<int VEC>() {
      combine_backward_kernel<T, VEC>
          <<<static_cast<int>(std::min(t_n, kMaxRowBlocks)), row_threads(h_n / VEC), 0, stream_of(ctx)>>>(
              out, row_TK.ptr<int64_t>(), prob_TK.ptr<float>(), dy, t_n, static_cast<int>(k_n), r_n, h_n, dout,
              dprob_TK.ptr<float>());
    });
  });
  MF_CUDA_LAUNCHED("moe_combine_backward");
}

}  // namespace moefold::cuda
