#include "moefold/train/bound_model.h"

namespace moefold {

BoundModel::BoundModel(const Config& cfg, int64_t len)
    : seq_len(len > 0 ? len : cfg.model.num_nextn_predict_layers + 1), model(cfg.model, cfg.moe, 1, seq_len) {
  auto bind = [&] {
    model.bind(mem);
    ids = mem.act({1, seq_len}, DType::i32);
    targets = mem.act({1, seq_len}, DType::i32);
  };
  mem.bind_twice(bind);
}

}  // namespace moefold
