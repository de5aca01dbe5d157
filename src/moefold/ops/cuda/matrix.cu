// CUDA matrix-view copies (2-D memcpy), sums and fills; see matrix.h.
#include <algorithm>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/matrix.h"

namespace moefold::cuda {

namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>(ceil_div(n, kThreads), 65535 * 8)); }

template <class T>
__global__ void add_kernel(const T* src, int64_t sld, T* dst, int64_t dld, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    dst[r * dld + c] = from_float<T>(to_float(dst[r * dld + c]) + to_float(src[r * sld + c]));
  }
}

template <class T>
__global__ void fill_kernel(T* dst, int64_t ld, int64_t rows, int64_t cols, T value) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i - r * cols;
    dst[r * ld + c] = value;
  }
}

}  // namespace

void copy_matrix(const ExecContext& ctx, const MatrixView& src, const MatrixView& dst) {
  if (src.rows == 0 || src.cols == 0) return;
  const size_t e = dtype_size(src.storage.dtype());
  MF_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst.storage.data()) + dst.offset * e, dst.ld * e,
                                  static_cast<const char*>(src.storage.data()) + src.offset * e, src.ld * e,
                                  src.cols * e, src.rows, cudaMemcpyDeviceToDevice, stream_of(ctx)));
}

void add_matrix(const ExecContext& ctx, const MatrixView& src, const MatrixView& dst) {
  const int64_t n = src.rows * src.cols;
  if (n == 0) return;
  dispatch_cuda_float(src.storage.dtype(), [&]<class T>() {
    add_kernel<T><<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(
        src.storage.ptr<T>() + src.offset, src.ld, dst.storage.ptr<T>() + dst.offset, dst.ld, src.rows, src.cols);
  });
  MF_CUDA_LAUNCHED("add_matrix");
}

void fill_matrix(const ExecContext& ctx, const MatrixView& dst, double value) {
  const int64_t n = dst.rows * dst.cols;
  if (n == 0) return;
  auto launch = [&]<class T>(T v) {
    fill_kernel<T><<<blocks_for(n), kThreads, 0, stream_of(ctx)>>>(dst.storage.ptr<T>() + dst.offset, dst.ld, dst.rows,
                                                                   dst.cols, v);
  };
  switch (dst.storage.dtype()) {
    case DType::i32:
      launch(static_cast<int32_t>(value));
      break;
    case DType::i64:
      launch(static_cast<int64_t>(value));
      break;
    case DType::f32:
      launch(static_cast<float>(value));
      break;
    case DType::bf16:
      launch(__float2bfloat16_rn(static_cast<float>(value)));
      break;
    default:
      MF_FAIL("fill_matrix: dtype ", dtype_name(dst.storage.dtype()));
  }
  MF_CUDA_LAUNCHED("fill_matrix");
}

}  // namespace moefold::cuda
