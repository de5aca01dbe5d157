// PeerMemory's offset helper and the host implementation over a group's messages (the CUDA
// implementation is in nccl.cpp and peer_memory.cu).
#include "moefold/comm/peer_memory.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "moefold/comm/comm_checks.h"
#include "moefold/comm/communicator.h"
#include "moefold/core/error.h"

namespace moefold {

size_t PeerMemory::offset_of(const Tensor& t) const {
  const char* b = static_cast<const char*>(block());
  const char* p = static_cast<const char*>(t.data());
  MF_CHECK(p >= b && p + t.nbytes() <= b + block_bytes(), "PeerMemory: ", t.str(),
           " is not inside this rank's peer-visible block");
  return static_cast<size_t>(p - b);
}

namespace {

// Host blocks: every push or pull is three exchanges over the group (how many copies each peer
// gets, their (offset, bytes) headers, the bytes), and each rank copies what it receives into its
// own block, or what it is asked for out of it. Finished before returning: wait is a no-op.
class MessagePeerMemory final : public PeerMemory {
 public:
  MessagePeerMemory(Communicator& group, void* block, size_t bytes) : group_(group), block_(block), bytes_(bytes) {
    int64_t range[2] = {static_cast<int64_t>(bytes), -static_cast<int64_t>(bytes)};  // max, -min
    group.all_reduce(Tensor(range, DType::i64, {2}), ReduceOp::max);
    MF_CHECK(range[0] == -range[1], "map_peer_memory on group '", group.name(), "': blocks of ", -range[1], " to ",
             range[0], " bytes on its ranks (every rank's must be the same size)");
  }

  int64_t push(const std::vector<Push>& pushes) override {
    const std::vector<size_t> order = by_peer(pushes);
    const std::vector<Copy> copies = requests(pushes, order, &Push::dst_offset, &Push::src, "push");
    const std::vector<Copy> arrived = exchange_headers(copies);
    std::vector<std::byte> out(total(copies)), in(total(arrived));
    size_t at = 0;
    for (const size_t i : order) {
      comm_detail::copy_bytes(out.data() + at, pushes[i].src.data(), pushes[i].src.nbytes());
      at += pushes[i].src.nbytes();
    }
    exchange_bytes(copies, out, arrived, in);
    at = 0;
    for (const Copy& c : arrived) {  // each into this rank's block where its sender aimed it
      comm_detail::copy_bytes(static_cast<std::byte*>(block_) + c.offset, in.data() + at, static_cast<size_t>(c.bytes));
      at += static_cast<size_t>(c.bytes);
    }
    return ++tickets_;
  }

  int64_t pull(const std::vector<Pull>& pulls) override {
    const std::vector<size_t> order = by_peer(pulls);
    const std::vector<Copy> asked = requests(pulls, order, &Pull::src_offset, &Pull::dst, "pull");
    const std::vector<Copy> wanted = exchange_headers(asked);  // what each peer pulls from this block
    std::vector<std::byte> out(total(wanted)), in(total(asked));
    size_t at = 0;
    for (const Copy& c : wanted) {
      comm_detail::copy_bytes(out.data() + at, static_cast<const std::byte*>(block_) + c.offset,
                              static_cast<size_t>(c.bytes));
      at += static_cast<size_t>(c.bytes);
    }
    exchange_bytes(wanted, out, asked, in);
    at = 0;
    for (const size_t i : order) {
      comm_detail::copy_bytes(pulls[i].dst.data(), in.data() + at, pulls[i].dst.nbytes());
      at += pulls[i].dst.nbytes();
    }
    return ++tickets_;
  }

  void wait(int64_t ticket) override {
    MF_CHECK(ticket > 0 && ticket <= tickets_, "PeerMemory::wait on group '", group_.name(), "': ticket ", ticket,
             " was never returned (", tickets_, " so far)");
  }

  void* block() const override { return block_; }
  size_t block_bytes() const override { return bytes_; }

 private:
  // One copy between this rank and `peer`: `bytes` bytes at byte `offset` of the peer's block
  // (outgoing) or of this rank's block (incoming).
  struct Copy {
    int peer = 0;
    int64_t offset = 0, bytes = 0;
  };

  // Indices of `items` ordered by peer (the exchanges are peer-major), after checking the peers.
  template <class Item>
  std::vector<size_t> by_peer(const std::vector<Item>& items) const {
    std::vector<size_t> order(items.size());
    std::iota(order.begin(), order.end(), size_t{0});
    for (const Item& it : items)
      MF_CHECK(it.peer >= 0 && it.peer < group_.size() && it.peer != group_.rank(), "PeerMemory on group '",
               group_.name(), "' (rank ", group_.rank(), " of ", group_.size(), "): bad peer ", it.peer);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return items[a].peer < items[b].peer; });
    return order;
  }

  // The copies `items` ask for, in `order`: the peer's block at item.*offset, as many bytes as
  // the local tensor item.*local holds (checked to be host memory).
  template <class Item>
  static std::vector<Copy> requests(const std::vector<Item>& items, const std::vector<size_t>& order,
                                    size_t Item::*offset, Tensor Item::*local, const char* op) {
    std::vector<Copy> copies;
    for (const size_t i : order) {
      const Tensor& t = items[i].*local;
      MF_CHECK(t.defined() && t.device() == Device::cpu, "PeerMemory::", op, ": ", t.str(),
               " is not a host tensor (this group's blocks are host memory)");
      copies.push_back({items[i].peer, static_cast<int64_t>(items[i].*offset), static_cast<int64_t>(t.nbytes())});
    }
    return copies;
  }

  static size_t total(const std::vector<Copy>& copies) {
    size_t n = 0;
    for (const Copy& c : copies) n += static_cast<size_t>(c.bytes);
    return n;
  }

  std::vector<int64_t> per_peer(const std::vector<Copy>& copies, bool bytes) const {
    std::vector<int64_t> n(static_cast<size_t>(group_.size()), 0);
    for (const Copy& c : copies) n[static_cast<size_t>(c.peer)] += bytes ? c.bytes : 1;
    return n;
  }

  // Sends each peer the headers of `mine` (peer-major) and returns the peers' headers for this
  // rank, peer-major, each checked against this block's size.
  std::vector<Copy> exchange_headers(const std::vector<Copy>& mine) const {
    const int n = group_.size();
    std::vector<int64_t> sent = per_peer(mine, false), got(static_cast<size_t>(n), 0);
    group_.all_to_all(Tensor(sent.data(), DType::i64, {n}), Tensor(got.data(), DType::i64, {n}));
    std::vector<int64_t> out, in(2 * static_cast<size_t>(std::accumulate(got.begin(), got.end(), int64_t{0})));
    for (const Copy& c : mine) {
      out.push_back(c.offset);
      out.push_back(c.bytes);
    }
    const int64_t n_out = static_cast<int64_t>(out.size() / 2), n_in = static_cast<int64_t>(in.size() / 2);
    group_.all_to_all_v(Tensor(out.data(), DType::i64, {n_out, 2}), sent.data(),
                        Tensor(in.data(), DType::i64, {n_in, 2}), got.data());
    std::vector<Copy> theirs;
    size_t k = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < got[static_cast<size_t>(p)]; ++i, k += 2) {
        const Copy c{p, in[k], in[k + 1]};
        MF_CHECK(c.offset >= 0 && c.bytes >= 0 && static_cast<size_t>(c.offset + c.bytes) <= bytes_,
                 "PeerMemory on group '", group_.name(), "': rank ", p, " copies bytes [", c.offset, ", ",
                 c.offset + c.bytes, ") of rank ", group_.rank(), "'s block of ", bytes_);
        theirs.push_back(c);
      }
    return theirs;
  }

  void exchange_bytes(const std::vector<Copy>& out_copies, std::vector<std::byte>& out,
                      const std::vector<Copy>& in_copies, std::vector<std::byte>& in) const {
    const std::vector<int64_t> sent = per_peer(out_copies, true), got = per_peer(in_copies, true);
    group_.all_to_all_v(Tensor(out.data(), DType::u8, {static_cast<int64_t>(out.size())}), sent.data(),
                        Tensor(in.data(), DType::u8, {static_cast<int64_t>(in.size())}), got.data());
  }

  Communicator& group_;
  void* block_;
  size_t bytes_;
  int64_t tickets_ = 0;
};

}  // namespace

std::unique_ptr<PeerMemory> make_message_peer_memory(Communicator& group, void* block, size_t bytes) {
  return std::make_unique<MessagePeerMemory>(group, block, bytes);
}

}  // namespace moefold
