// Argument checks shared by every Communicator backend, so that all backends accept and reject
// the same calls (a layout that runs on one rank must not fail only on many), and the byte copy
// the host backends pack with.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/core/tensor.h"

namespace moefold::comm_detail {

// memcpy that allows empty ranges (whose pointers may be null): the packing of host exchanges.
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

// Elements per row of dimension 0 (product of the other dimensions).
int64_t row_elems(const Tensor& t);
// REQUIRES: defined, contiguous, cpu, dtype f32/f64/i32/i64 (gpu: any device, bf16 too; the
// NCCL backend takes GPU tensors and stages host ones).
void check_buffer(const Tensor& t, const char* op, const char* what, bool gpu = false);
// recv has group_size * send.size(0) rows of send's row shape and dtype.
void check_all_gather(const Tensor& send, const Tensor& recv, int group_size, bool gpu = false);
// send has group_size * recv.size(0) rows of recv's row shape and dtype.
void check_reduce_scatter(const Tensor& send, const Tensor& recv, int group_size, bool gpu = false);
// send and recv: same dtype and row size, size(0) a multiple of group_size and equal.
void check_all_to_all(const Tensor& send, const Tensor& recv, int group_size, bool gpu = false);
// Same dtype and row size; counts non-negative and summing to at most each buffer's rows.
void check_all_to_all_v(const Tensor& send, const int64_t* send_counts, const Tensor& recv, const int64_t* recv_counts,
                        int group_size, bool gpu = false);
// Peers in [0, group_size), each at most once; send and recv checked buffers of one dtype and row
// size (every transfer alike).
void check_exchange(const std::vector<Transfer>& transfers, int group_size, bool gpu = false);

}  // namespace moefold::comm_detail
