// Causal grouped-query attention on [B, S, heads, D] tensors, one (batch, query head) at a time
// with gemm on strided rows (lda = heads * D); query head h reads kv head h / (Q/G). Forward saves
// each row's log-sum-exp; backward recomputes P = exp(scale*q k^T - lse) and applies
// dV += P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO*O)), dQ = scale*dS K, dK += scale*dS^T Q.
// Gradient rule: dq, dk, dv are activation gradients, WRITTEN (dk/dv zeroed, then summed over
// the query heads of each group).
#include <cmath>
#include <limits>

#include "moefold/ops/gemm.h"
#include "moefold/ops/ops.h"

namespace moefold {

namespace {
struct Dims {
  int64_t b, s, q, g, d;
};

void check_cpu(const Tensor& t, const Tensor& ref, const char* what) {
  MF_CHECK(t.dtype() == ref.dtype() && t.contiguous() && t.device() == Device::cpu, what, ": ", t.str(), " vs ",
           ref.str());
}

Dims check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     const Tensor& work, int64_t work_per_ss, const char* what) {
  MF_CHECK(q.ndim() == 4 && k.ndim() == 4, what, ": q ", q.str(), ", k ", k.str());
  const Dims dm{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  MF_CHECK(dm.g > 0 && dm.q % dm.g == 0, what, ": Q=", dm.q, " not a multiple of G=", dm.g);
  check_shape(k, {dm.b, dm.s, dm.g, dm.d}, what);
  check_shape(v, {dm.b, dm.s, dm.g, dm.d}, what);
  check_shape(out, q.shape(), what);
  check_shape(lse, {dm.b, dm.q, dm.s}, what);
  MF_CHECK(work.numel() >= work_per_ss * dm.s * dm.s, what, ": work ", work.str(), " smaller than ", work_per_ss,
           "*S*S, S=", dm.s);
  for (const Tensor* t : {&q, &k, &v, &out, &lse, &work}) check_cpu(*t, q, what);
  return dm;
}

// P_SS (row stride s) holds scale * q k^T; masks j > i and turns row i into exp(score - lse_i).
// When `lse` is written (forward), lse_i is computed here; otherwise it is read (backward).
template <class T>
void causal_softmax(T* p, int64_t s, T* lse, bool compute_lse) {
  for (int64_t i = 0; i < s; ++i) {
    T* row = p + i * s;
    T l;
    if (compute_lse) {
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j <= i; ++j) m = row[j] > m ? row[j] : m;
      double sum = 0;
      for (int64_t j = 0; j <= i; ++j) sum += std::exp(static_cast<double>(row[j] - m));
      l = m + static_cast<T>(std::log(sum));
      lse[i] = l;
    } else {
      l = lse[i];
    }
    for (int64_t j = 0; j <= i; ++j) row[j] = std::exp(row[j] - l);
    for (int64_t j = i + 1; j < s; ++j) row[j] = T(0);
  }
}
}  // namespace

void attention_forward(const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD, double scale,
                       const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& work_SS) {
  const Dims dm = check_attention(q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, work_SS, 1, "attention_forward");
  const int64_t s = dm.s, d = dm.d, ldq = dm.q * d, ldk = dm.g * d, per_group = dm.q / dm.g;
  dispatch_float(q_BSQD.dtype(), [&]<class T>() {
    T* p = work_SS.ptr<T>();
    for (int64_t b = 0; b < dm.b; ++b)
      for (int64_t h = 0; h < dm.q; ++h) {
        const int64_t g = h / per_group;
        const T* q = q_BSQD.ptr<T>() + b * s * ldq + h * d;
        const T* k = k_BSGD.ptr<T>() + b * s * ldk + g * d;
        const T* v = v_BSGD.ptr<T>() + b * s * ldk + g * d;
        T* out = out_BSQD.ptr<T>() + b * s * ldq + h * d;
        T* lse = lse_BQS.ptr<T>() + (b * dm.q + h) * s;
        gemm<T>(false, true, s, s, d, static_cast<T>(scale), q, ldq, k, ldk, T(0), p, s);
        causal_softmax<T>(p, s, lse, true);
        gemm<T>(false, false, s, d, s, T(1), p, s, v, ldk, T(0), out, ldq);
      }
  });
}

void attention_backward(const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD, const Tensor& out_BSQD,
                        const Tensor& lse_BQS, const Tensor& dout_BSQD, double scale, const Tensor& dq_BSQD,
                        const Tensor& dk_BSGD, const Tensor& dv_BSGD, const Tensor& work_2SS) {
  const char* what = "attention_backward";
  const Dims dm = check_attention(q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, work_2SS, 2, what);
  check_shape(dout_BSQD, q_BSQD.shape(), what);
  check_shape(dq_BSQD, q_BSQD.shape(), what);
  check_shape(dk_BSGD, k_BSGD.shape(), what);
  check_shape(dv_BSGD, v_BSGD.shape(), what);
  for (const Tensor* t : {&dout_BSQD, &dq_BSQD, &dk_BSGD, &dv_BSGD}) check_cpu(*t, q_BSQD, what);
  const int64_t s = dm.s, d = dm.d, ldq = dm.q * d, ldk = dm.g * d, per_group = dm.q / dm.g;
  dk_BSGD.zero();
  dv_BSGD.zero();
  dispatch_float(q_BSQD.dtype(), [&]<class T>() {
    T* p = work_2SS.ptr<T>();
    T* ds = p + s * s;
    const T sc = static_cast<T>(scale);
    for (int64_t b = 0; b < dm.b; ++b)
      for (int64_t h = 0; h < dm.q; ++h) {
        const int64_t g = h / per_group;
        const int64_t qo = b * s * ldq + h * d, ko = b * s * ldk + g * d;
        const T* q = q_BSQD.ptr<T>() + qo;
        const T* out = out_BSQD.ptr<T>() + qo;
        const T* dout = dout_BSQD.ptr<T>() + qo;
        T* dq = dq_BSQD.ptr<T>() + qo;
        const T* k = k_BSGD.ptr<T>() + ko;
        const T* v = v_BSGD.ptr<T>() + ko;
        T* dk = dk_BSGD.ptr<T>() + ko;
        T* dv = dv_BSGD.ptr<T>() + ko;
        T* lse = lse_BQS.ptr<T>() + (b * dm.q + h) * s;
        gemm<T>(false, true, s, s, d, sc, q, ldq, k, ldk, T(0), p, s);
        causal_softmax<T>(p, s, lse, false);
        gemm<T>(true, false, s, d, s, T(1), p, s, dout, ldq, T(1), dv, ldk);  // dV += P^T dO
        gemm<T>(false, true, s, s, d, T(1), dout, ldq, v, ldk, T(0), ds, s);  // dP = dO V^T
        for (int64_t i = 0; i < s; ++i) {
          T delta = 0;  // rowsum(dO * O) = rowsum(P * dP)
          for (int64_t c = 0; c < d; ++c) delta += dout[i * ldq + c] * out[i * ldq + c];
          for (int64_t j = 0; j < s; ++j) ds[i * s + j] = p[i * s + j] * (ds[i * s + j] - delta);
        }
        gemm<T>(false, false, s, d, s, sc, ds, s, k, ldk, T(0), dq, ldq);  // dQ = scale dS K
        gemm<T>(true, false, s, d, s, sc, ds, s, q, ldq, T(1), dk, ldk);   // dK += scale dS^T Q
      }
  });
}

}  // namespace moefold
