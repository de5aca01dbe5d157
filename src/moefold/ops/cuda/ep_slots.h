// The CUDA expert-parallel slot plans of ops/moe_ops.h (ep_slots.cu): the same names and
// contracts, in namespace moefold::cuda; ops/cpu/ep_slots.cpp checks the arguments and dispatches
// here for CUDA tensors. Integer arithmetic only (the overflow is a sum of whole numbers; the fill
// one division, max-ed as the CPU's): the results are bit-identical to the CPU ops'. fill_1 may be
// undefined. Nothing is read back to the host: graphs capture them. Only in the CUDA build.
#pragma once

#include <cstdint>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

void moe_ep_send_slots(const ExecContext& ctx, const Tensor& home_offsets_E1, const Tensor& home_token_S,
                       const Tensor& row_TK, int64_t slot_rows, const Tensor& token_X, const Tensor& slot_TK,
                       const Tensor& send_counts_PL, const Tensor& overflow_1, const Tensor& fill_1);
void moe_ep_recv_slots(const ExecContext& ctx, const Tensor& recv_counts_PL, int64_t slot_rows, const Tensor& src_R,
                       const Tensor& row_X, const Tensor& counts_L, const Tensor& offsets_L1, const Tensor& overflow_1,
                       const Tensor& fill_1);

}  // namespace moefold::cuda
