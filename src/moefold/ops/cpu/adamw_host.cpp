// adamw_update_host (ops/ops.h): the CUDA kernel's element update (ops/cuda/optimizer.cu) on the
// host. Built with -ffp-contract=off (CMakeLists.txt), so no multiply-add is fused and every
// operation rounds as the kernel's _rn intrinsics do; with -O3 -fno-math-errno the loops vectorise
// (division and square root are correctly rounded in every vector width).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

#include "moefold/core/dtype.h"
#include "moefold/core/error.h"
#include "moefold/core/host_threads.h"
#include "moefold/ops/adamw_args.h"
#include "moefold/ops/ops.h"

namespace moefold {

namespace {

// bf16 <-> f32 as core/dtype.h's, written without branches or calls so the loop vectorises.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t narrow(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);  // NaN stays NaN
}
inline void store(float x, float& to) { to = x; }
inline void store(float x, uint16_t& to) { to = narrow(x); }

// AVX2 where the CPU has it (chosen at load time), else the x86-64 baseline: the same roundings.
// (GCC's multiversioning; clang's does not take templates, so a clang build, scripts/fuzz.sh's,
// keeps the baseline.)
#if defined(__clang__)
#define MOEFOLD_AVX2_CLONES
#else
#define MOEFOLD_AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#endif
template <bool kCompute, class G, class M, class V>
MOEFOLD_AVX2_CLONES void update_run(const AdamWArgs a, float* __restrict w, const G* __restrict g, M* __restrict m,
                                    V* __restrict v, uint16_t* __restrict wc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = widen(g[i]) * a.gs;
    const float mi = a.b1 * widen(m[i]) + a.omb1 * gi;
    const float vi = a.b2 * widen(v[i]) + (a.omb2 * gi) * gi;
    const float den = std::sqrt(vi) * a.inv_sqrt_bc2 + a.eps;
    const float wi = w[i] * a.wd - (a.step_size * mi) / den;
    store(mi, m[i]);
    store(vi, v[i]);
    w[i] = wi;
    if constexpr (kCompute) wc[i] = narrow(wi);
  }
}

template <class G, class M, class V>
void update(const AdamWArgs& a, float* w, const G* g, M* m, V* v, uint16_t* wc, int64_t n) {
  if (wc)
    update_run<true>(a, w, g, m, v, wc, n);
  else
    update_run<false>(a, w, g, m, v, wc, n);
}

// Calls f.template operator()<T>() with T float for f32, uint16_t (bf16 bits) for bf16.
template <class F>
void with_type(DType t, const char* what, F&& f) {
  if (t == DType::f32) return f.template operator()<float>();
  MF_CHECK(t == DType::bf16, "adamw_update_host: ", what, " is ", dtype_name(t), " (f32 or bf16)");
  f.template operator()<uint16_t>();
}

}  // namespace

void adamw_update_host(const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v, const AdamWStep& s,
                       const Tensor& w_compute, HostThreads* threads) {
  for (const Tensor* t : {&w, &g, &m, &v})
    MF_CHECK(t->device() == Device::cpu && t->contiguous() && t->numel() == w.numel(), "adamw_update_host: ", t->str(),
             " vs w ", w.str());
  MF_CHECK(w.dtype() == DType::f32, "adamw_update_host: w ", w.str(), " (f32 master weights)");
  MF_CHECK(!w_compute.defined() || (w_compute.dtype() == DType::bf16 && w_compute.numel() == w.numel() &&
                                    w_compute.device() == Device::cpu),
           "adamw_update_host: compute copy ", w_compute.str(), " (bf16, like w)");
  const AdamWArgs a = adamw_args(s);
  const int64_t n = w.numel(), block = int64_t{1} << 16, blocks = (n + block - 1) / block;
  with_type(g.dtype(), "g", [&]<class G>() {
    with_type(m.dtype(), "m", [&]<class M>() {
      with_type(v.dtype(), "v", [&]<class V>() {
        // One pointer captured: std::function keeps it without a heap allocation.
        struct Job {
          AdamWArgs a;
          float* w;
          const G* g;
          M* m;
          V* v;
          uint16_t* c;
          int64_t n, block;
        } job{a,
              w.ptr<float>(),
              static_cast<const G*>(g.data()),
              static_cast<M*>(m.data()),
              static_cast<V*>(v.data()),
              w_compute.defined() ? static_cast<uint16_t*>(w_compute.data()) : nullptr,
              n,
              block};
        const std::function<void(int64_t)> run = [&job](int64_t b) {
          const int64_t i = b * job.block, k = std::min(job.block, job.n - i);
          update(job.a, job.w + i, job.g + i, job.m + i, job.v + i, job.c ? job.c + i : nullptr, k);
        };
        if (threads)
          threads->parallel_for(blocks, run);
        else
          for (int64_t b = 0; b < blocks; ++b) run(b);
      });
    });
  });
}

}  // namespace moefold
