// FP8 training (train.fp8 = blockwise, DeepSeek-V3's recipe): E4M3 values with f32 scales, one
// scale per 1 x 128 tile of activations and gradients (along each GEMM's reduction dimension) and
// per 128 x 128 block of weights; the FP8 GEMMs of the linear layers built on them. The CPU
// reference (ops/cpu/fp8.cpp) defines every result; the CUDA ops (ops/cuda/fp8*.cu) quantize bit
// for bit as it does and run the GEMMs on Hopper's FP8 tensor cores (CUTLASS's blockwise-scaled
// grouped GEMM), the CPU emulates them (quantize, dequantize, f32 GEMM: the same tiling of scales).
//
// Scales are powers of two: a tile's scale is the smallest 2^e with amax / 2^e <= 448 (E4M3's
// largest finite value), so x / s and q * s are exact and the quantized value is x / s rounded
// once to E4M3 (to nearest, ties to even). amax == 0 (an all-zero tile) gives scale 1; the
// exponent is clamped to [-126, 127], so s and 1 / s stay normal floats (the GPU clamps alike).
// A tile holding NaN or an infinity gets scale 1 (its values saturate; NaN stays NaN).
//
// Layouts (letters as in ops.h; B = ceil(K / 128) tiles along a row; all contiguous):
//   rows   q_RK (u8, x's shape), s_BR (f32) [ceil(K/128), R]: the scale of row r's tile b at s[b][r].
//   cols   the transpose, tiled along the rows within row segments (one per expert):
//          qT_CP (u8) [C, P], sT_BC (f32) [P / 128, C]. Segment j = rows [off[j], off[j+1]) starts
//          at column p_j = 128 * sum_{i<j} ceil(n_i / 128) of qT (each segment on a 128 boundary);
//          its rows form tiles of 128 from off[j] (the last may be shorter): qT[c][p_j + t] holds
//          x[off[j] + t][c] quantized with the scale sT[p_j / 128 + t / 128][c]. Columns between
//          segments are not written. P >= fp8_cols_width(R, S) always suffices.
//   blocks each matrix [O, I] of w ([O, I] or [E, O, I]) in 128 x 128 blocks (the last row and
//          column of blocks may be smaller): q (u8, w's shape), s (f32) [(E,) ceil(O/128),
//          ceil(I/128)]; optionally the transposed data qT [(E,) I, O] and scales sT [(E,)
//          ceil(I/128), ceil(O/128)] (the data gradient's operand).
//   packed the rows layout with each row's scales beside its codes, so that a row is one block of
//          bytes (moe.fp8_dispatch: tokens permuted and exchanged as FP8): u8 [R, W],
//          W = fp8_packed_width(K); row r holds its K codes at bytes [0, K), its ceil(K/128) f32
//          scales from byte fp8_packed_scales_at(K), zeros elsewhere. Same codes and scales as rows.
#pragma once

#include <cstdint>

#include "moefold/core/exec.h"
#include "moefold/core/memory.h"
#include "moefold/core/tensor.h"

namespace moefold {

inline constexpr int64_t kFp8Tile = 128;
inline constexpr float kFp8E4m3Max = 448.0f;

// E4M3 ("fn" variant: no infinities, 0x7f / 0xff are NaN). Round to nearest even; finite values
// beyond +-448 saturate to +-448 (as __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)); NaN
// gives 0x7f; infinities saturate.
uint8_t e4m3_from_float(float x);
float e4m3_to_float(uint8_t q);
// The scale of a tile whose largest magnitude is amax (the header's rule; non-finite amax: 1, the
// values saturate).
float fp8_tile_scale(float amax);
// Columns of qT that fp8_quantize_cols needs at most for R rows in S segments.
inline int64_t fp8_cols_width(int64_t rows, int64_t segments) {
  return (rows + segments * (kFp8Tile - 1) + kFp8Tile - 1) / kFp8Tile * kFp8Tile;
}

// The packed layout's scale offset and row width (bytes; multiples of 16).
inline int64_t fp8_packed_scales_at(int64_t k) { return (k + 15) / 16 * 16; }
inline int64_t fp8_packed_width(int64_t k) {
  return fp8_packed_scales_at(k) + (4 * ((k + kFp8Tile - 1) / kFp8Tile) + 15) / 16 * 16;
}

// ---- quantization (x, w: f32, f64 (CPU) or bf16; q u8; scales f32; all on one device) ----------
void fp8_quantize_rows(const ExecContext& ctx, const Tensor& x_RK, const Tensor& q_RK, const Tensor& s_BR);
// offsets_S1: i64 [S + 1], on x's device, off[0] = 0, off[S] = R, non-decreasing (the GPU trusts them).
void fp8_quantize_cols(const ExecContext& ctx, const Tensor& x_RC, const Tensor& offsets_S1, const Tensor& qT_CP,
                       const Tensor& sT_BC);
// qT and sT may be undefined (not wanted). via_bf16: w's values rounded to bf16 first (an f32
// master quantized into the codes its bf16 copy would give: train.fp8_param).
void fp8_quantize_blocks(const ExecContext& ctx, const Tensor& w, const Tensor& q, const Tensor& s, const Tensor& qT,
                         const Tensor& sT, bool via_bf16 = false);
// ---- FP8-only weights under the distributed optimizer (train.fp8_param, AdamW) ----------------
// A rank updates a flat part of a weight: elements [first, first + part.numel()) of the whole
// weight of shape `whole` ([O, I] or [E, O, I]; part a contiguous f32, f64 or bf16 tensor). Its
// blocks' codes come out as fp8_quantize_blocks's of the whole weight would, in four steps: each
// rank's fp8_block_amax, a max over the ranks, fp8_scales_from_amax, each rank's
// fp8_quantize_part (then the codes gathered), fp8_transpose_blocks for the transposed operands.
// amax (f32, fp8_block_scale_shape(whole, false)): amax[b] = max(amax[b], |v|) over the part's
// values v in block b (rounded to bf16 first with via_bf16); a non-finite v counts as +infinity.
// The caller zeroes amax before the first part.
void fp8_block_amax(const ExecContext& ctx, const Tensor& part, const Shape& whole, int64_t first, const Tensor& amax,
                    bool via_bf16 = false);
// In place, any f32 tensor: each amax to its block's scale (fp8_tile_scale; +infinity -> 1).
void fp8_scales_from_amax(const ExecContext& ctx, const Tensor& amax_to_scale);
// q_part (u8, part's numel): part's codes, e4m3(v / s[its block]), s (f32, fp8_block_scale_shape(whole,
// false)) the scales of the whole weight's blocks.
void fp8_quantize_part(const ExecContext& ctx, const Tensor& part, const Shape& whole, int64_t first, const Tensor& s,
                       const Tensor& q_part, bool via_bf16 = false);
// qT and sT of fp8_quantize_blocks from its q and s (a transpose of each matrix and of its scales).
void fp8_transpose_blocks(const ExecContext& ctx, const Tensor& q, const Tensor& s, const Tensor& qT, const Tensor& sT);
// x_RK [R, K] into the packed layout p_RW (u8 [R, fp8_packed_width(K)]).
void fp8_quantize_packed(const ExecContext& ctx, const Tensor& x_RK, const Tensor& p_RW);
// h = swiglu(gu) (GateUp::pairs, ops.h swiglu_forward: rounded to gu's dtype) into the packed layout
// p_RW (u8 [R, fp8_packed_width(F)]): what swiglu_forward followed by fp8_quantize_packed gives,
// in one pass on the GPU (bf16 gu; the FP8 experts' fc2 input).
void fp8_swiglu_packed(const ExecContext& ctx, const Tensor& gu_R2F, const Tensor& p_RW);
// The inverses (x = q * s, written in x's float dtype): for the tests and the CPU's emulation.
void fp8_dequantize_packed(const ExecContext& ctx, const Tensor& p_RW, const Tensor& x_RK);
void fp8_dequantize_rows(const ExecContext& ctx, const Tensor& q_RK, const Tensor& s_BR, const Tensor& x_RK);
void fp8_dequantize_cols(const ExecContext& ctx, const Tensor& qT_CP, const Tensor& sT_BC, const Tensor& offsets_S1,
                         const Tensor& x_RC);
void fp8_dequantize_blocks(const ExecContext& ctx, const Tensor& q, const Tensor& s, const Tensor& w);

// ---- FP8 linear layers (same shapes and gradient rule as linear_* and grouped_linear_*) ---------
// Q_rows / Q_cols / Q_blocks: quantized as above and dequantized. Every product of two E4M3 values
// is exact; the GPU sums each 128-long block of the reduction in the tensor cores, multiplies the
// block's partial sum by the two scales and adds it to an f32 accumulator (the "promotion" of
// DeepSeek-V3's recipe); the CPU sums the dequantized operands in f32 (or f64).
//   forward  y_NO  = Q_rows(x, along I) @ Q_blocks(w)^T
//   dgrad    dx_NI = Q_rows(dy, along O) @ Q_blocks(w)          (WRITTEN)
//   wgrad    dw_OI += Q_cols(dy)^T @ Q_cols(x), the reduction over tokens tiled per 128 rows
//            (per expert segment in the grouped ops); accumulate == false: written.
// y, dx: x's dtype (bf16 on the GPU); w: x's dtype; dw: f32 or w's dtype. dx or dw undefined:
// skipped. The grouped ops take the experts' row segments from offsets_E1 as grouped_linear_*.
// GPU: I and O multiples of 16; needs a build with CUTLASS (else a clear error).
// x may come quantized already: packed rows (u8 [R, fp8_packed_width(I)], fp8_quantize_packed's),
// the forward's operand as it is (the same codes and scales that Q_rows(x) would give), and the
// weight gradient's Q_cols of its dequantized values (an exact dequantization: DeepSeek-V3's
// requantization of dispatched FP8 tokens). y and dx then take w's dtype.
// wq: w already quantized (an Fp8Param's; REQUIRES: fp8_quantize_blocks of this w), or null. A weight
// kept only in FP8 (train.fp8_param: w has no data) needs it.
// xin (dense ops, bf16 x): x's operands shared with the other linears that read the same x
// (Fp8SharedOperands below), or null.
struct Fp8SharedOperands;
void fp8_linear_forward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO,
                        const Fp8Weight* wq = nullptr, Fp8SharedOperands* xin = nullptr);
void fp8_linear_backward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO,
                         const Tensor& dx_NI, const Tensor& dw_OI, bool accumulate = true,
                         const Fp8Weight* wq = nullptr, Fp8SharedOperands* xin = nullptr);
void fp8_grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                const Tensor& offsets_E1, const Tensor& y_RO, const Fp8Weight* wq = nullptr);
// dyq (grouped backward, bf16 dy): dy's cols operand carried from a call computing dx alone to the
// call computing dw alone that follows it with the same dy and offsets (the experts' backward,
// split around the input gradient's exchange): the first quantizes dy in both layouts in one pass,
// the cols into dyq's bytes (fp8_shared_operand_bytes(R, O, E); cols_ready), the second reads them.
// Null or without bytes: each call quantizes what it needs.
void fp8_grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                 const Tensor& offsets_E1, const Tensor& dy_RO, const Tensor& dx_RI,
                                 const Tensor& dw_EOI, bool accumulate = true, const Fp8Weight* wq = nullptr,
                                 Fp8SharedOperands* dyq = nullptr);

// A tensor's FP8 operands made once and read by several calls: an activation x that several FP8
// linears read (attention's q, k and v projections, MLA's two down projections; below), or an
// output gradient carried across the experts' split backward (dyq above). For x: the forwards
// share x's rows operand, the weight gradients its cols operand (one segment of all rows); the first call that
// needs one after reset() quantizes it into `bytes` (u8, fp8_shared_operand_bytes(rows, cols) of
// them, on x's device; one operand at a time: making one drops the other), the others read it. The
// owner resets whenever x may have changed (REQUIRES: the calls between two resets pass the same x).
// Both ready at once (fp8_swiglu_backward_operands below) means both held in the pair layout: the
// rows operand first, the cols operand after it (fp8_shared_operand_bytes(..., both = true)).
// The same results as without it: the CPU's emulation quantizes at every call, and so does a call
// given no bytes.
struct Fp8SharedOperands {
  Tensor bytes;
  bool rows_ready = false, cols_ready = false;
  void reset() { rows_ready = cols_ready = false; }
};
// Bytes for x [rows, cols]'s rows operand or its cols operand in `segments` row segments (the
// larger), or with `both` the two together (the pair layout).
int64_t fp8_shared_operand_bytes(int64_t rows, int64_t cols, int64_t segments = 1, bool both = false);

// The FP8 experts' SwiGLU backward straight into fc1's output-gradient operands: dgu =
// swiglu_backward(gu, dh) in the GateUp::pairs layout (ops.h) is the dy of the two
// fp8_grouped_linear_backward calls that follow with dy = dgu_R2F, the same offsets and dyq (the
// data gradient's, then the weight gradient's). On the GPU, where one pass serves (bf16, 2F a
// multiple of 4, aligned, dyq's bytes fp8_shared_operand_bytes(R, 2F, E, true)), dgu itself is NOT
// written: the pass leaves its rows operand and its cols operand (per expert) in dyq, both ready,
// and the calls read them (the same bits as quantizing the written dgu). Elsewhere (the CPU, other
// shapes) dgu is written and dyq reset. REQUIRES: nothing but those two calls reads dgu.
void fp8_swiglu_backward_operands(const ExecContext& ctx, const Tensor& gu_R2F, const Tensor& dh_RF,
                                  const Tensor& offsets_E1, const Tensor& dgu_R2F, Fp8SharedOperands& dyq);
// Where an operand of `codes` bytes and `scales` floats keeps them inside a block of fp8_shared_operand_bytes
// (both start on 256-byte boundaries; the scales after the codes): the scales' byte offset, and the
// bytes the operand takes.
inline int64_t fp8_operand_scales_at(int64_t codes) { return (codes + 255) / 256 * 256; }
inline int64_t fp8_operand_bytes(int64_t codes, int64_t scales) {
  return fp8_operand_scales_at(codes) + (4 * scales + 255) / 256 * 256;
}

// A weight the forward reads in FP8 (a module's FP8 linear): registers the parameter with
// ParamSpec::fp8 and hands out its FP8 copy (Param::fp8, shared by every binding of the module),
// quantized at its first use after Memory::weights_changed() and reused by every later forward and
// backward until the next (a step's micro-batches, recomputed forwards). The copy is quantized from
// the compute copy, or, where Memory::set_fp8_params left none, from the master rounded to the
// compute dtype: the same codes and scales either way.
class Fp8Param {
 public:
  // Registers `spec` (with fp8 = on) as mem.param does and returns its compute tensor (with
  // train.fp8_param a shape without data: read only through get()). REQUIRES: from the module's bind.
  Tensor param(Memory& mem, ParamSpec spec, bool on);
  // The quantized weight (quantized now, on `on` or else mem.exec(), if the weights may have
  // changed), or null when registered off. A module running on another context than its Memory's
  // (moe.shared_expert_overlap) passes its own, so the quantization precedes its GEMMs there.
  const Fp8Weight* get(const ExecContext* on = nullptr) const;

 private:
  Memory* mem_ = nullptr;
  size_t index_ = 0;  // in mem_->params()
  bool on_ = false;
};

// Every FP8 copy of mem's parameters quantized now, on mem.exec(), where the weights may have
// changed since it was made: what each Fp8Param::get would do at its first use, done before it (a
// step replayed from CUDA graphs makes no host calls, so its graphs hold no quantization). The
// same codes and scales. REQUIRES: the compute copies (masters) hold the new weights.
void fp8_quantize_changed_params(Memory& mem);

// A module's linear layer in its train.fp8 choice: linear_forward / linear_backward (ops.h), or
// the FP8 ops above with the weight's FP8 copy when wq is given (Fp8Param::get()).
// xin: x's shared FP8 operands (FP8 only), or null.
void linear_forward_in(const ExecContext& ctx, const Fp8Weight* wq, const Tensor& x_NI, const Tensor& w_OI,
                       const Tensor& y_NO, Fp8SharedOperands* xin = nullptr);
void linear_backward_in(const ExecContext& ctx, const Fp8Weight* wq, const Tensor& x_NI, const Tensor& w_OI,
                        const Tensor& dy_NO, const Tensor& dx_NI, const Tensor& dw_OI,
                        Fp8SharedOperands* xin = nullptr);

}  // namespace moefold
