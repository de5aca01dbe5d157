// CUDA expert-parallel slot plans (ops/moe_ops.h, contracts in ep_slots.h). Every block first
// builds the per-expert tables in shared memory (E <= 1024 entries: a few microseconds), then each
// thread places one row: a slot row, an assignment or an expert row, by binary search in the tables.
// One extra thread writes the per-expert outputs, adds the overflow and max-es the fill. Nothing
// is read back to the host.
#include "moefold/ops/cuda/common.cuh"
// (common.cuh first: it declares dtype_of<__nv_bfloat16>.)
#include "moefold/ops/cuda/ep_slots.h"
#include "moefold/ops/cuda/moe_common.cuh"

namespace moefold::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxExperts = 1024;  // as ops/cpu/ep_slots.cpp checks

// The last i in [0, n) with key(i) <= v (key non-decreasing, key(0) <= v).
template <class Key>
__device__ __forceinline__ int64_t last_at_most(int64_t n, int64_t v, Key key) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (key(mid) <= v)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// fill (or null) max-ed with rows / bound, a bound of 0 counting as 1 row (the CPU's division;
// non-negative doubles order as their bits).
__device__ __forceinline__ void max_fill(double* fill, int64_t rows, int64_t bound) {
  if (fill == nullptr) return;
  const double f = static_cast<double>(rows) / static_cast<double>(bound > 0 ? bound : 1);
  atomicMax(reinterpret_cast<unsigned long long*>(fill), static_cast<unsigned long long>(__double_as_longlong(f)));
}

__global__ void send_slots_kernel(const int64_t* off, const int64_t* token, const int64_t* row, int64_t a_n,
                                  int64_t p_n, int64_t l_n, int64_t b_n, int64_t* token_x, int64_t* slot,
                                  int64_t* counts, double* overflow, double* fill) {
  __shared__ int64_t s_off[kMaxExperts + 1];
  const int64_t e_n = p_n * l_n;
  for (int64_t i = threadIdx.x; i <= e_n; i += blockDim.x) s_off[i] = off[i];
  __syncthreads();
  const int64_t x_n = p_n * b_n;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < x_n) {  // a slot row: the home row at its place in its peer's block, if there is one
    const int64_t p = i / b_n, j = i % b_n, first = s_off[p * l_n];
    token_x[i] = j < s_off[(p + 1) * l_n] - first ? token[first + j] : -1;
  } else if (i < x_n + a_n) {  // an assignment: its home row's slot row
    const int64_t a = i - x_n, r = row[a];
    MF_DEVICE_REQUIRE(r < s_off[e_n], "moe_ep_send_slots: assignment %lld in home row %lld of %lld",
                      static_cast<long long>(a), static_cast<long long>(r), static_cast<long long>(s_off[e_n]));
    if (r < 0) {
      slot[a] = -1;
    } else {
      const int64_t p = last_at_most(p_n, r, [&](int64_t q) { return s_off[q * l_n]; });
      const int64_t at = r - s_off[p * l_n];
      slot[a] = at < b_n ? p * b_n + at : -1;
    }
  } else if (i < x_n + a_n + p_n) {  // a peer: its experts' rows in its slot, and what did not fit
    const int64_t p = i - x_n - a_n, first = s_off[p * l_n];
    for (int64_t l = 0; l < l_n; ++l) {
      const int64_t a = min(s_off[p * l_n + l] - first, b_n), b = min(s_off[p * l_n + l + 1] - first, b_n);
      counts[p * l_n + l] = b - a;
    }
    const int64_t n = s_off[(p + 1) * l_n] - first;
    if (n > b_n) atomicAdd(overflow, static_cast<double>(n - b_n));
    max_fill(fill, n, b_n);
  }
}

__global__ void recv_slots_kernel(const int64_t* c, int64_t p_n, int64_t l_n, int64_t b_n, int64_t r_n, int64_t* src_r,
                                  int64_t* row_x, int64_t* counts, int64_t* offsets, double* overflow, double* fill) {
  // s_src[p, l]: expert l's first row in slot p; s_dst[p, l]: where those rows start among the
  // experts' rows; s_start[l]: expert l's first row (s_start[L]: every row that came).
  __shared__ int64_t s_c[kMaxExperts], s_src[kMaxExperts], s_dst[kMaxExperts], s_start[kMaxExperts + 1];
  const int64_t e_n = p_n * l_n;
  for (int64_t i = threadIdx.x; i < e_n; i += blockDim.x) s_c[i] = c[i];
  __syncthreads();
  for (int64_t p = threadIdx.x; p < p_n; p += blockDim.x) {
    int64_t at = p * b_n;
    for (int64_t l = 0; l < l_n; ++l) {
      s_src[p * l_n + l] = at;
      at += s_c[p * l_n + l];
    }
    MF_DEVICE_REQUIRE(at - p * b_n <= b_n, "moe_ep_recv_slots: slot %lld brings %lld rows, slots hold %lld",
                      static_cast<long long>(p), static_cast<long long>(at - p * b_n), static_cast<long long>(b_n));
  }
  for (int64_t l = threadIdx.x; l < l_n; l += blockDim.x) {
    int64_t n = 0;
    for (int64_t p = 0; p < p_n; ++p) n += s_c[p * l_n + l];
    s_start[l + 1] = n;  // expert l's total, made a prefix below
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    s_start[0] = 0;
    for (int64_t l = 0; l < l_n; ++l) s_start[l + 1] += s_start[l];
  }
  __syncthreads();
  for (int64_t l = threadIdx.x; l < l_n; l += blockDim.x) {
    int64_t at = s_start[l];
    for (int64_t p = 0; p < p_n; ++p) {
      s_dst[p * l_n + l] = at;
      at += s_c[p * l_n + l];
    }
  }
  __syncthreads();
  const int64_t x_n = p_n * b_n, total = s_start[l_n];
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < r_n) {  // an expert row: its slot row, or padding
    if (i >= total) {
      src_r[i] = -1;
    } else {
      const int64_t l = last_at_most(l_n, i, [&](int64_t m) { return s_start[m]; });
      const int64_t p = last_at_most(p_n, i, [&](int64_t q) { return s_dst[q * l_n + l]; });
      src_r[i] = s_src[p * l_n + l] + (i - s_dst[p * l_n + l]);
    }
  } else if (i < r_n + x_n) {  // a slot row: its expert row, if it brought one that fits
    const int64_t x = i - r_n, p = x / b_n;
    const int64_t used = s_src[p * l_n + l_n - 1] + s_c[p * l_n + l_n - 1];
    if (x >= used) {
      row_x[x] = -1;
    } else {
      const int64_t l = last_at_most(l_n, x, [&](int64_t m) { return s_src[p * l_n + m]; });
      const int64_t r = s_dst[p * l_n + l] + (x - s_src[p * l_n + l]);
      row_x[x] = r < r_n ? r : -1;
    }
  } else if (i == r_n + x_n) {  // the experts' offsets (the last one padded to R) and the overflow
    for (int64_t l = 0; l < l_n; ++l) offsets[l] = min(s_start[l], r_n);
    offsets[l_n] = r_n;
    for (int64_t l = 0; l < l_n; ++l) counts[l] = offsets[l + 1] - offsets[l];
    if (total > r_n) atomicAdd(overflow, static_cast<double>(total - r_n));
    max_fill(fill, total, r_n);
  }
}

}  // namespace

void moe_ep_send_slots(const ExecContext& ctx, const Tensor& home_offsets_E1, const Tensor& home_token_S,
                       const Tensor& row_TK, int64_t slot_rows, const Tensor& token_X, const Tensor& slot_TK,
                       const Tensor& send_counts_PL, const Tensor& overflow_1, const Tensor& fill_1) {
  for (const Tensor* t : {&home_offsets_E1, &home_token_S, &row_TK, &token_X, &slot_TK, &send_counts_PL, &overflow_1})
    check_cuda_tensor(*t, "moe_ep_send_slots");
  if (fill_1.defined()) check_cuda_tensor(fill_1, "moe_ep_send_slots");
  const int64_t p_n = send_counts_PL.size(0), l_n = send_counts_PL.size(1), a_n = row_TK.numel();
  const int64_t n = p_n * slot_rows + a_n + p_n;
  send_slots_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
      home_offsets_E1.ptr<int64_t>(), home_token_S.ptr<int64_t>(), row_TK.ptr<int64_t>(), a_n, p_n, l_n, slot_rows,
      token_X.ptr<int64_t>(), slot_TK.ptr<int64_t>(), send_counts_PL.ptr<int64_t>(), overflow_1.ptr<double>(),
      fill_1.defined() ? fill_1.ptr<double>() : nullptr);
  MF_CUDA_LAUNCHED("moe_ep_send_slots");
}

void moe_ep_recv_slots(const ExecContext& ctx, const Tensor& recv_counts_PL, int64_t slot_rows, const Tensor& src_R,
                       const Tensor& row_X, const Tensor& counts_L, const Tensor& offsets_L1, const Tensor& overflow_1,
                       const Tensor& fill_1) {
  for (const Tensor* t : {&recv_counts_PL, &src_R, &row_X, &counts_L, &offsets_L1, &overflow_1})
    check_cuda_tensor(*t, "moe_ep_recv_slots");
  if (fill_1.defined()) check_cuda_tensor(fill_1, "moe_ep_recv_slots");
  const int64_t p_n = recv_counts_PL.size(0), l_n = recv_counts_PL.size(1), r_n = src_R.numel();
  const int64_t n = r_n + p_n * slot_rows + 1;
  recv_slots_kernel<<<blocks_for(n, kThreads), kThreads, 0, stream_of(ctx)>>>(
      recv_counts_PL.ptr<int64_t>(), p_n, l_n, slot_rows, r_n, src_R.ptr<int64_t>(), row_X.ptr<int64_t>(),
      counts_L.ptr<int64_t>(), offsets_L1.ptr<int64_t>(), overflow_1.ptr<double>(),
      fill_1.defined() ? fill_1.ptr<double>() : nullptr);
  MF_CUDA_LAUNCHED("moe_ep_recv_slots");
}

}  // namespace moefold::cuda
