// GPU GEMMs through cuBLASLt (gemm.h): the row-major wrapper, linear, grouped linear and
// matmul on views. Gradient rule: activation grads (dx) written, parameter grads (dw) accumulated.
// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so cuBLASLt receives B as its
// first operand and A as its second, each described by its stored (cols, rows, ld).
#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/grouped_gemm_cutlass.h"
// common.cuh first: it specialises dtype_of<__nv_bfloat16>.
#include <cublasLt.h>

#include <algorithm>
#include <memory>
#include <unordered_map>
#include <vector>

#include "moefold/ops/cuda/gemm.h"
#include "moefold/ops/cuda/swiglu.h"

namespace moefold::cuda {

#define MF_CUBLAS_CHECK(expr)                                                               \
  do {                                                                                      \
    const cublasStatus_t mf_st_ = (expr);                                                   \
    if (mf_st_ != CUBLAS_STATUS_SUCCESS)                                                    \
      MF_FAIL("cuBLASLt error in ", #expr, " (", __func__, ", ", __FILE__, ":", __LINE__,   \
              "): ", cublasLtGetStatusName(mf_st_), ": ", cublasLtGetStatusString(mf_st_)); \
  } while (0)

namespace {

// cuBLAS's recommended workspace on Hopper (cuBLAS docs, cublasSetWorkspace): enough for its
// split-K and stream-K kernels.
constexpr size_t kWorkspaceBytes = size_t{32} << 20;
// Cached algorithms per device before the cache is dropped and refilled (grouped GEMMs see a new
// row count per expert and step; 4096 entries of ~600 bytes stay small).
constexpr size_t kMaxPlans = 4096;

size_t dtype_bytes(DType t) { return t == DType::bf16 ? 2 : 4; }

cudaDataType_t cuda_type(DType t) { return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

// The largest power of two (<= 256, cuBLASLt's default requirement) dividing the address.
uint32_t alignment_of(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al /= 2;
  return al;
}

struct PlanKey {
  int64_t m, n, k, lda, ldb, ldc;
  DType ab_type, c_type;
  bool trans_a, trans_b;
  uint32_t align_a, align_b, align_c;
  bool operator==(const PlanKey&) const = default;
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    const auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    mix(static_cast<uint64_t>(k.m));
    mix(static_cast<uint64_t>(k.n));
    mix(static_cast<uint64_t>(k.k));
    mix(static_cast<uint64_t>(k.lda));
    mix(static_cast<uint64_t>(k.ldb));
    mix(static_cast<uint64_t>(k.ldc));
    mix(static_cast<uint64_t>(k.ab_type) | static_cast<uint64_t>(k.c_type) << 8 |
        static_cast<uint64_t>(k.trans_a) << 16 | static_cast<uint64_t>(k.trans_b) << 17);
    mix(static_cast<uint64_t>(k.align_a) | static_cast<uint64_t>(k.align_b) << 16 |
        static_cast<uint64_t>(k.align_c) << 32);
    return static_cast<size_t>(h);
  }
};

// Descriptors initialised in place (cublasLt*Init: no allocation) plus the chosen algorithm. The
// descriptors stay where they were initialised: the map's nodes never move.
struct Plan {
  cublasLtMatmulDescOpaque_t op;
  cublasLtMatrixLayoutOpaque_t first;   // cuBLASLt's A: our B
  cublasLtMatrixLayoutOpaque_t second;  // cuBLASLt's B: our A
  cublasLtMatrixLayoutOpaque_t out;     // C and D
  cublasLtMatmulAlgo_t algo;
  size_t workspace_bytes = 0;
};

// cuBLASLt's state in one execution context: its handle, the workspace its GEMMs share in stream
// order, and the plans (layouts and the chosen algorithm) per problem. Made on the context's
// first GEMM, destroyed with the context. REQUIRES: one host thread uses a context at a time.
struct LtState final : ExecLibraryState {
  explicit LtState(const ExecContext&) {
    MF_CUBLAS_CHECK(cublasLtCreate(&handle));
    workspace = device_malloc(kWorkspaceBytes);
  }
  ~LtState() override {
    device_free(workspace);
    cublasLtDestroy(handle);  // not actionable when it fails (the context is going away)
  }
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::unordered_map<PlanKey, Plan, PlanKeyHash> plans;
};

void set_pref(cublasLtMatmulPreference_t pref, cublasLtMatmulPreferenceAttributes_t attr, const auto& value) {
  MF_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
}

void init_plan(LtState& s, const PlanKey& key, Plan& p) {
  MF_CUBLAS_CHECK(cublasLtMatmulDescInit(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = key.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = key.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  MF_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  MF_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(&p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  // Stored row-major shapes: B is K x N (N x K when trans_b), A is M x K (K x M when trans_a);
  // column-major, each is its transpose: (cols, rows, ld).
  const int64_t b_rows = key.trans_b ? key.n : key.k, b_cols = key.trans_b ? key.k : key.n;
  const int64_t a_rows = key.trans_a ? key.k : key.m, a_cols = key.trans_a ? key.m : key.k;
  const cudaDataType_t ab = cuda_type(key.ab_type);
  MF_CUBLAS_CHECK(
      cublasLtMatrixLayoutInit(&p.first, ab, static_cast<uint64_t>(b_cols), static_cast<uint64_t>(b_rows), key.ldb));
  MF_CUBLAS_CHECK(
      cublasLtMatrixLayoutInit(&p.second, ab, static_cast<uint64_t>(a_cols), static_cast<uint64_t>(a_rows), key.lda));
  MF_CUBLAS_CHECK(cublasLtMatrixLayoutInit(&p.out, cuda_type(key.c_type), static_cast<uint64_t>(key.n),
                                           static_cast<uint64_t>(key.m), key.ldc));

  cublasLtMatmulPreferenceOpaque_t pref;
  MF_CUBLAS_CHECK(cublasLtMatmulPreferenceInit(&pref));
  set_pref(&pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(kWorkspaceBytes));
  // Split-K partial sums only in fp32 in the workspace: no reduction through bf16 outputs (one
  // rounding of a bf16 result) and no in-place reduction in the output buffer.
  set_pref(&pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
           static_cast<uint32_t>(CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE));
  // The heuristic assumes 256-byte-aligned buffers unless told: column blocks and expert slices
  // start anywhere.
  set_pref(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
  set_pref(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
  set_pref(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
  set_pref(&pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  MF_CUBLAS_CHECK(
      cublasLtMatmulAlgoGetHeuristic(s.handle, &p.op, &p.first, &p.second, &p.out, &p.out, &pref, 1, &result, &found));
  if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS)
    MF_FAIL("cuBLASLt has no algorithm for ", dtype_name(key.ab_type), " x ", dtype_name(key.ab_type), " -> ",
            dtype_name(key.c_type), " GEMM m=", key.m, " n=", key.n, " k=", key.k, " trans_a=", key.trans_a,
            " trans_b=", key.trans_b, " lda=", key.lda, " ldb=", key.ldb, " ldc=", key.ldc, " alignments ", key.align_a,
            "/", key.align_b, "/", key.align_c, " bytes");
  p.algo = result.algo;
  p.workspace_bytes = result.workspaceSize;
}

const Plan& plan_for(LtState& s, const PlanKey& key) {
  if (auto it = s.plans.find(key); it != s.plans.end()) return it->second;
  if (s.plans.size() >= kMaxPlans) s.plans.clear();
  const auto it = s.plans.try_emplace(key).first;
  try {
    init_plan(s, key, it->second);
  } catch (...) {
    s.plans.erase(it);
    throw;
  }
  return it->second;
}

// c = beta * c over an m x n view (K == 0); beta == 0 writes zeros without reading c.
template <class T>
__global__ void scale_matrix_kernel(T* c, int64_t m, int64_t n, int64_t ldc, float beta) {
  const int64_t total = m * n;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    T* p = c + (idx / n) * ldc + idx % n;
    *p = beta == 0.0f ? from_float<T>(0.0f) : from_float<T>(beta * to_float(*p));
  }
}

void check_matrix(const DeviceMatrix& x, const char* what) {
  MF_CHECK(x.dtype == DType::f32 || x.dtype == DType::bf16, "gemm ", what, ": dtype ", dtype_name(x.dtype),
           " (f32 or bf16)");
  MF_CHECK(x.rows >= 0 && x.cols >= 0 && x.ld >= std::max<int64_t>(1, x.cols), "gemm ", what, ": ", x.rows, " x ",
           x.cols, " with ld ", x.ld);
  MF_CHECK(x.data != nullptr || x.rows == 0 || x.cols == 0, "gemm ", what, ": null data");
  MF_CHECK(reinterpret_cast<uintptr_t>(x.data) % dtype_bytes(x.dtype) == 0, "gemm ", what,
           ": address not aligned to its element size");
}

DeviceMatrix device_matrix(const Tensor& t_RC) {
  return DeviceMatrix{t_RC.data(), t_RC.dtype(), t_RC.size(0), t_RC.size(1), std::max<int64_t>(1, t_RC.size(1))};
}

// Expert e's weight [O, I] inside w_EOI.
DeviceMatrix expert_matrix(const Tensor& w_EOI, int64_t e) {
  const int64_t o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  return DeviceMatrix{
      static_cast<char*>(w_EOI.data()) + e * o_n * i_n * static_cast<int64_t>(dtype_bytes(w_EOI.dtype())),
      w_EOI.dtype(), o_n, i_n, std::max<int64_t>(1, i_n)};
}

// Rows [begin, end) of a contiguous 2-D tensor.
DeviceMatrix row_block(const Tensor& t_RC, int64_t begin, int64_t end) { return device_matrix(t_RC.slice(begin, end)); }

void check_float_dtype(const Tensor& t, const char* what) {
  MF_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, what, ": ", t.str(), " (f32 or bf16)");
}

// dw may be f32 with bf16 operands (an fp32 gradient accumulator), else the operands' dtype.
void check_grad_dtype(const Tensor& dw, const Tensor& w, const char* what) {
  MF_CHECK(dw.dtype() == w.dtype() || dw.dtype() == DType::f32, what, ": ", dw.str(), " for weights ", w.str());
}

void check_linear(const Tensor& x, const Tensor& w, const Tensor& y, const char* what) {
  check_cuda_tensor(x, what);
  check_cuda_tensor(w, what);
  check_cuda_tensor(y, what);
  MF_CHECK(x.ndim() == 2 && w.ndim() == 2 && x.size(1) == w.size(1), what, ": x ", x.str(), ", w ", w.str());
  check_shape(y, {x.size(0), w.size(0)}, what);
  check_float_dtype(x, what);
  MF_CHECK(x.dtype() == w.dtype() && y.dtype() == w.dtype(), what, ": dtypes ", x.str(), " ", w.str(), " ", y.str());
}

// Copies offsets_E1 to `off` (waits for the GPU) and checks that they partition [0, rows).
void download_offsets(const ExecContext& ctx, const Tensor& offsets_E1, int64_t rows, std::vector<int64_t>& off) {
  off.resize(static_cast<size_t>(offsets_E1.numel()));
  device_copy(off.data(), Device::cpu, offsets_E1.data(), Device::cuda, off.size() * sizeof(int64_t), ctx.stream());
  const size_t e_n = off.size() - 1;
  MF_CHECK(off[0] == 0 && off[e_n] == rows, "grouped_linear: offsets span [", off[0], ", ", off[e_n], ") for ", rows,
           " rows");
  for (size_t e = 0; e < e_n; ++e) MF_CHECK(off[e] <= off[e + 1], "grouped_linear: offsets decrease at expert ", e);
}

void check_grouped(const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1, const Tensor& y_RO,
                   const char* what) {
  check_cuda_tensor(x_RI, what);
  check_cuda_tensor(w_EOI, what);
  check_cuda_tensor(y_RO, what);
  check_cuda_tensor(offsets_E1, what);
  MF_CHECK(offsets_E1.dtype() == DType::i64, what, ": offsets ", offsets_E1.str(), " must be i64");
  MF_CHECK(x_RI.ndim() == 2 && y_RO.ndim() == 2 && w_EOI.ndim() == 3 && offsets_E1.numel() == w_EOI.size(0) + 1 &&
               x_RI.size(1) == w_EOI.size(2) && y_RO.size(1) == w_EOI.size(1) && x_RI.size(0) == y_RO.size(0),
           what, ": x ", x_RI.str(), ", w ", w_EOI.str(), ", offsets ", offsets_E1.str(), ", y ", y_RO.str());
  check_float_dtype(x_RI, what);
  MF_CHECK(x_RI.dtype() == w_EOI.dtype() && y_RO.dtype() == w_EOI.dtype(), what, ": dtypes ", x_RI.str(), " ",
           w_EOI.str(), " ", y_RO.str());
}

// Reused host buffer for the offsets: the step loop does not allocate once it has grown.
std::vector<int64_t>& offsets_buffer() {
  thread_local std::vector<int64_t> off;
  return off;
}

}  // namespace

void gemm(const ExecContext& ctx, const DeviceMatrix& a, bool trans_a, const DeviceMatrix& b, bool trans_b,
          const DeviceMatrix& c, double alpha, double beta) {
  check_matrix(a, "a");
  check_matrix(b, "b");
  check_matrix(c, "c");
  const int64_t m = trans_a ? a.cols : a.rows, k = trans_a ? a.rows : a.cols;
  const int64_t n = trans_b ? b.rows : b.cols, kb = trans_b ? b.cols : b.rows;
  MF_CHECK(kb == k && c.rows == m && c.cols == n, "gemm: op(a) ", m, " x ", k, ", op(b) ", kb, " x ", n, ", c ", c.rows,
           " x ", c.cols);
  MF_CHECK(a.dtype == b.dtype, "gemm: a is ", dtype_name(a.dtype), ", b is ", dtype_name(b.dtype),
           " (cuBLASLt needs them alike)");
  MF_CHECK(c.dtype == DType::f32 || a.dtype == DType::bf16, "gemm: ", dtype_name(a.dtype), " operands into ",
           dtype_name(c.dtype), " (f32 operands give an f32 result)");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    constexpr int kThreads = 256;
    const int blocks = static_cast<int>(std::min<int64_t>(ceil_div(m * n, kThreads), 65535 * 8));
    dispatch_cuda_float(c.dtype, [&]<class T>() {
      scale_matrix_kernel<T>
          <<<blocks, kThreads, 0, stream_of(ctx)>>>(static_cast<T*>(c.data), m, n, c.ld, static_cast<float>(beta));
    });
    MF_CUDA_LAUNCHED("gemm (k = 0)");
    return;
  }
  const PlanKey key{m,
                    n,
                    k,
                    a.ld,
                    b.ld,
                    c.ld,
                    a.dtype,
                    c.dtype,
                    trans_a,
                    trans_b,
                    alignment_of(a.data),
                    alignment_of(b.data),
                    alignment_of(c.data)};
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  LtState& s = ctx.library<LtState>(ExecLibrary::cublaslt);
  const Plan& p = plan_for(s, key);
  // const_cast: cuBLASLt's API takes non-const descriptors it only reads.
  auto* op = const_cast<cublasLtMatmulDescOpaque_t*>(&p.op);
  auto* first = const_cast<cublasLtMatrixLayoutOpaque_t*>(&p.first);
  auto* second = const_cast<cublasLtMatrixLayoutOpaque_t*>(&p.second);
  auto* out = const_cast<cublasLtMatrixLayoutOpaque_t*>(&p.out);
  MF_CUBLAS_CHECK(cublasLtMatmul(s.handle, op, &alpha_f, b.data, first, a.data, second, &beta_f, c.data, out, c.data,
                                 out, &p.algo, s.workspace, p.workspace_bytes, stream_of(ctx)));
}

void linear_forward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO) {
  check_linear(x_NI, w_OI, y_NO, "linear_forward");
  gemm(ctx, device_matrix(x_NI), false, device_matrix(w_OI), true, device_matrix(y_NO), 1.0, 0.0);
}

void linear_backward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO,
                     const Tensor& dx_NI, const Tensor& dw_OI) {
  check_linear(x_NI, w_OI, dy_NO, "linear_backward");
  check_cuda_tensor(dw_OI, "linear_backward dw");
  check_shape(dw_OI, w_OI.shape(), "linear_backward dw");
  check_grad_dtype(dw_OI, w_OI, "linear_backward dw");
  if (dx_NI.defined()) {
    check_cuda_tensor(dx_NI, "linear_backward dx");
    check_shape(dx_NI, x_NI.shape(), "linear_backward dx");
    check_same_dtype(dx_NI, x_NI, "linear_backward dx");
    gemm(ctx, device_matrix(dy_NO), false, device_matrix(w_OI), false, device_matrix(dx_NI), 1.0, 0.0);
  }
  gemm(ctx, device_matrix(dy_NO), true, device_matrix(x_NI), false, device_matrix(dw_OI), 1.0, 1.0);
}

void grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                            const Tensor& y_RO) {
  check_grouped(x_RI, w_EOI, offsets_E1, y_RO, "grouped_linear_forward");
  if (ctx.kernels().grouped_gemm == GroupedGemmImpl::cutlass &&
      cutlass_grouped_linear_forward(ctx, x_RI, w_EOI, offsets_E1, y_RO))
    return;
  std::vector<int64_t>& off = offsets_buffer();
  download_offsets(ctx, offsets_E1, x_RI.size(0), off);
  for (int64_t e = 0; e < w_EOI.size(0); ++e) {
    if (off[e + 1] == off[e]) continue;
    gemm(ctx, row_block(x_RI, off[e], off[e + 1]), false, expert_matrix(w_EOI, e), true,
         row_block(y_RO, off[e], off[e + 1]), 1.0, 0.0);
  }
}

void grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                             const Tensor& dy_RO, const Tensor& dx_RI, const Tensor& dw_EOI, bool accumulate) {
  check_grouped(x_RI, w_EOI, offsets_E1, dy_RO, "grouped_linear_backward");
  if (dw_EOI.defined()) {
    check_cuda_tensor(dw_EOI, "grouped_linear_backward dw");
    check_shape(dw_EOI, w_EOI.shape(), "grouped_linear_backward dw");
    check_grad_dtype(dw_EOI, w_EOI, "grouped_linear_backward dw");
  }
  if (dx_RI.defined()) {
    check_cuda_tensor(dx_RI, "grouped_linear_backward dx");
    check_shape(dx_RI, x_RI.shape(), "grouped_linear_backward dx");
    check_same_dtype(dx_RI, x_RI, "grouped_linear_backward dx");
  }
  if (ctx.kernels().grouped_gemm == GroupedGemmImpl::cutlass &&
      cutlass_grouped_linear_backward(ctx, x_RI, w_EOI, offsets_E1, dy_RO, dx_RI, dw_EOI, accumulate))
    return;
  std::vector<int64_t>& off = offsets_buffer();
  download_offsets(ctx, offsets_E1, x_RI.size(0), off);
  for (int64_t e = 0; e < w_EOI.size(0); ++e) {
    const int64_t begin = off[e], end = off[e + 1];
    // An expert without rows: dw stays, or is zeroed (K = 0: gemm writes beta * dw = 0).
    if (begin == end && (accumulate || !dw_EOI.defined())) continue;
    // dx = dy @ w (m x O @ O x I); dw += dy^T @ x (O x m @ m x I).
    if (dx_RI.defined() && begin != end)
      gemm(ctx, row_block(dy_RO, begin, end), false, expert_matrix(w_EOI, e), false, row_block(dx_RI, begin, end), 1.0,
           0.0);
    if (dw_EOI.defined())
      gemm(ctx, row_block(dy_RO, begin, end), true, row_block(x_RI, begin, end), false, expert_matrix(dw_EOI, e), 1.0,
           accumulate ? 1.0 : 0.0);
  }
}

void grouped_linear_swiglu_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_E2FI,
                                   const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& h_RF) {
  check_grouped(x_RI, w_E2FI, offsets_E1, gu_R2F, "grouped_linear_swiglu_forward");
  check_cuda_tensor(h_RF, "grouped_linear_swiglu_forward h");
  check_shape(h_RF, {gu_R2F.size(0), gu_R2F.size(1) / 2}, "grouped_linear_swiglu_forward h");
  check_same_dtype(h_RF, gu_R2F, "grouped_linear_swiglu_forward h");
  if (ctx.kernels().grouped_gemm == GroupedGemmImpl::cutlass &&
      cutlass_grouped_linear_swiglu_forward(ctx, x_RI, w_E2FI, offsets_E1, gu_R2F, h_RF))
    return;
  grouped_linear_forward(ctx, x_RI, w_E2FI, offsets_E1, gu_R2F);
  cuda::swiglu_forward(ctx, gu_R2F, h_RF, GateUp::pairs);  // qualified: ADL also finds moefold::swiglu_forward
}

void grouped_linear_swiglu_backward_data(const ExecContext& ctx, const Tensor& dy_RO, const Tensor& w_EOF,
                                         const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& dh_RF,
                                         const Tensor& dgu_R2F) {
  check_grouped(dh_RF, w_EOF, offsets_E1, dy_RO, "grouped_linear_swiglu_backward_data");
  for (const Tensor* t : {&gu_R2F, &dgu_R2F}) {
    check_cuda_tensor(*t, "grouped_linear_swiglu_backward_data gu / dgu");
    check_shape(*t, {dh_RF.size(0), 2 * dh_RF.size(1)}, "grouped_linear_swiglu_backward_data gu / dgu");
    check_same_dtype(*t, dh_RF, "grouped_linear_swiglu_backward_data gu / dgu");
  }
  if (ctx.kernels().grouped_gemm == GroupedGemmImpl::cutlass &&
      cutlass_grouped_linear_swiglu_backward_data(ctx, dy_RO, w_EOF, offsets_E1, gu_R2F, dgu_R2F))
    return;
  // dh as the layer input too: without a weight gradient the backward reads only its shape.
  grouped_linear_backward(ctx, dh_RF, w_EOF, offsets_E1, dy_RO, dh_RF, Tensor(), true);
  cuda::swiglu_backward(ctx, gu_R2F, dh_RF, dgu_R2F, GateUp::pairs);
}

void matmul(const ExecContext& ctx, const MatrixView& a, bool trans_a, const MatrixView& b, bool trans_b,
            const MatrixView& c, double alpha, double beta) {
  const auto view = [](const MatrixView& v, const char* what) {
    check_cuda_tensor(v.storage, what);
    return DeviceMatrix{
        static_cast<char*>(v.storage.data()) + v.offset * static_cast<int64_t>(dtype_size(v.storage.dtype())),
        v.storage.dtype(), v.rows, v.cols, v.ld};
  };
  gemm(ctx, view(a, "matmul a"), trans_a, view(b, "matmul b"), trans_b, view(c, "matmul c"), alpha, beta);
}

}  // namespace moefold::cuda
