// The moefold binary: every bad input ends in exactly one line "moefold: error: ..." naming the
// file/key/value and a non-zero exit; the good paths (info, prepare, train, --resume) work.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli_testing.h"
#include "moefold/core/device.h"
#include "moefold/core/error.h"
#include "moefold/data/npy.h"
#include "moefold/data/token_dataset.h"
#include "moefold/io/safetensors.h"
#include "testing.h"

namespace moefold {
namespace {

namespace fs = std::filesystem;

TEST(Cli, InfoPrintsSizes) {
  Result r = run("info --config qwen3-30b-a3b");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("total parameters    30532122624"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("active parameters   3353032704"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("train FLOPs/token"), std::string::npos);
}

TEST(Cli, BadConfigs) {
  testing::TempDir tmp("test_cli");
  const fs::path& d = tmp.path();
  expect_one_line_error(run(cat("info --config ", write(d / "a.toml", "[model]\nhiden_size = 64\n"))),
                        {"a.toml:2", "model.hiden_size"});
  expect_one_line_error(run(cat("info --config ", write(d / "b.toml", "[moe]\nnum_experts = \"many\"\n"))),
                        {"b.toml:2", "moe.num_experts must be an integer"});
  expect_one_line_error(run("info --set model.num_attention_heads=5"),
                        {"num_key_value_heads = 2", "num_attention_heads = 5"});
  expect_one_line_error(run("info --set model.hidden_size=0"), {"model.hidden_size = 0"});
  expect_one_line_error(run("info --set moe.num_experts_per_tok=9"), {"num_experts_per_tok", "9"});
  expect_one_line_error(run("info --set moe.capacity_factor=-inf --set moe.pad_to_capacity=true"), {"moe."});
  expect_one_line_error(run("info --config nosuchpreset"), {"unknown preset 'nosuchpreset'"});
  expect_one_line_error(run("info --config /no/such/file.toml"), {"/no/such/file.toml"});
  expect_one_line_error(run("info --set train.seq_len=9999"), {"train.seq_len = 9999", "max_position_embeddings"});
  // --device cuda without a GPU (or without CUDA in the build): one line, nothing trained.
  if (cuda_device_count() == 0) expect_one_line_error(run("train --device cuda --steps 1", d), {"--device cuda"});
  // Usage errors get CLI11's own non-zero exit codes (109: extra arguments), not crashes.
  EXPECT_EQ(run("train --no-such-flag").code, 109);
  EXPECT_NE(run("").code, 0);
}

// The kernel switches and parallel.ep_transport: `moefold config` prints them (what a run directory
// records); a bad value is one line naming the key and the accepted values.
TEST(Cli, KernelSwitches) {
  Result r =
      run("config --set kernels.grouped_gemm=cublaslt --set kernels.cutlass_tile=forward=small "
          "--set parallel.ep_transport=nccl");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\ngrouped_gemm = 'cublaslt'  # "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\ncutlass_tile = 'forward=small,dgrad=auto,"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nep_transport = 'nccl'  # "), std::string::npos) << r.out;
  expect_one_line_error(run("info --set kernels.fused_swiglu=maybe"), {"kernels.fused_swiglu", "auto, on, off"});
  expect_one_line_error(run("config --set kernels.gemm_sms=-4"), {"kernels.gemm_sms = -4", ">= 0"});
  expect_one_line_error(run("config --set kernels.own_wgrad_units=0"), {"kernels.own_wgrad_units = 0", "between 1"});
  expect_one_line_error(run("config --set parallel.ep_transport=shm"), {"parallel.ep_transport", "auto, nccl, ipc"});
}

// `moefold plan` runs without a GPU: the per-rank bytes, the verdict, the parts, and the
// distributed optimizer's effect on a layout with data parallelism; bad sizes, worlds and
// layouts are one line each.
TEST(Cli, PlanPrintsEachRanksBytes) {
  Result r = run("plan --config qwen3-30b-a3b --world 8 --set parallel.ep=8 --set model.num_hidden_layers=4");
  EXPECT_EQ(r.code, 0) << r.err;
  for (const char* want : {"(pp, tp, cp, dp, ep, etp) = (1, 1, 1, 8, 8, 1)", "master weights (f32)", "optimizer state",
                           "planned on the GPU", "layers.0-3 ", "parallel.distributed_optimizer = true: peak",
                           "with train.exp_avg_dtype = train.exp_avg_sq_dtype = bf16: peak"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  // With FP8 linears, keeping their weights only in FP8 is one of the options (after the free ones).
  Result fp8 =
      run("plan --config qwen3-30b-a3b --world 8 --set parallel.ep=8 --set model.num_hidden_layers=4 "
          "--set train.fp8=blockwise");
  EXPECT_EQ(fp8.code, 0) << fp8.err;
  EXPECT_NE(fp8.out.find("train.main_grads_dtype = bf16, train.fp8_param = true: peak"), std::string::npos) << fp8.out;
  EXPECT_EQ(r.out.find("train.fp8_param"), std::string::npos) << r.out;
  // The slot dispatcher's fixed sizes: 4096 tokens per rank, K = 8 of 128 experts over EP 8 (16
  // each): slots of 2 x 4096 x 8 / 8 rows at twice the average, 2 x 4096 x 8 rows to the experts.
  Result slots =
      run("plan --config qwen3-30b-a3b --world 8 --set parallel.ep=8 --set model.num_hidden_layers=4 "
          "--set moe.dispatcher=slots --set moe.ep_recv_factor=2 --set train.micro_batch_size=1");
  EXPECT_EQ(slots.code, 0) << slots.err;
  EXPECT_NE(slots.out.find("slot dispatcher (moe.ep_recv_factor = 2): 8192 rows per peer slot, 65536 rows to the "
                           "experts; each exchange moves 65536 rows per rank whatever the routing (32768 routed on "
                           "average)"),
            std::string::npos)
      << slots.out;
  Result tiny = run("plan --device cpu --gpu-memory 1TB");
  EXPECT_EQ(tiny.code, 0) << tiny.err;
  EXPECT_NE(tiny.out.find("planned on the host"), std::string::npos) << tiny.out;
  EXPECT_NE(tiny.out.find(": fits"), std::string::npos) << tiny.out;
  EXPECT_NE(run("plan --config qwen3-30b-a3b --gpu-memory 1GiB").out.find("DOES NOT FIT"), std::string::npos);
  expect_one_line_error(run("plan --gpu-memory lots"), {"--gpu-memory lots", "141GiB"});
  // The memory options' bad values: one line each.
  expect_one_line_error(run("plan --device cpu --set train.main_grads_dtype=bf16"),
                        {"train.main_grads_dtype = 'bf16'", "CUDA"});
  expect_one_line_error(run("info --set train.main_grads_dtype=fp16"), {"train.main_grads_dtype", "f32, bf16"});
  expect_one_line_error(run("info --set 'train.recompute_modules=[\"layernorm\",\"attn\"]'"),
                        {"train.recompute_modules", "'attn'", "core_attn"});
  expect_one_line_error(run("info --set train.recompute_num_layers=99"),
                        {"train.recompute_num_layers = 99", "model.num_hidden_layers"});
  expect_one_line_error(run("info --set train.recompute_method=full"), {"train.recompute_method", "uniform, block"});
  expect_one_line_error(run("info --set train.optimizer_offload_fraction=1.5"),
                        {"train.optimizer_offload_fraction = 1.5", "[0, 1]"});
  expect_one_line_error(run("info --set train.optimizer_offload_fraction=0.5"),
                        {"train.optimizer_offload_fraction = 0.5", "parallel.distributed_optimizer"});
  expect_one_line_error(
      run("plan --device cpu --set train.optimizer_offload_fraction=0.5 --set parallel.distributed_optimizer=true"),
      {"train.optimizer_offload_fraction = 0.5", "CUDA"});
  expect_one_line_error(run("info --set train.fp8=e4m3"), {"train.fp8 = 'e4m3'", "none, blockwise"});
  expect_one_line_error(run("info --set 'train.fp8_exclude=[\"router\"]'"),
                        {"train.fp8_exclude", "'router'", "shared_experts"});
  expect_one_line_error(run("info --set 'train.offload_modules=[\"qkv\"]'"),
                        {"train.offload_modules", "'qkv'", "qkv_linear"});
  expect_one_line_error(run("plan --device cpu --set 'train.offload_modules=[\"moe_act\"]'"),
                        {"train.offload_modules", "CUDA"});
  Result acts =
      run("plan --config qwen3-30b-a3b --set model.num_hidden_layers=4 "
          "--set 'train.offload_modules=[\"moe_act\",\"expert_fc1\"]'");
  EXPECT_EQ(acts.code, 0) << acts.err;
  EXPECT_NE(acts.out.find("offloaded layers' slots"), std::string::npos) << acts.out;
  Result off =
      run("plan --config qwen3-30b-a3b --set model.num_hidden_layers=4 --set parallel.distributed_optimizer=true "
          "--set train.optimizer_offload_fraction=0.5");
  EXPECT_EQ(off.code, 0) << off.err;
  EXPECT_NE(off.out.find("optimizer state offloaded"), std::string::npos) << off.out;
  // The plan of a config with recomputation: the layers keep less, the workspace is shared.
  Result re = run("plan --config qwen3-30b-a3b --set model.num_hidden_layers=4 --set train.recompute_num_layers=2");
  EXPECT_EQ(re.code, 0) << re.err;
  for (const char* want : {"layers' shared workspace", "recomputed layers' block"})
    EXPECT_NE(re.out.find(want), std::string::npos) << want << "\n" << re.out;
  expect_one_line_error(run("plan --world 0"), {"--world 0"});
  expect_one_line_error(run("plan --world 3 --set parallel.ep=2"), {"ep x etp = 2 x 1 = 2 does not divide"});
}

TEST(Cli, BadData) {
  testing::TempDir tmp("test_cli");
  const fs::path& d = tmp.path();
  expect_one_line_error(run(cat("train --run-dir r1 --steps 1 --set data.path=", (d / "missing").string()), d),
                        {"data.path", "missing"});
  // A truncated token file.
  {
    std::ofstream f(d / "t.tokens", std::ios::binary);
    f.write("MFTOKENS\x01\0\0\0\x02\0\0\0\xe8\x03\0\0\0\0\0\0", 24);
    f.write("\x01\0\x02\0", 4);
  }
  expect_one_line_error(run(cat("train --run-dir r2 --steps 1 --set data.path=", (d / "t.tokens").string()), d),
                        {"t.tokens", "trunc"});
  // Token ids beyond the vocabulary.
  ASSERT_EQ(
      run(cat("prepare ", write(d / "text.txt", std::string(5000, 'z')), " -o ", (d / "z.tokens").string()), d).code,
      0);
  expect_one_line_error(
      run(cat("train --run-dir r3 --steps 1 --set model.vocab_size=100 --set data.path=", (d / "z.tokens").string()),
          d),
      {"z.tokens", "122"});
}

TEST(Cli, BadLayoutsFailOnEveryRankWithoutHanging) {
  testing::TempDir tmp("test_cli");
  const fs::path& d = tmp.path();
  ASSERT_EQ(run(cat("prepare ", write(d / "t.txt", std::string(20000, 'a')), " -o data.tokens"), d).code, 0);
  auto expect_on_both = [&](const std::string& set, const std::string& needle) {
    Result r = run_mpi(2, cat("train --run-dir r --steps 1 --set data.path=data.tokens ", kSmall, " ", set), d);
    EXPECT_NE(r.code, 0) << set;
    // One line per rank (config errors come before MPI starts, layout errors after: "rank R: ").
    size_t lines = 0;
    for (size_t at = r.err.find("moefold: error: "); at != std::string::npos;
         at = r.err.find("moefold: error: ", at + 1))
      ++lines;
    EXPECT_EQ(lines, 2u) << set << ": " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << set << ": " << r.err;
    EXPECT_EQ(r.err.find("timeout"), std::string::npos) << r.err;
  };
  expect_on_both("--set parallel.ep=3", "moe.num_experts = 4 is not divisible by parallel.ep = 3");
  expect_on_both("--set parallel.ep=4", "ep x etp = 4 x 1 = 4 does not divide dp x cp x tp = 2 x 1 x 1 = 2");
  expect_on_both("--set parallel.dp=4", "but the world has 2 ranks");
  expect_on_both("--set parallel.tp=2", "parallel.tp = 2");
  expect_on_both("--set parallel.cp=2 --set train.seq_len=18",
                 "train.seq_len = 18 is not divisible by 2 x parallel.cp = 4");
  expect_on_both("--set train.global_batch_size=2",
                 "train.global_batch_size = 2 is not divisible by train.micro_batch_size x parallel.dp = 2 x 2 = 4");
  // Pipeline stages: one decoder layer does not split into two stages; ep over a stage's one rank.
  expect_on_both("--set parallel.pp=2", "model.num_hidden_layers = 1 does not split into parallel.pp = 2 stages");
  expect_on_both("--set parallel.pp=2 --set model.num_hidden_layers=2 --set parallel.ep=2",
                 "ep x etp = 2 x 1 = 2 does not divide dp x cp x tp = 1 x 1 x 1 = 1");
  // Emulated nodes must split the host's ranks; the hierarchical dispatcher needs EP.
  expect_on_both("--set train.global_batch_size=4 --set parallel.ranks_per_node=3",
                 "parallel.ranks_per_node = 3 does not divide the 2 ranks on host");
  expect_on_both("--set moe.dispatcher=hierarchical", "moe.dispatcher = \"hierarchical\" needs parallel.ep > 1");
  // Interleaving needs the micro-batches per step to be a multiple of pp: 2 sequences are one here.
  expect_on_both("--set parallel.pp=2 --set parallel.vpp=2 --set model.num_hidden_layers=4",
                 "the interleaved schedule needs the micro-batches per step");
  // A good layout trains two steps on both ranks and writes both ranks' shards.
  auto expect_trains = [&](const std::string& run_dir, const std::string& set) {
    Result r =
        run_mpi(2, cat("train --run-dir ", run_dir, " --steps 2 --set data.path=data.tokens ", kSmall, " ", set), d);
    EXPECT_EQ(r.code, 0) << set << ": " << r.err;
    EXPECT_TRUE(fs::exists(d / run_dir / "checkpoints" / "step_00000002" / "model-00002-of-00002.safetensors")) << set;
  };
  // Two stages train and write a shard each.
  expect_trains("pp", "--set parallel.pp=2 --set model.num_hidden_layers=2");
  // Two emulated nodes of one rank: the hierarchical dispatcher trains and counts what crossed.
  expect_trains("hier",
                "--set train.global_batch_size=4 --set parallel.ep=2 --set moe.dispatcher=hierarchical "
                "--set parallel.ranks_per_node=1");
  EXPECT_NE(testing::read_bytes((d / "hier" / "metrics.jsonl").string()).find("\"inter_node_bytes\""),
            std::string::npos);
  // The slot dispatcher: slots of exactly the average share cannot hold the routing (the corpus is
  // one character, so with K = 1 every token takes the same expert, one rank's): the first step
  // fails on both ranks with one line naming the key, and no checkpoint is written; at the worst
  // case it trains.
  expect_on_both(
      "--set train.global_batch_size=4 --set parallel.ep=2 --set moe.dispatcher=slots "
      "--set moe.ep_recv_factor=1 --set moe.num_experts_per_tok=1",
      "rows of the expert-parallel exchange did not fit its fixed slots (moe.dispatcher = \"slots\", "
      "moe.ep_recv_factor = 1); raise moe.ep_recv_factor (this routing asked for up to 2 times a bound");
  EXPECT_FALSE(fs::exists(d / "r" / "checkpoints"));
  expect_trains("slots",
                "--set train.global_batch_size=4 --set parallel.ep=2 --set moe.dispatcher=slots "
                "--set moe.num_experts_per_tok=1");
  // Every token on one rank's expert fills that peer's worst-case slot exactly.
  EXPECT_NE(testing::read_bytes((d / "slots" / "metrics.jsonl").string()).find("\"ep_slot_fill\":1.0"),
            std::string::npos);
  EXPECT_NE(testing::read_bytes((d / "slots" / "train.log").string()).find(" | slot fill 1.00 | "), std::string::npos);
  // And the good layout trains, writing one shard per EP rank.
  expect_trains("good", "--set train.global_batch_size=4 --set parallel.ep=2");
}

TEST(Cli, PrepareTrainResumeAndBadCheckpoint) {
  testing::TempDir tmp("test_cli");
  const fs::path& d = tmp.path();
  fs::create_directories(d / "corpus" / "sub");
  std::string text;
  for (int i = 0; i < 400; ++i) text += cat("line ", i % 13, ": the quick brown fox jumps over the lazy dog\n");
  write(d / "corpus" / "a.txt", text);
  write(d / "corpus" / "sub" / "b.txt", text);
  Result p = run("prepare corpus -o data.tokens", d);
  ASSERT_EQ(p.code, 0) << p.err;
  EXPECT_NE(p.out.find("prepared 2 files"), std::string::npos) << p.out;

  Result t = run(cat("train --run-dir run --steps 3 --set data.path=data.tokens ", kSmall), d);
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_TRUE(fs::exists(d / "run" / "checkpoints" / "step_00000003" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(d / "run" / "config.toml"));
  // Fresh run into a directory with checkpoints: refused, nothing overwritten.
  expect_one_line_error(run(cat("train --run-dir run --steps 3 --set data.path=data.tokens ", kSmall), d),
                        {"already holds checkpoints", "--resume"});
  Result r = run(cat("train --run-dir run --resume --steps 5 --set data.path=data.tokens ", kSmall), d);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(d / "run" / "checkpoints" / "step_00000005"));
  // A resumed run whose config no longer matches the checkpoint.
  expect_one_line_error(run(cat("train --run-dir run --resume --steps 6 --set data.path=data.tokens ", kSmall,
                                " --set moe.moe_intermediate_size=12"),
                            d),
                        {"model.safetensors", "shape"});
  // A corrupt checkpoint.
  fs::resize_file(d / "run" / "checkpoints" / "step_00000005" / "model.safetensors", 64);
  expect_one_line_error(run(cat("train --run-dir run --resume --steps 6 --set data.path=data.tokens ", kSmall), d),
                        {"step_00000005/model.safetensors"});
  expect_one_line_error(run(cat("train --run-dir empty --resume --set data.path=data.tokens ", kSmall), d),
                        {"no checkpoint"});
}

// End-to-end numerics against an independent implementation: tiny random Qwen3-MoE models built
// and evaluated by Hugging Face transformers (scripts/make_hf_fixtures.py, committed fixtures),
// imported with `moefold convert --from-hf` and evaluated with `moefold eval`.
// export(import(x)) is x: every tensor's name, dtype, shape and bytes.
void expect_same_safetensors(const fs::path& a, const fs::path& b) {
  SafetensorsReader orig(a.string()), back(b.string());
  ASSERT_EQ(orig.tensors().size(), back.tensors().size());
  for (const SafetensorsTensor& t : orig.tensors()) {
    const SafetensorsTensor& u = back.tensor(t.name);
    EXPECT_EQ(u.dtype, t.dtype) << t.name;
    EXPECT_EQ(u.shape, t.shape) << t.name;
    ASSERT_EQ(u.nbytes, t.nbytes) << t.name;
    EXPECT_EQ(std::memcmp(u.data, t.data, t.nbytes), 0) << t.name;
  }
}

// The committed fixtures (scripts/make_hf_fixtures.py): moefold's logits and loss against
// transformers', the bit-exact round trip, and continued pre-training from the import.
TEST(Cli, HuggingFaceParityEveryFamily) {
  testing::TempDir tmp("test_cli");
  const fs::path& d = tmp.path();
  const fs::path fixtures = fs::path(MOEFOLD_SOURCE_DIR) / "tests" / "fixtures" / "hf";
  for (const char* name : {"qwen3_moe_a", "qwen3_moe_b", "qwen3_moe_dense", "mixtral_a", "mixtral_b", "olmoe_a",
                           "olmoe_b", "deepseek_v3_a", "deepseek_v3_b"}) {
    SCOPED_TRACE(name);
    const fs::path fixture = fixtures / name;
    Result c = run(cat("convert --from-hf '", fixture.string(), "' --to ", name), d);
    ASSERT_EQ(c.code, 0) << c.err;
    Result e = run(cat("eval --checkpoint ", name, "/checkpoints/step_00000000 --tokens '",
                       (fixture / "inputs.npy").string(), "' --logits ", name, ".logits.npy"),
                   d);
    ASSERT_EQ(e.code, 0) << e.err;
    const double got = std::stod(e.out.substr(e.out.find("\"loss\": ") + 8));
    const std::string expected = testing::read_bytes((fixture / "expected.json").string());
    const double want = std::stod(expected.substr(expected.find("\"loss\": ") + 8));
    EXPECT_NEAR(got, want, 1e-4 * want) << "moefold " << got << " vs transformers " << want;
    // Logits: ours cover positions 0..cols-2 (the last token predicts nothing in a loss).
    const NpyFloats ours = read_npy_f32((d / cat(name, ".logits.npy")).string());
    const NpyFloats ref = read_npy_f32((fixture / "logits.npy").string());
    ASSERT_EQ(ref.shape.size(), 3u);
    const int64_t rows = ref.shape[0], cols = ref.shape[1], vocab = ref.shape[2];
    ASSERT_EQ(ours.shape, (std::vector<int64_t>{rows, cols - 1, vocab}));
    double scale = 0, err = 0;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < (cols - 1) * vocab; ++i) {
        const double a = ours.values[r * (cols - 1) * vocab + i], b = ref.values[r * cols * vocab + i];
        scale = std::max(scale, std::abs(b));
        err = std::max(err, std::abs(a - b));
      }
    EXPECT_LE(err, 1e-4 * scale) << "largest logit error " << err << " (largest logit " << scale << ")";
    std::printf("%s: loss %.10f vs transformers %.10f (rel %.2e); largest logit error %.2e of %.3f (rel %.2e)\n", name,
                got, want, std::abs(got - want) / want, err, scale, err / scale);
    Result x = run(cat("convert --from ", name, "/checkpoints/step_00000000 --to-hf ", name, "_hf"), d);
    ASSERT_EQ(x.code, 0) << x.err;
    expect_same_safetensors(fixture / "model.safetensors", d / cat(name, "_hf") / "model.safetensors");
    ASSERT_EQ(run(cat("convert --from-hf ", name, "_hf --to ", name, "_again"), d).code, 0);
    EXPECT_EQ(testing::read_bytes((d / name / "config.toml").string()),
              testing::read_bytes((d / cat(name, "_again") / "config.toml").string()));
    // Continued pre-training starts from the import (step 0) and goes on to step 2.
    std::vector<uint32_t> toks(4000);
    for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint32_t>(i * 7 % 13);
    write_token_file((d / "cpt.tokens").string(), toks, 2);
    Result t = run(cat("train --config ", name, "/config.toml --run-dir ", name,
                       " --resume --steps 2 --quiet --set train.seq_len=8 --set train.micro_batch_size=1 "
                       "--set train.global_batch_size=2 --set data.path=cpt.tokens"),
                   d);
    EXPECT_EQ(t.code, 0) << t.err;
    EXPECT_TRUE(fs::exists(d / name / "checkpoints" / "step_00000002" / "trainer.json"));
  }
  // bfloat16 checkpoints come back bfloat16, bit for bit (the selection bias stays float32).
  for (const char* name : {"mixtral_b_bf16", "deepseek_v3_b_bf16"}) {
    SCOPED_TRACE(name);
    ASSERT_EQ(run(cat("convert --from-hf '", (fixtures / name).string(), "' --to ", name), d).code, 0);
    Result x = run(cat("convert --from ", name, "/checkpoints/step_00000000 --to-hf ", name, "_hf"), d);
    ASSERT_EQ(x.code, 0) << x.err;
    expect_same_safetensors(fixtures / name / "model.safetensors", d / cat(name, "_hf") / "model.safetensors");
  }
}

// Multi-token prediction goes to and comes back from DeepSeek-V3's layout: layers L.. hold the
// modules, with copies of the (shared) embedding and LM head, which must equal the main ones.
TEST(Cli, MultiTokenPredictionRoundTrip) {
  testing::TempDir tmp("test_cli");
  const fs::path& d = tmp.path();
  const fs::path fixture = fs::path(MOEFOLD_SOURCE_DIR) / "tests" / "fixtures" / "hf" / "deepseek_v3_b";
  ASSERT_EQ(run(cat("convert --from-hf '", fixture.string(), "' --to base"), d).code, 0);
  std::vector<uint32_t> toks(4000);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint32_t>(i * 7 % 13);
  write_token_file((d / "t.tokens").string(), toks, 2);
  Result t =
      run("train --config base/config.toml --run-dir mtp --steps 1 --quiet --set train.seq_len=8 "
          "--set train.micro_batch_size=1 --set train.global_batch_size=2 --set data.path=t.tokens "
          "--set model.num_nextn_predict_layers=2",
          d);
  ASSERT_EQ(t.code, 0) << t.err;
  const std::string metrics = testing::read_bytes((d / "mtp" / "metrics.jsonl").string());
  const size_t at = metrics.find("\"mtp_loss\":");
  ASSERT_NE(at, std::string::npos) << metrics;
  EXPECT_GT(std::stod(metrics.substr(at + 11)), 0.1);
  ASSERT_EQ(run("convert --from mtp/checkpoints/step_00000001 --to-hf mtp_hf", d).code, 0);
  SafetensorsReader out((d / "mtp_hf" / "model.safetensors").string());
  for (const char* name : {"model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
                           "model.layers.4.hnorm.weight", "model.layers.4.shared_head.norm.weight",
                           "model.layers.3.shared_head.head.weight", "model.layers.4.embed_tokens.weight",
                           "model.layers.4.mlp.gate.weight", "model.layers.3.self_attn.kv_b_proj.weight"})
    EXPECT_NO_FATAL_FAILURE(out.tensor(name)) << name;
  ASSERT_EQ(run("convert --from-hf mtp_hf --to again", d).code, 0);
  EXPECT_NE(testing::read_bytes((d / "again" / "config.toml").string()).find("num_nextn_predict_layers = 2"),
            std::string::npos);
  ASSERT_EQ(run("convert --from again/checkpoints/step_00000000 --to-hf again_hf", d).code, 0);
  expect_same_safetensors(d / "mtp_hf" / "model.safetensors", d / "again_hf" / "model.safetensors");
  // A "copy" of the LM head that is not one cannot be shared: one line naming both tensors.
  std::vector<SafetensorsEntry> entries;
  std::vector<std::vector<uint8_t>> bytes;
  for (const SafetensorsTensor& u : out.tensors()) bytes.emplace_back(u.data, u.data + u.nbytes);
  size_t i = 0;
  for (const SafetensorsTensor& u : out.tensors()) {
    if (u.name == "model.layers.3.shared_head.head.weight") bytes[i][0] ^= 1;
    Shape shape;  // every tensor here is 1-D or 2-D
    shape.ndim = static_cast<int>(u.shape.size());
    std::copy(u.shape.begin(), u.shape.end(), shape.dims.begin());
    entries.push_back({u.name, Tensor(bytes[i].data(), u.dtype, shape), u.dtype});
    ++i;
  }
  fs::create_directories(d / "bad_hf");
  fs::copy_file(d / "mtp_hf" / "config.json", d / "bad_hf" / "config.json");
  write_safetensors((d / "bad_hf" / "model.safetensors").string(), entries, {{"format", "pt"}});
  expect_one_line_error(run("convert --from-hf bad_hf --to bad", d),
                        {"model.layers.3.shared_head.head.weight", "differs from 'lm_head.weight'"});
}

TEST(Cli, HuggingFaceBadInput) {
  testing::TempDir tmp("test_cli");
  const fs::path& d = tmp.path();
  // Unsupported or broken Hugging Face directories: one line naming the file and key.
  const fs::path a = fs::path(MOEFOLD_SOURCE_DIR) / "tests" / "fixtures" / "hf" / "qwen3_moe_a";
  fs::copy(a, d / "mixtral", fs::copy_options::recursive);
  std::string cfg = testing::read_bytes((a / "config.json").string());
  std::string other = cfg;
  other.replace(other.find("Qwen3MoeForCausalLM"), 19, "LlamaForCausalLM");
  testing::write_bytes((d / "mixtral" / "config.json").string(), other);
  expect_one_line_error(run("convert --from-hf mixtral --to m1", d),
                        {"mixtral/config.json", "architecture 'LlamaForCausalLM' is not supported"});
  std::string deeper = cfg;
  deeper.replace(deeper.find("\"num_hidden_layers\": 2"), 22, "\"num_hidden_layers\": 3");
  testing::write_bytes((d / "mixtral" / "config.json").string(), deeper);
  expect_one_line_error(run("convert --from-hf mixtral --to m2", d), {"model.layers.2.", "is missing"});
  testing::write_bytes((d / "mixtral" / "config.json").string(), cfg);
  fs::resize_file(d / "mixtral" / "model.safetensors", 4000);
  expect_one_line_error(run("convert --from-hf mixtral --to m3", d), {"mixtral/model.safetensors"});
  expect_one_line_error(run("convert --from-hf nowhere --to m4", d), {"nowhere/config.json"});
  // Wrong shapes: the config promises wider experts than the tensors hold.
  std::string wider = cfg;
  wider.replace(wider.find("\"moe_intermediate_size\": 12"), 27, "\"moe_intermediate_size\": 16");
  testing::write_bytes((d / "mixtral" / "config.json").string(), wider);
  fs::copy_file(a / "model.safetensors", d / "mixtral" / "model.safetensors", fs::copy_options::overwrite_existing);
  expect_one_line_error(run("convert --from-hf mixtral --to m5", d), {"mlp.experts.0.gate_proj.weight", "[12, 24]"});
  // Wrong dtype: an integer tensor where a float weight belongs.
  testing::write_bytes((d / "mixtral" / "config.json").string(), cfg);
  {
    SafetensorsReader in((a / "model.safetensors").string());
    std::vector<SafetensorsEntry> entries;
    std::vector<std::vector<uint8_t>> bytes;
    for (const SafetensorsTensor& u : in.tensors()) bytes.emplace_back(u.data, u.data + u.nbytes);
    size_t i = 0;
    for (const SafetensorsTensor& u : in.tensors()) {
      Shape shape;
      shape.ndim = static_cast<int>(u.shape.size());
      std::copy(u.shape.begin(), u.shape.end(), shape.dims.begin());
      const DType dt = u.name == "model.norm.weight" ? DType::i32 : u.dtype;
      entries.push_back({u.name, Tensor(bytes[i++].data(), dt, shape), dt});
    }
    write_safetensors((d / "mixtral" / "model.safetensors").string(), entries, {{"format", "pt"}});
  }
  expect_one_line_error(run("convert --from-hf mixtral --to m6", d), {"model.norm.weight"});
  // Features of a family that moefold does not implement are refused by name, not ignored.
  const fs::path fx = fs::path(MOEFOLD_SOURCE_DIR) / "tests" / "fixtures" / "hf";
  struct Edit {
    const char* fixture;
    std::string from, to, error;
  };
  for (const Edit& e : std::vector<Edit>{
           {"mixtral_a", "\"sliding_window\": null", "\"sliding_window\": 4096", "sliding-window attention"},
           {"olmoe_a", "\"clip_qkv\": null", "\"clip_qkv\": 8.0", "clip_qkv"},
           {"deepseek_v3_a", "\"rope_type\": \"yarn\"", "\"rope_type\": \"longrope\"", "rope type 'longrope'"},
           {"deepseek_v3_b", "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"", "hidden_act 'gelu'"},
           {"qwen3_moe_b", "\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true", "tie_word_embeddings"}}) {
    const fs::path dir = d / cat(e.fixture, "_edit");
    fs::copy(fx / e.fixture, dir, fs::copy_options::recursive);
    std::string c = testing::read_bytes((dir / "config.json").string());
    ASSERT_NE(c.find(e.from), std::string::npos) << e.fixture << ": " << e.from;
    c.replace(c.find(e.from), e.from.size(), e.to);
    testing::write_bytes((dir / "config.json").string(), c);
    expect_one_line_error(run(cat("convert --from-hf ", dir.filename().string(), " --to ", e.fixture, "_x"), d),
                          {cat(e.fixture, "_edit/config.json"), e.error});
  }
}

TEST(Cli, EvalMatchesTheTrainersHeldOutLoss) {
  testing::TempDir tmp("test_cli");
  const fs::path& d = tmp.path();
  std::string text;
  for (int i = 0; i < 300; ++i) text += cat("line ", i % 11, ": the quick brown fox jumps over the lazy dog\n");
  write(d / "a.txt", text);
  ASSERT_EQ(run("prepare a.txt -o data.tokens", d).code, 0);
  // eval_batches = 2 held-out micro-batches of 2 sequences: 4 windows of seq_len + 1 = 17 tokens.
  Result t = run(cat("train --run-dir run --steps 3 --set data.path=data.tokens --set data.valid_fraction=0.1 ", kSmall,
                     " --set train.eval_batches=2"),
                 d);
  ASSERT_EQ(t.code, 0) << t.err;
  std::ifstream metrics(d / "run" / "metrics.jsonl");
  std::string line, last;
  while (std::getline(metrics, line)) last = line;
  const size_t at = last.find("\"eval_loss\":");
  ASSERT_NE(at, std::string::npos) << last;
  const double want = std::stod(last.substr(at + 12));
  // The same windows the trainer evaluated, as a 2-D int32 .npy (one sequence per row).
  TokenDataset data = open_token_dataset((d / "data.tokens").string());
  const int64_t n_valid = static_cast<int64_t>(0.1 * static_cast<double>(data.num_tokens()));
  const int64_t first = data.num_tokens() - n_valid, rows = 4, cols = 17;
  std::vector<int32_t> toks(static_cast<size_t>(rows * cols));
  data.copy_tokens(first, rows * cols, toks.data());
  write_npy_tokens((d / "valid.npy").string(), toks, rows, cols);
  Result e = run("eval --checkpoint run/checkpoints/step_00000003 --tokens valid.npy", d);
  ASSERT_EQ(e.code, 0) << e.err;
  const size_t lat = e.out.find("\"loss\": ");
  ASSERT_NE(lat, std::string::npos) << e.out;
  const double got = std::stod(e.out.substr(lat + 8));
  EXPECT_NEAR(got, want, 1e-5 * want) << e.out;
  EXPECT_NE(e.out.find("\"tokens\": 64, \"sequences\": 4, \"step\": 3"), std::string::npos) << e.out;
  // The token file with --seq-len reads consecutive sequences from the start.
  Result f = run("eval --checkpoint run/checkpoints/step_00000003 --tokens data.tokens --seq-len 17", d);
  EXPECT_EQ(f.code, 0) << f.err;
  EXPECT_NE(f.out.find("\"sequences\": "), std::string::npos) << f.out;
  // Bad input: one line naming the file.
  std::string bytes = testing::read_bytes((d / "valid.npy").string());
  testing::write_bytes((d / "cut.npy").string(), bytes.substr(0, bytes.size() - 5));
  expect_one_line_error(run("eval --checkpoint run/checkpoints/step_00000003 --tokens cut.npy", d),
                        {"cut.npy", "truncated"});
  write_npy_tokens((d / "big.npy").string(), std::vector<int32_t>(6, 400), 2, 3);
  expect_one_line_error(run("eval --checkpoint run/checkpoints/step_00000003 --tokens big.npy", d),
                        {"big.npy", "token id 400", "outside the vocabulary"});
  std::string flat = bytes;
  flat.replace(flat.find("(4, 17)"), 7, "(68,)  ");
  testing::write_bytes((d / "flat.npy").string(), flat);
  expect_one_line_error(run("eval --checkpoint run/checkpoints/step_00000003 --tokens flat.npy", d),
                        {"flat.npy", "2-D"});
  std::string floats = bytes;
  floats.replace(floats.find("<i4"), 3, "<f4");
  testing::write_bytes((d / "f.npy").string(), floats);
  expect_one_line_error(run("eval --checkpoint run/checkpoints/step_00000003 --tokens f.npy", d), {"f.npy", "<f4"});
  expect_one_line_error(run("eval --checkpoint nowhere --tokens valid.npy", d), {"nowhere/config.toml"});
  expect_one_line_error(run("eval --checkpoint run/checkpoints/step_00000003 --tokens data.tokens", d), {"--seq-len"});
  // An int64 Megatron token above 2^32 (found by the audit of the readers, docs/faults.md): it read
  // as its low 32 bits (2^32 + 1 as 1) and passed the vocabulary check.
  write_megatron_dataset((d / "wide").string(), {std::vector<uint32_t>(40, 1)}, MegatronDType::int64);
  {
    std::fstream bin(d / "wide.bin", std::ios::in | std::ios::out | std::ios::binary);
    bin.seekp(4);
    bin.put('\1');  // token 0 = 2^32 + 1
  }
  expect_one_line_error(run("eval --checkpoint run/checkpoints/step_00000003 --tokens wide --seq-len 17", d),
                        {"wide.bin", "token id 4294967297 at index 0"});
}

}  // namespace
}  // namespace moefold
