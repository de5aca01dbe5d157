// Recomputation changes nothing (test_train.cpp on the CPU in f64 and f32, test_train_cuda.cpp on
// the GPU, test_train_layouts.cpp under every layout): each train.recompute_modules entry alone,
// all of them together, and whole layers (uniform chunks of 1 and 2, block of 1, block with every
// module), and the shared experts on a context of their own, give the run without recomputation's
// losses and gradient norms bit for bit, step after step, and then the same master weights. The recomputed forward runs
// the same ops on the same inputs, so the bits are the same wherever the forward ops are deterministic.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moefold/core/device.h"
#include "moefold/train/trainer.h"

namespace moefold::testing {

struct RecomputeVariant {
  std::string name;
  std::vector<std::string> modules;
  int64_t num_layers = 0;
  std::string method = "uniform";
  std::vector<std::string> offload;  // train.offload_modules (GPU)
  bool overlap = false;              // parallel.overlap_moe_a2a
  bool shared_overlap = false;       // moe.shared_expert_overlap (where there are shared experts and no TP)
};

// every: each module alone too (else only the combinations).
inline std::vector<RecomputeVariant> recompute_variants(bool every = true) {
  const std::vector<std::string> all = {"layernorm",      "core_attn", "mla_up_proj", "moe_act",
                                        "shared_experts", "moe",       "mlp"};
  std::vector<RecomputeVariant> v;
  if (every)
    for (const std::string& m : all) v.push_back({m, {m}, 0, "uniform", {}});
  v.push_back({"every module", all, 0, "uniform", {}});
  v.push_back({"whole layers, uniform 1", {}, 1, "uniform", {}});
  v.push_back({"whole layers, uniform 2", {}, 2, "uniform", {}});
  v.push_back({"whole layers, block 1, every module", all, 1, "block", {}});
  // The forward of one micro-batch interleaved with the backward of another, in their phases, alone
  // and with the modules that recompute within one phase.
  v.push_back({"overlap_moe_a2a", {}, 0, "uniform", {}, true});
  v.push_back({"overlap_moe_a2a, core_attn, mla_up_proj, moe_act, shared_experts, mlp",
               {"core_attn", "mla_up_proj", "moe_act", "shared_experts", "mlp"},
               0,
               "uniform",
               {},
               true});
  // The shared experts on their own context (moe.shared_expert_overlap): alone, recomputed, in
  // whole recomputed layers and in the phases of overlap_moe_a2a.
  v.push_back({"shared_expert_overlap", {}, 0, "uniform", {}, false, true});
  v.push_back({"shared_expert_overlap, shared_experts, layernorm",
               {"shared_experts", "layernorm"},
               0,
               "uniform",
               {},
               false,
               true});
  v.push_back({"shared_expert_overlap, whole layers, uniform 1", {}, 1, "uniform", {}, false, true});
  v.push_back({"shared_expert_overlap, overlap_moe_a2a", {}, 0, "uniform", {}, true, true});
  return v;
}

// Activation offload (GPU): each module alone, all together, and all with every recompute module.
inline std::vector<RecomputeVariant> offload_variants() {
  const std::vector<std::string> all = {"attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                        "mlp_norm",  "expert_fc1", "moe_act"};
  std::vector<RecomputeVariant> v;
  for (const std::string& m : all) v.push_back({"offload " + m, {}, 0, "uniform", {m}});
  v.push_back({"offload every module", {}, 0, "uniform", all});
  v.push_back({"offload every module, recompute every module",
               {"layernorm", "core_attn", "mla_up_proj", "moe_act", "shared_experts", "moe", "mlp"},
               0,
               "uniform",
               all});
  // Whole layers recomputed (the first one or two) keep only their input; the others offload.
  v.push_back({"offload every module, block 1", {}, 1, "block", all});
  v.push_back({"offload every module, block 2 + every module recomputed",
               {"layernorm", "core_attn", "mla_up_proj", "moe_act", "shared_experts", "moe", "mlp"},
               2,
               "block",
               all});
  v.push_back({"offload every module, uniform 2 (nothing left to offload)", {}, 2, "uniform", all});
  v.push_back({"offload every module, shared_expert_overlap", {}, 0, "uniform", all, false, true});
  return v;
}

inline Config with_recompute(Config c, const RecomputeVariant& v) {
  c.train.recompute_modules = v.modules;
  c.train.recompute_num_layers = v.num_layers;
  c.train.recompute_method = v.method;
  c.train.offload_modules = v.offload;
  c.parallel.overlap_moe_a2a = v.overlap;
  c.moe.shared_expert_overlap = v.shared_overlap && c.moe.n_shared_experts > 0 && c.parallel.tp <= 1;
  c.validate();
  return c;
}

inline std::vector<uint8_t> value_bytes(const Tensor& t) {
  std::vector<uint8_t> out(t.nbytes());
  device_copy(out.data(), Device::cpu, t.data(), t.device(), out.size());
  return out;
}

// make: a trainer of a config, initialised (init_fresh) the same way each time.
inline void expect_recompute_changes_nothing(const Config& base,
                                             const std::function<std::unique_ptr<Trainer>(const Config&)>& make,
                                             const std::vector<RecomputeVariant>& variants, int steps = 3) {
  std::unique_ptr<Trainer> ref = make(base);
  std::vector<double> want;
  for (int i = 0; i < steps; ++i) {
    const StepMetrics m = ref->train_step();
    want.push_back(m.loss);
    want.push_back(m.grad_norm);
  }
  for (const RecomputeVariant& v : variants) {
    SCOPED_TRACE(v.name);
    std::unique_ptr<Trainer> t = make(with_recompute(base, v));
    std::vector<double> got;
    for (int i = 0; i < steps; ++i) {
      const StepMetrics m = t->train_step();
      got.push_back(m.loss);
      got.push_back(m.grad_norm);
    }
    EXPECT_EQ(got, want) << "losses and gradient norms, step by step";
    for (const Param& p : t->params()) {
      const Param* r = ref->memory().find(p.name);
      ASSERT_NE(r, nullptr) << p.name;
      EXPECT_TRUE(value_bytes(p.value) == value_bytes(r->value)) << p.name << ": master weights differ";
    }
  }
}

}  // namespace moefold::testing
