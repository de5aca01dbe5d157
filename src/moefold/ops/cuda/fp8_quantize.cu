// FP8 quantization on the GPU (ops/fp8.h's rows, cols and blocks layouts and their inverses), bit
// for bit as the CPU reference (ops/cpu/fp8.cpp): the tile's amax over |x| in f32, its power-of-two
// scale read off amax's exponent bits (never a log), x / s computed as x * 2^-e (exact: the same
// correctly rounded quotient), and one rounding to E4M3 by the hardware's cvt.rn.satfinite.
//
// Memory-bound passes: rows give each lane 16 bytes of a tile and each warp 4 such loads in flight
// (bf16: a tile per half warp, 8 rows of one tile a warp; the packed and SwiGLU forms and narrow or
// unaligned rows: a warp per tile, 4 elements a lane); cols stage a 128-row x 128-column (f32: 64;
// packed FP8 rows: 256, a code times its row tile's scale) tile per block, a lane loading 16
// consecutive rows of its 8 bytes of columns, and write its transpose from shared memory, 128
// contiguous bytes per column; blocks read a 128 x 128 block row by row and write its transpose
// (qT) through shared memory the same way. Parts of a weight (the distributed optimizer's flat
// slices) are read row tile by row tile as in the rows layout: a warp's 128 elements share a
// block, so block amaxes take one atomicMax per 32 row tiles, not per element.
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/fp8.h"
#include "moefold/ops/cuda/swiglu.cuh"
#include "moefold/ops/cuda/swiglu.h"
#include "moefold/ops/fp8.h"

namespace moefold::cuda {
namespace {

constexpr int kTile = static_cast<int>(kFp8Tile);
constexpr int kThreads = 256;  // every kernel here: 8 warps
constexpr int kWarps = kThreads / 32;
static_assert(kTile == 128, "the kernels map 32 lanes x 4 elements onto one tile");

constexpr uint32_t kInfBits = 0x7f800000u;

// |x| as the bits of a non-negative float: for those, integer order is float order and NaN's bits
// exceed infinity's, so an integer max (one warp instruction) gives amax and flags non-finite tiles.
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// A tile's scale s = 2^e and 1 / s, as fp8_tile_scale (ops/fp8.h): the smallest e in [-126, 127]
// with amax <= 448 * 2^e. amax = 1.m * 2^(E - 127) (E its biased exponent) and 448 = 1.75 * 2^8, so
// e = E - 135 when 1.m <= 1.75 (mantissa bits <= 0x600000), else E - 134; a subnormal amax clamps
// to -126. amax == 0 or non-finite: s = 1 (non-finite values take e4m3_special's path).
struct TileScale {
  float scale;
  float inv;    // 2^-e exactly (2^-127 is a subnormal, still exact)
  bool finite;  // every value of the tile is finite
};

__device__ __forceinline__ TileScale tile_scale(uint32_t amax_bits) {
  if (amax_bits >= kInfBits) return {1.0f, 1.0f, false};
  if (amax_bits == 0) return {1.0f, 1.0f, true};
  const int exp_field = static_cast<int>(amax_bits >> 23);
  int e = exp_field == 0 ? -126 : exp_field - 135 + ((amax_bits & 0x7fffffu) > 0x600000u ? 1 : 0);
  e = max(-126, min(127, e));
  const float s = __uint_as_float(static_cast<uint32_t>(e + 127) << 23);
  const float inv = e == 127 ? __uint_as_float(0x00400000u) : __uint_as_float(static_cast<uint32_t>(127 - e) << 23);
  return {s, inv, true};
}

// e4m3_from_float's rule for any float: NaN -> 0x7f (the hardware might keep a NaN's sign),
// infinities -> +-448 (0x7e / 0xfe) spelled out rather than trusted to satfinite; finite values as
// the hardware rounds them (to nearest even, saturating at +-448).
__device__ __forceinline__ uint32_t e4m3_special(float v) {
  const uint32_t a = abs_bits(v);
  if (a > kInfBits) return 0x7fu;
  if (a == kInfBits) return v < 0.0f ? 0xfeu : 0x7eu;
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

// Four values already divided by their scale, as four codes (byte j: value j). In a finite tile
// every value is finite and the paired conversion serves.
__device__ __forceinline__ uint32_t e4m3x4(const float v[4], bool finite) {
  if (!finite)
    return e4m3_special(v[0]) | e4m3_special(v[1]) << 8 | e4m3_special(v[2]) << 16 | e4m3_special(v[3]) << 24;
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(v[0], v[1]), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(v[2], v[3]), __NV_SATFINITE, __NV_E4M3);
  return lo | hi << 16;
}
__device__ __forceinline__ uint8_t e4m3(float v, bool finite) {
  return static_cast<uint8_t>(finite ? __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3) : e4m3_special(v));
}

// An E4M3 code as a float (exact: E4M3 is a subset of f16); 0x7f / 0xff give NaN.
__device__ __forceinline__ float e4m3_value(uint8_t q) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(q, __NV_E4M3)));
}

// Four consecutive elements (16-byte f32 / 8-byte bf16 loads; REQUIRES that alignment).
__device__ __forceinline__ void load4(const float* p, float v[4]) {
  const float4 t = *reinterpret_cast<const float4*>(p);
  v[0] = t.x, v[1] = t.y, v[2] = t.z, v[3] = t.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float v[4]) {
  const uint2 t = *reinterpret_cast<const uint2*>(p);  // a bf16 is the high half of its float
  v[0] = __uint_as_float(t.x << 16), v[1] = __uint_as_float(t.x & 0xffff0000u);
  v[2] = __uint_as_float(t.y << 16), v[3] = __uint_as_float(t.y & 0xffff0000u);
}

// The largest g < groups with off[g] <= r: row r's group (empty groups share an offset with the
// next one; the last of equals is the one whose range holds r).
__device__ __forceinline__ int find_group(const int64_t* __restrict__ off, int groups, int64_t r) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (off[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// ---- rows ------------------------------------------------------------------------------------------

// Warp w of block (bx, b) quantizes tile b of row 8 bx + w; lane l holds its elements 4l .. 4l + 3.
// kVec: k % 4 == 0 with aligned x and q (vector loads, one 32-bit store of 4 codes per lane).
// Packed (packed_at >= 0): row r's codes at q + r * ldq, its scales at byte packed_at of the row
// (s unused), the row's other bytes zeroed by tile 0's warp; else ldq == k.
// kSwiglu (T = bf16): x is a SwiGLU's input gu [rows, 2k] with gate and up interleaved (GateUp::
// pairs) and the quantized values are h = swiglu(g, u) rounded to bf16, as swiglu_forward writes
// them (ops/cuda/swiglu.cu): the fused form of swiglu_forward then this quantization.
template <class T, bool kVec, bool kSwiglu = false>
__global__ void __launch_bounds__(kThreads)
    quantize_rows_kernel(const T* __restrict__ x, int64_t rows, int64_t k, uint8_t* __restrict__ q,
                         float* __restrict__ s, const int64_t* __restrict__ off, int groups, int64_t ldq,
                         int64_t packed_at) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t r = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  if (r >= rows) return;  // whole warps
  const int64_t b = blockIdx.y, k0 = b * kTile + 4 * lane;
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if constexpr (kSwiglu) {
    static_assert(std::is_same_v<T, __nv_bfloat16>, "the fused SwiGLU quantization reads bf16");
    const T* gu = x + r * 2 * k;
    alignas(16) __nv_bfloat16 pairs[8];  // this lane's 4 (g, u) pairs
    if constexpr (kVec) {
      if (k0 < k) *reinterpret_cast<uint4*>(pairs) = *reinterpret_cast<const uint4*>(gu + 2 * k0);  // 16 bytes
    } else {
      for (int j = 0; j < 8; ++j) pairs[j] = k0 + j / 2 < k ? gu[2 * k0 + j] : __float2bfloat16(0.0f);
    }
    for (int j = 0; j < 4; ++j)
      if (k0 + j < k)
        v[j] = __bfloat162float(
            __float2bfloat16(swiglu<true>(__bfloat162float(pairs[2 * j]), __bfloat162float(pairs[2 * j + 1]))));
  } else if constexpr (kVec) {
    const T* xr = x + r * k;
    if (k0 < k) load4(xr + k0, v);
  } else {
    const T* xr = x + r * k;
    for (int j = 0; j < 4; ++j)
      if (k0 + j < k) v[j] = to_float(xr[k0 + j]);
  }
  uint32_t m = max(max(abs_bits(v[0]), abs_bits(v[1])), max(abs_bits(v[2]), abs_bits(v[3])));
  m = __reduce_max_sync(0xffffffffu, m);
  const TileScale ts = tile_scale(m);
  const float scaled[4] = {v[0] * ts.inv, v[1] * ts.inv, v[2] * ts.inv, v[3] * ts.inv};
  const uint32_t codes = e4m3x4(scaled, ts.finite);
  uint8_t* qr = q + r * ldq;
  if constexpr (kVec) {
    if (k0 < k) *reinterpret_cast<uint32_t*>(qr + k0) = codes;
  } else {
    for (int j = 0; j < 4; ++j)
      if (k0 + j < k) qr[k0 + j] = static_cast<uint8_t>(codes >> (8 * j));
  }
  if (packed_at >= 0) {
    if (lane == 0) reinterpret_cast<float*>(qr + packed_at)[b] = ts.scale;
    if (b == 0) {  // the padding bytes: [k, packed_at) and past the scales
      const int64_t tail = packed_at + 4 * static_cast<int64_t>(gridDim.y);
      for (int64_t i = k + lane; i < packed_at; i += 32) qr[i] = 0;
      for (int64_t i = tail + lane; i < ldq; i += 32) qr[i] = 0;
    }
    return;
  }
  if (lane == 0) {
    if (off == nullptr) {
      s[b * rows + r] = ts.scale;
    } else {
      const int g = find_group(off, groups, r);
      const int64_t begin = off[g];
      s[begin * gridDim.y + b * (off[g + 1] - begin) + (r - begin)] = ts.scale;
    }
  }
}

// The plain rows layout (no packing, no SwiGLU) with 16-byte loads: a lane holds kPer = 16 /
// sizeof(T) consecutive elements of a tile (bf16: 8, 16 lanes a tile, two tiles a warp; f32: 4, a
// warp a tile), and warp w of block (bx, b) quantizes tile b of the kRowSteps * kItems consecutive
// rows from (8 bx + w) * kRowSteps * kItems, every load issued before the first reduction (4 loads
// in flight per lane: a warp per tile of 8-byte loads reached 40% of an H100's bandwidth). Values,
// scales and codes as quantize_rows_kernel's; lane j stores row j's scale (one coalesced store),
// its group looked up while the loads are in flight. REQUIRES: k % kPer == 0, x 16-byte and q
// kPer-byte aligned; tiles = ceil(k / 128).
constexpr int kRowSteps = 4;

template <class T>
__global__ void __launch_bounds__(kThreads)
    quantize_rows_wide_kernel(const T* __restrict__ x, int64_t rows, int64_t k, int64_t tiles, uint8_t* __restrict__ q,
                              float* __restrict__ s, const int64_t* __restrict__ off, int groups) {
  constexpr int kPer = 16 / static_cast<int>(sizeof(T));  // elements per lane
  constexpr int kLanes = kTile / kPer;                    // lanes per tile
  constexpr int kItems = 32 / kLanes;                     // tiles (rows) per warp and step
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int li = lane % kLanes;
  const int64_t first = (blockIdx.x * static_cast<int64_t>(kWarps) + warp) * (kRowSteps * kItems);
  if (first >= rows) return;  // whole warps
  const int64_t b = blockIdx.y, k0 = b * kTile + kPer * li;
  uint4 raw[kRowSteps];
#pragma unroll
  for (int u = 0; u < kRowSteps; ++u) {  // step u: row first + u kItems + lane / kLanes
    const int64_t r = first + u * kItems + lane / kLanes;
    raw[u] = make_uint4(0, 0, 0, 0);
    if (r < rows && k0 < k) raw[u] = *reinterpret_cast<const uint4*>(x + r * k + k0);
  }
  const int64_t rs = first + lane;  // the row whose scale this lane stores (lane < kRowSteps * kItems)
  int64_t begin = 0, m = rows;
  if (off != nullptr && lane < kRowSteps * kItems && rs < rows) {
    const int g = find_group(off, groups, rs);
    begin = off[g];
    m = off[g + 1] - begin;
  }
  float scale = 0.0f;
#pragma unroll
  for (int u = 0; u < kRowSteps; ++u) {
    float v[kPer];
    if constexpr (kPer == 8) {  // a bf16 is the high half of its float
      const uint32_t w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
      for (int j = 0; j < 4; ++j)
        v[2 * j] = __uint_as_float(w[j] << 16), v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    } else {
      v[0] = __uint_as_float(raw[u].x), v[1] = __uint_as_float(raw[u].y);
      v[2] = __uint_as_float(raw[u].z), v[3] = __uint_as_float(raw[u].w);
    }
    uint32_t mx = 0;
    for (int j = 0; j < kPer; ++j) mx = max(mx, abs_bits(v[j]));
    for (int o = kLanes / 2; o > 0; o /= 2) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const TileScale ts = tile_scale(mx);
    float scaled[kPer];
    for (int j = 0; j < kPer; ++j) scaled[j] = v[j] * ts.inv;
    const int64_t r = first + u * kItems + lane / kLanes;
    if (r < rows && k0 < k) {
      uint8_t* dst = q + r * k + k0;
      if constexpr (kPer == 8)
        *reinterpret_cast<uint2*>(dst) = make_uint2(e4m3x4(scaled, ts.finite), e4m3x4(scaled + 4, ts.finite));
      else
        *reinterpret_cast<uint32_t*>(dst) = e4m3x4(scaled, ts.finite);
    }
    // Lane j takes row j's scale: step j / kItems, from the first lane of tile j % kItems.
    const float t = __shfl_sync(0xffffffffu, ts.scale, (lane % kItems) * kLanes);
    if (lane / kItems == u) scale = t;
  }
  if (lane < kRowSteps * kItems && rs < rows)
    s[off != nullptr ? begin * tiles + b * m + (rs - begin) : b * rows + rs] = scale;
}

// x [rows, k] = q * s in x's dtype, one thread per element.
template <class T>
__global__ void dequantize_rows_kernel(const uint8_t* __restrict__ q, const float* __restrict__ s, int64_t rows,
                                       int64_t k, T* __restrict__ x) {
  const int64_t n = rows * k;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k, c = i % k;
    x[i] = from_float<T>(e4m3_value(q[i]) * s[(c / kTile) * rows + r]);
  }
}

// x [rows, k] = the packed rows p [rows, w] dequantized, one thread per element.
template <class T>
__global__ void dequantize_packed_kernel(const uint8_t* __restrict__ p, int64_t rows, int64_t k, int64_t w, int64_t at,
                                         T* __restrict__ x) {
  const int64_t n = rows * k;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / k, c = i % k;
    const uint8_t* row = p + r * w;
    x[i] = from_float<T>(e4m3_value(row[c]) * reinterpret_cast<const float*>(row + at)[c / kTile]);
  }
}

// The packed rows' scales into the GEMM's grouped rows layout (launch_fp8_quantize_rows's with
// group offsets), one thread per (row, tile).
__global__ void packed_scales_kernel(const uint8_t* __restrict__ p, int64_t rows, int64_t tiles, int64_t w, int64_t at,
                                     const int64_t* __restrict__ off, int groups, float* __restrict__ s) {
  const int64_t n = rows * tiles;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / tiles, b = i % tiles;
    const float v = reinterpret_cast<const float*>(p + r * w + at)[b];
    const int g = off != nullptr ? find_group(off, groups, r) : 0;
    const int64_t begin = off != nullptr ? off[g] : 0, m = off != nullptr ? off[g + 1] - begin : rows;
    s[begin * tiles + b * m + (r - begin)] = v;
  }
}

// ---- cols ------------------------------------------------------------------------------------------

// Padded tile pt of the cols layout (qT's columns [128 pt, 128 pt + 128)): rows [r0, r0 + n) of x,
// n <= 128; n == 0 for the tiles past the last segment's. begin, count: the tile's segment's first
// row and its rows (the rows layout's grouped scales, quantize_cols_wide_kernel's RowsOut).
struct ColTile {
  int64_t r0;
  int64_t n;
  int64_t begin;
  int64_t count;
};

// One block: each segment's tiles from an exclusive scan of ceil(n_j / 128) over the segments
// (p_j / 128 in ops/fp8.h), in rounds of kThreads segments.
__global__ void __launch_bounds__(kThreads) col_tiles_kernel(const int64_t* __restrict__ off, int64_t segments,
                                                             int64_t rows, int64_t tiles, ColTile* __restrict__ map) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int64_t done;  // tiles of the segments before this round
  if (threadIdx.x == 0) done = 0;
  __syncthreads();
  for (int64_t base = 0; base < segments; base += kThreads) {
    const int64_t j = base + threadIdx.x;
    int64_t begin = 0, end = 0;
    if (j < segments) {
      begin = off != nullptr ? off[j] : 0;
      end = off != nullptr ? off[j + 1] : rows;
    }
    const int64_t count = (end - begin + kTile - 1) / kTile;
    int64_t first = 0, total = 0;
    Scan(scan_storage).ExclusiveSum(count, first, total);
    first += done;
    for (int64_t t = 0; t < count && first + t < tiles; ++t)
      map[first + t] = {begin + t * kTile, std::min<int64_t>(kTile, end - begin - t * kTile), begin, end - begin};
    __syncthreads();  // every thread has read `done` and left the scan's storage
    if (threadIdx.x == 0) done += total;
    __syncthreads();
  }
  for (int64_t pt = done + threadIdx.x; pt < tiles; pt += kThreads) map[pt] = {0, 0, 0, 0};
}

// The cols kernels' block of kChunk columns of one padded tile pt: each column's amax over the
// warps' partial maxima, its scale into sT (columns past `cols` not written), its inverse and
// finiteness for the codes. Threads [0, kChunk) work; the caller synchronises around it.
template <int kChunk>
__device__ __forceinline__ void column_scales(const uint32_t (*partial)[kChunk], int64_t pt, int64_t cols, int64_t c0,
                                              float* inv_of, bool* finite_of, float* __restrict__ sT) {
  if (threadIdx.x >= kChunk) return;
  uint32_t m = 0;
  for (int w = 0; w < kWarps; ++w) m = max(m, partial[w][threadIdx.x]);
  const TileScale ts = tile_scale(m);
  inv_of[threadIdx.x] = ts.inv;
  finite_of[threadIdx.x] = ts.finite;
  if (c0 + threadIdx.x < cols) sT[pt * cols + c0 + threadIdx.x] = ts.scale;
}

constexpr int kColChunk = 64;           // columns per block: a warp reads 64 contiguous elements of a row
constexpr int kCodeStride = kTile + 4;  // bytes per column of staged codes: 4-byte aligned, banks spread

// Block (cx, pt): columns [64 cx, 64 cx + 64) of padded tile pt. Lane l of warp w loads columns 2l
// and 2l + 1 of rows w, w + 8, ..., w + 120; the column maxima meet in shared memory; the codes are
// staged transposed and leave as 128 contiguous bytes of qT per column. kVec: column pairs as one
// load (cols even, x aligned).
// Packed x (T = uint8_t, ops/fp8.h's packed rows): row pitch ldx bytes, each value its code times
// the row tile's scale at byte `at` (c and c + 1 share a tile: c is even). Else ldx == cols.
template <class T, bool kVec, bool kPacked = false>
__global__ void __launch_bounds__(kThreads)
    quantize_cols_kernel(const T* __restrict__ x, int64_t cols, int64_t p, const ColTile* __restrict__ map,
                         uint8_t* __restrict__ qT, float* __restrict__ sT, int64_t ldx, int64_t at) {
  const int64_t pt = blockIdx.y;
  const ColTile tile = map[pt];
  if (tile.n == 0) return;
  const int n = static_cast<int>(tile.n);
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t c0 = blockIdx.x * static_cast<int64_t>(kColChunk);
  const int64_t c = c0 + 2 * lane;
  __shared__ uint32_t partial[kWarps][kColChunk];
  __shared__ float inv_of[kColChunk];
  __shared__ bool finite_of[kColChunk];
  __shared__ __align__(16) uint8_t codes[kColChunk][kCodeStride];

  float v[kTile / kWarps][2];
  uint32_t m0 = 0, m1 = 0;
#pragma unroll
  for (int i = 0; i < kTile / kWarps; ++i) {
    const int t = warp + kWarps * i;
    v[i][0] = v[i][1] = 0.0f;
    if (t < n) {
      const T* row = x + (tile.r0 + t) * ldx;
      if constexpr (kPacked) {
        if (c < cols) {
          const float scale = reinterpret_cast<const float*>(row + at)[c / kTile];
          v[i][0] = e4m3_value(row[c]) * scale;
          if (c + 1 < cols) v[i][1] = e4m3_value(row[c + 1]) * scale;
        }
      } else if constexpr (kVec) {
        if (c < cols) {
          if constexpr (sizeof(T) == 4) {
            const float2 pair = *reinterpret_cast<const float2*>(row + c);
            v[i][0] = pair.x, v[i][1] = pair.y;
          } else {
            const uint32_t pair = *reinterpret_cast<const uint32_t*>(row + c);
            v[i][0] = __uint_as_float(pair << 16), v[i][1] = __uint_as_float(pair & 0xffff0000u);
          }
        }
      } else {
        if (c < cols) v[i][0] = to_float(row[c]);
        if (c + 1 < cols) v[i][1] = to_float(row[c + 1]);
      }
    }
    m0 = max(m0, abs_bits(v[i][0]));
    m1 = max(m1, abs_bits(v[i][1]));
  }
  partial[warp][2 * lane] = m0;
  partial[warp][2 * lane + 1] = m1;
  __syncthreads();
  column_scales<kColChunk>(partial, pt, cols, c0, inv_of, finite_of, sT);
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kTile / kWarps; ++i) {
    const int t = warp + kWarps * i;
    if (t < n)
      for (int h = 0; h < 2; ++h) {
        const int cl = 2 * lane + h;
        codes[cl][t] = e4m3(v[i][h] * inv_of[cl], finite_of[cl]);
      }
  }
  __syncthreads();
  const int t = 4 * lane;
  for (int cl = warp; cl < kColChunk && c0 + cl < cols; cl += kWarps) {
    uint8_t* dst = qT + (c0 + cl) * p + pt * kTile;  // p % 128 == 0: 4-byte aligned with qT
    if (t + 3 < n) {
      *reinterpret_cast<uint32_t*>(dst + t) = *reinterpret_cast<const uint32_t*>(&codes[cl][t]);
    } else {
      for (int j = 0; j < 4; ++j)
        if (t + j < n) dst[t + j] = codes[cl][t + j];
    }
  }
}

// quantize_cols_wide_kernel's inputs: a lane's kPer consecutive columns of a row as one 8-byte
// load (load), anything per row beside them (rows: the warp's kRows rows from r, count of them
// real), and the values of columns 2h and 2h + 1 of the lane's kPer in row i (pair). kMagnitude
// clears the loaded elements' sign bits: pair of the masked load is |value| (the max pass reads it,
// so that the compiler does not keep the code pass's values live across the reduction).
// Dense x [rows, cols] of T: bf16 4 columns a lane, f32 2.
template <class T>
struct DenseColsIn {
  static constexpr int kPer = 8 / static_cast<int>(sizeof(T));
  static constexpr uint32_t kMagnitude = sizeof(T) == 2 ? 0x7fff7fffu : 0x7fffffffu;
  const T* x;
  int64_t cols;
  struct Rows {};
  __device__ __forceinline__ uint2 load(int64_t r, int64_t c) const {
    return __ldg(reinterpret_cast<const uint2*>(x + r * cols + c));
  }
  __device__ __forceinline__ Rows rows(int64_t, int, int64_t) const { return {}; }
  __device__ __forceinline__ float2 pair(uint2 raw, const Rows&, int, int h) const {
    if constexpr (kPer == 4) {  // a bf16 is the high half of its float
      const uint32_t w = h == 0 ? raw.x : raw.y;
      return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
    } else {
      return make_float2(__uint_as_float(raw.x), __uint_as_float(raw.y));
    }
  }
};

// dgu [rows, cols = 2F] = swiglu_backward(gu, dh) in the GateUp::pairs layout, computed as loaded:
// a lane's 4 columns are two (g, u) pairs of gu and two values of dh [rows, F], their gradients
// as swiglu_backward's bf16 kernels compute and round them (swiglu_grad<true>, round to nearest);
// from there DenseColsIn<bf16>'s (the same bits as reading the written dgu).
struct SwigluGradColsIn : DenseColsIn<__nv_bfloat16> {
  const __nv_bfloat16* dh;
  __device__ __forceinline__ uint2 load(int64_t r, int64_t c) const {
    const uint2 g = __ldg(reinterpret_cast<const uint2*>(x + r * cols + c));
    const uint32_t d = __ldg(reinterpret_cast<const uint32_t*>(dh + r * (cols / 2) + c / 2));
    const auto lo = [](uint32_t w) { return __uint_as_float(w << 16); };
    const auto hi = [](uint32_t w) { return __uint_as_float(w & 0xffff0000u); };
    const auto bits = [](float v) { return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(v))); };
    float dg0, du0, dg1, du1;
    swiglu_grad<true>(lo(g.x), hi(g.x), lo(d), dg0, du0);
    swiglu_grad<true>(lo(g.y), hi(g.y), hi(d), dg1, du1);
    return make_uint2(bits(dg0) | bits(du0) << 16, bits(dg1) | bits(du1) << 16);
  }
};

// Packed rows (ops/fp8.h: row pitch ld bytes, scales from byte `at`), 8 codes a lane (a block's 256
// columns: two tiles of the rows), each value its code times its row tile's scale, as
// quantize_cols_kernel's kPacked path computes it. The 16 lanes of a tile load the scales of the
// warp's 16 rows, one a lane, and hand them round by shuffles.
struct PackedColsIn {
  static constexpr int kPer = 8;
  static constexpr int kLanesPerTile = kTile / kPer;
  static constexpr uint32_t kMagnitude = 0x7f7f7f7fu;  // |code * s| == |code| * s, rounded alike
  const uint8_t* x;
  int64_t cols, ld, at;
  struct Rows {
    float scale[kTile / kWarps];
  };
  __device__ __forceinline__ uint2 load(int64_t r, int64_t c) const {
    return __ldg(reinterpret_cast<const uint2*>(x + r * ld + c));
  }
  __device__ __forceinline__ Rows rows(int64_t r, int count, int64_t c) const {
    constexpr int kRows = kTile / kWarps;
    static_assert(kRows <= kLanesPerTile, "a tile's lanes hold its rows' scales");
    const int lane = static_cast<int>(threadIdx.x % 32), i = lane % kRows;
    float own = 0.0f;
    if (i < count && c - c % kTile < cols)
      own = __ldg(reinterpret_cast<const float*>(x + (r + i) * ld + at) + c / kTile);
    Rows out;
#pragma unroll
    for (int j = 0; j < kRows; ++j)
      out.scale[j] = __shfl_sync(0xffffffffu, own, lane / kLanesPerTile * kLanesPerTile + j);
    return out;
  }
  __device__ __forceinline__ float2 pair(uint2 raw, const Rows& rows, int i, int h) const {
    const uint32_t w = h < 2 ? raw.x : raw.y;
    const __half2_raw codes =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w >> (16 * (h % 2))), __NV_E4M3);
    const float2 v = __half22float2(__half2(codes));  // exact, as e4m3_value
    return make_float2(v.x * rows.scale[i], v.y * rows.scale[i]);
  }
};

// quantize_cols_wide_kernel's optional second output: the rows layout of the same values
// (launch_fp8_quantize_rows_cols). NoRowsOut: the cols layout alone.
struct NoRowsOut {
  static constexpr bool kOn = false;
};
// q [rows, cols] codes; s the rows' scales, tile b of row r at s[begin * tiles + b * count + (r -
// begin)] with the tile's segment (begin, count) when grouped (launch_fp8_quantize_rows's layout
// with group offsets), else at s[b * rows + r].
struct RowsOut {
  static constexpr bool kOn = true;
  uint8_t* q;
  float* s;
  int64_t rows, tiles;
  bool grouped;
};

// The largest of v over the warp's lanes, in every lane.
__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xffffffffu, v);
#else
  for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
#endif
}

// quantize_cols_kernel with 8-byte loads and 16-byte staging: block (cx, pt) takes columns
// [kChunk cx, kChunk cx + kChunk) of padded tile pt (kChunk = 32 lanes x In::kPer columns); warp w
// loads rows 16 w .. 16 w + 15 (all 16 loads in flight), so that a lane holds 16 consecutive rows
// of its columns and stages each column's 16 codes as one 16-byte store. The staged column's
// 16-byte chunks are swizzled (chunk j of column cl at j ^ (cl / kPer % 8)) so that neither the
// stores nor the reads conflict; 8 lanes write a column's 128 bytes of qT.
// With RowsOut (kChunk == 128: the block's columns are one tile of a row, b = blockIdx.x) the same
// registers give the rows layout too: row t's amax over the warp, its four codes a lane as one
// 32-bit store, its scale from lane t % 16 (x read once for both of a backward's operands).
// REQUIRES: cols % In::kPer == 0, In's rows aligned for its loads, qT 4-byte aligned (16 if q16);
// with RowsOut, q 4-byte aligned. With RowsOut three blocks an SM (80 registers, 16 bytes
// spilled; left alone ptxas takes 124 and two blocks fit: 0.244 against 0.219 ms for [65536, 2048]
// on an H100).
template <class In, class Out = NoRowsOut>
__global__ void __launch_bounds__(kThreads, Out::kOn ? 3 : 0)
    quantize_cols_wide_kernel(In in, int64_t cols, int64_t p, const ColTile* __restrict__ map, uint8_t* __restrict__ qT,
                              float* __restrict__ sT, bool q16, Out out = {}) {
  constexpr int kPer = In::kPer;         // columns per lane
  constexpr int kChunk = 32 * kPer;      // columns per block
  constexpr int kRows = kTile / kWarps;  // rows per warp
  static_assert(kRows == 16, "a warp's rows are one 16-byte chunk of a staged column");
  static_assert(kChunk <= kThreads, "column_scales gives each column a thread");
  const int64_t pt = blockIdx.y;
  const ColTile tile = map[pt];
  if (tile.n == 0) return;
  const int n = static_cast<int>(tile.n);
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t c0 = blockIdx.x * static_cast<int64_t>(kChunk), c = c0 + kPer * lane;
  __shared__ __align__(16) uint32_t partial[kWarps][kChunk];
  __shared__ float inv_of[kChunk];
  __shared__ bool finite_of[kChunk];
  __shared__ __align__(16) uint8_t codes[kChunk][kTile];

  uint2 raw[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int t = kRows * warp + i;
    raw[i] = make_uint2(0, 0);
    if (c < cols && t < n) raw[i] = in.load(tile.r0 + t, c);
  }
  const typename In::Rows rows = in.rows(tile.r0 + kRows * warp, n - kRows * warp, c);
  uint32_t m[kPer];
#pragma unroll
  for (int h = 0; h < kPer / 2; ++h) {
    m[2 * h] = m[2 * h + 1] = 0;
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const float2 v = in.pair(make_uint2(raw[i].x & In::kMagnitude, raw[i].y & In::kMagnitude), rows, i, h);
      m[2 * h] = max(m[2 * h], abs_bits(v.x));
      m[2 * h + 1] = max(m[2 * h + 1], abs_bits(v.y));
    }
  }
  if constexpr (Out::kOn) {
    static_assert(std::is_base_of_v<DenseColsIn<__nv_bfloat16>, In>, "a block's columns are one tile of each row");
    float own_scale = 0.0f;  // row kRows * warp + lane's (lanes below kRows)
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      // amax on the bf16 bits (sign cleared, integer order is float order): two halves at a time,
      // then as an f32's bits (a bf16 is the high half of its float).
      const uint32_t m2 = __vmaxu2(raw[i].x & In::kMagnitude, raw[i].y & In::kMagnitude);
      const uint32_t mx = warp_max(max(m2 & 0xffffu, m2 >> 16) << 16);
      const TileScale ts = tile_scale(mx);
      const float2 lo = in.pair(raw[i], rows, i, 0), hi = in.pair(raw[i], rows, i, 1);
      const float a[4] = {lo.x * ts.inv, lo.y * ts.inv, hi.x * ts.inv, hi.y * ts.inv};
      const uint32_t codes4 = e4m3x4(a, ts.finite);
      const int t = kRows * warp + i;
      if (t < n && c < cols) *reinterpret_cast<uint32_t*>(out.q + (tile.r0 + t) * cols + c) = codes4;
      if (lane == i) own_scale = ts.scale;
    }
    const int t = kRows * warp + lane;
    if (lane < kRows && t < n) {
      const int64_t r = tile.r0 + t, b = blockIdx.x;
      out.s[out.grouped ? tile.begin * out.tiles + b * tile.count + (r - tile.begin) : b * out.rows + r] = own_scale;
    }
  }
  if constexpr (kPer == 2) {
    *reinterpret_cast<uint2*>(&partial[warp][kPer * lane]) = make_uint2(m[0], m[1]);
  } else {
#pragma unroll
    for (int j = 0; j < kPer; j += 4)
      *reinterpret_cast<uint4*>(&partial[warp][kPer * lane + j]) = make_uint4(m[j], m[j + 1], m[j + 2], m[j + 3]);
  }
  __syncthreads();
  column_scales<kChunk>(partial, pt, cols, c0, inv_of, finite_of, sT);
  __syncthreads();
#pragma unroll
  for (int h = 0; h < kPer / 2; ++h) {  // columns cl and cl + 1
    const int cl = kPer * lane + 2 * h;
    const float inv0 = inv_of[cl], inv1 = inv_of[cl + 1];
    const bool finite0 = finite_of[cl], finite1 = finite_of[cl + 1];
    uint32_t w0[4], w1[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      float a[4], b[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float2 v = in.pair(raw[4 * g + u], rows, 4 * g + u, h);
        a[u] = v.x * inv0, b[u] = v.y * inv1;
      }
      w0[g] = e4m3x4(a, finite0);
      w1[g] = e4m3x4(b, finite1);
    }
    const int chunk = 16 * (warp ^ (lane % 8));
    *reinterpret_cast<uint4*>(&codes[cl][chunk]) = make_uint4(w0[0], w0[1], w0[2], w0[3]);
    *reinterpret_cast<uint4*>(&codes[cl + 1][chunk]) = make_uint4(w1[0], w1[1], w1[2], w1[3]);
  }
  __syncthreads();
  const int part = lane % 8, t = 16 * part;  // this lane's 16 rows of a column
  for (int cl = 4 * warp + lane / 8; cl < kChunk && c0 + cl < cols; cl += 4 * kWarps) {
    const uint4 v = *reinterpret_cast<const uint4*>(&codes[cl][16 * (part ^ (cl / kPer % 8))]);
    uint8_t* dst = qT + (c0 + cl) * p + pt * kTile + t;  // p % 128 == 0
    if (t + 16 <= n) {
      if (q16) {
        *reinterpret_cast<uint4*>(dst) = v;
      } else {
        uint32_t* d4 = reinterpret_cast<uint32_t*>(dst);
        d4[0] = v.x, d4[1] = v.y, d4[2] = v.z, d4[3] = v.w;
      }
    } else {
      const uint32_t w[4] = {v.x, v.y, v.z, v.w};
      for (int j = 0; t + j < n; ++j) dst[j] = static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
    }
  }
}

// Block (cx, pt): thread j writes column 256 cx + j of padded tile pt's rows (x's rows coalesced;
// qT read a byte at a time: the inverse serves tests and the CPU-style emulation, not training).
template <class T>
__global__ void __launch_bounds__(kThreads)
    dequantize_cols_kernel(const uint8_t* __restrict__ qT, const float* __restrict__ sT, int64_t cols, int64_t p,
                           const ColTile* __restrict__ map, T* __restrict__ x) {
  const int64_t pt = blockIdx.y, c = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  const ColTile tile = map[pt];
  if (c >= cols) return;
  const float s = sT[pt * cols + c];
  const uint8_t* src = qT + c * p + pt * kTile;
  for (int64_t t = 0; t < tile.n; ++t) x[(tile.r0 + t) * cols + c] = from_float<T>(e4m3_value(src[t]) * s);
}

// ---- blocks ----------------------------------------------------------------------------------------

// A block's codes staged transposed in shared memory (codes[column][row], h rows x wd columns) out
// to qT's rows, dst its element (i0, o0) (qT [i, o_n]): warp w writes columns w, w + 8, ..., lane l
// bytes 4l .. 4l + 3 of each (128 contiguous bytes). vec_t: o_n % 4 == 0 with qT 4-byte aligned.
__device__ __forceinline__ void store_block_transposed(const uint8_t (*codes)[kCodeStride], uint8_t* __restrict__ dst,
                                                       int64_t o_n, int h, int wd, bool vec_t) {
  const int t = 4 * static_cast<int>(threadIdx.x % 32);
  for (int cl = static_cast<int>(threadIdx.x / 32); cl < wd; cl += kWarps) {
    uint8_t* row = dst + cl * o_n;
    if (vec_t && t + 3 < h) {
      *reinterpret_cast<uint32_t*>(row + t) = *reinterpret_cast<const uint32_t*>(&codes[cl][t]);
    } else {
      for (int j = 0; j < 4; ++j)
        if (t + j < h) row[t + j] = codes[cl][t + j];
    }
  }
}

// The blocks kernels' block (bi, bo, e) = blockIdx: matrix e's 128 x 128 block (bo, bi), h rows x
// wd columns of it (fewer at the edges), base the index of its element (o0, i0) in w [e, o, i].
struct WeightBlock {
  int64_t e, bo, bi, o0, i0, base;
  int h, wd;
  __device__ WeightBlock(int64_t o_n, int64_t i_n)
      : e(blockIdx.z),
        bo(blockIdx.y),
        bi(blockIdx.x),
        o0(bo * kTile),
        i0(bi * kTile),
        base(e * o_n * i_n + o0 * i_n + i0),
        h(static_cast<int>(std::min<int64_t>(kTile, o_n - o0))),
        wd(static_cast<int>(std::min<int64_t>(kTile, i_n - i0))) {}
  // The block's scale from every thread's amax bits m (a warp max, then the block's through
  // partial[kWarps]), written by thread 0 to s and sT (either may be null) in the blocks layouts.
  __device__ TileScale scale(uint32_t m, uint32_t* partial, float* __restrict__ s, float* __restrict__ sT) const {
    m = warp_max(m);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = m;
    __syncthreads();
    m = partial[0];
    for (int j = 1; j < kWarps; ++j) m = max(m, partial[j]);
    const TileScale ts = tile_scale(m);
    const int64_t ob = gridDim.y, ib = gridDim.x;
    if (threadIdx.x == 0) {
      if (s != nullptr) s[(e * ob + bo) * ib + bi] = ts.scale;
      if (sT != nullptr) sT[(e * ib + bi) * ob + bo] = ts.scale;
    }
    return ts;
  }
};

// Block (bi, bo, e): the 128 x 128 block (bo, bi) of matrix e, element by element (I % 4 != 0 or
// unaligned w, q: else quantize_blocks_wide_kernel). Lane l of warp w holds columns 4l .. 4l + 3 of
// rows w, w + 8, ..., w + 120; vec_t: o % 4 == 0 with qT aligned (32-bit stores of qT's rows).
template <class T>
__global__ void __launch_bounds__(kThreads)
    quantize_blocks_kernel(const T* __restrict__ w, int64_t o_n, int64_t i_n, uint8_t* __restrict__ q,
                           float* __restrict__ s, uint8_t* __restrict__ qT, float* __restrict__ sT, bool vec_t,
                           bool via_bf16) {
  const WeightBlock blk(o_n, i_n);
  const int64_t e = blk.e, o0 = blk.o0, i0 = blk.i0, base = blk.base;
  const int h = blk.h, wd = blk.wd;
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int c = 4 * lane;
  __shared__ uint32_t partial[kWarps];
  __shared__ __align__(16) uint8_t codes[kTile][kCodeStride];  // [column][row]: qT's rows

  float v[kTile / kWarps][4];
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kTile / kWarps; ++i) {
    const int o = warp + kWarps * i;
    v[i][0] = v[i][1] = v[i][2] = v[i][3] = 0.0f;
    if (o < h) {
      const T* row = w + base + o * i_n;
      for (int j = 0; j < 4; ++j)
        if (c + j < wd) v[i][j] = to_float(row[c + j]);
      if (via_bf16)  // an f32 master quantized as its bf16 copy would be (uniform over the grid)
        for (int j = 0; j < 4; ++j) v[i][j] = __bfloat162float(__float2bfloat16_rn(v[i][j]));
    }
    m = max(m, max(max(abs_bits(v[i][0]), abs_bits(v[i][1])), max(abs_bits(v[i][2]), abs_bits(v[i][3]))));
  }
  const TileScale ts = blk.scale(m, partial, s, sT);
#pragma unroll
  for (int i = 0; i < kTile / kWarps; ++i) {
    const int o = warp + kWarps * i;
    if (o >= h) continue;
    const float scaled[4] = {v[i][0] * ts.inv, v[i][1] * ts.inv, v[i][2] * ts.inv, v[i][3] * ts.inv};
    const uint32_t c4 = e4m3x4(scaled, ts.finite);
    if (q != nullptr) {
      uint8_t* dst = q + base + o * i_n + c;
      for (int j = 0; j < 4; ++j)
        if (c + j < wd) dst[j] = static_cast<uint8_t>(c4 >> (8 * j));
    }
    if (qT != nullptr)
      for (int j = 0; j < 4; ++j)
        if (c + j < wd) codes[c + j][o] = static_cast<uint8_t>(c4 >> (8 * j));
  }
  if (qT == nullptr) return;  // uniform over the block
  __syncthreads();
  store_block_transposed(codes, qT + e * i_n * o_n + i0 * o_n + o0, o_n, h, wd, vec_t);
}

// The blocks of aligned weights, with a layout that stages the transpose in 16-byte pieces:
// warp w holds rows 16 w .. 16 w + 15 of the block (lane l its columns 4l .. 4l + 3), bf16 values
// (and f32 ones quantized via bf16) kept as their bf16 bits (32 registers), so that each of a
// lane's columns has 16 consecutive codes: a 4 x 4 byte transpose of four rows' code words gives
// them, staged as one 16-byte store per column (16-byte chunks swizzled as in
// quantize_cols_wide_kernel), then 8 lanes write a column's 128 bytes of qT. The same codes and
// scales. REQUIRES: i % 4 == 0, w aligned for 8-byte (bf16) / 16-byte (f32) loads, q 4-byte
// aligned; vec_t: o % 4 == 0 with qT 4-byte aligned, q16t: o % 16 == 0 with qT 16-byte aligned.
template <class T, bool kViaBf16>
__global__ void __launch_bounds__(kThreads)
    quantize_blocks_wide_kernel(const T* __restrict__ w, int64_t o_n, int64_t i_n, uint8_t* __restrict__ q,
                                float* __restrict__ s, uint8_t* __restrict__ qT, float* __restrict__ sT, bool vec_t,
                                bool q16t) {
  constexpr bool kBits = std::is_same_v<T, __nv_bfloat16> || kViaBf16;  // values held as bf16 bits
  constexpr int kRows = kTile / kWarps;
  static_assert(kRows == 16, "a warp's rows are one 16-byte chunk of a staged column");
  using Raw = std::conditional_t<kBits, uint2, float4>;
  const WeightBlock blk(o_n, i_n);
  const int64_t e = blk.e, o0 = blk.o0, i0 = blk.i0, base = blk.base;
  const int h = blk.h, wd = blk.wd;
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int c = 4 * lane;
  __shared__ uint32_t partial[kWarps];
  __shared__ __align__(16) uint8_t codes[kTile][kTile];  // [column][row]: qT's rows

  Raw raw[kRows];
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    const int o = kRows * warp + i;
    raw[i] = Raw{};
    if (o < h && c < wd) {
      const T* p = w + base + o * i_n + c;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        raw[i] = __ldg(reinterpret_cast<const uint2*>(p));
      } else if constexpr (kViaBf16) {  // an f32 master quantized as its bf16 copy would be
        const float4 f = __ldg(reinterpret_cast<const float4*>(p));
        const auto bits = [](float a) { return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(a))); };
        raw[i] = make_uint2(bits(f.x) | bits(f.y) << 16, bits(f.z) | bits(f.w) << 16);
      } else {
        raw[i] = __ldg(reinterpret_cast<const float4*>(p));
      }
    }
  }
  // Value j of a lane's four (a bf16 is the high half of its float).
  const auto value = [](const Raw& r, int j) {
    if constexpr (kBits) {
      const uint32_t x = j < 2 ? r.x : r.y;
      return __uint_as_float(j % 2 == 0 ? x << 16 : x & 0xffff0000u);
    } else {
      return j == 0 ? r.x : j == 1 ? r.y : j == 2 ? r.z : r.w;
    }
  };
  uint32_t m = 0;
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
    if constexpr (kBits) {  // sign cleared, integer order is float order
      const uint32_t m2 = __vmaxu2(raw[i].x & 0x7fff7fffu, raw[i].y & 0x7fff7fffu);
      m = max(m, max(m2 & 0xffffu, m2 >> 16) << 16);
    } else {
      m = max(m, max(max(abs_bits(raw[i].x), abs_bits(raw[i].y)), max(abs_bits(raw[i].z), abs_bits(raw[i].w))));
    }
  }
  const TileScale ts = blk.scale(m, partial, s, sT);
  uint32_t col[4][kRows / 4];  // column j's codes of rows 4g .. 4g + 3 of the warp's: col[j][g]
#pragma unroll
  for (int g = 0; g < kRows / 4; ++g) {
    uint32_t row4[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = 4 * g + u, o = kRows * warp + i;
      const float a[4] = {value(raw[i], 0) * ts.inv, value(raw[i], 1) * ts.inv, value(raw[i], 2) * ts.inv,
                          value(raw[i], 3) * ts.inv};
      row4[u] = e4m3x4(a, ts.finite);
      if (q != nullptr && o < h && c < wd) *reinterpret_cast<uint32_t*>(q + base + o * i_n + c) = row4[u];
    }
    // The four rows' words transposed: column j's four codes (rows 4g .. 4g + 3) as one word.
    const uint32_t t0 = __byte_perm(row4[0], row4[1], 0x5140), t1 = __byte_perm(row4[2], row4[3], 0x5140);
    const uint32_t t2 = __byte_perm(row4[0], row4[1], 0x7362), t3 = __byte_perm(row4[2], row4[3], 0x7362);
    col[0][g] = __byte_perm(t0, t1, 0x5410), col[1][g] = __byte_perm(t0, t1, 0x7632);
    col[2][g] = __byte_perm(t2, t3, 0x5410), col[3][g] = __byte_perm(t2, t3, 0x7632);
  }
  if (qT == nullptr) return;  // uniform over the block
  const int chunk = 16 * (warp ^ (lane % 8));
#pragma unroll
  for (int j = 0; j < 4; ++j)
    *reinterpret_cast<uint4*>(&codes[c + j][chunk]) = make_uint4(col[j][0], col[j][1], col[j][2], col[j][3]);
  __syncthreads();
  const int part = lane % 8, t = 16 * part;  // this lane's 16 rows of a column
  for (int cl = 4 * warp + lane / 8; cl < wd; cl += 4 * kWarps) {
    const uint4 v = *reinterpret_cast<const uint4*>(&codes[cl][16 * (part ^ (cl / 4 % 8))]);
    uint8_t* dst = qT + e * i_n * o_n + (i0 + cl) * o_n + o0 + t;
    if (t + 16 <= h && q16t) {
      *reinterpret_cast<uint4*>(dst) = v;
    } else if (t + 16 <= h && vec_t) {
      uint32_t* d4 = reinterpret_cast<uint32_t*>(dst);
      d4[0] = v.x, d4[1] = v.y, d4[2] = v.z, d4[3] = v.w;
    } else {
      const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
      for (int j = 0; j < 16 && t + j < h; ++j) dst[j] = static_cast<uint8_t>(wv[j / 4] >> (8 * (j % 4)));
    }
  }
}

// w [e, o, i] = q * s, one thread per element.
template <class T>
__global__ void dequantize_blocks_kernel(const uint8_t* __restrict__ q, const float* __restrict__ s, int64_t e_n,
                                         int64_t o_n, int64_t i_n, T* __restrict__ w) {
  const int64_t n = e_n * o_n * i_n, ob = (o_n + kTile - 1) / kTile, ib = (i_n + kTile - 1) / kTile;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % i_n, o = (idx / i_n) % o_n, e = idx / (i_n * o_n);
    w[idx] = from_float<T>(e4m3_value(q[idx]) * s[(e * ob + o / kTile) * ib + i / kTile]);
  }
}

// q [e, o, i] into qT [e, i, o] and s [e, ob, ib] into sT [e, ib, ob] (fp8_transpose_blocks), block
// (bi, bo, e) moving block (bo, bi) of matrix e as quantize_blocks_kernel moves its codes: rows read
// 128 bytes a warp, staged transposed in shared memory, written 128 bytes a warp. kVec: i % 4 == 0
// with q aligned (32-bit loads); vec_t as store_block_transposed's.
template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    transpose_blocks_kernel(const uint8_t* __restrict__ q, const float* __restrict__ s, int64_t o_n, int64_t i_n,
                            uint8_t* __restrict__ qT, float* __restrict__ sT, bool vec_t) {
  const int64_t e = blockIdx.z, bo = blockIdx.y, bi = blockIdx.x, ob = gridDim.y, ib = gridDim.x;
  const int64_t o0 = bo * kTile, i0 = bi * kTile;
  const int h = static_cast<int>(std::min<int64_t>(kTile, o_n - o0)),
            wd = static_cast<int>(std::min<int64_t>(kTile, i_n - i0));
  const int c = 4 * static_cast<int>(threadIdx.x % 32);
  __shared__ __align__(16) uint8_t codes[kTile][kCodeStride];
  if (threadIdx.x == 0) sT[(e * ib + bi) * ob + bo] = s[(e * ob + bo) * ib + bi];
  const uint8_t* src = q + e * o_n * i_n + o0 * i_n + i0 + c;
  for (int o = static_cast<int>(threadIdx.x / 32); o < h; o += kWarps) {
    if constexpr (kVec) {
      if (c < wd) {  // wd % 4 == 0
        const uint32_t c4 = *reinterpret_cast<const uint32_t*>(src + o * i_n);
        for (int j = 0; j < 4; ++j) codes[c + j][o] = static_cast<uint8_t>(c4 >> (8 * j));
      }
    } else {
      for (int j = 0; j < 4; ++j)
        if (c + j < wd) codes[c + j][o] = src[o * i_n + j];
    }
  }
  __syncthreads();
  store_block_transposed(codes, qT + e * i_n * o_n + i0 * o_n + o0, o_n, h, wd, vec_t);
}

// ---- parts of a weight (fp8_block_amax, fp8_quantize_part) ----------------------------------------

// A part (elements [first, first + n) of a weight [e, o_n, i_n], flat) seen as the rows of the
// weight's [e * o_n, i_n] view it touches: rows [r0, r0 + rows). Each warp takes tiles of those rows
// as quantize_rows_kernel does (lane l: columns 4l .. 4l + 3 of a 128-column tile), so a warp's
// elements all lie in one block and need no index arithmetic per element.
struct PartRows {
  int64_t n, first, o_n, i_n, ob, ib, r0, rows;
};

constexpr int kPartRows = 4;  // rows per warp: block (x, b) covers rows 32x .. 32x + 31 of tile b
static_assert(kWarps * kPartRows == 32, "block_amax_kernel gives each of its 32 row tiles a lane");

// A warp's current row among the part's rows (y, then y + 8, ...): its matrix e and row o in the
// weight and the part's index j of its column 0, one division for the first and steps after.
struct PartRow {
  int64_t y, e, o, j;
  __device__ PartRow(const PartRows& p, int64_t first_y)
      : y(first_y), e((p.r0 + y) / p.o_n), o(p.r0 + y - e * p.o_n), j((p.r0 + y) * p.i_n - p.first) {}
  __device__ void next(const PartRows& p) {
    y += kWarps;
    j += kWarps * p.i_n;
    for (o += kWarps; o >= p.o_n; o -= p.o_n) ++e;
  }
};

// A lane's four elements of a row, tile blockIdx.y.
struct PartQuad {
  int64_t j;      // the part's index of the first element (outside [0, n) for elements not in the part)
  int64_t block;  // the flat index of the elements' block (blocks layout [e, ob, ib])
  unsigned in;    // bit k: element k lies in the part
};

// The lane's values v of `row` (0 where not in the part: they leave an amax as it is), read as the
// blocks kernel reads w (rounded to bf16 first with via_bf16). kVec: i_n % 4 == 0, first % 4 == 0
// and part aligned (a lane's four elements are then all in or all out, but for the part's last).
template <class T, bool kVec>
__device__ __forceinline__ PartQuad load_part_quad(const T* __restrict__ part, const PartRows& p, const PartRow& row,
                                                   bool via_bf16, float v[4]) {
  const int64_t c = blockIdx.y * static_cast<int64_t>(kTile) + 4 * (threadIdx.x % 32);
  PartQuad quad{row.j + c, (row.e * p.ob + row.o / kTile) * p.ib + blockIdx.y, 0u};
  for (int k = 0; k < 4; ++k) v[k] = 0.0f;
  if (row.y < p.rows) {
    if (row.j >= 0 && row.j + p.i_n <= p.n) {  // the whole row lies in the part (most rows)
      const int64_t left = p.i_n - c;
      quad.in = left >= 4 ? 0xfu : left > 0 ? (1u << left) - 1u : 0u;
    } else {
      for (int k = 0; k < 4; ++k)
        if (c + k < p.i_n && quad.j + k >= 0 && quad.j + k < p.n) quad.in |= 1u << k;
    }
  }
  if (kVec && quad.in == 0xfu) {
    load4(part + quad.j, v);
  } else {
    for (int k = 0; k < 4; ++k)
      if (quad.in >> k & 1u) v[k] = to_float(part[quad.j + k]);
  }
  if (via_bf16) {  // __float2bfloat16_rn's roundings, two to an instruction
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
    v[0] = __low2float(lo), v[1] = __high2float(lo), v[2] = __low2float(hi), v[3] = __high2float(hi);
  }
  return quad;
}

// Block (x, b): rows 32x .. 32x + 31 of the part's rows, tile b; warp w reads rows w, w + 8, w + 16,
// w + 24 (four loads in flight per lane). Each row tile's max is a warp max (its elements share a
// block); the 32 row tiles' maxima go to warp 0, whose lanes group equal blocks (__match_any_sync:
// 32 consecutive rows span one block but where a 128-row band or a matrix ends) and add each
// group's max by one atomicMax on the float's bits: one atomic per 4096 elements, not per element.
// Non-negative floats order as their bits; non-finite |v| clamp to +infinity's bits.
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    block_amax_kernel(const T* __restrict__ part, PartRows p, float* __restrict__ amax, bool via_bf16) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  __shared__ int64_t block_of[32];
  __shared__ uint32_t max_of[32];
  PartRow row(p, blockIdx.x * 32LL + warp);
  float v[kPartRows][4];
  PartQuad quad[kPartRows];
#pragma unroll
  for (int i = 0; i < kPartRows; ++i, row.next(p)) quad[i] = load_part_quad<T, kVec>(part, p, row, via_bf16, v[i]);
#pragma unroll
  for (int i = 0; i < kPartRows; ++i) {
    uint32_t m = max(max(abs_bits(v[i][0]), abs_bits(v[i][1])), max(abs_bits(v[i][2]), abs_bits(v[i][3])));
    m = __reduce_max_sync(0xffffffffu, min(m, kInfBits));
    if (lane == 0) {
      block_of[warp + kWarps * i] = quad[i].block;
      max_of[warp + kWarps * i] = m;
    }
  }
  __syncthreads();
  if (warp != 0) return;
  const int64_t block = block_of[lane];
  const unsigned same = __match_any_sync(0xffffffffu, static_cast<unsigned long long>(block));
  const uint32_t m = __reduce_max_sync(same, max_of[lane]);
  // m == 0 changes nothing (amax starts at 0); rows past the part's (m == 0) have no block.
  if (lane == __ffs(same) - 1 && m != 0) atomicMax(reinterpret_cast<int*>(amax) + block, static_cast<int>(m));
}

// 1 / s exactly where s is a positive normal power of two (every scale fp8_tile_scale gives), so
// v * (1 / s) is v / s's correctly rounded quotient; 0 for other s (divided instead).
__device__ __forceinline__ float pow2_inverse(float s) {
  const uint32_t bits = __float_as_uint(s), exp_field = bits >> 23;  // with the sign: negatives >= 256
  if ((bits & 0x7fffffu) != 0 || exp_field == 0 || exp_field >= 255) return 0.0f;
  return exp_field == 254 ? __uint_as_float(0x00400000u) : __uint_as_float((254u - exp_field) << 23);  // 2^-127
}

// Block (x, b) as block_amax_kernel's; each lane writes its elements' codes e4m3(v / s[block])
// (e4m3_special's rule for the non-finite quotients). kVec: q aligned too (one 32-bit store).
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    quantize_part_kernel(const T* __restrict__ part, PartRows p, const float* __restrict__ s, uint8_t* __restrict__ q,
                         bool via_bf16) {
  PartRow row(p, blockIdx.x * 32LL + threadIdx.x / 32);
#pragma unroll
  for (int i = 0; i < kPartRows; ++i, row.next(p)) {
    float v[4];
    const PartQuad quad = load_part_quad<T, kVec>(part, p, row, via_bf16, v);
    if (quad.in == 0) continue;
    const float scale = s[quad.block], inv = pow2_inverse(scale);
    float x[4];
    if (inv != 0.0f) {  // uniform over the warp
      for (int k = 0; k < 4; ++k) x[k] = v[k] * inv;
    } else {
      for (int k = 0; k < 4; ++k) x[k] = __fdiv_rn(v[k], scale);
    }
    uint32_t m = 0;
    for (int k = 0; k < 4; ++k)
      if (quad.in >> k & 1u) m = max(m, abs_bits(x[k]));
    const uint32_t codes = e4m3x4(x, m < kInfBits);
    if (kVec && quad.in == 0xfu) {
      *reinterpret_cast<uint32_t*>(q + quad.j) = codes;
    } else {
      for (int k = 0; k < 4; ++k)
        if (quad.in >> k & 1u) q[quad.j + k] = static_cast<uint8_t>(codes >> (8 * k));
    }
  }
}

// In place: each amax to its scale (fp8_tile_scale, as tile_scale reads it off the bits: negative,
// NaN and infinite values give 1 as the CPU's !(amax > 0) || !isfinite(amax)).
__global__ void scales_from_amax_kernel(float* __restrict__ a, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    a[i] = tile_scale(__float_as_uint(a[i])).scale;
}

// ---- launch helpers --------------------------------------------------------------------------------

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Calls f.template operator()<T>() for a GPU input dtype (f32, bf16); f64 and others fail clearly.
template <class F>
void with_input_dtype(DType dtype, const char* what, F&& f) {
  if (dtype == DType::f32) return f.template operator()<float>();
  if (dtype == DType::bf16) return f.template operator()<__nv_bfloat16>();
  MF_FAIL(what, " on the GPU: ", dtype_name(dtype), " values (the GPU quantizes f32 or bf16; f64 is CPU-only)");
}

// Blocks for an elementwise grid-stride loop over n elements.
unsigned elementwise_blocks(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(n, kThreads), 1, 65536));
}

unsigned grid_dim_yz(int64_t n, const char* what) {
  if (n > 65535) MF_FAIL(what, " on the GPU: ", n, " tiles along a grid dimension limited to 65535");
  return static_cast<unsigned>(n);
}

// The cols layout's tile map for `segments` segments (offsets on the device, or nullptr: one of
// all `rows`), in fp8_tile_map scratch.
const ColTile* col_tiles(const ExecContext& ctx, const int64_t* offsets, int64_t segments, int64_t rows,
                         int64_t tiles) {
  auto* map =
      static_cast<ColTile*>(ctx.scratch(ScratchSlot::fp8_tile_map, static_cast<size_t>(tiles) * sizeof(ColTile)));
  col_tiles_kernel<<<1, kThreads, 0, stream_of(ctx)>>>(offsets, segments, rows, tiles, map);
  MF_CUDA_LAUNCHED("fp8 cols (tile map)");
  return map;
}

}  // namespace

// ---- raw launchers ---------------------------------------------------------------------------------

namespace {
// Rows (packed_at < 0: q [rows, k], scales s) or packed rows (q [rows, ldq], scales in the rows).
// swiglu: x is bf16 gu [rows, 2k] (GateUp::pairs) and the rows quantized are swiglu(gu).
void quantize_rows(const ExecContext& ctx, const void* x, DType dtype, int64_t rows, int64_t k, uint8_t* q, float* s,
                   const int64_t* group_offsets, int64_t groups, int64_t ldq, int64_t packed_at, bool swiglu = false) {
  if (rows == 0 || k == 0) return;
  const char* what = swiglu ? "fp8_swiglu_packed" : "fp8_quantize_rows";
  const dim3 grid(static_cast<unsigned>(ceil_div(rows, kWarps)), grid_dim_yz(ceil_div(k, kTile), what));
  const auto launch = [&]<class T, bool kSwiglu>() {
    const T* xt = static_cast<const T*>(x);
    constexpr int kPer = 16 / static_cast<int>(sizeof(T));
    if (!kSwiglu && packed_at < 0 && k % kPer == 0 && aligned(x, 16) && aligned(q, kPer)) {
      const int64_t tiles = ceil_div(k, kTile), rows_per_block = kWarps * kRowSteps * (32 * kPer / kTile);
      const dim3 g(static_cast<unsigned>(ceil_div(rows, rows_per_block)), grid_dim_yz(tiles, what));
      quantize_rows_wide_kernel<T>
          <<<g, kThreads, 0, stream_of(ctx)>>>(xt, rows, k, tiles, q, s, group_offsets, static_cast<int>(groups));
      return;
    }
    // A lane reads 4 elements (SwiGLU: 4 gate-up pairs, 16 bytes of bf16) and writes 4 codes.
    const bool vec = k % 4 == 0 && ldq % 4 == 0 && aligned(x, (kSwiglu ? 8 : 4) * sizeof(T)) && aligned(q, 4);
    if (vec)
      quantize_rows_kernel<T, true, kSwiglu><<<grid, kThreads, 0, stream_of(ctx)>>>(
          xt, rows, k, q, s, group_offsets, static_cast<int>(groups), ldq, packed_at);
    else
      quantize_rows_kernel<T, false, kSwiglu><<<grid, kThreads, 0, stream_of(ctx)>>>(
          xt, rows, k, q, s, group_offsets, static_cast<int>(groups), ldq, packed_at);
  };
  if (swiglu) {
    if (dtype != DType::bf16) MF_FAIL("fp8_swiglu_packed on the GPU: ", dtype_name(dtype), " gu (bf16 only)");
    launch.template operator()<__nv_bfloat16, true>();
  } else {
    with_input_dtype(dtype, what, [&]<class T>() { launch.template operator()<T, false>(); });
  }
  MF_CUDA_LAUNCHED(what);
}
}  // namespace

void launch_fp8_quantize_rows(const ExecContext& ctx, const void* x, DType dtype, int64_t rows, int64_t k, uint8_t* q,
                              float* s, const int64_t* group_offsets, int64_t groups) {
  quantize_rows(ctx, x, dtype, rows, k, q, s, group_offsets, groups, k, -1);
}

void launch_fp8_packed_scales(const ExecContext& ctx, const uint8_t* p, int64_t rows, int64_t k, float* s,
                              const int64_t* group_offsets, int64_t groups) {
  if (rows == 0 || k == 0) return;
  const int64_t tiles = ceil_div(k, kTile);
  packed_scales_kernel<<<elementwise_blocks(rows * tiles), kThreads, 0, stream_of(ctx)>>>(
      p, rows, tiles, fp8_packed_width(k), fp8_packed_scales_at(k), group_offsets, static_cast<int>(groups), s);
  MF_CUDA_LAUNCHED("fp8 packed rows' scales");
}

namespace {
// quantize_cols_wide_kernel over input `in`: grid.y padded tiles, columns in blocks of 32 In::kPer.
template <class In, class Out = NoRowsOut>
void launch_cols_wide(const ExecContext& ctx, const In& in, int64_t cols, int64_t p, dim3 grid, const ColTile* map,
                      uint8_t* qT, float* sT, const Out& out = {}) {
  quantize_cols_wide_kernel<In, Out>
      <<<dim3(static_cast<unsigned>(ceil_div(cols, 32 * In::kPer)), grid.y), kThreads, 0, stream_of(ctx)>>>(
          in, cols, p, map, qT, sT, aligned(qT, 16), out);
}

// The cols layout's launches: the checks, the tile map and the grid, then launch(grid, map).
template <class Launch>
void quantize_cols(const ExecContext& ctx, int64_t rows, int64_t cols, const int64_t* offsets, int64_t segments,
                   int64_t p, const uint8_t* qT, const char* what, const Launch& launch) {
  MF_CHECK(p % kTile == 0, "fp8_quantize_cols: qT's width ", p, " is not a multiple of 128");
  if (rows == 0 || cols == 0 || p == 0) return;
  const int64_t tiles = p / kTile;
  const ColTile* map = col_tiles(ctx, offsets, segments, rows, tiles);
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, kColChunk)), grid_dim_yz(tiles, "fp8_quantize_cols"));
  MF_CHECK(aligned(qT, 4), "fp8_quantize_cols: qT is not 4-byte aligned");
  launch(grid, map);
  MF_CUDA_LAUNCHED(what);
}
}  // namespace

void launch_fp8_quantize_cols(const ExecContext& ctx, const void* x, DType dtype, int64_t rows, int64_t cols,
                              const int64_t* offsets, int64_t segments, int64_t p, uint8_t* qT, float* sT) {
  quantize_cols(ctx, rows, cols, offsets, segments, p, qT, "fp8_quantize_cols", [&](dim3 grid, const ColTile* map) {
    with_input_dtype(dtype, "fp8_quantize_cols", [&]<class T>() {
      const T* xt = static_cast<const T*>(x);
      if (cols % DenseColsIn<T>::kPer == 0 && aligned(x, 8))
        launch_cols_wide(ctx, DenseColsIn<T>{xt, cols}, cols, p, grid, map, qT, sT);
      else if (cols % 2 == 0 && aligned(x, 2 * sizeof(T)))
        quantize_cols_kernel<T, true><<<grid, kThreads, 0, stream_of(ctx)>>>(xt, cols, p, map, qT, sT, cols, 0);
      else
        quantize_cols_kernel<T, false><<<grid, kThreads, 0, stream_of(ctx)>>>(xt, cols, p, map, qT, sT, cols, 0);
    });
  });
}

bool fp8_rows_cols_fused_serves(DType dtype, int64_t cols, const void* x, const void* q) {
  return dtype == DType::bf16 && cols % DenseColsIn<__nv_bfloat16>::kPer == 0 && aligned(x, 8) && aligned(q, 4);
}

void launch_fp8_quantize_rows_cols(const ExecContext& ctx, const void* x, DType dtype, int64_t rows, int64_t cols,
                                   const int64_t* offsets, int64_t segments, bool grouped_rows, uint8_t* q, float* s,
                                   int64_t p, uint8_t* qT, float* sT) {
  MF_CHECK(fp8_rows_cols_fused_serves(dtype, cols, x, q), "fp8 rows and cols in one pass: ", dtype_name(dtype),
           " x of ", cols, " columns (bf16, a multiple of 4, aligned: else the two passes)");
  const RowsOut out{q, s, rows, ceil_div(cols, kTile), grouped_rows};
  quantize_cols(ctx, rows, cols, offsets, segments, p, qT, "fp8_quantize_rows_cols",
                [&](dim3 grid, const ColTile* map) {
                  launch_cols_wide(ctx, DenseColsIn<__nv_bfloat16>{static_cast<const __nv_bfloat16*>(x), cols}, cols, p,
                                   grid, map, qT, sT, out);
                });
}

bool fp8_swiglu_grad_fused_serves(DType dtype, int64_t cols, const void* gu, const void* dh, const void* q) {
  return fp8_rows_cols_fused_serves(dtype, cols, gu, q) && aligned(dh, 4);
}

void launch_fp8_swiglu_grad_rows_cols(const ExecContext& ctx, const void* gu, const void* dh, int64_t rows,
                                      int64_t cols, const int64_t* offsets, int64_t segments, uint8_t* q, float* s,
                                      int64_t p, uint8_t* qT, float* sT) {
  MF_CHECK(fp8_swiglu_grad_fused_serves(DType::bf16, cols, gu, dh, q), "fp8 SwiGLU gradient in one pass: ", cols,
           " columns (a multiple of 4, aligned: else swiglu_backward and the quantization)");
  const RowsOut out{q, s, rows, ceil_div(cols, kTile), true};
  const SwigluGradColsIn in{{static_cast<const __nv_bfloat16*>(gu), cols}, static_cast<const __nv_bfloat16*>(dh)};
  quantize_cols(ctx, rows, cols, offsets, segments, p, qT, "fp8_swiglu_grad_rows_cols",
                [&](dim3 grid, const ColTile* map) { launch_cols_wide(ctx, in, cols, p, grid, map, qT, sT, out); });
}

void launch_fp8_quantize_cols_packed(const ExecContext& ctx, const uint8_t* x, int64_t rows, int64_t cols,
                                     const int64_t* offsets, int64_t segments, int64_t p, uint8_t* qT, float* sT) {
  const int64_t ld = fp8_packed_width(cols), at = fp8_packed_scales_at(cols);
  quantize_cols(ctx, rows, cols, offsets, segments, p, qT, "fp8_quantize_cols (packed rows)",
                [&](dim3 grid, const ColTile* map) {
                  // ld and at are multiples of 16: 8-byte code loads, aligned scales.
                  if (cols % PackedColsIn::kPer == 0 && aligned(x, 8))
                    launch_cols_wide(ctx, PackedColsIn{x, cols, ld, at}, cols, p, grid, map, qT, sT);
                  else
                    quantize_cols_kernel<uint8_t, false, true>
                        <<<grid, kThreads, 0, stream_of(ctx)>>>(x, cols, p, map, qT, sT, ld, at);
                });
}

void launch_fp8_quantize_blocks(const ExecContext& ctx, const void* w, DType dtype, int64_t e, int64_t o, int64_t i,
                                uint8_t* q, float* s, uint8_t* qT, float* sT, bool via_bf16) {
  if (e == 0 || o == 0 || i == 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(i, kTile)), grid_dim_yz(ceil_div(o, kTile), "fp8_quantize_blocks"),
                  grid_dim_yz(e, "fp8_quantize_blocks"));
  const bool vec_t = o % 4 == 0 && aligned(qT, 4);
  with_input_dtype(dtype, "fp8_quantize_blocks", [&]<class T>() {
    const T* wt = static_cast<const T*>(w);
    if (i % 4 == 0 && aligned(w, 4 * sizeof(T)) && aligned(q, 4)) {
      const bool q16t = o % 16 == 0 && aligned(qT, 16);
      if (std::is_same_v<T, float> && via_bf16)
        quantize_blocks_wide_kernel<T, true>
            <<<grid, kThreads, 0, stream_of(ctx)>>>(wt, o, i, q, s, qT, sT, vec_t, q16t);
      else
        quantize_blocks_wide_kernel<T, false>
            <<<grid, kThreads, 0, stream_of(ctx)>>>(wt, o, i, q, s, qT, sT, vec_t, q16t);
    } else {
      quantize_blocks_kernel<T><<<grid, kThreads, 0, stream_of(ctx)>>>(wt, o, i, q, s, qT, sT, vec_t, via_bf16);
    }
  });
  MF_CUDA_LAUNCHED("fp8_quantize_blocks");
}

namespace {
// The parts' launches (fp8_block_amax, fp8_quantize_part): the dtype (f64 refused even for an empty
// part), the grid over the part's rows and tiles, and the vector path; launch<T, kVec>(grid, rows).
// q_aligned: the codes, if any, 4-byte aligned.
template <class Launch>
void launch_part(const Tensor& part, const Shape& whole, int64_t first, bool q_aligned, const char* what,
                 const Launch& launch) {
  with_input_dtype(part.dtype(), what, [&]<class T>() {
    const int64_t n = part.numel(), o_n = whole[whole.ndim - 2], i_n = whole[whole.ndim - 1];
    if (n == 0) return;
    const int64_t r0 = first / i_n;
    const PartRows p{
        n, first, o_n, i_n, ceil_div(o_n, kTile), ceil_div(i_n, kTile), r0, (first + n - 1) / i_n - r0 + 1};
    const dim3 grid(static_cast<unsigned>(ceil_div(p.rows, 32)), grid_dim_yz(p.ib, what));
    if (i_n % 4 == 0 && first % 4 == 0 && aligned(part.data(), 4 * sizeof(T)) && q_aligned)
      launch.template operator()<T, true>(grid, p);
    else
      launch.template operator()<T, false>(grid, p);
    MF_CUDA_LAUNCHED(what);
  });
}
}  // namespace

// ---- the ops ---------------------------------------------------------------------------------------

void fp8_quantize_rows(const ExecContext& ctx, const Tensor& x_RK, const Tensor& q_RK, const Tensor& s_BR) {
  launch_fp8_quantize_rows(ctx, x_RK.data(), x_RK.dtype(), x_RK.size(0), x_RK.size(1), q_RK.ptr<uint8_t>(),
                           s_BR.ptr<float>(), nullptr, 1);
}

void fp8_quantize_packed(const ExecContext& ctx, const Tensor& x_RK, const Tensor& p_RW) {
  const int64_t k = x_RK.size(1);
  quantize_rows(ctx, x_RK.data(), x_RK.dtype(), x_RK.size(0), k, p_RW.ptr<uint8_t>(), nullptr, nullptr, 1, p_RW.size(1),
                fp8_packed_scales_at(k));
}

void fp8_swiglu_packed(const ExecContext& ctx, const Tensor& gu_R2F, const Tensor& p_RW) {
  const int64_t f = gu_R2F.size(1) / 2;
  quantize_rows(ctx, gu_R2F.data(), gu_R2F.dtype(), gu_R2F.size(0), f, p_RW.ptr<uint8_t>(), nullptr, nullptr, 1,
                p_RW.size(1), fp8_packed_scales_at(f), true);
}

void fp8_swiglu_backward_operands(const ExecContext& ctx, const Tensor& gu_R2F, const Tensor& dh_RF,
                                  const Tensor& offsets_E1, const Tensor& dgu_R2F, Fp8SharedOperands& dyq) {
  const int64_t r_n = gu_R2F.size(0), cols = gu_R2F.size(1), e_n = offsets_E1.numel() - 1;
  const int64_t p = fp8_cols_width(r_n, e_n);
  const bool room = dyq.bytes.defined() && dyq.bytes.dtype() == DType::u8 &&
                    dyq.bytes.numel() >= fp8_shared_operand_bytes(r_n, cols, e_n, true);
  auto* base = room ? static_cast<char*>(dyq.bytes.data()) : nullptr;
  if (!room || !fp8_swiglu_grad_fused_serves(gu_R2F.dtype(), cols, gu_R2F.data(), dh_RF.data(), base)) {
    cuda::swiglu_backward(ctx, gu_R2F, dh_RF, dgu_R2F, GateUp::pairs);
    dyq.reset();
    return;
  }
  // The pair layout (ops/fp8.h): the rows operand, then the cols operand.
  const int64_t rows_codes = r_n * cols, rows_scales = ceil_div(cols, kTile) * r_n;
  char* cols_at = base + fp8_operand_bytes(rows_codes, rows_scales);
  launch_fp8_swiglu_grad_rows_cols(
      ctx, gu_R2F.data(), dh_RF.data(), r_n, cols, offsets_E1.ptr<int64_t>(), e_n, reinterpret_cast<uint8_t*>(base),
      reinterpret_cast<float*>(base + fp8_operand_scales_at(rows_codes)), p, reinterpret_cast<uint8_t*>(cols_at),
      reinterpret_cast<float*>(cols_at + fp8_operand_scales_at(cols * p)));
  dyq.rows_ready = dyq.cols_ready = true;
}

void fp8_dequantize_packed(const ExecContext& ctx, const Tensor& p_RW, const Tensor& x_RK) {
  const int64_t rows = x_RK.size(0), k = x_RK.size(1);
  if (rows == 0 || k == 0) return;
  with_input_dtype(x_RK.dtype(), "fp8_dequantize_packed", [&]<class T>() {
    dequantize_packed_kernel<T><<<elementwise_blocks(rows * k), kThreads, 0, stream_of(ctx)>>>(
        p_RW.ptr<uint8_t>(), rows, k, p_RW.size(1), fp8_packed_scales_at(k), static_cast<T*>(x_RK.data()));
  });
  MF_CUDA_LAUNCHED("fp8_dequantize_packed");
}

void fp8_quantize_cols(const ExecContext& ctx, const Tensor& x_RC, const Tensor& offsets_S1, const Tensor& qT_CP,
                       const Tensor& sT_BC) {
  launch_fp8_quantize_cols(ctx, x_RC.data(), x_RC.dtype(), x_RC.size(0), x_RC.size(1), offsets_S1.ptr<int64_t>(),
                           offsets_S1.numel() - 1, qT_CP.size(1), qT_CP.ptr<uint8_t>(), sT_BC.ptr<float>());
}

void fp8_quantize_blocks(const ExecContext& ctx, const Tensor& w, const Tensor& q, const Tensor& s, const Tensor& qT,
                         const Tensor& sT, bool via_bf16) {
  const bool batched = w.ndim() == 3;
  launch_fp8_quantize_blocks(ctx, w.data(), w.dtype(), batched ? w.size(0) : 1, w.size(batched ? 1 : 0),
                             w.size(batched ? 2 : 1), q.ptr<uint8_t>(), s.ptr<float>(),
                             qT.defined() ? qT.ptr<uint8_t>() : nullptr, sT.defined() ? sT.ptr<float>() : nullptr,
                             via_bf16);
}

void fp8_block_amax(const ExecContext& ctx, const Tensor& part, const Shape& whole, int64_t first, const Tensor& amax,
                    bool via_bf16) {
  launch_part(part, whole, first, true, "fp8_block_amax", [&]<class T, bool kVec>(dim3 grid, const PartRows& p) {
    block_amax_kernel<T, kVec>
        <<<grid, kThreads, 0, stream_of(ctx)>>>(static_cast<const T*>(part.data()), p, amax.ptr<float>(), via_bf16);
  });
}

void fp8_scales_from_amax(const ExecContext& ctx, const Tensor& amax_to_scale) {
  const int64_t n = amax_to_scale.numel();
  if (n == 0) return;
  scales_from_amax_kernel<<<elementwise_blocks(n), kThreads, 0, stream_of(ctx)>>>(amax_to_scale.ptr<float>(), n);
  MF_CUDA_LAUNCHED("fp8_scales_from_amax");
}

void fp8_quantize_part(const ExecContext& ctx, const Tensor& part, const Shape& whole, int64_t first, const Tensor& s,
                       const Tensor& q_part, bool via_bf16) {
  uint8_t* q = q_part.ptr<uint8_t>();
  launch_part(
      part, whole, first, aligned(q, 4), "fp8_quantize_part", [&]<class T, bool kVec>(dim3 grid, const PartRows& p) {
        quantize_part_kernel<T, kVec>
            <<<grid, kThreads, 0, stream_of(ctx)>>>(static_cast<const T*>(part.data()), p, s.ptr<float>(), q, via_bf16);
      });
}

void fp8_transpose_blocks(const ExecContext& ctx, const Tensor& q, const Tensor& s, const Tensor& qT,
                          const Tensor& sT) {
  const bool batched = q.ndim() == 3;
  const int64_t e = batched ? q.size(0) : 1, o = q.size(batched ? 1 : 0), i = q.size(batched ? 2 : 1);
  if (e == 0 || o == 0 || i == 0) return;
  const dim3 grid(static_cast<unsigned>(ceil_div(i, kTile)), grid_dim_yz(ceil_div(o, kTile), "fp8_transpose_blocks"),
                  grid_dim_yz(e, "fp8_transpose_blocks"));
  const uint8_t* qd = q.ptr<uint8_t>();
  uint8_t* qtd = qT.ptr<uint8_t>();
  const bool vec_t = o % 4 == 0 && aligned(qtd, 4);
  if (i % 4 == 0 && aligned(qd, 4))
    transpose_blocks_kernel<true>
        <<<grid, kThreads, 0, stream_of(ctx)>>>(qd, s.ptr<float>(), o, i, qtd, sT.ptr<float>(), vec_t);
  else
    transpose_blocks_kernel<false>
        <<<grid, kThreads, 0, stream_of(ctx)>>>(qd, s.ptr<float>(), o, i, qtd, sT.ptr<float>(), vec_t);
  MF_CUDA_LAUNCHED("fp8_transpose_blocks");
}

void fp8_dequantize_rows(const ExecContext& ctx, const Tensor& q_RK, const Tensor& s_BR, const Tensor& x_RK) {
  const int64_t rows = x_RK.size(0), k = x_RK.size(1);
  if (rows == 0 || k == 0) return;
  with_input_dtype(x_RK.dtype(), "fp8_dequantize_rows", [&]<class T>() {
    dequantize_rows_kernel<T><<<elementwise_blocks(rows * k), kThreads, 0, stream_of(ctx)>>>(
        q_RK.ptr<uint8_t>(), s_BR.ptr<float>(), rows, k, static_cast<T*>(x_RK.data()));
  });
  MF_CUDA_LAUNCHED("fp8_dequantize_rows");
}

void fp8_dequantize_cols(const ExecContext& ctx, const Tensor& qT_CP, const Tensor& sT_BC, const Tensor& offsets_S1,
                         const Tensor& x_RC) {
  const int64_t rows = x_RC.size(0), cols = x_RC.size(1), p = qT_CP.size(1);
  if (rows == 0 || cols == 0) return;
  const ColTile* map = col_tiles(ctx, offsets_S1.ptr<int64_t>(), offsets_S1.numel() - 1, rows, p / kTile);
  const dim3 grid(static_cast<unsigned>(ceil_div(cols, kThreads)), grid_dim_yz(p / kTile, "fp8_dequantize_cols"));
  with_input_dtype(x_RC.dtype(), "fp8_dequantize_cols", [&]<class T>() {
    dequantize_cols_kernel<T><<<grid, kThreads, 0, stream_of(ctx)>>>(qT_CP.ptr<uint8_t>(), sT_BC.ptr<float>(), cols, p,
                                                                     map, static_cast<T*>(x_RC.data()));
  });
  MF_CUDA_LAUNCHED("fp8_dequantize_cols");
}

void fp8_dequantize_blocks(const ExecContext& ctx, const Tensor& q, const Tensor& s, const Tensor& w) {
  const bool batched = w.ndim() == 3;
  const int64_t e = batched ? w.size(0) : 1, o = w.size(batched ? 1 : 0), i = w.size(batched ? 2 : 1);
  if (e * o * i == 0) return;
  with_input_dtype(w.dtype(), "fp8_dequantize_blocks", [&]<class T>() {
    dequantize_blocks_kernel<T><<<elementwise_blocks(e * o * i), kThreads, 0, stream_of(ctx)>>>(
        q.ptr<uint8_t>(), s.ptr<float>(), e, o, i, static_cast<T*>(w.data()));
  });
  MF_CUDA_LAUNCHED("fp8_dequantize_blocks");
}

}  // namespace moefold::cuda
