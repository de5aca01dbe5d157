// Test helpers: owned tensors with fresh random contents, and a float64 finite-difference
// gradient checker shared by every backward test.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "moefold/core/exec.h"
#include "moefold/core/tensor.h"

namespace moefold::testing {

// The execution context the tests run ops on: the GPU's standard context when this process sees a
// GPU (host tensors still run the CPU reference there), else the CPU's.
const ExecContext& exec();

// Owns the storage of the tensors it hands out (kept alive until the pool dies).
class Pool {
 public:
  Tensor zeros(Shape shape, DType dtype = DType::f64);
  // Normal(0, std) with a fresh seed per call (seeded from the test's random seed).
  Tensor randn(Shape shape, DType dtype = DType::f64, double std = 1.0);
  Tensor uniform(Shape shape, double lo, double hi, DType dtype = DType::f64);
  Tensor ints(Shape shape, int32_t lo, int32_t hi);  // i32 uniform in [lo, hi)
  Tensor clone(const Tensor& t);

 private:
  std::vector<std::unique_ptr<double[]>> bufs_;
};

// A seed that differs between runs (fresh inputs each run) unless MOEFOLD_TEST_SEED is set;
// printed on failure through SCOPED_TRACE by the helpers that use it.
uint64_t fresh_seed();

// Element i of a host tensor (f32, f64, i32, i64; bf16 decoded), as double; and its setter.
double value_at(const Tensor& t, int64_t i);
void set_value_at(const Tensor& t, int64_t i, double v);

// sum_i a_i * b_i over float tensors of equal numel.
double dot(const Tensor& a, const Tensor& b);
double max_abs_diff(const Tensor& a, const Tensor& b);
double max_abs(const Tensor& a);

struct GradCheckOptions {
  double eps = 1e-6;   // central difference step
  double rtol = 1e-5;  // |fd - analytic| <= atol + rtol * max(|fd|, |analytic|)
  double atol = 1e-7;
};

// For every element x_i of `x` (f64): fd_i = (loss(x + eps e_i) - loss(x - eps e_i)) / (2 eps),
// EXPECTs fd_i to match analytic_i. `x` is restored afterwards.
void check_gradient(const std::string& what, const Tensor& x, const Tensor& analytic,
                    const std::function<double()>& loss, GradCheckOptions opts = {});

// A fresh directory under the system temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "test");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

std::string read_bytes(const std::string& path);
void write_bytes(const std::string& path, const std::string& bytes);

// The message of the moefold::Error that f throws ("" when it throws none).
std::string error_of(const std::function<void()>& f);

}  // namespace moefold::testing
