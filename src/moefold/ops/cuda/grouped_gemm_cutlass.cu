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
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "moefold/ops/cuda/common.cuh"
#include "moefold/ops/cuda/grouped_gemm_cutlass.h"

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
#endif

namespace moefold::cuda {

bool cutlass_grouped_gemm_requested() {
  const char* v = std::getenv("MOEFOLD_GROUPED_GEMM");
  return v == nullptr || std::strcmp(v, "cublaslt") != 0;
}

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
template <class LayoutA, class LayoutB, class ElementOut, class TileShape_, class ClusterShape_,
          class Schedule = Cooperative>
struct Grouped {
  using ElementIn = cutlass::bfloat16_t;
  using Out = ElementOut;
  using Acc = float;
  static constexpr int kAlignIn = 8;  // 16 bytes of bf16
  static constexpr int kAlignOut = 16 / static_cast<int>(sizeof(ElementOut));
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc, ElementOut, cutlass::layout::RowMajor*, kAlignOut,
      ElementOut, cutlass::layout::RowMajor*, kAlignOut, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, Acc>>::CollectiveOp;
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
};

enum class Kind : int { forward, dgrad, wgrad };

// The tile configurations: "small" 128 x 128 x 64 in 1 x 1 clusters; "large" 128 x 256 x 64 in
// 2 x 1 clusters (PyTorch's choice for large Hopper grouped GEMMs, which BENCHMARKS.md's ceilings
// used; measured best at every shape, the default); "pingpong" 64 x 256 x 64 tiles per consumer
// warp group in 2 x 1 clusters (half the row padding when experts get few rows, e.g. real
// routing at DeepSeek-V3's 256 rows per expert; the wgrad epilogue's f32 stores hidden behind
// the other warp group's mainloop). Not yet measured (session 4 ran out of device time).
using SmallTile = cute::Shape<_128, _128, _64>;
using LargeTile = cute::Shape<_128, _256, _64>;
using PongTile = cute::Shape<_64, _256, _64>;
using One = cute::Shape<_1, _1, _1>;
using Pair = cute::Shape<_2, _1, _1>;
template <class Tile, class Cluster, class Schedule = Cooperative>
using Forward =
    Grouped<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, cutlass::bfloat16_t, Tile, Cluster, Schedule>;
template <class Tile, class Cluster, class Schedule = Cooperative>
using Dgrad =
    Grouped<cutlass::layout::RowMajor, cutlass::layout::RowMajor, cutlass::bfloat16_t, Tile, Cluster, Schedule>;
template <class Tile, class Cluster, class Schedule = Cooperative>
using Wgrad = Grouped<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, Tile, Cluster, Schedule>;

enum class Tiles : int { small, large, pingpong };

Tiles parse_tiles(const std::string& s, size_t at) {
  for (const auto& [name, t] :
       {std::pair{"small", Tiles::small}, std::pair{"large", Tiles::large}, std::pair{"pingpong", Tiles::pingpong}})
    if (s.compare(at, std::strlen(name), name) == 0) return t;
  MF_FAIL("MOEFOLD_CUTLASS_TILE = \"", s, "\": expected small, large or pingpong, for all kinds or as ",
          "forward=...,dgrad=...,wgrad=...");
}

// Which configuration each kind uses: MOEFOLD_CUTLASS_TILE = "small", "large" or "pingpong" (every
// kind), or per kind, e.g. "forward=large,dgrad=small,wgrad=pingpong"; unset (or a kind not
// named): large. Read at every call (a getenv), so a benchmark or test can switch between calls.
Tiles tiles_for(Kind kind) {
  const char* v = std::getenv("MOEFOLD_CUTLASS_TILE");
  if (v == nullptr || v[0] == '\0') return Tiles::large;
  const std::string s(v);
  if (s.find('=') == std::string::npos) return parse_tiles(s, 0);
  const char* names[3] = {"forward=", "dgrad=", "wgrad="};
  const char* name = names[static_cast<int>(kind)];
  const size_t at = s.find(name);
  return at == std::string::npos ? Tiles::large : parse_tiles(s, at + std::strlen(name));
}

// Calls run.template operator()<G>() with G the configuration of `kind` (Forward, Dgrad or Wgrad)
// that tiles_for picks.
template <template <class, class, class> class Config, class Run>
void with_tiles(Kind kind, const Run& run) {
  switch (tiles_for(kind)) {
    case Tiles::large:
      run.template operator()<Config<LargeTile, Pair, Cooperative>>();
      break;
    case Tiles::small:
      run.template operator()<Config<SmallTile, One, Cooperative>>();
      break;
    case Tiles::pingpong:
      run.template operator()<Config<PongTile, Pair, PingPong>>();
      break;
  }
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
    const size_t n = static_cast<size_t>(e_n);
    return n * (sizeof(Problem) + 4 * sizeof(void*) + sizeof(typename G::StrideA) + sizeof(typename G::StrideB) +
                sizeof(typename G::StrideC) + sizeof(typename G::StrideD)) +
           16 * 9;  // alignment slack
  }
  static Arrays carve(void* base, int64_t e_n) {
    char* p = static_cast<char*>(base);
    auto take = [&](size_t size) {
      p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t{15});
      char* r = p;
      p += size * static_cast<size_t>(e_n);
      return r;
    };
    Arrays a;
    a.problems = reinterpret_cast<Problem*>(take(sizeof(Problem)));
    a.a = reinterpret_cast<const In**>(take(sizeof(void*)));
    a.b = reinterpret_cast<const In**>(take(sizeof(void*)));
    a.c = reinterpret_cast<const Out**>(take(sizeof(void*)));
    a.d = reinterpret_cast<Out**>(take(sizeof(void*)));
    a.sa = reinterpret_cast<typename G::StrideA*>(take(sizeof(typename G::StrideA)));
    a.sb = reinterpret_cast<typename G::StrideB*>(take(sizeof(typename G::StrideB)));
    a.sc = reinterpret_cast<typename G::StrideC*>(take(sizeof(typename G::StrideC)));
    a.sd = reinterpret_cast<typename G::StrideD*>(take(sizeof(typename G::StrideD)));
    return a;
  }
};

// Group e's (M, N, K), operands and packed strides (A is M x K, B is N x K in CUTLASS's view, C
// and D are M x N). `skip`: no tiles (an empty expert's weight gradient stays as it is).
template <class G>
__device__ void set_group(const Arrays<G>& arr, int e, int m, int n, int k, const cutlass::bfloat16_t* a,
                          const cutlass::bfloat16_t* b, typename G::Out* cd, bool skip) {
  arr.problems[e] = Problem(skip ? 0 : m, n, k);
  arr.a[e] = a;
  arr.b[e] = b;
  arr.c[e] = cd;
  arr.d[e] = cd;
  arr.sa[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, cute::make_shape(m, k, 1));
  arr.sb[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, cute::make_shape(n, k, 1));
  arr.sc[e] = cutlass::make_cute_packed_stride(typename G::StrideC{}, cute::make_shape(m, n, 1));
  arr.sd[e] = cutlass::make_cute_packed_stride(typename G::StrideD{}, cute::make_shape(m, n, 1));
}

// One thread per expert. i_n / o_n: the weight's I and O; `rows` / `rows2`: the row-indexed
// operands (x for forward; dy for dgrad; dy and x for wgrad); `out`: y, dx, or dw (C and D).
template <class G, Kind kKind>
__global__ void build_group_args(Arrays<G> arr, const int64_t* __restrict__ off, int e_n, int i_n, int o_n,
                                 const cutlass::bfloat16_t* rows, const cutlass::bfloat16_t* rows2,
                                 const cutlass::bfloat16_t* w, void* out) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= e_n) return;
  const int64_t begin = off[e];
  const int m = static_cast<int>(off[e + 1] - begin);
  auto* o = static_cast<typename G::Out*>(out);
  const size_t we = static_cast<size_t>(e) * static_cast<size_t>(o_n) * static_cast<size_t>(i_n);
  if constexpr (kKind == Kind::forward)  // y_e = x_e @ w_e^T: (m, O, I)
    set_group<G>(arr, e, m, o_n, i_n, rows + begin * i_n, w + we, o + begin * o_n, false);
  else if constexpr (kKind == Kind::dgrad)  // dx_e = dy_e @ w_e: (m, I, O)
    set_group<G>(arr, e, m, i_n, o_n, rows + begin * o_n, w + we, o + begin * i_n, false);
  else  // dw_e += dy_e^T @ x_e: (O, I, m)
    set_group<G>(arr, e, o_n, i_n, m, rows + begin * o_n, rows2 + begin * i_n, o + we, m == 0);
}

// The SMs the persistent grouped GEMMs spread over: all of them, or MOEFOLD_GEMM_SMS (read once)
// to leave some to a transfer running beside them (expert parallelism: NCCL's blocks take SMs, and
// a persistent kernel whose blocks wait for them finishes late).
cutlass::KernelHardwareInfo hardware_info() {
  static thread_local cutlass::KernelHardwareInfo info = [] {
    cutlass::KernelHardwareInfo h;
    MF_CUDA_CHECK(cudaGetDevice(&h.device_id));
    h.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(h.device_id);
    if (const char* v = std::getenv("MOEFOLD_GEMM_SMS"); v != nullptr && *v != '\0') {
      const int n = std::atoi(v);
      MF_CHECK(n >= 1 && n <= h.sm_count, "MOEFOLD_GEMM_SMS=", v, ": must be in [1, ", h.sm_count, "]");
      h.sm_count = n;
    }
    return h;
  }();
  return info;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// dw_e = 0 for every expert e without rows (blockIdx.y = e; the other experts' blocks exit).
__global__ void zero_empty_experts(float* dw, const int64_t* __restrict__ off, int64_t per) {
  const int64_t e = blockIdx.y;
  if (off[e + 1] != off[e]) return;
  float* d = dw + e * per;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    d[i] = 0.0f;
}

// Builds the group arguments on the device and runs one grouped GEMM of kind kKind.
template <class G, Kind kKind>
void run_grouped(int64_t e_n, int64_t i_n, int64_t o_n, const Tensor& offsets_E1, const Tensor& rows,
                 const Tensor& rows2, const Tensor& w, void* out, float beta, const char* what) {
  const size_t arg_bytes = Arrays<G>::bytes(e_n);
  void* arg_block = device_scratch(ScratchSlot::grouped_gemm_args, arg_bytes);
  Arrays<G> arr = Arrays<G>::carve(arg_block, e_n);
  constexpr int kThreads = 128;
  build_group_args<G, kKind><<<static_cast<unsigned>(ceil_div(e_n, kThreads)), kThreads, 0, stream()>>>(
      arr, offsets_E1.ptr<int64_t>(), static_cast<int>(e_n), static_cast<int>(i_n), static_cast<int>(o_n),
      static_cast<const cutlass::bfloat16_t*>(rows.data()),
      rows2.defined() ? static_cast<const cutlass::bfloat16_t*>(rows2.data()) : nullptr,
      static_cast<const cutlass::bfloat16_t*>(w.data()), out);
  MF_CUDA_LAUNCHED(what);
  typename G::Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                   {static_cast<int>(e_n), arr.problems, nullptr},
                                   {arr.a, arr.sa, arr.b, arr.sb},
                                   {{}, arr.c, arr.sc, arr.d, arr.sd},
                                   hardware_info()};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = beta;
  typename G::Gemm gemm;
  const cutlass::Status ok = gemm.can_implement(args);
  MF_CHECK(ok == cutlass::Status::kSuccess, what, ": CUTLASS cannot run this grouped GEMM (",
           cutlassGetStatusString(ok), ")");
  const size_t ws_bytes = G::Gemm::get_workspace_size(args);
  void* ws = device_scratch(ScratchSlot::grouped_gemm_workspace, ws_bytes);
  const cutlass::Status init = gemm.initialize(args, ws, stream());
  MF_CHECK(init == cutlass::Status::kSuccess, what, ": CUTLASS initialize: ", cutlassGetStatusString(init));
  const cutlass::Status run = gemm.run(stream());
  MF_CHECK(run == cutlass::Status::kSuccess, what, ": CUTLASS run: ", cutlassGetStatusString(run));
  MF_CUDA_LAUNCHED(what);
}

}  // namespace

bool cutlass_grouped_linear_forward(const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                                    const Tensor& y_RO) {
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  if (x_RI.dtype() != DType::bf16 || y_RO.dtype() != DType::bf16 || i_n % 8 != 0 || o_n % 8 != 0) return false;
  if (!aligned16(x_RI.data()) || !aligned16(w_EOI.data()) || !aligned16(y_RO.data())) return false;
  if (x_RI.size(0) == 0 || e_n == 0) return true;
  const auto run = [&]<class G>() {
    run_grouped<G, Kind::forward>(e_n, i_n, o_n, offsets_E1, x_RI, Tensor(), w_EOI, y_RO.data(), 0.0f,
                                  "grouped_linear_forward (CUTLASS)");
  };
  with_tiles<Forward>(Kind::forward, run);
  return true;
}

bool cutlass_grouped_linear_backward(const Tensor& x_RI, const Tensor& w_EOI, const Tensor& offsets_E1,
                                     const Tensor& dy_RO, const Tensor& dx_RI, const Tensor& dw_EOI, bool accumulate) {
  const int64_t e_n = w_EOI.size(0), o_n = w_EOI.size(1), i_n = w_EOI.size(2);
  const bool want_dw = dw_EOI.defined();
  if (x_RI.dtype() != DType::bf16 || dy_RO.dtype() != DType::bf16 || (want_dw && dw_EOI.dtype() != DType::f32) ||
      i_n % 8 != 0 || o_n % 8 != 0)
    return false;
  if (!aligned16(x_RI.data()) || !aligned16(w_EOI.data()) || !aligned16(dy_RO.data()) ||
      (want_dw && !aligned16(dw_EOI.data())) ||
      (dx_RI.defined() && (dx_RI.dtype() != DType::bf16 || !aligned16(dx_RI.data()))))
    return false;
  if (e_n == 0) return true;
  if (x_RI.size(0) == 0) {
    if (want_dw && !accumulate) device_zero(dw_EOI.data(), dw_EOI.nbytes());
    return true;
  }
  const auto dgrad = [&]<class G>() {
    run_grouped<G, Kind::dgrad>(e_n, i_n, o_n, offsets_E1, dy_RO, Tensor(), w_EOI, dx_RI.data(), 0.0f,
                                "grouped_linear_backward dx (CUTLASS)");
  };
  const auto wgrad = [&]<class G>() {
    run_grouped<G, Kind::wgrad>(e_n, i_n, o_n, offsets_E1, dy_RO, x_RI, w_EOI, dw_EOI.data(), accumulate ? 1.0f : 0.0f,
                                "grouped_linear_backward dw (CUTLASS)");
  };
  // Written, not accumulated (beta = 0: the epilogue does not read dw): an expert without rows
  // gets no tiles, so its dw is zeroed here (the offsets are read on the device).
  if (dx_RI.defined()) with_tiles<Dgrad>(Kind::dgrad, dgrad);
  if (!want_dw) return true;
  if (!accumulate) {
    const int64_t per = o_n * i_n;
    zero_empty_experts<<<dim3(64, static_cast<unsigned>(e_n)), 256, 0, stream()>>>(dw_EOI.ptr<float>(),
                                                                                   offsets_E1.ptr<int64_t>(), per);
    MF_CUDA_LAUNCHED("grouped_linear_backward dw (zero empty experts)");
  }
  with_tiles<Wgrad>(Kind::wgrad, wgrad);
  return true;
}

#else  // built without CUTLASS's headers

bool cutlass_grouped_gemm_built() { return false; }
bool cutlass_grouped_linear_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&) { return false; }
bool cutlass_grouped_linear_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, bool) {
  return false;
}

#endif

}  // namespace moefold::cuda
