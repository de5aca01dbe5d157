// The one-rank Communicator: collectives are copies or no-ops, on host or GPU tensors; point-to-point to oneself is a
// programming error (a one-rank layout has no peers).
#include <limits>

#include "moefold/comm/comm_checks.h"
#include "moefold/comm/communicator.h"

namespace moefold {
namespace {

using comm_detail::check_buffer;
// Copies work between any devices (Tensor::copy_from), so GPU tensors (bf16 too) are welcome.
constexpr bool kAnyDevice = true;

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(std::string name) : name_(std::move(name)) {}

  int rank() const override { return 0; }
  int size() const override { return 1; }
  int world_rank() const override { return 0; }
  const std::string& name() const override { return name_; }
  // Nothing ever waits on another rank.
  double timeout_s() const override { return std::numeric_limits<double>::infinity(); }

  void all_reduce(const Tensor& buf, ReduceOp) override { check_buffer(buf, "all_reduce", "buf", kAnyDevice); }
  void all_gather(const Tensor& send, const Tensor& recv) override {
    comm_detail::check_all_gather(send, recv, 1, kAnyDevice);
    recv.copy_from(send);
  }
  void reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp) override {
    comm_detail::check_reduce_scatter(send, recv, 1, kAnyDevice);
    recv.copy_from(send);
  }
  void all_to_all_v(const Tensor& send, const int64_t* send_counts, const Tensor& recv,
                    const int64_t* recv_counts) override {
    comm_detail::check_all_to_all_v(send, send_counts, recv, recv_counts, 1, kAnyDevice);
    MF_CHECK(send_counts[0] == recv_counts[0], "all_to_all_v on group '", name_, "': sends ", send_counts[0],
             " rows to itself but expects ", recv_counts[0]);
    recv.slice(0, recv_counts[0]).copy_from(send.slice(0, send_counts[0]));
  }
  void all_to_all(const Tensor& send, const Tensor& recv) override {
    comm_detail::check_all_to_all(send, recv, 1, kAnyDevice);
    recv.copy_from(send);
  }
  void broadcast(const Tensor& buf, int root) override {
    check_buffer(buf, "broadcast", "buf", kAnyDevice);
    MF_CHECK(root == 0, "broadcast on group '", name_, "' of 1 rank from root ", root);
  }
  void send(const Tensor&, int peer, int) override {
    MF_CHECK(false, "send to peer ", peer, " on group '", name_, "' of 1 rank (no peers)");
  }
  void recv(const Tensor&, int peer, int) override {
    MF_CHECK(false, "recv from peer ", peer, " on group '", name_, "' of 1 rank (no peers)");
  }
  void barrier() override {}
  int64_t start_exchange(const std::vector<Transfer>& transfers) override {
    comm_detail::check_exchange(transfers, 1, kAnyDevice);
    for (const Transfer& t : transfers) {
      MF_CHECK(t.send.size(0) == t.recv.size(0), "start_exchange on group '", name_, "': sends ", t.send.size(0),
               " rows to itself but expects ", t.recv.size(0));
      t.recv.copy_from(t.send);
    }
    return 0;
  }
  // One block: already reduced, already gathered.
  int64_t start_reduce_scatter(const Tensor& buf, ReduceOp) override {
    check_buffer(buf, "start_reduce_scatter", "buf", kAnyDevice);
    return 0;
  }
  int64_t start_all_gather(const Tensor& buf) override {
    check_buffer(buf, "start_all_gather", "buf", kAnyDevice);
    return 0;
  }
  std::unique_ptr<Communicator> split(int, int, const std::string& name) override {
    return make_self_communicator(name);
  }

 private:
  std::string name_;
};

}  // namespace

std::unique_ptr<Communicator> make_self_communicator(const std::string& name) {
  return std::make_unique<SelfCommunicator>(name);
}

}  // namespace moefold
