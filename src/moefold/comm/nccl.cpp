// NcclCommunicator; see nccl.h. The TCP rendezvous of the environment bootstrap is a plain
// blocking socket exchange of the 128-byte ncclUniqueId, with the communicator's timeout.
#include "moefold/comm/nccl.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "moefold/comm/comm_checks.h"
#include "moefold/comm/mpi.h"
#include "moefold/comm/peer_memory.h"
#include "moefold/core/device.h"

#ifdef MOEFOLD_WITH_CUDA
#include <nccl.h>

#include "moefold/core/cuda_check.h"
#endif

namespace moefold {

namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int dflt) {
  const char* v = env(name);
  return v ? std::atoi(v) : dflt;
}

}  // namespace

bool launched_by_torchrun() {
  return env("RANK") && env("WORLD_SIZE") && env("MASTER_ADDR") && !env("OMPI_COMM_WORLD_SIZE") && !env("PMI_SIZE") &&
         !env("PMIX_RANK");
}

int local_rank_from_env() {
  for (const char* name : {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"})
    if (env(name)) return env_int(name, 0);
  return 0;
}

#ifdef MOEFOLD_WITH_CUDA

namespace {

using comm_detail::row_elems;
using Clock = std::chrono::steady_clock;

#define MF_NCCL(expr)                                                                              \
  do {                                                                                             \
    const ncclResult_t mf_rc_ = (expr);                                                            \
    if (mf_rc_ != ncclSuccess) MF_FAIL("NCCL error in ", #expr, ": ", ncclGetErrorString(mf_rc_)); \
  } while (0)

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::f64:
      return ncclFloat64;
    case DType::bf16:
      return ncclBfloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
    default:
      break;
  }
  MF_FAIL("NCCL: dtype ", dtype_name(t), " is not supported");
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::sum ? ncclSum : ncclMax; }

cudaStream_t compute() { return static_cast<cudaStream_t>(primary_stream()); }

constexpr size_t kStagingBytes = 8 << 20;  // host tensors through NCCL: losses, loads, flags, counts

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, std::string name, double timeout_s, int world_rank)
      : comm_(comm), name_(std::move(name)), timeout_s_(timeout_s), world_rank_(world_rank) {
    MF_NCCL(ncclCommUserRank(comm_, &rank_));
    MF_NCCL(ncclCommCount(comm_, &size_));
    // The highest priority: a transfer started beside the compute stream's kernels gets its
    // blocks scheduled as soon as SMs free up, not after the queued compute.
    int least = 0, greatest = 0;
    MF_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    MF_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
    MF_CUDA_CHECK(cudaEventCreateWithFlags(&before_, cudaEventDisableTiming));
    MF_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
    for (cudaEvent_t& e : started_) MF_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    staging_ = device_malloc(kStagingBytes);
  }
  ~NcclCommunicator() override {
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaEventDestroy(before_);
    cudaEventDestroy(after_);
    for (cudaEvent_t e : started_) cudaEventDestroy(e);
    cudaStreamDestroy(stream_);
    device_free(staging_);
  }
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank() const override { return world_rank_; }
  const std::string& name() const override { return name_; }
  double timeout_s() const override { return timeout_s_; }

  void all_reduce(const Tensor& buf, ReduceOp op) override {
    comm_detail::check_buffer(buf, "all_reduce", "buf", true);
    with_device({&buf}, {&buf}, "all_reduce", [&](const std::vector<Tensor>& d) {
      MF_NCCL(
          ncclAllReduce(d[0].data(), d[0].data(), d[0].numel(), nccl_type(buf.dtype()), nccl_op(op), comm_, stream_));
    });
  }

  void all_gather(const Tensor& send, const Tensor& recv) override {
    comm_detail::check_all_gather(send, recv, size_, true);
    with_device({&send, &recv}, {&recv}, "all_gather", [&](const std::vector<Tensor>& d) {
      MF_NCCL(ncclAllGather(d[0].data(), d[1].data(), send.numel(), nccl_type(send.dtype()), comm_, stream_));
    });
  }

  void reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    comm_detail::check_reduce_scatter(send, recv, size_, true);
    with_device({&send, &recv}, {&recv}, "reduce_scatter", [&](const std::vector<Tensor>& d) {
      MF_NCCL(ncclReduceScatter(d[0].data(), d[1].data(), recv.numel(), nccl_type(send.dtype()), nccl_op(op), comm_,
                                stream_));
    });
  }

  void all_to_all_v(const Tensor& send, const int64_t* send_counts, const Tensor& recv,
                    const int64_t* recv_counts) override {
    comm_detail::check_all_to_all_v(send, send_counts, recv, recv_counts, size_, true);
    const int64_t row = row_elems(send), esize = static_cast<int64_t>(dtype_size(send.dtype()));
    with_device({&send, &recv}, {&recv}, "all_to_all_v", [&](const std::vector<Tensor>& d) {
      // Grouped send/recv: one NCCL launch for every peer (the self block too).
      MF_NCCL(ncclGroupStart());
      int64_t soff = 0, roff = 0;
      for (int p = 0; p < size_; ++p) {
        if (send_counts[p] > 0)
          MF_NCCL(ncclSend(static_cast<const char*>(d[0].data()) + soff * row * esize, send_counts[p] * row,
                           nccl_type(send.dtype()), p, comm_, stream_));
        if (recv_counts[p] > 0)
          MF_NCCL(ncclRecv(static_cast<char*>(d[1].data()) + roff * row * esize, recv_counts[p] * row,
                           nccl_type(recv.dtype()), p, comm_, stream_));
        soff += send_counts[p];
        roff += recv_counts[p];
      }
      MF_NCCL(ncclGroupEnd());
    });
  }

  int64_t start_exchange(const std::vector<Transfer>& transfers) override {
    comm_detail::check_exchange(transfers, size_, true);
    for (const Transfer& t : transfers)
      MF_CHECK(t.send.device() == Device::cuda && t.recv.device() == Device::cuda, "start_exchange on group '", name_,
               "': send ", t.send.str(), " and recv ", t.recv.str(), " must be GPU tensors");
    MF_CUDA_CHECK(cudaEventRecord(before_, compute()));
    MF_CUDA_CHECK(cudaStreamWaitEvent(stream_, before_, 0));
    MF_NCCL(ncclGroupStart());
    for (const Transfer& t : transfers) {
      const int64_t row = row_elems(t.send);
      if (t.send.size(0) > 0)
        MF_NCCL(ncclSend(t.send.data(), t.send.size(0) * row, nccl_type(t.send.dtype()), t.peer, comm_, stream_));
      if (t.recv.size(0) > 0)
        MF_NCCL(ncclRecv(t.recv.data(), t.recv.size(0) * row, nccl_type(t.recv.dtype()), t.peer, comm_, stream_));
    }
    MF_NCCL(ncclGroupEnd());
    return ticket_after();
  }
  int64_t start_send(const Tensor& buf, int peer) override { return start_p2p(buf, peer, true); }
  int64_t start_recv(const Tensor& buf, int peer) override { return start_p2p(buf, peer, false); }
  int64_t start_all_reduce(const Tensor& buf, ReduceOp op) override {
    comm_detail::check_buffer(buf, "start_all_reduce", "buf", true);
    MF_CHECK(buf.device() == Device::cuda, "start_all_reduce on group '", name_, "': ", buf.str(),
             " must be a GPU tensor");
    MF_CUDA_CHECK(cudaEventRecord(before_, compute()));
    MF_CUDA_CHECK(cudaStreamWaitEvent(stream_, before_, 0));
    MF_NCCL(ncclAllReduce(buf.data(), buf.data(), buf.numel(), nccl_type(buf.dtype()), nccl_op(op), comm_, stream_));
    return ticket_after();
  }
  int64_t start_reduce_scatter(const Tensor& buf, ReduceOp op) override {
    const int64_t n = in_place_block(buf, "start_reduce_scatter");
    char* base = static_cast<char*>(buf.data());
    const size_t block_bytes = static_cast<size_t>(n) * dtype_size(buf.dtype());
    MF_NCCL(
        ncclReduceScatter(base, base + rank_ * block_bytes, n, nccl_type(buf.dtype()), nccl_op(op), comm_, stream_));
    return ticket_after();
  }
  int64_t start_all_gather(const Tensor& buf) override {
    const int64_t n = in_place_block(buf, "start_all_gather");
    char* base = static_cast<char*>(buf.data());
    const size_t block_bytes = static_cast<size_t>(n) * dtype_size(buf.dtype());
    MF_NCCL(ncclAllGather(base + rank_ * block_bytes, base, n, nccl_type(buf.dtype()), comm_, stream_));
    return ticket_after();
  }
  void wait(int64_t ticket) override {
    MF_CHECK(ticket >= 0 && ticket < next_ticket_ && ticket >= next_ticket_ - kStarted, "wait on group '", name_,
             "': ticket ", ticket, " is not one of the last ", kStarted, " exchanges (", next_ticket_, " started)");
    MF_CUDA_CHECK(cudaStreamWaitEvent(compute(), started_[static_cast<size_t>(ticket % kStarted)], 0));
  }
  std::unique_ptr<PeerMemory> map_peer_memory(void* block, size_t bytes) override {
    return make_cuda_peer_memory(*this, block, bytes);
  }
  void all_to_all(const Tensor& send, const Tensor& recv) override {
    comm_detail::check_all_to_all(send, recv, size_, true);
    std::vector<int64_t> counts(static_cast<size_t>(size_), send.size(0) / size_);
    all_to_all_v(send, counts.data(), recv, counts.data());
  }

  void broadcast(const Tensor& buf, int root) override {
    comm_detail::check_buffer(buf, "broadcast", "buf", true);
    MF_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " of ", size_);
    with_device({&buf}, {&buf}, "broadcast", [&](const std::vector<Tensor>& d) {
      MF_NCCL(ncclBroadcast(d[0].data(), d[0].data(), buf.numel(), nccl_type(buf.dtype()), root, comm_, stream_));
    });
  }

  void send(const Tensor& buf, int peer, int /*tag*/) override {
    comm_detail::check_buffer(buf, "send", "buf", true);
    with_device({&buf}, {}, "send", [&](const std::vector<Tensor>& d) {
      MF_NCCL(ncclSend(d[0].data(), buf.numel(), nccl_type(buf.dtype()), peer, comm_, stream_));
    });
  }

  void recv(const Tensor& buf, int peer, int /*tag*/) override {
    comm_detail::check_buffer(buf, "recv", "buf", true);
    with_device({&buf}, {&buf}, "recv", [&](const std::vector<Tensor>& d) {
      MF_NCCL(ncclRecv(d[0].data(), buf.numel(), nccl_type(buf.dtype()), peer, comm_, stream_));
    });
  }

  void barrier() override {
    int32_t one = 1;
    all_reduce(Tensor(&one, DType::i32, {1}), ReduceOp::sum);  // host tensor: waits, with the timeout
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    ncclComm_t sub = nullptr;
    MF_NCCL(ncclCommSplit(comm_, color, key, &sub, nullptr));
    return std::make_unique<NcclCommunicator>(sub, name, timeout_s_, world_rank_);
  }

 private:
  // Runs `op` on device tensors: host tensors among `in` are staged into the staging buffer
  // (in order), the communicator stream waits for the compute stream, and the compute stream
  // for it; host tensors among `out` are copied back, waiting at most timeout_s(). Host tensors
  // larger than the staging buffer (checkpoint gathers, outside the step loop) get a temporary
  // device buffer for the call.
  template <class Op>
  void with_device(std::initializer_list<const Tensor*> in, std::initializer_list<const Tensor*> out, const char* what,
                   Op&& op) {
    auto staged_bytes = [](const Tensor& t) { return (static_cast<size_t>(t.nbytes()) + 255) / 256 * 256; };
    size_t need = 0;
    for (const Tensor* t : in)
      if (t->device() != Device::cuda) need += staged_bytes(*t);
    struct Temp {
      void* p = nullptr;
      ~Temp() {
        if (p) {
          cudaStreamSynchronize(static_cast<cudaStream_t>(primary_stream()));
          device_free(p);
        }
      }
    } temp;
    char* base = static_cast<char*>(staging_);
    if (need > kStagingBytes) base = static_cast<char*>(temp.p = device_malloc(need));
    std::vector<Tensor> dev;
    size_t used = 0;
    for (const Tensor* t : in) {
      if (t->device() == Device::cuda) {
        dev.push_back(*t);
        continue;
      }
      Tensor d(base + used, t->dtype(), t->shape(), Device::cuda);
      d.copy_from(*t);  // on the compute stream
      dev.push_back(d);
      used += staged_bytes(*t);
    }
    MF_CUDA_CHECK(cudaEventRecord(before_, compute()));
    MF_CUDA_CHECK(cudaStreamWaitEvent(stream_, before_, 0));
    op(dev);
    MF_CUDA_CHECK(cudaEventRecord(after_, stream_));
    MF_CUDA_CHECK(cudaStreamWaitEvent(compute(), after_, 0));
    if (need == 0) return;
    wait_or_abort(what);
    size_t i = 0;
    for (const Tensor* t : in) {
      for (const Tensor* o : out)
        if (o == t && t->device() == Device::cpu) t->copy_from(dev[i]);
      ++i;
    }
  }

  // The in-place collectives' checks and ordering: `buf` a GPU tensor of size_ equal blocks (the
  // block's elements returned); the communicator's stream waits for the compute stream.
  int64_t in_place_block(const Tensor& buf, const char* op) {
    comm_detail::check_buffer(buf, op, "buf", true);
    MF_CHECK(buf.device() == Device::cuda, op, " on group '", name_, "': ", buf.str(), " must be a GPU tensor");
    MF_CHECK(buf.numel() % size_ == 0, op, " on group '", name_, "': ", buf.str(), " is not ", size_, " equal blocks");
    MF_CUDA_CHECK(cudaEventRecord(before_, compute()));
    MF_CUDA_CHECK(cudaStreamWaitEvent(stream_, before_, 0));
    return buf.numel() / size_;
  }

  int64_t start_p2p(const Tensor& buf, int peer, bool send) {
    const char* op = send ? "start_send" : "start_recv";
    comm_detail::check_buffer(buf, op, "buf", true);
    MF_CHECK(buf.device() == Device::cuda && peer >= 0 && peer < size_ && peer != rank_, op, " on group '", name_,
             "': ", buf.str(), " to peer ", peer, " (a GPU tensor, another rank of the group)");
    MF_CUDA_CHECK(cudaEventRecord(before_, compute()));
    MF_CUDA_CHECK(cudaStreamWaitEvent(stream_, before_, 0));
    if (send)
      MF_NCCL(ncclSend(buf.data(), buf.numel(), nccl_type(buf.dtype()), peer, comm_, stream_));
    else
      MF_NCCL(ncclRecv(buf.data(), buf.numel(), nccl_type(buf.dtype()), peer, comm_, stream_));
    return ticket_after();
  }

  // A ticket for the work queued so far on the communicator's stream (start_exchange,
  // start_all_reduce): its completion event, one of the last kStarted.
  int64_t ticket_after() {
    const int64_t ticket = next_ticket_++;
    MF_CUDA_CHECK(cudaEventRecord(started_[static_cast<size_t>(ticket % kStarted)], stream_));
    return ticket;
  }

  // Polls the communicator's last operation; past the deadline names itself and aborts.
  void wait_or_abort(const char* what) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
    const auto spin_until = Clock::now() + std::chrono::milliseconds(2);
    while (true) {
      const cudaError_t q = cudaEventQuery(after_);
      if (q == cudaSuccess) return liveness_end_wait();
      MF_CHECK(q == cudaErrorNotReady, what, " on group '", name_, "': ", cudaGetErrorString(q));
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        MF_FAIL(what, " on group '", name_, "': NCCL: ", ncclGetErrorString(async));
      const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
      if (left < 0) {
        std::fprintf(stderr, "moefold: rank %d: timeout after %gs in %s on group '%s' (rank %d of %d, NCCL)%s\n",
                     world_rank_, timeout_s_, what, name_.c_str(), rank_, size_, liveness_verdict().c_str());
        std::fflush(stderr);
        ncclCommAbort(comm_);
        std::_Exit(3);
      }
      // The first milliseconds spin (the counts of every EP dispatch wait here, and the GPU idles
      // until the host goes on); a long wait sleeps between polls.
      if (Clock::now() < spin_until) {
        std::this_thread::yield();
      } else {
        liveness_poll(left, timeout_s_);  // answers other ranks; asks them near the deadline
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
  }

  ncclComm_t comm_;
  std::string name_;
  double timeout_s_;
  int world_rank_ = 0, rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t before_ = nullptr, after_ = nullptr;
  // Completion events of the last kStarted started operations (start_exchange, start_all_reduce,
  // start_reduce_scatter, start_all_gather), by ticket: a step of a deep model keeps a gather per
  // layer pending until the next forward reaches it.
  static constexpr int64_t kStarted = 256;
  std::array<cudaEvent_t, kStarted> started_{};
  int64_t next_ticket_ = 0;
  void* staging_ = nullptr;
};

// Rank 0 listens on MASTER_PORT and hands the id to WORLD_SIZE - 1 connections; the others
// connect (retrying until the deadline, rank 0 may start later) and read it.
void rendezvous(ncclUniqueId* id, int rank, int world, double timeout_s) {
  const char* addr = env("MASTER_ADDR");
  const int port = env_int("MASTER_PORT", 29500);
  MF_CHECK(addr != nullptr, "NCCL bootstrap: MASTER_ADDR is not set");
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  if (rank == 0) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    MF_CHECK(fd >= 0, "NCCL bootstrap: socket: ", std::strerror(errno));
    int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    sa.sin_port = htons(static_cast<uint16_t>(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0 || ::listen(fd, world) != 0) {
      const std::string err = std::strerror(errno);
      ::close(fd);
      MF_FAIL("NCCL bootstrap: rank 0 cannot listen on MASTER_PORT=", port, ": ", err);
    }
    for (int served = 1; served < world; ++served) {
      const int c = ::accept(fd, nullptr, nullptr);
      MF_CHECK(c >= 0, "NCCL bootstrap: accept: ", std::strerror(errno));
      const bool ok = ::send(c, id, sizeof *id, 0) == static_cast<ssize_t>(sizeof *id);
      ::close(c);
      MF_CHECK(ok, "NCCL bootstrap: sending the id failed");
    }
    ::close(fd);
    return;
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  const std::string port_s = std::to_string(port);
  MF_CHECK(::getaddrinfo(addr, port_s.c_str(), &hints, &res) == 0 && res,
           "NCCL bootstrap: cannot resolve MASTER_ADDR=", addr);
  while (true) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      size_t got = 0;
      while (got < sizeof *id) {
        const ssize_t n = ::recv(fd, reinterpret_cast<char*>(id) + got, sizeof *id - got, 0);
        if (n <= 0) break;
        got += static_cast<size_t>(n);
      }
      ::close(fd);
      ::freeaddrinfo(res);
      MF_CHECK(got == sizeof *id, "NCCL bootstrap: short read of the id from ", addr, ":", port);
      return;
    }
    if (fd >= 0) ::close(fd);
    if (Clock::now() > deadline) {
      ::freeaddrinfo(res);
      MF_FAIL("NCCL bootstrap: rank ", rank, " could not reach MASTER_ADDR=", addr, " MASTER_PORT=", port, " in ",
              timeout_s, " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Communicator> make_nccl_world(Communicator* bootstrap, double timeout_s) {
  MF_CHECK(timeout_s > 0, "make_nccl_world: timeout_s ", timeout_s);
  const int devices = cuda_device_count();
  if (devices == 0) MF_FAIL("NCCL: no GPU visible to this process");
  cuda_set_device(local_rank_from_env() % devices);
  int rank = 0, world = 1;
  ncclUniqueId id{};
  if (bootstrap) {
    rank = bootstrap->rank();
    world = bootstrap->size();
    if (rank == 0) MF_NCCL(ncclGetUniqueId(&id));
    std::vector<int64_t> words((sizeof id + 7) / 8, 0);
    std::memcpy(words.data(), &id, sizeof id);
    bootstrap->broadcast(Tensor(words.data(), DType::i64, {static_cast<int64_t>(words.size())}), 0);
    std::memcpy(&id, words.data(), sizeof id);
  } else {
    MF_CHECK(env("RANK") && env("WORLD_SIZE"), "NCCL bootstrap: RANK and WORLD_SIZE must be set (torchrun, Slurm)");
    rank = env_int("RANK", -1);
    world = env_int("WORLD_SIZE", -1);
    MF_CHECK(world >= 1 && rank >= 0 && rank < world, "NCCL bootstrap: RANK=", rank, " WORLD_SIZE=", world);
    if (rank == 0) MF_NCCL(ncclGetUniqueId(&id));
    if (world > 1) rendezvous(&id, rank, world, timeout_s);
  }
  ncclComm_t comm = nullptr;
  MF_NCCL(ncclCommInitRank(&comm, world, id, rank));
  return std::make_unique<NcclCommunicator>(comm, "world", timeout_s, rank);
}

#else  // CPU-only build

bool nccl_built() { return false; }
std::unique_ptr<Communicator> make_nccl_world(Communicator*, double) {
  MF_FAIL("this moefold was built without CUDA/NCCL (no nvcc at build time)");
}

#endif

}  // namespace moefold
