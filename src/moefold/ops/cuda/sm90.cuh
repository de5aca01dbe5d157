// Hopper (sm_90a) building blocks of moefold's own GEMM kernels (fp8_grouped_gemm.cu,
// wgrad_grouped_gemm.cu): shared-memory barriers, TMA loads and stores, wgmma's fences, and the
// driver's tensor-map encoder. The device functions exist only where MOEFOLD_SM90A_DEVICE is
// defined (device code for sm_90a, whose wgmma and TMA instructions they use); the kernels guard
// their bodies with it.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "moefold/ops/cuda/common.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MOEFOLD_SM90A_DEVICE 1
#endif

namespace moefold::cuda::sm90 {

#ifdef MOEFOLD_SM90A_DEVICE
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred ready;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 ready, [%0], %1;\n"
      "@!ready bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// After every thread's mbarrier.init: the inits visible to the asynchronous proxy (TMA).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// This thread's generic-proxy writes of shared memory visible to the asynchronous proxy (wgmma's
// operand reads, TMA stores) after the barrier that follows.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// A named barrier of `threads` threads (whole warps), id 1..15 (0 is __syncthreads').
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// TMA tile loads (landing on bar's transaction count; boxes past the tensor fill zeros).
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// The same load multicast: the box lands at dst's offset in the shared memory of every CTA of the
// cluster in cta_mask, each completing the bytes on its own barrier at bar's offset.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                                      uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%3, "
      "%4}], [%2], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "h"(cta_mask)
      : "memory");
}
// This CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// Arrives on the barrier at bar's offset in the shared memory of the cluster's CTA `cta` (this one
// included). The arrival's release is the CTA's, not the cluster's (a cluster-scope release costs a
// memory barrier of this thread's earlier accesses, and the stage's readers are wgmma's, already
// waited for).
__device__ __forceinline__ void bar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(cta)
      : "memory");
}
// Every thread of the cluster that has not exited meets here (barrier inits and shared memory seen
// across the cluster; no CTA leaves while another may still reach its shared memory).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
// A TMA tile store (the parts of the box past the tensor are not written), in this thread's
// current bulk group; store_commit closes the group, store_wait_read<N> waits until at most N
// groups still read their shared memory, store_wait_all until every group's writes are done.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, const void* src, int c0, int c1, int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_addr(src)), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
__device__ __forceinline__ void store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of d across the asynchronous MMAs.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
#endif

// Inline-asm pieces of the wgmma instructions (m64nN, f32 accumulators): the accumulators as
// operands (8 and 64 of them from d[i] on), their register lists in the instruction (the first 64
// or 128 operands), and the setup of the predicate p (accumulate, else overwrite) and of the
// descriptors da and db from 32-bit operands (a's and b's low words and the high word they share),
// the operands named as strings ("%64").
#define MOEFOLD_WGMMA_D8(d, i)                                                                          \
  "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
      "+f"(d[(i) + 6]), "+f"(d[(i) + 7])
#define MOEFOLD_WGMMA_D64(d, i)                                                                                       \
  MOEFOLD_WGMMA_D8(d, i), MOEFOLD_WGMMA_D8(d, (i) + 8), MOEFOLD_WGMMA_D8(d, (i) + 16), MOEFOLD_WGMMA_D8(d, (i) + 24), \
      MOEFOLD_WGMMA_D8(d, (i) + 32), MOEFOLD_WGMMA_D8(d, (i) + 40), MOEFOLD_WGMMA_D8(d, (i) + 48),                    \
      MOEFOLD_WGMMA_D8(d, (i) + 56)
#define MOEFOLD_WGMMA_ACC64                                                          \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "          \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define MOEFOLD_WGMMA_ACC128                                                                     \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                      \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "             \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "             \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "             \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "             \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "             \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define MOEFOLD_WGMMA_SETUP(a_lo, b_lo, hi, accumulate) \
  ".reg .pred p;\n"                                     \
  ".reg .b64 da, db;\n"                                 \
  "setp.ne.b32 p, " accumulate                          \
  ", 0;\n"                                              \
  "mov.b64 da, {" a_lo ", " hi                          \
  "};\n"                                                \
  "mov.b64 db, {" b_lo ", " hi "};\n"

// cuTensorMapEncodeTiled through the runtime (no link against the driver library).
inline PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MF_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    MF_CHECK(found == cudaDriverEntryPointSuccess && f != nullptr, "cuTensorMapEncodeTiled not found in the driver");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A tiled TMA map of `rank` dims (inner first; byte strides of the outer ones), boxes of `box`
// elements, unit element strides; out-of-bounds boxes fill zeros on loads and are not written by
// stores. `what` names the kernel in the failure.
inline CUtensorMap tiled_map(const void* base, CUtensorMapDataType type, int rank, const uint64_t* dims,
                             const uint64_t* strides, const uint32_t* box, CUtensorMapSwizzle swizzle,
                             const char* what) {
  CUtensorMap map{};
  const cuuint32_t unit[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode_tiled()(&map, type, static_cast<cuuint32_t>(rank), const_cast<void*>(base), dims, strides,
                                    box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MF_CHECK(r == CUDA_SUCCESS, what, ": cuTensorMapEncodeTiled failed (", static_cast<int>(r), ")");
  return map;
}

// The kernel's body exists only in sm_90a code: anything else would run an empty kernel. Fails
// naming `what` unless `kernel` was built for sm_90a (else sets its dynamic shared memory).
template <class Kernel>
void require_sm90a(Kernel* kernel, int smem_bytes, const char* what) {
  cudaFuncAttributes attr{};
  MF_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  MF_CHECK(attr.binaryVersion == 90, what, " needs an sm_90a GPU and a build for it ",
           "(MOEFOLD_CUDA_ARCHS with 90a); this kernel was built for sm_", attr.binaryVersion);
  MF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
}

}  // namespace moefold::cuda::sm90
