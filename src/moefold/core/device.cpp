// core/device.h over the CUDA runtime, or the CPU-only stand-ins.
#include "moefold/core/device.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "moefold/core/error.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/core/cuda_check.h"
#endif

namespace moefold {

namespace {
double host_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
std::atomic<size_t> g_in_use{0}, g_peak{0};
std::atomic<int64_t> g_mallocs{0};
}  // namespace

int64_t device_malloc_count() { return g_mallocs.load(); }

size_t device_bytes_in_use() { return g_in_use.load(); }
size_t device_bytes_peak() { return g_peak.load(); }
void reset_device_bytes_peak() { g_peak.store(g_in_use.load()); }

#ifdef MOEFOLD_WITH_CUDA

namespace {
// Bytes of each live allocation, for the in-use count (device_free gets only the pointer).
struct Sizes {
  static constexpr int kMax = 4096;
  void* ptr[kMax] = {};
  size_t bytes[kMax] = {};
};
Sizes g_sizes;

cudaStream_t stream() {
  static cudaStream_t s = [] {
    cudaStream_t t = nullptr;
    MF_CUDA_CHECK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
    return t;
  }();
  return s;
}
}  // namespace

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no GPU: not an error for a CPU run
    return 0;
  }
  return n;
}

void cuda_set_device(int device) {
  MF_CHECK(device >= 0 && device < cuda_device_count(), "cuda_set_device(", device, ") with ", cuda_device_count(),
           " GPUs");
  MF_CUDA_CHECK(cudaSetDevice(device));
}

std::string cuda_device_name() {
  if (cuda_device_count() == 0) return "none";
  int dev = 0;
  MF_CUDA_CHECK(cudaGetDevice(&dev));
  cudaDeviceProp p{};
  MF_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  return cat(p.name, " (sm_", p.major, p.minor, ", ", p.multiProcessorCount, " SMs, ", p.totalGlobalMem >> 30, " GiB)");
}

void* device_malloc(size_t bytes) {
  ++g_mallocs;
  void* p = nullptr;
  const cudaError_t err = cudaMalloc(&p, bytes ? bytes : 256);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_b = 0, total = 0;
    cudaMemGetInfo(&free_b, &total);
    MF_FAIL("out of GPU memory: asked for ", bytes >> 20, " MiB with ", free_b >> 20, " MiB free of ", total >> 20,
            " MiB (", cudaGetErrorString(err), ")");
  }
  for (int i = 0; i < Sizes::kMax; ++i)
    if (!g_sizes.ptr[i]) {
      g_sizes.ptr[i] = p;
      g_sizes.bytes[i] = bytes;
      break;
    }
  const size_t now = g_in_use += bytes;
  size_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void device_free(void* p) {
  if (!p) return;
  for (int i = 0; i < Sizes::kMax; ++i)
    if (g_sizes.ptr[i] == p) {
      g_in_use -= g_sizes.bytes[i];
      g_sizes.ptr[i] = nullptr;
      break;
    }
  cudaFree(p);  // errors at exit (driver shutting down) are not actionable
}

void* primary_stream() { return stream(); }

void device_synchronize() { MF_CUDA_CHECK(cudaStreamSynchronize(stream())); }

StreamTimer::StreamTimer() = default;  // events made on first GPU use: a CPU run needs no GPU
StreamTimer::~StreamTimer() {
  for (void* e : events_)
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));
}
void StreamTimer::start(Device device) {
  device_ = device;
  if (device_ != Device::cuda) {
    host_start_ = host_ms();
    return;
  }
  for (void*& e : events_)
    if (!e) MF_CUDA_CHECK(cudaEventCreate(reinterpret_cast<cudaEvent_t*>(&e)));
  MF_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(events_[0]), stream()));
}
void StreamTimer::stop() {
  if (device_ == Device::cuda)
    MF_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(events_[1]), stream()));
  else
    host_stop_ = host_ms();
}
double StreamTimer::elapsed_ms() const {
  if (device_ != Device::cuda) return host_stop_ - host_start_;
  MF_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(events_[1])));
  float ms = 0;
  MF_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_[0]), static_cast<cudaEvent_t>(events_[1])));
  return ms;
}

void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes, void* on) {
  if (bytes == 0) return;
  if (dst_device == Device::cpu && src_device == Device::cpu) {
    std::memmove(dst, src, bytes);
    return;
  }
  const cudaStream_t s = on ? static_cast<cudaStream_t>(on) : stream();
  MF_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, s));
  if (dst_device == Device::cpu) MF_CUDA_CHECK(cudaStreamSynchronize(s));
}

namespace {
// device_copy_2d's rows to or from device memory.
void pitched_device_copy(void* dst, size_t dst_pitch, Device dst_device, const void* src, size_t src_pitch,
                         size_t row_bytes, size_t rows, void* on) {
  const cudaStream_t s = on ? static_cast<cudaStream_t>(on) : stream();
  MF_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDefault, s));
  if (dst_device == Device::cpu) MF_CUDA_CHECK(cudaStreamSynchronize(s));
}
}  // namespace

void device_zero(void* p, size_t bytes, void* on) {
  if (bytes) MF_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, on ? static_cast<cudaStream_t>(on) : stream()));
}

void* pinned_host_malloc(size_t bytes) {
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, bytes ? bytes : 64, cudaHostAllocDefault);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    MF_FAIL("out of pinned host memory: asked for ", bytes >> 20, " MiB (", cudaGetErrorString(err), ")");
  }
  return p;
}
void pinned_host_free(void* p) {
  if (p) cudaFreeHost(p);  // errors at exit (driver shutting down) are not actionable
}

void device_copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes, void* on) {
  if (bytes == 0) return;
  if (dst_device == Device::cpu && src_device == Device::cpu) {
    std::memmove(dst, src, bytes);
    return;
  }
  MF_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, on ? static_cast<cudaStream_t>(on) : stream()));
}

StreamFence::~StreamFence() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}
void StreamFence::record(void* on) {
  if (!event_) MF_CUDA_CHECK(cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(&event_), cudaEventDisableTiming));
  MF_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_), on ? static_cast<cudaStream_t>(on) : stream()));
}
void StreamFence::wait() const {
  if (event_) MF_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)));
}

#else  // CPU-only build

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
void cuda_set_device(int) { MF_FAIL("this moefold was built without CUDA (no nvcc at build time)"); }
std::string cuda_device_name() { return "none"; }
void* device_malloc(size_t) { MF_FAIL("this moefold was built without CUDA (no nvcc at build time)"); }
void device_free(void*) {}
void* primary_stream() { return nullptr; }
void device_synchronize() {}
void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes, void*) {
  MF_CHECK(dst_device == Device::cpu && src_device == Device::cpu, "device_copy: built without CUDA");
  if (bytes) std::memmove(dst, src, bytes);
}
namespace {
void pitched_device_copy(void*, size_t, Device, const void*, size_t, size_t, size_t, void*) {
  MF_FAIL("device_copy_2d: built without CUDA");
}
}  // namespace
void device_zero(void*, size_t, void*) { MF_FAIL("this moefold was built without CUDA (no nvcc at build time)"); }
void* pinned_host_malloc(size_t bytes) {
  void* p = std::aligned_alloc(64, (std::max<size_t>(bytes, 64) + 63) / 64 * 64);
  MF_CHECK(p != nullptr, "out of host memory allocating ", bytes, " bytes");
  return p;
}
void pinned_host_free(void* p) { std::free(p); }
void device_copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes, void* on) {
  device_copy(dst, dst_device, src, src_device, bytes, on);
}
StreamFence::~StreamFence() = default;
void StreamFence::record(void*) {}
void StreamFence::wait() const {}
StreamTimer::StreamTimer() = default;
StreamTimer::~StreamTimer() = default;
void StreamTimer::start(Device device) {
  MF_CHECK(device == Device::cpu, "StreamTimer: built without CUDA");
  device_ = device;
  host_start_ = host_ms();
}
void StreamTimer::stop() { host_stop_ = host_ms(); }
double StreamTimer::elapsed_ms() const { return host_stop_ - host_start_; }

#endif

void device_copy_2d(void* dst, size_t dst_pitch, Device dst_device, const void* src, size_t src_pitch,
                    Device src_device, size_t row_bytes, size_t rows, void* stream) {
  MF_CHECK(dst_pitch >= row_bytes && src_pitch >= row_bytes, "device_copy_2d: rows of ", row_bytes, " bytes, pitches ",
           dst_pitch, " and ", src_pitch);
  if (rows <= 1 || (dst_pitch == row_bytes && src_pitch == row_bytes))  // one block
    return device_copy(dst, dst_device, src, src_device, row_bytes * rows, stream);
  if (dst_device == Device::cpu && src_device == Device::cpu) {
    for (size_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, row_bytes);
    return;
  }
  pitched_device_copy(dst, dst_pitch, dst_device, src, src_pitch, row_bytes, rows, stream);
}

}  // namespace moefold
