// PeerMemory's offset helper (the CUDA implementation is in nccl.cpp and peer_memory.cu).
#include "moefold/comm/peer_memory.h"

#include "moefold/core/error.h"

namespace moefold {

size_t PeerMemory::offset_of(const Tensor& t) const {
  const char* b = static_cast<const char*>(block());
  const char* p = static_cast<const char*>(t.data());
  MF_CHECK(p >= b && p + t.nbytes() <= b + block_bytes(), "PeerMemory: ", t.str(),
           " is not inside this rank's peer-visible block");
  return static_cast<size_t>(p - b);
}

}  // namespace moefold
