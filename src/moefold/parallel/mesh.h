// The device mesh of parallel folding: the same world laid out twice, with every group built
// once from the world communicator and handed explicitly to whoever needs it.
//   dense view: world rank r = tp_rank + tp * (cp_rank + cp * dp_rank) + n * pp_rank
//   MoE view:   world rank r = etp_rank + etp * (ep_rank + ep * edp_rank) + n * pp_rank
// with n = tp * cp * dp, the ranks of one pipeline stage: pipeline parallelism is the outermost
// dimension of both views, every other group lies within one stage. TP (and ETP) are neighbouring
// ranks, then CP / EP, so the busiest groups stay inside a node.
#pragma once

#include <memory>
#include <string>
#include <vector>

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
  // Pipeline (null with pp = 1): the stages at this rank's place within a stage (pp ranks), and the
  // first and the last stage (the embedding's copies, with multi-token prediction).
  std::unique_ptr<Communicator> pp, pp_ends;
  // The links of the pipeline ring, stage l to stage l + 1 mod pp (the last stage's to the first:
  // interleaved chunks), each direction a communicator of its own (two ranks, stage l first), so
  // that its messages match in order: activations forward (f), gradients back (b). Three rounds of
  // links (a rank is in at most one link per round): even links, odd links, and for an odd pp the
  // last one. Members of no link of a round are alone in its communicator.
  std::unique_ptr<Communicator> pp_link_f0, pp_link_f1, pp_link_f2, pp_link_b0, pp_link_b1, pp_link_b2;
  // This rank's ends of them (null with pp = 1): activations to the next stage / from the previous
  // one, gradients to the previous stage / from the next one (the peer: the other rank, 1 - rank()).
  Communicator* activations_out() const;
  Communicator* activations_in() const;
  Communicator* grads_out() const;
  Communicator* grads_in() const;
  bool first_stage() const { return pp_rank == 0; }
  bool last_stage() const { return pp_rank + 1 == dims.pp; }

  // Nodes: the ranks sharing a host name, split into emulated nodes of dims.ranks_per_node
  // consecutive ranks where that is set; numbered in the order of their lowest world rank.
  int node = 0, num_nodes = 1;
  int ep_nodes = 1;  // the nodes this rank's EP group spans
  // With build(..., ep_hierarchy) and ep > 1 (else null): the EP ranks on this rank's node, and
  // those at this rank's place on theirs (one per node: the rail its tokens cross nodes on), both
  // ordered by EP rank. ep_nodes_irregular: empty when each node holds the same number of every EP
  // group's ranks, consecutive in EP rank (what HierarchicalDispatcher needs), else why not.
  std::unique_ptr<Communicator> ep_node, ep_rail;
  std::string ep_nodes_irregular;  // empty: regular

  // Collective over `world`. REQUIRES: dims resolved for world->size() ranks. ep_hierarchy: also
  // build ep_node and ep_rail (moe.dispatcher = "hierarchical").
  static Mesh build(Communicator& world, const ParallelConfig& dims, bool ep_hierarchy = false);
  // The mesh world rank `rank` of dims.world() ranks would have, without a world: every group
  // knows its size and this rank's place (as build() would split them) and refuses to
  // communicate (moefold plan binds a model on it). Nodes: dims.ranks_per_node consecutive ranks
  // (0: one node). REQUIRES: dims resolved.
  static Mesh plan(const ParallelConfig& dims, int rank, bool ep_hierarchy = false);

  std::unique_ptr<Communicator> owned_world;  // plan(): the shape-only world
};

}  // namespace moefold
