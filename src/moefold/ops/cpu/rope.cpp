// Rotary position embedding, Hugging Face "rotate_half" form (Qwen3/Llama): the pair
// (x[j], x[j + D/2]) is rotated by angle s * theta^(-2j/D). Forward and backward are in place;
// the backward applies the transpose (rotation by -angle) to the gradient, which is WRITTEN.
// The _at variants read table row positions[s] for token s (context parallelism).
// CUDA tensors go to ops/cuda/rope.cu.
#include <cmath>

#include "moefold/ops/dispatch.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/rope.h"
#endif

namespace moefold {

namespace {
void check_table(const Tensor& cos, const Tensor& sin, const char* what) {
  MF_CHECK(cos.ndim() == 2 && cos.size(1) % 2 == 0, what, ": cos ", cos.str(), " (D must be even)");
  check_shape(sin, cos.shape(), what);
  MF_CHECK(cos.dtype() == sin.dtype() && cos.contiguous() && sin.contiguous() && cos.device() == Device::cpu &&
               sin.device() == Device::cpu,
           what, ": cos ", cos.str(), ", sin ", sin.str());
}
// REQUIRES: the table covers exactly x's S positions (slice a longer table to offset them).
void check_rope(const Tensor& x, const Tensor& cos, const Tensor& sin, const char* what) {
  check_table(cos, sin, what);
  MF_CHECK(x.ndim() == 4 && x.size(1) == cos.size(0) && x.size(3) == cos.size(1), what, ": x ", x.str(), ", table ",
           cos.str());
  MF_CHECK(x.dtype() == cos.dtype() && x.contiguous() && x.device() == Device::cpu, what, ": x ", x.str());
}

// Positions for the _at variants: i32[S], each in [0, P) for a table of P rows.
void check_rope_at(const Tensor& x, const Tensor& positions, const Tensor& cos, const Tensor& sin, const char* what) {
  check_table(cos, sin, what);
  MF_CHECK(x.ndim() == 4 && x.size(3) == cos.size(1), what, ": x ", x.str(), ", table ", cos.str());
  MF_CHECK(x.dtype() == cos.dtype() && x.contiguous() && x.device() == Device::cpu, what, ": x ", x.str());
  check_shape(positions, {x.size(1)}, what);
  MF_CHECK(positions.dtype() == DType::i32 && positions.contiguous() && positions.device() == Device::cpu, what,
           ": positions ", positions.str(), " must be contiguous cpu i32");
  const int32_t* pos = positions.ptr<int32_t>();
  for (int64_t s = 0; s < x.size(1); ++s)
    MF_CHECK(pos[s] >= 0 && pos[s] < cos.size(0), what, ": position ", pos[s], " of token ", s,
             " outside the table of ", cos.size(0), " rows");
}

// Forward: (a, b) -> (a*cos[j] - b*sin[j], b*cos[j+D/2] + a*sin[j+D/2]); `transpose` applies
// the exact transpose of that 2x2 map. Token si uses table row pos[si] (row si when pos is null).
template <class T>
void rope_apply(T* x, const T* cos, const T* sin, const int32_t* pos, int64_t b, int64_t s, int64_t h, int64_t d,
                bool transpose, bool interleaved) {
  const int64_t half = d / 2;
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t si = 0; si < s; ++si) {
      const int64_t row_idx = pos ? pos[si] : si;
      const T* c = cos + row_idx * d;
      const T* sn = sin + row_idx * d;
      for (int64_t hi = 0; hi < h; ++hi) {
        T* row = x + ((bi * s + si) * h + hi) * d;
        for (int64_t j = 0; j < half; ++j) {
          const int64_t i0 = interleaved ? 2 * j : j, i1 = interleaved ? 2 * j + 1 : j + half;
          const T a = row[i0], bb = row[i1];
          if (!transpose) {
            row[i0] = a * c[j] - bb * sn[j];
            row[i1] = bb * c[j + half] + a * sn[j + half];
          } else {
            row[i0] = a * c[j] + bb * sn[j + half];
            row[i1] = bb * c[j + half] - a * sn[j];
          }
        }
      }
    }
}
}  // namespace

void rope_table(double theta, const Tensor& cos_SD, const Tensor& sin_SD) {
  MF_CHECK(theta > 0, "rope_table: theta ", theta);
  const int64_t d = cos_SD.ndim() == 2 ? cos_SD.size(1) : 0;
  std::vector<double> inv_freq(static_cast<size_t>(d / 2));
  for (int64_t j = 0; j < d / 2; ++j)
    inv_freq[j] = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(d));
  rope_table(inv_freq, 1.0, cos_SD, sin_SD);
}

void rope_table(const std::vector<double>& inv_freq, double attention_factor, const Tensor& cos_SD,
                const Tensor& sin_SD) {
  check_table(cos_SD, sin_SD, "rope_table");
  const int64_t s = cos_SD.size(0), d = cos_SD.size(1), half = d / 2;
  MF_CHECK(static_cast<int64_t>(inv_freq.size()) == half, "rope_table: ", inv_freq.size(), " frequencies for D=", d);
  dispatch_float(cos_SD.dtype(), [&]<class T>() {
    T* c = cos_SD.ptr<T>();
    T* sn = sin_SD.ptr<T>();
    for (int64_t j = 0; j < half; ++j)
      for (int64_t si = 0; si < s; ++si) {
        const double angle = static_cast<double>(si) * inv_freq[j];
        c[si * d + j] = c[si * d + j + half] = static_cast<T>(std::cos(angle) * attention_factor);
        sn[si * d + j] = sn[si * d + j + half] = static_cast<T>(std::sin(angle) * attention_factor);
      }
  });
}

void rope_forward(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& cos_SD, const Tensor& sin_SD,
                  bool interleaved) {
  MF_ON_GPU(ctx, x_BSHD, cuda::rope_forward(ctx, x_BSHD, cos_SD, sin_SD, interleaved));
  check_rope(x_BSHD, cos_SD, sin_SD, "rope_forward");
  dispatch_float(x_BSHD.dtype(), [&]<class T>() {
    rope_apply<T>(x_BSHD.ptr<T>(), cos_SD.ptr<T>(), sin_SD.ptr<T>(), nullptr, x_BSHD.size(0), x_BSHD.size(1),
                  x_BSHD.size(2), x_BSHD.size(3), false, interleaved);
  });
}

void rope_backward(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& cos_SD, const Tensor& sin_SD,
                   bool interleaved) {
  MF_ON_GPU(ctx, dx_BSHD, cuda::rope_backward(ctx, dx_BSHD, cos_SD, sin_SD, interleaved));
  check_rope(dx_BSHD, cos_SD, sin_SD, "rope_backward");
  dispatch_float(dx_BSHD.dtype(), [&]<class T>() {
    rope_apply<T>(dx_BSHD.ptr<T>(), cos_SD.ptr<T>(), sin_SD.ptr<T>(), nullptr, dx_BSHD.size(0), dx_BSHD.size(1),
                  dx_BSHD.size(2), dx_BSHD.size(3), true, interleaved);
  });
}

void rope_forward_at(const ExecContext& ctx, const Tensor& x_BSHD, const Tensor& positions_S, const Tensor& cos_PD,
                     const Tensor& sin_PD, bool interleaved) {
  MF_ON_GPU(ctx, x_BSHD, cuda::rope_forward_at(ctx, x_BSHD, positions_S, cos_PD, sin_PD, interleaved));
  check_rope_at(x_BSHD, positions_S, cos_PD, sin_PD, "rope_forward_at");
  dispatch_float(x_BSHD.dtype(), [&]<class T>() {
    rope_apply<T>(x_BSHD.ptr<T>(), cos_PD.ptr<T>(), sin_PD.ptr<T>(), positions_S.ptr<int32_t>(), x_BSHD.size(0),
                  x_BSHD.size(1), x_BSHD.size(2), x_BSHD.size(3), false, interleaved);
  });
}

void rope_backward_at(const ExecContext& ctx, const Tensor& dx_BSHD, const Tensor& positions_S, const Tensor& cos_PD,
                      const Tensor& sin_PD, bool interleaved) {
  MF_ON_GPU(ctx, dx_BSHD, cuda::rope_backward_at(ctx, dx_BSHD, positions_S, cos_PD, sin_PD, interleaved));
  check_rope_at(dx_BSHD, positions_S, cos_PD, sin_PD, "rope_backward_at");
  dispatch_float(dx_BSHD.dtype(), [&]<class T>() {
    rope_apply<T>(dx_BSHD.ptr<T>(), cos_PD.ptr<T>(), sin_PD.ptr<T>(), positions_S.ptr<int32_t>(), dx_BSHD.size(0),
                  dx_BSHD.size(1), dx_BSHD.size(2), dx_BSHD.size(3), true, interleaved);
  });
}

}  // namespace moefold
