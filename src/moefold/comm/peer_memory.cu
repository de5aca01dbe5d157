// PeerMemory over CUDA IPC (GPUs of one host): every rank's peer-visible block and a small flag
// buffer are mapped by every other rank; copies are cudaMemcpyAsync on a copy stream (copy
// engines), completion is a sequence number written into the peers' flag buffers by a one-block
// kernel, and waiting is a one-block kernel that polls the flags (with a timeout that names the
// rank and the flag before it traps).
#include <cuda_runtime.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "moefold/comm/communicator.h"
#include "moefold/comm/peer_memory.h"
#include "moefold/core/cuda_check.h"
#include "moefold/core/device.h"

namespace moefold {
namespace {

constexpr int kMaxRanks = 16;  // GPUs of one host
// Flags of a rank: [kind][source rank] sequence numbers; kind 0: the source's pushes of that call
// have landed here, kind 1: the source has reached that pull call (its data is ready).
constexpr int kLanded = 0, kReady = 1;

struct FlagTargets {
  unsigned long long* flag[kMaxRanks];
  int n;
};

__global__ void signal_kernel(FlagTargets t, unsigned long long seq) {
  __threadfence_system();  // this stream's earlier writes are visible before the flag
  const int i = static_cast<int>(threadIdx.x);
  if (i < t.n) *reinterpret_cast<volatile unsigned long long*>(t.flag[i]) = seq;
  __threadfence_system();
}

__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Thread i waits until flags[i] >= seq (i != skip).
__global__ void wait_kernel(const unsigned long long* flags, int n, int skip, unsigned long long seq,
                            unsigned long long timeout_ns, int rank) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= n || i == skip) return;
  const volatile unsigned long long* f = flags + i;
  const unsigned long long start = global_ns();
  while (*f < seq) {
    if (global_ns() - start > timeout_ns) {
      printf("moefold: rank %d: peer rank %d did not reach exchange %llu within %.0f s (flag %llu): aborting\n", rank,
             i, seq, static_cast<double>(timeout_ns) * 1e-9, *f);
      __trap();
    }
    __nanosleep(256);
  }
  __threadfence();
}

cudaStream_t compute() { return static_cast<cudaStream_t>(primary_stream()); }

// 64 bytes as 8 i64, for the host-side all_gather.
template <class T>
std::array<int64_t, 8> as_words(const T& v) {
  static_assert(sizeof(T) <= 64);
  std::array<int64_t, 8> w{};
  std::memcpy(w.data(), &v, sizeof(T));
  return w;
}

class CudaPeerMemory final : public PeerMemory {
 public:
  CudaPeerMemory(Communicator& group, void* block, size_t bytes)
      : rank_(group.rank()), size_(group.size()), timeout_s_(group.timeout_s()), block_(block), bytes_(bytes) {
    const size_t p_n = static_cast<size_t>(size_);
    flags_ = static_cast<unsigned long long*>(device_malloc(2 * p_n * sizeof(unsigned long long)));
    device_zero(flags_, 2 * p_n * sizeof(unsigned long long));
    MF_CUDA_CHECK(cudaDeviceSynchronize());  // the flags are zero before any peer can see them
    cudaIpcMemHandle_t handles[2];
    MF_CUDA_CHECK(cudaIpcGetMemHandle(&handles[0], block));
    MF_CUDA_CHECK(cudaIpcGetMemHandle(&handles[1], flags_));
    std::vector<int64_t> mine(16), all(16 * p_n);
    const std::array<int64_t, 8> h0 = as_words(handles[0]), h1 = as_words(handles[1]);
    std::copy(h0.begin(), h0.end(), mine.begin());
    std::copy(h1.begin(), h1.end(), mine.begin() + 8);
    group.all_gather(Tensor(mine.data(), DType::i64, {1, 16}), Tensor(all.data(), DType::i64, {size_, 16}));
    peer_block_.assign(p_n, nullptr);
    peer_flags_.assign(p_n, nullptr);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) {
        peer_block_[static_cast<size_t>(q)] = static_cast<char*>(block);
        peer_flags_[static_cast<size_t>(q)] = flags_;
        continue;
      }
      cudaIpcMemHandle_t hb, hf;
      std::memcpy(&hb, all.data() + 16 * q, sizeof hb);
      std::memcpy(&hf, all.data() + 16 * q + 8, sizeof hf);
      void* pb = nullptr;
      void* pf = nullptr;
      MF_CUDA_CHECK(cudaIpcOpenMemHandle(&pb, hb, cudaIpcMemLazyEnablePeerAccess));
      MF_CUDA_CHECK(cudaIpcOpenMemHandle(&pf, hf, cudaIpcMemLazyEnablePeerAccess));
      peer_block_[static_cast<size_t>(q)] = static_cast<char*>(pb);
      peer_flags_[static_cast<size_t>(q)] = static_cast<unsigned long long*>(pf);
    }
    int least = 0, greatest = 0;
    MF_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    MF_CUDA_CHECK(cudaStreamCreateWithPriority(&copy_, cudaStreamNonBlocking, greatest));
    MF_CUDA_CHECK(cudaEventCreateWithFlags(&start_, cudaEventDisableTiming));
    for (cudaEvent_t& e : pulled_) MF_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    // Every rank has mapped every block before any copy can target it.
    int32_t one = 1;
    group.all_reduce(Tensor(&one, DType::i32, {1}), ReduceOp::sum);
  }
  ~CudaPeerMemory() override {
    cudaStreamSynchronize(copy_);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      cudaIpcCloseMemHandle(peer_block_[static_cast<size_t>(q)]);
      cudaIpcCloseMemHandle(peer_flags_[static_cast<size_t>(q)]);
    }
    for (cudaEvent_t e : pulled_) cudaEventDestroy(e);
    cudaEventDestroy(start_);
    cudaStreamDestroy(copy_);
    device_free(flags_);
  }
  CudaPeerMemory(const CudaPeerMemory&) = delete;
  CudaPeerMemory& operator=(const CudaPeerMemory&) = delete;

  void* block() const override { return block_; }
  size_t block_bytes() const override { return bytes_; }

  int64_t push(const std::vector<Push>& pushes) override {
    const int64_t seq = ++push_seq_;
    copy_after_compute();
    for (const Push& p : pushes) copy(p.peer, p.src, p.dst_offset, true);
    signal(kLanded, seq, copy_);
    return 2 * seq;
  }

  int64_t pull(const std::vector<Pull>& pulls) override {
    const int64_t seq = ++pull_seq_;
    signal(kReady, seq, compute());
    copy_after_compute();
    wait_flags(kReady, seq, copy_);
    for (const Pull& p : pulls) copy(p.peer, p.dst, p.src_offset, false);
    MF_CUDA_CHECK(cudaEventRecord(pulled_[static_cast<size_t>(seq % kPulled)], copy_));
    return 2 * seq + 1;
  }

  void wait(int64_t ticket) override {
    const int64_t seq = ticket / 2;
    if (ticket % 2 == 0) {
      MF_CHECK(seq >= 1 && seq <= push_seq_, "PeerMemory wait: push ticket ", ticket, " not handed out");
      wait_flags(kLanded, seq, compute());
      return;
    }
    MF_CHECK(seq >= 1 && seq <= pull_seq_ && seq > pull_seq_ - kPulled, "PeerMemory wait: pull ticket ", ticket,
             " is not one of the last ", kPulled);
    MF_CUDA_CHECK(cudaStreamWaitEvent(compute(), pulled_[static_cast<size_t>(seq % kPulled)], 0));
  }

 private:
  // On the copy stream: the rows of `local` to peer `peer`'s block at `offset` (push), or from there
  // into `local` (pull).
  void copy(int peer, const Tensor& local, size_t offset, bool push) {
    const char* what = push ? "push" : "pull";
    MF_CHECK(peer >= 0 && peer < size_ && peer != rank_, "PeerMemory ", what, ": peer ", peer, " of ", size_, " (rank ",
             rank_, ")");
    MF_CHECK(local.device() == Device::cuda && local.contiguous(), "PeerMemory ", what, ": ", local.str(),
             " must be a contiguous GPU tensor");
    const size_t n = local.nbytes();
    MF_CHECK(offset + n <= bytes_, "PeerMemory ", what, ": ", n, " bytes at ", offset, " past the ", bytes_,
             "-byte block");
    if (n == 0) return;
    char* remote = peer_block_[static_cast<size_t>(peer)] + offset;
    MF_CUDA_CHECK(cudaMemcpyAsync(push ? static_cast<void*>(remote) : local.data(),
                                  push ? local.data() : static_cast<const void*>(remote), n, cudaMemcpyDeviceToDevice,
                                  copy_));
  }
  void copy_after_compute() {
    MF_CUDA_CHECK(cudaEventRecord(start_, compute()));
    MF_CUDA_CHECK(cudaStreamWaitEvent(copy_, start_, 0));
  }
  // Writes seq into flag [kind][rank_] of every peer.
  void signal(int kind, int64_t seq, cudaStream_t stream) {
    FlagTargets t{};
    for (int q = 0; q < size_; ++q)
      if (q != rank_) t.flag[t.n++] = peer_flags_[static_cast<size_t>(q)] + kind * size_ + rank_;
    if (t.n == 0) return;
    signal_kernel<<<1, 32, 0, stream>>>(t, static_cast<unsigned long long>(seq));
    MF_CUDA_CHECK(cudaGetLastError());
  }
  // `stream` waits until every peer's flag [kind][peer] here reaches seq.
  void wait_flags(int kind, int64_t seq, cudaStream_t stream) {
    if (size_ == 1) return;
    wait_kernel<<<1, 32, 0, stream>>>(flags_ + kind * size_, size_, rank_, static_cast<unsigned long long>(seq),
                                      static_cast<unsigned long long>(timeout_s_ * 1e9), rank_);
    MF_CUDA_CHECK(cudaGetLastError());
  }

  int rank_, size_;
  double timeout_s_;
  void* block_;
  size_t bytes_;
  unsigned long long* flags_ = nullptr;  // this rank's [2][size] flags
  std::vector<char*> peer_block_;        // every rank's block in this address space
  std::vector<unsigned long long*> peer_flags_;
  cudaStream_t copy_ = nullptr;
  cudaEvent_t start_ = nullptr;
  static constexpr int64_t kPulled = 64;
  std::array<cudaEvent_t, kPulled> pulled_{};
  int64_t push_seq_ = 0, pull_seq_ = 0;
};

}  // namespace

// Collective over `group` (one GPU per rank). Null on every rank unless every rank is on this
// host, on its own GPU, and every pair of GPUs can access each other (CUDA peer access).
std::unique_ptr<PeerMemory> make_cuda_peer_memory(Communicator& group, void* block, size_t bytes) {
  const int p_n = group.size();
  int device = 0;
  MF_CUDA_CHECK(cudaGetDevice(&device));
  struct Id {
    char host[40];
    char bus[24];
  } id{};
  gethostname(id.host, sizeof id.host - 1);
  MF_CUDA_CHECK(cudaDeviceGetPCIBusId(id.bus, sizeof id.bus, device));
  std::vector<int64_t> all(8 * static_cast<size_t>(p_n));
  const std::array<int64_t, 8> mine = as_words(id);
  group.all_gather(Tensor(const_cast<int64_t*>(mine.data()), DType::i64, {1, 8}),
                   Tensor(all.data(), DType::i64, {p_n, 8}));
  int32_t ok = p_n <= kMaxRanks && block != nullptr ? 1 : 0;
  int64_t sizes[2] = {static_cast<int64_t>(bytes), -static_cast<int64_t>(bytes)};
  for (int q = 0; q < p_n && ok; ++q) {
    Id peer{};
    std::memcpy(&peer, all.data() + 8 * q, sizeof peer);
    if (q == group.rank()) continue;
    int peer_device = -1, can = 0;
    if (std::strncmp(peer.host, id.host, sizeof id.host) != 0 || std::strncmp(peer.bus, id.bus, sizeof id.bus) == 0 ||
        cudaDeviceGetByPCIBusId(&peer_device, peer.bus) != cudaSuccess ||
        cudaDeviceCanAccessPeer(&can, device, peer_device) != cudaSuccess || can == 0) {
      cudaGetLastError();  // clear a failed lookup
      ok = 0;
    }
  }
  group.all_reduce(Tensor(&ok, DType::i32, {1}), ReduceOp::sum);
  group.all_reduce(Tensor(sizes, DType::i64, {2}), ReduceOp::max);
  if (ok != p_n) return nullptr;
  MF_CHECK(sizes[0] == -sizes[1], "map_peer_memory: the ranks of group '", group.name(),
           "' have peer-visible blocks of different sizes (", -sizes[1], " to ", sizes[0],
           " bytes): they must bind the same modules");
  return std::make_unique<CudaPeerMemory>(group, block, bytes);
}

}  // namespace moefold
