// CUDA copies, sums and fills on matrix views (ops/ops.h, "matmul on matrix views"); the checks
// (shapes, dtypes, overlap) are done by the dispatching CPU functions.
#pragma once

#include "moefold/ops/ops.h"

namespace moefold::cuda {

void copy_matrix(const ExecContext& ctx, const MatrixView& src, const MatrixView& dst);  // one cudaMemcpy2DAsync
void add_matrix(const ExecContext& ctx, const MatrixView& src, const MatrixView& dst);   // f32 or bf16 (sum in f32)
void fill_matrix(const ExecContext& ctx, const MatrixView& dst, double value);           // f32, bf16, i32, i64

}  // namespace moefold::cuda
