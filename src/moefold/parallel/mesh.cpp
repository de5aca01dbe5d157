#include "moefold/parallel/mesh.h"

#include <array>
#include <limits>
#include <string>

#include "moefold/core/error.h"

namespace moefold {

namespace {

// Each group of the mesh as split(color, key) builds it: ranks sharing every other coordinate
// form one group, ordered by their own. One table for build() and plan().
struct GroupSpec {
  const char* name;
  std::unique_ptr<Communicator> Mesh::*member;
};
constexpr int kGroups = 18;
constexpr std::array<GroupSpec, kGroups> kGroupSpecs = {{{"tp", &Mesh::tp},
                                                         {"cp", &Mesh::cp},
                                                         {"dp", &Mesh::dp},
                                                         {"dp_cp", &Mesh::dp_cp},
                                                         {"tp_cp", &Mesh::tp_cp},
                                                         {"dense", &Mesh::dense},
                                                         {"etp", &Mesh::etp},
                                                         {"ep", &Mesh::ep},
                                                         {"edp", &Mesh::edp},
                                                         {"ep_etp", &Mesh::ep_etp},
                                                         {"pp", &Mesh::pp},
                                                         {"pp_ends", &Mesh::pp_ends},
                                                         {"pp_link_f0", &Mesh::pp_link_f0},
                                                         {"pp_link_f1", &Mesh::pp_link_f1},
                                                         {"pp_link_f2", &Mesh::pp_link_f2},
                                                         {"pp_link_b0", &Mesh::pp_link_b0},
                                                         {"pp_link_b1", &Mesh::pp_link_b1},
                                                         {"pp_link_b2", &Mesh::pp_link_b2}}};

// The groups a layout has: the pipeline's (from "pp" on) only with pp > 1.
int groups_of(const ParallelConfig& d) { return d.pp > 1 ? kGroups : 10; }

// The round of link l (stage l to l + 1 mod pp): even links, odd links, and for an odd pp the last.
int link_round(int l, int pp) { return pp % 2 == 1 && l == pp - 1 ? 2 : l % 2; }

// The coordinates of world rank r and the (color, key) of each of its groups, in kGroupSpecs order.
struct Coords {
  int tp_rank, cp_rank, dp_rank, etp_rank, ep_rank, edp_rank, pp_rank;
  std::array<std::pair<int, int>, kGroups> split;
};
Coords coords_of(const ParallelConfig& d, int world_rank) {
  const int tp = static_cast<int>(d.tp), cp = static_cast<int>(d.cp), etp = static_cast<int>(d.etp),
            ep = static_cast<int>(d.ep), pp = static_cast<int>(d.pp);
  // Within the stage: rank r of n; the groups of the stage get colors of their own (s * n + ...).
  const int n = static_cast<int>(d.world() / d.pp), s = world_rank / n, r = world_rank % n;
  Coords c{};
  c.pp_rank = s;
  c.tp_rank = r % tp;
  c.cp_rank = r / tp % cp;
  c.dp_rank = r / (tp * cp);
  c.etp_rank = r % etp;
  c.ep_rank = r / etp % ep;
  c.edp_rank = r / (etp * ep);
  c.split = {{{c.dp_rank * cp + c.cp_rank, c.tp_rank},
              {c.dp_rank * tp + c.tp_rank, c.cp_rank},
              {c.cp_rank * tp + c.tp_rank, c.dp_rank},
              {c.tp_rank, c.dp_rank * cp + c.cp_rank},
              {c.dp_rank, c.cp_rank * tp + c.tp_rank},
              {0, r},
              {c.edp_rank * ep + c.ep_rank, c.etp_rank},
              {c.edp_rank * etp + c.etp_rank, c.ep_rank},
              {c.ep_rank * etp + c.etp_rank, c.edp_rank},
              {c.edp_rank, c.ep_rank * etp + c.etp_rank},
              {r, s},
              {s == 0 || s == pp - 1 ? r : n + world_rank, s}}};
  for (int g = 0; g < 10; ++g) c.split[g].first += s * n;  // the stage's own groups
  // The links: round R's communicator joins stage l (key 0) and l + 1 (key 1) for each link l of R.
  for (int round = 0; round < 3; ++round) {
    std::pair<int, int> split{n * pp + world_rank, 0};  // alone
    const int prev = (s + pp - 1) % pp;
    if (pp > 1 && link_round(s, pp) == round) split = {r + n * s, 0};
    if (pp > 1 && link_round(prev, pp) == round) split = {r + n * prev, 1};
    c.split[12 + round] = c.split[15 + round] = split;
  }
  return c;
}

void set_ranks(Mesh& m, const Coords& c, int r) {
  m.world_rank = r;
  m.tp_rank = c.tp_rank;
  m.cp_rank = c.cp_rank;
  m.dp_rank = c.dp_rank;
  m.etp_rank = c.etp_rank;
  m.ep_rank = c.ep_rank;
  m.edp_rank = c.edp_rank;
  m.pp_rank = c.pp_rank;
}

// A group that only knows its shape (Mesh::plan): any communication is a programming error.
class ShapeCommunicator final : public Communicator {
 public:
  ShapeCommunicator(std::string name, int rank, int size) : name_(std::move(name)), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank() const override { return rank_; }
  const std::string& name() const override { return name_; }
  double timeout_s() const override { return std::numeric_limits<double>::infinity(); }
  void all_reduce(const Tensor&, ReduceOp) override { refuse("all_reduce"); }
  void all_gather(const Tensor&, const Tensor&) override { refuse("all_gather"); }
  void reduce_scatter(const Tensor&, const Tensor&, ReduceOp) override { refuse("reduce_scatter"); }
  void all_to_all_v(const Tensor&, const int64_t*, const Tensor&, const int64_t*) override { refuse("all_to_all_v"); }
  void all_to_all(const Tensor&, const Tensor&) override { refuse("all_to_all"); }
  void broadcast(const Tensor&, int) override { refuse("broadcast"); }
  void send(const Tensor&, int, int) override { refuse("send"); }
  void recv(const Tensor&, int, int) override { refuse("recv"); }
  void barrier() override { refuse("barrier"); }
  std::unique_ptr<Communicator> split(int, int, const std::string&) override { refuse("split"); }

 private:
  [[noreturn]] void refuse(const char* op) const {
    MF_FAIL(op, " on the planning group '", name_, "': a plan never communicates");
  }
  std::string name_;
  int rank_, size_;
};

}  // namespace

namespace {
// The link communicator of `round` in one direction.
Communicator* link(const Mesh& m, int round, bool activations) {
  const std::unique_ptr<Communicator>* f[] = {&m.pp_link_f0, &m.pp_link_f1, &m.pp_link_f2};
  const std::unique_ptr<Communicator>* b[] = {&m.pp_link_b0, &m.pp_link_b1, &m.pp_link_b2};
  return (activations ? f : b)[round]->get();
}
}  // namespace

Communicator* Mesh::activations_out() const {
  const int pp = static_cast<int>(dims.pp);
  return pp == 1 ? nullptr : link(*this, link_round(pp_rank, pp), true);
}
Communicator* Mesh::activations_in() const {
  const int pp = static_cast<int>(dims.pp);
  return pp == 1 ? nullptr : link(*this, link_round((pp_rank + pp - 1) % pp, pp), true);
}
Communicator* Mesh::grads_out() const {
  const int pp = static_cast<int>(dims.pp);
  return pp == 1 ? nullptr : link(*this, link_round((pp_rank + pp - 1) % pp, pp), false);
}
Communicator* Mesh::grads_in() const {
  const int pp = static_cast<int>(dims.pp);
  return pp == 1 ? nullptr : link(*this, link_round(pp_rank, pp), false);
}

Mesh Mesh::build(Communicator& world, const ParallelConfig& d) {
  MF_CHECK(d.world() == world.size(), "mesh for ", d.world(), " ranks built on a world of ", world.size());
  Mesh m;
  m.dims = d;
  m.world = &world;
  const int r = world.rank();
  const Coords c = coords_of(d, r);
  set_ranks(m, c, r);
  for (int g = 0; g < groups_of(d); ++g)
    m.*kGroupSpecs[g].member = world.split(c.split[g].first, c.split[g].second, kGroupSpecs[g].name);
  return m;
}

Mesh Mesh::plan(const ParallelConfig& d, int rank) {
  const int n = static_cast<int>(d.world());
  MF_CHECK(0 <= rank && rank < n, "Mesh::plan: rank ", rank, " of ", n);
  Mesh m;
  m.dims = d;
  m.owned_world = std::make_unique<ShapeCommunicator>("world", rank, n);
  m.world = m.owned_world.get();
  const Coords c = coords_of(d, rank);
  set_ranks(m, c, rank);
  // Each group's size and this rank's place in it, as split would order them.
  for (int g = 0; g < groups_of(d); ++g) {
    int size = 0, below = 0;
    for (int q = 0; q < n; ++q) {
      const std::pair<int, int> s = coords_of(d, q).split[g];
      if (s.first != c.split[g].first) continue;
      ++size;
      if (s.second < c.split[g].second || (s.second == c.split[g].second && q < rank)) ++below;
    }
    m.*kGroupSpecs[g].member = std::make_unique<ShapeCommunicator>(kGroupSpecs[g].name, below, size);
  }
  return m;
}

}  // namespace moefold
