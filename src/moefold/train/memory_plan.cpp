#include "moefold/train/memory_plan.h"

#include "moefold/core/exec.h"
#include "moefold/model/model.h"
#include "moefold/parallel/mesh.h"
#include "moefold/train/optimizer.h"
#include "moefold/train/trainer.h"

namespace moefold {

MemoryPlan plan_memory(const Config& cfg, int world, int rank, Device device) {
  MemoryPlan p;
  p.layout = cfg.resolve_layout(world);
  p.rank = rank;
  p.device = device;
  p.compute = device == Device::cuda ? DType::bf16 : DType::f32;
  Mesh mesh = Mesh::plan(p.layout, rank, cfg.moe.dispatcher == "hierarchical");
  std::vector<std::unique_ptr<Model>> models = make_models(cfg, mesh);  // one per micro-batch in flight
  const ExecContext ctx(device, cfg.kernels, ExecContext::Stream::none);
  Memory mem(p.compute, ctx);
  apply_memory_options(mem, cfg.train);
  if (cfg.parallel.distributed_optimizer) mem.shard_layout(shard_layout_for(mesh, *models.front()));
  StepBuffers buffers;
  bind_training(mem, models, cfg, buffers);  // the measuring pass: sizes only
  p.master = mem.master_bytes();
  p.compute_copies = mem.compute_bytes();
  p.fp8_copies = mem.fp8_bytes();
  p.gradients = mem.grad_bytes();
  p.bf16_grads = mem.grad_dtype(ParamGroup::expert) == DType::bf16;
  p.optimizer = AdamW::state_bytes(mem, cfg.train);
  p.optimizer_host = AdamW::host_state_bytes(mem, cfg.train);
  p.activations = mem.act_bytes();
  p.host = mem.host_act_bytes();
  p.parts = mem.part_bytes();
  if (device == Device::cuda) {
    // cuBLASLt's workspace (ops/cuda/gemm.cu), and FP8's own where cuBLASLt's block scaling serves
    // the dense layers (fp8_gemm_cublaslt.cu): one per execution context, and with
    // moe.shared_expert_overlap each model (micro-batch in flight) has a second one.
    const bool fp8_lt = cfg.train.fp8 == "blockwise" && cfg.kernels.fp8_dense_gemm == Fp8DenseGemm::cublaslt;
    const size_t contexts = 1 + (cfg.moe.shared_expert_overlap ? models.size() : 0);
    p.runtime = contexts * (fp8_lt ? 2 : 1) * (size_t{32} << 20);
    // Several GPUs: each NCCL communicator (the world and the mesh's ten groups, eighteen with
    // pipeline stages) stages host tensors in 8 MiB of its own (comm/nccl.cpp; NCCL's internal
    // buffers are not device_malloc's).
    if (world > 1) p.runtime += size_t{p.layout.pp > 1 ? 19u : 11u} * (size_t{8} << 20);
    // What the libraries took at the first step on an H200 (cuDNN 9; docs/benchmarks.md), per
    // micro-batch of B sequences, H = heads / tp, S = seq_len, Sq = S / cp queries, D = head_dim:
    // the deterministic backward 2 B H Sq S bytes (+ 4 B H Sq D with grouped-query heads), the
    // other one 8 B H Sq D.
    const KernelOptions& k = cfg.kernels;
    const auto b = static_cast<size_t>(cfg.train.micro_batch_size),
               h = static_cast<size_t>(cfg.model.num_attention_heads / p.layout.tp),
               s = static_cast<size_t>(cfg.train.seq_len), sq = s / static_cast<size_t>(p.layout.cp),
               d = static_cast<size_t>(cfg.model.head_dim);
    const bool grouped = cfg.model.num_key_value_heads < cfg.model.num_attention_heads;
    if (k.attention != AttentionKernel::own)
      p.runtime +=
          k.deterministic_attention ? 2 * b * h * sq * s + (grouped ? 4 * b * h * sq * d : 0) : 8 * b * h * sq * d;
  }
  return p;
}

}  // namespace moefold
