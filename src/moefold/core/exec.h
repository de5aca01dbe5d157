// Where ops run: the execution context (DESIGN: "Execution context"). On a GPU one CUDA stream
// with its own scratch buffers and library state (cuBLASLt handle and workspace, cuDNN handle),
// and the kernel choices of the run's [kernels] config; on the CPU the calling thread. Passed
// down explicitly, never looked up: the trainer makes one, hands it to the Memory its modules
// bind through (Memory::exec()), and every op takes it as its first argument. Two contexts on one
// GPU run concurrently (two micro-batches in flight, a shared expert beside the routed experts, a
// copy stream); work crosses from one to another only through wait_for.
#pragma once

#include <cstddef>
#include <memory>

#include "moefold/core/kernel_options.h"
#include "moefold/core/tensor.h"

namespace moefold {

// Grow-only device scratch of the CUDA ops that take no workspace (partial sums of a reduction,
// the temporaries of a plan): one buffer per slot and context, reused by every call that needs no
// more bytes, so once the first step has sized them the step loop allocates nothing.
enum class ScratchSlot : int {
  sum_squares,
  cross_entropy,
  router_loss,
  permute_plan,
  attention,
  grouped_gemm_args,
  grouped_gemm_workspace,
  fp8_operand_a,  // an FP8 GEMM's quantized A operand and its scales (ops/cuda/fp8_gemm_cutlass.cu)
  fp8_operand_b,  // its quantized B operand and scales
  fp8_gemm_args,  // its per-group CUTLASS arguments
  fp8_tile_map,   // the row tiles of fp8_quantize_cols' segments (ops/cuda/fp8_quantize.cu)
  rmsnorm_dw,     // rmsnorm_backward's dw partial sums per chunk of rows (ops/cuda/rmsnorm.cu)
  // Arrival counters of the one-launch reductions (a block's partial sum, then the last block to
  // arrive adds them in order: rmsnorm_backward, the router losses). ZEROED when (re)allocated,
  // and every kernel that uses them leaves them zero again (the ops run in stream order).
  arrivals,
  count
};

// A library's per-context state (handles, workspaces): made by the library's own code on first
// use in a context, destroyed with the context (before its stream).
struct ExecLibraryState {
  virtual ~ExecLibraryState() = default;
};
enum class ExecLibrary : int { cublaslt, cublaslt_fp8, cudnn, cutlass, count };

class ExecContext {
 public:
  // Which stream a CUDA context runs on: the process's primary stream (the one tensor copies,
  // communicators and the profiler order themselves with: core/device.h), or a new one of its own.
  // none: a planning context (moefold plan): it names the device a Memory measures for and
  // nothing may run on it (no GPU needed; scratch refuses).
  enum class Stream : uint8_t { primary, own, none };

  // cpu: ops on the calling thread. cuda (REQUIRES: a CUDA build and a GPU): the current GPU.
  explicit ExecContext(Device device, const KernelOptions& kernels = {}, Stream stream = Stream::primary);
  ~ExecContext();  // waits for the stream's work, then frees scratch, library state and an own stream
  ExecContext(const ExecContext&) = delete;
  ExecContext& operator=(const ExecContext&) = delete;

  // A context on the primary stream with default kernel choices, one per device for the whole
  // process (never destroyed): for tests and tools that run a few ops outside a trainer.
  static const ExecContext& standard(Device device);

  Device device() const { return device_; }
  const KernelOptions& kernels() const { return kernels_; }
  // The cudaStream_t (as void*, so this header needs no CUDA headers); null on the CPU.
  void* stream() const { return stream_; }

  // Device memory of `bytes` or more for `slot`, valid until the next call for that slot on this
  // context; only this context's stream may use it (arrivals: zeroed when it grows).
  // REQUIRES: a CUDA context.
  void* scratch(ScratchSlot slot, size_t bytes) const;
  // The bytes `slot`'s scratch holds now (0 before its first use).
  size_t scratch_bytes(ScratchSlot slot) const;
  // This context's state of `library`, made by `make` on first use.
  ExecLibraryState& library(ExecLibrary library, std::unique_ptr<ExecLibraryState> (*make)(const ExecContext&)) const;
  template <class T>
  T& library(ExecLibrary which) const {
    return static_cast<T&>(library(
        which, [](const ExecContext& c) -> std::unique_ptr<ExecLibraryState> { return std::make_unique<T>(c); }));
  }

  // The host waits for everything queued on this context.
  void synchronize() const;
  // Work queued on this context from now on starts after everything queued on `other` so far.
  void wait_for(const ExecContext& other) const;

 private:
  struct Buffers;
  Device device_;
  KernelOptions kernels_;
  void* stream_ = nullptr;
  bool own_stream_ = false;
  bool planning_ = false;             // Stream::none
  std::unique_ptr<Buffers> buffers_;  // scratch, library state, the event of wait_for
};

}  // namespace moefold
