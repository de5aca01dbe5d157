#include "moefold/parallel/mesh.h"

#include "moefold/core/error.h"

namespace moefold {

Mesh Mesh::build(Communicator& world, const ParallelConfig& d) {
  MF_CHECK(d.world() == world.size(), "mesh for ", d.world(), " ranks built on a world of ", world.size());
  Mesh m;
  m.dims = d;
  m.world = &world;
  const int r = world.rank();
  const int tp = static_cast<int>(d.tp), cp = static_cast<int>(d.cp), etp = static_cast<int>(d.etp),
            ep = static_cast<int>(d.ep);
  m.world_rank = r;
  m.tp_rank = r % tp;
  m.cp_rank = r / tp % cp;
  m.dp_rank = r / (tp * cp);
  m.etp_rank = r % etp;
  m.ep_rank = r / etp % ep;
  m.edp_rank = r / (etp * ep);
  // split(color, key): ranks sharing every other coordinate form one group, ordered by their own.
  m.tp = world.split(m.dp_rank * cp + m.cp_rank, m.tp_rank, "tp");
  m.cp = world.split(m.dp_rank * tp + m.tp_rank, m.cp_rank, "cp");
  m.dp = world.split(m.cp_rank * tp + m.tp_rank, m.dp_rank, "dp");
  m.dp_cp = world.split(m.tp_rank, m.dp_rank * cp + m.cp_rank, "dp_cp");
  m.tp_cp = world.split(m.dp_rank, m.cp_rank * tp + m.tp_rank, "tp_cp");
  m.dense = world.split(0, r, "dense");
  m.etp = world.split(m.edp_rank * ep + m.ep_rank, m.etp_rank, "etp");
  m.ep = world.split(m.edp_rank * etp + m.etp_rank, m.ep_rank, "ep");
  m.edp = world.split(m.ep_rank * etp + m.etp_rank, m.edp_rank, "edp");
  m.ep_etp = world.split(m.edp_rank, m.ep_rank * etp + m.etp_rank, "ep_etp");
  return m;
}

}  // namespace moefold
