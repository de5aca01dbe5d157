#include "moefold/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#define XXH_INLINE_ALL  // header-only: nothing to link
#include <xxhash.h>

#include "moefold/comm/agree.h"
#include "moefold/core/device.h"
#include "moefold/core/fault_points.h"
#include "moefold/io/json_limits.h"
#include "moefold/io/mapped_file.h"
#include "moefold/io/safetensors.h"
#include "moefold/model/hf_names.h"

namespace moefold {

namespace fs = std::filesystem;

namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kStepPrefix = "step_";

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%s%08lld", kStepPrefix, static_cast<long long>(step));
  return buf;
}

// "model.safetensors" alone, or Hugging Face's "model-00002-of-00004.safetensors".
std::string shard_file(const std::string& stem, int k, int n) {
  if (n == 1) return stem + ".safetensors";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s-%05d-of-%05d.safetensors", stem.c_str(), k + 1, n);
  return buf;
}

// The checksum of a whole file, which detects any corruption of a checkpoint file: XXH3-64
// (written since 2026-12; tens of GB/s), or FNV-1a 64 (byte-serial, about 1 GB/s) for checkpoints
// whose trainer.json names no "checksum" algorithm.
constexpr const char* kChecksum = "xxh3-64";
constexpr const char* kOldChecksum = "fnv1a-64";

uint64_t file_hash(const std::string& path, const std::string& algorithm) {
  MappedFile f(path);
  if (algorithm == kChecksum) return XXH3_64bits(f.data(), f.size());
  MF_CHECK(algorithm == kOldChecksum, algorithm);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < f.size(); ++i) h = (h ^ f.data()[i]) * 1099511628211ull;
  return h;
}

std::string checksum_text(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string file_checksum(const std::string& path, const std::string& algorithm = kChecksum) {
  return checksum_text(file_hash(path, algorithm));
}

void fsync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
  f.close();
  if (!f) MF_FAIL(path, ": cannot write");
  fsync_path(path);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  if (!f) MF_FAIL(path, ": cannot open (not a moefold checkpoint?)");
  try {
    return parse_json_limited<nlohmann::json>(path, f);
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(path, ": not valid JSON (", e.what(), ")");
  }
}

// The tensors one rank writes, as contiguous host tensors: views of the live state where it is
// contiguous host memory (a synchronous save), else copies: in `storage`, or in `pool` when given
// (an asynchronous save: every tensor copied, the state may change once save() returns).
struct ShardedNames {
  std::vector<SafetensorsEntry> weights, moments;
  std::vector<std::vector<float>> storage;
};

}  // namespace

// The snapshot's host memory: chunks (pinned on a GPU run, for fast copies from the GPU) kept
// from one save to the next, first-fit.
struct SnapshotPool {
  explicit SnapshotPool(bool pinned) : pinned(pinned) {}
  ~SnapshotPool() {
    for (const Chunk& c : chunks) pinned ? pinned_host_free(c.p) : std::free(c.p);
  }
  void reset() {
    for (Chunk& c : chunks) c.used = 0;
  }
  // An f32 host tensor of `shape` holding a copy of `src` (any device, row-strided views too).
  Tensor copy(const Tensor& src) {
    MF_CHECK(src.dtype() == DType::f32, src.str());
    const size_t bytes = (src.nbytes() + 63) / 64 * 64;
    auto take = [&](Chunk& c) {
      Tensor t(static_cast<char*>(c.p) + c.used, DType::f32, src.shape());
      c.used += bytes;
      t.copy_from(src);
      return t;
    };
    for (Chunk& c : chunks)
      if (c.bytes - c.used >= bytes) return take(c);
    const size_t n = std::max<size_t>(bytes, size_t{64} << 20);
    void* p = pinned ? pinned_host_malloc(n) : std::aligned_alloc(64, n);
    if (p == nullptr) MF_FAIL("out of host memory for a checkpoint's copy (", n >> 20, " MiB)");
    chunks.push_back({p, n, 0});
    return take(chunks.back());
  }

  struct Chunk {
    void* p;
    size_t bytes, used;
  };
  bool pinned;
  std::vector<Chunk> chunks;
};

namespace {

// The whole Hugging Face tensor of view `v` as a contiguous host tensor: the view itself, or a
// copy (kept in `storage`, or in `pool` when given); under tensor or expert tensor parallelism its
// slices gathered over `group`, in offset order (rank r holds offset r * size). Collective over
// `group` when v.dim >= 0.
Tensor whole_tensor(const NamedView& v, Communicator& group, std::vector<std::vector<float>>& storage,
                    SnapshotPool* pool) {
  if (v.dim < 0) return pool ? pool->copy(v.value) : contiguous_host(v.value, storage);
  const int64_t g = group.size(), rows = v.value.size(0), cols = v.value.size(1);
  MF_CHECK(v.value.dtype() == DType::f32 && v.value.ndim() == 2 && v.global_size == g * v.value.size(v.dim), v.name);
  std::vector<float> gathered(static_cast<size_t>(g * rows * cols));
  group.all_gather(contiguous_host(v.value, storage).view({1, rows * cols}),
                   Tensor(gathered.data(), DType::f32, {g, rows * cols}));
  std::vector<float> whole;
  if (v.dim == 0) {
    whole = std::move(gathered);
  } else {
    whole.resize(gathered.size());  // [rows, g * cols] from g blocks of [rows, cols]
    for (int64_t r = 0; r < g; ++r)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          whole[static_cast<size_t>(i * g * cols + r * cols + j)] =
              gathered[static_cast<size_t>((r * rows + i) * cols + j)];
  }
  const Shape shape = v.dim == 0 ? Shape{g * rows, cols} : Shape{rows, g * cols};
  if (pool) return pool->copy(Tensor(whole.data(), DType::f32, shape));
  storage.push_back(std::move(whole));
  return Tensor(storage.back().data(), DType::f32, shape);
}

// What this rank writes: dense parameters on rank 0 (TP shards gathered first), expert shards on
// the first EDP replica (ETP rank 0, after gathering the FFN slices). Every rank calls it (the
// gathers are collective).
ShardedNames entries_of(const std::vector<Param>& params, const AdamW& opt, const Mesh& mesh, SnapshotPool* pool) {
  ShardedNames out;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    const bool expert = p.group == ParamGroup::expert;
    if (p.pipeline_copy) continue;  // the stage that owns it writes it
    // Dense parameters: the first rank of the stage (pipeline parallelism: each stage its own).
    const bool first_of_stage = mesh.tp_rank == 0 && mesh.cp_rank == 0 && mesh.dp_rank == 0;
    const bool mine = expert ? mesh.edp_rank == 0 && mesh.etp_rank == 0 : first_of_stage;
    Communicator& group = expert ? *mesh.etp : *mesh.tp;  // the group its slices are split over
    const bool sliced = group.size() > 1 && (expert ? p.dim_shard.dim >= 0 : p.group == ParamGroup::tensor_parallel);
    if (!mine && !sliced) continue;
    auto add = [&](const Tensor& of, const char* suffix, std::vector<SafetensorsEntry>& to) {
      for (const NamedView& v : hf_views(p, of)) {
        Tensor whole = whole_tensor(v, group, out.storage, mine ? pool : nullptr);
        if (mine) to.push_back({v.name + suffix, whole, DType::f32});
      }
    };
    add(p.value, "", out.weights);
    add(opt.exp_avg(i), ".exp_avg", out.moments);
    add(opt.exp_avg_sq(i), ".exp_avg_sq", out.moments);
  }
  return out;
}

// A safetensors header's JSON per tensor, name excluded: dtype, shape and offsets (< 128 bytes);
// names are < 64 bytes where only their count is known (checkpoint_bytes).
constexpr int64_t kHeaderBytesPerTensor = 128;

// Bytes of the two files a writing rank writes: the tensors plus each file's header.
int64_t checkpoint_file_bytes(const ShardedNames& e) {
  int64_t bytes = 2 * (8 + 4096);
  for (const auto* list : {&e.weights, &e.moments})
    for (const SafetensorsEntry& t : *list)
      bytes += t.tensor.numel() * 4 + kHeaderBytesPerTensor + static_cast<int64_t>(t.name.size());
  return bytes;
}

// Throws naming the directory when its file system has less than `bytes` (+ 1 %) available.
void check_free_space(const std::string& dir, int64_t bytes) {
  std::error_code ec;
  const fs::space_info s = fs::space(dir, ec);
  if (ec) return;  // unknown: the write itself reports a full disk
  const double need = static_cast<double>(bytes) * 1.01;
  if (need > static_cast<double>(s.available))
    MF_FAIL("it needs ", format_bytes(static_cast<double>(bytes)), " and ", dir, " has ",
            format_bytes(static_cast<double>(s.available)),
            " free (nothing was written; free space, set train.keep_checkpoints, or use another --run-dir)");
}

// Hugging Face's sharded-checkpoint index: {"metadata": {"total_size": N}, "weight_map": {...}}.
nlohmann::json make_index(const std::string& dir, const std::string& stem, int n) {
  nlohmann::json map = nlohmann::json::object();
  int64_t total = 0;
  for (int k = 0; k < n; ++k) {
    const std::string file = shard_file(stem, k, n);
    SafetensorsReader r(dir + "/" + file);
    for (const SafetensorsTensor& t : r.tensors()) {
      map[t.name] = file;
      total += static_cast<int64_t>(t.nbytes);
    }
  }
  return {{"metadata", {{"total_size", total}}}, {"weight_map", map}};
}

// Complete checkpoints (step_N holding trainer.json), oldest first.
std::vector<fs::path> complete_checkpoints(const std::string& checkpoints_dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec)) {
    const std::string n = e.path().filename().string();
    if (n.starts_with(kStepPrefix) && fs::exists(e.path() / "trainer.json", ec)) out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());  // step_%08lld: names sort as steps
  return out;
}

// Removes a directory so that a crash midway never leaves something that looks like a checkpoint:
// renamed to ".del-NAME" first (atomic), then deleted.
void remove_dir(const fs::path& dir) {
  std::error_code ec;
  const fs::path doomed = dir.parent_path() / (".del-" + dir.filename().string());
  fs::remove_all(doomed, ec);
  fs::rename(dir, doomed, ec);
  if (ec) MF_FAIL(dir.string(), ": cannot remove: ", ec.message());
  fsync_path(dir.parent_path().string());
  (void)fault_point("checkpoint.prune");
  fs::remove_all(doomed, ec);
}

}  // namespace

// One save between its snapshot and its completion.
struct CheckpointWriter::Pending {
  TrainerState state;
  int64_t optimizer_steps = 0;
  std::string config_toml, final_dir, tmp_dir;
  int n = 1, k = 0;      // files per kind, and this rank's
  bool writes = false;   // this rank writes file k
  ShardedNames entries;  // what it writes
  // The write's outcome (async: set by the thread, read after `done`).
  std::atomic<bool> done{false};
  std::string error;
  uint64_t sums[2] = {0, 0};  // checksums (kChecksum) of the model and optimizer files
  std::thread thread;
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();

  void write() {
    try {
      const std::string model = tmp_dir + "/" + shard_file("model", k, n);
      const std::string moments = tmp_dir + "/" + shard_file("optimizer", k, n);
      write_safetensors(model, entries.weights, {{"format", "pt"}});
      write_safetensors(moments, entries.moments, {{"optimizer", "adamw"}});
      (void)fault_point("checkpoint.fsync");
      fsync_path(model);
      fsync_path(moments);
      sums[0] = file_hash(model, kChecksum);
      sums[1] = file_hash(moments, kChecksum);
    } catch (const Error& e) {
      error = e.what();
    }
    entries = ShardedNames();  // the views and copies are no longer needed
    done = true;
  }
};

CheckpointWriter::CheckpointWriter(std::string checkpoints_dir, const Mesh& mesh, CheckpointOptions opts)
    : dir_(std::move(checkpoints_dir)), mesh_(mesh), opts_(opts) {
  if (opts_.async) pool_ = std::make_unique<SnapshotPool>(opts_.device == Device::cuda);
}

CheckpointWriter::~CheckpointWriter() {
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();
}

std::string format_bytes(double bytes) {
  const char* unit = bytes >= 1e9 ? "GB" : bytes >= 1e6 ? "MB" : "kB";
  const double scale = bytes >= 1e9 ? 1e9 : bytes >= 1e6 ? 1e6 : 1e3;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", bytes / scale, unit);
  return buf;
}

int64_t checkpoint_bytes(const Config& cfg) {
  const ModelSize size = model_size(cfg.model, cfg.moe, cfg.train.seq_len);
  const int64_t params = size.total_params + size.mtp_params;
  // Each tensor's header entry (and its name) in the model file and twice in the optimizer's, at
  // most 16 + 3 E tensors per decoder layer; 32 KiB for trainer.json, config.toml and the indexes.
  const int64_t layers = cfg.model.num_hidden_layers + cfg.model.num_nextn_predict_layers;
  const int64_t tensors = 8 + layers * (16 + 3 * cfg.moe.num_experts);
  return params * 12 + tensors * 3 * (kHeaderBytesPerTensor + 64) + (int64_t{32} << 10);
}

std::string CheckpointWriter::save(const std::vector<Param>& params, const AdamW& opt, const TrainerState& state,
                                   const std::string& config_toml) {
  finish(true);
  Communicator& world = *mesh_.world;
  auto p = std::make_unique<Pending>();
  p->state = state;
  p->optimizer_steps = opt.num_steps();
  p->config_toml = config_toml;
  const std::string name = step_name(state.step);
  p->final_dir = (fs::path(dir_) / name).string();
  p->tmp_dir = (fs::path(dir_) / (".tmp-" + name)).string();
  // One file per stage and EP rank (ETP slices are gathered), written by its first EDP replica.
  p->n = static_cast<int>(mesh_.dims.pp * mesh_.dims.ep);
  p->k = mesh_.pp_rank * static_cast<int>(mesh_.dims.ep) + mesh_.ep_rank;
  p->writes = mesh_.edp_rank == 0 && mesh_.etp_rank == 0;
  on_every_rank(world, "creating the checkpoint directory", [&] {
    if (mesh_.world_rank != 0) return;
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec) MF_FAIL(dir_, ": cannot create checkpoint directory: ", ec.message());
    fs::remove_all(p->tmp_dir, ec);
    fs::create_directories(p->tmp_dir, ec);
    if (ec) MF_FAIL(p->tmp_dir, ": cannot create: ", ec.message());
  });
  try {
    on_every_rank(world, "copying the checkpoint's state", [&] {
      if (pool_) pool_->reset();
      p->entries = entries_of(params, opt, mesh_, pool_.get());
      (void)fault_point("checkpoint.snapshot");
    });
  } catch (const Error& e) {
    std::error_code ec;
    if (mesh_.world_rank == 0) fs::remove_all(p->tmp_dir, ec);
    throw Error(cat("checkpoint ", name, " not saved: ", e.what()));
  }
  // Nothing is written unless the directory's file system can hold the whole checkpoint (every
  // rank's files go into the one directory rank 0 renames).
  int64_t bytes = p->writes ? checkpoint_file_bytes(p->entries) : 0;
  if (world.size() > 1) world.all_reduce(Tensor(&bytes, DType::i64, {1}), ReduceOp::sum);
  try {
    on_every_rank(world, "checking the checkpoint's disk space", [&] {
      if (mesh_.world_rank == 0) check_free_space(dir_, bytes);
    });
  } catch (const Error& e) {
    std::error_code ec;
    if (mesh_.world_rank == 0) fs::remove_all(p->tmp_dir, ec);
    throw Error(cat("checkpoint ", name, " not saved: ", e.what()));
  }
  if (!p->writes) {
    p->entries = ShardedNames();
    p->done = true;
  } else if (opts_.async) {
    p->thread = std::thread([raw = p.get()] { raw->write(); });
  } else {
    p->write();
  }
  pending_ = std::move(p);
  const std::string final_dir = pending_->final_dir;
  if (!opts_.async) finish(true);
  return final_dir;
}

int64_t CheckpointWriter::finish(bool wait) {
  if (!pending_) return -1;
  Pending& p = *pending_;
  Communicator& world = *mesh_.world;
  if (wait && p.thread.joinable()) p.thread.join();
  // Every rank's state: [still writing, failed world rank + 1] (max over the world).
  int64_t flags[2] = {p.done ? 0 : 1, p.done && !p.error.empty() ? mesh_.world_rank + 1 : 0};
  if (world.size() > 1) world.all_reduce(Tensor(flags, DType::i64, {2}), ReduceOp::max);
  if (flags[0] != 0 && flags[1] == 0) return -1;  // written elsewhere still (never when waiting)
  if (p.thread.joinable()) p.thread.join();       // done: the thread has returned or is returning
  const std::unique_ptr<Pending> owned = std::move(pending_);
  const std::string what = cat("checkpoint ", step_name(p.state.step), " not saved: ");
  if (flags[1] != 0) {
    if (world.size() > 1) world.barrier();  // every rank's writer has stopped: the directory can go
    std::error_code ec;
    if (mesh_.world_rank == 0) fs::remove_all(p.tmp_dir, ec);
    if (!p.error.empty()) throw Error(what + p.error);
    MF_FAIL(what, "writing failed on rank ", flags[1] - 1, " (its message is in its output)");
  }
  // Rank 0 names each file's checksum in trainer.json: [file index or -1, model sum, optimizer sum].
  const int64_t mine[3] = {p.writes ? p.k : -1, static_cast<int64_t>(p.sums[0]), static_cast<int64_t>(p.sums[1])};
  std::vector<int64_t> sums(static_cast<size_t>(3 * world.size()));
  if (world.size() > 1)
    world.all_gather(Tensor(const_cast<int64_t*>(mine), DType::i64, {1, 3}),
                     Tensor(sums.data(), DType::i64, {world.size(), 3}));
  else
    std::copy(mine, mine + 3, sums.begin());
  on_every_rank(world, "finishing the checkpoint", [&] {
    if (mesh_.world_rank != 0) return;
    try {
      finalize(p, sums);
    } catch (const Error& e) {
      std::error_code ec;
      fs::remove_all(p.tmp_dir, ec);
      throw Error(what + e.what());
    }
  });
  last_save_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - p.started).count();
  return p.state.step;
}

void CheckpointWriter::finalize(const Pending& p, const std::vector<int64_t>& sums_by_rank) {
  std::vector<uint64_t> file_sums(static_cast<size_t>(2 * p.n), 0);
  for (size_t r = 0; r + 2 < sums_by_rank.size(); r += 3) {
    const int64_t k = sums_by_rank[r];
    if (k < 0) continue;
    file_sums[static_cast<size_t>(2 * k)] = static_cast<uint64_t>(sums_by_rank[r + 1]);
    file_sums[static_cast<size_t>(2 * k + 1)] = static_cast<uint64_t>(sums_by_rank[r + 2]);
  }
  nlohmann::json sums = nlohmann::json::object();
  for (int kind = 0; kind < 2; ++kind) {
    const std::string stem = kind == 0 ? "model" : "optimizer";
    for (int f = 0; f < p.n; ++f) sums[shard_file(stem, f, p.n)] = checksum_text(file_sums[2 * f + kind]);
    const std::string index = stem + ".safetensors.index.json";
    write_text(p.tmp_dir + "/" + index, make_index(p.tmp_dir, stem, p.n).dump(2) + "\n");
    sums[index] = file_checksum(p.tmp_dir + "/" + index);
  }
  (void)fault_point("checkpoint.index");
  write_text(p.tmp_dir + "/config.toml", p.config_toml);
  const Mesh& m = mesh_;
  const nlohmann::json meta = {{"format_version", kFormatVersion},
                               {"step", p.state.step},
                               {"data_position", p.state.data_position},
                               {"seed", p.state.seed},
                               {"optimizer_steps", p.optimizer_steps},
                               {"checksum", kChecksum},
                               {"layout",
                                {{"world", m.dims.world()},
                                 {"pp", m.dims.pp},
                                 {"tp", m.dims.tp},
                                 {"cp", m.dims.cp},
                                 {"dp", m.dims.dp},
                                 {"ep", m.dims.ep},
                                 {"etp", m.dims.etp}}},
                               {"checksums", sums}};
  write_text(p.tmp_dir + "/trainer.json", meta.dump(2) + "\n");  // last: marks the checkpoint complete
  fsync_path(p.tmp_dir);
  (void)fault_point("checkpoint.rename");
  // Replace an existing checkpoint of the same step only after the new one is complete.
  std::error_code ec;
  const fs::path final_dir = p.final_dir, old_dir = fs::path(dir_) / (".old-" + final_dir.filename().string());
  const bool had_old = fs::exists(final_dir);
  if (had_old) {
    fs::remove_all(old_dir, ec);
    fs::rename(final_dir, old_dir, ec);
    if (ec) MF_FAIL(p.final_dir, ": cannot move the previous checkpoint aside: ", ec.message());
  }
  fs::rename(p.tmp_dir, final_dir, ec);
  if (ec) MF_FAIL(p.final_dir, ": cannot rename checkpoint into place: ", ec.message());
  fsync_path(dir_);
  if (had_old) fs::remove_all(old_dir, ec);
  // Durable now: the oldest checkpoints past `keep` go.
  if (opts_.keep > 0) {
    std::vector<fs::path> all = complete_checkpoints(dir_);
    std::erase(all, final_dir);
    for (size_t i = 0; i + static_cast<size_t>(opts_.keep) - 1 < all.size(); ++i) remove_dir(all[i]);
  }
}

std::string save_checkpoint(const std::string& checkpoints_dir, const std::vector<Param>& params, const AdamW& opt,
                            const TrainerState& state, const std::string& config_toml, const Mesh& mesh) {
  CheckpointWriter writer(checkpoints_dir, mesh);
  return writer.save(params, opt, state, config_toml);
}

void tidy_checkpoints(const std::string& checkpoints_dir) {
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return;
  std::vector<fs::path> entries;
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec)) entries.push_back(e.path());
  bool changed = false;
  for (const fs::path& e : entries) {
    const std::string n = e.filename().string();
    if (n.starts_with(".tmp-") || n.starts_with(".del-")) {
      fs::remove_all(e, ec);
      changed = true;
    } else if (n.starts_with(".old-")) {
      // Moved aside for a replacement of the same step: back, unless the replacement is complete.
      const fs::path target = e.parent_path() / n.substr(5);
      if (fs::exists(target / "trainer.json", ec)) {
        fs::remove_all(e, ec);
      } else {
        fs::remove_all(target, ec);
        fs::rename(e, target, ec);
        if (ec) MF_FAIL(e.string(), ": cannot move back to ", target.string(), ": ", ec.message());
      }
      changed = true;
    }
  }
  if (changed) fsync_path(checkpoints_dir);
}

std::string latest_checkpoint(const std::string& checkpoints_dir) {
  const std::vector<fs::path> all = complete_checkpoints(checkpoints_dir);
  return all.empty() ? "" : all.back().string();
}

namespace {

// `file` of checkpoint `dir` (a plain name: nothing outside the directory is ever read) exists and
// has the checksum its trainer.json (`meta`, read_trainer_json's) gives it; `named_by` is the file
// that named it.
void check_file(const std::string& dir, const std::string& file, const nlohmann::json& meta,
                const std::string& named_by) {
  if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos)
    MF_FAIL(named_by, ": names '", file, "', which is not a file of the checkpoint directory");
  const std::string path = dir + "/" + file;
  if (!fs::exists(path)) MF_FAIL(path, ": missing (named by ", named_by, ")");
  const nlohmann::json& sums = meta["checksums"];
  const auto it = sums.find(file);
  if (it == sums.end() || !it->is_string() || file_checksum(path, meta["checksum"]) != it->get<std::string>())
    MF_FAIL(path, ": checksum mismatch (file corrupt or modified after saving)");
}

// trainer.json of checkpoint `dir`, with its fields checked.
nlohmann::json read_trainer_json(const std::string& dir) {
  const std::string meta_path = dir + "/trainer.json";
  nlohmann::json j = read_json(meta_path);
  try {
    if (json_int64(j.at("format_version"), meta_path, "format_version") != kFormatVersion)
      MF_FAIL(meta_path, ": format_version ", j.at("format_version").dump(), " is not ", kFormatVersion);
    for (const char* key : {"step", "data_position", "optimizer_steps"})
      if (json_int64(j.at(key), meta_path, key) < 0) MF_FAIL(meta_path, ": '", key, "' must be >= 0");
    if (!j.at("seed").is_number_unsigned()) MF_FAIL(meta_path, ": 'seed' must be an unsigned integer");
    j.at("checksums").get<nlohmann::json::object_t>();
    if (!j.contains("checksum")) j["checksum"] = kOldChecksum;  // saved before the field existed
    const nlohmann::json& algorithm = j["checksum"];
    if (algorithm != kChecksum && algorithm != kOldChecksum)
      MF_FAIL(meta_path, ": checksum ", algorithm.dump(), " is not ", kChecksum, " or ", kOldChecksum);
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(meta_path, ": missing or malformed field (", e.what(), ")");
  }
  return j;
}

// The tensors of one kind ("model" or "optimizer") of a checkpoint, found through its index.
class ShardSet {
 public:
  ShardSet(const std::string& dir, const std::string& stem, const nlohmann::json& meta) : dir_(dir), meta_(meta) {
    const std::string index = dir + "/" + stem + ".safetensors.index.json";
    nlohmann::json j = read_json(index);
    try {
      for (const auto& [tensor, file] : j.at("weight_map").items()) map_[tensor] = file.get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      MF_FAIL(index, ": malformed Hugging Face index (", e.what(), ")");
    }
    index_ = index;
  }
  size_t size() const { return map_.size(); }
  // Into a host or GPU tensor, contiguous or row-strided (through host memory when needed).
  void load_into(const std::string& tensor, const Tensor& dst) {
    auto it = map_.find(tensor);
    if (it == map_.end()) MF_FAIL(index_, ": no tensor '", tensor, "'");
    write_through_host(dst, [&](const Tensor& host) { reader(it->second).load_into(tensor, host); });
  }
  // View v's part of its tensor (the whole tensor, or an ETP slice of it).
  void load_view(const NamedView& v, const std::string& suffix) {
    if (v.dim < 0) return load_into(v.name + suffix, v.value);
    const int64_t rows = v.value.size(0), cols = v.value.size(1);
    const int64_t whole_rows = v.dim == 0 ? v.global_size : rows, whole_cols = v.dim == 1 ? v.global_size : cols;
    std::vector<float> whole(static_cast<size_t>(whole_rows * whole_cols));
    load_into(v.name + suffix, Tensor(whole.data(), DType::f32, {whole_rows, whole_cols}));
    write_through_host(v.value, [&](const Tensor& host) {
      float* dst = host.ptr<float>();
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) {
          const int64_t wi = v.dim == 0 ? v.offset + i : i, wj = v.dim == 1 ? v.offset + j : j;
          dst[i * cols + j] = whole[static_cast<size_t>(wi * whole_cols + wj)];
        }
    });
  }

 private:
  SafetensorsReader& reader(const std::string& file) {
    auto it = readers_.find(file);
    if (it != readers_.end()) return *it->second;
    check_file(dir_, file, meta_, index_);
    const std::string path = dir_ + "/" + file;
    return *readers_.emplace(file, std::make_unique<SafetensorsReader>(path)).first->second;
  }

  std::string dir_, index_;
  const nlohmann::json& meta_;  // trainer.json
  std::map<std::string, std::string> map_;
  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;
};

// Tensors the whole (unsharded) model has on disk: `params`' (copies of other stages' left out),
// summed over the pipeline stages.
size_t global_tensor_count(const std::vector<Param>& params, Communicator* stages) {
  size_t n = 0;
  for (const Param& p : params) {
    if (p.pipeline_copy) continue;
    const size_t views = hf_views(p).size();
    const int64_t rows = p.value.size(0);
    n += p.group == ParamGroup::expert ? views / static_cast<size_t>(rows) * static_cast<size_t>(p.global_rows) : views;
  }
  if (stages != nullptr && stages->size() > 1) {
    int64_t all = static_cast<int64_t>(n);
    stages->all_reduce(Tensor(&all, DType::i64, {1}), ReduceOp::sum);
    n = static_cast<size_t>(all);
  }
  return n;
}

}  // namespace

TrainerState load_checkpoint(const std::string& dir, std::vector<Param>& params, AdamW* opt, Communicator* stages) {
  const std::string meta_path = dir + "/trainer.json";
  const nlohmann::json j = read_trainer_json(dir);
  TrainerState s;
  s.step = j["step"].get<int64_t>();
  s.data_position = j["data_position"].get<int64_t>();
  s.seed = j["seed"].get<uint64_t>();
  const int64_t opt_steps = j["optimizer_steps"].get<int64_t>();
  for (const char* index : {"model.safetensors.index.json", "optimizer.safetensors.index.json"})
    check_file(dir, index, j, meta_path);
  ShardSet weights(dir, "model", j);
  const size_t expected = global_tensor_count(params, stages);
  if (weights.size() != expected)
    MF_FAIL(dir, "/model.safetensors.index.json: holds ", weights.size(), " tensors, the model has ", expected,
            " (different architecture or layer count?)");
  for (Param& p : params)
    for (const NamedView& v : hf_views(p)) weights.load_view(v, "");
  if (opt) {
    ShardSet moments(dir, "optimizer", j);
    for (size_t i = 0; i < params.size(); ++i) {
      for (const NamedView& v : hf_views(params[i], opt->exp_avg(i))) moments.load_view(v, ".exp_avg");
      for (const NamedView& v : hf_views(params[i], opt->exp_avg_sq(i))) moments.load_view(v, ".exp_avg_sq");
    }
    opt->set_num_steps(opt_steps);
  }
  return s;
}

void verify_checkpoint(const std::string& dir) {
  const nlohmann::json j = read_trainer_json(dir);
  const nlohmann::json& sums = j["checksums"];
  for (const auto& [file, sum] : sums.items()) check_file(dir, file, j, dir + "/trainer.json");
  for (const char* index : {"model.safetensors.index.json", "optimizer.safetensors.index.json"})
    if (!sums.contains(index)) MF_FAIL(dir, "/trainer.json: no checksum for ", index);
}

}  // namespace moefold
