// CUDA rotary position embedding (ops/ops.h), Hugging Face "rotate_half" form: the pair
// (x[j], x[j + D/2]) is rotated in place by table row s (or positions[s]). The backward applies
// the transpose of the same 2x2 map to the gradient, which is WRITTEN (in place).
#include <algorithm>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/rope.h"

namespace moefold::cuda {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>(ceil_div(n, kThreads), 65535 * 8)); }

// One thread per pair (j, j + D/2), or (2j, 2j + 1) interleaved, of one (b, s, h) row of x_BSHD. Token s reads table
// row pos[s] (row s when pos is null); the table has p rows.
template <bool kTranspose, class T, class TT>
__global__ void rope_kernel(T* x, const TT* cos, const TT* sin, const int32_t* pos, int64_t p, int64_t s, int64_t h,
                            int64_t d, int64_t pairs, bool interleaved) {
  const int64_t half = d / 2;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / half, j = i - row * half;
    const int64_t si = (row / h) % s;
    int64_t table_row = si;
    if (pos != nullptr) {
      table_row = pos[si];
      if (table_row < 0 || table_row >= p) __trap();  // REQUIRES: 0 <= positions[s] < P
    }
    const TT* c = cos + table_row * d;
    const TT* sn = sin + table_row * d;
    T* xr = x + row * d;
    const int64_t i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + half;
    const float a = to_float(xr[i0]), b = to_float(xr[i1]);
    if constexpr (!kTranspose) {
      xr[i0] = from_float<T>(a * to_float(c[j]) - b * to_float(sn[j]));
      xr[i1] = from_float<T>(b * to_float(c[j + half]) + a * to_float(sn[j + half]));
    } else {
      xr[i0] = from_float<T>(a * to_float(c[j]) + b * to_float(sn[j + half]));
      xr[i1] = from_float<T>(b * to_float(c[j + half]) - a * to_float(sn[j]));
    }
  }
}

void check_table(const Tensor& x, const Tensor& cos, const Tensor& sin, const char* what) {
  check_cuda_tensor(x, what);
  check_cuda_tensor(cos, what);
  check_cuda_tensor(sin, what);
  MF_CHECK(cos.ndim() == 2 && cos.size(1) % 2 == 0, what, ": cos ", cos.str(), " (D must be even)");
  check_shape(sin, cos.shape(), what);
  MF_CHECK(x.ndim() == 4 && x.size(3) == cos.size(1) && (x.dtype() == DType::f32 || x.dtype() == DType::bf16), what,
           ": x ", x.str(), ", table ", cos.str());
  MF_CHECK(cos.dtype() == sin.dtype() && (cos.dtype() == x.dtype() || cos.dtype() == DType::f32), what, ": cos ",
           cos.str(), ", sin ", sin.str(), " must both have x's dtype or f32 (x ", x.str(), ")");
}

template <bool kTranspose>
void rope_launch(const ExecContext& ctx, const Tensor& x, const Tensor& cos, const Tensor& sin, const int32_t* pos,
                 bool interleaved, const char* what) {
  const int64_t s = x.size(1), h = x.size(2), d = x.size(3);
  const int64_t pairs = x.size(0) * s * h * (d / 2);
  if (pairs == 0) return;
  dispatch_cuda_float(x.dtype(), [&]<class T>() {
    auto launch = [&]<class TT>() {
      rope_kernel<kTranspose, T, TT><<<blocks_for(pairs), kThreads, 0, stream_of(ctx)>>>(
          x.ptr<T>(), cos.ptr<TT>(), sin.ptr<TT>(), pos, cos.size(0), s, h, d, pairs, interleaved);
    };
    if (cos.dtype() == x.dtype())
      launch.template operator()<T>();
    else
      launch.template operator()<float>();
  });
  MF_CUDA_LAUNCHED(what);
}

// REQUIRES: the table covers exactly x's S positions (as on the CPU).
void check_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const char* what) {
  check_table(x, cos, sin, what);
  MF_CHECK(x.size(1) == cos.size(0), what, ": x ", x.str(), " vs table ", cos.str(), " (one row per position)");
}

void check_positions(const Tensor& x, const Tensor& positions, const char* what) {
  check_cuda_tensor(positions, what);
  check_shape(positions, {x.size(1)}, what);
  MF_CHECK(positions.dtype() == DType::i32, what, ": positions ", positions.str(), " must be i32");
}

}  // namespace

void rope_forward(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& cos_SD, const Tensor& sin_SD,
                  bool interleaved) {
  check_rope(x_BSHD, cos_SD, sin_SD, "rope_forward");
  rope_launch<false>(ctx, x_BSHD, cos_SD, sin_SD, nullptr, interleaved, "rope_forward");
}

void rope_backward(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& cos_SD, const Tensor& sin_SD,
                   bool interleaved) {
  check_rope(dx_BSHD, cos_SD, sin_SD, "rope_backward");
  rope_launch<true>(ctx, dx_BSHD, cos_SD, sin_SD, nullptr, interleaved, "rope_backward");
}

void rope_forward_at(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& positions_S, const Tensor& cos_PD,
                     const Tensor& sin_PD, bool interleaved) {
  check_table(x_BSHD, cos_PD, sin_PD, "rope_forward_at");
  check_positions(x_BSHD, positions_S, "rope_forward_at");
  rope_launch<false>(ctx, x_BSHD, cos_PD, sin_PD, positions_S.ptr<int32_t>(), interleaved, "rope_forward_at");
}

void rope_backward_at(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& positions_S, const Tensor& cos_PD,
                      const Tensor& sin_PD, bool interleaved) {
  check_table(dx_BSHD, cos_PD, sin_PD, "rope_backward_at");
  check_positions(dx_BSHD, positions_S, "rope_backward_at");
  rope_launch<true>(ctx, dx_BSHD, cos_PD, sin_PD, positions_S.ptr<int32_t>(), interleaved, "rope_backward_at");
}

}  // namespace moefold::cuda
