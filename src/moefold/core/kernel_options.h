// Which kernels compute a run's ops: the `[kernels]` section of a run's config.toml, read once at
// start-up and carried by the execution context (core/exec.h) into every op. Each switch here
// can change the bits a run produces (another GEMM or attention kernel sums in another order), so
// they are configuration, recorded with the run, not environment variables.
#pragma once

#include <cstdint>
#include <string>

namespace moefold {

// The experts' grouped GEMMs: CUTLASS's Hopper grouped GEMM (one launch for every expert; group
// sizes read on the device), or cuBLASLt one GEMM per expert (any GPU; the host reads the sizes).
enum class GroupedGemmImpl : uint8_t { cutlass, cublaslt };

// CUTLASS tile configurations of the grouped GEMMs: 128x128 cooperative (small), 128x256
// cooperative (large), 64x256 ping-pong (pingpong; one warp group's epilogue overlaps the other's
// math). large and pingpong run in 2 x 1 clusters: the two CTAs of a cluster take adjacent M
// tiles and share B's (the weight's) loads, so CUTLASS pads every expert's rows to a PAIR of M
// tiles. large_n2 and pingpong_n2 are the same tiles in 1 x 2 clusters: the two CTAs take
// adjacent N tiles and share A's (the rows') loads, so an expert's rows are padded to one tile
// (real routing's uneven experts), at 25% more operand traffic per CTA. large_auto: large or
// large_n2, whichever pads the call's experts to fewer tiles (weighted by what the 1 x 2 clusters'
// extra traffic costs), chosen on the device from the offsets (no host read; graphs keep it); both
// kernels are launched, the one not chosen finds no tiles. The weight gradient's M is the weight's
// rows (never padded): there the _n2 and _auto names run as large and pingpong. The fused SwiGLU
// kinds are built without small (compile time): small there runs the GEMM and SwiGLU apart.
// automatic (config text "auto"): large_auto where large_auto_pays says the call is worth its two
// extra launches (few rows per expert, much work), else large; decided on the host from the
// call's shapes (the rows of a dropless layer are T x k, known without reading the counts).
// own (the weight gradient only): moefold's kernel (ops/cuda/wgrad_grouped_gemm.cu: 128 x 256
// tiles for bf16 gradients, 128 x 128 for f32, both operands read along the rows, TMA stores
// beside the next tile's MMAs; sm_90a); where it cannot serve (widths not multiples of 8), large.
enum class GemmTiles : uint8_t { small, large, pingpong, large_n2, pingpong_n2, large_auto, automatic, own };

// One tile configuration per GEMM kind. Defaults: measured (docs/benchmarks.md): ping-pong for the
// fused SwiGLU forward (1.27 ms vs 1.40 ms with large tiles, qwen3-30b-a3b fc1); auto for the
// kinds whose M is the experts' rows (DeepSeek-V3 under real routing: large_auto 1.23-1.24x the
// PyTorch layer against 1.20x with large; elsewhere auto is large); large for the weight gradient.
struct CutlassTiles {
  GemmTiles forward = GemmTiles::automatic;        // y = x w^T
  GemmTiles dgrad = GemmTiles::automatic;          // dx = dy w
  GemmTiles wgrad = GemmTiles::large;              // dw += dy^T x (f32)
  GemmTiles swiglu_forward = GemmTiles::pingpong;  // fc1 with SwiGLU in the epilogue
  GemmTiles swiglu_dgrad = GemmTiles::automatic;   // fc2's dgrad with SwiGLU's backward in the epilogue
};

// GemmTiles::automatic's rule for a grouped GEMM of `rows` rows (all experts') over `experts`
// groups with weights of in x out: large_auto when the experts average fewer than four 128-row
// tiles (where real routing's uneven counts make the 2 x 1 clusters' padding to tile pairs a
// sizeable share) and the call does at least 2^36 multiply-adds (~0.1 ms on an H200, so the
// argument kernel and the second, empty launch cost a few percent at most). Measured
// (docs/benchmarks.md, session 22): DeepSeek-V3 (256 rows per expert) gains 2.8-3.4% of the layer
// under real routing; Qwen3-30B-A3B (1024) lost 2% balanced and the tiny preset 5% with large_auto.
constexpr int64_t kAutoMaxRowsPerExpert = 512;
constexpr int64_t kAutoMinMultiplyAdds = int64_t{1} << 36;
bool large_auto_pays(int64_t rows, int64_t experts, int64_t in, int64_t out);

// CUTLASS configurations of the FP8 blockwise-scaled GEMMs (ops/cuda/fp8_gemm_cutlass.cu; K tile
// 128, one scale block): cooperative (128 x 128 tiles, both consumer warp groups on one tile, in
// 2 x 1 clusters: two M tiles share B's loads), cooperative_1x1 (the same without clusters) or
// pingpong (64 x 128 tiles, one warp group's epilogue beside the other's math, 2 x 1 clusters).
// own: moefold's kernel (ops/cuda/fp8_grouped_gemm.cu; rows only: 128 x 128 tiles, one TMA
// descriptor for every expert). automatic: own where own_fp8_pays, else cooperative (for cols:
// cooperative). All sum alike: the same bits (tests/test_ops_cuda_fp8.cpp).
enum class Fp8Tile : uint8_t { cooperative, cooperative_1x1, pingpong, own, automatic };

// One configuration per FP8 GEMM kernel: rows (forward and dgrad: 1 x 128 rows x 128 x 128 weight
// blocks) and cols (wgrad: both operands transposed 1 x 128 tiles). Defaults: measured
// (docs/benchmarks.md, "FP8": cooperative and cooperative_1x1 within noise of each other at the
// expert shapes, pingpong slower but at Qwen3-30B-A3B's fc2; own ahead of cooperative where the
// output and the reduction are both at most 2048 wide, behind it at DeepSeek-V3's wider GEMMs).
struct Fp8Tiles {
  Fp8Tile rows = Fp8Tile::automatic;
  Fp8Tile cols = Fp8Tile::cooperative;
};
// Whether rows = auto runs a grouped FP8 GEMM of n output columns and reduction k on moefold's own
// kernel: n <= 2048 and k <= 2048 (every expert GEMM of Qwen3-30B-A3B; none of DeepSeek-V3's).
inline bool own_fp8_pays(int64_t n, int64_t k) { return n <= 2048 && k <= 2048; }

// SwiGLU fused into the experts' grouped GEMM epilogues: automatic (the backward always, the
// forward for inputs of at most 2048 columns, where it was measured faster), on (both
// everywhere), off (separate SwiGLU kernels).
enum class SwigluFusion : uint8_t { automatic, on, off };

// The causal attention kernel: automatic (cuDNN's fused attention where this build has it and it
// serves the problem, else moefold's own), own, cudnn (a problem cuDNN cannot serve fails).
enum class AttentionKernel : uint8_t { automatic, own, cudnn };

// The dense FP8 linear layers' GEMMs (train.fp8, ops/fp8.h fp8_linear_*): cuBLASLt's block
// scaling where it serves the shape (K a multiple of 128, M and N of 16; else CUTLASS), or
// CUTLASS's blockwise kernel (a dense layer as one group) everywhere.
enum class Fp8DenseGemm : uint8_t { cublaslt, cutlass };

struct KernelOptions {
  GroupedGemmImpl grouped_gemm = GroupedGemmImpl::cutlass;
  Fp8DenseGemm fp8_dense_gemm = Fp8DenseGemm::cublaslt;
  CutlassTiles cutlass_tiles;  // config text: see parse_cutlass_tiles
  Fp8Tiles fp8_tiles;          // config text: see parse_fp8_tiles
  int gemm_sms = 0;            // SMs the persistent grouped GEMMs spread over (0: all of them)
  // The own weight-gradient kernel (wgrad = own): up to this many tiles of one expert and the same
  // weight rows a cluster takes in a row, dy kept in shared memory for them, where every expert
  // has at most 256 rows (else tiles one at a time). 1: one at a time (the same bits either way).
  int own_wgrad_units = 1;
  SwigluFusion fused_swiglu = SwigluFusion::automatic;
  AttentionKernel attention = AttentionKernel::automatic;
  // cuDNN's attention backward with its deterministic engine (bit-identical reruns); false allows
  // its faster one with atomic dQ accumulation.
  bool deterministic_attention = true;
};

// Config text of each switch, and back (parse_* throw moefold::Error naming `key` and the
// accepted values).
GroupedGemmImpl parse_grouped_gemm(const std::string& value, const std::string& key);
Fp8DenseGemm parse_fp8_dense_gemm(const std::string& value, const std::string& key);
SwigluFusion parse_swiglu_fusion(const std::string& value, const std::string& key);
AttentionKernel parse_attention_kernel(const std::string& value, const std::string& key);
// "" (every default), "small" | "large" | "pingpong" (every kind), or per kind
// "forward=large,dgrad=small,wgrad=...,swiglu_forward=pingpong,swiglu_dgrad=large" (kinds not
// named keep their defaults).
CutlassTiles parse_cutlass_tiles(const std::string& value, const std::string& key);
// "" (defaults), one of "cooperative" | "cooperative_1x1" | "pingpong" | "auto" (both kinds), or
// per kind "rows=...,cols=..." (rows also "own").
Fp8Tiles parse_fp8_tiles(const std::string& value, const std::string& key);
const char* grouped_gemm_name(GroupedGemmImpl v);
const char* fp8_dense_gemm_name(Fp8DenseGemm v);
const char* swiglu_fusion_name(SwigluFusion v);
const char* attention_kernel_name(AttentionKernel v);
const char* gemm_tiles_name(GemmTiles v);
// The canonical text of a tile choice: "" when every kind has its default, else every kind named.
std::string cutlass_tiles_text(const CutlassTiles& t);
std::string fp8_tiles_text(const Fp8Tiles& t);

}  // namespace moefold
