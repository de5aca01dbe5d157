// CUDA elementwise helpers (ops/ops.h): y += x, sum of squares, x *= s, over f32 or bf16.
#include <algorithm>
#include <span>

#include "moefold/core/philox.h"
#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/elementwise.h"
#include "moefold/ops/ops.h"  // kMaxSumSquares

namespace moefold::cuda {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>(ceil_div(n, kThreads), 65535 * 8)); }

// y += a, then (kTwo) y += b, each sum rounded to T: add_inplace and add_two_inplace. 16-byte
// vectors of Vec16<T>::kN elements where every pointer is 16-byte aligned (the scalar loop where
// not, and for the last n % kN elements): a warp moves 512 bytes per access of bf16, not 64.
// Elementwise: the same bits either way.
template <class T>
struct alignas(16) Vec16 {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

template <class T, bool kTwo>
__device__ __forceinline__ T add_one(T y, T a, T b) {
  const T s = from_float<T>(to_float(y) + to_float(a));
  if constexpr (kTwo) return from_float<T>(to_float(s) + to_float(b));
  return s;
}

template <class T, bool kTwo>
__global__ void add_kernel(T* y, const T* a, const T* b, int64_t n, bool vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t first = 0;
  if (vectors) {
    constexpr int kN = Vec16<T>::kN;
    const int64_t nv = n / kN;
    auto* yv = reinterpret_cast<Vec16<T>*>(y);
    const auto* av = reinterpret_cast<const Vec16<T>*>(a);
    [[maybe_unused]] const auto* bv = reinterpret_cast<const Vec16<T>*>(b);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < nv; i += stride) {
      Vec16<T> yy = yv[i];
      const Vec16<T> aa = av[i];
      if constexpr (kTwo) {
        const Vec16<T> bb = bv[i];
#pragma unroll
        for (int j = 0; j < kN; ++j) yy.v[j] = add_one<T, true>(yy.v[j], aa.v[j], bb.v[j]);
      } else {
#pragma unroll
        for (int j = 0; j < kN; ++j) yy.v[j] = add_one<T, false>(yy.v[j], aa.v[j], aa.v[j]);
      }
      yv[i] = yy;
    }
    first = nv * kN;
  }
  for (int64_t i = first + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    if constexpr (kTwo)
      y[i] = add_one<T, true>(y[i], a[i], b[i]);
    else
      y[i] = add_one<T, false>(y[i], a[i], a[i]);
  }
}
// One thread: mtp_loss_accumulate, the host's operations one by one.
__global__ void mtp_loss_kernel(const double* l, int64_t d_n, int64_t seq_len, double scaling, double* out) {
  double s = 0;
  for (int64_t k = 1; k <= d_n; ++k)
    s = __dadd_rn(s, __ddiv_rn(__dmul_rn(l[k - 1], static_cast<double>(seq_len)), static_cast<double>(seq_len - k)));
  out[0] = __dadd_rn(out[0], __ddiv_rn(__dmul_rn(s, scaling), static_cast<double>(d_n)));
}

__global__ void add_f64_kernel(double* y, const double* x, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] = __dadd_rn(y[i], x[i]);
}

// Element i: mean + std * normal(seed, stream, first + i), as core/rng.cpp's rng_normal on the host.
template <class T>
__global__ void fill_normal_kernel(T* p, int64_t n, uint64_t seed, uint64_t stream, double mean, double std,
                                   uint64_t first) {
  constexpr double kPi = 3.14159265358979323846;  // M_PI
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const philox::Block r = philox::draw(seed, stream, first + static_cast<uint64_t>(i));
    const double u1 = philox::to_unit(r.v[0]), u2 = philox::to_unit(r.v[1]);
    p[i] = from_float<T>(static_cast<float>(mean + std * (::sqrt(-2.0 * ::log(u1)) * ::cos(2.0 * kPi * u2))));
  }
}

template <class T>
__global__ void scale_kernel(T* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x[i] = from_float<T>(to_float(x[i]) * s);
}

// One partial sum (double) per block; the host adds the partials.
template <class T>
__global__ void sum_squares_kernel(const T* x, int64_t n, double* partial) {
  __shared__ double sh[kThreads];
  double s = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double v = to_float(x[i]);
    s += v * v;
  }
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (static_cast<int>(threadIdx.x) < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}

template <class S, class D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = from_float<D>(to_float(src[i]));
}

}  // namespace

void cast(const ExecContext& ctx, const Tensor& src, const Tensor& dst) {
  check_cuda_tensor(src, "cast src");
  check_cuda_tensor(dst, "cast dst");
  MF_CHECK(src.numel() == dst.numel(), "cast: ", src.str(), " -> ", dst.str());
  const int64_t n = src.numel();
  if (n == 0) return;
  dispatch_cuda_float(src.dtype(), [&]<class S>() {
    dispatch_cuda_float(dst.dtype(), [&]<class D>() {
      cast_kernel<S, D><<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(src.ptr<S>(), dst.ptr<D>(), n);
    });
  });
  MF_CUDA_LAUNCHED("cast");
}

void fill_normal(const ExecContext& ctx, const Tensor& t, uint64_t seed, uint64_t rng_stream, double mean, double std,
                 uint64_t first_index) {
  check_cuda_tensor(t, "fill_normal");
  MF_CHECK(t.contiguous(), "fill_normal: ", t.str(), " is not contiguous");
  const int64_t n = t.numel();
  if (n == 0) return;
  dispatch_cuda_float(t.dtype(), [&]<class T>() {
    fill_normal_kernel<T>
        <<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(t.ptr<T>(), n, seed, rng_stream, mean, std, first_index);
  });
  MF_CUDA_LAUNCHED("fill_normal");
}

namespace {
// add_inplace (b undefined) and add_two_inplace on f32 or bf16.
void launch_add(const ExecContext& ctx, const Tensor& y, const Tensor& a, const Tensor& b, const char* what) {
  const int64_t n = y.numel();
  const auto aligned = [](const Tensor& t) { return !t.defined() || reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; };
  const bool vectors = aligned(y) && aligned(a) && aligned(b);
  dispatch_cuda_float(y.dtype(), [&]<class T>() {
    const int64_t work = vectors ? std::max<int64_t>(n / Vec16<T>::kN, n % Vec16<T>::kN) : n;
    const int blocks = blocks_for(work);
    if (b.defined())
      add_kernel<T, true><<<blocks, kThreads, 0, stream_of(ctx)>>>(y.ptr<T>(), a.ptr<T>(), b.ptr<T>(), n, vectors);
    else
      add_kernel<T, false><<<blocks, kThreads, 0, stream_of(ctx)>>>(y.ptr<T>(), a.ptr<T>(), nullptr, n, vectors);
  });
  MF_CUDA_LAUNCHED(what);
}
}  // namespace

void add_inplace(const ExecContext& ctx, const Tensor& y, const Tensor& x) {
  check_cuda_tensor(y, "add_inplace y");
  check_cuda_tensor(x, "add_inplace x");
  MF_CHECK(y.numel() == x.numel() && y.dtype() == x.dtype(), "add_inplace: ", y.str(), " += ", x.str());
  const int64_t n = y.numel();
  if (n == 0) return;
  if (y.dtype() == DType::f64) {  // statistics (a step's loss sums): in double, as the host
    add_f64_kernel<<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(y.ptr<double>(), x.ptr<double>(), n);
    MF_CUDA_LAUNCHED("add_inplace");
    return;
  }
  launch_add(ctx, y, x, Tensor(), "add_inplace");
}

void add_two_inplace(const ExecContext& ctx, const Tensor& y, const Tensor& a, const Tensor& b) {
  check_cuda_tensor(y, "add_two_inplace y");
  check_cuda_tensor(a, "add_two_inplace a");
  check_cuda_tensor(b, "add_two_inplace b");
  MF_CHECK(y.numel() == a.numel() && y.numel() == b.numel() && y.dtype() == a.dtype() && y.dtype() == b.dtype() &&
               y.dtype() != DType::f64,
           "add_two_inplace: ", y.str(), " += ", a.str(), " + ", b.str());
  if (y.numel() == 0) return;
  launch_add(ctx, y, a, b, "add_two_inplace");
}

void mtp_loss_accumulate(const ExecContext& ctx, const Tensor& losses_D, int64_t seq_len, double scaling,
                         const Tensor& out_1) {
  check_cuda_tensor(losses_D, "mtp_loss_accumulate losses");
  check_cuda_tensor(out_1, "mtp_loss_accumulate out");
  if (losses_D.numel() == 0) return;
  mtp_loss_kernel<<<1, 1, 0, stream_of(ctx)>>>(losses_D.ptr<double>(), losses_D.numel(), seq_len, scaling,
                                               out_1.ptr<double>());
  MF_CUDA_LAUNCHED("mtp_loss_accumulate");
}

void scale_inplace(const ExecContext& ctx, const Tensor& x, double s) {
  check_cuda_tensor(x, "scale_inplace");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_cuda_float(x.dtype(), [&]<class T>() {
    scale_kernel<T><<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(x.ptr<T>(), static_cast<float>(s), n);
  });
  MF_CUDA_LAUNCHED("scale_inplace");
}

double sum_squares(const ExecContext& ctx, const Tensor& x) {
  double s = 0;
  cuda::sum_squares_each(ctx, std::span<const Tensor>(&x, 1), std::span<double>(&s, 1));  // not ops.h's
  return s;
}

void sum_squares_each(const ExecContext& ctx, std::span<const Tensor> xs, std::span<double> out) {
  // Each tensor's partial sums (at most 1024 blocks) side by side in one scratch, one copy back.
  constexpr int kMaxBlocks = 1024;
  int blocks[kMaxSumSquares];
  int total = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i].numel() > 0) check_cuda_tensor(xs[i], "sum_squares");
    blocks[i] = static_cast<int>(std::min<int64_t>(ceil_div(xs[i].numel(), kThreads), kMaxBlocks));
    total += blocks[i];
    out[i] = 0;
  }
  if (total == 0) return;
  auto* partial = static_cast<double*>(ctx.scratch(ScratchSlot::sum_squares, total * sizeof(double)));
  int first = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (blocks[i] > 0)
      dispatch_cuda_float(xs[i].dtype(), [&]<class T>() {
        sum_squares_kernel<T>
            <<<blocks[i], kThreads, 0, stream_of(ctx)>>>(xs[i].ptr<T>(), xs[i].numel(), partial + first);
      });
    MF_CUDA_LAUNCHED("sum_squares");
    first += blocks[i];
  }
  static thread_local double host[kMaxSumSquares * kMaxBlocks];
  MF_CUDA_CHECK(cudaMemcpyAsync(host, partial, total * sizeof(double), cudaMemcpyDeviceToHost, stream_of(ctx)));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  first = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    double s = 0;
    for (int b = 0; b < blocks[i]; ++b) s += host[first + b];
    out[i] = s;
    first += blocks[i];
  }
}

}  // namespace moefold::cuda
