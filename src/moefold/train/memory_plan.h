// moefold plan's numbers: the bytes one training rank reserves, from the same binding pass the
// Trainer runs (bind_training on a measuring Memory, on a shape-only Mesh: Mesh::plan), never
// from a second formula. Nothing is allocated and no GPU is needed.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "moefold/core/memory.h"
#include "moefold/model/config.h"

namespace moefold {

struct MemoryPlan {
  ParallelConfig layout;  // resolved
  int rank = 0;
  Device device = Device::cuda;
  DType compute = DType::bf16;
  size_t master = 0;          // master weights kept whole (all, or the full_master ones when sharded)
  size_t compute_copies = 0;  // bf16 copies (mixed precision), or every weight (sharded)
  size_t fp8_copies = 0;      // the FP8 linears' weights as FP8 codes and scales (train.fp8)
  size_t gradients = 0;
  bool bf16_grads = false;               // train.main_grads_dtype = bf16: the expert and tensor-parallel ones
  size_t optimizer = 0;                  // AdamW moments (and, sharded, the master shards) on the device
  size_t optimizer_host = 0;             // their offloaded part, with its staging (pinned host memory)
  size_t activations = 0;                // every planned workspace on the device, peer-visible ones included
  size_t host = 0;                       // host workspaces of a GPU run (plans from counts, token windows)
  std::vector<Memory::PartBytes> parts;  // activations by part of the model
  // Not planned by Memory: the libraries size these at the first step. cuBLASLt's workspace
  // (32 MiB, ops/cuda/gemm.cu; another 32 MiB for FP8's dense GEMMs on cuBLASLt) and, where cuDNN serves attention
  // (kernels.attention auto or cudnn), its backward's workspace as measured on an H200 (plan_memory;
  // docs/benchmarks.md): 2 bytes per (sequence, head, query, key) of a micro-batch with
  // kernels.deterministic_attention; on several GPUs the NCCL communicators' staging buffers. Zero on the CPU.
  size_t runtime = 0;
  // The device bytes planned before step 0 (the arenas and the optimizer): what device_malloc
  // reserves before the first step.
  size_t device_total() const { return master + compute_copies + fp8_copies + gradients + optimizer + activations; }
  // The predicted peak of device_malloc's bytes.
  size_t peak() const { return device_total() + runtime; }
};

// The plan of world rank `rank` of cfg's layout on `world` ranks. device cuda: bf16 compute with
// f32 masters (the trainer's GPU default); cpu: f32. REQUIRES: cfg validated; the layout fits
// `world` (Config::resolve_layout checks it).
MemoryPlan plan_memory(const Config& cfg, int world, int rank, Device device);

}  // namespace moefold
