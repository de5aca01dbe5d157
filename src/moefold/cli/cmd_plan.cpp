// `moefold plan`: the memory one training rank of a layout needs, from the trainer's own binding
// pass (train/memory_plan.h), and whether it fits; when it does not, what the memory options
// that exist give. `moefold plan --perf`: the predicted step time and TFLOP/s per GPU on a cluster
// (train/perf_model.h), with --search the best layouts that fit.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "moefold/cli/commands.h"
#include "moefold/core/error.h"
#include "moefold/moe/slot_dispatcher.h"
#include "moefold/train/checkpoint.h"
#include "moefold/train/memory_plan.h"
#include "moefold/train/perf_model.h"
#include "moefold/train/pipeline_schedule.h"

namespace moefold::cli {

namespace {

struct PlanArgs {
  ConfigOptions config;
  int world = 1;
  std::string gpu_memory, host_memory = "1TiB", device = "cuda";  // gpu_memory empty: 139GiB (--perf: the cluster's)
  bool perf = false, search = false, json = false;                // --perf, --search, --json
  ClusterOptions cluster;
  int top = 5;  // --top: layouts --search prints
};

// "141GiB", "80GB", "512MiB", "1TiB" or plain bytes; anything else: one line naming the option.
size_t parse_bytes(const std::string& text, const char* option) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  const std::string number = text.substr(0, i), unit = text.substr(i);
  double scale = 0;
  for (const auto& [name, s] : {std::pair<const char*, double>{"", 1.0},
                                {"B", 1.0},
                                {"KB", 1e3},
                                {"MB", 1e6},
                                {"GB", 1e9},
                                {"TB", 1e12},
                                {"KiB", 1024.0},
                                {"MiB", 1024.0 * 1024},
                                {"GiB", 1024.0 * 1024 * 1024},
                                {"TiB", 1024.0 * 1024 * 1024 * 1024}})
    if (unit == name) scale = s;
  double value = 0;
  try {
    value = number.empty() ? -1 : std::stod(number);
  } catch (const std::exception&) {
    value = -1;
  }
  if (scale == 0 || value <= 0)
    MF_FAIL(option, " ", text, ": expected a size such as 141GiB, 80GB, 512MiB or a number of bytes");
  return static_cast<size_t>(value * scale);
}

std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024 * 1024));
  return buf;
}

void print_rank(const MemoryPlan& p, size_t gpu_bytes, size_t host_bytes) {
  const bool gpu = p.device == Device::cuda;
  std::printf("  master weights (f32)        %s\n", gib(p.master).c_str());
  std::printf("  compute copies (%s)       %s\n", gpu ? "bf16" : "f32 ", gib(p.compute_copies).c_str());
  if (p.fp8_copies > 0) std::printf("  FP8 weight copies           %s\n", gib(p.fp8_copies).c_str());
  std::printf("  gradients (%s)%s%s\n", p.bf16_grads ? "bf16 and f32" : "f32", p.bf16_grads ? "    " : "             ",
              gib(p.gradients).c_str());
  std::printf("  optimizer state             %s\n", gib(p.optimizer).c_str());
  if (p.optimizer_host > 0)
    std::printf("  optimizer state offloaded   %s (pinned host memory)\n", gib(p.optimizer_host).c_str());
  std::printf("  activations and workspaces  %s\n", gib(p.activations).c_str());
  const size_t total = p.peak();
  std::printf("  planned on the %s         %s\n", gpu ? "GPU " : "host", gib(p.device_total()).c_str());
  if (gpu)
    std::printf("  library workspaces          %s (cuBLASLt, cuDNN attention, NCCL staging)\n", gib(p.runtime).c_str());
  std::printf("  peak                        %s of %s: %s\n", gib(total).c_str(),
              gib(gpu ? gpu_bytes : host_bytes).c_str(),
              total <= (gpu ? gpu_bytes : host_bytes) ? "fits" : "DOES NOT FIT");
  if (gpu)
    std::printf("  host memory                 %s of %s: %s\n", gib(p.host + p.optimizer_host).c_str(),
                gib(host_bytes).c_str(), p.host + p.optimizer_host <= host_bytes ? "fits" : "DOES NOT FIT");
}

// Adds recompute modules to the config's (each once).
void add_modules(Config& c, std::initializer_list<const char*> modules) {
  std::vector<std::string>& m = c.train.recompute_modules;
  for (const char* name : modules)
    if (std::find(m.begin(), m.end(), name) == m.end()) m.emplace_back(name);
}

// --perf: the performance model's breakdown of one step (or JSON for scripts and tests).
nlohmann::json item_json(const PerfItem& i) {
  return {{"name", i.name}, {"ms", i.ms}, {"exposed_ms", i.exposed_ms}, {"overlap", i.overlap}};
}

nlohmann::json prediction_json(const PerfPrediction& p) {
  const ParallelConfig& l = p.layout;
  nlohmann::json j = {
      {"layout",
       {{"pp", l.pp}, {"vpp", l.vpp}, {"tp", l.tp}, {"cp", l.cp}, {"dp", l.dp}, {"ep", l.ep}, {"etp", l.etp}}},
      {"micro_batches", p.micro_batches},
      {"slowest_stage", p.slowest_stage},
      {"moe_layer_ms", p.moe_layer_ms},
      {"dense_layer_ms", p.dense_layer_ms},
      {"head_ms", p.head_ms},
      {"bubble_ms", p.bubble_ms},
      {"step_ms", p.step_ms},
      {"tokens_per_s", p.tokens_per_s},
      {"tflops_per_gpu", p.tflops_per_gpu}};
  j["compute"] = nlohmann::json::array();
  for (const PerfItem& i : p.compute) j["compute"].push_back(item_json(i));
  j["communication"] = nlohmann::json::array();
  for (const PerfItem& i : p.communication) j["communication"].push_back(item_json(i));
  return j;
}

std::string layout_text(const ParallelConfig& l) {
  return cat("tp ", l.tp, ", cp ", l.cp, ", pp ", l.pp, l.vpp > 1 ? cat(" (vpp ", l.vpp, ")") : std::string(), ", dp ",
             l.dp, ", ep ", l.ep, ", etp ", l.etp, " (edp ", l.edp(), ")");
}

void print_prediction(const Config& cfg, const Cluster& c, int world, const PerfPrediction& p) {
  std::printf("%s on %d x %s (%lld per node; NVLink %.0f GB/s, between nodes %.0f GB/s per GPU): %s\n",
              cfg.preset.c_str(), world, c.gpu.name.c_str(), static_cast<long long>(c.gpus_per_node), c.nvlink_gbps,
              c.internode_gbps, layout_text(p.layout).c_str());
  std::printf("%lld micro-batches of %lld x %lld tokens per step and data-parallel rank; dispatcher %s; %s\n",
              static_cast<long long>(p.micro_batches), static_cast<long long>(cfg.train.micro_batch_size),
              static_cast<long long>(cfg.train.seq_len), cfg.moe.dispatcher.c_str(),
              cfg.train.fp8 == "blockwise" ? "FP8 (blockwise) linears" : "bf16");
  std::printf("one micro-batch on one rank, forward + backward%s: MoE layer %.2f ms",
              cfg.train.recompute().num_layers > 0 || cfg.train.recompute().any_module() ? " + recompute" : "",
              p.moe_layer_ms);
  if (p.dense_layer_ms > 0) std::printf(", dense layer %.2f ms", p.dense_layer_ms);
  std::printf(", LM head%s %.2f ms\n", cfg.model.num_nextn_predict_layers > 0 ? " and MTP" : "", p.head_ms);
  std::printf("per step, %s (ms):\n",
              p.layout.pp > 1 ? cat("pipeline stage ", p.slowest_stage, ", the slowest").c_str() : "one rank");
  for (const PerfItem& i : p.compute) std::printf("  %-46s %10.2f\n", i.name.c_str(), i.ms);
  std::printf("  communication                                   total    exposed   overlap\n");
  for (const PerfItem& i : p.communication)
    std::printf("  %-46s %10.2f %10.2f   %s\n", i.name.c_str(), i.ms, i.exposed_ms, i.overlap.c_str());
  if (p.layout.pp > 1)
    std::printf("  pipeline bubble ((pp - 1) / (m x vpp) = %.3f)       %10.2f\n",
                bubble_fraction(p.layout.pp, p.layout.vpp, p.micro_batches), p.bubble_ms);
  std::printf("step %.1f ms: %.0f tokens/s, %.1f model TFLOP/s per GPU (MFU %.3f of 989)\n", p.step_ms, p.tokens_per_s,
              p.tflops_per_gpu, p.tflops_per_gpu / 989);
}

void run_perf(const PlanArgs& a) {
  const Config cfg = a.config.load();
  if (a.world < 1) MF_FAIL("--world ", a.world, ": expected at least 1 rank");
  if (a.top < 1) MF_FAIL("--top ", a.top, ": expected at least 1 layout");
  Cluster c = make_cluster(a.cluster);
  if (!a.gpu_memory.empty()) c.gpu.memory_gib = parse_bytes(a.gpu_memory, "--gpu-memory") / (1024.0 * 1024 * 1024);
  if (!a.search) {
    const PerfPrediction p = predict_step(cfg, a.world, c);
    if (a.json) {
      std::printf("%s\n", prediction_json(p).dump(2).c_str());
      return;
    }
    print_prediction(cfg, c, a.world, p);
    return;
  }
  SearchStats stats;
  const std::vector<LayoutCandidate> best = search_layouts(cfg, a.world, c, a.top, &stats);
  if (a.json) {
    nlohmann::json j = {{"layouts", stats.layouts}, {"planned", stats.planned}, {"too_large", stats.too_large}};
    j["best"] = nlohmann::json::array();
    for (const LayoutCandidate& b : best) {
      nlohmann::json e = prediction_json(b.prediction);
      e["micro_batch_size"] = b.micro_batch_size;
      e["peak_gib"] = b.peak_gib;
      e["dispatcher"] = b.dispatcher;
      j["best"].push_back(e);
    }
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  std::printf(
      "%s on %d x %s: %lld layouts timed (tp, cp, pp, vpp, ep, etp, micro-batch), best first; %lld memory-planned, "
      "%lld of them over %.1f GiB\n",
      cfg.preset.c_str(), a.world, c.gpu.name.c_str(), static_cast<long long>(stats.layouts),
      static_cast<long long>(stats.planned), static_cast<long long>(stats.too_large), c.gpu.memory_gib);
  if (best.empty()) std::printf("no layout fits: more GPUs, or the memory options `moefold plan` lists\n");
  for (const LayoutCandidate& b : best)
    std::printf("  %6.1f TFLOP/s  %8.0f ms  %s, micro-batch %lld, %s, peak %.1f GiB\n", b.prediction.tflops_per_gpu,
                b.prediction.step_ms, layout_text(b.layout).c_str(), static_cast<long long>(b.micro_batch_size),
                b.dispatcher.c_str(), b.peak_gib);
}

void run_plan(const PlanArgs& a) {
  Config cfg = a.config.load();
  const Device device = a.device == "cpu" ? Device::cpu : Device::cuda;
  if (a.device != "cpu" && a.device != "cuda") MF_FAIL("--device ", a.device, ": expected cuda or cpu");
  if (a.world < 1) MF_FAIL("--world ", a.world, ": expected at least 1 rank");
  const size_t gpu_bytes = parse_bytes(a.gpu_memory.empty() ? "139GiB" : a.gpu_memory, "--gpu-memory");
  const size_t host_bytes = parse_bytes(a.host_memory, "--host-memory");
  // The ranks whose plans can differ: the first of each pipeline stage (their layers and
  // micro-batches in flight differ) and the last rank (the last expert-parallel shard).
  const ParallelConfig layout = cfg.resolve_layout(a.world);
  std::vector<int> ranks;
  for (int64_t s = 0; s < layout.pp; ++s) ranks.push_back(static_cast<int>(s * (layout.world() / layout.pp)));
  if (ranks.back() != a.world - 1) ranks.push_back(a.world - 1);
  const MemoryPlan first = plan_memory(cfg, a.world, 0, device);
  MemoryPlan last = first;  // the largest of the others
  for (size_t i = 1; i < ranks.size(); ++i) {
    MemoryPlan p = plan_memory(cfg, a.world, ranks[i], device);
    if (i == 1 || p.peak() > last.peak()) last = std::move(p);
  }
  const ParallelConfig& l = first.layout;
  std::printf("%s on %d rank(s): (pp, tp, cp, dp, ep, etp) = (%lld, %lld, %lld, %lld, %lld, %lld), %s, %s\n",
              cfg.preset.c_str(), a.world, static_cast<long long>(l.pp), static_cast<long long>(l.tp),
              static_cast<long long>(l.cp), static_cast<long long>(l.dp), static_cast<long long>(l.ep),
              static_cast<long long>(l.etp),
              device == Device::cuda ? "GPU (bf16 compute, f32 master weights and optimizer state)" : "CPU (f32)",
              cfg.parallel.distributed_optimizer ? "distributed optimizer" : "optimizer state on every rank");
  if (l.pp > 1 || cfg.parallel.overlap_moe_a2a) {  // each stage's layers, and the micro-batches it keeps
    std::string counts, first, last;
    for (const int64_t n : l.stage_layers(cfg.model.num_hidden_layers)) counts += cat(counts.empty() ? "" : ", ", n);
    const int64_t micro = cfg.train.global_batch_size / (cfg.train.micro_batch_size * l.dp);
    const bool ov = cfg.parallel.overlap_moe_a2a;
    for (const int64_t n : micro_batches_in_flight(pipeline_actions(l.pp, l.vpp, 0, micro, ov), l.vpp))
      first += cat(first.empty() ? "" : " + ", n);
    for (const int64_t n : micro_batches_in_flight(pipeline_actions(l.pp, l.vpp, l.pp - 1, micro, ov), l.vpp))
      last += cat(last.empty() ? "" : " + ", n);
    std::printf(
        "pipeline (%s%s%s): decoder layers per %sstage %s; micro-batches in flight (activations kept, per "
        "chunk): %s on the first stage, %s on the last\n",
        cfg.parallel.pipeline_schedule.c_str(), l.vpp > 1 ? ", interleaved" : "", ov ? ", all-to-all overlap" : "",
        l.vpp > 1 ? "virtual " : "", counts.c_str(), first.c_str(), last.c_str());
  }
  if (cfg.moe.dispatcher == "slots" && l.ep > 1) {  // its fixed sizes decide memory and the bytes on the wire
    const int64_t tokens = cfg.train.micro_batch_size * cfg.train.seq_len / (l.cp * l.tp);
    const int ep = static_cast<int>(l.ep);
    const int64_t slot = SlotDispatcher::slot_rows(cfg.moe, tokens, ep);
    std::printf(
        "slot dispatcher (moe.ep_recv_factor = %g): %lld rows per peer slot, %lld rows to the experts; each "
        "exchange moves %lld rows per rank whatever the routing (%lld routed on average)\n",
        cfg.moe.ep_recv_factor, static_cast<long long>(slot),
        static_cast<long long>(SlotDispatcher::expert_rows(cfg.moe, tokens, ep)), static_cast<long long>(slot * ep),
        static_cast<long long>(tokens * cfg.moe.num_experts_per_tok));
  }
  std::printf(
      "per rank (%s); planned = what the trainer reserves before step 0 (its binding pass); the libraries\n"
      "size their workspaces at the first step (docs/benchmarks.md: predicted vs measured peaks). Dropless\n"
      "expert-parallel receive buffers are sized for the worst case (every peer's tokens on this rank's\n"
      "experts); moe.capacity_factor bounds them.\n",
      first.peak() == last.peak() ? "rank 0; every rank the same" : "rank 0");
  print_rank(first, gpu_bytes, host_bytes);
  std::printf("checkpoint on disk: %s per save (f32 weights and AdamW moments of the whole model)\n",
              gib(static_cast<size_t>(checkpoint_bytes(cfg))).c_str());
  if (first.peak() != last.peak()) {
    std::printf(
        "rank %d%s\n", last.rank,
        l.pp > 1 ? cat(" (stage ", last.rank / (l.world() / l.pp), ": the largest of the others)").c_str() : "");
    print_rank(last, gpu_bytes, host_bytes);
  }
  // Runs of layers with equal bytes on one line ("layers.3-47  2.02 GiB each").
  std::printf("activations by part (rank 0):\n");
  // The workspace the layers share (and the recomputed layers' block) after the layers.
  std::vector<Memory::PartBytes> parts;
  for (int pass = 0; pass < 2; ++pass)
    for (const Memory::PartBytes& p : first.parts) {
      const bool pooled =
          p.part.rfind("layers' ", 0) == 0 || p.part.rfind("recomputed ", 0) == 0 || p.part.rfind("offloaded ", 0) == 0;
      if (pooled != (pass == 1)) continue;
      if (pass == 1) {  // pooled: right after the last layer
        size_t at = parts.size();
        while (at > 0 && parts[at - 1].part.rfind("layers.", 0) != 0) --at;
        parts.insert(parts.begin() + static_cast<std::ptrdiff_t>(at > 0 ? at : parts.size()), p);
      } else {
        parts.push_back(p);
      }
    }
  for (size_t i = 0; i < parts.size();) {
    size_t j = i + 1;
    const bool layer = parts[i].part.rfind("layers.", 0) == 0;
    while (layer && j < parts.size() && parts[j].part.rfind("layers.", 0) == 0 && parts[j].device == parts[i].device &&
           parts[j].host == parts[i].host)
      ++j;
    const std::string name = j - i > 1 ? parts[i].part + "-" + parts[j - 1].part.substr(7) : parts[i].part;
    std::printf("  %-26s  %s%s%s\n", name.c_str(), gib(parts[i].device).c_str(), j - i > 1 ? " each" : "",
                parts[i].host > 0 ? (" (+ " + gib(parts[i].host) + " host)").c_str() : "");
    i = j;
  }
  // The memory options that exist, added one by one in order of their throughput cost (measured
  // on an H200, docs/benchmarks.md): bf16 moments (none: the update gets faster), cuDNN's
  // non-deterministic attention backward (none; reruns differ in the last bits), expert-parallel
  // receive buffers at twice the average (none; an imbalance past it stops the run), then the
  // distributed optimizer (its gathers; only with shard groups of several ranks), bf16 gradient
  // accumulators (none), FP8 linears' weights kept only in FP8 (with train.fp8: ~1% on one rank
  // with the distributed optimizer, its gathers half as large); then, only while
  // nothing fits, recomputation: the cheap modules (norms, the experts' SwiGLU, MLA's up
  // projections), the attention core and the dense MLPs, the whole MoE block, then the smallest
  // optimizer offload (tenths; its host update is paid every step), and last the fewest whole
  // layers (method block) that make it fit.
  struct Option {
    const char* text;
    bool applies;
    void (*apply)(Config&);
  };
  const Option options[] = {
      {"train.exp_avg_dtype = train.exp_avg_sq_dtype = bf16",
       cfg.train.exp_avg_dtype != "bf16" || cfg.train.exp_avg_sq_dtype != "bf16",
       [](Config& c) { c.train.exp_avg_dtype = c.train.exp_avg_sq_dtype = "bf16"; }},
      {"kernels.deterministic_attention = false", device == Device::cuda && cfg.kernels.deterministic_attention,
       [](Config& c) { c.kernels.deterministic_attention = false; }},
      // No throughput cost, but a dispatch past twice the average receive fails the run.
      {"moe.ep_recv_factor = 2", first.layout.ep > 1 && !(cfg.moe.ep_recv_factor > 0),
       [](Config& c) { c.moe.ep_recv_factor = 2; }},
      {"parallel.distributed_optimizer = true", !cfg.parallel.distributed_optimizer && a.world > 1,
       [](Config& c) { c.parallel.distributed_optimizer = true; }},
      // No throughput cost; the expert and tensor-parallel gradients accumulate in bf16.
      {"train.main_grads_dtype = bf16", device == Device::cuda && cfg.train.main_grads_dtype != "bf16",
       [](Config& c) { c.train.main_grads_dtype = "bf16"; }},
      // The same results; no bf16 copies of the FP8 linears' weights.
      {"train.fp8_param = true", cfg.train.fp8 == "blockwise" && !cfg.train.fp8_param,
       [](Config& c) { c.train.fp8_param = true; }},
      {"train.recompute_modules += layernorm, moe_act, mla_up_proj", true,
       [](Config& c) {
         add_modules(c, {"layernorm", "moe_act", "mla_up_proj"});
       }},
      {"train.recompute_modules += core_attn, shared_experts, mlp", true,
       [](Config& c) {
         add_modules(c, {"core_attn", "shared_experts", "mlp"});
       }},
      {"train.recompute_modules += moe", true, [](Config& c) { add_modules(c, {"moe"}); }},
  };
  const size_t recompute_options = 3;  // the last ones: tried only while nothing fits
  const size_t limit = device == Device::cuda ? gpu_bytes : host_bytes;
  Config with = cfg;
  std::string added;
  bool fits = first.peak() <= limit && last.peak() <= limit;
  auto peak_of = [&](const Config& c) {
    size_t peak = 0;
    for (const int r : ranks) peak = std::max(peak, plan_memory(c, a.world, r, device).peak());
    return peak;
  };
  auto report = [&](const std::string& text, size_t peak) {
    std::printf("with %s: peak %s per rank (%s)%s\n", text.c_str(), gib(peak).c_str(),
                peak <= limit ? "fits" : "does not fit", !fits && peak <= limit ? ": the cheapest set that fits" : "");
    fits = fits || peak <= limit;
  };
  const size_t n_options = sizeof(options) / sizeof(options[0]);
  for (size_t i = 0; i < n_options; ++i) {
    const Option& o = options[i];
    if (!o.applies || (fits && i + recompute_options >= n_options)) continue;
    o.apply(with);
    added += added.empty() ? o.text : std::string(", ") + o.text;
    report(added, peak_of(with));
  }
  if (!fits && device == Device::cuda) {  // optimizer offload: the smallest tenth that fits
    auto offload = [&](int tenths) {
      Config c = with;
      c.parallel.distributed_optimizer = true;  // the offloaded state is the optimizer's shards
      c.train.optimizer_offload_fraction = tenths / 10.0;
      return c;
    };
    auto host_of = [&](const Config& c) {  // the offloaded state must fit the host too
      size_t bytes = 0;
      for (const int r : ranks) {
        const MemoryPlan p = plan_memory(c, a.world, r, device);
        bytes = std::max(bytes, p.host + p.optimizer_host);
      }
      return bytes;
    };
    const std::string dist = with.parallel.distributed_optimizer ? "" : ", parallel.distributed_optimizer = true";
    for (int t = 1; t <= 10 && !fits; ++t) {
      const Config c = offload(t);
      const size_t peak = peak_of(c), host = host_of(c);
      if (host > host_bytes) {
        std::printf(
            "with %s%s, train.optimizer_offload_fraction = %.1f: %s of host memory, over the %s given "
            "(--host-memory)\n",
            added.c_str(), dist.c_str(), t / 10.0, gib(host).c_str(), gib(host_bytes).c_str());
        break;
      }
      if (peak <= limit || t == 10) report(added + dist + cat(", train.optimizer_offload_fraction = ", t / 10.0), peak);
    }
  }
  const int64_t layers = cfg.model.num_hidden_layers;
  if (!fits && layers > 0) {  // whole layers, one by one from the first: the fewest that fit
    auto whole = [&](int64_t n) {
      Config c = with;
      c.train.recompute_method = "block";
      c.train.recompute_num_layers = n;
      return c;
    };
    int64_t lo = 1, hi = layers;
    if (peak_of(whole(hi)) <= limit)
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (peak_of(whole(mid)) <= limit)
          hi = mid;
        else
          lo = mid + 1;
      }
    report(added + cat(", train.recompute_method = block, train.recompute_num_layers = ", hi), peak_of(whole(hi)));
  }
  if (!fits)
    std::printf(
        "no set of the memory options that exist fits: a smaller micro-batch, more ranks or a layout with more "
        "tensor/expert parallelism\n");
}

}  // namespace

Command add_plan(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand("plan", "print the memory each rank of a layout needs, and whether it fits");
  add_config_options(cmd, a->config);
  cmd->add_option("--world", a->world, "ranks of the layout (default 1; parallel.* of the config lays them out)");
  cmd->add_option("--gpu-memory", a->gpu_memory,
                  "memory one GPU can allocate (default 139GiB: an H200; with --perf the cluster's GPU)");
  cmd->add_option("--host-memory", a->host_memory, "host memory per rank (default 1TiB)");
  cmd->add_option("--device", a->device, "cuda (default: bf16 mixed precision) or cpu (f32)");
  cmd->add_flag("--perf", a->perf, "predict the step time and model TFLOP/s per GPU on a cluster instead");
  cmd->add_flag("--search", a->search, "with --perf: the best layouts for --world GPUs that fit in memory");
  cmd->add_flag("--json", a->json, "with --perf: print JSON");
  cmd->add_option("--top", a->top, "with --search: layouts to print (default 5)");
  cmd->add_option("--cluster", a->cluster.kind, "with --perf: h200 (default) or h100");
  cmd->add_option("--gpus-per-node", a->cluster.gpus_per_node, "with --perf: GPUs per node (default 8)");
  cmd->add_option("--nvlink-gbps", a->cluster.nvlink_gbps,
                  "with --perf: NVLink GB/s per GPU and direction (default: the cluster's)");
  cmd->add_option("--internode-gbps", a->cluster.internode_gbps,
                  "with --perf: GB/s per GPU and direction between nodes (default 50)");
  return {cmd, [a](World&) { a->perf || a->search ? run_perf(*a) : run_plan(*a); }};
}

}  // namespace moefold::cli
