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

// One thread per V consecutive pairs (j, j + D/2), or (2j, 2j + 1) interleaved, j in [j0, j0 + V),
// of one (b, s, h) row of x_BSHD: V = 1, or V pairs read and written as whole vectors where D/2
// and the pointers allow (rope_width). Token s reads table row pos[s] (row s when pos is null);
// the table has p rows. Each element's arithmetic is the one-pair form's.
template <bool kTranspose, int V, class T, class TT>
__global__ void rope_kernel(T* __restrict__ x, const TT* __restrict__ cos, const TT* __restrict__ sin,
                            const int32_t* __restrict__ pos, int64_t p, int64_t s, int64_t h, int64_t d, int64_t groups,
                            bool interleaved) {
  const int64_t half = d / 2, per_row = half / V;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < groups;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / per_row, j0 = (i - row * per_row) * V;
    const int64_t si = (row / h) % s;
    int64_t table_row = si;
    if (pos != nullptr) {
      table_row = pos[si];
      if (table_row < 0 || table_row >= p) __trap();  // REQUIRES: 0 <= positions[s] < P
    }
    using PT = Pack<TT, V>;
    const PT c0 = *reinterpret_cast<const PT*>(cos + table_row * d + j0);
    const PT c1 = *reinterpret_cast<const PT*>(cos + table_row * d + j0 + half);
    const PT s0 = *reinterpret_cast<const PT*>(sin + table_row * d + j0);
    const PT s1 = *reinterpret_cast<const PT*>(sin + table_row * d + j0 + half);
    // The pairs' elements: rotate_half's two halves, or V interleaved pairs.
    Pack<T, 2 * V> xs;
    T* xr = x + row * d;
    if (interleaved) {
      if constexpr (V == 1) {  // element by element: x need not be aligned to a pair
        xs.v[0] = xr[2 * j0];
        xs.v[1] = xr[2 * j0 + 1];
      } else {
        xs = *reinterpret_cast<const Pack<T, 2 * V>*>(xr + 2 * j0);
      }
    } else {
      const Pack<T, V> lo = *reinterpret_cast<const Pack<T, V>*>(xr + j0);
      const Pack<T, V> hi = *reinterpret_cast<const Pack<T, V>*>(xr + j0 + half);
#pragma unroll
      for (int q = 0; q < V; ++q) {
        xs.v[2 * q] = lo.v[q];
        xs.v[2 * q + 1] = hi.v[q];
      }
    }
#pragma unroll
    for (int q = 0; q < V; ++q) {
      const float a = to_float(xs.v[2 * q]), b = to_float(xs.v[2 * q + 1]);
      if constexpr (!kTranspose) {
        xs.v[2 * q] = from_float<T>(a * to_float(c0.v[q]) - b * to_float(s0.v[q]));
        xs.v[2 * q + 1] = from_float<T>(b * to_float(c1.v[q]) + a * to_float(s1.v[q]));
      } else {
        xs.v[2 * q] = from_float<T>(a * to_float(c0.v[q]) + b * to_float(s1.v[q]));
        xs.v[2 * q + 1] = from_float<T>(b * to_float(c1.v[q]) - a * to_float(s0.v[q]));
      }
    }
    if (interleaved) {
      if constexpr (V == 1) {
        xr[2 * j0] = xs.v[0];
        xr[2 * j0 + 1] = xs.v[1];
      } else {
        *reinterpret_cast<Pack<T, 2 * V>*>(xr + 2 * j0) = xs;
      }
    } else {
      Pack<T, V> lo, hi;
#pragma unroll
      for (int q = 0; q < V; ++q) {
        lo.v[q] = xs.v[2 * q];
        hi.v[q] = xs.v[2 * q + 1];
      }
      *reinterpret_cast<Pack<T, V>*>(xr + j0) = lo;
      *reinterpret_cast<Pack<T, V>*>(xr + j0 + half) = hi;
    }
  }
}

// The pairs per thread: the most (up to 16 bytes of x per half, 8 bf16 or 4 f32) that divide D/2
// and keep every vector of x and of the tables aligned; 1 otherwise.
template <class T, class TT>
int rope_width(int64_t d, bool interleaved, const void* x, const void* cos, const void* sin) {
  const auto aligned = [](const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  for (int v = static_cast<int>(16 / sizeof(T)); v > 1; v /= 2) {
    const int64_t x_bytes = (interleaved ? 2 : 1) * v * static_cast<int64_t>(sizeof(T));
    const int64_t t_bytes = v * static_cast<int64_t>(sizeof(TT));
    if ((d / 2) % v == 0 && aligned(x, x_bytes) && (d * static_cast<int64_t>(sizeof(T))) % x_bytes == 0 &&
        aligned(cos, t_bytes) && aligned(sin, t_bytes))
      return v;
  }
  return 1;
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
      const auto run = [&]<int V>() {
        const int64_t groups = pairs / V;
        rope_kernel<kTranspose, V, T, TT><<<blocks_for(groups), kThreads, 0, stream_of(ctx)>>>(
            x.ptr<T>(), cos.ptr<TT>(), sin.ptr<TT>(), pos, cos.size(0), s, h, d, groups, interleaved);
      };
      const int v = rope_width<T, TT>(d, interleaved, x.data(), cos.data(), sin.data());
      if (v == 8) {
        if constexpr (sizeof(T) == 2) run.template operator()<8>();
      } else if (v == 4) {
        run.template operator()<4>();
      } else if (v == 2) {
        run.template operator()<2>();
      } else {
        run.template operator()<1>();
      }
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
