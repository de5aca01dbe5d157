// Core: the config text of the kernel switches (core/kernel_options.h): every name parses back to
// its value, tile choices print canonically and read back, and bad text names the key, the whole
// value and what is accepted.
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
                      GemmTiles::pingpong_n2, GemmTiles::large_auto})
    EXPECT_EQ(parse_cutlass_tiles(gemm_tiles_name(v), "k").dgrad, v);
  EXPECT_STREQ(gemm_tiles_name(GemmTiles::large_n2), "large_n2");
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
  EXPECT_EQ(some.forward, GemmTiles::large);
  EXPECT_EQ(some.dgrad, GemmTiles::small);
  EXPECT_EQ(some.swiglu_forward, GemmTiles::large);
  const std::string text = cutlass_tiles_text(some);
  EXPECT_EQ(text, "forward=large,dgrad=small,wgrad=large,swiglu_forward=large,swiglu_dgrad=large");
  EXPECT_TRUE(same(parse_cutlass_tiles(text, "k"), some));
  // Naming every kind with its default is the defaults: the text is "" again.
  EXPECT_EQ(cutlass_tiles_text(parse_cutlass_tiles("swiglu_forward=pingpong,forward=large", "k")), "");
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
            "large_auto");
  EXPECT_EQ(tiles_err("forward=large,dgrad=huge"),
            "kernels.cutlass_tile = \"forward=large,dgrad=huge\": tiles \"huge\" for dgrad: expected one of small, "
            "large, pingpong, large_n2, pingpong_n2, large_auto");
  EXPECT_NE(tiles_err("backward=large").find("unknown kind \"backward\""), std::string::npos);
  EXPECT_NE(tiles_err("forward=large,forward=small").find("kind \"forward\" named twice"), std::string::npos);
  for (const char* v : {"forward=large,", ",forward=large", "forward=large,,dgrad=small", "forward=large,dgrad"})
    EXPECT_NE(tiles_err(v).find("expected kind=tiles items separated by commas"), std::string::npos) << v;
  EXPECT_NE(tiles_err("forward=").find("tiles \"\" for forward"), std::string::npos);
}

}  // namespace
}  // namespace moefold
