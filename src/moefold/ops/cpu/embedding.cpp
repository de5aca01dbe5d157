// Token embedding lookup: out_NC[n] = table_VC[ids_N[n]].
// Gradient rule: dtable is a parameter gradient, ACCUMULATED (+=; repeated ids add up).
// CUDA tensors go to ops/cuda/embedding.cu.
#include "moefold/ops/dispatch.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/embedding.h"
#endif

namespace moefold {

namespace {
void check_embedding(const Tensor& ids, const Tensor& table, const Tensor& rows, const char* what) {
  MF_CHECK(ids.ndim() == 1 && ids.dtype() == DType::i32 && ids.contiguous(), what, ": ids ", ids.str());
  MF_CHECK(table.ndim() == 2 && table.contiguous(), what, ": table ", table.str());
  check_shape(rows, {ids.size(0), table.size(1)}, what);
  MF_CHECK(rows.contiguous() && rows.dtype() == table.dtype(), what, ": ", rows.str(), " vs table ", table.str());
  MF_CHECK(ids.device() == Device::cpu && table.device() == Device::cpu && rows.device() == Device::cpu, what);
}
}  // namespace

void embedding_forward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& table_VC, const Tensor& out_NC) {
  MF_ON_GPU(ctx, table_VC, cuda::embedding_forward(ctx, ids_N, table_VC, out_NC));
  check_embedding(ids_N, table_VC, out_NC, "embedding_forward");
  const int64_t n = ids_N.size(0), v = table_VC.size(0), c = table_VC.size(1);
  const int32_t* ids = ids_N.ptr<int32_t>();
  dispatch_float(table_VC.dtype(), [&]<class T>() {
    const T* table = table_VC.ptr<T>();
    T* out = out_NC.ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      MF_CHECK(ids[i] >= 0 && ids[i] < v, "embedding_forward: id ", ids[i], " at ", i, " outside [0, ", v, ")");
      const T* row = table + ids[i] * c;
      for (int64_t j = 0; j < c; ++j) out[i * c + j] = row[j];
    }
  });
}

void embedding_backward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& dout_NC, const Tensor& dtable_VC) {
  MF_ON_GPU(ctx, dtable_VC, cuda::embedding_backward(ctx, ids_N, dout_NC, dtable_VC));
  check_embedding(ids_N, dtable_VC, dout_NC, "embedding_backward");
  const int64_t n = ids_N.size(0), v = dtable_VC.size(0), c = dtable_VC.size(1);
  const int32_t* ids = ids_N.ptr<int32_t>();
  dispatch_float(dtable_VC.dtype(), [&]<class T>() {
    const T* dout = dout_NC.ptr<T>();
    T* dtable = dtable_VC.ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      MF_CHECK(ids[i] >= 0 && ids[i] < v, "embedding_backward: id ", ids[i], " at ", i, " outside [0, ", v, ")");
      T* row = dtable + ids[i] * c;
      for (int64_t j = 0; j < c; ++j) row[j] += dout[i * c + j];
    }
  });
}

}  // namespace moefold
