// Communicator: collective and point-to-point communication within one group of ranks, behind
// one interface (MPI for CPU tensors now; NCCL for GPU tensors drops in behind the same calls).
// Groups are values passed explicitly to whoever needs them; there is no global group state.
//
// Every blocking call waits at most timeout_s(); past it the rank prints one line naming its
// world rank, the group, the operation and the peer (where there is one), and the job aborts:
// an MoE hang explains itself instead of hanging.
//
// Buffers are contiguous tensors; counts and displacements are in ROWS of dimension 0 (a row is
// numel / size(0) elements), which is how tokens travel.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "moefold/comm/peer_memory.h"
#include "moefold/core/tensor.h"

namespace moefold {

enum class ReduceOp : uint8_t { sum, max };

// One peer's part of an exchange: the rows of `send` go to `peer`, the rows `peer` sends here land
// in `recv` (either may have 0 rows; both are defined, contiguous, of one dtype and row size).
struct Transfer {
  int peer = 0;
  Tensor send, recv;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;  // rank within this group
  virtual int size() const = 0;
  virtual int world_rank() const = 0;           // for messages
  virtual const std::string& name() const = 0;  // "world", "dp", "ep", ... (for messages)
  virtual double timeout_s() const = 0;

  // In place; f32/f64/i32/i64.
  virtual void all_reduce(const Tensor& buf, ReduceOp op) = 0;
  // recv has size() * send.size(0) rows: rank i's send lands in rows [i*n, (i+1)*n).
  virtual void all_gather(const Tensor& send, const Tensor& recv) = 0;
  // send has size() * recv.size(0) rows; rank i gets the reduction of everyone's block i.
  virtual void reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op) = 0;
  // Rows [sum(send_counts[0..p)), +send_counts[p]) of send go to peer p; rows from peer p land at
  // rows [sum(recv_counts[0..p)), +recv_counts[p]) of recv. Both arrays have size() entries.
  // REQUIRES: recv_counts match what the peers send (exchange counts first with all_to_all).
  virtual void all_to_all_v(const Tensor& send, const int64_t* send_counts, const Tensor& recv,
                            const int64_t* recv_counts) = 0;
  // Equal blocks: send and recv both have size() * n rows; block p goes to / comes from peer p.
  virtual void all_to_all(const Tensor& send, const Tensor& recv) = 0;
  virtual void broadcast(const Tensor& buf, int root) = 0;
  virtual void send(const Tensor& buf, int peer, int tag) = 0;
  virtual void recv(const Tensor& buf, int peer, int tag) = 0;
  virtual void barrier() = 0;

  // Collective: every rank calls it together, with at most one Transfer per peer (itself
  // included); a rank's recv rows from q must equal q's send rows to it. Starts the exchange after
  // the work queued so far on the compute stream and returns a ticket; on a GPU backend the
  // exchange runs on the communicator's own stream, so the compute stream goes on with other
  // work. wait(ticket) orders the compute-stream work queued after it behind the exchange; until
  // then neither the send nor the recv rows may be touched. Host backends (MPI, one rank) finish
  // the exchange before returning (this default does, through all_to_all_v).
  virtual int64_t start_exchange(const std::vector<Transfer>& transfers);
  // Collective: all_reduce(buf, op) started like start_exchange (after the compute stream's work
  // so far; on a GPU backend on the communicator's stream, the compute stream going on) with a
  // ticket for wait(); `buf` must not be touched until then. Host backends finish it before
  // returning (this default). Backward overlaps the data-parallel gradient reduction with it.
  virtual int64_t start_all_reduce(const Tensor& buf, ReduceOp op) {
    all_reduce(buf, op);
    return 0;
  }
  // Collective, in place (the distributed optimizer's gradient buckets): `buf` is size() equal
  // blocks; block rank() of this rank's buf becomes op over every rank's block rank(), the other
  // blocks keep unspecified values. Started like start_all_reduce. REQUIRES: numel % size() == 0.
  // Host backends finish before returning (this default: reduce_scatter through a copy).
  virtual int64_t start_reduce_scatter(const Tensor& buf, ReduceOp op);
  // Collective, in place (the distributed optimizer's updated weights): block r of rank r's `buf`
  // lands in block r of every rank's buf. Started like start_all_reduce. REQUIRES: numel %
  // size() == 0. Host backends finish before returning (this default: all_gather from a copy).
  virtual int64_t start_all_gather(const Tensor& buf);
  // Point to point without blocking (the pipeline's stages): `buf` goes to `peer` / comes from
  // `peer`; between two ranks the sends of one and the receives of the other match in the order
  // they were started (one communicator per direction where both directions flow). Started after
  // the compute stream's work so far (GPU backends: on the communicator's stream; host backends: a
  // non-blocking message); `buf` must not be touched until wait(ticket). This default blocks
  // (send / recv): sound only where the peer's matching call is already under way.
  virtual int64_t start_send(const Tensor& buf, int peer) {
    send(buf, peer, 0);
    return 0;
  }
  virtual int64_t start_recv(const Tensor& buf, int peer) {
    recv(buf, peer, 0);
    return 0;
  }
  virtual void wait(int64_t ticket) { (void)ticket; }
  // Collective: maps every rank's peer-visible block (Memory::peer_block, `bytes` long on every
  // rank) into the others' address spaces, for direct copies (see PeerMemory). Null on every rank
  // where the group cannot (one rank; GPUs on other hosts or without peer access). MPI groups
  // (host blocks) give make_message_peer_memory: the same copies, as messages.
  virtual std::unique_ptr<PeerMemory> map_peer_memory(void* block, size_t bytes) {
    (void)block, (void)bytes;
    return nullptr;
  }

  // Collective over this group: ranks with equal `color` form a new group, ordered by `key`.
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;
};

// A group of one rank (no MPI): every collective is a copy or a no-op.
std::unique_ptr<Communicator> make_self_communicator(const std::string& name = "world");

}  // namespace moefold
