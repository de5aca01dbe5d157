// CPU reference of permute and combine (moe_ops.h), forward and backward: tokens to expert rows
// and the prob-weighted sum back, in the tensors' dtype. Gradient rule: drows, dx, dout, dprob
// WRITTEN. CUDA tensors go to ops/cuda/permute.cu.
#include <algorithm>

#include "moefold/ops/cpu/moe_common.h"
#include "moefold/ops/dispatch.h"
#include "moefold/ops/moe_ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/permute.h"
#endif

namespace moefold {

namespace {
void check_rows(const Tensor& rows_RH, const Tensor& x_TH, const char* what) {
  check_2d(rows_RH, what);
  check_2d(x_TH, what);
  check_same_dtype(rows_RH, x_TH, what);
  MF_CHECK(rows_RH.size(1) == x_TH.size(1), what, ": rows ", rows_RH.str(), ", tokens ", x_TH.str());
}
void check_row_map(const Tensor& row_TK, int64_t t_n, const char* what) {
  check_2d(row_TK, what);
  check_dtype(row_TK, DType::i64, what);
  MF_CHECK(row_TK.size(0) == t_n, what, ": ", row_TK.str(), " for ", t_n, " tokens");
}
}  // namespace

void moe_permute(const ExecContext& ctx, const Tensor& x_TH, const Tensor& token_R, const Tensor& rows_RH) {
  check_rows(rows_RH, x_TH, "moe_permute");
  if (x_TH.dtype() == DType::u8) {  // bytes (packed FP8 rows, ops/fp8.h): moved as f32 words, bit for bit
    const int64_t w = x_TH.size(1);
    MF_CHECK(w % 4 == 0 && x_TH.contiguous() && rows_RH.contiguous(), "moe_permute: byte rows ", x_TH.str(),
             " (contiguous, a multiple of 4 wide)");
    return moe_permute(ctx, Tensor(x_TH.data(), DType::f32, {x_TH.size(0), w / 4}, x_TH.device()), token_R,
                       Tensor(rows_RH.data(), DType::f32, {rows_RH.size(0), w / 4}, rows_RH.device()));
  }
  check_dtype(token_R, DType::i64, "moe_permute token");
  const int64_t r_n = rows_RH.size(0), h_n = rows_RH.size(1), t_n = x_TH.size(0);
  MF_CHECK(token_R.contiguous() && token_R.numel() >= r_n, "moe_permute: token ", token_R.str(), " for ", r_n, " rows");
  MF_ON_GPU(ctx, x_TH, cuda::moe_permute(ctx, x_TH, token_R, rows_RH));
  check_on_cpu(rows_RH, "moe_permute");
  check_on_cpu(x_TH, "moe_permute");
  const int64_t* token = token_R.ptr<int64_t>();
  dispatch_float(x_TH.dtype(), [&]<class T>() {
    const T* x = x_TH.ptr<T>();
    T* rows = rows_RH.ptr<T>();
    for (int64_t r = 0; r < r_n; ++r) {
      const int64_t t = token[r];
      MF_CHECK(t >= -1 && t < t_n, "row ", r, " reads token ", t, " of ", t_n);
      if (t < 0)
        std::fill(rows + r * h_n, rows + (r + 1) * h_n, T(0));
      else
        std::copy(x + t * h_n, x + (t + 1) * h_n, rows + r * h_n);
    }
  });
}

void moe_permute_backward(const ExecContext& ctx, const Tensor& drows_RH, const Tensor& row_TK, const Tensor& dx_TH) {
  check_rows(drows_RH, dx_TH, "moe_permute_backward");
  check_row_map(row_TK, dx_TH.size(0), "moe_permute_backward row");
  MF_ON_GPU(ctx, drows_RH, cuda::moe_permute_backward(ctx, drows_RH, row_TK, dx_TH));
  check_on_cpu(drows_RH, "moe_permute_backward");
  check_on_cpu(dx_TH, "moe_permute_backward");
  check_on_cpu(row_TK, "moe_permute_backward row");
  const int64_t t_n = dx_TH.size(0), h_n = dx_TH.size(1), k_n = row_TK.size(1), r_n = drows_RH.size(0);
  const int64_t* row = row_TK.ptr<int64_t>();
  dispatch_float(dx_TH.dtype(), [&]<class T>() {
    const T* drows = drows_RH.ptr<T>();
    T* dx = dx_TH.ptr<T>();
    for (int64_t t = 0; t < t_n; ++t) {
      T* d = dx + t * h_n;
      std::fill(d, d + h_n, T(0));
      for (int64_t k = 0; k < k_n; ++k) {
        const int64_t r = row[t * k_n + k];
        if (r < 0) continue;
        MF_CHECK(r < r_n, "row ", r, " of ", r_n);
        for (int64_t h = 0; h < h_n; ++h) d[h] += drows[r * h_n + h];
      }
    }
  });
}

// ---- combine -----------------------------------------------------------------------------------

void moe_combine(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                 const Tensor& y_TH) {
  check_rows(out_RH, y_TH, "moe_combine");
  check_row_map(row_TK, y_TH.size(0), "moe_combine row");
  check_shape(prob_TK, row_TK.shape(), "moe_combine prob");
  MF_ON_GPU(ctx, out_RH, cuda::moe_combine(ctx, out_RH, row_TK, prob_TK, y_TH));
  check_on_cpu(out_RH, "moe_combine");
  check_on_cpu(y_TH, "moe_combine");
  check_on_cpu(row_TK, "moe_combine row");
  check_same_dtype(prob_TK, y_TH, "moe_combine prob");
  const int64_t t_n = y_TH.size(0), h_n = y_TH.size(1), k_n = row_TK.size(1), r_n = out_RH.size(0);
  const int64_t* row = row_TK.ptr<int64_t>();
  dispatch_float(y_TH.dtype(), [&]<class T>() {
    const T* out = out_RH.ptr<T>();
    const T* prob = prob_TK.ptr<T>();
    T* y = y_TH.ptr<T>();
    for (int64_t t = 0; t < t_n; ++t) {
      T* yt = y + t * h_n;
      std::fill(yt, yt + h_n, T(0));
      for (int64_t k = 0; k < k_n; ++k) {
        const int64_t r = row[t * k_n + k];
        if (r < 0) continue;
        MF_CHECK(r < r_n, "row ", r, " of ", r_n);
        const T p = prob[t * k_n + k];
        for (int64_t h = 0; h < h_n; ++h) yt[h] += p * out[r * h_n + h];
      }
    }
  });
}

void moe_combine_backward(const ExecContext& ctx, const Tensor& out_RH, const Tensor& row_TK, const Tensor& prob_TK,
                          const Tensor& token_R, const Tensor& dy_TH, const Tensor& dout_RH, const Tensor& dprob_TK) {
  check_rows(out_RH, dy_TH, "moe_combine_backward");
  check_row_map(row_TK, dy_TH.size(0), "moe_combine_backward row");
  check_shape(prob_TK, row_TK.shape(), "moe_combine_backward prob");
  check_shape(dprob_TK, row_TK.shape(), "moe_combine_backward dprob");
  check_shape(dout_RH, out_RH.shape(), "moe_combine_backward dout");
  check_same_dtype(dout_RH, dy_TH, "moe_combine_backward dout");
  check_dtype(token_R, DType::i64, "moe_combine_backward token");
  MF_CHECK(token_R.ndim() == 1 && token_R.numel() >= out_RH.size(0), "moe_combine_backward: token_R ", token_R.str(),
           " for ", out_RH.size(0), " rows");
  MF_ON_GPU(ctx, out_RH, cuda::moe_combine_backward(ctx, out_RH, row_TK, prob_TK, token_R, dy_TH, dout_RH, dprob_TK));
  check_on_cpu(out_RH, "moe_combine_backward");
  check_on_cpu(dy_TH, "moe_combine_backward");
  check_on_cpu(row_TK, "moe_combine_backward row");
  check_on_cpu(token_R, "moe_combine_backward token");
  // The combine weights take the rows' dtype on the CPU (CUDA: f32 whatever that dtype is).
  check_same_dtype(prob_TK, dy_TH, "moe_combine_backward prob");
  check_same_dtype(dprob_TK, dy_TH, "moe_combine_backward dprob");
  const int64_t t_n = dy_TH.size(0), h_n = dy_TH.size(1), k_n = row_TK.size(1), r_n = out_RH.size(0);
  const int64_t* row = row_TK.ptr<int64_t>();
  dispatch_float(dy_TH.dtype(), [&]<class T>() {
    const T* out = out_RH.ptr<T>();
    const T* prob = prob_TK.ptr<T>();
    const T* dy = dy_TH.ptr<T>();
    T* dout = dout_RH.ptr<T>();
    T* dprob = dprob_TK.ptr<T>();
    const int64_t* token = token_R.ptr<int64_t>();
    for (int64_t r = 0; r < r_n; ++r)  // padding rows get no gradient; the others are written below
      if (token[r] < 0) std::fill(dout + r * h_n, dout + (r + 1) * h_n, T(0));
    for (int64_t t = 0; t < t_n; ++t) {
      const T* dyt = dy + t * h_n;
      for (int64_t k = 0; k < k_n; ++k) {
        const int64_t r = row[t * k_n + k];
        T dp = 0;
        if (r >= 0) {
          MF_CHECK(r < r_n, "row ", r, " of ", r_n);
          const T p = prob[t * k_n + k];
          for (int64_t h = 0; h < h_n; ++h) {
            dp += dyt[h] * out[r * h_n + h];
            dout[r * h_n + h] = p * dyt[h];
          }
        }
        dprob[t * k_n + k] = dp;
      }
    }
  });
}

}  // namespace moefold
