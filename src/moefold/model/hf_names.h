// The parameter table under Hugging Face names. Experts are stored fused for the grouped GEMM
// ("<mlp>.experts.gate_up_proj" [E, 2F, H], "<mlp>.experts.down_proj" [E, H, F]); on disk they
// are the per-expert tensors of the Hub checkpoints ("<mlp>.experts.{e}.gate_proj.weight" ...;
// Mixtral: "<layer>.block_sparse_moe.experts.{e}.w1.weight" (gate), w3 (up), w2 (down)).
#pragma once

#include <string>
#include <vector>

#include "moefold/core/memory.h"

namespace moefold {

struct NamedView {
  std::string name;
  Tensor value;  // a view into the parameter (or its gradient)
  // Expert tensor parallelism: the view holds [offset, offset + value.size(dim)) of dimension
  // `dim` (of size global_size) of the Hugging Face tensor; dim = -1: the whole tensor.
  int dim = -1;
  int64_t offset = 0;
  int64_t global_size = 0;
};

// The Hugging Face tensors that make up parameter `p` (one view, or 2E / E views for experts;
// expert indices are global, from p.shard_offset). `of` is p.value, p.grad or any tensor shaped
// like them (e.g. an optimizer moment), cut and named the same way. Under expert tensor
// parallelism each view is a slice of its tensor along the FFN dimension (NamedView::dim).
std::vector<NamedView> hf_views(const Param& p, const Tensor& of);
inline std::vector<NamedView> hf_views(const Param& p) { return hf_views(p, p.value); }

}  // namespace moefold
