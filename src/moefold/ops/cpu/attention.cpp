// Causal grouped-query attention on [B, S, heads, D] tensors, one (batch, query head) at a time
// with gemm on strided rows (lda = heads * D); query head h reads kv head h / (Q/G). Forward saves
// each row's log-sum-exp; backward recomputes P = exp(scale*q k^T - lse) and applies
// dV += P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO*O)), dQ = scale*dS K, dK += scale*dS^T Q.
// Gradient rule: dq, dk, dv are activation gradients, WRITTEN (dk/dv zeroed, then summed over
// the query heads of each group). The _at variants take each query's and key's global position
// (context parallelism: local queries against gathered keys); the plain ops are them with 0..S-1.
// CUDA tensors go to ops/cuda/attention.cu (flash-attention kernels, no work_* scratch used); the
// plain ops through ops/cuda/attention_cudnn.h, which picks cuDNN's fused attention or that kernel.
#include <cmath>
#include <limits>

#include "moefold/ops/dispatch.h"
#include "moefold/ops/gemm.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/attention.h"
#include "moefold/ops/cuda/attention_cudnn.h"
#endif

namespace moefold {

namespace {
struct Dims {
  int64_t b, sq, sk, q, g, d;
};

void check_cpu(const Tensor& t, const Tensor& ref, const char* what) {
  MF_CHECK(t.dtype() == ref.dtype() && t.contiguous() && t.device() == Device::cpu, what, ": ", t.str(), " vs ",
           ref.str());
}

Dims check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     const Tensor& work, int64_t work_per_qk, const char* what) {
  MF_CHECK(q.ndim() == 4 && k.ndim() == 4, what, ": q ", q.str(), ", k ", k.str());
  const Dims dm{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  MF_CHECK(dm.g > 0 && dm.q % dm.g == 0, what, ": Q=", dm.q, " not a multiple of G=", dm.g);
  check_shape(k, {dm.b, dm.sk, dm.g, dm.d}, what);
  check_shape(v, {dm.b, dm.sk, dm.g, dm.d}, what);
  check_shape(out, q.shape(), what);
  check_shape(lse, {dm.b, dm.q, dm.sq}, what);
  MF_CHECK(work.numel() >= work_per_qk * dm.sq * dm.sk, what, ": work ", work.str(), " smaller than ", work_per_qk,
           "*Sq*Sk, Sq=", dm.sq, " Sk=", dm.sk);
  for (const Tensor* t : {&q, &k, &v, &out, &lse, &work}) check_cpu(*t, q, what);
  return dm;
}

// Explicit positions: i32 vectors of Sq and Sk entries, and every query sees at least one key
// (min key position <= every query position), so no softmax row is empty.
void check_positions(const Tensor& q_pos, const Tensor& k_pos, const Dims& dm, const char* what) {
  check_shape(q_pos, {dm.sq}, what);
  check_shape(k_pos, {dm.sk}, what);
  for (const Tensor* t : {&q_pos, &k_pos})
    MF_CHECK(t->dtype() == DType::i32 && t->contiguous() && t->device() == Device::cpu, what, ": positions ", t->str(),
             " must be contiguous cpu i32");
  const int32_t* kp = k_pos.ptr<int32_t>();
  const int32_t* qp = q_pos.ptr<int32_t>();
  int32_t kmin = dm.sk > 0 ? kp[0] : 0;
  for (int64_t j = 1; j < dm.sk; ++j) kmin = kp[j] < kmin ? kp[j] : kmin;
  for (int64_t i = 0; i < dm.sq; ++i)
    MF_CHECK(dm.sk > 0 && qp[i] >= kmin, what, ": query ", i, " at position ", qp[i],
             " sees no key (smallest key position ", kmin, ")");
}

// Global position of row i: pos[i], or i itself when pos is null (the plain causal ops).
inline int64_t at(const int32_t* pos, int64_t i) { return pos ? pos[i] : i; }

// P (Sq x Sk, row stride sk) holds scale * q k^T; masks k_pos[j] > q_pos[i] and turns row i into
// exp(score - lse_i). When `compute_lse` (forward), lse_i is computed here; otherwise it is read.
// Visible keys are visited in index order, so with null positions the sums (and so the bits) are
// those of a plain causal softmax over j <= i.
template <class T>
void causal_softmax(T* p, int64_t sq, int64_t sk, const int32_t* q_pos, const int32_t* k_pos, T* lse,
                    bool compute_lse) {
  for (int64_t i = 0; i < sq; ++i) {
    T* row = p + i * sk;
    const int64_t qi = at(q_pos, i);
    T l;
    if (compute_lse) {
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < sk; ++j)
        if (at(k_pos, j) <= qi) m = row[j] > m ? row[j] : m;
      double sum = 0;
      for (int64_t j = 0; j < sk; ++j)
        if (at(k_pos, j) <= qi) sum += std::exp(static_cast<double>(row[j] - m));
      l = m + static_cast<T>(std::log(sum));
      lse[i] = l;
    } else {
      l = lse[i];
    }
    for (int64_t j = 0; j < sk; ++j) row[j] = at(k_pos, j) <= qi ? std::exp(row[j] - l) : T(0);
  }
}

// The kernels behind both entry points; null positions mean 0..S-1 (REQUIRES then Sq == Sk).
void forward_impl(const Dims& dm, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                  const int32_t* q_pos, const int32_t* k_pos, double scale, const Tensor& out_BSQD,
                  const Tensor& lse_BQS, const Tensor& work) {
  const int64_t sq = dm.sq, sk = dm.sk, d = dm.d, ldq = dm.q * d, ldk = dm.g * d, per_group = dm.q / dm.g;
  dispatch_float(q_BSQD.dtype(), [&]<class T>() {
    T* p = work.ptr<T>();
    for (int64_t b = 0; b < dm.b; ++b)
      for (int64_t h = 0; h < dm.q; ++h) {
        const int64_t g = h / per_group;
        const T* q = q_BSQD.ptr<T>() + b * sq * ldq + h * d;
        const T* k = k_BSGD.ptr<T>() + b * sk * ldk + g * d;
        const T* v = v_BSGD.ptr<T>() + b * sk * ldk + g * d;
        T* out = out_BSQD.ptr<T>() + b * sq * ldq + h * d;
        T* lse = lse_BQS.ptr<T>() + (b * dm.q + h) * sq;
        gemm<T>(false, true, sq, sk, d, static_cast<T>(scale), q, ldq, k, ldk, T(0), p, sk);
        causal_softmax<T>(p, sq, sk, q_pos, k_pos, lse, true);
        gemm<T>(false, false, sq, d, sk, T(1), p, sk, v, ldk, T(0), out, ldq);
      }
  });
}

void backward_impl(const Dims& dm, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                   const int32_t* q_pos, const int32_t* k_pos, const Tensor& out_BSQD, const Tensor& lse_BQS,
                   const Tensor& dout_BSQD, double scale, const Tensor& dq_BSQD, const Tensor& dk_BSGD,
                   const Tensor& dv_BSGD, const Tensor& work) {
  const int64_t sq = dm.sq, sk = dm.sk, d = dm.d, ldq = dm.q * d, ldk = dm.g * d, per_group = dm.q / dm.g;
  dk_BSGD.zero();
  dv_BSGD.zero();
  dispatch_float(q_BSQD.dtype(), [&]<class T>() {
    T* p = work.ptr<T>();
    T* ds = p + sq * sk;
    const T sc = static_cast<T>(scale);
    for (int64_t b = 0; b < dm.b; ++b)
      for (int64_t h = 0; h < dm.q; ++h) {
        const int64_t g = h / per_group;
        const int64_t qo = b * sq * ldq + h * d, ko = b * sk * ldk + g * d;
        const T* q = q_BSQD.ptr<T>() + qo;
        const T* out = out_BSQD.ptr<T>() + qo;
        const T* dout = dout_BSQD.ptr<T>() + qo;
        T* dq = dq_BSQD.ptr<T>() + qo;
        const T* k = k_BSGD.ptr<T>() + ko;
        const T* v = v_BSGD.ptr<T>() + ko;
        T* dk = dk_BSGD.ptr<T>() + ko;
        T* dv = dv_BSGD.ptr<T>() + ko;
        T* lse = lse_BQS.ptr<T>() + (b * dm.q + h) * sq;
        gemm<T>(false, true, sq, sk, d, sc, q, ldq, k, ldk, T(0), p, sk);
        causal_softmax<T>(p, sq, sk, q_pos, k_pos, lse, false);
        gemm<T>(true, false, sk, d, sq, T(1), p, sk, dout, ldq, T(1), dv, ldk);  // dV += P^T dO
        gemm<T>(false, true, sq, sk, d, T(1), dout, ldq, v, ldk, T(0), ds, sk);  // dP = dO V^T
        for (int64_t i = 0; i < sq; ++i) {
          T delta = 0;  // rowsum(dO * O) = rowsum(P * dP)
          for (int64_t c = 0; c < d; ++c) delta += dout[i * ldq + c] * out[i * ldq + c];
          for (int64_t j = 0; j < sk; ++j) ds[i * sk + j] = p[i * sk + j] * (ds[i * sk + j] - delta);
        }
        gemm<T>(false, false, sq, d, sk, sc, ds, sk, k, ldk, T(0), dq, ldq);  // dQ = scale dS K
        gemm<T>(true, false, sk, d, sq, sc, ds, sk, q, ldq, T(1), dk, ldk);   // dK += scale dS^T Q
      }
  });
}

void check_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const Tensor& dq,
                    const Tensor& dk, const Tensor& dv, const char* what) {
  check_shape(dout, q.shape(), what);
  check_shape(dq, q.shape(), what);
  check_shape(dk, k.shape(), what);
  check_shape(dv, v.shape(), what);
  for (const Tensor* t : {&dout, &dq, &dk, &dv}) check_cpu(*t, q, what);
}
}  // namespace

void attention_forward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                       double scale, const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& work_SS) {
  MF_ON_GPU(ctx, q_BSQD, cuda::attention_forward_dispatch(ctx, q_BSQD, k_BSGD, v_BSGD, scale, out_BSQD, lse_BQS));
  const char* what = "attention_forward";
  const Dims dm = check_attention(q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, work_SS, 1, what);
  MF_CHECK(dm.sq == dm.sk, what, ": q ", q_BSQD.str(), " and k ", k_BSGD.str(), " differ in S");
  forward_impl(dm, q_BSQD, k_BSGD, v_BSGD, nullptr, nullptr, scale, out_BSQD, lse_BQS, work_SS);
}

void attention_backward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                        const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& dout_BSQD, double scale,
                        const Tensor& dq_BSQD, const Tensor& dk_BSGD, const Tensor& dv_BSGD, const Tensor& work_2SS) {
  MF_ON_GPU(ctx, q_BSQD,
            cuda::attention_backward_dispatch(ctx, q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, dout_BSQD, scale, dq_BSQD,
                                              dk_BSGD, dv_BSGD));
  const char* what = "attention_backward";
  const Dims dm = check_attention(q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, work_2SS, 2, what);
  MF_CHECK(dm.sq == dm.sk, what, ": q ", q_BSQD.str(), " and k ", k_BSGD.str(), " differ in S");
  check_backward(q_BSQD, k_BSGD, v_BSGD, dout_BSQD, dq_BSQD, dk_BSGD, dv_BSGD, what);
  backward_impl(dm, q_BSQD, k_BSGD, v_BSGD, nullptr, nullptr, out_BSQD, lse_BQS, dout_BSQD, scale, dq_BSQD, dk_BSGD,
                dv_BSGD, work_2SS);
}

void attention_forward_at(const ExecContext& ctx, const Tensor& q_BSqQD, const Tensor& k_BSkGD, const Tensor& v_BSkGD,
                          const Tensor& q_pos_Sq, const Tensor& k_pos_Sk, double scale, const Tensor& out_BSqQD,
                          const Tensor& lse_BQSq, const Tensor& work_SqSk) {
  MF_ON_GPU(ctx, q_BSqQD,
            cuda::attention_forward_at(ctx, q_BSqQD, k_BSkGD, v_BSkGD, q_pos_Sq, k_pos_Sk, scale, out_BSqQD, lse_BQSq));
  const char* what = "attention_forward_at";
  const Dims dm = check_attention(q_BSqQD, k_BSkGD, v_BSkGD, out_BSqQD, lse_BQSq, work_SqSk, 1, what);
  check_positions(q_pos_Sq, k_pos_Sk, dm, what);
  forward_impl(dm, q_BSqQD, k_BSkGD, v_BSkGD, q_pos_Sq.ptr<int32_t>(), k_pos_Sk.ptr<int32_t>(), scale, out_BSqQD,
               lse_BQSq, work_SqSk);
}

void attention_backward_at(const ExecContext& ctx, const Tensor& q_BSqQD, const Tensor& k_BSkGD, const Tensor& v_BSkGD,
                           const Tensor& q_pos_Sq, const Tensor& k_pos_Sk, const Tensor& out_BSqQD,
                           const Tensor& lse_BQSq, const Tensor& dout_BSqQD, double scale, const Tensor& dq_BSqQD,
                           const Tensor& dk_BSkGD, const Tensor& dv_BSkGD, const Tensor& work_2SqSk) {
  MF_ON_GPU(ctx, q_BSqQD,
            cuda::attention_backward_at(ctx, q_BSqQD, k_BSkGD, v_BSkGD, q_pos_Sq, k_pos_Sk, out_BSqQD, lse_BQSq,
                                        dout_BSqQD, scale, dq_BSqQD, dk_BSkGD, dv_BSkGD));
  const char* what = "attention_backward_at";
  const Dims dm = check_attention(q_BSqQD, k_BSkGD, v_BSkGD, out_BSqQD, lse_BQSq, work_2SqSk, 2, what);
  check_positions(q_pos_Sq, k_pos_Sk, dm, what);
  check_backward(q_BSqQD, k_BSkGD, v_BSkGD, dout_BSqQD, dq_BSqQD, dk_BSkGD, dv_BSkGD, what);
  backward_impl(dm, q_BSqQD, k_BSkGD, v_BSkGD, q_pos_Sq.ptr<int32_t>(), k_pos_Sk.ptr<int32_t>(), out_BSqQD, lse_BQSq,
                dout_BSqQD, scale, dq_BSqQD, dk_BSkGD, dv_BSkGD, work_2SqSk);
}

}  // namespace moefold
