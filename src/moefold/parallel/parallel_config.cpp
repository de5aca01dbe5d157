#include "moefold/parallel/parallel_config.h"

#include "moefold/core/error.h"

namespace moefold {

void ParallelConfig::validate() const {
  auto positive = [](const char* k, int64_t v) { require_positive("parallel", k, v); };
  positive("tp", tp);
  positive("cp", cp);
  positive("ep", ep);
  positive("etp", etp);
  positive("pp", pp);
  if (dp < 0) MF_FAIL("parallel.dp = ", dp, " must be >= 1 (or 0: derived from the world size)");
  if (!(timeout_s > 0)) MF_FAIL("parallel.timeout_s = ", timeout_s, " must be > 0");
  if (ep_transport != "auto" && ep_transport != "nccl" && ep_transport != "ipc")
    MF_FAIL("parallel.ep_transport = '", ep_transport, "' is not supported (auto, nccl, ipc)");
  if (pipeline_schedule != "1f1b")
    MF_FAIL("parallel.pipeline_schedule = '", pipeline_schedule, "' is not supported (1f1b)");
  positive("vpp", vpp);
  if (ranks_per_node < 0)
    MF_FAIL("parallel.ranks_per_node = ", ranks_per_node, " must be >= 1 (or 0: the ranks of one host)");
  if (vpp > 1 && pp == 1) MF_FAIL("parallel.vpp = ", vpp, " needs parallel.pp > 1 (pp = 1)");
  if (vpp > 1 && (first_stage_layers > 0 || last_stage_layers > 0))
    MF_FAIL("parallel.vpp = ", vpp,
            " with parallel.first_stage_layers / last_stage_layers is not supported (interleaved stages split the "
            "layers evenly)");
  if (overlap_moe_a2a && vpp > 1)
    MF_FAIL("parallel.overlap_moe_a2a with parallel.vpp = ", vpp, " is not supported yet (1F1B only)");
  if (first_stage_layers < 0 || last_stage_layers < 0)
    MF_FAIL("parallel.first_stage_layers = ", first_stage_layers, ", parallel.last_stage_layers = ", last_stage_layers,
            ": must be >= 0 (0: an even share)");
  if (pp == 1 && (first_stage_layers > 0 || last_stage_layers > 0))
    MF_FAIL("parallel.first_stage_layers / last_stage_layers need parallel.pp > 1 (pp = 1)");
}

std::vector<int64_t> ParallelConfig::stage_layers(int64_t layers) const {
  if (pp == 1) return {layers};
  if (vpp > 1) {  // virtual stages: an even split
    const int64_t v = pp * vpp;
    if (layers % v != 0)
      MF_FAIL("parallel: model.num_hidden_layers = ", layers,
              " does not split evenly into parallel.pp x parallel.vpp = ", pp, " x ", vpp, " = ", v, " virtual stages");
    return std::vector<int64_t>(static_cast<size_t>(v), layers / v);
  }
  const int64_t first = first_stage_layers, last = last_stage_layers;
  const int64_t even = pp - (first > 0) - (last > 0), rest = layers - first - last;
  auto fail = [&] {
    MF_FAIL("parallel: model.num_hidden_layers = ", layers, " does not split into parallel.pp = ", pp,
            " stages of at least one layer with parallel.first_stage_layers = ", first,
            " and parallel.last_stage_layers = ", last, " (the rest split evenly)");
  };
  if (rest < 0 || (even == 0 && rest != 0) || (even > 0 && (rest % even != 0 || rest / even == 0))) fail();
  std::vector<int64_t> out(static_cast<size_t>(pp), even > 0 ? rest / even : 0);
  if (first > 0) out.front() = first;
  if (last > 0) out.back() = last;
  return out;
}

ParallelConfig ParallelConfig::resolve(int64_t world) const {
  validate();
  ParallelConfig p = *this;
  const int64_t dense = pp * tp * cp;
  if (p.dp == 0) {
    if (world % dense != 0)
      MF_FAIL("parallel: world size ", world, " is not divisible by pp x tp x cp = ", pp, " x ", tp, " x ", cp, " = ",
              dense);
    p.dp = world / dense;
  }
  if (p.world() != world)
    MF_FAIL("parallel: pp x dp x cp x tp = ", pp, " x ", p.dp, " x ", cp, " x ", tp, " = ", p.world(),
            " but the world has ", world, " ranks");
  const int64_t folded = p.dp * cp * tp;
  if (folded % (ep * etp) != 0)
    MF_FAIL("parallel: ep x etp = ", ep, " x ", etp, " = ", ep * etp, " does not divide dp x cp x tp = ", p.dp, " x ",
            cp, " x ", tp, " = ", folded);
  return p;
}

}  // namespace moefold
