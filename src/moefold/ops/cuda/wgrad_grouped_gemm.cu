// moefold's own bf16 grouped weight-gradient GEMM for Hopper (sm_90a): kernels.cutlass_tile
// wgrad = own. See wgrad_grouped_gemm.h and docs/design-notes.md, "The own weight-gradient kernel".
//
// dw_e[o, i] (+)= sum over the expert's rows r of dy[r, o] x[r, i]
//
// Per CTA tile: 128 weight rows (o) x kBlockN weight columns (i) of one expert; the reduction runs
// over the expert's rows in blocks of kBlockK. Both operands are read as they lie, row by row
// ("MN-major" for wgmma: dy^T's and x's contiguous dimension is the tile's M and N): one producer
// thread loads TMA boxes of kBlockK rows x 64 columns (128 bytes, 128-byte swizzle) into a ring of
// stages; two consumer warp groups (64 weight rows each, sharing x's boxes) sum each block with
// wgmma.m64nNk16 with both transpose bits set. An expert's rows start anywhere: its blocks start
// at its first row, and the last block's rows past the expert's end (the next expert's, or zeros
// past the tensor) are zeroed in shared memory before its MMAs. The epilogue stages each warp
// group's 64 x kBlockN tile in shared memory (in the 128-byte swizzle of the output's TMA boxes;
// bf16 with stmatrix, four 8 x 8 matrices an instruction; a written bf16 tile in two halves, one
// after the other, so that the staging area's other half holds two more stages) and one thread
// stores it with TMA; the warp group goes on to the next tile's blocks while the stores drain,
// and waits for them only before it writes the staging area again. Accumulating, the old
// gradient tile is loaded into the staging area by TMA at the tile's start (beside its main loop)
// and added in the epilogue:
// round(acc + old), as CUTLASS's epilogue with beta = 1. Consecutive tiles of an expert walk the
// weight's columns first: the CTAs in flight write whole rows of the gradient. In 2-CTA clusters
// the pair sums neighbouring 128-row tiles of the same columns, each CTA loading half of x's boxes
// and multicasting them to both; a stage goes back to the producers once all 16 consumer warps of
// the pair are done with it.
//
// Each output tile is summed by one CTA in a fixed order: the bits do not depend on the grid.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/sm90.cuh"
#include "moefold/ops/cuda/wgrad_grouped_gemm.h"

namespace moefold::cuda {

namespace {

using namespace sm90;

constexpr int kBlockM = 128;  // weight rows per tile: two consumer warp groups of 64
// Expert rows per main-loop block (one stage): 32, so that the stages the consumers hold (the block
// being summed and the one whose MMAs may still run) leave four loading (docs/benchmarks.md, session 33).
constexpr int kBlockK = 32;
constexpr int kInBox = kBlockK * 128;  // one operand TMA box: kBlockK rows x 128 bytes, 128-byte swizzle
constexpr int kOutBox = 64 * 128;      // one output TMA box: 64 rows x 128 bytes, 128-byte swizzle
constexpr int kThreads = 384;          // a producer warp group and two consumer warp groups
// kernels.own_wgrad_units > 1 (docs/design-notes.md, session 39): dy gets a ring of its own,
// kDySlots blocks of kBlockK rows x 128 weight rows (64 KiB), each slot with an empty barrier of
// the CTA's consumer warps. A unit of consecutive column tiles of one expert and the same weight
// rows loads the expert's dy blocks once, with its first tile's x stages, and keeps them for the
// others: only x streams. Only where every expert has at most kDySlots blocks of rows (checked on
// the device); else that launch takes tiles one at a time, dy with its x stage as without units.
constexpr int kDySlots = 8;
// kCluster CTAs a cluster (2 unless own_grouped_wgrad is told 1) sum neighbouring 128-row tiles
// of the same columns of one expert, each loading 1 / kCluster of x's boxes and multicasting them
// to all: x's reads from L2 halve in pairs.

// Tile width and stages per output type, and the parts a warp group's tile is staged in (kParts):
// bf16 256 columns, staged whole (64 KiB: six stages of 24 KiB beside it) or, written, in two
// halves of 128 columns (32 KiB: the other 32 KiB make eight stages; 4% faster at DeepSeek-V3's
// and Qwen3's fc1 on the H200, docs/benchmarks.md, session 36); f32 128 columns, staged whole
// with eight stages of 16 KiB (in halves with twelve it was slower).
template <class Out, int kParts>
struct Config;
template <int kParts>
struct Config<__nv_bfloat16, kParts> {
  static constexpr int kBlockN = 256, kStages = kParts == 1 ? 6 : 8;
};
template <int kParts>
struct Config<float, kParts> {
  static_assert(kParts == 1, "f32 tiles are staged whole");
  static constexpr int kBlockN = 128, kStages = 8;
};

template <class Out, int kParts, bool kUnits = false>
struct alignas(1024) Smem {
  static constexpr int kBlockN = Config<Out, kParts>::kBlockN, kStages = Config<Out, kParts>::kStages;
  static constexpr int kPartCols = kBlockN / kParts;                      // output columns staged at once
  static constexpr int kChunkCols = 128 / static_cast<int>(sizeof(Out));  // output columns per staged box row
  static constexpr int kChunks = kPartCols / kChunkCols;                  // output boxes per warp group and part
  static constexpr int kDyBlocks = kUnits ? kDySlots : kStages;
  uint8_t a[kDyBlocks][2 * kInBox];           // dy: kBlockK rows x 128 weight rows, two boxes of 64 columns
  uint8_t b[kStages][kBlockN / 64 * kInBox];  // x: kBlockK rows x kBlockN weight columns
  uint8_t out[2][kChunks * kOutBox];          // each consumer warp group's 64 x kPartCols outputs, as TMA boxes
  uint64_t full[kStages];                     // the stage's boxes landed
  uint64_t empty[kStages];                    // every consumer warp of the cluster is done with the stage
  uint64_t old[2];                            // each warp group's old gradient tile landed (accumulating)
  uint64_t dy_empty[kUnits ? kDySlots : 1];   // units: every consumer warp of this CTA is done with the dy slot
};

// Each layout, with the 1024 bytes of alignment slack, within an SM's 227 KiB of shared memory.
static_assert(sizeof(Smem<__nv_bfloat16, 1>) + 1024 <= 227 * 1024 && sizeof(Smem<float, 1>) + 1024 <= 227 * 1024);
static_assert(sizeof(Smem<__nv_bfloat16, 2>) + 1024 <= 227 * 1024);
static_assert(sizeof(Smem<__nv_bfloat16, 1, true>) + 1024 <= 227 * 1024 &&
              sizeof(Smem<__nv_bfloat16, 2, true>) + 1024 <= 227 * 1024 &&
              sizeof(Smem<float, 1, true>) + 1024 <= 227 * 1024);

struct Params {
  const int64_t* off;  // [groups + 1] the experts' row offsets
  int groups;
  int o_groups;  // the clusters' units of weight rows: ceil(128-row tiles / the cluster's CTAs)
  int i_tiles;
  int accumulate;
  int parts;        // units: the parts an expert's o_group's columns are cut into
  int force_units;  // units: also where some expert has more rows than dy's ring holds (tests)
};

#ifdef MOEFOLD_SM90A_DEVICE
// A wgmma shared-memory descriptor of an MN-major operand in the 128-byte swizzle, as the TMA
// boxes lie: each row (one k) holds 64 consecutive m (or n) in 128 bytes, 8-row groups 1024 bytes
// apart (stride byte offset), the next 64 m (n) one box further (leading byte offset). A 16-row
// step of k adds 2048 bytes (128 to the low word).
__device__ __forceinline__ uint64_t desc_mn(const void* tile) {
  uint64_t desc = (smem_addr(tile) & 0x3FFFF) >> 4;  // start address / 16
  desc |= uint64_t{kInBox >> 4} << 16;               // leading byte offset: the next 64 columns
  desc |= uint64_t{1024 >> 4} << 32;                 // stride byte offset: the next 8 rows
  desc |= uint64_t{1} << 62;                         // 128-byte swizzle
  return desc;
}

// d (64 x N over the warp group) (+)= A (64 x 16) B (16 x N), both MN-major bf16 in shared memory.
// The descriptors as their low words and the high word they share (desc_mn's, the same for every
// tile).
template <int N>
__device__ __forceinline__ void wgmma_bf16_mn(float (&d)[N / 2], uint32_t desc_a_lo, uint32_t desc_b_lo,
                                              uint32_t desc_hi, bool accumulate) {
  if constexpr (N == 128) {
    asm volatile(
        "{\n" MOEFOLD_WGMMA_SETUP("%64", "%65", "%66",
                                  "%67") "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " MOEFOLD_WGMMA_ACC64
                                         ", da, db, p, 1, 1, 1, 1;\n"
                                         "}\n"
        : MOEFOLD_WGMMA_D64(d, 0)
        : "r"(desc_a_lo), "r"(desc_b_lo), "r"(desc_hi), "r"(static_cast<int>(accumulate)));
  } else {
    static_assert(N == 256);
    asm volatile(
        "{\n" MOEFOLD_WGMMA_SETUP("%128", "%129", "%130",
                                  "%131") "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " MOEFOLD_WGMMA_ACC128
                                          ", da, db, p, 1, 1, 1, 1;\n"
                                          "}\n"
        : MOEFOLD_WGMMA_D64(d, 0), MOEFOLD_WGMMA_D64(d, 64)
        : "r"(desc_a_lo), "r"(desc_b_lo), "r"(desc_hi), "r"(static_cast<int>(accumulate)));
  }
}

// Zeroes an operand box's rows from `from` on (whole 128-byte rows: the swizzle permutes 16-byte
// units within a row), 128 threads.
__device__ __forceinline__ void zero_rows_from(uint8_t* box, int from, int tid) {
  for (int u = from * 8 + tid; u < kBlockK * 8; u += 128)
    *reinterpret_cast<uint4*>(box + 16 * u) = make_uint4(0, 0, 0, 0);
}

// The byte of output (row, col) in a warp group's staging area: box col / kChunkCols, its row's
// 16-byte units swizzled as TMA's 128-byte swizzle lays them (unit ^ row % 8).
template <class Out>
__device__ __forceinline__ int staged_byte(int row, int col) {
  constexpr int kChunkCols = Smem<Out, 1>::kChunkCols;
  const int byte = (col % kChunkCols) * static_cast<int>(sizeof(Out));
  return (col / kChunkCols) * kOutBox + row * 128 + ((((byte >> 4) ^ (row & 7)) << 4) | (byte & 15));
}
#endif

template <class Out, int kCluster, int kParts, bool kUnits>
__global__ void __launch_bounds__(kThreads, 1)
    own_wgrad_kernel(const __grid_constant__ CUtensorMap map_dy, const __grid_constant__ CUtensorMap map_x,
                     const __grid_constant__ CUtensorMap map_dw, const Params p) {
#ifdef MOEFOLD_SM90A_DEVICE
  using S = Smem<Out, kParts, kUnits>;
  constexpr int kBlockN = S::kBlockN, kStages = S::kStages, kChunkCols = S::kChunkCols, kPartCols = S::kPartCols;
  const bool accumulate = kParts == 1 && p.accumulate;  // (the launch stages accumulated tiles whole)
  extern __shared__ uint8_t raw[];
  S& sm = *reinterpret_cast<S*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t{1023});
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      bar_init(&sm.full[s], 1);              // the TMA thread's expect_tx
      bar_init(&sm.empty[s], 8 * kCluster);  // each consumer warp of the cluster
    }
    bar_init(&sm.old[0], 1);
    bar_init(&sm.old[1], 1);
    if constexpr (kUnits)
      for (int s = 0; s < kDySlots; ++s) bar_init(&sm.dy_empty[s], 8);  // each consumer warp of this CTA
    fence_barrier_init();
  }
  if constexpr (kCluster > 1)
    cluster_sync();  // the barriers of every CTA of the cluster initialized
  else
    __syncthreads();
  const uint32_t rank = kCluster > 1 ? cluster_rank() : 0;
  const int cluster = static_cast<int>(blockIdx.x) / kCluster, clusters = static_cast<int>(gridDim.x) / kCluster;
  const int per_expert = p.o_groups * p.i_tiles, tiles = p.groups * per_expert;
  // Cluster tile t: expert t / per_expert; within it, along the weight's columns first (consecutive
  // tiles write neighbouring pieces of the same rows of the gradient). This CTA's 128 rows: the
  // rank's of the cluster's kCluster x 128.
  const auto tile_at = [&](int t, int& e, int& o_tile, int& i_tile) {
    e = t / per_expert;
    const int rest = t - e * per_expert;
    const int o_group = rest / p.i_tiles;
    i_tile = rest - o_group * p.i_tiles;
    o_tile = o_group * kCluster + static_cast<int>(rank);
  };
  // Units: cluster unit u is expert e's o_group's part-th share of the columns, tiles [i0, i1) in
  // the order above; its dy stays in the ring for all of them. Units of one tile (parts = i_tiles,
  // dy with its x stage) where some expert has more rows than the ring holds, unless forced (then
  // such an expert's dy streams through the ring block by block); each CTA reads the offsets
  // itself, so every CTA of a cluster decides alike.
  int parts = p.i_tiles;
  if constexpr (kUnits) {
    parts = p.parts;
    int streams = 0;
    for (int e = static_cast<int>(threadIdx.x); e < p.groups; e += kThreads)
      streams |= p.off[e + 1] - p.off[e] > kBlockK * kDySlots;
    if (__syncthreads_or(streams) && !p.force_units) parts = p.i_tiles;
  }
  const int units = p.groups * p.o_groups * parts;
  const bool tiles_only = parts == p.i_tiles;  // units of one tile: each block's dy in its stage's slot, no ring
  struct Unit {
    int e, o_tile, i0, i1, blocks;  // blocks: the expert's blocks of kBlockK rows
    bool stay;
  };
  const auto unit_at = [&](int u) {
    Unit un;
    const int eo = u / parts, part = u - eo * parts;
    un.e = eo / p.o_groups;
    un.o_tile = (eo - un.e * p.o_groups) * kCluster + static_cast<int>(rank);
    un.i0 = part * p.i_tiles / parts;
    un.i1 = (part + 1) * p.i_tiles / parts;
    un.blocks = (static_cast<int>(p.off[un.e + 1] - p.off[un.e]) + kBlockK - 1) / kBlockK;
    un.stay = un.i1 - un.i0 > 1 && un.blocks <= kDySlots;
    return un;
  };
  // tile(e, o_tile, i_tile, dy_first, dy_fresh, dy_last) for each tile of this cluster in order, as
  // the producer and the consumers both walk them: units (dy's block j of the tile at ring position
  // dy_first + j, loaded with the tile where dy_fresh, given back after it where dy_last) or single
  // tiles (dy with its stage).
  const auto walk = [&](const auto& tile) {
    if constexpr (kUnits) {
      int dy_pos = 0;
      for (int u = cluster; u < units; u += clusters) {
        const Unit un = unit_at(u);
        for (int i_tile = un.i0; i_tile < un.i1; ++i_tile) {
          tile(un.e, un.o_tile, i_tile, dy_pos, !un.stay || i_tile == un.i0, !un.stay || i_tile == un.i1 - 1);
          if (!un.stay) dy_pos += un.blocks;
        }
        if (un.stay) dy_pos += un.blocks;
      }
    } else {
      for (int t = cluster; t < tiles; t += clusters) {
        int e, o_tile, i_tile;
        tile_at(t, e, o_tile, i_tile);
        tile(e, o_tile, i_tile, 0, true, true);
      }
    }
  };

  if (warp < 4) {  // the producer warp group: one thread issues every TMA load
    // Units: the consumers' 128 accumulators a thread and the units' bookkeeping need more than an
    // even share of the registers (168) to run without spills; the producers need few.
    if constexpr (kUnits) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x != 0) return;
    prefetch_map(&map_dy);
    prefetch_map(&map_x);
    int stage = 0;
    uint32_t phase = 0;
    // A block's x boxes, this rank's share multicast to every CTA of the cluster.
    const auto load_x = [&](int i_tile, int row) {
#pragma unroll
      for (int c = 0; c < kBlockN / 64; ++c) {
        if constexpr (kCluster > 1) {
          if (c % kCluster == static_cast<int>(rank))
            tma_load_2d_multicast(sm.b[stage] + c * kInBox, &map_x, &sm.full[stage], i_tile * kBlockN + c * 64, row,
                                  static_cast<uint16_t>((1u << kCluster) - 1));
        } else {
          tma_load_2d(sm.b[stage] + c * kInBox, &map_x, &sm.full[stage], i_tile * kBlockN + c * 64, row);
        }
      }
    };
    walk([&](int e, int o_tile, int i_tile, int dy_first, bool dy_fresh, bool) {
      const int begin = static_cast<int>(p.off[e]), end = static_cast<int>(p.off[e + 1]);
      for (int row = begin; row < end; row += kBlockK) {
        bar_wait(&sm.empty[stage], phase ^ 1);
        int slot = stage;  // single tiles: dy in its stage's slot
        if constexpr (kUnits) {
          const int q = dy_first + (row - begin) / kBlockK;
          if (!tiles_only) {
            slot = q % kDySlots;
            if (dy_fresh) bar_wait(&sm.dy_empty[slot], ((q / kDySlots) & 1) ^ 1);
          }
        }
        bar_expect_tx(&sm.full[stage], (kBlockN / 64 + (dy_fresh ? 2 : 0)) * kInBox);
        if (dy_fresh) {
#pragma unroll
          for (int h = 0; h < 2; ++h)
            tma_load_2d(sm.a[slot] + h * kInBox, &map_dy, &sm.full[stage], o_tile * kBlockM + h * 64, row);
        }
        load_x(i_tile, row);
        if (++stage == kStages) stage = 0, phase ^= 1;
      }
    });
    return;
  }

  // A consumer warp group: weight rows wg * 64 ... + 63 of each tile.
  const int wg = warp / 4 - 1, tid = static_cast<int>(threadIdx.x % 128);
  const bool leader = tid == 0;               // issues the warp group's TMA stores (and old-gradient loads)
  const int lr = (warp % 4) * 16 + lane / 4;  // this thread's rows of the 64: lr, lr + 8
  uint8_t* out = sm.out[wg];
  // Stage 0's descriptors; stage s's start s * the stage's bytes later (the address field counts 16
  // bytes and stays in the low word), made warp-uniform for the uniform datapath.
  const uint64_t desc_a0 = desc_mn(sm.a[0] + wg * kInBox), desc_b0 = desc_mn(sm.b[0]);
  const uint32_t desc_hi = static_cast<uint32_t>(desc_a0 >> 32);
  const uint32_t desc_a0_lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(desc_a0), 0),
                 desc_b0_lo = __shfl_sync(0xffffffffu, static_cast<uint32_t>(desc_b0), 0);
  constexpr uint32_t kStepA = sizeof(sm.a[0]) >> 4, kStepB = sizeof(sm.b[0]) >> 4;
  int stage = 0;
  uint32_t phase = 0, old_phase = 0;
  float acc[kBlockN / 2];
  // A stage goes back to the producers once every consumer warp of the cluster is done with it.
  const auto release = [&](int s) {
    bar_arrive(&sm.empty[s]);
    for (uint32_t r = 0; r < kCluster; ++r)
      if (r != rank) bar_arrive_cluster(&sm.empty[s], r);
  };
  // One output tile. Units: dy's block j in ring position dy_first + j (single tiles of a launch of
  // units: the stage's slot), loaded with this tile's stages where dy_fresh, given back after this
  // tile's MMAs where dy_last.
  const auto run_tile = [&](int e, int o_tile, int i_tile, int dy_first, bool dy_fresh, bool dy_last) {
    const int begin = static_cast<int>(p.off[e]), end = static_cast<int>(p.off[e + 1]);
    const int out_row = o_tile * kBlockM + wg * 64, out_col = i_tile * kBlockN;
    if (accumulate && leader) {  // the old gradient into the staging area, once the last stores read it
      store_wait_read<0>();
      bar_expect_tx(&sm.old[wg], S::kChunks * kOutBox);
#pragma unroll
      for (int c = 0; c < S::kChunks; ++c)
        tma_load_3d(out + c * kOutBox, &map_dw, &sm.old[wg], out_col + c * kChunkCols, out_row, e);
    }
    int prev = -1;   // the stage of the block whose MMAs may still run
    int prev_q = 0;  // units: its dy's ring position
    for (int row = begin; row < end; row += kBlockK) {
      bar_wait(&sm.full[stage], phase);
      int q = 0;  // units: the ring position of this block's dy
      if constexpr (kUnits) q = dy_first + (row - begin) / kBlockK;
      const int slot = kUnits && !tiles_only ? q % kDySlots : stage;
      const int valid = min(kBlockK, end - row);
      if (valid < kBlockK) {  // the expert's last block: its rows from `valid` on are not the expert's
        if (dy_fresh) zero_rows_from(sm.a[slot] + wg * kInBox, valid, tid);  // (a kept block stays zeroed)
        for (int c = wg; c < kBlockN / 64; c += 2) zero_rows_from(sm.b[stage] + c * kInBox, valid, tid);
        fence_async_shared();
        named_sync(3, 256);  // both warp groups' zeros written (they share x's boxes)
      }
      const uint32_t ustage = __shfl_sync(0xffffffffu, static_cast<uint32_t>(stage), 0),
                     uslot = kUnits ? __shfl_sync(0xffffffffu, static_cast<uint32_t>(slot), 0) : ustage;
      const uint32_t da = desc_a0_lo + uslot * kStepA, db = desc_b0_lo + ustage * kStepB;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk)
        wgmma_bf16_mn<kBlockN>(acc, da + 128 * kk, db + 128 * kk, desc_hi, row > begin || kk > 0);
      wgmma_commit();
      wgmma_wait<1>();  // the previous block's MMAs are done: its stage goes back to the producer
      __syncwarp();
      if (prev >= 0 && lane == 0) {
        release(prev);
        if (kUnits && dy_last && !tiles_only) bar_arrive(&sm.dy_empty[prev_q % kDySlots]);
      }
      prev = stage;
      prev_q = q;
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    wgmma_wait<0>();
    fence_operands(acc);
    __syncwarp();
    if (prev >= 0 && lane == 0) {
      release(prev);
      if (kUnits && dy_last && !tiles_only) bar_arrive(&sm.dy_empty[prev_q % kDySlots]);
    }
    const bool summed = prev >= 0;  // else no rows (acc never written): zeros written, or the old gradient kept
    // The epilogue: each thread holds rows lr and lr + 8, columns 8j + 2 (lane % 4) + {0, 1}; staged
    // and stored kPartCols columns at a time.
    if (accumulate) {
      bar_wait(&sm.old[wg], old_phase);
      old_phase ^= 1;
    }
#pragma unroll
    for (int part = 0; part < kParts; ++part) {
      const int col0 = part * kPartCols;
      if (!accumulate) {
        if (leader) store_wait_read<0>();  // the last stores have read the staging area
        named_sync(1 + wg, 128);
      }
      if constexpr (sizeof(Out) == 2) {
        // Two 8-column groups a step: four 8 x 8 matrices (rows lr's and lr + 8's 8-row blocks, groups
        // j and j + 1), stored with one stmatrix (lane l gives row l % 8 of matrix l / 8).
        const int m = lane / 8, m_row = (warp % 4) * 16 + lane % 8 + 8 * (m & 1);
#pragma unroll
        for (int j = col0 / 8; j < (col0 + kPartCols) / 8; j += 2) {
          const uint32_t addr = smem_addr(out + staged_byte<Out>(m_row, 8 * (j + (m >> 1)) - col0));
          float v[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = summed ? acc[4 * j + i] : 0.0f;
          if (accumulate) {
            uint32_t old[4];
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                         : "=r"(old[0]), "=r"(old[1]), "=r"(old[2]), "=r"(old[3])
                         : "r"(addr)
                         : "memory");
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float2 o = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&old[i]));
              v[2 * i] += o.x;
              v[2 * i + 1] += o.y;
            }
          }
          uint32_t r[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
            r[i] = *reinterpret_cast<const uint32_t*>(&b);
          }
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]),
                       "r"(r[1]), "r"(r[2]), "r"(r[3])
                       : "memory");
        }
      } else {  // f32: two floats a thread and row, 8-byte shared stores
#pragma unroll
        for (int j = col0 / 8; j < (col0 + kPartCols) / 8; ++j) {
          const int col = 8 * j + 2 * (lane % 4) - col0;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float2* q = reinterpret_cast<float2*>(out + staged_byte<Out>(lr + 8 * h, col));
            float2 v = summed ? make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]) : make_float2(0.0f, 0.0f);
            if (accumulate) {
              const float2 old = *q;
              v.x += old.x;
              v.y += old.y;
            }
            *q = v;
          }
        }
      }
      fence_async_shared();
      named_sync(1 + wg, 128);
      if (leader) {
#pragma unroll
        for (int c = 0; c < S::kChunks; ++c)
          tma_store_3d(&map_dw, out + c * kOutBox, out_col + col0 + c * kChunkCols, out_row, e);
        store_commit();
      }
    }
  };
  if constexpr (kUnits) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
  walk(run_tile);
  if (leader) store_wait_all();
  if constexpr (kCluster > 1) cluster_sync();  // the other CTAs' last arrivals on this one's barriers landed
#endif
}

// A launch's configuration: grid (whole clusters), block, shared memory, stream, the cluster's
// shape where it has more than one CTA.
struct Launch {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute cluster{};
  Launch(int cluster_ctas, unsigned clusters, int smem, cudaStream_t stream) {
    config.gridDim = dim3(clusters * static_cast<unsigned>(cluster_ctas));
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = static_cast<size_t>(smem);
    config.stream = stream;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = static_cast<unsigned>(cluster_ctas);
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = cluster_ctas > 1 ? 1 : 0;
  }
};

// The clusters resident at once (one CTA a multiprocessor), found once.
template <class Out, int kCluster, int kParts, bool kUnits>
int resident_clusters() {
  static int clusters = 0;
  static std::once_flag once;
  std::call_once(once, [] {
    const int smem = static_cast<int>(sizeof(Smem<Out, kParts, kUnits>) + 1024);
    require_sm90a(own_wgrad_kernel<Out, kCluster, kParts, kUnits>, smem, "kernels.cutlass_tile wgrad = own");
    if constexpr (kCluster == 1) {
      int dev = 0;
      MF_CUDA_CHECK(cudaGetDevice(&dev));
      MF_CUDA_CHECK(cudaDeviceGetAttribute(&clusters, cudaDevAttrMultiProcessorCount, dev));
    } else {
      Launch l(kCluster, 1, smem, nullptr);
      MF_CUDA_CHECK(
          cudaOccupancyMaxActiveClusters(&clusters, own_wgrad_kernel<Out, kCluster, kParts, kUnits>, &l.config));
      MF_CHECK(clusters > 0, "kernels.cutlass_tile wgrad = own: no cluster of ", kCluster, " CTAs fits this GPU");
    }
  });
  return clusters;
}

template <class Out, int kCluster, int kParts, bool kUnits>
void launch(const ExecContext& ctx, const Tensor& x_RI, const Tensor& dy_RO, const Tensor& offsets_E1,
            const Tensor& dw_EOI, bool accumulate, const char* what, int unit_tiles, bool force_units) {
  using S = Smem<Out, kParts, kUnits>;
  MF_CHECK(kParts == 1 || !accumulate, what,
           ": an accumulated gradient is staged whole (the old tile fills the staging area)");
  const int resident = resident_clusters<Out, kCluster, kParts, kUnits>();
  const int64_t rows = x_RI.size(0), e_n = dw_EOI.size(0), o_n = dw_EOI.size(1), i_n = dw_EOI.size(2);
  constexpr auto bf16 = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  constexpr auto out_type = sizeof(Out) == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  const uint32_t box_in[2] = {64, kBlockK}, box_out[3] = {S::kChunkCols, 64, 1};
  const uint64_t dims_dy[2] = {static_cast<uint64_t>(o_n), static_cast<uint64_t>(rows)},
                 dims_x[2] = {static_cast<uint64_t>(i_n), static_cast<uint64_t>(rows)},
                 dims_dw[3] = {static_cast<uint64_t>(i_n), static_cast<uint64_t>(o_n), static_cast<uint64_t>(e_n)};
  const uint64_t strides_dy[1] = {static_cast<uint64_t>(o_n) * 2}, strides_x[1] = {static_cast<uint64_t>(i_n) * 2},
                 strides_dw[2] = {static_cast<uint64_t>(i_n) * sizeof(Out),
                                  static_cast<uint64_t>(o_n * i_n) * sizeof(Out)};
  const CUtensorMap map_dy =
      tiled_map(dy_RO.data(), bf16, 2, dims_dy, strides_dy, box_in, CU_TENSOR_MAP_SWIZZLE_128B, what);
  const CUtensorMap map_x =
      tiled_map(x_RI.data(), bf16, 2, dims_x, strides_x, box_in, CU_TENSOR_MAP_SWIZZLE_128B, what);
  const CUtensorMap map_dw =
      tiled_map(dw_EOI.data(), out_type, 3, dims_dw, strides_dw, box_out, CU_TENSOR_MAP_SWIZZLE_128B, what);
  const int o_tiles = static_cast<int>(ceil_div(o_n, kBlockM));
  const Params p{offsets_E1.ptr<int64_t>(), static_cast<int>(e_n), static_cast<int>(ceil_div(o_tiles, kCluster)),
                 static_cast<int>(ceil_div(i_n, S::kBlockN)), accumulate ? 1 : 0,
                 // Units: the columns cut into parts of at most unit_tiles tiles.
                 static_cast<int>(ceil_div(ceil_div(i_n, S::kBlockN), unit_tiles)), force_units ? 1 : 0};
  const int64_t tiles = e_n * p.o_groups * p.i_tiles;  // the clusters' tiles
  // Persistent clusters: as many as fit at once, fewer for kernels.gemm_sms (at least one).
  int clusters = resident;
  if (const int want = ctx.kernels().gemm_sms; want > 0) clusters = std::min(clusters, std::max(1, want / kCluster));
  Launch l(kCluster, static_cast<unsigned>(std::min<int64_t>(clusters, tiles)), static_cast<int>(sizeof(S) + 1024),
           stream_of(ctx));
  MF_CUDA_CHECK(
      cudaLaunchKernelEx(&l.config, own_wgrad_kernel<Out, kCluster, kParts, kUnits>, map_dy, map_x, map_dw, p));
  MF_CUDA_LAUNCHED(what);
}

// The cluster size's and the units' instantiation.
template <class Out>
void launch_cluster(int cluster, const ExecContext& ctx, const Tensor& x_RI, const Tensor& dy_RO,
                    const Tensor& offsets_E1, const Tensor& dw_EOI, bool accumulate, const char* what, int unit_tiles,
                    bool force_units) {
  MF_CHECK(cluster == 1 || cluster == 2, what, ": the own weight-gradient kernel runs in clusters of 1 or 2 CTAs, not ",
           cluster);
  const auto go = [&]<int kCluster, int kParts>() {
    if (unit_tiles > 1)
      launch<Out, kCluster, kParts, true>(ctx, x_RI, dy_RO, offsets_E1, dw_EOI, accumulate, what, unit_tiles,
                                          force_units);
    else
      launch<Out, kCluster, kParts, false>(ctx, x_RI, dy_RO, offsets_E1, dw_EOI, accumulate, what, 1, false);
  };
  // A written bf16 gradient is staged in halves (two more main-loop stages); an accumulated one
  // whole (the old tile is loaded into the staging area), and f32 whole.
  if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
    if (!accumulate) {
      if (cluster == 2) return go.template operator()<2, 2>();
      return go.template operator()<1, 2>();
    }
  }
  if (cluster == 2) return go.template operator()<2, 1>();
  go.template operator()<1, 1>();
}

}  // namespace

bool own_wgrad_serves(int64_t groups, int64_t o_n, int64_t i_n) {
  return groups >= 1 && o_n > 0 && i_n > 0 && o_n % 8 == 0 && i_n % 8 == 0 &&
         groups * ceil_div(o_n, kBlockM) * ceil_div(i_n, 128) < (int64_t{1} << 31);
}

void own_grouped_wgrad(const ExecContext& ctx, const Tensor& x_RI, const Tensor& dy_RO, const Tensor& offsets_E1,
                       const Tensor& dw_EOI, bool accumulate, const char* what, int cluster, int unit_tiles,
                       bool force_units) {
  const int64_t e_n = dw_EOI.size(0), o_n = dw_EOI.size(1), i_n = dw_EOI.size(2);
  MF_CHECK(own_wgrad_serves(e_n, o_n, i_n), what, ": the own weight-gradient GEMM cannot serve ", e_n, " experts of ",
           o_n, " x ", i_n);
  MF_CHECK(x_RI.size(0) < (int64_t{1} << 31), what, ": ", x_RI.size(0),
           " rows (the own kernel indexes rows with 32 bits)");
  MF_CHECK(x_RI.dtype() == DType::bf16 && dy_RO.dtype() == DType::bf16, what, ": bf16 x and dy expected");
  MF_CHECK(unit_tiles >= 0, what, ": unit_tiles ", unit_tiles);
  if (unit_tiles == 0) unit_tiles = std::max(ctx.kernels().own_wgrad_units, 1);
  if (dw_EOI.dtype() == DType::bf16)
    launch_cluster<__nv_bfloat16>(cluster, ctx, x_RI, dy_RO, offsets_E1, dw_EOI, accumulate, what, unit_tiles,
                                  force_units);
  else if (dw_EOI.dtype() == DType::f32)
    launch_cluster<float>(cluster, ctx, x_RI, dy_RO, offsets_E1, dw_EOI, accumulate, what, unit_tiles, force_units);
  else
    MF_FAIL(what, ": dw must be bf16 or f32, not ", dtype_name(dw_EOI.dtype()));
}

}  // namespace moefold::cuda
