// CUDA RMSNorm over the last dim (ops/ops.h): y = w * x * r, r = 1/sqrt(mean(x^2) + eps).
// Backward: dx = r * (w*dy) - x * r^3 / C * sum_c(w*dy*x) (WRITTEN); dw += sum_n dy * x * r
// (ACCUMULATED, deterministic: fixed row chunks, then the chunks in order; no atomics).
#include <algorithm>
#include <climits>
#include <cstdint>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/rmsnorm.h"

namespace moefold::cuda {

namespace {

constexpr int kThreads = 256;
// Rows of at most this many channels get one warp each (8 rows per block); longer rows a block.
constexpr int64_t kWarpRowMaxC = 1024;
// dw: a block sums a tile of 32 columns over a chunk of rows, 8 warps striding the rows.
constexpr int kTileCols = 32;
constexpr int kTileWarps = 8;
constexpr int64_t kMinRowsPerChunk = 64;  // also keeps the partials within dx (chunks <= N/2)
constexpr int64_t kMaxChunks = 1024;

__device__ __forceinline__ float warp_sum(float v) {
  // Butterfly: every lane ends with the same sum (each step adds the same two values).
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum of v over the kTPR threads of one row (kTPR 32: a warp; kThreads: the whole block),
// returned to all of them. Called once per kernel (its shared memory is not reused).
template <int kTPR>
__device__ __forceinline__ float row_sum(float v) {
  v = warp_sum(v);
  if constexpr (kTPR == 32) {
    return v;
  } else {
    static_assert(kTPR == kThreads);
    __shared__ float partial[kThreads / 32];
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    float s = 0;
    for (int i = 0; i < kThreads / 32; ++i) s += partial[i];
    return s;
  }
}

// kTPR threads per row, kThreads / kTPR rows per block.
template <int kTPR, class T, class W>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(const T* x, const W* w, float eps, T* y, float* rstd, int64_t n, int64_t c) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kThreads / kTPR) + threadIdx.x / kTPR;
  const int t = threadIdx.x % kTPR;
  if (row >= n) return;  // whole warps only (kTPR = kThreads: the grid has exactly n blocks)
  const T* xr = x + row * c;
  float ss = 0;
  for (int64_t j = t; j < c; j += kTPR) {
    const float v = to_float(xr[j]);
    ss += v * v;
  }
  ss = row_sum<kTPR>(ss);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(c) + eps);
  if (t == 0) rstd[row] = r;
  T* yr = y + row * c;
  for (int64_t j = t; j < c; j += kTPR) yr[j] = from_float<T>(to_float(w[j]) * (to_float(xr[j]) * r));
}

template <int kTPR, class T, class W>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_dx_kernel(const T* x, const W* w, const float* rstd, const T* dy, T* dx, int64_t n, int64_t c) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kThreads / kTPR) + threadIdx.x / kTPR;
  const int t = threadIdx.x % kTPR;
  if (row >= n) return;
  const T* xr = x + row * c;
  const T* dyr = dy + row * c;
  float dot = 0;  // sum_c (w*dy) * x
  for (int64_t j = t; j < c; j += kTPR) dot += to_float(w[j]) * to_float(dyr[j]) * to_float(xr[j]);
  dot = row_sum<kTPR>(dot);
  const float r = rstd[row];
  const float k = dot * r * r * r / static_cast<float>(c);
  T* dxr = dx + row * c;
  for (int64_t j = t; j < c; j += kTPR)
    dxr[j] = from_float<T>(r * (to_float(w[j]) * to_float(dyr[j])) - to_float(xr[j]) * k);
}

// The dw term of one element, and a partial sum of an earlier pass.
template <class T>
struct DwTerm {
  const T* x;
  const T* dy;
  const float* rstd;
  int64_t c;
  __device__ float operator()(int64_t r, int64_t col) const {
    return to_float(dy[r * c + col]) * (to_float(x[r * c + col]) * rstd[r]);
  }
};
struct PartialTerm {
  const float* partial;
  int64_t c;
  __device__ float operator()(int64_t r, int64_t col) const { return partial[r * c + col]; }
};

// Sum of f(r, col) over rows [r0, r1) for the block's column `col` (blockDim = (32, 8)), in a
// fixed order; the result is valid in threadIdx.y == 0. Every thread must call it.
template <class F>
__device__ float column_sum(const F& f, int64_t r0, int64_t r1, int64_t col, int64_t c) {
  __shared__ float part[kTileWarps][kTileCols + 1];
  float acc = 0;
  if (col < c)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kTileWarps) acc += f(r, col);
  part[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  float s = 0;
  if (threadIdx.y == 0)
    for (int i = 0; i < kTileWarps; ++i) s += part[i][threadIdx.x];
  return s;
}

// Pass 1: block (tile, chunk) sums dy * x * r over its chunk of rows: into partial[chunk] when
// there are several chunks, straight into dw (accumulated) when partial is null (one chunk).
template <class T, class G>
__global__ void __launch_bounds__(kTileCols* kTileWarps)
    rmsnorm_dw_chunks_kernel(const T* x, const T* dy, const float* rstd, int64_t n, int64_t c, int64_t rows_per_chunk,
                             float* partial, G* dw) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(kTileCols) + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per_chunk, r1 = std::min(n, r0 + rows_per_chunk);
  const float s = column_sum(DwTerm<T>{x, dy, rstd, c}, r0, r1, col, c);
  if (threadIdx.y != 0 || col >= c) return;
  if (partial != nullptr)
    partial[blockIdx.y * c + col] = s;
  else
    dw[col] = from_float<G>(to_float(dw[col]) + s);
}

// Pass 2: dw += the sum of the chunks' partials, in chunk order.
template <class G>
__global__ void __launch_bounds__(kTileCols* kTileWarps)
    rmsnorm_dw_reduce_kernel(const float* partial, int64_t chunks, int64_t c, G* dw) {
  const int64_t col = blockIdx.x * static_cast<int64_t>(kTileCols) + threadIdx.x;
  const float s = column_sum(PartialTerm{partial, c}, 0, chunks, col, c);
  if (threadIdx.y == 0 && col < c) dw[col] = from_float<G>(to_float(dw[col]) + s);
}

// Calls f.template operator()<P>() with P = T when `t` is T's dtype, float when it is f32.
template <class T, class F>
void dispatch_param(DType t, F&& f) {
  if (t == dtype_of<T>())
    f.template operator()<T>();
  else
    f.template operator()<float>();
}

bool overlaps(const Tensor& a, const Tensor& b) {
  const auto* pa = static_cast<const char*>(a.data());
  const auto* pb = static_cast<const char*>(b.data());
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

int sm_count() {
  int device = 0, sms = 0;
  MF_CUDA_CHECK(cudaGetDevice(&device));
  MF_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

void check_rmsnorm(const Tensor& x, const Tensor& w, const Tensor& rstd, const char* what) {
  check_cuda_tensor(x, what);
  check_cuda_tensor(w, what);
  check_cuda_tensor(rstd, what);
  MF_CHECK(x.ndim() == 2 && x.size(1) > 0 && (x.dtype() == DType::f32 || x.dtype() == DType::bf16), what, ": x ",
           x.str());
  MF_CHECK(x.size(0) <= INT_MAX, what, ": ", x.size(0), " rows");
  check_shape(w, {x.size(1)}, what);
  check_shape(rstd, {x.size(0)}, what);
  MF_CHECK(w.dtype() == x.dtype() || w.dtype() == DType::f32, what, ": w ", w.str(), " must have x's dtype or f32");
  MF_CHECK(rstd.dtype() == DType::f32, what, ": rstd ", rstd.str(), " must be f32");
}

void check_like(const Tensor& t, const Tensor& ref, const char* what) {
  check_cuda_tensor(t, what);
  check_shape(t, ref.shape(), what);
  MF_CHECK(t.dtype() == ref.dtype(), what, ": ", t.str(), " vs ", ref.str());
}

}  // namespace

void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, double eps, const Tensor& y_NC,
                     const Tensor& rstd_N) {
  check_rmsnorm(x_NC, w_C, rstd_N, "rmsnorm_forward");
  check_like(y_NC, x_NC, "rmsnorm_forward y");
  const int64_t n = x_NC.size(0), c = x_NC.size(1);
  if (n == 0) return;
  dispatch_cuda_float(x_NC.dtype(), [&]<class T>() {
    dispatch_param<T>(w_C.dtype(), [&]<class W>() {
      const T* x = x_NC.ptr<T>();
      const W* w = w_C.ptr<W>();
      T* y = y_NC.ptr<T>();
      float* rstd = rstd_N.ptr<float>();
      const auto e = static_cast<float>(eps);
      if (c <= kWarpRowMaxC)
        rmsnorm_forward_kernel<32, T, W>
            <<<static_cast<unsigned>(ceil_div(n, kThreads / 32)), kThreads, 0, stream_of(ctx)>>>(x, w, e, y, rstd, n,
                                                                                                 c);
      else
        rmsnorm_forward_kernel<kThreads, T, W>
            <<<static_cast<unsigned>(n), kThreads, 0, stream_of(ctx)>>>(x, w, e, y, rstd, n, c);
    });
  });
  MF_CUDA_LAUNCHED("rmsnorm_forward");
}

void rmsnorm_backward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                      const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C) {
  check_rmsnorm(x_NC, w_C, rstd_N, "rmsnorm_backward");
  check_like(dy_NC, x_NC, "rmsnorm_backward dy");
  check_like(dx_NC, x_NC, "rmsnorm_backward dx");
  check_cuda_tensor(dw_C, "rmsnorm_backward dw");
  check_shape(dw_C, w_C.shape(), "rmsnorm_backward dw");
  MF_CHECK(dw_C.dtype() == x_NC.dtype() || dw_C.dtype() == DType::f32, "rmsnorm_backward: dw ", dw_C.str(),
           " must have x's dtype or f32");
  // dx's storage holds the dw partials until dx is written (see rmsnorm.h).
  for (const Tensor* t : {&x_NC, &w_C, &rstd_N, &dy_NC, &dw_C})
    MF_CHECK(!overlaps(dx_NC, *t), "rmsnorm_backward: dx ", dx_NC.str(), " overlaps an input or dw ", t->str());
  const int64_t n = x_NC.size(0), c = x_NC.size(1);
  if (n == 0) return;

  // Chunks of rows for dw: enough blocks to fill the GPU (8 per SM), at least kMinRowsPerChunk
  // rows each (so the f32 partials fit in dx: chunks <= N/2), at most kMaxChunks.
  const int64_t tiles = ceil_div(c, kTileCols);
  int64_t chunks =
      std::min({ceil_div(8 * static_cast<int64_t>(sm_count()), tiles), ceil_div(n, kMinRowsPerChunk), kMaxChunks});
  if (reinterpret_cast<uintptr_t>(dx_NC.data()) % alignof(float) != 0) chunks = 1;
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t rows_per_chunk = ceil_div(n, chunks);
  chunks = ceil_div(n, rows_per_chunk);
  MF_CHECK(chunks == 1 || chunks * c * static_cast<int64_t>(sizeof(float)) <= static_cast<int64_t>(dx_NC.nbytes()),
           "rmsnorm_backward: ", chunks, " chunks of dw partials do not fit in dx ", dx_NC.str());
  float* partial = chunks > 1 ? static_cast<float*>(dx_NC.data()) : nullptr;

  dispatch_cuda_float(x_NC.dtype(), [&]<class T>() {
    const T* x = x_NC.ptr<T>();
    const T* dy = dy_NC.ptr<T>();
    const float* rstd = rstd_N.ptr<float>();
    dispatch_param<T>(dw_C.dtype(), [&]<class G>() {
      G* dw = dw_C.ptr<G>();
      const dim3 block(kTileCols, kTileWarps);
      rmsnorm_dw_chunks_kernel<T, G>
          <<<dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(chunks)), block, 0, stream_of(ctx)>>>(
              x, dy, rstd, n, c, rows_per_chunk, partial, dw);
      MF_CUDA_LAUNCHED("rmsnorm_backward dw chunks");
      if (partial != nullptr) {
        rmsnorm_dw_reduce_kernel<G><<<static_cast<unsigned>(tiles), block, 0, stream_of(ctx)>>>(partial, chunks, c, dw);
        MF_CUDA_LAUNCHED("rmsnorm_backward dw reduce");
      }
    });
    dispatch_param<T>(w_C.dtype(), [&]<class W>() {
      const W* w = w_C.ptr<W>();
      T* dx = dx_NC.ptr<T>();
      if (c <= kWarpRowMaxC)
        rmsnorm_backward_dx_kernel<32, T, W>
            <<<static_cast<unsigned>(ceil_div(n, kThreads / 32)), kThreads, 0, stream_of(ctx)>>>(x, w, rstd, dy, dx, n,
                                                                                                 c);
      else
        rmsnorm_backward_dx_kernel<kThreads, T, W>
            <<<static_cast<unsigned>(n), kThreads, 0, stream_of(ctx)>>>(x, w, rstd, dy, dx, n, c);
      MF_CUDA_LAUNCHED("rmsnorm_backward dx");
    });
  });
}

}  // namespace moefold::cuda
