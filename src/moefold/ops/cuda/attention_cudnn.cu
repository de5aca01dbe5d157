// Causal grouped-query attention through cuDNN's fused attention (attention_cudnn.h): one cuDNN
// frontend graph per problem (sdpa with a top-left causal mask and softmax stats for forward,
// sdpa_backward for backward; GQA through different head counts of q and k/v; the BSHD tensors
// described by strides), built once and cached; and the dispatch between it and the own kernel
// (attention.cu). Gradient rule: dq, dk, dv WRITTEN (cuDNN sums the query heads of a group).
// Host code only: CMake compiles this file with the C++ compiler (nvcc's front end takes three
// times as long over the frontend's headers). The cuDNN part exists with MOEFOLD_WITH_CUDNN (CMake
// option MOEFOLD_CUDNN); without it every problem goes to the own kernel.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <string>
#include <unordered_map>

#include "moefold/core/cuda_check.h"
#include "moefold/core/device.h"
#include "moefold/core/error.h"
#include "moefold/ops/cuda/attention.h"
#include "moefold/ops/cuda/attention_cudnn.h"

#ifdef MOEFOLD_WITH_CUDNN
#include <cudnn.h>
#include <cudnn_frontend.h>
#elif !defined(MOEFOLD_CUDNN_OFF_REASON)
#define MOEFOLD_CUDNN_OFF_REASON "CMake option MOEFOLD_CUDNN"
#endif

namespace moefold::cuda {

namespace {

#ifndef MOEFOLD_WITH_CUDNN
constexpr const char* kBuiltWithoutCudnn = "this moefold was built without cuDNN: " MOEFOLD_CUDNN_OFF_REASON;
#endif

std::atomic<AttentionImpl> g_last_impl[2] = {AttentionImpl::own, AttentionImpl::own};

struct Dims {
  int64_t b, s, nq, ng, d;
};

// The own kernel's entry checks (attention.cu), repeated for the cuDNN path: shapes, one dtype,
// f32 lse, contiguous CUDA tensors, Sq == Sk.
Dims check_forward_tensors(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                           const char* what) {
  for (const Tensor* t : {&q, &k, &v, &out, &lse})
    MF_CHECK(t->device() == Device::cuda && t->contiguous(), what, ": ", t->str(), " must be a contiguous CUDA tensor");
  MF_CHECK(q.ndim() == 4 && k.ndim() == 4, what, ": q ", q.str(), ", k ", k.str());
  const Dims dm{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  MF_CHECK(dm.ng > 0 && dm.nq % dm.ng == 0, what, ": Q=", dm.nq, " not a multiple of G=", dm.ng);
  MF_CHECK(k.size(1) == dm.s, what, ": q ", q.str(), " and k ", k.str(), " differ in S");
  check_shape(k, {dm.b, dm.s, dm.ng, dm.d}, what);
  check_shape(v, {dm.b, dm.s, dm.ng, dm.d}, what);
  check_shape(out, q.shape(), what);
  check_shape(lse, {dm.b, dm.nq, dm.s}, what);
  for (const Tensor* t : {&k, &v, &out}) check_same_dtype(*t, q, what);
  MF_CHECK(lse.dtype() == DType::f32, what, ": lse ", lse.str(), " must be f32 on the GPU");
  return dm;
}

void check_backward_tensors(const Tensor& q, const Tensor& k, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                            const Tensor& dv, const char* what) {
  for (const Tensor* t : {&dout, &dq, &dk, &dv}) {
    MF_CHECK(t->device() == Device::cuda && t->contiguous(), what, ": ", t->str(), " must be a contiguous CUDA tensor");
    check_same_dtype(*t, q, what);
  }
  check_shape(dout, q.shape(), what);
  check_shape(dq, q.shape(), what);
  check_shape(dk, k.shape(), what);
  check_shape(dv, k.shape(), what);
}

// Reasons cuDNN is not even asked (no graph is built for them).
bool precheck(const CudnnAttentionProblem& p, std::string* why) {
  const auto refuse = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  if (p.dtype != DType::bf16) return refuse(cat("cuDNN attention takes bf16 only (", dtype_name(p.dtype), " given)"));
  // cuDNN's SDPA on Hopper: head dims that are multiples of 8 up to 256 (cuDNN frontend's
  // support surface; strides must be 16-byte multiples).
  if (p.head_dim % 8 != 0 || p.head_dim > 256)
    return refuse(cat("head dim ", p.head_dim, " (cuDNN needs a multiple of 8, at most 256)"));
  return true;
}

#ifdef MOEFOLD_WITH_CUDNN

namespace fe = cudnn_frontend;

std::string problem_name(const CudnnAttentionProblem& p) {
  return cat("B=", p.batch, " S=", p.seq, " Q=", p.q_heads, " G=", p.kv_heads, " D=", p.head_dim, " ",
             dtype_name(p.dtype),
             p.backward ? (p.deterministic ? " backward" : " backward (non-deterministic)") : " forward");
}

bool aligned16(std::initializer_list<const Tensor*> ts, std::string* why) {
  for (const Tensor* t : ts)
    if (reinterpret_cast<uintptr_t>(t->data()) % 16 != 0) {
      if (why) *why = cat("tensor ", t->str(), " is not 16-byte aligned");
      return false;
    }
  return true;
}

#define MF_CUDNN_CHECK(expr)                                                           \
  do {                                                                                 \
    const cudnnStatus_t mf_st_ = (expr);                                               \
    if (mf_st_ != CUDNN_STATUS_SUCCESS)                                                \
      MF_FAIL("cuDNN error in ", #expr, " (", __func__, ", ", __FILE__, ":", __LINE__, \
              "): ", cudnnGetErrorString(mf_st_));                                     \
  } while (0)

// Tensor uids of the graphs (the variant pack maps them to pointers).
enum Uid : int64_t { kUidQ = 1, kUidK, kUidV, kUidO, kUidStats, kUidDout, kUidDq, kUidDk, kUidDv };

struct Key {
  int device;
  int64_t b, s, nq, ng, d;
  DType dtype;
  uint32_t scale_bits;  // the float scale the graph embeds
  bool backward, deterministic;
  bool operator==(const Key&) const = default;
};

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 1469598103934665603ull;
    const auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (int64_t v : {k.b, k.s, k.nq, k.ng, k.d}) mix(static_cast<uint64_t>(v));
    mix(static_cast<uint64_t>(k.device) | static_cast<uint64_t>(k.dtype) << 16 | uint64_t{k.scale_bits} << 24);
    mix(static_cast<uint64_t>(k.backward) | static_cast<uint64_t>(k.deterministic) << 1);
    return static_cast<size_t>(h);
  }
};

// A built graph, or (graph null) why cuDNN refused the problem: refusals are cached too, so a
// refused shape costs one graph build per process, not one per step.
struct Entry {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
  std::string why;
};

// cuDNN's state in one execution context: its handle (null when cuDNN is unusable: why) and the
// graphs built with it (execution plans belong to the handle that built them). Made on the
// context's first cuDNN call, destroyed with the context. REQUIRES: one host thread per context.
struct CudnnState final : ExecLibraryState {
  explicit CudnnState(const ExecContext& ctx) {
    MF_CUDA_CHECK(cudaGetDevice(&device));
    const cudnnStatus_t st = cudnnCreate(&handle);
    if (st != CUDNN_STATUS_SUCCESS) {
      handle = nullptr;
      why = cat("cudnnCreate failed on GPU ", device, ": ", cudnnGetErrorString(st));
      std::fprintf(stderr, "moefold: cuDNN is unusable (%s); attention uses moefold's own kernel\n", why.c_str());
      return;
    }
    MF_CUDNN_CHECK(cudnnSetStream(handle, static_cast<cudaStream_t>(ctx.stream())));
  }
  ~CudnnState() override {
    graphs.clear();
    if (handle) cudnnDestroy(handle);  // not actionable when it fails (the context is going away)
  }
  int device = 0;
  cudnnHandle_t handle = nullptr;
  std::string why;
  std::unordered_map<Key, Entry, KeyHash> graphs;
};

Key key_of(const CudnnAttentionProblem& p, int device) {
  const float scale = static_cast<float>(p.scale);
  uint32_t bits = 0;
  std::memcpy(&bits, &scale, sizeof(bits));
  return Key{device,     p.batch, p.seq, p.q_heads,  p.kv_heads,
             p.head_dim, p.dtype, bits,  p.backward, p.backward && p.deterministic};
}

// Logical dims {B, H, S, D} of a [B, S, H, D] tensor, as cuDNN describes attention operands.
fe::graph::Tensor_attributes bshd(const char* name, int64_t uid, int64_t b, int64_t s, int64_t h, int64_t d) {
  return fe::graph::Tensor_attributes()
      .set_name(name)
      .set_uid(uid)
      .set_dim({b, h, s, d})
      .set_stride({s * h * d, d, h * d, 1});
}

// lse_BQS as cuDNN's softmax stats: {B, Q, S, 1}, f32. Both are the natural-log log-sum-exp of
// the scaled scores (cuDNN's stats are max + ln(sum exp(x - max)) of x = scale * q k^T).
fe::graph::Tensor_attributes& describe_stats(fe::graph::Tensor_attributes& t, int64_t b, int64_t s, int64_t nq) {
  return t.set_name("lse")
      .set_uid(kUidStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({b, nq, s, 1})
      .set_stride({nq * s, s, 1, 1});
}

// REQUIRES: the calling context's CudnnState owns `handle`.
Entry build_graph(const Key& key, cudnnHandle_t handle) {
  Entry e;
  const int64_t b = key.b, s = key.s, nq = key.nq, ng = key.ng, d = key.d;
  float scale = 0;
  std::memcpy(&scale, &key.scale_bits, sizeof(scale));
  try {
    auto g = std::make_shared<fe::graph::Graph>();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    auto q = g->tensor(bshd("q", kUidQ, b, s, nq, d));
    auto k = g->tensor(bshd("k", kUidK, b, s, ng, d));
    auto v = g->tensor(bshd("v", kUidV, b, s, ng, d));
    if (!key.backward) {
      auto [o, stats] = g->sdpa(q, k, v,
                                fe::graph::SDPA_attributes()
                                    .set_name("attention_forward")
                                    .set_generate_stats(true)
                                    .set_causal_mask(true)
                                    .set_attn_scale(scale));
      o->set_output(true).set_uid(kUidO).set_dim({b, nq, s, d}).set_stride({s * nq * d, d, nq * d, 1});
      describe_stats(*stats, b, s, nq).set_output(true);
    } else {
      auto o = g->tensor(bshd("out", kUidO, b, s, nq, d));
      auto dout = g->tensor(bshd("dout", kUidDout, b, s, nq, d));
      fe::graph::Tensor_attributes stats_in;
      auto stats = g->tensor(describe_stats(stats_in, b, s, nq));
      auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats,
                                           fe::graph::SDPA_backward_attributes()
                                               .set_name("attention_backward")
                                               .set_causal_mask(true)
                                               .set_attn_scale(scale)
                                               .set_deterministic_algorithm(key.deterministic));
      dq->set_output(true).set_uid(kUidDq).set_dim({b, nq, s, d}).set_stride({s * nq * d, d, nq * d, 1});
      dk->set_output(true).set_uid(kUidDk).set_dim({b, ng, s, d}).set_stride({s * ng * d, d, ng * d, 1});
      dv->set_output(true).set_uid(kUidDv).set_dim({b, ng, s, d}).set_stride({s * ng * d, d, ng * d, 1});
    }
    const auto failed = [&](const char* stage, fe::error_t err) {
      e.why = cat("cuDNN ", stage, ": ", err.get_message());
      return e;
    };
    if (auto err = g->validate(); err.is_bad()) return failed("validate", err);
    if (auto err = g->build_operation_graph(handle); err.is_bad()) return failed("build_operation_graph", err);
    if (auto err = g->create_execution_plans({fe::HeurMode_t::A}); err.is_bad())
      return failed("create_execution_plans", err);
    if (auto err = g->check_support(handle); err.is_bad()) return failed("check_support", err);
    if (auto err = g->build_plans(handle); err.is_bad()) return failed("build_plans", err);
    int64_t workspace = 0;
    if (auto err = g->get_workspace_size(workspace); err.is_bad()) return failed("get_workspace_size", err);
    // The deterministic backward keeps dP for every (query, key) pair in its workspace (2 bytes
    // each: B*Q*S*S*2); past 1/8 of the GPU's memory the own kernel (no workspace) serves instead.
    cudaDeviceProp prop{};
    MF_CUDA_CHECK(cudaGetDeviceProperties(&prop, key.device));
    if (workspace > static_cast<int64_t>(prop.totalGlobalMem / 8)) {
      e.why = cat("cuDNN wants a workspace of ", workspace >> 20, " MiB, more than 1/8 of the GPU's ",
                  prop.totalGlobalMem >> 20, " MiB");
      return e;
    }
    e.graph = std::move(g);
    e.workspace_bytes = workspace;
  } catch (const std::exception& ex) {  // the frontend throws on some backend failures
    e.graph.reset();
    e.why = cat("cuDNN graph build threw: ", ex.what());
  }
  return e;
}

// The cached entry of `p` in `ctx`, built on first use.
const Entry& entry_of(const ExecContext& ctx, const CudnnAttentionProblem& p, cudnnHandle_t* handle_out) {
  CudnnState& st = ctx.library<CudnnState>(ExecLibrary::cudnn);
  *handle_out = st.handle;
  const Key key = key_of(p, st.device);
  auto it = st.graphs.find(key);
  if (it != st.graphs.end()) return it->second;
  Entry e;
  if (!st.handle) {
    e.why = st.why;
  } else {
    e = build_graph(key, st.handle);
    if (!e.graph)
      std::fprintf(stderr, "moefold: cuDNN attention refused %s: %s\n", problem_name(p).c_str(), e.why.c_str());
  }
  return st.graphs.emplace(key, std::move(e)).first->second;
}

// Runs the graph of `p` on the context's stream with `ptrs`; false (nothing launched) when cuDNN
// refuses `p`.
bool execute(const ExecContext& ctx, const CudnnAttentionProblem& p, std::unordered_map<int64_t, void*>& ptrs,
             std::string* why) {
  cudnnHandle_t handle = nullptr;
  const Entry& e = entry_of(ctx, p, &handle);
  if (!e.graph) {
    if (why) *why = e.why;
    return false;
  }
  void* workspace =
      e.workspace_bytes > 0 ? ctx.scratch(ScratchSlot::attention, static_cast<size_t>(e.workspace_bytes)) : nullptr;
  if (auto err = e.graph->execute(handle, ptrs, workspace); err.is_bad())
    MF_FAIL("cuDNN attention ", problem_name(p), ": execute failed: ", err.get_message());
  return true;
}

#endif  // MOEFOLD_WITH_CUDNN

CudnnAttentionProblem problem_of(const Dims& dm, DType dtype, double scale, bool backward, bool deterministic) {
  return CudnnAttentionProblem{dm.b, dm.s, dm.nq, dm.ng, dm.d, dtype, scale, backward, deterministic};
}

}  // namespace

const char* attention_impl_name(AttentionImpl impl) { return impl == AttentionImpl::cudnn ? "cudnn" : "own"; }

bool cudnn_attention_built() {
#ifdef MOEFOLD_WITH_CUDNN
  return true;
#else
  return false;
#endif
}

int64_t cudnn_runtime_version() {
#ifdef MOEFOLD_WITH_CUDNN
  return static_cast<int64_t>(cudnnGetVersion());
#else
  return 0;
#endif
}

std::string cudnn_frontend_version() {
#ifdef MOEFOLD_WITH_CUDNN
  return cat(CUDNN_FRONTEND_MAJOR_VERSION, ".", CUDNN_FRONTEND_MINOR_VERSION, ".", CUDNN_FRONTEND_PATCH_VERSION);
#else
  return "";
#endif
}

bool cudnn_attention_supported(const ExecContext& ctx, const CudnnAttentionProblem& p, std::string* why) {
  if (!precheck(p, why)) return false;
#ifdef MOEFOLD_WITH_CUDNN
  cudnnHandle_t handle = nullptr;
  const Entry& e = entry_of(ctx, p, &handle);
  if (!e.graph && why) *why = e.why;
  return e.graph != nullptr;
#else
  if (why) *why = kBuiltWithoutCudnn;
  return false;
#endif
}

bool cudnn_attention_forward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                             double scale, const Tensor& out_BSQD, const Tensor& lse_BQS,
                             const CudnnAttentionOptions& opts, std::string* why) {
  const Dims dm = check_forward_tensors(q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, "attention_forward (cudnn)");
  const CudnnAttentionProblem p = problem_of(dm, q_BSQD.dtype(), scale, false, opts.deterministic);
#ifdef MOEFOLD_WITH_CUDNN
  if (!precheck(p, why)) return false;
  if (dm.b == 0 || dm.s == 0 || dm.nq == 0) return true;  // nothing to compute or write
  if (!aligned16({&q_BSQD, &k_BSGD, &v_BSGD, &out_BSQD, &lse_BQS}, why)) return false;
  std::unordered_map<int64_t, void*> ptrs = {{kUidQ, q_BSQD.data()},
                                             {kUidK, k_BSGD.data()},
                                             {kUidV, v_BSGD.data()},
                                             {kUidO, out_BSQD.data()},
                                             {kUidStats, lse_BQS.data()}};
  return execute(ctx, p, ptrs, why);
#else
  (void)p;
  if (why) *why = kBuiltWithoutCudnn;
  return false;
#endif
}

bool cudnn_attention_backward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                              const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& dout_BSQD, double scale,
                              const Tensor& dq_BSQD, const Tensor& dk_BSGD, const Tensor& dv_BSGD,
                              const CudnnAttentionOptions& opts, std::string* why) {
  const char* what = "attention_backward (cudnn)";
  const Dims dm = check_forward_tensors(q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, what);
  check_backward_tensors(q_BSQD, k_BSGD, dout_BSQD, dq_BSQD, dk_BSGD, dv_BSGD, what);
  const CudnnAttentionProblem p = problem_of(dm, q_BSQD.dtype(), scale, true, opts.deterministic);
#ifdef MOEFOLD_WITH_CUDNN
  if (!precheck(p, why)) return false;
  if (dm.b == 0 || dm.s == 0) return true;  // empty gradients
  if (dm.nq == 0) {                         // no query head reads k, v: their gradients are zero (WRITTEN)
    MF_CUDA_CHECK(cudaMemsetAsync(dk_BSGD.data(), 0, dk_BSGD.nbytes(), static_cast<cudaStream_t>(ctx.stream())));
    MF_CUDA_CHECK(cudaMemsetAsync(dv_BSGD.data(), 0, dv_BSGD.nbytes(), static_cast<cudaStream_t>(ctx.stream())));
    return true;
  }
  if (!aligned16({&q_BSQD, &k_BSGD, &v_BSGD, &out_BSQD, &lse_BQS, &dout_BSQD, &dq_BSQD, &dk_BSGD, &dv_BSGD}, why))
    return false;
  std::unordered_map<int64_t, void*> ptrs = {
      {kUidQ, q_BSQD.data()},   {kUidK, k_BSGD.data()},      {kUidV, v_BSGD.data()},
      {kUidO, out_BSQD.data()}, {kUidStats, lse_BQS.data()}, {kUidDout, dout_BSQD.data()},
      {kUidDq, dq_BSQD.data()}, {kUidDk, dk_BSGD.data()},    {kUidDv, dv_BSGD.data()}};
  return execute(ctx, p, ptrs, why);
#else
  (void)p;
  if (why) *why = kBuiltWithoutCudnn;
  return false;
#endif
}

void attention_forward_dispatch(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD,
                                const Tensor& v_BSGD, double scale, const Tensor& out_BSQD, const Tensor& lse_BQS) {
  const AttentionKernel choice = ctx.kernels().attention;
  if (choice != AttentionKernel::own) {
    std::string why;
    if (cudnn_attention_forward(ctx, q_BSQD, k_BSGD, v_BSGD, scale, out_BSQD, lse_BQS, {}, &why)) {
      g_last_impl[0] = AttentionImpl::cudnn;
      return;
    }
    if (choice == AttentionKernel::cudnn)
      MF_FAIL("kernels.attention = cudnn: attention_forward of q ", q_BSQD.str(), ", k ", k_BSGD.str(), ": ", why);
  }
  attention_forward(ctx, q_BSQD, k_BSGD, v_BSGD, scale, out_BSQD, lse_BQS);
  g_last_impl[0] = AttentionImpl::own;
}

void attention_backward_dispatch(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD,
                                 const Tensor& v_BSGD, const Tensor& out_BSQD, const Tensor& lse_BQS,
                                 const Tensor& dout_BSQD, double scale, const Tensor& dq_BSQD, const Tensor& dk_BSGD,
                                 const Tensor& dv_BSGD) {
  const AttentionKernel choice = ctx.kernels().attention;
  if (choice != AttentionKernel::own) {
    std::string why;
    const CudnnAttentionOptions opts{ctx.kernels().deterministic_attention};
    if (cudnn_attention_backward(ctx, q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, dout_BSQD, scale, dq_BSQD, dk_BSGD,
                                 dv_BSGD, opts, &why)) {
      g_last_impl[1] = AttentionImpl::cudnn;
      return;
    }
    if (choice == AttentionKernel::cudnn)
      MF_FAIL("kernels.attention = cudnn: attention_backward of q ", q_BSQD.str(), ", k ", k_BSGD.str(), ": ", why);
  }
  attention_backward(ctx, q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, dout_BSQD, scale, dq_BSQD, dk_BSGD, dv_BSGD);
  g_last_impl[1] = AttentionImpl::own;
}

AttentionImpl last_attention_impl(bool backward) { return g_last_impl[backward ? 1 : 0]; }

}  // namespace moefold::cuda
