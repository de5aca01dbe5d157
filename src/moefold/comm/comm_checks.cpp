// Argument checks shared by every Communicator backend.
#include "moefold/comm/comm_checks.h"

namespace moefold::comm_detail {

int64_t row_elems(const Tensor& t) {
  int64_t n = 1;
  for (int i = 1; i < t.ndim(); ++i) n *= t.size(i);
  return n;
}

void check_buffer(const Tensor& t, const char* op, const char* what, bool gpu) {
  MF_CHECK(t.defined(), op, ": ", what, " is undefined");
  MF_CHECK(t.contiguous(), op, ": ", what, " ", t.str(), " is not contiguous");
  MF_CHECK(gpu || t.device() == Device::cpu, op, ": ", what, " ", t.str(), " is not on the cpu");
  const DType d = t.dtype();
  MF_CHECK(d == DType::f32 || d == DType::f64 || d == DType::i32 || d == DType::i64 || d == DType::u8 ||
               (gpu && d == DType::bf16),
           op, ": ", what, " ", t.str(), " has an unsupported dtype (f32, f64, i32, i64, u8", gpu ? ", bf16)" : ")");
}

static void check_rows_alike(const Tensor& a, const Tensor& b, const char* op) {
  MF_CHECK(a.dtype() == b.dtype(), op, ": send ", a.str(), " and recv ", b.str(), " differ in dtype");
  MF_CHECK(row_elems(a) == row_elems(b), op, ": send ", a.str(), " and recv ", b.str(), " differ in row size");
}

void check_all_gather(const Tensor& send, const Tensor& recv, int group_size, bool gpu) {
  check_buffer(send, "all_gather", "send", gpu);
  check_buffer(recv, "all_gather", "recv", gpu);
  check_rows_alike(send, recv, "all_gather");
  MF_CHECK(recv.size(0) == group_size * send.size(0), "all_gather: recv ", recv.str(), " needs ", group_size,
           " x send ", send.str(), " rows");
}

void check_reduce_scatter(const Tensor& send, const Tensor& recv, int group_size, bool gpu) {
  check_buffer(send, "reduce_scatter", "send", gpu);
  check_buffer(recv, "reduce_scatter", "recv", gpu);
  check_rows_alike(send, recv, "reduce_scatter");
  MF_CHECK(send.size(0) == group_size * recv.size(0), "reduce_scatter: send ", send.str(), " needs ", group_size,
           " x recv ", recv.str(), " rows");
}

void check_all_to_all(const Tensor& send, const Tensor& recv, int group_size, bool gpu) {
  check_buffer(send, "all_to_all", "send", gpu);
  check_buffer(recv, "all_to_all", "recv", gpu);
  check_rows_alike(send, recv, "all_to_all");
  MF_CHECK(send.size(0) == recv.size(0) && send.size(0) % group_size == 0, "all_to_all: send ", send.str(),
           " and recv ", recv.str(), " need equal rows, a multiple of the group size ", group_size);
}

void check_all_to_all_v(const Tensor& send, const int64_t* send_counts, const Tensor& recv, const int64_t* recv_counts,
                        int group_size, bool gpu) {
  check_buffer(send, "all_to_all_v", "send", gpu);
  check_buffer(recv, "all_to_all_v", "recv", gpu);
  check_rows_alike(send, recv, "all_to_all_v");
  MF_CHECK(send_counts != nullptr && recv_counts != nullptr, "all_to_all_v: null counts");
  int64_t send_rows = 0, recv_rows = 0;
  for (int p = 0; p < group_size; ++p) {
    MF_CHECK(send_counts[p] >= 0 && recv_counts[p] >= 0, "all_to_all_v: negative count for peer ", p);
    send_rows += send_counts[p];
    recv_rows += recv_counts[p];
  }
  MF_CHECK(send_rows <= send.size(0), "all_to_all_v: send counts total ", send_rows, " rows > send ", send.str());
  MF_CHECK(recv_rows <= recv.size(0), "all_to_all_v: recv counts total ", recv_rows, " rows > recv ", recv.str());
}

void check_exchange(const std::vector<Transfer>& transfers, int group_size, bool gpu) {
  std::vector<bool> seen(static_cast<size_t>(group_size), false);
  for (const Transfer& t : transfers) {
    MF_CHECK(t.peer >= 0 && t.peer < group_size, "start_exchange: peer ", t.peer, " of ", group_size);
    MF_CHECK(!seen[static_cast<size_t>(t.peer)], "start_exchange: peer ", t.peer, " given twice");
    seen[static_cast<size_t>(t.peer)] = true;
    check_buffer(t.send, "start_exchange", "send", gpu);
    check_buffer(t.recv, "start_exchange", "recv", gpu);
    check_rows_alike(t.send, t.recv, "start_exchange");
    check_rows_alike(t.send, transfers.front().send, "start_exchange");
  }
}

}  // namespace moefold::comm_detail
