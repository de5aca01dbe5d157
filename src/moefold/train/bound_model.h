// A model of a config on one rank, on the CPU in f32, with its memory planned and allocated and
// [1, seq_len] i32 ids/targets buffers: what eval, convert and upcycle work with (checkpoints go
// in and out through mem.params()).
#pragma once

#include <cstdint>

#include "moefold/core/memory.h"
#include "moefold/model/config.h"
#include "moefold/model/model.h"

namespace moefold {

struct BoundModel {
  // seq_len 0: the shortest the config allows (one token, or multi-token prediction's depth + 1).
  explicit BoundModel(const Config& cfg, int64_t seq_len = 0);
  BoundModel(const BoundModel&) = delete;
  BoundModel& operator=(const BoundModel&) = delete;

  int64_t seq_len;
  Model model;
  Memory mem{DType::f32};
  Tensor ids, targets;  // i32 [1, seq_len]
};

}  // namespace moefold
