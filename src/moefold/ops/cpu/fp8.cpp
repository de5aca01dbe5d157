// CPU reference of FP8 blockwise quantization and the FP8 linear layers (ops/fp8.h): the E4M3
// conversions, the three tilings (rows, cols per segment, 128 x 128 blocks) and the GEMMs emulated
// as quantize -> dequantize -> GEMM in the operands' dtype (f32; f64 for gradient checks, read
// through f32 as the GPU reads bf16 through f32). CUDA tensors go to ops/cuda/fp8*.cu after the
// checks here.
#include "moefold/ops/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "moefold/ops/dispatch.h"
#include "moefold/ops/gemm.h"
#include "moefold/ops/moe_ops.h"
#include "moefold/ops/ops.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/ops/cuda/fp8.h"
#endif

namespace moefold {

// ---- E4M3 and the tile scale ------------------------------------------------------------------

uint8_t e4m3_from_float(float x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float a = std::fabs(x);
  if (a >= kFp8E4m3Max) return sign | 0x7e;  // saturate (infinities too)
  // Subnormals: multiples of 2^-9 below 2^-6; a * 512 is exact, nearbyint rounds ties to even
  // (the default rounding mode). 8 * 2^-9 = 2^-6 is code 8, the smallest normal: no special case.
  if (a < 0.015625f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
  int k = 0;
  const float f = std::frexp(a, &k);  // a = f * 2^k, f in [0.5, 1): exponent k - 1
  int e = k - 1;
  int m = static_cast<int>(std::nearbyint((2.0f * f - 1.0f) * 8.0f));  // exact before the rounding
  if (m == 8) {
    m = 0;
    ++e;
  }
  return sign | static_cast<uint8_t>(((e + 7) << 3) | m);  // e <= 8: below 448 the code stays < 0x7f
}

float e4m3_to_float(uint8_t q) {
  const int e = (q >> 3) & 0xf, m = q & 7;
  float v;
  if (e == 15 && m == 7)
    v = NAN;
  else if (e == 0)
    v = std::ldexp(static_cast<float>(m), -9);
  else
    v = std::ldexp(static_cast<float>(8 + m), e - 10);
  return (q & 0x80) ? -v : v;
}

float fp8_tile_scale(float amax) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return 1.0f;
  // amax = f * 2^k; 448 = 0.875 * 2^9: amax <= 448 * 2^e iff e >= k - 9 (f <= 0.875) or k - 8.
  int k = 0;
  const float f = std::frexp(amax, &k);
  const int e = std::clamp(k - 9 + (f > 0.875f ? 1 : 0), -126, 127);  // s and 1 / s stay normal floats
  return std::ldexp(1.0f, e);
}

namespace {

// ---- host tiles -------------------------------------------------------------------------------

// One float element of a host tensor of dtype f32, f64 or bf16.
float load(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(base)[i];
    case DType::f64:
      return static_cast<float>(static_cast<const double*>(base)[i]);
    case DType::bf16:
      return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default:
      MF_FAIL("fp8: dtype ", dtype_name(t), " (f32, f64 or bf16)");
  }
}

void store(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::f32:
      static_cast<float*>(base)[i] = v;
      return;
    case DType::f64:
      static_cast<double*>(base)[i] = v;
      return;
    case DType::bf16:
      static_cast<uint16_t*>(base)[i] = f32_to_bf16(v);
      return;
    default:
      MF_FAIL("fp8: dtype ", dtype_name(t), " (f32, f64 or bf16)");
  }
}

// Quantizes one tile of n elements, element j at flat index idx(j) of x: returns the scale and
// calls put(j, code).
template <class Idx, class Put>
float quantize_tile(const void* x, DType t, int64_t n, const Idx& idx, const Put& put, bool via_bf16 = false) {
  const auto value = [&](int64_t j) {
    const float v = load(x, t, idx(j));
    return via_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
  };
  float amax = 0.0f;
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) {
    const float a = std::fabs(value(j));
    if (!std::isfinite(a)) finite = false;
    amax = std::max(amax, a);
  }
  const float s = finite ? fp8_tile_scale(amax) : 1.0f;
  for (int64_t j = 0; j < n; ++j) put(j, e4m3_from_float(value(j) / s));
  return s;
}

// The tiles of each layout, calling tile(count, idx, scale_index) with idx(j) the flat index of the
// tile's element j in x (w) and scale_index the flat index of its scale in the scale tensor.
template <class Tile>
void for_row_tiles(int64_t rows, int64_t k, const Tile& tile) {
  const int64_t nb = (k + kFp8Tile - 1) / kFp8Tile;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * kFp8Tile;
      tile(
          std::min(kFp8Tile, k - k0), [=](int64_t j) { return r * k + k0 + j; }, b * rows + r);
    }
}

// Segment j's first column of the transposed layout (p_j in fp8.h), for every j (S + 1 entries).
std::vector<int64_t> padded_starts(const int64_t* off, int64_t segments) {
  std::vector<int64_t> p(static_cast<size_t>(segments + 1), 0);
  for (int64_t j = 0; j < segments; ++j) p[j + 1] = p[j] + (off[j + 1] - off[j] + kFp8Tile - 1) / kFp8Tile * kFp8Tile;
  return p;
}

// cols: tile(count, idx, scale_index, column c, first padded column p, first row r0).
template <class Tile>
void for_col_tiles(int64_t cols, const int64_t* off, int64_t segments, const Tile& tile) {
  const std::vector<int64_t> p = padded_starts(off, segments);
  for (int64_t s = 0; s < segments; ++s)
    for (int64_t t0 = 0; t0 < off[s + 1] - off[s]; t0 += kFp8Tile) {
      const int64_t r0 = off[s] + t0, n = std::min(kFp8Tile, off[s + 1] - r0), pb = (p[s] + t0) / kFp8Tile;
      for (int64_t c = 0; c < cols; ++c)
        tile(
            n, [=](int64_t j) { return (r0 + j) * cols + c; }, pb * cols + c, c, p[s] + t0, r0);
    }
}

// blocks of matrix e of [E, O, I]: tile(count, idx, scale_index, o0, i0, rows of the block, cols).
template <class Tile>
void for_blocks(int64_t e_n, int64_t o_n, int64_t i_n, const Tile& tile) {
  const int64_t ob = (o_n + kFp8Tile - 1) / kFp8Tile, ib = (i_n + kFp8Tile - 1) / kFp8Tile;
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t bo = 0; bo < ob; ++bo)
      for (int64_t bi = 0; bi < ib; ++bi) {
        const int64_t o0 = bo * kFp8Tile, i0 = bi * kFp8Tile;
        const int64_t h = std::min(kFp8Tile, o_n - o0), w = std::min(kFp8Tile, i_n - i0);
        const int64_t base = e * o_n * i_n + o0 * i_n + i0;
        tile(
            h * w, [=](int64_t j) { return base + (j / w) * i_n + j % w; }, (e * ob + bo) * ib + bi, e, o0, i0, h, w);
      }
}

// ---- argument checks --------------------------------------------------------------------------

bool is_float(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16; }

void check_same_device(std::initializer_list<const Tensor*> ts, const char* what) {
  const Device d = (*ts.begin())->device();
  for (const Tensor* t : ts)
    if (t->defined()) MF_CHECK(t->device() == d, what, ": tensors on different devices (", t->str(), ")");
}

void check_quant(const Tensor& x, const Tensor& q, const Tensor& s, const Shape& s_shape, const char* what) {
  MF_CHECK(x.contiguous() && q.contiguous() && s.contiguous(), what, ": not contiguous");
  MF_CHECK(is_float(x.dtype()), what, ": x ", x.str(), " (f32, f64 or bf16)");
  MF_CHECK(q.dtype() == DType::u8, what, ": q ", q.str(), " (u8 E4M3)");
  MF_CHECK(s.dtype() == DType::f32, what, ": scales ", s.str(), " (f32)");
  check_shape(s, s_shape, what);
}

int64_t tiles(int64_t n) { return (n + kFp8Tile - 1) / kFp8Tile; }

// O and I of a weight [O, I] or [E, O, I] (indices spelled out: GCC's -Warray-bounds cannot see
// that ndim() >= 2 here).
int64_t matrix_rows(const Tensor& w) { return w.size(w.ndim() == 3 ? 1 : 0); }
int64_t matrix_cols(const Tensor& w) { return w.size(w.ndim() == 3 ? 2 : 1); }

Shape block_scale_shape(const Tensor& w, bool transposed) { return fp8_block_scale_shape(w.shape(), transposed); }

void check_offsets(const Tensor& offsets, int64_t rows, const char* what) {
  MF_CHECK(offsets.ndim() == 1 && offsets.numel() >= 2 && offsets.dtype() == DType::i64 && offsets.contiguous(), what,
           ": offsets ", offsets.str(), " (i64 [S + 1])");
  if (offsets.device() != Device::cpu) return;  // the GPU trusts them (they come from the permutation plan)
  const int64_t* off = offsets.ptr<int64_t>();
  const int64_t s_n = offsets.numel() - 1;
  MF_CHECK(off[0] == 0 && off[s_n] == rows, what, ": offsets span [", off[0], ", ", off[s_n], ") for ", rows, " rows");
  for (int64_t j = 0; j < s_n; ++j) MF_CHECK(off[j] <= off[j + 1], what, ": offsets decrease");
}

void check_cols(const Tensor& x_RC, const Tensor& offsets, const Tensor& qT, const Tensor& sT, const char* what) {
  MF_CHECK(x_RC.ndim() == 2 && qT.ndim() == 2 && qT.size(0) == x_RC.size(1) && qT.size(1) % kFp8Tile == 0, what, ": x ",
           x_RC.str(), ", qT ", qT.str(), " ([C, P], P a multiple of 128)");
  check_offsets(offsets, x_RC.size(0), what);
  MF_CHECK(qT.size(1) >= fp8_cols_width(x_RC.size(0), offsets.numel() - 1) || offsets.device() == Device::cpu, what,
           ": qT ", qT.str(), " narrower than fp8_cols_width");
  if (offsets.device() == Device::cpu) {
    const std::vector<int64_t> p = padded_starts(offsets.ptr<int64_t>(), offsets.numel() - 1);
    MF_CHECK(p.back() <= qT.size(1), what, ": qT ", qT.str(), " has fewer than the ", p.back(), " columns needed");
  }
  check_quant(x_RC, qT, sT, {qT.size(1) / kFp8Tile, x_RC.size(1)}, what);
  check_same_device({&x_RC, &offsets, &qT, &sT}, what);
}

void check_blocks(const Tensor& w, const Tensor& q, const Tensor& s, const Tensor& qT, const Tensor& sT,
                  const char* what) {
  MF_CHECK(w.ndim() == 2 || w.ndim() == 3, what, ": w ", w.str(), " ([O, I] or [E, O, I])");
  check_shape(q, w.shape(), what);
  check_quant(w, q, s, block_scale_shape(w, false), what);
  if (qT.defined()) {
    check_shape(qT, fp8_transposed_shape(w.shape()), what);
    check_quant(w, qT, sT, block_scale_shape(w, true), what);
  } else {
    MF_CHECK(!sT.defined(), what, ": sT without qT");
  }
  check_same_device({&w, &q, &s, &qT, &sT}, what);
}

}  // namespace

// ---- quantization ops ---------------------------------------------------------------------------

void fp8_quantize_rows(const ExecContext& ctx, const Tensor& x_RK, const Tensor& q_RK, const Tensor& s_BR) {
  MF_CHECK(x_RK.ndim() == 2, "fp8_quantize_rows: x ", x_RK.str());
  check_shape(q_RK, x_RK.shape(), "fp8_quantize_rows q");
  check_quant(x_RK, q_RK, s_BR, {tiles(x_RK.size(1)), x_RK.size(0)}, "fp8_quantize_rows");
  check_same_device({&x_RK, &q_RK, &s_BR}, "fp8_quantize_rows");
  MF_ON_GPU(ctx, x_RK, cuda::fp8_quantize_rows(ctx, x_RK, q_RK, s_BR));
  uint8_t* q = q_RK.ptr<uint8_t>();
  float* s = s_BR.ptr<float>();
  for_row_tiles(x_RK.size(0), x_RK.size(1), [&](int64_t n, const auto& idx, int64_t si) {
    s[si] = quantize_tile(x_RK.data(), x_RK.dtype(), n, idx, [&](int64_t j, uint8_t c) { q[idx(j)] = c; });
  });
}

void fp8_quantize_cols(const ExecContext& ctx, const Tensor& x_RC, const Tensor& offsets_S1, const Tensor& qT_CP,
                       const Tensor& sT_BC) {
  check_cols(x_RC, offsets_S1, qT_CP, sT_BC, "fp8_quantize_cols");
  MF_ON_GPU(ctx, x_RC, cuda::fp8_quantize_cols(ctx, x_RC, offsets_S1, qT_CP, sT_BC));
  uint8_t* q = qT_CP.ptr<uint8_t>();
  float* s = sT_BC.ptr<float>();
  const int64_t p_n = qT_CP.size(1);
  for_col_tiles(x_RC.size(1), offsets_S1.ptr<int64_t>(), offsets_S1.numel() - 1,
                [&](int64_t n, const auto& idx, int64_t si, int64_t c, int64_t p0, int64_t) {
                  s[si] = quantize_tile(x_RC.data(), x_RC.dtype(), n, idx,
                                        [&](int64_t j, uint8_t code) { q[c * p_n + p0 + j] = code; });
                });
}

void fp8_quantize_blocks(const ExecContext& ctx, const Tensor& w, const Tensor& q, const Tensor& s, const Tensor& qT,
                         const Tensor& sT, bool via_bf16) {
  check_blocks(w, q, s, qT, sT, "fp8_quantize_blocks");
  MF_ON_GPU(ctx, w, cuda::fp8_quantize_blocks(ctx, w, q, s, qT, sT, via_bf16));
  const int64_t e_n = w.ndim() == 3 ? w.size(0) : 1, o_n = matrix_rows(w), i_n = matrix_cols(w);
  uint8_t* qd = q.ptr<uint8_t>();
  float* sd = s.ptr<float>();
  uint8_t* qt = qT.defined() ? qT.ptr<uint8_t>() : nullptr;
  float* st = sT.defined() ? sT.ptr<float>() : nullptr;
  const int64_t ob = tiles(o_n), ib = tiles(i_n);
  for_blocks(e_n, o_n, i_n,
             [&](int64_t n, const auto& idx, int64_t si, int64_t e, int64_t o0, int64_t i0, int64_t, int64_t bw) {
               const float scale = quantize_tile(
                   w.data(), w.dtype(), n, idx,
                   [&](int64_t j, uint8_t c) {
                     qd[idx(j)] = c;
                     if (qt) qt[e * o_n * i_n + (i0 + j % bw) * o_n + o0 + j / bw] = c;
                   },
                   via_bf16);
               sd[si] = scale;
               if (st) st[(e * ib + i0 / kFp8Tile) * ob + o0 / kFp8Tile] = scale;
             });
}

namespace {

// A flat part of a weight of shape `whole` (fp8_block_amax, fp8_quantize_part): the checks.
void check_part(const Tensor& part, const Shape& whole, int64_t first, const Tensor& s, const Tensor& q,
                const char* what) {
  MF_CHECK(whole.ndim == 2 || whole.ndim == 3, what, ": whole weight ", whole.str(), " ([O, I] or [E, O, I])");
  MF_CHECK(part.contiguous() && is_float(part.dtype()), what, ": part ", part.str(), " (contiguous f32, f64 or bf16)");
  MF_CHECK(first >= 0 && first + part.numel() <= whole.numel(), what, ": elements [", first, ", ", first + part.numel(),
           ") of a weight of ", whole.numel());
  check_shape(s, fp8_block_scale_shape(whole, false), what);
  MF_CHECK(s.dtype() == DType::f32 && s.contiguous(), what, ": scales ", s.str(), " (contiguous f32)");
  if (q.defined())
    MF_CHECK(q.dtype() == DType::u8 && q.contiguous() && q.numel() == part.numel(), what, ": codes ", q.str(),
             " for a part of ", part.numel());
  check_same_device({&part, &s, &q}, what);
}

// Calls each(j, b) for a part's element j, b the flat index of its block's scale.
template <class Each>
void for_part_blocks(int64_t n, const Shape& whole, int64_t first, const Each& each) {
  const int64_t o_n = whole[whole.ndim - 2], i_n = whole[whole.ndim - 1];
  const int64_t ob = tiles(o_n), ib = tiles(i_n);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t g = first + j, e = g / (o_n * i_n), o = g / i_n % o_n, i = g % i_n;
    each(j, (e * ob + o / kFp8Tile) * ib + i / kFp8Tile);
  }
}

// Element j of a part: its value as fp8_quantize_blocks reads it.
float part_value(const Tensor& part, int64_t j, bool via_bf16) {
  const float v = load(part.data(), part.dtype(), j);
  return via_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
}

}  // namespace

void fp8_block_amax(const ExecContext& ctx, const Tensor& part, const Shape& whole, int64_t first, const Tensor& amax,
                    bool via_bf16) {
  check_part(part, whole, first, amax, Tensor(), "fp8_block_amax");
  MF_ON_GPU(ctx, part, cuda::fp8_block_amax(ctx, part, whole, first, amax, via_bf16));
  float* m = amax.ptr<float>();
  for_part_blocks(part.numel(), whole, first, [&](int64_t j, int64_t b) {
    const float a = std::fabs(part_value(part, j, via_bf16));
    m[b] = std::max(m[b], std::isfinite(a) ? a : std::numeric_limits<float>::infinity());
  });
}

void fp8_scales_from_amax(const ExecContext& ctx, const Tensor& amax_to_scale) {
  MF_CHECK(amax_to_scale.dtype() == DType::f32 && amax_to_scale.contiguous(),
           "fp8_scales_from_amax: ", amax_to_scale.str(), " (contiguous f32)");
  MF_ON_GPU(ctx, amax_to_scale, cuda::fp8_scales_from_amax(ctx, amax_to_scale));
  float* a = amax_to_scale.ptr<float>();
  for (int64_t i = 0; i < amax_to_scale.numel(); ++i) a[i] = fp8_tile_scale(a[i]);
}

void fp8_quantize_part(const ExecContext& ctx, const Tensor& part, const Shape& whole, int64_t first, const Tensor& s,
                       const Tensor& q_part, bool via_bf16) {
  MF_CHECK(q_part.defined(), "fp8_quantize_part: no codes tensor");
  check_part(part, whole, first, s, q_part, "fp8_quantize_part");
  MF_ON_GPU(ctx, part, cuda::fp8_quantize_part(ctx, part, whole, first, s, q_part, via_bf16));
  const float* sd = s.ptr<float>();
  uint8_t* q = q_part.ptr<uint8_t>();
  for_part_blocks(part.numel(), whole, first,
                  [&](int64_t j, int64_t b) { q[j] = e4m3_from_float(part_value(part, j, via_bf16) / sd[b]); });
}

void fp8_transpose_blocks(const ExecContext& ctx, const Tensor& q, const Tensor& s, const Tensor& qT,
                          const Tensor& sT) {
  const char* what = "fp8_transpose_blocks";
  MF_CHECK((q.ndim() == 2 || q.ndim() == 3) && q.dtype() == DType::u8 && q.contiguous(), what, ": q ", q.str(),
           " (contiguous u8 [O, I] or [E, O, I])");
  check_shape(s, fp8_block_scale_shape(q.shape(), false), what);
  check_shape(qT, fp8_transposed_shape(q.shape()), what);
  check_shape(sT, fp8_block_scale_shape(q.shape(), true), what);
  MF_CHECK(qT.dtype() == DType::u8 && s.dtype() == DType::f32 && sT.dtype() == DType::f32 && s.contiguous() &&
               qT.contiguous() && sT.contiguous(),
           what, ": qT ", qT.str(), ", s ", s.str(), ", sT ", sT.str(), " (contiguous u8, f32, f32)");
  check_same_device({&q, &s, &qT, &sT}, what);
  MF_ON_GPU(ctx, q, cuda::fp8_transpose_blocks(ctx, q, s, qT, sT));
  const int64_t e_n = q.ndim() == 3 ? q.size(0) : 1, o_n = q.size(q.ndim() - 2), i_n = q.size(q.ndim() - 1);
  const int64_t ob = tiles(o_n), ib = tiles(i_n);
  const uint8_t* qd = q.ptr<uint8_t>();
  uint8_t* qt = qT.ptr<uint8_t>();
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t o = 0; o < o_n; ++o)
      for (int64_t i = 0; i < i_n; ++i) qt[(e * i_n + i) * o_n + o] = qd[(e * o_n + o) * i_n + i];
  const float* sd = s.ptr<float>();
  float* st = sT.ptr<float>();
  for (int64_t e = 0; e < e_n; ++e)
    for (int64_t a = 0; a < ob; ++a)
      for (int64_t b = 0; b < ib; ++b) st[(e * ib + b) * ob + a] = sd[(e * ob + a) * ib + b];
}

void fp8_dequantize_rows(const ExecContext& ctx, const Tensor& q_RK, const Tensor& s_BR, const Tensor& x_RK) {
  MF_CHECK(x_RK.ndim() == 2, "fp8_dequantize_rows: x ", x_RK.str());
  check_shape(q_RK, x_RK.shape(), "fp8_dequantize_rows q");
  check_quant(x_RK, q_RK, s_BR, {tiles(x_RK.size(1)), x_RK.size(0)}, "fp8_dequantize_rows");
  check_same_device({&x_RK, &q_RK, &s_BR}, "fp8_dequantize_rows");
  MF_ON_GPU(ctx, x_RK, cuda::fp8_dequantize_rows(ctx, q_RK, s_BR, x_RK));
  const uint8_t* q = q_RK.ptr<uint8_t>();
  const float* s = s_BR.ptr<float>();
  for_row_tiles(x_RK.size(0), x_RK.size(1), [&](int64_t n, const auto& idx, int64_t si) {
    for (int64_t j = 0; j < n; ++j) store(x_RK.data(), x_RK.dtype(), idx(j), e4m3_to_float(q[idx(j)]) * s[si]);
  });
}

namespace {
void check_packed(const Tensor& x_RK, const Tensor& p_RW, const char* what) {
  MF_CHECK(x_RK.ndim() == 2, what, ": x ", x_RK.str());
  check_shape(p_RW, {x_RK.size(0), fp8_packed_width(x_RK.size(1))}, what);
  MF_CHECK(x_RK.contiguous() && p_RW.contiguous(), what, ": not contiguous");
  MF_CHECK(is_float(x_RK.dtype()), what, ": x ", x_RK.str(), " (f32, f64 or bf16)");
  MF_CHECK(p_RW.dtype() == DType::u8, what, ": packed rows ", p_RW.str(), " (u8)");
  check_same_device({&x_RK, &p_RW}, what);
}
// Row r's tile b of a packed row: tile(count, idx, r, b) with idx(j) x's flat index of element j
// (the code's byte in row r is idx(j) - r * K).
template <class Tile>
void for_packed_tiles(int64_t rows, int64_t k, const Tile& tile) {
  for_row_tiles(rows, k, [&](int64_t n, const auto& idx, int64_t si) { tile(n, idx, si % rows, si / rows); });
}
}  // namespace

void fp8_quantize_packed(const ExecContext& ctx, const Tensor& x_RK, const Tensor& p_RW) {
  check_packed(x_RK, p_RW, "fp8_quantize_packed");
  MF_ON_GPU(ctx, x_RK, cuda::fp8_quantize_packed(ctx, x_RK, p_RW));
  const int64_t k = x_RK.size(1), w = p_RW.size(1), at = fp8_packed_scales_at(k);
  uint8_t* p = p_RW.ptr<uint8_t>();
  std::fill(p, p + p_RW.numel(), uint8_t{0});
  for_packed_tiles(x_RK.size(0), k, [&](int64_t n, const auto& idx, int64_t r, int64_t b) {
    uint8_t* row = p + r * w;
    const float scale =
        quantize_tile(x_RK.data(), x_RK.dtype(), n, idx, [&](int64_t j, uint8_t c) { row[idx(j) - r * k] = c; });
    std::memcpy(row + at + 4 * b, &scale, sizeof scale);
  });
}

void fp8_swiglu_packed(const ExecContext& ctx, const Tensor& gu_R2F, const Tensor& p_RW) {
  MF_CHECK(gu_R2F.ndim() == 2 && gu_R2F.size(1) % 2 == 0, "fp8_swiglu_packed: gu ", gu_R2F.str());
  const int64_t r_n = gu_R2F.size(0), f = gu_R2F.size(1) / 2;
  check_shape(p_RW, {r_n, fp8_packed_width(f)}, "fp8_swiglu_packed");
  MF_CHECK(p_RW.dtype() == DType::u8 && p_RW.contiguous() && gu_R2F.contiguous() && is_float(gu_R2F.dtype()),
           "fp8_swiglu_packed: gu ", gu_R2F.str(), ", packed rows ", p_RW.str());
  check_same_device({&gu_R2F, &p_RW}, "fp8_swiglu_packed");
  MF_ON_GPU(ctx, gu_R2F, cuda::fp8_swiglu_packed(ctx, gu_R2F, p_RW));
  std::vector<uint8_t> h(static_cast<size_t>(r_n * f) * dtype_size(gu_R2F.dtype()));
  const Tensor h_RF(h.data(), gu_R2F.dtype(), {r_n, f});
  swiglu_forward(ctx, gu_R2F, h_RF, GateUp::pairs);
  fp8_quantize_packed(ctx, h_RF, p_RW);
}

void fp8_swiglu_backward_operands(const ExecContext& ctx, const Tensor& gu_R2F, const Tensor& dh_RF,
                                  const Tensor& offsets_E1, const Tensor& dgu_R2F, Fp8SharedOperands& dyq) {
  MF_CHECK(
      gu_R2F.ndim() == 2 && dh_RF.ndim() == 2 && gu_R2F.size(0) == dh_RF.size(0) && gu_R2F.size(1) == 2 * dh_RF.size(1),
      "fp8_swiglu_backward_operands: gu ", gu_R2F.str(), ", dh ", dh_RF.str());
  check_shape(dgu_R2F, gu_R2F.shape(), "fp8_swiglu_backward_operands dgu");
  check_offsets(offsets_E1, gu_R2F.size(0), "fp8_swiglu_backward_operands");
  check_same_device({&gu_R2F, &dh_RF, &dgu_R2F, &offsets_E1}, "fp8_swiglu_backward_operands");
  MF_ON_GPU(ctx, gu_R2F, cuda::fp8_swiglu_backward_operands(ctx, gu_R2F, dh_RF, offsets_E1, dgu_R2F, dyq));
  swiglu_backward(ctx, gu_R2F, dh_RF, dgu_R2F, GateUp::pairs);
  dyq.reset();
}

void fp8_dequantize_packed(const ExecContext& ctx, const Tensor& p_RW, const Tensor& x_RK) {
  check_packed(x_RK, p_RW, "fp8_dequantize_packed");
  MF_ON_GPU(ctx, x_RK, cuda::fp8_dequantize_packed(ctx, p_RW, x_RK));
  const int64_t k = x_RK.size(1), w = p_RW.size(1), at = fp8_packed_scales_at(k);
  const uint8_t* p = p_RW.ptr<uint8_t>();
  for_packed_tiles(x_RK.size(0), k, [&](int64_t n, const auto& idx, int64_t r, int64_t b) {
    const uint8_t* row = p + r * w;
    float scale;
    std::memcpy(&scale, row + at + 4 * b, sizeof scale);
    for (int64_t j = 0; j < n; ++j)
      store(x_RK.data(), x_RK.dtype(), idx(j), e4m3_to_float(row[idx(j) - r * k]) * scale);
  });
}

void fp8_dequantize_cols(const ExecContext& ctx, const Tensor& qT_CP, const Tensor& sT_BC, const Tensor& offsets_S1,
                         const Tensor& x_RC) {
  check_cols(x_RC, offsets_S1, qT_CP, sT_BC, "fp8_dequantize_cols");
  MF_ON_GPU(ctx, x_RC, cuda::fp8_dequantize_cols(ctx, qT_CP, sT_BC, offsets_S1, x_RC));
  const uint8_t* q = qT_CP.ptr<uint8_t>();
  const float* s = sT_BC.ptr<float>();
  const int64_t p_n = qT_CP.size(1);
  for_col_tiles(x_RC.size(1), offsets_S1.ptr<int64_t>(), offsets_S1.numel() - 1,
                [&](int64_t n, const auto& idx, int64_t si, int64_t c, int64_t p0, int64_t) {
                  for (int64_t j = 0; j < n; ++j)
                    store(x_RC.data(), x_RC.dtype(), idx(j), e4m3_to_float(q[c * p_n + p0 + j]) * s[si]);
                });
}

void fp8_dequantize_blocks(const ExecContext& ctx, const Tensor& q, const Tensor& s, const Tensor& w) {
  check_blocks(w, q, s, Tensor(), Tensor(), "fp8_dequantize_blocks");
  MF_ON_GPU(ctx, w, cuda::fp8_dequantize_blocks(ctx, q, s, w));
  const int64_t e_n = w.ndim() == 3 ? w.size(0) : 1, o_n = matrix_rows(w), i_n = matrix_cols(w);
  const uint8_t* qd = q.ptr<uint8_t>();
  const float* sd = s.ptr<float>();
  for_blocks(e_n, o_n, i_n, [&](int64_t n, const auto& idx, int64_t si, auto...) {
    for (int64_t j = 0; j < n; ++j) store(w.data(), w.dtype(), idx(j), e4m3_to_float(qd[idx(j)]) * sd[si]);
  });
}

// ---- the FP8 linear layers ------------------------------------------------------------------------

namespace {

// Whether x is packed FP8 rows (fp8.h) rather than values.
bool is_packed(const Tensor& x) { return x.dtype() == DType::u8; }

// x as values: x itself, or packed rows (of I columns) dequantized into `own`, in T (w's dtype).
// Q_rows of the dequantized rows gives them back (requantizing a tile of E4M3 values times a
// power of two reproduces the values), so the forward sees the dispatched codes as they are.
template <class T>
Tensor values(const Tensor& x, int64_t i_n, std::vector<T>& own) {
  if (!is_packed(x)) return x;
  own.resize(static_cast<size_t>(x.size(0) * i_n));
  const Tensor v(own.data(), dtype_of<T>(), {x.size(0), i_n});
  fp8_dequantize_packed(ExecContext::standard(Device::cpu), x, v);
  return v;
}

// Host copies of an operand quantized and dequantized in its layout (the CPU's emulation).
template <class T>
std::vector<T> fake_rows(const Tensor& x) {
  const int64_t r_n = x.size(0), k = x.size(1);
  std::vector<uint8_t> q(static_cast<size_t>(x.numel()));
  std::vector<float> s(static_cast<size_t>(tiles(k) * r_n));
  const ExecContext& cpu = ExecContext::standard(Device::cpu);
  fp8_quantize_rows(cpu, x, Tensor(q.data(), DType::u8, x.shape()), Tensor(s.data(), DType::f32, {tiles(k), r_n}));
  std::vector<T> out(q.size());
  for_row_tiles(r_n, k, [&](int64_t n, const auto& idx, int64_t si) {
    for (int64_t j = 0; j < n; ++j) out[idx(j)] = static_cast<T>(e4m3_to_float(q[idx(j)]) * s[si]);
  });
  return out;
}

template <class T>
std::vector<T> fake_cols(const Tensor& x, const Tensor& offsets) {
  const int64_t s_n = offsets.numel() - 1, c_n = x.size(1);
  const int64_t p_n = padded_starts(offsets.ptr<int64_t>(), s_n).back();
  std::vector<uint8_t> q(static_cast<size_t>(std::max<int64_t>(p_n, kFp8Tile) * c_n));
  std::vector<float> s(q.size() / kFp8Tile);
  const Tensor qT(q.data(), DType::u8, {c_n, std::max<int64_t>(p_n, kFp8Tile)});
  const Tensor sT(s.data(), DType::f32, {qT.size(1) / kFp8Tile, c_n});
  const ExecContext& cpu = ExecContext::standard(Device::cpu);
  fp8_quantize_cols(cpu, x, offsets, qT, sT);
  std::vector<T> out(static_cast<size_t>(x.numel()));
  for_col_tiles(c_n, offsets.ptr<int64_t>(), s_n,
                [&](int64_t n, const auto& idx, int64_t si, int64_t c, int64_t p0, int64_t) {
                  for (int64_t j = 0; j < n; ++j)
                    out[idx(j)] = static_cast<T>(e4m3_to_float(q[c * qT.size(1) + p0 + j]) * s[si]);
                });
  return out;
}

// wq (if given and defined) already holds w quantized: its q and s are read instead.
template <class T>
std::vector<T> fake_blocks(const Tensor& w, const Fp8Weight* wq) {
  std::vector<uint8_t> own_q;
  std::vector<float> own_s;
  const uint8_t* q = nullptr;
  const float* s = nullptr;
  if (wq != nullptr && wq->defined()) {
    q = wq->q.ptr<uint8_t>();
    s = wq->s.ptr<float>();
  } else {
    own_q.resize(static_cast<size_t>(w.numel()));
    const Shape ss = block_scale_shape(w, false);
    own_s.resize(static_cast<size_t>(ss.numel()));
    const ExecContext& cpu = ExecContext::standard(Device::cpu);
    fp8_quantize_blocks(cpu, w, Tensor(own_q.data(), DType::u8, w.shape()), Tensor(own_s.data(), DType::f32, ss),
                        Tensor(), Tensor());
    q = own_q.data();
    s = own_s.data();
  }
  const int64_t e_n = w.ndim() == 3 ? w.size(0) : 1, o_n = matrix_rows(w), i_n = matrix_cols(w);
  std::vector<T> out(static_cast<size_t>(w.numel()));
  for_blocks(e_n, o_n, i_n, [&](int64_t n, const auto& idx, int64_t si, auto...) {
    for (int64_t j = 0; j < n; ++j) out[idx(j)] = static_cast<T>(e4m3_to_float(q[idx(j)]) * s[si]);
  });
  return out;
}

// A given quantized weight: all four tensors, in w's shapes and on its device.
void check_wq(const Tensor& w, const Fp8Weight* wq, const char* what) {
  if (wq == nullptr || !wq->defined()) {
    MF_CHECK(w.data() != nullptr, what, ": a weight kept only in FP8 (train.fp8_param) without its FP8 copy");
    return;
  }
  MF_CHECK(wq->qT.defined(), what, ": a quantized weight without its transpose");
  check_blocks(w, wq->q, wq->s, wq->qT, wq->sT, what);
}

// The checks every FP8 linear entry point shares (both devices): x [R, I] (or packed rows
// [R, fp8_packed_width(I)]), w [(E,) O, I], y [R, O].
void check_fp8_linear(const Tensor& x, const Tensor& w, const Tensor& y, int64_t w_dims, const char* what) {
  const int64_t i_n = w.ndim() == w_dims ? w.size(w_dims - 1) : -1;
  MF_CHECK(x.ndim() == 2 && w.ndim() == w_dims && x.size(1) == (is_packed(x) ? fp8_packed_width(i_n) : i_n), what,
           ": x ", x.str(), ", w ", w.str());
  check_shape(y, {x.size(0), w.size(w_dims - 2)}, what);
  MF_CHECK(is_float(w.dtype()) && (is_packed(x) || x.dtype() == w.dtype()) && y.dtype() == w.dtype(), what, ": dtypes ",
           x.str(), " ", w.str(), " ", y.str());
  MF_CHECK(x.contiguous() && w.contiguous() && y.contiguous(), what, ": not contiguous");
  check_same_device({&x, &w, &y}, what);
}

void check_fp8_grads(const Tensor& x, const Tensor& w, const Tensor& dx, const Tensor& dw, const char* what) {
  if (dx.defined()) {
    check_shape(dx, {x.size(0), matrix_cols(w)}, what);
    MF_CHECK(dx.dtype() == w.dtype() && dx.contiguous(), what, ": dx ", dx.str());
  }
  if (dw.defined()) {
    check_shape(dw, w.shape(), what);
    MF_CHECK((dw.dtype() == w.dtype() || dw.dtype() == DType::f32) && dw.contiguous(), what, ": dw ", dw.str());
  }
  check_same_device({&x, &dx, &dw}, what);
}

// The CPU's wgrad: dw (+)= Q_cols(dy)^T @ Q_cols(x) with the segments of `offsets`.
template <class T>
void emulated_wgrad(const Tensor& x, const Tensor& dy, const Tensor& offsets, const Tensor& dw, bool accumulate) {
  const int64_t e_n = dw.ndim() == 3 ? dw.size(0) : 1, o_n = dy.size(1), i_n = x.size(1);
  const std::vector<T> qx = fake_cols<T>(x, offsets), qdy = fake_cols<T>(dy, offsets);
  const int64_t* off = offsets.ptr<int64_t>();
  T* d = dw.ptr<T>();
  if (!accumulate) std::fill(d, d + dw.numel(), T(0));
  for (int64_t e = 0; e < e_n; ++e) {
    const int64_t m = off[e + 1] - off[e];
    if (m == 0) continue;
    gemm<T>(true, false, o_n, i_n, m, T(1), qdy.data() + off[e] * o_n, o_n, qx.data() + off[e] * i_n, i_n, T(1),
            d + e * o_n * i_n, i_n);
  }
}

}  // namespace

int64_t fp8_shared_operand_bytes(int64_t rows, int64_t cols, int64_t segments, bool both) {
  const int64_t p = fp8_cols_width(rows, segments);
  const int64_t r = fp8_operand_bytes(rows * cols, tiles(cols) * rows),
                c = fp8_operand_bytes(cols * p, p / kFp8Tile * cols);
  return both ? r + c : std::max(r, c);
}

namespace {
// A shared operand's bytes: where given, on x's device and large enough for x's operands in
// `segments` segments.
void check_shared(const Tensor& x, const Fp8SharedOperands* xin, const char* what, int64_t segments = 1) {
  if (xin == nullptr || !xin->bytes.defined()) return;
  MF_CHECK(!is_packed(x), what, ": shared FP8 operands of packed rows");
  MF_CHECK(xin->bytes.dtype() == DType::u8 && xin->bytes.contiguous() &&
               xin->bytes.numel() >= fp8_shared_operand_bytes(x.size(0), x.size(1), segments),
           what, ": shared FP8 operands' bytes ", xin->bytes.str(), " for ", x.str());
  check_same_device({&x, &xin->bytes}, what);
}
}  // namespace

void fp8_linear_forward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO,
                        const Fp8Weight* wq, Fp8SharedOperands* xin) {
  check_fp8_linear(x_NI, w_OI, y_NO, 2, "fp8_linear_forward");
  check_wq(w_OI, wq, "fp8_linear_forward");
  check_shared(x_NI, xin, "fp8_linear_forward");
  MF_ON_GPU(ctx, x_NI, cuda::fp8_linear_forward(ctx, x_NI, w_OI, y_NO, wq, xin));
  const int64_t n = x_NI.size(0), in = w_OI.size(1), out = w_OI.size(0);
  dispatch_float(w_OI.dtype(), [&]<class T>() {
    std::vector<T> own;
    const std::vector<T> qx = fake_rows<T>(values<T>(x_NI, in, own)), qw = fake_blocks<T>(w_OI, wq);
    gemm<T>(false, true, n, out, in, T(1), qx.data(), in, qw.data(), in, T(0), y_NO.ptr<T>(), out);
  });
}

void fp8_linear_backward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO,
                         const Tensor& dx_NI, const Tensor& dw_OI, bool accumulate, const Fp8Weight* wq,
                         Fp8SharedOperands* xin) {
  check_fp8_linear(x_NI, w_OI, dy_NO, 2, "fp8_linear_backward");
  check_fp8_grads(x_NI, w_OI, dx_NI, dw_OI, "fp8_linear_backward");
  check_wq(w_OI, wq, "fp8_linear_backward");
  check_shared(x_NI, xin, "fp8_linear_backward");
  MF_ON_GPU(ctx, x_NI, cuda::fp8_linear_backward(ctx, x_NI, w_OI, dy_NO, dx_NI, dw_OI, accumulate, wq, xin));
  const int64_t n = x_NI.size(0), in = w_OI.size(1), out = w_OI.size(0);
  dispatch_float(w_OI.dtype(), [&]<class T>() {
    if (dx_NI.defined()) {
      const std::vector<T> qdy = fake_rows<T>(dy_NO), qw = fake_blocks<T>(w_OI, wq);
      gemm<T>(false, false, n, in, out, T(1), qdy.data(), out, qw.data(), in, T(0), dx_NI.ptr<T>(), in);
    }
    if (dw_OI.defined()) {
      int64_t off[2] = {0, n};
      std::vector<T> own;
      emulated_wgrad<T>(values<T>(x_NI, in, own), dy_NO, Tensor(off, DType::i64, {2}), dw_OI, accumulate);
    }
  });
}

void fp8_grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                const Tensor& offsets_E1, const Tensor& y_RO, const Fp8Weight* wq) {
  check_fp8_linear(x_RI, w_EOI, y_RO, 3, "fp8_grouped_linear_forward");
  check_offsets(offsets_E1, x_RI.size(0), "fp8_grouped_linear_forward");
  MF_CHECK(offsets_E1.numel() == w_EOI.size(0) + 1, "fp8_grouped_linear_forward: offsets ", offsets_E1.str(), " for ",
           w_EOI.size(0), " experts");
  check_wq(w_EOI, wq, "fp8_grouped_linear_forward");
  MF_ON_GPU(ctx, x_RI, cuda::fp8_grouped_linear_forward(ctx, x_RI, w_EOI, offsets_E1, y_RO, wq));
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  const int64_t* off = offsets_E1.ptr<int64_t>();
  dispatch_float(w_EOI.dtype(), [&]<class T>() {
    std::vector<T> own;
    const std::vector<T> qx = fake_rows<T>(values<T>(x_RI, i_n, own)), qw = fake_blocks<T>(w_EOI, wq);
    for (int64_t e = 0; e < e_n; ++e) {
      const int64_t m = off[e + 1] - off[e];
      if (m == 0) continue;
      gemm<T>(false, true, m, o_n, i_n, T(1), qx.data() + off[e] * i_n, i_n, qw.data() + e * o_n * i_n, i_n, T(0),
              y_RO.ptr<T>() + off[e] * o_n, o_n);
    }
  });
}

void fp8_grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                 const Tensor& offsets_E1, const Tensor& dy_RO, const Tensor& dx_RI,
                                 const Tensor& dw_EOI, bool accumulate, const Fp8Weight* wq, Fp8SharedOperands* dyq) {
  check_fp8_linear(x_RI, w_EOI, dy_RO, 3, "fp8_grouped_linear_backward");
  check_fp8_grads(x_RI, w_EOI, dx_RI, dw_EOI, "fp8_grouped_linear_backward");
  check_offsets(offsets_E1, x_RI.size(0), "fp8_grouped_linear_backward");
  MF_CHECK(offsets_E1.numel() == w_EOI.size(0) + 1, "fp8_grouped_linear_backward: offsets ", offsets_E1.str(), " for ",
           w_EOI.size(0), " experts");
  check_wq(w_EOI, wq, "fp8_grouped_linear_backward");
  check_shared(dy_RO, dyq, "fp8_grouped_linear_backward", w_EOI.size(0));
  MF_ON_GPU(ctx, x_RI,
            cuda::fp8_grouped_linear_backward(ctx, x_RI, w_EOI, offsets_E1, dy_RO, dx_RI, dw_EOI, accumulate, wq, dyq));
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  const int64_t* off = offsets_E1.ptr<int64_t>();
  dispatch_float(w_EOI.dtype(), [&]<class T>() {
    if (dx_RI.defined()) {
      const std::vector<T> qdy = fake_rows<T>(dy_RO), qw = fake_blocks<T>(w_EOI, wq);
      for (int64_t e = 0; e < e_n; ++e) {
        const int64_t m = off[e + 1] - off[e];
        if (m == 0) continue;
        gemm<T>(false, false, m, i_n, o_n, T(1), qdy.data() + off[e] * o_n, o_n, qw.data() + e * o_n * i_n, i_n, T(0),
                dx_RI.ptr<T>() + off[e] * i_n, i_n);
      }
    }
    if (dw_EOI.defined()) {
      std::vector<T> own;
      emulated_wgrad<T>(values<T>(x_RI, i_n, own), dy_RO, offsets_E1, dw_EOI, accumulate);
    }
  });
}

Tensor Fp8Param::param(Memory& mem, ParamSpec spec, bool on) {
  spec.fp8 = on;
  const std::string name = spec.name;
  const Tensor w = mem.param(spec);
  mem_ = &mem;
  on_ = on;
  const Param* p = mem.find(name);
  MF_CHECK(p != nullptr, "Fp8Param: no parameter ", name);
  index_ = static_cast<size_t>(p - mem.params().data());
  MF_CHECK(!on || p->fp8.defined(), "Fp8Param: ", name, " was registered without its FP8 copy (ParamSpec::fp8)");
  return w;
}

namespace {

// p's FP8 copy quantized again on `ctx` if the weights may have changed since it was made.
void refresh_fp8_copy(const ExecContext& ctx, const Memory& mem, Param& p) {
  if (p.fp8_version == mem.weights_version()) return;
  if (p.fp8_gathered) {  // q and s from the distributed optimizer (its gathered codes): transposed here
    fp8_transpose_blocks(ctx, p.fp8.q, p.fp8.s, p.fp8.qT, p.fp8.sT);
    p.fp8_version = mem.weights_version();
    return;
  }
  // Kept only in FP8: from the master, rounded as its bf16 copy would be.
  const bool from_master = p.compute.data() == nullptr;
  const bool via_bf16 = from_master && mem.dtype() == DType::bf16 && p.value.dtype() != DType::bf16;
  fp8_quantize_blocks(ctx, from_master ? p.value : p.compute, p.fp8.q, p.fp8.s, p.fp8.qT, p.fp8.sT, via_bf16);
  p.fp8_version = mem.weights_version();
}

}  // namespace

const Fp8Weight* Fp8Param::get(const ExecContext* on) const {
  if (!on_) return nullptr;
  Param& p = mem_->params()[index_];
  refresh_fp8_copy(on ? *on : mem_->exec(), *mem_, p);
  return &p.fp8;
}

void fp8_quantize_changed_params(Memory& mem) {
  for (Param& p : mem.params())
    if (p.fp8.defined()) refresh_fp8_copy(mem.exec(), mem, p);
}

void linear_forward_in(const ExecContext& ctx, const Fp8Weight* wq, const Tensor& x_NI, const Tensor& w_OI,
                       const Tensor& y_NO, Fp8SharedOperands* xin) {
  if (wq != nullptr)
    fp8_linear_forward(ctx, x_NI, w_OI, y_NO, wq, xin);
  else
    linear_forward(ctx, x_NI, w_OI, y_NO);
}

void linear_backward_in(const ExecContext& ctx, const Fp8Weight* wq, const Tensor& x_NI, const Tensor& w_OI,
                        const Tensor& dy_NO, const Tensor& dx_NI, const Tensor& dw_OI, Fp8SharedOperands* xin) {
  if (wq != nullptr)
    fp8_linear_backward(ctx, x_NI, w_OI, dy_NO, dx_NI, dw_OI, true, wq, xin);
  else
    linear_backward(ctx, x_NI, w_OI, dy_NO, dx_NI, dw_OI);
}

}  // namespace moefold
