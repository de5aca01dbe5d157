// The performance model (perf_model.h). Every time is work / rate: FLOPs from model_flops (the
// count behind moefold's TFLOP/s), bytes from the tensors each op reads and writes, rates measured
// with moefold on an H200. One global set of efficiencies (below, each with its source); nothing is
// fitted per configuration. docs/scaling.md compares the model with measured and published runs.
#include "moefold/train/perf_model.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "moefold/core/error.h"
#include "moefold/model/model_flops.h"
#include "moefold/moe/slot_dispatcher.h"
#include "moefold/train/memory_plan.h"

namespace moefold {

namespace {

// H200 SXM, measured with moefold (or, where moefold has no benchmark of its own, with PyTorch on
// the same machine) and recorded in docs/benchmarks.md:
GpuRates h200_rates() {
  GpuRates g;
  g.name = "h200";
  // "FP8 GEMM ceilings" table, cuBLASLt bf16 column: 782.3 / 690.6 / 822.6 / 809.5 at the four
  // expert shapes taken as one dense GEMM; their mean (dense bf16 8192^3: 790).
  g.dense_tflops = 776;
  // "Stages (qwen3-30b-a3b balanced)": experts forward 1.978 ms = 625 TFLOP/s; the FP8 section's
  // MoE-layer table, bf16 column: deepseek-v3 experts forward 8.980 ms = 642. The backward runs at
  // the same rate plus its f32 weight-gradient writes (modelled as bytes, below): 4.274 ms and
  // 29.353 ms measured.
  g.grouped_tflops = 640;
  // Same table, cuBLASLt "FP8 1x128 x 128x128" column: 1247.4 / 970.9 / 1201.7 / 1078.3; mean.
  g.fp8_dense_tflops = 1125;
  // "moefold's own grouped kernel" table (CUTLASS cooperative, ms): qwen3 fc1 1.12, fc2 0.69
  // (736 / 597 TFLOP/s, 684 for the pair), deepseek fc1 4.16-4.58, fc2 2.24-2.37 (924 / 836: 893);
  // the mean of the two shapes (each within 13%).
  g.fp8_grouped_tflops = 790;
  // "causal attention, own kernel vs cuDNN": cuDNN forward 524 / 582 (qwen3-30b-a3b / qwen3-235b-a22b
  // heads), deterministic backward 393 / 431, non-deterministic 437 / 471: means.
  g.attn_fwd_tflops = 553;
  g.attn_bwd_tflops = 412;
  g.attn_bwd_nondet_tflops = 454;
  // Same table, deepseek-v3 MLA padded (D = 192): 636, 250, 304.
  g.mla_fwd_tflops = 636;
  g.mla_bwd_tflops = 250;
  g.mla_bwd_nondet_tflops = 304;
  // "Ceilings and bars": HBM about 4.3 TB/s for a copy.
  g.hbm_gbps = 4300;
  // "GPU kernel leads": cross-entropy 8192 x 151936, forward 1.09 ms + backward 1.25 ms.
  g.cross_entropy_per_s = 8192.0 * 151936 / 2.34e-3;
  // FP8 section, MoE-layer table: "quantize fc1 input rows" 0.348 ms for 131072 x 2048 (qwen3) and
  // 0.638 ms for 65536 x 7168 (deepseek): 0.77e12 and 0.74e12 elements/s.
  g.fp8_quant_per_s = 0.75e12;
  // Same table, "quantize fc1 weight (once per step)": 0.932 ms for 128 x 1536 x 2048 and 17.183 ms
  // for 256 x 4096 x 7168 elements: 0.43e12 and 0.44e12 elements/s.
  g.fp8_weight_quant_per_s = 0.435e12;
  g.memory_gib = 139;  // moefold plan's default --gpu-memory for an H200
  return g;
}

// H100 SXM (80 GB): no moefold measurement. The same GH100 die with the same 132 SMs and the same
// datasheet peaks (989 TFLOP/s dense bf16), so every compute rate is the H200's; HBM3 at 3.35 TB/s
// against the H200's 4.8 TB/s (datasheets), so every memory-bound rate is the H200's x 0.70.
GpuRates h100_rates() {
  GpuRates g = h200_rates();
  g.name = "h100";
  constexpr double kHbmRatio = 3.35 / 4.8;
  g.hbm_gbps *= kHbmRatio;
  g.cross_entropy_per_s *= kHbmRatio;
  g.fp8_quant_per_s *= kHbmRatio;
  g.fp8_weight_quant_per_s *= kHbmRatio;
  g.memory_gib = 74.5;  // of 80 GB, as docs/benchmarks.md plans Megatron-Core's H100 layouts
  return g;
}

// The global efficiencies (one set for every configuration):
// - memory-bound elementwise kernels (norms, RoPE, permutation, SwiGLU, residual adds) reach half of
//   the copy bandwidth: "GPU kernel leads" has RMSNorm forward at 0.72, its backward 0.35, RoPE 0.28;
//   the dispatch/combine stages of the qwen3 layer move their bytes at 0.5-0.7.
constexpr double kElementwiseEfficiency = 0.5;
// - all-to-all within a node: NCCL's bus bandwidth at 256 MiB per rank between two H200s was
//   258 GB/s of the 478 GB/s NVLink ("Communication, 2 x H200": the size a qwen3-30b-a3b layer
//   dispatches): 0.54 of the link.
constexpr double kAllToAllEfficiency = 258.0 / 478;
// - all-to-all between nodes: 0.8 of each GPU's NIC. Not measured here (no multi-node machine):
//   the usual share of a 400 Gb/s InfiniBand NIC that NCCL's and DeepEP's inter-node exchanges reach.
constexpr double kInterNodeAllToAllEfficiency = 0.8;
// - ring collectives (all-gather, reduce-scatter, all-reduce of gradients and parameters): 0.8 of
//   the link (not measured here: NCCL's usual bus bandwidth on NVLink and InfiniBand).
constexpr double kRingEfficiency = 0.8;
// - a collective's fixed cost (launch and synchronisation), per call.
constexpr double kCollectiveLatencyMs = 0.03;
// - a fixed cost per layer and micro-batch, forward + backward, whatever the work: the kernels'
//   launches and tails. The tiny preset's step is all of it ("GPU: training through the CLI": 4.06-4.94
//   ms per step, host-bound, for 2 micro-batches x (4 layers + the head)): ~0.45 ms each.
constexpr double kLayerOverheadMs = 0.45;
// - collectives hidden behind computation still slow it: NCCL's kernels take SMs and HBM bandwidth.
//   "Two GPUs: training steps at EP = 2 and DP = 2": with the DP = 2 gradient all-reduce overlapped,
//   the backward grew from 79.1 to 94.7 ms while about 21 ms of all-reduce hid behind it; half of
//   the hidden time is charged to the step.
constexpr double kOverlapContention = 0.5;
// - optimizer offload: ~4.6 G elements/s ("Optimizer offload": PCIe copies and the host update).
constexpr double kOffloadElementsPerS = 4.6e9;

double bytes_ms(double bytes, double gbps) { return gbps > 0 ? bytes / (gbps * 1e9) * 1e3 : 0; }
double flops_ms(double flops, double tflops) { return flops / (tflops * 1e12) * 1e3; }

int64_t parse_count(const std::string& text, const char* flag) {
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < 1 || v > 1024)
    MF_FAIL(flag, " ", text, ": expected a whole number of GPUs from 1 to 1024");
  return v;
}

double parse_gbps(const std::string& text, const char* flag) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !(v > 0) || !std::isfinite(v))
    MF_FAIL(flag, " ", text, ": expected a bandwidth in GB/s per GPU and direction, such as 450");
  return v;
}

// What one rank computes per micro-batch, by part, forward / backward / recomputed forward (ms).
struct Part {
  const char* name;
  double fwd = 0, bwd = 0, recompute = 0;
  double total() const { return fwd + bwd + recompute; }
};

// The per-token sizes and per-rank share the ops below are written in.
struct OpShape {
  const Config& cfg;
  const ParallelConfig& l;
  const GpuRates& g;
  ModelFlops f;
  Recompute rc;
  Fp8Linears fp8;
  double tau;      // tokens of a micro-batch whose work one rank does: mbs * S / (cp * tp)
  double ew_gbps;  // elementwise kernels' bandwidth
};

double dense_rate(const OpShape& s, bool fp8) { return fp8 ? s.g.fp8_dense_tflops : s.g.dense_tflops; }

// Bytes an elementwise op moves per token are counted in bf16 elements read + written.
double ew_ms(const OpShape& s, double elements_per_token) {
  return bytes_ms(2.0 * elements_per_token * s.tau, s.ew_gbps);
}

// One FP8 linear's activation quantizations per token (x rows forward; dy rows, x and dy along the
// tokens for the backward): two passes over its input and two over its output gradient.
double fp8_quant_ms(const OpShape& s, double in, double out) {
  return (2 * in + 2 * out) * s.tau / s.g.fp8_quant_per_s * 1e3;
}

// The attention block of one layer: projections, core, norms / RoPE / residual.
void attention_parts(const OpShape& s, bool recompute_layer, std::vector<Part>& parts) {
  const ModelConfig& m = s.cfg.model;
  const double h = static_cast<double>(m.hidden_size), q = static_cast<double>(m.num_attention_heads);
  Part proj{"attention projections"}, core{"attention core"}, ew{"norms, RoPE, residual (attention)"};
  const bool fp8 = s.fp8.qkv;
  proj.fwd = flops_ms(s.f.attn_proj * s.tau, dense_rate(s, fp8));
  proj.bwd = 2 * proj.fwd;
  if (fp8) proj.fwd += fp8_quant_ms(s, 2 * h, 2 * h);  // input and output widths, roughly H each way
  // cuDNN's rates count the padded core (MLA's v padded to the q/k width) and a backward of 2.5 x
  // the forward's FLOPs (bench_attention's convention).
  const double pad = m.is_mla() ? 2.0 * m.qk_head_dim() / (m.qk_head_dim() + m.v_head_dim) : 1.0;
  const bool det = s.cfg.kernels.deterministic_attention;
  const double fwd_rate = m.is_mla() ? s.g.mla_fwd_tflops : s.g.attn_fwd_tflops;
  const double bwd_rate = m.is_mla() ? (det ? s.g.mla_bwd_tflops : s.g.mla_bwd_nondet_tflops)
                                     : (det ? s.g.attn_bwd_tflops : s.g.attn_bwd_nondet_tflops);
  core.fwd = flops_ms(s.f.attn_core * pad * s.tau, fwd_rate);
  core.bwd = flops_ms(2.5 * s.f.attn_core * pad * s.tau, bwd_rate);
  double elems = 5 * h;  // the input norm (read, write) and the residual add (two reads, a write)
  if (m.is_mla()) {
    const double rope = static_cast<double>(m.qk_rope_head_dim);
    elems += 2.0 * (m.q_lora_rank + m.kv_lora_rank) + 2 * q * rope + 2 * rope +
             q * (2.0 * m.qk_head_dim() + m.v_head_dim) / static_cast<double>(s.l.tp);
  } else {
    const double qkv = (q + 2.0 * m.num_key_value_heads) * m.head_dim / static_cast<double>(s.l.tp);
    elems += (m.architecture == "mixtral" ? 2 : 4) * qkv;  // RoPE (+ the q/k norms)
  }
  ew.fwd = ew_ms(s, elems);
  ew.bwd = 2 * ew.fwd;
  if (recompute_layer) {
    proj.recompute = proj.fwd;
    core.recompute = core.fwd;
    ew.recompute = ew.fwd;
  } else {
    if (s.rc.core_attn) core.recompute = core.fwd;
    if (s.rc.layernorm) ew.recompute = ew_ms(s, 2 * h);
    if (s.rc.mla_up_proj && m.is_mla()) {  // the up projections (most of MLA's projection FLOPs) and RoPE
      const double up =
          2.0 * (m.q_lora_rank * q * m.qk_head_dim() + m.kv_lora_rank * q * (m.qk_nope_head_dim + m.v_head_dim));
      proj.recompute = flops_ms(up * s.tau / static_cast<double>(s.l.tp), dense_rate(s, fp8));
    }
  }
  parts.push_back(proj);
  parts.push_back(core);
  parts.push_back(ew);
}

// The f32 (or bf16) main-gradient traffic of a GEMM's weight gradient per micro-batch: written by
// the first micro-batch of a step, read and written by the others (the epilogue accumulates).
double grad_pass_ms(const OpShape& s, double params, int64_t micro) {
  const double gb = s.cfg.train.main_grads_dtype == "bf16" ? 2 : 4;
  const double passes = (1.0 + 2.0 * static_cast<double>(micro - 1)) / static_cast<double>(micro);
  return bytes_ms(params * gb * passes, s.g.hbm_gbps);
}

// The MoE block of one layer (router, permutation, experts, SwiGLU, unpermutation, shared experts).
// local_expert_params: this rank's expert weights (their gradient traffic).
void moe_parts(const OpShape& s, bool recompute_layer, double local_expert_params, int64_t micro,
               std::vector<Part>& parts) {
  const MoeConfig& e = s.cfg.moe;
  const double h = static_cast<double>(s.cfg.model.hidden_size), k = static_cast<double>(e.num_experts_per_tok),
               f = static_cast<double>(e.moe_intermediate_size);
  Part router{"router"}, experts{"experts (grouped GEMMs)"}, ew{"permute, SwiGLU, unpermute, norm"},
      shared{"shared experts"};
  router.fwd = flops_ms(s.f.router * s.tau, s.g.dense_tflops) + ew_ms(s, 6.0 * e.num_experts);
  router.bwd = 2 * router.fwd;
  // Balanced routing: every rank's experts receive tau x K rows per micro-batch.
  const double rate = s.fp8.experts ? s.g.fp8_grouped_tflops : s.g.grouped_tflops;
  experts.fwd = flops_ms(s.f.experts * s.tau, rate);
  experts.bwd = 2 * experts.fwd + grad_pass_ms(s, local_expert_params, micro);
  if (s.fp8.experts) {                   // fc1 (H -> 2F) and fc2 (F -> H) on K rows per token
    const bool packed = e.fp8_dispatch;  // the tokens quantized once before the permutation
    experts.fwd += fp8_quant_ms(s, k * (packed ? 0.5 : 1) * h + k * f, k * 2 * f + k * h);
  }
  // Norm + residual (5H), permutation (read H, write KH), unpermutation (read KH, write H); the
  // SwiGLU (read 2F, write F per row) runs apart only forward at H > 2048 (the measured rule:
  // fused into fc1's epilogue forward at H <= 2048, into fc2's data-gradient epilogue backward).
  const double swiglu = 3 * k * f;
  ew.fwd = ew_ms(s, 7 * h + 2 * k * h + (h <= 2048 ? 0 : swiglu));
  ew.bwd = 2 * ew_ms(s, 7 * h + 2 * k * h);
  if (e.n_shared_experts > 0) {
    shared.fwd = flops_ms(s.f.shared_experts * s.tau, dense_rate(s, s.fp8.shared_experts)) +
                 ew_ms(s, 3.0 * f * e.n_shared_experts / static_cast<double>(s.l.tp));
    shared.bwd = 2 * shared.fwd;
  }
  if (recompute_layer || s.rc.moe) {
    router.recompute = router.fwd;
    experts.recompute = experts.fwd;
    ew.recompute = ew.fwd;
  } else {
    if (s.rc.moe_act) ew.recompute = ew_ms(s, swiglu);
    if (s.rc.layernorm) ew.recompute += ew_ms(s, 2 * h);
  }
  if (recompute_layer || s.rc.shared_experts || s.rc.moe) shared.recompute = shared.fwd;
  parts.push_back(router);
  parts.push_back(experts);
  parts.push_back(ew);
  if (e.n_shared_experts > 0) parts.push_back(shared);
}

void dense_mlp_parts(const OpShape& s, bool recompute_layer, std::vector<Part>& parts) {
  const double h = static_cast<double>(s.cfg.model.hidden_size),
               inter = static_cast<double>(s.cfg.model.intermediate_size);
  Part mlp{"dense MLP"};
  mlp.fwd = flops_ms(s.f.dense_mlp * s.tau, dense_rate(s, s.fp8.mlp)) +
            ew_ms(s, 7 * h + 3 * inter / static_cast<double>(s.l.tp));
  if (s.fp8.mlp) mlp.fwd += fp8_quant_ms(s, h + inter, 2 * inter + h);
  mlp.bwd = 2 * mlp.fwd;
  if (recompute_layer || s.rc.mlp) mlp.recompute = mlp.fwd;
  parts.push_back(mlp);
}

// The LM head and its cross-entropy (vocabulary-parallel over TP: tau x V pairs per rank).
// Its weight gradient and the embedding's (tp-sharded: embed_params) accumulate like the others'.
void head_parts(const OpShape& s, double embed_params, int64_t micro, std::vector<Part>& parts) {
  Part head{"LM head + cross-entropy"}, grads{"dense weight gradients (accumulate)"}, launch{"kernel launches"};
  head.fwd = flops_ms(s.f.lm_head * s.tau, s.g.dense_tflops);
  head.bwd = 2 * head.fwd + s.tau * static_cast<double>(s.cfg.model.vocab_size) / s.g.cross_entropy_per_s * 1e3;
  grads.bwd = grad_pass_ms(s, 2 * embed_params, micro);
  launch.bwd = kLayerOverheadMs;
  parts.push_back(head);
  parts.push_back(grads);
  parts.push_back(launch);
}

double sum(const std::vector<Part>& parts) {
  double t = 0;
  for (const Part& p : parts) t += p.total();
  return t;
}

// One all-to-all (dispatch or combine, either direction) of one MoE layer and micro-batch: the
// slower of its NVLink and inter-node traffic (both run at once), ms.
struct A2a {
  double ms = 0, intra_bytes = 0, inter_bytes = 0;
};
A2a ep_all_to_all(const OpShape& s, const Cluster& c, double row_bytes) {
  A2a a;
  const ParallelConfig& l = s.l;
  if (l.ep == 1) return a;
  const double ep = static_cast<double>(l.ep), k = static_cast<double>(s.cfg.moe.num_experts_per_tok);
  // The MoE view puts ETP innermost, then EP: an EP group has gpn / etp ranks per node.
  const int64_t per_node = std::clamp<int64_t>(c.gpus_per_node / l.etp, 1, l.ep);
  const double g = static_cast<double>(per_node), nodes = ep / g;
  const double rows = s.tau * k;  // this rank's (token, expert) rows
  if (s.cfg.moe.dispatcher == "slots") {
    // Fixed slots: every peer gets B rows whatever the routing (SlotDispatcher::slot_rows).
    const auto slot = static_cast<double>(
        SlotDispatcher::slot_rows(s.cfg.moe, static_cast<int64_t>(std::ceil(s.tau)), static_cast<int>(l.ep)));
    a.intra_bytes = slot * (g - 1) * row_bytes;
    a.inter_bytes = slot * (ep - g) * row_bytes;
  } else if (s.cfg.moe.dispatcher == "hierarchical" && nodes > 1) {
    // Each token crosses to each other node holding one of its experts once, then fans out there
    // over NVLink; the rows for this node's other ranks go over NVLink directly.
    const double remote =
        expected_remote_nodes(s.cfg.moe.num_experts, s.cfg.moe.num_experts_per_tok, static_cast<int64_t>(nodes));
    a.inter_bytes = s.tau * remote * row_bytes;
    a.intra_bytes = rows * (g - 1) / ep * row_bytes + rows * (ep - g) / ep * (g - 1) / g * row_bytes;
  } else {
    a.intra_bytes = rows * (g - 1) / ep * row_bytes;
    a.inter_bytes = rows * (ep - g) / ep * row_bytes;
  }
  a.ms = kCollectiveLatencyMs + std::max(bytes_ms(a.intra_bytes, c.nvlink_gbps * kAllToAllEfficiency),
                                         bytes_ms(a.inter_bytes, c.internode_gbps * kInterNodeAllToAllEfficiency));
  return a;
}

// A ring collective moving `bytes` per rank over a group of n ranks whose members are `stride`
// world ranks apart (all-gather or reduce-scatter: (n-1)/n of the data; an all-reduce is both).
double ring_ms(double bytes, int64_t n, int64_t stride, const Cluster& c) {
  if (n <= 1) return 0;
  const bool crosses = n * stride > c.gpus_per_node;
  const double link = crosses ? c.internode_gbps : c.nvlink_gbps;
  return kCollectiveLatencyMs +
         bytes_ms(bytes * static_cast<double>(n - 1) / static_cast<double>(n), link * kRingEfficiency);
}

// Parameters of one layer (non-expert and expert) and of the embedding / head.
struct LayerParams {
  double attn = 0, moe_rest = 0, experts = 0, dense_mlp = 0, embed = 0, mtp = 0;
};
LayerParams layer_params(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  const MoeConfig& e = cfg.moe;
  const double h = static_cast<double>(m.hidden_size);
  const ModelFlops f = model_flops(m, e, cfg.train.seq_len);
  LayerParams p;
  p.attn = f.attn_proj / 2 + 2 * h;
  p.moe_rest = h * static_cast<double>(e.num_experts) + 3.0 * h * e.moe_intermediate_size * e.n_shared_experts;
  p.experts = 3.0 * h * e.moe_intermediate_size * e.num_experts;
  p.dense_mlp = 3.0 * h * m.intermediate_size;
  p.embed = h * static_cast<double>(m.vocab_size);
  p.mtp = static_cast<double>(m.num_nextn_predict_layers) * (p.attn + p.moe_rest + p.experts + 2 * h * h);
  return p;
}

}  // namespace

std::vector<std::string> cluster_kinds() { return {"h200", "h100"}; }

Cluster make_cluster(const ClusterOptions& o) {
  Cluster c;
  if (o.kind == "h200") {
    c.gpu = h200_rates();
    c.nvlink_gbps = 478;  // "Communication, 2 x H200": 18 NVLinks x 26.6 GB/s per direction
  } else if (o.kind == "h100") {
    c.gpu = h100_rates();
    c.nvlink_gbps = 450;  // NVLink 4 datasheet: 900 GB/s both directions together
  } else {
    MF_FAIL("--cluster ", o.kind, ": expected h200 or h100");
  }
  c.gpus_per_node = 8;
  c.internode_gbps = 50;  // one 400 Gb/s InfiniBand NIC per GPU (DGX H100 / H200)
  if (!o.gpus_per_node.empty()) c.gpus_per_node = parse_count(o.gpus_per_node, "--gpus-per-node");
  if (!o.nvlink_gbps.empty()) c.nvlink_gbps = parse_gbps(o.nvlink_gbps, "--nvlink-gbps");
  if (!o.internode_gbps.empty()) c.internode_gbps = parse_gbps(o.internode_gbps, "--internode-gbps");
  return c;
}

double expected_remote_nodes(int64_t experts, int64_t k, int64_t nodes) {
  MF_CHECK(nodes >= 1 && experts % nodes == 0 && k >= 1 && k <= experts, "experts ", experts, " k ", k, " nodes ",
           nodes);
  // P(none of the K experts on one given node of E / nodes experts) = C(E - E/n, K) / C(E, K).
  const int64_t per = experts / nodes;
  double none = 1;
  for (int64_t i = 0; i < k; ++i)
    none *= static_cast<double>(std::max<int64_t>(experts - per - i, 0)) / static_cast<double>(experts - i);
  return static_cast<double>(nodes - 1) * (1 - none);
}

double bubble_fraction(int64_t pp, int64_t vpp, int64_t micro_batches) {
  return static_cast<double>(pp - 1) / (static_cast<double>(micro_batches) * static_cast<double>(vpp));
}

double predict_moe_layer_ms(const Config& cfg, int64_t tokens, const Cluster& cluster) {
  Config c = cfg;
  c.train.micro_batch_size = 1;
  c.train.seq_len = tokens;
  const ParallelConfig l = ParallelConfig{}.resolve(1);
  OpShape s{c,
            l,
            cluster.gpu,
            model_flops(c.model, c.moe, tokens),
            Recompute{},
            c.train.fp8_linears(),
            static_cast<double>(tokens),
            cluster.gpu.hbm_gbps * kElementwiseEfficiency};
  std::vector<Part> parts;
  moe_parts(s, false, layer_params(c).experts, 1, parts);
  // bench moe-layer times the block alone: no norm or residual (5 H of the 7 H counted above).
  return sum(parts) - 3 * ew_ms(s, 5.0 * c.model.hidden_size);
}

PerfPrediction predict_step(const Config& cfg, int64_t world, const Cluster& cluster) {
  PerfPrediction out;
  const ParallelConfig l = cfg.resolve_layout(world);
  out.layout = l;
  const TrainConfig& t = cfg.train;
  const int64_t micro = t.global_batch_size / (t.micro_batch_size * l.dp);
  out.micro_batches = micro;
  OpShape s{cfg,
            l,
            cluster.gpu,
            model_flops(cfg.model, cfg.moe, t.seq_len),
            t.recompute(),
            t.fp8_linears(),
            static_cast<double>(t.micro_batch_size * t.seq_len) / static_cast<double>(l.cp * l.tp),
            cluster.gpu.hbm_gbps * kElementwiseEfficiency};
  const ModelConfig& m = cfg.model;
  const double h = static_cast<double>(m.hidden_size);
  const LayerParams lp = layer_params(cfg);
  const double expert_shard = static_cast<double>(l.ep * l.etp);
  const double tp = static_cast<double>(l.tp);

  // Per layer kind, per micro-batch: compute parts, and the layer's communication.
  auto layer_parts = [&](bool dense, bool recompute_layer) {
    std::vector<Part> parts;
    attention_parts(s, recompute_layer, parts);
    if (dense)
      dense_mlp_parts(s, recompute_layer, parts);
    else
      moe_parts(s, recompute_layer, lp.experts / expert_shard, micro, parts);
    // Every weight's gradient (the experts' are counted with them) and the layer's fixed cost;
    // a layer recomputed whole launches its forward's kernels again (a third of them).
    Part grads{"dense weight gradients (accumulate)"}, launch{"kernel launches"};
    grads.bwd = grad_pass_ms(s, (lp.attn + (dense ? lp.dense_mlp : lp.moe_rest)) / tp, micro);
    launch.fwd = kLayerOverheadMs / 3;
    launch.bwd = kLayerOverheadMs * 2 / 3;
    if (recompute_layer) launch.recompute = launch.fwd;
    parts.push_back(grads);
    parts.push_back(launch);
    return parts;
  };
  // Expert parallelism: 4 all-to-alls per MoE layer (dispatch, combine; their gradients), 2 more
  // when the MoE block is recomputed. Rows are bf16 (FP8 dispatch: 1 byte + a scale per 128).
  const double row = 2 * h, row_fp8 = h + h / 128 * 4;
  const bool fp8_rows = cfg.moe.fp8_dispatch && s.fp8.experts;
  const A2a dispatch = ep_all_to_all(s, cluster, fp8_rows ? row_fp8 : row), other = ep_all_to_all(s, cluster, row);
  // Tensor parallelism with sequence parallelism: an all-gather before and a reduce-scatter after
  // each block (attention; the dense MLP), forward and backward, of the micro-batch's tokens.
  // Not overlapped. ETP: the same around the experts over the ETP group.
  const double tokens_cp = static_cast<double>(t.micro_batch_size * t.seq_len) / static_cast<double>(l.cp);
  const double tp_block = 4 * ring_ms(tokens_cp * row, l.tp, 1, cluster);
  const double etp_block = 4 * ring_ms(tokens_cp / tp * static_cast<double>(l.etp) * row, l.etp, 1, cluster);
  // Context parallelism: K and V chunks passed around the ring (cp - 1 hops forward, K, V and their
  // gradients backward), overlapped with the attention core.
  double cp_bytes = 0;
  if (l.cp > 1) {
    const double kv = m.is_mla() ? m.num_attention_heads * (m.qk_head_dim() + m.v_head_dim)
                                 : 2.0 * m.num_key_value_heads * m.head_dim;
    cp_bytes = 3.0 * static_cast<double>(l.cp - 1) * tokens_cp * kv / tp * 2;
  }
  const double cp_ms = l.cp > 1 ? kCollectiveLatencyMs * 3 * static_cast<double>(l.cp - 1) +
                                      bytes_ms(cp_bytes, (l.cp * l.tp > cluster.gpus_per_node ? cluster.internode_gbps
                                                                                              : cluster.nvlink_gbps) *
                                                             kRingEfficiency)
                                : 0;

  struct LayerTime {
    double compute = 0, a2a = 0, a2a_exposed = 0, tp = 0, cp = 0, cp_exposed = 0;
    std::vector<Part> parts;
  };
  auto layer_time = [&](bool dense, bool recompute_layer) {
    LayerTime lt;
    lt.parts = layer_parts(dense, recompute_layer);
    lt.compute = sum(lt.parts);
    double core = 0, experts = 0, shared = 0;
    for (const Part& p : lt.parts) {
      if (std::string(p.name) == "attention core") core = p.total();
      if (std::string(p.name) == "experts (grouped GEMMs)") experts = p.total();
      if (std::string(p.name) == "shared experts") shared = p.total();
    }
    lt.tp = tp_block * (dense ? 2 : 1) + (dense ? 0 : etp_block);
    if (recompute_layer) lt.tp *= 1.25;  // the recomputed forward gathers again
    lt.cp = cp_ms;
    lt.cp_exposed = std::max(0.0, cp_ms - core);
    if (!dense && l.ep > 1) {
      const bool again = recompute_layer || s.rc.moe;
      lt.a2a = dispatch.ms + 3 * other.ms + (again ? dispatch.ms + other.ms : 0);
      // Overlap: with parallel.overlap_moe_a2a one micro-batch's all-to-alls run beside another's
      // computation of the same layer (Megatron-Core's 1F1B overlap): exposed only past that
      // compute. Without it the dispatcher's rounds (moe.ep_overlap_chunks = c) hide all but the
      // first round of each exchange behind the experts' GEMMs of the rounds already received
      // (the slot dispatcher has no rounds).
      if (cfg.parallel.overlap_moe_a2a) {
        lt.a2a_exposed = std::max(0.0, lt.a2a - lt.compute);
      } else if (cfg.moe.dispatcher == "slots") {  // not pipelined: the experts wait for every row
        lt.a2a_exposed = lt.a2a;
      } else {
        const double c = static_cast<double>(std::max<int64_t>(cfg.moe.ep_overlap_chunks, 1));
        lt.a2a_exposed = lt.a2a / c + std::max(0.0, lt.a2a * (c - 1) / c - experts);
      }
      // moe.shared_expert_overlap: the shared experts run on their own stream while the exchanges
      // wait (their forward beside the dispatch and combine, their backward beside the gradients').
      if (cfg.moe.shared_expert_overlap) lt.a2a_exposed = std::max(0.0, lt.a2a_exposed - shared);
    }
    return lt;
  };

  // The stages: each one's layers (dense or MoE; whole-layer recompute by method), the first's
  // embedding, the last's head and MTP.
  const std::vector<int64_t> virt = l.stage_layers(m.num_hidden_layers);
  const Recompute& rc = s.rc;
  struct Stage {
    double mb_ms = 0;          // one micro-batch, forward + backward, with its exposed communication
    double fwd_ms = 0;         // its forward alone (the parameter gathers hide behind it)
    double params_dense = 0;   // this rank's non-expert parameters
    double params_expert = 0;  // this rank's expert parameters
    int64_t layers = 0;
    std::vector<Part> parts;  // summed over its layers, per micro-batch
    double a2a = 0, a2a_exposed = 0, tpc = 0, cpc = 0, cp_exposed = 0;
    int64_t moe_layers = 0, dense_layers = 0;
  };
  std::vector<Stage> stages(static_cast<size_t>(l.pp));
  const LayerTime moe_plain = layer_time(false, false), dense_plain = layer_time(true, false);
  const LayerTime moe_whole = layer_time(false, true), dense_whole = layer_time(true, true);
  out.moe_layer_ms = moe_plain.compute;
  out.dense_layer_ms = m.first_k_dense_replace > 0 || !m.mlp_only_layers.empty() ? dense_plain.compute : 0;
  auto add_parts = [](std::vector<Part>& into, const std::vector<Part>& from) {
    for (const Part& p : from) {
      auto it = std::find_if(into.begin(), into.end(), [&](const Part& q) { return std::string(q.name) == p.name; });
      if (it == into.end()) {
        into.push_back(p);
      } else {
        it->fwd += p.fwd;
        it->bwd += p.bwd;
        it->recompute += p.recompute;
      }
    }
  };
  int64_t layer = 0;
  for (size_t v = 0; v < virt.size(); ++v) {
    Stage& st = stages[v % static_cast<size_t>(l.pp)];
    for (int64_t i = 0; i < virt[v]; ++i, ++layer) {
      const bool dense = m.is_dense_layer(layer);
      // Whole layers: uniform recomputes every layer (chunks of num_layers); block the first
      // num_layers of each stage.
      const bool whole = rc.num_layers > 0 && (!rc.block || st.layers < rc.num_layers);
      const LayerTime& lt = dense ? (whole ? dense_whole : dense_plain) : (whole ? moe_whole : moe_plain);
      add_parts(st.parts, lt.parts);
      st.mb_ms += lt.compute + lt.a2a_exposed + lt.tp + lt.cp_exposed;
      st.fwd_ms += lt.compute / 3;
      st.a2a += lt.a2a;
      st.a2a_exposed += lt.a2a_exposed;
      st.tpc += lt.tp;
      st.cpc += lt.cp;
      st.cp_exposed += lt.cp_exposed;
      st.params_dense += (lp.attn + (dense ? lp.dense_mlp : lp.moe_rest)) / tp;
      st.params_expert += dense ? 0 : lp.experts / expert_shard;
      ++st.layers;
      ++(dense ? st.dense_layers : st.moe_layers);
    }
  }
  stages.front().params_dense += lp.embed / tp;
  {  // the last stage: LM head, cross-entropy, MTP (a MoE layer, eh_proj and the head again per depth)
    Stage& last = stages.back();
    std::vector<Part> head;
    head_parts(s, lp.embed / tp, micro, head);
    double head_ms = sum(head);
    for (int64_t d = 0; d < m.num_nextn_predict_layers; ++d) {
      Part proj{"MTP projection"};
      proj.fwd = flops_ms(s.f.mtp_proj * s.tau, dense_rate(s, s.fp8.mtp));
      proj.bwd = 2 * proj.fwd;
      add_parts(last.parts, moe_plain.parts);
      last.mb_ms += moe_plain.compute + moe_plain.a2a_exposed + moe_plain.tp + moe_plain.cp_exposed;
      last.a2a += moe_plain.a2a;
      last.a2a_exposed += moe_plain.a2a_exposed;
      head_ms += proj.total() + sum(head);
      add_parts(last.parts, {proj});
      add_parts(last.parts, head);
    }
    add_parts(last.parts, head);
    last.mb_ms += head_ms;
    last.fwd_ms += head_ms / 3;
    last.params_dense += (lp.embed + lp.mtp - static_cast<double>(m.num_nextn_predict_layers) * lp.experts) / tp;
    last.params_expert += static_cast<double>(m.num_nextn_predict_layers) * lp.experts / expert_shard;
    out.head_ms = head_ms;
  }
  // Pipeline: the activations (and their gradients) sent between stages run on their own
  // channel beside the computation: not exposed.
  const double p2p_ms = l.pp > 1 ? 2 * ring_ms(s.tau * row * 2, 2, static_cast<int64_t>(world / l.pp), cluster) : 0;

  // Per step, each stage: its micro-batches, the gradient reduction and parameter gathers, the
  // optimizer. The slowest stage sets the step.
  const double gb = t.main_grads_dtype == "bf16" ? 2 : 4;
  const double dense_n = static_cast<double>(l.dp * l.cp);  // ranks reducing a TP shard's gradients
  const int64_t edp = l.edp();
  const bool dist = cfg.parallel.distributed_optimizer;
  double best = -1;
  for (size_t i = 0; i < stages.size(); ++i) {
    const Stage& st = stages[i];
    // Gradients: reduce-scatter (distributed optimizer) or all-reduce over DP x CP (dense) and EDP
    // (experts), in the main gradients' dtype; then the updated bf16 weights all-gathered, or with
    // train.fp8_param the FP8 linears' codes (a byte an element; their scales are ~0.01% more).
    const int64_t dn = l.dp * l.cp;
    const double rs =
        ring_ms(st.params_dense * gb, dn, l.tp, cluster) + ring_ms(st.params_expert * gb, edp, l.ep * l.etp, cluster);
    // The FP8 linears' weights (dense, experts).
    double fp8_dense = 0;
    const double fp8_expert = s.fp8.experts ? st.params_expert : 0;
    if (s.fp8.qkv) fp8_dense += static_cast<double>(st.layers) * lp.attn / tp;
    if (s.fp8.shared_experts || s.fp8.mlp) fp8_dense += st.params_dense - static_cast<double>(st.layers) * lp.attn / tp;
    fp8_dense = std::clamp(fp8_dense, 0.0, st.params_dense);
    const double codes = t.fp8_param ? 1 : 0;  // bytes each FP8 weight element saves in the gather
    const double ag = ring_ms(st.params_dense * 2 - codes * fp8_dense, dn, l.tp, cluster) +
                      ring_ms(st.params_expert * 2 - codes * fp8_expert, edp, l.ep * l.etp, cluster);
    const double grad_ms = dist ? rs : 2 * rs, gather_ms = dist ? ag : 0;
    // Overlap (parallel.overlap_grad_reduce / overlap_param_gather): each layer's reduction starts
    // as its backward ends in the step's last micro-batch, so all but the last layer's hides behind
    // the rest of that backward; the gathers behind the next step's first forward, likewise.
    const double layers = static_cast<double>(std::max<int64_t>(st.layers, 1));
    const double bwd = st.mb_ms - st.fwd_ms;
    auto hidden_behind = [&](double comm, double compute) {  // exposed: the last layer's part, any excess
      const double exposed = comm / layers + std::max(0.0, comm * (1 - 1 / layers) - compute);
      return exposed + kOverlapContention * (comm - exposed);
    };
    const double grad_exposed = cfg.parallel.overlap_grad_reduce ? hidden_behind(grad_ms, bwd) : grad_ms;
    const double gather_exposed = cfg.parallel.overlap_param_gather ? hidden_behind(gather_ms, st.fwd_ms) : gather_ms;
    // AdamW (memory-bound): per element of this rank's optimizer shard, the f32 master read and
    // written, both moments read and written, the gradient read, the bf16 copy written; and the
    // gradient norm's pass over the gradients. "AdamW 40.3 ms" for 5.6 G elements (8 layers of
    // qwen3-30b-a3b) is 4.2 TB/s at these 30 bytes.
    const double shard_dense = dist ? st.params_dense / dense_n : st.params_dense;
    const double shard_expert = dist ? st.params_expert / static_cast<double>(edp) : st.params_expert;
    const double elems = shard_dense + shard_expert;
    const double moments = (t.exp_avg_dtype == "bf16" ? 4 : 8) + (t.exp_avg_sq_dtype == "bf16" ? 4 : 8);
    const double offloaded = dist ? elems * t.optimizer_offload_fraction : 0;
    double opt_ms = bytes_ms((elems - offloaded) * (8 + moments + gb + 2) + elems * gb, cluster.gpu.hbm_gbps) +
                    offloaded / kOffloadElementsPerS * 1e3;
    // FP8: the FP8 linears' weights quantized once per step.
    const double quant_ms = (fp8_dense + fp8_expert) / cluster.gpu.fp8_weight_quant_per_s * 1e3;
    const double mb = st.mb_ms;
    const double bubble = l.pp > 1 ? bubble_fraction(l.pp, l.vpp, micro) * static_cast<double>(micro) * mb : 0;
    const double step = static_cast<double>(micro) * mb + bubble + grad_exposed + gather_exposed + opt_ms + quant_ms;
    if (step <= best) continue;
    best = step;
    out.slowest_stage = static_cast<int64_t>(i);
    out.compute.clear();
    out.communication.clear();
    const double m_d = static_cast<double>(micro);
    for (const Part& p : st.parts) out.compute.push_back({p.name, p.total() * m_d, p.total() * m_d, ""});
    out.compute.push_back({"optimizer (AdamW, gradient norm)", opt_ms, opt_ms, ""});
    if (quant_ms > 0) out.compute.push_back({"FP8 weight quantization", quant_ms, quant_ms, ""});
    auto comm = [&](const char* name, double ms, double exposed, const char* how) {
      if (ms > 0) out.communication.push_back({name, ms, exposed, how});
    };
    const std::string a2a_how =
        std::string(cfg.parallel.overlap_moe_a2a ? "beside the other micro-batch's layer (overlap_moe_a2a)"
                                                 : "rounds beside the experts' GEMMs (ep_overlap_chunks)") +
        (cfg.moe.shared_expert_overlap ? " and the shared experts (shared_expert_overlap)" : "");
    comm("expert all-to-all (EP)", st.a2a * m_d, st.a2a_exposed * m_d, a2a_how.c_str());
    comm("tensor-parallel gathers (TP, ETP)", st.tpc * m_d, st.tpc * m_d, "not overlapped");
    comm("context-parallel K/V ring (CP)", st.cpc * m_d, st.cp_exposed * m_d, "beside the attention core");
    comm(dist ? "gradient reduce-scatter (DP, EDP)" : "gradient all-reduce (DP, EDP)", grad_ms, grad_exposed,
         cfg.parallel.overlap_grad_reduce ? "beside the last micro-batch's backward" : "after the backward");
    comm("parameter all-gather (distributed optimizer)", gather_ms, gather_exposed,
         cfg.parallel.overlap_param_gather ? "beside the next forward" : "after the update");
    comm("pipeline send/recv (PP)", p2p_ms * m_d, 0, "own channel, beside the computation");
    out.bubble_ms = bubble;
    out.step_ms = step;
  }
  const double tokens = static_cast<double>(t.global_batch_size * t.seq_len);
  out.tokens_per_s = tokens / (out.step_ms / 1e3);
  out.tflops_per_gpu =
      model_size(m, cfg.moe, t.seq_len).train_flops_per_token * out.tokens_per_s / static_cast<double>(world) / 1e12;
  return out;
}

std::vector<LayoutCandidate> search_layouts(const Config& cfg, int64_t world, const Cluster& cluster, int top,
                                            SearchStats* stats) {
  SearchStats st;
  std::vector<LayoutCandidate> all;
  auto divisors = [](int64_t n, int64_t limit) {
    std::vector<int64_t> d;
    for (int64_t i = 1; i <= std::min(n, limit); ++i)
      if (n % i == 0) d.push_back(i);
    return d;
  };
  const ModelConfig& m = cfg.model;
  for (const int64_t pp : divisors(world, m.num_hidden_layers))
    for (const int64_t vpp : {int64_t{1}, int64_t{2}, int64_t{4}})
      for (const int64_t tp : divisors(cluster.gpus_per_node, m.num_attention_heads))
        for (const int64_t cp : {int64_t{1}, int64_t{2}, int64_t{4}})
          for (const int64_t ep : divisors(cfg.moe.num_experts, world))
            for (const int64_t etp : {int64_t{1}, int64_t{2}, int64_t{4}})
              for (const int64_t mbs : {int64_t{1}, int64_t{2}, int64_t{4}})
                for (const char* dispatcher : {"alltoall", "hierarchical"}) {
                  if ((pp == 1 && vpp > 1) || world % (pp * tp * cp) != 0) continue;
                  Config c = cfg;
                  ParallelConfig& p = c.parallel;
                  p.pp = pp;
                  p.vpp = vpp;
                  p.tp = tp;
                  p.cp = cp;
                  p.ep = ep;
                  p.etp = etp;
                  p.dp = 0;
                  p.first_stage_layers = p.last_stage_layers = 0;
                  if (pp > 1 && vpp == 1 && m.num_hidden_layers % pp != 0) {
                    // Uneven stages: the middle ones ceil(L / pp) layers, the rest split between the
                    // first and the last (they also hold the embedding, the head and MTP).
                    const int64_t per = (m.num_hidden_layers + pp - 1) / pp;
                    const int64_t rest = m.num_hidden_layers - per * (pp - 2);
                    p.first_stage_layers = (rest + 1) / 2;
                    p.last_stage_layers = rest / 2;
                    if (p.first_stage_layers < 1 || p.last_stage_layers < 1) continue;
                  }
                  if (vpp > 1) p.overlap_moe_a2a = false;
                  c.train.micro_batch_size = mbs;
                  c.moe.dispatcher = dispatcher;  // the hierarchical one only where EP spans nodes
                  if (c.moe.dispatcher == "hierarchical" && (etp > 1 || ep * etp <= cluster.gpus_per_node)) continue;
                  try {
                    c.validate();
                    const ParallelConfig r = c.resolve_layout(world);
                    (void)r.stage_layers(m.num_hidden_layers);
                    LayoutCandidate cand{r, mbs, c.moe.dispatcher, predict_step(c, world, cluster), 0};
                    all.push_back(std::move(cand));
                  } catch (const Error&) {
                    continue;  // a layout the model, the batch or the world does not divide into
                  }
                }
  st.layouts = static_cast<int64_t>(all.size());
  std::sort(all.begin(), all.end(), [](const LayoutCandidate& a, const LayoutCandidate& b) {
    return a.prediction.tflops_per_gpu > b.prediction.tflops_per_gpu;
  });
  std::vector<LayoutCandidate> fit;
  const double limit = cluster.gpu.memory_gib * 1024.0 * 1024 * 1024;
  for (LayoutCandidate& cand : all) {
    if (static_cast<int>(fit.size()) >= top) break;
    Config c = cfg;
    c.parallel = cand.layout;
    c.train.micro_batch_size = cand.micro_batch_size;
    c.moe.dispatcher = cand.dispatcher;
    // The ranks whose plans differ: each stage's first and the last rank (as `moefold plan`).
    double peak = 0;
    std::vector<int64_t> ranks;
    for (int64_t s = 0; s < cand.layout.pp; ++s) ranks.push_back(s * (world / cand.layout.pp));
    ranks.push_back(world - 1);
    ++st.planned;
    for (const int64_t r : ranks) {
      peak = std::max(
          peak, static_cast<double>(plan_memory(c, static_cast<int>(world), static_cast<int>(r), Device::cuda).peak()));
      if (peak > limit) break;
    }
    if (peak > limit) {
      ++st.too_large;
      continue;
    }
    cand.peak_gib = peak / (1024.0 * 1024 * 1024);
    fit.push_back(std::move(cand));
  }
  if (stats) *stats = st;
  return fit;
}

}  // namespace moefold
