// CUDA RMSNorm over the last dim (ops/ops.h): y = w * x * r, r = 1/sqrt(mean(x^2) + eps).
// Backward: dx = r * (w*dy) - x * r^3 / C * sum_c(w*dy*x) (WRITTEN; rmsnorm_backward_add: ADDED);
// dw += sum_n dy * x * r (ACCUMULATED, deterministic: fixed row chunks, then the chunks in order).
// One kernel per call (the residual stream's add fused in too: add_rmsnorm_forward,
// rmsnorm_backward_add), since at small widths a step is bound by its kernel count.
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
static_assert(kTileCols * kTileWarps == kThreads);
constexpr int64_t kMinRowsPerChunk = 64;
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

// kTPR threads per row, kThreads / kTPR rows per block. kAdd (add_rmsnorm_forward): the row is
// h = x + a (rounded to T), written to h (and h2 when not null) and normalised; else x is.
template <int kTPR, bool kAdd, class T, class W>
__global__ void __launch_bounds__(kThreads) rmsnorm_forward_kernel(const T* x, const T* a, const W* w, float eps, T* h,
                                                                   T* h2, T* y, float* rstd, int64_t n, int64_t c) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kThreads / kTPR) + threadIdx.x / kTPR;
  const int t = threadIdx.x % kTPR;
  if (row >= n) return;  // whole warps only (kTPR = kThreads: the grid has exactly n blocks)
  const T* xr = x + row * c;
  const T* src = kAdd ? h + row * c : xr;  // the rows normalised (each thread reads back its own writes)
  float ss = 0;
  for (int64_t j = t; j < c; j += kTPR) {
    float v;
    if constexpr (kAdd) {
      const T hv = from_float<T>(to_float(xr[j]) + to_float(a[row * c + j]));
      h[row * c + j] = hv;
      if (h2 != nullptr) h2[row * c + j] = hv;
      v = to_float(hv);
    } else {
      v = to_float(xr[j]);
    }
    ss += v * v;
  }
  ss = row_sum<kTPR>(ss);
  const float r = 1.0f / sqrtf(ss / static_cast<float>(c) + eps);
  if (t == 0) rstd[row] = r;
  T* yr = y + row * c;
  for (int64_t j = t; j < c; j += kTPR) yr[j] = from_float<T>(to_float(w[j]) * (to_float(src[j]) * r));
}

// The dw term of one element, and a partial sum of the chunks (written by other blocks of the
// same kernel: read past L1).
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
  __device__ float operator()(int64_t r, int64_t col) const { return __ldcg(partial + r * c + col); }
};

// Sum of f(r, col) over rows [r0, r1) for column `col` of the block's tile (lane: the column in the
// tile, warp: one of kTileWarps striding the rows), in a fixed order; the result is valid in warp
// 0. Every thread of the block must call it; calls are separated by a __syncthreads.
template <class F>
__device__ float column_sum(const F& f, int64_t r0, int64_t r1, int64_t col, int64_t c, int lane, int warp) {
  __shared__ float part[kTileWarps][kTileCols + 1];
  float acc = 0;
  if (col < c)
    for (int64_t r = r0 + warp; r < r1; r += kTileWarps) acc += f(r, col);
  part[warp][lane] = acc;
  __syncthreads();
  float s = 0;
  if (warp == 0)
    for (int i = 0; i < kTileWarps; ++i) s += part[i][lane];
  return s;
}

template <class T, class W, class G>
struct BackwardArgs {
  const T* x;
  const W* w;
  const float* rstd;
  const T* dy;
  T* dx;
  G* dw;
  int64_t n, c, tiles, chunks, rows_per_chunk;
  float* partial;     // [chunks, c]: each chunk's column sums (null with one chunk)
  unsigned* arrived;  // [tiles]: chunks done per column tile (zero before and after the kernel)
};

// dw of column tile `tile` over rows chunk `chunk`: with one chunk added to dw at once; else
// stored as the chunk's partial, and the tile's last chunk to arrive adds every chunk's partial,
// in chunk order, to dw (the same sums whichever block comes last) and resets the counter.
template <class T, class W, class G>
__device__ void dw_tile(const BackwardArgs<T, W, G>& a, int64_t tile, int64_t chunk) {
  const int lane = static_cast<int>(threadIdx.x % kTileCols), warp = static_cast<int>(threadIdx.x / kTileCols);
  const int64_t col = tile * kTileCols + lane;
  const int64_t r0 = chunk * a.rows_per_chunk, r1 = std::min(a.n, r0 + a.rows_per_chunk);
  const float s = column_sum(DwTerm<T>{a.x, a.dy, a.rstd, a.c}, r0, r1, col, a.c, lane, warp);
  const bool writes = warp == 0 && col < a.c;
  if (a.partial == nullptr) {
    if (writes) a.dw[col] = from_float<G>(to_float(a.dw[col]) + s);
    return;
  }
  if (writes) a.partial[chunk * a.c + col] = s;
  if (!block_is_last_to_arrive(a.arrived + tile, static_cast<unsigned>(a.chunks))) return;
  const float total = column_sum(PartialTerm{a.partial, a.c}, 0, a.chunks, col, a.c, lane, warp);
  if (writes) a.dw[col] = from_float<G>(to_float(a.dw[col]) + total);
}

// One launch for the whole backward, two kinds of blocks running side by side (one after the
// other in a block they would add up): the first tiles * chunks blocks each sum dw's column tile
// (b % tiles) over its chunk of rows (b / tiles); the rest write (kAdd: add) dx, kTPR threads per
// row and kThreads / kTPR rows per block.
template <int kTPR, bool kAdd, class T, class W, class G>
__global__ void __launch_bounds__(kThreads) rmsnorm_backward_kernel(BackwardArgs<T, W, G> a) {
  const int64_t dw_blocks = a.tiles * a.chunks;
  if (blockIdx.x < dw_blocks) {
    dw_tile(a, blockIdx.x % a.tiles, blockIdx.x / a.tiles);
    return;
  }
  const int64_t row = (blockIdx.x - dw_blocks) * (kThreads / kTPR) + threadIdx.x / kTPR;
  const int t = threadIdx.x % kTPR;
  if (row >= a.n) return;  // whole warps (kTPR = kThreads: the dx blocks are exactly n)
  const int64_t c = a.c;
  const T* xr = a.x + row * c;
  const T* dyr = a.dy + row * c;
  float dot = 0;  // sum_c (w*dy) * x
  for (int64_t j = t; j < c; j += kTPR) dot += to_float(a.w[j]) * to_float(dyr[j]) * to_float(xr[j]);
  dot = row_sum<kTPR>(dot);
  const float r = a.rstd[row];
  const float k = dot * r * r * r / static_cast<float>(c);
  T* dxr = a.dx + row * c;
  for (int64_t j = t; j < c; j += kTPR) {
    const T g = from_float<T>(r * (to_float(a.w[j]) * to_float(dyr[j])) - to_float(xr[j]) * k);
    if constexpr (kAdd)
      dxr[j] = from_float<T>(to_float(dxr[j]) + to_float(g));
    else
      dxr[j] = g;
  }
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

// rmsnorm_forward (kAdd false: a, h, h2 null) and add_rmsnorm_forward after the checks.
template <bool kAdd>
void launch_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& a_NC, const Tensor& w_C, double eps,
                    const Tensor& h_NC, const Tensor& h2_NC, const Tensor& y_NC, const Tensor& rstd_N) {
  const int64_t n = x_NC.size(0), c = x_NC.size(1);
  if (n == 0) return;
  dispatch_cuda_float(x_NC.dtype(), [&]<class T>() {
    dispatch_param<T>(w_C.dtype(), [&]<class W>() {
      const T* x = x_NC.ptr<T>();
      const T* a = kAdd ? a_NC.ptr<T>() : nullptr;
      T* h = kAdd ? h_NC.ptr<T>() : nullptr;
      T* h2 = h2_NC.defined() ? h2_NC.ptr<T>() : nullptr;
      const W* w = w_C.ptr<W>();
      T* y = y_NC.ptr<T>();
      float* rstd = rstd_N.ptr<float>();
      const auto e = static_cast<float>(eps);
      if (c <= kWarpRowMaxC)
        rmsnorm_forward_kernel<32, kAdd, T, W>
            <<<static_cast<unsigned>(ceil_div(n, kThreads / 32)), kThreads, 0, stream_of(ctx)>>>(x, a, w, e, h, h2, y,
                                                                                                 rstd, n, c);
      else
        rmsnorm_forward_kernel<kThreads, kAdd, T, W>
            <<<static_cast<unsigned>(n), kThreads, 0, stream_of(ctx)>>>(x, a, w, e, h, h2, y, rstd, n, c);
    });
  });
  MF_CUDA_LAUNCHED(kAdd ? "add_rmsnorm_forward" : "rmsnorm_forward");
}

// rmsnorm_backward (kAdd: rmsnorm_backward_add) after the checks.
template <bool kAdd>
void launch_backward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                     const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C, const char* what) {
  check_like(dy_NC, x_NC, what);
  check_like(dx_NC, x_NC, what);
  check_cuda_tensor(dw_C, what);
  check_shape(dw_C, w_C.shape(), what);
  MF_CHECK(dw_C.dtype() == x_NC.dtype() || dw_C.dtype() == DType::f32, what, ": dw ", dw_C.str(),
           " must have x's dtype or f32");
  // Other blocks still read x, dy, w, rstd while a block writes dx; dw is read-modify-written.
  for (const Tensor* t : {&x_NC, &w_C, &rstd_N, &dy_NC, &dw_C})
    MF_CHECK(!overlaps(dx_NC, *t), what, ": dx ", dx_NC.str(), " overlaps an input or dw ", t->str());
  const int64_t n = x_NC.size(0), c = x_NC.size(1);
  if (n == 0) return;

  // Chunks of rows for dw: enough dw blocks to fill the GPU (8 per SM), at least kMinRowsPerChunk
  // rows each, at most kMaxChunks.
  const int64_t tiles = ceil_div(c, kTileCols);
  int64_t chunks =
      std::min({ceil_div(8 * static_cast<int64_t>(sm_count()), tiles), ceil_div(n, kMinRowsPerChunk), kMaxChunks});
  chunks = std::max<int64_t>(chunks, 1);
  const int64_t rows_per_chunk = ceil_div(n, chunks);
  chunks = ceil_div(n, rows_per_chunk);
  float* partial =
      chunks > 1
          ? static_cast<float*>(ctx.scratch(ScratchSlot::rmsnorm_dw, static_cast<size_t>(chunks * c) * sizeof(float)))
          : nullptr;
  auto* arrived =
      chunks > 1
          ? static_cast<unsigned*>(ctx.scratch(ScratchSlot::arrivals, static_cast<size_t>(tiles) * sizeof(unsigned)))
          : nullptr;
  const bool warp_rows = c <= kWarpRowMaxC;
  const int64_t dx_blocks = warp_rows ? ceil_div(n, kThreads / 32) : n;
  const auto blocks = static_cast<unsigned>(dx_blocks + tiles * chunks);

  dispatch_cuda_float(x_NC.dtype(), [&]<class T>() {
    dispatch_param<T>(w_C.dtype(), [&]<class W>() {
      dispatch_param<T>(dw_C.dtype(), [&]<class G>() {
        const BackwardArgs<T, W, G> a{
            x_NC.ptr<T>(), w_C.ptr<W>(), rstd_N.ptr<float>(), dy_NC.ptr<T>(), dx_NC.ptr<T>(), dw_C.ptr<G>(), n, c,
            tiles,         chunks,       rows_per_chunk,      partial,        arrived};
        if (warp_rows)
          rmsnorm_backward_kernel<32, kAdd, T, W, G><<<blocks, kThreads, 0, stream_of(ctx)>>>(a);
        else
          rmsnorm_backward_kernel<kThreads, kAdd, T, W, G><<<blocks, kThreads, 0, stream_of(ctx)>>>(a);
      });
    });
  });
  MF_CUDA_LAUNCHED(what);
}

}  // namespace

void rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, double eps, const Tensor& y_NC,
                     const Tensor& rstd_N) {
  check_rmsnorm(x_NC, w_C, rstd_N, "rmsnorm_forward");
  check_like(y_NC, x_NC, "rmsnorm_forward y");
  launch_forward<false>(ctx, x_NC, Tensor{}, w_C, eps, Tensor{}, Tensor{}, y_NC, rstd_N);
}

void add_rmsnorm_forward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& a_NC, const Tensor& w_C, double eps,
                         const Tensor& h_NC, const Tensor& y_NC, const Tensor& rstd_N, const Tensor& h2_NC) {
  const char* what = "add_rmsnorm_forward";
  check_rmsnorm(x_NC, w_C, rstd_N, what);
  for (const Tensor* t : {&a_NC, &h_NC, &y_NC}) check_like(*t, x_NC, what);
  if (h2_NC.defined()) check_like(h2_NC, x_NC, what);
  // y is written after the row's h is read back; h2 is written beside h.
  for (const Tensor* t : {&h_NC, &h2_NC, &x_NC, &a_NC})
    MF_CHECK(!t->defined() || !overlaps(y_NC, *t), what, ": y ", y_NC.str(), " overlaps ", t->str());
  MF_CHECK(!h2_NC.defined() || !overlaps(h_NC, h2_NC), what, ": h ", h_NC.str(), " overlaps h2 ", h2_NC.str());
  launch_forward<true>(ctx, x_NC, a_NC, w_C, eps, h_NC, h2_NC, y_NC, rstd_N);
}

void rmsnorm_backward(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                      const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C) {
  check_rmsnorm(x_NC, w_C, rstd_N, "rmsnorm_backward");
  launch_backward<false>(ctx, x_NC, w_C, rstd_N, dy_NC, dx_NC, dw_C, "rmsnorm_backward");
}

void rmsnorm_backward_add(const ExecContext& ctx, const Tensor& x_NC, const Tensor& w_C, const Tensor& rstd_N,
                          const Tensor& dy_NC, const Tensor& dx_NC, const Tensor& dw_C) {
  check_rmsnorm(x_NC, w_C, rstd_N, "rmsnorm_backward_add");
  launch_backward<true>(ctx, x_NC, w_C, rstd_N, dy_NC, dx_NC, dw_C, "rmsnorm_backward_add");
}

}  // namespace moefold::cuda
