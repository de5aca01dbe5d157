// CUDA permutation plan (ops/moe_ops.h, contract in permute_plan.h): tokens -> expert-contiguous
// rows, with capacity dropping and padding. No gradient (integer indices).
#include "moefold/ops/cuda/common.cuh"
// (common.cuh first: it declares dtype_of<__nv_bfloat16>.)
#include <algorithm>

#include "moefold/ops/cuda/moe_common.cuh"
#include "moefold/ops/cuda/permute_plan.h"

namespace moefold::cuda {

namespace {

// Assignments a = t*K + k are cut into tiles (plan_tile: 32 to 512 of them, smaller tiles for
// fewer assignments, so that small plans still spread over many warps), one warp per tile. (1) Each tile counts
// its assignments per expert; (2) per expert, an exclusive scan over the tiles turns the counts
// into each tile's first position within the expert; (3) one block lays the experts out (their
// assignment and row offsets); (4) each tile gives its assignments their positions in token order
// (a match_any rank within each 32-chunk); (5) with a capacity, one block per expert selects the
// kept assignments (radix select of the capacity-th largest (prob, -a) key) and lays out rows and
// padding. Integer arithmetic only: the plan is bit-identical to the CPU's.

constexpr int kPlanWarps = 4;

// Assignments per tile for a_n of them: ~128 tiles up to 512 assignments each, at least a warp's.
int64_t plan_tile(int64_t a_n) { return std::clamp<int64_t>(ceil_div(ceil_div(a_n, 128), 32) * 32, 32, 512); }
constexpr int kPlanThreads = 256;

// Values the plan returns to the host (set to all ones before the plan).
enum PlanInfo : int {
  kRows = 0,   // R
  kBadIndex,   // the first assignment whose expert index is E or more (negative: an empty slot)
  kDuplicate,  // the first assignment whose expert an earlier k of its token chose
  kNumPlanInfo,
};
constexpr unsigned long long kNoAssignment = ~0ull;

__global__ void plan_tile_counts_kernel(const int32_t* idx, int64_t a_n, int k_n, int e_n, int64_t tile_size,
                                        int64_t num_tiles, int* tile_base, unsigned long long* info) {
  extern __shared__ int plan_cnt[];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kPlanWarps + warp;
  if (tile >= num_tiles) return;
  int* cnt = plan_cnt + warp * e_n;
  for (int e = lane; e < e_n; e += kWarp) cnt[e] = 0;
  __syncwarp();
  const int64_t end = std::min<int64_t>(a_n, (tile + 1) * tile_size);
  for (int64_t a = tile * tile_size + lane; a < end; a += kWarp) {
    const int e = idx[a];
    if (e < 0) continue;  // an empty slot
    if (e >= e_n) {
      atomicMin(&info[kBadIndex], static_cast<unsigned long long>(a));
      continue;
    }
    atomicAdd(&cnt[e], 1);
    const int64_t first = a - a % k_n;
    for (int64_t b = first; b < a; ++b)
      if (idx[b] == e) atomicMin(&info[kDuplicate], static_cast<unsigned long long>(a));
  }
  __syncwarp();
  for (int e = lane; e < e_n; e += kWarp) tile_base[tile * e_n + e] = cnt[e];
}

// One warp per expert, 32 tiles at a time: the tiles' counts become their first position within
// the expert (an exclusive scan over the tiles).
__global__ void plan_expert_scan_kernel(int* tile_base, int64_t num_tiles, int e_n, int64_t* n_assign) {
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int e = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / kWarp);
  if (e >= e_n) return;
  int64_t running = 0;
  for (int64_t t0 = 0; t0 < num_tiles; t0 += kWarp) {
    const int64_t tile = t0 + lane;
    const int v = tile < num_tiles ? tile_base[tile * e_n + e] : 0;
    int incl = v;  // inclusive scan over the lanes
    for (int d = 1; d < kWarp; d *= 2) {
      const int up = __shfl_up_sync(kFullMask, incl, d);
      if (lane >= d) incl += up;
    }
    if (tile < num_tiles) tile_base[tile * e_n + e] = static_cast<int>(running + incl - v);
    running += __shfl_sync(kFullMask, incl, kWarp - 1);
  }
  if (lane == 0) n_assign[e] = running;
}

// Exclusive scan over the block (blockDim.x a multiple of 32); *total = the block's sum.
__device__ int64_t block_exclusive_scan(int64_t v, int64_t* total) {
  __shared__ int64_t warp_sums[32];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int n_warps = static_cast<int>(blockDim.x) / kWarp;
  int64_t x = v;
#pragma unroll
  for (int off = 1; off < kWarp; off <<= 1) {
    const int64_t y = __shfl_up_sync(kFullMask, x, off);
    if (lane >= off) x += y;
  }
  if (lane == kWarp - 1) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int64_t w = lane < n_warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int off = 1; off < kWarp; off <<= 1) {
      const int64_t y = __shfl_up_sync(kFullMask, w, off);
      if (lane >= off) w += y;
    }
    if (lane < n_warps) warp_sums[lane] = w;
  }
  __syncthreads();
  const int64_t prefix = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[n_warps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return prefix;
}

// One block: rows per expert (dropless: all; capacity: at most `capacity`; pad: exactly
// `capacity`), the assignment offsets, the row offsets, counts_E, offsets_E1 and R; with bound > R
// the last expert padded up to R = bound.
__global__ void plan_offsets_kernel(const int64_t* n_assign, int e_n, int64_t capacity, bool pad, int64_t bound,
                                    int64_t* assign_off, int64_t* counts, int64_t* offsets, unsigned long long* info) {
  int64_t carry_a = 0, carry_r = 0;
  for (int e0 = 0; e0 < e_n; e0 += static_cast<int>(blockDim.x)) {
    const int e = e0 + static_cast<int>(threadIdx.x);
    const int64_t n = e < e_n ? n_assign[e] : 0;
    const int64_t rows = e >= e_n ? 0 : capacity <= 0 ? n : pad ? capacity : std::min(n, capacity);
    int64_t total_a, total_r;
    const int64_t pa = block_exclusive_scan(n, &total_a);
    const int64_t pr = block_exclusive_scan(rows, &total_r);
    if (e < e_n) {
      assign_off[e] = carry_a + pa;
      offsets[e] = carry_r + pr;
      counts[e] = rows;
    }
    carry_a += total_a;
    carry_r += total_r;
  }
  __syncthreads();  // counts[e_n - 1] written
  if (threadIdx.x == 0) {
    if (bound > carry_r) {
      counts[e_n - 1] += bound - carry_r;
      carry_r = bound;
    }
    offsets[e_n] = carry_r;
    info[kRows] = static_cast<unsigned long long>(carry_r);
  }
}

// Positions in token order within each expert (see above). Dropless: the rows themselves;
// with a capacity: the assignment ids grouped by expert, for plan_capacity_kernel.
__global__ void plan_scatter_kernel(const int32_t* idx, int64_t a_n, int k_n, int e_n, int64_t tile_size,
                                    int64_t num_tiles, const int* tile_base, const int64_t* assign_off,
                                    const int64_t* offsets, int64_t max_rows, bool dropless, int64_t* row,
                                    int64_t* token, int* grouped) {
  extern __shared__ int plan_cnt[];
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kPlanWarps + warp;
  if (tile >= num_tiles) return;
  int* cnt = plan_cnt + warp * e_n;
  for (int e = lane; e < e_n; e += kWarp) cnt[e] = tile_base[tile * e_n + e];
  __syncwarp();
  const int64_t begin = tile * tile_size, end = std::min<int64_t>(a_n, begin + tile_size);
  for (int64_t a0 = begin; a0 < end; a0 += kWarp) {  // every lane runs every chunk (match_any)
    const int64_t a = a0 + lane;
    int e = a < end ? idx[a] : -1;
    if (e >= e_n) e = -1;
    const unsigned peers = __match_any_sync(kFullMask, e);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    const int pos = e >= 0 ? cnt[e] + rank : 0;
    __syncwarp();
    if (e >= 0 && lane == __ffs(peers) - 1) cnt[e] += __popc(peers);
    __syncwarp();
    if (a >= end) continue;
    if (dropless) {
      const int64_t r = e >= 0 ? offsets[e] + pos : -1;
      row[a] = r;
      if (r >= 0 && r < max_rows) token[r] = a / k_n;
    } else if (e >= 0) {
      grouped[assign_off[e] + pos] = static_cast<int>(a);
    } else {
      row[a] = -1;  // an empty slot: plan_capacity_kernel never sees it
    }
  }
}

// Larger key = kept first: the higher probability, then the lower assignment (token) index.
// -0 and +0 compare equal on the CPU, so both map to the key of +0.
__device__ __forceinline__ uint64_t plan_key(int a, const float* prob) {
  float p = prob[a];
  if (p == 0.f) p = 0.f;
  uint32_t u = __float_as_uint(p);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<uint64_t>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(a));
}

// One block per expert: keep the `capacity` largest keys (a radix select of the capacity-th
// largest, 8 bits at a time: the keys are distinct), in token order, then the padding rows.
__global__ void plan_capacity_kernel(const int* grouped, const float* prob, const int64_t* n_assign,
                                     const int64_t* assign_off, const int64_t* offsets, const int64_t* counts,
                                     int64_t capacity, int k_n, int64_t max_rows, int64_t* row, int64_t* token) {
  __shared__ unsigned hist[256];
  __shared__ unsigned sel_digit, sel_need;
  const int e = static_cast<int>(blockIdx.x);
  const int lane = static_cast<int>(threadIdx.x) % kWarp, warp = static_cast<int>(threadIdx.x) / kWarp;
  const int64_t n = n_assign[e], r0 = offsets[e], rows = counts[e];
  const int* seg = grouped + assign_off[e];
  const bool drops = n > capacity;
  uint64_t threshold = 0;
  if (drops) {
    uint64_t prefix = 0, mask = 0;
    unsigned need = static_cast<unsigned>(capacity);
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int i = static_cast<int>(threadIdx.x); i < 256; i += static_cast<int>(blockDim.x)) hist[i] = 0;
      __syncthreads();
      for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        const uint64_t key = plan_key(seg[i], prob);
        if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
      }
      __syncthreads();
      if (warp == 0) {
        // Lane l covers the digits 255 - 8l down to 248 - 8l; exactly one lane holds the need-th.
        unsigned local = 0;
        for (int q = 0; q < 8; ++q) local += hist[255 - 8 * lane - q];
        unsigned incl = local;
#pragma unroll
        for (int off = 1; off < kWarp; off <<= 1) {
          const unsigned y = __shfl_up_sync(kFullMask, incl, off);
          if (lane >= off) incl += y;
        }
        unsigned cum = incl - local;
        if (cum < need && need <= incl) {
          for (int q = 0; q < 8; ++q) {
            const int d = 255 - 8 * lane - q;
            if (cum + hist[d] >= need) {
              sel_digit = static_cast<unsigned>(d);
              sel_need = need - cum;
              break;
            }
            cum += hist[d];
          }
        }
      }
      __syncthreads();
      prefix |= static_cast<uint64_t>(sel_digit) << shift;
      mask |= 0xffull << shift;
      need = sel_need;
    }
    threshold = prefix;
  }
  int64_t carry = 0;
  for (int64_t i0 = 0; i0 < n; i0 += blockDim.x) {  // block-uniform trip count (block scans inside)
    const int64_t i = i0 + threadIdx.x;
    const int a = i < n ? seg[i] : 0;
    const bool keep = i < n && (!drops || plan_key(a, prob) >= threshold);
    int64_t total;
    const int64_t rank = carry + block_exclusive_scan(keep ? 1 : 0, &total);
    carry += total;
    if (i >= n) continue;
    if (keep) {
      const int64_t r = r0 + rank;
      row[a] = r;
      if (r < max_rows) token[r] = a / k_n;
    } else {
      row[a] = -1;
    }
  }
  for (int64_t i = carry + threadIdx.x; i < rows; i += blockDim.x)
    if (r0 + i < max_rows) token[r0 + i] = -1;
}

// wait = false: what the host would have checked, checked here (a trap stops the stream's work).
__global__ void plan_check_kernel(const unsigned long long* info, int64_t expected_rows) {
  MF_DEVICE_REQUIRE(info[kBadIndex] == kNoAssignment, "moe_permute_plan: assignment %llu has an expert index >= E",
                    info[kBadIndex]);
  MF_DEVICE_REQUIRE(info[kDuplicate] == kNoAssignment, "moe_permute_plan: assignment %llu repeats its token's expert",
                    info[kDuplicate]);
  MF_DEVICE_REQUIRE(info[kRows] == static_cast<unsigned long long>(expected_rows),
                    "moe_permute_plan: %llu rows, the caller expects %lld", info[kRows],
                    static_cast<long long>(expected_rows));
}

}  // namespace

// ---- permutation plan --------------------------------------------------------------------------

int64_t moe_permute_plan(const ExecContext& ctx, const Tensor& topk_idx_TK, const Tensor& topk_prob_TK,
                         int64_t capacity, bool pad, const PermutePlanOut& out, bool wait) {
  check_cuda_tensor(topk_idx_TK, "moe_permute_plan topk_idx");
  check_cuda_dtype(topk_prob_TK, DType::f32, "moe_permute_plan topk_prob (CUDA: f32)");
  for (const Tensor* t : {&out.counts_E, &out.offsets_E1, &out.row_TK, &out.token_R})
    check_cuda_tensor(*t, "moe_permute_plan output");
  const int64_t e_n = out.counts_E.numel(), t_n = topk_idx_TK.size(0), k_n = topk_idx_TK.size(1);
  const int64_t a_n = t_n * k_n;  // assignments a = t*K + k
  MF_CHECK(e_n >= 1 && k_n >= 1 && a_n < (int64_t{1} << 31) && e_n * sizeof(int) * kPlanWarps <= kSharedBudget,
           "moe_permute_plan (CUDA: T*K < 2^31, E <= ", kSharedBudget / sizeof(int) / kPlanWarps, "): topk_idx ",
           topk_idx_TK.str(), ", ", e_n, " experts");
  const int64_t max_rows = out.token_R.numel();
  const bool dropless = capacity <= 0;
  const int e = static_cast<int>(e_n), k = static_cast<int>(k_n);
  const int64_t tile_size = plan_tile(a_n), num_tiles = ceil_div(a_n, tile_size);

  // Scratch (grow-only): info | n_assign[E] | assign_off[E] | tile_base | grouped.
  const size_t info_bytes = kNumPlanInfo * sizeof(unsigned long long);
  const size_t base_bytes = static_cast<size_t>(num_tiles * e_n) * sizeof(int);
  const size_t grouped_bytes = dropless ? 0 : static_cast<size_t>(a_n) * sizeof(int);
  const size_t bytes = info_bytes + 2 * static_cast<size_t>(e_n) * sizeof(int64_t) + base_bytes + grouped_bytes;
  auto* scratch = static_cast<char*>(ctx.scratch(ScratchSlot::permute_plan, bytes));
  auto* info = reinterpret_cast<unsigned long long*>(scratch);
  auto* n_assign = reinterpret_cast<int64_t*>(scratch + info_bytes);
  int64_t* assign_off = n_assign + e_n;
  auto* tile_base = reinterpret_cast<int*>(assign_off + e_n);
  int* grouped = tile_base + num_tiles * e_n;
  MF_CUDA_CHECK(cudaMemsetAsync(info, 0xff, info_bytes, stream_of(ctx)));

  const int32_t* idx = topk_idx_TK.ptr<int32_t>();
  int64_t* counts = out.counts_E.ptr<int64_t>();
  int64_t* offsets = out.offsets_E1.ptr<int64_t>();
  int64_t* row = out.row_TK.ptr<int64_t>();
  int64_t* token = out.token_R.ptr<int64_t>();
  const size_t tile_shared = static_cast<size_t>(kPlanWarps) * e_n * sizeof(int);
  const int tile_blocks = blocks_for(num_tiles, kPlanWarps);
  if (num_tiles > 0) {
    plan_tile_counts_kernel<<<tile_blocks, kPlanWarps * kWarp, tile_shared, stream_of(ctx)>>>(
        idx, a_n, k, e, tile_size, num_tiles, tile_base, info);
    MF_CUDA_LAUNCHED("moe_permute_plan counts");
  }
  plan_expert_scan_kernel<<<blocks_for(e_n, 4), 4 * kWarp, 0, stream_of(ctx)>>>(tile_base, num_tiles, e, n_assign);
  MF_CUDA_LAUNCHED("moe_permute_plan scan");
  // Without waiting, capacity and no padding: the last expert padded up to the bound.
  const int64_t bound = !wait && !dropless && !pad ? std::min(a_n, e_n * capacity) : 0;
  plan_offsets_kernel<<<1, 1024, 0, stream_of(ctx)>>>(n_assign, e, capacity, pad, bound, assign_off, counts, offsets,
                                                      info);
  MF_CUDA_LAUNCHED("moe_permute_plan offsets");
  if (num_tiles > 0) {
    plan_scatter_kernel<<<tile_blocks, kPlanWarps * kWarp, tile_shared, stream_of(ctx)>>>(
        idx, a_n, k, e, tile_size, num_tiles, tile_base, assign_off, offsets, max_rows, dropless, row, token, grouped);
    MF_CUDA_LAUNCHED("moe_permute_plan scatter");
  }
  if (!dropless) {
    plan_capacity_kernel<<<e, kPlanThreads, 0, stream_of(ctx)>>>(
        grouped, topk_prob_TK.ptr<float>(), n_assign, assign_off, offsets, counts, capacity, k, max_rows, row, token);
    MF_CUDA_LAUNCHED("moe_permute_plan capacity");
  }
  if (!wait) {
    const int64_t rows = pad ? e_n * capacity : dropless ? a_n : bound;
    MF_CHECK(rows <= max_rows, "permute plan needs more than ", max_rows, " rows");
    plan_check_kernel<<<1, 1, 0, stream_of(ctx)>>>(info, rows);
    MF_CUDA_LAUNCHED("moe_permute_plan check");
    return rows;
  }
  unsigned long long host[kNumPlanInfo];
  MF_CUDA_CHECK(cudaMemcpyAsync(host, info, info_bytes, cudaMemcpyDeviceToHost, stream_of(ctx)));
  MF_CUDA_CHECK(cudaStreamSynchronize(stream_of(ctx)));
  if (host[kBadIndex] != kNoAssignment) {
    // The index itself, for the CPU op's message (one more small copy: this is the failure path).
    const auto a = static_cast<int64_t>(host[kBadIndex]);
    int32_t bad = 0;
    device_copy(&bad, Device::cpu, idx + a, Device::cuda, sizeof(bad), ctx.stream());
    MF_CHECK(false, "expert index ", bad, " out of [0, ", e_n, ")");
  }
  if (host[kDuplicate] != kNoAssignment) {
    const auto a = static_cast<int64_t>(host[kDuplicate]);
    int32_t dup = 0;
    device_copy(&dup, Device::cpu, idx + a, Device::cuda, sizeof(dup), ctx.stream());
    MF_CHECK(false, "token ", a / k_n, " routed twice to expert ", dup);
  }
  const auto num_rows = static_cast<int64_t>(host[kRows]);
  MF_CHECK(num_rows <= max_rows, "permute plan needs more than ", max_rows, " rows");
  return num_rows;
}

}  // namespace moefold::cuda
