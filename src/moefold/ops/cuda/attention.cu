// CUDA causal grouped-query attention (ops/ops.h; contracts and dtypes in attention.h):
// flash-attention forward (key tiles streamed through shared memory, online softmax in float;
// FlashAttention-2, Dao 2023, Algorithm 1) and its backward by recomputation of P from the saved
// lse (Algorithm 2), split into a pass over key tiles (dk, dv) and a pass over query tiles (dq) so
// that nothing is accumulated atomically: deterministic. Gradient rule: dq, dk, dv WRITTEN.
// Shape letters: B batch, Sq/Sk query/key positions, Q/G query/kv heads, D head dim.
// Scalar-FMA (SIMT) kernels in float for any D <= 256: the GPU reference that tensor-core paths
// (wgmma/TMA) will be checked against later.
#include "moefold/ops/cuda/common.cuh"
// (common.cuh first: it specialises dtype_of<__nv_bfloat16>)
#include <climits>

#include "moefold/ops/cuda/attention.h"

namespace moefold::cuda {

namespace {

// 256 threads as a 16 x 16 grid, tx = threadIdx.x % 16 fastest. A thread owns the strided
// micro-tile (rows ty + 16 i, columns tx + 16 j) of a score tile and the head-dim columns
// tx + 16 j of its rows, so the 16 threads of one score row form one half-warp (row max and sum
// are 4 xor-shuffles) and the shared-memory reads along a row are conflict-free.
constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Problem {
  int batch, sq, sk, nq, ng, d;  // B, Sq, Sk, Q, G, D
  float scale;                   // softmax scale
  float scale_log2;              // scale * log2(e): scores in base-2 units, for exp2f
  const int32_t* q_pos;          // null: query i is at position i (the plain causal ops)
  const int32_t* k_pos;          // null: key j is at position j
};

// Tile sizes. Shared-memory operand rows are padded to an odd stride (kMaxD + 1) so that the 16
// threads of a half-warp reading one column of 16 different rows hit 16 different banks.
template <int kMaxD>
struct FwdTile {
  static constexpr int kRI = 4;                    // query rows per thread: 64-query tiles
  static constexpr int kCJ = kMaxD <= 64 ? 4 : 2;  // key columns per thread: 64- or 32-key tiles
  static constexpr int kBr = 16 * kRI, kBc = 16 * kCJ;
  static constexpr int kDJ = kMaxD / 16;  // head-dim columns per thread
  static constexpr int kLd = kMaxD + 1, kLdP = kBc + 1;
  // sQ [kBr][kLd], sK [kBc][kLd], sV [kBc][kMaxD], sP [kBr][kLdP], then query and key positions.
  static constexpr int kFloats = kBr * kLd + kBc * kLd + kBc * kMaxD + kBr * kLdP;
  static constexpr size_t kSmem = sizeof(float) * kFloats + sizeof(int) * (kBr + kBc);
};

template <int kMaxD>
struct BwdTile {
  static constexpr int kR = kMaxD <= 64 ? 4 : 2;  // 16 kR queries and 16 kR keys per tile
  static constexpr int kB = 16 * kR;
  static constexpr int kDJ = kMaxD / 16;
  static constexpr int kLd = kMaxD + 1, kLdP = kB + 1;
  // Four operand tiles [kB][kLd], two score tiles [kB][kLdP], lse and delta [kB], then positions.
  static constexpr int kFloats = 4 * kB * kLd + 2 * kB * kLdP + 2 * kB;
  static constexpr size_t kSmem = sizeof(float) * kFloats + sizeof(int) * 2 * kB;
};

__device__ __forceinline__ float half_warp_max(float x) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Tiles of `size` covering n rows.
__host__ __device__ __forceinline__ int tiles(int n, int size) { return (n + size - 1) / size; }

// Global position of row i of n rows (pos null: i itself); rows past the end get `pad`
// (INT_MIN for queries: they see nothing; INT_MAX for keys: nobody sees them).
__device__ __forceinline__ int position(const int32_t* pos, int i, int n, int pad) {
  return i < n ? (pos ? pos[i] : i) : pad;
}

// Rows [row0, row0 + rows) of one head of a [B, S, H, D] tensor (`head` points at row 0 of that
// head, rows `ld` elements apart) into shared memory as float, row stride ld_s. Rows from `rows`
// to kRows and columns from d to kMaxD are zero, so inner products may run over all of kMaxD.
// Consecutive threads read consecutive elements of a row (coalesced).
template <class T, int kMaxD, int kRows>
__device__ __forceinline__ void load_tile(float* s, int ld_s, const T* head, int64_t ld, int row0, int rows, int d) {
  for (int idx = threadIdx.x; idx < kRows * kMaxD; idx += kThreads) {
    const int r = idx / kMaxD, c = idx - r * kMaxD;
    s[r * ld_s + c] = r < rows && c < d ? to_float(head[static_cast<int64_t>(row0 + r) * ld + c]) : 0.f;
  }
}

// delta[r] = rowsum(dO * O) for the rows of a query tile (dO already in shared memory, O read from
// global): one warp per row, lanes along D. Rows past `rows` get 0.
template <class T, int kRows>
__device__ __forceinline__ void tile_delta(float* s_delta, const float* s_do, int ld_s, const T* out_head, int64_t ld,
                                           int row0, int rows, int d) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < kRows; r += kThreads / 32) {
    float acc = 0.f;
    if (r < rows)
      for (int c = lane; c < d; c += 32)
        acc = fmaf(s_do[r * ld_s + c], to_float(out_head[static_cast<int64_t>(row0 + r) * ld + c]), acc);
    acc = warp_sum(acc);
    if (lane == 0) s_delta[r] = acc;
  }
}

// ---- forward: one block per (64-query tile, batch * query head) --------------------------------
template <class T, int kMaxD>
__global__ void __launch_bounds__(kThreads)
    forward_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ out,
                   float* __restrict__ lse, Problem p) {
  using Tile = FwdTile<kMaxD>;
  constexpr int kRI = Tile::kRI, kCJ = Tile::kCJ, kBr = Tile::kBr, kBc = Tile::kBc, kDJ = Tile::kDJ;
  constexpr int kLd = Tile::kLd, kLdP = Tile::kLdP;
  extern __shared__ float smem[];
  float* sQ = smem;
  float* sK = sQ + kBr * kLd;
  float* sV = sK + kBc * kLd;
  float* sP = sV + kBc * kMaxD;
  int* sQpos = reinterpret_cast<int*>(sP + kBr * kLdP);
  int* sKpos = sQpos + kBr;
  __shared__ int s_qmax;

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  // Plain causal: the last query tiles see the most keys, so they are scheduled first.
  const int qt = p.q_pos ? blockIdx.x : gridDim.x - 1 - blockIdx.x;
  const int bh = blockIdx.y, b = bh / p.nq, h = bh % p.nq, g = h / (p.nq / p.ng);
  const int row0 = qt * kBr, rows = min(kBr, p.sq - row0);
  const int64_t ldq = static_cast<int64_t>(p.nq) * p.d, ldk = static_cast<int64_t>(p.ng) * p.d;
  const T* qh = q + static_cast<int64_t>(b) * p.sq * ldq + static_cast<int64_t>(h) * p.d;
  const T* kh = k + static_cast<int64_t>(b) * p.sk * ldk + static_cast<int64_t>(g) * p.d;
  const T* vh = v + static_cast<int64_t>(b) * p.sk * ldk + static_cast<int64_t>(g) * p.d;

  if (tid == 0) s_qmax = INT_MIN;
  load_tile<T, kMaxD, kBr>(sQ, kLd, qh, ldq, row0, rows, p.d);
  __syncthreads();
  if (tid < kBr) {
    const int qp = position(p.q_pos, row0 + tid, p.sq, INT_MIN);
    sQpos[tid] = qp;
    atomicMax(&s_qmax, qp);
  }
  __syncthreads();
  const int qmax = s_qmax;

  float m[kRI], l[kRI], acc[kRI][kDJ];  // running max (base-2 units), running sum, unnormalised out
#pragma unroll
  for (int i = 0; i < kRI; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int jd = 0; jd < kDJ; ++jd) acc[i][jd] = 0.f;
  }

  // Explicit positions: every key tile, those that no query of this tile sees skipped below.
  // Plain causal: the key tiles up to the diagonal.
  const int num_kt = p.k_pos ? tiles(p.sk, kBc) : tiles(min(row0 + kBr, p.sk), kBc);
  for (int kt = 0; kt < num_kt; ++kt) {
    const int col0 = kt * kBc;
    int kp = INT_MAX;
    if (tid < kBc) {
      kp = position(p.k_pos, col0 + tid, p.sk, INT_MAX);
      sKpos[tid] = kp;
    }
    if (!__syncthreads_or(kp <= qmax)) continue;  // fully masked tile
    const int cols = min(kBc, p.sk - col0);
    load_tile<T, kMaxD, kBc>(sK, kLd, kh, ldk, col0, cols, p.d);
    load_tile<T, kMaxD, kBc>(sV, kMaxD, vh, ldk, col0, cols, p.d);
    __syncthreads();

    float s[kRI][kCJ];
#pragma unroll
    for (int i = 0; i < kRI; ++i)
#pragma unroll
      for (int j = 0; j < kCJ; ++j) s[i][j] = 0.f;
#pragma unroll 8
    for (int c = 0; c < kMaxD; ++c) {
      float a[kRI], bk[kCJ];
#pragma unroll
      for (int i = 0; i < kRI; ++i) a[i] = sQ[(ty + 16 * i) * kLd + c];
#pragma unroll
      for (int j = 0; j < kCJ; ++j) bk[j] = sK[(tx + 16 * j) * kLd + c];
#pragma unroll
      for (int i = 0; i < kRI; ++i)
#pragma unroll
        for (int j = 0; j < kCJ; ++j) s[i][j] = fmaf(a[i], bk[j], s[i][j]);
    }

    // Online softmax: rescale what the row has accumulated by 2^(m_old - m_new).
#pragma unroll
    for (int i = 0; i < kRI; ++i) {
      const int qp = sQpos[ty + 16 * i];
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kCJ; ++j) {
        s[i][j] = sKpos[tx + 16 * j] <= qp ? s[i][j] * p.scale_log2 : -INFINITY;
        mx = fmaxf(mx, s[i][j]);
      }
      const float m_new = fmaxf(m[i], half_warp_max(mx));
      const float base = m_new == -INFINITY ? 0.f : m_new;  // a row that has seen no key yet: all P are 0
      const float alpha = exp2f(m[i] - base);
      float rs = 0.f;
#pragma unroll
      for (int j = 0; j < kCJ; ++j) {
        const float pv = exp2f(s[i][j] - base);
        sP[(ty + 16 * i) * kLdP + tx + 16 * j] = pv;
        rs += pv;
      }
      l[i] = l[i] * alpha + half_warp_sum(rs);
      m[i] = m_new;
#pragma unroll
      for (int jd = 0; jd < kDJ; ++jd) acc[i][jd] *= alpha;
    }
    __syncthreads();

    // acc += P V (P in float; padded keys have P = 0 and V = 0).
#pragma unroll 4
    for (int c = 0; c < kBc; ++c) {
      float pr[kRI], vr[kDJ];
#pragma unroll
      for (int i = 0; i < kRI; ++i) pr[i] = sP[(ty + 16 * i) * kLdP + c];
#pragma unroll
      for (int jd = 0; jd < kDJ; ++jd) vr[jd] = sV[c * kMaxD + tx + 16 * jd];
#pragma unroll
      for (int i = 0; i < kRI; ++i)
#pragma unroll
        for (int jd = 0; jd < kDJ; ++jd) acc[i][jd] = fmaf(pr[i], vr[jd], acc[i][jd]);
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < kRI; ++i) {
    const int r = ty + 16 * i;
    if (r >= rows) continue;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;  // a query that sees no key: out = 0
    T* o = out + (static_cast<int64_t>(b) * p.sq + row0 + r) * ldq + static_cast<int64_t>(h) * p.d;
#pragma unroll
    for (int jd = 0; jd < kDJ; ++jd) {
      const int c = tx + 16 * jd;
      if (c < p.d) o[c] = from_float<T>(acc[i][jd] * inv);
    }
    if (tx == 0) lse[static_cast<int64_t>(bh) * p.sq + row0 + r] = l[i] > 0.f ? m[i] * kLn2 + logf(l[i]) : -INFINITY;
  }
}

// ---- backward, dq: one block per (query tile, batch * query head), looping over key tiles -------
// dS = P * (dP - delta), dP = dO V^T, P = exp(scale q k^T - lse); dq = scale * dS K.
template <class T, int kMaxD>
__global__ void __launch_bounds__(kThreads)
    backward_dq_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                       const T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ lse,
                       T* __restrict__ dq, Problem p) {
  using Tile = BwdTile<kMaxD>;
  constexpr int kR = Tile::kR, kB = Tile::kB, kDJ = Tile::kDJ, kLd = Tile::kLd, kLdP = Tile::kLdP;
  extern __shared__ float smem[];
  float* sQ = smem;
  float* sdO = sQ + kB * kLd;
  float* sK = sdO + kB * kLd;
  float* sV = sK + kB * kLd;
  float* sdS = sV + kB * kLd;
  float* sLse = sdS + 2 * kB * kLdP;  // (the second score tile is the dk/dv kernel's)
  float* sDelta = sLse + kB;
  int* sQpos = reinterpret_cast<int*>(sDelta + kB);
  int* sKpos = sQpos + kB;
  __shared__ int s_qmax;

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int qt = p.q_pos ? blockIdx.x : gridDim.x - 1 - blockIdx.x;
  const int bh = blockIdx.y, b = bh / p.nq, h = bh % p.nq, g = h / (p.nq / p.ng);
  const int row0 = qt * kB, rows = min(kB, p.sq - row0);
  const int64_t ldq = static_cast<int64_t>(p.nq) * p.d, ldk = static_cast<int64_t>(p.ng) * p.d;
  const int64_t qoff = static_cast<int64_t>(b) * p.sq * ldq + static_cast<int64_t>(h) * p.d;
  const int64_t koff = static_cast<int64_t>(b) * p.sk * ldk + static_cast<int64_t>(g) * p.d;

  if (tid == 0) s_qmax = INT_MIN;
  load_tile<T, kMaxD, kB>(sQ, kLd, q + qoff, ldq, row0, rows, p.d);
  load_tile<T, kMaxD, kB>(sdO, kLd, dout + qoff, ldq, row0, rows, p.d);
  if (tid < kB) {
    sQpos[tid] = position(p.q_pos, row0 + tid, p.sq, INT_MIN);
    sLse[tid] = tid < rows ? lse[static_cast<int64_t>(bh) * p.sq + row0 + tid] * kLog2e : 0.f;
  }
  __syncthreads();
  if (tid < kB) atomicMax(&s_qmax, sQpos[tid]);
  tile_delta<T, kB>(sDelta, sdO, kLd, out + qoff, ldq, row0, rows, p.d);
  __syncthreads();
  const int qmax = s_qmax;

  float acc[kR][kDJ];
#pragma unroll
  for (int i = 0; i < kR; ++i)
#pragma unroll
    for (int jd = 0; jd < kDJ; ++jd) acc[i][jd] = 0.f;

  const int num_kt = p.k_pos ? tiles(p.sk, kB) : tiles(min(row0 + kB, p.sk), kB);
  for (int kt = 0; kt < num_kt; ++kt) {
    const int col0 = kt * kB;
    int kp = INT_MAX;
    if (tid < kB) {
      kp = position(p.k_pos, col0 + tid, p.sk, INT_MAX);
      sKpos[tid] = kp;
    }
    if (!__syncthreads_or(kp <= qmax)) continue;
    const int cols = min(kB, p.sk - col0);
    load_tile<T, kMaxD, kB>(sK, kLd, k + koff, ldk, col0, cols, p.d);
    load_tile<T, kMaxD, kB>(sV, kLd, v + koff, ldk, col0, cols, p.d);
    __syncthreads();

    float s[kR][kR], dp[kR][kR];  // scores and dP = dO V^T: rows ty + 16 i (queries), cols tx + 16 j (keys)
#pragma unroll
    for (int i = 0; i < kR; ++i)
#pragma unroll
      for (int j = 0; j < kR; ++j) s[i][j] = dp[i][j] = 0.f;
#pragma unroll 4
    for (int c = 0; c < kMaxD; ++c) {
      float a[kR], o[kR], bk[kR], bv[kR];
#pragma unroll
      for (int i = 0; i < kR; ++i) {
        a[i] = sQ[(ty + 16 * i) * kLd + c];
        o[i] = sdO[(ty + 16 * i) * kLd + c];
      }
#pragma unroll
      for (int j = 0; j < kR; ++j) {
        bk[j] = sK[(tx + 16 * j) * kLd + c];
        bv[j] = sV[(tx + 16 * j) * kLd + c];
      }
#pragma unroll
      for (int i = 0; i < kR; ++i)
#pragma unroll
        for (int j = 0; j < kR; ++j) {
          s[i][j] = fmaf(a[i], bk[j], s[i][j]);
          dp[i][j] = fmaf(o[i], bv[j], dp[i][j]);
        }
    }
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const int r = ty + 16 * i;
      const int qp = sQpos[r];
      const float lse2 = sLse[r], delta = sDelta[r];
#pragma unroll
      for (int j = 0; j < kR; ++j) {
        const float pv = sKpos[tx + 16 * j] <= qp ? exp2f(s[i][j] * p.scale_log2 - lse2) : 0.f;
        sdS[r * kLdP + tx + 16 * j] = pv * (dp[i][j] - delta);
      }
    }
    __syncthreads();

    // acc += dS K
#pragma unroll 4
    for (int c = 0; c < kB; ++c) {
      float ds[kR], kr[kDJ];
#pragma unroll
      for (int i = 0; i < kR; ++i) ds[i] = sdS[(ty + 16 * i) * kLdP + c];
#pragma unroll
      for (int jd = 0; jd < kDJ; ++jd) kr[jd] = sK[c * kLd + tx + 16 * jd];
#pragma unroll
      for (int i = 0; i < kR; ++i)
#pragma unroll
        for (int jd = 0; jd < kDJ; ++jd) acc[i][jd] = fmaf(ds[i], kr[jd], acc[i][jd]);
    }
    __syncthreads();
  }

#pragma unroll
  for (int i = 0; i < kR; ++i) {
    const int r = ty + 16 * i;
    if (r >= rows) continue;
    T* o = dq + qoff + static_cast<int64_t>(row0 + r) * ldq;
#pragma unroll
    for (int jd = 0; jd < kDJ; ++jd) {
      const int c = tx + 16 * jd;
      if (c < p.d) o[c] = from_float<T>(acc[i][jd] * p.scale);
    }
  }
}

// ---- backward, dk and dv: one block per (key tile, batch * kv head), looping over the Q/G query
// heads of the group and their query tiles (in a fixed order: deterministic sums).
// dv = P^T dO, dk = scale * dS^T Q, computed as S^T tiles (rows: keys, columns: queries).
template <class T, int kMaxD>
__global__ void __launch_bounds__(kThreads)
    backward_dkdv_kernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                         const T* __restrict__ out, const T* __restrict__ dout, const float* __restrict__ lse,
                         T* __restrict__ dk, T* __restrict__ dv, Problem p) {
  using Tile = BwdTile<kMaxD>;
  constexpr int kR = Tile::kR, kB = Tile::kB, kDJ = Tile::kDJ, kLd = Tile::kLd, kLdP = Tile::kLdP;
  extern __shared__ float smem[];
  float* sK = smem;
  float* sV = sK + kB * kLd;
  float* sQ = sV + kB * kLd;
  float* sdO = sQ + kB * kLd;
  float* sPt = sdO + kB * kLd;
  float* sdSt = sPt + kB * kLdP;
  float* sLse = sdSt + kB * kLdP;
  float* sDelta = sLse + kB;
  int* sQpos = reinterpret_cast<int*>(sDelta + kB);
  int* sKpos = sQpos + kB;
  __shared__ int s_kmin;

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int kt = blockIdx.x;  // plain causal: the first key tiles have the most queries, and start first
  const int bg = blockIdx.y, b = bg / p.ng, g = bg % p.ng, per_group = p.nq / p.ng;
  const int col0 = kt * kB, cols = min(kB, p.sk - col0);
  const int64_t ldq = static_cast<int64_t>(p.nq) * p.d, ldk = static_cast<int64_t>(p.ng) * p.d;
  const int64_t koff = static_cast<int64_t>(b) * p.sk * ldk + static_cast<int64_t>(g) * p.d;

  if (tid == 0) s_kmin = INT_MAX;
  load_tile<T, kMaxD, kB>(sK, kLd, k + koff, ldk, col0, cols, p.d);
  load_tile<T, kMaxD, kB>(sV, kLd, v + koff, ldk, col0, cols, p.d);
  if (tid < kB) sKpos[tid] = position(p.k_pos, col0 + tid, p.sk, INT_MAX);
  __syncthreads();
  if (tid < kB) atomicMin(&s_kmin, sKpos[tid]);
  __syncthreads();
  const int kmin = s_kmin;

  float dk_acc[kR][kDJ], dv_acc[kR][kDJ];  // keys ty + 16 i, head-dim columns tx + 16 jd
#pragma unroll
  for (int i = 0; i < kR; ++i)
#pragma unroll
    for (int jd = 0; jd < kDJ; ++jd) dk_acc[i][jd] = dv_acc[i][jd] = 0.f;

  // Plain causal: queries from col0 on see this tile; explicit positions: all, skipped below.
  const int num_qt = tiles(p.sq, kB), qt0 = p.q_pos ? 0 : col0 / kB;
  for (int hh = 0; hh < per_group; ++hh) {
    const int h = g * per_group + hh, bh = b * p.nq + h;
    const int64_t qoff = static_cast<int64_t>(b) * p.sq * ldq + static_cast<int64_t>(h) * p.d;
    for (int qt = qt0; qt < num_qt; ++qt) {
      const int row0 = qt * kB, rows = min(kB, p.sq - row0);
      int qp = INT_MIN;
      if (tid < kB) {
        qp = position(p.q_pos, row0 + tid, p.sq, INT_MIN);
        sQpos[tid] = qp;
        sLse[tid] = tid < rows ? lse[static_cast<int64_t>(bh) * p.sq + row0 + tid] * kLog2e : 0.f;
      }
      if (!__syncthreads_or(qp >= kmin)) continue;  // no query of this tile sees a key of ours
      load_tile<T, kMaxD, kB>(sQ, kLd, q + qoff, ldq, row0, rows, p.d);
      load_tile<T, kMaxD, kB>(sdO, kLd, dout + qoff, ldq, row0, rows, p.d);
      __syncthreads();
      // delta is recomputed per key tile rather than read from a workspace: the ops take none.
      tile_delta<T, kB>(sDelta, sdO, kLd, out + qoff, ldq, row0, rows, p.d);
      __syncthreads();

      float s[kR][kR], dpt[kR][kR];  // S^T and dP^T: rows ty + 16 i (keys), cols tx + 16 j (queries)
#pragma unroll
      for (int i = 0; i < kR; ++i)
#pragma unroll
        for (int j = 0; j < kR; ++j) s[i][j] = dpt[i][j] = 0.f;
#pragma unroll 4
      for (int c = 0; c < kMaxD; ++c) {
        float kr[kR], vr[kR], qr[kR], orow[kR];
#pragma unroll
        for (int i = 0; i < kR; ++i) {
          kr[i] = sK[(ty + 16 * i) * kLd + c];
          vr[i] = sV[(ty + 16 * i) * kLd + c];
        }
#pragma unroll
        for (int j = 0; j < kR; ++j) {
          qr[j] = sQ[(tx + 16 * j) * kLd + c];
          orow[j] = sdO[(tx + 16 * j) * kLd + c];
        }
#pragma unroll
        for (int i = 0; i < kR; ++i)
#pragma unroll
          for (int j = 0; j < kR; ++j) {
            s[i][j] = fmaf(kr[i], qr[j], s[i][j]);
            dpt[i][j] = fmaf(vr[i], orow[j], dpt[i][j]);
          }
      }
#pragma unroll
      for (int i = 0; i < kR; ++i) {
        const int key = ty + 16 * i, kpos = sKpos[key];
#pragma unroll
        for (int j = 0; j < kR; ++j) {
          const int r = tx + 16 * j;
          const float pv = kpos <= sQpos[r] ? exp2f(s[i][j] * p.scale_log2 - sLse[r]) : 0.f;
          sPt[key * kLdP + r] = pv;
          sdSt[key * kLdP + r] = pv * (dpt[i][j] - sDelta[r]);
        }
      }
      __syncthreads();

      // dv += P^T dO, dk += dS^T Q
#pragma unroll 4
      for (int r = 0; r < kB; ++r) {
        float pt[kR], dst[kR], orow[kDJ], qr[kDJ];
#pragma unroll
        for (int i = 0; i < kR; ++i) {
          pt[i] = sPt[(ty + 16 * i) * kLdP + r];
          dst[i] = sdSt[(ty + 16 * i) * kLdP + r];
        }
#pragma unroll
        for (int jd = 0; jd < kDJ; ++jd) {
          orow[jd] = sdO[r * kLd + tx + 16 * jd];
          qr[jd] = sQ[r * kLd + tx + 16 * jd];
        }
#pragma unroll
        for (int i = 0; i < kR; ++i)
#pragma unroll
          for (int jd = 0; jd < kDJ; ++jd) {
            dv_acc[i][jd] = fmaf(pt[i], orow[jd], dv_acc[i][jd]);
            dk_acc[i][jd] = fmaf(dst[i], qr[jd], dk_acc[i][jd]);
          }
      }
      __syncthreads();
    }
  }

#pragma unroll
  for (int i = 0; i < kR; ++i) {
    const int key = ty + 16 * i;
    if (key >= cols) continue;
    const int64_t row = koff + static_cast<int64_t>(col0 + key) * ldk;
#pragma unroll
    for (int jd = 0; jd < kDJ; ++jd) {
      const int c = tx + 16 * jd;
      if (c < p.d) {
        dk[row + c] = from_float<T>(dk_acc[i][jd] * p.scale);
        dv[row + c] = from_float<T>(dv_acc[i][jd]);
      }
    }
  }
}

// ---- launchers -----------------------------------------------------------------------------------

// Calls f.template operator()<kMaxD>() with the head-dim bucket (a multiple of 16) holding d.
template <class F>
void dispatch_head_dim(int d, F&& f) {
  if (d <= 16) return f.template operator()<16>();
  if (d <= 32) return f.template operator()<32>();
  if (d <= 64) return f.template operator()<64>();
  if (d <= 128) return f.template operator()<128>();
  if (d <= 192) return f.template operator()<192>();
  return f.template operator()<256>();
}

// Dynamic shared memory above 48 KiB must be opted into, per kernel (cheap; no synchronisation).
template <class K>
void allow_smem(K kernel, size_t bytes) {
  MF_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <class T, int kMaxD>
void launch_forward(const ExecContext& ctx, const Problem& p, const T* q, const T* k, const T* v, T* out, float* lse) {
  using Tile = FwdTile<kMaxD>;
  allow_smem(forward_kernel<T, kMaxD>, Tile::kSmem);
  const dim3 grid(static_cast<unsigned>(tiles(p.sq, Tile::kBr)), static_cast<unsigned>(p.batch * p.nq));
  forward_kernel<T, kMaxD><<<grid, kThreads, Tile::kSmem, stream_of(ctx)>>>(q, k, v, out, lse, p);
}

template <class T, int kMaxD>
void launch_backward(const ExecContext& ctx, const Problem& p, const T* q, const T* k, const T* v, const T* out,
                     const T* dout, const float* lse, T* dq, T* dk, T* dv) {
  using Tile = BwdTile<kMaxD>;
  if (p.sk > 0) {
    allow_smem(backward_dkdv_kernel<T, kMaxD>, Tile::kSmem);
    const dim3 grid(static_cast<unsigned>(tiles(p.sk, Tile::kB)), static_cast<unsigned>(p.batch * p.ng));
    backward_dkdv_kernel<T, kMaxD><<<grid, kThreads, Tile::kSmem, stream_of(ctx)>>>(q, k, v, out, dout, lse, dk, dv, p);
    MF_CUDA_LAUNCHED("attention backward (dk, dv)");
  }
  if (p.sq > 0) {
    allow_smem(backward_dq_kernel<T, kMaxD>, Tile::kSmem);
    const dim3 grid(static_cast<unsigned>(tiles(p.sq, Tile::kB)), static_cast<unsigned>(p.batch * p.nq));
    backward_dq_kernel<T, kMaxD><<<grid, kThreads, Tile::kSmem, stream_of(ctx)>>>(q, k, v, out, dout, lse, dq, p);
    MF_CUDA_LAUNCHED("attention backward (dq)");
  }
}

// ---- checked entry points ------------------------------------------------------------------------

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxGridY = 65535;

Problem check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        double scale, const char* what) {
  for (const Tensor* t : {&q, &k, &v, &out, &lse}) check_cuda_tensor(*t, what);
  MF_CHECK(q.ndim() == 4 && k.ndim() == 4, what, ": q ", q.str(), ", k ", k.str());
  const int64_t b = q.size(0), sq = q.size(1), nq = q.size(2), d = q.size(3), sk = k.size(1), ng = k.size(2);
  MF_CHECK(ng > 0 && nq % ng == 0, what, ": Q=", nq, " not a multiple of G=", ng);
  MF_CHECK(d >= 1 && d <= kMaxHeadDim, what, ": head dim ", d, " outside 1..", kMaxHeadDim);
  check_shape(k, {b, sk, ng, d}, what);
  check_shape(v, {b, sk, ng, d}, what);
  check_shape(out, q.shape(), what);
  check_shape(lse, {b, nq, sq}, what);
  for (const Tensor* t : {&k, &v, &out}) check_same_dtype(*t, q, what);
  MF_CHECK(lse.dtype() == DType::f32, what, ": lse ", lse.str(), " must be f32 on the GPU");
  MF_CHECK(sq <= INT_MAX / 2 && sk <= INT_MAX / 2 && b * nq <= kMaxGridY, what, ": q ", q.str(), ", k ", k.str(),
           " too large (S < 2^30, B*Q <= ", kMaxGridY, ")");
  MF_CHECK(sk > 0 || sq == 0, what, ": ", sq, " queries and no key");
  const float sc = static_cast<float>(scale);
  return Problem{static_cast<int>(b),
                 static_cast<int>(sq),
                 static_cast<int>(sk),
                 static_cast<int>(nq),
                 static_cast<int>(ng),
                 static_cast<int>(d),
                 sc,
                 sc * kLog2e,
                 nullptr,
                 nullptr};
}

void check_backward(const Tensor& q, const Tensor& k, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                    const Tensor& dv, const char* what) {
  for (const Tensor* t : {&dout, &dq, &dk, &dv}) {
    check_cuda_tensor(*t, what);
    check_same_dtype(*t, q, what);
  }
  check_shape(dout, q.shape(), what);
  check_shape(dq, q.shape(), what);
  check_shape(dk, k.shape(), what);
  check_shape(dv, k.shape(), what);
}

void set_positions(Problem& p, const Tensor& q_pos, const Tensor& k_pos, const char* what) {
  for (const Tensor* t : {&q_pos, &k_pos}) {
    check_cuda_tensor(*t, what);
    MF_CHECK(t->dtype() == DType::i32, what, ": positions ", t->str(), " must be i32");
  }
  check_shape(q_pos, {p.sq}, what);
  check_shape(k_pos, {p.sk}, what);
  p.q_pos = q_pos.ptr<int32_t>();
  p.k_pos = k_pos.ptr<int32_t>();
}

void run_forward(const ExecContext& ctx, const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v,
                 const Tensor& out, const Tensor& lse, const char* what) {
  if (p.batch == 0 || p.sq == 0 || p.nq == 0) return;
  dispatch_cuda_float(q.dtype(), [&]<class T>() {
    dispatch_head_dim(p.d, [&]<int kMaxD>() {
      launch_forward<T, kMaxD>(ctx, p, q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), out.ptr<T>(), lse.ptr<float>());
    });
  });
  MF_CUDA_LAUNCHED(what);
}

void run_backward(const ExecContext& ctx, const Problem& p, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq, const Tensor& dk,
                  const Tensor& dv) {
  if (p.batch == 0 || p.nq == 0) return;
  dispatch_cuda_float(q.dtype(), [&]<class T>() {
    dispatch_head_dim(p.d, [&]<int kMaxD>() {
      launch_backward<T, kMaxD>(ctx, p, q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), out.ptr<T>(), dout.ptr<T>(),
                                lse.ptr<float>(), dq.ptr<T>(), dk.ptr<T>(), dv.ptr<T>());
    });
  });
}

}  // namespace

void attention_forward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                       double scale, const Tensor& out_BSQD, const Tensor& lse_BQS) {
  const char* what = "attention_forward (cuda)";
  const Problem p = check_attention(q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, scale, what);
  MF_CHECK(p.sq == p.sk, what, ": q ", q_BSQD.str(), " and k ", k_BSGD.str(), " differ in S");
  run_forward(ctx, p, q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, what);
}

void attention_backward(const ExecContext& ctx, const Tensor& q_BSQD, const Tensor& k_BSGD, const Tensor& v_BSGD,
                        const Tensor& out_BSQD, const Tensor& lse_BQS, const Tensor& dout_BSQD, double scale,
                        const Tensor& dq_BSQD, const Tensor& dk_BSGD, const Tensor& dv_BSGD) {
  const char* what = "attention_backward (cuda)";
  const Problem p = check_attention(q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, scale, what);
  MF_CHECK(p.sq == p.sk, what, ": q ", q_BSQD.str(), " and k ", k_BSGD.str(), " differ in S");
  check_backward(q_BSQD, k_BSGD, dout_BSQD, dq_BSQD, dk_BSGD, dv_BSGD, what);
  run_backward(ctx, p, q_BSQD, k_BSGD, v_BSGD, out_BSQD, lse_BQS, dout_BSQD, dq_BSQD, dk_BSGD, dv_BSGD);
}

void attention_forward_at(const ExecContext& ctx, const Tensor& q_BSqQD, const Tensor& k_BSkGD, const Tensor& v_BSkGD,
                          const Tensor& q_pos_Sq, const Tensor& k_pos_Sk, double scale, const Tensor& out_BSqQD,
                          const Tensor& lse_BQSq) {
  const char* what = "attention_forward_at (cuda)";
  Problem p = check_attention(q_BSqQD, k_BSkGD, v_BSkGD, out_BSqQD, lse_BQSq, scale, what);
  set_positions(p, q_pos_Sq, k_pos_Sk, what);
  run_forward(ctx, p, q_BSqQD, k_BSkGD, v_BSkGD, out_BSqQD, lse_BQSq, what);
}

void attention_backward_at(const ExecContext& ctx, const Tensor& q_BSqQD, const Tensor& k_BSkGD, const Tensor& v_BSkGD,
                           const Tensor& q_pos_Sq, const Tensor& k_pos_Sk, const Tensor& out_BSqQD,
                           const Tensor& lse_BQSq, const Tensor& dout_BSqQD, double scale, const Tensor& dq_BSqQD,
                           const Tensor& dk_BSkGD, const Tensor& dv_BSkGD) {
  const char* what = "attention_backward_at (cuda)";
  Problem p = check_attention(q_BSqQD, k_BSkGD, v_BSkGD, out_BSqQD, lse_BQSq, scale, what);
  set_positions(p, q_pos_Sq, k_pos_Sk, what);
  check_backward(q_BSqQD, k_BSkGD, dout_BSqQD, dq_BSqQD, dk_BSkGD, dv_BSkGD, what);
  run_backward(ctx, p, q_BSqQD, k_BSkGD, v_BSkGD, out_BSqQD, lse_BQSq, dout_BSqQD, dq_BSqQD, dk_BSkGD, dv_BSkGD);
}

}  // namespace moefold::cuda
