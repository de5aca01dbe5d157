// A MoE layer bound to its own planned Memory (both binding passes), for the multi-rank MoE tests.
#pragma once

#include <memory>
#include <string>

#include "moefold/core/memory.h"
#include "moefold/moe/moe_layer.h"

namespace moefold::testing {

struct MoeRig {
  Memory mem{DType::f64};
  MoeLayer layer;
  // d: the dispatcher (null: LocalDispatcher).
  MoeRig(const MoeConfig& cfg, int64_t hidden, int64_t max_t, const std::string& prefix, std::unique_ptr<Dispatcher> d)
      : layer(d ? MoeLayer(cfg, hidden, max_t, prefix, std::move(d)) : MoeLayer(cfg, hidden, max_t, prefix)),
        prefix_(prefix) {
    layer.bind(mem);
    mem.allocate();
    layer.bind(mem);
    mem.finish_binding();
  }
  const Param& param(const std::string& suffix) const { return *mem.find(prefix_ + suffix); }

 private:
  std::string prefix_;
};

}  // namespace moefold::testing
