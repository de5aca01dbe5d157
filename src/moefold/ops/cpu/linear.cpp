// Linear layer without bias, PyTorch weight layout: y_NO = x_NI @ w_OI^T, all through gemm; and
// matmul, copies and fills on matrix views. CUDA tensors go to ops/cuda/gemm.cu (cuBLASLt) and
// ops/cuda/matrix.cu.
// Gradient rule: dx = dy @ w (WRITTEN, skipped when dx is undefined); dw += dy^T @ x (ACCUMULATED).
#include <algorithm>
#include <cstring>

#include "moefold/ops/dispatch.h"
#include "moefold/ops/gemm.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/gemm.h"
#include "moefold/ops/cuda/matrix.h"
#endif

namespace moefold {

namespace {
void check_linear(const Tensor& x, const Tensor& w, const Tensor& y, const char* what) {
  MF_CHECK(x.ndim() == 2 && w.ndim() == 2 && x.size(1) == w.size(1), what, ": x ", x.str(), ", w ", w.str());
  check_shape(y, {x.size(0), w.size(0)}, what);
  MF_CHECK(x.dtype() == w.dtype() && y.dtype() == w.dtype(), what, ": dtypes ", x.str(), " ", w.str(), " ", y.str());
  MF_CHECK(x.contiguous() && w.contiguous() && y.contiguous(), what, ": not contiguous");
  MF_CHECK(x.device() == Device::cpu && w.device() == Device::cpu && y.device() == Device::cpu, what);
}
void check_like(const Tensor& t, const Tensor& ref, const char* what) {
  check_shape(t, ref.shape(), what);
  MF_CHECK(t.contiguous() && t.dtype() == ref.dtype() && t.device() == Device::cpu, what, ": ", t.str());
}
}  // namespace

void linear_forward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO) {
  MF_ON_GPU(ctx, x_NI, cuda::linear_forward(ctx, x_NI, w_OI, y_NO));
  check_linear(x_NI, w_OI, y_NO, "linear_forward");
  const int64_t n = x_NI.size(0), in = x_NI.size(1), out = w_OI.size(0);
  dispatch_float(x_NI.dtype(), [&]<class T>() {
    gemm<T>(false, true, n, out, in, T(1), x_NI.ptr<T>(), in, w_OI.ptr<T>(), in, T(0), y_NO.ptr<T>(), out);
  });
}

void linear_backward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO,
                     const Tensor& dx_NI, const Tensor& dw_OI) {
  MF_ON_GPU(ctx, x_NI, cuda::linear_backward(ctx, x_NI, w_OI, dy_NO, dx_NI, dw_OI));
  check_linear(x_NI, w_OI, dy_NO, "linear_backward");
  if (dx_NI.defined()) check_like(dx_NI, x_NI, "linear_backward dx");
  check_like(dw_OI, w_OI, "linear_backward dw");
  const int64_t n = x_NI.size(0), in = x_NI.size(1), out = w_OI.size(0);
  dispatch_float(x_NI.dtype(), [&]<class T>() {
    const T* dy = dy_NO.ptr<T>();
    if (dx_NI.defined()) gemm<T>(false, false, n, in, out, T(1), dy, out, w_OI.ptr<T>(), in, T(0), dx_NI.ptr<T>(), in);
    gemm<T>(true, false, out, in, n, T(1), dy, out, x_NI.ptr<T>(), in, T(1), dw_OI.ptr<T>(), in);
  });
}

MatrixView as_matrix(const Tensor& t_RC) {
  MF_CHECK(t_RC.ndim() == 2 && t_RC.contiguous(), "as_matrix: ", t_RC.str(), " must be a contiguous 2-D tensor");
  return MatrixView{t_RC, t_RC.size(0), t_RC.size(1), std::max<int64_t>(1, t_RC.size(1)), 0};
}

MatrixView column_block(const Tensor& t_RC, int64_t begin, int64_t end) {
  MF_CHECK(t_RC.ndim() == 2 && t_RC.contiguous() && 0 <= begin && begin <= end && end <= t_RC.size(1), "column_block [",
           begin, ", ", end, ") of ", t_RC.str());
  return MatrixView{t_RC, t_RC.size(0), end - begin, std::max<int64_t>(1, t_RC.size(1)), begin};
}

namespace {
void check_view(const MatrixView& v, const char* what) {
  MF_CHECK(v.storage.contiguous(), what, ": storage ", v.storage.str(), " is not contiguous");
  MF_CHECK(v.rows >= 0 && v.cols >= 0 && v.ld >= std::max<int64_t>(1, v.cols) && v.offset >= 0, what, ": ", v.rows,
           " x ", v.cols, " with ld ", v.ld, " at offset ", v.offset);
  MF_CHECK(v.rows == 0 || v.cols == 0 || v.offset + (v.rows - 1) * v.ld + v.cols <= v.storage.numel(), what, ": ",
           v.rows, " x ", v.cols, " with ld ", v.ld, " at offset ", v.offset, " overruns ", v.storage.str());
}

// Whether two views may share an element. Views with the same ld and no row wrapping are rectangles
// of one [*, ld] grid (the halves of gu_N2F do not overlap); otherwise their address ranges decide.
bool may_overlap(const MatrixView& x, const MatrixView& y) {
  if (x.rows == 0 || x.cols == 0 || y.rows == 0 || y.cols == 0) return false;
  const size_t bytes_x = dtype_size(x.storage.dtype()), bytes_y = dtype_size(y.storage.dtype());
  const auto* bx = static_cast<const char*>(x.storage.data()) + x.offset * static_cast<int64_t>(bytes_x);
  const auto* by = static_cast<const char*>(y.storage.data()) + y.offset * static_cast<int64_t>(bytes_y);
  const auto* ex = bx + ((x.rows - 1) * x.ld + x.cols) * static_cast<int64_t>(bytes_x);
  const auto* ey = by + ((y.rows - 1) * y.ld + y.cols) * static_cast<int64_t>(bytes_y);
  if (ex <= by || ey <= bx) return false;
  if (x.storage.data() != y.storage.data() || x.ld != y.ld || bytes_x != bytes_y) return true;
  const int64_t cx = x.offset % x.ld, cy = y.offset % y.ld;
  if (cx + x.cols > x.ld || cy + y.cols > y.ld) return true;  // rows wrap: be conservative
  return cx < cy + y.cols && cy < cx + x.cols;                // the address ranges meet, so the rows do
}
}  // namespace

namespace {
// Two views of one shape, dtype and device that do not overlap (copy_matrix, add_matrix).
void check_pair(const MatrixView& src, const MatrixView& dst, const char* what) {
  check_view(src, what);
  check_view(dst, what);
  MF_CHECK(src.rows == dst.rows && src.cols == dst.cols && src.storage.dtype() == dst.storage.dtype() &&
               src.storage.device() == dst.storage.device() && !may_overlap(src, dst),
           what, ": ", src.rows, " x ", src.cols, " ", src.storage.str(), " -> ", dst.rows, " x ", dst.cols, " ",
           dst.storage.str());
}
}  // namespace

void copy_matrix(const ExecContext& ctx, const MatrixView& src, const MatrixView& dst) {
  check_pair(src, dst, "copy_matrix");
  MF_ON_GPU(ctx, dst.storage, cuda::copy_matrix(ctx, src, dst));
  const size_t e = dtype_size(src.storage.dtype());
  const auto* s = static_cast<const char*>(src.storage.data());
  auto* d = static_cast<char*>(dst.storage.data());
  for (int64_t i = 0; i < src.rows; ++i)
    std::memcpy(d + (dst.offset + i * dst.ld) * e, s + (src.offset + i * src.ld) * e, src.cols * e);
}

void add_matrix(const ExecContext& ctx, const MatrixView& src, const MatrixView& dst) {
  check_pair(src, dst, "add_matrix");
  MF_ON_GPU(ctx, dst.storage, cuda::add_matrix(ctx, src, dst));
  dispatch_float(src.storage.dtype(), [&]<class T>() {
    const T* s = src.storage.ptr<T>() + src.offset;
    T* d = dst.storage.ptr<T>() + dst.offset;
    for (int64_t i = 0; i < src.rows; ++i)
      for (int64_t j = 0; j < src.cols; ++j) d[i * dst.ld + j] += s[i * src.ld + j];
  });
}

void fill_matrix(const ExecContext& ctx, const MatrixView& dst, double value) {
  check_view(dst, "fill_matrix");
  MF_ON_GPU(ctx, dst.storage, cuda::fill_matrix(ctx, dst, value));
  auto fill = [&]<class T>() {
    T* d = dst.storage.ptr<T>() + dst.offset;
    for (int64_t i = 0; i < dst.rows; ++i)
      for (int64_t j = 0; j < dst.cols; ++j) d[i * dst.ld + j] = static_cast<T>(value);
  };
  if (dst.storage.dtype() == DType::i32)
    fill.template operator()<int32_t>();
  else if (dst.storage.dtype() == DType::i64)
    fill.template operator()<int64_t>();
  else
    dispatch_float(dst.storage.dtype(), fill);
}

void matmul(const ExecContext& ctx, const MatrixView& a, bool trans_a, const MatrixView& b, bool trans_b,
            const MatrixView& c, double alpha, double beta) {
  check_view(a, "matmul a");
  check_view(b, "matmul b");
  check_view(c, "matmul c");
  const int64_t m = trans_a ? a.cols : a.rows, k = trans_a ? a.rows : a.cols;
  const int64_t n = trans_b ? b.rows : b.cols, kb = trans_b ? b.cols : b.rows;
  MF_CHECK(kb == k && c.rows == m && c.cols == n, "matmul: op(a) ", m, " x ", k, ", op(b) ", kb, " x ", n, ", c ",
           c.rows, " x ", c.cols);
  const Device dev = c.storage.device();
  MF_CHECK(a.storage.device() == dev && b.storage.device() == dev, "matmul: a, b and c on different devices");
  MF_CHECK(!may_overlap(c, a) && !may_overlap(c, b), "matmul: c overlaps a or b");
  MF_ON_GPU(ctx, c.storage, cuda::matmul(ctx, a, trans_a, b, trans_b, c, alpha, beta));
  MF_CHECK(a.storage.dtype() == c.storage.dtype() && b.storage.dtype() == c.storage.dtype(), "matmul: dtypes ",
           a.storage.str(), " ", b.storage.str(), " ", c.storage.str());
  dispatch_float(c.storage.dtype(), [&]<class T>() {
    gemm<T>(trans_a, trans_b, m, n, k, static_cast<T>(alpha), a.storage.ptr<T>() + a.offset, a.ld,
            b.storage.ptr<T>() + b.offset, b.ld, static_cast<T>(beta), c.storage.ptr<T>() + c.offset, c.ld);
  });
}

}  // namespace moefold
