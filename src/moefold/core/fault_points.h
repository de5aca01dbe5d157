// Fault injection for the crash, full-disk and lost-rank tests (a diagnostic: never set in a
// real run). Named points in the code call fault_point(); the environment variable
//
//   MOEFOLD_FAULT=<point>:<n>:<action>[@<world rank>]
//
// makes the n-th pass (counting from 1) of this process through <point> (on that world rank
// only, when given) do <action>:
//   kill    SIGKILL to itself (a crash at that instant: nothing flushed, no destructors);
//   hang    stop responding for good (a rank lost without dying: it sleeps forever);
//   enospc  fault_point returns ENOSPC: the caller fails as if the disk were full (only
//           safetensors.tensor acts on it; the other points ignore what fault_point returns).
// A malformed value is an Error naming it. Points in use: checkpoint.snapshot,
// safetensors.tensor (before each tensor write_safetensors writes), checkpoint.fsync,
// checkpoint.index, checkpoint.rename, checkpoint.prune, train.step.
#pragma once

namespace moefold {

// 0, or the errno the caller must fail with. Thread-safe.
int fault_point(const char* point);

// This process's world rank, for MOEFOLD_FAULT's @rank (before it is set, only specs without
// @rank fire).
void set_fault_rank(int world_rank);

}  // namespace moefold
