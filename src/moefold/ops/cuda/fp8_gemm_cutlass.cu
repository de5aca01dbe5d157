// The FP8 linear layers on the GPU (ops/fp8.h fp8_linear_* and fp8_grouped_linear_*): the
// operands quantized into scratch (fp8_quantize.cu), then CUTLASS's Hopper blockwise-scaled
// grouped GEMM (TMA + warp-specialised wgmma on E4M3, each 128-long block of the reduction summed
// in the tensor cores and promoted into an f32 accumulator with its two scales: DeepSeek-V3's
// recipe), one persistent launch for all experts; a dense layer is one group, unless cuBLASLt's
// block scaling serves it (kernels.fp8_dense_gemm, fp8_gemm_cublaslt.cu). x may also come as packed
// FP8 rows (moe.fp8_dispatch, the experts' fc2 input). Built when CMake found CUTLASS's headers
// (MOEFOLD_WITH_CUTLASS).
//
// Per expert e with rows [off[e], off[e+1]) (m_e of them), every operand K-major ("TN"), as CUTLASS
// sees each group (M, N, K) and its scales (SFA per 1 x 128 tile of A, SFB per GranN x 128 of B):
//   forward  y_e  = x_e @ w_e^T      (m_e, O, I): A = rows of x, B = blocks of w (q), D = y bf16;
//   dgrad    dx_e = dy_e @ w_e       (m_e, I, O): A = rows of dy, B = blocks of w (qT), D = dx bf16;
//   wgrad    dw_e += dy_e^T @ x_e    (O, I, m_e): A = cols of dy (qT), B = cols of x (qT), GranN = 1,
//                                                 C = D = dw_e (f32 or bf16), beta 1 or 0.
// Scale layouts. CUTLASS 4.2's grouped blockwise mainloop ignores the layout_SFA / layout_SFB
// arrays it is given and derives each group's scale layout from its problem shape: MN-major and
// packed, i.e. scale (mn, kb) of group e at ptr_SF[e][mn / Gran + kb * ceil(MN / Gran)]. So:
//   SFA of forward / dgrad: the rows scales in the grouped layout of launch_fp8_quantize_rows
//     (group e's [ceil(K/128), m_e] block at off[e] * ceil(K/128)); a dense layer's one group is
//     ops/fp8.h's rows layout itself;
//   SFB of forward: the blocks' transposed scales sT [ceil(I/128), ceil(O/128)] of expert e (N = O);
//   SFB of dgrad: the blocks' scales s [ceil(O/128), ceil(I/128)] of expert e (N = I);
//   SFA / SFB of wgrad: the cols scales sT_BC as they are (segment e's tiles from row p_e / 128,
//     C = O or I between tiles: exactly the packed stride M or N).
// The layout arrays are still filled with those same layouts (for a CUTLASS that reads them).
// The K tail: a group's K need not be a multiple of 128 (nor 16: wgrad's K = m_e): its TMA
// descriptor takes the group's K as the tensor's extent and zero-fills past it, and only the row
// stride (I, O or the cols width P, all multiples of 16) and the base address need 16 bytes;
// can_implement checks K % 16 only for problem shapes given on the host, which these calls never
// pass (the shapes live on the device).
#include <algorithm>
#include <cstdint>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/fp8.h"
#include "moefold/ops/fp8.h"

#ifdef MOEFOLD_WITH_CUTLASS
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "moefold/ops/cuda/cutlass_grouped.cuh"
#endif

namespace moefold::cuda {

#ifdef MOEFOLD_WITH_CUTLASS

bool fp8_gemm_built() { return true; }

namespace {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Problem = ProblemShape::UnderlyingProblemShape;

// Kernel schedules (core/kernel_options.h Fp8Tile): cooperative (both consumer warp groups share a
// 128-row tile) or ping-pong (each consumer warp group owns a 64-row tile; one's epilogue runs
// beside the other's mainloop).
struct Cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using Tile = cute::Shape<_128, _128, _128>;
};
struct PingPong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
  using Tile = cute::Shape<_64, _128, _128>;
};
using Pair = cute::Shape<_2, _1, _1>;  // two CTAs of adjacent M tiles share B's tile loads (TMA multicast)
using One = cute::Shape<_1, _1, _1>;

// One FP8 grouped GEMM configuration: E4M3 A (M x K) and B (N x K), both K-major; f32 accumulation
// with the blockwise promotion; scales per 1 x 128 of A and kGranN x 128 of B (MN-major);
// D = acc + beta * C in ElementOut. The K tile is 128 (one scale block per k-tile, as the
// mainloop requires); the M x N tile and the cluster come from the schedule and kernels.fp8_tile.
template <int kGranN, class ElementOut, class Schedule, class ClusterShape_>
struct Fp8Grouped {
  using ElementIn = cutlass::float_e4m3_t;
  using Out = ElementOut;  // C and D
  using Acc = float;
  static constexpr int kAlignIn = 16;  // 16 bytes of E4M3
  static constexpr int kAlignOut = 16 / static_cast<int>(sizeof(ElementOut));
  using TileShape = typename Schedule::Tile;
  using ClusterShape = ClusterShape_;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kGranN, 128>;  // MN-major SFA and SFB
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc, ElementOut, cutlass::layout::RowMajor*, kAlignOut,
      ElementOut, cutlass::layout::RowMajor*, kAlignOut, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn,
      cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>, kAlignIn, ElementIn,
      cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>, kAlignIn, Acc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;  // (lda, 1, 0): K contiguous
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Thread = decltype(std::declval<typename Gemm::Arguments>().epilogue.thread);
};

// Calls run.template operator()<Fp8Grouped<kGranN, Out, ...>>() in configuration `tile`.
template <int kGranN, class Out, class Run>
void with_fp8_tile(Fp8Tile tile, const Run& run) {
  switch (tile) {
    case Fp8Tile::cooperative:
    case Fp8Tile::own:        // a shape the own kernel does not serve: the default configuration
    case Fp8Tile::automatic:  // where own does not pay (rows), and the weight gradient's (cols)
      return run.template operator()<Fp8Grouped<kGranN, Out, Cooperative, Pair>>();
    case Fp8Tile::cooperative_1x1:
      return run.template operator()<Fp8Grouped<kGranN, Out, Cooperative, One>>();
    case Fp8Tile::pingpong:
      return run.template operator()<Fp8Grouped<kGranN, Out, PingPong, Pair>>();
  }
}

enum class Kind : int { forward, dgrad, wgrad };

// The per-group argument arrays of one call, carved from one scratch block.
template <class G>
struct Arrays {
  using In = typename G::ElementIn;
  using Out = typename G::Out;
  Problem* problems;
  const In** a;
  const In** b;
  const float** sfa;
  const float** sfb;
  const Out** c;
  Out** d;
  typename G::StrideA* sa;
  typename G::StrideB* sb;
  typename G::StrideC* sc;
  typename G::StrideD* sd;
  typename G::LayoutSFA* lsfa;
  typename G::LayoutSFB* lsfb;

  static size_t bytes(int64_t e_n) {
    cutlass_grouped::ArgCarver measure(nullptr, e_n);
    take(measure);
    return measure.bytes();
  }
  static Arrays carve(void* base, int64_t e_n) {
    cutlass_grouped::ArgCarver arrays(base, e_n);
    return take(arrays);
  }
  // Every array, in one order for measuring and carving.
  static Arrays take(cutlass_grouped::ArgCarver& arrays) {
    Arrays a;
    a.problems = arrays.take<Problem>();
    a.a = arrays.take<const In*>();
    a.b = arrays.take<const In*>();
    a.sfa = arrays.take<const float*>();
    a.sfb = arrays.take<const float*>();
    a.c = arrays.take<const Out*>();
    a.d = arrays.take<Out*>();
    a.sa = arrays.take<typename G::StrideA>();
    a.sb = arrays.take<typename G::StrideB>();
    a.sc = arrays.take<typename G::StrideC>();
    a.sd = arrays.take<typename G::StrideD>();
    a.lsfa = arrays.take<typename G::LayoutSFA>();
    a.lsfb = arrays.take<typename G::LayoutSFB>();
    return a;
  }
};

// The quantized operands of one GEMM kind (device pointers) and the shapes that place each group.
struct Operands {
  const uint8_t* a = nullptr;  // rows: [R, K] (row stride lda); cols: qT [M, p]
  int64_t lda = 0;             // forward: A's row stride (K, or the packed rows' width)
  const float* sfa = nullptr;
  const uint8_t* b = nullptr;  // blocks: [E, N, K]; cols: qT [N, p]
  const float* sfb = nullptr;
  void* d = nullptr;              // y, dx or dw
  const int64_t* off = nullptr;   // [e_n + 1] on the device, or nullptr: one group of `rows` rows
  int64_t rows = 0;               // R
  int64_t p = 0;                  // wgrad: the cols layout's width
  int e_n = 0, i_n = 0, o_n = 0;  // groups (experts), the weight's I and O
};

// Group e's (M, N, K), operands, scales, leading dimensions (elements) and layouts. `skip`: no tiles.
template <class G>
__device__ void set_group(const Arrays<G>& arr, int e, int m, int n, int k, const uint8_t* a, int64_t lda,
                          const float* sfa, const uint8_t* b, int64_t ldb, const float* sfb, typename G::Out* d,
                          bool skip) {
  arr.problems[e] = Problem(skip ? 0 : m, n, k);
  arr.a[e] = reinterpret_cast<const typename G::ElementIn*>(a);
  arr.b[e] = reinterpret_cast<const typename G::ElementIn*>(b);
  arr.sfa[e] = sfa;
  arr.sfb[e] = sfb;
  arr.c[e] = d;
  arr.d[e] = d;
  arr.sa[e] = cute::make_stride(lda, cute::Int<1>{}, cute::Int<0>{});
  arr.sb[e] = cute::make_stride(ldb, cute::Int<1>{}, cute::Int<0>{});
  arr.sc[e] = cutlass::make_cute_packed_stride(typename G::StrideC{}, cute::make_shape(m, n, 1));
  arr.sd[e] = cutlass::make_cute_packed_stride(typename G::StrideD{}, cute::make_shape(m, n, 1));
  arr.lsfa[e] = G::ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, k, 1));
  arr.lsfb[e] = G::ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, k, 1));
}

__device__ __forceinline__ int64_t tiles_of(int64_t n) { return (n + kFp8Tile - 1) / kFp8Tile; }

// One thread per group.
template <class G, Kind kKind>
__global__ void build_fp8_args(Arrays<G> arr, Operands op) {
  const int e = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= op.e_n) return;
  const int64_t begin = op.off != nullptr ? op.off[e] : 0;
  const int m = static_cast<int>(op.off != nullptr ? op.off[e + 1] - begin : op.rows);
  const int64_t ib = tiles_of(op.i_n), ob = tiles_of(op.o_n);
  const int64_t we = static_cast<int64_t>(e) * op.o_n * op.i_n;  // expert e's weight matrix
  auto* d = static_cast<typename G::Out*>(op.d);
  if constexpr (kKind == Kind::forward) {  // y_e = x_e @ w_e^T: (m, O, I)
    set_group<G>(arr, e, m, op.o_n, op.i_n, op.a + begin * op.lda, op.lda, op.sfa + begin * ib, op.b + we, op.i_n,
                 op.sfb + e * ib * ob, d + begin * op.o_n, false);
  } else if constexpr (kKind == Kind::dgrad) {  // dx_e = dy_e @ w_e: (m, I, O), B = w_e^T stored [I, O]
    set_group<G>(arr, e, m, op.i_n, op.o_n, op.a + begin * op.o_n, op.o_n, op.sfa + begin * ob, op.b + we, op.o_n,
                 op.sfb + e * ob * ib, d + begin * op.i_n, false);
  } else {  // dw_e += dy_e^T @ x_e: (O, I, m); segment e starts at column p_e of the cols layout
    int64_t p_e = 0;
    if (op.off != nullptr)
      for (int j = 0; j < e; ++j) p_e += tiles_of(op.off[j + 1] - op.off[j]) * kFp8Tile;
    set_group<G>(arr, e, op.o_n, op.i_n, m, op.a + p_e, op.p, op.sfa + p_e / kFp8Tile * op.o_n, op.b + p_e, op.p,
                 op.sfb + p_e / kFp8Tile * op.i_n, d + we, m == 0);
  }
}

// Builds the group arguments on the device and runs one grouped GEMM of kind kKind.
template <class G, Kind kKind>
void run_fp8(const ExecContext& ctx, const Operands& op, float beta, const char* what) {
  Arrays<G> arr = Arrays<G>::carve(ctx.scratch(ScratchSlot::fp8_gemm_args, Arrays<G>::bytes(op.e_n)), op.e_n);
  constexpr int kThreads = 128;
  build_fp8_args<G, kKind><<<static_cast<unsigned>(ceil_div(op.e_n, kThreads)), kThreads, 0, stream_of(ctx)>>>(arr, op);
  MF_CUDA_LAUNCHED(what);
  typename G::Thread thread;
  thread.alpha = 1.0f;
  thread.beta = beta;
  typename G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                   {op.e_n, arr.problems, nullptr},
                                   {arr.a, arr.sa, arr.b, arr.sb, arr.sfa, arr.lsfa, arr.sfb, arr.lsfb},
                                   {thread, arr.c, arr.sc, arr.d, arr.sd},
                                   cutlass_grouped::hardware_info(ctx)};
  cutlass_grouped::run_gemm<typename G::Gemm>(ctx, args, what);
}

// ---- operands in scratch -----------------------------------------------------------------------

// A quantized operand: `codes` bytes of E4M3 and `scales` floats (ops/fp8.h fp8_operand_bytes's
// layout), in a scratch slot or a shared input's bytes.
struct Quantized {
  uint8_t* q;
  float* s;
};
struct Counts {  // an operand's size in elements
  int64_t codes, scales;
};
size_t operand_bytes(Counts n) { return static_cast<size_t>(fp8_operand_bytes(n.codes, n.scales)); }
Quantized operand_at(char* base, Counts n) {
  return {reinterpret_cast<uint8_t*>(base), reinterpret_cast<float*>(base + fp8_operand_scales_at(n.codes))};
}
// x's operand in a shared input's bytes (ops/fp8.h Fp8SharedOperands; the entry point checked its size).
Quantized shared_operand(const Fp8SharedOperands& xin, Counts n) {
  return operand_at(static_cast<char*>(xin.bytes.data()), n);
}
bool shares(const Fp8SharedOperands* xin) { return xin != nullptr && xin->bytes.defined(); }
// Both operands in a shared operand's pair layout (ops/fp8.h: the rows first).
struct RowsAndCols {
  Quantized rows, cols;
};
RowsAndCols shared_pair(const Fp8SharedOperands& xin, Counts rows, Counts cols) {
  char* base = static_cast<char*>(xin.bytes.data());
  return {operand_at(base, rows), operand_at(base + operand_bytes(rows), cols)};
}
Quantized quantized_scratch(const ExecContext& ctx, ScratchSlot slot, int64_t codes, int64_t scales) {
  const Counts n{codes, scales};
  return operand_at(static_cast<char*>(ctx.scratch(slot, operand_bytes(n))), n);
}
// Two operands in one slot, the second after the first.
RowsAndCols quantized_pair_scratch(const ExecContext& ctx, ScratchSlot slot, Counts rows, Counts cols) {
  char* base = static_cast<char*>(ctx.scratch(slot, operand_bytes(rows) + operand_bytes(cols)));
  return {operand_at(base, rows), operand_at(base + operand_bytes(rows), cols)};
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// x given as packed FP8 rows (ops/fp8.h) rather than bf16 values.
bool packed(const Tensor& x) { return x.dtype() == DType::u8; }
// O and I of a weight [O, I] or [E, O, I].
int64_t matrix_rows(const Tensor& w) { return w.size(w.ndim() == 3 ? 1 : 0); }
int64_t matrix_cols(const Tensor& w) { return w.size(w.ndim() == 3 ? 2 : 1); }

// The GPU's conditions on one FP8 linear call (the entry point checked shapes and devices): the
// dtypes and widths are the model's (an Error naming them); alignment is the allocator's.
void check_gpu_operands(const Tensor& x, const Tensor& w, const Tensor& dy_or_y, const Tensor& dx, const Tensor& dw,
                        const char* what) {
  const int64_t o_n = matrix_rows(w), i_n = matrix_cols(w);
  if ((x.dtype() != DType::bf16 && !packed(x)) || w.dtype() != DType::bf16 || dy_or_y.dtype() != DType::bf16)
    MF_FAIL(what, " on the GPU: x ", x.str(), ", w ", w.str(), ", y / dy ", dy_or_y.str(),
            " (the FP8 GEMMs take bf16; f32 and f64 run on the CPU)");
  if (dw.defined() && dw.dtype() != DType::f32 && dw.dtype() != DType::bf16)
    MF_FAIL(what, " on the GPU: dw ", dw.str(), " (f32 or bf16)");
  if (i_n % 16 != 0 || o_n % 16 != 0)
    MF_FAIL(what, " on the GPU: I = ", i_n, " and O = ", o_n,
            " must be multiples of 16 (TMA moves rows of 16-byte multiples of E4M3)");
  for (const Tensor* t : {&x, &w, &dy_or_y, &dx, &dw})
    MF_CHECK(!t->defined() || aligned16(t->data()), what, " on the GPU: ", t->str(), " is not 16-byte aligned");
}

// Whether a dense layer's GEMM out[m, n] (K = k) runs on cuBLASLt's block scaling.
bool dense_on_cublaslt(const ExecContext& ctx, const int64_t* off, int64_t m, int64_t n, int64_t k) {
  return off == nullptr && ctx.kernels().fp8_dense_gemm == Fp8DenseGemm::cublaslt && lt_fp8_gemm_serves(m, n, k);
}

// out[m, n] = a[m, k] b[n, k]^T on cuBLASLt with b a weight in 128 x 128 blocks (scales
// s_blocks [n/128, k/128], padded here into scratch); false: nothing ran.
bool lt_blocks(const ExecContext& ctx, const uint8_t* a, int64_t lda, const float* sa, int64_t m, const uint8_t* b,
               int64_t ldb, const float* s_blocks, int64_t n, int64_t k, const Tensor& out, float beta) {
  const int64_t nb = ceil_div(n, kFp8Tile), kb = ceil_div(k, kFp8Tile);
  auto* padded = static_cast<float*>(
      ctx.scratch(ScratchSlot::fp8_gemm_args, static_cast<size_t>(nb * fp8_lt_block_ld(kb)) * sizeof(float)));
  fp8_lt_block_scales(ctx, s_blocks, nb, kb, padded);
  return lt_fp8_gemm(ctx, m, n, k, a, lda, sa, b, ldb, padded, true, out.data(), out.dtype(), beta);
}

// Whether a rows GEMM (forward or dgrad: n output columns, reduction k, A's row stride lda; off:
// the experts' offsets, null for a dense layer) runs on moefold's own kernel (kernels.fp8_tile rows
// = own, or auto for the experts' GEMMs where own_fp8_pays; shapes it does not serve stay on
// CUTLASS).
bool own_rows(const ExecContext& ctx, const int64_t* off, int64_t e_n, int64_t n, int64_t k, int64_t lda) {
  const Fp8Tile rows = ctx.kernels().fp8_tiles.rows;
  return (rows == Fp8Tile::own || (rows == Fp8Tile::automatic && off != nullptr && own_fp8_pays(n, k))) &&
         own_fp8_gemm_serves(e_n, n, k, lda);
}

// The weight's operand for the forward (q; CUTLASS reads it with the transposed block scales sT,
// cuBLASLt with s) or, transposed, for the data gradient (qT; CUTLASS with s, cuBLASLt with sT):
// the cached copy wq's (Fp8Param), or w quantized into scratch now (s_lt only when `lt`).
struct WeightOperand {
  const uint8_t* q;
  const float* s;     // CUTLASS's scales
  const float* s_lt;  // cuBLASLt's
};
WeightOperand weight_operand(const ExecContext& ctx, const Tensor& w, const Fp8Weight* wq, int64_t e_n, int64_t o_n,
                             int64_t i_n, bool transposed, bool lt) {
  if (wq != nullptr && wq->defined())
    return transposed ? WeightOperand{wq->qT.ptr<uint8_t>(), wq->s.ptr<float>(), wq->sT.ptr<float>()}
                      : WeightOperand{wq->q.ptr<uint8_t>(), wq->sT.ptr<float>(), wq->s.ptr<float>()};
  const int64_t n = e_n * ceil_div(o_n, kFp8Tile) * ceil_div(i_n, kFp8Tile);  // scales of one orientation
  const Quantized qw = quantized_scratch(ctx, ScratchSlot::fp8_operand_b, e_n * o_n * i_n, 2 * n);
  float* s_lt = lt ? qw.s + n : nullptr;
  if (transposed)  // qT with s (and sT)
    launch_fp8_quantize_blocks(ctx, w.data(), w.dtype(), e_n, o_n, i_n, nullptr, qw.s, qw.q, s_lt, false);
  else  // q with sT (and s)
    launch_fp8_quantize_blocks(ctx, w.data(), w.dtype(), e_n, o_n, i_n, qw.q, s_lt, nullptr, qw.s, false);
  return {qw.q, qw.s, s_lt};
}

// y = x @ w^T per group (off: [e_n + 1] device offsets, or nullptr: one group of all rows).
void forward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const int64_t* off, int64_t e_n, const Tensor& y,
             const Fp8Weight* wq, Fp8SharedOperands* xin, const char* what) {
  check_gpu_operands(x, w, y, Tensor(), Tensor(), what);
  const int64_t r_n = x.size(0), i_n = matrix_cols(w), o_n = matrix_rows(w);
  if (r_n == 0 || e_n == 0) return;
  const int64_t ib = ceil_div(i_n, kFp8Tile);
  Quantized qx;
  int64_t lda = i_n;
  if (packed(x)) {  // the codes as they are (row stride: the packed width), the scales regrouped
    qx = quantized_scratch(ctx, ScratchSlot::fp8_operand_a, 0, ib * r_n);
    qx.q = x.ptr<uint8_t>();
    lda = x.size(1);
    launch_fp8_packed_scales(ctx, qx.q, r_n, i_n, qx.s, off, e_n);
  } else if (shares(xin)) {  // quantized by the first of the linears reading x
    qx = shared_operand(*xin, {r_n * i_n, ib * r_n});
    if (!xin->rows_ready) {
      launch_fp8_quantize_rows(ctx, x.data(), x.dtype(), r_n, i_n, qx.q, qx.s, off, e_n);
      xin->rows_ready = true, xin->cols_ready = false;
    }
  } else {
    qx = quantized_scratch(ctx, ScratchSlot::fp8_operand_a, r_n * i_n, ib * r_n);
    launch_fp8_quantize_rows(ctx, x.data(), x.dtype(), r_n, i_n, qx.q, qx.s, off, e_n);
  }
  const bool lt = dense_on_cublaslt(ctx, off, r_n, o_n, i_n);
  const WeightOperand qw = weight_operand(ctx, w, wq, e_n, o_n, i_n, false, lt);
  if (lt && lt_blocks(ctx, qx.q, lda, qx.s, r_n, qw.q, i_n, qw.s_lt, o_n, i_n, y, 0.0f)) return;
  if (own_rows(ctx, off, e_n, o_n, i_n, lda))
    return own_fp8_grouped_gemm(ctx, qx.q, lda, qx.s, r_n, off, e_n, qw.q, qw.s, o_n, i_n, y.data(), what);
  Operands op;
  op.a = qx.q, op.lda = lda, op.sfa = qx.s, op.b = qw.q, op.sfb = qw.s, op.d = y.data(), op.off = off, op.rows = r_n;
  op.e_n = static_cast<int>(e_n), op.i_n = static_cast<int>(i_n), op.o_n = static_cast<int>(o_n);
  with_fp8_tile<128, cutlass::bfloat16_t>(ctx.kernels().fp8_tiles.rows,
                                          [&]<class G>() { run_fp8<G, Kind::forward>(ctx, op, 0.0f, what); });
}

// dx = dy @ w and dw (+)= dy^T @ x per group; dx or dw undefined: skipped.
void backward(const ExecContext& ctx, const Tensor& x, const Tensor& w, const int64_t* off, int64_t e_n,
              const Tensor& dy, const Tensor& dx, const Tensor& dw, bool accumulate, const Fp8Weight* wq,
              Fp8SharedOperands* xin, Fp8SharedOperands* dyq, const char* what) {
  check_gpu_operands(x, w, dy, dx, dw, what);
  const int64_t r_n = x.size(0), i_n = matrix_cols(w), o_n = matrix_rows(w);
  if (e_n == 0) return;
  if (r_n == 0) {
    if (dw.defined() && !accumulate) MF_CUDA_CHECK(cudaMemsetAsync(dw.data(), 0, dw.nbytes(), stream_of(ctx)));
    return;
  }
  const int64_t ob = ceil_div(o_n, kFp8Tile), segments = off != nullptr ? e_n : 1;
  const int64_t p = fp8_cols_width(r_n, segments);  // the weight gradient's reduction, padded per segment
  Operands op;
  op.off = off, op.rows = r_n;
  op.e_n = static_cast<int>(e_n), op.i_n = static_cast<int>(i_n), op.o_n = static_cast<int>(o_n);
  // dy's two operands (rows for the data gradient, cols for the weight gradient) from one read of
  // dy where both are wanted: both in dgrad's slot (the cols after the rows), or the cols in dyq's
  // bytes for the weight gradient's call to come.
  const Counts dy_rows_n{r_n * o_n, ob * r_n}, dy_cols_n{o_n * p, p / kFp8Tile * o_n};
  // Both of dy's operands made before the call (fp8_swiglu_backward_operands: the pair layout).
  const bool made = shares(dyq) && dyq->rows_ready && dyq->cols_ready;
  Quantized dy_cols{};
  if (dx.defined()) {
    Quantized qdy{};
    if (shares(dyq) && !made) dyq->cols_ready = false;  // an earlier dy's are stale now, whatever this call leaves
    const bool one_pass = fp8_rows_cols_fused_serves(dy.dtype(), o_n, dy.data(), nullptr);
    if (made) {  // read in place; the cols stay for the weight gradient's call
      const RowsAndCols both = shared_pair(*dyq, dy_rows_n, dy_cols_n);
      qdy = both.rows;
      if (dw.defined()) dy_cols = both.cols, dyq->reset();
    } else if (one_pass && (dw.defined() || shares(dyq))) {
      if (dw.defined()) {
        const RowsAndCols both = quantized_pair_scratch(ctx, ScratchSlot::fp8_operand_a, dy_rows_n, dy_cols_n);
        qdy = both.rows, dy_cols = both.cols;
      } else {
        qdy = quantized_scratch(ctx, ScratchSlot::fp8_operand_a, dy_rows_n.codes, dy_rows_n.scales);
        dy_cols = shared_operand(*dyq, dy_cols_n);
        dyq->cols_ready = true, dyq->rows_ready = false;
      }
      launch_fp8_quantize_rows_cols(ctx, dy.data(), dy.dtype(), r_n, o_n, off, segments, true, qdy.q, qdy.s, p,
                                    dy_cols.q, dy_cols.s);
    } else {
      qdy = quantized_scratch(ctx, ScratchSlot::fp8_operand_a, r_n * o_n, ob * r_n);
      launch_fp8_quantize_rows(ctx, dy.data(), dy.dtype(), r_n, o_n, qdy.q, qdy.s, off, e_n);
    }
    const bool lt = dense_on_cublaslt(ctx, off, r_n, i_n, o_n);
    const WeightOperand qw = weight_operand(ctx, w, wq, e_n, o_n, i_n, true, lt);
    if (lt && lt_blocks(ctx, qdy.q, o_n, qdy.s, r_n, qw.q, o_n, qw.s_lt, i_n, o_n, dx, 0.0f)) {
      // done on cuBLASLt
    } else if (own_rows(ctx, off, e_n, i_n, o_n, o_n)) {
      own_fp8_grouped_gemm(ctx, qdy.q, o_n, qdy.s, r_n, off, e_n, qw.q, qw.s, i_n, o_n, dx.data(), what);
    } else {
      op.a = qdy.q, op.sfa = qdy.s, op.b = qw.q, op.sfb = qw.s, op.d = dx.data();
      with_fp8_tile<128, cutlass::bfloat16_t>(ctx.kernels().fp8_tiles.rows,
                                              [&]<class G>() { run_fp8<G, Kind::dgrad>(ctx, op, 0.0f, what); });
    }
  }
  if (!dw.defined()) return;
  const bool dw16 = dw.dtype() == DType::bf16;
  // Written (beta = 0: the epilogue does not read dw): an expert without rows gets no tiles, so
  // its dw is zeroed here (the offsets are read on the device).
  if (!accumulate && off != nullptr) {
    const char* zero = "fp8 wgrad (zero empty experts)";
    if (dw16)
      cutlass_grouped::zero_empty_experts(ctx, static_cast<__nv_bfloat16*>(dw.data()), off, e_n, o_n * i_n, zero);
    else
      cutlass_grouped::zero_empty_experts(ctx, dw.ptr<float>(), off, e_n, o_n * i_n, zero);
  }
  // The slots of dgrad's operands are reused: this stream ran (or queued) dgrad before.
  Quantized qdy = dy_cols;
  if (qdy.q == nullptr && !dx.defined() && shares(dyq) && dyq->cols_ready) {  // made by an earlier call
    qdy = made ? shared_pair(*dyq, dy_rows_n, dy_cols_n).cols : shared_operand(*dyq, dy_cols_n);
    dyq->reset();
  }
  if (qdy.q == nullptr) {
    qdy = quantized_scratch(ctx, ScratchSlot::fp8_operand_a, o_n * p, p / kFp8Tile * o_n);
    launch_fp8_quantize_cols(ctx, dy.data(), dy.dtype(), r_n, o_n, off, segments, p, qdy.q, qdy.s);
  }
  const Counts x_cols{i_n * p, p / kFp8Tile * i_n};
  Quantized qx{};
  if (packed(x)) {  // Q_cols of the packed rows' values, read from the codes and scales
    qx = quantized_scratch(ctx, ScratchSlot::fp8_operand_b, x_cols.codes, x_cols.scales);
    launch_fp8_quantize_cols_packed(ctx, x.ptr<uint8_t>(), r_n, i_n, off, segments, p, qx.q, qx.s);
  } else if (shares(xin)) {  // quantized by the first of the linears reading x
    qx = shared_operand(*xin, x_cols);
    if (!xin->cols_ready) {
      launch_fp8_quantize_cols(ctx, x.data(), x.dtype(), r_n, i_n, off, segments, p, qx.q, qx.s);
      xin->cols_ready = true, xin->rows_ready = false;
    }
  } else {
    qx = quantized_scratch(ctx, ScratchSlot::fp8_operand_b, x_cols.codes, x_cols.scales);
    launch_fp8_quantize_cols(ctx, x.data(), x.dtype(), r_n, i_n, off, segments, p, qx.q, qx.s);
  }
  // Dense on cuBLASLt: dw[O, I] = dy^T x, both operands' cols layouts as they are (1 x 128 tiles
  // along the tokens), K = the rows (whole tiles only: the columns past them are not written).
  if (dense_on_cublaslt(ctx, off, o_n, i_n, r_n) && lt_fp8_gemm(ctx, o_n, i_n, r_n, qdy.q, p, qdy.s, qx.q, p, qx.s,
                                                                false, dw.data(), dw.dtype(), accumulate ? 1.0f : 0.0f))
    return;
  op.a = qdy.q, op.sfa = qdy.s, op.b = qx.q, op.sfb = qx.s, op.d = dw.data(), op.p = p;
  const auto wgrad = [&]<class G>() { run_fp8<G, Kind::wgrad>(ctx, op, accumulate ? 1.0f : 0.0f, what); };
  if (dw16)
    with_fp8_tile<1, cutlass::bfloat16_t>(ctx.kernels().fp8_tiles.cols, wgrad);
  else
    with_fp8_tile<1, float>(ctx.kernels().fp8_tiles.cols, wgrad);
}

}  // namespace

void fp8_linear_forward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& y_NO,
                        const Fp8Weight* wq, Fp8SharedOperands* xin) {
  forward(ctx, x_NI, w_OI, nullptr, 1, y_NO, wq, xin, "fp8_linear_forward");
}

void fp8_linear_backward(const ExecContext& ctx, const Tensor& x_NI, const Tensor& w_OI, const Tensor& dy_NO,
                         const Tensor& dx_NI, const Tensor& dw_OI, bool accumulate, const Fp8Weight* wq,
                         Fp8SharedOperands* xin) {
  backward(ctx, x_NI, w_OI, nullptr, 1, dy_NO, dx_NI, dw_OI, accumulate, wq, xin, nullptr, "fp8_linear_backward");
}

void fp8_grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                const Tensor& offsets_E1, const Tensor& y_RO, const Fp8Weight* wq) {
  forward(ctx, x_RI, w_EOI, offsets_E1.ptr<int64_t>(), w_EOI.size(0), y_RO, wq, nullptr, "fp8_grouped_linear_forward");
}

void fp8_grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                 const Tensor& offsets_E1, const Tensor& dy_RO, const Tensor& dx_RI,
                                 const Tensor& dw_EOI, bool accumulate, const Fp8Weight* wq, Fp8SharedOperands* dyq) {
  backward(ctx, x_RI, w_EOI, offsets_E1.ptr<int64_t>(), w_EOI.size(0), dy_RO, dx_RI, dw_EOI, accumulate, wq, nullptr,
           dyq, "fp8_grouped_linear_backward");
}

#else  // built without CUTLASS's headers

bool fp8_gemm_built() { return false; }

namespace {
[[noreturn]] void no_cutlass(const char* what) {
  MF_FAIL(what,
          ": train.fp8 = blockwise on the GPU needs a build with CUTLASS's headers (CMake fetches the nvidia-cutlass "
          "wheel when MOEFOLD_CUTLASS is ON; this build has MOEFOLD_WITH_CUTLASS off)");
}
}  // namespace

void fp8_linear_forward(const ExecContext&, const Tensor&, const Tensor&, const Tensor&, const Fp8Weight*,
                        Fp8SharedOperands*) {
  no_cutlass("fp8_linear_forward");
}
void fp8_linear_backward(const ExecContext&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         bool, const Fp8Weight*, Fp8SharedOperands*) {
  no_cutlass("fp8_linear_backward");
}
void fp8_grouped_linear_forward(const ExecContext&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Fp8Weight*) {
  no_cutlass("fp8_grouped_linear_forward");
}
void fp8_grouped_linear_backward(const ExecContext&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, bool, const Fp8Weight*, Fp8SharedOperands*) {
  no_cutlass("fp8_grouped_linear_backward");
}

#endif

}  // namespace moefold::cuda
