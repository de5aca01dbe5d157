#include "moefold/model/hf_names.h"

namespace moefold {

namespace {
bool strip_suffix(const std::string& s, const std::string& suffix, std::string* prefix) {
  if (!s.ends_with(suffix)) return false;
  *prefix = s.substr(0, s.size() - suffix.size());
  return true;
}

bool on_host_contiguous(const Tensor& t) { return t.device() == Device::cpu && t.contiguous(); }

// A contiguous host tensor of t's dtype and shape in a new element of `storage`.
Tensor host_buffer(const Tensor& t, std::vector<std::vector<float>>& storage) {
  return Tensor(storage.emplace_back((t.nbytes() + sizeof(float) - 1) / sizeof(float)).data(), t.dtype(), t.shape());
}
}  // namespace

std::vector<NamedView> hf_views(const Param& p, const Tensor& of) {
  MF_CHECK(of.shape() == p.value.shape(), p.name, ": ", of.str(), " vs ", p.value.str());
  std::string mlp;
  std::vector<NamedView> out;
  // Mixtral's experts ("<layer>.block_sparse_moe.experts.{e}"): w1 gate, w3 up, w2 down.
  const bool mixtral = p.name.find(".block_sparse_moe.") != std::string::npos;
  const char* gate = mixtral ? ".w1.weight" : ".gate_proj.weight";
  const char* up = mixtral ? ".w3.weight" : ".up_proj.weight";
  const char* down = mixtral ? ".w2.weight" : ".down_proj.weight";
  if (strip_suffix(p.name, ".experts.gate_up_proj", &mlp)) {
    const int64_t e = of.size(0), f2 = of.size(1), h = of.size(2);
    for (int64_t i = 0; i < e; ++i) {
      Tensor w = of.slice(i, i + 1).view({f2, h});
      const int64_t g = p.shard_offset + i;       // global expert index
      const bool sharded = p.dim_shard.dim == 1;  // rows of gate and of up split over ETP
      const int dim = sharded ? 0 : -1;
      const int64_t offset = sharded ? p.dim_shard.offset : 0, whole = sharded ? p.dim_shard.global_size : f2 / 2;
      out.push_back({cat(mlp, ".experts.", g, gate), w.step_rows(0, 2), dim, offset, whole});  // rows 2j
      out.push_back({cat(mlp, ".experts.", g, up), w.step_rows(1, 2), dim, offset, whole});    // rows 2j + 1
    }
  } else if (strip_suffix(p.name, ".experts.down_proj", &mlp)) {
    const int64_t e = of.size(0), h = of.size(1), f = of.size(2);
    const bool sharded = p.dim_shard.dim == 2;  // columns split over ETP
    for (int64_t i = 0; i < e; ++i)
      out.push_back({cat(mlp, ".experts.", p.shard_offset + i, down), of.slice(i, i + 1).view({h, f}), sharded ? 1 : -1,
                     sharded ? p.dim_shard.offset : 0, sharded ? p.dim_shard.global_size : f});
  } else if (p.dim_shard.dim == 1 && of.ndim() == 2) {  // tensor parallelism: columns (row-parallel)
    out.push_back({p.name, of, 1, p.dim_shard.offset, p.dim_shard.global_size});
  } else if (p.global_rows != of.size(0)) {  // tensor parallelism: rows (column-parallel, vocabulary)
    out.push_back({p.name, of, 0, p.shard_offset, p.global_rows});
  } else {
    out.push_back({p.name, of});
  }
  return out;
}

Tensor contiguous_host(const Tensor& t, std::vector<std::vector<float>>& storage) {
  if (on_host_contiguous(t)) return t;
  const Tensor copy = host_buffer(t, storage);
  copy.copy_from(t);
  return copy;
}

void write_through_host(const Tensor& dst, const std::function<void(const Tensor& host)>& write) {
  if (on_host_contiguous(dst)) return write(dst);
  std::vector<std::vector<float>> storage;
  const Tensor host = host_buffer(dst, storage);
  write(host);
  dst.copy_from(host);
}

}  // namespace moefold
