// NCCL backend of Communicator, for GPU tensors (bf16/f32/f64/i32/i64), behind the interface of
// the MPI one. Host tensors (losses, loads, agreement flags: small) are staged through a device
// buffer reserved at creation, so every caller keeps working unchanged on a GPU run.
//
// Bootstrap (make_nccl_world): through an existing communicator when launched by mpirun/srun
// (rank 0's ncclUniqueId is broadcast over it), or from the torchrun / Slurm environment
// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; LOCAL_RANK picks the GPU): rank 0 serves the id
// over TCP. Groups come from ncclCommSplit.
//
// Streams: each communicator has its own stream. A call makes it wait (event) for the work
// already queued on the compute stream, queues the NCCL operation, and makes the compute stream
// wait for it: no host synchronisation, except where a host tensor must come back and in
// barrier(), which wait at most timeout_s() and then name rank, group and operation, and abort.
// Point-to-point tags are not used by NCCL (messages between two ranks arrive in order).
#pragma once

#include <memory>

#include "moefold/comm/communicator.h"

namespace moefold {

// Whether this build contains NCCL (the CUDA build).
bool nccl_built();
// True when RANK, WORLD_SIZE and MASTER_ADDR are set (torchrun --no-python, or Slurm exporting
// them) and no MPI launcher is detected.
bool launched_by_torchrun();
// The GPU of this process on its node: LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID,
// else 0.
int local_rank_from_env();

// Selects GPU local_rank_from_env() % devices and creates the world communicator. `bootstrap`:
// an existing world communicator (MPI) to agree on the NCCL id, or null to use the environment
// (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, default port 29500). Fails with one line naming
// what is missing or unreachable.
std::unique_ptr<Communicator> make_nccl_world(Communicator* bootstrap, double timeout_s);

}  // namespace moefold
