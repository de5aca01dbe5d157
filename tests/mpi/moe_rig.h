// A MoE layer bound to its own planned Memory (both binding passes), and the token blocks and
// comparisons the multi-rank MoE tests share.
#pragma once

#include <algorithm>
#include <memory>
#include <string>

#include "moefold/comm/communicator.h"
#include "moefold/core/memory.h"
#include "moefold/core/rng.h"
#include "moefold/moe/moe_layer.h"
#include "testing.h"

namespace moefold::testing {

struct MoeRig {
  Memory mem{DType::f64};
  MoeLayer layer;
  // d: the dispatcher (null: LocalDispatcher).
  MoeRig(const MoeConfig& cfg, int64_t hidden, int64_t max_t, const std::string& prefix, std::unique_ptr<Dispatcher> d)
      : layer(d ? MoeLayer(cfg, hidden, max_t, prefix, std::move(d)) : MoeLayer(cfg, hidden, max_t, prefix)),
        prefix_(prefix) {
    mem.bind_twice([&] { layer.bind(mem); });
  }
  const Param& param(const std::string& suffix) const { return *mem.find(prefix_ + suffix); }

 private:
  std::string prefix_;
};

// The layer the multi-rank MoE tests run: hidden 6, parameters under model.layers.0.mlp (its
// routed experts' weights: kRigExpertParams); LocalDispatcher when d is null.
inline const std::string kRigPrefix = "model.layers.0.mlp";
inline const char* const kRigExpertParams[] = {".experts.gate_up_proj", ".experts.down_proj"};
inline constexpr int64_t kRigHidden = 6;
struct Rig : MoeRig {
  Rig(const MoeConfig& cfg, int64_t max_t, std::unique_ptr<Dispatcher> d)
      : MoeRig(cfg, kRigHidden, max_t, kRigPrefix, std::move(d)) {}
};

// Token block of rank b: its size differs per rank (so capacities differ too), its values are
// drawn from (seed, b), so any rank can build any block.
inline int64_t block_tokens(int b) { return 5 + 3 * b; }

struct Block {
  Tensor x, dy;
};
inline Block draw_block(Pool& pool, uint64_t seed, int b, int64_t hidden, bool biased, int64_t shift) {
  const int64_t t_n = block_tokens(b) - shift;
  Block blk{pool.zeros({t_n, hidden}), pool.zeros({t_n, hidden})};
  // Biased routers need inputs of positive mean (logit_e moves by bias_e * sum_h x_h).
  if (biased)
    fill_uniform(blk.x, seed, 1000 + 10 * shift + b, 0.5, 1.5);
  else
    fill_normal(blk.x, seed, 1000 + 10 * shift + b, 0.0, 1.0);
  fill_normal(blk.dy, seed, 2000 + 10 * shift + b, 0.0, 1.0);
  return blk;
}

inline double rel_err(const Tensor& got, const Tensor& want) {
  return max_abs_diff(got, want) / std::max(1.0, max_abs(want));
}

inline int64_t sum_all(Communicator& comm, int64_t v) {
  comm.all_reduce(Tensor(&v, DType::i64, {1}), ReduceOp::sum);
  return v;
}

}  // namespace moefold::testing
