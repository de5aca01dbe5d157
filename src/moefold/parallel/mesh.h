// The device mesh of parallel folding: the same world laid out twice, with every group built
// once from the world communicator and handed explicitly to whoever needs it.
//   dense view: world rank r = tp_rank + tp * (cp_rank + cp * dp_rank) + n * pp_rank
//   MoE view:   world rank r = etp_rank + etp * (ep_rank + ep * edp_rank) + n * pp_rank
// with n = tp * cp * dp, the ranks of one pipeline stage: pipeline parallelism is the outermost
// dimension of both views, every other group lies within one stage. TP (and ETP) are neighbouring
// ranks, then CP / EP, so the busiest groups stay inside a node.
#pragma once

#include <memory>

#include "moefold/comm/communicator.h"
#include "moefold/parallel/parallel_config.h"

namespace moefold {

struct Mesh {
  ParallelConfig dims;  // resolved (dp filled in)
  int world_rank = 0;
  int tp_rank = 0, cp_rank = 0, dp_rank = 0;    // dense view
  int etp_rank = 0, ep_rank = 0, edp_rank = 0;  // MoE view
  int pp_rank = 0;                              // the pipeline stage

  Communicator* world = nullptr;                    // not owned
  std::unique_ptr<Communicator> tp, cp, dp, dp_cp;  // dense groups; dp_cp reduces TP-sharded gradients
  std::unique_ptr<Communicator> tp_cp;              // the ranks splitting one micro-batch's tokens
  std::unique_ptr<Communicator> dense;              // DP x CP x TP: reduces replicated gradients
  std::unique_ptr<Communicator> etp, ep, edp;       // MoE groups; edp reduces expert gradients
  std::unique_ptr<Communicator> ep_etp;             // the ranks whose expert shards are disjoint
  // Pipeline: the stages at this rank's place within a stage (pp ranks); the pairs of neighbouring
  // stages (stage 2k with 2k + 1, and 2k + 1 with 2k + 2; a stage without a partner there is alone);
  // the first and the last stage (the embedding's copies, with multi-token prediction).
  std::unique_ptr<Communicator> pp, pp_even, pp_odd, pp_ends;
  // The pair with the next / previous stage (null for the last / first stage).
  Communicator* pp_next() const;
  Communicator* pp_prev() const;
  bool first_stage() const { return pp_rank == 0; }
  bool last_stage() const { return pp_rank + 1 == dims.pp; }

  // Collective over `world`. REQUIRES: dims resolved for world->size() ranks.
  static Mesh build(Communicator& world, const ParallelConfig& dims);
  // The mesh world rank `rank` of dims.world() ranks would have, without a world: every group
  // knows its size and this rank's place (as build() would split them) and refuses to
  // communicate (moefold plan binds a model on it). REQUIRES: dims resolved.
  static Mesh plan(const ParallelConfig& dims, int rank);

  std::unique_ptr<Communicator> owned_world;  // plan(): the shape-only world
};

}  // namespace moefold
