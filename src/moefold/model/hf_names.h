// The parameter table under Hugging Face names. Experts are stored fused for the grouped GEMM
// ("<mlp>.experts.gate_up_proj" [E, 2F, H] with gate and up rows interleaved, see experts.h;
// "<mlp>.experts.down_proj" [E, H, F]); on disk they are the per-expert tensors of the Hub
// checkpoints ("<mlp>.experts.{e}.gate_proj.weight" ...; Mixtral:
// "<layer>.block_sparse_moe.experts.{e}.w1.weight" (gate), w3 (up), w2 (down)).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "moefold/core/memory.h"

namespace moefold {

struct NamedView {
  std::string name;
  // A view into the parameter (or its gradient), on the parameter's device. NOT always
  // contiguous: expert gate and up weights are every other row of gate_up_proj (rows
  // contiguous, row pitch 2H; Tensor::copy_from takes such views). Files read and write it
  // through contiguous_host / write_through_host.
  Tensor value;
  // Expert tensor parallelism: the view holds [offset, offset + value.size(dim)) of dimension
  // `dim` (of size global_size) of the Hugging Face tensor; dim = -1: the whole tensor.
  int dim = -1;
  int64_t offset = 0;
  int64_t global_size = 0;
};

// The Hugging Face tensors that make up parameter `p` (one view, or 2E / E views for experts;
// expert indices are global, from p.shard_offset). `of` is p.value, p.grad or any tensor shaped
// like them (e.g. an optimizer moment), cut and named the same way: an expert's gate_proj is
// the even rows of its [2F, H] block of gate_up_proj, up_proj the odd rows. Under expert tensor
// parallelism each view is a slice of its tensor along the FFN dimension (NamedView::dim).
std::vector<NamedView> hf_views(const Param& p, const Tensor& of);
inline std::vector<NamedView> hf_views(const Param& p) { return hf_views(p, p.value); }

// What file readers and writers (safetensors: contiguous host tensors) make of a view that may
// be row-strided or on the GPU. contiguous_host: t itself when it is contiguous host memory,
// else a contiguous host copy kept in a new element of `storage` (floats, as many as t's bytes
// need: any dtype). write_through_host: `write` fills a contiguous host tensor of dst's shape
// and dtype (dst itself when it is one), which is then copied into dst.
Tensor contiguous_host(const Tensor& t, std::vector<std::vector<float>>& storage);
void write_through_host(const Tensor& dst, const std::function<void(const Tensor& host)>& write);

}  // namespace moefold
