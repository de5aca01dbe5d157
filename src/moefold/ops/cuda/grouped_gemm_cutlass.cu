// Grouped GEMMs of the expert layers through CUTLASS's Hopper grouped GEMM (TMA + warp-specialised
// wgmma, one persistent launch for all experts, group sizes read on the device), built when
// CMake found CUTLASS's headers (MOEFOLD_WITH_CUTLASS). See grouped_gemm_cutlass.h.
//
// Per expert e with rows [off[e], off[e+1]) (m_e of them), as CUTLASS sees each group (M, N, K):
//   forward  y_e  = x_e @ w_e^T      (m_e, O, I): A = x_e row-major, B = w_e "column-major" (K = I
//                                                 contiguous), D = y_e row-major, bf16;
//   dgrad    dx_e = dy_e @ w_e       (m_e, I, O): A = dy_e row-major, B = w_e row-major, D bf16;
//   wgrad    dw_e += dy_e^T @ x_e    (O, I, m_e): A = dy_e^T column-major, B = x_e row-major,
//                                                 C = D = dw_e f32, beta = 1.
// An empty expert becomes an (0, N, K) group: no tiles, so dw_e keeps its value (ACCUMULATED) and
// y / dx have no rows of it. The per-group arguments are written by one small kernel from the
// device offsets, so nothing here waits for the GPU.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/grouped_gemm_cutlass.h"
#include "moefold/ops/cuda/swiglu.cuh"
#include "moefold/ops/cuda/wgrad_grouped_gemm.h"

#ifdef MOEFOLD_WITH_CUTLASS
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
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

bool cutlass_grouped_gemm_built() { return true; }

namespace {

using namespace cute;
using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Problem = ProblemShape::UnderlyingProblemShape;

// Kernel schedules: cooperative (two consumer warp groups share one CTA tile) or ping-pong (each
// consumer warp group owns a tile of 64 rows; one's epilogue overlaps the other's mainloop).
struct Cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct PingPong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// One grouped GEMM configuration: bf16 operands, f32 accumulation, output ElementOut, CTA tile
// TileShape, thread-block cluster ClusterShape (a 2 x 1 cluster shares B's tile loads between the
// two CTAs of adjacent M tiles through TMA multicast), schedule Schedule.
// Fusion: the epilogue's operation (default D = alpha * acc + beta * C; the SwiGLU kinds below
// bring their own visitor trees).
template <class LayoutA, class LayoutB, class ElementOut, class TileShape_, class ClusterShape_,
          class Schedule = Cooperative, class Fusion = cutlass::epilogue::fusion::LinearCombination<ElementOut, float>,
          class EpiTile = cutlass::epilogue::collective::EpilogueTileAuto, class ElementC = ElementOut>
struct Grouped {
  using ElementIn = cutlass::bfloat16_t;
  using Out = ElementOut;  // D, and C unless ElementC is void (no C read)
  using Acc = float;
  static constexpr int kAlignIn = 8;  // 16 bytes of bf16
  static constexpr int kAlignOut = 16 / static_cast<int>(sizeof(ElementOut));
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpiTile, Acc, Acc, ElementC,
      cutlass::layout::RowMajor*, kAlignOut, ElementOut, cutlass::layout::RowMajor*, kAlignOut,
      typename Schedule::Epilogue, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn, ElementIn, LayoutB*, kAlignIn,
      Acc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Thread = decltype(std::declval<typename Gemm::Arguments>().epilogue.thread);  // the fusion's arguments
};

// ---- SwiGLU in the epilogue (GateUp::pairs: gate and up interleaved by column) ---------------

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// Forward: a visitor-tree node that stores h_j = silu(g_j) * u_j to global memory straight from
// the accumulator, whose fragment holds each (g_j, u_j) pair as two adjacent elements (a wgmma
// accumulator gives every thread pairs of adjacent columns; checked by the tests against the
// unfused ops). h is half as wide as the tile, so it cannot ride D's TMA store; the node passes
// its input through (D = gu). g and u are rounded to bf16 first, as the unfused swiglu reads them.
struct SwigluPairsStore {
  struct SharedStorage {};
  struct Arguments {
    cutlass::bfloat16_t* h = nullptr;  // [R, F]: rows of group e start at offsets[e]
    int64_t ld = 0;                    // F
    const int64_t* offsets = nullptr;  // [E + 1] on the device
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.h != nullptr && args.offsets != nullptr;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE SwigluPairsStore() {}
  CUTLASS_HOST_DEVICE SwigluPairsStore(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  // Where an epilogue subtile gives each thread 4 fragments of 4 accumulators, fragment v holding
  // (row r, columns 2q and 2q + 1) and (row r + 8, the same columns) of the subtile's v-th group of
  // 8 columns (q = lane % 4; the wgmma accumulator layout, checked at run time), the 4 lanes of a
  // quad together hold h columns [4v, 4v + 4) of rows r and r + 8: a 4 x 4 transpose by
  // shuffles gives each lane 4 adjacent h values per row, stored as 8 bytes (a quad writes one
  // 32-byte sector per row) instead of 2-byte stores that each touch their own sector. Other
  // layouts store one h value at a time.
  template <class CoordTensor, class Residue>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor c, Residue r, int m0, int n0, cutlass::bfloat16_t* h, int64_t ld)
        : tCcD(c), residue(r), m0(m0), n0(n0), h(h), ld(ld) {}
    CoordTensor tCcD;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N) -> (m, n) relative to this thread's first element
    Residue residue;   // (M, N) minus this thread's first element: the in-bounds limit of tCcD
    int m0, n0;        // this thread's first element in the group's (M, N)
    cutlass::bfloat16_t* h;
    int64_t ld;
    // The subtile's h values (quad layout): fragment v's (row r, row r + 8) pair as bf16x2.
    uint32_t packed[4] = {};
    bool col_in[4] = {};
    int row_a = 0, row_b = 0, h_col = 0;  // rows r and r + 8; fragment 0's h column
    bool row_a_in = false, row_b_in = false;

    static constexpr int kQuadElements = 16;  // 4 fragments of 4 per subtile

    template <class ElementAcc, class ElementIn, int kFrag>
    CUTLASS_DEVICE cutlass::Array<ElementIn, kFrag> visit(cutlass::Array<ElementAcc, kFrag> const&, int epi_v,
                                                          int epi_m, int epi_n,
                                                          cutlass::Array<ElementIn, kFrag> const& in) {
      static_assert(kFrag % 2 == 0, "the fragment must hold whole (g, u) pairs");
      auto c = tCcD(_, _, _, epi_m, epi_n);
      const auto h_of = [&](int i) {
        return swiglu<true>(round_bf16(static_cast<float>(in[i])), round_bf16(static_cast<float>(in[i + 1])));
      };
      if constexpr (kFrag == 4 && decltype(size(c))::value == kQuadElements) {
        const auto a = c(epi_v * 4), b = c(epi_v * 4 + 2), first = c(0);
        const int q = static_cast<int>(threadIdx.x % 4);
        if (get<0>(b) != get<0>(a) + 8 || get<1>(b) != get<1>(a) || get<0>(a) != get<0>(first) ||
            get<1>(a) != get<1>(first) + 8 * epi_v || get<1>(c(epi_v * 4 + 1)) != get<1>(a) + 1 ||
            (n0 + get<1>(first)) % 8 != 2 * q)
          __trap();  // not the accumulator layout the quad stores assume
        packed[epi_v] = static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(h_of(0)))) |
                        static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(h_of(2)))) << 16;
        col_in[epi_v] = get<1>(a) < get<1>(residue);
        if (epi_v == 0) {
          row_a = m0 + get<0>(a);
          row_b = m0 + get<0>(b);
          row_a_in = get<0>(a) < get<0>(residue);
          row_b_in = get<0>(b) < get<0>(residue);
          h_col = (n0 + get<1>(a)) / 2;
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < kFrag; i += 2) {
          const auto mn = c(epi_v * kFrag + i);
          if (elem_less(mn, residue))
            h[static_cast<int64_t>(m0 + get<0>(mn)) * ld + (n0 + get<1>(mn)) / 2] = cutlass::bfloat16_t(h_of(i));
        }
      }
      return in;
    }

    CUTLASS_DEVICE void end_loop(int epi_m, int epi_n) {
      if constexpr (decltype(size(tCcD(_, _, _, 0, 0)))::value == kQuadElements) {
        const int q = static_cast<int>(threadIdx.x % 4);
        const auto pick = [&](int i) {
          return i == 0 ? packed[0] : i == 1 ? packed[1] : i == 2 ? packed[2] : packed[3];
        };
        // y[j]: h columns 4q + j (relative to fragment 0's first) of rows r and r + 8, from lane j's fragment q.
        uint32_t y[4];
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 4; ++k) {
          const uint32_t got = __shfl_xor_sync(0xffffffffu, pick(q ^ k), k);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 4; ++j)
            if (j == (q ^ k)) y[j] = got;
        }
        const bool in_cols = q == 0 ? col_in[0] : q == 1 ? col_in[1] : q == 2 ? col_in[2] : col_in[3];
        const int64_t col = h_col - q + 4 * q;  // fragment 0's first h column of the quad, plus 4q
        if (in_cols && row_a_in)
          *reinterpret_cast<uint2*>(h + row_a * ld + col) =
              make_uint2(__byte_perm(y[0], y[1], 0x5410), __byte_perm(y[2], y[3], 0x5410));
        if (in_cols && row_b_in)
          *reinterpret_cast<uint2*>(h + row_b * ld + col) =
              make_uint2(__byte_perm(y[0], y[1], 0x7632), __byte_perm(y[2], y[3], 0x7632));
      }
    }
  };

  template <bool kReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;
    const int m0 = static_cast<int>(M) - static_cast<int>(get<0>(args.residue_tCcD));
    const int n0 = static_cast<int>(N) - static_cast<int>(get<1>(args.residue_tCcD));
    cutlass::bfloat16_t* h = params.h + params.offsets[l] * params.ld;
    return ConsumerStoreCallbacks<decltype(args.tCcD), decltype(args.residue_tCcD)>(args.tCcD, args.residue_tCcD, m0,
                                                                                    n0, h, params.ld);
  }
};

// Backward: (dh, gu pair) -> dgu pair, elementwise over the F columns of dh = dy @ w; gu arrives as
// the epilogue's source C and dgu leaves as D, each (bf16 g, bf16 u) pair viewed as one 32-bit
// float lane (moved bit for bit: the epilogue's float-to-float conversions are copies).
template <class T>
struct SwigluPairsBackward {};
template <int kFrag>
struct SwigluPairsBackward<cutlass::Array<float, kFrag>> {
  CUTLASS_DEVICE cutlass::Array<float, kFrag> operator()(cutlass::Array<float, kFrag> const& dh,
                                                         cutlass::Array<float, kFrag> const& gu) const {
    cutlass::Array<float, kFrag> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kFrag; ++i) {
      // A bf16 is the high half of the float it widens to; g is the pair's low (first) half.
      const uint32_t pair = __float_as_uint(gu[i]);
      const float g = __uint_as_float(pair << 16), u = __uint_as_float(pair & 0xffff0000u);
      float dg, du;
      swiglu_grad<true>(g, u, round_bf16(dh[i]), dg, du);
      out[i] = __uint_as_float(static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(dg))) |
                               static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16(du))) << 16);
    }
    return out;
  }
};

namespace fusion = cutlass::epilogue::fusion;
using SwigluForwardTree = fusion::Sm90EVT<SwigluPairsStore, fusion::Sm90AccFetch>;
using SwigluBackwardTree =
    fusion::Sm90EVT<fusion::Sm90Compute<SwigluPairsBackward, float, float, cutlass::FloatRoundStyle::round_to_nearest>,
                    fusion::Sm90AccFetch, fusion::Sm90SrcFetch<float>>;

enum class Kind : int { forward, dgrad, wgrad, swiglu_forward, swiglu_dgrad };

// The tile configurations: "small" 128 x 128 x 64 in 1 x 1 clusters; "large" 128 x 256 x 64 in
// 2 x 1 clusters (PyTorch's choice for large Hopper grouped GEMMs, which docs/benchmarks.md's ceilings
// used; measured best at every shape, the default); "pingpong" 64 x 256 x 64 tiles per consumer
// warp group in 2 x 1 clusters (half the row padding when experts get few rows, e.g. real
// routing at DeepSeek-V3's 256 rows per expert; the wgrad epilogue's f32 stores hidden behind
// the other warp group's mainloop, in theory). Measured (docs/benchmarks.md, sessions 5 and 7):
// ping-pong is the fused SwiGLU forward's default; for the weight gradient it did not hide the f32
// stores at DeepSeek-V3 (13.2 vs 13.0 ms), and neither did 4 or 8 epilogue buffers with as many
// TMA stores in flight (12.6 / 14.4 ms; 4 slowed the accumulating form, 8 starves the mainloop).
// Session 22 (bf16 weight gradient, DeepSeek-V3 fc1, 9.8-10.1 ms; ncu: tensor pipe 48%, DRAM 28%,
// L2 50%): no better with 2 x 2 clusters (10.9), ping-pong 128 x 128 tiles in 2 x 1 / 2 x 2
// clusters (10.2-10.4 / 11.0-11.3), 64 x 256 ping-pong in 2 x 2 (11.1) or an epilogue storing
// straight from registers (PtrArrayNoSmemWarpSpecialized: 30.7). CUTLASS pads each group's M
// tiles to a multiple of the cluster's M: the _n2 tiles (1 x 2 clusters) pad the rows to one
// tile; measured: DeepSeek-V3 real routing +2.5-3% (fc1 forward 7.52-7.60 -> 7.14-7.21 ms) but
// balanced -2.6% (5.62 -> 6.05: B no longer shared), Qwen3's fc2 dgrad (N = 768: 3 N tiles padded
// to 4) 0.62 -> 0.82-0.86 ms; so they are options, not defaults.
using SmallTile = cute::Shape<_128, _128, _64>;
using LargeTile = cute::Shape<_128, _256, _64>;
using PongTile = cute::Shape<_64, _256, _64>;
using One = cute::Shape<_1, _1, _1>;
using Pair = cute::Shape<_2, _1, _1>;   // adjacent M tiles share B: rows padded to two tiles
using PairN = cute::Shape<_1, _2, _1>;  // adjacent N tiles share A: rows padded to one tile
template <class Tile, class Cluster, class Schedule = Cooperative>
using Forward =
    Grouped<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t, Tile, Cluster, Schedule>;
template <class Tile, class Cluster, class Schedule = Cooperative>
using Dgrad =
    Grouped<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t, Tile, Cluster, Schedule>;
template <class Tile, class Cluster, class Schedule = Cooperative>
using Wgrad = Grouped<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, Tile, Cluster, Schedule>;
// bf16 weight gradients (train.main_grads_dtype = bf16): f32 accumulation, D = round(acc + beta * C).
template <class Tile, class Cluster, class Schedule = Cooperative>
using WgradBf16 =
    Grouped<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t, Tile, Cluster, Schedule>;
// The weight gradient in large tiles, with the epilogue measured best for it (docs/benchmarks.md,
// session 23: DeepSeek-V3's fc1, K = 256 rows per expert, so each tile's epilogue weighs against
// only four 64-deep main-loop steps). Written (beta = 0): no C operand at all (CUTLASS otherwise
// keeps C's shared-memory tiles, and D reuses them, even when beta = 0 reads none), bf16 stored in
// two 128 x 128 subtiles (fc1 9.06-9.31 ms against 9.85-10.41 with the builder's 128 x 32
// subtiles, 9.66-9.95 with 128 x 32 and no C), f32 in 128 x 32 (11.8-12.0 against 12.5-13.0).
// Accumulated (beta = 1, a step's later micro-batches): bf16 in 128 x 64 subtiles (9.29 against
// 10.39); f32 as Wgrad. Same bits either way: D = round(acc) written, round(acc + C) added.
template <class Out, int kEpiN, bool kReadsC>
using WgradLarge =
    Grouped<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Out, LargeTile, Pair, Cooperative,
            cutlass::epilogue::fusion::LinearCombination<Out, float, std::conditional_t<kReadsC, Out, void>, float>,
            cute::Shape<_128, cute::Int<kEpiN>>, std::conditional_t<kReadsC, Out, void>>;
// The SwiGLU kinds: forward as Forward (D = gu, bf16) plus h; backward data as Dgrad with C = gu
// and D = dgu viewed as F float lanes per row.
template <class Tile, class Cluster, class Schedule = Cooperative>
using SwigluForward = Grouped<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t, Tile,
                              Cluster, Schedule, SwigluForwardTree>;
template <class Tile, class Cluster, class Schedule = Cooperative>
using SwigluDgrad =
    Grouped<cutlass::layout::RowMajor, cutlass::layout::RowMajor, float, Tile, Cluster, Schedule, SwigluBackwardTree>;

// The operands of one grouped call (see set_kind_group).
struct GroupCall {
  int64_t r_n, e_n, i_n, o_n;  // r_n: the rows of every expert (the row-indexed operand's)
  const int64_t* offsets;
  const cutlass::bfloat16_t *rows, *rows2, *w;
  void* out;
  const void* src;
  const char* what;
};
GroupCall group_call(int64_t e_n, int64_t i_n, int64_t o_n, const Tensor& offsets_E1, const Tensor& rows,
                     const Tensor& rows2, const Tensor& w, void* out, const char* what, const void* src = nullptr) {
  const auto bf = [](const Tensor& t) {
    return t.defined() ? static_cast<const cutlass::bfloat16_t*>(t.data()) : nullptr;
  };
  return GroupCall{rows.size(0), e_n, i_n, o_n, offsets_E1.ptr<int64_t>(), bf(rows), bf(rows2), bf(w), out, src, what};
}

// The tile configuration of `kind` in the run's kernels.cutlass_tile (core/kernel_options.h).
GemmTiles tiles_for(const ExecContext& ctx, Kind kind) {
  const CutlassTiles& t = ctx.kernels().cutlass_tiles;
  const GemmTiles per_kind[] = {t.forward, t.dgrad, t.wgrad, t.swiglu_forward, t.swiglu_dgrad};
  return per_kind[static_cast<int>(kind)];
}

// Calls run.template operator()<G>() with G the configuration of `kind` (Forward, Dgrad or Wgrad)
// that the context's kernels.cutlass_tile picks and returns true; false (nothing run) for "small" when kSmall is false
// (the SwiGLU kinds are not built with small tiles, to bound the compile time). kRowsInM: the
// kind's M is the experts' rows (every kind but the weight gradient, whose M is the weight's
// rows): only there do the 1 x 2 clusters differ (no pair of M tiles to pad to), so the weight
// gradient runs large_n2 / pingpong_n2 / large_auto as large / pingpong / large (fewer kernels to
// build). large_auto hands `run` both large configurations: run_grouped picks one on the device;
// auto does so where large_auto_pays for call `c`, else runs large.
template <template <class, class, class> class Config, bool kSmall = true, bool kRowsInM = true, class Run>
bool with_tiles(const ExecContext& ctx, Kind kind, const GroupCall& c, const Run& run) {
  using ClusterN2 = std::conditional_t<kRowsInM, PairN, Pair>;  // the _n2 tiles' clusters
  GemmTiles tiles = tiles_for(ctx, kind);
  if (tiles == GemmTiles::automatic)
    tiles = kRowsInM && large_auto_pays(c.r_n, c.e_n, c.i_n, c.o_n) ? GemmTiles::large_auto : GemmTiles::large;
  switch (tiles) {
    case GemmTiles::large:
      run.template operator()<Config<LargeTile, Pair, Cooperative>>();
      return true;
    case GemmTiles::small:
      if constexpr (kSmall) {
        run.template operator()<Config<SmallTile, One, Cooperative>>();
        return true;
      }
      return false;
    case GemmTiles::pingpong:
      run.template operator()<Config<PongTile, Pair, PingPong>>();
      return true;
    case GemmTiles::large_n2:
      run.template operator()<Config<LargeTile, ClusterN2, Cooperative>>();
      return true;
    case GemmTiles::pingpong_n2:
      run.template operator()<Config<PongTile, ClusterN2, PingPong>>();
      return true;
    case GemmTiles::large_auto:
      if constexpr (kRowsInM)
        run.template operator()<Config<LargeTile, Pair, Cooperative>, Config<LargeTile, PairN, Cooperative>>();
      else
        run.template operator()<Config<LargeTile, Pair, Cooperative>>();
      return true;
    case GemmTiles::automatic:  // resolved above
    case GemmTiles::own:        // the weight gradient's only (parse_cutlass_tiles refuses it elsewhere)
      break;
  }
  return false;
}

// The per-group argument arrays of one call, carved from one scratch block.
template <class G>
struct Arrays {
  using In = cutlass::bfloat16_t;
  using Out = typename G::Out;
  Problem* problems;
  const In** a;
  const In** b;
  const Out** c;
  Out** d;
  typename G::StrideA* sa;
  typename G::StrideB* sb;
  typename G::StrideC* sc;
  typename G::StrideD* sd;

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
    a.c = arrays.take<const Out*>();
    a.d = arrays.take<Out*>();
    a.sa = arrays.take<typename G::StrideA>();
    a.sb = arrays.take<typename G::StrideB>();
    a.sc = arrays.take<typename G::StrideC>();
    a.sd = arrays.take<typename G::StrideD>();
    return a;
  }
};

// Group e's (M, N, K), operands and packed strides (A is M x K, B is N x K in CUTLASS's view, C
// and D are M x N; C is D unless given). `skip`: no tiles (an empty expert's weight gradient
// stays as it is).
template <class G>
__device__ void set_group(const Arrays<G>& arr, int e, int m, int n, int k, const cutlass::bfloat16_t* a,
                          const cutlass::bfloat16_t* b, typename G::Out* d, bool skip,
                          const typename G::Out* c = nullptr) {
  arr.problems[e] = Problem(skip ? 0 : m, n, k);
  arr.a[e] = a;
  arr.b[e] = b;
  arr.c[e] = c != nullptr ? c : d;
  arr.d[e] = d;
  arr.sa[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, cute::make_shape(m, k, 1));
  arr.sb[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, cute::make_shape(n, k, 1));
  arr.sc[e] = cutlass::make_cute_packed_stride(typename G::StrideC{}, cute::make_shape(m, n, 1));
  arr.sd[e] = cutlass::make_cute_packed_stride(typename G::StrideD{}, cute::make_shape(m, n, 1));
}

// Expert e's group of kind kKind. i_n / o_n: the weight's I and O; `rows` / `rows2`: the
// row-indexed operands (x for forward; dy for dgrad; dy and x for wgrad); `out`: y, dx, or dw (C
// and D); `src`: C where it is not D (swiglu_dgrad: gu as I float lanes per row). `none`: no tiles
// at all (the configuration the device did not choose).
template <class G, Kind kKind>
__device__ void set_kind_group(const Arrays<G>& arr, int e, const int64_t* __restrict__ off, int i_n, int o_n,
                               const cutlass::bfloat16_t* rows, const cutlass::bfloat16_t* rows2,
                               const cutlass::bfloat16_t* w, void* out, const void* src, bool none) {
  const int64_t begin = off[e];
  const int m = static_cast<int>(off[e + 1] - begin);
  auto* o = static_cast<typename G::Out*>(out);
  const size_t we = static_cast<size_t>(e) * static_cast<size_t>(o_n) * static_cast<size_t>(i_n);
  if constexpr (kKind == Kind::forward || kKind == Kind::swiglu_forward)  // y_e = x_e @ w_e^T: (m, O, I)
    set_group<G>(arr, e, m, o_n, i_n, rows + begin * i_n, w + we, o + begin * o_n, none);
  else if constexpr (kKind == Kind::dgrad)  // dx_e = dy_e @ w_e: (m, I, O)
    set_group<G>(arr, e, m, i_n, o_n, rows + begin * o_n, w + we, o + begin * i_n, none);
  else if constexpr (kKind == Kind::swiglu_dgrad)  // dgu_e from dh_e = dy_e @ w_e and gu_e: (m, I, O)
    set_group<G>(arr, e, m, i_n, o_n, rows + begin * o_n, w + we, o + begin * i_n, none,
                 static_cast<const typename G::Out*>(src) + begin * i_n);
  else  // dw_e += dy_e^T @ x_e: (O, I, m)
    set_group<G>(arr, e, o_n, i_n, m, rows + begin * o_n, rows2 + begin * i_n, o + we, none || m == 0);
}

// One thread per expert.
template <class G, Kind kKind>
__global__ void build_group_args(Arrays<G> arr, const int64_t* __restrict__ off, int e_n, int i_n, int o_n,
                                 const cutlass::bfloat16_t* rows, const cutlass::bfloat16_t* rows2,
                                 const cutlass::bfloat16_t* w, void* out, const void* src) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < e_n) set_kind_group<G, kKind>(arr, e, off, i_n, o_n, rows, rows2, w, out, src, false);
}

// The CTA tiles configuration G runs for e_n groups of m_e rows and n columns: CUTLASS's group
// scheduler pads each group's M and N tiles to multiples of the cluster's.
template <class G>
__device__ uint64_t cluster_padded_tiles(int m, int n) {
  constexpr int kTm = cute::size<0>(typename G::TileShape{}), kTn = cute::size<1>(typename G::TileShape{});
  constexpr int kCm = cute::size<0>(typename G::ClusterShape{}), kCn = cute::size<1>(typename G::ClusterShape{});
  const uint64_t mt = (m + kTm - 1) / kTm, nt = (n + kTn - 1) / kTn;
  return (mt + kCm - 1) / kCm * kCm * ((nt + kCn - 1) / kCn * kCn);
}

// The second configuration's tiles cost this much more than the first's: large_n2 against large,
// measured at DeepSeek-V3's fc1 forward with 256 rows per expert (6.02-6.07 vs 5.62-5.64 ms, no
// padding in either): 1 x 2 clusters share A, the smaller operand, where 2 x 1 share B.
constexpr uint64_t kSecondCostNum = 1075, kSecondCostDen = 1000;

// One block: both configurations' groups, of which only the one with the fewer weighted tiles gets
// any (the other's groups are all empty: its launch finds no work). The choice is made here from
// the device's offsets, so it needs no host read and holds under CUDA graphs.
template <class G1, class G2, Kind kKind>
__global__ void build_group_args_either(Arrays<G1> arr1, Arrays<G2> arr2, const int64_t* __restrict__ off, int e_n,
                                        int i_n, int o_n, const cutlass::bfloat16_t* rows,
                                        const cutlass::bfloat16_t* rows2, const cutlass::bfloat16_t* w, void* out,
                                        const void* src) {
  __shared__ unsigned long long tiles[2];
  if (threadIdx.x < 2) tiles[threadIdx.x] = 0;
  __syncthreads();
  const int n = kKind == Kind::forward || kKind == Kind::swiglu_forward ? o_n : i_n;  // the groups' N
  unsigned long long t1 = 0, t2 = 0;
  for (int e = threadIdx.x; e < e_n; e += blockDim.x) {
    const int m = static_cast<int>(off[e + 1] - off[e]);
    t1 += cluster_padded_tiles<G1>(m, n);
    t2 += cluster_padded_tiles<G2>(m, n);
  }
  atomicAdd(&tiles[0], t1);
  atomicAdd(&tiles[1], t2);
  __syncthreads();
  const bool second = tiles[0] * kSecondCostDen > tiles[1] * kSecondCostNum;
  for (int e = threadIdx.x; e < e_n; e += blockDim.x) {
    set_kind_group<G1, kKind>(arr1, e, off, i_n, o_n, rows, rows2, w, out, src, second);
    set_kind_group<G2, kKind>(arr2, e, off, i_n, o_n, rows, rows2, w, out, src, !second);
  }
}

using cutlass_grouped::hardware_info;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The epilogue arguments of the default fusion, D = acc + beta * C, for configuration G.
struct LinearCombination {
  float beta = 0.0f;
  template <class G>
  typename G::Thread operator()(std::type_identity<G>) const {
    typename G::Thread t;
    t.alpha = 1.0f;
    t.beta = beta;
    return t;
  }
};

// C's pointers: none where G reads no C (ElementC void).
template <class G>
auto c_pointers(const Arrays<G>& arr) {
  using CPtr = decltype(std::declval<typename G::Gemm::Arguments>().epilogue.ptr_C);
  if constexpr (std::is_same_v<CPtr, const void**>)
    return CPtr{nullptr};
  else
    return arr.c;
}

// Runs configuration G over the groups in `arr` (built on the stream before).
template <class G, class ThreadOf>
void launch_grouped(const ExecContext& ctx, const Arrays<G>& arr, const GroupCall& c, const ThreadOf& thread_of) {
  typename G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                   {static_cast<int>(c.e_n), arr.problems, nullptr},
                                   {arr.a, arr.sa, arr.b, arr.sb},
                                   {thread_of(std::type_identity<G>{}), c_pointers<G>(arr), arr.sc, arr.d, arr.sd},
                                   hardware_info(ctx)};
  cutlass_grouped::run_gemm<typename G::Gemm>(ctx, args, c.what);
}

// Builds the group arguments on the device and runs one grouped GEMM of kind kKind in
// configuration G, or (two configurations) in the one build_group_args_either picks on the device:
// both are launched, the other finds no tiles. thread_of(std::type_identity<G>{}): G's epilogue
// arguments.
template <Kind kKind, class G, class... Alt, class ThreadOf>
void run_grouped(const ExecContext& ctx, const GroupCall& c, const ThreadOf& thread_of) {
  static_assert(sizeof...(Alt) <= 1, "one configuration, or two to choose between");
  const int e_n = static_cast<int>(c.e_n), i_n = static_cast<int>(c.i_n), o_n = static_cast<int>(c.o_n);
  if constexpr (sizeof...(Alt) == 0) {
    Arrays<G> arr = Arrays<G>::carve(ctx.scratch(ScratchSlot::grouped_gemm_args, Arrays<G>::bytes(c.e_n)), c.e_n);
    constexpr int kThreads = 128;
    build_group_args<G, kKind><<<static_cast<unsigned>(ceil_div(c.e_n, kThreads)), kThreads, 0, stream_of(ctx)>>>(
        arr, c.offsets, e_n, i_n, o_n, c.rows, c.rows2, c.w, c.out, c.src);
    MF_CUDA_LAUNCHED(c.what);
    launch_grouped<G>(ctx, arr, c, thread_of);
  } else {
    using G2 = std::tuple_element_t<0, std::tuple<Alt...>>;
    const size_t first = (Arrays<G>::bytes(c.e_n) + 15) / 16 * 16;
    auto* block = static_cast<char*>(ctx.scratch(ScratchSlot::grouped_gemm_args, first + Arrays<G2>::bytes(c.e_n)));
    Arrays<G> arr1 = Arrays<G>::carve(block, c.e_n);
    Arrays<G2> arr2 = Arrays<G2>::carve(block + first, c.e_n);
    build_group_args_either<G, G2, kKind>
        <<<1, 256, 0, stream_of(ctx)>>>(arr1, arr2, c.offsets, e_n, i_n, o_n, c.rows, c.rows2, c.w, c.out, c.src);
    MF_CUDA_LAUNCHED(c.what);
    launch_grouped<G>(ctx, arr1, c, thread_of);
    launch_grouped<G2>(ctx, arr2, c, thread_of);
  }
}

}  // namespace

bool cutlass_grouped_linear_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                    const Tensor& offsets_E1, const Tensor& y_RO) {
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  if (x_RI.dtype() != DType::bf16 || y_RO.dtype() != DType::bf16 || i_n % 8 != 0 || o_n % 8 != 0) return false;
  if (!aligned16(x_RI.data()) || !aligned16(w_EOI.data()) || !aligned16(y_RO.data())) return false;
  if (x_RI.size(0) == 0 || e_n == 0) return true;
  const GroupCall call =
      group_call(e_n, i_n, o_n, offsets_E1, x_RI, Tensor(), w_EOI, y_RO.data(), "grouped_linear_forward (CUTLASS)");
  const auto run = [&]<class... G>() { run_grouped<Kind::forward, G...>(ctx, call, LinearCombination{0.0f}); };
  with_tiles<Forward>(ctx, Kind::forward, call, run);
  return true;
}

bool cutlass_grouped_linear_backward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_EOI,
                                     const Tensor& offsets_E1, const Tensor& dy_RO, const Tensor& dx_RI,
                                     const Tensor& dw_EOI, bool accumulate) {
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  const bool want_dw = dw_EOI.defined();
  const bool dw16 = want_dw && dw_EOI.dtype() == DType::bf16;  // else f32
  if (x_RI.dtype() != DType::bf16 || dy_RO.dtype() != DType::bf16 ||
      (want_dw && !dw16 && dw_EOI.dtype() != DType::f32) || i_n % 8 != 0 || o_n % 8 != 0)
    return false;
  if (!aligned16(x_RI.data()) || !aligned16(w_EOI.data()) || !aligned16(dy_RO.data()) ||
      (want_dw && !aligned16(dw_EOI.data())) ||
      (dx_RI.defined() && (dx_RI.dtype() != DType::bf16 || !aligned16(dx_RI.data()))))
    return false;
  if (e_n == 0) return true;
  if (x_RI.size(0) == 0) {
    if (want_dw && !accumulate) MF_CUDA_CHECK(cudaMemsetAsync(dw_EOI.data(), 0, dw_EOI.nbytes(), stream_of(ctx)));
    return true;
  }
  const GroupCall dgrad_call =
      group_call(e_n, i_n, o_n, offsets_E1, dy_RO, Tensor(), w_EOI, dx_RI.defined() ? dx_RI.data() : nullptr,
                 "grouped_linear_backward dx (CUTLASS)");
  const GroupCall wgrad_call = group_call(e_n, i_n, o_n, offsets_E1, dy_RO, x_RI, w_EOI,
                                          want_dw ? dw_EOI.data() : nullptr, "grouped_linear_backward dw (CUTLASS)");
  const auto dgrad = [&]<class... G>() { run_grouped<Kind::dgrad, G...>(ctx, dgrad_call, LinearCombination{0.0f}); };
  const auto wgrad = [&]<class... G>() {
    run_grouped<Kind::wgrad, G...>(ctx, wgrad_call, LinearCombination{accumulate ? 1.0f : 0.0f});
  };
  // Written, not accumulated (beta = 0: the epilogue does not read dw): an expert without rows
  // gets no tiles, so its dw is zeroed here (the offsets are read on the device).
  if (dx_RI.defined()) with_tiles<Dgrad>(ctx, Kind::dgrad, dgrad_call, dgrad);
  if (!want_dw) return true;
  const GemmTiles tiles = tiles_for(ctx, Kind::wgrad);
  if (tiles == GemmTiles::own && own_wgrad_serves(e_n, o_n, i_n)) {  // zeroes empty experts itself
    own_grouped_wgrad(ctx, x_RI, dy_RO, offsets_E1, dw_EOI, accumulate, "grouped_linear_backward dw (own kernel)");
    return true;
  }
  if (!accumulate) {
    const int64_t per = o_n * i_n;
    const char* what = "grouped_linear_backward dw (zero empty experts)";
    if (dw16)
      cutlass_grouped::zero_empty_experts(ctx, static_cast<__nv_bfloat16*>(dw_EOI.data()), offsets_E1.ptr<int64_t>(),
                                          e_n, per, what);
    else
      cutlass_grouped::zero_empty_experts(ctx, dw_EOI.ptr<float>(), offsets_E1.ptr<int64_t>(), e_n, per, what);
  }
  // The kind's tiles as run: ping-pong (pingpong, pingpong_n2), small (f32 only: bf16 gradients are
  // not built with small tiles, to bound the compile time), else large (the _n2, _auto and auto
  // names: the weight gradient's M is the weight's rows, never padded; own where it cannot serve).
  const bool pong = tiles == GemmTiles::pingpong || tiles == GemmTiles::pingpong_n2;
  if (dw16) {
    if (pong)
      wgrad.template operator()<WgradBf16<PongTile, Pair, PingPong>>();
    else if (accumulate)
      wgrad.template operator()<WgradLarge<cutlass::bfloat16_t, 64, true>>();
    else
      wgrad.template operator()<WgradLarge<cutlass::bfloat16_t, 128, false>>();
  } else if (pong || tiles == GemmTiles::small) {
    with_tiles<Wgrad, true, false>(ctx, Kind::wgrad, wgrad_call, wgrad);
  } else if (accumulate) {
    wgrad.template operator()<Wgrad<LargeTile, Pair>>();
  } else {
    wgrad.template operator()<WgradLarge<float, 32, false>>();
  }
  return true;
}

namespace {
// kernels.fused_swiglu (core/kernel_options.h): auto fuses the backward kind always and the
// forward kind where it was measured faster than the GEMM and the pairs kernel apart
// (docs/benchmarks.md, session 6: fc1 of qwen3-30b-a3b, H = 2048: 1.27-1.34 ms fused vs
// 1.32-1.42 apart; H = 4096 (qwen3-235b-a22b) and 7168 (DeepSeek-V3): 0.1 and 0.6-1.0 ms slower
// fused, the epilogue's cost growing with the tiles' K for reasons not yet understood), i.e. for
// inputs of at most 2048 columns; on fuses both everywhere; off neither (the unfused ops).
constexpr int64_t kFusedForwardMaxInputs = 2048;
}  // namespace

bool cutlass_grouped_linear_swiglu_forward(const ExecContext& ctx, const Tensor& x_RI, const Tensor& w_E2FI,
                                           const Tensor& offsets_E1, const Tensor& gu_R2F, const Tensor& h_RF) {
  const SwigluFusion fusion = ctx.kernels().fused_swiglu;
  const int64_t e_n = w_E2FI.size(0), o_n = w_E2FI.size(1), i_n = w_E2FI.size(2);
  if (fusion == SwigluFusion::off || (fusion == SwigluFusion::automatic && i_n > kFusedForwardMaxInputs)) return false;
  if (x_RI.dtype() != DType::bf16 || gu_R2F.dtype() != DType::bf16 || h_RF.dtype() != DType::bf16 || i_n % 8 != 0 ||
      o_n % 16 != 0)
    return false;
  if (!aligned16(x_RI.data()) || !aligned16(w_E2FI.data()) || !aligned16(gu_R2F.data()) || !aligned16(h_RF.data()))
    return false;
  if (x_RI.size(0) == 0 || e_n == 0) return true;
  const GroupCall call = group_call(e_n, i_n, o_n, offsets_E1, x_RI, Tensor(), w_E2FI, gu_R2F.data(),
                                    "grouped_linear_swiglu_forward (CUTLASS)");
  const auto thread_of = [&]<class G>(std::type_identity<G>) {
    typename G::Thread thread;
    thread.op_1 = {static_cast<cutlass::bfloat16_t*>(h_RF.data()), o_n / 2, offsets_E1.ptr<int64_t>()};
    return thread;
  };
  const auto run = [&]<class... G>() { run_grouped<Kind::swiglu_forward, G...>(ctx, call, thread_of); };
  return with_tiles<SwigluForward, false>(ctx, Kind::swiglu_forward, call, run);
}

bool cutlass_grouped_linear_swiglu_backward_data(const ExecContext& ctx, const Tensor& dy_RO, const Tensor& w_EOF,
                                                 const Tensor& offsets_E1, const Tensor& gu_R2F,
                                                 const Tensor& dgu_R2F) {
  if (ctx.kernels().fused_swiglu == SwigluFusion::off) return false;
  const int64_t e_n = w_EOF.size(0), o_n = w_EOF.size(1), f_n = w_EOF.size(2);
  if (dy_RO.dtype() != DType::bf16 || w_EOF.dtype() != DType::bf16 || gu_R2F.dtype() != DType::bf16 ||
      dgu_R2F.dtype() != DType::bf16 || f_n % 8 != 0 || o_n % 8 != 0)
    return false;
  if (!aligned16(dy_RO.data()) || !aligned16(w_EOF.data()) || !aligned16(gu_R2F.data()) || !aligned16(dgu_R2F.data()))
    return false;
  if (dy_RO.size(0) == 0 || e_n == 0) return true;
  // gu and dgu as [R, F] float lanes, one (g, u) pair each.
  const GroupCall call = group_call(e_n, f_n, o_n, offsets_E1, dy_RO, Tensor(), w_EOF, dgu_R2F.data(),
                                    "grouped_linear_swiglu_backward_data (CUTLASS)", gu_R2F.data());
  const auto run = [&]<class... G>() {
    run_grouped<Kind::swiglu_dgrad, G...>(ctx, call,
                                          []<class Gi>(std::type_identity<Gi>) { return typename Gi::Thread{}; });
  };
  return with_tiles<SwigluDgrad, false>(ctx, Kind::swiglu_dgrad, call, run);
}

#else  // built without CUTLASS's headers

bool cutlass_grouped_gemm_built() { return false; }
bool cutlass_grouped_linear_forward(const ExecContext&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  return false;
}
bool cutlass_grouped_linear_backward(const ExecContext&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, bool) {
  return false;
}
bool cutlass_grouped_linear_swiglu_forward(const ExecContext&, const Tensor&, const Tensor&, const Tensor&,
                                           const Tensor&, const Tensor&) {
  return false;
}
bool cutlass_grouped_linear_swiglu_backward_data(const ExecContext&, const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, const Tensor&) {
  return false;
}

#endif

}  // namespace moefold::cuda
