// Element types of tensor storage and their conversions. Compute on the CPU is float32 (float64
// in gradient-check tests); bfloat16 is a storage type (checkpoints, GPU compute).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace moefold {

enum class DType : uint8_t { f32, f64, bf16, i32, i64, u8, u16 };

size_t dtype_size(DType t);
// safetensors spelling: "F32", "F64", "BF16", "I32", "I64", "U8", "U16".
std::string_view dtype_name(DType t);
// Inverse of dtype_name; returns false when the name is unknown.
bool dtype_from_name(std::string_view name, DType* out);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::u8;
}
template <>
constexpr DType dtype_of<uint16_t>() {
  return DType::u16;
}

// bfloat16 <-> float32, round to nearest even; NaN stays NaN (quiet).
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace moefold
