// GPU parity, elementwise helpers: every CUDA op against its CPU op on fresh random inputs
// (tests/cuda_testing.h). Tolerances: f32 ops must agree to float rounding (1e-6 relative);
// bf16 outputs are one bf16 rounding of an f32 result (relative 2^-9 = 2e-3 each, 4e-3 bound).
#include <gtest/gtest.h>

#include "cuda_testing.h"
#include "moefold/ops/ops.h"

namespace moefold {
namespace {

using testing::DevicePool;
using testing::Pool;

TEST(CudaElementwise, AddScaleSumSquaresMatchCpu) {
  MF_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    Pool pool;
    DevicePool dev;
    const int64_t n = 100003;  // not a multiple of any block size
    Tensor y = pool.randn({n}), x = pool.randn({n});
    Tensor yr = testing::rounded(pool, y, dt), xr = testing::rounded(pool, x, dt);
    Tensor yd = dev.upload(y, dt), xd = dev.upload(x, dt);
    add_inplace(yd, xd);
    scale_inplace(yd, -0.75);
    add_inplace(yr, xr);
    scale_inplace(yr, -0.75);
    const double tol = dt == DType::f32 ? 1e-6 : 4e-3;
    EXPECT_LE(testing::rel_error(testing::download(yd), yr), tol);
    const double want = sum_squares(xr), got = sum_squares(xd);
    EXPECT_NEAR(got, want, 1e-9 * want);  // the same inputs, summed in double either way
  }
}

}  // namespace
}  // namespace moefold
