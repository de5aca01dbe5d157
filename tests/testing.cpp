#include "testing.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>

#include "moefold/core/device.h"
#include "moefold/core/error.h"
#include "moefold/core/rng.h"

namespace moefold::testing {

const ExecContext& exec() { return ExecContext::standard(cuda_device_count() > 0 ? Device::cuda : Device::cpu); }

namespace {
uint64_t next_seed() {
  static uint64_t s = fresh_seed();
  return s++;
}
}  // namespace

uint64_t fresh_seed() {
  static const uint64_t base = [] {
    if (const char* e = std::getenv("MOEFOLD_TEST_SEED")) return static_cast<uint64_t>(std::strtoull(e, nullptr, 10));
    return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  return base;
}

Tensor Pool::zeros(Shape shape, DType dtype) {
  size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  bufs_.emplace_back(new double[bytes / sizeof(double) + 1]());
  return Tensor(bufs_.back().get(), dtype, shape);
}

Tensor Pool::randn(Shape shape, DType dtype, double std) {
  Tensor t = zeros(shape, dtype);
  fill_normal(t, next_seed(), 0, 0.0, std);
  return t;
}

Tensor Pool::uniform(Shape shape, double lo, double hi, DType dtype) {
  Tensor t = zeros(shape, dtype);
  fill_uniform(t, next_seed(), 0, lo, hi);
  return t;
}

Tensor Pool::ints(Shape shape, int32_t lo, int32_t hi) {
  Tensor t = zeros(shape, DType::i32);
  uint64_t seed = next_seed();
  for (int64_t i = 0; i < t.numel(); ++i)
    t.ptr<int32_t>()[i] = lo + static_cast<int32_t>(rng_below(seed, 0, i, static_cast<uint64_t>(hi - lo)));
  return t;
}

Tensor Pool::clone(const Tensor& t) {
  Tensor c = zeros(t.shape(), t.dtype());
  c.copy_from(t);
  return c;
}

namespace {
double at(const Tensor& t, int64_t i) {
  return dispatch_float(t.dtype(), [&]<class T>() { return static_cast<double>(t.ptr<T>()[i]); });
}
}  // namespace

double dot(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  double s = 0;
  for (int64_t i = 0; i < a.numel(); ++i) s += at(a, i) * at(b, i);
  return s;
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.numel(), b.numel());
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(at(a, i) - at(b, i)));
  return m;
}

double max_abs(const Tensor& a) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(at(a, i)));
  return m;
}

void check_gradient(const std::string& what, const Tensor& x, const Tensor& analytic,
                    const std::function<double()>& loss, GradCheckOptions o) {
  ASSERT_EQ(x.dtype(), DType::f64) << what;
  ASSERT_EQ(x.numel(), analytic.numel()) << what;
  SCOPED_TRACE(what + " (MOEFOLD_TEST_SEED=" + std::to_string(fresh_seed()) + ")");
  double* p = x.ptr<double>();
  int failures = 0;
  for (int64_t i = 0; i < x.numel() && failures < 5; ++i) {
    double keep = p[i];
    p[i] = keep + o.eps;
    double lp = loss();
    p[i] = keep - o.eps;
    double lm = loss();
    p[i] = keep;
    double fd = (lp - lm) / (2 * o.eps);
    double an = at(analytic, i);
    double tol = o.atol + o.rtol * std::max(std::abs(fd), std::abs(an));
    if (!(std::abs(fd - an) <= tol)) {
      ++failures;
      ADD_FAILURE() << what << "[" << i << "]: finite difference " << fd << " vs analytic " << an;
    }
  }
}

TempDir::TempDir(const std::string& tag) {
  static int counter = 0;
  path_ = std::filesystem::temp_directory_path() /
          cat("moefold_", tag, "_", ::getpid(), "_", fresh_seed() % 100000, "_", counter++);
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

double value_at(const Tensor& t, int64_t i) {
  if (t.dtype() == DType::i32) return t.ptr<int32_t>()[i];
  if (t.dtype() == DType::i64) return static_cast<double>(t.ptr<int64_t>()[i]);
  if (t.dtype() == DType::bf16) return bf16_to_f32(static_cast<uint16_t*>(t.data())[i]);
  return dispatch_float(t.dtype(), [&]<class T>() { return static_cast<double>(t.ptr<T>()[i]); });
}

void set_value_at(const Tensor& t, int64_t i, double v) {
  if (t.dtype() == DType::i32) {
    t.ptr<int32_t>()[i] = static_cast<int32_t>(v);
    return;
  }
  if (t.dtype() == DType::i64) {
    t.ptr<int64_t>()[i] = static_cast<int64_t>(v);
    return;
  }
  if (t.dtype() == DType::bf16) {
    static_cast<uint16_t*>(t.data())[i] = f32_to_bf16(static_cast<float>(v));
    return;
  }
  dispatch_float(t.dtype(), [&]<class T>() { t.ptr<T>()[i] = static_cast<T>(v); });
}

}  // namespace moefold::testing
