// bench_attention: causal grouped-query attention on the GPU, forward and backward, moefold's own
// kernel (ops/cuda/attention.cu) against cuDNN's fused attention (ops/cuda/attention_cudnn.h), at
// the attention shapes of the models moefold trains. bf16 q, k, v, dout (random, unit variance),
// f32 lse. Times: CUDA events on the compute stream (StreamTimer), median of --runs timed calls
// after --warmup untimed ones. FLOPs of causal attention (half of the S x S scores): forward
// 4 B Q S^2 D / 2, backward 2.5 x forward. Both backwards read the own kernel's out and lse, and
// each shape ends with the relative (Frobenius) difference of cuDNN's results from the own
// kernel's: two implementations agreeing to bf16 precision (~1e-3) is the sanity check.
//   ./build-gpu/bench_attention [--runs N] [--warmup N] [--shape NAME]...
#include "moefold/ops/cuda/attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "moefold/core/device.h"
#include "moefold/core/dtype.h"
#include "moefold/core/error.h"
#include "moefold/core/tensor.h"
#include "moefold/ops/cuda/attention_cudnn.h"

namespace moefold {
namespace {

using bench::DeviceTensor;
using bench::fill_random;
using bench::time_ms;

struct Shape4 {
  const char* name;
  int64_t b, s, nq, ng, d;
};

// qwen3-30b-a3b and qwen3-235b-a22b: 32 / 64 query heads on 4 kv heads of 128; DeepSeek-V3's
// multi-head latent attention run as plain attention: 128 heads, q/k head dim 192 (128 + 64
// rotary), v padded from 128 to 192.
const Shape4 kShapes[] = {
    {"qwen3-30b-a3b", 1, 4096, 32, 4, 128},
    {"qwen3-235b-a22b", 1, 4096, 64, 4, 128},
    {"deepseek-v3-mla-padded", 1, 4096, 128, 128, 192},
};

struct Options {
  int runs = 25, warmup = 3;
  std::vector<std::string> shapes;  // empty: all
};

std::vector<double> download(const Tensor& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::bf16) {
    std::vector<uint16_t> h(out.size());
    device_copy(h.data(), Device::cpu, t.data(), Device::cuda, h.size() * 2);
    for (size_t i = 0; i < h.size(); ++i) out[i] = bf16_to_f32(h[i]);
  } else {
    std::vector<float> h(out.size());
    device_copy(h.data(), Device::cpu, t.data(), Device::cuda, h.size() * 4);
    for (size_t i = 0; i < h.size(); ++i) out[i] = h[i];
  }
  return out;
}

// ||a - b|| / ||b||.
double rel_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = download(a), y = download(b);
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    num += (x[i] - y[i]) * (x[i] - y[i]);
    den += y[i] * y[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void report(const Shape4& sh, const char* impl, const char* direction, double ms, double flops) {
  std::printf("%-24s B=%lld S=%lld Q=%lld G=%lld D=%lld  %-13s %-8s %9.3f ms %8.1f TFLOP/s\n", sh.name,
              static_cast<long long>(sh.b), static_cast<long long>(sh.s), static_cast<long long>(sh.nq),
              static_cast<long long>(sh.ng), static_cast<long long>(sh.d), impl, direction, ms, flops / ms * 1e-9);
  std::fflush(stdout);
}

void skip(const Shape4& sh, const char* impl, const char* direction, const std::string& why) {
  std::printf("%-24s %-13s %-8s skipped: %s\n", sh.name, impl, direction, why.c_str());
  std::fflush(stdout);
}

void bench_shape(const Shape4& sh, const Options& opt) {
  const Shape q_shape{sh.b, sh.s, sh.nq, sh.d}, kv_shape{sh.b, sh.s, sh.ng, sh.d}, lse_shape{sh.b, sh.nq, sh.s};
  const double scale = 1.0 / std::sqrt(static_cast<double>(sh.d));
  const double fwd_flops = 4.0 * sh.b * sh.nq * static_cast<double>(sh.s) * sh.s * sh.d / 2,
               bwd_flops = 2.5 * fwd_flops;
  DeviceTensor q(q_shape, DType::bf16), k(kv_shape, DType::bf16), v(kv_shape, DType::bf16), dout(q_shape, DType::bf16);
  DeviceTensor out(q_shape, DType::bf16), lse(lse_shape, DType::f32), out2(q_shape, DType::bf16),
      lse2(lse_shape, DType::f32);
  DeviceTensor dq(q_shape, DType::bf16), dk(kv_shape, DType::bf16), dv(kv_shape, DType::bf16),
      dq2(q_shape, DType::bf16), dk2(kv_shape, DType::bf16), dv2(kv_shape, DType::bf16);
  fill_random(*q, 1);
  fill_random(*k, 2);
  fill_random(*v, 3);
  fill_random(*dout, 4);
  const ExecContext& ctx = ExecContext::standard(Device::cuda);

  report(sh, "own", "forward",
         time_ms(opt.runs, opt.warmup, [&] { cuda::attention_forward(ctx, *q, *k, *v, scale, *out, *lse); }),
         fwd_flops);
  report(sh, "own", "backward",
         time_ms(opt.runs, opt.warmup,
                 [&] { cuda::attention_backward(ctx, *q, *k, *v, *out, *lse, *dout, scale, *dq, *dk, *dv); }),
         bwd_flops);

  std::string why;
  const bool fwd_ok = cuda::cudnn_attention_forward(ctx, *q, *k, *v, scale, *out2, *lse2, {}, &why);
  if (fwd_ok) {
    report(sh, "cudnn", "forward",
           time_ms(opt.runs, opt.warmup, [&] { cuda::cudnn_attention_forward(ctx, *q, *k, *v, scale, *out2, *lse2); }),
           fwd_flops);
    std::printf("%-24s cudnn vs own (forward): out %.2e lse %.2e\n", sh.name, rel_diff(*out2, *out),
                rel_diff(*lse2, *lse));
  } else {
    skip(sh, "cudnn", "forward", why);
  }
  for (bool deterministic : {true, false}) {
    const cuda::CudnnAttentionOptions o{deterministic};
    const char* name = deterministic ? "cudnn" : "cudnn-nondet";
    why.clear();
    if (!cuda::cudnn_attention_backward(ctx, *q, *k, *v, *out, *lse, *dout, scale, *dq2, *dk2, *dv2, o, &why)) {
      skip(sh, name, "backward", why);
      continue;
    }
    report(sh, name, "backward",
           time_ms(
               opt.runs, opt.warmup,
               [&] { cuda::cudnn_attention_backward(ctx, *q, *k, *v, *out, *lse, *dout, scale, *dq2, *dk2, *dv2, o); }),
           bwd_flops);
    std::printf("%-24s %s vs own (backward): dq %.2e dk %.2e dv %.2e\n", sh.name, name, rel_diff(*dq2, *dq),
                rel_diff(*dk2, *dk), rel_diff(*dv2, *dv));
  }
  std::fflush(stdout);
}

int run(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) MF_FAIL(a, ": missing value");
      return argv[++i];
    };
    if (a == "--runs")
      opt.runs = std::max(1, std::atoi(value().c_str()));
    else if (a == "--warmup")
      opt.warmup = std::max(0, std::atoi(value().c_str()));
    else if (a == "--shape")
      opt.shapes.push_back(value());
    else
      MF_FAIL("unknown argument ", a, " (usage: bench_attention [--runs N] [--warmup N] [--shape NAME]...)");
  }
  if (cuda_device_count() == 0) MF_FAIL("no GPU visible to this process");
  std::printf("GPU: %s; cuDNN %s (runtime %lld, frontend %s); median of %d runs after %d warmup\n",
              cuda_device_name().c_str(), cuda::cudnn_attention_built() ? "built" : "not built",
              static_cast<long long>(cuda::cudnn_runtime_version()), cuda::cudnn_frontend_version().c_str(), opt.runs,
              opt.warmup);
  for (const Shape4& sh : kShapes)
    if (opt.shapes.empty() || std::find(opt.shapes.begin(), opt.shapes.end(), sh.name) != opt.shapes.end())
      bench_shape(sh, opt);
  return 0;
}

}  // namespace
}  // namespace moefold

int main(int argc, char** argv) {
  try {
    return moefold::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_attention: error: %s\n", e.what());
    return 1;
  }
}
