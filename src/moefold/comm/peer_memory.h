// PeerMemory: direct copies between the GPUs of a group's ranks on one host. Every rank's
// peer-visible block (Memory::peer_act) is mapped into every other rank's address space (CUDA
// IPC); copies run on the copy engines, beside the compute stream's kernels, taking none of their
// SMs (NCCL's transfers take SMs, and the persistent grouped GEMMs then wait for them). Each rank
// signals the end of its copies with a flag in the other ranks' memory, which their compute stream
// waits for on the device: nothing waits on the host.
// Offsets are bytes into a block; ranks that bound the same modules in the same order find every
// peer_act at the same offset in each other's blocks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "moefold/core/tensor.h"

namespace moefold {

class PeerMemory {
 public:
  // Local rows `src` into peer `peer`'s block at byte dst_offset.
  struct Push {
    int peer = 0;
    Tensor src;
    size_t dst_offset = 0;
  };
  // Peer `peer`'s block at byte src_offset into local rows `dst` (dst.nbytes() bytes).
  struct Pull {
    int peer = 0;
    size_t src_offset = 0;
    Tensor dst;
  };

  virtual ~PeerMemory() = default;

  // Collective (every rank of the group makes the same sequence of push and pull calls, each
  // with any subset of its peers). Starts once the compute stream's work queued so far is done;
  // returns a ticket at once. wait(ticket) then orders the primary stream's later work after
  // every peer's pushes of that call have landed here.
  virtual int64_t push(const std::vector<Push>& pushes) = 0;
  // Collective, as push: each rank's pulls start once every peer's compute stream has reached the
  // same call (its data is ready); wait(ticket) orders this rank's compute stream after its own
  // pulls. REQUIRES: a peer does not overwrite what is pulled from it before the puller's wait.
  virtual int64_t pull(const std::vector<Pull>& pulls) = 0;
  virtual void wait(int64_t ticket) = 0;

  // This rank's block and its size (the same size on every rank).
  virtual void* block() const = 0;
  virtual size_t block_bytes() const = 0;
  // The byte offset of `t` (a view into this rank's block) within it.
  size_t offset_of(const Tensor& t) const;
};

class Communicator;
// The CUDA IPC implementation behind NcclCommunicator::map_peer_memory (CUDA builds only).
std::unique_ptr<PeerMemory> make_cuda_peer_memory(Communicator& group, void* block, size_t bytes);
// Host blocks (MpiCommunicator::map_peer_memory): each push or pull is an exchange of messages
// over `group` after which every rank copies into or out of its own block, so the same offsets
// reach the same bytes as the direct copies do; finished before it returns. Collective; checks
// that every rank's block is `bytes` long.
std::unique_ptr<PeerMemory> make_message_peer_memory(Communicator& group, void* block, size_t bytes);

}  // namespace moefold
