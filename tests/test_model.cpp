// Model: config parsing and validation, parameter/FLOP counts, and the whole Qwen3-MoE model's
// backward against float64 finite differences.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "moefold/core/rng.h"
#include "moefold/model/config.h"
#include "moefold/model/hf_names.h"
#include "moefold/model/model.h"
#include "testing.h"

namespace moefold {
namespace {

namespace fs = std::filesystem;

using testing::error_of;

std::string write_file(const std::string& name, const std::string& text) {
  static testing::TempDir dir("test_model");
  testing::write_bytes(dir.file(name), text);
  return dir.file(name);
}

TEST(Config, PresetsAreValid) {
  for (const auto& name : preset_names()) {
    Config c = load_config(name, {});
    EXPECT_EQ(c.preset, name);
  }
  EXPECT_EQ(load_config("", {}).preset, "tiny");
}

TEST(Config, FileDerivesFromPresetAndOverridesApply) {
  std::string p = write_file("ok.toml",
                             "preset = \"qwen3-30b-a3b\"\n[model]\nnum_hidden_layers = 2\n[moe]\nscoring_func = "
                             "\"sigmoid\"\nrouter_aux_loss_coef = 0\n[train]\nlr = 1\n");
  Config c = load_config(p, {"moe.num_experts=64", "data.path=foo/bar", "train.lr=2e-3", "moe.norm_topk_prob=false"});
  EXPECT_EQ(c.model.hidden_size, 2048);
  EXPECT_EQ(c.model.num_hidden_layers, 2);
  EXPECT_EQ(c.moe.scoring_func, ScoreFunc::sigmoid);
  EXPECT_EQ(c.moe.num_experts, 64);
  EXPECT_EQ(c.moe.aux_loss_coeff, 0.0);
  EXPECT_FALSE(c.moe.norm_topk_prob);
  EXPECT_EQ(c.data.path, "foo/bar");
  EXPECT_DOUBLE_EQ(c.train.lr, 2e-3);
}

TEST(Config, TomlRoundTrip) {
  Config a = load_config("tiny", {"moe.capacity_factor=1.25", "train.seed=7", "data.path=x y.tokens"});
  std::string p = write_file("round.toml", config_to_toml(a));
  Config b = load_config(p, {});
  EXPECT_EQ(config_to_toml(a), config_to_toml(b));
}

TEST(Config, CommittedTinyConfigIsThePreset) {
  // configs/tiny.toml is `moefold config` output: it documents every key and must stay current
  // (regenerate it with `moefold config > configs/tiny.toml` when a key is added).
  const std::string path = std::string(MOEFOLD_SOURCE_DIR) + "/configs/tiny.toml";
  Config c = load_config(path, {});
  EXPECT_EQ(config_to_toml(c), config_to_toml(preset_config("tiny")));
  std::ifstream f(path);
  const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, config_to_toml(preset_config("tiny"))) << "configs/tiny.toml is not `moefold config` output";
}

TEST(Config, BadInputNamesTheKey) {
  auto err = [](const std::string& text, std::vector<std::string> ov = {}) {
    std::string p = write_file("bad.toml", text);
    return error_of([&] { load_config(p, ov); });
  };
  EXPECT_NE(err("[model]\nhiden_size = 3\n").find("bad.toml:2: unknown key 'model.hiden_size'"), std::string::npos);
  EXPECT_NE(err("[model]\nhidden_size = \"big\"\n").find("model.hidden_size must be an integer"), std::string::npos);
  EXPECT_NE(err("[model]\nhidden_size = 1.5\n").find("model.hidden_size must be an integer"), std::string::npos);
  EXPECT_NE(err("[modle]\nx = 1\n").find("unknown section [modle]"), std::string::npos);
  EXPECT_NE(err("[model]\nnum_attention_heads = 6\nnum_key_value_heads = 4\n").find("num_key_value_heads = 4"),
            std::string::npos);
  EXPECT_NE(err("[moe]\nnum_experts = 4\nnum_experts_per_tok = 5\n").find("num_experts_per_tok"), std::string::npos);
  EXPECT_NE(err("[moe]\nscoring_func = \"relu\"\n").find("moe.scoring_func"), std::string::npos);
  EXPECT_NE(err("[train]\nglobal_batch_size = 10\nmicro_batch_size = 4\n").find("does not divide"), std::string::npos);
  EXPECT_NE(err("[model]\nhidden_size = \n").find("TOML syntax error"), std::string::npos);
  EXPECT_NE(err("[parallel]\ntp = 3\n").find("must both be divisible by parallel.tp = 3"), std::string::npos);
  // Pipeline stages: 4 layers do not split into 3 stages, nor 1 + 2 + an even share of the rest.
  EXPECT_NE(err("[parallel]\npp = 3\n").find("model.num_hidden_layers = 4 does not split into parallel.pp = 3"),
            std::string::npos);
  EXPECT_NE(err("[parallel]\npp = 3\nfirst_stage_layers = 1\nlast_stage_layers = 3\n")
                .find("parallel.first_stage_layers = 1 and parallel.last_stage_layers = 3"),
            std::string::npos);
  EXPECT_EQ(err("[parallel]\npp = 3\nfirst_stage_layers = 2\n"), "");  // 2 + 1 + 1
  EXPECT_NE(err("[parallel]\nfirst_stage_layers = 2\n").find("need parallel.pp > 1"), std::string::npos);
  // Interleaving: 4 layers in 2 x 4 virtual stages; 4 sequences of one micro-batch of 8 are 1 micro-batch.
  EXPECT_NE(err("[parallel]\npp = 2\nvpp = 4\n").find("does not split evenly into parallel.pp x parallel.vpp = 2 x 4"),
            std::string::npos);
  EXPECT_NE(err("[parallel]\nvpp = 2\n").find("parallel.vpp = 2 needs parallel.pp > 1"), std::string::npos);
  EXPECT_NE(err("[parallel]\npp = 2\nvpp = 2\nfirst_stage_layers = 1\n").find("split the layers evenly"),
            std::string::npos);
  EXPECT_NE(err("[parallel]\npipeline_schedule = \"gpipe\"\n").find("parallel.pipeline_schedule = 'gpipe'"),
            std::string::npos);
  // The all-to-all overlap keeps nothing recomputed across its phases, and runs 1F1B only.
  EXPECT_NE(err("[parallel]\noverlap_moe_a2a = true\n[train]\nrecompute_num_layers = 1\n")
                .find("parallel.overlap_moe_a2a with train.recompute_num_layers"),
            std::string::npos);
  EXPECT_NE(err("[parallel]\noverlap_moe_a2a = true\n[train]\nrecompute_modules = [\"moe\"]\n")
                .find("parallel.overlap_moe_a2a"),
            std::string::npos);
  EXPECT_NE(err("[parallel]\npp = 2\nvpp = 2\noverlap_moe_a2a = true\n").find("1F1B only"), std::string::npos);
  // The shared experts on their own stream: only where there are some, without tensor parallelism.
  EXPECT_NE(err("[moe]\nshared_expert_overlap = true\n")
                .find("moe.shared_expert_overlap = true needs moe.n_shared_experts > 0 (got 0)"),
            std::string::npos);
  EXPECT_NE(err("[moe]\nshared_expert_overlap = true\nn_shared_experts = 1\n[parallel]\ntp = 2\n")
                .find("moe.shared_expert_overlap = true with parallel.tp = 2 is not supported yet"),
            std::string::npos);
  EXPECT_EQ(err("[moe]\nshared_expert_overlap = true\nn_shared_experts = 1\n"), "");
  EXPECT_NE(err("[parallel]\ncp = 3\n").find("train.seq_len = 128 is not divisible by 2 x parallel.cp = 6"),
            std::string::npos);
  EXPECT_NE(err("[parallel]\nep = 3\n").find("moe.num_experts = 8 is not divisible by parallel.ep = 3"),
            std::string::npos);
  EXPECT_NE(err("[parallel]\nepp = 3\n").find("unknown key 'parallel.epp'"), std::string::npos);
  EXPECT_NE(err("preset = \"huge\"\n").find("unknown preset 'huge'"), std::string::npos);
  EXPECT_NE(err("").find(""), std::string::npos);
  EXPECT_EQ(err(""), "");
  EXPECT_NE(error_of([] { load_config("tiny", {"model.nope=1"}); }).find("--set model.nope=1: unknown key"),
            std::string::npos);
  EXPECT_NE(error_of([] { load_config("tiny", {"train.lr=fast"}); }).find("train.lr must be a number"),
            std::string::npos);
  EXPECT_NE(error_of([] { load_config("tiny", {"trainlr"}); }).find("expected section.key=value"), std::string::npos);
  EXPECT_NE(error_of([] { load_config("/no/such.toml", {}); }).find("/no/such.toml: config file not found"),
            std::string::npos);
}

// The kernel switches and parallel.ep_transport of `a` and `b` agree (KernelOptions has no ==).
void expect_same_switches(const Config& a, const Config& b) {
  EXPECT_EQ(a.kernels.grouped_gemm, b.kernels.grouped_gemm);
  EXPECT_EQ(cutlass_tiles_text(a.kernels.cutlass_tiles), cutlass_tiles_text(b.kernels.cutlass_tiles));
  EXPECT_EQ(fp8_tiles_text(a.kernels.fp8_tiles), fp8_tiles_text(b.kernels.fp8_tiles));
  EXPECT_EQ(a.kernels.fp8_dense_gemm, b.kernels.fp8_dense_gemm);
  EXPECT_EQ(a.kernels.gemm_sms, b.kernels.gemm_sms);
  EXPECT_EQ(a.kernels.own_wgrad_units, b.kernels.own_wgrad_units);
  EXPECT_EQ(a.kernels.fused_swiglu, b.kernels.fused_swiglu);
  EXPECT_EQ(a.kernels.attention, b.kernels.attention);
  EXPECT_EQ(a.kernels.deterministic_attention, b.kernels.deterministic_attention);
  EXPECT_EQ(a.parallel.ep_transport, b.parallel.ep_transport);
}

TEST(Config, KernelsSectionAndEpTransport) {
  // The defaults: what the kernels did before the section existed.
  const Config d = load_config("tiny", {});
  EXPECT_EQ(d.kernels.grouped_gemm, GroupedGemmImpl::cutlass);
  EXPECT_EQ(cutlass_tiles_text(d.kernels.cutlass_tiles), "");
  EXPECT_EQ(fp8_tiles_text(d.kernels.fp8_tiles), "");
  // FP8 rows GEMMs: own where it pays (every expert GEMM of Qwen3-30B-A3B, none of DeepSeek-V3's).
  EXPECT_EQ(d.kernels.fp8_tiles.rows, Fp8Tile::automatic);
  EXPECT_EQ(d.kernels.fp8_tiles.cols, Fp8Tile::cooperative);
  EXPECT_TRUE(own_fp8_pays(1536, 2048) && own_fp8_pays(2048, 1536) && own_fp8_pays(2048, 768) &&
              own_fp8_pays(768, 2048));
  EXPECT_FALSE(own_fp8_pays(4096, 7168) || own_fp8_pays(7168, 4096) || own_fp8_pays(7168, 2048) ||
               own_fp8_pays(2048, 7168));
  EXPECT_EQ(fp8_tiles_text(parse_fp8_tiles("cooperative", "kernels.fp8_tile")), "rows=cooperative,cols=cooperative");
  EXPECT_EQ(parse_fp8_tiles("auto", "kernels.fp8_tile").rows, Fp8Tile::automatic);
  EXPECT_EQ(d.kernels.fp8_dense_gemm, Fp8DenseGemm::cublaslt);
  EXPECT_EQ(d.kernels.gemm_sms, 0);
  EXPECT_EQ(d.kernels.own_wgrad_units, 1);
  EXPECT_EQ(d.kernels.fused_swiglu, SwigluFusion::automatic);
  EXPECT_EQ(d.kernels.attention, AttentionKernel::automatic);
  EXPECT_TRUE(d.kernels.deterministic_attention);
  EXPECT_EQ(d.parallel.ep_transport, "auto");
  // Every key, each away from its default, from a file and from --set (bare words are strings).
  Config want = d;
  want.kernels.grouped_gemm = GroupedGemmImpl::cublaslt;
  want.kernels.cutlass_tiles.forward = GemmTiles::small;  // the other kinds keep their defaults
  want.kernels.cutlass_tiles.swiglu_forward = GemmTiles::large;
  want.kernels.fp8_tiles.cols = Fp8Tile::pingpong;  // rows keeps its default
  want.kernels.fp8_dense_gemm = Fp8DenseGemm::cutlass;
  want.kernels.gemm_sms = 120;
  want.kernels.own_wgrad_units = 16;
  want.kernels.fused_swiglu = SwigluFusion::off;
  want.kernels.attention = AttentionKernel::cudnn;
  want.kernels.deterministic_attention = false;
  want.parallel.ep_transport = "ipc";
  const Config f =
      load_config(write_file("kernels.toml",
                             "[kernels]\ngrouped_gemm = \"cublaslt\"\ncutlass_tile = "
                             "\"forward=small,swiglu_forward=large\"\nfp8_tile = \"cols=pingpong\"\nfp8_dense_gemm = "
                             "\"cutlass\"\ngemm_sms = 120\nown_wgrad_units = 16\nfused_swiglu = "
                             "\"off\"\nattention = \"cudnn\"\ndeterministic_attention = false\n"
                             "[parallel]\nep_transport = \"ipc\"\n"),
                  {});
  expect_same_switches(f, want);
  const Config s =
      load_config("tiny", {"kernels.grouped_gemm=cublaslt", "kernels.cutlass_tile=forward=small,swiglu_forward=large",
                           "kernels.fp8_tile=cols=pingpong", "kernels.fp8_dense_gemm=cutlass", "kernels.gemm_sms=120",
                           "kernels.own_wgrad_units=16", "kernels.fused_swiglu=off", "kernels.attention=cudnn",
                           "kernels.deterministic_attention=false", "parallel.ep_transport=ipc"});
  expect_same_switches(s, want);
  // config_to_toml records every switch (a run directory's config.toml) and reads back the same.
  for (const Config& c : {d, f}) {
    const std::string text = config_to_toml(c);
    const Config back = load_config(write_file("kernels_round.toml", text), {});
    EXPECT_EQ(config_to_toml(back), text);
    expect_same_switches(back, c);
  }
  EXPECT_NE(config_to_toml(f).find("\n[kernels]\ngrouped_gemm = 'cublaslt'  # "), std::string::npos);
}

// Found by the audit of the readers (docs/faults.md, "Untrusted files"): sizes whose products pass
// 2^63 (a config.toml or a checkpoint's from elsewhere) planned buffers that wrapped to a few bytes
// (Shape::numel is plain int64). The sizes' products are now bounded by 2^50, one line.
TEST(Config, SizesThatMultiplyPastMemoryAreRefused) {
  auto err = [](const std::string& text) {
    std::string p = write_file("huge.toml", text);
    return error_of([&] { load_config(p, {}); });
  };
  const std::pair<std::string, std::string> cases[] = {
      {"[model]\nvocab_size = 4611686018427387904\nhidden_size = 4\n",
       "huge.toml: the model's sizes multiply to ~3.68935e+19 parameters"},
      {"[model]\nhidden_size = 1048576\n[moe]\nnum_experts = 1048576\nmoe_intermediate_size = 1048576\n",
       "more than 2^50 (model.vocab_size = 320, model.hidden_size = 1048576"},
      {"[moe]\ncapacity_factor = 1e300\n", "activation values, more than 2^50"},
      {"[model]\nmax_position_embeddings = 4294967296\n", "model.max_position_embeddings = 4294967296"},
      {"[train]\nglobal_batch_size = 9223372036854775800\nmicro_batch_size = 8\n", "more than 2^50"},
  };
  for (const auto& [text, needle] : cases) {
    const std::string e = err(text);
    EXPECT_NE(e.find(needle), std::string::npos) << text << " gave: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

TEST(Config, BadKernelsValueIsOneLineNamingTheKey) {
  auto err = [](const std::string& text) {
    std::string p = write_file("bad_kernels.toml", text);
    return error_of([&] { load_config(p, {}); });
  };
  const std::pair<std::string, std::string> cases[] = {
      {"[kernels]\ngrouped_gemm = \"cublas\"\n",
       "bad_kernels.toml:2: kernels.grouped_gemm = \"cublas\": expected one of cutlass, cublaslt"},
      {"[kernels]\ncutlass_tile = \"huge\"\n",
       "bad_kernels.toml:2: kernels.cutlass_tile = \"huge\": expected one of small, large, pingpong"},
      {"[kernels]\ncutlass_tile = \"forward=huge\"\n", "kernels.cutlass_tile = \"forward=huge\": tiles \"huge\""},
      {"[kernels]\ncutlass_tile = \"backward=large\"\n", "kernels.cutlass_tile = \"backward=large\": unknown kind"},
      {"[kernels]\nfp8_tile = \"wide\"\n",
       "kernels.fp8_tile = \"wide\": expected one of cooperative, cooperative_1x1, pingpong, own"},
      {"[kernels]\nfp8_tile = \"own\"\n",
       "kernels.fp8_tile = \"own\": own serves rows only (forward and dgrad, e.g. \"rows=own\")"},
      {"[kernels]\nfp8_tile = \"cols=own\"\n", "kernels.fp8_tile = \"cols=own\": own serves rows only"},
      {"[kernels]\nfp8_tile = \"forward=pingpong\"\n",
       "kernels.fp8_tile = \"forward=pingpong\": unknown kind \"forward\" (rows, cols)"},
      {"[kernels]\nfp8_dense_gemm = \"cublas\"\n",
       "kernels.fp8_dense_gemm = \"cublas\": expected one of cublaslt, cutlass"},
      {"[moe]\nfp8_dispatch = true\n", "moe.fp8_dispatch = true needs the experts in FP8"},
      {"[kernels]\ngemm_sms = -1\n", "bad_kernels.toml: kernels.gemm_sms = -1 must be >= 0 (0: every SM)"},
      {"[kernels]\ngemm_sms = 1.5\n", "kernels.gemm_sms must be an integer"},
      {"[kernels]\ngemm_sms = 9999999999\n", "kernels.gemm_sms = 9999999999 is out of range"},
      {"[kernels]\nfused_swiglu = \"yes\"\n", "kernels.fused_swiglu = \"yes\": expected one of auto, on, off"},
      {"[kernels]\nfused_swiglu = true\n", "kernels.fused_swiglu must be a string"},
      {"[kernels]\nattention = \"flash\"\n", "kernels.attention = \"flash\": expected one of auto, own, cudnn"},
      {"[kernels]\ndeterministic_attention = 1\n", "kernels.deterministic_attention must be true or false"},
      {"[kernels]\ngemm_smz = 1\n", "unknown key 'kernels.gemm_smz'"},
      {"[parallel]\nep_transport = \"shm\"\n", "parallel.ep_transport = 'shm' is not supported (auto, nccl, ipc)"},
      {"[parallel]\ndistributed_optimizer = \"yes\"\n", "parallel.distributed_optimizer must be true or false"},
      {"[train]\nexp_avg_dtype = \"fp8\"\n", "train.exp_avg_dtype = 'fp8' is not supported (f32, bf16)"},
      {"[train]\non_nonfinite = \"ignore\"\n", "train.on_nonfinite = 'ignore' is not supported (stop, skip)"},
      {"[model]\nnum_hidden_layers = 68888888888\n", "model.num_hidden_layers = 68888888888 is more than 16384 layers"},
      {"[train]\nexp_avg_sq_dtype = \"f16\"\n", "train.exp_avg_sq_dtype = 'f16' is not supported (f32, bf16)"},
      {"[moe]\nep_recv_factor = 0.5\n", "moe.ep_recv_factor = 0.5 must be 0 (the worst case) or >= 1"},
      {"[moe]\ndispatcher = \"slot\"\n", "moe.dispatcher = 'slot' is not supported (alltoall, hierarchical, slots)"},
      {"[moe]\ndispatcher = \"slots\"\ncapacity_factor = 1.25\n",
       "moe.dispatcher = \"slots\" needs dropless routing or moe.pad_to_capacity = true"},
      {"[moe]\ndispatcher = \"slots\"\nnum_experts = 2048\n", "moe.dispatcher = \"slots\" takes at most 1024 experts"},
      {"[moe]\ndispatcher = \"slots\"\n[parallel]\nep = 2\netp = 2\n",
       "moe.dispatcher = \"slots\" needs parallel.etp = 1 (etp = 2)"},
      {"[moe]\ndispatcher = \"slots\"\n[parallel]\nep_transport = \"ipc\"\n",
       "moe.dispatcher = \"slots\" exchanges through the communicator: parallel.ep_transport = 'ipc' does not apply"},
  };
  for (const auto& [text, needle] : cases) {
    const std::string e = err(text);
    EXPECT_NE(e.find(needle), std::string::npos) << text << " gave: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  EXPECT_EQ(error_of([] { load_config("tiny", {"kernels.attention=flash"}); }),
            "--set kernels.attention=flash: kernels.attention = \"flash\": expected one of auto, own, cudnn");
  EXPECT_NE(error_of([] { load_config("tiny", {"parallel.ep_transport=mpi"}); }).find("parallel.ep_transport = 'mpi'"),
            std::string::npos);
}

TEST(ModelSize, MatchesPublishedQwen3Sizes) {
  Config c = preset_config("qwen3-30b-a3b");
  ModelSize s = model_size(c.model, c.moe, 4096);
  EXPECT_NEAR(s.total_params / 1e9, 30.53, 0.01);  // "30.5B total, 3.3B activated"
  EXPECT_NEAR(s.active_params / 1e9, 3.35, 0.01);
  // docs/benchmarks.md formulas, by hand: per layer attention + MoE, plus the LM head.
  const double h = 2048, q = 4096, kv = 512, S = 4096;
  const double per_layer = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * S * q + 2 * h * 128 + 6 * 8 * h * 768;
  EXPECT_DOUBLE_EQ(s.train_flops_per_token, 3 * (48 * per_layer + 2 * h * 151936));
  Config big = preset_config("qwen3-235b-a22b");
  ModelSize b = model_size(big.model, big.moe, 4096);
  EXPECT_NEAR(b.total_params / 1e9, 235.1, 0.1);
  EXPECT_NEAR(b.active_params / 1e9, 22.2, 0.1);
}

// Published sizes: DeepSeek-V3 671B (+ the MTP module; 37B active), Mixtral-8x7B 46.7B (12.9B
// active), OLMoE-1B-7B 6.9B (1.3B active).
TEST(ModelSize, MatchesPublishedSizesOfTheOtherFamilies) {
  Config ds = preset_config("deepseek-v3");
  ModelSize d = model_size(ds.model, ds.moe, 4096);
  EXPECT_NEAR(d.total_params / 1e9, 671.0, 0.1);
  EXPECT_NEAR(d.active_params / 1e9, 37.5, 0.6);
  // 671B + MTP (a MoE layer, projections and the copies of embedding and head DeepSeek stores) = 685B.
  EXPECT_NEAR((d.total_params + d.mtp_params + 2 * ds.model.vocab_size * ds.model.hidden_size) / 1e9, 685.0, 1.0);
  Config mx = preset_config("mixtral-8x7b");
  ModelSize x = model_size(mx.model, mx.moe, 4096);
  EXPECT_NEAR(x.total_params / 1e9, 46.70, 0.01);
  EXPECT_NEAR(x.active_params / 1e9, 12.88, 0.01);
  Config ol = preset_config("olmoe-1b-7b");
  ModelSize o = model_size(ol.model, ol.moe, 4096);
  EXPECT_NEAR(o.total_params / 1e9, 6.92, 0.01);
  EXPECT_NEAR(o.active_params / 1e9, 1.28, 0.01);
}

struct TinyModel {
  Config cfg;
  std::unique_ptr<Model> model;
  std::unique_ptr<Memory> mem;
  testing::Pool pool;
  Tensor ids, targets;

  TinyModel(int64_t b, int64_t s, std::vector<std::string> overrides, DType dtype = DType::f64) {
    std::vector<std::string> ov = {"model.vocab_size=11",         "model.hidden_size=8",
                                   "model.num_hidden_layers=2",   "model.num_attention_heads=3",
                                   "model.num_key_value_heads=1", "model.head_dim=4",
                                   "moe.num_experts=3",           "moe.num_experts_per_tok=2",
                                   "moe.moe_intermediate_size=5", "moe.router_aux_loss_coef=0.1",
                                   "moe.router_z_loss_coef=0.01", "model.rope_theta=100"};
    ov.insert(ov.end(), overrides.begin(), overrides.end());
    cfg = load_config("tiny", ov);
    model = std::make_unique<Model>(cfg.model, cfg.moe, b, s);
    mem = std::make_unique<Memory>(dtype);
    mem->bind_twice([&] { model->bind(*mem); });
    Model::init_params(testing::exec(), mem->params(), 42);
    // Larger weights than the 0.02 init so every term of the gradient matters.
    for (Param& p : mem->params())
      if (p.init == Init::normal) scale_by(p.value, 20.0);
    ids = pool.ints({b, s}, 0, 11);
    targets = pool.ints({b, s}, 0, 11);
  }
  static void scale_by(const Tensor& t, double f) {
    dispatch_float(t.dtype(), [&]<class T>() {
      for (int64_t i = 0; i < t.numel(); ++i) t.ptr<T>()[i] *= static_cast<T>(f);
    });
  }
  // Total loss with lm_scale on the summed token loss and moe_scale on the router losses.
  double loss(double lm_scale, double moe_scale) {
    double l = model->forward(ids, targets) * lm_scale;
    return l + model->mtp_loss() * lm_scale + moe_scale * (model->aux_loss() + model->z_loss());
  }
};

TEST(Model, BackwardMatchesFiniteDifferences) {
  for (const char* score : {"softmax", "sigmoid"}) {
    TinyModel t(2, 5, {cat("moe.scoring_func=", score)});
    const double lm_scale = 1.0 / 10, moe_scale = 0.5;
    for (Param& p : t.mem->params()) p.grad.zero();
    double l0 = t.loss(lm_scale, moe_scale);
    ASSERT_TRUE(std::isfinite(l0));
    t.model->backward(lm_scale, moe_scale);
    std::vector<Tensor> analytic;
    for (Param& p : t.mem->params()) analytic.push_back(t.pool.clone(p.grad));
    size_t i = 0;
    for (Param& p : t.mem->params()) {
      EXPECT_GT(testing::max_abs(analytic[i]), 0.0) << p.name << " has an all-zero gradient";
      testing::check_gradient(cat(score, " ", p.name), p.value, analytic[i],
                              [&] { return t.loss(lm_scale, moe_scale); }, {.eps = 1e-6, .rtol = 1e-5, .atol = 1e-8});
      ++i;
    }
  }
}

TEST(Model, Float32AgreesWithFloat64) {
  TinyModel a(2, 6, {}, DType::f64), b(2, 6, {}, DType::f32);
  b.ids.copy_from(a.ids);
  b.targets.copy_from(a.targets);
  for (size_t i = 0; i < a.mem->params().size(); ++i) {
    const Tensor& src = a.mem->params()[i].value;
    const Tensor& dst = b.mem->params()[i].value;
    for (int64_t j = 0; j < src.numel(); ++j) dst.ptr<float>()[j] = static_cast<float>(src.ptr<double>()[j]);
  }
  double la = a.loss(1.0 / 12, 1.0), lb = b.loss(1.0 / 12, 1.0);
  EXPECT_NEAR(lb, la, 1e-5 * std::abs(la));
}

TEST(Model, ParametersUseHuggingFaceNames) {
  TinyModel t(1, 2, {});
  std::vector<std::string> names;
  for (const Param& p : t.mem->params())
    for (const NamedView& v : hf_views(p)) names.push_back(v.name);
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  for (const char* n : {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
                        "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
                        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_norm.weight",
                        "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.2.gate_proj.weight",
                        "model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.mlp.experts.1.down_proj.weight"})
    EXPECT_TRUE(has(n)) << n;
  // 2 layers x (4 attn + 2 qk norms + 2 norms + gate + 3 experts x 3) + embed + norm + head
  EXPECT_EQ(names.size(), 2u * (4 + 2 + 2 + 1 + 9) + 3);
  // The per-expert views are the right rows of the fused tensor: gate row j at 2j, up at 2j + 1.
  const Param* gu = t.mem->find("model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(gu, nullptr);
  int found = 0;
  for (const NamedView& v : hf_views(*gu)) {
    const bool up = v.name == "model.layers.0.mlp.experts.1.up_proj.weight";
    if (!up && v.name != "model.layers.0.mlp.experts.1.gate_proj.weight") continue;
    ++found;
    EXPECT_EQ(v.value.shape(), Shape({5, 8}));
    EXPECT_EQ(v.value.stride(0), 2 * 8);
    EXPECT_EQ(v.value.stride(1), 1);
    EXPECT_EQ(v.value.data(), gu->value.ptr<double>() + (1 * 10 + (up ? 1 : 0)) * 8);
  }
  EXPECT_EQ(found, 2);
}

TEST(Model, InitIsDeterministicPerName) {
  TinyModel a(1, 2, {}), b(1, 2, {});
  for (size_t i = 0; i < a.mem->params().size(); ++i)
    EXPECT_EQ(testing::max_abs_diff(a.mem->params()[i].value, b.mem->params()[i].value), 0.0);
  const Param* norm = a.mem->find("model.norm.weight");
  EXPECT_EQ(norm->value.ptr<double>()[0], 1.0);
}

// Every family's layers (config.h) under finite differences: Mixtral (no q/k norm), OLMoE
// (whole-projection q/k norms), dense layers, DeepSeek-V3 (MLA with and without q-LoRA, YaRN,
// interleaved RoPE, v wider and narrower than q/k, shared experts, first-k dense).
TEST(Model, EveryFamilyBackwardMatchesFiniteDifferences) {
  const std::vector<std::vector<std::string>> families = {
      {"model.architecture=mixtral"},
      {"model.architecture=olmoe", "moe.norm_topk_prob=false"},
      {"model.mlp_only_layers=[0]", "model.intermediate_size=6"},
      // gate and up of 6 x 7 f64 (336 bytes) do not end on the arena's 64-byte boundary: the dense
      // MLP runs them as two GEMMs (above, one stacked GEMM)
      {"model.mlp_only_layers=[0]", "model.intermediate_size=6", "model.hidden_size=7"},
      {"model.architecture=deepseek_v3",
       "model.num_key_value_heads=3",
       "model.qk_rope_head_dim=4",
       "model.qk_nope_head_dim=3",
       "model.v_head_dim=5",
       "model.kv_lora_rank=6",
       "model.q_lora_rank=5",
       "model.rope_interleave=true",
       "model.rope_type=yarn",
       "model.rope_factor=4",
       "model.rope_original_max_position_embeddings=2",
       "model.rope_mscale=1",
       "model.rope_mscale_all_dim=0.7",
       "model.first_k_dense_replace=1",
       "model.intermediate_size=6",
       "moe.n_shared_experts=1",
       "moe.scoring_func=sigmoid",
       "moe.routed_scaling_factor=2.5",
       "moe.n_group=3",
       "moe.topk_group=2",
       "moe.expert_bias=true",
       "moe.seq_aux_loss_coef=0.3"},
      {"model.architecture=deepseek_v3", "model.num_key_value_heads=3", "model.qk_rope_head_dim=4",
       "model.qk_nope_head_dim=2", "model.v_head_dim=9", "model.kv_lora_rank=5", "moe.n_shared_experts=2",
       "moe.norm_topk_prob=false", "moe.scoring_func=sigmoid", "moe.expert_bias=true",
       "model.num_nextn_predict_layers=2", "model.mtp_loss_scaling_factor=0.7"},
  };
  for (const auto& ov : families) {
    TinyModel t(2, 5, ov);
    const double lm_scale = 1.0 / 10, moe_scale = 0.5;
    for (Param& p : t.mem->params()) p.grad.zero();
    ASSERT_TRUE(std::isfinite(t.loss(lm_scale, moe_scale)));
    t.model->backward(lm_scale, moe_scale);
    std::vector<Tensor> analytic;
    for (Param& p : t.mem->params()) analytic.push_back(t.pool.clone(p.grad));
    size_t i = 0;
    for (Param& p : t.mem->params()) {
      if (!p.name.ends_with("e_score_correction_bias")) {  // selection only: no gradient by design
        EXPECT_GT(testing::max_abs(analytic[i]), 0.0) << ov[0] << " " << p.name << " has an all-zero gradient";
      }
      testing::check_gradient(cat(ov.back(), " ", p.name), p.value, analytic[i],
                              [&] { return t.loss(lm_scale, moe_scale); }, {.eps = 1e-6, .rtol = 1e-5, .atol = 1e-8});
      ++i;
    }
  }
}

}  // namespace
}  // namespace moefold
