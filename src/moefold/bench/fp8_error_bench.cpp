#include "moefold/bench/fp8_error_bench.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>

#include "moefold/bench/format.h"
#include "moefold/core/device.h"
#include "moefold/core/dtype.h"
#include "moefold/core/error.h"
#include "moefold/data/token_dataset.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/run.h"
#include "moefold/train/trainer.h"

namespace moefold {

using bench_format::fmt;

namespace fs = std::filesystem;

namespace {

// The host values of a gradient (f32 or bf16, either device).
std::vector<double> host_values(const Tensor& t) {
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<uint8_t> bytes(static_cast<size_t>(t.nbytes()));
  device_copy(bytes.data(), Device::cpu, t.data(), t.device(), bytes.size());
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    if (t.dtype() == DType::f32) {
      float f;
      std::memcpy(&f, bytes.data() + 4 * i, 4);
      out[i] = f;
    } else if (t.dtype() == DType::bf16) {
      uint16_t h;
      std::memcpy(&h, bytes.data() + 2 * i, 2);
      out[i] = bf16_to_f32(h);
    } else if (t.dtype() == DType::f64) {
      std::memcpy(&out[i], bytes.data() + 8 * i, 8);
    } else {
      MF_FAIL("bench fp8-error: a gradient of dtype ", dtype_name(t.dtype()));
    }
  }
  return out;
}

// "model.layers.3.self_attn.o_proj.weight" -> "model.layers.*.self_attn.o_proj.weight" (decoder
// layers below `layers` only: multi-token prediction's keep their index); with per_layer as given.
std::string group_name(const std::string& name, int64_t layers, bool per_layer) {
  const std::string key = "model.layers.";
  if (per_layer || name.rfind(key, 0) != 0) return name;
  const size_t dot = name.find('.', key.size());
  if (dot == std::string::npos) return name;
  const std::string index = name.substr(key.size(), dot - key.size());
  if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos) return name;
  if (std::stoll(index) >= layers) return name;
  return key + "*" + name.substr(dot);
}

}  // namespace

double Fp8ErrorRow::relative_error() const {
  return ref_sq > 0 ? std::sqrt(diff_sq / ref_sq) : (diff_sq > 0 ? INFINITY : 0);
}

double Fp8ErrorRow::cosine() const {
  return ref_sq > 0 && fp8_sq > 0 ? dot / std::sqrt(ref_sq * fp8_sq) : (ref_sq == fp8_sq ? 1.0 : 0.0);
}

Fp8ErrorResult bench_fp8_error(const Config& cfg_in, Communicator& world, const Fp8ErrorOptions& opts) {
  if (world.size() != 1)
    MF_FAIL("bench fp8-error runs on one rank (", world.size(), " here): start it without mpirun or torchrun");
  if (opts.batches < 1) MF_FAIL("bench fp8-error: --batches ", opts.batches, " (need >= 1)");
  Config with = cfg_in, without = cfg_in;
  if (with.train.fp8 == "none") with.train.fp8 = "blockwise";
  without.train.fp8 = "none";
  without.moe.fp8_dispatch = false;
  without.train.fp8_param = false;
  without.train.fp8_exclude.clear();
  for (Config* c : {&with, &without}) {
    c->train.eval_interval = 0;
    c->train.checkpoint_interval = 0;
    c->validate();
  }
  Fp8ErrorResult r;
  r.fp8_modules = with.train.fp8_linears().names();

  // Without data.path, the default corpus: the checkpoint's run directory's (where `moefold train`
  // prepared it), or prepared into a scratch directory removed at the end.
  fs::path dir;
  if (!opts.checkpoint.empty()) {
    fs::path c = fs::path(opts.checkpoint).lexically_normal();
    if (!c.has_filename()) c = c.parent_path();  // a trailing '/'
    const fs::path run = c.parent_path().parent_path();
    if (fs::exists(run / "default_corpus.tokens")) dir = run;
  }
  struct Scratch {
    fs::path dir;
    ~Scratch() {
      std::error_code ec;
      if (!dir.empty()) fs::remove_all(dir, ec);
    }
  } scratch;
  if (dir.empty() && with.data.path.empty()) {
    dir = scratch.dir = fs::temp_directory_path() / cat("moefold_fp8_error_", ::getpid());
    fs::create_directories(dir);
  }
  const TokenDataset data = open_run_data(with, dir.string(), true, world);
  data.check_vocab(with.model.vocab_size);
  const ParallelConfig layout = with.resolve_layout(1);
  Mesh mesh_ref = Mesh::build(world, layout), mesh_fp8 = Mesh::build(world, layout);
  Trainer ref(without, data, mesh_ref, opts.device), fp8(with, data, mesh_fp8, opts.device);
  for (Trainer* t : {&ref, &fp8}) {
    if (opts.checkpoint.empty())
      t->init_fresh();
    else
      t->load(opts.checkpoint);
  }
  MF_CHECK(ref.params().size() == fp8.params().size(), "bench fp8-error: the two arms' parameters differ");
  std::map<std::string, size_t> index;
  for (int b = 0; b < opts.batches; ++b) {
    ref.accumulate_gradients();
    fp8.accumulate_gradients();
    const StepMetrics &a = ref.metrics(), &q = fp8.metrics();
    r.lm_loss_ref.push_back(a.lm_loss);
    r.lm_loss_fp8.push_back(q.lm_loss);
    r.mtp_loss_ref.push_back(a.mtp_loss);
    r.mtp_loss_fp8.push_back(q.mtp_loss);
    r.grad_norm_ref.push_back(a.grad_norm);
    r.grad_norm_fp8.push_back(q.grad_norm);
    for (size_t i = 0; i < ref.params().size(); ++i) {
      const Param &p = ref.params()[i], &p8 = fp8.params()[i];
      MF_CHECK(p.name == p8.name, "bench fp8-error: parameter ", i, " is ", p.name, " and ", p8.name);
      if (p.pipeline_copy) continue;
      const std::string g = group_name(p.name, with.model.num_hidden_layers, opts.per_layer);
      auto [it, fresh] = index.emplace(g, r.rows.size());
      if (fresh) r.rows.push_back({.name = g, .fp8 = p8.fp8.defined()});
      Fp8ErrorRow& row = r.rows[it->second];
      const std::vector<double> x = host_values(p.grad), y = host_values(p8.grad);
      MF_CHECK(x.size() == y.size(), "bench fp8-error: ", p.name, "'s gradients differ in size");
      if (b == 0) row.elements += static_cast<int64_t>(x.size());
      for (size_t j = 0; j < x.size(); ++j) {
        row.ref_sq += x[j] * x[j];
        row.fp8_sq += y[j] * y[j];
        row.diff_sq += (y[j] - x[j]) * (y[j] - x[j]);
        row.dot += x[j] * y[j];
      }
    }
  }
  return r;
}

std::string format_fp8_error(const Fp8ErrorResult& r, const std::string& title) {
  auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? 0.0 : s / static_cast<double>(v.size());
  };
  auto rel = [](double a, double b) { return a != 0 ? fmt("%+.3f%%", 100 * (b - a) / a) : std::string("-"); };
  std::string s = title + "\n\nFP8 linear layers: " + (r.fp8_modules.empty() ? "none" : r.fp8_modules) + "\n\n";
  s += "| per batch (mean of " + std::to_string(r.lm_loss_ref.size()) + ") | without FP8 | FP8 | FP8 against it |\n";
  s += "|---|---|---|---|\n";
  const double lr = mean(r.lm_loss_ref), l8 = mean(r.lm_loss_fp8), mr = mean(r.mtp_loss_ref), m8 = mean(r.mtp_loss_fp8),
               gr = mean(r.grad_norm_ref), g8 = mean(r.grad_norm_fp8);
  s += cat("| language-model loss | ", fmt("%.6f", lr), " | ", fmt("%.6f", l8), " | ", rel(lr, l8), " |\n");
  if (mr != 0 || m8 != 0)
    s += cat("| multi-token-prediction loss | ", fmt("%.6f", mr), " | ", fmt("%.6f", m8), " | ", rel(mr, m8), " |\n");
  s += cat("| gradient norm | ", fmt("%.6g", gr), " | ", fmt("%.6g", g8), " | ", rel(gr, g8), " |\n\n");
  s += "| parameter | FP8 GEMM weight | elements | gradient norm without FP8 | relative error | cosine |\n";
  s += "|---|---|---|---|---|---|\n";
  for (const Fp8ErrorRow& x : r.rows)
    s += cat("| ", x.name, " | ", x.fp8 ? "yes" : "", " | ", x.elements, " | ", fmt("%.4g", std::sqrt(x.ref_sq)), " | ",
             fmt("%.4f", x.relative_error()), " | ", fmt("%.6f", x.cosine()), " |\n");
  return s;
}

}  // namespace moefold
