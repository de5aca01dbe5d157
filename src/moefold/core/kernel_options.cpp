// core/kernel_options.h: the config text of each kernel switch.
#include "moefold/core/kernel_options.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "moefold/core/error.h"

namespace moefold {

namespace {
// The value of `names` that `value` names, or nullptr.
template <class T, size_t N>
const T* find_one(const std::string& value, const std::pair<const char*, T> (&names)[N]) {
  for (const auto& [name, v] : names)
    if (value == name) return &v;
  return nullptr;
}
// "a, b, c": the accepted texts, for messages.
template <class T, size_t N>
std::string known_names(const std::pair<const char*, T> (&names)[N]) {
  std::string known;
  for (const auto& [name, v] : names) known += known.empty() ? name : cat(", ", name);
  return known;
}
// The value of `names` that `value` names, or an Error listing them.
template <class T, size_t N>
T parse_one(const std::string& value, const std::string& key, const std::pair<const char*, T> (&names)[N]) {
  if (const T* v = find_one(value, names)) return *v;
  MF_FAIL(key, " = \"", value, "\": expected one of ", known_names(names));
}
template <class T, size_t N>
const char* name_of(T v, const std::pair<const char*, T> (&names)[N]) {
  for (const auto& [name, x] : names)
    if (x == v) return name;
  return "?";
}
constexpr std::pair<const char*, GroupedGemmImpl> kGroupedGemm[] = {{"cutlass", GroupedGemmImpl::cutlass},
                                                                    {"cublaslt", GroupedGemmImpl::cublaslt}};
constexpr std::pair<const char*, Fp8DenseGemm> kFp8Dense[] = {{"cublaslt", Fp8DenseGemm::cublaslt},
                                                              {"cutlass", Fp8DenseGemm::cutlass}};
constexpr std::pair<const char*, SwigluFusion> kSwiglu[] = {
    {"auto", SwigluFusion::automatic}, {"on", SwigluFusion::on}, {"off", SwigluFusion::off}};
constexpr std::pair<const char*, AttentionKernel> kAttention[] = {
    {"auto", AttentionKernel::automatic}, {"own", AttentionKernel::own}, {"cudnn", AttentionKernel::cudnn}};
constexpr std::pair<const char*, GemmTiles> kTiles[] = {{"small", GemmTiles::small},
                                                        {"large", GemmTiles::large},
                                                        {"pingpong", GemmTiles::pingpong},
                                                        {"large_n2", GemmTiles::large_n2},
                                                        {"pingpong_n2", GemmTiles::pingpong_n2},
                                                        {"large_auto", GemmTiles::large_auto},
                                                        {"auto", GemmTiles::automatic},
                                                        {"own", GemmTiles::own}};
constexpr std::pair<const char*, Fp8Tile> kFp8Tiles[] = {{"cooperative", Fp8Tile::cooperative},
                                                         {"cooperative_1x1", Fp8Tile::cooperative_1x1},
                                                         {"pingpong", Fp8Tile::pingpong},
                                                         {"own", Fp8Tile::own},
                                                         {"auto", Fp8Tile::automatic}};
// The kinds of CutlassTiles and Fp8Tiles, in the order of their members.
constexpr const char* kKinds[] = {"forward", "dgrad", "wgrad", "swiglu_forward", "swiglu_dgrad"};
constexpr const char* kFp8Kinds[] = {"rows", "cols"};
GemmTiles* kind_member(CutlassTiles& t, size_t i) {
  GemmTiles* members[] = {&t.forward, &t.dgrad, &t.wgrad, &t.swiglu_forward, &t.swiglu_dgrad};
  return members[i];
}
Fp8Tile* kind_member(Fp8Tiles& t, size_t i) {
  Fp8Tile* members[] = {&t.rows, &t.cols};
  return members[i];
}

// A per-kind tile choice: "" (defaults), one value for every kind, or "kind=value" items
// separated by commas (kinds not named keep their defaults).
template <class Tiles, class V, size_t NK, size_t NV>
Tiles parse_per_kind(const std::string& value, const std::string& key, const char* const (&kinds)[NK],
                     const std::pair<const char*, V> (&names)[NV]) {
  Tiles t;
  if (value.empty()) return t;
  if (value.find('=') == std::string::npos) {
    const V all = parse_one(value, key, names);
    for (size_t i = 0; i < NK; ++i) *kind_member(t, i) = all;
    return t;
  }
  std::string kind_list;
  for (const char* k : kinds) kind_list += kind_list.empty() ? k : cat(", ", k);
  bool named[NK] = {};
  for (size_t begin = 0; begin <= value.size();) {
    const size_t end = std::min(value.find(',', begin), value.size()), eq = value.find('=', begin);
    if (eq >= end) MF_FAIL(key, " = \"", value, "\": expected kind=tiles items separated by commas");
    const std::string kind = value.substr(begin, eq - begin);
    size_t i = 0;
    while (i < NK && kind != kinds[i]) ++i;
    if (i == NK) MF_FAIL(key, " = \"", value, "\": unknown kind \"", kind, "\" (", kind_list, ")");
    if (named[i]) MF_FAIL(key, " = \"", value, "\": kind \"", kind, "\" named twice");
    named[i] = true;
    const std::string tiles = value.substr(eq + 1, end - eq - 1);
    const V* chosen = find_one(tiles, names);
    if (chosen == nullptr)
      MF_FAIL(key, " = \"", value, "\": tiles \"", tiles, "\" for ", kind, ": expected one of ", known_names(names));
    *kind_member(t, i) = *chosen;
    begin = end + 1;
  }
  return t;
}

// The canonical text of a per-kind choice: "" when every kind has its default, else every kind named.
template <class Tiles, class V, size_t NK, size_t NV>
std::string per_kind_text(const Tiles& t, const char* const (&kinds)[NK],
                          const std::pair<const char*, V> (&names)[NV]) {
  Tiles copy = t, defaults;
  std::string text;
  bool all_default = true;
  for (size_t i = 0; i < NK; ++i) {
    all_default = all_default && *kind_member(copy, i) == *kind_member(defaults, i);
    text += cat(i ? "," : "", kinds[i], "=", name_of(*kind_member(copy, i), names));
  }
  return all_default ? std::string() : text;
}
}  // namespace

GroupedGemmImpl parse_grouped_gemm(const std::string& value, const std::string& key) {
  return parse_one(value, key, kGroupedGemm);
}
Fp8DenseGemm parse_fp8_dense_gemm(const std::string& value, const std::string& key) {
  return parse_one(value, key, kFp8Dense);
}
SwigluFusion parse_swiglu_fusion(const std::string& value, const std::string& key) {
  return parse_one(value, key, kSwiglu);
}
AttentionKernel parse_attention_kernel(const std::string& value, const std::string& key) {
  return parse_one(value, key, kAttention);
}
const char* grouped_gemm_name(GroupedGemmImpl v) { return name_of(v, kGroupedGemm); }
const char* swiglu_fusion_name(SwigluFusion v) { return name_of(v, kSwiglu); }
const char* fp8_dense_gemm_name(Fp8DenseGemm v) { return name_of(v, kFp8Dense); }
const char* attention_kernel_name(AttentionKernel v) { return name_of(v, kAttention); }
const char* gemm_tiles_name(GemmTiles v) { return name_of(v, kTiles); }

bool large_auto_pays(int64_t rows, int64_t experts, int64_t in, int64_t out) {
  if (rows <= 0 || experts <= 0) return false;
  const double multiply_adds = static_cast<double>(rows) * static_cast<double>(in) * static_cast<double>(out);
  return rows < kAutoMaxRowsPerExpert * experts && multiply_adds >= static_cast<double>(kAutoMinMultiplyAdds);
}

CutlassTiles parse_cutlass_tiles(const std::string& value, const std::string& key) {
  const CutlassTiles t = parse_per_kind<CutlassTiles>(value, key, kKinds, kTiles);
  for (const GemmTiles k : {t.forward, t.dgrad, t.swiglu_forward, t.swiglu_dgrad})
    if (k == GemmTiles::own)
      MF_FAIL(key, " = \"", value, "\": own serves the weight gradient only (\"wgrad=own\"); the other kinds run on ",
              "CUTLASS");
  return t;
}
std::string cutlass_tiles_text(const CutlassTiles& t) { return per_kind_text(t, kKinds, kTiles); }
Fp8Tiles parse_fp8_tiles(const std::string& value, const std::string& key) {
  const Fp8Tiles t = parse_per_kind<Fp8Tiles>(value, key, kFp8Kinds, kFp8Tiles);
  if (t.cols == Fp8Tile::own)
    MF_FAIL(key, " = \"", value, "\": own serves rows only (forward and dgrad, e.g. \"rows=own\"); the weight ",
            "gradient (cols) runs on CUTLASS");
  return t;
}
std::string fp8_tiles_text(const Fp8Tiles& t) { return per_kind_text(t, kFp8Kinds, kFp8Tiles); }

}  // namespace moefold
