// Dense matrix multiply on raw row-major buffers: C = alpha * op(A) @ op(B) + beta * C, where
// op(X) is X or X^T. CPU: OpenBLAS (float) and reference-BLAS-compatible double (for gradient
// checks). Every linear layer, attention product and expert GEMM goes through here.
#pragma once

#include <cstdint>

namespace moefold {

// A is M x K (or K x M when trans_a), B is K x N (or N x K when trans_b), C is M x N.
// lda/ldb/ldc are row strides in elements. Zero-sized problems are no-ops (beta still applies
// to C when K == 0).
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda, const T* b,
          int64_t ldb, T beta, T* c, int64_t ldc);

}  // namespace moefold
