// moefold's own blockwise-scaled FP8 grouped GEMM for Hopper (sm_90a): the experts' forward and
// data-gradient GEMMs (kernels.fp8_tile rows = own). One persistent launch for all experts, with
// one TMA descriptor for every expert's rows (A: the rows of all experts, contiguous) and one for
// every expert's weight (B: [E, N, K], indexed by the tile's expert), so nothing per group is
// rewritten while a CTA moves from expert to expert (CUTLASS's pointer-array kernel rewrites its
// descriptors at each move). See docs/design-notes.md, "FP8 blockwise, third part".
//
// d[r, n] (bf16) = sum over 128-long blocks kb of (sum_{k in kb} a[r, k] b_e[n, k]) * sa[r, kb] * sb_e[kb, n / 128]
//
// for each row r of expert e. Per CTA tile (128 rows of one expert x 128 columns), in the producer
// warp group: one thread loads the A and B tiles of 128 x 128 bytes per K block with TMA (128-byte
// swizzle) into a ring of kStages stages, and a scale warp copies each stage's 128 A scales and its
// B scale into shared memory (cp.async, landing on the stage's barrier); two consumer warp groups
// (64 rows each) sum each K block with four wgmma.m64n128k32 (E4M3, f32 accumulators in the tensor
// cores), then promote: acc += part * sa * sb (DeepSeek-V3's recipe; the same instructions in the
// same order as CUTLASS's blockwise mainloop, so the same bits), and stage the bf16 output in
// shared memory for 16-byte row stores. A tile's rows past its expert's end belong to the next
// expert (or are past the tensor: TMA fills zeros): they are computed with the wrong weight and
// never stored.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/fp8.h"
#include "moefold/ops/cuda/sm90.cuh"

namespace moefold::cuda {

namespace {

using namespace sm90;

constexpr int kBlockM = 128;  // rows per CTA tile (two consumer warp groups of 64)
constexpr int kBlockN = 128;  // columns per tile: one weight scale block
constexpr int kBlockK = 128;  // one scale block of the reduction; 128 bytes of E4M3: the swizzle span
constexpr int kStages = 5;
constexpr int kOutPitch = kBlockN * 2 + 16;  // bytes per staged output row (the pad spreads the banks)
constexpr int kThreads = 384;                // a producer warp group and two consumer warp groups
constexpr int kMaxGroups = 1024;
constexpr uint32_t kStageBytesA = kBlockM * kBlockK, kStageBytesB = kBlockN * kBlockK;

struct Params {
  const int64_t* off;  // [groups + 1] row offsets on the device, or nullptr: one group of `rows`
  int64_t rows;
  int groups;
  int n, k;          // output columns, reduction length
  const float* sfa;  // A's scales in the grouped rows layout (launch_fp8_quantize_rows)
  const float* sfb;  // B's block scales, group e's [ceil(K / 128), ceil(N / 128)] at e * kb * nb
  __nv_bfloat16* d;  // [rows, n]
};

// Shared memory: the stages (1024-byte aligned: the swizzle's repeat), the barriers, the groups'
// tile prefix sums.
struct alignas(1024) Smem {
  uint8_t a[kStages][kStageBytesA];
  uint8_t b[kStages][kStageBytesB];
  uint8_t out[2][64 * kOutPitch];    // each consumer warp group's 64 output rows, staged for the stores
  float sa[kStages][kBlockM];        // A's scales of the stage's rows (0 past the group)
  float sb[kStages][4];              // B's scale of the stage's block (padded to 16 bytes)
  uint64_t full[kStages];            // TMA's bytes and the scale warp's 32 copies landed
  uint64_t empty[kStages];           // the consumers' 8 warps are done with the stage
  int tiles_before[kMaxGroups + 1];  // M tiles of the groups before group e
  int begin[kMaxGroups + 1];         // the groups' row offsets
};

#ifdef MOEFOLD_SM90A_DEVICE
// 4 bytes from global to shared memory, asynchronously; zeros when !valid (src is not read).
__device__ __forceinline__ void copy_async_4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}
// One arrival on bar once this thread's cp.async copies so far have landed (counted in bar's
// initial count).
__device__ __forceinline__ void copies_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// A wgmma shared-memory descriptor of a K-major tile in the 128-byte swizzle (rows of 128 bytes,
// 8-row groups 1024 bytes apart). Advancing by 32 bytes of K adds 2 to it.
__device__ __forceinline__ uint64_t gmma_desc(const void* tile) {
  uint64_t desc = (smem_addr(tile) & 0x3FFFF) >> 4;  // start address / 16
  desc |= uint64_t{1} << 16;                         // leading byte offset (unused by the swizzle)
  desc |= uint64_t{1024 >> 4} << 32;                 // stride byte offset: 8 rows x 128 bytes
  desc |= uint64_t{1} << 62;                         // 128-byte swizzle
  return desc;
}

// A float of shared memory, read in program order with the asm around it (issued between a
// block's MMAs and the wait for them, its latency hides under their drain).
__device__ __forceinline__ float ld_shared_f32(const float* p) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(smem_addr(p)) : "memory");
  return v;
}

// d (64 rows x 128 columns over the warp group) (+)= A (64 x 32, smem) B^T (128 x 32, smem). The
// descriptors as their low words and the high word they share (gmma_desc's, the same for every
// tile): 32-bit arithmetic on warp-uniform values between the MMAs, not 64-bit adds per MMA.
__device__ __forceinline__ void wgmma_m64n128k32(float (&d)[64], uint32_t desc_a_lo, uint32_t desc_b_lo,
                                                 uint32_t desc_hi, bool accumulate) {
  asm volatile(
      "{\n" MOEFOLD_WGMMA_SETUP("%64", "%65", "%66",
                                "%67") "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " MOEFOLD_WGMMA_ACC64
                                       ", da, db, p, 1, 1;\n"
                                       "}\n"
      : MOEFOLD_WGMMA_D64(d, 0)
      : "r"(desc_a_lo), "r"(desc_b_lo), "r"(desc_hi), "r"(static_cast<int>(accumulate)));
}

// The CTA's tiles in order: tile t is M tile g = t / n_tiles (of all groups' M tiles in group
// order) and N tile t % n_tiles. Consecutive CTAs share an A tile; an expert's weight stays in L2
// while its M tiles pass.
struct TileWalk {
  const int* tiles_before;
  int n_tiles;
  int e = 0;
  // Group, the tile's first row within the group, and its N tile.
  __device__ void at(int t, int& group, int& m_tile, int& n_tile) {
    const int g = t / n_tiles;
    while (tiles_before[e + 1] <= g) ++e;
    group = e;
    m_tile = g - tiles_before[e];
    n_tile = t - g * n_tiles;
  }
};
#endif

__global__ void __launch_bounds__(kThreads, 1)
    own_fp8_grouped_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                           const Params p) {
#ifdef MOEFOLD_SM90A_DEVICE
  extern __shared__ uint8_t raw[];
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  // The groups' M tiles, prefix-summed by warp 0.
  if (warp == 0) {
    int carry = 0;
    if (lane == 0) sm.tiles_before[0] = 0;
    for (int base = 0; base < p.groups; base += 32) {
      const int e = base + lane;
      int64_t m = 0;
      if (e < p.groups) {
        const int64_t b = p.off != nullptr ? p.off[e] : 0, end = p.off != nullptr ? p.off[e + 1] : p.rows;
        m = end - b;
        sm.begin[e] = static_cast<int>(b);
        if (e + 1 == p.groups) sm.begin[p.groups] = static_cast<int>(end);
      }
      int incl = static_cast<int>((m + kBlockM - 1) / kBlockM);
#pragma unroll
      for (int s = 1; s < 32; s *= 2) {
        const int v = __shfl_up_sync(0xffffffffu, incl, s);
        if (lane >= s) incl += v;
      }
      if (e < p.groups) sm.tiles_before[e + 1] = carry + incl;
      carry += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
  if (threadIdx.x == 32) {
    for (int s = 0; s < kStages; ++s) {
      bar_init(&sm.full[s], 1 + 32);  // the TMA thread's expect_tx and the scale warp's lanes
      bar_init(&sm.empty[s], 8);      // each consumer warp
    }
    fence_barrier_init();
  }
  __syncthreads();
  const int n_tiles = (p.n + kBlockN - 1) / kBlockN, k_blocks = (p.k + kBlockK - 1) / kBlockK;
  const int tiles = sm.tiles_before[p.groups] * n_tiles;
  TileWalk walk{sm.tiles_before, n_tiles};

  if (warp == 1) {  // the scale warp: A's and B's scales of each stage into shared memory
    int stage = 0;
    uint32_t phase = 0;
    const int n_blocks = n_tiles;
    for (int t = static_cast<int>(blockIdx.x); t < tiles; t += static_cast<int>(gridDim.x)) {
      int e, m_tile, n_tile;
      walk.at(t, e, m_tile, n_tile);
      const int64_t begin = sm.begin[e], m_e = sm.begin[e + 1] - begin;
      const float* sb = p.sfb + int64_t{e} * k_blocks * n_blocks + n_tile;
      for (int kb = 0; kb < k_blocks; ++kb) {
        bar_wait(&sm.empty[stage], phase ^ 1);
        // Row r of the tile: scale (r, kb) of group e at sfa[begin * k_blocks + kb * m_e + r - begin].
        const float* sa = p.sfa + begin * k_blocks + int64_t{kb} * m_e;
#pragma unroll
        for (int i = 0; i < kBlockM / 32; ++i) {
          const int64_t r = int64_t{m_tile} * kBlockM + lane + 32 * i;  // within the group
          copy_async_4(&sm.sa[stage][lane + 32 * i], r < m_e ? sa + r : sa, r < m_e);
        }
        if (lane == 0) copy_async_4(&sm.sb[stage][0], sb + int64_t{kb} * n_blocks, true);
        copies_arrive(&sm.full[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }
  if (warp < 4) {  // the rest of the producer warp group: one thread issues every TMA load
    if (threadIdx.x != 0) return;
    prefetch_map(&map_a);
    prefetch_map(&map_b);
    int stage = 0;
    uint32_t phase = 0;
    for (int t = static_cast<int>(blockIdx.x); t < tiles; t += static_cast<int>(gridDim.x)) {
      int e, m_tile, n_tile;
      walk.at(t, e, m_tile, n_tile);
      const int row0 = sm.begin[e] + m_tile * kBlockM;
      for (int kb = 0; kb < k_blocks; ++kb) {
        bar_wait(&sm.empty[stage], phase ^ 1);
        bar_expect_tx(&sm.full[stage], kStageBytesA + kStageBytesB);
        tma_load_2d(sm.a[stage], &map_a, &sm.full[stage], kb * kBlockK, row0);
        tma_load_3d(sm.b[stage], &map_b, &sm.full[stage], kb * kBlockK, n_tile * kBlockN, e);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    }
    return;
  }

  // A consumer warp group: rows wg * 64 ... + 63 of each tile.
  const int wg = warp / 4 - 1, wg_warp = warp % 4;
  const int row_lo = wg * 64 + wg_warp * 16 + lane / 4;  // this thread's rows in the tile: row_lo, row_lo + 8
  // Stage 0's descriptors; stage s's start s * the stage's bytes later (the address field counts 16
  // bytes and stays in the low word). Made warp-uniform so that their arithmetic can run on the
  // uniform datapath.
  const uint64_t desc_a0 = gmma_desc(sm.a[0] + wg * 64 * kBlockK), desc_b0 = gmma_desc(sm.b[0]);
  const uint32_t desc_hi = static_cast<uint32_t>(desc_a0 >> 32);
  const uint32_t desc_a0_lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(desc_a0), 0),
                 desc_b0_lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(desc_b0), 0);
  int stage = 0;
  uint32_t phase = 0;
  float acc[64], part[64];
  for (int t = static_cast<int>(blockIdx.x); t < tiles; t += static_cast<int>(gridDim.x)) {
    int e, m_tile, n_tile;
    walk.at(t, e, m_tile, n_tile);
    const int64_t end = sm.begin[e + 1];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
    for (int kb = 0; kb < k_blocks; ++kb) {
      bar_wait(&sm.full[stage], phase);
      const uint32_t ustage = __shfl_sync(0xffffffffu, static_cast<uint32_t>(stage), 0);
      const uint32_t da = desc_a0_lo + ustage * (kStageBytesA >> 4), db = desc_b0_lo + ustage * (kStageBytesB >> 4);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 32; ++kk) wgmma_m64n128k32(part, da + 2 * kk, db + 2 * kk, desc_hi, kk > 0);
      wgmma_commit();
      // The scales, read while the MMAs run (after their issue: it never waits for them).
      const float s_b = ld_shared_f32(&sm.sb[stage][0]);
      const float sa_lo = ld_shared_f32(&sm.sa[stage][row_lo]), sa_hi = ld_shared_f32(&sm.sa[stage][row_lo + 8]);
      wgmma_wait<0>();
      fence_operands(part);
      const float s_lo = sa_lo * s_b, s_hi = sa_hi * s_b;
      __syncwarp();
      if (lane == 0) bar_arrive(&sm.empty[stage]);
      if (++stage == kStages) stage = 0, phase ^= 1;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        acc[4 * j + 0] += part[4 * j + 0] * s_lo;
        acc[4 * j + 1] += part[4 * j + 1] * s_lo;
        acc[4 * j + 2] += part[4 * j + 2] * s_hi;
        acc[4 * j + 3] += part[4 * j + 3] * s_hi;
      }
    }
    // The epilogue: each thread holds rows row_lo and row_lo + 8 (of the warp group's 64: minus
    // wg * 64), columns 8j + 2 (lane % 4) + {0, 1}; staged in shared memory, then stored 16 bytes
    // a thread along whole rows. The warp group's named barrier (1 + wg) brackets the staging area.
    uint8_t* out = sm.out[wg];
    named_sync(1 + wg, 128);  // the previous tile's reads are done
    const int lr = row_lo - wg * 64;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int c = 2 * (8 * j + 2 * (lane % 4));  // byte offset of the column pair
      *reinterpret_cast<__nv_bfloat162*>(out + lr * kOutPitch + c) =
          __floats2bfloat162_rn(acc[4 * j + 0], acc[4 * j + 1]);
      *reinterpret_cast<__nv_bfloat162*>(out + (lr + 8) * kOutPitch + c) =
          __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
    }
    named_sync(1 + wg, 128);
    const int tid = static_cast<int>(threadIdx.x % 128), chunk = tid % 16;  // 16 chunks of 8 columns a row
    const int col = n_tile * kBlockN + 8 * chunk;
    const int64_t first = sm.begin[e] + int64_t{m_tile} * kBlockM + wg * 64;
    if (col < p.n) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int lrow = tid / 16 + 8 * i;
        if (first + lrow < end)
          *reinterpret_cast<uint4*>(p.d + (first + lrow) * p.n + col) =
              *reinterpret_cast<const uint4*>(out + lrow * kOutPitch + 16 * chunk);
      }
    }
  }
#endif
}

// A TMA map of E4M3 bytes with dims (inner first) and byte strides of the outer dims, boxes of
// 128 bytes x box_rows (x 1), in the 128-byte swizzle; out-of-bounds boxes fill zeros.
CUtensorMap tma_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides, uint32_t box_rows) {
  const uint32_t box[3] = {kBlockK, box_rows, 1};
  return tiled_map(base, CU_TENSOR_MAP_DATA_TYPE_UINT8, rank, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B,
                   "own FP8 grouped GEMM");
}

struct KernelState {
  int sms = 0;
};
KernelState& kernel_state() {
  static KernelState s;
  static std::once_flag once;
  std::call_once(once, [] {
    int dev = 0;
    MF_CUDA_CHECK(cudaGetDevice(&dev));
    MF_CUDA_CHECK(cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, dev));
    require_sm90a(own_fp8_grouped_kernel, static_cast<int>(sizeof(Smem) + 1024), "kernels.fp8_tile rows = own");
  });
  return s;
}

}  // namespace

bool own_fp8_gemm_serves(int64_t groups, int64_t n, int64_t k, int64_t lda) {
  return groups >= 1 && groups <= kMaxGroups && n % 16 == 0 && k % 16 == 0 && lda % 16 == 0 && n > 0 && k > 0;
}

void own_fp8_grouped_gemm(const ExecContext& ctx, const uint8_t* a, int64_t lda, const float* sfa, int64_t rows,
                          const int64_t* off, int64_t groups, const uint8_t* b, const float* sfb, int64_t n, int64_t k,
                          void* d, const char* what) {
  MF_CHECK(own_fp8_gemm_serves(groups, n, k, lda), what, ": the own FP8 GEMM cannot serve groups ", groups, ", N ", n,
           ", K ", k, ", lda ", lda);
  MF_CHECK(rows < (int64_t{1} << 31), what, ": ", rows, " rows (the own FP8 GEMM indexes rows with 32 bits)");
  if (rows == 0) return;
  KernelState& st = kernel_state();
  const uint64_t dims_a[2] = {static_cast<uint64_t>(k), static_cast<uint64_t>(rows)};
  const uint64_t strides_a[1] = {static_cast<uint64_t>(lda)};
  const uint64_t dims_b[3] = {static_cast<uint64_t>(k), static_cast<uint64_t>(n), static_cast<uint64_t>(groups)};
  const uint64_t strides_b[2] = {static_cast<uint64_t>(k), static_cast<uint64_t>(n * k)};
  const CUtensorMap map_a = tma_map(a, 2, dims_a, strides_a, kBlockM);
  const CUtensorMap map_b = tma_map(b, 3, dims_b, strides_b, kBlockN);
  Params p{off, rows, static_cast<int>(groups),      static_cast<int>(n), static_cast<int>(k),
           sfa, sfb,  static_cast<__nv_bfloat16*>(d)};
  // At most one tile per CTA more than there can be: ceil(rows / 128) + groups M tiles.
  const int64_t most = (ceil_div(rows, kBlockM) + groups) * ceil_div(n, kBlockN);
  int sms = st.sms;
  if (const int want = ctx.kernels().gemm_sms; want > 0) sms = std::min(sms, want);
  const auto grid = static_cast<unsigned>(std::min<int64_t>(sms, most));
  own_fp8_grouped_kernel<<<grid, kThreads, sizeof(Smem) + 1024, stream_of(ctx)>>>(map_a, map_b, p);
  MF_CUDA_LAUNCHED(what);
}

}  // namespace moefold::cuda
