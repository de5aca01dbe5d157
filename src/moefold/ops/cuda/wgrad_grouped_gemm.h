// moefold's own grouped weight-gradient GEMM (Hopper, sm_90a): dw_e (+)= dy_e^T x_e for every
// expert e in one persistent launch, bf16 operands read along the rows as they lie (no transposed
// copy), f32 sums, bf16 or f32 gradients stored by TMA while the next tile's MMAs run.
// kernels.cutlass_tile wgrad = own selects it (grouped_gemm_cutlass.cu); see
// wgrad_grouped_gemm.cu and docs/design-notes.md, "The own weight-gradient kernel".
#pragma once

#include <cstdint>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::cuda {

// Whether the kernel serves weights of o_n x i_n (dy's and x's widths) over `groups` experts:
// both widths multiples of 8 (16-byte rows for TMA), at least one expert.
bool own_wgrad_serves(int64_t groups, int64_t o_n, int64_t i_n);

// dw_EOI (bf16 or f32) = dy_RO^T x_RI per expert (accumulate: +=), the experts' rows given by
// offsets_E1 on the device (read there, never by the host). An expert without rows gets zeros
// (written) or keeps dw (accumulated). REQUIRES: own_wgrad_serves; bf16 x and dy; every pointer
// 16-byte aligned; fewer than 2^31 rows. Fails (naming kernels.cutlass_tile) on a GPU or build
// without sm_90a code. `cluster`: CTAs a cluster, 2 (pairs of CTAs on neighbouring rows of the
// weight share x's loads by TMA multicast: what kernels.cutlass_tile wgrad = own runs) or 1.
// `unit_tiles`: the most tiles of one expert and the same weight rows a cluster takes in a row,
// keeping dy in shared memory for them (0: ctx's kernels.own_wgrad_units). Only where every expert
// has at most 256 rows (the kernel checks on the device; else tiles one at a time), unless
// `force_units` (tests: experts keeping dy and experts streaming it in one launch). The same bits
// for every cluster size and unit.
void own_grouped_wgrad(const ExecContext& ctx, const Tensor& x_RI, const Tensor& dy_RO, const Tensor& offsets_E1,
                       const Tensor& dw_EOI, bool accumulate, const char* what, int cluster = 2, int unit_tiles = 0,
                       bool force_units = false);

}  // namespace moefold::cuda
