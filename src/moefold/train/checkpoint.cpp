#include "moefold/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "moefold/comm/agree.h"
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

// FNV-1a over the whole file: detects any corruption of a checkpoint file.
std::string file_checksum(const std::string& path) {
  MappedFile f(path);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < f.size(); ++i) h = (h ^ f.data()[i]) * 1099511628211ull;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
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
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(path, ": not valid JSON (", e.what(), ")");
  }
}

struct ShardedNames {
  std::vector<SafetensorsEntry> weights, moments;
  std::vector<std::vector<float>> storage;  // whole tensors assembled from ETP slices
};

// The whole Hugging Face tensor of view `v` as a contiguous host tensor (kept in `storage` when
// copied: GPU weights and moments and row-strided views are written through host memory): the
// view itself, or (tensor or expert tensor parallelism) its slices gathered over `group`, in
// offset order (rank r holds offset r * size). Collective over `group` when v.dim >= 0.
Tensor whole_tensor(const NamedView& v, Communicator& group, std::vector<std::vector<float>>& storage) {
  if (v.dim < 0) return contiguous_host(v.value, storage);
  const int64_t g = group.size(), rows = v.value.size(0), cols = v.value.size(1);
  MF_CHECK(v.value.dtype() == DType::f32 && v.value.ndim() == 2 && v.global_size == g * v.value.size(v.dim), v.name);
  std::vector<float> gathered(static_cast<size_t>(g * rows * cols));
  group.all_gather(contiguous_host(v.value, storage).view({1, rows * cols}),
                   Tensor(gathered.data(), DType::f32, {g, rows * cols}));
  if (v.dim == 0) {
    storage.push_back(std::move(gathered));
    return Tensor(storage.back().data(), DType::f32, {g * rows, cols});
  }
  std::vector<float> whole(gathered.size());  // [rows, g * cols] from g blocks of [rows, cols]
  for (int64_t r = 0; r < g; ++r)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        whole[static_cast<size_t>(i * g * cols + r * cols + j)] =
            gathered[static_cast<size_t>((r * rows + i) * cols + j)];
  storage.push_back(std::move(whole));
  return Tensor(storage.back().data(), DType::f32, {rows, g * cols});
}

// What this rank writes: dense parameters on rank 0 (TP shards gathered first), expert shards on
// the first EDP replica (ETP rank 0, after gathering the FFN slices). Every rank calls it (the
// gathers are collective).
ShardedNames entries_of(const std::vector<Param>& params, const AdamW& opt, const Mesh& mesh) {
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
        Tensor whole = whole_tensor(v, group, out.storage);
        if (mine) to.push_back({v.name + suffix, whole, DType::f32});
      }
    };
    add(p.value, "", out.weights);
    add(opt.exp_avg(i), ".exp_avg", out.moments);
    add(opt.exp_avg_sq(i), ".exp_avg_sq", out.moments);
  }
  return out;
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

}  // namespace

std::string save_checkpoint(const std::string& checkpoints_dir, const std::vector<Param>& params, const AdamW& opt,
                            const TrainerState& state, const std::string& config_toml, const Mesh& mesh) {
  Communicator& world = *mesh.world;
  const std::string name = step_name(state.step);
  const std::string final_dir = (fs::path(checkpoints_dir) / name).string();
  const std::string tmp_dir = (fs::path(checkpoints_dir) / (".tmp-" + name)).string();
  // One file per stage and EP rank (ETP slices are gathered).
  const int n = static_cast<int>(mesh.dims.pp * mesh.dims.ep),
            k = mesh.pp_rank * static_cast<int>(mesh.dims.ep) + mesh.ep_rank;
  on_every_rank(world, "creating the checkpoint directory", [&] {
    if (mesh.world_rank != 0) return;
    std::error_code ec;
    fs::create_directories(checkpoints_dir, ec);
    if (ec) MF_FAIL(checkpoints_dir, ": cannot create checkpoint directory: ", ec.message());
    fs::remove_all(tmp_dir, ec);
    fs::create_directories(tmp_dir, ec);
    if (ec) MF_FAIL(tmp_dir, ": cannot create: ", ec.message());
  });
  ShardedNames mine = entries_of(params, opt, mesh);
  on_every_rank(world, "writing the checkpoint", [&] {
    if (mesh.edp_rank != 0 || mesh.etp_rank != 0) return;
    const std::string model = tmp_dir + "/" + shard_file("model", k, n);
    const std::string moments = tmp_dir + "/" + shard_file("optimizer", k, n);
    write_safetensors(model, mine.weights, {{"format", "pt"}});
    write_safetensors(moments, mine.moments, {{"optimizer", "adamw"}});
    fsync_path(model);
    fsync_path(moments);
  });
  on_every_rank(world, "finishing the checkpoint", [&] {
    if (mesh.world_rank != 0) return;
    nlohmann::json sums = nlohmann::json::object();
    for (const char* stem : {"model", "optimizer"}) {
      for (int f = 0; f < n; ++f) {
        const std::string file = shard_file(stem, f, n);
        sums[file] = file_checksum(tmp_dir + "/" + file);
      }
      const std::string index = std::string(stem) + ".safetensors.index.json";
      write_text(tmp_dir + "/" + index, make_index(tmp_dir, stem, n).dump(2) + "\n");
      sums[index] = file_checksum(tmp_dir + "/" + index);
    }
    write_text(tmp_dir + "/config.toml", config_toml);
    const nlohmann::json meta = {{"format_version", kFormatVersion},
                                 {"step", state.step},
                                 {"data_position", state.data_position},
                                 {"seed", state.seed},
                                 {"optimizer_steps", opt.num_steps()},
                                 {"layout",
                                  {{"world", mesh.dims.world()},
                                   {"pp", mesh.dims.pp},
                                   {"tp", mesh.dims.tp},
                                   {"cp", mesh.dims.cp},
                                   {"dp", mesh.dims.dp},
                                   {"ep", mesh.dims.ep},
                                   {"etp", mesh.dims.etp}}},
                                 {"checksums", sums}};
    write_text(tmp_dir + "/trainer.json", meta.dump(2) + "\n");  // last: marks the checkpoint complete
    // Replace an existing checkpoint of the same step only after the new one is complete.
    std::error_code ec;
    const std::string old_dir = (fs::path(checkpoints_dir) / (".old-" + name)).string();
    const bool had_old = fs::exists(final_dir);
    if (had_old) {
      fs::remove_all(old_dir, ec);
      fs::rename(final_dir, old_dir, ec);
      if (ec) MF_FAIL(final_dir, ": cannot move the previous checkpoint aside: ", ec.message());
    }
    fs::rename(tmp_dir, final_dir, ec);
    if (ec) MF_FAIL(final_dir, ": cannot rename checkpoint into place: ", ec.message());
    fsync_path(checkpoints_dir);
    if (had_old) fs::remove_all(old_dir, ec);
  });
  return final_dir;
}

std::string latest_checkpoint(const std::string& checkpoints_dir) {
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return "";
  std::string best;
  for (const auto& e : fs::directory_iterator(checkpoints_dir, ec)) {
    std::string n = e.path().filename().string();
    if (!n.starts_with(kStepPrefix) || !fs::exists(e.path() / "trainer.json")) continue;
    if (best.empty() || n > fs::path(best).filename().string()) best = e.path().string();
  }
  return best;
}

namespace {

// The tensors of one kind ("model" or "optimizer") of a checkpoint, found through its index.
class ShardSet {
 public:
  ShardSet(const std::string& dir, const std::string& stem, const nlohmann::json& checksums)
      : dir_(dir), checksums_(checksums) {
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
    const std::string path = dir_ + "/" + file;
    if (!fs::exists(path)) MF_FAIL(path, ": missing (named by ", index_, ")");
    if (!checksums_.contains(file) || file_checksum(path) != checksums_[file].get<std::string>())
      MF_FAIL(path, ": checksum mismatch (file corrupt or modified after saving)");
    return *readers_.emplace(file, std::make_unique<SafetensorsReader>(path)).first->second;
  }

  std::string dir_, index_;
  const nlohmann::json& checksums_;
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
  nlohmann::json j = read_json(meta_path);
  TrainerState s;
  int64_t opt_steps = 0;
  try {
    if (j.at("format_version").get<int>() != kFormatVersion)
      MF_FAIL(meta_path, ": format_version ", j.at("format_version").dump(), " is not ", kFormatVersion);
    s.step = j.at("step").get<int64_t>();
    s.data_position = j.at("data_position").get<int64_t>();
    s.seed = j.at("seed").get<uint64_t>();
    opt_steps = j.at("optimizer_steps").get<int64_t>();
    j.at("checksums").get<nlohmann::json::object_t>();
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(meta_path, ": missing or malformed field (", e.what(), ")");
  }
  const nlohmann::json& sums = j["checksums"];
  for (const char* index : {"model.safetensors.index.json", "optimizer.safetensors.index.json"}) {
    const std::string path = dir + "/" + index;
    if (!fs::exists(path)) MF_FAIL(path, ": missing");
    if (!sums.contains(index) || file_checksum(path) != sums[index].get<std::string>())
      MF_FAIL(path, ": checksum mismatch (file corrupt or modified after saving)");
  }
  ShardSet weights(dir, "model", sums);
  const size_t expected = global_tensor_count(params, stages);
  if (weights.size() != expected)
    MF_FAIL(dir, "/model.safetensors.index.json: holds ", weights.size(), " tensors, the model has ", expected,
            " (different architecture or layer count?)");
  for (Param& p : params)
    for (const NamedView& v : hf_views(p)) weights.load_view(v, "");
  if (opt) {
    ShardSet moments(dir, "optimizer", sums);
    for (size_t i = 0; i < params.size(); ++i) {
      for (const NamedView& v : hf_views(params[i], opt->exp_avg(i))) moments.load_view(v, ".exp_avg");
      for (const NamedView& v : hf_views(params[i], opt->exp_avg_sq(i))) moments.load_view(v, ".exp_avg_sq");
    }
    opt->set_num_steps(opt_steps);
  }
  return s;
}

}  // namespace moefold
