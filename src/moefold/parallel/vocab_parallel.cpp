// Vocabulary-parallel embedding and cross-entropy (see vocab_parallel.h): the CPU shard-local
// loops, and the forward's two packed all-reduces between its phases. Gradient rules: dtable
// ACCUMULATED, dlogits WRITTEN. The checks are device-agnostic; CUDA tensors then go to the shard
// ops of ops/cuda/cross_entropy.cu (the cross-entropy's phases) and ops/cuda/embedding.cu.
#include "moefold/parallel/vocab_parallel.h"

#include <algorithm>
#include <cmath>

#include "moefold/core/error.h"
#include "moefold/ops/dispatch.h"
#include "moefold/ops/ops.h"
#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/cross_entropy.h"
#include "moefold/ops/cuda/embedding.h"
#endif

namespace moefold {

namespace {
// Whether the tensors of a call are CUDA tensors (the checks have put them all on one device).
bool on_gpu(const Tensor& t) {
#ifdef MOEFOLD_WITH_CUDA
  return t.device() == Device::cuda;
#else
  MF_CHECK(t.device() == Device::cpu, "vocab_parallel: ", t.str(), " on a GPU in a build without CUDA");
  return false;
#endif
}

bool cuda_float(DType d) { return d == DType::f32 || d == DType::bf16; }

// rows: out_partial (forward) or dout (backward); table: the table or dtable shard.
void check_embedding(const Tensor& ids, const Tensor& table, const Tensor& rows, int64_t vocab_offset, bool backward,
                     const char* what) {
  MF_CHECK(ids.ndim() == 1 && ids.dtype() == DType::i32 && ids.contiguous(), what, ": ids ", ids.str());
  MF_CHECK(table.ndim() == 2 && table.contiguous(), what, ": table shard ", table.str());
  check_shape(rows, {ids.size(0), table.size(1)}, what);
  MF_CHECK(rows.contiguous(), what, ": ", rows.str(), " is not contiguous");
  MF_CHECK(ids.device() == table.device() && rows.device() == table.device(), what, ": ids ", ids.str(), ", table ",
           table.str(), " and rows ", rows.str(), " on different devices");
  if (on_gpu(table)) {
    // Mixed precision: the backward adds bf16 rows into the f32 master gradient.
    const bool ok =
        cuda_float(rows.dtype()) && (rows.dtype() == table.dtype() || (backward && table.dtype() == DType::f32));
    MF_CHECK(ok, what, ": ", rows.str(), " vs table shard ", table.str(),
             backward ? " (CUDA: dout f32 or bf16, dtable of its dtype or f32)" : " (CUDA: one dtype, f32 or bf16)");
  } else {
    MF_CHECK(rows.dtype() == table.dtype(), what, ": ", rows.str(), " vs table shard ", table.str());
  }
  MF_CHECK(vocab_offset >= 0, what, ": vocab_offset ", vocab_offset);
}

void check_ce(const Tensor& logits, const Tensor& targets, const Tensor& lse, int64_t vocab_offset, const char* what) {
  MF_CHECK(logits.ndim() == 2 && logits.contiguous(), what, ": logits shard ", logits.str());
  MF_CHECK(logits.size(1) > 0, what, ": empty vocabulary shard ", logits.str());
  check_shape(targets, {logits.size(0)}, what);
  check_shape(lse, {logits.size(0)}, what);
  MF_CHECK(targets.dtype() == DType::i32 && targets.contiguous() && targets.device() == logits.device(), what,
           ": targets ", targets.str(), " vs logits shard ", logits.str());
  MF_CHECK(lse.contiguous() && lse.device() == logits.device(), what, ": lse ", lse.str());
  if (on_gpu(logits)) {
    MF_CHECK(cuda_float(logits.dtype()), what, ": logits shard ", logits.str(), " (CUDA: f32 or bf16)");
    MF_CHECK(lse.dtype() == DType::f32, what, ": lse ", lse.str(), " (CUDA: f32)");
  } else {
    MF_CHECK(lse.dtype() == logits.dtype(), what, ": lse ", lse.str(), " vs logits shard ", logits.str());
  }
  MF_CHECK(vocab_offset >= 0, what, ": vocab_offset ", vocab_offset);
}

void check_found(Communicator& tp, double found, int64_t n, const char* what) {
  MF_CHECK(found == static_cast<double>(n), what, ": rank ", tp.rank(), " of group '", tp.name(), "': ", found, " of ",
           n, " targets fell inside a vocabulary shard (a target outside [0, V), or shards that overlap)");
}
}  // namespace

void vocab_parallel_embedding_forward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& table_shard_VlC,
                                      int64_t vocab_offset, const Tensor& out_partial_NC) {
  check_embedding(ids_N, table_shard_VlC, out_partial_NC, vocab_offset, false, "vocab_parallel_embedding_forward");
  MF_ON_GPU(ctx, ids_N, cuda::embedding_shard_forward(ctx, ids_N, table_shard_VlC, vocab_offset, out_partial_NC));
  const int64_t n = ids_N.size(0), vl = table_shard_VlC.size(0), c = table_shard_VlC.size(1);
  const int32_t* ids = ids_N.ptr<int32_t>();
  dispatch_float(table_shard_VlC.dtype(), [&]<class T>() {
    const T* table = table_shard_VlC.ptr<T>();
    T* out = out_partial_NC.ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      MF_CHECK(ids[i] >= 0, "vocab_parallel_embedding_forward: id ", ids[i], " at ", i, " is negative");
      const int64_t local = ids[i] - vocab_offset;
      T* dst = out + i * c;
      if (local < 0 || local >= vl) {
        for (int64_t j = 0; j < c; ++j) dst[j] = T(0);
        continue;
      }
      const T* row = table + local * c;
      for (int64_t j = 0; j < c; ++j) dst[j] = row[j];
    }
  });
}

void vocab_parallel_embedding_backward(const ExecContext& ctx, const Tensor& ids_N, const Tensor& dout_NC,
                                       int64_t vocab_offset, const Tensor& dtable_shard_VlC) {
  check_embedding(ids_N, dtable_shard_VlC, dout_NC, vocab_offset, true, "vocab_parallel_embedding_backward");
  MF_ON_GPU(ctx, ids_N, cuda::embedding_shard_backward(ctx, ids_N, dout_NC, vocab_offset, dtable_shard_VlC));
  const int64_t n = ids_N.size(0), vl = dtable_shard_VlC.size(0), c = dtable_shard_VlC.size(1);
  const int32_t* ids = ids_N.ptr<int32_t>();
  dispatch_float(dtable_shard_VlC.dtype(), [&]<class T>() {
    const T* dout = dout_NC.ptr<T>();
    T* dtable = dtable_shard_VlC.ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      MF_CHECK(ids[i] >= 0, "vocab_parallel_embedding_backward: id ", ids[i], " at ", i, " is negative");
      const int64_t local = ids[i] - vocab_offset;
      if (local < 0 || local >= vl) continue;
      T* row = dtable + local * c;
      for (int64_t j = 0; j < c; ++j) row[j] += dout[i * c + j];
    }
  });
}

void VocabParallelScratch::bind(Memory& mem, int64_t rows) {
  MF_CHECK(rows > 0, "VocabParallelScratch::bind: max_rows ", rows);
  max_rows = rows;
  max_N = mem.act({rows}, DType::f64);
  sums_2N1 = mem.act({2 * rows + 1}, DType::f64);
  result_2 = mem.act({2}, DType::f64);
}

double vocab_parallel_cross_entropy_forward(const ExecContext& ctx, Communicator& tp, const Tensor& logits_shard_NVl,
                                            int64_t vocab_offset, const Tensor& targets_N, const Tensor& lse_N,
                                            const VocabParallelScratch& scratch) {
  const char* what = "vocab_parallel_cross_entropy_forward";
  check_ce(logits_shard_NVl, targets_N, lse_N, vocab_offset, what);
  const int64_t n = logits_shard_NVl.size(0), vl = logits_shard_NVl.size(1);
  MF_CHECK(n <= scratch.max_rows && scratch.max_N.numel() >= n && scratch.sums_2N1.numel() >= 2 * n + 1 &&
               scratch.result_2.numel() >= 2,
           what, ": ", n, " rows, scratch bound for ", scratch.max_rows);
  for (const Tensor* t : {&scratch.max_N, &scratch.sums_2N1, &scratch.result_2})
    MF_CHECK(t->dtype() == DType::f64 && t->contiguous() && t->device() == logits_shard_NVl.device(), what,
             ": scratch ", t->str(), " vs logits shard ", logits_shard_NVl.str());
  if (n == 0) return 0.0;
  const Tensor max_n = scratch.max_N.slice(0, n);
  const Tensor sums = scratch.sums_2N1.slice(0, 2 * n + 1);
  if (runs_on_gpu(ctx, logits_shard_NVl, what)) {
#ifdef MOEFOLD_WITH_CUDA
    // With one rank an all-reduce is the identity (and the self communicator takes host tensors only).
    const bool reduce = tp.size() > 1;
    cuda::cross_entropy_shard_row_max(ctx, logits_shard_NVl, max_n);
    if (reduce) tp.all_reduce(max_n, ReduceOp::max);
    cuda::cross_entropy_shard_sums(ctx, logits_shard_NVl, targets_N, max_n, vocab_offset, tp.rank() == 0, sums);
    if (reduce) tp.all_reduce(sums, ReduceOp::sum);
    const cuda::CrossEntropyShardTotals r =
        cuda::cross_entropy_shard_finish(ctx, targets_N, max_n, sums, lse_N, scratch.result_2);
    check_found(tp, r.found, n, what);
    return r.loss;
#endif
  }
  double* row_max = max_n.ptr<double>();
  double* sum_exp = sums.ptr<double>();  // [0, n): sum of exp; [n, 2n): target logit; [2n]: hits
  double* target_logit = sum_exp + n;
  const int32_t* targets = targets_N.ptr<int32_t>();
  return dispatch_float(logits_shard_NVl.dtype(), [&]<class T>() {
    const T* logits = logits_shard_NVl.ptr<T>();
    for (int64_t i = 0; i < n; ++i) {
      const T* row = logits + i * vl;
      double m = row[0];
      for (int64_t j = 1; j < vl; ++j) m = row[j] > m ? static_cast<double>(row[j]) : m;
      row_max[i] = m;
    }
    tp.all_reduce(max_n, ReduceOp::max);
    int64_t hits = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T* row = logits + i * vl;
      if (targets[i] == kIgnoreTarget) {  // counted as a hit on rank 0 only, so the check below holds
        sum_exp[i] = 1;
        target_logit[i] = 0;
        if (tp.rank() == 0) ++hits;
        continue;
      }
      MF_CHECK(targets[i] >= 0, what, ": target ", targets[i], " at ", i, " is negative");
      double s = 0;
      for (int64_t j = 0; j < vl; ++j) s += std::exp(static_cast<double>(row[j]) - row_max[i]);
      sum_exp[i] = s;
      const int64_t local = targets[i] - vocab_offset;
      // A one-hot pick: exactly one rank contributes a non-zero, so the sum is exact.
      target_logit[i] = 0;
      if (local >= 0 && local < vl) {
        target_logit[i] = static_cast<double>(row[local]);
        ++hits;
      }
    }
    sum_exp[2 * n] = static_cast<double>(hits);
    tp.all_reduce(sums, ReduceOp::sum);
    check_found(tp, sum_exp[2 * n], n, what);
    T* lse = lse_N.ptr<T>();
    double loss = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (targets[i] == kIgnoreTarget) {
        lse[i] = T(0);
        continue;
      }
      const double l = row_max[i] + std::log(sum_exp[i]);
      lse[i] = static_cast<T>(l);
      loss += l - target_logit[i];
    }
    return loss;
  });
}

void vocab_parallel_cross_entropy_backward(const ExecContext& ctx, const Tensor& logits_shard_NVl, int64_t vocab_offset,
                                           const Tensor& targets_N, const Tensor& lse_N, double grad_scale,
                                           const Tensor& dlogits_shard_NVl) {
  const char* what = "vocab_parallel_cross_entropy_backward";
  check_ce(logits_shard_NVl, targets_N, lse_N, vocab_offset, what);
  check_shape(dlogits_shard_NVl, logits_shard_NVl.shape(), what);
  MF_CHECK(dlogits_shard_NVl.dtype() == logits_shard_NVl.dtype() && dlogits_shard_NVl.contiguous() &&
               dlogits_shard_NVl.device() == logits_shard_NVl.device(),
           what, ": dlogits shard ", dlogits_shard_NVl.str(), " vs logits shard ", logits_shard_NVl.str());
  MF_ON_GPU(ctx, logits_shard_NVl,
            cuda::cross_entropy_shard_backward(ctx, logits_shard_NVl, vocab_offset, targets_N, lse_N, grad_scale,
                                               dlogits_shard_NVl));
  const int64_t n = logits_shard_NVl.size(0), vl = logits_shard_NVl.size(1);
  const int32_t* targets = targets_N.ptr<int32_t>();
  dispatch_float(logits_shard_NVl.dtype(), [&]<class T>() {
    const T* logits = logits_shard_NVl.ptr<T>();
    const T* lse = lse_N.ptr<T>();
    T* dlogits = dlogits_shard_NVl.ptr<T>();
    const T gs = static_cast<T>(grad_scale);
    for (int64_t i = 0; i < n; ++i) {
      if (targets[i] == kIgnoreTarget) {
        std::fill(dlogits + i * vl, dlogits + (i + 1) * vl, T(0));
        continue;
      }
      MF_CHECK(targets[i] >= 0, what, ": target ", targets[i], " at ", i, " is negative");
      // Same expression as cross_entropy_backward, so TP = 1 agrees bit for bit.
      for (int64_t j = 0; j < vl; ++j) dlogits[i * vl + j] = gs * std::exp(logits[i * vl + j] - lse[i]);
      const int64_t local = targets[i] - vocab_offset;
      if (local >= 0 && local < vl) dlogits[i * vl + local] -= gs;
    }
  });
}

}  // namespace moefold
