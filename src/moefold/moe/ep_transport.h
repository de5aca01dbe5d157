// How the rounds of an expert-parallel dispatch travel between the EP ranks (AllToAllDispatcher;
// parallel.ep_transport). A round moves, for each peer in it, one block of home rows on one side
// and one piece of expert rows on the other; where they sit on both sides is EpLayout's arithmetic,
// so each rank knows the peer's offsets without asking. Two transports move them:
// - exchange: the communicator's start_exchange (NCCL send/recv on GPUs, MPI on CPU ranks): both
//   sides name their own buffers and the library pairs them;
// - peer: PeerMemory copies straight into (or, for dout, out of) the peer's buffers at the peer's
//   offsets: on GPUs of one host CUDA IPC on the copy engines, leaving the SMs to the experts.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/comm/peer_memory.h"
#include "moefold/core/memory.h"
#include "moefold/core/tensor.h"

namespace moefold {

class EpExchange;

// parallel.ep_transport.
enum class EpTransportChoice : uint8_t { automatic, nccl, ipc };
// "auto", "nccl" or "ipc" (anything else: Error naming parallel.ep_transport).
EpTransportChoice parse_ep_transport(const std::string& value);

// The four legs of a layer: x rows out to the experts, their outputs back, the output gradients
// out, the input gradients back.
enum class EpLeg : uint8_t { dispatch, combine, dout, drows };
// dispatch and dout carry home rows to the experts; combine and drows carry expert rows home.
inline bool toward_experts(EpLeg leg) { return leg == EpLeg::dispatch || leg == EpLeg::dout; }

// One peer's part of a round, from this rank's side. home: this rank's home rows for the peer's
// experts (the leg's home buffer: EpExchange::home_SH for combine, own_SH for the others); rows:
// the piece of this rank's expert rows that comes from (or goes back to) the peer. home and rows
// are two different pairings: this rank's home rows meet the PEER's piece, this rank's piece the
// PEER's home rows, at the peer's offsets below (rows of its buffers).
struct EpMove {
  int peer = 0;
  Tensor home, rows;
  int64_t peer_home_row = 0;   // the peer's home rows for this rank's experts (EpLayout::home_part(peer, me, j))
  int64_t peer_piece_row = 0;  // this rank's home rows at the peer's experts (EpLayout::piece_row(peer, me, j))
};

class EpTransport {
 public:
  virtual ~EpTransport() = default;
  // Collective over the EP group: every rank starts the same round of the same leg together,
  // after the work queued so far on its context's stream. Returns a ticket at once; until
  // wait(ticket) the moves' tensors must not be touched.
  virtual int64_t start(EpLeg leg, const std::vector<EpMove>& moves) = 0;
  // Orders the context stream's later work after the round (its rows have landed here).
  virtual void wait(int64_t ticket) = 0;
  // "exchange" or "peer" (for messages and tests).
  virtual const char* name() const = 0;
};

// Collective over `ep` (the first dispatch after bind): peer copies where `choice` allows them and
// every rank can map the others' peer-visible blocks (GPUs of one host with auto; any group with
// ipc, which fails naming the group where it cannot be had), else the exchange. ex's buffers are
// the ones the peer copies address; `mem` holds the peer-visible block they live in. Both
// outlive the transport.
std::unique_ptr<EpTransport> choose_ep_transport(EpTransportChoice choice, Communicator& ep, const Memory& mem,
                                                 const EpExchange& ex);

}  // namespace moefold
