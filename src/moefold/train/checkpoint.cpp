#include "moefold/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

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
}

}  // namespace

std::string save_checkpoint(const std::string& checkpoints_dir, const std::vector<Param>& params, const AdamW& opt,
                            const TrainerState& state, const std::string& config_toml) {
  std::error_code ec;
  fs::create_directories(checkpoints_dir, ec);
  if (ec) MF_FAIL(checkpoints_dir, ": cannot create checkpoint directory: ", ec.message());
  const std::string name = step_name(state.step);
  const std::string final_dir = (fs::path(checkpoints_dir) / name).string();
  const std::string tmp_dir = (fs::path(checkpoints_dir) / cat(".tmp-", name, "-", ::getpid())).string();
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) MF_FAIL(tmp_dir, ": cannot create: ", ec.message());

  std::vector<SafetensorsEntry> weights, moments;
  for (size_t i = 0; i < params.size(); ++i) {
    for (const NamedView& v : hf_views(params[i])) weights.push_back({v.name, v.value, DType::f32});
    moments.push_back({params[i].name + ".exp_avg", opt.exp_avg(i), DType::f32});
    moments.push_back({params[i].name + ".exp_avg_sq", opt.exp_avg_sq(i), DType::f32});
  }
  const std::string model_path = tmp_dir + "/model.safetensors", opt_path = tmp_dir + "/optimizer.safetensors";
  write_safetensors(model_path, weights, {{"format", "pt"}});
  write_safetensors(opt_path, moments, {{"optimizer", "adamw"}});
  write_text(tmp_dir + "/config.toml", config_toml);
  nlohmann::json j = {
      {"format_version", kFormatVersion},
      {"step", state.step},
      {"data_position", state.data_position},
      {"seed", state.seed},
      {"optimizer_steps", opt.num_steps()},
      {"checksums",
       {{"model.safetensors", file_checksum(model_path)}, {"optimizer.safetensors", file_checksum(opt_path)}}}};
  write_text(tmp_dir + "/trainer.json", j.dump(2) + "\n");
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "config.toml", "trainer.json"})
    fsync_path(tmp_dir + "/" + f);

  // Replace an existing checkpoint of the same step only after the new one is complete.
  const std::string old_dir = (fs::path(checkpoints_dir) / cat(".old-", name, "-", ::getpid())).string();
  bool had_old = fs::exists(final_dir);
  if (had_old) fs::rename(final_dir, old_dir, ec);
  if (ec) MF_FAIL(final_dir, ": cannot move the previous checkpoint aside: ", ec.message());
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) MF_FAIL(final_dir, ": cannot rename checkpoint into place: ", ec.message());
  fsync_path(checkpoints_dir);
  if (had_old) fs::remove_all(old_dir, ec);
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

TrainerState load_checkpoint(const std::string& dir, std::vector<Param>& params, AdamW* opt) {
  const std::string meta_path = dir + "/trainer.json";
  std::ifstream f(meta_path);
  if (!f) MF_FAIL(meta_path, ": cannot open (not a moefold checkpoint?)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(meta_path, ": not valid JSON (", e.what(), ")");
  }
  TrainerState s;
  int64_t opt_steps = 0;
  std::string sum_model, sum_opt;
  try {
    if (j.at("format_version").get<int>() != kFormatVersion)
      MF_FAIL(meta_path, ": format_version ", j.at("format_version").dump(), " is not ", kFormatVersion);
    s.step = j.at("step").get<int64_t>();
    s.data_position = j.at("data_position").get<int64_t>();
    s.seed = j.at("seed").get<uint64_t>();
    opt_steps = j.at("optimizer_steps").get<int64_t>();
    sum_model = j.at("checksums").at("model.safetensors").get<std::string>();
    sum_opt = j.at("checksums").at("optimizer.safetensors").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    MF_FAIL(meta_path, ": missing or malformed field (", e.what(), ")");
  }
  const std::string model_path = dir + "/model.safetensors", opt_path = dir + "/optimizer.safetensors";
  if (!fs::exists(model_path)) MF_FAIL(model_path, ": missing");
  if (file_checksum(model_path) != sum_model)
    MF_FAIL(model_path, ": checksum mismatch (file corrupt or modified after saving)");
  SafetensorsReader weights(model_path);
  size_t expected = 0;
  for (Param& p : params)
    for (const NamedView& v : hf_views(p)) {
      weights.load_into(v.name, v.value);
      ++expected;
    }
  if (weights.tensors().size() != expected)
    MF_FAIL(model_path, ": holds ", weights.tensors().size(), " tensors, the model has ", expected,
            " (different architecture or layer count?)");
  if (opt) {
    if (!fs::exists(opt_path)) MF_FAIL(opt_path, ": missing");
    if (file_checksum(opt_path) != sum_opt)
      MF_FAIL(opt_path, ": checksum mismatch (file corrupt or modified after saving)");
    SafetensorsReader moments(opt_path);
    for (size_t i = 0; i < params.size(); ++i) {
      moments.load_into(params[i].name + ".exp_avg", opt->exp_avg(i));
      moments.load_into(params[i].name + ".exp_avg_sq", opt->exp_avg_sq(i));
    }
    opt->set_num_steps(opt_steps);
  }
  return s;
}

}  // namespace moefold
