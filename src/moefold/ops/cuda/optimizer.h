// The CUDA AdamW update of ops/ops.h (optimizer.cu): the same contract (AdamWStep), in namespace
// moefold::cuda, for tensors on the GPU; ops/cpu/elementwise.cpp dispatches here for CUDA tensors.
// w, g, m, v f32 (fp32 master weights and moments); w_compute (optional) bf16 or f32. Runs on the
// context's stream. Only in the CUDA build.
#pragma once

#include <cstdint>
#include <vector>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/ops.h"  // AdamWStep

namespace moefold::cuda {

void adamw_update(const ExecContext& ctx, const Tensor& w, const Tensor& g, const Tensor& m, const Tensor& v,
                  const AdamWStep& s, const Tensor& w_compute);
// AdamWBatch's device side: the entries' descriptor table (device memory, freed with
// adamw_batch_free) and the blocks of one launch; the update, one kernel over every entry.
void* adamw_batch_table(const std::vector<AdamWEntry>& entries, int64_t* blocks);
void adamw_batch_free(void* table);
void adamw_batch_update(const ExecContext& ctx, const std::vector<AdamWEntry>& entries, const void* table,
                        int64_t blocks, const AdamWStep& s);

}  // namespace moefold::cuda
