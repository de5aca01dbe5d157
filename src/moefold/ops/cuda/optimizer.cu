// AdamW on the GPU (ops/ops.h adamw_update): one pass over w, g, m, v in f32 (the same
// arithmetic as the CPU op, in float), the gradient scaled on the fly (clipping), optionally
// writing the bf16 compute copy of the weight.
#include <algorithm>
#include <cmath>
#include <limits>

#include "moefold/core/device.h"
#include "moefold/ops/adamw_args.h"
#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/optimizer.h"

namespace moefold::cuda {

namespace {

// One element's update (g already scaled by the clip factor), every operation rounded on its own
// (the _rn intrinsics are never contracted into fused multiply-adds): the host's
// adamw_update_host (ops/cpu/adamw_host.cpp) computes the same bits.
__device__ __forceinline__ void adamw_element(const AdamWArgs& a, float g, float& w, float& m, float& v) {
  m = __fadd_rn(__fmul_rn(a.b1, m), __fmul_rn(a.omb1, g));
  v = __fadd_rn(__fmul_rn(a.b2, v), __fmul_rn(__fmul_rn(a.omb2, g), g));
  const float den = __fadd_rn(__fmul_rn(__fsqrt_rn(v), a.inv_sqrt_bc2), a.eps);
  w = __fsub_rn(__fmul_rn(w, a.wd), __fdiv_rn(__fmul_rn(a.step_size, m), den));
}

// M, V: the moments' types (float, or bf16: stored rounded, the weight updated from the unrounded
// values); G: the gradient's (float, or bf16: train.main_grads_dtype).
template <class C, class M, class V, class G>
__global__ void adamw_kernel(float* w, const G* g, M* m, V* v, C* wc, int64_t n, AdamWArgs a) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float wi = w[i], mi = to_float(m[i]), vi = to_float(v[i]);
    adamw_element(a, __fmul_rn(to_float(g[i]), a.gs), wi, mi, vi);
    m[i] = from_float<M>(mi);
    v[i] = from_float<V>(vi);
    w[i] = wi;
    if (wc) wc[i] = from_float<C>(wi);
  }
}

// The same update, four elements per thread with 16-byte loads and stores (the pass is memory-
// bound: ~30 bytes per parameter); the compute copy (bf16) is written 8 bytes at a time.
struct alignas(8) Bf16x4 {
  __nv_bfloat16 v[4];
};

__global__ void adamw_vec_kernel(float4* w, const float4* g, float4* m, float4* v, Bf16x4* wc, int64_t n4,
                                 AdamWArgs a) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 gv = g[i];
    float4 mv = m[i], vv = v[i], wv = w[i];
    const float* gp = &gv.x;
    float* mp = &mv.x;
    float* vp = &vv.x;
    float* wp = &wv.x;
    Bf16x4 c;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      adamw_element(a, __fmul_rn(gp[k], a.gs), wp[k], mp[k], vp[k]);
      c.v[k] = __float2bfloat16(wp[k]);
    }
    m[i] = mv;
    v[i] = vv;
    w[i] = wv;
    if (wc) wc[i] = c;
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// AdamWBatch: entry i covers blocks [first_block, first_block + ceil(n / kBatchChunk)) of a launch.
constexpr int kBatchThreads = 256;
constexpr int64_t kBatchChunk = 16 * kBatchThreads;
struct AdamWDesc {
  float* w;
  const void* g;
  void* m;
  void* v;
  void* wc;
  int64_t n, first_block;
  int decay;
};

template <class C, class M, class V, class G>
__global__ void adamw_batch_kernel(const AdamWDesc* d, int n_desc, AdamWArgs with_decay, AdamWArgs without) {
  const auto b = static_cast<int64_t>(blockIdx.x);
  int lo = 0, hi = n_desc - 1;  // the last entry whose first block is <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (d[mid].first_block <= b)
      lo = mid;
    else
      hi = mid - 1;
  }
  const AdamWDesc e = d[lo];
  const AdamWArgs& a = e.decay ? with_decay : without;
  const G* g = static_cast<const G*>(e.g);
  M* m = static_cast<M*>(e.m);
  V* v = static_cast<V*>(e.v);
  C* wc = static_cast<C*>(e.wc);
  const int64_t begin = (b - e.first_block) * kBatchChunk, end = min(e.n, begin + kBatchChunk);
  for (int64_t i = begin + threadIdx.x; i < end; i += kBatchThreads) {  // adamw_kernel's element
    float wi = e.w[i], mi = to_float(m[i]), vi = to_float(v[i]);
    adamw_element(a, __fmul_rn(to_float(g[i]), a.gs), wi, mi, vi);
    m[i] = from_float<M>(mi);
    v[i] = from_float<V>(vi);
    e.w[i] = wi;
    if (wc) wc[i] = from_float<C>(wi);
  }
}

}  // namespace

void adamw_update(const ExecContext& ctx, const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                  const AdamWStep& s, const Tensor& w_compute) {
  for (const Tensor* t : {&w, &g, &m, &v}) {
    check_cuda_tensor(*t, "adamw_update");
    const bool either = t != &w;  // moments and gradients: f32 or bf16
    MF_CHECK((t->dtype() == DType::f32 || (either && t->dtype() == DType::bf16)) && t->shape() == w.shape(),
             "adamw_update: ", t->str(), " vs w ", w.str(), " (f32 master weights; f32 or bf16 gradients and moments)");
  }
  const int64_t n = w.numel();
  if (n == 0) return;
  const int threads = 256, blocks = static_cast<int>(std::min<int64_t>(ceil_div(n, threads), 65535 * 4));
  const AdamWArgs a = adamw_args(s);
  if (w_compute.defined()) {
    check_cuda_tensor(w_compute, "adamw_update w_compute");
    MF_CHECK(w_compute.numel() == n, "adamw_update: compute copy ", w_compute.str(), " vs w ", w.str());
  }
  const bool f32_moments = m.dtype() == DType::f32 && v.dtype() == DType::f32;
  const bool vec = f32_moments && g.dtype() == DType::f32 && n % 4 == 0 && aligned(w.data(), 16) &&
                   aligned(g.data(), 16) && aligned(m.data(), 16) && aligned(v.data(), 16) &&
                   (!w_compute.defined() || (w_compute.dtype() == DType::bf16 && aligned(w_compute.data(), 8)));
  if (vec) {
    const int vblocks = static_cast<int>(std::min<int64_t>(ceil_div(n / 4, threads), 65535 * 4));
    adamw_vec_kernel<<<vblocks, threads, 0, stream_of(ctx)>>>(
        static_cast<float4*>(w.data()), static_cast<const float4*>(g.data()), static_cast<float4*>(m.data()),
        static_cast<float4*>(v.data()), w_compute.defined() ? static_cast<Bf16x4*>(w_compute.data()) : nullptr, n / 4,
        a);
  } else {
    // The scalar path: any compute copy (none: float, never written), any moment and gradient dtypes.
    const DType c_dtype = w_compute.defined() ? w_compute.dtype() : DType::f32;
    dispatch_cuda_float(c_dtype, [&]<class C>() {
      dispatch_cuda_float(m.dtype(), [&]<class M>() {
        dispatch_cuda_float(v.dtype(), [&]<class V>() {
          dispatch_cuda_float(g.dtype(), [&]<class G>() {
            adamw_kernel<C, M, V, G><<<blocks, threads, 0, stream_of(ctx)>>>(
                w.ptr<float>(), static_cast<const G*>(g.data()), static_cast<M*>(m.data()), static_cast<V*>(v.data()),
                w_compute.defined() ? static_cast<C*>(w_compute.data()) : nullptr, n, a);
          });
        });
      });
    });
  }
  MF_CUDA_LAUNCHED("adamw_update");
}

void* adamw_batch_table(const std::vector<AdamWEntry>& entries, int64_t* blocks) {
  std::vector<AdamWDesc> d;
  int64_t first = 0;
  for (const AdamWEntry& e : entries) {
    for (const Tensor* t : {&e.w, &e.g, &e.m, &e.v}) check_cuda_tensor(*t, "AdamWBatch");
    if (e.compute.defined()) check_cuda_tensor(e.compute, "AdamWBatch compute copy");
    d.push_back({e.w.ptr<float>(), e.g.data(), e.m.data(), e.v.data(), e.compute.defined() ? e.compute.data() : nullptr,
                 e.w.numel(), first, e.decay ? 1 : 0});
    first += ceil_div(e.w.numel(), kBatchChunk);
  }
  MF_CHECK(first <= std::numeric_limits<int>::max() && d.size() <= std::numeric_limits<int>::max(),
           "AdamWBatch: ", d.size(), " entries in ", first, " blocks");
  *blocks = first;
  void* table = device_malloc(d.size() * sizeof(AdamWDesc));
  MF_CUDA_CHECK(cudaMemcpy(table, d.data(), d.size() * sizeof(AdamWDesc), cudaMemcpyHostToDevice));
  return table;
}

void adamw_batch_free(void* table) { device_free(table); }

void adamw_batch_update(const ExecContext& ctx, const std::vector<AdamWEntry>& entries, const void* table,
                        int64_t blocks, const AdamWStep& s) {
  if (blocks == 0) return;
  AdamWStep off = s;
  off.weight_decay = 0;
  const AdamWArgs with_decay = adamw_args(s), without = adamw_args(off);
  const AdamWEntry& e0 = entries.front();
  const DType c_dtype = e0.compute.defined() ? e0.compute.dtype() : DType::f32;
  dispatch_cuda_float(c_dtype, [&]<class C>() {
    dispatch_cuda_float(e0.m.dtype(), [&]<class M>() {
      dispatch_cuda_float(e0.v.dtype(), [&]<class V>() {
        dispatch_cuda_float(e0.g.dtype(), [&]<class G>() {
          adamw_batch_kernel<C, M, V, G><<<static_cast<unsigned>(blocks), kBatchThreads, 0, stream_of(ctx)>>>(
              static_cast<const AdamWDesc*>(table), static_cast<int>(entries.size()), with_decay, without);
        });
      });
    });
  });
  MF_CUDA_LAUNCHED("AdamWBatch");
}

}  // namespace moefold::cuda
