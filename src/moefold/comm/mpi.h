// MPI backend of Communicator (CPU tensors): world bootstrap, launcher detection, finalize.
// Every call is non-blocking MPI polled against a deadline, so a hang names rank, group,
// operation and peer, then aborts the job (exit code 3).
#pragma once

#include <memory>
#include <string>

#include "moefold/comm/communicator.h"

namespace moefold {

// True when the environment shows an MPI launcher: mpirun (OMPI_COMM_WORLD_SIZE), a PMI/PMIx
// launcher (PMI_SIZE, PMIX_RANK) or Slurm's srun (SLURM_NTASKS and SLURM_PROCID inside a step).
bool launched_by_mpi();

// Initialises MPI on first use (MPI_Init_thread, MPI_THREAD_FUNNELED: only the thread that called
// this makes MPI calls) and returns a communicator over all ranks named "world", on a private
// duplicate of MPI_COMM_WORLD. May be called again (for another timeout); each call returns a new
// group. Groups split from it inherit its timeout. REQUIRES: timeout_s > 0; MPI not finalized.
std::unique_ptr<Communicator> make_mpi_world(double timeout_s);

// Naming a lost rank. While a rank waits on a communicator it calls liveness_poll, which answers
// the other ranks' "are you there?" and, in the last quarter of the wait (at most 5 s), asks every
// rank of the MPI world; liveness_verdict is what the timeout line adds: the world ranks that
// did not answer (died or hang), or that every rank answers. The NCCL communicators use them too
// when MPI bootstrapped them. Without an MPI world (make_mpi_world): no-ops, "".
void liveness_poll(double seconds_left, double timeout_s);
void liveness_end_wait();  // the wait ended: answers still due do not count for the next one
std::string liveness_verdict();

// Finalizes MPI when this process initialised it and it is not finalized yet; otherwise a no-op
// (safe without MPI). Communicators still alive afterwards must only be destroyed.
void mpi_finalize();

}  // namespace moefold
