// Faults during training runs of the moefold binary (docs/faults.md lists them): SIGKILL at every
// stage of a checkpoint's write (synchronous and asynchronous), after which --resume starts from
// the newest complete checkpoint and continues with exactly the losses and weights of an
// uninterrupted run; a full disk during a save (an injected ENOSPC, and a real small tmpfs); a rank
// lost mid-step under mpirun. The faults come from MOEFOLD_FAULT (core/fault_points.h).
#include <sys/mount.h>

#include <csignal>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli_testing.h"
#include "moefold/train/checkpoint.h"

namespace moefold {
namespace {

// Six steps, a checkpoint after each, the two newest kept, an evaluation every other step.
const std::string kArgs = cat("train --run-dir run --steps 6 --set data.path=../data.tokens ", kSmall,
                              " --set train.checkpoint_interval=1 --set train.keep_checkpoints=2 "
                              "--set train.eval_interval=2");

// A directory with the token file every run here reads (../data.tokens from a run's directory).
class Workspace {
 public:
  Workspace() : tmp_("test_cli_faults") {
    std::string text;
    for (int i = 0; i < 300; ++i) text += cat("line ", i % 17, ": the quick brown fox jumps over the lazy dog\n");
    write(tmp_.path() / "corpus.txt", text);
    Result p = run("prepare corpus.txt -o data.tokens", tmp_.path());
    EXPECT_EQ(p.code, 0) << p.err;
  }
  // A fresh subdirectory for one run.
  fs::path fresh(const std::string& name) const {
    const fs::path d = tmp_.path() / name;
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
  }

 private:
  testing::TempDir tmp_;
};

// What a run computed, step by step: the fields of metrics.jsonl that do not depend on timing.
std::vector<nlohmann::json> losses(const fs::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    nlohmann::json j = nlohmann::json::parse(line);
    nlohmann::json kept;
    for (const char* k : {"step", "loss", "lm_loss", "aux_loss", "grad_norm", "skipped", "eval_loss"})
      if (j.contains(k)) kept[k] = j[k];
    out.push_back(kept);
  }
  return out;
}

// The uninterrupted run every trial is compared with (per mode: async must not change results).
struct Reference {
  std::vector<nlohmann::json> losses;
  std::string model, optimizer;  // the last checkpoint's files
};

const fs::path kLast = fs::path("run") / "checkpoints" / "step_00000006";

Reference reference(const Workspace& w, const std::string& extra) {
  const fs::path d = w.fresh("reference");
  Result r = run(cat(kArgs, extra), d);
  EXPECT_EQ(r.code, 0) << r.err;
  return {losses(d / "run"), testing::read_bytes((d / kLast / "model.safetensors").string()),
          testing::read_bytes((d / kLast / "optimizer.safetensors").string())};
}

// Every step_* directory is a complete checkpoint; nothing but them once a run has ended well.
void expect_only_complete_checkpoints(const fs::path& ckpt_dir, bool tidy, const std::string& what) {
  std::error_code ec;
  if (!fs::exists(ckpt_dir)) return;
  for (const auto& e : fs::directory_iterator(ckpt_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.starts_with("step_")) {
      EXPECT_NO_THROW(verify_checkpoint(e.path().string())) << what << ": " << n;
    } else {
      EXPECT_FALSE(tidy) << what << ": left behind: " << n;
    }
  }
}

// Kills a run with `fault` (MOEFOLD_FAULT), then resumes it (or starts it again when no
// checkpoint was complete) to the end: the same losses and final weights as the reference.
void kill_and_resume(const Workspace& w, const Reference& ref, const std::string& fault, const std::string& extra) {
  SCOPED_TRACE(fault + extra);
  const fs::path d = w.fresh("trial");
  Result killed = run(cat(kArgs, extra), d, 0, cat("MOEFOLD_FAULT=", fault));
  ASSERT_EQ(killed.code, 128 + SIGKILL) << killed.err;
  const fs::path ckpts = d / "run" / "checkpoints";
  expect_only_complete_checkpoints(ckpts, false, "after the kill");
  const bool any = !latest_checkpoint(ckpts.string()).empty();
  Result resumed = run(cat(kArgs, extra, any ? " --resume" : ""), d);
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_EQ(losses(d / "run"), ref.losses);
  EXPECT_TRUE(testing::read_bytes((d / kLast / "model.safetensors").string()) == ref.model);
  EXPECT_TRUE(testing::read_bytes((d / kLast / "optimizer.safetensors").string()) == ref.optimizer);
  expect_only_complete_checkpoints(ckpts, true, "after the resumed run");
}

// The points of a checkpoint's life a kill lands on, and at which pass (a save writes 24 model
// and 48 optimizer tensors here; six saves; pruning from the third).
const std::vector<std::string> kKills = {
    "safetensors.tensor:1:kill",   "safetensors.tensor:24:kill",  "safetensors.tensor:25:kill",
    "safetensors.tensor:72:kill",  "safetensors.tensor:73:kill",  "safetensors.tensor:130:kill",
    "safetensors.tensor:200:kill", "safetensors.tensor:290:kill", "safetensors.tensor:400:kill",
    "checkpoint.snapshot:1:kill",  "checkpoint.snapshot:4:kill",  "checkpoint.fsync:1:kill",
    "checkpoint.fsync:3:kill",     "checkpoint.fsync:6:kill",     "checkpoint.index:1:kill",
    "checkpoint.index:5:kill",     "checkpoint.rename:1:kill",    "checkpoint.rename:2:kill",
    "checkpoint.rename:6:kill",    "checkpoint.prune:1:kill",     "checkpoint.prune:3:kill",
    "checkpoint.prune:4:kill",     "train.step:2:kill",           "train.step:4:kill",
    "train.step:6:kill",           "checkpoint.snapshot:6:kill"};

TEST(CliFaults, KilledDuringSynchronousCheckpointsResumesExactly) {
  Workspace w;
  const Reference ref = reference(w, "");
  ASSERT_EQ(ref.losses.size(), 6u);
  for (const std::string& fault : kKills) kill_and_resume(w, ref, fault, "");
}

TEST(CliFaults, KilledDuringAsynchronousCheckpointsResumesExactly) {
  Workspace w;
  const Reference sync = reference(w, "");
  const std::string async = " --set train.async_checkpoint=true";
  const Reference ref = reference(w, async);
  // Writing in the background changes nothing that is computed or saved.
  EXPECT_EQ(ref.losses, sync.losses);
  EXPECT_TRUE(ref.model == sync.model && ref.optimizer == sync.optimizer);
  for (const std::string& fault : kKills) kill_and_resume(w, ref, fault, async);
}

// A full disk in the middle of the second save (the 80th tensor written: its model file).
TEST(CliFaults, FullDiskDuringASaveKeepsThePreviousCheckpoint) {
  Workspace w;
  const Reference ref = reference(w, "");
  for (const std::string mode : {"", " --set train.async_checkpoint=true"}) {
    SCOPED_TRACE(mode);
    const std::string full = "MOEFOLD_FAULT=safetensors.tensor:80:enospc";
    // on_save_error = stop (the default): one line, exit 1, the first checkpoint intact.
    fs::path d = w.fresh("stop");
    Result r = run(cat(kArgs, mode), d, 0, full);
    expect_one_line_error(
        r, {"checkpoint step_00000002 not saved", ".tmp-step_00000002/model.safetensors", "No space left on device"});
    expect_only_complete_checkpoints(d / "run" / "checkpoints", true, "stopped");
    EXPECT_EQ(latest_checkpoint((d / "run" / "checkpoints").string()),
              (d / "run" / "checkpoints" / "step_00000001").string());
    Result resumed = run(cat(kArgs, mode, " --resume"), d);
    ASSERT_EQ(resumed.code, 0) << resumed.err;
    EXPECT_EQ(losses(d / "run"), ref.losses);
    // on_save_error = continue: one warning line, training goes on, step 2 is not a checkpoint.
    d = w.fresh("continue");
    r = run(cat(kArgs, mode, " --set train.on_save_error=continue"), d, 0, full);
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("moefold: warning: checkpoint step_00000002 not saved: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("No space left on device; training goes on"), std::string::npos) << r.err;
    EXPECT_EQ(losses(d / "run"), ref.losses);
    EXPECT_TRUE(testing::read_bytes((d / kLast / "model.safetensors").string()) == ref.model);
    EXPECT_FALSE(fs::exists(d / "run" / "checkpoints" / "step_00000002"));
    expect_only_complete_checkpoints(d / "run" / "checkpoints", true, "continued");
  }
}

// A real full disk: the run directory on a 256 KiB tmpfs, where one checkpoint (160 KiB) fits
// and the second does not: refused before its first byte, naming what it needs and what is free
// (a disk filling up during the write is the injected ENOSPC above). Needs the right to mount
// (root; CI runs as root).
TEST(CliFaults, RealFullDiskOnASmallTmpfs) {
  Workspace w;
  const fs::path d = w.fresh("tmpfs");
  if (::mount("tmpfs", d.c_str(), "tmpfs", 0, "size=256k") != 0) GTEST_SKIP() << "cannot mount a tmpfs here";
  struct Unmount {
    fs::path d;
    ~Unmount() { ::umount(d.c_str()); }
  } unmount{d};
  const std::string args = cat(kArgs, " --set train.keep_checkpoints=0");
  Result r = run(args, d);
  expect_one_line_error(
      r, {"checkpoint step_00000002 not saved: it needs ", " kB and ", " kB free", "(nothing was written"});
  expect_only_complete_checkpoints(d / "run" / "checkpoints", true, "stopped");
  EXPECT_FALSE(latest_checkpoint((d / "run" / "checkpoints").string()).empty());
  // Going on: every later save fails the same way, training reaches its end.
  Result c = run(cat(args, " --resume --set train.on_save_error=continue --set train.async_checkpoint=true"), d);
  EXPECT_EQ(c.code, 0) << c.err;
  EXPECT_NE(c.err.find("checkpoint step_00000006 not saved"), std::string::npos) << c.err;
  EXPECT_EQ(losses(d / "run").size(), 6u);
  expect_only_complete_checkpoints(d / "run" / "checkpoints", true, "continued");
}

// A rank lost mid-step under mpirun (4 ranks): the others end within parallel.timeout_s, a line names it,
// every checkpoint left is complete, and the resumed run goes on exactly.
TEST(CliFaults, LostRankIsNamedAndNothingIsHalfWritten) {
  Workspace w;
  const std::string args = cat("train --run-dir run --steps 5 --set data.path=../data.tokens ", kSmall,
                               " --set train.global_batch_size=8 --set parallel.ep=2 --set train.checkpoint_interval=1"
                               " --set parallel.timeout_s=8 --set train.async_checkpoint=true");
  const fs::path ref_dir = w.fresh("reference");
  Result ref = run_mpi(4, args, ref_dir);
  ASSERT_EQ(ref.code, 0) << ref.err;
  // A rank that hangs (in a step; in its background checkpoint write) and one that dies. The
  // three others answer: only the lost one is named.
  const std::pair<std::string, std::string> faults[] = {
      {"train.step:3:hang@2", "world rank 2 does not answer"},
      {"safetensors.tensor:60:hang@1", "world rank 1 does not answer"},
      {"train.step:3:kill@2", "rank 2"}};  // mpirun names it
  for (const auto& [fault, named] : faults) {
    SCOPED_TRACE(fault);
    const fs::path d = w.fresh("lost");
    const auto t0 = std::chrono::steady_clock::now();
    Result r = run_mpi(4, args, d, cat("MOEFOLD_FAULT=", fault));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(r.code, 0) << r.err;
    EXPECT_LT(seconds, 8 + 10) << r.err;  // the timeout, and the launcher taking the job down
    EXPECT_NE(r.err.find(named), std::string::npos) << r.err;
    expect_only_complete_checkpoints(d / "run" / "checkpoints", false, "lost rank");
    Result resumed = run_mpi(4, cat(args, " --resume"), d);
    ASSERT_EQ(resumed.code, 0) << resumed.err;
    EXPECT_EQ(losses(d / "run"), losses(ref_dir / "run"));
  }
}

TEST(CliFaults, BadFaultSpecIsOneLine) {
  Workspace w;
  expect_one_line_error(run(kArgs, w.fresh("bad"), 0, "MOEFOLD_FAULT=checkpoint.rename:zero:kill"),
                        {"MOEFOLD_FAULT = 'checkpoint.rename:zero:kill'"});
}

}  // namespace
}  // namespace moefold
