// core/exec.h over the CUDA runtime, or the CPU-only stand-ins.
#include "moefold/core/exec.h"

#include <algorithm>
#include <mutex>

#include "moefold/core/device.h"
#include "moefold/core/error.h"

#ifdef MOEFOLD_WITH_CUDA
#include "moefold/core/cuda_check.h"
#endif

namespace moefold {

struct ExecContext::Buffers {
  struct Scratch {
    void* p = nullptr;
    size_t bytes = 0;
  };
  Scratch scratch[static_cast<int>(ScratchSlot::count)];
  std::unique_ptr<ExecLibraryState> libraries[static_cast<int>(ExecLibrary::count)];
  void* event = nullptr;  // wait_for's event, recorded on the other context's stream
};

size_t ExecContext::scratch_bytes(ScratchSlot slot) const { return buffers_->scratch[static_cast<int>(slot)].bytes; }

const ExecContext& ExecContext::standard(Device device) {
  static std::mutex m;
  static const ExecContext* contexts[2] = {nullptr, nullptr};  // never destroyed (see gemm.cu)
  const std::lock_guard lock(m);
  const ExecContext*& c = contexts[device == Device::cuda ? 1 : 0];
  if (c == nullptr) c = new ExecContext(device);
  return *c;
}

#ifdef MOEFOLD_WITH_CUDA

ExecContext::ExecContext(Device device, const KernelOptions& kernels, Stream stream)
    : device_(device), kernels_(kernels), planning_(stream == Stream::none), buffers_(std::make_unique<Buffers>()) {
  if (device_ != Device::cuda || planning_) return;
  MF_CHECK(cuda_device_count() > 0, "a CUDA execution context on a machine without a GPU");
  if (stream == Stream::own) {
    cudaStream_t s = nullptr;
    MF_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    stream_ = s;
    own_stream_ = true;
  } else {
    stream_ = primary_stream();
  }
}

ExecContext::~ExecContext() {
  if (device_ != Device::cuda || planning_) return;
  // Errors here (a failed kernel poisoned the context, or the driver is shutting down) are not
  // actionable: the error that caused them was reported where it happened.
  cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  for (auto& l : buffers_->libraries) l.reset();
  for (auto& s : buffers_->scratch) device_free(s.p);
  if (buffers_->event) cudaEventDestroy(static_cast<cudaEvent_t>(buffers_->event));
  if (own_stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

void* ExecContext::scratch(ScratchSlot slot, size_t bytes) const {
  MF_CHECK(device_ == Device::cuda && !planning_, "ExecContext::scratch on a CPU or planning context");
  Buffers::Scratch& b = buffers_->scratch[static_cast<int>(slot)];
  if (bytes > b.bytes) {
    if (b.p) {
      synchronize();  // queued work may still read the old one
      device_free(b.p);
    }
    b.bytes = std::max(bytes, 2 * b.bytes);
    b.p = device_malloc(b.bytes);
    if (slot == ScratchSlot::arrivals)
      MF_CUDA_CHECK(cudaMemsetAsync(b.p, 0, b.bytes, static_cast<cudaStream_t>(stream_)));
  }
  return b.p;
}

void ExecContext::synchronize() const {
  if (device_ == Device::cuda && !planning_) MF_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
}

void ExecContext::wait_for(const ExecContext& other) const {
  if (device_ != Device::cuda || other.device_ != Device::cuda || other.stream_ == stream_ || planning_) return;
  void*& e = buffers_->event;
  if (!e) MF_CUDA_CHECK(cudaEventCreateWithFlags(reinterpret_cast<cudaEvent_t*>(&e), cudaEventDisableTiming));
  MF_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(e), static_cast<cudaStream_t>(other.stream_)));
  MF_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), static_cast<cudaEvent_t>(e), 0));
}

#else  // CPU-only build

ExecContext::ExecContext(Device device, const KernelOptions& kernels, Stream stream)
    : device_(device), kernels_(kernels), planning_(stream == Stream::none), buffers_(std::make_unique<Buffers>()) {
  if (device_ == Device::cuda && !planning_) MF_FAIL("this moefold was built without CUDA (no nvcc at build time)");
}
ExecContext::~ExecContext() = default;
void* ExecContext::scratch(ScratchSlot, size_t) const {
  MF_FAIL("this moefold was built without CUDA (no nvcc at build time)");
}
void ExecContext::synchronize() const {}
void ExecContext::wait_for(const ExecContext&) const {}

#endif

ExecLibraryState& ExecContext::library(ExecLibrary which,
                                       std::unique_ptr<ExecLibraryState> (*make)(const ExecContext&)) const {
  std::unique_ptr<ExecLibraryState>& l = buffers_->libraries[static_cast<int>(which)];
  if (!l) l = make(*this);
  return *l;
}

}  // namespace moefold
