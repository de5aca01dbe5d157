#include "moefold/model/hf_names.h"

namespace moefold {

namespace {
bool strip_suffix(const std::string& s, const std::string& suffix, std::string* prefix) {
  if (!s.ends_with(suffix)) return false;
  *prefix = s.substr(0, s.size() - suffix.size());
  return true;
}
}  // namespace

std::vector<NamedView> hf_views(const Param& p) {
  std::string mlp;
  std::vector<NamedView> out;
  if (strip_suffix(p.name, ".experts.gate_up_proj", &mlp)) {
    const int64_t e = p.value.size(0), f2 = p.value.size(1), h = p.value.size(2);
    for (int64_t i = 0; i < e; ++i) {
      Tensor w = p.value.slice(i, i + 1).view({f2, h});
      out.push_back({cat(mlp, ".experts.", i, ".gate_proj.weight"), w.slice(0, f2 / 2)});
      out.push_back({cat(mlp, ".experts.", i, ".up_proj.weight"), w.slice(f2 / 2, f2)});
    }
  } else if (strip_suffix(p.name, ".experts.down_proj", &mlp)) {
    const int64_t e = p.value.size(0), h = p.value.size(1), f = p.value.size(2);
    for (int64_t i = 0; i < e; ++i)
      out.push_back({cat(mlp, ".experts.", i, ".down_proj.weight"), p.value.slice(i, i + 1).view({h, f})});
  } else {
    out.push_back({p.name, p.value});
  }
  return out;
}

}  // namespace moefold
