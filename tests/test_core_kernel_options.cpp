// Core: the config text of the kernel switches (core/kernel_options.h): every name parses back to
// its value, tile choices print canonically and read back, and bad text names the key, the whole
// value and what is accepted.
#include "moefold/core/error.h"
#include "moefold/core/kernel_options.h"
#include "testing.h"

namespace moefold {
namespace {

using testing::error_of;

bool same(const CutlassTiles& a, const CutlassTiles& b) {
  return a.forward == b.forward && a.dgrad == b.dgrad && a.wgrad == b.wgrad && a.swiglu_forward == b.swiglu_forward &&
         a.swiglu_dgrad == b.swiglu_dgrad;
}

TEST(KernelOptions, NamesParseBack) {
  for (GroupedGemmImpl v : {GroupedGemmImpl::cutlass, GroupedGemmImpl::cublaslt})
    EXPECT_EQ(parse_grouped_gemm(grouped_gemm_name(v), "k"), v);
  for (SwigluFusion v : {SwigluFusion::automatic, SwigluFusion::on, SwigluFusion::off})
    EXPECT_EQ(parse_swiglu_fusion(swiglu_fusion_name(v), "k"), v);
  for (AttentionKernel v : {AttentionKernel::automatic, AttentionKernel::own, AttentionKernel::cudnn})
    EXPECT_EQ(parse_attention_kernel(attention_kernel_name(v), "k"), v);
  EXPECT_STREQ(swiglu_fusion_name(SwigluFusion::automatic), "auto");
  EXPECT_STREQ(attention_kernel_name(AttentionKernel::automatic), "auto");
  EXPECT_STREQ(gemm_tiles_name(GemmTiles::pingpong), "pingpong");
  for (GemmTiles v : {GemmTiles::small, GemmTiles::large, GemmTiles::pingpong, GemmTiles::large_n2,
                      GemmTiles::pingpong_n2, GemmTiles::large_auto, GemmTiles::automatic})
    EXPECT_EQ(parse_cutlass_tiles(gemm_tiles_name(v), "k").dgrad, v);
  EXPECT_STREQ(gemm_tiles_name(GemmTiles::large_n2), "large_n2");
  EXPECT_STREQ(gemm_tiles_name(GemmTiles::automatic), "auto");
}

// auto's rule: large_auto only for few rows per expert (under four 128-row tiles on average) and
// calls of at least 2^36 multiply-adds.
TEST(KernelOptions, LargeAutoPaysForFewRowsPerExpertInLargeCalls) {
  // DeepSeek-V3's layer: 8192 tokens x 8 over 256 experts (256 rows each), fc1 7168 -> 4096 and
  // fc2 2048 -> 7168.
  EXPECT_TRUE(large_auto_pays(65536, 256, 7168, 4096));
  EXPECT_TRUE(large_auto_pays(65536, 256, 2048, 7168));
  // Qwen3-30B-A3B: 16384 x 8 over 128 experts, 1024 rows each: the pair padding is small there.
  EXPECT_FALSE(large_auto_pays(131072, 128, 2048, 1536));
  // The edge: 511.9 rows per expert pays, 512 does not.
  EXPECT_TRUE(large_auto_pays(512 * 256 - 1, 256, 7168, 4096));
  EXPECT_FALSE(large_auto_pays(512 * 256, 256, 7168, 4096));
  // The tiny preset: 1024 tokens x 2 over 8 experts (256 rows each) but ~10^8 multiply-adds.
  EXPECT_FALSE(large_auto_pays(2048, 8, 128, 512));
  // The work bound: exactly 2^36 multiply-adds pays, one row less does not.
  EXPECT_TRUE(large_auto_pays(int64_t{1} << 12, 64, int64_t{1} << 12, int64_t{1} << 12));
  EXPECT_FALSE(large_auto_pays((int64_t{1} << 12) - 1, 64, int64_t{1} << 12, int64_t{1} << 12));
  EXPECT_FALSE(large_auto_pays(0, 256, 7168, 4096));
  EXPECT_FALSE(large_auto_pays(65536, 0, 7168, 4096));
}

TEST(KernelOptions, CutlassTilesTextRoundTrips) {
  const CutlassTiles defaults;
  EXPECT_EQ(cutlass_tiles_text(defaults), "");
  EXPECT_TRUE(same(parse_cutlass_tiles("", "k"), defaults));
  // One name for every kind.
  const CutlassTiles small = parse_cutlass_tiles("small", "k");
  for (GemmTiles t : {small.forward, small.dgrad, small.wgrad, small.swiglu_forward, small.swiglu_dgrad})
    EXPECT_EQ(t, GemmTiles::small);
  // "large" differs from the defaults (ping-pong for swiglu_forward), so its text is not "".
  EXPECT_EQ(cutlass_tiles_text(parse_cutlass_tiles("large", "k")),
            "forward=large,dgrad=large,wgrad=large,swiglu_forward=large,swiglu_dgrad=large");
  // Per kind: kinds not named keep their defaults; the text names every kind.
  const CutlassTiles some = parse_cutlass_tiles("dgrad=small,swiglu_forward=large", "k");
  EXPECT_EQ(some.forward, GemmTiles::automatic);
  EXPECT_EQ(some.dgrad, GemmTiles::small);
  EXPECT_EQ(some.swiglu_forward, GemmTiles::large);
  const std::string text = cutlass_tiles_text(some);
  EXPECT_EQ(text, "forward=auto,dgrad=small,wgrad=large,swiglu_forward=large,swiglu_dgrad=auto");
  EXPECT_TRUE(same(parse_cutlass_tiles(text, "k"), some));
  // Naming every kind with its default is the defaults: the text is "" again.
  EXPECT_EQ(cutlass_tiles_text(parse_cutlass_tiles("swiglu_forward=pingpong,forward=auto", "k")), "");
}

TEST(KernelOptions, BadTextNamesKeyValueAndChoices) {
  auto tiles_err = [](const std::string& v) {
    return error_of([&] { parse_cutlass_tiles(v, "kernels.cutlass_tile"); });
  };
  EXPECT_EQ(error_of([] { parse_grouped_gemm("cublas", "kernels.grouped_gemm"); }),
            "kernels.grouped_gemm = \"cublas\": expected one of cutlass, cublaslt");
  EXPECT_EQ(error_of([] { parse_swiglu_fusion("1", "kernels.fused_swiglu"); }),
            "kernels.fused_swiglu = \"1\": expected one of auto, on, off");
  EXPECT_EQ(error_of([] { parse_attention_kernel("flash", "kernels.attention"); }),
            "kernels.attention = \"flash\": expected one of auto, own, cudnn");
  EXPECT_EQ(tiles_err("huge"),
            "kernels.cutlass_tile = \"huge\": expected one of small, large, pingpong, large_n2, pingpong_n2, "
            "large_auto, auto, own");
  EXPECT_EQ(tiles_err("forward=large,dgrad=huge"),
            "kernels.cutlass_tile = \"forward=large,dgrad=huge\": tiles \"huge\" for dgrad: expected one of small, "
            "large, pingpong, large_n2, pingpong_n2, large_auto, auto, own");
  // own is the weight gradient's only.
  EXPECT_EQ(parse_cutlass_tiles("wgrad=own", "k").wgrad, GemmTiles::own);
  EXPECT_EQ(cutlass_tiles_text(parse_cutlass_tiles("wgrad=own", "k")),
            "forward=auto,dgrad=auto,wgrad=own,swiglu_forward=pingpong,swiglu_dgrad=auto");
  for (const char* v : {"own", "dgrad=own", "wgrad=own,swiglu_dgrad=own"})
    EXPECT_EQ(tiles_err(v),
              cat("kernels.cutlass_tile = \"", v,
                  "\": own serves the weight gradient only (\"wgrad=own\"); the other kinds run on CUTLASS"))
        << v;
  EXPECT_NE(tiles_err("backward=large").find("unknown kind \"backward\""), std::string::npos);
  EXPECT_NE(tiles_err("forward=large,forward=small").find("kind \"forward\" named twice"), std::string::npos);
  for (const char* v : {"forward=large,", ",forward=large", "forward=large,,dgrad=small", "forward=large,dgrad"})
    EXPECT_NE(tiles_err(v).find("expected kind=tiles items separated by commas"), std::string::npos) << v;
  EXPECT_NE(tiles_err("forward=").find("tiles \"\" for forward"), std::string::npos);
}

}  // namespace
}  // namespace moefold
