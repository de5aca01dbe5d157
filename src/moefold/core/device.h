// The GPU runtime as the rest of moefold sees it: device count, device memory, copies, the
// stream every CUDA op runs on, and peak-memory accounting. Built against the CUDA runtime when
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
// Grow-only device scratch for CUDA ops that take no workspace (partial sums of a reduction, the
// temporaries of a plan): one buffer per slot, reused by every call that needs no more bytes,
// so once the first step has sized them the step loop allocates nothing. Only work on
// compute_stream() may use it; a slot's buffer is valid until the next call for that slot.
enum class ScratchSlot : int {
  sum_squares,
  cross_entropy,
  router_loss,
  permute_plan,
  vocab_parallel,
  attention,
  grouped_gemm_args,
  grouped_gemm_workspace,
  count
};
void* device_scratch(ScratchSlot slot, size_t bytes);
// Bytes obtained through device_malloc and not yet freed, and their peak since start (or the
// last reset): the planned GPU memory.
size_t device_bytes_in_use();
size_t device_bytes_peak();
void reset_device_bytes_peak();

// The stream every moefold CUDA op and copy runs on (one per process for now; as a void* so
// that this header needs no CUDA headers). Its work is ordered; the host waits only in
// device_synchronize and in copies to the host.
void* compute_stream();
void device_synchronize();

// Elapsed time of the work queued on the compute stream between two marks (CUDA events; on a
// CPU-only build or for CPU work, host wall time): benchmarks, never the step loop.
class StreamTimer {
 public:
  StreamTimer();
  ~StreamTimer();
  StreamTimer(const StreamTimer&) = delete;
  StreamTimer& operator=(const StreamTimer&) = delete;
  // Marks the start / the end on the compute stream (host clock when `device` is cpu).
  void start(Device device);
  void stop();
  // Milliseconds between start and stop (waits for the stop mark).
  double elapsed_ms() const;

 private:
  Device device_ = Device::cpu;
  void* events_[2] = {nullptr, nullptr};
  double host_start_ = 0, host_stop_ = 0;
};

// Copies `bytes` between any two of host and device memory on the compute stream; a copy to
// the host waits for it.
void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
// The same for `rows` rows of `row_bytes` each, `src_pitch` bytes apart in src and `dst_pitch`
// bytes apart in dst (cudaMemcpy2DAsync; on the host one memcpy per row). REQUIRES: pitches
// >= row_bytes; the rows of dst and src overlap only when both are contiguous (pitch ==
// row_bytes).
void device_copy_2d(void* dst, size_t dst_pitch, Device dst_device, const void* src, size_t src_pitch,
                    Device src_device, size_t row_bytes, size_t rows);
// Sets `bytes` of device memory to zero on the compute stream.
void device_zero(void* p, size_t bytes);

}  // namespace moefold
