#include "moefold/core/dtype.h"

namespace moefold {

namespace {
struct DTypeInfo {
  DType t;
  size_t size;
  std::string_view name;
};
constexpr DTypeInfo kInfo[] = {{DType::f32, 4, "F32"}, {DType::f64, 8, "F64"}, {DType::bf16, 2, "BF16"},
                               {DType::i32, 4, "I32"}, {DType::i64, 8, "I64"}, {DType::u8, 1, "U8"},
                               {DType::u16, 2, "U16"}};
}  // namespace

size_t dtype_size(DType t) { return kInfo[static_cast<int>(t)].size; }
std::string_view dtype_name(DType t) { return kInfo[static_cast<int>(t)].name; }
bool dtype_from_name(std::string_view name, DType* out) {
  for (const auto& i : kInfo)
    if (i.name == name) {
      *out = i.t;
      return true;
    }
  return false;
}

}  // namespace moefold
