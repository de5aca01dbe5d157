// The two EpTransports: the communicator's exchange and PeerMemory copies.
#include "moefold/moe/ep_transport.h"

#include <utility>

#include "moefold/core/error.h"
#include "moefold/moe/ep_exchange.h"

namespace moefold {

EpTransportChoice parse_ep_transport(const std::string& value) {
  if (value == "auto") return EpTransportChoice::automatic;
  if (value == "nccl") return EpTransportChoice::nccl;
  if (value == "ipc") return EpTransportChoice::ipc;
  MF_FAIL("parallel.ep_transport = \"", value, "\": expected one of auto, nccl, ipc");
}

namespace {

// Each move is one Transfer: this rank's home rows pair with the peer's piece and the other way
// round, so the library needs no offsets.
class ExchangeTransport final : public EpTransport {
 public:
  explicit ExchangeTransport(Communicator& ep) : ep_(ep) {}
  int64_t start(EpLeg leg, const std::vector<EpMove>& moves) override {
    transfers_.clear();
    for (const EpMove& m : moves)
      transfers_.push_back(toward_experts(leg) ? Transfer{m.peer, m.home, m.rows} : Transfer{m.peer, m.rows, m.home});
    return ep_.start_exchange(transfers_);
  }
  void wait(int64_t ticket) override { ep_.wait(ticket); }
  const char* name() const override { return "exchange"; }

 private:
  Communicator& ep_;
  std::vector<Transfer> transfers_;  // kept: no allocation in a step once grown
};

// Each rank copies what it holds into the peer's buffer at the peer's offset (every rank's
// buffers sit at the same offsets of their peer-visible blocks), except dout, whose destination
// is the caller's buffer (not peer-visible): the expert rank pulls it from the peer's home rows.
class PeerTransport final : public EpTransport {
 public:
  PeerTransport(std::unique_ptr<PeerMemory> peer, const EpExchange& ex) : peer_(std::move(peer)), ex_(ex) {}
  int64_t start(EpLeg leg, const std::vector<EpMove>& moves) override {
    // The peer's buffer on the other side of the leg: its experts' rows, or its home rows.
    const Tensor& there = leg == EpLeg::dispatch ? ex_.rows_RH() : leg == EpLeg::combine ? ex_.home_SH() : ex_.own_SH();
    const size_t base = peer_->offset_of(there);
    const size_t row_bytes = static_cast<size_t>(there.size(1)) * dtype_size(there.dtype());
    auto at = [&](int64_t row) { return base + row_bytes * static_cast<size_t>(row); };
    pushes_.clear();
    pulls_.clear();
    for (const EpMove& m : moves) {
      switch (leg) {
        case EpLeg::dispatch:
          pushes_.push_back({m.peer, m.home, at(m.peer_piece_row)});
          break;
        case EpLeg::combine:
        case EpLeg::drows:
          pushes_.push_back({m.peer, m.rows, at(m.peer_home_row)});
          break;
        case EpLeg::dout:
          pulls_.push_back({m.peer, at(m.peer_home_row), m.rows});
          break;
      }
    }
    return leg == EpLeg::dout ? peer_->pull(pulls_) : peer_->push(pushes_);
  }
  void wait(int64_t ticket) override { peer_->wait(ticket); }
  const char* name() const override { return "peer"; }

 private:
  std::unique_ptr<PeerMemory> peer_;
  const EpExchange& ex_;
  std::vector<PeerMemory::Push> pushes_;
  std::vector<PeerMemory::Pull> pulls_;
};

}  // namespace

std::unique_ptr<EpTransport> choose_ep_transport(EpTransportChoice choice, Communicator& ep, const Memory& mem,
                                                 const EpExchange& ex) {
  // Collective: every rank maps, or none does. auto maps GPUs only (on CPU ranks the copies would
  // be messages anyway, and the exchange sends fewer).
  const bool want = ep.size() > 1 && (choice == EpTransportChoice::ipc ||
                                      (choice == EpTransportChoice::automatic && mem.device() == Device::cuda));
  int32_t all_want = want ? 1 : 0;
  ep.all_reduce(Tensor(&all_want, DType::i32, {1}), ReduceOp::sum);
  std::unique_ptr<PeerMemory> peer;
  if (all_want == ep.size()) peer = ep.map_peer_memory(mem.peer_block(), mem.peer_block_bytes());
  if (peer != nullptr) return std::make_unique<PeerTransport>(std::move(peer), ex);
  if (choice == EpTransportChoice::ipc && ep.size() > 1)
    MF_FAIL("parallel.ep_transport = ipc: the ranks of EP group '", ep.name(),
            "' cannot map each other's memory (GPUs not of one host, or without peer access)");
  return std::make_unique<ExchangeTransport>(ep);
}

}  // namespace moefold
