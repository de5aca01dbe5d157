#include "moefold/train/run.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "moefold/comm/agree.h"
#include "moefold/core/device.h"
#include "moefold/core/fault_points.h"
#include "moefold/data/npy.h"
#include "moefold/data/prepare.h"
#include "moefold/data/token_dataset.h"
#include "moefold/io/tensorboard.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/trainer.h"

namespace moefold {

namespace fs = std::filesystem;

namespace {

std::string human_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  char buf[32];
  long long t = std::llround(s);
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, t / 60 % 60);
  else
    std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
  return buf;
}

// The progress bar, redrawn in place on an interactive terminal.
void progress(const StepMetrics& m, int64_t stop, double tok_s, double eta) {
  const int width = 24;
  int filled = stop > 0 ? static_cast<int>(width * m.step / stop) : width;
  std::string bar(static_cast<size_t>(filled), '=');
  bar.resize(width, ' ');
  std::fprintf(stderr, "\rstep %lld/%lld [%s] loss %.4f | %.0f tok/s | ETA %s   ", static_cast<long long>(m.step),
               static_cast<long long>(stop), bar.c_str(), m.loss, tok_s, human_duration(eta).c_str());
  std::fflush(stderr);
}

// The process's peak resident memory (Linux: getrusage's KiB).
int64_t peak_rss_bytes() {
  rusage u{};
  return ::getrusage(RUSAGE_SELF, &u) == 0 ? static_cast<int64_t>(u.ru_maxrss) * 1024 : 0;
}

// Keeps the metrics lines up to `step` (a resumed run rewrites what follows).
void truncate_metrics(const std::string& path, int64_t step) {
  std::ifstream in(path);
  if (!in) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    try {
      if (nlohmann::json::parse(line).at("step").get<int64_t>() <= step) kept += line + "\n";
    } catch (const nlohmann::json::exception&) {
      // a torn last line from a crash: dropped
    }
  }
  in.close();
  std::ofstream(path, std::ios::trunc) << kept;
}

// Writes to `sink` unless it is gone; a failure (a full disk) is one warning and the sink stops:
// the statistics files are not worth stopping the run for (rank 0 alone writes them).
template <class T, class F>
void best_effort(std::unique_ptr<T>& sink, const char* what, bool tty, F&& write) {
  if (!sink) return;
  try {
    write(*sink);
  } catch (const Error& e) {
    std::fprintf(stderr, "%smoefold: warning: %s; %s stops here\n", tty ? "\n" : "", e.what(), what);
    sink.reset();
  }
}

// A step's TensorBoard values: every metrics.jsonl scalar; with `layers`, per MoE layer the
// expert-load statistics and a histogram of its tokens per expert (`loads`: [layers, experts]).
void write_tensorboard(TensorBoardWriter& tb, const StepMetrics& m, const nlohmann::json& j, const double* loads,
                       int64_t experts, bool layers) {
  for (const auto& [tag, key] :
       std::initializer_list<std::pair<const char*, const char*>>{{"loss/total", "loss"},
                                                                  {"loss/lm", "lm_loss"},
                                                                  {"loss/aux", "aux_loss"},
                                                                  {"loss/z", "z_loss"},
                                                                  {"loss/mtp", "mtp_loss"},
                                                                  {"loss/eval", "eval_loss"},
                                                                  {"optimizer/lr", "lr"},
                                                                  {"optimizer/grad_norm", "grad_norm"},
                                                                  {"throughput/tokens_per_s", "tokens_per_s"},
                                                                  {"throughput/tflops", "tflops"},
                                                                  {"throughput/step_time_s", "step_time_s"},
                                                                  {"memory/gpu_peak_mib", "gpu_memory_peak_mib"},
                                                                  {"memory/host_peak_mib", "host_memory_peak_mib"},
                                                                  {"comm/inter_node_bytes", "inter_node_bytes"},
                                                                  {"comm/ep_slot_fill", "ep_slot_fill"}})
    if (j.contains(key)) tb.scalar(tag, j[key].get<double>());
  tb.scalar("optimizer/skipped", m.skipped ? 1 : 0);
  const size_t n = m.expert_load_max_over_mean.size();
  if (n > 0)  // every step: the worst layer
    tb.scalar("expert_load/max_over_mean_worst_layer",
              *std::max_element(m.expert_load_max_over_mean.begin(), m.expert_load_max_over_mean.end()));
  if (!layers) return;
  for (size_t l = 0; l < n; ++l) {
    char layer[32];
    std::snprintf(layer, sizeof layer, "layer_%02zu", l);
    const double mean = m.expert_load_mean[l] > 0 ? m.expert_load_mean[l] : 1;
    const std::string p = std::string("expert_load_") + layer + "/";
    tb.scalar(p + "max_over_mean", m.expert_load_max_over_mean[l]);
    tb.scalar(p + "min_over_mean", m.expert_load_min[l] / mean);
    tb.scalar(p + "p50_over_mean", m.expert_load_p50[l]);
    tb.scalar(p + "p90_over_mean", m.expert_load_p90[l]);
    tb.scalar(p + "p99_over_mean", m.expert_load_p99[l]);
    tb.scalar(p + "max_tokens", m.expert_load_max[l]);
    tb.scalar(p + "mean_tokens", m.expert_load_mean[l]);
    tb.scalar(p + "min_tokens", m.expert_load_min[l]);
    tb.scalar(p + "dropped_fraction", m.expert_load_dropped_fraction[l]);
    tb.histogram(std::string("tokens_per_expert/") + layer,
                 make_histogram(loads + l * experts, static_cast<size_t>(experts), std::min<int>(30, experts)));
  }
}

}  // namespace

TokenDataset open_run_data(const Config& cfg, const std::string& run_dir, bool quiet, Communicator& world) {
  if (!cfg.data.path.empty()) return open_token_dataset(cfg.data.path);
  const std::string path = (fs::path(run_dir) / "default_corpus.tokens").string();
  on_every_rank(world, "preparing the default corpus", [&] {
    if (world.rank() != 0 || fs::exists(path)) return;
    std::vector<std::string> inputs;
    if (!cfg.data.default_corpus_dir.empty())
      inputs.push_back(cfg.data.default_corpus_dir);
    else
      inputs = default_corpus_dirs();
    PrepareStats s = prepare(inputs, path, TokenFormat::plain);
    if (!quiet)
      std::fprintf(stderr, "moefold: prepared the default corpus: %lld files, %lld tokens from %s -> %s\n",
                   static_cast<long long>(s.files), static_cast<long long>(s.tokens), inputs.front().c_str(),
                   path.c_str());
  });
  return open_token_dataset(path);
}

int64_t run_training(const Config& cfg, const RunOptions& opts_in, Communicator& world) {
  RunOptions opts = opts_in;
  const bool lead = world.rank() == 0;
  set_fault_rank(world.rank());
  if (!lead) opts.quiet = true;
  // Every setup step runs under on_every_rank: a user error on any rank fails every rank with a
  // message instead of leaving the others waiting in their next collective.
  ParallelConfig layout;
  on_every_rank(world, "checking the layout", [&] { layout = cfg.resolve_layout(world.size()); });
  Mesh mesh;
  on_every_rank(world, "building the mesh",
                [&] { mesh = Mesh::build(world, layout, cfg.moe.dispatcher == "hierarchical"); });
  const std::string ckpt_dir = (fs::path(opts.run_dir) / "checkpoints").string();
  const std::string metrics_path = (fs::path(opts.run_dir) / "metrics.jsonl").string();
  std::string resume_from;
  on_every_rank(world, "tidying the checkpoints", [&] {
    if (lead) tidy_checkpoints(ckpt_dir);  // what interrupted saves left
  });
  on_every_rank(world, "opening the run directory", [&] {
    std::error_code ec;
    if (lead) fs::create_directories(opts.run_dir, ec);
    if (ec) MF_FAIL(opts.run_dir, ": cannot create run directory: ", ec.message());
    if (opts.resume) {
      resume_from = latest_checkpoint(ckpt_dir);
      if (resume_from.empty()) MF_FAIL(opts.run_dir, ": --resume given but there is no checkpoint in ", ckpt_dir);
    } else if (!latest_checkpoint(ckpt_dir).empty()) {
      MF_FAIL(opts.run_dir, ": already holds checkpoints; pass --resume to continue it or choose another --run-dir");
    }
  });
  std::optional<TokenDataset> data;
  std::unique_ptr<Trainer> trainer_ptr;
  on_every_rank(world, "opening the data", [&] {
    data.emplace(open_run_data(cfg, opts.run_dir, opts.quiet, world));
    data->check_vocab(cfg.model.vocab_size);
    trainer_ptr = std::make_unique<Trainer>(cfg, *data, mesh, opts.device);
  });
  Trainer& trainer = *trainer_ptr;
  if (resume_from.empty()) {
    trainer.init_fresh();
    if (lead) std::ofstream(metrics_path, std::ios::trunc);
  } else {
    on_every_rank(world, "loading the checkpoint", [&] { trainer.load(resume_from); });
    if (lead) truncate_metrics(metrics_path, trainer.step());
    if (!opts.quiet)
      std::fprintf(stderr, "moefold: resumed from %s (step %lld)\n", resume_from.c_str(),
                   static_cast<long long>(trainer.step()));
  }
  if (lead) {
    std::ofstream f(fs::path(opts.run_dir) / "config.toml", std::ios::trunc);
    f << config_to_toml(cfg);
  }
  if (!opts.quiet && world.size() > 1)
    std::fprintf(stderr, "moefold: %d ranks; dense tp=%lld cp=%lld dp=%lld, MoE ep=%lld etp=%lld edp=%lld\n",
                 world.size(), static_cast<long long>(layout.tp), static_cast<long long>(layout.cp),
                 static_cast<long long>(layout.dp), static_cast<long long>(layout.ep),
                 static_cast<long long>(layout.etp), static_cast<long long>(layout.edp()));

  if (lead && cfg.train.save_checkpoints) {  // a save refuses to start without the space
    std::error_code ec;
    const fs::space_info space = fs::space(opts.run_dir, ec);
    const int64_t need = checkpoint_bytes(cfg);
    if (!ec && static_cast<double>(space.available) < static_cast<double>(need))
      std::fprintf(
          stderr,
          "moefold: warning: a checkpoint takes %s and %s has %s free: saves will fail (train.on_save_error = %s)\n",
          format_bytes(static_cast<double>(need)).c_str(), opts.run_dir.c_str(),
          format_bytes(static_cast<double>(space.available)).c_str(), cfg.train.on_save_error.c_str());
  }
  const int64_t stop = opts.stop_step >= 0 ? opts.stop_step : cfg.train.steps;
  const ModelSize size = model_size(cfg.model, cfg.moe, cfg.train.seq_len);
  if (!opts.quiet)
    std::fprintf(stderr,
                 "moefold: training %s (%.2fM params, %.2fM active; %.1f MiB planned) on %lld tokens, %lld "
                 "tokens/step, until step %lld; run dir %s\n",
                 cfg.preset.c_str(), size.total_params / 1e6, size.active_params / 1e6,
                 static_cast<double>(trainer.planned_bytes()) / (1 << 20), static_cast<long long>(data->num_tokens()),
                 static_cast<long long>(cfg.train.global_batch_size * cfg.train.seq_len), static_cast<long long>(stop),
                 opts.run_dir.c_str());
  std::string graphs_note = trainer.cuda_graphs_note();  // said once, and again if it changes
  if (lead && !graphs_note.empty()) std::fprintf(stderr, "moefold: %s\n", graphs_note.c_str());
  std::ofstream metrics;
  if (lead) metrics.open(metrics_path, std::ios::app);
  // expert_load.npy: a slice every expert_load_interval steps, those past the resumed step cut off.
  std::unique_ptr<NpyAppender> loads_file;
  const int64_t moe_layers = trainer.expert_loads().size(0), interval = cfg.train.expert_load_interval;
  on_every_rank(world, "opening expert_load.npy", [&] {
    if (lead && interval > 0 && moe_layers > 0)
      loads_file = std::make_unique<NpyAppender>((fs::path(opts.run_dir) / "expert_load.npy").string(),
                                                 std::vector<int64_t>{moe_layers, cfg.moe.num_experts},
                                                 trainer.step() / interval);
  });
  std::vector<float> load_slice(static_cast<size_t>(moe_layers * cfg.moe.num_experts));
  // TensorBoard (rank 0): events past the resumed step cut off (all of them on a fresh start), then
  // a new event file from here.
  std::unique_ptr<TensorBoardWriter> tb;
  on_every_rank(world, "opening the TensorBoard files", [&] {
    if (!lead) return;
    const std::string dir = (fs::path(opts.run_dir) / "tensorboard").string();
    for (const std::string& problem : truncate_tb_events(dir, trainer.step()))
      std::fprintf(stderr, "moefold: warning: %s\n", problem.c_str());
    if (!cfg.train.tensorboard) return;
    tb = std::make_unique<TensorBoardWriter>(dir);
    std::string config_md;  // TensorBoard's Text tab renders Markdown: a code block
    std::istringstream toml(config_to_toml(cfg));
    for (std::string line; std::getline(toml, line);) config_md += "    " + line + "\n";
    tb->text("config", config_md);
    tb->write_step(trainer.step());
  });
  const bool tty = ::isatty(STDERR_FILENO);
  // The progress bar on a terminal (every step); log lines every train.log_interval steps, to
  // train.log (rank 0) and standard error.
  std::ofstream train_log;
  if (lead) {
    train_log.open(fs::path(opts.run_dir) / "train.log", std::ios::app);
    train_log << "moefold: " << (trainer.step() > 0 ? "resumed at step " : "started at step ") << trainer.step()
              << ", until step " << stop << "; " << cfg.preset << ", "
              << cfg.train.global_batch_size * cfg.train.seq_len << " tokens per step, " << world.size()
              << " rank(s)\n";
    train_log.flush();
  }
  const int64_t log_every = cfg.train.log_interval;
  double since_log_s = 0;
  int64_t since_log_tokens = 0;
  auto log_line = [&](const StepMetrics& m, double eta_s) {
    const double tok_s = static_cast<double>(since_log_tokens) / since_log_s;
    const double mib = opts.device == Device::cuda ? static_cast<double>(device_bytes_peak()) / (1 << 20)
                                                   : static_cast<double>(peak_rss_bytes()) / (1 << 20);
    char fill[32] = "";  // the slot dispatcher's fullest slot (metrics.jsonl's ep_slot_fill)
    if (trainer.slot_exchange()) std::snprintf(fill, sizeof fill, " | slot fill %.2f", m.ep_slot_fill);
    char buf[288];
    std::snprintf(buf, sizeof buf,
                  "step %lld/%lld | loss %.4f | lr %.3e | %.0f tokens/s | %.2f TFLOP/s | %s %.0f MiB%s | ETA %s",
                  static_cast<long long>(m.step), static_cast<long long>(stop), m.loss, m.lr, tok_s,
                  tok_s * size.train_flops_per_token / 1e12, opts.device == Device::cuda ? "GPU peak" : "peak RSS", mib,
                  fill, human_duration(eta_s).c_str());
    since_log_s = 0;
    since_log_tokens = 0;
    return std::string(buf);
  };
  double elapsed = 0;
  int64_t steps_done = 0;
  int64_t last_saved = -1;
  CheckpointWriter writer(ckpt_dir, mesh, {cfg.train.async_checkpoint, cfg.train.keep_checkpoints, opts.device});
  // A save that fails (a full disk) stops the run, or with on_save_error = continue is reported
  // in one line and training goes on (the earlier checkpoints are intact either way).
  auto saving = [&](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      if (cfg.train.on_save_error != "continue") throw;
      std::fprintf(stderr, "%smoefold: warning: %s; training goes on (train.on_save_error = continue)\n",
                   tty && !opts.quiet ? "\n" : "", e.what());
    }
  };
  auto report_saved = [&](int64_t step, double blocking_s) {
    if (step < 0 || opts.quiet) return;
    std::fprintf(stderr, "%smoefold: checkpoint step %lld saved in %.2f s (training waited %.2f s)\n", tty ? "\n" : "",
                 static_cast<long long>(step), writer.last_save_s(), blocking_s);
  };
  double save_blocking_s = 0;  // of the save in flight
  while (trainer.step() < stop) {
    const StepMetrics& m = trainer.train_step();
    if (writer.in_flight())  // an asynchronous save completes once every rank has written its files
      saving([&] { report_saved(writer.finish(false), save_blocking_s); });
    elapsed += m.seconds;
    ++steps_done;
    since_log_s += m.seconds;
    since_log_tokens += m.tokens;
    nlohmann::json j = {{"step", m.step},
                        {"loss", m.loss},
                        {"lm_loss", m.lm_loss},
                        {"aux_loss", m.aux_loss},
                        {"z_loss", m.z_loss},
                        {"mtp_loss", m.mtp_loss},
                        {"grad_norm", m.grad_norm},
                        {"skipped", m.skipped},
                        {"lr", m.lr},
                        {"tokens", m.tokens},
                        {"tokens_per_s", m.tokens / m.seconds},
                        {"step_time_s", m.seconds},
                        {"expert_load_max", m.expert_load_max},
                        {"expert_load_mean", m.expert_load_mean},
                        {"expert_load_p50", m.expert_load_p50},
                        {"expert_load_p90", m.expert_load_p90},
                        {"expert_load_p99", m.expert_load_p99},
                        {"expert_load_max_over_mean", m.expert_load_max_over_mean}};
    if (interval > 0 && m.step % interval == 0)
      best_effort(loads_file, "expert_load.npy", tty, [&](NpyAppender& f) {
        const double* l = trainer.expert_loads().ptr<double>();
        for (size_t i = 0; i < load_slice.size(); ++i) load_slice[i] = static_cast<float>(l[i]);
        f.append(load_slice.data());
      });
    j["tflops"] = static_cast<double>(m.tokens) / m.seconds * size.train_flops_per_token / 1e12;
    j["expert_load_min"] = m.expert_load_min;
    j["expert_load_dropped_fraction"] = m.expert_load_dropped_fraction;
    if (cfg.moe.dispatcher == "hierarchical") j["inter_node_bytes"] = m.inter_node_bytes;
    if (trainer.slot_exchange()) j["ep_slot_fill"] = m.ep_slot_fill;
    if (opts.device == Device::cuda)  // planned GPU memory (arenas), the peak so far
      j["gpu_memory_peak_mib"] = static_cast<double>(device_bytes_peak()) / (1 << 20);
    j["host_memory_peak_mib"] = static_cast<double>(peak_rss_bytes()) / (1 << 20);
    const bool last = m.step == stop;
    if ((cfg.train.eval_interval > 0 && m.step % cfg.train.eval_interval == 0) || last)
      if (trainer.num_valid_batches() > 0) j["eval_loss"] = trainer.evaluate();
    if (lead) {
      metrics << j.dump() << "\n";
      metrics.flush();
    }
    best_effort(tb, "the TensorBoard event file", tty, [&](TensorBoardWriter& w) {
      write_tensorboard(w, m, j, trainer.expert_loads().ptr<double>(), cfg.moe.num_experts,
                        interval > 0 && m.step % interval == 0);
      w.write_step(m.step);
    });
    if (const std::string note = trainer.cuda_graphs_note(); note != graphs_note) {
      graphs_note = note;
      if (lead) std::fprintf(stderr, "%smoefold: %s\n", tty ? "\n" : "", note.c_str());
    }
    const double eta = elapsed / static_cast<double>(steps_done) * static_cast<double>(stop - m.step);
    if (!opts.quiet && tty) progress(m, stop, static_cast<double>(m.tokens) * steps_done / elapsed, eta);
    if (lead && ((log_every > 0 && m.step % log_every == 0) || last)) {
      const std::string line = log_line(m, eta);
      train_log << line << "\n";
      if (!opts.quiet) std::fprintf(stderr, "%s%s\n", tty ? "\r\033[K" : "", line.c_str());
    }
    if (lead && j.contains("eval_loss")) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "eval loss %.4f at step %lld", j["eval_loss"].get<double>(),
                    static_cast<long long>(m.step));
      train_log << buf << "\n";
      if (!opts.quiet) std::fprintf(stderr, "%s%s\n", tty ? "\r\033[K" : "", buf);
    }
    if (lead) train_log.flush();
    if (cfg.train.save_checkpoints &&
        ((cfg.train.checkpoint_interval > 0 && m.step % cfg.train.checkpoint_interval == 0) || last)) {
      const auto t0 = std::chrono::steady_clock::now();  // training waits from here (for the save before too)
      saving([&] {
        if (writer.in_flight()) report_saved(writer.finish(true), save_blocking_s);  // one save at a time
      });
      saving([&] {
        trainer.save(writer);
        save_blocking_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (!writer.in_flight()) report_saved(m.step, save_blocking_s);
      });
      last_saved = m.step;
    }
  }
  saving([&] { report_saved(writer.finish(true), save_blocking_s); });  // the last save made durable
  if (last_saved != trainer.step() && steps_done == 0 && !opts.quiet)
    std::fprintf(stderr, "moefold: already at step %lld; nothing to do\n", static_cast<long long>(trainer.step()));
  if (!opts.quiet && tty) std::fprintf(stderr, "\n");
  if (!opts.quiet && steps_done > 0)
    std::fprintf(stderr, "moefold: done at step %lld: %.1f s, %.0f tokens/s; %s%s\n",
                 static_cast<long long>(trainer.step()), elapsed,
                 static_cast<double>(cfg.train.global_batch_size * cfg.train.seq_len) * steps_done / elapsed,
                 cfg.train.save_checkpoints ? "checkpoints in " : "no checkpoints (train.save_checkpoints = false)",
                 cfg.train.save_checkpoints ? ckpt_dir.c_str() : "");
  return trainer.step();
}

}  // namespace moefold
