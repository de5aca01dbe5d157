// The GPU runtime as the rest of moefold sees it: device count, device memory, copies, the
// primary stream, and peak-memory accounting. Built against the CUDA runtime when
// nvcc was found (MOEFOLD_WITH_CUDA); otherwise every call that would need a GPU fails with one
// clear line and cuda_device_count() is 0, so CPU-only builds run everything else unchanged.
#pragma once

#include <cstddef>
#include <cstdint>

#include "moefold/core/tensor.h"

namespace moefold {

// Whether this build contains the CUDA backend.
bool cuda_built();
// GPUs visible to this process (0 without CUDA, without a driver or without a GPU).
int cuda_device_count();
// Selects the GPU of this process (REQUIRES: 0 <= device < cuda_device_count()).
void cuda_set_device(int device);
// "NVIDIA H200 (sm_90, 132 SMs, 141 GiB)" or "none".
std::string cuda_device_name();

// Device memory (cudaMalloc / cudaFree): used only when memory is planned (arenas), never in a
// step loop. Fails with the bytes asked for and the bytes free.
void* device_malloc(size_t bytes);
void device_free(void* p);
// Calls of device_malloc so far (a step loop that allocates shows up here).
int64_t device_malloc_count();
// Bytes obtained through device_malloc and not yet freed, and their peak since start (or the
// last reset): the planned GPU memory.
size_t device_bytes_in_use();
size_t device_bytes_peak();
void reset_device_bytes_peak();

// The process's primary stream (as a void* so that this header needs no CUDA headers): tensor
// copies below, the communicators and the profiler run on it, and so do the ops of every
// execution context made on it (core/exec.h: a trainer's). Its work is ordered; the host waits
// only in device_synchronize and in copies to the host. Ops never use it implicitly: they run on
// the stream of the context they are given.
void* primary_stream();
void device_synchronize();

// Page-locked host memory (cudaHostAlloc; plain 64-byte aligned memory in a CPU-only build), so
// that copies between it and the GPU run asynchronously on the copy engines.
void* pinned_host_malloc(size_t bytes);
void pinned_host_free(void* p);
// device_copy without the host waiting, also to the host: the copy is done once a StreamFence
// recorded on `stream` after it has been waited for. REQUIRES: host memory pinned (else CUDA
// copies synchronously).
void device_copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes, void* stream);
// A point in a stream's work the host can wait for (a CUDA event; nothing to wait for without CUDA).
class StreamFence {
 public:
  StreamFence() = default;
  ~StreamFence();
  StreamFence(const StreamFence&) = delete;
  StreamFence& operator=(const StreamFence&) = delete;
  StreamFence(StreamFence&& o) noexcept : event_(o.event_) { o.event_ = nullptr; }
  // Marks the work queued on `stream` so far (the event is made on first use).
  void record(void* stream);
  // The host waits until the marked work is done (no-op before any record).
  void wait() const;

 private:
  void* event_ = nullptr;
};

// Elapsed time of the work queued on the primary stream between two marks (CUDA events; on a
// CPU-only build or for CPU work, host wall time): benchmarks, never the step loop.
class StreamTimer {
 public:
  StreamTimer();
  ~StreamTimer();
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;
  // Marks the start / the end on the primary stream (host clock when `device` is cpu).
  void start(Device device);
  void stop();
  // Milliseconds between start and stop (waits for the stop mark).
  double elapsed_ms() const;

 private:
  Device device_ = Device::cpu;
  void* events_[2] = {nullptr, nullptr};
  double host_start_ = 0, host_stop_ = 0;
};

// Copies `bytes` between any two of host and device memory on the primary stream; a copy to
// the host waits for it.
// `stream`: a cudaStream_t to run on instead (an execution context's, ExecContext::stream()).
void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                 void* stream = nullptr);
// The same for `rows` rows of `row_bytes` each, `src_pitch` bytes apart in src and `dst_pitch`
// bytes apart in dst (cudaMemcpy2DAsync; on the host one memcpy per row). REQUIRES: pitches
// >= row_bytes; the rows of dst and src overlap only when both are contiguous (pitch ==
// row_bytes).
void device_copy_2d(void* dst, size_t dst_pitch, Device dst_device, const void* src, size_t src_pitch,
                    Device src_device, size_t row_bytes, size_t rows, void* stream = nullptr);
// Sets `bytes` of device memory to zero on the primary stream (or on `stream`).
void device_zero(void* p, size_t bytes, void* stream = nullptr);

}  // namespace moefold
