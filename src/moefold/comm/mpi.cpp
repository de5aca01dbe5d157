// MPI backend of Communicator. Every operation is started non-blocking and polled with MPI_Test
// against a deadline (DeepEP's timeout_while): past timeout_s the rank prints one line naming
// itself, the operation, the group and the peer, and aborts the whole job with exit code 3.
#include "moefold/comm/mpi.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "moefold/comm/comm_checks.h"

namespace moefold {
namespace {

bool g_we_initialized = false;  // this process called MPI_Init_thread (so it finalizes)

// Used on error paths, so its calls are deliberately unchecked (no recursion into the checks).
int world_rank_or_minus_one() {
  int init = 0, fin = 0, r = -1;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

[[noreturn]] void mpi_failed(const char* stmt, const char* func, const char* file, int line, int rc) {
  char msg[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) std::snprintf(msg, sizeof msg, "error code %d", rc);
  std::fprintf(stderr, "moefold: rank %d: MPI error: %s failed in %s (%s:%d): %s\n", world_rank_or_minus_one(), stmt,
               func, file, line, msg);
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::_Exit(2);
}

}  // namespace
}  // namespace moefold

// Every MPI call goes through this: on failure it names statement, function, file, line, rank.
#define MF_MPI_CHECK(stmt)                                                                                 \
  do {                                                                                                     \
    const int mf_mpi_rc_ = (stmt);                                                                         \
    if (mf_mpi_rc_ != MPI_SUCCESS) ::moefold::mpi_failed(#stmt, __func__, __FILE__, __LINE__, mf_mpi_rc_); \
  } while (0)

namespace moefold {
namespace {

using comm_detail::check_buffer;
using comm_detail::row_elems;

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::f32:
      return MPI_FLOAT;
    case DType::f64:
      return MPI_DOUBLE;
    case DType::i32:
      return MPI_INT32_T;
    case DType::i64:
      return MPI_INT64_T;
    case DType::u8:
      return MPI_UINT8_T;
    default:
      break;
  }
  MF_CHECK(false, "no MPI datatype for ", dtype_name(t));
  return MPI_DATATYPE_NULL;
}

MPI_Op mpi_op(ReduceOp op) { return op == ReduceOp::sum ? MPI_SUM : MPI_MAX; }

// Who waits on what: everything the timeout message names.
struct WaitSite {
  const char* op;
  const std::string& group;
  int rank, size;  // in the group
  int peer;        // -1: none
  double timeout_s;
};

// Liveness: naming the rank that was lost. While a rank waits in wait_or_abort it answers every
// other rank's "are you there?" (on a private duplicate of MPI_COMM_WORLD); a wait near its
// deadline asks every rank, and at the deadline the ranks that have not answered are named: they
// died or hang. Ranks doing work answer when they next wait. Calls here ignore MPI's error codes
// on purpose: a dead peer may make them fail, which only means no answer.
class Liveness {
 public:
  bool active() const { return comm_ != MPI_COMM_NULL; }
  // Collective over MPI_COMM_WORLD (once, from make_mpi_world).
  void start(MPI_Comm world, int rank, int size) {
    if (active()) return;
    MF_MPI_CHECK(MPI_Comm_dup(world, &comm_));
    MF_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    rank_ = rank;
    size_ = size;
    replies_.assign(static_cast<size_t>(size), MPI_REQUEST_NULL);
    reply_buf_.assign(static_cast<size_t>(size), 0);
    answer_buf_.assign(static_cast<size_t>(size), 0);
    answered_.assign(static_cast<size_t>(size), 0);
    post_incoming();
  }
  // Answers the questions that have arrived.
  void serve() {
    if (!active()) return;
    for (;;) {
      int flag = 0;
      MPI_Status st;
      if (MPI_Test(&incoming_, &flag, &st) != MPI_SUCCESS || !flag) return;
      int& echo = answer_buf_[static_cast<size_t>(st.MPI_SOURCE)];
      echo = incoming_buf_;  // the asker's round
      MPI_Request r;
      if (MPI_Isend(&echo, 1, MPI_INT, st.MPI_SOURCE, kAnswer, comm_, &r) == MPI_SUCCESS) MPI_Request_free(&r);
      post_incoming();
    }
  }
  // Asks every other rank (a new round; answers to an earlier one do not count).
  void ask() {
    if (!active() || asking_) return;
    asking_ = true;
    ++round_;
    std::fill(answered_.begin(), answered_.end(), 0);
    answered_[static_cast<size_t>(rank_)] = 1;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      MPI_Request r;
      if (MPI_Isend(&round_, 1, MPI_INT, p, kAsk, comm_, &r) == MPI_SUCCESS) MPI_Request_free(&r);
      if (replies_[static_cast<size_t>(p)] == MPI_REQUEST_NULL) post_reply(p);
    }
  }
  // Collects the answers that have arrived.
  void collect() {
    if (!asking_) return;
    for (int p = 0; p < size_; ++p) {
      MPI_Request& r = replies_[static_cast<size_t>(p)];
      if (r == MPI_REQUEST_NULL) continue;
      int flag = 0;
      if (MPI_Test(&r, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || !flag) continue;
      if (reply_buf_[static_cast<size_t>(p)] == round_) {
        answered_[static_cast<size_t>(p)] = 1;
      } else {
        post_reply(p);  // a late answer to an earlier round
      }
    }
  }
  // The round is over (the wait ended): the receives of answers still missing stay posted for
  // the next round, which ignores what they bring from this one.
  void end_round() { asking_ = false; }
  // The world ranks that have not answered this round, as text ("" when all have).
  std::string silent() const {
    std::string out;
    int n = 0;
    for (int p = 0; p < size_; ++p) {
      if (answered_[static_cast<size_t>(p)]) continue;
      if (++n <= 8) out += (out.empty() ? "" : ", ") + std::to_string(p);
    }
    if (n > 8) out += ", and " + std::to_string(n - 8) + " more";
    return out;
  }
  bool asking() const { return asking_; }
  void stop() {
    if (!active()) return;
    auto cancel = [](MPI_Request& r) {
      if (r == MPI_REQUEST_NULL) return;
      MPI_Cancel(&r);
      MPI_Wait(&r, MPI_STATUS_IGNORE);
    };
    cancel(incoming_);
    for (MPI_Request& r : replies_) cancel(r);
    MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

 private:
  static constexpr int kAsk = 1, kAnswer = 2;
  void post_incoming() {
    if (MPI_Irecv(&incoming_buf_, 1, MPI_INT, MPI_ANY_SOURCE, kAsk, comm_, &incoming_) != MPI_SUCCESS)
      incoming_ = MPI_REQUEST_NULL;
  }
  void post_reply(int p) {
    MPI_Request& r = replies_[static_cast<size_t>(p)];
    if (MPI_Irecv(&reply_buf_[static_cast<size_t>(p)], 1, MPI_INT, p, kAnswer, comm_, &r) != MPI_SUCCESS)
      r = MPI_REQUEST_NULL;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  MPI_Request incoming_ = MPI_REQUEST_NULL;
  int incoming_buf_ = 0;
  std::vector<int> answer_buf_;  // by asker
  int round_ = 0;
  bool asking_ = false;
  std::vector<MPI_Request> replies_;
  std::vector<int> reply_buf_;
  std::vector<char> answered_;
};

Liveness g_liveness;

}  // namespace

void liveness_poll(double seconds_left, double timeout_s) {
  g_liveness.serve();
  if (seconds_left < std::min(5.0, timeout_s / 4)) {
    g_liveness.ask();
    g_liveness.collect();
  }
}

void liveness_end_wait() { g_liveness.end_round(); }

std::string liveness_verdict() {
  if (!g_liveness.asking()) return "";
  g_liveness.collect();
  const std::string silent = g_liveness.silent();
  if (silent.empty()) return "; every rank answers (do they wait in different operations?)";
  if (silent.find(',') == std::string::npos)
    return "; world rank " + silent + " does not answer (lost: died or hangs?)";
  return "; world ranks " + silent + " do not answer (lost: died or hang?)";
}

namespace {

[[noreturn]] void timed_out(const WaitSite& w) {
  char peer_txt[32] = "";
  if (w.peer >= 0) std::snprintf(peer_txt, sizeof peer_txt, ", peer %d", w.peer);
  std::fprintf(stderr, "moefold: rank %d: timeout after %gs in %s on group '%s' (rank %d of %d%s)%s\n",
               world_rank_or_minus_one(), w.timeout_s, w.op, w.group.c_str(), w.rank, w.size, peer_txt,
               liveness_verdict().c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 3);
  std::_Exit(3);
}

// Polls `req` until done, answering the liveness questions of other ranks meanwhile (and asking
// them near the deadline, liveness_poll); past the deadline prints the one-line diagnosis, with
// the ranks that did not answer, and aborts the job.
MPI_Status wait_or_abort(MPI_Request* req, const WaitSite& site) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration<double>(site.timeout_s);
  // Spin briefly (latency of small collectives), then back off to sleeping up to 1 ms so that
  // oversubscribed ranks (8 ranks on 2 cores in CI) leave the cores to the ranks doing work.
  auto nap = std::chrono::microseconds(0);
  MPI_Status st;
  for (int polls = 0;; ++polls) {
    int done = 0;
    MF_MPI_CHECK(MPI_Test(req, &done, &st));
    if (done) {
      liveness_end_wait();
      return st;
    }
    const double left = std::chrono::duration<double>(deadline - Clock::now()).count();
    if (left < 0) timed_out(site);
    if (polls < 64) {
      std::this_thread::yield();
    } else {
      liveness_poll(left, site.timeout_s);
      nap = std::min(std::chrono::microseconds(1000), nap + std::chrono::microseconds(20));
      std::this_thread::sleep_for(nap);
    }
  }
}

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed on destruction unless MPI is finalized by then).
  MpiCommunicator(MPI_Comm comm, std::string name, double timeout_s)
      : comm_(comm), name_(std::move(name)), timeout_s_(timeout_s) {
    MF_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    MF_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    MF_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_));
  }
  ~MpiCommunicator() override {
    int fin = 0;
    MF_MPI_CHECK(MPI_Finalized(&fin));
    if (!fin) MF_MPI_CHECK(MPI_Comm_free(&comm_));
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank() const override { return world_rank_; }
  const std::string& name() const override { return name_; }
  double timeout_s() const override { return timeout_s_; }

  void all_reduce(const Tensor& buf, ReduceOp op) override {
    check_buffer(buf, "all_reduce", "buf");
    const int n = to_int_count(buf.numel(), "all_reduce", "buf");
    MPI_Request req;
    MF_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buf.data(), n, mpi_type(buf.dtype()), mpi_op(op), comm_, &req));
    wait(&req, "all_reduce");
  }

  void all_gather(const Tensor& send, const Tensor& recv) override {
    comm_detail::check_all_gather(send, recv, size_);
    const int n = to_int_count(send.numel(), "all_gather", "send");
    to_int_count(recv.numel(), "all_gather", "recv");
    const MPI_Datatype t = mpi_type(send.dtype());
    MPI_Request req;
    MF_MPI_CHECK(MPI_Iallgather(send.data(), n, t, recv.data(), n, t, comm_, &req));
    wait(&req, "all_gather");
  }

  void reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op) override {
    comm_detail::check_reduce_scatter(send, recv, size_);
    to_int_count(send.numel(), "reduce_scatter", "send");
    const int n = to_int_count(recv.numel(), "reduce_scatter", "recv");
    MPI_Request req;
    MF_MPI_CHECK(
        MPI_Ireduce_scatter_block(send.data(), recv.data(), n, mpi_type(send.dtype()), mpi_op(op), comm_, &req));
    wait(&req, "reduce_scatter");
  }

  void all_to_all_v(const Tensor& send, const int64_t* send_counts, const Tensor& recv,
                    const int64_t* recv_counts) override {
    comm_detail::check_all_to_all_v(send, send_counts, recv, recv_counts, size_);
    const int64_t row = row_elems(send);
    // Rows -> elements; displacements are prefix sums. All must fit MPI's int.
    std::vector<int> scount(size_), sdispl(size_), rcount(size_), rdispl(size_);
    int64_t soff = 0, roff = 0;
    for (int p = 0; p < size_; ++p) {
      sdispl[p] = to_int_count(soff, "all_to_all_v", "send displacement");
      rdispl[p] = to_int_count(roff, "all_to_all_v", "recv displacement");
      scount[p] = to_int_count(send_counts[p] * row, "all_to_all_v", "send count");
      rcount[p] = to_int_count(recv_counts[p] * row, "all_to_all_v", "recv count");
      soff += send_counts[p] * row;
      roff += recv_counts[p] * row;
    }
    const MPI_Datatype t = mpi_type(send.dtype());
    MPI_Request req;
    MF_MPI_CHECK(MPI_Ialltoallv(send.data(), scount.data(), sdispl.data(), t, recv.data(), rcount.data(), rdispl.data(),
                                t, comm_, &req));
    wait(&req, "all_to_all_v");  // the count arrays must outlive the request
  }

  void all_to_all(const Tensor& send, const Tensor& recv) override {
    comm_detail::check_all_to_all(send, recv, size_);
    const int n = to_int_count(send.numel() / size_, "all_to_all", "block");
    to_int_count(send.numel(), "all_to_all", "send");
    const MPI_Datatype t = mpi_type(send.dtype());
    MPI_Request req;
    MF_MPI_CHECK(MPI_Ialltoall(send.data(), n, t, recv.data(), n, t, comm_, &req));
    wait(&req, "all_to_all");
  }

  void broadcast(const Tensor& buf, int root) override {
    check_buffer(buf, "broadcast", "buf");
    MF_CHECK(0 <= root && root < size_, "broadcast on group '", name_, "' of ", size_, " ranks from root ", root);
    const int n = to_int_count(buf.numel(), "broadcast", "buf");
    MPI_Request req;
    MF_MPI_CHECK(MPI_Ibcast(buf.data(), n, mpi_type(buf.dtype()), root, comm_, &req));
    wait(&req, "broadcast", root);
  }

  void send(const Tensor& buf, int peer, int tag) override {
    check_p2p(buf, peer, tag, "send");
    const int n = to_int_count(buf.numel(), "send", "buf");
    MPI_Request req;
    MF_MPI_CHECK(MPI_Isend(buf.data(), n, mpi_type(buf.dtype()), peer, tag, comm_, &req));
    wait(&req, "send", peer);
  }

  void recv(const Tensor& buf, int peer, int tag) override {
    check_p2p(buf, peer, tag, "recv");
    const int n = to_int_count(buf.numel(), "recv", "buf");
    MPI_Request req;
    MF_MPI_CHECK(MPI_Irecv(buf.data(), n, mpi_type(buf.dtype()), peer, tag, comm_, &req));
    MPI_Status st = wait(&req, "recv", peer);
    int got = 0;
    MF_MPI_CHECK(MPI_Get_count(&st, mpi_type(buf.dtype()), &got));
    MF_CHECK(got == n, "recv on group '", name_, "' from peer ", peer, ": got ", got, " elements, expected ", n, " (",
             buf.str(), ")");
  }

  int64_t start_send(const Tensor& buf, int peer) override { return start_p2p(buf, peer, true); }
  int64_t start_recv(const Tensor& buf, int peer) override { return start_p2p(buf, peer, false); }

  // The collectives finish before they return (ticket 0); a point-to-point ticket waits for its
  // message (any other ticket: nothing to wait for).
  void wait(int64_t ticket) override {
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (pending_[i].ticket != ticket) continue;
      Pending p = pending_[i];
      pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
      const MPI_Status st = wait(&p.req, p.send ? "send" : "recv", p.peer);
      if (!p.send) {
        int got = 0;
        MF_MPI_CHECK(MPI_Get_count(&st, mpi_type(p.dtype), &got));
        MF_CHECK(got == p.elems, "recv on group '", name_, "' from peer ", p.peer, ": got ", got,
                 " elements, expected ", p.elems);
      }
      return;
    }
  }

  void barrier() override {
    MPI_Request req;
    MF_MPI_CHECK(MPI_Ibarrier(comm_, &req));
    wait(&req, "barrier");
  }

  // Host blocks: no process maps another's memory; the copies travel as messages.
  std::unique_ptr<PeerMemory> map_peer_memory(void* block, size_t bytes) override {
    return make_message_peer_memory(*this, block, bytes);
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    MF_CHECK(color >= 0, "split of group '", name_, "' into '", name, "': color ", color, " < 0");
    // MPI_Comm_split blocks and has no non-blocking form in MPI 3.1; a barrier with a deadline
    // first makes sure every rank has arrived, so the split itself cannot hang.
    MPI_Request req;
    MF_MPI_CHECK(MPI_Ibarrier(comm_, &req));
    wait(&req, "split");
    MPI_Comm sub = MPI_COMM_NULL;
    MF_MPI_CHECK(MPI_Comm_split(comm_, color, key, &sub));
    return std::make_unique<MpiCommunicator>(sub, name, timeout_s_);
  }

 private:
  void check_p2p(const Tensor& buf, int peer, int tag, const char* op) const {
    check_buffer(buf, op, "buf");
    MF_CHECK(0 <= peer && peer < size_ && peer != rank_, op, " on group '", name_, "' (rank ", rank_, " of ", size_,
             "): bad peer ", peer);
    MF_CHECK(tag >= 0 && tag <= 32767, op, " on group '", name_, "': tag ", tag, " outside [0, 32767]");
  }

  int64_t start_p2p(const Tensor& buf, int peer, bool send) {
    const char* op = send ? "start_send" : "start_recv";
    check_p2p(buf, peer, kP2pTag, op);
    const int n = to_int_count(buf.numel(), op, "buf");
    Pending p{next_ticket_++, {}, peer, n, buf.dtype(), send};
    if (send)
      MF_MPI_CHECK(MPI_Isend(buf.data(), n, mpi_type(buf.dtype()), peer, kP2pTag, comm_, &p.req));
    else
      MF_MPI_CHECK(MPI_Irecv(buf.data(), n, mpi_type(buf.dtype()), peer, kP2pTag, comm_, &p.req));
    pending_.push_back(p);
    return p.ticket;
  }

  MPI_Status wait(MPI_Request* req, const char* op, int peer = -1) const {
    return wait_or_abort(req, {op, name_, rank_, size_, peer, timeout_s_});
  }

  // Open MPI 4.1 implements MPI 3.1: counts and displacements are int (the MPI 4.0 `_c`
  // large-count calls are absent), so a count past INT_MAX elements must stop here, not wrap.
  int to_int_count(int64_t elems, const char* op, const char* what) const {
    MF_CHECK(elems >= 0 && elems <= INT_MAX, "rank ", world_rank_, ": ", op, " on group '", name_, "': ", what, " of ",
             elems, " elements exceeds MPI's int count limit (INT_MAX); split the transfer");
    return static_cast<int>(elems);
  }

  MPI_Comm comm_;
  std::string name_;
  double timeout_s_;
  int rank_ = 0, size_ = 1, world_rank_ = 0;
  // start_send / start_recv not yet waited for (tickets from 1: the collectives' are 0).
  static constexpr int kP2pTag = 17;
  struct Pending {
    int64_t ticket;
    MPI_Request req;
    int peer, elems;
    DType dtype;
    bool send;
  };
  std::vector<Pending> pending_;
  int64_t next_ticket_ = 1;
};

}  // namespace

bool launched_by_mpi() {
  auto has = [](const char* v) { return std::getenv(v) != nullptr; };
  if (has("OMPI_COMM_WORLD_SIZE") || has("PMI_SIZE") || has("PMIX_RANK")) return true;
  // A Slurm batch script also has SLURM_NTASKS/SLURM_PROCID; only srun starts a job step.
  return has("SLURM_NTASKS") && has("SLURM_PROCID") && (has("SLURM_STEP_ID") || has("SLURM_STEPID"));
}

std::unique_ptr<Communicator> make_mpi_world(double timeout_s) {
  MF_CHECK(timeout_s > 0, "make_mpi_world: timeout_s ", timeout_s, " <= 0");
  int init = 0, fin = 0;
  MF_MPI_CHECK(MPI_Initialized(&init));
  MF_MPI_CHECK(MPI_Finalized(&fin));
  MF_CHECK(!fin, "make_mpi_world after mpi_finalize");
  if (!init) {
    int provided = 0;
    MF_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
    g_we_initialized = true;
    // Errors come back as codes to MF_MPI_CHECK (which names the call) instead of MPI's default
    // abort without context. Communicators created below inherit this handler.
    MF_MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
    MF_CHECK(provided >= MPI_THREAD_FUNNELED, "MPI provides thread level ", provided, " < MPI_THREAD_FUNNELED");
  }
  // A private message space for moefold; non-blocking so that a rank that never arrives times out.
  MPI_Comm dup = MPI_COMM_NULL;
  MPI_Request req;
  MF_MPI_CHECK(MPI_Comm_idup(MPI_COMM_WORLD, &dup, &req));
  int world_rank = 0, world_size = 1;
  MF_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  MF_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  const std::string group = "world";
  wait_or_abort(&req, {"make_mpi_world", group, world_rank, world_size, -1, timeout_s});
  MF_MPI_CHECK(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
  g_liveness.start(MPI_COMM_WORLD, world_rank, world_size);
  return std::make_unique<MpiCommunicator>(dup, "world", timeout_s);
}

void mpi_finalize() {
  int init = 0, fin = 0;
  MF_MPI_CHECK(MPI_Initialized(&init));
  MF_MPI_CHECK(MPI_Finalized(&fin));
  if (init && !fin && g_we_initialized) {
    g_liveness.stop();
    MF_MPI_CHECK(MPI_Finalize());
  }
}

}  // namespace moefold
