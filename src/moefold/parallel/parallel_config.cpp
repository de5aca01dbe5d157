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
  if (pp != 1) MF_FAIL("parallel.pp = ", pp, ": pipeline parallelism is not implemented yet (use 1)");
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
