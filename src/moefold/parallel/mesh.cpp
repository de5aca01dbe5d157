#include "moefold/parallel/mesh.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

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

namespace {

// The node of every world rank from the host of every world rank: hosts in the order of their
// lowest rank, each cut into nodes of ranks_per_node consecutive ranks of it (0: one node).
std::vector<int> nodes_of(const std::vector<std::string>& hosts, int64_t ranks_per_node) {
  std::map<std::string, int> seen;  // host -> ranks of it so far
  std::map<std::pair<std::string, int64_t>, int> ids;
  std::vector<int> node(hosts.size());
  for (size_t r = 0; r < hosts.size(); ++r) {
    const int i = seen[hosts[r]]++;
    const std::pair<std::string, int64_t> key{hosts[r], ranks_per_node > 0 ? i / ranks_per_node : 0};
    const auto it = ids.emplace(key, static_cast<int>(ids.size())).first;
    node[r] = it->second;
  }
  if (ranks_per_node > 0)
    for (const auto& [host, n] : seen)
      if (n % ranks_per_node != 0)
        MF_FAIL("parallel.ranks_per_node = ", ranks_per_node, " does not divide the ", n, " ranks on host '", host,
                "'");
  return node;
}

// The (color, key) of this rank's ep_node and ep_rail groups, the nodes its EP group spans, and
// whether the group lies on them in equal blocks of consecutive EP ranks (else why not).
struct EpTopology {
  std::pair<int, int> node_split, rail_split;
  int nodes = 1;
  std::string irregular;
};
EpTopology ep_topology(const ParallelConfig& d, const std::vector<int>& node, int world_rank) {
  const int world = static_cast<int>(d.world()), ep = static_cast<int>(d.ep), etp = static_cast<int>(d.etp);
  const int n = world / static_cast<int>(d.pp), s = world_rank / n;
  const Coords c = coords_of(d, world_rank);
  std::vector<int> member_node(static_cast<size_t>(ep));  // node of EP rank j of this rank's group
  for (int j = 0; j < ep; ++j)
    member_node[static_cast<size_t>(j)] = node[static_cast<size_t>(s * n + c.etp_rank + etp * (j + ep * c.edp_rank))];
  EpTopology t;
  // Blocks of consecutive EP ranks on one node; regular when they are all as long and no node
  // appears in two blocks.
  std::vector<int> block_of(static_cast<size_t>(ep)), block_start;
  for (int j = 0; j < ep; ++j) {
    if (j == 0 || member_node[j] != member_node[j - 1]) block_start.push_back(j);
    block_of[static_cast<size_t>(j)] = static_cast<int>(block_start.size()) - 1;
  }
  const int blocks = static_cast<int>(block_start.size());
  std::map<int, int> blocks_on;
  for (int b = 0; b < blocks; ++b) ++blocks_on[member_node[static_cast<size_t>(block_start[b])]];
  t.nodes = static_cast<int>(blocks_on.size());
  const int per = ep / blocks;
  for (const auto& [nd, k] : blocks_on)
    if (k > 1) t.irregular = "node " + std::to_string(nd) + " holds EP ranks that are not consecutive";
  if (t.irregular.empty() && per * blocks != ep)
    t.irregular = std::to_string(ep) + " EP ranks on " + std::to_string(blocks) + " nodes unevenly";
  for (int b = 0; t.irregular.empty() && b < blocks; ++b) {
    const int end = b + 1 < blocks ? block_start[b + 1] : ep;
    if (end - block_start[b] != per)
      t.irregular = "node " + std::to_string(member_node[block_start[b]]) + " holds " +
                    std::to_string(end - block_start[b]) + " of the EP group's ranks, another " + std::to_string(per);
  }
  const int b = block_of[static_cast<size_t>(c.ep_rank)];
  const int ep_color = c.split[7].first;  // the EP group's (kGroupSpecs: "ep")
  t.node_split = {ep_color * world + member_node[static_cast<size_t>(c.ep_rank)], c.ep_rank};
  t.rail_split = {ep_color * world + (c.ep_rank - block_start[static_cast<size_t>(b)]), c.ep_rank};
  return t;
}

void set_nodes(Mesh& m, const std::vector<int>& node, int world_rank) {
  m.node = node[static_cast<size_t>(world_rank)];
  m.num_nodes = 0;
  for (const int x : node) m.num_nodes = std::max(m.num_nodes, x + 1);
  m.ep_nodes = ep_topology(m.dims, node, world_rank).nodes;
  // Every EP group's, so that every rank refuses a hierarchical dispatch alike.
  m.ep_nodes_irregular.clear();
  for (int q = 0; q < static_cast<int>(node.size()) && m.ep_nodes_irregular.empty(); ++q)
    m.ep_nodes_irregular = ep_topology(m.dims, node, q).irregular;
}

}  // namespace

Mesh Mesh::build(Communicator& world, const ParallelConfig& d, bool ep_hierarchy) {
  MF_CHECK(d.world() == world.size(), "mesh for ", d.world(), " ranks built on a world of ", world.size());
  Mesh m;
  m.dims = d;
  m.world = &world;
  const int r = world.rank();
  const Coords c = coords_of(d, r);
  set_ranks(m, c, r);
  for (int g = 0; g < groups_of(d); ++g)
    m.*kGroupSpecs[g].member = world.split(c.split[g].first, c.split[g].second, kGroupSpecs[g].name);
  // Every rank's host name (64 bytes: longer names are cut, as HOST_NAME_MAX allows).
  constexpr int64_t kHostBytes = 64;
  std::vector<char> host(static_cast<size_t>(kHostBytes), 0), all(static_cast<size_t>(kHostBytes * world.size()));
  gethostname(host.data(), host.size() - 1);
  world.all_gather(Tensor(host.data(), DType::u8, {1, kHostBytes}),
                   Tensor(all.data(), DType::u8, {static_cast<int64_t>(world.size()), kHostBytes}));
  std::vector<std::string> hosts;
  for (int q = 0; q < world.size(); ++q)
    hosts.emplace_back(all.data() + q * kHostBytes, strnlen(all.data() + q * kHostBytes, kHostBytes));
  const std::vector<int> node = nodes_of(hosts, d.ranks_per_node);
  set_nodes(m, node, r);
  if (ep_hierarchy && d.ep > 1) {
    const EpTopology t = ep_topology(d, node, r);
    m.ep_node = world.split(t.node_split.first, t.node_split.second, "ep_node");
    m.ep_rail = world.split(t.rail_split.first, t.rail_split.second, "ep_rail");
  }
  return m;
}

Mesh Mesh::plan(const ParallelConfig& d, int rank, bool ep_hierarchy) {
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
  std::vector<int> node(static_cast<size_t>(n));
  for (int q = 0; q < n; ++q)
    node[static_cast<size_t>(q)] = d.ranks_per_node > 0 ? q / static_cast<int>(d.ranks_per_node) : 0;
  if (d.ranks_per_node > 0 && n % d.ranks_per_node != 0)
    MF_FAIL("parallel.ranks_per_node = ", d.ranks_per_node, " does not divide the ", n, " ranks");
  set_nodes(m, node, rank);
  if (ep_hierarchy && d.ep > 1) {  // sizes and places as build() would split them
    const EpTopology mine = ep_topology(d, node, rank);
    int node_size = 0, node_below = 0, rail_size = 0, rail_below = 0;
    for (int q = 0; q < n; ++q) {
      const EpTopology t = ep_topology(d, node, q);
      if (t.node_split.first == mine.node_split.first) {
        ++node_size;
        node_below += t.node_split.second < mine.node_split.second;
      }
      if (t.rail_split.first == mine.rail_split.first) {
        ++rail_size;
        rail_below += t.rail_split.second < mine.rail_split.second;
      }
    }
    m.ep_node = std::make_unique<ShapeCommunicator>("ep_node", node_below, node_size);
    m.ep_rail = std::make_unique<ShapeCommunicator>("ep_rail", rail_below, rail_size);
  }
  return m;
}

}  // namespace moefold
