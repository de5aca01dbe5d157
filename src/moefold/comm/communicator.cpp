// The Communicator defaults: an exchange through all_to_all_v on packed host buffers, finished
// before it returns.
#include "moefold/comm/communicator.h"

#include <cstring>

#include "moefold/comm/comm_checks.h"

namespace moefold {

int64_t Communicator::start_exchange(const std::vector<Transfer>& transfers) {
  comm_detail::check_exchange(transfers, size());
  const int p_n = size();
  const DType dtype = transfers.empty() ? DType::f32 : transfers.front().send.dtype();
  const int64_t row = transfers.empty() ? 1 : comm_detail::row_elems(transfers.front().send);
  const size_t row_bytes = static_cast<size_t>(row) * dtype_size(dtype);
  std::vector<int64_t> send_counts(static_cast<size_t>(p_n), 0), recv_counts(static_cast<size_t>(p_n), 0);
  std::vector<const Transfer*> by_peer(static_cast<size_t>(p_n), nullptr);
  int64_t send_rows = 0, recv_rows = 0;
  for (const Transfer& t : transfers) {
    by_peer[static_cast<size_t>(t.peer)] = &t;
    send_counts[static_cast<size_t>(t.peer)] = t.send.size(0);
    recv_counts[static_cast<size_t>(t.peer)] = t.recv.size(0);
    send_rows += t.send.size(0);
    recv_rows += t.recv.size(0);
  }
  // Peer-major packed buffers, as all_to_all_v takes them.
  std::vector<std::byte> send(static_cast<size_t>(send_rows) * row_bytes),
      recv(static_cast<size_t>(recv_rows) * row_bytes);
  size_t off = 0;
  for (const Transfer* t : by_peer) {
    if (t == nullptr) continue;
    comm_detail::copy_bytes(send.data() + off, t->send.data(), static_cast<size_t>(t->send.size(0)) * row_bytes);
    off += static_cast<size_t>(t->send.size(0)) * row_bytes;
  }
  all_to_all_v(Tensor(send.data(), dtype, {send_rows, row}), send_counts.data(),
               Tensor(recv.data(), dtype, {recv_rows, row}), recv_counts.data());
  off = 0;
  for (const Transfer* t : by_peer) {
    if (t == nullptr) continue;
    comm_detail::copy_bytes(t->recv.data(), recv.data() + off, static_cast<size_t>(t->recv.size(0)) * row_bytes);
    off += static_cast<size_t>(t->recv.size(0)) * row_bytes;
  }
  return 0;
}

namespace {
// buf as [size, numel / size] and its block of this rank.
Tensor blocks_of(const Tensor& buf, int size, const char* op) {
  comm_detail::check_buffer(buf, op, "buf");
  MF_CHECK(buf.numel() % size == 0, op, ": ", buf.str(), " is not ", size, " equal blocks");
  return buf.view({size, buf.numel() / size});
}
}  // namespace

int64_t Communicator::start_reduce_scatter(const Tensor& buf, ReduceOp op) {
  const Tensor all = blocks_of(buf, size(), "start_reduce_scatter");
  std::vector<std::byte> mine(all.nbytes() / static_cast<size_t>(size()));
  const Tensor out(mine.data(), buf.dtype(), {1, all.size(1)});
  reduce_scatter(all, out, op);
  all.slice(rank(), rank() + 1).copy_from(out);
  return 0;
}

int64_t Communicator::start_all_gather(const Tensor& buf) {
  const Tensor all = blocks_of(buf, size(), "start_all_gather");
  std::vector<std::byte> mine(all.nbytes() / static_cast<size_t>(size()));
  const Tensor in(mine.data(), buf.dtype(), {1, all.size(1)});
  in.copy_from(all.slice(rank(), rank() + 1));
  all_gather(in, all);
  return 0;
}

}  // namespace moefold
